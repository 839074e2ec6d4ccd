"""Edge values under every recipe and every module (CPU; the FP8 recipes emulated):

* all-zero input and weights: finite outputs and gradients (no NaN from a zero amax);
* an ``inf`` or a NaN in the input: it reaches the output, or ``te.non_finite_amaxes`` reports
  it (per-tensor recipes keep finite scales and say so) - never silently clipped to a finite
  value with nothing reported;
* a single token, zero tokens and an odd hidden size (67): the module works (finite output of
  the right shape, finite gradients) or refuses the shape with a ValueError /
  NotImplementedError naming it - never an internal error.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import te_compile as te
from te_compile import recipe as R

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


# name -> (build(hidden), call(module, x)); x is [tokens, hidden] (TransformerLayer: [s, 1, h]).
MODULES = {
    "Linear": (lambda h: te.Linear(h, h), lambda m, x: m(x)),
    "LayerNormLinear": (lambda h: te.LayerNormLinear(h, h), lambda m, x: m(x)),
    "LayerNormMLP": (lambda h: te.LayerNormMLP(h, 2 * h), lambda m, x: m(x)),
    "GroupedLinear": (lambda h: te.GroupedLinear(2, h, h), lambda m, x: m(x, [x.shape[0], 0])),
    "GroupedMLP": (
        lambda h: te.GroupedMLP(2, h, h, activation="gelu", bias=True),
        lambda m, x: m(x, [x.shape[0], 0]),
    ),
    "LayerNorm": (lambda h: te.LayerNorm(h), lambda m, x: m(x)),
    "RMSNorm": (lambda h: te.RMSNorm(h), lambda m, x: m(x)),
    "TransformerLayer": (
        lambda h: te.TransformerLayer(h, 2 * h, 1, hidden_dropout=0.0, attention_dropout=0.0),
        lambda m, x: m(x[:, None]).squeeze(1),
    ),
    "ops.Sequential": (
        lambda h: te.ops.Sequential(te.ops.BasicLinear(h, h), te.ops.Bias(h), te.ops.GELU()),
        lambda m, x: m(x),
    ),
}
CASES = [(m, r) for m in MODULES for r in RECIPES]
IDS = [f"{m}-{r}" for m, r in CASES]


# The grouped GEMM does not implement NVFP4's Hadamard transform and stochastic rounding (it
# refuses them with NotImplementedError): the grouped modules run NVFP4 without them.
GROUPED_NVFP4 = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)


def _autocast(recipe, module_name=""):
    r = RECIPES[recipe]
    if recipe == "nvfp4" and module_name.startswith("Grouped"):
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


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
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
@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_non_finite_input_propagates_or_is_reported(module_name, recipe, value):
    x = torch.randn(32, HIDDEN[recipe])
    x[3, 5] = value
    module, _, y = _run(module_name, recipe, x)
    reported = te.non_finite_amaxes(module)
    assert not y.isfinite().all() or reported, (
        f"{module_name} under {recipe}: a {value} in the input vanished from the output and "
        "non_finite_amaxes reports nothing"
    )


def _works_or_refused(module_name, recipe, tokens, hidden):
    """Runs forward and backward; a refusal must be a ValueError / NotImplementedError."""
    try:
        module, x, y = _run(module_name, recipe, torch.randn(tokens, hidden))
    except (ValueError, NotImplementedError) as error:
        assert str(error), "a refusal says why"
        return
    assert y.shape[0] == tokens and y.isfinite().all()
    y.float().sum().backward()
    assert _finite_grads(module, x)


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_single_token(module_name, recipe):
    _works_or_refused(module_name, recipe, 1, HIDDEN[recipe])


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_zero_tokens(module_name, recipe):
    _works_or_refused(module_name, recipe, 0, HIDDEN[recipe])


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_odd_hidden_size(module_name, recipe):
    _works_or_refused(module_name, recipe, 32, 67)
