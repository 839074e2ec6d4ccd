r"""Normalisation over the last dim: LayerNorm, RMSNorm and L2 normalisation.

Ops ``te::layernorm_fwd/_bwd``, ``te::rmsnorm_fwd/_bwd``, ``te::l2normalization_fwd/_bwd``.
``inp`` is ``[..., N]``; every leading index is a row, normalised on its own. Per row:

.. math::
    \text{LayerNorm:}\quad \mu = \tfrac1N \textstyle\sum_j x_j, \quad
        r = \big(\tfrac1N \textstyle\sum_j (x_j-\mu)^2 + \varepsilon\big)^{-1/2}, \quad
        y = (x-\mu)\,r\,\gamma + \beta

    \text{RMSNorm:}\quad r = \big(\tfrac1N \textstyle\sum_j x_j^2 + \varepsilon\big)^{-1/2},
        \quad y = x\,r\,\gamma

    \text{L2 normalisation:}\quad r = \big(\textstyle\sum_j x_j^2 + \varepsilon\big)^{-1/2},
        \quad y = x\,r

and, with :math:`\hat x = (x-\mu)\,r` (:math:`\mu = 0` for RMSNorm and L2), :math:`g = dy\,\gamma`
(:math:`g = dy` for L2) and :math:`\langle\cdot\rangle` the row mean (the row *sum* for L2),

.. math::
    dx = r\,\big(g - \langle g\rangle - \hat x\,\langle \hat x\,g\rangle\big)
    \quad(\text{no } \langle g\rangle \text{ term for RMSNorm and L2}), \qquad
    d\gamma = \textstyle\sum_{rows} dy\,\hat x, \qquad d\beta = \textstyle\sum_{rows} dy.

``zero_centered_gamma=True`` stores the weight as :math:`w = \gamma - 1` (Transformer Engine's
option; weight decay then pulls the scale towards 1, not 0): the effective scale is ``w + 1``,
added in fp32 so it costs no precision. Its gradient is the gradient of :math:`\gamma`.

Statistics: the forward returns ``mean`` (LayerNorm) and ``rsigma`` :math:`= r` as extra outputs,
fp32 (fp64 for fp64 input) of shape ``inp.shape[:-1]``, and the backward op consumes them instead
of recomputing. They are not differentiable outputs (``setup_context`` marks them so).

Dtypes: ``inp`` is fp32, bf16, fp16 or fp64; ``weight`` (and ``bias``, which must match it) is
either fp32 or ``inp``'s dtype — fp32 parameters with bf16 activations, as Transformer Engine's
``params_dtype`` allows. All math is fp32 (fp64 for fp64); the output is ``inp``'s dtype, rounded
once; weight gradients are reduced in fp32 and rounded once to the weight's dtype. Under
``torch.autocast`` the op mechanism casts every floating argument, weight included, to the
autocast dtype, as it does for ``nn.Linear``.

Implementations (one function per op, choosing by device): on CUDA the Triton kernels of
``te_compile.kernels.norm`` (one program per row tile forward; backward with a two-stage
``dgamma``/``dbeta`` reduction), else (CPU; fp64) the reference math below (``*_ref``).

Argument order leaves room to grow: an FP8 recipe appends output-quantisation arguments with
defaults after ``zero_centered_gamma`` (``eps`` for L2).
"""

from __future__ import annotations

import functools
import math
from itertools import zip_longest

import torch
from torch import Tensor

from te_compile._checks import (
    FLOAT_DTYPES,
    check_bool,
    check_positive_finite,
    check_required,
    check_same_device,
    check_tensors,
)
from te_compile._library import differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.kernels import dense, runs_triton, submodule

__all__ = [
    "check_norm_args",
    "l2normalization",
    "l2normalization_ref",
    "layernorm",
    "layernorm_ref",
    "rmsnorm",
    "rmsnorm_ref",
]


# 1. Reference math --------------------------------------------------------------------------


def _gamma(weight: Tensor, zero_centered_gamma: bool, acc: torch.dtype) -> Tensor:
    return weight.to(acc) + 1 if zero_centered_gamma else weight.to(acc)


def layernorm_ref(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rsigma)``: fp32 (or fp64) math, ``out`` cast to ``inp``'s dtype at the end."""
    acc = acc_dtype(inp)
    x = inp.to(acc)
    mean = x.mean(-1)
    xc = x - mean[..., None]
    rsigma = torch.rsqrt((xc * xc).mean(-1) + eps)
    out = xc * rsigma[..., None] * _gamma(weight, zero_centered_gamma, acc)
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(inp.dtype), mean, rsigma


