"""``forward(..., is_first_microbatch=...)``: the FP8 weight cast once per optimizer step and
kept (``quantization.gemm``, "Weight caching"), on Linear, LayerNormLinear, LayerNormMLP,
through MultiheadAttention / TransformerLayer, and on GroupedLinear (both parameter layouts) /
GroupedMLP. The kept copy gives the bytes of the per-call
cast; with False the weight is not cast again (a changed weight is not seen until True)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import te_compile as te
from te_compile.functional import gemm as fgemm
from te_compile.functional import grouped_fp8, grouped_weight
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    autocast,
)
from tests.utils import DEVICES, compile_counted, with_specs

RECIPES = {
    "current": Float8CurrentScaling,
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    # 4over6 on the weight: the kept copy carries the per-block choice of 4 or 6
    "nvfp4_4over6": lambda: NVFP4BlockScaling(nvfp4_4over6="all", disable_stochastic_rounding=True),
}
MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP")


def _module(name, device):
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": device}
    if name == "Linear":
        return te.Linear(128, 64, **kw)
    if name == "LayerNormLinear":
        return te.LayerNormLinear(128, 64, **kw)
    return te.LayerNormMLP(128, 256, **kw)


def _weights(m):
    return [p for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2]


def _x(device, step=0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(96, 128, generator=g).to(device, torch.bfloat16).requires_grad_()


def _step(m, x, recipe, first):
    with autocast(recipe=recipe):
        y = m(x, is_first_microbatch=first)
    y.float().square().mean().backward()
    return y.detach(), x.grad, [p.grad for p in m.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_kept_weight_gives_the_per_call_cast(device, kind, name):
    """True and False give exactly the output and gradients of None (same weights). Under
    DelayedScaling a False step uses the scale of its cast, not the step's: compared with True
    only."""
    runs = {}
    for first in (None, True, False):
        m = _module(name, device)
        recipe = RECIPES[kind]()
        # A first step (a False call with nothing kept would cast and keep, as in TE).
        _step(m, _x(device, 9), recipe, True if first is False else first)
        m.zero_grad()
        runs[first] = [_step(m, _x(device, s), recipe, first) for s in range(2)]
    for first in (True, False) if kind != "delayed" else (True,):
        for (y, dx, dps), (y0, dx0, dps0) in zip(runs[first], runs[None], strict=True):
            assert torch.equal(y, y0) and torch.equal(dx, dx0)
            assert all(torch.equal(a, b) for a, b in zip(dps, dps0, strict=True))


class _Counter:
    """Counts the quantisations of a tensor of the weight's shape (eager)."""

    def __init__(self, shapes):
        self.shapes, self.calls = {tuple(s) for s in shapes}, 0
        self._table = dict(fgemm.QUANTIZERS)

    def __enter__(self):
        def wrap(fn):
            def counted(spec, x2, *args):
                self.calls += tuple(x2.shape) in self.shapes
                return fn(spec, x2, *args)

            return counted

        wrapped = {k: wrap(v) for k, v in self._table.items()}
        self._patch = mock.patch.dict(fgemm.QUANTIZERS, wrapped)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        self._patch.__exit__(*exc)


@pytest.mark.parametrize("kind", ["current", "delayed"])
@pytest.mark.parametrize("name", MODULES)
def test_false_does_not_cast_again(kind, name):
    """Gradient accumulation over micro-batches: one cast per weight with True, none with
    False; a weight changed in between is not seen until the next True."""
    m, recipe = _module(name, "cpu"), RECIPES[kind]()
    x = _x("cpu")
    shapes = [w.shape for w in _weights(m)]
    with _Counter(shapes) as count:
        y_true, *_ = _step(m, x, recipe, True)
        assert count.calls == len(shapes)
        y_false, *_ = _step(m, x, recipe, False)
        assert count.calls == len(shapes)  # nothing cast
        with torch.no_grad():
            for w in _weights(m):
                w.mul_(2.0)
        y_stale, *_ = _step(m, x, recipe, False)
        assert count.calls == len(shapes)
        y_new, *_ = _step(m, x, recipe, True)
        assert count.calls == 2 * len(shapes)
        _step(m, x, recipe, None)
        assert count.calls == 3 * len(shapes)  # None casts every call
    if kind == "current":  # delayed: the scales move with the recorded amaxes
        assert torch.equal(y_true, y_false) and torch.equal(y_true, y_stale)
    assert not torch.equal(y_stale, y_new)


