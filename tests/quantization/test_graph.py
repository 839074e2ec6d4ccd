"""te.make_graphed_callables: argument checks (CPU), the replay machinery with stand-in graphs
(CPU), the FP8 state saved and put back around capture (CPU), and on a GPU: graphed modules and
functions against their eager twins (values, gradients, the delayed-scaling history and scales
step by step) in bf16 and FP8, shared pools, unused inputs, keyword arguments, fallbacks."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import te_compile as te
from te_compile.quantization import graph as graph_mod
from te_compile.quantization import graph_replay
from te_compile.quantization.fp8_gemm import FP8GemmState
from tests.utils import HAS_CUDA, assert_close, assert_matches_eager, dtype_tols, requires_cuda

H, FFN, HEADS = 64, 128, 4
_CUDA_IS_AVAILABLE = torch.cuda.is_available


def _fp8_states(module: nn.Module) -> list[FP8GemmState]:
    return [m for m in module.modules() if isinstance(m, FP8GemmState)]


# Argument checks (CPU: every check runs before the CUDA one) ----------------------------------


def _lin():
    return te.Linear(16, 16, device="cpu")


def _x():
    return torch.randn(4, 16, requires_grad=True)


BAD_ARGS = [
    # (id, call kwargs beyond modules/sample_args or replacing them, error, message fragment)
    ("modules_list", {"modules": "list"}, TypeError, "modules must be a callable or a tuple"),
    ("modules_int", {"modules": 42}, TypeError, "modules must be a callable"),
    ("modules_empty", {"modules": (), "sample_args": ()}, ValueError, "at least one callable"),
    ("modules_twice", {"modules": "twice"}, ValueError, "twice"),
    ("sample_args_tensor", {"sample_args": "tensor"}, TypeError, "sample_args must be a tuple"),
    ("sample_args_count", {"modules": "two", "sample_args": "one"}, ValueError,
     "sample_args must be a tuple with one entry per callable (2)"),
    ("sample_args_scalar", {"sample_args": "scalar"}, TypeError,
     "sample_args must hold tensors only"),
    ("sample_kwargs_list", {"sample_kwargs": [{}]}, TypeError, "sample_kwargs must be a dict"),
    ("sample_kwargs_key", {"sample_kwargs": {1: 2}}, TypeError, "sample_kwargs keys"),
    ("num_warmup_iters_negative", {"num_warmup_iters": -1}, ValueError, "num_warmup_iters"),
    ("num_warmup_iters_float", {"num_warmup_iters": 1.5}, TypeError, "num_warmup_iters"),
    ("num_warmup_iters_bool", {"num_warmup_iters": True}, TypeError, "num_warmup_iters"),
    ("allow_unused_input", {"allow_unused_input": "yes"}, ValueError, "allow_unused_input"),
    ("retain_graph_in_backward", {"retain_graph_in_backward": 1}, ValueError,
     "retain_graph_in_backward"),
    ("calibrating", {"calibrating": 1}, ValueError, "calibrating must be a bool"),
    ("enabled_type", {"enabled": "yes"}, TypeError, "enabled must be a bool or a tuple"),
    ("enabled_count", {"modules": "two", "enabled": (True,)}, ValueError,
     "enabled must have one entry per callable (2)"),
    ("recipe", {"recipe": "delayed"}, TypeError, "recipe must be a Recipe"),
    ("amax_reduction_group", {"amax_reduction_group": 3}, TypeError, "amax_reduction_group"),
    ("pool", {"pool": 5}, TypeError, "pool must be None or a handle"),
    ("pre_warmup_hook", {"pre_warmup_hook": 3}, TypeError, "pre_warmup_hook must be callable"),
    ("post_warmup_hook", {"post_warmup_hook": 3}, TypeError, "post_warmup_hook"),
    ("capture_stream", {"capture_stream": "s"}, TypeError, "capture_stream must be a"),
    ("clone_param_grads", {"_clone_param_grads_on_return": None}, ValueError,
     "_clone_param_grads_on_return"),
    ("cache_quantized_params", {"cache_quantized_params": True}, NotImplementedError,
     "cache_quantized_params=True"),
    ("order_type", {"_order": "1,-1"}, TypeError, "_order must be a non-empty list"),
    ("order_zero", {"_order": [1, 0, -1]}, ValueError, "_order entries must be non-zero"),
    ("order_counts", {"_order": [1, 1, -1]}, ValueError, "_order must hold each chunk"),
    ("order_backward_first", {"_order": [-1, 1]}, ValueError,
     "backward of chunk 1 before its forward"),
    ("order_samples", {"_order": [1, 2, -2, -1]}, ValueError,
     "sample_args must hold one entry per forward pass, a multiple of 2 chunks"),
    ("order_layers", {"_order": [1, -1], "_num_layers_per_chunk": [1, 1]}, ValueError,
     "_num_layers_per_chunk must be None, a positive int or 1 positive"),
    ("order_callables", {"_order": [1, -1], "_num_layers_per_chunk": 2}, ValueError,
     "one callable per layer of the chunks of _order (2), got 1"),
    ("order_sample_count", {"modules": "two", "_order": [1, -1, 1, -1], "sample_args": "two",
                            "_num_layers_per_chunk": 2},
     ValueError, "sample_args must be a tuple with one entry per forward pass (4)"),
    ("order_single", {"_order": [1, -1, 1, -1], "_num_layers_per_chunk": 1}, ValueError,
     r"sample_args must hold one entry per forward pass (2): pass modules as a tuple"),
    ("num_layers_per_chunk", {"_num_layers_per_chunk": [1]}, ValueError,
     "_num_layers_per_chunk is used with _order only"),
    ("reuse_buffers", {"_reuse_graph_input_output_buffers": True}, NotImplementedError,
     "_reuse_graph_input_output_buffers"),
    ("capture_time_hooks", {"capture_time_hooks": [{}]}, NotImplementedError,
     "capture_time_hooks"),
    ("both_enabled_names", {"fp8_enabled": True, "enabled": True}, ValueError,
     "fp8_enabled is the deprecated name of enabled"),
    ("both_recipe_names", {"fp8_recipe": te.recipe.DelayedScaling(),
                           "recipe": te.recipe.DelayedScaling()}, ValueError,
     "fp8_recipe is the deprecated name of recipe"),
    ("function_fp8_no_warmup", {"modules": "function", "enabled": True, "num_warmup_iters": 0},
     ValueError, "num_warmup_iters must be >= 1 when a function"),
]  # fmt: skip


def _resolve(kwargs):
    lin, x = _lin(), _x()
    call = {"modules": lin, "sample_args": (x,), **kwargs}
    choices = {
        "list": [lin],
        "twice": (lin, lin),
        "two": (lin, _lin()),
        "function": lambda t: t * 2,
    }
    if isinstance(call["modules"], str):
        call["modules"] = choices[call["modules"]]
    samples = {"tensor": x, "one": ((x,),), "two": ((x,), (_x(),)), "scalar": (x, 3)}
    if isinstance(call["sample_args"], str):
        call["sample_args"] = samples[call["sample_args"]]
    if (
        call["modules"] is not lin
        and isinstance(call["modules"], tuple)
        and "sample_args" not in (kwargs)
    ):
        call["sample_args"] = tuple((_x(),) for _ in call["modules"])
    return call


@pytest.mark.parametrize(("kwargs", "error", "match"), [c[1:] for c in BAD_ARGS],
                         ids=[c[0] for c in BAD_ARGS])  # fmt: skip
def test_bad_arguments(kwargs, error, match):
    call = _resolve(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")):
            te.make_graphed_callables(**call)


def test_deprecated_names_warn():
    """TE's older fp8_* names are accepted with a DeprecationWarning naming the new one."""
    for old, value in (
        ("fp8_enabled", False),
        ("fp8_calibrating", False),
        ("fp8_recipe", te.recipe.DelayedScaling()),
        ("fp8_weight_caching", False),
    ):
        # capture_time_hooks stops the call after the renamed arguments are resolved.
        warns = pytest.warns(DeprecationWarning, match=f"{old} is deprecated")
        with warns, pytest.raises(NotImplementedError, match="capture_time_hooks"):
            te.make_graphed_callables(_lin(), (_x(),), capture_time_hooks=[{}], **{old: value})


