"""Fuzzing (hypothesis) of every public module and of the functional families: random valid
shapes, dtypes, options and recipes against float64 references written here in plain torch.

Settings come from the "te-fuzz" profile that tests/conftest.py registers from
``--fuzz-profile``: "ci" (default; seeded, derandomized, a few cases per test) or "full"
(200 random cases per test): ``pytest tests/test_fuzz.py --fuzz-profile=full``.

Tolerances: high precision from :func:`tests.utils.assert_close` (rounded-reference, ``roundings``
per chained op, ``reduced`` for sums); FP8 / FP4 recipes from
:func:`tests.utils.assert_close_quantized` (a normwise relative error bound per recipe: each
element is off by up to the format's unit roundoff, so elementwise tolerances would have to be
loose enough to hide bugs)."""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
import torch.nn.functional as tF
from hypothesis import given, settings
from hypothesis import strategies as st

import te_compile as te
from te_compile import recipe as R
from tests.utils import assert_close, assert_close_quantized, assert_close_sum, to_reference

FUZZ = settings(settings.get_profile("te-fuzz"))


def _fuzz(ci_examples):
    """``FUZZ`` for a heavy test: at most ``ci_examples`` cases under the "ci" profile (the
    derandomized one), all of them under "full"."""
    return settings(FUZZ, max_examples=ci_examples) if FUZZ.derandomize else FUZZ


# Each example seeds torch's generator from a drawn seed: its random tensors are part of the
# example, so a failure replays exactly.
SEED = st.integers(0, 2**31 - 1)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
# Recipes with the dims and token counts each can take (blocks, padding).
RECIPES = {
    "current": (R.Float8CurrentScaling(), 16, 1),
    "delayed": (R.DelayedScaling(amax_history_len=4), 16, 1),
    "block": (R.Float8BlockScaling(), 128, 1),
    "mxfp8": (R.MXFP8BlockScaling(), 32, 32),
    "nvfp4": (R.NVFP4BlockScaling(), 32, 32),
}
# The grouped GEMM implements NVFP4 without the Hadamard transform and stochastic rounding (it
# raises NotImplementedError on them): the grouped modules run this variant.
GROUPED_NVFP4 = R.NVFP4BlockScaling()
# te.quantize / ops.Quantize: without the transform and stochastic rounding, which only the
# GEMMs apply (a standalone quantiser refuses them).
QUANTIZE_NVFP4 = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)


@st.composite
def _precision(draw, max_tokens=24, max_features=48):
    """``(recipe name or None, dtype, tokens, in_features, out_features)``: any sizes in high
    precision, the multiples a recipe needs otherwise."""
    name = draw(st.sampled_from([None, *RECIPES]))
    if name is None:
        sizes = st.integers(1, max_features)
        return None, draw(DTYPES), draw(st.integers(0, max_tokens)), draw(sizes), draw(sizes)
    _, dim, rows = RECIPES[name]
    dims = st.integers(1, 2).map(lambda k: k * dim)
    tokens = draw(st.integers(1, 2).map(lambda k: k * max(rows, 16)))
    return (
        name,
        draw(st.sampled_from([torch.float32, torch.bfloat16])),
        tokens,
        draw(dims),
        draw(dims),
    )


def _autocast(name, grouped=False):
    if not name:
        return contextlib.nullcontext()
    return te.autocast(recipe=GROUPED_NVFP4 if grouped and name == "nvfp4" else RECIPES[name][0])


def _recipe_kwargs(recipe):
    """The recipe of ``RECIPES[recipe]`` as the data the functional GEMM ops take (emulated
    block-scaled GEMMs on the CPU; delayed scaling with the scales a calibrated state would hold,
    which is current scaling's)."""
    if recipe is None:
        return {}
    kw = {"recipe": recipe, "emulate": recipe in ("mxfp8", "nvfp4")}
    if recipe == "delayed":
        kw["recipe"] = "current"
    if recipe == "block":
        kw["fwd_dtype"] = kw["bwd_dtype"] = torch.float8_e4m3fn
    return kw


