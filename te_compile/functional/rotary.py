r"""Rotary position embeddings (RoPE) with Transformer Engine's semantics:
``te::rotary_fwd`` / ``te::rotary_bwd``.

``freqs`` (``[s2, 1, 1, d2]``, see :func:`rotary_frequencies`) holds one angle per position and
rotary channel. A token at position :math:`p` of a head of ``d`` channels becomes, with
:math:`f = \mathrm{freqs}[p]`,

.. math::
    y_j = x_j \cos f_j + r_j(x) \sin f_j \quad (j < d_2), \qquad
    y_j = x_j \quad (d_2 \le j < d)

where :math:`r` pairs every rotary channel with a partner: ``interleaved=False``
(``rotate_half``, GPT-NeoX / Llama) :math:`r(x) = [-x_{h:d_2},\ x_{0:h}]` with
:math:`h = d_2/2`; ``interleaved=True`` (GPT-J) :math:`r(x)_{2i} = -x_{2i+1},\
r(x)_{2i+1} = x_{2i}`. With the frequency layout :func:`rotary_frequencies` makes (both members
of a pair share their angle), each pair is rotated by its angle. Each channel uses its own
``freqs`` entry, as Transformer Engine's fused kernel does, so any ``freqs`` is allowed.

The backward is the transpose of that linear map, :math:`dx = dy \cos f - r(dy \sin f)`: the
rotation by :math:`-\theta` (``r`` is antisymmetric). ``freqs`` gets no gradient from the op
(Transformer Engine's fused path gives none either); ``fused=False`` differentiates it by autograd.

Positions:

* ``sbhd`` ``[s, b, h, d]`` / ``bshd`` ``[b, s, h, d]``: a token's index along ``s``;
* ``thd`` ``[t, h, d]`` with ``cu_seqlens`` (int32/int64 ``[n + 1]``): tokens
  ``cu_seqlens[i] // cp_size <= k < cu_seqlens[i + 1] // cp_size`` form sequence ``i`` and are
  numbered from 0 within it. Tokens in no sequence pass through unchanged;
* context parallelism (``cp_size > 1``; ``thd``'s ``cu_seqlens`` are then the global, padded
  ones): each rank holds two chunks of every sequence of global length :math:`L c`, its local
  index :math:`j` of a local length :math:`L` (even) standing for position
  :math:`j + r L/2` in the first half and :math:`L c - (r + 1) L/2 + (j - L/2)` in the second
  (rank :math:`r` of :math:`c`: the load-balanced split of Transformer Engine and Megatron).

A position past the last row of ``freqs`` is left unrotated; the checks that read the data of
``cu_seqlens`` run only eagerly on the CPU, where they cost no device sync (``docs/ops.md``).
Numerics: fp32 (fp64 for fp64 input), rounded once to ``t``'s dtype; ``freqs`` is read in fp32
whatever its dtype, as Transformer Engine's fused path casts it. CPU: the reference math below;
CUDA: the Triton kernel of ``te_compile.kernels.rotary`` (one read and one write of ``t``; fp64:
the reference). No autocast rule: the op runs in ``t``'s dtype, as torch's element-wise ops and
Transformer Engine's RoPE do; an autocast cast would round ``freqs`` (angles of thousands of
radians) to bf16.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from te_compile._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_bool,
    check_int,
    check_positive_finite,
    check_tensor,
)
from te_compile._library import differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.kernels import runs_triton, submodule

__all__ = [
    "TENSOR_FORMATS",
    "apply_rotary_pos_emb",
    "rotary_frequencies",
    "rotary_ref",
    "token_positions",
]

TENSOR_FORMATS = ("sbhd", "bshd", "thd")
_PREFIX = "te.apply_rotary_pos_emb: "


# Frequencies ----------------------------------------------------------------------------------


def rotary_frequencies(
    inv_freq: Tensor,
    max_seq_len: int,
    offset: int = 0,
    *,
    interleaved: bool = False,
    seq_len_interpolation_factor: float | None = None,
    pretrained_max_position_embeddings: int | None = None,
) -> Tensor:
    """``freqs [max_seq_len, 1, 1, 2 * len(inv_freq)]`` (fp32) for positions
    ``offset .. offset + max_seq_len - 1``, as Transformer Engine's ``RotaryPositionEmbedding``.

    Position interpolation (Chen et al., arXiv:2306.15595) applies when both
    ``seq_len_interpolation_factor`` and ``pretrained_max_position_embeddings`` are given:
    positions are divided by the factor, or, for ``max_seq_len`` beyond
    ``pretrained_max_position_embeddings * factor``, by
    ``max_seq_len / pretrained_max_position_embeddings`` (dynamic scaling). Layout of the last
    dim: ``[f_0 .. f_{n-1}, f_0 .. f_{n-1}]``, or ``[f_0, f_0, f_1, f_1, ...]`` when
    ``interleaved``."""
    owner = "te.rotary_frequencies"
    check_tensor(owner, "inv_freq", inv_freq)
    if inv_freq.dim() != 1:
        raise ValueError(f"{owner}: inv_freq must be 1-D, got shape {list(inv_freq.shape)}")
    check_int(owner, 1, max_seq_len=max_seq_len)
    check_int(owner, 0, offset=offset)
    check_bool(owner, interleaved=interleaved)
    if seq_len_interpolation_factor is not None:
        check_positive_finite(owner, seq_len_interpolation_factor=seq_len_interpolation_factor)
    if pretrained_max_position_embeddings is not None:
        check_int(owner, 1, pretrained_max_position_embeddings=pretrained_max_position_embeddings)
    inv_freq = inv_freq.to(torch.float32)
    seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32) + offset
    if seq_len_interpolation_factor is not None and pretrained_max_position_embeddings is not None:
        if max_seq_len > pretrained_max_position_embeddings * seq_len_interpolation_factor:
            seq = seq * (1 / (max_seq_len / pretrained_max_position_embeddings))
        else:
            seq = seq * (1 / seq_len_interpolation_factor)
    # An element-wise product: autocast leaves it in fp32 (an einsum would be a GEMM, cast).
    freqs = seq[:, None] * inv_freq[None, :]
    if interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.reshape(emb.shape[0], 1, 1, emb.shape[1])


# 1. Reference math ----------------------------------------------------------------------------


def _cp_position(j: Tensor, length: Tensor | int, cp_size: int, cp_rank: int) -> Tensor:
    """The global position of local index ``j`` in a local sequence of ``length`` tokens."""
    if cp_size == 1:
        return j
    half = length // 2
    second = length * cp_size - (cp_rank + 1) * half + (j - half)
    return torch.where(j < half, j + cp_rank * half, second)


def token_positions(
    tensor_format: str,
    seq_len: int,
    cu_seqlens: Tensor | None,
    cp_size: int,
    cp_rank: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """``(position, in_sequence)`` (int64, bool), one per index along ``s`` (sbhd / bshd, where
    ``seq_len`` is that dim's size) or per token (thd, ``seq_len`` = number of tokens)."""
    index = torch.arange(seq_len, device=device, dtype=torch.int64)
    if tensor_format != "thd":
        return _cp_position(index, seq_len, cp_size, cp_rank), torch.ones_like(index, dtype=bool)
    cu = cu_seqlens.to(torch.int64) // cp_size
    n = cu.shape[0] - 1
    seq = torch.searchsorted(cu, index, right=True) - 1  # last sequence starting at or before
    inside = (seq >= 0) & (seq < n)
    seq = seq.clamp(0, n - 1)
    start = cu[seq]
    return _cp_position(index - start, cu[seq + 1] - start, cp_size, cp_rank), inside


def _rotate(x: Tensor, interleaved: bool) -> Tensor:
    """:math:`r(x)` over the last dim (see the module docstring)."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_ref(
    t: Tensor,
    freqs: Tensor,
    cu_seqlens: Tensor | None,
    tensor_format: str,
    interleaved: bool,
    cp_size: int,
    cp_rank: int,
    backward: bool = False,
) -> Tensor:
    """``y = x cos f + r(x) sin f`` (the module docstring), differentiable by autograd (``t``
    and ``freqs``). ``backward``: ``t`` is the output's gradient and the result the input's."""
    acc = acc_dtype(t)
    pos, inside = token_positions(
        tensor_format, _seq_len(t, tensor_format), cu_seqlens, cp_size, cp_rank, t.device
    )
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1]).to(acc)
    rows, d2 = table.shape
    f = table[pos.clamp(0, rows - 1)]
    f = torch.where((inside & (pos >= 0) & (pos < rows))[:, None], f, 0.0)  # unrotated
    shape = {"sbhd": (-1, 1, 1, d2), "bshd": (1, -1, 1, d2)}  # to broadcast against t[..., :d2]
    f = f.view(shape.get(tensor_format, (-1, 1, d2)))
    x = t.to(acc)
    xr = x[..., :d2]
    if backward:
        yr = xr * f.cos() - _rotate(xr * f.sin(), interleaved)
    else:
        yr = xr * f.cos() + _rotate(xr, interleaved) * f.sin()
    return torch.cat((yr, x[..., d2:]), dim=-1).to(t.dtype).contiguous()


def _seq_len(t: Tensor, tensor_format: str) -> int:
    return t.shape[1] if tensor_format == "bshd" else t.shape[0]


def _check_args(t, freqs, cu_seqlens, tensor_format, cp_size, cp_rank) -> None:
    """Shapes, dtypes and scalars: a ValueError naming the argument, the same in eager and at
    trace time."""

    def fail(message: str) -> None:
        raise ValueError(_PREFIX + message)

    if tensor_format not in TENSOR_FORMATS:
        fail(f"tensor_format must be one of {TENSOR_FORMATS}, got {tensor_format!r}")
    if t.dtype not in FLOAT_DTYPES:
        fail(f"t.dtype must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if not freqs.is_floating_point():
        fail(f"freqs.dtype must be a floating type (read in fp32), got {freqs.dtype}")
    thd = tensor_format == "thd"
    rank = 3 if thd else 4
    if t.dim() != rank:
        layout = "[t, h, d]" if thd else f"[{', '.join(tensor_format)}]"
        fail(f"t must be {rank}-D {layout} for tensor_format={tensor_format!r}, got {t.dim()}-D")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1 or freqs.shape[0] < 1:
        fail(f"freqs must be [s2, 1, 1, d2] with s2 >= 1, got {list(freqs.shape)}")
    d2, d = freqs.shape[3], t.shape[-1]
    if not (2 <= d2 <= d and d2 % 2 == 0):
        fail(
            f"freqs.shape[-1] (the rotary dim, {d2}) must be even, at least 2 and at most "
            f"t.shape[-1] ({d})"
        )
    if freqs.device != t.device:
        fail(f"freqs must be on t's device ({t.device}), got {freqs.device}")
    if cp_size < 1:
        fail(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        fail(f"cp_rank must be in [0, cp_size) = [0, {cp_size}), got {cp_rank}")
    if thd:
        if cu_seqlens is None:
            fail("cu_seqlens is required for tensor_format='thd'")
        if (
            cu_seqlens.dtype not in INDEX_DTYPES
            or cu_seqlens.dim() != 1
            or cu_seqlens.shape[0] < 2
            or cu_seqlens.device != t.device
        ):
            fail(
                f"cu_seqlens must be an int32 or int64 tensor [n + 1] (n >= 1) on t's device "
                f"({t.device}), got {cu_seqlens.dtype} {list(cu_seqlens.shape)} on "
                f"{cu_seqlens.device}"
            )
        return
    if cu_seqlens is not None:
        fail(f"cu_seqlens is only for tensor_format='thd', got tensor_format={tensor_format!r}")
    s = _seq_len(t, tensor_format)
    if s * cp_size > freqs.shape[0]:
        fail(
            f"freqs has {freqs.shape[0]} positions, fewer than the sequence length {s} times "
            f"cp_size {cp_size}"
        )
    if cp_size > 1 and s % 2:
        fail(f"with cp_size > 1 the local sequence length must be even, got {s}")


def _check_cu_seqlens_values(t: Tensor, freqs: Tensor, cu_seqlens: Tensor, cp_size: int) -> None:
    """The checks that read ``cu_seqlens`` (CPU eager only: elsewhere a host sync)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if bool(cu[0] < 0) or bool((lengths < 0).any()):
        message = f"cu_seqlens must be non-decreasing from 0, got {cu_seqlens.tolist()}"
    elif int(cu[-1]) // cp_size > t.shape[0]:
        message = (f"cu_seqlens[-1] // cp_size ({int(cu[-1]) // cp_size}) exceeds the "
                   f"{t.shape[0]} tokens of t")  # fmt: skip
    elif cp_size > 1 and bool((lengths % (2 * cp_size) != 0).any()):
        message = (f"with cp_size={cp_size} every sequence length in cu_seqlens must be a "
                   f"multiple of 2 * cp_size, got {lengths.tolist()}")  # fmt: skip
    elif int(lengths.max()) > freqs.shape[0]:
        message = (f"freqs has {freqs.shape[0]} positions, fewer than the longest sequence "
                   f"in cu_seqlens ({int(lengths.max())})")  # fmt: skip
    else:
        return
    raise ValueError(_PREFIX + message)


_kernels = functools.partial(submodule, "rotary")  # Triton: imported on first CUDA use


def _rotate_by_device(*args: object, backward: bool) -> Tensor:
    """Both ops' implementations (``backward``: the backward op's): Triton or the reference math."""
    if runs_triton(args[0]):
        return _kernels().rotary(*args, backward=backward)
    return rotary_ref(*args, backward=backward)


# 2. Forward op --------------------------------------------------------------------------------


@op("rotary_fwd")
def rotary_fwd(
    t: Tensor,
    freqs: Tensor,
    cu_seqlens: Tensor | None,
    tensor_format: str,
    interleaved: bool,
    cp_size: int,
    cp_rank: int,
) -> Tensor:
    """RoPE of ``t``."""
    _check_args(t, freqs, cu_seqlens, tensor_format, cp_size, cp_rank)
    args = (t, freqs, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank)
    return _rotate_by_device(*args, backward=False)


# 3. Fake --------------------------------------------------------------------------------------


@rotary_fwd.register_fake
def _rotary_fwd_fake(t, freqs, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank):
    _check_args(t, freqs, cu_seqlens, tensor_format, cp_size, cp_rank)
    return t.new_empty(t.shape)


# 4. Backward op -------------------------------------------------------------------------------


@op("rotary_bwd")
def rotary_bwd(
    grad: Tensor,
    freqs: Tensor,
    cu_seqlens: Tensor | None,
    tensor_format: str,
    interleaved: bool,
    cp_size: int,
    cp_rank: int,
) -> Tensor:
    """The gradient of ``te::rotary_fwd`` with respect to ``t``: the rotation by ``-theta``."""
    args = (grad, freqs, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank)
    return _rotate_by_device(*args, backward=True)


@rotary_bwd.register_fake
def _rotary_bwd_fake(grad, freqs, cu_seqlens, tensor_format, interleaved, cp_size, cp_rank):
    return grad.new_empty(grad.shape)


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:3])  # freqs, cu_seqlens
    ctx.config = tuple(inputs[3:])  # tensor_format, interleaved, cp_size, cp_rank


