r"""Basic ops that move, scale or route tensors: ``Identity``, ``Reshape``, ``ConstantScale``,
``AddExtraInput`` (residual add) and ``MakeExtraOutput`` (branch output).

Each is one torch view or element-wise op: a te custom op would have to copy its output (an op's
output may not alias its input) and would hide the op from Inductor's fusion, for nothing. Where
one of them sits next to a GEMM or a norm, the fuser folds it into that op's te op pair
(``ConstantScale`` and ``AddExtraInput`` into ``te::linear``'s residual epilogue,
``MakeExtraOutput`` into ``te::linear``'s branch or ``te::branch_rmsnorm``).

Extra inputs and outputs, as in Transformer Engine: ``Sequential.forward(x, *extra_inputs)``
hands each ``AddExtraInput`` the next extra input, in order, and returns
``(y, *extra_outputs)`` with one extra output per ``MakeExtraOutput``, in order (just ``y`` when
there is none).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_compile._checks import check_bool, check_finite
from te_compile.ops.op import BasicOperation, OpOutput, broadcasts_to, check_extra_input

__all__ = ["AddExtraInput", "ConstantScale", "Identity", "MakeExtraOutput", "Reshape"]


class Identity(BasicOperation):
    """:math:`y = x` (the input itself, no copy)."""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return x, ()

    def te_vjp(self, dy: Tensor, grad_extra_outputs: tuple) -> tuple[Tensor, tuple, tuple]:
        """The backward inside a user fused op in TE's protocol (``ops.op``)."""
        return dy, (), ()


class Reshape(BasicOperation):
    """``x.reshape(shape)`` (a view when the layout allows); one dim may be -1."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        if not isinstance(shape, Sequence) or isinstance(shape, str):
            raise TypeError(f"Reshape: shape must be a sequence of ints, got {shape!r}")
        shape = tuple(shape)
        if any(not isinstance(s, int) or isinstance(s, bool) or s < -1 for s in shape) or (
            shape.count(-1) > 1
        ):
            raise ValueError(
                f"Reshape: shape must be a sequence of ints >= 0 with at most one -1, got {shape!r}"
            )
        self.shape = shape

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return x.reshape(self.shape), ()

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}"


class ConstantScale(BasicOperation):
    r""":math:`y = \alpha x` for a constant ``scale`` :math:`\alpha`."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        check_finite("ConstantScale", scale=scale)
        self.scale = float(scale)

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return x * self.scale, ()

    def te_vjp(self, dy: Tensor, grad_extra_outputs: tuple) -> tuple[Tensor, tuple, tuple]:
        """The backward inside a user fused op in TE's protocol (``ops.op``)."""
        return dy * self.scale, (), ()

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class AddExtraInput(BasicOperation):
    """:math:`y = x + r` with :math:`r` the next extra input of the ``Sequential`` (a residual).

    ``in_place=True`` (Transformer Engine's meaning): the sum is written into :math:`r`'s
    storage (``r += x``) and the output holds it: no new buffer; the caller's tensor holds the
    sum afterwards. The gradient of the output reaches both :math:`x` and :math:`r`; autograd
    records the in-place add, except on a leaf that requires grad, which it refuses to write:
    there (as TE writes into ``r.detach()`` in every case) an autograd function writes into
    :math:`r` with autograd off and passes the output's gradient to both. ``torch.compile``
    functionalises the write. :math:`r` must have the output's shape. After a linear, the
    fusers put the add in the GEMM's epilogue and, with ``in_place``, write the result into
    :math:`r` (:func:`store_into`).
    """

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        check_bool("AddExtraInput", in_place=in_place)
        self.in_place = in_place

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        (residual,) = extra_inputs
        check_extra_input("AddExtraInput", "residual", residual, x)
        if not self.in_place:
            if residual.shape != x.shape and not broadcasts_to(residual.shape, x.shape):
                raise ValueError(
                    f"AddExtraInput: residual (its extra input) must have the input's shape "
                    f"{tuple(x.shape)} or broadcast to it (the output keeps the input's shape), "
                    f"got {tuple(residual.shape)}"
                )
            return x + residual, ()
        if residual.shape != x.shape:
            raise ValueError(
                f"AddExtraInput(in_place=True): the extra input's shape "
                f"({tuple(residual.shape)}) must be the input's ({tuple(x.shape)})"
            )
        if residual.is_leaf and residual.requires_grad and torch.is_grad_enabled():
            return _AddInto.apply(x, residual), ()
        return residual.add_(x), ()

    def te_vjp(self, dy: Tensor, grad_extra_outputs: tuple) -> tuple[Tensor, tuple, tuple]:
        """The backward inside a user fused op in TE's protocol (``ops.op``); autograd sums a
        broadcast residual's gradient to its shape."""
        return dy, (), (dy,)

    def extra_repr(self) -> str:
        return "in_place=True" if self.in_place else ""


def store_into(residual: Tensor, y: Tensor) -> Tensor:
    """``y`` (a sum that already includes ``residual``, from a GEMM's residual epilogue)
    written into ``residual``'s storage, which is returned as the output: in-place
    ``AddExtraInput`` after the fused linear. The output's gradient goes to ``y`` (which passes
    it on to ``residual``); a leaf that requires grad is written with autograd off, as
    :class:`_AddInto` does."""
    if residual.is_leaf and residual.requires_grad and torch.is_grad_enabled():
        return _StoreInto.apply(y, residual)
    return residual.copy_(y)


class _StoreInto(torch.autograd.Function):
    """``residual[...] = y`` for a leaf that requires grad; the output aliases ``residual``."""

    @staticmethod
    def forward(ctx, y: Tensor, residual: Tensor) -> Tensor:
        residual.copy_(y)
        return residual.view_as(residual)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        return dy, None


class _AddInto(torch.autograd.Function):
    """``r += x`` into the storage of ``r`` (a tensor that requires grad, possibly a leaf), the
    sum as the output, and the output's gradient to both: TE's in-place ``AddExtraInput``."""

    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor) -> Tensor:
        residual.add_(x)  # autograd is off inside forward: a grad-requiring leaf may be written
        return residual.view_as(residual)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor]:
        return dy, dy


class MakeExtraOutput(BasicOperation):
    """:math:`y = x`, and :math:`x` also leaves the ``Sequential`` as its next extra output (a
    residual branch). The two gradients add up in the backward.

    ``in_place=True`` (Transformer Engine: the main gradient is accumulated into the extra
    output's gradient buffer): here autograd forms that sum, and its gradient buffer already
    accumulates in place when the buffer is not shared, so both settings compute the same values
    with the same memory; the flag is kept (``in_place``) for TE code and for the fusions
    (``BackwardLinearAdd`` adds the branch gradient in the dgrad GEMM's epilogue either way).
    """

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        check_bool("MakeExtraOutput", in_place=in_place)
        self.in_place = in_place

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return x, (x,)

    def te_vjp(self, dy: Tensor, grad_extra_outputs: tuple) -> tuple[Tensor, tuple, tuple]:
        """The backward inside a user fused op in TE's protocol (``ops.op``)."""
        (d_branch,) = grad_extra_outputs
        return (dy if d_branch is None else dy + d_branch), (), ()

    def extra_repr(self) -> str:
        return "in_place=True" if self.in_place else ""
