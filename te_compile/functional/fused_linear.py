r"""Linear + bias + activation fused: ``te::linear_bias_activation_fwd`` / ``_bwd``.

One of the fused linear ops ``te_compile.ops.Sequential`` emits in place of the basic ops
``BasicLinear, [Bias], <activation>`` (the others, which put a residual's add into a GEMM's
epilogue, are in ``fused_linear_add``). ``inp`` is ``[..., K]``, ``weight`` ``[N, K]``, the bias
``[N]`` (or ``[2H]`` for a gated activation, whose output has ``H`` features)::

    te::linear_bias_activation_fwd(inp, weight, bias?, main_grad?, activation, glu_interleave_size,
                                   limit, alpha, glu_linear_offset) -> (out, gemm_out)

.. math::
    h = x W^\top, \qquad y = f(h + b)

On CUDA: the cuBLAS GEMM, then the Triton activation kernel with the bias fused (the
implementations of ``te::linear_fwd`` and ``te::(gated_)activation_fwd``). ``gemm_out``
(:math:`h`) is what the backward needs; it is returned, not recomputed. The backward runs the
activation backward with ``dbias`` from the same pass, then the dgrad and wgrad GEMMs:
:math:`dh = f'(h + b)\,dy,\ db = \sum_{rows} dh,\ dX = dh\,W,\ dW = dh^\top X`. On CUDA the
results are therefore bitwise those of the unfused ops; what the fusion saves is the dispatch
of three ops (linear, bias add, activation) and the pass over :math:`h` of a separate bias add.
On the CPU (the definition of correctness) everything is fp32 math rounded once, with
:math:`h` kept in fp32, which is closer to the float64 reference than the unfused chain.

``main_grad`` (fp32, ``weight``'s shape) receives ``+= dW`` instead of a ``dweight`` output, as in
``te::linear_bwd``. A gradient that is not computed is a 0-element tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op
from te_compile.functional.activation import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    activation_bwd,
    activation_fwd,
    activation_ref,
    gated_activation_bwd,
    gated_activation_fwd,
    gated_activation_ref,
)
from te_compile.functional.activation import _check_args as _check_activation
from te_compile.functional.linear import _check_args as _check_linear
from te_compile.functional.linear import linear_bwd, linear_fwd, linear_ref

__all__ = ["linear_bias_activation", "linear_bias_activation_ref"]


def _acc(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# 1. Reference math ----------------------------------------------------------------------------


def linear_bias_activation_ref(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> Tensor:
    """``activation(inp @ weight.T + bias)``: the unfused composition of the reference ops."""
    h = linear_ref(inp, weight)
    if activation in GATED_ACTIVATIONS:
        config = (glu_interleave_size, limit, alpha, glu_linear_offset)
        return gated_activation_ref(h, bias, activation, *config)
    return activation_ref(h, bias, activation)


# Checks: the pieces' own checks (same messages as the unfused ops), plus the new arguments --


def _check_lba(inp, weight, bias, main_grad, activation, k) -> None:
    _check_linear(inp, weight, None, main_grad)
    n, gated = weight.shape[0], activation in GATED_ACTIVATIONS
    if (
        (bias is None or (bias.shape == (n,) and bias.dtype is inp.dtype))
        and (activation in ACTIVATIONS or (gated and n % 2 == 0 and k >= 0))
        and (not gated or k == 0 or (n // 2) % k == 0)
    ):
        return
    # The activation's own diagnosis, on a stand-in for the GEMM output ([..., N], inp's dtype).
    gemm_out = torch.empty((*inp.shape[:-1], n), dtype=inp.dtype, device="meta")
    _check_activation(gemm_out, bias, activation, gated, k)


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _gemm_out_dtype(inp: Tensor) -> torch.dtype:
    """``gemm_out`` is kept in the compute precision on the CPU, in ``inp``'s dtype elsewhere."""
    return _acc(inp) if inp.device.type == "cpu" else inp.dtype


def _linear_bwd_acc(dy, inp, weight, main_grad, has_bias, need_dgrad, need_wgrad):
    """``te::linear_bwd``'s implementation on ``dy``'s precision (fp32 or fp64; operands cast to
    it), the gradients rounded once to the dtypes of ``inp`` and ``weight``."""
    acc = dy.dtype
    dinp, dweight, dbias = linear_bwd.eager(
        dy, inp.to(acc), weight.to(acc), main_grad, has_bias, need_dgrad, need_wgrad
    )
    return dinp.to(inp.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype)