def test_delayed_records_the_amax_of_the_cast():
    m, recipe = _module("Linear", "cpu"), DelayedScaling(amax_history_len=4)
    x = _x("cpu")
    _step(m, x, recipe, True)
    amax = m.weight.detach().abs().max().float()
    with torch.no_grad():
        m.weight.mul_(4.0)
    _step(m, x, recipe, False)
    assert torch.equal(m.fp8_meta.fwd_amax[1], amax)  # the kept cast's, not the new weight's
    _step(m, x, recipe, True)
    assert torch.equal(m.fp8_meta.fwd_amax[1], m.weight.detach().abs().max().float())


def test_outside_autocast_nothing_is_kept():
    m = _module("Linear", "cpu")
    x = _x("cpu")
    y = m(x, is_first_microbatch=True)
    assert torch.equal(y, m(x)) and m._fp8_weights["weight"].tensors is None


@pytest.mark.parametrize("name", MODULES)
def test_bad_is_first_microbatch(name):
    m = _module(name, "cpu")
    with pytest.raises(
        ValueError, match=r"is_first_microbatch must be one of \(None, True, False\), got 1"
    ):
        m(_x("cpu"), is_first_microbatch=1)


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_compiled_true_false_one_graph_each(name):
    """Compiled fullgraph: one compile for True and one for False, values as eager."""
    recipe = Float8CurrentScaling()
    eager, compiled_m = _module(name, "cpu"), _module(name, "cpu")

    def forward(m, x, first):
        with autocast(recipe=recipe):
            return m(x, is_first_microbatch=first)

    fn, counter = compile_counted(forward, backend="aot_eager")
    firsts = (True, False, False, True, False)
    for s, first in enumerate(firsts):
        x = _x("cpu", s)
        y = fn(compiled_m, x, first)
        y0 = forward(eager, x.detach().clone().requires_grad_(), first)
        assert torch.equal(y, y0)
        for out in (y, y0):
            out.float().square().mean().backward()
        if first:  # a new weight each optimizer step: the False steps must not see it
            for m in (eager, compiled_m):
                with torch.no_grad():
                    for w in _weights(m):
                        w.add_(0.01)
    assert counter.frame_count == 2
    for p, p0 in zip(compiled_m.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, p0.grad)


def test_transformer_layer_passes_it_through():
    torch.manual_seed(0)
    layer = te.TransformerLayer(128, 256, 4, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                                attention_dropout=0.0)  # fmt: skip
    x = torch.randn(16, 2, 128, dtype=torch.bfloat16)
    recipe = Float8CurrentScaling()
    with autocast(recipe=recipe):
        y0 = layer(x)
        y1 = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            for p in layer.parameters():
                p.mul_(1.5)
        y2 = layer(x, is_first_microbatch=False)
    assert torch.equal(y0, y1)
    kept = [k for m in layer.modules() for k in getattr(m, "_fp8_weights", {}).values()]
    assert len(kept) == 4 and all(k.tensors is not None for k in kept)  # QKV, proj, FC1, FC2
    assert not torch.equal(y1, y2)  # the norms' weights changed; the GEMM weights are kept


# GroupedLinear / GroupedMLP ---------------------------------------------------------------------

