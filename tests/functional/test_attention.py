"""Attention (``te::attention_fwd/_bwd``, ``te.functional.dot_product_attention``): every mask
type, sliding windows, GQA / MQA, cross attention, bias and ALiBi, packed ``thd`` batches against
per-sequence attention, against a float64 reference built here from Transformer Engine's
definitions (python loops over (i, j), independent of the op's vectorised masks); dropout's
determinism and activation checkpointing; compile without graph breaks or recompiles; bad input
in eager and under compile; the CUDA path's mask bias and kernel choice, on the CPU."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.utils.checkpoint

import te_compile as te
from te_compile.functional import attention_cuda
from te_compile.functional.dropout_ops import dropout_mask
from tests.utils import (
    assert_close,
    assert_matches_eager,
    compile_counted,
    make_reference_and_test_tensors,
    references,
)

A = importlib.import_module("te_compile.functional.attention")
F = te.functional


# The float64 reference --------------------------------------------------------------------------


def visible_mask(b, h, sq, skv, mask_type, window=None, q_lens=None, kv_lens=None, mask=None):
    """[b, h, sq, skv] bool from Transformer Engine's definitions, one (i, j) at a time."""
    bottom_right = mask_type not in ("causal", "padding_causal")
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask_type:
        right = 0
    out = torch.zeros(b, h, sq, skv, dtype=torch.bool)
    for bi in range(b):
        nq = sq if q_lens is None else q_lens[bi]
        nk = skv if kv_lens is None else kv_lens[bi]
        off = nk - nq if bottom_right else 0
        for i in range(sq):
            for j in range(skv):
                ok = i < nq and j < nk
                ok = ok and (left < 0 or j >= i + off - left)
                ok = ok and (right < 0 or j <= i + off + right)
                out[bi, :, i, j] = ok
    if mask is not None:
        out &= ~mask.expand(b, h, sq, skv)
    return out


def alibi_bias(slopes, b, h, sq, skv, mask_type, q_lens=None, kv_lens=None):
    bottom_right = mask_type not in ("causal", "padding_causal")
    slopes = slopes.double().reshape(-1, h).expand(b, h)
    out = torch.zeros(b, h, sq, skv, dtype=torch.float64)
    for bi in range(b):
        nq = sq if q_lens is None else q_lens[bi]
        nk = skv if kv_lens is None else kv_lens[bi]
        off = nk - nq if bottom_right else 0
        for i in range(sq):
            for j in range(skv):
                out[bi, :, i, j] = -slopes[bi] * abs(i + off - j)
    return out


def reference(q, k, v, visible, scale, bias=None, sink=None, keep=None, p_drop=0.0):
    """Attention on float64 ``[b, s, h, d]`` tensors; a row that sees no key outputs zeros.
    ``sink`` ``[h]``: Transformer Engine's attention sink, one more key that every query sees,
    with logit ``sink[n]`` and a zero value (``softmax_type``). ``keep`` ``[b, h, sq, skv]``: the
    dropout keep mask, applied to the probabilities of the keys with ``1 / (1 - p_drop)``."""
    h, hk = q.shape[2], k.shape[2]
    outs = []
    for n in range(h):
        kn, vn = k[:, :, n // (h // hk)], v[:, :, n // (h // hk)]
        s = torch.einsum("bid,bjd->bij", q[:, :, n], kn) * scale
        if bias is not None:
            s = s + bias[:, n]
        seen = visible[:, n]
        if sink is not None:
            s = torch.cat([s, sink[n].expand(*s.shape[:-1], 1)], -1)
            seen = torch.cat([seen, torch.ones_like(seen[..., :1])], -1)
            vn = torch.cat([vn, torch.zeros_like(vn[:, :1])], 1)
        row = seen.any(-1, keepdim=True)
        s = s.masked_fill(~seen, -math.inf).masked_fill(~row, 0.0)
        p = torch.softmax(s, -1) * row
        if keep is not None:
            kept = keep[:, n]
            if sink is not None:
                kept = torch.cat([kept, torch.ones_like(kept[..., :1])], -1)
            p = torch.where(kept, p / (1 - p_drop), 0.0)
        outs.append(p @ vn)
    return torch.stack(outs, 2)


def make_qkv(b, sq, skv, h, hk, d, dv=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        make_reference_and_test_tensors(shape, dtype=dtype, generator=gen)
        for shape in ((b, sq, h, d), (b, skv, hk, d), (b, skv, hk, dv or d))
    ]


def to_format(x, qkv_format):
    return x.transpose(0, 1) if qkv_format == "sbhd" else x


def from_output(y, qkv_format, b, s, h):
    if qkv_format == "sbhd":
        y = y.transpose(0, 1)
    return y.reshape(b, s, h, -1)


def check_forward_backward(test, ref, inputs, dtype, grad_seed=1):
    """``test`` and ``ref`` outputs, then the gradients of ``inputs`` (pairs of (ref, test))."""
    assert_close(test, ref, dtype)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(grad_seed))
    grad = grad.to(dtype)
    test.backward(grad)
    ref.backward(grad.double())
    for r, t in inputs:
        assert_close(t.grad, r.grad, dtype, reduced=True)


