"""Tensor and sequence parallelism for the modules: configuration, sharding, communication.

A module built with ``parallel_mode="column"`` holds rows ``[r * n/p, (r+1) * n/p)`` of its
``[out_features, in_features]`` weight (and bias) on rank ``r`` of a ``p``-rank group; its input
is replicated and its output sharded along the last dim. ``parallel_mode="row"`` holds the
columns ``[r * k/p, (r+1) * k/p)`` of the weight, takes an input sharded along its last dim
(a column-parallel layer's output) and sums the partial outputs over the group; the bias is
replicated and added after the sum. A column layer followed by a row layer is the Megatron MLP:
one all-reduce forward, one backward.

``sequence_parallel=True`` keeps the activations *between* such pairs sharded along dim 0 (the
sequence dim of ``[s, b, h]``, or the token dim of ``[tokens, h]``): a column layer all-gathers
its input along dim 0 before the GEMM (backward: reduce-scatter of the input gradient), a row
layer reduce-scatters its output along dim 0 instead of all-reducing it (backward: all-gather).
Layer norms then run on the sequence shard: their weights see only local tokens, so their
gradients are partial sums. Transformer Engine marks such parameters ``sequence_parallel=True``
and leaves the all-reduce to the framework (Megatron's optimizer); te_compile does it in the
backward graph (:func:`~te_compile.distributed.all_reduce_grad` on the parameter before use), so
a plain optimizer sees correct gradients, and still sets the attribute, which therefore means
"reduced already". The row-parallel bias under sequence parallelism is treated the same way.

Parameter attributes (Megatron's names, which checkpoint converters and optimizers read), set on
every parameter of a module with ``parallel_mode`` set (``LayerNormMLP``/``GroupedMLP``: with a
tensor-parallel group or ``tp_size > 1``):

* ``tensor_model_parallel``: True when the parameter is a shard;
* ``partition_dim``: the dim it is sharded along (-1 when replicated);
* ``partition_stride``: 1, or 2 for the FC1 weight/bias of a gated activation: the full tensor
  is ``[activation half; linear half]`` and each rank holds ``[its activation shard; its linear
  shard]``, so the shard is chunks ``r`` and ``r + p`` of the ``2p`` chunks along the dim;
* ``sequence_parallel``: the replicated parameters whose gradient is all-reduced over the group
  because they see a sequence shard (norm weights and biases, the row-parallel bias).

:func:`shard_state_dict` uses them to cut a full (single-process) state_dict into a rank's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from te_compile._checks import check_bool, check_choice, check_int
from te_compile.distributed import collectives as C

__all__ = [
    "PARALLEL_MODES",
    "TensorParallel",
    "gather_optimizer_state_dict",
    "gather_state_dict",
    "set_parallel_attributes",
    "shard_optimizer_state_dict",
    "shard_state_dict",
    "shard_tensor",
    "unshard_tensor",
]

PARALLEL_MODES = ("column", "row", None)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One module's tensor-parallel settings, validated by :meth:`create`.

    ``mode``: "column", "row" or None. ``size``: number of shards. ``group``: the resolved
    ProcessGroup (None: no communication; ``size > 1`` without a group means the group is set
    later with ``set_tensor_parallel_group``). ``rank``: this rank in the group (0 without one).
    """

    mode: str | None = None
    sequence_parallel: bool = False
    size: int = 1
    group: Any = None
    rank: int = 0
    # Communicates: tensor-parallel with more than one rank (a field, not a property: forward
    # reads it on every call).
    active: bool = dataclasses.field(init=False, default=False)

    def __post_init__(self) -> None:
        owner = "TensorParallel"
        check_choice(owner, "mode", self.mode, PARALLEL_MODES)
        check_bool(owner, sequence_parallel=self.sequence_parallel)
        check_int(owner, size=self.size)
        check_int(owner, minimum=0, rank=self.rank)
        if not self.rank < self.size:
            raise ValueError(f"{owner}: rank must be < size ({self.size}), got {self.rank!r}")
        if self.group is not None and not (
            dist.is_available() and isinstance(self.group, dist.ProcessGroup)
        ):
            raise TypeError(
                f"{owner}: group must be a resolved torch.distributed.ProcessGroup or None "
                f"(TensorParallel.create resolves a DeviceMesh), got {self.group!r}"
            )
        object.__setattr__(self, "active", self.mode is not None and self.size > 1)

    # A ProcessGroup is a process-wide handle that cannot be pickled: a deep copy of a module
    # (EMA weights, ...) shares it (the settings are immutable), and a pickled module (torch.save
    # of a whole model) leaves it out; set it again with ``set_tensor_parallel_group``.
    def __deepcopy__(self, memo: dict) -> TensorParallel:
        return self

    def __getstate__(self) -> dict:
        return {**self.__dict__, "group": None}

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)

    @staticmethod
    def create(
        owner: str,
        parallel_mode: str | None,
        sequence_parallel: bool,
        tp_group: C.GroupLike,
        tp_size: int | None,
        modes: tuple[str | None, ...] = PARALLEL_MODES,
    ) -> TensorParallel:
        if parallel_mode not in modes:
            raise ValueError(
                f"{owner}: parallel_mode must be one of {modes}, got {parallel_mode!r}"
            )
        if not isinstance(sequence_parallel, bool):
            raise ValueError(
                f"{owner}: sequence_parallel must be a bool, got {sequence_parallel!r}"
            )
        if tp_size is not None and (
            isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1
        ):
            raise ValueError(f"{owner}: tp_size must be a positive int or None, got {tp_size!r}")
        group = C.resolve_group(tp_group, owner)
        size, rank = 1 if tp_size is None else tp_size, 0
        if group is not None:
            group_size = dist.get_world_size(group)
            if tp_size is not None and tp_size != group_size:
                raise ValueError(
                    f"{owner}: tp_size ({tp_size}) must equal the size of tp_group "
                    f"({group_size}); leave tp_size=None to take the group's size"
                )
            size, rank = group_size, dist.get_rank(group)
        if sequence_parallel:
            if parallel_mode is None:
                raise ValueError(
                    f"{owner}: sequence_parallel=True needs parallel_mode 'column' or 'row' "
                    "(it changes the collectives of a tensor-parallel layer)"
                )
            if group is None and size == 1:
                raise ValueError(
                    f"{owner}: sequence_parallel=True needs a tensor-parallel group: pass "
                    "tp_group (a ProcessGroup or DeviceMesh dim)"
                )
        if parallel_mode is None:
            # Not tensor-parallel: no shards and no communication, whatever the group.
            return TensorParallel()
        return TensorParallel(parallel_mode, sequence_parallel, size, group, rank)

    def with_group(self, owner: str, tp_group: C.GroupLike) -> TensorParallel:
        """The same settings with ``tp_group`` (its size must equal :attr:`size`)."""
        group = C.resolve_group(tp_group, owner)
        if group is None:
            raise ValueError(f"{owner}: set_tensor_parallel_group needs a group, got None")
        if dist.get_world_size(group) != self.size:
            raise ValueError(
                f"{owner}: the group's size ({dist.get_world_size(group)}) must equal the "
                f"tp_size the module was built with ({self.size})"
            )
        return dataclasses.replace(self, group=group, rank=dist.get_rank(group))

    def divide(self, owner: str, name: str, value: int, multiple: int = 1) -> int:
        """``value / size``, checking that the shard is a whole number of ``multiple``."""
        if value % (self.size * multiple):
            what = f"tp_size ({self.size})"
            if multiple > 1:
                what = f"tp_size * {multiple} ({self.size * multiple})"
            raise ValueError(
                f"{owner}: {name} ({value}) must be divisible by {what} with "
                f"parallel_mode={self.mode!r}"
            )
        return value // self.size

    def group_or_raise(self, owner: str) -> Any:
        if self.group is None:
            raise RuntimeError(
                f"{owner} was built with tp_size={self.size} and no tp_group: call "
                "module.set_tensor_parallel_group(group) before the forward"
            )
        return self.group

    # Communication around the GEMMs --------------------------------------------------------

    def column_input(self, owner: str, x: Tensor) -> Tensor:
        """A column-parallel GEMM's input: all-gathered along dim 0 with sequence parallelism,
        else replicated (its gradient all-reduced)."""
        if not self.active:
            return x
        group = self.group_or_raise(owner)
        if self.sequence_parallel:
            return C.all_gather(x, group, 0)
        return C.all_reduce_grad(x, group)

    def row_output(self, owner: str, y: Tensor) -> Tensor:
        """A row-parallel GEMM's partial output: reduce-scattered along dim 0 with sequence
        parallelism, else all-reduced."""
        if not self.active:
            return y
        group = self.group_or_raise(owner)
        if self.sequence_parallel:
            return C.reduce_scatter(y, group, 0)
        return C.all_reduce(y, group)

    def linear(
        self,
        owner: str,
        gemm: Callable[[Tensor, Tensor | None], Tensor],
        inp: Tensor,
        bias: Tensor | None,
        *,
        add_bias: bool = True,
        add: Callable[[Tensor, Tensor], Tensor] = torch.add,
    ) -> tuple[Tensor, Tensor | None]:
        """A GEMM with this module's tensor parallelism, the one place the choreography is
        written: ``gemm(inp, bias)`` runs the GEMM (any family op, any recipe).

        * column-parallel (or none): the input all-gathered along dim 0 with sequence
          parallelism, else replicated (its gradient all-reduced); the bias (this rank's shard)
          in the GEMM;
        * row-parallel: the GEMM without the bias, the partial outputs summed over the group
          (reduce-scattered along dim 0 with sequence parallelism), then the full bias added
          once (``add(out, bias)``; under sequence parallelism its gradient all-reduced).

        ``add_bias=False`` (a module's ``return_bias``): the bias is returned, not added.
        Returns ``(out, bias)``, the bias as such a module returns it. :meth:`pair` is the
        same for a column-parallel GEMM followed by a row-parallel one inside one op."""
        if self.active and self.mode == "row":
            return self._reduced(owner, gemm(inp, None), bias, add_bias, add)
        if self.mode == "column":
            inp = self.column_input(owner, inp)
        return gemm(inp, bias if add_bias else None), bias

    def pair(
        self,
        owner: str,
        block: Callable[[Tensor, Tensor | None], Tensor],
        inp: Tensor,
        bias: Tensor | None,
        *,
        add_bias: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """A column-parallel GEMM followed by a row-parallel one inside ``block(inp, bias)``
        (FC1 then FC2 of an MLP, ``bias`` the second's): the input gathered or replicated, the
        block's partial outputs reduced, the bias added once after the reduction."""
        inp = self.column_input(owner, inp)
        if not self.active:
            return block(inp, bias if add_bias else None), bias
        return self._reduced(owner, block(inp, None), bias, add_bias, torch.add)

    def _reduced(self, owner, partial, bias, add_bias, add) -> tuple[Tensor, Tensor | None]:
        out = self.row_output(owner, partial)
        bias = self.sequence_parallel_param(owner, bias)
        if add_bias and bias is not None:
            out = add(out, bias)
        return out, bias

    def sequence_parallel_param(self, owner: str, p: Tensor | None) -> Tensor | None:
        """A replicated parameter used on the sequence shard: its gradient is all-reduced."""
        if p is None or not (self.active and self.sequence_parallel):
            return p
        return C.all_reduce_grad(p, self.group_or_raise(owner))

    def describe(self) -> str:
        """For ``extra_repr``: empty when not tensor-parallel."""
        if self.mode is None:
            return ""
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f", parallel_mode={self.mode!r}, tp_size={self.size}{sp}"


def set_parallel_attributes(
    param: Tensor | None,
    partition_dim: int = -1,
    stride: int = 1,
    sequence_parallel: bool = False,
    parts: tuple[int, ...] | None = None,
) -> None:
    """Mark ``param`` as sharded along ``partition_dim`` (-1: replicated). ``parts``: the full
    sizes of named blocks along that dim, each sharded on its own (``parameters_split``: a
    rank's fused QKV weight is its query rows, then its key rows, then its value rows)."""
    owner = "set_parallel_attributes"
    if param is not None and not isinstance(param, Tensor):
        raise TypeError(f"{owner}: param must be a tensor (a parameter) or None, got {param!r}")
    _check_partition(owner, "param", param, partition_dim, stride)
    check_bool(owner, sequence_parallel=sequence_parallel)
    _check_parts(owner, parts)
    if param is None:
        return
    param.tensor_model_parallel = partition_dim >= 0
    param.partition_dim = partition_dim
    param.partition_stride = stride
    param.partition_parts = parts
    param.sequence_parallel = sequence_parallel


def _check_partition(
    owner: str, name: str, t: Tensor | None, partition_dim: object, stride: object
) -> None:
    """``partition_dim`` -1 (replicated) or a dim of ``t`` (named ``name``); ``stride`` >= 1."""
    check_int(owner, minimum=-1, partition_dim=partition_dim)
    if t is not None and not partition_dim < t.dim():
        raise ValueError(
            f"{owner}: partition_dim must be -1 (replicated) or a dim of {name} (< {t.dim()}), "
            f"got {partition_dim!r}"
        )
    check_int(owner, stride=stride)


def _check_parts(owner: str, parts: object, total: int | None = None) -> None:
    """``parts`` None, or a sequence of ints > 0 (summing to ``total`` where given)."""
    if parts is None:
        return
    if not isinstance(parts, (tuple, list)) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in parts
    ):
        raise ValueError(f"{owner}: parts must be None or a tuple of ints > 0, got {parts!r}")
    if total is not None and sum(parts) != total:
        raise ValueError(
            f"{owner}: parts must sum to the full size along partition_dim ({total}), got {parts!r}"
        )


