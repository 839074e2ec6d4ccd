"""Edge values under every recipe and every module (CPU; the FP8 recipes emulated):

* all-zero input and weights: finite outputs and gradients (no NaN from a zero amax);
* an ``inf`` or a NaN in the input: it reaches the output, or ``te.non_finite_amaxes`` reports
  it (per-tensor recipes keep finite scales and say so) - never silently clipped to a finite
  value with nothing reported;
* a single token, zero tokens and an odd hidden size (67): the module works - its output and
  gradients match a float64 reference written in plain torch from the module's own weights
  (:data:`REFERENCES`, from the fuzz tests' references; exactly as far as fp32 goes in high
  precision, within the recipe's quantisation error under FP8) - or refuses the shape
  with the ValueError :func:`_refusal` expects, naming the sizes and the multiple they miss;
  the grouped modules get one empty group among three (all three with zero tokens).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as tF

import te_compile as te
from te_compile import recipe as R
from tests.fuzz.common import _MLP_ACT, _compare_quantized, _grouped_ref, _ln, _rms
from tests.fuzz.test_functions import _attention_ref, _mha_ref
from tests.utils import (
    DEVICES,
    assert_close,
    assert_close_quantized,
    to_reference,
)

RECIPES = {
    "none": None,
    "current": R.Float8CurrentScaling(),
    "delayed": R.DelayedScaling(amax_history_len=4),
    "block": R.Float8BlockScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
    "nvfp4": R.NVFP4BlockScaling(),
}
# The smallest hidden size each recipe's blocks fit (1x128 / 128x128 FP8 blocks, 32-element
# MXFP8, 16-element NVFP4 with 32 tokens).
HIDDEN = {"none": 32, "current": 32, "delayed": 32, "block": 128, "mxfp8": 32, "nvfp4": 32}


def _splits(x):
    """Three groups, the middle one empty (all empty for zero tokens)."""
    n = x.shape[0]
    return [n // 2, 0, n - n // 2]


class PaddedGroupedLinear(torch.nn.Module):
    """``Fp8Padding`` -> ``GroupedLinear`` -> ``Fp8Unpadding``, the MoE pattern: each group's
    rows padded to the recipe's alignment for the grouped GEMM, the padding dropped after."""

    def __init__(self, hidden):
        super().__init__()
        self.pad, self.unpad = te.Fp8Padding(3), te.Fp8Unpadding(3)
        self.linear = te.GroupedLinear(3, hidden, hidden)

    def forward(self, x, splits):
        padded, padded_splits = self.pad(x, splits)
        return self.unpad(self.linear(padded, padded_splits), splits)


def _qkv(x):
    """``[tokens, hidden]`` as one head of ``[s, b=1, heads=1, hidden]`` query, key and value."""
    return x[:, None, None], x[:, None, None], x[:, None, None]


# name -> (build(hidden), call(module, x)); x is [tokens, hidden] (attention: [s, 1, h], causal).
MODULES = {
    "Linear": (lambda h: te.Linear(h, h), lambda m, x: m(x)),
    "LayerNormLinear": (lambda h: te.LayerNormLinear(h, h), lambda m, x: m(x)),
    "LayerNormMLP": (lambda h: te.LayerNormMLP(h, 2 * h), lambda m, x: m(x)),
    "GroupedLinear": (lambda h: te.GroupedLinear(3, h, h), lambda m, x: m(x, _splits(x))),
    "GroupedMLP": (
        lambda h: te.GroupedMLP(3, h, h, activation="gelu", bias=True),
        lambda m, x: m(x, _splits(x)),
    ),
    "Fp8Padding": (PaddedGroupedLinear, lambda m, x: m(x, _splits(x))),
    "LayerNorm": (lambda h: te.LayerNorm(h), lambda m, x: m(x)),
    "RMSNorm": (lambda h: te.RMSNorm(h), lambda m, x: m(x)),
    "TransformerLayer": (
        lambda h: te.TransformerLayer(h, 2 * h, 1, hidden_dropout=0.0, attention_dropout=0.0),
        lambda m, x: m(x[:, None]).squeeze(1),
    ),
    "MultiheadAttention": (
        lambda h: te.MultiheadAttention(h, 1, attention_dropout=0.0),
        lambda m, x: m(x[:, None]).squeeze(1),
    ),
    "DotProductAttention": (
        lambda h: te.DotProductAttention(1, h, attention_dropout=0.0, attn_mask_type="causal"),
        lambda m, x: m(*_qkv(x)).squeeze(1),
    ),
    "ops.Sequential": (
        lambda h: te.ops.Sequential(
            te.ops.LayerNorm(h), te.ops.BasicLinear(h, h), te.ops.Bias(h), te.ops.GELU()
        ),
        lambda m, x: m(x),
    ),
}


