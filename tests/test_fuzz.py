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
GROUPED_NVFP4 = R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True)


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


def _randomize(module, dtype):
    """Random parameters (normal; norm weights around 1) in ``dtype``, and their float64
    references."""
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.5 + ("norm" in n or (n == "weight"
                    and p.dim() == 1)))  # fmt: skip
    return {n: to_reference(p) for n, p in module.named_parameters()}


def _compare(recipe, actual, expected, dtype, roundings, gemms=1):
    if recipe is None:
        assert_close(actual, expected, dtype, roundings=roundings, reduced=True)
    else:
        assert_close_quantized(actual, expected, recipe, gemms)


def _check(module, ref, inputs, dtype, recipe=None, roundings=2, call=None, gemms=1,
           grouped=False, sum_bound=True, autocast=True):  # fmt: skip
    """``module(*inputs)`` against ``ref(ref_params, *ref_inputs)``: output, input gradient and
    parameter gradients. ``gemms``: quantised GEMMs in a row (the recipe's error bound);
    ``grouped``: the recipe variant of the grouped GEMM (``GROUPED_NVFP4``); ``sum_bound=False``
    for a softmax in the chain (no magnitude reference: ``reduced`` tolerances, two roundings
    more). ``autocast=False``: the call takes the recipe as data, no autocast region.

    Gradients are sums over tokens (or features) of rounded terms: in high precision their
    tolerance scales with the sum of the terms' magnitudes, the reference's gradients evaluated
    on the absolute values of the inputs, parameters and incoming gradient."""
    params = _randomize(module, dtype)
    x = inputs[0].to(dtype).requires_grad_()
    x_ref = to_reference(x)
    with _autocast(recipe if autocast else None, grouped):
        y = (call or module)(x, *inputs[1:])
    y_ref = ref(params, x_ref, *inputs[1:])
    assert y.shape == y_ref.shape and y.dtype == dtype
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
        for actual, expected in grads:
            assert_close_quantized(actual, expected, recipe, gemms + 1)
        return
    if not sum_bound:  # softmax: no monotone magnitude bound; a looser sum tolerance
        for actual, expected in grads:
            assert_close(actual, expected, dtype, roundings=roundings + 2, reduced=True)
        return
    abs_params = {n: p.detach().abs().requires_grad_() for n, p in params.items()}
    abs_x = x_ref.detach().abs().requires_grad_()
    ref(abs_params, abs_x, *inputs[1:]).backward(to_reference(dy).abs())
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
    if pieces and data.draw(st.booleans(), label="sized"):
        cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=pieces - 1,
                                         max_size=pieces - 1), label="cuts"))  # fmt: skip
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
@given(seed=SEED, p=_precision(), activation=st.sampled_from(sorted(_MLP_ACT)))
def test_layernorm_mlp(seed, p, activation):
    torch.manual_seed(seed)
    recipe, dtype, tokens, hidden, ffn = p
    m = te.LayerNormMLP(hidden, ffn, activation=activation, params_dtype=dtype)

    def ref(q, x):
        h = tF.linear(_ln(x, q["layer_norm_weight"], q["layer_norm_bias"]), q["fc1_weight"],
                      q["fc1_bias"])  # fmt: skip
        return tF.linear(_MLP_ACT[activation](h), q["fc2_weight"], q["fc2_bias"])

    _check(m, ref, [torch.randn(tokens, hidden)], dtype, recipe, roundings=4, gemms=2)


@st.composite
def _splits(draw, groups, tokens):
    cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=groups - 1, max_size=groups - 1)))
    bounds = [0, *cuts, tokens]
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
    splits = data.draw(_splits(groups, tokens))
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
    splits = data.draw(_splits(groups, tokens))
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


@FUZZ
@given(seed=SEED,
    dtype=DTYPES, rms=st.booleans(), zc=st.booleans(),
    shape=st.lists(st.integers(0, 6), max_size=2), hidden=st.integers(1, 80),
    eps=st.sampled_from([1e-5, 1e-3, 0.5]),
)  # fmt: skip
def test_norms(seed, dtype, rms, zc, shape, hidden, eps):
    torch.manual_seed(seed)
    cls = te.RMSNorm if rms else te.LayerNorm
    m = cls(hidden, eps, zero_centered_gamma=zc, params_dtype=dtype)

    def ref(q, x):
        g = q["weight"] + (1 if zc else 0)
        return _rms(x, g, eps) if rms else _ln(x, g, q["bias"], eps)

    x = torch.randn(*shape, hidden).to(dtype)
    # A row whose values nearly agree has a tiny variance: its 1 / sigma amplifies the input's
    # roundoff (the problem's condition number, max |x| / sigma), in any implementation.
    x64 = x.double()
    centered = x64 if rms else x64 - x64.mean(-1, keepdim=True)
    rsigma = torch.rsqrt(centered.square().mean(-1) + eps)
    cond = (x64.abs().amax(-1) * rsigma).max().item() if x.numel() else 1.0
    _check(m, ref, [x], dtype, roundings=2 * max(1, math.ceil(cond)))