def _backward(ctx, bwd, grad):
    return bwd(grad, *ctx.saved_tensors, *ctx.config), None, None, None, None, None, None


_rotary = differentiable(
    rotary_fwd,
    rotary_bwd,
    setup_context=_setup_context,
    backward=_backward,
    reference=rotary_ref,
    autocast=False,
)


# Public function ------------------------------------------------------------------------------


def apply_rotary_pos_emb(
    t: Tensor,
    freqs: Tensor,
    tensor_format: str = "sbhd",
    start_positions: Tensor | None = None,
    interleaved: bool = False,
    fused: bool = True,
    cu_seqlens: Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> Tensor:
    """Rotary position embeddings applied to ``t`` (Transformer Engine's
    ``apply_rotary_pos_emb``, its arguments in its order; the module docstring gives the math and
    the layouts, ``docs/ops.md`` the rest). ``fused=True`` (the default here, not in TE):
    ``te::rotary_fwd``; ``fused=False``: the same math in plain torch ops (autograd
    differentiates ``freqs`` too). ``start_positions`` must be None (KV-cache offsets are not
    implemented)."""
    if start_positions is not None:
        raise ValueError(
            _PREFIX + "start_positions must be None: per-sequence position offsets (inference "
            "with a KV cache) are not implemented"
        )
    for name, value in (("cp_size", cp_size), ("cp_rank", cp_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(_PREFIX + f"{name} must be an int, got {value!r}")
    check_bool(_PREFIX[:-2], interleaved=interleaved, fused=fused)
    check_tensor(_PREFIX[:-2], "t", t, floating=False, min_dim=0)
    check_tensor(_PREFIX[:-2], "freqs", freqs, floating=False, min_dim=0)
    if cu_seqlens is not None:
        check_tensor(_PREFIX[:-2], "cu_seqlens", cu_seqlens, floating=False)
    _check_args(t, freqs, cu_seqlens, tensor_format, cp_size, cp_rank)
    if (
        cu_seqlens is not None
        and cu_seqlens.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
    ):
        _check_cu_seqlens_values(t, freqs, cu_seqlens, cp_size)
    rope = _rotary if fused else rotary_ref
    return rope(t, freqs, cu_seqlens, tensor_format, bool(interleaved), cp_size, cp_rank)
