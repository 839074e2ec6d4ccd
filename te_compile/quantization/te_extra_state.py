"""Loading Transformer Engine's ``_extra_state`` (its FP8 metadata) into te_compile modules.

What TE saves, which modules save it, its slots and what te_compile takes of it:
``docs/te_compat.md``, "Checkpoints across Transformer Engine and te_compile". The value is an
empty ``uint8`` tensor without FP8 state, else a pickled dict in a ``uint8`` tensor (``recipe``,
``scale_fwd`` / ``amax_history_fwd`` with input, weight, output slots per GEMM, ``scale_bwd`` /
``amax_history_bwd`` with grad_output, grad_input slots, ``extra_fp8_variables``; TE 1.x
omitted ``recipe`` and also stored ``scale_inv_*``; the oldest format was an ``io.BytesIO`` of
``torch.save``). GroupedLinear's group ``i`` is TE's GEMM ``i + 1``; a ``te.ops`` operation
saves ``{"forward": {...}, "backward": {...}}``.

:func:`accept_te_extra_state` registers a load_state_dict pre-hook that takes that key and, for
delayed scaling, writes the history and scales into the module's :class:`FP8GemmState` buffers
(:func:`_te_to_ours`); the pickle is read by :class:`_RestrictedUnpickler`, which runs no code.
"""

from __future__ import annotations

import collections
import io
import pickle
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from te_compile.quantization.fp8_gemm import MAX_AMAX_HISTORY

__all__ = ["TERecipeRecord", "accept_te_extra_state", "decode_te_extra_state"]

_TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# TE's recipe module names a pickled recipe may reference (classes, the Format enum and the
# named tuples of its fields). CustomRecipe is absent: its factory is a callable.
_TE_RECIPE_NAMES = frozenset(
    {"DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
     "NVFP4BlockScaling", "Recipe", "Format", "_FormatHelper", "_OverrideLinearPrecision",
     "MMParams", "QParams"})  # fmt: skip
_DELAYED_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")


class TERecipeRecord:
    """An inert stand-in for a pickled Transformer Engine recipe object: its class name
    (``te_name``), constructor arguments (``args``) and fields (``fields``). Nothing of
    Transformer Engine runs; no te_compile recipe is built from it."""

    te_name = "?"

    def __new__(cls, *args: object) -> TERecipeRecord:
        obj = super().__new__(cls)
        obj.args, obj.fields = args, {}
        return obj  # (also for a call, which rebuilds an enum member: object.__init__ takes args)

    def __setstate__(self, state: object) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.fields.update(state)

    def __repr__(self) -> str:
        return f"TERecipeRecord({self.te_name}, {self.fields or self.args})"


_RECORD_CLASSES = {n: type(n, (TERecipeRecord,), {"te_name": n}) for n in _TE_RECIPE_NAMES}


def _load_storage_bytes(data: bytes) -> object:
    # torch pickles a storage as the bytes of a legacy torch.save: read them without code.
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


