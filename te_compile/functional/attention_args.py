"""Transformer Engine's attention arguments -> those of ``te::attention_fwd`` (``attention.py``).

The conventions are Transformer Engine's (``docs/attention.md``'s argument table: ``qkv_format``,
``attn_mask_type`` and its other spellings, ``window_size``, ``attention_mask``, the bias types,
``softmax_type``), each checked here with a ValueError naming the argument; where Transformer
Engine warns and replaces an incompatible window, this raises. The op takes ``[b, s, h, d]``;
``sbhd`` and ``thd`` are views of it. ``max_seqlen_q`` / ``max_seqlen_kv`` (``thd`` only) bound
the CUDA varlen kernels, capped at the token count; unset, the token count (never read from
``cu_seqlens``: no host synchronisation).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from te_compile._checks import FLOAT_DTYPES, check_choice
from te_compile.functional.dropout_ops import new_rng_state

__all__ = [
    "ATTN_MASK_TYPES",
    "BIAS_TYPES",
    "QKV_FORMATS",
    "SOFTMAX_TYPES",
    "default_alibi_slopes",
    "normalize_mask_type",
    "normalize_window",
    "op_arguments",
]

QKV_FORMATS = ("sbhd", "bshd", "thd")
ATTN_MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
_OWNER = "te.dot_product_attention"


def _fail(message: str) -> ValueError:
    return ValueError(f"{_OWNER}: {message}")


def normalize_mask_type(
    attn_mask_type: str, owner: str = _OWNER, arg: str = "attn_mask_type"
) -> str:
    """The canonical spelling of ``attn_mask_type``; ValueError for an unknown type, naming the
    argument as the caller spelled it (``arg``)."""
    if not isinstance(attn_mask_type, str):
        raise ValueError(f"{owner}: {arg} must be a str, got {attn_mask_type!r}")
    normalized = attn_mask_type.replace(",", "_")
    if normalized == "causal_padding":
        normalized = "padding_causal"
    if normalized not in ATTN_MASK_TYPES:
        raise ValueError(f"{owner}: {arg} must be one of {ATTN_MASK_TYPES}, got {attn_mask_type!r}")
    return normalized


def normalize_window(
    attn_mask_type: str, window_size, owner: str = _OWNER, arg: str = "window_size"
) -> tuple[int, int]:
    """``(left, right)`` for a normalized mask type (the rules above); ``arg``: the window's
    argument name in messages."""
    causal = "causal" in attn_mask_type
    if window_size is None:
        return (-1, 0) if causal else (-1, -1)
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise ValueError(f"{owner}: {arg} must be a pair of ints, got {window_size!r}")
    left, right = window_size
    if causal:
        if (left, right) == (-1, -1):
            return (-1, 0)
        if right == 0 and left >= -1:
            return (left, right)
    elif (left, right) == (-1, -1) or (left >= 0 and right >= 0):
        return (left, right)
    allowed = "(-1, 0) or (>=0, 0)" if causal else "(-1, -1) or (>=0, >=0)"
    raise ValueError(
        f"{owner}: {arg} must be {allowed} for attn_mask_type={attn_mask_type!r}, got "
        f"{tuple(window_size)}"
    )


def default_alibi_slopes(heads: int, device: torch.device | str = "cpu") -> Tensor:
    """The standard ALiBi slopes of ``heads`` heads: float32 ``[heads]`` (a graph constant under
    ``torch.compile``; no cached device tensor). Press et al.'s slopes as Transformer Engine
    computes them: the geometric sequence from 2^(-8/n) for the largest power of two n <= heads,
    then every other slope of 2n heads."""
    from te_compile.kernels import device_constant

    n = 2 ** math.floor(math.log2(heads))
    slopes = [(2.0 ** (-8.0 / n)) ** i for i in range(1, n + 1)]
    slopes += [(2.0 ** (-4.0 / n)) ** i for i in range(1, 2 * (heads - n), 2)]
    return device_constant(tuple(slopes), torch.float32, torch.device(device))


def _check_qkv(query, key, value, qkv_format: str) -> None:
    if not all(isinstance(x, Tensor) for x in (query, key, value)):
        raise _fail("query, key and value must be tensors")
    rank = 3 if qkv_format == "thd" else 4
    shapes = f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
    if query.dim() != rank or key.dim() != rank or value.dim() != rank:
        raise _fail(f"query, key and value must be {rank}-D for qkv_format={qkv_format!r}, got "
                    f"{shapes}")  # fmt: skip
    if query.dtype not in FLOAT_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        raise _fail(f"query, key and value must share a floating dtype, got {query.dtype}, "
                    f"{key.dtype}, {value.dtype}")  # fmt: skip
    if key.device != query.device or value.device != query.device:
        raise _fail("query, key and value must be on one device")
    if key.shape[:-1] != value.shape[:-1]:
        raise _fail(f"key and value must agree in all but the head dim, got {shapes}")
    if query.shape[-1] != key.shape[-1]:
        raise _fail(f"query and key must have one head dim, got {shapes}")
    if query.shape[-2] % key.shape[-2]:
        raise _fail(f"query heads ({query.shape[-2]}) must be a multiple of key/value heads "
                    f"({key.shape[-2]}), got {shapes}")  # fmt: skip
    batch = {"sbhd": 1, "bshd": 0}.get(qkv_format)
    if batch is not None and query.shape[batch] != key.shape[batch]:
        raise _fail(f"query and key must have one batch size ({qkv_format}), got {shapes}")


def _check_cu_seqlens(name: str, cu, device: torch.device, batch: int | None) -> None:
    if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
        raise _fail(f"{name} must be an int32 tensor [batch_size + 1], got {_described(cu)}")
    if cu.device != device:
        raise _fail(f"{name} must be on {device}, got {cu.device}")
    if cu.shape[0] < 2 or (batch is not None and cu.shape[0] != batch + 1):
        want = "at least 2" if batch is None else f"batch_size + 1 = {batch + 1}"
        raise _fail(f"{name} must have {want} entries, got {cu.shape[0]}")


def _padding(mask, which: str, b: int, s: int) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != (b, 1, 1, s):
        raise _fail(f"attention_mask ({which}) must be a bool tensor [{b}, 1, 1, {s}] "
                    f"(True = padded), got {_described(mask)}")  # fmt: skip
    return mask[:, 0, 0, :]


def _padding_masks(attention_mask, cu_q, cu_kv, b: int, sq: int, skv: int, device):
    """``(q_padding, kv_padding)``, bool ``[b, s]``, of a padded sbhd / bshd batch."""
    if attention_mask is not None:
        if isinstance(attention_mask, (tuple, list)):
            if len(attention_mask) != 2:
                raise _fail("attention_mask must be a tensor or a (q_mask, kv_mask) pair")
            q_mask, kv_mask = attention_mask
        elif sq != skv:
            raise _fail(f"attention_mask must be a (q_mask, kv_mask) pair when the query and "
                        f"key/value sequence lengths differ ({sq} != {skv})")  # fmt: skip
        else:
            q_mask = kv_mask = attention_mask
        return _padding(q_mask, "query", b, sq), _padding(kv_mask, "key/value", b, skv)
    if cu_q is None or cu_kv is None:
        raise _fail("padding mask types need attention_mask, or cu_seqlens_q and cu_seqlens_kv")
    _check_cu_seqlens("cu_seqlens_q", cu_q, device, b)
    _check_cu_seqlens("cu_seqlens_kv", cu_kv, device, b)

    def from_lengths(cu: Tensor, s: int) -> Tensor:
        return torch.arange(s, device=device)[None, :] >= (cu[1:] - cu[:-1]).long()[:, None]

    return from_lengths(cu_q, sq), from_lengths(cu_kv, skv)


def _arbitrary(mask, b: int, h: int, sq: int, skv: int) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise _fail("attention_mask must be a bool tensor (True = masked out) for "
                    "attn_mask_type='arbitrary'")  # fmt: skip
    want = (b, h, sq, skv)
    if mask.dim() != 4 or any(m not in (1, w) for m, w in zip(mask.shape, want, strict=True)):
        raise _fail(f"attention_mask must broadcast to [b, h, s_q, s_kv] = {list(want)}, got "
                    f"{list(mask.shape)}")  # fmt: skip
    return mask.expand(mask.shape[0], mask.shape[1], sq, skv)


def _bias(bias, b: int, h: int, sq: int, skv: int) -> Tensor:
    """Transformer Engine's bias shapes (bhss, 1hss, b1ss, 11ss, 111s) as [b|1, h|1, sq, skv]."""
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        raise _fail("core_attention_bias must be a floating tensor")
    if (
        bias.dim() != 4
        or bias.shape[3] != skv
        or any(m not in (1, w) for m, w in zip(bias.shape[:3], (b, h, sq), strict=True))
    ):
        raise _fail(f"core_attention_bias must be [1 or {b}, 1 or {h}, 1 or {sq}, {skv}], got "
                    f"{list(bias.shape)}")  # fmt: skip
    return bias.expand(bias.shape[0], bias.shape[1], sq, skv)


