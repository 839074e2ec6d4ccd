"""Every basic op of ``te_compile.ops`` on its own: forward and backward (input and parameter
gradients) against float64 references written here with plain torch ops; Identity and Reshape
exact; bad arguments raise ValueError naming the argument."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from te_compile import ops
from tests.utils import (
    DEVICES,
    assert_close,
    assert_close_sum,
    bad_scalar_arguments,
    compile_counted,
    make_reference_and_test_tensors,
    to_reference,
)

DTYPES = [torch.float32, torch.bfloat16]


# float64 references --------------------------------------------------------------------------


def _split(x, k):
    """(activation half, linear half) of the last dim; ``k``: blocks of k columns alternate."""
    h = x.shape[-1] // 2
    if not k:
        return x[..., :h], x[..., h:]
    blocks = x.reshape(*x.shape[:-1], h // k, 2, k)
    return blocks[..., 0, :].reshape(*x.shape[:-1], h), blocks[..., 1, :].reshape(*x.shape[:-1], h)


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.relu(x).square()


ELEMENTWISE = {
    "GELU": _gelu,
    "QGELU": _qgelu,
    "ReLU": torch.relu,
    "SReLU": _srelu,
    "SiLU": F.silu,
}
GATED = {
    "GLU": torch.sigmoid,
    "GEGLU": _gelu,
    "QGEGLU": _qgelu,
    "ReGLU": torch.relu,
    "SReGLU": _srelu,
    "SwiGLU": F.silu,
}


def _clamped_swiglu(x, k, limit, alpha, offset):
    a, lin = _split(x, k)
    c = a.clamp(max=limit)
    return c * torch.sigmoid(alpha * c) * (lin.clamp(-limit, limit) + offset)


def _situglu(x, k, beta1=4.0, beta2=25.0):
    a, lin = _split(x, k)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(lin / beta2)


def _grouped(x, m_splits, weight, bias):
    outs, start = [], 0
    for g, m in enumerate(m_splits):
        outs.append(x[start : start + m] @ weight[g].t() + bias[g])
        start += m
    return torch.cat(outs)


# (name, make op, reference(params, x, *extra), input shape, extra input shapes)
CASES = [
    ("Identity", lambda: ops.Identity(), lambda p, x: x, (5, 3, 16), ()),
    ("Reshape", lambda: ops.Reshape((-1, 8)), lambda p, x: x.reshape(-1, 8), (5, 3, 16), ()),
    ("ConstantScale", lambda: ops.ConstantScale(-0.37), lambda p, x: x * -0.37, (5, 3, 16), ()),
    *[
        (name, getattr(ops, name), lambda p, x, fn=fn: fn(x), (5, 3, 16), ())
        for name, fn in ELEMENTWISE.items()
    ],
    *[
        (
            f"{name}-k{k}",
            lambda name=name, k=k: getattr(ops, name)(glu_interleave_size=k),
            lambda p, x, fn=fn, k=k: (lambda a, lin: fn(a) * lin)(*_split(x, k)),
            (5, 3, 16),
            (),
        )
        for name, fn in GATED.items()
        for k in (None, 4)
    ],
    (
        "ClampedSwiGLU",
        lambda: ops.ClampedSwiGLU(
            limit=0.75, alpha=1.5, glu_linear_offset=0.5, glu_interleave_size=2
        ),
        lambda p, x: _clamped_swiglu(x, 2, 0.75, 1.5, 0.5),
        (5, 3, 16),
        (),
    ),
    # Small betas bend both tanh caps on randn inputs; the defaults barely do.
    (
        "SiTUGLU",
        lambda: ops.SiTUGLU(beta1=0.5, beta2=0.75, glu_interleave_size=2),
        lambda p, x: _situglu(x, 2, 0.5, 0.75),
        (5, 3, 16),
        (),
    ),
    ("SiTUGLU-defaults", lambda: ops.SiTUGLU(), lambda p, x: _situglu(x, None), (5, 3, 16), ()),
    (
        "LayerNorm",
        lambda: ops.LayerNorm(16, eps=1e-3),
        lambda p, x: F.layer_norm(x, (16,), p["weight"], p["bias"], 1e-3),
        (5, 3, 16),
        (),
    ),
    (
        "LayerNorm-2d",
        lambda: ops.LayerNorm((3, 16), zero_centered_gamma=True),
        lambda p, x: F.layer_norm(x, (3, 16), p["weight"] + 1, p["bias"], 1e-5),
        (5, 3, 16),
        (),
    ),
    (
        "RMSNorm",
        lambda: ops.RMSNorm(16, zero_centered_gamma=True),
        lambda p, x: F.rms_norm(x, (16,), p["weight"] + 1, 1e-5),
        (5, 3, 16),
        (),
    ),
    (
        "L2Normalization",
        lambda: ops.L2Normalization(eps=1e-4),
        lambda p, x: x / (x.square().sum(-1, keepdim=True) + 1e-4).sqrt(),
        (5, 3, 16),
        (),
    ),
    (
        "BasicLinear",
        lambda: ops.BasicLinear(16, 24),
        lambda p, x: x @ p["weight"].t(),
        (5, 3, 16),
        (),
    ),
    ("Bias", lambda: ops.Bias(16), lambda p, x: x + p["bias"], (5, 3, 16), ()),
    (
        "AddExtraInput",
        lambda: ops.AddExtraInput(),
        lambda p, x, r: x + r,
        (5, 3, 16),
        ((5, 3, 16),),
    ),
]


def _make(make, dtype, device):
    torch.manual_seed(1)
    op = make().to(device=device, dtype=dtype)
    with torch.no_grad():  # random parameters (biases start at zero, norm weights at one)
        for p in op.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    return op


def _params64(op):
    return {name: to_reference(p) for name, p in op.named_parameters()}


def _grouped_params(op, p64):
    """The float64 copies of a GroupedLinear's weight and bias, as ``[G, ...]`` (stacked from
    ``weight0 ..`` / ``bias0 ..`` in the per-group layout), and the names of the op's own."""
    names = {}
    for name in ("weight", "bias"):
        single = getattr(op, f"single_grouped_{name}")
        names[name] = [name] if single else [f"{name}{g}" for g in range(op.num_groups)]
    stacked = [
        p64[names[n][0]] if len(names[n]) == 1 else torch.stack([p64[k] for k in names[n]])
        for n in ("weight", "bias")
    ]
    return (*stacked, [k for ks in names.values() for k in ks])


