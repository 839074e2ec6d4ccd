r"""The linear family: :math:`y = r + s\,f(\mathrm{norm}(x) W^\top + b)` as ``te::linear_fwd`` /
``te::linear_bwd``, for every recipe, with an optional norm prologue and epilogue.

Layouts: ``inp`` is ``[..., in_features]`` (any number of leading dims, flattened to ``[M, K]``
for the GEMM), ``weight`` is ``[out_features, in_features]`` like ``nn.Linear``, ``bias`` is
``[out_features]``. The backward computes

.. math::
    dX = dY\,W, \qquad dW = dY^\top X, \qquad db = \textstyle\sum_{rows} dY

(through the epilogue and the prologue) and skips whichever of them autograd does not need.
``te::linear_fwd(inp, weight, bias?, main_grad?, <recipe>, <prologue>, <epilogue>) -> (out,
branch, saved)`` takes, after the four tensors:

* the recipe as data (``functional.gemm``; ``quantization.gemm.gemm_args`` makes these from
  the autocast recipe): ``recipe`` (``""`` high precision, ``"current"``, ``"delayed"``,
  ``"block"``, ``"mxfp8"``, ``"nvfp4"``), ``fwd_dtype`` / ``bwd_dtype`` (E4M3 / E5M2),
  ``power_2_scale``, ``weight_block_rows`` (1 or 128; NVFP4: 1 or 16, 16x16 weight tiles),
  ``emulate``, and the delayed-scaling
  state: ``scale`` ``[3]`` (input, weight, gradient) from ``te::delayed_scaling_update``, and
  ``grad_amax`` ``[1]``, into which the backward writes the gradient's amax (per-tensor
  recipes; a buffer of its own: a saved tensor must not be modified between the passes);
  ``backward_override`` (``functional.gemm.BACKWARD_OVERRIDES``, with a recipe only): ``""``,
  the backward GEMMs on the recipe's quantised operands and gradient; ``"high_precision"``, the
  forward saves the high-precision GEMM input (the norm's output with a prologue: the norm is
  then computed, kept and quantised, not fused into the cast) and the backward is high
  precision's on it and the weight; ``"dequantized"``, the forward saves its quantised operands
  dequantised to the input dtype and the backward is high precision's on them (the gradient is
  not quantised with either override, and ``grad_amax`` is not written); NVFP4's options
  (docs/fp8.md): ``rht`` (the random Hadamard transform of the wgrad GEMM's operands, the
  input's and the gradient's columnwise copies), ``stochastic_rounding`` of the gradient with
  ``rng_state`` (int64 ``[2]`` ``(seed, offset)``, saved for the backward op: its Philox
  stream), ``row_scaled`` (the forward's input with a global scale per row; needs a
  ``backward_override``), and, last of all the arguments, ``input_4over6`` / ``weight_4over6``
  (4over6 adaptive block scaling of the input's / the weight's copies, ``""`` off or one of
  ``functional.quantize_mx.FOUR_OVER_SIX``: the error metric and the E4M3 bound of the global
  scale; the gradient never);
* the norm prologue (``functional.prologue``): ``norm_weight``, ``norm_bias``,
  ``normalization`` (``""``, ``"LayerNorm"``, ``"RMSNorm"``), ``norm_eps``,
  ``zero_centered_gamma``: ``inp`` is normalised first (written straight into FP8 on CUDA by the
  per-tensor recipes and native Float8BlockScaling);
* the epilogue: ``activation`` (any of ``ACTIVATIONS`` / ``GATED_ACTIVATIONS``; the bias is
  added by the activation, whose output has half the features for a gated one) with
  ``glu_interleave_size``, ``limit``, ``alpha``, ``glu_linear_offset``; ``residual`` (the
  output's shape) and ``out_scale`` :math:`s`: ``residual + out_scale * y``; ``branch``: also
  return a copy of ``inp`` (a residual connection's branch, ``MakeExtraOutput``) whose gradient
  joins the dgrad GEMM.

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

Pre-quantised weight (``functional.gemm``, "Pre-quantised weights"): the last arguments
``weight_data``, ``weight_scale``, ``weight_data_t``, ``weight_scale_t``, ``weight_amax`` (all
or none, with a recipe) are ``weight`` already quantised by ``te::quantize_weight``; the op does
not quantise ``weight``, saves ``weight_data_t`` / ``weight_scale_t`` for the dgrad GEMM from
its inputs (``saved`` then holds only the input's copy), and reports ``weight_amax``. ``weight``
may then be the FP8 codes themselves (FP8 primary weights, ``quantization.primary``): its
gradient must go to ``main_grad`` (the backward raises otherwise), and
``backward_override="high_precision"`` is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import (
    check_bool,
    check_finite,
    check_required,
    check_same_device,
    check_tensors,
)
from te_compile._library import SampleInput, differentiable, op
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
    check_gemm_args,
    check_nvfp4_options,
    check_recipe,
    check_weight_operand,
    check_weight_quantized,
    delayed_on_cuda,
    empty,
    gemm,
    gemm_kind,
    pad_rows,
    padded,
    quantize_operand,
    quantize_weight,
    quantized_linear_ref,
    recipe_args_not_default,
    save_for_backward_except_written,
    scale_slots,
    unpad,
    weight_operand,
)
from te_compile.functional.prologue import (
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

__all__ = ["linear", "linear_ref"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Args(NamedTuple):
    """The forward op's arguments, by name (a call passes the first four, or all)."""

    inp: Tensor
    weight: Tensor
    bias: Tensor | None = None
    main_grad: Tensor | None = None
    recipe: str = ""
    fwd_dtype: torch.dtype = _E4M3
    bwd_dtype: torch.dtype = _E5M2
    power_2_scale: bool = False
    weight_block_rows: int = 1
    emulate: bool = False
    scale: Tensor | None = None
    grad_amax: Tensor | None = None
    norm_weight: Tensor | None = None
    norm_bias: Tensor | None = None
    normalization: str = ""
    norm_eps: float = 1e-5
    zero_centered_gamma: bool = False
    activation: str = ""
    glu_interleave_size: int = 0
    limit: float = 7.0
    alpha: float = 1.702
    glu_linear_offset: float = 1.0
    residual: Tensor | None = None
    out_scale: float = 1.0
    branch: bool = False
    backward_override: str = ""
    rht: bool = False
    stochastic_rounding: bool = False
    rng_state: Tensor | None = None
    row_scaled: bool = False
    weight_data: Tensor | None = None
    weight_scale: Tensor | None = None
    weight_data_t: Tensor | None = None
    weight_scale_t: Tensor | None = None
    weight_amax: Tensor | None = None
    wgrad_stash: Tensor | None = None
    save_original_input: bool = False
    input_4over6: str = ""
    weight_4over6: str = ""

    @property
    def weight_q(self) -> tuple[Tensor | None, ...]:
        """The pre-quantised weight (``functional.gemm.WEIGHT_OPERAND``; all None: quantise
        ``weight`` inside)."""
        return (self.weight_data, self.weight_scale, self.weight_data_t, self.weight_scale_t,
                self.weight_amax)  # fmt: skip

    @property
    def plain(self) -> bool:
        """High precision without a prologue or an epilogue: ``te.Linear``'s hot path."""
        return not (
            self.recipe or self.normalization or self.activation or self.branch
            or self.backward_override or self.rht or self.stochastic_rounding
            or self.rng_state is not None or self.row_scaled
            or self.residual is not None or self.out_scale != 1.0 or self.norm_weight is not None
            or self.norm_bias is not None or self.scale is not None
            or self.grad_amax is not None or self.weight_data is not None
            or self.wgrad_stash is not None or self.save_original_input
            or self.input_4over6 or self.weight_4over6
        )  # fmt: skip

    @property
    def norm(self) -> Norm:
        return Norm(self.norm_weight, self.norm_bias, self.normalization, self.norm_eps,
                    self.zero_centered_gamma)  # fmt: skip

    @property
    def act(self) -> tuple:
        return (self.glu_interleave_size, self.limit, self.alpha, self.glu_linear_offset)


