r"""Mixture-of-experts token routing: Transformer Engine's ``moe_permute``, ``moe_unpermute``,
``moe_permute_with_probs`` and ``moe_sort_chunks_by_index`` (``_with_probs``), as
``te::moe_permute_fwd/_bwd``, ``te::moe_unpermute_fwd/_bwd`` and ``te::moe_sort_chunks_fwd/_bwd``.
``docs/moe.md`` gives their semantics and what the compiler sees. ``row_id_map`` is one internal
layout for both map types: ``[T, S]`` int32 (``S = E`` for the mask, ``K`` for indices), the
permuted row of token ``t``'s slot ``s`` or -1. The unpermute is ``out[t] = sum_s p[t, s] *
inp[row_id_map[t, s]]`` (fp32 sums, rounded once); without probabilities it is the adjoint of the
permute, and the backward of each is the other. Nothing is read on the host (every data-dependent
size is an argument). The row movement: on CUDA one Triton kernel (``kernels.moe.gather_sum``), on
CPU the same math in torch. Argument checks: ``moe_args.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from te_compile._checks import check_choice
from te_compile._library import differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.functional.moe_args import (
    MAP_TYPES,
    check_permute_args,
    check_sort_chunks_args,
    check_tensor_args,
    check_unpermute_args,
    fail,
    int_arg,
    num_out,
)
from te_compile.kernels import runs_triton, submodule

__all__ = [
    "moe_permute",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
]


# A row mover: ``(x, index, weight) -> rows``, the torch one (``*_ref``) or the Triton one.
Mover = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]


# 1. Reference math ------------------------------------------------------------------------------


def make_row_id_map(routing_map: Tensor, num_out_tokens: int, map_type: str) -> Tensor:
    """``[T, S]`` int32: the permuted row of each (token, slot), -1 where not routed or past
    ``num_out_tokens`` (see the module docstring). Device ops only: no host sync."""
    tokens, slots = routing_map.shape
    if map_type == "mask":
        routed = routing_map != 0
        # Expert-major order: rows of expert e start after every token of experts < e.
        flat = routed.to(torch.int64).t().reshape(-1).cumsum(0).view(slots, tokens).t()
        dest = torch.where(routed, flat - 1, -1)
    else:
        order = torch.argsort(routing_map.reshape(-1).to(torch.int64), stable=True)
        dest = torch.empty_like(order)
        dest[order] = torch.arange(order.numel(), device=order.device)
        dest = dest.view(tokens, slots)
    return torch.where(dest < num_out_tokens, dest, -1).to(torch.int32)


def inverse_map(row_id_map: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """For each of ``rows`` permuted rows: its token and its slot's flat index ``t * S + s`` in the
    map (int64), -1 for a row no slot points at. Each row is pointed at by at most one slot."""
    tokens, slots = row_id_map.shape
    dest = row_id_map.reshape(-1).to(torch.int64)
    where = torch.where(dest >= 0, dest, rows)  # a spare row takes the empty slots
    flat = torch.full((rows + 1,), -1, dtype=torch.int64, device=row_id_map.device)
    flat[where] = torch.arange(tokens * slots, device=row_id_map.device)
    flat = flat[:rows]
    return torch.where(flat >= 0, flat // max(slots, 1), -1), flat


def _pick(values: Tensor, index: Tensor) -> Tensor:
    """``values.flatten()[index]``, 0 where ``index < 0``, in ``values``' dtype."""
    return torch.where(index >= 0, values.reshape(-1)[index.clamp(min=0)], 0).to(values.dtype)


def _gather_ref(x: Tensor, index: Tensor, weight: Tensor | None) -> Tensor:
    """``out[r] = weight[r] * x[index[r]]`` (0 where ``index[r] < 0``), in fp32, rounded once."""
    acc = acc_dtype(x)
    ok = index >= 0
    w = ok.to(acc) if weight is None else torch.where(ok, weight.to(acc), 0.0)
    return (x.to(acc)[index.clamp(min=0)] * w[:, None]).to(x.dtype)


