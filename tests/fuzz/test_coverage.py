"""Every public module and function is fuzzed in ``tests/fuzz/`` or exempt with a reason."""

from __future__ import annotations

import importlib

import torch

import te_compile as te
from tests.fuzz.common import (
    _ACT_REF,
    _FUSION_MOTIFS,
    _GLU_REF,
    _OPS_ACT,
    _OPS_GLU,
    _OPS_SCALED,
    _build_chain,
)

_OPS_CHAIN = "test_ops_sequential"


FUZZED = {
    "te.DotProductAttention": "test_dot_product_attention",
    "te.Fp8Padding": "test_fp8_padding",
    "te.Fp8Unpadding": "test_fp8_padding",
    "te.GroupedLinear": "test_grouped_linear",
    "te.GroupedMLP": "test_grouped_mlp",
    "te.LayerNorm": "test_norms",
    "te.LayerNormLinear": "test_layernorm_linear",
    "te.LayerNormMLP": "test_layernorm_mlp",
    "te.Linear": "test_linear",
    "te.MultiheadAttention": "test_multihead_attention",
    "te.RMSNorm": "test_norms",
    "te.RotaryPositionEmbedding": "test_rotary",
    "te.TransformerLayer": "test_transformer_layer",
    "te.apply_rotary_pos_emb": "test_rotary",
    "te.autocast": "test_linear",  # every module test's recipe cases run inside it
    "te.checkpoint": "test_layernorm_mlp",
    "te.deinterleave_glu_tensor": "test_glu_interleave",
    "te.interleave_glu_tensor": "test_glu_interleave",
    "te.quantize": "test_quantize_roundtrip",
    "te.dequantize": "test_quantize_roundtrip",
    "te.moe_permute": "test_moe_permute_unpermute",
    "te.moe_permute_with_probs": "test_moe_permute_unpermute",
    "te.moe_unpermute": "test_moe_permute_unpermute",
    "te.moe_sort_chunks_by_index": "test_moe_sort_chunks",
    "te.moe_sort_chunks_by_index_with_probs": "test_moe_sort_chunks",
    "te.functional.as_splits_tensor": "test_functional_grouped_linear",
    "te.functional.bias_activation": "test_activations",
    "te.functional.branch_rmsnorm": "test_norms",
    "te.functional.clamped_swiglu": "test_activations",
    "te.functional.delayed_scaling_update": "test_delayed_scaling_update",
    "te.functional.dequantize_mxfp8": "test_quantize_roundtrip",
    "te.functional.dequantize_nvfp4": "test_quantize_roundtrip",
    "te.functional.dot_product_attention": "test_dot_product_attention",
    "te.functional.dropout": "test_dropout",
    "te.functional.fake_quantize": "test_quantize_roundtrip",
    **{f"te.functional.{n}": "test_activations" for n in [*_ACT_REF, *_GLU_REF]},
    "te.functional.grouped_linear": "test_functional_grouped_linear",
    "te.functional.l2normalization": "test_norms",
    "te.functional.layernorm": "test_norms",
    "te.functional.linear": "test_functional_linear",
    "te.functional.mlp": "test_functional_mlp",
    "te.functional.quantize_mxfp8": "test_quantize_roundtrip",
    "te.functional.quantize_nvfp4": "test_quantize_roundtrip",
    "te.functional.rmsnorm": "test_norms",
    "te.functional.rotary_frequencies": "test_rotary",  # RotaryPositionEmbedding's forward
    **{
        f"te.ops.{n}": _OPS_CHAIN
        for n in [
            "BasicLinear",
            "Linear",
            "Bias",
            *_OPS_ACT,
            *_OPS_GLU,
            *_OPS_SCALED,
            "LayerNorm",
            "RMSNorm",
            "L2Normalization",
            "ConstantScale",
            "Identity",
            "Reshape",
            "AddExtraInput",
            "MakeExtraOutput",
            "GroupedLinear",
            "Sequential",
            "ForwardLinearBiasActivation",
            "ForwardLinearBiasAdd",
            "ForwardLinearScaleAdd",
            "BackwardLinearAdd",
            "BackwardLinearScale",
            "BackwardActivationBias",
            "BackwardAddRMSNorm",
        ]
    },
    "te.ops.Dropout": "test_dropout",
    "te.ops.Quantize": "test_ops_quantize",
}


_TEST_MODULES = [
    f"tests.fuzz.test_{n}" for n in ("modules", "ops", "functions", "rotary_moe", "quantization")
]
_UTILITY = "no numeric output to compare with a reference"