def test_module_checks():
    lin = _lin()
    lin.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="no hooks registered"):
        te.make_graphed_callables(lin, (_x(),))
    lin = _lin()
    lin.register_buffer("extra", torch.zeros(2, requires_grad=True))
    with pytest.raises(ValueError, match="only parameters may require grad"):
        te.make_graphed_callables(lin, (_x(),))
    lin = _lin()
    lin.forward = graph_replay.graphed_forward(lin, True, lambda *a: None)
    with pytest.raises(ValueError, match="already graphed"):
        te.make_graphed_callables(lin, (_x(),))
    with pytest.raises(ValueError, match="all be in training mode or all in eval mode"):
        te.make_graphed_callables((_lin().train(), _lin().eval()), ((_x(),), (_x(),)))


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised where there is no CUDA GPU")
def test_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA GPU"):
        te.make_graphed_callables(_lin(), (_x(),))


# The replay machinery, with stand-in graphs on the CPU -----------------------------------------


class _StandIn:
    """A 'graph' whose replay runs a fixed function on the static tensors, as a CUDA graph
    replays its kernels on fixed addresses."""

    def __init__(self, fn):
        self.fn = fn
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.fn()


def _stand_in_graphs(training=True, clone=True):
    """y = x * w + gate (w a parameter; ``gate`` a keyword tensor, ``mode`` a static keyword)."""
    x = torch.randn(3, 4, requires_grad=True)
    gate = torch.randn(3, 4)
    w = nn.Parameter(torch.randn(3, 4))
    spec = graph_replay.CallSpec(0, (x,), {"gate": gate, "mode": "add"})
    y = torch.empty(3, 4, requires_grad=True)
    gy, gx, gw = torch.empty(3, 4), torch.empty(3, 4), torch.empty(3, 4)

    def fwd():
        with torch.no_grad():
            y.copy_(x * w + gate)

    def bwd():
        gx.copy_(gy * w.detach())
        gw.copy_(gy * x.detach())

    g = graph_replay.CapturedGraphs(spec, (w,), training, _StandIn(fwd), _StandIn(bwd))
    g.outputs, g.out_spec = (y,), torch.utils._pytree.tree_flatten(y)[1]
    g.out_requires_grad = (True,)
    g.grad_outputs = (gy,)
    g.grad_inputs = (gx, None, gw)  # x, gate (no grad), w
    g.clone_param_grads = clone
    return g, w


