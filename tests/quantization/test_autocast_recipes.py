"""Transformer Engine's autocast and recipe behaviours the modules honour: calibration
(``calibrating=True``), ``backward_override``, recipe fields set after construction (recompile,
never a stale recipe), ``DelayedScaling``'s callables, and the device queries."""

from __future__ import annotations

import re

import pytest
import torch

import te_compile as te
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    autocast,
    fp8_autocast,
)
from tests.utils import (
    DEVICES,
    HAS_CUDA,
    assert_close,
    compile_counted,
    gemm_specs,
    make_reference_and_test_tensors,
)


def _x(shape, device, step=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(*shape, generator=g) * (1 + step)).to(device, dtype)


def _pair(cls, *args, **kw):
    """Two modules with the same parameters."""
    torch.manual_seed(0)
    a = cls(*args, **kw)
    b = cls(*args, **kw)
    b.load_state_dict(a.state_dict())
    return a, b


# ---------------------------------------------------------------------------------------------
# Calibration: high-precision outputs, the FP8 state kept as in an FP8 run
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8_autocast", "autocast"])
def test_calibration_computes_in_high_precision_and_updates_delayed_scaling(device, name):
    calibrated, plain = _pair(te.Linear, 32, 48, params_dtype=torch.bfloat16, device=device)
    recipe = DelayedScaling(amax_history_len=4)

    def region():
        if name == "fp8_autocast":
            return fp8_autocast(enabled=False, calibrating=True, fp8_recipe=recipe)
        return autocast(enabled=False, calibrating=True, recipe=recipe)

    for step in range(3):
        x = _x((64, 32), device, step, torch.bfloat16)
        xc, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        with region():
            y = calibrated(xc)
        expected = plain(xp)
        assert torch.equal(y, expected), "calibration computes in high precision"
        grad = torch.randn_like(y)
        y.backward(grad)
        expected.backward(grad)
        assert torch.equal(xc.grad, xp.grad) and torch.equal(
            calibrated.weight.grad, plain.weight.grad
        )
    meta = calibrated.fp8_meta
    xs = [_x((64, 32), device, s, torch.bfloat16) for s in range(3)]
    x_amaxes = [x.abs().max().float().item() for x in xs]
    # Step 0 marks the state calibrated; steps 1 and 2 fold the previous step's amaxes in.
    assert meta.amax_history[:4, 0].tolist() == [x_amaxes[1], x_amaxes[0], 0.0, 0.0]
    assert meta.fwd_amax[0].item() == x_amaxes[2]
    fp32 = torch.tensor
    assert meta.scale[0].item() == (fp32(448.0) / fp32(max(x_amaxes[:2]))).item()
    w_amax = calibrated.weight.detach().abs().max().float().cpu()
    assert meta.scale[1].item() == (fp32(448.0) / w_amax).item()
    assert meta.grad_amax.item() == 0.0, "the backward stays high precision: no gradient amax"
    assert plain.fp8_meta.is_unused()


def test_calibrated_scales_serve_the_next_fp8_step():
    """After calibration the first FP8 step under DelayedScaling uses the calibrated scales
    (not a calibration step of its own): its output is the delayed-scaling GEMM with them."""
    torch.manual_seed(0)
    m = te.Linear(32, 48, params_dtype=torch.float32)
    recipe = DelayedScaling(amax_history_len=4)
    for step in range(2):
        with autocast(enabled=False, calibrating=True, recipe=recipe):
            m(_x((64, 32), "cpu", step))
    x = _x((64, 32), "cpu", 2)
    history = torch.cat([m.fp8_meta.amax_history[:4], m.fp8_meta.fwd_amax.new_zeros(1, 3)])
    history[0, :2] = m.fp8_meta.fwd_amax  # what the FP8 step folds in first
    amax = history[:, :2].amax(0)
    scale = torch.cat([448.0 / amax, m.fp8_meta.scale[2:]])
    with autocast(recipe=recipe):
        y = m(x)
    expected = quantized_linear_ref(x, m.weight, **gemm_specs("delayed"), scale=scale) + m.bias
    torch.testing.assert_close(m.fp8_meta.scale[:2], scale[:2])
    # fp32 roundoff only (the CPU GEMM's summation order varies between machines); a GEMM with
    # other scales would differ by the FP8 quantisation step, orders of magnitude more.
    assert_close(y, expected, torch.float32, roundings=2)


