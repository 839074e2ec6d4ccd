"""``te_compile.MultiheadAttention``: QKV projection, rotary embedding, core attention, output
projection, with Transformer Engine's arguments, parameter names and ``[seq, batch, hidden]``
default layout.

A composition of our modules, so every FP8 recipe and tensor / sequence parallelism reaches
its GEMMs: the QKV projection is a :class:`~te_compile.LayerNormLinear` (``input_layernorm``)
or a :class:`~te_compile.Linear` named ``layernorm_qkv`` / ``qkv`` (self attention) or
``layernorm_query`` / ``query_layer`` and ``key_value`` (cross attention), the core is a
:class:`~te_compile.DotProductAttention` (``core_attention``), the output projection a
:class:`~te_compile.Linear` (``proj``).

Parameter layout, as in Transformer Engine:

* ``fuse_qkv_params=False`` (default): the QKV weight's rows are ``[query; key; value]``
  (``num_attention_heads * kv_channels`` rows, then ``num_gqa_groups * kv_channels`` twice) and
  the state_dict names them ``query_weight``, ``key_weight``, ``value_weight`` (and ``_bias``):
  the keys of a Transformer Engine checkpoint. The module keeps one fused Parameter
  (``parameters_split`` of :class:`~te_compile.Linear`).
* ``fuse_qkv_params=True``: one ``weight``; with ``qkv_weight_interleaved=True`` its rows are
  grouped per GQA group, ``[group][queries of the group, key, value][kv_channels]``.

With tensor parallelism (``set_parallel_mode=True``) the QKV projection is column-parallel and
``proj`` row-parallel: each rank holds ``num_attention_heads / tp_size`` heads (and
``num_gqa_groups / tp_size`` key/value heads).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from te_compile._checks import (
    check_bool,
    check_callable,
    check_int,
    check_positive_finite,
    check_tensor,
)
from te_compile.functional import apply_rotary_pos_emb
from te_compile.functional.attention_args import SOFTMAX_TYPES
from te_compile.modules._common import check_choice, check_positive, check_rng_tracker
from te_compile.modules._te_signature import te_signature
from te_compile.modules.attention import DotProductAttention
from te_compile.modules.layernorm_linear import LayerNormLinear
from te_compile.modules.linear import Linear
from te_compile.modules.norm import LayerNorm, RMSNorm

__all__ = ["MultiheadAttention"]

ATTENTION_TYPES = ("self", "cross")
QK_NORM_TYPES = (None, "RMSNorm", "LayerNorm", "L2Normalization")


def check_probability(owner: str, name: str, p: object) -> None:
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{owner}: {name} must be a float in [0, 1], got {p!r}")


def _positive_int(owner: str, name: str, value: object) -> None:
    if value is not None:
        check_positive(owner, **{name: value})


class _L2Norm(nn.Module):
    """``x / sqrt(sum(x^2) + eps)`` over the head dim (parameter-free)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        from te_compile.functional import l2normalization

        return l2normalization(x, self.eps)


