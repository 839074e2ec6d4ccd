r"""Linear: :math:`y = x W^\top + b`, as ``te::linear_fwd`` / ``te::linear_bwd``.

Layouts: ``inp`` is ``[..., in_features]`` (any number of leading dims, flattened to
``[M, K]`` for the GEMM), ``weight`` is ``[out_features, in_features]`` like ``nn.Linear``,
``bias`` is ``[out_features]``. The backward computes

.. math::
    dX = dY\,W, \qquad dW = dY^\top X, \qquad db = \textstyle\sum_{rows} dY

and skips whichever of them autograd does not need.

Weight-gradient fusion (``main_grad``): as in Transformer Engine, a module built with
``fuse_wgrad_accumulation=True`` keeps an fp32 ``weight.main_grad`` and the backward GEMM
*accumulates into it* (one cuBLAS call with fp32 output and beta=1 on CUDA) instead of producing
``weight.grad``. ``main_grad`` enters the forward op only so that ``setup_context`` can save it;
``te::linear_bwd`` declares it mutated, which torch.compile supports in the backward graph.

Extension points, so later recipes extend this op instead of adding a second Linear:
``te::linear_fwd`` returns ``(out, saved)`` where ``saved`` is the list of extra tensors the
backward needs that are not inputs. It is empty in high precision; FP8 recipes put their
quantised input/weight and scale-inverses there and append their scalar configuration
(recipe name, formats) as trailing schema arguments with defaults. Tensor parallelism stays
outside the op: collectives are traceable functional collectives around it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op

__all__ = ["linear", "linear_ref"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# 1. Reference math --------------------------------------------------------------------------


def linear_ref(inp: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Definition of correctness: fp32 (or fp64) math, cast to the input dtype at the end."""
    acc = torch.float64 if inp.dtype == torch.float64 else torch.float32
    out = torch.nn.functional.linear(
        inp.to(acc), weight.to(acc), None if bias is None else bias.to(acc)
    )
    return out.to(inp.dtype)


def _check_args(inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None) -> None:
    """Constraints shared by the implementations (eager) and the fake (trace time).

    One cheap compound test on the hot path (eager calls pay for it on every step); the
    per-argument diagnosis runs only when it fails, so eager and compile raise the same
    ValueError naming the argument."""
    w_shape = weight.shape
    dtype = inp.dtype
    if (
        len(w_shape) == 2
        and dtype is weight.dtype
        and dtype in _FLOAT_DTYPES
        and inp.ndim >= 1
        and inp.shape[-1] == w_shape[1]
        and (bias is None or (bias.shape == (w_shape[0],) and bias.dtype is dtype))
        and (main_grad is None or (main_grad.dtype is torch.float32 and main_grad.shape == w_shape))
    ):
        return
    raise ValueError(_diagnose(inp, weight, bias, main_grad))


