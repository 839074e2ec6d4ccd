"""The recipe as data: where a recipe object becomes the GEMM families' arguments.

:func:`recipe_specs` turns a recipe object into the three ``functional.spec.QuantSpec`` of a
GEMM's input, weight and gradient, and :func:`gemm_args` is the one place that reads a recipe
for a GEMM: from the autocast state, the GEMM's input and weights and the FP8 states of its
GEMMs it makes a :class:`GemmArgs`, those specs (native or emulated GEMMs decided here) and the
delayed-scaling state tensors of each GEMM. The module entry points below (:func:`linear`,
:func:`mlp`, :func:`grouped_linear`) call the family function of ``te_compile.functional``
with :meth:`GemmArgs.op_kwargs` and record the amaxes the op measured; none chooses an op per
recipe: there is one op per GEMM shape (``functional.gemm`` has the tables).

Outside an enabled ``te_compile.autocast`` the specs are those of high precision (``""``), so
a module's forward reads the same with and without FP8. Calibration (``docs/fp8.md``): the
entry points run high precision and keep each GEMM's FP8 state (:func:`calibrate`; a norm
prologue's output computed once more for its amax, ``mlp`` as two ``linear`` calls). Weight
caching (``is_first_microbatch``, ``docs/fp8.md``): a module hands the entry points a
:class:`WeightCache` (:func:`cached_weight`), not read outside an FP8 autocast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from te_compile import functional as F
from te_compile._checks import check_choice
from te_compile.functional import quantize_table as _q
from te_compile.functional.gemm import PER_TENSOR, blockwise_supported
from te_compile.functional.grouped_gemm import nvfp4_dtype
from te_compile.functional.linear_ops import linear_per_tensor
from te_compile.functional.mlp_ops import mlp_fast_path
from te_compile.functional.quantize_mx_ref import nvfp4_weight_values, tensor_amax
from te_compile.functional.spec import QuantSpec
from te_compile.quantization.device import is_fp8_block_scaling_available
from te_compile.quantization.fp8_gemm import FP8GemmState, delayed_scales
from te_compile.quantization.recipe import FP8_QPARAMS, Recipe
from te_compile.quantization.recompute import checkpoint
from te_compile.quantization.state import AutocastState, check_power_2_scales, get_autocast_state

__all__ = [
    "MLP_AS_TWO_LINEARS",
    "ROLES",
    "GemmArgs",
    "KeptWeight",
    "Norm",
    "WeightCache",
    "cached_weight",
    "calibrate",
    "check_first_microbatch",
    "dequantized",
    "gemm_args",
    "grouped_linear",
    "kept_weights",
    "linear",
    "mlp",
    "mlp_as_two_linears",
    "quantized",
    "recipe_specs",
]

# Test and benchmark overrides, not configuration: tests/ and bench/ patch them to compare one
# path against another (mock.patch.object / harness.with_setting); users never set them.
# False: Float8BlockScaling GEMMs emulated even where native ones exist.
_NATIVE_BLOCK = True
# True: every per-tensor FP8 GEMM runs emulated (``functional.gemm.GEMMS["tensorwise_emulated"]``).
_EMULATE = False
# False: LayerNormMLP runs te::linear twice around the activation instead of te::mlp (same bytes).
_FUSE_MLP = True

# A norm prologue: (weight, bias, normalization, eps, zero_centered_gamma).
Norm = tuple[Tensor, Tensor | None, str, float, bool]


class GemmArgs(NamedTuple):
    """A recipe as the GEMM family ops take it: ``specs``, the quantisation of the input, the
    weight and the gradient (``functional.spec.QuantSpec``; all ``QuantSpec()`` in high
    precision); ``scales`` / ``grad_amaxes``: per GEMM, the delayed scale ``[3]`` (None but
    under delayed scaling) and the ``[1]`` buffer the backward writes the gradient's amax into
    (per-tensor recipes); ``backward_override``: the recipe's (``""`` for None)."""

    specs: tuple[QuantSpec, QuantSpec, QuantSpec] = (QuantSpec(),) * 3
    scales: tuple[Tensor | None, ...] = ()
    grad_amaxes: tuple[Tensor | None, ...] = ()
    backward_override: str = ""

    @property
    def recipe(self) -> str:
        """The recipe kind (``""`` for high precision)."""
        return self.specs[0].kind

    def op_kwargs(self, amaxes: tuple[str, ...] = ("",)) -> dict[str, Any]:
        """The family functions' keyword arguments: the specs by their names, ``backward_override``
        where set and, under a per-tensor recipe, each GEMM's ``scale`` and ``grad_amax``
        (``amaxes``: their names' suffixes, one per GEMM; ``()``: none) with ``return_amax``."""
        if not self.recipe:  # high precision: the functions' defaults (traced: nothing encoded)
            return {}
        x, w, g = self.specs
        kw: dict[str, Any] = {"input_spec": x, "weight_spec": w, "grad_spec": g}
        if self.backward_override:
            kw["backward_override"] = self.backward_override
        if self.recipe in PER_TENSOR and amaxes:
            for suffix, scale, amax in zip(amaxes, self.scales, self.grad_amaxes, strict=True):
                kw.update({f"scale{suffix}": scale, f"grad_amax{suffix}": amax})
            kw["return_amax"] = True
        return kw


