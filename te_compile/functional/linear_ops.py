r"""The linear family: :math:`y = r + s\,f(\mathrm{norm}(x) W^\top + b)` as ``te::linear_fwd`` /
``te::linear_bwd``, for every recipe, with an optional norm prologue and epilogue.

Layouts: ``inp`` is ``[..., in_features]`` (any number of leading dims, flattened to ``[M, K]``
for the GEMM), ``weight`` is ``[out_features, in_features]`` like ``nn.Linear``, ``bias`` is
``[out_features]``. The backward computes

.. math::
    dX = dY\,W, \qquad dW = dY^\top X, \qquad db = \textstyle\sum_{rows} dY

(through the epilogue and the prologue) and skips whichever of them autograd does not need.
``te::linear_fwd(inp, weight, bias?, main_grad?, <recipe>, <prologue>, <epilogue>, <backward>,
weight_q?, wgrad_stash?) -> (out, branch, saved)`` takes, after the four tensors:

* the recipe as data (``docs/op_mechanism.md``): ``input_spec``, ``weight_spec``, ``grad_spec``
  (a ``QuantSpec`` string each), the delayed scales ``scale`` ``[3]`` (input, weight, gradient),
  ``grad_amax`` ``[1]``, which the backward writes the gradient's amax into (per-tensor recipes),
  and ``rng_state`` (int64 ``(seed, offset)``: a gradient spec's stochastic rounding);
* the norm prologue (``functional.prologue``): ``norm`` (a ``NormSpec`` string: ``""``,
  ``"LayerNorm"`` or ``"RMSNorm"`` with ``eps`` and ``zero_centered``), ``norm_weight``,
  ``norm_bias``: ``inp`` is normalised first (written straight into FP8 on CUDA by the
  per-tensor recipes and native Float8BlockScaling);
* the epilogue: ``epilogue`` (an ``EpilogueSpec`` string: ``act`` any of ``ACTIVATIONS`` /
  ``GATED_ACTIVATIONS``, the bias then added by the activation, whose output has half the
  features for a gated one, with ``interleave``, ``limit``, ``alpha``, ``offset``; ``scale``;
  ``branch``: also return a copy of ``inp``, a residual connection's branch, whose gradient joins
  the dgrad GEMM) and ``residual`` (the output's shape): ``residual + scale * y``;
* ``backward`` (a ``BackwardSpec`` string, with a recipe): ``""``, the backward GEMMs on the
  recipe's quantised operands and gradient; ``"high_precision"`` / ``"dequantized"``, high
  precision's backward on the forward's high-precision operands (with a prologue the norm is
  then not fused into the cast) or on its quantised ones dequantised (``docs/fp8.md``,
  ``backward_override``); ``"save_input"``, the backward keeps ``inp`` and quantises it again.

Outputs: ``out``; ``branch`` (0-element unless asked: an op's output may not alias its input);
``saved``, the tensors the backward needs that are not inputs (the FP8 transposed copies of
``X`` and ``W`` with their inverse scales, or their dequantised values under emulation; the
GEMM's output before an activation; the norm's output in high precision; the norm's ``mean,
rsigma``), then, for the per-tensor recipes, ``[amax(X), amax(W)]`` (fp32), which the caller
folds into the delayed-scaling history.

Numerics. High precision: on CUDA cuBLAS in the input dtype (bias, or the residual, in the
GEMM's epilogue) and the activation kernel; on the CPU (the definition of correctness) fp32
math rounded once at the end. FP8 (``_scaled_mm`` wants its first operand row-major and its
second column-major, so the forward writes the transposed copies the backward GEMMs need): the
GEMM output is rounded to the input dtype, then the epilogue runs on it. Per-tensor recipes
need in/out features multiples of 16 (token counts are padded with zero rows inside), the
block-scaled ones every dim a multiple of their block (32 for MXFP8, 16 otherwise). An inf/NaN
input gives an inf/NaN amax, which the delayed-scaling update ignores (keeps the old scale).

``main_grad`` (``fuse_wgrad_accumulation``): the backward GEMM accumulates into this fp32
buffer (mutated by ``te::linear_bwd``) instead of producing ``weight.grad``. ``weight_q``: the
five tensors of ``te::quantize_weight`` (``functional.dense_weight``, ``docs/fp8.md``), the
weight already quantised: ``saved`` then holds only the input's copy. ``weight`` may then be
the FP8 codes themselves (FP8 primary weights): its gradient must go to ``main_grad``, and
``backward="high_precision"`` is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_compile._checks import (
    check_bool,
    check_choice,
    check_same_device,
    check_tensors,
    passed_once,
)
from te_compile._library import differentiable, op, use_fast_path
from te_compile._numerics import acc_dtype
from te_compile.functional.activation import GATED_ACTIVATIONS, activation_ref, gated_activation_ref
from te_compile.functional.dense_weight import (
    check_weight_quantized,
    fake_copy,
    fp8_grad,
    refuse_fp8_weight_grad,
)
from te_compile.functional.dropout_ops import new_rng_state
from te_compile.functional.family import (
    BwdArgs,
    DeferredWgrad,
    check_gemm_args,
    check_gemm_tensors,
    check_overwrite,
    save_for_backward_except_written,
)
from te_compile.functional.gemm import (
    BACKWARD_OVERRIDES,
    PER_TENSOR,
    empty,
    hp_linear,
    hp_linear_backward,
    padded,
)
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.functional.linear_args import (
    NORM_WEIGHT,
    RESIDUAL,
    LinearArgs,
    check_linear,
    check_linear_tensors,
    out_features,
)
from te_compile.functional.linear_impl import backward_impl, forward_impl, quantized_gemm
from te_compile.functional.prologue import NORMALIZATIONS, Norm, fake_dnorm, fake_stats, norm_ref
from te_compile.functional.spec import (
    BackwardSpec,
    EpilogueSpec,
    NormSpec,
    QuantSpec,
    as_strings,
    backward_norm,
    eager_cached,
)

__all__ = ["linear", "linear_per_tensor", "linear_ref"]

# 1. Reference math --------------------------------------------------------------------------


def linear_ref(inp: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Definition of correctness in high precision: fp32 (or fp64) math, cast to the input
    dtype at the end (``functional.gemm.hp_linear``'s CPU implementation)."""
    return hp_linear(inp, weight, bias, cuda=False)


