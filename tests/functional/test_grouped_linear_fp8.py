"""The grouped linear family under the per-tensor recipes (rowwise current scaling, delayed
scaling) and Float8BlockScaling: accuracy against the
high-precision grouped linear (SQNR floors), the high-precision wgrad, zero-size groups, exact
agreement with the fake-quant reference, the CUDA path's helpers on CPU tensors, bad input, and
compilation without recompiles when device m_splits values change."""

from __future__ import annotations

import importlib

import pytest
import torch

import te_compile
from te_compile.functional.grouped_gemm import GroupedRecipe
from te_compile.functional.spec import BackwardSpec, QuantSpec
from tests.utils import (
    DEVICES,
    assert_bits_equal,
    assert_close,
    chain_roundings,
    compile_counted,
    make_reference_and_test_tensors,
    references,
    with_specs,
)

# The modules, not the function of the same name that te_compile.functional exports.
GF = importlib.import_module("te_compile.functional.grouped_fp8")
GL = importlib.import_module("te_compile.functional.grouped_linear_ops")
G = importlib.import_module("te_compile.functional.gemm")
Q = importlib.import_module("te_compile.functional.quantize")


def grouped_linear_fp8(x, s, w, b=None, **kw):
    """The family op under current (rowwise) scaling unless ``kw`` names a recipe."""
    return te_compile.functional.grouped_linear(x, s, w, b, **with_specs(**{"recipe": "current",
                                                                          **kw}))  # fmt: skip


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

# SQNR floors (dB) against the float64 high-precision grouped linear, for Gaussian data
# (96 rows, K=64, N=48). Measured on CPU over 5 seeds: output 28.9-29.0 dB (rowwise E4M3 input
# and weight); dgrad 25.1-25.3 dB with an E5M2 gradient (2 mantissa bits), 29.0-29.3 dB with an
# E4M3 one. The floors leave 3 dB of margin.
SQNR_FLOOR_OUT = 26.0
SQNR_FLOOR_DGRAD = {E5M2: 22.0, E4M3: 26.0}


def sqnr(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB, in float64."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return (10 * torch.log10(e.square().sum() / (a - e).square().sum())).item()


def ref_grouped_linear(x, splits, w, b):
    """float64 high-precision definition: group ``g`` of rows times ``w[g].T`` plus ``b[g]``."""
    outs = []
    for g, x_g in enumerate(x.split(list(splits))):
        y = x_g @ w[g].t()
        outs.append(y if b is None else y + b[g])
    return torch.cat(outs)


def _make(splits, k, n, dtype, device, bias=True):
    g = len(splits)
    x_ref, x = make_reference_and_test_tensors((sum(splits), k), dtype=dtype, device=device)
    w_ref, w = make_reference_and_test_tensors((g, n, k), dtype=dtype, device=device)
    b_ref, b = make_reference_and_test_tensors((g, n), dtype=dtype, device=device)
    if not bias:
        b_ref = b = None
    return (x_ref, w_ref, b_ref), (x, w, b)


# 1. Accuracy against high precision ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bwd_dtype", [E5M2, E4M3], ids=["e5m2", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sqnr_and_high_precision_wgrad(device, bwd_dtype, dtype):
    splits = [30, 0, 50, 16]
    (x_ref, w_ref, b_ref), (x, w, b) = _make(splits, 64, 48, dtype, device)
    y_ref = ref_grouped_linear(x_ref, splits, w_ref, b_ref)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, device=device)
    y_ref.backward(dy_ref)

    y = grouped_linear_fp8(x, splits, w, b, bwd_dtype=bwd_dtype)
    y.backward(dy)
    assert y.shape == y_ref.shape and y.dtype == dtype
    assert sqnr(y, y_ref) > SQNR_FLOOR_OUT
    assert sqnr(x.grad, x_ref.grad) > SQNR_FLOOR_DGRAD[bwd_dtype]
    # wgrad and dbias are high precision: equal to the float64 ones to dtype tolerance.
    assert_close(w.grad, w_ref.grad, dtype, reduced=True)
    assert_close(b.grad, b_ref.grad, dtype, reduced=True)
    # A group without rows gets exactly zero weight and bias gradients.
    assert not w.grad[1].any() and not b.grad[1].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "splits", [[0, 0, 20, 0], [7, 13], [20]], ids=["one_nonempty", "two", "one"]
)
def test_zero_size_groups_and_partial_grads(device, splits):
    _ref, (x, w, b) = _make(splits, 32, 16, torch.bfloat16, device)
    x.requires_grad_(False)
    y = grouped_linear_fp8(x, torch.tensor(splits, device=device), w, b)
    y.sum().backward()
    assert x.grad is None
    for g, rows in enumerate(splits):
        if rows == 0:
            assert not w.grad[g].any() and not b.grad[g].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "op_path"])
