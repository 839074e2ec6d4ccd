r"""Triton kernels that quantise an activation, or an activation's gradient, without writing it.

In an FP8 MLP the second GEMM's input is :math:`h = f(z + b)` and the first GEMM's gradient is
:math:`dz = dh \odot f'(z + b)`. Unfused, each is written in high precision by the activation
kernel, read back for its amax (current scaling) and read again by the cast. These kernels
compute :math:`h` (or :math:`dz`) in registers from :math:`z` (and :math:`dh`), round it to the
model's dtype exactly as the activation kernel's store would, and quantise it per tensor:

One kernel, ``_act_quant_kernel``, in two roles: current scaling launches it twice, first for
the amax of the rounded values (and, backward, the fp32 column sums of the unrounded
:math:`dz`: the bias gradient, one row of partial sums per program row, summed afterwards:
deterministic, no atomics), then for the cast, rowwise and transposed from the same registers
(the layouts the forward and backward GEMMs take) with the scale from that amax; delayed
scaling launches it once, with the given scale, folding the amax and the partial sums into the
same pass. Each program walks many row tiles of one column block and does one atomic at the
end (a tile per program made ~65k same-address atomics at 16384 x 16384, and the amax pass ran
at half the copy bandwidth on the H100).

So :math:`h` costs one read of :math:`z` per pass instead of a write and two reads of a
tensor of its size, and the bytes are those of the unfused ops (activation kernel, then
``quantize_current`` / ``quantize_tensorwise``): same activation code (``kernels.activation``),
same rounding, same cast (``kernels.quantize``). Rows ``M <= r < M_OUT`` (the token padding to
a multiple of 16 the FP8 GEMMs need) are written as zeros and do not enter the amax.

Element-wise activations only (no gated ones). The tensors are ``[M, N]`` contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile import kernels
from te_compile.kernels.activation import FUNCTION_OF, GATED, _act, _dact
from te_compile.kernels.quantize import (
    _FORMATS,
    QuantizeLaunchConfig,
    _abs_bits,
    _bits,
    _fp8_args,
    _saturate,
    _scale_from_amax,
    _software,
    _to_bf16_bits,
    _to_fp8_bits,
)

__all__ = ["act_quantize"]

# Rounding of the activation to the model's dtype before the cast.
_ROUND_NONE = 0
_ROUND_BF16 = 1
_ROUND_FP16 = 2
_ROUND = {torch.float32: _ROUND_NONE, torch.bfloat16: _ROUND_BF16, torch.float16: _ROUND_FP16}


@triton.jit
def _round(y, ROUND: tl.constexpr, SOFTWARE: tl.constexpr):
    """``y`` (fp32) rounded to nearest even to bf16 / fp16 and back (exact fp32 values)."""
    if ROUND == 1:
        if SOFTWARE:  # the interpreter truncates fp32 to bf16 (kernels.quantize docstring)
            y = (_to_bf16_bits(y).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = y.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _tile(
    Z, B, G, rows, cols, M, N,
    FN: tl.constexpr, BWD: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUND: tl.constexpr, SOFTWARE: tl.constexpr,
):  # fmt: skip
    """``(v, r, valid)``: the unrounded fp32 activation (or gradient) of the tile, the value
    rounded to the model's dtype, and the mask of real elements; 0 outside it."""
    valid = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    a = tl.load(Z + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if BWD:
        g = tl.load(G + offs, mask=valid, other=0.0).to(tl.float32)
        v = g * _dact(a, FN, 0.0, 0.0)
    else:
        v = _act(a, FN, 0.0, 0.0)
    v = tl.where(valid, v, 0.0)
    return v, _round(v, ROUND, SOFTWARE), valid


@triton.jit
def _act_quant_kernel(
    Z, B, G, SCALE, AMAX_BITS, DATA, DATA_T, SCALE_INV, PART, M, M_OUT, N, rows_per_program,
    fp8_max, eps,
    FN: tl.constexpr, BWD: tl.constexpr, HAS_BIAS: tl.constexpr, DBIAS: tl.constexpr,
    ROUND: tl.constexpr, E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr, AMAX: tl.constexpr, CAST: tl.constexpr, FROM_AMAX: tl.constexpr,
    COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program ``(p, c)`` walks rows ``[p * rows_per_program, ...)`` of the ``BLOCK_N`` columns
    ``c``, one ``BLOCK_M``-row tile at a time. ``AMAX``: fold the rounded values' amax (one
    atomic max per program, after the loop); ``DBIAS``: their unrounded column sums into row
    ``p`` of ``PART``; ``CAST``: the cast of ``kernels.quantize._cast_kernel``, rowwise into
    ``DATA`` and (``COLUMNWISE``) transposed into ``DATA_T``, with the scale from the amax in
    ``AMAX_BITS`` (``FROM_AMAX``: current scaling, whose first pass was this kernel with
    ``AMAX`` alone; program (0, 0) writes ``SCALE_INV``) or from ``SCALE`` (delayed scaling, one
    pass with ``AMAX``). Accumulators are element-wise over the tile and reduced once at the end
    (a cross-warp reduction per tile would make the loop latency-bound; see
    ``kernels.activation.rows_config``)."""
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if CAST:
        if FROM_AMAX:
            amax = tl.load(AMAX_BITS).to(tl.float32, bitcast=True)
            scale = _scale_from_amax(amax, fp8_max, eps, False)
            if (pid_m == 0) & (tl.program_id(1) == 0):
                tl.store(SCALE_INV, tl.math.div_rn(1.0, scale))
        else:
            scale = tl.load(SCALE)
    acc_amax = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    acc_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(0, rows_per_program, BLOCK_M):
        rows = pid_m * rows_per_program + r + tl.arange(0, BLOCK_M)
        v, x, _ = _tile(Z, B, G, rows, cols, M, N, FN, BWD, HAS_BIAS, ROUND, SOFTWARE)
        if AMAX:
            acc_amax = tl.maximum(acc_amax, _abs_bits(x))
        if DBIAS:
            acc_sum += v
        if CAST:
            q = _to_fp8_bits(_saturate(x * scale, fp8_max), E4M3, MBITS, BIAS, SOFTWARE)
            mask = (rows[:, None] < M_OUT) & (cols[None, :] < N)
            tl.store(DATA + rows.to(tl.int64)[:, None] * N + cols[None, :], q, mask=mask)
            if COLUMNWISE:
                mask_t = (cols[:, None] < N) & (rows[None, :] < M_OUT)
                offs_t = cols.to(tl.int64)[:, None] * M_OUT + rows[None, :]
                tl.store(DATA_T + offs_t, tl.trans(q), mask=mask_t)
    if AMAX:
        tl.atomic_max(AMAX_BITS, tl.max(tl.max(acc_amax, axis=1), axis=0))
    if DBIAS:
        tl.store(PART + pid_m.to(tl.int64) * N + cols, tl.sum(acc_sum, axis=0), mask=cols < N)


def act_quantize(
    z: Tensor,
    bias: Tensor | None,
    grad: Tensor | None,
    activation: str,
    fp8_dtype: torch.dtype,
    scale: Tensor | None,
    rows: int,
    columnwise: bool,
    need_dbias: bool,
    *,
    config: QuantizeLaunchConfig | None = None,
    programs_per_sm: int | None = 4,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Quantise ``activation(z + bias)``, or with ``grad`` its gradient ``grad *
    activation'(z + bias)``, per tensor, without writing it: ``(data, data_t, scale_inv, amax,
    dbias)``.

    ``z`` / ``grad``: ``[M_OUT, N]`` contiguous, of the model's dtype (the value is rounded to it
    before the cast); only the first ``rows`` rows are real, the rest are written as zero codes.
    ``scale=None``: current scaling (two passes), else the 1-element delayed scale (one pass).
    ``dbias`` (with ``need_dbias``, backward only): fp32 column sums of the unrounded gradient,
    cast to ``bias``'s dtype. ``config``: tile (``block_m`` x ``block_k``) and warps;
    ``programs_per_sm``: programs per SM over the whole grid, each walking many row tiles (None:
    one tile per program). Arguments are trusted (``functional.mlp_fp8`` checks them)."""
    if activation not in FUNCTION_OF or activation in GATED:
        raise ValueError(f"act_quantize: element-wise activation expected, got {activation!r}")
    cfg = config or QuantizeLaunchConfig()
    m_out, n = z.shape
    software = _software(z.device, cfg)
    data = torch.empty((m_out, n), device=z.device, dtype=fp8_dtype)
    data_t = z.new_empty((n, m_out) if columnwise else (0,), dtype=fp8_dtype)
    amax = torch.zeros(1, device=z.device, dtype=torch.float32)
    scale_inv = torch.empty(1, device=z.device, dtype=torch.float32)
    bm, bn = cfg.block_m, cfg.block_k
    row_tiles, col_tiles = max(triton.cdiv(m_out, bm), 1), max(triton.cdiv(n, bn), 1)
    if programs_per_sm is None:
        row_programs = row_tiles
    else:
        target = kernels.programs_per_sm(z.device, programs_per_sm)
        row_programs = max(1, min(row_tiles, target // col_tiles))
    rows_per_program = triton.cdiv(row_tiles, row_programs) * bm
    grid = (triton.cdiv(m_out, rows_per_program) if m_out else 1, col_tiles)
    dbias = need_dbias and bias is not None and grad is not None
    part = z.new_empty((grid[0], n), dtype=torch.float32) if dbias else amax
    b = z if bias is None else bias
    g = z if grad is None else grad
    args = [z, b, g, amax if scale is None else scale.reshape(1), amax.view(torch.int32)]
    args += [_bits(data), _bits(data_t), scale_inv, part, rows, m_out, n, rows_per_program]
    args += [_FORMATS[fp8_dtype].max, 0.0]
    common = {
        "FN": FUNCTION_OF[activation],
        "BWD": grad is not None,
        "HAS_BIAS": bias is not None,
        "ROUND": _ROUND[z.dtype],
        **_fp8_args(fp8_dtype, software),
        "COLUMNWISE": columnwise,
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "num_warps": cfg.num_warps,
    }
    if scale is None:  # current scaling: the amax (and the bias gradient) first
        _act_quant_kernel[grid](*args, DBIAS=dbias, AMAX=True, CAST=False, FROM_AMAX=True, **common)
        _act_quant_kernel[grid](*args, DBIAS=False, AMAX=False, CAST=True, FROM_AMAX=True, **common)
    else:
        _act_quant_kernel[grid](*args, DBIAS=dbias, AMAX=True, CAST=True, FROM_AMAX=False, **common)
        scale_inv = scale.reshape(1).reciprocal()
    db = part.sum(0).to(bias.dtype) if dbias else None
    return data, data_t, scale_inv, amax, db
