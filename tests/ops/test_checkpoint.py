"""Checkpointing a ``te_compile.ops`` model mid-training, as Transformer Engine's users do:
``torch.save`` of the model's and the optimizer's state_dicts, a fresh model and optimizer
loaded from it, and the next steps of both bitwise equal (parameters, their gradients, outputs,
input gradients), with and without an FP8 recipe (whose ``DelayedScaling`` state is
``fp8_meta`` buffers in the state_dict), eager and compiled."""

from __future__ import annotations

import io

import pytest
import torch

import te_compile as te
from te_compile import ops

_RECIPES = {
    "none": None,
    "delayed": lambda: te.recipe.DelayedScaling(
        fp8_format=te.recipe.Format.E4M3, amax_history_len=8
    ),
    "current": lambda: te.recipe.Float8CurrentScaling(fp8_format=te.recipe.Format.E4M3),
}


def _steps(model, optim, recipe, xs, dys, compiled):
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    ys = []
    for x, dy in zip(xs, dys, strict=True):
        optim.zero_grad()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = run(x)
        y.backward(dy)
        optim.step()
        ys.append(y.detach())
    return ys


def _fresh(shape, n):
    return [torch.randn(shape, requires_grad=True) for _ in range(n)]


@pytest.mark.filterwarnings("ignore:autocast.*emulated")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recipe_name", list(_RECIPES))
def test_linear_resumes_bitwise_from_a_checkpoint(recipe_name, compiled):
    torch.manual_seed(0)
    recipe = _RECIPES[recipe_name]() if _RECIPES[recipe_name] else None
    model = ops.Sequential(ops.Linear(32, 16))
    optim = torch.optim.SGD(model.parameters(), lr=0.25)
    _steps(model, optim, recipe, _fresh((8, 32), 2), [torch.randn(8, 16) for _ in range(2)],
           compiled)  # fmt: skip
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, buffer)
    xs_save, dys = _fresh((8, 32), 2), [torch.randn(8, 16) for _ in range(2)]
    xs_load = [x.detach().clone().requires_grad_() for x in xs_save]
    ys_save = _steps(model, optim, recipe, xs_save, dys, compiled)

    loaded = ops.Sequential(ops.Linear(32, 16))
    optim_loaded = torch.optim.SGD(loaded.parameters(), lr=0.25)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    loaded.load_state_dict(state["model"])
    optim_loaded.load_state_dict(state["optim"])
    ys_load = _steps(loaded, optim_loaded, recipe, xs_load, dys, compiled)

    for p_load, p_save in zip(loaded.parameters(), model.parameters(), strict=True):
        assert torch.equal(p_load, p_save)
        assert torch.equal(p_load.grad, p_save.grad)
    for b_load, b_save in zip(loaded.buffers(), model.buffers(), strict=True):
        assert torch.equal(b_load, b_save)  # DelayedScaling's amax history and scales
    for y_load, y_save in zip(ys_load, ys_save, strict=True):
        assert torch.equal(y_load, y_save)
    for x_load, x_save in zip(xs_load, xs_save, strict=True):
        assert torch.equal(x_load.grad, x_save.grad)
