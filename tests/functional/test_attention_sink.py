"""Attention sinks: Transformer Engine's ``softmax_type`` (``off-by-one``, ``learnable``) in
``te.functional.dot_product_attention``. Against the float64 reference of ``test_attention.py``
(the sink written as one more key column with a zero value, an independent formulation of the
op's logsumexp term), with the sink logits' gradient; a closed form for one key; masks, padding,
GQA, bias, dropout and packed ``thd`` batches; compile without graph breaks; autocast; bad
arguments."""

from __future__ import annotations

import math

import pytest
import torch

import te_compile as te
from te_compile.functional.dropout_ops import dropout_mask
from tests.functional.test_attention import (
    check_forward_backward,
    from_output,
    make_qkv,
    reference,
    to_format,
    visible_mask,
)
from tests.utils import assert_close, assert_matches_eager, compile_counted

F = te.functional
SINK_TYPES = ["off-by-one", "learnable"]


def _sink(h, softmax_type, seed=20):
    """``(reference float64 [h], test fp32 [h] or None)``: the sink logits, spread over a few
    units so that the sink takes a visible share of some rows and almost none of others."""
    if softmax_type == "off-by-one":
        return torch.zeros(h, dtype=torch.float64), None
    gen = torch.Generator().manual_seed(seed)
    test = (torch.randn(h, generator=gen) * 2).requires_grad_()
    return test.detach().double().requires_grad_(), test


CASES = {
    # mask type, (sq, skv), (h, hk), qkv_format
    "causal_gqa_sbhd": ("causal", (5, 5), (4, 2), "sbhd"),
    "bottom_right_sq>skv_mqa": ("causal_bottom_right", (7, 4), (4, 1), "bshd"),  # rows see none
    "padding_causal": ("padding_causal", (6, 6), (2, 2), "bshd"),  # padded rows see none
    "arbitrary_empty_row": ("arbitrary", (5, 4), (3, 3), "bshd"),
    "no_mask_cross_bias": ("no_mask", (3, 6), (2, 2), "sbhd"),
}


@pytest.mark.parametrize("softmax_type", SINK_TYPES)
@pytest.mark.parametrize("case", CASES)
def test_sink_matches_reference(case, softmax_type):
    mask_type, (sq, skv), (h, hk), qkv_format = CASES[case]
    b, d = 2, 8
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, sq, skv, h, hk, d, seed=21)
    sr, st = _sink(h, softmax_type)
    q_lens = kv_lens = mask = bias = None
    kwargs, inputs = {}, [(qr, qt), (kr, kt), (vr, vt)]
    if "padding" in mask_type:
        q_lens, kv_lens = [sq - 2, sq], [skv, skv - 3]
        q_pad = torch.arange(sq)[None] >= torch.tensor(q_lens)[:, None]
        kv_pad = torch.arange(skv)[None] >= torch.tensor(kv_lens)[:, None]
        kwargs["attention_mask"] = (q_pad[:, None, None], kv_pad[:, None, None])
    if mask_type == "arbitrary":
        mask = torch.rand(b, 1, sq, skv, generator=torch.Generator().manual_seed(22)) < 0.3
        mask[1, 0, 2] = True  # a row that sees no key: only the sink
        kwargs["attention_mask"] = mask
    if case.endswith("bias"):
        br, bt = make_qkv(1, sq, skv, h, h, skv, seed=23)[0]  # any [1, sq, h, skv] draw
        br, bt = (x.transpose(1, 2).detach().requires_grad_() for x in (br, bt))
        kwargs.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bt)
        bias, inputs = br, inputs + [(br, bt)]
    if st is not None:
        inputs.append((sr, st))
    y = F.dot_product_attention(
        to_format(qt, qkv_format),
        to_format(kt, qkv_format),
        to_format(vt, qkv_format),
        qkv_format=qkv_format,
        attn_mask_type=mask_type,
        softmax_type=softmax_type,
        softmax_offset=st,
        **kwargs,
    )
    visible = visible_mask(b, h, sq, skv, mask_type, None, q_lens, kv_lens, mask)
    ref = reference(qr, kr, vr, visible, d**-0.5, bias, sink=sr)
    check_forward_backward(from_output(y, qkv_format, b, sq, h), ref, inputs, torch.float32)


