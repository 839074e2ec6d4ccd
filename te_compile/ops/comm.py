r"""Tensor-parallel communication basic ops: ``AllGather``, ``AllReduce``, ``ReduceScatter``.

All three work on dim 0 (the token dim of sequence parallelism) over ``process_group`` with
``torch.distributed``'s functional collectives, which ``torch.compile`` traces into the graph:

* ``AllGather``: forward all-gather (dim 0 grows ``world_size`` times), backward reduce-scatter
  (``funcol.all_gather_tensor_autograd``);
* ``ReduceScatter``: forward sum reduce-scatter (dim 0 shrinks), backward all-gather
  (``funcol.reduce_scatter_tensor_autograd``);
* ``AllReduce``: forward sum all-reduce (the output of a row-parallel GEMM), backward identity
  (every rank already holds the full gradient).

Without a group (``process_group=None``) or with a group of one process, each op is the identity
and touches no communication. The tensor-parallel modules (issue 7) build on these.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from te_compile.ops.op import BasicOperation, OpOutput

__all__ = ["AllGather", "AllReduce", "ReduceScatter"]


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


class _Collective(BasicOperation):
    def __init__(self, process_group: Any = None) -> None:
        super().__init__()
        name = type(self).__name__
        if process_group is not None and not (
            dist.is_available() and isinstance(process_group, dist.ProcessGroup)
        ):
            raise ValueError(
                f"{name}: process_group must be a torch.distributed.ProcessGroup or None, "
                f"got {process_group!r}"
            )
        self.process_group = process_group
        self.world_size = 1 if process_group is None else dist.get_world_size(process_group)

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}"


class AllGather(_Collective):
    """Concatenate every rank's input along dim 0 (backward: reduce-scatter of the gradient)."""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        if self.world_size == 1:
            return x, ()
        return _funcol().all_gather_tensor_autograd(x, 0, self.process_group), ()


class ReduceScatter(_Collective):
    """Sum the inputs of every rank and keep this rank's slice of dim 0 (backward: all-gather).
    Dim 0 must be divisible by the group size."""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        if self.world_size == 1:
            return x, ()
        if x.shape[0] % self.world_size:
            raise ValueError(
                f"ReduceScatter: input dim 0 ({x.shape[0]}) must be divisible by the group size "
                f"({self.world_size})"
            )
        out = _funcol().reduce_scatter_tensor_autograd(x, "sum", 0, self.process_group)
        return out, ()


class _AllReduceSum(torch.autograd.Function):
    """Sum all-reduce whose gradient is the incoming gradient (each rank's is already full)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        return _funcol().all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class AllReduce(_Collective):
    """Sum the inputs of every rank (backward: identity)."""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        if self.world_size == 1:
            return x, ()
        return _AllReduceSum.apply(x, self.process_group), ()