def _randomize(module, dtype, fan_in=False):
    """Random parameters (normal; norm gains around 1) in ``dtype``, and their float64
    references. ``fan_in``: weight matrices with standard deviation ``1 / sqrt(in_features)``
    (activations of order 1, as a trained model keeps them: attention scores that do not
    saturate the softmax, whose sensitivity would otherwise amplify every rounding)."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            leaf = n.rsplit(".", 1)[-1]  # a norm's gain: "layer_norm_weight", a norm's "weight"
            gain = leaf in ("layer_norm_weight", "norm_weight") or (
                leaf == "weight" and p.dim() == 1
            )
            std = p.shape[-1] ** -0.5 if fan_in and p.dim() >= 2 else 0.5
            p.copy_(torch.randn_like(p, dtype=torch.float32) * std + gain)
    return {n: to_reference(p) for n, p in module.named_parameters()}


def _compare(recipe, actual, expected, dtype, roundings, gemms=1):
    if recipe is None:
        assert_close(actual, expected, dtype, roundings=roundings, reduced=True)
    else:
        assert_close_quantized(actual, expected, recipe, gemms)


def _check(module, ref, inputs, dtype, recipe=None, roundings=2, call=None, gemms=1,
           grouped=False, sum_bound=True, autocast=True, magnitude_ref=None):  # fmt: skip
    """``module(*inputs)`` against ``ref(ref_params, *ref_inputs)``: output, input gradient and
    parameter gradients. ``gemms``: quantised GEMMs in a row (the recipe's error bound);
    ``grouped``: the recipe variant of the grouped GEMM (``GROUPED_NVFP4``); ``autocast=False``:
    the call takes the recipe as data, no autocast region.

    Gradients are sums over tokens (or features) of rounded terms: in high precision their
    tolerance scales with the sum of the terms' magnitudes, the reference's gradients evaluated
    on the absolute values of the inputs, parameters and incoming gradient. ``sum_bound=False``
    for a softmax in the chain, where that is no bound: ``reduced`` tolerances, two roundings
    more, weights scaled by their fan-in (see :func:`_randomize`). ``roundings`` may be a
    callable, called after ``ref`` ran (which may record a norm's condition number). ``ref`` may
    return ``(output, magnitude)`` for an output that is a sum of terms (residual connections):
    the high-precision tolerance then scales with ``magnitude``, the sum of the terms' absolute
    values, since the sum can cancel. ``magnitude_ref``: the reference the magnitudes are taken
    from, where ``ref`` has a clamp (on absolute values it would cut gradients the actual inputs
    pass)."""
    params = _randomize(module, dtype, fan_in=not sum_bound)
    x = inputs[0].to(dtype).requires_grad_()
    x_ref = to_reference(x)
    with _autocast(recipe if autocast else None, grouped):
        y = (call or module)(x, *inputs[1:])
    y_ref = ref(params, x_ref, *inputs[1:])
    if callable(roundings):  # known once the reference ran (a norm's condition number)
        roundings = roundings()
    terms = None
    if isinstance(y_ref, tuple):  # a sum of terms (residuals): ``(sum, sum of |terms|)``
        y_ref, terms = y_ref
    assert y.shape == y_ref.shape and y.dtype == dtype
    if terms is not None and recipe is None:
        assert_close_sum(y, y_ref, dtype, terms.detach(), roundings)
    else:
        _compare(recipe, y, y_ref, dtype, roundings, gemms)
    if y.numel() == 0:
        return
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    grads = [(x.grad, x_ref.grad)]
    grads += [(p.grad, params[n].grad) for n, p in module.named_parameters()]
    if recipe is not None:
        # The backward quantises the incoming gradient too (one more quantised operand).
        for i, (actual, expected) in enumerate(grads):
            try:
                assert_close_quantized(actual, expected, recipe, gemms + 1)
            except AssertionError as e:
                names = ["x", *(n for n, _ in module.named_parameters())]
                raise AssertionError(f"gradient of {names[i]}: {e}") from None
        return
    if not sum_bound:  # softmax: no monotone magnitude bound; a looser sum tolerance
        for actual, expected in grads:
            assert_close(actual, expected, dtype, roundings=roundings + 2, reduced=True)
        return
    abs_params = {n: p.detach().abs().requires_grad_() for n, p in params.items()}
    abs_x = x_ref.detach().abs().requires_grad_()
    (magnitude_ref or ref)(abs_params, abs_x, *inputs[1:]).backward(to_reference(dy).abs())
    magnitudes = [abs_x.grad] + [abs_params[n].grad for n, _ in module.named_parameters()]
    for (actual, expected), magnitude in zip(grads, magnitudes, strict=True):
        assert_close_sum(actual, expected, dtype, magnitude, roundings + 1)


def _ln(x, w, b, eps=1e-5):
    return tF.layer_norm(x, x.shape[-1:], w, b, eps)


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


# Modules ---------------------------------------------------------------------------------------


@FUZZ
@given(seed=SEED, p=_precision(), bias=st.booleans(), lead=st.integers(1, 3))
def test_linear(seed, p, bias, lead):
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    m = te.Linear(k, n, bias=bias, params_dtype=dtype)
    x = torch.randn(lead, tokens, k) if recipe is None else torch.randn(tokens, k)
    _check(m, lambda q, x: tF.linear(x, q["weight"], q.get("bias")), [x], dtype, recipe)


@FUZZ
@given(
    seed=SEED,
    p=_precision(),
    normalization=st.sampled_from(["LayerNorm", "RMSNorm"]),
    zc=st.booleans(),
    pieces=st.integers(0, 3),
    data=st.data(),
)
def test_layernorm_linear(seed, p, normalization, zc, pieces, data):
    """Under every recipe; ``parameters_split`` (names with sizes, or names splitting evenly)
    names slices of the one fused weight and bias in the state_dict."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    split = None
    if 0 < pieces <= n and data.draw(st.booleans(), label="sized"):  # positive sizes
        cuts = []
        if pieces > 1:
            cuts = st.lists(st.integers(1, n - 1), min_size=pieces - 1, max_size=pieces - 1,
                            unique=True)  # fmt: skip
            cuts = sorted(data.draw(cuts, label="cuts"))
        sizes = [b - a for a, b in itertools.pairwise([0, *cuts, n])]
        split = {f"p{i}": size for i, size in enumerate(sizes)}
    elif pieces and n % pieces == 0:
        split = tuple(f"p{i}" for i in range(pieces))
    m = te.LayerNormLinear(k, n, normalization=normalization, zero_centered_gamma=zc,
                           parameters_split=split, params_dtype=dtype)  # fmt: skip

    def ref(q, x):
        g = q["layer_norm_weight"] + (1 if zc else 0)
        h = _ln(x, g, q["layer_norm_bias"]) if normalization == "LayerNorm" else _rms(x, g)
        return tF.linear(h, q["weight"], q["bias"])

    _check(m, ref, [torch.randn(tokens, k)], dtype, recipe, roundings=3)
    if split is not None:
        sizes = list(split.values()) if isinstance(split, dict) else [n // pieces] * pieces
        state = m.state_dict()
        for name, w, b in zip(split, m.weight.split(sizes), m.bias.split(sizes), strict=True):
            assert torch.equal(state[f"{name}_weight"], w) and torch.equal(state[f"{name}_bias"], b)


_MLP_ACT = {
    "gelu": lambda a: tF.gelu(a, approximate="tanh"),
    "relu": tF.relu,
    "silu": tF.silu,
    "swiglu": lambda a: tF.silu(a.chunk(2, -1)[0]) * a.chunk(2, -1)[1],
    "geglu": lambda a: tF.gelu(a.chunk(2, -1)[0], approximate="tanh") * a.chunk(2, -1)[1],
}


@FUZZ
@given(seed=SEED, p=_precision(), activation=st.sampled_from(sorted(_MLP_ACT)),
       checkpoint=st.booleans())  # fmt: skip
def test_layernorm_mlp(seed, p, activation, checkpoint):
    """Under every recipe; called directly or through ``te.checkpoint`` (recomputed in the
    backward)."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, hidden, ffn = p
    m = te.LayerNormMLP(hidden, ffn, activation=activation, params_dtype=dtype)

    def ref(q, x):
        h = tF.linear(_ln(x, q["layer_norm_weight"], q["layer_norm_bias"]), q["fc1_weight"],
                      q["fc1_bias"])  # fmt: skip
        return tF.linear(_MLP_ACT[activation](h), q["fc2_weight"], q["fc2_bias"])

    call = (lambda x: te.checkpoint(m, x, use_reentrant=False)) if checkpoint else None
    _check(m, ref, [torch.randn(tokens, hidden)], dtype, recipe, roundings=4, gemms=2, call=call)


@st.composite
def _splits(draw, groups, tokens, unit=1):
    """Random split sizes summing to ``tokens``, each a multiple of ``unit`` (NVFP4's grouped
    GEMMs take whole blocks of 16 tokens per group)."""
    top = tokens // unit
    cuts = sorted(draw(st.lists(st.integers(0, top), min_size=groups - 1, max_size=groups - 1)))
    bounds = [0, *(c * unit for c in cuts), tokens]
    return [b - a for a, b in itertools.pairwise(bounds)]


def _grouped_ref(x, splits, weights, biases):
    outs = [tF.linear(xg, w, b) for xg, w, b in zip(x.split(splits), weights, biases, strict=True)]
    return torch.cat(outs)


@FUZZ
@given(seed=SEED, p=_precision(), groups=st.integers(1, 4), bias=st.booleans(),
       single_weight=st.booleans(), single_bias=st.booleans(), splits_tensor=st.booleans(),
       data=st.data())  # fmt: skip
def test_grouped_linear(seed, p, groups, bias, single_weight, single_bias, splits_tensor, data):
    """Any split sizes (empty groups too) under every recipe, per-group or single grouped
    parameters, ``m_splits`` a list or a tensor."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    splits = data.draw(_splits(groups, tokens, 16 if recipe == "nvfp4" else 1))
    m = te.GroupedLinear(groups, k, n, bias=bias, single_grouped_weight=single_weight,
                         single_grouped_bias=single_bias, params_dtype=dtype)  # fmt: skip

    def ref(q, x, _):
        ws = q["weight"].unbind() if single_weight else [q[f"weight{g}"] for g in range(groups)]
        bs = [None] * groups
        if bias:
            bs = q["bias"].unbind() if single_bias else [q[f"bias{g}"] for g in range(groups)]
        return _grouped_ref(x, splits, ws, bs)

    m_splits = torch.tensor(splits) if splits_tensor else splits
    _check(m, ref, [torch.randn(tokens, k), m_splits], dtype, recipe, grouped=True)


_GROUPED_MLP_ACT = ["gelu", "relu", "silu", "swiglu", "geglu"]


@FUZZ
@given(seed=SEED, p=_precision(max_features=32), groups=st.integers(1, 3),
       activation=st.sampled_from(_GROUPED_MLP_ACT), interleave=st.sampled_from([None, 1, 4, 8]),
       bias=st.booleans(), single=st.booleans(), data=st.data())  # fmt: skip
def test_grouped_mlp(seed, p, groups, activation, interleave, bias, single, data):
    """Element-wise and gated activations, the gated ones in the contiguous or the interleaved
    FC1 layout (``glu_interleave_size``), one ``[G, N, K]`` parameter or one per expert, under
    every recipe."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, hidden, ffn = p
    gated = activation in _GLU_REF
    if not gated or ffn % (interleave or 1):
        interleave = None
    splits = data.draw(_splits(groups, tokens, 16 if recipe == "nvfp4" else 1))
    m = te.GroupedMLP(groups, hidden, ffn, activation=activation, glu_interleave_size=interleave,
                      bias=bias, single_grouped_parameter=single, params_dtype=dtype)  # fmt: skip

    def weights(q, fc):
        if single:
            bs = q[f"{fc}.bias"].unbind() if bias else [None] * groups
            return q[f"{fc}.weight"].unbind(), bs
        ws = [q[f"{fc}.weight{g}"] for g in range(groups)]
        return ws, ([q[f"{fc}.bias{g}"] for g in range(groups)] if bias else [None] * groups)

    def ref(q, x, _):
        h = _grouped_ref(x, splits, *weights(q, "fc1"))
        h = _gated(activation, h, interleave) if gated else _MLP_ACT[activation](h)
        return _grouped_ref(h, splits, *weights(q, "fc2"))

    _check(m, ref, [torch.randn(tokens, hidden), splits], dtype, recipe, roundings=4, gemms=2,
           grouped=True)  # fmt: skip


_NORM_FORMS = ["LayerNorm", "RMSNorm", "layernorm", "rmsnorm", "branch_rmsnorm", "l2normalization"]


@FUZZ
@given(seed=SEED,
    dtype=DTYPES, form=st.sampled_from(_NORM_FORMS), zc=st.booleans(), bias=st.booleans(),
    shape=st.lists(st.integers(0, 6), max_size=2), hidden=st.integers(1, 80),
    eps=st.sampled_from([1e-5, 1e-3, 0.5]),
)  # fmt: skip
def test_norms(seed, dtype, form, zc, bias, shape, hidden, eps):
    """The norm modules and functions: ``te.LayerNorm`` / ``te.RMSNorm``,
    ``te.functional.layernorm`` (with or without a bias) / ``rmsnorm`` / ``l2normalization`` /
    ``branch_rmsnorm`` (its branch output, a copy of the input, summed in)."""
    torch.manual_seed(seed)
    rms = form in ("RMSNorm", "rmsnorm", "branch_rmsnorm")
    F = te.functional
    shapes = {"weight": (hidden,)}
    if form in ("LayerNorm", "RMSNorm"):
        m = getattr(te, form)(hidden, eps, zero_centered_gamma=zc, params_dtype=dtype)
        bias = form == "LayerNorm"
    elif form == "layernorm":
        m = _Fn(lambda x, **t: F.layernorm(x, t["weight"], t.get("bias"), eps, zc), dtype,
                **shapes, **({"bias": (hidden,)} if bias else {}))  # fmt: skip
    elif form == "rmsnorm":
        m = _Fn(lambda x, **t: F.rmsnorm(x, t["weight"], eps, zc), dtype, **shapes)
    elif form == "branch_rmsnorm":
        m = _Fn(lambda x, **t: sum(F.branch_rmsnorm(x, t["weight"], eps, zc)), dtype, **shapes)
    else:
        m = _Fn(lambda x: F.l2normalization(x, eps), dtype)

    def ref(q, x):
        if form == "l2normalization":
            return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
        g = q["weight"] + (1 if zc else 0)
        if rms:
            return _rms(x, g, eps) + (x if form == "branch_rmsnorm" else 0)
        return _ln(x, g, q["bias"] if bias else None, eps)

    x = torch.randn(*shape, hidden).to(dtype)
    # A row whose values nearly agree has a tiny variance: its 1 / sigma amplifies the input's
    # roundoff (the problem's condition number, max |x| / sigma), in any implementation.
    x64 = x.double()
    centered = x64 if rms or form == "l2normalization" else x64 - x64.mean(-1, keepdim=True)
    rsigma = torch.rsqrt(centered.square().mean(-1) + eps)
    cond = (x64.abs().amax(-1) * rsigma).max().item() if x.numel() else 1.0
    _check(m, ref, [x], dtype, roundings=2 * max(1, math.ceil(cond)))


@FUZZ
@given(seed=SEED, dtype=DTYPES, p=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
       shape=st.lists(st.integers(1, 40), min_size=1, max_size=2), form=st.sampled_from(
       ["function", "function_rng_state", "ops", "eval"]))  # fmt: skip
def test_dropout(seed, dtype, p, shape, form):
    """``te.functional.dropout`` (torch's generator or an explicit ``rng_state``) and
    ``te.ops.Dropout`` (training; ``eval()`` is the identity): every element dropped or scaled by
    ``1 / (1 - p)``, the gradient through the same mask, the dropped fraction ``p`` within five
    standard deviations, and the same ``rng_state`` giving the same mask."""
    torch.manual_seed(seed)
    x = torch.randn(shape).to(dtype).requires_grad_()
    rng = torch.tensor([seed, 4 * seed], dtype=torch.int64)
    if form == "function":
        y = te.functional.dropout(x, p)
    elif form == "function_rng_state":
        y = te.functional.dropout(x, p, rng_state=rng)
        assert torch.equal(y, te.functional.dropout(x, p, rng_state=rng))
    else:
        m = te.ops.Sequential(te.ops.Dropout(p))
        y = m.eval()(x) if form == "eval" else m(x)
    keep = y.detach() != 0
    if form == "eval" or p == 0:
        assert torch.equal(y, x)
    else:
        expected = torch.where(keep, x.detach().double() / (1 - p), 0.0)
        assert_close(y, expected, dtype)
        n = x.numel()
        assert abs((~keep).sum().item() / n - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1 / n
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    scale = 1.0 if form == "eval" else 1 / (1 - p)
    assert_close(x.grad, torch.where(keep | (x == 0), dy.double() * scale, 0.0), dtype)


@FUZZ
@given(seed=SEED, dtype=DTYPES, splits=st.lists(st.integers(0, 40), min_size=1, max_size=4),
       features=st.integers(1, 8), align=st.sampled_from([None, 1, 4, 16]),
       mxfp8=st.booleans())  # fmt: skip
def test_fp8_padding(seed, dtype, splits, features, align, mxfp8):
    """``te.Fp8Padding`` / ``te.Fp8Unpadding``: each group's rows followed by zero rows up to a
    multiple of ``align_size`` (None: 16, or 32 inside an MXFP8 autocast), and back; exact, the
    gradient of each is the other."""
    torch.manual_seed(seed)
    size = align or (32 if mxfp8 else 16)
    padded = [-(-m // size) * size for m in splits]
    x = torch.randn(sum(splits), features).to(dtype).requires_grad_()
    ctx = te.autocast(recipe=R.MXFP8BlockScaling()) if mxfp8 else contextlib.nullcontext()
    with ctx:
        y, out_splits = te.Fp8Padding(len(splits), align)(x, splits)
        z = te.Fp8Unpadding(len(splits), align)(y, splits)
    groups = zip(x.detach().split(splits), splits, padded, strict=True)
    y_ref = torch.cat([torch.cat((g, g.new_zeros(pm - m, features))) for g, m, pm in groups])
    assert out_splits == padded and torch.equal(y, y_ref) and torch.equal(z, x)
    dz = torch.randn(z.shape).to(dtype)
    z.backward(dz)
    assert torch.equal(x.grad, dz)


@FUZZ
@given(seed=SEED, lead=st.lists(st.integers(1, 4), max_size=2), half=st.integers(1, 12),
       k=st.integers(1, 12), data=st.data())  # fmt: skip
def test_glu_interleave(seed, lead, half, k, data):
    """``te.interleave_glu_tensor`` / ``te.deinterleave_glu_tensor`` along any dim: the halves
    ``[a; l]`` as blocks ``[a_0:k, l_0:k, a_k:2k, ...]``, and back; exact."""
    torch.manual_seed(seed)
    if half % k:
        k = 1
    shape = [*lead]
    dim = data.draw(st.integers(0, len(shape)), label="dim")
    shape.insert(dim, 2 * half)
    t = torch.randn(shape)
    expected = t.unflatten(dim, (2, half // k, k)).transpose(dim, dim + 1).flatten(dim, dim + 2)
    out = te.interleave_glu_tensor(t, k, dim=dim)
    assert torch.equal(out, expected)
    assert torch.equal(te.deinterleave_glu_tensor(out, k, dim=dim), t)


# te.ops: random chains of basic ops. Motifs are the fusions' patterns (so the fused ops run),
# the rest single ops; each step is ``(kind, options)``, built and referenced in the test.
_OPS_ACT = {"GELU": "gelu", "QGELU": "qgelu", "ReLU": "relu", "SReLU": "srelu", "SiLU": "silu"}
_OPS_GLU = {"GLU": "glu", "GEGLU": "geglu", "QGEGLU": "qgeglu", "ReGLU": "reglu",
            "SReGLU": "sreglu", "SwiGLU": "swiglu", "ClampedSwiGLU": "clamped_swiglu"}  # fmt: skip
_OPS_SCALED_GLU = {"ScaledSwiGLU": "swiglu", "ScaledClampedQGeGLU": "clamped_swiglu"}
_FUSION_MOTIFS = [
    ["BasicLinear", "Bias?", "act"],  # ForwardLinearBiasActivation
    ["BasicLinear", "Bias?", "ConstantScale", "AddExtraInput"],  # ForwardLinearScaleAdd
    ["BasicLinear", "Bias?", "AddExtraInput"],  # ForwardLinearBiasAdd
    ["MakeExtraOutput", "BasicLinear", "Bias?"],  # BackwardLinearAdd
    ["Bias", "act"],  # BackwardActivationBias
    ["MakeExtraOutput", "RMSNorm"],  # BackwardAddRMSNorm
]
_MOTIFS = [
    *_FUSION_MOTIFS,
    *([op] for op in ["Linear", "Bias", "act", "glu", "scaled_glu", "LayerNorm", "RMSNorm",
                      "L2Normalization", "ConstantScale", "Identity", "Reshape", "AddExtraInput",
                      "MakeExtraOutput", "GroupedLinear"]),
]  # fmt: skip


@st.composite
def _op_chain(draw):
    steps = []
    for motif in draw(st.lists(st.sampled_from(_MOTIFS), min_size=1, max_size=4)):
        for kind in motif:
            if kind == "Bias?":
                if not draw(st.booleans()):
                    continue
                kind = "Bias"
            if kind == "act":
                kind = draw(st.sampled_from(sorted(_OPS_ACT)))
            elif kind == "glu":
                kind = draw(st.sampled_from(sorted(_OPS_GLU)))
            elif kind == "scaled_glu":
                kind = draw(st.sampled_from(sorted(_OPS_SCALED_GLU)))
            steps.append((kind, {
                "features": draw(st.integers(2, 12)), "bias": draw(st.booleans()),
                "zc": draw(st.booleans()), "interleave": draw(st.sampled_from([None, 1, 2])),
                "scale": draw(st.sampled_from([0.5, -2.0])), "groups": draw(st.integers(1, 3)),
                "flat": draw(st.booleans()),
            }))  # fmt: skip
    return steps


def _build_chain(steps, hidden, lead, dtype, data):
    """The ops, the reference of each (``(x, q, prefix, extras, outs) -> x``, taking extra inputs
    from the iterator ``extras`` and appending extra outputs to ``outs``), the extra inputs, and
    the list the scaled gated activations' references append ``(scales, glu, output)`` to."""
    ops, refs, extras, scaled_terms = [], [], [], []
    h = hidden
    shape = list(lead)
    for kind, o in steps:
        tokens = math.prod(shape)
        if kind in _OPS_GLU or kind in _OPS_SCALED_GLU:
            if h % 2:  # a gated op needs an even width: a linear to 2 * features first
                ops.append(te.ops.BasicLinear(h, 2 * o["features"], dtype=dtype))
                refs.append(lambda x, q, p, e, out: tF.linear(x, q[p + "weight"]))
                h = 2 * o["features"]
            k = o["interleave"] if o["interleave"] and (h // 2) % o["interleave"] == 0 else None
        if kind == "BasicLinear":
            ops.append(te.ops.BasicLinear(h, o["features"], dtype=dtype))
            refs.append(lambda x, q, p, e, out: tF.linear(x, q[p + "weight"]))
            h = o["features"]
        elif kind == "Linear":
            ops.append(te.ops.Linear(h, o["features"], bias=o["bias"], dtype=dtype))
            refs.append(lambda x, q, p, e, out: tF.linear(
                x, q[p + "basic_ops.0.weight"], q.get(p + "basic_ops.1.bias")))  # fmt: skip
            h = o["features"]
        elif kind == "GroupedLinear":  # 2-D input: a Reshape first where needed
            if len(shape) != 1:
                shape = [tokens]
                ops.append(te.ops.Reshape((tokens, h)))
                refs.append(lambda x, q, p, e, out, s=(tokens, h): x.reshape(s))
            splits = data.draw(_splits(o["groups"], tokens), label="m_splits")
            ops.append(te.ops.GroupedLinear(o["groups"], h, o["features"], bias=o["bias"],
                                            dtype=dtype))  # fmt: skip
            extras.append(splits)

            def grouped(x, q, p, e, out, groups=o["groups"], bias=o["bias"]):
                bs = q[p + "bias"].unbind() if bias else [None] * groups
                return _grouped_ref(x, next(e), q[p + "weight"].unbind(), bs)

            refs.append(grouped)
            h = o["features"]
        elif kind == "Bias":
            ops.append(te.ops.Bias(h, dtype=dtype))
            refs.append(lambda x, q, p, e, out: x + q[p + "bias"])
        elif kind in _OPS_ACT:
            ops.append(getattr(te.ops, kind)())
            refs.append(lambda x, q, p, e, out, f=_ACT_REF[_OPS_ACT[kind]]: f(x))
        elif kind in _OPS_GLU:
            ops.append(getattr(te.ops, kind)(glu_interleave_size=k))
            refs.append(lambda x, q, p, e, out, n=_OPS_GLU[kind], k=k: _gated(n, x, k))
            h //= 2
        elif kind in _OPS_SCALED_GLU:
            ops.append(getattr(te.ops, kind)(glu_interleave_size=k))
            extras.append(torch.randn(shape).to(dtype))

            def scaled(x, q, p, e, out, n=_OPS_SCALED_GLU[kind], k=k):
                g, s = _gated(n, x, k), next(e)
                y = g * s[..., None]
                y.retain_grad()
                scaled_terms.append((s, g, y))
                return y

            refs.append(scaled)
            h //= 2
        elif kind in ("LayerNorm", "RMSNorm"):
            ops.append(getattr(te.ops, kind)(h, dtype=dtype, zero_centered_gamma=o["zc"]))
            refs.append(lambda x, q, p, e, out, kind=kind, zc=o["zc"]:
                        _norm_ref(x, q, p, kind, zc))  # fmt: skip
        elif kind == "L2Normalization":
            ops.append(te.ops.L2Normalization())
            refs.append(lambda x, q, p, e, out: x * torch.rsqrt(x.square().sum(-1, True) + 1e-6))
        elif kind == "ConstantScale":
            ops.append(te.ops.ConstantScale(o["scale"]))
            refs.append(lambda x, q, p, e, out, a=o["scale"]: a * x)
        elif kind == "Identity":
            ops.append(te.ops.Identity())
            refs.append(lambda x, q, p, e, out: x)
        elif kind == "Reshape":  # all tokens in one dim, or a leading dim of 1
            shape = [tokens] if o["flat"] else [1, tokens]
            ops.append(te.ops.Reshape((*shape, h)))
            refs.append(lambda x, q, p, e, out, s=(*shape, h): x.reshape(s))
        elif kind == "AddExtraInput":
            ops.append(te.ops.AddExtraInput())
            extras.append(torch.randn(*shape, h).to(dtype))
            refs.append(lambda x, q, p, e, out: x + next(e))
        elif kind == "MakeExtraOutput":
            ops.append(te.ops.MakeExtraOutput())
            refs.append(lambda x, q, p, e, out: out.append(x) or x)
    return ops, refs, extras, scaled_terms


def _norm_cond(x, kind):
    """A norm's condition number over rows of ``x`` (see :func:`test_norms`)."""
    centered = x if kind != "LayerNorm" else x - x.mean(-1, keepdim=True)
    rsigma = torch.rsqrt(centered.square().mean(-1) + 1e-5)
    return (x.abs().amax(-1) * rsigma).max().item() if x.numel() else 1.0


@FUZZ
@given(seed=SEED, dtype=DTYPES, steps=_op_chain(), hidden=st.integers(2, 12),
       lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), fuse=st.booleans(),
       data=st.data())  # fmt: skip
def test_ops_sequential(seed, dtype, steps, hidden, lead, fuse, data):
    """A random ``te.ops.Sequential`` of every basic op (linears, biases, element-wise, gated and
    scaled gated activations, norms, scale, identity, reshape, extra inputs and outputs, grouped
    linear), the fusions' patterns among them, fused or not: outputs, extra outputs and the
    gradients of the input, the extra inputs and the parameters against plain torch."""
    torch.manual_seed(seed)
    # Widths from 2: a norm of a single value, or of values all proportional to one input
    # value, is scale invariant, and its gradient a cancellation to (nearly) zero.
    ops, refs, extras, scaled_terms = _build_chain(steps, hidden, lead, dtype, data)
    m = te.ops.Sequential(*ops, fuse=fuse)
    params = _randomize(m, dtype, fan_in=True)
    x = torch.randn(*lead, hidden).to(dtype).requires_grad_()
    extras = [e.requires_grad_() if isinstance(e, torch.Tensor) else e for e in extras]
    x_ref, extras_ref = to_reference(x), to_reference(extras)
    outs = m(x, *extras)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    y_ref, more, it = x_ref, [], iter(extras_ref)
    cond = 1.0
    for i, ref in enumerate(refs):
        if type(m[i]).__name__ in ("LayerNorm", "RMSNorm"):
            cond = max(cond, _norm_cond(y_ref.detach(), type(m[i]).__name__))
        y_ref = ref(y_ref, params, f"{i}.", it, more)
    outs_ref = [y_ref, *more]
    # Each op rounds once; a norm amplifies its input's roundoff by its condition number.
    roundings = (len(refs) + 1) * max(1, math.ceil(cond))
    assert len(outs) == len(outs_ref)
    for out, ref in zip(outs, outs_ref, strict=True):
        assert out.shape == ref.shape and out.dtype == dtype
        assert_close(out, ref, dtype, roundings=roundings, reduced=True)
    grads = [torch.randn(o.shape).to(dtype) for o in outs]
    sum((o * g).sum() for o, g in zip(outs, grads, strict=True)).backward()
    sum((o * to_reference(g)).sum() for o, g in zip(outs_ref, grads, strict=True)).backward()
    # A scaled activation's scales get sum_j dy_j glu_j: its terms' magnitudes bound the error
    # (a norm next is invariant to a row's scale, and that sum cancels to zero).
    sums = {id(s): (g.abs() * y.grad.abs()).sum(-1) for s, g, y in scaled_terms
            if y.grad is not None}  # fmt: skip
    checks = [(x.grad, x_ref.grad, None)]
    checks += [(p.grad, params[n].grad, None) for n, p in m.named_parameters()]
    checks += [(e.grad, r.grad, sums.get(id(r))) for e, r in zip(extras, extras_ref, strict=True)
               if isinstance(e, torch.Tensor)]  # fmt: skip
    for actual, expected, magnitude in checks:
        if expected is None:  # an input no output depends on
            assert actual is None or not actual.any()
        elif magnitude is not None:
            assert_close_sum(actual, expected, dtype, magnitude.detach(), roundings + 1)
        else:
            assert_close(actual, expected, dtype, roundings=roundings + 1, reduced=True)


# Functions -------------------------------------------------------------------------------------

_ACT_REF = {
    "gelu": lambda a: tF.gelu(a, approximate="tanh"),
    "qgelu": lambda a: a * torch.sigmoid(1.702 * a),
    "relu": tF.relu,
    "srelu": lambda a: tF.relu(a).square(),
    "silu": tF.silu,
}
_GLU_REF = {
    "glu": torch.sigmoid,
    "geglu": _ACT_REF["gelu"],
    "qgeglu": _ACT_REF["qgelu"],
    "reglu": tF.relu,
    "sreglu": _ACT_REF["srelu"],
    "swiglu": tF.silu,
}


def _gated(name, x, interleave=None, limit=7.0, alpha=1.702, offset=1.0):
    """A gated activation of ``x``'s last dim: the activation half ``a`` and the linear half
    ``l``, contiguous or in blocks of ``interleave``; ``clamped_swiglu`` clamps both."""
    blocks = x.unflatten(-1, (-1, 2, interleave or x.shape[-1] // 2))
    a, lin = blocks.select(-2, 0).flatten(-2), blocks.select(-2, 1).flatten(-2)
    if name == "clamped_swiglu":
        c = a.clamp(max=limit)
        return c * torch.sigmoid(alpha * c) * (lin.clamp(-limit, limit) + offset)
    return _GLU_REF[name](a) * lin


class _Fn(torch.nn.Module):
    """Tensors of a functional call as named parameters, so that :func:`_check` randomises them
    (names with "norm" around 1) and compares their gradients."""

    def __init__(self, fn, dtype, **shapes):
        super().__init__()
        self.fn = fn
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, dtype=dtype)))

    def forward(self, x, *args):
        return self.fn(x, *args, **dict(self.named_parameters()))


@FUZZ
@given(seed=SEED,
    dtype=DTYPES, name=st.sampled_from([*_ACT_REF, *_GLU_REF, "clamped_swiglu"]),
    shape=st.lists(st.integers(0, 5), max_size=2), half=st.integers(1, 24),
    interleave=st.sampled_from([None, 1, 2, 4]), bias=st.booleans(),
    limit=st.sampled_from([0.5, 7.0]), alpha=st.sampled_from([1.702, 0.5]),
    offset=st.sampled_from([1.0, -0.5]),
)  # fmt: skip
def test_activations(seed, dtype, name, shape, half, interleave, bias, limit, alpha, offset):
    """Every activation function (``te.functional.<name>``; ``clamped_swiglu`` with its limit,
    alpha and offset), gated ones in both layouts, or ``te.functional.bias_activation`` with a
    bias added first (its gradient a sum over rows)."""
    torch.manual_seed(seed)
    gated = name in _GLU_REF or name == "clamped_swiglu"
    if gated and interleave and half % interleave:
        interleave = None
    x = torch.randn(*shape, 2 * half).to(dtype).requires_grad_()
    b = torch.randn(2 * half).to(dtype).requires_grad_() if bias else None
    x_ref, b_ref = to_reference(x), to_reference(b)
    clamp = {"limit": limit, "alpha": alpha, "glu_linear_offset": offset}
    kw = clamp if name == "clamped_swiglu" else {}
    if bias:
        y = te.functional.bias_activation(x, b, name, interleave if gated else None, **kw)
    elif gated:
        y = getattr(te.functional, name)(x, glu_interleave_size=interleave, **kw)
    else:
        y = getattr(te.functional, name)(x)
    h = x_ref + b_ref if bias else x_ref
    y_ref = _gated(name, h, interleave, limit, alpha, offset) if gated else _ACT_REF[name](h)
    assert_close(y, y_ref, dtype, roundings=2 + bias)
    if y.numel():
        dy = torch.randn(y.shape).to(dtype)
        y.backward(dy)
        y_ref.backward(to_reference(dy))
        assert_close(x.grad, x_ref.grad, dtype, roundings=3 + bias)
        if bias:
            assert_close(b.grad, b_ref.grad, dtype, roundings=4, reduced=True)


@FUZZ
@given(seed=SEED, p=_precision(), bias=st.booleans())
def test_functional_linear(seed, p, bias):
    """``te.functional.linear`` with the recipe given as data (emulated FP8 on CPU)."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    kw = _recipe_kwargs(recipe)
    x = torch.randn(tokens, k).to(dtype).requires_grad_()
    w = torch.randn(n, k).to(dtype).requires_grad_()
    b = torch.randn(n).to(dtype).requires_grad_() if bias else None
    refs = to_reference((x, w, b))
    y = te.functional.linear(x, w, b, **kw)
    y_ref = tF.linear(*refs)
    _compare(recipe, y, y_ref, dtype, 2)


def _attention_ref(q, k, v, layout, mask, scale=None):
    """Softmax attention of ``[s, b, h, d]`` (sbhd) or ``[b, s, h, d]`` (bshd) heads, GQA
    (``k`` / ``v`` with fewer heads, each shared by consecutive query heads): ``[.., h * d]``."""
    if layout == "sbhd":
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    else:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if mask == "causal":
        seq = q.shape[2]
        scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
    out = scores.softmax(-1) @ v  # [b, h, s, d]
    out = out.permute(2, 0, 1, 3) if layout == "sbhd" else out.transpose(1, 2)
    return out.flatten(-2)


@FUZZ
@given(
    seed=SEED,
    dtype=DTYPES,
    seq=st.integers(1, 12),
    batch=st.integers(1, 3),
    groups=st.integers(1, 2),
    heads_per_group=st.integers(1, 2),
    head_dim=st.sampled_from([8, 16, 24]),
    mask=st.sampled_from(["causal", "no_mask"]),
    layout=st.sampled_from(["sbhd", "bshd"]),
    functional=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
)
def test_dot_product_attention(seed, dtype, seq, batch, groups, heads_per_group, head_dim, mask,
                               layout, functional, scale):  # fmt: skip
    """The module, or ``te.functional.dot_product_attention`` (with a ``softmax_scale``)."""
    torch.manual_seed(seed)
    heads = groups * heads_per_group
    shape = (seq, batch) if layout == "sbhd" else (batch, seq)
    q, k, v = (torch.randn(*shape, h, head_dim).to(dtype).requires_grad_()
               for h in (heads, groups, groups))  # fmt: skip
    refs = to_reference((q, k, v))
    if functional:
        y = te.functional.dot_product_attention(q, k, v, qkv_format=layout, attn_mask_type=mask,
                                                softmax_scale=scale)  # fmt: skip
    else:
        scale = None
        m = te.DotProductAttention(heads, head_dim, num_gqa_groups=groups, qkv_format=layout,
                                   attn_mask_type=mask)  # fmt: skip
        y = m(q, k, v)
    y_ref = _attention_ref(*refs, layout, mask, scale)
    assert_close(y, y_ref, dtype, roundings=4, reduced=True)
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    for t, r in zip((q, k, v), refs, strict=True):
        assert_close(t.grad, r.grad, dtype, roundings=6, reduced=True)


def _norm_ref(x, q, prefix, kind, zc, eps=1e-5, cond=None):
    """LayerNorm / RMSNorm with the gain (and bias) ``q[prefix + "weight"]`` (``"bias"``);
    appends its condition number over the rows to the list ``cond`` when given."""
    if cond is not None:
        cond.append(_norm_cond(x.detach(), kind))
    g = q[prefix + "weight"] + (1 if zc else 0)
    return _ln(x, g, q[prefix + "bias"], eps) if kind == "LayerNorm" else _rms(x, g, eps)


def _rope_ref(t, freqs, layout, interleaved):
    """``t [s, b, h, d]`` / ``[b, s, h, d]`` rotated by ``freqs [s2, 1, 1, d2]`` (positions from
    0)."""
    seq = t.shape[0] if layout == "sbhd" else t.shape[1]
    f = freqs[:seq].double()
    f = f if layout == "sbhd" else f.transpose(0, 1)
    d2 = f.shape[-1]
    rot = t[..., :d2]
    return torch.cat((rot * f.cos() + _rotate(rot, interleaved) * f.sin(), t[..., d2:]), -1)


def _mha_ref(q, x, c, pre="", freqs=None, cond=None):
    """``MultiheadAttention`` (self attention) from its own parameters ``q`` (names under
    ``pre``) and its configuration ``c``: ``(out, norm output or None)``."""
    ln_out = None
    if c["input_layernorm"]:
        name = pre + "layernorm_qkv."
        x = ln_out = _norm_ref(x, q, name + "layer_norm_", c["normalization"], c["zc"],
                               cond=cond)  # fmt: skip
    else:
        name = pre + "qkv."
    mixed = tF.linear(x, q[name + "weight"], q.get(name + "bias"))
    d, g, qpg = c["head_dim"], c["groups"], c["heads_per_group"]
    if c["fuse_qkv_params"] and c["qkv_weight_interleaved"]:  # [group][queries, key, value][d]
        blocks = mixed.unflatten(-1, (g, qpg + 2, d))
        qh, k, v = blocks[..., :qpg, :].flatten(-3, -2), blocks[..., qpg, :], blocks[..., -1, :]
    else:
        qh, k, v = (t.unflatten(-1, (-1, d)) for t in mixed.split([g * qpg * d, g * d, g * d], -1))
    if freqs is not None:
        qh, k = (_rope_ref(t, freqs, c["layout"], c["rotary_interleaved"]) for t in (qh, k))
    ctx = _attention_ref(qh, k, v, c["layout"], c["mask"])
    return tF.linear(ctx, q[pre + "proj.weight"], q.get(pre + "proj.bias")), ln_out


@st.composite
def _attention_config(draw, recipes=(None, *RECIPES)):
    """Sizes and options of a self-attention block: any head dim in high precision; under a
    recipe 16 and head counts whose projections are multiples of the recipe's block."""
    recipe = draw(st.sampled_from(recipes))
    c = {
        "recipe": recipe,
        "groups": draw(st.integers(1, 2)),
        "heads_per_group": draw(st.integers(1, 2)),
        "mask": draw(st.sampled_from(["causal", "no_mask"])),
        "layout": draw(st.sampled_from(["sbhd", "bshd"])),
        "normalization": draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
        "zc": draw(st.booleans()),
        "bias": draw(st.booleans()),
        "fuse_qkv_params": draw(st.booleans()),
        "qkv_weight_interleaved": draw(st.booleans()),
        "rotary": draw(st.booleans()),
        "rotary_interleaved": draw(st.booleans()),
    }
    if recipe is None:
        c |= {"dtype": draw(DTYPES), "head_dim": 2 * draw(st.integers(1, 4)),
              "hidden": draw(st.integers(4, 24)), "ffn": draw(st.integers(1, 24)),
              "batch": draw(st.integers(1, 2)), "seq": draw(st.integers(1, 6))}  # fmt: skip
    else:
        _, dim, rows = RECIPES[recipe]
        c["groups"] = max(c["groups"], dim // 16)
        batch = draw(st.integers(1, 2))
        c |= {"dtype": draw(st.sampled_from([torch.float32, torch.bfloat16])), "head_dim": 16,
              "hidden": dim * draw(st.integers(1, 2)), "ffn": dim * draw(st.integers(1, 2)),
              "batch": batch, "seq": max(rows, 16) // batch * draw(st.integers(1, 2))}  # fmt: skip
    return c


def _mha_kwargs(c):
    return {
        "kv_channels": c["head_dim"], "num_gqa_groups": c["groups"], "attention_dropout": 0.0,
        "attn_mask_type": c["mask"], "qkv_format": c["layout"], "bias": c["bias"],
        "normalization": c["normalization"], "zero_centered_gamma": c["zc"],
        "fuse_qkv_params": c["fuse_qkv_params"],
        "qkv_weight_interleaved": c["qkv_weight_interleaved"],
        "rotary_pos_interleaved": c["rotary_interleaved"], "params_dtype": c["dtype"],
    }  # fmt: skip


def _attention_input(c):
    shape = (c["seq"], c["batch"]) if c["layout"] == "sbhd" else (c["batch"], c["seq"])
    freqs = None
    if c["rotary"]:
        freqs = te.RotaryPositionEmbedding(c["head_dim"], interleaved=c["rotary_interleaved"])(
            c["seq"])  # fmt: skip
    return torch.randn(*shape, c["hidden"]), freqs


@FUZZ
@given(seed=SEED, c=_attention_config(), input_layernorm=st.booleans())
def test_multihead_attention(seed, c, input_layernorm):
    """``te.MultiheadAttention`` (self attention; GQA, masks, layouts, norms, fused or split QKV
    weights in both layouts, rotary embeddings in both layouts) under every recipe, against
    plain torch built from the module's own parameters."""
    torch.manual_seed(seed)
    c["input_layernorm"] = input_layernorm
    heads = c["groups"] * c["heads_per_group"]
    m = te.MultiheadAttention(c["hidden"], heads, input_layernorm=input_layernorm,
                              **_mha_kwargs(c))  # fmt: skip
    x, freqs = _attention_input(c)
    call = (lambda x: m(x, rotary_pos_emb=freqs)) if freqs is not None else None
    cond = [1.0]
    _check(m, lambda q, x: _mha_ref(q, x, c, freqs=freqs, cond=cond)[0], [x], c["dtype"],
           c["recipe"], roundings=lambda: 6 * math.ceil(max(cond)), call=call, gemms=2,
           sum_bound=False)  # fmt: skip


@_fuzz(3)
@given(seed=SEED, c=_attention_config(recipes=(None, "current", "delayed")),
       activation=st.sampled_from(["gelu", "relu", "swiglu"]),
       residual=st.sampled_from(["pre", "post_ln", "output_ln", "parallel"]))  # fmt: skip
def test_transformer_layer(seed, c, activation, residual):
    """``te.TransformerLayer`` (encoder) with each residual variant (pre-norm, residual after the
    norm, output norm, parallel attention and MLP), activations, and the attention options of
    :func:`test_multihead_attention`, high precision and per-tensor FP8, against plain torch
    built from its own parameters. Few cases under the "ci" profile (the heaviest module)."""
    torch.manual_seed(seed)
    heads = c["groups"] * c["heads_per_group"]
    post_ln, output_ln = residual == "post_ln", residual == "output_ln"
    c["input_layernorm"] = not output_ln
    kw = _mha_kwargs(c)
    kw.pop("attention_dropout")
    kw.pop("attn_mask_type")
    kw["attn_input_format"] = kw.pop("qkv_format")
    m = te.TransformerLayer(
        c["hidden"], c["ffn"], heads, hidden_dropout=0.0, attention_dropout=0.0,
        self_attn_mask_type=c["mask"], activation=activation,
        apply_residual_connection_post_layernorm=post_ln, output_layernorm=output_ln,
        parallel_attention_mlp=residual == "parallel", **kw,
    )  # fmt: skip
    x, freqs = _attention_input(c)

    cond = [1.0]

    def mlp(q, h):
        ln = _norm_ref(h, q, "layernorm_mlp.layer_norm_", c["normalization"], c["zc"], cond=cond)
        z = tF.linear(ln, q["layernorm_mlp.fc1_weight"], q.get("layernorm_mlp.fc1_bias"))
        z = _gated(activation, z) if activation in _GLU_REF else _MLP_ACT[activation](z)
        return tF.linear(z, q["layernorm_mlp.fc2_weight"], q.get("layernorm_mlp.fc2_bias")), ln

    def ref(q, x):  # (output, the magnitude of its terms)
        attn, ln1 = _mha_ref(q, x, c, "self_attention.", freqs, cond)
        if residual == "parallel":
            out = mlp(q, x)[0]
            return x + attn + out, x.abs() + attn.abs() + out.abs()
        res = ln1 if post_ln else x
        h = res + attn
        out, ln2 = mlp(q, h)
        terms = (ln2 if post_ln else h).abs() + out.abs() + (res.abs() + attn.abs())
        out = (ln2 if post_ln else h) + out
        if output_ln:
            return _norm_ref(out, q, "layernorm.", c["normalization"], c["zc"], cond=cond)
        return out, terms

    call = (lambda x: m(x, rotary_pos_emb=freqs)) if freqs is not None else None
    _check(m, ref, [x], c["dtype"], c["recipe"], roundings=lambda: 10 * math.ceil(max(cond)),
           call=call, gemms=3, sum_bound=False)  # fmt: skip


@FUZZ
@given(seed=SEED, p=_precision(max_features=32), activation=st.sampled_from(
       te.functional.MLP_ACTIVATIONS), normalization=st.sampled_from(["", "LayerNorm", "RMSNorm"]),
       zc=st.booleans(), bias=st.booleans(), out=st.integers(1, 2))  # fmt: skip
def test_functional_mlp(seed, p, activation, normalization, zc, bias, out):
    """``te.functional.mlp`` (norm prologue, every activation) with the recipe as data."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, hidden, ffn = p
    gated = activation in te.functional.GATED_ACTIVATIONS
    n_out = out * (RECIPES[recipe][1] if recipe else 8)
    shapes = {"fc1_weight": ((1 + gated) * ffn, hidden), "fc2_weight": (n_out, ffn)}
    if bias:
        shapes |= {"fc1_bias": ((1 + gated) * ffn,), "fc2_bias": (n_out,)}
    if normalization:
        shapes |= {"norm_weight": (hidden,)}
        shapes |= {"norm_bias": (hidden,)} if normalization == "LayerNorm" else {}
    kw = _recipe_kwargs(recipe) | {"normalization": normalization, "zero_centered_gamma": zc}
    m = _Fn(lambda x, **t: te.functional.mlp(x, t["fc1_weight"], t.get("fc1_bias"),
                                             t["fc2_weight"], t.get("fc2_bias"), activation,
                                             **kw, **{k: v for k, v in t.items()
                                                      if k.startswith("norm")}),
            dtype, **shapes)  # fmt: skip

    def ref(q, x, limit=7.0):
        if normalization:
            g = q["norm_weight"] + (1 if zc else 0)
            x = _ln(x, g, q["norm_bias"]) if normalization == "LayerNorm" else _rms(x, g)
        h = tF.linear(x, q["fc1_weight"], q.get("fc1_bias"))
        h = _gated(activation, h, limit=limit) if gated else _ACT_REF[activation](h)
        return tF.linear(h, q["fc2_weight"], q.get("fc2_bias"))

    # A norm's backward removes the gradient's mean and x_hat components, which the quantisation
    # error does not follow: the input gradient's relative error grows by up to a GEMM's.
    _check(m, ref, [torch.randn(tokens, hidden)], dtype, recipe, roundings=5,
           gemms=3 if normalization else 2, autocast=False,
           magnitude_ref=lambda q, x: ref(q, x, limit=math.inf))  # fmt: skip


@FUZZ
@given(seed=SEED, p=_precision(), groups=st.integers(1, 3), bias=st.booleans(),
       as_tensor=st.booleans(), data=st.data())  # fmt: skip
def test_functional_grouped_linear(seed, p, groups, bias, as_tensor, data):
    """``te.functional.grouped_linear`` (``[G, N, K]`` weight) with the recipe as data;
    ``m_splits`` a list or ``as_splits_tensor``'s tensor."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    splits = data.draw(_splits(groups, tokens, 16 if recipe == "nvfp4" else 1))
    shapes = {"weight": (groups, n, k)} | ({"bias": (groups, n)} if bias else {})
    kw = _recipe_kwargs(recipe)
    if recipe == "nvfp4":  # the grouped GEMM's NVFP4: no Hadamard transform, no SR (data only)
        kw["recipe"] = "nvfp4"
    m = _Fn(lambda x, s, **t: te.functional.grouped_linear(x, s, t["weight"], t.get("bias"), **kw),
            dtype, **shapes)  # fmt: skip

    def ref(q, x, _):
        bs = q["bias"].unbind() if bias else [None] * groups
        return _grouped_ref(x, splits, q["weight"].unbind(), bs)

    m_splits = te.functional.as_splits_tensor(splits) if as_tensor else splits
    _check(m, ref, [torch.randn(tokens, k), m_splits], dtype, recipe, roundings=3, autocast=False)


# Rotary embeddings -----------------------------------------------------------------------------


def _rotate(x, interleaved):
    if interleaved:  # (x0, x1) -> (-x1, x0) per pair
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


@FUZZ
@given(seed=SEED, dtype=DTYPES, fmt=st.sampled_from(["sbhd", "bshd", "thd"]),
       interleaved=st.booleans(), fused=st.booleans(), seq=st.integers(1, 12),
       batch=st.integers(1, 3), heads=st.integers(1, 3), half=st.integers(1, 8),
       extra=st.integers(0, 5), percent=st.sampled_from([1.0, 0.5]), offset=st.integers(0, 6),
       base=st.sampled_from([10000.0, 500.0]), interp=st.sampled_from([None, (2.0, 4), (0.5, 64)]),
       data=st.data())  # fmt: skip
def test_rotary(seed, dtype, fmt, interleaved, fused, seq, batch, heads, half, extra, percent,
                offset, base, interp, data):  # fmt: skip
    """``te.RotaryPositionEmbedding`` (``te.functional.rotary_frequencies``: base, partial
    rotation, offset, position interpolation, both frequency layouts) and
    ``te.apply_rotary_pos_emb`` in every tensor format (``thd``: random packed sequences, tokens
    past the last one unrotated), fused or not, against ``x cos f + rotate(x) sin f``."""
    torch.manual_seed(seed)
    dim = 2 * half if percent == 1.0 else 4 * half
    factor, pretrained = interp or (None, None)
    rope = te.RotaryPositionEmbedding(dim, rotary_percent=percent, rotary_base=base,
                                      interleaved=interleaved, seq_len_interpolation_factor=factor,
                                      pretrained_max_position_embeddings=pretrained)  # fmt: skip
    length = seq + data.draw(st.integers(0, 3), label="extra positions")
    freqs = rope(length, offset)
    pos = torch.arange(length, dtype=torch.float64) + offset
    if interp is not None:
        pos = pos / (length / pretrained if length > pretrained * factor else factor)
    angles = pos[:, None] * rope.inv_freq.double()[None, :]
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    assert freqs.shape == (length, 1, 1, 2 * (dim * percent // 2)) and freqs.dtype == torch.float32
    assert_close(freqs.squeeze(1).squeeze(1), angles, torch.float32, roundings=2)

    head_dim = dim + extra
    if fmt == "thd":
        lengths = data.draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
        bounds = [0, *itertools.accumulate(lengths)]
        cu = torch.tensor(bounds, dtype=torch.int32)
        total = bounds[-1] + data.draw(st.integers(0, 2), label="tokens in no sequence")
        shape, positions = (total, heads, head_dim), torch.full((total,), -1)
        for a, b in itertools.pairwise(bounds):
            positions[a:b] = torch.arange(b - a)
    else:
        cu = None
        shape = (seq, batch, heads, head_dim) if fmt == "sbhd" else (batch, seq, heads, head_dim)
        positions = torch.arange(seq)
    x = torch.randn(shape).to(dtype).requires_grad_()
    f_in = freqs.detach().requires_grad_(not fused)
    y = te.apply_rotary_pos_emb(x, f_in, fmt, interleaved=interleaved, fused=fused, cu_seqlens=cu)
    x_ref, f_ref = to_reference(x), to_reference(f_in)
    f_tok = f_ref.squeeze(1).squeeze(1)[positions.clamp(min=0)]  # [s or t, d2]
    if fmt == "sbhd":
        f_tok = f_tok[:, None, None]
    elif fmt == "bshd":
        f_tok = f_tok[None, :, None]
    else:
        f_tok = f_tok[:, None] * (positions >= 0)[:, None, None]  # unrotated: angle 0
    d2 = f_tok.shape[-1]
    rot = x_ref[..., :d2]
    y_ref = torch.cat((rot * f_tok.cos() + _rotate(rot, interleaved) * f_tok.sin(),
                       x_ref[..., d2:]), -1)  # fmt: skip
    assert_close(y, y_ref, dtype, roundings=2)
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    assert_close(x.grad, x_ref.grad, dtype, roundings=2)
    if not fused:  # autograd differentiates freqs too: a sum over tokens and heads
        assert_close(f_in.grad, f_ref.grad, dtype, roundings=4, reduced=True)


# MoE routing -----------------------------------------------------------------------------------


def _route_ref(routing_map, map_type):
    """``(token, slot)`` of each permuted row in order: experts ascending, tokens in order (for
    indices the stable sort of the flattened ``[T * K]`` ids)."""
    if map_type == "mask":
        expert, token = routing_map.t().nonzero(as_tuple=True)
        return token, expert
    order = torch.argsort(routing_map.flatten(), stable=True)
    k = routing_map.shape[1]
    return order // k, order % k


def _permute_ref(x, token, keep, rows, weight=None):
    """``rows`` rows: ``x[token]`` (times ``weight``) for the first ``keep``, zeros after."""
    moved = x.index_select(0, token[:keep])
    if weight is not None:
        moved = moved * weight[:keep, None]
    return torch.cat((moved, x.new_zeros(rows - keep, x.shape[1])))


@FUZZ
@given(seed=SEED, dtype=DTYPES, tokens=st.integers(0, 12), experts=st.integers(1, 6),
       topk=st.integers(1, 3), hidden=st.integers(1, 24),
       kind=st.sampled_from(["mask", "index", "mask_probs"]), merging=st.booleans(),
       data=st.data())  # fmt: skip
def test_moe_permute_unpermute(seed, dtype, tokens, experts, topk, hidden, kind, merging, data):
    """``te.moe_permute`` (mask or index maps) / ``te.moe_permute_with_probs`` and
    ``te.moe_unpermute`` (with or without merging probabilities) for random routings, dropped
    (``num_out_tokens`` below the routed count) and padded (above it, or probability-0 slots)
    rows, against index_select / index_add references; gradients of the tokens and of the
    probabilities."""
    torch.manual_seed(seed)
    map_type = "index" if kind == "index" else "mask"
    if map_type == "mask":
        routing_map = torch.rand(tokens, experts) < data.draw(st.floats(0, 1), label="density")
        slots = experts
    else:
        routing_map = torch.randint(0, experts, (tokens, topk))  # repeats allowed: each a row
        slots = topk
    token, slot = _route_ref(routing_map, map_type)
    routed = len(token)
    # For indices a num_out_tokens that is not positive means all T * K rows.
    lowest = 0 if map_type == "mask" else 1
    if map_type == "mask" or (routed and data.draw(st.booleans(), label="explicit num_out")):
        rows = data.draw(st.integers(lowest, min(routed + 2, tokens * slots)), label="num_out")
        num_out = rows
    else:
        rows, num_out = routed, data.draw(st.sampled_from([-1, 0]), label="num_out_tokens")
    keep = min(rows, routed)
    x = torch.randn(tokens, hidden).to(dtype).requires_grad_()
    x_ref = to_reference(x)
    if kind == "mask_probs":
        probs = torch.rand(tokens, experts).to(dtype)
        probs[torch.rand(tokens, experts) < 0.2] = 0  # padding slots
        probs.requires_grad_()
        y, y_probs, row_id_map = te.moe_permute_with_probs(x, probs, routing_map, num_out)
        p_ref = to_reference(probs)
        p_moved = p_ref[token, slot]
        y_ref = _permute_ref(x_ref, token, keep, rows, (p_moved != 0).double())
        probs_ref = torch.cat((p_moved[:keep], p_moved.new_zeros(rows - keep)))
        assert_close(y_probs, probs_ref, dtype)
    else:
        y, row_id_map = te.moe_permute(x, routing_map.int() if map_type == "index" else
                                       routing_map, num_out, map_type=map_type)  # fmt: skip
        y_ref = _permute_ref(x_ref, token, keep, rows)
    assert torch.equal(y.detach().double(), y_ref.detach())  # a permutation: exact
    dy = torch.randn(y.shape).to(dtype)
    loss, loss_ref = (y * dy).sum(), (y_ref * to_reference(dy)).sum()
    if kind == "mask_probs":
        dp = torch.randn(y_probs.shape).to(dtype)
        loss, loss_ref = loss + (y_probs * dp).sum(), loss_ref + (probs_ref * dp.double()).sum()
    loss.backward()
    loss_ref.backward()
    assert_close(x.grad, x_ref.grad, dtype, roundings=topk + 1)
    if kind == "mask_probs":
        assert_close(probs.grad, p_ref.grad, dtype)

    # Unpermute other rows with the same map: out[t] = sum_s w[t, s] rows[row of (t, s)].
    z = torch.randn(rows, hidden).to(dtype).requires_grad_()
    w = torch.rand(tokens, slots).to(dtype).requires_grad_() if merging else None
    z_ref, w_ref = to_reference(z), to_reference(w)
    out = te.moe_unpermute(z, row_id_map, merging_probs=w, map_type=map_type,
                           restore_shape=(tokens, hidden))  # fmt: skip
    weight = w_ref[token[:keep], slot[:keep]] if merging else None
    moved = z_ref[:keep] * (weight[:, None] if merging else 1)
    out_ref = z_ref.new_zeros(tokens, hidden).index_add(0, token[:keep], moved)
    # fp32 sums rounded once; with repeated rows a sum of up to topk terms
    assert_close(out, out_ref, dtype, roundings=2, reduced=True)
    dout = torch.randn(out.shape).to(dtype)
    out.backward(dout)
    out_ref.backward(to_reference(dout))
    assert_close(z.grad, z_ref.grad, dtype, roundings=2)
    if merging:
        assert_close(w.grad, w_ref.grad, dtype, roundings=2, reduced=True)


@FUZZ
@given(seed=SEED, dtype=DTYPES, chunks=st.integers(1, 5), hidden=st.integers(1, 16),
       with_probs=st.booleans(), data=st.data())  # fmt: skip
def test_moe_sort_chunks(seed, dtype, chunks, hidden, with_probs, data):
    """``te.moe_sort_chunks_by_index`` (``_with_probs``): random chunk sizes (empty ones too),
    a random order, rows past the chunks in place; exact, forward and backward."""
    torch.manual_seed(seed)
    sizes = data.draw(st.lists(st.integers(0, 4), min_size=chunks, max_size=chunks))
    order = data.draw(st.permutations(range(chunks)))
    rows = sum(sizes) + data.draw(st.integers(0, 3), label="rows past the chunks")
    index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
    split_sizes, sorted_index = (torch.tensor(v, dtype=index_dtype) for v in (sizes, order))
    x = torch.randn(rows, hidden).to(dtype).requires_grad_()
    x_ref = to_reference(x)
    pieces = x_ref[: sum(sizes)].split(sizes)
    src = torch.arange(rows)
    src_pieces = src[: sum(sizes)].split(sizes)
    src_order = torch.cat([*(src_pieces[i] for i in order), src[sum(sizes) :]])
    y_ref = torch.cat([*(pieces[i] for i in order), x_ref[sum(sizes) :]])
    if with_probs:
        probs = torch.rand(rows).to(dtype).requires_grad_()
        y, y_probs = te.moe_sort_chunks_by_index_with_probs(x, probs, split_sizes, sorted_index)
        assert torch.equal(y_probs, probs.detach()[src_order])
        if rows == 0:
            return
        dp = torch.randn(rows).to(dtype)
        y_probs.backward(dp, retain_graph=True)
        expected = torch.zeros(rows, dtype=dtype).index_add(0, src_order, dp)
        assert torch.equal(probs.grad, expected)
    else:
        y = te.moe_sort_chunks_by_index(x, split_sizes, sorted_index)
    assert torch.equal(y.detach().double(), y_ref.detach())
    if rows == 0:
        return
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    assert torch.equal(x.grad.double(), x_ref.grad)


# Quantisation ----------------------------------------------------------------------------------

# The largest E2M1 rounding error relative to the value (half of 0.5 at 1, of 2 at 4), and an
# E4M3 block scale's own rounding (a block's amax can land just past 6 and clip).
_NVFP4_REL = 0.25 + 2**-4


def _quantization_bound(x, fmt, amax, mxfp8=False):
    """Per-element bound of ``|dequantize(quantize(x)) - x|`` (float64 ``x``) for elements of
    ``fmt`` (an FP8 dtype, or "nvfp4") and a scale derived from at most ``amax``: half an ulp
    relative to the value, and for values the scale maps below the normal range the absolute
    half spacing of the subnormals (a block's amax lands in ``[max / 2, max]``). ``mxfp8``: the
    OCP spec's floor rule for the E8M0 exponent maps a block's amax into ``[max / 2, 8/7 max)``
    and saturates the values past ``max``: up to 1/8 low (``functional/quantize_mx.py``)."""
    if fmt == "nvfp4":
        return _NVFP4_REL * x.abs() + 0.25 * amax / 6 * (1 + 2**-3)
    finfo = torch.finfo(fmt)
    rel = 1 / 8 if mxfp8 else finfo.eps / 2  # half an ulp: eps / 2 (2^-4 E4M3, 2^-3 E5M2)
    subnormal = finfo.smallest_normal * finfo.eps
    return rel * x.abs() + subnormal * amax / finfo.max


def _within(actual, expected, bound):
    err = (actual.detach().double() - expected).abs()
    bad = (err > bound).nonzero()
    assert not len(bad), (
        f"{len(bad)} elements off by more than the bound, first at {bad[0].tolist()}: "
        f"{actual[tuple(bad[0])].item()} vs {expected[tuple(bad[0])].item()} "
        f"(bound {bound[tuple(bad[0])].item():.3g})"
    )


def _recipe_format(recipe, role):
    fmt = RECIPES[recipe][0].fp8_format
    return fmt.bwd_dtype if role == "grad" else fmt.fwd_dtype


def _data_format(q):
    return "nvfp4" if q.kind == "nvfp4" else q.data.dtype


@FUZZ
@given(seed=SEED, recipe=st.sampled_from(sorted(RECIPES)), role=st.sampled_from(["input", "weight",
       "grad"]), columnwise=st.booleans(), rows=st.integers(1, 40), cols=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), spread=st.booleans())  # fmt: skip
def test_quantize_roundtrip(seed, recipe, role, columnwise, rows, cols, dtype, spread):
    """``te.quantize`` / ``te.dequantize`` per recipe and operand role, rowwise and columnwise,
    any shape (NVFP4: even sizes), values of one scale or spread over decades: every element
    within half an ulp of its format (or the subnormal spacing) of the input. The functional
    quantisers give the same values: ``te.functional.fake_quantize``, ``quantize_mxfp8`` /
    ``dequantize_mxfp8``, ``quantize_nvfp4`` / ``dequantize_nvfp4``."""
    torch.manual_seed(seed)
    r = QUANTIZE_NVFP4 if recipe == "nvfp4" else RECIPES[recipe][0]
    if recipe == "nvfp4":
        rows, cols = 2 * rows, 2 * cols
    x = torch.randn(rows, cols)
    if spread:
        x = x * torch.logspace(-3, 3, cols)
    x = x.to(dtype)
    x64 = x.double()
    amax = x64.abs().max()
    scale = None
    if recipe == "delayed":  # the scale a calibrated history holds
        scale = (torch.finfo(_recipe_format(recipe, role)).max / amax.float()).reshape(1)
    q = te.quantize(x, r, role=role, scale=scale, columnwise=columnwise)
    y = te.dequantize(q, torch.float32)
    bound = _quantization_bound(x64, _data_format(q), amax, mxfp8=q.kind == "mxfp8")
    assert y.shape == x.shape
    _within(y, x64, bound)
    if columnwise:
        y_t = te.dequantize(q, torch.float32, columnwise=True)
        assert y_t.shape == (cols, rows)
        _within(y_t, x64.t(), bound.t())
    if recipe == "current":
        fake = te.functional.fake_quantize(x, "current", fp8_dtype=q.data.dtype)
        assert torch.equal(fake, te.dequantize(q, dtype))
    elif recipe == "block":
        fake = te.functional.fake_quantize(x, "block", block_rows=q.block_rows,
                                           fp8_dtype=q.data.dtype, power_2_scale=True)  # fmt: skip
        assert torch.equal(fake, te.dequantize(q, dtype))
    elif recipe == "mxfp8":
        data, s, data_t, s_t = te.functional.quantize_mxfp8(x, q.data.dtype)
        assert torch.equal(te.functional.dequantize_mxfp8(data, s, torch.float32), y)
        y_t = te.functional.dequantize_mxfp8(data_t, s_t, torch.float32)  # blocks down columns
        if columnwise:
            assert torch.equal(y_t, te.dequantize(q, torch.float32, columnwise=True))
        _within(y_t, x64.t(), bound.t())
        fake = te.functional.fake_quantize(x, "mxfp8", fp8_dtype=q.data.dtype)
        assert torch.equal(fake, y.to(dtype))
    elif recipe == "nvfp4":
        data, s, g, data_t, s_t = te.functional.quantize_nvfp4(x)
        for d, sc, ref in ((data, s, x64), (data_t, s_t, x64.t())):
            out = te.functional.dequantize_nvfp4(d, sc, g, torch.float32).double()
            assert ((out - ref).abs() <= _quantization_bound(ref, "nvfp4", amax)).all()


@FUZZ
@given(seed=SEED, recipe=st.sampled_from(sorted(RECIPES)), forward=st.booleans(),
       backward=st.booleans(), tokens=st.integers(1, 2), width=st.integers(1, 2))  # fmt: skip
def test_ops_quantize(seed, recipe, forward, backward, tokens, width):
    """``te.ops.Quantize(forward, backward)`` under each recipe: the recipe's input quantiser's
    values forward, its gradient quantiser's backward (straight through when off)."""
    torch.manual_seed(seed)
    _, dim, rows = RECIPES[recipe]
    x = torch.randn(tokens * max(rows, 16), width * dim).requires_grad_()
    m = te.ops.Sequential(te.ops.Quantize(forward=forward, backward=backward))
    with te.autocast(recipe=QUANTIZE_NVFP4 if recipe == "nvfp4" else RECIPES[recipe][0]):
        y = m(x)
    dy = torch.randn(y.shape)
    y.backward(dy)
    for out, ref, on in ((y, x, forward), (x.grad, dy, backward)):
        ref = ref.detach().double()
        if not on:
            assert torch.equal(out.double(), ref)
            continue
        role = "grad" if out is x.grad else "input"
        fmt = "nvfp4" if recipe == "nvfp4" else _recipe_format(recipe, role)
        _within(out, ref, _quantization_bound(ref, fmt, ref.abs().max(), recipe == "mxfp8"))


@FUZZ
@given(seed=SEED, length=st.integers(1, 6), slots=st.integers(1, 3), margin=st.integers(0, 3),
       algo=st.sampled_from(["max", "most_recent"]),
       special=st.sampled_from([None, 0.0, math.inf, math.nan]))  # fmt: skip
def test_delayed_scaling_update(seed, length, slots, margin, algo, special):
    """``te.functional.delayed_scaling_update`` (in place): the history rolled with the last
    amaxes in row 0, the scale ``fp8_max / (amax * 2^margin)`` from its max or its newest row,
    kept where that amax is 0 or not finite."""
    torch.manual_seed(seed)
    history = torch.rand(length, slots) * 10
    scale = torch.rand(slots) + 0.5
    amax = torch.rand(slots) * 10
    if special is not None:
        amax[0] = special
        if algo == "max":
            history[:, 0] = special if special != special or special == math.inf else 0.0
    fp8_max = [448.0, 448.0, 57344.0][:slots]
    expected_history = torch.cat((amax[None], history[:-1])).double()
    window = expected_history.amax(0) if algo == "max" else expected_history[0]
    new = torch.tensor(fp8_max, dtype=torch.float64) / (window * 2.0**margin)
    ok = (window > 0) & window.isfinite()
    expected_scale = torch.where(ok, new, scale.double())
    te.functional.delayed_scaling_update(history, scale, amax, fp8_max, margin, algo)
    torch.testing.assert_close(history.double(), expected_history, equal_nan=True, rtol=0, atol=0)
    assert_close(scale, expected_scale, torch.float32)


# Coverage: every public module and function is fuzzed above or exempt with a reason -----------

_OPS_CHAIN = "test_ops_sequential"
FUZZED = {
    "te.DotProductAttention": "test_dot_product_attention",
    "te.Fp8Padding": "test_fp8_padding",
    "te.Fp8Unpadding": "test_fp8_padding",
    "te.GroupedLinear": "test_grouped_linear",
    "te.GroupedMLP": "test_grouped_mlp",
    "te.LayerNorm": "test_norms",
    "te.LayerNormLinear": "test_layernorm_linear",
    "te.LayerNormMLP": "test_layernorm_mlp",
    "te.Linear": "test_linear",
    "te.MultiheadAttention": "test_multihead_attention",
    "te.RMSNorm": "test_norms",
    "te.RotaryPositionEmbedding": "test_rotary",
    "te.TransformerLayer": "test_transformer_layer",
    "te.apply_rotary_pos_emb": "test_rotary",
    "te.autocast": "test_linear",  # every module test's recipe cases run inside it
    "te.checkpoint": "test_layernorm_mlp",
    "te.deinterleave_glu_tensor": "test_glu_interleave",
    "te.interleave_glu_tensor": "test_glu_interleave",
    "te.quantize": "test_quantize_roundtrip",
    "te.dequantize": "test_quantize_roundtrip",
    "te.moe_permute": "test_moe_permute_unpermute",
    "te.moe_permute_with_probs": "test_moe_permute_unpermute",
    "te.moe_unpermute": "test_moe_permute_unpermute",
    "te.moe_sort_chunks_by_index": "test_moe_sort_chunks",
    "te.moe_sort_chunks_by_index_with_probs": "test_moe_sort_chunks",
    "te.functional.as_splits_tensor": "test_functional_grouped_linear",
    "te.functional.bias_activation": "test_activations",
    "te.functional.branch_rmsnorm": "test_norms",
    "te.functional.clamped_swiglu": "test_activations",
    "te.functional.delayed_scaling_update": "test_delayed_scaling_update",
    "te.functional.dequantize_mxfp8": "test_quantize_roundtrip",
    "te.functional.dequantize_nvfp4": "test_quantize_roundtrip",
    "te.functional.dot_product_attention": "test_dot_product_attention",
    "te.functional.dropout": "test_dropout",
    "te.functional.fake_quantize": "test_quantize_roundtrip",
    **{f"te.functional.{n}": "test_activations" for n in [*_ACT_REF, *_GLU_REF]},
    "te.functional.grouped_linear": "test_functional_grouped_linear",
    "te.functional.l2normalization": "test_norms",
    "te.functional.layernorm": "test_norms",
    "te.functional.linear": "test_functional_linear",
    "te.functional.mlp": "test_functional_mlp",
    "te.functional.quantize_mxfp8": "test_quantize_roundtrip",
    "te.functional.quantize_nvfp4": "test_quantize_roundtrip",
    "te.functional.rmsnorm": "test_norms",
    "te.functional.rotary_frequencies": "test_rotary",  # RotaryPositionEmbedding's forward
    **{
        f"te.ops.{n}": _OPS_CHAIN
        for n in [
            "BasicLinear",
            "Linear",
            "Bias",
            *_OPS_ACT,
            *_OPS_GLU,
            *_OPS_SCALED_GLU,
            "LayerNorm",
            "RMSNorm",
            "L2Normalization",
            "ConstantScale",
            "Identity",
            "Reshape",
            "AddExtraInput",
            "MakeExtraOutput",
            "GroupedLinear",
            "Sequential",
            "ForwardLinearBiasActivation",
            "ForwardLinearBiasAdd",
            "ForwardLinearScaleAdd",
            "BackwardLinearAdd",
            "BackwardActivationBias",
            "BackwardAddRMSNorm",
        ]
    },
    "te.ops.Dropout": "test_dropout",
    "te.ops.Quantize": "test_ops_quantize",
}
_UTILITY = "no numeric output to compare with a reference"
EXEMPT = {
    "te.fp8_autocast": "TE's older name of te.autocast (the same context manager)",
    "te.quantized_model_init": "context manager of FP8 primary weights, an optimizer-side "
    "state machine (tests/modules/test_fp8_primary_weights.py)",
    "te.fp8_model_init": "TE's older name of te.quantized_model_init",
    "te.FP8MasterWeights": "optimizer-side holder of the FP8 primary weights' masters "
    "(tests/modules/test_fp8_primary_weights.py)",
    "te.make_graphed_callables": "CUDA graph capture: needs a GPU "
    "(tests/quantization/test_graph.py)",
    "te.non_finite_amaxes": "a diagnostic over the FP8 state (tests/test_long_run.py, "
    "tests/modules/test_fp8_linear_module.py)",
    "te.bulk_allocate": "allocation: " + _UTILITY,
    "te.list_ops": "the op registry: " + _UTILITY,
    "te.set_eager_fast_path": "a switch: " + _UTILITY,
    "te.eager_fast_path_enabled": "a switch: " + _UTILITY,
    "te.get_device_compute_capability": "a device query: " + _UTILITY,
    **{
        f"te.{n}": "a device query: " + _UTILITY
        for n in [
            "is_bf16_available",
            "is_fp8_available",
            "is_fp8_block_scaling_available",
            "is_mxfp8_available",
            "is_nvfp4_available",
        ]
    },
    "te.functional.blockwise_supported": "a predicate on shapes: " + _UTILITY,
    "te.functional.linear_ref": "the reference math of te.functional.linear (registry-checked)",
    "te.functional.quantize_weight": "the GEMM family's private operand layout (five tensors) "
    "for kept FP8 weights; its values reach the GEMMs fuzzed above",
    "te.functional.quantize_grouped_weight": "the grouped GEMM's operand layout for kept FP8 "
    "weights; bit-equal to the per-call cast in tests/modules/test_fp8_weight_cache.py",
    **{
        f"te.ops.{n}": "process-group collective: tests/distributed (the identity without a group)"
        for n in ["AllGather", "AllReduce", "ReduceScatter"]
    },
    **{
        f"te.ops.{n}": "base class of user ops: " + _UTILITY
        for n in ["BasicOperation", "FusedOperation", "FusibleOperation", "OperationContext"]
    },
    **{
        f"te.ops.{n}": "fusion registration: " + _UTILITY
        for n in [
            "register_forward_fusion",
            "register_backward_fusion",
            "register_forward_backward_fusion",
        ]
    },
}


def _public_callables():
    """The public modules, functions and classes: ``te.__all__`` (subpackages and constants
    aside), ``te.functional.__all__`` (less the top level's), ``te.ops.__all__``."""
    import inspect

    names = {f"te.{n}" for n in te.__all__
             if callable(getattr(te, n)) and not inspect.ismodule(getattr(te, n))}  # fmt: skip
    top = {id(getattr(te, n)) for n in te.__all__}
    F = te.functional
    names |= {f"te.functional.{n}" for n in F.__all__
              if callable(getattr(F, n)) and id(getattr(F, n)) not in top}  # fmt: skip
    names |= {f"te.ops.{n}" for n in te.ops.__all__ if callable(getattr(te.ops, n))}
    return names


def test_every_public_callable_is_fuzzed():
    """A new public module or function fails here until it has a fuzz test (``FUZZED``) or a
    reason not to (``EXEMPT``); every named test exists, and the motifs of the op chains do
    select the fused ops they stand for."""
    public = _public_callables()
    assert public - set(FUZZED) - set(EXEMPT) == set(), "fuzz these, or exempt them with a reason"
    assert set(FUZZED) & set(EXEMPT) == set()
    assert set(FUZZED) | set(EXEMPT) <= public, "stale names"
    assert all(callable(globals().get(t)) for t in FUZZED.values())
    fused = set()
    for motif in _FUSION_MOTIFS:
        steps = [(k.rstrip("?").replace("act", "GELU"), {"features": 4, "bias": True,
                  "zc": False, "interleave": None, "scale": 2.0, "groups": 1, "flat": True})
                 for k in motif]  # fmt: skip
        ops = _build_chain(steps, 4, [4], torch.float32, None)[0]
        fused |= {name for name, _ in te.ops.Sequential(*ops).fusions()}
    assert fused == {
        n.removeprefix("te.ops.")
        for n, t in FUZZED.items()
        if t == _OPS_CHAIN and n.startswith(("te.ops.Forward", "te.ops.Backward"))
    }
