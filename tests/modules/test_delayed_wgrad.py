"""delay_wgrad_compute / backward_dw() (Transformer Engine's split backward for pipeline
schedules): the backward computes the input's, the bias's and the norm's gradients; the weight
gradients come from backward_dw(), bit for bit those of the normal backward, in train() or
eval() mode (TE's own tests run eval() modules), eager or behind torch.compile's graph
break."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from tests.utils import DEVICES, assert_bits_equal, assert_matches_eager, count_graph_breaks

BF16 = torch.bfloat16
RECIPES = [
    pytest.param(None, id="bf16"),
    pytest.param(te.recipe.Float8CurrentScaling(), id="fp8_current"),
]


def _make(name, device, **kw):
    factory = {"params_dtype": BF16, "device": device, **kw}
    if name == "Linear":
        return te.Linear(32, 32, **factory)
    if name == "LayerNormLinear":
        return te.LayerNormLinear(32, 32, **factory)
    if name == "GroupedLinear":
        return te.GroupedLinear(3, 32, 32, **factory)
    return te.LayerNormMLP(32, 64, activation="swiglu", **factory)


MODULES = ["Linear", "LayerNormLinear", "LayerNormMLP"]
ALL_MODULES = [*MODULES, "GroupedLinear"]
SPLITS = [16, 0, 16]  # GroupedLinear's groups of the 32 rows of a [16, 2, 32] input


def _call(m, x):
    return m(x, SPLITS) if isinstance(m, te.GroupedLinear) else m(x)


def _weights(m):
    return [p for n, p in m.named_parameters() if "weight" in n and "norm" not in n]


def _pair(name, device, **kw):
    torch.manual_seed(0)
    ref = _make(name, device, **kw)
    m = _make(name, device, delay_wgrad_compute=True, **kw)
    m.load_state_dict(ref.state_dict())
    return ref, m


def _step(m, x, g, recipe):
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        out = m(x)
    out.backward(g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_backward_dw_gives_the_normal_gradients(name, recipe, device):
    ref, m = _pair(name, device)
    x = torch.randn(2, 16, 32, device=device, dtype=BF16)
    g = torch.randn(2, 16, 32, device=device, dtype=BF16)
    x_ref, x_m = x.clone().requires_grad_(), x.clone().requires_grad_()
    _step(ref, x_ref, g, recipe)
    _step(m, x_m, g, recipe)
    assert m.need_backward_dw()
    assert_bits_equal(x_m.grad, x_ref.grad)
    weights = _weights(m)
    assert weights and all(w.grad is None for w in weights)
    for (_n, p), (_, q) in zip(ref.named_parameters(), m.named_parameters(), strict=True):
        if all(q is not w for w in weights):  # biases and norm parameters: the main backward
            assert_bits_equal(q.grad, p.grad)
    m.backward_dw()
    for (_n, p), (_, q) in zip(ref.named_parameters(), m.named_parameters(), strict=True):
        assert_bits_equal(q.grad, p.grad)


@pytest.mark.parametrize("name", MODULES)
def test_microbatches_in_flight_accumulate(name):
    """Two forwards before their backwards (a pipeline schedule); each backward_dw takes the
    oldest forward whose backward has run; the gradients sum as autograd sums them."""
    ref, m = _pair(name, "cpu")
    xs = [torch.randn(8, 32, dtype=BF16) for _ in range(2)]
    gs = [torch.randn(8, 32, dtype=BF16) for _ in range(2)]
    outs = [ref(x) for x in xs]
    for out, g in zip(outs, gs, strict=True):
        out.backward(g)
    outs = [m(x) for x in xs]
    with pytest.raises(RuntimeError, match=r"backward_dw\(\): .* none of the 2 pending"):
        m.backward_dw()
    outs[1].backward(gs[1])  # the second microbatch's backward first
    m.backward_dw()
    outs[0].backward(gs[0])
    m.backward_dw()
    with pytest.raises(
        RuntimeError, match=r"no forward with delay_wgrad_compute=True .* is pending"
    ):
        m.backward_dw()
    for w_ref, w in zip(_weights(ref), _weights(m), strict=True):
        # the sum in the other order: equal up to one bf16 rounding
        assert_matches_eager(w.grad, w_ref.grad, roundings=1)
    m2 = _pair(name, "cpu")[1]
    for x, g in zip(xs, gs, strict=True):
        m2(x).backward(g)
        m2.backward_dw()
    for w_ref, w in zip(_weights(ref), _weights(m2), strict=True):
        assert_bits_equal(w.grad, w_ref.grad)


@pytest.mark.parametrize("name", MODULES)
def test_main_grad_untouched_until_backward_dw(name):
    ref, m = _pair(name, "cpu", fuse_wgrad_accumulation=True)
    for mod in (ref, m):
        for w in _weights(mod):
            w.main_grad = torch.full(w.shape, 0.5)
    x, g = torch.randn(8, 32, dtype=BF16), torch.randn(8, 32, dtype=BF16)
    _step(ref, x, g, None)
    _step(m, x, g, None)
    assert all(torch.all(w.main_grad == 0.5) and w.grad is None for w in _weights(m))
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    m.backward_dw()
    assert calls == [1]
    for w_ref, w in zip(_weights(ref), _weights(m), strict=True):
        assert w.grad is None
        assert_bits_equal(w.main_grad, w_ref.main_grad)


FP8_RECIPES = [
    *RECIPES,
    pytest.param(te.recipe.DelayedScaling(), id="fp8_delayed"),
]


@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ALL_MODULES)
def test_te_usage_in_eval_mode(name, dtype, recipe, fuse):
    """Transformer Engine's own tests: eval() modules (gradients still enabled), a random
    main_grad set beforehand with fuse_wgrad_accumulation, forward, loss.backward(),
    backward_dw(); the output, the input's gradient and every parameter's grad (main_grad for
    the weights, whose grad stays None) bit for bit those of delay_wgrad_compute=False."""
    ref, m = _pair(name, "cpu", params_dtype=dtype, fuse_wgrad_accumulation=fuse)
    x = torch.randn(16, 2, 32, dtype=dtype)
    results = []
    for mod in (m, ref):
        mod.eval()
        if fuse:
            torch.manual_seed(1)  # the same main_grad values in both
            if isinstance(mod, te.GroupedLinear):
                mod.allocate_main_grad().uniform_()
            else:
                for w in _weights(mod):
                    w.main_grad = torch.rand_like(w, dtype=torch.float32)
        main_grads = [w.main_grad.clone() for w in _weights(mod)] if fuse else []
        inp = x.clone().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = _call(mod, inp)
        out.sum().backward()
        if mod is m:
            assert all(w.grad is None for w in _weights(m))
            for w, before in zip(_weights(m) if fuse else [], main_grads, strict=True):
                assert_bits_equal(w.main_grad, before)  # untouched until backward_dw()
            m.backward_dw()
        weights = _weights(mod)
        grads = [p.main_grad if fuse and any(p is w for w in weights) else p.grad
                 for p in mod.parameters()]  # fmt: skip
        assert all(g is not None for g in grads)
        assert not fuse or all(w.grad is None for w in weights)
        results.append([out, inp.grad, *grads])
    for actual, expected in zip(*results, strict=True):
        assert_bits_equal(actual, expected)


@pytest.mark.parametrize("name", ALL_MODULES)
def test_a_forward_whose_backward_never_runs_leaves_the_queue(name):
    """An evaluation with gradients enabled (no torch.no_grad()) queues its GEMMs; they leave
    the queue with the output's autograd graph unless its backward ran."""
    m = _pair(name, "cpu")[1].eval()
    x = torch.randn(16, 2, 32, dtype=BF16)
    out = _call(m, x)
    assert len(m._wgrad_pending) == 1
    del out
    assert not m._wgrad_pending
    with pytest.raises(RuntimeError, match=r"no forward with delay_wgrad_compute=True"):
        m.backward_dw()
    out = _call(m, x)
    out.float().sum().backward()
    del out  # the backward ran: backward_dw() still has it to compute
    m.backward_dw()
    assert all(w.grad is not None for w in _weights(m))
    with torch.no_grad():
        _call(m, x)
    assert not m._wgrad_pending
    assert te.Linear(4, 4).backward_dw() is None  # not delayed: a no-op, as in TE


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"^Linear: delay_wgrad_compute must be a bool"):
        te.Linear(4, 4, delay_wgrad_compute=1)
    with pytest.raises(NotImplementedError, match="checkpoint=True with delay_wgrad_compute"):
        te.LayerNormMLP(16, 32, checkpoint=True, delay_wgrad_compute=True)
    with pytest.raises(TypeError, match="hook must be callable"):
        te.Linear(4, 4, delay_wgrad_compute=True).register_wgrad_accumulation_and_reduce_hooks(3)