def test_calibration_of_layernorm_mlp_records_both_gemms():
    calibrated, plain = _pair(te.LayerNormMLP, 32, 64, params_dtype=torch.float32)
    x = _x((16, 32), "cpu")
    with autocast(enabled=False, calibrating=True, recipe=Float8CurrentScaling()):
        y = calibrated(x)
    torch.testing.assert_close(y, plain(x), rtol=0, atol=0)
    norm = torch.nn.functional.layer_norm(x, (32,), calibrated.layer_norm_weight,
                                          calibrated.layer_norm_bias, calibrated.eps)  # fmt: skip
    fc1 = norm @ calibrated.fc1_weight.t() + calibrated.fc1_bias
    act = torch.nn.functional.gelu(fc1, approximate="tanh")
    amaxes = calibrated.fc1_fp8_meta.fwd_amax, calibrated.fc2_fp8_meta.fwd_amax
    w1, w2 = calibrated.fc1_weight.abs().max(), calibrated.fc2_weight.abs().max()
    torch.testing.assert_close(amaxes[0], torch.stack([norm.abs().max(), w1]).detach())
    torch.testing.assert_close(amaxes[1], torch.stack([act.abs().max(), w2]).detach())


def test_calibration_compiles_without_graph_breaks():
    torch.manual_seed(0)
    m = te.Linear(32, 48, params_dtype=torch.float32)
    recipe = DelayedScaling(amax_history_len=4)

    def step(x):
        with autocast(enabled=False, calibrating=True, recipe=recipe):
            return m(x)

    compiled, counter = compile_counted(step, backend="aot_eager")
    torch.manual_seed(1)
    eager_m = te.Linear(32, 48, params_dtype=torch.float32)
    eager_m.load_state_dict(m.state_dict())
    for s in range(3):
        x = _x((64, 32), "cpu", s)
        y = compiled(x)
        with autocast(enabled=False, calibrating=True, recipe=recipe):
            expected = eager_m(x)
        assert torch.equal(y, expected)
    # One graph per value of the state's Python flag ``calibrated`` (the first step marks it).
    assert counter.frame_count == 2
    torch.testing.assert_close(m.fp8_meta.amax_history, eager_m.fp8_meta.amax_history)
    torch.testing.assert_close(m.fp8_meta.scale, eager_m.fp8_meta.scale)


# ---------------------------------------------------------------------------------------------
# backward_override
# ---------------------------------------------------------------------------------------------

RECIPES = [
    pytest.param(Float8CurrentScaling, {}, id="current"),
    pytest.param(MXFP8BlockScaling, {}, id="mxfp8"),
    pytest.param(Float8BlockScaling, {}, id="block"),
    pytest.param(NVFP4BlockScaling, {}, id="nvfp4"),
]
KIND = {
    Float8CurrentScaling: "current",
    MXFP8BlockScaling: "mxfp8",
    Float8BlockScaling: "block",
    NVFP4BlockScaling: "nvfp4",
}