_NORM_WEIGHT, _RESIDUAL = _Args._fields.index("norm_weight"), _Args._fields.index("residual")


def _acc(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _out_features(n: int, activation: str) -> int:
    return n // 2 if activation in GATED_ACTIVATIONS else n


# 1. Reference math --------------------------------------------------------------------------


def linear_ref(inp: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Definition of correctness in high precision: fp32 (or fp64) math, cast to the input
    dtype at the end."""
    acc = _acc(inp)
    out = torch.nn.functional.linear(
        inp.to(acc), weight.to(acc), None if bias is None else bias.to(acc)
    )
    return out.to(inp.dtype)


def _reference(*args):
    """The op's definition: the norm's reference, the recipe's GEMM, the epilogue, in the
    inputs' dtype (float64 in the tests)."""
    a = _Args(*args)
    x = norm_ref(a.inp, a.norm)
    config = (a.fwd_dtype, a.bwd_dtype, a.power_2_scale, a.weight_block_rows, a.scale)
    rng_state = a.rng_state if a.stochastic_rounding else None
    y = quantized_linear_ref(x, a.weight, a.recipe, *config, a.backward_override, a.rht,
                             rng_state, a.row_scaled, a.input_4over6,
                             a.weight_4over6)  # fmt: skip
    if a.activation in GATED_ACTIVATIONS:
        y = gated_activation_ref(y, a.bias, a.activation, *a.act)
    elif a.activation:
        y = activation_ref(y, a.bias, a.activation)
    elif a.bias is not None:
        y = y + a.bias
    if a.residual is not None:
        y = a.residual + a.out_scale * y
    elif a.out_scale != 1.0:
        y = a.out_scale * y
    return (y, a.inp) if a.branch else y


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
    fp8_weight = weight.dtype in FP8_DTYPES
    if fp8_weight:  # FP8 primary weights: the codes stand for the weight (module docstring)
        if a.weight_data is None:
            raise ValueError(
                f"te.linear: an FP8 weight ({weight.dtype}) needs its pre-quantised operand "
                f"({', '.join(WEIGHT_OPERAND)}); its gradient goes to main_grad (fp32)"
            )
        if a.backward_override == "high_precision":
            raise ValueError(
                "te.linear: backward_override='high_precision' needs a high-precision weight, "
                f"got {weight.dtype} (FP8 primary weights)"
            )
        weight = torch.empty(weight.shape, dtype=inp.dtype, device="meta")
    _check_args(inp, weight, a.bias, a.main_grad)
    if a.plain:
        return
    p = "te.linear: "
    recipe = a.recipe
    check_nvfp4_options(p, recipe, a.rht, a.stochastic_rounding, a.rng_state, a.inp,
                        a.row_scaled, a.backward_override, a.input_4over6,
                        a.weight_4over6)  # fmt: skip
    if a.save_original_input and a.input_4over6:
        raise NotImplementedError(
            p + "save_original_input=True with input_4over6 (4over6 block scaling of the input) "
            "is not implemented: the backward would quantise the input again without it"
        )
    if a.weight_data is not None and a.weight_4over6:
        raise ValueError(
            p + "weight_4over6 is for a weight the op quantises; a pre-quantised weight "
            "(weight_data, ...) carries its own quantisation (quantize_weight's four_over_six)"
        )
    check_recipe(p, recipe, a.fwd_dtype, a.bwd_dtype, a.weight_block_rows, a.emulate, a.scale,
                 a.grad_amax)  # fmt: skip
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
        if (
            recipe == "block"
            and not a.emulate
            and a.weight_block_rows == 128
            and (n % 512 or k % 512)
        ):
            raise ValueError(
                p + "native GEMMs with 128x128 weight blocks need in_features and out_features "
                f"to be multiples of 512; weight is {list(weight.shape)}"
            )
    if a.backward_override not in BACKWARD_OVERRIDES:
        raise ValueError(
            p
            + f"backward_override must be one of {BACKWARD_OVERRIDES}, got {a.backward_override!r}"
        )
    if a.backward_override and not recipe:
        raise ValueError(p + "backward_override is for a quantised recipe (recipe is '')")
    if a.save_original_input:
        if recipe == "delayed":
            raise ValueError(
                p + "save_original_input=True does not work with the delayed-scaling recipe "
                "(DelayedScaling): the backward would quantise the input again with a scale the "
                "amax-history update may have changed"
            )
        if a.normalization or a.backward_override == "dequantized":
            raise ValueError(
                p + "save_original_input=True is for a linear without a norm prologue and "
                "without backward_override='dequantized', got "
                f"normalization={a.normalization!r}, backward_override={a.backward_override!r}"
            )
    if a.grad_amax is not None and recipe not in PER_TENSOR:
        raise ValueError(p + "grad_amax is for the per-tensor recipes (current, delayed)")
    check_weight_operand(p, recipe, weight, a.weight_block_rows, a.emulate, a.weight_q)
    check_finite("te.linear", out_scale=a.out_scale)
    check_norm(p, inp, a.norm)
    if a.activation:
        if a.residual is not None or a.branch:
            raise ValueError(p + "activation cannot be combined with residual or branch")
        gemm_out = torch.empty((*inp.shape[:-1], n), dtype=inp.dtype, device="meta")
        check_activation(gemm_out, a.bias, a.activation, a.glu_interleave_size)
        check_gated_params("te.linear", a.limit, a.alpha, a.glu_linear_offset)
    if a.wgrad_stash is not None:
        shape = (*inp.shape[:-1], _out_features(n, a.activation))
        stash = a.wgrad_stash
        if stash.shape != shape or stash.dtype != inp.dtype or stash.device != inp.device:
            raise ValueError(
                p + f"wgrad_stash must have the output's shape {list(shape)}, inp's dtype "
                f"{inp.dtype} and device, got {list(stash.shape)} {stash.dtype} {stash.device}"
            )
    if a.residual is not None:
        shape = (*inp.shape[:-1], _out_features(n, a.activation))
        if a.residual.shape != shape or a.residual.dtype != inp.dtype:
            raise ValueError(
                p + f"residual must have the output's shape {list(shape)} and inp's dtype "
                f"{inp.dtype}, got {list(a.residual.shape)} {a.residual.dtype}"
            )


# 2. Forward op ------------------------------------------------------------------------------


def _bytes(t: Tensor) -> Tensor:
    """FP8 codes cross op boundaries as their bytes (docs/fp8.md); other tensors as they are."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def _codes(t: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return t.view(fp8_dtype) if t.dtype is torch.uint8 else t


def _forward(a: _Args, cuda: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    _check(a)
    inp, weight, bias = a.inp, a.weight, a.bias
    dtype, n = inp.dtype, weight.shape[0]
    branch = inp.clone(memory_format=torch.contiguous_format) if a.branch else empty(inp)
    if a.plain:  # te.Linear in high precision: the hot path
        out = (
            torch.nn.functional.linear(inp, weight, bias) if cuda else linear_ref(inp, weight, bias)
        )
        return out, branch, []
    x2 = inp.reshape(-1, inp.shape[-1])
    m, acc = x2.shape[0], None
    saved, stats, amax = [], [], []
    fuse_bias = bias if not a.activation else None
    if not a.recipe:
        acc = None if cuda else _acc(inp)
        if a.normalization:
            x2, *stats = norm_forward(x2, a.norm)
            saved.append(x2)
        if cuda and a.residual is not None:  # one GEMM with the residual in its epilogue
            out = torch.addmm(a.residual.reshape(-1, n), x2, weight.t(), alpha=a.out_scale)
            if bias is not None:
                out.add_(bias, alpha=a.out_scale)
            return out.reshape(a.residual.shape), branch, saved + stats
        c = (lambda t: t) if acc is None else (lambda t: None if t is None else t.to(acc))
        h = gemm("mm", c(x2), None, c(weight), None, dtype, bias=c(fuse_bias))
    else:
        recipe, p2, em, override = a.recipe, a.power_2_scale, a.emulate, a.backward_override
        s_x, s_w, _ = scale_slots(a.scale, recipe)
        if a.normalization and override == "high_precision":  # the norm's output is kept
            x2, *stats = norm_forward(x2, a.norm)
            xq = quantize_operand(recipe, pad_rows(x2), a.fwd_dtype, scale=s_x,
                                  power_2_scale=p2, emulate=em, rht=a.rht,
                                  row_scaled=a.row_scaled,
                                  four_over_six=a.input_4over6)  # fmt: skip
        elif a.normalization:
            xq, *stats = norm_quantize(recipe, x2, a.norm, a.fwd_dtype, scale=s_x,
                                       power_2_scale=p2, emulate=em, rht=a.rht,
                                       row_scaled=a.row_scaled,
                                       four_over_six=a.input_4over6)  # fmt: skip
        else:  # save_original_input: the backward quantises the input again for the wgrad
            xq = quantize_operand(recipe, pad_rows(x2), a.fwd_dtype, scale=s_x,
                                  power_2_scale=p2, emulate=em, rht=a.rht,
                                  row_scaled=a.row_scaled, four_over_six=a.input_4over6,
                                  columnwise=not a.save_original_input)  # fmt: skip
        if a.weight_data is not None:  # pre-quantised: the saved copy is an input's
            wq = weight_operand(a.weight_q, a.fwd_dtype)
        else:
            wq = quantize_operand(recipe, weight, a.fwd_dtype, scale=s_w, power_2_scale=p2,
                                  block_rows=a.weight_block_rows, emulate=em,
                                  four_over_six=a.weight_4over6)  # fmt: skip
        h = gemm(gemm_kind(recipe, em), xq.data, xq.scale, wq.data, wq.scale, dtype,
                 bias=fuse_bias, fast_accum=True, b_block_rows=a.weight_block_rows)  # fmt: skip
        h = unpad(h, m)
        if override == "high_precision":  # the GEMM input in high precision, with a norm
            saved = [x2] if a.normalization else []
        elif override == "dequantized":  # the forward's operands, dequantised
            w_rows = a.weight_block_rows
            saved = [_dequantized(recipe, xq, m, a.fwd_dtype, 1, em, dtype),
                     _dequantized(recipe, wq, n, a.fwd_dtype, w_rows, em, dtype)]  # fmt: skip
        else:
            if a.save_original_input:  # the input itself is saved instead of its copy
                f32 = torch.float32
                x_slots = [x2.new_empty(0, dtype=_bytes(wq.data_t).dtype),
                           x2.new_empty(0, dtype=f32)]  # fmt: skip
            else:
                x_slots = [_bytes(xq.data_t), xq.scale_t]
            # A pre-quantised weight's copies are inputs: setup_context saves them.
            w_slots = [] if a.weight_data is not None else [_bytes(wq.data_t), wq.scale_t]
            saved = [*x_slots, *w_slots]
        if recipe in PER_TENSOR:
            amax = [torch.cat([xq.amax, wq.amax])]
    y = h
    if a.activation:
        b = bias if acc is None or bias is None else bias.to(acc)
        y = activation_forward(h, b, a.activation, *a.act)
        saved.append(h)
    if a.residual is not None:
        r = a.residual.reshape(y.shape)
        y = r.to(acc) + a.out_scale * y if acc else torch.add(r, y, alpha=a.out_scale)
    elif a.out_scale != 1.0:
        y = y * a.out_scale
    out = y.to(dtype).reshape(*inp.shape[:-1], y.shape[-1])
    return out, branch, saved + stats + amax


def _dequantized(recipe, q, rows: int, fp8_dtype, block_rows: int, emulate: bool, dtype) -> Tensor:
    """The rowwise operand ``q`` (what the forward GEMM multiplied) dequantised to ``dtype``,
    its first ``rows`` rows (``backward_override="dequantized"``)."""
    if gemm_kind(recipe, emulate) == "dequantized":  # already the dequantised fp32 values
        values = q.data
    elif recipe in PER_TENSOR:
        values = q.data.float() * q.scale
    else:
        u8, f32 = torch.uint8, torch.float32
        values = dequantize_blockwise.eager(q.data.view(u8), q.scale, block_rows, fp8_dtype, f32)
    # A copy where the values are the operand's own tensor (an output may not alias another).
    return values[:rows].to(dtype, copy=values is q.data)


@op("linear_fwd", kept_whole=delayed_on_cuda)
def linear_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    recipe: str = "",
    fwd_dtype: torch.dtype = _E4M3,
    bwd_dtype: torch.dtype = _E5M2,
    power_2_scale: bool = False,
    weight_block_rows: int = 1,
    emulate: bool = False,
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    normalization: str = "",
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    activation: str = "",
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    residual: Tensor | None = None,
    out_scale: float = 1.0,
    branch: bool = False,
    backward_override: str = "",
    rht: bool = False,
    stochastic_rounding: bool = False,
    rng_state: Tensor | None = None,
    row_scaled: bool = False,
    weight_data: Tensor | None = None,
    weight_scale: Tensor | None = None,
    weight_data_t: Tensor | None = None,
    weight_scale_t: Tensor | None = None,
    weight_amax: Tensor | None = None,
    wgrad_stash: Tensor | None = None,
    save_original_input: bool = False,
    input_4over6: str = "",
    weight_4over6: str = "",
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(out, branch, saved)`` (module docstring). The default (CPU) implementation computes
    high precision in fp32 (fp64 stays fp64), rounded once."""
    if (
        recipe == "" and normalization == "" and activation == "" and residual is None
        and out_scale == 1.0 and not branch and scale is None and grad_amax is None
        and norm_weight is None and norm_bias is None and backward_override == ""
        and not rht and not stochastic_rounding and rng_state is None and not row_scaled
        and weight_data is None
        and wgrad_stash is None and not save_original_input
        and not input_4over6 and not weight_4over6
    ):  # fmt: skip
        return _plain_forward(inp, weight, bias, main_grad, cuda=False)
    args = (inp, weight, bias, main_grad, recipe, fwd_dtype, bwd_dtype, power_2_scale,
            weight_block_rows, emulate, scale, grad_amax, norm_weight, norm_bias, normalization,
            norm_eps, zero_centered_gamma, activation, glu_interleave_size, limit, alpha,
            glu_linear_offset, residual, out_scale, branch, backward_override, rht,
            stochastic_rounding, rng_state, row_scaled, weight_data, weight_scale,
            weight_data_t, weight_scale_t, weight_amax, wgrad_stash,
            save_original_input, input_4over6, weight_4over6)  # fmt: skip
    return _forward(_Args(*args), cuda=False)


def _plain_forward(inp, weight, bias, main_grad, cuda: bool) -> tuple[Tensor, Tensor, list]:
    """te.Linear's hot path: high precision, no prologue or epilogue (cheap to enter)."""
    _check_args(inp, weight, bias, main_grad)
    out = torch.nn.functional.linear(inp, weight, bias) if cuda else linear_ref(inp, weight, bias)
    return out, inp.new_empty(0), []


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
    n, k = weight.shape
    rows = inp.numel() // k if k else 0
    out = inp.new_empty((*inp.shape[:-1], _out_features(n, a.activation)))
    branch = inp.new_empty(inp.shape) if a.branch else empty(inp)
    if a.plain:
        return out, branch, []
    f32, u8 = torch.float32, torch.uint8
    saved = []
    recipe = a.recipe
    if a.backward_override == "high_precision":
        saved = [inp.new_empty(rows, k)] if a.normalization else []
    elif a.backward_override == "dequantized":
        saved = [inp.new_empty(rows, k), inp.new_empty(n, k)]
    elif recipe:
        m = padded(rows)
        kind = gemm_kind(recipe, a.emulate)
        if kind == "dequantized":
            saved = [inp.new_empty(k, m, dtype=f32), inp.new_empty(0, dtype=f32),
                     inp.new_empty(k, n, dtype=f32), inp.new_empty(0, dtype=f32)]  # fmt: skip
        elif recipe in PER_TENSOR:
            one = inp.new_empty(1, dtype=f32)
            saved = [inp.new_empty(k, m, dtype=u8), one, inp.new_empty(k, n, dtype=u8), one.clone()]
        else:
            w_rows = a.weight_block_rows
            saved = [inp.new_empty(k, m, dtype=u8), inp.new_empty(k, -(-m // 128), dtype=f32),
                     inp.new_empty(k, n, dtype=u8),
                     inp.new_empty(-(-k // w_rows), -(-n // 128), dtype=f32)]  # fmt: skip
        if a.save_original_input:  # the input's slots: 0-element (the input itself is saved)
            saved[:2] = [inp.new_empty(0, dtype=saved[0].dtype), inp.new_empty(0, dtype=f32)]
        if a.weight_data is not None:  # the weight's copies are inputs (setup_context)
            saved = saved[:2]
    elif a.normalization:
        saved = [inp.new_empty(rows, k)]
    if a.activation:
        h_dtype = _acc(inp) if not recipe and inp.device.type == "cpu" else inp.dtype
        saved.append(inp.new_empty(rows, n, dtype=h_dtype))
    saved += fake_stats(inp, rows, a.normalization)
    if recipe in PER_TENSOR:
        saved.append(inp.new_empty(2, dtype=f32))
    return out, branch, saved


# 4. Backward op -----------------------------------------------------------------------------


class _Bwd(NamedTuple):
    """The backward op's scalar arguments (after the tensors)."""

    recipe: str
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype
    power_2_scale: bool
    weight_block_rows: int
    emulate: bool
    rht: bool
    stochastic_rounding: bool
    normalization: str
    zero_centered_gamma: bool
    has_norm_bias: bool
    activation: str
    glu_interleave_size: int
    limit: float
    alpha: float
    glu_linear_offset: float
    out_scale: float
    need_dbias: bool
    need_dgrad: bool
    need_wgrad: bool


def _split_saved(saved: list[Tensor], c: _Bwd) -> tuple[list, Tensor | None, Tensor | None, list]:
    """``(quantised copies [4] or [], high-precision GEMM input or None, GEMM output before the
    activation or None, norm statistics)``."""
    i = 4 if c.recipe else int(bool(c.normalization))
    copies = saved[:4] if c.recipe else []
    x_hp = saved[0] if not c.recipe and c.normalization else None
    h = saved[i] if c.activation else None
    stats = saved[i + bool(c.activation) :]
    return copies, x_hp, h, stats


def _backward_impl(grad, grad_branch, saved, inp, weight, bias, main_grad, scale, grad_amax,
                   norm_weight, rng_state, c: _Bwd, cuda: bool):  # fmt: skip
    dtype = grad.dtype
    copies, x_hp, h, stats = _split_saved(saved, c)
    if copies and c.need_wgrad and copies[0].numel() == 0 and inp is not None and inp.numel():
        # save_original_input: the input's quantised transposed copy, made again here.
        x2 = inp.reshape(-1, inp.shape[-1])
        xq = quantize_operand(c.recipe, pad_rows(x2), c.fwd_dtype, scale=scale_slots(
            scale, c.recipe)[0], power_2_scale=c.power_2_scale, emulate=c.emulate,
            rht=c.rht)  # fmt: skip
        copies = [_bytes(xq.data_t), xq.scale_t, *copies[2:]]
    g2 = grad.reshape(-1, grad.shape[-1])
    m = g2.shape[0]
    acc = None if c.recipe or cuda else _acc(grad)
    dy = g2 if acc is None else g2.to(acc)
    if c.out_scale != 1.0:
        dy = dy * c.out_scale
    dbias = empty(grad)
    if c.activation:
        b = bias if acc is None or bias is None else bias.to(acc)
        config = (c.glu_interleave_size, c.limit, c.alpha, c.glu_linear_offset)
        dy, db = activation_backward(dy, h, b, c.activation, *config, c.need_dbias)
        if c.need_dbias:
            dbias = db.to(dtype)
    elif c.need_dbias and not (c.recipe == "block" and not c.emulate):
        dbias = dy.sum(0) if cuda and not c.recipe else dy.sum(0, dtype=acc or torch.float32)
        dbias = dbias.to(dtype)
    b2 = None if grad_branch is None else grad_branch.reshape(-1, grad_branch.shape[-1])
    fused_branch = b2 is not None and not c.recipe and not c.normalization
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
        if c.normalization:
            x2 = inp.reshape(-1, inp.shape[-1])
            dinp, *dnorm = norm_backward(dinp, x2, norm_weight, stats, c.normalization,
                                         c.zero_centered_gamma, c.has_norm_bias)  # fmt: skip
        if b2 is not None and not fused_branch:
            dinp = dinp + b2
        dinp = dinp.reshape(*grad.shape[:-1], dinp.shape[-1])
    return dinp if dinp is not None else empty(grad), dweight, dbias, *dnorm


def _quantized_backward(dy, copies, main_grad, scale, grad_amax, rng_state, c: _Bwd, m: int):
    """``(dinp 2-D or None, dweight, dbias or None)`` of a quantised recipe's GEMMs; ``dbias``
    only where the gradient's quantisation sums it (native blockwise)."""
    x_t, x_st, w_t, w_st = copies
    dtype = dy.dtype
    kind = gemm_kind(c.recipe, c.emulate)
    sums = c.need_dbias and kind == "blockwise" and not c.activation
    _, _, s_g = scale_slots(scale, c.recipe)
    g = quantize_operand(c.recipe, pad_rows(dy), c.bwd_dtype, scale=s_g,
                         power_2_scale=c.power_2_scale, emulate=c.emulate,
                         columnwise=c.need_wgrad, mn_major=True, sums=sums, rht=c.rht,
                         rng_state=rng_state if c.stochastic_rounding else None)  # fmt: skip
    if grad_amax is not None:
        grad_amax.copy_(g.amax)
    dinp = None
    if c.need_dgrad:  # dX [M, K] = dY [M, N] @ W [N, K]; W^T [K, N] is the GEMM's b
        dinp = gemm(kind, g.data, g.scale, _codes(w_t, c.fwd_dtype), w_st, dtype,
                    b_block_rows=c.weight_block_rows)  # fmt: skip
        dinp = unpad(dinp, m)
    dweight = empty(dy)
    if c.need_wgrad:  # dW [N, K] = dY^T [N, M] @ X [M, K]; X^T [K, M] is the GEMM's b
        into = main_grad is not None
        out_dtype = torch.float32 if into and kind != "blockwise" else dtype
        dw = gemm(kind, g.data_t, g.scale_t, _codes(x_t, c.fwd_dtype), x_st, out_dtype)
        if into:
            main_grad.add_(dw)
        else:
            dweight = dw
    return dinp, dweight, g.sums


@op(
    "linear_bwd",
    mutates_args=("main_grad", "grad_amax", "wgrad_stash"),
    kept_whole=delayed_on_cuda,
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
    recipe: str,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    power_2_scale: bool,
    weight_block_rows: int,
    emulate: bool,
    rht: bool,
    stochastic_rounding: bool,
    normalization: str,
    zero_centered_gamma: bool,
    has_norm_bias: bool,
    activation: str,
    glu_interleave_size: int,
    limit: float,
    alpha: float,
    glu_linear_offset: float,
    out_scale: float,
    need_dbias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
    wgrad_stash: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias, dnorm_weight, dnorm_bias)``, a 0-element tensor where not
    computed (``dweight`` also when it went into ``main_grad``). Tensors, not a list: a
    mutating op's list return cannot be functionalised (torch 2.13).
    ``saved``: the forward's, without the amaxes; ``inp`` is needed in high precision and with
    a norm (the norm's backward), ``weight`` in high precision, ``bias`` with an activation.
    ``need_dgrad``: any of the input and the norm's parameters needs a gradient. Writes
    ``amax(dY)`` into ``grad_amax`` when given. ``wgrad_stash`` (delayed weight gradient): the
    incoming gradient is copied into it and the weight gradient is not computed (a later call
    with ``grad=wgrad_stash`` and only ``need_wgrad`` computes it, ``DeferredWgrad``). Default
    (CPU): high precision in fp32 (fp64 stays fp64), each gradient rounded once."""
    if wgrad_stash is not None:
        wgrad_stash.copy_(grad)
        need_wgrad = False
    if (
        recipe == ""
        and normalization == ""
        and activation == ""
        and out_scale == 1.0
        and (grad_branch is None)
    ):
        acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
        return _plain_backward(grad, inp, weight, main_grad, need_dbias, need_dgrad, need_wgrad,
                               acc)  # fmt: skip
    c = _Bwd(*_locals_args_bwd(locals()))
    return _backward_impl(grad, grad_branch, saved, inp, weight, bias, main_grad, scale,
                          grad_amax, norm_weight, rng_state, c, cuda=False)  # fmt: skip


def _plain_backward(grad, inp, weight, main_grad, need_dbias, need_dgrad, need_wgrad, acc):
    """The backward of :func:`_plain_forward`: the three GEMMs / reductions in ``acc`` (None:
    the input dtype, cuBLAS with fp32 accumulation), each rounded once."""
    dtype = grad.dtype
    dy = grad.reshape(-1, grad.shape[-1])
    dinp = empty(grad)
    if need_dgrad:
        dinp = (grad.to(acc) @ weight.to(acc)).to(dtype) if acc else grad @ weight
    dweight = empty(grad)
    if need_wgrad:
        x = inp.reshape(-1, inp.shape[-1])
        if main_grad is not None:
            accumulate_wgrad(main_grad, dy, x)
        else:
            dweight = (dy.t().to(acc) @ x.to(acc)).to(dtype) if acc else dy.t() @ x
    dbias = empty(grad)
    if need_dbias:
        dbias = dy.sum(0, dtype=acc).to(dtype) if acc else dy.sum(0)
    return dinp, dweight, dbias, empty(grad), empty(grad)


_BWD_TENSORS = ("grad", "grad_branch", "saved", "inp", "weight", "bias", "main_grad", "scale",
                "grad_amax", "norm_weight", "rng_state")  # fmt: skip


def _locals_args_bwd(values: dict) -> tuple:
    return tuple(values[name] for name in _Bwd._fields)


def _bwd_args(args: tuple) -> tuple[tuple, _Bwd]:
    """The tensors and the scalars of a ``linear_bwd`` call (``wgrad_stash``, when given, gets
    the gradient and takes the weight gradient's place: ``need_wgrad`` becomes False)."""
    n = len(_BWD_TENSORS)
    tensors, c = args[:n], _Bwd(*args[n : n + len(_Bwd._fields)])
    stash = args[n + len(_Bwd._fields)] if len(args) > n + len(_Bwd._fields) else None
    return tensors, (c if stash is None else c._replace(need_wgrad=False))


@linear_bwd.register_kernel("cuda")
def _linear_bwd_cuda(*args):
    tensors, c = _bwd_args(args)
    if len(args) > len(_BWD_TENSORS) + len(_Bwd._fields) and args[-1] is not None:
        args[-1].copy_(tensors[0])
    if (
        not (c.recipe or c.normalization or c.activation)
        and c.out_scale == 1.0
        and (tensors[1] is None)
    ):
        grad, _, _, inp, weight, _, main_grad = tensors[:7]
        return _plain_backward(grad, inp, weight, main_grad, c.need_dbias, c.need_dgrad,
                               c.need_wgrad, None)  # fmt: skip
    return _backward_impl(*tensors, c, cuda=True)


@linear_bwd.register_fake
def _linear_bwd_fake(*args):
    (grad, _, saved, _, weight, _, main_grad, *_, norm_weight, _), c = _bwd_args(args)
    n, k = weight.shape if weight is not None else saved[2].shape[::-1]
    dinp = grad.new_empty(*grad.shape[:-1], k) if c.need_dgrad else empty(grad)
    want_dw = c.need_wgrad and main_grad is None
    dweight = grad.new_empty(n, k) if want_dw else empty(grad)
    dbias = grad.new_empty(n) if c.need_dbias else empty(grad)
    dnorm = fake_dnorm(grad, norm_weight, c.normalization, c.has_norm_bias, c.need_dgrad)
    return dinp, dweight, dbias, *dnorm


# 5. setup_context + autograd ------------------------------------------------------------------


_PLAIN_SCALARS = (
    "", _E4M3, _E5M2, False, 1, False, False, False, "", False, False, "", 0, 7.0, 1.702, 1.0,
    1.0,
)  # fmt: skip
# Positions in ctx.scalars (the backward op's scalar arguments before the need_* flags).
_NORMALIZATION, _HAS_NORM_BIAS = (
    _Bwd._fields.index("normalization"),
    _Bwd._fields.index("has_norm_bias"),
)


def _setup_context(ctx, inputs, output) -> None:
    if len(inputs) == 4:  # a plain call (the eager fast path passes the tensors only)
        inp, weight, bias, main_grad = inputs
        ctx.mark_non_differentiable(output[1])  # no branch: no gradient to make for it
        # (inp, weight, bias, main_grad, scale, grad_amax, norm_weight, rng_state, stash)
        save_for_backward_except_written(
            ctx, (inp, weight, None, main_grad, None, None, None, None, None), _WRITTEN
        )
        ctx.scalars, ctx.has_bias, ctx.branch = _PLAIN_SCALARS, bias is not None, False
        return
    a = _Args(*inputs)
    _out, branch, saved = output
    ctx.mark_non_differentiable(*saved, *(() if a.branch else (branch,)))
    tensors, ctx.scalars = _for_backward(a, saved)
    save_for_backward_except_written(ctx, (*tensors, a.wgrad_stash), _WRITTEN)
    ctx.has_bias, ctx.branch = a.bias is not None, a.branch
    ctx.fp8_weight = a.weight.dtype in FP8_DTYPES and a.main_grad is None


# Positions of main_grad and grad_amax in the backward's tensors (_for_backward): the buffers
# the backward writes into (functional.gemm.save_for_backward_except_written).
_WRITTEN = (3, 5)


def _for_backward(a: _Args, saved: list[Tensor]) -> tuple[tuple, tuple]:
    """What the backward op takes from a forward call: ``(inp, weight, bias, main_grad, scale,
    grad_amax, norm_weight, *saved)`` (None where not needed) and the scalars."""
    if a.recipe in PER_TENSOR:
        saved = saved[:-1]  # the amaxes: for the caller, not the backward
    if a.weight_data is not None and not a.backward_override:  # the dgrad GEMM's weight copy
        saved = [*saved[:2], a.weight_data_t, a.weight_scale_t, *saved[2:]]
    # backward_override: the backward is high precision's, on the forward's high-precision
    # operands or on their dequantised copies (which take the input's and the weight's place).
    hp, normed = not a.recipe or a.backward_override, bool(a.normalization)
    inp, weight = a.inp, a.weight
    keep_inp = hp or normed or a.save_original_input
    if a.backward_override == "dequantized":
        x_deq, weight, *saved = saved
        if normed:  # the norm's backward takes the input, the wgrad GEMM the saved operand
            saved = [x_deq, *saved]
        else:
            inp = x_deq
    tensors = (
        inp if keep_inp else None,
        weight if hp else None,
        a.bias if a.activation else None,
        a.main_grad, a.scale, a.grad_amax,
        a.norm_weight if normed else None,
        a.rng_state,
        *saved,
    )  # fmt: skip
    scalars = (
        "" if a.backward_override else a.recipe, a.fwd_dtype, a.bwd_dtype, a.power_2_scale,
        a.weight_block_rows, a.emulate, a.rht, a.stochastic_rounding,
        a.normalization, a.zero_centered_gamma, a.norm_bias is not None, a.activation, *a.act,
        a.out_scale,
    )  # fmt: skip
    return tensors, scalars


def _backward(ctx, bwd, grad, grad_branch, _grad_saved):
    inp, weight, bias, _, scale, _, norm_weight, rng_state, *saved, stash = ctx.saved_tensors
    main_grad, grad_amax = ctx.written
    need = ctx.needs_input_grad
    if need[1] and getattr(ctx, "fp8_weight", False):
        raise RuntimeError(
            "te.linear: an FP8 weight's gradient goes to main_grad (fp32), and none was given"
        )
    normalization = ctx.scalars[_NORMALIZATION]
    need_norm = bool(normalization) and any(need[_NORM_WEIGHT : _NORM_WEIGHT + 2])
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
    if need_norm:
        dnorm_w, dnorm_b = dnorm
        grads[_NORM_WEIGHT] = dnorm_w if need[_NORM_WEIGHT] else None
        has_norm_bias = ctx.scalars[_HAS_NORM_BIAS]
        grads[_NORM_WEIGHT + 1] = dnorm_b if has_norm_bias and need[_NORM_WEIGHT + 1] else None
    if len(need) > _RESIDUAL and need[_RESIDUAL]:
        grads[_RESIDUAL] = grad
    return tuple(grads)


def _call(inp, weight, bias=None, main_grad=None, **kw) -> SampleInput:
    """A sample: the four tensors, or every argument when any other is given."""
    if not kw:
        return SampleInput((inp, weight, bias, main_grad))
    return SampleInput(tuple(_Args(inp, weight, bias, main_grad, **kw)))


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
    yield _call(t(5, 16), t(24, 16), t(24), activation="gelu")
    yield _call(t(2, 3, 16, dtype=bf16), t(32, 16, dtype=bf16), activation="relu")
    yield _call(t(7, 32, dtype=bf16), t(16, 32, dtype=bf16), t(16, dtype=bf16),
                activation="swiglu", glu_interleave_size=4)  # fmt: skip
    yield _call(t(6, 16, grad=False), t(16, 16), t(16), torch.zeros(16, 16, device=device),
                activation="clamped_swiglu", glu_interleave_size=2, limit=0.75,
                glu_linear_offset=0.5)  # fmt: skip
    yield _call(t(5, 16), t(24, 16), t(24), residual=t(5, 24))
    yield _call(t(2, 3, 16, dtype=bf16), t(8, 16, dtype=bf16), residual=t(2, 3, 8, dtype=bf16),
                out_scale=0.5)  # fmt: skip
    yield _call(t(6, 16, grad=False), t(8, 16), t(8), torch.zeros(8, 16, device=device),
                residual=t(6, 8), out_scale=-2.0)  # fmt: skip
    yield _call(t(5, 16), t(24, 16), t(24), branch=True)
    yield _call(t(4, 8, dtype=fp16), t(12, 8, dtype=fp16), t(12, dtype=fp16), branch=True)
    yield _call(t(6, 16), t(8, 16), t(8), torch.zeros(8, 16, device=device), branch=True)
    # A norm prologue in high precision (LayerNorm, zero-centred gamma).
    yield _call(t(2, 5, 16), t(8, 16), t(8), norm_weight=t(16), norm_bias=t(16),
                normalization="LayerNorm", zero_centered_gamma=True)  # fmt: skip
    # Per-tensor FP8. 10 tokens: padded to 16 inside the ops.
    cur = {"recipe": "current"}
    yield _call(t(32, 16, dtype=bf16), t(16, 16, dtype=bf16), t(16, dtype=bf16), **cur)
    yield _call(t(2, 5, 16, dtype=bf16), t(32, 16, dtype=bf16), t(32, dtype=bf16), **cur)
    scale = torch.tensor([8.0, 16.0, 1.0], device=device)
    pending = torch.zeros(1, device=device)
    yield _call(t(2, 16, 32, dtype=bf16), t(48, 32, dtype=bf16), recipe="delayed", scale=scale,
                grad_amax=pending)  # fmt: skip
    yield _call(t(16, 32), t(16, 32), None, torch.zeros(16, 32, device=device), bwd_dtype=_E4M3,
                **cur)  # fmt: skip
    # float32 with a bias: _scaled_mm refuses a bias with an fp32 output (added after it).
    yield _call(t(16, 32), t(32, 32), t(32), **cur)
    # Norm prologues: inputs whose norm is exact in fp32 and float64 alike (``unit_rows``; the
    # FP8 codes of a computed value one fp32 rounding from a code boundary would differ).
    yield _call(unit_rows(2, 5, 32, device=device), t(16, 32), t(16), **cur, norm_weight=t(32),
                norm_bias=torch.zeros(32, device=device, requires_grad=True),
                normalization="LayerNorm", norm_eps=1e-30)  # fmt: skip
    yield _call(unit_rows(16, 32, device=device), t(32, 32), recipe="delayed",
                scale=scale.clone(), grad_amax=pending.clone(), norm_weight=t(32),
                normalization="RMSNorm", norm_eps=1e-30)  # fmt: skip
    # FP8 with an epilogue: bias + GELU, residual add, branch.
    yield _call(t(32, 16), t(32, 16), t(32), **cur, activation="gelu")
    yield _call(t(2, 8, 32), t(16, 32), t(16), **cur, residual=t(2, 8, 16), out_scale=2.0)
    yield _call(t(16, 32), t(16, 32), None, **cur, branch=True)
    # Block-scaled recipes, emulated: MXFP8 (E5M2 gradients in fp32), NVFP4, Float8BlockScaling
    # with 1x128 activations (a partial block: K=144) and 128x128 weight tiles.
    e4 = {"fwd_dtype": _E4M3, "bwd_dtype": _E4M3}
    yield _call(t(32, 64, dtype=bf16), t(32, 64, dtype=bf16), t(32, dtype=bf16),
                recipe="mxfp8", emulate=True, **e4)  # fmt: skip
    yield _call(t(2, 16, 32), t(64, 32), recipe="mxfp8", emulate=True)
    yield _call(t(16, 32, dtype=bf16), t(48, 32, dtype=bf16), t(48, dtype=bf16), recipe="nvfp4",
                emulate=True, **e4)  # fmt: skip
    yield _call(t(32, 144, dtype=bf16), t(160, 144, dtype=bf16), recipe="block", emulate=True,
                power_2_scale=True, weight_block_rows=128, **e4)  # fmt: skip
    # Native blockwise (its GEMMs emulated off CUDA), a bias, 1x128 weight blocks, main_grad.
    yield _call(t(32, 512, dtype=bf16), t(512, 512, dtype=bf16), t(512, dtype=bf16),
                recipe="block", weight_block_rows=128, **e4)  # fmt: skip
    yield _call(
        t(48, 256, dtype=bf16),
        t(32, 256, dtype=bf16),
        None,
        torch.zeros(32, 256, device=device),
        recipe="block",
        power_2_scale=True,
        **e4,
    )
    # Norm prologues: native blockwise with RMSNorm, emulated MXFP8 with LayerNorm.
    yield _call(unit_rows(32, 512, device=device), t(512, 512), t(512), recipe="block",
                weight_block_rows=128, **e4, norm_weight=t(512), normalization="RMSNorm",
                norm_eps=1e-30)  # fmt: skip
    yield _call(unit_rows(32, 64, device=device), t(32, 64), recipe="mxfp8", emulate=True, **e4,
                norm_weight=t(64), norm_bias=torch.zeros(64, device=device, requires_grad=True),
                normalization="LayerNorm", norm_eps=1e-30)  # fmt: skip
    # save_original_input: the input itself saved, its transposed copy quantised in the backward
    # (per-tensor current scaling, in bf16 and with GELU; emulated MXFP8; native blockwise).
    yield _call(t(2, 16, 32, dtype=bf16), t(32, 32, dtype=bf16), t(32, dtype=bf16), **cur,
                save_original_input=True)  # fmt: skip
    yield _call(t(2, 16, 32), t(32, 32), t(32), **cur, activation="gelu",
                save_original_input=True)  # fmt: skip
    yield _call(t(32, 64), t(32, 64), t(32), recipe="mxfp8", emulate=True, **e4,
                save_original_input=True)  # fmt: skip
    yield _call(t(32, 512, dtype=bf16), t(512, 512, dtype=bf16), None, recipe="block",
                weight_block_rows=128, **e4, save_original_input=True)  # fmt: skip
    # backward_override: high-precision backward GEMMs on the forward's high-precision operands
    # (the norm's output saved) or on its dequantised FP8 operands.
    yield _call(unit_rows(2, 8, 32, device=device), t(16, 32), t(16), **cur, norm_weight=t(32),
                normalization="RMSNorm", norm_eps=1e-30, activation="gelu",
                backward_override="high_precision")  # fmt: skip
    yield _call(t(20, 32, dtype=bf16), t(16, 32, dtype=bf16), t(16, dtype=bf16), **cur,
                backward_override="dequantized")  # fmt: skip
    yield _call(unit_rows(32, 64, device=device), t(32, 64), recipe="mxfp8", emulate=True, **e4,
                norm_weight=t(64), normalization="LayerNorm", norm_eps=1e-30,
                backward_override="dequantized")  # fmt: skip
    yield _call(t(32, 512, dtype=bf16), t(512, 512, dtype=bf16), None,
                torch.zeros(512, 512, device=device), recipe="block", weight_block_rows=128,
                **e4, backward_override="dequantized")  # fmt: skip
    yield _call(t(16, 32), t(48, 32), recipe="nvfp4", emulate=True, **e4,
                backward_override="high_precision")  # fmt: skip
    # NVFP4's recipe options: 16x16 weight tiles, the random Hadamard transform of the wgrad
    # GEMM's operands, stochastic rounding of the gradient (a fixed stream); with a norm.
    rng = torch.tensor([3, 5], device=device)
    yield _call(t(32, 48, dtype=bf16), t(32, 48, dtype=bf16), t(32, dtype=bf16), recipe="nvfp4",
                emulate=True, **e4, weight_block_rows=16, rht=True, stochastic_rounding=True,
                rng_state=rng)  # fmt: skip
    yield _call(unit_rows(16, 32, device=device), t(48, 32), recipe="nvfp4", emulate=True, **e4,
                norm_weight=t(32), normalization="RMSNorm", norm_eps=1e-30, rht=True,
                stochastic_rounding=True, rng_state=rng.clone())  # fmt: skip
    yield _call(t(32, 32), t(16, 32), t(16), recipe="nvfp4", emulate=True, **e4, row_scaled=True,
                weight_block_rows=16, backward_override="dequantized")  # fmt: skip
    # 4over6 block scaling of the input (with the transform of its wgrad copy) and of the
    # weight's 16x16 tiles.
    yield _call(t(32, 48, dtype=bf16), t(32, 48, dtype=bf16), recipe="nvfp4", emulate=True, **e4,
                weight_block_rows=16, rht=True, input_4over6="MAE:448",
                weight_4over6="MSE:256")  # fmt: skip

    # A pre-quantised weight (functional.gemm.quantize_weight): per tensor, delayed (its weight
    # slot), native blockwise with 128x128 blocks, emulated MXFP8, with a dequantised backward.
    def pre(w, recipe, rows=1, emulate=False, scale=None, **kw):
        q = quantize_weight(w.detach(), recipe, _E4M3, False, rows, emulate, scale)
        return dict(zip(WEIGHT_OPERAND, q, strict=True), recipe=recipe, weight_block_rows=rows,
                    emulate=emulate, scale=scale, **kw)  # fmt: skip

    w = t(32, 16, dtype=bf16)
    yield _call(t(2, 5, 16, dtype=bf16), w, t(32, dtype=bf16), **pre(w, "current"))
    w = t(48, 32)
    yield _call(t(16, 32), w, None, torch.zeros(48, 32, device=device),
                **pre(w, "delayed", scale=scale.clone(), grad_amax=pending.clone()))  # fmt: skip
    w = t(512, 512, dtype=bf16)
    yield _call(t(32, 512, dtype=bf16), w, **pre(w, "block", 128, **e4))
    w = t(32, 64)
    yield _call(t(32, 64), w, t(32), **pre(w, "mxfp8", emulate=True, **e4))
    w = t(16, 32, dtype=bf16)
    yield _call(t(20, 32, dtype=bf16), w, **pre(w, "current", backward_override="dequantized"))


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


def linear(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    main_grad: Tensor | None = None,
    recipe: str = "",
    fwd_dtype: torch.dtype = _E4M3,
    bwd_dtype: torch.dtype = _E5M2,
    power_2_scale: bool = False,
    weight_block_rows: int = 1,
    emulate: bool = False,
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
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
    rht: bool = False,
    stochastic_rounding: bool = False,
    rng_state: Tensor | None = None,
    row_scaled: bool = False,
    weight_quantized: Sequence[Tensor] | None = None,
    delay_wgrad: bool = False,
    save_original_input: bool = False,
    input_4over6: str = "",
    weight_4over6: str = "",
) -> Tensor | tuple[Tensor, ...]:
    """``residual + out_scale * activation(norm(inp) @ weight.T + bias)`` through
    ``te::linear_fwd``, every part optional (module docstring); by default ``inp @ weight.T +
    bias`` in high precision.

    ``main_grad`` (fp32, weight's shape): the weight gradient is accumulated into it and
    ``weight.grad`` is left untouched. The recipe arguments are those of
    ``quantization.gemm.GemmArgs``. ``return_branch=True`` also returns ``branch``, a tensor
    with ``inp``'s values whose gradient joins the dgrad GEMM; ``return_amax=True`` also returns
    ``[amax(X), amax(W)]`` (per-tensor recipes; X is the norm's output with a prologue), last.
    ``backward_override`` (with a recipe): ``"high_precision"`` or ``"dequantized"`` backward
    GEMMs (module docstring). NVFP4's options (``recipe="nvfp4"``): ``weight_block_rows=16``
    (16x16 weight tiles), ``rht`` (the random Hadamard transform of the wgrad GEMM's operands),
    ``stochastic_rounding`` (of the gradient; ``rng_state``, int64 ``(seed, offset)``, fixes its
    draws, None draws one from torch's generator), ``row_scaled`` (the input's forward copy
    with a global scale per row; needs ``backward_override``), ``input_4over6`` /
    ``weight_4over6`` (4over6 adaptive block scaling of the input's / the weight's copies:
    ``""`` off, or ``"MAE:448"``, ``"MAE:256"``, ``"MSE:448"``, ``"MSE:256"``, the error
    metric and the E4M3 bound of the global scale; docs/fp8.md).
    GEMMs (module docstring). ``weight_quantized``: ``weight`` already quantised by the recipe,
    the five tensors of :func:`~te_compile.functional.quantize_weight`, used instead of
    quantising ``weight`` (whose gradient is still computed); ``weight`` may then be the FP8
    codes themselves (FP8 primary weights), with ``main_grad`` taking its gradient.
    GEMMs (module docstring). ``delay_wgrad=True``: the backward leaves the weight gradient
    GEMM out (the input's, the bias's and the norm's gradients are computed) and a
    ``functional.gemm.DeferredWgrad`` is also returned (before the amaxes) whose ``compute()``
    runs it later: the modules' ``delay_wgrad_compute`` / ``backward_dw()``. Eager only: under
    ``torch.compile`` no tensor written by the backward can leave the compiled graph.
    ``save_original_input=True`` (with a recipe; Transformer Engine's option): the backward
    keeps ``inp`` itself (no bytes of its own when the caller keeps ``inp`` alive, e.g. an input
    several modules read) instead of the quantised transposed copy the forward would make, and
    quantises it again for the wgrad GEMM: the same gradients; not with ``DelayedScaling``
    (ValueError), nor with a norm prologue. In high precision the input is what is saved
    anyway.
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
    if save_original_input:
        check_bool("te.linear", save_original_input=save_original_input)
        save_original_input = bool(recipe)  # high precision saves the input itself anyway
    stash = None
    if delay_wgrad:
        DeferredWgrad.check("te.linear", delay_wgrad)
        n = weight.shape[0] if weight.dim() == 2 else 0
        stash = inp.new_empty((*inp.shape[:-1], _out_features(n, activation)))
    if (
        recipe or normalization or activation or return_branch or residual is not None
        or out_scale != 1.0 or norm_weight is not None or norm_bias is not None
        or scale is not None or grad_amax is not None or backward_override or rht
        or stochastic_rounding or rng_state is not None or row_scaled
        or weight_quantized is not None
        or stash is not None or save_original_input or input_4over6 or weight_4over6
        or recipe_args_not_default(fwd_dtype, bwd_dtype, power_2_scale, weight_block_rows, emulate)
        or norm_eps != 1e-5 or zero_centered_gamma is not False
        or glu_interleave_size is not None or limit != 7.0 or alpha != 1.702
        or glu_linear_offset != 1.0
    ):  # fmt: skip
        check_bool(
            "te.linear", power_2_scale=power_2_scale, emulate=emulate,
            zero_centered_gamma=zero_centered_gamma, return_branch=return_branch, rht=rht,
            stochastic_rounding=stochastic_rounding, row_scaled=row_scaled,
        )  # fmt: skip
        check_gemm_args(
            "te.linear",
            {"scale": scale, "grad_amax": grad_amax, "norm_weight": norm_weight,
             "norm_bias": norm_bias, "residual": residual},
            fwd_dtype=fwd_dtype, bwd_dtype=bwd_dtype, power_2_scale=power_2_scale,
            weight_block_rows=weight_block_rows, emulate=emulate, norm_eps=norm_eps,
            glu_interleave_size=glu_interleave_size, limit=limit, alpha=alpha,
            glu_linear_offset=glu_linear_offset, out_scale=out_scale,
        )  # fmt: skip
        check_same_device("te.linear", "inp", inp, norm_weight=norm_weight, norm_bias=norm_bias,
                          residual=residual)  # fmt: skip
        if stochastic_rounding and rng_state is None:
            rng_state = new_rng_state(inp.device)
        args += (
            recipe, fwd_dtype, bwd_dtype, power_2_scale, weight_block_rows, emulate, scale,
            grad_amax, norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma,
            activation, glu_interleave_size or 0, limit, alpha, glu_linear_offset, residual,
            float(out_scale), return_branch, backward_override, rht, stochastic_rounding,
            rng_state, row_scaled,
            *(weight_quantized if weight_quantized is not None else (None,) * 5),
            stash, save_original_input,
        )  # fmt: skip
        if input_4over6 or weight_4over6:
            for name, value in (("input_4over6", input_4over6), ("weight_4over6", weight_4over6)):
                if not isinstance(value, str):
                    raise TypeError(f"te.linear: {name} must be a str, got {value!r}")
            args += (input_4over6, weight_4over6)
    out, branch, saved = _linear(*args)
    if not (return_branch or return_amax or stash is not None):
        return out
    check_bool("te.linear", return_amax=return_amax)
    result = (out, branch) if return_branch else (out,)
    if stash is not None:
        result += (_deferred(args, saved),)
    if return_amax:
        result += (saved[-1] if recipe in PER_TENSOR else inp.new_empty(0, dtype=torch.float32),)
    return result
