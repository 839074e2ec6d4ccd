r"""Triton kernels for FP8 quantisation: per-tensor (delayed / current scaling) and blockwise.

The input is viewed as ``[M, K]`` (every leading index is a row). All math is fp32, whatever the
storage dtype; for a scale :math:`s` and the format's largest finite value :math:`F`
(448 for E4M3, 57344 for E5M2):

.. math::
    q = \operatorname{fp8}\big(\operatorname{clamp}(x\,s,\,-F,\,F)\big), \qquad
    s(a) = F / \max(a, \varepsilon) \;\;(\text{1 where that max is 0 or } \infty)

rounded to nearest even; NaN stays NaN, everything else saturates to :math:`\pm F`. The scale
rule is Transformer Engine's ``compute_scale_from_amax``: an fp32 overflow of :math:`F/a` (a
subnormal ``a``) becomes ``FLT_MAX``; with power-of-two scales the fp32 mantissa is cleared
(:math:`2^{\lfloor\log_2 s\rfloor}`); a NaN amax gives a NaN scale, and so does a block's
inf amax (``functional.quantize``'s edge semantics: blockwise casts report nothing, so such a
block dequantises to NaN instead of saturating). Division is
``div_rn`` (correctly rounded; Triton's ``/`` on CUDA is not), so the results match torch.

Kernels:

* ``_amax_kernel``: :math:`\max|x|` over the whole tensor. A fixed number of programs each
  reduce a contiguous chunk in registers and fold it into one fp32 with a single atomic max.
  The maximum is taken over the *int32 bits* of :math:`|x|`: for non-negative floats the
  integer order is the float order, and every NaN lies above :math:`+\infty`, so the integer
  max is a NaN-propagating float max (the float ``max`` of Triton is not NaN-propagating) and
  the int32 atomic max needs no compare-and-swap loop.
* ``_cast_kernel``: per-tensor cast of one ``BLOCK_M x BLOCK_K`` tile per program: ``data``,
  and with ``COLUMNWISE`` the transposed tile into ``data_t`` (``[K, M]``) from the same
  registers, so ``x`` is read once. Delayed scaling loads the given scale and folds the tile's
  amax into the amax output (one pass); current scaling loads the amax of ``_amax_kernel``,
  derives the scale in every program and program (0, 0) writes ``scale_inv`` (a second pass).
* ``_block_kernel``: blockwise cast of one tile of 128 columns per program, ``BLOCK_M`` rows
  (128 for 128x128 blocks and whenever the columnwise copy is made). Block amaxes are reduced in
  registers: per row for 1x128 blocks (and per column for the columnwise 1x128 copy of
  :math:`x^T`, whose blocks run along ``M``), over the whole tile for 128x128 blocks, where the
  columnwise copy is the transposed tile with the same scale.
* ``_dequant_kernel``: ``fp32(q) * scale_inv`` (one per tensor, or per block) to ``out_dtype``,
  saturating at its largest finite value.
* ``_rowwise_kernel``: one scale per row (``fp8_max / amax`` of the row; 1 for a zero or
  non-finite result), for the rowwise-scaled grouped FP8 GEMMs: ``BLOCK_M`` rows per program,
  the amax loop over the row, then the cast loop over it again (a re-read from L2).
* ``_columnwise_kernel``: the same per-slice quantisation along the *rows* of each matrix of a
  ``[B, N, K]`` tensor (one scale per column), stored transposed ``[B, K, N]``: the grouped
  dgrad's weight copy without a strided transpose of the high-precision weight first. Or along
  the rows of each token group of an ``[M, K]`` tensor, stored transposed with every group
  padded to a multiple of 16 rows: the grouped FP8 wgrad's operands.
* ``_recode_kernel``: FP8 bytes through a 256-entry table: E5M2 codes as the E4M3 codes of
  their values times ``2**-7``, for the grouped GEMM that takes E4M3 only.
* ``_delayed_update_kernel``: delayed scaling's state update (``te::delayed_scaling_update``):
  roll the ``[len, slots]`` amax history by one row, insert the last amaxes, recompute the
  scales, in one program and one launch (the plain-torch version is ~8 tiny kernels).

Storage: fp8 outputs and inputs cross the kernel boundary as their ``torch.uint8`` bit pattern
(``tensor.view(torch.uint8)``). On CUDA the conversion is the hardware's (``cvt.rn.satfinite``,
round to nearest even). Under ``TRITON_INTERPRET=1`` it cannot be: Triton's interpreter (3.x)
converts fp32 to fp8 rounding half *up* on the dropped bits with no carry into the exponent
(127.9 becomes 64), without NaN handling, and fp32 to bf16 by truncation. So off CUDA (or when
:attr:`QuantizeLaunchConfig.software_convert` asks for it) the kernels encode and decode fp8,
and round bf16 outputs, with integer bit arithmetic that is exact on every backend; the CPU
tests check it bit for bit against torch's conversions, and a CUDA test checks that both
conversion paths agree.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile import _csrc
from te_compile.kernels import aligned16, e5m2_to_e4m3_table, launch, programs_per_sm, tracing

__all__ = [
    "QuantizeLaunchConfig",
    "amax",
    "dequantize_blockwise",
    "dequantize_tensorwise",
    "e5m2_to_e4m3_table",
    "quantize_blockwise",
    "quantize_columnwise_transposed",
    "quantize_current",
    "quantize_group_columns",
    "quantize_tensorwise",
    "recode_e5m2_as_e4m3",
]

BLOCK = 128  # the quantisation block: 1x128 or 128x128 elements of the [M, K] view
_FLT_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class _Format:
    e4m3: bool
    mbits: int  # mantissa bits
    bias: int  # exponent bias
    max: float  # largest finite value


_FORMATS = {
    torch.float8_e4m3fn: _Format(True, 3, 7, 448.0),
    torch.float8_e5m2: _Format(False, 2, 15, 57344.0),
}


# Launch configuration ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantizeLaunchConfig:
    """Tiling of the launches. The defaults suit large tensors on a GPU; tests pass small tiles
    to reach many programs, partial tiles and multi-step amax chunks at sizes the interpreter
    runs quickly.

    ``block_m`` x ``block_k``: the tile of the per-tensor cast and of dequantisation (square
    tiles make the transposed store of ``data_t`` as wide as the rowwise one); ``block_m`` is
    also the rows per program of a rowwise-only 1x128 blockwise cast (other blockwise casts
    use 128 rows). ``amax_block``: elements per step of the amax reduction. ``amax_programs``:
    at most this many amax programs (None: 4 per SM on CUDA, 4 otherwise). ``software_convert``:
    integer fp8/bf16 conversion (None: exactly when not on CUDA; see the module docstring).
    ``block_num_warps``: warps of a blockwise cast with 128-row tiles. ``block_split`` (the
    fused activation + 1x128 cast, ``kernels.act_quantize.act_quantize_block``): a rowwise pass
    over ``[block_split_m, 128]`` tiles and a columnwise one over ``[128, block_split_n]`` tiles
    (``num_warps`` each) instead of one 128x128 tile for both. ``cuda_kernels``: use the
    C++/CUDA kernel of ``csrc/`` where one covers the call (``act_quantize_block``: gelu, bf16,
    whole 128x128 tiles), when the extension was built with CUDA."""

    block_m: int = 64
    block_k: int = 64
    amax_block: int = 4096
    amax_programs: int | None = None
    num_warps: int = 4
    block_num_warps: int = 8
    block_split: bool = True
    block_split_m: int = 32
    block_split_n: int = 64
    software_convert: bool | None = None
    cuda_kernels: bool = True

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k", "amax_block", "block_split_m", "block_split_n"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"QuantizeLaunchConfig: {name} must be a power of two, got {v}")
        if self.amax_programs is not None and self.amax_programs < 1:
            raise ValueError(
                f"QuantizeLaunchConfig: amax_programs must be >= 1, got {self.amax_programs}"
            )


_DEFAULT = QuantizeLaunchConfig()


def _software(device: torch.device, cfg: QuantizeLaunchConfig) -> bool:
    return device.type != "cuda" if cfg.software_convert is None else cfg.software_convert


# Device functions ----------------------------------------------------------------------------


@triton.jit
def _abs_bits(x):
    """``|x|`` as int32 bits; their integer max is a NaN-propagating float max (docstring)."""
    return tl.abs(x).to(tl.int32, bitcast=True)


@triton.jit
def _scale_from_amax(amax, fp8_max, eps, POW2: tl.constexpr):
    """Transformer Engine's ``compute_scale_from_amax`` (module docstring), elementwise."""
    amax = tl.where(amax < eps, eps, amax)  # not tl.maximum: a NaN amax must stay NaN
    unit = (amax == 0.0) | (amax == float("inf"))
    scale = tl.math.div_rn(fp8_max, tl.where(unit, 1.0, amax))  # no division by 0
    scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
    if POW2:
        # 0xFF800000: keep sign and exponent. NaN would become inf, so it is kept as it is.
        pow2 = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        scale = tl.where(scale == scale, pow2, scale)
    return tl.where(unit, 1.0, scale)


