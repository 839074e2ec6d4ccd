"""A Hugging Face Llama (or Qwen2 / Mistral) converted to a stack of te_compile TransformerLayers.

1. Builds the ``transformers`` model from a small config with random weights (no download).
2. Converts it with ``te_compile.convert.from_hf`` and compares the logits of both models on
   the same tokens: in fp32 directly; in bf16 each against the same weights in fp32, where ours
   must be as close as the original (the script fails otherwise).
3. Counts graph breaks of our model's training step (a Hugging Face loop's call:
   ``model(input_ids=, labels=).loss``) with ``torch._dynamo.explain``, then trains it compiled
   with ``fullgraph=True`` for a few steps.
4. Maps the trained weights back into a ``transformers`` model (``te_compile.convert.to_hf``,
   ready for ``save_pretrained``) and checks that it gives our logits.
5. Times a compiled training step (forward, cross-entropy, backward) of both models and prints
   tokens/s side by side, with the first two steps' seconds (compilation included; a
   delayed-scaling model compiles its calibrated step second); ours in bf16 and under each te
   FP8 recipe named by ``--recipes``.

Needs ``transformers`` (``pip install 'te-compile[hf]'``). Usage::

    python examples/convert_hf_llama.py                      # small config, CPU or GPU
    python examples/convert_hf_llama.py --arch qwen2 --steps 5
    python examples/convert_hf_llama.py --device cuda --dtype bfloat16 --hidden 2048 --layers 4
    python examples/convert_hf_llama.py --recipes none current delayed   # FP8 speeds too
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import torch._dynamo
import torch._inductor.utils

import te_compile as te

# --recipes: our model's precisions in the speed comparison (``none``: bf16, no FP8 autocast).
RECIPES = {
    "none": None,
    "current": te.recipe.Float8CurrentScaling,
    "delayed": te.recipe.DelayedScaling,
    "block": te.recipe.Float8BlockScaling,
}


def build_hf(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[args.arch]
    config = config_cls(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, args.seq),
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # Built as from_pretrained(dtype=...) builds it: parameters in the dtype, the rotary
    # frequencies float32. model.to(dtype) would round those too, and the reference below (that
    # model in fp32) would then carry angles off by radians at position 2,048.
    before = torch.get_default_dtype()
    torch.set_default_dtype(args.dtype)
    try:
        model = model_cls(config)
    finally:
        torch.set_default_dtype(before)
    return model.to(args.device)


def tokens_per_s(
    loss_fn, params: list[torch.Tensor], ids: torch.Tensor, iters: int
) -> tuple[float, list[float]]:
    """``(tokens/s, [first step s, second step s])``: training steps (forward, loss, backward;
    the gradients set to None before each, as ``zero_grad`` does) per second times the tokens
    of a step, and the first two steps' seconds (compilation included)."""

    def step() -> None:
        for p in params:
            p.grad = None
        loss_fn(ids).backward()

    def sync() -> None:
        if ids.is_cuda:
            torch.cuda.synchronize()

    firsts = []
    for _ in range(2):  # compiles; a delayed-scaling model compiles its calibrated step second
        start = time.perf_counter()
        step()
        sync()
        firsts.append(time.perf_counter() - start)
    step()  # warm up
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return ids.numel() * iters / (time.perf_counter() - start), firsts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=("llama", "qwen2", "mistral"), default="llama")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on GPU)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=3, help="compiled training steps of our model")
    p.add_argument("--iters", type=int, default=None, help="timed steps per model")
    p.add_argument(
        "--recipes", nargs="+", choices=tuple(RECIPES), default=["none"],
        help="our model's precisions in the speed comparison: none (bf16) and te FP8 recipes",
    )  # fmt: skip
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    defaults = (
        {"hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 4, "ffn": 2816, "vocab": 32000,
         "batch": 4, "seq": 1024, "iters": 30, "dtype": "bfloat16"}
        if gpu
        else {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
              "batch": 2, "seq": 32, "iters": 2, "dtype": "float32"}
    )  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = getattr(torch, args.dtype)

    hf = build_hf(args)
    ours = te.convert.from_hf(hf)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device)

    # 1. The same logits. In fp32 against the original directly. In bf16 two implementations
    # of one model round differently at every op, and with random weights the difference grows
    # with depth and width; so both are compared with the exact model (the original's weights
    # in fp32) and ours must be as close to it as the original is (or within 2e-2).
    hf.eval(), ours.eval()
    with torch.no_grad():
        actual, original = ours(ids).float(), hf(ids).logits.float()
        exact = copy.deepcopy(hf).float()(ids).logits if args.dtype != torch.float32 else None

    def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    if exact is None:
        rel, tol = rel_err(actual, original), 1e-4
        print(f"{args.arch}: logits relative error {rel:.2e} (tolerance {tol:.0e})")
    else:
        rel, theirs = rel_err(actual, exact), rel_err(original, exact)
        tol = max(1.25 * theirs, 2e-2)
        print(f"{args.arch}: logits relative error against the fp32 model: te_compile {rel:.2e}, "
              f"transformers {theirs:.2e} (tolerance {tol:.2e}); between the two "
              f"{rel_err(actual, original):.2e}")  # fmt: skip

    # 2. Graph breaks, then compiled training.
    hf.train(), ours.train()

    def ours_loss(batch: torch.Tensor) -> torch.Tensor:
        return ours(input_ids=batch, labels=batch).loss

    def hf_loss(batch: torch.Tensor) -> torch.Tensor:
        return hf(input_ids=batch, labels=batch).loss

    breaks = torch._dynamo.explain(ours_loss)(ids).graph_break_count
    print(f"graph breaks in our forward + loss: {breaks}")
    torch._dynamo.reset()
    compiled_ours = torch.compile(ours_loss, fullgraph=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    for i in range(args.steps):
        loss = compiled_ours(ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {i}: loss {loss.item():.4f}")

    # 3. The trained weights back in transformers' layout: the same logits.
    ours.eval()
    back = te.convert.to_hf(ours).eval()
    with torch.no_grad():
        back_rel = rel_err(back(ids).logits.float(), ours(ids).float())
    back_tol = 1e-4 if args.dtype == torch.float32 else tol
    print(f"to_hf: logits relative error {back_rel:.2e} (tolerance {back_tol:.0e})")
    ours.train()

    # 4. Speed of a compiled training step, side by side: a cold compile per precision (an
    # empty Inductor cache: the first step's seconds are a compile from scratch).
    device = torch.cuda.get_device_name() if gpu else "CPU"
    torch._dynamo.reset()
    with torch._inductor.utils.fresh_cache():
        hf_tps, hf_first = tokens_per_s(
            torch.compile(hf_loss), list(hf.parameters()), ids, args.iters
        )
    print(
        f"tokens/s on {device} ({args.dtype}, batch {args.batch} x seq {args.seq}), against "
        f"transformers compiled ({hf_tps:,.0f} tokens/s, first steps {hf_first[0]:.1f} s, "
        f"{hf_first[1]:.1f} s):"
    )
    for name in args.recipes:
        torch._dynamo.reset()
        recipe = RECIPES[name]() if RECIPES[name] else None

        def loss_under(batch: torch.Tensor, recipe=recipe) -> torch.Tensor:
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                return ours_loss(batch)

        compiled = torch.compile(loss_under, fullgraph=True)
        with torch._inductor.utils.fresh_cache():
            tps, first = tokens_per_s(compiled, list(ours.parameters()), ids, args.iters)
        label = "without FP8" if recipe is None else f"FP8 {name}"
        print(f"  te_compile {label}: {tps:,.0f} ({tps / hf_tps:.2f}x), first steps "
              f"{first[0]:.1f} s ({first[0] / hf_first[0]:.2f}x), {first[1]:.1f} s")  # fmt: skip
    ok = rel <= tol and back_rel <= back_tol and breaks == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
