r"""The reference math of MXFP8 and NVFP4 block quantisation (``functional.quantize_mx`` defines
the ops and states the definition in its module docstring): the ops' CPU implementations, the
definition their CUDA kernels reproduce bit for bit, and Transformer Engine's NVFP4 recipe
options as the emulated GEMMs apply them (:func:`nvfp4_qdq`: the random Hadamard transform,
stochastic rounding, 16x16 tiles, row-scaled inputs, 4over6 block scaling)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from te_compile._numerics import acc_dtype, div_rn, reciprocal_rn

__all__ = [
    "FOUR_OVER_SIX",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "RHT_SIGNS",
    "dequantize_mxfp8_ref",
    "dequantize_nvfp4_ref",
    "mxfp8_qdq_tiles",
    "nvfp4_global_scale",
    "nvfp4_qdq",
    "nvfp4_qdq_row_groups",
    "nvfp4_weight",
    "nvfp4_weight_values",
    "parse_four_over_six",
    "quantize_mxfp8_ref",
    "quantize_nvfp4_ref",
    "random_hadamard_transform",
    "spread_blocks",
    "tensor_amax",
]


MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
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


def _mxfp8_rows(
    x2: Tensor, fp8_dtype: torch.dtype, amax: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """MXFP8 of the rows of ``x2`` ``[M, K]``: ``(data [M, K], scale [M, ceil(K/32)])``.
    ``amax`` ``[M, ceil(K/32)]``: each block's scale from it instead of its own values (a
    32x32 tile's amax, :func:`mxfp8_qdq_tiles`)."""
    max_value, emax = _FP8_LIMITS[fp8_dtype]
    if amax is None:
        amax = _blocks(x2, MXFP8_BLOCK).abs().amax(-1)  # NaN if the block holds a NaN
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
    skipped = x.new_empty(0, dtype=fp8_dtype), x.new_empty(0, dtype=torch.uint8)
    data, scale = _mxfp8_rows(x2, fp8_dtype) if rowwise else skipped
    data_t, scale_t = _mxfp8_rows(x2.t(), fp8_dtype) if columnwise else skipped
    return data.view(x.shape) if rowwise else data, scale, data_t, scale_t


def mxfp8_qdq_tiles(x2: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """MXFP8 with one E8M0 scale per 32x32 tile of ``x2`` ``[M, K]`` (a weight under
    ``MXFP8BlockScaling(enable_2d_quantization=True)``), dequantised to fp32: each 1x32 block
    takes its tile's amax, so the rowwise and the columnwise copy hold the same values (the
    forward and the dgrad GEMM see one quantised weight)."""
    tiles = _tile_amax(x2, MXFP8_BLOCK)
    data, scale = _mxfp8_rows(x2, fp8_dtype, spread_blocks(tiles, 0, x2.shape[0], MXFP8_BLOCK))
    return dequantize_mxfp8_ref(data, scale, torch.float32)


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


def tensor_amax(x: Tensor) -> Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty tensor); NaN if ``x`` holds a NaN."""
    return x.new_zeros((), dtype=torch.float32) if x.numel() == 0 else x.abs().amax().float()


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


def _e2m1_values(codes: Tensor) -> Tensor:
    """The fp32 E2M1 values of 4-bit ``codes`` (``sign << 3 | magnitude``)."""
    values = codes.new_tensor(_E2M1_VALUES, dtype=torch.float32)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -values, values)


def _unpacked(data: Tensor) -> Tensor:
    """The 4-bit codes ``[M, K]`` of NVFP4 bytes ``[M, K/2]`` (two a byte, low nibble first)."""
    return torch.stack([data & 0xF, data >> 4], -1).reshape(data.shape[0], 2 * data.shape[1])


def _block_values(e2m1: Tensor, scale: Tensor, g: Tensor) -> Tensor:
    """fp32 values ``e2m1 * scale / g`` of E2M1 values ``[M, nb, 16]`` (:func:`_e2m1_values`;
    E4M3 ``scale`` ``[M, nb]``; ``g`` broadcastable to ``[M, nb]``)."""
    return div_rn(e2m1 * scale.float()[..., None], g[..., None])


def _four_over_six_errors(xb, amax, g, err_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(err4, err6, cand4, cand6)``: each block's sum of ``|q - x|`` (``"MAE"``) or
    ``(q - x)^2`` (``"MSE"``) over its 16 values for the map-to-4 and map-to-6 candidates
    (:func:`_nvfp4_candidate`, ``q`` dequantised), and the candidates."""
    cands = [_nvfp4_candidate(xb, amax, g, four, None) for four in (True, False)]
    diffs = [_block_values(_e2m1_values(codes), scale, g) - xb for codes, scale in cands]
    return *((d.abs() if err_mode == "MAE" else d * d).sum(-1) for d in diffs), *cands


