r"""``te.quantize`` / ``te.dequantize`` over every recipe kind: :func:`quantize`
(``recipe_kind`` "delayed", "current", "block", "mxfp8" or "nvfp4") returns a :class:`Quantized`
and :func:`dequantize` inverts it. Both dispatch through one table per direction
(``_QUANTIZERS``, ``_DEQUANTIZERS``) to the ops of ``functional.quantize`` (FP8 per tensor and
blockwise) and ``functional.quantize_mx`` (MXFP8, NVFP4), so a new kind is one entry each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import check_bool, check_choice
from te_compile._numerics import reciprocal_rn
from te_compile.functional import quantize_mx, quantize_mx_ref
from te_compile.functional.quantize import (
    dequantize_blockwise,
    dequantize_tensorwise,
    quantize_blockwise,
    quantize_current,
    quantize_tensorwise,
)
from te_compile.kernels import tracing

__all__ = ["Quantized", "dequantize", "quantize"]


class Quantized(NamedTuple):
    """A quantised tensor as plain tensors (never a tensor subclass).

    ``data``: FP8, the input's shape. ``scale_inv``: what to multiply ``data`` by to dequantise
    (``[1]`` per tensor; per block in ``functional.quantize``'s layout). ``data_t`` and
    ``scale_inv_t``: the columnwise ``[K, M]`` copy and its scales, None unless
    ``columnwise=True`` (per-tensor kinds share ``scale_inv``: the same tensor). ``amax``: ``[1]``
    fp32 ``max|x|`` for the per-tensor kinds, else None. ``kind`` and ``block_rows``: how it was
    made, which :func:`dequantize` dispatches on. For "mxfp8" ``scale_inv`` holds the E8M0
    block scales (uint8) and for "nvfp4" the E4M3 block scales, with the per-tensor
    ``global_scale`` (``quantize_mx``'s layouts)."""

    data: Tensor
    scale_inv: Tensor
    data_t: Tensor | None
    scale_inv_t: Tensor | None
    amax: Tensor | None
    kind: str
    block_rows: int = 1
    global_scale: Tensor | None = None


def _quantize_delayed(x: Tensor, *, fp8_dtype, scale, columnwise, **_) -> Quantized:
    if scale is None:
        raise ValueError(
            'te.quantize: recipe_kind "delayed" needs scale= (a 1-element torch.float32 tensor, '
            "the scale derived from the amax history)"
        )
    # The scale must be finite and > 0: 0 or inf would cast every value to 0 or to the format's
    # largest, NaN every value to NaN, a negative one flip the signs. One host read: quantize is
    # a utility (the modules' delayed scales come from the amax history, finite and > 0). Not
    # while tracing (torch.compile, fake tensors): no data to read. A wrong shape: the op raises.
    if scale.numel() == 1 and not (torch.compiler.is_compiling() or tracing()):
        value = scale.detach().reshape(()).item()
        if not 0 < value < math.inf:
            raise ValueError(f"te.quantize: scale must be finite and > 0, got {value}")
    data, data_t, amax = quantize_tensorwise(x, scale, fp8_dtype, columnwise)
    scale_inv = reciprocal_rn(scale.reshape(1))
    return _quantized(columnwise, data, scale_inv, data_t, scale_inv, amax, "delayed")


def _quantized(columnwise: bool, data, scale_inv, data_t, scale_inv_t, *rest) -> Quantized:
    """A :class:`Quantized` whose columnwise copy is None unless ``columnwise``."""
    t = (data_t, scale_inv_t) if columnwise else (None, None)
    return Quantized(data, scale_inv, *t, *rest)


def _quantize_current(
    x: Tensor, *, fp8_dtype, columnwise, amax_epsilon, power_2_scale, **_
) -> Quantized:
    data, data_t, scale_inv, amax = quantize_current(
        x, fp8_dtype, columnwise, amax_epsilon, power_2_scale
    )
    return _quantized(columnwise, data, scale_inv, data_t, scale_inv, amax, "current")


def _quantize_block(
    x: Tensor, *, fp8_dtype, block_rows, power_2_scale, columnwise, **_
) -> Quantized:
    out = quantize_blockwise(x, fp8_dtype, block_rows, power_2_scale, columnwise)
    return _quantized(columnwise, *out, None, "block", block_rows)  # out: in _quantized's order


# Every dequantiser: (q, data, scale_inv, out_dtype), the rowwise or the columnwise pair of q.
def _dequantize_fp8(q: Quantized, data, scale_inv, out_dtype: torch.dtype) -> Tensor:
    u8 = data.view(torch.uint8)
    if q.kind == "block":
        return dequantize_blockwise(u8, scale_inv, q.block_rows, data.dtype, out_dtype)
    return dequantize_tensorwise(u8, scale_inv, data.dtype, out_dtype)


def _quantize_mxfp8(x: Tensor, *, fp8_dtype: torch.dtype, columnwise, **_) -> Quantized:
    out = quantize_mx.quantize_mxfp8(x, fp8_dtype, columnwise=columnwise)
    return _quantized(columnwise, *out, None, "mxfp8", 1)  # out: in _quantized's order


def _quantize_nvfp4(x: Tensor, *, columnwise, block_rows, four_over_six, **_) -> Quantized:
    """1x16 blocks (``block_rows=1``: the op) or 16x16 tiles (16: every scale of a tile the
    same, from the tile's amax), ``four_over_six``: 4over6 block scaling (tiles and 4over6: the
    reference math, any device)."""
    if block_rows not in (1, 16):
        raise ValueError(
            "te.quantize: block_rows must be 1 (1x16 blocks) or 16 (16x16 tiles) for 'nvfp4', "
            f"got {block_rows}"
        )
    quantize_mx_ref.parse_four_over_six(four_over_six)  # raises for an unknown setting
    if block_rows == 16 or four_over_six:
        quantize_mx.check_quantize_nvfp4(x, None, True, columnwise)
        ref = quantize_mx_ref.quantize_nvfp4_ref
        data, s, g, data_t, s_t = ref(x, None, True, columnwise, block_rows == 16, four_over_six)
    else:
        data, s, g, data_t, s_t = quantize_mx.quantize_nvfp4(x, columnwise=columnwise)
    return _quantized(columnwise, data, s, data_t, s_t, None, "nvfp4", block_rows, g)


def _dequantize_mx(q: Quantized, data, s, out_dtype: torch.dtype) -> Tensor:
    if q.kind == "mxfp8":
        return quantize_mx.dequantize_mxfp8(data, s, out_dtype)
    return quantize_mx.dequantize_nvfp4(data, s, q.global_scale, out_dtype)


_QUANTIZERS: dict[str, Callable[..., Quantized]] = {
    "delayed": _quantize_delayed,
    "current": _quantize_current,
    "block": _quantize_block,
    "mxfp8": _quantize_mxfp8,
    "nvfp4": _quantize_nvfp4,
}
_KINDS = tuple(sorted(_QUANTIZERS))
_DEQUANTIZERS: dict[str, Callable[..., Tensor]] = {
    "delayed": _dequantize_fp8,
    "current": _dequantize_fp8,
    "block": _dequantize_fp8,
    "mxfp8": _dequantize_mx,
    "nvfp4": _dequantize_mx,
}


def quantize(
    tensor: Tensor,
    recipe_kind: str,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale: Tensor | None = None,
    block_rows: int = 1,
    power_2_scale: bool = False,
    columnwise: bool = False,
    amax_epsilon: float = 0.0,
    four_over_six: str = "",
) -> Quantized:
    """Quantise ``tensor`` to FP8 with one recipe kind:

    * ``"delayed"``: per-tensor with the given ``scale`` (1-element fp32); one read.
    * ``"current"``: per-tensor with the scale from ``tensor``'s amax (``amax_epsilon``,
      ``power_2_scale``); two reads.
    * ``"block"``: ``block_rows x 128`` blocks (``block_rows`` 1 or 128; ``power_2_scale``).
    * ``"mxfp8"``: 32-element blocks with E8M0 scales (``fp8_dtype`` elements).
    * ``"nvfp4"``: E2M1 elements (two per byte), 16-element E4M3 block scales, a global scale;
      ``four_over_six`` (``quantize_mx_ref.FOUR_OVER_SIX``, ``""`` off): 4over6 block scaling.

    ``columnwise=True`` also makes the ``[K, M]`` copy for the backward GEMMs. Returns a
    :class:`Quantized`; :func:`dequantize` inverts it. ``scale`` must be finite and > 0 (read
    on the host in eager; not checked while ``torch.compile`` traces)."""
    check_bool("te.quantize", power_2_scale=power_2_scale, columnwise=columnwise)
    check_choice("te.quantize", "recipe_kind", recipe_kind, _KINDS)
    if four_over_six and recipe_kind != "nvfp4":
        raise ValueError(
            f"te.quantize: four_over_six is for recipe_kind='nvfp4', got {recipe_kind!r}"
        )
    if scale is not None and recipe_kind != "delayed":
        raise ValueError(
            f'te.quantize: scale= is only for recipe_kind "delayed"; "{recipe_kind}" computes '
            "its own"
        )
    return _QUANTIZERS[recipe_kind](
        tensor,
        fp8_dtype=fp8_dtype,
        scale=scale,
        block_rows=block_rows,
        power_2_scale=power_2_scale,
        columnwise=columnwise,
        amax_epsilon=amax_epsilon,
        four_over_six=four_over_six,
    )


def dequantize(q: Quantized, out_dtype: torch.dtype, *, columnwise: bool = False) -> Tensor:
    """``q``'s values in ``out_dtype`` (fp32, bf16 or fp16): ``data``'s shape, or with
    ``columnwise=True`` the ``[K, M]`` copy ``data_t``'s."""
    check_bool("te.dequantize", columnwise=columnwise)
    if columnwise and q.data_t is None:
        raise ValueError(
            "te.dequantize: columnwise=True needs q.data_t (quantize(..., columnwise=True))"
        )
    data, scale_inv = (q.data_t, q.scale_inv_t) if columnwise else (q.data, q.scale_inv)
    return _DEQUANTIZERS[q.kind](q, data, scale_inv, out_dtype)
