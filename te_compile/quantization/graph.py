"""CUDA graphs of modules' forward and backward: ``te_compile.make_graphed_callables``.

Transformer Engine's ``make_graphed_callables`` (its signature, its return shape): each callable
is warmed up on its samples on a side stream, then its forward and backward are captured in two
CUDA graphs under ``te_compile.autocast``, so the graphs hold the recipe's casts and its state
updates. ``docs/graphs.md`` is the full account: the steps, what a graphed callable checks and
replays (``graph_replay``), DelayedScaling's first step, the interleaved schedules (``_order``,
:class:`_Schedule`) and the arguments that raise ``NotImplementedError``.
"""

from __future__ import annotations

import gc
import reprlib
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from te_compile._checks import check_bool, check_callable, check_int
from te_compile.quantization.device import get_default_fp8_recipe
from te_compile.quantization.fp8_gemm import FP8GemmState
from te_compile.quantization.graph_replay import (
    _NAME,
    CallSpec,
    CapturedGraphs,
    graphed_forward,
    make_replay,
    tensor_outputs,
)
from te_compile.quantization.recipe import Recipe
from te_compile.quantization.state import autocast, check_recipe_and_group

__all__ = ["make_graphed_callables"]

# (older name, current name): TE deprecated the fp8_* arguments in favour of these.
_RENAMED = (
    ("fp8_enabled", "enabled"),
    ("fp8_calibrating", "calibrating"),
    ("fp8_recipe", "recipe"),
    ("fp8_group", "amax_reduction_group"),
    ("fp8_weight_caching", "cache_quantized_params"),
)


