"""te.Linear inside te_compile's autocast: FP8 GEMMs with current and delayed scaling, the
delayed-scaling state in buffers updated by a compiled step, recipe changes, state_dict."""

from __future__ import annotations

import math

import expecttest
import pytest
import torch

import te_compile as te
from te_compile import functional as F
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    autocast,
    gemm,
)
from tests.utils import (
    DEVICES,
    GraphRecorder,
    assert_close,
    assert_fast_path_gives_op_bytes,
    assert_matches_eager,
    behaviour_backend,
    compile_counted,
    gemm_specs,
    requires_cuda,
    with_specs,
)
from tests.utils.references import nvfp4_dequantized


def _linear(device, bias=True):
    torch.manual_seed(0)
    return te.Linear(32, 48, bias=bias, params_dtype=torch.bfloat16, device=device)


def _x(device, step=0):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(64, 32, generator=g) * (1 + step)).to(device, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_current_scaling_runs_the_fp8_op(device):
    m = _linear(device)
    x = _x(device)
    with autocast(recipe=Float8CurrentScaling()):
        y = m(x)
    expected = F.linear(x, m.weight, m.bias, **gemm_specs("current"))
    assert torch.equal(y, expected)
    assert not torch.equal(y, m(x)), "outside autocast the GEMM is bf16 again"


def _train(m, steps, recipe, start=0):
    outs = []
    for step in range(start, start + steps):
        with autocast(recipe=recipe):
            y = m(_x(m.weight.device, step))
        y.float().square().mean().backward()
        outs.append(y.detach())
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_state_follows_the_amaxes(device):
    m = _linear(device)
    recipe = DelayedScaling(amax_history_len=4)
    _train(m, 3, recipe)
    meta = m.fp8_meta
    history = meta.amax_history[:4]
    # Row 0 holds the amaxes of step 1 (folded in at the start of step 2's forward).
    x_amaxes = [_x(device, s).abs().max().float().item() for s in range(3)]
    assert history[:, 0].tolist() == [x_amaxes[1], x_amaxes[0], 0.0, 0.0]
    assert meta.fwd_amax[0].item() == x_amaxes[2]
    assert meta.grad_amax.item() > 0
    fp32 = torch.tensor  # the scales are fp32 divisions
    assert meta.scale[0].item() == (fp32(448.0) / fp32(max(x_amaxes[:2]))).item()
    w_amax = m.weight.detach().abs().max().float().cpu()
    assert meta.scale[1].item() == (fp32(448.0) / w_amax).item()


@pytest.mark.parametrize("device", DEVICES)
def test_first_delayed_step_is_calibrated_with_current_scaling(device):
    """A fresh state's first step under DelayedScaling is current scaling (not unit scales):
    the same output and gradients as Float8CurrentScaling, with the amaxes it measured
    recorded; the second step's scales come from them. A state_dict saved right after it holds
    the state and resumes exactly."""
    recipe = DelayedScaling(amax_history_len=4)
    m, ref = _linear(device), _linear(device)
    assert not m.fp8_meta.calibrated
    x, dy = _x(device), torch.randn(64, 48, device=device, dtype=torch.bfloat16)
    with autocast(recipe=recipe):
        y = m(x)
    with autocast(recipe=Float8CurrentScaling()):
        y_ref = ref(x)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(m.weight.grad, ref.weight.grad)
    meta = m.fp8_meta
    assert meta.calibrated and not meta.is_unused()
    assert not meta.amax_history.any() and torch.equal(meta.scale, torch.ones_like(meta.scale))
    w_amax = m.weight.detach().abs().max().float()
    assert torch.equal(meta.fwd_amax, torch.stack([x.abs().max().float(), w_amax]))
    assert meta.grad_amax.item() > 0
    # Saved now: the state is in the state_dict, and a module that loads it resumes exactly.
    state = {k: v.clone() for k, v in m.state_dict().items()}
    assert "fp8_meta.grad_amax" in state
    b = _linear(device)
    b.load_state_dict(state)
    assert b.fp8_meta.calibrated
    assert torch.equal(_train(m, 1, recipe, start=1)[0], _train(b, 1, recipe, start=1)[0])
    fp32 = torch.tensor
    assert meta.scale[0].item() == (fp32(448.0) / x.abs().max().float().cpu()).item()
    assert meta.scale[2].item() == (fp32(57344.0) / state["fp8_meta.grad_amax"].cpu()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("calibrate_eagerly", [False, True], ids=["compiled", "eager_calibration"])
def test_compiled_delayed_step_matches_eager_with_autocast_inside(device, calibrate_eagerly):
    """Compiled delayed steps follow eager ones bit for bit: the calibration step (current
    scaling), then the delayed steps, two graphs. With the calibration step run eagerly first
    (``calibrate_eagerly``, docs/fp8.md) the compiled steps are one graph, the delayed step's."""
    recipe = DelayedScaling(amax_history_len=8)
    eager, compiled_model = _linear(device), _linear(device)

    def step(model, x):
        with autocast(recipe=recipe):  # entered inside the compiled region
            y = model(x)
        return y

    start = int(calibrate_eagerly)
    if calibrate_eagerly:
        for model in (eager, compiled_model):
            step(model, _x(device)).float().square().mean().backward()
        assert compiled_model.fp8_meta.calibrated
    compiled, counter = compile_counted(
        lambda x: step(compiled_model, x), backend=behaviour_backend(device)
    )
    for i in range(start, start + 3):
        x = _x(device, i)
        y_c, y_e = compiled(x), step(eager, x)
        assert torch.equal(y_c, y_e)
        y_c.float().square().mean().backward()
        y_e.float().square().mean().backward()
        for a, b in zip(compiled_model.buffers(), eager.buffers(), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(compiled_model.weight.grad, eager.weight.grad)
    assert counter.frame_count == (1 if calibrate_eagerly else 2)


@pytest.mark.parametrize("device", DEVICES)
def test_changing_the_recipe_recompiles(device):
    m = _linear(device)
    x = _x(device)
    compiled = torch.compile(m, fullgraph=True)
    with autocast(recipe=Float8CurrentScaling()):
        fp8 = compiled(x)
        assert torch.equal(fp8, m(x))
    with autocast(enabled=False):
        assert torch.equal(compiled(x), m(x))
    assert not torch.equal(fp8, compiled(x))


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_resumes_delayed_scaling_exactly(device):
    recipe = DelayedScaling(amax_history_len=4)
    fresh = _linear(device)
    assert set(fresh.state_dict()) == {"weight", "bias"}, "unused FP8 state is left out"
    a = _linear(device)
    _train(a, 2, recipe)
    state = {k: v.clone() for k, v in a.state_dict().items()}
    assert "fp8_meta.amax_history" in state
    b = _linear(device)
    b.load_state_dict(state)
    assert torch.equal(_train(a, 1, recipe, start=2)[0], _train(b, 1, recipe, start=2)[0])
    # And an nn.Linear state_dict still loads strictly, resetting the FP8 state.
    a.load_state_dict(torch.nn.Linear(32, 48).to(device, torch.bfloat16).state_dict())
    assert a.fp8_meta.is_unused()


RECIPES = [DelayedScaling(amax_history_len=16), Float8CurrentScaling()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
@pytest.mark.parametrize(
    "make",
    [
        lambda d: te.LayerNormLinear(32, 48, params_dtype=torch.bfloat16, device=d),
        lambda d: te.LayerNormMLP(
            32,
            64,
            activation="swiglu",
            normalization="RMSNorm",
            params_dtype=torch.bfloat16,
            device=d,
        ),
    ],
    ids=["LayerNormLinear", "LayerNormMLP"],
)
def test_fp8_modules_compile_and_match_eager(device, recipe, make):
    torch.manual_seed(0)
    eager = make(device)
    compiled_model = make(device)
    compiled_model.load_state_dict(eager.state_dict())
    # aot_eager: the traced program (our ops' implementations, traced through) against eager, bit
    # for bit; tests/test_trace_through.py checks Inductor's code for every recipe.
    compiled, counter = compile_counted(compiled_model, backend="aot_eager")
    for i in range(2):
        x = _x(device, i)
        with autocast(recipe=recipe):
            y_c, y_e = compiled(x), eager(x)
        assert torch.equal(y_c, y_e)
        y_c.float().square().mean().backward()
        y_e.float().square().mean().backward()
        for (name, a), b in zip(compiled_model.named_parameters(), eager.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), name
        for a, b in zip(compiled_model.buffers(), eager.buffers(), strict=True):
            assert torch.equal(a, b)
    # Delayed scaling: the calibration step (current scaling), then the delayed steps.
    assert counter.frame_count == (2 if isinstance(recipe, DelayedScaling) else 1)


class TestFP8Graph(expecttest.TestCase):
    def test_delayed_scaling_layernorm_mlp_graph(self):
        torch._dynamo.reset()
        m = te.LayerNormMLP(32, 64, activation="gelu", params_dtype=torch.bfloat16)
        rec = GraphRecorder()
        x = _x("cpu").requires_grad_(True)
        with autocast(recipe=DelayedScaling(amax_history_len=4)):
            m(x).float().sum().backward()  # the calibration step, eager
            torch.compile(m, backend=rec, fullgraph=True)(x).float().sum().backward()
        te_ops = [op for op in (*rec.forward, "|", *rec.backward) if "te." in op or op == "|"]
        self.assertExpectedInline(
            "\n".join(te_ops),
            """\
auto_functionalized_v2(te.delayed_scaling_update_pair.default)
te.mlp_fwd.default
|
auto_functionalized_v2(te.mlp_bwd.default)""",
        )
        # One update for both GEMMs' states (one launch), reading fwd_amax and grad_amax in
        # place: no cat of the two (a kernel per buffer in Inductor's code) before it.
        self.assertNotIn("aten.cat.default", rec.forward)


# Signal-to-quantisation-noise floors (dB) of an emulated block-scaled LayerNormMLP against the
# high-precision one on Gaussian data: measured ~24 dB (MXFP8) and ~15 dB (NVFP4).
BLOCK_SCALED_SQNR_DB = {
    "MXFP8BlockScaling": 20.0,
    "NVFP4BlockScaling": 12.0,
    "Float8BlockScaling": 20.0,
}


def _sqnr_db(actual, expected):
    noise = (actual.double() - expected.double()).square().sum().item()
    return 10 * math.log10(expected.double().square().sum().item() / max(noise, 1e-300))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "recipe_cls",
    [
        te.recipe.MXFP8BlockScaling,
        # NVFP4's emulated LayerNormMLP is the largest of these graphs (a minute of Inductor's
        # CPU compile): long_compile; tests/functional/test_quantize_mx.py compiles NVFP4's
        # quantisers with Inductor on the CPU.
        pytest.param(te.recipe.NVFP4BlockScaling, marks=pytest.mark.long_compile),
        te.recipe.Float8BlockScaling,
    ],
)
def test_emulated_block_scaled_recipes_in_layernorm_mlp(device, recipe_cls):
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 128, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    ref = m(x)
    ref.float().square().sum().backward()
    ref_dx, x.grad = x.grad, None
    compiled, counter = compile_counted(m)
    with autocast(recipe=recipe_cls()):
        y = compiled(x)
    y.float().square().sum().backward()
    floor = BLOCK_SCALED_SQNR_DB[recipe_cls.__name__]
    assert _sqnr_db(y, ref) > floor
    assert _sqnr_db(x.grad, ref_dx) > floor - 6  # gradients are quantised twice more
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_fp8_current_scaling(device):
    torch.manual_seed(0)
    m = te.GroupedLinear(4, 32, 48, single_grouped_parameter=True, params_dtype=torch.bfloat16,
                         device=device)  # fmt: skip
    x = torch.randn(40, 32, device=device, dtype=torch.bfloat16)
    splits = torch.tensor([16, 0, 8, 16], device=device)
    compiled, counter = compile_counted(m)
    with autocast(recipe=Float8CurrentScaling()):
        y, y_c = m(x, splits), compiled(x, splits)
    expected = F.grouped_linear(x, splits, m.weight, m.bias, **with_specs(recipe="current"),
                                fp8_wgrad=True)  # fmt: skip
    assert torch.equal(y, expected) and torch.equal(y_c, expected)
    assert _sqnr_db(y, m(x, splits)) > 25.0  # vs the bf16 grouped GEMM
    assert counter.frame_count == 1
    assert m.fp8_meta.is_unused() and set(m.state_dict()) == {"weight", "bias"}
    with (
        autocast(recipe=Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)),
        pytest.raises(NotImplementedError, match="128x128 activation"),
    ):
        m(x, splits)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_fp8_wgrad(device):
    """The module's wgrad is FP8 under every format (the functional op with
    ``fp8_wgrad=True``, bit for bit, eager and compiled; HYBRID's E5M2 gradient as E4M3 codes),
    and high precision under the recipe's ``backward_override="high_precision"`` (the weight
    gradient of the op's high-precision wgrad, ``fp8_wgrad=False``)."""
    torch.manual_seed(0)
    m = te.GroupedLinear(4, 32, 48, single_grouped_parameter=True, params_dtype=torch.bfloat16,
                         device=device)  # fmt: skip
    x = torch.randn(40, 32, device=device, dtype=torch.bfloat16)
    dy = torch.randn(40, 48, device=device, dtype=torch.bfloat16)
    splits = torch.tensor([16, 0, 9, 15], device=device)
    compiled, counter = compile_counted(m)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    fmts = te.recipe.Format
    cases = ((fmts.E4M3, e4m3, True), (fmts.HYBRID, e5m2, True), (fmts.HYBRID, e5m2, False))
    grads = []
    for fmt, bwd, fp8_wgrad in cases:
        w = m.weight.detach().requires_grad_()
        F.grouped_linear(
            x, splits, w, m.bias, **with_specs(recipe="current", bwd_dtype=bwd),
            fp8_wgrad=fp8_wgrad,
        ).backward(dy)  # fmt: skip
        grads.append(w.grad)
        for call in (m, compiled):
            m.zero_grad(set_to_none=True)
            override = None if fp8_wgrad else "high_precision"
            with autocast(recipe=Float8CurrentScaling(fp8_format=fmt, backward_override=override)):
                call(x, splits).backward(dy)
            assert torch.equal(m.weight.grad, w.grad)
    assert not torch.equal(grads[1], grads[2])  # HYBRID: the FP8 wgrad is not the bf16 one
    assert counter.frame_count == 3  # one graph per recipe


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_features", [128, 64], ids=["n128", "n64"])
@pytest.mark.parametrize(
    "recipe_cls",
    [Float8BlockScaling, te.recipe.MXFP8BlockScaling, te.recipe.NVFP4BlockScaling],
    ids=["block", "mxfp8", "nvfp4"],
)
def test_grouped_linear_block_scaled_recipes_emulated(device, recipe_cls, out_features):
    """The block-scaled recipes on GroupedLinear (emulated): compiled with zero graph breaks,
    the forward equals each expert's te.Linear under the same recipe (same quantised input
    rows and weight blocks; 64 output rows: the 128x128 weight blocks are cut per expert;
    NVFP4: every expert's tokens and weight with the global scale of their own amax), and
    the gradients track the high-precision ones."""
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": device}
    m = te.GroupedLinear(3, 128, out_features, single_grouped_parameter=True, **kw)
    x = torch.randn(96, 128, device=device, dtype=torch.bfloat16)
    # Experts of very different magnitudes: one global NVFP4 scale for all would push expert 0's
    # block scales into E4M3's subnormals, and expert 2's weight's.
    x[:32] *= 1e-3
    x.requires_grad_()
    with torch.no_grad():
        m.weight[2] *= 1e-3
    splits = [32, 0, 64]  # te.Linear's MXFP8 op wants multiples of 32 tokens
    ref = m(x, torch.tensor(splits))
    dy = torch.randn_like(ref)
    ref.backward(dy)
    ref_dx, ref_dw, x.grad, m.weight.grad = x.grad, m.weight.grad, None, None
    compiled, counter = compile_counted(m)
    nvfp4 = recipe_cls is te.recipe.NVFP4BlockScaling
    recipe = _GROUPED_NVFP4 if nvfp4 else recipe_cls()  # what the grouped GEMM implements
    with autocast(recipe=recipe):
        y = compiled(x, torch.tensor(splits, device=device))
        experts = []
        for g, x_g in enumerate(x.detach().split(splits)):
            lin = te.Linear(128, out_features, **kw)
            with torch.no_grad():
                lin.weight.copy_(m.weight[g])
                lin.bias.copy_(m.bias[g])
            experts.append(lin(x_g) if len(x_g) else x_g.new_empty(0, out_features))
    y.backward(dy)
    assert counter.frame_count == 1
    for y_g, e_g in zip(y.detach().split(splits), experts, strict=True):  # relative to each
        if recipe_cls is te.recipe.NVFP4BlockScaling and device == "cuda" and e_g.numel():
            # Compiled, the per-expert global scale is computed by Inductor's code, eagerly by
            # aten's: 1 ulp apart at times, which moves a few inputs one E2M1 step (a grid of
            # 8 magnitudes) and the outputs they feed by up to a few % of the expert's amax.
            assert _sqnr_db(y_g, e_g) > 30
            continue
        assert_matches_eager(y_g, e_g, roundings=1)
    floor = BLOCK_SCALED_SQNR_DB[recipe_cls.__name__]
    assert _sqnr_db(y, ref) > floor
    assert _sqnr_db(x.grad, ref_dx) > floor - 6
    assert _sqnr_db(m.weight.grad, ref_dw) > floor - 6
    assert not m.weight.grad[1].any()


def _grouped(device, single=True):
    torch.manual_seed(0)
    return te.GroupedLinear(4, 32, 48, single_grouped_parameter=single,
                            params_dtype=torch.bfloat16, device=device)  # fmt: skip


def _train_grouped(m, steps, recipe, start=0, call=None):
    call = m if call is None else call
    splits = torch.tensor([16, 0, 8, 40], device=m.fp8_meta.scale.device)
    outs = []
    for step in range(start, start + steps):
        x = _x(m.fp8_meta.scale.device, step)
        with autocast(recipe=recipe):
            y = call(x, splits)
        y.float().square().mean().backward()
        outs.append(y.detach())
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_first_delayed_step_is_calibrated(device):
    """GroupedLinear's first DelayedScaling step runs the rowwise current-scaling op, with the
    input, weight and gradient amaxes of all groups measured into the state."""
    m = _grouped(device)
    x = _x(device)
    dy = torch.randn(64, 48, device=device, dtype=torch.bfloat16)
    splits = torch.tensor([16, 0, 8, 40], device=device)
    w = m.weight.detach().clone().requires_grad_()
    with autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = m(x, splits)
    y.backward(dy)
    y_ref = F.grouped_linear(x, splits, w, m.bias, **with_specs(recipe="current"), fp8_wgrad=True)
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(m.weight.grad, w.grad)
    meta = m.fp8_meta
    assert meta.calibrated and not meta.amax_history.any()
    expected = torch.stack([x.abs().max(), m.weight.detach().abs().max()]).float()
    assert torch.equal(meta.fwd_amax, expected)
    assert torch.equal(meta.grad_amax, dy.abs().max().float().reshape(1))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_linear_delayed_scaling(device):
    """DelayedScaling on GroupedLinear: the per-tensor state follows the amaxes (input, weight
    and gradient of all groups), the compiled training step matches eager with zero graph
    breaks (the state updated in place), and a state_dict resumes training exactly."""
    recipe = DelayedScaling(amax_history_len=4)
    eager, other = _grouped(device), _grouped(device, single=False)
    compiled, counter = compile_counted(other)
    for step, (y_e, y_c) in enumerate(
        zip(_train_grouped(eager, 3, recipe), _train_grouped(other, 3, recipe, call=compiled),
            strict=True)
    ):  # fmt: skip
        assert torch.equal(y_e, y_c), step
    assert counter.frame_count == 2  # the calibration step (current scaling), then delayed
    for name in ("amax_history", "scale", "fwd_amax", "grad_amax"):
        assert torch.equal(getattr(eager.fp8_meta, name), getattr(other.fp8_meta, name)), name
    assert torch.equal(eager.weight.grad, torch.stack([w.grad for w in other.weights()]))
    meta = eager.fp8_meta
    x_amaxes = [_x(device, s).abs().max().float().item() for s in range(3)]
    assert meta.amax_history[:4, 0].tolist() == [x_amaxes[1], x_amaxes[0], 0.0, 0.0]
    assert meta.fwd_amax[0].item() == x_amaxes[2]
    w_amax = eager.weight.detach().abs().max().float().cpu()
    assert meta.scale[1].item() == (torch.tensor(448.0) / w_amax).item()
    assert meta.grad_amax.item() > 0
    # Resume from a state_dict exactly.
    state = {k: v.clone() for k, v in eager.state_dict().items()}
    assert "fp8_meta.amax_history" in state
    resumed = _grouped(device)
    resumed.load_state_dict(state)
    a = _train_grouped(eager, 1, recipe, start=3)[0]
    b = _train_grouped(resumed, 1, recipe, start=3)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
def test_non_finite_amaxes_are_reported(recipe):
    model = torch.nn.Sequential(_linear("cpu"), _linear("cpu").requires_grad_(False))
    model[1] = te.Linear(48, 32, params_dtype=torch.bfloat16)
    x = _x("cpu")
    with autocast(recipe=recipe):
        model(x).float().sum().backward()
    assert te.non_finite_amaxes(model) == {}
    x[0, 0] = float("inf")
    with autocast(recipe=recipe):
        y = model(x)
    # The inf saturates in the FP8 cast of layer 0's input; the report names it.
    assert te.non_finite_amaxes(model) == {"0.fp8_meta": ["input"]}
    assert torch.isfinite(y).all()


_EVERY_RECIPE = {
    "current": Float8CurrentScaling(),
    "delayed": DelayedScaling(amax_history_len=4),
    "block": Float8BlockScaling(),
    "mxfp8": te.recipe.MXFP8BlockScaling(),
    "nvfp4": te.recipe.NVFP4BlockScaling(),
}
# Expert token counts multiples of 16 (NVFP4's grouped GEMMs need them, as a dense one does).
_SPLITS = [16, 0, 16]
# NVFP4's default recipe on the grouped GEMMs (every option per expert).
_GROUPED_NVFP4 = te.recipe.NVFP4BlockScaling()
_GEMM_MODULES = {
    "Linear": lambda: te.Linear(32, 32, params_dtype=torch.bfloat16),
    "LayerNormLinear": lambda: te.LayerNormLinear(32, 32, params_dtype=torch.bfloat16),
    "LayerNormMLP": lambda: te.LayerNormMLP(32, 64, params_dtype=torch.bfloat16),
    "GroupedLinear": lambda: te.GroupedLinear(3, 32, 32, params_dtype=torch.bfloat16),
    "GroupedMLP": lambda: te.GroupedMLP(3, 32, 32, params_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("recipe", _EVERY_RECIPE.values(), ids=_EVERY_RECIPE.keys())
@pytest.mark.parametrize("name", _GEMM_MODULES)
def test_non_finite_values_propagate_or_are_reported(name, recipe, value):
    """An inf or NaN in the input, or in the output gradient, of an FP8 GEMM module is never
    silently clipped to a finite value: it reaches the output (the input's row) / the input
    gradient, or ``te.non_finite_amaxes`` names the slot (the per-tensor recipes, whose cast
    saturates and records the amax). Both steps of delayed scaling (calibration, delayed)."""
    torch.manual_seed(0)
    module = _GEMM_MODULES[name]()
    call = (lambda x: module(x, _SPLITS)) if name.startswith("Grouped") else module
    if name.startswith("Grouped") and recipe.nvfp4():  # what the grouped GEMM implements
        recipe = _GROUPED_NVFP4
    for step in range(2):
        x = torch.randn(32, 32, dtype=torch.bfloat16)
        x[9, 5] = value
        x.requires_grad_()
        with autocast(recipe=recipe):
            y = call(x)
        grad = torch.randn_like(y)
        grad[20, 3] = value
        y.backward(grad)
        report = te.non_finite_amaxes(module)
        reported = {slot for slots in report.values() for slot in slots}
        where = f"{name}, step {step}: {report}"
        assert not y[9].isfinite().all() or "input" in reported, where
        assert not x.grad.isfinite().all() or "grad" in reported, where


@pytest.mark.parametrize(
    "recipe_cls",
    [
        Float8CurrentScaling,
        DelayedScaling,
        te.recipe.Float8BlockScaling,
        te.recipe.MXFP8BlockScaling,
    ],
)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_linear_writes_the_norm_into_fp8(device, normalization, recipe_cls, monkeypatch):
    """LayerNormLinear under an FP8 recipe runs one op with the norm as its prologue
    (``te::linear_fwd`` with ``normalization``); three training steps give the same bytes
    (outputs, every gradient, the delayed-scaling state) as the norm op followed by the FP8
    linear, which it still takes where the norm's output is asked for."""

    kw = {"normalization": normalization, "params_dtype": torch.bfloat16, "device": device}
    torch.manual_seed(0)
    fused = te.LayerNormLinear(64, 64, zero_centered_gamma=True, **kw)
    plain = te.LayerNormLinear(64, 64, zero_centered_gamma=True, **kw)
    with torch.no_grad():
        fused.layer_norm_weight.normal_(0, 0.2)
    plain.load_state_dict(fused.state_dict())
    seen = []
    real, real_per_tensor = gemm.F.linear, gemm.linear_per_tensor

    def spy(*args, **kwargs):
        seen.append(kwargs.get("normalization", ""))
        return real(*args, **kwargs)

    def spy_per_tensor(*args):  # the FP8 linear's eager fast path (args[7]: its Norm or None)
        out = real_per_tensor(*args)
        seen.extend([args[7][2] if len(args) > 7 and args[7] else ""] if out is not None else [])
        return out

    monkeypatch.setattr(gemm.F, "linear", spy)
    monkeypatch.setattr(gemm, "linear_per_tensor", spy_per_tensor)
    results = []
    for module, fuse in ((fused, True), (plain, False)):
        if not fuse:  # the op-by-op path the module takes in high precision
            monkeypatch.setattr(gemm, "quantized", lambda: False)
        outs = []
        torch.manual_seed(1)
        for step in range(3):
            x = (torch.randn(2, 16, 64, device=device) * (1 + step) + 0.3).bfloat16()
            with autocast(recipe=recipe_cls()):
                out = module(x)
            out.float().square().mean().backward()
            outs.append(out.detach())
        grads = [p.grad for p in module.parameters()]
        results.append((outs, grads, [b.clone() for b in module.buffers()]))
    assert seen == [normalization] * 3 + [""] * 3
    for a, b in zip(*(r[0] + r[1] + r[2] for r in results), strict=True):
        assert torch.equal(a, b)
    # return_layernorm_output needs the norm's output: the op-by-op path.
    monkeypatch.undo()
    m = te.LayerNormLinear(64, 64, return_layernorm_output=True, **kw)
    with autocast(recipe=recipe_cls()):
        out, ln_out = m(torch.randn(32, 64, device=device, dtype=torch.bfloat16))
    assert ln_out.shape == (32, 64) and out.shape == (32, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("single", [True, False], ids=["single", "per_expert"])
def test_grouped_linear_fp8_accumulates_into_main_grad(device, single):
    """fuse_wgrad_accumulation under FP8 (compiled, delayed scaling): the weight gradients go
    into main_grad, as the module without the fusion computes them."""
    recipe = DelayedScaling(amax_history_len=4)
    plain = _grouped(device, single)
    torch.manual_seed(0)
    fused = te.GroupedLinear(4, 32, 48, single_grouped_parameter=single,
                             params_dtype=torch.bfloat16, device=device,
                             fuse_wgrad_accumulation=True)  # fmt: skip
    main_grad = fused.allocate_main_grad()
    compiled, counter = compile_counted(fused)
    outs = _train_grouped(fused, 2, recipe, call=compiled)
    for a, b in zip(_train_grouped(plain, 2, recipe), outs, strict=True):
        assert torch.equal(a, b)
    grads = [plain.weight.grad] if single else [w.grad for w in plain.weights()]
    summed = (grads[0] if single else torch.stack(grads)).float()
    # the plain module's bf16 gradients, summed in bf16: one rounding relative to the terms
    assert_close(main_grad, summed, torch.bfloat16, reduced=True)
    assert all(w.grad is None for w in ([fused.weight] if single else fused.weights()))
    assert counter.frame_count == 2  # the calibration step (current scaling), then delayed


@requires_cuda
@pytest.mark.parametrize(
    "recipe",
    [Float8CurrentScaling(), DelayedScaling(amax_history_len=4)],
    ids=["current", "delayed"],
)
def test_grouped_linear_fp8_under_cuda_graphs(recipe):
    """GroupedLinear's FP8 training step compiled with ``mode="reduce-overhead"`` (CUDA graphs):
    it runs (no device tensor of the ops is kept alive in the graphs' memory pool, e.g. a cached
    constant) and replays the eager step's outputs and weight gradients."""
    eager, graphed = _grouped("cuda"), _grouped("cuda")
    call = torch.compile(graphed, mode="reduce-overhead", fullgraph=True, dynamic=False)
    splits = torch.tensor([16, 0, 8, 40], device="cuda")
    for step in range(4):
        x = _x("cuda", step)
        dy = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
        for m, fn in ((eager, eager), (graphed, call)):
            m.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            with autocast(recipe=recipe):
                y = fn(x, splits)
            y.backward(dy)
            if m is eager:
                y_ref = y.detach().clone()
            else:
                torch.testing.assert_close(y.detach(), y_ref, rtol=0, atol=0)
        torch.testing.assert_close(graphed.weight.grad, eager.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("two_d", [True, False], ids=["2d_weight", "1d_weight"])
@pytest.mark.parametrize("module", ["Linear", "LayerNormLinear"])
def test_nvfp4_forward_is_the_gemm_of_the_quantised_operands(device, two_d, module):
    """Under NVFP4 a Linear's forward multiplies the E2M1 values of its input (1 x 16 blocks)
    and weight (16 x 16 tiles, or 1 x 16 with disable_2d_quantization) exactly: against the
    float64 product of an independent quantiser's values (tests.utils.references) only the
    fp32 accumulation differs. Comparing with the unquantised product instead would admit the
    format's own error and bias, which reach 8 - 20% (tests.utils.QUANTIZED_GAIN). The
    LayerNormLinear's GEMM input is its returned norm output (the norm has its own tests)."""
    torch.manual_seed(0)
    kw = {"params_dtype": torch.float32, "device": device}
    if module == "Linear":
        m = te.Linear(64, 48, **kw)
    else:
        m = te.LayerNormLinear(64, 48, return_layernorm_output=True, **kw)
    x = torch.randn(32, 64, device=device) * torch.logspace(-1, 1, 64, device=device)
    with autocast(recipe=te.recipe.NVFP4BlockScaling(disable_2d_quantization=not two_d)):
        y = m(x)
    y, gemm_input = (y, x) if module == "Linear" else y
    w = nvfp4_dequantized(m.weight.detach().cpu(), tile_rows=16 if two_d else 1)
    expected = nvfp4_dequantized(gemm_input.detach().cpu()) @ w.T + m.bias.detach().cpu().double()
    assert_close(y, expected, torch.float32, reduced=True, roundings=2)


# Float8CurrentScaling's MMParams: the backward GEMMs' accumulation ------------------------------

SPLITS = [(True, True), (False, True), (True, False), (False, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dgrad_split", "wgrad_split"), SPLITS)
@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_mmparams_set_each_backward_gemms_accumulation(
    name, dgrad_split, wgrad_split, device, monkeypatch
):
    """``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad`` reach the per-tensor GEMMs as their fast
    accumulation (``use_fast_accum`` of ``torch._scaled_mm`` on CUDA): the dgrad GEMMs (``a``:
    the gradient, a row per token) and the wgrad GEMMs (``a``: its transpose) each as their
    MMParams says, the forward GEMMs always fast (the only forward setting, TE's default)."""
    from te_compile.functional import gemm as G

    recipe = Float8CurrentScaling(
        fp8_gemm_dgrad=te.recipe.MMParams(use_split_accumulator=dgrad_split),
        fp8_gemm_wgrad=te.recipe.MMParams(use_split_accumulator=wgrad_split),
    )
    calls, real = [], G.GEMMS["tensorwise"]

    def spy(a, sa, b, sb, out_dtype, bias, fast_accum, rows, offs):
        calls.append((a.shape[0], fast_accum))
        return real(a, sa, b, sb, out_dtype, bias, fast_accum, rows, offs)

    monkeypatch.setitem(G.GEMMS, "tensorwise", spy)
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": device}
    m = te.Linear(32, 48, **kw) if name == "Linear" else te.LayerNormMLP(32, 64, **kw)
    tokens = 80  # no feature dim
    x = torch.randn(tokens, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    with autocast(recipe=recipe):
        y = m(x)
    forward = len(calls)
    y.float().square().sum().backward()
    assert forward == (1 if name == "Linear" else 2)
    assert all(fast for _, fast in calls[:forward])
    dgrad = [fast for rows, fast in calls[forward:] if rows == tokens]
    wgrad = [fast for rows, fast in calls[forward:] if rows != tokens]
    assert len(dgrad) == len(wgrad) == forward
    assert dgrad == [not dgrad_split] * forward and wgrad == [not wgrad_split] * forward


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dgrad_split", "wgrad_split"), SPLITS)
def test_mmparams_reach_the_grouped_backward_gemms(dgrad_split, wgrad_split, device, monkeypatch):
    """The grouped module's recipe (``make_grouped_recipe`` of its specs) carries them, and the
    grouped FP8 backward (the CUDA path; on the CPU run on CPU bf16 tensors) passes them to the
    dgrad and the FP8 wgrad grouped GEMMs."""
    from te_compile.functional import grouped_fp8 as GF
    from te_compile.functional.grouped_linear_args import make_grouped_recipe
    from te_compile.functional.spec import BackwardSpec

    recipe = Float8CurrentScaling(
        fp8_gemm_dgrad=te.recipe.MMParams(use_split_accumulator=dgrad_split),
        fp8_gemm_wgrad=te.recipe.MMParams(use_split_accumulator=wgrad_split),
    )
    r = make_grouped_recipe(gemm.recipe_specs(recipe), None, None, BackwardSpec(), None)
    assert (r.g.fast_dgrad, r.g.fast_wgrad) == (not dgrad_split, not wgrad_split)
    r = r._replace(bw=BackwardSpec(fp8_wgrad=True))
    from te_compile.functional import gemm as G

    calls, real, real_wgrad = [], G.GEMMS["scaled_grouped_mm"], GF._gemm_wgrad

    def spy(*args):  # (a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs)
        calls.append(("gemm", args[6]))
        return real(*args)

    def spy_wgrad(*args):  # (on CUDA its grouped GEMM; on the CPU the bf16 one, scales after)
        calls.append(("wgrad", args[-1]))
        return real_wgrad(*args)

    monkeypatch.setitem(G.GEMMS, "scaled_grouped_mm", spy)
    monkeypatch.setattr(GF, "_gemm_wgrad", spy_wgrad)
    torch.manual_seed(0)
    kw = {"dtype": torch.bfloat16, "device": device}
    x, w = torch.randn(32, 32, **kw), torch.randn(3, 16, 32, **kw)
    s = torch.tensor([16, 0, 16], device=device)
    out, saved = GF.per_tensor_forward(x, s, w, None, r, cuda=True)
    GF.per_tensor_backward(torch.randn_like(out), saved, x, s, w, None, r, False, True, True, True)
    wgrad = [("wgrad", not wgrad_split), ("gemm", not wgrad_split)]  # its own grouped GEMM
    assert calls == [("gemm", True), *wgrad, ("gemm", not dgrad_split)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ({"input_spec": "current:e4m3:fast_dgrad"}, "fast_dgrad: not an option of input operands"),
        ({"grad_spec": "block:e4m3:fast_wgrad"}, "fast_wgrad: not an option of grad operands"),
    ],
    ids=["input", "block"],
)
def test_fast_accumulation_only_on_a_per_tensor_grad_spec(specs, message, compiled):
    kind = specs.get("grad_spec", specs.get("input_spec")).split(":")[0]
    full = {"input_spec": f"{kind}:e4m3", "weight_spec": f"{kind}:e4m3",
            "grad_spec": f"{kind}:e5m2", **specs}  # fmt: skip
    x, w = torch.randn(32, 128), torch.randn(128, 128)
    fn = torch.compile(F.linear, backend="aot_eager", fullgraph=True) if compiled else F.linear
    with pytest.raises(Exception if compiled else ValueError, match=message):
        fn(x, w, **full)


@pytest.mark.parametrize("fuse_wgrad", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "make_recipe",
    [
        Float8CurrentScaling,
        DelayedScaling,
        lambda: DelayedScaling(fp8_format=Format.HYBRID),
        lambda: Float8CurrentScaling(fp8_format=Format.HYBRID),
    ],
    ids=["current", "delayed", "delayed-hybrid", "current-hybrid"],
)
@pytest.mark.parametrize("norm", ["", "LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("device", DEVICES)
def test_per_tensor_fast_path_gives_the_op_paths_bytes(device, norm, make_recipe, bias, fuse_wgrad):
    """te.Linear's and te.LayerNormLinear's eager FP8 calls under a per-tensor recipe skip the
    op's layers (``functional.linear_ops.linear_per_tensor``): three steps give the op path's
    bytes (outputs, input, weight, bias and norm gradients or main_grad, the delayed-scaling
    state) and the fast path's node."""

    kw = {"bias": bias, "params_dtype": torch.bfloat16, "device": device,
          "fuse_wgrad_accumulation": fuse_wgrad}  # fmt: skip

    def make():  # zero-centred gamma: the norm's scalars reach the kernels
        if norm:
            return te.LayerNormLinear(64, 32, normalization=norm, zero_centered_gamma=True, **kw)
        return te.Linear(64, 32, **kw)

    assert_fast_path_gives_op_bytes(
        make,
        lambda m: (m.weight,),
        make_recipe,
        device,
        fuse_wgrad,
        "_PerTensorLinearBackward",
        "te_linear_fwd",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_per_tensor_fast_path_refuses_what_the_op_refuses(device):
    """The fast path checks a call as the op does, once per set of shapes: in_features not a
    multiple of 16 is refused by name on every call."""
    m = te.Linear(40, 32, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 40, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        with (
            pytest.raises(ValueError, match="in_features"),
            autocast(recipe=Float8CurrentScaling()),
        ):
            m(x)