def _nvfp4_blocks(x2: Tensor, g: Tensor, tiles: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(xb, amax, g)``: the fp32 blocks ``[M, nb, 16]`` of ``x2`` ``[M, K]``, their amaxes
    ``[M, nb]`` (with ``tiles``, each block's 16x16 tile's) and ``g`` broadcast to them."""
    xb = _blocks(x2, NVFP4_BLOCK)
    if tiles:
        amax = spread_blocks(_tile_amax(x2, NVFP4_BLOCK), 0, x2.shape[0], NVFP4_BLOCK)
    else:
        amax = xb.abs().amax(-1)
    return xb, amax, g.expand(amax.shape) if g.dim() == 2 else g


def _nvfp4_rows(
    x2: Tensor, g: Tensor, tiles: bool, err_mode: str, pick: Tensor | None, u: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """NVFP4 of the rows of ``x2`` ``[M, K]`` (K even) with global scale ``g`` (0-dim, or
    broadcastable to ``[M, ceil(K/16)]``: one per row or per block):
    ``(data [M, K/2] uint8, scale [M, ceil(K/16)] e4m3)``. ``tiles``: each block's amax taken over
    its 16x16 tile; ``err_mode``: the error metric (``"MAE"``, ``"MSE"``; ``""``: off) of 4over6
    block scaling, each block keeping the candidate of lower error (map to 4 when strictly lower,
    else 6), or its tile's choice in ``pick`` (bool ``[ceil(M/16), ceil(K/16)]``, True: map to 4)
    when given; ``u``: uniforms ``[M, K]`` for stochastic rounding (:func:`_e2m1_codes`)."""
    xb, amax, g = _nvfp4_blocks(x2, g, tiles)
    if not err_mode and pick is None:
        ub = None if u is None else _blocks(u, NVFP4_BLOCK)
        codes, scale = _nvfp4_candidate(xb, amax, g, False, ub)
    else:
        err4, err6, (c4, s4), (c6, s6) = _four_over_six_errors(xb, amax, g, err_mode or "MAE")
        pick = err4 < err6 if pick is None else spread_blocks(pick, 0, x2.shape[0], NVFP4_BLOCK)
        codes = torch.where(pick[..., None], c4, c6)
        scale = torch.where(pick, s4.view(torch.uint8), s6.view(torch.uint8)).view(s4.dtype)
    codes = _unblock(codes, x2.shape[1])
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def _tile_pick(x2: Tensor, g: Tensor, err_mode: str) -> Tensor:
    """4over6 with 16x16 tiles: bool ``[ceil(M/16), ceil(K/16)]``, True where the tile maps to
    4, from the tile's summed error (one choice per tile, so that the rowwise and columnwise
    copies stay the same quantised values)."""
    err4, err6, _, _ = _four_over_six_errors(*_nvfp4_blocks(x2, g, True), err_mode)
    pad = -x2.shape[0] % NVFP4_BLOCK
    tile4, tile6 = (
        F.pad(e, (0, 0, 0, pad)).view(-1, NVFP4_BLOCK, e.shape[1]).sum(1) for e in (err4, err6)
    )
    return tile4 < tile6


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
    g = nvfp4_global_scale(tensor_amax(x) if global_amax is None else global_amax, e4m3_max)
    x2 = _rows(x)
    pick = _tile_pick(x2.float(), g, err_mode) if tiles and err_mode else None
    skipped = x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.float8_e4m3fn)
    data, scale = _nvfp4_rows(x2, g, tiles, err_mode, pick) if rowwise else skipped
    pick_t = None if pick is None else pick.t()
    data_t, scale_t = _nvfp4_rows(x2.t(), g, tiles, err_mode, pick_t) if columnwise else skipped
    if rowwise:
        data = data.reshape(*x.shape[:-1], x.shape[-1] // 2)
    return data, scale, g, data_t, scale_t


def dequantize_nvfp4_ref(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``e2m1 * scale / global_scale`` per 16-element block: ``[..., K/2]`` bytes to
    ``[..., K]`` values."""
    rows = data.reshape(scale.shape[0], data.shape[-1])
    out = _nvfp4_values(rows, scale, global_scale.float().reshape(()))
    return out.view(*data.shape[:-1], 2 * data.shape[-1]).to(out_dtype)


def _nvfp4_values(data: Tensor, scale: Tensor, g: Tensor) -> Tensor:
    """fp32 ``[M, K]`` values of the NVFP4 rows ``data`` ``[M, K/2]`` (E4M3 ``scale``) over the
    global scale ``g`` (0-dim, or broadcastable to ``scale``'s shape: one a row or a block)."""
    m, k = data.shape[0], 2 * data.shape[1]
    codes = F.pad(_unpacked(data), (0, -k % NVFP4_BLOCK)).view(m, scale.shape[-1], NVFP4_BLOCK)
    return _unblock(_block_values(_e2m1_values(codes), scale, g), k)