def make_graphed_callables(
    modules: Callable | tuple[Callable, ...],
    sample_args: tuple[Any, ...],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: dict[str, Any] | tuple[dict[str, Any], ...] | None = None,
    fp8_enabled: bool | tuple[bool, ...] | None = None,
    fp8_calibrating: bool | None = None,
    fp8_recipe: Recipe | None = None,
    fp8_group: dist.ProcessGroup | None = None,
    fp8_weight_caching: bool | None = None,
    enabled: bool | tuple[bool, ...] | None = None,
    calibrating: bool | None = None,
    recipe: Recipe | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
    cache_quantized_params: bool | None = None,
    _order: list[int] | None = None,
    _num_layers_per_chunk: list[int] | None = None,
    pool: tuple[int, ...] | None = None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
    _clone_param_grads_on_return: bool = True,
    pre_warmup_hook: Callable[[], Any] | None = None,
    post_warmup_hook: Callable[[], Any] | None = None,
    capture_time_hooks: list[dict[str, dict]] | None = None,
    capture_stream: torch.cuda.Stream | None = None,
) -> Callable | tuple[Callable, ...]:
    """CUDA-graphed versions of ``modules`` (module docstring); Transformer Engine's signature.

    ``modules``: a callable (``nn.Module`` or function) or a tuple of them; ``sample_args``: the
    positional arguments (tensors) of the callable, or a tuple of them per callable;
    ``sample_kwargs`` likewise, dicts (tensors, or values every call must repeat). ``enabled``
    (a bool, or one per callable), ``calibrating``, ``recipe`` (None: the default recipe) and
    ``amax_reduction_group``: the ``te_compile.autocast`` the callables are captured under;
    ``fp8_enabled``, ``fp8_calibrating``, ``fp8_recipe``, ``fp8_group`` and
    ``fp8_weight_caching`` are their older names (a ``DeprecationWarning``; giving both names of
    one argument raises ``ValueError``). ``_order`` / ``_num_layers_per_chunk``: an interleaved
    pipeline schedule (:class:`_Schedule`), one ``sample_args`` entry and one graphed forward
    per pass. ``num_warmup_iters``: eager runs before capture; ``allow_unused_input``: inputs
    (and parameters) the outputs do not depend on get a None gradient instead of an error;
    ``pool``: a ``torch.cuda.graph_pool_handle()`` to share; ``retain_graph_in_backward``:
    capture the backward with ``retain_graph=True``; ``_clone_param_grads_on_return``: parameter
    gradients as copies (False: views of the graph's buffers, overwritten by the next replay);
    ``pre_warmup_hook`` / ``post_warmup_hook``: called once before / after all warm-up runs;
    ``capture_stream``: the stream of warm-up and capture (default: a new one). Returns the
    graphed callable, or a tuple of them when ``modules`` is a tuple.
    """
    resolved, spelled = _resolve_renamed(locals())
    enabled, calibrating, recipe, group, cache_quantized_params = resolved

    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    _check_callables(callables, modules)
    n = len(callables)
    if capture_time_hooks is not None:
        if not isinstance(capture_time_hooks, list):
            raise TypeError(
                f"{_NAME}: capture_time_hooks must be None (a list of hook dicts is not "
                f"implemented), got {capture_time_hooks!r}"
            )
        raise NotImplementedError(
            f"{_NAME}: capture_time_hooks is not implemented (register hooks on the modules "
            f"after graphing: they run around each replay); pass None, got {capture_time_hooks!r}"
        )
    n_samples = 1 if single or not isinstance(sample_args, (tuple, list)) else len(sample_args)
    schedule = _Schedule.build(_order, _num_layers_per_chunk, n, n_samples)
    count = "forward pass" if schedule.interleaved else "callable"
    n_passes = len(schedule.callable_of)
    args_list = _per_callable("sample_args", sample_args, single, n_passes, (tuple, list), count)
    if sample_kwargs is None:  # (single with several passes: args_list raised)
        sample_kwargs = {} if single else ({},) * n_passes
    kwargs_list = _per_callable("sample_kwargs", sample_kwargs, single, n_passes, (dict,), count)
    for kwargs in kwargs_list:
        for key in kwargs:
            if not isinstance(key, str):
                raise TypeError(
                    f"{_NAME}: sample_kwargs keys must be strings, got {key!r} in "
                    f"{reprlib.repr(kwargs)}"
                )
    check_int(_NAME, minimum=0, num_warmup_iters=num_warmup_iters)
    check_bool(_NAME, allow_unused_input=allow_unused_input,
               retain_graph_in_backward=retain_graph_in_backward,
               _clone_param_grads_on_return=_clone_param_grads_on_return,
               _reuse_graph_input_output_buffers=_reuse_graph_input_output_buffers,
               **{spelled["calibrating"]: calibrating,
                  spelled["cache_quantized_params"]: cache_quantized_params})  # fmt: skip
    if _reuse_graph_input_output_buffers:
        raise NotImplementedError(
            f"{_NAME}: _reuse_graph_input_output_buffers=True is not implemented (every forward "
            "pass keeps its own input and output buffers); pass False"
        )
    enabled_list = _check_enabled(spelled["enabled"], enabled, n)
    group_name = spelled["amax_reduction_group"]
    check_recipe_and_group(_NAME, spelled["recipe"], recipe, group_name, group, TypeError)
    if cache_quantized_params:
        raise NotImplementedError(
            f"{_NAME}: {spelled['cache_quantized_params']}=True is not implemented (the "
            "graphed callables do not pass is_first_microbatch to the modules, so no FP8 weight "
            "is kept across micro-batches in the graphs); pass False"
        )
    if pool is not None and not (isinstance(pool, tuple) and all(isinstance(p, int) for p in pool)):
        raise TypeError(
            f"{_NAME}: pool must be None or a handle from torch.cuda.graph_pool_handle() "
            f"(a tuple of ints), got {pool!r}"
        )
    check_callable(_NAME, pre_warmup_hook=pre_warmup_hook, post_warmup_hook=post_warmup_hook)
    if capture_stream is not None and not isinstance(capture_stream, torch.cuda.Stream):
        raise TypeError(
            f"{_NAME}: capture_stream must be a torch.cuda.Stream or None, got {capture_stream!r}"
        )
    specs = [CallSpec(i, a, k) for i, (a, k) in enumerate(zip(args_list, kwargs_list, strict=True))]
    fp8_used = any(enabled_list) or calibrating
    if fp8_used and num_warmup_iters == 0 and not all(isinstance(c, nn.Module) for c in callables):
        raise ValueError(
            f"{_NAME}: num_warmup_iters must be >= 1 when a function (not an nn.Module) runs "
            "under FP8 (enabled or calibrating): its modules' FP8 state is found while it runs "
            f"in warm-up, got {num_warmup_iters}"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{_NAME}: CUDA graphs need a CUDA GPU, and torch.cuda.is_available() is False"
        )
    for spec in specs:
        spec.check_devices()
    if torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            f"{_NAME}: torch.autocast's weight cast cache cannot be captured in a CUDA graph; "
            "enter torch.autocast with cache_enabled=False"
        )
    if fp8_used and recipe is None:
        recipe = get_default_fp8_recipe()
    regions = [autocast(e, calibrating, recipe, group) for e in enabled_list]
    delayed = recipe is not None and recipe.delayed()
    calibrate_off = [delayed and (e or calibrating) for e in enabled_list]
    graphed = _capture(callables, schedule, specs, regions, calibrate_off,
                       num_warmup_iters=num_warmup_iters, allow_unused_input=allow_unused_input,
                       pool=pool, retain_graph=retain_graph_in_backward, stream=capture_stream,
                       clone_param_grads=_clone_param_grads_on_return,
                       hooks=(pre_warmup_hook, post_warmup_hook))  # fmt: skip
    return graphed[0] if single else tuple(graphed)


