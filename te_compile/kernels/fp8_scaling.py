"""Triton kernel of delayed scaling's state update (``te::delayed_scaling_update``,
``functional.fp8_scaling``): roll the ``[len, slots]`` amax history by one row, insert the last
amaxes (read from the forward's and the backward's buffers in place), recompute the scales (format
limits as scalars), one program per state, one launch for one state or two (the plain-torch version
is ~8 tiny kernels per state). The scale rule and the NaN / inf handling are ``kernels.quantize``'s
module docstring's."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from te_compile.kernels import launch, next_pow2

__all__ = ["delayed_scaling_update"]


@triton.jit
def _delayed_update_kernel(
    HIST,
    SCALE,
    AMAX,
    AMAX_TAIL,
    HIST1,
    SCALE1,
    AMAX1,
    AMAX_TAIL1,
    OUT,
    length,
    slots,
    n_amax,
    n_head,
    head_max,
    tail_max,
    row_stride,
    out_stride,
    margin_factor,
    MAX_ALGO: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PAIR: tl.constexpr,
):
    """One program per state: program 0 updates ``HIST`` / ``SCALE`` from ``AMAX`` /
    ``AMAX_TAIL`` and writes the new scales to ``OUT``'s first ``slots`` entries; with ``PAIR``,
    program 1 (a second state of the same shapes and recipe: a LayerNormMLP's two GEMMs)
    ``HIST1`` / ``SCALE1`` from ``AMAX1`` / ``AMAX_TAIL1``, and ``OUT``'s next ``slots`` (one
    output tensor: a write into a view of one would cost a copy in a compiled graph). Without
    ``PAIR`` the second set is not read or written (the launcher passes the first again).

    A state's update: ``HIST[r] <- HIST[r - 1]`` (r >= 1), ``HIST[0] <- last``, then
    ``SCALE <- limit / (window * margin_factor)`` where the window (max over the new history, or
    its row 0) is positive and finite; NaN anywhere in the window keeps the old scale, as torch's
    NaN-propagating ``amax`` does in the reference. ``last``: ``AMAX`` for the first ``n_amax``
    slots, ``AMAX_TAIL`` for the others (two buffers read in place: no concatenation first);
    ``limit``: ``head_max`` for the first ``n_head`` slots, ``tail_max`` for the others (scalars:
    no device tensor). ``OUT`` receives the new scales too: the copy the GEMMs read
    (:func:`delayed_scaling_update`)."""
    if PAIR:  # noqa: SIM102 (constexpr first: without PAIR the branch is not compiled)
        if tl.program_id(0) == 1:
            HIST, SCALE, AMAX, AMAX_TAIL = HIST1, SCALE1, AMAX1, AMAX_TAIL1
            OUT += slots * out_stride
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    margin_factor = tl.cast(margin_factor, tl.float32)
    head_max = tl.cast(head_max, tl.float32)
    tail_max = tl.cast(tail_max, tl.float32)
    rows = tl.arange(0, BLOCK_L)[:, None]
    cols = tl.arange(0, BLOCK_S)[None, :]
    in_cols = cols < slots
    shifted = (rows >= 1) & (rows < length) & in_cols
    old = tl.load(HIST + (rows - 1) * row_stride + cols, mask=shifted, other=0.0)
    head = tl.load(AMAX + cols, mask=cols < n_amax, other=0.0)
    tail = tl.load(AMAX_TAIL + tl.maximum(cols - n_amax, 0), mask=in_cols & (cols >= n_amax),
                   other=0.0)  # fmt: skip
    new = tl.where(rows == 0, tl.where(cols < n_amax, head, tail), old)
    if MAX_ALGO:
        live = (rows < length) & in_cols
        window = tl.max(tl.where(live, new, 0.0), axis=0)
        has_nan = tl.max((live & (new != new)).to(tl.int32), axis=0) > 0
        window = tl.where(has_nan, float("nan"), window)
    else:  # row 0 alone (a sum of one value per column: NaN and inf pass through)
        window = tl.sum(tl.where(rows == 0, new, 0.0), axis=0)
    c = tl.arange(0, BLOCK_S)
    limit = tl.where(c < n_head, head_max, tail_max)
    old_scale = tl.load(SCALE + c, mask=c < slots, other=1.0)
    ok = (window > 0) & (window < float("inf"))  # False for NaN
    # An overflowing scale (a tiny amax) is fp32's largest finite value, as in the reference.
    new_scale = tl.minimum(tl.div_rn(limit, window * margin_factor), 3.4028234663852886e38)
    new_scale = tl.where(ok, new_scale, old_scale)
    # Every thread has loaded its rows before any row is overwritten.
    tl.debug_barrier()
    tl.store(HIST + rows * row_stride + cols, new, mask=(rows < length) & in_cols)
    tl.store(SCALE + c, new_scale, mask=c < slots)
    tl.store(OUT + c * out_stride, new_scale, mask=c < slots)


def delayed_scaling_update(
    states: list[tuple[Tensor, Tensor, Tensor, Tensor | None]],
    out: Tensor,
    limits: tuple[float, float, int],
    margin: int,
    max_algo: bool,
) -> None:
    """In place, one launch for one or two states ``(amax_history, scale, amax, amax_tail)`` of
    the same shapes: see ``_delayed_update_kernel``. ``amax_history`` ``[len, slots]`` with unit
    column stride (a leading-rows slice of a larger buffer is fine); ``scale`` contiguous fp32
    ``[slots]``; the last amaxes ``amax`` (contiguous fp32, the first slots) and ``amax_tail``
    (the others; None: ``amax`` holds all); ``limits``: ``(head_max, tail_max, n_head)``, the
    first ``n_head`` slots' format's largest value and the others'; ``out`` ``[states *
    slots]`` fp32 (any stride) receives the new scales too, state by state."""
    args = []
    for hist, scale, amax, tail in states:
        tail = amax if tail is None else tail
        if hist.stride(1) != 1 or not all(t.is_contiguous() for t in (scale, amax, tail)):
            raise ValueError(
                "delayed_scaling_update: expects unit column stride / contiguous slots"
            )
        args.append((hist, scale, amax, tail))
    (hist, _, amax, _), last = args[0], args[-1]
    length, slots = hist.shape
    same = (last[0].shape, last[0].stride(0), last[2].numel()) == (hist.shape, hist.stride(0),
                                                                  amax.numel())  # fmt: skip
    if len(args) > 2 or not same or out.numel() != len(args) * slots:
        raise ValueError("delayed_scaling_update: one or two states of the same shapes, and out "
                         "of their slots")  # fmt: skip
    head_max, tail_max, n_head = limits
    launch(_delayed_update_kernel, (len(args),))(
        *args[0],
        *last,
        out,
        length,
        slots,
        amax.numel(),
        n_head,
        head_max,
        tail_max,
        hist.stride(0),
        out.stride(0),
        2.0**margin,
        MAX_ALGO=max_algo,
        BLOCK_L=next_pow2(length),
        BLOCK_S=next_pow2(slots),
        PAIR=len(args) == 2,
        num_warps=4,
    )
