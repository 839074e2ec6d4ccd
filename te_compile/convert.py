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
Q/K/V biases: our layer then has biases everywhere (``bias=True``); the ones Qwen2 lacks (the
output projection's and the MLP's) are zero and frozen (``requires_grad=False``), so the outputs
are the same and the trained model still maps back to a Qwen2. ``transformers`` is not a
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
- ``"yarn"`` (Qwen2.5's long-context configs: ``factor``, ``original_max_position_embeddings``,
  and ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``attention_factor``,
  ``truncate`` where given), its attention factor folded into each layer's softmax scale (as its
  square: ``transformers`` multiplies cos and sin by it);
- refused with a ValueError naming the field and its value, and why (``_ROPE_REFUSED``):
  ``"dynamic"``, ``"longrope"`` and any other type, and a ``partial_rotary_factor`` other than 1.

The converted model takes what a Hugging Face training loop passes: ``CausalLM.forward(input_ids,
attention_mask=None, position_ids=None, labels=None, return_dict=False)``, and keeps the model's
``config``. ``attention_mask`` ``[b, s]`` (1 = attend, 0 = padding; left or right padding) becomes
Transformer Engine's padding mask (``[b, 1, 1, s]``, True = masked out) with the
``"padding_causal"`` mask type: a token sees the unpadded tokens up to itself; a padded token's
output is not defined (transformers' differs), so its label must be ``-100``. ``position_ids``
``[b, s]`` or ``[1, s]``: the rotary angle of each token, :math:`p_t \theta_i` in fp32 as
``transformers`` computes it (default: ``0 .. s - 1``, as ``transformers``, also for padded
batches: RoPE sees position differences only). The rotary op takes one position per sequence
index for the whole batch, so ``[b, s]`` with ``b > 1`` runs the layers one row at a time (the
same FLOPs, in ``b`` times the launches; pass ``[1, s]`` when the rows agree). Positions set the
angles only: sequences packed in one row, which ``transformers`` separates where
``position_ids`` restart and ``attention_mask`` is None, are not separated here. ``labels``
``[b, s]``: the loss of ``transformers``' ``ForCausalLMLoss`` (the logits of token ``t`` predict
label ``t + 1``; ``-100`` ignored; the mean over the others, in fp32 or the logits' wider dtype),
returned with the logits as a :class:`CausalLMOutput`.

:func:`to_hf` maps the weights back (the inverse of the list above: ``fc1_weight`` split into
gate and up rows) into a ``transformers`` model, the one given or one built from ``config``: a
round trip gives the same tensors and the same logits, and ``save_pretrained`` writes a Hugging
Face checkpoint.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import NamedTuple

import torch
from torch import Tensor, nn

from te_compile._checks import (
    check_bool,
    check_dtype,
    check_int,
    check_positive_finite,
    check_tensor,
    default_device,
    shown,
)
from te_compile.modules import (
    Linear,
    RMSNorm,
    RopeScaling,
    RotaryPositionEmbedding,
    TransformerLayer,
)
from te_compile.modules.rotary import YARN_FIELDS

__all__ = ["CausalLM", "CausalLMOutput", "from_hf", "to_hf"]

_SUPPORTED = ("llama", "mistral", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Why each rope type of transformers' table that we do not map is refused.
_ROPE_REFUSED = {
    "dynamic": "its frequencies change with the longest sequence the model has seen",
    "longrope": "its frequencies switch with the sequence length",
}
_INDEX_DTYPES = (torch.int64, torch.int32)
# Our layer's biases without a place in transformers' layout (Qwen2 has Q/K/V biases only).
_NOT_IN_HF = ("self_attention.proj.bias", "layernorm_mlp.fc1_bias", "layernorm_mlp.fc2_bias")
_IGNORE_INDEX = -100  # transformers' label of a token without a loss (padding, the prompt)


class CausalLMOutput(NamedTuple):
    """:class:`CausalLM`'s output with ``labels`` or ``return_dict=True``, read as
    ``transformers``' ``CausalLMOutputWithPast``: ``out.loss`` (None without labels),
    ``out.logits``, and ``out[0]`` the loss, as a training loop reads it."""

    loss: Tensor | None
    logits: Tensor


class CausalLM(nn.Module):
    """Token embedding, ``TransformerLayer`` stack (``bshd``, causal, RMSNorm, SwiGLU, RoPE),
    final RMSNorm and LM head; ``forward(input_ids [b, s], ...) -> logits [b, s, vocab]``.
    ``tie_word_embeddings``: the LM head's weight is the embedding's parameter;
    ``rope_scaling``: the rotary frequencies' :class:`~te_compile.RopeScaling` (and YaRN's
    logit scale, in every layer's softmax scale). ``config``: the
    ``transformers`` config of the model :func:`from_hf` converted (None when built directly),
    which :func:`to_hf` builds the model back from."""

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
        device = default_device(owner, device)
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
        if rope_scaling is not None:  # YaRN's attention factor, on every logit (else 1)
            for layer in self.layers:
                layer.self_attention.core_attention.softmax_scale *= rope_scaling.logit_scale
        self.config: object | None = None

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        labels: Tensor | None = None,
        return_dict: bool = False,
    ) -> Tensor | CausalLMOutput:
        """``logits [b, s, vocab]``; a :class:`CausalLMOutput` (``loss``, ``logits``) with
        ``labels`` or ``return_dict=True``. The arguments are those of ``transformers``'
        ``LlamaForCausalLM`` (the module docstring gives their meaning)."""
        owner = "CausalLM"
        device = self.embed_tokens.weight.device
        _check_ids(owner, "input_ids", input_ids, device)
        check_bool(owner, return_dict=return_dict)
        b, s = input_ids.shape
        padded = None
        if attention_mask is not None:
            _check_ids(owner, "attention_mask", attention_mask, device, (b,), s,
                       (*_INDEX_DTYPES, torch.bool))  # fmt: skip
            padded = (attention_mask == 0).view(b, 1, 1, s)  # TE's convention: True = masked out
        if position_ids is not None:  # [1, s]: one set of positions for the whole batch
            _check_ids(owner, "position_ids", position_ids, device, (b, 1), s)
        if labels is not None:
            _check_ids(owner, "labels", labels, device, (b,), s)
        hidden = self.embed_tokens(input_ids)
        if position_ids is None or position_ids.shape[0] == 1:
            freqs = self._freqs(s, position_ids, device)
            hidden = self._layers(hidden, freqs, padded)
        else:  # one rotary table per row: the op takes one position per sequence index
            hidden = torch.cat([
                self._layers(hidden[i : i + 1], self._freqs(s, position_ids[i : i + 1], device),
                             None if padded is None else padded[i : i + 1])
                for i in range(b)
            ])  # fmt: skip
        logits = self.lm_head(self.norm(hidden))
        if labels is None and not return_dict:
            return logits
        return CausalLMOutput(None if labels is None else _causal_lm_loss(logits, labels), logits)

    def _freqs(self, s: int, position_ids: Tensor | None, device: torch.device) -> Tensor:
        """``freqs [s, 1, 1, d]`` of positions ``0 .. s - 1``, or of ``position_ids [1, s]``:
        each angle ``p * inv_freq`` in fp32, as ``transformers`` computes it."""
        if position_ids is None:
            return self.rotary(s).to(device)
        angles = position_ids[0, :, None].float() * self.rotary.inv_freq.float()[None, :]
        return torch.cat((angles, angles), dim=-1)[:, None, None, :]

    def _layers(self, hidden: Tensor, freqs: Tensor, padded: Tensor | None) -> Tensor:
        mask_type = None if padded is None else "padding_causal"
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=padded, self_attn_mask_type=mask_type,
                           rotary_pos_emb=freqs)  # fmt: skip
        return hidden


