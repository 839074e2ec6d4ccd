"""delay_wgrad_compute / backward_dw() (Transformer Engine's split backward for pipeline
schedules): the backward computes the input's, the bias's and the norm's gradients; the weight
gradients come from backward_dw(), bit for bit those of the normal backward."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from tests.utils import DEVICES, assert_bits_equal, assert_matches_eager

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
    return te.LayerNormMLP(32, 64, activation="swiglu", **factory)


MODULES = ["Linear", "LayerNormLinear", "LayerNormMLP"]


def _weights(m):
    return [p for n, p in m.named_parameters() if n.endswith("weight") and "norm" not in n]


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
    with pytest.raises(RuntimeError, match=r"no training forward .* is pending"):
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


def test_nothing_delayed_without_a_training_backward():
    ref, m = _pair("Linear", "cpu")
    x = torch.randn(8, 32, dtype=BF16)
    with torch.no_grad():
        m(x)
    m.eval()
    m(x).sum().backward()  # eval mode: the weight gradient comes with the backward
    ref(x).sum().backward()
    assert_bits_equal(m.weight.grad, ref.weight.grad)
    assert not m._wgrad_pending
    assert te.Linear(4, 4).backward_dw() is None  # not delayed: a no-op, as in TE


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"^Linear: delay_wgrad_compute must be a bool"):
        te.Linear(4, 4, delay_wgrad_compute=1)
    with pytest.raises(NotImplementedError, match="checkpoint=True with delay_wgrad_compute"):
        te.LayerNormMLP(16, 32, checkpoint=True, delay_wgrad_compute=True)
    with pytest.raises(TypeError, match="hook must be callable"):
        te.Linear(4, 4, delay_wgrad_compute=True).register_wgrad_accumulation_and_reduce_hooks(3)


def test_compile_refuses_clearly():
    """Under torch.compile no tensor the backward writes can leave the compiled graph (AOT
    autograd: a forward output mutated by the backward), so the delayed path is eager only and
    says so rather than computing the weight gradient at the wrong time."""
    m = te.Linear(16, 16, delay_wgrad_compute=True)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="eager mode only") as info:
        compiled(torch.randn(4, 16))
    assert "NotImplementedError" in repr(info.value) or isinstance(info.value, NotImplementedError)
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
    from te_compile.functional.linear import _Args

    x, w, b = torch.randn(2, 8, 32), torch.randn(16, 32), torch.randn(16)
    for t in (x, w, b):
        t.requires_grad_()
    specs = {"input_spec": "current:e4m3", "weight_spec": "current:e4m3",
             "grad_spec": "current:e5m2"}  # fmt: skip
    args = _Args(x, w, b, None, **specs, wgrad_stash=torch.empty(2, 8, 16))
    yield torch.ops.te.linear_fwd.default, tuple(args)
    gx, gw = torch.randn(40, 32, requires_grad=True), torch.randn(2, 16, 32, requires_grad=True)
    splits = torch.tensor([8, 32])
    yield (
        torch.ops.te.grouped_linear_fwd.default,
        (gx, splits, gw, None, None, "", torch.float8_e4m3fn, torch.float8_e5m2, False, 1,
         False, None, None, False, torch.empty(40, 16)),
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
