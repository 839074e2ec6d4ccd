"""CUDA graphs of modules' forward and backward: ``te_compile.make_graphed_callables``.

Transformer Engine's ``make_graphed_callables`` (its signature, its return shape): each callable
(an ``nn.Module`` or a function) is run ``num_warmup_iters`` times on ``sample_args`` /
``sample_kwargs`` on a side stream, then its forward and its backward are captured in two CUDA
graphs (forwards in order, backwards in reverse order, all in one memory pool). A graphed module
is the same module object with its ``forward`` replaced: called in the training mode it was
captured in, with tensors like the samples (same structure, shapes, dtypes, devices, and in a
training step the same ``requires_grad``), it copies the new tensors into the captured inputs,
replays the forward graph and returns the graph's outputs; its backward replays the backward
graph. Called in the other mode it runs its original forward; called with other tensors it raises
``ValueError``. Functions are returned as graphed functions.

**FP8.** Each callable runs under ``te_compile.autocast(enabled, calibrating, recipe,
amax_reduction_group)`` during warm-up and capture, so the graphs hold the recipe's casts. In
te_compile every state update of a recipe is a tensor op on module buffers inside the forward
(``quantization.fp8_gemm``: delayed scaling folds the last amaxes into the history and recomputes
the scales at the start of each forward; the forward and the backward write their amaxes into
buffers), so the updates are captured with the casts and happen on every replay, as in eager:
there is no work left for the end of a step, and no autocast is needed around a replay (the
recipe is the captured one, whatever autocast the call is made in).

Warm-up and capture run the callables on the samples; like Transformer Engine, the FP8 state
buffers (history, scales, amaxes) of the modules are saved first and restored after capture (in
place: the graphs hold their addresses), and so is the CUDA RNG state, so building the graphs
changes neither. One departure from te_compile's eager path: under ``DelayedScaling`` a fresh
FP8 state's first step is not the calibration step (current scaling, ``quantization.fp8_gemm``):
the graphs are captured on the delayed path, and a state that never ran starts, as in
Transformer Engine, from scales of 1. Run one eager training step under ``te_compile.autocast``
before graphing to start from measured scales.

The states of a function's modules are found while it runs (a global forward pre-hook during
warm-up), so a function under FP8 needs ``num_warmup_iters >= 1``. A function's backward graph
differentiates its tensor arguments only: parameters it reads are constants of the graph (graph
the module to get their gradients).

Limits: the graphed callables replay fixed shapes and fixed parameter storage (an optimizer
must update parameters in place); ``cache_quantized_params`` / ``fp8_weight_caching`` (te_compile
modules keep no FP8 weight cache across micro-batches), ``_order`` / ``_num_layers_per_chunk`` /
``_reuse_graph_input_output_buffers`` (pipeline-parallel interleaving) and
``capture_time_hooks`` raise ``NotImplementedError``. Each call's backward must run before the
next call's forward replays the graph again (the backward of an earlier call raises
``RuntimeError``: the saved tensors it needs were overwritten).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from te_compile.quantization.device import get_default_fp8_recipe
from te_compile.quantization.fp8_gemm import FP8GemmState
from te_compile.quantization.graph_replay import (
    CallSpec,
    CapturedGraphs,
    NoGraph,
    graphed_forward,
    make_replay,
    tensor_outputs,
)
from te_compile.quantization.recipe import Recipe
from te_compile.quantization.state import autocast

__all__ = ["make_graphed_callables"]

_NAME = "make_graphed_callables"

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

    ``modules``: a callable or a tuple of callables (``nn.Module`` or function).
    ``sample_args``: the positional arguments of the callable (a tuple of tensors), or a tuple of
    such tuples, one per callable. ``sample_kwargs``: a dict, or a tuple of dicts, of keyword
    arguments (tensors, or other values that every call must repeat). ``num_warmup_iters``: eager
    runs before capture. ``allow_unused_input``: allow inputs (and parameters) that the outputs do
    not depend on (their gradient is None). ``pool``: a ``torch.cuda.graph_pool_handle()`` to
    share with other graphs. ``retain_graph_in_backward``: capture the backward with
    ``retain_graph=True``. ``_clone_param_grads_on_return``: return parameter gradients as copies
    (False: views of the graph's buffers, overwritten by the next replay). ``pre_warmup_hook`` /
    ``post_warmup_hook``: called once before / after all warm-up runs. ``capture_stream``: the
    stream warm-up and capture run on (default: a new one).

    ``enabled`` (a bool, or one per callable), ``calibrating``, ``recipe`` (None: the default
    recipe) and ``amax_reduction_group``: the ``te_compile.autocast`` the callables are captured
    under; ``fp8_enabled``, ``fp8_calibrating``, ``fp8_recipe``, ``fp8_group`` and
    ``fp8_weight_caching`` are their older names (a ``DeprecationWarning``; giving both names of
    one argument raises ``ValueError``).

    Returns the graphed callable, or a tuple of them when ``modules`` is a tuple.
    """
    given = locals()
    resolved = _resolve_renamed(given)
    enabled, calibrating = resolved["enabled"], resolved["calibrating"]
    recipe, group = resolved["recipe"], resolved["amax_reduction_group"]
    cache_quantized_params = resolved["cache_quantized_params"]

    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    _check_callables(callables, modules)
    n = len(callables)
    args_list = _per_callable("sample_args", sample_args, single, n, (tuple, list))
    if sample_kwargs is None:
        kwargs_list = [{} for _ in range(n)]
    else:
        kwargs_list = _per_callable("sample_kwargs", sample_kwargs, single, n, (dict,))
    for kwargs in kwargs_list:
        for key in kwargs:
            if not isinstance(key, str):
                raise TypeError(f"{_NAME}: sample_kwargs keys must be strings, got {key!r}")
    _check_int("num_warmup_iters", num_warmup_iters)
    for name, value in (
        ("allow_unused_input", allow_unused_input),
        ("retain_graph_in_backward", retain_graph_in_backward),
        ("_clone_param_grads_on_return", _clone_param_grads_on_return),
        ("calibrating", calibrating),
        ("cache_quantized_params", cache_quantized_params),
        ("_reuse_graph_input_output_buffers", _reuse_graph_input_output_buffers),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{_NAME}: {name} must be a bool, got {value!r}")
    enabled_list = _check_enabled(enabled, single, n)
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            f"{_NAME}: recipe must be a Recipe (e.g. DelayedScaling()) or None, got {recipe!r}"
        )
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{_NAME}: amax_reduction_group must be a torch.distributed.ProcessGroup or None, "
            f"got {group!r}"
        )
    if cache_quantized_params:
        raise NotImplementedError(
            f"{_NAME}: cache_quantized_params=True (fp8_weight_caching) is not implemented: "
            "te_compile modules keep no FP8 weight cache across micro-batches (their forward "
            "takes no is_first_microbatch); pass False"
        )
    for name, value, default in (
        ("_order", _order, None),
        ("_num_layers_per_chunk", _num_layers_per_chunk, None),
        ("_reuse_graph_input_output_buffers", _reuse_graph_input_output_buffers, False),
        ("capture_time_hooks", capture_time_hooks, None),
    ):
        if value != default:
            raise NotImplementedError(
                f"{_NAME}: {name}={value!r} is not implemented (pipeline-parallel interleaving "
                f"and capture-time hooks are not supported); pass {default!r}"
            )
    if pool is not None and not (isinstance(pool, tuple) and all(isinstance(p, int) for p in pool)):
        raise TypeError(
            f"{_NAME}: pool must be None or a handle from torch.cuda.graph_pool_handle() "
            f"(a tuple of ints), got {pool!r}"
        )
    warmup_hooks = (("pre_warmup_hook", pre_warmup_hook), ("post_warmup_hook", post_warmup_hook))
    for name, hook in warmup_hooks:
        if hook is not None and not callable(hook):
            raise TypeError(f"{_NAME}: {name} must be callable or None, got {hook!r}")
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
    graphed = _capture(
        callables,
        specs,
        regions,
        calibrate_off,
        num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input,
        pool=pool,
        retain_graph=retain_graph_in_backward,
        clone_param_grads=_clone_param_grads_on_return,
        hooks=(pre_warmup_hook, post_warmup_hook),
        stream=capture_stream,
    )
    return graphed[0] if single else tuple(graphed)


