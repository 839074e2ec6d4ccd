"""save_original_input=True (Transformer Engine's): under an FP8 recipe the backward keeps the
module's input itself rather than its quantised copy and quantises it again for the wgrad GEMM:
fewer saved bytes, the same gradients; refused under DelayedScaling."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import te_compile as te
from tests.utils import (
    DEVICES,
    assert_bits_equal,
    assert_close,
    assert_close_quantized,
    assert_close_quantized_groups,
    compile_counted,
    gemm_specs,
    to_reference,
)

BF16 = torch.bfloat16
CURRENT = te.recipe.Float8CurrentScaling()


def _run(m, x, g, recipe, *args):
    """The output and the gradients, with the bytes the backward saved apart from ``x``'s."""
    x = x.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t), te.autocast(enabled=True, recipe=recipe):
        out = m(x, *args)
    out.backward(g)
    other = sum(t.numel() * t.element_size() for t in saved if t.data_ptr() != x.data_ptr())
    keeps_x = any(t.data_ptr() == x.data_ptr() for t in saved)
    return out, x.grad, [p.grad for p in m.parameters()], other, keeps_x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(CURRENT, id="current"),
        pytest.param(te.recipe.Float8BlockScaling(), id="block"),
        pytest.param(te.recipe.MXFP8BlockScaling(), id="mxfp8"),
    ],
)
def test_linear_saves_the_input_with_the_same_gradients(recipe, device):
    torch.manual_seed(0)
    ref = te.Linear(64, 64, params_dtype=BF16, device=device)
    m = te.Linear(64, 64, params_dtype=BF16, device=device, save_original_input=True)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(2, 32, 64, device=device, dtype=BF16)
    g = torch.randn(2, 32, 64, device=device, dtype=BF16)
    out_r, dx_r, dp_r, bytes_r, keeps_r = _run(ref, x, g, recipe)
    out, dx, dp, saved_bytes, keeps_x = _run(m, x, g, recipe)
    assert keeps_x and not keeps_r
    # The quantised transposed input copy (64 x 64 one-byte codes, and its scales) is not saved.
    assert bytes_r - saved_bytes >= x.numel()
    assert_bits_equal(out, out_r)
    assert_bits_equal(dx, dx_r)
    for a, b in zip(dp, dp_r, strict=True):
        assert_bits_equal(a, b)


def test_high_precision_is_unchanged():
    m = te.Linear(16, 16, save_original_input=True)
    x = torch.randn(4, 16, requires_grad=True)
    assert_bits_equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))
    assert "save_original_input=True" in repr(m)


def test_delayed_scaling_refused():
    m = te.Linear(16, 16, save_original_input=True)
    with (
        te.autocast(recipe=te.recipe.DelayedScaling()),
        pytest.raises(
            ValueError,
            match=r"^Linear: save_original_input=True does not work with the DelayedScaling",
        ),
    ):
        m(torch.randn(16, 16))
    g = te.GroupedLinear(2, 16, 16, save_original_input=True)
    with (
        te.autocast(recipe=te.recipe.DelayedScaling()),
        pytest.raises(
            ValueError, match="GroupedLinear: save_original_input=True does not work with the"
        ),
    ):
        g(torch.randn(32, 16), [16, 16])
    with pytest.raises(ValueError, match=r"^Linear: save_original_input must be a bool"):
        te.Linear(4, 4, save_original_input=1)


def test_functional_refusals():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="without a norm prologue"):
        te.functional.linear(x, w, **gemm_specs("current"), save_original_input=True,
                             normalization="RMSNorm", norm_weight=torch.ones(32))  # fmt: skip


