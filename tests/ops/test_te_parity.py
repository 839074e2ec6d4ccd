"""Transformer Engine parity of ``te_compile.ops``: ``Linear`` (TE's container, its state_dict
keys, tensor parallelism), user basic ops written in TE's ``op_forward(ctx, ...)`` /
``op_backward`` protocol, ``register_*_fusion``, ``AddExtraInput`` / ``MakeExtraOutput``
``in_place``; values and gradients against float64 references, eager and compiled."""

from __future__ import annotations

import contextlib

import pytest
import torch

from te_compile import ops
from te_compile.ops import fused as fused_mod
from te_compile.ops.fuser import OperationFuser
from tests.utils import (
    DEVICES,
    assert_close,
    assert_single_graph,
    chain_roundings,
    compile_counted,
    make_reference_and_test_tensors,
    to_reference,
)


def _backward(out, ref):
    dy = torch.randn_like(ref)
    out.backward(dy.to(out.dtype).to(out.device))
    ref.backward(dy)


# ops.Linear ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_reference_and_has_te_state_dict_keys(device, bias, dtype):
    torch.manual_seed(0)
    op = ops.Linear(16, 12, bias=bias, device=device, dtype=dtype)
    if bias:
        with torch.no_grad():
            op.bias.normal_()
    keys = sorted(op.state_dict())
    assert keys == (["basic_ops.0.weight", "basic_ops.1.bias"] if bias else ["basic_ops.0.weight"])
    assert op.weight is op.basic_ops[0].weight
    x_ref, x = make_reference_and_test_tensors((5, 3, 16), dtype=dtype, device=device)
    w_ref = to_reference(op.weight)
    y_ref = x_ref @ w_ref.T
    if bias:
        b_ref = to_reference(op.bias)
        y_ref = y_ref + b_ref
    y = op(x)
    assert_close(y, y_ref, dtype, reduced=True)
    _backward(y, y_ref)
    assert_close(x.grad, x_ref.grad, dtype, roundings=2, reduced=True)
    assert_close(op.weight.grad, w_ref.grad, dtype, roundings=2, reduced=True)
    if bias:
        assert_close(op.bias.grad, b_ref.grad, dtype, roundings=2, reduced=True)
    # TE's checkpoint loads; a parameter set on the container lands in the basic op
    clone = ops.Linear(16, 12, bias=bias, device=device, dtype=dtype)
    clone.load_state_dict(op.state_dict())
    assert torch.equal(clone.weight, op.weight)
    new = torch.nn.Parameter(torch.zeros_like(op.weight))
    clone.weight = new
    assert clone.basic_ops[0].weight is new


def test_linear_inside_sequential_fuses_with_neighbours_and_compiles():
    torch.manual_seed(0)
    seq = ops.Sequential(ops.Linear(16, 8), ops.GELU())
    assert seq.fusions() == [
        ("ForwardLinearBiasActivation", ("0.basic_ops.0", "0.basic_ops.1", "1"))
    ]
    assert sorted(seq.state_dict()) == ["0.basic_ops.0.weight", "0.basic_ops.1.bias"]
    x = torch.randn(4, 16, requires_grad=True)
    unfused = ops.Sequential(*seq, fuse=False)
    assert_close(seq(x), unfused(x).double(), torch.float32)
    compiled, _ = compile_counted(seq, backend="aot_eager")
    assert_close(compiled(x), seq(x).double(), torch.float32)
    assert_single_graph(seq, x)