def _resolve_renamed(given: dict[str, Any]) -> dict[str, Any]:
    defaults = {"enabled": False, "calibrating": False, "cache_quantized_params": False}
    out = {}
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
        out[new] = defaults.get(new) if value is None else value
    return out


def _check_callables(callables: tuple, modules: Any) -> None:
    if not callables:
        raise ValueError(f"{_NAME}: modules must hold at least one callable, got ()")
    seen = set()
    for c in callables:
        if not callable(c):
            raise TypeError(
                f"{_NAME}: modules must be a callable or a tuple of callables, got {modules!r}"
            )
        if id(c) in seen:
            raise ValueError(f"{_NAME}: modules holds {c!r} twice; each callable is graphed once")
        seen.add(id(c))
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
    modes = {c.training for c in callables if isinstance(c, nn.Module)}
    if len(modes) > 1:
        raise ValueError(
            f"{_NAME}: the modules must all be in training mode or all in eval mode, got both"
        )


def _per_callable(name: str, value: Any, single: bool, n: int, kinds: tuple) -> list:
    if single:
        if not isinstance(value, kinds):
            raise TypeError(
                f"{_NAME}: {name} must be a {' or '.join(k.__name__ for k in kinds)} for one "
                f"callable, got {type(value).__name__}"
            )
        return [value]
    if not isinstance(value, (tuple, list)) or len(value) != n:
        raise ValueError(
            f"{_NAME}: {name} must be a tuple with one entry per callable ({n}), got {value!r}"
        )
    for v in value:
        if not isinstance(v, kinds):
            raise TypeError(
                f"{_NAME}: each entry of {name} must be a "
                f"{' or '.join(k.__name__ for k in kinds)}, got {type(v).__name__}"
            )
    return list(value)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_NAME}: {name} must be an int >= 0, got {value!r}")