def _ref_config(recipe):
    """quantized_linear_ref's format arguments for a recipe (its operands' formats)."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    if isinstance(recipe, Float8CurrentScaling):
        return {"fwd_dtype": e4, "bwd_dtype": e5}
    if isinstance(recipe, Float8BlockScaling):
        return {"fwd_dtype": e4, "bwd_dtype": e4, "power_2_scale": True, "weight_block_rows": 128}
    if isinstance(recipe, NVFP4BlockScaling):  # 16x16 weight tiles by default
        return {"fwd_dtype": e4, "bwd_dtype": e4, "weight_block_rows": 16}
    return {"fwd_dtype": e4, "bwd_dtype": e4}


def _dequantized_reference(x, w, recipe):
    """The product of the forward's dequantised operands, written out here: each operand
    quantised along K as the forward GEMM quantises it, dequantised, and multiplied; its
    gradient flows straight through the quantisation (dX = dY W_q, dW = dY^T X_q)."""
    from te_compile import dequantize, quantize

    def qdq(t, role):
        values = dequantize(quantize(t.detach().float(), recipe, role=role), torch.float32)
        return t + (values.to(t.dtype) - t).detach()

    return qdq(x, "input") @ qdq(w, "weight").t()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("cls", "kw"), RECIPES)
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_linear_backward_override(device, cls, kw, override):
    dtype = torch.bfloat16
    recipe = cls(backward_override=override)
    torch.manual_seed(0)
    m = te.Linear(128, 256, bias=False, params_dtype=dtype, device=device)
    w_ref = m.weight.detach().to("cpu", torch.float64).requires_grad_()
    x_ref, x = make_reference_and_test_tensors((64, 128), dtype=dtype, device=device)
    with autocast(recipe=recipe):
        y = m(x)
    # The forward is the recipe's either way.
    with autocast(recipe=cls()):
        assert torch.equal(y, m(x.detach()))
    grad = torch.randn(64, 256).to(device, dtype)
    y.backward(grad)
    if override == "high_precision":  # the backward of the high-precision GEMM
        ref = x_ref @ w_ref.t()
    else:
        ref = _dequantized_reference(x_ref, w_ref, recipe)
    ref.backward(grad.cpu().double())
    assert_close(x.grad, x_ref.grad, dtype, roundings=2, reduced=True)
    assert_close(m.weight.grad, w_ref.grad, dtype, roundings=2, reduced=True)
    # The reference the op registry checks it against agrees.
    config = _ref_config(recipe)
    x2, w2 = x_ref.detach().requires_grad_(), w_ref.detach().requires_grad_()
    specs = gemm_specs(KIND[cls], **config)
    quantized_linear_ref(x2, w2, **specs, backward_override=override).backward(grad.cpu().double())
    assert_close(x.grad, x2.grad, dtype, roundings=2, reduced=True)
    assert_close(m.weight.grad, w2.grad, dtype, roundings=2, reduced=True)


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_layernorm_linear_backward_override(override):
    """With a norm prologue the wgrad GEMM takes the norm's output (high precision, or its
    quantised-dequantised value) and the norm's backward its input."""
    recipe = Float8CurrentScaling(backward_override=override)
    torch.manual_seed(0)
    m = te.LayerNormLinear(64, 32, params_dtype=torch.float32)
    x_ref, x = make_reference_and_test_tensors((16, 64), dtype=torch.float32)
    with autocast(recipe=recipe):
        y = m(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    params = [p.detach().double().requires_grad_() for p in (m.layer_norm_weight,
              m.layer_norm_bias, m.weight, m.bias)]  # fmt: skip
    ln_w, ln_b, w, b = params
    norm = torch.nn.functional.layer_norm(x_ref, (64,), ln_w, ln_b, m.eps)
    if override == "high_precision":
        ref = norm @ w.t() + b
    else:
        ref = _dequantized_reference(norm, w, recipe) + b
    ref.backward(grad.double())
    for actual, expected in zip((x.grad, m.layer_norm_weight.grad, m.layer_norm_bias.grad,
                                 m.weight.grad, m.bias.grad), (x_ref.grad, *[p.grad for p in
                                 params]), strict=True):  # fmt: skip
        assert_close(actual, expected, torch.float32, roundings=4, reduced=True)


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_layernorm_mlp_backward_override(override):
    """LayerNormMLP honours the override in both GEMMs (it runs them as two te::linear calls):
    against a float64 reference of the same recipe and override per GEMM."""
    recipe = MXFP8BlockScaling(backward_override=override)
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 64, params_dtype=torch.float32)
    x_ref, x = make_reference_and_test_tensors((32, 64), dtype=torch.float32)
    with autocast(recipe=recipe):
        y = m(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    params = (m.layer_norm_weight, m.layer_norm_bias, m.fc1_weight, m.fc1_bias, m.fc2_weight,
              m.fc2_bias)  # fmt: skip
    ln_w, ln_b, w1, b1, w2, b2 = refs = [p.detach().double().requires_grad_() for p in params]
    config = {**gemm_specs("mxfp8", **_ref_config(recipe)), "backward_override": override}
    norm = torch.nn.functional.layer_norm(x_ref, (64,), ln_w, ln_b, m.eps)
    h = quantized_linear_ref(norm, w1, **config) + b1
    act = torch.nn.functional.gelu(h, approximate="tanh")
    ref = quantized_linear_ref(act, w2, **config) + b2
    ref.backward(grad.double())
    # fp32 op, float64 reference: the activation's MXFP8 codes may land one step apart (as the
    # op registry judges requantising samples).
    for actual, expected in zip((x, *params), (x_ref, *refs), strict=True):
        assert_close(actual.grad, expected.grad, torch.bfloat16, roundings=2, reduced=True)


@pytest.mark.parametrize(("cls", "kw"), RECIPES)
def test_backward_override_none_quantises_the_gradient(cls, kw):
    """Without an override the backward GEMMs quantise the gradient: the gradients differ from
    both overrides' (the overrides are not a keyword accepted and ignored)."""
    grads = {}
    for override in (None, "high_precision", "dequantized"):
        torch.manual_seed(0)
        m = te.Linear(128, 32, bias=False, params_dtype=torch.float32)
        x = _x((32, 128), "cpu").requires_grad_()
        with autocast(recipe=cls(backward_override=override, **kw)):
            m(x).backward(_x((32, 32), "cpu", 5))
        grads[override] = x.grad
    assert not torch.equal(grads[None], grads["high_precision"])
    assert not torch.equal(grads[None], grads["dequantized"])
    assert not torch.equal(grads["high_precision"], grads["dequantized"])


def test_op_refuses_bad_backward_override():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match=re.escape("te.linear: backward_override must be one of")):
        te.functional.linear(x, w, **gemm_specs("current"), backward_override="fp8")
    with pytest.raises(ValueError, match="backward 'high_precision' / 'dequantized' is for a q"):
        te.functional.linear(x, w, backward_override="dequantized")
    compiled = torch.compile(
        lambda x, w: te.functional.linear(x, w, **gemm_specs("current"), backward_override="fp8"),
        fullgraph=True,
        backend="eager",
    )
    with pytest.raises(Exception, match=re.escape("te.linear: backward_override must be one of")):
        compiled(x, w)