def _diagnose(inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None) -> str:
    if weight.dim() != 2:
        return f"te.linear: weight must be 2-D [out_features, in_features], got {weight.dim()}-D"
    if inp.dim() < 1:
        return "te.linear: inp must have at least 1 dimension"
    if inp.dtype not in _FLOAT_DTYPES:
        return f"te.linear: inp.dtype must be a floating type, got {inp.dtype}"
    if inp.dtype != weight.dtype:
        return (
            f"te.linear: inp.dtype ({inp.dtype}) must equal weight.dtype ({weight.dtype}); "
            "use torch.autocast or cast the input"
        )
    if inp.shape[-1] != weight.shape[1]:
        return (
            f"te.linear: inp.shape[-1] ({inp.shape[-1]}) must equal in_features = "
            f"weight.shape[1] ({weight.shape[1]})"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        return (
            f"te.linear: bias must have shape [out_features] = [{weight.shape[0]}], "
            f"got {list(bias.shape)}"
        )
    if bias is not None and bias.dtype != weight.dtype:
        return f"te.linear: bias.dtype ({bias.dtype}) must equal weight.dtype ({weight.dtype})"
    return (
        f"te.linear: main_grad must be float32 with weight's shape {list(weight.shape)}, "
        f"got {main_grad.dtype} {list(main_grad.shape)}"
    )


# 2. Forward op ------------------------------------------------------------------------------


@op("linear_fwd")
def linear_fwd(
    inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> tuple[Tensor, list[Tensor]]:
    """Returns ``(out, saved)``; ``saved`` is empty in high precision (see module docstring).

    The default (CPU) implementation is the reference math: one rounding at the end."""
    _check_args(inp, weight, bias, main_grad)
    return linear_ref(inp, weight, bias), []


@linear_fwd.register_kernel("cuda")
def _linear_fwd_cuda(
    inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> tuple[Tensor, list[Tensor]]:
    _check_args(inp, weight, bias, main_grad)
    # cuBLAS(Lt): fp32 accumulation, bias fused into the GEMM epilogue.
    return torch.nn.functional.linear(inp, weight, bias), []


# 3. Fake ------------------------------------------------------------------------------------


@linear_fwd.register_fake
def _linear_fwd_fake(
    inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> tuple[Tensor, list[Tensor]]:
    _check_args(inp, weight, bias, main_grad)
    return inp.new_empty((*inp.shape[:-1], weight.shape[0])), []


# 4. Backward op -----------------------------------------------------------------------------


def _accumulate_wgrad(main_grad: Tensor, dy: Tensor, x: Tensor) -> None:
    """main_grad += dy^T x, accumulated in fp32."""
    if main_grad.is_cuda and dy.dtype != torch.float32:
        # One cuBLAS call: low-precision operands, fp32 output, beta=1.
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(dy.t().float(), x.float())


def _empty(like: Tensor) -> Tensor:
    # A gradient that is not computed: a fresh 0-element tensor per output (outputs of an op
    # must not alias each other, so one shared empty tensor is not allowed).
    return like.new_empty(0)


def _linear_bwd_impl(
    grad_out: Tensor,
    inp: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
    acc: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The three backward GEMMs/reductions, computed in ``acc`` (None: the input dtype)."""
    dtype = grad_out.dtype
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    dinp = _empty(grad_out)
    if need_dgrad:
        dinp = (grad_out.to(acc) @ weight.to(acc)).to(dtype) if acc else grad_out @ weight
    dweight = _empty(grad_out)
    if need_wgrad:
        x = inp.reshape(-1, inp.shape[-1])
        if main_grad is not None:
            _accumulate_wgrad(main_grad, dy, x)
        else:
            dweight = (dy.t().to(acc) @ x.to(acc)).to(dtype) if acc else dy.t() @ x
    dbias = _empty(grad_out)
    if has_bias:
        dbias = dy.sum(0, dtype=acc).to(dtype) if acc else dy.sum(0)
    return dinp, dweight, dbias


@op("linear_bwd", mutates_args=("main_grad",))
def linear_bwd(
    grad_out: Tensor,
    inp: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns ``(dinp, dweight, dbias)``. A gradient that is not computed is a 0-element tensor:
    dinp unless ``need_dgrad``, dweight unless ``need_wgrad`` and no ``main_grad`` (then the
    weight gradient went into ``main_grad``), dbias unless ``has_bias``. Default (CPU)
    implementation: fp32 math (fp64 stays fp64), rounded once."""
    acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    return _linear_bwd_impl(grad_out, inp, weight, main_grad, has_bias, need_dgrad, need_wgrad, acc)


@linear_bwd.register_kernel("cuda")
def _linear_bwd_cuda(
    grad_out: Tensor,
    inp: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    # cuBLAS GEMMs in the input dtype with fp32 accumulation.
    return _linear_bwd_impl(
        grad_out, inp, weight, main_grad, has_bias, need_dgrad, need_wgrad, None
    )


@linear_bwd.register_fake
def _linear_bwd_fake(
    grad_out: Tensor,
    inp: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dinp = grad_out.new_empty(inp.shape) if need_dgrad else _empty(grad_out)
    dweight = (
        grad_out.new_empty(weight.shape) if need_wgrad and main_grad is None else _empty(grad_out)
    )
    dbias = grad_out.new_empty(weight.shape[0]) if has_bias else _empty(grad_out)
    return dinp, dweight, dbias


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, main_grad = inputs
    ctx.save_for_backward(inp, weight, main_grad)
    ctx.has_bias = bias is not None


def _backward(ctx, bwd, grad_out, grad_saved):
    inp, weight, main_grad = ctx.saved_tensors
    need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
    dinp, dweight, dbias = bwd(
        grad_out.contiguous(),
        inp,
        weight,
        main_grad,
        ctx.has_bias and need_bgrad,
        need_dgrad,
        need_wgrad,
    )
    return (
        dinp if need_dgrad else None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if ctx.has_bias and need_bgrad else None,
        None,
    )


def _sample_inputs(device: torch.device):
    def t(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    yield SampleInput((t(5, 16), t(8, 16), t(8), None))
    yield SampleInput((t(2, 3, 16), t(24, 16), None, None))
    yield SampleInput(
        (
            t(7, 32, dtype=torch.bfloat16),
            t(12, 32, dtype=torch.bfloat16),
            t(12, dtype=torch.bfloat16),
            None,
        )
    )
    yield SampleInput(
        (
            t(3, 4, 8, dtype=torch.float16),
            t(6, 8, dtype=torch.float16),
            t(6, dtype=torch.float16),
            None,
        )
    )
    # Input that needs no gradient (first layer), weight gradient into main_grad.
    yield SampleInput((t(6, 16, grad=False), t(4, 16), t(4), torch.zeros(4, 16, device=device)))


_linear = differentiable(
    linear_fwd,
    linear_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_sample_inputs,
    reference=lambda inp, weight, bias, main_grad: linear_ref(inp, weight, bias),
    # Without main_grad, both implementations are differentiable torch ops (CUDA: F.linear; CPU:
    # fp32 F.linear between casts) whose autograd computes exactly te::linear_bwd's GEMMs.
    native_autograd=lambda inp, weight, bias, main_grad: main_grad is None,
)


# Public function ------------------------------------------------------------------------------


def linear(
    inp: Tensor, weight: Tensor, bias: Tensor | None = None, *, main_grad: Tensor | None = None
) -> Tensor:
    """``inp @ weight.T + bias`` through ``te::linear_fwd``.

    With ``main_grad`` (fp32, weight's shape) the weight gradient is accumulated into it and
    ``weight.grad`` is left untouched.
    """
    out, _saved = _linear(inp, weight, bias, main_grad)
    return out