def test_one_key_closed_form():
    """One query, one key: vanilla gives ``v``; off-by-one ``v e^s / (1 + e^s)``; learnable
    ``v e^s / (e^a + e^s)``, ``s`` the scaled score."""
    q = torch.tensor([1.0, 2.0, 0.0, -1.0]).view(1, 1, 1, 4)
    k = torch.tensor([0.5, 1.0, 3.0, 2.0]).view(1, 1, 1, 4)
    v = torch.tensor([2.0, -4.0, 1.0, 8.0]).view(1, 1, 1, 4)
    kw = {"qkv_format": "bshd", "attn_mask_type": "no_mask"}
    s = (q * k).sum().item() / 2.0  # scale 1/sqrt(4)
    alpha = torch.tensor([0.7])
    expected = {
        "vanilla": v,
        "off-by-one": v * math.exp(s) / (1.0 + math.exp(s)),
        "learnable": v * math.exp(s) / (math.exp(0.7) + math.exp(s)),
    }
    for softmax_type, want in expected.items():
        offset = alpha if softmax_type == "learnable" else None
        got = F.dot_product_attention(
            q, k, v, softmax_type=softmax_type, softmax_offset=offset, **kw
        )
        assert_close(got.view(4), want.view(4).double(), torch.float32)


def test_learnable_sink_limits():
    """A learnable sink at 0 is off-by-one exactly; far below the scores it is vanilla."""
    (_, q), (_, k), (_, v) = make_qkv(2, 5, 5, 2, 2, 8, seed=24)
    kw = {"qkv_format": "bshd"}
    off_by_one = F.dot_product_attention(q, k, v, softmax_type="off-by-one", **kw)
    zero = F.dot_product_attention(
        q, k, v, softmax_type="learnable", softmax_offset=torch.zeros(2), **kw
    )
    assert torch.equal(zero, off_by_one)
    vanilla = F.dot_product_attention(q, k, v, **kw)
    low = F.dot_product_attention(
        q, k, v, softmax_type="learnable", softmax_offset=torch.full((2,), -60.0), **kw
    )
    assert torch.equal(low, vanilla)
    assert not torch.allclose(off_by_one, vanilla)


@pytest.mark.parametrize("softmax_type", SINK_TYPES)
def test_sink_with_dropout(softmax_type):
    """Dropout acts on the keys' probabilities of the sink softmax (the sink's own is not an
    output: its value is zero), with the op's Philox mask over ``[b, h, sq, skv]``."""
    b, h, s, d, p = 2, 2, 6, 8, 0.3
    (qr, qt), (kr, kt), (vr, vt) = make_qkv(b, s, s, h, h, d, seed=25)
    sr, st = _sink(h, softmax_type, seed=26)
    state = torch.tensor([91, 4])
    y = F.dot_product_attention(
        qt, kt, vt, qkv_format="bshd", attn_mask_type="causal", dropout_p=p, rng_state=state,
        softmax_type=softmax_type, softmax_offset=st,
    )  # fmt: skip
    keep = dropout_mask(state, (b, h, s, s), p)
    ref = reference(
        qr, kr, vr, visible_mask(b, h, s, s, "causal"), d**-0.5, sink=sr, keep=keep, p_drop=p
    )
    inputs = [(qr, qt), (kr, kt), (vr, vt)] + ([(sr, st)] if st is not None else [])
    check_forward_backward(y.reshape(b, s, h, d), ref, inputs, torch.float32)


def test_thd_sink_per_sequence():
    """Packed sequences with a learnable sink: each sequence's output equals attention on it
    alone, and the sink's gradient is the sum of the sequences' gradients."""
    h, d = 2, 8
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    (_, q), (_, k), (_, v) = make_qkv(1, 9, 9, h, h, d, seed=27)
    q, k, v = q[0].detach(), k[0].detach(), v[0].detach()
    sink = torch.tensor([0.5, -1.5], requires_grad=True)
    kw = {"attn_mask_type": "padding_causal", "softmax_type": "learnable"}
    y = F.dot_product_attention(
        q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, softmax_offset=sink, **kw
    )
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(28))
    y.backward(grad)
    total = torch.zeros(h)
    for lo, hi in ((0, 3), (3, 4), (4, 8)):
        si = sink.detach().requires_grad_()
        yi = F.dot_product_attention(
            q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], qkv_format="bshd",
            attn_mask_type="causal", softmax_type="learnable", softmax_offset=si,
        )  # fmt: skip
        yi.backward(grad[None, lo:hi])
        assert_close(y[lo:hi], yi[0].double(), torch.float32)
        total += si.grad
    assert not y[8:].any()
    assert_close(sink.grad, total.double(), torch.float32, reduced=True)


