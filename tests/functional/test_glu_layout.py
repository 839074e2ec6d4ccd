"""GLU weight layouts (``te_compile.functional.glu_layout``): interleave/deinterleave are inverse
permutations along the GLU dim, with the blocks written out on small examples; over ranks, dims,
interleave sizes, dtypes and strided inputs; autograd through them; bad input in eager and under
compile; compiled equals eager in one graph; and the interleaved weight is the layout that the
gated activations read with ``glu_interleave_size``."""

from __future__ import annotations

import pytest
import torch

from te_compile.functional import activation
from te_compile.functional.glu_layout import deinterleave_glu_tensor, interleave_glu_tensor
from tests.utils import DEVICES, assert_close, compile_counted, make_reference_and_test_tensors

H = 12
KS = [1, 3, H]  # k = 1, k dividing H, k = H
K_IDS = ["k1", "k_divides_H", "k_H"]

# (shape, dim): a bias [2H], a weight [2H, in], a grouped weight [E, 2H, in] (dim 1 and -2),
# a grouped bias [E, 2H] (dim 1 and -1).
LAYOUTS = [
    ((2 * H,), 0),
    ((2 * H, 5), 0),
    ((3, 2 * H, 5), 1),
    ((3, 2 * H, 5), -2),
    ((3, 2 * H), 1),
    ((3, 2 * H), -1),
]
LAYOUT_IDS = ["bias", "weight", "grouped_weight", "grouped_weight_neg", "grouped_bias", "gb_neg"]


def _interleave_index(h, k):
    """Row ``j`` of the interleaved layout ``[W_0:k, V_0:k, W_k:2k, V_k:2k, ...]`` is row
    ``index[j]`` of the contiguous layout ``[W, V]`` (written independently of the module)."""
    index = []
    for start in range(0, h, k):
        index += range(start, start + k)
        index += range(h + start, h + start + k)
    return torch.tensor(index)


def _random(shape, dtype, device):
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(-1000, 1000, shape, device=device, dtype=dtype)


# 1. Layout, written out -----------------------------------------------------------------------


def test_blocks_on_arange_example():
    """H = 4, k = 2: ``[W0 W1 W2 W3 V0 V1 V2 V3]`` becomes ``[W0 W1 V0 V1 W2 W3 V2 V3]``."""
    x = torch.arange(8)
    expected = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])
    assert torch.equal(interleave_glu_tensor(x, 2), expected)
    assert torch.equal(deinterleave_glu_tensor(expected, 2), x)
    # k = 1 alternates single rows; k = H leaves the layout unchanged.
    assert torch.equal(interleave_glu_tensor(x, 1), torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]))
    assert torch.equal(interleave_glu_tensor(x, 4), x)