@triton.jit
def _block_scale(amax, fp8_max, POW2: tl.constexpr):
    """The scale of a block: ``_scale_from_amax`` (eps 0), NaN where the block holds inf (or
    NaN): the block dequantises to NaN rather than saturating unreported
    (``functional.quantize``'s edge semantics)."""
    return tl.where(amax == float("inf"), float("nan"), _scale_from_amax(amax, fp8_max, 0.0, POW2))


@triton.jit
def _slice_scale(amax_bits, fp8_max):
    """Current scale of a row or column from its amax (``_abs_bits`` max): ``fp8_max / amax``
    correctly rounded where ``amax > 0``, else 1, and 1 where that is not finite."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, tl.math.div_rn(fp8_max, tl.where(amax > 0, amax, 1.0)), 1.0)
    return tl.where(tl.abs(scale) < float("inf"), scale, 1.0)


@triton.jit
def _tile_scale(
    SCALE, AMAX_BITS, SCALE_INV, x, first, fp8_max, eps, FROM_AMAX: tl.constexpr,
    POW2: tl.constexpr,
):  # fmt: skip
    """The per-tensor scale a cast tile ``x`` uses. ``FROM_AMAX`` (current scaling): from the
    tensor's amax in ``AMAX_BITS``, and the ``first`` program writes ``SCALE_INV``; otherwise
    (delayed scaling) ``SCALE`` as given, and the tile's amax is folded into ``AMAX_BITS``."""
    if FROM_AMAX:
        amax = tl.load(AMAX_BITS).to(tl.float32, bitcast=True)
        scale = _scale_from_amax(amax, fp8_max, eps, POW2)
        if first:
            tl.store(SCALE_INV, tl.math.div_rn(1.0, scale))
    else:
        scale = tl.load(SCALE)
        tl.atomic_max(AMAX_BITS, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
    return scale


@triton.jit
def _saturate(y, fp8_max):
    return tl.clamp(y, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _cast_fp8(
    y, fp8_max, E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    """fp32 ``y`` saturated to ``[-fp8_max, fp8_max]`` (NaN stays NaN) and cast to the uint8
    bits of fp8, round to nearest even. ``fp8_max`` is the format's largest finite value.

    On the GPU that is the conversion instruction alone: Triton lowers it to
    ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32``, which saturates overflow and infinities to the
    largest finite value and keeps NaN a NaN (its NaN code may differ from torch's 0x7F; any
    NaN code decodes to NaN). A clamp and a NaN fix-up around it cost three instructions an
    element in kernels bound by instruction issue (``bench/diag/sass_quantize.py``).

    ``GUARD`` (set by ``_cast_args`` for fp32 sources): keep the clamp and the fix-up. On the
    H100 with Triton 3.6 (2026-11-22) the bare conversion of tiles loaded from fp32 tensors
    wrote a quarter of the codes as zeros (tests/kernels, fp32 cases); from bf16 / fp16 it is
    exact, and those are the sources of the training hot path."""
    if SOFTWARE or GUARD:
        return _to_fp8_bits(_saturate(y, fp8_max), E4M3, MBITS, BIAS, SOFTWARE)
    if E4M3:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return y.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def _to_fp8_bits(
    y, E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr
):
    """fp32 ``y``, already in ``[-max, max]`` or NaN, to the uint8 bits of fp8, round to
    nearest even; NaN as torch encodes it (0x7F)."""
    if not SOFTWARE:
        if E4M3:
            hw = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            hw = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
        return tl.where(y != y, 0x7F, hw).to(tl.uint8)
    bits = y.to(tl.uint32, bitcast=True)
    a = bits & 0x7FFFFFFF
    # Normal results: round the fp32 bits to MBITS mantissa bits (a carry out of the mantissa
    # correctly bumps the exponent), then re-bias the exponent.
    SHIFT: tl.constexpr = 23 - MBITS
    an = tl.maximum(a, (128 - BIAS) << 23)
    normal = (an + ((1 << (SHIFT - 1)) - 1) + ((an >> SHIFT) & 1)) >> SHIFT
    normal = normal - ((127 - BIAS) << MBITS)
    # Below the smallest normal 2^(1-BIAS): count quanta of 2^(1-BIAS-MBITS), rounded to
    # nearest even; a count of 2^MBITS is exactly the smallest normal's code.
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum(151 - BIAS - MBITS - (a >> 23).to(tl.int32), 1), 31)
    s = s.to(tl.uint32)
    sub = (m + ((1 << (s - 1)) - 1) + ((m >> s) & 1)) >> s
    code = tl.where(a < ((128 - BIAS) << 23), sub, normal)
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN, as torch encodes it
    return (code | ((bits >> 31) << 7)).to(tl.uint8)


@triton.jit
def _from_fp8_bits(
    q, E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr
):
    """uint8 bits of fp8 to fp32 (exact)."""
    if not SOFTWARE:
        if E4M3:
            return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return q.to(tl.float8e5, bitcast=True).to(tl.float32)
    b = q.to(tl.uint32)
    e = (b >> MBITS) & ((1 << (7 - MBITS)) - 1)
    m = b & ((1 << MBITS) - 1)
    normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    # Subnormal: m quanta of 2^(1-BIAS-MBITS), a power of two built from its bits.
    quantum = tl.full(m.shape, (128 - BIAS - MBITS) << 23, tl.int32).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * quantum, normal)
    if E4M3:
        v = tl.where((e == 15) & (m == 7), float("nan"), v)
    else:
        v = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), v)
    return _signed(v, (b >> 7) != 0)


