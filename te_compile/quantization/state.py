"""The autocast state: which recipe modules quantise with, read in ``forward``.

``autocast`` (TE's signature; ``fp8_autocast`` is TE's older name for it) is a context manager
(and a decorator) that replaces the current :class:`AutocastState` and restores the previous one
on exit, exception or not. Modules call :func:`get_autocast_state` in ``forward`` and flatten the
snapshot into their ops' scalar arguments (``quantization.gemm.gemm_args``). Calibration
(``calibrating=True`` with ``enabled=False``): ``docs/fp8.md``, "Calibration".

How this works with ``torch.compile`` (checked on torch 2.13, see tests/quantization):

- The state is one immutable ``NamedTuple`` on one module-level holder object; dynamo replays
  attribute stores on a plain object after the graph runs, so an ``autocast`` entered *inside*
  a ``fullgraph=True`` region compiles with zero graph breaks.
- A compiled function that reads the state *set outside* it guards on what it read (the
  recipe's type, every field read): another recipe recompiles, reading nothing reuses.
- ``autocast`` is a plain class with ``__enter__``/``__exit__``, which dynamo inlines (a
  ``contextlib.contextmanager`` costs more per entry in eager; ``contextlib.ContextDecorator``
  re-enters an instance made outside the compiled region, which dynamo refuses, so
  ``__call__`` builds a fresh ``autocast`` per call).
- The state is process-wide, not thread-local, as in Transformer Engine; autograd runs
  backward on other threads, so modules capture the recipe in forward.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from te_compile._checks import check_bool
from te_compile.quantization.device import emulation_reason, get_default_fp8_recipe
from te_compile.quantization.recipe import FP8_QPARAMS, Recipe

__all__ = [
    "AutocastState",
    "autocast",
    "check_power_2_scales",
    "check_recipe_and_group",
    "fp8_autocast",
    "get_autocast_state",
]

_F = TypeVar("_F", bound=Callable[..., Any])


class AutocastState(NamedTuple):
    """Immutable snapshot of the autocast state.

    ``enabled``: quantise inside this region. ``recipe``: how (None outside any autocast).
    ``amax_reduction_group``: the process group amaxes are all-reduced over (None: the default
    group, when ``torch.distributed`` is initialised). ``calibrating``: measure amaxes and
    update the scales of ``recipe`` while computing in high precision (module docstring)."""

    enabled: bool
    recipe: Recipe | None
    amax_reduction_group: Any
    calibrating: bool = False

    @property
    def calibration(self) -> bool:
        """Whether the GEMMs run now compute in high precision and calibrate the recipe's
        scales: ``calibrating`` outside an enabled region."""
        return self.calibrating and not self.enabled


class Holder:
    """Holds ``current``; a plain object so that dynamo can trace stores to it."""

    def __init__(self, current: Any) -> None:
        self.current = current


STATE_HOLDER = Holder(AutocastState(enabled=False, recipe=None, amax_reduction_group=None))


def get_autocast_state() -> AutocastState:
    """The current autocast state (what modules read in ``forward``)."""
    return STATE_HOLDER.current


class autocast:
    """Quantise the modules run inside this region with ``recipe`` (TE's parameters and order).

    ``enabled``: ``False`` turns quantisation off inside an enabled region. ``calibrating``:
    with ``enabled=False``, compute in high precision while measuring amaxes and updating the
    recipe's scales. ``recipe``: ``None`` picks
    :func:`~te_compile.quantization.device.get_default_fp8_recipe`. ``amax_reduction_group``: a
    ``torch.distributed`` process group for the amax all-reduce, or ``None``. The recipe is read
    when a module runs, not copied on entry: a field set on it inside the region applies to the
    next forward (a compiled region recompiles). Use as ``with autocast(recipe=r): ...`` or
    ``@autocast(recipe=r)``, around or inside a ``torch.compile(fullgraph=True)`` region.
    """

    def __init__(
        self,
        enabled: bool = True,
        calibrating: bool = False,
        recipe: Recipe | None = None,
        amax_reduction_group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_args("autocast", "recipe", enabled, calibrating, recipe, amax_reduction_group)
        self.enabled = enabled
        self.calibrating = calibrating
        self.recipe = get_default_fp8_recipe() if recipe is None else recipe
        if self.recipe.float8_current():
            check_power_2_scales("autocast", self.recipe)
        self.amax_reduction_group = amax_reduction_group
        if enabled and not torch.compiler.is_compiling():
            _say_once_if_emulated(self.recipe)
        # States saved on entry, innermost last: one instance may be entered again before it
        # exits (``with cm: ... with cm: ...``), and each exit restores its own entry's state.
        self._saved: list[AutocastState] = []

    def __enter__(self) -> None:
        self._saved.append(STATE_HOLDER.current)
        STATE_HOLDER.current = AutocastState(
            self.enabled, self.recipe, self.amax_reduction_group, self.calibrating
        )

    def __exit__(self, *exc_info: object) -> None:
        STATE_HOLDER.current = self._saved.pop()

    def __call__(self, fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.enabled, self.calibrating, self.recipe, self.amax_reduction_group):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


# The recipe classes whose emulation was announced in this process.
_ANNOUNCED: set[type] = set()


def check_power_2_scales(owner: str, recipe: Recipe) -> None:
    """Float8CurrentScaling's power-of-two scales (``use_power_2_scales``, or one operand's
    ``fp8_quant_*.power_2_scale``): te_compile.quantize applies them, the modules' per-tensor
    kernels do not, so a recipe that asks for them is refused rather than ignored."""
    if on := [name for name in FP8_QPARAMS if getattr(recipe, name).power_2_scale]:
        asked = ("(use_power_2_scales=True)" if recipe.use_power_2_scales
                 else f" with {', '.join(f'{n}.power_2_scale=True' for n in on)}")  # fmt: skip
        raise NotImplementedError(
            f"{owner}: Float8CurrentScaling{asked} is not implemented in the modules' FP8 GEMMs "
            f"(te_compile.quantize takes it); use power_2_scale=False in {', '.join(on)} "
            "(use_power_2_scales=False sets all three), or Float8BlockScaling (power-of-two "
            "block scales by default)"
        )


def _say_once_if_emulated(recipe: Recipe) -> None:
    """Warn, once per recipe class and process, that the recipe's GEMMs are emulated here. Not
    while dynamo traces (``warnings.warn`` would break the graph): an ``autocast`` built inside
    a compiled region says nothing, one built around it (the usual ``with``) does."""
    kind = type(recipe)
    if kind in _ANNOUNCED:
        return
    _ANNOUNCED.add(kind)
    if reason := emulation_reason(recipe):
        warnings.warn(
            f"autocast: {kind.__name__}'s GEMMs are emulated on this machine ({reason}): the "
            "quantised operands are multiplied in fp32, so the results have the recipe's "
            "numerics but not its speed",
            stacklevel=3,
        )


def fp8_autocast(
    enabled: bool = True,
    calibrating: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_group: dist.ProcessGroup | None = None,
    _graph: bool = False,
) -> autocast:
    """Transformer Engine's older name for :class:`autocast`: ``fp8_recipe`` is ``recipe``,
    ``fp8_group`` is ``amax_reduction_group``. ``_graph`` (TE: skip the work TE runs when the
    region exits, for a CUDA graph) changes nothing: te_compile has no work at the exit."""
    _check_args("fp8_autocast", "fp8_recipe", enabled, calibrating, fp8_recipe, fp8_group)
    check_bool("fp8_autocast", _graph=_graph)
    return autocast(enabled, calibrating, fp8_recipe, fp8_group)


def _check_args(owner: str, recipe_name: str, enabled, calibrating, recipe, group) -> None:
    check_bool(owner, enabled=enabled, calibrating=calibrating)
    group_name = "amax_reduction_group" if owner == "autocast" else "fp8_group"
    check_recipe_and_group(owner, recipe_name, recipe, group_name, group)


def check_recipe_and_group(owner, recipe_name, recipe, group_name, group, error=ValueError) -> None:
    """``recipe`` must be a Recipe or None and ``group`` a process group or None (``error``)."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise error(
            f"{owner}: {recipe_name} must be a Recipe (e.g. DelayedScaling()) or None, "
            f"got {recipe!r}"
        )
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise error(
            f"{owner}: {group_name} must be a torch.distributed.ProcessGroup or None, got {group!r}"
        )