class _Around(torch.nn.Module):
    """A compiled region around the module: exact ops (a power of two, relu), so the compiled
    and eager results are the same bits."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return torch.relu(_call(self.m, x * 2)) * 0.5


@pytest.mark.parametrize("name", ALL_MODULES)
def test_compiled_the_module_runs_eagerly_behind_a_graph_break(name):
    """Without fullgraph, torch.compile runs the delaying module eagerly (the rest compiled):
    backward_dw() after the compiled call's backward gives the normal gradients."""
    ref, m = _pair(name, "cpu")
    x = torch.randn(16, 2, 32, dtype=BF16)
    torch._dynamo.reset()
    # Inductor: dynamo's own fallback for an error raised in tracing compiled parts of the
    # module's forward, whose compiled backward then never wrote the stash backward_dw() reads.
    compiled = torch.compile(_Around(m), backend="inductor")
    for _ in range(2):  # the second call reuses the compiled frames
        compiled(x).float().sum().backward()
        m.backward_dw()
    for _ in range(2):
        _Around(ref)(x).float().sum().backward()
    for p, q in zip(ref.parameters(), m.parameters(), strict=True):
        assert_bits_equal(q.grad, p.grad)
    with torch.no_grad():  # nothing delayed: no graph break
        count = count_graph_breaks(_Around(m), x)
    assert count == (1, 0)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ALL_MODULES)
