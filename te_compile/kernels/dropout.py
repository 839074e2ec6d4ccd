r"""Triton kernel for dropout (``te_compile.functional.dropout_ops``): Philox4x32-10 in registers.

One program handles ``BLOCK`` consecutive elements of the flattened, contiguous tensor: it
evaluates Philox for the ``BLOCK / 4`` counters :math:`g = \lfloor i/4 \rfloor` of its elements
(counter ``(g_lo, g_hi, offset_lo, offset_hi)``, key ``(seed_lo, seed_hi)``), interleaves the four
output words so that element :math:`i` gets word :math:`i \bmod 4`, keeps the elements whose word
is at least ``threshold`` and multiplies them by ``scale`` in fp32: the same integers and the
same single fp32 multiply as the CPU reference, hence the same bits. ``seed`` and ``offset`` are
loaded from the ``rng_state`` tensor on the device: no host sync.

The 32-bit products use ``umulhi`` for the high word and wrapping uint32 multiplication for the
low word. bf16 crosses the kernel boundary as int16 bits, widened and rounded to nearest even by
hand (``quantize_mx``'s helpers): Triton's interpreter truncates fp32 to bf16 on stores, where
the GPU rounds, so this keeps one code path bit-exact on both. Runs on CPU tensors under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from te_compile.kernels import bf16_bits, cdiv, kernel_arg, launch
from te_compile.kernels.quantize_mx import load_x, store_out

__all__ = ["BLOCK", "dropout", "random_words"]

BLOCK = 1024  # elements per program: 256 Philox evaluations


@triton.jit
def _philox_words(g, offset_lo, offset_hi, seed_lo, seed_hi, ROUNDS: tl.constexpr):
    """Philox4x32-``ROUNDS`` of counters ``g`` (int64) -> four uint32 word tensors."""
    c0 = (g & 0xFFFFFFFF).to(tl.uint32)
    c1 = (g >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + offset_lo
    c3 = tl.zeros_like(c0) + offset_hi
    k0 = seed_lo
    k1 = seed_hi
    for _ in tl.static_range(ROUNDS):
        m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
        m1 = tl.full(c0.shape, 0xCD9E8D57, tl.uint32)
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + tl.full((), 0x9E3779B9, tl.uint32)
        k1 = k1 + tl.full((), 0xBB67AE85, tl.uint32)
    return c0, c1, c2, c3


@triton.jit
def _load_state(state_ptr):
    seed = tl.load(state_ptr)
    offset = tl.load(state_ptr + 1)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    offset_lo = (offset & 0xFFFFFFFF).to(tl.uint32)
    offset_hi = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return seed_lo, seed_hi, offset_lo, offset_hi


@triton.jit
def _block_words(state_ptr, pid, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    """The ``BLOCK`` words of program ``pid``, in element order."""
    seed_lo, seed_hi, offset_lo, offset_hi = _load_state(state_ptr)
    g = pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    w0, w1, w2, w3 = _philox_words(g, offset_lo, offset_hi, seed_lo, seed_hi, ROUNDS)
    # join(join(w0, w2), join(w1, w3)) is [BLOCK/4, 2, 2] holding w0 w1 w2 w3 in row-major order.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK,))


@triton.jit
def _dropout_kernel(
    x_ptr,
    out_ptr,
    state_ptr,
    numel,
    threshold_hi,
    threshold_lo,
    scale,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    scale = tl.cast(scale, tl.float32)
    # tl.cast, not .to: Triton passes an int argument equal to 1 as a constant (a Python int).
    threshold = tl.cast(threshold_hi, tl.int64) * 65536 + threshold_lo
    pid = tl.program_id(0)
    words = _block_words(state_ptr, pid, BLOCK, ROUNDS)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = load_x(x_ptr, offs, mask, BF16)
    keep = words.to(tl.int64) >= threshold
    store_out(out_ptr, offs, tl.where(keep, x * scale, 0.0), mask, BF16)


@triton.jit
def _words_kernel(out_ptr, state_ptr, numel, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    pid = tl.program_id(0)
    words = _block_words(state_ptr, pid, BLOCK, ROUNDS)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, words.to(tl.int64), mask=offs < numel)


def dropout(
    x: torch.Tensor, rng_state: torch.Tensor, threshold: int, scale: float, rounds: int = 10
) -> torch.Tensor:
    """``where(word >= threshold, x * scale, 0)``, a new contiguous tensor of ``x``'s dtype.
    Arguments are trusted (``te_compile.functional.dropout`` validates them)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        grid = (cdiv(x.numel(), BLOCK),)
        # The threshold (up to 2^32) in two 16-bit halves: torch 2.11's Inductor fails on an int
        # argument above int32's range of a user-defined Triton kernel under dynamic shapes.
        launch(_dropout_kernel, grid)(
            kernel_arg(x), kernel_arg(out), rng_state, x.numel(), threshold >> 16,
            threshold & 0xFFFF, scale, bf16_bits(x), BLOCK, rounds,
        )  # fmt: skip
    return out


def random_words(rng_state: torch.Tensor, numel: int, rounds: int = 10) -> torch.Tensor:
    """The first ``numel`` words of the stream, as int64 (to compare with the CPU reference)."""
    out = torch.empty(numel, dtype=torch.int64, device=rng_state.device)
    if numel:
        launch(_words_kernel, (cdiv(numel, BLOCK),))(out, rng_state, numel, BLOCK, rounds)
    return out
