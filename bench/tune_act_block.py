"""Diagnostic (GPU only, not a benchmark of record): layouts of the one-read fused activation +
Float8BlockScaling 1x128 cast, both layouts from one 128x128 tile, against the two-pass
default of ``kernels.act_quantize.act_quantize_block``.

The one-tile kernel of ``act_quantize_block`` (``block_split=False``) reduces the tile along
both axes in one register layout; the 128x128-block cast of ``kernels.quantize``, which reads
the same tile and writes the same bytes with one amax, runs at ~3.8 TB/s. Variants here:

* ``trans32``: the columnwise blocks cast from ``tl.trans`` of the fp32 tile, so both casts
  reduce along the tile's rows and the transposed copy is stored without a second transpose;
* ``trans16``: the same, the tile transposed as the model's dtype (exact: the values are
  already rounded to it), half the shared-memory traffic.

Each variant is checked byte for byte against the default launch before it is timed.

Measured on the H100 (2026-11-22, ninth session, ``bench/results/2026-11-22_h100/s9/
tune_act_block.log``): both slower than the split default at every warp count (forward 851 us
at best against 648, backward 1167 against 1105): not adopted.

    python -m bench.tune_act_block
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from te_compile.kernels import act_quantize as AQ
from te_compile.kernels import quantize as Q
from te_compile.kernels.activation import FUNCTION_OF
from te_compile.kernels.quantize import (
    _FORMATS,
    _ROUND,
    _abs_bits,
    _bits,
    _cast_1x128,
    _cast_args,
)

E4M3 = torch.float8_e4m3fn
TRITON = Q.QuantizeLaunchConfig(cuda_kernels=False)


@triton.jit
def _variant_kernel(
    Z, B, G, DATA, SCALE_INV, DATA_T, SCALE_INV_T, PART, M, N, fp8_max,
    FN: tl.constexpr, BWD: tl.constexpr, HAS_BIAS: tl.constexpr, DBIAS: tl.constexpr,
    ROUND: tl.constexpr, E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr, GUARD: tl.constexpr, POW2: tl.constexpr, HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    v, x, cols = AQ._tile(
        Z, B, G, G, G, pid_m, pid_n, M, N, FN, BWD, HAS_BIAS, ROUND, SOFTWARE, True, BLOCK, BLOCK
    )  # fmt: skip
    if DBIAS:
        tl.store(PART + pid_m.to(tl.int64) * N + cols, tl.sum(v, axis=0))
    r_in = tl.arange(0, BLOCK)
    c_in = tl.arange(0, BLOCK)
    rows = pid_m * BLOCK + r_in
    q, s = _cast_1x128(x, _abs_bits(x), 1, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
    offs = pid_m.to(tl.int64) * BLOCK * N + pid_n * BLOCK + (r_in[:, None] * N + c_in[None, :])
    tl.store(DATA + offs, q)
    tl.store(SCALE_INV + rows.to(tl.int64) * tl.cdiv(N, BLOCK) + pid_n, s)
    if HALF:  # noqa: SIM108 (a constexpr branch in a Triton kernel)
        xt = tl.trans(x.to(tl.bfloat16)).to(tl.float32)
    else:
        xt = tl.trans(x)
    q_t, s_t = _cast_1x128(xt, _abs_bits(xt), 1, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
    offs_t = pid_n.to(tl.int64) * BLOCK * M + pid_m * BLOCK + (c_in[:, None] * M + r_in[None, :])
    tl.store(DATA_T + offs_t, q_t)
    tl.store(SCALE_INV_T + cols.to(tl.int64) * tl.cdiv(M, BLOCK) + pid_m, s_t)


def variant(z, b, g, half: bool, warps: int):
    m, n = z.shape
    blk = 128
    data = torch.empty((m, n), device=z.device, dtype=E4M3)
    data_t = torch.empty((n, m), device=z.device, dtype=E4M3)
    s = z.new_empty((m, n // blk), dtype=torch.float32)
    s_t = z.new_empty((n, m // blk), dtype=torch.float32)
    part = z.new_empty((m // blk, n), dtype=torch.float32) if g is not None else s
    _variant_kernel[(m // blk, n // blk)](
        z, b, z if g is None else g, _bits(data), s, _bits(data_t), s_t, part, m, n,
        _FORMATS[E4M3].max, FN=FUNCTION_OF["gelu"], BWD=g is not None, HAS_BIAS=True,
        DBIAS=g is not None, ROUND=_ROUND[z.dtype], **_cast_args(E4M3, not z.is_cuda, z.dtype),
        POW2=False, HALF=half, BLOCK=blk, num_warps=warps,
    )  # fmt: skip
    db = part.sum(0).to(b.dtype) if g is not None else None
    return data, s, data_t, s_t, db


def main(m: int = 16384, n: int = 16384, device: str = "cuda", variants: bool = True) -> None:
    torch.manual_seed(0)
    z = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    g = torch.randn_like(z)
    b = torch.randn(n, device=device, dtype=torch.bfloat16)
    numel = m * n
    print(f"tensor [{m}, {n}] bf16, gelu + bias, E4M3 1x128 blocks, both layouts")

    def row(name, fn, nbytes):
        ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
        print(f"  {name:<44} {ms * 1e3:8.0f} us  {nbytes / ms / 1e6:7.0f} GB/s", flush=True)

    for bwd in (False, True):
        grad = g if bwd else None
        what = "bwd + dbias" if bwd else "fwd"
        nbytes = (8 if bwd else 6) * numel

        def ref(grad=grad):
            return AQ.act_quantize_block(
                z, b, grad, "gelu", E4M3, m, grad is not None, False, config=TRITON
            )

        want = ref()
        row(f"{what} split (Triton)", ref, nbytes)
        if Q._cuda_op("act_cast_1x128") is not None:
            cuda_cfg = Q.QuantizeLaunchConfig(cuda_kernels=True)

            def cuda(grad=grad, cfg=cuda_cfg):
                return AQ.act_quantize_block(
                    z, b, grad, "gelu", E4M3, m, grad is not None, False, config=cfg
                )

            got = cuda()
            same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                       for x, y in zip(got[:4], want[:4], strict=True))  # fmt: skip
            print(f"  {what} CUDA (csrc/block_cast.cu): bytes equal to Triton's: {same}")
            row(f"{what} CUDA one read", cuda, nbytes)
        for half, warps in [(h, w) for h in (False, True) for w in (4, 8, 16)] * variants:
            tag = f"{what} {'trans16' if half else 'trans32'} w{warps}"
            got = variant(z, b, grad, half, warps)
            same = all(
                torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                for x, y in zip(got[:4], want[:4], strict=True)
            )
            if bwd:  # column sums over other row tiles: same values, other order
                same &= torch.allclose(got[4].float(), want[4].float(), rtol=1e-2, atol=1e-2)
            if not same:
                print(f"  {tag}: MISMATCH against the default launch")
                continue
            row(tag, lambda half=half, warps=warps, grad=grad: variant(z, b, grad, half, warps),
                nbytes)  # fmt: skip

    if Q._cuda_op("act_cast_1x128") is None:
        return
    # The plain 1x128 cast of an output gradient [m, n / 4] (both layouts), and with its column
    # sums (the bias gradient): Triton (+ torch's sum) against the CUDA kernel's one read.
    dy = z[:, : n // 4]
    nbytes = 4 * dy.numel()
    print(f"tensor [{m}, {n // 4}] bf16, E4M3 1x128 blocks, both layouts (one read: {nbytes} B)")
    cuda_cfg = Q.QuantizeLaunchConfig(cuda_kernels=True)
    dy = dy.contiguous()
    for tag, cfg in (("Triton", TRITON), ("CUDA", cuda_cfg)):
        row(f"cast {tag}", lambda c=cfg: Q.quantize_blockwise(dy, E4M3, 1, False, True, config=c),
            nbytes)  # fmt: skip
        row(f"cast + column sums {tag}",
            lambda c=cfg: Q.quantize_blockwise_sums(dy, E4M3, False, config=c), nbytes)  # fmt: skip
    # A weight [n, n / 4] in 128x128 blocks, both layouts.
    w = dy.t().contiguous()
    print(f"weight [{n // 4}, {m}] bf16, E4M3 128x128 blocks, both layouts")
    for tag, cfg in (("Triton", TRITON), ("CUDA", cuda_cfg)):
        row(f"cast {tag}", lambda c=cfg: Q.quantize_blockwise(w, E4M3, 128, False, True, config=c),
            nbytes)  # fmt: skip


if __name__ == "__main__":
    main(variants="--cuda-only" not in sys.argv)
