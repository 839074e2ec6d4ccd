r"""The grouped linear family's pre-quantised weight: ``te::quantize_grouped_weight``.

The dense families' design (``functional.dense_weight``; ``docs/fp8.md``, ``is_first_microbatch``)
for the ``[G, N, K]`` weight of ``te::grouped_linear_fwd``: the same five tensors (``weight_q``),
cast by :func:`quantize_grouped_weight` with the functions the forward casts with (the same
bytes); the op saves the weight's dgrad copy for the backward from its inputs.

The five tensors by the GEMM kind of the recipe (``grouped_gemm.grouped_gemm_kind``):

=======================  ======================================================================
kind                     ``weight_data``, ``weight_scale``, ``weight_data_t``,
                         ``weight_scale_t``, ``weight_amax``
=======================  ======================================================================
``"scaled_grouped_mm"``  uint8 codes ``[G, N, K]``, fp32 inverse scales ``[G, N]`` (current:
                         one per output row; delayed: the per-tensor one broadcast), codes
                         ``[G, K, N]`` of the dgrad copy (current: quantised along ``N``),
                         its scales ``[G, K]``, ``amax(W)`` ``[1]`` measured at the cast
``"blockwise"``          uint8 codes ``[G, N, K]``, fp32 block scales ``[G, N / rows, K / 128]``
                         (``rows``: the weight spec's block rows, rounded up), codes ``[G, K, N]``,
                         scales ``[G, K / rows, N / 128]``, a 0-element amax
``"dequantized"``        the exact dequantised values ``[G, N, K]`` in the weight's dtype (the
                         emulated block-scaled recipes; NVFP4 per expert, ``nvfp4_dtype``),
                         then four 0-element fp32 tensors; or, third, the dgrad copy (``W``
                         quantised along ``N``, dequantised, ``[G, N, K]`` in the weight's
                         dtype), which the backward then reads instead of casting ``weight``
                         (FP8 primary weights, which have no high-precision ``weight``)
=======================  ======================================================================

Current and delayed scaling take each other's weight (both kinds' GEMMs read a scale per row):
a copy cast under one serves the other, as in the dense family.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import op
from te_compile.functional.dense_weight import (
    check_weight_operand,
    check_weight_quantized,
    check_weight_spec,
    checked_weight_cast,
)
from te_compile.functional.gemm import fp8_bytes
from te_compile.functional.grouped_fp8 import per_tensor_weight
from te_compile.functional.grouped_gemm import (
    GroupedRecipe,
    blockwise_weight,
    dequantized_weight,
    grouped_gemm_kind,
    nvfp4_dtype,
)
from te_compile.functional.spec import QuantSpec

__all__ = ["check_grouped_weight_operand", "quantize_grouped_weight"]


def _shapes(recipe: str, weight: Tensor, block_rows: int, emulate: bool):
    """``[(shape, dtype)]`` of the five tensors of ``weight`` ``[G, N, K]`` pre-quantised."""
    g, n, k = weight.shape
    f32, u8 = torch.float32, torch.uint8
    kind = grouped_gemm_kind(recipe, emulate)
    if kind == "scaled_grouped_mm":
        return [((g, n, k), u8), ((g, n), f32), ((g, k, n), u8), ((g, k), f32), ((1,), f32)]
    if kind == "blockwise":
        s, s_t = (g, -(-n // block_rows), -(-k // 128)), (g, -(-k // block_rows), -(-n // 128))
        return [((g, n, k), u8), (s, f32), ((g, k, n), u8), (s_t, f32), ((0,), f32)]
    dtype = nvfp4_dtype(weight) if recipe == "nvfp4" else weight.dtype
    return [((g, n, k), dtype)] + [((0,), f32)] * 4


def check_grouped_weight_operand(
    p: str, recipe: str, weight: Tensor, block_rows: int, emulate: bool, tensors
) -> None:
    """The pre-quantised weight ``tensors`` (None, or five) of ``te::grouped_linear_fwd`` whose
    weight is ``weight`` ``[G, N, K]`` (``p`` begins the messages)."""
    check_weight_quantized(p[: -len(": ")], "weight_q", tensors)
    shapes = _shapes(recipe, weight, block_rows, emulate) if recipe else None
    if shapes and shapes[2][0] == (0,) and tensors is not None and tensors[2].numel():
        shapes[2] = shapes[0]  # "dequantized" with the dgrad copy given (module docstring)
    check_weight_operand(p, recipe, weight, block_rows, emulate, tensors, shapes)


def _check(weight: Tensor, spec: str, scale: Tensor | None) -> QuantSpec:
    layout = " [num_gemms, out_features, in_features]"
    return check_weight_spec("te.quantize_grouped_weight: ", spec, scale, weight, 3, layout)


@op("quantize_grouped_weight")
def quantize_grouped_weight_op(weight: Tensor, spec: str, scale: Tensor | None) -> list[Tensor]:
    """``te::quantize_grouped_weight``: :func:`quantize_grouped_weight` without the argument
    checks."""
    w = _check(weight, spec, scale)
    kind = grouped_gemm_kind(w.kind, w.emulate)
    none = weight.new_empty(0, dtype=torch.float32)
    if kind == "scaled_grouped_mm":
        w_scale = scale[1:2] if w.kind == "delayed" else None
        return [fp8_bytes(t) for t in per_tensor_weight(weight, w.fp8_dtype, w_scale, True)]
    if kind == "blockwise":
        return [*blockwise_weight(weight, w.power_2_scale, w.block_rows), none]
    w_q = dequantized_weight(weight, GroupedRecipe(w, w, w))  # (the weight's spec for each role)
    return [w_q, none, none.clone(), none.clone(), none.clone()]


@quantize_grouped_weight_op.register_fake
def _fake(weight, spec, scale):
    w = _check(weight, spec, scale)
    return [weight.new_empty(shape, dtype=dtype)
            for shape, dtype in _shapes(w.kind, weight, w.block_rows, w.emulate)]  # fmt: skip


def quantize_grouped_weight(
    weight: Tensor, spec: str | QuantSpec, scale: Tensor | None = None
) -> list[Tensor]:
    """``weight`` ``[num_gemms, N, K]`` as ``te.functional.grouped_linear``'s pre-quantised
    weight operand (``weight_quantized``; module docstring), quantised as the grouped op would
    quantise it inside; outputs and arguments as ``dense_weight.quantize_weight``'s.
    ``te::quantize_grouped_weight`` after the checks of its arguments."""
    args = checked_weight_cast("te.quantize_grouped_weight", weight, spec, scale)
    return quantize_grouped_weight_op(*args)
