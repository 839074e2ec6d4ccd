"""``te_compile.DotProductAttention``: Transformer Engine's core attention module (no projections:
``query``, ``key`` and ``value`` come in already split into heads).

The constructor and ``forward`` take Transformer Engine's arguments with its defaults and meaning
(``attn_mask_type="causal"``, ``qkv_format="sbhd"``, ``softmax_scale = 1/sqrt(kv_channels)``,
``window_size`` / ``attn_mask_type`` overridable per call); the math, the masks and the kernels
are those of :func:`te_compile.functional.dot_product_attention` (``functional/attention.py``).
With tensor parallelism each rank holds ``num_attention_heads / tp_size`` query heads and
``num_gqa_groups / tp_size`` key/value heads: attention needs no communication. Not supported:
context parallelism, FP8 attention, KV caching (``inference_params``), packed ``qkv_layer``
inputs and ``cu_seqlens_*_padded``.

``softmax_type`` (Transformer Engine's attention sinks): ``"vanilla"``, ``"off-by-one"`` (a sink
of logit 0 in every head's softmax denominator) or ``"learnable"``, whose per-head sink logits
are the Parameter ``softmax_offset`` (fp32 ``[num_attention_heads / tp_size]``, zeros at
construction; the name, shape and initial value of Transformer Engine's, so checkpoints load
either way). The math is in ``functional/attention.py``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from te_compile._checks import check_bool, check_int, check_positive_finite, default_device
from te_compile.functional import attention_args as A
from te_compile.functional.attention import dot_product_attention
from te_compile.functional.dropout_ops import new_rng_state
from te_compile.modules._common import check_choice, check_positive, check_rng_tracker, rng_fork
from te_compile.modules._te_signature import te_signature
from te_compile.quantization.te_extra_state import accept_te_extra_state

__all__ = ["DotProductAttention"]

_NAME = "DotProductAttention"


def _tp_size(tp_size: int, tp_group) -> int:
    if tp_group is None:
        return tp_size
    import torch.distributed as dist

    return dist.get_world_size(tp_group)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with Transformer Engine's API. ``kv_channels`` is the head
    dim of keys and values, or a ``(k, v)`` pair when they differ. Output: ``[s, b, h*d_v]``
    (``sbhd``), ``[b, s, h*d_v]`` (``bshd``) or ``[t, h*d_v]`` (``thd``), ``h`` the local heads.
    Dropout (``attention_dropout``) applies in training mode only; with
    ``get_rng_state_tracker`` (Transformer Engine's: a callable returning a tracker with a
    ``fork()`` context manager, e.g. Megatron's ``CudaRNGStatesTracker``) its mask is drawn
    inside the tracker's ``fork()`` (not with ``sequence_parallel``, as in Transformer Engine),
    so torch's default generator is not advanced. ``softmax_type``: see the module docstring."""

    @te_signature("DotProductAttention")
    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        *,
        attention_type: str = "self",
        layer_number: int | None = None,
        softmax_scale: float | None = None,
        tp_size: int = 1,
        tp_group=None,
        sequence_parallel: bool = False,
        get_rng_state_tracker: Callable | None = None,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        accept_te_extra_state(self, attention=True)  # TE's FP8 attention state: none taken
        check_positive(_NAME, num_attention_heads=num_attention_heads)
        check_rng_tracker(_NAME, get_rng_state_tracker, None)
        self.get_rng_state_tracker = get_rng_state_tracker
        check_bool(_NAME, sequence_parallel=sequence_parallel)
        if isinstance(kv_channels, (tuple, list)) and len(kv_channels) == 2:
            channels_k, channels_v = kv_channels
        else:
            channels_k = channels_v = kv_channels
        check_positive(_NAME, kv_channels=channels_k)
        check_positive(_NAME, kv_channels=channels_v)
        gqa = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        check_positive(_NAME, num_gqa_groups=gqa)
        if num_attention_heads % gqa:
            raise ValueError(
                f"{_NAME}: num_attention_heads ({num_attention_heads}) must be divisible by "
                f"num_gqa_groups ({gqa})"
            )
        tp = _tp_size(tp_size, tp_group)
        check_positive(_NAME, tp_size=tp)
        if num_attention_heads % tp or gqa % tp:
            raise ValueError(
                f"{_NAME}: num_attention_heads ({num_attention_heads}) and num_gqa_groups "
                f"({gqa}) must be divisible by tp_size ({tp})"
            )
        if (
            not isinstance(attention_dropout, (int, float))
            or isinstance(attention_dropout, bool)
            or not 0.0 <= attention_dropout < 1.0
        ):
            raise ValueError(
                f"{_NAME}: attention_dropout must be a float in [0, 1), got {attention_dropout!r}"
            )
        check_choice(_NAME, "qkv_format", qkv_format, A.QKV_FORMATS)
        check_choice(_NAME, "attention_type", attention_type, ("self", "cross"))
        self.attn_mask_type = A.normalize_mask_type(attn_mask_type, _NAME)
        A.normalize_window(self.attn_mask_type, window_size, _NAME)  # checked, kept as given
        if softmax_scale is not None:
            check_positive_finite(_NAME, softmax_scale=softmax_scale)
        if layer_number is not None:
            check_int(_NAME, 1, layer_number=layer_number)
        check_choice(_NAME, "softmax_type", softmax_type, A.SOFTMAX_TYPES)

        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = gqa
        self.hidden_size_per_attention_head_k = channels_k
        self.hidden_size_per_attention_head_v = channels_v
        self.tp_size, self.tp_group, self.sequence_parallel = tp, tp_group, sequence_parallel
        self.num_attention_heads_per_partition = num_attention_heads // tp
        self.num_gqa_groups_per_partition = gqa // tp
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = qkv_format
        self.window_size = None if window_size is None else tuple(window_size)
        self.attention_type = attention_type
        self.layer_number = 1 if layer_number is None else layer_number
        self.softmax_scale = (
            1.0 / math.sqrt(channels_k) if softmax_scale is None else float(softmax_scale)
        )
        self.softmax_type = softmax_type
        # Transformer Engine's off-by-one sink is a fixed zero; only the learnable one is state.
        self.softmax_offset = None
        if softmax_type == "learnable":
            heads = self.num_attention_heads_per_partition
            where = default_device("DotProductAttention", None)  # TE's: on CUDA
            self.softmax_offset = nn.Parameter(
                torch.zeros(heads, dtype=torch.float32, device=where)
            )

    def _check_shapes(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        if not all(isinstance(x, Tensor) and x.dim() >= 2 for x in (query, key, value)):
            raise ValueError(f"{_NAME}: query, key and value must be tensors [..., h, d]")
        checks = (
            ("kv_channels", query.shape[-1], self.hidden_size_per_attention_head_k, "query"),
            ("kv_channels", key.shape[-1], self.hidden_size_per_attention_head_k, "key"),
            ("kv_channels", value.shape[-1], self.hidden_size_per_attention_head_v, "value"),
            ("num_attention_heads", query.shape[-2], self.num_attention_heads_per_partition,
             "query"),
            ("num_gqa_groups", key.shape[-2], self.num_gqa_groups_per_partition, "key"),
            ("num_gqa_groups", value.shape[-2], self.num_gqa_groups_per_partition, "value"),
        )  # fmt: skip
        for name, got, want, tensor in checks:
            if got != want:
                dim = "head dim" if name == "kv_channels" else "head count"
                raise ValueError(
                    f"{_NAME}: {tensor} has {dim} {got}, but {name} gives {want} per rank "
                    f"(tp_size={self.tp_size})"
                )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | tuple[Tensor, Tensor] | None = None,
        cu_seqlens_q: Tensor | None = None,
        cu_seqlens_kv: Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Tensor | None = None,
        alibi_slopes: Tensor | None = None,
        *,
        fast_zero_fill: bool = True,
    ) -> Tensor:
        # fast_zero_fill (Transformer Engine's, keyword only): TE zero-fills the padding of a
        # padded THD layout before its kernels write the sequences; we take no padded layout
        # (cu_seqlens_*_padded) and write every output element, so both values give the same
        # result.
        check_bool(_NAME, fast_zero_fill=fast_zero_fill)
        self._check_shapes(query, key, value)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if (
            attention_mask is not None
            and isinstance(mask_type, str)
            and "padding" not in mask_type
            and mask_type != "arbitrary"
            and not torch.compiler.is_compiling()
        ):
            # Transformer Engine ignores it too; a silent drop would hide a padded batch.
            warnings.warn(
                f"{_NAME}: attention_mask is ignored with attn_mask_type={mask_type!r} (as in "
                "Transformer Engine); a padding mask needs a 'padding' mask type, e.g. "
                "'padding_causal'",
                stacklevel=2,
            )
        dropout_p = self.attention_dropout if self.training else 0.0
        rng_state = None
        if dropout_p > 0 and self.get_rng_state_tracker is not None and not self.sequence_parallel:
            # Transformer Engine's attention_dropout_ctx: the mask drawn from the tracker's
            # default state (e.g. Megatron's model-parallel stream: differs across TP ranks).
            with rng_fork(self.get_rng_state_tracker):
                rng_state = new_rng_state(query.device)
        return dot_product_attention(
            query,
            key,
            value,
            attention_mask,
            qkv_format=self.qkv_format,
            attn_mask_type=mask_type,
            window_size=self.window_size if window_size is None else window_size,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            softmax_scale=self.softmax_scale,
            dropout_p=dropout_p,
            rng_state=rng_state,
            softmax_type=self.softmax_type,
            softmax_offset=self.softmax_offset,
        )

    def extra_repr(self) -> str:
        return (
            f"num_attention_heads={self.num_attention_heads}, kv_channels="
            f"({self.hidden_size_per_attention_head_k}, {self.hidden_size_per_attention_head_v})"
            f", num_gqa_groups={self.num_gqa_groups}, qkv_format={self.qkv_format!r}, "
            f"attn_mask_type={self.attn_mask_type!r}, attention_dropout={self.attention_dropout}"
            f", softmax_type={self.softmax_type!r}"
        )
