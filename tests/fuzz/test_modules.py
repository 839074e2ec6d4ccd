"""Fuzz tests of the modules (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, GroupedMLP,
the norms, dropout, Fp8Padding, GLU layouts) against float64 references (``common``)."""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
import torch.nn.functional as tF
from hypothesis import given
from hypothesis import strategies as st

import te_compile as te
from te_compile import recipe as R
from tests.fuzz.common import (
    _GLU_REF,
    _MLP_ACT,
    DTYPES,
    FUZZ,
    SEED,
    _check,
    _Fn,
    _gated,
    _grouped_ref,
    _ln,
    _precision,
    _rms,
    _splits,
)
from tests.utils import assert_close, capped_dtype


@FUZZ
@given(seed=SEED, p=_precision(roundings=3), bias=st.booleans(), lead=st.integers(1, 3))
def test_linear(seed, p, bias, lead):
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    m = te.Linear(k, n, bias=bias, params_dtype=dtype)
    x = torch.randn(lead, tokens, k) if recipe is None else torch.randn(tokens, k)
    _check(m, lambda q, x: tF.linear(x, q["weight"], q.get("bias")), [x], dtype, recipe)


@FUZZ
@given(
    seed=SEED,
    p=_precision(roundings=4),
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


@FUZZ
@given(seed=SEED, p=_precision(roundings=5), activation=st.sampled_from(sorted(_MLP_ACT)),
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


@FUZZ
@given(seed=SEED, p=_precision(roundings=3), groups=st.integers(1, 4), bias=st.booleans(),
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
@given(seed=SEED, p=_precision(max_features=32, roundings=5), groups=st.integers(1, 3),
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
    # A row whose values nearly agree has a tiny variance: its 1 / sigma amplifies the input's
    # roundoff (the problem's condition number, max |x| / sigma), in any implementation. The
    # gradients take 2 * cond + 1 roundings: past the cap of the dtype drawn, float32.
    x = torch.randn(*shape, hidden)

    def cond_of(x):
        x64 = x.double()
        centered = x64 if rms or form == "l2normalization" else x64 - x64.mean(-1, keepdim=True)
        rsigma = torch.rsqrt(centered.square().mean(-1) + eps)
        return (x64.abs().amax(-1) * rsigma).max().item() if x.numel() else 1.0

    dtype = capped_dtype(dtype, 2 * max(1, math.ceil(cond_of(x.to(dtype)))) + 1)
    x = x.to(dtype)
    roundings = 2 * max(1, math.ceil(cond_of(x)))
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

    _check(m, ref, [x], dtype, roundings=roundings)


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