# Returned, not built, in traced code: torch 2.11's dynamo cannot build a NamedTuple whose
# omitted fields default to a QuantSpec (a graph break per module call).
_HIGH_ARGS = GemmArgs()

ROLES = ("input", "weight", "grad")


class KeptWeight:
    """One weight's kept pre-quantised copy: ``tensors`` (``functional.quantize_weight``'s) and the
    ``key`` of the recipe settings it was cast with. An object whose attributes a True call sets: a
    compiled step then guards on neither (a dict entry that changed would be guarded on)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.tensors: list[Tensor] | None = None


def kept_weights(*names: str) -> dict[str, KeptWeight]:
    """A module's store of kept FP8 weights (``is_first_microbatch``), one entry per weight."""
    return {name: KeptWeight() for name in names}


class WeightCache(NamedTuple):
    """A module's kept pre-quantised weights (module docstring): ``store`` (from
    :func:`kept_weights`), and ``first``, the forward's ``is_first_microbatch``."""

    store: dict[str, KeptWeight]
    first: bool | None


def check_first_microbatch(owner: str, is_first_microbatch: object) -> None:
    """``is_first_microbatch`` is None or a bool."""
    check_choice(owner, "is_first_microbatch", is_first_microbatch, (None, True, False))


# The recipe families FP8 primary weights are kept for (quantization.primary), by the dtype and
# dim of the weight's scale: the autocast recipe that reads them, what they are, its predicate.
_PRIMARY = {
    "tensor": (
        "Float8CurrentScaling or DelayedScaling",
        "per-tensor FP8 codes",
        "float8_per_tensor_scaling",
    ),
    "block": ("Float8BlockScaling", "Float8BlockScaling blocks", "float8_block_scaling"),
    "mxfp8": ("MXFP8BlockScaling", "MXFP8 blocks", "mxfp8"),
    "nvfp4": ("NVFP4BlockScaling", "NVFP4 blocks", "nvfp4"),
}


def primary_kind(
    owner: str, state: AutocastState, name: str, weight_quantized: Sequence[Tensor] | None
) -> str:
    """The kind of an FP8 primary weight's operand (:data:`_PRIMARY`; ``""``: None, not one),
    told by its scale: one fp32 scale per tensor, fp32 block scales, MXFP8's uint8 (E8M0) ones,
    NVFP4's E4M3 ones. Such a weight ``name`` runs inside an FP8 autocast of the recipe family
    it was made for (per-tensor codes: either per-tensor recipe; blocks: a block-scaled recipe
    of the same weight blocks; under ``backward_override="high_precision"`` the backward reads
    the weight's values, ``quantization.primary``). Another recipe is Transformer Engine's
    "Recipe mismatch" (a ``NotImplementedError``, which is a ``RuntimeError`` as TE's is)."""
    if weight_quantized is None:
        return ""
    data, scale = weight_quantized[:2]
    kind = {torch.uint8: "mxfp8", torch.float8_e4m3fn: "nvfp4"}.get(
        scale.dtype, "block" if scale.dim() == 2 else "tensor"
    )
    recipe, (made, kept, family) = state.recipe, _PRIMARY[kind]
    if not state.enabled:
        raise NotImplementedError(
            f"{owner}: FP8 primary weights (quantized_model_init) run inside te_compile.autocast "
            f"with {made}, got {'calibration' if state.calibration else 'no FP8 autocast'}"
        )
    if not getattr(recipe, family)():
        raise NotImplementedError(
            f"{owner}: Recipe mismatch for {name!r}: the weight holds {kept} "
            f"(quantized_model_init with {made}), which autocast's {type(recipe).__name__} "
            f"cannot use; run it under te_compile.autocast(recipe={made}()), or build "
            "the module outside quantized_model_init to use this recipe"
        )
    if kind != "tensor":
        w, wide = recipe_specs(recipe)[1], {"block": 128, "mxfp8": 32, "nvfp4": 16}[kind]
        rows = 1 if scale.shape[0] == data.shape[0] else wide
        if (w.block_rows, w.fp8_dtype) != (rows, data.dtype):
            raise NotImplementedError(
                f"{owner}: Recipe mismatch for {name!r}: the weight holds {rows}x{wide} blocks "
                f"of {data.dtype}, autocast's {type(recipe).__name__} quantises weights in "
                f"{w.block_rows}x{wide} blocks of {w.fp8_dtype}"
            )
    return kind


