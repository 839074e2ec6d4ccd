"""What the modules share: argument checks (each raises naming the argument), parameter splits,
the RNG tracker fork and the delayed weight gradients."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from te_compile._checks import (
    check_bool,
    check_callable,
    check_device,
    check_dtype,
    check_positive_finite,
    default_device,
)

__all__ = [
    "DEFAULT_INIT_STD",
    "DelayedWgrad",
    "check_bool",
    "check_choice",
    "check_eps",
    "check_positive",
    "check_rng_tracker",
    "default_device",
    "default_init_method",
    "eager_when_delaying_wgrad",
    "init_method_or_default",
    "params_dtype_or_default",
    "rng_fork",
]

DEFAULT_INIT_STD = 0.023  # Transformer Engine's default weight init std


def default_init_method(weight: torch.Tensor) -> None:
    """Transformer Engine's default weight initialisation: normal, std 0.023."""
    torch.nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def check_rng_tracker(owner: str, get_rng_state_tracker: object, rng_tracker_name: object) -> None:
    """Transformer Engine's ``get_rng_state_tracker`` (a callable returning a tracker with a
    ``fork(name)`` context manager, e.g. Megatron's ``CudaRNGStatesTracker``) and
    ``rng_tracker_name`` (the tracker's state to fork; None: the tracker's default)."""
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError(
            f"{owner}: get_rng_state_tracker must be a callable returning an RNG states tracker "
            f"or None, got {get_rng_state_tracker!r}"
        )
    if rng_tracker_name is not None and not isinstance(rng_tracker_name, str):
        raise TypeError(
            f"{owner}: rng_tracker_name must be a str or None, got {rng_tracker_name!r}"
        )


def rng_fork(get_rng_state_tracker, rng_tracker_name: str | None = None) -> AbstractContextManager:
    """The context random draws run in: the tracker's ``fork(rng_tracker_name)`` (its default
    state when the name is None), as Transformer Engine forks it for parameter initialisation
    under tensor parallelism and for attention dropout; no tracker: torch's default
    generator."""
    if get_rng_state_tracker is None:
        return nullcontext()
    tracker = get_rng_state_tracker()
    if not callable(getattr(tracker, "fork", None)):
        raise TypeError(
            "get_rng_state_tracker() must return an RNG states tracker with a fork(name) "
            f"context manager, got {tracker!r}"
        )
    return tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork()


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


def _fuse_state(module: NamedSlices, state: dict, prefix: str, *args: object) -> None:
    """Load a checkpoint's split keys into the fused parameter, reporting each problem by the
    key the checkpoint has (``query_weight``), never by the fused ``weight`` it does not: a
    mis-shaped part is a size mismatch of its own key, a missing part a missing key of its own
    (the present parts still load under ``strict=False``), and no present part is left over as
    an unexpected key."""
    missing_keys, error_msgs = args[-3], args[-1]  # load_state_dict's lists (the hook's args)
    for kind in ("weight", "bias"):
        names = [n for n, s in module._slices.items() if s[0] == kind]
        present = [n for n in names if prefix + n in state]
        whole = getattr(module, kind)
        if prefix + kind in state or not present or whole is None:
            continue  # the fused key, no part (load_state_dict names the fused key), no bias
        bad = [n for n in present if state[prefix + n].shape != getattr(module, n).shape]
        for n in bad:
            error_msgs.append(
                f"size mismatch for {prefix}{n}: copying a param with shape "
                f"{tuple(state[prefix + n].shape)} from checkpoint, the shape in current model "
                f"is {tuple(getattr(module, n).shape)}."
            )
        missing_keys.extend(prefix + n for n in names if n not in present)
        parts = {n: state.pop(prefix + n) for n in present}
        # A missing or mis-shaped part keeps the module's rows (the load fails unless
        # strict=False tolerates the missing ones).
        kept = [parts[n] if n in parts and n not in bad else getattr(module, n) for n in names]
        state[prefix + kind] = torch.cat([p.detach() for p in kept])


