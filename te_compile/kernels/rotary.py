r"""Triton kernel for rotary position embeddings (``te_compile.functional.rotary``), forward and
backward.

``t`` is viewed as ``[rows, h, d]`` with ``rows = outer * inner`` (sbhd: ``s x b``, bshd:
``b x s``, thd: ``t x 1``), any strides but a contiguous last dim; the output is a new contiguous
tensor. A program owns ``BLOCK_T`` rows x ``BLOCK_H`` heads and one chunk of channels, the third
grid axis:

* a rotary chunk of ``BLOCK_P`` channel pairs :math:`(a, b)` (``(i, i + d_2/2)``, or
  ``(2i, 2i + 1)`` interleaved, loaded as one ``[..., 2]`` tile and split): it computes the
  rows' positions, loads their ``freqs`` once and evaluates ``cos``/``sin`` once on a
  ``[BLOCK_T, BLOCK_P]`` tile for all ``BLOCK_H`` heads (the trigonometry is the only arithmetic
  of note; sharing it over the heads keeps the kernel memory-bound), then, head by head, reads
  both members of its pairs and writes

  .. math::
      y_a = x_a \cos f_a - x_b \sin f_a, \qquad y_b = x_b \cos f_b + x_a \sin f_b

  or, for the backward (the transpose), :math:`dx_a = dy_a \cos f_a + dy_b \sin f_b,\
  dx_b = dy_b \cos f_b - dy_a \sin f_a`;
* a pass-through chunk of ``BLOCK_C`` channels from ``d2`` on, copied.

So every element is read once and written once, in one launch: the traffic is that of a copy
(plus the ``freqs`` rows, ``d2 / (h d)`` of it at fp32). Positions come from the row index
(sbhd / bshd) or from ``cu_seqlens`` on the device (thd): each row finds its sequence by a binary
search over ``cu_seqlens // cp_size`` (``bit_length(n)`` steps for ``n`` sequences), so nothing is
read on the host. Context parallelism maps local indices to global positions as
``te_compile.functional.rotary`` describes. Rows in no sequence and positions past ``freqs``'s
rows read angle 0 (unrotated).

Arithmetic in fp32. ``tl.cos``/``tl.sin`` compile to libdevice's ``__nv_cosf``/``__nv_sinf`` on
NVIDIA GPUs (read in the PTX for sm_90, Triton 3.9), not to ``sin.approx``: full range reduction,
so angles of many thousands of radians (long contexts) keep fp32 accuracy. With 16-element
aligned strides (what Triton's launcher specialises on) the rotate_half layout moves 16-byte
vectors; the interleaved tile mixes 16- and 4-byte accesses. bf16 crosses the kernel boundary as
int16 bits, widened and rounded to nearest even by hand (``quantize_mx``'s helpers), so that
Triton's interpreter rounds as the GPU does. Runs on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile.kernels import bf16_bits, cdiv, kernel_arg, launch, next_pow2, size_hint
from te_compile.kernels.quantize_mx import load_x, store_out

__all__ = ["RotaryLaunchConfig", "launch_config", "rotary"]

SBHD: tl.constexpr = tl.constexpr(0)
BSHD: tl.constexpr = tl.constexpr(1)
THD: tl.constexpr = tl.constexpr(2)
_FORMATS = {"sbhd": SBHD.value, "bshd": BSHD.value, "thd": THD.value}


@dataclasses.dataclass(frozen=True)
class RotaryLaunchConfig:
    """How a launch tiles ``[rows, h, d]``: a program owns ``block_t`` rows, ``block_h`` heads
    and ``block_p`` channel pairs (``block_c`` channels of a pass-through program) and walks its
    heads one at a time over 2-D ``[block_t, block_p]`` tiles.

    ``cos``/``sin`` are evaluated once per program on a ``[block_t, block_p]`` tile laid out as
    the data tiles, and serve all ``block_h`` heads: ``1 / block_h`` angles evaluated per element
    (``python -m bench.diag.sass_rotary`` counts them in the sm90 code). (Tiles of
    ``[rows, heads, pairs]`` with the angles broadcast over the heads let Triton's layout
    propagation give the angles the 3-D tile's layout, so every thread evaluated them for its
    own heads again: compute-bound, about a third of copy bandwidth on an H200.) About
    ``_TILE`` elements per head step; ``block_p`` up to 64 pairs, a head of 128 channels in one
    chunk, each member of a pair a 128-byte bf16 run; up to ``_MAX_BLOCK_H`` heads a program,
    unrolled, so that their loads are in flight together. ``block_h`` beyond ``head_unroll``:
    a loop of unrolled groups of ``head_unroll`` heads (fewer angles an element, one program
    per row tile for all heads)."""

    block_t: int
    block_h: int
    block_p: int
    block_c: int
    num_warps: int
    head_unroll: int = 8


# From bench/diag/tune_rotary.py on an H100 (2026-11-27): [8, 64]-pair tiles, 8 heads, 8 warps
# move 87% of copy bandwidth on the query tensors (sbhd and thd), 81 - 84% with [16, 64] tiles
# and 4 warps; more heads a program (fewer angles an element) did not help.
_TILE = 1024
_NUM_WARPS = 8
_MAX_BLOCK_P = 64
_MAX_BLOCK_H = 8


@functools.lru_cache(maxsize=256)
def launch_config(heads: int, pairs: int, passthrough: int) -> RotaryLaunchConfig:
    """The tiling for ``heads`` heads of ``pairs`` rotary pairs and ``passthrough`` copied
    channels (sizes to choose a tiling by: any tiling is correct for any size)."""
    block_p = min(next_pow2(max(pairs, 1)), _MAX_BLOCK_P)
    block_h = min(next_pow2(max(heads, 1)), _MAX_BLOCK_H)
    block_t = max(1, _TILE // (2 * block_p))
    block_c = min(next_pow2(max(passthrough, 1)), 2 * block_p)
    return RotaryLaunchConfig(block_t, block_h, block_p, block_c, num_warps=_NUM_WARPS)


@triton.jit
def _cp_position(j, length, cp_size, cp_rank):
    """The global position of local index ``j`` in a local sequence of ``length`` tokens."""
    pos = j
    if cp_size > 1:
        half = length // 2
        pos = tl.where(
            j < half, j + cp_rank * half, length * cp_size - (cp_rank + 1) * half + j - half
        )
    return pos


@triton.jit
def _thd_index(CU, token, n_seqs, cp_size):
    """``(index in its sequence, sequence length, in a sequence)`` of each ``token``: a binary
    search for the last ``k`` in ``[0, n_seqs]`` with ``cu[k] // cp_size <= token``."""
    lo = tl.zeros_like(token)
    hi = lo + n_seqs
    steps = tl.max(hi, axis=0)  # n_seqs as a scalar tensor (a loop-carried value)
    while steps > 0:  # bit_length(n_seqs) halvings of [lo, hi]
        active = lo < hi
        mid = (lo + hi + 1) // 2
        start = tl.load(CU + mid, mask=active, other=0).to(tl.int64) // cp_size
        lo = tl.where(active & (start <= token), mid, lo)
        hi = tl.where(active & (start > token), mid - 1, hi)
        steps = steps // 2
    start = tl.load(CU + lo).to(tl.int64) // cp_size
    end = tl.load(CU + lo + 1, mask=lo < n_seqs, other=0).to(tl.int64) // cp_size
    return token - start, end - start, (lo < n_seqs) & (start <= token)