# The float64 references of MODULES: plain torch from the module's own parameters ``q`` (name ->
# float64 leaf) and ``x`` [tokens, hidden]; one attention head of the whole hidden size, causal.
def _attention_config(hidden, input_layernorm):
    return {"input_layernorm": input_layernorm, "normalization": "LayerNorm", "zc": False,
            "head_dim": hidden, "groups": 1, "heads_per_group": 1, "fuse_qkv_params": False,
            "qkv_weight_interleaved": True, "layout": "sbhd", "mask": "causal"}  # fmt: skip


def _ln_mlp(q, x, prefix=""):
    """LayerNorm, FC1, tanh GELU, FC2 (``LayerNormMLP``'s defaults)."""
    h = _ln(x, q[prefix + "layer_norm_weight"], q[prefix + "layer_norm_bias"])
    h = _MLP_ACT["gelu"](tF.linear(h, q[prefix + "fc1_weight"], q[prefix + "fc1_bias"]))
    return tF.linear(h, q[prefix + "fc2_weight"], q[prefix + "fc2_bias"])


def _grouped(q, x, prefix=""):
    weights = [q[f"{prefix}weight{g}"] for g in range(3)]
    return _grouped_ref(x, _splits(x), weights, [q[f"{prefix}bias{g}"] for g in range(3)])


def _grouped_mlp(q, x):
    fc1, fc2 = ((q[f"{fc}.weight"].unbind(), q[f"{fc}.bias"].unbind()) for fc in ("fc1", "fc2"))
    return _grouped_ref(_MLP_ACT["gelu"](_grouped_ref(x, _splits(x), *fc1)), _splits(x), *fc2)


def _transformer_layer(q, x):
    """Pre-norm self attention and LayerNormMLP, each with its residual ([s, b=1, h])."""
    x = x[:, None]
    h = x + _mha_ref(q, x, _attention_config(x.shape[-1], True), "self_attention.")[0]
    return (h + _ln_mlp(q, h, "layernorm_mlp.")).squeeze(1)


REFERENCES = {
    "Linear": lambda q, x: tF.linear(x, q["weight"], q["bias"]),
    "LayerNormLinear": lambda q, x: tF.linear(
        _ln(x, q["layer_norm_weight"], q["layer_norm_bias"]), q["weight"], q["bias"]
    ),
    "LayerNormMLP": _ln_mlp,
    "GroupedLinear": _grouped,
    "GroupedMLP": _grouped_mlp,
    "Fp8Padding": lambda q, x: _grouped(q, x, "linear."),
    "LayerNorm": lambda q, x: _ln(x, q["weight"], q["bias"]),
    "RMSNorm": lambda q, x: _rms(x, q["weight"]),
    "TransformerLayer": _transformer_layer,
    "MultiheadAttention": lambda q, x: _mha_ref(
        q, x[:, None], _attention_config(x.shape[-1], False)
    )[0].squeeze(1),
    "DotProductAttention": lambda q, x: _attention_ref(*_qkv(x), "sbhd", "causal").squeeze(1),
    "ops.Sequential": lambda q, x: _MLP_ACT["gelu"](
        tF.linear(_ln(x, q["0.weight"], q["0.bias"]), q["1.weight"]) + q["2.bias"]
    ),
}