def _resolve_renamed(given: dict[str, Any]) -> tuple[list[Any], dict[str, str]]:
    """The values of the new names (in :data:`_RENAMED`'s order), and each new name as the
    caller spelled it (the deprecated name where that was given), for the messages."""
    defaults = {"enabled": False, "calibrating": False, "cache_quantized_params": False}
    out, spelled = [], {}
    for old, new in _RENAMED:
        value = given[new]
        if given[old] is not None:
            if value is not None:
                raise ValueError(
                    f"{_NAME}: {old} is the deprecated name of {new}; give one of them, "
                    f"got {old}={given[old]!r} and {new}={value!r}"
                )
            warnings.warn(
                f"{_NAME}: {old} is deprecated, use {new}", DeprecationWarning, stacklevel=3
            )
            value = given[old]
        spelled[new] = new if given[old] is None else old
        out.append(defaults.get(new) if value is None else value)
    return out, spelled


def _check_callables(callables: tuple, modules: Any) -> None:
    if not callables:
        raise ValueError(f"{_NAME}: modules must hold at least one callable, got ()")
    for i, c in enumerate(callables):
        if not callable(c):
            raise TypeError(
                f"{_NAME}: modules must be a callable or a tuple of callables, got {modules!r}"
            )
        if any(d is c for d in callables[:i]):
            raise ValueError(f"{_NAME}: modules holds {c!r} twice; each callable is graphed once")
        if isinstance(c, nn.Module):
            if c._forward_hooks or c._forward_pre_hooks or c._backward_hooks:
                raise ValueError(
                    f"{_NAME}: modules must have no hooks registered when graphed (register "
                    f"them afterwards), got {type(c).__name__} with hooks"
                )
            if getattr(c.forward, "_te_graphed", False):
                raise ValueError(
                    f"{_NAME}: {type(c).__name__} in modules is already graphed (its forward "
                    "replays a CUDA graph); graph the original module once"
                )
            if any(b.requires_grad for b in c.buffers()):
                raise ValueError(
                    f"{_NAME}: only parameters may require grad in a graphed module; a buffer "
                    f"of {type(c).__name__} has requires_grad=True"
                )
    if len({c.training for c in callables if isinstance(c, nn.Module)}) > 1:
        raise ValueError(
            f"{_NAME}: the modules must all be in training mode or all in eval mode, got both"
        )


