"""NVFP4's recipe options in the emulated GEMMs: 16x16 weight tiles, the random Hadamard
transform of the wgrad GEMM's operands, stochastic rounding of the gradient, row-scaled
activations (``functional.quantize_mx_ref.nvfp4_qdq``, ``te::linear``'s ``weight_block_rows=16``,
``rht``, ``stochastic_rounding``, ``row_scaled``), against float64 references."""

from __future__ import annotations

import math
import re

import pytest
import torch

import te_compile as te
from te_compile import functional as F
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.functional.quantize_mx_ref import (
    RHT_SIGNS,
    dequantize_nvfp4_ref,
    nvfp4_qdq,
    quantize_nvfp4_ref,
    random_hadamard_transform,
)
from tests.utils import DEVICES, assert_close, compile_counted, to_reference, with_specs

E4M3 = torch.float8_e4m3fn
NVFP4 = {"recipe": "nvfp4", "emulate": True, "fwd_dtype": E4M3, "bwd_dtype": E4M3}
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _rht_matrix() -> torch.Tensor:
    """``S H / 4`` written out in float64: ``H[i, j] = (-1)^popcount(i & j)``."""
    h = torch.tensor(
        [[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)],
        dtype=torch.float64,
    )
    return torch.diag(torch.tensor(RHT_SIGNS, dtype=torch.float64)) @ h / 4


def _sqnr_db(actual: torch.Tensor, expected: torch.Tensor) -> float:
    noise = (actual.double() - expected.double()).square().sum().item()
    return 10 * math.log10(expected.double().square().sum().item() / max(noise, 1e-300))


# Quantisation ----------------------------------------------------------------------------------


