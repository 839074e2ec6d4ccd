"""Every module constructor refuses a truthy non-bool for a switch and a NaN or inf for a float,
by name: walked from the signatures, so a new argument cannot skip it."""

from __future__ import annotations

import pytest

import te_compile as te
from tests.utils import bad_scalar_arguments

CONSTRUCTORS = {
    "Linear": (te.Linear, {"in_features": 16, "out_features": 16}),
    "LayerNormLinear": (te.LayerNormLinear, {"in_features": 16, "out_features": 16}),
    "LayerNormMLP": (te.LayerNormMLP, {"hidden_size": 16, "ffn_hidden_size": 32}),
    "LayerNorm": (te.LayerNorm, {"hidden_size": 16}),
    "RMSNorm": (te.RMSNorm, {"hidden_size": 16}),
    "GroupedLinear": (te.GroupedLinear, {"num_gemms": 2, "in_features": 16, "out_features": 16}),
    "GroupedMLP": (te.GroupedMLP, {"num_experts": 2, "hidden_size": 16, "ffn_hidden_size": 16}),
    "Fp8Padding": (te.Fp8Padding, {"num_gemms": 2}),
    "Fp8Unpadding": (te.Fp8Unpadding, {"num_gemms": 2}),
    "DotProductAttention": (te.DotProductAttention, {"num_attention_heads": 2, "kv_channels": 8}),
    "RotaryPositionEmbedding": (te.RotaryPositionEmbedding, {"dim": 8}),
    "RopeScaling": (
        te.RopeScaling,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "MultiheadAttention": (te.MultiheadAttention, {"hidden_size": 16, "num_attention_heads": 2}),
    "TransformerLayer": (
        te.TransformerLayer,
        {"hidden_size": 16, "ffn_hidden_size": 32, "num_attention_heads": 2},
    ),
}
CASES = [
    (name, arg, value)
    for name, (cls, given) in CONSTRUCTORS.items()
    for arg, value in bad_scalar_arguments(cls.__init__, given)
]


def test_every_module_is_walked():
    modules = {n for n in te.modules.__all__ if isinstance(getattr(te, n, None), type)}
    assert modules == set(CONSTRUCTORS)


@pytest.mark.parametrize(("name", "arg", "value"), CASES, ids=[f"{n}-{a}-{v}" for n, a, v in CASES])
def test_bad_switch_or_float_names_the_argument(name, arg, value):
    cls, given = CONSTRUCTORS[name]
    with pytest.raises(ValueError, match=rf"^{name}: {arg} must be a ") as info:
        cls(**given, **{arg: value})
    assert f"got {value!r}" in str(info.value)