# Mask types, windows, GQA, cross attention ---------------------------------------------------

MASK_TYPES = [
    "no_mask",
    "causal",
    "causal_bottom_right",
    "padding",
    "padding_causal",
    "padding_causal_bottom_right",
    "arbitrary",
]


@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", MASK_TYPES)
@pytest.mark.parametrize(("sq", "skv"), [(5, 5), (4, 7), (7, 3)], ids=["self", "sq<skv", "sq>skv"])
def test_mask_types_match_reference(mask_type, sq, skv, qkv_format):
    b, h, hk, d = 2, 4, 2, 8
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, sq, skv, h, hk, d)
    q_lens, kv_lens, mask, kwargs = None, None, None, {}
    if "padding" in mask_type:
        q_lens, kv_lens = [sq - 1, sq], [skv, max(skv - 2, 1)]
        q_pad = torch.arange(sq)[None] >= torch.tensor(q_lens)[:, None]
        kv_pad = torch.arange(skv)[None] >= torch.tensor(kv_lens)[:, None]
        kwargs["attention_mask"] = (q_pad[:, None, None], kv_pad[:, None, None])
    if mask_type == "arbitrary":
        mask = torch.rand(b, 1, sq, skv, generator=torch.Generator().manual_seed(3)) < 0.3
        kwargs["attention_mask"] = mask
    y = F.dot_product_attention(
        to_format(qt, qkv_format),
        to_format(kt, qkv_format),
        to_format(vt, qkv_format),
        qkv_format=qkv_format,
        attn_mask_type=mask_type,
        **kwargs,
    )
    visible = visible_mask(b, h, sq, skv, mask_type, None, q_lens, kv_lens, mask)
    ref = reference(qr, kr, vr, visible, d**-0.5)
    check_forward_backward(
        from_output(y, qkv_format, b, sq, h), ref, [(qr, qt), (kr, kt), (vr, vt)], torch.float32
    )


@pytest.mark.parametrize(
    ("mask_type", "window"),
    [
        ("causal", (2, 0)),
        ("causal", (0, 0)),
        ("causal_bottom_right", (3, 0)),
        ("no_mask", (2, 1)),
        ("no_mask", (0, 3)),
        ("padding", (1, 2)),
        ("arbitrary", (2, 2)),
    ],
)
def test_sliding_window(mask_type, window):
    b, h, hk, d, sq, skv = 2, 2, 2, 8, 6, 8
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, sq, skv, h, hk, d, seed=4)
    q_lens = kv_lens = mask = None
    kwargs = {}
    if mask_type == "padding":
        q_lens, kv_lens = [4, 6], [8, 5]
        q_pad = torch.arange(sq)[None] >= torch.tensor(q_lens)[:, None]
        kv_pad = torch.arange(skv)[None] >= torch.tensor(kv_lens)[:, None]
        kwargs["attention_mask"] = (q_pad[:, None, None], kv_pad[:, None, None])
    if mask_type == "arbitrary":
        mask = torch.rand(1, h, sq, skv, generator=torch.Generator().manual_seed(5)) < 0.2
        kwargs["attention_mask"] = mask
    y = F.dot_product_attention(
        qt, kt, vt, qkv_format="bshd", attn_mask_type=mask_type, window_size=window, **kwargs
    )
    visible = visible_mask(b, h, sq, skv, mask_type, window, q_lens, kv_lens, mask)
    ref = reference(qr, kr, vr, visible, d**-0.5)
    check_forward_backward(
        y.reshape(b, sq, h, d), ref, [(qr, qt), (kr, kt), (vr, vt)], torch.float32
    )


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_and_mqa(kv_heads, dtype):
    b, h, d, sq, skv = 2, 4, 8, 5, 6
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, sq, skv, h, kv_heads, d, dtype=dtype, seed=6)
    y = F.dot_product_attention(qt, kt, vt, qkv_format="bshd", attn_mask_type="causal")
    visible = visible_mask(b, h, sq, skv, "causal")
    ref = reference(qr, kr, vr, visible, d**-0.5)
    check_forward_backward(y.reshape(b, sq, h, d), ref, [(qr, qt), (kr, kt), (vr, vt)], dtype)


