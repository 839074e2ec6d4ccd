"""Every fusion of ``te_compile.ops.Sequential``: the fuser picks it (``fusions()``), the fused te
ops run (recorded at the dispatcher), and the fused result matches both the float64 reference
(plain torch ops) and the unfused composition (``fuse=False``), forward and backward, for every
activation, with and without the optional bias/scale, in fp32 and bf16."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from te_compile import ops
from te_compile.functional.spec import EpilogueSpec, parse
from tests.ops.test_basic_ops import ELEMENTWISE, GATED, _clamped_swiglu, _situglu, _split
from tests.utils import (
    DEVICES,
    assert_close,
    chain_roundings,
    make_reference_and_test_tensors,
    max_roundings,
    to_reference,
)

DTYPES = [torch.float32, torch.bfloat16]
# The unfused composition is a chain of up to three ops, each rounding its output, and an
# element-wise op after a rounded sum is off relative to the sum's terms, not to its own value
# (GELU near its zero): compared with ``reduced=True``. A fused op on the CPU computes in fp32
# and rounds once (its forward is compared element-wise with one rounding); on CUDA it chains
# the unfused kernels.
CHAIN = 3


class _TeOps(TorchDispatchMode):
    """Names of the te ops called (an active mode routes every op through the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.names, self.args = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("te."):
            self.names.append(name.removesuffix(".default"))
            self.args.append(args)
        return func(*args, **(kwargs or {}))


def _act_case(name, k=None):
    """(op, reference on the pre-activation, output features per 2H inputs)."""
    if name in ELEMENTWISE:
        return getattr(ops, name)(), ELEMENTWISE[name], 1
    if name == "ClampedSwiGLU":
        op = ops.ClampedSwiGLU(limit=0.75, alpha=1.5, glu_linear_offset=0.5, glu_interleave_size=k)
        return op, lambda h: _clamped_swiglu(h, k, 0.75, 1.5, 0.5), 2
    if name == "SiTUGLU":
        op = ops.SiTUGLU(beta1=0.5, beta2=0.75, glu_interleave_size=k)
        return op, lambda h: _situglu(h, k, 0.5, 0.75), 2
    fn = GATED[name]
    op = getattr(ops, name)(glu_interleave_size=k)
    return op, lambda h: (lambda a, lin: fn(a) * lin)(*_split(h, k)), 2


ACTIVATIONS = [(n, None) for n in ELEMENTWISE] + [
    (n, k) for n in [*GATED, "ClampedSwiGLU", "SiTUGLU"] for k in (None, 4)
]


def _build(modules_fn, dtype, device, fuse):
    torch.manual_seed(3)
    seq = ops.Sequential(*modules_fn(), fuse=fuse).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in seq.parameters():
            p.copy_(torch.randn(p.shape) / math.sqrt(p.shape[-1]))
    return seq


def _run(seq, inputs, grads):
    outs = seq(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, grads)
    return outs


def check_fusion(
    modules_fn,
    reference,
    shapes,
    dtype,
    device,
    expected_fusions,
    expected_ops,
    n_out=1,
    single_rounding=True,
):
    """Fused and unfused ``Sequential(*modules_fn())`` against ``reference(params64, *inputs64)``
    (``params64``: the float64 parameters by state_dict name). ``single_rounding``: the fused
    ops round once on the CPU (one fusion, nothing else in the Sequential)."""
    fused = _build(modules_fn, dtype, device, fuse=True)
    unfused = _build(modules_fn, dtype, device, fuse=False)
    unfused.load_state_dict(fused.state_dict())
    assert fused.fusions() == expected_fusions
    assert unfused.fusions() == []
    pairs = [make_reference_and_test_tensors(s, dtype=dtype, device=device) for s in shapes]
    params64 = {n: to_reference(p) for n, p in fused.named_parameters()}
    outs64 = reference(params64, *(r for r, _ in pairs))
    outs64 = outs64 if isinstance(outs64, tuple) else (outs64,)
    assert len(outs64) == n_out
    grads = [torch.randn(o.shape).to(dtype) for o in outs64]
    torch.autograd.backward(outs64, [g.double() for g in grads])
    results = {}
    for label, seq in (("fused", fused), ("unfused", unfused)):
        inputs = [t.detach().clone().requires_grad_() for _, t in pairs]
        with _TeOps() as rec:
            outs = _run(seq, inputs, [g.to(device) for g in grads])
        results[label] = (outs, inputs, rec.names, rec.args)
        once = label == "fused" and device == "cpu" and single_rounding
        chain = {"roundings": chain_roundings(dtype, CHAIN), "reduced": True}
        tols = {"roundings": 1} if once else chain
        for o, r in zip(outs, outs64, strict=True):
            assert o.dtype == dtype
            assert_close(o, r, dtype, **tols)
        tols["reduced"] = True
        for t, (r, _) in zip(inputs, pairs, strict=True):
            assert_close(t.grad, r.grad, dtype, **tols)
        for name, p in seq.named_parameters():
            assert_close(p.grad, params64[name].grad, dtype, **tols)
    for op_name in expected_ops:
        assert op_name in results["fused"][2], f"{op_name} not called: {results['fused'][2]}"
        assert op_name not in results["unfused"][2]
    # The fused and unfused results agree with each other as well (implied by the checks
    # against the reference; checked directly where the two chains' sum is within the cap).
    both = chain_roundings(dtype, 2 * CHAIN)
    for a, b in zip(results["fused"][0], results["unfused"][0], strict=True):
        if both <= max_roundings(dtype):
            assert_close(a, b.double(), dtype, roundings=both, reduced=True)
    return results


LINEAR_OPS = ["te.linear_fwd", "te.linear_bwd"]


def _linear_args(result) -> dict:
    """The arguments, by name, of the first ``te::linear_fwd`` call of a recorded run."""
    names, args = result[2], result[3]
    call = args[names.index("te.linear_fwd")]
    schema = torch.ops.te.linear_fwd.default._schema
    values = {a.name: a.default_value for a in schema.arguments}  # trailing defaults not passed
    values |= {a.name: v for a, v in zip(schema.arguments, call, strict=False)}
    return values | {"ep": parse(EpilogueSpec, values["epilogue"])}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("act", "k"), ACTIVATIONS, ids=[f"{n}-k{k}" for n, k in ACTIVATIONS])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear_bias_activation(act, k, bias, dtype, device):
    _, act_ref, factor = _act_case(act, k)
    n = 16 * factor

    def modules():
        return [ops.BasicLinear(24, n), *([ops.Bias(n)] if bias else []), _act_case(act, k)[0]]

    def reference(p, x):
        h = x @ p["0.weight"].t()
        return act_ref(h + p["1.bias"] if bias else h)

    names = ("0", "1", "2") if bias else ("0", "1")
    results = check_fusion(
        modules,
        reference,
        [(5, 3, 24)],
        dtype,
        device,
        [("ForwardLinearBiasActivation", names)],
        [],
    )
    # One te::linear with the activation (and the bias) in its epilogue.
    assert results["fused"][2] == LINEAR_OPS
    assert _linear_args(results["fused"])["ep"].activation == _act_case(act, k)[0].activation


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_bias_runs_te_linear_with_the_bias(dtype, device):
    results = check_fusion(
        lambda: [ops.BasicLinear(24, 16), ops.Bias(16)],
        lambda p, x: x @ p["0.weight"].t() + p["1.bias"],
        [(7, 24)],
        dtype,
        device,
        [("ForwardLinearBiasActivation", ("0", "1"))],
        [],
    )
    # The same te ops as without the bias: the bias rides in the GEMM (no separate add).
    assert results["fused"][2] == ["te.linear_fwd", "te.linear_bwd"]


