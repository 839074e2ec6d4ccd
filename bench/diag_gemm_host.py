"""Host time of one FP8 GEMM call, by scaling kind (GPU only; a diagnostic, not a benchmark).

bench_fp8's block row spends ~1.4 ms per step outside its kernels against ~0.6 ms for bf16
(H100, 2026-11-22). This times the host side of each ``torch._scaled_mm`` flavour the FP8 MLP
uses, with the GPU held busy (a ``torch.cuda._sleep`` queued first: the host never waits), and
whether the blockwise GEMM with a bias raises (``functional.gemm.block_scaled_mm`` then falls
back to an fp32 output plus a separate bias add).

    python -m bench.diag_gemm_host
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.diag_host import _host_ms
from te_compile.functional.gemm import block_scaled_mm

E4M3 = torch.float8_e4m3fn


def _host_us(fn, n: int = 20) -> float:
    fn()  # warm: the first call picks cuBLAS's algorithm
    return _host_ms(fn, n) * 1e3


def main() -> int:
    t, d, f = 16384, 4096, 16384
    bf16 = torch.bfloat16
    x = (torch.randn(t, d, device="cuda") * 50).to(E4M3)
    w = (torch.randn(f, d, device="cuda") * 50).to(E4M3)
    sx = torch.rand(t, d // 128, device="cuda") + 0.5
    sw = torch.rand(f // 128, d // 128, device="cuda") + 0.5
    one = torch.ones(1, device="cuda")
    bias = torch.randn(f, device="cuda", dtype=bf16)
    try:
        torch._scaled_mm(x, w.t(), sx.t().contiguous().t(), sw.t(), bias=bias, out_dtype=bf16)
        print("blockwise _scaled_mm with a bias: accepted")
    except RuntimeError as e:
        print(f"blockwise _scaled_mm with a bias: raises ({str(e).splitlines()[0][:120]})")
    rows = {
        "tensorwise _scaled_mm": lambda: torch._scaled_mm(x, w.t(), one, one, out_dtype=bf16),
        "tensorwise _scaled_mm + bias": lambda: torch._scaled_mm(
            x, w.t(), one, one, bias=bias, out_dtype=bf16
        ),
        "blockwise block_scaled_mm": lambda: block_scaled_mm(x, sx, w, sw, 128, bf16),
        "blockwise block_scaled_mm + bias": lambda: block_scaled_mm(x, sx, w, sw, 128, bf16, bias),
        "blockwise 1x128 x 1x128 (wgrad)": lambda: block_scaled_mm(
            x[:d], sx[:d], w[:, :], sx[:f], 1, bf16
        ),
    }
    for name, fn in rows.items():
        print(f"  {name:40s} host {_host_us(fn):8.1f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
