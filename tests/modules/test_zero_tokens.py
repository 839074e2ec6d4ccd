"""Batches without tokens (an input of shape ``[0, in_features]``, as Transformer Engine's
``test_sanity_linear_with_zero_tokens`` / ``test_sanity_grouped_linear`` run them) through the
GEMM modules under every recipe: the output is ``[0, out_features]``, the input gradient
``[0, in_features]``, the weight and bias gradients are zeros (``main_grad`` gains zeros), nothing
is NaN, the same in eager and in one compiled graph; and the delayed-scaling state survives
(an empty tensor's amax is 0, which keeps the old scale, and a zero-token step is not the
calibration step)."""

from __future__ import annotations

import warnings

import pytest
import torch

import te_compile as te
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    autocast,
)
from te_compile.quantization.fp8_gemm import FP8GemmState
from tests.utils import compile_counted

HIDDEN, FFN, GROUPS = 64, 256, 4  # Transformer Engine's "small" config: hidden 64, ffn 4x

RECIPES = {
    "current": Float8CurrentScaling,
    "delayed": DelayedScaling,
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}
MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


def _module(name: str, bias: bool = True, fuse: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    kw = {"bias": bias, "params_dtype": torch.bfloat16, "fuse_wgrad_accumulation": fuse}
    if name == "GroupedLinear":
        return te.GroupedLinear(GROUPS, HIDDEN, FFN, **kw)
    return getattr(te, name)(HIDDEN, FFN, **kw)


def _call(m: torch.nn.Module):
    if isinstance(m, te.GroupedLinear):
        return lambda x: m(x, [0] * GROUPS)
    return m


def _preset_main_grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Give every GEMM weight a ``main_grad`` of ones; returns copies to compare against."""
    if isinstance(m, te.GroupedLinear):
        m.allocate_main_grad().fill_(1.0)
    else:
        for name, p in m.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.main_grad = torch.ones_like(p, dtype=torch.float32)
    return {n: p.main_grad.clone() for n, p in m.named_parameters() if hasattr(p, "main_grad")}


def _step(m: torch.nn.Module, recipe, compiled: bool, tokens: int = 0):
    """One forward and backward of ``tokens`` tokens; (output, input), compiled as one graph."""
    fn = _call(m)
    counter = None
    if compiled:
        torch._dynamo.reset()
        fn, counter = compile_counted(fn, backend="aot_eager")
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with autocast(recipe=recipe):
        y = fn(x)
    y.float().sum().backward()
    if counter is not None:
        assert counter.frame_count == 1
    return y, x


def _assert_zero_token_step(m, y, x, main_grads=None):
    assert y.shape == (0, FFN if not isinstance(m, te.LayerNormMLP) else HIDDEN)
    assert x.grad is not None and x.grad.shape == (0, HIDDEN)
    for name, p in m.named_parameters():
        if name in (main_grads or {}):
            assert p.grad is None, name
            assert torch.equal(p.main_grad, main_grads[name]), name  # + zeros
            continue
        assert p.grad is not None, name
        assert torch.equal(p.grad, torch.zeros_like(p)), name
    for key, t in m.state_dict().items():
        if t.is_floating_point():
            assert torch.isfinite(t.float()).all(), key


@pytest.fixture(autouse=True)
def _quiet_emulation():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="autocast: .* emulated")
        yield


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module", MODULES)
def test_zero_tokens(module, recipe, compiled):
    m = _module(module)
    y, x = _step(m, RECIPES[recipe](), compiled)
    _assert_zero_token_step(m, y, x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module", MODULES)
def test_zero_tokens_fuse_wgrad_accumulation(module, recipe, compiled):
    m = _module(module, bias=False, fuse=True)
    main_grads = _preset_main_grads(m)
    y, x = _step(m, RECIPES[recipe](), compiled)
    _assert_zero_token_step(m, y, x, main_grads)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
@pytest.mark.parametrize("empty", [0, 2, GROUPS - 1], ids=["first", "middle", "last"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_grouped_linear_one_empty_group(recipe, empty, single, compiled):
    """Transformer Engine's ``test_sanity_grouped_linear`` ``empty_split``: one group without
    tokens; its weight and bias gradients are zeros, the others' are not."""
    torch.manual_seed(0)
    m = te.GroupedLinear(GROUPS, HIDDEN, FFN, params_dtype=torch.bfloat16,
                         single_grouped_parameter=single)  # fmt: skip
    splits = [32] * GROUPS
    splits[empty] = 0
    fn, counter = (lambda x: m(x, splits)), None
    if compiled:
        torch._dynamo.reset()
        fn, counter = compile_counted(fn, backend="aot_eager")
    x = torch.randn(sum(splits), HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with autocast(recipe=RECIPES[recipe]()):
        y = fn(x)
    y.float().sum().backward()
    assert counter is None or counter.frame_count == 1
    assert y.shape == (sum(splits), FFN) and x.grad.shape == x.shape
    for kind in ("weight", "bias"):
        grads = getattr(m, kind).grad if single else [getattr(m, f"{kind}{i}").grad
                                                      for i in range(GROUPS)]  # fmt: skip
        for i in range(GROUPS):
            assert torch.isfinite(grads[i]).all()
            assert (grads[i].abs().sum() == 0) == (i == empty), (kind, i)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "delayed"])