def moe_unpermute_ref(x: Tensor, row_id_map: Tensor, weight: Tensor | None) -> Tensor:
    """``[T, H]``: ``out[t] = sum_s weight[t, s] * x[row_id_map[t, s]]`` (the routed slots), in
    fp32, rounded once; through the inverse map, one ``index_add_`` of the rows of ``x``.
    Differentiable."""
    tokens = row_id_map.shape[0]
    token, flat = inverse_map(row_id_map, x.shape[0])
    xs = x.to(acc_dtype(x))
    if weight is not None:
        xs = xs * _pick(weight.to(xs.dtype), flat)[:, None]
    out = xs.new_zeros((tokens + 1, x.shape[1]))
    out = out.index_add(0, torch.where(token >= 0, token, tokens), xs)
    return out[:tokens].to(x.dtype)


def _empty_probs(like: Tensor, probs: Tensor | None) -> Tensor:
    """The probabilities' slot of a result: 0 elements without ``probs``, else like it."""
    return like.new_empty((0,)) if probs is None else torch.empty_like(probs)


def _pad_mask(probs: Tensor | None) -> Tensor | None:
    """The permute's row weights: 0 for a padding slot (probability 0), else 1."""
    return None if probs is None else (probs != 0).to(acc_dtype(probs))


def moe_permute_ref(
    inp: Tensor,
    routing_map: Tensor,
    probs: Tensor | None,
    num_out_tokens: int,
    map_type: str,
    *,
    gather: Mover = _gather_ref,
) -> tuple[Tensor, Tensor, Tensor]:
    """Permuted tokens ``[num_out_tokens, H]``, the row_id_map and the permuted probabilities
    (``[num_out_tokens]``, 0 elements without ``probs``). Differentiable by autograd. (The ops
    pass ``gather``: the Triton kernel on CUDA.)"""
    row_id_map = make_row_id_map(routing_map, num_out_tokens, map_type)
    token, flat = inverse_map(row_id_map, num_out_tokens)
    if probs is None:
        return gather(inp, token, None), row_id_map, inp.new_empty((0,))
    return gather(inp, token, _pick(_pad_mask(probs), flat)), row_id_map, _pick(probs, flat)


