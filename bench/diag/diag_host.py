"""Where the FP8 MLP step's time goes beyond its kernels: host time, GPU idle gaps, host ops.

When bench_fp8's do_bench median of a compiled LayerNormMLP step exceeds the sum of its kernels,
this separates, per recipe row (same module and case as ``bench.bench_fp8``):

* ``host ms``: the host's time to issue one step while the GPU is held busy (a
  ``torch.cuda._sleep`` queued first, so the host never waits for the device): pure launch
  and Python cost;
* ``do_bench ms``: bench_fp8's timer (L2 flushed before each call; the queue is not empty
  between calls: the host issues a step faster than the GPU runs it and never waits,
  ``bench/results/2026-11-22_h100/s10/diag_sync.log``);
* ``kernels ms`` / ``span ms`` / ``idle ms``: from a profiler trace of one call started on an
  empty queue, the sum of kernel times, first-kernel-start to last-kernel-end, and the
  difference; the largest gaps with the kernels on both sides;
* the host ops with the most self time over the profiled calls.

    python -m bench.diag.diag_host                  # CUDA; writes to stdout
    python -m bench.diag.diag_host --rows block current
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import itertools

import torch

import te_compile
from bench import harness
from bench.bench_fp8 import TE_RECIPES, _under_autocast
from bench.bench_mlp import FULL, TorchMLP, _copy_weights

ROWS = {"bf16": None, "current": "te FP8 current compiled", "delayed": "te FP8 delayed compiled",
        "block": "te FP8 block compiled"}  # fmt: skip


def _step(call, x, grad):
    def run():
        x.grad = None
        call(x).backward(grad)

    return run


def _trace(run, params, flush) -> tuple[list, object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            for p in params:
                p.grad = None
            flush.zero_()
            torch.cuda.synchronize()
            run()
            torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != "Memset (Device)"
    ]
    return kernels, prof


def report(name: str, run, params, flush) -> None:
    from triton.testing import do_bench

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    host = harness.host_ms(run, torch.device("cuda"))
    med = do_bench(run, warmup=100, rep=1000, return_mode="median", grad_to_none=params)
    kernels, prof = _trace(run, params, flush)
    ks = sorted(kernels, key=lambda e: e.time_range.start)
    # the flush (a 256 MB fill) is the longest non-GEMM kernel before each call; split there
    starts = [
        i
        for i, e in enumerate(ks)
        if e.time_range.elapsed_us() > 40 and ("fill" in e.name.lower() or "FillFunctor" in e.name)
    ]
    segs = [ks[a + 1 : b] for a, b in zip(starts, [*starts[1:], len(ks)], strict=False)]
    seg = segs[-1] if segs else ks
    busy = sum(e.time_range.elapsed_us() for e in seg) / 1e3
    span = (seg[-1].time_range.end - seg[0].time_range.start) / 1e3
    gaps = []
    for a, b in itertools.pairwise(seg):
        gap = (b.time_range.start - a.time_range.end) / 1e3
        gaps.append((gap, a.name[:60], b.name[:60]))
    gaps.sort(reverse=True)
    print(f"\n## {name}")
    print(
        f"host {host:.3f} ms/step | do_bench {med:.3f} ms | kernels {busy:.3f} ms | "
        f"span {span:.3f} ms | idle {span - busy:.3f} ms | {len(seg)} kernels"
    )
    if seg:
        lead = (seg[0].time_range.start - ks[starts[-1]].time_range.end) / 1e3 if starts else 0.0
        print(f"flush end -> first kernel: {lead:.3f} ms (host preamble not hidden by the flush)")
    for gap, a, b in gaps[:12]:
        print(f"  gap {gap * 1e3:8.1f} us after {a} | before {b}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table)


def compiled_rows(rows):
    """``(row, step, parameters)`` for each of ``rows``: the bench_fp8 LayerNormMLP case, compiled,
    under the row's recipe; ``step()`` runs one forward + backward. One module at a time."""
    device = torch.device("cuda")
    t, d, f = FULL
    torch.manual_seed(0)
    dtype = torch.bfloat16
    ref = TorchMLP(d, f, "gelu", device, dtype)
    x = torch.randn(t, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(t, d, device=device, dtype=dtype)
    for row in rows:
        torch._dynamo.reset()
        te = te_compile.LayerNormMLP(d, f, activation="gelu", normalization="LayerNorm",
                                     params_dtype=dtype, device=device)  # fmt: skip
        _copy_weights(te, ref)
        call = torch.compile(te, fullgraph=True, dynamic=False)
        if ROWS[row] is not None:
            call = _under_autocast(TE_RECIPES[ROWS[row]](), call)
        yield row, _step(call, x, grad), list(te.parameters())
        del te, call
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for row, step, params in compiled_rows(args.rows):
        report(row, step, params, flush)
    return 0


if __name__ == "__main__":
    sys.exit(main())
