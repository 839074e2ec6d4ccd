"""Transformer Engine checkpoints load into te_compile modules with ``strict=True``.

TE saves ``<prefix>_extra_state`` for every module built on its base module and every
``te.ops`` operation: an empty uint8 tensor without FP8 state, else a pickled dict in a uint8
tensor (``transformer_engine/pytorch/module/base.py``, ``get_extra_state``). Without TE
installed, :func:`te_extra_state` writes those bytes: the dict TE pickles, its recipe an
instance of a stand-in class living at TE's module path (``transformer_engine.common.recipe``,
put in ``sys.modules`` only inside the test), so the pickle names TE's globals exactly.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import sys
import types
import warnings
from typing import NamedTuple

import pytest
import torch

import te_compile as te
from te_compile.recipe import DelayedScaling

TE_RECIPE = "transformer_engine.common.recipe"


@pytest.fixture
def te_recipe(monkeypatch):
    """A stand-in ``transformer_engine.common.recipe`` with TE's ``Format`` and
    ``DelayedScaling`` (the fields a checkpoint pickles), for the duration of one test."""
    mod = types.ModuleType(TE_RECIPE)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(448, 448)
        HYBRID = _FormatHelper(448, 57344)

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: object = "max"
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False

    @dataclasses.dataclass
    class Float8CurrentScaling:
        fp8_format: Format = Format.HYBRID

    for cls in (_FormatHelper, Format, DelayedScaling, Float8CurrentScaling):
        cls.__module__ = TE_RECIPE
        cls.__qualname__ = cls.__name__
        setattr(mod, cls.__name__, cls)
    for name in ("transformer_engine", "transformer_engine.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, TE_RECIPE, mod)
    return mod


def te_op_extra_state(recipe, num_gemms=1, length=4, seed=0) -> torch.Tensor:
    """A ``te.ops`` linear's ``get_extra_state()``: per mode a dict of the recipe, that mode's
    tensors and ``extra_fp8_variables`` (``ops/op.py``); slots input, weight / grad_output."""
    g = torch.Generator().manual_seed(seed)
    fwd, bwd = (
        torch.rand(length, 2 * num_gemms, generator=g) + 0.5,
        torch.rand(length, num_gemms, generator=g),
    )
    fwd[0], bwd[0] = 0, 0
    state = {
        "forward": {"recipe": recipe, "scale_fwd": torch.rand(2 * num_gemms, generator=g) + 1,
                    "amax_history_fwd": fwd, "extra_fp8_variables": {}},
        "backward": {"recipe": recipe, "scale_bwd": torch.rand(num_gemms, generator=g) + 1,
                     "amax_history_bwd": bwd, "extra_fp8_variables": {}},
    }  # fmt: skip
    return _pickled(state)


def te_extra_state(recipe=None, num_gemms=1, length=4, seed=0, **tensors) -> torch.Tensor:
    """TE's ``get_extra_state()`` value: ``pickle.dumps`` of its dict in a uint8 tensor. With a
    recipe and no tensors given, random delayed-scaling tensors of TE's shapes (row 0 zero:
    the state after TE's update, as a checkpoint between steps holds it)."""
    g = torch.Generator().manual_seed(seed)
    state = {"recipe": recipe, "extra_fp8_variables": {"num_gemms": num_gemms}}
    if recipe is not None and type(recipe).__name__ == "DelayedScaling" and not tensors:
        fwd = torch.rand(length, 3 * num_gemms, generator=g) + 0.5
        bwd = torch.rand(length, 2 * num_gemms, generator=g) * 1e-3
        fwd[0], bwd[0] = 0, 0
        tensors = {
            "scale_fwd": torch.rand(3 * num_gemms, generator=g) + 1,
            "amax_history_fwd": fwd,
            "scale_bwd": torch.rand(2 * num_gemms, generator=g) * 1e3,
            "amax_history_bwd": bwd,
        }
    state.update(tensors)
    return _pickled(state)


EMPTY = torch.empty(0, dtype=torch.uint8)


def _transformer_layer():
    return te.TransformerLayer(32, 64, 4, device="cpu")


