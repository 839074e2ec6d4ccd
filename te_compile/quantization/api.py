"""``te_compile.quantize`` / ``te_compile.dequantize``: quantise a tensor the way a recipe would.

``quantize(tensor, recipe, role=...)`` maps a recipe and the tensor's role in a linear layer
(``"input"``, ``"weight"`` or ``"grad"``) to the quantisation op and its settings, exactly as the
modules do: the element format (forward format for inputs and weights, backward format for
gradients under ``Format.HYBRID``), per-tensor delayed (``scale=`` required: the scale the
amax history gives) or current scaling, 1x128 / 128x128 FP8 blocks (``*_block_scaling_dim``),
MXFP8 32-element blocks, NVFP4. The result is a :class:`~te_compile.functional.quantize.Quantized`
of plain tensors (data and scales; ``columnwise=True`` adds the transposed copy a backward GEMM
needs); ``dequantize`` inverts it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile.functional import quantize as _q
from te_compile.quantization.recipe import Recipe

__all__ = ["ROLES", "dequantize", "quantize"]

ROLES = ("input", "weight", "grad")


def quantize(
    tensor: Tensor,
    recipe: Recipe,
    *,
    role: str = "input",
    scale: Tensor | None = None,
    columnwise: bool = False,
) -> _q.Quantized:
    """``tensor`` quantised as ``recipe`` quantises a linear layer's ``role`` operand."""
    if role not in ROLES:
        raise ValueError(f"te.quantize: role must be one of {ROLES}, got {role!r}")
    if not isinstance(recipe, Recipe):
        raise ValueError(f"te.quantize: recipe must be a te_compile.recipe recipe, got {recipe!r}")
    kw = {"scale": scale, "columnwise": columnwise}
    if recipe.nvfp4():
        return _q.quantize(tensor, "nvfp4", **kw)
    fmt = recipe.fp8_format
    kw["fp8_dtype"] = fmt.bwd_dtype if role == "grad" else fmt.fwd_dtype
    if recipe.mxfp8():
        return _q.quantize(tensor, "mxfp8", **kw)
    if recipe.delayed():
        return _q.quantize(tensor, "delayed", **kw)
    if recipe.float8_current_scaling():
        return _q.quantize(tensor, "current", power_2_scale=recipe.use_power_2_scales, **kw)
    dim = {
        "input": recipe.x_block_scaling_dim,
        "weight": recipe.w_block_scaling_dim,
        "grad": recipe.grad_block_scaling_dim,
    }[role]
    return _q.quantize(
        tensor,
        "block",
        block_rows=128 if dim == 2 else 1,
        power_2_scale=not recipe.use_f32_scales,
        **kw,
    )


def dequantize(
    q: _q.Quantized, out_dtype: torch.dtype = torch.bfloat16, *, columnwise: bool = False
) -> Tensor:
    """The values of ``q`` (or of its transposed copy) in ``out_dtype``."""
    return _q.dequantize(q, out_dtype, columnwise=columnwise)
