"""Transformer Engine's constructor signatures on our modules.

TE's modules take every constructor argument positionally, in TE's order; ours take the first
few positionally and the rest by keyword. :func:`te_signature` gives a module TE's order: a
positional argument past ours binds to TE's parameter at that position (so TE code that calls
``GroupedLinear(4, 64, 64, False)`` sets ``sequence_parallel`` as in TE, never another
argument). It also takes the TE arguments a module has no parameter for (userbuffers overlap,
context parallelism, ...): at TE's default value, or where TE itself reads the value only
with a feature left off, they ask for nothing and are dropped; any other value is refused by
name. ``name`` (TE's label for its debug tools) is kept as the module's ``name`` attribute.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

_UB = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")
_GEMM = (*_UB, "ub_name", "symmetric_ar_type", "name")

# TE's positional order (TE 2.x), per module.
ORDERS: dict[str, tuple[str, ...]] = {
    "Linear": (
        "in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation",
        "tp_group", "tp_size", "get_rng_state_tracker", "rng_tracker_name", "init_method",
        "bias", "return_bias", "params_dtype", "parallel_mode", "parameters_split", "device",
        "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
        "ub_bulk_wgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type",
        "save_original_input", "name",
    ),
    "LayerNormLinear": (
        "in_features", "out_features", "eps", "sequence_parallel", "fuse_wgrad_accumulation",
        "tp_group", "tp_size", "get_rng_state_tracker", "init_method", "bias", "normalization",
        "return_bias", "params_dtype", "parallel_mode", "return_layernorm_output",
        "return_layernorm_output_gathered", "parameters_split", "zero_centered_gamma", "device",
        "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad",
        "ub_bulk_dgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "name",
    ),
    "LayerNormMLP": (
        "hidden_size", "ffn_hidden_size", "eps", "sequence_parallel", "return_bias",
        "get_rng_state_tracker", "tp_group", "tp_size", "init_method", "bias", "normalization",
        "activation", "activation_params", "output_layer_init_method", "fuse_wgrad_accumulation",
        "params_dtype", "return_layernorm_output", "return_layernorm_output_gathered",
        "seq_length", "micro_batch_size", "set_parallel_mode", "zero_centered_gamma", "device",
        "ub_overlap_ag", "name", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
        "ub_bulk_wgrad", "delay_wgrad_compute", "symmetric_ar_type", "checkpoint",
    ),
    "GroupedLinear": (
        "num_gemms", "in_features", "out_features", "sequence_parallel",
        "fuse_wgrad_accumulation", "tp_group", "tp_size", "get_rng_state_tracker",
        "rng_tracker_name", "init_method", "bias", "return_bias", "params_dtype",
        "parallel_mode", "device", "ub_overlap_rs", "ub_overlap_ag", "ub_name",
        "delay_wgrad_compute", "save_original_input", "single_grouped_weight",
        "single_grouped_bias", "name", "use_grouped_tensor",
    ),
    "LayerNorm": (
        "normalized_shape", "eps", "sequence_parallel", "params_dtype", "zero_centered_gamma",
        "hidden_size",
    ),
    "DotProductAttention": (
        "num_attention_heads", "kv_channels", "num_gqa_groups", "attention_dropout",
        "qkv_format", "attn_mask_type", "window_size", "bottom_right_diagonal",
        "sequence_parallel", "tp_size", "get_rng_state_tracker", "tp_group", "layer_number",
        "attention_type", "cp_group", "cp_global_ranks", "cp_stream", "cp_comm_type",
        "softmax_scale", "softmax_type", "return_max_logit", "name",
    ),
    "MultiheadAttention": (
        "hidden_size", "num_attention_heads", "kv_channels", "attention_dropout",
        "layernorm_epsilon", "init_method", "output_layer_init_method", "layer_number",
        "attn_mask_type", "window_size", "bottom_right_diagonal", "tp_group", "tp_size",
        "num_gqa_groups", "fuse_wgrad_accumulation", "get_rng_state_tracker",
        "sequence_parallel", "params_dtype", "return_bias", "return_layernorm_output",
        "input_layernorm", "attention_type", "set_parallel_mode", "fuse_qkv_params",
        "zero_centered_gamma", "qkv_weight_interleaved", "rotary_pos_interleaved",
        "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
        "ub_bulk_wgrad", "bias", "normalization", "device", "qkv_format", "name",
        "qk_norm_type", "qk_norm_eps", "qk_norm_before_rope", "seq_length", "micro_batch_size",
        "softmax_type",
    ),
    "TransformerLayer": (
        "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_gqa_groups",
        "layernorm_epsilon", "hidden_dropout", "attention_dropout", "init_method",
        "output_layer_init_method", "layer_number", "kv_channels", "self_attn_mask_type",
        "window_size", "bottom_right_diagonal", "enc_dec_attn_mask_type",
        "enc_dec_bottom_right_diagonal", "enc_dec_window_size", "tp_group", "tp_size",
        "params_dtype", "get_rng_state_tracker", "fuse_wgrad_accumulation", "seq_length",
        "micro_batch_size", "sequence_parallel", "apply_residual_connection_post_layernorm",
        "output_layernorm", "parallel_attention_mlp", "layer_type", "drop_path_rate",
        "set_parallel_mode", "fuse_qkv_params", "rotary_pos_interleaved", "zero_centered_gamma",
        "qkv_weight_interleaved", "ub_tp_comm_overlap", "ub_overlap_ag", "ub_overlap_rs",
        "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "bias", "activation",
        "activation_params", "normalization", "device", "attn_input_format", "name",
        "qk_norm_type", "qk_norm_eps", "qk_norm_before_rope", "softmax_type",
    ),
}  # fmt: skip
ORDERS["RMSNorm"] = ORDERS["LayerNorm"]

# TE's arguments a module has no parameter for: TE's default, which asks for nothing.
_DEFAULTS: dict[str, Any] = {
    **dict.fromkeys(_UB, False), "ub_name": None, "symmetric_ar_type": None, "name": None,
    "return_layernorm_output_gathered": False, "set_parallel_mode": False, "return_bias": False,
    "bottom_right_diagonal": None, "enc_dec_bottom_right_diagonal": None, "cp_group": None,
    "return_max_logit": False, "ub_tp_comm_overlap": False,
}  # fmt: skip
# Values TE reads only with a feature left off here (userbuffers, context parallelism): any.
_INERT = {"seq_length", "micro_batch_size", "cp_global_ranks", "cp_stream", "cp_comm_type"}
ABSENT: dict[str, tuple[str, ...]] = {
    "Linear": _GEMM,
    "LayerNormLinear": (*_GEMM, "return_layernorm_output_gathered"),
    "LayerNormMLP": (
        *_GEMM,
        "return_layernorm_output_gathered",
        "seq_length",
        "micro_batch_size",
        "set_parallel_mode",
    ),
    "GroupedLinear": ("return_bias", "ub_overlap_rs", "ub_overlap_ag", "ub_name", "name"),
    "LayerNorm": (),
    "RMSNorm": (),
    "DotProductAttention": (
        "bottom_right_diagonal",
        "cp_group",
        "cp_global_ranks",
        "cp_stream",
        "cp_comm_type",
        "return_max_logit",
        "name",
    ),
    "MultiheadAttention": (
        *_UB,
        "bottom_right_diagonal",
        "name",
        "seq_length",
        "micro_batch_size",
    ),
    "TransformerLayer": (
        *_UB,
        "ub_tp_comm_overlap",
        "bottom_right_diagonal",
        "enc_dec_bottom_right_diagonal",
        "seq_length",
        "micro_batch_size",
        "name",
    ),
}
# TransformerLayer's userbuffers flags take effect only with ub_tp_comm_overlap (TE's defaults
# for them are True): without it, any value.
_INERT_IN = {"TransformerLayer": set(_UB)}
_HINTS = {
    "bottom_right_diagonal": " (the attn_mask_type '*_bottom_right' variants align the "
    "diagonal bottom-right)",
}


def te_signature(owner: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``__init__`` of module ``owner`` with Transformer Engine's positional order and TE's
    arguments it has no parameter for (module docstring)."""
    order, absent = ORDERS[owner], ABSENT[owner]
    inert = _INERT | _INERT_IN.get(owner, set())

    def wrap(init: Callable[..., None]) -> Callable[..., None]:
        params = list(inspect.signature(init).parameters.values())[1:]
        ours = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        if tuple(ours) != order[: len(ours)]:
            raise AssertionError(f"{owner}: positional {ours} are not TE's {order[: len(ours)]}")
        start = len(ours)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            who = type(self).__name__
            if len(args) > start:
                if len(args) > len(order):
                    raise TypeError(
                        f"{who}: takes at most {len(order)} positional arguments (Transformer "
                        f"Engine's, in its order), got {len(args)}"
                    )
                for i, (key, value) in enumerate(
                    zip(order[start:], args[start:], strict=False), start + 1
                ):
                    if key in kwargs:
                        raise TypeError(
                            f"{who}: got {key!r} twice: as positional argument {i} (Transformer "
                            f"Engine's order) and by keyword"
                        )
                    kwargs[key] = value
                args = args[:start]
            name = None
            for key in absent:
                if key not in kwargs:
                    continue
                value = kwargs.pop(key)
                if key == "name":
                    if value is not None and not isinstance(value, str):
                        raise TypeError(f"{who}: name must be a str or None, got {value!r}")
                    name = value
                elif key not in inert and not _is_default(value, _DEFAULTS[key]):
                    raise NotImplementedError(
                        f"{who}: {key}={value!r} is not implemented by te_compile (Transformer "
                        f"Engine's argument; only its default {_DEFAULTS[key]!r} is taken)"
                        + _HINTS.get(key, "")
                    )
            init(self, *args, **kwargs)
            if name is not None:
                self.name = name

        return __init__

    return wrap


def _is_default(value: object, default: object) -> bool:
    if default is None or isinstance(default, bool):
        return value is default
    return type(value) is type(default) and value == default
