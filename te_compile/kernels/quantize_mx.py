r"""Triton kernels for MXFP8 and NVFP4 block quantisation, and their dequantisation.

The formats, layouts and every rounding decision are defined by the reference math in
``te_compile.functional.quantize_mx`` (read its module docstring first); these kernels reproduce
it bit for bit. The input is viewed as ``[M, K]`` (rows = every leading index). Work layout:

* quantise: one program per ``[BLOCK_M, BLOCK_K]`` tile of ``x`` (both multiples of the scaling
  block, 32 for MXFP8 and 16 for NVFP4), read **once** in fp32 and used for both directions:
  ``tl.reshape`` to ``[BLOCK_M, BLOCK_K / B, B]`` gives the rowwise blocks (scale per row and
  block of columns), to ``[BLOCK_M / B, B, BLOCK_K]`` the columnwise ones (scale per column and
  block of rows). Columnwise results are stored transposed (``data_t[k, m]``). Lanes past the
  end of ``x`` load 0, which leaves every block amax unchanged: that is the zero padding of a
  last, partial block.
* dequantise: one program per tile of the quantised data; each element gathers its block scale.

Low-precision values are produced and consumed as **integer bit patterns** (``uint8`` stores into
``.view(torch.uint8)`` of the fp8 outputs), with round-to-nearest-even and saturation done in
int32 arithmetic (:func:`_encode`). One code path then gives identical bits on every GPU (Triton's
fp8 casts need sm89+, and it has no E2M1 cast) and under ``TRITON_INTERPRET=1``, whose numpy
backend has no fp8 types at all. For the same reason bf16 crosses the kernel boundary as int16
bits, widened and rounded by hand (:func:`load_x`, :func:`_bf16_bits`): the interpreter flushes
bf16 subnormals to zero on loads and truncates fp32 to bf16 on stores, where the GPU is exact on
the first and rounds to nearest even on the second.
Powers of two are built from exponent bits (:func:`_pow2`), never with ``exp2``, and the NVFP4
divisions use ``tl.div_rn`` (IEEE division also where ``/`` may be approximate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile.kernels import bf16_bits, cdiv, kernel_arg, launch
from te_compile.kernels.fp8 import as_rows, signed

__all__ = ["dequantize_mxfp8", "dequantize_nvfp4", "quantize_mxfp8", "quantize_nvfp4"]

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
# Tile edge of every kernel (elements of x, or packed bytes for the NVFP4 dequantise): a
# multiple of both block sizes; 64 x 64 fp32 values are 16 per thread at 8 warps.
_TILE = 64
_NUM_WARPS = 8

# Element formats: (mantissa bits, smallest normal exponent, largest finite value, exponent of
# the largest power of two below it = OCP's emax_elem).
_E4M3 = (3, -6, 448.0, 8)
_E5M2 = (2, -14, 57344.0, 15)
_FP8_FORMATS = {torch.float8_e4m3fn: _E4M3, torch.float8_e5m2: _E5M2}
FP32_MAX = 3.4028234663852886e38


# Bit-level helpers ----------------------------------------------------------------------------


@triton.jit
def _pow2(e):
    """``2.0 ** e`` in fp32 for int32 ``e`` in [-126, 127], exact (the exponent field itself)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _encode(v, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr):
    """``(magnitude_code, sign)`` of fp32 ``v`` in a small float format with ``MBITS`` mantissa
    bits, smallest normal exponent ``EMIN``, subnormals, and no inf: ``|v|`` saturates at
    ``MAXV`` and is rounded to nearest, ties to even. ``v`` must not be NaN (the callers
    overwrite NaN blocks).

    The fp32 significand (implicit bit included) is shifted right by the number of bits the
    target keeps fewer (more below ``EMIN``, where the target is subnormal) and rounded on the
    dropped bits. The code is then ``(e - EMIN) << MBITS`` plus the kept significand, whose
    carry into the exponent field is exactly what a round-up across a binade needs."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    u = tl.minimum(tl.abs(v), MAXV).to(tl.int32, bitcast=True)
    ef = u >> 23
    sig = (u & 0x7FFFFF) | tl.where(ef > 0, 0x800000, 0)
    e = tl.maximum(ef, 1) - 127  # fp32 subnormals have exponent -126 and no implicit bit
    # Past 25 dropped bits everything rounds to 0; the clamp keeps shifts defined.
    shift = tl.minimum(23 - MBITS + tl.maximum(EMIN - e, 0), 25)
    q = sig >> shift
    rem = sig - (q << shift)
    half = (sig * 0 + 1) << (shift - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return (tl.maximum(e - EMIN, 0) << MBITS) + q, sign


@triton.jit
def _decode(mag, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """fp32 value of a magnitude code (no sign bit; no special values, see the callers)."""
    ef = mag >> MBITS
    m = mag & ((1 << MBITS) - 1)
    m = tl.where(ef > 0, m + (1 << MBITS), m)
    return m.to(tl.float32) * _pow2(tl.maximum(ef, 1) - 1 + EMIN - MBITS)


@triton.jit
def _decode_fp8(code, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """fp32 value of an fp8 code: E4M3 (``MBITS=3``; NaN = S.1111.111) or E5M2 (inf and NaN)."""
    mag = code & 0x7F
    v = _decode(mag, MBITS, EMIN)
    if MBITS == 3:
        v = tl.where(mag == 0x7F, float("nan"), v)
    else:
        v = tl.where(mag >= 0x7C, tl.where(mag == 0x7C, float("inf"), float("nan")), v)
    return signed(v, (code & 0x80) != 0)


@triton.jit
def _e8m0_to_f32(b):
    """E8M0 biased exponent -> ``2.0 ** (b - 127)``; 0 is the fp32 subnormal 2**-127, 255 NaN."""
    bits = tl.where(b == 0, 0x00400000, b << 23)
    return tl.where(b == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 bit pattern (int32 holding 16 bits), rounded to nearest even; NaN quiet."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded & 0xFFFF)


@triton.jit
def store_out(OUT, offs, v, mask, OUT_BF16: tl.constexpr):
    """Store fp32 ``v`` in the output's dtype; ``OUT`` is an int16 view for a bf16 output."""
    if OUT_BF16:
        tl.store(OUT + offs, _bf16_bits(v).to(tl.int16), mask=mask)
    else:
        tl.store(OUT + offs, v.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def load_x(X, offs, mask, IN_BF16: tl.constexpr):
    """A tile of ``x`` in fp32; ``X`` is an int16 view for a bf16 input, widened by hand
    (exact; the interpreter's own conversion flushes bf16 subnormals to zero)."""
    if IN_BF16:
        bits = tl.load(X + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)


# Block maxima are taken over the bit patterns of |x| (int32, sign cleared): for non-negative
# floats the integer order is the float order, and inf and NaN compare above every finite
# value, so one integer max gives both the amax and whether the block is finite.


@triton.jit
def _row_blocks_max(bits, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr):
    """``[BLOCK_M, BLOCK_K]`` -> ``[BLOCK_M, BLOCK_K / B]``: max over 1 x B blocks."""
    return tl.max(tl.reshape(bits, (BLOCK_M, BLOCK_K // B, B)), axis=2)


@triton.jit
def _col_blocks_max(bits, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr):
    """``[BLOCK_M, BLOCK_K]`` -> ``[BLOCK_M / B, BLOCK_K]``: max over B x 1 blocks."""
    return tl.max(tl.reshape(bits, (BLOCK_M // B, B, BLOCK_K)), axis=1)


@triton.jit
def _row_blocks_expand(v, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr):
    """Inverse shape of :func:`_row_blocks_max`: each block's value on each of its elements."""
    full = tl.broadcast_to(v[:, :, None], (BLOCK_M, BLOCK_K // B, B))
    return tl.reshape(full, (BLOCK_M, BLOCK_K))


@triton.jit
def _col_blocks_expand(v, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr):
    """Inverse shape of :func:`_col_blocks_max`."""
    full = tl.broadcast_to(v[:, None, :], (BLOCK_M // B, B, BLOCK_K))
    return tl.reshape(full, (BLOCK_M, BLOCK_K))


# MXFP8 ---------------------------------------------------------------------------------------


@triton.jit
def _mx_scale(amax_bits, EMAX: tl.constexpr):
    """E8M0 biased scale: ``floor(log2(amax)) - EMAX + 127`` clamped to [0, 254] (the fp32
    exponent field minus ``EMAX``); 127 for an all-zero block, 255 (NaN) for a non-finite one."""
    b = tl.minimum(tl.maximum((amax_bits >> 23) - EMAX, 0), 254)
    b = tl.where(amax_bits == 0, 127, b)
    return tl.where(amax_bits >= 0x7F800000, 255, b)


@triton.jit
def _mx_codes(x, b, MBITS: tl.constexpr, EMIN: tl.constexpr, MAXV: tl.constexpr):
    """fp8 codes of ``x / 2**(b - 127)`` (``b`` broadcast to ``x``); 0x7F (NaN) where b = 255.
    The reciprocal of a power of two is exact, so is the multiplication."""
    inv = _pow2(127 - tl.minimum(b, 253))
    mag, sign = _encode(x * inv, MBITS, EMIN, MAXV)
    return tl.where(b == 255, 0x7F, (sign << 7) | mag)


@triton.jit
def _mxfp8_quantize_kernel(
    X,
    DATA,
    SCALE,
    DATA_T,
    SCALE_T,
    M,
    K,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    MAXV: tl.constexpr,
    EMAX: tl.constexpr,
    IN_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    B: tl.constexpr = 32
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = load_x(X, r64[:, None] * K + c64[None, :], mask, IN_BF16)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if ROWWISE:
        nkb = tl.cdiv(K, B)
        b = _mx_scale(_row_blocks_max(bits, BLOCK_M, BLOCK_K, B), EMAX)  # [BM, BK/B]
        codes = _mx_codes(x, _row_blocks_expand(b, BLOCK_M, BLOCK_K, B), MBITS, EMIN, MAXV)
        tl.store(DATA + r64[:, None] * K + c64[None, :], codes.to(tl.uint8), mask=mask)
        kb = tl.program_id(1) * (BLOCK_K // B) + tl.arange(0, BLOCK_K // B)
        smask = (rows[:, None] < M) & (kb[None, :] < nkb)
        tl.store(SCALE + r64[:, None] * nkb + kb[None, :], b.to(tl.uint8), mask=smask)
    if COLWISE:
        nmb = tl.cdiv(M, B)
        b = _mx_scale(_col_blocks_max(bits, BLOCK_M, BLOCK_K, B), EMAX)  # [BM/B, BK]
        codes = _mx_codes(x, _col_blocks_expand(b, BLOCK_M, BLOCK_K, B), MBITS, EMIN, MAXV)
        # Transposed in registers, so that consecutive lanes store consecutive bytes of data_t.
        offs_t = c64[:, None] * M + r64[None, :]
        tl.store(DATA_T + offs_t, tl.trans(codes.to(tl.uint8)), mask=tl.trans(mask))
        mb = tl.program_id(0) * (BLOCK_M // B) + tl.arange(0, BLOCK_M // B)
        smask = (cols[:, None] < K) & (mb[None, :] < nmb)
        tl.store(SCALE_T + c64[:, None] * nmb + mb[None, :], tl.trans(b.to(tl.uint8)), mask=smask)


@triton.jit
def _mxfp8_dequantize_kernel(
    DATA,
    SCALE,
    OUT,
    M,
    K,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = r64[:, None] * K + cols[None, :]
    code = tl.load(DATA + offs, mask=mask, other=0).to(tl.int32)
    nkb = tl.cdiv(K, 32)
    b = tl.load(SCALE + r64[:, None] * nkb + (cols // 32)[None, :], mask=mask, other=127)
    v = _decode_fp8(code, MBITS, EMIN) * _e8m0_to_f32(b.to(tl.int32))
    store_out(OUT, offs, v, mask, OUT_BF16)


# NVFP4 ---------------------------------------------------------------------------------------


@triton.jit
def _nvfp4_scale(amax_bits, g_6, g_inv):
    """``(scale_code, enc)``: the E4M3 block scale ``e4m3(min(amax * (g / 6), 448))`` (NaN code
    0x7F for a non-finite block) and the factor that maps the block onto the E2M1 grid,
    ``min(1 / (scale * (1 / g)), FLT_MAX)``, 0 where the scale is 0."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    s_code, _ = _encode(tl.minimum(amax * g_6, 448.0), 3, -6, 448.0)
    s_code = tl.where(amax_bits >= 0x7F800000, 0x7F, s_code)
    s = tl.where(s_code == 0, 1.0, _decode(s_code, 3, -6))  # no 1/0: enc is 0 there
    enc = tl.minimum(tl.div_rn(1.0, s * g_inv), 3.4028234663852886e38)
    return s_code, tl.where(s_code == 0, 0.0, enc)


@triton.jit
def _nvfp4_codes(x, enc, s_code):
    """4-bit E2M1 codes (sign in bit 3) of ``x * enc``; 0 in a NaN-scale block."""
    mag, sign = _encode(x * enc, 1, 0, 6.0)
    return tl.where(s_code == 0x7F, 0, (sign << 3) | mag)


@triton.jit
def _nvfp4_quantize_kernel(
    X,
    G,
    DATA,
    SCALE,
    DATA_T,
    SCALE_T,
    M,
    K,
    ROWWISE: tl.constexpr,
    COLWISE: tl.constexpr,
    IN_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    B: tl.constexpr = 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = load_x(X, r64[:, None] * K + c64[None, :], mask, IN_BF16)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    g = tl.load(G)
    g_6 = g * (1.0 / 6.0)
    g_inv = tl.div_rn(1.0, g)
    # Nibble shifts of the two elements of a byte: the even one in the low nibble.
    nib = tl.arange(0, 2) * 4
    if ROWWISE:
        nkb = tl.cdiv(K, B)
        s_code, enc = _nvfp4_scale(_row_blocks_max(bits, BLOCK_M, BLOCK_K, B), g_6, g_inv)
        codes = _nvfp4_codes(
            x,
            _row_blocks_expand(enc, BLOCK_M, BLOCK_K, B),
            _row_blocks_expand(s_code, BLOCK_M, BLOCK_K, B),
        )
        packed = tl.sum(tl.reshape(codes, (BLOCK_M, BLOCK_K // 2, 2)) << nib[None, None, :], 2)
        pcols = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        pmask = (rows[:, None] < M) & (pcols[None, :] < K // 2)
        tl.store(DATA + r64[:, None] * (K // 2) + pcols[None, :], packed.to(tl.uint8), mask=pmask)
        kb = tl.program_id(1) * (BLOCK_K // B) + tl.arange(0, BLOCK_K // B)
        smask = (rows[:, None] < M) & (kb[None, :] < nkb)
        tl.store(SCALE + r64[:, None] * nkb + kb[None, :], s_code.to(tl.uint8), mask=smask)
    if COLWISE:
        nmb = tl.cdiv(M, B)
        s_code, enc = _nvfp4_scale(_col_blocks_max(bits, BLOCK_M, BLOCK_K, B), g_6, g_inv)
        codes = _nvfp4_codes(
            x,
            _col_blocks_expand(enc, BLOCK_M, BLOCK_K, B),
            _col_blocks_expand(s_code, BLOCK_M, BLOCK_K, B),
        )
        packed = tl.sum(tl.reshape(codes, (BLOCK_M // 2, 2, BLOCK_K)) << nib[None, :, None], 1)
        prows = tl.program_id(0) * (BLOCK_M // 2) + tl.arange(0, BLOCK_M // 2)
        pmask = (cols[:, None] < K) & (prows[None, :] < M // 2)
        offs_t = c64[:, None] * (M // 2) + prows[None, :]
        tl.store(DATA_T + offs_t, tl.trans(packed.to(tl.uint8)), mask=pmask)
        mb = tl.program_id(0) * (BLOCK_M // B) + tl.arange(0, BLOCK_M // B)
        smask = (cols[:, None] < K) & (mb[None, :] < nmb)
        offs_t = c64[:, None] * nmb + mb[None, :]
        tl.store(SCALE_T + offs_t, tl.trans(s_code.to(tl.uint8)), mask=smask)


@triton.jit
def _nvfp4_dequantize_kernel(
    DATA,
    SCALE,
    G,
    OUT,
    M,
    K,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program per ``[BLOCK_M, BLOCK_P]`` tile of packed bytes (2 * BLOCK_P elements)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pcols = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    r64 = rows.to(tl.int64)
    mask = (rows[:, None] < M) & (pcols[None, :] < K // 2)
    byte = tl.load(DATA + r64[:, None] * (K // 2) + pcols[None, :], mask=mask, other=0)
    byte = byte.to(tl.int32)
    nkb = tl.cdiv(K, 16)
    s = tl.load(SCALE + r64[:, None] * nkb + (pcols // 8)[None, :], mask=mask, other=0)
    s = s.to(tl.int32)
    s_val = _decode_fp8(s, 3, -6)
    g = tl.load(G)
    out = OUT + r64[:, None] * K + 2 * pcols[None, :]
    for half in tl.static_range(2):
        code = (byte >> (4 * half)) & 0xF
        v = _decode(code & 7, 1, 0)
        v = signed(v, (code & 8) != 0)
        store_out(out, half, tl.div_rn(v * s_val, g), mask, OUT_BF16)


# Launch wrappers -----------------------------------------------------------------------------


def quantize_mxfp8(
    x: Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale, data_t, scale_t)`` with the layouts of ``te::quantize_mxfp8``; a
    direction not asked for gives 0-element tensors."""
    x2, m, k = as_rows(x)
    mbits, emin, maxv, emax = _FP8_FORMATS[fp8_dtype]
    empty = x2.new_empty(0, dtype=torch.uint8)
    data = x2.new_empty((m, k) if rowwise else 0, dtype=torch.uint8)
    scale = x2.new_empty((m, cdiv(k, MXFP8_BLOCK)), dtype=torch.uint8) if rowwise else empty
    data_t = x2.new_empty((k, m) if columnwise else 0, dtype=torch.uint8)
    scale_t = x2.new_empty((k, cdiv(m, MXFP8_BLOCK)), dtype=torch.uint8)
    scale_t = scale_t if columnwise else empty.clone()
    if m and k:
        launch(_mxfp8_quantize_kernel, (cdiv(m, _TILE), cdiv(k, _TILE)))(
            kernel_arg(x2),
            data,
            scale,
            data_t,
            scale_t,
            m,
            k,
            ROWWISE=rowwise,
            COLWISE=columnwise,
            MBITS=mbits,
            EMIN=emin,
            MAXV=maxv,
            EMAX=emax,
            IN_BF16=bf16_bits(x2),
            BLOCK_M=_TILE,
            BLOCK_K=_TILE,
            num_warps=_NUM_WARPS,
        )
    data = data.view(fp8_dtype).view(x.shape if rowwise else (0,))
    return data, scale, data_t.view(fp8_dtype), scale_t


def dequantize_mxfp8(data: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``data * 2**(scale - 127)`` per 32-element block of the last dim, in ``out_dtype``."""
    mbits, emin, _, _ = _FP8_FORMATS[data.dtype]
    d2, m, k = as_rows(data.view(torch.uint8))
    out = d2.new_empty((m, k), dtype=out_dtype)
    if m and k:
        launch(_mxfp8_dequantize_kernel, (cdiv(m, _TILE), cdiv(k, _TILE)))(
            d2,
            scale.contiguous(),
            kernel_arg(out),
            m,
            k,
            MBITS=mbits,
            EMIN=emin,
            OUT_BF16=bf16_bits(out),
            BLOCK_M=_TILE,
            BLOCK_K=_TILE,
            num_warps=_NUM_WARPS,
        )
    return out.view(data.shape)


def quantize_nvfp4(
    x: Tensor, global_scale: Tensor, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale, data_t, scale_t)`` with the layouts of ``te::quantize_nvfp4``, given the
    fp32 global (encode) scale as a 1-element tensor; a direction not asked for gives
    0-element tensors. ``K`` (rowwise) and ``M`` (columnwise) must be even."""
    x2, m, k = as_rows(x)
    empty = x2.new_empty(0, dtype=torch.uint8)
    data = x2.new_empty((m, k // 2) if rowwise else 0, dtype=torch.uint8)
    scale = x2.new_empty((m, cdiv(k, NVFP4_BLOCK)), dtype=torch.uint8) if rowwise else empty
    data_t = x2.new_empty((k, m // 2) if columnwise else 0, dtype=torch.uint8)
    scale_t = x2.new_empty((k, cdiv(m, NVFP4_BLOCK)), dtype=torch.uint8)
    scale_t = scale_t if columnwise else empty.clone()
    if m and k:
        launch(_nvfp4_quantize_kernel, (cdiv(m, _TILE), cdiv(k, _TILE)))(
            kernel_arg(x2),
            global_scale.to(torch.float32).contiguous(),
            data,
            scale,
            data_t,
            scale_t,
            m,
            k,
            ROWWISE=rowwise,
            COLWISE=columnwise,
            IN_BF16=bf16_bits(x2),
            BLOCK_M=_TILE,
            BLOCK_K=_TILE,
            num_warps=_NUM_WARPS,
        )
    if rowwise:
        data = data.view(*x.shape[:-1], k // 2)
    return data, scale.view(torch.float8_e4m3fn), data_t, scale_t.view(torch.float8_e4m3fn)


def dequantize_nvfp4(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``e2m1 * scale / global_scale`` per 16-element block of the last dim, in ``out_dtype``;
    ``data`` is ``[..., K / 2]`` packed bytes, the output ``[..., K]``."""
    d2, m, p = as_rows(data)
    out = d2.new_empty((m, 2 * p), dtype=out_dtype)
    if m and p:
        launch(_nvfp4_dequantize_kernel, (cdiv(m, _TILE), cdiv(p, _TILE)))(
            d2,
            scale.contiguous().view(torch.uint8),
            global_scale.to(torch.float32).contiguous(),
            kernel_arg(out),
            m,
            2 * p,
            OUT_BF16=bf16_bits(out),
            BLOCK_M=_TILE,
            BLOCK_P=_TILE,
            num_warps=_NUM_WARPS,
        )
    return out.view(*data.shape[:-1], 2 * p)
