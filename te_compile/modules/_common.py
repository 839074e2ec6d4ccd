"""Argument checks shared by the modules: each raises ValueError naming the argument."""

from __future__ import annotations

import torch

from te_compile._checks import check_bool, check_positive_finite

__all__ = [
    "DEFAULT_INIT_STD",
    "check_bool",
    "check_choice",
    "check_eps",
    "check_positive",
    "default_init_method",
    "params_dtype_or_default",
]

DEFAULT_INIT_STD = 0.023  # Transformer Engine's default weight init std


def default_init_method(weight: torch.Tensor) -> None:
    """Transformer Engine's default weight initialisation: normal, std 0.023."""
    torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def check_positive(owner: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def check_eps(owner: str, eps: float) -> None:
    check_positive_finite(owner, eps=eps)


def params_dtype_or_default(owner: str, params_dtype: torch.dtype | None) -> torch.dtype:
    dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise ValueError(f"{owner}: params_dtype must be a floating dtype, got {dtype}")
    return dtype


def check_choice(owner: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")
