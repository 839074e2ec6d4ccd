"""Edge values under every recipe and every module (CPU; the FP8 recipes emulated):

* all-zero input and weights: finite outputs and gradients (no NaN from a zero amax);
* an ``inf`` or a NaN in the input: it reaches the output, or ``te.non_finite_amaxes`` reports
  it (per-tensor recipes keep finite scales and say so) - never silently clipped to a finite
  value with nothing reported;
* a single token, zero tokens and an odd hidden size (67): the module works - its output and
  gradients match the float64 run of the same module and weights (exactly as far as fp32 goes
  in high precision, within the recipe's quantisation error under FP8) - or refuses the shape
  with the ValueError :func:`_refusal` expects, naming the sizes and the multiple they miss;
  the grouped modules get one empty group among three (all three with zero tokens).
"""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

import te_compile as te
from te_compile import recipe as R
from tests.utils import assert_close, assert_close_quantized

RECIPES = {
    "none": None,
    "current": R.Float8CurrentScaling(),
    "delayed": R.DelayedScaling(amax_history_len=4),
    "block": R.Float8BlockScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
    "nvfp4": R.NVFP4BlockScaling(),
}
# The smallest hidden size each recipe's blocks fit (1x128 / 128x128 FP8 blocks, 32-element
# MXFP8, 16-element NVFP4 with 32 tokens).
HIDDEN = {"none": 32, "current": 32, "delayed": 32, "block": 128, "mxfp8": 32, "nvfp4": 32}


def _splits(x):
    """Three groups, the middle one empty (all empty for zero tokens)."""
    n = x.shape[0]
    return [n // 2, 0, n - n // 2]


class PaddedGroupedLinear(torch.nn.Module):
    """``Fp8Padding`` -> ``GroupedLinear`` -> ``Fp8Unpadding``, the MoE pattern: each group's
    rows padded to the recipe's alignment for the grouped GEMM, the padding dropped after."""

    def __init__(self, hidden):
        super().__init__()
        self.pad, self.unpad = te.Fp8Padding(3), te.Fp8Unpadding(3)
        self.linear = te.GroupedLinear(3, hidden, hidden)

    def forward(self, x, splits):
        padded, padded_splits = self.pad(x, splits)
        return self.unpad(self.linear(padded, padded_splits), splits)


def _qkv(x):
    """``[tokens, hidden]`` as one head of ``[s, b=1, heads=1, hidden]`` query, key and value."""
    return x[:, None, None], x[:, None, None], x[:, None, None]


# name -> (build(hidden), call(module, x)); x is [tokens, hidden] (attention: [s, 1, h], causal).
MODULES = {
    "Linear": (lambda h: te.Linear(h, h), lambda m, x: m(x)),
    "LayerNormLinear": (lambda h: te.LayerNormLinear(h, h), lambda m, x: m(x)),
    "LayerNormMLP": (lambda h: te.LayerNormMLP(h, 2 * h), lambda m, x: m(x)),
    "GroupedLinear": (lambda h: te.GroupedLinear(3, h, h), lambda m, x: m(x, _splits(x))),
    "GroupedMLP": (
        lambda h: te.GroupedMLP(3, h, h, activation="gelu", bias=True),
        lambda m, x: m(x, _splits(x)),
    ),
    "Fp8Padding": (PaddedGroupedLinear, lambda m, x: m(x, _splits(x))),
    "LayerNorm": (lambda h: te.LayerNorm(h), lambda m, x: m(x)),
    "RMSNorm": (lambda h: te.RMSNorm(h), lambda m, x: m(x)),
    "TransformerLayer": (
        lambda h: te.TransformerLayer(h, 2 * h, 1, hidden_dropout=0.0, attention_dropout=0.0),
        lambda m, x: m(x[:, None]).squeeze(1),
    ),
    "MultiheadAttention": (
        lambda h: te.MultiheadAttention(h, 1, attention_dropout=0.0),
        lambda m, x: m(x[:, None]).squeeze(1),
    ),
    "DotProductAttention": (
        lambda h: te.DotProductAttention(1, h, attention_dropout=0.0, attn_mask_type="causal"),
        lambda m, x: m(*_qkv(x)).squeeze(1),
    ),
    "ops.Sequential": (
        lambda h: te.ops.Sequential(
            te.ops.LayerNorm(h), te.ops.BasicLinear(h, h), te.ops.Bias(h), te.ops.GELU()
        ),
        lambda m, x: m(x),
    ),
}
# Quantised GEMMs a result passes through (the bound of assert_close_quantized); 0: none, the
# module runs in high precision under every recipe (DotProductAttention: only "none" is run).
GEMMS = {
    "Linear": 1,
    "LayerNormLinear": 1,
    "LayerNormMLP": 2,
    "GroupedLinear": 1,
    "GroupedMLP": 2,
    "Fp8Padding": 1,
    "LayerNorm": 0,
    "RMSNorm": 0,
    "TransformerLayer": 4,
    "MultiheadAttention": 2,
    "DotProductAttention": 0,
    "ops.Sequential": 1,
}
GROUPED = ("GroupedLinear", "GroupedMLP", "Fp8Padding")
COMPOSED = ("MultiheadAttention", "DotProductAttention", "Fp8Padding")
CASES = [(m, r) for m in MODULES for r in RECIPES if m != "DotProductAttention" or r == "none"]
IDS = [f"{m}-{r}" for m, r in CASES]
# The edge values: the modules whose parts the others are made of (MultiheadAttention and
# DotProductAttention run inside TransformerLayer, Fp8Padding around GroupedLinear's GEMM), to
# keep the test's time small; the edge shapes run every module.
VALUE_CASES = [(m, r) for m, r in CASES if m not in COMPOSED]
VALUE_IDS = [f"{m}-{r}" for m, r in VALUE_CASES]


# The grouped GEMM does not implement NVFP4's Hadamard transform and stochastic rounding (it
# refuses them with NotImplementedError): the grouped modules run NVFP4 without them.
GROUPED_NVFP4 = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)


