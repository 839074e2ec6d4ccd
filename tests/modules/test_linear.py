"""te_compile.Linear: construction, Transformer Engine's options, compile and graph snapshots."""

from __future__ import annotations

from contextlib import nullcontext

import expecttest
import pytest
import torch

import te_compile as te
from tests.utils import (
    DEVICES,
    GraphRecorder,
    assert_close,
    behaviour_backend,
    compile_counted,
    count_graph_breaks,
    to_reference,
)


def _pair(in_f=16, out_f=8, bias=True, dtype=torch.float32, device="cpu"):
    m = te.Linear(in_f, out_f, bias=bias, params_dtype=dtype, device=device)
    ref = torch.nn.Linear(in_f, out_f, bias=bias, dtype=dtype, device=device)
    ref.load_state_dict(m.state_dict())
    return m, ref


def test_parameters_and_defaults():
    m = te.Linear(16, 8)
    assert m.weight.shape == (8, 16) and m.bias.shape == (8,)
    assert m.weight.dtype == torch.get_default_dtype()
    assert torch.count_nonzero(m.bias) == 0
    assert 0.015 < m.weight.std().item() < 0.031  # TE's default init: normal, std 0.023
    assert te.Linear(4, 2, bias=False).bias is None
    seen = []
    te.Linear(4, 2, init_method=lambda w: seen.append(w.shape) or torch.nn.init.ones_(w))
    assert seen == [(2, 4)]
    assert "in_features=16, out_features=8" in repr(m)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_features_raise(bad):
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        te.Linear(bad, 4)
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        te.Linear(4, bad)


def test_bad_params_dtype_raises():
    with pytest.raises(ValueError, match="params_dtype must be a floating dtype"):
        te.Linear(4, 4, params_dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_nn_linear_state_dict_compatible(device, dtype):
    m, ref = _pair(dtype=dtype, device=device)
    x = torch.randn(3, 5, 16, device=device, dtype=dtype)
    ref64 = to_reference(torch.nn.Linear(16, 8, dtype=torch.float64))
    ref64.load_state_dict(m.state_dict())
    assert_close(m(x), ref64(to_reference(x)), dtype)
    assert set(m.state_dict()) == set(ref.state_dict()) == {"weight", "bias"}


def test_return_bias():
    m = te.Linear(16, 8, return_bias=True)
    torch.nn.init.normal_(m.bias)
    x = torch.randn(4, 16)
    out, bias = m(x)
    assert bias is m.bias
    torch.testing.assert_close(out + bias, torch.nn.functional.linear(x, m.weight, m.bias))


def test_fuse_wgrad_accumulation_requires_main_grad():
    m = te.Linear(16, 8, fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match=r"needs weight\.main_grad"):
        m(torch.randn(2, 16))
    m.weight.main_grad = torch.zeros(8, 16)
    x = torch.randn(2, 16)
    m(x).sum().backward()
    assert m.weight.grad is None
    torch.testing.assert_close(m.weight.main_grad, torch.ones(2, 8).t() @ x)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_step_matches_eager(device):
    torch.manual_seed(0)
    m, _ = _pair(device=device)
    m2, _ = _pair(device=device)
    m2.load_state_dict(m.state_dict())
    step = lambda mod, x: mod(torch.relu(mod(x) @ torch.ones(8, 16, device=device))).sum()  # noqa: E731
    compiled, counter = compile_counted(step, backend=behaviour_backend(device), dynamic=True)
    for n in (4, 7, 9):  # varying batch: one dynamic graph, no recompiles past the first
        x = torch.randn(n, 16, device=device)
        step(m, x).backward()
        compiled(m2, x).backward()
    assert counter.frame_count == 1
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert_close(a.grad, b.grad.double(), torch.float32)


def test_zero_graph_breaks_in_module_stack():
    model = torch.nn.Sequential(te.Linear(16, 32), torch.nn.GELU(), te.Linear(32, 4))
    graphs, breaks = count_graph_breaks(model, torch.randn(3, 16))
    assert (graphs, breaks) == (1, 0)


class TestGraphSnapshots(expecttest.TestCase):
    """The op sequence of Linear's compiled forward and backward graphs. A new graph break,
    a decomposition of our op, or an extra copy shows up as a diff here."""

    def _record(self, fn, *args):
        torch._dynamo.reset()
        rec = GraphRecorder()
        torch.compile(fn, backend=rec, fullgraph=True)(*args).sum().backward()
        return rec.summary()

    def test_linear_with_bias(self):
        m = te.Linear(16, 8)
        self.assertExpectedInline(
            self._record(m, torch.randn(2, 3, 16, requires_grad=True)),
            """\
forward:
  te.linear_fwd.default
backward:
  auto_functionalized_v2(te.linear_bwd.default)""",
        )

    def test_linear_weight_grad_only(self):
        m = te.Linear(16, 8, bias=False)
        self.assertExpectedInline(
            self._record(m, torch.randn(4, 16)),
            """\
forward:
  te.linear_fwd.default
backward:
  auto_functionalized_v2(te.linear_bwd.default)""",
        )

    def test_linear_main_grad(self):
        m = te.Linear(16, 8, fuse_wgrad_accumulation=True)
        m.weight.main_grad = torch.zeros(8, 16)
        self.assertExpectedInline(
            self._record(m, torch.randn(4, 16)),
            """\
forward:
  te.linear_fwd.default
backward:
  auto_functionalized_v2(te.linear_bwd.default)
  aten.copy_.default""",
        )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", [None, "current"], ids=["hp", "fp8_current"])
def test_layernorm_linear_accumulates_into_main_grad(recipe, compiled):
    """LayerNormLinear(fuse_wgrad_accumulation=True), with the norm an op of its own (high
    precision) or the FP8 GEMM's prologue: two steps add their weight gradients into
    ``weight.main_grad`` (fp32), ``weight.grad`` stays None, and the sum equals the module
    without the fusion; the norm's and the bias's gradients are as usual."""
    torch.manual_seed(0)
    plain = te.LayerNormLinear(16, 32)
    fused = te.LayerNormLinear(16, 32, fuse_wgrad_accumulation=True)
    fused.load_state_dict(plain.state_dict())
    with pytest.raises(RuntimeError, match=r"LayerNormLinear\(fuse_wgrad_accumulation=True\)"):
        fused(torch.randn(2, 16))
    fused.weight.main_grad = torch.zeros(32, 16)
    run = torch.compile(fused, fullgraph=True, backend=behaviour_backend()) if compiled else fused
    ctx = (lambda: te.autocast(recipe=te.recipe.Float8CurrentScaling())) if recipe else nullcontext
    for _ in range(2):
        x = torch.randn(32, 16)
        with ctx():
            run(x).square().sum().backward()
            plain(x).square().sum().backward()
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight.main_grad, plain.weight.grad)
    for name in ("bias", "layer_norm_weight", "layer_norm_bias"):
        torch.testing.assert_close(getattr(fused, name).grad, getattr(plain, name).grad)