def _reference(*args):
    """The op's definition: the norm's reference, the recipe's GEMM, the epilogue, in the
    inputs' dtype (float64 in the tests)."""
    a = LinearArgs(*args)
    ep = a.ep
    x = norm_ref(a.inp, a.nrm)
    y = quantized_linear_ref(x, a.weight, *a.specs, a.scale, a.bw.override, a.rng_state)
    if ep.activation in GATED_ACTIVATIONS:
        y = gated_activation_ref(y, a.bias, ep.activation, *ep.params)
    elif ep.activation:
        y = activation_ref(y, a.bias, ep.activation)
    elif a.bias is not None:
        y = y + a.bias
    if a.residual is not None:
        y = a.residual + ep.scale * y
    elif ep.scale != 1.0:
        y = ep.scale * y
    return (y, a.inp) if ep.branch else y


# 2. Forward op ------------------------------------------------------------------------------


@op("linear_fwd")
def linear_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    input_spec: str = "",
    weight_spec: str = "",
    grad_spec: str = "",
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    rng_state: Tensor | None = None,
    norm: str = "",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    epilogue: str = "",
    residual: Tensor | None = None,
    backward: str = "",
    weight_q: list[Tensor] | None = None,
    wgrad_stash: Tensor | None = None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(out, branch, saved)`` (module docstring; on the CPU fp64 stays fp64)."""
    a = LinearArgs(inp, weight, bias, main_grad, input_spec, weight_spec, grad_spec, scale,
                   grad_amax, rng_state, norm, norm_weight, norm_bias, epilogue, residual,
                   backward, weight_q, wgrad_stash)  # fmt: skip
    if a.plain:
        return _plain_forward(inp, weight, bias, main_grad, cuda=False)
    return forward_impl(a, cuda=False)


def _plain_forward(inp, weight, bias, main_grad, cuda: bool) -> tuple[Tensor, Tensor, list]:
    """te.Linear's hot path: high precision, no prologue or epilogue (cheap to enter)."""
    check_linear_tensors(inp, weight, bias, main_grad)
    return hp_linear(inp, weight, bias, cuda), inp.new_empty(0), []


