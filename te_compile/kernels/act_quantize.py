r"""Triton kernels that quantise an activation, or an activation's gradient, without writing it.

In an FP8 MLP the second GEMM's input is :math:`h = f(z + b)` and the first GEMM's gradient is
:math:`dz = dh \odot f'(z + b)`. Unfused, each is written in high precision by the activation
kernel, read back for its amax (current scaling) and read again by the cast. These kernels
compute :math:`h` (or :math:`dz`) in registers from :math:`z` (and :math:`dh`), round it to the
model's dtype exactly as the activation kernel's store would, and quantise it per tensor:

* ``_act_amax_kernel`` (current scaling, first pass): the amax of the rounded values, and with
  ``DBIAS`` the fp32 column sums of the unrounded :math:`dz` (the bias gradient), one row of a
  ``[row tiles, N]`` buffer per program row (summed afterwards: deterministic, no atomics);
* ``_act_cast_kernel``: the cast, rowwise and transposed from the same registers (the layouts
  the forward and backward GEMMs take); with the scale from the first pass's amax (current) or
  a given one (delayed scaling, one pass: it also folds the amax and the bias-gradient partial
  sums).

So :math:`h` costs one read of :math:`z` per pass instead of a write and two reads of a
tensor of its size, and the bytes are those of the unfused ops (activation kernel, then
``quantize_current`` / ``quantize_tensorwise``): same activation code (``kernels.activation``),
same rounding, same cast (``kernels.quantize``). Rows ``M <= r < M_OUT`` (the token padding to
a multiple of 16 the FP8 GEMMs need) are written as zeros and do not enter the amax.

One tile per program, as in ``kernels.quantize``: a persistent form (each program walking many
row tiles of a column block, one atomic and one partial-sum row at the end) is slower on the
H100 for current scaling (2.03 ms for the forward and backward passes at its best launch against
1.85 ms) and faster only for the delayed backward (0.82 ms against 0.86 ms;
``bench/results/2026-11-22_h100/tune_quantize_persistent.log``).

``_act_block_kernel`` (``act_quantize_block``) is the same for Float8BlockScaling's 1x128
blocks, as ``kernels.quantize._block_kernel`` casts a tensor, by default in two passes that each
compute the activation: rowwise over ``[32, 128]`` tiles, columnwise over ``[128, 64]`` tiles.
One 128x128 tile for both layouts (``block_split=False``) runs one program per SM and is
latency-bound: on the H100 at 16384 x 16384 the forward took 0.995 ms against 0.649 ms split,
the backward 1.145 against 1.105 ms (``bench/diag/tune_quantize.py``). Programs walking many
tiles are no faster, software pipelining is slower, and one tile read in row pieces twice, the
second time from L2, slower still: 0.89 / 1.82 ms at best; the columnwise blocks cast from the
transposed tile, fp32 or bf16: 0.85 / 1.17 ms at best (``bench/results/2026-11-22_h100/``:
``tune_quantize_block.log``, ``tune_quantize_block_reload.log``, ``s9/tune_act_block.log``).

Gated activations (contiguous halves, ``z`` ``[M, 2N]``): the forward quantises :math:`h =
f(a) \odot l` ``[M, N]``; the backward (``_gated_bwd_tile``) computes both halves of
:math:`dz` ``[M, 2N]`` from one read of a tile of :math:`dh` and the two tiles of ``z`` under it,
and casts both (per tensor: one scale for the whole of :math:`dz`; 1x128 blocks: ``N`` a multiple
of 128, so that no block straddles the halves). The tensors are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile.kernels import cdiv, launch
from te_compile.kernels.activation import (
    FN_CLAMPED_SILU,
    FN_GELU,
    FN_SILU,
    FUNCTION_OF,
    GATED,
    apply_act,
    apply_dact,
)
from te_compile.kernels.fp8 import (
    BLOCK,
    FORMATS,
    ROUNDING,
    QuantizeLaunchConfig,
    abs_bits,
    as_stored,
    cast_args,
    cast_fp8,
    fold_amax,
    fp8_out,
    round_to,
    software_convert,
    tile_scale,
    uint8_view,
)
from te_compile.kernels.norm import norm_stats
from te_compile.kernels.quantize import amax_bits, block_scales, cast_1x128, cuda_cast

__all__ = ["act_quantize", "act_quantize_block", "norm_quantize", "norm_quantize_block"]

# Norm prologues (``norm_quantize``): FN codes past the activations'. A LayerNorm / RMSNorm output
# from the statistics of ``kernels.norm.norm_stats``; ``+ 1``: zero-centred gamma.
_NORM_LN = 64
_NORM_RMS = 66


@triton.jit
def _load_cols(B, cols, N, EVEN: tl.constexpr):
    """``B[cols]`` in fp32 as a ``[1, BLOCK_N]`` row (0 past ``N``)."""
    if EVEN:  # noqa: SIM108 (a constexpr branch)
        b = tl.load(B + cols)
    else:
        b = tl.load(B + cols, mask=cols < N, other=0.0)
    return b.to(tl.float32)[None, :]


@triton.jit
def _tile(
    Z, B, G, MEAN, RSIG, pid_m, pid_n, M, N,
    FN: tl.constexpr, BWD: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROUND: tl.constexpr, SOFTWARE: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``(v, r, cols)``: the unrounded fp32 activation (or gradient) of tile ``(pid_m, pid_n)``,
    the value rounded to the model's dtype (both 0 outside the real ``[M, N]``) and the tile's
    columns. ``EVEN``: the tile is inside the tensor, no masks. Addresses are a 64-bit tile base
    plus 32-bit offsets inside the tile (the wrapper checks they fit).

    ``FN >= _NORM_LN``: a norm's output instead, ``Z`` the norm's input, ``G`` / ``B`` its gamma
    / beta, ``MEAN`` / ``RSIG`` the row statistics (``[M]``), in the order of operations of
    ``kernels.norm._norm_fwd_kernel`` (so the values are those its store would round)."""
    r_in = tl.arange(0, BLOCK_M)
    c_in = tl.arange(0, BLOCK_N)
    cols = pid_n * BLOCK_N + c_in
    offs = pid_m.to(tl.int64) * BLOCK_M * N + pid_n * BLOCK_N + (r_in[:, None] * N + c_in[None, :])
    if FN >= 64:
        rows = pid_m * BLOCK_M + r_in
        if EVEN:
            a = tl.load(Z + offs).to(tl.float32)
            rs = tl.load(RSIG + rows)
            w = tl.load(G + cols).to(tl.float32)
        else:
            valid = (rows[:, None] < M) & (cols[None, :] < N)
            a = tl.load(Z + offs, mask=valid, other=0.0).to(tl.float32)
            rs = tl.load(RSIG + rows, mask=rows < M, other=0.0)
            w = tl.load(G + cols, mask=cols < N, other=0.0).to(tl.float32)
        if FN == 64 or FN == 65:
            if EVEN:
                a = a - tl.load(MEAN + rows)[:, None]
            else:
                a = a - tl.load(MEAN + rows, mask=rows < M, other=0.0)[:, None]
        if FN == 65 or FN == 67:
            w += 1.0
        v = a * rs[:, None]
        v = v * w[None, :]
        if HAS_BIAS:
            if EVEN:
                v += tl.load(B + cols).to(tl.float32)[None, :]
            else:
                v += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if not EVEN:
            v = tl.where(valid, v, 0.0)
    else:
        # An activation (forward) or its gradient; gated: Z is [M, 2N], the activation half
        # then the linear half (``_gated_bwd_tile`` is the gated backward).
        offs_z = offs
        if GATED:
            offs_z = pid_m.to(tl.int64) * BLOCK_M * 2 * N + pid_n * BLOCK_N
            offs_z += r_in[:, None] * 2 * N + c_in[None, :]
        if EVEN:
            a = tl.load(Z + offs_z).to(tl.float32)
        else:
            valid = ((pid_m * BLOCK_M + r_in)[:, None] < M) & (cols[None, :] < N)
            a = tl.load(Z + offs_z, mask=valid, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += _load_cols(B, cols, N, EVEN)
        if GATED:
            if EVEN:
                lin = tl.load(Z + offs_z + N).to(tl.float32)
            else:
                lin = tl.load(Z + offs_z + N, mask=valid, other=0.0).to(tl.float32)
            if HAS_BIAS:
                lin += _load_cols(B + N, cols, N, EVEN)
            # Clamped SwiGLU with LayerNormMLP's parameters, te.functional.bias_activation's
            # defaults: limit 7.0, alpha 1.702, glu_linear_offset 1.0 (literals: the interpreter
            # does not multiply a tensor by a global constexpr float).
            if FN == FN_CLAMPED_SILU:
                lin = tl.minimum(tl.maximum(lin, -7.0), 7.0) + 1.0
            v = apply_act(a, FN, 7.0, 1.702) * lin
        elif BWD:
            if EVEN:
                g = tl.load(G + offs).to(tl.float32)
            else:
                g = tl.load(G + offs, mask=valid, other=0.0).to(tl.float32)
            v = g * apply_dact(a, FN, 0.0, 0.0)
        else:
            v = apply_act(a, FN, 0.0, 0.0)
        if not EVEN:
            v = tl.where(valid, v, 0.0)
    return v, round_to(v, ROUND, SOFTWARE), cols


@triton.jit
def _gated_bwd_tile(
    Z, B, G, pid_m, pid_n, M, N,
    FN: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, SOFTWARE: tl.constexpr,
    EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The gated backward of tile ``(pid_m, pid_n)`` of ``G`` (``dh``, ``[M, N]``) with ``Z``
    ``[M, 2N]``: ``(da, da rounded, dl, dl rounded, cols)``, the gradients of the activation
    half's columns ``cols`` and of the linear half's ``N + cols``, in the order of operations of
    ``kernels.activation._rows_bwd_kernel`` (0 outside the real rows and columns)."""
    r_in = tl.arange(0, BLOCK_M)
    c_in = tl.arange(0, BLOCK_N)
    cols = pid_n * BLOCK_N + c_in
    offs_g = pid_m.to(tl.int64) * BLOCK_M * N + pid_n * BLOCK_N
    offs_g += r_in[:, None] * N + c_in[None, :]
    offs_z = pid_m.to(tl.int64) * BLOCK_M * 2 * N + pid_n * BLOCK_N
    offs_z += r_in[:, None] * 2 * N + c_in[None, :]
    if EVEN:
        g = tl.load(G + offs_g).to(tl.float32)
        a = tl.load(Z + offs_z).to(tl.float32)
        lin = tl.load(Z + offs_z + N).to(tl.float32)
    else:
        valid = ((pid_m * BLOCK_M + r_in)[:, None] < M) & (cols[None, :] < N)
        g = tl.load(G + offs_g, mask=valid, other=0.0).to(tl.float32)
        a = tl.load(Z + offs_z, mask=valid, other=0.0).to(tl.float32)
        lin = tl.load(Z + offs_z + N, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += _load_cols(B, cols, N, EVEN)
        lin += _load_cols(B + N, cols, N, EVEN)
    dl = g * apply_act(a, FN, 7.0, 1.702)  # clamped SwiGLU's parameters as in _tile
    if FN == FN_CLAMPED_SILU:
        dl = tl.where((lin >= -7.0) & (lin <= 7.0), dl, 0.0)
        lin = tl.minimum(tl.maximum(lin, -7.0), 7.0) + 1.0
    da = g * lin * apply_dact(a, FN, 7.0, 1.702)
    if not EVEN:
        da = tl.where(valid, da, 0.0)
        dl = tl.where(valid, dl, 0.0)
    return da, round_to(da, ROUND, SOFTWARE), dl, round_to(dl, ROUND, SOFTWARE), cols


@triton.jit
def _store_sums(PART, v, pid_m, pid_n, ROW, COL0, N, BLOCK_N: tl.constexpr):
    """The column sums of tile ``(pid_m, pid_n)`` ``v`` into row ``pid_m`` of ``PART`` (``ROW``
    wide), columns ``COL0 + pid_n * BLOCK_N + ...`` (of ``N`` valid): a bias gradient's partial
    sums. The columns are computed here, not taken from the tile helpers: PyTorch's analysis of
    what a kernel writes (``wrap_triton`` under ``torch.compile``) takes a store address built
    from a helper's result as one that may point into every tensor given to the helper."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(PART + pid_m.to(tl.int64) * ROW + COL0 + cols, tl.sum(v, axis=0), mask=cols < N)


@triton.jit
def _max_abs_bits(r):
    return tl.max(tl.max(abs_bits(r), axis=1), axis=0)


@triton.jit(do_not_specialize=["AMAX_SLOT"])  # one compile for every slot
def _act_amax_kernel(
    Z, B, G, MEAN, RSIG, AMAX_BITS, AMAX_SLOT, PART, M, N,
    FN: tl.constexpr, BWD: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    DBIAS: tl.constexpr, ROUND: tl.constexpr, SOFTWARE: tl.constexpr, EVEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The amax goes into ``AMAX_BITS[AMAX_SLOT]``. The gated backward's ``PART`` rows are
    ``2N`` wide: the activation half's sums, then the linear half's."""
    AMAX_BITS = AMAX_BITS.to(tl.pointer_type(tl.int32)) + AMAX_SLOT
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GATED and BWD:
        va, ra, vl, rl, _ = _gated_bwd_tile(
            Z, B, G, pid_m, pid_n, M, N, FN, HAS_BIAS, ROUND, SOFTWARE, EVEN, BLOCK_M, BLOCK_N
        )
        fold_amax(AMAX_BITS, tl.maximum(_max_abs_bits(ra), _max_abs_bits(rl)))
        if DBIAS:
            _store_sums(PART, va, pid_m, pid_n, 2 * N, 0, N, BLOCK_N)
            _store_sums(PART, vl, pid_m, pid_n, 2 * N, N, N, BLOCK_N)
    else:
        v, r, _ = _tile(
            Z, B, G, MEAN, RSIG, pid_m, pid_n, M, N, FN, BWD, GATED, HAS_BIAS, ROUND, SOFTWARE,
            EVEN, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        fold_amax(AMAX_BITS, _max_abs_bits(r))
        if DBIAS:
            _store_sums(PART, v, pid_m, pid_n, N, 0, N, BLOCK_N)


@triton.jit
def _cast_store(
    x, scale, DATA, DATA_T, pid_m, pid_n, M_OUT, N, ROW, COL0, fp8_max,
    E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr, COLUMNWISE: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Cast tile ``x`` with ``scale`` and store it at columns ``COL0 + pid_n * BLOCK_N + ...``
    (of ``N`` valid) of ``DATA`` ``[M_OUT, ROW]``, and transposed into ``DATA_T`` ``[ROW,
    M_OUT]``."""
    q = cast_fp8(x * scale, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
    r_in = tl.arange(0, BLOCK_M)
    c_in = tl.arange(0, BLOCK_N)
    offs = pid_m.to(tl.int64) * BLOCK_M * ROW + COL0 + pid_n * BLOCK_N
    offs += r_in[:, None] * ROW + c_in[None, :]
    offs_t = (COL0 + pid_n * BLOCK_N).to(tl.int64) * M_OUT + pid_m * BLOCK_M
    offs_t += c_in[:, None] * M_OUT + r_in[None, :]
    if EVEN:
        tl.store(DATA + offs, as_stored(q, DATA))
        if COLUMNWISE:
            tl.store(DATA_T + offs_t, as_stored(tl.trans(q), DATA_T))
    else:
        rows = pid_m * BLOCK_M + r_in
        cols = pid_n * BLOCK_N + c_in
        tl.store(
            DATA + offs, as_stored(q, DATA), mask=(rows[:, None] < M_OUT) & (cols[None, :] < N)
        )
        if COLUMNWISE:
            mask_t = (cols[:, None] < N) & (rows[None, :] < M_OUT)
            tl.store(DATA_T + offs_t, as_stored(tl.trans(q), DATA_T), mask=mask_t)


@triton.jit(do_not_specialize=["AMAX_SLOT"])  # one compile for every slot
def _act_cast_kernel(
    Z, B, G, MEAN, RSIG, SCALE, AMAX_BITS, AMAX_SLOT, DATA, DATA_T, SCALE_INV, PART, M, M_OUT, N,
    fp8_max, eps,
    FN: tl.constexpr, BWD: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    DBIAS: tl.constexpr, ROUND: tl.constexpr, E4M3: tl.constexpr, MBITS: tl.constexpr,
    BIAS: tl.constexpr, SOFTWARE: tl.constexpr, GUARD: tl.constexpr, FROM_AMAX: tl.constexpr,
    COLUMNWISE: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``_cast_kernel`` of ``kernels.quantize`` with the activation as its load. ``FROM_AMAX``:
    current scaling (the scale from ``AMAX_BITS[AMAX_SLOT]``); else ``SCALE`` is given and the
    tile's amax (and, with ``DBIAS``, its column sums) are folded. Program (0, 0) writes
    ``SCALE_INV``. The gated backward casts both halves of ``dz`` (``[M_OUT, 2N]``) from one
    read."""
    AMAX_BITS = AMAX_BITS.to(tl.pointer_type(tl.int32)) + AMAX_SLOT
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    eps = tl.cast(eps, tl.float32)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    first = (pid_m == 0) & (pid_n == 0)
    if GATED and BWD:
        va, xa, vl, xl, _ = _gated_bwd_tile(
            Z, B, G, pid_m, pid_n, M, N, FN, HAS_BIAS, ROUND, SOFTWARE, EVEN, BLOCK_M, BLOCK_N
        )
        scale = tile_scale(SCALE, AMAX_BITS, SCALE_INV, xa, first, fp8_max, eps, FROM_AMAX, False)
        tile_scale(SCALE, AMAX_BITS, SCALE_INV, xl, first, fp8_max, eps, FROM_AMAX, False)
        if DBIAS and not FROM_AMAX:
            _store_sums(PART, va, pid_m, pid_n, 2 * N, 0, N, BLOCK_N)
            _store_sums(PART, vl, pid_m, pid_n, 2 * N, N, N, BLOCK_N)
        _cast_store(
            xa, scale, DATA, DATA_T, pid_m, pid_n, M_OUT, N, 2 * N, 0, fp8_max, E4M3, MBITS,
            BIAS, SOFTWARE, GUARD, COLUMNWISE, EVEN, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        _cast_store(
            xl, scale, DATA, DATA_T, pid_m, pid_n, M_OUT, N, 2 * N, N, fp8_max, E4M3, MBITS,
            BIAS, SOFTWARE, GUARD, COLUMNWISE, EVEN, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    else:
        v, x, _ = _tile(
            Z, B, G, MEAN, RSIG, pid_m, pid_n, M, N, FN, BWD, GATED, HAS_BIAS, ROUND, SOFTWARE,
            EVEN, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        scale = tile_scale(SCALE, AMAX_BITS, SCALE_INV, x, first, fp8_max, eps, FROM_AMAX, False)
        if DBIAS and not FROM_AMAX:
            _store_sums(PART, v, pid_m, pid_n, N, 0, N, BLOCK_N)
        _cast_store(
            x, scale, DATA, DATA_T, pid_m, pid_n, M_OUT, N, N, 0, fp8_max, E4M3, MBITS,
            BIAS, SOFTWARE, GUARD, COLUMNWISE, EVEN, BLOCK_M, BLOCK_N,
        )  # fmt: skip


@triton.jit
def _block_store(
    x, DATA, SCALE_INV, DATA_T, SCALE_INV_T, pid_m, pid_n, M_OUT, N, ROW, COL0, fp8_max,
    S_ROW, S_BLK, T_ROW, T_BLK,
    E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr, POW2: tl.constexpr, EVEN: tl.constexpr, AXES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Cast tile ``x`` in 1x128 blocks (``AXES`` as in ``_act_block_kernel``) and store it at
    columns ``COL0 + pid_n * BLOCK_N + ...`` (of ``N`` valid; ``COL0`` a multiple of 128) of
    ``DATA`` ``[M_OUT, ROW]`` and transposed into ``DATA_T`` ``[ROW, M_OUT]``, with the blocks'
    inverse scales."""
    a = abs_bits(x)  # rows past M are 0: they never raise a block's amax
    r_in = tl.arange(0, BLOCK_M)
    c_in = tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + r_in
    cols = pid_n * BLOCK_N + c_in
    if AXES != 0:
        q, s = cast_1x128(x, a, 1, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
        offs = pid_m.to(tl.int64) * BLOCK_M * ROW + COL0 + pid_n * BLOCK_N
        offs += r_in[:, None] * ROW + c_in[None, :]
        s_offs = rows.to(tl.int64) * S_ROW + (COL0 // 128 + pid_n) * S_BLK
        if EVEN:
            tl.store(DATA + offs, as_stored(q, DATA))
            tl.store(SCALE_INV + s_offs, s)
        else:
            tl.store(
                DATA + offs, as_stored(q, DATA), mask=(rows[:, None] < M_OUT) & (cols[None, :] < N)
            )
            tl.store(SCALE_INV + s_offs, s, mask=rows < M_OUT)
    if AXES != 1:
        q_t, s_t = cast_1x128(x, a, 0, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
        offs_t = (COL0 + pid_n * BLOCK_N).to(tl.int64) * M_OUT + pid_m * BLOCK_M
        offs_t += c_in[:, None] * M_OUT + r_in[None, :]
        s_offs_t = (COL0 + cols).to(tl.int64) * T_ROW + pid_m * T_BLK
        if EVEN:
            tl.store(DATA_T + offs_t, as_stored(tl.trans(q_t), DATA_T))
            tl.store(SCALE_INV_T + s_offs_t, s_t)
        else:
            mask_t = (cols[:, None] < N) & (rows[None, :] < M_OUT)
            tl.store(DATA_T + offs_t, as_stored(tl.trans(q_t), DATA_T), mask=mask_t)
            tl.store(SCALE_INV_T + s_offs_t, s_t, mask=cols < N)


@triton.jit
def _act_block_kernel(
    Z, B, G, MEAN, RSIG, DATA, SCALE_INV, DATA_T, SCALE_INV_T, PART, M, M_OUT, N, fp8_max,
    S_ROW, S_BLK, T_ROW, T_BLK,
    FN: tl.constexpr, BWD: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    DBIAS: tl.constexpr, ROUND: tl.constexpr, E4M3: tl.constexpr, MBITS: tl.constexpr,
    BIAS: tl.constexpr, SOFTWARE: tl.constexpr, GUARD: tl.constexpr, POW2: tl.constexpr,
    EVEN: tl.constexpr, AXES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``_block_kernel`` of ``kernels.quantize`` (1x128 blocks) with the activation as its load,
    one tile per program. ``AXES`` 2: both layouts from one 128x128 tile; 1: the rowwise copy
    only (``BLOCK_N`` = 128: each tile row is one block; ``BLOCK_M`` free); 0: the transposed
    copy only (``BLOCK_M`` = 128, ``BLOCK_N`` free). With ``DBIAS`` the tile's column sums of the
    unrounded gradient go to row ``pid_m`` of ``PART``. ``S_*`` / ``T_*``: the strides (row,
    block) of ``SCALE_INV`` / ``SCALE_INV_T`` (compact or rows-major). The gated backward
    (``N`` a multiple of 128) casts both halves of ``dz`` (``[M_OUT, 2N]``) from one read."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GATED and BWD:
        va, xa, vl, xl, _ = _gated_bwd_tile(
            Z, B, G, pid_m, pid_n, M, N, FN, HAS_BIAS, ROUND, SOFTWARE, EVEN, BLOCK_M, BLOCK_N
        )
        if DBIAS:
            _store_sums(PART, va, pid_m, pid_n, 2 * N, 0, N, BLOCK_N)
            _store_sums(PART, vl, pid_m, pid_n, 2 * N, N, N, BLOCK_N)
        _block_store(
            xa, DATA, SCALE_INV, DATA_T, SCALE_INV_T, pid_m, pid_n, M_OUT, N, 2 * N, 0,
            fp8_max, S_ROW, S_BLK, T_ROW, T_BLK, E4M3, MBITS, BIAS, SOFTWARE, GUARD, POW2, EVEN,
            AXES, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        _block_store(
            xl, DATA, SCALE_INV, DATA_T, SCALE_INV_T, pid_m, pid_n, M_OUT, N, 2 * N, N,
            fp8_max, S_ROW, S_BLK, T_ROW, T_BLK, E4M3, MBITS, BIAS, SOFTWARE, GUARD, POW2, EVEN,
            AXES, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    else:
        v, x, _ = _tile(
            Z, B, G, MEAN, RSIG, pid_m, pid_n, M, N, FN, BWD, GATED, HAS_BIAS, ROUND, SOFTWARE,
            EVEN, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if DBIAS:
            _store_sums(PART, v, pid_m, pid_n, N, 0, N, BLOCK_N)
        _block_store(
            x, DATA, SCALE_INV, DATA_T, SCALE_INV_T, pid_m, pid_n, M_OUT, N, N, 0,
            fp8_max, S_ROW, S_BLK, T_ROW, T_BLK, E4M3, MBITS, BIAS, SOFTWARE, GUARD, POW2, EVEN,
            AXES, BLOCK_M, BLOCK_N,
        )  # fmt: skip


def _per_tensor(
    z: Tensor,
    bias: Tensor | None,
    grad: Tensor | None,
    norm: tuple[Tensor, Tensor, Tensor] | None,
    fn: int,
    gated: bool,
    fp8_dtype: torch.dtype,
    scale: Tensor | None,
    rows: int,
    m_out: int,
    columnwise: bool,
    need_dbias: bool,
    amax: Tensor | None,
    slot: int,
    amax_folded: bool,
    cfg: QuantizeLaunchConfig,
    name: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The launches of :func:`act_quantize` / :func:`norm_quantize`: ``z`` ``[>= rows, N]``
    read up to row ``rows``, outputs of ``m_out`` rows. ``amax``: the zeroed buffer
    (``kernels.quantize.amax_bits``; None: a new ``[1]`` one) whose element ``slot`` takes the
    amax, returned whole; ``amax_folded``: current scaling's first pass already folded
    it (the norm statistics kernel), else ``_act_amax_kernel`` runs it. ``norm``: the norm's
    ``(gamma, mean, rsigma)`` (``bias`` is its beta). ``gated``:
    ``z`` is ``[>= rows, 2N]`` (:func:`act_quantize`)."""
    n, n_out = _gated_widths(z, grad, gated)
    software = software_convert(z.device, cfg)
    data = torch.empty((m_out, n_out), device=z.device, dtype=fp8_dtype)
    data_t = z.new_empty((n_out, m_out) if columnwise else (0,), dtype=fp8_dtype)
    amax_pass = not amax_folded and scale is None
    if amax is None:
        amax = amax_bits(z)
    scale_inv = torch.empty(1, device=z.device, dtype=torch.float32)
    grid = (max(cdiv(m_out, cfg.block_m), 1), max(cdiv(n, cfg.block_k), 1))
    if cfg.block_m * z.shape[1] >= 2**31 or cfg.block_k * m_out >= 2**31:
        raise ValueError(f"{name}: [{m_out}, {z.shape[1]}] is too large for 32-bit tile offsets")
    dbias = need_dbias and bias is not None and grad is not None
    # Unused without dbias: z, read only (the written amax buffer would cost Inductor a copy).
    part = z.new_empty((grid[0], n_out), dtype=torch.float32) if dbias else z
    g = z if grad is None else grad
    gamma, mean, rsig = norm if norm is not None else (g, z, z)
    common = {
        "FN": fn,
        "BWD": grad is not None,
        "GATED": gated,
        "HAS_BIAS": bias is not None,
        "DBIAS": dbias,
        "ROUND": ROUNDING[z.dtype],
        "EVEN": rows == m_out and m_out % cfg.block_m == 0 and n % cfg.block_k == 0,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_k,
        "num_warps": cfg.num_warps,
    }
    b = z if bias is None else bias
    if amax_pass:
        launch(_act_amax_kernel, grid)(
            z, b, gamma, mean, rsig, amax, slot, part, rows, n, SOFTWARE=software,
            **common,
        )  # fmt: skip
    launch(_act_cast_kernel, grid)(
        z,
        b,
        gamma,
        mean,
        rsig,
        amax if scale is None else scale.reshape(1),  # current scaling: SCALE unused
        amax,
        slot,
        fp8_out(data),
        fp8_out(data_t),
        scale_inv,
        part,
        rows,
        m_out,
        n,
        FORMATS[fp8_dtype].max,
        0.0,
        **cast_args(fp8_dtype, software, z.dtype),
        FROM_AMAX=scale is None,
        COLUMNWISE=columnwise,
        **common,
    )
    db = part.sum(0).to(bias.dtype) if dbias else None
    return data, data_t, scale_inv, amax, db


def _blockwise(
    z: Tensor,
    bias: Tensor | None,
    grad: Tensor | None,
    norm: tuple[Tensor, Tensor, Tensor] | None,
    fn: int,
    gated: bool,
    fp8_dtype: torch.dtype,
    rows: int,
    m_out: int,
    need_dbias: bool,
    power_2_scale: bool,
    cfg: QuantizeLaunchConfig,
    name: str,
    mn_major: tuple[bool, bool] = (False, False),
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The launches of :func:`act_quantize_block` / :func:`norm_quantize_block` (arguments as
    in :func:`_per_tensor`; ``mn_major`` as in :func:`act_quantize_block`)."""
    n, n_out = _gated_widths(z, grad, gated)
    blk = BLOCK
    if n_out != n and n % blk:
        raise ValueError(
            f"{name}: a gated gradient in 1x128 blocks needs a half width that is a multiple of "
            f"{blk} (a block must not straddle the halves), got {n}"
        )
    if blk * z.shape[1] >= 2**31 or blk * m_out >= 2**31:
        raise ValueError(f"{name}: [{m_out}, {z.shape[1]}] is too large for 32-bit tile offsets")
    f32 = torch.float32
    data = torch.empty((m_out, n_out), device=z.device, dtype=fp8_dtype)
    data_t = torch.empty((n_out, m_out), device=z.device, dtype=fp8_dtype)
    dbias = need_dbias and bias is not None and grad is not None
    # csrc/block_cast.cu's activations: gelu and (gated) swiglu.
    cuda_act = {(FN_GELU.value, False): "gelu", (FN_SILU.value, True): "swiglu"}.get((fn, gated))
    cuda = cuda_cast(cfg, "act_cast_1x128", m_out, n, z, bias, grad)
    cuda = cuda if norm is None and cuda_act and rows == m_out else None
    scale_inv = block_scales(z, m_out, cdiv(n_out, blk), mn_major[0])
    scale_inv_t = block_scales(z, n_out, cdiv(m_out, blk), mn_major[1])
    if cuda is not None:
        # One read of the input, both layouts (csrc/block_cast.cu; same bytes).
        part = z.new_empty((m_out // blk, n_out), dtype=f32) if dbias else None
        cuda(
            z, bias, grad, uint8_view(data), scale_inv, uint8_view(data_t), scale_inv_t, part,
            FORMATS[fp8_dtype].max, fp8_dtype is torch.float8_e4m3fn, power_2_scale, cuda_act,
        )  # fmt: skip
        db = part.sum(0).to(bias.dtype) if dbias else None
        return data, scale_inv, data_t, scale_inv_t, db
    # One 128x128 tile for both layouts, or (block_split) a rowwise pass over [split_m, 128]
    # tiles and a columnwise one over [128, split_n] tiles: two reads of the input, but small
    # tiles keep many programs per SM (the one-tile form runs one, latency-bound).
    if cfg.block_split:
        w = cfg.num_warps
        passes = [(1, cfg.block_split_m, blk, w), (0, blk, cfg.block_split_n, w)]
    else:
        passes = [(2, blk, blk, cfg.block_num_warps)]
    part = z.new_empty((cdiv(m_out, passes[0][1]), n_out), dtype=f32) if dbias else None
    part = scale_inv if part is None else part
    g = z if grad is None else grad
    gamma, mean, rsig = norm if norm is not None else (g, z, z)
    for axes, bm, bn, warps in passes if m_out * n else ():
        launch(_act_block_kernel, (cdiv(m_out, bm), cdiv(n, bn)))(
            z,
            z if bias is None else bias,
            gamma,
            mean,
            rsig,
            fp8_out(data),
            scale_inv,
            fp8_out(data_t),
            scale_inv_t,
            part,
            rows,
            m_out,
            n,
            FORMATS[fp8_dtype].max,
            *scale_inv.stride(),
            *scale_inv_t.stride(),
            FN=fn,
            BWD=grad is not None,
            GATED=gated,
            HAS_BIAS=bias is not None,
            DBIAS=dbias and axes != 0,
            ROUND=ROUNDING[z.dtype],
            **cast_args(fp8_dtype, software_convert(z.device, cfg), z.dtype),
            POW2=power_2_scale,
            EVEN=rows == m_out and m_out % bm == 0 and n % bn == 0,
            AXES=axes,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=warps,
        )
    db = part.sum(0).to(bias.dtype) if dbias else None
    return data, scale_inv, data_t, scale_inv_t, db


def _gated_widths(z: Tensor, grad: Tensor | None, gated: bool) -> tuple[int, int]:
    """``(N, width of the quantised tensor)``: ``N`` the activation's output columns (half of
    ``z``'s for a gated one); the quantised tensor is ``[., N]``, or ``[., 2N]`` for a gated
    gradient (``dz``)."""
    n = z.shape[1] // 2 if gated else z.shape[1]
    return n, 2 * n if gated and grad is not None else n


def _activation_fn(name: str, activation: str) -> tuple[int, bool]:
    if activation not in FUNCTION_OF:
        raise ValueError(f"{name}: unknown activation {activation!r}")
    return FUNCTION_OF[activation], activation in GATED


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
    amax: Tensor | None = None,
    slot: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Quantise ``activation(z + bias)``, or with ``grad`` its gradient ``grad *
    activation'(z + bias)``, per tensor, without writing it: ``(data, data_t, scale_inv, amax,
    dbias)``.

    ``z`` / ``grad``: ``[M_OUT, N]`` contiguous, of the model's dtype (the value is rounded to it
    before the cast); only the first ``rows`` rows are real, the rest are written as zero codes.
    A gated activation (contiguous halves, clamped SwiGLU with its default ``limit`` / ``alpha``
    / ``glu_linear_offset``): ``z`` (and ``bias``) hold ``2N`` columns, activation half first;
    the forward quantises ``h`` ``[M_OUT, N]``, the backward (``grad`` ``[M_OUT, N]``) ``dz``
    ``[M_OUT, 2N]``, both halves under one scale, from one read of ``z`` and ``grad``.
    ``scale=None``: current scaling (two passes), else the 1-element delayed scale (one pass).
    ``dbias`` (with ``need_dbias``, backward only): fp32 column sums of the unrounded gradient,
    cast to ``bias``'s dtype. ``amax`` / ``slot``: a GEMM's amax buffer and this cast's element
    of it (``kernels.quantize.quantize_tensorwise``). Arguments are trusted
    (``functional.mlp_ops`` checks them)."""
    fn, gated = _activation_fn("act_quantize", activation)
    cfg = config or QuantizeLaunchConfig()
    return _per_tensor(
        z, bias, grad, None, fn, gated, fp8_dtype, scale, rows, z.shape[0], columnwise,
        need_dbias, amax, slot, False, cfg, "act_quantize",
    )  # fmt: skip


def act_quantize_block(
    z: Tensor,
    bias: Tensor | None,
    grad: Tensor | None,
    activation: str,
    fp8_dtype: torch.dtype,
    rows: int,
    need_dbias: bool,
    power_2_scale: bool,
    *,
    mn_major: tuple[bool, bool] = (False, False),
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``act_quantize`` for Float8BlockScaling's 1x128 blocks: ``(data, scale_inv, data_t,
    scale_inv_t, dbias)`` in the layouts of ``quantize_blockwise(..., block_rows=1,
    columnwise=True)`` (scale_inv ``[M_OUT, cdiv(C, 128)]``, scale_inv_t ``[C, cdiv(M_OUT,
    128)]``, ``C`` the quantised tensor's columns). Rows past ``rows`` are quantised as zeros.
    A gated gradient needs ``N`` (half of ``z``'s columns) a multiple of 128.
    ``mn_major`` asks for ``scale_inv`` / ``scale_inv_t`` in the blockwise GEMM's layout
    (``kernels.quantize.block_scales``). Arguments are trusted."""
    fn, gated = _activation_fn("act_quantize_block", activation)
    cfg = config or QuantizeLaunchConfig()
    return _blockwise(
        z, bias, grad, None, fn, gated, fp8_dtype, rows, z.shape[0], need_dbias, power_2_scale,
        cfg, "act_quantize_block", mn_major,
    )  # fmt: skip


def _norm_pass(x, weight, bias, normalization, eps, zero_centered_gamma, amax, slot=0):
    """The statistics pass of a norm prologue (``kernels.norm.norm_stats``, folding the output's
    amax into ``amax[slot]`` when given) and what the cast kernels take for it: ``(fn, (gamma,
    mean, rsigma), mean, rsigma)``; ``mean`` is 0-element for RMSNorm (``rsigma`` stands in for
    its pointer)."""
    mean, rsigma = norm_stats(
        normalization, x, weight, bias, eps, zero_centered_gamma, amax, slot=slot
    )
    fn = (_NORM_LN if normalization == "LayerNorm" else _NORM_RMS) + int(zero_centered_gamma)
    return fn, (weight, rsigma if mean.numel() == 0 else mean, rsigma), mean, rsigma


def norm_quantize(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool,
    fp8_dtype: torch.dtype,
    scale: Tensor | None,
    m_out: int,
    *,
    config: QuantizeLaunchConfig | None = None,
    amax: Tensor | None = None,
    slot: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Quantise the output of a LayerNorm / RMSNorm of ``x`` (``[M, N]`` contiguous) per tensor
    without writing it: ``(data, data_t, scale_inv, amax, mean, rsigma)``, ``data`` ``[m_out,
    N]`` and ``data_t`` ``[N, m_out]`` with rows ``M..m_out`` zero codes; ``mean`` / ``rsigma``
    as ``te::layernorm_fwd`` / ``te::rmsnorm_fwd`` return them (``mean`` 0-element for
    RMSNorm). The output is the one ``kernels.norm``'s forward would store, rounded to ``x``'s
    dtype. Current scaling (``scale=None``): a statistics pass that also takes the amax
    (``kernels.norm.norm_stats``), then the cast; delayed scaling: the statistics, then a cast
    that folds the amax. Two reads of ``x`` against a read, a write and two reads of a tensor
    of its size unfused. ``amax`` / ``slot``: as :func:`act_quantize`'s. Arguments are trusted
    (``functional.linear_ops`` checks them)."""
    cfg = config or QuantizeLaunchConfig()
    amax = amax_bits(x) if amax is None else amax
    # Current scaling: the statistics pass takes the amax (delayed: the cast folds it).
    fn, norm, mean, rsigma = _norm_pass(
        x, weight, bias, normalization, eps, zero_centered_gamma, amax if scale is None else None,
        slot,
    )  # fmt: skip
    data, data_t, scale_inv, amax, _ = _per_tensor(
        x, bias, None, norm, fn, False, fp8_dtype, scale, x.shape[0], m_out, True, False, amax,
        slot, scale is None, cfg, "norm_quantize",
    )  # fmt: skip
    return data, data_t, scale_inv, amax, mean, rsigma


def norm_quantize_block(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    normalization: str,
    eps: float,
    zero_centered_gamma: bool,
    fp8_dtype: torch.dtype,
    m_out: int,
    power_2_scale: bool,
    *,
    mn_major: tuple[bool, bool] = (False, False),
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`norm_quantize` in Float8BlockScaling's 1x128 blocks: ``(data, scale_inv, data_t,
    scale_inv_t, mean, rsigma)``, layouts as :func:`act_quantize_block`'s (``mn_major`` too)."""
    cfg = config or QuantizeLaunchConfig()
    fn, norm, mean, rsigma = _norm_pass(
        x, weight, bias, normalization, eps, zero_centered_gamma, None
    )
    data, s, data_t, s_t, _ = _blockwise(
        x, bias, None, norm, fn, False, fp8_dtype, x.shape[0], m_out, False, power_2_scale, cfg,
        "norm_quantize_block", mn_major,
    )  # fmt: skip
    return data, s, data_t, s_t, mean, rsigma
