r"""Dropout with a counter-based RNG: ``te::dropout_fwd`` / ``te::dropout_bwd``.

.. math::
    y_i = \frac{m_i\,x_i}{1 - p}, \qquad dx_i = \frac{m_i\,dy_i}{1 - p}, \qquad
    m_i = [\,u_i \ge \lfloor p\,2^{32} \rfloor\,]

where :math:`u_i` is a 32-bit random word that is a pure function of ``rng_state`` and the
element's index :math:`i` in ``inp``'s logical (row-major) order. ``rng_state`` is an int64
tensor ``[2]`` = ``(seed, offset)`` on ``inp``'s device, an explicit *input* of both ops: they
are pure (no global RNG is read inside them, as opcheck and torch.compile require), the backward
recomputes the mask instead of saving it, and a checkpointed recompute gets the same
``rng_state``, eager and compiled (``docs/ops.md``).

The words come from Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
SC 2011): key ``(seed mod 2^32, seed >> 32)``, counter ``(g mod 2^32, g >> 32, offset mod 2^32,
offset >> 32)`` with :math:`g = \lfloor i/4 \rfloor`, and element :math:`i` takes output word
:math:`i \bmod 4`: one Philox evaluation per four elements. Philox needs 32x32->64-bit products;
the CPU implementation below forms them from 16-bit halves in int64 (no overflow anywhere), and
the Triton kernel (``te_compile.kernels.dropout``) uses native uint32 arithmetic; the two agree
bit for bit (tests run the kernel under ``TRITON_INTERPRET=1``). The keep test compares integers
(no float conversion of the random word) and the scaling is one fp32 multiply (fp64 for fp64
input), so the CPU and the kernel agree on the output bits as well.

``offset`` selects an independent stream for the same seed (e.g. per tensor-parallel rank).
``p`` is in ``[0, 1]``; ``p == 1`` drops everything (output zeros).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from te_compile._checks import FLOAT_DTYPES, check_bool, check_tensor
from te_compile._library import differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.kernels import runs_triton, submodule

__all__ = ["dropout", "dropout_mask", "dropout_ref", "new_rng_state", "philox4x32", "random_words"]

_MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key increments (golden ratio, sqrt(3) - 1)


# 1. Reference math ----------------------------------------------------------------------------


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)`` 32-bit words of ``a * b`` for a 32-bit constant ``a`` and int64 ``b`` holding
    32-bit values, from 16-bit halves of ``b`` so that no int64 product overflows."""
    p_lo, p_hi = (b & 0xFFFF) * a, (b >> 16) * a  # each < 2^48
    mid = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49
    return (p_hi >> 16) + (mid >> 32), mid & _MASK32


