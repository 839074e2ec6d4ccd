"""FP8 primary weights: ``quantized_model_init`` / ``fp8_model_init`` and ``FP8MasterWeights``.

Modules built inside ``quantized_model_init(recipe=...)`` keep each GEMM weight in FP8 only, as the
recipe casts weights: the Parameter holds the codes, buffers the scales and amax (and the transposed
copy of 1-D blocks), handed to the GEMM op as its pre-quantised operand: no per-step cast. Gradients
go to an fp32 ``weight.main_grad``, else ``.grad``; ``FP8MasterWeights`` keeps fp32 masters for any
optimizer and re-quantises them after each step. ``docs/fp8.md`` ("FP8 primary weights", "FSDP2")
is the full account: what each recipe keeps, usage, memory, grouped layouts, FSDP2, the limits.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn

from te_compile import functional as F
from te_compile._checks import FP8_DTYPES, check_bool
from te_compile._numerics import reciprocal_rn
from te_compile.functional.quantize import scale_from_amax
from te_compile.functional.quantize_mx_ref import nvfp4_weight
from te_compile.functional.spec import QuantSpec
from te_compile.quantization.device import get_default_fp8_recipe
from te_compile.quantization.gemm import dequantized, recipe_specs
from te_compile.quantization.recipe import Recipe
from te_compile.quantization.state import get_autocast_state

__all__ = [
    "FP8MasterWeights",
    "KeepFP8OnCast",
    "clear_high_precision_init_val",
    "fp8_model_init",
    "get_high_precision_init_val",
    "grouped_primary",
    "high_precision_init",
    "is_primary",
    "make_primary",
    "primary_operand",
    "quantized_model_init",
    "weight_values",
]


class _InitState(NamedTuple):
    recipe: Recipe
    preserve: bool


_STATE: list[_InitState | None] = [None]


@contextlib.contextmanager
def quantized_model_init(
    enabled: bool = True,
    recipe: Recipe | None = None,
    preserve_high_precision_init_val: bool = False,
) -> Iterator[None]:
    """Modules built inside keep their GEMM weights in FP8 only (module docstring). ``recipe``:
    the recipe the weights are quantised for (None: ``get_default_fp8_recipe()``);
    ``preserve_high_precision_init_val``: keep the initial high-precision values on the CPU."""
    check_bool("te.quantized_model_init", enabled=enabled,
               preserve_high_precision_init_val=preserve_high_precision_init_val)  # fmt: skip
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(
            f"te.quantized_model_init: recipe must be a Recipe or None, got {recipe!r}"
        )
    previous, keep = _STATE[0], preserve_high_precision_init_val
    _STATE[0] = _InitState(recipe or get_default_fp8_recipe(), keep) if enabled else None
    try:
        yield
    finally:
        _STATE[0] = previous


fp8_model_init = quantized_model_init  # Transformer Engine's older name, same arguments


def _weight_spec(recipe: Recipe, owner: str) -> QuantSpec:
    """How FP8 weights made under ``recipe`` are kept: the per-tensor recipes' weights by current
    scaling of the weight itself (either per-tensor recipe reads them, as Transformer Engine
    casts its primary weights); the block-scaled recipes' in their weight blocks, the codes as a
    native GEMM takes them (an emulated GEMM dequantises them: ``quantization.gemm``)."""
    spec = recipe_specs(recipe)[1]
    if spec.kind in ("current", "delayed"):
        return QuantSpec("current", spec.fp8_dtype)
    if spec.kind in ("block", "nvfp4") or (spec.kind == "mxfp8" and spec.block_rows == 1):
        return spec  # (block: recipe_specs' native spec; gemm_args emulates)
    got = type(recipe).__name__ + ("(enable_2d_quantization=True)" if spec.kind == "mxfp8" else "")
    raise NotImplementedError(
        f"{owner}: FP8 primary weights (quantized_model_init's recipe) support "
        "Float8CurrentScaling, DelayedScaling, Float8BlockScaling, NVFP4BlockScaling and "
        f"MXFP8BlockScaling(enable_2d_quantization=False); got {got} (build the module outside "
        "quantized_model_init to train it with this recipe)"
    )


def _cast(weight: Tensor, spec: QuantSpec) -> list[Tensor]:
    """The five tensors of ``functional.quantize_weight`` of ``weight`` by ``spec`` (MXFP8: the
    codes of ``functional.quantize_mxfp8``, whose values quantize_weight gives), the codes as
    float8 in ``weight``'s shape. A grouped ``[G, N, K]`` weight: per tensor cast as ``[G * N,
    K]`` (one scale); in blocks each expert on its own, as the grouped GEMM casts it (no block
    straddles two experts), stacked ``[G, ...]`` (NVFP4's global scales too, one an expert)."""
    if weight.dim() > 2 and spec.kind != "current":
        parts = [_cast(w, spec) for w in weight.unbind(0)]
        stacked = [torch.stack(t) for t in zip(*parts, strict=True)]
        return stacked if spec.kind == "nvfp4" else [*stacked[:4], parts[0][4]]
    flat = weight.reshape(-1, weight.shape[-1]) if weight.dim() > 2 else weight
    if spec.kind == "nvfp4":  # each element's E2M1 value with its scales, the global scale
        return nvfp4_weight(flat.float(), spec.block_rows == 16, spec.four_over_six)
    if spec.kind == "mxfp8":
        out = [*F.quantize_mxfp8(flat, spec.fp8_dtype), flat.new_empty(0, dtype=torch.float32)]
    else:
        out = F.quantize_weight(flat, spec)
    out[0], out[2] = out[0].view(spec.fp8_dtype).view(weight.shape), out[2].view(spec.fp8_dtype)
    return out


# What each of quantize_weight's five tensors is kept as, by suffix of the weight's name: the
# codes are the Parameter, the others buffers. A transposed copy that is the transpose of the
# codes and scale (per tensor, 128x128 blocks) is not kept: ``primary_operand`` makes it.
_SUFFIXES = ("", "_scale_inv", "_t", "_scale_inv_t", "_amax")
_METHODS = ("copy_", "get_high_precision_init_val", "clear_high_precision_init_val")  # (set below)


def _kept(values: Tensor, spec: QuantSpec) -> dict[str, Tensor]:
    """The tensors of :func:`_cast` that are kept, by suffix (the codes: ``""``)."""
    tensors = _cast(values, spec)
    transposable = spec.kind == "current" or spec.block_rows in (128, 16)  # (16: NVFP4 tiles)
    return {_SUFFIXES[i]: tensors[i] for i in ((0, 1, 4) if transposable else range(5))}


def _spec(module: nn.Module, name: str) -> QuantSpec:
    return module.__dict__[_SPECS][name]


def get_high_precision_init_val(param: nn.Parameter) -> Tensor | None:
    """The initial high-precision values of an FP8 weight (CPU), or None (not kept)."""
    return param.__dict__.get("_high_precision_init_val")


def clear_high_precision_init_val(param: nn.Parameter) -> None:
    param.__dict__.pop("_high_precision_init_val", None)


@torch.no_grad()
def make_primary(module: nn.Module, names: tuple[str, ...], owner: str) -> None:
    """Inside ``quantized_model_init``: replace ``module``'s weights ``names`` (initialised in high
    precision; a grouped GEMM's ``[G, N, K]`` weight or its ``G`` weights ``[N, K]``) by FP8
    Parameters with their ``<name>_scale_inv`` / ``<name>_amax`` buffers (and ``<name>_t`` /
    ``<name>_scale_inv_t`` of 1-D weight blocks: 1x128, MXFP8, NVFP4's 1x16). Else nothing."""
    if (state := _STATE[0]) is None:
        return
    spec = _weight_spec(state.recipe, owner)
    for name in names:
        hp = getattr(module, name)
        tensors = _kept(hp.detach(), spec)
        param = nn.Parameter(tensors.pop(""), requires_grad=hp.requires_grad)
        for attr, value in vars(hp).items():  # tensor-parallel attributes and the like
            setattr(param, attr, value)
        if state.preserve:
            param._high_precision_init_val = hp.detach().to("cpu", copy=True)
        setattr(module, name, param)
        module.__dict__.setdefault(_INIT_DTYPES, {})[name] = hp.dtype
        _add_methods(module, name)
        for suffix, tensor in tensors.items():
            module.register_buffer(name + suffix, tensor)
        module.__dict__.setdefault(_SPECS, {})[name] = spec
        _stamp(module, name)
    _LAST_RECIPES[module] = state.recipe
    _HOLDERS.add(module)
    if _STAMPS in module.__dict__ and _HOOKED not in module.__dict__:
        module.__dict__[_HOOKED] = True
        module.register_load_state_dict_pre_hook(_quantize_loaded_weights)
        module.register_load_state_dict_post_hook(_stamp_after_load)


def _add_methods(module: nn.Module, name: str) -> None:
    """TE's methods on FP8 weight ``name`` (also module functions) and ``weight.copy_(src)``,
    quantising high-precision values as at construction (TE's ``QuantizedTensor.copy_``; float8
    codes are copied as they are); again after a deep copy or unpickling of the module."""
    param, owner = getattr(module, name), weakref.ref(module)

    def copy_(src: Tensor, non_blocking: bool = False) -> Tensor:
        m, grad = owner(), torch.is_grad_enabled() and param.requires_grad
        if m is None or grad or is_primary(src) or getattr(m, name) is not param:
            return Tensor.copy_(param, src, non_blocking)  # (grad: torch's in-place error)
        _set(m, name, src.to(param.device, torch.float32).expand(param.shape))
        return param

    param.get_high_precision_init_val = types.MethodType(get_high_precision_init_val, param)
    param.clear_high_precision_init_val = types.MethodType(clear_high_precision_init_val, param)
    param.copy_ = copy_
    param.grad_dtype = module.__dict__[_INIT_DTYPES][name]  # .grad without main_grad (as TE)


def _quantize_loaded_weights(module, state_dict, prefix, *args) -> None:
    """``load_state_dict``'s pre-hook: a high-precision value for an FP8 weight (a checkpoint of
    the model without FP8 primary weights) is quantised into codes and buffers, as
    ``FP8MasterWeights`` quantises its masters (cast as it is, it would lose the scale)."""
    for name in module.__dict__.get(_STAMPS, {}):
        value, param = state_dict.get(prefix + name), getattr(module, name)
        high_precision = value is not None and value.is_floating_point() and not is_primary(value)
        if high_precision and type(param.data) is Tensor:  # (not a DTensor shard: DCP loads those)
            for suffix, tensor in _kept(value.to(param.device), _spec(module, name)).items():
                state_dict[prefix + name + suffix] = tensor


def _stamp(module: nn.Module, name: str) -> None:
    """Remember the storage and version of FP8 weight ``name`` and of its scale after
    te_compile set the codes with their scale (:func:`check_unchanged`)."""
    w, scale = getattr(module, name), getattr(module, f"{name}_scale_inv")
    if type(w.data) is Tensor:  # a DTensor shard (FSDP2) is written through its local tensor
        stamp = (w.data_ptr(), w._version, scale.data_ptr(), scale._version)
        module.__dict__.setdefault(_STAMPS, {})[name] = stamp


class KeepFP8OnCast:
    """Mixin of the modules that can hold FP8 primary weights: a dtype cast of the module
    (``.half()``, ``.bfloat16()``, ``.float()``, ``.to(dtype)``) leaves each FP8 weight's codes and
    its ``<name>_scale_inv`` / ``_t`` / ``_scale_inv_t`` / ``_amax`` buffers as they are (cast, the
    codes would become their values without the scale, and the scale would be rounded); the device
    still follows. The cast's dtype becomes the weight's nominal dtype (the one
    ``reset_parameters()`` initialises in), as a cast of Transformer Engine's quantized weight
    changes only its nominal dtype. The forward already computes in the input's dtype."""

    def __getstate__(self) -> dict:
        """Pickled (``torch.save(model)``): each FP8 weight without :func:`_add_methods`'s
        methods (``copy_`` is a closure), which ``__setstate__`` sets again."""
        state = dict(self.__dict__)
        params = state["_parameters"] = dict(state["_parameters"])
        for name, p in ((n, params[n]) for n in state.get(_SPECS, {})):
            params[name] = nn.Parameter(p.data, requires_grad=p.requires_grad)
            params[name].__dict__.update((k, v) for k, v in vars(p).items() if k not in _METHODS)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for name in self.__dict__.get(_SPECS, {}):
            _add_methods(self, name)
        if self.__dict__.get(_SPECS):
            _HOLDERS.add(self)

    def _apply(self, fn, recurse=True):
        specs = self.__dict__.get(_SPECS)
        if not specs:
            return super()._apply(fn, recurse)
        # id(tensor) -> the FP8 weight's name, or None for its buffers
        kept = {id(getattr(self, name)): name for name in specs}
        buffers = (self._buffers.get(name + suffix) for name in specs for suffix in _SUFFIXES[1:])
        kept.update((id(buf), None) for buf in buffers if buf is not None)
        dtypes = self.__dict__.setdefault(_INIT_DTYPES, {})

        def keep_fp8(t: Tensor) -> Tensor:
            out = fn(t)
            if id(t) not in kept or out.dtype == t.dtype:
                return out
            if (name := kept[id(t)]) is not None and out.is_floating_point():
                t.grad_dtype = dtypes[name] = out.dtype
            return t.data if out.device == t.device else t.data.to(out.device)

        return super()._apply(keep_fp8, recurse)


def _stamp_after_load(module: nn.Module, incompatible_keys: object) -> None:
    for name in list(module.__dict__.get(_STAMPS, {})):
        _stamp(module, name)


def check_unchanged(module: nn.Module, name: str, weight: Tensor) -> None:
    """Refuse an FP8 weight whose codes changed without its scale since te_compile set them: written
    in place (same storage, newer codes, the same scale: an in-place write other than
    ``weight.copy_`` casts values without the weight's scale), or replaced (a new Parameter or
    ``weight.data = ...`` while the stamped scale is unwritten: it belongs to the old codes; outside
    ``torch.distributed``, where FSDP2 gives the weight new storage at every forward) unless live
    FP8 weights hold those codes (:func:`_take_scale_of_same_codes`). Codes written with their
    scale, or moved with it (``.to()``, a deep copy): stamped again. Eager only."""
    stamps = module.__dict__.get(_STAMPS)
    if stamps is None or torch.compiler.is_compiling() or type(weight.data) is not Tensor:
        return
    scale = module._buffers[f"{name}_scale_inv"]
    ptr, codes, scale_ptr, scale_version = stamps.get(name, (None,) * 4)
    kept_scale = scale.data_ptr() == scale_ptr and scale._version == scale_version
    same_codes = not (replaced := weight.data_ptr() != ptr) and weight._version == codes
    if same_codes and kept_scale:  # nothing changed: the stamp stands (every call's case)
        return
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    ok = same_codes or not kept_scale or (replaced and dist)  # set with its scale, or by FSDP2
    if not ok and replaced and _take_scale_of_same_codes(module, name, weight):
        _add_methods(module, name)  # (the new Parameter has none of them)
    elif not ok:
        raise RuntimeError(
            f"{type(module).__name__}: the FP8 weight {name!r} was "
            f"{'replaced by other codes' if replaced else 'written in place'} without its scale "
            f"({name}_scale_inv; weight.detach().copy_(codes), an in-place init, a new Parameter "
            "of FP8 codes, ...): its values would be wrong. Set FP8 weights with "
            "weight.copy_(values) (which quantises), load_state_dict, FP8MasterWeights, "
            f"reset_parameters(), or FP8 codes together with their {name}_scale_inv "
            f"(module.{name}_scale_inv.copy_(...))"
        )
    _stamp(module, name)


def _note_recipe(module: nn.Module) -> None:
    """TE's warning when FP8 weights run under a recipe unequal to the one they were made or
    last ran under (TE replaces their quantizer; here the codes and scales stay, as the warning
    says). Eager calls only (a warning breaks a compiled graph). The recipe is held beside the
    module (a copy starts without one, and the module keeps no recipe alive)."""
    if torch.compiler.is_compiling():
        return
    state, last = get_autocast_state(), _LAST_RECIPES.get(module)
    if not state.enabled or state.recipe is last:
        return
    _LAST_RECIPES[module] = state.recipe
    if last is None or state.recipe == last:
        return
    level, frame = 2, sys._getframe(1)  # the warning points at the user's call
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_OURS):
        level, frame = level + 1, frame.f_back
    warnings.warn(
        f"Quantizer is being updated, this may affect model behavior: {type(module).__name__}'s "
        f"FP8 weights last ran under {last!r} and now run under {state.recipe!r}. They keep "
        "their codes and scales, and FP8MasterWeights / weight.copy_ keep casting them as "
        "quantized_model_init's recipe said",
        UserWarning,
        stacklevel=level,
    )


