"""Declared domains of every public argument, for the bad-input walker (tests/test_bad_inputs.py).

One line per argument: ``"name": <domain>``. A domain says which values are valid and yields the
invalid ones the walker tries (wrong type, bool for int, zero or negative sizes, NaN / inf /
non-positive floats, truthy strings for switches, unknown strings for choices, wrong tensor
ranks, dtypes and shapes). ``COMMON`` holds the arguments that mean the same everywhere
(``device``, ``params_dtype``, ``sequence_parallel``, ...); ``DOMAINS[owner]`` the rest, where
``owner`` is the public name (``"te.Linear"``, ``"te.Linear.forward"``,
``"te.functional.linear"``, ``"te.ops.BasicLinear"``, ``"te.recipe.DelayedScaling"``). An owner
entry wins over ``COMMON``. A parameter with neither fails the walker: a new public argument
declares its domain (``ANY("why")`` where no value can be wrong, rare)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Domain:
    """``what``: the constraint in words; ``bad``: invalid values (or, for tensors, functions of
    the valid tensor giving ``(label, invalid tensor)``); ``skip``: why nothing is tried."""

    what: str
    bad: tuple[Any, ...] = ()
    tensor_bad: tuple[Callable[[torch.Tensor], tuple[str, Any]], ...] = field(default=())
    skip: str = ""
    # Other arguments a message may name instead for a shape that disagrees with theirs.
    peers: tuple[str, ...] = ()
    # False where every value but None is refused (a feature not built): the message names the
    # argument and says why, without echoing the value.
    shows_value: bool = True


def _floats(*extra: Any) -> tuple[Any, ...]:
    return (math.nan, math.inf, "1.0", *extra)


def POS_INT() -> Domain:
    return Domain("int > 0", ("4", True, 0, -1, 2.5))


def NONNEG_INT() -> Domain:
    return Domain("int >= 0", ("4", True, -1, 2.5))


def INT() -> Domain:
    return Domain("int", ("4", True, 2.5))


def SWITCH() -> Domain:
    return Domain("bool", ("yes", 1))


def POS_FLOAT() -> Domain:
    return Domain("finite float > 0", _floats(0.0, -1.0))


def NONNEG_FLOAT() -> Domain:
    return Domain("finite float >= 0", _floats(-1.0))


def FINITE_FLOAT() -> Domain:
    return Domain("finite float", _floats())


def PROB() -> Domain:
    return Domain("probability in [0, 1)", (math.nan, -0.1, 1.5, "0.1"))


def CHOICE(*_valid: Any) -> Domain:
    return Domain("one of a fixed set of names", ("not-a-choice", 3))


def SPEC() -> Domain:
    """A ``functional.spec`` string (or its object)."""
    return Domain("a spec string of te_compile.functional.spec", ("not-a-token", 3))


def DTYPE() -> Domain:
    return Domain("floating torch.dtype", ("float32", torch.int32))


def DEVICE() -> Domain:
    return Domain("torch.device or device string", ("not-a-device", 1.5))


def CALLABLE() -> Domain:
    return Domain("callable", (3,))


def ANY(reason: str) -> Domain:
    return Domain("any", skip=reason)


# Tensor variants: each gives (label, bad value) from the valid tensor.


def _rank0(t):
    return "0-dim", t.detach().reshape(-1)[0].clone()


def _int_dtype(t):
    return "int64 dtype", t.detach().to(torch.int64)


def _float_dtype(t):
    return "float32 dtype", t.detach().float()


def _last_dim(t):
    return "last dim one short", t.detach()[..., :-1].clone()


def _first_dim(t):
    return "first dim one short", t.detach()[:-1].clone()


def _extra_dim(t):
    return "one more dim", t.detach().unsqueeze(0).clone()


def _meta_device(t):
    return "on the meta device", t.detach().to("meta")


def not_tensor(t):
    return "a list", t.detach().tolist()


def none(t):
    """None for a tensor argument: tried only where the signature does not allow None (no
    ``None`` default, no ``| None`` in the annotation)."""
    return "None", None


def TENSOR(*variants: Callable, peers: tuple[str, ...] = ()) -> Domain:
    """A floating tensor: not a list or None, not 0-dim, not an integer dtype, plus
    ``variants``."""
    bad = (not_tensor, none, _rank0, _int_dtype, *variants)
    return Domain("floating tensor", tensor_bad=bad, peers=peers)


def INDEX_TENSOR(*variants: Callable, peers: tuple[str, ...] = ()) -> Domain:
    """An integer (or bool) tensor: not a list or None, not floating, plus ``variants``."""
    bad = (not_tensor, none, _float_dtype, *variants)
    return Domain("integer tensor", tensor_bad=bad, peers=peers)


def ANY_RANK_TENSOR() -> Domain:
    """A floating tensor of any rank (element-wise ops: a 0-dim tensor is valid)."""
    return Domain("floating tensor", tensor_bad=(not_tensor, none, _int_dtype))


def ANY_DTYPE_TENSOR(*variants: Callable) -> Domain:
    """A tensor of any dtype with at least one dim (layout ops)."""
    return Domain("tensor", tensor_bad=(not_tensor, none, _rank0, *variants))


def UNSUPPORTED(what: str) -> Domain:
    """Only None (the default) is accepted: anything else is refused, by name."""
    return Domain(f"None ({what})", (3, "x"), shows_value=False)


LAST, FIRST, EXTRA = _last_dim, _first_dim, _extra_dim
# On another device than the tensors it meets (the walker's valid call is on the CPU): a
# parameter of a functional, or a module's input (its parameters stay on the CPU).
META = _meta_device

COMMON: dict[str, Domain] = {
    "device": DEVICE(),
    "params_dtype": DTYPE(),
    "dtype": DTYPE(),
    "sequence_parallel": SWITCH(),
    "tp_group": ANY("a process group; torch.distributed checks it"),
    "process_group": ANY("a process group; torch.distributed checks it"),
    "tp_size": POS_INT(),
    "init_method": CALLABLE(),
    "output_layer_init_method": CALLABLE(),
    "get_rng_state_tracker": UNSUPPORTED("dropout seeds come from an explicit RNG state"),
    "fuse_wgrad_accumulation": SWITCH(),
    "zero_centered_gamma": SWITCH(),
    "return_bias": SWITCH(),
    "return_layernorm_output": SWITCH(),
    "bias": SWITCH(),
    "eps": POS_FLOAT(),
    "layernorm_epsilon": POS_FLOAT(),
    "qk_norm_eps": POS_FLOAT(),
    "normalization": CHOICE("LayerNorm", "RMSNorm"),
    "glu_interleave_size": NONNEG_INT(),  # 0 or None: contiguous halves
    "limit": POS_FLOAT(),
    "alpha": POS_FLOAT(),
    "glu_linear_offset": FINITE_FLOAT(),
    "beta1": POS_FLOAT(),  # SiTUGLU's soft caps
    "beta2": POS_FLOAT(),
    "interleaved": SWITCH(),
    "fp8_dpa": SWITCH(),
    "fp8_mha": SWITCH(),
    "fp8_format": CHOICE("Format"),
    "backward_override": CHOICE(None, "high_precision", "dequantized"),
    "margin": NONNEG_INT(),
    "out_dtype": DTYPE(),
    "fp8_dtype": CHOICE(torch.float8_e4m3fn, torch.float8_e5m2),
    "columnwise": SWITCH(),
    "rowwise": SWITCH(),
    "inp": TENSOR(),
    "input": TENSOR(),
    "training": SWITCH(),
    "power_2_scale": SWITCH(),
    "delay_wgrad_compute": SWITCH(),
    "save_original_input": SWITCH(),
    "overwrite_main_grad": SWITCH(),
    "rng_tracker_name": Domain("str or None", (3, True)),
    "is_first_microbatch": Domain("bool or None", ("yes", 1)),
    "cache_quantized_input": SWITCH(),
    "in_place": SWITCH(),
    "tensor_parallel_mode": CHOICE("column", "row", None),
    "tensor_parallel_group": ANY("a process group; torch.distributed checks it"),
    "tensor_parallel": SWITCH(),
    "rng_state_tracker_function": CALLABLE(),
    "activation_recompute_in_mlp": SWITCH(),
}

_QKV_FORMAT = CHOICE("sbhd", "bshd", "thd")
_MASK = CHOICE("causal", "no_mask", "padding", "...")
_WINDOW = Domain("(left, right) ints >= -1", ("4", (1,), (1.5, 0)))
_ACTIVATION = CHOICE("gelu", "...")
_ROUTING_INT = Domain("int >= -1 or None", ("4", True, -2, 2.5))
_SPLITS = Domain("ints >= 0 summing to the rows", ("4", 6, None, [1, 2], [-1, 7]))
_FP8_RECIPE = Domain("a te_compile.recipe recipe", ("delayed", 3))
_ROPE_SCALING = Domain("None or a te_compile.RopeScaling", ("llama3", 3))
_ATTN = {
    "num_attention_heads": POS_INT(),
    "num_gqa_groups": POS_INT(),
    "attention_dropout": PROB(),
    "hidden_dropout": PROB(),
    "qkv_format": _QKV_FORMAT,
    "attn_input_format": _QKV_FORMAT,
    "attn_mask_type": _MASK,
    "self_attn_mask_type": _MASK,
    "enc_dec_attn_mask_type": _MASK,
    "window_size": _WINDOW,
    "enc_dec_window_size": _WINDOW,
    "attention_type": CHOICE("self", "cross"),
    "layer_number": POS_INT(),
    "softmax_scale": POS_FLOAT(),
    "softmax_type": CHOICE("vanilla", "off-by-one", "learnable"),
    "kv_channels": POS_INT(),
    "set_parallel_mode": SWITCH(),
    "fuse_qkv_params": SWITCH(),
    "qkv_weight_interleaved": SWITCH(),
    "rotary_pos_interleaved": SWITCH(),
    "input_layernorm": SWITCH(),
    "qk_norm_type": CHOICE("L2Normalization", "RMSNorm", "LayerNorm"),
    "qk_norm_before_rope": SWITCH(),
    "qk_layernorm": SWITCH(),
    "apply_residual_connection_post_layernorm": SWITCH(),
    "output_layernorm": SWITCH(),
    "parallel_attention_mlp": SWITCH(),
    "layer_type": CHOICE("encoder", "decoder"),
    "drop_path_rate": PROB(),
    "activation": _ACTIVATION,
    "hidden_size": POS_INT(),
    "ffn_hidden_size": POS_INT(),
}
_ATTN_FORWARD = {
    "hidden_states": TENSOR(LAST),
    "attention_mask": ANY("a mask or None; its shape is the backend's to check"),
    "encoder_output": TENSOR(LAST),
    "enc_dec_attn_mask": ANY("a mask or None; its shape is the backend's to check"),
    "attn_mask_type": _MASK,
    "self_attn_mask_type": _MASK,
    "enc_dec_attn_mask_type": _MASK,
    "window_size": _WINDOW,
    "enc_dec_window_size": _WINDOW,
    "is_first_microbatch": ANY("a hint: True, False or None all valid"),
    "checkpoint_core_attention": SWITCH(),
    "fast_zero_fill": SWITCH(),
    "inference_params": UNSUPPORTED("KV-cache inference is not implemented"),
    "rotary_pos_emb": TENSOR(),
    "core_attention_bias_type": CHOICE("no_bias", "post_scale_bias", "alibi"),
    "core_attention_bias": TENSOR(),
    "alibi_slopes": TENSOR(),
    "cu_seqlens_q": INDEX_TENSOR(),
    "cu_seqlens_kv": INDEX_TENSOR(),
    "max_seqlen_q": POS_INT(),
    "max_seqlen_kv": POS_INT(),
}
_WEIGHT_QUANTIZED = Domain("the tensors of te.functional.quantize_weight, or None", (3, "w", [1]))
# The weight casts' arguments (te.functional.quantize_weight / quantize_grouped_weight).
_WEIGHT_CAST = {"weight": TENSOR(EXTRA), "spec": SPEC(), "scale": TENSOR()}
_GLU_FN = {"inp": TENSOR(LAST)}
_ACT_FN = {"inp": ANY_RANK_TENSOR()}

_GROUP = Domain("a ProcessGroup, a 1-D DeviceMesh, (mesh, dim) or None", (3, "tp"))
_PARTITION_DIM = Domain("-1 or a dim of the tensor", ("4", True, 2.5, -2, 5))
_COLLECTIVE = {
    "x": ANY_DTYPE_TENSOR(),  # any dtype; gathered or scattered along dim: not 0-dim
    "group": _GROUP,
    "dim": Domain("int, a dim of x", ("4", True, 2.5, 2, -3)),
}
_REDUCTION = {"x": Domain("tensor", tensor_bad=(not_tensor,)), "group": _GROUP}
_MODULE = Domain("an nn.Module", (3, "model"))
_STATE = Domain("a state_dict (dict)", (3, "x"))
_OPTIM_STATE = Domain("an optimizer state dict with a 'state' dict", (3, {"param_groups": []}))

_INIT = {
    "enabled": SWITCH(),
    "recipe": _FP8_RECIPE,
    "preserve_high_precision_init_val": SWITCH(),
}
_FUSION = {"op_fusion_func": CALLABLE(), "prepend": SWITCH()}

DOMAINS: dict[str, dict[str, Domain]] = {
    # modules: constructors
    "te.Linear": {
        "in_features": POS_INT(),
        "out_features": POS_INT(),
        "parallel_mode": CHOICE("column", "row", None),
        "parameters_split": Domain("dict of name: size or tuple of names", (3, "qkv")),
    },
    "te.LayerNormLinear": {
        "in_features": POS_INT(),
        "out_features": POS_INT(),
        "parallel_mode": CHOICE("column", "row", None),
        "parameters_split": Domain("dict or tuple of names", (3, "qkv")),
    },
    "te.LayerNormMLP": {
        "hidden_size": POS_INT(),
        "ffn_hidden_size": POS_INT(),
        "activation": _ACTIVATION,
        "activation_params": Domain("dict of clamped_swiglu params", (3, "x")),
        "checkpoint": SWITCH(),
    },
    "te.LayerNorm": {"normalized_shape": POS_INT(), "hidden_size": POS_INT()},
    "te.RMSNorm": {"normalized_shape": POS_INT(), "hidden_size": POS_INT()},
    "te.GroupedLinear": {
        "num_gemms": POS_INT(),
        "in_features": POS_INT(),
        "out_features": POS_INT(),
        "single_grouped_parameter": SWITCH(),
        "single_grouped_weight": SWITCH(),
        "single_grouped_bias": SWITCH(),
        "parallel_mode": CHOICE("column", "row", None),
        "use_grouped_tensor": Domain("a bool or None", (1, "True", 0.0)),
    },
    "te.GroupedMLP": {
        "num_experts": POS_INT(),
        "hidden_size": POS_INT(),
        "ffn_hidden_size": POS_INT(),
        "activation": _ACTIVATION,
        "single_grouped_parameter": SWITCH(),
    },
    "te.Fp8Padding": {"num_gemms": POS_INT(), "align_size": POS_INT()},
    "te.Fp8Unpadding": {"num_gemms": POS_INT(), "align_size": POS_INT()},
    "te.DotProductAttention": _ATTN,
    "te.MultiheadAttention": _ATTN,
    "te.TransformerLayer": {
        **_ATTN,
        "activation_params": Domain("dict of clamped_swiglu params", (3, "x")),
    },
    "te.RotaryPositionEmbedding": {
        "dim": POS_INT(),
        "rotary_percent": Domain("float in (0, 1]", _floats(0.0, 1.5)),
        "seq_len_interpolation_factor": POS_FLOAT(),
        "pretrained_max_position_embeddings": POS_INT(),
        "rotary_base": POS_FLOAT(),
        "rope_scaling": _ROPE_SCALING,
    },
    "te.RopeScaling": {
        "rope_type": CHOICE("linear", "llama3", "yarn"),
        "factor": POS_FLOAT(),
        "low_freq_factor": POS_FLOAT(),
        "high_freq_factor": POS_FLOAT(),
        "original_max_position_embeddings": POS_INT(),
        # yarn's (the walker's call is llama3's: refused as another rope_type's field, or bad)
        "beta_fast": POS_FLOAT(),
        "beta_slow": POS_FLOAT(),
        "mscale": POS_FLOAT(),
        "mscale_all_dim": POS_FLOAT(),
        "attention_factor": POS_FLOAT(),
        "truncate": SWITCH(),
    },
    # modules: forwards
    "te.Linear.forward": {"inp": TENSOR(LAST, META)},
    "te.LayerNormLinear.forward": {"inp": TENSOR(LAST, META)},
    "te.LayerNormMLP.forward": {"inp": TENSOR(LAST, META)},
    "te.LayerNorm.forward": {"inp": TENSOR(LAST, META)},
    "te.RMSNorm.forward": {"inp": TENSOR(LAST, META)},
    "te.GroupedLinear.forward": {"inp": TENSOR(LAST, FIRST, META), "m_splits": _SPLITS},
    "te.GroupedMLP.forward": {"inp": TENSOR(LAST, FIRST, META), "m_splits": _SPLITS},
    "te.Fp8Padding.forward": {"inp": ANY_DTYPE_TENSOR(FIRST), "m_splits": _SPLITS},
    "te.Fp8Unpadding.forward": {
        "inp": ANY_DTYPE_TENSOR(FIRST),
        "m_splits": Domain("ints >= 0", ("4", 6, None, [-1, 7])),
    },
    "te.DotProductAttention.forward": {
        "query": TENSOR(LAST),
        "key": TENSOR(LAST, META),
        "value": TENSOR(META),
        **_ATTN_FORWARD,
    },
    "te.MultiheadAttention.forward": {**_ATTN_FORWARD, "hidden_states": TENSOR(LAST, META)},
    "te.TransformerLayer.forward": {**_ATTN_FORWARD, "hidden_states": TENSOR(LAST, META)},
    "te.RotaryPositionEmbedding.forward": {"max_seq_len": POS_INT(), "offset": NONNEG_INT()},
    # top-level utilities
    "te.autocast": {
        "enabled": SWITCH(),
        "calibrating": SWITCH(),
        "recipe": _FP8_RECIPE,
        "amax_reduction_group": ANY("a process group; torch.distributed checks it"),
    },
    "te.fp8_autocast": {
        "enabled": SWITCH(),
        "calibrating": SWITCH(),
        "fp8_recipe": _FP8_RECIPE,
        "fp8_group": ANY("a process group; torch.distributed checks it"),
        "_graph": SWITCH(),
    },
    "te.checkpoint": {
        "function": CALLABLE(),
        "distribute_saved_activations": SWITCH(),
        "use_reentrant": SWITCH(),
    },
    "te.quantize": {
        "tensor": TENSOR(),
        "recipe": _FP8_RECIPE,
        "role": CHOICE("input", "weight", "grad_output"),
        "scale": ANY_RANK_TENSOR(),
    },
    "te.dequantize": {"q": Domain("a Quantized from te.quantize", (3, "q"))},
    "te.bulk_allocate": {
        "shapes": Domain("sequence of shapes", (3, [(-1, 2)], [("2",)])),
        "dtypes": Domain("sequence of dtypes", (3, ["float32"])),
        "alignments": Domain("ints, powers of two", ([3], [0], ["8"])),
        "zero": SWITCH(),
    },
    "te.quantized_model_init": _INIT,
    "te.fp8_model_init": _INIT,
    "te.FP8MasterWeights": {"model": Domain("an nn.Module with FP8 primary weights", (3, "model"))},
    "te.make_graphed_callables": {
        "modules": Domain("a callable or a tuple of callables", (3, (3,))),
        "sample_args": Domain("a tuple of arguments, or one per callable", (3, "x")),
        "num_warmup_iters": NONNEG_INT(),
        "allow_unused_input": SWITCH(),
        "sample_kwargs": Domain("a dict, one per callable, or None", (3, "x", {1: 2})),
        "fp8_enabled": Domain("bool, one per callable, or None", ("yes", 1)),
        "fp8_calibrating": Domain("bool or None", ("yes", 1)),
        "fp8_recipe": _FP8_RECIPE,
        "fp8_group": ANY("a process group; torch.distributed checks it"),
        "fp8_weight_caching": Domain("bool or None", ("yes", 1)),
        "enabled": Domain("bool, one per callable, or None", ("yes", 1)),
        "calibrating": Domain("bool or None", ("yes", 1)),
        "recipe": _FP8_RECIPE,
        "amax_reduction_group": ANY("a process group; torch.distributed checks it"),
        "cache_quantized_params": Domain("bool or None", ("yes", 1)),
        "_order": Domain("list of non-zero ints or None", (3, ["a"])),
        "_num_layers_per_chunk": Domain("list of ints > 0 or None", (3, ["a"], [0])),
        "pool": Domain("a graph pool handle or None", (3, "x")),
        "retain_graph_in_backward": SWITCH(),
        "_reuse_graph_input_output_buffers": SWITCH(),
        "_clone_param_grads_on_return": SWITCH(),
        "pre_warmup_hook": CALLABLE(),
        "post_warmup_hook": CALLABLE(),
        "capture_time_hooks": Domain("None (a list of hook dicts: not implemented)", (3, "x")),
        "capture_stream": Domain("a torch.cuda.Stream or None", (3, "x")),
    },
    "te.set_eager_fast_path": {"enabled": SWITCH()},
    "te.set_static_launch": {"enabled": SWITCH()},
    "te.is_bf16_available": {"return_reason": SWITCH()},
    "te.is_fp8_available": {"return_reason": SWITCH()},
    "te.is_fp8_block_scaling_available": {"return_reason": SWITCH()},
    "te.is_mxfp8_available": {"return_reason": SWITCH()},
    "te.is_nvfp4_available": {"return_reason": SWITCH()},
    "te.non_finite_amaxes": {"model": Domain("an nn.Module", (3, "model"))},
    "te.apply_rotary_pos_emb": {
        "t": TENSOR(LAST),
        "freqs": TENSOR(LAST, META),
        "tensor_format": _QKV_FORMAT,
        "start_positions": UNSUPPORTED("per-sequence position offsets are not implemented"),
        "fused": SWITCH(),
        "cu_seqlens": INDEX_TENSOR(),
        "cp_size": POS_INT(),
        "cp_rank": NONNEG_INT(),
    },
    "te.interleave_glu_tensor": {
        "tensor": ANY_DTYPE_TENSOR(FIRST),
        "interleave_size": POS_INT(),
        "dim": INT(),
    },
    "te.deinterleave_glu_tensor": {
        "tensor": ANY_DTYPE_TENSOR(FIRST),
        "interleave_size": POS_INT(),
        "dim": INT(),
    },
    "te.moe_permute": {
        "routing_map": INDEX_TENSOR(FIRST),
        "num_out_tokens": _ROUTING_INT,
        "max_token_num": _ROUTING_INT,
        "map_type": CHOICE("mask", "index"),
        "inp": TENSOR(FIRST),
    },
    "te.moe_permute_with_probs": {
        "inp": TENSOR(FIRST),
        "probs": TENSOR(FIRST),
        "routing_map": INDEX_TENSOR(FIRST),
        "num_out_tokens": _ROUTING_INT,
    },
    "te.moe_unpermute": {
        "inp": TENSOR(),  # its rows are read through row_id_map's values
        "row_id_map": INDEX_TENSOR(FIRST, peers=("merging_probs",)),
        "merging_probs": TENSOR(FIRST),
        "restore_shape": Domain("shape or None", (3, "x")),
        "map_type": CHOICE("mask", "index"),
        "probs": TENSOR(FIRST),
    },
    "te.moe_sort_chunks_by_index": {
        "inp": TENSOR(),  # its rows: split_sizes' values
        "split_sizes": INDEX_TENSOR(FIRST, peers=("sorted_index",)),
        "sorted_index": INDEX_TENSOR(FIRST),
    },
    "te.moe_sort_chunks_by_index_with_probs": {
        "inp": TENSOR(FIRST, peers=("probs",)),
        "probs": TENSOR(FIRST),
        "split_sizes": INDEX_TENSOR(FIRST, peers=("sorted_index",)),
        "sorted_index": INDEX_TENSOR(FIRST),
    },
    # te.distributed
    "te.distributed.all_gather": _COLLECTIVE,
    "te.distributed.reduce_scatter": _COLLECTIVE,
    "te.distributed.scatter": _COLLECTIVE,
    "te.distributed.all_reduce": _REDUCTION,
    "te.distributed.all_reduce_grad": _REDUCTION,
    "te.distributed.all_reduce_max": _REDUCTION,
    "te.distributed.resolve_group": {
        "group": Domain(_GROUP.what, _GROUP.bad, peers=("tp_group",)),  # named as ``arg`` says
        "owner": Domain("str", (3,)),
        "arg": Domain("str", (3,)),
    },
    "te.distributed.vocab_parallel_cross_entropy": {
        "logits": TENSOR(FIRST, peers=("target",)),
        "target": INDEX_TENSOR(FIRST, peers=("logits",)),
        "group": _GROUP,
        "ignore_index": INT(),
        "reduction": CHOICE("mean", "sum", "none"),
    },
    "te.distributed.TensorParallel": {
        "mode": CHOICE("column", "row", None),
        "sequence_parallel": SWITCH(),
        "size": POS_INT(),
        "group": Domain("a ProcessGroup or None", (3, "tp")),
        "rank": Domain("int in [0, size)", ("4", True, -1, 2.5, 1)),
    },
    "te.distributed.set_parallel_attributes": {
        "param": Domain("a tensor or None", (3, "w")),
        "partition_dim": _PARTITION_DIM,
        "stride": POS_INT(),
        "parts": Domain("None or ints > 0", (3, ("a",), (0,))),
    },
    "te.distributed.shard_tensor": {
        "full": ANY_DTYPE_TENSOR(FIRST),
        "partition_dim": _PARTITION_DIM,
        "stride": POS_INT(),
        "rank": Domain("int in [0, size)", ("4", True, -1, 2.5, 2)),
        "size": POS_INT(),
        "parts": Domain("None or ints > 0 summing to full's dim", (3, ("a",), (3, 4))),
    },
    "te.distributed.unshard_tensor": {
        "pieces": Domain("a non-empty list of same-shape tensors", (3, [], [3])),
        "partition_dim": _PARTITION_DIM,
        "stride": POS_INT(),
        "parts": Domain("None or ints > 0, each divisible by the pieces", (3, (3, 4), (3, 5))),
    },
    "te.distributed.shard_state_dict": {"module": _MODULE, "full_state_dict": _STATE},
    "te.distributed.gather_state_dict": {"module": _MODULE, "state_dict": _STATE},
    "te.distributed.gather_optimizer_state_dict": {
        "module": _MODULE,
        "optim_state_dict": _OPTIM_STATE,
    },
    "te.distributed.shard_optimizer_state_dict": {
        "module": _MODULE,
        "full_optim_state_dict": _OPTIM_STATE,
    },
    # te.convert
    "te.convert.CausalLM": {
        "vocab_size": POS_INT(),
        "hidden_size": POS_INT(),
        "ffn_hidden_size": POS_INT(),
        "num_layers": POS_INT(),
        "num_attention_heads": POS_INT(),
        "num_gqa_groups": POS_INT(),
        "kv_channels": POS_INT(),
        "eps": POS_FLOAT(),
        "rotary_base": POS_FLOAT(),
        "qkv_bias": SWITCH(),
        "window_size": _WINDOW,
        "tie_word_embeddings": SWITCH(),
        "rope_scaling": _ROPE_SCALING,
    },
    "te.convert.CausalLM.forward": {
        "input_ids": INDEX_TENSOR(EXTRA, META),
        "attention_mask": INDEX_TENSOR(FIRST, LAST, EXTRA, META),
        "position_ids": INDEX_TENSOR(LAST, EXTRA, META),  # one row short: [1, s] is valid
        "labels": INDEX_TENSOR(FIRST, LAST, EXTRA, META),
        "return_dict": SWITCH(),
    },
    "te.convert.from_hf": {"model": Domain("a transformers causal LM", (3, "model"))},
    "te.convert.to_hf": {
        "model": Domain("a te.convert.CausalLM", (3, "model")),
        "hf_model": Domain("None or a transformers causal LM", (3, "x")),
    },
    # te.functional
    "te.functional.as_splits_tensor": {
        "m_splits": Domain("ints >= 0", ("4", 6, None, [-1, 2], [1.5]))
    },
    "te.functional.bias_activation": {
        "inp": TENSOR(LAST),
        "bias": TENSOR(LAST, META),
        "activation": _ACTIVATION,
    },
    "te.functional.blockwise_supported": {
        "weight": TENSOR(),
        "weight_block_rows": CHOICE(1, 128),
        "fwd_dtype": CHOICE(torch.float8_e4m3fn),
        "bwd_dtype": CHOICE(torch.float8_e5m2),
    },
    "te.functional.branch_rmsnorm": {"inp": TENSOR(LAST), "weight": TENSOR(LAST, META)},
    "te.functional.clamped_swiglu": _GLU_FN,
    "te.functional.geglu": _GLU_FN,
    "te.functional.glu": _GLU_FN,
    "te.functional.qgeglu": _GLU_FN,
    "te.functional.reglu": _GLU_FN,
    "te.functional.sreglu": _GLU_FN,
    "te.functional.swiglu": _GLU_FN,
    "te.functional.gelu": _ACT_FN,
    "te.functional.qgelu": _ACT_FN,
    "te.functional.relu": _ACT_FN,
    "te.functional.silu": _ACT_FN,
    "te.functional.srelu": _ACT_FN,
    "te.functional.delayed_scaling_update": {
        "amax_history": TENSOR(),
        "scale": TENSOR(),
        "amax": TENSOR(),
        "amax_tail": TENSOR(),
        "fp8_max": Domain("list of positive finite floats", ([0.0], [math.nan], [-1.0])),
        "amax_compute_algo": CHOICE("max", "most_recent"),
    },
    "te.functional.dequantize_mxfp8": {"data": TENSOR(), "scale": TENSOR()},
    "te.functional.dequantize_nvfp4": {
        "data": TENSOR(),
        "scale": TENSOR(),
        "global_scale": ANY_RANK_TENSOR(),
    },
    "te.functional.quantize_mxfp8": {"x": TENSOR()},
    "te.functional.quantize_nvfp4": {"x": TENSOR(), "global_amax": ANY_RANK_TENSOR()},
    "te.functional.dot_product_attention": {
        "query": TENSOR(LAST),
        "key": TENSOR(LAST, META),
        "value": TENSOR(META),  # v's head dim is free
        **{k: v for k, v in _ATTN_FORWARD.items() if k != "hidden_states"},
        "qkv_format": _QKV_FORMAT,
        "softmax_scale": POS_FLOAT(),
        "dropout_p": PROB(),
        "rng_state": INDEX_TENSOR(),
        "softmax_type": CHOICE("vanilla", "off-by-one", "learnable"),
        "softmax_offset": TENSOR(),
    },
    "te.functional.dropout": {"inp": ANY_RANK_TENSOR(), "p": PROB(), "rng_state": INDEX_TENSOR()},
    "te.functional.fake_quantize": {
        "spec": SPEC(),
        "grad_spec": SPEC(),
        "row_splits": INDEX_TENSOR(),
    },
    "te.functional.grouped_linear": {
        "inp": TENSOR(LAST, FIRST),
        "m_splits": _SPLITS,
        "weight": TENSOR(LAST, EXTRA, META),
        "bias": TENSOR(LAST, META),
        "main_grad": TENSOR(LAST),
        "input_spec": SPEC(),
        "weight_spec": SPEC(),
        "grad_spec": SPEC(),
        "return_amax": SWITCH(),
        "delay_wgrad": SWITCH(),
        "scale": TENSOR(),
        "grad_amax": TENSOR(),
        "fp8_wgrad": SWITCH(),
        "weight_quantized": Domain(
            "the tensors of te.functional.quantize_grouped_weight, or None", (3, "w", [1])
        ),
        "rng_state": INDEX_TENSOR(),
    },
    "te.functional.l2normalization": {"inp": TENSOR()},
    "te.functional.layernorm": {"weight": TENSOR(LAST, META), "bias": TENSOR(LAST, META)},
    "te.functional.rmsnorm": {"weight": TENSOR(LAST, META)},
    "te.functional.linear": {
        "inp": TENSOR(LAST),
        "weight": TENSOR(LAST, EXTRA, META),
        "bias": TENSOR(LAST, META),
        "main_grad": TENSOR(LAST),
        "input_spec": SPEC(),
        "weight_spec": SPEC(),
        "grad_spec": SPEC(),
        "return_amax": SWITCH(),
        "norm_eps": POS_FLOAT(),
        "normalization": CHOICE("", "LayerNorm", "RMSNorm"),
        "delay_wgrad": SWITCH(),
        "scale": TENSOR(),
        "grad_amax": TENSOR(),
        "norm_weight": TENSOR(LAST),
        "norm_bias": TENSOR(LAST),
        "activation": _ACTIVATION,
        "residual": TENSOR(LAST),
        "out_scale": FINITE_FLOAT(),
        "return_branch": SWITCH(),
        "rng_state": INDEX_TENSOR(),
        "weight_quantized": _WEIGHT_QUANTIZED,
    },
    "te.functional.mlp": {
        "inp": TENSOR(LAST),
        "fc1_weight": TENSOR(LAST, EXTRA, META),
        "fc1_bias": TENSOR(LAST, META),
        "fc2_weight": TENSOR(LAST, EXTRA, META),
        "fc2_bias": TENSOR(LAST, META),
        "activation": _ACTIVATION,
        "input_spec": SPEC(),
        "weight_spec": SPEC(),
        "grad_spec": SPEC(),
        "return_amax": SWITCH(),
        "norm_eps": POS_FLOAT(),
        "normalization": CHOICE("", "LayerNorm", "RMSNorm"),
        "scale1": TENSOR(),
        "scale2": TENSOR(),
        "grad_amax1": TENSOR(),
        "grad_amax2": TENSOR(),
        "norm_weight": TENSOR(LAST),
        "norm_bias": TENSOR(LAST),
        "fc1_weight_quantized": _WEIGHT_QUANTIZED,
        "fc2_weight_quantized": _WEIGHT_QUANTIZED,
        "main_grad1": TENSOR(LAST),
        "main_grad2": TENSOR(LAST),
    },
    "te.functional.quantize_grouped_weight": _WEIGHT_CAST,
    "te.functional.quantize_weight": _WEIGHT_CAST,
    "te.functional.rotary_frequencies": {
        "inv_freq": TENSOR(EXTRA),
        "max_seq_len": POS_INT(),
        "offset": NONNEG_INT(),
        "seq_len_interpolation_factor": POS_FLOAT(),
        "pretrained_max_position_embeddings": POS_INT(),
    },
    # te.ops
    "te.ops.BasicLinear": {
        "in_features": POS_INT(),
        "out_features": POS_INT(),
        "accumulate_into_main_grad": SWITCH(),
        "userbuffers_options": Domain(
            "None or a dict (Userbuffers overlap: not implemented)", (3, "x")
        ),
    },
    "te.ops.Linear": {
        "in_features": POS_INT(),
        "out_features": POS_INT(),
        "accumulate_into_main_grad": SWITCH(),
    },
    "te.ops.Bias": {"size": POS_INT()},
    "te.ops.register_forward_fusion": _FUSION,
    "te.ops.register_backward_fusion": _FUSION,
    "te.ops.register_forward_backward_fusion": _FUSION,
    "te.ops.GroupedLinear": {
        "num_groups": POS_INT(),
        "in_features": POS_INT(),
        "out_features": POS_INT(),
        "scale_bias": SWITCH(),
        "single_grouped_weight": SWITCH(),
        "single_grouped_bias": SWITCH(),
    },
    "te.ops.ConstantScale": {"scale": FINITE_FLOAT()},
    "te.ops.Dropout": {"p": PROB()},
    "te.ops.L2Normalization": {},
    "te.ops.LayerNorm": {"normalized_shape": POS_INT()},
    "te.ops.RMSNorm": {"normalized_shape": POS_INT()},
    "te.ops.Quantize": {"forward": SWITCH(), "backward": SWITCH()},
    "te.ops.Reshape": {"shape": Domain("sequence of ints", (3, ["a"], [1.5]))},
    "te.ops.Sequential": {"fuse": SWITCH()},
    "te.ops.forward": {"input": TENSOR(LAST, META)},  # the ops walked forward have parameters
    # te.recipe
    "te.recipe.DelayedScaling": {
        "amax_history_len": POS_INT(),
        "amax_compute_algo": CHOICE("max", "most_recent"),
        "scaling_factor_compute_algo": CALLABLE(),
        "reduce_amax": SWITCH(),
    },
    "te.recipe.Float8CurrentScaling": {
        "use_power_2_scales": SWITCH(),
        "fp8_gemm_fprop": Domain("MMParams", (3, True)),
        "fp8_gemm_dgrad": Domain("MMParams", (3, True)),
        "fp8_gemm_wgrad": Domain("MMParams", (3, True)),
    },
    "te.recipe.Float8BlockScaling": {
        "use_f32_scales": SWITCH(),
        "x_block_scaling_dim": CHOICE(1, 2),
        "w_block_scaling_dim": CHOICE(1, 2),
        "grad_block_scaling_dim": CHOICE(1, 2),
        "fp8_gemm_fprop": Domain("MMParams", (3, True)),
        "fp8_gemm_dgrad": Domain("MMParams", (3, True)),
        "fp8_gemm_wgrad": Domain("MMParams", (3, True)),
    },
    "te.recipe.MXFP8BlockScaling": {"enable_2d_quantization": SWITCH()},
    "te.recipe.NVFP4BlockScaling": {
        "disable_rht": SWITCH(),
        "disable_stochastic_rounding": SWITCH(),
        "disable_2d_quantization": SWITCH(),
        "row_scaled_activation": SWITCH(),
        "nvfp4_4over6": CHOICE("none", "weights", "activations", "all"),
        "nvfp4_4over6_e4m3_use_256": CHOICE("none", "weights", "activations", "all"),
        "nvfp4_4over6_err_mode": CHOICE("MAE", "MSE"),
        "fp4_format": CHOICE("Format.E2M1"),
    },
    "te.recipe.MMParams": {"use_split_accumulator": SWITCH()},
    "te.recipe.QParams": {
        "power_2_scale": SWITCH(),
        "amax_epsilon": NONNEG_FLOAT(),
        "random_hadamard_transform": SWITCH(),
        "stochastic_rounding": SWITCH(),
        "fp4_2d_quantization": SWITCH(),
    },
}


def domain(owner: str, name: str) -> Domain | None:
    """The declared domain of ``owner``'s argument ``name``: the owner's own entry, else the
    common one, else None (the walker fails on it)."""
    own = DOMAINS.get(owner, {})
    return own[name] if name in own else COMMON.get(name)
