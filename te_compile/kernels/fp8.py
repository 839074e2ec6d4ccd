r"""The FP8 encoding the cast kernels share (``kernels.quantize``, ``kernels.quantize_rows``,
``kernels.act_quantize``, ``kernels.norm``): the two formats, Transformer Engine's scale rule
and its block / slice variants, the saturating cast, the exact integer conversions used off CUDA
(``software_convert``), the rounding of an fp32 value to the model's dtype before a cast, and the
launch configuration of the casts. ``kernels.quantize``'s docstring gives the math and why the
software conversions exist."""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile.kernels import cdiv

__all__ = [
    "BLOCK",
    "DEFAULT_CONFIG",
    "FORMATS",
    "FP32_MAX",
    "ROUNDING",
    "ROUND_BF16",
    "ROUND_FP16",
    "ROUND_NONE",
    "Fp8Format",
    "QuantizeLaunchConfig",
    "abs_bits",
    "as_rows",
    "as_stored",
    "block_scale",
    "cast_args",
    "cast_fp8",
    "fold_amax",
    "fp8_args",
    "fp8_out",
    "from_fp8_bits",
    "grid_2d",
    "round_to",
    "rounded_out",
    "saturate",
    "scale_from_amax",
    "signed",
    "slice_scale",
    "software_convert",
    "store_rounded",
    "tile_scale",
    "to_bf16_bits",
    "to_fp8_bits",
    "uint8_view",
]

BLOCK = 128  # the quantisation block: 1x128 or 128x128 elements of the [M, K] view
FP32_MAX = 3.4028234663852886e38


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    e4m3: bool
    mbits: int  # mantissa bits
    bias: int  # exponent bias
    max: float  # largest finite value


