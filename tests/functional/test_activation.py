"""Element-wise and gated activations (``te_compile.functional.activation``) beyond the registry
test: every public function, forward and backward, against float64 references written here with
plain torch ops, over dtypes and shapes; the interleaved gated layout; the fused bias and its
dbias; which gradients are computed; compiled equals eager; autocast; bad input in eager and under
compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import te_compile as te
from te_compile import _library
from te_compile.functional import activation
from tests.samples import SAMPLES
from tests.utils import (
    DEVICES,
    assert_close,
    assert_matches_eager,
    compile_counted,
    make_reference_and_test_tensors,
    to_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# float64 references from torch's own ops (independent of te_compile's *_ref) ------------------


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.relu(x).square()


ELEMENTWISE = {"gelu": _gelu, "qgelu": _qgelu, "relu": torch.relu, "srelu": _srelu, "silu": F.silu}
# The function each gated name applies to its activation half (clamped_swiglu: see _expected).
GATED = {
    "glu": torch.sigmoid,
    "geglu": _gelu,
    "qgeglu": _qgelu,
    "reglu": torch.relu,
    "sreglu": _srelu,
    "swiglu": F.silu,
    "clamped_swiglu": None,
    "situglu": None,
}
NAMES = [*ELEMENTWISE, *GATED]

# Non-default clamped_swiglu parameters: randn inputs cross +-limit, so both clamps cut, and 0.75
# is a bf16/fp16 number, so some low-precision inputs sit exactly on a bound.
CLAMP = {"limit": 0.75, "alpha": 1.5, "glu_linear_offset": 0.5}
CLAMP_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}
# situglu's slots: beta1 in limit, beta2 in alpha, no offset. Small betas so that randn inputs
# reach the bent part of both tanh caps.
SITU = {"limit": 0.5, "alpha": 0.75, "glu_linear_offset": 0.0}


def _params(name):
    """The gated ops' parameter slots for ``name`` (the other names ignore CLAMP's)."""
    return SITU if name == "situglu" else CLAMP


def _expected(name, x, bias=None, clamp=None):
    """float64 reference of ``name`` applied to ``x + bias`` (contiguous halves when gated)."""
    clamp = CLAMP if clamp is None else clamp
    if bias is not None:
        x = x + bias
    if name in ELEMENTWISE:
        return ELEMENTWISE[name](x)
    a, lin = x.chunk(2, dim=-1)
    if name == "situglu":
        b1, b2 = SITU["limit"], SITU["alpha"]
        gate = b1 * torch.tanh(a / b1) / (1 + torch.exp(-a))
        return gate * b2 * torch.tanh(lin / b2)
    if name == "clamped_swiglu":
        limit = clamp["limit"]
        c = a.clamp(max=limit)
        gate = c * torch.sigmoid(clamp["alpha"] * c)
        return gate * (lin.clamp(-limit, limit) + clamp["glu_linear_offset"])
    return GATED[name](a) * lin


def _call(name, x, k=None):
    """The public function of ``name`` (clamped_swiglu with CLAMP)."""
    if name in ELEMENTWISE:
        assert k is None
        return getattr(activation, name)(x)
    if name == "clamped_swiglu":
        return activation.clamped_swiglu(x, **CLAMP, glu_interleave_size=k)
    if name == "situglu":  # no public function: te.ops.SiTUGLU calls bias_activation
        return activation.bias_activation(x, None, name, k, **SITU)
    return getattr(activation, name)(x, k)


def _interleave_index(h, k):
    """Column ``j`` of the interleaved layout ``[a_0:k, l_0:k, a_k:2k, l_k:2k, ...]`` holds
    column ``index[j]`` of the contiguous layout ``[a, l]``."""
    index = []
    for start in range(0, h, k):
        index += range(start, start + k)
        index += range(h + start, h + start + k)
    return torch.tensor(index)


@pytest.fixture(params=["fast", "op"])
def eager_path(request):
    """Both eager paths of the op mechanism: the fast path and the dispatcher (op) path."""
    previous = te.eager_fast_path_enabled()
    te.set_eager_fast_path(request.param == "fast")
    yield request.param
    te.set_eager_fast_path(previous)


# 1. Every public function against float64 -----------------------------------------------------

ELEMENTWISE_SHAPES = [(1, 37), (7, 37), (2, 3, 37), (1, 65536)]
GATED_SHAPES = [(1, 2 * 37), (7, 2 * 37), (2, 3, 2 * 37), (1, 65536)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape_index", range(4), ids=["one_row", "rows", "3d", "wide"])
@pytest.mark.parametrize("name", NAMES)
def test_matches_float64_reference(device, dtype, shape_index, name):
    shape = (GATED_SHAPES if name in GATED else ELEMENTWISE_SHAPES)[shape_index]
    x_ref, x = make_reference_and_test_tensors(shape, dtype=dtype, device=device)
    y_ref = _expected(name, x_ref)
    dy_ref, dy = make_reference_and_test_tensors(
        y_ref.shape, dtype=dtype, device=device, requires_grad=False
    )
    y_ref.backward(dy_ref)
    y = _call(name, x)
    y.backward(dy)
    assert y.shape == y_ref.shape and y.dtype == dtype and y.device == x.device
    assert_close(y, y_ref, dtype)
    assert x.grad.dtype == dtype
    assert_close(x.grad, x_ref.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamped_swiglu_passes_gradient_at_the_bounds(device, dtype):
    """Inputs below, on and above each bound: gradient flows inside the range, bounds included
    (as torch.clamp), and stops outside."""
    limit = CLAMP["limit"]
    a = torch.tensor([-2.0, -limit, 0.25, limit, 2.0, limit])
    lin = torch.tensor([2.0, limit, -limit, -2.0, 0.25, 1.0])
    x = torch.cat([a, lin]).repeat(3, 1).to(device=device, dtype=dtype).requires_grad_()
    x_ref = to_reference(x)
    y_ref = _expected("clamped_swiglu", x_ref)
    y_ref.backward(torch.ones_like(y_ref))
    y = _call("clamped_swiglu", x)
    y.backward(torch.ones_like(y))
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, x_ref.grad, dtype)
    # The expectation itself: a = 2 (above limit) and l = +-2 (outside) get no gradient, the
    # bound values do.
    grad_a, grad_lin = x.grad[0].float().cpu().chunk(2)
    assert grad_a[4] == 0 and grad_lin[0] == 0 and grad_lin[3] == 0
    assert grad_a[3] != 0 and grad_lin[1] != 0 and grad_lin[2] != 0


@pytest.mark.parametrize("device", DEVICES)
def test_clamped_swiglu_defaults(device):
    """limit=7, alpha=1.702, glu_linear_offset=1 when not given (inputs wide enough to clamp)."""
    x_ref, x = make_reference_and_test_tensors((16, 64), device=device)
    with torch.no_grad():
        x.mul_(5)
        x_ref.mul_(5)
    y_ref = _expected("clamped_swiglu", x_ref, clamp=CLAMP_DEFAULTS)
    assert (x_ref.abs() > CLAMP_DEFAULTS["limit"]).any()
    y_ref.backward(torch.ones_like(y_ref))
    y = activation.clamped_swiglu(x)
    y.backward(torch.ones_like(y))
    assert_close(y, y_ref, torch.float32)
    assert_close(x.grad, x_ref.grad, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_input(device, name):
    """A strided input gives the contiguous output the fake promises (else compiled code, which
    trusts the fake's strides, fails), equal to that of the contiguous input."""
    x = torch.randn(48, 5, device=device).t().requires_grad_()  # [5, 48], last dim strided
    b = torch.randn(48, device=device)
    y = activation.bias_activation(x, b, name, **_params(name))
    assert y.is_contiguous()
    assert torch.equal(y, activation.bias_activation(x.contiguous(), b, name, **_params(name)))
    if name in ELEMENTWISE:
        op, args = torch.ops.te.activation_fwd.default, (x, b, name)
    else:
        op, args = (
            torch.ops.te.gated_activation_fwd.default,
            (x, b, name, 0, *_params(name).values()),
        )
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_empty_rows(device, name):
    x = torch.randn(0, 16, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    y = activation.bias_activation(x, b, name, **_params(name))
    y.sum().backward()
    assert y.shape == (0, 8 if name in GATED else 16) and x.grad.shape == (0, 16)
    assert torch.equal(b.grad, torch.zeros_like(b))


# 2. Interleaved gated layout ------------------------------------------------------------------

H = 24


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 6, H], ids=["k1", "k_divides_H", "k_H"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("name", list(GATED))
def test_interleaved_layout_equals_contiguous(device, dtype, k, bias, name):
    """``glu_interleave_size=k`` on the interleaved input gives the contiguous result, and the
    interleaved gradients (dinp, dbias) are the contiguous ones, interleaved: up to the format's
    rounding (the CPU math vectorises differently over strided halves), bitwise for k = H (the
    interleaved layout is then the contiguous one)."""
    x_ref, x = make_reference_and_test_tensors((2, 3, 2 * H), dtype=dtype, device=device)
    b_ref, b = make_reference_and_test_tensors((2 * H,), dtype=dtype, device=device)
    if not bias:
        b_ref = b = None
    index = _interleave_index(H, k).to(device)
    assert sorted(index.tolist()) == list(range(2 * H))
    x_il = x.detach()[..., index].requires_grad_()
    b_il = None if b is None else b.detach()[index].requires_grad_()
    if bias:
        y = activation.bias_activation(x, b, name, **_params(name))
        y_il = activation.bias_activation(x_il, b_il, name, k, **_params(name))
    else:
        y = _call(name, x)
        y_il = _call(name, x_il, k)
    y_ref = _expected(name, x_ref, b_ref)

    def check_same(actual, expected, reduced=False):
        if k == H:
            assert torch.equal(actual, expected)
        else:
            assert_close(actual, expected, dtype, reduced=reduced)

    check_same(y_il, y)
    assert_close(y_il, y_ref, dtype)

    dy = torch.randn(y.shape, device=device, dtype=dtype)
    y.backward(dy)
    y_il.backward(dy)
    y_ref.backward(to_reference(dy))
    check_same(x_il.grad, x.grad[..., index])
    assert_close(x_il.grad, x_ref.grad[..., index.cpu()], dtype)
    if bias:
        check_same(b_il.grad, b.grad[index], reduced=True)
        assert_close(b_il.grad, b_ref.grad[index.cpu()], dtype, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(GATED))
def test_interleave_size_none_zero_and_half_are_contiguous(device, name):
    x = torch.randn(4, 2 * 37, device=device)
    y = _call(name, x)
    for k in (0, 37):
        assert torch.equal(_call(name, x, k), y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["swiglu", "reglu"])
def test_interleaved_layout_is_not_contiguous(device, name):
    """The interleave size changes the result (else the layout tests above prove nothing)."""
    x = torch.randn(4, 2 * H, device=device)
    assert not torch.equal(_call(name, x, 6), _call(name, x))


# 3. Fused bias --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_bias_activation_matches_float64_reference(device, dtype, name, eager_path):
    shape = (4, 5, 2 * 37)  # 20 rows summed into dbias
    x_ref, x = make_reference_and_test_tensors(shape, dtype=dtype, device=device)
    b_ref, b = make_reference_and_test_tensors(shape[-1:], dtype=dtype, device=device)
    y_ref = _expected(name, x_ref, b_ref)
    dy_ref, dy = make_reference_and_test_tensors(
        y_ref.shape, dtype=dtype, device=device, requires_grad=False
    )
    y_ref.backward(dy_ref)
    # The clamped_swiglu parameters are passed for every name: the others ignore them.
    y = activation.bias_activation(x, b, name, **_params(name))
    y.backward(dy)
    assert y.shape == y_ref.shape and y.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, x_ref.grad, dtype)
    assert b.grad.shape == b.shape and b.grad.dtype == dtype
    assert_close(b.grad, b_ref.grad, dtype, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_bias_none_is_the_plain_activation(device, name, eager_path):
    x = torch.randn(3, 2 * H, device=device, requires_grad=True)
    twin = x.detach().clone().requires_grad_()
    y = activation.bias_activation(x, None, name, **_params(name))
    y_plain = _call(name, twin)
    assert torch.equal(y, y_plain)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_plain.backward(dy)
    assert torch.equal(x.grad, twin.grad)


_BWD_OPS = (torch.ops.te.activation_bwd.default, torch.ops.te.gated_activation_bwd.default)


class _RecordBackwardOps(TorchDispatchMode):
    """Records the arguments and outputs of every te activation backward op call (forces the op
    path)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _BWD_OPS:
            self.calls.append((args, out))
        return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["silu", "geglu", "clamped_swiglu"])
@pytest.mark.parametrize("frozen", ["bias", "inp"])
@pytest.mark.parametrize("mode", ["fast", "op", "recorded"])
def test_only_needed_gradients_are_computed(device, name, frozen, mode):
    """A frozen bias gets no gradient and no dbias is computed (need_dbias=False); a frozen
    input gets no gradient while the bias's is still right."""
    x_ref, x = make_reference_and_test_tensors(
        (6, 2 * H), device=device, requires_grad=frozen != "inp"
    )
    b_ref, b = make_reference_and_test_tensors(
        (2 * H,), device=device, requires_grad=frozen != "bias"
    )
    y_ref = _expected(name, x_ref, b_ref)
    y_ref.backward(torch.ones_like(y_ref))
    previous = te.eager_fast_path_enabled()
    te.set_eager_fast_path(mode == "fast")
    recorder = _RecordBackwardOps()
    try:
        if mode == "recorded":
            with recorder:
                activation.bias_activation(x, b, name, **_params(name)).sum().backward()
        else:
            activation.bias_activation(x, b, name, **_params(name)).sum().backward()
    finally:
        te.set_eager_fast_path(previous)
    if frozen == "bias":
        assert b.grad is None
        assert_close(x.grad, x_ref.grad, torch.float32)
    else:
        assert x.grad is None
        assert_close(b.grad, b_ref.grad, torch.float32, reduced=True)
    if mode == "recorded":
        ((args, (_dinp, dbias)),) = recorder.calls
        assert args[-1] is (frozen != "bias"), "need_dbias"
        assert dbias.numel() == (0 if frozen == "bias" else 2 * H)


# 4. torch.compile -----------------------------------------------------------------------------

COMPILE_CASES = [
    ("gelu", None, False),
    ("srelu", None, True),
    ("swiglu", None, False),
    ("geglu", 4, True),
    ("clamped_swiglu", 2, True),
    ("situglu", 2, True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "name, k, bias", COMPILE_CASES, ids=[f"{n}-k{k}-bias{b}" for n, k, b in COMPILE_CASES]
)
def test_compiled_equals_eager(device, name, k, bias):
    """Compiled (fullgraph, dynamic shapes) runs the same implementation: bitwise equal to eager,
    forward and backward, and no recompile for new row counts after the first call (which may
    count two frames: dynamo restarts its analysis once for the float arguments)."""

    def fn(x, b, limit, alpha, glu_linear_offset):
        return activation.bias_activation(
            x, b, name, k, limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset
        )

    compiled, counter = compile_counted(fn, dynamic=True)
    frames_after_first = None
    for rows in (3, 5, 8, 13):
        x = torch.randn(rows, 2, 2 * H, device=device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(2 * H, device=device, dtype=torch.bfloat16, requires_grad=True)
        if not bias:
            b = None
        x_twin = x.detach().clone().requires_grad_()
        b_twin = None if b is None else b.detach().clone().requires_grad_()
        y = compiled(x, b, *_params(name).values())
        y_eager = fn(x_twin, b_twin, *_params(name).values())
        assert torch.equal(y, y_eager)
        y.float().square().sum().backward()
        y_eager.float().square().sum().backward()
        assert torch.equal(x.grad, x_twin.grad)
        if bias:
            assert torch.equal(b.grad, b_twin.grad)
        if frames_after_first is None:
            frames_after_first = counter.frame_count
            assert frames_after_first >= 1
    assert counter.frame_count == frames_after_first, "recompiled for a new row count"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_public_functions_compile_in_one_graph(device, layout):
    """All twelve public functions in one fullgraph compile: one frame, equal to eager; also on a
    strided input (inductor checks the op outputs' strides against the fakes')."""

    def fn(x):
        outs = [_call(name, x) for name in ELEMENTWISE]
        outs += [_call(name, x, 4) for name in GATED]
        return torch.cat([o.flatten() for o in outs])

    compiled, counter = compile_counted(fn)
    x = torch.randn(5, 2 * H, device=device)
    if layout == "strided":
        x = x.t().contiguous().t()
        assert not x.is_contiguous()
    x.requires_grad_()
    twin = x.detach().clone().requires_grad_()
    y = compiled(x)
    y_eager = fn(twin)
    assert_matches_eager(y, y_eager)
    y.square().sum().backward()
    y_eager.square().sum().backward()
    assert_matches_eager(x.grad, twin.grad, roundings=4)
    assert counter.frame_count == 1


# 5. Autocast ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gelu", "swiglu", "clamped_swiglu"])
def test_autocast_runs_in_autocast_dtype(device, name):
    low = torch.bfloat16
    x = torch.randn(4, 2 * H, device=device, requires_grad=True)
    b = torch.randn(2 * H, device=device, requires_grad=True)
    with torch.autocast(device_type=device, dtype=low):
        y_plain = _call(name, x)
        y = activation.bias_activation(x, b, name, **_params(name))
        compiled_fn, _ = compile_counted(
            lambda x: activation.bias_activation(x, b, name, **_params(name))
        )
        y_compiled = compiled_fn(x)
    assert y_plain.dtype == low
    assert_close(y_plain, _expected(name, to_reference(x.to(low))), low)
    expected = _expected(name, *to_reference((x.to(low), b.to(low))))
    for out in (y, y_compiled):
        assert out.dtype == low
    assert_close(y, expected, low)
    # Inductor keeps fused intermediates in fp32 (the autocast casts of the inputs included).
    assert_close(y_compiled, expected, low, roundings=2, reduced=True)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


# 6. Registration ------------------------------------------------------------------------------


def test_ops_are_registered_for_the_registry_and_fast_path_tests():
    entries = _library.registry()
    assert set(activation.ACTIVATIONS) == set(ELEMENTWISE)
    assert set(activation.GATED_ACTIVATIONS) == set(GATED)
    for family in ("activation", "gated_activation"):
        fwd, bwd = f"te::{family}_fwd", f"te::{family}_bwd"
        assert {fwd, bwd} <= set(te.list_ops())
        assert fwd in SAMPLES and entries[fwd].differentiable
        assert entries[bwd].differentiable is entries[fwd].differentiable


# 7. Bad input ---------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


_EW = "te.activation: "
_GATED = "te.gated_activation: "
ba = activation.bias_activation

# (id, call, make (inp, bias), message naming the argument)
BAD_INPUTS = [
    (
        "odd last dim",
        lambda x, b: activation.swiglu(x),
        lambda: (_t(4, 7), None),
        _GATED + "inp.shape[-1] (7) must be even",
    ),
    (
        "odd last dim with bias",
        lambda x, b: ba(x, b, "geglu"),
        lambda: (_t(4, 7), _t(7)),
        _GATED + "inp.shape[-1] (7) must be even",
    ),
    (
        "interleave does not divide half",
        lambda x, b: activation.geglu(x, 4),
        lambda: (_t(4, 12), None),
        _GATED + "glu_interleave_size (4) must divide half the last dim, inp.shape[-1] // 2 = 6",
    ),
    (
        "interleave above half",
        lambda x, b: ba(x, b, "reglu", 8),
        lambda: (_t(4, 8), _t(8)),
        _GATED + "glu_interleave_size (8) must divide half the last dim",
    ),
    (
        "negative interleave",
        lambda x, b: activation.glu(x, -2),
        lambda: (_t(4, 8), None),
        "te.glu: glu_interleave_size must be an int >= 0, got -2",
    ),
    (
        "unknown activation",
        lambda x, b: ba(x, b, "tanh"),
        lambda: (_t(4, 8), None),
        "unknown activation 'tanh'",
    ),
    (
        "element-wise activation with interleave size",
        lambda x, b: ba(x, b, "gelu", 2),
        lambda: (_t(4, 8), _t(8)),
        _GATED + "activation must be a gated activation",
    ),
    (
        "gated activation to the element-wise op",
        lambda x, b: torch.ops.te.activation_fwd(x, b, "swiglu"),
        lambda: (_t(4, 8), None),
        _EW + "activation must be element-wise",
    ),
    (
        "bias shape",
        lambda x, b: ba(x, b, "relu"),
        lambda: (_t(4, 8), _t(7)),
        _EW + "bias must have shape [inp.shape[-1]] = [8], got [7]",
    ),
    (
        "gated bias of output width",
        lambda x, b: ba(x, b, "swiglu"),
        lambda: (_t(4, 8), _t(4)),
        _GATED + "bias must have shape [inp.shape[-1]] = [8], got [4]",
    ),
    (
        "bias rank",
        lambda x, b: ba(x, b, "silu"),
        lambda: (_t(4, 8), _t(1, 8)),
        _EW + "bias must have shape [inp.shape[-1]] = [8], got [1, 8]",
    ),
    (
        "bias dtype",
        lambda x, b: ba(x, b, "gelu"),
        lambda: (_t(4, 8), _t(8, dtype=torch.bfloat16)),
        _EW + "bias.dtype (torch.bfloat16) must equal inp.dtype (torch.float32)",
    ),
    (
        "gated bias dtype",
        lambda x, b: ba(x, b, "clamped_swiglu", 2),
        lambda: (_t(4, 8, dtype=torch.bfloat16), _t(8, dtype=torch.float16)),
        _GATED + "bias.dtype (torch.float16) must equal inp.dtype (torch.bfloat16)",
    ),
    (
        "integer input",
        lambda x, b: activation.relu(x),
        lambda: (torch.ones(4, 8, dtype=torch.int32), None),
        _EW + "inp.dtype must be a floating type, got torch.int32",
    ),
    (
        "gated integer input",
        lambda x, b: activation.swiglu(x),
        lambda: (torch.ones(4, 8, dtype=torch.int64), None),
        _GATED + "inp.dtype must be a floating type, got torch.int64",
    ),
    (
        "gated 0-d input",
        lambda x, b: activation.sreglu(x),
        lambda: (torch.tensor(1.0), None),
        _GATED + "inp must have at least 1 dimension",
    ),
    # clamped_swiglu's parameters: limit and alpha finite and > 0, glu_linear_offset finite.
    *(
        (
            f"clamped {arg}={value}",
            lambda x, b, arg=arg, value=value: activation.clamped_swiglu(x, **{arg: value}),
            lambda: (_t(4, 8), None),
            f"te.clamped_swiglu: {arg} must be a {kind}, got {value}",
        )
        for arg, kind, values in (
            ("limit", "positive float (finite, > 0)", (0.0, -1.0, math.nan, math.inf)),
            ("alpha", "positive float (finite, > 0)", (0.0, math.nan)),
            ("glu_linear_offset", "float (finite)", (math.nan, -math.inf)),
        )
        for value in values
    ),
    (
        "bias_activation limit nan",
        lambda x, b: ba(x, b, "clamped_swiglu", limit=math.nan),
        lambda: (_t(4, 8), _t(8)),
        "te.bias_activation: limit must be a positive float (finite, > 0), got nan",
    ),
    (
        "gated op limit 0",
        lambda x, b: torch.ops.te.gated_activation_fwd(x, b, "clamped_swiglu", 0, 0.0, 1.7, 1.0),
        lambda: (_t(4, 8), None),
        _GATED + "limit must be a positive float (finite, > 0), got 0.0",
    ),
    # situglu: beta1 / beta2 in the limit / alpha slots, named as betas; its offset slot is 0,
    # so clamped_swiglu's defaults (bias_activation's) are refused, never read as betas.
    (
        "situglu with clamped defaults",
        lambda x, b: ba(x, b, "situglu"),
        lambda: (_t(4, 8), _t(8)),
        _GATED + "activation 'situglu' has no glu_linear_offset; its slot must be 0.0",
    ),
    *(
        (
            f"gated op situglu {arg}={value}",
            lambda x, b, args=args: torch.ops.te.gated_activation_fwd(x, b, "situglu", 0, *args),
            lambda: (_t(4, 8), None),
            _GATED + f"{arg} must be a positive float (finite, > 0), got {value}",
        )
        for arg, value, args in (
            ("beta1", 0.0, (0.0, 25.0, 0.0)),
            ("beta1", math.inf, (math.inf, 25.0, 0.0)),
            ("beta2", -1.0, (4.0, -1.0, 0.0)),
            ("beta2", math.nan, (4.0, math.nan, 0.0)),
        )
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["fast", "op", "compiled"])
def test_bad_input_raises_clear_error(case, mode):
    _name, call, make, message = case
    x, b = make()
    if x.is_floating_point():
        x.requires_grad_()
    if b is not None:
        b.requires_grad_()
    previous = te.eager_fast_path_enabled()
    te.set_eager_fast_path(mode == "fast")
    fn = compile_counted(call, backend="aot_eager")[0] if mode == "compiled" else call
    try:
        with pytest.raises(Exception) as info:
            fn(x, b)
    finally:
        te.set_eager_fast_path(previous)
    assert message in str(info.value)
    if mode == "compiled":
        # Raised at trace time by the fake; dynamo wraps it, naming the ValueError.
        assert "ValueError" in str(info.value)
    else:
        assert info.type is ValueError


def test_fused_quantize_runs_only_what_the_act_quantize_kernels_compute():
    """kernels.act_quantize applies clamped_swiglu's default parameters as literals and has no
    situglu up branch: te::mlp sends the rest to the activation op (functional.mlp_ops)."""
    defaults = tuple(activation.CLAMPED_SWIGLU_DEFAULTS.values())
    for name in (*ELEMENTWISE, *GATED):
        assert activation.fused_quantize_runs(name, defaults) == (name != "situglu"), name
    assert not activation.fused_quantize_runs("clamped_swiglu", (0.75, 1.702, 1.0))
    assert not activation.fused_quantize_runs("situglu", (4.0, 25.0, 0.0))


def test_package_names_are_the_functions():
    """``te.functional.<name>`` is the activation function for every public activation name (a
    submodule of the same name once shadowed ``glu``)."""
    import te_compile as te

    x = torch.randn(3, 8)
    # situglu has no function of its own (te.ops.SiTUGLU and bias_activation run it; its betas
    # travel in the limit/alpha slots): docs/op_mechanism.md, "A new activation".
    assert not hasattr(te.functional, "situglu")
    for name in (*ELEMENTWISE, *(n for n in GATED if n != "situglu")):
        fn = getattr(te.functional, name)
        assert callable(fn) and fn is getattr(activation, name), name
    a, lin = x.chunk(2, -1)
    assert_close(te.functional.glu(x), *to_reference((torch.sigmoid(a) * lin,)), torch.float32)
