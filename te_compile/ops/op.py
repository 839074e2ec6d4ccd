"""The kinds of step of a :class:`~te_compile.ops.Sequential`: basic and fused operations.

A **basic operation** is an ``nn.Module`` that owns its parameters (if any). It implements one of
two protocols, told apart by which methods the subclass overrides:

* **ours**: ``op_forward(x, extra_inputs) -> (y, extra_outputs)`` through ``te_compile.functional``
  (te ops), differentiated by autograd;
* **Transformer Engine's**: ``op_forward(ctx, input_, prev_op_grad_output_quantizer,
  next_op_input_quantizer) -> y`` with ``ctx.save_for_backward(...)``, and
  ``op_backward(ctx, grad_output) -> (grad_input, grad_params)`` (one gradient per tensor of
  ``self.parameters()``, in that order); or, for an op with extra inputs/outputs, ``fuser_forward``
  / ``fuser_backward`` as in TE. Such an op runs as one ``torch.autograd.Function``
  (:func:`step_forward`); the quantizer arguments are None (quantised
  data does not cross op boundaries here).

On its own a basic op is called like any module, ``op(x, *extra_inputs)``, returning ``y`` or
``(y, *extra_outputs)``.

A **fused operation** stands for a run of consecutive basic ops whose composition is one te op
call (``te_compile.functional.linear`` with an epilogue, ``fused_norm``). It is a plain object,
not a module: it owns nothing and reads the basic ops' parameters when called, so
``state_dict``, ``.to()``, optimizers and parameter replacement all see the basic ops only,
exactly as if nothing had been fused. Under an enabled ``te_compile.autocast`` a fused op
containing a linear runs the same op with the recipe as data. A user fused op (from
:func:`te_compile.ops.register_forward_fusion` and friends) implements either ``op_forward(x,
extra_inputs)`` or TE's ``fuser_forward`` / ``fuser_backward``; the latter may contain our
built-in basic ops, which then run in TE's protocol for the half it leaves to them (see
``_ours_te_forward``).

A **container** (:class:`FusibleOperation` with ``is_fused_op`` True, e.g. ``ops.Linear``) is a
module holding basic ops in ``basic_ops``; inside a ``Sequential`` its basic ops join the run
around it, so the fuser sees through it, as in Transformer Engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from te_compile._checks import shown
from te_compile.quantization.te_extra_state import accept_te_extra_state

__all__ = [
    "BasicOperation",
    "FusedOperation",
    "FusibleOperation",
    "OpOutput",
    "OperationContext",
    "broadcasts_to",
    "check_extra_input",
    "check_input",
    "implements_pass",
    "step_forward",
]

OpOutput = tuple[Tensor, tuple[Tensor, ...]]


@dataclasses.dataclass
class OperationContext:
    """Transformer Engine's per-op context: ``save_for_backward(*tensors)`` in the forward,
    ``saved_tensors`` in the backward; other attributes may be set freely."""

    saved_tensors: tuple[Tensor | None, ...] | None = None
    to_save: tuple[Tensor | None, ...] | None = None
    requires_grad: bool = True

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.to_save = tensors


class FusibleOperation(nn.Module):
    """Base of everything a ``Sequential`` fuses: basic ops and containers of basic ops."""

    is_fused_op: ClassVar[bool] = False


class BasicOperation(FusibleOperation):
    """Base of the basic ops: ``num_extra_inputs`` / ``num_extra_outputs`` and ``op_forward`` (in
    either protocol; see the module docstring)."""

    num_extra_inputs: ClassVar[int] = 0
    num_extra_outputs: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        accept_te_extra_state(self)  # each TE basic op saves one (empty without FP8 state)
        # Extra tensor channels (TE's names): a channel name per extra input / output, or None
        # (the caller's); whether each extra output is also returned to the caller.
        self._extra_input_channels: list[str | None] = [None] * self.num_extra_inputs
        self._extra_output_channels: list[str | None] = [None] * self.num_extra_outputs
        self._extra_output_to_caller: list[bool] = [True] * self.num_extra_outputs
        self._extra_tensor_channels_locked = False

    def _check_channel_call(self, what: str, index: int, count: int, channel: object) -> None:
        name = f"{type(self).__name__}.set_extra_{what}_channel"
        # Transformer Engine's exception types and wording (its tests match them).
        if self._extra_tensor_channels_locked:
            raise RuntimeError(
                f"{name}: the op already captured its channel routing (a Sequential, an "
                "OperationFuser or a direct call holds it); construct new operations for a "
                "different routing"
            )
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise IndexError(f"{name}: index {index!r} out of range [0, {count})")
        if channel is not None and (not isinstance(channel, str) or not channel):
            raise ValueError(f"{name}: channel must be a non-empty string or None, got {channel!r}")

    def set_extra_input_channel(self, index: int, channel: str | None) -> None:
        """Take extra input ``index`` from the extra output named ``channel`` of an earlier op
        of the same ``Sequential`` instead of from the caller (None: from the caller)."""
        self._check_channel_call("input", index, self.num_extra_inputs, channel)
        self._extra_input_channels[index] = channel

    def set_extra_output_channel(
        self, index: int, channel: str | None, output_to_caller: bool = True
    ) -> None:
        """Name extra output ``index`` ``channel`` for later ops' extra inputs; with
        ``output_to_caller=False`` it is not returned by the ``Sequential`` (None: public)."""
        self._check_channel_call("output", index, self.num_extra_outputs, channel)
        if not isinstance(output_to_caller, bool):
            raise TypeError(
                f"{type(self).__name__}.set_extra_output_channel: output_to_caller must be a "
                f"bool, got {output_to_caller!r}"
            )
        self._extra_output_channels[index] = channel
        self._extra_output_to_caller[index] = output_to_caller or channel is None

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        """``(y, extra_outputs)`` for input ``x`` and this op's ``extra_inputs``."""
        raise NotImplementedError

    def op_backward(self, ctx: OperationContext, grad_output: Tensor) -> Any:
        """Transformer Engine's protocol only: ``(grad_input, grad_params)``."""
        raise NotImplementedError

    def fuser_forward(self, basic_op_ctxs, input_, **kwargs) -> Any:
        """Transformer Engine's protocol only, for ops with extra inputs/outputs."""
        raise NotImplementedError

    def fuser_backward(self, basic_op_ctxs, grad_output, **kwargs) -> Any:
        """Transformer Engine's protocol only, for ops with extra inputs/outputs."""
        raise NotImplementedError

    @classmethod
    def te_protocol(cls) -> bool:
        """Whether the subclass implements Transformer Engine's protocol (it overrides
        ``op_backward`` or ``fuser_forward``) rather than ours."""
        return (
            cls.op_backward is not BasicOperation.op_backward
            or cls.fuser_forward is not BasicOperation.fuser_forward
        )

    def forward(self, input: Tensor, *extra_inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        self._extra_tensor_channels_locked = True  # as TE's transient fuser captures them
        if len(extra_inputs) != self.num_extra_inputs:
            raise ValueError(
                f"{type(self).__name__}: expected {self.num_extra_inputs} extra input(s) after "
                f"the input, got {len(extra_inputs)}"
            )
        if not isinstance(input, Tensor):
            raise TypeError(
                f"{type(self).__name__}: input must be a torch.Tensor, got {type(input).__name__}"
            )
        y, extra_outputs = step_forward(self, input, tuple(extra_inputs))
        return (y, *extra_outputs) if self.num_extra_outputs else y


def check_input(
    owner: str,
    x: object,
    last_dim: int | None = None,
    param: Tensor | None = None,
    param_name: str = "weight",
) -> None:
    """An op's ``input``: a floating-point tensor with at least one dim (and ``last_dim``
    features when given) on the device of ``param`` (the op's parameter ``param_name``, when
    given), refused by the name the op's ``forward`` gives it."""
    if (
        isinstance(x, Tensor)
        and x.is_floating_point()
        and x.dim() >= 1
        and (last_dim is None or x.shape[-1] == last_dim)
        and (param is None or x.device == param.device)
    ):
        return
    if not isinstance(x, Tensor):
        got = "None" if x is None else type(x).__name__
        raise TypeError(f"{owner}: input must be a torch.Tensor, got {got}")
    if param is not None and x.device != param.device:
        raise ValueError(
            f"{owner}: input and {param_name} must be on one device, got input on {x.device} "
            f"and {param_name} on {param.device}"
        )
    want = "" if last_dim is None else f" with {last_dim} features in its last dim"
    raise ValueError(
        f"{owner}: input must be a floating-point tensor of at least one dim{want}, got "
        f"{x.dtype} of shape {list(x.shape)}"
    )


def check_extra_input(owner: str, name: str, value: object, x: Tensor) -> None:
    """An op's extra input ``name`` (the next of the ``extra_inputs`` its ``forward``, or its
    ``Sequential``'s, was given): a tensor on the device of the op's input ``x``."""
    if isinstance(value, Tensor) and value.device == x.device:
        return
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{owner}: {name} (its extra input, one of forward's extra_inputs) must be a "
            f"torch.Tensor, got {shown(value)}"
        )
    raise ValueError(
        f"{owner}: {name} (its extra input) and input must be on one device, got {name} on "
        f"{value.device} and input on {x.device}"
    )


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without growing it."""
    return len(shape) <= len(target) and all(
        s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False)
    )


class FusedOperation:
    """A run of basic ops computed by one te op pair (see the module docstring). Which runs are
    fused, and in which order the fusions are tried, is listed in ``te_compile.ops.fused``."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        self.basic_ops = tuple(basic_ops)
        if not self.basic_ops:
            raise ValueError("FusedOperation: basic_ops must not be empty")
        self.num_extra_inputs = sum(op.num_extra_inputs for op in self.basic_ops)
        self.num_extra_outputs = sum(op.num_extra_outputs for op in self.basic_ops)

    is_fused_op: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return type(self).__name__

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        """Whether a run matching the pattern can be fused (settings the fused op does not
        cover); default: always."""
        return True

    def te_protocol(self) -> bool:
        """Whether this (user) fused op implements TE's ``fuser_forward`` / ``fuser_backward``."""
        cls = type(self)
        return cls.op_forward is FusedOperation.op_forward and (
            hasattr(cls, "fuser_forward") or hasattr(cls, "fuser_backward")
        )

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        raise NotImplementedError

    def unfused(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        """The basic ops one by one (the fallback, and the definition of what is fused)."""
        pos, extra_outputs = 0, ()
        for op in self.basic_ops:
            n = op.num_extra_inputs
            x, extra = step_forward(op, x, extra_inputs[pos : pos + n])
            pos += n
            extra_outputs = extra_outputs + extra
        return x, extra_outputs

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(type(op).__name__ for op in self.basic_ops)})"