# 2. Forward ops -------------------------------------------------------------------------------


def _activation(h, bias, activation, k, limit, alpha, offset) -> Tensor:
    if activation in GATED_ACTIVATIONS:
        return gated_activation_fwd.eager(h, bias, activation, k, limit, alpha, offset)
    return activation_fwd.eager(h, bias, activation)


@op("linear_bias_activation_fwd")
def linear_bias_activation_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Returns ``(out, gemm_out)``. Default (CPU) implementation: the reference math in fp32
    (fp64 stays fp64), rounded once; ``gemm_out`` stays in that precision, so the backward too
    rounds once (the CPU is where correctness is defined, not where speed is)."""
    _check_lba(inp, weight, bias, main_grad, activation, glu_interleave_size)
    acc = _acc(inp)
    h = torch.nn.functional.linear(inp.to(acc), weight.to(acc))
    b = None if bias is None else bias.to(acc)
    config = (glu_interleave_size, limit, alpha, glu_linear_offset)
    return _activation(h, b, activation, *config).to(inp.dtype), h


@linear_bias_activation_fwd.register_kernel("cuda")
def _linear_bias_activation_fwd_cuda(
    inp, weight, bias, main_grad, activation, k=0, limit=7.0, alpha=1.702, offset=1.0
):
    # The GEMM through te::linear_fwd's CUDA implementation (cuBLAS), then the fused bias +
    # activation Triton kernel of te::(gated_)activation_fwd; gemm_out in the input dtype.
    _check_lba(inp, weight, bias, main_grad, activation, k)
    h, _ = linear_fwd.eager(inp, weight, None, main_grad)
    return _activation(h, bias, activation, k, limit, alpha, offset), h


# 3. Fakes -------------------------------------------------------------------------------------


@linear_bias_activation_fwd.register_fake
def _linear_bias_activation_fwd_fake(
    inp, weight, bias, main_grad, activation, k=0, limit=7.0, alpha=1.702, offset=1.0
):
    _check_lba(inp, weight, bias, main_grad, activation, k)
    n = weight.shape[0]
    n_out = n // 2 if activation in GATED_ACTIVATIONS else n
    out = inp.new_empty((*inp.shape[:-1], n_out))
    return out, inp.new_empty((*inp.shape[:-1], n), dtype=_gemm_out_dtype(inp))


# 4. Backward ops ------------------------------------------------------------------------------


def _activation_bwd(grad, gemm_out, bias, activation, k, limit, alpha, offset, need_dbias):
    if activation in GATED_ACTIVATIONS:
        config = (k, limit, alpha, offset)
        return gated_activation_bwd.eager(grad, gemm_out, bias, activation, *config, need_dbias)
    return activation_bwd.eager(grad, gemm_out, bias, activation, need_dbias)


@op("linear_bias_activation_bwd", mutates_args=("main_grad",))
def linear_bias_activation_bwd(
    grad: Tensor,
    inp: Tensor,
    weight: Tensor,
    gemm_out: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    activation: str,
    glu_interleave_size: int,
    limit: float,
    alpha: float,
    glu_linear_offset: float,
    need_dgrad: bool,
    need_wgrad: bool,
    need_dbias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)``: the activation backward with ``dbias`` from the same pass,
    then the GEMMs. Default (CPU) implementation: all of it in ``gemm_out``'s fp32 (fp64 stays
    fp64), each gradient rounded once."""
    acc = gemm_out.dtype
    need_dbias = need_dbias and bias is not None
    config = (glu_interleave_size, limit, alpha, glu_linear_offset)
    b = None if bias is None else bias.to(acc)
    dh, dbias = _activation_bwd(grad.to(acc), gemm_out, b, activation, *config, need_dbias)
    dinp, dweight, _ = _linear_bwd_acc(dh, inp, weight, main_grad, False, need_dgrad, need_wgrad)
    return dinp, dweight, dbias.to(grad.dtype if bias is None else bias.dtype)


@linear_bias_activation_bwd.register_kernel("cuda")
def _linear_bias_activation_bwd_cuda(
    grad, inp, weight, gemm_out, bias, main_grad, act, k, limit, alpha, offset, dgrad, wgrad, dbias
):
    # The Triton activation backward (dbias from the same pass), then the cuBLAS GEMMs of
    # te::linear_bwd's CUDA implementation.
    dbias = dbias and bias is not None
    dh, db = _activation_bwd(grad, gemm_out, bias, act, k, limit, alpha, offset, dbias)
    dinp, dweight, _ = linear_bwd.eager(dh, inp, weight, main_grad, False, dgrad, wgrad)
    return dinp, dweight, db