def _per_callable(name: str, value: Any, single: bool, n: int, kinds: tuple, count: str) -> list:
    allowed = " or ".join(k.__name__ for k in kinds)
    if single:
        if n != 1:
            raise ValueError(
                f"{_NAME}: {name} must hold one entry per {count} ({n}): pass modules as a "
                "tuple and one entry each"
            )
        if not isinstance(value, kinds):
            raise TypeError(
                f"{_NAME}: {name} must be a {allowed} for one callable, got {reprlib.repr(value)}"
            )
        return [value]
    if not isinstance(value, (tuple, list)) or len(value) != n:
        raise ValueError(
            f"{_NAME}: {name} must be a tuple with one entry per {count} ({n}), got {value!r}"
        )
    for v in value:
        if not isinstance(v, kinds):
            raise TypeError(
                f"{_NAME}: each entry of {name} must be a {allowed}, got {reprlib.repr(v)}"
            )
    return list(value)


def _check_enabled(name: str, enabled: Any, n: int) -> list[bool]:
    if isinstance(enabled, bool):
        return [enabled] * n
    if not isinstance(enabled, tuple) or not all(isinstance(e, bool) for e in enabled):
        raise TypeError(f"{_NAME}: {name} must be a bool or a tuple of bools, got {enabled!r}")
    if len(enabled) != n:
        raise ValueError(
            f"{_NAME}: {name} must have one entry per callable ({n}), got {len(enabled)}"
        )
    return list(enabled)


class _Schedule(NamedTuple):
    """Which callable each forward pass runs, in which order the passes warm up, and the order
    of the captures (``(True, p)``: forward of pass ``p``; ``(False, p)``: its backward).
    Without ``_order`` each callable is one pass: forwards in order, backwards in reverse. With
    ``_order`` (``docs/graphs.md``), pass ``p`` of chunk ``m``, micro-batch ``k``, layer ``l`` is
    ``first_layer[m] * microbatches + k * layers[m] + l``."""

    callable_of: list[int]
    warmup: list[int]
    events: list[tuple[bool, int]]
    interleaved: bool  # with _order

    @classmethod
    def build(cls, order: Any, layers: Any, n_callables: int, n_samples: int) -> _Schedule:
        if order is None:
            if layers is not None:
                raise ValueError(
                    f"{_NAME}: _num_layers_per_chunk is used with _order only, got {layers!r}"
                )
            passes = list(range(n_callables))
            events = [(True, p) for p in passes] + [(False, p) for p in reversed(passes)]
            return cls(passes, passes, events, False)
        chunks, microbatches = _check_order(order)
        layers = _layers_per_chunk(layers, chunks, microbatches, n_callables, n_samples)
        first = [sum(layers[:m]) for m in range(chunks)]
        callable_of = [0] * (sum(layers) * microbatches)
        events = []
        done = {True: [0] * chunks, False: [0] * chunks}
        for entry in order:
            forward, m = entry > 0, abs(entry) - 1
            k = done[forward][m]
            done[forward][m] += 1
            steps = range(layers[m]) if forward else reversed(range(layers[m]))
            for layer in steps:
                p = first[m] * microbatches + k * layers[m] + layer
                callable_of[p] = first[m] + layer
                events.append((forward, p))
        return cls(callable_of, [p for forward, p in events if forward], events, True)