def shard_tensor(
    full: Tensor,
    partition_dim: int,
    stride: int,
    rank: int,
    size: int,
    parts: tuple[int, ...] | None = None,
) -> Tensor:
    """Rank ``rank``'s shard of ``full`` along ``partition_dim`` (see ``partition_stride`` in
    the module docstring): chunks ``rank, rank + size, ...`` of ``size * stride`` chunks; with
    ``parts`` (full block sizes along the dim), each block's shard, concatenated."""
    owner = "shard_tensor"
    if not isinstance(full, Tensor):
        raise TypeError(f"{owner}: full must be a torch.Tensor, got {type(full).__name__}")
    _check_partition(owner, "full", full, partition_dim, stride)
    check_int(owner, size=size)
    check_int(owner, minimum=0, rank=rank)
    if not rank < size:
        raise ValueError(f"{owner}: rank must be < size ({size}), got {rank!r}")
    _check_parts(owner, parts, full.shape[partition_dim] if partition_dim >= 0 else None)
    if partition_dim < 0:
        return full
    if parts:
        blocks = full.split(list(parts), dim=partition_dim)
        return torch.cat([shard_tensor(b, partition_dim, stride, rank, size) for b in blocks],
                         dim=partition_dim)  # fmt: skip
    chunks = full.chunk(size * stride, dim=partition_dim)
    if len(chunks) != size * stride or full.shape[partition_dim] % (size * stride):
        raise ValueError(
            f"shard_tensor: full's dim {partition_dim} ({full.shape[partition_dim]}) does not "
            f"split into {size * stride} equal chunks (size * stride)"
        )
    return torch.cat(chunks[rank::size], dim=partition_dim)


