"""Train a small character-level GPT built from te_compile's modules.

This is te_compile's main demo. It shows that a model built from te_compile modules
compiles with ``torch.compile(model, fullgraph=True)`` into a single graph: the whole
training step (forward, loss and backward) runs compiled, with zero graph breaks.

What it does:

1. Reads a small plain-text corpus shipped with the repository (the five books of Moses,
   King James Version, 0.8 MB; see ``examples/data/README.md``) and tokenises it by
   character.
2. Builds a GPT: token and position embeddings, pre-norm transformer blocks with causal
   self-attention (``F.scaled_dot_product_attention(is_causal=True)``) and an MLP, a final
   norm and an LM head. The pre-attention norm and the fused QKV projection are one
   ``te_compile.LayerNormLinear``, the attention output projection and the LM head are
   ``te_compile.Linear``, the pre-MLP norm and the MLP are one ``te_compile.LayerNormMLP``
   (GELU by default, ``--activation swiglu`` and the others work too) and the final norm is a
   ``te_compile.LayerNorm`` or ``te_compile.RMSNorm`` (``--normalization``, used by every norm).
   Embeddings, attention and the loss are plain PyTorch.
3. Counts graph breaks with ``torch._dynamo.explain`` before training, then trains the
   model compiled with ``fullgraph=True`` (which would raise on any break) using AdamW,
   and counts again whatever breaks Dynamo recorded during training.
4. Reports the held-out loss before and after training, the training throughput in
   tokens/s, and a sample of generated text. Exits with status 1 if the loss did not
   fall or a graph break was found, so the script doubles as a smoke test.

The default configuration depends on the device: on CPU a small model that finishes,
compile included, in about a minute on two cores; on CUDA a six-layer, 384-wide model
in bfloat16 that trains for a minute or two on an H100. Every setting can be
overridden from the command line; see ``--help``.

Usage::

    python examples/train_gpt.py                     # default config for the device
    python examples/train_gpt.py --steps 50 --layers 1 --width 32
    python examples/train_gpt.py --device cuda --dtype float32 --no-compile
    python examples/train_gpt.py --recipe delayed     # FP8 GEMMs in the transformer blocks
    python examples/train_gpt.py --dtype float32 --autocast bfloat16   # fp32 master weights
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import te_compile

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "pentateuch.txt"

# Defaults per device type; command-line flags override any of them.
DEFAULTS = {
    "cpu": dict(layers=2, width=128, heads=4, block_size=64, batch_size=32, steps=600, lr=3e-3),
    "cuda": dict(layers=6, width=384, heads=6, block_size=256, batch_size=64, steps=1500, lr=1e-3),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
RECIPES = {
    "none": lambda: None,
    "delayed": lambda: te_compile.recipe.DelayedScaling(amax_history_len=16),
    "current": te_compile.recipe.Float8CurrentScaling,
    # Emulated off Blackwell (exact quantisation, fp32 GEMMs): numerics, not speed.
    "block": te_compile.recipe.Float8BlockScaling,
    "mxfp8": te_compile.recipe.MXFP8BlockScaling,
    "nvfp4": te_compile.recipe.NVFP4BlockScaling,
}


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    layers: int
    width: int
    heads: int
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    recipe: str = "none"
    autocast: str | None = None  # torch.autocast dtype name: fp32 master weights, bf16 math
    fp8_margin: int = 0  # DelayedScaling.margin (--recipe delayed)
    amax_compute_algo: str = "max"  # DelayedScaling.amax_compute_algo (--recipe delayed)


class CausalSelfAttention(nn.Module):
    """Pre-norm attention: the norm and the QKV projection are one LayerNormLinear."""

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = te_compile.LayerNormLinear(
            cfg.width,
            3 * cfg.width,
            bias=True,
            normalization=cfg.normalization,
            params_dtype=dtype,
            device=device,
        )
        self.proj = te_compile.Linear(
            cfg.width, cfg.width, bias=True, params_dtype=dtype, device=device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        # [B, T, C] -> [B, heads, T, head_dim]
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)); each norm lives
    in the te_compile module that follows it."""

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.attn = CausalSelfAttention(cfg, dtype, device)
        self.mlp = te_compile.LayerNormMLP(
            cfg.width,
            4 * cfg.width,
            bias=True,
            activation=cfg.activation,
            normalization=cfg.normalization,
            params_dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width, dtype=dtype, device=device)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.width, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(Block(cfg, dtype, device) for _ in range(cfg.layers))
        norm = te_compile.RMSNorm if cfg.normalization == "RMSNorm" else te_compile.LayerNorm
        self.ln_f = norm(cfg.width, params_dtype=dtype, device=device)
        self.lm_head = te_compile.Linear(
            cfg.width, cfg.vocab_size, bias=False, params_dtype=dtype, device=device
        )
        self.recipe = RECIPES[cfg.recipe]()
        if cfg.recipe == "delayed":
            self.recipe = dataclasses.replace(
                self.recipe, margin=cfg.fp8_margin, amax_compute_algo=cfg.amax_compute_algo
            )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02) weights, zero biases, residual projections
        scaled down by sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                # Norm weights stay at one; every bias starts at zero.
                if not name.endswith(("layer_norm_weight", "ln_f.weight")):
                    p.zero_()
                continue
            std = 0.02
            if name.endswith(("attn.proj.weight", "mlp.fc2_weight")):
                std /= math.sqrt(2 * self.cfg.layers)
            p.normal_(0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Returns the mean cross-entropy loss if ``targets`` is given, else the logits."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        # The transformer blocks' GEMMs run in FP8 with --recipe while training; the LM head
        # stays in high precision (its vocabulary-sized output is not a multiple of 16, and FP8
        # logits hurt), and so does evaluation: sampling feeds prompts of any length, which the
        # per-tensor recipes pad but the block-scaled ones need in multiples of their block.
        fp8 = self.recipe is not None and self.training
        amp = self.cfg.autocast
        with torch.autocast(idx.device.type, dtype=DTYPES.get(amp), enabled=amp is not None):
            with te_compile.autocast(enabled=fp8, recipe=self.recipe):
                for block in self.blocks:
                    x = block(x)
            logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------------------- data


class CharDataset:
    """The whole corpus as one tensor of character ids, split 90/10 into train/val."""

    def __init__(self, path: Path):
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(data))
        self.splits = {"train": data[:n], "val": data[n:]}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s if c in self.stoi]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def batch(self, split: str, batch_size: int, block_size: int, gen: torch.Generator):
        """Random windows of ``block_size + 1`` characters: inputs and next-char targets."""
        data = self.splits[split]
        starts = torch.randint(len(data) - block_size - 1, (batch_size, 1), generator=gen)
        window = data[starts + torch.arange(block_size + 1)]
        return window[:, :-1], window[:, 1:]