# Transformer Engine's protocol -----------------------------------------------------------------


def _te_step(step: Any) -> bool:
    if isinstance(step, BasicOperation):
        return type(step).te_protocol()
    return isinstance(step, FusedOperation) and step.te_protocol()


def step_forward(step: Any, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
    """Run one step of a plan (basic op, fused op, plain module) in its protocol."""
    if not _te_step(step):
        return step.op_forward(x, extra_inputs)
    ops = step.basic_ops if isinstance(step, FusedOperation) else (step,)
    params = [p for op in ops for p in op.parameters()]
    requires_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, *extra_inputs, *params)
    )
    outs = _TEProtocol.apply(x, step, requires_grad, len(extra_inputs), *extra_inputs, *params)
    return outs[0], tuple(outs[1:])


def _split(flat: Sequence[Any], counts: Sequence[int]) -> list[tuple[Any, ...]]:
    out, pos = [], 0
    for n in counts:
        out.append(tuple(flat[pos : pos + n]))
        pos += n
    return out


def implements_pass(step: Any, method: str) -> bool:
    """Whether ``step`` is a user fused op whose ``method`` (``"fuser_forward"`` /
    ``"fuser_backward"``) runs: it defines it and was registered for that pass (a forward-only
    fusion's ``fuser_backward`` is not used, as in TE; ``_te_passes`` is set by the fuser)."""
    passes = getattr(step, "_te_passes", ("forward", "backward"))
    return (
        isinstance(step, FusedOperation)
        and hasattr(step, method)
        and method.removeprefix("fuser_") in passes
    )