@pytest.mark.parametrize("softmax_type", SINK_TYPES)
def test_compiled_fullgraph_matches_eager(softmax_type):
    """One frame, no graph break; output and gradients (the sink's too) as in eager."""
    torch._dynamo.reset()

    def fn(q, k, v, sink):
        return F.dot_product_attention(
            q, k, v, attn_mask_type="causal", softmax_type=softmax_type, softmax_offset=sink
        )

    gen = torch.Generator().manual_seed(29)
    args = [torch.randn(5, 2, 4, 8, generator=gen, requires_grad=True) for _ in range(3)]
    sink = torch.randn(4, generator=gen).requires_grad_() if softmax_type == "learnable" else None
    compiled, counter = compile_counted(fn)
    out = compiled(*args, sink)
    out.sum().backward()
    eager = [a.detach().requires_grad_() for a in args]
    eager_sink = None if sink is None else sink.detach().requires_grad_()
    expected = fn(*eager, eager_sink)
    expected.sum().backward()
    assert_matches_eager(out, expected)
    for a, e in zip(args, eager, strict=True):
        assert_matches_eager(a.grad, e.grad)
    if sink is not None:
        assert_matches_eager(sink.grad, eager_sink.grad)
    assert counter.frame_count == 1


def test_autocast_keeps_the_sink_fp32_and_a_bf16_sink_gets_its_gradient():
    """Under autocast q, k and v run in bf16 and the sink logits stay fp32 (the op takes them
    so); a bf16 sink (a module cast with ``.to(torch.bfloat16)``, as Transformer Engine's tests
    do) is computed in fp32 and gets a bf16 gradient."""
    (_, q), (_, k), (_, v) = make_qkv(2, 5, 5, 2, 2, 8, seed=30)
    sink = torch.tensor([0.25, -0.5])
    kw = {"qkv_format": "bshd", "softmax_type": "learnable"}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.dot_product_attention(q, k, v, softmax_offset=sink, **kw)
    assert y.dtype == torch.bfloat16
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    assert torch.equal(y, F.dot_product_attention(qb, kb, vb, softmax_offset=sink, **kw))
    sink_bf16 = sink.bfloat16().requires_grad_()
    F.dot_product_attention(qb, kb, vb, softmax_offset=sink_bf16, **kw).sum().backward()
    assert sink_bf16.grad.dtype == torch.bfloat16 and sink_bf16.grad.abs().sum() > 0


BAD = [
    (dict(softmax_type="softmax"), "softmax_type must be one of ('vanilla', 'off-by-one', "),
    (dict(softmax_type="learnable"), "softmax_type='learnable' needs softmax_offset"),
    (dict(softmax_offset=torch.zeros(4)), "softmax_offset must be None for softmax_type="),
    (
        dict(softmax_type="off-by-one", softmax_offset=torch.zeros(4)),
        "softmax_offset must be None for softmax_type='off-by-one'",
    ),
    (
        dict(softmax_type="learnable", softmax_offset=torch.zeros(2)),
        "softmax_offset must be a floating tensor [4] (one logit per query head)",
    ),
    (
        dict(softmax_type="learnable", softmax_offset=torch.zeros(4, dtype=torch.int64)),
        "softmax_offset must be a floating tensor [4]",
    ),
]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_bad_softmax_arguments(kwargs, message, mode):
    q, k, v = torch.randn(5, 2, 4, 8), torch.randn(5, 2, 2, 8), torch.randn(5, 2, 2, 8)

    def fn(q, k, v):
        return F.dot_product_attention(q, k, v, **kwargs)

    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"te\.dot_product_attention: ") as info:
        fn(q, k, v)
    assert message in str(info.value)
    if mode == "eager":
        assert info.type is ValueError


def test_op_checks_the_sink():
    q = torch.randn(1, 4, 2, 8)
    args = [q, q, q] + [None] * 8 + [torch.zeros(2, dtype=torch.float64)]
    args += [1.0, -1, -1, True, 0.0, 4, 4, False]
    with pytest.raises(ValueError, match=r"te\.attention_fwd: softmax_offset must be float32"):
        torch.ops.te.attention_fwd(*args)
