"""``te_compile.ops.Sequential``: ``nn.Sequential`` for basic ops, with a fuser.

``Sequential(*modules, fuse=True)`` holds its modules exactly as ``nn.Sequential`` does (same
names ``"0"``, ``"1"``, ..., same ``state_dict`` keys, indexing, ``append`` / ``insert`` /
``extend`` / ``pop`` / ``del``). Plain ``nn.Module``\\ s may sit anywhere; they run as they are
and split the runs of consecutive basic ops, each of which the fuser rewrites with the fusions
of ``te_compile.ops.fused``. The plan is made when the module list changes, not per call, and
:meth:`Sequential.fusions` lists it. ``fuse=False`` (or setting ``.fuse``) runs every basic op
on its own: the reference the fusions are tested against.

``forward(input, *extra_inputs)``: each ``AddExtraInput`` (and each op taking extra inputs, such
as ``GroupedLinear``'s ``m_splits``) takes the next extra input in order; the result is the
output, or ``(output, *extra_outputs)`` when ``MakeExtraOutput`` ops produced extra outputs.

Extra tensor channels (Transformer Engine's): ``op.set_extra_output_channel(i, "name",
output_to_caller=...)`` names an extra output, ``op.set_extra_input_channel(j, "name")`` makes a
later op take it as an extra input; named inputs are not arguments of ``forward``, and outputs
with ``output_to_caller=False`` are not returned. A name has one producer, which must come
earlier; a channel may fan out to several consumers (autograd adds their gradients). The routing
is captured when the ``Sequential`` is built (the ops' channels are then locked); here channels
may also cross plain modules of the ``Sequential``.
Inside a ``Sequential`` the basic ops are called through ``op_forward``, so module hooks
registered on a *basic op* do not run (hooks on the ``Sequential`` and on plain modules do).
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

from torch import Tensor, nn

from te_compile._checks import check_bool
from te_compile.ops.fused import fuse as _fuse
from te_compile.ops.fused import user_fusions_version
from te_compile.ops.op import (
    BasicOperation,
    FusedOperation,
    FusibleOperation,
    OpOutput,
    implements_pass,
    step_forward,
)
from te_compile.quantization.state import get_autocast_state

__all__ = ["Sequential"]


class _ModuleStep:
    """A plain module in the plan: no extra inputs or outputs."""

    num_extra_inputs = 0
    num_extra_outputs = 0

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return self.module(x), ()


class Sequential(nn.Sequential):
    """A container of basic ops (and plain modules) whose known patterns run as fused ops.

    Args:
        *modules: basic ops of ``te_compile.ops`` and/or any ``nn.Module`` (or one
            ``OrderedDict`` of them, as for ``nn.Sequential``).
        fuse: replace known patterns of consecutive basic ops with fused ops (default True).
    """

    def __init__(self, *modules: nn.Module | OrderedDict, fuse: bool = True) -> None:
        object.__setattr__(self, "_planning", False)
        super().__init__(*modules)
        check_bool("Sequential", fuse=fuse)
        self._fuse = fuse
        self._replan()

    # The plan ------------------------------------------------------------------------------

    def _plan(self, recipe: Any = None) -> tuple[Any, ...]:
        steps: list[Any] = []
        run: list[BasicOperation] = []
        for module in self._modules.values():
            if isinstance(module, BasicOperation):
                run.append(module)
                continue
            if isinstance(module, FusibleOperation) and module.is_fused_op:
                run.extend(module.basic_ops)  # a container (ops.Linear): the fuser sees through
                continue
            steps.extend(_fuse(run, recipe) if self._fuse else run)
            run = []
            steps.append(_ModuleStep(module))
        steps.extend(_fuse(run, recipe) if self._fuse else run)
        return tuple(steps)

    def _replan(self) -> None:
        steps = self._plan()
        # Plain attributes (not submodules): fused ops own nothing, and the basic ops stay the
        # registered children, so state_dict, .to() and optimizers see only them. Plans for
        # other recipes (user fusions get the recipe) are made on first use.
        object.__setattr__(self, "_steps", steps)
        object.__setattr__(self, "_routes", self._route(steps))
        # Per (recipe type, user fusions): (steps, routes).
        object.__setattr__(self, "_plans", {(None, user_fusions_version()): (steps, self._routes)})
        object.__setattr__(self, "_planning", True)

    @staticmethod
    def _route(steps: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Per step: ``(inputs, outputs)`` with inputs ``("caller", i)`` / ``("channel",
        name)`` and outputs ``(channel name or None, returned to the caller)``; None when no
        op uses a channel (the plain path). Validates the channel names."""

        def ops_of(step: Any) -> tuple[BasicOperation, ...]:
            if isinstance(step, FusedOperation):
                return step.basic_ops
            return (step,) if isinstance(step, BasicOperation) else ()

        ops = [op for step in steps for op in ops_of(step)]
        for op in ops:
            op._extra_tensor_channels_locked = True
        if not any(any(op._extra_input_channels) or any(op._extra_output_channels) for op in ops):
            return None
        # Every producer first (TE's order of checks), by position among the basic ops.
        producers: dict[str, int] = {}
        for k, op in enumerate(ops):
            for ch in op._extra_output_channels:
                if ch is not None and ch in producers:
                    raise ValueError(
                        f"Sequential: extra tensor channel {ch!r} has multiple producers "
                        f"({type(ops[producers[ch]]).__name__} and {type(op).__name__})"
                    )
                if ch is not None:
                    producers[ch] = k
        routes, n_caller, k = [], 0, 0
        for step in steps:
            first = k  # this step's basic ops are ops[first:k]
            inputs, outputs = [], []
            for op in ops_of(step):
                for ch in op._extra_input_channels:
                    if ch is None:
                        inputs.append(("caller", n_caller))
                        n_caller += 1
                    elif producers.get(ch, k) >= k:
                        earlier = "earlier " if ch in producers else ""
                        raise ValueError(
                            f"Sequential: extra tensor channel {ch!r} consumed by "
                            f"{type(op).__name__} has no {earlier}producer "
                            f"(set_extra_output_channel on {'an earlier' if earlier else 'a'} op)"
                        )
                    else:
                        # A producer inside the same (fused) step: the step routes it itself
                        # and is handed None, as in TE.
                        inputs.append(("internal" if producers[ch] >= first else "channel", ch))
                outputs.extend(zip(op._extra_output_channels, op._extra_output_to_caller,
                                   strict=True))  # fmt: skip
                k += 1
            routes.append((tuple(inputs), tuple(outputs)))
        return tuple(routes)

    @property
    def _num_extra_inputs(self) -> int:
        if self._routes is None:
            return sum(s.num_extra_inputs for s in self._steps)
        return sum(src == "caller" for ins, _ in self._routes for src, _ in ins)

    def _plan_for_call(self) -> tuple[tuple[Any, ...], Any]:
        """``(steps, routes)`` of the plan for the current autocast recipe and user fusions."""
        version = user_fusions_version()
        if not version:
            return self._steps, self._routes
        state = get_autocast_state()
        recipe = state.recipe if state.enabled else None
        key = (None if recipe is None else type(recipe), version)
        plan = self._plans.get(key)
        if plan is None:
            steps = self._plan(recipe)
            plan = (steps, self._route(steps))
            self._plans[key] = plan
        return plan

    @property
    def fuse(self) -> bool:
        """Whether known patterns run fused; setting it re-plans."""
        return self._fuse

    @fuse.setter
    def fuse(self, value: bool) -> None:
        object.__setattr__(self, "_fuse", bool(value))
        self._replan()

    def fusions(self) -> list[tuple[str, tuple[str, ...]]]:
        """The fused ops of the plan: ``[(fused op name, (names of its modules, ...)), ...]``,
        e.g. ``[("ForwardLinearBiasActivation", ("0", "1", "2"))]``; empty without fusion."""
        names = {id(m): name for name, m in self.named_modules() if name}
        return [
            (step.name, tuple(names[id(op)] for op in step.basic_ops))
            for step in self._plan_for_call()[0]
            if isinstance(step, FusedOperation)
        ]

    @property
    def _module_groups(self) -> list[Any]:
        """Transformer Engine's private view of the plan, which its tests read: per run of ops
        between plain modules, an object with ``_forward_ops`` / ``_backward_ops``, lists of
        ``(op, [basic op indices in the run])`` for each pass (a fused op where it implements
        that pass, else its basic ops one by one); a plain module as itself."""
        groups: list[Any] = []
        run: list[Any] = []

        def close() -> None:
            if run:
                fwd, bwd, i = [], [], 0
                for step in run:
                    basic = step.basic_ops if isinstance(step, FusedOperation) else (step,)
                    idxs = list(range(i, i + len(basic)))
                    for ops, method in ((fwd, "fuser_forward"), (bwd, "fuser_backward")):
                        if isinstance(step, FusedOperation) and (
                            not step.te_protocol() or implements_pass(step, method)
                        ):
                            ops.append((step, idxs))
                        else:
                            ops.extend((op, [j]) for op, j in zip(basic, idxs, strict=True))
                    i += len(basic)
                groups.append(SimpleNamespace(_forward_ops=fwd, _backward_ops=bwd))
                run.clear()

        for step in self._plan_for_call()[0]:
            if isinstance(step, _ModuleStep):
                close()
                groups.append(step.module)
            else:
                run.append(step)
        close()
        return groups

    # Re-plan on every change of the module list (nn.Sequential's mutators all come here).

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if self._planning and (name == "_modules" or isinstance(value, nn.Module)):
            self._replan()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        if self._planning and (name == "_modules" or name.isdigit()):
            self._replan()

    def add_module(self, name: str, module: nn.Module | None) -> None:
        super().add_module(name, module)
        if self._planning:
            self._replan()

    def insert(self, index: int, module: nn.Module) -> Sequential:
        super().insert(index, module)
        self._replan()
        return self

    # Forward ---------------------------------------------------------------------------------

    def forward(self, input: Tensor, *extra_inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        if len(extra_inputs) != self._num_extra_inputs:
            raise ValueError(
                f"Sequential: expected {self._num_extra_inputs} extra input(s) after the input "
                f"(one per AddExtraInput, in order), got {len(extra_inputs)}"
            )
        if not isinstance(input, Tensor):
            raise TypeError(f"Sequential: input must be a torch.Tensor, got {type(input).__name__}")
        steps, routes = self._plan_for_call()
        if routes is not None:
            return self._forward_routed(steps, routes, input, extra_inputs)
        x, pos, extra_outputs = input, 0, ()
        for step in steps:
            n = step.num_extra_inputs
            x, extra = step_forward(step, x, extra_inputs[pos : pos + n])
            pos += n
            extra_outputs = extra_outputs + extra
        return (x, *extra_outputs) if extra_outputs else x

    def _forward_routed(self, steps, routes, x: Tensor, extra_inputs: tuple[Tensor, ...]):
        channels: dict[str, Tensor] = {}
        public: list[Tensor] = []
        for step, (inputs, outputs) in zip(steps, routes, strict=True):
            ins = []
            for src, k in inputs:
                if src == "caller":
                    ins.append(extra_inputs[k])
                elif src == "internal":
                    ins.append(None)
                elif channels[k] is None:
                    raise RuntimeError(
                        f"Sequential: extra tensor channel {k!r} is consumed by an operation "
                        "outside its forward fusion, which returned None for it"
                    )
                else:
                    ins.append(channels[k])
            x, extra = step_forward(step, x, tuple(ins))
            for y, (ch, to_caller) in zip(extra, outputs, strict=True):
                if y is None and to_caller:
                    raise RuntimeError(
                        f"Sequential: an extra output of {getattr(step, 'name', step)} is public "
                        "(returned to the caller), and its forward fusion returned None for it"
                    )
                if ch is not None:
                    channels[ch] = y
                if to_caller:
                    public.append(y)
        return (x, *public) if public else x

    def extra_repr(self) -> str:
        return "" if self._fuse else "fuse=False"