# Each module and the keys a TE checkpoint of it has (TE's names).
LAYOUTS = {
    "Linear": (lambda: te.Linear(16, 8), ["_extra_state"]),
    "LayerNormLinear": (lambda: te.LayerNormLinear(16, 8), ["_extra_state"]),
    "LayerNormMLP": (lambda: te.LayerNormMLP(16, 32), ["_extra_state"]),
    "GroupedLinear": (lambda: te.GroupedLinear(3, 16, 8), ["_extra_state"]),
    "LayerNorm": (lambda: te.LayerNorm(16), ["_extra_state"]),
    "RMSNorm": (lambda: te.RMSNorm(16), ["_extra_state"]),
    "DotProductAttention": (lambda: te.DotProductAttention(4, 8), ["_extra_state"]),
    "TransformerLayer": (
        _transformer_layer,
        [
            "self_attention.layernorm_qkv._extra_state",
            "self_attention.core_attention._extra_state",
            "self_attention.proj._extra_state",
            "layernorm_mlp._extra_state",
        ],
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_strict_load_of_a_te_checkpoint_without_fp8_state(name):
    build, keys = LAYOUTS[name]
    state = build().state_dict()
    assert not any(k.endswith("_extra_state") for k in state)  # ours emits none
    state.update({k: EMPTY for k in keys})
    model = build()
    model.load_state_dict(state, strict=True)
    assert not any(k.endswith("fp8_meta.scale") for k in model.state_dict())  # nothing taken


def _pickled(value) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


@pytest.mark.parametrize(
    "raw", [None, EMPTY, _pickled(None), _pickled({})], ids=["None", "empty", "pickled None", "{}"]
)
def test_an_extra_state_holding_nothing_loads_as_nothing(raw):
    model = te.Linear(16, 8)
    model.load_state_dict({**model.state_dict(), "_extra_state": raw}, strict=True)
    assert model.fp8_meta.is_unused()


def _expected(amax_fwd, amax_bwd, scale_fwd, scale_bwd, gemms):
    """Our buffers for TE's post-update state of ``gemms`` (row 0 zero): the newest amax (TE's
    last row) pending, the older rows in our history newest first."""
    length = amax_fwd.shape[0]
    fwd = amax_fwd[1:].flip(0)  # newest first
    bwd = amax_bwd[1:].flip(0)
    cols = torch.stack(
        [
            fwd[:, [3 * g for g in gemms]].amax(1),
            fwd[:, [3 * g + 1 for g in gemms]].amax(1),
            bwd[:, [2 * g for g in gemms]].amax(1),
        ],
        1,
    )
    history = torch.zeros(1024, 3)
    history[: length - 2] = cols[1:]
    scale = torch.stack(
        [
            scale_fwd[[3 * g for g in gemms]].amin(),
            scale_fwd[[3 * g + 1 for g in gemms]].amin(),
            scale_bwd[[2 * g for g in gemms]].amin(),
        ]
    )
    return history, scale, cols[0, :2], cols[0, 2:]


def _unpickle(raw: torch.Tensor) -> dict:
    return pickle.loads(raw.numpy().tobytes())


def _assert_state(fp8_state, raw, gemms):
    te_state = _unpickle(raw)
    history, scale, fwd_amax, grad_amax = _expected(
        te_state["amax_history_fwd"], te_state["amax_history_bwd"], te_state["scale_fwd"],
        te_state["scale_bwd"], gemms,
    )  # fmt: skip
    torch.testing.assert_close(fp8_state.amax_history, history, rtol=0, atol=0)
    torch.testing.assert_close(fp8_state.scale, scale, rtol=0, atol=0)
    torch.testing.assert_close(fp8_state.fwd_amax, fwd_amax, rtol=0, atol=0)
    torch.testing.assert_close(fp8_state.grad_amax, grad_amax, rtol=0, atol=0)
    assert fp8_state.calibrated  # the next delayed step updates, it does not calibrate again


@pytest.mark.parametrize(
    "name, states",
    [
        ("Linear", {"fp8_meta": [0]}),
        ("LayerNormLinear", {"fp8_meta": [0]}),
        ("LayerNormMLP", {"fc1_fp8_meta": [0], "fc2_fp8_meta": [1]}),  # TE's GEMM 1, GEMM 2
        ("GroupedLinear", {"fp8_meta": [0, 1, 2]}),  # three groups fold into one state
    ],
)
def test_delayed_scaling_state_lands_in_our_buffers(te_recipe, name, states):
    build, _ = LAYOUTS[name]
    num_gemms = sum(len(g) for g in states.values())
    raw = te_extra_state(te_recipe.DelayedScaling(amax_history_len=4), num_gemms=num_gemms)
    model = build()
    model.load_state_dict({**model.state_dict(), "_extra_state": raw}, strict=True)
    for attr, gemms in states.items():
        _assert_state(getattr(model, attr), raw, gemms)
    # Saved again (ours), the state is in our fp8_meta keys and round-trips.
    again = build()
    again.load_state_dict(model.state_dict(), strict=True)
    for attr in states:
        torch.testing.assert_close(
            getattr(again, attr).amax_history, getattr(model, attr).amax_history, rtol=0, atol=0
        )


def test_transformer_layer_takes_each_modules_state(te_recipe):
    layer = _transformer_layer()
    recipe = te_recipe.DelayedScaling(amax_history_len=8)
    raws = {
        "self_attention.layernorm_qkv": te_extra_state(recipe, length=8, seed=1),
        "self_attention.core_attention": te_extra_state(recipe, num_gemms=3, length=8, seed=2),
        "self_attention.proj": te_extra_state(recipe, length=8, seed=3),
        "layernorm_mlp": te_extra_state(recipe, num_gemms=2, length=8, seed=4),
    }
    state = {**layer.state_dict(), **{k + "._extra_state": v for k, v in raws.items()}}
    with warnings.catch_warnings():  # the attention's slots (no fp8_dpa) are dropped silently
        warnings.simplefilter("error")
        layer.load_state_dict(state, strict=True)
    _assert_state(
        layer.self_attention.layernorm_qkv.fp8_meta, raws["self_attention.layernorm_qkv"], [0]
    )
    _assert_state(layer.self_attention.proj.fp8_meta, raws["self_attention.proj"], [0])
    _assert_state(layer.layernorm_mlp.fc1_fp8_meta, raws["layernorm_mlp"], [0])
    _assert_state(layer.layernorm_mlp.fc2_fp8_meta, raws["layernorm_mlp"], [1])


def test_a_state_saved_before_tes_update_keeps_row_0_as_the_newest_amax(te_recipe):
    fwd = torch.tensor([[9.0, 8.0, 0.0], [1.0, 2.0, 0.0], [3.0, 4.0, 0.0]])
    bwd = torch.tensor([[7.0, 0.0], [5.0, 0.0], [6.0, 0.0]])
    raw = te_extra_state(
        te_recipe.DelayedScaling(amax_history_len=3), scale_fwd=torch.ones(3),
        amax_history_fwd=fwd, scale_bwd=torch.ones(2), amax_history_bwd=bwd,
    )  # fmt: skip
    model = te.Linear(16, 8)
    model.load_state_dict({**model.state_dict(), "_extra_state": raw}, strict=True)
    state = model.fp8_meta
    torch.testing.assert_close(state.fwd_amax, torch.tensor([9.0, 8.0]), rtol=0, atol=0)
    torch.testing.assert_close(state.grad_amax, torch.tensor([7.0]), rtol=0, atol=0)
    expected = torch.tensor([[3.0, 4.0, 6.0], [1.0, 2.0, 5.0]])  # TE rows 2, 1: newest first
    torch.testing.assert_close(state.amax_history[:2], expected, rtol=0, atol=0)
    assert not state.amax_history[2:].any()


def test_the_next_delayed_step_uses_tes_scale(te_recipe):
    """TE's saved scale came from its window (all rows, the newest now in the last row); ours
    recomputes it at the next forward from the rows TE kept: the same scale when the largest
    amax is among them."""
    fwd = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.5, 0.0], [4.0, 2.0, 0.0], [2.0, 1.0, 0.0]])
    bwd = torch.tensor([[0.0, 0.0], [1e-4, 0.0], [4e-4, 0.0], [2e-4, 0.0]])
    scale_fwd = torch.tensor([448 / 4.0, 448 / 2.0, 1.0])
    scale_bwd = torch.tensor([57344 / 4e-4, 1.0])
    raw = te_extra_state(
        te_recipe.DelayedScaling(amax_history_len=4), scale_fwd=scale_fwd,
        amax_history_fwd=fwd, scale_bwd=scale_bwd, amax_history_bwd=bwd,
    )  # fmt: skip
    model = te.Linear(16, 16)
    model.load_state_dict({**model.state_dict(), "_extra_state": raw}, strict=True)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        model(torch.randn(16, 16))
    expected = torch.tensor([448 / 4.0, 448 / 2.0, 57344 / 4e-4])
    torch.testing.assert_close(model.fp8_meta.scale, expected, rtol=0, atol=0)


