"""The autocast state: which recipe modules quantise with, read in ``forward``.

``autocast(enabled=True, recipe=..., amax_reduction_group=...)`` is a context manager (and a
decorator) that replaces the current :class:`AutocastState` and restores the previous one on
exit, exception or not. Modules call :func:`get_autocast_state` in ``forward`` and flatten the
snapshot into the scalar arguments of their ops. Outside any autocast the state is
``AutocastState(enabled=False, recipe=None, amax_reduction_group=None)``.

How this works with ``torch.compile`` (checked on torch 2.13, see tests/quantization):

- The state is one immutable ``NamedTuple`` stored on one module-level holder object; entering
  stores a new snapshot on the holder, exiting stores back the one saved on entry. Dynamo traces
  attribute stores on a plain object as side effects it replays after the graph runs, so an
  ``autocast`` entered *inside* a ``fullgraph=True`` region compiles with zero graph breaks and
  leaves the holder as it found it.
- A compiled function that reads the state *set outside* it gets guards on what it read: the
  recipe's type (reading ``recipe.kind`` or calling ``recipe.delayed()`` reads the class) and
  every field it read (``recipe.margin == 0``). Called again under a different recipe, a guard
  fails and dynamo recompiles instead of reusing the stale graph. Reading nothing, it guards on
  nothing, and one graph serves every recipe.
- ``autocast`` is a plain class with ``__enter__``/``__exit__``, which dynamo inlines. A
  ``contextlib.contextmanager`` generator traces as well but costs more per entry in eager;
  ``contextlib.ContextDecorator`` does not trace as a decorator (it re-enters an instance made
  outside the compiled region, which dynamo refuses), so ``__call__`` builds a fresh ``autocast``
  per call instead.
- The state is process-wide, not thread-local, as in Transformer Engine; the autograd engine
  runs backward on other threads, so modules capture the recipe in forward rather than reading
  the state in backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

from te_compile.quantization.device import get_default_fp8_recipe
from te_compile.quantization.recipe import Recipe

__all__ = ["AutocastState", "autocast", "get_autocast_state"]

_F = TypeVar("_F", bound=Callable[..., Any])


class AutocastState(NamedTuple):
    """Immutable snapshot of the autocast state.

    ``enabled``: quantise inside this region. ``recipe``: how (None outside any autocast).
    ``amax_reduction_group``: the process group amaxes are all-reduced over (None: the default
    group, when ``torch.distributed`` is initialised)."""

    enabled: bool
    recipe: Recipe | None
    amax_reduction_group: Any


class _Holder:
    """Holds the current state; a plain object so that dynamo can trace stores to it."""

    def __init__(self) -> None:
        self.current = AutocastState(enabled=False, recipe=None, amax_reduction_group=None)


_HOLDER = _Holder()


def get_autocast_state() -> AutocastState:
    """The current autocast state (what modules read in ``forward``)."""
    return _HOLDER.current


class autocast:
    """Quantise the modules run inside this region with ``recipe``.

    ``enabled``: ``False`` turns quantisation off inside an enabled region. ``recipe``: a
    :class:`~te_compile.quantization.recipe.Recipe`; ``None`` picks
    :func:`~te_compile.quantization.device.get_default_fp8_recipe` (``DelayedScaling()`` except on
    Blackwell, as in TE). ``amax_reduction_group``: a ``torch.distributed`` process group for the
    amax all-reduce, or ``None``. ``recipe`` and ``amax_reduction_group`` are keyword-only: TE's
    second positional parameter is ``calibrating``, which te_compile does not have.

    Use as ``with autocast(recipe=r): ...`` or as a decorator ``@autocast(recipe=r)``; both work
    around and inside a ``torch.compile(fullgraph=True)`` region.
    """

    def __init__(
        self,
        enabled: bool = True,
        *,
        recipe: Recipe | None = None,
        amax_reduction_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"autocast: enabled must be a bool, got {enabled!r}")
        if recipe is not None and not isinstance(recipe, Recipe):
            raise ValueError(
                f"autocast: recipe must be a Recipe (e.g. DelayedScaling()) or None, got {recipe!r}"
            )
        if amax_reduction_group is not None and not (
            dist.is_available() and isinstance(amax_reduction_group, dist.ProcessGroup)
        ):
            raise ValueError(
                "autocast: amax_reduction_group must be a torch.distributed.ProcessGroup or None, "
                f"got {amax_reduction_group!r}"
            )
        self.enabled = enabled
        self.recipe = get_default_fp8_recipe() if recipe is None else recipe
        if self.recipe.float8_current() and self.recipe.use_power_2_scales:
            # te_compile.quantize applies it; the modules' per-tensor kernels do not: refused
            # rather than ignored.
            raise NotImplementedError(
                "autocast: Float8CurrentScaling(use_power_2_scales=True) is not implemented in "
                "the modules' FP8 GEMMs (te_compile.quantize takes it); use "
                "use_power_2_scales=False, or Float8BlockScaling (power-of-two block scales by "
                "default)"
            )
        self.amax_reduction_group = amax_reduction_group
        # States saved on entry, innermost last: one instance may be entered again before it
        # exits (``with cm: ... with cm: ...``), and each exit restores its own entry's state.
        self._saved: list[AutocastState] = []

    def __enter__(self) -> None:
        self._saved.append(_HOLDER.current)
        _HOLDER.current = AutocastState(self.enabled, self.recipe, self.amax_reduction_group)

    def __exit__(self, *exc_info: object) -> None:
        _HOLDER.current = self._saved.pop()

    def __call__(self, fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(
                self.enabled, recipe=self.recipe, amax_reduction_group=self.amax_reduction_group
            ):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
