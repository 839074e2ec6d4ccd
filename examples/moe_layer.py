"""A mixture-of-experts layer on te_compile against the same layer in plain PyTorch.

The te_compile layer: router top-k -> ``te.moe_permute`` -> ``te.GroupedMLP`` (SwiGLU experts)
-> ``te.moe_unpermute`` with the router's probabilities. The plain PyTorch layer, holding the same
weights: a stable ``argsort`` of the expert ids, a row gather, ``torch._grouped_mm`` experts and
an ``index_add_`` weighted by the probabilities. Both are compiled with ``fullgraph=True``; the
tokens per expert stay on the device, so neither syncs with the host nor recompiles when the
routing changes.

The script checks that the two layers give the same output and input gradient (within the
dtype's tolerance), counts the te_compile layer's graph breaks, then times a compiled training
step (forward, loss, backward) of each. GPU defaults are the case of issue 26: 16384 tokens,
hidden 4096, ffn 1408, 64 experts, top-2, bf16. Usage::

    python examples/moe_layer.py                       # small config on CPU, full on GPU
    python examples/moe_layer.py --tokens 4096 --experts 16
    python examples/moe_layer.py --recipe current     # te_compile's experts in FP8, timed too
    python examples/moe_layer.py --recipe current --fp8-weights  # and with FP8 expert weights
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import te_compile as te

# --recipe: te FP8 recipes the te_compile layer is also timed under (against the bf16 layers);
# current_fast: current scaling with the backward GEMMs' fast accumulation (MMParams).
_FAST = te.recipe.MMParams(use_split_accumulator=False)
RECIPES = {
    "current": te.recipe.Float8CurrentScaling,
    "current_fast": lambda: te.recipe.Float8CurrentScaling(
        fp8_gemm_dgrad=_FAST, fp8_gemm_wgrad=_FAST
    ),
    "delayed": te.recipe.DelayedScaling,
    "block": te.recipe.Float8BlockScaling,
}


def route(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top-k, renormalised: ``(probs [T, k] fp32, experts
    [T, k] int64)``."""
    probs, experts = logits.float().softmax(-1).topk(topk, dim=-1)
    return probs / probs.sum(-1, keepdim=True), experts


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` int64 counts on the device (``bincount``'s output size would depend on data)."""
    flat = experts.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.index_add_(0, flat, torch.ones_like(flat))


class TeMoE(nn.Module):
    """Router -> ``te.moe_permute`` -> ``te.GroupedMLP`` -> ``te.moe_unpermute``."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, topk: int, **factory) -> None:
        super().__init__()
        self.num_experts, self.topk = num_experts, topk
        self.router = nn.Linear(hidden, num_experts, bias=False, **factory)
        self.experts = te.GroupedMLP(
            num_experts, hidden, ffn, activation="swiglu", params_dtype=factory["dtype"],
            device=factory["device"],
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, experts = route(self.router(x), self.topk)
        permuted, row_id_map = te.moe_permute(x, experts.to(torch.int32), map_type="index")
        y = self.experts(permuted, tokens_per_expert(experts, self.num_experts))
        return te.moe_unpermute(y, row_id_map, merging_probs=probs, map_type="index")


class TorchMoE(nn.Module):
    """The same layer in plain PyTorch, with a copy of ``TeMoE``'s weights."""

    def __init__(self, te_moe: TeMoE) -> None:
        super().__init__()
        self.num_experts, self.topk = te_moe.num_experts, te_moe.topk
        self.router = nn.Linear(1, 1, bias=False)
        self.router.weight = nn.Parameter(te_moe.router.weight.detach().clone())
        # [E, 2F, H] (activation half, then linear half) and [E, H, F], as GroupedMLP holds them.
        self.w1 = nn.Parameter(te_moe.experts.fc1.weight.detach().clone())
        self.w2 = nn.Parameter(te_moe.experts.fc2.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, experts = route(self.router(x), self.topk)
        order = experts.flatten().argsort(stable=True)  # rows grouped by expert
        token = order // self.topk
        offs = tokens_per_expert(experts, self.num_experts).cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x[token], self.w1.transpose(-2, -1), offs=offs)
        a, b = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(a) * b, self.w2.transpose(-2, -1), offs=offs)
        w = probs.flatten()[order].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token, y * w[:, None])


def step_ms(model: nn.Module, fn, x: torch.Tensor, iters: int, after=None) -> float:
    """Median wall time of a training step (forward, loss, backward, then ``after()``;
    gradients set to None before each, synchronised), after three warm-up steps."""
    params = list(model.parameters())
    gpu = x.is_cuda

    def step() -> None:
        for p in params:
            p.grad = None
        fn(x).float().square().mean().backward()
        if after is not None:
            after()

    for _ in range(3):  # compile, warm up
        step()
    times = []
    for _ in range(iters):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=None, help="timed steps per layer")
    p.add_argument(
        "--recipe", nargs="+", choices=tuple(RECIPES), default=[],
        help="also time the te_compile layer under these FP8 recipes (te.autocast)",
    )  # fmt: skip
    p.add_argument(
        "--fp8-weights", action="store_true",
        help="with --recipe current / delayed / block: also the layer whose experts keep FP8 "
        "weights (te.quantized_model_init), the step including FP8MasterWeights' refresh of "
        "them (the optimizer step's cast)",
    )  # fmt: skip
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    defaults = (
        {"tokens": 16384, "hidden": 4096, "ffn": 1408, "experts": 64, "iters": 20}
        if gpu
        else {"tokens": 96, "hidden": 32, "ffn": 48, "experts": 4, "iters": 2}
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    dtype = torch.bfloat16
    factory = {"device": args.device, "dtype": dtype}

    torch.manual_seed(0)
    ours = TeMoE(args.experts, args.hidden, args.ffn, args.topk, **factory)
    with torch.no_grad():  # GroupedMLP's default init; a router that spreads the tokens
        ours.router.weight.normal_(0, args.hidden**-0.5)
    theirs = TorchMoE(ours)
    x = torch.randn(args.tokens, args.hidden, **factory)

    # 1. The same output and input gradient.
    outs = []
    for model in (ours, theirs):
        xi = x.clone().requires_grad_()
        y = model(xi)
        y.float().square().mean().backward()
        outs.append((y.detach().float(), xi.grad.float()))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    out_err, grad_err = rel(outs[0][0], outs[1][0]), rel(outs[0][1], outs[1][1])
    tol = 2e-2  # bf16: the two layers round differently at every step
    print(f"relative difference to plain PyTorch: output {out_err:.2e}, input gradient "
          f"{grad_err:.2e} (tolerance {tol:.0e})")  # fmt: skip

    # 2. Graph breaks, then a compiled step of each.
    breaks = torch._dynamo.explain(ours)(x).graph_break_count
    print(f"graph breaks in the te_compile layer: {breaks}")
    torch._dynamo.reset()
    xr = x.clone().requires_grad_()
    ours_ms = step_ms(ours, torch.compile(ours, fullgraph=True), xr, args.iters)
    theirs_ms = step_ms(theirs, torch.compile(theirs, fullgraph=True), xr, args.iters)
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(
        f"compiled fwd+bwd step on {device} ({args.tokens} tokens, hidden {args.hidden}, "
        f"ffn {args.ffn}, {args.experts} experts, top-{args.topk}, bf16)"
    )
    print(f"ms/step: te_compile {ours_ms:.3f}, plain PyTorch {theirs_ms:.3f} "
          f"({theirs_ms / ours_ms:.2f}x)")  # fmt: skip
    for name in args.recipe:
        torch._dynamo.reset()
        recipe = RECIPES[name]()

        def under(x: torch.Tensor, recipe=recipe) -> torch.Tensor:
            with te.autocast(recipe=recipe):
                return ours(x)

        fp8_ms = step_ms(ours, torch.compile(under, fullgraph=True), xr, args.iters)
        print(f"ms/step: te_compile FP8 {name} {fp8_ms:.3f} ({theirs_ms / fp8_ms:.2f}x plain "
              f"PyTorch bf16)")  # fmt: skip
        if args.fp8_weights and name in ("current", "delayed", "block"):
            torch._dynamo.reset()
            with te.quantized_model_init(recipe=recipe):
                kept = TeMoE(args.experts, args.hidden, args.ffn, args.topk, **factory)
            kept.load_state_dict(ours.state_dict())  # the same weights, quantised
            masters = te.FP8MasterWeights(kept)

            def under_kept(x: torch.Tensor, recipe=recipe, kept=kept) -> torch.Tensor:
                with te.autocast(recipe=recipe):
                    return kept(x)

            fn = torch.compile(under_kept, fullgraph=True)
            kept_ms = step_ms(kept, fn, xr, args.iters, after=masters.refresh)
            print(f"ms/step: te_compile FP8 {name}, FP8 expert weights {kept_ms:.3f} "
                  f"({theirs_ms / kept_ms:.2f}x plain PyTorch bf16)")  # fmt: skip
    ok = out_err <= tol and grad_err <= tol and breaks == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
