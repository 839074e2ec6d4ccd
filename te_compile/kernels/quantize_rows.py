r"""Triton kernels for FP8 with one scale per row or per column, the operands of the grouped
FP8 GEMMs (``functional.grouped_fp8``), and the E5M2-to-E4M3 recoding of the grouped GEMM that
takes E4M3 only. The encoding, scale rule and conversions are ``kernels.fp8``'s.

* ``_rowwise_kernel``: one scale per row (``fp8_max / amax`` of the row; 1 for a zero or
  non-finite result): ``BLOCK_M`` rows per program, the amax loop over the row, then the cast
  loop over it again (a re-read from L2). Or one given scale for every row (delayed scaling),
  the tensor's amax folded in during the one cast loop.
* ``_columnwise_kernel``: the same per-slice quantisation along the *rows* of each matrix of a
  ``[B, N, K]`` tensor (one scale per column), stored transposed ``[B, K, N]``: the grouped
  dgrad's weight copy without a strided transpose of the high-precision weight first. Or along
  the rows of each token group of an ``[M, K]`` tensor, stored transposed with every group
  padded to a multiple of 16 rows: the grouped FP8 wgrad's operands.
* ``_recode_kernel``: FP8 bytes through a 256-entry table: E5M2 codes as the E4M3 codes of
  their values times ``2**-7``.
* ``_balance_scales_kernel``: two per-slice scale vectors brought to one power-of-two range.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile._numerics import reciprocal_rn
from te_compile.kernels import cdiv, e5m2_to_e4m3_table, launch, next_pow2
from te_compile.kernels.fp8 import (
    DEFAULT_CONFIG,
    FORMATS,
    abs_bits,
    as_rows,
    cast_args,
    cast_fp8,
    slice_scale,
    software_convert,
    uint8_view,
)

__all__ = [
    "balance_scales",
    "quantize_columnwise_transposed",
    "quantize_group_columns",
    "quantize_rowwise",
    "recode_e5m2_as_e4m3",
]


@triton.jit
def _recoded(q, TABLE, RECODE: tl.constexpr):
    """FP8 bits ``q``, or with ``RECODE`` their E4M3 codes through ``TABLE``
    (:func:`e5m2_to_e4m3_table`: E5M2 values times ``2**-7``)."""
    if RECODE:
        q = tl.load(TABLE + q.to(tl.int32))
    return q


@triton.jit
def _inverse(scale, RECODE: tl.constexpr):
    """``1 / scale`` correctly rounded; times 128 (exact) for recoded E4M3 codes."""
    inv = tl.math.div_rn(1.0, scale)
    if RECODE:
        inv = inv * 128.0
    return inv


@triton.jit(do_not_specialize=["AMAX_SLOT"])  # one compile for every slot
def _rowwise_kernel(
    X,
    DATA,
    SCALE_INV,
    SCALE,
    AMAX_BITS,
    AMAX_SLOT,
    M,
    K,
    fp8_max,
    TABLE,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr,
    RECODE: tl.constexpr,
    GIVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows ``[pid * BLOCK_M, ...)``: amax over each row (NaN-propagating, on the int bits),
    ``scale = fp8_max / amax`` where ``amax > 0`` else 1, and 1 where that is not finite; then
    ``DATA = fp8(clamp(x * scale))`` and ``SCALE_INV = 1 / scale`` (both divisions correctly
    rounded: the same bytes as the torch definition in ``functional.grouped_fp8``).
    ``RECODE``: E5M2 stored as its E4M3 codes, ``SCALE_INV`` times 128 (:func:`_recoded`).
    ``GIVEN``: every row cast with the one scale ``SCALE`` instead (per tensor, delayed scaling:
    the bytes of ``_cast_kernel``), in one loop that also folds the tensor's amax into
    ``AMAX_BITS[AMAX_SLOT]`` (``kernels.quantize.amax_bits``)."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    base = rows.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    if GIVEN:
        scale = tl.load(SCALE) + tl.zeros([BLOCK_M], dtype=tl.float32)
    else:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = in_rows[:, None] & (cols[None, :] < K)
            x = tl.load(X + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.max(abs_bits(x), axis=1))
        scale = slice_scale(acc, fp8_max)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = in_rows[:, None] & (cols[None, :] < K)
        x = tl.load(X + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GIVEN:
            acc = tl.maximum(acc, tl.max(abs_bits(x), axis=1))
        q = cast_fp8(x * scale[:, None], fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
        tl.store(DATA + base + cols[None, :], _recoded(q, TABLE, RECODE), mask=mask)
    tl.store(SCALE_INV + rows, _inverse(scale, RECODE), mask=in_rows)
    if GIVEN:
        tl.atomic_max(AMAX_BITS.to(tl.pointer_type(tl.int32)) + AMAX_SLOT, tl.max(acc, axis=0))


@triton.jit
def _columnwise_kernel(
    X,
    DATA_T,
    SCALE_INV,
    SCALE,
    ENDS,
    PAD_ENDS,
    N,
    K,
    fp8_max,
    TABLE,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr,
    RECODE: tl.constexpr,
    GIVEN: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Slice ``pid(0)`` of ``X``'s rows, columns ``[pid(1) * BLOCK_K, ...)``: the
    ``_rowwise_kernel`` quantisation of each *column* of the slice (amax over its rows), written
    transposed, and ``SCALE_INV`` ``[slices, K]``. ``GIVEN``: every column cast with the one
    scale ``SCALE`` instead (per tensor, delayed scaling: the bytes of ``_cast_kernel``,
    transposed). The tiles are read along ``K`` and stored along the slice's rows. ``RECODE``:
    E5M2 stored as its E4M3 codes, ``SCALE_INV`` times 128 (:func:`_recoded`).

    * Not ``GROUPED``: ``X`` is ``[B, N, K]``, slice ``b`` its matrix ``b``, ``DATA_T``
      ``[B, K, N]`` (the grouped dgrad's weight copy without a strided transpose of the
      high-precision weight first).
    * ``GROUPED``: ``X`` is ``[M, K]`` and slice ``g`` its rows ``[ENDS[g-1], ENDS[g])`` (a
      token group); ``DATA_T`` is ``[K, N]`` with ``N`` its row stride, and the group's
      columns start at ``PAD_ENDS[g-1]``: its row count rounded up to a multiple of 16, the
      padding written as zeros, as are the columns after the last group (the grouped wgrad's
      operands, whose groups along the contraction dim must start at 16-byte offsets)."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_cols = cols < K
    if GROUPED:
        start = tl.load(ENDS + b - 1, mask=b > 0, other=0).to(tl.int64)
        rows_in = tl.load(ENDS + b).to(tl.int64) - start
        dst_col = tl.load(PAD_ENDS + b - 1, mask=b > 0, other=0).to(tl.int64)
        rows_out = (rows_in + 15) // 16 * 16
        # The last group also zeroes the columns after it: the whole output is defined.
        rows_out = tl.where(b == tl.num_programs(0) - 1, N - dst_col, rows_out)
        dst = DATA_T + dst_col
    else:
        start = b.to(tl.int64) * N
        rows_in = N
        rows_out = N
        dst = DATA_T + start * K
    src = X + start * K
    if GIVEN:
        scale = tl.load(SCALE) + tl.zeros([BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_K], dtype=tl.int32)
        for n0 in range(0, rows_in, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < rows_in) & in_cols[None, :]
            x = tl.load(src + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.max(abs_bits(x.to(tl.float32)), axis=0))
        scale = slice_scale(acc, fp8_max)
    for n0 in range(0, rows_out, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < rows_in) & in_cols[None, :]
        x = tl.load(src + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
        y = x.to(tl.float32) * scale[None, :]
        q = tl.trans(cast_fp8(y, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD))  # [BLOCK_K, BLOCK_N]
        out = cols.to(tl.int64)[:, None] * N + rows[None, :]
        q = _recoded(q, TABLE, RECODE)
        tl.store(dst + out, q, mask=in_cols[:, None] & (rows[None, :] < rows_out))
    tl.store(SCALE_INV + b * K + cols, _inverse(scale, RECODE), mask=in_cols)


@triton.jit
def _recode_kernel(SRC, DST, TABLE, N, BLOCK_SIZE: tl.constexpr):
    """``DST[i] = TABLE[SRC[i]]``: FP8 bytes mapped through a 256-entry code table."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < N
    codes = tl.load(SRC + offs, mask=mask, other=0)
    tl.store(DST + offs, tl.load(TABLE + codes.to(tl.int32)), mask=mask)


