"""Fuzz tests of the functional ops and the attention modules: activations, ``te.functional``
linear / mlp / grouped_linear with the recipe as data, attention, MultiheadAttention and
TransformerLayer, against float64 references (``common``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as tF
from hypothesis import given, settings
from hypothesis import strategies as st

import te_compile as te
from tests.fuzz.common import (
    _ACT_REF,
    _GLU_REF,
    _MLP_ACT,
    DTYPES,
    FUZZ,
    RECIPES,
    SEED,
    _check,
    _compare,
    _Fn,
    _gated,
    _grouped_ref,
    _ln,
    _norm_ref,
    _precision,
    _rms,
    _rotate,
    _splits,
)
from tests.utils import assert_close, capped_dtype, to_reference, with_specs


def _fuzz(ci_examples):
    """``FUZZ`` for a heavy test: at most ``ci_examples`` cases under the "ci" profile (the
    derandomized one), all of them under "full"."""
    return settings(FUZZ, max_examples=ci_examples) if FUZZ.derandomize else FUZZ


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
    dtype = capped_dtype(dtype, 4)  # the bias gradient: 4 roundings
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
@given(seed=SEED, p=_precision(roundings=2), bias=st.booleans())
def test_functional_linear(seed, p, bias):
    """``te.functional.linear`` with the recipe given as data (emulated FP8 on CPU)."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    kw = with_specs(**_recipe_kwargs(recipe))
    x = torch.randn(tokens, k).to(dtype).requires_grad_()
    w = torch.randn(n, k).to(dtype).requires_grad_()
    b = torch.randn(n).to(dtype).requires_grad_() if bias else None
    refs = to_reference((x, w, b))
    y = te.functional.linear(x, w, b, **kw)
    y_ref = tF.linear(*refs)
    _compare(recipe, y, y_ref, dtype, 2)


def _attention_ref(q, k, v, layout, mask, scale=None, sink=None):
    """Softmax attention of ``[s, b, h, d]`` (sbhd) or ``[b, s, h, d]`` (bshd) heads, GQA
    (``k`` / ``v`` with fewer heads, each shared by consecutive query heads): ``[.., h * d]``.
    ``sink`` ``[h]``: an extra softmax column of these logits, dropped after the softmax
    (Transformer Engine's ``softmax_type``)."""
    if layout == "sbhd":
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    else:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if mask == "causal":
        seq = q.shape[2]
        scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
    if sink is None:
        probs = scores.softmax(-1)
    else:
        column = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    out = probs @ v  # [b, h, s, d]
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
    softmax_type=st.sampled_from(["vanilla", "off-by-one", "learnable"]),
)
def test_dot_product_attention(seed, dtype, seq, batch, groups, heads_per_group, head_dim, mask,
                               layout, functional, scale, softmax_type):  # fmt: skip
    """The module, or ``te.functional.dot_product_attention`` (with a ``softmax_scale``); a sink
    softmax, the learnable sink's logits drawn at random and their gradient checked."""
    torch.manual_seed(seed)
    dtype = capped_dtype(dtype, 6)  # the gradients: 6 roundings (bfloat16 runs in float32)
    heads = groups * heads_per_group
    shape = (seq, batch) if layout == "sbhd" else (batch, seq)
    q, k, v = (torch.randn(*shape, h, head_dim).to(dtype).requires_grad_()
               for h in (heads, groups, groups))  # fmt: skip
    refs = to_reference((q, k, v))
    sink = (torch.randn(heads) * 2).requires_grad_() if softmax_type == "learnable" else None
    if functional:
        y = te.functional.dot_product_attention(q, k, v, qkv_format=layout, attn_mask_type=mask,
                                                softmax_scale=scale, softmax_type=softmax_type,
                                                softmax_offset=sink)  # fmt: skip
    else:
        scale = None
        m = te.DotProductAttention(heads, head_dim, num_gqa_groups=groups, qkv_format=layout,
                                   attn_mask_type=mask, softmax_type=softmax_type)  # fmt: skip
        if sink is not None:
            m.softmax_offset.data.copy_(sink.detach())
            sink = m.softmax_offset
        y = m(q, k, v)
    sink_ref = torch.zeros(heads, dtype=torch.float64) if softmax_type == "off-by-one" else None
    if sink is not None:
        sink_ref = to_reference(sink)
    y_ref = _attention_ref(*refs, layout, mask, scale, sink_ref)
    assert_close(y, y_ref, dtype, roundings=4, reduced=True)
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    pairs = [*zip((q, k, v), refs, strict=True)] + ([(sink, sink_ref)] if sink is not None else [])
    for t, r in pairs:
        assert_close(t.grad, r.grad, dtype, roundings=6, reduced=True)


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
def _attention_config(draw, recipes=(None, *(r for r in RECIPES if r != "nvfp4"))):
    """Sizes and options of a self-attention block: any head dim in high precision; under a
    recipe 16 and head counts whose projections are multiples of the recipe's block. High
    precision is float32: the chain (norm, QKV, softmax, projection; the MLP too in the layer)
    takes 6 to 10 roundings times a norm's condition number, past the cap of bfloat16 (2) and
    float16 (31) alike. Not NVFP4: through the softmax its FP4 queries and keys leave a normwise
    error of 0.4 - 0.6 against float64 and a gain of 0.75 - 0.9 (measured on these sizes), more
    than any bound that still rejects an all-zero result; its GEMMs are checked in the linear
    and MLP fuzz."""
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
        c |= {"dtype": torch.float32, "head_dim": 2 * draw(st.integers(1, 4)),
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
           c["recipe"], roundings=lambda: 6 * math.ceil(max(cond)), call=call,
           gemms=4,  # QKV, QK^T and PV of quantised operands' results, proj
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
           call=call, gemms=6, sum_bound=False,
           residual=residual in ("pre", "parallel"))  # fmt: skip


