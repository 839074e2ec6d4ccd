"""PyTorch's fused attention kernels on CUDA: which one runs each case of ``te::attention_fwd/_bwd``
and how it is called. CUDA only (written against the aten schemas of torch 2.11 - 2.13, which
match; ``tests/functional/test_attention_cuda.py`` checks every kind on a GPU).

``plan`` walks the kernel table of ``docs/attention.md`` (first match wins) and names a kind:
``cudnn`` (``aten._scaled_dot_product_cudnn_attention`` / ``_backward`` on ``[b, h, s, d]``
views of the op's tensors, any strides); ``flash`` / ``flash_varlen``
(``_flash_attention_forward`` / ``_backward``, dense or 3-D ``[t, h, d]`` with ``cum_seq_q/k``;
varlen takes top-left windows only when q and kv share cu_seqlens); ``efficient`` /
``efficient_varlen`` (``_efficient_attention_forward`` / ``_backward``, GQA by expanding K/V;
varlen: batch 1, plain causal or no mask); ``math`` (the reference math: fp64, a sink softmax,
``thd`` cases no kernel expresses). ``cudnn`` runs where SDPA's own dispatcher would pick
cuDNN for these tensors, asked of small real tensors (``_sdpa_choice``) so that the fake and
the CUDA kernel choose alike; ``sdpa_kernel`` and ``enable_*_sdp`` steer both.

``efficient`` takes masks as an additive bias (a causal-only one as ``Plan.mask_type``): the bias
path materialises one ``[b|1, h|1, sq, skv]`` tensor in the query's dtype (-inf where masked, user
bias and ALiBi added, last dim padded to 16 elements as the kernel's loads need) and expands it to
``[b, h, sq, skv]`` (stride 0, no copy). A query row that sees no key (a padded query, bottom-right
causal with sq > skv) is given an all-zero bias row instead, and its output and incoming gradient
are zeroed around the kernel: the kernels' behaviour on an all ``-inf`` row is not relied on.

Dropout: the fused kernels draw their Philox seed and offset from the CUDA generator and return
them; they are saved for the backward (``docs/attention.md``, Dropout). The op's ``rng_state``
input is used by the ``math`` path only. Under ``torch.compile`` the aten ops are traced (tagged
``nondeterministic_seeded``) as they are for ``F.scaled_dot_product_attention``.

Head dims: flash needs q, k and v with one head dim, a multiple of 8; the mem-efficient kernel's
vectorised loads want multiples of 8 too. Inputs are zero-padded (zeros add nothing to QK^T; a
zero column of V gives a zero output column, sliced off) when needed, and gradients sliced back.
Tokens of a ``thd`` batch past ``cu_seqlens[-1]`` are not written by the varlen kernels: their
outputs and gradients are set to zero here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["Plan", "backward", "expand_heads", "forward", "plan", "sum_heads"]

_HALF = (torch.float16, torch.bfloat16)
_CUDNN = SDPBackend.CUDNN_ATTENTION.value


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel for one call: ``kind`` (a row of the table above) and, for ``efficient``,
    ``mask_type``: aten's ``custom_mask_type`` (0 none, 1 causal top-left, 2 causal bottom-right)
    or -1 for the bias path."""

    kind: str
    mask_type: int = 0

    @property
    def uses_bias(self) -> bool:
        return self.kind == "efficient" and self.mask_type < 0


