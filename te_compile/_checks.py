"""Checks of public scalar arguments, shared by every layer (modules, te.ops, functional,
quantization): each raises ValueError naming the owner, the argument, the constraint and the
value. They read Python scalars only, never tensor data, so the same check runs in eager and
while ``torch.compile`` traces the calling Python (comparisons only: a float that dynamo traces
as a ``SymFloat`` compares, where ``math.isfinite`` would not trace).

A NaN fails every comparison, so each constraint is written as the comparisons that hold for a
valid value (``0 < v < inf``), never as the negation of an invalid one (``v <= 0``)."""

from __future__ import annotations

import math

import torch

_REAL = (int, float, torch.SymInt, torch.SymFloat)


def check_bool(owner: str, **flags: object) -> None:
    """Each flag is ``True`` or ``False``: a truthy string or a tensor would switch a mode on
    without saying so."""
    for name, value in flags.items():
        if value is not True and value is not False:
            raise ValueError(f"{owner}: {name} must be a bool (True or False), got {value!r}")


def _real(value: object) -> bool:
    return isinstance(value, _REAL) and not isinstance(value, bool)


def check_positive_finite(owner: str, **values: float) -> None:
    """Each value is a real number with ``0 < v < inf`` (eps, limits, slopes)."""
    for name, value in values.items():
        if not (_real(value) and 0 < value < math.inf):
            raise ValueError(
                f"{owner}: {name} must be a positive float (finite, > 0), got {value!r}"
            )


def check_finite(owner: str, **values: float) -> None:
    """Each value is a real number with ``-inf < v < inf`` (offsets, output scales)."""
    for name, value in values.items():
        if not (_real(value) and -math.inf < value < math.inf):
            raise ValueError(f"{owner}: {name} must be a float (finite), got {value!r}")