# GEMMs a result passes through whose operands carry quantisation errors (the bound of
# assert_close_quantized; attention's QK^T and PV count: their Q, K and V are quantised GEMMs'
# results); 0: none, the
# module runs in high precision under every recipe (DotProductAttention: only "none" is run).
GEMMS = {
    "Linear": 1,
    "LayerNormLinear": 1,
    "LayerNormMLP": 2,
    "GroupedLinear": 1,
    "GroupedMLP": 2,
    "Fp8Padding": 1,
    "LayerNorm": 0,
    "RMSNorm": 0,
    "TransformerLayer": 6,
    "MultiheadAttention": 4,
    "DotProductAttention": 0,
    "ops.Sequential": 1,
}
GROUPED = ("GroupedLinear", "GroupedMLP", "Fp8Padding")
COMPOSED = ("MultiheadAttention", "DotProductAttention", "Fp8Padding")
# Modules whose output adds their input (pre-norm residuals): under a recipe the input is taken
# off the output, and the incoming gradient off the input gradient, before the comparison, so
# that the quantised branches are compared and not a sum the residual dominates.
RESIDUAL = ("TransformerLayer",)
CASES = [(m, r) for m in MODULES for r in RECIPES if m != "DotProductAttention" or r == "none"]
IDS = [f"{m}-{r}" for m, r in CASES]
# The edge values: the modules whose parts the others are made of (MultiheadAttention and
# DotProductAttention run inside TransformerLayer, Fp8Padding around GroupedLinear's GEMM), to
# keep the test's time small; the edge shapes run every module.
VALUE_CASES = [(m, r) for m, r in CASES if m not in COMPOSED]
VALUE_IDS = [f"{m}-{r}" for m, r in VALUE_CASES]


# The grouped GEMM does not implement NVFP4's Hadamard transform and stochastic rounding (it
# refuses them with NotImplementedError): the grouped modules run NVFP4 without them.
GROUPED_NVFP4 = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)


def _autocast(recipe, module_name=""):
    r = RECIPES[recipe]
    if recipe == "nvfp4" and module_name in GROUPED:
        r = GROUPED_NVFP4
    return te.autocast(recipe=r) if r else contextlib.nullcontext()


def _run(module_name, recipe, x, module=None):
    build, call = MODULES[module_name]
    module = module if module is not None else build(x.shape[-1])
    x = x.detach().requires_grad_()
    with _autocast(recipe, module_name):
        y = call(module, x)
    return module, x, y


def _finite_grads(module, x):
    grads = [x.grad] + [p.grad for p in module.parameters() if p.grad is not None]
    return all(g.isfinite().all() for g in grads)


@pytest.mark.parametrize(("module_name", "recipe"), VALUE_CASES, ids=VALUE_IDS)
def test_zero_input_and_weights_give_finite_outputs_and_gradients(module_name, recipe):
    build, _ = MODULES[module_name]
    module = build(HIDDEN[recipe])
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    module, x, y = _run(module_name, recipe, torch.zeros(32, HIDDEN[recipe]), module)
    assert y.isfinite().all()
    y.float().sum().backward()
    assert x.grad is not None and _finite_grads(module, x)


