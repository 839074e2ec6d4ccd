r"""Delayed-scaling state update: ``te::delayed_scaling_update``, a mutating op on module buffers.

Delayed scaling (Transformer Engine's ``DelayedScaling`` recipe) casts a tensor to FP8 with a
scale derived from the amaxes of *earlier* steps, so the cast needs no reduction over the tensor
first. Per quantised tensor (slot) a module keeps, as buffers:

* ``amax_history`` ``[amax_history_len, slots]`` fp32: the last amaxes, newest in row 0;
* ``scale`` ``[slots]`` fp32: what the next casts multiply by;
* the amaxes the casts of the last step measured, ``amax`` ``[slots]`` (the forward reports the
  input/weight amaxes, the backward writes the gradient's; the module keeps them in two
  buffers, which the op takes as they are: ``amax`` for the first slots, ``amax_tail`` for the
  others).

The update, run by the module at the start of each forward (so the gradient amax of the previous
backward is included), for every slot:

.. math::
    h \leftarrow \mathrm{roll}(h, 1);\quad h_0 \leftarrow a_{last};\quad
    a = \begin{cases}\max_i h_i & \text{"max"}\\ h_0 & \text{"most\_recent"}\end{cases};\quad
    s \leftarrow \frac{\mathrm{fp8\_max}}{a \cdot 2^{\mathrm{margin}}}
    \ \text{where } a > 0 \text{ and finite, else unchanged}

A scale that overflows fp32 (an amax below ``fp8_max / FLT_MAX``, ~1e-36) becomes the largest
finite fp32 value, as in Transformer Engine, never inf. ``fp8_max`` holds one format's largest
value for the first slots and one for the others (the forward format's for input and weight,
the backward's for the gradient), which the CUDA kernel takes as two scalars.

On CUDA the whole update is one kernel launch, also inside a compiled graph: it reads the two
amax buffers in place (a ``torch.cat`` first would be one more kernel per input) and takes the
limits as scalars (a device tensor of them is one more kernel in a compiled graph, the copy of
its constant).

A separate op, not part of the differentiable linear ops: the differentiable ops stay pure
(scales in, amaxes out) and the mutation of module state is one node that ``torch.compile``
functionalises, so a compiled training step updates the buffers with zero graph breaks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from te_compile._checks import check_choice, check_int, check_tensor, passed_once
from te_compile._library import op, plain_fast_path
from te_compile.kernels import dense

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "FP32_MAX",
    "delayed_scaling_update",
    "delayed_scaling_update_op",
    "delayed_scaling_update_pair",
    "delayed_scaling_update_ref",
    "scale_copy",
    "update_states",
]

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FP32_MAX = torch.finfo(torch.float32).max  # an overflowing scale's value
_OWNER = "te.delayed_scaling_update"


def scale_copy(scale: Tensor, states: int = 1) -> Tensor:
    """An empty ``[states * slots]`` fp32 tensor for a copy of the delayed scales ``scale`` (of
    ``states`` states), one slot per 16 bytes (stride 4): each slot's ``[1]`` view is a valid
    ``torch._scaled_mm`` scale. Why a copy (Inductor drops a ``clone``), and why the stride (a
    contiguous copy put a saved slot 8 bytes into a buffer that ``_scaled_mm`` refused, H200,
    torch 2.11): ``docs/op_mechanism.md``."""
    return scale.new_empty_strided((states * scale.shape[0],), (4,))  # fp32; no CSE across states


def delayed_scaling_update_ref(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    fp8_max: list[float],
    margin: int,
    amax_compute_algo: str,
    amax_tail: Tensor | None = None,
) -> Tensor:
    """The update in place (see the module docstring), in plain torch: the CPU path and the
    definition the CUDA kernel is tested against. Returns a copy of the new scales."""
    history = torch.roll(amax_history, 1, dims=0)
    history[0] = amax if amax_tail is None else torch.cat([amax, amax_tail])
    window = history.amax(0) if amax_compute_algo == "max" else history[0]
    limit = torch.tensor(fp8_max, dtype=torch.float32, device=scale.device)
    new_scale = (limit / (window * (2.0**margin))).clamp(max=FP32_MAX)
    new_scale = torch.where((window > 0) & torch.isfinite(window), new_scale, scale)
    scale.copy_(new_scale)
    amax_history.copy_(history)
    return scale_copy(scale).copy_(new_scale)


def _limit_runs(fp8_max: list[float]) -> tuple[float, float, int] | None:
    """``(head_max, tail_max, n_head)`` when ``fp8_max`` is ``head_max`` for its first
    ``n_head`` slots and ``tail_max`` for the others (the kernel's scalars), else None."""
    if not fp8_max:
        return 1.0, 1.0, 0
    n_head = next((i for i, m in enumerate(fp8_max) if m != fp8_max[0]), len(fp8_max))
    if any(m != fp8_max[-1] for m in fp8_max[n_head:]):
        return None
    return fp8_max[0], fp8_max[-1], n_head


_RUNS: dict[tuple, tuple[float, float, int] | None] = {}  # _limit_runs per fp8_max, for _update


@passed_once  # an eager step's update: checked once per shapes and recipe
def _check(args: tuple) -> None:
    amax_history, scale, amax, fp8_max, margin, amax_compute_algo, amax_tail = args
    p = f"{_OWNER}: "
    check_choice(_OWNER, "amax_compute_algo", amax_compute_algo, AMAX_COMPUTE_ALGOS)
    check_int(_OWNER, 0, margin=margin)
    slots = scale.shape[0] if scale.ndim == 1 else -1
    if len(fp8_max) == slots and not all(0 < m < math.inf for m in fp8_max):
        raise ValueError(
            p + f"fp8_max (the formats' largest values) must be finite and > 0, got {fp8_max}"
        )
    if len(fp8_max) == slots and _limit_runs(fp8_max) is None:
        raise ValueError(
            p + "fp8_max must be one format's largest value for the first slots and one for the "
            f"others (the forward and the backward format), got {fp8_max}"
        )
    h, amaxes = amax_history, (amax,) if amax_tail is None else (amax, amax_tail)
    history = h.ndim == 2 and h.shape[1] == slots and h.shape[0] >= 1
    amax_slots = all(t.ndim == 1 for t in amaxes) and sum(t.shape[0] for t in amaxes) == slots
    float32 = all(t.dtype is torch.float32 for t in (h, scale, *amaxes))
    if history and amax_slots and len(fp8_max) == slots and float32:
        return
    tail = "" if amax_tail is None else f" + {list(amax_tail.shape)} ({amax_tail.dtype})"
    raise ValueError(
        p + "expected float32 amax_history [len >= 1, slots], scale [slots], amax "
        "[slots] (or amax and amax_tail, 1-D, together [slots]) and fp8_max of length slots; "
        f"got {list(amax_history.shape)}, {list(scale.shape)}, {list(amax.shape)}{tail}, "
        f"{len(fp8_max)} ({amax_history.dtype}, {scale.dtype}, {amax.dtype})"
    )


@op("delayed_scaling_update", mutates_args=("amax_history", "scale"))
def delayed_scaling_update_op(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    fp8_max: list[float],
    margin: int,
    amax_compute_algo: str,
    amax_tail: Tensor | None = None,
) -> Tensor:
    """Roll the history, take the new amax, recompute the scales (module docstring); returns
    a copy of the new scales laid out by :func:`scale_copy`: what the GEMM ops read."""
    _check((amax_history, scale, amax, fp8_max, margin, amax_compute_algo, amax_tail))
    return _update([(amax_history, scale, amax, amax_tail)], fp8_max, margin, amax_compute_algo)


@op(
    "delayed_scaling_update_pair",
    mutates_args=("amax_history", "scale", "amax_history2", "scale2"),
)
def delayed_scaling_update_pair(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    amax_tail: Tensor,
    amax_history2: Tensor,
    scale2: Tensor,
    amax2: Tensor,
    amax_tail2: Tensor,
    fp8_max: list[float],
    margin: int,
    amax_compute_algo: str,
) -> Tensor:
    """``te::delayed_scaling_update`` of two states of the same shapes and recipe in one launch
    (a LayerNormMLP's two GEMMs); the copy holds both states' new scales, the first's first."""
    states = _pair(amax_history, scale, amax, amax_tail, amax_history2, scale2, amax2, amax_tail2,
                   fp8_max, margin, amax_compute_algo)  # fmt: skip
    return _update(states, fp8_max, margin, amax_compute_algo)


def _update(states: list, fp8_max: list[float], margin: int, algo: str) -> Tensor:
    scale = states[0][1]
    if scale.device.type != "cuda":
        copies = [
            delayed_scaling_update_ref(*st[:3], fp8_max, margin, algo, st[3]) for st in states
        ]
        return copies[0] if len(copies) == 1 else scale_copy(scale, 2).copy_(torch.cat(copies))
    from te_compile.kernels.fp8_scaling import delayed_scaling_update as update

    if (runs := _RUNS.get(key := tuple(fp8_max))) is None:  # (checked: never None here)
        runs = _RUNS[key] = _limit_runs(fp8_max)
    out = scale_copy(scale, len(states))
    update(
        [(hist, s, dense(last), None if tail is None else dense(tail))
         for hist, s, last, tail in states],
        out, runs, margin, algo == "max")  # fmt: skip
    return out


def _pair(hist, scale, amax, tail, hist2, scale2, amax2, tail2, fp8_max, margin, algo) -> list:
    """The pair op's two states ``(amax_history, scale, amax, amax_tail)``, checked."""
    states = [(hist, scale, amax, tail), (hist2, scale2, amax2, tail2)]
    for h, s, a, t in states:
        _check((h, s, a, fp8_max, margin, algo, t))
    shapes = [(h.shape, h.stride(0), a.shape, t.shape) for h, _, a, t in states]
    if shapes[0] != shapes[1]:
        raise ValueError(f"{_OWNER}: the second state must have the first's shapes and history "
                         f"stride, got {shapes[1]} against {shapes[0]}")  # fmt: skip
    return states


def update_states(states: list, fp8_max: list[float], margin: int, algo: str) -> Tensor:
    """The update of one module's delayed-scaling states ``(amax_history, scale, amax,
    amax_tail)``, one or two of the same shapes (a LayerNormMLP's: one launch):
    ``te::delayed_scaling_update`` / ``_pair``. Eager with nothing watching, their implementation
    directly, without the op's entry and argument checks: the states are a module's own fp32
    buffers and the recipe checked ``margin``, ``algo`` and ``fp8_max`` when it was built; the
    written buffers' versions move on as the op's do. The same bytes either way. Where the op
    itself would dispatch (``_library.plain_fast_path``: amaxes of a tensor subclass, say a
    functional all-reduce's result over the amax group), the op runs."""
    if plain_fast_path(states):
        out = _update(states, fp8_max, margin, algo)
        torch.autograd.graph.increment_version([t for state in states for t in state[:2]])
        return out
    if len(states) == 2:
        return delayed_scaling_update_pair(*states[0], *states[1], fp8_max, margin, algo)
    hist, scale, amax, tail = states[0]
    return delayed_scaling_update_op(hist, scale, amax, fp8_max, margin, algo, tail)


@delayed_scaling_update_op.register_fake
def _delayed_scaling_update_fake(amax_history, scale, amax, fp8_max, margin, algo, amax_tail=None):
    _check((amax_history, scale, amax, fp8_max, margin, algo, amax_tail))
    return scale_copy(scale)


@delayed_scaling_update_pair.register_fake
def _delayed_scaling_update_pair_fake(*args):
    _pair(*args)
    return scale_copy(args[1], 2)


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    amax: Tensor,
    fp8_max: list[float],
    margin: int,
    amax_compute_algo: str,
    amax_tail: Tensor | None = None,
) -> Tensor:
    """``te::delayed_scaling_update`` with its arguments' types checked by name first (the op's
    schema parser would refuse a wrong type with a RuntimeError, and turn ``True`` into 1)."""
    for name, t in (("amax_history", amax_history), ("scale", scale), ("amax", amax)):
        check_tensor(_OWNER, name, t, min_dim=0)
    if amax_tail is not None:
        check_tensor(_OWNER, "amax_tail", amax_tail, min_dim=0)
    check_int(_OWNER, 0, margin=margin)
    if not isinstance(amax_compute_algo, str):
        raise TypeError(f"{_OWNER}: amax_compute_algo must be a str, got {amax_compute_algo!r}")
    return delayed_scaling_update_op(
        amax_history, scale, amax, fp8_max, margin, amax_compute_algo, amax_tail
    )
