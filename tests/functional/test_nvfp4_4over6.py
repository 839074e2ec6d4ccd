"""NVFP4's 4over6 adaptive block scaling (``NVFP4BlockScaling(nvfp4_4over6=...)``,
``functional.quantize_mx_ref.nvfp4_qdq``'s ``four_over_six``, ``te::linear``'s ``input_4over6`` /
``weight_4over6``) against a float64 reference of the quantiser, per error metric and scope."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from te_compile import functional as F
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.functional.quantize_mx_ref import (
    dequantize_nvfp4_ref,
    nvfp4_qdq,
    quantize_nvfp4_ref,
)
from tests.utils import assert_close, compile_counted, to_reference, with_specs

E4M3 = torch.float8_e4m3fn
NVFP4 = {"recipe": "nvfp4", "emulate": True, "fwd_dtype": E4M3, "bwd_dtype": E4M3}
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _candidate64(xb: torch.Tensor, s_hp: torch.Tensor, g: float) -> torch.Tensor:
    """float64 dequantised values of the blocks ``xb`` ``[B, 16]`` with the E4M3-rounded block
    scales ``s_hp`` ``[B]`` (nearest E2M1 point of ``|x| g / s``, saturated to 6)."""
    s = s_hp.clamp(max=448).float().to(E4M3).double()
    scaled = (xb.abs() * g / s[:, None]).clamp(max=6)
    q = GRID[(scaled[..., None] - GRID).abs().argmin(-1)]
    return torch.where(s[:, None] == 0, 0.0, torch.sign(xb) * q * s[:, None] / g)


def four_over_six_ref(x: torch.Tensor, err_mode: str, bound: float):
    """``(values, picked_four)``: 1x16 blocks of ``x`` ``[M, K]`` in float64, each block's
    candidate of lower error (map its amax to 4 where strictly lower, else to 6)."""
    amax = x.abs().max().float()
    g = float(torch.tensor(bound * 6, dtype=torch.float32) / amax)
    xb = x.double().reshape(-1, 16)
    s6 = xb.abs().amax(-1) * g / 6
    v6, v4 = _candidate64(xb, s6, g), _candidate64(xb, s6 * 1.5, g)

    def err(v):
        d = v - xb
        return (d.abs() if err_mode == "MAE" else d * d).sum(-1)

    four = err(v4) < err(v6)
    return torch.where(four[:, None], v4, v6).reshape(x.shape), four


@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
@pytest.mark.parametrize("bound", [448, 256])
def test_quantiser_matches_the_float64_reference(err_mode, bound):
    torch.manual_seed(0)
    x = torch.randn(32, 64) * torch.logspace(-2, 2, 32)[:, None]
    row, col_t = nvfp4_qdq(x, four_over_six=f"{err_mode}:{bound}")
    expected, four = four_over_six_ref(x, err_mode, bound)
    assert_close(row, expected, torch.float32)
    assert 0 < four.sum() < four.numel()  # both candidates win somewhere
    expected_t, _ = four_over_six_ref(x.t().contiguous(), err_mode, bound)
    assert_close(col_t, expected_t, torch.float32)


def test_each_block_keeps_the_better_candidate():
    """Block A (3, 2.25, ...) is exact mapped to 4 and not to 6; block B (3, 0.5, ...) the
    other way round. The first block (amax 6) fixes the global scale at 256 * 6 / 6."""
    a = torch.tensor([3.0] + [2.25] * 15)
    b = torch.tensor([3.0] + [0.5] * 15)
    x = torch.stack([torch.tensor([6.0] + [0.0] * 15), a, b])
    for mode in ("MAE", "MSE"):
        row, _ = nvfp4_qdq(x, columnwise=False, four_over_six=f"{mode}:256")
        assert torch.equal(row[1], a) and torch.equal(row[2], b)
    plain, _ = nvfp4_qdq(x, columnwise=False)
    assert not torch.equal(plain[1], a) and torch.equal(plain[2], b)


@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
def test_error_is_never_larger_than_the_plain_quantisation(err_mode):
    torch.manual_seed(1)
    x = torch.randn(64, 128) * torch.rand(64, 1) * 10
    fos, _ = nvfp4_qdq(x, columnwise=False, four_over_six=f"{err_mode}:448")
    plain, _ = nvfp4_qdq(x, columnwise=False)  # the same global scale: plain is the 6 candidate

    def block_err(v):
        d = (v.double() - x.double()).reshape(-1, 16)
        return (d.abs() if err_mode == "MAE" else d * d).sum(-1)

    assert (block_err(fos) <= block_err(plain)).all()
    assert (block_err(fos) < block_err(plain)).any()


def test_tiles_choose_per_tile_and_keep_both_copies_equal():
    torch.manual_seed(2)
    x = torch.randn(48, 32) * torch.logspace(-1, 1, 48)[:, None]
    row, col_t = nvfp4_qdq(x, tiles=True, four_over_six="MSE:256")
    assert torch.equal(col_t, row.t())
    data, scale, g, data_t, scale_t = quantize_nvfp4_ref(x, tiles=True, four_over_six="MSE:256")
    per_tile = scale.float().view(3, 16, 2)
    assert torch.equal(per_tile, per_tile[:, :1].expand(3, 16, 2))  # one scale per tile
    assert torch.equal(dequantize_nvfp4_ref(data, scale, g, torch.float32), row)
    assert torch.equal(dequantize_nvfp4_ref(data_t, scale_t, g, torch.float32), row.t())


# The recipe's scopes: which operands of te.Linear use 4over6 --------------------------------

SCOPES = [
    ({"nvfp4_4over6": "weights"}, "", "MAE:256"),
    ({"nvfp4_4over6": "activations", "nvfp4_4over6_err_mode": "MSE"}, "MSE:256", ""),
    ({"nvfp4_4over6": "all", "nvfp4_4over6_e4m3_use_256": "weights"}, "MAE:448", "MAE:256"),
    ({"nvfp4_4over6": "all", "nvfp4_4over6_e4m3_use_256": "none"}, "MAE:448", "MAE:448"),
]


@pytest.mark.parametrize(("fields", "input_spec", "weight_spec"), SCOPES)
def test_scopes_reach_the_right_operands_of_te_linear(fields, input_spec, weight_spec):
    torch.manual_seed(3)
    m = te.Linear(64, 32, params_dtype=torch.float32)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 32)
    recipe = te.recipe.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                         **fields)  # fmt: skip
    with te.autocast(recipe=recipe):
        y = m(x)
    dx, dw = torch.autograd.grad(y, (x, m.weight), dy)
    x2 = x.detach().requires_grad_()
    w2 = m.weight.detach().requires_grad_()
    expected = F.linear(x2, w2, m.bias.detach(), **with_specs(**NVFP4, weight_block_rows=16,
                        input_4over6=input_spec, weight_4over6=weight_spec))  # fmt: skip
    e_dx, e_dw = torch.autograd.grad(expected, (x2, w2), dy)
    assert torch.equal(y, expected) and torch.equal(dx, e_dx) and torch.equal(dw, e_dw)
    # ... and the float64 definition, the gradient's quantisation without 4over6.
    x64, w64 = to_reference(x2), to_reference(w2)
    spec = with_specs(recipe="nvfp4", weight_block_rows=16, input_4over6=input_spec,
                      weight_4over6=weight_spec)  # fmt: skip
    ref = quantized_linear_ref(x64, w64, **spec)
    ref = ref + to_reference(m.bias)
    r_dx, r_dw = torch.autograd.grad(ref, (x64, w64), to_reference(dy))
    assert_close(y, ref, torch.float32)
    assert_close(dx, r_dx, torch.float32)
    assert_close(dw, r_dw, torch.float32, reduced=True)
    if input_spec or weight_spec:  # 4over6 changes the GEMM
        plain = F.linear(x2, w2, m.bias.detach(), **with_specs(**NVFP4, weight_block_rows=16))
        assert not torch.equal(plain, expected)


def test_4over6_with_the_default_options_and_compiled():
    """4over6 with the transform of the input's wgrad copy and stochastic rounding of the
    gradient (the recipe's defaults), eager and compiled (one graph)."""
    torch.manual_seed(4)
    m = te.Linear(64, 32, params_dtype=torch.float32)
    x = torch.randn(32, 64)
    recipe = te.recipe.NVFP4BlockScaling(nvfp4_4over6="all", nvfp4_4over6_err_mode="MSE")

    def step(inp):
        with te.autocast(recipe=recipe):
            return m(inp)

    torch.manual_seed(5)
    eager = step(x)
    compiled, counter = compile_counted(step, backend="aot_eager")
    torch.manual_seed(5)
    out = compiled(x)
    assert counter.frame_count == 1
    assert torch.equal(out, eager)
    expected = F.linear(x, m.weight, m.bias, **with_specs(**NVFP4, weight_block_rows=16,
                        input_4over6="MSE:256", weight_4over6="MSE:256"))  # fmt: skip
    assert torch.equal(eager, expected)


def test_te_quantize_and_the_mlp_follow_the_scopes():
    torch.manual_seed(6)
    w = torch.randn(32, 64)
    recipe = te.recipe.NVFP4BlockScaling(nvfp4_4over6="weights", disable_rht=True,
                                         disable_stochastic_rounding=True)  # fmt: skip
    q = te.quantize(w, recipe, role="weight", columnwise=True)
    amax = w.abs().max()
    assert torch.equal(q.global_scale, torch.tensor(256 * 6.0) / amax)
    row, _ = nvfp4_qdq(w, tiles=True, four_over_six="MAE:256")
    assert torch.equal(te.dequantize(q, torch.float32), row)
    g = te.quantize(w, recipe, role="grad")  # gradients never use 4over6
    assert torch.equal(g.global_scale, torch.tensor(448 * 6.0) / amax)
    mlp = te.LayerNormMLP(64, 64, params_dtype=torch.float32)
    x = torch.randn(32, 64)
    with te.autocast(recipe=recipe):
        y = mlp(x)
        h = te.LayerNorm(64, params_dtype=torch.float32)
        h.load_state_dict({"weight": mlp.layer_norm_weight, "bias": mlp.layer_norm_bias})
        spec = with_specs(**NVFP4, weight_block_rows=16, weight_4over6="MAE:256")
    a = F.linear(h(x), mlp.fc1_weight, mlp.fc1_bias, **spec)
    expected = F.linear(torch.nn.functional.gelu(a, approximate="tanh"), mlp.fc2_weight,
                        mlp.fc2_bias, **spec)  # fmt: skip
    assert_close(y, expected.double(), torch.float32, roundings=4)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"input_4over6": "MAE"}, "input_spec 'nvfp4:emulate:4over6=MAE': 4over6 must be one"),
        ({"weight_4over6": "MSE:300"}, "weight_spec 'nvfp4:emulate:4over6=MSE/300': 4over6"),
    ],
)
def test_bad_4over6_arguments_raise(kw, message):
    x, w = torch.randn(32, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match=message):
        F.linear(x, w, **with_specs(**NVFP4, **kw))
    with pytest.raises(ValueError, match="four_over_six: not an option of input operands"):
        F.linear(x, w, **with_specs(recipe="current", input_4over6="MAE:448"))
    # Compiled, the op's fake impl raises the same ValueError inside dynamo's wrapper.
    with pytest.raises(Exception, match=message):
        torch.compile(lambda a, b: F.linear(a, b, **with_specs(**NVFP4, **kw)), backend="aot_eager",
                      fullgraph=True)(x, w)  # fmt: skip