def _check_order(order: Any) -> tuple[int, int]:
    """``(chunks, micro-batches)`` of a valid ``_order``; ValueError/TypeError otherwise."""
    if not isinstance(order, (list, tuple)) or not order:
        raise TypeError(f"{_NAME}: _order must be a non-empty list of ints, got {order!r}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c == 0 for c in order):
        raise ValueError(
            f"{_NAME}: _order entries must be non-zero ints (chunk numbers from 1, negative for a "
            f"backward), got {order!r}"
        )
    chunks = max(abs(c) for c in order)
    microbatches = len(order) // (2 * chunks)
    counts = {c: order.count(c) for c in range(-chunks, chunks + 1) if c}
    if microbatches == 0 or any(v != microbatches for v in counts.values()):
        raise ValueError(
            f"{_NAME}: _order must hold each chunk 1..{chunks} as often (once per micro-batch) "
            f"forward (+) and backward (-), got {order!r}"
        )
    seen = [0] * (chunks + 1)
    for c in order:
        seen[abs(c)] += 1 if c > 0 else -1
        if seen[abs(c)] < 0:
            raise ValueError(
                f"{_NAME}: _order runs a backward of chunk {abs(c)} before its forward: {order!r}"
            )
    return chunks, microbatches


def _layers_per_chunk(
    layers: Any, chunks: int, microbatches: int, n_callables: int, n_samples: int
) -> list[int]:
    if layers is None:
        if n_samples % (chunks * microbatches):
            raise ValueError(
                f"{_NAME}: sample_args must hold one entry per forward pass, a multiple of "
                f"{chunks} chunks x {microbatches} micro-batches of _order, got {n_samples}"
            )
        layers = [n_samples // (chunks * microbatches)] * chunks
    elif isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers] * chunks
    if (
        not isinstance(layers, (list, tuple))
        or len(layers) != chunks
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in layers)
    ):
        raise ValueError(
            f"{_NAME}: _num_layers_per_chunk must be None, a positive int or {chunks} positive "
            f"ints (one per chunk of _order), got {layers!r}"
        )
    if sum(layers) != n_callables:
        raise ValueError(
            f"{_NAME}: modules must hold one callable per layer of the chunks of _order "
            f"({sum(layers)}), got {n_callables}"
        )
    return list(layers)