@FUZZ
@given(
    seed=SEED,
    dtype=DTYPES,
    tokens=st.integers(1, 12),
    hidden=st.integers(1, 48),
    bias=st.booleans(),
)
def test_ops_sequential_linear_bias_gelu(seed, dtype, tokens, hidden, bias):
    torch.manual_seed(seed)
    ops = [te.ops.BasicLinear(hidden, hidden, dtype=dtype)]
    ops += [te.ops.Bias(hidden, dtype=dtype)] if bias else []
    m = te.ops.Sequential(*ops, te.ops.GELU())

    def ref(q, x):
        return tF.gelu(tF.linear(x, q["0.weight"], q.get("1.bias")), approximate="tanh")

    _check(m, ref, [torch.randn(tokens, hidden)], dtype, roundings=3)


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
    dtype=DTYPES, name=st.sampled_from([*_ACT_REF, *_GLU_REF]),
    shape=st.lists(st.integers(0, 5), max_size=2), half=st.integers(1, 24),
    interleave=st.sampled_from([None, 1, 2, 4]),
)  # fmt: skip
def test_activations(seed, dtype, name, shape, half, interleave):
    torch.manual_seed(seed)
    gated = name in _GLU_REF
    if gated and interleave and half % interleave:
        interleave = None
    x = torch.randn(*shape, 2 * half).to(dtype).requires_grad_()
    x_ref = to_reference(x)
    if gated:
        y = getattr(te.functional, name)(x, glu_interleave_size=interleave)
        blocks = x_ref.unflatten(-1, (-1, 2, interleave or half))
        a, lin = blocks.select(-2, 0).flatten(-2), blocks.select(-2, 1).flatten(-2)
        y_ref = _GLU_REF[name](a) * lin
    else:
        y, y_ref = getattr(te.functional, name)(x), _ACT_REF[name](x_ref)
    assert_close(y, y_ref, dtype, roundings=2)
    if y.numel():
        dy = torch.randn(y.shape).to(dtype)
        y.backward(dy)
        y_ref.backward(to_reference(dy))
        assert_close(x.grad, x_ref.grad, dtype, roundings=3)


@FUZZ
@given(seed=SEED, p=_precision(), bias=st.booleans())
def test_functional_linear(seed, p, bias):
    """``te.functional.linear`` with the recipe given as data (emulated FP8 on CPU)."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    kw = {}
    if recipe is not None:
        kw = {"recipe": recipe, "emulate": recipe in ("mxfp8", "nvfp4")}
        if recipe == "delayed":  # the scales a calibrated state would hold: 448 / amax
            kw["recipe"] = "current"
        if recipe == "block":
            kw["fwd_dtype"] = kw["bwd_dtype"] = torch.float8_e4m3fn
    x = torch.randn(tokens, k).to(dtype).requires_grad_()
    w = torch.randn(n, k).to(dtype).requires_grad_()
    b = torch.randn(n).to(dtype).requires_grad_() if bias else None
    refs = to_reference((x, w, b))
    y = te.functional.linear(x, w, b, **kw)
    y_ref = tF.linear(*refs)
    _compare(recipe, y, y_ref, dtype, 2)


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
)
def test_dot_product_attention(seed, dtype, seq, batch, groups, heads_per_group, head_dim, mask,
                               layout):  # fmt: skip
    torch.manual_seed(seed)
    heads = groups * heads_per_group
    m = te.DotProductAttention(heads, head_dim, num_gqa_groups=groups, qkv_format=layout,
                               attn_mask_type=mask)  # fmt: skip
    shape = (seq, batch) if layout == "sbhd" else (batch, seq)
    q, k, v = (torch.randn(*shape, h, head_dim).to(dtype).requires_grad_()
               for h in (heads, groups, groups))  # fmt: skip
    refs = to_reference((q, k, v))

    def ref(q, k, v):  # [b, h, s, d]
        if layout == "sbhd":
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(heads_per_group, dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / head_dim**0.5
        if mask == "causal":
            scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
        out = scores.softmax(-1) @ v  # [b, h, s, d]
        out = out.permute(2, 0, 1, 3) if layout == "sbhd" else out.transpose(1, 2)
        return out.reshape(*shape, heads * head_dim)

    y, y_ref = m(q, k, v), ref(*refs)
    assert_close(y, y_ref, dtype, roundings=4, reduced=True)
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    for t, r in zip((q, k, v), refs, strict=True):
        assert_close(t.grad, r.grad, dtype, roundings=6, reduced=True)


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

    def ref(q, x):
        if normalization:
            g = q["norm_weight"] + (1 if zc else 0)
            x = _ln(x, g, q["norm_bias"]) if normalization == "LayerNorm" else _rms(x, g)
        h = tF.linear(x, q["fc1_weight"], q.get("fc1_bias"))
        h = _gated(activation, h) if gated else _ACT_REF[activation](h)
        return tF.linear(h, q["fc2_weight"], q.get("fc2_bias"))

    _check(m, ref, [torch.randn(tokens, hidden)], dtype, recipe, roundings=5, gemms=2,
           autocast=False)  # fmt: skip


@FUZZ
@given(seed=SEED, p=_precision(), groups=st.integers(1, 3), bias=st.booleans(),
       as_tensor=st.booleans(), data=st.data())  # fmt: skip
def test_functional_grouped_linear(seed, p, groups, bias, as_tensor, data):
    """``te.functional.grouped_linear`` (``[G, N, K]`` weight) with the recipe as data;
    ``m_splits`` a list or ``as_splits_tensor``'s tensor."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    splits = data.draw(_splits(groups, tokens))
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
