r"""Tensor-parallel communication basic ops: ``AllGather``, ``AllReduce``, ``ReduceScatter``.

All three work on dim 0 (the token dim of sequence parallelism) over ``process_group`` (a
ProcessGroup, a 1-D DeviceMesh or ``(mesh, dim name)``) through the same collectives the
tensor-parallel modules use (:mod:`te_compile.distributed.collectives`, on ``torch.distributed``'s
functional collectives, which ``torch.compile`` traces into the graph):

* ``AllGather``: forward all-gather (dim 0 grows ``world_size`` times), backward reduce-scatter;
* ``ReduceScatter``: forward sum reduce-scatter (dim 0 shrinks), backward all-gather;
* ``AllReduce``: forward sum all-reduce (the output of a row-parallel GEMM), backward identity
  (every rank already holds the full gradient).

Without a group (``process_group=None``) or with a group of one process, each op is the identity
and touches no communication.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from te_compile.distributed import collectives
from te_compile.ops.op import BasicOperation, OpOutput

__all__ = ["AllGather", "AllReduce", "ReduceScatter"]


class _Collective(BasicOperation):
    def __init__(self, process_group: Any = None) -> None:
        super().__init__()
        self.process_group = collectives.resolve_group(
            process_group, type(self).__name__, "process_group"
        )
        self.world_size = (
            1 if self.process_group is None else dist.get_world_size(self.process_group)
        )

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}"


class AllGather(_Collective):
    """Concatenate every rank's input along dim 0 (backward: reduce-scatter of the gradient)."""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        if self.world_size == 1:
            return x, ()
        return collectives.all_gather(x, self.process_group, 0), ()


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
        return collectives.reduce_scatter(x, self.process_group, 0), ()


class AllReduce(_Collective):
    """Sum the inputs of every rank (backward: identity)."""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        if self.world_size == 1:
            return x, ()
        return collectives.all_reduce(x, self.process_group), ()