GROUPED_RECIPES = [
    pytest.param(CURRENT, id="current"),
    pytest.param(te.recipe.MXFP8BlockScaling(), id="mxfp8"),
    pytest.param(te.recipe.Float8BlockScaling(), id="block"),
    pytest.param(te.recipe.NVFP4BlockScaling(), id="nvfp4"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", GROUPED_RECIPES)
def test_grouped_linear(device, recipe):
    """The input itself is kept, never a quantised copy (Float8CurrentScaling: its FP8 wgrad
    operand; the emulated block-scaled recipes: its dequantised copy), and quantised again in
    the backward: bit for bit the results without it."""
    if device == "cuda" and isinstance(recipe, te.recipe.Float8BlockScaling):
        pytest.skip("native Float8BlockScaling grouped GEMMs: NotImplementedError (tested below)")
    torch.manual_seed(0)
    kw = {"params_dtype": BF16, "device": device}
    ref = te.GroupedLinear(2, 32, 32, **kw)
    m = te.GroupedLinear(2, 32, 32, save_original_input=True, **kw)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(48, 32, device=device, dtype=BF16)
    g = torch.randn(48, 32, device=device, dtype=BF16)
    torch.manual_seed(1)  # the same stream for NVFP4's stochastic rounding of the gradient
    out_r, dx_r, dp_r, bytes_r, keeps_r = _run(ref, x, g, recipe, [16, 32])
    torch.manual_seed(1)
    out, dx, dp, saved_bytes, keeps_x = _run(m, x, g, recipe, [16, 32])
    assert keeps_x and not keeps_r
    assert bytes_r - saved_bytes >= x.numel()  # no copy of the input
    assert_bits_equal(out, out_r)
    assert_bits_equal(dx, dx_r)
    for a, b in zip(dp, dp_r, strict=True):
        assert_bits_equal(a, b)


def test_grouped_linear_native_blockwise_refused():
    """The native blockwise grouped GEMMs save blockwise FP8 copies of the input: refused."""
    x, w = torch.randn(16, 32), torch.randn(2, 32, 32)
    specs = gemm_specs("block", bwd_dtype=torch.float8_e4m3fn, weight_block_rows=128)
    with pytest.raises(NotImplementedError, match="not implemented for the native blockwise"):
        te.functional.grouped_linear(x, [8, 8], w, None, **specs, save_original_input=True)


PAD_RECIPES = GROUPED_RECIPES[1:]  # the block-scaled recipes, which the padding is for


@pytest.mark.parametrize("recipe", PAD_RECIPES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_grouped_linear_with_padding(recipe, compiled):
    """Transformer Engine's Fp8Padding -> GroupedLinear(save_original_input=True) ->
    Fp8Unpadding: the experts' token counts padded to the recipe's alignment; against a float64
    reference of the unpadded experts, and bit for bit the module without save_original_input
    on the same padded tokens, eager and compiled (one graph)."""
    torch.manual_seed(0)
    splits = [5, 0, 37, 22]
    pad, unpad = te.Fp8Padding(4), te.Fp8Unpadding(4)
    kw = {"params_dtype": BF16, "bias": True}
    m = te.GroupedLinear(4, 64, 32, save_original_input=True, **kw)
    ref = te.GroupedLinear(4, 64, 32, **kw)
    ref.load_state_dict(m.state_dict())

    def step(module, x):
        with te.autocast(recipe=recipe):
            padded, padded_splits = pad(x, splits)
            return unpad(module(padded, padded_splits), splits)

    fn, counter = compile_counted(step, backend="aot_eager") if compiled else (step, None)
    x = torch.randn(64, 64, dtype=BF16)
    dy = torch.randn(64, 32, dtype=BF16)
    results = []
    for module in (m, ref):
        torch.manual_seed(1)  # the same stream for NVFP4's stochastic rounding of the gradient
        xr = x.clone().requires_grad_()
        out = fn(module, xr)
        out.backward(dy)
        results.append((out, xr.grad, *(p.grad for p in module.parameters())))
    if counter is not None:
        assert counter.frame_count == 2  # one graph per module, no break
    for a, b in zip(*results, strict=True):
        assert_bits_equal(a, b)
    # float64 reference of the unpadded experts
    x64, dy64 = to_reference(x).requires_grad_(), to_reference(dy)
    ws, bs = [to_reference(w) for w in m.weights()], [to_reference(b) for b in m.biases()]
    ws = [w.requires_grad_() for w in ws]
    out64 = torch.cat([xg @ w.t() + b for xg, w, b in
                       zip(x64.split(splits), ws, bs, strict=True)])  # fmt: skip
    out64.backward(dy64)
    name = {te.recipe.MXFP8BlockScaling: "mxfp8", te.recipe.Float8BlockScaling: "block",
            te.recipe.NVFP4BlockScaling: "nvfp4"}[type(recipe)]  # fmt: skip
    out, dx = results[0][:2]
    assert_close_quantized_groups(out, out64, name, splits)
    assert_close_quantized_groups(dx, x64.grad, name, splits, grad=True)
    for i, w in enumerate(ws):
        if splits[i]:
            assert_close_quantized(m.weights()[i].grad, w.grad, name, grad=True)
    # The bias gradient: sums of the high-precision incoming gradient (padded rows add zeros).
    dbias = torch.stack([d.sum(0) for d in dy64.split(splits)])
    assert_close(torch.stack([b.grad for b in m.biases()]), dbias, BF16)