def test_value_head_dim_and_scale():
    """kv_channels as a (k, v) pair: v's head dim differs; an explicit softmax_scale."""
    b, h, sq, skv = 2, 2, 4, 5
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, sq, skv, h, h, 6, dv=10, seed=7)
    y = F.dot_product_attention(
        qt, kt, vt, qkv_format="bshd", attn_mask_type="no_mask", softmax_scale=0.3
    )
    assert y.shape == (b, sq, h * 10)
    ref = reference(qr, kr, vr, visible_mask(b, h, sq, skv, "no_mask"), 0.3)
    check_forward_backward(
        y.reshape(b, sq, h, 10), ref, [(qr, qt), (kr, kt), (vr, vt)], torch.float32
    )


def test_padding_from_cu_seqlens_equals_attention_mask():
    b, h, d, s = 3, 2, 8, 6
    lens = [6, 2, 4]
    (_, q), (_, k), (_, v) = make_qkv(b, s, s, h, h, d, seed=8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    pad = (torch.arange(s)[None] >= torch.tensor(lens)[:, None])[:, None, None]
    for mask_type in ("padding", "padding_causal", "padding_causal_bottom_right"):
        by_mask = F.dot_product_attention(q, k, v, pad, qkv_format="bshd", attn_mask_type=mask_type)
        by_cu = F.dot_product_attention(
            q, k, v, qkv_format="bshd", attn_mask_type=mask_type, cu_seqlens_q=cu, cu_seqlens_kv=cu
        )
        assert torch.equal(by_mask, by_cu)
        # Padded queries output zeros.
        assert not by_mask.reshape(b, s, -1)[1, 2:].any()


# Packed sequences (thd) --------------------------------------------------------------------


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_thd_matches_per_sequence_attention(mask_type, cross):
    """Uneven sequences packed with padding tokens at the end: each sequence's output and
    gradients equal separate attention on that sequence alone; padding tokens get zeros."""
    h, hk, d = 4, 2, 8
    lens_q = [3, 1, 5]
    lens_kv = [2, 4, 3] if cross else lens_q
    tq, tk = sum(lens_q) + 2, sum(lens_kv) + 1
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_kv = torch.tensor([0, 2, 6, 9], dtype=torch.int32) if cross else cu_q
    (_, q), (_, k), (_, v) = make_qkv(1, tq, tk, h, hk, d, seed=9)
    q, k, v = (x[0].detach().requires_grad_() for x in (q, k, v))
    y = F.dot_product_attention(
        q, k, v, qkv_format="thd", attn_mask_type=mask_type, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv
    )
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(10))
    y.backward(grad)
    dense = mask_type.replace("padding_", "").replace("padding", "no_mask")
    for i in range(3):
        sl_q = slice(cu_q[i].item(), cu_q[i + 1].item())
        sl_k = slice(cu_kv[i].item(), cu_kv[i + 1].item())
        qi, ki, vi = (
            x.detach()[sl][None].requires_grad_() for x, sl in ((q, sl_q), (k, sl_k), (v, sl_k))
        )
        yi = F.dot_product_attention(qi, ki, vi, qkv_format="bshd", attn_mask_type=dense)
        yi.backward(grad[sl_q][None])
        assert_close(y[sl_q], yi[0], torch.float32)
        assert_close(q.grad[sl_q], qi.grad[0], torch.float32)
        assert_close(k.grad[sl_k], ki.grad[0], torch.float32)
        assert_close(v.grad[sl_k], vi.grad[0], torch.float32)
    assert not y[9:].any() and not q.grad[9:].any()
    assert not k.grad[cu_kv[-1] :].any() and not v.grad[cu_kv[-1] :].any()


def test_thd_alibi_and_window_per_sequence():
    h, d = 2, 8
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    (_, q), (_, k), (_, v) = make_qkv(1, 6, 6, h, h, d, seed=11)
    q, k, v = q[0].detach(), k[0].detach(), v[0].detach()
    slopes = torch.tensor([0.5, 0.125])
    kwargs = {"core_attention_bias_type": "alibi", "alibi_slopes": slopes, "window_size": (1, 0)}
    y = F.dot_product_attention(
        q,
        k,
        v,
        qkv_format="thd",
        attn_mask_type="padding_causal",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        **kwargs,
    )
    for lo, hi in ((0, 4), (4, 6)):
        yi = F.dot_product_attention(
            q[None, lo:hi],
            k[None, lo:hi],
            v[None, lo:hi],
            qkv_format="bshd",
            attn_mask_type="causal",
            **kwargs,
        )
        assert_close(y[lo:hi], yi[0], torch.float32)


