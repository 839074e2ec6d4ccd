"""LayerNorm, RMSNorm, LayerNormLinear, LayerNormMLP modules against float64 references built
from plain PyTorch (independent of te's own reference functions)."""

from __future__ import annotations

from contextlib import nullcontext

import expecttest
import pytest
import torch
import torch.nn.functional as torch_F

import te_compile as te
from tests.utils import (
    DEVICES,
    GraphRecorder,
    assert_close,
    assert_fast_path_gives_op_bytes,
    behaviour_backend,
    chain_roundings,
    compile_counted,
    to_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ref_norm(x, normalization, weight, bias, eps, zero_centered_gamma):
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    return torch_F.layer_norm(x, x.shape[-1:], gamma, bias, eps)


def ref_activation(h, activation):
    if activation == "gelu":
        return torch_F.gelu(h, approximate="tanh")
    if activation == "relu":
        return torch.relu(h)
    a, b = h.chunk(2, dim=-1)
    if activation == "swiglu":
        return torch_F.silu(a) * b
    if activation == "geglu":
        return torch_F.gelu(a, approximate="tanh") * b
    raise AssertionError(activation)


class _RoundTo(torch.autograd.Function):
    """Round to ``dtype`` in the forward and the backward: where a module materialises an
    intermediate (and its gradient) in ``dtype``, the float64 reference rounds it too."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.to(dtype).to(torch.float64)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(torch.float64), None


def _random_params(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (0.5 if p.dim() == 1 else 0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norm_modules(device, dtype, cls, zero_centered_gamma):
    m = cls(
        37, eps=1e-5, zero_centered_gamma=zero_centered_gamma, params_dtype=dtype, device=device
    )
    expected_init = 0.0 if zero_centered_gamma else 1.0
    assert torch.all(m.weight == expected_init)
    _random_params(m)
    x = torch.randn(3, 5, 37, device=device, dtype=dtype, requires_grad=True)
    y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x_ref = to_reference(x)
    params = [to_reference(p) for p in (m.weight, m.bias)]
    y_ref = ref_norm(x_ref, m.normalization, params[0], params[1], 1e-5, zero_centered_gamma)
    y_ref.backward(to_reference(dy))
    assert_close(y, y_ref, dtype)
    assert_close(x.grad, x_ref.grad, dtype)
    assert_close(m.weight.grad, params[0].grad, dtype)
    if m.bias is not None:
        assert_close(m.bias.grad, params[1].grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("return_bias", [False, True])
@pytest.mark.parametrize("return_layernorm_output", [False, True])
def test_layernorm_linear(device, normalization, return_bias, return_layernorm_output):
    dtype = torch.float32
    m = te.LayerNormLinear(
        24,
        10,
        normalization=normalization,
        return_bias=return_bias,
        return_layernorm_output=return_layernorm_output,
        device=device,
    )
    _random_params(m)
    x = torch.randn(4, 24, device=device, requires_grad=True)
    result = m(x)
    outs = result if isinstance(result, tuple) else (result,)
    assert len(outs) == 1 + return_bias + return_layernorm_output
    out = outs[0]
    if return_bias:
        assert outs[1] is m.bias
        out = out + outs[1]
    out.sum().backward()
    x_ref = to_reference(x)
    lnw, lnb, w, b = (
        to_reference(p) for p in (m.layer_norm_weight, m.layer_norm_bias, m.weight, m.bias)
    )
    ln = ref_norm(x_ref, normalization, lnw, lnb, m.eps, False)
    y_ref = ln @ w.t() + b
    y_ref.sum().backward()
    assert_close(out, y_ref, dtype)
    if return_layernorm_output:
        assert_close(outs[-1], ln, dtype)
    assert_close(x.grad, x_ref.grad, dtype)
    assert_close(m.layer_norm_weight.grad, lnw.grad, dtype)
    assert_close(m.weight.grad, w.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["gelu", "relu", "swiglu", "geglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_mlp(device, dtype, activation, normalization):
    m = te.LayerNormMLP(
        16,
        24,
        activation=activation,
        normalization=normalization,
        params_dtype=dtype,
        device=device,
    )
    gated = activation in ("swiglu", "geglu")
    assert m.fc1_weight.shape == ((48 if gated else 24), 16)
    assert m.fc2_weight.shape == (16, 24)
    _random_params(m)
    x = torch.randn(2, 3, 16, device=device, dtype=dtype, requires_grad=True)
    y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x_ref = to_reference(x)
    lnw, lnb, w1, b1, w2, b2 = (
        to_reference(p)
        for p in (
            m.layer_norm_weight,
            m.layer_norm_bias,
            m.fc1_weight,
            m.fc1_bias,
            m.fc2_weight,
            m.fc2_bias,
        )
    )
    ln = _RoundTo.apply(ref_norm(x_ref, normalization, lnw, lnb, m.eps, False), dtype)
    h = _RoundTo.apply(ln @ w1.t(), dtype)  # FC1 runs without bias; the fused op adds it
    act = _RoundTo.apply(ref_activation(h + b1, activation), dtype)
    y_ref = act @ w2.t() + b2
    y_ref.backward(to_reference(dy))
    assert_close(y, y_ref, dtype)
    # Gradients pass through up to four rounded ops (FC2 dgrad, activation backward, FC1 dgrad,
    # norm backward); the reference rounds the same intermediates, but each rounding can still
    # differ by one ulp, and the weight/bias gradients sum such operands over rows.
    assert_close(x.grad, x_ref.grad, dtype, roundings=chain_roundings(dtype, 4))
    for p, r in ((m.fc1_weight, w1), (m.fc2_weight, w2), (m.fc1_bias, b1)):
        assert_close(p.grad, r.grad, dtype, roundings=chain_roundings(dtype, 4), reduced=True)


@pytest.mark.parametrize("recipe", [None, "current"], ids=["bf16", "fp8_current"])
def test_layernorm_mlp_activation_params(recipe):
    """``activation_params`` (Transformer Engine's ``{"limit", "alpha"}``) reach clamped SwiGLU:
    the module equals its op-by-op composition with the same parameters (fused ``te::mlp`` under
    FP8 too), and differs from the defaults'."""
    torch.manual_seed(0)
    params = {"limit": 1.5, "alpha": 2.0, "glu_linear_offset": 0.25}
    m = te.LayerNormMLP(16, 32, activation="clamped_swiglu", activation_params=params)
    default = te.LayerNormMLP(16, 32, activation="clamped_swiglu")
    _random_params(m)
    default.load_state_dict(m.state_dict())
    x = (torch.randn(2, 16, 16) * 3).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    ctx = te.autocast(recipe=te.recipe.Float8CurrentScaling()) if recipe else nullcontext()
    with ctx:
        y = m(x)
        ln = te.functional.layernorm(x_ref, m.layer_norm_weight, m.layer_norm_bias, m.eps)
        h = te.Linear(16, 64, bias=False)
        h.weight = m.fc1_weight
        fc2 = te.Linear(32, 16)
        fc2.weight, fc2.bias = m.fc2_weight, m.fc2_bias
        act = te.functional.bias_activation(h(ln), m.fc1_bias, "clamped_swiglu", **params)
        expected = fc2(act)
        y_default = default(x.detach())
    assert_close(y, expected.detach(), torch.float32, roundings=2)
    assert (y - y_default).abs().max() > 1e-2
    dy = torch.randn_like(y)
    y.backward(dy)
    expected.backward(dy)
    assert_close(x.grad, x_ref.grad, torch.float32, roundings=4)


@pytest.mark.parametrize(
    ("activation", "params", "match"),
    [
        ("gelu", {"limit": 2.0}, "activation_params are for activation='clamped_swiglu' only"),
        ("clamped_swiglu", {"beta": 1.0}, "activation_params keys must be among"),
        ("clamped_swiglu", {"limit": -1.0}, "limit must be"),
        ("clamped_swiglu", {"alpha": float("nan")}, "alpha must be"),
    ],
)
def test_layernorm_mlp_bad_activation_params(activation, params, match):
    with pytest.raises(ValueError, match=match):
        te.LayerNormMLP(16, 32, activation=activation, activation_params=params)
    with pytest.raises(TypeError, match="activation_params must be a dict"):
        te.LayerNormMLP(16, 32, activation="clamped_swiglu", activation_params=[("limit", 1.0)])


def test_bad_arguments():
    with pytest.raises(ValueError, match="LayerNormMLP: activation must be one of"):
        te.LayerNormMLP(8, 16, activation="tanh")
    # situglu is a te.ops activation: refused when built, not at the first forward.
    with pytest.raises(ValueError, match="LayerNormMLP: activation must be one of"):
        te.LayerNormMLP(8, 16, activation="situglu")
    with pytest.raises(ValueError, match="GroupedMLP: activation must be one of"):
        te.GroupedMLP(2, 8, 16, activation="situglu")
    with pytest.raises(ValueError, match="normalization must be one of"):
        te.LayerNormLinear(8, 16, normalization="BatchNorm")
    with pytest.raises(ValueError, match="eps must be a positive float"):
        te.LayerNorm(8, eps=0.0)
    with pytest.raises(ValueError, match="normalized_shape must be a positive int"):
        te.RMSNorm(0)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        te.RMSNorm(hidden_size=0)
    with pytest.raises(ValueError, match="RMSNorm: normalized_shape is required"):
        te.RMSNorm()
    with pytest.raises(ValueError, match=r"normalized_shape or hidden_size .*not both"):
        te.LayerNorm(8, hidden_size=8)
    with pytest.raises(ValueError, match="normalized_shape must be an int or a one-element"):
        te.LayerNorm((4, 8))


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_takes_transformer_engines_normalized_shape(kind):
    """TE's first parameter: an int, a one-element shape, or the older ``hidden_size=``."""
    cls = getattr(te, kind)
    for module in (cls(16), cls((16,)), cls(torch.Size([16])), cls(normalized_shape=16),
                   cls(hidden_size=16)):  # fmt: skip
        assert module.weight.shape == (16,) and module.hidden_size == 16


_ZERO_DIM_RECIPES = {
    "none": None,
    "current": te.recipe.Float8CurrentScaling(),
    "delayed": te.recipe.DelayedScaling(),
    "block": te.recipe.Float8BlockScaling(),
    "mxfp8": te.recipe.MXFP8BlockScaling(),
    "nvfp4": te.recipe.NVFP4BlockScaling(),
}
_ZERO_DIM_MODULES = {
    "LayerNormLinear": lambda: te.LayerNormLinear(32, 32),
    "LayerNormMLP": lambda: te.LayerNormMLP(32, 64),
    "Linear": lambda: te.Linear(32, 32),
    "LayerNorm": lambda: te.LayerNorm(32),
    "RMSNorm": lambda: te.RMSNorm(32),
    "GroupedLinear": lambda: te.GroupedLinear(2, 32, 32),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", _ZERO_DIM_RECIPES.values(), ids=_ZERO_DIM_RECIPES.keys())
@pytest.mark.parametrize("name", _ZERO_DIM_MODULES)
def test_zero_dim_input_names_inp(name, recipe, compiled):
    """A 0-dim input is refused with a ValueError naming ``inp`` (LayerNormMLP under an FP8
    recipe raised IndexError), in eager and at trace time (dynamo wraps the error raised while
    tracing, with the same message)."""
    module = _ZERO_DIM_MODULES[name]()
    if name == "GroupedLinear" and recipe is not None and recipe.nvfp4():
        # NVFP4 as the grouped GEMM takes it (its Hadamard transform and stochastic rounding
        # raise NotImplementedError first).
        recipe = te.recipe.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)
    fn = torch.compile(module, fullgraph=True, backend=behaviour_backend()) if compiled else module
    args = (torch.tensor(1.0), [1, 0]) if name == "GroupedLinear" else (torch.tensor(1.0),)
    with (
        pytest.raises(Exception if compiled else ValueError, match=r"te\.\w+: inp must") as info,
        te.autocast(enabled=recipe is not None, recipe=recipe),
    ):
        fn(*args)
    assert "IndexError" not in str(info.value)


@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_compiles_without_breaks(device):
    m = te.LayerNormMLP(16, 32, activation="swiglu", normalization="RMSNorm", device=device)
    compiled, counter = compile_counted(m, backend=behaviour_backend(device), dynamic=True)
    frames = None
    for n in (3, 5, 9):
        x = torch.randn(n, 16, device=device)
        assert_close(compiled(x), m(x).double(), torch.float32)
        # fullgraph=True already forbids breaks. The first call may count 2 frames: with
        # dynamic=True dynamo traces eps as a symbolic float and restarts the analysis once to
        # make it a graph input. New row counts must not recompile.
        frames = frames or counter.frame_count
        assert counter.frame_count == frames


class TestLayerNormMLPGraph(expecttest.TestCase):
    def test_compiled_graph_shows_fused_ops(self):
        torch._dynamo.reset()
        m = te.LayerNormMLP(16, 32, activation="gelu")
        rec = GraphRecorder()
        x = torch.randn(4, 16, requires_grad=True)
        torch.compile(m, backend=rec, fullgraph=True)(x).sum().backward()
        self.assertExpectedInline(
            rec.summary(),
            """\
forward:
  te.layernorm_fwd.default
  te.mlp_fwd.default
backward:
  auto_functionalized_v2(te.mlp_bwd.default)
  te.layernorm_bwd.default""",
        )


@pytest.mark.parametrize("cls", [te.LayerNorm, te.RMSNorm])
def test_norm_sequence_parallel_marks_its_parameters(cls):
    """``sequence_parallel=True`` without a group marks the parameters as Transformer Engine
    does (Megatron-style code all-reduces their gradients by that attribute); the forward is
    the plain norm. With a group the module all-reduces them itself (tests/distributed)."""
    m = cls(16, sequence_parallel=True)
    for p in m.parameters():
        assert getattr(p, "sequence_parallel", False) is True
    assert "sequence_parallel=True" in repr(m)
    plain = cls(16)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(4, 16)
    assert torch.equal(m(x), plain(x))
    assert not any(getattr(p, "sequence_parallel", False) for p in plain.parameters())
    with pytest.raises(ValueError, match="tp_group is for sequence_parallel=True"):
        cls(16, tp_group=object())
    with pytest.raises(ValueError, match="sequence_parallel must be a bool"):
        cls(16, sequence_parallel="yes")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", [None, "current"], ids=["hp", "fp8_current"])
def test_layernorm_mlp_accumulates_into_main_grad(recipe, compiled):
    """LayerNormMLP(fuse_wgrad_accumulation=True): two steps add FC1's and FC2's weight
    gradients into their ``main_grad`` (fp32), ``.grad`` stays None, and the sums equal the
    module without the fusion; the other parameters' gradients are as usual."""
    torch.manual_seed(0)
    plain = te.LayerNormMLP(32, 64, activation="swiglu")
    fused = te.LayerNormMLP(32, 64, activation="swiglu", fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    with pytest.raises(RuntimeError, match=r"LayerNormMLP\(fuse_wgrad_accumulation=True\)"):
        fused(torch.randn(2, 32))
    for w in (fused.fc1_weight, fused.fc2_weight):
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    run = torch.compile(fused, fullgraph=True, backend=behaviour_backend()) if compiled else fused
    ctx = (lambda: te.autocast(recipe=te.recipe.Float8CurrentScaling())) if recipe else nullcontext
    for _ in range(2):
        x = torch.randn(32, 32)
        with ctx():
            run(x).square().sum().backward()
            plain(x).square().sum().backward()
    for name in ("fc1_weight", "fc2_weight"):
        assert getattr(fused, name).grad is None
        torch.testing.assert_close(getattr(fused, name).main_grad, getattr(plain, name).grad)
    for name in ("fc1_bias", "fc2_bias", "layer_norm_weight", "layer_norm_bias"):
        torch.testing.assert_close(getattr(fused, name).grad, getattr(plain, name).grad)


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves while ``fn()`` runs."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", [None, "current"], ids=["hp", "fp8_current"])
def test_layernorm_mlp_checkpoint_recomputes_fc1(recipe, compiled):
    """LayerNormMLP(checkpoint=True): the norm, FC1 and the activation are recomputed in the
    backward, so the forward saves less (eagerly: only the input and what FC2 needs); output
    and gradients equal the module without it."""
    torch.manual_seed(0)
    plain = te.LayerNormMLP(32, 128, activation="swiglu")
    ckpt = te.LayerNormMLP(32, 128, activation="swiglu", checkpoint=True)
    ckpt.load_state_dict(plain.state_dict())
    assert "checkpoint=True" in repr(ckpt)
    run = torch.compile(ckpt, fullgraph=True, backend=behaviour_backend()) if compiled else ckpt
    ctx = (lambda: te.autocast(recipe=te.recipe.Float8CurrentScaling())) if recipe else nullcontext
    x = torch.randn(64, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with ctx():
        y_ref = plain(x_ref)
        y = run(x)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for name, p in ckpt.named_parameters():
        torch.testing.assert_close(p.grad, dict(plain.named_parameters())[name].grad)
    if not compiled:
        with ctx():
            saved_plain, _ = _saved_bytes(lambda: plain(x_ref))
            saved_ckpt, _ = _saved_bytes(lambda: ckpt(x))
        assert saved_ckpt < saved_plain


@pytest.mark.parametrize("bias, fuse_wgrad", [(True, False), (False, True)])
@pytest.mark.parametrize(
    "make_recipe",
    [
        None,
        te.recipe.Float8CurrentScaling,
        te.recipe.DelayedScaling,
        lambda: te.recipe.Float8CurrentScaling(fp8_format=te.recipe.Format.HYBRID),
    ],
    ids=["bf16", "current", "delayed", "current-hybrid"],
)
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_fast_path_gives_the_op_paths_bytes(
    device, normalization, activation, make_recipe, bias, fuse_wgrad
):
    """te.LayerNormMLP's eager calls in bf16 and under a per-tensor recipe skip the op's layers
    (``functional.mlp_ops.mlp_fast_path``): three steps give the op path's bytes (outputs,
    input, weight (or main_grad), bias and norm gradients, the delayed-scaling state) and the
    fast path's autograd node."""
    params = {"limit": 0.75, "alpha": 1.5} if activation == "clamped_swiglu" else None

    def make():
        return te.LayerNormMLP(64, 96, normalization=normalization, activation=activation,
                               bias=bias, zero_centered_gamma=True, activation_params=params,
                               fuse_wgrad_accumulation=fuse_wgrad, params_dtype=torch.bfloat16,
                               device=device)  # fmt: skip

    weights = lambda m: (m.fc1_weight, m.fc2_weight)  # noqa: E731
    assert_fast_path_gives_op_bytes(
        make, weights, make_recipe, device, fuse_wgrad, "_FastMLPBackward", "te_mlp_fwd"
    )


@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_fast_path_refuses_what_the_op_refuses(device):
    """The fast path checks a call as the op does, once per set of shapes: a hidden size not
    a multiple of 16 is refused by name on every call, the input's dtype against the weights'
    and its device against theirs too."""
    m = te.LayerNormMLP(40, 64, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(16, 40, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        with (
            pytest.raises(ValueError, match="hidden"),
            te.autocast(recipe=te.recipe.Float8CurrentScaling()),
        ):
            m(x)
    m = te.LayerNormMLP(64, 64, params_dtype=torch.bfloat16, device=device)
    for dtype in (torch.bfloat16, torch.float16, torch.float16):
        x = torch.randn(16, 64, device=device, dtype=dtype)
        with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
            if dtype is torch.bfloat16:
                m(x)
                continue
            with pytest.raises(ValueError, match="inp, fc1_weight and fc2_weight must share"):
                m(x)
    x = torch.randn(16, 64, device="meta", dtype=torch.bfloat16)
    for _ in range(2):
        with (
            pytest.raises(ValueError, match="inp and fc1_weight must be on one device"),
            te.autocast(recipe=te.recipe.Float8CurrentScaling()),
        ):
            m(x)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_high_precision_norm_as_prologue(device, normalization, activation, bias):
    """In high precision an eager te.LayerNormMLP runs its norm as te::mlp's prologue (one op
    call, ``PreNorm._fused_norm``); with the fast path off (as while traced or watched) as an op
    of its own: the same bytes, outputs and every gradient, over two steps."""
    from te_compile import _library

    def run(fast: bool):
        _library.set_eager_fast_path(fast)
        try:
            torch.manual_seed(0)
            m = te.LayerNormMLP(64, 96, normalization=normalization, activation=activation,
                                bias=bias, zero_centered_gamma=True, params_dtype=torch.bfloat16,
                                device=device)  # fmt: skip
            with torch.no_grad():
                for p in m.parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn(p.shape, device=device) * 0.1)
            calls = []
            outs = []
            for step in range(2):
                x = (torch.randn(4, 8, 64) * (1 + step)).to(device, torch.bfloat16)
                x.requires_grad_(True)
                y = m(x)
                calls.append(_node_names(y.grad_fn))
                w = torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)
                (y.float() * w).sum().backward()
                outs += [y.detach(), x.grad]
            return outs + [p.grad for p in m.parameters()], calls
        finally:
            _library.set_eager_fast_path(True)

    (fast, fast_nodes), (op, op_nodes) = run(True), run(False)
    norm_op = f"te_{normalization.lower()}_fwd"
    assert not any(norm_op in n for names in fast_nodes for n in names)  # no norm node
    assert all(any(norm_op in n for n in names) for names in op_nodes)
    assert len(fast) == len(op)
    for a, b in zip(fast, op, strict=True):
        assert torch.equal(a, b)


def _node_names(node) -> set[str]:
    """The names of the autograd nodes reachable from ``node``."""
    names, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is not None and type(n).__name__ not in names:
            names.add(type(n).__name__)
            todo += [f for f, _ in n.next_functions]
    return names


@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_keeps_the_norm_apart_where_the_prologue_does_not_take_it(device):
    """In high precision the norm stays an op of its own where ``te::mlp``'s prologue does not
    take the call as the norm op does: a float64 module (the prologue's dtypes are fp32, bf16
    and fp16), a norm weight of another dtype than the input, and ``torch.autocast`` (whose
    casts the two ops' rules make); with a module of one such dtype it is the prologue."""
    f32 = torch.float32
    cases = [(torch.float64, torch.float64, False), (torch.bfloat16, f32, False),
             (f32, f32, True), (f32, f32, False)]  # fmt: skip
    seen = []
    for dtype, norm_dtype, autocast in cases:
        m = te.LayerNormMLP(32, 64, params_dtype=dtype, device=device)
        m.layer_norm_weight.data = m.layer_norm_weight.data.to(norm_dtype)
        m.layer_norm_bias.data = m.layer_norm_bias.data.to(norm_dtype)
        x = torch.randn(8, 32, device=device, dtype=dtype, requires_grad=True)
        ctx = torch.autocast(device, dtype=torch.bfloat16) if autocast else nullcontext()
        with ctx:
            y = m(x)
        seen.append(any("te_layernorm_fwd" in n for n in _node_names(y.grad_fn)))
    assert seen == [True, True, True, False]
