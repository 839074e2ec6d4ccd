r"""A residual's add in a GEMM's epilogue, forward and backward: ``te::linear_add_fwd/_bwd``
and ``te::branch_linear_fwd/_bwd``, the other fused linear ops ``te_compile.ops.Sequential``
emits (``fused_linear`` has linear + bias + activation). ``inp`` is ``[..., K]``, ``weight``
``[N, K]``, the bias ``[N]``.

**Linear + bias / scale + residual add** (``BasicLinear, [Bias], [ConstantScale],
AddExtraInput``)::

    te::linear_add_fwd(inp, weight, bias?, residual, main_grad?, alpha) -> out

.. math::
    y = r + \alpha\,(x W^\top + b)

CUDA: one cuBLAS GEMM whose epilogue adds the residual (``addmm`` with beta 1), the bias added
in place (the GEMM epilogue cannot take both); CPU: fp32 math, rounded once. The backward
scales the gradient by :math:`\alpha` (skipped when 1) and runs ``te::linear_bwd``'s
implementation; the residual's gradient is the incoming gradient itself (no op, no copy).

**Branch + linear** (``MakeExtraOutput, BasicLinear, [Bias]``)::

    te::branch_linear_fwd(inp, weight, bias?, main_grad?) -> (out, branch)

The forward is the linear plus ``branch``, a copy of ``inp`` (an op's output may not alias its
input): the extra output a residual connection reads. The backward adds the branch's gradient
to the dgrad GEMM in its epilogue: :math:`dX = dB + dY\,W` (``addmm`` with beta 1 on CUDA; fp32
math rounded once on the CPU) instead of a GEMM and a separate sum. The copy costs one write of
``inp`` in the forward; the backward saves a read-read-write pass over ``dX``.

``main_grad`` (fp32, ``weight``'s shape) receives ``+= dW`` instead of a ``dweight`` output, as in
``te::linear_bwd``. A gradient that is not computed is a 0-element tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op
from te_compile.functional.fused_linear import (
    _acc,
    _empty,
    _linear_bwd_acc,
    _linear_grads_fake,
    _tensor,
)
from te_compile.functional.linear import _check_args as _check_linear
from te_compile.functional.linear import linear_bwd, linear_fwd, linear_ref

__all__ = ["branch_linear", "branch_linear_ref", "linear_add", "linear_add_ref"]


# 1. Reference math ----------------------------------------------------------------------------


def linear_add_ref(
    inp: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, alpha: float = 1.0
) -> Tensor:
    """``residual + alpha * (inp @ weight.T + bias)``, fp32 (fp64 stays fp64), rounded once."""
    acc = _acc(inp)
    b = None if bias is None else bias.to(acc)
    y = torch.nn.functional.linear(inp.to(acc), weight.to(acc), b)
    return (residual.to(acc) + alpha * y).to(inp.dtype)


def branch_linear_ref(
    inp: Tensor, weight: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(inp @ weight.T + bias, inp)``: the linear and the branch (the input itself)."""
    return linear_ref(inp, weight, bias), inp


def _check_residual(inp: Tensor, weight: Tensor, residual: Tensor) -> None:
    shape = (*inp.shape[:-1], weight.shape[0])
    if residual.shape != shape or residual.dtype != inp.dtype:
        raise ValueError(
            f"te.linear_add: residual must have the output's shape {list(shape)} and inp's dtype "
            f"{inp.dtype}, got {list(residual.shape)} {residual.dtype}"
        )


# 2. Forward ops -------------------------------------------------------------------------------


@op("linear_add_fwd")
def linear_add_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    residual: Tensor,
    main_grad: Tensor | None,
    alpha: float,
) -> Tensor:
    """``residual + alpha * (inp @ weight.T + bias)``. Default (CPU) implementation: the
    reference math, one rounding."""
    _check_linear(inp, weight, bias, main_grad)
    _check_residual(inp, weight, residual)
    return linear_add_ref(inp, weight, bias, residual, alpha)


@linear_add_fwd.register_kernel("cuda")
def _linear_add_fwd_cuda(inp, weight, bias, residual, main_grad, alpha):
    _check_linear(inp, weight, bias, main_grad)
    _check_residual(inp, weight, residual)
    n = weight.shape[0]
    # One GEMM with the residual in its epilogue (beta = 1); the bias in place after it.
    out = torch.addmm(
        residual.reshape(-1, n), inp.reshape(-1, inp.shape[-1]), weight.t(), alpha=alpha
    )
    if bias is not None:
        out.add_(bias, alpha=alpha)
    return out.reshape(residual.shape)