@FUZZ
@given(seed=SEED, p=_precision(max_features=32, roundings=6), activation=st.sampled_from(
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
    kw = with_specs(**_recipe_kwargs(recipe))
    kw |= {"normalization": normalization, "zero_centered_gamma": zc}
    if activation == "situglu":  # its default betas in the limit / alpha slots, no offset
        kw |= {"limit": 4.0, "alpha": 25.0, "glu_linear_offset": 0.0}
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
@given(seed=SEED, p=_precision(roundings=4), groups=st.integers(1, 3), bias=st.booleans(),
       as_tensor=st.booleans(), data=st.data())  # fmt: skip
def test_functional_grouped_linear(seed, p, groups, bias, as_tensor, data):
    """``te.functional.grouped_linear`` (``[G, N, K]`` weight) with the recipe as data;
    ``m_splits`` a list or ``as_splits_tensor``'s tensor."""
    torch.manual_seed(seed)
    recipe, dtype, tokens, k, n = p
    splits = data.draw(_splits(groups, tokens, 16 if recipe == "nvfp4" else 1))
    shapes = {"weight": (groups, n, k)} | ({"bias": (groups, n)} if bias else {})
    # The grouped GEMM's NVFP4 here: no Hadamard transform, no SR (data only).
    kw = with_specs(**_recipe_kwargs(recipe))
    m = _Fn(lambda x, s, **t: te.functional.grouped_linear(x, s, t["weight"], t.get("bias"), **kw),
            dtype, **shapes)  # fmt: skip

    def ref(q, x, _):
        bs = q["bias"].unbind() if bias else [None] * groups
        return _grouped_ref(x, splits, q["weight"].unbind(), bs)

    m_splits = te.functional.as_splits_tensor(splits) if as_tensor else splits
    _check(m, ref, [torch.randn(tokens, k), m_splits], dtype, recipe, roundings=3, autocast=False,
           grouped=True)  # fmt: skip
