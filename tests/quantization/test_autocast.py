"""autocast: nesting, restore on exit and on exceptions, validation, and torch.compile (zero
graph breaks when entered inside a compiled region; recompiles when the outer recipe changes)."""

import re

import pytest
import torch
import torch.distributed as dist

from te_compile.quantization import (
    AutocastState,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    autocast,
    fp8_autocast,
    get_autocast_state,
    get_default_fp8_recipe,
)
from tests.utils import compile_counted, count_graph_breaks

OUTSIDE = AutocastState(enabled=False, recipe=None, amax_reduction_group=None)
DELAYED, CURRENT = DelayedScaling(), Float8CurrentScaling()

# The toy "module": what it computes depends on the autocast state it reads, as a real module's
# choice of quantisation would.
FACTOR = {"delayed": 2, "current": 3, "block": 4, "mxfp8": 5, "nvfp4": 6}


def toy(x):
    state = get_autocast_state()
    if not state.enabled:
        return x * 1
    return x * FACTOR[state.recipe.kind]


def expected(x, recipe=None, enabled=True):
    return x * (FACTOR[recipe.kind] if enabled and recipe is not None else 1)


@pytest.fixture(autouse=True)
def _outside_autocast():
    assert get_autocast_state() == OUTSIDE, "a previous test leaked autocast state"
    yield
    assert get_autocast_state() == OUTSIDE, "this test leaked autocast state"


# ---------------------------------------------------------------------------------------------
# Eager behaviour
# ---------------------------------------------------------------------------------------------


def test_state_outside_and_inside():
    assert get_autocast_state() == OUTSIDE
    with autocast(recipe=CURRENT):
        assert get_autocast_state() == AutocastState(True, CURRENT, None)
    assert get_autocast_state() == OUTSIDE


def test_default_recipe_is_the_device_default():
    with autocast():
        state = get_autocast_state()
    assert state.enabled and state.recipe == get_default_fp8_recipe()
    if not torch.cuda.is_available():
        assert state.recipe == DelayedScaling()


def test_nesting_restores_each_outer_state():
    block = Float8BlockScaling()
    with autocast(recipe=DELAYED):
        outer = get_autocast_state()
        with autocast(recipe=block):
            middle = get_autocast_state()
            assert middle.recipe is block
            with autocast(enabled=False):
                assert not get_autocast_state().enabled
            assert get_autocast_state() is middle
        assert get_autocast_state() is outer
    assert get_autocast_state() == OUTSIDE


def test_disabled_inside_enabled_region():
    with autocast(recipe=CURRENT):
        with autocast(enabled=False):
            state = get_autocast_state()
            assert not state.enabled
            x = torch.ones(2)
            torch.testing.assert_close(toy(x), x)
        assert get_autocast_state().enabled


def test_exception_restores_state_and_propagates():
    with autocast(recipe=DELAYED):
        outer = get_autocast_state()
        with pytest.raises(RuntimeError, match="boom"), autocast(recipe=CURRENT):
            raise RuntimeError("boom")
        assert get_autocast_state() is outer


def test_same_instance_entered_twice():
    region = autocast(recipe=CURRENT)
    with autocast(recipe=DELAYED):
        outer = get_autocast_state()
        with region:
            inner = get_autocast_state()
            with region:
                assert get_autocast_state() == inner
            assert get_autocast_state() is inner
        assert get_autocast_state() is outer


def test_snapshot_is_immutable():
    with autocast(recipe=CURRENT):
        snapshot = get_autocast_state()
        with pytest.raises(AttributeError):
            snapshot.enabled = False
    assert snapshot == AutocastState(True, CURRENT, None)  # unchanged by the exit


def test_decorator():
    @autocast(recipe=MXFP8BlockScaling())
    def fn(x):
        """Docstring."""
        return toy(x)

    x = torch.ones(2)
    torch.testing.assert_close(fn(x), x * FACTOR["mxfp8"])
    assert fn.__name__ == "fn" and fn.__doc__ == "Docstring."
    with autocast(recipe=DELAYED):
        torch.testing.assert_close(fn(x), x * FACTOR["mxfp8"])
        assert get_autocast_state().recipe is DELAYED


