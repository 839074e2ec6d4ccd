"""Shared pieces of the fuzz tests (``tests/fuzz/``): hypothesis settings and strategies, the
recipes with the sizes each takes, float64 references, and the check of a module or function
against its reference written in plain torch.

Settings come from the "te-fuzz" profile that tests/conftest.py registers from
``--fuzz-profile``: "ci" (default; seeded, derandomized, a few cases per test) or "full"
(200 random cases per test): ``pytest tests/fuzz --fuzz-profile=full``.

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
from hypothesis import settings
from hypothesis import strategies as st

import te_compile as te
from te_compile import recipe as R
from tests.utils import (
    assert_close,
    assert_close_quantized,
    assert_close_quantized_groups,
    assert_close_sum,
    capped_dtype,
    to_reference,
)

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


# The grouped modules' NVFP4: the default recipe (Hadamard transform and stochastic rounding per
# expert), expert token counts drawn in multiples of 16 (``_splits``'s ``unit``).
GROUPED_NVFP4 = R.NVFP4BlockScaling()


@st.composite
def _precision(draw, max_tokens=24, max_features=48, roundings=3):
    """``(recipe name or None, dtype, tokens, in_features, out_features)``: any sizes in high
    precision, the multiples a recipe needs otherwise. ``roundings``: the most the test's
    high-precision checks take (:func:`_check`: its ``roundings`` plus one for the gradients);
    where they exceed the cap of the dtype drawn (bfloat16 past two), float32
    (:func:`tests.utils.capped_dtype`)."""
    name = draw(st.sampled_from([None, *RECIPES]))
    if name is None:
        sizes = st.integers(1, max_features)
        dtype = capped_dtype(draw(DTYPES), roundings)
        return None, dtype, draw(st.integers(0, max_tokens)), draw(sizes), draw(sizes)
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


def _compare_quantized(recipe, actual, expected, gemms, grad=False, splits=None, subtract=None,
                       gain=True):  # fmt: skip
    """:func:`assert_close_quantized`, per group where ``splits`` gives the rows of each group
    along dim 0 (a grouped module's output and input gradient) or the tensor has one slice per
    group (a single grouped weight's gradient: ``splits`` has its number of groups)."""
    if splits is not None and actual.dim() >= 2:
        if actual.shape[0] == sum(splits):  # rows: the output, the input gradient
            assert_close_quantized_groups(actual, expected, recipe, splits, gemms, grad)
            return
        if actual.shape[0] == len(splits):  # [groups, ...]: a single grouped parameter
            assert_close_quantized_groups(actual, expected, recipe, [1] * len(splits), gemms, grad)
            return
    assert_close_quantized(actual, expected, recipe, gemms, grad, subtract, gain=gain)


def _compare(recipe, actual, expected, dtype, roundings):
    if recipe is None:
        assert_close(actual, expected, dtype, roundings=roundings, reduced=True)
    else:
        assert_close_quantized(actual, expected, recipe)


def _check(module, ref, inputs, dtype, recipe=None, roundings=2, call=None, gemms=1,
           grouped=False, sum_bound=True, autocast=True, magnitude_ref=None,
           residual=False):  # fmt: skip
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
    pass). ``residual``: the output adds the input (``x + branches``), the input gradient the
    incoming gradient; under a recipe both are taken off before the comparison, so the quantised
    branches are compared rather than residual sums. Under a recipe a grouped module's results
    (``grouped``; its split sizes are ``inputs[1]``) are compared group by group."""
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
    elif recipe is None:
        assert_close(y, y_ref, dtype, roundings=roundings, reduced=True)
    else:
        splits = [int(n) for n in inputs[1]] if grouped else None
        _compare_quantized(recipe, y, y_ref, gemms, False, splits, x_ref if residual else None)
    if y.numel() == 0:
        return
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    grads = [(x.grad, x_ref.grad)]
    grads += [(p.grad, params[n].grad) for n, p in module.named_parameters()]
    if recipe is not None:
        for i, (actual, expected) in enumerate(grads):
            try:
                through = to_reference(dy) if residual and i == 0 else None  # x.grad: dy + ...
                _compare_quantized(
                    recipe, actual, expected, gemms, True, splits, through, gain=sum_bound
                )  # a softmax: see assert_close_quantized
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


_MLP_ACT = {
    "gelu": lambda a: tF.gelu(a, approximate="tanh"),
    "relu": tF.relu,
    "silu": tF.silu,
    "swiglu": lambda a: tF.silu(a.chunk(2, -1)[0]) * a.chunk(2, -1)[1],
    "geglu": lambda a: tF.gelu(a.chunk(2, -1)[0], approximate="tanh") * a.chunk(2, -1)[1],
}


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


# te.ops: random chains of basic ops. Motifs are the fusions' patterns (so the fused ops run),
# the rest single ops; each step is ``(kind, options)``, built and referenced in the test.
_OPS_ACT = {"GELU": "gelu", "QGELU": "qgelu", "ReLU": "relu", "SReLU": "srelu", "SiLU": "silu"}


_OPS_GLU = {"GLU": "glu", "GEGLU": "geglu", "QGEGLU": "qgeglu", "ReGLU": "reglu",
            "SReGLU": "sreglu", "SwiGLU": "swiglu", "ClampedSwiGLU": "clamped_swiglu",
            "SiTUGLU": "situglu"}  # fmt: skip


_OPS_SCALED_GLU = {"ScaledSwiGLU": "swiglu", "ScaledClampedQGeGLU": "clamped_swiglu",
                   "ScaledSiTUGLU": "situglu"}  # fmt: skip
_OPS_SCALED_ACT = {"ScaledSReLU": "srelu"}
_OPS_SCALED = {**_OPS_SCALED_GLU, **_OPS_SCALED_ACT}  # an activation times the extra input


_FUSION_MOTIFS = [
    ["BasicLinear", "Bias?", "act"],  # ForwardLinearBiasActivation
    ["BasicLinear", "Bias?", "ConstantScale", "AddExtraInput"],  # ForwardLinearScaleAdd
    ["BasicLinear", "Bias?", "AddExtraInput"],  # ForwardLinearBiasAdd
    ["MakeExtraOutput", "BasicLinear", "Bias?"],  # BackwardLinearAdd
    ["BasicLinear", "ConstantScale"],  # BackwardLinearScale
    ["Bias", "act"],  # BackwardActivationBias
    ["MakeExtraOutput", "RMSNorm"],  # BackwardAddRMSNorm
]


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
                # Transformer Engine's default per-group parameters: weight0 .., bias0 ..
                ws = [q[f"{p}weight{g}"] for g in range(groups)]
                bs = [q[f"{p}bias{g}"] for g in range(groups)] if bias else [None] * groups
                return _grouped_ref(x, next(e), ws, bs)

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
        elif kind in _OPS_SCALED_ACT:
            ops.append(getattr(te.ops, kind)())
            extras.append(torch.randn(shape).to(dtype))

            def scaled_act(x, q, p, e, out, f=_ACT_REF[_OPS_SCALED_ACT[kind]]):
                g, s = f(x), next(e)
                y = g * s[..., None]
                y.retain_grad()
                scaled_terms.append((s, g, y))
                return y

            refs.append(scaled_act)
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
    ``l``, contiguous or in blocks of ``interleave``; ``clamped_swiglu`` clamps both,
    ``situglu`` soft-caps both (its default betas 4 and 25)."""
    blocks = x.unflatten(-1, (-1, 2, interleave or x.shape[-1] // 2))
    a, lin = blocks.select(-2, 0).flatten(-2), blocks.select(-2, 1).flatten(-2)
    if name == "clamped_swiglu":
        c = a.clamp(max=limit)
        return c * torch.sigmoid(alpha * c) * (lin.clamp(-limit, limit) + offset)
    if name == "situglu":
        return 4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * 25.0 * torch.tanh(lin / 25.0)
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


def _norm_ref(x, q, prefix, kind, zc, eps=1e-5, cond=None):
    """LayerNorm / RMSNorm with the gain (and bias) ``q[prefix + "weight"]`` (``"bias"``);
    appends its condition number over the rows to the list ``cond`` when given."""
    if cond is not None:
        cond.append(_norm_cond(x.detach(), kind))
    g = q[prefix + "weight"] + (1 if zc else 0)
    return _ln(x, g, q[prefix + "bias"], eps) if kind == "LayerNorm" else _rms(x, g, eps)


def _rotate(x, interleaved):
    if interleaved:  # (x0, x1) -> (-x1, x0) per pair
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)
