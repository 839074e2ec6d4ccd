"""Float8BlockScaling's GEMMs of the MLP benchmark, one by one, and the wgrads with the operands
swapped (``dW^T = X^T dY`` then a transpose, instead of ``dW = dY^T X``).

cuBLAS runs the wgrads (1x128 blocks on both operands, along the token dim) with a slower kernel
than fprop / dgrad (H100, 2026-11-22: ~2.05 against ~1.64 ms). This measures whether the other
operand order, or the output transposed, picks a faster one.

    python -m bench.diag_block_gemm
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from triton.testing import do_bench

from te_compile.functional.gemm import block_scaled_mm

E4M3 = torch.float8_e4m3fn


def _operand(rows: int, k: int, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = (torch.randn(rows, k, device="cuda") * 50).to(E4M3)
    shape = (rows, k // 128) if block_rows == 1 else (rows // 128, k // 128)
    return data, torch.rand(shape, device="cuda") + 0.5


def _time(name: str, fn, flops: float) -> None:
    ms = do_bench(fn, warmup=50, rep=300, return_mode="median")
    print(f"  {name:58s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:7.1f} TFLOP/s")


def main() -> int:
    t, d, f = 16384, 4096, 16384
    bf16 = torch.bfloat16
    print(f"Float8BlockScaling GEMMs, T={t}, D={d}, F={f} ({torch.cuda.get_device_name()})")
    x = _operand(t, d, 1)
    w1 = _operand(f, d, 128)
    h = _operand(t, f, 1)
    w1t = _operand(d, f, 128)
    # wgrad operands: transposed copies, 1x128 blocks along the tokens
    dy_t, h_t = _operand(d, t, 1), _operand(f, t, 1)
    dz_t, x_t = _operand(f, t, 1), _operand(d, t, 1)
    fl = 2.0 * t * d * f
    _time("fprop fc1 z = X W1^T", lambda: block_scaled_mm(*x, *w1, 128, bf16), fl)
    _time("dgrad fc1 dX = dz W1", lambda: block_scaled_mm(*h, *w1t, 128, bf16), fl)
    for name, a, b in (("fc2", dy_t, h_t), ("fc1", dz_t, x_t)):
        _time(f"wgrad {name} dW = dY^T X", lambda a=a, b=b: block_scaled_mm(*a, *b, 1, bf16), fl)
        _time(
            f"wgrad {name} dW^T = X^T dY",
            lambda a=a, b=b: block_scaled_mm(*b, *a, 1, bf16),
            fl,
        )
        _time(
            f"wgrad {name} dW^T = X^T dY, then .t().contiguous()",
            lambda a=a, b=b: block_scaled_mm(*b, *a, 1, bf16).t().contiguous(),
            fl,
        )
        _time(
            f"wgrad {name} as fp32 out",
            lambda a=a, b=b: block_scaled_mm(*a, *b, 1, torch.float32),
            fl,
        )
    # per-tensor reference: the same wgrad shape with one scale each
    one = torch.ones(1, device="cuda")
    a, b = dy_t[0], h_t[0]
    _time(
        "per-tensor wgrad fc2 (reference)",
        lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=bf16),
        fl,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
