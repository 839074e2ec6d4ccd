"""Fuzz tests of quantisation: ``te.quantize`` / ``te.dequantize`` and the functional quantisers,
``ops.Quantize``, the delayed-scaling update (``common``)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import te_compile as te
from te_compile import recipe as R
from te_compile.functional.spec import QuantSpec
from tests.fuzz.common import (
    FUZZ,
    RECIPES,
    SEED,
)
from tests.utils import assert_close

# te.quantize / ops.Quantize: without the transform and stochastic rounding, which only the
# GEMMs apply (a standalone quantiser refuses them).
QUANTIZE_NVFP4 = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)


# The largest E2M1 rounding error relative to the value (half of 0.5 at 1, of 2 at 4), and an
# E4M3 block scale's own rounding (a block's amax can land just past 6 and clip).
_NVFP4_REL = 0.25 + 2**-4


def _quantization_bound(x, fmt, amax, mxfp8=False):
    """Per-element bound of ``|dequantize(quantize(x)) - x|`` (float64 ``x``) for elements of
    ``fmt`` (an FP8 dtype, or "nvfp4") and a scale derived from at most ``amax``: half an ulp
    relative to the value, and for values the scale maps below the normal range the absolute
    half spacing of the subnormals (a block's amax lands in ``[max / 2, max]``). ``mxfp8``: the
    OCP spec's floor rule for the E8M0 exponent maps a block's amax into ``[max / 2, 8/7 max)``
    and saturates the values past ``max``: up to 1/8 low (``functional/quantize_mx.py``)."""
    if fmt == "nvfp4":
        return _NVFP4_REL * x.abs() + 0.25 * amax / 6 * (1 + 2**-3)
    finfo = torch.finfo(fmt)
    rel = 1 / 8 if mxfp8 else finfo.eps / 2  # half an ulp: eps / 2 (2^-4 E4M3, 2^-3 E5M2)
    subnormal = finfo.smallest_normal * finfo.eps
    return rel * x.abs() + subnormal * amax / finfo.max


def _within(actual, expected, bound):
    err = (actual.detach().double() - expected).abs()
    bad = (err > bound).nonzero()
    assert not len(bad), (
        f"{len(bad)} elements off by more than the bound, first at {bad[0].tolist()}: "
        f"{actual[tuple(bad[0])].item()} vs {expected[tuple(bad[0])].item()} "
        f"(bound {bound[tuple(bad[0])].item():.3g})"
    )


def _recipe_format(recipe, role):
    fmt = RECIPES[recipe][0].fp8_format
    return fmt.bwd_dtype if role == "grad" else fmt.fwd_dtype


def _data_format(q):
    return "nvfp4" if q.kind == "nvfp4" else q.data.dtype


@FUZZ
@given(seed=SEED, recipe=st.sampled_from(sorted(RECIPES)), role=st.sampled_from(["input", "weight",
       "grad"]), columnwise=st.booleans(), rows=st.integers(1, 40), cols=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), spread=st.booleans())  # fmt: skip
def test_quantize_roundtrip(seed, recipe, role, columnwise, rows, cols, dtype, spread):
    """``te.quantize`` / ``te.dequantize`` per recipe and operand role, rowwise and columnwise,
    any shape (NVFP4: even sizes), values of one scale or spread over decades: every element
    within half an ulp of its format (or the subnormal spacing) of the input. The functional
    quantisers give the same values: ``te.functional.fake_quantize``, ``quantize_mxfp8`` /
    ``dequantize_mxfp8``, ``quantize_nvfp4`` / ``dequantize_nvfp4``."""
    torch.manual_seed(seed)
    r = QUANTIZE_NVFP4 if recipe == "nvfp4" else RECIPES[recipe][0]
    if recipe == "nvfp4":
        rows, cols = 2 * rows, 2 * cols
    x = torch.randn(rows, cols)
    if spread:
        x = x * torch.logspace(-3, 3, cols)
    x = x.to(dtype)
    x64 = x.double()
    amax = x64.abs().max()
    scale = None
    if recipe == "delayed":  # the scale a calibrated history holds
        scale = (torch.finfo(_recipe_format(recipe, role)).max / amax.float()).reshape(1)
    q = te.quantize(x, r, role=role, scale=scale, columnwise=columnwise)
    y = te.dequantize(q, torch.float32)
    bound = _quantization_bound(x64, _data_format(q), amax, mxfp8=q.kind == "mxfp8")
    assert y.shape == x.shape
    _within(y, x64, bound)
    if columnwise:
        y_t = te.dequantize(q, torch.float32, columnwise=True)
        assert y_t.shape == (cols, rows)
        _within(y_t, x64.t(), bound.t())
    if recipe == "current":
        fake = te.functional.fake_quantize(x, QuantSpec("current", q.data.dtype))
        assert torch.equal(fake, te.dequantize(q, dtype))
    elif recipe == "block":
        fake = te.functional.fake_quantize(x, QuantSpec("block", q.data.dtype, q.block_rows, True))
        assert torch.equal(fake, te.dequantize(q, dtype))
    elif recipe == "mxfp8":
        data, s, data_t, s_t = te.functional.quantize_mxfp8(x, q.data.dtype)
        assert torch.equal(te.functional.dequantize_mxfp8(data, s, torch.float32), y)
        y_t = te.functional.dequantize_mxfp8(data_t, s_t, torch.float32)  # blocks down columns
        if columnwise:
            assert torch.equal(y_t, te.dequantize(q, torch.float32, columnwise=True))
        _within(y_t, x64.t(), bound.t())
        fake = te.functional.fake_quantize(x, QuantSpec("mxfp8", q.data.dtype))
        assert torch.equal(fake, y.to(dtype))
    elif recipe == "nvfp4":
        data, s, g, data_t, s_t = te.functional.quantize_nvfp4(x)
        for d, sc, ref in ((data, s, x64), (data_t, s_t, x64.t())):
            out = te.functional.dequantize_nvfp4(d, sc, g, torch.float32).double()
            assert ((out - ref).abs() <= _quantization_bound(ref, "nvfp4", amax)).all()


@FUZZ
@given(seed=SEED, recipe=st.sampled_from(sorted(RECIPES)), forward=st.booleans(),
       backward=st.booleans(), tokens=st.integers(1, 2), width=st.integers(1, 2))  # fmt: skip
def test_ops_quantize(seed, recipe, forward, backward, tokens, width):
    """``te.ops.Quantize(forward, backward)`` under each recipe: the recipe's input quantiser's
    values forward, its gradient quantiser's backward (straight through when off)."""
    torch.manual_seed(seed)
    _, dim, rows = RECIPES[recipe]
    x = torch.randn(tokens * max(rows, 16), width * dim).requires_grad_()
    m = te.ops.Sequential(te.ops.Quantize(forward=forward, backward=backward))
    with te.autocast(recipe=QUANTIZE_NVFP4 if recipe == "nvfp4" else RECIPES[recipe][0]):
        y = m(x)
    dy = torch.randn(y.shape)
    y.backward(dy)
    for out, ref, on in ((y, x, forward), (x.grad, dy, backward)):
        ref = ref.detach().double()
        if not on:
            assert torch.equal(out.double(), ref)
            continue
        role = "grad" if out is x.grad else "input"
        fmt = "nvfp4" if recipe == "nvfp4" else _recipe_format(recipe, role)
        _within(out, ref, _quantization_bound(ref, fmt, ref.abs().max(), recipe == "mxfp8"))


@FUZZ
@given(seed=SEED, length=st.integers(1, 6), slots=st.integers(1, 3), margin=st.integers(0, 3),
       algo=st.sampled_from(["max", "most_recent"]),
       special=st.sampled_from([None, 0.0, math.inf, math.nan]))  # fmt: skip
def test_delayed_scaling_update(seed, length, slots, margin, algo, special):
    """``te.functional.delayed_scaling_update`` (in place): the history rolled with the last
    amaxes in row 0, the scale ``fp8_max / (amax * 2^margin)`` from its max or its newest row,
    kept where that amax is 0 or not finite."""
    torch.manual_seed(seed)
    history = torch.rand(length, slots) * 10
    scale = torch.rand(slots) + 0.5
    amax = torch.rand(slots) * 10
    if special is not None:
        amax[0] = special
        if algo == "max":
            history[:, 0] = special if special != special or special == math.inf else 0.0
    fp8_max = [448.0, 448.0, 57344.0][:slots]
    expected_history = torch.cat((amax[None], history[:-1])).double()
    window = expected_history.amax(0) if algo == "max" else expected_history[0]
    new = torch.tensor(fp8_max, dtype=torch.float64) / (window * 2.0**margin)
    ok = (window > 0) & window.isfinite()
    expected_scale = torch.where(ok, new, scale.double())
    te.functional.delayed_scaling_update(history, scale, amax, fp8_max, margin, algo)
    torch.testing.assert_close(history.double(), expected_history, equal_nan=True, rtol=0, atol=0)
    assert_close(scale, expected_scale, torch.float32)