def _flash_ok(q: Tensor, v: Tensor, dropout_p: float) -> bool:
    return (
        q.dtype in _HALF
        and max(q.shape[-1], v.shape[-1]) <= 256
        and dropout_p == 0.0
        and torch.backends.cuda.flash_sdp_enabled()
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def _cudnn_ok(
    q: Tensor, k: Tensor, v: Tensor, window_left: int, window_right: int, dropout_p: float
) -> bool:
    """SDPA's dispatcher would run cuDNN's attention for these dense tensors (no window; causal
    only where top-left and bottom-right coincide); head dims this module's backward takes."""
    if not (q.dtype in _HALF and dropout_p == 0.0 and window_left < 0 and window_right <= 0):
        return False
    b, sq, h, d = q.shape
    skv, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if d % 8 or dv % 8 or max(d, dv) > 128 or skv == 1 or max(b, h) > 65535:
        return False
    causal = window_right == 0
    if causal and sq != skv:
        return False
    return _sdpa_choice(q.device, q.dtype, int(h), int(hk), int(d), int(dv), causal) == _CUDNN


def _sdpa_choice(
    device: torch.device, dtype: torch.dtype, h: int, hk: int, d: int, dv: int, causal: bool
) -> int:
    """The backend (an ``SDPBackend`` value) SDPA's dispatcher picks for dense ``[b, h, s, d]``
    tensors of these dtype, heads and head dims, no dropout, no mask, under the current SDPA
    settings (backends enabled, their priority order, deterministic mode). Asked of small real
    tensors: on fake ones (the op's fake, its trace) ``torch._fused_sdp_choice``'s meta answers
    math. The batch, the sequence lengths (beyond ``_cudnn_ok``'s checks) and the strides do not
    change the choice."""
    state = (
        torch.backends.cuda.cudnn_sdp_enabled(),
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        tuple(torch._C._get_sdp_priority_order()),
    )
    return _probe(torch.device(device), dtype, h, hk, d, dv, causal, state)


@functools.lru_cache(maxsize=64)
def _probe(device, dtype, h, hk, d, dv, causal, state) -> int:
    del state  # a key only: torch reads the settings itself
    with _disable_current_modes(), unset_fake_temporarily():
        q = torch.empty(1, h, 64, d, device=device, dtype=dtype)
        k = torch.empty(1, hk, 64, d, device=device, dtype=dtype)
        v = torch.empty(1, hk, 64, dv, device=device, dtype=dtype)
        return int(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=True))


def _causal_type(window_left: int, window_right: int, bottom_right: bool) -> int | None:
    """aten's ``custom_mask_type`` for a window the mem-efficient kernel expresses without a
    bias (no left bound; right bound none or the diagonal), else None."""
    if window_left >= 0 or window_right > 0:
        return None
    if window_right < 0:
        return 0
    return 2 if bottom_right else 1


def plan(q: Tensor, k: Tensor, v: Tensor, plain: bool, varlen: bool, same_layout: bool,
         window_left: int, window_right: int, bottom_right: bool,
         dropout_p: float) -> Plan:  # fmt: skip
    """The kernel for these arguments (shapes, dtypes and flags only: the fake makes the same
    choice). ``plain``: no bias, ALiBi, mask or padding; ``same_layout``: q and kv share
    cu_seqlens, so top-left and bottom-right alignment coincide per sequence."""
    if q.dtype == torch.float64:
        return Plan("math")
    sq, skv = q.shape[1], k.shape[1]
    windowed = window_left >= 0 or window_right >= 0
    aligned = bottom_right or not windowed or (same_layout if varlen else sq == skv)
    if plain and not varlen and _cudnn_ok(q, k, v, window_left, window_right, dropout_p):
        return Plan("cudnn")
    if plain and aligned and _flash_ok(q, v, dropout_p):
        return Plan("flash_varlen" if varlen else "flash")
    if not torch.backends.cuda.mem_efficient_sdp_enabled():
        return Plan("math")
    causal_type = _causal_type(window_left, window_right, bottom_right)
    if varlen:
        # Bottom-right rows with no key (a sequence with more queries than keys) only where the
        # layouts differ; the kernel's handling of such rows is not relied on.
        if plain and causal_type is not None and (causal_type < 2 or same_layout):
            return Plan("efficient_varlen", causal_type)
        return Plan("math")
    if plain and causal_type is not None and (causal_type < 2 or sq <= skv):
        return Plan("efficient", causal_type)
    return Plan("efficient", -1)