def philox4x32(
    counter: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (broadcasting); returns four words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def random_words(rng_state: Tensor, numel: int) -> Tensor:
    """The ``numel`` 32-bit words (int64) of the stream ``rng_state = (seed, offset)``."""
    seed, offset = rng_state[0], rng_state[1]
    g = torch.arange((numel + 3) // 4, device=rng_state.device, dtype=torch.int64)
    counter = (g & _MASK32, g >> 32, offset & _MASK32, (offset >> 32) & _MASK32)
    words = philox4x32(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    return torch.stack(words, dim=-1).reshape(-1)[:numel]


def threshold(p: float) -> int:
    """Words below this are dropped: ``floor(p * 2^32)``."""
    return min(int(p * 4294967296.0), 4294967296)


def scale(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def dropout_mask(rng_state: Tensor, shape: torch.Size | tuple[int, ...], p: float) -> Tensor:
    """The keep mask (bool, ``shape``) of the stream ``rng_state`` with drop probability ``p``."""
    return (random_words(rng_state, math.prod(shape)) >= threshold(p)).reshape(shape)


def dropout_ref(inp: Tensor, rng_state: Tensor, p: float) -> Tensor:
    """``inp * mask / (1 - p)``: the scaling in fp32 (fp64 stays fp64), rounded once."""
    keep = dropout_mask(rng_state, inp.shape, p)
    return torch.where(keep, inp.to(acc_dtype(inp)) * scale(p), 0.0).to(inp.dtype)


def _check_args(inp: Tensor, rng_state: Tensor, p: float) -> None:
    """The same message in eager and at trace time."""
    prefix = "te.dropout: "
    if not 0.0 <= p <= 1.0:
        raise ValueError(prefix + f"p must be in [0, 1], got {p}")
    if inp.dtype not in FLOAT_DTYPES:
        raise ValueError(prefix + f"inp.dtype must be a floating type, got {inp.dtype}")
    if (rng_state.dtype, rng_state.shape, rng_state.device) != (torch.int64, (2,), inp.device):
        raise ValueError(
            prefix + f"rng_state must be an int64 tensor [2] = (seed, offset) on inp's device "
            f"({inp.device}), got {rng_state.dtype} {list(rng_state.shape)} on {rng_state.device}"
        )


_kernels = functools.partial(submodule, "dropout")  # Triton: imported on first CUDA use


def _dropout_by_device(x: Tensor, rng_state: Tensor, p: float) -> Tensor:
    """Both ops' implementations: the Triton kernel (CUDA, but not fp64) or the reference math."""
    if runs_triton(x):
        return _kernels().dropout(x, rng_state, threshold(p), scale(p))
    return dropout_ref(x.contiguous(), rng_state, p)


# 2. Forward op / 3. fake ----------------------------------------------------------------------


@op("dropout_fwd")
def dropout_fwd(inp: Tensor, rng_state: Tensor, p: float) -> Tensor:
    """``inp * mask / (1 - p)``."""
    _check_args(inp, rng_state, p)
    return _dropout_by_device(inp, rng_state, p)


@dropout_fwd.register_fake
def _dropout_fwd_fake(inp, rng_state, p):
    _check_args(inp, rng_state, p)
    return inp.new_empty(inp.shape)


# 4. Backward op -------------------------------------------------------------------------------


@op("dropout_bwd")
def dropout_bwd(grad: Tensor, rng_state: Tensor, p: float) -> Tensor:
    """``grad * mask / (1 - p)`` with the mask recomputed from ``rng_state``."""
    return _dropout_by_device(grad, rng_state, p)


@dropout_bwd.register_fake
def _dropout_bwd_fake(grad, rng_state, p):
    return grad.new_empty(grad.shape)


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    _inp, rng_state, ctx.p = inputs
    ctx.save_for_backward(rng_state)


def _backward(ctx, bwd, grad):
    (rng_state,) = ctx.saved_tensors
    return bwd(grad.contiguous(), rng_state, ctx.p), None, None


_dropout = differentiable(
    dropout_fwd,
    dropout_bwd,
    setup_context=_setup_context,
    backward=_backward,
    reference=dropout_ref,
)


# Public functions -----------------------------------------------------------------------------


def new_rng_state(device: torch.device | str | None = None) -> Tensor:
    """A fresh ``(seed, offset)`` drawn from torch's default generator of ``device``: seeded by
    ``torch.manual_seed``, and restored by ``torch.utils.checkpoint`` for the recompute."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def dropout(
    inp: Tensor, p: float = 0.5, *, rng_state: Tensor | None = None, training: bool = True
) -> Tensor:
    """Dropout through ``te::dropout_fwd``: each element zeroed with probability ``p``, the rest
    scaled by ``1 / (1 - p)``. ``rng_state`` (int64 ``[2]``, ``(seed, offset)``) fixes the mask;
    None draws one with :func:`new_rng_state`. Not ``training`` or ``p == 0``: ``inp`` itself."""
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
        raise ValueError(f"te.dropout: p must be a float in [0, 1], got {p!r}")
    check_bool("te.dropout", training=training)
    check_tensor("te.dropout", "inp", inp, min_dim=0)
    if rng_state is not None:
        check_tensor("te.dropout", "rng_state", rng_state, floating=False)
    if not training or p == 0:
        return inp
    return _dropout(inp, new_rng_state(inp.device) if rng_state is None else rng_state, float(p))
