"""Where a converted Hugging Face Llama's bf16 logits lose accuracy against the fp32 model.

``examples/convert_hf_llama.py`` checks our bf16 logits against the same weights in fp32 next to
transformers' own bf16 model. This breaks that comparison down, forward only, no compile:

1. logits: the relative error of ours and of transformers' bf16 model against the fp32 model,
   for each ``--configs`` entry (``hidden:layers:heads:kv_heads:ffn:batch:seq``);
2. per layer of the last config: each bf16 decoder layer run on the fp32 model's input to that
   layer, against the fp32 layer's output (ours and transformers');
3. per block of layer 0: our ``layernorm_mlp`` against the fp32 RMSNorm + MLP, and our
   ``core_attention`` (``te.DotProductAttention``) against fp32 causal SDPA on the same q / k / v.

    python -m bench.diag.diag_hf_accuracy --device cuda
    python -m bench.diag.diag_hf_accuracy --configs 2048:2:32:8:8192:4:2048 2048:2:32:8:8192:4:1024
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import te_compile as te
from te_compile.convert import _default_dtype as default_dtype

DEFAULT_CONFIGS = (
    "1024:4:16:4:2816:4:1024",
    "2048:2:32:8:8192:4:1024",
    "2048:2:32:8:8192:4:2048",
    "2048:8:32:8:8192:4:2048",
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def build(spec: str, device: str, cast: bool):
    import transformers

    hidden, layers, heads, kv, ffn, batch, seq = (int(v) for v in spec.split(":"))
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max(2048, seq),
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # As from_pretrained(dtype=torch.bfloat16) builds it (float32 rotary frequencies), unless
    # --cast: model.to(torch.bfloat16), which rounds the frequencies to bf16 too.
    with default_dtype(torch.float32 if cast else torch.bfloat16):
        hf = transformers.LlamaForCausalLM(config)
    hf = hf.to(device=device, dtype=torch.bfloat16 if cast else None).eval()
    exact = copy.deepcopy(hf).float().eval()
    ours = te.convert.from_hf(hf).eval()
    ids = torch.randint(0, 32000, (batch, seq), device=device)
    return hf, exact, ours, ids


def captured(layers) -> list[dict]:
    """Pre-hooks keeping each layer's call (args, kwargs) and post-hooks its output."""
    calls: list[dict] = [{} for _ in layers]
    for i, layer in enumerate(layers):

        def pre(mod, args, kwargs, i=i):
            calls[i]["args"], calls[i]["kwargs"] = args, kwargs

        def post(mod, args, kwargs, out, i=i):
            calls[i]["out"] = out[0] if isinstance(out, tuple) else out

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)
    return calls


def hidden_of(call: dict) -> torch.Tensor:
    return call["args"][0] if call["args"] else call["kwargs"]["hidden_states"]