def moe_permute_bwd_ref(
    grad: Tensor,
    grad_probs: Tensor | None,
    row_id_map: Tensor,
    probs: Tensor | None,
    *,
    combine: Mover = moe_unpermute_ref,
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`moe_permute_ref` for ``inp`` and ``probs`` (0 elements without):
    each routed slot of ``probs`` reads its row's gradient."""
    grad_inp = combine(grad, row_id_map, _pad_mask(probs))
    if probs is None:
        return grad_inp, grad.new_empty((0,))
    if grad_probs is None:
        return grad_inp, torch.zeros_like(probs)
    return grad_inp, _pick(grad_probs, row_id_map.to(torch.int64)).to(probs.dtype)


def _gather_dot_ref(
    grad: Tensor, token: Tensor, weight: Tensor, inp: Tensor
) -> tuple[Tensor, Tensor]:
    """``(weight[r] * grad[token[r]], <grad[token[r]], inp[r]>)`` (fp32 dots; the dot of a row
    with no token is not read)."""
    acc = acc_dtype(grad)
    dots = (grad.to(acc)[token.clamp(min=0)] * inp.to(acc)).sum(-1)
    return _gather_ref(grad, token, weight), dots


def moe_unpermute_bwd_ref(
    grad: Tensor,
    inp: Tensor | None,
    row_id_map: Tensor,
    merging_probs: Tensor | None,
    rows: int,
    *,
    gather: Mover = _gather_ref,
    gather_dot: Callable[..., tuple[Tensor, Tensor]] = _gather_dot_ref,
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`moe_unpermute_ref` for ``inp [rows, H]`` and ``merging_probs``:
    ``d inp[r] = p[t, s] * grad[t]`` for the slot ``(t, s)`` of row ``r``, and
    ``d p[t, s] = <grad[t], inp[row_id_map[t, s]]>`` (fp32 dots)."""
    token, flat = inverse_map(row_id_map, rows)
    weight = None if merging_probs is None else _pick(merging_probs, flat)
    if merging_probs is None or inp is None:
        return gather(grad, token, weight), grad.new_empty((0,))
    grad_inp, dots = gather_dot(grad, token, weight, inp)
    # Each row's dot to its slot; the rows with no slot to a spare element.
    n = merging_probs.numel()
    grad_p = dots.new_zeros((n + 1,)).index_put((torch.where(flat >= 0, flat, n),), dots)
    return grad_inp, grad_p[:n].view_as(merging_probs).to(merging_probs.dtype)


def chunk_sort_map(split_sizes: Tensor, sorted_index: Tensor, rows: int) -> Tensor:
    """``[rows]`` int64: the input row each output row of the chunk sort reads (-1 where that
    row would lie past ``rows``). Device ops only."""
    sizes, order = split_sizes.to(torch.int64), sorted_index.to(torch.int64)
    in_start = sizes.cumsum(0) - sizes
    out_sizes = sizes[order]
    out_end = out_sizes.cumsum(0)
    j = torch.arange(rows, device=sizes.device)
    q = torch.searchsorted(out_end, j, right=True)  # the output chunk of row j
    qc = q.clamp(max=sizes.numel() - 1)
    src = in_start[order[qc]] + j - (out_end[qc] - out_sizes[qc])
    src = torch.where(q < sizes.numel(), src, j)  # rows past the chunks keep their place
    return torch.where(src < rows, src, -1)


def _move_rows(x: Tensor, probs: Tensor | None, index: Tensor, gather: Mover):
    """Rows ``x[index]`` and entries ``probs[index]`` (0 elements without), 0 where
    ``index < 0``."""
    return gather(x, index, None), (x.new_empty((0,)) if probs is None else _pick(probs, index))


def moe_sort_chunks_ref(
    inp: Tensor,
    split_sizes: Tensor,
    sorted_index: Tensor,
    probs: Tensor | None,
    *,
    gather: Mover = _gather_ref,
) -> tuple[Tensor, Tensor]:
    """The chunks of ``inp`` (and ``probs``) in the order ``sorted_index``; probabilities 0
    elements without ``probs``. Differentiable by autograd."""
    return _move_rows(inp, probs, chunk_sort_map(split_sizes, sorted_index, inp.shape[0]), gather)


_kernels = functools.partial(submodule, "moe")  # Triton: imported on first CUDA use


def _gather(x: Tensor, index: Tensor, weight: Tensor | None) -> Tensor:
    """:func:`_gather_ref` with the Triton kernel on CUDA."""
    if not runs_triton(x):
        return _gather_ref(x, index, weight)
    w = None if weight is None else weight.to(torch.float32)[:, None]
    return _kernels().gather_sum(x, index.to(torch.int32)[:, None], w)


# Maps wider than this many slots (a mask's [T, E]) are compacted before the kernel.
_COMPACT_SLOTS = 4


def _compact(row_id_map: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor]:
    """A sparse ``[T, S]`` map with each token's routed slots moved to its first columns, in
    slot order (the same sum, in the same order), their weights along, and the routed count of
    each token: the kernel then reads a token's routed slots only. Device ops, no host sync."""
    tokens, slots = row_id_map.shape
    routed = row_id_map >= 0
    # Routed slots to their rank among the token's routed slots; the rest to a spare column.
    col = torch.where(routed, routed.to(torch.int32).cumsum(1) - 1, slots).to(torch.int64)
    index = row_id_map.new_full((tokens, slots + 1), -1).scatter(1, col, row_id_map)
    w = None
    if weight is not None:
        w = weight.new_zeros((tokens, slots + 1)).scatter(1, col, torch.where(routed, weight, 0))
    return index[:, :slots], w if w is None else w[:, :slots], routed.sum(1, dtype=torch.int32)


def _gather_dot(grad: Tensor, token: Tensor, weight: Tensor, inp: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_gather_dot_ref` with the Triton kernel on CUDA (one read of each row)."""
    if not runs_triton(grad):
        return _gather_dot_ref(grad, token, weight, inp)
    return _kernels().gather_dot(grad, token.to(torch.int32), weight.to(torch.float32), inp)


def _combine(x: Tensor, row_id_map: Tensor, weight: Tensor | None) -> Tensor:
    """:func:`moe_unpermute_ref` with the Triton kernel on CUDA."""
    if not runs_triton(x):
        return moe_unpermute_ref(x, row_id_map, weight)
    w = None if weight is None else weight.to(torch.float32)
    narrow = row_id_map.shape[1] <= _COMPACT_SLOTS
    return _kernels().gather_sum(x, *((row_id_map, w) if narrow else _compact(row_id_map, w)))


# 2-5. Permute: forward op, fake, backward op, autograd -----------------------------------------


@op("moe_permute_fwd")
def moe_permute_fwd(
    inp: Tensor, routing_map: Tensor, probs: Tensor | None, num_out_tokens: int, map_type: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Tokens grouped by expert, the row_id_map, the permuted probabilities (0 elements
    without ``probs``)."""
    check_permute_args(inp, routing_map, probs, num_out_tokens, map_type)
    return moe_permute_ref(inp, routing_map, probs, num_out_tokens, map_type, gather=_gather)


@moe_permute_fwd.register_fake
def _moe_permute_fwd_fake(inp, routing_map, probs, num_out_tokens, map_type):
    check_permute_args(inp, routing_map, probs, num_out_tokens, map_type)
    row_id_map = routing_map.new_empty(routing_map.shape, dtype=torch.int32)
    permuted = inp.new_empty((0,)) if probs is None else probs.new_empty((num_out_tokens,))
    return inp.new_empty((num_out_tokens, inp.shape[1])), row_id_map, permuted


@op("moe_permute_bwd")
def moe_permute_bwd(
    grad: Tensor, grad_probs: Tensor | None, row_id_map: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Gradients of ``te::moe_permute_fwd`` for ``inp`` (each token's rows summed) and
    ``probs`` (0 elements without)."""
    return moe_permute_bwd_ref(grad, grad_probs, row_id_map, probs, combine=_combine)


@moe_permute_bwd.register_fake
def _moe_permute_bwd_fake(grad, grad_probs, row_id_map, probs):
    return grad.new_empty((row_id_map.shape[0], grad.shape[1])), _empty_probs(grad, probs)


def _permute_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1], inputs[2])  # row_id_map, probs


def _permute_backward(ctx, bwd, grad, _grad_map, grad_probs):
    row_id_map, probs = ctx.saved_tensors
    grad_probs = grad_probs if grad_probs is not None and grad_probs.numel() else None
    grad_inp, grad_p = bwd(grad, grad_probs, row_id_map, probs)
    return grad_inp, None, (grad_p if probs is not None else None), None, None


_moe_permute = differentiable(
    moe_permute_fwd,
    moe_permute_bwd,
    setup_context=_permute_setup,
    backward=_permute_backward,
    reference=moe_permute_ref,
    autocast=False,
)


# 2-5. Unpermute -----------------------------------------------------------------------------------


@op("moe_unpermute_fwd")
def moe_unpermute_fwd(inp: Tensor, row_id_map: Tensor, merging_probs: Tensor | None) -> Tensor:
    """Each token's permuted rows summed, weighted by ``merging_probs``."""
    check_unpermute_args(inp, row_id_map, merging_probs)
    return _combine(inp, row_id_map, merging_probs)


@moe_unpermute_fwd.register_fake
def _moe_unpermute_fwd_fake(inp, row_id_map, merging_probs):
    check_unpermute_args(inp, row_id_map, merging_probs)
    return inp.new_empty((row_id_map.shape[0], inp.shape[1]))


@op("moe_unpermute_bwd")
def moe_unpermute_bwd(
    grad: Tensor, inp: Tensor | None, row_id_map: Tensor, merging_probs: Tensor | None, rows: int
) -> tuple[Tensor, Tensor]:
    """Gradients of ``te::moe_unpermute_fwd`` for ``inp`` and ``merging_probs`` (0 elements
    without)."""
    return moe_unpermute_bwd_ref(
        grad, inp, row_id_map, merging_probs, rows, gather=_gather, gather_dot=_gather_dot
    )


@moe_unpermute_bwd.register_fake
def _moe_unpermute_bwd_fake(grad, inp, row_id_map, merging_probs, rows):
    probs = None if inp is None else merging_probs
    return grad.new_empty((rows, grad.shape[1])), _empty_probs(grad, probs)


def _unpermute_setup(ctx, inputs, output) -> None:
    inp, row_id_map, merging_probs = inputs
    # The forward input is needed only for the probabilities' gradient.
    ctx.save_for_backward(inp if merging_probs is not None else None, row_id_map, merging_probs)
    ctx.rows = inp.shape[0]


def _unpermute_backward(ctx, bwd, grad):
    inp, row_id_map, merging_probs = ctx.saved_tensors
    grad_inp, grad_p = bwd(grad, inp, row_id_map, merging_probs, ctx.rows)
    return grad_inp, None, (grad_p if merging_probs is not None else None)


_moe_unpermute = differentiable(
    moe_unpermute_fwd,
    moe_unpermute_bwd,
    setup_context=_unpermute_setup,
    backward=_unpermute_backward,
    reference=moe_unpermute_ref,
    autocast=False,
)


# 2-5. Chunk sort ----------------------------------------------------------------------------------


@op("moe_sort_chunks_fwd")
def moe_sort_chunks_fwd(
    inp: Tensor, split_sizes: Tensor, sorted_index: Tensor, probs: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The chunks of ``inp`` (and ``probs``, 0 elements without) in ``sorted_index`` order."""
    check_sort_chunks_args(inp, split_sizes, sorted_index, probs)
    return moe_sort_chunks_ref(inp, split_sizes, sorted_index, probs, gather=_gather)


@moe_sort_chunks_fwd.register_fake
def _moe_sort_chunks_fwd_fake(inp, split_sizes, sorted_index, probs):
    check_sort_chunks_args(inp, split_sizes, sorted_index, probs)
    return torch.empty_like(inp), _empty_probs(inp, probs)


@op("moe_sort_chunks_bwd")
def moe_sort_chunks_bwd(
    grad: Tensor, grad_probs: Tensor | None, split_sizes: Tensor, sorted_index: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients of ``te::moe_sort_chunks_fwd``: the inverse row permutation of ``grad`` (and
    of ``grad_probs``, 0 elements without)."""
    src = chunk_sort_map(split_sizes, sorted_index, grad.shape[0])
    dest = inverse_map(src[:, None], grad.shape[0])[0]  # dest[src[j]] = j, -1 where none reads
    return _move_rows(grad, grad_probs, dest, _gather)


@moe_sort_chunks_bwd.register_fake
def _moe_sort_chunks_bwd_fake(grad, grad_probs, split_sizes, sorted_index):
    return torch.empty_like(grad), _empty_probs(grad, grad_probs)


def _sort_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])  # split_sizes, sorted_index


def _sort_backward(ctx, bwd, grad, grad_probs):
    # Without probs the probabilities' output has 0 elements: its gradient too, or None.
    grad_probs = grad_probs if grad_probs is not None and grad_probs.numel() else None
    grad_inp, grad_p = bwd(grad, grad_probs, *ctx.saved_tensors)
    return grad_inp, None, None, (grad_p if grad_probs is not None else None)


_moe_sort_chunks = differentiable(
    moe_sort_chunks_fwd,
    moe_sort_chunks_bwd,
    setup_context=_sort_setup,
    backward=_sort_backward,
    reference=moe_sort_chunks_ref,
    autocast=False,
)


# Public functions ---------------------------------------------------------------------------------


def moe_permute(
    inp: Tensor,
    routing_map: Tensor,
    num_out_tokens: int | None = -1,
    max_token_num: int | None = -1,
    map_type: str = "mask",
) -> tuple[Tensor, Tensor]:
    """Tokens grouped by expert (Transformer Engine's ``moe_permute``): ``(permuted [n, H],
    row_id_map)``. ``routing_map``: ``[T, E]`` mask (``map_type="mask"``) or ``[T, K]`` expert
    indices (``"index"``). ``num_out_tokens``: the output rows; required for the mask, and for
    indices ``T * K`` when not positive (the default); fewer drops the last rows. ``max_token_num``
    (a workspace size in Transformer Engine) is accepted and unused. See the module docstring."""
    prefix = "te.moe_permute"
    check_tensor_args(prefix, inp=inp, routing_map=routing_map)
    int_arg(prefix, "max_token_num", max_token_num)
    n = num_out(prefix, routing_map, num_out_tokens, map_type)
    return _moe_permute(inp, routing_map, None, n, map_type)[:2]  # (out, row_id_map)


def moe_permute_with_probs(
    inp: Tensor, probs: Tensor, routing_map: Tensor, num_out_tokens: int | None = -1
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`moe_permute` for a mask ``routing_map [T, E]`` that also permutes ``probs
    [T, E]``: ``(permuted, permuted_probs [n], row_id_map)``; a routed slot of probability 0
    (padding) gives a zero row."""
    prefix = "te.moe_permute_with_probs"
    check_tensor_args(prefix, inp=inp, probs=probs, routing_map=routing_map)
    n = num_out(prefix, routing_map, num_out_tokens, "mask")
    check_permute_args(inp, routing_map, probs, n, "mask", prefix)
    out, row_id_map, permuted_probs = _moe_permute(inp, routing_map, probs, n, "mask")
    return out, permuted_probs, row_id_map


def moe_unpermute(
    inp: Tensor,
    row_id_map: Tensor,
    merging_probs: Tensor | None = None,
    restore_shape: torch.Size | tuple[int, ...] | None = None,
    map_type: str = "mask",
    probs: Tensor | None = None,
) -> Tensor:
    """The inverse of :func:`moe_permute` (Transformer Engine's ``moe_unpermute``): each token's
    rows summed, weighted by ``merging_probs`` (``[T, E]`` for the mask, ``[T, K]`` for
    indices) when given. ``restore_shape``: the output shape, ``(T, H)``. ``probs``: the old
    name of ``merging_probs``."""
    prefix = "te.moe_unpermute"
    check_tensor_args(
        prefix, ("merging_probs", "probs"), inp=inp, row_id_map=row_id_map,
        merging_probs=merging_probs, probs=probs)  # fmt: skip
    if restore_shape is not None and not (
        isinstance(restore_shape, (tuple, list, torch.Size))
        and all(isinstance(d, (int, torch.SymInt)) for d in restore_shape)
    ):
        fail(prefix, f"restore_shape must be None or a tuple of ints, got {restore_shape!r}")
    if probs is not None:
        if merging_probs is not None:
            fail(prefix, "give merging_probs or its old name probs, not both")
        merging_probs = probs
    check_choice(prefix, "map_type", map_type, MAP_TYPES)
    check_unpermute_args(inp, row_id_map, merging_probs, prefix)
    shape = (row_id_map.shape[0], inp.shape[1])
    if restore_shape is not None and tuple(restore_shape) != shape:
        fail(
            prefix,
            f"restore_shape must be (num_tokens, hidden) = {shape} for this row_id_map, got "
            f"{tuple(restore_shape)}",
        )
    return _moe_unpermute(inp, row_id_map, merging_probs)


def moe_sort_chunks_by_index(inp: Tensor, split_sizes: Tensor, sorted_index: Tensor) -> Tensor:
    """``inp`` cut into chunks of ``split_sizes`` rows, reordered as ``sorted_index`` lists
    them (Transformer Engine's ``moe_sort_chunks_by_index``)."""
    check_tensor_args(
        "te.moe_sort_chunks_by_index", inp=inp, split_sizes=split_sizes, sorted_index=sorted_index
    )
    return _moe_sort_chunks(inp, split_sizes, sorted_index, None)[0]


def moe_sort_chunks_by_index_with_probs(
    inp: Tensor, probs: Tensor, split_sizes: Tensor, sorted_index: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`moe_sort_chunks_by_index` that moves ``probs [N]`` along: ``(out, probs)``."""
    prefix = "te.moe_sort_chunks_by_index_with_probs"
    check_tensor_args(
        prefix, inp=inp, probs=probs, split_sizes=split_sizes, sorted_index=sorted_index
    )
    check_sort_chunks_args(inp, split_sizes, sorted_index, probs, prefix)
    return _moe_sort_chunks(inp, split_sizes, sorted_index, probs)