GROUPED_RECIPES = {
    **{k: v for k, v in RECIPES.items() if k != "nvfp4_4over6"},  # refused: see below
    "nvfp4": NVFP4BlockScaling,  # its default Hadamard transform and stochastic rounding
}
SPLITS = [16, 0, 32]  # NVFP4's grouped GEMMs take multiples of 16 tokens per group


def _grouped(device, single=False):
    torch.manual_seed(0)
    return te.GroupedLinear(3, 64, 32, params_dtype=torch.bfloat16, device=device,
                            single_grouped_parameter=single)  # fmt: skip


def _gx(device, step=0, features=64):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(sum(SPLITS), features, generator=g)
    return x.to(device, torch.bfloat16).requires_grad_()


def _grouped_step(m, x, recipe, first):
    with autocast(recipe=recipe):
        y = m(x, SPLITS, is_first_microbatch=first)
    y.float().square().mean().backward()
    return y.detach(), x.grad, [p.grad for p in m.parameters()]


# Every layout of the kept weight (per-tensor, blockwise, dequantised) in the per-group layout;
# the single layout (the weight passed as is) once more.
_GROUPED_CASES = [(kind, False) for kind in GROUPED_RECIPES] + [("block", True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "single"), _GROUPED_CASES)
def test_grouped_kept_weight_gives_the_per_call_cast(device, kind, single):
    """True and False give exactly the output and gradients of None, every grouped recipe and
    both parameter layouts (DelayedScaling: True only, as for Linear)."""
    runs = {}
    for first in (None, True, False):
        m, recipe = _grouped(device, single), GROUPED_RECIPES[kind]()
        # A False first step casts and keeps (nothing kept yet), as Linear and TE do.
        runs[first] = [_grouped_step(m, _gx(device, s), recipe, first) for s in range(2)]
        m.zero_grad()
    for first in (True, False) if kind != "delayed" else (True,):
        for (y, dx, dps), (y0, dx0, dps0) in zip(runs[first], runs[None], strict=True):
            assert torch.equal(y, y0) and torch.equal(dx, dx0)
            assert all(torch.equal(a, b) for a, b in zip(dps, dps0, strict=True))


@pytest.mark.parametrize(
    "recipe",
    [NVFP4BlockScaling(nvfp4_4over6="weights"), NVFP4BlockScaling(disable_2d_quantization=True)],
    ids=["4over6", "1d"],
)
def test_grouped_kept_nvfp4_weight_needs_tiles_and_no_4over6(recipe):
    """The kept NVFP4 grouped weight serves as its own dgrad copy, which needs 16x16 tiles and
    no weight 4over6; other NVFP4 weights are refused by name, not cast differently."""
    m = _grouped("cpu")
    with autocast(recipe=recipe), pytest.raises(NotImplementedError, match="is_first_microbatch"):
        m(_gx("cpu"), SPLITS, is_first_microbatch=True)


def test_grouped_nvfp4_pre_quantised_weight_needs_its_dgrad_copy_or_tiles():
    """``te::grouped_linear`` with an NVFP4 pre-quantised weight of 1x16 blocks: refused without
    the dgrad copy (the weight is its own only with 16x16 tiles), naming the spec; with it (FP8
    primary weights give it), the forward reads the given weight, as the op's own cast."""
    torch.manual_seed(0)
    w, x, spec = torch.randn(2, 32, 64), torch.randn(32, 64), "nvfp4:emulate"
    specs = {"input_spec": spec, "weight_spec": spec, "grad_spec": spec}
    q = te.functional.quantize_grouped_weight(w, spec)
    with pytest.raises(ValueError, match=r"without its dgrad copy, 16x16 tiles.*'nvfp4:emulate'"):
        te.functional.grouped_linear(x, [16, 16], w, None, weight_quantized=q, **specs)
    given = [q[0], q[1], q[0].clone(), q[3], q[4]]
    y = te.functional.grouped_linear(x, [16, 16], w, None, weight_quantized=given, **specs)
    assert torch.equal(y, te.functional.grouped_linear(x, [16, 16], w, None, **specs))