def test_linear_rng_state_tracker_fork_wraps_the_init():
    entered = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self):
            entered.append(True)
            with torch.random.fork_rng():
                torch.manual_seed(123)
                yield

    a = ops.Linear(8, 4, rng_state_tracker_function=Tracker)
    b = ops.Linear(8, 4, rng_state_tracker_function=Tracker)
    assert entered == [True, True]
    assert torch.equal(a.weight, b.weight)  # drawn from the tracker's stream


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_mode": "diagonal"}, "tensor_parallel_mode"),
        ({"sequence_parallel": True}, "sequence_parallel"),
        ({"bias": 1}, "bias"),
        ({"rng_state_tracker_function": 3}, "rng_state_tracker_function"),
    ],
)
def test_linear_bad_arguments_raise_naming_them(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ops.Linear(8, 4, **kwargs)


def test_basic_linear_userbuffers_raise():
    with pytest.raises(NotImplementedError, match="userbuffers_options"):
        ops.BasicLinear(8, 4, userbuffers_options={"comm_name": "qkv"})


# User ops in Transformer Engine's protocol -------------------------------------------------------


class TEScale(ops.BasicOperation):
    """y = x * w (per feature), written as TE's docs show."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size))

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer=None,
                   next_op_input_quantizer=None):  # fmt: skip
        if ctx.requires_grad:
            ctx.save_for_backward(input_)
        return input_ * self.weight

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        dw = (grad_output * x).reshape(-1, x.shape[-1]).sum(0)
        return grad_output * self.weight, (dw,)


class TEGatedExtra(ops.BasicOperation):
    """TE's fuser protocol for an op with an extra input: y = x * s, grads to both."""

    num_extra_inputs = 1

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        (s,) = basic_op_extra_inputs[0]
        basic_op_ctxs[0].save_for_backward(input_, s)
        return input_ * s, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        x, s = basic_op_ctxs[0].saved_tensors
        return grad_output * s, [()], [(grad_output * x,)]


def test_user_op_in_te_protocol_runs_inside_sequential_forward_and_backward():
    torch.manual_seed(0)
    user = TEScale(8)
    seq = ops.Sequential(ops.BasicLinear(16, 8), user, TEGatedExtra(), ops.GELU())
    x_ref, x = make_reference_and_test_tensors((3, 16))
    s_ref, s = make_reference_and_test_tensors((3, 8))
    w_ref, u_ref = to_reference(seq[0].weight), to_reference(user.weight)
    h = (x_ref @ w_ref.T) * u_ref * s_ref
    y_ref = torch.nn.functional.gelu(h, approximate="tanh")
    y = seq(x, s)
    assert_close(y, y_ref, torch.float32, roundings=3)
    _backward(y, y_ref)
    for got, want in ((x.grad, x_ref.grad), (s.grad, s_ref.grad), (user.weight.grad, u_ref.grad),
                      (seq[0].weight.grad, w_ref.grad)):  # fmt: skip
        assert_close(got, want, torch.float32, roundings=4, reduced=True)
    # on its own, like any module
    h = torch.randn(3, 8)
    assert_close(user(h), h.double() * u_ref.detach(), torch.float32)


def test_user_op_in_te_protocol_compiles_fullgraph():
    torch.manual_seed(0)
    seq = ops.Sequential(ops.BasicLinear(16, 8), TEScale(8))
    x = torch.randn(3, 16, requires_grad=True)
    compiled, _ = compile_counted(seq, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    seq(x).sum().backward()
    assert_close(y, seq(x).double(), torch.float32)
    assert_close(g, x.grad.double(), torch.float32)


# register_*_fusion -----------------------------------------------------------------------------


class ScaleScale(ops.FusedOperation):
    """TE-protocol forward fusion of two TEScale ops: one multiply by the product."""

    calls = 0

    def fuser_forward(
        self,
        basic_op_ctxs,
        input_,
        *,
        basic_op_extra_inputs,
        prev_op_grad_output_quantizer,
        next_op_input_quantizer,
        basic_op_kwargs,
    ):
        ScaleScale.calls += 1
        a, b = self.basic_ops
        basic_op_ctxs[0].save_for_backward(input_)
        mid = input_ * a.weight
        basic_op_ctxs[1].save_for_backward(mid)
        return mid * b.weight, [(), ()]


def _fuse_scale_scale(ops_list, *, recipe):
    out, i = [], 0
    while i < len(ops_list):
        if (i + 1 < len(ops_list) and isinstance(ops_list[i], TEScale)
                and isinstance(ops_list[i + 1], TEScale)):  # fmt: skip
            out.append(ScaleScale(ops_list[i : i + 2]))
            i += 2
        else:
            out.append(ops_list[i])
            i += 1
    return out


@pytest.fixture
def registered():
    saved = {k: list(v) for k, v in fused_mod._USER_FUSIONS.items()}
    yield
    for k, v in saved.items():
        fused_mod._USER_FUSIONS[k][:] = v


def test_register_forward_fusion_replaces_the_run_and_backward_is_the_basic_ops(registered):
    torch.manual_seed(0)
    a, b = TEScale(8), TEScale(8)
    seq = ops.Sequential(a, b, ops.ReLU())
    ops.register_forward_fusion(_fuse_scale_scale)
    assert seq.fusions() == [("ScaleScale", ("0", "1"))]
    x_ref, x = make_reference_and_test_tensors((4, 8))
    a_ref, b_ref = to_reference(a.weight), to_reference(b.weight)
    y_ref = torch.relu(x_ref * a_ref * b_ref)
    ScaleScale.calls = 0
    y = seq(x)
    assert ScaleScale.calls == 1
    assert_close(y, y_ref, torch.float32, roundings=2)
    _backward(y, y_ref)
    assert_close(x.grad, x_ref.grad, torch.float32, roundings=3)
    assert_close(a.weight.grad, a_ref.grad, torch.float32, roundings=3, reduced=True)
    assert_close(b.weight.grad, b_ref.grad, torch.float32, roundings=3, reduced=True)


class LinearTwice(ops.FusedOperation):
    """Our-protocol user fusion: BasicLinear then ConstantScale as one GEMM with out_scale."""

    def op_forward(self, x, extra_inputs):
        lin, scale = self.basic_ops
        return lin.weight.mul(scale.scale).matmul(x.unsqueeze(-1)).squeeze(-1), ()


def test_register_backward_and_joint_fusions_and_recipe_argument(registered):
    seen = []

    def joint(ops_list, *, recipe):
        seen.append(recipe)
        out, i = [], 0
        while i < len(ops_list):
            pair = ops_list[i : i + 2]
            if (len(pair) == 2 and isinstance(pair[0], ops.BasicLinear)
                    and isinstance(pair[1], ops.ConstantScale)):  # fmt: skip
                out.append(LinearTwice(pair))
                i += 2
            else:
                out.append(ops_list[i])
                i += 1
        return out

    ops.register_forward_backward_fusion(joint)
    ops.register_backward_fusion(lambda o, *, recipe: o, prepend=True)
    seq = ops.Sequential(ops.BasicLinear(8, 4), ops.ConstantScale(3.0))
    assert seq.fusions() == [("LinearTwice", ("0", "1"))]
    assert seen[-1] is None
    x = torch.randn(2, 8)
    assert_close(seq(x), (x.double() @ seq[0].weight.double().T) * 3, torch.float32)


def test_registered_fusion_that_loses_ops_raises(registered):
    ops.register_forward_fusion(lambda o, *, recipe: o[:-1])
    with pytest.raises(RuntimeError, match="do not expand"):
        ops.Sequential(ops.ReLU(), ops.GELU())


def test_register_fusion_rejects_non_callable():
    with pytest.raises(TypeError, match="op_fusion_func"):
        ops.register_forward_fusion(3)


# in_place ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("leaf", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_add_extra_input_in_place_writes_into_the_extra_input(compiled, leaf):
    torch.manual_seed(0)
    seq = ops.Sequential(ops.BasicLinear(8, 8), ops.AddExtraInput(in_place=True))
    # The add is the GEMM's residual epilogue; the sum is then written into the residual.
    assert seq.fusions() == [("ForwardLinearBiasAdd", ("0", "1"))]
    x_ref, x = make_reference_and_test_tensors((3, 8))
    r0_ref, r0 = make_reference_and_test_tensors((3, 8))
    # A non-leaf residual, as in a block, or the grad-requiring leaf itself (TE's own test).
    r = r0 if leaf else r0 * 1.0
    w_ref = to_reference(seq[0].weight)
    run, counter = compile_counted(seq, backend="aot_eager") if compiled else (seq, None)
    y = run(x, r)
    if compiled:
        assert counter.frame_count == 1
    y_ref = x_ref @ w_ref.T + r0_ref
    assert_close(y, y_ref, torch.float32)
    assert_close(r, y_ref, torch.float32)  # the caller's tensor holds the sum
    _backward(y, y_ref)
    assert_close(x.grad, x_ref.grad, torch.float32, roundings=2)
    assert_close(r0.grad, r0_ref.grad, torch.float32)
    assert_close(seq[0].weight.grad, w_ref.grad, torch.float32, roundings=2)


def test_add_extra_input_in_place_leaf_alone():
    # TE's test_add_extra_input shape: the op on its own, both inputs grad-requiring leaves.
    x_ref, x = make_reference_and_test_tensors((5, 7))
    r_ref, r = make_reference_and_test_tensors((5, 7))
    y = ops.AddExtraInput(in_place=True)(x, r)
    y_ref = x_ref + r_ref
    assert_close(y, y_ref, torch.float32)
    assert_close(r, y_ref, torch.float32)
    _backward(y, y_ref)
    assert torch.equal(x.grad, r.grad)  # both are the output's gradient, exactly
    assert_close(x.grad, x_ref.grad, torch.float32)


def test_add_extra_input_in_place_refuses_shape_mismatch():
    op = ops.AddExtraInput(in_place=True)
    with pytest.raises(ValueError, match="shape"):
        op(torch.randn(2, 3), torch.randn(1, 3))
    with pytest.raises(ValueError, match="in_place"):
        ops.AddExtraInput(in_place="yes")


def test_make_extra_output_in_place_gradients_add_up():
    x_ref, x = make_reference_and_test_tensors((3, 8))
    seq = ops.Sequential(ops.MakeExtraOutput(in_place=True), ops.ReLU())
    y, branch = seq(x)
    (y.sum() + 2 * branch.sum()).backward()
    (torch.relu(x_ref).sum() + 2 * x_ref.sum()).backward()
    assert_close(x.grad, x_ref.grad, torch.float32)


# ScaledSwiGLU / ScaledClampedQGeGLU / ScaledSReLU --------------------------------------------


def _halves(x, k):
    h = x.shape[-1] // 2
    if not k:
        return x[..., :h], x[..., h:]
    blocks = x.reshape(*x.shape[:-1], h // k, 2, k)
    return blocks[..., 0, :].reshape(*x.shape[:-1], h), blocks[..., 1, :].reshape(*x.shape[:-1], h)


def _scaled_swiglu_ref(x, s, k):
    a, lin = _halves(x, k)
    return torch.nn.functional.silu(a) * lin * s.unsqueeze(-1)


def _scaled_clamped_ref(x, s, k, limit=7.0, alpha=1.702, offset=1.0):
    a, lin = _halves(x, k)
    c = a.clamp(max=limit)
    return c * torch.sigmoid(alpha * c) * (lin.clamp(-limit, limit) + offset) * s.unsqueeze(-1)


def _scaled_situglu_ref(x, s, k, beta1=4.0, beta2=25.0):
    a, lin = _halves(x, k)
    gate = beta1 * torch.tanh(a / beta1) * torch.sigmoid(a)
    return gate * beta2 * torch.tanh(lin / beta2) * s.unsqueeze(-1)


SCALED = [
    ("swiglu", lambda k: ops.ScaledSwiGLU(k), _scaled_swiglu_ref),
    ("clamped", lambda k: ops.ScaledClampedQGeGLU(k), _scaled_clamped_ref),
    (
        "clamped_params",
        lambda k: ops.ScaledClampedQGeGLU(k, limit=0.75, alpha=1.5, glu_linear_offset=0.5),
        lambda x, s, k: _scaled_clamped_ref(x, s, k, 0.75, 1.5, 0.5),
    ),
    ("situglu", lambda k: ops.ScaledSiTUGLU(k), _scaled_situglu_ref),
    # element-wise: k does not apply
    ("srelu", lambda k: ops.ScaledSReLU(), lambda x, s, k: x.relu().square() * s.unsqueeze(-1)),
    (
        "situglu_params",
        lambda k: ops.ScaledSiTUGLU(k, beta1=0.5, beta2=0.75),
        lambda x, s, k: _scaled_situglu_ref(x, s, k, 0.5, 0.75),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize(("make", "ref"), [c[1:] for c in SCALED], ids=[c[0] for c in SCALED])
def test_scaled_glu_matches_reference_with_scales_gradient(make, ref, k, dtype, device):
    torch.manual_seed(0)
    x_ref, x = make_reference_and_test_tensors((3, 5, 12), dtype=dtype, device=device)
    x.data *= 3  # reach the clamps
    x_ref.data = x.detach().to("cpu", torch.float64)
    s_ref, s = make_reference_and_test_tensors((3, 5), dtype=dtype, device=device)
    op = make(k)
    y = ops.Sequential(op)(x, s)
    y_ref = ref(x_ref, s_ref, k)
    assert_close(y, y_ref, dtype, roundings=2)
    _backward(y, y_ref)
    assert_close(x.grad, x_ref.grad, dtype, roundings=chain_roundings(dtype, 3))
    assert_close(s.grad, s_ref.grad, dtype, roundings=chain_roundings(dtype, 3), reduced=True)


def test_scaled_glu_after_linear_bias_is_not_fused_with_its_scales_and_compiles():
    torch.manual_seed(0)
    seq = ops.Sequential(ops.BasicLinear(8, 12), ops.Bias(12), ops.ScaledSwiGLU())
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1"))]
    x = torch.randn(4, 8, requires_grad=True)
    s = torch.rand(4, requires_grad=True)
    assert_single_graph(seq, x, s)
    compiled, _ = compile_counted(seq, backend="aot_eager")
    assert_close(compiled(x, s), seq(x, s).double(), torch.float32)


def test_scaled_situglu_after_linear_bias_compiles_in_one_graph():
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.BasicLinear(8, 12), ops.Bias(12), ops.ScaledSiTUGLU(2, beta1=0.5, beta2=0.75)
    )
    x = torch.randn(4, 8, requires_grad=True)
    s = torch.rand(4, requires_grad=True)
    assert_single_graph(seq, x, s)
    compiled, _ = compile_counted(seq, backend="aot_eager")
    assert_close(compiled(x, s), seq(x, s).double(), torch.float32)


def test_scaled_glu_bad_arguments():
    with pytest.raises(ValueError, match="scales"):
        ops.ScaledSwiGLU()(torch.randn(2, 4), torch.randn(2, 1))
    recompute = "does not support activation recomputation"  # TE's ValueError
    with pytest.raises(ValueError, match=recompute):
        ops.ScaledSwiGLU(activation_recompute_in_mlp=True)
    with pytest.raises(ValueError, match="limit"):
        ops.ScaledClampedQGeGLU(limit=-1.0)
    with pytest.raises(ValueError, match="glu_interleave_size"):
        ops.ScaledSwiGLU(0)
    with pytest.raises(ValueError, match="ScaledSiTUGLU: beta1 must be a positive float"):
        ops.ScaledSiTUGLU(beta1=-1.0)
    with pytest.raises(ValueError, match="ScaledSiTUGLU: beta2 must be a positive float"):
        ops.ScaledSiTUGLU(beta2=float("inf"))
    with pytest.raises(ValueError, match=recompute):
        ops.ScaledSiTUGLU(activation_recompute_in_mlp=True)
    srelu = ops.ScaledSReLU(activation_recompute_in_mlp=True)  # TE's fused grouped MLP's knob
    assert srelu.activation_recompute_in_mlp and not ops.ScaledSReLU().activation_recompute_in_mlp
    with pytest.raises(RuntimeError, match="fused grouped MLP"):
        srelu(torch.randn(2, 4), torch.randn(2))
    with pytest.raises(TypeError):
        ops.ScaledSiTUGLU(None, True)  # activation_recompute_in_mlp is keyword-only, as in TE
    with pytest.raises(TypeError):
        ops.SiTUGLU(4.0)  # every SiTUGLU argument is keyword-only, as in TE


# cache_quantized_input ---------------------------------------------------------------------------


def _e4m3_current_qdq(x64: torch.Tensor) -> torch.Tensor:
    """float64 reference of TE's cache quantiser: E4M3 with the tensor's current scale."""
    scale = torch.tensor(448.0, dtype=torch.float32) / x64.abs().max().to(torch.float32)
    q = (x64 * scale.double()).clamp(-448, 448).to(torch.float32).to(torch.float8_e4m3fn)
    return q.double() * scale.reciprocal().double()


CACHED = [
    ("gelu", lambda: ops.GELU(cache_quantized_input=True), lambda x: torch.nn.functional.gelu(x, approximate="tanh")),  # noqa: E501
    ("srelu", lambda: ops.SReLU(cache_quantized_input=True), lambda x: torch.relu(x).square()),
    ("swiglu", lambda: ops.SwiGLU(cache_quantized_input=True), lambda x: _scaled_swiglu_ref(x, torch.ones(x.shape[:-1], dtype=x.dtype), None)),  # noqa: E501
    ("clamped_k2", lambda: ops.ClampedSwiGLU(cache_quantized_input=True, glu_interleave_size=2), lambda x: _scaled_clamped_ref(x, torch.ones(x.shape[:-1], dtype=x.dtype), 2)),  # noqa: E501
    ("situglu_k2", lambda: ops.SiTUGLU(cache_quantized_input=True, glu_interleave_size=2), lambda x: _scaled_situglu_ref(x, torch.ones(x.shape[:-1], dtype=x.dtype), 2)),  # noqa: E501
]  # fmt: skip


def _saved_bytes(fn):
    """Bytes of the tensors autograd saves while ``fn()`` runs, and its result."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(sizes), out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("make", "ref"), [c[1:] for c in CACHED], ids=[c[0] for c in CACHED])
def test_cache_quantized_input_saves_fp8_and_backward_uses_it(make, ref, dtype, device):
    torch.manual_seed(0)
    x_ref, x = make_reference_and_test_tensors((6, 5, 16), dtype=dtype, device=device)
    x.data *= 3
    x_ref.data = x.detach().to("cpu", torch.float64)
    op = make()
    saved, y = _saved_bytes(lambda: op(x))
    assert saved <= x.numel() + 64, "one byte per element (+ the scale)"
    plain = type(op)(**{k: v for k, v in _ctor(op).items() if k != "cache_quantized_input"})
    plain_saved, y_plain = _saved_bytes(lambda: plain(x))
    assert plain_saved >= x.numel() * x.element_size()
    assert torch.equal(y, y_plain), "the forward is the exact activation"
    assert_close(y, ref(x_ref), dtype)
    dy = torch.randn_like(y)
    y.backward(dy)
    # the gradient at the dequantised FP8 input (rounded to the input's dtype), as in TE
    xq = _e4m3_current_qdq(x_ref.detach()).to(dtype).double().requires_grad_()
    ref(xq).backward(dy.double().cpu())
    assert_close(x.grad, xq.grad, dtype, roundings=2)
    x_exact = x_ref.detach().requires_grad_()
    ref(x_exact).backward(dy.double().cpu())
    # tol: a lower bound (the quantised gradient differs from the exact one), not a tolerance
    assert not torch.allclose(x.grad.double().cpu(), x_exact.grad, rtol=1e-3, atol=1e-3)


def _ctor(op):
    kw = {"cache_quantized_input": op.cache_quantized_input}
    if getattr(op, "glu_interleave_size", None):
        kw["glu_interleave_size"] = op.glu_interleave_size
    return kw


def test_cache_quantized_input_compiles_and_is_not_fused():
    torch.manual_seed(0)
    seq = ops.Sequential(ops.BasicLinear(8, 16), ops.Bias(16), ops.GELU(cache_quantized_input=True))
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1"))]
    x = torch.randn(4, 8, requires_grad=True)
    assert_single_graph(seq, x)
    compiled, _ = compile_counted(seq, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    seq(x).sum().backward()
    assert_close(y, seq(x).double(), torch.float32)
    assert_close(g, x.grad.double(), torch.float32)
    with pytest.raises(ValueError, match="cache_quantized_input"):
        ops.GELU(cache_quantized_input=1)


# Extra tensor channels -------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True])
def test_channel_routes_the_residual_inside_one_sequential(compiled):
    torch.manual_seed(0)
    make_residual, add_residual = ops.MakeExtraOutput(), ops.AddExtraInput()
    make_residual.set_extra_output_channel(0, "residual", output_to_caller=False)
    add_residual.set_extra_input_channel(0, "residual")
    block = ops.Sequential(
        ops.RMSNorm(8), make_residual, ops.Linear(8, 16), ops.GELU(), ops.Linear(16, 8),
        add_residual,
    )  # fmt: skip
    x_ref, x = make_reference_and_test_tensors((4, 8))
    p = {n: to_reference(t) for n, t in block.named_parameters()}
    h = x_ref * torch.rsqrt(x_ref.square().mean(-1, keepdim=True) + block[0].eps) * p["0.weight"]
    a = torch.nn.functional.gelu(
        h @ p["2.basic_ops.0.weight"].T + p["2.basic_ops.1.bias"], approximate="tanh"
    )
    y_ref = a @ p["4.basic_ops.0.weight"].T + p["4.basic_ops.1.bias"] + h
    run = torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block
    y = run(x)  # no extra input, no extra output: the channel is internal
    assert isinstance(y, torch.Tensor)
    assert_close(y, y_ref, torch.float32, roundings=4, reduced=True)
    _backward(y, y_ref)
    assert_close(x.grad, x_ref.grad, torch.float32, roundings=6, reduced=True)


def test_channel_public_output_fan_out_and_errors():
    torch.manual_seed(0)
    src = ops.MakeExtraOutput()
    src.set_extra_output_channel(0, "r")  # also returned to the caller (default)
    a, b = ops.AddExtraInput(), ops.AddExtraInput()
    a.set_extra_input_channel(0, "r")
    b.set_extra_input_channel(0, "r")
    free = ops.AddExtraInput()  # unnamed: the caller's
    seq = ops.Sequential(src, ops.ReLU(), a, b, free)
    x_ref, x = make_reference_and_test_tensors((3, 4))
    e_ref, e = make_reference_and_test_tensors((3, 4))
    y, r = seq(x, e)
    y_ref = torch.relu(x_ref) + 2 * x_ref + e_ref
    assert_close(y, y_ref, torch.float32)
    assert torch.equal(r, x)
    (y.sum() + r.sum()).backward()
    (y_ref.sum() + x_ref.sum()).backward()
    assert_close(x.grad, x_ref.grad, torch.float32)
    assert_close(e.grad, e_ref.grad, torch.float32)
    with pytest.raises(RuntimeError, match="already captured its channel routing"):
        a.set_extra_input_channel(0, None)


# The producer rules, with Transformer Engine's exception types and wording: a named extra input
# has exactly one producer, an earlier one; indices, names and output_to_caller are checked.
def _orphan():
    consumer = ops.AddExtraInput()
    consumer.set_extra_input_channel(0, "route")
    return consumer


def _producer(name="route"):
    producer = ops.MakeExtraOutput()
    producer.set_extra_output_channel(0, name)
    return producer


class _TwoOutputs(ops.BasicOperation):
    num_extra_outputs = 2

    def op_forward(self, x, extra_inputs):
        return x, (x, 2 * x)


def _same_op_twice():
    producer = _TwoOutputs()
    producer.set_extra_output_channel(0, "route")
    producer.set_extra_output_channel(1, "route")
    return [producer, _orphan()]


@pytest.mark.parametrize("build", [ops.Sequential, lambda *o: OperationFuser(o)])
@pytest.mark.parametrize(
    "make_ops,error",
    [
        (lambda: [ops.ReLU(), _orphan()], r"'route' consumed by AddExtraInput has no producer"),
        (lambda: [_orphan(), _producer()], "has no earlier producer"),
        (lambda: [_producer(), _producer(), _orphan()], "has multiple producers"),
        (_same_op_twice, "has multiple producers"),
    ],
    ids=["no-producer", "later-producer", "two-ops", "one-op-two-slots"],
)
def test_channel_producer_rules(build, make_ops, error):
    with pytest.raises(ValueError, match=error):
        build(*make_ops())


def test_channel_argument_checks_and_lock():
    with pytest.raises(IndexError, match="out of range"):
        ops.AddExtraInput().set_extra_input_channel(1, "x")
    with pytest.raises(IndexError, match="out of range"):
        ops.MakeExtraOutput().set_extra_output_channel(-1, "x")
    with pytest.raises(ValueError, match="non-empty string"):
        ops.MakeExtraOutput().set_extra_output_channel(0, "")
    with pytest.raises(ValueError, match="non-empty string"):
        ops.AddExtraInput().set_extra_input_channel(0, 3)
    with pytest.raises(TypeError, match="output_to_caller must be a bool"):
        ops.MakeExtraOutput().set_extra_output_channel(0, "x", output_to_caller=None)
    producer, consumer = _producer(), _orphan()
    OperationFuser([producer, consumer])  # building the fuser captures the routing
    for call in (lambda: producer.set_extra_output_channel(0, None),
                 lambda: consumer.set_extra_input_channel(0, None)):  # fmt: skip
        with pytest.raises(RuntimeError, match="already captured its channel routing"):
            call()


def test_operation_fuser_runs_the_ops_and_records_sources():
    # A rebound consumer takes its last channel; the other producer's output stays public.
    a, b, consumer = _producer("a"), _producer("b"), ops.AddExtraInput()
    consumer.set_extra_input_channel(0, "a")
    consumer.set_extra_input_channel(0, "b")
    free = ops.AddExtraInput()
    fuser = OperationFuser([a, ops.Linear(4, 4), b, consumer, free])
    assert fuser._basic_op_extra_input_sources == [[], [], [], [], [(3, 0)], [None]]
    assert fuser.num_extra_inputs == 1
    x_ref, x = make_reference_and_test_tensors((3, 4))
    e_ref, e = make_reference_and_test_tensors((3, 4))
    linear = fuser._basic_ops[1:3]
    w_ref, b_ref = to_reference(linear[0].weight), to_reference(linear[1].bias)
    y, out_a, out_b = fuser(x, e)
    h_ref = x_ref @ w_ref.T + b_ref
    assert_close(y, 2 * h_ref + e_ref, torch.float32, roundings=2)
    assert torch.equal(out_a, x)
    assert_close(out_b, h_ref, torch.float32)