# Bias and ALiBi ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["1hss", "b1ss", "bhss", "111s"])
@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias"])
def test_core_attention_bias(bias_type, shape):
    b, h, d, sq, skv = 2, 3, 8, 4, 6
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, sq, skv, h, h, d, seed=12)
    dims = {
        "1hss": (1, h, sq, skv),
        "b1ss": (b, 1, sq, skv),
        "bhss": (b, h, sq, skv),
        "111s": (1, 1, 1, skv),
    }[shape]
    br, bt = make_reference_and_test_tensors(dims, generator=torch.Generator().manual_seed(13))
    y = F.dot_product_attention(
        qt,
        kt,
        vt,
        qkv_format="bshd",
        attn_mask_type="causal",
        core_attention_bias_type=bias_type,
        core_attention_bias=bt,
    )
    scale = d**-0.5
    bias = (br * scale if bias_type == "pre_scale_bias" else br).expand(b, h, sq, skv)
    ref = reference(qr, kr, vr, visible_mask(b, h, sq, skv, "causal"), scale, bias)
    check_forward_backward(
        y.reshape(b, sq, h, d), ref, [(qr, qt), (kr, kt), (vr, vt), (br, bt)], torch.float32
    )


@pytest.mark.parametrize("slopes", ["default", "per_head", "per_batch"])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask", "padding_causal_bottom_right"])
def test_alibi(mask_type, slopes):
    b, h, d, sq, skv = 2, 4, 8, 5, 7
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, sq, skv, h, h, d, seed=14)
    values = {
        "default": None,
        "per_head": torch.tensor([0.5, 0.3, 0.2, 0.05]),
        "per_batch": torch.rand(b, h, generator=torch.Generator().manual_seed(15)),
    }[slopes]
    q_lens = kv_lens = None
    kwargs = {}
    if "padding" in mask_type:
        q_lens, kv_lens = [5, 3], [6, 7]
        q_pad = torch.arange(sq)[None] >= torch.tensor(q_lens)[:, None]
        kv_pad = torch.arange(skv)[None] >= torch.tensor(kv_lens)[:, None]
        kwargs["attention_mask"] = (q_pad[:, None, None], kv_pad[:, None, None])
    y = F.dot_product_attention(
        qt,
        kt,
        vt,
        qkv_format="bshd",
        attn_mask_type=mask_type,
        core_attention_bias_type="alibi",
        alibi_slopes=values,
        **kwargs,
    )
    if values is None:  # Press et al.: 2^(-8/h * n) for n = 1..h, h a power of two
        values = torch.tensor([2.0 ** (-8.0 / h * n) for n in range(1, h + 1)])
    bias = alibi_bias(values, b, h, sq, skv, mask_type, q_lens, kv_lens)
    visible = visible_mask(b, h, sq, skv, mask_type, None, q_lens, kv_lens)
    ref = reference(qr, kr, vr, visible, d**-0.5, bias)
    check_forward_backward(
        y.reshape(b, sq, h, d), ref, [(qr, qt), (kr, kt), (vr, vt)], torch.float32
    )


def test_default_alibi_slopes_for_six_heads():
    """Not a power of two: 4 geometric slopes, then every other slope of 8 heads."""
    got = A.attention_args.default_alibi_slopes(6)
    eight = [2.0 ** (-n) for n in range(1, 9)]
    expected = [2.0 ** (-2 * n) for n in range(1, 5)] + eight[0::2][:2]
    torch.testing.assert_close(got, torch.tensor(expected))


def test_autocast_casts_qkv_and_keeps_alibi_slopes_fp32():
    """Under autocast q, k and v run in the autocast dtype; ALiBi slopes stay fp32 (the op
    requires them so)."""
    (_, q), (_, k), (_, v) = make_qkv(2, 5, 5, 2, 2, 8, seed=19)
    slopes = torch.tensor([0.5, 0.25])
    kwargs = {"qkv_format": "bshd", "core_attention_bias_type": "alibi", "alibi_slopes": slopes}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.dot_product_attention(q, k, v, **kwargs)
    assert y.dtype == torch.bfloat16
    expected = F.dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kwargs)
    assert torch.equal(y, expected)


# Dropout and recomputation -------------------------------------------------------------------


def _dropout_call(q, k, v, rng_state, p=0.3):
    return F.dot_product_attention(
        q, k, v, qkv_format="bshd", attn_mask_type="causal", dropout_p=p, rng_state=rng_state
    )


def test_dropout_is_a_function_of_the_rng_state():
    (_, q), (_, k), (_, v) = make_qkv(2, 6, 6, 2, 2, 8, seed=16)
    state = torch.tensor([77, 3])
    y1, y2 = _dropout_call(q, k, v, state), _dropout_call(q, k, v, state)
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, _dropout_call(q, k, v, torch.tensor([78, 3])))
    assert not torch.equal(y1, _dropout_call(q, k, v, torch.tensor([77, 4])))
    # The mask is the Philox stream over [b, h, sq, skv]; forward and backward use the same one.
    keep = dropout_mask(state, (2, 2, 6, 6), 0.3)
    visible = visible_mask(2, 2, 6, 6, "causal")
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    s = torch.einsum("bihd,bjhd->bhij", qd, kd) / math.sqrt(8)
    p = torch.softmax(s.masked_fill(~visible, -math.inf), -1)
    ref = torch.einsum("bhij,bjhd->bihd", torch.where(keep, p / 0.7, 0.0), vd)
    grad = torch.randn(2, 6, 2, 8, generator=torch.Generator().manual_seed(17))
    y1.backward(grad.reshape(y1.shape))
    ref.backward(grad.double())
    assert_close(y1.reshape(ref.shape), ref, torch.float32)
    for t, r in ((q, qd), (k, kd), (v, vd)):
        assert_close(t.grad, r.grad, torch.float32, reduced=True)


