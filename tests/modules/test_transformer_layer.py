"""MultiheadAttention and TransformerLayer against a float64 transformer layer written here in
plain PyTorch from the modules' parameters (Transformer Engine's names)."""

from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn.functional as F

import te_compile as te
from tests.utils import (
    DEVICES,
    GraphRecorder,
    assert_close,
    assert_matches_eager,
    compile_counted,
    requires_cuda,
    start_cuda_graph_case,
)

H, FFN, HEADS = 32, 48, 4


# The reference ------------------------------------------------------------------------------


def _norm(x, weight, bias, normalization, eps=1e-5):
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _act(z, activation):
    if activation == "swiglu":
        a, b = z.chunk(2, -1)
        return F.silu(a) * b
    if activation == "gelu":
        return F.gelu(z, approximate="tanh")
    return F.relu(z)


def _rope(x, freqs):
    """``x`` [b, s, h, d] rotated by ``freqs`` [s, 1, 1, d'] (non-interleaved halves)."""
    f = freqs[: x.shape[1], 0, 0].double()[None, :, None, :]
    d = f.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    a, b = rot.chunk(2, -1)
    return torch.cat((rot * f.cos() + torch.cat((-b, a), -1) * f.sin(), rest), -1)


def _attention(q, k, v, causal):
    """``q`` [b, s, hq, d], ``k``/``v`` [b, s, hkv, d] -> [b, s, hq * d]."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), -math.inf)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    return out.reshape(*out.shape[:2], -1)


def _p(module, name):
    t = getattr(module, name, None)
    return None if t is None else t.detach().double().cpu()


def _mha_ref(mha, x, normalization, causal=True, freqs=None, encoder=None):
    """MultiheadAttention (``input_layernorm``, pre-norm, not interleaved) in float64; ``x``
    [b, s, h]. Returns ``(out_without_proj_bias, proj_bias, ln_out)``."""
    d, g = mha.hidden_size_per_attention_head, mha.num_gqa_groups
    hq = mha.num_attention_heads
    if mha.attention_type == "self":
        lin = mha.layernorm_qkv
        ln = _norm(x, _p(lin, "layer_norm_weight"), _p(lin, "layer_norm_bias"), normalization)
        q = F.linear(ln, _p(lin, "query_weight"), _p(lin, "query_bias"))
        k = F.linear(ln, _p(lin, "key_weight"), _p(lin, "key_bias"))
        v = F.linear(ln, _p(lin, "value_weight"), _p(lin, "value_bias"))
    else:
        lin = mha.layernorm_query
        ln = _norm(x, _p(lin, "layer_norm_weight"), _p(lin, "layer_norm_bias"), normalization)
        q = F.linear(ln, _p(lin, "query_weight"), _p(lin, "query_bias"))
        kv = mha.key_value
        k = F.linear(encoder, _p(kv, "key_weight"), _p(kv, "key_bias"))
        v = F.linear(encoder, _p(kv, "value_weight"), _p(kv, "value_bias"))
    q = q.unflatten(-1, (hq, d))
    k, v = k.unflatten(-1, (g, d)), v.unflatten(-1, (g, d))
    if freqs is not None:
        q, k = _rope(q, freqs), _rope(k, freqs)
    ctx = _attention(q, k, v, causal)
    return F.linear(ctx, _p(mha.proj, "weight")), _p(mha.proj, "bias"), ln


def _layer_ref(layer, x, normalization, activation, freqs=None, encoder=None, post_ln=False):
    """TransformerLayer (eval, ``bshd``) in float64."""
    attn, bias, ln = _mha_ref(layer.self_attention, x, normalization, freqs=freqs)
    residual = ln if post_ln else x
    h = residual + (attn if bias is None else attn + bias)
    if encoder is not None:
        cross, bias, ln = _mha_ref(
            layer.inter_attention, h, normalization, causal=False, encoder=encoder
        )
        residual = ln if post_ln else h
        h = residual + (cross if bias is None else cross + bias)
    mlp = layer.layernorm_mlp
    ln = _norm(h, _p(mlp, "layer_norm_weight"), _p(mlp, "layer_norm_bias"), normalization)
    z = _act(F.linear(ln, _p(mlp, "fc1_weight"), _p(mlp, "fc1_bias")), activation)
    out = F.linear(z, _p(mlp, "fc2_weight"), _p(mlp, "fc2_bias"))
    return (ln if post_ln else h) + out


def _layer(device, dtype=torch.float32, **kw):
    args = {
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "attn_input_format": "bshd",
        "params_dtype": dtype,
        "device": device,
    }
    layer = te.TransformerLayer(H, FFN, HEADS, **{**args, **kw})
    with torch.no_grad():  # non-trivial norm parameters and biases
        for name, p in layer.named_parameters():
            if "layer_norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return layer.eval()


# State dict names ---------------------------------------------------------------------------

MLP_NAMES = ("layer_norm_weight", "layer_norm_bias", "fc1_weight", "fc1_bias", "fc2_weight",
             "fc2_bias")  # fmt: skip


def test_state_dict_has_transformer_engines_names():
    layer = te.TransformerLayer(H, FFN, HEADS, num_gqa_groups=2, device="cpu")
    keys = {k for k in layer.state_dict() if not k.endswith("_extra_state")}
    qkv = "self_attention.layernorm_qkv."
    expected = {
        *(qkv + n for n in ("layer_norm_weight", "layer_norm_bias")),
        *(qkv + f"{p}_{w}" for p in ("query", "key", "value") for w in ("weight", "bias")),
        "self_attention.proj.weight",
        "self_attention.proj.bias",
        *(f"layernorm_mlp.{n}" for n in MLP_NAMES),
    }
    assert expected <= keys, expected - keys
    assert layer.state_dict()[qkv + "key_weight"].shape == (H // HEADS * 2, H)
    fused = te.TransformerLayer(H, FFN, HEADS, fuse_qkv_params=True, device="cpu")
    assert "self_attention.layernorm_qkv.weight" in fused.state_dict()


def test_split_qkv_state_dict_round_trip():
    a = _layer("cpu", num_gqa_groups=2)
    b = _layer("cpu", num_gqa_groups=2)
    state = a.state_dict()
    b.load_state_dict(state)
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    state.pop("self_attention.layernorm_qkv.key_weight")
    with pytest.raises(RuntimeError, match=r"key_weight|weight"):
        b.load_state_dict(state)


# Numerics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "config",
    [
        {"normalization": "RMSNorm", "activation": "swiglu", "bias": False, "num_gqa_groups": 2},
        {"normalization": "LayerNorm", "activation": "gelu", "bias": True},
        {"normalization": "LayerNorm", "activation": "gelu", "num_gqa_groups": 1},  # MQA
    ],
)
def test_layer_matches_reference(device, config):
    layer = _layer(device, **config)
    x = torch.randn(2, 6, H, device=device, requires_grad=True)
    out = layer(x)
    x64 = x.detach().double().cpu().requires_grad_()
    ref = _layer_ref(layer, x64, config["normalization"], config["activation"])
    assert_close(out, ref, torch.float32, roundings=8)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, roundings=16, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_with_rotary_embedding_matches_reference(device):
    layer = _layer(device, normalization="RMSNorm", activation="swiglu", num_gqa_groups=2)
    freqs = te.RotaryPositionEmbedding(H // HEADS)(8).to(device)
    x = torch.randn(2, 8, H, device=device)
    ref = _layer_ref(layer, x.double().cpu(), "RMSNorm", "swiglu", freqs=freqs.cpu())
    assert_close(layer(x, rotary_pos_emb=freqs), ref, torch.float32, roundings=8)


def test_residual_after_norm_matches_reference():
    layer = _layer("cpu", apply_residual_connection_post_layernorm=True)
    x = torch.randn(2, 5, H)
    ref = _layer_ref(layer, x.double(), "LayerNorm", "gelu", post_ln=True)
    assert_close(layer(x), ref, torch.float32, roundings=8)


def test_decoder_cross_attention_matches_reference():
    layer = _layer("cpu", layer_type="decoder")
    x, enc = torch.randn(2, 5, H), torch.randn(2, 7, H)
    ref = _layer_ref(layer, x.double(), "LayerNorm", "gelu", encoder=enc.double())
    assert_close(layer(x, encoder_output=enc), ref, torch.float32, roundings=8)
    with pytest.raises(ValueError, match="encoder_output"):
        layer(x)


def test_output_layernorm_and_parallel_attention_mlp():
    x = torch.randn(2, 5, H)
    bert = _layer("cpu", output_layernorm=True)
    assert hasattr(bert.self_attention, "qkv") and hasattr(bert, "layernorm")
    h = x.double()
    attn = bert.self_attention
    d = H // HEADS
    q = F.linear(h, _p(attn.qkv, "query_weight"), _p(attn.qkv, "query_bias")).unflatten(
        -1, (HEADS, d)
    )
    k = F.linear(h, _p(attn.qkv, "key_weight"), _p(attn.qkv, "key_bias")).unflatten(-1, (HEADS, d))
    v = F.linear(h, _p(attn.qkv, "value_weight"), _p(attn.qkv, "value_bias")).unflatten(
        -1, (HEADS, d)
    )
    h = h + F.linear(_attention(q, k, v, True), _p(attn.proj, "weight"), _p(attn.proj, "bias"))
    mlp = bert.layernorm_mlp
    ln = _norm(h, _p(mlp, "layer_norm_weight"), _p(mlp, "layer_norm_bias"), "LayerNorm")
    z = _act(F.linear(ln, _p(mlp, "fc1_weight"), _p(mlp, "fc1_bias")), "gelu")
    h = h + F.linear(z, _p(mlp, "fc2_weight"), _p(mlp, "fc2_bias"))
    ref = _norm(h, _p(bert.layernorm, "weight"), _p(bert.layernorm, "bias"), "LayerNorm")
    assert_close(bert(x), ref, torch.float32, roundings=8)

    falcon = _layer("cpu", parallel_attention_mlp=True)
    attn, bias, _ = _mha_ref(falcon.self_attention, x.double(), "LayerNorm")
    mlp = falcon.layernorm_mlp
    ln = _norm(x.double(), _p(mlp, "layer_norm_weight"), _p(mlp, "layer_norm_bias"), "LayerNorm")
    z = _act(F.linear(ln, _p(mlp, "fc1_weight"), _p(mlp, "fc1_bias")), "gelu")
    ref = x.double() + attn + bias + F.linear(z, _p(mlp, "fc2_weight"), _p(mlp, "fc2_bias"))
    assert_close(falcon(x), ref, torch.float32, roundings=8)


def test_fused_interleaved_qkv_groups_heads_per_gqa_group():
    """``fuse_qkv_params=True`` with ``qkv_weight_interleaved``: rows [group][queries, k, v]."""
    groups, d = 2, H // HEADS
    a = _layer("cpu", num_gqa_groups=groups, fuse_qkv_params=True)
    b = _layer("cpu", num_gqa_groups=groups)
    w = a.self_attention.layernorm_qkv.weight.detach().view(groups, HEADS // groups + 2, d, H)
    bias = a.self_attention.layernorm_qkv.bias.detach().view(groups, HEADS // groups + 2, d)
    state = {k: v for k, v in a.state_dict().items() if "layernorm_qkv.weight" not in k
             and "layernorm_qkv.bias" not in k}  # fmt: skip
    prefix = "self_attention.layernorm_qkv."
    state[prefix + "query_weight"] = w[:, :-2].reshape(-1, H)
    state[prefix + "key_weight"] = w[:, -2].reshape(-1, H)
    state[prefix + "value_weight"] = w[:, -1].reshape(-1, H)
    state[prefix + "query_bias"] = bias[:, :-2].reshape(-1)
    state[prefix + "key_bias"] = bias[:, -2].reshape(-1)
    state[prefix + "value_bias"] = bias[:, -1].reshape(-1)
    b.load_state_dict(state)
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(a(x), b(x))


def test_fuse_wgrad_accumulation_puts_every_gemm_weight_gradient_in_main_grad():
    """TransformerLayer(fuse_wgrad_accumulation=True): QKV, the projection, FC1 and FC2 add
    their weight gradients into ``main_grad``, as the layer without the fusion computes them."""
    torch.manual_seed(0)
    kw = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "activation": "swiglu"}
    plain = te.TransformerLayer(32, 64, 4, **kw)
    fused = te.TransformerLayer(32, 64, 4, fuse_wgrad_accumulation=True, **kw)
    fused.load_state_dict(plain.state_dict())
    names = ["self_attention.layernorm_qkv.weight", "self_attention.proj.weight",
             "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight"]  # fmt: skip
    fused_params, plain_params = dict(fused.named_parameters()), dict(plain.named_parameters())
    for name in names:
        w = fused_params[name]
        w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    x = torch.randn(6, 2, 32)
    fused(x).square().sum().backward()
    plain(x).square().sum().backward()
    for name in names:
        assert fused_params[name].grad is None, name
        torch.testing.assert_close(fused_params[name].main_grad, plain_params[name].grad)


def test_hidden_dropout_trains_and_eval_is_deterministic():
    layer = _layer("cpu", hidden_dropout=0.5)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        assert torch.equal(layer(x), layer(x))
        layer.train()
        assert not torch.equal(layer(x), layer(x))


def test_sbhd_is_the_default_layout():
    layer = te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0).eval()
    x = torch.randn(5, 2, H)  # [seq, batch, hidden]
    ref = _layer_ref(layer, x.transpose(0, 1).double(), "LayerNorm", "gelu").transpose(0, 1)
    assert_close(layer(x), ref, torch.float32, roundings=8)


# Compile ------------------------------------------------------------------------------------


RECIPES = {
    "bf16": None,
    "current": te.recipe.Float8CurrentScaling,
    "delayed": te.recipe.DelayedScaling,
    "block": te.recipe.Float8BlockScaling,
}


# The FP8 stacks are long_compile (half a minute to two minutes each of Inductor's CPU compile
# on CI's 2 cores); the CPU keeps the bf16 stack here, and tests/test_trace_through.py compiles a
# block under current, delayed and block scaling.
@pytest.mark.parametrize(
    "recipe",
    [pytest.param(r, marks=pytest.mark.long_compile) if r != "bf16" else r for r in RECIPES],
)
def test_stack_compiles_without_breaks_or_recompiles(recipe):
    """Two layers train under torch.compile(fullgraph=True, dynamic=True): one frame for batch
    and sequence lengths that change (DelayedScaling: two, its first step calibrates with current
    scaling); the loss matches eager."""
    torch.manual_seed(0)
    kw = {"normalization": "RMSNorm", "activation": "swiglu", "bias": False, "num_gqa_groups": 2}
    stack = torch.nn.Sequential(*(_layer("cpu", **kw) for _ in range(2))).train()
    twin = torch.nn.Sequential(*(_layer("cpu", **kw) for _ in range(2))).train()
    twin.load_state_dict(stack.state_dict())
    factory = RECIPES[recipe]

    def step(model, x):
        with te.autocast(enabled=factory is not None, recipe=factory() if factory else None):
            return model(x).float().square().mean()

    compiled, counter = compile_counted(step, dynamic=True)
    # Token counts: multiples of 16 (FP8 GEMMs pad rows to 16: other counts are a second
    # graph), above Inductor's small-size thresholds (4096 elements), sizes unequal to the
    # model's dims (dynamo ties equal sizes of a first call together).
    for b, s in ((3, 48), (5, 64), (7, 80)):
        x = torch.randn(b, s, H)
        loss = compiled(stack, x)
        loss.backward()
        ref = step(twin, x)
        ref.backward()
        assert_matches_eager(loss, ref, roundings=16)
    assert counter.frame_count == (2 if recipe == "delayed" else 1)


@requires_cuda
@pytest.mark.parametrize("recipe", ["bf16", "current", "delayed"])
def test_stack_trains_under_cuda_graphs(recipe):
    """``mode="reduce-overhead"``: training steps of a Llama-style stack (RMSNorm, GQA, RoPE,
    SwiGLU; bf16 parameters) are captured in CUDA graphs with no skip and match eager."""
    factory = RECIPES[recipe]
    start_cuda_graph_case(factory)
    from torch._dynamo.utils import counters

    kw = {"normalization": "RMSNorm", "activation": "swiglu", "bias": False, "num_gqa_groups": 2}

    def stack():
        return torch.nn.ModuleList(_layer("cuda", torch.bfloat16, **kw) for _ in range(2)).train()

    eager, graphed = stack(), stack()
    graphed.load_state_dict(eager.state_dict())
    freqs = te.RotaryPositionEmbedding(H // HEADS)(32).cuda()
    recipes = [factory() if factory else None for _ in range(2)]

    def step(model, x, recipe):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            for layer in model:
                x = layer(x, rotary_pos_emb=freqs)
        return x

    call = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        for p in (*eager.parameters(), *graphed.parameters()):
            p.grad = None  # as zero_grad does: no gradient accumulated across replays
        x = torch.randn(2, 32, H, device="cuda", dtype=torch.bfloat16)
        torch.compiler.cudagraph_mark_step_begin()
        xg = x.clone().requires_grad_()
        out = call(graphed, xg, recipes[0])
        out.float().square().mean().backward()
        xe = x.clone().requires_grad_()
        expected = step(eager, xe, recipes[1])
        expected.float().square().mean().backward()
        # bf16 through two layers: Inductor's fusions round elsewhere than eager (the output and
        # the input gradient are sums of rounded terms: tolerances from the largest magnitude).
        assert_close(out, expected, torch.bfloat16, roundings=2, reduced=True)
        assert_close(xg.grad, xe.grad, torch.bfloat16, roundings=2, reduced=True)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


class TestGraphSnapshot(expecttest.TestCase):
    """The op sequence of a compiled Llama-style TransformerLayer (RMSNorm, GQA, RoPE, SwiGLU):
    a new graph break, a decomposed te op or an extra copy shows up as a diff here."""

    def test_llama_style_layer(self):
        torch._dynamo.reset()
        kw = {"normalization": "RMSNorm", "activation": "swiglu", "bias": False}
        layer = _layer("cpu", num_gqa_groups=2, **kw).train()
        freqs = te.RotaryPositionEmbedding(H // HEADS)(16)
        rec = GraphRecorder()
        x = torch.randn(2, 16, H, requires_grad=True)
        torch.compile(layer, backend=rec, fullgraph=True)(x, rotary_pos_emb=freqs).sum().backward()
        self.assertExpectedInline(
            rec.summary(),
            """\