@op("branch_linear_fwd")
def branch_linear_fwd(
    inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, branch)``: ``te::linear_fwd``'s implementation and a copy of ``inp``."""
    _check_linear(inp, weight, bias, main_grad)
    out, _ = linear_fwd.eager(inp, weight, bias, main_grad)
    return out, inp.clone(memory_format=torch.contiguous_format)


# 3. Fakes -------------------------------------------------------------------------------------


@linear_add_fwd.register_fake
def _linear_add_fwd_fake(inp, weight, bias, residual, main_grad, alpha):
    _check_linear(inp, weight, bias, main_grad)
    _check_residual(inp, weight, residual)
    return inp.new_empty(residual.shape)


@branch_linear_fwd.register_fake
def _branch_linear_fwd_fake(inp, weight, bias, main_grad):
    _check_linear(inp, weight, bias, main_grad)
    return inp.new_empty((*inp.shape[:-1], weight.shape[0])), inp.new_empty(inp.shape)


# 4. Backward ops ------------------------------------------------------------------------------


@op("linear_add_bwd", mutates_args=("main_grad",))
def linear_add_bwd(
    grad: Tensor,
    inp: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    alpha: float,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)`` of ``alpha * linear`` (the residual's gradient is ``grad``
    itself, returned by the autograd formula without an op). Default (CPU) implementation:
    ``te::linear_bwd``'s math on ``alpha * grad`` in fp32 (fp64 stays fp64), rounded once."""
    dy = grad.to(_acc(grad)) * alpha
    return _linear_bwd_acc(dy, inp, weight, main_grad, has_bias, need_dgrad, need_wgrad)


@linear_add_bwd.register_kernel("cuda")
def _linear_add_bwd_cuda(grad, inp, weight, main_grad, alpha, has_bias, need_dgrad, need_wgrad):
    # One pass to scale the gradient (none when alpha is 1), then te::linear_bwd's cuBLAS GEMMs.
    g = grad if alpha == 1.0 else grad * alpha
    return linear_bwd.eager(g, inp, weight, main_grad, has_bias, need_dgrad, need_wgrad)


def _branch_dgrad(grad: Tensor, grad_branch: Tensor, weight: Tensor, acc) -> Tensor:
    """``grad_branch + grad @ weight`` as one GEMM with beta 1, in ``acc`` (None: the dtype)."""
    g2 = grad.reshape(-1, grad.shape[-1])
    b2 = grad_branch.reshape(-1, weight.shape[1])
    if acc is None:
        return torch.addmm(b2, g2, weight).reshape(grad_branch.shape)
    out = torch.addmm(b2.to(acc), g2.to(acc), weight.to(acc))
    return out.to(grad.dtype).reshape(grad_branch.shape)


def _branch_linear_bwd(grad, grad_branch, inp, weight, main_grad, has_bias, need_dgrad, wgrad, acc):
    _, dweight, dbias = linear_bwd.eager(grad, inp, weight, main_grad, has_bias, False, wgrad)
    dinp = _branch_dgrad(grad, grad_branch, weight, acc) if need_dgrad else _empty(grad)
    return dinp, dweight, dbias