def test_dropout_rate():
    q = k = v = torch.ones(1, 64, 1, 8)
    y = F.dot_product_attention(
        q,
        k,
        v,
        qkv_format="bshd",
        attn_mask_type="no_mask",
        dropout_p=0.25,
        rng_state=torch.tensor([5, 0]),
    )
    # Every probability is 1/64 and v is ones: each output counts the kept keys of its row.
    kept = (y[0, :, 0] * 0.75 * 64).round()
    dropped = 64 * 64 - kept.sum().item()
    n, p = 64 * 64, 0.25
    assert abs(dropped - n * p) < 6 * math.sqrt(n * p * (1 - p))


def _block(dropout):
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 3 * 16)
    attn = te.DotProductAttention(4, 4, attention_dropout=dropout, qkv_format="sbhd")

    def run(x):
        q, k, v = proj(x).reshape(x.shape[0], x.shape[1], 3, 4, 4).unbind(2)
        return attn(q, k, v)

    return proj, run


def _grads(fn, proj, x):
    proj.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    torch.manual_seed(123)
    y = fn(xi)
    y.backward(torch.ones_like(y))
    return y.detach(), xi.grad, [p.grad for p in proj.parameters()]


def test_checkpoint_recomputes_the_same_dropout_mask():
    """torch.utils.checkpoint restores torch's generator, so the recomputed forward draws the
    same rng_state: identical output and gradients to the run without checkpointing."""
    proj, run = _block(0.4)
    x = torch.randn(6, 2, 16)

    def ckpt(t):
        return torch.utils.checkpoint.checkpoint(run, t, use_reentrant=False)

    y, dx, dparams = _grads(run, proj, x)
    y_c, dx_c, dparams_c = _grads(ckpt, proj, x)
    assert torch.equal(y, y_c) and torch.equal(dx, dx_c)
    for a, b in zip(dparams, dparams_c, strict=True):
        assert torch.equal(a, b)
    # And dropout did act: a different seed gives another output.
    torch.manual_seed(7)
    assert not torch.equal(run(x).detach(), y)


# Compile -------------------------------------------------------------------------------------


@pytest.mark.parametrize("qkv_format", ["sbhd", "thd"])
def test_compiled_fullgraph_no_recompile_on_new_sizes(qkv_format):
    """One frame for every batch / sequence size (dynamic=True), matching eager."""
    torch._dynamo.reset()
    if qkv_format == "thd":

        def fn(q, k, v, cu):
            return F.dot_product_attention(
                q,
                k,
                v,
                qkv_format="thd",
                attn_mask_type="padding_causal",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
            )

        def inputs(t, lens):
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            # 3 heads: no size of the first call equal to another (dynamo's duck sizing)
            return [torch.randn(t, 3, 8, requires_grad=True) for _ in range(3)] + [cu]

        cases = [inputs(9, [3, 4, 2]), inputs(13, [5, 1, 6, 1]), inputs(6, [6])]
    else:

        def fn(q, k, v):
            return F.dot_product_attention(q, k, v, attn_mask_type="causal")

        def inputs(s, b):
            return [torch.randn(s, b, 4, 8, requires_grad=True) for _ in range(3)]

        cases = [inputs(5, 2), inputs(7, 3), inputs(4, 4)]  # no size 1: dynamo specialises it
    compiled, counter = compile_counted(fn, dynamic=True)
    for args in cases:
        out = compiled(*args)
        out.sum().backward()
        grads = [a.grad for a in args if a.requires_grad]
        eager_args = [a.detach().requires_grad_(a.requires_grad) for a in args]
        expected = fn(*eager_args)
        expected.sum().backward()
        assert_matches_eager(out, expected)
        for g, a in zip(grads, [a for a in eager_args if a.requires_grad], strict=True):
            assert_matches_eager(g, a.grad)
    assert counter.frame_count == 1


# Bad input -----------------------------------------------------------------------------------


