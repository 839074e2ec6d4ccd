"""Transformer Engine's constructor signatures (``modules._te_signature``): positional
arguments bind in TE's order, TE's arguments without a counterpart here are taken at TE's
default and refused by name otherwise."""

from __future__ import annotations

import inspect

import pytest
import torch

import te_compile as te
from te_compile.modules import _te_signature as S

SIZES = {
    "Linear": (16, 8),
    "LayerNormLinear": (16, 8),
    "LayerNormMLP": (16, 32),
    "GroupedLinear": (2, 16, 8),
    "LayerNorm": (16,),
    "RMSNorm": (16,),
    "DotProductAttention": (2, 8),
    "MultiheadAttention": (16, 2),
    "TransformerLayer": (16, 32, 2),
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_te_argument_is_a_parameter_or_handled(name):
    """Each name of TE's order is a parameter of ours or one the signature layer takes."""
    ours = set(inspect.signature(getattr(te, name).__init__).parameters)
    missing = [a for a in S.ORDERS[name] if a not in ours and a not in S.ABSENT[name]]
    assert not missing, missing
    assert not set(S.ABSENT[name]) & ours  # an argument we have is ours to check


def _param_names(m: torch.nn.Module) -> list[str]:
    return [n for n, _ in m.named_parameters()]


def test_a_positional_argument_past_ours_binds_to_te_s_parameter():
    """TE's fourth ``GroupedLinear`` argument is ``sequence_parallel`` (False here): the module
    keeps its biases; ``bias`` is TE's eleventh (tenth for ``Linear``)."""
    assert "bias0" in _param_names(te.GroupedLinear(2, 16, 8, False))
    no_bias = te.GroupedLinear(2, 16, 8, False, False, None, 1, None, None, None, False)
    assert "bias0" not in _param_names(no_bias)
    assert te.Linear(16, 8, False).bias is not None
    assert te.Linear(16, 8, False, False, None, 1, None, None, None, False).bias is None
    m = te.LayerNormMLP(16, 32, 1e-5, False, False, None, None, 1, None, True, "RMSNorm", "swiglu")
    assert m.normalization == "RMSNorm" and m.activation == "swiglu"
    m = te.LayerNormLinear(16, 8, 1e-3, False, False, None, 1, None, None, True, "RMSNorm")
    assert m.normalization == "RMSNorm" and m.eps == 1e-3
    layer = te.TransformerLayer(16, 32, 2, None, 1e-5, 0.0, 0.0, None, None, None, None, "padding")
    assert layer.self_attn_mask_type == "padding"
    with pytest.raises(NotImplementedError, match="bottom_right_diagonal=True"):
        te.DotProductAttention(2, 8, None, 0.0, "sbhd", "causal", None, True)


def test_bad_positional_use_is_named():
    with pytest.raises(TypeError, match="'sequence_parallel' twice"):
        te.Linear(16, 8, False, sequence_parallel=False)
    with pytest.raises(TypeError, match="Linear: takes at most 25 positional arguments"):
        te.Linear(*range(26))


@pytest.mark.parametrize(
    ("name", "argument", "value"),
    [
        ("Linear", "ub_overlap_ag", True),
        ("LayerNormLinear", "return_layernorm_output_gathered", True),
        ("LayerNormMLP", "set_parallel_mode", True),
        ("GroupedLinear", "return_bias", True),
        ("DotProductAttention", "cp_group", object()),
        ("DotProductAttention", "return_max_logit", True),
        ("MultiheadAttention", "ub_bulk_wgrad", True),
        ("TransformerLayer", "ub_tp_comm_overlap", True),
        ("TransformerLayer", "enc_dec_bottom_right_diagonal", False),
    ],
)
def test_te_arguments_without_a_counterpart(name, argument, value):
    """At TE's default they ask for nothing and are taken; another value is refused by name."""
    cls, sizes = getattr(te, name), SIZES[name]
    cls(*sizes, **{argument: S._DEFAULTS[argument]})
    with pytest.raises(NotImplementedError, match=f"{name}: {argument}="):
        cls(*sizes, **{argument: value})


def test_arguments_te_reads_only_with_a_missing_feature_take_any_value():
    """TE reads ``seq_length`` / ``micro_batch_size`` only for userbuffers, the ``cp_*`` details
    only with a ``cp_group``, TransformerLayer's ``ub_*`` flags only with
    ``ub_tp_comm_overlap`` (TE's defaults for some are True)."""
    te.TransformerLayer(16, 32, 2, seq_length=128, micro_batch_size=2, ub_overlap_ag=True)
    te.DotProductAttention(2, 8, cp_comm_type="a2a", cp_stream=None)
    te.LayerNormMLP(16, 32, seq_length=64)


def test_name_is_kept():
    assert te.Linear(16, 8, name="fc1").name == "fc1"
    with pytest.raises(TypeError, match="name must be a str or None"):
        te.Linear(16, 8, name=3)


def test_transformer_layer_passes_activation_params_to_its_mlp():
    layer = te.TransformerLayer(
        16, 32, 2, activation="clamped_swiglu", activation_params={"limit": 5.0}
    )
    assert layer.layernorm_mlp.activation_params["limit"] == 5.0