def _recode_args(fp8_dtype: torch.dtype, data: Tensor, unused: Tensor) -> dict[str, object]:
    """``TABLE`` / ``RECODE`` of a kernel casting to ``fp8_dtype`` into ``data``: recoded when
    an E5M2 cast is stored into an E4M3 tensor (``unused``: any tensor, for no recoding)."""
    recode = fp8_dtype is torch.float8_e5m2 and data.dtype is torch.float8_e4m3fn
    return {"TABLE": e5m2_to_e4m3_table(data.device) if recode else unused, "RECODE": recode}


def _codes_dtype(fp8_dtype: torch.dtype, e4m3_codes: bool) -> torch.dtype:
    """The storage dtype of a cast to ``fp8_dtype``: E4M3 for E5M2 with ``e4m3_codes``."""
    return torch.float8_e4m3fn if e4m3_codes else fp8_dtype


def quantize_columnwise_transposed(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: Tensor | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> tuple[Tensor, Tensor]:
    """``(data_t, scale_inv)`` of ``x`` ``[..., N, K]``: every column (a slice along ``N``)
    cast to ``fp8_dtype`` with its own current scale, the data written transposed,
    ``[..., K, N]``, and ``scale_inv`` fp32 ``[..., K]``. Bit-identical to
    ``quantize_rowwise(x.transpose(-2, -1))`` (what a grouped dgrad GEMM's weight copy needs)
    in one launch, without materialising the transposed high-precision copy. ``scale``
    (``[1]`` fp32): every column cast with it instead (delayed scaling; the bytes of
    ``quantize_tensorwise``, transposed)."""
    *lead, n, k = x.shape
    batch = math.prod(lead)
    x3 = x.contiguous().view(batch, n, k)
    data_t = torch.empty((*lead, k, n), device=x.device, dtype=fp8_dtype)
    scale_inv = torch.empty((*lead, k), device=x.device, dtype=torch.float32)
    if batch * k == 0:
        return data_t, scale_inv
    if n == 0:
        return data_t, scale_inv.fill_(1.0)  # an empty column: amax 0, scale 1
    _launch_columnwise(x3, data_t, scale_inv, scale, None, n, batch, (block_n, block_k, 4))
    return data_t, scale_inv


def _launch_columnwise(
    x, data_t, scale_inv, scale, ends, n, slices, tiling, fp8_dtype=None
) -> None:
    """``_columnwise_kernel`` over ``slices`` slices of ``x`` (``ends``: ``(ENDS, PAD_ENDS)``
    for token groups, None for the matrices of a batch); ``tiling``: ``(BLOCK_N, BLOCK_K,
    num_warps)``; ``fp8_dtype``: the cast's format when it is not ``data_t``'s (E5M2 into E4M3
    codes, :func:`_recode_args`)."""
    block_n, block_k, num_warps = tiling
    k = x.shape[-1]
    fp8_dtype = fp8_dtype or data_t.dtype
    launch(_columnwise_kernel, (slices, cdiv(k, block_k)))(
        x,
        uint8_view(data_t),
        scale_inv,
        scale_inv if scale is None else scale,
        *((scale_inv, scale_inv) if ends is None else ends),  # unused without groups
        n,
        k,
        FORMATS[fp8_dtype].max,
        **_recode_args(fp8_dtype, data_t, scale_inv),
        **cast_args(fp8_dtype, software_convert(x.device, DEFAULT_CONFIG), x.dtype),
        GIVEN=scale is not None,
        GROUPED=ends is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )


def quantize_group_columns(
    x: Tensor,
    ends: Tensor,
    pad_ends: Tensor,
    capacity: int,
    fp8_dtype: torch.dtype,
    *,
    scale: Tensor | None = None,
    e4m3_codes: bool = False,
    block_n: int = 128,
    block_k: int = 32,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor]:
    """``(data_t, scale_inv)`` of ``x`` ``[M, K]`` whose rows form groups ending at ``ends``
    (``[G]`` int32, on ``x``'s device): every column of every group cast to ``fp8_dtype`` with
    its own current scale (amax over the group's rows), written transposed into ``data_t``
    ``[K, capacity]``, group ``g`` from column ``pad_ends[g-1]`` (``pad_ends``: the ends of the
    groups' row counts rounded up to multiples of 16; the padding and the columns after the
    last group are zeros), and ``scale_inv`` fp32 ``[G, K]`` (1 for an empty group; ``1 /
    scale`` for every group with ``scale``). ``scale``
    (``[1]`` fp32): every group cast with it instead (delayed scaling). One launch, no host
    sync; ``capacity`` must hold the padded groups (``M + 15 G`` always does). Launch:
    ``bench/diag/tune_group_columns.py``; 128 x 32 tiles, 4 warps ran 330 / 177 us at 32768 x 4096 /
    2048 in 8 groups on the H100 (2026-11-23; ~2.0 TB/s of its minimal traffic against 2.9 for a
    copy; 64 x 64 took 443 / 352 us). ``e4m3_codes``: as in :func:`quantize_rowwise`."""
    k = x.shape[1]
    groups = ends.shape[0]
    data_t = torch.empty((k, capacity), device=x.device, dtype=_codes_dtype(fp8_dtype, e4m3_codes))
    scale_inv = torch.empty((groups, k), device=x.device, dtype=torch.float32)
    if k == 0:
        return data_t, scale_inv
    if groups == 0:
        return data_t.view(torch.uint8).zero_().view(data_t.dtype), scale_inv
    tiling = (block_n, block_k, num_warps)
    _launch_columnwise(x.contiguous(), data_t, scale_inv, scale, (ends, pad_ends), capacity,
                       groups, tiling, fp8_dtype)  # fmt: skip
    return data_t, scale_inv


def recode_e5m2_as_e4m3(data: Tensor, *, block: int = 4096) -> Tensor:
    """E5M2 ``data`` as E4M3 codes of its values times ``2**-7``
    (:func:`e5m2_to_e4m3_table`), one read and one write: a scale that multiplied the E5M2
    values is multiplied by 128 for the codes. Lets a GEMM that takes E4M3 operands only
    (``torch._scaled_grouped_mm`` on Hopper) run an E5M2 gradient."""
    if data.dtype is not torch.float8_e5m2:
        raise ValueError(f"recode_e5m2_as_e4m3: data must be float8_e5m2, got {data.dtype}")
    src = data.contiguous().view(torch.uint8)
    out = torch.empty_like(src)
    if src.numel():
        table = e5m2_to_e4m3_table(src.device)
        grid = (cdiv(src.numel(), block),)
        launch(_recode_kernel, grid)(src, out, table, src.numel(), BLOCK_SIZE=block, num_warps=4)
    return out.view(torch.float8_e4m3fn)


def quantize_rowwise(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    scale: Tensor | None = None,
    amax: Tensor | None = None,
    amax_slot: int = 0,
    e4m3_codes: bool = False,
    block_m: int = 4,
    block_k: int = 1024,
) -> tuple[Tensor, Tensor]:
    """``(data, scale_inv)``: every row of ``x`` (``[..., K]``, the last dim) cast to
    ``fp8_dtype`` with its own current scale; ``scale_inv`` fp32 of ``x``'s shape without the
    last dim. One launch, ``x`` read from memory once (see ``_rowwise_kernel``).
    ``e4m3_codes``: an E5M2 cast stored as E4M3 codes with ``scale_inv`` times 128, the bytes
    of :func:`recode_e5m2_as_e4m3` without its pass. ``scale`` (``[1]`` fp32): every row cast
    with it instead (delayed scaling; ``scale_inv`` its inverse in every row), in one pass that
    folds ``max|x|`` into ``amax[amax_slot]`` (a zeroed fp32 buffer,
    ``kernels.quantize.amax_bits``; required with ``scale``)."""
    if (scale is None) != (amax is None):
        raise ValueError("quantize_rowwise: scale and amax go together (delayed scaling)")
    x2, m, k = as_rows(x)
    data = torch.empty(x.shape, device=x.device, dtype=_codes_dtype(fp8_dtype, e4m3_codes))
    scale_inv = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    if m * k:
        bk = min(block_k, next_pow2(k))
        launch(_rowwise_kernel, (cdiv(m, block_m),))(
            x2,
            uint8_view(data),
            scale_inv,
            scale_inv if scale is None else scale,  # unused without a given scale
            scale_inv if amax is None else amax,
            amax_slot,
            m,
            k,
            FORMATS[fp8_dtype].max,
            **_recode_args(fp8_dtype, data, scale_inv),
            **cast_args(fp8_dtype, software_convert(x.device, DEFAULT_CONFIG), x.dtype),
            GIVEN=scale is not None,
            BLOCK_M=block_m,
            BLOCK_K=bk,
            num_warps=4,
        )
    elif m:  # an empty row: scale 1 (current), or the given one
        recode = 128.0 if data.dtype != fp8_dtype else 1.0
        if scale is None:
            scale_inv.fill_(recode)
        else:
            scale_inv.copy_((reciprocal_rn(scale) * recode).expand(m))
    return data, scale_inv


@triton.jit
def _max_exponent(S, n, BLOCK: tl.constexpr):
    """The biased fp32 exponent of the largest of the ``n`` positive values at ``S``."""
    m = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.load(S + o, mask=o < n, other=0.0))
    return (tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF


@triton.jit
def _scale_by(S, OUT, n, f, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        o = start + tl.arange(0, BLOCK)
        tl.store(OUT + o, tl.load(S + o, mask=o < n, other=0.0) * f, mask=o < n)


@triton.jit
def _balance_scales_kernel(SA, SB, OUT_A, OUT_B, NA, NB, BLOCK: tl.constexpr):
    """One program: ``s = floor((ea - eb) / 2)`` of the two vectors' largest exponents, then
    ``SA * 2**-s`` and ``SB * 2**s`` (powers of two built from their bits: exact products)."""
    s = (_max_exponent(SA, NA, BLOCK) - _max_exponent(SB, NB, BLOCK)) >> 1  # floor: arithmetic
    s = tl.minimum(tl.maximum(s, -126), 126)
    _scale_by(SA, OUT_A, NA, ((127 - s) << 23).to(tl.float32, bitcast=True), BLOCK)
    _scale_by(SB, OUT_B, NB, ((127 + s) << 23).to(tl.float32, bitcast=True), BLOCK)


def balance_scales(sa: Tensor, sb: Tensor) -> tuple[Tensor, Tensor]:
    """``(sa * 2**-s, sb * 2**s)`` for the 1-D positive fp32 scale vectors of a grouped FP8 GEMM,
    ``s`` half the difference of their largest exponents (``functional.gemm._balanced``,
    whose torch ops are ten launches in eager): one launch of one program."""
    out_a, out_b = torch.empty_like(sa), torch.empty_like(sb)
    launch(_balance_scales_kernel, (1,))(
        sa, sb, out_a, out_b, sa.numel(), sb.numel(), BLOCK=1024, num_warps=4
    )
    return out_a, out_b