def _q(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


BAD_INPUTS = [
    ("qkv_format", dict(qkv_format="bhsd"), "qkv_format must be one of"),
    ("attn_mask_type", dict(attn_mask_type="sliding"), "attn_mask_type must be one of"),
    ("window with causal", dict(window_size=(4, 2)), "window_size must be (-1, 0) or (>=0, 0)"),
    (
        "window with no_mask",
        dict(attn_mask_type="no_mask", window_size=(-1, 0)),
        "window_size must be (-1, -1) or (>=0, >=0)",
    ),
    ("window type", dict(window_size=3), "window_size must be a pair of ints"),
    ("gqa heads", dict(k=_q(5, 2, 3, 8), v=_q(5, 2, 3, 8)), "query heads (4) must be a multiple"),
    ("head dim", dict(k=_q(5, 2, 2, 6), v=_q(5, 2, 2, 6)), "query and key must have one head dim"),
    ("dtypes", dict(k=_q(5, 2, 2, 8, dtype=torch.bfloat16)), "share a floating dtype"),
    ("rank", dict(q=_q(5, 2, 32)), "must be 4-D for qkv_format='sbhd'"),
    ("padding without mask", dict(attn_mask_type="padding"), "need attention_mask, or cu_seqlens"),
    (
        "padding mask shape",
        dict(attn_mask_type="padding", mask=torch.zeros(2, 1, 5, dtype=bool)),
        "attention_mask (query) must be a bool tensor [2, 1, 1, 5]",
    ),
    (
        "arbitrary mask shape",
        dict(attn_mask_type="arbitrary", mask=torch.zeros(2, 3, 5, 5, dtype=bool)),
        "attention_mask must broadcast to [b, h, s_q, s_kv] = [2, 4, 5, 5]",
    ),
    (
        "arbitrary mask dtype",
        dict(attn_mask_type="arbitrary", mask=torch.zeros(2, 1, 5, 5)),
        "attention_mask must be a bool tensor",
    ),
    (
        "cu_seqlens dtype",
        dict(attn_mask_type="padding", cu_q=torch.tensor([0, 2, 5]), cu_kv=torch.tensor([0, 2, 5])),
        "cu_seqlens_q must be an int32 tensor",
    ),
    (
        "cu_seqlens length",
        dict(
            attn_mask_type="padding",
            cu_q=torch.tensor([0, 5], dtype=torch.int32),
            cu_kv=torch.tensor([0, 5], dtype=torch.int32),
        ),
        "cu_seqlens_q must have batch_size + 1 = 3 entries",
    ),
    ("bias type", dict(core_attention_bias_type="relative"), "core_attention_bias_type must be"),
    ("bias missing", dict(core_attention_bias_type="post_scale_bias"), "needs core_attention_bias"),
    (
        "bias shape",
        dict(core_attention_bias_type="post_scale_bias", bias=_q(1, 4, 5, 4)),
        "core_attention_bias must be [1 or 2, 1 or 4, 1 or 5, 5]",
    ),
    ("bias without type", dict(bias=_q(1, 4, 5, 5)), "core_attention_bias must be None"),
    (
        "alibi slopes dtype",
        dict(core_attention_bias_type="alibi", slopes=torch.ones(4, dtype=torch.float64)),
        "alibi_slopes must be a float32 tensor",
    ),
    ("alibi slopes without alibi", dict(slopes=torch.ones(4)), "alibi_slopes needs"),
    ("dropout", dict(dropout_p=1.0), "dropout_p must be a float in [0, 1)"),
]

THD_BAD_INPUTS = [
    ("thd without cu_seqlens", dict(attn_mask_type="padding"), "needs cu_seqlens_q"),
    ("thd mask type", dict(attn_mask_type="causal", cu=True), "needs a padding mask type"),
    (
        "thd cu_seqlens rank",
        dict(
            attn_mask_type="padding",
            cu_q=torch.zeros(2, 2, dtype=torch.int32),
            cu_kv=torch.zeros(2, 2, dtype=torch.int32),
        ),
        "cu_seqlens_q must be an int32 tensor",
    ),
    (
        "thd cu_seqlens lengths",
        dict(
            attn_mask_type="padding",
            cu_q=torch.tensor([0, 3, 5], dtype=torch.int32),
            cu_kv=torch.tensor([0, 5], dtype=torch.int32),
        ),
        "cu_seqlens_q and cu_seqlens_kv must have one length",
    ),
    (
        "thd bias",
        dict(
            attn_mask_type="padding",
            cu=True,
            core_attention_bias_type="post_scale_bias",
            bias=_q(1, 4, 6, 6),
        ),
        "not supported with qkv_format='thd'",
    ),
]


def _bad_call(case_kwargs, thd):
    kw = dict(case_kwargs)
    if thd:
        q, k, v = _q(6, 4, 8), _q(6, 2, 8), _q(6, 2, 8)
        kw.setdefault("qkv_format", "thd")
        if kw.pop("cu", False):
            kw["cu_q"] = kw["cu_kv"] = torch.tensor([0, 6], dtype=torch.int32)
    else:
        q, k, v = _q(5, 2, 4, 8), _q(5, 2, 2, 8), _q(5, 2, 2, 8)
    q, k, v = kw.pop("q", q), kw.pop("k", k), kw.pop("v", v)
    mask = kw.pop("mask", None)
    renames = {
        "cu_q": "cu_seqlens_q",
        "cu_kv": "cu_seqlens_kv",
        "bias": "core_attention_bias",
        "slopes": "alibi_slopes",
    }
    kw = {renames.get(name, name): value for name, value in kw.items()}
    return (q, k, v, mask), kw


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize(
    ("case", "thd"),
    [(c, False) for c in BAD_INPUTS] + [(c, True) for c in THD_BAD_INPUTS],
    ids=[c[0] for c in BAD_INPUTS + THD_BAD_INPUTS],
)
def test_bad_input_raises_clear_error(case, thd, mode):
    _name, case_kwargs, message = case
    args, kwargs = _bad_call(case_kwargs, thd)

    def fn(q, k, v, mask):
        return F.dot_product_attention(q, k, v, mask, **kwargs)

    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"te\.dot_product_attention: ") as info:
        fn(*args)
    assert message in str(info.value)
    if mode == "eager":
        assert info.type is ValueError