def _overwrite_modules():
    g = {"params_dtype": torch.float32}
    return {
        "Linear": lambda: te.Linear(32, 16, fuse_wgrad_accumulation=True, **g),
        "LayerNormLinear": lambda: te.LayerNormLinear(32, 16, fuse_wgrad_accumulation=True, **g),
        "LayerNormMLP": lambda: te.LayerNormMLP(32, 32, fuse_wgrad_accumulation=True, **g),
        "GroupedLinear": lambda: te.GroupedLinear(2, 32, 16, fuse_wgrad_accumulation=True, **g),
        "GroupedLinear_single": lambda: te.GroupedLinear(
            2, 32, 16, fuse_wgrad_accumulation=True, single_grouped_weight=True, **g
        ),
        "ops.BasicLinear": lambda: te.ops.BasicLinear(32, 16, accumulate_into_main_grad=True),
    }


_OVERWRITE_CASES = [
    *((name, recipe, False) for name in _overwrite_modules() for recipe in (None, "current")),
    # Compiled: the two families' autograd backwards (the others share them), FP8 included.
    ("Linear", "current", True),
    ("GroupedLinear", "current", True),
]


@pytest.mark.parametrize(("name", "recipe", "compiled"), _OVERWRITE_CASES)
def test_overwrite_main_grad_replaces_its_values(name, recipe, compiled):
    """Transformer Engine's ``weight.overwrite_main_grad = True``: the backward writes the
    weight gradient into ``main_grad`` instead of adding it to what is there (Megatron-FSDP's
    convention). Against the same step into a zeroed ``main_grad``, exactly; without the
    attribute the old values stay added (the attribute is not ignored)."""
    grouped = name.startswith("GroupedLinear")
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    m = _overwrite_modules()[name]()
    weights = [p for n, p in m.named_parameters() if "weight" in n and "layer_norm" not in n]
    single = name.endswith("single")
    if single:
        m.allocate_main_grad()
    r = te.recipe.Float8CurrentScaling() if recipe else None

    def step(start: float, overwrite: bool) -> list[torch.Tensor]:
        for w in weights:
            if single:  # the buffer allocate_main_grad made
                w.main_grad.fill_(start)
            else:
                w.main_grad = torch.full(w.shape, start)
            w.overwrite_main_grad = overwrite
        fn = torch.compile(m, fullgraph=True, backend=behaviour_backend()) if compiled else m
        with te.autocast(enabled=r is not None, recipe=r):
            y = fn(x, [16, 16]) if grouped else fn(x)
        y.square().sum().backward()
        return [w.main_grad.clone() for w in weights]

    zero = step(0.0, False)
    assert all(g.abs().sum() > 0 for g in zero)
    for got, want in zip(step(7.0, True), zero, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(step(7.0, False), zero, strict=True):  # accumulated: 7 + the gradient
        assert_close(got, want.double() + 7.0, torch.float32, roundings=2)


def test_overwrite_main_grad_needs_main_grad():
    x, w = torch.randn(4, 16), torch.randn(8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="overwrite_main_grad=True needs main_grad"):
        te.functional.linear(x, w, overwrite_main_grad=True)
    with pytest.raises(ValueError, match="overwrite_main_grad=True needs main_grad"):
        te.functional.grouped_linear(x, [2, 2], w.view(2, 4, 16), overwrite_main_grad=True)