def _sharded_entries(module: nn.Module, slices: bool = True) -> dict[str, tuple]:
    """``{key: (tp, partition_dim, partition_stride, parts)}`` for every tensor-parallel shard of
    ``module``'s state: its sharded parameters by name and, with ``slices``, the named blocks of
    ``parameters_split`` (state_dict keys of their own, each sharded alone)."""
    out: dict[str, tuple] = {}
    for mod_name, sub in module.named_modules():
        tp = getattr(sub, "tp", None)
        if not isinstance(tp, TensorParallel):
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in sub.named_parameters(recurse=False):
            if getattr(p, "tensor_model_parallel", False):
                parts = getattr(p, "partition_parts", None)
                out[prefix + name] = (tp, p.partition_dim, p.partition_stride, parts)
        for name, (kind, _start, _rows) in getattr(sub, "_slices", {}).items() if slices else ():
            whole = getattr(sub, kind)
            if getattr(whole, "tensor_model_parallel", False):
                out[prefix + name] = (tp, whole.partition_dim, 1, None)
    return out


def _check_state(owner: str, module: object, name: str, state: object, optim: bool) -> None:
    """``module`` an nn.Module; ``state`` (argument ``name``) a dict: a state_dict, or with
    ``optim`` an optimizer state dict holding a ``"state"`` dict."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{owner}: module must be an nn.Module, got {module!r}")
    if not isinstance(state, dict):
        raise TypeError(f"{owner}: {name} must be a dict, got {state!r}")
    if optim and not isinstance(state.get("state"), dict):
        raise ValueError(
            f"{owner}: {name} must be an optimizer state dict with a 'state' dict of "
            f"per-parameter states (get_state_dict's form), got {state!r}"
        )


def shard_state_dict(module: nn.Module, full_state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Cut ``full_state_dict`` (of the same model built without tensor parallelism) into this
    rank's state_dict for ``module``, following each parameter's ``partition_dim`` and
    ``partition_stride``. Entries that are not sharded parameters are passed through."""
    _check_state("shard_state_dict", module, "full_state_dict", full_state_dict, False)
    out = dict(full_state_dict)
    for key, (tp, dim, stride, parts) in _sharded_entries(module).items():
        if key in out:
            out[key] = shard_tensor(out[key], dim, stride, tp.rank, tp.size, parts)
    return out


