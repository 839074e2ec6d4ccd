"""Argument checks shared by the modules: each raises ValueError naming the argument."""

from __future__ import annotations

import torch

from te_compile._checks import (
    check_bool,
    check_callable,
    check_device,
    check_dtype,
    check_positive_finite,
)

__all__ = [
    "DEFAULT_INIT_STD",
    "check_bool",
    "check_choice",
    "check_eps",
    "check_positive",
    "default_init_method",
    "init_method_or_default",
    "params_dtype_or_default",
]

DEFAULT_INIT_STD = 0.023  # Transformer Engine's default weight init std


def default_init_method(weight: torch.Tensor) -> None:
    """Transformer Engine's default weight initialisation: normal, std 0.023."""
    torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def weight_main_grad(owner: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad``, the fp32 buffer ``fuse_wgrad_accumulation=True`` accumulates the
    weight gradient into (allocated by the caller, e.g. a Megatron-style optimizer)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{owner}(fuse_wgrad_accumulation=True) needs weight.main_grad: a float32 tensor of "
            "the weight's shape, e.g. "
            "`m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)`"
        )
    return main_grad


def check_positive(owner: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def check_eps(owner: str, eps: float) -> None:
    check_positive_finite(owner, eps=eps)


def params_dtype_or_default(
    owner: str, params_dtype: torch.dtype | None, device: object = None
) -> torch.dtype:
    """``params_dtype`` (None: torch's default dtype), checked with the ``device`` argument."""
    dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
    check_dtype(owner, "params_dtype", dtype)
    check_device(owner, "device", device)
    return dtype


def init_method_or_default(owner: str, name: str, init_method: object):
    """``init_method`` (None: :func:`default_init_method`), checked to be callable."""
    check_callable(owner, **{name: init_method})
    return init_method if init_method is not None else default_init_method


def check_choice(owner: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")


def parse_parameters_split(
    owner: str, parameters_split: object, out_features: int, tp_size: int = 1
) -> tuple[tuple[str, int], ...] | None:
    """``((name, local_rows), ...)`` of Transformer Engine's ``parameters_split``: a dict of
    names to (global) output sizes, or a sequence of names that split ``out_features`` evenly;
    None: one weight. Each part is sharded over ``tp_size`` on its own (column parallelism: a
    rank holds its rows of every part, e.g. its heads' query, key and value rows)."""
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        items = list(parameters_split.items())
    elif isinstance(parameters_split, (list, tuple)) and parameters_split:
        names = list(parameters_split)
        if out_features % len(names):
            raise ValueError(
                f"{owner}: parameters_split splits out_features={out_features} evenly into "
                f"{len(names)} parts; {out_features} is not a multiple of {len(names)}"
            )
        items = [(name, out_features // len(names)) for name in names]
    else:
        raise ValueError(
            f"{owner}: parameters_split must be None, a dict of names to sizes or a non-empty "
            f"sequence of names, got {parameters_split!r}"
        )
    parts = []
    for name, size in items:
        if not isinstance(name, str) or not name.rstrip("_").isidentifier():
            raise ValueError(f"{owner}: parameters_split names must be identifiers, got {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % tp_size:
            raise ValueError(
                f"{owner}: parameters_split[{name!r}] must be a positive int divisible by "
                f"tp_size={tp_size}, got {size!r}"
            )
        parts.append((name.rstrip("_"), size // tp_size))
    if len({n for n, _ in parts}) != len(parts):
        raise ValueError(f"{owner}: parameters_split names must be unique, got {parameters_split}")
    total = sum(size for _, size in parts) * tp_size
    if total != out_features:
        raise ValueError(
            f"{owner}: parameters_split sizes must sum to out_features={out_features}, got {total}"
        )
    return tuple(parts)


class NamedSlices:
    """Transformer Engine's ``parameters_split`` on one fused weight: the module keeps a single
    ``weight`` (and ``bias``) Parameter, so the GEMM reads it without a concatenation per step,
    and exposes the named row blocks as ``<name>_weight`` / ``<name>_bias`` views (attributes)
    and as state_dict entries of those names, the keys a Transformer Engine checkpoint has.
    Loading takes either the split keys or the fused ``weight``/``bias``.

    A mixin for an ``nn.Module`` with ``weight`` and ``bias``; call :meth:`_init_slices` in
    ``__init__`` after the parameters exist."""

    def _init_slices(self, parts: tuple[tuple[str, int], ...] | None) -> None:
        self._slices: dict[str, tuple[str, int, int]] = {}
        if parts is None:
            return
        start = 0
        for name, rows in parts:
            for kind in ("weight", "bias"):
                self._slices[f"{name}_{kind}"] = (kind, start, rows)
            start += rows
        self.register_state_dict_post_hook(_split_state)
        self.register_load_state_dict_pre_hook(_fuse_state)

    def _split_parts(self, tp_size: int) -> tuple[int, ...] | None:
        """The full sizes of the named blocks (for sharding a full tensor), or None."""
        rows = [r for _, (kind, _, r) in self._slices.items() if kind == "weight"]
        return tuple(r * tp_size for r in rows) or None

    def __getattr__(self, name: str):
        slices = self.__dict__.get("_slices")
        if slices and name in slices:
            kind, start, rows = slices[name]
            whole = getattr(self, kind)
            return None if whole is None else whole[start : start + rows]
        return super().__getattr__(name)

    @property
    def parameters_split(self) -> tuple[str, ...] | None:
        names = [n[: -len("_weight")] for n, s in self._slices.items() if s[0] == "weight"]
        return tuple(names) or None


def _split_state(module: NamedSlices, state: dict, prefix: str, _metadata: object) -> None:
    for kind in ("weight", "bias"):
        whole = state.pop(prefix + kind, None)
        if whole is None:
            continue
        for name, (k, start, rows) in module._slices.items():
            if k == kind:
                state[prefix + name] = whole[start : start + rows]


def _fuse_state(module: NamedSlices, state: dict, prefix: str, *_args: object) -> None:
    for kind in ("weight", "bias"):
        names = [n for n, s in module._slices.items() if s[0] == kind]
        if prefix + kind in state or not all(prefix + n in state for n in names):
            continue  # the fused key, or missing parts (load_state_dict names them)
        state[prefix + kind] = torch.cat([state.pop(prefix + n) for n in names])
