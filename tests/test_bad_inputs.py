"""The bad-input walker: every public argument of every public module (constructor and
forward), function (``te.*``, ``te.functional.*``, ``te.distributed.*``, ``te.convert.*``),
``te.ops`` op and recipe gets the invalid
values its declared domain (``tests/utils/domains.py``) generates, and must refuse each with a
ValueError or TypeError whose message names the argument as the caller spelled it and the bad
value. The walker reads the signatures: a new public argument without a declared domain fails
``test_every_argument_has_a_domain``; a new public callable without a valid call here fails
``test_every_public_callable_is_walked``. A subset of the tensor cases runs again under
``torch.compile(fullgraph=True)``: the same message at trace time."""

from __future__ import annotations

import inspect
import operator
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import te_compile as te
from te_compile import recipe as R
from tests.utils.domains import domain, none, not_tensor

F = te.functional
D = te.distributed


def _x(*shape):
    return torch.randn(*shape)


def _routing():
    rm = torch.zeros(6, 2, dtype=torch.bool)
    rm[:, 0] = True
    rm[3:, 1] = True
    return rm


def _nvfp4():
    data, scale, global_scale, *_ = F.quantize_nvfp4(_x(32, 64))
    return {"data": data, "scale": scale, "global_scale": global_scale}


def _mxfp8():
    data, scale, *_ = F.quantize_mxfp8(_x(32, 64))
    return {"data": data, "scale": scale}


def _delayed():
    return {
        "amax_history": torch.zeros(4, 1),
        "scale": torch.ones(1),
        "amax": torch.ones(1),
        "fp8_max": [448.0],
        "margin": 0,
        "amax_compute_algo": "max",
    }


def _primary_model():
    with te.quantized_model_init(recipe=R.Float8CurrentScaling()):
        return te.Linear(16, 16)


def _fusion(ops, **_kwargs):
    """A fusion that fuses nothing: harmless should a bad call ever register it."""
    return ops


def _hf_model():
    """The least of a Hugging Face Llama ``te.convert.from_hf`` reads: its config and
    state_dict (one layer, hidden 16, two heads of 8)."""
    config = types.SimpleNamespace(
        model_type="llama",
        vocab_size=8,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
    )
    layer = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (8, 16),
        "model.norm.weight": (16,),
        "lm_head.weight": (8, 16),
        layer + "input_layernorm.weight": (16,),
        layer + "post_attention_layernorm.weight": (16,),
        **{layer + f"self_attn.{n}_proj.weight": (16, 16) for n in "qkvo"},
        layer + "mlp.gate_proj.weight": (16, 16),
        layer + "mlp.up_proj.weight": (16, 16),
        layer + "mlp.down_proj.weight": (16, 16),
    }

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = config
            self.weights = {k: _x(*v) for k, v in shapes.items()}
            self.anchor = torch.nn.Parameter(torch.zeros(1))  # from_hf reads the dtype

        def state_dict(self, *args, **kwargs):
            return dict(self.weights)

    return Model()


def _optim_state():
    return {"state": {}, "param_groups": []}


def _qkv():
    return {n: _x(4, 2, 2, 8) for n in ("query", "key", "value")}