_OURS = ("te_compile.", "torch.")  # modules whose frames a warning skips (_note_recipe)
_HOLDERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the modules with FP8 weights
# {module: the recipe its FP8 weights were made or last ran under} (_note_recipe)
_LAST_RECIPES: weakref.WeakKeyDictionary[nn.Module, Recipe] = weakref.WeakKeyDictionary()


def _take_scale_of_same_codes(module: nn.Module, name: str, weight: Tensor) -> bool:
    """FP8 weight ``name`` replaced by codes bit for bit those of live FP8 weights kept alike (spec,
    shape, device) whose scale buffers all agree: take those buffers (True), as TE's
    ``Parameter(src.weight.clone())`` carries the source's scale (its tests share a ``Float8Tensor``
    that way). None, or two with other scales (equal codes, other values): False."""
    spec, codes = _spec(module, name), weight.detach().view(torch.uint8)
    found = [[o._buffers.get(n + suffix) for suffix in _SUFFIXES[1:]]
             for o in list(_HOLDERS) for n, w in ((n, getattr(o, n)) for n in o.__dict__[_SPECS])
             if not (o is module and n == name) and _spec(o, n) == spec
             and w.shape == codes.shape and w.device == codes.device
             and torch.equal(w.detach().view(torch.uint8), codes)]  # fmt: skip
    if not found or not all(a is None or torch.equal(a, b) for f in found[1:]
                            for a, b in zip(found[0], f, strict=True)):  # fmt: skip
        return False
    for suffix, buf in zip(_SUFFIXES[1:], found[0], strict=True):
        if buf is not None:
            module._buffers[name + suffix].copy_(buf)
    return True


