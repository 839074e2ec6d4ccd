"""``te_compile.TransformerLayer``: self attention (and cross attention for a decoder) and an MLP,
each with its norm and residual, with Transformer Engine's arguments, parameter names
(``self_attention``, ``inter_attention``, ``layernorm_mlp``, ``layernorm``) and
``[seq, batch, hidden]`` default layout.

A composition of :class:`~te_compile.MultiheadAttention` and :class:`~te_compile.LayerNormMLP`,
so every FP8 recipe and tensor / sequence parallelism works through it. The projections return
their biases and the layer adds bias, dropout and residual in one expression
(``residual + dropout(out + bias)``), which Inductor fuses into one kernel.

Residual variants, as in Transformer Engine: pre-norm (default), the residual taken after the
norm (``apply_residual_connection_post_layernorm``), a norm on the output instead of the inputs
(``output_layernorm``, BERT), attention and MLP on the same input (``parallel_attention_mlp``,
Falcon).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from te_compile._checks import check_bool, check_int, check_positive_finite, check_tensor
from te_compile.functional import attention_args as A
from te_compile.functional import dropout
from te_compile.modules._common import check_choice, check_positive
from te_compile.modules._te_signature import te_signature
from te_compile.modules.layernorm_mlp import LayerNormMLP
from te_compile.modules.multi_head_attention import MultiheadAttention, check_probability
from te_compile.modules.norm import LayerNorm, RMSNorm

__all__ = ["TransformerLayer"]

LAYER_TYPES = ("encoder", "decoder")


def _check_mask(owner: str, name: str, mask_type: object, window_size: object) -> None:
    """A mask type and its window, refused by the names the caller gave them
    (``self_attn_mask_type`` / ``window_size``, ``enc_dec_attn_mask_type`` /
    ``enc_dec_window_size``)."""
    window = "window_size" if name.startswith("self") else "enc_dec_window_size"
    A.normalize_window(A.normalize_mask_type(mask_type, owner, name), window_size, owner, window)


class TransformerLayer(nn.Module):
    """One transformer layer (see the module docstring).

    Args: Transformer Engine's (``hidden_size``, ``ffn_hidden_size``, ``num_attention_heads``,
    ``num_gqa_groups``, ``layernorm_epsilon``, ``hidden_dropout``, ``attention_dropout``,
    ``init_method``, ``output_layer_init_method``, ``layer_number``, ``kv_channels``,
    ``self_attn_mask_type``, ``window_size``, ``enc_dec_attn_mask_type``,
    ``enc_dec_window_size``, ``tp_group``, ``tp_size``, ``params_dtype``,
    ``fuse_wgrad_accumulation``, ``sequence_parallel``,
    ``apply_residual_connection_post_layernorm``, ``output_layernorm``,
    ``parallel_attention_mlp``, ``layer_type``, ``drop_path_rate``, ``set_parallel_mode``,
    ``fuse_qkv_params``, ``zero_centered_gamma``, ``qkv_weight_interleaved``, ``bias``,
    ``activation``, ``activation_params`` (:class:`LayerNormMLP`'s), ``normalization``,
    ``device``, ``attn_input_format`` ("sbhd", "bshd" or "thd"), ``softmax_type`` (both
    attentions' sink softmax), and MultiheadAttention's ``rotary_pos_interleaved``,
    ``qk_norm_type``, ``qk_norm_eps``, ``qk_norm_before_rope``). Positional arguments follow
    Transformer Engine's order (``modules._te_signature``).
    ``device=None``: as in ``Linear`` ("cuda" where present, unless torch's default device
    is set).
    """

    @te_signature("TransformerLayer")
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: int | None = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Callable[[Tensor], None] | None = None,
        output_layer_init_method: Callable[[Tensor], None] | None = None,
        layer_number: int | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        *,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_window_size: tuple[int, int] | None = None,
        tp_group: object = None,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        get_rng_state_tracker: Callable | None = None,
        fuse_wgrad_accumulation: bool = False,
        sequence_parallel: bool = False,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        set_parallel_mode: bool = False,
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: dict | None = None,
        normalization: str = "LayerNorm",
        device: torch.device | str | None = None,
        attn_input_format: str = "sbhd",
        rotary_pos_interleaved: bool = False,
        qk_norm_type: str | None = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
    ) -> None:
        super().__init__()
        owner = "TransformerLayer"
        check_positive(owner, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        check_choice(owner, "layer_type", layer_type, LAYER_TYPES)
        check_bool(owner, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                   sequence_parallel=sequence_parallel,
                   apply_residual_connection_post_layernorm=apply_residual_connection_post_layernorm,
                   output_layernorm=output_layernorm, parallel_attention_mlp=parallel_attention_mlp,
                   set_parallel_mode=set_parallel_mode, fuse_qkv_params=fuse_qkv_params,
                   zero_centered_gamma=zero_centered_gamma,
                   qkv_weight_interleaved=qkv_weight_interleaved, bias=bias,
                   rotary_pos_interleaved=rotary_pos_interleaved,
                   qk_norm_before_rope=qk_norm_before_rope)  # fmt: skip
        check_probability(owner, "hidden_dropout", hidden_dropout)
        check_probability(owner, "attention_dropout", attention_dropout)
        check_probability(owner, "drop_path_rate", drop_path_rate)
        check_positive_finite(owner, layernorm_epsilon=layernorm_epsilon, qk_norm_eps=qk_norm_eps)
        if parallel_attention_mlp and (
            layer_type != "encoder" or apply_residual_connection_post_layernorm or output_layernorm
        ):
            raise ValueError(
                f"{owner}: parallel_attention_mlp=True needs layer_type='encoder', "
                "apply_residual_connection_post_layernorm=False and output_layernorm=False"
            )
        check_int(owner, 1, tp_size=tp_size)
        check_choice(owner, "attn_input_format", attn_input_format, A.QKV_FORMATS)
        check_choice(owner, "softmax_type", softmax_type, A.SOFTMAX_TYPES)
        _check_mask(owner, "self_attn_mask_type", self_attn_mask_type, window_size)
        _check_mask(owner, "enc_dec_attn_mask_type", enc_dec_attn_mask_type, enc_dec_window_size)
        tp_mlp = {"tp_group": tp_group, "tp_size": tp_size if tp_group is None else None}
        self.hidden_dropout = float(hidden_dropout)
        self.drop_path_rate = float(drop_path_rate)
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = window_size
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = enc_dec_window_size
        self.layer_type = layer_type
        self.output_layernorm = output_layernorm
        self.parallel_attention_mlp = parallel_attention_mlp
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.attn_input_format = attn_input_format
        self.layer_number = layer_number
        post_ln = apply_residual_connection_post_layernorm
        sequence_parallel = set_parallel_mode and sequence_parallel

        attention = {
            "kv_channels": kv_channels,
            "attention_dropout": attention_dropout,
            "layernorm_epsilon": layernorm_epsilon,
            "init_method": init_method,
            "output_layer_init_method": output_layer_init_method,
            "layer_number": layer_number,
            "tp_group": tp_group,
            "tp_size": tp_size,
            "num_gqa_groups": num_gqa_groups,
            "get_rng_state_tracker": get_rng_state_tracker,
            "sequence_parallel": sequence_parallel,
            "params_dtype": params_dtype,
            "return_layernorm_output": post_ln,
            "set_parallel_mode": set_parallel_mode,
            "fuse_qkv_params": fuse_qkv_params,
            "zero_centered_gamma": zero_centered_gamma,
            "qkv_weight_interleaved": qkv_weight_interleaved,
            "rotary_pos_interleaved": rotary_pos_interleaved,
            "bias": bias,
            "normalization": normalization,
            "device": device,
            "qkv_format": attn_input_format,
            "qk_norm_type": qk_norm_type,
            "qk_norm_eps": qk_norm_eps,
            "qk_norm_before_rope": qk_norm_before_rope,
            "fuse_wgrad_accumulation": fuse_wgrad_accumulation,
            "softmax_type": softmax_type,
        }
        self.self_attention = MultiheadAttention(
            hidden_size,
            num_attention_heads,
            attn_mask_type=self_attn_mask_type,
            window_size=window_size,
            input_layernorm=not output_layernorm,
            attention_type="self",
            return_bias=True,
            **attention,
        )
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                hidden_size,
                num_attention_heads,
                attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size,
                input_layernorm=True,
                attention_type="cross",
                return_bias=True,
                **attention,
            )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            bias=bias,
            activation=activation,
            activation_params=activation_params,
            normalization=normalization,
            zero_centered_gamma=zero_centered_gamma,
            return_layernorm_output=post_ln,
            return_bias=True,
            params_dtype=params_dtype,
            device=device,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            sequence_parallel=sequence_parallel,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            get_rng_state_tracker=get_rng_state_tracker,
            **(tp_mlp if set_parallel_mode else {}),
        )
        if output_layernorm:
            norm_cls = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm_cls(
                hidden_size,
                eps=layernorm_epsilon,
                zero_centered_gamma=zero_centered_gamma,
                params_dtype=params_dtype,
                device=device,
            )

    def set_tensor_parallel_group(self, tp_group: object) -> None:
        """Set the group of every child module built with ``tp_size > 1``."""
        for child in self.modules():
            if child is not self and hasattr(child, "set_tensor_parallel_group"):
                child.set_tensor_parallel_group(tp_group)

    def _bias_dropout_add(self, out: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
        """``residual + drop_path(dropout(out + bias))``."""
        if bias is not None:
            out = out + bias
        if self.training and self.hidden_dropout > 0:
            out = dropout(out, self.hidden_dropout)
        if self.training and self.drop_path_rate > 0:
            keep = 1.0 - self.drop_path_rate
            batch_dim = 1 if self.attn_input_format == "sbhd" else 0
            shape = [1] * out.dim()
            shape[batch_dim] = out.shape[batch_dim]
            mask = torch.rand(shape, dtype=out.dtype, device=out.device) < keep
            out = out * mask / keep
        return residual + out

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | tuple[Tensor, Tensor] | None = None,
        self_attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        encoder_output: Tensor | None = None,
        enc_dec_attn_mask: Tensor | tuple[Tensor, Tensor] | None = None,
        enc_dec_attn_mask_type: str | None = None,
        enc_dec_window_size: tuple[int, int] | None = None,
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
    ) -> Tensor:
        if self.layer_type == "decoder" and encoder_output is None:
            raise ValueError("TransformerLayer: layer_type='decoder' needs encoder_output")
        owner = "TransformerLayer"
        # fast_zero_fill: checked only (DotProductAttention.forward says why).
        check_bool(owner, fast_zero_fill=fast_zero_fill)
        check_tensor(owner, "hidden_states", hidden_states)
        if self_attn_mask_type is not None or window_size is not None:
            mask = self.self_attn_mask_type if self_attn_mask_type is None else self_attn_mask_type
            _check_mask(owner, "self_attn_mask_type", mask, window_size)
        if enc_dec_attn_mask_type is not None or enc_dec_window_size is not None:
            mask = enc_dec_attn_mask_type or self.enc_dec_attn_mask_type
            _check_mask(owner, "enc_dec_attn_mask_type", mask, enc_dec_window_size)
        self_attn_mask_type = self_attn_mask_type or self.self_attn_mask_type
        window_size = window_size if window_size is not None else self.window_size
        attn = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type,
            window_size=window_size,
            is_first_microbatch=is_first_microbatch,
            checkpoint_core_attention=checkpoint_core_attention,
            inference_params=inference_params,
            rotary_pos_emb=rotary_pos_emb,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
        )
        if self.parallel_attention_mlp:  # both blocks on the input, one residual
            attn_out, attn_bias = attn
            mlp_out, mlp_bias = self.layernorm_mlp(hidden_states, is_first_microbatch)
            both = attn_out + mlp_out
            bias = None
            if attn_bias is not None or mlp_bias is not None:
                bias = sum(b for b in (attn_bias, mlp_bias) if b is not None)
            return self._bias_dropout_add(both, bias, hidden_states)

        if self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            attn_out, attn_bias, residual = attn
        else:
            (attn_out, attn_bias), residual = attn, hidden_states
        hidden_states = self._bias_dropout_add(attn_out, attn_bias, residual)

        if self.layer_type == "decoder":
            cross = self.inter_attention(
                hidden_states,
                attention_mask=enc_dec_attn_mask,
                encoder_output=encoder_output,
                attn_mask_type=enc_dec_attn_mask_type or self.enc_dec_attn_mask_type,
                window_size=enc_dec_window_size
                if enc_dec_window_size is not None
                else self.enc_dec_window_size,
                is_first_microbatch=is_first_microbatch,
                checkpoint_core_attention=checkpoint_core_attention,
                core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias,
                alibi_slopes=alibi_slopes,
            )
            if self.apply_residual_connection_post_layernorm:
                cross_out, cross_bias, residual = cross
            else:
                (cross_out, cross_bias), residual = cross, hidden_states
            hidden_states = self._bias_dropout_add(cross_out, cross_bias, residual)

        mlp = self.layernorm_mlp(hidden_states, is_first_microbatch)
        if self.apply_residual_connection_post_layernorm:
            mlp_out, mlp_bias, residual = mlp
        else:
            (mlp_out, mlp_bias), residual = mlp, hidden_states
        out = self._bias_dropout_add(mlp_out, mlp_bias, residual)
        return self.layernorm(out) if self.output_layernorm else out

    def extra_repr(self) -> str:
        return (
            f"layer_type={self.layer_type!r}, hidden_dropout={self.hidden_dropout}, "
            f"attn_input_format={self.attn_input_format!r}"
        )