def _autocast(recipe, module_name=""):
    r = RECIPES[recipe]
    if recipe == "nvfp4" and module_name in GROUPED:
        r = GROUPED_NVFP4
    return te.autocast(recipe=r) if r else contextlib.nullcontext()


def _run(module_name, recipe, x, module=None):
    build, call = MODULES[module_name]
    module = module if module is not None else build(x.shape[-1])
    x = x.detach().requires_grad_()
    with _autocast(recipe, module_name):
        y = call(module, x)
    return module, x, y


def _finite_grads(module, x):
    grads = [x.grad] + [p.grad for p in module.parameters() if p.grad is not None]
    return all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize(("module_name", "recipe"), VALUE_CASES, ids=VALUE_IDS)
def test_zero_input_and_weights_give_finite_outputs_and_gradients(module_name, recipe):
    build, _ = MODULES[module_name]
    module = build(HIDDEN[recipe])
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    module, x, y = _run(module_name, recipe, torch.zeros(32, HIDDEN[recipe]), module)
    assert y.isfinite().all()
    y.float().sum().backward()
    assert x.grad is not None and _finite_grads(module, x)


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize(("module_name", "recipe"), VALUE_CASES, ids=VALUE_IDS)
def test_non_finite_input_propagates_or_is_reported(module_name, recipe, value):
    x = torch.randn(32, HIDDEN[recipe])
    x[3, 5] = value
    module, _, y = _run(module_name, recipe, x)
    reported = te.non_finite_amaxes(module)
    assert not y.isfinite().all() or reported, (
        f"{module_name} under {recipe}: a {value} in the input vanished from the output and "
        "non_finite_amaxes reports nothing"
    )


def _refusal(module_name, recipe, tokens, hidden):
    """The message (a regex) with which the module must refuse this shape, or None where it
    must work. FP8 GEMMs need their feature dims to be multiples of 16 (MXFP8: 32); the
    non-grouped MXFP8 and NVFP4 GEMMs also need the tokens in whole blocks (the grouped ones
    pad each group)."""
    if recipe == "none" or not GEMMS[module_name]:
        return None
    if hidden % 16:
        return rf"\({hidden}\).* multiples? of (its block \()?(16|32)"
    if recipe in ("mxfp8", "nvfp4") and tokens % 32 and module_name not in GROUPED:
        return rf"number of tokens \({tokens}\).* multiples? of (its block \()?(16|32)"
    return None


def _works_or_refused(module_name, recipe, tokens, hidden):
    """Forward and backward at an edge shape, against the float64 run of the same module (a
    copy, same weights, no autocast); or the refusal :func:`_refusal` expects."""
    build, call = MODULES[module_name]
    module = build(hidden)
    reference = copy.deepcopy(module).double()
    expected = _refusal(module_name, recipe, tokens, hidden)
    x = torch.randn(tokens, hidden)
    if expected is not None:
        with pytest.raises(ValueError, match=expected):
            _run(module_name, recipe, x, module)
        return
    module, x, y = _run(module_name, recipe, x, module)
    x64 = x.detach().double().requires_grad_()
    y64 = call(reference, x64)
    assert y.shape == y64.shape and y.shape[0] == tokens
    grad = torch.randn_like(y64)
    y.backward(grad.float())
    y64.backward(grad)
    pairs = [("input", x.grad, x64.grad)] + [
        (name, p.grad, q.grad)
        for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True)
    ]
    for name, actual, ref in pairs:
        assert (actual is None) == (ref is None), name
        if actual is None:
            continue
        if recipe == "none" or not GEMMS[module_name]:
            assert_close(actual, ref, torch.float32, roundings=8, reduced=True, msg=name)
        else:
            assert_close_quantized(actual, ref, recipe, gemms=GEMMS[module_name])
    if recipe == "none" or not GEMMS[module_name]:
        assert_close(y, y64, torch.float32, roundings=8, reduced=True)
    else:
        assert_close_quantized(y, y64, recipe, gemms=GEMMS[module_name])


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_single_token(module_name, recipe):
    _works_or_refused(module_name, recipe, 1, HIDDEN[recipe])


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_zero_tokens(module_name, recipe):
    _works_or_refused(module_name, recipe, 0, HIDDEN[recipe])


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_odd_hidden_size(module_name, recipe):
    _works_or_refused(module_name, recipe, 32, 67)
