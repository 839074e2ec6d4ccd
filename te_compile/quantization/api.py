"""``te_compile.quantize`` / ``te_compile.dequantize``: quantise a tensor the way a recipe would.

``quantize(tensor, recipe, role=...)`` maps a recipe and the tensor's role in a linear layer
(``"input"``, ``"weight"`` or ``"grad"``) to the quantisation op and its settings, exactly as the
modules do (delayed scaling needs ``scale=``, the scale the amax history gives). The result is a
:class:`~te_compile.functional.quantize_table.Quantized` of plain tensors (data and scales;
``columnwise=True`` adds the transposed copy a backward GEMM needs); ``dequantize`` inverts it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._checks import check_choice, check_dtype, check_tensor
from te_compile.functional import quantize_table as _q
from te_compile.quantization.gemm import ROLES, recipe_specs
from te_compile.quantization.recipe import Recipe

__all__ = ["ROLES", "dequantize", "quantize"]


def quantize(
    tensor: Tensor,
    recipe: Recipe,
    *,
    role: str = "input",
    scale: Tensor | None = None,
    columnwise: bool = False,
) -> _q.Quantized:
    """``tensor`` quantised as ``recipe`` quantises a linear layer's ``role`` operand
    (``quantization.gemm.recipe_specs``). NVFP4: weights in 16x16 tiles unless
    ``disable_2d_quantization``; the random Hadamard transform (of the columnwise copy),
    stochastic rounding (gradients) and row-scaled activations are applied by the GEMMs only,
    and raise NotImplementedError here where they would change the result."""
    if not isinstance(recipe, Recipe):
        raise ValueError(f"te.quantize: recipe must be a te_compile.recipe recipe, got {recipe!r}")
    check_tensor("te.quantize", "tensor", tensor)
    if scale is not None:
        check_tensor("te.quantize", "scale", scale, min_dim=0)
    check_choice("te.quantize", "role", role, ROLES)
    spec = recipe_specs(recipe)[ROLES.index(role)]
    unsupported = {
        "rht": ("disable_rht=True", spec.rht and columnwise),
        "stochastic_rounding": ("disable_stochastic_rounding=True", spec.stochastic_rounding),
        "row_scaled": ("row_scaled_activation=False", spec.row_scaled),
    }
    for name, (fix, on) in unsupported.items():
        if on:
            raise NotImplementedError(
                f"te.quantize: NVFP4's {name} (role={role!r}) is applied inside the GEMMs only, "
                f"not by te.quantize; use NVFP4BlockScaling({fix})"
                + (" or columnwise=False" if name == "rht" else "")
            )
    return _q.quantize(tensor, spec.kind, fp8_dtype=spec.fp8_dtype, scale=scale,
                       block_rows=spec.block_rows, power_2_scale=spec.power_2_scale,
                       columnwise=columnwise, four_over_six=spec.four_over_six)  # fmt: skip


def dequantize(
    q: _q.Quantized, out_dtype: torch.dtype = torch.bfloat16, *, columnwise: bool = False
) -> Tensor:
    """The values of ``q`` (or of its transposed copy) in ``out_dtype``."""
    if not isinstance(q, _q.Quantized):
        raise TypeError(f"te.dequantize: q must be a Quantized (from te.quantize), got {q!r}")
    check_dtype("te.dequantize", "out_dtype", out_dtype)
    return _q.dequantize(q, out_dtype, columnwise=columnwise)