@contextlib.contextmanager
def high_precision_init(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """For ``module.reset_parameters()``: inside, each FP8 weight of ``names`` is a
    high-precision Parameter (the dtype it was built in) for the initialiser to fill; on exit
    it is cast into the codes, scale and amax as at construction (as TE re-quantises), and a
    kept initial value is replaced. ``FP8MasterWeights`` built before keeps the old masters."""
    fp8 = {n: getattr(module, n) for n in names if is_primary(getattr(module, n))}
    dtypes = module.__dict__.get(_INIT_DTYPES, {})
    for n, p in fp8.items():
        if type(p.data) is not Tensor:  # a DTensor shard (FSDP2)
            raise NotImplementedError(
                f"{type(module).__name__}.reset_parameters(): the FP8 weight {n!r} is sharded "
                f"({type(p.data).__name__}); initialise modules with FP8 weights before sharding"
            )
        hp = torch.empty(p.shape, dtype=dtypes.get(n, torch.float32), device=p.device)
        module._parameters[n] = nn.Parameter(hp, requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for n, p in fp8.items():
            hp = module._parameters[n].detach()
            module._parameters[n] = p
            _set(module, n, hp)
            if get_high_precision_init_val(p) is not None:
                p._high_precision_init_val = hp.to("cpu", copy=True)


@torch.no_grad()
def _set(module: nn.Module, name: str, values: Tensor) -> None:
    """Quantise ``values`` into FP8 weight ``name``'s codes and buffers (as it was made)."""
    for suffix, tensor in _kept(values, _spec(module, name)).items():
        getattr(module, name + suffix).copy_(tensor)
    _stamp(module, name)


def weight_values(module: nn.Module, name: str, dtype: torch.dtype) -> Tensor:
    """FP8 weight ``name``'s values (its codes with their scales) in ``dtype``, no gradient."""
    scale_inv, g = getattr(module, f"{name}_scale_inv"), getattr(module, f"{name}_amax")
    return dequantized(getattr(module, name).detach(), scale_inv, _spec(module, name), dtype, g)


def is_primary(weight: Tensor) -> bool:
    return weight.dtype in FP8_DTYPES


def primary_operand(module: nn.Module, name: str, weight: Tensor) -> tuple[Tensor, ...] | None:
    """The pre-quantised operand of ``module``'s FP8 weight ``name`` (``weight_quantized``'s
    five tensors: the codes, their scale, the transposed codes, its scale, the amax), or None:
    the weight is not FP8. ``weight``: the parameter ``name``."""
    if not is_primary(weight):
        if f"{name}_scale_inv" in module._buffers:
            raise ValueError(
                f"{type(module).__name__}: the FP8 weight {name!r} arrived as {weight.dtype}: "
                "something cast the float8 codes (fully_shard's MixedPrecisionPolicy(param_dtype"
                "=...) does); shard modules with FP8 weights with param_dtype=None"
            )
        return None
    check_unchanged(module, name, weight)
    _note_recipe(module)
    scale_inv, amax = getattr(module, f"{name}_scale_inv"), getattr(module, f"{name}_amax")
    kept = module._buffers
    if f"{name}_t" in kept:  # 1x128 or MXFP8's 1x32 weight blocks: a cast of its own
        return weight, scale_inv, kept[f"{name}_t"], kept[f"{name}_scale_inv_t"], amax
    codes_t = weight.detach().view(torch.uint8).t().contiguous()
    return weight, scale_inv, codes_t, scale_inv.t().contiguous(), amax


def grouped_primary(
    module: nn.Module, names: tuple[str, ...], dtype: torch.dtype, to_leaves: bool = True
) -> tuple[Tensor, list[Tensor]] | None:
    """For a grouped GEMM whose weights are ``module``'s ``names`` (one ``[G, N, K]`` weight, or
    ``G`` weights ``[N, K]``): None when they are not FP8, else the GEMM op's ``weight`` argument, a
    :class:`_StandIn` of shape ``[G, N, K]`` (the op accumulates the gradient into the ``main_grad``
    it is given, else, with ``to_leaves``, returns it to the weights' ``.grad``; sharded, returns it
    to the stand-in), and its pre-quantised operand (``functional.quantize_grouped_weight``'s
    ``scaled_grouped_mm`` kind: the codes ``[G, N, K]``, each group's inverse scale broadcast over
    its rows ``[G, N]``, the transposed codes ``[G, K, N]`` with the scales ``[G, K]``, the largest
    amax ``[1]``; kept in blocks, :func:`_grouped_blocks`)."""
    weights = [getattr(module, n) for n in names]
    if not is_primary(weights[0]):
        for n, w in zip(names, weights, strict=True):
            primary_operand(module, n, w)  # raises for codes some cast turned high-precision
        return None
    for name, w in zip(names, weights, strict=True):
        check_unchanged(module, name, w)
    _note_recipe(module)
    data = _stacked([w.detach() for w in weights])  # one [G, N, K], or G [N, K]
    g, n, k = data.shape
    if _spec(module, names[0]).kind != "current":
        operand = _grouped_blocks(module, names, data)
    else:
        data = data.view(torch.uint8)
        inv = torch.cat([getattr(module, f"{name}_scale_inv") for name in names]).expand(g)
        amax = torch.cat([getattr(module, f"{name}_amax") for name in names]).amax().reshape(1)
        operand = [data, inv[:, None].expand(g, n).contiguous(), data.transpose(1, 2).contiguous(),
                   inv[:, None].expand(g, k).contiguous(), amax]  # fmt: skip
    values = _backward_values(module, names, dtype)
    stand_in = _sharded_stand_in(module, names, dtype, (g, n, k), True, values)
    if stand_in is None:
        stand_in = _StandIn.apply(dtype, (g, n, k), values, None, 0, False, to_leaves, *weights)
    return stand_in, operand


def _stacked(tensors: list[Tensor]) -> Tensor:
    """One grouped weight's tensor ``[G, ...]`` as it is, or ``G`` per-expert ones stacked."""
    return tensors[0] if len(tensors) == 1 and tensors[0].dim() == 3 else torch.stack(tensors)


def _grouped_blocks(module: nn.Module, names: tuple[str, ...], data: Tensor) -> list[Tensor]:
    """The pre-quantised operand of a grouped GEMM's weights kept in blocks, every expert's
    tensors stacked: the codes ``data`` ``[G, N, K]``, their scales, the dgrad GEMM's copy ``[G,
    K, N]`` and its scales (of 128x128 blocks the transposes, made per step), a 0-element amax
    or NVFP4's global scales ``[G, 1]`` (``quantization.gemm.as_gemm_takes`` dequantises them
    where the GEMM is emulated)."""
    scale = _stacked([module._buffers[f"{n}_scale_inv"] for n in names])
    if f"{names[0]}_t" in module._buffers:  # 1-D blocks: a cast of its own
        data_t = _stacked([module._buffers[f"{n}_t"] for n in names])
        scale_t = _stacked([module._buffers[f"{n}_scale_inv_t"] for n in names])
    else:
        data_t, scale_t = data.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous()
    amax = [module._buffers[f"{n}_amax"] for n in names]
    one = len(names) == 1 or not amax[0].numel()  # one grouped weight's, or the 0-element amax
    return [data, scale, data_t, scale_t, amax[0] if one else torch.stack(amax)]


def _backward_values(
    module: nn.Module, names: tuple[str, ...], dtype: torch.dtype
) -> Tensor | None:
    """FP8 weights ``names``' values in ``dtype`` (G expert weights stacked) under an autocast
    recipe with ``backward_override="high_precision"``, whose dgrad GEMM reads them (as TE
    dequantises a quantised weight there; the forward still reads the codes); else None."""
    state = get_autocast_state()
    hp_backward = state.enabled and state.recipe.backward_override == "high_precision"
    if not (hp_backward and torch.is_grad_enabled()):
        return None
    if getattr(module, "delay_wgrad_compute", False):
        raise NotImplementedError(
            f"{type(module).__name__}: delay_wgrad_compute=True is not supported with FP8 "
            "primary weights under backward_override='high_precision'"
        )
    with torch.no_grad():
        parts = [weight_values(module, name, dtype) for name in names]
    return parts[0] if len(parts) == 1 else torch.stack(parts)


def _sharded_stand_in(
    module: nn.Module, names: tuple[str, ...], dtype, shape, grouped: bool, values: Tensor | None
) -> Tensor | None:
    """The :class:`_StandIn` of FP8 weights ``names`` sharded by FSDP2, with ``FP8MasterWeights``
    and grad enabled; else None. ``values``: :func:`_backward_values`."""
    sharded = [module.__dict__.get(_SHARDED_MAIN_GRADS, {}).get(n) for n in names]
    if sharded[0] is None or getattr(module, names[0]).requires_grad or not torch.is_grad_enabled():
        return None
    if getattr(module, "delay_wgrad_compute", False):
        raise NotImplementedError(
            f"{type(module).__name__}: delay_wgrad_compute=True with FP8 primary weights sharded "
            "by FSDP2 is not supported (their gradient is reduce-scattered during the backward); "
            "build the module with delay_wgrad_compute=False"
        )
    (sink, group_name, world), sinks = sharded[0], [s[0] for s in sharded]
    per_group = grouped and sink.dim() == 2  # G weights [N, K] (else one [G, N, K])
    return _StandIn.apply(dtype, shape, values, group_name, world, per_group, False, *sinks)


def primary_weight(
    module: nn.Module, name: str, dtype: torch.dtype, accumulate: bool
) -> tuple[Tensor, Tensor | None]:
    """The GEMM op's ``weight`` argument for ``module``'s FP8 weight ``name`` (its operand is
    :func:`primary_operand`) and the fp32 ``main_grad`` the op accumulates its gradient into:
    the codes Parameter and :func:`taken_main_grad` (None: the gradient goes to ``.grad`` in the
    nominal dtype). Sharded by FSDP2, with ``FP8MasterWeights`` and grad enabled: a
    :class:`_StandIn` in ``dtype`` and None (the op returns the gradient to the stand-in)."""
    weight = getattr(module, name)
    values = _backward_values(module, (name,), dtype)
    stand_in = _sharded_stand_in(module, (name,), dtype, weight.shape, False, values)
    if stand_in is not None:
        return stand_in, None
    main_grad = taken_main_grad(weight, accumulate)
    if values is not None:  # (a frozen weight too: the input's gradient reads the values)
        weight = _StandIn.apply(dtype, weight.shape, values, None, 0, False, main_grad is None,
                                weight)  # fmt: skip
    return weight, main_grad


def taken_main_grad(weight: Tensor, accumulate: bool) -> Tensor | None:
    """``weight.main_grad`` where the module accumulates into it (``accumulate``: its
    ``fuse_wgrad_accumulation`` / ``accumulate_into_main_grad``) or ``FP8MasterWeights`` made
    it; else None, as Transformer Engine leaves a ``main_grad`` the module was not told of."""
    main_grad = getattr(weight, "main_grad", None)
    take = main_grad is not None and (accumulate or getattr(main_grad, _MASTERS, False))
    return main_grad if take else None


def _reduce_scatter_rows(grad: Tensor, world: int, group_name: str, local_rows: int) -> Tensor:
    """This rank's rows of the mean over the group of ``grad`` (fp32), in FSDP2's chunks
    along dim 0 (``ceil(rows / world)`` rows per rank, the last ones short: zero padding)."""
    import torch.distributed._functional_collectives as funcol

    rows = grad.shape[0]
    chunk = -(-rows // world)
    full = grad.float()
    if chunk * world != rows:
        full = torch.cat([full, full.new_zeros((chunk * world - rows, *full.shape[1:]))])
    # What funcol.reduce_scatter_tensor calls, without its warning.
    reduce_scatter = torch.ops._c10d_functional.reduce_scatter_tensor
    out = funcol.wait_tensor(reduce_scatter(full.contiguous(), "sum", world, group_name))
    return out[:local_rows].div(world)


class _StandIn(torch.autograd.Function):
    """The weight argument of a GEMM op on FP8 weights: ``shape`` in ``dtype``, zero bytes (an
    expanded scalar; the op reads the codes from its pre-quantised operand, never this), or
    ``values`` where a high-precision backward reads them (:func:`_backward_values`), requiring grad
    through ``leaves``. Not sharded (``group_name`` None): the leaves are the codes; with
    ``to_leaves`` (the op is given no ``main_grad``: :func:`taken_main_grad`) the op's gradient goes
    to their ``.grad`` (in their ``grad_dtype``), ``[G, N, K]`` split per leaf. Sharded by FSDP2:
    one zero-byte fp32 leaf per FP8 weight, of its local shard's shape, whose ``.grad`` is the
    sharded ``main_grad`` (``per_group``: a grouped GEMM's ``G`` weights ``[N, K]``, else one
    weight); the full-size ``dW`` is reduce-scattered into each leaf (:func:`_reduce_scatter_rows`,
    a functional collective: traced by torch.compile); autograd sums micro-batches in ``.grad``."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, shape: tuple[int, ...], values: Tensor | None,
                group_name: str | None, world: int, per_group: bool, to_leaves: bool,
                *leaves: Tensor) -> Tensor:  # fmt: skip
        ctx.group_name, ctx.world, ctx.per_group = group_name, world, per_group
        ctx.local_rows, ctx.to_leaves = [s.shape[0] for s in leaves], to_leaves
        if values is not None:
            return values.view(shape)
        return leaves[0].new_zeros((), dtype=dtype).expand(shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.group_name is None:  # to the codes' .grad where no main_grad took it
            n = len(ctx.local_rows)
            return (None,) * 7 + ((None,) * n if not ctx.to_leaves else grad.unbind(0) if n > 1
                                  else (grad,))  # fmt: skip
        parts = grad.unbind(0) if ctx.per_group else (grad,)
        shards = [_reduce_scatter_rows(p, ctx.world, ctx.group_name, rows)
                  for p, rows in zip(parts, ctx.local_rows, strict=True)]  # fmt: skip
        return (None,) * 7 + tuple(shards)


def primary_main_grad(module: nn.Module, name: str) -> Tensor | None:
    """The fp32 ``main_grad`` of ``module``'s FP8 weight ``name``, or None (no
    ``FP8MasterWeights`` yet). On the weight (``weight.main_grad``, as Transformer Engine),
    weight-sized; for a weight sharded by FSDP2 (whose unsharded Parameter FSDP2 makes at each
    all-gather), this rank's shard of it (the local shard's shape), kept for the module."""
    main_grad = getattr(getattr(module, name), "main_grad", None)
    sink = module.__dict__.get(_SHARDED_MAIN_GRADS, {}).get(name)
    return main_grad if main_grad is not None or sink is None else sink[0].grad


_MASTERS = "_fp8_masters"  # on the main_grad tensors FP8MasterWeights made (taken_main_grad)
_INIT_DTYPES = "_fp8_init_dtypes"  # {name: the dtype the FP8 weight was built in}
_SPECS = "_fp8_weight_specs"  # {name: the QuantSpec it is kept by (_weight_spec)}
_STAMPS = "_fp8_weight_stamps"  # {name: the codes' and the scale's (data_ptr, _version) when set}
_HOOKED = "_fp8_load_hooks"  # the load_state_dict hooks are registered
# {name: (the zero-byte leaf holding it as .grad, the FSDP2 group's name, its size)}
_SHARDED_MAIN_GRADS = "_fp8_sharded_main_grads"


class _Entry(NamedTuple):
    module: nn.Module
    name: str
    master: nn.Parameter
    group: object  # the FSDP2 shard group of a sharded weight, else None


def _fsdp_group(owner: str, param: Tensor) -> object:
    """The process group over which FSDP2 shards ``param`` (a DTensor), else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return None
    if param.device_mesh.ndim != 1 or param.placements != (Shard(0),):
        raise NotImplementedError(
            f"{owner}: FP8 weights sharded with placements {param.placements} on a "
            f"{param.device_mesh.ndim}-D mesh; supported: fully_shard on a 1-D mesh (Shard(0))"
        )
    return param.device_mesh.get_group()


class FP8MasterWeights:
    """fp32 master weights of a model's FP8 primary weights (module docstring): one master
    Parameter and one fp32 ``main_grad`` per FP8 weight. ``parameters()``: the masters, for the
    optimizer; ``other_parameters()``: the model's parameters that are not FP8 (biases, norms),
    trained as usual; ``step(optimizer)``: one optimizer step and the FP8 refresh.

    After ``fully_shard`` (FSDP2), the masters are DTensor shards like the FP8 weights (build
    this after ``fully_shard`` and before the first forward): see ``docs/fp8.md``, "FSDP2"."""

    def __init__(self, model: nn.Module) -> None:
        owner = "te.FP8MasterWeights"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{owner}: model must be a torch.nn.Module, got {model!r}")
        self._entries: list[_Entry] = []
        self._others: list[nn.Parameter] = []
        seen: set[int] = set()
        for module in model.modules():
            # A module whose weights' main_grad are views of one buffer (GroupedLinear: its grouped
            # GEMM accumulates into one [G, N, K]) allocates it; the others get one per weight.
            allocate = getattr(module, "allocate_main_grad", None)
            own = [p for p in module.parameters(recurse=False) if is_primary(p)]
            allocated = bool(own) and allocate is not None
            allocated = allocated and all(_fsdp_group(owner, p) is None for p in own)
            if allocated:
                allocate()
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                if not is_primary(param):
                    self._others.append(param)
                    continue
                group, spec = _fsdp_group(owner, param), _spec(module, name)
                if group is not None and spec.kind != "current":
                    raise NotImplementedError(
                        f"{owner}: the FP8 weight {name!r} of {type(module).__name__} is sharded "
                        "by FSDP2 and kept in blocks (Float8BlockScaling, MXFP8BlockScaling); "
                        "sharded FP8 primary weights support the per-tensor recipes "
                        "(Float8CurrentScaling, DelayedScaling)"
                    )
                if group is not None:  # a DTensor shard: the master is this rank's shard
                    codes = param.to_local()
                    local = codes.float() * getattr(module, f"{name}_scale_inv")
                    master = type(param.data).from_local(
                        local, param.device_mesh, param.placements, shape=param.shape,
                        stride=param.stride())  # fmt: skip
                    # FSDP2 wants one dtype among the parameters that require grad; the
                    # gradient goes to the sharded main_grad, sink.grad (primary_weight).
                    param.requires_grad_(False)
                    sink = torch.zeros((), device=codes.device).expand(local.shape)
                    sink = sink.detach().requires_grad_(True)
                    sink.grad = torch.zeros(local.shape, device=codes.device)
                    sharded = (sink, group.group_name, group.size())
                    module.__dict__.setdefault(_SHARDED_MAIN_GRADS, {})[name] = sharded
                elif (init := get_high_precision_init_val(param)) is not None:
                    master = init.to(param.device, torch.float32, copy=True)
                else:
                    master = weight_values(module, name, torch.float32)
                clear_high_precision_init_val(param)
                master = nn.Parameter(master)
                if group is None and not allocated:
                    param.main_grad = torch.zeros_like(master)
                if group is None:  # the modules accumulate into it whatever their flags say
                    setattr(param.main_grad, _MASTERS, True)
                self._entries.append(_Entry(module, name, master, group))
        if not self._entries:
            raise ValueError(
                f"{owner}: model has no FP8 primary weights (build it inside "
                "te.quantized_model_init)"
            )

    def parameters(self) -> list[nn.Parameter]:
        return [e.master for e in self._entries]

    def other_parameters(self) -> list[nn.Parameter]:
        return list(self._others)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Masters' grads from ``main_grad`` (a sharded weight's: this rank's shard, averaged
        over its FSDP2 group by the backward's reduce-scatter, as FSDP2 averages the other
        gradients), ``optimizer.step()``, the FP8 refresh, ``main_grad`` zeroed."""
        for e in self._entries:
            main_grad = primary_main_grad(e.module, e.name)
            if e.group is None:
                e.master.grad = main_grad
            else:  # this rank's shard, reduce-scattered during the backward
                e.master.grad = type(e.master.data).from_local(
                    main_grad, e.master.device_mesh, e.master.placements,
                    shape=e.master.shape, stride=e.master.stride())  # fmt: skip
        optimizer.step()
        self.refresh()
        for e in self._entries:
            primary_main_grad(e.module, e.name).zero_()
            e.master.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantise every master into its FP8 weight (codes, scale, amax; per tensor the codes
        alone: an amax pass and one cast). A sharded weight's amax is the max over its FSDP2
        group: each rank casts its shard with the whole weight's scale (the unsharded codes)."""
        for e in self._entries:
            if _spec(e.module, e.name).kind != "current":  # in blocks: the whole cast
                _set(e.module, e.name, e.master)
                continue
            weight = getattr(e.module, e.name)
            if e.group is None:
                data, _, scale_inv, amax = torch.ops.te.quantize_current(
                    e.master, weight.dtype, False
                )
            else:
                import torch.distributed._functional_collectives as funcol

                weight, local = weight.to_local(), e.master.to_local()
                amax = local.abs().amax().reshape(1) if local.numel() else local.new_zeros(1)
                amax = funcol.wait_tensor(funcol.all_reduce(amax, "max", e.group))
                scale = scale_from_amax(amax, torch.finfo(weight.dtype).max)
                data, _, _ = torch.ops.te.quantize_tensorwise(local, scale, weight.dtype, False)
                scale_inv = reciprocal_rn(scale)
            weight.copy_(data.view(weight.dtype))
            getattr(e.module, f"{e.name}_scale_inv").copy_(scale_inv)
            getattr(e.module, f"{e.name}_amax").copy_(amax)
            _stamp(e.module, e.name)