def _grouped_backward_matches(y, y64, x, x64, op, p64, dtype) -> None:
    """The gradients of ``x`` and the op's weights and biases (either layout) against float64,
    for one random output gradient ``[10, 8]``."""
    dy = torch.randn(10, 8).to(dtype)
    y.backward(dy.to(y.device))
    y64.backward(dy.double())
    assert_close(x.grad, x64.grad, dtype, reduced=True)
    for name in _grouped_params(op, p64)[2]:
        assert_close(getattr(op, name).grad, p64[name].grad, dtype, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("name", "make", "ref", "shape", "extra"), CASES, ids=[c[0] for c in CASES]
)
def test_basic_op_vs_float64_reference(name, make, ref, shape, extra, dtype, device):
    op = _make(make, dtype, device)
    x64, x = make_reference_and_test_tensors(shape, dtype=dtype, device=device)
    extras = [make_reference_and_test_tensors(s, dtype=dtype, device=device) for s in extra]
    p64 = _params64(op)
    y = op(x, *(e for _, e in extras))
    y64 = ref(p64, x64, *(r for r, _ in extras))
    assert y.dtype == dtype and y.shape == y64.shape
    assert_close(y, y64, dtype)
    dy = torch.randn(y64.shape).to(dtype)
    y.backward(dy.to(device))
    y64.backward(dy.double())
    assert_close(x.grad, x64.grad, dtype, reduced=True)
    for r, e in extras:
        assert_close(e.grad, r.grad, dtype)
    grads = 0
    for pname, p in op.named_parameters():
        assert_close(p.grad, p64[pname].grad, dtype, reduced=True)
        grads += 1
    assert grads == len(p64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [lambda: ops.Identity(), lambda: ops.Reshape((3, -1))])
def test_identity_and_reshape_are_exact(make, device):
    x = torch.randn(4, 6, dtype=torch.bfloat16, device=device, requires_grad=True)
    y = make()(x)
    assert torch.equal(y.reshape(x.shape), x)
    assert y.data_ptr() == x.data_ptr(), "a view, not a copy"
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad, dy.reshape(x.shape))