def nvfp4_weight(w2: Tensor, tiles: bool, four_over_six: str) -> list[Tensor]:
    """A weight ``[N, K]`` kept in NVFP4 (FP8 primary weights): ``[elements, scale, elements_t,
    scale_t, g]``. Each element's E2M1 value as ``float8_e4m3fn`` (exact; one byte an element,
    not two a byte) with its E4M3 block scales, ``[N, ceil(K/16)]``, or with ``tiles`` one a
    16x16 tile, ``[ceil(N/16), ceil(K/16)]`` (then ``elements_t`` / ``scale_t`` are 0-element:
    the transposes are the columnwise copy); else the columnwise copy quantised along ``N``;
    ``g``: the global scale ``[1]``. :func:`quantize_nvfp4_ref` with ``four_over_six``."""
    data, scale, g, data_t, scale_t = quantize_nvfp4_ref(w2, None, True, not tiles, tiles,
                                                         four_over_six)  # fmt: skip

    def elements(packed: Tensor) -> Tensor:
        return _e2m1_values(_unpacked(packed)).to(torch.float8_e4m3fn)

    if tiles:
        none = scale.new_empty(0)
        return [elements(data), scale[::NVFP4_BLOCK].contiguous(), none, none, g.reshape(1)]
    return [elements(data), scale, elements(data_t), scale_t, g.reshape(1)]


def nvfp4_weight_values(elements: Tensor, scale: Tensor, g: Tensor) -> Tensor:
    """fp32 values ``[N, K]`` of :func:`nvfp4_weight`'s ``elements`` with their ``scale`` (of
    blocks, or of tiles) over ``g``: the bits of :func:`dequantize_nvfp4_ref` of the
    quantisation it kept."""
    n = elements.shape[0]
    if scale.shape[0] != n:  # one scale a 16x16 tile
        scale = spread_blocks(scale, 0, n, NVFP4_BLOCK)
    values = _block_values(_blocks(elements, NVFP4_BLOCK), scale, g.reshape(()))
    return _unblock(values, elements.shape[1])


def nvfp4_qdq_row_groups(x: Tensor, row_splits: Tensor, tiles: bool = False) -> Tensor:
    """The rowwise copy of :func:`nvfp4_qdq` with ``row_splits`` (its groups of rows, the leading
    dims of ``x`` ``[..., K]`` flattened, each quantised as a tensor of its own: a group holding a
    NaN gets ``g = 1``) and ``tiles`` (groups of a multiple of 16 rows), in ``x``'s shape."""
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
    acc = acc_dtype(x2)
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


def _tile_amax(x2: Tensor, tile: int) -> Tensor:
    """The amax ``[ceil(M/tile), ceil(K/tile)]`` of every ``tile x tile`` tile of ``x2`` (fp32,
    zero-padded)."""
    m, k = x2.shape
    padded = F.pad(x2.float().abs(), (0, -k % tile, 0, -m % tile))
    return padded.view(-(-m // tile), tile, -(-k // tile), tile).amax((1, 3))


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
    """The global scale ``[groups]`` of every group of rows (``ids``: each row's group) from the
    rows' amaxes, on the device (no host sync); a group holding a NaN gets 1, as a tensor does."""
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
    if rng_state is not None:  # fp32 uniforms in [0, 1): the words' top 24 bits (exact in fp32)
        from te_compile.functional.dropout_ops import random_words

        u = (random_words(rng_state, (2 if columnwise else 1) * m * k) >> 8).float() * 2.0**-24
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
        g = nvfp4_global_scale(tensor_amax(x), e4m3_max)
    g_row = _global_scales(_row_amax(x), e4m3_max)[:, None] if row_scaled else g
    pick = _tile_pick(x, g_row, err_mode) if tiles and err_mode else None
    row = _nvfp4_values(*_nvfp4_rows(x, g_row, tiles, err_mode, pick, u_row), g_row)
    if not columnwise:
        return row, x.new_empty(0)
    if tiles and not rht and u_col is None:
        return row, row.t().contiguous()
    xt = random_hadamard_transform(x.t()) if rht else x.t()
    if ids is not None:  # one scale per block of 16 tokens: its group's
        g_col = _group_scales(_row_amax(xt.t()), ids, groups, e4m3_max)[ids] if rht else g[:, 0]
        g_t = g_col[::NVFP4_BLOCK][None, :]
    elif rht:
        g_t = nvfp4_global_scale(tensor_amax(xt), e4m3_max)
    else:
        g_t = g
    if pick is not None:
        pick = _tile_pick(xt, g_t, err_mode) if rht else pick.t()
    return row, _nvfp4_values(*_nvfp4_rows(xt, g_t, tiles, err_mode, pick, u_col), g_t)
