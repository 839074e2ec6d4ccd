"""Native FP8 blockwise grouped linear beyond the registry test (which checks it against the dense
op's reference, expert by expert): the same bytes as the dense native op on each expert, blocks
that restart at every expert, padding of ragged experts, main_grad, errors, and the module's
dispatch to it."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from te_compile import functional as F
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.quantization import gemm
from tests.utils import (
    DEVICES,
    assert_bits_equal,
    assert_close,
    compile_counted,
    requires_cuda,
    with_specs,
)

E4M3 = torch.float8_e4m3fn
E4 = {"fwd_dtype": E4M3, "bwd_dtype": E4M3}


def _block(x, splits, w, b=None, **kw):
    """The grouped family under Float8BlockScaling with native GEMMs (128x128 weight blocks
    unless ``weight_block_rows`` says otherwise)."""
    kw = {"recipe": "block", "weight_block_rows": 128, **E4, **kw}
    return F.grouped_linear(x, splits, w, b, **with_specs(**kw))


native_block = pytest.mark.skipif(
    torch.cuda.is_available() and not te.is_fp8_block_scaling_available(),
    reason="needs blockwise-scaled _scaled_mm (compute capability 9.0+, CUDA 12.9+)",
)


def _leaves(device, tokens, k, n, groups, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0):
        x = torch.randn(*shape, generator=g) * scale
        return x.to(device=device, dtype=torch.bfloat16).requires_grad_()

    return t(tokens, k), t(groups, n, k, scale=0.05), t(groups, n) if bias else None


def _grads(out, dy, *leaves):
    out.backward(dy)
    return [None if t is None else t.grad for t in leaves]


@native_block
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "splits, k, n, w_rows, power_2",
    [([32, 0, 160, 64], 256, 128, 1, True), ([128, 256], 512, 512, 128, False)],
    ids=["1x128", "128x128"],
)
def test_each_expert_is_the_dense_native_op(device, splits, k, n, w_rows, power_2):
    """Every expert's rows, output and gradients are bit for bit those of
    ``linear(recipe="block")`` (native GEMMs) on that expert alone (the same quantisation and GEMM
    calls: cuBLAS's on a GPU)."""
    x, w, b = _leaves(device, sum(splits), k, n, len(splits))
    kw = {"power_2_scale": power_2, "weight_block_rows": w_rows}
    out = _block(x, splits, w, b, **kw)
    dy = torch.randn_like(out)
    dx, dw, db = _grads(out, dy, x, w, b)
    row = 0
    for g, m in enumerate(splits):
        x_g = x.detach()[row : row + m].clone().requires_grad_()
        w_g = w.detach()[g].clone().requires_grad_()
        b_g = b.detach()[g].clone().requires_grad_()
        if m:
            ref = F.linear(x_g, w_g, b_g, **with_specs(recipe="block", **E4, **kw))
            assert_bits_equal(out[row : row + m], ref)
            assert_bits_equal(dx[row : row + m], _grads(ref, dy[row : row + m], x_g)[0])
            assert_bits_equal(dw[g], w_g.grad)
            assert_bits_equal(db[g], b_g.grad)
        else:  # an expert without tokens: zero weight and bias gradients
            assert not dw[g].any() and not db[g].any()
        row += m


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_experts_are_padded_on_their_own(device):
    """Experts of 17 and 45 tokens: each is padded with zero rows to a multiple of 16 in its own
    pass, which is the dense op on those padded rows (zero rows change no block)."""
    splits = [17, 45]
    x, w, b = _leaves(device, sum(splits), 128, 64, 2)
    out = _block(x, splits, w, b, weight_block_rows=1)
    dy = torch.randn_like(out)
    dx, dw, db = _grads(out, dy, x, w, b)
    row = 0
    for g, m in enumerate(splits):
        pad = -m % 16
        x_g = torch.nn.functional.pad(x.detach()[row : row + m], (0, 0, 0, pad)).requires_grad_()
        w_g = w.detach()[g].clone().requires_grad_()
        ref = F.linear(x_g, w_g, b.detach()[g], **with_specs(recipe="block", **E4))
        assert_bits_equal(out[row : row + m], ref[:m])
        ref.backward(torch.nn.functional.pad(dy[row : row + m], (0, 0, 0, pad)))
        assert_bits_equal(dx[row : row + m], x_g.grad[:m])
        assert_bits_equal(dw[g], w_g.grad)
        torch.testing.assert_close(db[g], dy[row : row + m].float().sum(0).to(db.dtype))
        row += m


@pytest.mark.parametrize("device", DEVICES)
def test_wgrad_blocks_start_at_each_expert(device):
    """Two experts of 64 tokens: one 128-token block along the tokens would hold both. Expert 0's
    tokens are 1e6 times larger; if its block scale reached expert 1's tokens they would fall
    into E4M3's subnormals. Expert 1's weight gradient keeps the error of its own blocks."""
    x, w, _ = _leaves(device, 128, 128, 64, 2, bias=False)
    with torch.no_grad():
        x[:64] *= 1e6
    out = _block(x, [64, 64], w, weight_block_rows=1)
    dy = torch.randn_like(out)
    (dw,) = _grads(out, dy, w)
    exact = dy[64:].double().t() @ x.detach()[64:].double()
    err = (dw[1].double() - exact).norm() / exact.norm()
    assert err < 0.06, f"relative error {err:.3f}: the wgrad blocks crossed experts"


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_accumulates(device):
    """With main_grad (fp32) the weight gradient is added to it, twice, and not returned."""
    splits = [16, 48]
    x, w, _ = _leaves(device, 64, 64, 32, 2, bias=False)
    out = _block(x, splits, w, weight_block_rows=1)
    (dw,) = _grads(out, torch.ones_like(out), w)
    main_grad = torch.ones(w.shape, device=device)
    w2 = w.detach().requires_grad_()
    for _ in range(2):
        y = _block(x.detach(), splits, w2, weight_block_rows=1, main_grad=main_grad)
        y.backward(torch.ones_like(y))
    assert w2.grad is None
    torch.testing.assert_close(main_grad, 1 + 2 * dw.float(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_argument(device):
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(2, 32, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"te\.grouped_linear: weight_spec 'block:e4m3:16x16': "
                       "blocks of 16 rows are not implemented"):  # fmt: skip
        F.grouped_linear(x, [16, 16], w, input_spec="block:e4m3", weight_spec="block:e4m3:16x16",
                         grad_spec="block:e4m3")  # fmt: skip
    with pytest.raises(ValueError, match="multiples of 512"):
        _block(x, [16, 16], w)  # 128x128 weight blocks by default
    with pytest.raises(ValueError, match=r"te.grouped_linear: .*multiples of 16"):
        _block(x[:, :40], [16, 16], w[..., :40], weight_block_rows=1)
    with pytest.raises(ValueError, match=r"sum to inp\.shape"):
        _block(x, [16, 8], w, weight_block_rows=1)
    with pytest.raises(ValueError, match="m_splits has 3 groups"):
        _block(x, [16, 8, 8], w, weight_block_rows=1)


# The block-scaled kinds, each on a path of its own: native Float8BlockScaling (its GEMMs
# emulated off a GPU), the emulated one with 128x128 weight blocks, MXFP8, NVFP4 (16x16 tiles).
OVERRIDE_SPECS = {
    "block": {"recipe": "block", **E4},
    "block_emulated": {"recipe": "block", **E4, "weight_block_rows": 128, "emulate": True},
    "mxfp8": {"recipe": "mxfp8", "emulate": True},
    "nvfp4": {"recipe": "nvfp4", "emulate": True, "weight_block_rows": 16},
}


@native_block
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", OVERRIDE_SPECS)
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_override_is_the_dense_ops_per_expert(device, kind, override):
    """``backward_override``: every expert's gradients are bit for bit those of ``te.linear``
    with the same specs and override on that expert's tokens alone (the forward's operands are
    quantised per expert as the dense op quantises them), and match its float64 reference
    (``quantized_linear_ref``); the forward is the recipe's, bit for bit."""
    splits = [32, 0, 64]
    x, w, b = _leaves(device, sum(splits), 128, 64, 3)
    specs = with_specs(**OVERRIDE_SPECS[kind])
    out = F.grouped_linear(x, splits, w, b, **specs, backward_override=override)
    assert_bits_equal(out, F.grouped_linear(x.detach(), splits, w.detach(), b.detach(), **specs))
    dy = torch.randn_like(out)
    dx, dw, db = _grads(out, dy, x, w, b)
    row = 0
    for g, m in enumerate(splits):
        rows = slice(row, row + m)
        x_g, w_g, b_g = (t.detach().clone().requires_grad_() for t in (x[rows], w[g], b[g]))
        if m:
            F.linear(x_g, w_g, b_g, **specs, backward_override=override).backward(dy[rows])
            assert_bits_equal(dx[rows], x_g.grad)
            assert_bits_equal(dw[g], w_g.grad)
            assert_bits_equal(db[g], b_g.grad)
            x64, w64 = (t.detach().cpu().double().requires_grad_() for t in (x_g, w_g))
            ref = quantized_linear_ref(x64, w64, **specs, backward_override=override)
            ref.backward(dy[rows].cpu().double())
            assert_close(dx[rows], x64.grad, torch.bfloat16, roundings=2, reduced=True)
            assert_close(dw[g], w64.grad, torch.bfloat16, roundings=2, reduced=True)
        else:  # an expert without tokens: zero weight and bias gradients
            assert not dw[g].any() and not db[g].any()
        row += m


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_without_graph_breaks(device):
    """Under torch.compile(fullgraph=True) with list and tensor splits: the eager bytes."""
    x, w, b = _leaves(device, 80, 64, 32, 3)
    splits = [16, 0, 64]

    def step(x, splits, w, b):
        return _block(x, splits, w, b, weight_block_rows=1)

    eager = step(x, splits, w, b)
    compiled, counter = compile_counted(step)
    assert_bits_equal(compiled(x, splits, w, b), eager)
    assert_bits_equal(compiled(x, torch.tensor(splits), w, b), eager)
    assert counter.frame_count >= 1


@requires_cuda
@native_block
def test_module_runs_the_native_op_under_float8_block_scaling():
    """GroupedLinear under Float8BlockScaling (1x128 weight blocks) on a GPU: the native grouped
    op, the same bytes as calling it; with quantization.gemm._NATIVE_BLOCK = False the emulation."""
    torch.manual_seed(0)
    m = te.GroupedLinear(
        2, 256, 128, single_grouped_parameter=True, params_dtype=torch.bfloat16, device="cuda"
    )
    x = torch.randn(96, 256, device="cuda", dtype=torch.bfloat16)
    splits = [32, 64]
    recipe = te.recipe.Float8BlockScaling(w_block_scaling_dim=1)
    with te.autocast(recipe=recipe):
        y = m(x, splits)
    power_2 = not recipe.use_f32_scales  # Transformer Engine's default: power-of-two scales
    direct = _block(x, splits, m.weight, m.bias, power_2_scale=power_2, weight_block_rows=1)
    assert_bits_equal(y, direct)
    from unittest import mock

    with mock.patch.object(gemm, "_NATIVE_BLOCK", False), te.autocast(recipe=recipe):
        emulated = m(x, splits)
    assert_close(emulated, y.double(), y.dtype, roundings=2, reduced=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "kind, fp8, rows, power_2",
    [("block", E4M3, 1, True), ("block", torch.float8_e5m2, 128, False),
     ("mxfp8", E4M3, 1, False), ("mxfp8", torch.float8_e5m2, 1, False)],
    ids=["block_1x128_p2", "block_128x128_e5m2", "mxfp8_e4m3", "mxfp8_e5m2"],
)  # fmt: skip
def test_emulated_casts_are_te_quantize_bytes(dtype, kind, fp8, rows, power_2):
    """The emulated grouped GEMMs' casts (the dense family's quantiser table, rowwise copy,
    dequantised to the input dtype) are ``te.quantize`` then ``te.dequantize`` bit for bit,
    values at the dtype's largest included (saturated, not infinite)."""
    from te_compile.functional.fake_quantize_ops import qdq
    from te_compile.functional.grouped_gemm import GroupedRecipe, _cast
    from te_compile.functional.spec import QuantSpec

    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 100
    x[0, :3], x[1, 0] = torch.finfo(dtype).max, -torch.finfo(dtype).max
    x = x.to(dtype)
    spec = QuantSpec(kind, fp8, rows, power_2, emulate=True)
    recipe = GroupedRecipe(spec, spec, spec)
    assert_bits_equal(_cast(x, recipe, fp8, rows), qdq(x, kind, fp8, rows, power_2))
