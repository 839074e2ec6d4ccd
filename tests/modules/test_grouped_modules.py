"""GroupedLinear and GroupedMLP: against a loop of te.Linear and float64 references, both
parameter layouts, state_dict conversion between them, fused weight-gradient accumulation, GLU
interleaving, and argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as torch_F
from torch import nn

import te_compile as te
from te_compile.modules import convert_glu_layout
from tests.utils import (
    DEVICES,
    assert_bits_equal,
    assert_close,
    behaviour_backend,
    chain_roundings,
    compile_counted,
    to_reference,
)

DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = [False, True]
LAYOUT_IDS = ["default", "single"]


def cuda_adds_bias_after_rounding(device, bias):
    """On CUDA the bias is added to the GEMM's rounded output (grouped GEMM and per-group loop):
    one more rounding, relative to the GEMM output rather than to the sum, which can cancel."""
    return bias and device == "cuda"


def main_grad_dtype(device, dtype):
    """Accuracy of main_grad: fp32, except on the CUDA grouped-GEMM path (bf16, these shapes),
    where torch._grouped_mm rounds dW to bf16 before it is accumulated in fp32."""
    return dtype if device == "cuda" and dtype is torch.bfloat16 else torch.float32


def _random_params(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)


def _grouped_weights(m):
    """``[num_gemms, out, in]`` weight and ``[num_gemms, out]`` bias (or None), either layout."""
    biases = m.biases()
    return torch.stack(m.weights()), None if biases is None else torch.stack(biases)


def _weight_grads(m):
    if m.single_grouped_parameter:
        return m.weight.grad
    return torch.stack([getattr(m, f"weight{i}").grad for i in range(m.num_gemms)])


def _bias_grads(m):
    if m.single_grouped_parameter:
        return m.bias.grad
    return torch.stack([getattr(m, f"bias{i}").grad for i in range(m.num_gemms)])


# 1. GroupedLinear against a loop of te.Linear ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("single", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("bias", [True, False])
def test_grouped_linear_equals_loop_of_linear(device, dtype, single, bias):
    splits = [3, 0, 5, 2]
    m = te.GroupedLinear(
        4, 16, 8, bias=bias, single_grouped_parameter=single, params_dtype=dtype, device=device
    )
    _random_params(m)
    linears = []
    for w, b in zip(m.weights(), m.biases() or [None] * 4, strict=True):
        lin = te.Linear(16, 8, bias=bias, params_dtype=dtype, device=device)
        with torch.no_grad():
            lin.weight.copy_(w)
            if bias:
                lin.bias.copy_(b)
        linears.append(lin)
    x = torch.randn(10, 16, device=device, dtype=dtype, requires_grad=True)
    x_loop = x.detach().clone().requires_grad_()
    y = m(x, splits)
    y_loop = torch.cat([lin(x_g) for lin, x_g in zip(linears, x_loop.split(splits), strict=True)])
    dy = torch.randn_like(y)
    y.backward(dy)
    y_loop.backward(dy)
    # Both are rounded once from an exact value: they may differ by one rounding each.
    extra = cuda_adds_bias_after_rounding(device, bias)
    assert_close(y, y_loop, dtype, roundings=chain_roundings(dtype, 2 + extra), reduced=extra)
    assert_close(x.grad, x_loop.grad, dtype, roundings=2)
    for g, lin in enumerate(linears):
        # A Linear that saw no rows gets no gradient; the grouped layer's is exactly zero.
        expected_w = lin.weight.grad if splits[g] else torch.zeros_like(lin.weight)
        assert_close(_weight_grads(m)[g], expected_w, dtype, roundings=2, reduced=True)
        if bias:
            expected_b = lin.bias.grad if splits[g] else torch.zeros_like(lin.bias)
            assert_close(_bias_grads(m)[g], expected_b, dtype, roundings=2, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_default_layout_grads_are_per_parameter_and_correct(device, dtype):
    splits = torch.tensor([4, 2, 0])
    m = te.GroupedLinear(3, 8, 16, params_dtype=dtype, device=device)
    _random_params(m)
    names = [n for n, _ in m.named_parameters()]
    assert names == ["weight0", "bias0", "weight1", "bias1", "weight2", "bias2"]
    x = torch.randn(6, 8, device=device, dtype=dtype, requires_grad=True)
    y = m(x, splits)
    dy = torch.randn_like(y)
    y.backward(dy)
    x_ref, dy_ref = to_reference(x), to_reference(dy)
    rows = x_ref.split(splits.tolist())
    drows = dy_ref.split(splits.tolist())
    for i in range(3):
        w, b = getattr(m, f"weight{i}"), getattr(m, f"bias{i}")
        assert w.grad.shape == w.shape == (16, 8) and b.grad.shape == b.shape == (16,)
        assert w.grad.dtype == dtype
        assert_close(w.grad, drows[i].t() @ rows[i], dtype, reduced=True)
        assert_close(b.grad, drows[i].sum(0), dtype, reduced=True)
    # A second backward accumulates into every parameter's own .grad.
    first = [p.grad.clone() for p in m.parameters()]
    m(x, splits).backward(dy)
    for p, g in zip(m.parameters(), first, strict=True):
        assert torch.equal(p.grad, 2 * g)


# 2. state_dict between the layouts -----------------------------------------------------------


@pytest.mark.parametrize("src_single", LAYOUTS, ids=["from_default", "from_single"])
@pytest.mark.parametrize("dst_single", LAYOUTS, ids=["to_default", "to_single"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("nested", [False, True], ids=["top", "nested"])
def test_state_dict_round_trip_across_layouts(src_single, dst_single, bias, nested):
    def make(single):
        m = te.GroupedLinear(3, 8, 4, bias=bias, single_grouped_parameter=single)
        return (nn.Sequential(nn.Identity(), m), m) if nested else (m, m)

    src_root, src = make(src_single)
    _random_params(src)
    dst_root, dst = make(dst_single)
    prefix = "1." if nested else ""

    state = src_root.state_dict()
    if src_single:
        expected_keys = [prefix + "weight", *([prefix + "bias"] if bias else [])]
    else:
        expected_keys = [
            f"{prefix}{n}{i}" for i in range(3) for n in ("weight", "bias")[: 1 + bias]
        ]
    assert sorted(state) == sorted(expected_keys)
    before = dict(state)
    dst_root.load_state_dict(state)  # strict: no missing or unexpected keys
    assert dict(state).keys() == before.keys(), "loading must not rewrite the caller's dict"

    w_src, b_src = _grouped_weights(src)
    w_dst, b_dst = _grouped_weights(dst)
    assert torch.equal(w_dst, w_src)
    assert (b_dst is None) == (not bias) and (not bias or torch.equal(b_dst, b_src))
    x, splits = torch.randn(7, 8), [2, 5, 0]
    assert torch.equal(dst(x, splits), src(x, splits))

    # And back: the destination's own state_dict loads into a fresh source-layout module.
    back_root, back = make(src_single)
    back_root.load_state_dict(dst_root.state_dict())
    for a, b in zip(back.state_dict().values(), src.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("single_weight", "single_bias"), [(True, False), (False, True)], ids=["weight", "bias"]
)
def test_transformer_engine_layout_names_choose_weight_and_bias_separately(
    single_weight, single_bias
):
    """``single_grouped_weight`` / ``single_grouped_bias`` (Transformer Engine's names): one
    parameter for the weights or for the biases alone; the same results and gradients as the
    per-group layout, and state_dicts that load across the layouts."""
    m = te.GroupedLinear(
        3, 8, 4, single_grouped_weight=single_weight, single_grouped_bias=single_bias
    )
    names = [n for n, _ in m.named_parameters()]
    weights = ["weight"] if single_weight else ["weight0", "weight1", "weight2"]
    biases = ["bias"] if single_bias else ["bias0", "bias1", "bias2"]
    assert sorted(names) == sorted(weights + biases)
    assert (m.single_grouped_weight, m.single_grouped_bias) == (single_weight, single_bias)
    assert not m.single_grouped_parameter
    _random_params(m)
    ref = te.GroupedLinear(3, 8, 4)
    ref.load_state_dict(m.state_dict())  # converted to the per-group layout
    x, splits = torch.randn(7, 8, requires_grad=True), [2, 5, 0]
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = m(x, splits), ref(x_ref, splits)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(x.grad, x_ref.grad)
    w_grads = [m.weight.grad] if single_weight else [getattr(m, n).grad for n in weights]
    torch.testing.assert_close(torch.stack(w_grads).reshape(3, 4, 8), _weight_grads(ref))
    b_grads = [m.bias.grad] if single_bias else [getattr(m, n).grad for n in biases]
    torch.testing.assert_close(torch.stack(b_grads).reshape(3, 4), _bias_grads(ref))
    back = te.GroupedLinear(
        3, 8, 4, single_grouped_weight=single_weight, single_grouped_bias=single_bias
    )
    back.load_state_dict(ref.state_dict())
    assert torch.equal(back(x.detach(), splits), y.detach())
    with pytest.raises(ValueError, match="single_grouped_parameter=True is single_grouped_weight"):
        te.GroupedLinear(3, 8, 4, single_grouped_parameter=True, single_grouped_weight=False)
    with pytest.raises(ValueError, match="single_grouped_bias must be a bool"):
        te.GroupedLinear(3, 8, 4, single_grouped_bias="yes")


def test_3d_input_is_rows_and_keeps_its_leading_dims():
    """Transformer Engine's ``[seq, batch, hidden]`` input: its rows grouped by ``m_splits``."""
    m = te.GroupedLinear(2, 8, 4, single_grouped_parameter=True)
    x = torch.randn(3, 4, 8)
    y = m(x, [5, 7])
    assert y.shape == (3, 4, 4)
    assert torch.equal(y, m(x.reshape(12, 8), [5, 7]).reshape(3, 4, 4))


def test_state_dict_wrong_num_gemms_raises():
    state = te.GroupedLinear(2, 8, 4, single_grouped_parameter=True).state_dict()
    with pytest.raises(ValueError, match="expected dim 0 = num_gemms = 3"):
        te.GroupedLinear(3, 8, 4).load_state_dict(state)


# 3. Fused weight-gradient accumulation --------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("single", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fuse_wgrad_accumulation(device, dtype, single, compiled):
    m = te.GroupedLinear(
        3,
        16,
        8,
        single_grouped_parameter=single,
        fuse_wgrad_accumulation=True,
        params_dtype=dtype,
        device=device,
    )
    _random_params(m)
    buffer = m.allocate_main_grad()
    assert buffer.dtype == torch.float32 and buffer.shape == (3, 8, 16) and not buffer.any()
    if single:
        assert m.weight.main_grad is buffer
    else:
        for i, w in enumerate(m.weights()):
            assert w.main_grad.data_ptr() == buffer[i].data_ptr() and w.main_grad.shape == (8, 16)
    fn = compile_counted(m, backend="aot_eager")[0] if compiled else m
    splits = torch.tensor([5, 0, 4])
    x = torch.randn(9, 16, device=device, dtype=dtype)
    dy = torch.randn(9, 8, device=device, dtype=dtype)
    for _step in range(2):
        fn(x, splits).backward(dy)
    for w in m.weights() if not single else [m.weight]:
        assert w.grad is None, "with main_grad the weight gradient must not go to weight.grad"
    x_rows = to_reference(x).split(splits.tolist())
    dy_rows = to_reference(dy).split(splits.tolist())
    expected = torch.stack([d.t() @ r for d, r in zip(dy_rows, x_rows, strict=True)])
    # Accumulated in fp32 from dtype operands: fp32-accurate (but see main_grad_dtype).
    assert_close(buffer, 2 * expected, main_grad_dtype(device, dtype))
    assert_close(_bias_grads(m), 2 * torch.stack([d.sum(0) for d in dy_rows]), dtype)


@pytest.mark.parametrize("single", LAYOUTS, ids=LAYOUT_IDS)
def test_fuse_wgrad_accumulation_without_main_grad_raises(single):
    m = te.GroupedLinear(2, 8, 4, single_grouped_parameter=single, fuse_wgrad_accumulation=True)
    with pytest.raises(ValueError, match=r"allocate_main_grad\(\)"):
        m(torch.randn(3, 8), [1, 2])


def _per_weight_main_grads(m, initial):
    """Each ``weight{i}`` its own fp32 ``main_grad`` holding ``initial[i]`` (as Transformer
    Engine's tests and Megatron-LM's gradient buffers set them)."""
    for i, w in enumerate(m.weights()):
        w.main_grad = initial[i].clone()
    return [w.main_grad for w in m.weights()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fuse_wgrad_accumulation_per_weight_main_grad(device, dtype, compiled):
    """Default layout, each weight{i}.main_grad its own buffer (not allocate_main_grad's views):
    every one receives its own expert's weight gradient, added to what it held."""
    m = te.GroupedLinear(3, 16, 8, fuse_wgrad_accumulation=True, params_dtype=dtype,
                         device=device)  # fmt: skip
    _random_params(m)
    initial = [torch.rand(8, 16, device=device) for _ in range(3)]
    main_grads = _per_weight_main_grads(m, initial)
    fn, counter = compile_counted(m, backend=behaviour_backend()) if compiled else (m, None)
    splits = [5, 0, 4]
    x = torch.randn(9, 16, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(9, 8, device=device, dtype=dtype)
    for _step in range(2):
        fn(x, torch.tensor(splits)).backward(dy)
    if counter is not None:
        assert counter.frame_count == 1
    x_rows, dy_rows = to_reference(x).split(splits), to_reference(dy).split(splits)
    for i, (w, g) in enumerate(zip(m.weights(), main_grads, strict=True)):
        assert w.main_grad is g and w.grad is None
        expected = to_reference(initial[i]) + 2 * dy_rows[i].t() @ x_rows[i]
        # reduced: on CUDA in bf16 each dW is rounded before it is added (main_grad_dtype), an
        # error relative to dW's terms, not to the sum, which can cancel near zero.
        assert_close(g, expected, main_grad_dtype(device, dtype), reduced=True)
    assert_close(_bias_grads(m), 2 * torch.stack([d.sum(0) for d in dy_rows]), dtype)
    assert_close(x.grad, 2 * _loop_dgrad(m, dy_rows), dtype)


def _loop_dgrad(m, dy_rows):
    return torch.cat([d @ to_reference(w) for d, w in zip(dy_rows, m.weights(), strict=True)])


def test_fuse_wgrad_accumulation_replaced_main_grad():
    """After allocate_main_grad, a weight whose main_grad was replaced gets its gradient in the
    new tensor (not in the buffer's stale view)."""
    m = te.GroupedLinear(2, 8, 4, bias=False, fuse_wgrad_accumulation=True)
    buffer = m.allocate_main_grad()
    own = torch.zeros(4, 8)
    m.weight1.main_grad = own
    x, dy = torch.randn(5, 8), torch.randn(5, 4)
    m(x, [2, 3]).backward(dy)
    x_ref, dy_ref = to_reference(x), to_reference(dy)
    assert_close(buffer[0], dy_ref[:2].t() @ x_ref[:2], torch.float32)
    assert not buffer[1].any()
    assert_close(own, dy_ref[2:].t() @ x_ref[2:], torch.float32)


def test_fuse_wgrad_accumulation_per_weight_main_grad_delayed():
    """delay_wgrad_compute=True: backward_dw() adds each expert's gradient to its own
    main_grad (the backward leaves them untouched)."""
    m = te.GroupedLinear(3, 8, 4, fuse_wgrad_accumulation=True, delay_wgrad_compute=True)
    initial = [torch.rand(4, 8) for _ in range(3)]
    main_grads = _per_weight_main_grads(m, initial)
    splits = [2, 4, 1]
    x, dy = torch.randn(7, 8), torch.randn(7, 4)
    m(x, splits).backward(dy)
    for g, g0 in zip(main_grads, initial, strict=True):
        assert torch.equal(g, g0)
    m.backward_dw()
    x_rows, dy_rows = to_reference(x).split(splits), to_reference(dy).split(splits)
    for i, (w, g) in enumerate(zip(m.weights(), main_grads, strict=True)):
        assert w.grad is None
        assert_close(g, to_reference(initial[i]) + dy_rows[i].t() @ x_rows[i], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["eager", "compiled", "delayed_wgrad"])
def test_per_weight_main_grad_equals_linears_bit_for_bit(dtype, mode):
    """Transformer Engine's test_grouped_linear_accuracy with fuse_wgrad_accumulation on the
    CPU: each weight{i}.main_grad its own tensor holding values, and a te.Linear per expert with
    the same weight and a copy of that main_grad: the grouped GEMM accumulates each expert's
    gradient into its main_grad's values as the Linear does (one GEMM adding into them, not a
    product rounded and then added), so the two are equal bit for bit."""
    delay = mode == "delayed_wgrad"
    m = te.GroupedLinear(3, 64, 48, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay,
                         params_dtype=dtype)  # fmt: skip
    _random_params(m)
    initial = [torch.rand(48, 64) * 100 for _ in range(3)]
    main_grads = _per_weight_main_grads(m, initial)
    linears = []
    for w, g0 in zip(m.weights(), initial, strict=True):
        lin = te.Linear(64, 48, fuse_wgrad_accumulation=True, params_dtype=dtype)
        lin.weight = nn.Parameter(w.detach().clone())
        lin.bias = nn.Parameter(torch.zeros(48, dtype=dtype))
        lin.weight.main_grad = g0.clone()
        linears.append(lin)
    # Hundreds of tokens in an expert: the CPU GEMM then adds partial sums along the tokens
    # into main_grad (a product rounded first and then added differs in the last bit).
    splits = [384, 0, 1152]
    x = torch.randn(1536, 64, dtype=dtype, requires_grad=True)
    x_loop = x.detach().clone().requires_grad_()
    dy = torch.randn(1536, 48, dtype=dtype)
    fn = torch.compile(m, backend="aot_eager", fullgraph=True) if mode == "compiled" else m
    fn(x, splits).backward(dy)
    if delay:
        m.backward_dw()
    y_loop = torch.cat([lin(x_g) for lin, x_g in zip(linears, x_loop.split(splits), strict=True)])
    y_loop.backward(dy)
    assert torch.equal(x.grad, x_loop.grad)
    for g, lin in zip(main_grads, linears, strict=True):
        assert torch.equal(g, lin.weight.main_grad)
    assert not torch.equal(main_grads[0], initial[0])


@pytest.mark.parametrize("recipe", ["mxfp8", "block"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_emulated_block_recipes_equal_linears_bit_for_bit(recipe, dtype, fuse):
    """MXFP8BlockScaling and Float8BlockScaling (emulated on the CPU): GroupedLinear gives what a
    te.Linear per expert gives, bit for bit (Transformer Engine's test_grouped_linear_accuracy):
    the dgrad GEMM takes the weight quantised along out_features, the wgrad GEMM the gradient
    and the input quantised along each expert's own tokens (splits that are not multiples of
    the 32 / 128-row blocks: no block straddles two experts), each GEMM the dense one."""
    make = {"mxfp8": te.recipe.MXFP8BlockScaling, "block": te.recipe.Float8BlockScaling}
    m = te.GroupedLinear(3, 64, 96, bias=True, fuse_wgrad_accumulation=fuse, params_dtype=dtype)
    _random_params(m)
    initial = [torch.rand(96, 64) for _ in range(3)]
    if fuse:
        _per_weight_main_grads(m, initial)
    linears = []
    for i, (w, b) in enumerate(zip(m.weights(), m.biases(), strict=True)):
        lin = te.Linear(64, 96, fuse_wgrad_accumulation=fuse, params_dtype=dtype)
        lin.weight, lin.bias = nn.Parameter(w.detach().clone()), nn.Parameter(b.detach().clone())
        if fuse:
            lin.weight.main_grad = initial[i].clone()
        linears.append(lin)
    # Float8BlockScaling: experts that start inside a 128-row block (MXFP8's dense GEMM needs
    # tokens in multiples of 32, so its experts start on a block).
    splits = [48, 0, 80] if recipe == "block" else [64, 0, 64]
    x = torch.randn(128, 64, dtype=dtype, requires_grad=True)
    x_loop = x.detach().clone().requires_grad_()
    dy = torch.randn(128, 96, dtype=dtype) * torch.logspace(-2, 2, 128, dtype=dtype)[:, None]
    with te.autocast(recipe=make[recipe]()):
        y = m(x, splits)
        y_loop = torch.cat(
            [lin(x_g) for lin, x_g in zip(linears, x_loop.split(splits), strict=True)]
        )
    y.backward(dy)
    y_loop.backward(dy)
    assert torch.equal(y, y_loop)
    assert torch.equal(x.grad, x_loop.grad)
    for w, lin in zip(m.weights(), linears, strict=True):
        if fuse:
            assert torch.equal(w.main_grad, lin.weight.main_grad)
        elif lin.weight.grad is not None:  # a Linear that saw no rows gets no gradient
            assert torch.equal(w.grad, lin.weight.grad)


@pytest.mark.parametrize("wanted", ["bias", "weights"])
def test_emulated_block_recipe_partial_backward(wanted):
    """MXFP8 (emulated): a backward that wants the bias gradient alone (frozen weights, an
    input without grad), or the weights' without the input's, gives what the full one gives."""
    torch.manual_seed(0)
    m = te.GroupedLinear(3, 64, 32, params_dtype=torch.bfloat16)
    _random_params(m)
    x, dy = torch.randn(96, 64, dtype=torch.bfloat16), torch.randn(96, 32, dtype=torch.bfloat16)
    with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
        m(x.clone().requires_grad_(), [32, 0, 64]).backward(dy)
        full = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        if wanted == "bias":
            for w in m.weights():
                w.requires_grad_(False)
        m(x, [32, 0, 64]).backward(dy)
    for n, p in m.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.grad, full[n]), n


@pytest.mark.parametrize("recipe", ["current", "delayed", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("delay", [False, True], ids=["now", "delayed_wgrad"])
def test_per_weight_main_grad_equals_one_buffer_under_recipes(recipe, delay):
    """Transformer Engine's test_grouped_linear_accuracy(_save_original_input) setting: each
    weight{i}.main_grad its own tensor, under an FP8 recipe, with delay_wgrad_compute and
    save_original_input (not under DelayedScaling, which refuses it): bit for bit the
    allocate_main_grad buffer's accumulation (the same op into a zeroed buffer, then added)."""
    recipes = {
        "current": te.recipe.Float8CurrentScaling(),
        "delayed": te.recipe.DelayedScaling(),
        "mxfp8": te.recipe.MXFP8BlockScaling(),
        "nvfp4": te.recipe.NVFP4BlockScaling(),
    }
    kw = {
        "fuse_wgrad_accumulation": True,
        "delay_wgrad_compute": delay,
        "save_original_input": recipe != "delayed",
        "params_dtype": torch.bfloat16,
    }
    splits = [32, 0, 48]
    x = torch.randn(80, 64, dtype=torch.bfloat16)
    dy = torch.randn(80, 32, dtype=torch.bfloat16)
    results = []
    for own in (False, True):
        torch.manual_seed(0)
        m = te.GroupedLinear(3, 64, 32, **kw)
        if own:
            main_grads = _per_weight_main_grads(m, [torch.zeros(32, 64)] * 3)
        else:
            main_grads = list(m.allocate_main_grad().unbind(0))
        torch.manual_seed(1)  # NVFP4's stochastic rounding of the gradient
        with te.autocast(recipe=recipes[recipe]):
            out = m(x.clone().requires_grad_(), splits)
        out.backward(dy)
        if delay:
            m.backward_dw()
        assert all(w.grad is None for w in m.weights())
        results.append(torch.stack(main_grads))
    assert results[1].any()
    assert_bits_equal(results[1], results[0])


_OVERRIDE_RECIPES = {
    "current": te.recipe.Float8CurrentScaling,
    "block": te.recipe.Float8BlockScaling,
    "mxfp8": te.recipe.MXFP8BlockScaling,
    "nvfp4": te.recipe.NVFP4BlockScaling,
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
@pytest.mark.parametrize("recipe", _OVERRIDE_RECIPES)
def test_grouped_linear_backward_override(recipe, override, compiled):
    """A recipe's ``backward_override`` on GroupedLinear, eager and compiled (fullgraph, one
    graph): the gradients are bit for bit those of a te.Linear per group under the same recipe
    where the backward's operands are the same: every recipe with "high_precision" (the
    high-precision input and weight), the block-scaled ones with "dequantized" (quantised per
    expert as the dense op quantises them); current scaling's grouped GEMM scales per row where
    te.Linear scales per tensor (tests/functional/test_grouped_linear_fp8.py checks it against
    float64). Without the override the gradients differ (the recipe's quantised backward)."""
    torch.manual_seed(0)
    m = te.GroupedLinear(3, 128, 64, params_dtype=torch.bfloat16)
    loop = [te.Linear(128, 64, params_dtype=torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        for i, linear in enumerate(loop):
            linear.weight.copy_(getattr(m, f"weight{i}"))
            linear.bias.copy_(getattr(m, f"bias{i}"))
    splits = [32, 0, 64]
    x = torch.randn(96, 128, dtype=torch.bfloat16, requires_grad=True)
    x_loop = x.detach().clone().requires_grad_()
    dy = torch.randn(96, 64, dtype=torch.bfloat16)
    cls = _OVERRIDE_RECIPES[recipe]
    call, counter = compile_counted(m, backend=behaviour_backend()) if compiled else (m, None)
    with te.autocast(recipe=cls(backward_override=override)):
        call(x, splits).backward(dy)
        for i, rows in ((0, slice(0, 32)), (2, slice(32, 96))):
            loop[i](x_loop[rows]).backward(dy[rows])
    assert counter is None or counter.frame_count == 1
    assert not m.weight1.grad.any() and not m.bias1.grad.any()
    if recipe != "current" or override == "high_precision":
        assert_bits_equal(x.grad, x_loop.grad)
        for i in (0, 2):
            assert_bits_equal(getattr(m, f"weight{i}").grad, loop[i].weight.grad)
            assert_bits_equal(getattr(m, f"bias{i}").grad, loop[i].bias.grad)
    x_own = x.detach().clone().requires_grad_()
    with te.autocast(recipe=cls()):
        m(x_own, splits).backward(dy)
    assert not torch.equal(x_own.grad, x.grad)


def test_fuse_wgrad_accumulation_bad_main_grad_raises():
    m = te.GroupedLinear(2, 8, 4, fuse_wgrad_accumulation=True)
    m.weight0.main_grad = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"needs weight1\.main_grad"):
        m(torch.randn(3, 8), [1, 2])
    m.weight1.main_grad = torch.zeros(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"weight1\.main_grad must be float32"):
        m(torch.randn(3, 8), [1, 2])
    with torch.no_grad():  # no gradient: main_grad is not read
        m(torch.randn(3, 8), [1, 2])


@pytest.mark.parametrize(
    ("use_grouped_tensor", "single"),
    [(None, False), (False, False), (True, False), (None, True), (True, True)],
)
def test_use_grouped_tensor(use_grouped_tensor, single):
    """Transformer Engine's use_grouped_tensor picks its GEMM path; here one grouped op serves
    both, so every accepted value gives the same results (against a float64 reference)."""
    torch.manual_seed(0)
    m = te.GroupedLinear(3, 16, 8, single_grouped_parameter=single,
                         use_grouped_tensor=use_grouped_tensor)  # fmt: skip
    assert m.use_grouped_tensor is (single if use_grouped_tensor is None else use_grouped_tensor)
    _random_params(m)
    splits = [4, 0, 5]
    x = torch.randn(9, 16, requires_grad=True)
    w, b = (to_reference(t) for t in _grouped_weights(m))
    expected = torch.cat([r @ w_g.t() + b_g for r, w_g, b_g in
                          zip(to_reference(x).split(splits), w, b, strict=True)])  # fmt: skip
    assert_close(m(x, splits), expected, torch.float32)


@pytest.mark.parametrize(("weight", "bias"), [(True, True), (True, False), (False, True)])
def test_single_layout_leaves_per_group_names_none(weight, bias):
    """As Transformer Engine: weight{i} / bias{i} are None where the single parameter holds them
    (not in the state_dict, not parameters)."""
    m = te.GroupedLinear(2, 8, 4, single_grouped_weight=weight, single_grouped_bias=bias)
    for i in range(2):
        assert (getattr(m, f"weight{i}") is None) == weight
        assert (getattr(m, f"bias{i}") is None) == bias
    names = {n for n, _ in m.named_parameters()}
    expected = ({"weight"} if weight else {"weight0", "weight1"}) | (
        {"bias"} if bias else {"bias0", "bias1"}
    )
    assert names == expected and set(m.state_dict()) == expected


def test_use_grouped_tensor_refused():
    with pytest.raises(TypeError, match=r"^GroupedLinear: use_grouped_tensor must be a bool"):
        te.GroupedLinear(2, 8, 4, use_grouped_tensor=1)
    for kw in ({"single_grouped_parameter": True}, {"single_grouped_weight": True},
               {"single_grouped_bias": True}):  # fmt: skip
        with pytest.raises(ValueError, match=r"need use_grouped_tensor=True"):
            te.GroupedLinear(2, 8, 4, use_grouped_tensor=False, **kw)


BAD_GROUPED_LINEAR = [
    ("num_gemms_zero", {"num_gemms": 0}, "num_gemms must be a positive int"),
    ("num_gemms_bool", {"num_gemms": True}, "num_gemms must be a positive int"),
    ("in_features", {"in_features": -1}, "in_features must be a positive int"),
    ("out_features_float", {"out_features": 4.0}, "out_features must be a positive int"),
    ("params_dtype", {"params_dtype": torch.int32}, "params_dtype must be a floating dtype"),
]


@pytest.mark.parametrize("case", BAD_GROUPED_LINEAR, ids=[c[0] for c in BAD_GROUPED_LINEAR])
def test_grouped_linear_bad_arguments(case):
    _id, override, message = case
    kwargs = {"num_gemms": 2, "in_features": 8, "out_features": 4, **override}
    with pytest.raises(ValueError, match=r"^GroupedLinear: ") as info:
        te.GroupedLinear(**kwargs)
    assert message in str(info.value)


_BLOCKED_SIZES = {
    "GroupedLinear": lambda: te.GroupedLinear(2, 24, 32),
    "ops.GroupedLinear": lambda: te.ops.Sequential(te.ops.GroupedLinear(2, 24, 32)),
    "GroupedMLP": lambda: te.GroupedMLP(2, 24, 32),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    ("recipe", "multiple"),
    [
        (te.recipe.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True), 16),
        (te.recipe.MXFP8BlockScaling(), 32),
    ],
    ids=["nvfp4", "mxfp8"],
)
@pytest.mark.parametrize("name", _BLOCKED_SIZES)
def test_grouped_in_features_the_format_cannot_take(name, recipe, multiple, compiled):
    """in_features = 24 is no multiple of the format's block: a ValueError naming in_features
    and the constraint, as the dense path gives, in eager and at trace time (never a shape
    mismatch from inside torch)."""
    module = _BLOCKED_SIZES[name]()
    fn = torch.compile(module, fullgraph=True, backend=behaviour_backend()) if compiled else module
    match = (
        rf"te\.grouped_linear: \w+ grouped GEMMs need in_features \(24\) .* multiples of {multiple}"
    )
    with (
        pytest.raises(Exception if compiled else ValueError, match=match),
        te.autocast(recipe=recipe),
    ):
        fn(torch.randn(32, 24), torch.tensor([8, 24]))


# 4. GroupedMLP --------------------------------------------------------------------------------


class _RoundTo(torch.autograd.Function):
    """Round to ``dtype`` in the forward and the backward: where the module materialises an
    intermediate (and its gradient) in ``dtype``, the float64 reference rounds it too."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(torch.float64)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(torch.float64), None


def ref_activation(h, activation):
    if activation == "gelu":
        return torch_F.gelu(h, approximate="tanh")
    a, b = h.chunk(2, dim=-1)
    assert activation == "swiglu"
    return torch_F.silu(a) * b


def ref_grouped_mlp(x, splits, w1, b1, w2, b2, activation, dtype):
    outs = []
    for e, x_e in enumerate(x.split(splits)):
        h = _RoundTo.apply(x_e @ w1[e].t() + (0 if b1 is None else b1[e]), dtype)
        act = _RoundTo.apply(ref_activation(h, activation), dtype)
        outs.append(act @ w2[e].t() + (0 if b2 is None else b2[e]))
    return torch.cat(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("single", LAYOUTS, ids=LAYOUT_IDS)
def test_grouped_mlp_matches_reference(device, dtype, activation, bias, single):
    splits = [4, 0, 3, 5]
    m = te.GroupedMLP(
        4,
        16,
        8,
        activation=activation,
        bias=bias,
        single_grouped_parameter=single,
        params_dtype=dtype,
        device=device,
    )
    fc1_out = 16 if activation == "swiglu" else 8
    assert (m.fc1.out_features, m.fc1.in_features) == (fc1_out, 16)
    assert (m.fc2.out_features, m.fc2.in_features) == (16, 8)
    _random_params(m)
    x = torch.randn(12, 16, device=device, dtype=dtype, requires_grad=True)
    y = m(x, splits)
    dy = torch.randn_like(y)
    y.backward(dy)

    x_ref = to_reference(x)
    w1, b1 = (to_reference(t) for t in _grouped_weights(m.fc1))
    w2, b2 = (to_reference(t) for t in _grouped_weights(m.fc2))
    params = [t.requires_grad_() for t in (w1, b1, w2, b2) if t is not None]
    y_ref = ref_grouped_mlp(x_ref, splits, w1, b1, w2, b2, activation, dtype)
    y_ref.backward(to_reference(dy))
    extra = cuda_adds_bias_after_rounding(device, bias)
    assert_close(y, y_ref, dtype, roundings=1 + extra, reduced=extra)
    # Gradients pass through up to three rounded ops (FC2 dgrad, activation backward, FC1
    # dgrad); the weight and bias gradients sum such operands over rows.
    assert_close(x.grad, x_ref.grad, dtype, roundings=chain_roundings(dtype, 3), reduced=extra)
    grads = [_weight_grads(m.fc1), _weight_grads(m.fc2)]
    refs = [w1.grad, w2.grad]
    if bias:
        grads += [_bias_grads(m.fc1), _bias_grads(m.fc2)]
        refs += [b1.grad, b2.grad]
    assert len(params) == len(grads)
    for g, r in zip(grads, refs, strict=True):
        assert_close(g, r, dtype, roundings=chain_roundings(dtype, 3), reduced=True)


def _named_grads(module):
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("single", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("to_interleaved", [True, False], ids=["to_interleaved", "to_contiguous"])
def test_glu_interleave_equivalent_to_contiguous(single, bias, k, to_interleaved):
    """A module loaded from the other GLU layout through convert_glu_layout computes the same
    function; its gradients, converted back, are the source's (nested: with a prefix)."""
    kw = {"activation": "swiglu", "bias": bias, "single_grouped_parameter": single}
    contiguous = nn.Sequential(te.GroupedMLP(3, 16, 8, **kw))
    interleaved = nn.Sequential(te.GroupedMLP(3, 16, 8, glu_interleave_size=k, **kw))
    src, dst = (contiguous, interleaved) if to_interleaved else (interleaved, contiguous)
    _random_params(src)
    state = convert_glu_layout(src.state_dict(), k, to_interleaved=to_interleaved, prefix="0.")
    dst.load_state_dict(state)
    if k != 8:  # k = ffn_hidden_size: both layouts coincide
        fc1 = "0.fc1.weight" if single else "0.fc1.weight1"
        assert not torch.equal(state[fc1], src.state_dict()[fc1])

    splits = torch.tensor([5, 0, 4])
    x = torch.randn(9, 16)
    dy = torch.randn(9, 16)
    y_src, y_dst = src[0](x, splits), dst[0](x, splits)
    y_src.backward(dy)
    y_dst.backward(dy)
    back = convert_glu_layout(_named_grads(dst), k, to_interleaved=not to_interleaved, prefix="0.")
    src_grads = _named_grads(src)
    assert back.keys() == src_grads.keys()

    # FC1 is bitwise the same up to the permutation; the gated activation's CPU math vectorises
    # differently over the strided halves of the two layouts, so from there on the two agree up
    # to fp32 rounding (bitwise for k = ffn_hidden_size, where the layouts coincide).
    def check_same(actual, expected, roundings):
        if k == 8:
            assert torch.equal(actual, expected)
        else:
            assert_close(actual, expected.double(), torch.float32, roundings, reduced=True)

    check_same(y_dst, y_src, 2)
    for name, grad in src_grads.items():
        check_same(back[name], grad, 3)


@pytest.mark.parametrize("single", LAYOUTS, ids=LAYOUT_IDS)
def test_convert_glu_layout_round_trip_is_exact(single):
    m = te.GroupedMLP(2, 8, 8, bias=True, single_grouped_parameter=single)
    _random_params(m)
    state = m.state_dict()
    there = convert_glu_layout(state, 2, to_interleaved=True)
    back = convert_glu_layout(there, 2, to_interleaved=False)
    assert back.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(back[name], value)
        if name.startswith("fc2."):
            assert there[name] is value  # other entries are passed through
    assert state.keys() == m.state_dict().keys(), "the input dict is not modified"


BAD_GROUPED_MLP = [
    ("k_not_gated", {"activation": "gelu", "glu_interleave_size": 2}, "applies to gated"),
    ("k_zero", {"glu_interleave_size": 0}, "glu_interleave_size must be a positive int"),
    ("k_negative", {"glu_interleave_size": -2}, "glu_interleave_size must be a positive int"),
    ("k_not_dividing", {"glu_interleave_size": 3}, "dividing ffn_hidden_size (8), got 3"),
    ("k_above_ffn", {"glu_interleave_size": 16}, "dividing ffn_hidden_size (8), got 16"),
    ("k_bool", {"glu_interleave_size": True}, "glu_interleave_size must be a positive int"),
    ("k_float", {"glu_interleave_size": 2.0}, "glu_interleave_size must be a positive int"),
    ("activation", {"activation": "tanh"}, "activation must be one of"),
    ("num_experts", {"num_experts": 0}, "num_experts must be a positive int"),
    ("ffn_hidden_size", {"ffn_hidden_size": -8}, "ffn_hidden_size must be a positive int"),
]


@pytest.mark.parametrize("case", BAD_GROUPED_MLP, ids=[c[0] for c in BAD_GROUPED_MLP])
def test_grouped_mlp_bad_arguments(case):
    _id, override, message = case
    kwargs = {"num_experts": 2, "hidden_size": 16, "ffn_hidden_size": 8, **override}
    with pytest.raises(ValueError, match=r"^GroupedMLP: ") as info:
        te.GroupedMLP(**kwargs)
    assert message in str(info.value)


def test_convert_glu_layout_bad_interleave_size_raises():
    state = te.GroupedMLP(2, 8, 8).state_dict()
    with pytest.raises(ValueError, match="interleave_size must be positive"):
        convert_glu_layout(state, 0, to_interleaved=True)
    with pytest.raises(ValueError, match="must be divisible by 2 \\* interleave_size"):
        convert_glu_layout(state, 3, to_interleaved=True)