@pytest.mark.parametrize("value", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize(("module_name", "recipe"), VALUE_CASES, ids=VALUE_IDS)
def test_non_finite_input_propagates_or_is_reported(module_name, recipe, value):
    x = torch.randn(32, HIDDEN[recipe])
    x[3, 5] = value
    module, _, y = _run(module_name, recipe, x)
    reported = te.non_finite_amaxes(module)
    assert not y.isfinite().all() or reported, (
        f"{module_name} under {recipe}: a {value} in the input vanished from the output and "
        "non_finite_amaxes reports nothing"
    )


def _refusal(module_name, recipe, tokens, hidden):
    """The message (a regex) with which the module must refuse this shape, or None where it
    must work. FP8 GEMMs need their feature dims to be multiples of 16 (MXFP8: 32); the
    non-grouped MXFP8 and NVFP4 GEMMs also need the tokens in whole blocks (the grouped MXFP8
    GEMMs pad each group; the grouped NVFP4 ones need each group's tokens in blocks of 16, which
    ``Fp8Padding`` gives)."""
    if recipe == "none" or not GEMMS[module_name]:
        return None
    if hidden % 16:
        return rf"\({hidden}\).* multiples? of (its block \()?(16|32)"
    if recipe in ("mxfp8", "nvfp4") and tokens % 32 and module_name not in GROUPED:
        return rf"number of tokens \({tokens}\).* multiples? of (its block \()?(16|32)"
    grouped_nvfp4 = recipe == "nvfp4" and module_name in ("GroupedLinear", "GroupedMLP")
    if grouped_nvfp4 and any(m % 16 for m in _splits(torch.empty(tokens))):  # Fp8Padding pads
        return r"token count \(m_splits\) to be a multiple of 16"
    return None


def _works_or_refused(module_name, recipe, tokens, hidden):
    """Forward and backward at an edge shape, against the module's float64 reference
    (:data:`REFERENCES`, from the same weights); or the refusal :func:`_refusal` expects."""
    build, _ = MODULES[module_name]
    module = build(hidden)
    expected = _refusal(module_name, recipe, tokens, hidden)
    x = torch.randn(tokens, hidden)
    if expected is not None:
        with pytest.raises(ValueError, match=expected):
            _run(module_name, recipe, x, module)
        return
    module, x, y = _run(module_name, recipe, x, module)
    params = {name: to_reference(p) for name, p in module.named_parameters()}
    x64 = to_reference(x.detach()).requires_grad_()
    y64 = REFERENCES[module_name](params, x64)
    assert y.shape == y64.shape and y.shape[0] == tokens
    grad = torch.randn_like(y64)
    y.backward(grad.float())
    y64.backward(grad)
    pairs = [("input", x.grad, x64.grad)] + [
        (name, p.grad, params[name].grad) for name, p in module.named_parameters()
    ]
    quantized = recipe != "none" and GEMMS[module_name]
    for name, actual, ref in pairs:
        assert (actual is None) == (ref is None), name
        if actual is None:
            continue
        if not quantized:
            assert_close(actual, ref, torch.float32, roundings=8, reduced=True, msg=name)
        else:
            residual = grad.float() if name == "input" and module_name in RESIDUAL else None
            _assert_quantized(module_name, recipe, x, actual, ref, grad=True, subtract=residual)
    if not quantized:
        assert_close(y, y64, torch.float32, roundings=8, reduced=True)
    else:
        residual = x.detach() if module_name in RESIDUAL else None
        _assert_quantized(module_name, recipe, x, y, y64, subtract=residual)


def _assert_quantized(module_name, recipe, x, actual, expected, grad=False, subtract=None):
    """The fuzz tests' quantised comparison of a module's result (a grouped module's group by
    group)."""
    splits = _splits(x) if module_name in GROUPED else None
    _compare_quantized(recipe, actual, expected, GEMMS[module_name], grad, splits, subtract)


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_single_token(module_name, recipe):
    _works_or_refused(module_name, recipe, 1, HIDDEN[recipe])


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_zero_tokens(module_name, recipe):
    _works_or_refused(module_name, recipe, 0, HIDDEN[recipe])


@pytest.mark.parametrize(("module_name", "recipe"), CASES, ids=IDS)
def test_odd_hidden_size(module_name, recipe):
    _works_or_refused(module_name, recipe, 32, 67)


# Overflow saturates. FP8 casts saturate (Transformer Engine's kernels convert with ``satfinite``):
# a value whose scaled magnitude passes the format's max F (E4M3 448, E5M2 57344) becomes +-F.
# Under delayed scaling a stale scale from a quiet amax history makes a new outlier overflow:
# it quantises to F / scale, finite, and ``te.non_finite_amaxes`` stays silent (its amax is
# finite). The scaling recipes that measure their own amax (current, block, MXFP8, NVFP4) keep
# even values at the dtype's max in range: quantised and dequantised, they stay finite.

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HIGH_DTYPES = [pytest.param(d, id=n) for n, d in DTYPE_NAMES.items()]
QUANTIZE_RECIPES = {
    "current": R.Float8CurrentScaling(),
    "current-pow2": R.Float8CurrentScaling(use_power_2_scales=True),
    "block": R.Float8BlockScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
    "nvfp4": GROUPED_NVFP4,  # te.quantize applies neither RHT nor stochastic rounding
}


def _huge(shape, dtype):
    """randn with the dtype's largest finite value (and its negative, and 0.9 of it) planted."""
    x = torch.randn(*shape)
    big = torch.finfo(dtype).max
    x[3, 5], x[4, 7], x[6, 1] = big, -big, 0.9 * big
    return x.to(dtype)


def _assert_finite_codes_and_scales(q):
    """FP8 codes and fp32 / E4M3 scales finite; MXFP8's E8M0 scales (uint8) not the NaN code
    255; NVFP4's packed E2M1 codes have no non-finite values."""
    for t in (q.data, q.scale_inv, q.global_scale):
        if t is None:
            continue
        if t.dtype == torch.uint8:
            assert q.kind != "mxfp8" or t is not q.scale_inv or (t != 255).all()
        else:
            assert t.float().isfinite().all(), q.kind


def _round_trip(x, recipe, role, out_dtype):
    q = te.quantize(x, recipe, role=role)
    return q, te.dequantize(q, out_dtype)


# Compiled (fullgraph): the power-of-two recipes, whose dequantisation needed the saturation.
DTYPE_MAX_CASES = [
    *[(r, d, False) for r in QUANTIZE_RECIPES for d in DTYPE_NAMES],
    *[(r, "fp32", True) for r in ("current-pow2", "block")],
]


@pytest.mark.parametrize(
    ("recipe", "dtype_name", "compiled"),
    DTYPE_MAX_CASES,
    ids=[f"{r}-{d}-{'compiled' if c else 'eager'}" for r, d, c in DTYPE_MAX_CASES],
)
def test_values_at_the_dtype_max_quantise_finite(recipe, dtype_name, compiled):
    """Every recipe quantises the dtype's max to finite codes and scales and dequantises it
    (to fp32 and to the dtype) finite, within the format's error."""
    dtype = DTYPE_NAMES[dtype_name]
    x = _huge((32, 128), dtype)
    x64 = x.double()
    huge = x64.abs() > torch.finfo(dtype).max / 2
    bound = OUTLIER_ERROR[recipe.removesuffix("-pow2")]
    fn = _round_trip
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for role in ("input", "weight", "grad"):
        for out_dtype in (torch.float32, dtype):
            q, d = fn(x, QUANTIZE_RECIPES[recipe], role, out_dtype)
            _assert_finite_codes_and_scales(q)
            assert d.isfinite().all(), (role, out_dtype)
            # The outliers keep their value within the format's rounding error.
            error = ((d.double() - x64).abs() / x64.abs())[huge]
            assert (error <= bound).all(), (role, out_dtype, error.max().item())


# The largest relative error of one quantised element: half the spacing of the format's codes
# (E5M2 gradients under HYBRID, E4M3 otherwise; E2M1 inside an NVFP4 block), MXFP8's power-of-two
# block scale rounding a block's amax down by up to 1/8 more.
OUTLIER_ERROR = {"current": 2**-3, "delayed": 2**-3, "block": 2**-4, "mxfp8": 2**-3, "nvfp4": 2**-2}


def _stale_quantize(x, role, scale):
    q = te.quantize(x, R.DelayedScaling(), role=role, scale=scale)
    return te.dequantize(q, torch.float32), q.amax


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", HIGH_DTYPES)
@pytest.mark.parametrize(("role", "fp8_max"), [("input", E4M3_MAX), ("grad", E5M2_MAX)])
def test_delayed_scaling_saturates_an_outlier_past_a_stale_scale(role, fp8_max, dtype, compiled):
    """The scale of an amax history of 2 meets values 1e4 times larger and one at the dtype's
    max: they quantise to +-F / scale (E4M3 for inputs, E5M2 for gradients), finite, and the
    amax records them (finite: nothing to report). Compiled: the same, fullgraph."""
    scale = torch.tensor([fp8_max / 2.0])
    x = torch.randn(32, 64)
    x[3, 5], x[4, 7], x[5, 0] = 2e4, -3e4, torch.finfo(dtype).max
    x = x.to(dtype)
    fn = _stale_quantize
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    d, amax = fn(x, role, scale)
    expected = x.double().clamp(-2.0, 2.0)  # F / scale
    assert_close_quantized(d, expected, "delayed")
    assert d[3, 5] == 2.0 and d[4, 7] == -2.0 and d[5, 0] == 2.0
    assert amax.item() == x.float().abs().max().item() and amax.isfinite().all()


def test_delayed_scaling_saturates_in_a_module_forward_and_backward():
    """te.Linear under DelayedScaling after three quiet steps: an input outlier overflows the
    stale input scale (E4M3) and a gradient outlier the stale gradient scale (E5M2). The output
    and gradients are those of the saturated operands (float64 reference), finite, and
    ``te.non_finite_amaxes`` reports nothing: the amaxes are finite."""
    module = te.Linear(32, 32)
    recipe = R.DelayedScaling(amax_history_len=4)
    for _ in range(3):
        with te.autocast(recipe=recipe):
            y = module(torch.randn(32, 32))
        y.backward(torch.randn_like(y))
    module.zero_grad()
    x = torch.randn(32, 32)
    x[3, 5] = 1e4
    x.requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x)
    s_in, _, s_grad = module.fp8_meta.scale.tolist()  # the scales this step quantises with
    assert 1e4 * s_in > E4M3_MAX
    grad = torch.randn_like(y)
    grad[2, 3] = 1e6
    assert 1e6 * s_grad > E5M2_MAX
    y.backward(grad)
    assert y.isfinite().all() and _finite_grads(module, x)
    assert te.non_finite_amaxes(module) == {}
    x_sat = x.detach().double().clamp(-E4M3_MAX / s_in, E4M3_MAX / s_in)
    g_sat = grad.double().clamp(-E5M2_MAX / s_grad, E5M2_MAX / s_grad)
    w, b = module.weight.detach().double(), module.bias.detach().double()
    assert_close_quantized(y, x_sat @ w.T + b, "delayed")
    assert_close_quantized(x.grad, g_sat @ w, "delayed", grad=True)
    assert_close_quantized(module.weight.grad, g_sat.T @ x_sat, "delayed", grad=True)


