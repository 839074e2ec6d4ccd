"""Save, load, continue: training resumed from a checkpoint is bit-for-bit the uninterrupted run.

For every public module (and a ``te.ops.Sequential``) under every recipe (high precision and the
five FP8 recipes, emulated on the CPU) and layout (fused QKV ``parameters_split``, grouped weights
as one parameter or one per GEMM): train a few AdamW steps, checkpoint the model, the optimizer
and the RNG state, train on; then build fresh objects, load the checkpoint (through
``torch.save`` / ``torch.load``, or ``torch.distributed.checkpoint``) and train the same steps.
Losses, parameters, optimizer state and the FP8 state buffers must be identical. Delayed
scaling's amax history and scales are what this guards: a state that came back reset would
calibrate again and give other FP8 casts.

A state_dict that does not fit (a wrong shape, a missing or an unexpected key) is refused naming
the key, FP8 state included.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import te_compile as te
from te_compile import ops
from te_compile.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

H, TOKENS, GROUPS = 32, 32, 3
SPLITS = [16, 0, 16]  # NVFP4's grouped GEMMs take multiples of 16 tokens per group
RECIPES = {
    "none": None,
    "current": Float8CurrentScaling(),
    "delayed": DelayedScaling(amax_history_len=4),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
MODULES = {
    "Linear": lambda: te.Linear(H, H),
    "Linear_qkv_split": lambda: te.Linear(H, 3 * H, parameters_split=("query", "key", "value")),
    "LayerNormLinear": lambda: te.LayerNormLinear(H, H, normalization="RMSNorm"),
    "LayerNormMLP": lambda: te.LayerNormMLP(H, 2 * H, activation="swiglu"),
    "LayerNorm": lambda: te.LayerNorm(H),
    "RMSNorm": lambda: te.RMSNorm(H),
    "GroupedLinear": lambda: te.GroupedLinear(GROUPS, H, H),
    "GroupedLinear_single": lambda: te.GroupedLinear(GROUPS, H, H, single_grouped_parameter=True),
    "GroupedMLP": lambda: te.GroupedMLP(GROUPS, H, H),
    "MultiheadAttention": lambda: te.MultiheadAttention(H, 4, attention_dropout=0.1),
    "TransformerLayer": lambda: te.TransformerLayer(
        H, 2 * H, 4, hidden_dropout=0.1, attention_dropout=0.1
    ),
    "ops.Sequential": lambda: ops.Sequential(
        ops.LayerNorm(H),
        ops.BasicLinear(H, 2 * H),
        ops.Bias(2 * H),
        ops.SwiGLU(),
        ops.BasicLinear(H, H),
    ),
}
GROUPED = ("GroupedLinear", "GroupedLinear_single", "GroupedMLP")
SEQUENCE = ("MultiheadAttention", "TransformerLayer")
BEFORE, AFTER = 2, 2


def _input(name: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    shape = (8, 4, H) if name in SEQUENCE else (TOKENS, H)
    return torch.randn(shape, generator=g)


# The grouped GEMMs take NVFP4 without the Hadamard transform and stochastic rounding (they
# refuse the default recipe, naming the two fields).
GROUPED_NVFP4 = NVFP4BlockScaling()


def _step(name: str, model, opt, recipe, step: int) -> torch.Tensor:
    x = _input(name, step)
    if name in GROUPED and isinstance(recipe, NVFP4BlockScaling):
        recipe = GROUPED_NVFP4
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x, SPLITS) if name in GROUPED else model(x)
    y = y[0] if isinstance(y, tuple) else y
    loss = y.float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _build(name: str):
    torch.manual_seed(0)
    model = MODULES[name]()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _save_torch(model, opt) -> bytes:
    buf = io.BytesIO()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state()}
    torch.save(state, buf)
    return buf.getvalue()


def _load_torch(blob: bytes, model, opt) -> None:
    state = torch.load(io.BytesIO(blob), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module, opt_a, opt_b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for (pa, st_a), (pb, st_b) in zip(opt_a.state.items(), opt_b.state.items(), strict=True):
        assert pa.shape == pb.shape
        for k in st_a:
            assert torch.equal(st_a[k], st_b[k]), k


def _resume(name: str, recipe, save, load) -> None:
    model, opt = _build(name)
    for step in range(BEFORE):
        _step(name, model, opt, recipe, step)
    blob = save(model, opt)
    continued = [_step(name, model, opt, recipe, BEFORE + s) for s in range(AFTER)]

    torch.manual_seed(12345)  # the fresh objects' own init and RNG state must not matter
    fresh, fresh_opt = _build(name)
    _step(name, fresh, fresh_opt, recipe, 99)  # optimizer state and FP8 state exist already
    load(blob, fresh, fresh_opt)
    resumed = [_step(name, fresh, fresh_opt, recipe, BEFORE + s) for s in range(AFTER)]
    assert [x.item() for x in resumed] == [x.item() for x in continued]
    _assert_same_state(model, fresh, opt, fresh_opt)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", MODULES)
def test_resume_is_bit_for_bit(name, recipe):
    _resume(name, RECIPES[recipe], _save_torch, _load_torch)


def test_delayed_scaling_state_is_saved_and_used():
    """The checkpoint holds a used delayed-scaling state (history rows, scales): what the
    bit-for-bit resume of the delayed cases depends on."""
    model, opt = _build("Linear")
    for step in range(BEFORE):
        _step("Linear", model, opt, RECIPES["delayed"], step)
    state = torch.load(io.BytesIO(_save_torch(model, opt)), weights_only=True)["model"]
    assert state["fp8_meta.amax_history"][0, :2].gt(0).all()
    assert not torch.equal(state["fp8_meta.scale"], torch.ones(3))


def _save_dcp(tmp_path):
    def save(model, opt) -> str:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
        return torch.get_rng_state()

    def load(rng, model, opt) -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tmp_path))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.set_rng_state(rng)

    return save, load


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("recipe", ["none", "delayed", "block"])
@pytest.mark.parametrize("name", ["Linear_qkv_split", "GroupedLinear_single", "LayerNormMLP"])
def test_resume_through_distributed_checkpoint(name, recipe, tmp_path):
    """The same through ``torch.distributed.checkpoint`` (one process, no process group)."""
    _resume(name, RECIPES[recipe], *_save_dcp(tmp_path))


# Refused state_dicts ---------------------------------------------------------------------------


def _trained(name: str, recipe: str = "delayed") -> torch.nn.Module:
    model, opt = _build(name)
    for step in range(2):
        _step(name, model, opt, RECIPES[recipe], step)
    return model


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "GroupedLinear", "TransformerLayer"])
def test_wrong_shape_names_the_key(name):
    state = _trained(name).state_dict()
    key = next(k for k in state if "weight" in k and state[k].dim() >= 2)
    state[key] = state[key][:-1]
    with pytest.raises(RuntimeError, match=rf"size mismatch for {key}"):
        _build(name)[0].load_state_dict(state)


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "GroupedLinear", "TransformerLayer"])
def test_missing_and_unexpected_keys_are_named(name):
    state = _trained(name).state_dict()
    key = next(k for k in state if "weight" in k)
    del state[key]
    state["not_a_parameter"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=rf"Missing key\(s\).*{key}") as info:
        _build(name)[0].load_state_dict(state)
    assert "not_a_parameter" in str(info.value)


def test_fp8_state_of_a_wrong_shape_names_the_key():
    state = _trained("Linear").state_dict()
    state["fp8_meta.amax_history"] = state["fp8_meta.amax_history"][:16]
    with pytest.raises(RuntimeError, match=r"size mismatch for fp8_meta\.amax_history"):
        _build("Linear")[0].load_state_dict(state)


def test_fp8_state_is_kept_across_recipes():
    """A delayed-scaling state loaded into a module that then trains under another recipe keeps
    its history and scales (the current-scaling step records only its own amaxes)."""
    trained = _trained("Linear")
    state = trained.state_dict()
    saved = {k: state[k].clone() for k in ("fp8_meta.amax_history", "fp8_meta.scale")}
    model, opt = _build("Linear")
    model.load_state_dict(trained.state_dict())
    _step("Linear", model, opt, RECIPES["current"], 5)
    for key, value in saved.items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize("problem", ["missing", "wrong_shape"])
def test_a_split_key_is_named_as_the_checkpoint_has_it(problem):
    """A Transformer Engine checkpoint's split QKV keys (``query_weight``, ...): a missing or
    mis-shaped one is reported under its own key, never as the fused ``weight`` the checkpoint
    does not have, and its siblings are not listed as unexpected. Under ``strict=False`` a
    missing part is returned as missing and the present parts load."""
    model = te.TransformerLayer(H, 2 * H, 2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    prefix = "self_attention.layernorm_qkv."
    target = te.TransformerLayer(H, 2 * H, 2)
    if problem == "missing":
        del state[prefix + "query_weight"]
        match = rf'Missing key\(s\) in state_dict: "{prefix}query_weight"\.'
    else:
        state[prefix + "query_weight"] = state[prefix + "query_weight"][:-1]
        match = rf"size mismatch for {prefix}query_weight: "
    with pytest.raises(RuntimeError, match=match) as info:
        target.load_state_dict(state)
    assert prefix + "weight" not in str(info.value)
    assert "Unexpected" not in str(info.value)
    if problem == "missing":
        result = target.load_state_dict(state, strict=False)
        assert result.missing_keys == [prefix + "query_weight"]
        assert result.unexpected_keys == []
        layer = target.self_attention.layernorm_qkv
        assert torch.equal(layer.key_weight, model.self_attention.layernorm_qkv.key_weight)
        assert not torch.equal(layer.query_weight, model.self_attention.layernorm_qkv.query_weight)