_SAFE_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    **{(_TE_RECIPE_MODULE, n): cls for n, cls in _RECORD_CLASSES.items()},
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only tensors, ``OrderedDict`` and TE's recipe names (as records); any other
    global (a function, ``os.system``, a user's ``amax_compute_algo``) is refused."""

    def find_class(self, module: str, name: str) -> object:
        safe = _SAFE_GLOBALS.get((module, name))
        if safe is None:
            raise pickle.UnpicklingError(f"refusing the global {module}.{name}")
        return safe


def decode_te_extra_state(value: object, key: str) -> dict | None:
    """The dict a Transformer Engine ``_extra_state`` value holds, or None when it holds
    nothing (None, an empty tensor, a pickled None or empty dict). Raises ``RuntimeError``
    naming ``key`` for a value that is not TE's format or a pickle that references anything
    but tensors and TE's recipe classes."""
    if value is None or (isinstance(value, Tensor) and value.numel() == 0):
        return None
    try:
        if isinstance(value, Tensor):
            if value.dtype != torch.uint8:
                raise TypeError(f"a {value.dtype} tensor, not TE's uint8 bytes")
            state = _RestrictedUnpickler(io.BytesIO(value.detach().cpu().numpy().tobytes())).load()
        elif isinstance(value, io.BytesIO):  # TE's oldest format: torch.save into a BytesIO
            value.seek(0)
            allow = [(cls, f"{_TE_RECIPE_MODULE}.{n}") for n, cls in _RECORD_CLASSES.items()]
            with torch.serialization.safe_globals(allow):
                state = torch.load(value, weights_only=True, map_location="cpu")
        else:
            raise TypeError(f"a {type(value).__name__}, not a uint8 tensor or io.BytesIO")
    except Exception as e:
        raise RuntimeError(
            f"{key}: cannot read Transformer Engine's extra state ({e}); it is loaded without "
            "running any code from the checkpoint. To load the rest without it, drop the key "
            f"(state_dict.pop({key!r}))"
        ) from e
    if state is not None and not isinstance(state, dict):
        raise RuntimeError(
            f"{key}: Transformer Engine's extra state holds a dict, got a {type(state).__name__}"
        )
    return state or None


class _Spec(NamedTuple):
    """How a module takes TE's extra state (see :func:`accept_te_extra_state`)."""

    gemm_states: tuple[str, ...]
    te_gemms: tuple[int, ...]
    slots: tuple[int, int]
    attention: bool


def accept_te_extra_state(
    module: nn.Module,
    gemm_states: Sequence[str] = (),
    te_gemms: Sequence[int] = (1,),
    *,
    slots: tuple[int, int] = (3, 2),
    attention: bool = False,
) -> None:
    """Let ``module`` load Transformer Engine's ``<prefix>_extra_state``.

    ``gemm_states``: the names of its :class:`FP8GemmState` children; ``te_gemms[i]``: the
    number of TE GEMMs whose slots fold into ``gemm_states[i]`` (GroupedLinear: one per group;
    TE numbers the GEMMs in this order); ``slots``: TE's forward and backward slots per GEMM
    (modules 3, 2; ``te.ops`` linears 2, 1). No ``gemm_states``: the key is accepted and its FP8
    state not taken, with a warning when it held some (``attention``: only under ``fp8_dpa`` /
    ``fp8_mha``, as TE saves the attention's slots under any FP8 recipe). A later call (a
    subclass's ``__init__``) replaces an earlier one's choice."""
    # Not while dynamo traces (an op built inside a compiled region, e.g. under checkpoint):
    # registering a hook bumps a class counter dynamo cannot trace, and such a temporary
    # module is never loaded into.
    if "_te_extra_state" not in module.__dict__ and not torch.compiler.is_compiling():
        module.register_load_state_dict_pre_hook(_load_hook)
    module._te_extra_state = _Spec(tuple(gemm_states), tuple(te_gemms), slots, attention)


def _load_hook(mod, state_dict, prefix, _meta, _strict, _missing, _unexpected, error_msgs):
    key = prefix + "_extra_state"
    if key not in state_dict:
        return
    spec: _Spec = mod._te_extra_state
    try:
        state = decode_te_extra_state(state_dict.pop(key), key)
    except RuntimeError as e:
        error_msgs.append(str(e))
        return
    if state is None:
        return
    if "forward" in state or "backward" in state:  # a te.ops operation's: as a module's dict
        fwd, bwd = state.get("forward") or {}, state.get("backward") or {}
        state = {"recipe": fwd.get("recipe", bwd.get("recipe"))}
        state.update({k: v for k, v in fwd.items() if k.endswith("_fwd")})
        state.update({k: v for k, v in bwd.items() if k.endswith("_bwd")})
    if not spec.gemm_states:
        fields = getattr(state.get("recipe"), "fields", {})
        fp8_attention = fields.get("fp8_dpa") or fields.get("fp8_mha")
        if any(k in state for k in _DELAYED_KEYS) and (fp8_attention or not spec.attention):
            warnings.warn(
                f"{key}: Transformer Engine's FP8 state of this module is not taken "
                f"(te_compile's {type(mod).__name__} keeps none of it)",
                stacklevel=2,
            )
        return
    try:
        _load_delayed(mod, state, state_dict, prefix, key, spec)
    except ValueError as e:
        error_msgs.append(str(e))


def _load_delayed(mod, state, state_dict, prefix, key, spec: _Spec) -> None:
    recipe = state.get("recipe")  # TE 1.x saved none: it had only delayed scaling
    name = "DelayedScaling" if recipe is None else getattr(recipe, "te_name", repr(recipe))
    missing = sorted(k for k in _DELAYED_KEYS if k not in state)
    if len(missing) == len(_DELAYED_KEYS):
        return  # a stateless recipe (older TE pickled its name): nothing to take
    if missing:
        raise ValueError(f"{key}: the delayed-scaling state lacks {missing}")
    if name != "DelayedScaling":
        raise ValueError(f"{key}: delayed-scaling tensors under a {name} recipe")
    total, (per_fwd, per_bwd) = sum(spec.te_gemms), spec.slots
    tensors = {k: torch.as_tensor(state[k], dtype=torch.float32) for k in _DELAYED_KEYS}
    length = tensors["amax_history_fwd"].shape[0]
    for k in _DELAYED_KEYS:
        n = (per_fwd if k.endswith("_fwd") else per_bwd) * total
        shape = (length, n) if k.startswith("amax") else (n,)
        if tuple(tensors[k].shape) != shape:
            raise ValueError(
                f"{key}: {k} has shape {tuple(tensors[k].shape)}; this {type(mod).__name__} takes "
                f"{shape} ({total} TE GEMM(s), the history length of amax_history_fwd)"
            )
    if length - 1 > MAX_AMAX_HISTORY:
        warnings.warn(
            f"{key}: the amax history has {length} rows; the oldest "
            f"{length - 1 - MAX_AMAX_HISTORY} are not taken (te_compile keeps {MAX_AMAX_HISTORY})",
            stacklevel=3,
        )
    first = 0
    for attr, count in zip(spec.gemm_states, spec.te_gemms, strict=True):
        buffers = _te_to_ours(tensors, range(first, first + count), spec.slots)
        first += count
        names = {prefix + attr + "." + n: t for n, t in buffers.items()}
        if any(n in state_dict for n in names):
            warnings.warn(
                f"{key}: not taken for {attr}: the state_dict also holds te_compile's "
                f"{prefix + attr}.* FP8 state, which is loaded instead",
                stacklevel=3,
            )
            continue
        state_dict.update(names)


def _newest_first(history: Tensor) -> Tensor:
    """TE's amax history as a sequence, newest first. TE records a step's amax in row 0; its
    update (after each forward and backward) rolls row ``i + 1`` to row ``i`` and row 0 to the
    last row, then zeroes row 0. So rows ``1 ..`` are oldest to newest, and row 0 is newer
    still when not zero (a state saved before the update)."""
    older = history[1:].flip(0)
    return torch.cat([history[:1], older]) if bool(history[0].any()) else older


def _te_to_ours(
    tensors: dict[str, Tensor], gemms: range, slots: tuple[int, int]
) -> dict[str, Tensor]:
    """Our :class:`FP8GemmState` buffers from TE's delayed-scaling tensors of ``gemms``.

    Ours keep the newest amax pending (``fwd_amax`` input, weight; ``grad_amax``) and the
    older ones in ``amax_history`` newest first; the next forward folds the pending one in and
    recomputes the scales from the window, as TE's update did after its last step. TE's
    output and grad_input slots have no counterpart (we do not cast them). Several GEMMs
    (GroupedLinear's groups) fold into one state: the max of their amaxes (ours is measured
    over all groups at once) and the min of their scales (the scale of the largest amax)."""
    fwd = _newest_first(tensors["amax_history_fwd"])
    bwd = _newest_first(tensors["amax_history_bwd"])
    inp = [slots[0] * g for g in gemms]
    weight = [slots[0] * g + 1 for g in gemms]
    grad = [slots[1] * g for g in gemms]  # grad_output
    history = torch.zeros(MAX_AMAX_HISTORY, 3)
    pending = torch.zeros(3)
    for col, (seq, idx) in enumerate(((fwd, inp), (fwd, weight), (bwd, grad))):
        if len(seq):
            amax = seq[:, idx].amax(1)
            pending[col] = amax[0]
            rest = amax[1 : 1 + MAX_AMAX_HISTORY]
            history[: len(rest), col] = rest
    scale_fwd, scale_bwd = tensors["scale_fwd"], tensors["scale_bwd"]
    scale = torch.stack([scale_fwd[inp].amin(), scale_fwd[weight].amin(), scale_bwd[grad].amin()])
    return {
        "amax_history": history,
        "scale": scale,
        "fwd_amax": pending[:2].clone(),
        "grad_amax": pending[2:].clone(),
    }