ADD_CASES = [
    ("linear+add", False, None, "ForwardLinearBiasAdd"),
    ("linear+bias+add", True, None, "ForwardLinearBiasAdd"),
    ("linear+scale+add", False, 0.37, "ForwardLinearScaleAdd"),
    ("linear+bias+scale+add", True, -1.5, "ForwardLinearScaleAdd"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_place", [False, True], ids=["new-output", "in-place"])
@pytest.mark.parametrize(
    ("bias", "scale", "fused_name"), [c[1:] for c in ADD_CASES], ids=[c[0] for c in ADD_CASES]
)
def test_linear_add(bias, scale, fused_name, in_place, dtype, device):
    """With ``AddExtraInput(in_place=True)`` the fused sum is written into the residual (a leaf
    that requires grad here), which is the output; its gradient is the output's."""

    def modules():
        return [
            ops.BasicLinear(24, 16),
            *([ops.Bias(16)] if bias else []),
            *([ops.ConstantScale(scale)] if scale is not None else []),
            ops.AddExtraInput(in_place=in_place),
        ]

    def reference(p, x, residual):
        y = x @ p["0.weight"].t()
        if bias:
            y = y + p["1.bias"]
        return residual + (y if scale is None else scale * y)

    n = 2 + bias + (scale is not None)
    results = check_fusion(
        modules,
        reference,
        [(5, 3, 24), (5, 3, 16)],
        dtype,
        device,
        [(fused_name, tuple(str(i) for i in range(n)))],
        [],
    )
    # One te::linear with the residual (and the scale) in its epilogue.
    assert results["fused"][2] == LINEAR_OPS
    linear = _linear_args(results["fused"])
    assert linear["residual"] is not None
    assert linear["ep"].scale == (1.0 if scale is None else scale)
    for label in ("fused", "unfused"):
        (out,), (_, residual), *_ = results[label]
        assert (out.data_ptr() == residual.data_ptr()) == in_place
        if in_place:
            assert torch.equal(residual.detach(), out.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_linear_add_in_place_into_a_computed_residual(device):
    """In-place add after the fused linear into a residual that autograd computed (not a leaf):
    the residual's storage holds the sum, and the gradients through it and through the linear
    are those of the unfused ops."""
    results = []
    for fuse in (True, False):
        seq = _build(lambda: [ops.BasicLinear(8, 8), ops.AddExtraInput(in_place=True)],
                     torch.float32, device, fuse)  # fmt: skip
        torch.manual_seed(0)
        x = torch.randn(4, 8, device=device, requires_grad=True)
        base = torch.randn(4, 8, device=device, requires_grad=True)
        residual = base * 2.0
        out = seq(x, residual)
        assert out.data_ptr() == residual.data_ptr()
        out.pow(2).sum().backward()
        results.append((out.detach(), x.grad, base.grad, seq[0].weight.grad))
    assert seq.fusions() == []  # the unfused run (built last)
    for a, b in zip(*results, strict=True):  # the residual in the GEMM or added after it
        assert_close(a, b.double(), torch.float32, roundings=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_scale_runs_one_te_linear_with_the_scale(dtype, device):
    results = check_fusion(
        lambda: [ops.BasicLinear(24, 16), ops.ConstantScale(-0.75)],
        lambda p, x: -0.75 * (x @ p["0.weight"].t()),
        [(5, 3, 24)],
        dtype,
        device,
        [("BackwardLinearScale", ("0", "1"))],
        [],
    )
    assert results["fused"][2] == LINEAR_OPS
    assert _linear_args(results["fused"])["ep"].scale == -0.75


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_branch_linear_adds_the_branch_gradient_in_the_dgrad(bias, dtype, device):
    def reference(p, x):
        y = x @ p["1.weight"].t()
        return (y + p["2.bias"] if bias else y), x

    results = check_fusion(
        lambda: [ops.MakeExtraOutput(), ops.BasicLinear(24, 16), *([ops.Bias(16)] if bias else [])],
        reference,
        [(5, 3, 24)],
        dtype,
        device,
        [("BackwardLinearAdd", ("0", "1", "2") if bias else ("0", "1"))],
        [],
        n_out=2,
    )
    assert results["fused"][2] == LINEAR_OPS
    assert _linear_args(results["fused"])["ep"].branch is True


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("act", "k"), [("GELU", None), ("SwiGLU", 4), ("SReLU", None)])
def test_bias_activation_fuses_dbias_into_the_activation_backward(act, k, dtype, device):
    _, act_ref, factor = _act_case(act, k)
    n = 16 * factor
    results = check_fusion(
        lambda: [ops.Bias(n), _act_case(act, k)[0]],
        lambda p, x: act_ref(x + p["0.bias"]),
        [(5, 3, n)],
        dtype,
        device,
        [("BackwardActivationBias", ("0", "1"))],
        [],
    )
    prefix = "te.gated_activation" if factor == 2 else "te.activation"
    for label, with_bias in (("fused", True), ("unfused", False)):
        names, args = results[label][2], results[label][3]
        assert names == [f"{prefix}_fwd", f"{prefix}_bwd"]
        # The bias goes to the activation op (fwd: argument 1, bwd: argument 2) only when fused.
        assert (args[0][1] is not None) == with_bias and (args[1][2] is not None) == with_bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_branch_rmsnorm_adds_the_branch_gradient_in_the_norm_backward(
    zero_centered_gamma, dtype, device
):
    def reference(p, x):
        w = p["1.weight"] + 1 if zero_centered_gamma else p["1.weight"]
        return F.rms_norm(x, (24,), w, 1e-5), x

    check_fusion(
        lambda: [ops.MakeExtraOutput(), ops.RMSNorm(24, zero_centered_gamma=zero_centered_gamma)],
        reference,
        [(5, 3, 24)],
        dtype,
        device,
        [("BackwardAddRMSNorm", ("0", "1"))],
        ["te.branch_rmsnorm_fwd", "te.branch_rmsnorm_bwd"],
        n_out=2,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_mlp_block(device):
    """A pre-norm MLP block with its residual: three fusions in one Sequential."""
    dtype = torch.bfloat16

    def modules():
        return [
            ops.MakeExtraOutput(),
            ops.RMSNorm(32),
            ops.BasicLinear(32, 64),
            ops.Bias(64),
            ops.SwiGLU(),
            ops.BasicLinear(32, 32),
            ops.Bias(32),
            ops.AddExtraInput(),
        ]

    def reference(p, x, residual):
        branch = x
        h = F.rms_norm(x, (32,), p["1.weight"], 1e-5) @ p["2.weight"].t() + p["3.bias"]
        a, lin = h.chunk(2, dim=-1)
        y = (F.silu(a) * lin) @ p["5.weight"].t() + p["6.bias"] + residual
        return y, branch

    check_fusion(
        modules,
        reference,
        [(4, 8, 32), (4, 8, 32)],
        dtype,
        device,
        [
            ("BackwardAddRMSNorm", ("0", "1")),
            ("ForwardLinearBiasActivation", ("2", "3", "4")),
            ("ForwardLinearBiasAdd", ("5", "6", "7")),
        ],
        ["te.branch_rmsnorm_bwd"],
        n_out=2,
        single_rounding=False,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_linear_add_with_a_broadcast_residual_runs_unfused(device):
    seq = ops.Sequential(ops.BasicLinear(8, 4), ops.Bias(4), ops.AddExtraInput()).to(device)
    x, residual = torch.randn(3, 8, device=device), torch.randn(4, device=device)
    with _TeOps() as rec:
        y = seq(x, residual)
    assert rec.names == ["te.linear_fwd"]
    w, b = seq[0].weight, seq[1].bias
    assert_close(y, x.double() @ w.double().t() + b.double() + residual.double(), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "modules",
    [
        lambda: [ops.BasicLinear(8, 4), ops.Bias(4, dtype=torch.float64), ops.GELU()],
        lambda: [ops.BasicLinear(8, 4), ops.Bias(4, dtype=torch.float64), ops.AddExtraInput()],
        lambda: [ops.MakeExtraOutput(), ops.BasicLinear(8, 4), ops.Bias(4, dtype=torch.float64)],
        lambda: [ops.Bias(8, dtype=torch.float64), ops.SiLU()],
    ],
    ids=["linear-bias-act", "linear-bias-add", "branch-linear-bias", "bias-act"],
)
def test_a_bias_of_another_dtype_runs_unfused_and_promotes(modules, device):
    torch.manual_seed(0)
    fused = ops.Sequential(*modules()).to(device)
    unfused = ops.Sequential(*modules(), fuse=False).to(device)
    unfused.load_state_dict(fused.state_dict())
    assert fused.fusions()
    x = torch.randn(3, 8, device=device)
    extra = [torch.randn(3, 4, device=device)] if isinstance(fused[-1], ops.AddExtraInput) else []
    outs = [seq(x, *extra) for seq in (fused, unfused)]
    outs = [o if isinstance(o, tuple) else (o,) for o in outs]
    assert outs[0][0].dtype == torch.float64  # promoted by the bias
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