def test_rht_is_transformer_engines_orthogonal_matrix():
    r = _rht_matrix()
    assert torch.equal(r @ r.t(), torch.eye(16, dtype=torch.float64))
    x = torch.randn(8, 48, dtype=torch.float64)
    expected = (x.view(8, 3, 16) @ r).view(8, 48)
    assert_close(random_hadamard_transform(x), expected, torch.float64)
    assert_close(random_hadamard_transform(x.float()), expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_no_option_is_the_plain_quantisation(device):
    x = torch.randn(32, 48, device=device)
    data, scale, g, data_t, scale_t = quantize_nvfp4_ref(x)
    row, col_t = nvfp4_qdq(x)
    assert torch.equal(row, dequantize_nvfp4_ref(data, scale, g, torch.float32))
    assert torch.equal(col_t, dequantize_nvfp4_ref(data_t, scale_t, g, torch.float32))


def test_tiles_share_one_scale_per_16x16_tile_and_transpose_exactly():
    torch.manual_seed(0)
    x = torch.randn(48, 32) * torch.logspace(-3, 3, 48)[:, None]  # rows of very different size
    data, scale, g, *_ = quantize_nvfp4_ref(x, tiles=True)
    tile_amax = x.abs().view(3, 16, 2, 16).amax((1, 3)).double()
    expected = (tile_amax * (g.double() / 6)).clamp(max=448).to(E4M3)  # the tile's E4M3 scale
    assert torch.equal(scale.view(3, 16, 2).float(), expected.float()[:, None, :].expand(3, 16, 2))
    row, col_t = nvfp4_qdq(x, tiles=True)
    assert torch.equal(col_t, row.t())  # one quantised weight for the forward and dgrad GEMMs
    assert torch.equal(row, dequantize_nvfp4_ref(data, scale, g, torch.float32))
    # 1x16 blocks follow each row; a tile's scale follows its largest row.
    assert _sqnr_db(nvfp4_qdq(x)[0], x) > _sqnr_db(row, x)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    nearest, _ = nvfp4_qdq(x, columnwise=False)
    state = torch.tensor([11, 0])
    a, a_t = nvfp4_qdq(x, rng_state=state)
    b, b_t = nvfp4_qdq(x, rng_state=state.clone())
    assert torch.equal(a, b) and torch.equal(a_t, b_t)
    assert not torch.equal(a, nvfp4_qdq(x, rng_state=torch.tensor([12, 0]))[0])
    draws = 400
    mean = sum(nvfp4_qdq(x, rng_state=torch.tensor([s, 7]))[0].double() for s in range(draws))
    mean = mean / draws
    bias_sr = (mean - x.double()).abs().mean().item()
    bias_rn = (nearest.double() - x.double()).abs().mean().item()
    assert bias_sr < bias_rn / 5  # round-to-nearest's error is systematic, SR's averages out


def test_stochastic_rounding_probabilities_on_the_grid():
    """A constant block whose scale maps 4.2 to 4.2 exactly rounds up to 6 with probability
    0.1: the distance to 4 over the grid step 2."""
    x = torch.full((16, 16), 4.2)
    x[:, 0] = 6.0  # the block max maps to 6: the scale is amax / 6 (an E4M3 value here)
    draws = torch.stack([nvfp4_qdq(x, rng_state=torch.tensor([s, 0]), columnwise=False)[0]
                         for s in range(200)])  # fmt: skip
    values = draws[:, :, 1:]
    assert set(values.unique().tolist()) <= {4.0, 6.0}
    assert abs((values == 6.0).double().mean().item() - 0.1) < 0.01


def test_rht_transforms_the_columnwise_copy_only():
    torch.manual_seed(0)
    x = torch.randn(32, 48)
    x[3, 5] = 40.0  # an outlier: the transform spreads it over its block of 16 tokens
    row, col_t = nvfp4_qdq(x, rht=True)
    plain_row, plain_col_t = nvfp4_qdq(x)
    assert torch.equal(row, plain_row)
    transformed = random_hadamard_transform(x.t().double())
    assert _sqnr_db(col_t, transformed) > 15
    assert not torch.equal(col_t, plain_col_t)


def test_row_scaled_gives_every_row_its_own_global_scale():
    torch.manual_seed(0)
    x = torch.randn(32, 64) * torch.logspace(-4, 2, 32)[:, None]
    row, _ = nvfp4_qdq(x, row_scaled=True)
    for r in (0, 31):  # each row as a tensor of its own
        data, scale, g, *_ = quantize_nvfp4_ref(x[r : r + 1], columnwise=False)
        assert torch.equal(row[r : r + 1], dequantize_nvfp4_ref(data, scale, g, torch.float32))


# te::linear with the options ---------------------------------------------------------------------


def _linear_and_grads(x, w, dy, **kw):
    out = F.linear(x, w, **with_specs(**NVFP4, **kw))
    dx, dw = torch.autograd.grad(out, (x, w), dy)
    return out, dx, dw


@pytest.mark.parametrize("device", DEVICES)
def test_linear_options_match_the_float64_reference(device):
    torch.manual_seed(0)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
    state = torch.tensor([5, 9], device=device)
    kw = {"weight_block_rows": 16, "rht": True, "stochastic_rounding": True}
    out, dx, dw = _linear_and_grads(x, w, dy, rng_state=state, **kw)
    x64, w64, dy64 = to_reference(x), to_reference(w), to_reference(dy)
    spec = with_specs(recipe="nvfp4", weight_block_rows=16, rht=True, stochastic_rounding=True)
    ref = quantized_linear_ref(x64, w64, **spec, rng_state=state.cpu())
    ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), dy64)
    assert_close(out, ref, torch.bfloat16)
    assert_close(dx, ref_dx, torch.bfloat16)
    assert_close(dw, ref_dw, torch.bfloat16, reduced=True)
    # Each option changes the numbers.
    for off in ("weight_block_rows", "rht", "stochastic_rounding"):
        other = {**kw, off: 1 if off == "weight_block_rows" else False}
        rng = state if other["stochastic_rounding"] else None
        _, dx_o, dw_o = _linear_and_grads(x, w, dy, rng_state=rng, **other)
        assert not (torch.equal(dx_o, dx) and torch.equal(dw_o, dw)), off