@triton.jit
def _rotate(xa, xb, ca, sa, cb, sb, BACKWARD: tl.constexpr):
    """One pair's rotation, the angles' ``cos``/``sin`` given (``[T, P]``, as ``xa``/``xb``)."""
    if BACKWARD:
        return xa * ca + xb * sb, xb * cb - xa * sa
    return xa * ca - xb * sa, xb * cb + xa * sb


@triton.jit
def _rotary_kernel(
    X,
    OUT,
    FREQS,
    CU,
    n_rows,
    n_inner,
    n_heads,
    sx_outer,
    sx_inner,
    sx_head,
    so_outer,
    so_inner,
    so_head,
    freqs_rows,
    freqs_stride,
    pairs,
    d2,
    d,
    seq_len,
    n_seqs,
    cp_size,
    cp_rank,
    rot_chunks,
    FORMAT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
    UNROLL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head0 = tl.program_id(1).to(tl.int64) * BLOCK_H
    chunk = tl.program_id(2)
    outer = rows // n_inner
    inner = rows % n_inner
    row_ok = rows < n_rows
    # A head's bounds as a [T] mask: Triton's interpreter refuses a mask that combines a tile
    # with a scalar comparison.
    rows_zero = rows * 0
    x_row = outer * sx_outer + inner * sx_inner  # [T]
    o_row = outer * so_outer + inner * so_inner
    if chunk < rot_chunks:
        if FORMAT == THD:
            j, length, valid = _thd_index(CU, outer, n_seqs, cp_size)
        elif FORMAT == SBHD:
            j, length, valid = outer, seq_len, row_ok
        else:
            j, length, valid = inner, seq_len, row_ok
        pos = _cp_position(j, length, cp_size, cp_rank)
        valid = valid & row_ok & (pos >= 0) & (pos < freqs_rows)
        f_row = pos * freqs_stride  # [T]
        p = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = p < pairs
        if INTERLEAVED:
            pair = tl.arange(0, 2)
            c2 = ((2 * p)[:, None] + pair[None, :])[None, :, :]  # [1, P, 2]: channels 2i, 2i + 1
            pair_ok = (p_ok[:, None] & (pair < 2)[None, :])[None, :, :]
            f_mask = valid[:, None, None] & pair_ok
            f = tl.load(FREQS + f_row[:, None, None] + c2, mask=f_mask, other=0.0)
            fa, fb = tl.split(f.to(tl.float32))
            ca, sa, cb, sb = tl.cos(fa), tl.sin(fa), tl.cos(fb), tl.sin(fb)
            t_mask = row_ok[:, None, None] & pair_ok
            for hg in range(0, BLOCK_H, UNROLL):
                for hh in tl.static_range(UNROLL):
                    head = head0 + hg + hh
                    x_mask = t_mask & (rows_zero + head < n_heads)[:, None, None]
                    x_offs = x_row[:, None, None] + head * sx_head + c2
                    xa, xb = tl.split(load_x(X, x_offs, x_mask, BF16))
                    ya, yb = _rotate(xa, xb, ca, sa, cb, sb, BACKWARD)
                    o_offs = o_row[:, None, None] + head * so_head + c2
                    store_out(OUT, o_offs, tl.join(ya, yb), x_mask, BF16)
        else:
            f_mask = valid[:, None] & p_ok[None, :]
            f_offs = f_row[:, None] + p[None, :]
            fa = tl.load(FREQS + f_offs, mask=f_mask, other=0.0).to(tl.float32)
            fb = tl.load(FREQS + f_offs + pairs, mask=f_mask, other=0.0).to(tl.float32)
            ca, sa, cb, sb = tl.cos(fa), tl.sin(fa), tl.cos(fb), tl.sin(fb)
            t_mask = row_ok[:, None] & p_ok[None, :]
            for hg in range(0, BLOCK_H, UNROLL):
                for hh in tl.static_range(UNROLL):
                    head = head0 + hg + hh
                    x_mask = t_mask & (rows_zero + head < n_heads)[:, None]
                    x_offs = x_row[:, None] + head * sx_head + p[None, :]
                    xa = load_x(X, x_offs, x_mask, BF16)
                    xb = load_x(X, x_offs + pairs, x_mask, BF16)
                    ya, yb = _rotate(xa, xb, ca, sa, cb, sb, BACKWARD)
                    o_offs = o_row[:, None] + head * so_head + p[None, :]
                    store_out(OUT, o_offs, ya, x_mask, BF16)
                    store_out(OUT, o_offs + pairs, yb, x_mask, BF16)
    else:
        c = d2 + (chunk - rot_chunks) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_tile = row_ok[:, None] & (c < d)[None, :]
        for hg in range(0, BLOCK_H, UNROLL):
            for hh in tl.static_range(UNROLL):
                head = head0 + hg + hh
                c_mask = c_tile & (rows_zero + head < n_heads)[:, None]
                v = tl.load(X + x_row[:, None] + head * sx_head + c[None, :], mask=c_mask)
                tl.store(OUT + o_row[:, None] + head * so_head + c[None, :], v, mask=c_mask)


def _rows_view(t: Tensor, tensor_format: str) -> tuple[Tensor, int, int, int]:
    """``t`` as ``[outer, inner, h, d]`` and its sequence length (0 for thd)."""
    if tensor_format == "thd":
        return t.unsqueeze(1), 0, 0, 0
    seq_len = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    return t, t.shape[0], t.shape[1], seq_len


def rotary(
    t: Tensor,
    freqs: Tensor,
    cu_seqlens: Tensor | None,
    tensor_format: str,
    interleaved: bool,
    cp_size: int,
    cp_rank: int,
    *,
    backward: bool = False,
    config: RotaryLaunchConfig | None = None,
) -> Tensor:
    """RoPE of ``t`` (``backward``: its transpose, applied to a gradient), a new contiguous tensor
    of ``t``'s dtype. Arguments are trusted (``te_compile.functional.rotary`` validates them);
    ``config`` overrides :func:`launch_config` (tests use small tiles)."""
    x = t if t.stride(-1) == 1 else t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if out.numel() == 0:
        return out
    x4, _, _, seq_len = _rows_view(x, tensor_format)
    o4 = _rows_view(out, tensor_format)[0]
    heads, d = x4.shape[2], x4.shape[3]
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    if table.stride(-1) != 1:
        table = table.contiguous()
    d2 = table.shape[1]
    pairs = d2 // 2
    cfg = config or launch_config(size_hint(heads), size_hint(pairs), size_hint(d - d2))
    unroll = min(cfg.block_h, cfg.head_unroll)
    if cfg.block_h % unroll:  # a program's last group would reach into the next one's heads
        raise ValueError(
            f"RotaryLaunchConfig: block_h ({cfg.block_h}) must be a multiple of head_unroll "
            f"({cfg.head_unroll}) when larger"
        )
    rot_chunks = cdiv(pairs, cfg.block_p)
    n_rows = x4.shape[0] * x4.shape[1]
    grid = (
        cdiv(n_rows, cfg.block_t),
        cdiv(heads, cfg.block_h),
        rot_chunks + cdiv(d - d2, cfg.block_c),
    )
    cu = table if cu_seqlens is None else cu_seqlens.contiguous()
    launch(_rotary_kernel, grid)(
        kernel_arg(x4),
        kernel_arg(o4),
        table,
        cu,
        n_rows,
        x4.shape[1],
        heads,
        x4.stride(0),
        x4.stride(1),
        x4.stride(2),
        o4.stride(0),
        o4.stride(1),
        o4.stride(2),
        table.shape[0],
        table.stride(0),
        pairs,
        d2,
        d,
        seq_len,
        cu.shape[0] - 1,
        cp_size,
        cp_rank,
        rot_chunks,
        FORMAT=_FORMATS[tensor_format],
        INTERLEAVED=interleaved,
        BACKWARD=backward,
        BF16=bf16_bits(x4),
        BLOCK_T=cfg.block_t,
        BLOCK_H=cfg.block_h,
        BLOCK_P=cfg.block_p,
        BLOCK_C=cfg.block_c,
        UNROLL=unroll,
        num_warps=cfg.num_warps,
    )
    return out
