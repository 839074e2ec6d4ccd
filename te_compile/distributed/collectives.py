r"""Tensor-parallel collectives with the gradients tensor parallelism needs, traceable by
``torch.compile``.

Each function pairs a forward collective with the backward collective that makes the layer's
gradients those of the unsharded layer (``g`` is the group, :math:`x_r` rank ``r``'s tensor):

============================  ====================================  ==========================
function                      forward                               backward
============================  ====================================  ==========================
:func:`all_gather`            :math:`[x_0; x_1; \dots]` along dim   reduce-scatter (sum)
:func:`reduce_scatter`        rank r's slice of :math:`\sum_r x_r`  all-gather
:func:`all_reduce`            :math:`\sum_r x_r`                    identity
:func:`all_reduce_grad`       identity                              all-reduce (sum)
:func:`scatter`               rank r's chunk of (replicated) x      all-gather
============================  ====================================  ==========================

``all_reduce`` is the row-parallel output (every rank holds a partial product; the sum is
replicated, so each rank's gradient is the gradient of the sum); ``all_reduce_grad`` the
column-parallel input (a replicated input feeds a different shard of the GEMM on each rank, so
its gradient is the sum of the ranks' gradients) and the replicated parameters that see only a
sequence shard (norm weights and the row-parallel bias under sequence parallelism).

Why ``torch.autograd.Function`` around ``torch.distributed._functional_collectives`` and not the
functional collectives' own autograd: in torch >= 2.11 ``_c10d_functional.all_reduce`` is
differentiable with the *adjoint* rule (backward = all-reduce), which is right when each rank's
value is a distinct summand of a sum used once, and wrong for the replicated activations of
tensor parallelism (it would multiply gradients by the group size). Dynamo traces these
Functions, forward and backward, into the compiled graph: the collectives show up as
``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor`` / ``all_reduce`` with
their ``wait_tensor``, which Inductor may reorder to overlap communication with compute, and
there is no graph break.

A group is a ``ProcessGroup``, a 1-D ``DeviceMesh`` (``mesh["tp"]``), or ``(mesh, "tp")`` for a
named dim of a larger mesh; :func:`resolve_group` turns each into a ``ProcessGroup``. Modules
resolve their group once, at construction, so that the traced code holds a constant; code that
calls these functions inside a compiled region should do the same. ``group=None`` means no
communication: every function returns its input.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from te_compile._checks import check_int

__all__ = [
    "GroupLike",
    "all_gather",
    "all_reduce",
    "all_reduce_grad",
    "all_reduce_max",
    "reduce_scatter",
    "resolve_group",
    "scatter",
]

GroupLike = Union["dist.ProcessGroup", Any, None]  # ProcessGroup | DeviceMesh | (mesh, dim)


def resolve_group(
    group: GroupLike, owner: str = "te_compile.distributed", arg: str = "tp_group"
) -> Any:
    """The ``ProcessGroup`` of ``group`` (a ProcessGroup, a 1-D DeviceMesh, or ``(mesh, dim)``
    with ``dim`` a name or index of ``mesh``), or None for None. Errors name ``owner`` and the
    argument ``arg``."""
    for name, value in (("owner", owner), ("arg", arg)):
        if not isinstance(value, str):
            raise TypeError(f"resolve_group: {name} must be a str, got {value!r}")
    if group is None:
        return None
    if not dist.is_available():
        raise ValueError(f"{owner}: {arg} needs torch.distributed, which this build lacks")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names
            raise ValueError(
                f"{owner}: {arg} must be a 1-D DeviceMesh, got a {group.ndim}-D mesh "
                f"(dims {names}); pass mesh['tp'] or (mesh, 'tp') to name the tensor-parallel dim"
            )
        return group.get_group()
    if (
        isinstance(group, tuple)
        and len(group) == 2
        and isinstance(group[0], DeviceMesh)
        and isinstance(group[1], (str, int))
    ):
        mesh, dim = group
        try:
            return mesh.get_group(dim)
        except (KeyError, IndexError, RuntimeError, ValueError) as err:
            raise ValueError(
                f"{owner}: {arg} ({type(mesh).__name__}, {dim!r}): {dim!r} is not a dim of the "
                f"mesh (dims {mesh.mesh_dim_names})"
            ) from err
    raise ValueError(
        f"{owner}: {arg} must be a torch.distributed.ProcessGroup, a 1-D DeviceMesh or "
        f"(DeviceMesh, dim name), got {group!r}"
    )


def _checked(owner: str, x: object, group: GroupLike, dim: int | None = None) -> Any:
    """The resolved ``group`` of a public collective, after checking its arguments (also with
    ``group=None``, which communicates nothing): ``x`` a tensor, ``dim`` one of its dims. Reads
    metadata only, so it runs the same while ``torch.compile`` traces."""
    owner = f"te_compile.distributed.{owner}"
    if not isinstance(x, Tensor):
        raise TypeError(f"{owner}: x must be a torch.Tensor, got {type(x).__name__}")
    if dim is not None:
        check_int(owner, minimum=-x.dim(), dim=dim)
        if not dim < x.dim():
            raise ValueError(
                f"{owner}: dim must be a dim of x (in [{-x.dim()}, {x.dim()})), got {dim!r}"
            )
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    return resolve_group(group, owner, "group")


def _wait(t: Tensor) -> Tensor:
    # Eager functional collectives return an AsyncCollectiveTensor; traced ones a plain tensor
    # already followed by wait_tensor in the graph.
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _along_dim0(collective, x: Tensor, dim: int) -> Tensor:
    """``collective`` (a gather or scatter along dim 0 of a contiguous tensor) applied along
    ``dim``: the dim moved to the front and back. funcol's own handling of another dim calls
    torch._utils._maybe_view_chunk_cat on torch 2.11, which dynamo refuses to trace (a graph
    break, seen on the GPU machine 2026-11-22)."""
    if dim == 0:
        return collective(x.contiguous())
    return collective(x.movedim(dim, 0).contiguous()).movedim(0, dim).contiguous()


def _gather(x: Tensor, group: Any, dim: int) -> Tensor:
    return _along_dim0(lambda t: _wait(funcol.all_gather_tensor(t, 0, group)), x, dim)


def _scatter(x: Tensor, group: Any, dim: int) -> Tensor:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"te_compile.distributed.reduce_scatter: dim {dim} of the tensor ({x.shape[dim]}) "
            f"must be divisible by the group size ({size}); with sequence_parallel the sequence "
            "(token) dim 0 must split evenly over the tensor-parallel ranks"
        )
    return _along_dim0(lambda t: _wait(funcol.reduce_scatter_tensor(t, "sum", 0, group)), x, dim)


def _reduce(x: Tensor, group: Any, op: str = "sum") -> Tensor:
    return _wait(funcol.all_reduce(x.contiguous(), op, group))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        return _reduce(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce(grad, ctx.group), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Any, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if x.shape[dim] % size:
            raise ValueError(
                f"te_compile.distributed.scatter: dim {dim} of the tensor ({x.shape[dim]}) must "
                f"be divisible by the group size ({size})"
            )
        # A copy, never a view of ``x``: AOTAutograd regenerates an output that aliases an input
        # as a view outside the compiled graph, and the gradient then skips this backward (the
        # all-gather): wrong input gradients under torch.compile with NCCL on torch 2.11 (4x H200,
        # 2026-11-22). ``contiguous()`` returns the view itself for a dim-0 chunk.
        return x.chunk(size, dim)[rank].clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad, ctx.group, ctx.dim), None, None


def all_gather(x: Tensor, group: Any, dim: int = 0) -> Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` (rank order); backward: reduce-scatter."""
    group = _checked("all_gather", x, group, dim)
    if group is None:
        return x
    return _AllGather.apply(x, group, dim % x.dim())