def rmsnorm_ref(
    inp: Tensor, weight: Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False
) -> tuple[Tensor, Tensor]:
    """``(out, rsigma)``: fp32 (or fp64) math, ``out`` cast to ``inp``'s dtype at the end."""
    acc = acc_dtype(inp)
    x = inp.to(acc)
    rsigma = torch.rsqrt((x * x).mean(-1) + eps)
    out = x * rsigma[..., None] * _gamma(weight, zero_centered_gamma, acc)
    return out.to(inp.dtype), rsigma


def l2normalization_ref(inp: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(out, rsigma)`` with ``rsigma = 1/sqrt(sum(x^2) + eps)``; fp32 (or fp64) math."""
    x = inp.to(acc_dtype(inp))
    rsigma = torch.rsqrt((x * x).sum(-1) + eps)
    return (x * rsigma[..., None]).to(inp.dtype), rsigma


def _dx(g: Tensor, x_hat: Tensor, rsigma: Tensor, centered: bool, scale: float) -> Tensor:
    """``r (g - <g> - x_hat <x_hat g>)``; ``<.>`` is ``scale`` times the row sum."""
    dx = g - x_hat * ((x_hat * g).sum(-1, keepdim=True) * scale)
    if centered:
        dx = dx - g.sum(-1, keepdim=True) * scale
    return dx * rsigma[..., None]


def _sum_rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).sum(0)


def layernorm_bwd_ref(
    grad_out: Tensor,
    inp: Tensor,
    mean: Tensor | None,
    rsigma: Tensor,
    weight: Tensor,
    zero_centered_gamma: bool,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(dinp, dweight, dbias)`` (``dbias`` None unless ``has_bias``); fp32 (or fp64) math.
    ``mean`` None: RMSNorm's backward (no mean, no ``<g>`` term)."""
    acc = acc_dtype(inp)
    x = inp.to(acc) if mean is None else inp.to(acc) - mean[..., None]
    dy, x_hat = grad_out.to(acc), x * rsigma[..., None]
    g = dy * _gamma(weight, zero_centered_gamma, acc)
    dx = _dx(g, x_hat, rsigma, mean is not None, 1.0 / inp.shape[-1])
    dbias = _sum_rows(dy).to(weight.dtype) if has_bias else None
    return dx.to(inp.dtype), _sum_rows(dy * x_hat).to(weight.dtype), dbias


def rmsnorm_bwd_ref(
    grad_out: Tensor, inp: Tensor, rsigma: Tensor, weight: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """``(dinp, dweight)``; fp32 (or fp64) math."""
    return layernorm_bwd_ref(grad_out, inp, None, rsigma, weight, zero_centered_gamma, False)[:2]


def l2normalization_bwd_ref(grad_out: Tensor, inp: Tensor, rsigma: Tensor) -> Tensor:
    """``dinp``; fp32 (or fp64) math."""
    acc = acc_dtype(inp)
    x_hat = inp.to(acc) * rsigma[..., None]
    return _dx(grad_out.to(acc), x_hat, rsigma, False, 1.0).to(inp.dtype)


def check_public_args(
    owner: str, eps: float, bias: Tensor | None = None, zcg: bool = False, **required: Tensor
) -> None:
    """The public functions' argument types: tensors (``bias`` may be None, the ``required``
    ones not), a real ``eps`` and a bool ``zero_centered_gamma`` (``zcg``), so that a wrong type
    is refused by name before the ops' shape checks read it. One cheap test on the hot path."""
    if (
        type(eps) is float
        and (zcg is True or zcg is False)
        and (bias is None or isinstance(bias, Tensor))
        and all(isinstance(t, Tensor) for t in required.values())
    ):
        return
    check_bool(owner, zero_centered_gamma=zcg)
    check_required(owner, **required)
    check_tensors(owner, bias=bias)
    check_positive_finite(owner, eps=eps)


def check_norm_args(
    name: str, inp: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> None:
    """Constraints shared by the implementations (eager) and the fakes (trace time), so eager
    and compile raise the same ValueError naming the argument."""

    def fail(message: str) -> ValueError:
        return ValueError(f"te.{name}: {message}")

    if not 0 < eps < math.inf:
        raise fail(f"eps must be > 0 and finite, got {eps}")
    if inp.dtype not in FLOAT_DTYPES:
        raise fail(f"inp.dtype must be a floating type, got {inp.dtype}")
    if inp.ndim < 1 or inp.shape[-1] < 1:
        raise fail(f"inp must have a non-empty last dim, got shape {list(inp.shape)}")
    n = inp.shape[-1]
    if weight is not None and (weight.ndim != 1 or weight.shape[0] != n):
        raise fail(f"weight must have shape [inp.shape[-1]] = [{n}], got {list(weight.shape)}")
    if weight is not None and weight.dtype not in (inp.dtype, torch.float32):
        raise fail(
            f"weight.dtype ({weight.dtype}) must be torch.float32 or equal inp.dtype ({inp.dtype})"
        )
    check_same_device(f"te.{name}", "inp", inp, weight=weight, bias=bias)
    if bias is not None and bias.shape != weight.shape:
        raise fail(f"bias must have weight's shape [{n}], got {list(bias.shape)}")
    if bias is not None and bias.dtype is not weight.dtype:
        raise fail(f"bias.dtype ({bias.dtype}) must equal weight.dtype ({weight.dtype})")


_kernels = functools.partial(submodule, "norm")  # Triton: imported on first CUDA use


# 2. Forward ops -----------------------------------------------------------------------------


@op("layernorm_fwd")
def layernorm_fwd(
    inp: Tensor, weight: Tensor, bias: Tensor | None, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(out, mean, rsigma)``."""
    check_norm_args("layernorm", inp, weight, bias, eps)
    if runs_triton(inp):
        return _kernels().layernorm_fwd(inp, weight, bias, eps, zero_centered_gamma)
    return layernorm_ref(inp.contiguous(), weight, bias, eps, zero_centered_gamma)


@op("rmsnorm_fwd")
def rmsnorm_fwd(
    inp: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, rsigma)``."""
    check_norm_args("rmsnorm", inp, weight, None, eps)
    if runs_triton(inp):
        return _kernels().rmsnorm_fwd(inp, weight, eps, zero_centered_gamma)
    return rmsnorm_ref(inp.contiguous(), weight, eps, zero_centered_gamma)


@op("l2normalization_fwd")
def l2normalization_fwd(inp: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns ``(out, rsigma)``."""
    check_norm_args("l2normalization", inp, None, None, eps)
    if runs_triton(inp):
        return _kernels().l2normalization_fwd(inp, eps)
    return l2normalization_ref(inp.contiguous(), eps)


# 3. Fakes -----------------------------------------------------------------------------------


def _stat(inp: Tensor) -> Tensor:
    return inp.new_empty(inp.shape[:-1], dtype=acc_dtype(inp))


@layernorm_fwd.register_fake
def _layernorm_fwd_fake(inp, weight, bias, eps, zero_centered_gamma):
    check_norm_args("layernorm", inp, weight, bias, eps)
    return inp.new_empty(inp.shape), _stat(inp), _stat(inp)


@rmsnorm_fwd.register_fake
def _rmsnorm_fwd_fake(inp, weight, eps, zero_centered_gamma):
    check_norm_args("rmsnorm", inp, weight, None, eps)
    return inp.new_empty(inp.shape), _stat(inp)


@l2normalization_fwd.register_fake
def _l2normalization_fwd_fake(inp, eps):
    check_norm_args("l2normalization", inp, None, None, eps)
    return inp.new_empty(inp.shape), _stat(inp)


# 4. Backward ops ----------------------------------------------------------------------------


@op("layernorm_bwd")
def layernorm_bwd(
    grad_out: Tensor,
    inp: Tensor,
    mean: Tensor,
    rsigma: Tensor,
    weight: Tensor,
    zero_centered_gamma: bool,
    has_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dinp, dweight, dbias)``; ``dbias`` is a 0-element tensor unless
    ``has_bias``."""
    rest = (mean, rsigma, weight, zero_centered_gamma, has_bias)
    if runs_triton(inp):
        dx, dw, db = _kernels().layernorm_bwd(grad_out, inp, *rest)
    else:
        dx, dw, db = layernorm_bwd_ref(grad_out.contiguous(), inp.contiguous(), *rest)
    return dx, dw, dw.new_empty(0) if db is None else db


@layernorm_bwd.register_fake
def _layernorm_bwd_fake(grad_out, inp, mean, rsigma, weight, zero_centered_gamma, has_bias):
    dbias = weight.new_empty(weight.shape) if has_bias else weight.new_empty(0)
    return inp.new_empty(inp.shape), weight.new_empty(weight.shape), dbias


@op("rmsnorm_bwd")
def rmsnorm_bwd(
    grad_out: Tensor, inp: Tensor, rsigma: Tensor, weight: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """Returns ``(dinp, dweight)``."""
    rest = (rsigma, weight, zero_centered_gamma)
    if runs_triton(inp):
        return _kernels().rmsnorm_bwd(grad_out, inp, *rest)
    return rmsnorm_bwd_ref(grad_out.contiguous(), inp.contiguous(), *rest)


@rmsnorm_bwd.register_fake
def _rmsnorm_bwd_fake(grad_out, inp, rsigma, weight, zero_centered_gamma):
    return inp.new_empty(inp.shape), weight.new_empty(weight.shape)


@op("l2normalization_bwd")
def l2normalization_bwd(grad_out: Tensor, inp: Tensor, rsigma: Tensor) -> Tensor:
    """Returns ``dinp``."""
    if runs_triton(inp):
        return _kernels().l2normalization_bwd(grad_out, inp, rsigma)
    return l2normalization_bwd_ref(grad_out.contiguous(), inp.contiguous(), rsigma)


@l2normalization_bwd.register_fake
def _l2normalization_bwd_fake(grad_out, inp, rsigma):
    return inp.new_empty(inp.shape)


# 5. setup_context + autograd ------------------------------------------------------------------


def _layernorm_setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, _eps, zero_centered_gamma = inputs
    _save(ctx, output, inp, weight, zero_centered_gamma, bias is not None)


def _rmsnorm_setup_context(ctx, inputs, output) -> None:
    inp, weight, _eps, zero_centered_gamma = inputs
    _save(ctx, output, inp, weight, zero_centered_gamma)


def _l2_setup_context(ctx, inputs, output) -> None:
    _save(ctx, output, inputs[0])


def _save(ctx, output, inp, *rest) -> None:
    """Keeps the backward op's arguments after ``grad_out``: ``inp``, the statistics (the
    forward's outputs after ``out``, not differentiable), then ``rest`` (``weight``, saved, and
    the flags)."""
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(inp, *output[1:], *rest[:1])
    ctx.flags = rest[1:]


def _backward(ctx, bwd, grad_out, *_grad_stats):
    """The backward op's gradients for the forward's inputs that need one; None for the rest."""
    grads = bwd(dense(grad_out), *ctx.saved_tensors, *ctx.flags)
    grads = (grads,) if isinstance(grads, Tensor) else grads
    return tuple(g if need else None for g, need in zip_longest(grads, ctx.needs_input_grad))


# One op pair per norm: forward, backward, setup_context, reference.
_layernorm, _rmsnorm, _l2normalization = (
    differentiable(f, b, setup_context=c, backward=_backward, reference=r)
    for f, b, c, r in (
        (layernorm_fwd, layernorm_bwd, _layernorm_setup_context, layernorm_ref),
        (rmsnorm_fwd, rmsnorm_bwd, _rmsnorm_setup_context, rmsnorm_ref),
        (l2normalization_fwd, l2normalization_bwd, _l2_setup_context, l2normalization_ref),
    )
)


# Public functions -----------------------------------------------------------------------------


def layernorm(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> Tensor:
    """LayerNorm over the last dim of ``inp`` through ``te::layernorm_fwd``.

    ``weight`` and ``bias`` are ``[inp.shape[-1]]``, fp32 or ``inp``'s dtype. With
    ``zero_centered_gamma`` the scale applied is ``weight + 1``."""
    check_public_args(
        "te.layernorm", eps, inp=inp, weight=weight, bias=bias, zcg=zero_centered_gamma
    )
    return _layernorm(inp, weight, bias, eps, zero_centered_gamma)[0]


def rmsnorm(
    inp: Tensor, weight: Tensor, eps: float = 1e-5, zero_centered_gamma: bool = False
) -> Tensor:
    """RMSNorm over the last dim of ``inp`` through ``te::rmsnorm_fwd``.

    ``weight`` is ``[inp.shape[-1]]``, fp32 or ``inp``'s dtype. With ``zero_centered_gamma``
    the scale applied is ``weight + 1``."""
    check_public_args("te.rmsnorm", eps, inp=inp, weight=weight, zcg=zero_centered_gamma)
    return _rmsnorm(inp, weight, eps, zero_centered_gamma)[0]


def l2normalization(inp: Tensor, eps: float = 1e-6) -> Tensor:
    """``inp / sqrt(sum(inp**2, -1) + eps)`` through ``te::l2normalization_fwd``."""
    check_public_args("te.l2normalization", eps, inp=inp)
    return _l2normalization(inp, eps)[0]