def _check_ids(
    owner: str,
    name: str,
    value: object,
    device: torch.device,
    batches: tuple[int, ...] = (),
    seq: int | None = None,
    dtypes: tuple[torch.dtype, ...] = _INDEX_DTYPES,
) -> None:
    """``value`` is a ``[batch, seq]`` tensor of one of ``dtypes`` on ``device``; ``batches`` /
    ``seq``: the sizes allowed (empty / None: any)."""
    check_tensor(owner, name, value, floating=False, min_dim=2)
    if value.dtype not in dtypes:
        raise ValueError(f"{owner}: {name} must be a tensor of dtype "
                         f"{' or '.join(map(str, dtypes))}, got {value.dtype}")  # fmt: skip
    if (
        value.dim() != 2
        or (batches and value.shape[0] not in batches)
        or (seq is not None and value.shape[1] != seq)
    ):
        rows = " or ".join(map(str, batches)) or "batch"
        raise ValueError(f"{owner}: {name} must be [{rows}, {seq or 'seq'}], got shape "
                         f"{list(value.shape)}")  # fmt: skip
    if value.device != device:
        raise ValueError(f"{owner}: {name} must be on the model's device ({device}), got "
                         f"{value.device}")  # fmt: skip


def _causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """``transformers``' ``ForCausalLMLoss``: the logits of token ``t`` against label ``t + 1``,
    ``-100`` ignored, the mean over the rest, in fp32 (the logits' dtype when wider)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=_IGNORE_INDEX)
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).to(dtype), shifted.flatten().long(), ignore_index=_IGNORE_INDEX
    )


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
    rounded = [(n, b.dtype) for n, b in model.named_buffers()
               if n.endswith("inv_freq") and b.dtype != torch.float32]  # fmt: skip
    if rounded:
        warnings.warn(
            f"from_hf: the transformers model's rotary frequencies ({rounded[0][0]}) are "
            f"{rounded[0][1]}, not float32: model.to(dtype) rounded them "
            "(from_pretrained / from_config with a dtype keep them float32). The converted "
            "model computes them in float32 from the config, so its logits differ from this "
            "model's at long positions (the rounded angles are off by up to 2^-9 of the "
            "position, several radians at position 2,048); build the transformers model with "
            "a dtype rather than casting it to compare the two",
            UserWarning,
            stacklevel=2,
        )
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
    for name, param in ours.named_parameters():  # Qwen2's missing biases: zero, kept zero
        if name.endswith(_NOT_IN_HF):
            param.requires_grad_(False)
    ours.config = config
    return ours


def to_hf(model: CausalLM, hf_model: nn.Module | None = None) -> nn.Module:
    """``model``'s weights in a ``transformers`` causal LM: loaded into ``hf_model`` (its
    layout: Llama, Mistral or Qwen2, the sizes of ``model``), or into one built from
    ``model.config`` (``transformers`` imported here) with ``model``'s dtype and device.
    Returns that model. Raises ValueError for a ``model`` without a config and no ``hf_model``,
    and for a bias ``transformers``' layout has no room for that training moved from zero
    (Qwen2's output projection and MLP)."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"to_hf: model must be a te_compile.convert.CausalLM, got {_named(model)}")
    if hf_model is not None and not isinstance(hf_model, nn.Module):
        raise TypeError(f"to_hf: hf_model must be None or a transformers causal LM, got "
                        f"{_named(hf_model)}")  # fmt: skip
    if hf_model is None and model.config is None:
        raise ValueError(
            "to_hf: model.config is None (a CausalLM built directly, not by from_hf): pass "
            "hf_model, a transformers model of the same sizes to load the weights into"
        )
    state = _hf_state(model.state_dict(), len(model.layers))
    if hf_model is None:
        import transformers

        weight = model.embed_tokens.weight
        # Built as from_pretrained(dtype=...) builds it: parameters in the dtype, the rotary
        # frequencies float32 (``.to(dtype)`` would round them too: from_hf's warning).
        with _default_dtype(weight.dtype):
            hf_model = transformers.AutoModelForCausalLM.from_config(model.config)
        hf_model = hf_model.to(device=weight.device)
    hf_model.load_state_dict(state, strict=True)
    return hf_model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


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
    if kind == "yarn":  # (transformers: no factor is the context's growth)
        fields |= {name: rope.get(name) for name in YARN_FIELDS}
        original = fields["original_max_position_embeddings"]
        longest = _config_value(config, "max_position_embeddings")
        if fields["factor"] is None and isinstance(original, int) and longest:
            fields["factor"] = longest / original
    try:
        return rope, RopeScaling(kind, **fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where} = {rope} ({kind!r}): {error}") from None


# The weights one name maps to one name, each way: (ours, transformers'), per layer under
# ``layers.<i>.`` / ``model.layers.<i>.``; a bias only where both layouts have it (Qwen2's Q/K/V).
# ``fc1_weight`` is gate_proj's rows then up_proj's, mapped apart.
_LAYER_NAMES = (
    ("self_attention.layernorm_qkv.layer_norm_weight", "input_layernorm.weight"),
    *(
        (f"self_attention.layernorm_qkv.{ours}_{kind}", f"self_attn.{proj}_proj.{kind}")
        for kind in ("weight", "bias")
        for ours, proj in (("query", "q"), ("key", "k"), ("value", "v"))
    ),
    ("self_attention.proj.weight", "self_attn.o_proj.weight"),
    ("layernorm_mlp.layer_norm_weight", "post_attention_layernorm.weight"),
    ("layernorm_mlp.fc2_weight", "mlp.down_proj.weight"),
)
_MODEL_NAMES = (
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
_GATE_UP = ("layernorm_mlp.fc1_weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")


def _mapped_state(hf: dict[str, Tensor], num_layers: int, ours: CausalLM) -> dict[str, Tensor]:
    """``transformers``' state dict ``hf`` in our names (``lm_head.weight``: the embedding's when
    the model ties them and its state dict leaves the head out)."""
    hf = {"lm_head.weight": hf["model.embed_tokens.weight"], **hf}
    target = ours.state_dict()
    out = {mine: hf[theirs] for mine, theirs in _MODEL_NAMES}
    for i in range(num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for mine, theirs in _LAYER_NAMES:
            if dst + mine in target:
                out[dst + mine] = hf[src + theirs]
        fc1, gate, up = _GATE_UP
        out[dst + fc1] = torch.cat((hf[src + gate], hf[src + up]))
    for name, value in target.items():  # biases Qwen2 lacks, and our FP8 state: as created
        out.setdefault(name, torch.zeros_like(value) if name.endswith("bias") else value)
    return out


def _named(value: object) -> str:
    """A module by its class (its repr lists every layer), anything else as the checks show it."""
    return type(value).__name__ if isinstance(value, nn.Module) else shown(value)


def _hf_state(ours: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """The inverse of :func:`_mapped_state`: our state dict ``ours`` in ``transformers``' names;
    ValueError for a bias of ours that has no place there and is not zero."""
    out = {theirs: ours[mine] for mine, theirs in _MODEL_NAMES}
    for i in range(num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        for mine, theirs in _LAYER_NAMES:
            if src + mine in ours:
                out[dst + theirs] = ours[src + mine]
        fc1, gate, up = _GATE_UP
        out[dst + gate], out[dst + up] = ours[src + fc1].chunk(2)
        for name in (src + bias for bias in _NOT_IN_HF):
            if name in ours and bool(ours[name].any()):
                raise ValueError(f"to_hf: {name} is not zero, and transformers' layout has no "
                                 "such bias (from_hf freezes it at zero)")  # fmt: skip
    return out
