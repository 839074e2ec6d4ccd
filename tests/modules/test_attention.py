"""``te.DotProductAttention``: Transformer Engine's constructor and forward arguments (defaults,
kv_channels pairs, GQA, tensor-parallel head counts, per-call overrides), dropout in training only
and under activation checkpointing, the sink softmax types and their parameter (through
``MultiheadAttention`` and ``TransformerLayer`` too), a compiled module without graph breaks or
recompiles, and bad arguments named in the error."""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils.checkpoint

import te_compile as te
from tests.utils import assert_matches_eager, behaviour_backend, compile_counted


def _qkv(s=5, b=2, h=4, hk=2, d=8, dv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(s, b, h, d, generator=gen).requires_grad_(),
        torch.randn(s, b, hk, d, generator=gen).requires_grad_(),
        torch.randn(s, b, hk, dv or d, generator=gen).requires_grad_(),
    )


def test_defaults_follow_transformer_engine():
    attn = te.DotProductAttention(4, 8)
    assert attn.qkv_format == "sbhd" and attn.attn_mask_type == "causal"
    assert attn.num_gqa_groups == 4 and attn.attention_dropout == 0.0
    assert attn.softmax_scale == pytest.approx(1 / math.sqrt(8))
    assert attn.layer_number == 1 and attn.attention_type == "self"
    assert te.DotProductAttention(4, 8, attn_mask_type="causal,padding").attn_mask_type == (
        "padding_causal"
    )


def test_forward_equals_functional_and_output_shape():
    q, k, v = _qkv()
    attn = te.DotProductAttention(4, 8, num_gqa_groups=2)
    y = attn(q, k, v)
    assert y.shape == (5, 2, 32)
    expected = te.functional.dot_product_attention(q, k, v, attn_mask_type="causal")
    assert torch.equal(y, expected)


def test_kv_channels_pair_and_softmax_scale():
    q, k, v = _qkv(hk=4, d=8, dv=12)
    attn = te.DotProductAttention(4, (8, 12), qkv_format="sbhd", attn_mask_type="no_mask")
    y = attn(q, k, v)
    assert y.shape == (5, 2, 4 * 12)
    scaled = te.DotProductAttention(4, (8, 12), attn_mask_type="no_mask", softmax_scale=0.1)
    expected = te.functional.dot_product_attention(
        q, k, v, attn_mask_type="no_mask", softmax_scale=0.1
    )
    assert torch.equal(scaled(q, k, v), expected)


def test_forward_overrides_mask_type_and_window():
    q, k, v = _qkv(hk=4)
    attn = te.DotProductAttention(4, 8)  # causal: window (-1, 0)
    y = attn(q, k, v, attn_mask_type="no_mask", window_size=(1, 1))
    expected = te.functional.dot_product_attention(
        q, k, v, attn_mask_type="no_mask", window_size=(1, 1)
    )
    assert torch.equal(y, expected)
    # The constructor's window is checked against the mask type of each call.
    windowed = te.DotProductAttention(4, 8, window_size=(2, 0))
    assert torch.equal(
        windowed(q, k, v),
        te.functional.dot_product_attention(q, k, v, window_size=(2, 0)),
    )
    with pytest.raises(ValueError, match="window_size must be"):
        windowed(q, k, v, attn_mask_type="no_mask", window_size=(-1, 0))


def test_tensor_parallel_heads_per_rank():
    attn = te.DotProductAttention(8, 8, num_gqa_groups=4, tp_size=2)
    assert attn.num_attention_heads_per_partition == 4
    assert attn.num_gqa_groups_per_partition == 2
    q, k, v = _qkv(h=4, hk=2)
    assert attn(q, k, v).shape == (5, 2, 32)
    with pytest.raises(ValueError, match=r"query has head count 8, but num_attention_heads"):
        attn(*_qkv(h=8, hk=2))