def test_compiled_fullgraph_fails_at_the_first_call_naming_the_option(name):
    m = _make(name, "cpu", delay_wgrad_compute=True)
    compiled = torch.compile(_Around(m), fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        compiled(torch.randn(16, 2, 32, dtype=BF16))
    assert f"te_compile.{name}(delay_wgrad_compute=True) runs eagerly" in str(info.value)
    assert "construct it with delay_wgrad_compute=False" in str(info.value)
    assert not m._wgrad_pending
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_linear_backward_dw(single, recipe, device):
    kw = {"params_dtype": BF16, "device": device, "single_grouped_parameter": single}
    torch.manual_seed(0)
    ref = te.GroupedLinear(3, 32, 32, **kw)
    m = te.GroupedLinear(3, 32, 32, delay_wgrad_compute=True, **kw)
    m.load_state_dict(ref.state_dict())
    splits = [16, 0, 32]  # an empty group too
    x = torch.randn(48, 32, device=device, dtype=BF16)
    g = torch.randn(48, 32, device=device, dtype=BF16)
    x_ref, x_m = x.clone().requires_grad_(), x.clone().requires_grad_()
    for mod, inp in ((ref, x_ref), (m, x_m)):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = mod(inp, splits)
        out.backward(g)
    assert_bits_equal(x_m.grad, x_ref.grad)
    weights = [p for n, p in m.named_parameters() if n.startswith("weight")]
    assert all(w.grad is None for w in weights)
    for (_n, p), (_, q) in zip(ref.named_parameters(), m.named_parameters(), strict=True):
        if all(q is not w for w in weights):  # the biases: the main backward
            assert_bits_equal(q.grad, p.grad)
    m.backward_dw()
    for (_n, p), (_, q) in zip(ref.named_parameters(), m.named_parameters(), strict=True):
        assert_bits_equal(q.grad, p.grad)


def test_grouped_linear_main_grad():
    ref = te.GroupedLinear(2, 32, 32, params_dtype=BF16, fuse_wgrad_accumulation=True)
    m = te.GroupedLinear(
        2, 32, 32, params_dtype=BF16, fuse_wgrad_accumulation=True, delay_wgrad_compute=True
    )
    m.load_state_dict(ref.state_dict())
    buffers = [mod.allocate_main_grad() for mod in (ref, m)]
    x, g = torch.randn(24, 32, dtype=BF16), torch.randn(24, 32, dtype=BF16)
    ref(x, [8, 16]).backward(g)
    m(x, [8, 16]).backward(g)
    assert torch.count_nonzero(buffers[1]) == 0
    m.backward_dw()
    assert_bits_equal(buffers[1], buffers[0])


def _stash_calls():
    from te_compile.functional.linear_args import LinearArgs

    x, w, b = torch.randn(2, 8, 32), torch.randn(16, 32), torch.randn(16)
    for t in (x, w, b):
        t.requires_grad_()
    specs = {"input_spec": "current:e4m3", "weight_spec": "current:e4m3",
             "grad_spec": "current:e5m2"}  # fmt: skip
    args = LinearArgs(x, w, b, None, **specs, wgrad_stash=torch.empty(2, 8, 16))
    yield torch.ops.te.linear_fwd.default, tuple(args)
    gx, gw = torch.randn(40, 32, requires_grad=True), torch.randn(2, 16, 32, requires_grad=True)
    splits = torch.tensor([8, 32])
    yield (
        torch.ops.te.grouped_linear_fwd.default,
        (gx, splits, gw, None, None, "", "", "", None, None, None, "", None, torch.empty(40, 16)),
    )  # fmt: skip


@pytest.mark.parametrize("call", list(_stash_calls()), ids=["linear", "grouped_linear"])
def test_ops_with_a_wgrad_stash_pass_opcheck(call):
    """The schema declares the backward's write into wgrad_stash; fake and autograd agree.
    (Not the AOT dispatch test: a compiled backward cannot write a forward output.)"""
    op, args = call
    torch.library.opcheck(
        op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor")
    )


def test_functional_delay_wgrad():
    x = torch.randn(4, 32, dtype=BF16, requires_grad=True)
    w = torch.randn(16, 32, dtype=BF16, requires_grad=True)
    y = te.functional.linear(x, w)
    g = torch.randn_like(y)
    (dw,) = torch.autograd.grad(y, w, g)
    y2, deferred = te.functional.linear(x, w, delay_wgrad=True)
    assert not deferred.ready
    y2.backward(g)
    assert deferred.ready and w.grad is None
    assert_bits_equal(deferred.compute(), dw)
    with pytest.raises(ValueError, match=r"te\.linear: delay_wgrad must be a bool"):
        te.functional.linear(x, w, delay_wgrad=1)


def test_delayed_scaling_backward_dw_after_the_next_forward():
    """DelayedScaling: backward_dw() runs after the next forward updated the scales; it uses
    the scales of its own forward (saved), and the FP8 state ends as without the split."""
    torch.manual_seed(0)
    ref, m = _pair("Linear", "cpu")
    recipe = te.recipe.DelayedScaling()
    xs = [torch.randn(16, 32, dtype=BF16) * (i + 1) for i in range(4)]
    gs = [torch.randn(16, 32, dtype=BF16) * (i + 1) for i in range(4)]
    for x, g in zip(xs, gs, strict=True):
        _step(ref, x, g, recipe)
    _step(m, xs[0], gs[0], recipe)
    for x, g in zip(xs[1:], gs[1:], strict=True):
        with te.autocast(recipe=recipe):
            out = m(x)
        m.backward_dw()
        out.backward(g)
    m.backward_dw()
    assert_bits_equal(m.weight.grad, ref.weight.grad)
    for key, value in ref.fp8_meta.state_dict().items():
        assert_bits_equal(m.fp8_meta.state_dict()[key], value)