def lse_shape(p: Plan, q: Tensor, cu_seqlens_q: Tensor | None, max_seqlen_q: int) -> tuple:
    """Shape of the fp32 logsumexp each kernel returns (and its backward takes)."""
    b, sq, h = q.shape[0], q.shape[1], q.shape[2]
    if p.kind == "flash_varlen":
        return (h, sq)
    if p.kind == "efficient_varlen":
        return (cu_seqlens_q.shape[0] - 1, h, (max_seqlen_q + 31) // 32 * 32)
    if p.kind == "efficient":
        return (b, h, (sq + 31) // 32 * 32)
    if p.kind == "cudnn":
        return (b, h, sq, 1)
    return (b, h, sq)


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _pad_last(x: Tensor, size: int) -> Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def expand_heads(x: Tensor, heads: int) -> Tensor:
    """GQA as equal head counts (the mem-efficient kernel; the reference math): ``[b, s, hk, d]``
    -> ``[b, s, heads, d]``, kv head ``j`` serving query heads ``j*g .. j*g+g-1``."""
    b, s, hk, d = x.shape
    if hk == heads:
        return x
    return x[:, :, :, None].expand(b, s, hk, heads // hk, d).reshape(b, s, heads, d)


def sum_heads(dx: Tensor, kv_heads: int) -> Tensor:
    """The inverse's gradient: ``[b, s, h, d]`` summed over each kv head's group of query heads."""
    b, s, h, d = dx.shape
    if h == kv_heads:
        return dx
    return dx.reshape(b, s, kv_heads, h // kv_heads, d).sum(3)


def _padded(p: Plan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-padded head dims: one common dim for flash, each a multiple of 8 for efficient."""
    if p.kind.startswith("flash"):
        d = _round8(max(q.shape[-1], v.shape[-1]))
        return _pad_last(q, d), _pad_last(k, d), _pad_last(v, d)
    dqk = _round8(q.shape[-1])
    return _pad_last(q, dqk), _pad_last(k, dqk), _pad_last(v, _round8(v.shape[-1]))


def _valid_tokens(cu_seqlens: Tensor, n: int) -> Tensor:
    """[n, 1, 1] bool: the token lies inside some sequence (before ``cu_seqlens[-1]``)."""
    return (torch.arange(n, device=cu_seqlens.device) < cu_seqlens[-1])[:, None, None]


def forward(p: Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
            row_valid: Tensor | None, cu_seqlens_q: Tensor | None, cu_seqlens_kv: Tensor | None,
            scale: float, window_left: int, window_right: int, dropout_p: float,
            max_seqlen_q: int, max_seqlen_kv: int) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
    """``(out [b, sq, h, dv], saved)``; ``saved`` = ``[lse]`` (+ the Philox seed and offset the
    mem-efficient kernel drew, with dropout). ``bias``: the kernel bias of the bias path
    (``[b, h, sq, skv]``, q's dtype), ``row_valid``: ``[b|1, h|1, sq, 1]``, False for rows that
    see no key."""
    dv = v.shape[-1]
    causal = window_right == 0
    window = {"window_size_left": window_left, "window_size_right": window_right}
    cu_kv = cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv
    if p.kind == "cudnn":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True, 0.0, causal,
            False, scale=scale)  # fmt: skip
        return out.transpose(1, 2), [lse]
    qp, kp, vp = _padded(p, q, k, v)
    if p.kind == "flash":
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            qp, kp, vp, None, None, q.shape[1], k.shape[1], 0.0, causal, False,
            scale=scale, **window)  # fmt: skip
        return out[..., :dv], [lse]
    if p.kind == "flash_varlen":
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            qp[0], kp[0], vp[0], cu_seqlens_q, cu_kv, max_seqlen_q, max_seqlen_kv, 0.0, causal,
            False, scale=scale, **window)  # fmt: skip
        out = torch.where(_valid_tokens(cu_seqlens_q, out.shape[0]), out[..., :dv], 0.0)
        return out[None], [lse]
    kp, vp = expand_heads(kp, q.shape[2]), expand_heads(vp, q.shape[2])
    if p.kind == "efficient_varlen":
        out, lse, seed, offset, *_ = torch.ops.aten._efficient_attention_forward(
            qp, kp, vp, None, cu_seqlens_q, cu_kv, max_seqlen_q, max_seqlen_kv, dropout_p,
            p.mask_type, True, scale=scale)  # fmt: skip
        out = torch.where(_valid_tokens(cu_seqlens_q, out.shape[1])[None], out[..., :dv], 0.0)
        return out, [lse, seed, offset] if dropout_p > 0 else [lse]
    out, lse, seed, offset, *_ = torch.ops.aten._efficient_attention_forward(
        qp, kp, vp, bias, None, None, None, None, dropout_p, max(p.mask_type, 0), True,
        scale=scale)  # fmt: skip
    out = out[..., :dv]
    if row_valid is not None:
        out = torch.where(row_valid.transpose(1, 2), out, 0.0)
    return out, [lse, seed, offset] if dropout_p > 0 else [lse]


def backward(p: Plan, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
             saved: list[Tensor], bias: Tensor | None, row_valid: Tensor | None, bias_grad: bool,
             cu_seqlens_q: Tensor | None, cu_seqlens_kv: Tensor | None, scale: float,
             window_left: int, window_right: int, dropout_p: float, max_seqlen_q: int,
             max_seqlen_kv: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``(dq, dk, dv, dbias)`` through the backward of the forward's kernel; ``dbias`` is the
    gradient of the kernel bias (``[b, h, sq, skv]``) when ``bias_grad``, else None."""
    d, dv, hk = q.shape[-1], v.shape[-1], k.shape[2]
    causal = window_right == 0
    window = {"window_size_left": window_left, "window_size_right": window_right}
    cu_kv = cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv
    # The Philox seed and offset's placeholder where the kernel reads none (no dropout).
    unused = torch.empty((), dtype=torch.int64, device=q.device)
    if p.kind == "cudnn":
        if grad_out.stride() != out.stride():  # cuDNN reads dO laid out as O
            grad_out = torch.empty_like(out).copy_(grad_out)
        dq, dk, dvv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            out.transpose(1, 2), saved[0], unused, unused, None, None, None, q.shape[1],
            k.shape[1], 0.0, causal, scale=scale)  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dvv.transpose(1, 2), None
    qp, kp, vp = _padded(p, q, k, v)
    outp, gp = _pad_last(out, vp.shape[-1]), _pad_last(grad_out, vp.shape[-1])
    lse = saved[0]
    if p.kind.startswith("flash"):
        # No dropout on this path: the kernel reads no RNG state; placeholders of the forward's.
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        if p.kind == "flash":
            dq, dk, dvv = torch.ops.aten._flash_attention_backward(
                gp, qp, kp, vp, outp, lse, None, None, q.shape[1], k.shape[1], 0.0, causal,
                rng, unused, scale=scale, **window)  # fmt: skip
            return dq[..., :d], dk[..., :d], dvv[..., :dv], None
        dq, dk, dvv = torch.ops.aten._flash_attention_backward(
            gp[0], qp[0], kp[0], vp[0], outp[0], lse, cu_seqlens_q, cu_kv, max_seqlen_q,
            max_seqlen_kv, 0.0, causal, rng, unused, scale=scale, **window)  # fmt: skip
        vq, vk = _valid_tokens(cu_seqlens_q, dq.shape[0]), _valid_tokens(cu_kv, dk.shape[0])
        dq = torch.where(vq, dq[..., :d], 0.0)
        dk, dvv = torch.where(vk, dk[..., :d], 0.0), torch.where(vk, dvv[..., :dv], 0.0)
        return dq[None], dk[None], dvv[None], None
    kp, vp = expand_heads(kp, q.shape[2]), expand_heads(vp, q.shape[2])
    seed, offset = (saved[1], saved[2]) if dropout_p > 0 else (unused, unused)
    if p.kind == "efficient_varlen":
        dq, dk, dvv, _ = torch.ops.aten._efficient_attention_backward(
            gp, qp, kp, vp, None, outp, cu_seqlens_q, cu_kv, max_seqlen_q, max_seqlen_kv, lse,
            dropout_p, seed, offset, p.mask_type, False, scale=scale)  # fmt: skip
        vq, vk = _valid_tokens(cu_seqlens_q, dq.shape[1]), _valid_tokens(cu_kv, dk.shape[1])
        dq = torch.where(vq[None], dq[..., :d], 0.0)
        dk = torch.where(vk[None], sum_heads(dk, hk)[..., :d], 0.0)
        dvv = torch.where(vk[None], sum_heads(dvv, hk)[..., :dv], 0.0)
        return dq, dk, dvv, None
    if row_valid is not None:
        gp = torch.where(row_valid.transpose(1, 2), gp, 0.0)
    dq, dk, dvv, dbias = torch.ops.aten._efficient_attention_backward(
        gp, qp, kp, vp, bias, outp, None, None, q.shape[1], k.shape[1], lse, dropout_p, seed,
        offset, max(p.mask_type, 0), bias_grad, scale=scale)  # fmt: skip
    dk, dvv = sum_heads(dk, hk), sum_heads(dvv, hk)
    return dq[..., :d], dk[..., :d], dvv[..., :dv], dbias if bias_grad else None