def unshard_tensor(
    pieces: list[Tensor], partition_dim: int, stride: int, parts: tuple[int, ...] | None = None
) -> Tensor:
    """The full tensor of every rank's shard (``pieces``, in rank order): the inverse of
    :func:`shard_tensor`; ``partition_dim`` -1: replicated, every piece is the full tensor."""
    owner = "unshard_tensor"
    if (
        not isinstance(pieces, (list, tuple))
        or not pieces
        or not all(isinstance(p, Tensor) for p in pieces)
    ):
        raise TypeError(f"{owner}: pieces must be a non-empty list of tensors, got {pieces!r}")
    if any(p.shape != pieces[0].shape for p in pieces):
        shapes = [list(p.shape) for p in pieces]
        raise ValueError(f"{owner}: pieces must all have the same shape, got {shapes}")
    _check_partition(owner, "pieces", pieces[0], partition_dim, stride)
    size = len(pieces)
    if partition_dim < 0:
        return pieces[0]
    if pieces[0].shape[partition_dim] % stride:
        raise ValueError(
            f"{owner}: a piece's dim {partition_dim} ({pieces[0].shape[partition_dim]}) must "
            f"split into stride ({stride}) equal chunks"
        )
    _check_parts(owner, parts, pieces[0].shape[partition_dim] * size)
    if parts and any(n % size for n in parts):
        raise ValueError(
            f"{owner}: parts must be divisible by the number of pieces ({size}), got {parts!r}"
        )
    if parts:
        split = [p.split([n // size for n in parts], dim=partition_dim) for p in pieces]
        blocks = [unshard_tensor([s[i] for s in split], partition_dim, stride)
                  for i in range(len(parts))]  # fmt: skip
        return torch.cat(blocks, dim=partition_dim)
    chunks = [p.chunk(stride, dim=partition_dim) for p in pieces]
    # Rank r holds chunks r, r + size, ...: full chunk j is rank j % size's chunk j // size.
    full = [chunks[j % size][j // size] for j in range(size * stride)]
    return torch.cat(full, dim=partition_dim)


def _gather(local: Tensor, tp: TensorParallel, dim: int, stride: int, parts) -> Tensor:
    if tp.size == 1:
        return local
    if tp.group is None:
        raise ValueError(
            "gather_state_dict: a module has tp_size > 1 and no tp_group; set it with "
            "set_tensor_parallel_group before gathering its state"
        )
    pieces = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(pieces, local.contiguous(), group=tp.group)
    return unshard_tensor(pieces, dim, stride, parts)


def gather_state_dict(
    module: nn.Module, state_dict: dict[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """The single-process state_dict of a tensor-parallel ``module``: every shard of
    ``state_dict`` (default ``module.state_dict()``) all-gathered over its group into the full
    tensor, the other entries as they are (the inverse of :func:`shard_state_dict`). Call it on
    every rank of the group (a collective). This is the state to give
    ``torch.distributed.checkpoint`` (or ``torch.save`` on one rank): a rank's shard is a plain
    tensor that ``torch.distributed.checkpoint`` would take for a replica of the other ranks'
    (and keep only one), while the full tensors are replicas indeed; load them back with
    ``module.load_state_dict(shard_state_dict(module, full))``."""
    if state_dict is None:
        _check_state("gather_state_dict", module, "state_dict", {}, False)
        state = module.state_dict()
    else:
        _check_state("gather_state_dict", module, "state_dict", state_dict, False)
        state = dict(state_dict)
    for key, (tp, dim, stride, parts) in _sharded_entries(module).items():
        if key in state:
            state[key] = _gather(state[key], tp, dim, stride, parts)
    for key, group in _rank_grad_amaxes(module).items():
        if key in state:
            state[key] = C.all_reduce_max(state[key], group)
    return state


def _rank_grad_amaxes(module: nn.Module) -> dict[str, Any]:
    """``{state_dict key: group}`` of the FP8 gradient amaxes that differ per rank: a
    tensor-parallel GEMM's ``grad_amax`` holds the amax of this rank's output gradient (a column
    shard of it under column parallelism), max-reduced only when the next forward folds it into
    the history. A checkpoint keeps one rank's copy of a replicated entry, so the gathered state
    holds the max over the group, the value that forward would fold in (the amax reduction
    group contains the tensor-parallel group)."""
    out: dict[str, Any] = {}
    for mod_name, sub in module.named_modules():
        tp = getattr(sub, "tp", None)
        if not isinstance(tp, TensorParallel) or not tp.active:
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for name, _ in sub.named_buffers():
            if name == "grad_amax" or name.endswith(".grad_amax"):
                out[prefix + name] = tp.group
    return out


def _optimizer_entries(module: nn.Module) -> tuple[dict[str, tuple], dict[str, torch.Size]]:
    """The sharded parameters by name, and every parameter's (local) shape."""
    shapes = {name: p.shape for name, p in module.named_parameters()}
    return _sharded_entries(module, slices=False), shapes


def gather_optimizer_state_dict(module: nn.Module, optim_state_dict: dict) -> dict:
    """:func:`gather_state_dict` for an optimizer's state in the form
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns (``{"state": {parameter
    name: {...}}, "param_groups": ...}``): each state tensor of a sharded parameter's shape
    (Adam's moments, ...) all-gathered into the full tensor; scalars (``step``) as they are."""
    _check_state("gather_optimizer_state_dict", module, "optim_state_dict", optim_state_dict, True)
    entries, shapes = _optimizer_entries(module)
    state = {}
    for name, per_param in optim_state_dict["state"].items():
        if name not in entries:
            state[name] = per_param
            continue
        tp, dim, stride, parts = entries[name]
        state[name] = {
            k: _gather(v, tp, dim, stride, parts)
            if isinstance(v, Tensor) and v.shape == shapes[name] else v
            for k, v in per_param.items()
        }  # fmt: skip
    return {**optim_state_dict, "state": state}


def shard_optimizer_state_dict(module: nn.Module, full_optim_state_dict: dict) -> dict:
    """This rank's part of an optimizer state gathered by :func:`gather_optimizer_state_dict`
    (for ``torch.distributed.checkpoint.state_dict.set_state_dict``)."""
    _check_state(
        "shard_optimizer_state_dict", module, "full_optim_state_dict", full_optim_state_dict, True
    )
    entries, shapes = _optimizer_entries(module)
    state = {}
    for name, per_param in full_optim_state_dict["state"].items():
        if name not in entries:
            state[name] = per_param
            continue
        tp, dim, stride, parts = entries[name]
        full_shape = list(shapes[name])
        if dim >= 0:
            full_shape[dim] *= tp.size
        state[name] = {
            k: shard_tensor(v, dim, stride, tp.rank, tp.size, parts)
            if isinstance(v, Tensor) and list(v.shape) == full_shape else v
            for k, v in per_param.items()
        }  # fmt: skip
    return {**full_optim_state_dict, "state": state}