FORMATS = {
    torch.float8_e4m3fn: Fp8Format(True, 3, 7, 448.0),
    torch.float8_e5m2: Fp8Format(False, 2, 15, 57344.0),
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
    use 128 rows). ``amax_block``: elements per step of the amax reduction, ``amax_num_warps``
    its warps. ``amax_programs``: at most this many amax programs (None: ``amax_per_sm`` per SM
    on CUDA, 4 otherwise); each reduces a contiguous chunk of whole steps, one after the other,
    so fewer, longer programs wait on more loads in series. ``software_convert``:
    integer fp8/bf16 conversion (None: exactly when not on CUDA; see the module docstring).
    ``block_num_warps``: warps of a blockwise cast with 128-row tiles. ``block_split`` (the
    fused activation + 1x128 cast, ``kernels.act_quantize.act_quantize_block``): a rowwise pass
    over ``[block_split_m, 128]`` tiles and a columnwise one over ``[128, block_split_n]`` tiles
    (``num_warps`` each) instead of one 128x128 tile for both. ``cuda_kernels``: use the
    C++/CUDA kernel of ``csrc/`` where one covers the call (``act_quantize_block``: gelu, bf16,
    whole 128x128 tiles), when the extension was built with CUDA."""

    block_m: int = 64
    block_k: int = 64
    amax_block: int = 2048
    amax_num_warps: int = 16
    amax_programs: int | None = None
    amax_per_sm: int = 4
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
        for name in ("amax_programs", "amax_per_sm", "amax_num_warps"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"QuantizeLaunchConfig: {name} must be >= 1, got {v}")


DEFAULT_CONFIG = QuantizeLaunchConfig()


def software_convert(device: torch.device, cfg: QuantizeLaunchConfig) -> bool:
    return device.type != "cuda" if cfg.software_convert is None else cfg.software_convert


# Device functions ----------------------------------------------------------------------------


@triton.jit
def abs_bits(x):
    """``|x|`` as int32 bits; their integer max is a NaN-propagating float max (docstring)."""
    return tl.abs(x).to(tl.int32, bitcast=True)


@triton.jit
def fold_amax(AMAX_BITS, bits):
    """Fold a tile's amax ``bits`` (an ``abs_bits`` max) into ``AMAX_BITS`` (int32): the atomic
    is skipped where the value read there is already at least ``bits``. That value only grows, so
    a stale read costs one atomic, never a wrong amax, and most tiles skip theirs instead of
    queueing on the one address."""
    tl.atomic_max(AMAX_BITS, bits, mask=bits > tl.load(AMAX_BITS))


@triton.jit
def scale_from_amax(amax, fp8_max, eps, POW2: tl.constexpr):
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
def block_scale(amax, fp8_max, POW2: tl.constexpr):
    """The scale of a block: ``scale_from_amax`` (eps 0), NaN where the block holds inf (or
    NaN): the block dequantises to NaN rather than saturating unreported
    (``functional.quantize``'s edge semantics)."""
    return tl.where(amax == float("inf"), float("nan"), scale_from_amax(amax, fp8_max, 0.0, POW2))


@triton.jit
def slice_scale(amax_bits, fp8_max):
    """Current scale of a row or column from its amax (``abs_bits`` max): ``fp8_max / amax``
    correctly rounded where ``amax > 0``, else 1, and 1 where that is not finite."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    scale = tl.where(amax > 0, tl.math.div_rn(fp8_max, tl.where(amax > 0, amax, 1.0)), 1.0)
    return tl.where(tl.abs(scale) < float("inf"), scale, 1.0)


@triton.jit
def tile_scale(
    SCALE, AMAX_BITS, SCALE_INV, x, first, fp8_max, eps, FROM_AMAX: tl.constexpr,
    POW2: tl.constexpr,
):  # fmt: skip
    """The per-tensor scale a cast tile ``x`` uses, and the ``first`` program writes its inverse
    into ``SCALE_INV``. ``FROM_AMAX`` (current scaling): from the tensor's amax in
    ``AMAX_BITS``; otherwise (delayed scaling) ``SCALE`` as given, and the tile's amax is folded
    into ``AMAX_BITS`` (the inverse written here spares a compiled graph one reciprocal kernel
    per operand)."""
    if FROM_AMAX:
        amax = tl.load(AMAX_BITS).to(tl.float32, bitcast=True)
        scale = scale_from_amax(amax, fp8_max, eps, POW2)
    else:
        scale = tl.load(SCALE)
        fold_amax(AMAX_BITS, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    if first:
        tl.store(SCALE_INV, tl.math.div_rn(1.0, scale))
    return scale


@triton.jit
def saturate(y, fp8_max):
    return tl.clamp(y, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def cast_fp8(
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

    ``GUARD`` (set by ``cast_args`` for fp32 sources): keep the clamp and the fix-up. On the
    H100 with Triton 3.6 (2026-11-22) the bare conversion of tiles loaded from fp32 tensors
    wrote a quarter of the codes as zeros (tests/kernels, fp32 cases); from bf16 / fp16 it is
    exact, and those are the sources of the training hot path."""
    if SOFTWARE or GUARD:
        return to_fp8_bits(saturate(y, fp8_max), E4M3, MBITS, BIAS, SOFTWARE)
    if E4M3:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return y.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def to_fp8_bits(
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
def from_fp8_bits(
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
    return signed(v, (b >> 7) != 0)


@triton.jit
def signed(v, negative):
    """``v`` (>= 0 or NaN) with its sign bit set where ``negative``: ``-0.0`` for a zero. (Triton
    compiles ``-v`` as ``0 - v`` on the GPU, which is ``+0.0`` for ``v = 0``.)"""
    bits = v.to(tl.uint32, bitcast=True) | (negative.to(tl.uint32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_bf16_bits(y):
    """fp32 to the uint16 bits of bf16, round to nearest even (NaN stays a quiet NaN)."""
    bits = y.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, rounded).to(tl.uint16)


# Rounding of a value computed in fp32 (an activation, a norm's output) to the model's dtype
# before a cast, as the kernel that would have stored it in that dtype rounds it.
ROUND_NONE = 0
ROUND_BF16 = 1
ROUND_FP16 = 2
ROUNDING = {torch.float32: ROUND_NONE, torch.bfloat16: ROUND_BF16, torch.float16: ROUND_FP16}


@triton.jit
def round_to(y, ROUND: tl.constexpr, SOFTWARE: tl.constexpr):
    """``y`` (fp32) rounded to nearest even to bf16 / fp16 and back (exact fp32 values)."""
    if ROUND == 1:
        if SOFTWARE:  # the interpreter truncates fp32 to bf16 (kernels.quantize docstring)
            y = (to_bf16_bits(y).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            y = y.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def store_rounded(ptr, y, mask, BF16_BITS: tl.constexpr):
    """Store fp32 ``y`` rounded once to the output's dtype; ``BF16_BITS``: the output is bf16
    seen as uint16 and rounded here (the interpreter truncates fp32 to bf16; module docstring)."""
    if BF16_BITS:
        tl.store(ptr, to_bf16_bits(y), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


# Kernels -------------------------------------------------------------------------------------


def as_rows(t: Tensor) -> tuple[Tensor, int, int]:
    """``[..., K]`` as a contiguous ``[M, K]`` (a copy only when not contiguous; ``t`` itself,
    no torch call, when it is one)."""
    m, k = math.prod(t.shape[:-1]), t.shape[-1]
    return (t if t.dim() == 2 and t.is_contiguous() else t.contiguous().view(m, k)), m, k


def fp8_args(fp8_dtype: torch.dtype, software: bool) -> dict[str, object]:
    f = FORMATS[fp8_dtype]
    return {"E4M3": f.e4m3, "MBITS": f.mbits, "BIAS": f.bias, "SOFTWARE": software}


def cast_args(fp8_dtype: torch.dtype, software: bool, source: torch.dtype) -> dict[str, object]:
    """``fp8_args`` of a kernel that casts to FP8 with ``cast_fp8``, plus its ``GUARD``: set
    for fp32 sources (see ``cast_fp8``)."""
    return {**fp8_args(fp8_dtype, software), "GUARD": source == torch.float32}


def uint8_view(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


def fp8_out(t: Tensor) -> Tensor:
    """An fp8 output as our Triton kernels take it: the tensor itself on CUDA (the kernel stores
    its codes through ``as_stored``), its uint8 bits elsewhere (Triton's interpreter has no fp8
    arrays). On CUDA that is no view per call: under ``torch.compile`` each ``view(uint8)`` was
    a dispatcher call of the host in Inductor's code, 24 per FP8 decoder layer."""
    return t if t.is_cuda else t.view(torch.uint8)


@triton.jit
def as_stored(q, PTR):
    """uint8 fp8 codes ``q`` as ``PTR``'s element type, bit for bit (``fp8_out``)."""
    return q.to(PTR.dtype.element_ty, bitcast=True)


def rounded_out(out: Tensor, software: bool) -> tuple[Tensor, bool]:
    """The output argument of a kernel that ends in ``store_rounded`` and its ``BF16_BITS``:
    under software conversion a bf16 output is passed as its uint16 bits."""
    bf16_bits = software and out.dtype == torch.bfloat16
    return (out.view(torch.uint16) if bf16_bits else out), bf16_bits


def grid_2d(m: int, k: int, bm: int, bk: int) -> tuple[int, int]:
    # At least one program: current scaling writes scale_inv even for an empty input.
    return max(cdiv(m, bm), 1), max(cdiv(k, bk), 1)