# ------------------------------------------------------------------------ training


def count_graph_breaks(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Trace forward + loss with Dynamo and print how many graphs and breaks it found. On a
    copy of the model: the traced forward runs, and would otherwise leave its FP8 state behind
    (DelayedScaling would take it for its calibration step)."""
    explanation = torch._dynamo.explain(copy.deepcopy(model))(x, y)
    print(
        f"torch._dynamo.explain: {explanation.graph_count} graph(s), "
        f"{explanation.graph_break_count} graph break(s)"
    )
    for reason in explanation.break_reasons:
        print(f"  break: {reason.reason}")
    torch._dynamo.reset()  # start the real compilation from a clean slate
    return explanation.graph_break_count


@torch.no_grad()
def estimate_loss(model: nn.Module, data: CharDataset, args, device, batches: int = 8) -> float:
    """Mean loss over a fixed set of held-out batches (eager, so no recompilation)."""
    model.eval()
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches every call
    losses = []
    for _ in range(batches):
        x, y = data.batch("val", args.batch_size, args.block_size, gen)
        losses.append(model(x.to(device), y.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def sample(
    model: GPT, data: CharDataset, prompt: str, n: int, device, seed: int, temperature=0.8
) -> str:
    """Sample ``n`` characters after ``prompt`` (eager; the context is cropped to the block)."""
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([data.encode(prompt)], device=device)
    for _ in range(n):
        logits = model(ids[:, -model.cfg.block_size :])[:, -1].float()
        probs = F.softmax(logits / temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    model.train()
    return data.decode(ids[0].tolist())


def lr_at(step: int, args) -> float:
    """Linear warm-up for the first 5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="parameter and activation dtype, passed to te_compile.Linear as params_dtype\n"
        "(default: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument(
        "--autocast",
        choices=("bfloat16",),
        default=None,
        help="mixed precision: torch.autocast to this dtype around the model, the parameters\n"
        "(and AdamW's update) in --dtype (use with --dtype float32: fp32 master weights)",
    )
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--width", type=int, help="model width (embedding dimension)")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--block-size", type=int, help="context length in characters")
    p.add_argument("--batch-size", type=int, help="sequences per step")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument(
        "--normalization",
        default="LayerNorm",
        choices=te_compile.modules.norm.NORMALIZATIONS,
        help="every norm of the model (default: LayerNorm)",
    )
    p.add_argument(
        "--recipe",
        default="none",
        choices=tuple(RECIPES),
        help="FP8 recipe for the transformer blocks' GEMMs (default: none, high precision)",
    )
    p.add_argument("--fp8-margin", type=int, default=0, help="DelayedScaling's margin (default: 0)")
    p.add_argument(
        "--amax-compute-algo",
        default="max",
        choices=("max", "most_recent"),
        help="DelayedScaling's amax_compute_algo (default: max, over 16 steps of history)",
    )
    p.add_argument(
        "--activation",
        default="gelu",
        choices=(*te_compile.functional.ACTIVATIONS, *te_compile.functional.GATED_ACTIVATIONS),
        help="the MLP activation (default: gelu; gated ones double FC1's outputs)",
    )
    p.add_argument("--seed", type=int, default=1337, help="random seed (default: 1337)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly, without torch.compile")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="plain-text training corpus")
    p.add_argument("--prompt", default="And the LORD spake unto Moses", help="sample prompt")
    p.add_argument("--sample-chars", type=int, default=300, help="characters to generate")
    args = p.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = torch.device(args.device).type
    for key, value in DEFAULTS.get(device_type, DEFAULTS["cpu"]).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.dtype is None:
        args.dtype = "bfloat16" if device_type == "cuda" else "float32"
    if args.width % args.heads:
        p.error(f"--width ({args.width}) must be divisible by --heads ({args.heads})")
    return args


