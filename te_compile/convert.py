"""Hugging Face decoder models as stacks of :class:`~te_compile.TransformerLayer`.

:func:`from_hf` takes a ``transformers`` Llama, Mistral or Qwen2 causal LM (the model object,
with its weights) and returns a :class:`CausalLM` whose layers are ours: ``LayerNormLinear``
for Q/K/V with the RMSNorm as its prologue, ``DotProductAttention`` with rotary embeddings,
``Linear`` for the output projection, ``LayerNormMLP`` with SwiGLU. The weights are copied
(``model.layers.<i>.`` to ``layers.<i>.``):

- ``input_layernorm.weight`` -> ``self_attention.layernorm_qkv.layer_norm_weight``;
- ``self_attn.{q,k,v}_proj.weight`` (and ``.bias``) ->
  ``self_attention.layernorm_qkv.{query,key,value}_weight`` (``_bias``);
- ``self_attn.o_proj.weight`` -> ``self_attention.proj.weight``;
- ``post_attention_layernorm.weight`` -> ``layernorm_mlp.layer_norm_weight``;
- ``mlp.gate_proj.weight`` and ``mlp.up_proj.weight`` -> ``layernorm_mlp.fc1_weight`` (gate rows,
  then up rows: the activation half first);
- ``mlp.down_proj.weight`` -> ``layernorm_mlp.fc2_weight``;

plus ``embed_tokens``, the final ``norm`` and ``lm_head`` (tied when the model ties them). Qwen2's
Q/K/V biases: our layer then has biases everywhere (``bias=True``), the ones Qwen2 lacks start at
zero, so the outputs are the same and training can move them. ``transformers`` is not a
dependency of te_compile: the function reads the model's config and state_dict only.

Tied embeddings (``tie_word_embeddings=True``, Llama 3.2 1B / 3B): ``lm_head.weight`` is the
embedding's parameter, one tensor, as in the original, so training keeps them equal.

RoPE scaling, the config's ``rope_parameters`` (``rope_scaling`` in older ``transformers``), by
``rope_type``; the frequencies are computed as ``transformers`` computes them, once, into the
rotary module's ``inv_freq`` (:class:`~te_compile.RopeScaling`):

- ``"default"`` (no scaling) and ``"linear"`` (position interpolation, ``factor``);
- ``"llama3"`` (Llama 3.1 / 3.2 / 3.3: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``, which defaults to ``max_position_embeddings`` as in
  ``transformers``);
- refused with a ValueError naming the field and its value, and why (``_ROPE_REFUSED``):
  ``"dynamic"``, ``"yarn"``, ``"longrope"`` and any other type, and a ``partial_rotary_factor``
  other than 1.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from te_compile._checks import (
    check_bool,
    check_device,
    check_dtype,
    check_int,
    check_positive_finite,
    check_tensor,
)
from te_compile.modules import (
    Linear,
    RMSNorm,
    RopeScaling,
    RotaryPositionEmbedding,
    TransformerLayer,
)

__all__ = ["CausalLM", "from_hf"]

_SUPPORTED = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")
# Why each rope type of transformers' table that we do not map is refused.
_ROPE_REFUSED = {
    "dynamic": "its frequencies change with the longest sequence the model has seen",
    "yarn": "its attention factor multiplies cos and sin, which needs a softmax scale "
    "TransformerLayer does not take",
    "longrope": "its frequencies switch with the sequence length",
}


class CausalLM(nn.Module):
    """Token embedding, ``TransformerLayer`` stack (``bshd``, causal, RMSNorm, SwiGLU, RoPE),
    final RMSNorm and LM head; ``forward(input_ids [b, s]) -> logits [b, s, vocab]``.
    ``tie_word_embeddings``: the LM head's weight is the embedding's parameter;
    ``rope_scaling``: the rotary frequencies' :class:`~te_compile.RopeScaling`."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        ffn_hidden_size: int,
        num_layers: int,
        num_attention_heads: int,
        num_gqa_groups: int,
        kv_channels: int,
        eps: float = 1e-6,
        rotary_base: float = 10000.0,
        qkv_bias: bool = False,
        window_size: tuple[int, int] | None = None,
        tie_word_embeddings: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        rope_scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        owner = "CausalLM"
        check_int(
            owner,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
            num_layers=num_layers,
            num_attention_heads=num_attention_heads,
            num_gqa_groups=num_gqa_groups,
            kv_channels=kv_channels,
        )
        check_positive_finite(owner, eps=eps, rotary_base=rotary_base)
        check_bool(owner, qkv_bias=qkv_bias, tie_word_embeddings=tie_word_embeddings)
        if params_dtype is not None:
            check_dtype(owner, "params_dtype", params_dtype)
        check_device(owner, "device", device)
        factory = {"dtype": params_dtype, "device": device}
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, **factory)
        self.layers = nn.ModuleList(
            TransformerLayer(
                hidden_size,
                ffn_hidden_size,
                num_attention_heads,
                num_gqa_groups=num_gqa_groups,
                kv_channels=kv_channels,
                layernorm_epsilon=eps,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                layer_number=i + 1,
                self_attn_mask_type="causal",
                window_size=window_size,
                bias=qkv_bias,
                activation="swiglu",
                normalization="RMSNorm",
                attn_input_format="bshd",
                params_dtype=params_dtype,
                device=device,
            )
            for i in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, eps=eps, params_dtype=params_dtype, device=device)
        self.lm_head = Linear(
            hidden_size, vocab_size, bias=False, params_dtype=params_dtype, device=device
        )
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryPositionEmbedding(
            kv_channels, rotary_base=rotary_base, rope_scaling=rope_scaling
        )

    def forward(self, input_ids: Tensor) -> Tensor:
        check_tensor("CausalLM", "input_ids", input_ids, floating=False, min_dim=2)
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"CausalLM: input_ids must be an int64 or int32 tensor of token ids, "
                f"got {input_ids.dtype}"
            )
        if input_ids.dim() != 2:
            raise ValueError(
                f"CausalLM: input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}"
            )
        device = self.embed_tokens.weight.device
        if input_ids.device != device:
            raise ValueError(
                f"CausalLM: input_ids must be on the model's device ({device}), got "
                f"{input_ids.device}"
            )
        hidden = self.embed_tokens(input_ids)
        freqs = self.rotary(input_ids.shape[1]).to(hidden.device)
        for layer in self.layers:
            hidden = layer(hidden, rotary_pos_emb=freqs)
        return self.lm_head(self.norm(hidden))


