r"""Triton kernel for mixture-of-experts token routing (``te_compile.functional.moe``).

Every data movement of the family is one weighted row gather:

.. math::
    \mathrm{out}_r = \sum_{s < S,\ i_{r,s} \ge 0} w_{r,s}\, x_{i_{r,s}}

with ``index [R, S]`` (int32, ``-1`` for an empty slot) and optional fp32 weights ``[R, S]``:

* permute (and the chunk sort): ``S = 1``, ``index`` the source row of each output row, weights
  the padding mask of ``moe_permute_with_probs`` (a slot whose probability is 0 is written as 0);
* unpermute (and the permute's backward): ``index = row_id_map [T, S]``, each token summing its
  expert rows, weighted by ``merging_probs``;
* unpermute's backward: ``S = 1`` again, each permuted row reading its token's gradient; with
  merging probabilities one pass also takes each row's dot product with the forward's input
  (the probabilities' gradient), :func:`gather_dot`.

A program owns one output row and ``BLOCK_H`` channels and walks the row's slots (the first
``count[r]`` of them where counts are given: a sparse map compacted, slots routed first, so that
a row of a ``[T, 64]`` expert mask reads its two slots, not 64); every output
element is written exactly once (no atomics, no zero-fill), so the result does not depend on the
order programs run in. Empty slots are masked loads, not branches. Sums are in fp32, rounded once
to ``x``'s dtype. bf16 crosses the kernel as int16 bits under ``TRITON_INTERPRET=1``
(``kernels.bf16_bits``). The indices are read on the device only: nothing here synchronises with
the host. Runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile.kernels import bf16_bits, cdiv, kernel_arg, launch, next_pow2, size_hint
from te_compile.kernels.quantize_mx import load_x, store_out

__all__ = ["gather_dot", "gather_sum"]

# Channels a program moves per slot: 1024 fp32 / bf16 elements is 4 / 2 KiB per load, enough
# to keep a row's loads in flight; hidden sizes below it take the next power of two.
_MAX_BLOCK_H = 1024


@triton.jit
def _gather_sum_kernel(
    X,
    INDEX,
    WEIGHT,
    COUNT,
    OUT,
    slots,
    hidden,
    sx_row,
    so_row,
    HAS_WEIGHT: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    n = slots
    if HAS_COUNT:
        n = tl.load(COUNT + row)
    for s in range(n):
        src = tl.load(INDEX + row * slots + s).to(tl.int64)
        # An empty slot (-1) masks the whole load; the mask is a block, as the loads need.
        ok = h_ok & ((h * 0 + src) >= 0)
        x = load_x(X, tl.maximum(src, 0) * sx_row + h, ok, BF16)
        if HAS_WEIGHT:
            x = x * tl.load(WEIGHT + row * slots + s)
        acc += x
    store_out(OUT, row * so_row + h, acc, h_ok, BF16)


def gather_sum(
    x: Tensor,
    index: Tensor,
    weight: Tensor | None,
    count: Tensor | None = None,
    *,
    block_h: int | None = None,
) -> Tensor:
    """``out[r] = sum_s weight[r, s] * x[index[r, s]]`` over the slots with ``index >= 0`` (rows
    with no slot are 0): ``x [M, H]`` (fp32 / bf16 / fp16, unit stride along ``H``), ``index
    [R, S]`` int32, ``weight [R, S]`` fp32 or None (all ones), ``count [R]`` int32 or None:
    only the first ``count[r]`` slots of row ``r`` are read. A new ``[R, H]`` tensor of ``x``'s
    dtype. Arguments are trusted (``te_compile.functional.moe`` validates them); ``block_h``
    overrides the channel tile (tests use small tiles)."""
    rows, slots = index.shape
    hidden = x.shape[1]
    out = x.new_empty((rows, hidden))
    if out.numel() == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    index = index.contiguous()
    weight = None if weight is None else weight.contiguous()
    count = None if count is None else count.contiguous()
    block = block_h or min(_MAX_BLOCK_H, next_pow2(size_hint(hidden)))
    grid = (rows, cdiv(hidden, block))
    launch(_gather_sum_kernel, grid)(
        kernel_arg(x),
        index,
        index if weight is None else weight,
        index if count is None else count,
        kernel_arg(out),
        slots,
        hidden,
        x.stride(0),
        out.stride(0),
        HAS_WEIGHT=weight is not None,
        HAS_COUNT=count is not None,
        BF16=bf16_bits(x),
        BLOCK_H=block,
        num_warps=4,
    )
    return out


@triton.jit
def _gather_dot_kernel(
    G,
    INDEX,
    WEIGHT,
    X,
    OUT,
    DOT,
    hidden,
    sg_row,
    sx_row,
    so_row,
    BF16: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    src = tl.load(INDEX + row).to(tl.int64)
    w = tl.where(src >= 0, tl.load(WEIGHT + row), 0.0)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        g = load_x(G, tl.maximum(src, 0) * sg_row + h, h_ok & ((h * 0 + src) >= 0), BF16)
        x = load_x(X, row * sx_row + h, h_ok, BF16)
        store_out(OUT, row * so_row + h, g * w, h_ok, BF16)
        acc += g * x
    tl.store(DOT + row, tl.sum(acc, axis=0))


def gather_dot(
    g: Tensor, index: Tensor, weight: Tensor, x: Tensor, *, block_h: int | None = None
) -> tuple[Tensor, Tensor]:
    """``(out, dot)``: ``out[r] = weight[r] * g[index[r]]`` and ``dot[r] = <g[index[r]], x[r]>``
    (fp32) for ``index [R]`` int32 (``-1``: a zero row and a zero dot), ``weight [R]`` fp32,
    ``g [T, H]`` and ``x [R, H]`` of one dtype (unit stride along ``H``); one read of each row.
    ``out`` has ``g``'s dtype, ``dot`` is fp32. Arguments are trusted; ``block_h`` overrides the
    channel tile (tests use small tiles)."""
    rows, hidden = x.shape
    out = g.new_empty((rows, hidden))
    dot = g.new_empty((rows,), dtype=torch.float32)
    if rows == 0:
        return out, dot
    if hidden == 0:
        return out, dot.zero_()
    g = g if g.stride(1) == 1 else g.contiguous()
    x = x if x.stride(1) == 1 else x.contiguous()
    index, weight = index.contiguous(), weight.contiguous()
    block = block_h or min(_MAX_BLOCK_H, next_pow2(size_hint(hidden)))
    launch(_gather_dot_kernel, (rows,))(
        kernel_arg(g),
        index,
        weight,
        kernel_arg(x),
        kernel_arg(out),
        dot,
        hidden,
        g.stride(0),
        x.stride(0),
        out.stride(0),
        BF16=bf16_bits(g),
        BLOCK_H=block,
        num_warps=4,
    )
    return out, dot