def main(argv=None) -> int:
    wall_start = time.perf_counter()
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    data = CharDataset(args.data)
    cfg = GPTConfig(
        data.vocab_size,
        args.block_size,
        args.layers,
        args.width,
        args.heads,
        normalization=args.normalization,
        activation=args.activation,
        recipe=args.recipe,
        autocast=args.autocast,
        fp8_margin=args.fp8_margin,
        amax_compute_algo=args.amax_compute_algo,
    )
    model = GPT(cfg, dtype, device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"corpus: {args.data.name}, {sum(map(len, data.splits.values())):,} chars, "
        f"vocab {data.vocab_size}"
    )
    print(
        f"model: {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, "
        f"block {cfg.block_size}, {cfg.normalization}, {cfg.activation} MLP, "
        f"{n_params / 1e6:.2f}M params, {args.dtype} on {device}"
        + (f", autocast {args.autocast}" if args.autocast else "")
    )
    print(f"training: {args.steps} steps of {args.batch_size} x {args.block_size} tokens")

    # Parameters with two or more dimensions (linear weights, embeddings) get weight decay.
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type in ("cpu", "cuda"),  # one kernel per step, not one per tensor
    )

    gen = torch.Generator().manual_seed(args.seed)
    initial_loss = estimate_loss(model, data, args, device)
    print(f"initial val loss: {initial_loss:.4f}  (uniform guess: {math.log(cfg.vocab_size):.4f})")

    train_model = model
    graph_breaks = None
    if not args.no_compile:
        x, y = data.batch("train", args.batch_size, args.block_size, torch.Generator())
        graph_breaks = count_graph_breaks(model, x.to(device), y.to(device))
        torch._dynamo.utils.counters.clear()
        train_model = torch.compile(model, fullgraph=True)

    tokens_per_step = args.batch_size * args.block_size
    start = time.perf_counter()
    first_step_s = 0.0
    timed_tokens, timed_s = 0, 0.0
    # Non-finite training losses, counted on the device (no host sync per step).
    non_finite = torch.zeros((), dtype=torch.int64, device=device)
    # The mean training loss over the last steps (up to 100), also kept on the device.
    tail = min(100, args.steps)
    tail_loss = torch.zeros((), dtype=torch.float32, device=device)
    progress = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    for step in progress:
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = data.batch("train", args.batch_size, args.block_size, gen)
        loss = train_model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        # On this thread, not autograd's CUDA device thread, where a backward with Python nodes
        # (te_compile's eager ops, a compiled graph's backward) pays thread hand-offs
        # (docs/op_mechanism.md, "Eager backward: the calling thread").
        with torch.autograd.set_multithreading_enabled(False):
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        non_finite += ~loss.detach().isfinite()
        if step >= args.steps - tail:
            tail_loss += loss.detach().float() / tail
        # Reading the loss synchronises the device, so only do it every few steps.
        if step % 10 == 0 or step == args.steps - 1:
            loss_value = loss.item()
            dt = time.perf_counter() - t0
            if step == 0:
                first_step_s = dt  # includes compilation: not counted in throughput
            else:
                timed_s = time.perf_counter() - start - first_step_s
                timed_tokens = step * tokens_per_step
            tok_s = timed_tokens / timed_s if timed_s else 0.0
            progress.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{tok_s:,.0f}")
    progress.close()
    train_s = time.perf_counter() - start

    if not args.no_compile:
        # fullgraph=True raises on a graph break, so this is 0 whenever we get here; it is
        # printed as a second, independent count over the whole run.
        breaks_during_training = sum(torch._dynamo.utils.counters["graph_break"].values())
        graph_breaks += breaks_during_training

    final_loss = estimate_loss(model, data, args, device)
    text = sample(model, data, args.prompt, args.sample_chars, device, args.seed)

    print(f"\nsample:\n{text}\n")
    print(f"initial val loss:  {initial_loss:.4f}")
    print(f"final val loss:    {final_loss:.4f}")
    print(f"final train loss:  {float(tail_loss):.4f} (mean of the last {tail} steps)")
    first = "first step, including compilation" if not args.no_compile else "first step"
    print(f"training time:     {train_s:.1f} s ({first}: {first_step_s:.1f} s)")
    tok_s = timed_tokens / timed_s if timed_s else 0.0
    print(f"throughput:        {tok_s:,.0f} tokens/s (after the first step)")
    print(f"total wall time:   {time.perf_counter() - wall_start:.1f} s (since main() started)")
    non_finite_losses = int(non_finite)
    bad_amaxes = te_compile.non_finite_amaxes(model)
    print(f"non-finite losses: {non_finite_losses} of {args.steps} steps")
    print(f"non-finite amaxes: {bad_amaxes or 'none'}")
    if graph_breaks is None:
        print("graph breaks:      n/a (--no-compile)")
    else:
        print(f"graph breaks:      {graph_breaks}")

    if non_finite_losses or bad_amaxes:
        print("FAILED: a non-finite training loss or amax", file=sys.stderr)
        return 1
    if not final_loss < initial_loss:
        print("FAILED: the loss did not fall", file=sys.stderr)
        return 1
    if graph_breaks:
        print("FAILED: the training step has graph breaks", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