@pytest.mark.parametrize("module", MODULES)
def test_zero_tokens_backward_override(module, recipe, override, compiled):
    m = _module(module, bias=module != "LayerNormLinear")
    y, x = _step(m, RECIPES[recipe](backward_override=override), compiled)
    _assert_zero_token_step(m, y, x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_zero_tokens_nvfp4_row_scaled(compiled):
    m = _module("Linear")
    recipe = NVFP4BlockScaling(row_scaled_activation=True, backward_override="dequantized")
    y, x = _step(m, recipe, compiled)
    _assert_zero_token_step(m, y, x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("recipe", ["current", "delayed", "block", "mxfp8"])
@pytest.mark.parametrize("module", MODULES)
def test_zero_tokens_fp8_primary_weights(module, recipe, compiled):
    """``quantized_model_init`` (TE's ``fp8_model_params``): the gradient goes to
    ``main_grad``, which gains zeros."""
    with te.quantized_model_init(recipe=RECIPES[recipe]()):
        m = _module(module)
    te.FP8MasterWeights(m)  # the main_grad buffers, zeros
    main_grads = {
        n: p.main_grad.clone() for n, p in m.named_parameters() if hasattr(p, "main_grad")
    }
    assert main_grads
    y, x = _step(m, RECIPES[recipe](), compiled)
    _assert_zero_token_step(m, y, x, main_grads)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("module", MODULES)
def test_zero_token_step_keeps_delayed_scales(module, compiled):
    """After steps with tokens, a step without: its amaxes are 0, which keep the old scales
    (``most_recent`` would otherwise read 0 and divide by it); the weight's amax is real."""
    m = _module(module)
    recipe = DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent")
    metas = [s for s in m.modules() if isinstance(s, FP8GemmState)]
    for _ in range(3):
        _step(m, recipe, compiled=False, tokens=32 if module != "GroupedLinear" else 0)
    if module == "GroupedLinear":  # the splits of _call are zeros: steps with tokens by hand
        for _ in range(3):
            x = torch.randn(32, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
            with autocast(recipe=recipe):
                m(x, [8] * GROUPS).float().sum().backward()
    _step(m, recipe, compiled)  # folds the last real amaxes in; records zeros
    before = [s.scale.clone() for s in metas]
    for _ in range(2):  # fold the zeros in
        m.zero_grad(set_to_none=True)
        y, x = _step(m, recipe, compiled)
        _assert_zero_token_step(m, y, x)
    for s, old in zip(metas, before, strict=True):
        assert s.amax_history[0, 0] == 0 and s.amax_history[0, 2] == 0  # input, gradient
        assert torch.isfinite(s.scale).all() and (s.scale > 0).all()
        # Input and gradient scales as they were, however many zero-token steps follow.
        assert torch.equal(s.scale[[0, 2]], old[[0, 2]])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_zero_token_first_step_does_not_calibrate(module, compiled):
    """The first delayed-scaling step with tokens runs current scaling (the calibration step,
    ``quantization.fp8_gemm``), also after zero-token steps: those measure amaxes of 0, and
    calibrating with them would leave the input and gradient scales at 1."""
    m, ref = _module(module), _module(module)
    _step(m, DelayedScaling(), compiled)  # zero tokens
    x = torch.randn(32, HIDDEN, dtype=torch.bfloat16) * 100
    fn = _call(m)
    if compiled:
        torch._dynamo.reset()
        fn, _ = compile_counted(fn, backend="aot_eager")
    with autocast(recipe=DelayedScaling()):
        y = fn(x)
    with autocast(recipe=Float8CurrentScaling()):
        expected = ref(x)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("module", MODULES[:3])
def test_zero_tokens_under_calibration(module):
    """``autocast(enabled=False, calibrating=True)``: the amax of an empty input is 0 (not an
    error), and the step leaves the calibration to the first step with tokens."""
    m = _module(module)
    x = torch.randn(0, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with autocast(enabled=False, calibrating=True, recipe=DelayedScaling()):
        y = m(x)
    y.float().sum().backward()
    _assert_zero_token_step(m, y, x)
    for s in m.modules():
        if isinstance(s, FP8GemmState):
            assert not s.calibrated and s.fwd_amax[0] == 0 and s.fwd_amax[1] > 0
