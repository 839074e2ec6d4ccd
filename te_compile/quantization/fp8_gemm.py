"""The FP8 state of one GEMM: the delayed-scaling buffers and their update.

Every module GEMM that can run in FP8 owns an :class:`FP8GemmState` child module. Its buffers
are the delayed-scaling state (Transformer Engine's "fp8 meta"), persistent so that a
state_dict save/load resumes training exactly:

* ``amax_history`` ``[1024, 3]``: per slot (input, weight, gradient) the last amaxes, newest in
  row 0; a recipe's ``amax_history_len`` (at most 1024) uses the first rows;
* ``scale`` ``[3]``: the scales the next casts use;
* ``fwd_amax`` ``[2]`` / ``grad_amax`` ``[1]``: the amaxes the last forward / backward measured.
  Two buffers: the backward op writes ``grad_amax`` after the forward saved it, and a saved
  tensor sharing storage with one the forward then writes would fail autograd's version check.

A state that was never used (delayed scaling never ran: zero history, unit scales) is left out
of the state_dict and, when absent from a loaded one, reset to that initial value: a module that
never ran in FP8 keeps the state_dict of its ``torch.nn`` counterpart (``te.Linear`` <->
``nn.Linear``, both ways); one trained with delayed scaling saves and restores its history.

Under ``DelayedScaling`` each forward first folds the last amaxes into the history and
recomputes the scales (``te::delayed_scaling_update``, a mutating op: compiled steps update the
buffers with zero graph breaks), then the GEMM family op takes a copy of the scales
(``quantization.gemm.gemm_args``, the one place a recipe becomes the ops' arguments).

**The first delayed step is calibrated** (``docs/fp8.md`` says why, with the numbers): a
state's first step under ``DelayedScaling`` runs current scaling and records the amaxes it
measured, and the next step folds them into the history; a step without tokens leaves the
calibration to the first step with tokens. ``calibrated`` (a Python bool, saved with the
buffers) is what a compiled step specialises on: one recompile after the first step.
A recipe with ``amax_compute_algo`` or ``scaling_factor_compute_algo`` callables runs the same
update in plain torch around them (:func:`_custom_update`). With ``amax_reduction_group`` (or
``reduce_amax`` and an initialised default process group) the amaxes are max-reduced over the
group with a functional all-reduce: the forward's before they are recorded, the gradient's when
it is folded into the history at the next forward. torch.compile traces both.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from te_compile._numerics import div_rn
from te_compile.functional.fp8_scaling import FP32_MAX, scale_copy, update_states
from te_compile.quantization.recompute import current_scope
from te_compile.quantization.state import AutocastState

__all__ = ["MAX_AMAX_HISTORY", "FP8GemmState", "delayed_scales", "non_finite_amaxes"]

MAX_AMAX_HISTORY = 1024


class FP8GemmState(nn.Module):
    """The FP8 scaling state of one GEMM (see the module docstring)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        kw = {"dtype": torch.float32, "device": device}
        self.register_buffer("amax_history", torch.zeros(MAX_AMAX_HISTORY, 3, **kw))
        self.register_buffer("scale", torch.ones(3, **kw))
        self.register_buffer("fwd_amax", torch.zeros(2, **kw))
        self.register_buffer("grad_amax", torch.zeros(1, **kw))
        # Whether a delayed-scaling step ran here (module docstring): the first one is current.
        self.calibrated = False
        # The recipe class of the last eager FP8 (or calibration) call (note_recipe).
        self.recipe_type: type | None = None
        self._register_state_dict_hook(_drop_if_unused)

    def forward_state(self) -> tuple[Tensor, Tensor, Tensor]:
        """The buffers a forward writes: history, scales, forward amaxes (``grad_amax`` is the
        backward's, and the forward saves it for the backward to write into)."""
        return self.amax_history, self.scale, self.fwd_amax

    def is_unused(self) -> bool:
        """True while delayed scaling never ran (a host sync: for state_dict, not forward)."""
        return not self.calibrated and not self.amax_history.any() and bool((self.scale == 1).all())

    def _apply(self, fn, recurse=True):
        # The scaling state stays float32 when the model is cast (``.to(torch.bfloat16)``,
        # ``.half()``): the delayed-scaling update needs fp32, and a bf16 amax history would
        # round the scales. Only the device follows.
        def keep_float32(t: Tensor) -> Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        return super()._apply(keep_float32, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Saved only once used, so a state_dict that holds the state is calibrated.
        self.calibrated = any(prefix + n in state_dict for n in self._buffers)
        if not self.calibrated:
            fresh = FP8GemmState(self.scale.device)
            state_dict.update({prefix + n: b for n, b in fresh.named_buffers()})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def delayed_scale(
        self, owner: str, state: AutocastState, has_tokens: bool = True
    ) -> Tensor | None:
        """:func:`delayed_scales` of this state alone."""
        return delayed_scales(owner, state, has_tokens, (self,))[0]

    def _update(self, owner: str, state: AutocastState, has_tokens: bool) -> Tensor | tuple | None:
        """:func:`delayed_scales`' work for this state: None (no delayed scale), the copy of the
        scales a custom update made, or the arguments of ``te::delayed_scaling_update``."""
        recipe = state.recipe
        if recipe.float8_current():
            return None
        if not recipe.delayed():
            raise NotImplementedError(
                f"{owner}: the {type(recipe).__name__} recipe is not implemented"
            )
        length = recipe.amax_history_len
        if length > MAX_AMAX_HISTORY:
            raise ValueError(
                f"{owner}: DelayedScaling.amax_history_len ({length}) must be <= "
                f"{MAX_AMAX_HISTORY}, the history these buffers hold"
            )
        if (scope := current_scope()) is not None:
            scope.snapshot(self)  # te_compile.checkpoint: the state before this step's update
        if not self.calibrated:
            self.calibrated = has_tokens
            return None
        fmt = recipe.fp8_format
        limits = [fmt.max_fwd, fmt.max_fwd, fmt.max_bwd]
        history = self.amax_history if length == MAX_AMAX_HISTORY else self.amax_history[:length]
        fwd, grad = self.fwd_amax, self.grad_amax
        if _amax_group(state, recipe) is not None:
            # The backward op has no group: the gradient amax of the last backward is reduced here.
            fwd, grad = _reduce_amax(torch.cat([fwd, grad]), state, recipe).split([2, 1])
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            return _custom_update(history, self.scale, torch.cat([fwd, grad]), limits, recipe)
        # The two buffers as they are: the update's one kernel reads both (no cat first).
        return history, self.scale, fwd, limits, recipe.margin, recipe.amax_compute_algo, grad

    def note_recipe(self, owner: str, recipe: object) -> None:
        """Remember ``recipe``'s class and warn, as Transformer Engine does, when it is of
        another family than the one of this GEMM's last FP8 call (neither class a subclass of
        the other): a ``UserWarning`` ``"Recipe type changed from A to B"``. Eager calls only:
        ``warnings.warn`` would break a compiled graph, which recompiles for a recipe of
        another class anyway (it guards on the recipe's type)."""
        kind, last = type(recipe), self.recipe_type
        self.recipe_type = kind
        if last is None or issubclass(kind, last) or issubclass(last, kind):
            return
        warnings.warn(
            f"{owner}: Recipe type changed from {last.__name__} to {kind.__name__} since this "
            f"module's last FP8 forward; this may affect model behavior: its GEMMs now quantise "
            f"as {kind.__name__} says (weights kept with is_first_microbatch are cast again; "
            "the DelayedScaling amax history and scales are kept for a later DelayedScaling "
            "step). Use one recipe per module, or filter this warning if the switch is meant",
            UserWarning,
            stacklevel=5,
        )

    def record(self, amax: Tensor, state: AutocastState, *more: FP8GemmState) -> None:
        """Keep the forward's ``[amax(input), amax(weight)]``, then ``more``'s: delayed scaling
        (reduced over the amax group) and compiled steps copy them in one launch; eager current
        scaling keeps the op's output itself (read only by :func:`non_finite_amaxes`)."""
        if delayed := state.recipe.delayed():
            amax = _reduce_amax(amax, state, state.recipe)
        pairs = amax.reshape(-1, 2).unbind() if more else (amax,)
        if delayed or torch.compiler.is_compiling():
            torch._foreach_copy_([s.fwd_amax for s in (self, *more)], pairs)
            return
        for s, pair in zip((self, *more), pairs, strict=True):
            s._buffers["fwd_amax"] = pair


def delayed_scales(
    owner: str, state: AutocastState, has_tokens: bool, metas: tuple[FP8GemmState, ...]
) -> tuple[Tensor | None, ...]:
    """Per state of ``metas`` (one GEMM family call's), None under current scaling and at the
    first delayed step (the calibration step: the caller runs current scaling and records the
    amaxes); else fold the last amaxes into the history, recompute the scales and return a copy
    of them (the ``[3]`` the FP8 ops take). Two states with the built-in update (a
    LayerNormMLP's) are updated by one ``te::delayed_scaling_update`` call: one launch.
    ``has_tokens``: the GEMM's input has rows. A step without any (a zero-token batch) runs
    current scaling too but is not the calibration step: its input and gradient amaxes are 0,
    which would leave those scales at 1 for the next step. Inside ``te_compile.checkpoint``
    each state is first snapshotted, so that the recompute can start from it again."""
    todo = [meta._update(owner, state, has_tokens) for meta in metas]
    if len(todo) == 2 and all(isinstance(t, tuple) for t in todo) and todo[0][3:6] == todo[1][3:6]:
        both = update_states([(*t[:3], t[6]) for t in todo], *todo[0][3:6])
        return tuple(both.split(todo[0][1].shape[0]))
    return tuple(update_states([(*t[:3], t[6])], *t[3:6]) if isinstance(t, tuple) else t
                 for t in todo)  # fmt: skip


def non_finite_amaxes(model: nn.Module) -> dict[str, list[str]]:
    """The FP8 GEMMs of ``model`` whose last measured amaxes are inf or NaN: ``{name: ["input",
    "weight", "grad" (those that were)]}``, empty when all are finite. An inf or NaN in an input,
    weight or gradient shows up here after the step that saw it (per-tensor recipes, current and
    delayed); delayed scaling keeps its previous scale for such a slot. One host sync per call:
    call it when logging, not every step."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"non_finite_amaxes: model must be an nn.Module, got {model!r}")
    report = {}
    for name, state in model.named_modules():
        if isinstance(state, FP8GemmState):
            finite = torch.cat([state.fwd_amax, state.grad_amax]).isfinite().tolist()
            bad = [s for s, ok in zip(("input", "weight", "grad"), finite, strict=True) if not ok]
            if bad:
                report[name] = bad
    return report


# The built-in amax choices, as functions of the history.
_HISTORY_AMAX = {"max": lambda h: h.amax(0), "most_recent": lambda h: h[0]}


def _custom_update(
    history: Tensor, scale: Tensor, last: Tensor, limits: list[float], recipe
) -> Tensor:
    """``te::delayed_scaling_update`` with the recipe's callables (``DelayedScaling``'s
    ``amax_compute_algo`` / ``scaling_factor_compute_algo``) in place of the built-in amax choice
    or scale formula, in plain torch: roll the history in, pick the amax, compute the scales.
    Returns a copy of the new scales, laid out as ``functional.fp8_scaling.scale_copy``'s."""
    old = scale.clone()
    rolled = torch.roll(history, 1, dims=0)
    rolled[0] = last
    history.copy_(rolled)
    algo = recipe.amax_compute_algo
    amax = (algo if callable(algo) else _HISTORY_AMAX[algo])(rolled)
    from te_compile.kernels import device_constant

    fp8_max = device_constant(tuple(limits), torch.float32, scale.device)
    if (compute := recipe.scaling_factor_compute_algo) is not None:
        new = compute(amax, old, fp8_max, recipe)
    else:  # the built-in formula: an amax of 0, inf or NaN keeps the old scale
        ok = (amax > 0) & torch.isfinite(amax)
        new = div_rn(fp8_max, amax * 2.0**recipe.margin).clamp(max=FP32_MAX)
        new = torch.where(ok, new, old)
    scale.copy_(new)
    return scale_copy(scale).copy_(new)


def _drop_if_unused(module: FP8GemmState, state_dict, prefix: str, local_metadata) -> None:
    if module.is_unused():
        for name in module._buffers:
            state_dict.pop(prefix + name, None)


def _amax_group(state: AutocastState, recipe):
    """The group amaxes are max-reduced over, or None (no reduction)."""
    group = state.amax_reduction_group
    if group is None and recipe.reduce_amax and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return group


def _reduce_amax(amax: Tensor, state: AutocastState, recipe) -> Tensor:
    """Max over the amax reduction group (functional collective: traced by torch.compile)."""
    if (group := _amax_group(state, recipe)) is None:
        return amax
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(amax, "max", group)
