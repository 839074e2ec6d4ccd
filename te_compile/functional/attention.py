r"""Scaled dot-product attention: ``te::attention_fwd`` / ``te::attention_bwd``, the core of
:class:`te_compile.DotProductAttention`.

For each batch entry and query head :math:`n` (served by key/value head :math:`\lfloor n/g
\rfloor`, :math:`g` query heads per key/value head: GQA, and MQA with one key/value head):

.. math::
    S_{ij} = \sigma\, q_i \cdot k_j + B_{ij} - m_n\,|i + o - j|, \qquad
    P_{ij} = \frac{[\,j \in V_i\,]\, e^{S_{ij}}}{[\,e^{\alpha_n}\,] + \sum_{l \in V_i} e^{S_{il}}},
    \qquad y_i = \sum_j \frac{M_{ij}}{1-p}\, P_{ij}\, v_j

with :math:`\sigma` the softmax scale, :math:`B` the post-scale bias, :math:`m` the ALiBi slopes,
:math:`M` the dropout keep mask and :math:`V_i` the keys query :math:`i` may see. A query that
sees no key (a padded query; bottom-right causal with more queries than keys) outputs zeros and
gets zero gradients, as Transformer Engine's fused backends do.

The bracketed :math:`e^{\alpha_n}` is the attention sink of Transformer Engine's
``softmax_type`` (Xiao et al., *Efficient Streaming Language Models with Attention Sinks*): a
key that every query sees, with logit :math:`\alpha_n` (``softmax_offset``, one per query head)
and a zero value, so that a query may attend to nothing. ``off-by-one`` is :math:`\alpha = 0`,
``learnable`` a parameter (its gradient: :func:`attention_bwd_ref`). The sink enters the logsumexp
only: the saved ``lse`` includes it, so the backward's probabilities are the sink softmax's.

Masks (positions local to a sequence; ``docs/attention.md`` gives them in Transformer Engine's
terms, and ``functional/attention_args.py`` turns its arguments into the op's): the window
``(left, right)`` lets query :math:`i` see keys :math:`i + o - \text{left} \le j \le i + o +
\text{right}`, ``-1`` unbounded, causal being ``(left, 0)``; the diagonal offset :math:`o` is 0
(top left) or :math:`s_{kv} - s_q` (bottom right, per sequence for padded and packed batches),
ALiBi using the same. Padding masks remove padded queries and keys; in a packed ``thd`` batch a
query sees keys of its own sequence only, and tokens past ``cu_seqlens[-1]`` are padding.

The op's tensors are ``[b, s, h, d]`` (``thd``: ``b = 1``); ``sbhd`` says that the output and
the gradients are laid out ``[s, b, h, d]`` in memory, so that the module's ``[s, b, h*d]``
output is a view. Arguments: see :class:`_Args`.

CPU, and CUDA where no fused kernel expresses the case (fp64 among them): the reference math
below, in fp32 (fp64 for fp64) rounded once at the end; the forward saves the logsumexp (``+inf``
for a row that sees no key) and the backward recomputes the probabilities from it, as the fused
kernels do. Otherwise PyTorch's fused kernels, which never materialise the softmax, chosen per
case (``attention_cuda.py``). Dropout's keep mask on CPU is te_compile's Philox stream
(``functional.dropout_ops``) of the ``rng_state = (seed, offset)`` input over the probabilities
in ``[b, h, s_q, s_kv]`` order, so the backward and a checkpointed recompute regenerate it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from te_compile._checks import FLOAT_DTYPES
from te_compile._library import differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.functional import attention_args, attention_cuda
from te_compile.functional.dropout_ops import dropout_mask

__all__ = ["attention_bwd_ref", "attention_ref", "dot_product_attention"]


class _Args(NamedTuple):
    r"""``te::attention_fwd``'s arguments, by name.

    ``bias``: post-scale bias ``[b|1, h|1, sq, skv]``; ``alibi_slopes``: fp32 ``[h]`` or
    ``[b, h]``; ``q_padding`` / ``kv_padding``: bool ``[b, sq]`` / ``[b, skv]``, True = padded
    (both or neither); ``mask``: bool ``[b|1, h|1, sq, skv]``, True = masked out;
    ``cu_seqlens_q`` / ``cu_seqlens_kv``: int32 ``[n + 1]`` for packed tokens (``b = 1``;
    ``cu_seqlens_kv`` None: the keys share the queries' layout); ``rng_state``: int64
    ``(seed, offset)``, needed when ``dropout_p > 0``; ``softmax_offset``: fp32 ``[h]``, the
    sink logit :math:`\alpha_n` of each query head (None: plain softmax); ``window_left`` /
    ``window_right``: ``-1`` unbounded; ``bottom_right``: the diagonal's alignment;
    ``max_seqlen_q`` / ``max_seqlen_kv``: bounds on the packed sequences' lengths (the CUDA
    varlen kernels')."""

    query: Tensor
    key: Tensor
    value: Tensor
    bias: Tensor | None
    alibi_slopes: Tensor | None
    q_padding: Tensor | None
    kv_padding: Tensor | None
    mask: Tensor | None
    cu_seqlens_q: Tensor | None
    cu_seqlens_kv: Tensor | None
    rng_state: Tensor | None
    softmax_offset: Tensor | None
    scale: float
    window_left: int
    window_right: int
    bottom_right: bool
    dropout_p: float
    max_seqlen_q: int
    max_seqlen_kv: int
    sbhd: bool


_N_TENSORS = 12  # query .. softmax_offset


# 1. Reference math ----------------------------------------------------------------------------


def _visible(a: _Args) -> tuple[Tensor, Tensor]:
    """``(visible, rel)``: ``visible`` ``[b|1, h|1, sq, skv]`` bool, True where key ``j`` may be
    seen by query ``i`` (both real tokens of one sequence, inside the window and the mask);
    ``rel`` = :math:`i + o - j` in local positions. No host reads: sequence ids come from
    ``searchsorted`` on ``cu_seqlens``."""
    sq, skv, device = a.query.shape[1], a.key.shape[1], a.query.device
    iq, ik = torch.arange(sq, device=device), torch.arange(skv, device=device)
    visible = torch.ones((1, 1, sq, skv), dtype=torch.bool, device=device)
    if a.cu_seqlens_q is not None:
        cq = a.cu_seqlens_q.long()
        ck = cq if a.cu_seqlens_kv is None else a.cu_seqlens_kv.long()
        n = cq.shape[0] - 1
        seq_q = torch.searchsorted(cq, iq, right=True) - 1  # n: past the last sequence
        seq_k = torch.searchsorted(ck, ik, right=True) - 1
        visible = visible & ((seq_q[:, None] == seq_k[None, :]) & (seq_q < n)[:, None])[None, None]
        seq_q, seq_k = seq_q.clamp(max=n - 1), seq_k.clamp(max=n - 1)
        pos_q, pos_k = iq - cq[seq_q], ik - ck[seq_k]
        if a.bottom_right:
            pos_q = pos_q + (ck[1:] - ck[:-1] - cq[1:] + cq[:-1])[seq_q]
        rel = (pos_q[:, None] - pos_k[None, :])[None, None]
    else:
        rel = (iq[:, None] - ik[None, :])[None, None]
        if a.q_padding is not None:
            keep_q, keep_k = ~a.q_padding, ~a.kv_padding
            visible = visible & (keep_q[:, :, None] & keep_k[:, None, :])[:, None]
            if a.bottom_right:
                rel = rel + (keep_k.sum(-1) - keep_q.sum(-1))[:, None, None, None]
        elif a.bottom_right:
            rel = rel + (skv - sq)
    if a.window_left >= 0:
        visible = visible & (rel <= a.window_left)
    if a.window_right >= 0:
        visible = visible & (rel >= -a.window_right)
    if a.mask is not None:
        visible = visible & ~a.mask
    return visible, rel


def _alibi(slopes: Tensor, rel: Tensor, dtype: torch.dtype) -> Tensor:
    """:math:`-m_n |i + o - j|`, ``[b|1, h, sq, skv]``."""
    m = slopes.to(dtype)
    m = m.view(1, -1, 1, 1) if m.dim() == 1 else m[:, :, None, None]
    return -m * rel.abs().to(dtype)


def _heads(x: Tensor, heads: int, dtype: torch.dtype) -> Tensor:
    """``[b, s, hk, d]`` -> ``[b, heads, s, d]`` in ``dtype``, each key/value head serving its
    group of query heads."""
    return attention_cuda.expand_heads(x.to(dtype), heads).transpose(1, 2)


def _scores(a: _Args, rel: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(S, q, k)``: ``S = scale q k^T + bias + alibi`` ``[b, h, sq, skv]`` in the compute dtype,
    with ``q`` and ``k`` as ``[b, h, s, d]`` in that dtype."""
    acc, h = acc_dtype(a.query), a.query.shape[2]
    q, k = _heads(a.query, h, acc), _heads(a.key, h, acc)
    s = (q @ k.transpose(-1, -2)) * a.scale
    if a.bias is not None:
        s = s + a.bias.to(acc)
    if a.alibi_slopes is not None:
        s = s + _alibi(a.alibi_slopes, rel, acc)
    return s, q, k


def _no_autocast(fn: Callable) -> Callable:
    """Runs ``fn(a, ...)`` with autocast off, so that the math runs in the dtypes written here: the
    op path runs an implementation with autocast's dispatch key excluded, and the eager fast path,
    which enters it with autocast on (the op's arguments already cast), must compute the same."""

    @functools.wraps(fn)
    def run(a: _Args, *args):
        with torch.autocast(a.query.device.type, enabled=False):
            return fn(a, *args)

    return run


def _in_layout(x: Tensor, sbhd: bool) -> Tensor:
    """``x`` ``[b, s, h, d]`` laid out ``[s, b, h, d]`` in memory (``sbhd``) or contiguous; no
    copy when it already is."""
    return x.transpose(0, 1).contiguous().transpose(0, 1) if sbhd else x.contiguous()


@_no_autocast
def _forward_ref(a: _Args) -> tuple[Tensor, list[Tensor]]:
    visible, rel = _visible(a)
    s, _, _ = _scores(a, rel)
    row = visible.any(-1, keepdim=True)
    # A row that sees no key gets finite scores, then zero probabilities: no inf - inf anywhere.
    s = s.masked_fill(~visible, -math.inf).masked_fill(~row, 0.0)
    lse = torch.logsumexp(s, -1, keepdim=True)
    if a.softmax_offset is not None:
        lse = torch.logaddexp(lse, a.softmax_offset.to(s.dtype).view(1, -1, 1, 1))
    probs = torch.exp(s - lse).masked_fill(~row, 0.0)
    if a.dropout_p > 0:
        keep = dropout_mask(a.rng_state, probs.shape, a.dropout_p)
        probs = torch.where(keep, probs * (1.0 / (1.0 - a.dropout_p)), 0.0)
    out = (probs @ _heads(a.value, a.query.shape[2], s.dtype)).transpose(1, 2)
    lse = lse.masked_fill(~row, math.inf).squeeze(-1)
    return _in_layout(out.to(a.query.dtype), a.sbhd), [lse.contiguous()]


def attention_ref(*args) -> tuple[Tensor, list[Tensor]]:
    """``(out, [lse])`` for ``te::attention_fwd``'s arguments in plain, differentiable PyTorch:
    the CPU implementation and the float64 reference of the registry test. ``lse``
    ``[b, h, sq]``, ``+inf`` for a row that sees no key."""
    return _forward_ref(_Args(*args))


def _reduce_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    """``x`` ``[b, h, sq, skv]`` summed over the broadcast dims of a ``shape`` bias."""
    dims = [i for i in (0, 1) if shape[i] == 1 and x.shape[i] != 1]
    return x.sum(dims, keepdim=True) if dims else x


@_no_autocast
def attention_bwd_ref(
    a: _Args, grad_out: Tensor, saved: list[Tensor], bias_grad: bool, offset_grad: bool
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    r"""``(dq, dk, dv, [dbias, dsoftmax_offset])`` (each where asked) from the saved logsumexp
    (the sink's term included): :math:`P = e^{S - \mathrm{lse}}`,
    :math:`dV = \tilde P^T dO` (:math:`\tilde P` with dropout applied),
    :math:`dP = M \circ dO\, V^T / (1-p)`, :math:`dS = P \circ (dP - \textstyle\sum_j P\, dP)`,
    :math:`dQ = \sigma\, dS\, K`, :math:`dK = \sigma\, dS^T Q`, :math:`dB = dS`,
    :math:`d\alpha_n = -\sum_{b,i} e^{\alpha_n - \mathrm{lse}_i} \sum_j P\, dP`; fp32 (fp64)
    math, each result rounded once."""
    visible, rel = _visible(a)
    s, q, k = _scores(a, rel)
    acc, hk = s.dtype, a.key.shape[2]
    probs = torch.exp(s.masked_fill(~visible, -math.inf) - saved[0][..., None].to(acc))
    g = grad_out.to(acc).transpose(1, 2)
    dprobs = g @ _heads(a.value, a.query.shape[2], acc).transpose(-1, -2)
    if a.dropout_p > 0:
        keep, c = dropout_mask(a.rng_state, probs.shape, a.dropout_p), 1.0 / (1.0 - a.dropout_p)
        dv = torch.where(keep, probs * c, 0.0).transpose(-1, -2) @ g
        dprobs = torch.where(keep, dprobs * c, 0.0)
    else:
        dv = probs.transpose(-1, -2) @ g
    delta = (probs * dprobs).sum(-1, keepdim=True)
    ds = probs * (dprobs - delta)
    dq = ((ds @ k) * a.scale).transpose(1, 2)
    dk = (ds.transpose(-1, -2) @ q) * a.scale
    extra = [_reduce_to(ds, a.bias.shape).to(a.bias.dtype).contiguous()] if bias_grad else []
    if offset_grad:
        # The sink's value is zero: its dP is 0, so its dS is -P_sink * delta. A row that sees
        # no key has lse = +inf there, hence P_sink = 0.
        sink = a.softmax_offset.to(acc).view(1, -1, 1, 1)
        p_sink = torch.exp(sink - saved[0][..., None].to(acc))
        extra.append(-(p_sink * delta).sum((0, 2, 3)).to(a.softmax_offset.dtype))
    dk = attention_cuda.sum_heads(dk.transpose(1, 2), hk).to(a.key.dtype)
    dv = attention_cuda.sum_heads(dv.transpose(1, 2), hk).to(a.value.dtype)
    return *(_in_layout(x, a.sbhd) for x in (dq.to(a.query.dtype), dk, dv)), extra


def _kernel_bias(a: _Args) -> tuple[Tensor, Tensor]:
    """The masks as the memory-efficient kernel's additive bias (``attention_cuda``'s bias path):
    ``[b, h, sq, skv]`` in the query's dtype, and ``row`` ``[b|1, h|1, sq, 1]``, False for a row
    that sees no key (given an all-zero bias, finite for the kernel, and zeroed around it)."""
    b, sq, h = a.query.shape[:3]
    skv = a.key.shape[1]
    visible, rel = _visible(a)
    row = visible.any(-1, keepdim=True)
    total = torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=a.query.device)
    if a.bias is not None:
        total = total + a.bias.float()
    if a.alibi_slopes is not None:
        total = total + _alibi(a.alibi_slopes, rel, torch.float32)
    total = total.masked_fill(~(visible | ~row), -math.inf).to(a.query.dtype)
    total = F.pad(total, (0, (skv + 15) // 16 * 16 - skv))[..., :skv]  # rows 16-element aligned
    return total.expand(b, h, sq, skv), row


def _plan(a: _Args) -> attention_cuda.Plan | None:
    """The fused CUDA kernel that runs ``a`` (``attention_cuda.plan``), or None where the
    reference math runs: on CPU, and where no kernel expresses the case (fp64; a sink, which
    PyTorch's fused kernels lack: attention_cuda's table)."""
    if a.query.device.type != "cuda" or a.softmax_offset is not None:
        return None
    plain = a.bias is None and a.alibi_slopes is None and a.q_padding is None and a.mask is None
    plan = attention_cuda.plan(
        a.query, a.key, a.value, plain, a.cu_seqlens_q is not None, a.cu_seqlens_kv is None,
        a.window_left, a.window_right, a.bottom_right, a.dropout_p)  # fmt: skip
    return None if plan.kind == "math" else plan


def _broadcasts(t: Tensor, b: int, h: int, sq: int, skv: int) -> bool:
    return (
        t.dim() == 4 and t.shape[0] in (1, b) and t.shape[1] in (1, h) and t.shape[2:] == (sq, skv)
    )


def _check(a: _Args) -> None:
    """The op's constraints, each a ValueError naming the argument, the same in eager and at
    trace time (``attention_args`` checks the public function's arguments first)."""
    q, k, v = a.query, a.key, a.value

    def fail(message: str) -> ValueError:
        return ValueError("te.attention_fwd: " + message)

    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise fail(f"query, key and value must be [b, s, h, d], got {list(q.shape)}, "
                   f"{list(k.shape)}, {list(v.shape)}")  # fmt: skip
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise fail(f"query, key and value must share a floating dtype, got {q.dtype}, "
                   f"{k.dtype}, {v.dtype}")  # fmt: skip
    b, sq, h, d = q.shape
    skv = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
        raise fail(f"key must be [{b}, s_kv, h_kv, {d}] and value [{b}, s_kv, h_kv, d_v], got "
                   f"{list(k.shape)}, {list(v.shape)}")  # fmt: skip
    if h % k.shape[2]:
        raise fail(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[2]})")
    broadcast = f"[1 or {b}, 1 or {h}, {sq}, {skv}]"
    if a.bias is not None and not _broadcasts(a.bias, b, h, sq, skv):
        raise fail(f"bias must be {broadcast}, got {list(a.bias.shape)}")
    slopes = a.alibi_slopes
    if slopes is not None and (slopes.dtype != torch.float32 or slopes.shape not in ((h,), (b, h))):
        raise fail(f"alibi_slopes must be float32 [{h}] or [{b}, {h}], got {slopes.dtype} "
                   f"{list(slopes.shape)}")  # fmt: skip
    pads = [(x.dtype, tuple(x.shape)) for x in (a.q_padding, a.kv_padding) if x is not None]
    if pads and pads != [(torch.bool, (b, sq)), (torch.bool, (b, skv))]:
        raise fail(f"q_padding and kv_padding must both be bool [{b}, {sq}] and [{b}, {skv}]")
    if a.mask is not None and (
        a.mask.dtype != torch.bool or not _broadcasts(a.mask, b, h, sq, skv)
    ):
        raise fail(f"mask must be bool {broadcast}, got {a.mask.dtype} {list(a.mask.shape)}")
    cu_q, cu_kv = a.cu_seqlens_q, a.cu_seqlens_kv
    if cu_q is not None:
        if not (cu_q.dtype == torch.int32 and cu_q.dim() == 1 and cu_q.shape[0] >= 2):
            raise fail(f"cu_seqlens_q must be int32 [n + 1], n >= 1, got {cu_q.dtype} "
                       f"{list(cu_q.shape)}")  # fmt: skip
        if b != 1 or pads:
            raise fail(f"cu_seqlens_q needs packed tokens (b == 1, got {b}) and no padding masks")
    if cu_kv is not None and (
        cu_q is None or cu_kv.dtype != torch.int32 or cu_kv.shape != cu_q.shape
    ):
        raise fail("cu_seqlens_kv must be int32 with cu_seqlens_q's shape")
    if a.window_left < -1 or a.window_right < -1:
        raise fail(f"window_left and window_right must be >= -1, got ({a.window_left}, "
                   f"{a.window_right})")  # fmt: skip
    if not 0.0 <= a.dropout_p < 1.0:
        raise fail(f"dropout_p must be in [0, 1), got {a.dropout_p}")
    rng = a.rng_state
    if a.dropout_p > 0 and (rng is None or rng.dtype != torch.int64 or tuple(rng.shape) != (2,)):
        raise fail("rng_state must be an int64 tensor [2] = (seed, offset) when dropout_p > 0")
    sink = a.softmax_offset
    if sink is not None and (sink.dtype != torch.float32 or tuple(sink.shape) != (h,)):
        raise fail(f"softmax_offset must be float32 [{h}], got {sink.dtype} {list(sink.shape)}")


def _empty_out(like: Tensor, d: int, sbhd: bool) -> Tensor:
    """A ``[b, s, h, d]`` result laid out as :func:`_in_layout` lays it out."""
    b, s, h = like.shape[:3]
    return like.new_empty((s, b, h, d)).transpose(0, 1) if sbhd else like.new_empty((b, s, h, d))


# 2. Forward op --------------------------------------------------------------------------------


@op("attention_fwd")
def attention_fwd(query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None,
                  alibi_slopes: Tensor | None, q_padding: Tensor | None,
                  kv_padding: Tensor | None, mask: Tensor | None, cu_seqlens_q: Tensor | None,
                  cu_seqlens_kv: Tensor | None, rng_state: Tensor | None,
                  softmax_offset: Tensor | None, scale: float, window_left: int,
                  window_right: int, bottom_right: bool, dropout_p: float, max_seqlen_q: int,
                  max_seqlen_kv: int, sbhd: bool) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
    """``(out, saved)``; ``saved``: what the backward needs (the logsumexp; with dropout on CUDA
    also the kernel's Philox seed and offset). The fused kernel :func:`_plan` picks, else the
    reference math."""
    a = _Args(query, key, value, bias, alibi_slopes, q_padding, kv_padding, mask, cu_seqlens_q,
              cu_seqlens_kv, rng_state, softmax_offset, scale, window_left, window_right,
              bottom_right, dropout_p, max_seqlen_q, max_seqlen_kv, sbhd)  # fmt: skip
    _check(a)
    plan = _plan(a)
    if plan is None:
        return _forward_ref(a)
    kernel_bias, row = _kernel_bias(a) if plan.uses_bias else (None, None)
    out, saved = attention_cuda.forward(
        plan, a.query, a.key, a.value, kernel_bias, row, a.cu_seqlens_q, a.cu_seqlens_kv, a.scale,
        a.window_left, a.window_right, a.dropout_p, a.max_seqlen_q, a.max_seqlen_kv)  # fmt: skip
    return _in_layout(out, a.sbhd), saved


# 3. Fake --------------------------------------------------------------------------------------


@attention_fwd.register_fake
def _attention_fwd_fake(*args):
    a = _Args(*args)
    _check(a)
    q, plan = a.query, _plan(a)
    out = _empty_out(q, a.value.shape[-1], a.sbhd)
    if plan is not None:
        shape = attention_cuda.lse_shape(plan, q, a.cu_seqlens_q, a.max_seqlen_q)
        saved = [q.new_empty(shape, dtype=torch.float32)]
        if a.dropout_p > 0 and plan.kind.startswith("efficient"):
            # aten returns the Philox seed and offset as CPU scalars (as CUDA ones only while a
            # CUDA graph is being captured).
            saved += [torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)]
        return out, saved
    b, sq, h = q.shape[:3]
    return out, [q.new_empty((b, h, sq), dtype=acc_dtype(q))]


# 4. Backward op -------------------------------------------------------------------------------


def _efficient_bwd_on_cuda(grad_out, saved, *args) -> str | None:
    """``kept_whole`` of ``te::attention_bwd``: the calls that run the memory-efficient kernel's
    backward stay one opaque call under compile (why: ``docs/op_mechanism.md``)."""
    plan = _plan(_Args(*args[:-2]))
    if plan is not None and plan.kind.startswith("efficient"):
        return "aten's meta of _efficient_attention_backward does not match its schema"
    return None


@op("attention_bwd", kept_whole=_efficient_bwd_on_cuda)
def attention_bwd(grad_out: Tensor, saved: list[Tensor], query: Tensor, key: Tensor,
                  value: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
                  q_padding: Tensor | None, kv_padding: Tensor | None, mask: Tensor | None,
                  cu_seqlens_q: Tensor | None, cu_seqlens_kv: Tensor | None,
                  rng_state: Tensor | None, softmax_offset: Tensor | None, scale: float,
                  window_left: int, window_right: int, bottom_right: bool, dropout_p: float,
                  max_seqlen_q: int, max_seqlen_kv: int, sbhd: bool, bias_grad: bool,
                  offset_grad: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:  # fmt: skip
    """``(dq, dk, dv, extra)``: ``extra`` holds ``d bias`` when ``bias_grad``, then
    ``d softmax_offset`` when ``offset_grad``. ``saved``: the forward's ``out`` (what the fused
    kernels' backward reads), then its ``saved``; the forward's arguments follow. The backward
    of the forward's kernel (the same plan, from the same arguments), else the reference math."""
    a = _Args(query, key, value, bias, alibi_slopes, q_padding, kv_padding, mask, cu_seqlens_q,
              cu_seqlens_kv, rng_state, softmax_offset, scale, window_left, window_right,
              bottom_right, dropout_p, max_seqlen_q, max_seqlen_kv, sbhd)  # fmt: skip
    plan = _plan(a)
    out, saved = saved[0], saved[1:]
    if plan is None:
        return attention_bwd_ref(a, grad_out, saved, bias_grad, offset_grad)
    kernel_bias, row = _kernel_bias(a) if plan.uses_bias else (None, None)
    dq, dk, dv, dbias = attention_cuda.backward(
        plan, grad_out, a.query, a.key, a.value, out, saved, kernel_bias, row, bias_grad,
        a.cu_seqlens_q, a.cu_seqlens_kv, a.scale, a.window_left, a.window_right, a.dropout_p,
        a.max_seqlen_q, a.max_seqlen_kv)  # fmt: skip
    if bias_grad:
        dbias = [_reduce_to(dbias.float(), a.bias.shape).to(a.bias.dtype).contiguous()]
    return *(_in_layout(x, a.sbhd) for x in (dq, dk, dv)), dbias or []


@attention_bwd.register_fake
def _attention_bwd_fake(grad_out, saved, *args):
    a, bias_grad, offset_grad = _Args(*args[:-2]), args[-2], args[-1]
    extra = [a.bias.new_empty(a.bias.shape)] if bias_grad else []
    if offset_grad:
        extra.append(a.softmax_offset.new_empty(a.softmax_offset.shape))
    return *(_empty_out(x, x.shape[-1], a.sbhd) for x in (a.query, a.key, a.value)), extra


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    out, saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(out, *inputs[:_N_TENSORS], *saved)
    ctx.scalars = tuple(inputs[_N_TENSORS:])


def _backward(ctx, bwd, grad_out, _grad_saved):
    out, *tensors = ctx.saved_tensors
    args, saved = tensors[:_N_TENSORS], [out, *tensors[_N_TENSORS:]]
    need = ctx.needs_input_grad
    bias_grad = args[3] is not None and need[3]
    offset_grad = args[11] is not None and need[11]
    dq, dk, dv, extra = bwd(grad_out, saved, *args, *ctx.scalars, bias_grad, offset_grad)
    grads = [g if n else None for g, n in zip((dq, dk, dv), need[:3], strict=True)]
    grads += [None] * (len(need) - 3)
    if bias_grad:
        grads[3] = extra[0]
    if offset_grad:
        grads[11] = extra[-1]
    return tuple(grads)


_attention = differentiable(
    attention_fwd,
    attention_bwd,
    setup_context=_setup_context,
    backward=_backward,
    reference=attention_ref,
)


# Public function ------------------------------------------------------------------------------


def dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | tuple[Tensor, Tensor] | None = None,
    *,
    qkv_format: str = "sbhd",
    attn_mask_type: str = "causal",
    window_size: tuple[int, int] | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_kv: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    core_attention_bias_type: str = "no_bias",
    core_attention_bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
    softmax_type: str = "vanilla",
    softmax_offset: Tensor | None = None,
) -> Tensor:
    r"""Attention with the conventions of Transformer Engine's ``DotProductAttention.forward``
    (``docs/attention.md`` gives every argument), through ``te::attention_fwd``. ``query`` is
    ``[s, b, h, d]`` (``sbhd``), ``[b, s, h, d]`` (``bshd``) or ``[t, h, d]`` (``thd``: packed
    sequences given by ``cu_seqlens_q`` / ``cu_seqlens_kv``); ``key`` and ``value`` have ``h_kv``
    heads dividing ``h`` (GQA). Returns ``[s, b, h*d_v]``, ``[b, s, h*d_v]`` or ``[t, h*d_v]``.
    ``attention_mask`` (True = masked out) is read for the padding mask types and ``"arbitrary"``
    only. ``dropout_p > 0`` draws ``rng_state`` (int64 ``(seed, offset)``) from torch's generator
    unless given. ``softmax_offset``: the ``"learnable"`` sink logits ``[h]``, any floating dtype
    (computed in fp32). Bad arguments raise ValueError naming them."""
    args = attention_args.op_arguments(
        query, key, value, attention_mask, qkv_format, attn_mask_type, window_size, cu_seqlens_q,
        cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, core_attention_bias_type,
        core_attention_bias, alibi_slopes, softmax_scale, dropout_p, rng_state, softmax_type,
        softmax_offset)  # fmt: skip
    out, _ = _attention(*args)
    if qkv_format != "bshd":
        out = out[0] if qkv_format == "thd" else out.transpose(0, 1)
    return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])
