"""The two kinds of step of a :class:`~te_compile.ops.Sequential`: basic and fused operations.

A **basic operation** is an ``nn.Module`` that owns its parameters (if any) and computes one
thing through ``te_compile.functional``. Inside a ``Sequential`` it is called through
:meth:`BasicOperation.op_forward`, which takes the main input and this op's extra inputs and
returns the main output and this op's extra outputs; on its own it is called like any module,
``op(x, *extra_inputs)``, returning ``y`` or ``(y, *extra_outputs)``.

A **fused operation** stands for a run of consecutive basic ops whose composition is one te op
call (``te_compile.functional.linear`` with an epilogue, ``fused_norm``). It is a plain object,
not a module: it owns nothing and reads the basic ops' parameters when called, so
``state_dict``, ``.to()``, optimizers and parameter replacement all see the basic ops only,
exactly as if nothing had been fused. Under an enabled ``te_compile.autocast`` a fused op
containing a linear runs the same op with the recipe as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from torch import Tensor, nn

__all__ = ["BasicOperation", "FusedOperation", "OpOutput", "check_input"]

OpOutput = tuple[Tensor, tuple[Tensor, ...]]


class BasicOperation(nn.Module):
    """Base of the basic ops: ``num_extra_inputs`` / ``num_extra_outputs`` and ``op_forward``."""

    num_extra_inputs: ClassVar[int] = 0
    num_extra_outputs: ClassVar[int] = 0

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        """``(y, extra_outputs)`` for input ``x`` and this op's ``extra_inputs``."""
        raise NotImplementedError

    def forward(self, input: Tensor, *extra_inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        if len(extra_inputs) != self.num_extra_inputs:
            raise ValueError(
                f"{type(self).__name__}: expected {self.num_extra_inputs} extra input(s) after "
                f"the input, got {len(extra_inputs)}"
            )
        if not isinstance(input, Tensor):
            raise TypeError(
                f"{type(self).__name__}: input must be a torch.Tensor, got {type(input).__name__}"
            )
        y, extra_outputs = self.op_forward(input, extra_inputs)
        return (y, *extra_outputs) if self.num_extra_outputs else y


def check_input(owner: str, x: object, last_dim: int | None = None) -> None:
    """An op's ``input``: a floating-point tensor with at least one dim (and ``last_dim``
    features when given), refused by the name the op's ``forward`` gives it."""
    if (
        isinstance(x, Tensor)
        and x.is_floating_point()
        and x.dim() >= 1
        and (last_dim is None or x.shape[-1] == last_dim)
    ):
        return
    if not isinstance(x, Tensor):
        raise TypeError(f"{owner}: input must be a torch.Tensor, got {type(x).__name__}")
    want = "" if last_dim is None else f" with {last_dim} features in its last dim"
    raise ValueError(
        f"{owner}: input must be a floating-point tensor of at least one dim{want}, got "
        f"{x.dtype} of shape {list(x.shape)}"
    )


class FusedOperation:
    """A run of basic ops computed by one te op pair (see the module docstring). Which runs are
    fused, and in which order the fusions are tried, is listed in ``te_compile.ops.fused``."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        self.basic_ops = tuple(basic_ops)
        self.num_extra_inputs = sum(op.num_extra_inputs for op in self.basic_ops)
        self.num_extra_outputs = sum(op.num_extra_outputs for op in self.basic_ops)

    @property
    def name(self) -> str:
        return type(self).__name__

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        """Whether a run matching the pattern can be fused (settings the fused op does not
        cover); default: always."""
        return True

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        raise NotImplementedError

    def unfused(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        """The basic ops one by one (the fallback, and the definition of what is fused)."""
        pos, extra_outputs = 0, ()
        for op in self.basic_ops:
            n = op.num_extra_inputs
            x, extra = op.op_forward(x, extra_inputs[pos : pos + n])
            pos += n
            extra_outputs = extra_outputs + extra
        return x, extra_outputs

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(type(op).__name__ for op in self.basic_ops)})"
