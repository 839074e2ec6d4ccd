"""``Quantize(forward=True, backward=False)``: inside an enabled ``te_compile.autocast``, the
tensor as the recipe's quantiser leaves it; outside (or disabled), the identity.

The forward quantises and dequantises the input as the recipe quantises a GEMM input (role
``"input"``), the backward (with ``backward=True``) the gradient as it quantises a GEMM's
gradient (role ``"grad"``), through ``te::fake_quantize_fwd/_bwd``: per-tensor current scaling,
1x128 / 128x128 FP8 blocks, MXFP8, NVFP4. Quantised data crosses op boundaries only as plain
tensors here, so the op hands on the dequantised values rather than Transformer Engine's FP8
tensor: the numerics of a quantised activation, for studying or emulating low precision where
no GEMM follows (the FP8 GEMMs of ``BasicLinear`` quantise their own operands).

Under ``DelayedScaling`` the op keeps its own scaling state, as a module's GEMM does: the
``fp8_meta`` child (:class:`te_compile.quantization.fp8_gemm.FP8GemmState`: amax history,
scales, last amaxes, in buffers; slot 0 the input, slot 2 the gradient). Each forward folds the
last amaxes into the history and takes the scales from it (the recipe's ``margin``,
``amax_compute_algo``, ``amax_history_len``); the input is cast with the input scale through
``te::quantize_tensorwise`` (one read, which also measures the amax recorded for the next step)
and dequantised, and the backward casts the gradient with the gradient scale and records its
amax. The first step (no history yet) runs current scaling and records the amaxes, as the
GEMMs' first delayed step does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile import functional as F
from te_compile._numerics import reciprocal_rn
from te_compile.ops.op import BasicOperation, OpOutput
from te_compile.quantization import fp8_gemm
from te_compile.quantization.gemm import quantize_args
from te_compile.quantization.recipe import Recipe
from te_compile.quantization.state import AutocastState, get_autocast_state

__all__ = ["Quantize"]


def quantizer_args(recipe: Recipe, role: str) -> tuple[str, torch.dtype, int, bool]:
    """``(kind, fp8_dtype, block_rows, power_2_scale)`` of ``te::fake_quantize`` for ``recipe``'s
    quantiser of a GEMM operand in ``role`` ("input" or "grad"), with the recipe's settings as
    ``te_compile.quantize`` maps them."""
    if recipe.delayed():
        raise ValueError("quantizer_args: DelayedScaling runs through Quantize's fp8_meta")
    if recipe.nvfp4():
        # The recipe's options as the GEMMs take them: the Hadamard transform touches only the
        # columnwise copy (not made here); stochastic rounding, row scaling and 4over6 block
        # scaling are not done here.
        _, kw = quantize_args(recipe, role)
        for name, fix in (("stochastic_rounding", "disable_stochastic_rounding=True"),
                          ("row_scaled", "row_scaled_activation=False"),
                          ("four_over_six", "nvfp4_4over6='none' or 'weights'")):  # fmt: skip
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


def _qdq_tensorwise(
    x: Tensor, scale: Tensor | None, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(dequantize(quantize(x)), amax(x))`` per tensor: with ``scale`` (``[1]``, delayed) or
    from ``x``'s own amax (``scale`` None: the calibration step)."""
    if scale is None:
        data, _, scale_inv, amax = torch.ops.te.quantize_current(x, fp8_dtype, False)
    else:
        data, _, amax = torch.ops.te.quantize_tensorwise(x, scale, fp8_dtype, False)
        scale_inv = reciprocal_rn(scale)
    y = torch.ops.te.dequantize_tensorwise(data.view(torch.uint8), scale_inv, fp8_dtype, x.dtype)
    return y, amax


class _DelayedQDQ(torch.autograd.Function):
    """Delayed-scaling quantise-dequantise of the input (``fwd``) and of its gradient (``bwd``);
    returns ``(y, amax(x))``; the backward writes the gradient's amax into ``grad_amax``."""

    @staticmethod
    def forward(ctx, x, scales, fwd_dtype, bwd_dtype, grad_amax, fwd, bwd):
        ctx.bwd, ctx.bwd_dtype = bwd, bwd_dtype
        ctx.save_for_backward(scales, grad_amax)
        if fwd:
            y, amax = _qdq_tensorwise(x, None if scales is None else scales[0:1], fwd_dtype)
        else:
            y, amax = x.clone(), x.new_zeros(1, dtype=torch.float32)
        ctx.mark_non_differentiable(amax)
        return y, amax

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, _damax):
        if not ctx.bwd:
            return dy, None, None, None, None, None, None
        scales, grad_amax = ctx.saved_tensors
        dx, amax = _qdq_tensorwise(dy, None if scales is None else scales[2:3], ctx.bwd_dtype)
        grad_amax.copy_(amax)
        return dx, None, None, None, None, None, None


class Quantize(BasicOperation):
    """Quantise-dequantise the input (``forward``) and/or its gradient (``backward``) with the
    recipe of the enclosing ``te_compile.autocast``; ``fp8_meta``: the delayed-scaling state
    (left out of the state_dict until used)."""

    def __init__(self, forward: bool = True, backward: bool = False) -> None:
        super().__init__()
        for name, value in (("forward", forward), ("backward", backward)):
            if not isinstance(value, bool):
                raise ValueError(f"Quantize: {name} must be a bool, got {value!r}")
        self.quantize_forward, self.quantize_backward = forward, backward
        self.fp8_meta = fp8_gemm.FP8GemmState()

    def _delayed(self, x: Tensor, state: AutocastState) -> Tensor:
        meta = self.fp8_meta
        scales = meta.delayed_scale("Quantize", state)  # None at the calibration step
        fwd = quantize_args(state.recipe, "input")[1]["fp8_dtype"]
        bwd = quantize_args(state.recipe, "grad")[1]["fp8_dtype"]
        y, amax = _DelayedQDQ.apply(
            x, scales, fwd, bwd, meta.grad_amax, self.quantize_forward, self.quantize_backward
        )
        meta.record(torch.cat([amax.float(), amax.new_zeros(1, dtype=torch.float32)]), state)
        return y

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        state = get_autocast_state()
        if not state.enabled or not (self.quantize_forward or self.quantize_backward):
            return x, ()
        if state.recipe.delayed():
            return self._delayed(x, state), ()
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
