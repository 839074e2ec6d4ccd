"""te::linear_fwd / te::linear_bwd beyond the registry test: shapes, gradient subsets,
main_grad accumulation, autocast, aliasing, and bad input in eager and under compile."""

from __future__ import annotations

import pytest
import torch

import te_compile.functional as tef
from tests.utils import DEVICES, assert_close, compile_counted, make_reference_and_test_tensors

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
    out, saved = torch.ops.te.linear_fwd(x, w, b, None)
    assert saved == []
    storages = {t.untyped_storage().data_ptr() for t in (x, w, b)}
    assert out.untyped_storage().data_ptr() not in storages
    grads = torch.ops.te.linear_bwd(
        torch.randn(4, 3), x.detach(), w.detach(), None, True, True, True
    )
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