def test_rht_wgrad_approximates_the_product():
    """``S H / 4`` is orthogonal and multiplies both wgrad operands, so their GEMM estimates
    ``dY^T X`` as well as the untransformed NVFP4 GEMM does (within 3 dB), with other
    numbers."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(64, 32)
    exact = dy.t().double() @ x.detach().double()
    _, dx_rht, dw_rht = _linear_and_grads(x, w, dy, rht=True)
    _, dx_plain, dw_plain = _linear_and_grads(x, w, dy)
    assert _sqnr_db(dw_rht, exact) > _sqnr_db(dw_plain, exact) - 3 > 10
    assert not torch.equal(dw_rht, dw_plain)
    assert torch.equal(dx_rht, dx_plain)  # the dgrad GEMM's operands are not transformed


def test_stochastic_rounding_draws_from_torchs_generator():
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    dy = torch.randn(32, 48)
    grads = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        grads.append(_linear_and_grads(x, w, dy, stochastic_rounding=True)[1])
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    # Unbiased: the mean dgrad over draws approaches dY @ Q(W) (the gradient unquantised).
    exact = dy.double() @ nvfp4_qdq(w.detach())[1].t().double()  # the dgrad GEMM's weight
    mean = sum(_linear_and_grads(x, w, dy, stochastic_rounding=True)[1].double()
               for _ in range(100)) / 100  # fmt: skip
    nearest = _linear_and_grads(x, w, dy)[1].double()
    assert (mean - exact).abs().mean() < (nearest - exact).abs().mean() / 3


@pytest.mark.parametrize("device", DEVICES)
def test_options_compile_without_graph_breaks(device):
    torch.manual_seed(0)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    w = torch.randn(48, 64, device=device, requires_grad=True)
    dy = torch.randn(32, 48, device=device)
    state = torch.tensor([1, 2], device=device)

    def fn(x, w, state):
        return F.linear(x, w, **with_specs(**NVFP4, weight_block_rows=16, rht=True,
                                           stochastic_rounding=True, rng_state=state))  # fmt: skip

    compiled, counter = compile_counted(fn, backend="aot_eager")
    eager = _linear_and_grads(x, w, dy, weight_block_rows=16, rht=True, stochastic_rounding=True,
                              rng_state=state)  # fmt: skip
    out = compiled(x, w, state)
    dx, dw = torch.autograd.grad(out, (x, w), dy)
    for a, b in zip((out, dx, dw), eager, strict=True):
        assert torch.equal(a, b)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_row_scaled_linear_with_dequantized_backward(device):
    torch.manual_seed(0)
    x = torch.randn(32, 64, device=device) * torch.logspace(-8, 1, 32, device=device)[:, None]
    x.requires_grad_()
    w = torch.randn(16, 64, device=device, requires_grad=True)
    dy = torch.randn(32, 16, device=device)
    kw = {"row_scaled": True, "backward_override": "dequantized"}
    out, dx, dw = _linear_and_grads(x, w, dy, **kw)
    x64, w64 = to_reference(x), to_reference(w)
    spec = with_specs(recipe="nvfp4", row_scaled=True)
    ref = quantized_linear_ref(x64, w64, **spec, backward_override="dequantized")
    ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), to_reference(dy))
    assert_close(out, ref, torch.float32)
    assert_close(dx, ref_dx, torch.float32)
    assert_close(dw, ref_dw, torch.float32, reduced=True)
    # The small rows keep their precision: a global scale per tensor sends them to zero.
    plain = F.linear(x, w, **with_specs(**NVFP4, backward_override="dequantized"))
    exact = x.detach().double() @ w.detach().double().t()
    assert _sqnr_db(out[:8], exact[:8]) > _sqnr_db(plain[:8], exact[:8]) + 10


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"recipe": "current", "rht": True}, "rht: not an option of input operands (NVFP4's"),
        ({**NVFP4, "stochastic_rounding": True, "rng_state": torch.tensor([1.0, 2.0])},
         "stochastic rounding ('sr') needs rng_state: an int64 tensor [2]"),
        ({**NVFP4, "rng_state": torch.tensor([1, 2])}, "rng_state is for a grad_spec with 'sr'"),
        ({**NVFP4, "weight_block_rows": 128}, "blocks of 128 rows are not implemented for weight"),
        ({"recipe": "block", "weight_block_rows": 16}, "blocks of 16 rows are not implemented"),
        ({**NVFP4, "row_scaled": True}, "a row_scaled input_spec needs backward"),
    ],
    ids=["rht-not-nvfp4", "rng-dtype", "rng-without-sr", "nvfp4-rows", "block-rows", "row"],
)  # fmt: skip
def test_bad_option_arguments_raise(kw, message, compiled):
    x, w = torch.randn(32, 64), torch.randn(16, 64)
    fn = torch.compile(F.linear, backend="aot_eager", fullgraph=True) if compiled else F.linear
    # Compiled, the op's fake impl raises the same ValueError inside dynamo's wrapper.
    with pytest.raises(Exception if compiled else ValueError, match=re.escape(message)):
        fn(x, w, **with_specs(**kw))


# The recipe ---------------------------------------------------------------------------------------


def _seeded(fn, seed=0):
    torch.manual_seed(seed)
    return fn()


@pytest.mark.parametrize("device", DEVICES)
def test_default_recipe_is_linear_with_every_option(device):
    """te.Linear under NVFP4BlockScaling() runs te::linear with 16x16 weight tiles, the
    Hadamard transform and stochastic rounding (the recipe's QParams), bit for bit."""
    torch.manual_seed(0)
    m = te.Linear(64, 48, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(32, 48, device=device, dtype=torch.bfloat16)

    def module():
        with te.autocast(recipe=te.recipe.NVFP4BlockScaling()):
            out = m(x)
        return (out, *torch.autograd.grad(out, (x, m.weight), dy))

    def functional():
        kw = {"weight_block_rows": 16, "rht": True, "stochastic_rounding": True}
        return _linear_and_grads(x, m.weight, dy, **kw)

    for a, b in zip(_seeded(module), _seeded(functional), strict=True):
        assert torch.equal(a, b)
    off = te.recipe.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    )
    with te.autocast(recipe=off):
        out = m(x)
    plain = (out, *torch.autograd.grad(out, (x, m.weight), dy))
    for a, b in zip(plain, _linear_and_grads(x, m.weight, dy), strict=True):
        assert torch.equal(a, b)


def test_layernorm_mlp_runs_the_options_op_by_op():
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 128, params_dtype=torch.float32)
    x = torch.randn(32, 64, requires_grad=True)
    ref = m(x)
    with te.autocast(recipe=te.recipe.NVFP4BlockScaling()):
        y = _seeded(lambda: m(x))
        y2 = _seeded(lambda: m(x))
    assert torch.equal(y, y2) and _sqnr_db(y, ref) > 10


