"""FP8 through ``te_compile.ops``: ``BasicLinear`` inside ``te_compile.autocast`` (current and
delayed scaling, state in buffers, compiled step equals eager), the linear fusions running the
same ``te::linear`` with the recipe as data, and ``Quantize`` for every recipe it supports."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import te_compile as te
from te_compile import ops
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    autocast,
)
from tests.ops.test_basic_ops import _situglu
from tests.ops.test_fusions import _linear_args as _linear_call_args
from tests.ops.test_fusions import _TeOps
from tests.utils import (
    DEVICES,
    assert_close,
    behaviour_backend,
    chain_roundings,
    compile_counted,
    gemm_specs,
    to_reference,
)


def _x(device, rows=32, cols=32, step=0):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(rows, cols, generator=g) * (1 + step)).to(device, torch.bfloat16)


def _linear_args(rec: _TeOps) -> dict:
    return _linear_call_args((None, None, rec.names, rec.args))


def _linear(device, *more):
    torch.manual_seed(0)
    return ops.Sequential(ops.BasicLinear(32, 48), *more).to(device, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_basic_linear_runs_the_fp8_op_inside_autocast(device):
    seq = _linear(device)
    x = _x(device)
    with autocast(recipe=Float8CurrentScaling()):
        y = seq(x)
    assert torch.equal(y, te.functional.linear(x, seq[0].weight, None, **gemm_specs("current")))
    assert not torch.equal(y, seq(x)), "outside autocast the GEMM is bf16 again"


@pytest.mark.parametrize("device", DEVICES)
def test_basic_linear_delayed_scaling_state_and_compiled_step(device):
    recipe = DelayedScaling(amax_history_len=4)
    eager, compiled_model = _linear(device), _linear(device)
    assert set(eager.state_dict()) == {"0.weight"}, "unused FP8 state stays out"

    def step(model, x):
        with autocast(recipe=recipe):
            return model(x)

    compiled, counter = compile_counted(
        lambda x: step(compiled_model, x), backend=behaviour_backend(device)
    )
    for i in range(3):
        x = _x(device, step=i)
        y_c, y_e = compiled(x), step(eager, x)
        assert torch.equal(y_c, y_e)
        y_c.float().square().mean().backward()
        y_e.float().square().mean().backward()
        for a, b in zip(compiled_model.buffers(), eager.buffers(), strict=True):
            assert torch.equal(a, b)
    assert counter.frame_count == 2  # the calibration step (current scaling), then delayed
    meta = eager[0].fp8_meta
    assert meta.amax_history[0, 0].item() == _x(device, step=1).abs().max().float().item()
    assert "0.fp8_meta.amax_history" in eager.state_dict()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("more", "reference_tail", "epilogue", "residual"),
    [
        (
            lambda: [ops.Bias(48), ops.GELU()],
            lambda y, p: F.gelu(y + p["1.bias"], approximate="tanh"),
            {"activation": "gelu"},
            False,
        ),
        (lambda: [ops.Bias(48)], lambda y, p: y + p["1.bias"], {}, False),
        (
            lambda: [ops.Bias(48), ops.SiTUGLU(beta1=0.5, beta2=0.75, glu_interleave_size=4)],
            lambda y, p: _situglu(y + p["1.bias"], 4, 0.5, 0.75),
            {"activation": "situglu", "interleave": 4, "limit": 0.5, "alpha": 0.75, "offset": 0.0},
            False,
        ),
        (
            lambda: [ops.Bias(48), ops.AddExtraInput()],
            lambda y, p, r: y + p["1.bias"] + r,
            {"scale": 1.0},
            True,
        ),
    ],
    ids=["linear-bias-gelu", "linear-bias", "linear-bias-situglu", "linear-bias-add"],
)
def test_linear_fusions_run_fp8_with_their_epilogue_inside_autocast(
    more, reference_tail, epilogue, residual, device
):
    seq = _linear(device, *more())
    with torch.no_grad():
        seq[1].bias.normal_()
    assert seq.fusions()
    x = _x(device)
    extra = [torch.randn(32, 48).to(device, torch.bfloat16)] if residual else []
    with _TeOps() as rec, autocast(recipe=Float8CurrentScaling()):
        y = seq(x, *extra)
    assert rec.names == ["te.linear_fwd"]  # one op: the GEMM in FP8 and the epilogue
    linear = _linear_args(rec)
    assert linear["input_spec"] == "current:e4m3"
    for name, value in epilogue.items():
        assert getattr(linear["ep"], name) == value  # the epilogue's spec
    assert (linear["residual"] is not None) == residual
    p64 = {n: to_reference(p) for n, p in seq.named_parameters()}
    y64 = quantized_linear_ref(to_reference(x), p64["0.weight"], **gemm_specs("current"))
    expected = reference_tail(y64, p64, *(to_reference(e) for e in extra))
    assert_close(
        y, expected, torch.bfloat16, roundings=chain_roundings(torch.bfloat16, 3), reduced=True
    )


@pytest.mark.parametrize("device", DEVICES)
def test_branch_linear_runs_fp8_with_the_branch_inside_autocast(device):
    torch.manual_seed(0)
    seq = ops.Sequential(ops.MakeExtraOutput(), ops.BasicLinear(32, 48), ops.Bias(48))
    seq = seq.to(device, torch.bfloat16)
    x = _x(device).requires_grad_()
    with _TeOps() as rec, autocast(recipe=Float8CurrentScaling()):
        y, branch = seq(x)
    assert seq.fusions() and rec.names == ["te.linear_fwd"]
    assert _linear_args(rec)["ep"].branch is True and torch.equal(branch, x)
    (y.float().sum() + 2 * branch.float().sum()).backward()
    x2 = x.detach().clone().requires_grad_()
    with autocast(recipe=Float8CurrentScaling()):
        y2 = te.functional.linear(x2, seq[1].weight, seq[2].bias, **gemm_specs("current"))
    (y2.float().sum() + 2 * x2.float().sum()).backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)


RECIPES = [
    Float8CurrentScaling(),
    Float8BlockScaling(),
    Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    MXFP8BlockScaling(),
    # Stochastic rounding is the GEMMs' (Quantize refuses it, below).
    NVFP4BlockScaling(disable_stochastic_rounding=True),
    # 4over6 block scaling of the input (never of the gradient), as te.quantize applies it.
    NVFP4BlockScaling(disable_stochastic_rounding=True, nvfp4_4over6="all"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "recipe",
    RECIPES,
    ids=["current", "block1x128", "block128x128", "mxfp8", "nvfp4", "nvfp4_4over6"],
)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_quantize_is_the_recipe_quantiser(recipe, backward, device):
    x = torch.randn(128, 128).to(device, torch.bfloat16).requires_grad_()
    op = ops.Quantize(backward=backward)
    with autocast(recipe=recipe):
        y = op(x)
    expected = te.dequantize(te.quantize(x.detach(), recipe, role="input"), torch.bfloat16)
    assert torch.equal(y, expected)
    assert not torch.equal(y, x), "quantisation changed the values"
    dy = torch.randn(128, 128).to(device, torch.bfloat16)
    y.backward(dy)
    if backward:
        dq = te.dequantize(te.quantize(dy, recipe, role="grad"), torch.bfloat16)
        assert torch.equal(x.grad, dq) and not torch.equal(x.grad, dy)
    else:
        assert torch.equal(x.grad, dy), "straight-through gradient"


def test_quantize_refuses_nvfp4_stochastic_rounding():
    x = torch.randn(32, 32, requires_grad=True)
    with (
        autocast(recipe=NVFP4BlockScaling()),
        pytest.raises(NotImplementedError, match="disable_stochastic_rounding=True"),
    ):
        ops.Quantize(backward=True)(x)
    with autocast(recipe=NVFP4BlockScaling()):
        ops.Quantize()(x)  # the forward quantises the input: no stochastic rounding there


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_outside_autocast_and_backward_only(device):
    x = torch.randn(16, 64, device=device, requires_grad=True)
    assert ops.Quantize()(x) is x
    with autocast(enabled=False):
        assert ops.Quantize(backward=True)(x) is x
    recipe = Float8CurrentScaling()
    with autocast(recipe=recipe):
        y = ops.Quantize(forward=False, backward=True)(x)
    assert torch.equal(y, x) and y is not x
    dy = torch.randn_like(x)
    y.backward(dy)
    assert torch.equal(x.grad, te.dequantize(te.quantize(dy, recipe, role="grad"), torch.float32))


def test_quantize_errors():
    with pytest.raises(ValueError, match="Quantize: forward must be a bool"):
        ops.Quantize(forward=1)
    # te::fake_quantize_fwd takes 4over6 for its forward spec only (NVFP4's gradients never).
    x = torch.randn(16, 64, requires_grad=True)
    with pytest.raises(ValueError, match=r"4over6 in spec only"):
        te.functional.fake_quantize(x, "nvfp4", grad_spec="nvfp4:4over6=MAE/256")


def _qdq_ref(t: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """float64 reference of a per-tensor cast with ``scale`` (saturating) and back."""
    fmax = torch.finfo(fp8_dtype).max
    q = (t.double() * scale).clamp(-fmax, fmax).to(torch.float32).to(fp8_dtype)
    return q.double() / scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True])
def test_quantize_delayed_scaling_uses_the_amax_history(device, compiled):
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="max")
    op = ops.Quantize(backward=True).to(device)
    run = torch.compile(op, backend="aot_eager", fullgraph=True) if compiled else op
    gen = torch.Generator().manual_seed(0)
    amax_x, amax_g = [], []
    for step in range(3):
        x = (torch.randn(32, 64, generator=gen) * (step + 1)).to(device).requires_grad_()
        dy = (torch.randn(32, 64, generator=gen) * 10 ** (-step)).to(device)
        with autocast(recipe=recipe):
            y = run(x)
        y.backward(dy)
        if step == 0:  # calibration: this tensor's own scale
            sx, sg = 448 / x.detach().abs().max().item(), 57344 / dy.abs().max().item()
        else:  # the largest amax of the history of the earlier steps
            sx, sg = 448 / max(amax_x), 57344 / max(amax_g)
        # tol: an FP8 cast and back, exact up to the fp32 product with the scale (rtol); no
        # atol: E4M3 / E5M2 subnormals times these scales are as small as the helper's atol
        torch.testing.assert_close(
            y.double().cpu(), _qdq_ref(x.detach().cpu(), sx, torch.float8_e4m3fn), rtol=1e-6, atol=0
        )
        # tol: the gradient's E5M2 cast and back, as above
        torch.testing.assert_close(
            x.grad.double().cpu(), _qdq_ref(dy.cpu(), sg, torch.float8_e5m2), rtol=1e-6, atol=0
        )
        amax_x.append(x.detach().abs().max().item())
        amax_g.append(dy.abs().max().item())
    # step 2's input is larger than the history: it saturates at 448 / scale
    assert y.abs().max().item() == pytest.approx(448 / sx)
    assert "fp8_meta.amax_history" in op.state_dict()


_ROW_SPLITS_ERRORS = [
    ({"spec": "current:e4m3"}, "which spec='current:e4m3' does not have"),
    ({"spec": "block:e4m3:128x128"}, "which spec='block:e4m3:128x128' does not"),
    ({"spec": "", "grad_spec": "current:e5m2"}, "which grad_spec='current:e5m2' does not have"),
    ({"spec": "nvfp4", "splits": torch.tensor([2.0, 2.0])}, "row_splits must be a 1-D int32"),
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", range(len(_ROW_SPLITS_ERRORS)))
def test_fake_quantize_row_splits_errors(case, compiled):
    """Row groups need quantisers whose scales are per block of one row (or per group, NVFP4's
    global scale): the per-tensor ones raise, naming the argument, eager and compiled."""
    kw, message = _ROW_SPLITS_ERRORS[case]
    kw = dict(kw)
    splits = kw.pop("splits", torch.tensor([2, 2]))

    def call(x, s):
        return te.functional.fake_quantize(x, row_splits=s, **kw)

    fn = torch.compile(call, fullgraph=True, backend="aot_eager") if compiled else call
    with pytest.raises(Exception, match=r"te\.fake_quantize: ") as info:
        fn(torch.randn(4, 32), splits)
    assert message in str(info.value)
    # Groups that do not cover the rows: a device-side assertion (no host sync).
    with pytest.raises(RuntimeError, match="row_splits must be >= 0 and sum to the row count"):
        te.functional.fake_quantize(torch.randn(4, 32), "nvfp4", row_splits=torch.tensor([1, 2]))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_sequential_compiles_without_graph_breaks(device):
    seq = _linear(device, ops.Bias(48), ops.GELU(), ops.Quantize(backward=True))

    def step(x):
        with autocast(recipe=Float8CurrentScaling()):
            return seq(x)

    x = _x(device)
    explanation = torch._dynamo.explain(step)(x)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), step(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_situglu_between_fp8_linears_compiles_and_matches(recipe, device):
    """Linear, Bias, SiTUGLU (fused: the activation in the first GEMM's epilogue), then a Linear
    whose FP8 input is the activation's output, under current and delayed scaling: one graph,
    compiled equals eager, and the output matches the float64 chain of the recipe's GEMMs."""
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.BasicLinear(32, 64), ops.Bias(64), ops.SiTUGLU(beta1=0.5, beta2=0.75),
        ops.BasicLinear(32, 16),
    ).to(device, torch.bfloat16)  # fmt: skip
    assert seq.fusions()[0] == ("ForwardLinearBiasActivation", ("0", "1", "2"))
    with torch.no_grad():
        seq[1].bias.normal_()
    fp8 = Float8CurrentScaling() if recipe == "current" else DelayedScaling()

    def step(x):
        with autocast(recipe=fp8):
            return seq(x)

    x = _x(device)
    explanation = torch._dynamo.explain(step)(x)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    if recipe == "current":  # delayed scaling's state moves with each step: compare one step
        assert torch.equal(compiled(x), step(x))
    y = step(x) if recipe == "current" else compiled(x)
    p64 = {n: to_reference(p) for n, p in seq.named_parameters()}
    specs = gemm_specs("current")
    h = quantized_linear_ref(to_reference(x), p64["0.weight"], **specs)
    h = _situglu(h + p64["1.bias"], None, 0.5, 0.75).to(torch.bfloat16).double()
    expected = quantized_linear_ref(h, p64["3.weight"], **specs)
    if recipe == "current":
        assert_close(
            y, expected, torch.bfloat16, roundings=chain_roundings(torch.bfloat16, 4), reduced=True
        )
    y.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in seq.parameters())