def test_decorator_restores_on_exception():
    @autocast(recipe=CURRENT)
    def fn():
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fn()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enabled": 1}, "autocast: enabled must be a bool (True or False), got 1"),
        (
            {"recipe": "delayed"},
            "autocast: recipe must be a Recipe (e.g. DelayedScaling()) or None",
        ),
        ({"recipe": DelayedScaling}, "recipe must be a Recipe"),  # the class, not an instance
        (
            {"amax_reduction_group": "world"},
            "amax_reduction_group must be a torch.distributed.ProcessGroup or None, got 'world'",
        ),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        autocast(**kwargs)


def test_recipe_settings_the_modules_do_not_implement_raise():
    """Float8CurrentScaling's power-of-two scales reach te_compile.quantize, not the modules'
    FP8 GEMMs: autocast refuses the recipe (eager and inside a compiled region) instead of
    quantising with other scales than it asks for."""
    recipe = Float8CurrentScaling(use_power_2_scales=True)
    message = "autocast: Float8CurrentScaling(use_power_2_scales=True) is not implemented"
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        autocast(recipe=recipe)

    def fn(x):
        with autocast(recipe=Float8CurrentScaling(use_power_2_scales=True)):
            return x + 1

    with pytest.raises(Exception, match=re.escape(message)):
        torch.compile(fn, fullgraph=True, backend="eager")(torch.ones(2))


def test_parameters_are_te_positional_order():
    # TE's order: enabled, calibrating, recipe, amax_reduction_group.
    with autocast(True, False, CURRENT):
        assert get_autocast_state() == AutocastState(True, CURRENT, None, False)
    with autocast(False, True, DELAYED):
        assert get_autocast_state() == AutocastState(False, DELAYED, None, True)
        assert get_autocast_state().calibration


def test_fp8_autocast_is_te_older_name():
    with fp8_autocast(enabled=True, fp8_recipe=CURRENT):
        assert get_autocast_state() == AutocastState(True, CURRENT, None, False)
    with fp8_autocast(True, True, DELAYED, None, True):
        assert get_autocast_state() == AutocastState(True, DELAYED, None, True)
        assert not get_autocast_state().calibration  # enabled: FP8, not calibration
    with pytest.raises(ValueError, match=re.escape("fp8_autocast: fp8_recipe must be a Recipe")):
        fp8_autocast(fp8_recipe="delayed")
    with pytest.raises(ValueError, match=re.escape("fp8_autocast: calibrating must be a bool")):
        fp8_autocast(calibrating=1)
    with pytest.raises(ValueError, match=re.escape("fp8_autocast: fp8_group must be a")):
        fp8_autocast(fp8_group="world")
    with pytest.raises(ValueError, match=re.escape("fp8_autocast: _graph must be a bool")):
        fp8_autocast(_graph=None)


def test_fp8_autocast_inside_compiled_region():
    def fn(x):
        with fp8_autocast(enabled=True, fp8_recipe=Float8CurrentScaling()):
            return toy(x)

    assert count_graph_breaks(fn, torch.ones(2)) == (1, 0)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="eager")(torch.ones(2)),
                               3 * torch.ones(2))  # fmt: skip


@pytest.mark.skipif(
    not dist.is_available() or dist.is_initialized(), reason="needs an uninitialised gloo"
)
def test_amax_reduction_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        with autocast(recipe=DELAYED, amax_reduction_group=group):
            assert get_autocast_state().amax_reduction_group is group
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------


def _inside(x):
    """Enters autocast inside the compiled region, nested and disabled, and reads the state."""
    a = toy(x)
    with autocast(recipe=CURRENT):
        b = toy(x)
        with autocast(recipe=NVFP4BlockScaling()):
            c = toy(x)
        with autocast(enabled=False):
            d = toy(x)
        e = toy(x)
    return a, b, c, d, e