DELAYED_MODULES = [m for m, _ in VALUE_CASES if GEMMS[m]]


@pytest.mark.parametrize("module_name", sorted(set(DELAYED_MODULES)))
def test_delayed_scaling_outliers_stay_finite_in_every_module(module_name):
    """Every module with FP8 GEMMs, after three quiet delayed-scaling steps, meets an input
    outlier (for the norm-first modules the norm tames it) and a gradient outlier past its
    stale E5M2 scale: outputs and gradients finite, nothing reported (the Linear test above
    checks the saturated values against float64)."""
    build, call = MODULES[module_name]
    module = build(32)
    recipe = R.DelayedScaling(amax_history_len=4)
    for _ in range(3):
        with te.autocast(recipe=recipe):
            y = call(module, torch.randn(32, 32))
        y.float().sum().backward()
    x = torch.randn(32, 32)
    x[3, 5] = 1e4
    x.requires_grad_()
    with te.autocast(recipe=recipe):
        y = call(module, x)
    grad = torch.randn_like(y)
    grad[2, 3] = 1e6
    y.backward(grad)
    assert y.isfinite().all() and _finite_grads(module, x)
    assert te.non_finite_amaxes(module) == {}


def _grouped_reference(module, x64, splits):
    """float64 ``GroupedLinear``: each group's rows times its weight, plus its bias."""
    rows = x64.split(splits)
    outs = [
        r @ getattr(module, f"weight{g}").detach().cpu().double().T
        + getattr(module, f"bias{g}").detach().cpu().double()
        for g, r in enumerate(rows)
    ]
    return torch.cat(outs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HIGH_DTYPES)
