"""FP8 linear (per-tensor current and delayed scaling) beyond the registry test, which already
compares forward and backward with the exact fake-quantised reference: accuracy against the
high-precision linear (SQNR), amax reporting, saturation, zeros and non-finite input, errors."""

from __future__ import annotations

import math

import pytest
import torch

from te_compile import functional as F
from tests.utils import DEVICES, compile_counted, paired_grads

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Signal-to-quantisation-noise floors (dB) of a GEMM of two E4M3 operands (3 mantissa bits,
# ~1/16 relative step): measured ~31 dB on Gaussian data; the floor leaves margin.
SQNR_E4M3_DB = 25.0
SQNR_E5M2_DB = 18.0


def sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    noise = (actual.double() - expected.double()).square().sum()
    return 10 * math.log10(expected.double().square().sum().item() / max(noise.item(), 1e-300))


def _tensors(device, m=64, k=32, n=48, dtype=torch.bfloat16):
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
    return x, w


@pytest.mark.parametrize("device", DEVICES)
def test_current_scaling_accuracy_against_high_precision(device):
    x, w = _tensors(device)
    b = torch.randn(48, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = F.linear_fp8(x, w, b, recipe="current")
    dy = torch.randn_like(y)
    y.backward(dy)
    x_ref, w_ref, b_ref = (t.detach().double().requires_grad_() for t in (x, w, b))
    y_ref = x_ref @ w_ref.t() + b_ref
    y_ref.backward(dy.double())
    assert sqnr_db(y, y_ref) > SQNR_E4M3_DB
    # dgrad and wgrad: an E5M2 gradient times an E4M3 operand.
    assert sqnr_db(x.grad, x_ref.grad) > SQNR_E5M2_DB
    assert sqnr_db(w.grad, w_ref.grad) > SQNR_E5M2_DB
    assert sqnr_db(b.grad, b_ref.grad) > 40.0  # dbias is a high-precision sum


@pytest.mark.parametrize("device", DEVICES)
def test_float32_parameters_with_a_bias(device):
    """fp32 operands and a bias: the fp32 GEMM output takes the bias after the GEMM on CUDA
    (torch._scaled_mm refuses a bias with an fp32 output); the result is the reference's
    within Transformer Engine's e4m3 GEMM tolerances (Hopper's FP8 tensor cores accumulate with
    fewer bits than fp32: 2e-3 off at K=32 on an H100, 2026-11-22)."""
    x, w = _tensors(device, dtype=torch.float32)
    b = torch.randn(48, device=device, requires_grad=True)
    y = F.linear_fp8(x, w, b, recipe="current")
    assert y.dtype is torch.float32
    from te_compile.functional.linear_fp8 import linear_fp8_ref

    y_ref = linear_fp8_ref(x.detach().double(), w.detach().double(), b.detach().double())
    torch.testing.assert_close(y.double(), y_ref, rtol=0.125, atol=0.0675)
    without_bias = F.linear_fp8(x.detach(), w.detach(), None, recipe="current")
    torch.testing.assert_close(y.detach() - without_bias, b.detach().expand_as(y))
    y.sum().backward()
    assert b.grad is not None and torch.equal(b.grad, torch.full_like(b, x.shape[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_amaxes_are_reported_forward_and_backward(device):
    x, w = _tensors(device)
    grad_amax = torch.zeros(1, device=device)
    y, amax = F.linear_fp8(x, w, recipe="current", grad_amax=grad_amax, return_amax=True)
    assert amax[0].item() == x.detach().abs().max().float().item()
    assert amax[1].item() == w.detach().abs().max().float().item()
    assert grad_amax.item() == 0.0
    dy = torch.randn_like(y)
    y.backward(dy)
    assert grad_amax.item() == dy.abs().max().float().item()


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_uses_the_given_scales_and_saturates(device):
    x, w = _tensors(device)
    amax_x = x.detach().abs().max().float().item()
    fitting = torch.tensor([448.0 / amax_x, 1.0, 1.0], device=device)
    y_fit = F.linear_fp8(x, w, recipe="delayed", scale=fitting)
    y_cur = F.linear_fp8(x, w, recipe="current")
    # The weight scale 1 vs current scaling: different rounding, same accuracy class.
    assert not torch.equal(y_fit, y_cur)
    # A scale 100x too large saturates x at +-448/scale instead of producing inf.
    too_large = fitting * torch.tensor([100.0, 1.0, 1.0], device=device)
    y_sat = F.linear_fp8(x, w, recipe="delayed", scale=too_large)
    assert torch.isfinite(y_sat).all()
    clipped = x.detach().float().clamp(-amax_x / 100, amax_x / 100)
    expected = clipped @ w.detach().float().t()
    assert sqnr_db(y_sat, expected) > SQNR_E4M3_DB - 10


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tensors_give_zero_without_nan(device):
    x = torch.zeros(32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(16, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = F.linear_fp8(x, w, recipe="current")
    y.backward(torch.zeros_like(y))
    for t in (y, x.grad, w.grad):
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_input_is_reported_in_the_amax(device):
    x, w = _tensors(device)
    x = x.detach().clone()
    x[3, 5] = math.inf
    _, amax = F.linear_fp8(x, w.detach(), recipe="current", return_amax=True)
    assert math.isinf(amax[0].item())


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_matches_eager(device):
    x, w = _tensors(device)
    fn = lambda x, w: F.linear_fp8(x, w, recipe="current")  # noqa: E731
    compiled, counter = compile_counted(fn)
    assert torch.equal(compiled(x, w), fn(x, w))
    assert counter.frame_count == 1


def test_feature_sizes_fp8_gemms_cannot_take_raise():
    x = torch.randn(32, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in_features \\(24\\)"):
        F.linear_fp8(x, torch.randn(16, 24, dtype=torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_token_counts_are_padded_to_16(device, recipe):
    """30 tokens run as 32 (two zero rows): the same values as the 30 rows of a padded call."""
    torch.manual_seed(0)
    x = torch.randn(30, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    kw = {"recipe": recipe, "scale": torch.tensor([50.0, 50.0, 1000.0], device=device)}
    if recipe == "current":
        kw.pop("scale")
    y = F.linear_fp8(x, w, **kw)
    dy = torch.randn_like(y)
    y.backward(dy)
    x_pad = torch.cat([x.detach(), x.new_zeros(2, 32)]).requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    y_pad = F.linear_fp8(x_pad, w2, **kw)
    y_pad.backward(torch.cat([dy, dy.new_zeros(2, 16)]))
    assert y.shape == (30, 16) and torch.equal(y, y_pad[:30])
    assert torch.equal(x.grad, x_pad.grad[:30]) and torch.equal(w.grad, w2.grad)


def test_bad_recipe_and_missing_delayed_scale():
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    with pytest.raises(ValueError, match="recipe must be one of"):
        F.linear_fp8(x, w, recipe="mxfp8")
    with pytest.raises(ValueError, match='recipe="delayed" needs scale'):
        F.linear_fp8(x, w, recipe="delayed")


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_state_keeps_fp32_under_autocast(device):
    """Under torch.autocast the FP8 op computes from bf16 operands but takes the delayed scale
    and the gradient-amax buffer as they are (fp32): the amax of the gradient reaches the
    caller's buffer, and the result equals the op called with bf16 operands directly."""
    torch.manual_seed(0)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    w = torch.randn(48, 64, device=device, requires_grad=True)
    scale = torch.tensor([64.0, 128.0, 2.0**10], device=device)
    grad_amax = torch.zeros(1, device=device)
    grad = torch.randn(32, 48, device=device)
    kw = dict(recipe="delayed", scale=scale)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = F.linear_fp8(x, w, grad_amax=grad_amax, **kw)
    assert y.dtype is torch.bfloat16
    y.backward(grad.bfloat16())
    assert grad_amax.dtype is torch.float32
    assert grad_amax.item() == grad.bfloat16().abs().max().float().item()
    expected = F.linear_fp8(x.detach().bfloat16(), w.detach().bfloat16(), **kw)
    assert torch.equal(y.detach(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_emulated_gemms_match_the_scaled_mm_ones(device, monkeypatch):
    """linear_fp8._EMULATE = True (the diagnostic switch): the three GEMMs as fp32 GEMMs of
    the same FP8 values give the same output and gradients as torch._scaled_mm, to fp32
    accumulation-order error on the CPU (and Hopper's FP8 accumulation on CUDA)."""
    import importlib

    mod = importlib.import_module("te_compile.functional.linear_fp8")
    x, w = _tensors(device)
    b = torch.randn(48, device=device, dtype=torch.bfloat16, requires_grad=True)
    runs = []
    for emulate in (False, True):
        monkeypatch.setattr(mod, "_EMULATE", emulate)
        for t in (x, w, b):
            t.grad = None
        y = F.linear_fp8(x, w, b, recipe="current")
        y.backward(torch.ones_like(y))
        runs.append([t.detach().float() for t in (y, x.grad, w.grad, b.grad)])
    for native, emulated in zip(*runs, strict=True):
        torch.testing.assert_close(emulated, native, rtol=2e-2, atol=2e-2)


# Norm prologue (LayerNormLinear): the norm written straight into FP8. --------------------------

NORM_CASES = [
    pytest.param("LayerNorm", "current", False, True, id="layernorm-current"),
    pytest.param("LayerNorm", "delayed", True, False, id="layernorm-zc-delayed-no-beta"),
    pytest.param("RMSNorm", "current", True, False, id="rmsnorm-zc-current"),
    pytest.param("RMSNorm", "delayed", False, False, id="rmsnorm-delayed"),
]


def _norm_then_linear(x, gamma, beta, normalization, zcg, w, b, **kw):
    if normalization == "LayerNorm":
        ln = F.layernorm(x, gamma, beta, 1e-5, zero_centered_gamma=zcg)
    else:
        ln = F.rmsnorm(x, gamma, 1e-5, zero_centered_gamma=zcg)
    return F.linear_fp8(ln, w, b, return_amax=True, **kw)


@pytest.mark.parametrize("normalization,recipe,zcg,has_beta", NORM_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_prologue_same_bytes_as_the_norm_then_the_linear(
    device, normalization, recipe, zcg, has_beta
):
    """``linear_fp8(..., normalization=...)`` (the norm never written on CUDA) against the norm
    op followed by ``linear_fp8``: every output, amax, written gradient amax and gradient
    (input, weight, bias, gamma, beta) bit for bit; 21 tokens (padded inside)."""
    torch.manual_seed(0)

    def t(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, device=device) * std + mean).bfloat16().requires_grad_()

    x = t(3, 7, 64, std=2.0, mean=0.5)
    gamma = t(64, std=0.2, mean=0.0 if zcg else 1.0)
    beta = t(64, std=0.3) if has_beta and normalization == "LayerNorm" else None
    w, b = t(48, 64, std=0.2), t(48)
    pending = [torch.zeros(1, device=device) for _ in range(2)]
    kw = {"recipe": recipe}
    if recipe == "delayed":
        kw["scale"] = torch.tensor([30.0, 900.0, 2e3], device=device)
    out, amax = F.linear_fp8(
        x, w, b, normalization=normalization, norm_weight=gamma, norm_bias=beta, norm_eps=1e-5,
        zero_centered_gamma=zcg, return_amax=True, grad_amax=pending[0], **kw,
    )  # fmt: skip
    ref, ref_amax = _norm_then_linear(x, gamma, beta, normalization, zcg, w, b,
                                      grad_amax=pending[1], **kw)  # fmt: skip
    assert torch.equal(out, ref) and torch.equal(amax, ref_amax)
    params = [p for p in (x, gamma, beta, w, b) if p is not None]
    for _p, g, r in paired_grads(out, ref, params):
        assert torch.equal(g, r)
    assert torch.equal(pending[0], pending[1]) and pending[0].item() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_norm_prologue_compiles_and_only_the_needed_gradients(device):
    x, w = _tensors(device)
    b = torch.randn(48, device=device, dtype=torch.bfloat16, requires_grad=True)
    gamma = torch.ones(32, device=device, dtype=torch.bfloat16, requires_grad=True)

    def fn(x, w, b, gamma):
        return F.linear_fp8(x, w, b, normalization="RMSNorm", norm_weight=gamma)

    compiled, counter = compile_counted(fn, backend="aot_eager")
    out = compiled(x, w, b, gamma)
    assert torch.equal(out, fn(x, w, b, gamma))
    assert counter.frame_count == 1
    # Only gamma needs a gradient: the GEMM's dgrad still runs (the norm's backward needs it).
    (g,) = torch.autograd.grad(fn(x.detach(), w.detach(), None, gamma).sum(), [gamma])
    assert g.abs().sum() > 0


def test_norm_prologue_errors_name_the_argument():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    g = torch.ones(32)
    with pytest.raises(ValueError, match="normalization must be"):
        F.linear_fp8(x, w, normalization="BatchNorm", norm_weight=g)
    with pytest.raises(ValueError, match=r"LayerNorm needs norm_weight \[32\]"):
        F.linear_fp8(x, w, normalization="LayerNorm")
    with pytest.raises(ValueError, match=r"RMSNorm needs norm_weight \[32\]"):
        F.linear_fp8(x, w, normalization="RMSNorm", norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="norm_bias must be None for RMSNorm"):
        F.linear_fp8(x, w, normalization="RMSNorm", norm_weight=g, norm_bias=g)
    with pytest.raises(ValueError, match='normalization="" '):
        F.linear_fp8(x, w, norm_weight=g)
    with pytest.raises(ValueError, match="norm_eps must be > 0"):
        F.linear_fp8(x, w, normalization="RMSNorm", norm_weight=g, norm_eps=0.0)
