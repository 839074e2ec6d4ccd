"""``Quantize(forward=True, backward=False)``: inside an enabled ``te_compile.autocast``, the
tensor as the recipe's quantiser leaves it; outside (or disabled), the identity.

The forward quantises and dequantises the input as the recipe quantises a GEMM input (role
``"input"``), the backward (with ``backward=True``) the gradient as it quantises a GEMM's
gradient (role ``"grad"``), through ``te::fake_quantize_fwd/_bwd``: per-tensor current scaling,
1x128 / 128x128 FP8 blocks, MXFP8, NVFP4 (with the input's 4over6 block scaling). Quantised
data crosses op boundaries only as plain tensors here, so the op hands on the dequantised
values rather than Transformer Engine's FP8 tensor: the numerics of a quantised activation,
for studying or emulating low precision where no GEMM follows (the FP8 GEMMs of
``BasicLinear`` quantise their own operands).

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

from dataclasses import replace

import torch
from torch import Tensor

from te_compile import functional as F
from te_compile._checks import default_device
from te_compile._numerics import reciprocal_rn
from te_compile.ops.op import BasicOperation, OpOutput
from te_compile.quantization import fp8_gemm
from te_compile.quantization.gemm import recipe_specs
from te_compile.quantization.state import AutocastState, get_autocast_state

__all__ = ["Quantize"]


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
        # Its delayed-scaling state where the modules' parameters go by default (TE: CUDA).
        self.fp8_meta = fp8_gemm.FP8GemmState(default_device("Quantize", None))

    def _delayed(self, x: Tensor, state: AutocastState) -> Tensor:
        meta = self.fp8_meta
        scales = meta.delayed_scale("Quantize", state)  # None at the calibration step
        spec_x, _, spec_g = recipe_specs(state.recipe)
        fwd, bwd = spec_x.fp8_dtype, spec_g.fp8_dtype
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
        sx, _, sg = recipe_specs(state.recipe)
        fwd, bwd = self.quantize_forward, self.quantize_backward
        # NVFP4's options as the GEMMs take them: the Hadamard transform touches only the
        # columnwise copy (not made here); 4over6 block scaling of the input is applied (as
        # TE's input quantiser does; never to the gradient); stochastic rounding and row
        # scaling are not done here.
        for name, on, fix in (
            (
                "stochastic_rounding",
                bwd and sg.stochastic_rounding,
                "disable_stochastic_rounding=True",
            ),
            ("row_scaled", fwd and sx.row_scaled, "row_scaled_activation=False"),
        ):
            if on:
                raise NotImplementedError(
                    f"Quantize: NVFP4's {name} is applied inside the GEMMs only; use "
                    f"NVFP4BlockScaling({fix})"
                )
        plain = {"rht": False, "emulate": False}
        spec = replace(sx, **plain).encode() if fwd else ""
        grad_spec = replace(sg, **plain).encode() if bwd else ""
        return F.fake_quantize(x, spec, grad_spec=grad_spec), ()

    def extra_repr(self) -> str:
        return f"forward={self.quantize_forward}, backward={self.quantize_backward}"