@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("module_name", ["Linear", "GroupedLinear"])
def test_values_at_the_dtype_max_pass_a_module_finite(module_name, recipe, dtype, device):
    """te.Linear and te.GroupedLinear (params in ``dtype``) under the recipes that scale from
    the tensor's own amax: inputs holding the dtype's max give the float64 result within the
    recipe's error, finite, forward and backward; nothing is reported."""
    hidden = HIDDEN[recipe]
    factory = {"params_dtype": dtype, "device": device}
    splits = [16, 0, 16]
    if module_name == "Linear":
        module = te.Linear(hidden, hidden, **factory)
    else:
        module = te.GroupedLinear(3, hidden, hidden, **factory)
    x = _huge((32, hidden), dtype).to(device).requires_grad_()
    with _autocast(recipe, module_name):
        y = module(x) if module_name == "Linear" else module(x, splits)
    grad = torch.randn(y.shape) * 1e-2  # weight gradients x^T g stay in fp16's range
    y.backward(grad.to(device, dtype))
    assert y.isfinite().all() and _finite_grads(module, x)
    assert te.non_finite_amaxes(module) == {}
    x64, g64 = x.detach().cpu().double(), grad.to(dtype).double()
    # MXFP8's power-of-two scales saturate the largest elements of a block of huge values (a
    # bias, not noise): each element is within the format's largest error instead.
    kw = {"bound": OUTLIER_ERROR[recipe]} if recipe == "mxfp8" else {}
    if module_name == "Linear":
        w, b = module.weight.detach().cpu().double(), module.bias.detach().cpu().double()
        assert_close_quantized(y, x64 @ w.T + b, recipe, **kw)
        assert_close_quantized(x.grad, g64 @ w, recipe, grad=True, **kw)
        assert_close_quantized(module.weight.grad, g64.T @ x64, recipe, grad=True, **kw)
    else:
        weights = [getattr(module, f"weight{g}").detach().cpu().double() for g in range(3)]
        dx = torch.cat([g @ w for g, w in zip(g64.split(splits), weights, strict=True)])
        assert_close_quantized(y, _grouped_reference(module, x64, splits), recipe, **kw)
        assert_close_quantized(x.grad, dx, recipe, grad=True, **kw)