def test_matches_fake_quant_reference(device, fast):
    """The op equals the exact fake-quant emulation (float64) to the dtype's tolerance, on the
    eager fast path and through the dispatcher."""
    splits = [5, 0, 11]
    dtype = torch.float32
    (x_ref, w_ref, b_ref), (x, w, b) = _make(splits, 32, 16, dtype, device)
    y_ref = GL.scaled_grouped_linear_ref(x_ref, splits, w_ref, b_ref)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, device=device)
    y_ref.backward(dy_ref)
    previous = te_compile.eager_fast_path_enabled()
    te_compile.set_eager_fast_path(fast)
    try:
        y = grouped_linear_fp8(x, splits, w, b)
        y.backward(dy)
    finally:
        te_compile.set_eager_fast_path(previous)
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, x_ref.grad, dtype)
    assert_close(w.grad, w_ref.grad, dtype, reduced=True)
    assert_close(b.grad, b_ref.grad, dtype, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_rowwise_measures_the_amaxes_when_given_grad_amax(device, compiled):
    """Under "rowwise" a grad_amax makes the op measure [amax(x), amax(w)] and amax(dY) (a
    delayed-scaling state's calibration step) without changing any result; without it the amax
    output is 0-element."""
    splits = [5, 0, 11, 16]
    _, (x, w, b) = _make(splits, 32, 16, torch.bfloat16, device)
    dy = torch.randn(32, 16, device=device, dtype=torch.bfloat16)
    s = torch.tensor(splits, device=device)

    def forward(grad_amax):
        return grouped_linear_fp8(x, s, w, b, grad_amax=grad_amax, return_amax=True)

    def run(fn, grad_amax):
        x.grad = w.grad = b.grad = None
        y, amax = fn(grad_amax)
        y.backward(dy)
        return y.detach(), amax, x.grad, w.grad, b.grad

    fn = compile_counted(forward, backend="aot_eager")[0] if compiled else forward
    grad_amax = torch.zeros(1, device=device)
    y, amax, *grads = run(fn, grad_amax)
    y0, amax0, *grads0 = run(forward, None)
    assert torch.equal(y, y0) and all(map(torch.equal, grads, grads0))
    assert amax0.numel() == 0
    assert torch.equal(amax, torch.stack([x.detach().abs().max(), w.detach().abs().max()]).float())
    assert torch.equal(grad_amax, dy.abs().max().float().reshape(1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delayed_scaling(device, dtype):
    """recipe="delayed": the op equals the fake-quant reference with the given per-tensor scales,
    reports the forward's [amax(x), amax(w)] and writes amax(dY) into grad_amax; a scale that
    is too large saturates instead of overflowing."""
    splits = [5, 0, 11, 16]
    (x_ref, w_ref, b_ref), (x, w, b) = _make(splits, 32, 16, dtype, device)
    scale = torch.tensor([16.0, 64.0, 2.0**12], device=device)
    # bf16 on CUDA: the grouped kernel, whose output is rounded before the bias is added.
    bf16 = dtype is torch.bfloat16
    y_ref = GL.scaled_grouped_linear_ref(x_ref, splits, w_ref, b_ref, scale=scale.cpu())
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, device=device)
    y_ref.backward(dy_ref)
    grad_amax = torch.zeros(1, device=device)
    y, amax = grouped_linear_fp8(
        x, splits, w, b, recipe="delayed", scale=scale, grad_amax=grad_amax, return_amax=True
    )
    y.backward(dy)
    assert_close(y, y_ref, dtype, reduced=bf16)
    assert_close(x.grad, x_ref.grad, dtype, reduced=bf16)
    assert_close(w.grad, w_ref.grad, dtype, reduced=True)
    assert_close(b.grad, b_ref.grad, dtype, reduced=True)
    expected = torch.stack([x.detach().abs().max(), w.detach().abs().max()])
    assert torch.equal(amax, expected.float())
    assert torch.equal(grad_amax, dy.abs().max().float().reshape(1))
    # Per-tensor, not rowwise: a rescaled row changes every row's rounding under rowwise
    # scaling only; here the other rows' outputs stay bit-identical.
    x2 = x.detach().clone()
    x2[0] *= 4
    y2 = grouped_linear_fp8(x2, splits, w.detach(), b.detach(), recipe="delayed", scale=scale)
    assert torch.equal(y2[1:], y.detach()[1:])
    # Overflow saturates at the format's largest value (448 for E4M3), no inf.
    big = grouped_linear_fp8(
        x.detach(), splits, w.detach(), None, recipe="delayed",
        scale=torch.tensor([1e6, 1e6, 1.0], device=device),
    )  # fmt: skip
    assert torch.isfinite(big).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_main_grad_accumulation(device, dtype):
    """main_grad (fp32): the weight gradient is added to it (twice: accumulated), no .grad."""
    splits = [7, 0, 25]
    _ref, (x, w, b) = _make(splits, 32, 16, dtype, device)
    dy = torch.randn(sum(splits), 16, device=device, dtype=dtype)
    expected = grouped_linear_fp8(x, splits, w, b)
    expected.backward(dy)
    main_grad = torch.ones(w.shape, device=device)
    for _ in range(2):
        y = grouped_linear_fp8(x, splits, w.detach().requires_grad_(), b, main_grad=main_grad)
        y.backward(dy)
    assert torch.equal(y, expected)
    # bf16 on CUDA: the grouped wgrad is rounded to bf16 before the fp32 add.
    assert_close(main_grad, 1 + 2 * w.grad.double(), dtype, reduced=True)
    with pytest.raises(ValueError, match="main_grad must be float32"):
        grouped_linear_fp8(x, splits, w, b, main_grad=main_grad.to(dtype=torch.float16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("delayed", [False, True], ids=["rowwise", "delayed"])
@pytest.mark.parametrize("bwd_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_wgrad_matches_reference(device, dtype, delayed, bwd_dtype):
    """fp8_wgrad=True: the wgrad from both operands quantised per (group, column) along the
    tokens (or per tensor, delayed) equals the fake-quant reference; groups of 17 / 0 / 23 / 5
    tokens (padded to multiples of 16 inside); it is not the high-precision wgrad, but close
    to it (SQNR); dgrad, output and bias gradient are unchanged by the flag. On CUDA in bf16
    both formats run torch's grouped FP8 GEMM (E5M2 as its E4M3 recoding)."""
    splits = [17, 0, 23, 5]
    (x_ref, w_ref, b_ref), (x, w, b) = _make(splits, 32, 48, dtype, device)
    # Delayed: scales that keep Gaussian data inside E4M3's range (|x| * 64 < 448).
    scale = torch.tensor([16.0, 64.0, 64.0], device=device) if delayed else None
    y_ref = GL.scaled_grouped_linear_ref(
        x_ref, splits, w_ref, b_ref, E4M3, bwd_dtype, None if scale is None else scale.cpu(), True
    )
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, device=device)
    y_ref.backward(dy_ref)
    kw = {"recipe": "delayed", "scale": scale} if delayed else {}
    grads = {}
    for fp8_wgrad in (True, False):
        x_, w_, b_ = (t.detach().requires_grad_() for t in (x, w, b))
        y = grouped_linear_fp8(x_, splits, w_, b_, bwd_dtype=bwd_dtype, fp8_wgrad=fp8_wgrad, **kw)
        y.backward(dy)
        grads[fp8_wgrad] = (y, x_.grad, w_.grad, b_.grad)
    y, dx, dw, db = grads[True]
    native = device == "cuda" and dtype is torch.bfloat16
    assert_close(y, y_ref, dtype, reduced=native)
    assert_close(dx, x_ref.grad, dtype, reduced=native)
    assert_close(dw, w_ref.grad, dtype, reduced=True, roundings=2 if native else 1)
    assert_close(db, b_ref.grad, dtype, reduced=True)
    assert not dw[1].any()  # the empty group
    for i in (0, 1, 3):  # output, dgrad, bias gradient
        assert torch.equal(grads[True][i], grads[False][i])
    hp = grads[False][2]
    assert not torch.equal(dw, hp)
    assert sqnr(dw, hp) > (20.0 if bwd_dtype is E5M2 else 24.0)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_wgrad_keeps_the_fp8_copy_not_the_input(device):
    """With fp8_wgrad the autograd graph holds the input's FP8 copy (uint8, [K, capacity]),
    not the input; without it, the input itself."""
    from torch.autograd.graph import saved_tensors_hooks

    splits = [17, 0, 23, 5]
    _ref, (x, w, b) = _make(splits, 32, 48, torch.bfloat16, device)
    saved = []

    def keep(t):
        saved.append(t)
        return t

    for fp8_wgrad in (False, True):
        saved.clear()
        with saved_tensors_hooks(keep, lambda t: t):
            y = grouped_linear_fp8(x, splits, w, b, bwd_dtype=E4M3, fp8_wgrad=fp8_wgrad)
        kept_input = any(t.dtype is x.dtype and t.shape == x.shape for t in saved)
        fp8_copy = [t for t in saved if t.dtype is torch.uint8 and t.shape[0] == 32]
        assert kept_input is not fp8_wgrad
        assert bool(fp8_copy) is fp8_wgrad
        if fp8_wgrad:
            assert fp8_copy[0].shape == (32, (45 + 15 * 4 + 15) // 16 * 16)
        y.sum().backward()


def _rowwise_qdq(t: torch.Tensor) -> torch.Tensor:
    """float64 ``t`` (``[..., K]``) with each row quantised to E4M3 with its own current scale
    (amax over ``K``, Transformer Engine's scale) and dequantised: the per-tensor grouped GEMM's
    forward operands under current scaling, written out from the scale and cast helpers."""
    rows = t.detach().reshape(-1, t.shape[-1]).cpu()
    out = torch.empty(rows.shape, dtype=torch.float64)
    for i, row in enumerate(rows):
        s = references.te_scale(references.amax_of(row), E4M3)
        out[i] = references.fp8_cast(row, s, E4M3).double() * references.fp32_reciprocal(s).double()
    return out.reshape(t.shape).to(t.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_override_matches_reference(device, dtype, override):
    """``backward_override`` (te.linear's): the forward is the recipe's, bit for bit; the
    backward is high precision's on the input and the weight ("high_precision") or on the
    forward GEMM's operands dequantised (rowwise E4M3, "dequantized"), the gradient not
    quantised; against float64, with no FP8 copy saved and no gradient amax written."""
    splits = [30, 0, 50, 16]
    (x_ref, w_ref, b_ref), (x, w, b) = _make(splits, 64, 48, dtype, device)
    grad_amax = torch.zeros(1, device=device)
    y = grouped_linear_fp8(x, splits, w, b, backward_override=override, grad_amax=grad_amax)
    assert torch.equal(y, grouped_linear_fp8(x.detach(), splits, w.detach(), b.detach()))
    dy_ref, dy = make_reference_and_test_tensors(y.shape, dtype=dtype, device=device)
    y.backward(dy)
    assert not grad_amax.any()
    x_op, w_op = x_ref, w_ref
    if override == "dequantized":  # straight through the quantisation
        x_op = x_ref + (_rowwise_qdq(x_ref) - x_ref).detach()
        w_op = w_ref + (_rowwise_qdq(w_ref) - w_ref).detach()
    ref_grouped_linear(x_op, splits, w_op, b_ref).backward(dy_ref)
    for actual, expected in ((x.grad, x_ref.grad), (w.grad, w_ref.grad), (b.grad, b_ref.grad)):
        assert_close(actual, expected, dtype, roundings=2, reduced=True)
    # The high-precision backward's bits, or (the dequantised operands) not its dgrad and wgrad.
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    te_compile.functional.grouped_linear(leaves[0], splits, *leaves[1:]).backward(dy)
    same = [torch.equal(t.grad, h.grad) for t, h in zip((x, w, b), leaves, strict=True)]
    assert same == ([True] * 3 if override == "high_precision" else [False, False, True])


# 2. The quantisation and GEMM helpers of the CUDA path, on CPU tensors ------------------------


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_rowwise(fp8):
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    x[2] = 0
    data, scale_inv = Q.quantize_rowwise(x, fp8)
    assert data.dtype is fp8 and data.shape == x.shape
    assert scale_inv.dtype is torch.float32 and scale_inv.shape == (6,)
    limit = torch.finfo(fp8).max
    # Every non-zero row's amax lands on the format's largest value; a zero row gets scale 1.
    amax = data.float().abs().amax(1)
    assert torch.equal(amax[[0, 1, 3, 4, 5]], torch.full((5,), limit))
    assert scale_inv[2] == 1 and not data[2].float().any()
    expected_inv = x.float().abs().amax(1) / limit
    torch.testing.assert_close(scale_inv[[0, 1, 3, 4, 5]], expected_inv[[0, 1, 3, 4, 5]])
    # Dequantised: within half an FP8 ulp of each row's scale.
    deq = data.float() * scale_inv[:, None]
    eps = torch.finfo(fp8).eps
    assert ((deq - x.float()).abs() <= eps * x.float().abs() + 1e-30).all()
    # A float64 copy gets the same bytes and scales (the reference relies on it).
    d64, s64 = Q.quantize_rowwise(x.double(), fp8)
    assert torch.equal(d64.view(torch.uint8), data.view(torch.uint8)) and torch.equal(
        s64, scale_inv
    )


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_row_scaled_rows_of_the_quantiser_table(fp8):
    """The grouped operands' casts are the per-tensor rows of ``functional.gemm.QUANTIZERS``
    with ``row_scaled``: current scaling gives ``quantize_rowwise``'s bytes and scales (no amax),
    delayed scaling the per-tensor cast's bytes and amax with its inverse scale in every row;
    ``e4m3_codes`` recodes an E5M2 result. Op specs refuse ``row_scaled`` for these kinds."""
    from te_compile.functional.spec import QuantSpec

    x = torch.randn(7, 48, dtype=torch.bfloat16) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0
    rows = G.quantize_operand(QuantSpec("current", fp8, row_scaled=True), x, columnwise=False)
    data, scale_inv = Q.quantize_rowwise(x, fp8)
    assert_bits_equal(rows.data, data)
    assert_bits_equal(rows.scale, scale_inv)
    assert rows.amax.numel() == 0
    codes = G.quantize_operand(QuantSpec("current", fp8, row_scaled=True), x, columnwise=False,
                               e4m3_codes=True)  # fmt: skip
    want = Q.as_e4m3(data, scale_inv)
    assert codes.data.dtype is E4M3
    assert_bits_equal(codes.data, want[0])
    assert_bits_equal(codes.scale, want[1])
    scale = torch.tensor([2.0**-4 if fp8 is E5M2 else 2.0**3])
    delayed = G.quantize_operand(QuantSpec("delayed", fp8, row_scaled=True), x, scale=scale,
                                 columnwise=False)  # fmt: skip
    tensor = G.quantize_operand(QuantSpec("delayed", fp8), x, scale=scale, columnwise=False)
    assert_bits_equal(delayed.data, tensor.data)
    assert_bits_equal(delayed.amax, tensor.amax)
    assert_bits_equal(delayed.scale, tensor.scale.expand(7))
    specs = {
        "input_spec": QuantSpec("current", E4M3, row_scaled=True),
        "weight_spec": QuantSpec("current", E4M3),
        "grad_spec": QuantSpec("current", E5M2),
    }
    with pytest.raises(ValueError, match="row_scaled: not an option"):
        G.check_specs("te::linear_fwd: ", specs)


def test_weight_scales_per_group_and_dim():
    """Forward: one scale per (group, output row), amax over K; dgrad: per (group, input
    column), amax over N, stored transposed ``[G, K, N]``."""
    w = torch.randn(3, 16, 32)
    data, s = Q.quantize_rowwise(w, E4M3)
    assert data.shape == (3, 16, 32) and s.shape == (3, 16)
    torch.testing.assert_close(s, w.abs().amax(-1) / 448)
    _, _, data_t, s_t, _ = GF.per_tensor_weight(w, E4M3, None, False)
    assert data_t.shape == (3, 32, 16) and data_t.is_contiguous() and s_t.shape == (3, 32)
    torch.testing.assert_close(s_t, w.abs().amax(1) / 448)
    for g in range(3):
        ref, ref_s = Q.quantize_rowwise(w[g].t(), E4M3)
        assert torch.equal(data_t[g].view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(s_t[g], ref_s)


@pytest.mark.parametrize("delayed", [False, True], ids=["rowwise", "per_tensor"])
def test_e5m2_operand_recoded_to_e4m3(delayed):
    """An E5M2 operand goes into the grouped GEMMs as E4M3 codes of its values times 2**-7, its
    inverse scales times 128: the dequantised values are the E5M2 ones wherever the scaled
    value is 1 or more (down to amax / 57344 of a row), within 2**-3 scaled units below (E4M3's
    subnormal grid), NaN stays NaN; E4M3 operands pass through untouched."""
    torch.manual_seed(3)
    x = torch.randn(6, 64) * torch.logspace(-12, 0, 64, base=2.0)  # down to 2**-12 of amax
    x[5, 7] = float("nan")
    if delayed:
        data, s, _ = GL.quantize_per_tensor(x, E5M2, torch.tensor([2.0**10]))
        s_rows = s.expand(6)
    else:
        data, s_rows = Q.quantize_rowwise(x, E5M2)
    codes, s4 = Q.as_e4m3(data, s_rows)
    assert codes.dtype is E4M3 and torch.equal(s4, s_rows * 128)
    want = data.double() * s_rows.double()[:, None]
    got = codes.double() * s4.double()[:, None]
    scaled = data.double().abs()
    big = scaled >= 1
    assert torch.equal(got[big], want[big]) and big.sum() > 100
    small = ~big & ~torch.isnan(want)
    err = (got[small] - want[small]).abs() / s_rows.double()[:, None].expand_as(want)[small]
    assert (~big).sum() > 10 and err.max() <= 2.0**-3
    assert torch.isnan(got[5, 7])
    e4 = Q.quantize_rowwise(x, E4M3)
    assert Q.as_e4m3(*e4)[0] is e4[0]


def test_balanced_scales_keep_every_product_exactly():
    """The two scale vectors of a native grouped GEMM, their largest exponents evened out by a
    power of two: every product ``sa[i] * sb[j]`` unchanged bit for bit, and a row scale near
    2**119 (an input at the bf16 max) brought down to where the fp32 accumulator times it stays
    finite."""
    sa = torch.tensor([2.0**119, 3.0 * 2**100, 1.0, 0.75])
    sb = torch.tensor([2.0**-11, 5.0 * 2**-20, 0.5])
    a2, b2 = G._balanced(sa, sb)
    assert torch.equal(a2[:, None] * b2[None, :], sa[:, None] * sb[None, :])
    assert a2.max() < 2.0**70 and b2.max() < 2.0**70
    assert (2.0**17 * a2).isfinite().all()
    same = torch.tensor([1.0, 2.0])
    assert all(torch.equal(t, same) for t in G._balanced(same, same))
    # Traced (the torch ops Inductor fuses on CUDA too): the same bits.
    compiled = torch.compile(G._balanced, fullgraph=True)
    for x, y in ((sa, sb), (sb, sa), (torch.tensor([2.0**-140, 1.5]), sb)):
        assert all(
            torch.equal(c, e) for c, e in zip(compiled(x, y), G._balanced(x, y), strict=True)
        )
    a0, b0 = G._balanced(torch.empty(0), sb)  # no rows (exponent 0): sb's, 126, halved
    assert a0.numel() == 0 and torch.equal(b0, sb * 2.0**-63)


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_grouped_gemm_path_matches_loop(fp8):
    """The device-offset GEMM (``torch._grouped_mm`` of the FP8 values in bf16, scales after;
    on CUDA ``torch._scaled_grouped_mm``) equals the exact loop to 2 roundings, E5M2 operands
    recoded to E4M3 in both."""
    splits = [9, 0, 20, 3]
    a, sa = Q.quantize_rowwise(torch.randn(32, 48), fp8)
    b, sb = Q.quantize_rowwise(torch.randn(4, 16, 48), E4M3)
    s = torch.tensor(splits)
    _, offs = GF.device_splits(s, a)
    grouped = G.gemm("scaled_grouped_mm", a, sa, b, sb, torch.bfloat16, offs=offs)
    loop = GF._gemm_loop(a, sa, b, sb, splits, torch.float64)
    assert grouped.dtype is torch.bfloat16
    assert_close(grouped, loop, torch.bfloat16, roundings=2)


@pytest.mark.parametrize("fp8_wgrad", [False, True], ids=["hp_wgrad", "fp8_wgrad"])
@pytest.mark.parametrize("delayed", [False, True], ids=["rowwise", "delayed"])
@pytest.mark.parametrize("bias", [True, False])
def test_native_path_on_cpu_tensors(bias, delayed, fp8_wgrad):
    """The whole grouped (no host sync) forward and backward of the CUDA kernel, run on CPU bf16
    tensors, against the exact emulation (the FP8 wgrad with an E5M2 gradient too: the bf16
    grouped GEMM of the recoded FP8 values, scales after)."""
    splits = [6, 0, 17, 9]
    _ref, (x, w, b) = _make(splits, 32, 16, torch.bfloat16, "cpu", bias=bias)
    s = torch.tensor(splits)
    scale = torch.tensor([4.0, 32.0, 512.0]) if delayed else None
    kind = "delayed" if delayed else "current"
    fwd, bwd = QuantSpec(kind), QuantSpec(kind, torch.float8_e5m2)
    r = GroupedRecipe(fwd, fwd, bwd, BackwardSpec(fp8_wgrad=fp8_wgrad), scale)
    out_n, saved_n = GF.per_tensor_forward(x, s, w, b, r, cuda=True)
    out_l, saved_l = GF.per_tensor_forward(x, s, w, b, r, cuda=False)
    assert len(saved_n) == (4 if fp8_wgrad else 2) + delayed  # the amaxes last
    for a, e in zip(saved_n, saved_l, strict=True):
        assert torch.equal(a, e)
    # The native path adds the bias to the GEMM's rounded bf16 output: an error of the GEMM's
    # magnitude, which a cancelling sum leaves large relative to the result (hence `reduced`).
    assert_close(
        out_n,
        out_l.double(),
        torch.bfloat16,
        roundings=chain_roundings(torch.bfloat16, 2 + bias),
        reduced=bias,
    )
    dy = torch.randn_like(out_l)
    args = (dy, saved_l[: 4 if fp8_wgrad else 2], x, s, w, None, r, bias, True, True)
    grads_n = GF.per_tensor_backward(*args, cuda=True)
    grads_l = GF.per_tensor_backward(*args, cuda=False)
    assert_close(grads_n[0], grads_l[0].double(), torch.bfloat16, roundings=2)
    assert_close(grads_n[1], grads_l[1].double(), torch.bfloat16, reduced=True)
    if bias:
        assert_close(grads_n[2], grads_l[2].double(), torch.bfloat16, reduced=True)
    assert not grads_n[1][1].any()


# 3. Bad input ----------------------------------------------------------------------------------


def _args(**override):
    args = {
        "x": torch.randn(10, 16),
        "s": torch.tensor([3, 0, 7]),
        "w": torch.randn(3, 16, 16),
        "b": torch.randn(3, 16),
        "fwd": E4M3,
        "kw": {},
    }
    args.update(override)
    return args


BAD_INPUTS = [
    ("in_features_16", lambda: _args(x=torch.randn(10, 24), w=torch.randn(3, 16, 24)), "16"),
    ("out_features_16", lambda: _args(w=torch.randn(3, 8, 16), b=torch.randn(3, 8)), "16"),
    ("in_features", lambda: _args(w=torch.randn(3, 16, 32)), "must equal in_features"),
    ("weight_rank", lambda: _args(w=torch.randn(16, 16)), "weight must be 3-D"),
    ("num_gemms", lambda: _args(s=torch.tensor([3, 7])), "m_splits has 2 groups but weight"),
    ("splits_float", lambda: _args(s=torch.tensor([3.0, 0.0, 7.0])), "m_splits must be a 1-D"),
    ("bias_shape", lambda: _args(b=torch.randn(3, 8)), "bias must have shape"),
    ("dtype_mix", lambda: _args(w=torch.randn(3, 16, 16).half()), "must equal weight.dtype"),
    ("fp64", lambda: _args(x=torch.randn(10, 16).double(), w=torch.randn(3, 16, 16).double(),
                           b=torch.randn(3, 16).double()),
     "FP8 recipes take float32/bfloat16/float16 inputs"),
    ("bad_spec", lambda: _args(kw={"grad_spec": "current:e5m2:x"}),
     "grad_spec 'current:e5m2:x': unknown token 'x'"),
    ("splits_sum", lambda: _args(s=torch.tensor([3, 0, 6])), "sum to inp.shape[0] (10)"),
    ("scale_rowwise", lambda: _args(kw={"scale": torch.ones(3)}),
     'scale is for "delayed" specs only'),
    ("delayed_no_scale", lambda: _args(kw={"recipe": "delayed"}), 'a "delayed" spec needs scale'),
    ("grad_amax_shape", lambda: _args(kw={"grad_amax": torch.zeros(2)}),
     "grad_amax must be a [1] float32 tensor"),
    ("override_name", lambda: _args(kw={"backward_override": "fast"}),
     "te.grouped_linear: backward_override must be one of ('', 'high_precision', "
     "'dequantized'), got 'fast'"),
    ("override_fp8_wgrad", lambda: _args(kw={"backward_override": "dequantized",
                                             "fp8_wgrad": True}), "without 'fp8_wgrad'"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["fast", "op", "compiled"])
def test_bad_input_raises_clear_error(case, mode):
    _id, make, message = case
    a = make()
    a["x"].requires_grad_()

    def call(x, s, w, b, fwd, kw):
        return grouped_linear_fp8(x, s, w, b, fwd_dtype=fwd, **kw)

    previous = te_compile.eager_fast_path_enabled()
    te_compile.set_eager_fast_path(mode == "fast")
    fn = compile_counted(call, backend="aot_eager")[0] if mode == "compiled" else call
    try:
        with pytest.raises(Exception) as info:
            fn(a["x"], a["s"], a["w"], a["b"], a["fwd"], a["kw"])
    finally:
        te_compile.set_eager_fast_path(previous)
    assert message in str(info.value)
    if _id != "splits_sum":  # the splits' values are checked by the grouped_linear helper
        assert "te.grouped_linear: " in str(info.value)
    if mode == "compiled":
        assert info.type is ValueError or "ValueError" in str(info.value)
    else:
        assert info.type is ValueError


# 4. Compilation --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_wgrad", [False, True], ids=["hp_wgrad", "fp8_wgrad"])
def test_compiled_changing_splits_do_not_recompile(device, fp8_wgrad):
    """A device-tensor m_splits whose values change reuses the one fullgraph graph (fixed and,
    with dynamic shapes, changing row counts; the FP8 wgrad's padded operands have a static
    capacity); compiled equals eager."""
    kw = {"fwd_dtype": E4M3, "bwd_dtype": E4M3, "fp8_wgrad": True} if fp8_wgrad else {}

    def fn(x, s, w, b):
        return grouped_linear_fp8(x, s, w, b, **kw)

    compiled, counter = compile_counted(fn, dynamic=True)
    # Row counts differ from every feature size (dynamic shapes would duck-size equal ones).
    w = torch.randn(4, 48, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    for splits in ([3, 0, 7, 7], [0, 17, 0, 0], [5, 5, 2, 5], [2, 9, 0, 11]):
        x = torch.randn(sum(splits), 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        s = torch.tensor(splits, device=device, dtype=torch.int32)
        outs = []
        for f in (compiled, fn):
            y = f(x, s, w, b)
            outs.append((y, *torch.autograd.grad(y.float().square().sum(), (x, w, b))))
        for c, e in zip(*outs, strict=True):
            assert_close(c, e.double(), torch.bfloat16)
        assert counter.frame_count == 1


def test_compiled_graph_has_the_fp8_ops():
    from tests.utils import count_graph_breaks

    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(2, 16, 32, requires_grad=True)
    graphs, breaks = count_graph_breaks(
        lambda x, s, w: grouped_linear_fp8(x, s, w), x, torch.tensor([10, 6]), w
    )
    assert (graphs, breaks) == (1, 0)
