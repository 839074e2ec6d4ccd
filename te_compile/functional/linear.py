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

* the recipe as data (``functional.spec``; ``quantization.gemm.gemm_args`` makes it from the
  autocast recipe): ``input_spec``, ``weight_spec``, ``grad_spec`` (a ``QuantSpec`` string each:
  kind, format, block rows, power-of-two scales, emulation, NVFP4's options), the delayed-scaling
  state ``scale`` ``[3]`` (input, weight, gradient) from ``te::delayed_scaling_update`` and
  ``grad_amax`` ``[1]``, into which the backward writes the gradient's amax (per-tensor recipes;
  a buffer of its own: a saved tensor must not be modified between the passes), and
  ``rng_state`` (int64 ``[2]`` ``(seed, offset)``: the Philox stream of a gradient spec's
  stochastic rounding, saved for the backward op);
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
  recipe's quantised operands and gradient; ``"high_precision"``, the forward saves the
  high-precision GEMM input (the norm's output with a prologue: the norm is then computed,
  kept and quantised, not fused into the cast) and the backward is high precision's on it and
  the weight; ``"dequantized"``, the forward saves its quantised operands dequantised to the
  input dtype and the backward is high precision's on them (the gradient is not quantised with
  either, and ``grad_amax`` is not written; a row-scaled input needs one); ``"save_input"``,
  the backward keeps ``inp`` and quantises it again (``save_original_input``).

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

Weight-gradient fusion (``main_grad``): as in Transformer Engine, a module built with
``fuse_wgrad_accumulation=True`` keeps an fp32 ``weight.main_grad`` and the backward GEMM
accumulates into it (fp32 output) instead of producing ``weight.grad``; ``te::linear_bwd``
declares it mutated, which torch.compile supports in the backward graph. Tensor parallelism
stays outside the op (``distributed.tensor_parallel``).