def _check_enabled(enabled: Any, single: bool, n: int) -> list[bool]:
    if isinstance(enabled, bool):
        return [enabled] * n
    if not isinstance(enabled, tuple) or not all(isinstance(e, bool) for e in enabled):
        raise TypeError(f"{_NAME}: enabled must be a bool or a tuple of bools, got {enabled!r}")
    if len(enabled) != n:
        raise ValueError(
            f"{_NAME}: enabled must have one entry per callable ({n}), got {len(enabled)}"
        )
    return list(enabled)


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
                copies = [b.detach().clone() for b in _buffers(m)]
                self.saved[id(m)] = (m, m.calibrated, copies)
                # The graphs hold the delayed path (module docstring), never the calibration one.
                if calibrate_off:
                    m.calibrated = True

    def restore(self, flags: bool) -> None:
        with torch.no_grad():
            for state, calibrated, copies in self.saved.values():
                for buffer, saved in zip(_buffers(state), copies, strict=True):
                    buffer.copy_(saved)
                if flags:
                    state.calibrated = calibrated


def _buffers(state: FP8GemmState) -> tuple[Tensor, ...]:
    return (state.amax_history, state.scale, state.fwd_amax, state.grad_amax)


def _grad(outs, ins, grad_outputs, allow_unused: bool, retain_graph: bool) -> tuple:
    try:
        return torch.autograd.grad(
            outs,
            ins,
            grad_outputs=grad_outputs,
            only_inputs=True,
            allow_unused=allow_unused,
            retain_graph=retain_graph,
        )
    except RuntimeError as err:
        if "appears to not have been used" in str(err):
            raise ValueError(
                f"{_NAME}: an input or parameter that requires grad is not used by the "
                "callable's outputs; pass allow_unused_input=True (its gradient is then None)"
            ) from err
        raise


def _capture(
    callables, specs, regions, calibrate_off, *, num_warmup_iters, allow_unused_input, pool,
    retain_graph, clone_param_grads, hooks, stream,
) -> list[Callable]:  # fmt: skip
    training = all(c.training for c in callables if isinstance(c, nn.Module))
    graphs = []
    for c, spec in zip(callables, specs, strict=True):
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
                for i, (c, spec, region, g) in enumerate(
                    zip(callables, specs, regions, graphs, strict=True)
                ):
                    current[0] = i
                    for _ in range(num_warmup_iters):
                        with torch.set_grad_enabled(training), region:
                            outs = tensor_outputs(c(*spec.args, **spec.kwargs), spec)[0]
                        if training:
                            g.outputs = tuple(outs)
                            o, ins = g.grad_targets()
                            if o and ins:
                                grads = tuple(torch.zeros_like(t) for t in o)
                                _grad(o, ins, grads, allow_unused_input, False)
                        del outs
                        g.outputs = ()
            if post is not None:
                post()
        finally:
            hook.remove()
        torch.cuda.synchronize()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a graph collected while another is being captured breaks the capture
        try:
            for c, spec, region, g in zip(callables, specs, regions, graphs, strict=True):
                capture = torch.cuda.graph(g.fwd, pool=mempool, stream=side)
                with capture, torch.set_grad_enabled(training), region:
                    result = c(*spec.args, **spec.kwargs)
                outs, g.out_spec = tensor_outputs(result, spec)
                g.outputs = tuple(outs)
                g.out_requires_grad = tuple(o.requires_grad for o in outs)
            for g in reversed(graphs) if training else ():
                o, ins = g.grad_targets()
                g.grad_outputs = tuple(
                    torch.empty_like(t) if t.requires_grad else None for t in g.outputs
                )
                grads: tuple = ()
                if o and ins:
                    static = tuple(t for t in g.grad_outputs if t is not None)
                    with torch.cuda.graph(g.bwd, pool=mempool, stream=side):
                        grads = _grad(o, ins, static, allow_unused_input, retain_graph)
                it = iter(grads)
                g.grad_inputs = tuple(next(it) if t.requires_grad else None for t in g.surface)
                if not (o and ins):
                    g.bwd = NoGraph()
        finally:
            if gc_was_enabled:
                gc.enable()
        done = True
    finally:
        torch.cuda.synchronize()
        states.restore(flags=not done)
        torch.cuda.set_rng_state(rng)
    out = []
    for c, g in zip(callables, graphs, strict=True):
        replay = make_replay(g)
        if isinstance(c, nn.Module):
            c.forward = graphed_forward(c, c.training, replay)
            out.append(c)
        else:
            out.append(replay)
    return out
