"""te.checkpoint: activation checkpointing that recomputes FP8 modules exactly (the recompute
under the forward's autocast state, delayed scaling's scales handed out again and its state
updated once), dropout masks included, with either checkpoint implementation, eager and with
torch.compile on either side of it; bad arguments."""

from __future__ import annotations

import copy

import pytest
import torch

import te_compile as te
from tests.utils import assert_matches_eager, behaviour_backend, compile_counted

RECIPES = {
    "bf16": None,
    "current": te.recipe.Float8CurrentScaling,
    "delayed": te.recipe.DelayedScaling,
    "block": te.recipe.Float8BlockScaling,
}


def _steps(module, x, recipe, checkpointed, use_reentrant=True, steps=3):
    """Per step: the input's and the parameters' gradients; then the state_dict."""
    grads = []
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe() if recipe else None):
            if checkpointed:
                y = te.checkpoint(module, xi, use_reentrant=use_reentrant)
            else:
                y = module(xi)
        y.float().square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in module.parameters())])
    return grads, module.state_dict()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("kind", ["LayerNormMLP", "Linear"])
def test_checkpoint_equals_no_checkpoint_bit_for_bit(kind, recipe, use_reentrant):
    """Three steps (delayed scaling: the calibration step, then two that fold amaxes in): the
    same gradients and the same FP8 state as without checkpointing."""
    torch.manual_seed(0)
    make = {"LayerNormMLP": lambda: te.LayerNormMLP(64, 128), "Linear": lambda: te.Linear(64, 96)}
    plain = make[kind]()
    ckpt = copy.deepcopy(plain)
    x = torch.randn(16, 64)
    g0, s0 = _steps(plain, x, RECIPES[recipe], False)
    g1, s1 = _steps(ckpt, x, RECIPES[recipe], True, use_reentrant)
    for step0, step1 in zip(g0, g1, strict=True):
        for a, b in zip(step0, step1, strict=True):
            assert torch.equal(a, b)
    assert s0.keys() == s1.keys()
    for key in s0:
        assert torch.equal(s0[key], s1[key]), key
    if recipe == "delayed":  # the state moved: two folds into the history, not four
        history = [v for k, v in s1.items() if k.endswith("amax_history")]
        assert history and all(bool((h[2:] == 0).all()) and bool(h[:2].any()) for h in history)


def test_plain_torch_checkpoint_loses_the_recipe_te_checkpoint_keeps_it():
    """The reason te.checkpoint exists: torch's recompute runs outside the autocast region."""
    m = te.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        y.sum().backward()
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        y = te.checkpoint(m, x, use_reentrant=False)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_dropout_masks_are_recomputed():
    """A TransformerLayer with attention and hidden dropout under current scaling: the
    recompute draws the forward's masks (checkpoint restores torch's generator)."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.2, attention_dropout=0.2)
    ckpt = copy.deepcopy(layer)
    x = torch.randn(12, 2, 64)
    results = []
    for module, checkpointed in ((layer, False), (ckpt, True)):
        torch.manual_seed(5)
        results.append(_steps(module, x, RECIPES["current"], checkpointed, steps=1)[0][0])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_second_backward_recomputes_again():
    """retain_graph: the non-reentrant checkpoint recomputes for each backward, and the
    delayed scales are handed out from the first again."""
    torch.manual_seed(0)
    m = te.Linear(32, 32)
    x = torch.randn(8, 32, requires_grad=True)
    for _ in range(2):  # the second step is past the calibration step
        x.grad = None
        with te.autocast(recipe=te.recipe.DelayedScaling()):
            y = te.checkpoint(m, x, use_reentrant=False)
        y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    assert torch.equal(x.grad, first)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_checkpoint_around_a_compiled_module(recipe):
    torch.manual_seed(0)
    plain = te.LayerNormMLP(64, 128)
    compiled_copy = copy.deepcopy(plain)
    compiled = torch.compile(compiled_copy, fullgraph=True, backend=behaviour_backend())
    x = torch.randn(16, 64)
    g0, s0 = _steps(plain, x, RECIPES[recipe], False)
    g1, _ = _steps(compiled, x, RECIPES[recipe], True, use_reentrant=False)
    s1 = compiled_copy.state_dict()
    for step0, step1 in zip(g0, g1, strict=True):
        for a, b in zip(step0, step1, strict=True):
            assert_matches_eager(b, a)
    assert s0.keys() == s1.keys()
    for key in s0:
        assert_matches_eager(s1[key], s0[key])


def test_checkpoint_inside_a_compiled_region():
    """Current scaling: fullgraph, no break, the compiler recomputes; delayed scaling: refused
    with the way out in the message."""
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 128)
    x = torch.randn(16, 64)

    def step(module, xi, recipe):
        with te.autocast(recipe=recipe):
            return te.checkpoint(module, xi, use_reentrant=False).float().square().sum()

    compiled, counter = compile_counted(step)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    step(m, a, te.recipe.Float8CurrentScaling()).backward()
    compiled(m, b, te.recipe.Float8CurrentScaling()).backward()
    assert counter.frame_count == 1
    assert_matches_eager(b.grad, a.grad)
    with pytest.raises(Exception, match=r"te\.checkpoint: under DelayedScaling"):
        torch.compile(step, fullgraph=True)(m, b, te.recipe.DelayedScaling())


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_function_keyword_arguments(use_reentrant):
    """``function``'s keyword arguments reach it with either implementation (TE's tests call a
    TransformerLayer through ``te.checkpoint(layer, x, attention_mask=m, ...)``), the forward
    and the recompute alike; a tensor among them gets its gradient. torch.utils.checkpoint's own
    keyword arguments still go to it."""
    torch.manual_seed(0)
    m = te.Linear(8, 8)
    x, bias = torch.randn(4, 8), torch.randn(8)

    def fn(inp, *, shift, scale=1.0):
        return m(inp) * scale + shift

    def grads(checkpointed):
        m.zero_grad(set_to_none=True)
        xi, b = x.clone().requires_grad_(), bias.clone().requires_grad_()
        if checkpointed:
            y = te.checkpoint(fn, xi, shift=b, scale=3.0, use_reentrant=use_reentrant,
                              preserve_rng_state=False)  # fmt: skip
        else:
            y = fn(xi, shift=b, scale=3.0)
        y.square().sum().backward()
        return y, xi.grad, b.grad, m.weight.grad

    for a, b in zip(grads(False), grads(True), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"distribute_saved_activations": True}, "distribute_saved_activations must be False"),
        ({"get_rng_state_tracker": lambda: None}, "get_rng_state_tracker must be None"),
        ({"use_reentrant": "yes"}, "use_reentrant must be a bool"),
    ],
)
def test_bad_arguments(kwargs, match):
    m = te.Linear(8, 8)
    with pytest.raises(ValueError, match=rf"te\.checkpoint: {match}"):
        te.checkpoint(m, torch.randn(2, 8, requires_grad=True), **kwargs)
    with pytest.raises(ValueError, match=r"te\.checkpoint: function must be callable"):
        te.checkpoint(3, torch.randn(2, 8))


def test_distributed_alias():
    assert te.distributed.checkpoint is te.checkpoint