def test_bshd_and_thd_formats():
    q, k, v = (x.detach().transpose(0, 1).contiguous() for x in _qkv(hk=4))
    assert te.DotProductAttention(4, 8, qkv_format="bshd")(q, k, v).shape == (2, 5, 32)
    attn = te.DotProductAttention(4, 8, qkv_format="thd", attn_mask_type="padding_causal")
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    t = torch.randn(8, 4, 8)
    y = attn(t, t, t, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    assert y.shape == (8, 32) and not y[7:].any()


def test_dropout_in_training_only():
    q, k, v = _qkv(hk=4)
    attn = te.DotProductAttention(4, 8, attention_dropout=0.5)
    plain = te.functional.dot_product_attention(q, k, v)
    torch.manual_seed(0)
    assert not torch.equal(attn(q, k, v), plain)
    attn.eval()
    assert torch.equal(attn(q, k, v), plain)


def test_checkpointed_module_gives_identical_gradients():
    attn = te.DotProductAttention(4, 8, num_gqa_groups=2, attention_dropout=0.3)

    def grads(checkpoint):
        q, k, v = _qkv(seed=3)
        torch.manual_seed(11)
        if checkpoint:
            y = torch.utils.checkpoint.checkpoint(attn, q, k, v, use_reentrant=False)
        else:
            y = attn(q, k, v)
        y.backward(torch.ones_like(y))
        return y.detach(), q.grad, k.grad, v.grad

    for a, b in zip(grads(False), grads(True), strict=True):
        assert torch.equal(a, b)


def test_compiled_module_one_frame_for_new_sizes():
    torch._dynamo.reset()
    attn = te.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="causal_bottom_right")
    compiled, counter = compile_counted(attn, backend=behaviour_backend(), dynamic=True)
    # The first call's sizes differ from the head counts and dims: dynamo's duck sizing would tie
    # a size equal to a (guarded, static) head count to it.
    for s_q, s_kv, b in ((5, 7, 3), (6, 9, 2), (3, 4, 5)):
        gen = torch.Generator().manual_seed(s_q)
        q = torch.randn(s_q, b, 4, 8, generator=gen, requires_grad=True)
        k = torch.randn(s_kv, b, 2, 8, generator=gen, requires_grad=True)
        v = torch.randn(s_kv, b, 2, 8, generator=gen, requires_grad=True)
        y = compiled(q, k, v)
        y.sum().backward()
        qe, ke, ve = (x.detach().requires_grad_() for x in (q, k, v))
        ye = attn(qe, ke, ve)
        ye.sum().backward()
        assert_matches_eager(y, ye)
        for a, e in ((q, qe), (k, ke), (v, ve)):
            assert_matches_eager(a.grad, e.grad)
    assert counter.frame_count == 1


# Sink softmax ----------------------------------------------------------------------------------


def test_softmax_types_state_follows_transformer_engine():
    """``learnable``: one fp32 Parameter ``softmax_offset`` of the local heads, zeros at
    construction (Transformer Engine's name, shape and value); ``off-by-one`` and ``vanilla``:
    no state. The module computes the functional's sink softmax, and the sink gets a gradient."""
    assert te.DotProductAttention(4, 8).softmax_type == "vanilla"
    for softmax_type in ("vanilla", "off-by-one"):
        attn = te.DotProductAttention(4, 8, softmax_type=softmax_type)
        assert attn.softmax_offset is None and not attn.state_dict()
    attn = te.DotProductAttention(8, 8, num_gqa_groups=4, tp_size=2, softmax_type="learnable")
    assert list(attn.state_dict()) == ["softmax_offset"]
    offset = attn.softmax_offset
    assert isinstance(offset, torch.nn.Parameter) and offset.dtype == torch.float32
    assert offset.shape == (4,) and not offset.any()
    attn.load_state_dict({"softmax_offset": torch.tensor([0.5, -1.0, 2.0, 0.0])})
    q, k, v = _qkv()
    y = attn(q, k, v)
    expected = te.functional.dot_product_attention(
        q, k, v, softmax_type="learnable", softmax_offset=attn.softmax_offset.detach()
    )
    assert torch.equal(y, expected)
    y.sum().backward()
    assert attn.softmax_offset.grad.shape == (4,) and attn.softmax_offset.grad.abs().sum() > 0
    off = te.DotProductAttention(4, 8, num_gqa_groups=2, softmax_type="off-by-one")
    assert torch.equal(
        off(q, k, v), te.functional.dot_product_attention(q, k, v, softmax_type="off-by-one")
    )