def test_replay_values_and_gradients():
    """Each call copies its tensors into the static inputs, replays, and its backward returns
    the gradients the backward 'graph' wrote, the parameter's as a copy."""
    g, w = _stand_in_graphs()
    call = graph_replay.make_replay(g)
    for _ in range(3):
        x = torch.randn(3, 4, requires_grad=True)
        gate = torch.randn(3, 4)
        dy = torch.randn(3, 4)
        w.grad = None
        y = call(x, gate=gate, mode="add")
        torch.testing.assert_close(y, x.detach() * w.detach() + gate, rtol=0, atol=0)
        y.backward(dy)
        torch.testing.assert_close(x.grad, dy * w.detach(), rtol=0, atol=0)
        torch.testing.assert_close(w.grad, dy * x.detach(), rtol=0, atol=0)
        assert w.grad.data_ptr() != g.grad_inputs[2].data_ptr()  # cloned
    assert g.fwd.replays == 3 and g.bwd.replays == 3


def test_replay_param_grads_not_cloned():
    g, w = _stand_in_graphs(clone=False)
    call = graph_replay.make_replay(g)
    call(torch.randn(3, 4, requires_grad=True), gate=torch.randn(3, 4), mode="add").sum().backward()
    assert w.grad.data_ptr() == g.grad_inputs[2].data_ptr()


def test_replay_refuses_other_inputs():
    g, w = _stand_in_graphs()
    call = graph_replay.make_replay(g)
    gate = torch.randn(3, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"input 0 must match its sample \(shape \(3, 4\)"):
        call(torch.randn(3, 5, requires_grad=True), gate=gate, mode="add")
    with pytest.raises(ValueError, match="float32"):
        call(x.double(), gate=gate, mode="add")
    with pytest.raises(ValueError, match="requires_grad"):
        call(x.detach(), gate=gate, mode="add")
    with torch.no_grad():  # no backward: requires_grad does not matter
        call(x.detach(), gate=gate, mode="add")
    with pytest.raises(ValueError, match="must equal its sample_kwargs value 'add'"):
        call(x, gate=gate, mode="mul")
    with pytest.raises(TypeError, match="keyword arguments must be those of sample_kwargs"):
        call(x, gate=gate)
    with pytest.raises(TypeError, match="keyword arguments must be those of sample_kwargs"):
        call(x, gate=gate, mode="add", other=1)
    with pytest.raises(ValueError, match="positional arguments must have sample_args"):
        call(x, x, gate=gate, mode="add")
    w.requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires_grad changed since capture"):
        call(x, gate=gate, mode="add")
    w.requires_grad_(True)
    w.data = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="parameter's storage changed"):
        call(x, gate=gate, mode="add")


def test_replay_backward_of_an_overwritten_call_raises():
    g, _ = _stand_in_graphs()
    call = graph_replay.make_replay(g)
    gate = torch.randn(3, 4)
    y1 = call(torch.randn(3, 4, requires_grad=True), gate=gate, mode="add")
    y2 = call(torch.randn(3, 4, requires_grad=True), gate=gate, mode="add")
    with pytest.raises(RuntimeError, match="forward graph was replayed again"):
        y1.sum().backward()
    y2.sum().backward()


def test_graphed_forward_falls_back_in_the_other_mode():
    """A graphed module replays in the mode it was captured in and runs its own forward in the
    other one."""
    lin = _lin().train()
    calls = []

    def replay(*args, **kwargs):
        calls.append(args)
        return "replayed"

    lin.forward = graph_replay.graphed_forward(lin, True, replay)
    x = torch.randn(2, 16)
    assert lin(x) == "replayed"
    lin.eval()
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert len(calls) == 1