def _in_step_sources(ops: Sequence[BasicOperation]) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(consumer op, extra input): (producer op, extra output)}`` for channels produced and
    consumed within one step's ops (handed in as None; the basic ops route them here)."""
    produced = {ch: (i, k) for i, op in enumerate(ops)
                for k, ch in enumerate(op._extra_output_channels) if ch is not None}  # fmt: skip
    return {
        (i, j): produced[ch]
        for i, op in enumerate(ops)
        for j, ch in enumerate(op._extra_input_channels)
        if ch in produced and produced[ch][0] < i
    }


def _te_forward(step, ctxs, x, extra_inputs):
    """``(y, [extra outputs of each basic op])`` through ``fuser_forward`` where the step (or an
    op of it) has one, else each basic op's ``op_forward(ctx, input_, ...)``."""
    none = {"prev_op_grad_output_quantizer": None, "next_op_input_quantizer": None}
    if implements_pass(step, "fuser_forward"):
        kwargs = [{} for _ in ctxs]
        y, extra = step.fuser_forward(
            ctxs, x, basic_op_extra_inputs=extra_inputs, basic_op_kwargs=kwargs, **none
        )
        return y, [tuple(e) for e in extra]
    ops = step.basic_ops if isinstance(step, FusedOperation) else (step,)
    sources = _in_step_sources(ops)
    extra_outputs = []
    for i, (op, ctx, xs) in enumerate(zip(ops, ctxs, extra_inputs, strict=True)):
        xs = tuple(
            extra_outputs[sources[i, j][0]][sources[i, j][1]] if (i, j) in sources else t
            for j, t in enumerate(xs)
        )
        if not type(op).te_protocol():
            x, extra = _ours_te_forward(op, ctx, x, xs)
        elif type(op).fuser_forward is not BasicOperation.fuser_forward:
            x, (extra,) = op.fuser_forward(
                [ctx], x, basic_op_extra_inputs=[xs], basic_op_kwargs=[{}], **none
            )
        else:
            x, extra = op.op_forward(ctx, x, **none), ()
        extra_outputs.append(tuple(extra))
    return x, extra_outputs