def test_layers_pass_softmax_type_to_their_attention():
    """``MultiheadAttention`` and ``TransformerLayer`` (both attentions of a decoder) hold the
    learnable sink where Transformer Engine does, under its ``state_dict`` keys."""
    mha = te.MultiheadAttention(16, 2, softmax_type="learnable")
    assert mha.core_attention.softmax_type == "learnable"
    assert "core_attention.softmax_offset" in mha.state_dict()
    layer = te.TransformerLayer(16, 32, 2, layer_type="decoder", softmax_type="learnable")
    sinks = sorted(k for k in layer.state_dict() if k.endswith("softmax_offset"))
    assert sinks == [
        "inter_attention.core_attention.softmax_offset",
        "self_attention.core_attention.softmax_offset",
    ]
    x = torch.randn(4, 2, 16)
    layer(x, encoder_output=torch.randn(3, 2, 16)).sum().backward()
    assert layer.self_attention.core_attention.softmax_offset.grad is not None
    off = te.TransformerLayer(16, 32, 2, softmax_type="off-by-one")
    assert off.self_attention.core_attention.softmax_type == "off-by-one"
    for make in (
        lambda: te.MultiheadAttention(16, 2, softmax_type="sink"),
        lambda: te.TransformerLayer(16, 32, 2, softmax_type="sink"),
    ):
        with pytest.raises(ValueError, match=r"softmax_type must be one of \('vanilla'"):
            make()


def test_compiled_module_with_learnable_sink():
    """fullgraph, one frame, the sink Parameter's gradient as in eager (a bf16 module, as
    Transformer Engine's compile tests build it: the sink is cast to bf16 with the module)."""
    torch._dynamo.reset()
    attn = te.DotProductAttention(4, 8, num_gqa_groups=2, softmax_type="learnable")
    with torch.no_grad():
        attn.softmax_offset.copy_(torch.tensor([0.5, -1.0, 1.5, 0.0]))
    for dtype in (torch.float32, torch.bfloat16):
        torch._dynamo.reset()
        module = attn.to(dtype)
        compiled, counter = compile_counted(module, backend=behaviour_backend())
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(seed=5))
        y = compiled(q, k, v)
        y.sum().backward()
        grad = module.softmax_offset.grad
        module.softmax_offset.grad = None
        ye = module(q, k, v)
        ye.sum().backward()
        assert_matches_eager(y, ye)
        assert grad.dtype == dtype
        assert_matches_eager(grad, module.softmax_offset.grad)
        module.softmax_offset.grad = None
        assert counter.frame_count == 1


BAD_CONSTRUCTOR = [
    (
        dict(num_attention_heads=6, kv_channels=8, num_gqa_groups=4),
        "num_attention_heads (6) must be divisible by num_gqa_groups (4)",
    ),
    (
        dict(num_attention_heads=8, kv_channels=8, num_gqa_groups=2, tp_size=4),
        "must be divisible by tp_size (4)",
    ),
    (dict(num_attention_heads=0, kv_channels=8), "num_attention_heads must be a positive int"),
    (dict(num_attention_heads=4, kv_channels=(8, 0)), "kv_channels must be a positive int"),
    (dict(num_attention_heads=4, kv_channels=8, qkv_format="bhsd"), "qkv_format must be one of"),
    (
        dict(num_attention_heads=4, kv_channels=8, attn_mask_type="full"),
        "attn_mask_type must be one of",
    ),
    (
        dict(num_attention_heads=4, kv_channels=8, window_size=(3, 3)),
        "window_size must be (-1, 0) or (>=0, 0) for attn_mask_type='causal'",
    ),
    (
        dict(num_attention_heads=4, kv_channels=8, attention_dropout=1.5),
        "attention_dropout must be a float in [0, 1)",
    ),
    (
        dict(num_attention_heads=4, kv_channels=8, attention_type="encoder"),
        "attention_type must be one of",
    ),
    (
        dict(num_attention_heads=4, kv_channels=8, softmax_type="off_by_one"),
        "softmax_type must be one of ('vanilla', 'off-by-one', 'learnable'), got 'off_by_one'",
    ),
]