def _linear_grads_fake(grad, inp, weight, main_grad, has_bias, need_dgrad, need_wgrad):
    dinp = grad.new_empty(inp.shape) if need_dgrad else _empty(grad)
    dweight = grad.new_empty(weight.shape) if need_wgrad and main_grad is None else _empty(grad)
    dbias = grad.new_empty(weight.shape[0]) if has_bias else _empty(grad)
    return dinp, dweight, dbias


@linear_bias_activation_bwd.register_fake
def _linear_bias_activation_bwd_fake(
    grad, inp, weight, gemm_out, bias, main_grad, act, k, limit, alpha, offset, dgrad, wgrad, dbias
):
    dinp, dweight, _ = _linear_grads_fake(grad, inp, weight, main_grad, False, dgrad, wgrad)
    dbias_out = grad.new_empty(bias.shape) if dbias and bias is not None else _empty(grad)
    return dinp, dweight, dbias_out


# 5. setup_context + autograd ------------------------------------------------------------------


def _lba_setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, main_grad, *config = inputs
    _out, gemm_out = output
    ctx.mark_non_differentiable(gemm_out)
    ctx.save_for_backward(inp, weight, gemm_out, bias, main_grad)
    ctx.config = config  # activation, glu_interleave_size, limit, alpha, glu_linear_offset


def _lba_backward(ctx, bwd, grad, _grad_gemm_out):
    inp, weight, gemm_out, bias, main_grad = ctx.saved_tensors
    need_dgrad, need_wgrad, need_dbias = ctx.needs_input_grad[:3]
    need_dbias = need_dbias and bias is not None
    dinp, dweight, dbias = bwd(
        grad.contiguous(),
        inp,
        weight,
        gemm_out,
        bias,
        main_grad,
        *ctx.config,
        need_dgrad,
        need_wgrad,
        need_dbias,
    )
    return (
        dinp if need_dgrad else None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if need_dbias else None,
        *(None for _ in range(1 + len(ctx.config))),
    )


def _tensor(device: torch.device):
    def t(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    return t


def _lba_samples(device: torch.device):
    t, bf16, fp16 = _tensor(device), torch.bfloat16, torch.float16
    yield SampleInput((t(5, 16), t(24, 16), t(24), None, "gelu", 0, 7.0, 1.702, 1.0))
    yield SampleInput(
        (t(2, 3, 16, dtype=bf16), t(32, 16, dtype=bf16), None, None, "relu", 0, 7.0, 1.702, 1.0)
    )
    yield SampleInput(
        (t(7, 32, dtype=bf16), t(16, 32, dtype=bf16), t(16, dtype=bf16), None, "swiglu", 4, 7.0)
        + (1.702, 1.0)
    )
    yield SampleInput(
        (t(3, 8, dtype=fp16), t(12, 8, dtype=fp16), t(12, dtype=fp16), None, "qgelu", 0, 7.0)
        + (1.702, 1.0)
    )
    # A small limit so that both clamps cut; first layer (no input gradient), main_grad.
    yield SampleInput(
        (t(6, 16, grad=False), t(16, 16), t(16), torch.zeros(16, 16, device=device))
        + ("clamped_swiglu", 2, 0.75, 1.702, 0.5)
    )


_linear_bias_activation = differentiable(
    linear_bias_activation_fwd,
    linear_bias_activation_bwd,
    setup_context=_lba_setup_context,
    backward=_lba_backward,
    sample_inputs=_lba_samples,
    reference=lambda inp, weight, bias, main_grad, *config: linear_bias_activation_ref(
        inp, weight, bias, *config
    ),
)
# Public functions -----------------------------------------------------------------------------


def linear_bias_activation(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str,
    glu_interleave_size: int | None = None,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    main_grad: Tensor | None = None,
) -> Tensor:
    """``activation(inp @ weight.T + bias)`` through ``te::linear_bias_activation_fwd``;
    ``activation`` is any name of ``ACTIVATIONS`` or ``GATED_ACTIVATIONS``."""
    if activation not in ACTIVATIONS + GATED_ACTIVATIONS:
        raise ValueError(
            f"te.linear_bias_activation: activation must be one of "
            f"{ACTIVATIONS + GATED_ACTIVATIONS}, got {activation!r}"
        )
    config = (glu_interleave_size or 0, limit, alpha, glu_linear_offset)
    out, _ = _linear_bias_activation(inp, weight, bias, main_grad, activation, *config)
    return out
