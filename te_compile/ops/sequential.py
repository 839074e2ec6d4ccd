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
Inside a ``Sequential`` the basic ops are called through ``op_forward``, so module hooks
registered on a *basic op* do not run (hooks on the ``Sequential`` and on plain modules do).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from torch import Tensor, nn

from te_compile._checks import check_bool
from te_compile.ops.fused import fuse as _fuse
from te_compile.ops.op import BasicOperation, FusedOperation, OpOutput

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

    def _replan(self) -> None:
        steps: list[Any] = []
        run: list[BasicOperation] = []
        for module in self._modules.values():
            if isinstance(module, BasicOperation):
                run.append(module)
                continue
            steps.extend(_fuse(run) if self._fuse else run)
            run = []
            steps.append(_ModuleStep(module))
        steps.extend(_fuse(run) if self._fuse else run)
        # Plain attributes (not submodules): fused ops own nothing, and the basic ops stay the
        # registered children, so state_dict, .to() and optimizers see only them.
        object.__setattr__(self, "_steps", tuple(steps))
        object.__setattr__(self, "_num_extra_inputs", sum(s.num_extra_inputs for s in steps))
        object.__setattr__(self, "_planning", True)

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
        names = {id(m): name for name, m in self._modules.items()}
        return [
            (step.name, tuple(names[id(op)] for op in step.basic_ops))
            for step in self._steps
            if isinstance(step, FusedOperation)
        ]

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
        x, pos, extra_outputs = input, 0, ()
        for step in self._steps:
            n = step.num_extra_inputs
            x, extra = step.op_forward(x, extra_inputs[pos : pos + n])
            pos += n
            extra_outputs = extra_outputs + extra
        return (x, *extra_outputs) if extra_outputs else x

    def extra_repr(self) -> str:
        return "" if self._fuse else "fuse=False"