def rerun(layer, call: dict, x: torch.Tensor) -> torch.Tensor:
    args, kwargs = list(call["args"]), dict(call["kwargs"])
    if args:
        args[0] = x
    else:
        kwargs["hidden_states"] = x
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    p.add_argument(
        "--cast", action="store_true",
        help="build transformers' model in fp32 and cast it (model.to(torch.bfloat16)): its "
        "rotary frequencies are then rounded to bf16, in the fp32 reference too",
    )  # fmt: skip
    args = p.parse_args()

    print("1. logits against the fp32 model (hidden:layers:heads:kv:ffn:batch:seq)")
    for spec in args.configs:
        hf, exact, ours, ids = build(spec, args.device, args.cast)
        ref = exact(ids).logits
        print(f"  {spec}: te_compile {rel(ours(ids), ref):.2e}, "
              f"transformers {rel(hf(ids).logits, ref):.2e}")  # fmt: skip
        del hf, exact, ours

    hf, exact, ours, ids = build(args.configs[-1], args.device, args.cast)
    ref_calls, hf_calls = captured(exact.model.layers), captured(hf.model.layers)
    our_calls = captured(ours.layers)
    exact(ids), hf(ids), ours(ids)
    print(f"2. per layer, on the fp32 model's input to the layer ({args.configs[-1]})")
    for i, (rc, hc, oc) in enumerate(zip(ref_calls, hf_calls, our_calls, strict=True)):
        x = hidden_of(rc).to(torch.bfloat16)
        want = rc["out"]
        # The residual dominates a layer's output: compare the layer's update too.
        ours_out, hf_out = rerun(ours.layers[i], oc, x), rerun(hf.model.layers[i], hc, x)
        base = hidden_of(rc)
        print(f"  layer {i}: output te_compile {rel(ours_out, want):.2e}, transformers "
              f"{rel(hf_out, want):.2e}; update (output - input) te_compile "
              f"{rel(ours_out.float() - base, want - base):.2e}, transformers "
              f"{rel(hf_out.float() - base, want - base):.2e}")  # fmt: skip

    print("3. blocks of layer 0")
    x = hidden_of(ref_calls[0])
    ref_layer = exact.model.layers[0]
    want = ref_layer.mlp(ref_layer.post_attention_layernorm(x))
    got = ours.layers[0].layernorm_mlp(x.to(torch.bfloat16))
    got = got[0] if isinstance(got, tuple) else got
    print(f"  layernorm_mlp: {rel(got, want):.2e}")
    # Self-attention (norm, QKV, RoPE, core attention, projection) on the layer inputs of
    # layers 0 and 1 (layer 0's: the embeddings, small), with and without RoPE (identity
    # cos / sin for transformers, no rotary_pos_emb for ours).
    ours_kw = {k: v for k, v in our_calls[0]["kwargs"].items() if k == "rotary_pos_emb"}
    hf_kw = dict(hf_calls[0]["kwargs"])
    for src in (0, 1):
        x = hidden_of(ref_calls[src])
        for rope in (True, False):
            kw = dict(ours_kw) if rope else {}
            pe = hf_kw["position_embeddings"]
            if not rope:
                pe = (torch.ones_like(pe[0]), torch.zeros_like(pe[1]))
            hkw = {"position_embeddings": pe, "attention_mask": hf_kw.get("attention_mask")}
            want = ref_layer.self_attn(
                ref_layer.input_layernorm(x),
                position_embeddings=tuple(t.float() for t in pe),
                attention_mask=hkw["attention_mask"],
            )[0]
            hl = hf.model.layers[0]
            theirs = hl.self_attn(hl.input_layernorm(x.to(torch.bfloat16)), **hkw)[0]
            got = ours.layers[0].self_attention(x.to(torch.bfloat16), **kw)
            got = got[0] if isinstance(got, tuple) else got
            print(f"  self_attention on layer {src}'s input, rope {rope}: te_compile "
                  f"{rel(got, want):.2e}, transformers {rel(theirs, want):.2e}")  # fmt: skip
    hidden, _, heads, kv, _, batch, seq = (int(v) for v in args.configs[-1].split(":"))
    d = hidden // heads
    g = torch.Generator(device=args.device).manual_seed(1)
    q = torch.randn(batch, seq, heads, d, device=args.device, generator=g)
    k = torch.randn(batch, seq, kv, d, device=args.device, generator=g)
    v = torch.randn(batch, seq, kv, d, device=args.device, generator=g)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(heads // kv, 1),
        v.transpose(1, 2).repeat_interleave(heads // kv, 1), is_causal=True,
    ).transpose(1, 2).reshape(batch, seq, hidden)  # fmt: skip
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    got = ours.layers[0].self_attention.core_attention(*bf)
    sdpa = F.scaled_dot_product_attention(
        bf[0].transpose(1, 2), bf[1].transpose(1, 2).repeat_interleave(heads // kv, 1),
        bf[2].transpose(1, 2).repeat_interleave(heads // kv, 1), is_causal=True,
    ).transpose(1, 2).reshape(batch, seq, hidden)  # fmt: skip
    print(f"  core_attention (random q/k/v): te_compile {rel(got, want):.2e}, torch bf16 SDPA "
          f"{rel(sdpa, want):.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