# A message that begins with the module's name (after dynamo's prefix, under compile).
_NAMED = r"(^|[^.])DotProductAttention: "


@pytest.mark.parametrize(("kwargs", "message"), BAD_CONSTRUCTOR)
def test_bad_constructor_arguments(kwargs, message):
    with pytest.raises(ValueError, match=_NAMED) as info:
        te.DotProductAttention(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize(
    ("qkv", "message"),
    [
        (dict(d=6), "query has head dim 6, but kv_channels gives 8"),
        (dict(dv=4), "value has head dim 4, but kv_channels gives 8"),
        (dict(h=2), "query has head count 2, but num_attention_heads gives 4"),
        (dict(hk=4), "key has head count 4, but num_gqa_groups gives 2"),
    ],
)
def test_bad_forward_arguments(qkv, message, mode):
    attn = te.DotProductAttention(4, 8, num_gqa_groups=2)
    shape = {"h": 4, "hk": 2, "d": 8, **qkv}
    q, k, v = _qkv(**shape)
    fn = attn
    if mode == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(attn, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=_NAMED) as info:
        fn(q, k, v)
    assert message in str(info.value)
    if mode == "eager":
        assert info.type is ValueError


def test_multihead_attention_with_input_layernorm_accumulates_into_main_grad():
    """fuse_wgrad_accumulation=True with input_layernorm=True: the QKV LayerNormLinear and the
    projection add their weight gradients into ``weight.main_grad``, as the module without the
    fusion computes them into ``weight.grad``."""
    torch.manual_seed(0)
    kw = {"input_layernorm": True, "attention_dropout": 0.0}
    plain = te.MultiheadAttention(32, 4, **kw)
    fused = te.MultiheadAttention(32, 4, fuse_wgrad_accumulation=True, **kw)
    fused.load_state_dict(plain.state_dict())
    gemms = [m for m in fused.modules() if isinstance(m, (te.Linear, te.LayerNormLinear))]
    assert len(gemms) == 2 and all(m.fuse_wgrad_accumulation for m in gemms)
    for m in gemms:
        m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)
    x = torch.randn(6, 2, 32)
    fused(x).square().sum().backward()
    plain(x).square().sum().backward()
    plain_gemms = [m for m in plain.modules() if isinstance(m, (te.Linear, te.LayerNormLinear))]
    for m, p in zip(gemms, plain_gemms, strict=True):
        assert m.weight.grad is None
        torch.testing.assert_close(m.weight.main_grad, p.weight.grad)


@pytest.mark.parametrize("mask_type", ["causal", "no_mask", "causal_bottom_right"])
def test_a_mask_the_mask_type_ignores_is_announced(mask_type):
    """attention_mask with a mask type that reads none is ignored, as in Transformer Engine,
    and said: the output is the unmasked one and a warning names the argument and the fix; a
    padding mask type takes it without a word."""
    import warnings

    q = torch.randn(4, 1, 2, 8)
    padded = torch.tensor([False, False, True, True]).view(1, 1, 1, 4)
    attn = te.DotProductAttention(2, 8, attn_mask_type=mask_type)
    with pytest.warns(
        UserWarning, match=rf"attention_mask is ignored with attn_mask_type='{mask_type}'"
    ):
        out = attn(q, q, q, attention_mask=padded)
    assert torch.equal(out, attn(q, q, q))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        te.DotProductAttention(2, 8, attn_mask_type="padding_causal")(
            q, q, q, attention_mask=padded
        )


def test_alibi_with_its_default_slopes_compiles_in_one_graph():
    """core_attention_bias_type="alibi" without alibi_slopes: the module makes the default
    slopes (``kernels.device_constant``) inside the traced forward; under dynamo that is a graph
    constant, with no graph break, and the compiled result is the eager one."""
    torch._dynamo.reset()
    attn = te.DotProductAttention(4, 8, num_gqa_groups=2, attn_mask_type="causal")
    q, k, v = _qkv()

    def f(q, k, v):
        return attn(q, k, v, core_attention_bias_type="alibi")

    compiled, counter = compile_counted(f, backend="aot_eager")
    y = compiled(q, k, v)
    assert counter.frame_count == 1
    assert_matches_eager(y, f(q, k, v))
