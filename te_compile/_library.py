"""The one mechanism every ``torch.ops.te.*`` op is defined with, and the registry of all ops.

An op family file in ``functional/`` uses three calls, in the order of the op pattern
(see ``docs/op_mechanism.md``)::

    @op("linear_fwd")                       # te::linear_fwd, schema inferred from type hints
    def linear_fwd(inp: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, list[Tensor]]:
        ...                                 # default (CPU) implementation

    @linear_fwd.register_kernel("cuda")     # optional device-specific implementation
    @linear_fwd.register_fake               # shapes/dtypes only, torch._check for constraints

    linear = differentiable(linear_fwd, linear_bwd, setup_context=..., backward=...,
                            reference=linear_ref)

The library ships no test data: the registry test's sample inputs of each op live in
``tests/samples/<family>.py``, keyed by op name.

Why not ``torch.library.custom_op``: the ops are defined with the lower-level
``torch.library.Library`` API (same dispatcher semantics, same ``opcheck`` guarantees) so that the
op mechanism owns one thing ``custom_op`` cannot give us: a cheap eager path. Entering a custom
op's autograd kernel from Python costs tens of microseconds per call (the autograd kernel is a
new-style ``autograd.Function`` plus Python dispatcher hops), which dominates small-shape training.
So ``DifferentiableOp.__call__`` takes one of two paths that run the *same* implementation
functions, ``setup_context`` and ``backward``:

* the **op path** — ``torch.ops.te.<name>_fwd`` through the dispatcher; taken whenever anything
  may be watching: ``torch.compile``/``torch.export`` tracing, any active ``TorchDispatchMode``
  (FakeTensorMode, selective activation checkpointing, FlopCounter), functorch transforms, the
  profiler (so ops show up by name), or when the fast path is switched off;
* the **eager fast path** — an old-style ``torch.autograd.Function`` (single ``forward(ctx, ...)``,
  measured 3x cheaper to enter than the ``setup_context`` style) that calls the implementation
  function directly and hands ``backward`` the backward implementation instead of the backward op;
  or, where the op declares it exact (``native_autograd``), the forward implementation itself run
  under PyTorch's native autograd, which costs what ``nn.Linear`` costs.

``tests/test_library.py`` proves both paths give identical results; ``set_eager_fast_path(False)``
forces the op path everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

NAMESPACE = "te"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

# Device types with an autocast dispatch key we register a rule for.
_AUTOCAST_DEVICES = ("cpu", "cuda")


# ---------------------------------------------------------------------------------------------
# Eager fast-path switch
# ---------------------------------------------------------------------------------------------

_fast_path_enabled = True


def set_eager_fast_path(enabled: bool) -> None:
    """Enable (default) or disable the eager fast path; disabled, every call uses the op path."""
    global _fast_path_enabled
    if enabled is not True and enabled is not False:
        raise ValueError(f"set_eager_fast_path: enabled must be a bool, got {enabled!r}")
    _fast_path_enabled = enabled


def eager_fast_path_enabled() -> bool:
    return _fast_path_enabled


# While a profiler runs, eager calls take the op path, so that profiles name the ops.
# ``bench.harness.eager_fast_path_kept`` clears this to count the kernels of the fast path. A
# flag rather than another ``_use_fast_path``: compiled code guards on that function, and traced
# code never reads this one (``is_compiling`` ends the test first).
_op_path_when_profiled = True


def _use_fast_path() -> bool:
    """Whether an eager call may skip the dispatcher (and a family its op layers): eager, no
    dispatch mode, functorch transform or profiler watching. Each check costs ~0.1 us."""
    return (
        _fast_path_enabled
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._are_functorch_transforms_active()
        and not (torch.autograd.profiler._is_profiler_enabled and _op_path_when_profiled)
    )


use_fast_path = _use_fast_path


# ---------------------------------------------------------------------------------------------
# Plain ops: one dispatcher op with per-device implementations and a fake
# ---------------------------------------------------------------------------------------------


def _infer_schema(fn: Callable, mutates_args: Sequence[str]) -> str:
    """``torch.library.infer_schema``, plus an optional tensor list (``list[Tensor] | None =
    None``, ``Tensor[]? name=None``), which it does not infer."""
    sig = inspect.signature(fn)
    lists = [n for n, p in sig.parameters.items() if p.annotation == "list[Tensor] | None"]
    if lists:
        params = [p.replace(annotation="Tensor | None") if n in lists else p
                  for n, p in sig.parameters.items()]  # fmt: skip
        fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__)  # its globals: hints
        fn.__signature__ = sig.replace(parameters=params)
    schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
    for n in lists:
        schema = schema.replace(f"Tensor? {n}=None", f"Tensor[]? {n}=None")
    return schema


class Op:
    """A ``te::<name>`` op: schema inferred from the implementation's type hints.

    Unless ``opaque`` gives the reason it cannot be, the op is *traced through* under
    ``torch.compile``: AOTAutograd runs its implementation for the inputs' device (the same
    function eager calls) on functional tensors instead of recording a call of the op, so
    Inductor sees the aten calls and the Triton kernels inside (``kernels.launch`` hands them to
    ``torch.library.wrap_triton`` while tracing) and launches them itself. This is the mechanism
    of ``torch.library.triton_op`` applied to ``Library``-defined ops; dynamo's graph and
    ``torch.export`` keep the op by name."""

    def __init__(
        self,
        name: str,
        fn: Callable,
        mutates_args: Sequence[str],
        opaque: str | None = None,
        kept_whole: Callable[..., str | None] | None = None,
    ) -> None:
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        _LIB.define(name + _infer_schema(fn, mutates_args))
        self._impls: dict[str, Callable] = {}
        self._default = fn
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        self.overload: torch._ops.OpOverload = getattr(getattr(torch.ops, NAMESPACE), name).default
        names = [a.name for a in self.overload._schema.arguments]
        self._written = tuple(mutates_args)
        self._written_at = [(names.index(n), n) for n in self._written]  # (position, name)
        if self._written:
            _LIB.impl(name, self._new_versions, "ADInplaceOrView", with_keyset=True)
        self.opaque = opaque
        self.kept_whole = kept_whole
        if opaque is None:
            _register_trace_through(self)
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def _new_versions(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        # What the op writes is a new version on every path (a Triton kernel's write is seen by
        # no version counter), so autograd refuses a saved tensor the op has overwritten.
        self._bump_written(args, kwargs)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            below = keyset & torch._C._after_ADInplaceOrView_keyset
            return self.overload.redispatch(below, *args, **kwargs)

    def _bump_written(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        written = [args[i] if i < len(args) else kwargs.get(name) for i, name in self._written_at]
        torch.autograd.graph.increment_version([t for t in written if isinstance(t, torch.Tensor)])

    def register_kernel(self, device_type: str) -> Callable[[Callable], Callable]:
        """Decorator: the implementation used for tensors on ``device_type`` (e.g. "cuda")."""

        keys = {"cpu": "CPU", "cuda": "CUDA"}
        if device_type not in keys:
            raise ValueError(f"register_kernel: device_type must be one of {sorted(keys)}")

        def deco(fn: Callable) -> Callable:
            _LIB.impl(self.name, fn, keys[device_type])
            self._impls[device_type] = fn
            return fn

        return deco

    def register_fake(self, fn: Callable) -> Callable:
        """Decorator: the fake (meta) implementation; shapes, strides and dtypes only."""
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """Call the implementation for the inputs' device directly, bypassing the dispatcher."""
        if self._impls:
            t = _first_tensor(args)
            if t is not None:
                return self._impls.get(t.device.type, self._default)(*args, **kwargs)
        return self._default(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The op; eagerly, where :func:`plain_fast_path` says, its implementation directly, as
        the differentiable ops' fast path (a dispatcher round trip less per call)."""
        if plain_fast_path((*args, *kwargs.values())):
            out = self.eager(*args, **kwargs)
            if self._written:  # as the dispatcher's call does (``_new_versions``)
                self._bump_written(args, kwargs)
            return out
        return self.overload(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Op({self.qualname})"


def plain_fast_path(args: Sequence[Any]) -> bool:
    """Whether an eager call of an op without autograd may run its implementation on ``args``
    directly: :func:`_use_fast_path`, autograd has nothing to record (grad mode off, or no tensor
    argument that requires grad: the op has no autograd formula), and every tensor argument is a
    plain tensor or parameter (a tensor subclass, such as an asynchronous collective's result or
    a DTensor, takes the dispatcher, which waits for it or unwraps it)."""
    return _use_fast_path() and _plain_args(args, torch.is_grad_enabled())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_args(args: Sequence[Any], grad: bool) -> bool:
    """Whether every tensor argument, also in a list argument, is of a :data:`_PLAIN` type and,
    with ``grad``, requires no grad."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) not in _PLAIN or (grad and a.requires_grad):
                return False
        elif isinstance(a, (list, tuple)) and not _plain_args(a, grad):
            return False
    return True


def op(
    name: str,
    *,
    mutates_args: Sequence[str] = (),
    opaque: str | None = None,
    kept_whole: Callable[..., str | None] | None = None,
) -> Callable[[Callable], Op]:
    """Decorator defining ``te::<name>`` from its default (CPU / reference) implementation.

    ``opaque="<reason>"`` keeps the op a call that Inductor does not trace into (an
    implementation that reads tensor data on the host, or calls code the compiler cannot trace);
    ``opaque_ops()`` lists them with their reasons.
    ``kept_whole(*args)``: for the arguments of one call, the reason to keep this call opaque
    (None: trace through), for a case known to break under tracing."""

    def deco(fn: Callable) -> Op:
        qualname = f"{NAMESPACE}::{name}"
        if qualname in _REGISTRY:
            raise RuntimeError(f"{qualname} is already registered")
        new = Op(name, fn, mutates_args, opaque, kept_whole)
        _REGISTRY[qualname] = RegistryEntry(qualname, new.overload, None, new.opaque)
        return new

    return deco


# Why a grouped GEMM call is kept whole (``functional.grouped_linear_ops.host_split_path``).
HOST_SPLITS = (
    "reads the group sizes (m_splits) on the host to split the GEMMs, which a traced graph "
    "cannot do without a data-dependent shape per group"
)


@functools.cache
def _trace_through_kernels() -> tuple[object, ...]:
    """Every Triton kernel of ``te_compile.kernels``: what AOTAutograd's cache key must cover for
    a traced-through op (``torch._library.triton`` reads this table). Empty without Triton.
    Found once for all ops."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return ()
    from te_compile.kernels import all_kernels

    return tuple(all_kernels())


def _register_trace_through(new: Op) -> None:
    from torch._library import triton as library_triton
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    known = (torch.Tensor, FunctionalTensor)

    def decompose(mode: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if custom_triton_ops_decomposition_disabled():  # torch.export keeps the op by name
            return mode.__torch_dispatch__(func, types, args, kwargs)
        if any(not (t in known or issubclass(t, FakeTensor)) for t in types):
            return NotImplemented
        # Under the mode: a kept_whole predicate may run ops on the FunctionalTensors (the
        # attention plan asks SDPA's dispatcher, ``torch._fused_sdp_choice``).
        with mode:
            keep = new.kept_whole is not None and new.kept_whole(*args, **kwargs)
        if keep:
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode:
            return new.eager(*args, **kwargs)

    torch.library.register_torch_dispatch(new.qualname, FunctionalTensorMode, decompose, lib=_LIB)
    # Looked up lazily by AOTAutograd's cache: a list filled on first use.
    library_triton.triton_ops_to_kernels[new.qualname] = _LazyKernels()


class _LazyKernels(list):
    """The kernel list of a traced-through op, filled when first read (importing Triton at op
    definition would make it a dependency of the CPU-only package)."""

    def __iter__(self):
        if not self:
            self.extend(_trace_through_kernels())
        return super().__iter__()


def opaque_ops() -> dict[str, str]:
    """The ops Inductor does not trace into, with the reason for each."""
    return {name: e.opaque for name, e in _REGISTRY.items() if e.opaque is not None}


def _first_tensor(args: Sequence[Any]) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def stash_for_backward(ctx: Any, name: str, tensors: tuple[torch.Tensor | None, ...]) -> None:
    """``setattr(ctx, name, tensors)``: tensors the backward reads and writes but that are not
    values of this forward (accumulators such as ``main_grad``), kept out of autograd's
    version-counter check, in eager and under ``torch.compile``.

    Eager, a tensor stashed as a ``ctx`` attribute is not checked. Compiled, AOTAutograd's
    partitioner decides what the forward graph saves and saves it with
    ``ctx.save_for_backward``, so a second forward's backward would be refused once the first
    backward wrote the accumulator (pipeline schedules: F1 F2 B2 B1). The partitioner keeps
    out of that check the values whose graph node carries ``saved_tensor_with_no_vc_check``,
    the mark dynamo gives to tensors an ``autograd.Function`` stashes on ``ctx`` (PyTorch's
    parity with eager, torch >= 2.11); the tensors' nodes in the graph being traced get it here.
    The mark is on the node of the tensor's current value (the graph input itself where the
    forward did not write it), so only these tensors lose the check."""
    setattr(ctx, name, tensors)
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None:
        return  # not tracing a graph: the ctx attribute is all there is
    from torch.fx.experimental.proxy_tensor import _get_proxies

    for t in tensors:
        if t is not None:
            for proxy in _get_proxies(t):
                proxy.node.meta["saved_tensor_with_no_vc_check"] = True


# ---------------------------------------------------------------------------------------------
# Differentiable ops: forward op + backward op + autograd + autocast
# ---------------------------------------------------------------------------------------------


def _returns_layout(overload: torch._ops.OpOverload) -> tuple[bool, ...]:
    """For each schema return: True if it is a ``Tensor[]``."""
    return tuple(isinstance(r.type, torch.ListType) for r in overload._schema.returns)


def _flatten(
    out: Any, layout: tuple[bool, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    if len(layout) == 1:
        out = (out,)
    flat: list[torch.Tensor] = []
    sizes: list[int] = []
    for value, is_list in zip(out, layout, strict=True):
        if is_list:
            flat.extend(value)
            sizes.append(len(value))
        else:
            flat.append(value)
            sizes.append(-1)
    return tuple(flat), tuple(sizes)


def _unflatten(flat: Sequence[Any], sizes: Sequence[int]) -> Any:
    out: list[Any] = []
    i = 0
    for n in sizes:
        if n < 0:
            out.append(flat[i])
            i += 1
        else:
            out.append(list(flat[i : i + n]))
            i += n
    return out[0] if len(out) == 1 else tuple(out)


def _autocast_eligible(t: Any, device_type: str) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.element_size() > 1  # FP8 codes (FP8 primary weights) stay as they are
        and t.device.type == device_type
        and t.dtype != torch.float64
    )


# Arguments autocast leaves alone: fp32 accumulators and FP8 scaling state. Casting them would
# hand the op a copy: a write into it (main_grad's wgrad accumulation, grad_amax) would be lost
# silently, and a delayed scale would be rounded to bf16 (found by train_gpt --autocast bfloat16
# --recipe delayed, 2026-11-22). Arguments the schema marks as written are kept as well. ALiBi
# slopes and the attention sink's logits (softmax_offset) stay fp32 (Transformer Engine's dtype
# for them; the op computes with them in fp32). A tensor list (a pre-quantised weight,
# Tensor[]?) is never cast.
_AUTOCAST_KEEP = frozenset(
    {
        "alibi_slopes",
        "softmax_offset",
        "main_grad",
        "scale",
        "grad_amax",
        "amax_history",
        "scale1",
        "scale2",
        "grad_amax1",
        "grad_amax2",
        "main_grad1",
        "main_grad2",
    }
)


def _autocast_kept(overload: Any) -> frozenset[int]:
    """Positions of the arguments of ``overload`` that autocast must not cast."""
    return frozenset(
        i
        for i, arg in enumerate(overload._schema.arguments)
        if arg.name in _AUTOCAST_KEEP or (arg.alias_info is not None and arg.alias_info.is_write)
    )


def _autocast_args(
    args: Sequence[Any], device_type: str, keep: frozenset[int] = frozenset()
) -> tuple[Any, ...]:
    """Cast floating args the way ``nn.Linear`` is cast under autocast: to the autocast dtype;
    the positions in ``keep`` (state and written arguments) keep theirs."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        a.to(dtype) if i not in keep and _autocast_eligible(a, device_type) else a
        for i, a in enumerate(args)
    )


class DifferentiableOp:
    """A forward op with its backward op, autograd formula and autocast rule.

    ``setup_context(ctx, inputs, output)`` saves what the backward needs; ``backward(ctx, bwd,
    *grads)`` returns one gradient per forward input, calling ``bwd`` — the backward op on the op
    path, its implementation function on the eager fast path — and nothing else of substance.
    """

    def __init__(
        self,
        fwd: Op,
        bwd: Op,
        *,
        setup_context: Callable,
        backward: Callable,
        reference: Callable,
        autocast: bool = True,
        native_autograd: Callable[..., bool] | None = None,
    ) -> None:
        self.fwd, self.bwd = fwd, bwd
        self._native_autograd = native_autograd
        self.reference = reference
        self._setup_context, self._backward = setup_context, backward
        self._autocast = autocast
        self._autocast_keep = _autocast_kept(fwd.overload)
        self._layout = _returns_layout(fwd.overload)
        self._single = len(self._layout) == 1 and not self._layout[0]
        self._n_fixed = sum(1 for is_list in self._layout if not is_list)
        self._n_list = len(self._layout) - self._n_fixed

        bwd_overload = bwd.overload

        lists = [i for i, arg in enumerate(fwd.overload._schema.arguments)
                 if isinstance(arg.type, torch.OptionalType)
                 and isinstance(arg.type.getElementType(), torch.ListType)]  # fmt: skip

        def _op_setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            # The gradient of a Tensor[]? input: None, or one None per tensor of the list.
            ctx._te_lists = [(i, len(inputs[i])) for i in lists
                             if i < len(inputs) and inputs[i] is not None]  # fmt: skip
            setup_context(ctx, inputs, output)

        def _op_backward(ctx: Any, *grads: Any) -> Any:
            result = backward(ctx, bwd_overload, *grads)
            if not ctx._te_lists:
                return result
            result = list(result)
            for i, n in ctx._te_lists:
                result[i] = [None] * n
            return tuple(result)

        # Only autograd's eager engine calls this function as a frame of its own: after a
        # graph break at ``loss.backward()`` under a compiled or explained step, while dynamo's
        # frame hook is still set. Dynamo would then trace our Python backward as graphs of
        # their own (a graph and a recompile per op, counted as the user's graph breaks), where
        # an aten op's C++ backward is invisible to it. A compiled forward's backward is traced
        # by AOTAutograd, which calls this function directly and still sees every op in it.
        _op_backward = torch._dynamo.disable(
            _op_backward, reason="te_compile: an op's backward run by autograd's eager engine"
        )
        torch.library.register_autograd(
            fwd.qualname, _op_backward, setup_context=_op_setup_context, lib=_LIB
        )
        if autocast:
            for device_type in _AUTOCAST_DEVICES:
                self._register_autocast(device_type)
        self._function = self._make_function()
        self._apply = _function_entry(self._function)

    def _register_autocast(self, device_type: str) -> None:
        key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        exclude = DispatchKeySet(getattr(DispatchKey, key_name))
        overload, keep = self.fwd.overload, self._autocast_keep

        def kernel(*args: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                return overload(*_autocast_args(args, device_type, keep))

        _LIB.impl(self.fwd.name, kernel, key_name)

    def _make_function(self) -> type[torch.autograd.Function]:
        fwd_eager, bwd_eager = self.fwd.eager, self.bwd.eager
        setup_context, backward, layout = self._setup_context, self._backward, self._layout

        if not any(layout):  # tensors only: autograd takes the op's return as it is

            def forward(ctx: Any, *args: Any) -> Any:
                out = fwd_eager(*args)
                setup_context(ctx, args, out)
                _no_zero_grads(ctx, out if type(out) in (tuple, list) else (out,))
                return tuple(out) if type(out) is list else out

            def backward_(ctx: Any, *grads: Any) -> Any:
                return backward(ctx, bwd_eager, *_zero_fill(ctx, grads))

        else:

            def forward(ctx: Any, *args: Any) -> Any:
                out = fwd_eager(*args)
                setup_context(ctx, args, out)
                flat, sizes = _flatten(out, layout)
                _no_zero_grads(ctx, flat)
                ctx._te_sizes = sizes
                return flat[0] if len(flat) == 1 else flat

            def backward_(ctx: Any, *grads: Any) -> Any:
                grads = _zero_fill(ctx, grads)
                return backward(ctx, bwd_eager, *_flatten_grads(grads, ctx._te_sizes))

        # Built with type() so that autograd names the node after the op: te_linear_fwdBackward.
        return type(
            f"{NAMESPACE}_{self.fwd.name}",
            (torch.autograd.Function,),
            {"forward": staticmethod(forward), "backward": staticmethod(backward_)},
        )

    def __call__(self, *args: Any) -> Any:
        """Run the forward: the eager fast path when nothing is watching, else the op path."""
        if not _use_fast_path():
            return self.fwd.overload(*args)
        if self._autocast and torch._C._is_any_autocast_enabled():
            t = _first_tensor(args)
            if t is not None and torch.is_autocast_enabled(t.device.type):
                args = _autocast_args(args, t.device.type, self._autocast_keep)
        if self._native_autograd is not None and self._native_autograd(*args):
            return self.fwd.eager(*args)
        out = self._apply(*args)
        if self._single or not self._n_list:
            return out
        flat = out if isinstance(out, tuple) else (out,)
        # At most one Tensor[] return (checked in differentiable()): its length is what is left.
        n_list = len(flat) - self._n_fixed
        return _unflatten(flat, tuple(n_list if is_list else -1 for is_list in self._layout))

    def __repr__(self) -> str:
        return f"DifferentiableOp({self.fwd.qualname}, {self.bwd.qualname})"


def _function_entry(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` for the eager fast path: autograd's C entry, which ``Function.apply`` calls
    after a Python prologue that is settled here (``cls`` defines no ``setup_context``, and the
    fast path runs only while no functorch transform is active). The prologue's one remaining
    step, unwrapping functorch wrappers whose transform has exited, is kept. Measured 4-6 us
    less per op call (2-core dev CPU)."""
    c_apply = super(torch.autograd.Function, cls).apply
    unwrap_if_dead = torch._C._functorch.unwrap_if_dead

    def apply(*args: Any) -> Any:
        return c_apply(*[unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a for a in args])

    return apply


def _no_zero_grads(ctx: Any, flat: Sequence[torch.Tensor]) -> None:
    """Autograd gives the backward no zero gradients: without this it fills a zero tensor for
    every output that got no gradient, the saved tensors included (each op returns what its
    backward keeps, FP8 copies among them, marked non-differentiable by its setup_context): an
    allocation and a fill kernel each, every backward, read by no one. Kept instead: the
    shapes of the differentiable floating outputs, whose missing gradient (an output the
    caller did not use) :func:`_zero_fill` makes, as autograd would have."""
    ctx.set_materialize_grads(False)
    fixed = {id(t) for t in getattr(ctx, "non_differentiable", None) or ()}
    ctx._te_zeros = [(i, t.shape, t.dtype, t.device) for i, t in enumerate(flat)
                     if id(t) not in fixed and t.is_floating_point()]  # fmt: skip


def _zero_fill(ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """``grads`` with zeros for the differentiable outputs that got none (:func:`_no_zero_grads`);
    the non-differentiable ones stay None (their backward parameters are unused)."""
    missing = [z for z in ctx._te_zeros if grads[z[0]] is None]
    if not missing:
        return grads
    grads = list(grads)
    for i, shape, dtype, device in missing:
        grads[i] = torch.zeros(shape, dtype=dtype, device=device)
    return tuple(grads)


def _flatten_grads(grads: Sequence[Any], sizes: Sequence[int]) -> tuple[Any, ...]:
    out = _unflatten(grads, sizes)
    return out if isinstance(out, tuple) else (out,)


def differentiable(
    fwd: Op,
    bwd: Op,
    *,
    setup_context: Callable,
    backward: Callable,
    reference: Callable,
    autocast: bool = True,
    native_autograd: Callable[..., bool] | None = None,
) -> DifferentiableOp:
    """Tie ``fwd`` and ``bwd`` together with autograd and autocast, and register the pair.

    ``native_autograd(*args) -> bool``, optional: True when, for these arguments, the forward
    implementation is built from differentiable torch ops whose own autograd computes exactly
    the gradients of the backward op and saves the same tensors. The eager fast path then runs
    the implementation under native autograd, with no Python autograd node at all (the cheapest
    eager path there is); ``tests/test_library.py`` proves it agrees bitwise with the op path.
    """
    if sum(fwd_is_list for fwd_is_list in _returns_layout(fwd.overload)) > 1:
        raise ValueError(f"{fwd.qualname}: at most one Tensor[] return is supported")
    dop = DifferentiableOp(
        fwd,
        bwd,
        setup_context=setup_context,
        backward=backward,
        reference=reference,
        autocast=autocast,
        native_autograd=native_autograd,
    )
    _REGISTRY[fwd.qualname] = RegistryEntry(fwd.qualname, fwd.overload, dop, fwd.opaque)
    _REGISTRY[bwd.qualname] = RegistryEntry(bwd.qualname, bwd.overload, dop, bwd.opaque)
    return dop


# ---------------------------------------------------------------------------------------------
# Ops defined in C++ (csrc/): schema and kernels come from TORCH_LIBRARY_FRAGMENT(te, m)
# ---------------------------------------------------------------------------------------------


def extern_op(name: str, *, fake: Callable, opaque: str) -> torch._ops.OpOverload:
    """Register the fake of a C++ op already loaded from ``te_compile._C``.
    Inductor cannot trace C++: ``opaque`` says why the op needs to be C++."""
    qualname = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualname, fake, lib=_LIB)
    overload = getattr(getattr(torch.ops, NAMESPACE), name).default
    _REGISTRY[qualname] = RegistryEntry(qualname, overload, None, opaque)
    return overload


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RegistryEntry:
    """One registered op. ``differentiable`` is the pair a forward or backward op belongs to
    (None for an op without a backward). The registry test calls every op but the backward ops
    on its sample inputs (``tests/samples``) and a backward op with the calls the forward's
    autograd makes."""

    name: str
    overload: torch._ops.OpOverload
    differentiable: DifferentiableOp | None
    opaque: str | None = None


_REGISTRY: dict[str, RegistryEntry] = {}


def registry() -> dict[str, RegistryEntry]:
    return dict(_REGISTRY)


def list_ops() -> list[str]:
    """Names of every registered te op, e.g. ``["te::bulk_allocate", "te::linear_fwd", ...]``."""
    return sorted(_REGISTRY)