@linear_fwd.register_kernel("cuda")
def _linear_fwd_cuda(*args):
    if len(args) == 4:  # the eager fast path passes only the tensors of a plain call
        return _plain_forward(*args, cuda=True)
    return forward_impl(LinearArgs(*args), cuda=True)


# 3. Fake ------------------------------------------------------------------------------------


@linear_fwd.register_fake
def _linear_fwd_fake(*args):
    a = LinearArgs(*args)
    check_linear(a)
    inp, weight, ep = a.inp, a.weight, a.ep
    n, k = weight.shape
    rows = inp.numel() // k if k else 0
    out = inp.new_empty((*inp.shape[:-1], out_features(n, ep.activation)))
    branch = inp.new_empty(inp.shape) if ep.branch else empty(inp)
    if a.plain:
        return out, branch, []
    f32 = torch.float32
    xs, ws, _ = a.specs
    recipe, override, normalized = xs.kind, a.bw.override, bool(a.nrm.normalization)
    saved = [inp.new_empty(rows, k)] if normalized else []  # the norm's output, high precision
    if override == "dequantized":
        saved = [inp.new_empty(rows, k), inp.new_empty(n, k)]
    elif recipe and not override:  # the input's and the weight's transposed copies
        saved = [*fake_copy(inp, recipe, padded(rows), k, 1, xs.emulate),
                 *fake_copy(inp, recipe, n, k, ws.block_rows, xs.emulate)]  # fmt: skip
        if a.bw.save_input:  # the input's slots: 0-element (the input itself is saved)
            saved[:2] = [inp.new_empty(0, dtype=saved[0].dtype), inp.new_empty(0, dtype=f32)]
        if a.weight_q is not None:  # the weight's copies are inputs (setup_context)
            saved = saved[:2]
    if ep.activation:
        h_dtype = acc_dtype(inp) if not recipe and inp.device.type == "cpu" else inp.dtype
        saved.append(inp.new_empty(rows, n, dtype=h_dtype))
    saved += fake_stats(inp, rows, a.nrm.normalization)
    if recipe in PER_TENSOR:
        saved.append(inp.new_empty(2, dtype=f32))
    return out, branch, saved


# 4. Backward op -----------------------------------------------------------------------------