@op("branch_linear_bwd", mutates_args=("main_grad",))
def branch_linear_bwd(
    grad: Tensor,
    grad_branch: Tensor,
    inp: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)`` with ``dinp = grad_branch + grad @ weight`` in one GEMM.
    Default (CPU) implementation: fp32 (fp64 stays fp64) math, rounded once."""
    config = (main_grad, has_bias, need_dgrad, need_wgrad, _acc(grad))
    return _branch_linear_bwd(grad, grad_branch, inp, weight, *config)


@branch_linear_bwd.register_kernel("cuda")
def _branch_linear_bwd_cuda(grad, grad_branch, inp, weight, main_grad, has_bias, dgrad, wgrad):
    # cuBLAS in the input dtype with fp32 accumulation; beta = 1 reads the branch gradient.
    config = (main_grad, has_bias, dgrad, wgrad, None)
    return _branch_linear_bwd(grad, grad_branch, inp, weight, *config)


@linear_add_bwd.register_fake
def _linear_add_bwd_fake(grad, inp, weight, main_grad, alpha, has_bias, need_dgrad, need_wgrad):
    return _linear_grads_fake(grad, inp, weight, main_grad, has_bias, need_dgrad, need_wgrad)


@branch_linear_bwd.register_fake
def _branch_linear_bwd_fake(grad, grad_branch, inp, weight, main_grad, has_bias, dgrad, wgrad):
    return _linear_grads_fake(grad, inp, weight, main_grad, has_bias, dgrad, wgrad)


# 5. setup_context + autograd ------------------------------------------------------------------


def _linear_add_setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, _residual, main_grad, alpha = inputs
    ctx.save_for_backward(inp, weight, main_grad)
    ctx.has_bias, ctx.alpha = bias is not None, alpha


def _linear_add_backward(ctx, bwd, grad):
    inp, weight, main_grad = ctx.saved_tensors
    need_dgrad, need_wgrad, need_dbias, need_dresidual = ctx.needs_input_grad[:4]
    has_bias = ctx.has_bias and need_dbias
    dinp, dweight, dbias = bwd(
        grad.contiguous(), inp, weight, main_grad, ctx.alpha, has_bias, need_dgrad, need_wgrad
    )
    return (
        dinp if need_dgrad else None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if has_bias else None,
        grad if need_dresidual else None,
        None,
        None,
    )


def _branch_linear_setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, main_grad = inputs
    ctx.save_for_backward(inp, weight, main_grad)
    ctx.has_bias = bias is not None


def _branch_linear_backward(ctx, bwd, grad, grad_branch):
    inp, weight, main_grad = ctx.saved_tensors
    need_dgrad, need_wgrad, need_dbias = ctx.needs_input_grad[:3]
    has_bias = ctx.has_bias and need_dbias
    if grad_branch is None:  # the branch output was not used
        grad_branch = torch.zeros_like(inp)
    dinp, dweight, dbias = bwd(
        grad.contiguous(),
        grad_branch.contiguous(),
        inp,
        weight,
        main_grad,
        has_bias,
        need_dgrad,
        need_wgrad,
    )
    return (
        dinp if need_dgrad else None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if has_bias else None,
        None,
    )


def _linear_add_samples(device: torch.device):
    t, bf16 = _tensor(device), torch.bfloat16
    yield SampleInput((t(5, 16), t(24, 16), t(24), t(5, 24), None, 1.0))
    yield SampleInput((t(2, 3, 16, dtype=bf16), t(8, 16, dtype=bf16), None, t(2, 3, 8, dtype=bf16))
                      + (None, 0.5))  # fmt: skip
    yield SampleInput(
        (t(7, 32, dtype=bf16), t(16, 32, dtype=bf16), t(16, dtype=bf16), t(7, 16, dtype=bf16))
        + (None, -2.0)
    )
    yield SampleInput(
        (t(6, 16, grad=False), t(8, 16), t(8), t(6, 8), torch.zeros(8, 16, device=device), 1.0)
    )


def _branch_linear_samples(device: torch.device):
    t, bf16, fp16 = _tensor(device), torch.bfloat16, torch.float16
    yield SampleInput((t(5, 16), t(24, 16), t(24), None))
    yield SampleInput((t(2, 3, 16, dtype=bf16), t(8, 16, dtype=bf16), None, None))
    yield SampleInput((t(4, 8, dtype=fp16), t(12, 8, dtype=fp16), t(12, dtype=fp16), None))
    yield SampleInput((t(6, 16), t(8, 16), t(8), torch.zeros(8, 16, device=device)))


_linear_add = differentiable(
    linear_add_fwd,
    linear_add_bwd,
    setup_context=_linear_add_setup_context,
    backward=_linear_add_backward,
    sample_inputs=_linear_add_samples,
    reference=lambda inp, weight, bias, residual, main_grad, alpha: linear_add_ref(
        inp, weight, bias, residual, alpha
    ),
)
_branch_linear = differentiable(
    branch_linear_fwd,
    branch_linear_bwd,
    setup_context=_branch_linear_setup_context,
    backward=_branch_linear_backward,
    sample_inputs=_branch_linear_samples,
    reference=lambda inp, weight, bias, main_grad: branch_linear_ref(inp, weight, bias),
)


# Public functions -----------------------------------------------------------------------------


def linear_add(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    residual: Tensor,
    alpha: float = 1.0,
    *,
    main_grad: Tensor | None = None,
) -> Tensor:
    """``residual + alpha * (inp @ weight.T + bias)`` through ``te::linear_add_fwd``."""
    return _linear_add(inp, weight, bias, residual, main_grad, float(alpha))


def branch_linear(
    inp: Tensor, weight: Tensor, bias: Tensor | None = None, *, main_grad: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(inp @ weight.T + bias, branch)`` through ``te::branch_linear_fwd``: ``branch`` holds
    ``inp``'s values, and its gradient joins the dgrad GEMM in the backward."""
    return _branch_linear(inp, weight, bias, main_grad)