class _GroupedCasts:
    """Counts the per-tensor casts of a grouped weight: ``op`` in ``te::quantize_grouped_weight``
    (the kept copy), ``inline`` inside the grouped GEMM op (the per-call cast)."""

    def __enter__(self):
        self.op = self.inline = 0
        cast = grouped_fp8.per_tensor_weight

        def counted(attr):
            def fn(*args):
                setattr(self, attr, getattr(self, attr) + 1)
                return cast(*args)

            return fn

        self._patches = [
            mock.patch.object(grouped_weight, "per_tensor_weight", counted("op")),
            mock.patch.object(grouped_fp8, "per_tensor_weight", counted("inline")),
        ]
        for p in self._patches:
            p.__enter__()
        return self

    def __exit__(self, *exc):
        for p in self._patches:
            p.__exit__(*exc)


@pytest.mark.parametrize(("kind", "single"), [("current", False), ("delayed", True)])
def test_grouped_false_does_not_cast_again(kind, single):
    """One cast of all groups' weights with True, none with False (a weight changed in between
    is not seen until the next True), one inside the op every None call."""
    m, recipe, x = _grouped("cpu", single), RECIPES[kind](), _gx("cpu")
    with _GroupedCasts() as casts:
        y_true, *_ = _grouped_step(m, x, recipe, True)
        assert (casts.op, casts.inline) == (1, 0)
        y_false, *_ = _grouped_step(m, x, recipe, False)
        with torch.no_grad():
            for w in m.weights():
                w.mul_(2.0)
        y_stale, *_ = _grouped_step(m, x, recipe, False)
        assert (casts.op, casts.inline) == (1, 0)  # nothing cast
        y_new, *_ = _grouped_step(m, x, recipe, True)
        assert (casts.op, casts.inline) == (2, 0)
        _grouped_step(m, x, recipe, None)
        assert (casts.op, casts.inline) == (2, 1)
    if kind == "current":  # delayed: the scales move with the recorded amaxes
        assert torch.equal(y_true, y_false) and torch.equal(y_true, y_stale)
    assert not torch.equal(y_stale, y_new)


def test_grouped_delayed_records_the_amax_of_the_cast():
    m, recipe, x = _grouped("cpu"), DelayedScaling(amax_history_len=4), _gx("cpu")
    _grouped_step(m, x, recipe, True)  # the state's first step: current scaling, amaxes kept
    _grouped_step(m, x, recipe, True)  # a delayed-scaling cast
    amax = torch.stack(m.weights()).detach().abs().max().float()
    assert torch.equal(m.fp8_meta.fwd_amax[1], amax)
    with torch.no_grad():
        for w in m.weights():
            w.mul_(4.0)
    _grouped_step(m, x, recipe, False)
    assert torch.equal(m.fp8_meta.fwd_amax[1], amax)  # the kept cast's, not the new weights'
    _grouped_step(m, x, recipe, True)
    assert torch.equal(m.fp8_meta.fwd_amax[1], 4 * amax)


def test_grouped_outside_autocast_nothing_is_kept():
    m, x = _grouped("cpu"), _gx("cpu")
    assert torch.equal(m(x, SPLITS, is_first_microbatch=True), m(x, SPLITS))
    assert m._fp8_weights["weight"].tensors is None


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_compiled_true_false_one_graph_each(device):
    """Compiled fullgraph with a device m_splits: one compile for True and one for False,
    values and gradients as eager (on CUDA: te::quantize_grouped_weight traced through)."""
    recipe = Float8CurrentScaling()
    eager, compiled_m = _grouped(device, single=True), _grouped(device, single=True)
    splits = torch.tensor(SPLITS, device=device)

    def forward(m, x, first):
        with autocast(recipe=recipe):
            return m(x, splits, is_first_microbatch=first)

    fn, counter = compile_counted(forward, backend="aot_eager")
    for s, first in enumerate((True, False, False, True, False)):
        x = _gx(device, s)
        y = fn(compiled_m, x, first)
        y0 = forward(eager, x.detach().clone().requires_grad_(), first)
        assert torch.equal(y, y0)
        for out in (y, y0):
            out.float().square().mean().backward()
        if first:  # a new weight each optimizer step: the False steps must not see it
            for m in (eager, compiled_m):
                with torch.no_grad():
                    m.weight.add_(0.01)
    assert counter.frame_count == 2
    for p, p0 in zip(compiled_m.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, p0.grad)