def test_fp8_states_saved_and_restored():
    """The FP8 buffers are put back in place (same storage) after capture; under delayed
    scaling the states are marked calibrated (the graphs hold the delayed path), and on a
    failed capture the flag is put back too."""
    lin = _lin()
    (state,) = _fp8_states(lin)
    ptrs = [b.data_ptr() for b in state.buffers()]
    before = [b.clone() for b in state.buffers()]
    for flags in (False, True):
        states = graph_mod._FP8States()
        states.add(lin, calibrate_off=True)
        states.add(lin, calibrate_off=True)  # a module met twice is saved once
        assert state.calibrated
        for b in state.buffers():
            b.fill_(7.0)
        states.restore(flags=flags)
        assert state.calibrated is (not flags)
        state.calibrated = False
        for b, ref, ptr in zip(state.buffers(), before, ptrs, strict=True):
            assert b.data_ptr() == ptr
            assert torch.equal(b, ref)


class _FakeGraph:
    """Stand-in for torch.cuda.CUDAGraph: 'capture' runs the code for real (on the CPU), replay
    does nothing, so a call with the samples themselves returns what the capture computed."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class _FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """make_graphed_callables' capture path on the CPU: CUDA's graph, stream and RNG calls
    replaced by stand-ins, so warm-up, capture order, FP8 state restore and the wrapping of the
    results run here (the GPU tests check the values of real replays)."""
    graphs = []

    def fake_graph_class():
        graphs.append(_FakeGraph())
        return graphs[-1]

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None):
        graph.captured_at = sum(hasattr(g, "captured_at") for g in graphs)
        yield

    for name, value in (
        ("is_available", lambda: True),
        ("CUDAGraph", fake_graph_class),
        ("graph", fake_graph),
        ("graph_pool_handle", lambda: (0, 1)),
        ("Stream", _FakeStream),
        ("stream", lambda s: contextlib.nullcontext()),
        ("current_stream", lambda: None),
        ("synchronize", lambda: None),
        ("get_rng_state", torch.get_rng_state),
        ("set_rng_state", torch.set_rng_state),
    ):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(graph_replay.CallSpec, "check_devices", lambda self: None)
    # The default recipe asks the (absent) GPU for its compute capability.
    monkeypatch.setattr(te.quantization.state, "get_default_fp8_recipe", te.recipe.DelayedScaling)
    # So does the once-per-process emulation notice, when this is the process's first autocast.
    monkeypatch.setattr(te.quantization.device, "_capability", lambda: None)
    return graphs


class _Counted(nn.Module):
    """A te.Linear that notes the autocast state of each run of its Python forward."""

    def __init__(self):
        super().__init__()
        self.lin = te.Linear(32, 32, device="cpu")
        self.runs = []

    def forward(self, x):
        self.runs.append(te.quantization.get_autocast_state())
        return self.lin(x)


@pytest.mark.parametrize("callable_kind", ["module", "function"])
def test_capture_path_with_stand_ins(stand_in_cuda, callable_kind):
    """Warm-up runs num_warmup_iters times under the recipe, then one capture; the FP8 buffers
    come back as they were (same storage), the states are marked calibrated (delayed), the RNG
    state is put back, the warm-up hooks run once each; a module comes back as itself with its
    forward replaced, a function as a graphed function; replays run no Python forward."""
    torch.manual_seed(0)
    recipe = te.recipe.DelayedScaling(amax_history_len=4)
    model = _Counted().train()
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=recipe):  # the calibration step
        model(x).sum().backward()
    model.runs.clear()
    (state,) = _fp8_states(model)
    before = [b.clone() for b in state.buffers()]
    ptrs = [b.data_ptr() for b in state.buffers()]
    hooks = []
    rng = torch.get_rng_state()
    target = model if callable_kind == "module" else (lambda t: model(t))
    graphed = te.make_graphed_callables(
        target, (x,), num_warmup_iters=2, enabled=True, recipe=recipe,
        pre_warmup_hook=lambda: hooks.append("pre"), post_warmup_hook=lambda: hooks.append("post"),
    )  # fmt: skip
    assert len(model.runs) == 3  # two warm-up runs and the capture
    assert all(r.enabled and r.recipe is recipe for r in model.runs)
    assert hooks == ["pre", "post"]
    assert torch.equal(torch.get_rng_state(), rng)
    assert state.calibrated
    for b, ref, ptr in zip(state.buffers(), before, ptrs, strict=True):
        assert b.data_ptr() == ptr
        assert torch.equal(b, ref)
    if callable_kind == "module":
        assert graphed is model
    else:
        assert not isinstance(graphed, nn.Module)
    bwd, fwd = stand_in_cuda  # made in this order
    graphed(x).sum().backward()
    assert (fwd.replays, bwd.replays) == (1, 1)
    assert len(model.runs) == 3
    if callable_kind == "module":
        model.eval()  # the other mode: the module's own forward
        model(x)
        assert len(model.runs) == 4 and fwd.replays == 1


def test_graphed_module_inside_a_compiled_region(stand_in_cuda, monkeypatch):
    """A compiled function that calls a graphed module: the replay is left to eager (a graph
    break at the call, ``torch.compiler.disable``) and runs, forward and backward."""
    torch._dynamo.reset()
    model = te.Linear(32, 32, device="cpu").train()
    x = torch.randn(16, 32, requires_grad=True)
    graphed = te.make_graphed_callables(model, (x,))
    bwd, fwd = stand_in_cuda
    monkeypatch.setattr(torch.cuda, "is_available", _CUDA_IS_AVAILABLE)  # dynamo asks

    def step(t):
        return (graphed(t) * 2).sum()

    torch.compile(step, backend="aot_eager")(x).backward()
    assert (fwd.replays, bwd.replays) == (1, 1)
    assert x.grad is not None and model.weight.grad is not None


def test_interleaved_order_with_stand_ins(stand_in_cuda):
    """``_order`` (Megatron's interleaved pipeline schedule): chunk 1 of one layer, chunk 2 of
    two layers, two micro-batches. Warm-up runs the passes in forward order, the captures follow
    ``_order`` (a chunk's layers forward in order, backward in reverse), the result is one
    graphed forward per pass and the modules keep their own forward."""
    torch.manual_seed(0)
    layers = tuple(te.Linear(16, 16, device="cpu") for _ in range(3))
    forwards = [m.forward for m in layers]
    order = [1, 2, 1, -2, 2, -1, -2, -1]
    samples = tuple((torch.randn(8, 16, requires_grad=True),) for _ in range(6))
    seen = []

    def noting(forward, i):
        def run(t):
            seen.append(i)
            return forward(t)

        return run

    wrappers = [noting(f, i) for i, f in enumerate(forwards)]
    for m, w in zip(layers, wrappers, strict=True):
        m.forward = w
    result = te.make_graphed_callables(layers, samples, num_warmup_iters=1, _order=order,
                                       _num_layers_per_chunk=[1, 2])  # fmt: skip
    assert len(result) == 6 and not any(isinstance(r, nn.Module) for r in result)
    # Pass p of chunk m, micro-batch k, layer l: first_layer[m] * 2 + k * layers[m] + l.
    layer_of_pass = [0, 0, 1, 2, 1, 2]
    warm_order = [0, 2, 3, 1, 4, 5]
    assert seen == [layer_of_pass[p] for p in warm_order + warm_order]  # warm-up, then capture
    graphs = stand_in_cuda
    bwd = {p: graphs[2 * p] for p in range(6)}
    fwd = {p: graphs[2 * p + 1] for p in range(6)}
    events = [("f", 0), ("f", 2), ("f", 3), ("f", 1), ("b", 3), ("b", 2), ("f", 4), ("f", 5),
              ("b", 0), ("b", 5), ("b", 4), ("b", 1)]  # fmt: skip
    captured = sorted((g.captured_at, kind, p) for kind, d in (("f", fwd), ("b", bwd))
                      for p, g in d.items())  # fmt: skip
    assert [(kind, p) for _, kind, p in captured] == events
    for p, r in enumerate(result):
        r(*samples[p]).sum().backward()
        assert (fwd[p].replays, bwd[p].replays) == (1, 1)
    assert [m.forward for m in layers] == wrappers  # not replaced under _order
    assert len(seen) == 12  # replays run no Python forward


def test_capture_failure_leaves_the_module_as_it_was(stand_in_cuda):
    """An unused input without allow_unused_input: ValueError naming it, and the module keeps
    its forward, its FP8 buffers and its calibration flag."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = te.Linear(32, 32, device="cpu")

        def forward(self, x, unused):
            return self.lin(x)

    module = TwoInputs().train()
    (state,) = _fp8_states(module)
    x, unused = torch.randn(16, 32, requires_grad=True), torch.randn(4, requires_grad=True)
    forward = module.forward
    with pytest.raises(ValueError, match="allow_unused_input=True"):
        te.make_graphed_callables(module, (x, unused), enabled=True,
                                  recipe=te.recipe.DelayedScaling())  # fmt: skip
    assert module.forward == forward
    assert not state.calibrated
    assert not state.amax_history.any()
    graphed = te.make_graphed_callables(module, (x, unused), allow_unused_input=True)
    graphed(x, unused).sum().backward()
    assert unused.grad is None


# On a GPU ---------------------------------------------------------------------------------------

RECIPES = {
    "bf16": None,
    "delayed": lambda: te.recipe.DelayedScaling(amax_history_len=16),
    "current": te.recipe.Float8CurrentScaling,
}


def _module(kind):
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    if kind == "Linear":
        return te.Linear(H, 96, **kw)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(H, FFN, **kw)
    return te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               attn_input_format="bshd", **kw)  # fmt: skip


def _skip_without_fp8(name):
    if RECIPES[name] is not None and not te.is_fp8_available():
        pytest.skip("no FP8 on this GPU")


def _kwargs(kind):
    if kind != "TransformerLayer":
        return {}
    return {"rotary_pos_emb": te.RotaryPositionEmbedding(H // HEADS)(32).cuda()}


def _step(module, x, dy, kwargs, recipe=None):
    """One training step: (output, input gradient, parameter gradients)."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    if recipe is None:
        y = module(x, **kwargs)
    else:
        with te.autocast(recipe=recipe):
            y = module(x, **kwargs)
    y.backward(dy)
    return y.detach().clone(), x.grad.clone(), [p.grad.clone() for p in module.parameters()]


def _shape(kind):
    return (2, 32, H) if kind == "TransformerLayer" else (64, H)


@requires_cuda
@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_graphed_module_matches_eager(kind, recipe_name):
    """A graphed te module's training steps give its eager twin's outputs and gradients, and
    under DelayedScaling its amax history and scales advance on each replay as the twin's do;
    building the graphs changes neither the FP8 state nor the CUDA RNG state."""
    _skip_without_fp8(recipe_name)
    torch.manual_seed(0)
    recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] else None
    model = _module(kind).train()
    kwargs = _kwargs(kind)
    shape = _shape(kind)
    out_features = 96 if kind == "Linear" else H
    dy_shape = (*shape[:-1], out_features)
    if recipe is not None:  # one eager step first: delayed scaling's calibration step
        x0 = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        _step(model, x0, torch.randn(dy_shape, device="cuda", dtype=torch.bfloat16), kwargs, recipe)
    twin = copy.deepcopy(model)
    states, twin_states = _fp8_states(model), _fp8_states(twin)
    sample = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rng = torch.cuda.get_rng_state()
    graphed = te.make_graphed_callables(
        model, (sample,), sample_kwargs=kwargs, enabled=recipe is not None, recipe=recipe
    )
    assert graphed is model
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    for s, t in zip(states, twin_states, strict=True):
        for a, b in zip(s.buffers(), t.buffers(), strict=True):
            assert torch.equal(a, b)
    for step in range(1, 4):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(dy_shape, device="cuda", dtype=torch.bfloat16)
        y, gx, gp = _step(graphed, x, dy, kwargs)  # no autocast: the graph holds the recipe
        y_ref, gx_ref, gp_ref = _step(twin, x, dy, kwargs, recipe)
        assert_matches_eager(y, y_ref)
        assert_matches_eager(gx, gx_ref)
        for a, b in zip(gp, gp_ref, strict=True):
            assert_matches_eager(a, b)
        if recipe_name == "delayed":
            for s, t in zip(states, twin_states, strict=True):
                filled = int((s.amax_history[:16] != 0).any(dim=1).sum())
                assert filled == step  # one row folded in per replay
                tols = dtype_tols(torch.bfloat16, 2)
                torch.testing.assert_close(s.amax_history, t.amax_history, **tols)
                torch.testing.assert_close(s.scale, t.scale, **tols)
                torch.testing.assert_close(s.grad_amax, t.grad_amax, **tols)


@requires_cuda
def test_delayed_scales_follow_the_history_on_replay():
    """Under DelayedScaling the scale each replay uses is computed inside the graph from the
    history: it changes between replays as the amaxes do (a larger input raises the input amax,
    lowering the input scale two steps later)."""
    _skip_without_fp8("delayed")
    torch.manual_seed(0)
    recipe = te.recipe.DelayedScaling(amax_history_len=1)
    model = _module("Linear").train()
    x0 = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    _step(model, x0, dy, {}, recipe)
    graphed = te.make_graphed_callables(
        model, (x0.clone().requires_grad_(),), enabled=True, recipe=recipe
    )
    (state,) = _fp8_states(model)
    scales = []
    for factor in (1.0, 1.0, 8.0, 8.0):
        _step(graphed, x0 * factor, dy, {})
        scales.append(state.scale[0].item())
    # Step k folds step k-1's amax: the x8 input of step 3 shows in step 4's scale.
    assert scales[1] == scales[2]
    assert_close(torch.tensor(scales[3]), torch.tensor(scales[2] / 8), torch.float32)


@requires_cuda
def test_multiple_callables_and_a_shared_pool():
    """Two modules graphed together (a chain: the second's sample is shaped like the first's
    output) and a third graphed separately into the same pool match their eager twins."""
    torch.manual_seed(0)
    first = te.Linear(H, H, params_dtype=torch.bfloat16, device="cuda")
    second, third = _module("LayerNormMLP"), _module("Linear")
    twins = [copy.deepcopy(m) for m in (first, second, third)]
    pool = torch.cuda.graph_pool_handle()

    def sample(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    g1, g2 = te.make_graphed_callables((first, second), ((sample(64, H),), (sample(64, H),)),
                                       pool=pool)  # fmt: skip
    g3 = te.make_graphed_callables(third, (sample(32, H),), pool=pool)
    for _ in range(3):
        x, z = torch.randn(64, H, device="cuda"), torch.randn(32, H, device="cuda")
        dy, dz = torch.randn(64, H, device="cuda"), torch.randn(32, 96, device="cuda")
        results = []
        for m1, m2, m3 in ((g1, g2, g3), twins):
            for m in (m1, m2, m3):
                m.zero_grad(set_to_none=True)
            xi = x.bfloat16().requires_grad_()
            m2(m1(xi)).backward(dy.bfloat16())
            zi = z.bfloat16().requires_grad_()
            m3(zi).backward(dz.bfloat16())
            grads = [p.grad.clone() for m in (m1, m2, m3) for p in m.parameters()]
            results.append([xi.grad, zi.grad, *grads])
        for a, b in zip(*results, strict=True):
            assert_matches_eager(a, b)


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = te.Linear(H, H, params_dtype=torch.bfloat16, device="cuda")

    def forward(self, x, unused):
        return self.lin(x)


@requires_cuda
def test_allow_unused_input():
    torch.manual_seed(0)
    module = _TwoInputs().train()
    x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    unused = torch.randn(8, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match="allow_unused_input=True"):
        te.make_graphed_callables(module, (x, unused))
    twin = copy.deepcopy(module)
    graphed = te.make_graphed_callables(module, (x, unused), allow_unused_input=True)
    dy = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    xs = [x.detach().clone().requires_grad_() for _ in range(2)]
    us = [unused.detach().clone().requires_grad_() for _ in range(2)]
    graphed(xs[0], us[0]).backward(dy)
    twin(xs[1], us[1]).backward(dy)
    assert us[0].grad is None
    assert_matches_eager(xs[0].grad, xs[1].grad)
    assert_matches_eager(module.lin.weight.grad, twin.lin.weight.grad)


@requires_cuda
def test_graphed_function():
    """A function (not a module) is graphed too: its tensor arguments get their gradients."""
    torch.manual_seed(0)

    def fn(x, w):
        return torch.nn.functional.gelu(x @ w) * 2

    def sample(*shape):
        return torch.randn(*shape, device="cuda", requires_grad=True)

    graphed = te.make_graphed_callables(fn, (sample(32, 48), sample(48, 16)))
    for _ in range(3):
        x, w, dy = sample(32, 48), sample(48, 16), torch.randn(32, 16, device="cuda")
        y = graphed(x, w)
        y.backward(dy)
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        fn(xr, wr).backward(dy)
        assert_matches_eager(y.detach(), fn(xr, wr).detach(), roundings=4)
        assert_matches_eager(x.grad, xr.grad, roundings=4)
        assert_matches_eager(w.grad, wr.grad, roundings=4)


@requires_cuda
def test_graphed_function_of_an_fp8_module():
    """A function that calls a te module under delayed scaling: the module's FP8 state is found
    while the function warms up and put back after capture; replays match the eager module."""
    _skip_without_fp8("delayed")
    torch.manual_seed(0)
    recipe = te.recipe.DelayedScaling(amax_history_len=16)
    model = _module("Linear").train()
    x0 = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(64, 96, device="cuda", dtype=torch.bfloat16)
    _step(model, x0, dy, {}, recipe)
    twin = copy.deepcopy(model)
    (state,) = _fp8_states(model)
    before = [b.clone() for b in state.buffers()]
    graphed = te.make_graphed_callables(
        lambda t: model(t), (x0.clone().requires_grad_(),), enabled=True, recipe=recipe
    )
    for a, b in zip(state.buffers(), before, strict=True):
        assert torch.equal(a, b)
    for _ in range(3):
        x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = graphed(xg)
        y.backward(dy)
        with te.autocast(recipe=recipe):
            y_ref = twin(xe)
        y_ref.backward(dy)
        assert_matches_eager(y.detach(), y_ref.detach())
        assert_matches_eager(xg.grad, xe.grad)
        torch.testing.assert_close(state.scale, _fp8_states(twin)[0].scale,
                                   **dtype_tols(torch.bfloat16, 2))  # fmt: skip


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = te.Linear(H, H, params_dtype=torch.bfloat16, device="cuda")

    def forward(self, x, *, gate, act="gelu"):
        y = self.lin(x) * gate
        return torch.nn.functional.gelu(y) if act == "gelu" else torch.relu(y)


@requires_cuda
def test_sample_kwargs():
    """Keyword tensors are graph inputs (with gradients); other keyword values are fixed by the
    capture and must be repeated."""
    torch.manual_seed(0)
    module = _Gated().train()
    twin = copy.deepcopy(module)

    def sample(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    graphed = te.make_graphed_callables(
        module, (sample(64, H),), sample_kwargs={"gate": sample(64, H), "act": "relu"}
    )
    for _ in range(2):
        x, gate, dy = sample(64, H), sample(64, H), torch.randn_like(sample(64, H))
        graphed(x, gate=gate, act="relu").backward(dy)
        xr, gr = x.detach().clone().requires_grad_(), gate.detach().clone().requires_grad_()
        twin(xr, gate=gr, act="relu").backward(dy)
        assert_matches_eager(x.grad, xr.grad)
        assert_matches_eager(gate.grad, gr.grad)
    with pytest.raises(ValueError, match="must equal its sample_kwargs value 'relu'"):
        graphed(sample(64, H), gate=sample(64, H), act="gelu")
    with pytest.raises(TypeError, match="keyword arguments must be those of sample_kwargs"):
        graphed(sample(64, H))


@requires_cuda
def test_replay_checks_and_fallback():
    """Other shapes raise; eval mode runs the module's own forward; the backward of a call
    whose saved tensors a later call overwrote raises."""
    torch.manual_seed(0)
    model = _module("Linear").train()
    twin = copy.deepcopy(model)
    x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(model, (x,))
    with pytest.raises(ValueError, match=r"input 0 must match its sample \(shape \(64, 64\)"):
        graphed(torch.randn(32, H, device="cuda", dtype=torch.bfloat16, requires_grad=True))
    graphed.eval()
    twin.eval()
    with torch.no_grad():
        z = torch.randn(32, H, device="cuda", dtype=torch.bfloat16)  # any shape in eval
        assert_matches_eager(graphed(z), twin(z))
    graphed.train()
    y1 = graphed(x.detach().clone().requires_grad_())
    y2 = graphed(x.detach().clone().requires_grad_())
    with pytest.raises(RuntimeError, match="forward graph was replayed again"):
        y1.sum().backward()
    y2.sum().backward()


@requires_cuda
def test_eval_mode_graph():
    """A module graphed in eval mode replays its forward only (no autograd)."""
    torch.manual_seed(0)
    model = _module("LayerNormMLP").eval()
    twin = copy.deepcopy(model)
    x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    graphed = te.make_graphed_callables(model, (x,))
    for _ in range(2):
        z = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert_matches_eager(graphed(z), twin(z))


@requires_cuda
def test_cpu_samples_refused():
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        te.make_graphed_callables(_lin(), (_x(),))


@requires_cuda
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed"])
def test_interleaved_pipeline_order(recipe_name):
    """``_order``: a two-chunk pipeline (chunk 1 a Linear, chunk 2 a LayerNormMLP) with two
    micro-batches, run in the schedule's order, gives the eager layers' outputs and gradients
    (accumulated over the micro-batches), FP8 state included."""
    _skip_without_fp8(recipe_name)
    torch.manual_seed(0)
    recipe = RECIPES[recipe_name]() if RECIPES[recipe_name] else None
    first = te.Linear(H, H, params_dtype=torch.bfloat16, device="cuda").train()
    second = _module("LayerNormMLP").train()

    def rand(requires_grad=False):
        return torch.randn(64, H, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)

    if recipe is not None:  # delayed scaling's calibration step, eagerly
        with te.autocast(recipe=recipe):
            second(first(rand())).backward(rand())
    twins = copy.deepcopy(first), copy.deepcopy(second)
    order = [1, 2, 1, 2, -2, -1, -2, -1]
    # Pass p of chunk m, micro-batch k: m * 2 + k (one layer per chunk).
    passes = te.make_graphed_callables(
        (first, second), tuple((rand(True),) for _ in range(4)), _order=order,
        enabled=recipe is not None, recipe=recipe,
    )  # fmt: skip
    chunk1, chunk2 = passes[:2], passes[2:]
    for _ in range(2):
        xs, dys = [rand() for _ in range(2)], [rand() for _ in range(2)]
        results = []
        eager_region = te.autocast(enabled=recipe is not None, recipe=recipe)
        for f1, f2, region in (
            (chunk1, chunk2, contextlib.nullcontext()),
            ([twins[0]] * 2, [twins[1]] * 2, eager_region),
        ):
            for m in (first, second, *twins):
                m.zero_grad(set_to_none=True)
            ins = [x.clone().requires_grad_() for x in xs]
            with region:
                ys = [f2[k](f1[k](ins[k])) for k in range(2)]
            for y, dy in zip(ys, dys, strict=True):
                y.backward(dy)
            layers = (first, second) if f1 is chunk1 else twins
            grads = [p.grad.clone() for m in layers for p in m.parameters()]
            results.append([*(y.detach().clone() for y in ys), *(i.grad for i in ins), *grads])
        for a, b in zip(*results, strict=True):
            assert_matches_eager(a, b)
