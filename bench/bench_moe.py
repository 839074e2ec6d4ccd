"""MoE token routing forward and backward: te_compile (``te.moe_permute`` -> ``te.moe_unpermute``
with merging probabilities, its Triton gather kernel) against the same routing in plain PyTorch
(a stable ``argsort`` of the expert ids, a row gather, ``index_add_`` weighted by the
probabilities), eager and under ``torch.compile``.

Case (issue 26): 16384 tokens, hidden 4096, 64 experts, top-2, bf16; routing maps ``index``
(``[T, 2]`` expert ids) and ``mask`` (``[T, 64]``). The experts are left out (identity), so the
rows time the permute + unpermute pair alone; the target is 2x the compiled PyTorch routing.

Minimum traffic: the forward reads ``x`` and writes the ``T * k`` permuted rows, then reads them
and writes ``T`` merged rows; the backward moves the same bytes back (plus the probabilities'
dot products, which read the permuted rows once more).

    python -m bench.bench_moe            # CUDA
    python -m bench.bench_moe --smoke    # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_moe.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import te_compile as te
from bench import harness, membound

FULL = {"tokens": 16384, "hidden": 4096, "experts": 64, "topk": 2}
SMOKE = {"tokens": 64, "hidden": 32, "experts": 8, "topk": 2}


def torch_routing(x: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Permute by a stable argsort of the expert ids, unpermute by ``index_add_`` weighted by
    ``probs [T, k]`` (the plain-PyTorch MoE routing)."""
    k = idx.shape[1]
    order = torch.argsort(idx.reshape(-1), stable=True)
    token = order // k
    permuted = x[token]  # the experts would run here
    w = probs.reshape(-1)[order].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, permuted * w[:, None])


def implementations(
    map_type: str, x: torch.Tensor, idx: torch.Tensor, probs_k: torch.Tensor, experts: int
) -> dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    """name -> (fn, inputs); the first entry is the baseline of the ratios."""
    tokens, k = idx.shape
    routing = idx
    if map_type == "mask":
        routing = torch.zeros(tokens, experts, dtype=torch.bool, device=x.device)
        routing.scatter_(1, idx.long(), True)

    def te_fn(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        if map_type == "mask":  # the [T, k] probabilities as the mask's [T, E]
            p = p.new_zeros(tokens, experts).scatter(1, idx.long(), p)
        out, row_id_map = te.moe_permute(t, routing, tokens * k, map_type=map_type)
        return te.moe_unpermute(out, row_id_map, merging_probs=p, map_type=map_type)

    def plain(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch_routing(t, idx, p)

    kw = {"fullgraph": True, "dynamic": False}
    return {
        "torch compiled": (torch.compile(plain, **kw), (x, probs_k)),
        "torch eager": (plain, (x, probs_k)),
        "te_compile": (te_fn, (x, probs_k)),
        "te_compile compiled": (torch.compile(te_fn, **kw), (x, probs_k)),
    }


def run_moe(
    map_type: str, sizes: dict, *, device: torch.device, timing: dict
) -> list[harness.CaseResult]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    tokens, hidden, experts, k = (sizes[n] for n in ("tokens", "hidden", "experts", "topk"))
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    scores = torch.randn(tokens, experts, device=device).softmax(-1)
    probs_k, idx = scores.topk(k, dim=-1)
    probs_k = probs_k.detach().requires_grad_()
    idx = idx.to(torch.int32)
    dy = torch.randn_like(x)
    impls = implementations(map_type, x, idx, probs_k, experts)
    notes = [membound.compare(impls, dy)]
    nbytes = 2 * (1 + k) * x.numel() * x.element_size()
    label = f"{tokens} tokens x {hidden}, {experts} experts, top-{k}, bf16"
    results = []
    for direction in ("fwd", "bwd"):
        case = harness.Case(f"moe routing {map_type} {direction}", label, nbytes=nbytes)
        if direction == "fwd":
            comps = {
                n: membound.forward_competitor(f, inp, "torch compiled")
                for n, (f, inp) in impls.items()
            }
        else:
            comps = {
                n: membound.backward_competitor(f, inp, dy, "torch compiled")
                for n, (f, inp) in impls.items()
            }
        results.append(harness.run_case(case, comps, device=device, notes=notes, **timing))
        del comps
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--map-types", nargs="+", choices=("index", "mask"), default=["index", "mask"]
    )
    args, device, timing, report = harness.start(
        parser, argv, "bench_moe", full_timing=harness.MEMORY_BOUND_TIMING
    )
    sizes = SMOKE if args.smoke else FULL
    for map_type in args.map_types:
        for result in run_moe(map_type, sizes, device=device, timing=timing):
            report.add(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
