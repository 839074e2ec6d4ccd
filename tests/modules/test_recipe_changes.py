"""A recipe that changes between steps (Transformer Engine's ``test_recipe.py``): another recipe
class warns once (``"Recipe type changed"``, a ``UserWarning``, eager calls), a field set on the
recipe takes effect at the next step (no stale state, eager and compiled), and FP8 primary
weights under a recipe that cannot read them raise TE's "Recipe mismatch"."""

from __future__ import annotations

import warnings

import pytest
import torch

import te_compile as te
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    autocast,
)
from te_compile.quantization.fp8_gemm import FP8GemmState
from tests.utils import assert_close, compile_counted

SIZE = 32  # tokens and features: a multiple of every recipe's block
MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


def _module(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "GroupedLinear":
        return te.GroupedLinear(1, SIZE, SIZE)
    return getattr(te, name)(SIZE, SIZE)


def _step(m: torch.nn.Module, recipe, fn=None, scale: float = 1.0, x=None) -> torch.Tensor:
    if fn is None:
        fn = (lambda x: m(x, [SIZE])) if isinstance(m, te.GroupedLinear) else m
    x = torch.randn(SIZE, SIZE) * scale if x is None else x
    with autocast(recipe=recipe):
        y = fn(x)
    y.sum().backward()
    return y.detach()


@pytest.fixture(autouse=True)
def _quiet_emulation():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="autocast: .* emulated")
        yield


@pytest.mark.parametrize("target", [MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling])
@pytest.mark.parametrize("module", MODULES)
def test_recipe_type_change_warns_once(module, target):
    m = _module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning while the recipe class stays
        warnings.filterwarnings("ignore", message="autocast: .* emulated")
        for margin in range(3):
            _step(m, DelayedScaling(margin=margin))  # other fields, same class
    states = [s for s in m.modules() if isinstance(s, FP8GemmState)]
    kept = [torch.cat([s.amax_history, s.scale[None]]) for s in states]
    changed = f"Recipe type changed from DelayedScaling to {target.__name__}"
    x = torch.randn(SIZE, SIZE)
    with pytest.warns(UserWarning, match=changed):
        y = _step(m, target(), x=x)
    # The new recipe took effect: as a module that never ran another one (same weights).
    assert torch.equal(y, _step(_module(module), target(), x=x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="autocast: .* emulated")
        for _ in range(2):
            _step(m, target())
        _step(m, target())  # a new instance of the same class
    # The delayed-scaling state waits, untouched, for a later DelayedScaling step.
    for s, before in zip(states, kept, strict=True):
        assert torch.equal(torch.cat([s.amax_history, s.scale[None]]), before)


def test_recipe_type_change_warning_names_the_module_and_counts_fp8_calls_only():
    m = _module("Linear")
    _step(m, Float8CurrentScaling())
    with autocast(enabled=False):  # no FP8: the module's last FP8 recipe stays
        m(torch.randn(SIZE, SIZE))
    with pytest.warns(UserWarning, match="^Linear: Recipe type changed from Float8CurrentScaling"):
        _step(m, DelayedScaling())


def test_recipe_type_change_compiles_without_a_warning_or_graph_break():
    """Under torch.compile the recipe's class is guarded on: the switch recompiles, one graph
    each, and nothing warns (a warning would break the graph)."""
    m = _module("Linear")
    fn, counter = compile_counted(m, backend="aot_eager")
    _step(m, Float8CurrentScaling(), fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="autocast: .* emulated")
        _step(m, MXFP8BlockScaling(), fn)
    assert counter.frame_count == 2
    assert all(s.recipe_type is None for s in m.modules() if isinstance(s, FP8GemmState))


def _expected_scale(state: FP8GemmState, recipe: DelayedScaling) -> torch.Tensor:
    """The scales the last update must have computed from the history it left."""
    fmt = recipe.fp8_format
    limits = torch.tensor([fmt.max_fwd, fmt.max_fwd, fmt.max_bwd])
    window = state.amax_history[: recipe.amax_history_len].amax(0)
    return limits / (window * 2.0**recipe.margin)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_recipe_fields_set_between_steps_take_effect(compiled):
    """``margin``, ``amax_history_len`` and ``fp8_format`` set on the recipe between steps:
    the next update uses the new values (the compiled step recompiles for each)."""
    m = _module("Linear")
    fn = None
    if compiled:
        torch._dynamo.reset()
        fn, _ = compile_counted(m, backend="aot_eager")
    recipe = DelayedScaling(amax_history_len=8)
    for step in range(4):  # decreasing amaxes: a shorter window sees a smaller one
        _step(m, recipe, fn, scale=2.0 ** (4 - step))
    for field, value in (("margin", 2), ("amax_history_len", 1), ("fp8_format", Format.E4M3)):
        setattr(recipe, field, value)
        _step(m, recipe, fn)
        assert_close(m.fp8_meta.scale, _expected_scale(m.fp8_meta, recipe), torch.float32)


def test_fp8_primary_weights_under_another_recipe_class_raise_recipe_mismatch():
    for name, weight in (("Linear", "weight"), ("LayerNormMLP", "fc1_weight")):
        with te.quantized_model_init(recipe=DelayedScaling()):
            m = _module(name)
        te.FP8MasterWeights(m)
        for other in (MXFP8BlockScaling(), Float8BlockScaling(), NVFP4BlockScaling()):
            message = f"{name}: Recipe mismatch for '{weight}'.*{type(other).__name__}"
            with pytest.raises(RuntimeError, match=message), autocast(recipe=other):
                m(torch.randn(SIZE, SIZE))


@pytest.mark.parametrize("made, used", [(DelayedScaling, Float8CurrentScaling),
                                        (Float8CurrentScaling, DelayedScaling)])  # fmt: skip
def test_fp8_primary_weights_serve_either_per_tensor_recipe(made, used):
    """A deliberate difference (docs/te_compat.md): the per-tensor FP8 codes of a primary
    weight serve both per-tensor recipes; the recipe change warns Transformer Engine's
    "Quantizer is being updated" (nothing else) and changes nothing of the weight."""
    with te.quantized_model_init(recipe=made(amax_history_len=1024) if made is DelayedScaling
                                 else made()):  # fmt: skip
        m = _module("Linear")
    te.FP8MasterWeights(m)
    codes = m.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="autocast: .* emulated")
        with pytest.warns(UserWarning, match="Quantizer is being updated") as seen:
            _step(m, used(amax_history_len=1) if used is DelayedScaling else used())
    assert len(seen) == 1
    assert torch.isfinite(m.weight.main_grad).all() and m.weight.main_grad.abs().sum() > 0
    assert torch.equal(m.weight.view(torch.uint8), codes.view(torch.uint8))
