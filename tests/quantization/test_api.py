"""te_compile.quantize / dequantize: a tensor quantised the way a recipe quantises each operand."""

from __future__ import annotations

import math

import pytest
import torch

import te_compile as te
from tests.utils import compile_counted

# Relative RMS error of a Gaussian tensor after a quantise/dequantise round trip, per element
# format: E4M3 (3 mantissa bits) ~2.7%, E5M2 ~5.3%, NVFP4 (1 mantissa bit) ~9.5%; with margin.
MAX_REL_RMS = {"e4m3": 0.035, "e5m2": 0.07, "nvfp4": 0.12}

CASES = [
    (te.recipe.Float8CurrentScaling(), "input", "current", "e4m3", 1),
    (te.recipe.Float8CurrentScaling(), "grad", "current", "e5m2", 1),
    (te.recipe.Float8BlockScaling(), "input", "block", "e4m3", 1),
    (te.recipe.Float8BlockScaling(), "weight", "block", "e4m3", 128),
    (te.recipe.MXFP8BlockScaling(), "grad", "mxfp8", "e4m3", 1),
    (te.recipe.NVFP4BlockScaling(), "weight", "nvfp4", "nvfp4", 16),
    (te.recipe.NVFP4BlockScaling(disable_2d_quantization=True), "weight", "nvfp4", "nvfp4", 1),
]


def _rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("recipe, role, kind, fmt, block_rows", CASES)
def test_recipe_and_role_pick_the_quantiser(recipe, role, kind, fmt, block_rows):
    torch.manual_seed(0)
    x = torch.randn(256, 160)
    q = te.quantize(x, recipe, role=role, columnwise=True)
    assert (q.kind, q.block_rows) == (kind, block_rows)
    if fmt != "nvfp4":
        assert q.data.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    assert _rel_rms(te.dequantize(q, torch.float32), x) < MAX_REL_RMS[fmt]
    # The columnwise copy is the transposed tensor, quantised on its own (blocks along M).
    assert _rel_rms(te.dequantize(q, torch.float32, columnwise=True), x.t()) < MAX_REL_RMS[fmt]


def test_delayed_scaling_uses_the_given_scale_and_saturates():
    x = torch.tensor([[1.0, -2.0, 1000.0, 0.5]])
    q = te.quantize(x, te.recipe.DelayedScaling(), scale=torch.tensor([2.0]))
    assert q.amax.item() == 1000.0
    assert te.dequantize(q, torch.float32).tolist() == [[1.0, -2.0, 224.0, 0.5]]


def test_all_zero_tensor_round_trips_without_nan():
    for recipe in (te.recipe.Float8CurrentScaling(), te.recipe.Float8BlockScaling(),
                   te.recipe.MXFP8BlockScaling(), te.recipe.NVFP4BlockScaling()):  # fmt: skip
        out = te.dequantize(te.quantize(torch.zeros(32, 64), recipe), torch.float32)
        assert torch.equal(out, torch.zeros(32, 64)), type(recipe).__name__


def test_compiles_without_graph_breaks():
    recipe = te.recipe.Float8BlockScaling()

    def fn(x):
        return te.dequantize(te.quantize(x, recipe, role="weight"), torch.float32)

    compiled, counter = compile_counted(fn)
    x = torch.randn(128, 256)
    assert torch.equal(compiled(x), fn(x))
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"role": "bias"}, "role must be one of"),
        ({"recipe": "delayed"}, "recipe must be a te_compile.recipe recipe"),
        ({"recipe": te.recipe.DelayedScaling()}, "needs scale="),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"recipe": te.recipe.Float8CurrentScaling(), **kwargs}
    recipe = args.pop("recipe")
    with pytest.raises(ValueError, match=match):
        te.quantize(torch.randn(16, 16), recipe, **args)


def test_nvfp4_error_is_finite_for_wide_dynamic_range():
    x = torch.randn(64, 64) * torch.logspace(-3, 3, 64)  # columns over six decades
    q = te.quantize(x, te.recipe.NVFP4BlockScaling())
    out = te.dequantize(q, torch.float32)
    assert torch.isfinite(out).all() and not math.isnan(_rel_rms(out, x))