# owner -> () -> (callable, valid keyword arguments). Constructors are called as classes,
# forwards as modules (``module(**kwargs)``), so hooks run as for a user.
_MODULES: dict[str, tuple[Callable[[], Any], dict[str, Any], Callable[[], dict[str, Any]]]] = {
    "Linear": (
        lambda: te.Linear(16, 16),
        {"in_features": 16, "out_features": 16},
        lambda: {"inp": _x(6, 16)},
    ),
    "LayerNormLinear": (
        lambda: te.LayerNormLinear(16, 16),
        {"in_features": 16, "out_features": 16},
        lambda: {"inp": _x(6, 16)},
    ),
    "LayerNormMLP": (
        lambda: te.LayerNormMLP(16, 32),
        {"hidden_size": 16, "ffn_hidden_size": 32},
        lambda: {"inp": _x(6, 16)},
    ),
    "LayerNorm": (lambda: te.LayerNorm(16), {"normalized_shape": 16}, lambda: {"inp": _x(6, 16)}),
    "RMSNorm": (lambda: te.RMSNorm(16), {"normalized_shape": 16}, lambda: {"inp": _x(6, 16)}),
    "GroupedLinear": (
        lambda: te.GroupedLinear(2, 16, 8),
        {"num_gemms": 2, "in_features": 16, "out_features": 8},
        lambda: {"inp": _x(6, 16), "m_splits": [2, 4]},
    ),
    "GroupedMLP": (
        lambda: te.GroupedMLP(2, 16, 16),
        {"num_experts": 2, "hidden_size": 16, "ffn_hidden_size": 16},
        lambda: {"inp": _x(6, 16), "m_splits": [2, 4]},
    ),
    "Fp8Padding": (
        lambda: te.Fp8Padding(2),
        {"num_gemms": 2},
        lambda: {"inp": _x(6, 16), "m_splits": [2, 4]},
    ),
    "Fp8Unpadding": (
        lambda: te.Fp8Unpadding(2),
        {"num_gemms": 2},
        lambda: {"inp": _x(32, 16), "m_splits": [2, 4]},
    ),
    "DotProductAttention": (
        lambda: te.DotProductAttention(2, 8),
        {"num_attention_heads": 2, "kv_channels": 8},
        _qkv,
    ),
    "MultiheadAttention": (
        lambda: te.MultiheadAttention(16, 2),
        {"hidden_size": 16, "num_attention_heads": 2},
        lambda: {"hidden_states": _x(4, 2, 16)},
    ),
    "TransformerLayer": (
        lambda: te.TransformerLayer(16, 32, 2),
        {"hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2},
        lambda: {"hidden_states": _x(4, 2, 16)},
    ),
    "RotaryPositionEmbedding": (
        lambda: te.RotaryPositionEmbedding(8),
        {"dim": 8},
        lambda: {"max_seq_len": 4},
    ),
    "convert.CausalLM": (
        lambda: te.convert.CausalLM(8, 16, 16, 1, 2, 2, 8),
        {
            "vocab_size": 8,
            "hidden_size": 16,
            "ffn_hidden_size": 16,
            "num_layers": 1,
            "num_attention_heads": 2,
            "num_gqa_groups": 2,
            "kv_channels": 8,
        },
        lambda: {
            "input_ids": torch.randint(0, 8, (2, 4)),
            "attention_mask": torch.ones(2, 4, dtype=torch.long),
            "position_ids": torch.arange(4).expand(2, 4),
            "labels": torch.randint(0, 8, (2, 4)),
        },
    ),
}

_FUNCTIONS: dict[str, tuple[Callable, Callable[[], dict[str, Any]]]] = {
    "te.autocast": (te.autocast, dict),
    "te.fp8_autocast": (te.fp8_autocast, dict),
    "te.checkpoint": (te.checkpoint, lambda: {"function": torch.sin}),
    "te.quantize": (
        te.quantize,
        lambda: {"tensor": _x(6, 16), "recipe": R.DelayedScaling(), "scale": torch.ones(())},
    ),
    "te.dequantize": (
        te.dequantize,
        lambda: {"q": te.quantize(_x(6, 16), R.Float8CurrentScaling())},
    ),
    "te.bulk_allocate": (te.bulk_allocate, lambda: {"shapes": [(2, 3)], "dtypes": [torch.float32]}),
    "te.set_eager_fast_path": (te.set_eager_fast_path, lambda: {"enabled": True}),
    "te.set_static_launch": (te.set_static_launch, lambda: {"enabled": True}),
    "te.quantized_model_init": (te.quantized_model_init, dict),
    "te.fp8_model_init": (te.fp8_model_init, dict),
    "te.FP8MasterWeights": (te.FP8MasterWeights, lambda: {"model": _primary_model()}),
    # Its argument checks run before the CUDA check (a CPU call of valid arguments raises
    # RuntimeError; the walker calls it with one bad argument only).
    "te.make_graphed_callables": (
        te.make_graphed_callables,
        lambda: {"modules": te.Linear(16, 16), "sample_args": (_x(6, 16),)},
    ),
    "te.is_bf16_available": (te.is_bf16_available, dict),
    "te.is_fp8_available": (te.is_fp8_available, dict),
    "te.is_fp8_block_scaling_available": (te.is_fp8_block_scaling_available, dict),
    "te.is_mxfp8_available": (te.is_mxfp8_available, dict),
    "te.is_nvfp4_available": (te.is_nvfp4_available, dict),
    "te.non_finite_amaxes": (te.non_finite_amaxes, lambda: {"model": te.Linear(16, 16)}),
    "te.apply_rotary_pos_emb": (
        te.apply_rotary_pos_emb,
        lambda: {
            "t": _x(4, 2, 2, 8),
            "freqs": te.RotaryPositionEmbedding(8)(4),
            "cu_seqlens": None,
        },
    ),
    "te.interleave_glu_tensor": (
        te.interleave_glu_tensor,
        lambda: {"tensor": _x(16, 4), "interleave_size": 4},
    ),
    "te.deinterleave_glu_tensor": (
        te.deinterleave_glu_tensor,
        lambda: {"tensor": _x(16, 4), "interleave_size": 4},
    ),
    "te.moe_permute": (
        te.moe_permute,
        lambda: {"inp": _x(6, 16), "routing_map": _routing(), "num_out_tokens": 9},
    ),
    "te.moe_permute_with_probs": (
        te.moe_permute_with_probs,
        lambda: {
            "inp": _x(6, 16),
            "probs": torch.rand(6, 2),
            "routing_map": _routing(),
            "num_out_tokens": 9,
        },
    ),
    "te.moe_unpermute": (
        te.moe_unpermute,
        lambda: dict(
            zip(
                ("inp", "row_id_map"),
                te.moe_permute(_x(6, 16), _routing(), num_out_tokens=9),
                strict=True,
            ),
            merging_probs=torch.rand(6, 2),
        ),
    ),
    "te.moe_sort_chunks_by_index": (
        te.moe_sort_chunks_by_index,
        lambda: {
            "inp": _x(6, 16),
            "split_sizes": torch.tensor([2, 4]),
            "sorted_index": torch.tensor([1, 0]),
        },
    ),
    "te.moe_sort_chunks_by_index_with_probs": (
        te.moe_sort_chunks_by_index_with_probs,
        lambda: {
            "inp": _x(6, 16),
            "probs": torch.rand(6),
            "split_sizes": torch.tensor([2, 4]),
            "sorted_index": torch.tensor([1, 0]),
        },
    ),
    # te.distributed: group=None (no communication) checks the arguments all the same.
    **{
        f"te.distributed.{n}": (
            getattr(D, n),
            lambda: {"x": _x(6, 16), "group": None, "dim": 0},
        )
        for n in ("all_gather", "reduce_scatter", "scatter")
    },
    **{
        f"te.distributed.{n}": (getattr(D, n), lambda: {"x": _x(6, 16), "group": None})
        for n in ("all_reduce", "all_reduce_grad", "all_reduce_max")
    },
    "te.distributed.resolve_group": (D.resolve_group, lambda: {"group": None}),
    "te.distributed.vocab_parallel_cross_entropy": (
        D.vocab_parallel_cross_entropy,
        lambda: {"logits": _x(6, 16), "target": torch.randint(0, 16, (6,))},
    ),
    "te.distributed.TensorParallel": (D.TensorParallel, dict),
    "te.distributed.set_parallel_attributes": (
        D.set_parallel_attributes,
        lambda: {"param": torch.nn.Parameter(_x(4, 4)), "partition_dim": 0},
    ),
    "te.distributed.shard_tensor": (
        D.shard_tensor,
        lambda: {"full": _x(8, 4), "partition_dim": 0, "stride": 1, "rank": 0, "size": 2},
    ),
    "te.distributed.unshard_tensor": (
        D.unshard_tensor,
        lambda: {"pieces": [_x(4, 4), _x(4, 4)], "partition_dim": 0, "stride": 1},
    ),
    "te.distributed.shard_state_dict": (
        D.shard_state_dict,
        lambda: {"module": te.Linear(16, 16), "full_state_dict": te.Linear(16, 16).state_dict()},
    ),
    "te.distributed.gather_state_dict": (
        D.gather_state_dict,
        lambda: {"module": te.Linear(16, 16)},
    ),
    "te.distributed.gather_optimizer_state_dict": (
        D.gather_optimizer_state_dict,
        lambda: {"module": te.Linear(16, 16), "optim_state_dict": _optim_state()},
    ),
    "te.distributed.shard_optimizer_state_dict": (
        D.shard_optimizer_state_dict,
        lambda: {"module": te.Linear(16, 16), "full_optim_state_dict": _optim_state()},
    ),
    "te.convert.from_hf": (te.convert.from_hf, lambda: {"model": _hf_model()}),
    "te.convert.to_hf": (
        te.convert.to_hf,
        lambda: {"model": te.convert.CausalLM(8, 16, 16, 1, 2, 2, 8)},
    ),
    "te.RopeScaling": (
        te.RopeScaling,
        lambda: {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "te.functional.as_splits_tensor": (F.as_splits_tensor, lambda: {"m_splits": [2, 4]}),
    "te.functional.bias_activation": (
        F.bias_activation,
        lambda: {"inp": _x(6, 16), "bias": _x(16), "activation": "swiglu"},
    ),
    "te.functional.blockwise_supported": (
        F.blockwise_supported,
        lambda: {
            "weight": _x(128, 128),
            "weight_block_rows": 128,
            "fwd_dtype": torch.float8_e4m3fn,
            "bwd_dtype": torch.float8_e5m2,
        },
    ),
    "te.functional.branch_rmsnorm": (
        F.branch_rmsnorm,
        lambda: {"inp": _x(6, 16), "weight": torch.ones(16)},
    ),
    **{
        f"te.functional.{n}": (getattr(F, n), lambda: {"inp": _x(6, 16)})
        for n in (
            "clamped_swiglu",
            "geglu",
            "glu",
            "qgeglu",
            "reglu",
            "sreglu",
            "swiglu",
            "gelu",
            "qgelu",
            "relu",
            "silu",
            "srelu",
            "l2normalization",
        )
    },
    "te.functional.delayed_scaling_update": (F.delayed_scaling_update, _delayed),
    "te.functional.dequantize_mxfp8": (F.dequantize_mxfp8, _mxfp8),
    "te.functional.dequantize_nvfp4": (F.dequantize_nvfp4, _nvfp4),
    "te.functional.quantize_mxfp8": (F.quantize_mxfp8, lambda: {"x": _x(32, 64)}),
    "te.functional.quantize_nvfp4": (
        F.quantize_nvfp4,
        lambda: {"x": _x(32, 64), "global_amax": torch.ones(())},
    ),
    "te.functional.dot_product_attention": (F.dot_product_attention, _qkv),
    "te.functional.dropout": (F.dropout, lambda: {"inp": _x(6, 16), "p": 0.1}),
    "te.functional.fake_quantize": (
        F.fake_quantize,
        lambda: {"inp": _x(6, 16), "spec": "current:e4m3"},
    ),
    "te.functional.grouped_linear": (
        F.grouped_linear,
        lambda: {"inp": _x(6, 16), "m_splits": [2, 4], "weight": _x(2, 8, 16), "bias": _x(2, 8)},
    ),
    "te.functional.layernorm": (
        F.layernorm,
        lambda: {"inp": _x(6, 16), "weight": torch.ones(16), "bias": torch.zeros(16)},
    ),
    "te.functional.rmsnorm": (F.rmsnorm, lambda: {"inp": _x(6, 16), "weight": torch.ones(16)}),
    "te.functional.linear": (
        F.linear,
        lambda: {"inp": _x(6, 16), "weight": _x(8, 16), "bias": _x(8)},
    ),
    "te.functional.mlp": (
        F.mlp,
        lambda: {
            "inp": _x(6, 16),
            "fc1_weight": _x(32, 16),
            "fc1_bias": _x(32),
            "fc2_weight": _x(16, 32),
            "fc2_bias": _x(16),
        },
    ),
    "te.functional.quantize_grouped_weight": (
        F.quantize_grouped_weight,
        lambda: {"weight": _x(2, 8, 16), "spec": "current:e4m3", "scale": None},
    ),
    "te.functional.quantize_weight": (
        F.quantize_weight,
        lambda: {"weight": _x(8, 16), "spec": "current:e4m3", "scale": None},
    ),
    "te.functional.rotary_frequencies": (
        F.rotary_frequencies,
        lambda: {"inv_freq": _x(4), "max_seq_len": 8},
    ),
}

_OPS: dict[str, tuple[Callable[[], Any], dict[str, Any], Callable[[], dict[str, Any]] | None]] = {
    "BasicLinear": (
        te.ops.BasicLinear,
        {"in_features": 16, "out_features": 8},
        lambda: {"input": _x(6, 16)},
    ),
    "Linear": (
        te.ops.Linear,
        {"in_features": 16, "out_features": 8},
        lambda: {"input": _x(6, 16)},
    ),
    "Bias": (te.ops.Bias, {"size": 16}, lambda: {"input": _x(6, 16)}),
    "GroupedLinear": (
        te.ops.GroupedLinear,
        {"num_groups": 2, "in_features": 16, "out_features": 8},
        None,
    ),
    "ConstantScale": (te.ops.ConstantScale, {"scale": 2.0}, None),
    "Dropout": (te.ops.Dropout, {"p": 0.1}, None),
    "L2Normalization": (te.ops.L2Normalization, {}, None),
    "LayerNorm": (te.ops.LayerNorm, {"normalized_shape": 16}, lambda: {"input": _x(6, 16)}),
    "RMSNorm": (te.ops.RMSNorm, {"normalized_shape": 16}, lambda: {"input": _x(6, 16)}),
    "Quantize": (te.ops.Quantize, {}, None),
    "Reshape": (te.ops.Reshape, {"shape": (-1, 4)}, None),
    "Sequential": (te.ops.Sequential, {}, None),
    "ClampedSwiGLU": (te.ops.ClampedSwiGLU, {}, None),
    "SiTUGLU": (te.ops.SiTUGLU, {}, None),
    "ScaledSiTUGLU": (te.ops.ScaledSiTUGLU, {}, None),
    "ScaledSReLU": (te.ops.ScaledSReLU, {}, None),
    **{
        n: (getattr(te.ops, n), {}, None)
        for n in (
            "GEGLU",
            "GLU",
            "QGEGLU",
            "ReGLU",
            "SReGLU",
            "SwiGLU",
            "ScaledSwiGLU",
            "ScaledClampedQGeGLU",
            "GELU",
            "QGELU",
            "ReLU",
            "SReLU",
            "SiLU",
            "AddExtraInput",
            "MakeExtraOutput",
        )
    },
    **{
        n: (getattr(te.ops, n), {"op_fusion_func": _fusion}, None)
        for n in (
            "register_forward_fusion",
            "register_backward_fusion",
            "register_forward_backward_fusion",
        )
    },
}

# Arguments that replace others (an older name): testing one drops the other from the call.
ALTERNATES = {
    "te.LayerNorm": {"hidden_size": ("normalized_shape",)},
    "te.RMSNorm": {"hidden_size": ("normalized_shape",)},
}

# Public callables that are not walked, and why (each must stay rare).
NOT_WALKED = {
    "te.get_device_compute_capability": "no arguments",
    "te.list_ops": "no arguments",
    "te.functional.linear_ref": "the float reference the tests compare with: plain torch.nn."
    "functional.linear, torch's own errors",
    "te.eager_fast_path_enabled": "no arguments",
    "te.static_launch_enabled": "no arguments",
    "te.functional.ACTIVATIONS": "a constant",
    "te.functional.GATED_ACTIVATIONS": "a constant",
    "te.functional.MLP_ACTIVATIONS": "a constant",
    "te.ops.FUSIONS": "a constant",
    "te.ops.BasicOperation": "an abstract base class",
    "te.ops.FusedOperation": "an abstract base class; the fuser builds fused ops",
    **{
        f"te.ops.{n}": "built by the fuser from basic ops, not by users"
        for n in (
            "BackwardActivationBias",
            "BackwardAddRMSNorm",
            "BackwardLinearAdd",
            "BackwardLinearScale",
            "ForwardLinearBiasActivation",
            "ForwardLinearBiasAdd",
            "ForwardLinearScaleAdd",
        )
    },
    "te.ops.Identity": "no arguments",
    "te.convert.CausalLMOutput": "CausalLM.forward's output record (a NamedTuple of tensors)",
    "te.ops.FusibleOperation": "an abstract base class",
    "te.ops.OperationContext": "the fuser builds it and passes it to an op's forward and "
    "backward, not users",
    "te.functional.WEIGHT_OPERAND": "a constant",
    **{
        f"te.ops.{n}": "a process group only; torch.distributed checks it"
        for n in ("AllGather", "AllReduce", "ReduceScatter")
    },
    "te.distributed.PARALLEL_MODES": "a constant",
    "te.recipe.Recipe": "an abstract base class",
    "te.recipe.Format": "an enum",
}

_RECIPES = (
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "MMParams",
    "QParams",
)


def _owners() -> dict[str, tuple[inspect.Signature, Callable[[], tuple[Callable, dict]]]]:
    """owner -> (its public signature, a maker of (callable, valid kwargs))."""
    out = {}
    for name, (make, ctor_kwargs, fwd_kwargs) in _MODULES.items():
        cls = operator.attrgetter(name)(te)
        out[f"te.{name}"] = (inspect.signature(cls), lambda c=cls, k=ctor_kwargs: (c, dict(k)))
        out[f"te.{name}.forward"] = (
            inspect.signature(cls.forward),
            lambda m=make, f=fwd_kwargs: (m(), f()),
        )
    for owner, (fn, make) in _FUNCTIONS.items():
        out[owner] = (inspect.signature(fn), lambda f=fn, m=make: (f, m()))
    for name, (cls, ctor_kwargs, fwd_kwargs) in _OPS.items():
        out[f"te.ops.{name}"] = (inspect.signature(cls), lambda c=cls, k=ctor_kwargs: (c, dict(k)))
        if fwd_kwargs is not None:
            out[f"te.ops.{name}.forward"] = (
                inspect.signature(cls.forward),
                lambda c=cls, k=ctor_kwargs, f=fwd_kwargs: (c(**k), f()),
            )
    for name in _RECIPES:
        cls = getattr(R, name)
        out[f"te.recipe.{name}"] = (inspect.signature(cls), lambda c=cls: (c, {}))
    return out


OWNERS = _owners()


def _parameters(owner):
    sig, _ = OWNERS[owner]
    return [
        p
        for n, p in sig.parameters.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _domain(owner, name):
    if owner.startswith("te.ops.") and owner.endswith(".forward"):
        return domain("te.ops.forward", name)
    return domain(owner, name)


def _takes_none(p: inspect.Parameter) -> bool:
    """Whether the signature lets ``p`` be None (a None default or ``| None`` in its hint)."""
    return p.default is None or "None" in str(p.annotation)


def _cases():
    """Every (owner, argument, bad value index); tensor variants only where the walker's valid
    call passes a tensor for the argument (an optional tensor left at None has none), None
    only where the signature does not allow it."""
    cases = []
    for owner in OWNERS:
        _, valid = OWNERS[owner][1]()
        for p in _parameters(owner):
            d = _domain(owner, p.name)
            if d is None or d.skip:
                continue
            cases += [(owner, p.name, i) for i in range(len(d.bad))]
            if isinstance(valid.get(p.name), torch.Tensor):
                cases += [
                    (owner, p.name, len(d.bad) + j)
                    for j, variant in enumerate(d.tensor_bad)
                    if not (variant is none and _takes_none(p))
                ]
    return cases


CASES = _cases()


def _case_id(case):
    owner, name, i = case
    d = _domain(owner, name)
    label = repr(d.bad[i]) if i < len(d.bad) else d.tensor_bad[i - len(d.bad)].__name__
    return f"{owner}-{name}-{label}"


def _bad_value(owner, name, i, kwargs):
    """``(bad value, the ways a message may show it)``; tensors: the message names the argument
    and the constraint (its shape or dtype in the message is not required)."""
    d = _domain(owner, name)
    if i < len(d.bad):
        value = d.bad[i]
        shown = [repr(value), str(value)] if isinstance(value, str) else [repr(value)]
        if isinstance(value, (list, tuple)):  # a sequence: the message may show the bad item
            shown += [repr(tuple(value)), *(repr(v) for v in value)]
        return value, shown if d.shows_value else [""]
    valid = kwargs[name]
    _label, value = d.tensor_bad[i - len(d.bad)](valid)
    return value, [""]


def _call(owner, name, i):
    """The walker's call of ``owner`` with argument ``name`` replaced by its ``i``-th bad value:
    ``(callable, kwargs, ways the value may show)``."""
    fn, kwargs = OWNERS[owner][1]()
    for other in ALTERNATES.get(owner, {}).get(name, ()):
        kwargs.pop(other)
    value, shown = _bad_value(owner, name, i, kwargs)
    kwargs[name] = value
    return fn, kwargs, shown


def _check_message(owner, name, message, shown):
    names = (name, *_domain(owner, name).peers)
    assert any(_names_argument(message, n) for n in names), (
        f"message does not name {name!r}: {message}"
    )
    assert any(s in message for s in shown), f"message does not show the value {shown}: {message}"


def _public_callables():
    names = set()
    for n in te.__all__:
        obj = getattr(te, n)
        if callable(obj) and not inspect.ismodule(obj):
            names.add(f"te.{n}")
    top = {id(getattr(te, n)) for n in te.__all__}
    names |= {f"te.functional.{n}" for n in F.__all__ if id(getattr(F, n)) not in top}
    names |= {f"te.ops.{n}" for n in te.ops.__all__}
    for space in ("distributed", "convert"):  # te.distributed.checkpoint is te.checkpoint
        module = getattr(te, space)
        names |= {f"te.{space}.{n}" for n in module.__all__ if id(getattr(module, n)) not in top}
    names |= {f"te.recipe.{n}" for n in R.__all__}
    return names


def test_every_public_callable_is_walked():
    walked = {o.removesuffix(".forward") for o in OWNERS}
    assert _public_callables() - walked - set(NOT_WALKED) == set()
    assert set(NOT_WALKED) & walked == set()


def test_every_argument_has_a_domain():
    missing = [
        f"{o}({p.name})" for o in OWNERS for p in _parameters(o) if _domain(o, p.name) is None
    ]
    assert missing == [], "declare these arguments' domains in tests/utils/domains.py"


def _names_argument(message, name):
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message) is not None


# Context managers: their checks run on entry.
_CONTEXTS = ("te.autocast", "te.fp8_autocast", "te.quantized_model_init", "te.fp8_model_init")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_value_is_refused_by_name(case):
    owner, name, i = case
    fn, kwargs, shown = _call(owner, name, i)
    with pytest.raises((ValueError, TypeError)) as info:
        out = fn(**kwargs)
        if owner in _CONTEXTS:
            with out:
                pass
    _check_message(owner, name, str(info.value), shown)


# Every bad input of a forward or function, again under torch.compile(fullgraph=True): the
# checks run on metadata and Python values, so dynamo raises the same message at trace time.
# Constructors, recipes and context managers run outside compiled code, and so does
# make_graphed_callables (it captures CUDA graphs at setup). `make test` compiles the bad
# tensors (the checks on metadata); --long-runs every bad value.
_NOT_TRACED = {"te.make_graphed_callables": "captures CUDA graphs at setup, outside compiled code"}


def _traced(owner: str) -> bool:
    obj = te
    for part in owner.split(".")[1:]:
        obj = getattr(obj, part)
    return inspect.isfunction(obj) and owner not in _CONTEXTS and owner not in _NOT_TRACED


def _bad_tensor(case) -> bool:
    owner, name, i = case
    domain = _domain(owner, name)
    return i >= len(domain.bad) and domain.tensor_bad[i - len(domain.bad)] is not not_tensor


COMPILED_CASES = [c for c in CASES if _traced(c[0])]


def pytest_generate_tests(metafunc):
    """The compiled walker's cases: the bad tensors, or with --long-runs every bad value (kept
    out of the default collection rather than skipped, so the summary stays short)."""
    if metafunc.function.__name__ == "test_bad_value_is_refused_by_name_at_trace_time":
        long_runs = metafunc.config.getoption("--long-runs")
        cases = [c for c in COMPILED_CASES if long_runs or _bad_tensor(c)]
        metafunc.parametrize("case", cases, ids=[_case_id(c) for c in cases])


def test_bad_value_is_refused_by_name_at_trace_time(case):
    owner, name, i = case
    fn, kwargs, shown = _call(owner, name, i)
    compiled = torch.compile(lambda kw: fn(**kw), backend="eager", fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(kwargs)
    assert not isinstance(info.value, (IndexError, KeyError, AttributeError, ImportError))
    _check_message(owner, name, str(info.value), shown)