def test_casting_the_model_keeps_the_fp8_state_in_float32():
    seq = ops.Sequential(ops.BasicLinear(32, 16)).to(torch.bfloat16)
    linear = te.Linear(32, 16).half()
    for meta in (seq[0].fp8_meta, linear.fp8_meta):
        assert {b.dtype for b in meta.buffers()} == {torch.float32}
    assert seq[0].weight.dtype == torch.bfloat16 and linear.weight.dtype == torch.float16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "recipe",
    [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
    ids=["current", "delayed"],
)
def test_grouped_linear_op_matches_the_module_under_fp8(device, recipe):
    """ops.GroupedLinear inside autocast runs the module's FP8 grouped GEMM: the same outputs,
    gradients and (delayed) scaling state as te.GroupedLinear over three compiled steps."""
    torch.manual_seed(0)
    single = {"single_grouped_weight": True, "single_grouped_bias": True}
    seq = ops.Sequential(ops.GroupedLinear(3, 32, 48, **single)).to(device, torch.bfloat16)
    module = te.GroupedLinear(3, 32, 48, single_grouped_parameter=True,
                              params_dtype=torch.bfloat16, device=device)  # fmt: skip
    with torch.no_grad():
        module.weight.copy_(seq[0].weight)
        module.bias.copy_(seq[0].bias)
    compiled, counter = compile_counted(seq)
    splits = torch.tensor([8, 0, 24], device=device)
    for step in range(3):
        x = _x(device, step=step)
        with autocast(recipe=recipe):
            y_op, y_mod = compiled(x, splits), module(x, splits)
        assert torch.equal(y_op, y_mod), step
        y_op.float().square().mean().backward()
        y_mod.float().square().mean().backward()
    assert torch.equal(seq[0].weight.grad, module.weight.grad)
    for a, b in zip(seq[0].fp8_meta.buffers(), module.fp8_meta.buffers(), strict=True):
        assert torch.equal(a, b)
    assert seq[0].fp8_meta.is_unused() == isinstance(recipe, Float8CurrentScaling)
    # Delayed scaling: the calibration step (current scaling), then the delayed steps.
    assert counter.frame_count == (1 if isinstance(recipe, Float8CurrentScaling) else 2)
