"""The GEMM ceiling of the FP8 GroupedLinear (its target: 1.3x faster than bf16 at 8 experts),
GPU only.

At bench_grouped's shape (8 experts, 32768 tokens in its uneven splits, 4096 -> 2048) this
times each of the three GEMMs of a training step alone, bf16 (``torch._grouped_mm``) against
FP8 E4M3 (``torch._scaled_grouped_mm``, rowwise scales, fast and promoted accumulation), plus
the forward GEMM through Inductor's max-autotune (does a Triton template beat the CUTLASS
kernel?), and a bf16 copy of the input (the bandwidth the FP8 casts can reach). From these it
prints the best speedup an FP8 step can have: bf16 GEMMs / (FP8 GEMMs + the least bytes the
casts must move at copy bandwidth), for each choice of accumulation and wgrad precision.

    python -m bench.diag.diag_grouped_gemm
    python -m bench.diag.diag_grouped_gemm --experts 64 --in 4096 --out 2816  # moe_layer's fc1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from triton.testing import do_bench

from bench.bench_grouped import FP8_EXPERTS, IN_FEATURES, OUT_FEATURES, TOKENS, make_splits

E4M3 = torch.float8_e4m3fn


def _time(fn) -> float:
    """Median microseconds per call (L2 flushed between calls)."""
    return do_bench(fn, warmup=100, rep=500, return_mode="median") * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=FP8_EXPERTS)
    p.add_argument("--tokens", type=int, default=TOKENS, help="rows over all experts")
    p.add_argument("--in", dest="k", type=int, default=IN_FEATURES)
    p.add_argument("--out", dest="n", type=int, default=OUT_FEATURES)
    p.add_argument("--no-autotune", action="store_true", help="skip Inductor's max-autotune row")
    args = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    g, m, k, n = args.experts, args.tokens, args.k, args.n
    print(f"{g} experts, {m} rows in uneven splits, {k} -> {n}")
    splits = torch.tensor(make_splits(m, g, 0), device="cuda")
    ends = splits.cumsum(0).to(torch.int32)
    pad_ends = ((splits + 15) // 16 * 16).cumsum(0).to(torch.int32)
    mp = (m + 15 * g + 15) // 16 * 16
    bf16 = torch.bfloat16
    x, dy = (
        torch.randn(m, k, device="cuda", dtype=bf16),
        torch.randn(m, n, device="cuda", dtype=bf16),
    )
    w = torch.randn(g, n, k, device="cuda", dtype=bf16)
    xq, dyq = x.to(E4M3), dy.to(E4M3)
    wq, wq_t = w.to(E4M3), w.transpose(1, 2).contiguous().to(E4M3)  # [G, N, K], [G, K, N]
    dyt = torch.randn(n, mp, device="cuda").to(E4M3)
    xt = torch.randn(k, mp, device="cuda").to(E4M3)
    sx, sdy = torch.rand(m, device="cuda"), torch.rand(m, device="cuda")
    sw, sw_t = torch.rand(g, n, device="cuda"), torch.rand(g, k, device="cuda")
    sdyt, sxt = torch.rand(g * n, device="cuda"), torch.rand(g * k, device="cuda")
    flops = 2 * m * n * k

    def sgmm(a, b, sa, sb, offs, fast):
        return torch._scaled_grouped_mm(
            a, b, sa, sb, offs=offs, out_dtype=bf16, use_fast_accum=fast
        )

    bf16_t = {
        "fprop": _time(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)),
        "dgrad": _time(lambda: torch._grouped_mm(dy, w, offs=ends)),
        "wgrad": _time(lambda: torch._grouped_mm(dy.t(), x, offs=ends)),
    }
    fp8_t = {}
    for fast in (True, False):
        fp8_t["fprop", fast] = _time(lambda f=fast: sgmm(xq, wq.transpose(-2, -1), sx, sw, ends, f))
        fp8_t["dgrad", fast] = _time(
            lambda f=fast: sgmm(dyq, wq_t.transpose(-2, -1), sdy, sw_t, ends, f)
        )
        fp8_t["wgrad", fast] = _time(lambda f=fast: sgmm(dyt, xt.t(), sdyt, sxt, pad_ends, f))
    print("GEMM alone (us, TFLOP/s)")
    for name, t in bf16_t.items():
        print(f"  bf16 {name}                         {t:8.1f}  {flops / t / 1e6:7.1f}")
    for (name, fast), t in fp8_t.items():
        print(f"  fp8 {name} fast_accum={fast!s:5s}        {t:8.1f}  {flops / t / 1e6:7.1f}")

    # Inductor's own choice for the forward GEMM (Triton templates vs the ATen kernel).
    try:
        if args.no_autotune:
            raise RuntimeError("skipped (--no-autotune)")
        auto = torch.compile(sgmm, mode="max-autotune-no-cudagraphs", dynamic=False)
        auto(xq, wq.transpose(-2, -1), sx, sw, ends, True)
        t = _time(lambda: auto(xq, wq.transpose(-2, -1), sx, sw, ends, True))
        print(f"  fp8 fprop, inductor max-autotune   {t:8.1f}  {flops / t / 1e6:7.1f}")
    except Exception as exc:  # what we want to know
        print(f"  fp8 fprop, inductor max-autotune raised {type(exc).__name__}: {str(exc)[:200]}")

    out = torch.empty_like(x)
    t_copy = _time(lambda: out.copy_(x))
    bw = 2 * x.numel() * 2 / t_copy / 1e6  # TB/s (read + write)
    print(f"copy of x (bf16 {m}x{k}): {t_copy:.1f} us, {bw:.2f} TB/s")

    # The least bytes the casts move (current scaling, every cast fused to read its input once):
    # x -> rowwise + per-group-column copies, W -> rowwise + transposed copies, dY likewise;
    # with the bf16 wgrad x and dY need only their rowwise copies.
    def cast_us(fp8_wgrad: bool) -> float:
        copies = 2 if fp8_wgrad else 1
        nbytes = (2 + copies) * (x.numel() + dy.numel()) + (2 + 2) * w.numel()
        return nbytes / bw / 1e6

    base = sum(bf16_t.values())
    print(f"bound on the speedup, bf16 GEMMs {base:.1f} us / (FP8 GEMMs + casts at copy speed)")
    for fast_bwd in (False, True):
        for fp8_wgrad in (True, False):
            gemms = fp8_t["fprop", True] + fp8_t["dgrad", fast_bwd]
            gemms += fp8_t["wgrad", fast_bwd] if fp8_wgrad else bf16_t["wgrad"]
            casts = cast_us(fp8_wgrad)
            print(
                f"  dgrad/wgrad fast_accum={fast_bwd!s:5s} "
                f"wgrad {'fp8 ' if fp8_wgrad else 'bf16'}: "
                f"GEMMs {gemms:7.1f} + casts {casts:6.1f} us -> {base / (gemms + casts):.3f}x "
                f"(GEMMs alone {base / gemms:.3f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