# ---------------------------------------------------------------------------------------------
# A recipe field set after construction: the compiled module recompiles and uses it
# ---------------------------------------------------------------------------------------------


def test_setting_backward_override_recompiles_the_module():
    torch.manual_seed(0)
    m = te.Linear(64, 32, bias=False, params_dtype=torch.float32)
    recipe = Float8CurrentScaling()

    def step(x):
        with autocast(recipe=recipe):
            return m(x)

    compiled, counter = compile_counted(step, backend="aot_eager")

    def grads(fn, override):
        x = _x((32, 64), "cpu").requires_grad_()
        m.weight.grad = None
        recipe.backward_override = override
        fn(x).backward(_x((32, 32), "cpu", 5))
        return x.grad, m.weight.grad

    for override in (None, "high_precision", "dequantized", None):
        got, expected = grads(compiled, override), grads(step, override)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert counter.frame_count == 3, "one graph per value; setting None back reuses the first"


# ---------------------------------------------------------------------------------------------
# DelayedScaling's callables
# ---------------------------------------------------------------------------------------------


def _halved(amax, scale, fp8_max, recipe):
    return fp8_max / amax / 2


@pytest.mark.parametrize("device", DEVICES)
def test_scaling_factor_compute_algo(device):
    torch.manual_seed(0)
    m = te.Linear(32, 48, params_dtype=torch.float32, device=device)
    seen = []

    def algo(amax, scale, fp8_max, recipe):
        seen.append((amax.clone(), scale.clone(), fp8_max.clone(), recipe))
        return fp8_max / amax / 2

    recipe = DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=algo)
    for step in range(3):
        with autocast(recipe=recipe):
            m(_x((64, 32), device, step)).sum().backward()
    assert len(seen) == 2  # the first step is the calibration step
    amax, old, fp8_max, got_recipe = seen[-1]
    assert got_recipe is recipe
    assert fp8_max.tolist() == [448.0, 448.0, 57344.0]
    torch.testing.assert_close(amax, m.fp8_meta.amax_history[:4].amax(0))
    torch.testing.assert_close(old, seen[0][2] / seen[0][0] / 2)
    torch.testing.assert_close(m.fp8_meta.scale, fp8_max / amax / 2)


