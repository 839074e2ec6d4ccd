"""The definition of every kind's GEMM, :func:`quantized_linear_ref`, on the operands of
``functional.gemm``'s reference quantisers, differentiable, the gradient quantised on its way
back as the backward GEMMs see it. The family ops' references are built on it."""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile.functional.gemm import PER_TENSOR, qdq_both, quantize_per_tensor, scale_slots
from te_compile.functional.spec import QuantSpec, as_specs

__all__ = ["quantized_linear_ref"]


def _fake_quant(x: Tensor, spec: QuantSpec, scale: Tensor | None) -> Tensor:
    """``dequantize(quantize(x))`` by ``spec`` along the rows (``scale``: a delayed scale) in
    ``x``'s dtype, the identity's gradient (straight through)."""
    if spec.kind in PER_TENSOR:
        q, s_inv, _ = quantize_per_tensor(x, spec.fp8_dtype, scale)
        values = q.float() * s_inv
    else:
        values = qdq_both(x, spec)[0]
    return x + (values.to(x.dtype) - x).detach()


class _FakeQuantGrad(torch.autograd.Function):
    """Identity forward; the backward quantises the incoming gradient per tensor (current
    scaling, or the given scale), as the backward GEMMs of the FP8 op see it."""

    @staticmethod
    def forward(ctx, y, fp8_dtype, scale):
        ctx.fp8_dtype, ctx.scale = fp8_dtype, scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        g = grad.reshape(-1, grad.shape[-1])
        q, s_inv, _ = quantize_per_tensor(g, ctx.fp8_dtype, ctx.scale)
        return (q.float() * s_inv).to(grad.dtype).reshape(grad.shape), None, None


class _BlockReference(torch.autograd.Function):
    """A block-scaled GEMM written out in the input's dtype (fp64 in the tests): autograd alone
    cannot express it, since each backward GEMM quantises its operands along a different dim
    than the forward did (``Q_K`` forward, ``Q_N`` for dgrad, ``Q_M`` for wgrad)."""

    @staticmethod
    def forward(ctx, x, weight, specs, rng_state):
        x_row, x_col_t = qdq_both(x, specs[0])
        w_row, w_col_t = qdq_both(weight, specs[1])
        ctx.save_for_backward(x_col_t, w_col_t, rng_state if specs[2].stochastic_rounding else None)
        ctx.grad_spec = specs[2]
        return x_row @ w_row.t()

    @staticmethod
    def backward(ctx, grad):
        x_col_t, w_col_t, rng_state = ctx.saved_tensors
        g_row, g_col_t = qdq_both(grad, ctx.grad_spec, rng_state)
        return g_row @ w_col_t.t(), g_col_t @ x_col_t.t(), None, None


def quantized_linear_ref(
    inp: Tensor,
    weight: Tensor,
    input_spec: str | QuantSpec = "",
    weight_spec: str | QuantSpec = "",
    grad_spec: str | QuantSpec = "",
    scale: Tensor | None = None,
    backward_override: str = "",
    rng_state: Tensor | None = None,
) -> Tensor:
    """Definition of correctness of the GEMM of a recipe, differentiable: ``inp @ weight.T`` of
    the quantised-dequantised operands in the input's dtype (fp64 in the tests), the incoming
    gradient quantised on its way back as the backward GEMMs see it; the specs are those of the
    family ops (``functional.spec.QuantSpec``). ``inp`` ``[..., K]``; ``scale`` ``[3]`` for
    ``"delayed"``. ``backward_override`` (:data:`BACKWARD_OVERRIDES`): ``"high_precision"``,
    the quantised forward's value with the gradients of ``inp @ weight.T``; ``"dequantized"``,
    the gradients of the product of the forward's dequantised operands (straight through the
    quantisation), the gradient not quantised. ``rng_state``: the stochastic rounding stream
    of a gradient spec with ``sr`` (the op's)."""
    x = inp.reshape(-1, inp.shape[-1])
    specs = xs, ws, gs = as_specs(input_spec, weight_spec, grad_spec)
    recipe = xs.kind
    if recipe and backward_override == "high_precision":
        quantized = quantized_linear_ref(x, weight, *specs, scale).detach()
        high = x @ weight.t()
        out = high + (quantized - high).detach()
    elif not recipe:
        out = x @ weight.t()
    elif backward_override == "dequantized" or recipe in PER_TENSOR:
        s_x, s_w, s_g = scale_slots(scale, recipe, 0, 1, 2)
        out = _fake_quant(x, xs, s_x) @ _fake_quant(weight, ws, s_w).t()
        if not backward_override:  # the gradient quantised per tensor on its way back
            out = _FakeQuantGrad.apply(out, gs.fp8_dtype, s_g)
    else:
        out = _BlockReference.apply(x, weight, specs, rng_state)
    return out.reshape(*inp.shape[:-1], weight.shape[0])