def as_gemm_takes(spec: QuantSpec, weight_q: Sequence[Tensor] | None, kind: str,
                  dtype: torch.dtype = torch.float32):  # fmt: skip
    """An FP8 primary weight's block-scaled operand (``kind``: :func:`primary_kind`'s) as the
    GEMM of weight spec ``spec`` takes it: the codes, or their fp32 values where the GEMM is
    emulated (MXFP8's always are); grouped (``[G, N, K]``), each expert's values in the
    activation ``dtype`` and the dgrad copy as ``[G, N, K]`` (``functional.grouped_weight``)."""
    if kind in ("", "tensor") or not spec.emulate:
        return weight_q
    data, s, data_t, s_t, amax = weight_q
    f32, none = torch.float32, s.new_empty(0, dtype=torch.float32)
    w, w_t = dequantized(data, s, spec, f32, amax), dequantized(data_t, s_t, spec, f32, amax)
    if data.dim() == 3:
        w, w_t = w.to(dtype), w_t.transpose(1, 2).to(dtype).contiguous()
    return [w, none, w_t, none.clone(), none.clone()]


def dequantized(codes: Tensor, scale_inv: Tensor, spec: QuantSpec, dtype: torch.dtype,
                g: Tensor | None = None) -> Tensor:  # fmt: skip
    """The values of an FP8 primary weight's ``codes`` (float8, or their bytes in an operand)
    with their ``scale_inv``, kept as ``spec`` keeps them (``quantization.primary._cast``), in
    ``dtype``: ``te.dequantize``'s table (``functional.quantize_table``); NVFP4's E2M1 elements
    with their global scale ``g``. A grouped ``[G, N, K]`` weight in blocks: expert by expert."""
    if codes.dim() > 2 and spec.kind != "current":
        gs = g if spec.kind == "nvfp4" else [None] * len(codes)
        experts = zip(codes, scale_inv, gs, strict=True)
        return torch.stack([dequantized(c, s, spec, dtype, e) for c, s, e in experts])
    if spec.kind == "nvfp4":
        return nvfp4_weight_values(codes.view(torch.float8_e4m3fn), scale_inv, g).to(dtype)
    data = codes.view(spec.fp8_dtype)
    q = _q.Quantized(data, scale_inv, None, None, None, spec.kind, spec.block_rows)
    return _q.dequantize(q, dtype)


def cached_weight(
    args: GemmArgs,
    weight: Tensor,
    cache: WeightCache | None,
    name: str,
    index: int = 0,
    *,
    grouped: bool = False,
) -> list[Tensor] | None:
    """The pre-quantised ``weight`` (``functional.quantize_weight``; ``grouped``: a ``[G, N,
    K]`` weight by ``functional.quantize_grouped_weight``) that ``cache`` gives for GEMM
    ``index`` of ``args`` (module docstring), or None: the op quantises ``weight``."""
    if cache is None or cache.first is None or not args.recipe:
        return None
    spec = args.specs[1]
    # Current and delayed casts are interchangeable.
    key = replace(spec, kind="current") if args.recipe in PER_TENSOR else spec
    kept = cache.store[name]
    if not cache.first and kept.key == key:  # True never reads it (a compiled True step does
        return kept.tensors  # not guard on it)
    scale = args.scales[index] if args.recipe == "delayed" else None
    if grouped and args.recipe == "nvfp4" and (spec.four_over_six or spec.block_rows != 16):
        raise NotImplementedError(
            "GroupedLinear: is_first_microbatch under NVFP4BlockScaling keeps the weight "
            "with its 16x16 tiles and without 4over6 only (the recipe has "
            f"disable_2d_quantization={spec.block_rows != 16}, nvfp4_4over6 scope "
            f"covering the weight={bool(spec.four_over_six)}); pass is_first_microbatch=None"
        )
    quantize = F.quantize_grouped_weight if grouped else F.quantize_weight
    kept.key, kept.tensors = key, quantize(weight.detach(), spec, scale)
    return kept.tensors


def recipe_specs(recipe: Recipe) -> tuple[QuantSpec, QuantSpec, QuantSpec]:
    """How ``recipe`` quantises a GEMM's input, weight and gradient (``ROLES``) as
    ``functional.spec.QuantSpec``s: the kind, the FP8 format (forward for inputs and weights,
    backward for gradients), block rows, power-of-two scales and NVFP4's options (from each
    operand's QParams field; :func:`_checked_qparams` refuses one no kernel applies). The one
    place a recipe's fields are read (:func:`gemm_args`, ``te_compile.quantize``,
    ``ops.Quantize``, FP8 primary weights). MXFP8 and NVFP4 GEMMs are emulated (native ones
    need Blackwell); Float8BlockScaling's are native (:func:`gemm_args` may emulate them)."""
    if torch.compiler.is_compiling():  # Recipe.derive's, made eagerly: read, not traced
        specs = recipe.__dict__.get("_memo", {}).get("specs")  # (no truth test: a len() guard)
        if specs is not None:
            return specs
    return _memoised(recipe, "specs", _recipe_specs, recipe)