def test_grouped_mlp_passes_it_to_both_gemms():
    torch.manual_seed(0)
    mlp = te.GroupedMLP(3, 64, 32, activation="swiglu", params_dtype=torch.bfloat16)
    x, recipe = _gx("cpu"), Float8CurrentScaling()
    with autocast(recipe=recipe):
        y0 = mlp(x, SPLITS)
        y1 = mlp(x, SPLITS, is_first_microbatch=True)
        with torch.no_grad():
            for p in mlp.parameters():
                p.mul_(1.5)
        y2 = mlp(x, SPLITS, is_first_microbatch=False)
        y3 = mlp(x, SPLITS)
    assert torch.equal(y0, y1) and torch.equal(y1, y2) and not torch.equal(y2, y3)
    assert all(fc._fp8_weights["weight"].tensors is not None for fc in (mlp.fc1, mlp.fc2))
    with pytest.raises(
        ValueError, match=r"GroupedMLP: is_first_microbatch must be one of \(None, True"
    ):
        mlp(x, SPLITS, is_first_microbatch="yes")


def test_grouped_weight_fake_matches_every_kind():
    """te::quantize_grouped_weight's fake gives the real tensors' shapes and dtypes for every
    recipe kind (the registry opchecks two)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    scale = torch.tensor([8.0, 16.0, 1.0])
    cases = [("current:e4m3", None), ("delayed:e4m3", scale), ("block:e4m3:128x128:p2", None),
             ("block:e4m3:128x128:emulate", None), ("mxfp8:e4m3:emulate", None),
             ("nvfp4:16x16:emulate", None)]  # fmt: skip
    w = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    op = torch.ops.te.quantize_grouped_weight.default
    for spec, s in cases:
        real = op(w, spec, s)
        with FakeTensorMode() as mode:
            fw = mode.from_tensor(w)
            fs = None if s is None else mode.from_tensor(s)
            fake = op(fw, spec, fs)
        got = [(tuple(t.shape), t.dtype) for t in fake]
        assert got == [(tuple(t.shape), t.dtype) for t in real], spec


def test_grouped_linear_bad_pre_quantised_weight():
    """The functional API: a weight_quantized that is not this weight's cast is refused by
    name (shape and dtype), in eager and under torch.compile."""
    x, w = _gx("cpu").detach(), torch.randn(3, 32, 64, dtype=torch.bfloat16)
    q = te.functional.quantize_grouped_weight(w[:2], "current:e4m3")
    cur = with_specs(recipe="current")

    def call(x, w):
        return te.functional.grouped_linear(x, SPLITS, w, **cur, weight_quantized=q)

    message = r"weight_data must be torch.uint8 \[3, 32, 64\]"
    with pytest.raises(ValueError, match=message):
        call(x, w)
    with pytest.raises(Exception, match=message):  # dynamo wraps the fake's ValueError
        torch.compile(call, backend="aot_eager", fullgraph=True)(x, w)
    with pytest.raises(ValueError, match="weight_quantized must be the 5 tensors"):
        te.functional.grouped_linear(x, SPLITS, w, **cur, weight_quantized=q[:4])
    full = te.functional.quantize_grouped_weight(w, "current:e4m3")
    with pytest.raises(ValueError, match="needs a quantised recipe"):
        te.functional.grouped_linear(x, SPLITS, w, weight_quantized=full)