class DelayedWgrad:
    """Transformer Engine's ``delay_wgrad_compute`` / ``backward_dw()`` for a module of GEMMs
    (pipeline-parallel schedules that overlap the weight-gradient GEMMs with other work).

    With ``delay_wgrad_compute=True`` a forward with gradients enabled and a weight that needs
    one (in ``train()`` or ``eval()`` mode, as in Transformer Engine) queues its GEMMs'
    :class:`~te_compile.functional.family.DeferredWgrad`; the backward then computes the input's,
    the bias's and the norm's gradients and leaves the weights' ``grad`` (or ``main_grad``)
    untouched; :meth:`backward_dw` runs the weight-gradient GEMMs of one backward and
    accumulates them into ``weight.grad`` (summed like autograd's, where Transformer Engine
    overwrites it) or, with ``fuse_wgrad_accumulation``, into ``weight.main_grad``, then calls
    the hooks of :meth:`register_wgrad_accumulation_and_reduce_hooks`. Each call consumes the
    oldest forward whose backward has run, so several microbatches may be in flight. A forward
    whose backward never runs (an evaluation without ``torch.no_grad()``) leaves the queue when
    its autograd graph is freed: its output is dropped.

    Under ``torch.compile`` such a forward runs eagerly, behind a graph break
    (:func:`eager_when_delaying_wgrad`): a compiled backward cannot hand the output gradient
    out of its graph to ``backward_dw()``. With ``fullgraph=True`` the first call raises
    dynamo's ``Unsupported``, whose explanation names ``delay_wgrad_compute``.

    A mixin for an ``nn.Module``; call :meth:`_init_delayed_wgrad` in ``__init__``, decorate
    ``forward`` with :func:`eager_when_delaying_wgrad` and hand each forward's list and output
    to :meth:`_wgrad_queue`."""

    def _init_delayed_wgrad(self, owner: str, delay_wgrad_compute: bool) -> None:
        check_bool(owner, delay_wgrad_compute=delay_wgrad_compute)
        self.delay_wgrad_compute = delay_wgrad_compute
        self._wgrad_pending: list[list[tuple]] = []
        self.wgrad_accumulation_and_reduce_hooks: list = []

    def _delaying_wgrad(self) -> bool:
        """Whether a forward now would delay its weight gradients (it will if a weight needs
        one)."""
        return self.delay_wgrad_compute and torch.is_grad_enabled()

    def _wgrad_defer(self, *weights: torch.Tensor) -> list | None:
        """A list to collect the forward's delayed weight gradients in, or None (not delayed)."""
        if not self._delaying_wgrad():
            return None
        return [] if any(w.requires_grad for w in weights) else None

    def _wgrad_queue(self, defer: list | None, out: torch.Tensor) -> None:
        """Queue the delayed GEMMs of the forward that produced ``out`` until its output's
        autograd graph is freed: then, unless its backward ran, they leave the queue (a token
        in the graph node's ``metadata`` dies with the graph)."""
        if not defer or out.grad_fn is None:
            return
        self._wgrad_pending.append(defer)
        token = _GraphToken()
        out.grad_fn.metadata.setdefault("te_compile.delayed_wgrad", []).append(token)
        weakref.finalize(token, _drop_if_never_run, weakref.ref(self), defer).atexit = False

    def need_backward_dw(self) -> bool:
        """Whether :meth:`backward_dw` must run to complete the weight gradients."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        """``hook()`` runs after each :meth:`backward_dw` (e.g. a data-parallel gradient
        reduction, which the weights' autograd hooks no longer trigger)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        """Run the delayed weight-gradient GEMMs of the oldest forward whose backward has run."""
        if not self.delay_wgrad_compute:
            return
        pending = self._wgrad_pending
        done = next((i for i, e in enumerate(pending) if _backward_ran(e)), None)
        if done is None:
            name = type(self).__name__
            raise RuntimeError(
                f"{name}.backward_dw(): no weight gradient to compute: "
                + (
                    f"the backward of none of the {len(pending)} pending forward(s) has run"
                    if pending
                    else "no forward with delay_wgrad_compute=True and gradients enabled is "
                    "pending (call backward_dw() once per backward)"
                )
            )
        with torch.no_grad():
            for deferred, weights in pending.pop(done):
                dweight = deferred.compute()
                if dweight is None:  # accumulated into weight.main_grad
                    continue
                # One weight, or the groups' weights of a grouped GEMM's [G, N, K] gradient.
                single = isinstance(weights, torch.Tensor)
                for weight, grad in zip(
                    (weights,) if single else weights,
                    (dweight,) if single else dweight.unbind(0),
                    strict=True,
                ):
                    if weight.grad is None:
                        weight.grad = grad.clone() if not single else grad
                    else:
                        weight.grad += grad
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class _GraphToken:
    """Lives in an autograd node's ``metadata``: freed with the graph."""


def _backward_ran(entry: list[tuple]) -> bool:
    return all(deferred.ready for deferred, _ in entry)


def _drop_if_never_run(module_ref: weakref.ref, entry: list[tuple]) -> None:
    """A forward's graph was freed: its backward can no longer run, so unless it ran, its
    delayed GEMMs (and the tensors they hold) leave the module's queue."""
    module = module_ref()
    if module is None or _backward_ran(entry):
        return
    pending = module._wgrad_pending
    for i, e in enumerate(pending):
        if e is entry:  # by identity: the entries hold tensors
            del pending[i]
            return


def eager_when_delaying_wgrad(forward: Callable) -> Callable:
    """``forward`` of a :class:`DelayedWgrad` module, run eagerly under ``torch.compile`` when
    it delays weight gradients (``torch.compiler.disable``: a graph break, or dynamo's
    ``Unsupported`` error with ``fullgraph=True``, naming the reason below). Otherwise, and
    in eager mode, ``forward`` itself."""
    owner = forward.__qualname__.split(".")[0]
    eager = torch.compiler.disable(
        forward,
        reason=(
            f"te_compile.{owner}(delay_wgrad_compute=True) runs eagerly under torch.compile "
            "(its backward hands the output gradient to backward_dw(), which a compiled "
            "backward cannot do); with fullgraph=True construct it with "
            "delay_wgrad_compute=False or call it outside the compiled region"
        ),
    )

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if self._delaying_wgrad() and torch.compiler.is_compiling():
            return eager(self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    return wrapper