def test_a_malicious_pickle_is_refused_naming_the_key(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    raw = _pickled({"recipe": Evil()})
    layer = _transformer_layer()
    key = "layernorm_mlp._extra_state"
    with pytest.raises(RuntimeError, match=f"{key}: cannot read .*refusing the global"):
        layer.load_state_dict({**layer.state_dict(), key: raw}, strict=True)
    assert not marker.exists()


def user_amax_algo(history: torch.Tensor) -> torch.Tensor:
    return history.amax(0)


def test_a_recipe_callable_is_refused(te_recipe):
    # A user's amax_compute_algo pickles as a reference to their function: not run, refused.
    recipe = te_recipe.DelayedScaling(amax_compute_algo=user_amax_algo)
    model = te.Linear(16, 8)
    match = r"_extra_state: .*refusing the global tests\.modules\.test_te_extra_state\.user_amax"
    with pytest.raises(RuntimeError, match=match):
        model.load_state_dict({**model.state_dict(), "_extra_state": te_extra_state(recipe)})


def test_a_stateless_recipe_takes_nothing(te_recipe):
    # Older TE pickled a stateless recipe with no tensors; TE now saves an empty tensor.
    raw = te_extra_state(te_recipe.Float8CurrentScaling())
    model = te.Linear(16, 8)
    model.load_state_dict({**model.state_dict(), "_extra_state": raw}, strict=True)
    assert model.fp8_meta.is_unused()


def test_te_1x_and_bytesio_formats(te_recipe):
    # TE 1.x: no recipe (delayed scaling implied), also scale_inv_*.
    tensors = _unpickle(te_extra_state(te_recipe.DelayedScaling(amax_history_len=4)))
    old = {
        k: tensors[k] for k in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
    }
    old.update(scale_inv_fwd=1 / tensors["scale_fwd"], scale_inv_bwd=1 / tensors["scale_bwd"])
    raw = _pickled(old)
    model = te.Linear(16, 8)
    model.load_state_dict({**model.state_dict(), "_extra_state": raw}, strict=True)
    _assert_state(model.fp8_meta, raw, [0])
    # The oldest format: torch.save of the dict (recipe included) into an io.BytesIO.
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    model = te.Linear(16, 8)
    model.load_state_dict({**model.state_dict(), "_extra_state": buffer}, strict=True)
    _assert_state(model.fp8_meta, raw, [0])


def test_a_state_of_another_shape_is_refused_naming_the_key(te_recipe):
    raw = te_extra_state(te_recipe.DelayedScaling(amax_history_len=4), num_gemms=2)
    model = te.GroupedLinear(3, 16, 8)
    with pytest.raises(RuntimeError, match=r"_extra_state: scale_fwd has shape \(6,\); .*\(9,\)"):
        model.load_state_dict({**model.state_dict(), "_extra_state": raw})


def test_fp8_attention_state_is_not_taken_with_a_warning(te_recipe):
    raw = te_extra_state(te_recipe.DelayedScaling(fp8_dpa=True), num_gemms=3)
    model = te.DotProductAttention(4, 8)
    with pytest.warns(UserWarning, match="_extra_state: .* FP8 state of this module is not taken"):
        model.load_state_dict({"_extra_state": raw}, strict=True)


def test_our_checkpoint_in_tes_format_as_docs_te_compat_says():
    """docs/te_compat.md, "te_compile to TE": our state_dict without its ``fp8_meta`` keys,
    plus the (empty) ``_extra_state`` of each TE module, is a strict TE-format checkpoint."""
    model = te.LayerNormMLP(16, 32)
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
    ours = model.state_dict()
    assert any("fp8_meta." in k for k in ours)
    state = {k: v for k, v in ours.items() if "fp8_meta." not in k}
    state["_extra_state"] = EMPTY  # what a fresh TE LayerNormMLP's state_dict holds
    fresh = te.LayerNormMLP(16, 32)
    fresh.load_state_dict(state, strict=True)
    assert fresh.fc1_fp8_meta.is_unused()
    torch.testing.assert_close(fresh.fc2_weight, model.fc2_weight, rtol=0, atol=0)


def _op_as_module_state(raw: torch.Tensor) -> torch.Tensor:
    """A ``te.ops`` extra state in a module's flat layout, with empty output / grad_input
    slots, so :func:`_assert_state` (input, weight / grad_output at 3g, 3g + 1 / 2g) applies."""
    op = _unpickle(raw)
    fwd, bwd = op["forward"], op["backward"]
    n = fwd["scale_fwd"].numel() // 2

    def widen(t, per, new):  # insert zero slots after each GEMM's
        parts = t.reshape(*t.shape[:-1], n, per)
        pad = torch.zeros(*parts.shape[:-1], new - per)
        return torch.cat([parts, pad], -1).reshape(*t.shape[:-1], n * new)

    return _pickled(
        {
            "recipe": fwd["recipe"],
            "scale_fwd": widen(fwd["scale_fwd"], 2, 3),
            "amax_history_fwd": widen(fwd["amax_history_fwd"], 2, 3),
            "scale_bwd": widen(bwd["scale_bwd"], 1, 2),
            "amax_history_bwd": widen(bwd["amax_history_bwd"], 1, 2),
        }
    )


def test_te_ops_checkpoints_load(te_recipe):
    """TE's ``te.ops``: every basic op saves ``_extra_state`` (``ops.Linear``: ``basic_ops.0``
    the BasicLinear, ``basic_ops.1`` the Bias); the linears' slots are input, weight /
    grad_output."""
    recipe = te_recipe.DelayedScaling(amax_history_len=4)
    seq = te.ops.Sequential(te.ops.LayerNorm(16), te.ops.Linear(16, 8), te.ops.GELU())
    raw = te_op_extra_state(recipe)
    state = {
        **seq.state_dict(),
        "0._extra_state": EMPTY,
        "1.basic_ops.0._extra_state": raw,
        "1.basic_ops.1._extra_state": EMPTY,
        "2._extra_state": EMPTY,
    }
    seq.load_state_dict(state, strict=True)
    _assert_state(seq[1].basic_ops[0].fp8_meta, _op_as_module_state(raw), [0])

    grouped = te.ops.GroupedLinear(3, 16, 8)
    raw = te_op_extra_state(recipe, num_gemms=3)
    grouped.load_state_dict({**grouped.state_dict(), "_extra_state": raw}, strict=True)
    _assert_state(grouped.fp8_meta, _op_as_module_state(raw), [0, 1, 2])


def test_an_ops_fp8_state_we_do_not_map_is_dropped_with_a_warning(te_recipe):
    recipe = te_recipe.DelayedScaling(amax_history_len=4)
    fwd = {"recipe": recipe, "scale_fwd": torch.ones(1), "amax_history_fwd": torch.zeros(4, 1)}
    state = {"forward": fwd}
    op = te.ops.Quantize()
    with pytest.warns(UserWarning, match="_extra_state: .* not taken .*Quantize"):
        op.load_state_dict({**op.state_dict(), "_extra_state": _pickled(state)}, strict=True)


def test_an_extra_state_not_in_tes_format_is_refused_naming_the_key():
    model = te.Linear(16, 8)
    for raw, what in ((_pickled([1, 2]), "a list"), (torch.zeros(3), "torch.float32 tensor")):
        with pytest.raises(RuntimeError, match=f"_extra_state: .*{what}"):
            model.load_state_dict({**model.state_dict(), "_extra_state": raw})