def test_op_checks_its_arguments():
    """A direct call of the op with a bad argument names it (here and in its fake)."""
    q, k, v = _q(1, 4, 2, 8), _q(1, 4, 2, 8), _q(1, 4, 2, 8)
    args = [
        q,
        k,
        v,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
        1.0,
        -1,
        -1,
        True,
        0.5,
        4,
        4,
        False,
    ]
    with pytest.raises(ValueError, match=r"te\.attention_fwd: rng_state must be"):
        torch.ops.te.attention_fwd(*args)
    args[16], args[8] = 0.0, torch.tensor([0, 4])
    with pytest.raises(ValueError, match=r"te\.attention_fwd: cu_seqlens_q must be int32"):
        torch.ops.te.attention_fwd(*args)


# The CUDA path's pieces, on the CPU ----------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["padding_window_alibi", "arbitrary", "bottom_right_sq_gt_skv", "bias"]
)
def test_kernel_bias_reproduces_the_masks(case):
    """The memory-efficient kernel's bias (CUDA's general path): softmax(scale QK^T + bias) with
    the no-key rows zeroed equals the independent reference (``tests/utils/references.py``)."""
    gen = torch.Generator().manual_seed(18)
    b, h, sq, skv, d = 2, 2, 6, 5, 8
    q, k, v = (torch.randn(b, s, h, d, generator=gen) for s in (sq, skv, skv))
    kw = dict(
        bias=None,
        alibi_slopes=None,
        q_padding=None,
        kv_padding=None,
        mask=None,
        window=(-1, -1),
        bottom_right=True,
    )
    if case == "padding_window_alibi":
        kw["q_padding"] = torch.arange(sq)[None] >= torch.tensor([[4], [6]])
        kw["kv_padding"] = torch.arange(skv)[None] >= torch.tensor([[5], [2]])
        kw["window"], kw["alibi_slopes"] = (1, 2), torch.tensor([0.5, 0.25])
    elif case == "arbitrary":
        kw["mask"] = torch.rand(b, h, sq, skv, generator=gen) < 0.5
    elif case == "bottom_right_sq_gt_skv":
        kw["window"] = (-1, 0)
    else:
        kw["bias"] = torch.randn(1, h, sq, skv, generator=gen)
    a = A._Args(
        q,
        k,
        v,
        kw["bias"],
        kw["alibi_slopes"],
        kw["q_padding"],
        kw["kv_padding"],
        kw["mask"],
        None,
        None,
        None,
        None,
        d**-0.5,
        *kw["window"],
        kw["bottom_right"],
        0.0,
        sq,
        skv,
        False,
    )
    bias, row = A._kernel_bias(a)
    assert bias.shape == (b, h, sq, skv) and bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0
    s = torch.einsum("bihd,bjhd->bhij", q, k) * a.scale + bias
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(s, -1), v)
    out = torch.where(row.transpose(1, 2), out, 0.0)
    expected, _ = references.attention(*a)
    assert_close(out, expected, torch.float32, roundings=4, reduced=True)
    assert not bool(row.all()) or case in ("arbitrary", "bias")


