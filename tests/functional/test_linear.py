"""The linear family (``te::linear_fwd`` / ``te::linear_bwd``) beyond the registry test, which
compares every recipe, prologue and epilogue with its float64 reference: in high precision
shapes, gradient subsets, main_grad accumulation, autocast, aliasing, bad input in eager and
under compile; per-tensor FP8 accuracy against the high-precision linear (SQNR), amaxes,
saturation, zeros and non-finite input; native blockwise GEMMs against their emulation; the
norm prologue bit for bit against the norm op then the linear; the epilogues' main_grad and
errors."""

from __future__ import annotations

import math

import pytest
import torch

import te_compile as te
import te_compile.functional as tef
from te_compile import functional as F
from te_compile.functional.gemm_ref import quantized_linear_ref
from tests.utils import (
    DEVICES,
    assert_close,
    assert_close_quantized,
    compile_counted,
    gemm_specs,
    make_reference_and_test_tensors,
    paired_grads,
    requires_cuda,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ref_linear(x, w, b):
    out = x @ w.t()
    return out + b if b is not None else out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(13,), (6, 42), (2, 3, 5, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_reference(device, dtype, shape, bias):
    out_features = 19
    x_ref, x = make_reference_and_test_tensors(shape, dtype=dtype, device=device)
    w_ref, w = make_reference_and_test_tensors(
        (out_features, shape[-1]), dtype=dtype, device=device
    )
    b_ref, b = make_reference_and_test_tensors((out_features,), dtype=dtype, device=device)
    if not bias:
        b_ref = b = None
    y_ref = _ref_linear(x_ref, w_ref, b_ref)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, device=device)
    y_ref.backward(dy_ref)
    y = tef.linear(x, w, b)
    y.backward(dy)
    assert y.shape == (*shape[:-1], out_features) and y.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, x_ref.grad, dtype)
    assert_close(w.grad, w_ref.grad, dtype)
    if bias:
        assert_close(b.grad, b_ref.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", ["input", "weight", "bias", "weight+bias"])
def test_only_needed_gradients_are_computed(device, needs):
    x = torch.randn(4, 8, device=device, requires_grad="input" in needs)
    w = torch.randn(3, 8, device=device, requires_grad="weight" in needs)
    b = torch.randn(3, device=device, requires_grad="bias" in needs)
    tef.linear(x, w, b).sum().backward()
    assert (x.grad is not None) == ("input" in needs)
    assert (w.grad is not None) == ("weight" in needs)
    assert (b.grad is not None) == ("bias" in needs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_main_grad_accumulates_in_fp32(device, dtype, compiled):
    x_ref, x = make_reference_and_test_tensors((2, 5, 16), dtype=dtype, device=device)
    w_ref, w = make_reference_and_test_tensors((8, 16), dtype=dtype, device=device)
    main_grad = torch.zeros(8, 16, device=device, dtype=torch.float32)
    fn = lambda x, w, mg: tef.linear(x, w, None, main_grad=mg)  # noqa: E731
    if compiled:
        fn, _ = compile_counted(fn)
    for _step in range(2):
        fn(x, w, main_grad).sum().backward()
    _ref_linear(x_ref, w_ref, None).sum().backward()
    assert w.grad is None, "with main_grad the weight gradient must not go to weight.grad"
    # Two accumulations of the same gradient, in fp32 from dtype operands: fp32-accurate.
    assert_close(main_grad, 2 * w_ref.grad, torch.float32)
    assert_close(x.grad, 2 * x_ref.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_matches_nn_linear(device):
    low = torch.bfloat16
    m = torch.nn.Linear(16, 8, device=device)
    x = torch.randn(4, 16, device=device)
    with torch.autocast(device_type=device, dtype=low):
        expected = m(x)
        fast = tef.linear(x, m.weight, m.bias)
        compiled_fn, _ = compile_counted(lambda x: tef.linear(x, m.weight, m.bias))
        compiled = compiled_fn(x)
    for y in (fast, compiled):
        assert y.dtype == expected.dtype == low
    assert_close(fast, expected.double(), low)
    # Inductor keeps fused intermediates in fp32 (the autocast casts of the inputs included).
    assert_close(compiled, expected.double(), low, roundings=2, reduced=True)
    fast.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_main_grad_accumulates_under_autocast(compiled):
    """Autocast casts the compute arguments, never main_grad: a bf16 copy of it would take
    the weight gradient and be thrown away (weight.grad None, main_grad unchanged)."""
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    main_grad = torch.zeros(8, 16)
    fn = lambda x, w, mg: tef.linear(x, w, None, main_grad=mg)  # noqa: E731
    if compiled:
        fn = compile_counted(fn)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(x, w, main_grad)
    assert y.dtype is torch.bfloat16
    y.float().sum().backward()
    assert main_grad.dtype is torch.float32
    expected = x.detach().bfloat16().double().sum(0).expand(8, 16)  # d(sum y)/dW = 1^T X
    # Compiled, Inductor may fuse the wgrad with the autocast cast of x and skip its rounding.
    assert_close(main_grad, expected, torch.bfloat16 if compiled else torch.float32, reduced=True)


def test_outputs_and_saved_tensors_alias_nothing():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out, branch, saved = torch.ops.te.linear_fwd(x, w, b, None)
    assert saved == [] and branch.numel() == 0
    storages = {t.untyped_storage().data_ptr() for t in (x, w, b)}
    assert out.untyped_storage().data_ptr() not in storages
    # By name: the backward op's trailing arguments grow with the features it serves.
    schema = torch.ops.te.linear_bwd.default._schema
    given = {"grad": torch.randn(4, 3), "saved": [], "inp": x.detach(), "weight": w.detach(),
             "need_dbias": True, "need_dgrad": True, "need_wgrad": True}  # fmt: skip
    hp = {"input_spec": "", "weight_spec": "", "grad_spec": "", "norm": "", "epilogue": ""}
    kwargs = {}
    for arg in schema.arguments:
        if arg.name in given or arg.name in hp:
            kwargs[arg.name] = given.get(arg.name, hp.get(arg.name))
        elif str(arg.type) == "bool":
            kwargs[arg.name] = False
        else:
            kwargs[arg.name] = None
    grads = torch.ops.te.linear_bwd(**kwargs)[:3]
    ptrs = [g.untyped_storage().data_ptr() for g in grads]
    assert len(set(ptrs)) == 3 and not storages & set(ptrs)


BAD_INPUTS = [
    ("in_features", lambda: (torch.randn(4, 8), torch.randn(3, 7), None), "inp.shape[-1] (8)"),
    ("weight rank", lambda: (torch.randn(4, 8), torch.randn(3, 8, 1), None), "weight must be 2-D"),
    ("dtype mix", lambda: (torch.randn(4, 8), torch.randn(3, 8).half(), None), "inp.dtype"),
    (
        "bias shape",
        lambda: (torch.randn(4, 8), torch.randn(3, 8), torch.randn(4)),
        "bias must have",
    ),
    (
        "bias dtype",
        lambda: (torch.randn(4, 8), torch.randn(3, 8), torch.randn(3).half()),
        "bias.dtype",
    ),
    (
        "int input",
        lambda: (torch.ones(4, 8, dtype=torch.int32), torch.ones(3, 8), None),
        "floating",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["fast", "op", "compiled"])
def test_bad_input_raises_clear_error(case, mode):
    _name, make, message = case
    args = make()
    fn = lambda x, w, b: tef.linear(x, w, b)  # noqa: E731
    if mode == "compiled":
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    elif mode == "op":
        fn = lambda x, w, b: torch.ops.te.linear_fwd(x, w, b, None)  # noqa: E731
    with pytest.raises(Exception, match=r"te\.linear: ") as info:
        fn(*args)
    assert message in str(info.value)


def test_main_grad_bad_shape_raises():
    with pytest.raises(ValueError, match="main_grad must be float32"):
        tef.linear(torch.randn(2, 4), torch.randn(3, 4), main_grad=torch.zeros(3, 4).half())


# Per-tensor FP8 (current and delayed scaling) -------------------------------------------------

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
    y = F.linear(x, w, b, **gemm_specs("current"))
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
    y = F.linear(x, w, b, **gemm_specs("current"))
    assert y.dtype is torch.float32
    y_ref = quantized_linear_ref(x.detach().double(), w.detach().double(), **gemm_specs("current"))
    y_ref = y_ref + b.detach().double()
    if device == "cpu":  # the emulated GEMM accumulates in fp32: fp32 roundings
        assert_close(y, y_ref, torch.float32, roundings=2, reduced=True)
    else:  # tol: Transformer Engine's e4m3 GEMM tolerance (Hopper's FP8 accumulation)
        torch.testing.assert_close(y.double(), y_ref, rtol=0.125, atol=0.0675)
    without_bias = F.linear(x.detach(), w.detach(), None, **gemm_specs("current"))
    torch.testing.assert_close(y.detach() - without_bias, b.detach().expand_as(y))
    y.sum().backward()
    assert b.grad is not None and torch.equal(b.grad, torch.full_like(b, x.shape[0]))


@pytest.mark.parametrize("device", DEVICES)
def test_amaxes_are_reported_forward_and_backward(device):
    x, w = _tensors(device)
    grad_amax = torch.zeros(1, device=device)
    y, amax = F.linear(x, w, **gemm_specs("current"), grad_amax=grad_amax, return_amax=True)
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
    y_fit = F.linear(x, w, **gemm_specs("delayed"), scale=fitting)
    y_cur = F.linear(x, w, **gemm_specs("current"))
    # The weight scale 1 vs current scaling: different rounding, same accuracy class.
    assert not torch.equal(y_fit, y_cur)
    # A scale 100x too large saturates x at +-448/scale instead of producing inf.
    too_large = fitting * torch.tensor([100.0, 1.0, 1.0], device=device)
    y_sat = F.linear(x, w, **gemm_specs("delayed"), scale=too_large)
    assert torch.isfinite(y_sat).all()
    clipped = x.detach().float().clamp(-amax_x / 100, amax_x / 100)
    expected = clipped @ w.detach().float().t()
    assert sqnr_db(y_sat, expected) > SQNR_E4M3_DB - 10


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tensors_give_zero_without_nan(device):
    x = torch.zeros(32, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.zeros(16, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = F.linear(x, w, **gemm_specs("current"))
    y.backward(torch.zeros_like(y))
    for t in (y, x.grad, w.grad):
        assert torch.equal(t, torch.zeros_like(t))


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_input_is_reported_in_the_amax(device):
    x, w = _tensors(device)
    x = x.detach().clone()
    x[3, 5] = math.inf
    _, amax = F.linear(x, w.detach(), **gemm_specs("current"), return_amax=True)
    assert math.isinf(amax[0].item())


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_matches_eager(device):
    x, w = _tensors(device)
    fn = lambda x, w: F.linear(x, w, **gemm_specs("current"))  # noqa: E731
    compiled, counter = compile_counted(fn)
    assert torch.equal(compiled(x, w), fn(x, w))
    assert counter.frame_count == 1


def test_feature_sizes_fp8_gemms_cannot_take_raise():
    x = torch.randn(32, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in_features \\(24\\)"):
        F.linear(x, torch.randn(16, 24, dtype=torch.bfloat16), **gemm_specs("current"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_token_counts_are_padded_to_16(device, recipe):
    """30 tokens run as 32 (two zero rows): the same values as the 30 rows of a padded call."""
    torch.manual_seed(0)
    x = torch.randn(30, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    kw = {**gemm_specs(recipe), "scale": torch.tensor([50.0, 50.0, 1000.0], device=device)}
    if recipe == "current":
        kw.pop("scale")
    y = F.linear(x, w, **kw)
    dy = torch.randn_like(y)
    y.backward(dy)
    x_pad = torch.cat([x.detach(), x.new_zeros(2, 32)]).requires_grad_(True)
    w2 = w.detach().clone().requires_grad_(True)
    y_pad = F.linear(x_pad, w2, **kw)
    y_pad.backward(torch.cat([dy, dy.new_zeros(2, 16)]))
    assert y.shape == (30, 16) and torch.equal(y, y_pad[:30])
    assert torch.equal(x.grad, x_pad.grad[:30]) and torch.equal(w.grad, w2.grad)


def test_bad_recipe_and_missing_delayed_scale():
    x, w = torch.randn(16, 16), torch.randn(16, 16)
    with pytest.raises(ValueError, match="input_spec 'fp8:e4m3': unknown token 'fp8'"):
        F.linear(x, w, input_spec="fp8:e4m3")
    with pytest.raises(ValueError, match="mxfp8 GEMMs are emulated here"):
        F.linear(x, w, **gemm_specs("mxfp8"))
    with pytest.raises(ValueError, match='a "delayed" spec needs scale'):
        F.linear(x, w, **gemm_specs("delayed"))


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
    kw = dict(**gemm_specs("delayed"), scale=scale)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = F.linear(x, w, grad_amax=grad_amax, **kw)
    assert y.dtype is torch.bfloat16
    y.backward(grad.bfloat16())
    assert grad_amax.dtype is torch.float32
    assert grad_amax.item() == grad.bfloat16().abs().max().float().item()
    expected = F.linear(x.detach().bfloat16(), w.detach().bfloat16(), **kw)
    assert torch.equal(y.detach(), expected)


@requires_cuda
def test_emulated_gemms_match_the_scaled_mm_ones():
    """``emulate=True`` with a per-tensor recipe (the diagnostic ``quantization.gemm._EMULATE``
    sets): the three GEMMs as fp32 GEMMs of the same FP8 values give the same output and
    gradients as torch._scaled_mm, to Hopper's FP8 accumulation. (Off CUDA the per-tensor GEMM
    is this emulation.)"""
    device = "cuda"
    x, w = _tensors(device)
    b = torch.randn(48, device=device, dtype=torch.bfloat16, requires_grad=True)
    runs = []
    for emulate in (False, True):
        for t in (x, w, b):
            t.grad = None
        y = F.linear(x, w, b, **gemm_specs("current", emulate=emulate))
        y.backward(torch.ones_like(y))
        runs.append([t.detach().float() for t in (y, x.grad, w.grad, b.grad)])
    for native, emulated in zip(*runs, strict=True):
        # tol: two FP8 GEMMs of the same quantised operands, bf16 outputs; the native one
        # accumulates in Hopper's FP8 precision (not a rounding count of bf16)
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
    return F.linear(ln, w, b, return_amax=True, **kw)


@pytest.mark.parametrize("normalization,recipe,zcg,has_beta", NORM_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_prologue_same_bytes_as_the_norm_then_the_linear(
    device, normalization, recipe, zcg, has_beta
):
    """``linear(..., normalization=...)`` (the norm never written on CUDA) against the norm
    op followed by ``linear``: every output, amax, written gradient amax and gradient
    (input, weight, bias, gamma, beta) bit for bit; 21 tokens (padded inside)."""
    torch.manual_seed(0)

    def t(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, device=device) * std + mean).bfloat16().requires_grad_()

    x = t(3, 7, 64, std=2.0, mean=0.5)
    gamma = t(64, std=0.2, mean=0.0 if zcg else 1.0)
    beta = t(64, std=0.3) if has_beta and normalization == "LayerNorm" else None
    w, b = t(48, 64, std=0.2), t(48)
    pending = [torch.zeros(1, device=device) for _ in range(2)]
    kw = gemm_specs(recipe)
    if recipe == "delayed":
        kw["scale"] = torch.tensor([30.0, 900.0, 2e3], device=device)
    out, amax = F.linear(
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
        return F.linear(
            x, w, b, **gemm_specs("current"), normalization="RMSNorm", norm_weight=gamma
        )

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
        F.linear(x, w, normalization="BatchNorm", norm_weight=g)
    with pytest.raises(ValueError, match=r"LayerNorm needs norm_weight \[32\]"):
        F.linear(x, w, normalization="LayerNorm")
    with pytest.raises(ValueError, match=r"RMSNorm needs norm_weight \[32\]"):
        F.linear(x, w, normalization="RMSNorm", norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="norm_bias must be None for RMSNorm"):
        F.linear(x, w, normalization="RMSNorm", norm_weight=g, norm_bias=g)
    with pytest.raises(ValueError, match='normalization="" '):
        F.linear(x, w, norm_weight=g)
    with pytest.raises(ValueError, match="norm_eps must be a positive float"):
        F.linear(x, w, normalization="RMSNorm", norm_weight=g, norm_eps=0.0)


# Float8BlockScaling: native GEMMs against their emulation ---------------------------------------


def _run(native, x, w, b, power_2_scale, weight_block_rows):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    out = F.linear(
        x, w, b, **gemm_specs("block", E4M3, E4M3, power_2_scale, weight_block_rows, not native),
    )  # fmt: skip
    torch.manual_seed(1)
    out.backward(torch.randn_like(out))
    return out, x.grad, w.grad, None if b is None else b.grad


@requires_cuda
@pytest.mark.skipif(
    torch.cuda.is_available() and not te.is_fp8_block_scaling_available(),
    reason="needs blockwise-scaled _scaled_mm (compute capability 9.0+, CUDA 12.9+)",
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("power_2_scale, weight_block_rows", [(True, 128), (False, 128), (True, 1)])
@pytest.mark.parametrize("m, k, n", [(256, 512, 1024), (160, 1024, 512)], ids=str)
def test_native_gemms_match_the_emulation(m, k, n, power_2_scale, weight_block_rows, bias):
    """Both paths quantise identically (same ops); the GEMMs differ only in accumulation order,
    each result rounded once to bf16: so they agree within two bf16 roundings, relative to the
    largest term (a sum of products cancels)."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    native = _run(True, x, w, b, power_2_scale, weight_block_rows)
    emulated = _run(False, x, w, b, power_2_scale, weight_block_rows)
    for a, e in zip(native, emulated, strict=True):
        if e is None:
            assert a is None
            continue
        assert_close(a, e.double(), torch.bfloat16, roundings=2, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_native_blockwise_needs_e4m3_and_shapes_cublas_takes(device):
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="E4M3 operands"):
        F.linear(x, w, **gemm_specs("block", bwd_dtype=E5M2))
    # 128x128 weight blocks: the weight's K / 128 scale dims must be multiples of 4.
    with pytest.raises(ValueError, match="multiples of 512"):
        F.linear(x, w, **gemm_specs("block", bwd_dtype=E4M3, weight_block_rows=128))
    assert F.blockwise_supported(w, 1, E4M3, E4M3)
    assert not F.blockwise_supported(w, 128, E4M3, E4M3)
    assert not F.blockwise_supported(w, 1, E4M3, E5M2)


@pytest.mark.parametrize(
    "kind,native,normalization",
    [("block", True, "RMSNorm"), ("block", True, "LayerNorm"), ("mxfp8", False, "LayerNorm")],
    ids=["block-native-rmsnorm", "block-native-layernorm", "mxfp8-layernorm"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_block_norm_prologue_same_bytes_as_the_norm_then_the_linear(
    device, kind, native, normalization
):
    """``linear(..., normalization=...)`` (natively on CUDA the norm is quantised in
    1x128 blocks without being written) against the norm op followed by the linear: output and
    every gradient bit for bit."""
    if native and device == "cuda" and not te.is_fp8_block_scaling_available():
        pytest.skip("no native blockwise FP8 GEMMs on this GPU")
    torch.manual_seed(0)

    def t(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, device=device) * std + mean).bfloat16().requires_grad_()

    x, w, b = t(2, 32, 512, std=2.0, mean=0.5), t(512, 512, std=0.05), t(512)
    gamma, beta = t(512, std=0.2, mean=1.0), t(512, std=0.3)
    beta = beta if normalization == "LayerNorm" else None
    kw = gemm_specs(kind, E4M3, E4M3, weight_block_rows=128 if kind == "block" else 1,
                    emulate=not native)  # fmt: skip
    out = F.linear(x, w, b, normalization=normalization, norm_weight=gamma, norm_bias=beta, **kw)
    ln = F.layernorm(x, gamma, beta) if normalization == "LayerNorm" else F.rmsnorm(x, gamma)
    ref = F.linear(ln, w, b, **kw)
    assert torch.equal(out, ref)
    params = [p for p in (x, gamma, beta, w, b) if p is not None]
    for _p, g, r in paired_grads(out, ref, params):
        assert torch.equal(g, r)


# Epilogues: main_grad, an unused branch, errors --------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "call",
    [
        lambda x, w, b, mg: F.linear(x, w, b, activation="srelu", main_grad=mg),
        lambda x, w, b, mg: F.linear(
            x, w, b, residual=torch.zeros_like(x[:, :8]), out_scale=2.0, main_grad=mg
        ),
        lambda x, w, b, mg: F.linear(x, w, b, main_grad=mg, return_branch=True)[0],
    ],
    ids=["activation", "residual", "branch"],
)
def test_weight_gradient_goes_into_main_grad_with_an_epilogue(call, device):
    x = torch.randn(6, 16, device=device)
    w = torch.randn(8, 16, device=device, requires_grad=True)
    b = torch.randn(8, device=device, requires_grad=True)
    main_grad = torch.ones(8, 16, device=device)
    y = call(x, w, b, main_grad)
    y.backward(torch.ones_like(y))
    assert w.grad is None and b.grad is not None
    w_ref = w.detach().clone().requires_grad_()
    call(x, w_ref, b.detach(), None).backward(torch.ones_like(y))
    assert_close(main_grad, 1 + w_ref.grad.double(), torch.float32, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_unused_branch_outputs_get_a_zero_gradient(device):
    x = torch.randn(6, 16, device=device, requires_grad=True)
    w = torch.randn(8, 16, device=device)
    out, _branch = F.linear(x, w, return_branch=True)
    out.backward(torch.ones_like(out))
    assert_close(x.grad, torch.ones(6, 8, dtype=torch.float64) @ w.double().cpu(), torch.float32)
    x.grad = None
    weight = torch.ones(16, device=device)
    _out, branch = F.branch_rmsnorm(x, weight)
    branch.backward(torch.full_like(branch, 3.0))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def _x(*shape):
    return torch.randn(*shape)


BAD = [
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, residual=_x(4, 6)),
        r"te.linear: residual must have the output's shape \[4, 8\]",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, residual=_x(4, 8).double()),
        "te.linear: residual must have .* inp's dtype torch.float32",
    ),
    (
        lambda: F.linear(_x(4, 12), _x(8, 16), None, residual=_x(4, 8)),
        r"te.linear: inp.shape\[-1\] \(12\) must equal in_features",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), _x(6), activation="gelu"),
        r"te.linear: bias must have shape \[out_features\] = \[8\]",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(7, 16), None, activation="swiglu"),
        r"te.gated_activation: inp.shape\[-1\] \(7\) must be even",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, activation="swiglu", glu_interleave_size=3),
        r"glu_interleave_size \(3\) must divide half the last dim",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, activation="tanh"),
        "te.activation: unknown activation 'tanh'",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, activation="gelu", residual=_x(4, 8)),
        "te.linear: activation cannot be combined with residual or branch",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), _x(8).half(), return_branch=True),
        r"te.linear: bias.dtype \(torch.float16\) must equal weight.dtype",
    ),
    (
        lambda: F.branch_rmsnorm(_x(4, 16), _x(15)),
        r"te.rmsnorm: weight must have shape \[inp.shape\[-1\]\] = \[16\]",
    ),
    (
        lambda: F.branch_rmsnorm(_x(4, 16), _x(16), eps=0.0),
        "te.rmsnorm: eps must be > 0",
    ),
    (
        lambda: F.branch_rmsnorm(_x(4, 16), _x(16), zero_centered_gamma="no"),
        r"te.branch_rmsnorm: zero_centered_gamma must be a bool \(True or False\), got 'no'",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, out_scale=math.nan),
        r"te.linear: out_scale must be a float \(finite\), got nan",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, activation="clamped_swiglu", limit=0.0),
        r"te.linear: limit must be a positive float \(finite, > 0\), got 0.0",
    ),
    (
        lambda: F.linear(
            _x(4, 16),
            _x(8, 16),
            None,
            normalization="RMSNorm",
            norm_weight=_x(16),
            norm_eps=math.inf,
        ),
        "te.linear: norm_eps must be a positive float \\(finite, > 0\\), got inf",
    ),
    (
        lambda: F.linear(
            _x(4, 16),
            _x(8, 16),
            None,
            normalization="RMSNorm",
            norm_weight=_x(16),
            zero_centered_gamma="no",
        ),
        r"te.linear: zero_centered_gamma must be a bool \(True or False\), got 'no'",
    ),
    (
        lambda: F.linear(_x(4, 16), _x(8, 16), None, return_branch="yes"),
        r"te.linear: return_branch must be a bool \(True or False\), got 'yes'",
    ),
]


@pytest.mark.parametrize(("call", "match"), BAD)
def test_bad_epilogue_input_names_the_argument_eager_and_compiled(call, match):
    with pytest.raises(ValueError, match=match):
        call()
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(call, fullgraph=True)()


def test_branch_rmsnorm_backward_checks_the_branch_gradient():
    x, w = _x(4, 16), _x(16)
    _out, _branch, rsigma = torch.ops.te.branch_rmsnorm_fwd(x, w, 1e-5, False)
    with pytest.raises(ValueError, match=r"te\.branch_rmsnorm: grad_branch must have inp's shape"):
        torch.ops.te.branch_rmsnorm_bwd(_x(4, 16), _x(4, 8), x, rsigma, w, False)


def test_fp8_weight_needs_its_operand_and_a_main_grad():
    """An FP8 weight (FP8 primary weights) without its pre-quantised operand is refused naming
    weight_q; with it but without main_grad, a backward that wants its gradient is refused
    naming main_grad, unless the weight's grad_dtype is high precision (then its .grad)."""
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(48, 32)
    specs = gemm_specs("current")
    codes = w.to(E4M3)
    with pytest.raises(
        ValueError, match=r"an FP8 weight .* needs its pre-quantised operand \(weight_q"
    ):
        F.linear(x, codes, None, **specs)
    wq = F.quantize_weight(w, specs["weight_spec"])
    y = F.linear(x, codes.requires_grad_(), None, weight_quantized=wq, **specs)
    with pytest.raises(RuntimeError, match=r"an FP8 weight's gradient needs main_grad"):
        y.sum().backward()
    codes.grad_dtype = torch.float32  # a high-precision gradient dtype: into .grad, as in TE
    g = torch.randn(16, 48)
    F.linear(x, codes, None, weight_quantized=wq, **specs).backward(g)
    assert codes.grad.dtype == torch.float32
    assert_close_quantized(codes.grad, g.double().T @ x.detach().double(), "current", grad=True)


@pytest.mark.xfail(
    strict=True,
    reason="known limitation (docs/op_mechanism.md, 'Why spec strings'): a float argument of "
    "the compiled function that dynamo makes symbolic cannot enter te::linear's epilogue spec",
)
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_float_argument_of_the_compiled_function(dynamic):
    """``limit`` passed to the compiled function itself, with three values: automatic dynamic
    makes it symbolic from the second (``dynamic=True``: from the first)."""

    def fn(x, w, b, limit):
        return tef.linear(x, w, b, activation="clamped_swiglu", limit=limit)

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 16), torch.randn(32, 16), torch.randn(32)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for limit in (0.75, 2.0, 3.5):
        assert_close(compiled(x, w, b, limit), fn(x, w, b, limit).double(), torch.float32)