# One of our basic ops inside a user fused op in TE's protocol: the half of the step the user
# did not fuse runs the op in TE's protocol. The forward saves what TE's basic op saves where the
# layouts agree (``(input, *parameters, *extra_inputs)``: BasicLinear's ``(input, weight)``, an
# activation's ``(input,)``) and sets ``ctx.dtype``; the backward differentiates the op's own
# ``op_forward`` at the saved input (the first saved tensor, as a user's fused forward that
# fills the context TE's way leaves it), or, for the ops whose backward needs nothing saved
# (structural ops, ``Bias``), their ``te_vjp(dy, grad_extra_outputs) -> (dx, dparams, dextra)``.


def _ours_te_forward(op, ctx, x, extra_inputs):
    y, extra = op.op_forward(x, extra_inputs)
    ctx.save_for_backward(x, *op.parameters(), *extra_inputs)
    ctx.dtype = y.dtype
    return y, extra


def _ours_te_backward(op, ctx, dy, grad_extra_outputs):
    vjp = getattr(op, "te_vjp", None)
    if vjp is not None:
        return vjp(dy, grad_extra_outputs)
    saved = ctx.saved_tensors or ()
    params = list(op.parameters())
    if not saved or saved[0] is None:
        raise RuntimeError(
            f"{type(op).__name__} (inside a fused op in Transformer Engine's protocol): its "
            "context has no saved input; the fused op's fuser_forward must "
            "ctx.save_for_backward(input_, ...) for it, as for Transformer Engine's op"
        )
    n_extra = op.num_extra_inputs
    extra = tuple(saved[len(saved) - n_extra :]) if n_extra else ()
    with torch.enable_grad():
        x = saved[0].detach().requires_grad_(dy is not None)
        extra = tuple(e.detach().requires_grad_(e.is_floating_point()) for e in extra)
        y, outs = op.op_forward(x, extra)
        wrt = [x, *params, *(e for e in extra if e.requires_grad)]
        pairs = [(y, dy)] + [(o, g) for o, g in zip(outs, grad_extra_outputs, strict=True)
                             if g is not None]  # fmt: skip
        # Not traceable by dynamo (torch.func.vjp is, but not over our ops' eager autograd
        # functions): torch.compile breaks the graph at such a fused op.
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                    allow_unused=True)  # fmt: skip
    grads_extra = iter(grads[1 + len(params) :])
    dextra = tuple(next(grads_extra) if e.requires_grad else None for e in extra)
    return grads[0], tuple(grads[1 : 1 + len(params)]), dextra