Pre-quantised weight (``functional.gemm``, "Pre-quantised weights"): ``weight_q``, the five
tensors ``weight_data``, ``weight_scale``, ``weight_data_t``, ``weight_scale_t``,
``weight_amax`` (with a recipe), is ``weight`` already quantised by ``te::quantize_weight``; the
op does not quantise ``weight``, saves ``weight_data_t`` / ``weight_scale_t`` for the dgrad GEMM
from its inputs (``saved`` then holds only the input's copy), and reports ``weight_amax``.
``weight`` may then be the FP8 codes themselves (FP8 primary weights, ``quantization.primary``):
its gradient must go to ``main_grad`` (the backward raises otherwise), and
``backward="high_precision"`` is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import (
    check_bool,
    check_choice,
    check_finite,
    check_required,
    check_same_device,
    check_tensors,
)
from te_compile._library import SampleInput, differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.functional.activation import (
    GATED_ACTIVATIONS,
    activation_backward,
    activation_forward,
    activation_ref,
    check_activation,
    check_gated_params,
    gated_activation_ref,
)
from te_compile.functional.dropout import new_rng_state
from te_compile.functional.gemm import (
    BACKWARD_OVERRIDES,
    BLOCK_KINDS,
    FP8_DTYPES,
    HIGH_DTYPES,
    PER_TENSOR,
    WEIGHT_OPERAND,
    DeferredWgrad,
    accumulate_wgrad,
    as_specs,
    check_gemm_args,
    check_specs,
    check_weight_operand,
    check_weight_quantized,
    empty,
    fp8_bytes,
    fp8_codes,
    gemm,
    gemm_kind,
    hp_linear,
    hp_linear_backward,
    pad_rows,
    padded,
    quantize_operand,
    quantize_weight,
    quantized_linear_ref,
    save_for_backward_except_written,
    scale_slots,
    unpad,
    weight_operand,
    wgrad_gemm,
)
from te_compile.functional.prologue import (
    NORMALIZATIONS,
    Norm,
    check_norm,
    fake_dnorm,
    fake_stats,
    norm_backward,
    norm_forward,
    norm_quantize,
    norm_ref,
    unit_rows,
)
from te_compile.functional.quantize import dequantize_blockwise
from te_compile.functional.spec import (
    BackwardSpec,
    EpilogueSpec,
    NormSpec,
    QuantSpec,
    parse,
    parse_roles,
)

__all__ = ["linear", "linear_ref"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Args(NamedTuple):
    """The forward op's arguments, by name (a call passes the first four, or all)."""

    inp: Tensor
    weight: Tensor
    bias: Tensor | None = None
    main_grad: Tensor | None = None
    input_spec: str = ""
    weight_spec: str = ""
    grad_spec: str = ""
    scale: Tensor | None = None
    grad_amax: Tensor | None = None
    rng_state: Tensor | None = None
    norm: str = ""
    norm_weight: Tensor | None = None
    norm_bias: Tensor | None = None
    epilogue: str = ""
    residual: Tensor | None = None
    backward: str = ""
    weight_q: list[Tensor] | None = None
    wgrad_stash: Tensor | None = None

    @property
    def specs(self) -> tuple[QuantSpec, QuantSpec, QuantSpec]:
        return parse_roles("te.linear", self.input_spec, self.weight_spec, self.grad_spec)

    @property
    def ep(self) -> EpilogueSpec:
        return parse(EpilogueSpec, self.epilogue, "te.linear: epilogue")

    @property
    def bw(self) -> BackwardSpec:
        return parse(BackwardSpec, self.backward, "te.linear: backward")

    @property
    def plain(self) -> bool:
        """High precision without a prologue or an epilogue: ``te.Linear``'s hot path."""
        return not (
            self.input_spec or self.weight_spec or self.grad_spec or self.norm or self.epilogue
            or self.backward or self.scale is not None or self.grad_amax is not None
            or self.rng_state is not None or self.norm_weight is not None
            or self.norm_bias is not None or self.residual is not None
            or self.weight_q is not None or self.wgrad_stash is not None
        )  # fmt: skip

    @property
    def nrm(self) -> Norm:
        n = parse(NormSpec, self.norm, "te.linear: norm")
        return Norm(self.norm_weight, self.norm_bias, n.normalization, n.eps,
                    n.zero_centered_gamma)  # fmt: skip


_NORM_WEIGHT, _RESIDUAL = _Args._fields.index("norm_weight"), _Args._fields.index("residual")


def _out_features(n: int, activation: str) -> int:
    return n // 2 if activation in GATED_ACTIVATIONS else n


# 1. Reference math --------------------------------------------------------------------------


def linear_ref(inp: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Definition of correctness in high precision: fp32 (or fp64) math, cast to the input
    dtype at the end (``functional.gemm.hp_linear``'s CPU implementation)."""
    return hp_linear(inp, weight, bias, cuda=False)


def _reference(*args):
    """The op's definition: the norm's reference, the recipe's GEMM, the epilogue, in the
    inputs' dtype (float64 in the tests)."""
    a = _Args(*args)
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


# Checks, shared by the implementations (eager) and the fakes (trace time) ---------------------


def _check_args(inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None) -> None:
    """The four tensors. One cheap compound test on the hot path (eager calls pay for it on
    every step); the per-argument diagnosis runs only when it fails, so eager and compile raise
    the same ValueError naming the argument."""
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


def _check(a: _Args) -> None:
    inp, weight = a.inp, a.weight
    if weight.dtype in FP8_DTYPES:  # FP8 primary weights: the codes stand for the weight
        if a.weight_q is None:
            raise ValueError(
                f"te.linear: an FP8 weight ({weight.dtype}) needs its pre-quantised operand "
                f"(weight_q: {', '.join(WEIGHT_OPERAND)}); its gradient goes to main_grad (fp32)"
            )
        if a.bw.override == "high_precision":
            raise ValueError(
                "te.linear: backward 'high_precision' needs a high-precision weight, got "
                f"{weight.dtype} (FP8 primary weights)"
            )
        weight = torch.empty(weight.shape, dtype=inp.dtype, device="meta")
    _check_args(inp, weight, a.bias, a.main_grad)
    if a.plain:
        return
    p = "te.linear: "
    x, w, g = a.specs
    ep, bw, norm = a.ep, a.bw, a.nrm
    recipe = check_specs(p, {"input_spec": x, "weight_spec": w, "grad_spec": g}, a.scale,
                         a.grad_amax, a.rng_state, inp)  # fmt: skip
    if x.row_scaled and not bw.override:
        raise ValueError(
            p + "a row_scaled input_spec needs backward 'high_precision' or 'dequantized' (a "
            f"row-scaled NVFP4 input has no columnwise copy), got backward={a.backward!r}"
        )
    if bw.save_input and x.four_over_six:
        raise NotImplementedError(
            p + "backward 'save_input' with 4over6 block scaling of the input is not "
            "implemented: the backward would quantise the input again without it"
        )
    if a.weight_q is not None and w.four_over_six:
        raise ValueError(
            p + "4over6 in weight_spec is for a weight the op quantises; a pre-quantised weight "
            "(weight_q) carries its own quantisation (quantize_weight's spec)"
        )
    n, k = weight.shape
    if recipe:
        if inp.dtype not in HIGH_DTYPES:
            raise ValueError(
                p + f"FP8 recipes take float32/bfloat16/float16 inputs, got {inp.dtype}"
            )
        if recipe in PER_TENSOR and (n % 16 or k % 16):
            raise ValueError(p + f"FP8 GEMMs need in_features ({k}) and out_features ({n}) to be "
                             "multiples of 16")  # fmt: skip
        block = BLOCK_KINDS.get(recipe, 0)
        m = inp.numel() // k if k else 0
        if block and (n % block or k % block or (recipe != "block" and m % block)):
            raise ValueError(
                p
                + f"{recipe} needs in_features ({k}), out_features ({n})"
                + ("" if recipe == "block" else f" and the number of tokens ({m})")
                + f" to be multiples of its block ({block})"
            )
        if recipe == "block" and not w.emulate and w.block_rows == 128 and (n % 512 or k % 512):
            raise ValueError(
                p + "native GEMMs with 128x128 weight blocks need in_features and out_features "
                f"to be multiples of 512; weight is {list(weight.shape)}"
            )
    if bw.fp8_wgrad:
        raise ValueError(p + "backward 'fp8_wgrad' is for the grouped family")
    if bw.override and not recipe:
        raise ValueError(p + "backward 'high_precision' / 'dequantized' is for a quantised recipe")
    if bw.save_input:
        if recipe == "delayed":
            raise ValueError(
                p + "backward 'save_input' (save_original_input) does not work with the "
                "delayed-scaling recipe (DelayedScaling): the backward would quantise the input "
                "again with a scale the amax-history update may have changed"
            )
        if not recipe or a.norm or bw.override == "dequantized":
            raise ValueError(
                p + "backward 'save_input' is for a quantised linear without a norm prologue and "
                f"without 'dequantized', got norm={a.norm!r}, backward={a.backward!r}"
            )
    if a.weight_q is not None:
        check_weight_quantized("te.linear", "weight_q", a.weight_q)
    check_weight_operand(p, recipe, weight, w.block_rows, w.emulate, a.weight_q or (None,) * 5)
    check_finite("te.linear", out_scale=ep.scale)
    check_norm(p, inp, norm)
    if ep.activation:
        if a.residual is not None or ep.branch:
            raise ValueError(p + "activation cannot be combined with residual or branch")
        gemm_out = torch.empty((*inp.shape[:-1], n), dtype=inp.dtype, device="meta")
        check_activation(gemm_out, a.bias, ep.activation, ep.interleave)
        check_gated_params("te.linear", ep.limit, ep.alpha, ep.offset)
    if a.wgrad_stash is not None:
        shape = (*inp.shape[:-1], _out_features(n, ep.activation))
        stash = a.wgrad_stash
        if stash.shape != shape or stash.dtype != inp.dtype or stash.device != inp.device:
            raise ValueError(
                p + f"wgrad_stash must have the output's shape {list(shape)}, inp's dtype "
                f"{inp.dtype} and device, got {list(stash.shape)} {stash.dtype} {stash.device}"
            )
    if a.residual is not None:
        shape = (*inp.shape[:-1], _out_features(n, ep.activation))
        if a.residual.shape != shape or a.residual.dtype != inp.dtype:
            raise ValueError(
                p + f"residual must have the output's shape {list(shape)} and inp's dtype "
                f"{inp.dtype}, got {list(a.residual.shape)} {a.residual.dtype}"
            )


# 2. Forward op ------------------------------------------------------------------------------


def _forward(a: _Args, cuda: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    _check(a)
    inp, weight, bias = a.inp, a.weight, a.bias
    ep = a.ep
    dtype, n = inp.dtype, weight.shape[0]
    branch = inp.clone(memory_format=torch.contiguous_format) if ep.branch else empty(inp)
    if a.plain:  # te.Linear in high precision: the hot path
        return hp_linear(inp, weight, bias, cuda), branch, []
    x2 = inp.reshape(-1, inp.shape[-1])
    m, acc = x2.shape[0], None
    saved, stats, amax = [], [], []
    fuse_bias = bias if not ep.activation else None
    xs, ws, _ = a.specs
    recipe, norm = xs.kind, a.nrm
    if not recipe:
        acc = None if cuda else acc_dtype(inp)
        if norm.normalization:
            x2, *stats = norm_forward(x2, norm)
            saved.append(x2)
        if cuda and a.residual is not None:  # one GEMM with the residual in its epilogue
            out = torch.addmm(a.residual.reshape(-1, n), x2, weight.t(), alpha=ep.scale)
            if bias is not None:
                out.add_(bias, alpha=ep.scale)
            return out.reshape(a.residual.shape), branch, saved + stats
        c = (lambda t: t) if acc is None else (lambda t: None if t is None else t.to(acc))
        h = gemm("mm", c(x2), None, c(weight), None, dtype, bias=c(fuse_bias))
    else:
        bw = a.bw
        override = bw.override
        s_x, s_w, _ = scale_slots(a.scale, recipe)
        if norm.normalization and override == "high_precision":  # the norm's output is kept
            x2, *stats = norm_forward(x2, norm)
            xq = quantize_operand(xs, pad_rows(x2), scale=s_x)
        elif norm.normalization:
            xq, *stats = norm_quantize(xs, x2, norm, scale=s_x)
        else:  # save_input: the backward quantises the input again for the wgrad
            xq = quantize_operand(xs, pad_rows(x2), scale=s_x, columnwise=not bw.save_input)
        if a.weight_q is not None:  # pre-quantised: the saved copy is an input's
            wq = weight_operand(a.weight_q, ws.fp8_dtype)
        else:
            wq = quantize_operand(ws, weight, scale=s_w)
        h = gemm(gemm_kind(recipe, xs.emulate), xq.data, xq.scale, wq.data, wq.scale, dtype,
                 bias=fuse_bias, fast_accum=True, b_block_rows=ws.block_rows)  # fmt: skip
        h = unpad(h, m)
        if override == "high_precision":  # the GEMM input in high precision, with a norm
            saved = [x2] if norm.normalization else []
        elif override == "dequantized":  # the forward's operands, dequantised
            saved = [_dequantized(xs, xq, m, dtype), _dequantized(ws, wq, n, dtype)]
        else:
            if bw.save_input:  # the input itself is saved instead of its copy
                f32 = torch.float32
                x_slots = [x2.new_empty(0, dtype=fp8_bytes(wq.data_t).dtype),
                           x2.new_empty(0, dtype=f32)]  # fmt: skip
            else:
                x_slots = [fp8_bytes(xq.data_t), xq.scale_t]
            # A pre-quantised weight's copies are inputs: setup_context saves them.
            w_slots = [] if a.weight_q is not None else [fp8_bytes(wq.data_t), wq.scale_t]
            saved = [*x_slots, *w_slots]
        if recipe in PER_TENSOR:
            amax = [torch.cat([xq.amax, wq.amax])]
    y = h
    if ep.activation:
        b = bias if acc is None or bias is None else bias.to(acc)
        y = activation_forward(h, b, ep.activation, *ep.params)
        saved.append(h)
    if a.residual is not None:
        r = a.residual.reshape(y.shape)
        y = r.to(acc) + ep.scale * y if acc else torch.add(r, y, alpha=ep.scale)
    elif ep.scale != 1.0:
        y = y * ep.scale
    out = y.to(dtype).reshape(*inp.shape[:-1], y.shape[-1])
    return out, branch, saved + stats + amax


def _dequantized(spec: QuantSpec, q, rows: int, dtype) -> Tensor:
    """The rowwise operand ``q`` (what the forward GEMM multiplied) dequantised to ``dtype``,
    its first ``rows`` rows (backward ``"dequantized"``)."""
    if gemm_kind(spec.kind, spec.emulate) == "dequantized":  # the dequantised fp32 values
        values = q.data
    elif spec.kind in PER_TENSOR:
        values = q.data.float() * q.scale
    else:
        u8, f32 = torch.uint8, torch.float32
        values = dequantize_blockwise.eager(q.data.view(u8), q.scale, spec.block_rows,
                                            spec.fp8_dtype, f32)  # fmt: skip
    # A copy where the values are the operand's own tensor (an output may not alias another).
    return values[:rows].to(dtype, copy=values is q.data)


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
    """``(out, branch, saved)`` (module docstring). The default (CPU) implementation computes
    high precision in fp32 (fp64 stays fp64), rounded once."""
    a = _Args(inp, weight, bias, main_grad, input_spec, weight_spec, grad_spec, scale, grad_amax,
              rng_state, norm, norm_weight, norm_bias, epilogue, residual, backward, weight_q,
              wgrad_stash)  # fmt: skip
    if a.plain:
        return _plain_forward(inp, weight, bias, main_grad, cuda=False)
    return _forward(a, cuda=False)


def _plain_forward(inp, weight, bias, main_grad, cuda: bool) -> tuple[Tensor, Tensor, list]:
    """te.Linear's hot path: high precision, no prologue or epilogue (cheap to enter)."""
    _check_args(inp, weight, bias, main_grad)
    return hp_linear(inp, weight, bias, cuda), inp.new_empty(0), []


@linear_fwd.register_kernel("cuda")
def _linear_fwd_cuda(*args):
    if len(args) == 4:  # the eager fast path passes only the tensors of a plain call
        return _plain_forward(*args, cuda=True)
    return _forward(_Args(*args), cuda=True)


# 3. Fake ------------------------------------------------------------------------------------


@linear_fwd.register_fake
def _linear_fwd_fake(*args):
    a = _Args(*args)
    _check(a)
    inp, weight = a.inp, a.weight
    ep = a.ep
    n, k = weight.shape
    rows = inp.numel() // k if k else 0
    out = inp.new_empty((*inp.shape[:-1], _out_features(n, ep.activation)))
    branch = inp.new_empty(inp.shape) if ep.branch else empty(inp)
    if a.plain:
        return out, branch, []
    f32, u8 = torch.float32, torch.uint8
    saved = []
    xs, ws, _ = a.specs
    recipe, override, normalized = xs.kind, a.bw.override, bool(a.nrm.normalization)
    if override == "high_precision":
        saved = [inp.new_empty(rows, k)] if normalized else []
    elif override == "dequantized":
        saved = [inp.new_empty(rows, k), inp.new_empty(n, k)]
    elif recipe:
        m = padded(rows)
        kind = gemm_kind(recipe, xs.emulate)
        if kind == "dequantized":
            saved = [inp.new_empty(k, m, dtype=f32), inp.new_empty(0, dtype=f32),
                     inp.new_empty(k, n, dtype=f32), inp.new_empty(0, dtype=f32)]  # fmt: skip
        elif recipe in PER_TENSOR:
            one = inp.new_empty(1, dtype=f32)
            saved = [inp.new_empty(k, m, dtype=u8), one, inp.new_empty(k, n, dtype=u8), one.clone()]
        else:
            w_rows = ws.block_rows
            saved = [inp.new_empty(k, m, dtype=u8), inp.new_empty(k, -(-m // 128), dtype=f32),
                     inp.new_empty(k, n, dtype=u8),
                     inp.new_empty(-(-k // w_rows), -(-n // 128), dtype=f32)]  # fmt: skip
        if a.bw.save_input:  # the input's slots: 0-element (the input itself is saved)
            saved[:2] = [inp.new_empty(0, dtype=saved[0].dtype), inp.new_empty(0, dtype=f32)]
        if a.weight_q is not None:  # the weight's copies are inputs (setup_context)
            saved = saved[:2]
    elif normalized:
        saved = [inp.new_empty(rows, k)]
    if ep.activation:
        h_dtype = acc_dtype(inp) if not recipe and inp.device.type == "cpu" else inp.dtype
        saved.append(inp.new_empty(rows, n, dtype=h_dtype))
    saved += fake_stats(inp, rows, a.nrm.normalization)
    if recipe in PER_TENSOR:
        saved.append(inp.new_empty(2, dtype=f32))
    return out, branch, saved


# 4. Backward op -----------------------------------------------------------------------------


class _Bwd(NamedTuple):
    """The backward op's arguments after the tensors, parsed."""

    x: QuantSpec
    w: QuantSpec
    g: QuantSpec
    norm: NormSpec
    ep: EpilogueSpec
    need_dbias: bool
    need_dgrad: bool
    need_wgrad: bool

    @classmethod
    def of(cls, input_spec, weight_spec, grad_spec, norm, epilogue, *need) -> _Bwd:
        return cls(*as_specs(input_spec, weight_spec, grad_spec), parse(NormSpec, norm),
                   parse(EpilogueSpec, epilogue), *need)  # fmt: skip

    @property
    def recipe(self) -> str:
        return self.x.kind


def _split_saved(saved: list[Tensor], c: _Bwd) -> tuple[list, Tensor | None, Tensor | None, list]:
    """``(quantised copies [4] or [], high-precision GEMM input or None, GEMM output before the
    activation or None, norm statistics)``."""
    normalized, act = bool(c.norm.normalization), bool(c.ep.activation)
    i = 4 if c.recipe else int(normalized)
    copies = saved[:4] if c.recipe else []
    x_hp = saved[0] if not c.recipe and normalized else None
    h = saved[i] if act else None
    stats = saved[i + act :]
    return copies, x_hp, h, stats


def _backward_impl(grad, grad_branch, saved, inp, weight, bias, main_grad, scale, grad_amax,
                   norm_weight, rng_state, c: _Bwd, cuda: bool):  # fmt: skip
    dtype = grad.dtype
    ep, normalization = c.ep, c.norm.normalization
    copies, x_hp, h, stats = _split_saved(saved, c)
    if copies and c.need_wgrad and copies[0].numel() == 0 and inp is not None and inp.numel():
        # save_input: the input's quantised transposed copy, made again here.
        x2 = inp.reshape(-1, inp.shape[-1])
        xq = quantize_operand(c.x, pad_rows(x2), scale=scale_slots(scale, c.recipe)[0])
        copies = [fp8_bytes(xq.data_t), xq.scale_t, *copies[2:]]
    g2 = grad.reshape(-1, grad.shape[-1])
    m = g2.shape[0]
    acc = None if c.recipe or cuda else acc_dtype(grad)
    dy = g2 if acc is None else g2.to(acc)
    if ep.scale != 1.0:
        dy = dy * ep.scale
    dbias = empty(grad)
    native_block = c.recipe == "block" and not c.x.emulate
    if ep.activation:
        b = bias if acc is None or bias is None else bias.to(acc)
        dy, db = activation_backward(dy, h, b, ep.activation, *ep.params, c.need_dbias)
        if c.need_dbias:
            dbias = db.to(dtype)
    elif c.need_dbias and not native_block:
        dbias = dy.sum(0) if cuda and not c.recipe else dy.sum(0, dtype=acc or torch.float32)
        dbias = dbias.to(dtype)
    b2 = None if grad_branch is None else grad_branch.reshape(-1, grad_branch.shape[-1])
    fused_branch = b2 is not None and not c.recipe and not normalization
    dinp, dweight = None, empty(grad)
    if not c.recipe:
        x2 = x_hp if x_hp is not None else inp.reshape(-1, inp.shape[-1])
        cast = (lambda t: t) if acc is None else (lambda t: t.to(acc))
        if c.need_dgrad:
            w = cast(weight)
            dinp = torch.addmm(cast(b2), dy, w) if fused_branch else dy @ w
            dinp = dinp.to(dtype)
        if c.need_wgrad and main_grad is not None:
            accumulate_wgrad(main_grad, dy, x2)
        elif c.need_wgrad:
            dweight = (dy.t() @ cast(x2)).to(dtype)
    else:
        dinp, dweight, db = _quantized_backward(dy, copies, main_grad, scale, grad_amax,
                                                rng_state, c, m)  # fmt: skip
        if db is not None:
            dbias = db.to(dtype)
    dnorm = [empty(grad), empty(grad)]
    if dinp is not None:
        if normalization:
            x2 = inp.reshape(-1, inp.shape[-1])
            dinp, *dnorm = norm_backward(dinp, x2, norm_weight, stats, normalization,
                                         c.norm.zero_centered_gamma, c.norm.bias)  # fmt: skip
        if b2 is not None and not fused_branch:
            dinp = dinp + b2
        dinp = dinp.reshape(*grad.shape[:-1], dinp.shape[-1])
    return dinp if dinp is not None else empty(grad), dweight, dbias, *dnorm


def _quantized_backward(dy, copies, main_grad, scale, grad_amax, rng_state, c: _Bwd, m: int):
    """``(dinp 2-D or None, dweight, dbias or None)`` of a quantised recipe's GEMMs; ``dbias``
    only where the gradient's quantisation sums it (native blockwise)."""
    x_t, x_st, w_t, w_st = copies
    dtype = dy.dtype
    kind = gemm_kind(c.recipe, c.x.emulate)
    sums = c.need_dbias and kind == "blockwise" and not c.ep.activation
    _, _, s_g = scale_slots(scale, c.recipe)
    g = quantize_operand(c.g, pad_rows(dy), scale=s_g, columnwise=c.need_wgrad, mn_major=True,
                         sums=sums, rng_state=rng_state)  # fmt: skip
    if grad_amax is not None:
        grad_amax.copy_(g.amax)
    dinp = None
    if c.need_dgrad:  # dX [M, K] = dY [M, N] @ W [N, K]; W^T [K, N] is the GEMM's b
        dinp = gemm(kind, g.data, g.scale, fp8_codes(w_t, c.w.fp8_dtype), w_st, dtype,
                    b_block_rows=c.w.block_rows)  # fmt: skip
        dinp = unpad(dinp, m)
    dweight = empty(dy)
    if c.need_wgrad:  # dW [N, K] = dY^T [N, M] @ X [M, K]; X^T [K, M] is the GEMM's b
        dweight = wgrad_gemm(kind, g.data_t, g.scale_t, fp8_codes(x_t, c.x.fp8_dtype), x_st, dtype,
                             main_grad)  # fmt: skip
    return dinp, dweight, g.sums


@op(
    "linear_bwd",
    mutates_args=("main_grad", "grad_amax", "wgrad_stash"),
)
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
    ``DeferredWgrad``). Default (CPU): high precision in fp32 (fp64 stays fp64), each gradient
    rounded once."""
    if wgrad_stash is not None:
        wgrad_stash.copy_(grad)
        need_wgrad = False
    if not (input_spec or norm or epilogue) and grad_branch is None:
        return (*hp_linear_backward(grad, inp, weight, main_grad, need_dbias, need_dgrad,
                                    need_wgrad, cuda=False), empty(grad), empty(grad))  # fmt: skip
    c = _Bwd.of(input_spec, weight_spec, grad_spec, norm, epilogue, need_dbias, need_dgrad,
                need_wgrad)  # fmt: skip
    return _backward_impl(grad, grad_branch, saved, inp, weight, bias, main_grad, scale,
                          grad_amax, norm_weight, rng_state, c, cuda=False)  # fmt: skip


_BWD_TENSORS = 11  # grad, grad_branch, saved, inp, weight, bias, main_grad, scale, grad_amax,
# norm_weight, rng_state
_BWD_SCALARS = 8  # the specs, norm, epilogue, need_dbias, need_dgrad, need_wgrad


def _bwd_args(args: tuple) -> tuple[tuple, tuple, Tensor | None]:
    """The tensors, the strings and flags, and ``wgrad_stash`` of a ``linear_bwd`` call."""
    n, end = _BWD_TENSORS, _BWD_TENSORS + _BWD_SCALARS
    return args[:n], args[n:end], args[end] if len(args) > end else None


@linear_bwd.register_kernel("cuda")
def _linear_bwd_cuda(*args):
    tensors, scalars, stash = _bwd_args(args)
    need_wgrad = scalars[-1]
    if stash is not None:
        stash.copy_(tensors[0])
        need_wgrad = False
    input_spec, _, _, norm, epilogue, need_dbias, need_dgrad, _ = scalars
    if not (input_spec or norm or epilogue) and tensors[1] is None:
        grad, _, _, inp, weight, _, main_grad = tensors[:7]
        return (*hp_linear_backward(grad, inp, weight, main_grad, need_dbias, need_dgrad,
                                    need_wgrad, cuda=True), empty(grad), empty(grad))  # fmt: skip
    c = _Bwd.of(*scalars[:-1], need_wgrad)
    return _backward_impl(*tensors, c, cuda=True)


@linear_bwd.register_fake
def _linear_bwd_fake(*args):
    (grad, _, saved, _, weight, _, main_grad, *_, norm_weight, _), scalars, stash = _bwd_args(args)
    c = _Bwd.of(*scalars)
    need_wgrad = c.need_wgrad and stash is None
    n, k = weight.shape if weight is not None else saved[2].shape[::-1]
    dinp = grad.new_empty(*grad.shape[:-1], k) if c.need_dgrad else empty(grad)
    want_dw = need_wgrad and main_grad is None
    dweight = grad.new_empty(n, k) if want_dw else empty(grad)
    dbias = grad.new_empty(n) if c.need_dbias else empty(grad)
    dnorm = fake_dnorm(grad, norm_weight, c.norm.normalization, c.norm.bias, c.need_dgrad)
    return dinp, dweight, dbias, *dnorm


# 5. setup_context + autograd ------------------------------------------------------------------


_PLAIN_SCALARS = ("", "", "", "", "")  # the specs, norm and epilogue of a plain call


def _setup_context(ctx, inputs, output) -> None:
    if len(inputs) == 4:  # a plain call (the eager fast path passes the tensors only)
        inp, weight, bias, main_grad = inputs
        ctx.mark_non_differentiable(output[1])  # no branch: no gradient to make for it
        # (inp, weight, bias, main_grad, scale, grad_amax, norm_weight, rng_state, stash)
        save_for_backward_except_written(
            ctx, (inp, weight, None, main_grad, None, None, None, None, None), _WRITTEN
        )
        ctx.scalars, ctx.has_bias = _PLAIN_SCALARS, bias is not None
        ctx.branch = ctx.has_norm = False
        return
    a = _Args(*inputs)
    _out, branch, saved = output
    ep = a.ep
    ctx.mark_non_differentiable(*saved, *(() if ep.branch else (branch,)))
    tensors, ctx.scalars = _for_backward(a, saved)
    save_for_backward_except_written(ctx, (*tensors, a.wgrad_stash), _WRITTEN)
    ctx.has_bias, ctx.branch = a.bias is not None, ep.branch
    ctx.has_norm = bool(a.nrm.normalization)
    ctx.fp8_weight = a.weight.dtype in FP8_DTYPES and a.main_grad is None


# Positions of main_grad and grad_amax in the backward's tensors (_for_backward): the buffers
# the backward writes into (functional.gemm.save_for_backward_except_written).
_WRITTEN = (3, 5)


def _for_backward(a: _Args, saved: list[Tensor]) -> tuple[tuple, tuple]:
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
    keep_inp = hp or normed or a.bw.save_input
    if override == "dequantized":
        x_deq, weight, *saved = saved
        if normed:  # the norm's backward takes the input, the wgrad GEMM the saved operand
            saved = [x_deq, *saved]
        else:
            inp = x_deq
    tensors = (
        inp if keep_inp else None,
        weight if hp else None,
        a.bias if a.ep.activation else None,
        a.main_grad, a.scale, a.grad_amax,
        a.norm_weight if normed else None,
        a.rng_state,
        *saved,
    )  # fmt: skip
    specs = ("", "", "") if override else (a.input_spec, a.weight_spec, a.grad_spec)
    norm = a.norm
    if normed and a.norm_bias is not None:
        norm = replace(parse(NormSpec, norm), bias=True).encode()
    return tensors, (*specs, norm, a.epilogue)


def _backward(ctx, bwd, grad, grad_branch, _grad_saved):
    inp, weight, bias, _, scale, _, norm_weight, rng_state, *saved, stash = ctx.saved_tensors
    main_grad, grad_amax = ctx.written
    need = ctx.needs_input_grad
    if need[1] and getattr(ctx, "fp8_weight", False):
        raise RuntimeError(
            "te.linear: an FP8 weight's gradient goes to main_grad (fp32), and none was given"
        )
    need_norm = ctx.has_norm and any(need[_NORM_WEIGHT : _NORM_WEIGHT + 2])
    need_dbias = ctx.has_bias and need[2]
    need_dgrad = need[0] or need_norm
    grad_branch = grad_branch.contiguous() if ctx.branch and grad_branch is not None else None
    dinp, dweight, dbias, *dnorm = bwd(
        grad.contiguous(), grad_branch, saved, inp, weight, bias, main_grad, scale, grad_amax,
        norm_weight, rng_state, *ctx.scalars, need_dbias, need_dgrad, need[1],
        *(() if stash is None else (stash,)),
    )  # fmt: skip
    grads = [None] * len(need)
    grads[0] = dinp if need[0] else None
    grads[1] = dweight if need[1] and main_grad is None and stash is None else None
    grads[2] = dbias if need_dbias else None
    if need_norm:  # (a call passes no trailing argument left at its default)
        for i, d in zip(range(_NORM_WEIGHT, min(len(need), _NORM_WEIGHT + 2)), dnorm, strict=False):
            grads[i] = d if need[i] else None
    if len(need) > _RESIDUAL and need[_RESIDUAL]:
        grads[_RESIDUAL] = grad
    return tuple(grads)


def _call(inp, weight, bias=None, main_grad=None, **kw) -> SampleInput:
    """A sample: the four tensors, or every argument when any other is given."""
    if not kw:
        return SampleInput((inp, weight, bias, main_grad))
    return SampleInput(tuple(_Args(inp, weight, bias, main_grad, **kw)))


def _specs(x: str, w: str | None = None, g: str | None = None) -> dict[str, str]:
    """The three specs (the weight's as the input's, the gradient's E5M2 unless given)."""
    return {"input_spec": x, "weight_spec": x if w is None else w,
            "grad_spec": x.replace("e4m3", "e5m2") if g is None else g}  # fmt: skip


def _samples(device: torch.device):
    def t(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    bf16, fp16 = torch.bfloat16, torch.float16
    # High precision.
    yield _call(t(5, 16), t(8, 16), t(8))
    yield _call(t(2, 3, 16), t(24, 16))
    yield _call(t(7, 32, dtype=bf16), t(12, 32, dtype=bf16), t(12, dtype=bf16))
    yield _call(t(3, 4, 8, dtype=fp16), t(6, 8, dtype=fp16), t(6, dtype=fp16))
    # Input that needs no gradient (first layer), weight gradient into main_grad.
    yield _call(t(6, 16, grad=False), t(4, 16), t(4), torch.zeros(4, 16, device=device))
    # Epilogues in high precision: bias + activation (gated ones, interleaved GLU layout, a
    # clamped SwiGLU whose limit cuts), residual add with a scale, a branch output.
    yield _call(t(5, 16), t(24, 16), t(24), epilogue="act=gelu")
    yield _call(t(2, 3, 16, dtype=bf16), t(32, 16, dtype=bf16), epilogue="act=relu")
    yield _call(t(7, 32, dtype=bf16), t(16, 32, dtype=bf16), t(16, dtype=bf16),
                epilogue="act=swiglu:interleave=4")  # fmt: skip
    yield _call(t(6, 16, grad=False), t(16, 16), t(16), torch.zeros(16, 16, device=device),
                epilogue="act=clamped_swiglu:interleave=2:limit=0.75:offset=0.5")  # fmt: skip
    yield _call(t(5, 16), t(24, 16), t(24), residual=t(5, 24))
    yield _call(t(2, 3, 16, dtype=bf16), t(8, 16, dtype=bf16), residual=t(2, 3, 8, dtype=bf16),
                epilogue="scale=0.5")  # fmt: skip
    yield _call(t(6, 16, grad=False), t(8, 16), t(8), torch.zeros(8, 16, device=device),
                residual=t(6, 8), epilogue="scale=-2.0")  # fmt: skip
    yield _call(t(5, 16), t(24, 16), t(24), epilogue="branch")
    yield _call(t(4, 8, dtype=fp16), t(12, 8, dtype=fp16), t(12, dtype=fp16), epilogue="branch")
    yield _call(t(6, 16), t(8, 16), t(8), torch.zeros(8, 16, device=device), epilogue="branch")
    # A norm prologue in high precision (LayerNorm, zero-centred gamma).
    yield _call(t(2, 5, 16), t(8, 16), t(8), norm_weight=t(16), norm_bias=t(16),
                norm="LayerNorm:zero_centered")  # fmt: skip
    # Per-tensor FP8. 10 tokens: padded to 16 inside the ops.
    cur = _specs("current:e4m3")
    yield _call(t(32, 16, dtype=bf16), t(16, 16, dtype=bf16), t(16, dtype=bf16), **cur)
    yield _call(t(2, 5, 16, dtype=bf16), t(32, 16, dtype=bf16), t(32, dtype=bf16), **cur)
    scale = torch.tensor([8.0, 16.0, 1.0], device=device)
    pending = torch.zeros(1, device=device)
    delayed = _specs("delayed:e4m3")
    yield _call(t(2, 16, 32, dtype=bf16), t(48, 32, dtype=bf16), **delayed, scale=scale,
                grad_amax=pending)  # fmt: skip
    yield _call(t(16, 32), t(16, 32), None, torch.zeros(16, 32, device=device),
                **_specs("current:e4m3", g="current:e4m3"))  # fmt: skip
    # float32 with a bias: _scaled_mm refuses a bias with an fp32 output (added after it).
    yield _call(t(16, 32), t(32, 32), t(32), **cur)
    # Norm prologues: inputs whose norm is exact in fp32 and float64 alike (``unit_rows``; the
    # FP8 codes of a computed value one fp32 rounding from a code boundary would differ).
    yield _call(unit_rows(2, 5, 32, device=device), t(16, 32), t(16), **cur, norm_weight=t(32),
                norm_bias=torch.zeros(32, device=device, requires_grad=True),
                norm="LayerNorm:eps=1e-30")  # fmt: skip
    yield _call(unit_rows(16, 32, device=device), t(32, 32), **delayed, scale=scale.clone(),
                grad_amax=pending.clone(), norm_weight=t(32), norm="RMSNorm:eps=1e-30")  # fmt: skip
    # FP8 with an epilogue: bias + GELU, residual add, branch.
    yield _call(t(32, 16), t(32, 16), t(32), **cur, epilogue="act=gelu")
    yield _call(t(2, 8, 32), t(16, 32), t(16), **cur, residual=t(2, 8, 16), epilogue="scale=2.0")
    yield _call(t(16, 32), t(16, 32), None, **cur, epilogue="branch")
    # Block-scaled recipes, emulated: MXFP8 (E5M2 gradients in fp32), NVFP4, Float8BlockScaling
    # with 1x128 activations (a partial block: K=144) and 128x128 weight tiles.
    mx = _specs("mxfp8:e4m3:emulate", g="mxfp8:e4m3:emulate")
    yield _call(t(32, 64, dtype=bf16), t(32, 64, dtype=bf16), t(32, dtype=bf16), **mx)
    yield _call(t(2, 16, 32), t(64, 32), **_specs("mxfp8:e4m3:emulate"))
    nv = _specs("nvfp4:emulate")
    yield _call(t(16, 32, dtype=bf16), t(48, 32, dtype=bf16), t(48, dtype=bf16), **nv)
    yield _call(t(32, 144, dtype=bf16), t(160, 144, dtype=bf16),
                **_specs("block:e4m3:p2:emulate", "block:e4m3:128x128:p2:emulate",
                         "block:e4m3:p2:emulate"))  # fmt: skip
    # Native blockwise (its GEMMs emulated off CUDA), a bias, 1x128 weight blocks, main_grad.
    blk = _specs("block:e4m3", "block:e4m3:128x128", "block:e4m3")
    yield _call(t(32, 512, dtype=bf16), t(512, 512, dtype=bf16), t(512, dtype=bf16), **blk)
    blk_p2 = _specs("block:e4m3:p2", g="block:e4m3:p2")
    yield _call(t(48, 256, dtype=bf16), t(32, 256, dtype=bf16), None,
                torch.zeros(32, 256, device=device), **blk_p2)  # fmt: skip
    # Norm prologues: native blockwise with RMSNorm, emulated MXFP8 with LayerNorm.
    yield _call(unit_rows(32, 512, device=device), t(512, 512), t(512), **blk, norm_weight=t(512),
                norm="RMSNorm:eps=1e-30")  # fmt: skip
    yield _call(unit_rows(32, 64, device=device), t(32, 64), **mx, norm_weight=t(64),
                norm_bias=torch.zeros(64, device=device, requires_grad=True),
                norm="LayerNorm:eps=1e-30")  # fmt: skip
    # save_input: the input itself saved, its transposed copy quantised in the backward
    # (per-tensor current scaling, in bf16 and with GELU; emulated MXFP8; native blockwise).
    yield _call(t(2, 16, 32, dtype=bf16), t(32, 32, dtype=bf16), t(32, dtype=bf16), **cur,
                backward="save_input")  # fmt: skip
    yield _call(t(2, 16, 32), t(32, 32), t(32), **cur, epilogue="act=gelu", backward="save_input")
    yield _call(t(32, 64), t(32, 64), t(32), **mx, backward="save_input")
    yield _call(t(32, 512, dtype=bf16), t(512, 512, dtype=bf16), None, **blk,
                backward="save_input")  # fmt: skip
    # Backward overrides: high-precision backward GEMMs on the forward's high-precision operands
    # (the norm's output saved) or on its dequantised FP8 operands.
    yield _call(unit_rows(2, 8, 32, device=device), t(16, 32), t(16), **cur, norm_weight=t(32),
                norm="RMSNorm:eps=1e-30", epilogue="act=gelu",
                backward="high_precision")  # fmt: skip
    yield _call(t(20, 32, dtype=bf16), t(16, 32, dtype=bf16), t(16, dtype=bf16), **cur,
                backward="dequantized")  # fmt: skip
    yield _call(unit_rows(32, 64, device=device), t(32, 64), **mx, norm_weight=t(64),
                norm="LayerNorm:eps=1e-30", backward="dequantized")  # fmt: skip
    yield _call(t(32, 512, dtype=bf16), t(512, 512, dtype=bf16), None,
                torch.zeros(512, 512, device=device), **blk, backward="dequantized")  # fmt: skip
    yield _call(t(16, 32), t(48, 32), **nv, backward="high_precision")
    # NVFP4's recipe options: 16x16 weight tiles, the random Hadamard transform of the wgrad
    # GEMM's operands, stochastic rounding of the gradient (a fixed stream); with a norm.
    rng = torch.tensor([3, 5], device=device)
    yield _call(t(32, 48, dtype=bf16), t(32, 48, dtype=bf16), t(32, dtype=bf16),
                **_specs("nvfp4:emulate:rht", "nvfp4:16x16:emulate", "nvfp4:emulate:rht:sr"),
                rng_state=rng)  # fmt: skip
    yield _call(unit_rows(16, 32, device=device), t(48, 32),
                **_specs("nvfp4:emulate:rht", "nvfp4:emulate", "nvfp4:emulate:rht:sr"),
                norm_weight=t(32), norm="RMSNorm:eps=1e-30", rng_state=rng.clone())  # fmt: skip
    yield _call(t(32, 32), t(16, 32), t(16),
                **_specs("nvfp4:emulate:row_scaled", "nvfp4:16x16:emulate", "nvfp4:emulate"),
                backward="dequantized")  # fmt: skip
    # 4over6 block scaling of the input (with the transform of its wgrad copy) and of the
    # weight's 16x16 tiles.
    yield _call(t(32, 48, dtype=bf16), t(32, 48, dtype=bf16),
                **_specs("nvfp4:emulate:rht:4over6=MAE/448",
                         "nvfp4:16x16:emulate:4over6=MSE/256", "nvfp4:emulate:rht"))  # fmt: skip

    # A pre-quantised weight (functional.gemm.quantize_weight): per tensor, delayed (its weight
    # slot), native blockwise with 128x128 blocks, emulated MXFP8, with a dequantised backward.
    def pre(w, specs, scale=None, **kw):
        q = quantize_weight(w.detach(), specs["weight_spec"], scale)
        return dict(**specs, weight_q=q, scale=scale, **kw)

    w = t(32, 16, dtype=bf16)
    yield _call(t(2, 5, 16, dtype=bf16), w, t(32, dtype=bf16), **pre(w, cur))
    w = t(48, 32)
    yield _call(t(16, 32), w, None, torch.zeros(48, 32, device=device),
                **pre(w, delayed, scale=scale.clone(), grad_amax=pending.clone()))  # fmt: skip
    w = t(512, 512, dtype=bf16)
    yield _call(t(32, 512, dtype=bf16), w, **pre(w, blk))
    w = t(32, 64)
    yield _call(t(32, 64), w, t(32), **pre(w, mx))
    w = t(16, 32, dtype=bf16)
    yield _call(t(20, 32, dtype=bf16), w, **pre(w, cur, backward="dequantized"))


_linear = differentiable(
    linear_fwd,
    linear_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=_reference,
    # Plain high precision without main_grad: both implementations are differentiable torch ops
    # (CUDA: F.linear; CPU: fp32 F.linear between casts) whose autograd computes exactly
    # te::linear_bwd's GEMMs.
    native_autograd=lambda *args: len(args) == 4 and args[3] is None,
)


# Public function ------------------------------------------------------------------------------


def _deferred(args: tuple, saved: list[Tensor]) -> DeferredWgrad:
    a = _Args(*args)
    tensors, scalars = _for_backward(a, saved)

    def replay(grad: Tensor) -> Tensor | None:
        inp, weight, bias, main_grad, scale, grad_amax, norm_weight, rng_state, *saved = tensors
        if grad_amax is not None:  # the backward recorded amax(dY) already: not twice
            grad_amax = torch.zeros_like(grad_amax)
        _, dweight, *_ = torch.ops.te.linear_bwd(
            grad, None, saved, inp, weight, bias, main_grad, scale, grad_amax, norm_weight,
            rng_state, *scalars, False, False, True,
        )  # fmt: skip
        return None if main_grad is not None else dweight

    return DeferredWgrad.create(a.wgrad_stash, replay)


_SCALAR_SPECS: dict[tuple, tuple[str, str, str]] = {}


def _scalar_specs(normalization, norm_eps, zero_centered_gamma, activation, glu_interleave_size,
                  limit, alpha, glu_linear_offset, out_scale, return_branch, backward_override,
                  save_original_input) -> tuple[str, str, str]:  # fmt: skip
    """:func:`linear`'s scalar arguments checked (each error names its argument) and encoded:
    the ``norm``, ``epilogue`` and ``backward`` strings of ``te::linear_fwd``. They depend on
    the values alone, so an eager call looks them up (``_SCALAR_SPECS``)."""
    check_bool("te.linear", zero_centered_gamma=zero_centered_gamma,
               return_branch=return_branch)  # fmt: skip
    check_gemm_args(
        "te.linear", {}, norm_eps=norm_eps, glu_interleave_size=glu_interleave_size, limit=limit,
        alpha=alpha, glu_linear_offset=glu_linear_offset, out_scale=out_scale,
    )  # fmt: skip
    check_choice("te.linear", "backward_override", backward_override, BACKWARD_OVERRIDES)
    if normalization not in ("", *NORMALIZATIONS):
        raise ValueError('te.linear: normalization must be "", "LayerNorm" or "RMSNorm", '
                         f"got {normalization!r}")  # fmt: skip
    norm = NormSpec(normalization, float(norm_eps), zero_centered_gamma) if normalization else None
    epilogue = EpilogueSpec(activation, glu_interleave_size or 0, limit, alpha,
                            glu_linear_offset, float(out_scale), return_branch)  # fmt: skip
    backward = BackwardSpec(backward_override, save_original_input)
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
) -> Tensor | tuple[Tensor, ...]:
    """``residual + out_scale * activation(norm(inp) @ weight.T + bias)`` through
    ``te::linear_fwd``, every part optional (module docstring); by default ``inp @ weight.T +
    bias`` in high precision.

    ``main_grad`` (fp32, weight's shape): the weight gradient is accumulated into it and
    ``weight.grad`` is left untouched. ``input_spec`` / ``weight_spec`` / ``grad_spec``: the
    quantisation of each operand (``functional.spec.QuantSpec`` or its string, e.g.
    ``"current:e4m3"``; ``quantization.gemm.recipe_specs`` gives a recipe's), with the delayed
    scales ``scale``, the gradient's amax buffer ``grad_amax`` and ``rng_state`` (int64 ``(seed,
    offset)`` of a gradient spec's stochastic rounding; None draws one from torch's
    generator). ``return_branch=True`` also returns ``branch``, a tensor with ``inp``'s values
    whose gradient joins the dgrad GEMM; ``return_amax=True`` also returns ``[amax(X),
    amax(W)]`` (per-tensor recipes; X is the norm's output with a prologue), last.
    ``backward_override`` (with a recipe): ``"high_precision"`` or ``"dequantized"`` backward
    GEMMs (module docstring). ``weight_quantized``: ``weight`` already quantised by the recipe,
    the five tensors of :func:`~te_compile.functional.quantize_weight`, used instead of
    quantising ``weight`` (whose gradient is still computed); ``weight`` may then be the FP8
    codes themselves (FP8 primary weights), with ``main_grad`` taking its gradient.
    ``delay_wgrad=True``: the backward leaves the weight gradient GEMM out (the input's, the
    bias's and the norm's gradients are computed) and a ``functional.gemm.DeferredWgrad`` is
    also returned (before the amaxes) whose ``compute()`` runs it later: the modules'
    ``delay_wgrad_compute`` / ``backward_dw()``. Eager only: under ``torch.compile`` no tensor
    written by the backward can leave the compiled graph. ``save_original_input=True`` (with a
    recipe; Transformer Engine's option): the backward keeps ``inp`` itself (no bytes of its
    own when the caller keeps ``inp`` alive, e.g. an input several modules read) instead of the
    quantised transposed copy the forward would make, and quantises it again for the wgrad
    GEMM: the same gradients; not with ``DelayedScaling`` (ValueError), nor with a norm
    prologue. In high precision the input is what is saved anyway.
    """
    check_weight_quantized("te.linear", "weight_quantized", weight_quantized)
    args = (inp, weight, bias, main_grad)
    if not (
        isinstance(inp, Tensor) and isinstance(weight, Tensor)
        and (bias is None or isinstance(bias, Tensor))
        and (main_grad is None or isinstance(main_grad, Tensor))
    ):  # fmt: skip
        check_required("te.linear", inp=inp, weight=weight)
        check_tensors("te.linear", bias=bias, main_grad=main_grad)
    device = inp.device
    if (
        weight.device != device or (bias is not None and bias.device != device)
        or (main_grad is not None and main_grad.device != device)
    ):  # fmt: skip
        check_same_device("te.linear", "inp", inp, weight=weight, bias=bias, main_grad=main_grad)
    specs = [s.encode() if isinstance(s, QuantSpec) else s
             for s in (input_spec, weight_spec, grad_spec)]  # fmt: skip
    if save_original_input:
        check_bool("te.linear", save_original_input=save_original_input)
        save_original_input = bool(specs[0])  # high precision saves the input itself anyway
    stash = None
    if delay_wgrad:
        DeferredWgrad.check("te.linear", delay_wgrad)
        n = weight.shape[0] if weight.dim() == 2 else 0
        stash = inp.new_empty((*inp.shape[:-1], _out_features(n, activation)))
    if (
        any(specs) or normalization or activation or return_branch or residual is not None
        or out_scale != 1.0 or norm_weight is not None or norm_bias is not None
        or scale is not None or grad_amax is not None or backward_override
        or rng_state is not None or weight_quantized is not None
        or stash is not None or save_original_input
        or norm_eps != 1e-5 or zero_centered_gamma is not False
        or glu_interleave_size is not None or limit != 7.0 or alpha != 1.702
        or glu_linear_offset != 1.0
    ):  # fmt: skip
        check_tensors("te.linear", scale=scale, grad_amax=grad_amax, norm_weight=norm_weight,
                      norm_bias=norm_bias, residual=residual)  # fmt: skip
        check_same_device("te.linear", "inp", inp, norm_weight=norm_weight, norm_bias=norm_bias,
                          residual=residual)  # fmt: skip
        scalars = (normalization, norm_eps, zero_centered_gamma, activation, glu_interleave_size,
                   limit, alpha, glu_linear_offset, out_scale, return_branch, backward_override,
                   save_original_input)  # fmt: skip
        if torch.compiler.is_compiling():  # symbolic floats: checked and encoded in the graph
            strings = _scalar_specs(*scalars)
        else:  # eager: checked and encoded once per set of values (and their types)
            key = (scalars, tuple(map(type, scalars)))
            strings = _SCALAR_SPECS.get(key)
            if strings is None:
                if len(_SCALAR_SPECS) >= 1024:  # many distinct eps / scale values: start over
                    _SCALAR_SPECS.clear()
                strings = _SCALAR_SPECS[key] = _scalar_specs(*scalars)
        if rng_state is None and isinstance(specs[2], str) and "sr" in specs[2].split(":"):
            rng_state = new_rng_state(inp.device)
        norm, epilogue, backward = strings
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
