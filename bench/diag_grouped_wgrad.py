"""What torch's grouped FP8 GEMM does with the grouped wgrad (offsets along the contraction
dim, "2d x 2d"), GPU only; a diagnostic for the FP8 GroupedLinear wgrad.

Checks, for ``torch._scaled_grouped_mm(a [N, M], b [M, K] column-major, scale_a [G*N],
scale_b [G*K], offs)`` with E4M3 operands:

* group offsets that are not multiples of 16: a device-side assertion (not run any more);
* an empty group (is its output written as zeros?);
* ``use_fast_accum=False`` (the promoted accumulation of a gradient GEMM);

and times, at bench_grouped's shape (8 experts, 32768 tokens, 4096 -> 2048), the bf16 grouped
wgrad ``torch._grouped_mm(dY^T, X, offs)`` against the FP8 one (16-aligned offsets).

    python -m bench.diag_grouped_wgrad
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from triton.testing import do_bench

E4M3 = torch.float8_e4m3fn


def _reference(a, b, sa, sb, ends):
    """fp32 per-group ``(a_g @ b_g) * sa_g[:, None] * sb_g[None, :]``."""
    outs, start = [], 0
    g_n, g_k = sa.numel() // len(ends), sb.numel() // len(ends)
    for g, end in enumerate(ends):
        acc = a[:, start:end].float() @ b[start:end].float()
        outs.append(acc * sa[g * g_n : (g + 1) * g_n, None] * sb[None, g * g_k : (g + 1) * g_k])
        start = end
    return torch.stack(outs)


def _check(name: str, splits: list[int], fast: bool, n: int = 64, k: int = 128) -> None:
    m = sum(splits)
    g = len(splits)
    a = (torch.randn(n, m, device="cuda") * 4).to(E4M3)
    b = (torch.randn(k, m, device="cuda") * 4).to(E4M3).t()  # [M, K] column-major
    sa = torch.rand(g * n, device="cuda") + 0.5
    sb = torch.rand(g * k, device="cuda") + 0.5
    ends = torch.tensor(splits, device="cuda").cumsum(0).to(torch.int32)
    try:
        out = torch._scaled_grouped_mm(
            a, b, sa, sb, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=fast
        )
    except Exception as exc:  # what we want to know
        print(f"  {name:44s} raised {type(exc).__name__}: {str(exc)[:160]}")
        return
    ref = _reference(a, b, sa, sb, ends.tolist())
    err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    empty = [i for i, s in enumerate(splits) if s == 0]
    zeros = all(bool((out[i] == 0).all()) for i in empty)
    print(f"  {name:44s} ok, max rel err {err:.2e}, empty groups zero: {zeros if empty else '-'}")


def main() -> int:
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("correctness")
    for fast in (True, False):
        _check(f"aligned 16, fast_accum={fast}", [32, 48, 16, 64], fast)
    # Offsets that are not multiples of 16 hit a device-side assertion (H100, torch 2.11,
    # 2026-11-23: "expected input tensor dynamic dimension byte size to be non-negative
    # multiple of 16"), which kills the CUDA context: not run here.
    _check("empty group (aligned)", [32, 0, 48, 16], False)
    # Poison the output memory first so that unwritten results show.
    junk = torch.full((1 << 26,), float("nan"), device="cuda")
    del junk
    _check("empty group after NaN-filled memory", [32, 0, 48, 16], False)

    print("timing, 8 experts, 32768 tokens, 4096 -> 2048 (wgrad: [G, 2048, 4096])")
    torch.manual_seed(0)
    g, k, n = 8, 4096, 2048
    w = torch.rand(g, device="cuda") + 0.2
    splits = (w / w.sum() * 32768).floor().to(torch.int64)
    splits[-1] += 32768 - splits.sum()
    m = 32768
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ends = splits.cumsum(0).to(torch.int32)
    pad = (splits + 15) // 16 * 16
    pad_ends = pad.cumsum(0).to(torch.int32)
    mp = (m + 15 * g + 15) // 16 * 16
    flops = 2 * m * n * k
    ms = do_bench(lambda: torch._grouped_mm(dy.t(), x, offs=ends), warmup=50, rep=300)
    print(f"  bf16 torch._grouped_mm(dY^T, X)            {ms * 1e3:8.1f} us "
          f"{flops / ms / 1e9:7.1f} TFLOP/s")  # fmt: skip
    a = torch.randn(n, mp, device="cuda").to(E4M3)
    b = torch.randn(k, mp, device="cuda").to(E4M3)
    sa = torch.rand(g * n, device="cuda")
    sb = torch.rand(g * k, device="cuda")
    for fast in (True, False):
        ms = do_bench(
            lambda fast=fast: torch._scaled_grouped_mm(
                a, b.t(), sa, sb, offs=pad_ends, out_dtype=torch.bfloat16, use_fast_accum=fast
            ),
            warmup=50,
            rep=300,
        )
        print(f"  fp8 _scaled_grouped_mm fast_accum={fast!s:5s}      {ms * 1e3:8.1f} us "
              f"{flops / ms / 1e9:7.1f} TFLOP/s")  # fmt: skip
    # The forward GEMM for comparison (2d x 3d).
    xq = torch.randn(m, k, device="cuda").to(E4M3)
    wq = torch.randn(g, n, k, device="cuda").to(E4M3)
    sx = torch.rand(m, device="cuda")
    sw = torch.rand(g, n, device="cuda")
    ms = do_bench(
        lambda: torch._scaled_grouped_mm(
            xq, wq.transpose(-2, -1), sx, sw, offs=ends, out_dtype=torch.bfloat16,
            use_fast_accum=True,
        ),
        warmup=50,
        rep=300,
    )  # fmt: skip
    print(f"  fp8 fprop X W^T (2d x 3d)                  {ms * 1e3:8.1f} us "
          f"{flops / ms / 1e9:7.1f} TFLOP/s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