EXEMPT = {
    "te.fp8_autocast": "TE's older name of te.autocast (the same context manager)",
    "te.quantized_model_init": "context manager of FP8 primary weights, an optimizer-side "
    "state machine (tests/modules/test_fp8_primary_weights.py)",
    "te.fp8_model_init": "TE's older name of te.quantized_model_init",
    "te.FP8MasterWeights": "optimizer-side holder of the FP8 primary weights' masters "
    "(tests/modules/test_fp8_primary_weights.py)",
    "te.make_graphed_callables": "CUDA graph capture: needs a GPU "
    "(tests/quantization/test_graph.py)",
    "te.non_finite_amaxes": "a diagnostic over the FP8 state (tests/test_long_run.py, "
    "tests/modules/test_fp8_linear_module.py)",
    "te.RopeScaling": "a frozen record of RotaryPositionEmbedding's frequency rule, checked "
    "when built; the rule is tested against a float64 per-frequency loop "
    "(tests/functional/test_rotary.py)",
    "te.bulk_allocate": "allocation: " + _UTILITY,
    "te.list_ops": "the op registry: " + _UTILITY,
    "te.set_eager_fast_path": "a switch: " + _UTILITY,
    "te.eager_fast_path_enabled": "a switch: " + _UTILITY,
    "te.set_static_launch": "a switch: tests/test_static_launch.py",
    "te.static_launch_enabled": "a switch: tests/test_static_launch.py",
    "te.get_device_compute_capability": "a device query: " + _UTILITY,
    **{
        f"te.{n}": "a device query: " + _UTILITY
        for n in [
            "is_bf16_available",
            "is_fp8_available",
            "is_fp8_block_scaling_available",
            "is_mxfp8_available",
            "is_nvfp4_available",
        ]
    },
    "te.functional.blockwise_supported": "a predicate on shapes: " + _UTILITY,
    "te.functional.linear_ref": "the reference math of te.functional.linear (registry-checked)",
    "te.functional.quantize_weight": "the GEMM family's private operand layout (five tensors) "
    "for kept FP8 weights; its values reach the GEMMs fuzzed above",
    "te.functional.quantize_grouped_weight": "the grouped GEMM's operand layout for kept FP8 "
    "weights; bit-equal to the per-call cast in tests/modules/test_fp8_weight_cache.py",
    **{
        f"te.ops.{n}": "process-group collective: tests/distributed (the identity without a group)"
        for n in ["AllGather", "AllReduce", "ReduceScatter"]
    },
    **{
        f"te.ops.{n}": "base class of user ops: " + _UTILITY
        for n in ["BasicOperation", "FusedOperation", "FusibleOperation", "OperationContext"]
    },
    **{
        f"te.ops.{n}": "fusion registration: " + _UTILITY
        for n in [
            "register_forward_fusion",
            "register_backward_fusion",
            "register_forward_backward_fusion",
        ]
    },
}


def _public_callables():
    """The public modules, functions and classes: ``te.__all__`` (subpackages and constants
    aside), ``te.functional.__all__`` (less the top level's), ``te.ops.__all__``."""
    import inspect

    names = {f"te.{n}" for n in te.__all__
             if callable(getattr(te, n)) and not inspect.ismodule(getattr(te, n))}  # fmt: skip
    top = {id(getattr(te, n)) for n in te.__all__}
    F = te.functional
    names |= {f"te.functional.{n}" for n in F.__all__
              if callable(getattr(F, n)) and id(getattr(F, n)) not in top}  # fmt: skip
    names |= {f"te.ops.{n}" for n in te.ops.__all__ if callable(getattr(te.ops, n))}
    return names


def test_every_public_callable_is_fuzzed():
    """A new public module or function fails here until it has a fuzz test (``FUZZED``) or a
    reason not to (``EXEMPT``); every named test exists, and the motifs of the op chains do
    select the fused ops they stand for."""
    public = _public_callables()
    assert public - set(FUZZED) - set(EXEMPT) == set(), "fuzz these, or exempt them with a reason"
    assert set(FUZZED) & set(EXEMPT) == set()
    assert set(FUZZED) | set(EXEMPT) <= public, "stale names"
    tests = {
        n for m in _TEST_MODULES for n in vars(importlib.import_module(m)) if n.startswith("test_")
    }
    assert set(FUZZED.values()) <= tests, "FUZZED names a test that does not exist"
    fused = set()
    for motif in _FUSION_MOTIFS:
        steps = [(k.rstrip("?").replace("act", "GELU"), {"features": 4, "bias": True,
                  "zc": False, "interleave": None, "scale": 2.0, "groups": 1, "flat": True})
                 for k in motif]  # fmt: skip
        ops = _build_chain(steps, 4, [4], torch.float32, None)[0]
        fused |= {name for name, _ in te.ops.Sequential(*ops).fusions()}
    assert fused == {
        n.removeprefix("te.ops.")
        for n, t in FUZZED.items()
        if t == _OPS_CHAIN and n.startswith(("te.ops.Forward", "te.ops.Backward"))
    }
