r"""Branch + RMSNorm fused: ``te::branch_rmsnorm_fwd`` / ``te::branch_rmsnorm_bwd``.

The pre-norm residual pattern of a transformer block, ``MakeExtraOutput, RMSNorm`` in
``te_compile.ops``: the block input :math:`x` leaves as the residual branch and is normalised.

.. math::
    y = x\,r\,\gamma, \quad r = \big(\tfrac1N \textstyle\sum_j x_j^2 + \varepsilon\big)^{-1/2},
    \qquad dx = dB + \mathrm{RMSNorm}'(x)^\top dy

The forward returns ``(out, branch, rsigma)``: ``te::rmsnorm_fwd``'s implementation for the
device, ``branch`` a copy of ``inp`` (an op's output may not alias its input) and the fp32
statistics. The backward adds the branch's gradient :math:`dB` to the norm's input gradient
before the single rounding (CUDA: inside the Triton norm backward, which reads :math:`dB`
where it writes :math:`dx`; CPU: fp32 math, as ``te::rmsnorm_bwd``), where unfused the norm
backward rounds :math:`dx` and autograd adds the branch gradient in a second pass (a launch,
a write and a read of :math:`dx` and a second rounding more).

Argument conventions (dtypes, ``zero_centered_gamma``, ``eps``) are those of
``te_compile.functional.norm``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.functional.norm import (
    check_norm_args,
    check_public_args,
    rmsnorm_bwd_ref,
    rmsnorm_fwd,
    rmsnorm_ref,
)
from te_compile.kernels import runs_triton

__all__ = ["branch_rmsnorm", "branch_rmsnorm_ref"]


# 1. Reference math ----------------------------------------------------------------------------


def branch_rmsnorm_ref(
    inp: Tensor, weight: Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False
) -> tuple[Tensor, Tensor]:
    """``(rmsnorm(inp), inp)``."""
    return rmsnorm_ref(inp, weight, eps, zero_centered_gamma)[0], inp


def _check_branch(inp: Tensor, grad_branch: Tensor) -> None:
    if grad_branch.shape != inp.shape or grad_branch.dtype != inp.dtype:
        raise ValueError(
            f"te.branch_rmsnorm: grad_branch must have inp's shape {list(inp.shape)} and dtype "
            f"{inp.dtype}, got {list(grad_branch.shape)} {grad_branch.dtype}"
        )


# 2. Forward op --------------------------------------------------------------------------------


@op("branch_rmsnorm_fwd")
def branch_rmsnorm_fwd(
    inp: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, branch, rsigma)`` (module docstring), ``te::rmsnorm_fwd``'s checks included."""
    out, rsigma = rmsnorm_fwd.eager(inp, weight, eps, zero_centered_gamma)
    return out, inp.clone(memory_format=torch.contiguous_format), rsigma


# 3. Fake --------------------------------------------------------------------------------------


@branch_rmsnorm_fwd.register_fake
def _branch_rmsnorm_fwd_fake(inp, weight, eps, zero_centered_gamma):
    check_norm_args("rmsnorm", inp, weight, None, eps)
    stat = inp.new_empty(inp.shape[:-1], dtype=acc_dtype(inp))
    return inp.new_empty(inp.shape), inp.new_empty(inp.shape), stat


# 4. Backward op -------------------------------------------------------------------------------


@op("branch_rmsnorm_bwd")
def branch_rmsnorm_bwd(
    grad_out: Tensor,
    grad_branch: Tensor,
    inp: Tensor,
    rsigma: Tensor,
    weight: Tensor,
    zero_centered_gamma: bool,
) -> tuple[Tensor, Tensor]:
    """``(dinp, dweight)`` with the branch gradient in ``dinp`` (module docstring); fp64 input
    takes the CPU path, in fp64."""
    _check_branch(inp, grad_branch)
    if runs_triton(inp):
        from te_compile.kernels.norm import rmsnorm_bwd as kernel

        return kernel(grad_out, inp, rsigma, weight, zero_centered_gamma, branch=grad_branch)
    acc = rsigma.dtype  # fp32, or fp64 for fp64 input
    dx, dweight = rmsnorm_bwd_ref(
        grad_out.to(acc), inp.to(acc), rsigma, weight, zero_centered_gamma
    )
    return (dx + grad_branch.to(acc)).to(inp.dtype), dweight


@branch_rmsnorm_bwd.register_fake
def _branch_rmsnorm_bwd_fake(grad_out, grad_branch, inp, rsigma, weight, zero_centered_gamma):
    _check_branch(inp, grad_branch)
    return inp.new_empty(inp.shape), weight.new_empty(weight.shape)


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, weight, _eps, zero_centered_gamma = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(inp, weight, output[2])
    ctx.zero_centered_gamma = zero_centered_gamma


def _backward(ctx, bwd, grad_out, grad_branch, _grad_rsigma):
    inp, weight, rsigma = ctx.saved_tensors
    # None: that output (the norm's, or the branch) was not used.
    dy = [(torch.zeros_like(inp) if g is None else g).contiguous() for g in (grad_out, grad_branch)]
    dinp, dweight = bwd(*dy, inp, rsigma, weight, ctx.zero_centered_gamma)
    need_dgrad, need_wgrad = ctx.needs_input_grad[:2]
    return dinp if need_dgrad else None, dweight if need_wgrad else None, None, None


_branch_rmsnorm = differentiable(
    branch_rmsnorm_fwd,
    branch_rmsnorm_bwd,
    setup_context=_setup_context,
    backward=_backward,
    reference=branch_rmsnorm_ref,
)


# Public function ------------------------------------------------------------------------------


def branch_rmsnorm(
    inp: Tensor, weight: Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False
) -> tuple[Tensor, Tensor]:
    """``(rmsnorm(inp), branch)`` through ``te::branch_rmsnorm_fwd``: ``branch`` holds ``inp``'s
    values, and its gradient is added inside the norm's backward."""
    check_public_args("te.branch_rmsnorm", eps, inp=inp, weight=weight, zcg=zero_centered_gamma)
    out, branch, _rsigma = _branch_rmsnorm(inp, weight, eps, zero_centered_gamma)
    return out, branch