def test_amax_compute_algo_callable():
    torch.manual_seed(0)
    m = te.Linear(32, 48, params_dtype=torch.float32)
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=lambda h: h.mean(0))
    for step in range(3):
        with autocast(recipe=recipe):
            m(_x((64, 32), "cpu", step)).sum().backward()
    history = m.fp8_meta.amax_history
    expected = torch.tensor([448.0, 448.0, 57344.0]) / history[:4].mean(0)
    torch.testing.assert_close(m.fp8_meta.scale, expected)


def test_scaling_callable_compiles_and_recompiles_when_replaced():
    torch.manual_seed(0)
    m = te.Linear(32, 48, params_dtype=torch.float32)
    eager = te.Linear(32, 48, params_dtype=torch.float32)
    eager.load_state_dict(m.state_dict())
    recipe = DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=_halved)

    def step(module, x):
        with autocast(recipe=recipe):
            return module(x)

    compiled, counter = compile_counted(step, backend="aot_eager")
    for s in range(4):
        if s == 3:
            recipe.scaling_factor_compute_algo = None  # the built-in formula again
        x = _x((64, 32), "cpu", s)
        compiled(m, x).sum().backward()
        step(eager, x).sum().backward()
        torch.testing.assert_close(m.fp8_meta.scale, eager.fp8_meta.scale, rtol=0, atol=0)
    # First step (calibration), the callable's steps, the built-in formula's step.
    assert counter.frame_count == 3


# ---------------------------------------------------------------------------------------------
# Device queries
# ---------------------------------------------------------------------------------------------


def test_device_compute_capability_and_bf16():
    capability = te.get_device_compute_capability()
    assert isinstance(capability, tuple) and len(capability) == 2
    available = te.is_bf16_available()
    ok, reason = te.is_bf16_available(return_reason=True)
    assert ok is available and (reason == "") == ok
    if not HAS_CUDA:
        assert capability == (0, 0)
        assert (ok, reason) == (False, "no CUDA device")
    else:
        assert capability == torch.cuda.get_device_capability()
        assert ok == (capability >= (8, 0))


def test_device_queries_inside_compiled_region():
    def fn(x):
        return x * (2 if te.is_bf16_available() else 3) + te.get_device_compute_capability()[0]

    compiled, counter = compile_counted(fn, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), fn(x))
    assert counter.frame_count == 1


def test_checkpoint_recomputes_with_the_recipe_of_the_forward():
    """A field set between the forward and the backward does not reach the recompute of
    ``te.checkpoint``: it runs the forward's recipe (a copy made in the forward)."""
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        m = te.Linear(64, 32, bias=False, params_dtype=torch.float32)
        recipe = Float8CurrentScaling(backward_override="high_precision")
        x = _x((32, 64), "cpu").requires_grad_()
        with autocast(recipe=recipe):
            y = te.checkpoint(m, x) if checkpointed else m(x)
        recipe.backward_override = None
        y.backward(_x((32, 32), "cpu", 5))
        grads.append((x.grad, m.weight.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(te.is_fp8_available(), reason="per-tensor FP8 GEMMs are native here")
def test_emulated_recipe_is_announced_once_per_recipe(monkeypatch):
    """Where a recipe's GEMMs are emulated (no FP8 tensor cores), the first autocast of each
    recipe class in a process says so, with the reason; later ones and a disabled one stay
    quiet."""
    import warnings

    from te_compile.quantization import state

    monkeypatch.setattr(state, "_ANNOUNCED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        te.autocast(enabled=False, recipe=te.recipe.Float8CurrentScaling())
        for _ in range(2):
            te.autocast(recipe=te.recipe.Float8CurrentScaling())
        te.autocast(recipe=te.recipe.MXFP8BlockScaling())
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert messages[0].startswith("autocast: Float8CurrentScaling's GEMMs are emulated")
    assert te.is_fp8_available(return_reason=True)[1] in messages[0]
    assert messages[1].startswith("autocast: MXFP8BlockScaling's GEMMs are emulated")
    assert caught[0].filename == __file__  # points at the caller's line