@triton.jit
def _signed(v, negative):
    """``v`` (>= 0 or NaN) with its sign bit set where ``negative``: ``-0.0`` for a zero. (Triton
    compiles ``-v`` as ``0 - v`` on the GPU, which is ``+0.0`` for ``v = 0``.)"""
    bits = v.to(tl.uint32, bitcast=True) | (negative.to(tl.uint32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16_bits(y):
    """fp32 to the uint16 bits of bf16, round to nearest even (NaN stays a quiet NaN)."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, rounded).to(tl.uint16)


# Rounding of a value computed in fp32 (an activation, a norm's output) to the model's dtype
# before a cast, as the kernel that would have stored it in that dtype rounds it.
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
def _store_rounded(ptr, y, mask, BF16_BITS: tl.constexpr):
    """Store fp32 ``y`` rounded once to the output's dtype; ``BF16_BITS``: the output is bf16
    seen as uint16 and rounded here (the interpreter truncates fp32 to bf16; module docstring)."""
    if BF16_BITS:
        tl.store(ptr, _to_bf16_bits(y), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


# Kernels -------------------------------------------------------------------------------------


@triton.jit
def _amax_kernel(X, AMAX_BITS, numel, chunk, BLOCK_SIZE: tl.constexpr):
    """Program ``p`` reduces elements ``[p * chunk, (p + 1) * chunk)``; one atomic max each."""
    start = tl.program_id(0).to(tl.int64) * chunk
    end = tl.minimum(start + chunk, numel)
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    for s in range(start, end, BLOCK_SIZE):
        offs = s + tl.arange(0, BLOCK_SIZE)
        x = tl.load(X + offs, mask=offs < end, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    tl.atomic_max(AMAX_BITS, tl.max(acc, axis=0))


@triton.jit
def _cast_kernel(
    X,
    SCALE,
    AMAX_BITS,
    DATA,
    DATA_T,
    SCALE_INV,
    M,
    K,
    fp8_max,
    eps,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr,
    FROM_AMAX: tl.constexpr,
    POW2: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per-tensor cast of one tile. ``FROM_AMAX`` (current scaling): the scale comes from the
    amax in ``AMAX_BITS`` and program (0, 0) writes ``SCALE_INV``; otherwise (delayed scaling)
    ``SCALE`` is given and the tile's amax is folded into ``AMAX_BITS``."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    eps = tl.cast(eps, tl.float32)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    first = (pid_m == 0) & (pid_k == 0)
    scale = _tile_scale(SCALE, AMAX_BITS, SCALE_INV, x, first, fp8_max, eps, FROM_AMAX, POW2)
    q = _cast_fp8(x * scale, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
    tl.store(DATA + rows.to(tl.int64)[:, None] * K + cols[None, :], q, mask=mask)
    if COLUMNWISE:
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
        tl.store(DATA_T + offs_t, tl.trans(q), mask=mask_t)


@triton.jit
def _cast_1x128(
    x, a, AXIS: tl.constexpr, fp8_max, E4M3: tl.constexpr, MBITS: tl.constexpr,
    BIAS: tl.constexpr, SOFTWARE: tl.constexpr, POW2: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    """A tile ``x`` (``a = _abs_bits(x)``) cast in blocks along ``AXIS`` (1: each row of the
    tile is one block, 0: each column): ``(codes, inverse scale of each block)``."""
    amax = tl.max(a, axis=AXIS).to(tl.float32, bitcast=True)
    scale = _block_scale(amax, fp8_max, POW2)
    if AXIS == 1:
        q = _cast_fp8(x * scale[:, None], fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
    else:
        q = _cast_fp8(x * scale[None, :], fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
    return q, tl.math.div_rn(1.0, scale)


@triton.jit
def _block_kernel(
    X,
    DATA,
    SCALE_INV,
    DATA_T,
    SCALE_INV_T,
    M,
    K,
    fp8_max,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Blockwise cast of a ``BLOCK_M x BLOCK_K`` tile (``BLOCK_K`` = 128; ``BLOCK_M`` = 128
    for 128x128 blocks and with ``COLUMNWISE``)."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    a = _abs_bits(x)  # padding lanes are 0 and never raise a block's amax
    n_kb = tl.cdiv(K, BLOCK_K)
    mask_t = (cols[:, None] < K) & (rows[None, :] < M)
    offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
    if BLOCK_ROWS == 1:
        q, scale_inv = _cast_1x128(x, a, 1, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
        tl.store(SCALE_INV + rows.to(tl.int64) * n_kb + pid_k, scale_inv, mask=rows < M)
        if COLUMNWISE:
            # x^T in 1x128 blocks along M: one block per column of this tile.
            q_t, s_t = _cast_1x128(x, a, 0, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
            tl.store(DATA_T + offs_t, tl.trans(q_t), mask=mask_t)
            n_mb = tl.cdiv(M, BLOCK_M)
            tl.store(SCALE_INV_T + cols.to(tl.int64) * n_mb + pid_m, s_t, mask=cols < K)
    else:
        amax = tl.max(tl.max(a, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = _block_scale(amax, fp8_max, POW2)
        q = _cast_fp8(x * scale, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
        scale_inv = tl.math.div_rn(1.0, scale)
        tl.store(SCALE_INV + pid_m * n_kb + pid_k, scale_inv)
        if COLUMNWISE:
            # A 128x128 block of x^T is the transposed block of x: same scale, same codes.
            tl.store(DATA_T + offs_t, tl.trans(q), mask=mask_t)
            tl.store(SCALE_INV_T + pid_k * tl.cdiv(M, BLOCK_M) + pid_m, scale_inv)
    tl.store(DATA + offs, q, mask=mask)


@triton.jit
def _dequant_kernel(
    DATA,
    SCALE_INV,
    OUT,
    M,
    K,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_MAX: tl.constexpr,
):
    """``OUT = fp32(DATA) * SCALE_INV``; one scale (``BLOCK_ROWS == 0``) or one per block of
    ``BLOCK_ROWS x 128``. ``BF16_BITS``: ``OUT`` is a bf16 output seen as uint16, rounded here.
    Saturates at ``OUT_MAX``, the output's largest finite value, where the code is finite (NaN
    stays NaN), as the reference does."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    q = tl.load(DATA + offs, mask=mask, other=0)
    v = _from_fp8_bits(q, E4M3, MBITS, BIAS, SOFTWARE)
    if BLOCK_ROWS == 0:
        s = tl.load(SCALE_INV)
    else:
        n_kb = tl.cdiv(K, 128)
        s_offs = (rows // BLOCK_ROWS).to(tl.int64)[:, None] * n_kb + (cols // 128)[None, :]
        s = tl.load(SCALE_INV + s_offs, mask=mask, other=0.0)
    y = v * s
    finite_code = tl.abs(v) < float("inf")  # an E5M2 infinity stays infinite
    y = tl.where(finite_code, tl.clamp(y, -OUT_MAX, OUT_MAX, propagate_nan=tl.PropagateNan.ALL), y)
    _store_rounded(OUT + offs, y, mask, BF16_BITS)


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


@triton.jit
def _rowwise_kernel(
    X,
    DATA,
    SCALE_INV,
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
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Rows ``[pid * BLOCK_M, ...)``: amax over each row (NaN-propagating, on the int bits),
    ``scale = fp8_max / amax`` where ``amax > 0`` else 1, and 1 where that is not finite; then
    ``DATA = fp8(clamp(x * scale))`` and ``SCALE_INV = 1 / scale`` (both divisions correctly
    rounded: the same bytes as the torch definition in ``functional.grouped_fp8``).
    ``RECODE``: E5M2 stored as its E4M3 codes, ``SCALE_INV`` times 128 (:func:`_recoded`)."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    base = rows.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = in_rows[:, None] & (cols[None, :] < K)
        x = tl.load(X + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.max(_abs_bits(x), axis=1))
    scale = _slice_scale(acc, fp8_max)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = in_rows[:, None] & (cols[None, :] < K)
        x = tl.load(X + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q = _cast_fp8(x * scale[:, None], fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
        tl.store(DATA + base + cols[None, :], _recoded(q, TABLE, RECODE), mask=mask)
    tl.store(SCALE_INV + rows, _inverse(scale, RECODE), mask=in_rows)


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
            acc = tl.maximum(acc, tl.max(_abs_bits(x.to(tl.float32)), axis=0))
        scale = _slice_scale(acc, fp8_max)
    for n0 in range(0, rows_out, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < rows_in) & in_cols[None, :]
        x = tl.load(src + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
        y = x.to(tl.float32) * scale[None, :]
        q = tl.trans(
            _cast_fp8(y, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
        )  # [BLOCK_K, BLOCK_N]
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


@triton.jit
def _delayed_update_kernel(
    HIST,
    SCALE,
    AMAX,
    LIMIT,
    length,
    slots,
    row_stride,
    margin_factor,
    MAX_ALGO: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program: ``HIST[r] <- HIST[r - 1]`` (r >= 1), ``HIST[0] <- AMAX``, then
    ``SCALE <- LIMIT / (window * margin_factor)`` where the window (max over the new history, or
    its row 0) is positive and finite; NaN anywhere in the window keeps the old scale, as torch's
    NaN-propagating ``amax`` does in the reference."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    margin_factor = tl.cast(margin_factor, tl.float32)
    rows = tl.arange(0, BLOCK_L)[:, None]
    cols = tl.arange(0, BLOCK_S)[None, :]
    in_cols = cols < slots
    shifted = (rows >= 1) & (rows < length) & in_cols
    old = tl.load(HIST + (rows - 1) * row_stride + cols, mask=shifted, other=0.0)
    last = tl.load(AMAX + cols, mask=in_cols, other=0.0)
    new = tl.where(rows == 0, last, old)
    if MAX_ALGO:
        live = (rows < length) & in_cols
        window = tl.max(tl.where(live, new, 0.0), axis=0)
        has_nan = tl.max((live & (new != new)).to(tl.int32), axis=0) > 0
        window = tl.where(has_nan, float("nan"), window)
    else:  # row 0 alone (a sum of one value per column: NaN and inf pass through)
        window = tl.sum(tl.where(rows == 0, new, 0.0), axis=0)
    c = tl.arange(0, BLOCK_S)
    limit = tl.load(LIMIT + c, mask=c < slots, other=1.0)
    old_scale = tl.load(SCALE + c, mask=c < slots, other=1.0)
    ok = (window > 0) & (window < float("inf"))  # False for NaN
    new_scale = tl.where(ok, tl.div_rn(limit, window * margin_factor), old_scale)
    # Every thread has loaded its rows before any row is overwritten.
    tl.debug_barrier()
    tl.store(HIST + rows * row_stride + cols, new, mask=(rows < length) & in_cols)
    tl.store(SCALE + c, new_scale, mask=c < slots)


# Launch wrappers -----------------------------------------------------------------------------


def _rows(t: Tensor) -> tuple[Tensor, int, int]:
    """``[..., K]`` as a contiguous ``[M, K]`` (a copy only when not contiguous)."""
    m, k = math.prod(t.shape[:-1]), t.shape[-1]
    return t.contiguous().view(m, k), m, k


def _fp8_args(fp8_dtype: torch.dtype, software: bool) -> dict[str, object]:
    f = _FORMATS[fp8_dtype]
    return {"E4M3": f.e4m3, "MBITS": f.mbits, "BIAS": f.bias, "SOFTWARE": software}


def _cast_args(fp8_dtype: torch.dtype, software: bool, source: torch.dtype) -> dict[str, object]:
    """``_fp8_args`` of a kernel that casts to FP8 with ``_cast_fp8``, plus its ``GUARD``: set
    for fp32 sources (see ``_cast_fp8``)."""
    return {**_fp8_args(fp8_dtype, software), "GUARD": source == torch.float32}


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


def _recode_args(fp8_dtype: torch.dtype, data: Tensor, unused: Tensor) -> dict[str, object]:
    """``TABLE`` / ``RECODE`` of a kernel casting to ``fp8_dtype`` into ``data``: recoded when
    an E5M2 cast is stored into an E4M3 tensor (``unused``: any tensor, for no recoding)."""
    recode = fp8_dtype is torch.float8_e5m2 and data.dtype is torch.float8_e4m3fn
    return {"TABLE": e5m2_to_e4m3_table(data.device) if recode else unused, "RECODE": recode}


def _codes_dtype(fp8_dtype: torch.dtype, e4m3_codes: bool) -> torch.dtype:
    """The storage dtype of a cast to ``fp8_dtype``: E4M3 for E5M2 with ``e4m3_codes``."""
    return torch.float8_e4m3fn if e4m3_codes else fp8_dtype


def _rounded_out(out: Tensor, software: bool) -> tuple[Tensor, bool]:
    """The output argument of a kernel that ends in ``_store_rounded`` and its ``BF16_BITS``:
    under software conversion a bf16 output is passed as its uint16 bits."""
    bf16_bits = software and out.dtype == torch.bfloat16
    return (out.view(torch.uint16) if bf16_bits else out), bf16_bits


def _grid(m: int, k: int, bm: int, bk: int) -> tuple[int, int]:
    # At least one program: current scaling writes scale_inv even for an empty input.
    return max(triton.cdiv(m, bm), 1), max(triton.cdiv(k, bk), 1)


def amax_bits(device: torch.device) -> Tensor:
    """A zeroed ``[1]`` int32 buffer that kernels fold an amax into (``tl.atomic_max`` over the
    int32 bits of ``|x|``, module docstring); ``.view(torch.float32)`` reads it as the amax.
    Kernels are given this int32 buffer itself, never an int32 view of an fp32 one: Inductor
    (torch 2.11) cannot lower a kernel's write through a dtype view of a buffer the graph made
    (``make_reindexer NYI on DtypeView``)."""
    return torch.zeros(1, device=device, dtype=torch.int32)


def amax(x: Tensor, *, config: QuantizeLaunchConfig | None = None) -> Tensor:
    """``max|x|`` as a 1-element fp32 tensor (0 for an empty ``x``; NaN if any is NaN)."""
    return _amax_bits(x, config or _DEFAULT).view(torch.float32)


def _amax_bits(x: Tensor, cfg: QuantizeLaunchConfig) -> Tensor:
    """:func:`amax` as its int32 bits (:func:`amax_bits`)."""
    x = x.contiguous()
    out = amax_bits(x.device)
    n = x.numel()
    if n:
        cap = cfg.amax_programs or programs_per_sm(x.device, 4)
        programs = min(triton.cdiv(n, cfg.amax_block), cap)
        chunk = triton.cdiv(triton.cdiv(n, programs), cfg.amax_block) * cfg.amax_block
        launch(_amax_kernel, (triton.cdiv(n, chunk),))(
            x, out, n, chunk, BLOCK_SIZE=cfg.amax_block, num_warps=cfg.num_warps
        )
    return out


@functools.cache
def _cuda_op(name: str):
    """``torch.ops.te_cuda.<name>`` (csrc/block_cast.cu) when the C++ extension was built with
    CUDA, else None (a CPU build, or no extension: the Triton kernels run)."""
    try:
        _csrc.load()
    except ImportError:
        return None
    return getattr(torch.ops.te_cuda, name, None)


def _cuda_cast(cfg: QuantizeLaunchConfig, name: str, m: int, n: int, *tensors: Tensor | None):
    """The CUDA block cast ``name`` (``act_cast_1x128`` or ``cast_128x128``: both layouts, one
    read) when it covers a ``[m, n]`` call on ``tensors`` (the input, and the bias / gradient
    where given): CUDA bf16 tensors, 16-byte aligned, ``m`` and ``n`` whole 128x128 tiles; else
    None (the Triton kernels run)."""
    if not cfg.cuda_kernels or not (0 < m // BLOCK <= 65535 and m % BLOCK == 0 and n % BLOCK == 0):
        return None
    given = [t for t in tensors if t is not None]
    if tracing() or not all(
        t.is_cuda and t.dtype is torch.bfloat16 and aligned16(t) for t in given
    ):
        return None  # the C++ kernel has no fake: traced code launches the Triton kernels
    return _cuda_op(name)


def _transposed(x: Tensor, m: int, k: int, dtype: torch.dtype, columnwise: bool) -> Tensor:
    return x.new_empty((k, m) if columnwise else (0,), dtype=dtype)


def quantize_tensorwise(
    x: Tensor,
    scale: Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    *,
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Delayed scaling: ``(data, data_t, amax)`` from one read of ``x`` (see the op)."""
    cfg = config or _DEFAULT
    x2, m, k = _rows(x)
    data = torch.empty(x.shape, device=x.device, dtype=fp8_dtype)
    data_t = _transposed(x, m, k, fp8_dtype, columnwise)
    bits = amax_bits(x.device)
    if m * k:
        launch(_cast_kernel, _grid(m, k, cfg.block_m, cfg.block_k))(
            x2,
            scale.reshape(1).contiguous(),
            bits,
            _bits(data),
            _bits(data_t),
            bits,  # SCALE_INV: unused
            m,
            k,
            _FORMATS[fp8_dtype].max,
            0.0,
            **_cast_args(fp8_dtype, _software(x.device, cfg), x.dtype),
            FROM_AMAX=False,
            POW2=False,
            COLUMNWISE=columnwise,
            BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps,
        )
    return data, data_t, bits.view(torch.float32)


def quantize_current(
    x: Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
    *,
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Current scaling: ``(data, data_t, scale_inv, amax)``; two reads of ``x`` (the amax
    reduction, then the cast)."""
    cfg = config or _DEFAULT
    x2, m, k = _rows(x)
    data = torch.empty(x.shape, device=x.device, dtype=fp8_dtype)
    data_t = _transposed(x, m, k, fp8_dtype, columnwise)
    bits = _amax_bits(x2, cfg)
    scale_inv = torch.empty(1, device=x.device, dtype=torch.float32)
    launch(_cast_kernel, _grid(m, k, cfg.block_m, cfg.block_k))(
        x2,
        bits,  # SCALE: unused
        bits,
        _bits(data),
        _bits(data_t),
        scale_inv,
        m,
        k,
        _FORMATS[fp8_dtype].max,
        amax_epsilon,
        **_cast_args(fp8_dtype, _software(x.device, cfg), x.dtype),
        FROM_AMAX=True,
        POW2=power_2_scale,
        COLUMNWISE=columnwise,
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )
    return data, data_t, scale_inv, bits.view(torch.float32)


def quantize_blockwise(
    x: Tensor,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2_scale: bool,
    columnwise: bool,
    *,
    out_t: tuple[Tensor, Tensor] | None = None,
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Blockwise: ``(data, scale_inv, data_t, scale_inv_t)``, one read of ``x`` (see the op).
    ``out_t`` (with ``columnwise``): ``(data_t, scale_inv_t)`` to write the transposed copy
    into, e.g. views of a larger buffer, returned: ``data_t`` contiguous ``[K, M]`` of
    ``fp8_dtype`` or uint8, ``scale_inv_t`` fp32, compact or rows-major (strides ``(1, K)``,
    the GEMM's layout, :func:`block_scales`; written in place by the CUDA kernel, else
    through a compact copy)."""
    cfg = config or _DEFAULT
    x2, m, k = _rows(x)
    block_m = cfg.block_m if block_rows == 1 and not columnwise else BLOCK
    data = torch.empty(x.shape, device=x.device, dtype=fp8_dtype)
    f32 = torch.float32
    scale_inv = x.new_empty((triton.cdiv(m, block_rows), triton.cdiv(k, BLOCK)), dtype=f32)
    t_shape = (triton.cdiv(k, block_rows), triton.cdiv(m, BLOCK)) if columnwise else (0,)
    if out_t is None:
        data_t = _transposed(x, m, k, fp8_dtype, columnwise)
        scale_inv_t = x.new_empty(t_shape, dtype=f32)
    else:
        data_t, given_scale_t = out_t
        if not (
            columnwise
            and data_t.shape == (k, m)
            and data_t.dtype in (fp8_dtype, torch.uint8)
            and given_scale_t.shape == t_shape
            and given_scale_t.dtype is f32
            and data_t.is_contiguous()
            and (given_scale_t.is_contiguous() or given_scale_t.stride() == (1, t_shape[0]))
        ):
            raise ValueError(
                f"quantize_blockwise: out_t must be ([{k}, {m}] {fp8_dtype} or uint8, contiguous; "
                f"{list(t_shape)} float32, compact or with strides (1, {t_shape[0]})) with "
                "columnwise=True"
            )
        data_t = data_t.view(fp8_dtype)
        scale_inv_t = given_scale_t
    name = "act_cast_1x128" if block_rows == 1 else "cast_128x128"
    cuda = _cuda_cast(cfg, name, m, k, x2) if columnwise else None
    if cuda is None and not scale_inv_t.is_contiguous():  # the Triton kernel writes compact
        scale_inv_t = x.new_empty(t_shape, dtype=f32)
    f = _FORMATS[fp8_dtype]
    if cuda is not None and block_rows == 1:  # one read, both layouts (csrc/block_cast.cu)
        cuda(x2, None, None, _bits(data).view(m, k), scale_inv, _bits(data_t), scale_inv_t, None,
             f.max, f.e4m3, power_2_scale, "identity")  # fmt: skip
    elif cuda is not None:
        cuda(x2, _bits(data).view(m, k), scale_inv, _bits(data_t), scale_inv_t, f.max, f.e4m3,
             power_2_scale)  # fmt: skip
    elif m * k:
        launch(_block_kernel, (triton.cdiv(m, block_m), triton.cdiv(k, BLOCK)))(
            x2,
            _bits(data),
            scale_inv,
            _bits(data_t),
            scale_inv_t,
            m,
            k,
            f.max,
            **_cast_args(fp8_dtype, _software(x.device, cfg), x.dtype),
            POW2=power_2_scale,
            BLOCK_ROWS=block_rows,
            COLUMNWISE=columnwise,
            BLOCK_M=block_m,
            BLOCK_K=BLOCK,
            num_warps=cfg.block_num_warps if block_m == BLOCK else cfg.num_warps,
        )
    if out_t is not None and scale_inv_t is not out_t[1]:
        scale_inv_t = out_t[1].copy_(scale_inv_t)
    return data, scale_inv, data_t, scale_inv_t


def block_scales(x: Tensor, rows: int, blocks: int, mn_major: bool) -> Tensor:
    """An fp32 ``[rows, blocks]`` block-scale tensor on ``x``'s device: compact, or with
    ``mn_major`` rows-major (strides ``(1, rows)``), the layout cuBLAS's blockwise-scaled GEMM
    takes for a 1x128-scaled operand (``functional.gemm.block_scaled_mm`` then
    passes it without a copy)."""
    if mn_major:
        return x.new_empty((blocks, rows), dtype=torch.float32).t()
    return x.new_empty((rows, blocks), dtype=torch.float32)


def quantize_blockwise_sums(
    x: Tensor,
    fp8_dtype: torch.dtype,
    power_2_scale: bool,
    *,
    mn_major: tuple[bool, bool] = (False, False),
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``quantize_blockwise(x, fp8_dtype, 1, power_2_scale, True)`` and the fp32 column sums
    of ``x`` (``[K]``; a bias gradient when ``x`` is an output gradient): ``(data, scale_inv,
    data_t, scale_inv_t, sums)``. Where the CUDA kernel covers ``x``, one read of it: the sums
    are per-128-row-tile partials added afterwards (another order than ``x.sum(0)``: equal to
    rounding), and ``mn_major`` asks for ``scale_inv`` / ``scale_inv_t`` in the GEMM's layout
    (:func:`block_scales`; elsewhere they are compact: callers take either)."""
    cfg = config or _DEFAULT
    x2, m, k = _rows(x)
    cuda = _cuda_cast(cfg, "act_cast_1x128", m, k, x2)
    if cuda is None:
        return (*quantize_blockwise(x, fp8_dtype, 1, power_2_scale, True, config=cfg),
                x2.sum(0, dtype=torch.float32))  # fmt: skip
    data = torch.empty(x.shape, device=x.device, dtype=fp8_dtype)
    data_t = x.new_empty((k, m), dtype=fp8_dtype)
    scale_inv = block_scales(x, m, k // BLOCK, mn_major[0])
    scale_inv_t = block_scales(x, k, m // BLOCK, mn_major[1])
    part = x.new_empty((m // BLOCK, k), dtype=torch.float32)
    f = _FORMATS[fp8_dtype]
    cuda(x2, None, None, _bits(data).view(m, k), scale_inv, _bits(data_t), scale_inv_t, part,
         f.max, f.e4m3, power_2_scale, "identity")  # fmt: skip
    return data, scale_inv, data_t, scale_inv_t, part.sum(0)


def _dequantize(
    data: Tensor,
    scale_inv: Tensor,
    block_rows: int,
    out_dtype: torch.dtype,
    cfg: QuantizeLaunchConfig,
) -> Tensor:
    q, m, k = _rows(data)
    out = torch.empty(data.shape, device=data.device, dtype=out_dtype)
    software = _software(data.device, cfg)
    out_arg, bf16_bits = _rounded_out(out, software)
    if m * k:
        launch(_dequant_kernel, _grid(m, k, cfg.block_m, cfg.block_k))(
            _bits(q),
            scale_inv.contiguous(),
            out_arg,
            m,
            k,
            **_fp8_args(data.dtype, software),
            BF16_BITS=bf16_bits,
            BLOCK_ROWS=block_rows,
            BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_k,
            OUT_MAX=torch.finfo(out_dtype).max,
            num_warps=cfg.num_warps,
        )
    return out


def dequantize_tensorwise(
    data: Tensor,
    scale_inv: Tensor,
    out_dtype: torch.dtype,
    *,
    config: QuantizeLaunchConfig | None = None,
) -> Tensor:
    """``fp32(data) * scale_inv`` rounded to ``out_dtype``; ``scale_inv`` has one element."""
    return _dequantize(data, scale_inv.reshape(1), 0, out_dtype, config or _DEFAULT)


def dequantize_blockwise(
    data: Tensor,
    scale_inv: Tensor,
    block_rows: int,
    out_dtype: torch.dtype,
    *,
    config: QuantizeLaunchConfig | None = None,
) -> Tensor:
    """``fp32(data) * scale_inv`` per ``block_rows x 128`` block of the ``[M, K]`` view."""
    return _dequantize(data, scale_inv, block_rows, out_dtype, config or _DEFAULT)


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
    launch(_columnwise_kernel, (slices, triton.cdiv(k, block_k)))(
        x,
        _bits(data_t),
        scale_inv,
        scale_inv if scale is None else scale,
        *((scale_inv, scale_inv) if ends is None else ends),  # unused without groups
        n,
        k,
        _FORMATS[fp8_dtype].max,
        **_recode_args(fp8_dtype, data_t, scale_inv),
        **_cast_args(fp8_dtype, _software(x.device, _DEFAULT), x.dtype),
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
        grid = (triton.cdiv(src.numel(), block),)
        launch(_recode_kernel, grid)(src, out, table, src.numel(), BLOCK_SIZE=block, num_warps=4)
    return out.view(torch.float8_e4m3fn)


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    limits: Tensor,
    margin: int,
    max_algo: bool,
) -> None:
    """In place, one launch: see ``_delayed_update_kernel``. ``amax_history`` ``[len, slots]``
    with unit column stride (a leading-rows slice of a larger buffer is fine); ``scale``,
    ``amax`` and ``limits`` (the formats' largest values) contiguous fp32 ``[slots]``."""
    length, slots = amax_history.shape
    if amax_history.stride(1) != 1 or not (scale.is_contiguous() and amax.is_contiguous()):
        raise ValueError("delayed_scaling_update: expects unit column stride / contiguous slots")
    launch(_delayed_update_kernel, (1,))(
        amax_history,
        scale,
        amax,
        limits,
        length,
        slots,
        amax_history.stride(0),
        2.0**margin,
        MAX_ALGO=max_algo,
        BLOCK_L=triton.next_power_of_2(length),
        BLOCK_S=triton.next_power_of_2(slots),
        num_warps=4,
    )


def quantize_rowwise(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    e4m3_codes: bool = False,
    block_m: int = 4,
    block_k: int = 1024,
) -> tuple[Tensor, Tensor]:
    """``(data, scale_inv)``: every row of ``x`` (``[..., K]``, the last dim) cast to
    ``fp8_dtype`` with its own current scale; ``scale_inv`` fp32 of ``x``'s shape without the
    last dim. One launch, ``x`` read from memory once (see ``_rowwise_kernel``).
    ``e4m3_codes``: an E5M2 cast stored as E4M3 codes with ``scale_inv`` times 128, the bytes
    of :func:`recode_e5m2_as_e4m3` without its pass."""
    x2, m, k = _rows(x)
    data = torch.empty(x.shape, device=x.device, dtype=_codes_dtype(fp8_dtype, e4m3_codes))
    scale_inv = torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)
    if m * k:
        bk = min(block_k, triton.next_power_of_2(k))
        launch(_rowwise_kernel, (triton.cdiv(m, block_m),))(
            x2,
            _bits(data),
            scale_inv,
            m,
            k,
            _FORMATS[fp8_dtype].max,
            **_recode_args(fp8_dtype, data, scale_inv),
            **_cast_args(fp8_dtype, _software(x.device, _DEFAULT), x.dtype),
            BLOCK_M=block_m,
            BLOCK_K=bk,
            num_warps=4,
        )
    elif m:
        scale_inv.fill_(128.0 if data.dtype != fp8_dtype else 1.0)  # an empty row: scale 1
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
    ``s`` half the difference of their largest exponents (``functional.grouped_fp8._balanced``,
    whose torch ops are ten launches in eager): one launch of one program."""
    out_a, out_b = torch.empty_like(sa), torch.empty_like(sb)
    launch(_balance_scales_kernel, (1,))(
        sa, sb, out_a, out_b, sa.numel(), sb.numel(), BLOCK=1024, num_warps=4
    )
    return out_a, out_b