def reduce_scatter(x: Tensor, group: Any, dim: int = 0) -> Tensor:
    """This rank's slice (along ``dim``) of the sum of the ranks' ``x``; backward: all-gather.
    ``x.shape[dim]`` must be divisible by the group size."""
    group = _checked("reduce_scatter", x, group, dim)
    if group is None:
        return x
    return _ReduceScatter.apply(x, group, dim % x.dim())


def scatter(x: Tensor, group: Any, dim: int = 0) -> Tensor:
    """This rank's chunk along ``dim`` of the replicated ``x`` (e.g. entering the sequence-
    parallel region after an embedding); backward: all-gather. ``x.shape[dim]`` must be
    divisible by the group size."""
    group = _checked("scatter", x, group, dim)
    if group is None:
        return x
    return _Scatter.apply(x, group, dim % x.dim())


def all_reduce(x: Tensor, group: Any) -> Tensor:
    """The sum of the ranks' ``x``; backward: identity (the sum is replicated)."""
    group = _checked("all_reduce", x, group)
    if group is None:
        return x
    return _AllReduce.apply(x, group)


def all_reduce_grad(x: Tensor, group: Any) -> Tensor:
    """Identity; backward: the sum of the ranks' gradients (``x`` is replicated and each rank
    uses it for a different part of the computation)."""
    group = _checked("all_reduce_grad", x, group)
    if group is None:
        return x
    return _AllReduceGrad.apply(x, group)


def all_reduce_max(x: Tensor, group: Any) -> Tensor:
    """The element-wise max of the ranks' ``x``, not differentiable (``x`` is detached first):
    for stabilising shifts such as the logits' max in a sharded softmax."""
    group = _checked("all_reduce_max", x, group)
    x = x.detach()
    if group is None:
        return x
    return _reduce(x, group, "max")