def _te_backward(step, ctxs, dy, grad_extra_outputs):
    """``(dx, [param grads of each op], [extra-input grads of each op])``, in reverse."""
    if implements_pass(step, "fuser_backward"):
        dx, dparams, dextra = step.fuser_backward(
            ctxs, dy, basic_op_grad_extra_outputs=grad_extra_outputs
        )
        return dx, [tuple(d) for d in dparams], [tuple(d) for d in dextra]
    ops = step.basic_ops if isinstance(step, FusedOperation) else (step,)
    dparams, dextra = [None] * len(ops), [None] * len(ops)
    sources = _in_step_sources(ops)
    grad_extra_outputs = [list(g) for g in grad_extra_outputs]
    for i in reversed(range(len(ops))):
        op = ops[i]
        if not type(op).te_protocol():
            dy, dp, de = _ours_te_backward(op, ctxs[i], dy, grad_extra_outputs[i])
        elif type(op).fuser_backward is not BasicOperation.fuser_backward:
            dy, (dp,), (de,) = op.fuser_backward(
                [ctxs[i]], dy, basic_op_grad_extra_outputs=[grad_extra_outputs[i]]
            )
        else:
            dy, dp = op.op_backward(ctxs[i], dy)
            de = ()
        dparams[i], dextra[i] = tuple(dp), tuple(de)
        for j, g in enumerate(dextra[i]):  # a channel inside the step: to its producer
            if (i, j) in sources and g is not None:
                p, k = sources[i, j]
                prev = grad_extra_outputs[p][k]
                grad_extra_outputs[p][k] = g if prev is None else prev + g
    return dy, dparams, dextra


class _BackwardContext:
    """A forward's :class:`OperationContext` as the backward sees it: its ``saved_tensors``, and
    every other attribute read through to the forward's context (a new object: torch.compile
    traces the backward and does not let it mutate objects made in the forward; torch 2.11's
    dynamo does not trace ``copy.copy`` either)."""

    def __init__(self, forward_ctx: OperationContext, saved: tuple[Tensor | None, ...]) -> None:
        self.forward_ctx = forward_ctx
        self.saved_tensors = saved

    def __getattr__(self, name: str) -> Any:
        return getattr(self.forward_ctx, name)


class _TEProtocol(torch.autograd.Function):
    """One step in Transformer Engine's protocol as an autograd function: the forward and the
    backward are the step's (or its basic ops') own; the tensors of every ``ctx.save_for_backward``
    are saved through autograd."""

    @staticmethod
    def forward(ctx, x: Tensor, step: Any, requires_grad: bool, n_extra: int, *tensors: Tensor):
        ops = step.basic_ops if isinstance(step, FusedOperation) else (step,)
        extra_inputs = _split(tensors[:n_extra], [op.num_extra_inputs for op in ops])
        op_ctxs = [OperationContext(requires_grad=requires_grad) for _ in ops]
        y, extra_outputs = _te_forward(step, op_ctxs, x, extra_inputs)
        to_save, ranges = [], []
        for op_ctx in op_ctxs:
            start = len(to_save)
            to_save.extend(op_ctx.to_save or ())
            op_ctx.to_save = None
            ranges.append((start, len(to_save)))
        ctx.save_for_backward(*to_save)
        ctx.step, ctx.op_ctxs, ctx.ranges, ctx.n_extra = step, op_ctxs, ranges, n_extra
        # None: an extra input routed inside this (fused) step; it takes no gradient.
        ctx.extra_given = [t is not None for t in tensors[:n_extra]]
        ctx.param_counts = [len(list(op.parameters())) for op in ops]
        ctx.extra_output_counts = [op.num_extra_outputs for op in ops]
        flat = [t for ts in extra_outputs for t in ts]
        return (y, *flat)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor, *grad_extra_outputs: Tensor):
        saved = ctx.saved_tensors
        # Fresh contexts carrying the forward's attributes (torch.compile traces the backward
        # and does not let it mutate objects made in the forward).
        op_ctxs = [
            _BackwardContext(op_ctx, tuple(saved[start:end]))
            for op_ctx, (start, end) in zip(ctx.op_ctxs, ctx.ranges, strict=True)
        ]
        per_op = _split(grad_extra_outputs, ctx.extra_output_counts)
        dx, dparams, dextra = _te_backward(ctx.step, op_ctxs, dy, per_op)
        grads_params = []
        for dp, n in zip(dparams, ctx.param_counts, strict=True):
            dp = tuple(dp) if dp is not None else (None,) * n
            if len(dp) != n:
                raise RuntimeError(
                    f"{type(ctx.step).__name__}: op_backward returned {len(dp)} parameter "
                    f"gradient(s) for {n} parameter(s)"
                )
            grads_params.extend(dp)
        grads_extra = [g for de in dextra for g in (de or ())]
        grads_extra += [None] * (ctx.n_extra - len(grads_extra))
        grads_extra = [g if given else None for g, given in zip(grads_extra, ctx.extra_given,
                                                                strict=True)]  # fmt: skip
        return (dx, None, None, None, *grads_extra, *grads_params)