def _plan(
    monkeypatch,
    flash,
    *,
    dtype=torch.bfloat16,
    sq=8,
    skv=8,
    d=64,
    dv=64,
    plain=True,
    varlen=False,
    same_layout=True,
    window=(-1, 0),
    bottom_right=False,
    p=0.0,
    cudnn=False,
):
    monkeypatch.setattr(
        attention_cuda,
        "_flash_ok",
        lambda q, v, p_: flash and p_ == 0.0 and q.dtype in (torch.float16, torch.bfloat16),
    )
    B = torch.nn.attention.SDPBackend
    choice = (B.CUDNN_ATTENTION if cudnn else B.FLASH_ATTENTION).value
    monkeypatch.setattr(attention_cuda, "_sdpa_choice", lambda *args: choice)
    q, k, v = (
        torch.empty(1, sq, 4, d, dtype=dtype),
        torch.empty(1, skv, 2, d, dtype=dtype),
        (torch.empty(1, skv, 2, dv, dtype=dtype)),
    )
    return attention_cuda.plan(q, k, v, plain, varlen, same_layout, *window, bottom_right, p)


def test_cuda_kernel_choice(monkeypatch):
    """The table of attention_cuda: flash for plain bf16 / fp16 attention without dropout, the
    memory-efficient kernel for the rest, the reference math for what neither expresses."""
    P = attention_cuda.Plan
    assert _plan(monkeypatch, True) == P("flash")
    assert _plan(monkeypatch, True, sq=4) == P("efficient", 1)  # top-left causal, sq != skv
    assert _plan(monkeypatch, True, sq=4, bottom_right=True) == P("flash")
    assert _plan(monkeypatch, True, p=0.1) == P("efficient", 1)
    assert _plan(monkeypatch, True, dtype=torch.float32) == P("efficient", 1)
    assert _plan(monkeypatch, True, plain=False) == P("efficient", -1)
    assert _plan(monkeypatch, True, window=(-1, -1)) == P("flash")
    assert _plan(monkeypatch, False, window=(-1, -1)) == P("efficient", 0)
    assert _plan(monkeypatch, False, window=(3, 0)) == P("efficient", -1)
    assert _plan(monkeypatch, False, sq=9, bottom_right=True) == P("efficient", -1)  # empty rows
    assert _plan(monkeypatch, True, dtype=torch.float64) == P("math")
    assert _plan(monkeypatch, True, varlen=True, same_layout=False) == P("efficient_varlen", 1)
    assert _plan(monkeypatch, True, varlen=True) == P("flash_varlen")
    assert _plan(monkeypatch, False, varlen=True, p=0.1, bottom_right=True, same_layout=False) == P(
        "math"
    )
    assert _plan(monkeypatch, False, varlen=True, window=(2, 0)) == P("math")
    assert _plan(monkeypatch, True, varlen=True, plain=False) == P("math")


def test_cuda_kernel_choice_follows_sdpa_to_cudnn(monkeypatch):
    """Where SDPA's dispatcher would pick cuDNN's attention, the dense cases cuDNN's kernel
    expresses as SDPA does (no window, causal with sq == skv) run it; the rest keep the table."""
    P = attention_cuda.Plan

    def plan(**kw):
        return _plan(monkeypatch, True, cudnn=True, **kw)

    assert plan() == P("cudnn")
    assert plan(window=(-1, -1), sq=4) == P("cudnn")  # no mask: any sq, skv
    assert plan(d=128, dv=64) == P("cudnn")
    assert plan(sq=4, bottom_right=True) == P("flash")  # causal, sq != skv
    assert plan(sq=4) == P("efficient", 1)
    assert plan(window=(3, 0)) == P("flash")
    assert plan(d=256, dv=256) == P("flash")  # cuDNN's backward: head dims <= 128
    assert plan(d=36, dv=36) == P("flash")  # padded to 40 for flash
    assert plan(p=0.1) == P("efficient", 1)
    assert plan(dtype=torch.float32) == P("efficient", 1)
    assert plan(plain=False) == P("efficient", -1)
    assert plan(varlen=True) == P("flash_varlen")
    assert _plan(monkeypatch, True, cudnn=False) == P("flash")  # SDPA would pick flash


def test_cuda_head_dim_padding_and_gqa_helpers():
    q, k, v = torch.randn(1, 3, 4, 6), torch.randn(1, 5, 2, 6), torch.randn(1, 5, 2, 12)
    qp, kp, vp = attention_cuda._padded(attention_cuda.Plan("flash"), q, k, v)
    assert qp.shape[-1] == kp.shape[-1] == vp.shape[-1] == 16
    assert torch.equal(qp[..., :6], q) and not qp[..., 6:].any()
    qp, kp, vp = attention_cuda._padded(attention_cuda.Plan("efficient"), q, k, v)
    assert (qp.shape[-1], vp.shape[-1]) == (8, 16)
    expanded = attention_cuda.expand_heads(k, 4)
    assert torch.equal(expanded[:, :, 0], k[:, :, 0]) and torch.equal(expanded[:, :, 1], k[:, :, 0])
    assert torch.equal(expanded[:, :, 2], k[:, :, 1])
    torch.testing.assert_close(attention_cuda.sum_heads(expanded, 2), 2 * k)
