"""Several forwards before their backwards (pipeline-parallel schedules, 1F1B's warm-up): the
backwards write into buffers every forward shares (``weight.main_grad`` with
``fuse_wgrad_accumulation``, the delayed-scaling gradient amax), which the ops keep out of
autograd's saved tensors, so the second backward is not refused by autograd's version check;
compiled, the graph stashes them without the check as well. The gradients equal those of the
same micro-batches run forward-backward one at a time.
"""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from te_compile.recipe import DelayedScaling, Float8CurrentScaling
from tests.utils import DEVICES, assert_bits_equal, assert_matches_eager

H, MICRO = 32, 3
SPLITS = [8, 8, 16]
MODULES = {
    "Linear": lambda **kw: te.Linear(H, H, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(H, H, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(H, 2 * H, activation="swiglu", **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(3, H, H, **kw),
}
RECIPES = {
    "none": None,
    "current": Float8CurrentScaling(),
    "delayed": DelayedScaling(amax_history_len=4),
}


def _weights(m):
    return [p for n, p in m.named_parameters() if "weight" in n and p.dim() == 2]


def _run(name, recipe, main_grad, interleaved):
    torch.manual_seed(0)
    m = MODULES[name](fuse_wgrad_accumulation=main_grad)
    if main_grad:
        for w in _weights(m):
            w.main_grad = torch.zeros(w.shape)
    xs = [torch.randn(32, H, generator=torch.Generator().manual_seed(i)) for i in range(MICRO)]
    args = (SPLITS,) if name == "GroupedLinear" else ()

    def forward(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return m(x, *args).float().square().sum()  # gradients well inside E5M2

    if interleaved:  # every forward, then every backward (newest first)
        losses = [forward(x) for x in xs]
        for loss in reversed(losses):
            loss.backward()
    else:
        for x in xs:
            forward(x).backward()
    grads = [w.main_grad if main_grad else w.grad for w in _weights(m)]
    return grads, [p.grad for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_forwards_before_backwards(name, recipe, main_grad):
    got, got_other = _run(name, RECIPES[recipe], main_grad, interleaved=True)
    want, want_other = _run(name, RECIPES[recipe], main_grad, interleaved=False)
    if recipe == "delayed":
        # Interleaved, the forwards see no gradient amax yet and the backwards fold theirs in
        # another order: other gradient scales, FP8-level differences (normwise) only.
        for g, w in zip(got, want, strict=True):
            assert torch.isfinite(g).all()
            # E5M2 gradients (two mantissa bits) under two scale schedules: ~10-15% apart.
            assert ((g - w).norm() / w.norm()).item() < 0.25
        return
    for g, w in zip([*got, *got_other], [*want, *want_other], strict=True):
        assert_matches_eager(g, w, roundings=1)


# Compiled (torch.compile, fullgraph=True): the forward graph's inputs the backward writes into
# are kept out of the version check as in eager (_library.stash_for_backward). Two micro-batches,
# so every order sums the same two weight gradients into a zeroed main_grad: bit for bit equal.
ORDERS = {
    "F1F2B2B1": ("f0", "f1", "b1", "b0"),
    "F1F2B1B2": ("f0", "f1", "b0", "b1"),
    "F1B1F2B2": ("f0", "b0", "f1", "b1"),
}
COMPILED = [
    pytest.param(name, recipe, main_grad, id=f"{name}-{recipe}-{('grad', 'main_grad')[main_grad]}")
    for name, recipe, main_grad in [
        *((name, "none", True) for name in MODULES),
        ("Linear", "delayed", False),  # the delayed-scaling gradient amax alone
        ("LayerNormMLP", "delayed", False),  # te::mlp's two (with main_grad: two te::linear)
        ("GroupedLinear", "delayed", True),
        # Each weight{i} its own main_grad (not allocate_main_grad's views of one buffer).
        ("GroupedLinear-own", "none", True),
        ("GroupedLinear-own", "delayed", True),
    ]
]


def _module(name, main_grad, device="cpu"):
    torch.manual_seed(0)
    m = MODULES[name.removesuffix("-own")](fuse_wgrad_accumulation=main_grad, device=device)
    if main_grad and name == "GroupedLinear":  # weight{i}.main_grad = buffer[i]
        m.allocate_main_grad()
    elif main_grad:
        for w in _weights(m):
            w.main_grad = torch.zeros(w.shape, device=device)
    return m


def _schedule(m, f, name, recipe, order):
    """Run two micro-batches in ``order`` through ``f`` (``m`` or its compiled twin), from zeroed
    gradients; returns the gradients (``main_grad`` or ``grad``, then the others) and buffers."""
    for p in m.parameters():
        p.grad = None
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.zero_()
    device = next(m.parameters()).device
    xs = [
        torch.randn(32, H, generator=torch.Generator().manual_seed(i)).to(device) for i in range(2)
    ]
    args = (SPLITS,) if name.startswith("GroupedLinear") else ()
    losses = {}
    for step in order:
        k = int(step[1])
        if step[0] == "f":
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                losses[k] = f(xs[k], *args).float().square().sum()
        else:
            losses.pop(k).backward()
    grads = [w.main_grad if m.fuse_wgrad_accumulation else w.grad for w in _weights(m)]
    others = [p.grad for p in m.parameters() if p.grad is not None]
    return [t.clone() for t in (*grads, *others, *m.buffers())]


def _assert_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if g.is_floating_point():
            assert_bits_equal(g, w)
        else:
            assert torch.equal(g, w)


@pytest.mark.parametrize(("name", "recipe", "main_grad"), COMPILED)
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_forwards_before_backwards(name, recipe, main_grad, device):
    """Compiled (aot_eager: the traced program, bit for bit) in every order equals the eager
    module in the same order, FP8 state included; without delayed scaling (whose scales depend
    on the order) also the one-forward-one-backward order."""
    recipe = RECIPES[recipe]
    compiled_module, eager = _module(name, main_grad, device), _module(name, main_grad, device)
    f = torch.compile(compiled_module, fullgraph=True, backend="aot_eager")
    for order in ORDERS.values():
        got = _schedule(compiled_module, f, name, recipe, order)
        _assert_equal(got, _schedule(eager, eager, name, recipe, order))
        if recipe is None:
            _assert_equal(got, _schedule(eager, eager, name, recipe, ORDERS["F1B1F2B2"]))


@pytest.mark.parametrize("name", ["GroupedLinear", "Linear"])
def test_compiled_forwards_before_backwards_inductor(name, request):
    """Inductor (CPU): its own code for the math, so within roundings of eager. Linear (traced
    through: Inductor generates the GEMMs' C++, ~20 s from a cold cache) with --long-runs."""
    if name == "Linear" and not request.config.getoption("--long-runs"):
        pytest.skip("compiled Linear with Inductor, forwards before backwards: with --long-runs")
    compiled_module, eager = _module(name, True), _module(name, True)
    f = torch.compile(compiled_module, fullgraph=True, backend="inductor")
    for order in (ORDERS["F1F2B2B1"], ORDERS["F1F2B1B2"]):
        got = _schedule(compiled_module, f, name, None, order)
        want = _schedule(eager, eager, name, None, ORDERS["F1B1F2B2"])
        for g, w in zip(got, want, strict=True):
            assert_matches_eager(g, w)


def test_compiled_other_saved_tensors_keep_version_check():
    """Only the written buffers leave the check: the input, saved for the weight gradient and
    changed in place before the backward, is refused as in eager."""
    m = _module("Linear", True)
    f = torch.compile(m, fullgraph=True, backend="aot_eager")
    for fn in (m, f):
        x = torch.randn(8, H)
        loss = fn(x).sum()
        x.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
