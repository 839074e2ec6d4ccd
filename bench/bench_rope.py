"""Rotary position embeddings forward and backward: te_compile (``te::rotary``, its Triton kernel)
against a plain PyTorch RoPE, eager and under torch.compile, and Transformer Engine's fused RoPE
where it is installed, with the fraction of the measured copy bandwidth.

Cases (bf16, non-interleaved, full rotary, freqs from ``te.RotaryPositionEmbedding``):

* ``q sbhd``: ``[4096, 2, 32, 128]``, a query of 32 heads;
* ``k sbhd``: ``[4096, 2, 8, 128]``, a GQA key of 8 heads (fewer heads share each cos/sin);
* ``q thd``: ``[8192, 32, 128]`` packed into 8 sequences of uneven lengths (``cu_seqlens`` on
  the GPU; the plain-PyTorch competitor is ``fused=False``, which finds positions on the device).

Minimum traffic: forward reads ``t`` and writes ``y``, backward reads ``dy`` and writes ``dx``,
both also read the ``freqs`` rows they use (fp32). The target (issue 25) is 85% of copy bandwidth
forward and backward on an H100.

Timer: ``kernels`` by default (the summed duration of each call's CUDA kernels, and the copy's,
from ``torch.profiler``): bandwidth is a property of the kernels. ``--timer do_bench`` times
a call between CUDA events instead; a compiled call of a ~50 us kernel is then host-bound (its
guards and autograd wrapper take longer to issue than the kernel runs), so that timer measures
the host as much as the kernel.

    python -m bench.bench_rope            # CUDA
    python -m bench.bench_rope --smoke    # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_rope.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import te_compile as te
from bench import harness, membound

HEAD_DIM = 128
FULL = {"q sbhd": (4096, 2, 32), "k sbhd": (4096, 2, 8), "q thd": (8192, 8, 32)}
SMOKE = {"q sbhd": (16, 2, 4), "k sbhd": (16, 2, 2), "q thd": (64, 4, 4)}


def torch_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """sbhd RoPE in plain PyTorch, as Transformer Engine's unfused path computes it (cos/sin in
    fp32, cast to ``t``'s dtype, the products in ``t``'s dtype)."""
    f = freqs[: t.shape[0]]
    cos, sin = f.cos().to(t.dtype), f.sin().to(t.dtype)
    x1, x2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-x2, x1), dim=-1) * sin


def _transformer_engine_rope() -> Callable | None:
    try:
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
    except ImportError:
        return None
    return apply_rotary_pos_emb


def _cu_seqlens(tokens: int, n_seqs: int, device: torch.device) -> torch.Tensor:
    """``n_seqs`` uneven lengths summing to ``tokens`` (1 : 2 : ... : n_seqs)."""
    weights = torch.arange(1, n_seqs + 1, dtype=torch.float64)
    bounds = (weights.cumsum(0) / weights.sum() * tokens).round().long()
    return torch.cat([bounds.new_zeros(1), bounds]).to(device=device, dtype=torch.int32)


def implementations(
    case: str, x: torch.Tensor, freqs: torch.Tensor, cu: torch.Tensor | None
) -> dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    """name -> (fn, inputs); the first entry is the baseline of the ratios."""
    fmt = "sbhd" if cu is None else "thd"

    def plain(t: torch.Tensor) -> torch.Tensor:
        if cu is None:
            return torch_rope(t, freqs)
        return te.apply_rotary_pos_emb(t, freqs, fmt, fused=False, cu_seqlens=cu)

    def te_fn(t: torch.Tensor) -> torch.Tensor:
        return te.apply_rotary_pos_emb(t, freqs, fmt, cu_seqlens=cu)

    kw = {"fullgraph": True, "dynamic": False}
    impls = {
        "torch compiled": (torch.compile(plain, **kw), (x,)),
        "torch eager": (plain, (x,)),
        "te_compile": (te_fn, (x,)),
        "te_compile compiled": (torch.compile(te_fn, **kw), (x,)),
    }
    te_rope = _transformer_engine_rope() if x.is_cuda else None
    if te_rope is not None:
        impls["TransformerEngine fused"] = (
            lambda t: te_rope(t, freqs, fmt, fused=True, cu_seqlens=cu),
            (x,),
        )
    return impls


def run_rope(
    case: str, sizes: tuple[int, int, int], *, device: torch.device, timing: dict, copy_gbps: float
) -> list[harness.CaseResult]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    if case.endswith("thd"):
        tokens, n_seqs, heads = sizes
        shape, cu = (tokens, heads, HEAD_DIM), _cu_seqlens(tokens, n_seqs, device)
        positions = int((cu[1:] - cu[:-1]).max())
    else:
        s, b, heads = sizes
        shape, cu, positions = (s, b, heads, HEAD_DIM), None, s
    freqs = te.RotaryPositionEmbedding(HEAD_DIM, device=device)(positions)
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(*shape, device=device, dtype=dtype)
    impls = implementations(case, x, freqs, cu)
    baseline = next(iter(impls))
    notes = [membound.compare(impls, dy)]
    nbytes = 2 * x.numel() * x.element_size() + positions * HEAD_DIM * 4  # + the freqs rows
    label = "x".join(str(n) for n in shape) + (
        f", {len(cu) - 1} sequences" if cu is not None else ""
    )
    results = []
    for direction in ("fwd", "bwd"):
        bench_case = harness.Case(f"rope {case} {direction}", f"{label}, bf16", nbytes=nbytes)
        if direction == "fwd":
            comps = {
                k: membound.forward_competitor(f, inp, baseline) for k, (f, inp) in impls.items()
            }
        else:
            comps = {
                k: membound.backward_competitor(f, inp, dy, baseline)
                for k, (f, inp) in impls.items()
            }
        result = harness.run_case(bench_case, comps, device=device, notes=notes, **timing)
        result.notes.append(membound.percent_of_copy(result, copy_gbps))
        results.append(result)
        del comps
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", choices=list(FULL), default=list(FULL))
    parser.add_argument("--timer", choices=("kernels", "do_bench"), default="kernels")
    args, device, timing, report = harness.start(
        parser, argv, "bench_rope", full_timing=harness.MEMORY_BOUND_TIMING
    )
    timing = {**timing, "timer": args.timer}
    cases = SMOKE if args.smoke else FULL
    s, b, h = cases["q sbhd"]
    copy_gbps = membound.copy_bandwidth(device, 2 * s * b * h * HEAD_DIM * 2, timing)
    for case in args.only:
        for result in run_rope(
            case, cases[case], device=device, timing=timing, copy_gbps=copy_gbps
        ):
            report.add(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