forward:
  te.rmsnorm_fwd.default
  te.linear_fwd.default
  aten.split_with_sizes.default
  aten.view.default
  aten.view.default
  aten.view.default
  te.rotary_fwd.default
  te.rotary_fwd.default
  te.attention_fwd.default
  aten.detach.default
  aten.view.default
  te.linear_fwd.default
  aten.add.Tensor
  te.rmsnorm_fwd.default
  te.mlp_fwd.default
  aten.add.Tensor
backward:
  auto_functionalized_v2(te.mlp_bwd.default)
  te.rmsnorm_bwd.default
  aten.add.Tensor
  auto_functionalized_v2(te.linear_bwd.default)
  aten.view.default
  aten.detach.default
  te.attention_bwd.default
  te.rotary_bwd.default
  te.rotary_bwd.default
  aten.view.default
  aten.view.default
  aten.view.default
  aten.cat.default
  auto_functionalized_v2(te.linear_bwd.default)
  te.rmsnorm_bwd.default
  aten.add.Tensor""",
        )


# Bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_attention_heads": 3}, "num_attention_heads|kv_channels"),
        ({"num_gqa_groups": 3}, "num_gqa_groups"),
        ({"layer_type": "middle"}, "layer_type"),
        ({"hidden_dropout": 1.5}, "hidden_dropout"),
        ({"attn_input_format": "hbsd"}, "attn_input_format"),
        ({"parallel_attention_mlp": True, "output_layernorm": True}, "parallel_attention_mlp"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    args = {"hidden_size": H, "ffn_hidden_size": FFN, "num_attention_heads": HEADS}
    with pytest.raises(ValueError, match=match):
        te.TransformerLayer(**{**args, **kwargs})


def test_unsupported_forward_arguments_raise():
    layer = _layer("cpu")
    x = torch.randn(2, 5, H)
    with pytest.raises(ValueError, match="inference_params"):
        layer(x, inference_params=object())


def test_fast_zero_fill_is_checked_and_changes_nothing():
    """Transformer Engine's forward(fast_zero_fill=...) zero-fills a padded THD layout's
    padding, which te_compile does not take: both values give the same output; a non-bool is
    refused naming it, in each module that takes it."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(6, 2, 32)
    torch.testing.assert_close(layer(x, fast_zero_fill=False), layer(x), rtol=0, atol=0)
    q = torch.randn(6, 2, 4, 8)
    for call in (
        lambda v: layer(x, fast_zero_fill=v),
        lambda v: layer.self_attention(x, fast_zero_fill=v),
        lambda v: te.DotProductAttention(4, 8)(q, q, q, fast_zero_fill=v),
    ):
        with pytest.raises(ValueError, match="fast_zero_fill"):
            call(1)