@op("linear_bwd", mutates_args=("main_grad", "grad_amax", "wgrad_stash"))
def linear_bwd(
    grad: Tensor,
    grad_branch: Tensor | None,
    saved: list[Tensor],
    inp: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    main_grad: Tensor | None,
    scale: Tensor | None,
    grad_amax: Tensor | None,
    norm_weight: Tensor | None,
    rng_state: Tensor | None,
    input_spec: str,
    weight_spec: str,
    grad_spec: str,
    norm: str,
    epilogue: str,
    need_dbias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
    wgrad_stash: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias, dnorm_weight, dnorm_bias)``, a 0-element tensor where not
    computed (``dweight`` also when it went into ``main_grad``). Tensors, not a list: a
    mutating op's list return cannot be functionalised (torch 2.13).
    ``saved``: the forward's, without the amaxes; ``inp`` is needed in high precision and with
    a norm (the norm's backward), ``weight`` in high precision, ``bias`` with an activation;
    the specs are the forward's (all ``""`` under a backward override), ``norm`` with ``bias``
    where the norm has one. ``need_dgrad``: any of the input and the norm's parameters needs a
    gradient. Writes ``amax(dY)`` into ``grad_amax`` when given. ``wgrad_stash`` (delayed
    weight gradient): the incoming gradient is copied into it and the weight gradient is not
    computed (a later call with ``grad=wgrad_stash`` and only ``need_wgrad`` computes it,
    ``DeferredWgrad``). On the CPU fp64 stays fp64."""
    return _backward_op(
        (grad, grad_branch, saved, inp, weight, bias, main_grad, scale, grad_amax, norm_weight,
         rng_state, input_spec, weight_spec, grad_spec, norm, epilogue, need_dbias, need_dgrad,
         need_wgrad, wgrad_stash), cuda=False)  # fmt: skip


def _bwd_args(args: tuple) -> tuple[tuple, tuple, Tensor | None]:
    """The 11 tensors (``grad`` to ``rng_state``), the 8 strings and flags (the specs to
    ``need_wgrad``) and the ``wgrad_stash`` of a ``linear_bwd`` call."""
    return args[:11], args[11:19], args[19] if len(args) > 19 else None


def _backward_op(args: tuple, cuda: bool) -> tuple[Tensor, ...]:
    """``linear_bwd`` on a device; a call without recipe, norm, epilogue or branch is plain."""
    tensors, scalars, stash = _bwd_args(args)
    input_spec, _, _, norm, epilogue, need_dbias, need_dgrad, need_wgrad = scalars
    if stash is not None:
        stash.copy_(tensors[0])
        need_wgrad = False
    if not (input_spec or norm or epilogue) and tensors[1] is None:
        grad, _, _, inp, weight, _, main_grad = tensors[:7]
        return (*hp_linear_backward(grad, inp, weight, main_grad, need_dbias, need_dgrad,
                                    need_wgrad, cuda=cuda), empty(grad), empty(grad))  # fmt: skip
    return backward_impl(*tensors, BwdArgs.of(*scalars[:-1], need_wgrad), cuda=cuda)


@linear_bwd.register_kernel("cuda")
def _linear_bwd_cuda(*args):
    return _backward_op(args, cuda=True)


@linear_bwd.register_fake
def _linear_bwd_fake(*args):
    (grad, _, saved, _, weight, _, main_grad, *_, norm_weight, _), scalars, stash = _bwd_args(args)
    c = BwdArgs.of(*scalars)
    n, k = weight.shape if weight is not None else saved[2].shape[::-1]
    dinp = grad.new_empty(*grad.shape[:-1], k) if c.need_dgrad else empty(grad)
    want_dw = c.need_wgrad and stash is None and main_grad is None
    dweight = grad.new_empty(n, k) if want_dw else empty(grad)
    dbias = grad.new_empty(n) if c.need_dbias else empty(grad)
    dnorm = fake_dnorm(grad, norm_weight, c.norm.normalization, c.norm.bias, c.need_dgrad)
    return dinp, dweight, dbias, *dnorm


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    if len(inputs) == 4:  # a plain call (the eager fast path passes the tensors only)
        inp, weight, bias, main_grad = inputs
        ctx.mark_non_differentiable(output[1])  # no branch: no gradient to make for it
        # (inp, weight, bias, main_grad, scale, grad_amax, norm_weight, rng_state, stash)
        save_for_backward_except_written(
            ctx, (inp, weight, None, main_grad, None, None, None, None, None), _WRITTEN
        )
        ctx.scalars, ctx.has_bias = ("", "", "", "", ""), bias is not None  # specs, norm, epilogue
        ctx.branch = ctx.has_norm = False
        return
    a = LinearArgs(*inputs)
    _out, branch, saved = output
    ctx.has_bias, ctx.branch = a.bias is not None, a.ep.branch
    ctx.mark_non_differentiable(*saved, *(() if ctx.branch else (branch,)))
    tensors, ctx.scalars = _for_backward(a, saved)
    save_for_backward_except_written(ctx, (*tensors, a.wgrad_stash), _WRITTEN)
    ctx.has_norm = bool(a.nrm.normalization)
    ctx.fp8_weight = a.main_grad is None and fp8_grad(a.weight)
    ctx.overwrite = a.bw.overwrite_main_grad


# Positions of main_grad and grad_amax in the backward's tensors (_for_backward): the buffers
# the backward writes into (functional.family.save_for_backward_except_written).
_WRITTEN = (3, 5)


def _for_backward(a: LinearArgs, saved: list[Tensor]) -> tuple[tuple, tuple]:
    """What the backward op takes from a forward call: ``(inp, weight, bias, main_grad, scale,
    grad_amax, norm_weight, rng_state, *saved)`` (None where not needed) and the strings."""
    recipe, override = a.specs[0].kind, a.bw.override
    if recipe in PER_TENSOR:
        saved = saved[:-1]  # the amaxes: for the caller, not the backward
    if a.weight_q is not None and not override:  # the dgrad GEMM's weight copy
        saved = [*saved[:2], a.weight_q[2], a.weight_q[3], *saved[2:]]
    # A backward override: the backward is high precision's, on the forward's high-precision
    # operands or on their dequantised copies (which take the input's and the weight's place).
    hp, normed = not recipe or override, bool(a.nrm.normalization)
    inp, weight = a.inp, a.weight
    if override == "dequantized" and normed:  # inp for the norm's backward, X's copy for wgrad
        weight, saved = saved[1], [saved[0], *saved[2:]]
    elif override == "dequantized":
        inp, weight, *saved = saved
    tensors = (
        inp if hp or normed or a.bw.save_input else None,
        weight if hp else None,
        a.bias if a.ep.activation else None,
        a.main_grad, a.scale, a.grad_amax,
        a.norm_weight if normed else None,
        a.rng_state,
        *saved)  # fmt: skip
    specs = ("", "", "") if override else (a.input_spec, a.weight_spec, a.grad_spec)
    return tensors, (*specs, backward_norm(a.norm, normed and a.norm_bias is not None), a.epilogue)


def _backward(ctx, bwd, grad, grad_branch, _grad_saved):
    inp, weight, bias, _, scale, _, norm_weight, rng_state, *saved, stash = ctx.saved_tensors
    main_grad, grad_amax = ctx.written
    need = ctx.needs_input_grad
    if need[1] and getattr(ctx, "fp8_weight", False):
        refuse_fp8_weight_grad("te.linear", "weight", "main_grad")
    if need[1] and getattr(ctx, "overwrite", False):  # (a deferred wgrad adds to the zeros)
        main_grad.zero_()
    need_norm = ctx.has_norm and any(need[NORM_WEIGHT : NORM_WEIGHT + 2])
    need_dbias = ctx.has_bias and need[2]
    grad_branch = grad_branch.contiguous() if ctx.branch and grad_branch is not None else None
    dinp, dweight, dbias, *dnorm = bwd(
        grad.contiguous(), grad_branch, saved, inp, weight, bias, main_grad, scale, grad_amax,
        norm_weight, rng_state, *ctx.scalars, need_dbias, need[0] or need_norm, need[1],
        *(() if stash is None else (stash,)))  # fmt: skip
    grads = [None] * len(need)
    grads[0] = dinp if need[0] else None
    grads[1] = dweight if need[1] and main_grad is None and stash is None else None
    grads[2] = dbias if need_dbias else None
    if need_norm:  # (a call passes no trailing argument left at its default)
        for i, d in zip(range(NORM_WEIGHT, min(len(need), NORM_WEIGHT + 2)), dnorm, strict=False):
            grads[i] = d if need[i] else None
    if len(need) > RESIDUAL and need[RESIDUAL]:
        grads[RESIDUAL] = grad
    return tuple(grads)


_linear = differentiable(
    linear_fwd,
    linear_bwd,
    setup_context=_setup_context,
    backward=_backward,
    reference=_reference,
    # Plain high precision without main_grad: both implementations are differentiable torch ops
    # (CUDA: F.linear; CPU: fp32 F.linear between casts) whose autograd computes exactly
    # te::linear_bwd's GEMMs.
    native_autograd=lambda *args: len(args) == 4 and args[3] is None,
)


class _PerTensorLinear(torch.autograd.Function):
    """``te::linear`` under a per-tensor recipe with an optional norm prologue, without
    epilogue or override, eager: :func:`linear_impl.quantized_gemm` / ``backward_impl`` (the
    op's own calls, the same bits) without the op's argument encoding, layers and generic
    autograd glue."""

    @staticmethod
    def forward(ctx, inp, weight, bias, main_grad, scale, grad_amax, specs, norm_weight,
                norm_bias, norm):  # fmt: skip
        prologue = None if norm is None else Norm(norm_weight, norm_bias, *norm)
        h, xq, wq, amax, stats = quantized_gemm(inp.reshape(-1, inp.shape[-1]), weight, bias,
                                                scale, *specs[:2], prologue)  # fmt: skip
        copies = (xq.data_t, xq.scale_t, wq.data_t, wq.scale_t)
        kept = (inp, norm_weight) if norm is not None else (None, None)
        ctx.save_for_backward(*copies, scale, *kept, *stats)
        spec = _NO_NORM if norm is None else NormSpec(*norm, bias=norm_bias is not None)
        ctx.te = main_grad, grad_amax, specs, spec, bias is not None, inp.is_cuda
        ctx.mark_non_differentiable(amax)
        ctx.set_materialize_grads(False)  # (the amax gets no gradient)
        return h.reshape(*inp.shape[:-1], h.shape[-1]), amax

    @staticmethod
    def backward(ctx, grad, _):
        saved = ctx.saved_tensors  # (read once: a checkpoint unpacks each tensor once)
        *copies, scale, inp, norm_weight = saved[:7]
        main_grad, grad_amax, specs, norm, has_bias, cuda = ctx.te
        need = ctx.needs_input_grad
        c = BwdArgs(*specs, norm, _NO_EPILOGUE, has_bias and need[2], any(need[:1] + need[7:9]),
                    need[1])  # fmt: skip
        dinp, dweight, dbias, dgamma, dbeta = backward_impl(
            grad.contiguous(), None, [*copies, *saved[7:]], inp, None, None, main_grad, scale,
            grad_amax, norm_weight, None, c, cuda)  # fmt: skip
        dnorm = (dgamma if need[7] else None, dbeta if need[8] else None)
        return (dinp if need[0] else None, dweight if need[1] and main_grad is None else None,
                dbias if c.need_dbias else None, None, None, None, None, *dnorm, None)  # fmt: skip


_NO_NORM, _NO_EPILOGUE = NormSpec(), EpilogueSpec()


@passed_once
def _check_per_tensor(args: tuple) -> None:
    """The op's checks of a :func:`linear_per_tensor` call (once per kind of call)."""
    inp, weight, bias, main_grad, specs, scale, grad_amax, w, b, *scalars = args
    check_gemm_tensors("te.linear", inp, weight, bias, main_grad)
    text = NormSpec(*scalars).encode() if scalars else ""
    check_linear(LinearArgs(inp, weight, bias, main_grad, *as_strings(*specs), scale, grad_amax,
                            None, text, w, b))  # fmt: skip


def linear_per_tensor(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    specs: tuple[QuantSpec, QuantSpec, QuantSpec],
    scale: Tensor | None,
    grad_amax: Tensor | None,
    norm: Norm | None = None,
) -> tuple[Tensor, Tensor] | None:
    """``(out, [amax(X), amax(W)])`` of ``linear(inp, weight, bias, main_grad=main_grad,
    input_spec=..., scale=scale, grad_amax=grad_amax, return_amax=True)`` under the per-tensor
    ``specs``, with ``norm``'s prologue where given (``prologue.Norm``: its ``normalization``
    set), the same bits and errors, through the eager fast path (``_library.use_fast_path``:
    eager, nothing watching; no ``torch.autocast``) without the op's layers: te.Linear's and
    te.LayerNormLinear's FP8 hot path. None where it does not apply (the caller then calls
    :func:`linear`). The op's checks run once per set of shapes, dtypes, devices and specs."""
    if not use_fast_path() or torch._C._is_any_autocast_enabled():
        return None
    w, b, *scalars = norm if norm is not None else (None, None)
    if scalars:
        scalars[1] = float(scalars[1])  # eps, as the op's NormSpec string gives it
    _check_per_tensor((inp, weight, bias, main_grad, specs, scale, grad_amax, w, b, *scalars))
    return _PerTensorLinear.apply(inp, weight, bias, main_grad, scale, grad_amax, specs, w, b,
                                  None if norm is None else tuple(scalars))  # fmt: skip


# Public function ------------------------------------------------------------------------------


def _deferred(args: tuple, saved: list[Tensor]) -> DeferredWgrad:
    a = LinearArgs(*args)
    tensors, scalars = _for_backward(a, saved)  # (the grad_branch: None)
    return DeferredWgrad.replaying(a.wgrad_stash, torch.ops.te.linear_bwd, (None,), tensors, 8,
                                   scalars)  # fmt: skip


@eager_cached(1024, typed=True)
def _scalar_specs(normalization, norm_eps, zero_centered_gamma, activation, glu_interleave_size,
                  limit, alpha, glu_linear_offset, out_scale, return_branch, backward_override,
                  save_original_input, overwrite_main_grad) -> tuple[str, str, str]:  # fmt: skip
    """:func:`linear`'s scalar arguments checked (each error names its argument) and encoded:
    the ``norm``, ``epilogue`` and ``backward`` strings of ``te::linear_fwd``. They depend on
    the values alone (and their types), so an eager call computes them once."""
    check_bool("te.linear", zero_centered_gamma=zero_centered_gamma, return_branch=return_branch,
               overwrite_main_grad=overwrite_main_grad)  # fmt: skip
    check_gemm_args("te.linear", norm_eps=norm_eps, glu_interleave_size=glu_interleave_size,
                    limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset,
                    out_scale=out_scale)  # fmt: skip
    check_choice("te.linear", "backward_override", backward_override, BACKWARD_OVERRIDES)
    check_choice("te.linear", "normalization", normalization, ("", *NORMALIZATIONS))
    norm = NormSpec(normalization, float(norm_eps), zero_centered_gamma) if normalization else None
    epilogue = EpilogueSpec(activation, glu_interleave_size or 0, limit, alpha,
                            glu_linear_offset, float(out_scale), return_branch)  # fmt: skip
    backward = BackwardSpec(backward_override, save_original_input, False, overwrite_main_grad)
    return norm.encode() if norm else "", epilogue.encode(), backward.encode()


def linear(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    main_grad: Tensor | None = None,
    input_spec: str | QuantSpec = "",
    weight_spec: str | QuantSpec = "",
    grad_spec: str | QuantSpec = "",
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    rng_state: Tensor | None = None,
    normalization: str = "",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    activation: str = "",
    glu_interleave_size: int | None = None,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    residual: Tensor | None = None,
    out_scale: float = 1.0,
    return_branch: bool = False,
    return_amax: bool = False,
    backward_override: str = "",
    weight_quantized: Sequence[Tensor] | None = None,
    delay_wgrad: bool = False,
    save_original_input: bool = False,
    overwrite_main_grad: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """``residual + out_scale * activation(norm(inp) @ weight.T + bias)`` through
    ``te::linear_fwd``, every part optional; by default ``inp @ weight.T + bias`` in high
    precision. The op's arguments (module docstring), unpacked: the specs as a ``QuantSpec`` or
    its string (``quantization.gemm.recipe_specs`` gives a recipe's); ``rng_state`` None draws
    one from torch's generator; ``normalization`` to ``zero_centered_gamma`` make ``norm``,
    ``activation`` to ``return_branch`` ``epilogue``, ``backward_override`` and
    ``save_original_input`` ``backward``; ``weight_quantized`` is ``weight_q``
    (:func:`~te_compile.functional.quantize_weight`'s five tensors).

    Also returned, in this order: ``branch`` (``return_branch=True``: ``inp``'s values, whose
    gradient joins the dgrad GEMM); a ``functional.family.DeferredWgrad`` (``delay_wgrad=True``:
    the backward leaves the weight-gradient GEMM out and its ``compute()`` runs it later, the
    modules' ``delay_wgrad_compute`` / ``backward_dw()``; eager only: under ``torch.compile`` no
    tensor the backward writes can leave the graph); ``[amax(X), amax(W)]``
    (``return_amax=True``, per-tensor recipes; X is the norm's output with a prologue).

    ``save_original_input=True`` (Transformer Engine's option, with a recipe): the backward keeps
    ``inp`` and quantises it again for the wgrad GEMM, the same gradients (``docs/fp8.md``).
    """
    check_weight_quantized("te.linear", "weight_quantized", weight_quantized)
    check_gemm_tensors("te.linear", inp, weight, bias, main_grad)
    args = (inp, weight, bias, main_grad)
    specs = as_strings(input_spec, weight_spec, grad_spec)
    if save_original_input:
        check_bool("te.linear", save_original_input=save_original_input)
        save_original_input = bool(specs[0])  # high precision saves the input itself anyway
    stash = None
    if delay_wgrad:
        DeferredWgrad.check("te.linear", delay_wgrad)
        n = weight.shape[0] if weight.dim() == 2 else 0
        stash = inp.new_empty((*inp.shape[:-1], out_features(n, activation)))
    # te.Linear's hot path: every argument at its default is a plain call, told without
    # encoding anything (a few us of host time per call).
    if (
        any(specs) or normalization or activation or return_branch or backward_override
        or save_original_input or stash is not None or residual is not None
        or scale is not None or grad_amax is not None or rng_state is not None
        or norm_weight is not None or norm_bias is not None or weight_quantized is not None
        or norm_eps != 1e-5 or zero_centered_gamma is not False or glu_interleave_size is not None
        or limit != 7.0 or alpha != 1.702 or glu_linear_offset != 1.0 or out_scale != 1.0
        or overwrite_main_grad is not False):  # fmt: skip
        norm, epilogue, backward = _scalar_specs(
            normalization, norm_eps, zero_centered_gamma, activation, glu_interleave_size,
            limit, alpha, glu_linear_offset, out_scale, return_branch, backward_override,
            save_original_input, overwrite_main_grad)  # fmt: skip
        check_overwrite("te.linear", overwrite_main_grad, main_grad)
        check_tensors("te.linear", scale=scale, grad_amax=grad_amax, norm_weight=norm_weight,
                      norm_bias=norm_bias, residual=residual)  # fmt: skip
        check_same_device("te.linear", "inp", inp, norm_weight=norm_weight, norm_bias=norm_bias,
                          residual=residual)  # fmt: skip
        if rng_state is None and isinstance(specs[2], str) and "sr" in specs[2].split(":"):
            rng_state = new_rng_state(inp.device)
        args += (
            *specs, scale, grad_amax, rng_state, norm, norm_weight, norm_bias, epilogue, residual,
            backward, list(weight_quantized) if weight_quantized is not None else None, stash,
        )  # fmt: skip
    out, branch, saved = _linear(*args)
    if not (return_branch or return_amax or stash is not None):
        return out
    check_bool("te.linear", return_amax=return_amax)
    result = (out, branch) if return_branch else (out,)
    if stash is not None:
        result += (_deferred(args, saved),)
    if return_amax:
        per_tensor = specs[0].startswith(PER_TENSOR)
        result += (saved[-1] if per_tensor else inp.new_empty(0, dtype=torch.float32),)
    return result
