r"""MXFP8 and NVFP4 block quantisation: ``te::quantize_mxfp8`` / ``te::dequantize_mxfp8`` and
``te::quantize_nvfp4`` / ``te::dequantize_nvfp4``.

The quantisation is exact: bit for bit as defined below, on CPU and CUDA alike. Native MX/NVFP4
GEMMs exist only on Blackwell; elsewhere the recipes that use these ops emulate the GEMM by
dequantising and running a bf16 GEMM, which gives the numerics of the format without its speed.

Schemas (public functions of the same names, with defaults, below)::

    te::quantize_mxfp8(Tensor x, ScalarType fp8_dtype, bool rowwise, bool columnwise)
        -> (Tensor data, Tensor scale, Tensor data_t, Tensor scale_t)
    te::dequantize_mxfp8(Tensor data, Tensor scale, ScalarType fp8_dtype, ScalarType out_dtype)
        -> Tensor
    te::quantize_nvfp4(Tensor x, Tensor? global_amax, bool rowwise, bool columnwise)
        -> (Tensor data, Tensor scale, Tensor global_scale, Tensor data_t, Tensor scale_t)
    te::dequantize_nvfp4(Tensor data, Tensor scale, Tensor global_scale, ScalarType out_dtype)
        -> Tensor

The dequantise *ops* take fp8 inputs as their uint8 bytes (MXFP8 ``data``, with its
``fp8_dtype``; NVFP4's E4M3 ``scale``), as the GEMM family ops do: ``opcheck``'s schema test
compares every input before and after the call with ``torch.allclose``, which has no fp8 kernel
on the CPU. The public :func:`dequantize_mxfp8` / :func:`dequantize_nvfp4` take the fp8 tensors
that quantisation returns and pass ``.view(torch.uint8)`` (free, and traced by the compiler).

The input ``x`` ``[..., K]`` is viewed as ``[M, K]`` (``M`` = product of the leading dims).
*Rowwise* blocks are ``1 x B`` runs along ``K``; *columnwise* blocks are ``B x 1`` runs along
``M``, quantised from the same ``x`` and stored transposed, as ``[K, M]`` data whose rows are the
blocks (what the GEMM of a backward pass reads, e.g. ``x^T`` for a weight gradient). Either
direction can be skipped; its outputs are then 0-element tensors of the same dtypes.

MXFP8 (OCP Microscaling spec v1.0), ``B = 32``, elements E4M3 or E5M2
----------------------------------------------------------------------------------------------

Per block, with :math:`e_{max}` the exponent of the largest power of two of the element format
(8 for E4M3, whose max is 448; 15 for E5M2, max 57344):

.. math::
    X = \lfloor \log_2 \max_i |x_i| \rfloor - e_{max}, \qquad
    q_i = \mathrm{sat}\big(\mathrm{rne}(x_i / 2^X)\big)

``X`` is stored as E8M0: a ``uint8`` biased exponent ``X + 127`` (127 is :math:`2^0`), clamped
to [0, 254]. Dividing by a power of two is exact, and :math:`|x_i| / 2^X < 2^{e_{max}+1}`; values
above the element max (448 for E4M3) saturate to it, as the spec allows. Dequantisation is
:math:`q_i \cdot 2^X`.

* ``data`` ``[..., K]`` fp8 (``x``'s shape), ``scale`` ``[M, ceil(K/32)]`` uint8;
  ``data_t`` ``[K, M]`` fp8, ``scale_t`` ``[K, ceil(M/32)]`` uint8.
* Scales are in this plain row-major layout; cuBLAS's swizzled ("128x4" tiled) scale layout that
  native MX GEMMs on Blackwell consume is not produced.
* Scale rule: the spec's floor rule above. Transformer Engine rounds the exponent up instead
  (:math:`\lceil \log_2(\mathrm{amax}/\mathrm{max}) \rceil`, no saturation needed); the two
  agree unless the block amax's mantissa exceeds the element max's (e.g. E4M3 amax in
  (448, 512) times a power of two), where the floor rule keeps one more bit and saturates.

NVFP4 (NVIDIA), ``B = 16``, elements E2M1 with an E4M3 block scale and an fp32 global scale
----------------------------------------------------------------------------------------------

E2M1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}. With ``amax`` the tensor's max ``|x|`` (or
``global_amax`` when given) and ``b`` a block's max ``|x|``, all in fp32 (Transformer Engine's
formulas and order of operations):

.. math::
    g = \min\!\big(\tfrac{448 \cdot 6}{\mathrm{amax}}, \mathrm{FLT\_MAX}\big), \qquad
    s = \mathrm{e4m3}\big(\min(b \cdot (g \cdot \tfrac16), 448)\big), \qquad
    q_i = \mathrm{sat}_6\big(\mathrm{rne}_{E2M1}(x_i \cdot \min(\tfrac{1}{s\,\cdot\,(1/g)},
    \mathrm{FLT\_MAX}))\big)

so that a block's max lands near 6 and dequantisation is :math:`q_i \cdot s / g`.

* ``data`` ``[..., K/2]`` uint8 — two E2M1 codes per byte, the **even** element in the **low**
  nibble (``byte = code[2j] | code[2j+1] << 4``), each code ``sign << 3 | magnitude index``;
  ``scale`` ``[M, ceil(K/16)]`` ``torch.float8_e4m3fn``; ``global_scale`` a 0-dim fp32 tensor
  ``g`` (the *encode* scale: dequantise divides by it); ``data_t`` ``[K, M/2]`` uint8 and
  ``scale_t`` ``[K, ceil(M/16)]`` e4m3, the columnwise pair, with the same ``g``.
* ``K`` must be even for rowwise output and ``M`` even for columnwise output (whole bytes).
* Rounding: to nearest on the E2M1 grid, ties to the even code (0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). These ops round to nearest; the GEMM
  families' NVFP4 operands (:func:`nvfp4_qdq`) also take stochastic rounding (gradients), the
  random Hadamard transform (the wgrad GEMM's operands), 16 x 16 tiles and 4over6 block
  scaling.

Edge cases (both formats)
-------------------------

* ``K`` (or ``M`` columnwise) not a multiple of ``B``: the last block is partial, quantised as if
  zero-padded to ``B`` (zeros do not change its max); the padding is not stored.
* All-zero block: MXFP8 stores the scale 127 (:math:`2^0`; any scale decodes zeros to zeros, and
  1 is the neutral one). NVFP4 stores the E4M3 scale 0 and zero codes; dequantisation gives 0,
  never NaN (``s / g`` with ``g > 0``). An NVFP4 block whose scale underflows E4M3 to 0 also
  stores zero codes (signed zeros), where Transformer Engine stores saturated codes under the
  0 scale: the dequantised values are 0 either way.
* A block holding inf or NaN: its scale is NaN (MXFP8: E8M0 ``0xFF``; NVFP4: E4M3 ``0x7F``), so
  the whole block dequantises to NaN; its data bytes are fixed (MXFP8: ``0x7F``, NVFP4: zero
  codes). NVFP4's global scale falls back to 1 when ``amax`` is 0 or inf (as in Transformer
  Engine) or NaN; the other blocks are then quantised against ``g = 1``.
* Overflow saturates: elements to the element max, an NVFP4 block scale to 448 (possible when a
  ``global_amax`` smaller than the tensor's is passed).

Implementations: on CPU the reference math below (``*_ref``); on CUDA the Triton kernels of
``te_compile.kernels.quantize_mx`` (one read of ``x`` for both directions), which reproduce the
reference bit for bit (tests/kernels runs them under the Triton interpreter). NVFP4 without a
``global_amax`` first reduces ``x`` to its amax (a torch reduction: every block's scale depends
on it), so it reads ``x`` twice. Inputs are fp32, bf16 or fp16; all math is fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from te_compile._checks import check_bool
from te_compile._library import SampleInput, op
from te_compile._numerics import div_rn, reciprocal_rn

__all__ = [
    "FOUR_OVER_SIX",
    "RHT_SIGNS",
    "check_quantize_nvfp4",
    "dequantize_mxfp8",
    "dequantize_mxfp8_ref",
    "dequantize_nvfp4",
    "dequantize_nvfp4_ref",
    "nvfp4_global_scale",
    "nvfp4_qdq",
    "nvfp4_qdq_row_groups",
    "parse_four_over_six",
    "quantize_mxfp8",
    "quantize_mxfp8_ref",
    "quantize_nvfp4",
    "quantize_nvfp4_ref",
    "random_hadamard_transform",
    "spread_blocks",
]

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# (largest finite value, OCP emax_elem = exponent of the largest power of two below it)
_FP8_LIMITS = {torch.float8_e4m3fn: (448.0, 8), torch.float8_e5m2: (57344.0, 15)}
_E8M0_NAN = 255
_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_FLT_MAX = torch.finfo(torch.float32).max
# E2M1 magnitude of each 3-bit code, in code order.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# 4over6 settings of an operand (``nvfp4_qdq``'s ``four_over_six``): off, or the error metric
# and the E4M3 bound the global scale maps the amax to.
FOUR_OVER_SIX = ("", "MAE:448", "MAE:256", "MSE:448", "MSE:256")


# 1. Reference math --------------------------------------------------------------------------


def _rows(x: Tensor) -> Tensor:
    """``[..., K]`` as ``[M, K]``."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _blocks(x2: Tensor, block: int) -> Tensor:
    """``[M, K]`` as fp32 ``[M, ceil(K / block), block]``, the last block zero-padded."""
    m, k = x2.shape
    return F.pad(x2.float().contiguous(), (0, -k % block)).view(m, -(-k // block), block)


def spread_blocks(t: Tensor, dim: int, size: int, block: int) -> Tensor:
    """Per-block values ``t`` (one per ``block`` elements along ``dim``) repeated over the
    ``size`` elements, gathered by a block index that is data (``bucketize``), not index
    arithmetic. A broadcast over a padded, blocked view cut back to ``size``, or an
    ``arange // block`` index, leaves a division by the block size in the loop's indexing;
    Inductor's CPU generator then splits the loop by the block size even where ``size`` is not
    a multiple of it, and the tail is never written (torch 2.13)."""
    if block == 1:
        return t
    starts = torch.arange(t.shape[dim], device=t.device) * block
    index = torch.bucketize(torch.arange(size, device=t.device), starts, right=True) - 1
    return t.index_select(dim, index)


def _unblock(t: Tensor, k: int) -> Tensor:
    """Inverse of :func:`_blocks`: ``[M, nb, block]`` -> ``[M, K]``, padding dropped."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2])[:, :k]


def e8m0_to_float(biased: Tensor) -> Tensor:
    """The fp32 value ``2**(b - 127)`` of E8M0 codes ``b`` (255 is NaN), built from the float's
    bits: what ``.view(torch.float8_e8m0fnu).float()`` gives, in operations that Inductor's CPU
    code generator also knows (it has no E8M0 type)."""
    b = biased.to(torch.int32)
    bits = torch.where(b == 0, 1 << 22, b << 23)  # 2**-127 is the subnormal 0x00400000
    return torch.where(b == 255, float("nan"), bits.view(torch.float32))


def _mxfp8_rows(x2: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """MXFP8 of the rows of ``x2`` ``[M, K]``: ``(data [M, K], scale [M, ceil(K/32)])``."""
    max_value, emax = _FP8_LIMITS[fp8_dtype]
    xb = _blocks(x2, MXFP8_BLOCK)
    amax = xb.abs().amax(-1)  # NaN if the block holds a NaN
    finite = amax.isfinite()
    # floor(log2(amax)), exactly: amax = mantissa * 2**exponent with 0.5 <= mantissa < 1.
    floor_log2 = torch.frexp(amax).exponent - 1
    biased = (floor_log2 - emax + 127).clamp(0, 254)
    biased = torch.where(amax == 0, 127, biased)
    scale = torch.where(finite, biased, _E8M0_NAN).to(torch.uint8)
    # 1 / 2**(b - 127) = 2**(127 - b), which is the E8M0 value of 254 - b.
    inv = e8m0_to_float(254 - biased.clamp(max=254))
    k = x2.shape[1]
    q = x2.float().contiguous() * spread_blocks(inv, 1, k, MXFP8_BLOCK)
    q = q.clamp(-max_value, max_value).to(fp8_dtype).view(torch.uint8)
    # NaN code where the block is not finite; the NaN scale decides anyway
    q = torch.where(spread_blocks(finite, 1, k, MXFP8_BLOCK), q, 0x7F)
    return q.view(fp8_dtype), scale


def quantize_mxfp8_ref(
    x: Tensor, fp8_dtype: torch.dtype, rowwise: bool = True, columnwise: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale, data_t, scale_t)`` (module docstring); 0-element tensors for a direction
    not asked for."""
    x2 = _rows(x)
    if rowwise:
        data, scale = _mxfp8_rows(x2, fp8_dtype)
        data = data.view(x.shape)
    else:
        data, scale = x.new_empty(0, dtype=fp8_dtype), x.new_empty(0, dtype=torch.uint8)
    if columnwise:
        data_t, scale_t = _mxfp8_rows(x2.t(), fp8_dtype)
    else:
        data_t, scale_t = x.new_empty(0, dtype=fp8_dtype), x.new_empty(0, dtype=torch.uint8)
    return data, scale, data_t, scale_t


def dequantize_mxfp8_ref(data: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``data * 2**(scale - 127)`` per 32-element block of the last dim (E8M0 255 is NaN)."""
    k = data.shape[-1]
    rows = data.reshape(scale.shape[0], k).float().contiguous()
    values = rows * spread_blocks(e8m0_to_float(scale), 1, k, MXFP8_BLOCK)
    return values.to(out_dtype).view(data.shape)


def nvfp4_global_scale(amax: Tensor, e4m3_max: float = _E4M3_MAX) -> Tensor:
    """The 0-dim fp32 NVFP4 encode scale ``min(e4m3_max * 6 / amax, FLT_MAX)``; 1 where
    ``amax`` is 0, inf or NaN. ``e4m3_max``: 448 (the E4M3 max), or 256 for 4over6 operands
    (:func:`nvfp4_qdq`'s ``four_over_six``)."""
    return _global_scales(amax.float().reshape(()), e4m3_max)


def _global_scales(amax: Tensor, e4m3_max: float = _E4M3_MAX) -> Tensor:
    """:func:`nvfp4_global_scale` of every element of the fp32 ``amax``."""
    g = div_rn(e4m3_max * _E2M1_MAX, amax).clamp(max=_FLT_MAX)
    return torch.where((amax == 0) | ~amax.isfinite(), 1.0, g)


def _tensor_amax(x: Tensor) -> Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty tensor); NaN if ``x`` holds a NaN."""
    if x.numel() == 0:
        return x.new_zeros((), dtype=torch.float32)
    return x.abs().amax().float()


def _e2m1_codes(v: Tensor, u: Tensor | None = None) -> Tensor:
    """4-bit E2M1 codes (``sign << 3 | magnitude``) of ``v``, saturated to 6 and rounded to the
    nearest grid point, ties to even: the grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in
    [4, 6], and ``torch.round`` rounds half to even on ``|v| / spacing``. With ``u`` (uniform in
    [0, 1), ``v``'s shape): stochastic rounding, up to the next grid point with probability
    ``(|v| - lo) / spacing`` from the grid point ``lo`` below, so the expected value is ``v``."""
    a = v.abs().clamp(max=_E2M1_MAX)
    spacing = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    # Times the inverse spacing (a power of two: exact), not divided by the spacing (Triton's
    # approximate division under Inductor).
    steps = a * torch.where(a < 2, 2.0, torch.where(a < 4, 1.0, 0.5))
    if u is None:
        r = torch.round(steps) * spacing
    else:
        whole = torch.floor(steps)
        r = (whole + (u < steps - whole).to(a.dtype)) * spacing
    magnitude = torch.searchsorted(a.new_tensor(_E2M1_VALUES), r)  # exact: r is a grid point
    return (torch.signbit(v).to(torch.uint8) << 3) | magnitude.to(torch.uint8)


def _nvfp4_candidate(
    xb: Tensor, amax: Tensor, g: Tensor, four: bool, ub: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(codes [M, nb, 16] uint8, scale [M, nb] e4m3)`` of the blocks ``xb`` (fp32, amaxes
    ``amax``) with the block scale mapping the amax to 6, or with ``four`` to 4 (that scale
    times 1.5, 4over6's second candidate)."""
    finite = amax.isfinite()
    s = amax * (g * (1 / 6))
    if four:
        s = s * 1.5
    scale = torch.where(finite, s.clamp(max=_E4M3_MAX), math.nan).to(torch.float8_e4m3fn)
    s = scale.float()
    enc = reciprocal_rn(s * reciprocal_rn(g)).clamp(max=_FLT_MAX)
    enc = torch.where(s == 0, 0.0, enc)
    codes = torch.where(finite[..., None], _e2m1_codes(xb * enc[..., None], ub), 0)
    return codes, scale


def _block_values(codes: Tensor, scale: Tensor, g: Tensor) -> Tensor:
    """fp32 values ``e2m1 * scale / g`` of E2M1 ``codes`` ``[M, nb, 16]`` (E4M3 ``scale``
    ``[M, nb]``; ``g`` broadcastable to ``[M, nb]``)."""
    values = codes.new_tensor(_E2M1_VALUES, dtype=torch.float32)[(codes & 7).long()]
    values = torch.where((codes & 8) != 0, -values, values)
    return div_rn(values * scale.float()[..., None], g[..., None])


def _four_over_six_errors(xb, amax, g, err_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(err4, err6, cand4, cand6)``: each block's sum of ``|q - x|`` (``"MAE"``) or
    ``(q - x)^2`` (``"MSE"``) over its 16 values for the map-to-4 and map-to-6 candidates
    (:func:`_nvfp4_candidate`, ``q`` dequantised), and the candidates."""
    cand4 = _nvfp4_candidate(xb, amax, g, True, None)
    cand6 = _nvfp4_candidate(xb, amax, g, False, None)
    errs = []
    for codes, scale in (cand4, cand6):
        diff = _block_values(codes, scale, g) - xb
        errs.append((diff.abs() if err_mode == "MAE" else diff * diff).sum(-1))
    return errs[0], errs[1], cand4, cand6


def _nvfp4_rows(
    x2: Tensor,
    g: Tensor,
    amax: Tensor | None = None,
    u: Tensor | None = None,
    four_over_six: str = "",
    pick: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """NVFP4 of the rows of ``x2`` ``[M, K]`` (K even) with global scale ``g`` (0-dim, or
    broadcastable to ``[M, ceil(K/16)]``: one per row or per block):
    ``(data [M, K/2] uint8, scale [M, ceil(K/16)] e4m3)``. ``amax``: each block's amax ``[M,
    ceil(K/16)]`` when not its own (16x16 tiles); ``u``: uniforms ``[M, K]`` for stochastic
    rounding (:func:`_e2m1_codes`); ``four_over_six``: the error metric (``"MAE"``, ``"MSE"``)
    of 4over6 block scaling, each block keeping the candidate of lower error (map to 4 when
    strictly lower, else 6), or ``pick`` (bool ``[M, ceil(K/16)]``, True: map to 4) given."""
    xb = _blocks(x2, NVFP4_BLOCK)
    if amax is None:
        amax = xb.abs().amax(-1)
    if g.dim() == 2:
        g = g.expand(amax.shape)
    if not four_over_six and pick is None:
        ub = None if u is None else _blocks(u, NVFP4_BLOCK)
        codes, scale = _nvfp4_candidate(xb, amax, g, False, ub)
    else:
        err4, err6, (c4, s4), (c6, s6) = _four_over_six_errors(xb, amax, g, four_over_six or "MAE")
        if pick is None:
            pick = err4 < err6
        codes = torch.where(pick[..., None], c4, c6)
        scale = torch.where(pick, s4.view(torch.uint8), s6.view(torch.uint8))
        scale = scale.view(torch.float8_e4m3fn)
    codes = _unblock(codes, x2.shape[1])
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def _tile_pick(x2: Tensor, g: Tensor, err_mode: str) -> Tensor:
    """4over6 with 16x16 tiles: bool ``[ceil(M/16), ceil(K/16)]``, True where the tile maps to
    4, from the tile's summed error (one choice per tile, so that the rowwise and columnwise
    copies stay the same quantised values)."""
    m = x2.shape[0]
    xb = _blocks(x2, NVFP4_BLOCK)
    amax = _tile_amaxes(x2)
    if g.dim() == 2:
        g = g.expand(amax.shape)
    err4, err6, _, _ = _four_over_six_errors(xb, amax, g, err_mode)
    pad = -m % NVFP4_BLOCK

    def tiles(e: Tensor) -> Tensor:
        e = F.pad(e, (0, 0, 0, pad))
        return e.view(-1, NVFP4_BLOCK, e.shape[1]).sum(1)

    return tiles(err4) < tiles(err6)


def _expand_tiles(pick: Tensor, rows: int) -> Tensor:
    return pick.repeat_interleave(NVFP4_BLOCK, 0)[:rows]


def quantize_nvfp4_ref(
    x: Tensor,
    global_amax: Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = True,
    tiles: bool = False,
    four_over_six: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale, global_scale, data_t, scale_t)`` (module docstring); 0-element tensors
    for a direction not asked for. ``tiles``: every block's scale from its 16x16 tile's amax
    (the columnwise copy is then the rowwise one transposed, value for value).
    ``four_over_six``: 4over6 block scaling (:func:`nvfp4_qdq`; ``""``: off)."""
    err_mode, e4m3_max = parse_four_over_six(four_over_six)
    g = nvfp4_global_scale(_tensor_amax(x) if global_amax is None else global_amax, e4m3_max)
    x2 = _rows(x)
    e4m3 = torch.float8_e4m3fn
    pick = _tile_pick(x2.float(), g, err_mode) if tiles and err_mode else None
    if rowwise:
        data, scale = _nvfp4_rows(
            x2,
            g,
            _tile_amaxes(x2) if tiles else None,
            None,
            err_mode,
            None if pick is None else _expand_tiles(pick, x2.shape[0]),
        )
        data = data.reshape(*x.shape[:-1], x.shape[-1] // 2)
    else:
        data, scale = x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=e4m3)
    if columnwise:
        pick_t = None if pick is None else _expand_tiles(pick.t(), x2.shape[1])
        data_t, scale_t = _nvfp4_rows(
            x2.t(), g, _tile_amaxes(x2.t()) if tiles else None, None, err_mode, pick_t
        )
    else:
        data_t, scale_t = x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=e4m3)
    return data, scale, g, data_t, scale_t


def dequantize_nvfp4_ref(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``e2m1 * scale / global_scale`` per 16-element block: ``[..., K/2]`` bytes to
    ``[..., K]`` values."""
    k = 2 * data.shape[-1]
    rows = data.reshape(scale.shape[0], data.shape[-1])
    out = _nvfp4_values(rows, scale, global_scale.float().reshape(()))
    return out.view(*data.shape[:-1], k).to(out_dtype)


def _nvfp4_values(data: Tensor, scale: Tensor, g: Tensor) -> Tensor:
    """fp32 ``[M, K]`` values of the NVFP4 rows ``data`` ``[M, K/2]`` (E4M3 ``scale``) over the
    global scale ``g`` (0-dim, or broadcastable to ``scale``'s shape: one a row or a block)."""
    m, k = data.shape[0], 2 * data.shape[1]
    codes = torch.stack([data & 0xF, data >> 4], -1).reshape(m, k)
    codes = F.pad(codes, (0, -k % NVFP4_BLOCK)).view(m, scale.shape[-1], NVFP4_BLOCK)
    return _unblock(_block_values(codes, scale, g), k)


def nvfp4_qdq_row_groups(x: Tensor, row_splits: Tensor, tiles: bool = False) -> Tensor:
    """NVFP4 quantised and dequantised (fp32) in blocks along the rows of ``x`` ``[..., K]``, every
    group of consecutive rows (``row_splits[i]`` rows, flattening the leading dims; they must
    sum to the row count) with the global scale of its own amax: what quantising each group as
    its own tensor gives (Transformer Engine's grouped NVFP4 quantisation of a mixture of
    experts' tokens or weights), in one pass of torch ops on any device with no host sync
    (:func:`nvfp4_qdq`'s ``row_splits``; a group holding a NaN gets ``g = 1``, as a tensor
    does). ``K`` must be even. ``tiles``: one block scale per 16x16 tile (groups of a multiple
    of 16 rows, so that no tile straddles two)."""
    row, _ = nvfp4_qdq(_rows(x), columnwise=False, tiles=tiles, row_splits=row_splits)
    return row.view(x.shape)


# Transformer Engine's NVFP4 recipe options, as the emulated GEMMs apply them ----------------

# The random signs of the Hadamard transform: Transformer Engine's fixed wgrad sign vector.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def random_hadamard_transform(x2: Tensor) -> Tensor:
    """Every 16-element block along the rows of ``x2`` ``[R, C]`` (``C`` a multiple of 16)
    times :math:`S H / 4`: ``S = diag(RHT_SIGNS)``, ``H`` the 16x16 Sylvester Hadamard matrix
    (entries +-1, ``H[i, j] = (-1)^{popcount(i & j)}``), so ``S H / 4`` is orthogonal. Computed
    in fp32 (fp64 stays fp64) as four add/subtract butterfly stages, no matrix product: the
    same sums on every device, whatever TF32 setting."""
    acc = torch.float64 if x2.dtype == torch.float64 else torch.float32
    r, c = x2.shape
    i = torch.arange(NVFP4_BLOCK, device=x2.device)
    mask = sum(1 << j for j, s in enumerate(RHT_SIGNS) if s < 0)
    signs = 1 - 2 * ((mask >> i) & 1).to(acc)
    v = x2.to(acc).reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK) * signs
    for h in (8, 4, 2, 1):  # x @ H = x @ (H2 kron H2 kron H2 kron H2): one stage per factor
        v = v.reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        v = torch.stack([a + b, a - b], dim=-2)
    return v.reshape(r, c) * 0.25


def _uniforms(rng_state: Tensor, numel: int) -> Tensor:
    """The first ``numel`` words of the stream ``rng_state`` as fp32 uniforms in [0, 1) (their
    top 24 bits: exact in fp32)."""
    from te_compile.functional.dropout_ops import random_words

    return (random_words(rng_state, numel) >> 8).to(torch.float32) * 2.0**-24


def _tile_amaxes(x2: Tensor) -> Tensor:
    """Each row block's amax ``[M, ceil(K/16)]`` taken over its 16x16 tile (zero-padded)."""
    m, k = x2.shape
    xp = F.pad(x2.float().abs(), (0, -k % NVFP4_BLOCK, 0, -m % NVFP4_BLOCK))
    mt, kt = xp.shape[0] // NVFP4_BLOCK, xp.shape[1] // NVFP4_BLOCK
    tiles = xp.view(mt, NVFP4_BLOCK, kt, NVFP4_BLOCK).amax((1, 3))
    return tiles.repeat_interleave(NVFP4_BLOCK, 0)[:m]


def parse_four_over_six(spec: str) -> tuple[str, float]:
    """``(err_mode, e4m3_max)`` of a 4over6 setting (:data:`FOUR_OVER_SIX`): ``""`` is off,
    ``("", 448.0)``; ``"MSE:256"`` is ``("MSE", 256.0)``."""
    if spec not in FOUR_OVER_SIX:
        raise ValueError(f"four_over_six must be one of {FOUR_OVER_SIX}, got {spec!r}")
    if not spec:
        return "", _E4M3_MAX
    err_mode, bound = spec.split(":")
    return err_mode, float(bound)


def _group_scales(row_amax: Tensor, ids: Tensor, groups: int, e4m3_max: float) -> Tensor:
    """The global scale ``[groups]`` of every group of rows (``ids``: each row's group) from
    the rows' amaxes, on the device (no host sync); a group holding a NaN gets 1, as a
    tensor does."""
    amax = row_amax.new_zeros(groups).scatter_reduce(0, ids, row_amax, "amax")
    has_nan = row_amax.new_zeros(groups).index_add(0, ids, row_amax.isnan().float()) > 0
    return _global_scales(torch.where(has_nan, math.nan, amax), e4m3_max)


def _row_amax(x: Tensor) -> Tensor:
    return x.abs().amax(1) if x.shape[1] else x.new_zeros(x.shape[0])


def nvfp4_qdq(
    x2: Tensor,
    *,
    columnwise: bool = True,
    tiles: bool = False,
    rht: bool = False,
    rng_state: Tensor | None = None,
    row_scaled: bool = False,
    four_over_six: str = "",
    row_splits: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(row [M, K], col_t [K, M])``: ``x2`` quantised to NVFP4 and dequantised (fp32, exact),
    in blocks along K and, transposed, along M, with Transformer Engine's recipe options:

    * ``tiles``: one E4M3 scale per 16x16 tile (the tile's amax; weights), so the columnwise
      copy is the rowwise one transposed (the same quantised weight for both GEMMs);
    * ``rht``: the columnwise copy (the wgrad GEMM's operand) is that of
      :func:`random_hadamard_transform` of ``x2^T`` along M, with the global scale of its own
      amax; a wgrad GEMM of two such operands approximates the product, since ``S H / 4`` is
      orthogonal (the values stay in the transformed basis);
    * ``rng_state`` (int64 ``[2]``): stochastic rounding of the E2M1 values (gradients), the
      rowwise copy with words ``[0, M K)`` of the stream and the columnwise one with words
      ``[M K, 2 M K)``;
    * ``row_scaled``: the rowwise copy with one global scale per row, from the row's amax
      (row-scaled activations; their columnwise copy is the plain one);
    * ``four_over_six`` (:data:`FOUR_OVER_SIX`, ``"MAE:256"`` ...): 4over6 adaptive block
      scaling (Cook et al. 2025, as Transformer Engine's ``nvfp4_4over6``): every global scale
      maps the amax to ``e4m3_max * 6`` (256: room for a block scale times 1.5 below E4M3's
      448), and each block (16x16 tile with ``tiles``: the tile's summed error) is quantised
      twice, its scale mapping its amax to 6 and to 4 (the first scale times 1.5, both rounded
      to E4M3), keeping the candidate whose dequantised values have the smaller sum of
      absolute (MAE) or squared (MSE) errors against the fp32 input; 6 on a tie. Applied to
      both copies (the columnwise one after the transform with ``rht``);
    * ``row_splits``: the rows in consecutive groups of ``row_splits[i]`` rows, each group
      quantised as a tensor of its own (its global scales from its own amaxes, the
      transformed one's with ``rht``; a mixture of experts' tokens, gradients or weights), on
      the device without a host sync. The columnwise blocks must not straddle two groups:
      every group a multiple of 16 rows.

    ``columnwise=False``: ``col_t`` is 0-element. ``M`` and ``K`` even; with ``rht`` ``M`` a
    multiple of 16."""
    m, k = x2.shape
    x = x2.float()
    err_mode, e4m3_max = parse_four_over_six(four_over_six)
    u_row = u_col = None
    if rng_state is not None:
        u = _uniforms(rng_state, (2 if columnwise else 1) * m * k)
        u_row = u[: m * k].view(m, k)
        u_col = u[m * k :].view(k, m) if columnwise else None
    ids = groups = None
    if row_splits is not None:
        groups = row_splits.numel()
        ids = torch.repeat_interleave(
            torch.arange(groups, device=x.device), row_splits.to(x.device), output_size=m
        )
        g = _group_scales(_row_amax(x).float(), ids, groups, e4m3_max)[ids, None]
    else:
        g = nvfp4_global_scale(_tensor_amax(x), e4m3_max)
    g_row = _global_scales(_row_amax(x), e4m3_max)[:, None] if row_scaled else g
    pick = _tile_pick(x, g_row, err_mode) if tiles and err_mode else None
    block_amax = _tile_amaxes(x) if tiles else None
    data, scale = _nvfp4_rows(x, g_row, block_amax, u_row, err_mode,
                              None if pick is None else _expand_tiles(pick, m))  # fmt: skip
    row = _nvfp4_values(data, scale, g_row)
    if not columnwise:
        return row, x.new_empty(0)
    if tiles and not rht and u_col is None:
        return row, row.t().contiguous()
    xt = x.t()
    if rht:
        xt = random_hadamard_transform(xt)
    if ids is not None:  # one scale per block of 16 tokens: its group's
        if rht:
            col_amax = xt.abs().amax(0) if k else xt.new_zeros(m)
            g_col = _group_scales(col_amax, ids, groups, e4m3_max)[ids]
        else:
            g_col = g[:, 0]
        g_t = g_col[::NVFP4_BLOCK][None, :]
    elif rht:
        g_t = nvfp4_global_scale(_tensor_amax(xt), e4m3_max)
    else:
        g_t = g
    pick_t = None
    if pick is not None:
        pick_t = _tile_pick(xt, g_t, err_mode) if rht else pick.t()
        pick_t = _expand_tiles(pick_t, k)
    block_amax_t = _tile_amaxes(xt) if tiles else None
    data_t, scale_t = _nvfp4_rows(xt, g_t, block_amax_t, u_col, err_mode, pick_t)
    return row, _nvfp4_values(data_t, scale_t, g_t)


# Argument checks (eager and fakes: shapes and dtypes only) -----------------------------------


def _check_input(name: str, x: Tensor, rowwise: bool, columnwise: bool) -> None:
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"te.{name}: x.dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"te.{name}: x must have at least 1 dim ([..., K]), got a 0-dim tensor")
    if not (rowwise or columnwise):
        raise ValueError(f"te.{name}: at least one of rowwise and columnwise must be True")


def _check_quantize_mxfp8(x: Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool):
    _check_input("quantize_mxfp8", x, rowwise, columnwise)
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(
            "te.quantize_mxfp8: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
            f"got {fp8_dtype}"
        )


def check_quantize_nvfp4(x: Tensor, global_amax: Tensor | None, rowwise: bool, columnwise: bool):
    _check_input("quantize_nvfp4", x, rowwise, columnwise)
    if rowwise and x.shape[-1] % 2:
        raise ValueError(
            f"te.quantize_nvfp4: x.shape[-1] (K = {x.shape[-1]}) must be even for rowwise "
            "output: two E2M1 values per byte"
        )
    if columnwise and math.prod(x.shape[:-1]) % 2:
        raise ValueError(
            f"te.quantize_nvfp4: the row count M = prod(x.shape[:-1]) = "
            f"{math.prod(x.shape[:-1])} must be even for columnwise output: two E2M1 values "
            "per byte"
        )
    if global_amax is not None and (
        global_amax.dtype != torch.float32
        or global_amax.numel() != 1
        or global_amax.device != x.device
    ):
        raise ValueError(
            "te.quantize_nvfp4: global_amax must be None or a float32 tensor with one element "
            f"on x's device ({x.device}), got {global_amax.dtype} of shape "
            f"{list(global_amax.shape)} on {global_amax.device}"
        )


def _check_scale(name: str, data: Tensor, scale: Tensor, k: int, block: int, what: str) -> None:
    """``scale`` must be uint8 ``[M, ceil(K / block)]`` for ``data`` ``[..., *]`` (K elements
    per row); ``what`` says what its bytes hold."""
    m = math.prod(data.shape[:-1])
    expected = [m, -(-k // block)]
    if scale.dtype != torch.uint8 or list(scale.shape) != expected:
        raise ValueError(
            f"te.{name}: scale must hold {what} of shape [M, ceil(K/{block})] = {expected} for "
            f"data of shape {list(data.shape)}, got {scale.dtype} of shape {list(scale.shape)}"
        )
    if scale.device != data.device:
        raise ValueError(f"te.{name}: scale must be on data's device ({data.device})")


def _check_out_dtype(name: str, out_dtype: torch.dtype) -> None:
    if out_dtype not in _INPUT_DTYPES:
        raise ValueError(
            f"te.{name}: out_dtype must be float32, bfloat16 or float16, got {out_dtype}"
        )


def _check_fp8_data(data: Tensor) -> None:
    """The public function's check: the op itself takes the bytes (module docstring)."""
    if data.dtype not in _FP8_DTYPES:
        raise ValueError(
            "te.dequantize_mxfp8: data must be a float8_e4m3fn or float8_e5m2 tensor, got "
            f"{data.dtype}"
        )


def _check_dequantize_mxfp8(
    data: Tensor, scale: Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    if data.dtype != torch.uint8 or data.ndim < 1:
        raise ValueError(
            "te.dequantize_mxfp8: data must be the uint8 bytes of the fp8 data with at least 1 "
            f"dim, got {data.dtype} of shape {list(data.shape)}"
        )
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(
            "te.dequantize_mxfp8: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
            f"got {fp8_dtype}"
        )
    k = data.shape[-1]
    _check_scale("dequantize_mxfp8", data, scale, k, MXFP8_BLOCK, "E8M0 exponents (uint8)")
    _check_out_dtype("dequantize_mxfp8", out_dtype)


def _check_dequantize_nvfp4(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> None:
    if data.dtype != torch.uint8 or data.ndim < 1:
        raise ValueError(
            "te.dequantize_nvfp4: data must be a uint8 tensor (two E2M1 codes per byte) with at "
            f"least 1 dim, got {data.dtype} of shape {list(data.shape)}"
        )
    what = "E4M3 scales (their uint8 bytes: module docstring)"
    _check_scale("dequantize_nvfp4", data, scale, 2 * data.shape[-1], NVFP4_BLOCK, what)
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(
            "te.dequantize_nvfp4: global_scale must be a float32 tensor with one element, got "
            f"{global_scale.dtype} of shape {list(global_scale.shape)}"
        )
    if global_scale.device != data.device:
        raise ValueError(
            f"te.dequantize_nvfp4: global_scale must be on data's device ({data.device})"
        )
    _check_out_dtype("dequantize_nvfp4", out_dtype)


def _kernels():
    # Imported on first CUDA use: Triton is not a dependency of the CPU-only package.
    from te_compile.kernels import quantize_mx

    return quantize_mx


# Sample inputs for the registry test ---------------------------------------------------------


def _x(device: torch.device, *shape: int, dtype=torch.float32, spread: float = 4.0) -> Tensor:
    """Values over several binades, so blocks get different scales."""
    x = torch.randn(*shape) * torch.exp2(torch.randint(-4, 5, shape) * spread / 4)
    return x.to(device=device, dtype=dtype)


def _quantize_mxfp8_samples(device: torch.device):
    bf16 = torch.bfloat16
    yield SampleInput((_x(device, 5, 40, dtype=bf16), torch.float8_e4m3fn, True, True))
    yield SampleInput((_x(device, 2, 3, 64), torch.float8_e5m2, True, False))
    yield SampleInput((_x(device, 33, 7), torch.float8_e4m3fn, False, True))


def _dequantize_mxfp8_samples(device: torch.device):
    for shape, fp8_dtype, out_dtype in [
        ((5, 40), torch.float8_e4m3fn, torch.bfloat16),
        ((2, 3, 64), torch.float8_e5m2, torch.float32),
    ]:
        data, scale, _, _ = quantize_mxfp8_ref(_x(torch.device("cpu"), *shape), fp8_dtype)
        data = data.view(torch.uint8).to(device)
        yield SampleInput((data, scale.to(device), fp8_dtype, out_dtype))


def _quantize_nvfp4_samples(device: torch.device):
    yield SampleInput((_x(device, 6, 40, dtype=torch.bfloat16), None, True, True))
    yield SampleInput((_x(device, 2, 3, 32), torch.tensor([8.0], device=device), True, False))
    yield SampleInput((_x(device, 34, 7), None, False, True))


def _dequantize_nvfp4_samples(device: torch.device):
    for shape, out_dtype in [((6, 40), torch.bfloat16), ((2, 3, 32), torch.float32)]:
        data, scale, g, _, _ = quantize_nvfp4_ref(_x(torch.device("cpu"), *shape))
        scale = scale.view(torch.uint8).to(device)
        yield SampleInput((data.to(device), scale, g.to(device), out_dtype))


# 2. Ops ---------------------------------------------------------------------------------------


@op("quantize_mxfp8", sample_inputs=_quantize_mxfp8_samples)
def quantize_mxfp8_op(
    x: Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(data, scale, data_t, scale_t)``. Default (CPU) implementation: the reference."""
    _check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)
    return quantize_mxfp8_ref(x, fp8_dtype, rowwise, columnwise)


@quantize_mxfp8_op.register_kernel("cuda")
def _quantize_mxfp8_cuda(x, fp8_dtype, rowwise, columnwise):
    _check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)
    return _kernels().quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)


@op("dequantize_mxfp8", sample_inputs=_dequantize_mxfp8_samples)
def dequantize_mxfp8_op(
    data: Tensor, scale: Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> Tensor:
    """``data`` (the uint8 bytes of ``fp8_dtype`` values) dequantised to ``out_dtype``. Default
    (CPU) implementation: the reference."""
    _check_dequantize_mxfp8(data, scale, fp8_dtype, out_dtype)
    return dequantize_mxfp8_ref(data.view(fp8_dtype), scale, out_dtype)


@dequantize_mxfp8_op.register_kernel("cuda")
def _dequantize_mxfp8_cuda(data, scale, fp8_dtype, out_dtype):
    _check_dequantize_mxfp8(data, scale, fp8_dtype, out_dtype)
    return _kernels().dequantize_mxfp8(data.view(fp8_dtype), scale, out_dtype)


@op("quantize_nvfp4", sample_inputs=_quantize_nvfp4_samples)
def quantize_nvfp4_op(
    x: Tensor, global_amax: Tensor | None, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(data, scale, global_scale, data_t, scale_t)``. Default (CPU) implementation:
    the reference."""
    check_quantize_nvfp4(x, global_amax, rowwise, columnwise)
    return quantize_nvfp4_ref(x, global_amax, rowwise, columnwise)


@quantize_nvfp4_op.register_kernel("cuda")
def _quantize_nvfp4_cuda(x, global_amax, rowwise, columnwise):
    check_quantize_nvfp4(x, global_amax, rowwise, columnwise)
    # The tensor amax is a reduction over all of x before any block can be scaled: torch's.
    g = nvfp4_global_scale(_tensor_amax(x) if global_amax is None else global_amax)
    data, scale, data_t, scale_t = _kernels().quantize_nvfp4(x, g, rowwise, columnwise)
    return data, scale, g, data_t, scale_t


@op("dequantize_nvfp4", sample_inputs=_dequantize_nvfp4_samples)
def dequantize_nvfp4_op(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``data`` dequantised to ``out_dtype``; ``scale`` is the uint8 bytes of the E4M3 scales.
    Default (CPU) implementation: the reference."""
    _check_dequantize_nvfp4(data, scale, global_scale, out_dtype)
    return dequantize_nvfp4_ref(data, scale.view(torch.float8_e4m3fn), global_scale, out_dtype)


@dequantize_nvfp4_op.register_kernel("cuda")
def _dequantize_nvfp4_cuda(data, scale, global_scale, out_dtype):
    _check_dequantize_nvfp4(data, scale, global_scale, out_dtype)
    e4m3 = scale.view(torch.float8_e4m3fn)
    return _kernels().dequantize_nvfp4(data, e4m3, global_scale, out_dtype)


# 3. Fakes -------------------------------------------------------------------------------------


@quantize_mxfp8_op.register_fake
def _quantize_mxfp8_fake(x, fp8_dtype, rowwise, columnwise):
    _check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)
    m, k, b = math.prod(x.shape[:-1]), x.shape[-1], MXFP8_BLOCK
    u8 = torch.uint8
    data = x.new_empty(x.shape if rowwise else (0,), dtype=fp8_dtype)
    scale = x.new_empty((m, (k + b - 1) // b) if rowwise else (0,), dtype=u8)
    data_t = x.new_empty((k, m) if columnwise else (0,), dtype=fp8_dtype)
    scale_t = x.new_empty((k, (m + b - 1) // b) if columnwise else (0,), dtype=u8)
    return data, scale, data_t, scale_t


@dequantize_mxfp8_op.register_fake
def _dequantize_mxfp8_fake(data, scale, fp8_dtype, out_dtype):
    _check_dequantize_mxfp8(data, scale, fp8_dtype, out_dtype)
    return data.new_empty(data.shape, dtype=out_dtype)


@quantize_nvfp4_op.register_fake
def _quantize_nvfp4_fake(x, global_amax, rowwise, columnwise):
    check_quantize_nvfp4(x, global_amax, rowwise, columnwise)
    m, k, b = math.prod(x.shape[:-1]), x.shape[-1], NVFP4_BLOCK
    u8, e4m3 = torch.uint8, torch.float8_e4m3fn
    data = x.new_empty((*x.shape[:-1], k // 2) if rowwise else (0,), dtype=u8)
    scale = x.new_empty((m, (k + b - 1) // b) if rowwise else (0,), dtype=e4m3)
    data_t = x.new_empty((k, m // 2) if columnwise else (0,), dtype=u8)
    scale_t = x.new_empty((k, (m + b - 1) // b) if columnwise else (0,), dtype=e4m3)
    return data, scale, x.new_empty((), dtype=torch.float32), data_t, scale_t


@dequantize_nvfp4_op.register_fake
def _dequantize_nvfp4_fake(data, scale, global_scale, out_dtype):
    _check_dequantize_nvfp4(data, scale, global_scale, out_dtype)
    return data.new_empty((*data.shape[:-1], 2 * data.shape[-1]), dtype=out_dtype)


# Public functions -----------------------------------------------------------------------------


def _check_public(
    owner: str,
    tensors: dict[str, object],
    rowwise: object = True,
    columnwise: object = True,
    **dtypes: object,
) -> None:
    """The public functions' argument types, by name, before the ops' schema parser sees them
    (it would raise a RuntimeError naming the op's own parameters); ``tensors`` holds the
    required ones (None refused)."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            got = "None" if t is None else type(t).__name__
            raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {got}")
    check_bool(owner, rowwise=rowwise, columnwise=columnwise)
    for name, dtype in dtypes.items():
        if name == "fp8_dtype" and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(
                f"{owner}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                f"got {dtype!r}"
            )
        if name == "out_dtype" and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{owner}: out_dtype must be a floating torch.dtype, got {dtype!r}")


def quantize_mxfp8(
    x: Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MXFP8 of ``x`` ``[..., K]``: ``(data, scale, data_t, scale_t)``, see the module docstring
    for the layouts; a direction not asked for gives 0-element tensors."""
    _check_public("te.quantize_mxfp8", {"x": x}, rowwise, columnwise, fp8_dtype=fp8_dtype)
    return quantize_mxfp8_op(x, fp8_dtype, rowwise, columnwise)


def dequantize_mxfp8(
    data: Tensor, scale: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Inverse of :func:`quantize_mxfp8` for one direction: ``(data, scale)`` or
    ``(data_t, scale_t)`` (which gives ``x`` transposed, ``[K, M]``)."""
    _check_public("te.dequantize_mxfp8", {"data": data, "scale": scale}, out_dtype=out_dtype)
    _check_fp8_data(data)
    return dequantize_mxfp8_op(data.view(torch.uint8), scale, data.dtype, out_dtype)


def quantize_nvfp4(
    x: Tensor,
    global_amax: Tensor | None = None,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """NVFP4 of ``x`` ``[..., K]``: ``(data, scale, global_scale, data_t, scale_t)``, see the
    module docstring; ``global_amax`` (fp32, one element) replaces the tensor's own amax."""
    tensors = {"x": x} if global_amax is None else {"x": x, "global_amax": global_amax}
    _check_public("te.quantize_nvfp4", tensors, rowwise, columnwise)
    return quantize_nvfp4_op(x, global_amax, rowwise, columnwise)


def dequantize_nvfp4(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Inverse of :func:`quantize_nvfp4` for one direction: ``(data, scale, global_scale)`` or
    ``(data_t, scale_t, global_scale)`` (which gives ``x`` transposed, ``[K, M]``)."""
    tensors = {"data": data, "scale": scale, "global_scale": global_scale}
    _check_public("te.dequantize_nvfp4", tensors, out_dtype=out_dtype)
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"te.dequantize_nvfp4: scale must be a torch.float8_e4m3fn tensor, got {scale.dtype}"
        )
    return dequantize_nvfp4_op(data, scale.view(torch.uint8), global_scale, out_dtype)