@pytest.mark.parametrize("device", DEVICES)
def test_make_extra_output_returns_the_input_and_adds_the_gradients(device):
    x = torch.randn(3, 8, device=device, requires_grad=True)
    y, branch = ops.MakeExtraOutput()(x)
    assert y is x and branch is x
    g1, g2 = torch.randn(3, 8, device=device), torch.randn(3, 8, device=device)
    torch.autograd.backward((y, branch), (g1, g2))
    assert torch.equal(x.grad, g1 + g2)


# Transformer Engine's default per-group parameters, its single [G, ...] ones, and one of each.
LAYOUTS = {
    "per_group": {},
    "single": {"single_grouped_weight": True, "single_grouped_bias": True},
    "single_weight": {"single_grouped_weight": True},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_linear_with_m_splits_as_extra_input(dtype, device, layout):
    op = _make(lambda: ops.GroupedLinear(3, 16, 8, **LAYOUTS[layout]), dtype, device)
    assert op.num_extra_inputs == 1
    m_splits = [3, 0, 7]
    x64, x = make_reference_and_test_tensors((10, 16), dtype=dtype, device=device)
    p64 = _params64(op)
    y = op(x, torch.tensor(m_splits))
    weight64, bias64, _ = _grouped_params(op, p64)
    y64 = _grouped(x64, m_splits, weight64, bias64)
    assert_close(y, y64, dtype)
    _grouped_backward_matches(y, y64, x, x64, op, p64, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("layout", ["per_group", "single"])
def test_grouped_linear_scale_bias(dtype, device, compiled, layout):
    """Transformer Engine's scale_bias: a second extra input, one scale per token, multiplies
    its group's bias (y_t = x_t W_g^T + s_t b_g); gradients of x, W, b and the scales against
    float64, eager and compiled (aot_eager, one graph), in either parameter layout."""
    op = _make(lambda: ops.GroupedLinear(3, 16, 8, scale_bias=True, **LAYOUTS[layout]), dtype,
               device)  # fmt: skip
    assert op.num_extra_inputs == 2 and "scale_bias=True" in repr(op)
    seq = ops.Sequential(op)
    fn, counter = compile_counted(seq, backend="aot_eager") if compiled else (seq, None)
    m_splits = [3, 0, 7]
    x64, x = make_reference_and_test_tensors((10, 16), dtype=dtype, device=device)
    s64, s = make_reference_and_test_tensors((10,), dtype=torch.float32, device=device)
    p64 = _params64(op)
    y = fn(x, torch.tensor(m_splits), s)
    if counter is not None:
        assert counter.frame_count == 1
    weight64, bias64, _ = _grouped_params(op, p64)
    bias_rows = bias64.repeat_interleave(torch.tensor(m_splits), dim=0)
    gemm64 = _grouped(x64, m_splits, weight64, torch.zeros_like(bias64))
    y64 = gemm64 + s64.unsqueeze(-1) * bias_rows
    # The GEMM's output is rounded, then the scaled bias added and the sum rounded: two
    # roundings, the first relative to the GEMM's output (the sum may cancel).
    magnitude = gemm64.abs() + (s64.unsqueeze(-1) * bias_rows).abs()
    assert_close_sum(y, y64, dtype, magnitude.detach(), roundings=2)
    _grouped_backward_matches(y, y64, x, x64, op, p64, dtype)
    assert_close(s.grad, s64.grad, dtype, reduced=True)


def test_grouped_linear_scale_bias_refusals():
    """Without a bias scale_bias is off (one extra input), as in Transformer Engine; bad scales
    are refused naming them."""
    assert ops.GroupedLinear(2, 8, 4, bias=False, scale_bias=True).num_extra_inputs == 1
    op = ops.GroupedLinear(2, 8, 4, scale_bias=True)
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"scales must be \[rows\] = \[5\]"):
        op(x, [2, 3], torch.ones(4))
    with pytest.raises(TypeError, match="scales must be a floating tensor"):
        op(x, [2, 3], torch.ones(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="scale_bias must be a bool"):
        ops.GroupedLinear(2, 8, 4, scale_bias=1)


def test_grouped_linear_parameter_layouts():
    """Transformer Engine's layouts and names: per-group weight0 .. / bias0 .. by default (the
    single attributes None), one [G, ...] weight / bias with single_grouped_* = True (the
    per-group ones None), chosen separately; a flag that is not a bool is refused naming it."""
    op = ops.GroupedLinear(2, 8, 4)
    assert op.weight is None and op.bias is None
    assert [n for n, _ in op.named_parameters()] == ["weight0", "weight1", "bias0", "bias1"]
    assert op.weight1.shape == (4, 8) and op.bias1.shape == (4,)
    op = ops.GroupedLinear(2, 8, 4, single_grouped_weight=True, single_grouped_bias=True)
    assert op.weight.shape == (2, 4, 8) and op.bias.shape == (2, 4)
    assert op.weight0 is None and op.bias1 is None
    op = ops.GroupedLinear(2, 8, 4, single_grouped_weight=True)
    assert [n for n, _ in op.named_parameters()] == ["weight", "bias0", "bias1"]
    assert [n for n, _ in ops.GroupedLinear(2, 8, 4, bias=False).named_parameters()] == [
        "weight0",
        "weight1",
    ]
    for name in ("weight", "bias"):
        with pytest.raises(ValueError, match=f"single_grouped_{name} must be a bool"):
            ops.GroupedLinear(2, 8, 4, **{f"single_grouped_{name}": 1})


@pytest.mark.parametrize("device", DEVICES)
def test_basic_linear_accumulates_into_main_grad(device):
    op = ops.BasicLinear(16, 8, device=device, accumulate_into_main_grad=True)
    x = torch.randn(5, 16, device=device)
    with pytest.raises(RuntimeError, match=r"weight\.main_grad"):
        op(x)
    op.weight.main_grad = torch.ones(8, 16, device=device)
    dy = torch.randn(5, 8, device=device)
    op(x).backward(dy)
    assert op.weight.grad is None
    assert_close(op.weight.main_grad, 1 + dy.double().t() @ x.double(), torch.float32, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_comm_ops_are_the_identity_without_a_group(device):
    x = torch.randn(4, 8, device=device, requires_grad=True)
    for op in (ops.AllGather(), ops.AllReduce(), ops.ReduceScatter()):
        assert op.world_size == 1
        y = op(x)
        assert y is x


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ops.BasicLinear(0, 4), "BasicLinear: in_features must be a positive int"),
        (lambda: ops.BasicLinear(4, 2.5), "BasicLinear: out_features must be a positive int"),
        (lambda: ops.BasicLinear(4, 4, dtype=torch.int32), "BasicLinear: dtype must be a floating"),
        (lambda: ops.Bias(-1), "Bias: size must be a positive int"),
        (lambda: ops.GroupedLinear(0, 4, 4), "GroupedLinear: num_groups must be a positive int"),
        (lambda: ops.SwiGLU(glu_interleave_size=0), "SwiGLU: glu_interleave_size must be"),
        (lambda: ops.ClampedSwiGLU(limit=-1.0), "ClampedSwiGLU: limit must be a positive float"),
        (lambda: ops.ClampedSwiGLU(alpha=0), "ClampedSwiGLU: alpha must be a positive float"),
        (lambda: ops.ClampedSwiGLU(glu_linear_offset="1"), "glu_linear_offset must be a float"),
        (lambda: ops.SiTUGLU(beta1=0.0), "SiTUGLU: beta1 must be a positive float"),
        (lambda: ops.SiTUGLU(beta1=float("inf")), "SiTUGLU: beta1 must be a positive float"),
        (lambda: ops.SiTUGLU(beta2=-2.0), "SiTUGLU: beta2 must be a positive float"),
        (lambda: ops.SiTUGLU(beta2=float("nan")), "SiTUGLU: beta2 must be a positive float"),
        (lambda: ops.SiTUGLU(glu_interleave_size=0), "SiTUGLU: glu_interleave_size must be"),
        (lambda: ops.LayerNorm(0), "LayerNorm: normalized_shape must be a positive int"),
        (lambda: ops.RMSNorm((4, 0)), "RMSNorm: normalized_shape must be"),
        (lambda: ops.RMSNorm(8, eps=0.0), "RMSNorm: eps must be a positive float"),
        (lambda: ops.L2Normalization(eps=-1e-6), "L2Normalization: eps must be a positive"),
        (lambda: ops.Dropout(1.5), r"Dropout: p must be a float in \[0, 1\]"),
        (lambda: ops.Reshape((2, -1, -1)), "Reshape: shape must be a sequence of ints"),
        (lambda: ops.ConstantScale("2"), "ConstantScale: scale must be a float"),
        (lambda: ops.AllReduce(process_group="tp"), "AllReduce: process_group must be a"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("make", "name", "good", "bad"),
    [
        (ops.ClampedSwiGLU, "limit", 0.5, -1.0),
        (ops.ClampedSwiGLU, "glu_linear_offset", -0.25, float("nan")),
        (ops.ScaledClampedQGeGLU, "alpha", 2.5, 0.0),
        (ops.SiTUGLU, "beta2", 3.0, float("inf")),
        (ops.ScaledSiTUGLU, "beta1", 0.5, -2.0),
        (ops.SwiGLU, "glu_interleave_size", 2, 0),
    ],
)
def test_activation_parameters_set_later_are_checked_and_used(make, name, good, bad):
    """An activation parameter set after construction is checked as the constructor checks it
    and is what the op computes with (the parameters live in the tuple ``config()`` returns)."""
    op, fresh = make(), make(**{name: good})
    setattr(op, name, good)
    assert getattr(op, name) == good
    assert op.config() == fresh.config() != make().config()
    with pytest.raises(ValueError, match=f"{make.__name__}: {name} must be"):
        setattr(op, name, bad)
    assert getattr(op, name) == good


# The arguments every op needs, by name; the walker below tries bad scalars for the others.
_GIVEN = {"in_features": 8, "out_features": 8, "size": 8, "num_groups": 2, "normalized_shape": 8}
_OPS = {
    name: getattr(ops, name)
    for name in ops.__all__
    if isinstance(getattr(ops, name), type)
    and issubclass(getattr(ops, name), ops.BasicOperation)
    and getattr(ops, name) is not ops.BasicOperation
}
_SCALAR_CASES = [
    (name, arg, value)
    for name, cls in _OPS.items()
    for arg, value in bad_scalar_arguments(cls.__init__, _GIVEN)
]


@pytest.mark.parametrize(
    ("name", "arg", "value"), _SCALAR_CASES, ids=[f"{n}-{a}-{v}" for n, a, v in _SCALAR_CASES]
)
def test_bad_switch_or_float_names_the_argument(name, arg, value):
    """A truthy non-bool for a switch, NaN or inf for a float: refused by name, for every op
    (walked from the constructors' signatures)."""
    cls = _OPS[name]
    params = inspect.signature(cls.__init__).parameters
    given = {k: v for k, v in _GIVEN.items() if k in params}
    with pytest.raises(ValueError, match=rf"^{name}: {arg} must be a ") as info:
        cls(**given, **{arg: value})
    assert f"got {value!r}" in str(info.value)


# Built at collection, before tests/conftest.py's fixture: on the CPU by name (device=None is
# CUDA on a GPU machine), where the inputs are.
@pytest.mark.parametrize(
    ("op", "x", "match"),
    [
        (
            ops.Bias(8, device="cpu"),
            torch.randn(2, 6),
            r"Bias: input's last dim \(6\) must equal size \(8\)",
        ),
        (
            ops.RMSNorm((3, 8), device="cpu"),
            torch.randn(2, 4, 8),
            r"RMSNorm: the input's trailing dims",
        ),
        (
            ops.BasicLinear(8, 4, device="cpu"),
            torch.randn(2, 6),
            r"BasicLinear: input must be .* with 8 features in its last dim",
        ),
        (ops.SwiGLU(), torch.randn(2, 7), r"inp.shape\[-1\] \(7\) must be even"),
        (ops.AddExtraInput(), torch.randn(2, 7), "AddExtraInput: expected 1 extra input"),
    ],
)
def test_bad_inputs_name_the_argument(op, x, match):
    with pytest.raises(ValueError, match=match):
        op(x)