class _FP8States:
    """The FP8 states the callables use, saved before warm-up and put back after capture."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[FP8GemmState, bool, list[Tensor]]] = {}
        self.seen: set[int] = set()

    def add(self, root: nn.Module, calibrate_off: bool) -> None:
        if id(root) in self.seen:
            return
        self.seen.add(id(root))
        for m in root.modules():
            if isinstance(m, FP8GemmState) and id(m) not in self.saved:
                self.saved[id(m)] = (m, m.calibrated, [b.detach().clone() for b in m.buffers()])
                # The graphs hold the delayed path (module docstring), never the calibration one.
                if calibrate_off:
                    m.calibrated = True

    def restore(self, flags: bool) -> None:
        with torch.no_grad():
            for state, calibrated, copies in self.saved.values():
                for buffer, saved in zip(state.buffers(), copies, strict=True):
                    buffer.copy_(saved)
                if flags:
                    state.calibrated = calibrated


def _grad(outs, ins, grad_outputs, allow_unused: bool, retain_graph: bool) -> tuple:
    try:
        return torch.autograd.grad(outs, ins, grad_outputs, retain_graph, allow_unused=allow_unused)
    except RuntimeError as err:
        if "appears to not have been used" in str(err):
            raise ValueError(
                f"{_NAME}: an input or parameter that requires grad is not used by the "
                "callable's outputs; pass allow_unused_input=True (its gradient is then None)"
            ) from err
        raise


def _capture(
    callables, schedule, specs, regions, calibrate_off, *, num_warmup_iters, allow_unused_input,
    pool, retain_graph, clone_param_grads, hooks, stream) -> list[Callable]:  # fmt: skip
    training = all(c.training for c in callables if isinstance(c, nn.Module))
    of = schedule.callable_of
    graphs = []
    for p, spec in enumerate(specs):
        c = callables[of[p]]
        params = tuple(c.parameters()) if isinstance(c, nn.Module) else ()
        bwd = torch.cuda.CUDAGraph() if training else None
        g = CapturedGraphs(spec, params, training, torch.cuda.CUDAGraph(), bwd)
        g.clone_param_grads = clone_param_grads
        graphs.append(g)
    states = _FP8States()
    for c, off in zip(callables, calibrate_off, strict=True):
        if isinstance(c, nn.Module):
            states.add(c, off)
    current = [0]

    def discover(module: nn.Module, _args: Any) -> None:
        states.add(module, calibrate_off[current[0]])

    rng = torch.cuda.get_rng_state()
    mempool = torch.cuda.graph_pool_handle() if pool is None else pool
    side = torch.cuda.Stream() if stream is None else stream
    done = False
    try:
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        hook = nn.modules.module.register_module_forward_pre_hook(discover)
        try:
            pre, post = hooks
            if pre is not None:
                pre()
            with torch.cuda.stream(side):
                for p in schedule.warmup:
                    current[0] = of[p]
                    for _ in range(num_warmup_iters):
                        _warm_up(callables[of[p]], graphs[p], regions[of[p]], training,
                                 allow_unused_input)  # fmt: skip
            if post is not None:
                post()
        finally:
            hook.remove()
        torch.cuda.synchronize()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a graph collected while another is being captured breaks the capture
        try:
            for forward, p in schedule.events:
                if forward:
                    _capture_forward(callables[of[p]], graphs[p], regions[of[p]], training,
                                     mempool, side)  # fmt: skip
                elif training:
                    _capture_backward(graphs[p], allow_unused_input, retain_graph, mempool, side)
        finally:
            if gc_was_enabled:
                gc.enable()
        done = True
    finally:
        torch.cuda.synchronize()
        states.restore(flags=not done)
        torch.cuda.set_rng_state(rng)
    out = []
    for p, g in enumerate(graphs):
        c, replay = callables[of[p]], make_replay(g)
        if not isinstance(c, nn.Module):
            out.append(replay)
        elif schedule.interleaved:  # one graphed forward per pass; the modules keep their forward
            out.append(graphed_forward(c, c.training, replay))
        else:
            c.forward = graphed_forward(c, c.training, replay)
            out.append(c)
    return out


def _warm_up(c, g: CapturedGraphs, region, training: bool, allow_unused: bool) -> None:
    with torch.set_grad_enabled(training), region:
        outs = tensor_outputs(c(*g.spec.args, **g.spec.kwargs), g.spec)[0]
    if training:
        g.outputs = tuple(outs)
        o, ins = g.grad_targets()
        if o and ins:
            _grad(o, ins, tuple(torch.zeros_like(t) for t in o), allow_unused, False)
        g.outputs = ()


def _capture_forward(c, g: CapturedGraphs, region, training: bool, mempool, side) -> None:
    capture = torch.cuda.graph(g.fwd, pool=mempool, stream=side)
    with capture, torch.set_grad_enabled(training), region:
        result = c(*g.spec.args, **g.spec.kwargs)
    outs, g.out_spec = tensor_outputs(result, g.spec)
    g.outputs = tuple(outs)
    g.out_requires_grad = tuple(o.requires_grad for o in outs)


def _capture_backward(g: CapturedGraphs, allow_unused: bool, retain_graph: bool, mempool, side):
    o, ins = g.grad_targets()
    g.grad_outputs = tuple(torch.empty_like(t) if t.requires_grad else None for t in g.outputs)
    grads: tuple = ()
    if o and ins:
        static = tuple(t for t in g.grad_outputs if t is not None)
        with torch.cuda.graph(g.bwd, pool=mempool, stream=side):
            grads = _grad(o, ins, static, allow_unused, retain_graph)
    else:
        g.bwd = None  # nothing to replay
    it = iter(grads)
    g.grad_inputs = tuple(next(it) if t.requires_grad else None for t in g.surface)
