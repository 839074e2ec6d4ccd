"""Activation checkpointing that recomputes FP8 modules exactly: ``te_compile.checkpoint``
(``docs/distributed.md``, "Activation checkpointing", says what it guarantees).

:func:`checkpoint` runs the function under ``torch.utils.checkpoint`` with two additions: the
recompute runs under the autocast state the forward saw, with a copy of the recipe as it was then
(recipes are mutable); and a :class:`RecomputeScope` is open while the function runs, in which
every FP8 GEMM state (``quantization.fp8_gemm.FP8GemmState``) is snapshotted before the forward's
first update of it, so the recompute starts from the forward's state and the state is put back as
the forward left it. Under ``torch.compile`` it calls ``torch.utils.checkpoint.checkpoint`` as it
is (the compiler recomputes from its traced graph) and refuses ``DelayedScaling``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint

from te_compile._checks import check_bool
from te_compile.quantization.state import STATE_HOLDER, Holder, get_autocast_state

__all__ = ["RecomputeScope", "checkpoint", "current_scope"]


class RecomputeScope:
    """The FP8 states one checkpointed call uses, each as it was before the forward's first
    update of it, for the recompute to start from again."""

    def __init__(self) -> None:
        self.replay = False
        self._before: dict[int, tuple[object, bool, list[torch.Tensor]]] = {}

    def snapshot(self, state) -> None:
        """Called by an FP8 state before it updates (``FP8GemmState.delayed_scale``): keeps the
        buffers a forward writes and the calibration flag, at the forward's first call."""
        copies = [b.clone() for b in state.forward_state()]
        if not self.replay and id(state) not in self._before:
            self._before[id(state)] = (state, state.calibrated, copies)

    def rewound(self) -> dict[int, tuple[object, bool, list[torch.Tensor]]]:
        """Set every kept state back to its snapshot for a recompute; returns the states as
        they are now, for :func:`_restore` after it."""
        self.replay = True
        now = {}
        for key, (state, calibrated, copies) in self._before.items():
            now[key] = (state, state.calibrated, [b.clone() for b in state.forward_state()])
            _restore(state, calibrated, copies)
        return now


def _restore(state, calibrated: bool, copies: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for buffer, saved in zip(state.forward_state(), copies, strict=True):
            buffer.copy_(saved)
    state.calibrated = calibrated


_SCOPE = Holder(None)  # current: the RecomputeScope of the checkpointed call running now


def current_scope() -> RecomputeScope | None:
    """The scope of the checkpointed call running now, or None."""
    return _SCOPE.current


# torch.utils.checkpoint's own keyword arguments; te.checkpoint's other ones are function's.
_TORCH_CHECKPOINT_ARGS = ("context_fn", "determinism_check", "debug", "preserve_rng_state",
                          "early_stop")  # fmt: skip


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker: Callable[[], Any] | None = None,
    tp_group: Any = None,
    use_reentrant: bool = True,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` with its activations recomputed in the backward, FP8 state
    included (module docstring); Transformer Engine's ``checkpoint``.

    ``use_reentrant``: as ``torch.utils.checkpoint`` (TE's default, True, needs an input that
    requires grad). ``kwargs``: ``torch.utils.checkpoint``'s own (``context_fn``,
    ``determinism_check``, ``debug``, ``preserve_rng_state``, ``early_stop``) go to it; the others
    are ``function``'s, also with ``use_reentrant=True`` (as in TE: they are passed as they are to
    the forward and to the recompute, not as checkpointed inputs). ``distribute_saved_activations``
    only False, ``get_rng_state_tracker`` only None (their messages say why); ``tp_group``, used
    by TE only with ``distribute_saved_activations``, is accepted and unused."""
    if not callable(function):
        raise ValueError(f"te.checkpoint: function must be callable, got {function!r}")
    if distribute_saved_activations is not False:
        raise ValueError(
            "te.checkpoint: distribute_saved_activations must be False: sharding the saved "
            f"activations over the tensor-parallel group is not implemented, got "
            f"{distribute_saved_activations!r}"
        )
    if get_rng_state_tracker is not None:
        raise ValueError(
            "te.checkpoint: get_rng_state_tracker must be None: te_compile's dropout draws its "
            "seeds from torch's generators, which the checkpoint restores for the recompute"
        )
    check_bool("te.checkpoint", use_reentrant=use_reentrant)
    options = {k: kwargs.pop(k) for k in _TORCH_CHECKPOINT_ARGS if k in kwargs}
    if kwargs:  # function's keyword arguments: bound here (the reentrant checkpoint takes none)
        function = functools.partial(function, **kwargs)
    state = get_autocast_state()
    if torch.compiler.is_compiling():
        if state.enabled and state.recipe is not None and state.recipe.delayed():
            raise ValueError(
                "te.checkpoint: under DelayedScaling, checkpointing inside a torch.compile region "
                "is not supported: the delayed-scaling update writes the FP8 state, which a "
                "compiled checkpoint region cannot hold. Checkpoint around the compiled module "
                "instead (te.checkpoint(torch.compile(block), x)), or use Float8CurrentScaling"
            )
        return torch.utils.checkpoint.checkpoint(
            function, *args, use_reentrant=use_reentrant, **options
        )
    if state.recipe is not None:
        state = state._replace(recipe=copy.copy(state.recipe))
    scope = RecomputeScope()
    runs = [0]

    def run(*a: Any) -> Any:
        # Each recompute (a second backward recomputes again) starts from the FP8 state the
        # forward started from, and leaves the state as it found it.
        after = scope.rewound() if runs[0] > 0 else {}
        runs[0] += 1
        outer_state, outer_scope = STATE_HOLDER.current, _SCOPE.current
        STATE_HOLDER.current, _SCOPE.current = state, scope
        try:
            return function(*a)
        finally:
            STATE_HOLDER.current, _SCOPE.current = outer_state, outer_scope
            for fp8_state, calibrated, copies in after.values():
                _restore(fp8_state, calibrated, copies)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **options)
