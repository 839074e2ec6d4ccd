"""LayerNorm, RMSNorm and L2 normalisation beyond the registry test: forward and backward against
independent float64 references over dtypes, odd shapes and options; statistics; compiled equals
eager; autocast; bad input in eager and under compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import te_compile as te
from te_compile import _library
from te_compile.functional import norm
from tests.samples import SAMPLES
from tests.utils import (
    DEVICES,
    assert_close,
    compile_counted,
    dtype_tols,
    make_reference_and_test_tensors,
    to_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(13,), (1, 1), (1, 7), (3, 129), (2, 3, 37), (37, 1000)]
KINDS = ["layernorm", "rmsnorm", "l2normalization"]


def _expected(kind, x, w, b, eps, zero_centered_gamma):
    """float64 reference from torch's own ops (independent of te_compile's ``*_ref``)."""
    if kind == "l2normalization":
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    gamma = w + 1 if zero_centered_gamma else w
    if kind == "layernorm":
        return F.layer_norm(x, x.shape[-1:], gamma, b, eps)
    return F.rms_norm(x, x.shape[-1:], gamma, eps)


def _call(kind, x, w, b, eps, zero_centered_gamma):
    if kind == "layernorm":
        return norm.layernorm(x, w, b, eps, zero_centered_gamma)
    if kind == "rmsnorm":
        return norm.rmsnorm(x, w, eps, zero_centered_gamma)
    return norm.l2normalization(x, eps)


def _make(kind, shape, dtype, device, *, weight_dtype=None, bias=True):
    """(reference tensors, test tensors) for x, weight, bias; None where the op takes none."""
    n = shape[-1]
    x_ref, x = make_reference_and_test_tensors(shape, dtype=dtype, device=device)
    if kind == "l2normalization":
        return (x_ref, None, None), (x, None, None)
    w_ref, w = make_reference_and_test_tensors((n,), dtype=weight_dtype or dtype, device=device)
    if kind == "layernorm" and bias:
        b_ref, b = make_reference_and_test_tensors((n,), dtype=weight_dtype or dtype, device=device)
    else:
        b_ref = b = None
    return (x_ref, w_ref, b_ref), (x, w, b)


# (kind, zero_centered_gamma, bias, fp32 weight with low-precision input)
OPTIONS = [
    *[(k, False, True, False) for k in ("layernorm", "rmsnorm")],
    *[(k, True, False, True) for k in ("layernorm", "rmsnorm")],
    ("layernorm", True, True, False),
    ("l2normalization", False, False, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "kind, zero_centered_gamma, bias, fp32_weight",
    OPTIONS,
    ids=["-".join(str(v) for v in o) for o in OPTIONS],
)
def test_matches_float64_reference(device, dtype, shape, kind, zero_centered_gamma, bias,
                                   fp32_weight):  # fmt: skip
    weight_dtype = torch.float32 if fp32_weight else dtype
    eps = 1e-5
    (x_ref, w_ref, b_ref), (x, w, b) = _make(
        kind, shape, dtype, device, weight_dtype=weight_dtype, bias=bias
    )
    y_ref = _expected(kind, x_ref, w_ref, b_ref, eps, zero_centered_gamma)
    dy_ref, dy = make_reference_and_test_tensors(shape, dtype=dtype, device=device)
    y_ref.backward(dy_ref)
    y = _call(kind, x, w, b, eps, zero_centered_gamma)
    y.backward(dy)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(y, y_ref, dtype)
    if kind == "layernorm" and shape[-1] == 1:
        # One element per row: dx = rsigma * (g - mean(g)) is 0 by the cancellation of two terms
        # of size |g| * rsigma with rsigma = eps**-0.5, so a GPU kernel's fp32 rounding of g
        # (fused multiply-adds) shows up at one fp32 rounding of those terms, not at 0.
        gamma = w_ref + 1 if zero_centered_gamma else w_ref
        terms = (dy_ref * gamma).abs().max().item() * eps**-0.5
        bound = dtype_tols(torch.float32)["rtol"] * terms
        assert x.grad.detach().abs().max().item() <= bound
    else:
        assert_close(x.grad, x_ref.grad, dtype)
    if w is not None:
        assert w.grad.dtype == weight_dtype
        assert_close(w.grad, w_ref.grad, weight_dtype)
    if b is not None:
        assert_close(b.grad, b_ref.grad, weight_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_statistics_are_fp32_row_stats(device, dtype):
    x_ref, x = make_reference_and_test_tensors((2, 5, 24), dtype=dtype, device=device)
    w = torch.randn(24, device=device, dtype=dtype, requires_grad=True)
    eps = 1e-5
    _out, mean, rsigma = torch.ops.te.layernorm_fwd(x, w, None, eps, False)
    _out, rms_rsigma = torch.ops.te.rmsnorm_fwd(x, w, eps, False)
    _out, l2_rsigma = torch.ops.te.l2normalization_fwd(x, eps)
    expected = {
        "mean": (mean, x_ref.mean(-1)),
        "layernorm rsigma": (rsigma, torch.rsqrt(x_ref.var(-1, unbiased=False) + eps)),
        "rmsnorm rsigma": (rms_rsigma, torch.rsqrt((x_ref * x_ref).mean(-1) + eps)),
        "l2 rsigma": (l2_rsigma, torch.rsqrt((x_ref * x_ref).sum(-1) + eps)),
    }
    for name, (stat, ref) in expected.items():
        assert stat.dtype == torch.float32 and stat.shape == (2, 5), name
        assert not stat.requires_grad, f"{name} must not be a differentiable output"
        # Computed in fp32 from dtype-representable inputs: fp32-accurate.
        assert_close(stat, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_centered_gamma_is_weight_plus_one(device):
    x = torch.randn(6, 40, device=device)
    w = torch.randn(40, device=device)
    b = torch.randn(40, device=device)
    assert torch.equal(norm.layernorm(x, w, b, 1e-5, True), norm.layernorm(x, w + 1, b, 1e-5))
    assert torch.equal(norm.rmsnorm(x, w, 1e-5, True), norm.rmsnorm(x, w + 1, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_input(device, kind):
    _, (_, w, b) = _make(kind, (4, 24), torch.float32, device)
    x = torch.randn(24, 5, device=device).t()  # [5, 24], last dim strided
    y = _call(kind, x, w, b, 1e-5, False)
    assert y.is_contiguous()
    assert torch.equal(y, _call(kind, x.contiguous(), w, b, 1e-5, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_empty_rows(device, kind):
    _, (x, w, b) = _make(kind, (0, 16), torch.float32, device)
    y = _call(kind, x, w, b, 1e-5, False)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 16)
    if w is not None:
        assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("device", DEVICES)
def test_only_needed_gradients_are_returned(device):
    x = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(8, device=device)  # frozen
    b = torch.randn(8, device=device, requires_grad=True)
    norm.layernorm(x, w, b).sum().backward()
    assert x.grad is not None and w.grad is None and b.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_compiled_equals_eager(device, kind):
    """The traced program (fullgraph, dynamic shapes; aot_eager runs it without Inductor's code
    generation) is the same implementation: bitwise equal to eager, with one frame for several
    row counts."""
    fn, counter = compile_counted(
        lambda x, w, b: _call(kind, x, w, b, 1e-5, True), backend="aot_eager", dynamic=True
    )
    for rows in (3, 5, 8):
        args = _make(kind, (rows, 20), torch.bfloat16, device, weight_dtype=torch.float32)[1]
        twin = tuple(None if a is None else a.detach().clone().requires_grad_() for a in args)
        y = fn(*args)
        y_eager = _call(kind, *twin, 1e-5, True)
        assert torch.equal(y, y_eager)
        y.float().square().sum().backward()
        y_eager.float().square().sum().backward()
        for a, t in zip(args, twin, strict=True):
            if a is not None:
                assert torch.equal(a.grad, t.grad)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_in_autocast_dtype(device):
    low = torch.bfloat16
    x = torch.randn(4, 16, device=device)
    w = torch.randn(16, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    with torch.autocast(device_type=device, dtype=low):
        y = norm.layernorm(x, w, b)
        compiled_fn, _ = compile_counted(lambda x: norm.layernorm(x, w, b))
        y_compiled = compiled_fn(x)
    expected = F.layer_norm(*to_reference((x.to(low), (16,), w.to(low), b.to(low))))
    for out in (y, y_compiled):
        assert out.dtype == low
    assert_close(y, expected, low)
    # Inductor keeps fused intermediates in fp32 (the autocast casts of the inputs included).
    assert_close(y_compiled, expected, low, roundings=2, reduced=True)
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_ops_are_registered_for_the_registry_and_fast_path_tests():
    """tests/test_registry.py and tests/test_library.py walk every registered differentiable op
    with sample inputs; the norm ops must be among them."""
    entries = _library.registry()
    for kind in KINDS:
        fwd, bwd = f"te::{kind}_fwd", f"te::{kind}_bwd"
        assert {fwd, bwd} <= set(te.list_ops())
        assert fwd in SAMPLES and entries[fwd].differentiable
        assert entries[bwd].differentiable is entries[fwd].differentiable


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


BAD_INPUTS = [
    ("eps zero", "layernorm", lambda: (_t(4, 8), _t(8), None, 0.0), "eps must be > 0"),
    ("eps negative", "rmsnorm", lambda: (_t(4, 8), _t(8), None, -1e-5), "eps must be > 0"),
    ("l2 eps", "l2normalization", lambda: (_t(4, 8), None, None, 0.0), "eps must be > 0"),
    ("eps inf", "layernorm", lambda: (_t(4, 8), _t(8), None, math.inf), "finite, got inf"),
    ("eps nan", "rmsnorm", lambda: (_t(4, 8), _t(8), None, math.nan), "finite, got nan"),
    ("l2 eps inf", "l2normalization", lambda: (_t(4, 8), None, None, math.inf), "finite, got inf"),
    ("weight shape", "layernorm", lambda: (_t(4, 8), _t(7), None, 1e-5), "weight must have shape"),
    ("weight rank", "rmsnorm", lambda: (_t(4, 8), _t(1, 8), None, 1e-5), "weight must have shape"),
    (
        "weight dtype",
        "layernorm",
        lambda: (_t(4, 8, dtype=torch.bfloat16), _t(8, dtype=torch.float16), None, 1e-5),
        "weight.dtype (torch.float16) must be torch.float32 or equal inp.dtype",
    ),
    (
        "weight fp64 with fp32 input",
        "rmsnorm",
        lambda: (_t(4, 8), _t(8, dtype=torch.float64), None, 1e-5),
        "weight.dtype (torch.float64)",
    ),
    ("bias shape", "layernorm", lambda: (_t(4, 8), _t(8), _t(9), 1e-5), "bias must have"),
    (
        "bias dtype",
        "layernorm",
        lambda: (_t(4, 8), _t(8), _t(8, dtype=torch.bfloat16), 1e-5),
        "bias.dtype (torch.bfloat16) must equal weight.dtype",
    ),
    (
        "int input",
        "l2normalization",
        lambda: (torch.ones(4, 8, dtype=torch.int32), None, None, 1e-6),
        "inp.dtype must be a floating type",
    ),
    ("empty last dim", "rmsnorm", lambda: (_t(4, 0), _t(0), None, 1e-5), "non-empty last dim"),
]


def _op_call(kind, x, w, b, eps):
    if kind == "layernorm":
        return torch.ops.te.layernorm_fwd(x, w, b, eps, False)
    if kind == "rmsnorm":
        return torch.ops.te.rmsnorm_fwd(x, w, eps, False)
    return torch.ops.te.l2normalization_fwd(x, eps)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_zero_centered_gamma_must_be_a_bool(kind, compiled):
    """A truthy string would switch the weight offset on silently."""
    fn = lambda x, w: _call(kind, x, w, None, 1e-5, "no")  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    match = rf"te\.{kind}: zero_centered_gamma must be a bool \(True or False\), got 'no'"
    with pytest.raises(Exception if compiled else ValueError, match=match):
        fn(_t(4, 8), _t(8))


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["fast", "op", "compiled"])
def test_bad_input_raises_clear_error(case, mode):
    _name, kind, make, message = case
    x, w, b, eps = make()
    if mode == "fast":
        fn = lambda x, w, b: _call(kind, x, w, b, eps, False)  # noqa: E731
    elif mode == "op":
        fn = lambda x, w, b: _op_call(kind, x, w, b, eps)  # noqa: E731
    else:
        fn = torch.compile(
            lambda x, w, b: _call(kind, x, w, b, eps, False), fullgraph=True, backend="aot_eager"
        )
    with pytest.raises(Exception, match=rf"te\.{kind}: ") as info:
        fn(x, w, b)
    assert message in str(info.value)
    if mode != "compiled":
        assert info.type is ValueError