def _config_value(config: object, name: str, default: object = None) -> object:
    value = getattr(config, name, default)
    return default if value is None else value


def from_hf(model: nn.Module, dtype: torch.dtype | None = None) -> CausalLM:
    """A :class:`CausalLM` with ``model``'s weights (a ``transformers`` ``LlamaForCausalLM``,
    ``MistralForCausalLM`` or ``Qwen2ForCausalLM``); ``dtype``: of the new parameters (default:
    the model's). Raises ValueError for architectures or settings it does not map (the rope
    types the module docstring lists as refused, attention or MLP biases where the
    architecture has none)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_hf: model must be a transformers causal LM, got {model!r}")
    if dtype is not None:
        check_dtype("from_hf", "dtype", dtype)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _SUPPORTED:
        raise ValueError(f"from_hf: model.config.model_type must be one of {_SUPPORTED}, "
                         f"got {kind!r}")  # fmt: skip
    rope, rope_scaling = _rope(config)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"from_hf: hidden_act must be 'silu' (SwiGLU), got {config.hidden_act!r}")
    if _config_value(config, "mlp_bias", False) or (
        kind != "qwen2" and _config_value(config, "attention_bias", False)
    ):
        raise ValueError("from_hf: attention_bias / mlp_bias are not supported")
    heads = config.num_attention_heads
    head_dim = _config_value(config, "head_dim", config.hidden_size // heads)
    base = rope.get("rope_theta") or _config_value(config, "rope_theta", 10000.0)
    window = None
    sliding = _config_value(config, "sliding_window")
    if kind == "mistral" and sliding:
        window = (sliding - 1, 0)  # the query and the sliding_window - 1 keys before it
    elif kind == "qwen2" and _config_value(config, "use_sliding_window", False):
        raise ValueError("from_hf: Qwen2's use_sliding_window is not supported")
    state = model.state_dict()
    dtype = dtype or next(model.parameters()).dtype
    device = next(model.parameters()).device
    ours = CausalLM(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_gqa_groups=_config_value(config, "num_key_value_heads", heads),
        kv_channels=head_dim,
        eps=config.rms_norm_eps,
        rotary_base=float(base),
        qkv_bias=kind == "qwen2",
        window_size=window,
        tie_word_embeddings=bool(_config_value(config, "tie_word_embeddings", False)),
        params_dtype=dtype,
        device=device,
        rope_scaling=rope_scaling,
    )
    ours.load_state_dict(_mapped_state(state, config.num_hidden_layers, ours), strict=True)
    return ours


def _rope(config: object) -> tuple[dict, RopeScaling | None]:
    """The config's rope parameters (``rope_parameters``, or ``rope_scaling`` in transformers
    4) and the :class:`RopeScaling` of their ``rope_type``; ValueError for a type we refuse."""
    field = "rope_parameters" if _config_value(config, "rope_parameters") else "rope_scaling"
    rope = dict(_config_value(config, field, {}))
    kind = rope.get("rope_type", rope.get("type", "default"))
    where = f"from_hf: config.{field}"
    if kind not in _ROPE_TYPES:
        why = _ROPE_REFUSED.get(kind, "te_compile does not implement it")
        raise ValueError(
            f"{where}['rope_type'] = {kind!r} is not supported ({why}); supported: {_ROPE_TYPES}"
        )
    partial = rope.get("partial_rotary_factor", _config_value(config, "partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor must be 1.0, got {partial!r}")
    if kind == "default":
        return rope, None
    fields = {"factor": rope.get("factor")}
    if kind == "llama3":
        fields |= {name: rope.get(name) for name in ("low_freq_factor", "high_freq_factor")}
        fields["original_max_position_embeddings"] = rope.get(
            "original_max_position_embeddings", _config_value(config, "max_position_embeddings")
        )
    try:
        return rope, RopeScaling(kind, **fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} = {rope} ({kind!r}): {error}") from None


def _mapped_state(hf: dict[str, Tensor], num_layers: int, ours: CausalLM) -> dict[str, Tensor]:
    out = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "lm_head.weight": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
    }
    target = ours.state_dict()
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        qkv, mlp = dst + "self_attention.layernorm_qkv.", dst + "layernorm_mlp."
        out[qkv + "layer_norm_weight"] = hf[src + "input_layernorm.weight"]
        for part, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            out[qkv + f"{part}_weight"] = hf[src + f"self_attn.{proj}.weight"]
            if qkv + f"{part}_bias" in target:
                out[qkv + f"{part}_bias"] = hf[src + f"self_attn.{proj}.bias"]
        out[dst + "self_attention.proj.weight"] = hf[src + "self_attn.o_proj.weight"]
        out[mlp + "layer_norm_weight"] = hf[src + "post_attention_layernorm.weight"]
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[mlp + "fc1_weight"] = torch.cat((gate, up))
        out[mlp + "fc2_weight"] = hf[src + "mlp.down_proj.weight"]
    for name, value in target.items():  # biases Qwen2 lacks, and our FP8 state: as created
        out.setdefault(name, torch.zeros_like(value) if name.endswith("bias") else value)
    return out