class MultiheadAttention(nn.Module):
    """Multi-head (grouped-query) attention with its projections.

    Args: Transformer Engine's (``hidden_size``, ``num_attention_heads``, ``kv_channels``,
    ``attention_dropout``, ``layernorm_epsilon``, ``init_method``, ``output_layer_init_method``,
    ``layer_number``, ``attn_mask_type``, ``window_size``, ``tp_group``, ``tp_size``,
    ``num_gqa_groups``, ``fuse_wgrad_accumulation``, ``sequence_parallel``, ``params_dtype``,
    ``return_bias``, ``return_layernorm_output``, ``input_layernorm``, ``attention_type``,
    ``set_parallel_mode``, ``fuse_qkv_params``, ``zero_centered_gamma``,
    ``qkv_weight_interleaved``, ``rotary_pos_interleaved``, ``bias``, ``normalization``,
    ``device``, ``qkv_format`` ("sbhd", "bshd" or "thd"), ``qk_norm_type`` (None, "RMSNorm",
    "LayerNorm", "L2Normalization"; ``qk_layernorm=True`` is "LayerNorm"), ``qk_norm_eps``,
    ``qk_norm_before_rope``, ``softmax_type``: the attention sink of
    :class:`DotProductAttention`, whose learnable logits are ``core_attention.softmax_offset``).
    ``device=None``: as in ``Linear`` ("cuda" where present, unless torch's default device
    is set).

    ``forward`` returns the output, then the projection's bias if ``return_bias``, then the
    norm's output if ``input_layernorm`` and ``return_layernorm_output``.
    """

    @te_signature("MultiheadAttention")
    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: int | None = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Callable[[Tensor], None] | None = None,
        output_layer_init_method: Callable[[Tensor], None] | None = None,
        layer_number: int | None = None,
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        *,
        tp_group: object = None,
        tp_size: int = 1,
        num_gqa_groups: int | None = None,
        fuse_wgrad_accumulation: bool = False,
        get_rng_state_tracker: Callable | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: torch.device | str | None = None,
        qkv_format: str = "sbhd",
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        qk_layernorm: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        owner = "MultiheadAttention"
        check_positive(owner, hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        check_bool(owner, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                   sequence_parallel=sequence_parallel, return_bias=return_bias,
                   return_layernorm_output=return_layernorm_output,
                   input_layernorm=input_layernorm, set_parallel_mode=set_parallel_mode,
                   fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
                   qkv_weight_interleaved=qkv_weight_interleaved,
                   rotary_pos_interleaved=rotary_pos_interleaved, bias=bias,
                   qk_norm_before_rope=qk_norm_before_rope, qk_layernorm=qk_layernorm)  # fmt: skip
        check_probability(owner, "attention_dropout", attention_dropout)
        check_positive_finite(owner, layernorm_epsilon=layernorm_epsilon, qk_norm_eps=qk_norm_eps)
        _positive_int(owner, "kv_channels", kv_channels)
        _positive_int(owner, "num_gqa_groups", num_gqa_groups)
        _positive_int(owner, "layer_number", layer_number)
        check_choice(owner, "attention_type", attention_type, ATTENTION_TYPES)
        check_choice(owner, "qkv_format", qkv_format, ("sbhd", "bshd", "thd"))
        check_choice(owner, "softmax_type", softmax_type, SOFTMAX_TYPES)
        check_int(owner, 1, tp_size=tp_size)
        check_choice(owner, "normalization", normalization, ("LayerNorm", "RMSNorm"))
        check_callable(
            owner, init_method=init_method, output_layer_init_method=output_layer_init_method
        )
        check_rng_tracker(owner, get_rng_state_tracker, None)
        if qk_layernorm:
            if qk_norm_type not in (None, "LayerNorm"):
                raise ValueError(
                    f"{owner}: qk_layernorm=True means qk_norm_type='LayerNorm', got "
                    f"qk_norm_type={qk_norm_type!r}"
                )
            qk_norm_type = "LayerNorm"
        if qk_norm_type not in QK_NORM_TYPES:
            raise ValueError(f"{owner}: qk_norm_type must be one of {QK_NORM_TYPES}, got "
                             f"{qk_norm_type!r}")  # fmt: skip
        groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        if num_attention_heads % groups:
            raise ValueError(
                f"{owner}: num_attention_heads ({num_attention_heads}) must be divisible by "
                f"num_gqa_groups ({groups})"
            )
        if kv_channels is None and hidden_size % num_attention_heads:
            raise ValueError(
                f"{owner}: num_attention_heads ({num_attention_heads}) must divide hidden_size "
                f"({hidden_size}) when kv_channels is not given"
            )
        kv_channels = kv_channels if kv_channels else hidden_size // num_attention_heads
        # Tensor parallelism with set_parallel_mode (as Transformer Engine: heads are sharded
        # only when the projections are).
        tp_kw: dict = {}
        tp = 1
        if set_parallel_mode:
            tp_kw = {
                "tp_group": tp_group,
                "tp_size": tp_size if tp_group is None else None,
                "sequence_parallel": sequence_parallel,
            }
            tp = tp_size if tp_group is None else _group_size(tp_group)
        if groups % tp:
            raise ValueError(
                f"{owner}: num_gqa_groups ({groups}) must be divisible by the tensor-parallel "
                f"size ({tp})"
            )
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = groups
        self.hidden_size_per_attention_head = kv_channels
        self.heads_per_partition = num_attention_heads // tp
        self.groups_per_partition = groups // tp
        self.attention_type = attention_type
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.qkv_format = qkv_format
        self.input_layernorm = input_layernorm
        self.return_layernorm_output = return_layernorm_output
        self.return_bias = return_bias
        self.layer_number = 1 if layer_number is None else layer_number
        self.qkv_weight_interleaved = fuse_qkv_params and qkv_weight_interleaved
        self.rotary_pos_interleaved = rotary_pos_interleaved
        self.qk_norm_before_rope = qk_norm_before_rope
        hq, hkv = kv_channels * num_attention_heads, kv_channels * groups

        column = "column" if set_parallel_mode else None
        common = {
            "params_dtype": params_dtype,
            "device": device,
            "init_method": init_method,
            "get_rng_state_tracker": get_rng_state_tracker,
        }
        gemm = {**common, "bias": bias, "parallel_mode": column, **tp_kw}
        norm = {
            "eps": layernorm_epsilon,
            "normalization": normalization,
            "zero_centered_gamma": zero_centered_gamma,
            "return_layernorm_output": return_layernorm_output,
        }
        wgrad = {"fuse_wgrad_accumulation": fuse_wgrad_accumulation}

        def split(*parts: tuple[str, int]) -> dict[str, int] | None:
            return None if fuse_qkv_params else dict(parts)

        if attention_type == "self":
            qkv_split = split(("query", hq), ("key", hkv), ("value", hkv))
            if input_layernorm:
                self.layernorm_qkv = LayerNormLinear(
                    hidden_size, hq + 2 * hkv, parameters_split=qkv_split, **norm, **wgrad, **gemm
                )
            else:
                self.qkv = Linear(
                    hidden_size, hq + 2 * hkv, parameters_split=qkv_split, **wgrad, **gemm
                )
        else:
            if input_layernorm:
                self.layernorm_query = LayerNormLinear(
                    hidden_size, hq, parameters_split=split(("query", hq)), **norm, **wgrad,
                    **gemm,
                )  # fmt: skip
            else:
                self.query_layer = Linear(hidden_size, hq, **wgrad, **gemm)
            self.key_value = Linear(
                hidden_size, 2 * hkv, parameters_split=split(("key", hkv), ("value", hkv)),
                **wgrad, **gemm,
            )  # fmt: skip

        self.q_norm, self.k_norm = self._qk_norms(qk_norm_type, qk_norm_eps, kv_channels, device)
        self.core_attention = DotProductAttention(
            num_attention_heads,
            kv_channels,
            num_gqa_groups=groups,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            attention_type=attention_type,
            layer_number=self.layer_number,
            tp_size=tp,
            sequence_parallel=sequence_parallel,
            get_rng_state_tracker=get_rng_state_tracker,
            softmax_type=softmax_type,
        ).to(device)  # its only state: the learnable sink logits
        out_init = output_layer_init_method
        self.proj = Linear(
            hq,
            hidden_size,
            bias=bias,
            return_bias=return_bias,
            parallel_mode="row" if set_parallel_mode else None,
            params_dtype=params_dtype,
            device=device,
            init_method=out_init,
            get_rng_state_tracker=get_rng_state_tracker,
            **wgrad,
            **tp_kw,
        )

    @staticmethod
    def _qk_norms(kind: str | None, eps: float, dim: int, device) -> tuple:
        if kind is None:
            return None, None
        if kind == "L2Normalization":
            norm = _L2Norm(eps)
            return norm, norm
        cls = RMSNorm if kind == "RMSNorm" else LayerNorm
        return cls(dim, eps=eps, device=device), cls(dim, eps=eps, device=device)

    def set_tensor_parallel_group(self, tp_group: object) -> None:
        """Set the group of the projections (modules built with ``tp_size > 1``)."""
        for child in self.modules():
            if child is not self and hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    # forward -------------------------------------------------------------------------------

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        """``[..., heads * d]`` -> ``[..., heads, d]`` (``thd``: ``[t, heads, d]``)."""
        return x.view(*x.shape[:-1], heads, self.hidden_size_per_attention_head)

    def _split_qkv(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        d, g = self.hidden_size_per_attention_head, self.groups_per_partition
        q_per_group = self.heads_per_partition // g
        lead = mixed.shape[:-1]
        if self.qkv_weight_interleaved:  # [group][queries, key, value][d]
            x = mixed.view(*lead, g, q_per_group + 2, d)
            q, k, v = x.split((q_per_group, 1, 1), dim=-2)
            return q.reshape(*lead, g * q_per_group, d), k.squeeze(-2), v.squeeze(-2)
        q, k, v = mixed.split((g * q_per_group * d, g * d, g * d), dim=-1)
        return self._heads(q, g * q_per_group), self._heads(k, g), self._heads(v, g)

    def _split_kv(self, mixed: Tensor) -> tuple[Tensor, Tensor]:
        d, g = self.hidden_size_per_attention_head, self.groups_per_partition
        if self.qkv_weight_interleaved:  # [group][key, value][d]
            k, v = mixed.view(*mixed.shape[:-1], g, 2 * d).split(d, dim=-1)
            return k, v
        k, v = mixed.split(g * d, dim=-1)
        return self._heads(k, g), self._heads(v, g)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | tuple[Tensor, Tensor] | None = None,
        encoder_output: Tensor | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        is_first_microbatch: bool | None = None,
        checkpoint_core_attention: bool = False,
        inference_params: object = None,
        rotary_pos_emb: Tensor | tuple[Tensor, Tensor] | None = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Tensor | None = None,
        alibi_slopes: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None,
        cu_seqlens_kv: Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        *,
        fast_zero_fill: bool = True,
    ) -> Tensor | tuple[Tensor, ...]:
        owner = "MultiheadAttention"
        _unsupported(owner, inference_params=inference_params)
        first = is_first_microbatch  # each projection's kept FP8 weight (Linear's forward)
        # fast_zero_fill: checked only (DotProductAttention.forward says why).
        check_bool(owner, checkpoint_core_attention=checkpoint_core_attention,
                   fast_zero_fill=fast_zero_fill)  # fmt: skip
        check_tensor(owner, "hidden_states", hidden_states)
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{owner}: hidden_states must have hidden_size={self.hidden_size} in its last "
                f"dim, got shape {list(hidden_states.shape)}"
            )
        weight = self.proj.weight  # the projections' weights share one device
        if hidden_states.device != weight.device:
            raise ValueError(
                f"{owner}: hidden_states must be on the module's device ({weight.device}), got "
                f"{hidden_states.device}"
            )
        ln_out = None
        if self.attention_type == "self":
            if encoder_output is not None:
                raise ValueError(f"{owner}: encoder_output is for attention_type='cross'")
            if self.input_layernorm:
                mixed = self.layernorm_qkv(hidden_states, first)
                if self.return_layernorm_output:
                    mixed, ln_out = mixed
            else:
                mixed = self.qkv(hidden_states, first)
            q, k, v = self._split_qkv(mixed)
        else:
            if encoder_output is None:
                raise ValueError(f"{owner}: attention_type='cross' needs encoder_output")
            k, v = self._split_kv(self.key_value(encoder_output, first))
            if self.input_layernorm:
                query = self.layernorm_query(hidden_states, first)
                if self.return_layernorm_output:
                    query, ln_out = query
            else:
                query = self.query_layer(hidden_states, first)
            q = self._heads(query, self.heads_per_partition)

        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = (
                rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            )
            rope = {"tensor_format": self.qkv_format, "interleaved": self.rotary_pos_interleaved}
            q = apply_rotary_pos_emb(q, q_freqs, cu_seqlens=cu_seqlens_q, **rope)
            k = apply_rotary_pos_emb(k, k_freqs, cu_seqlens=cu_seqlens_kv, **rope)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)

        attn_kw = {
            "attention_mask": attention_mask,
            "attn_mask_type": attn_mask_type,
            "window_size": window_size,
            "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_kv": cu_seqlens_kv,
            "max_seqlen_q": max_seqlen_q,
            "max_seqlen_kv": max_seqlen_kv,
            "core_attention_bias_type": core_attention_bias_type,
            "core_attention_bias": core_attention_bias,
            "alibi_slopes": alibi_slopes,
        }
        if checkpoint_core_attention and torch.is_grad_enabled():
            context = torch.utils.checkpoint.checkpoint(
                lambda q_, k_, v_: self.core_attention(q_, k_, v_, **attn_kw),
                q, k, v, use_reentrant=False,
            )  # fmt: skip
        else:
            context = self.core_attention(q, k, v, **attn_kw)

        out = self.proj(context, first)
        outputs = out if isinstance(out, tuple) else (out,)
        if self.input_layernorm and self.return_layernorm_output:
            outputs += (ln_out,)
        return outputs if len(outputs) > 1 else outputs[0]

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads}, "
            f"num_gqa_groups={self.num_gqa_groups}, "
            f"kv_channels={self.hidden_size_per_attention_head}, "
            f"attention_type={self.attention_type!r}, qkv_format={self.qkv_format!r}"
        )


def _group_size(tp_group: object) -> int:
    from te_compile.distributed.tensor_parallel import TensorParallel

    return TensorParallel.create("MultiheadAttention", "column", False, tp_group, None).size


def _unsupported(owner: str, **values: object) -> None:
    for name, value in values.items():
        if value is not None:
            raise ValueError(f"{owner}: {name} is not supported yet; pass None, got {value!r}")