def _memoised(recipe: Recipe, key: Any, make: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``make(*args, **kw)``, kept in ``recipe``'s memo under ``key`` in eager calls; under
    dynamo, which specialises on the recipe, built in the graph (``dataclasses.replace`` only
    where a spec changes: dynamo traces each one, ~10 ms of a compile)."""
    if torch.compiler.is_compiling():
        return make(*args, **kw)
    memo = recipe.memo()
    if (out := memo.get(key)) is None:
        out = memo[key] = make(*args, **kw)
    return out


def _replaced(specs: tuple, **changes: Any) -> tuple:  # (kind / emulate: shared by the specs)
    same = all(getattr(specs[0], name) == value for name, value in changes.items())
    return specs if same else tuple(replace(s, **changes) for s in specs)


def _recipe_specs(recipe: Recipe) -> tuple[QuantSpec, QuantSpec, QuantSpec]:
    if recipe.nvfp4():
        qparams = _checked_qparams(recipe, _FP4_QPARAMS)

        def nvfp4(q: Any, role: str) -> QuantSpec:
            return QuantSpec("nvfp4", block_rows=16 if q.fp4_2d_quantization else 1, emulate=True,
                             rht=q.random_hadamard_transform,
                             stochastic_rounding=q.stochastic_rounding,
                             row_scaled=role == "input" and recipe.row_scaled_activation,
                             four_over_six=_four_over_six(recipe, role))  # fmt: skip

        return tuple(nvfp4(q, role) for q, role in zip(qparams, ROLES, strict=True))  # type: ignore[return-value]
    fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    kind = recipe.kind
    if kind in ("block", "current"):  # (current scaling: block_rows 1, QuantSpec's default)
        dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
                recipe.grad_block_scaling_dim) if kind == "block" else (1, 1, 1)  # fmt: skip
        qs = _checked_qparams(recipe, _FP8_QPARAMS)
        # MMParams (current scaling): the backward GEMMs' fast accumulation (both read g).
        fast = {} if kind == "block" else {
            "fast_dgrad": not recipe.fp8_gemm_dgrad.use_split_accumulator,
            "fast_wgrad": not recipe.fp8_gemm_wgrad.use_split_accumulator}  # fmt: skip
        each = zip(dims, (fwd, fwd, bwd), qs, ({}, {}, fast), strict=True)
        return tuple(QuantSpec(kind, dtype, 128 if dim == 2 else 1, q.power_2_scale, **o)
                     for dim, dtype, q, o in each)  # type: ignore[return-value]  # fmt: skip
    kw = {"emulate": True} if recipe.mxfp8() else {}
    tiles = 32 if recipe.mxfp8() and recipe.enable_2d_quantization else 1
    return (QuantSpec(kind, fwd, **kw), QuantSpec(kind, fwd, tiles, **kw),
            QuantSpec(kind, bwd, **kw))  # fmt: skip


Recipe.derive = _recipe_specs


# The per-operand QParams fields of a recipe (input, weight, gradient: ``ROLES``), and the
# options each takes here. NVFP4: the Hadamard transform is of the wgrad GEMM's operands (the
# input's and the gradient's columnwise copies), stochastic rounding of the gradient, 16x16
# tiles of the weight (the one operand both of whose copies feed a GEMM from one quantisation);
# Float8CurrentScaling and Float8BlockScaling: power-of-two scales on any operand.
_FP4_QPARAMS = {
    "fp4_quant_fwd_inp": ("random_hadamard_transform",),
    "fp4_quant_fwd_weight": ("fp4_2d_quantization",),
    "fp4_quant_bwd_grad": ("random_hadamard_transform", "stochastic_rounding"),
}
_FP8_QPARAMS = dict.fromkeys(FP8_QPARAMS, ("power_2_scale",))
_QPARAM_OPTIONS = ("power_2_scale", "random_hadamard_transform", "stochastic_rounding",
                   "fp4_2d_quantization")  # fmt: skip


def _checked_qparams(recipe: Recipe, fields: dict[str, tuple[str, ...]]) -> list[Any]:
    """``recipe``'s per-operand QParams (``fields``: name -> the options implemented for that
    operand); an option of :data:`_QPARAM_OPTIONS` set where it is not implemented, or a nonzero
    ``amax_epsilon``, raises NotImplementedError naming the field, rather than being ignored."""
    out, owner = [getattr(recipe, name) for name in fields], type(recipe).__name__
    for name, q in zip(fields, out, strict=True):
        if refused := [o for o in _QPARAM_OPTIONS if o not in fields[name] and getattr(q, o)]:
            raise NotImplementedError(
                f"{owner}: {name}.{refused[0]}=True is not implemented for this operand "
                f"(te_compile's {owner} takes "
                f"{', '.join(f'{n}.{o}' for n, os in fields.items() for o in os)})"
            )
        if q.amax_epsilon:
            raise NotImplementedError(
                f"{owner}: {name}.amax_epsilon={q.amax_epsilon!r} is not implemented (the "
                "GEMMs' quantisers take no amax floor); use 0.0"
            )
    x, g = out[0], out[2]
    if fields is _FP4_QPARAMS and x.random_hadamard_transform != g.random_hadamard_transform:
        raise ValueError(
            f"{owner}: fp4_quant_fwd_inp.random_hadamard_transform and "
            "fp4_quant_bwd_grad.random_hadamard_transform must be equal (the wgrad GEMM "
            "multiplies the two transformed operands, whose transforms cancel only together), "
            f"got {x.random_hadamard_transform} and {g.random_hadamard_transform}"
        )
    return out


# The operands each scope of NVFP4BlockScaling's nvfp4_4over6 / nvfp4_4over6_e4m3_use_256 covers:
# "activations" is the forward input (Transformer Engine never applies 4over6 to gradients).
_4OVER6_ROLES = {"none": (), "weights": ("weight",), "activations": ("input",),
                 "all": ("input", "weight")}  # fmt: skip


def _four_over_six(recipe: Recipe, role: str) -> str:
    """The 4over6 setting (``functional.quantize_mx_ref.FOUR_OVER_SIX``) of ``role`` under the
    NVFP4 ``recipe``: ``""`` outside ``nvfp4_4over6``'s scope, else its error metric and the
    E4M3 bound of the global scale (256 inside ``nvfp4_4over6_e4m3_use_256``'s scope)."""
    if role not in _4OVER6_ROLES[recipe.nvfp4_4over6]:
        return ""
    bound = 256 if role in _4OVER6_ROLES[recipe.nvfp4_4over6_e4m3_use_256] else 448
    return f"{recipe.nvfp4_4over6_err_mode}:{bound}"


def gemm_args(
    owner: str,
    state: AutocastState,
    inp: Tensor,
    weights: Sequence[Tensor],
    metas: Sequence[FP8GemmState] = (),
    *,
    grouped: bool = False,
) -> GemmArgs:
    """The GEMM family arguments of ``state``'s recipe (:func:`recipe_specs`'s specs) for GEMMs
    with these ``weights`` (2-D, or ``[G, N, K]`` with ``grouped``) and input, with the
    delayed-scaling state of ``metas``, one per GEMM (``FP8GemmState.delayed_scale``: a state's
    first delayed step runs current scaling). Float8BlockScaling runs native blockwise GEMMs
    (Hopper, CUDA 12.9+) where cuBLAS takes the operands (``functional.blockwise_supported``; a
    grouped GEMM also needs a bf16 input), emulated elsewhere; MXFP8 and NVFP4 are emulated."""
    if not state.enabled:
        return _HIGH_ARGS
    _note_recipe(owner, state, metas)
    recipe = state.recipe
    override = recipe.backward_override or ""
    specs = x, w, g = recipe_specs(recipe)
    if x.row_scaled and recipe.backward_override is None:  # (NVFP4's option)
        raise ValueError(
            f"{owner}: NVFP4BlockScaling(row_scaled_activation=True) needs backward_override "
            "'high_precision' or 'dequantized' (a row-scaled NVFP4 input has no columnwise "
            "copy for the wgrad GEMM, as in Transformer Engine), got None"
        )
    if x.kind == "block":
        if x.block_rows != 1 or g.block_rows != 1:
            raise NotImplementedError(
                f"{owner}: Float8BlockScaling with 128x128 activation or gradient blocks is not "
                "implemented (1x128, the default, is)"
            )
        w2d = [t[0] if grouped else t for t in weights]
        native = (
            inp.device.type == "cuda"
            and _NATIVE_BLOCK
            and is_fp8_block_scaling_available()
            and (not grouped or inp.dtype is torch.bfloat16)
            and all(blockwise_supported(t, w.block_rows, x.fp8_dtype, g.fp8_dtype) for t in w2d)
        )
        specs = _memoised(recipe, ("block", not native), _replaced, specs, emulate=not native)
    if x.kind in ("nvfp4", "mxfp8", "block"):  # (no delayed scales, no amaxes)
        return GemmArgs(specs, backward_override=override)
    has_tokens = inp.numel() > 0  # a zero-token step does not calibrate (FP8GemmState)
    scales = delayed_scales(owner, state, has_tokens, metas)
    kind = "delayed" if scales and all(s is not None for s in scales) else "current"
    if kind == "current":  # current scaling, or a state's calibration step
        scales = (None,) * len(scales)
    key = (kind, _EMULATE)
    # The per-tensor quantisers take no power-of-two option; autocast refuses a recipe that asks
    # for it, and this a field set since (which empties the memo).
    if recipe.float8_current() and (torch.compiler.is_compiling() or key not in recipe.memo()):
        check_power_2_scales(owner, recipe)
    specs = _memoised(recipe, key, _replaced, specs, kind=kind, emulate=_EMULATE)
    return GemmArgs(specs, scales, tuple(meta.grad_amax for meta in metas), override)


def _note_recipe(owner: str, state: AutocastState, metas: Sequence[FP8GemmState]) -> None:
    """Each GEMM state remembers the recipe class of its last eager FP8 or calibration call and
    warns when it changes (``FP8GemmState.note_recipe``); not while dynamo traces."""
    if not torch.compiler.is_compiling():
        for meta in metas:
            meta.note_recipe(owner, state.recipe)


def calibrate(
    owner: str, state: AutocastState, meta: FP8GemmState, x: Tensor, weight: Tensor
) -> AutocastState:
    """Under calibration (``state.calibration``) with a per-tensor recipe, keep the GEMM's FP8
    state ``meta`` as an FP8 forward would: fold the last amaxes into the history and update the
    scales (delayed scaling; its first step only marks the state calibrated), then record the
    amaxes of the GEMM's input ``x`` and ``weight``. Returns the state the GEMM then runs with:
    high precision, calibration done. Other recipes keep no amax state: nothing is recorded."""
    if not state.calibration:
        return state
    _note_recipe(owner, state, (meta,))
    if state.recipe.float8_per_tensor_scaling():
        meta.delayed_scale(owner, state, x.numel() > 0)
        with torch.no_grad():
            meta.record(torch.stack([tensor_amax(x), tensor_amax(weight)]), state)
    return state._replace(calibrating=False)


def quantized() -> bool:
    """Whether the GEMMs run now are quantised: inside an enabled ``te_compile.autocast``."""
    return get_autocast_state().enabled


def _apply_norm(inp: Tensor, norm: Norm) -> Tensor:
    weight, bias, normalization, eps, zcg = norm
    if normalization == "LayerNorm":
        return F.layernorm(inp, weight, bias, eps, zero_centered_gamma=zcg)
    return F.rmsnorm(inp, weight, eps, zero_centered_gamma=zcg)


def _norm_kwargs(norm: Norm | None) -> dict[str, Any]:
    if norm is None:
        return {}
    weight, bias, normalization, eps, zcg = norm
    return {"normalization": normalization, "norm_weight": weight, "norm_bias": bias,
            "norm_eps": eps, "zero_centered_gamma": zcg}  # fmt: skip


def linear(
    owner: str,
    meta: FP8GemmState,
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    main_grad: Tensor | None = None,
    *,
    norm: Norm | None = None,
    cache: WeightCache | None = None,
    cache_name: str = "weight",
    weight_quantized: Sequence[Tensor] | None = None,
    defer: list | None = None,
    **epilogue: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """A module's linear through ``te::linear``: the recipe of the autocast state (high
    precision outside it) with ``meta``'s FP8 state, an optional ``norm`` prologue (:data:`Norm`)
    and the epilogue arguments of ``functional.linear`` (``activation``, ``residual``,
    ``out_scale``, ``return_branch``, ...). The forward's amaxes go into ``meta`` (per-tensor
    recipes). ``cache``: the module's kept FP8 weights and ``is_first_microbatch`` (module
    docstring), ``cache_name`` this weight's entry. ``weight_quantized``: ``weight``'s
    pre-quantised operand (FP8 primary weights, ``quantization.primary``), under an autocast of
    the recipe it was made for (:func:`primary_kind`). ``defer``: a list, the weight gradient is
    delayed (``delay_wgrad_compute``): ``(DeferredWgrad, weight)`` is appended."""
    state = get_autocast_state()
    kind = primary_kind(owner, state, cache_name, weight_quantized)
    if state.calibration:  # a prologue's GEMM input is the norm's output: computed for its amax
        with torch.no_grad():
            x = inp if norm is None else _apply_norm(inp.detach(), norm)
        state = calibrate(owner, state, meta, x, weight)
    if epilogue.get("save_original_input") and state.enabled:
        _refuse_delayed(owner, state)
    if defer is not None and weight.requires_grad:  # (else no weight gradient to delay)
        epilogue = {**epilogue, "delay_wgrad": True}
    if main_grad is not None and getattr(weight, "overwrite_main_grad", False):  # TE's attribute
        epilogue = {**epilogue, "overwrite_main_grad": True}
    if not (state.enabled or norm or epilogue):  # te.Linear's hot path in high precision
        return F.linear(inp, weight, bias, main_grad=main_grad)
    args = gemm_args(owner, state, inp, (weight,), (meta,))
    weight_q = as_gemm_takes(args.specs[1], weight_quantized, kind) or cached_weight(
        args, weight, cache, cache_name
    )
    if not (epilogue or weight_q is not None or args.backward_override) and (
        args.recipe in PER_TENSOR
    ):  # te.Linear's and te.LayerNormLinear's FP8 hot path: eager, the op's layers skipped
        out = linear_per_tensor(inp, weight, bias, main_grad, args.specs, args.scales[0],
                                args.grad_amaxes[0], norm)  # fmt: skip
        if out is not None:
            return _outputs(out, {"return_amax": True}, state, (meta,), defer, weight)
    kw = {**_norm_kwargs(norm), **epilogue, **args.op_kwargs()}
    if weight_q is not None:
        # A kept NVFP4 weight holds its 4over6 (cached_weight keys on it): the op is told none.
        kw.update(weight_quantized=weight_q, weight_spec=replace(args.specs[1], four_over_six=""))
    out = F.linear(inp, weight, bias, main_grad=main_grad, **kw)
    return _outputs(out, kw, state, (meta,), defer, weight)


def _outputs(out, kw: dict[str, Any], state: AutocastState, metas, defer, weight) -> Any:
    """A family op's outputs ``(out, branch?, deferred?, amax?)`` as a module takes them: the
    amaxes (``kw`` asked for them) recorded into ``metas``, the deferred weight gradient
    appended to ``defer`` (``kw`` delayed it), the rest."""
    out = list(out) if isinstance(out, tuple) else [out]
    if kw.get("return_amax"):
        metas[0].record(out.pop(), state, *metas[1:])
    if kw.get("delay_wgrad"):
        defer.append((out.pop(), weight))
    return tuple(out) if len(out) > 1 else out[0]


def _refuse_delayed(owner: str, state: AutocastState) -> None:
    """save_original_input under DelayedScaling: refused, as Transformer Engine refuses it (the
    first steps of a delayed-scaling state run current scaling; the recipe decides)."""
    if state.recipe.delayed():
        raise ValueError(
            f"{owner}: save_original_input=True does not work with the DelayedScaling recipe "
            "(the backward would quantise the input again with a scale the amax-history update "
            "may have changed)"
        )


def mlp(
    owner: str,
    metas: tuple[FP8GemmState, FP8GemmState],
    inp: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    activation: str,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    *,
    norm: Norm | None = None,
    activation_params: dict[str, float] | None = None,
    main_grads: tuple[Tensor, Tensor] | None = None,
    recompute_fc1: bool = False,
    cache: WeightCache | None = None,
    weights_quantized: tuple[Sequence[Tensor] | None, Sequence[Tensor] | None] = (None, None),
    defer: list | None = None,
) -> Tensor:
    """``fc2(activation(fc1(norm(inp))))`` through ``te::mlp`` with the autocast state's
    recipe, each GEMM as :func:`linear` runs one (``metas``: their FP8 states; ``main_grads``,
    ``weights_quantized``: per weight; ``cache`` entries ``"fc1_weight"`` / ``"fc2_weight"``;
    ``defer``: both weight gradients), or as two :func:`linear` calls around the activation op
    where :func:`mlp_as_two_linears` says (or ``_FUSE_MLP = False``). ``activation_params``:
    ``clamped_swiglu``'s ``limit``, ``alpha``, ``glu_linear_offset``. ``recompute_fc1``: the
    norm, FC1 and the activation are recomputed in the backward (:func:`~te_compile.checkpoint`,
    FP8 state included) rather than their outputs saved; FC2 runs once."""
    act_kw = activation_params or {}
    state = get_autocast_state()
    (q1, q2), (g1, g2) = weights_quantized, main_grads or (None, None)
    pairs = ((fc1_weight, g1), (fc2_weight, g2))
    overwrite = any(g is not None and getattr(w, "overwrite_main_grad", False) for w, g in pairs)
    by_op = mlp_as_two_linears(state, recompute_fc1, defer, overwrite)
    kinds = [primary_kind(owner, state, n, q) for n, q in (("fc1_weight", q1), ("fc2_weight", q2))]
    if recompute_fc1 and defer is not None:
        raise NotImplementedError(
            f"{owner}: checkpoint=True with delay_wgrad_compute=True is not supported (the "
            "recomputed FC1 would delay its weight gradient twice)"
        )
    if not _FUSE_MLP or by_op:  # op by op: the same bytes

        def fc1_act(x: Tensor) -> Tensor:
            if norm is not None:
                x = _apply_norm(x, norm)
            fc1_out = linear(owner, metas[0], x, fc1_weight, None, g1, cache=cache,
                             cache_name="fc1_weight", weight_quantized=q1, defer=defer)  # fmt: skip
            return F.bias_activation(fc1_out, fc1_bias, activation, **act_kw)

        act = checkpoint(fc1_act, inp, use_reentrant=False) if recompute_fc1 else fc1_act(inp)
        return linear(owner, metas[1], act, fc2_weight, fc2_bias, g2, cache=cache,
                      cache_name="fc2_weight", weight_quantized=q2, defer=defer)  # fmt: skip
    args = gemm_args(owner, state, inp, (fc1_weight, fc2_weight), metas)
    kw = {**_norm_kwargs(norm), **args.op_kwargs(("1", "2")), **act_kw, "main_grad1": g1,
          "main_grad2": g2}  # fmt: skip
    q1, q2 = (as_gemm_takes(args.specs[1], q, k) for q, k in zip((q1, q2), kinds, strict=True))
    kw["fc1_weight_quantized"] = q1 or cached_weight(args, fc1_weight, cache, "fc1_weight", 0)
    kw["fc2_weight_quantized"] = q2 or cached_weight(args, fc2_weight, cache, "fc2_weight", 1)
    kept = kw["fc1_weight_quantized"], kw["fc2_weight_quantized"]
    if args.recipe in ("", *PER_TENSOR) and kept[0] is None and kept[1] is None:
        # te.LayerNormMLP's hot path: eager, the op's layers skipped
        scales, amaxes = (args.scales, args.grad_amaxes) if args.recipe else ((None, None),) * 2
        out = mlp_fast_path(inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation,
                             args.specs, scales, amaxes, (g1, g2), norm, **act_kw)  # fmt: skip
        if out is not None:
            return _outputs(out if args.recipe else out[0], kw, state, metas, None, None)
    out = F.mlp(inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, **kw)
    return _outputs(out, kw, state, metas, None, None)


# What te::mlp does not implement: :func:`mlp` then runs two te::linear calls around the activation
# op (the same bytes); LayerNormMLP's docstring and docs/op_mechanism.md name each (test_mlp.py).
MLP_AS_TWO_LINEARS = ("delay_wgrad_compute", "checkpoint=True", "backward_override",
                      "calibrating=True", "Hadamard transform", "stochastic rounding",
                      "row-scaled activations", "4over6", "overwrite_main_grad")  # fmt: skip


def mlp_as_two_linears(state: AutocastState, recompute_fc1: bool, defer: list | None,
                       overwrite_main_grad: bool = False) -> str:  # fmt: skip
    """The first of :data:`MLP_AS_TWO_LINEARS` that applies to an :func:`mlp` call, or ``""``:
    ``te::mlp`` runs it. The one place that decides."""
    nvfp4 = recipe_specs(state.recipe) if state.enabled and state.recipe.nvfp4() else ()
    applies = (defer is not None, recompute_fc1,
               state.enabled and state.recipe.backward_override is not None, state.calibration,
               any(s.rht for s in nvfp4), any(s.stochastic_rounding for s in nvfp4),
               any(s.row_scaled for s in nvfp4), any(s.four_over_six for s in nvfp4),
               overwrite_main_grad)  # fmt: skip
    return MLP_AS_TWO_LINEARS[applies.index(True)] if True in applies else ""


def grouped_linear(
    owner: str,
    meta: FP8GemmState,
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None,
    *,
    main_grad: Tensor | None = None,
    defer: list | None = None,
    save_original_input: bool = False,
    cache: WeightCache | None = None,
    weight_quantized: Sequence[Tensor] | None = None,
    overwrite_main_grad: bool = False,
) -> Tensor:
    """A module's grouped GEMM (``weight`` ``[G, N, K]``) through ``te::grouped_linear`` with
    the autocast state's recipe (high precision outside it), as :func:`linear` runs a dense one
    (``defer``, ``cache`` with the entry ``"weight"``, ``weight_quantized``:
    ``quantization.primary.grouped_primary``'s; native or emulated GEMMs: :func:`gemm_args`).
    The per-tensor recipes run the wgrad GEMM in FP8 too (``fp8_wgrad``), ``DelayedScaling``
    with ``meta``'s scales for all groups. ``save_original_input``: the backward keeps the input
    itself (high precision, current scaling, the emulated block-scaled recipes); DelayedScaling
    refuses it (as Transformer Engine), the native Float8BlockScaling GEMMs do not implement it."""
    state = get_autocast_state()
    expert = weight_quantized and [t[0] for t in weight_quantized[:2]]  # read as a dense one's
    kind = primary_kind(owner, state, "weight", expert)
    state = calibrate(owner, state, meta, inp, weight)
    args = gemm_args(owner, state, inp, (weight,), (meta,), grouped=True)
    # Current scaling measures no amaxes here (a read each).
    kw = args.op_kwargs(("",) if state.enabled and state.recipe.delayed() else ())
    if save_original_input and args.recipe:  # (high precision keeps its input anyway)
        _refuse_delayed(owner, state)
        if args.recipe == "block" and not args.specs[0].emulate:
            raise NotImplementedError(
                f"{owner}: save_original_input=True is not implemented for the native "
                "Float8BlockScaling grouped GEMMs (they save blockwise FP8 copies of the input); "
                "build the module with save_original_input=False"
            )
        kw["save_original_input"] = True
    if defer is not None and weight.requires_grad:
        kw["delay_wgrad"] = True
    if args.recipe in PER_TENSOR and not args.backward_override:
        kw["fp8_wgrad"] = True
    dtype = nvfp4_dtype(inp) if args.specs[1].kind == "nvfp4" else inp.dtype  # (CPU: fp32)
    weight_q = as_gemm_takes(args.specs[1], weight_quantized, kind, dtype) or cached_weight(
        args, weight, cache, "weight", grouped=True
    )
    kw["overwrite_main_grad"] = overwrite_main_grad  # (TE's attribute of the module's weights)
    if weight_q is not None:  # (cast with the weight's 4over6: the op is told none, as dense)
        kw.update(weight_quantized=weight_q, weight_spec=replace(args.specs[1], four_over_six=""))
    out = F.grouped_linear(inp, m_splits, weight, bias, main_grad=main_grad, **kw)
    return _outputs(out, kw, state, (meta,), defer, weight)