@pytest.mark.parametrize("outer", [None, DELAYED], ids=["no-outer", "outer-delayed"])
def test_autocast_inside_compiled_region(outer):
    x = torch.randn(5)
    want = (expected(x, outer, enabled=outer is not None),)
    want += (x * 3, x * 6, x * 1, x * 3)
    regions = [autocast(recipe=outer)] if outer is not None else []
    for region in regions:
        region.__enter__()
    try:
        before = get_autocast_state()
        assert count_graph_breaks(_inside, x) == (1, 0)
        compiled, counter = compile_counted(_inside)
        for got, ref in zip(compiled(x), want, strict=True):
            torch.testing.assert_close(got, ref)
        assert counter.frame_count == 1
        assert get_autocast_state() is before  # the side effects left the holder as it was
    finally:
        for region in regions:
            region.__exit__(None, None, None)


def test_recompiles_when_outer_recipe_changes():
    x = torch.randn(4)
    compiled, counter = compile_counted(toy, backend="eager")
    block, block_2d_x = (
        Float8BlockScaling(),
        Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
    )
    calls = [  # (recipe or None for outside, graphs compiled so far)
        (DELAYED, 1),
        (CURRENT, 2),  # another class: the type guard fails
        (DELAYED, 2),  # the first graph is reused
        (DelayedScaling(margin=5), 2),  # toy reads no field but the class: still valid
        (None, 3),  # outside autocast: enabled is False
        (block, 4),
        (block_2d_x, 4),
        (CURRENT, 4),
    ]
    for recipe, frames in calls:
        if recipe is None:
            torch.testing.assert_close(compiled(x), x)
        else:
            with autocast(recipe=recipe):
                torch.testing.assert_close(compiled(x), expected(x, recipe))
        assert counter.frame_count == frames, (recipe, counter.frame_count)


def test_recompiles_when_a_read_field_changes():
    def fn(x):
        recipe = get_autocast_state().recipe
        return x * (recipe.margin + 1) if recipe.delayed() else x

    x = torch.randn(3)
    compiled, counter = compile_counted(fn, backend="eager")
    for margin, frames in [(0, 1), (2, 2), (0, 2), (2, 2)]:
        with autocast(recipe=DelayedScaling(margin=margin)):
            torch.testing.assert_close(compiled(x), x * (margin + 1))
        assert counter.frame_count == frames


def test_no_recompile_when_state_is_not_read():
    compiled, counter = compile_counted(lambda x: x + 1, backend="eager")
    x = torch.randn(3)
    for recipe in (DELAYED, CURRENT, MXFP8BlockScaling()):
        with autocast(recipe=recipe):
            compiled(x)
    assert counter.frame_count == 1


def test_decorator_and_default_recipe_inside_compiled_region():
    @autocast(recipe=Float8BlockScaling())
    def block(x):
        return toy(x)

    def fn(x):
        with autocast():
            default = toy(x)
        return block(x), default

    x = torch.randn(3)
    assert count_graph_breaks(fn, x) == (1, 0)
    compiled, _ = compile_counted(fn, backend="eager")
    got_block, got_default = compiled(x)
    torch.testing.assert_close(got_block, x * FACTOR["block"])
    torch.testing.assert_close(got_default, expected(x, get_default_fp8_recipe()))


def test_exception_inside_compiled_region_restores_state():
    def fn(x):
        with autocast(recipe=CURRENT):
            if x.sum() > 0:  # data-dependent: dynamo breaks here and runs the rest eagerly
                raise RuntimeError("boom")
            return x

    compiled = torch.compile(fn, backend="eager")
    with autocast(recipe=DELAYED):
        outer = get_autocast_state()
        with pytest.raises(RuntimeError, match="boom"):
            compiled(torch.ones(2))
        assert get_autocast_state() is outer
