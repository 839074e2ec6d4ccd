"""``Quantize(forward=True, backward=False)``: inside an enabled ``te_compile.autocast``, the
tensor as the recipe's quantiser leaves it; outside (or disabled), the identity.

The forward quantises and dequantises the input as the recipe quantises a GEMM input (role
``"input"``), the backward (with ``backward=True``) the gradient as it quantises a GEMM's
gradient (role ``"grad"``), through ``te::fake_quantize_fwd/_bwd``: per-tensor current scaling,
1x128 / 128x128 FP8 blocks, MXFP8, NVFP4. Quantised data crosses op boundaries only as plain
tensors here, so the op hands on the dequantised values rather than Transformer Engine's FP8
tensor: the numerics of a quantised activation, for studying or emulating low precision where
no GEMM follows (the FP8 GEMMs of ``BasicLinear`` quantise their own operands). Delayed scaling
needs an amax history and raises NotImplementedError.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile import functional as F
from te_compile.ops.op import BasicOperation, OpOutput
from te_compile.quantization.gemm import quantize_args
from te_compile.quantization.recipe import Recipe
from te_compile.quantization.state import get_autocast_state

__all__ = ["Quantize"]


def quantizer_args(recipe: Recipe, role: str) -> tuple[str, torch.dtype, int, bool]:
    """``(kind, fp8_dtype, block_rows, power_2_scale)`` of ``te::fake_quantize`` for ``recipe``'s
    quantiser of a GEMM operand in ``role`` ("input" or "grad"), with the recipe's settings as
    ``te_compile.quantize`` maps them."""
    if recipe.delayed():
        raise NotImplementedError(
            "Quantize: DelayedScaling needs an amax history, which Quantize does not keep; use "
            "Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling or NVFP4BlockScaling"
        )
    if recipe.nvfp4():
        # The recipe's options as the GEMMs take them: the Hadamard transform touches only the
        # columnwise copy (not made here); stochastic rounding and row scaling are not done here.
        _, kw = quantize_args(recipe, role)
        for name, fix in (("stochastic_rounding", "disable_stochastic_rounding=True"),
                          ("row_scaled", "row_scaled_activation=False")):  # fmt: skip
            if kw.get(name):
                raise NotImplementedError(
                    f"Quantize: NVFP4's {name} is applied inside the GEMMs only; use "
                    f"NVFP4BlockScaling({fix})"
                )
        return "nvfp4", torch.float8_e4m3fn, 1, False
    fmt = recipe.fp8_format
    fp8_dtype = fmt.bwd_dtype if role == "grad" else fmt.fwd_dtype
    if recipe.mxfp8():
        return "mxfp8", fp8_dtype, 1, False
    if recipe.float8_current_scaling():
        return "current", fp8_dtype, 1, recipe.use_power_2_scales
    dim = recipe.grad_block_scaling_dim if role == "grad" else recipe.x_block_scaling_dim
    return "block", fp8_dtype, 128 if dim == 2 else 1, not recipe.use_f32_scales


class Quantize(BasicOperation):
    """Quantise-dequantise the input (``forward``) and/or its gradient (``backward``) with the
    recipe of the enclosing ``te_compile.autocast``."""

    def __init__(self, forward: bool = True, backward: bool = False) -> None:
        super().__init__()
        for name, value in (("forward", forward), ("backward", backward)):
            if not isinstance(value, bool):
                raise ValueError(f"Quantize: {name} must be a bool, got {value!r}")
        self.quantize_forward, self.quantize_backward = forward, backward

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        state = get_autocast_state()
        if not state.enabled or not (self.quantize_forward or self.quantize_backward):
            return x, ()
        fwd = quantizer_args(state.recipe, "input") if self.quantize_forward else None
        bwd = quantizer_args(state.recipe, "grad") if self.quantize_backward else None
        kind, fp8_dtype, rows, power_2 = fwd or ("none", torch.float8_e4m3fn, 1, bwd[3])
        grad_kind, grad_dtype, grad_rows, _ = bwd or ("none", torch.float8_e5m2, 1, power_2)
        y = F.fake_quantize(
            x,
            kind,
            fp8_dtype=fp8_dtype,
            block_rows=rows,
            power_2_scale=power_2,
            grad_kind=grad_kind,
            grad_fp8_dtype=grad_dtype,
            grad_block_rows=grad_rows,
        )
        return y, ()

    def extra_repr(self) -> str:
        return f"forward={self.quantize_forward}, backward={self.quantize_backward}"