def _slopes(alibi_slopes, b: int, h: int, thd: bool, device) -> Tensor:
    if alibi_slopes is None:
        return default_alibi_slopes(h, device)
    shapes = ((h,),) if thd else ((h,), (b, h))
    if (
        not isinstance(alibi_slopes, Tensor)
        or alibi_slopes.dtype != torch.float32
        or tuple(alibi_slopes.shape) not in shapes
    ):
        raise _fail(f"alibi_slopes must be a float32 tensor {' or '.join(map(str, shapes))}, "
                    f"got {_described(alibi_slopes)}")  # fmt: skip
    if alibi_slopes.device != device:
        raise _fail(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")
    return alibi_slopes


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _described(x: object) -> str:
    """``x`` as an error message shows it: a tensor by dtype and shape, else its repr."""
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else repr(x)


def _softmax_offset(softmax_type, softmax_offset, h: int, device) -> Tensor | None:
    """The op's ``softmax_offset``: None (vanilla), zeros (off-by-one) or the given logits as
    fp32 ``[h]``."""
    check_choice(_OWNER, "softmax_type", softmax_type, SOFTMAX_TYPES)
    if softmax_type != "learnable":
        if softmax_offset is not None:
            raise _fail(f"softmax_offset must be None for softmax_type={softmax_type!r} (only "
                        "'learnable' takes one)")  # fmt: skip
        return None if softmax_type == "vanilla" else torch.zeros(h, device=device)
    if softmax_offset is None:
        raise _fail("softmax_type='learnable' needs softmax_offset, a floating tensor [h]")
    if (
        not isinstance(softmax_offset, Tensor)
        or not softmax_offset.is_floating_point()
        or tuple(softmax_offset.shape) != (h,)
    ):
        raise _fail(f"softmax_offset must be a floating tensor [{h}] (one logit per query "
                    f"head), got {_described(softmax_offset)}")  # fmt: skip
    if softmax_offset.device != device:
        raise _fail(f"softmax_offset must be on {device}, got {softmax_offset.device}")
    return softmax_offset.float()


def op_arguments(
    query, key, value, attention_mask, qkv_format, attn_mask_type, window_size, cu_seqlens_q,
    cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, core_attention_bias_type, core_attention_bias,
    alibi_slopes, softmax_scale, dropout_p, rng_state, softmax_type, softmax_offset,
) -> tuple:  # fmt: skip
    """``te::attention_fwd``'s arguments for a call of
    :func:`te_compile.functional.dot_product_attention` (its arguments, in order)."""
    check_choice(_OWNER, "qkv_format", qkv_format, QKV_FORMATS)
    mask_type = normalize_mask_type(attn_mask_type)
    left, right = normalize_window(mask_type, window_size)
    _check_qkv(query, key, value, qkv_format)
    check_choice(_OWNER, "core_attention_bias_type", core_attention_bias_type, BIAS_TYPES)
    if not _real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise _fail(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if softmax_scale is not None and not (_real(softmax_scale) and 0 < softmax_scale < math.inf):
        raise _fail(f"softmax_scale must be a positive float (finite, > 0), got {softmax_scale!r}")
    # Checked for every format (a bound given for sbhd / bshd is not silently ignored).
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise _fail(f"{name} must be a positive int, got {n!r}")

    thd = qkv_format == "thd"
    if thd:
        q, k, v = query[None], key[None], value[None]
    elif qkv_format == "sbhd":
        q, k, v = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    else:
        q, k, v = query, key, value
    b, sq, h, d = q.shape
    skv, device = k.shape[1], query.device

    q_pad = kv_pad = mask = cu_q = cu_kv = None
    if thd:
        if "padding" not in mask_type:
            raise _fail(f"qkv_format='thd' needs a padding mask type, got attn_mask_type="
                        f"{mask_type!r}")  # fmt: skip
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise _fail("qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv")
        if attention_mask is not None:
            raise _fail("attention_mask is not supported with qkv_format='thd': use cu_seqlens")
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device, None)
        _check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, device, None)
        if cu_seqlens_q.shape != cu_seqlens_kv.shape:
            raise _fail(f"cu_seqlens_q and cu_seqlens_kv must have one length, got "
                        f"{cu_seqlens_q.shape[0]} and {cu_seqlens_kv.shape[0]}")  # fmt: skip
        # The same tensor on both sides tells the CUDA kernels that q and kv share one layout.
        cu_q, cu_kv = cu_seqlens_q, None if cu_seqlens_kv is cu_seqlens_q else cu_seqlens_kv
    elif "padding" in mask_type:
        q_pad, kv_pad = _padding_masks(attention_mask, cu_seqlens_q, cu_seqlens_kv, b, sq, skv,
                                       device)  # fmt: skip
    elif mask_type == "arbitrary":
        if attention_mask is None:
            raise _fail("attn_mask_type='arbitrary' needs attention_mask")
        mask = _arbitrary(attention_mask, b, h, sq, skv)

    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    bias = slopes = None
    if core_attention_bias_type in ("pre_scale_bias", "post_scale_bias"):
        if core_attention_bias is None:
            raise _fail(f"core_attention_bias_type={core_attention_bias_type!r} needs "
                        "core_attention_bias")  # fmt: skip
        if thd:
            raise _fail("core_attention_bias is not supported with qkv_format='thd'")
        bias = _bias(core_attention_bias, b, h, sq, skv)
        if core_attention_bias_type == "pre_scale_bias":
            bias = bias * scale  # softmax((QK^T + B) * scale)
    elif core_attention_bias is not None:
        raise _fail(f"core_attention_bias must be None for core_attention_bias_type="
                    f"{core_attention_bias_type!r}")  # fmt: skip
    if core_attention_bias_type == "alibi":
        slopes = _slopes(alibi_slopes, b, h, thd, device)
    elif alibi_slopes is not None:
        raise _fail("alibi_slopes needs core_attention_bias_type='alibi'")

    sink = _softmax_offset(softmax_type, softmax_offset, h, device)
    p = float(dropout_p)
    if p > 0 and rng_state is None:
        rng_state = new_rng_state(device)
    max_q, max_kv = sq, skv
    if thd:  # the bounds are checked above
        max_q = sq if max_seqlen_q is None else torch.sym_min(max_seqlen_q, sq)
        max_kv = skv if max_seqlen_kv is None else torch.sym_min(max_seqlen_kv, skv)
    bottom_right = mask_type not in ("causal", "padding_causal")
    return (
        q, k, v, bias, slopes, q_pad, kv_pad, mask, cu_q, cu_kv, rng_state if p > 0 else None,
        sink, scale, left, right, bottom_right, p, max_q, max_kv, qkv_format == "sbhd")  # fmt: skip