def test_row_scaled_recipe_needs_backward_override():
    m = te.Linear(64, 16, params_dtype=torch.float32)
    x = torch.randn(32, 64)
    with (
        te.autocast(recipe=te.recipe.NVFP4BlockScaling(row_scaled_activation=True)),
        pytest.raises(ValueError, match=r"row_scaled_activation=True\) needs backward_override"),
    ):
        m(x)
    recipe = te.recipe.NVFP4BlockScaling(row_scaled_activation=True,
                                         backward_override="dequantized")  # fmt: skip
    with te.autocast(recipe=recipe):
        y = m(x)
    expected = F.linear(x, m.weight, m.bias, **with_specs(
        **NVFP4, weight_block_rows=16, row_scaled=True, rht=True, stochastic_rounding=True,
        rng_state=torch.tensor([0, 0]), backward_override="dequantized"))  # fmt: skip
    assert torch.equal(y, expected)


def test_grouped_linear_is_per_expert_dense_under_the_default_recipe():
    """GroupedLinear under NVFP4 (tiles, the transform, 4over6) is a dense te.Linear per expert
    (float64 definition); the default recipe (stochastic rounding too) runs, and the grouped
    op matches its own float64 reference with the same stream."""
    torch.manual_seed(0)
    m = te.GroupedLinear(2, 64, 32, params_dtype=torch.float32)
    x = torch.randn(48, 64, requires_grad=True)
    dy = torch.randn(48, 32)
    splits = [32, 16]
    recipe = te.recipe.NVFP4BlockScaling(disable_stochastic_rounding=True, nvfp4_4over6="all")
    with te.autocast(recipe=recipe):
        y = m(x, splits)
    y.backward(dy)
    row = 0
    spec = {"weight_block_rows": 16, "rht": True, "input_4over6": "MAE:256",
            "weight_4over6": "MAE:256"}  # fmt: skip
    for i, s in enumerate(splits):
        w = getattr(m, f"weight{i}")
        x64, w64 = to_reference(x[row : row + s].detach()).requires_grad_(), to_reference(w)
        ref = quantized_linear_ref(x64, w64, **with_specs(recipe="nvfp4", **spec))
        ref = ref + to_reference(getattr(m, f"bias{i}"))
        ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), to_reference(dy[row : row + s]))
        assert_close(y[row : row + s], ref, torch.float32)
        assert_close(x.grad[row : row + s], ref_dx, torch.float32)
        assert_close(w.grad, ref_dw, torch.float32, reduced=True)
        row += s
    with te.autocast(recipe=te.recipe.NVFP4BlockScaling()):
        torch.manual_seed(1)
        y1 = m(x, splits)
        torch.manual_seed(1)
        y2 = m(x, splits)
    assert torch.equal(y1, y2)
    w3 = torch.stack([m.weight0, m.weight1]).detach().requires_grad_()
    state = torch.tensor([5, 9])
    kw = {**NVFP4, **spec, "stochastic_rounding": True, "rng_state": state}
    out = F.grouped_linear(x.detach(), splits, w3, **with_specs(**kw))
    (da,) = torch.autograd.grad(out, (w3,), dy)
    from te_compile.functional.grouped_gemm import GroupedRecipe
    from te_compile.functional.grouped_linear_ops import _RefGrouped
    from te_compile.functional.spec import QuantSpec

    x_spec = QuantSpec("nvfp4", rht=True, four_over_six="MAE:256")
    w_spec = QuantSpec("nvfp4", block_rows=16, four_over_six="MAE:256")
    g_spec = QuantSpec("nvfp4", rht=True, stochastic_rounding=True)
    r = GroupedRecipe(x_spec, w_spec, g_spec, rng_state=state)
    w64 = to_reference(w3)
    ref = _RefGrouped.apply(to_reference(x.detach()), w64, splits, r)
    (ref_dw,) = torch.autograd.grad(ref, (w64,), to_reference(dy))
    assert_close(out, ref, torch.float32)
    assert_close(da, ref_dw, torch.float32, reduced=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        F.grouped_linear(x.detach(), [40, 8], w3, **with_specs(**NVFP4))


def test_te_quantize_tiles_weights_and_refuses_what_only_gemms_apply():
    x = torch.randn(64, 32)
    q = te.quantize(x, te.recipe.NVFP4BlockScaling(), role="weight", columnwise=True)
    assert q.block_rows == 16
    assert torch.equal(te.dequantize(q, torch.float32, columnwise=True),
                       te.dequantize(q, torch.float32).t())  # fmt: skip
    with pytest.raises(NotImplementedError, match="stochastic_rounding"):
        te.quantize(x, te.recipe.NVFP4BlockScaling(), role="grad")
    with pytest.raises(NotImplementedError, match="rht"):
        te.quantize(x, te.recipe.NVFP4BlockScaling(), role="input", columnwise=True)
    te.quantize(x, te.recipe.NVFP4BlockScaling(), role="input")  # rowwise: no transform


def _dense_per_expert(m: te.GroupedLinear, dtype: torch.dtype, **kw) -> list[te.Linear]:
    """A te.Linear per expert of ``m`` (``kw``: its arguments) with its weights and (random)
    biases."""
    k, n = m.in_features, m.out_features
    dense = [te.Linear(k, n, params_dtype=dtype, **kw) for _ in m.weights()]
    with torch.no_grad():
        for i, d in enumerate(dense):
            d.weight.copy_(getattr(m, f"weight{i}"))
            d.bias.copy_(getattr(m, f"bias{i}").normal_())
    return dense


def _grouped_and_dense_step(m, dense, x, dy, splits, recipe):
    """``(out, dx)`` of ``m`` and of ``dense`` on each expert's rows, under ``recipe`` (the
    same stochastic-rounding draws: one seed for both)."""
    xs = [x.clone().requires_grad_() for _ in range(2)]
    with te.autocast(recipe=recipe):
        torch.manual_seed(1)
        y = m(xs[0], splits)
        torch.manual_seed(1)
        y_dense = torch.cat([d(p) for d, p in zip(dense, xs[1].split(splits), strict=True)])
    y.backward(dy)
    y_dense.backward(dy)
    return (y, xs[0].grad), (y_dense, xs[1].grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_grouped_linear_row_scaled_is_a_dense_linear_per_expert(override, dtype):
    """GroupedLinear under row-scaled activations (every token's own global scale, whatever its
    expert) is a te.Linear per expert under the same recipe, bit for bit (Transformer Engine's
    test_grouped_linear_accuracy), and each expert its float64 reference; without a
    backward_override the recipe is refused as for Linear."""
    torch.manual_seed(0)
    splits, k, n = [32, 0, 48], 64, 32
    m = te.GroupedLinear(len(splits), k, n, params_dtype=dtype)
    dense = _dense_per_expert(m, dtype)
    x = (torch.randn(sum(splits), k) * torch.logspace(-6, 2, sum(splits))[:, None]).to(dtype)
    dy = torch.randn(sum(splits), n, dtype=dtype)
    plain = {"disable_rht": True, "disable_stochastic_rounding": True,
             "disable_2d_quantization": True, "row_scaled_activation": True}  # fmt: skip
    recipe = te.recipe.NVFP4BlockScaling(**plain, backward_override=override)
    grouped, per_expert = _grouped_and_dense_step(m, dense, x, dy, splits, recipe)
    assert all(torch.equal(a, b) for a, b in zip(grouped, per_expert, strict=True))
    y = grouped[0]
    row = 0
    for i, (s, d) in enumerate(zip(splits, dense, strict=True)):
        assert torch.equal(getattr(m, f"weight{i}").grad, d.weight.grad)
        assert torch.equal(getattr(m, f"bias{i}").grad, d.bias.grad)
        if s:
            x64 = to_reference(x[row : row + s])
            spec = with_specs(**NVFP4, row_scaled=True, backward_override=override)
            ref = quantized_linear_ref(x64, to_reference(d.weight), **spec)
            assert_close(y[row : row + s], ref + to_reference(d.bias), dtype)
        row += s
    with (
        te.autocast(recipe=te.recipe.NVFP4BlockScaling(**plain)),
        pytest.raises(ValueError, match=r"row_scaled_activation=True\) needs backward_override"),
    ):
        m(x, splits)
    w3 = torch.stack(m.weights()).detach()
    with pytest.raises(ValueError, match="a row_scaled input_spec needs backward"):
        F.grouped_linear(x, splits, w3, **with_specs(**NVFP4, row_scaled=True))


@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["grad", "main_grad"])
def test_grouped_linear_bf16_is_a_dense_linear_per_expert(fuse_wgrad):
    """In bf16 GroupedLinear under NVFP4 (16x16 tiles, the transform, its quantised backward)
    is a te.Linear per expert bit for bit: the dequantised operands stay fp32 on the CPU as the
    dense op keeps them (one rounding, of the GEMM's output), main_grad accumulation included."""
    torch.manual_seed(0)
    splits, k, n, bf16 = [16, 0, 48], 64, 32, torch.bfloat16
    m = te.GroupedLinear(len(splits), k, n, params_dtype=bf16, fuse_wgrad_accumulation=fuse_wgrad)
    dense = _dense_per_expert(m, bf16, fuse_wgrad_accumulation=fuse_wgrad)
    for i, d in enumerate(dense):
        if fuse_wgrad:
            w = getattr(m, f"weight{i}")
            w.main_grad = torch.rand_like(w, dtype=torch.float32)
            d.weight.main_grad = w.main_grad.clone()
    x, dy = torch.randn(sum(splits), k, dtype=bf16), torch.randn(sum(splits), n, dtype=bf16)
    recipe = te.recipe.NVFP4BlockScaling(disable_stochastic_rounding=True)
    grouped, per_expert = _grouped_and_dense_step(m, dense, x, dy, splits, recipe)
    assert all(torch.equal(a, b) for a, b in zip(grouped, per_expert, strict=True))
    for i, d in enumerate(dense):
        w = getattr(m, f"weight{i}")
        assert torch.equal(w.main_grad if fuse_wgrad else w.grad,
                           d.weight.main_grad if fuse_wgrad else d.weight.grad)  # fmt: skip
        assert torch.equal(getattr(m, f"bias{i}").grad, d.bias.grad)
