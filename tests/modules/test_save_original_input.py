"""save_original_input=True (Transformer Engine's): under an FP8 recipe the backward keeps the
module's input itself rather than its quantised copy and quantises it again for the wgrad GEMM:
fewer saved bytes, the same gradients; refused under DelayedScaling."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

import te_compile as te
from tests.utils import DEVICES, assert_bits_equal, gemm_specs

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


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear(device):
    """Float8CurrentScaling: the grouped FP8 wgrad operand is quantised again in the backward
    from the input itself; block-scaled recipes (quantised copies) are not implemented."""
    torch.manual_seed(0)
    kw = {"params_dtype": BF16, "device": device}
    ref = te.GroupedLinear(2, 32, 32, **kw)
    m = te.GroupedLinear(2, 32, 32, save_original_input=True, **kw)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(48, 32, device=device, dtype=BF16)
    g = torch.randn(48, 32, device=device, dtype=BF16)
    out_r, dx_r, dp_r, bytes_r, keeps_r = _run(ref, x, g, CURRENT, [16, 32])
    out, dx, dp, saved_bytes, keeps_x = _run(m, x, g, CURRENT, [16, 32])
    assert keeps_x and not keeps_r
    assert bytes_r - saved_bytes >= x.numel()  # no FP8 copy of the input
    assert_bits_equal(out, out_r)
    assert_bits_equal(dx, dx_r)
    for a, b in zip(dp, dp_r, strict=True):
        assert_bits_equal(a, b)
    with (
        te.autocast(recipe=te.recipe.MXFP8BlockScaling()),
        pytest.raises(NotImplementedError, match="save_original_input=True is not implemented"),
    ):
        m(x, [16, 32])