def test_blocks_on_arange_weight_and_grouped():
    """Whole rows move for a weight; a grouped weight permutes dim 1 of each expert."""
    w = torch.arange(8 * 3).view(8, 3)
    expected = w[[0, 1, 4, 5, 2, 3, 6, 7]]
    assert torch.equal(interleave_glu_tensor(w, 2), expected)
    assert torch.equal(interleave_glu_tensor(w.t(), 2, dim=1), expected.t())

    grouped = torch.arange(2 * 8 * 3).view(2, 8, 3)
    out = interleave_glu_tensor(grouped, 2, dim=1)
    for e in range(2):
        assert torch.equal(out[e], grouped[e][[0, 1, 4, 5, 2, 3, 6, 7]])
    bias = torch.arange(2 * 8).view(2, 8)
    assert torch.equal(interleave_glu_tensor(bias, 2, dim=-1), bias[:, [0, 1, 4, 5, 2, 3, 6, 7]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", KS, ids=K_IDS)
@pytest.mark.parametrize(("shape", "dim"), LAYOUTS, ids=LAYOUT_IDS)
def test_interleave_is_the_index_permutation(device, k, shape, dim):
    x = _random(shape, torch.float32, device)
    index = _interleave_index(H, k).to(device)
    assert torch.equal(interleave_glu_tensor(x, k, dim=dim), x.index_select(dim, index))
    # dim passed positionally as well
    assert torch.equal(deinterleave_glu_tensor(x.index_select(dim, index), k, dim), x)


# 2. Round trips, dtypes, strides --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("k", KS, ids=K_IDS)
@pytest.mark.parametrize(("shape", "dim"), LAYOUTS, ids=LAYOUT_IDS)
def test_round_trips(device, dtype, k, shape, dim):
    """Both compositions are the identity, bitwise; the results are new contiguous tensors of the
    input's shape, dtype and device (also for k = H, where the layout does not change)."""
    x = _random(shape, dtype, device)
    il = interleave_glu_tensor(x, k, dim=dim)
    de = deinterleave_glu_tensor(x, k, dim=dim)
    for out in (il, de):
        assert out.shape == x.shape
        assert out.dtype == dtype
        assert out.device == x.device
        assert out.is_contiguous()
        assert out.data_ptr() != x.data_ptr()
    assert torch.equal(deinterleave_glu_tensor(il, k, dim=dim), x)
    assert torch.equal(interleave_glu_tensor(de, k, dim=dim), x)
    if k == H:
        assert torch.equal(il, x)
        assert torch.equal(de, x)


@pytest.mark.parametrize("device", DEVICES)
def test_interleave_changes_the_layout(device):
    """For k < H the two directions differ from the identity (else the round trips prove
    nothing), and for H / k > 2 blocks they differ from each other."""
    x = torch.randn(2 * H, 4, device=device)
    assert not torch.equal(interleave_glu_tensor(x, 3), x)
    assert not torch.equal(interleave_glu_tensor(x, 3), deinterleave_glu_tensor(x, 3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", KS, ids=K_IDS)
def test_non_contiguous_input(device, k):
    """A transposed weight, a sliced one and a grouped weight stored expert-minor give the same
    values as their contiguous copies, and a contiguous result."""
    index = _interleave_index(H, k).to(device)
    cases = [
        (torch.randn(5, 2 * H, device=device).t(), 0),  # [2H, 5], strides (1, 2H)
        (torch.randn(4 * H, 6, device=device)[::2, 1:], 0),  # every other row
        (torch.randn(2 * H, 5, 3, device=device).permute(2, 0, 1), 1),  # [3, 2H, 5]
    ]
    for x, dim in cases:
        assert not x.is_contiguous()
        out = interleave_glu_tensor(x, k, dim=dim)
        assert out.is_contiguous()
        assert torch.equal(out, interleave_glu_tensor(x.contiguous(), k, dim=dim))
        assert torch.equal(out, x.index_select(dim, index))
        back = deinterleave_glu_tensor(x, k, dim=dim)
        assert back.is_contiguous()
        assert torch.equal(interleave_glu_tensor(back, k, dim=dim), x)


def test_empty_dims():
    """Zero rows (H = 0) and zero trailing columns are valid."""
    assert interleave_glu_tensor(torch.empty(0, 3), 2).shape == (0, 3)
    assert deinterleave_glu_tensor(torch.empty(2 * H, 0), 3).shape == (2 * H, 0)


# 3. Autograd ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", KS, ids=K_IDS)
@pytest.mark.parametrize(("shape", "dim"), LAYOUTS, ids=LAYOUT_IDS)
def test_gradients_are_the_permutation(device, dtype, k, shape, dim):
    """The gradient through interleave is the upstream gradient deinterleaved, and vice versa:
    bitwise, as for any permutation."""
    index = _interleave_index(H, k).to(device)
    inverse = torch.argsort(index)
    for fn, perm in ((interleave_glu_tensor, inverse), (deinterleave_glu_tensor, index)):
        x = _random(shape, dtype, device).requires_grad_()
        y = fn(x, k, dim=dim)
        assert y.requires_grad
        dy = _random(shape, dtype, device)
        y.backward(dy)
        assert torch.equal(x.grad, dy.index_select(dim, perm))


# 4. Equivalence with the gated activations' interleaved layout --------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", KS, ids=K_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_interleaved_weight_feeds_interleaved_swiglu(device, dtype, k, bias):
    """``swiglu(x @ interleave(W).T + interleave(b), glu_interleave_size=k)`` equals
    ``swiglu(x @ W.T + b)``: the FC1 output columns are a permutation of the contiguous ones
    (each column is the same dot product), so up to the activation's rounding (bitwise for
    k = H), and both match a float64 reference; so do the gradients of x, W and b."""
    x_ref, x = make_reference_and_test_tensors((2, 3, 16), dtype=dtype, device=device)
    w_ref, w = make_reference_and_test_tensors((2 * H, 16), dtype=dtype, device=device)
    b_ref, b = make_reference_and_test_tensors((2 * H,), dtype=dtype, device=device)
    x_il = x.detach().clone().requires_grad_()
    w_il = w.detach().clone().requires_grad_()
    b_il = b.detach().clone().requires_grad_()

    def fc1(inp, weight, bias_):
        return inp @ weight.t() + bias_ if bias else inp @ weight.t()

    y = activation.swiglu(fc1(x, w, b))
    y_il = activation.swiglu(
        fc1(x_il, interleave_glu_tensor(w_il, k), interleave_glu_tensor(b_il, k)),
        glu_interleave_size=k,
    )
    y_ref = activation.swiglu(fc1(x_ref, w_ref, b_ref))
    if k == H:
        assert torch.equal(y_il, y)
    else:
        assert_close(y_il, y, dtype)
    assert_close(y_il, y_ref, dtype, roundings=2)  # FC1 output, then the activation

    dy = torch.randn(y.shape, device=device).to(dtype)
    y.backward(dy)
    y_il.backward(dy)
    y_ref.backward(dy.to(device="cpu", dtype=torch.float64))
    # dx sums over 2H columns, dW/db over tokens, of products of rounded activation gradients.
    for actual, contiguous, ref in ((x_il, x, x_ref), (w_il, w, w_ref), (b_il, b, b_ref)):
        if ref is b_ref and not bias:
            assert actual.grad is None
            continue
        assert_close(actual.grad, contiguous.grad, dtype, roundings=2, reduced=True)
        assert_close(actual.grad, ref.grad, dtype, roundings=2, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_grouped_weight_feeds_interleaved_swiglu(device):
    """Per expert of a grouped weight ``[E, 2H, in]`` interleaved with ``dim=1``."""
    k = 3
    x = torch.randn(3, 5, 16, device=device)
    w = torch.randn(3, 2 * H, 16, device=device)
    w_il = interleave_glu_tensor(w, k, dim=1)
    y = activation.swiglu(torch.bmm(x, w.transpose(1, 2)))
    y_il = activation.swiglu(torch.bmm(x, w_il.transpose(1, 2)), glu_interleave_size=k)
    assert_close(y_il, y, torch.float32)
    assert not torch.equal(activation.swiglu(torch.bmm(x, w_il.transpose(1, 2))), y)


# 5. torch.compile -----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", KS, ids=K_IDS)
@pytest.mark.parametrize(("shape", "dim"), LAYOUTS[:3], ids=LAYOUT_IDS[:3])
def test_compiled_equals_eager_in_one_graph(device, k, shape, dim):
    """Both functions, forward and backward, fullgraph-compiled in one frame, bitwise equal to
    eager."""

    def fn(t):
        il = interleave_glu_tensor(t, k, dim=dim)
        return il, deinterleave_glu_tensor(t, k, dim), deinterleave_glu_tensor(il * 2, k, dim=dim)

    compiled, counter = compile_counted(fn)
    x = torch.randn(shape, device=device, requires_grad=True)
    twin = x.detach().clone().requires_grad_()
    outs, outs_eager = compiled(x), fn(twin)
    for out, out_eager in zip(outs, outs_eager, strict=True):
        assert torch.equal(out, out_eager)
        assert out.is_contiguous()
    torch.cat([o.flatten() for o in outs]).square().sum().backward()
    torch.cat([o.flatten() for o in outs_eager]).square().sum().backward()
    assert torch.equal(x.grad, twin.grad)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_dynamic_rows_no_recompile(device):
    """With dynamic shapes, another valid row count reuses the graph."""
    compiled, counter = compile_counted(lambda t: interleave_glu_tensor(t, 2), dynamic=True)
    for rows in (8, 16, 24):
        x = torch.randn(rows, 3, device=device)
        assert torch.equal(compiled(x), interleave_glu_tensor(x, 2))
    assert counter.frame_count == 1


# 6. Bad input ---------------------------------------------------------------------------------

BAD_INPUTS = [
    # (id, tensor shape, interleave_size, dim, message fragment)
    ("k_zero", (8,), 0, 0, "interleave_size must be positive, got 0"),
    ("k_negative", (8,), -2, 0, "interleave_size must be positive, got -2"),
    ("k_float", (8,), 2.0, 0, "interleave_size must be an int, got float 2.0"),
    ("k_bool", (8,), True, 0, "interleave_size must be an int, got bool True"),
    ("k_none", (8,), None, 0, "interleave_size must be an int, got NoneType None"),
    ("zero_dim", (), 1, 0, "tensor must have at least 1 dimension (the GLU dim), got a 0-dim"),
    ("dim_too_large", (8, 3), 1, 2, "dim (=2) out of range for a 2-dim tensor of shape [8, 3]"),
    ("dim_too_small", (8, 3), 1, -3, "(expected -2 <= dim < 2)"),
    ("dim_float", (8, 3), 1, 0.0, "dim must be an int, got float 0.0"),
    (
        "not_divisible",
        (30,),
        4,
        0,
        "tensor.shape[0] (=30) must be divisible by 2 * interleave_size",
    ),
    ("not_divisible_8", (30,), 4, 0, "(=30) must be divisible by 2 * interleave_size (=8)"),
    ("odd", (3, 7), 1, -1, "tensor.shape[-1] (=7) must be divisible by 2 * interleave_size (=2)"),
    ("k_above_H", (2, 8), 8, 1, "tensor.shape[1] (=8) must be divisible by 2 * interleave_size"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("fn", [interleave_glu_tensor, deinterleave_glu_tensor])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bad_input_raises_clear_error(case, fn, mode):
    _id, shape, k, dim, message = case

    def call(t):
        return fn(t, k, dim=dim)

    x = torch.randn(shape)
    if mode == "compiled":
        # Raised at trace time from static shapes; fullgraph dynamo wraps it, naming the
        # ValueError and its message.
        with pytest.raises(Exception) as info:
            compile_counted(call, backend="aot_eager")[0](x)
        assert "ValueError" in str(info.value)
    else:
        with pytest.raises(ValueError) as info:
            call(x)
    assert f"{fn.__name__}: " in str(info.value)
    assert message in str(info.value)
