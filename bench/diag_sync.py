"""Does a compiled FP8 MLP step make the host wait for the GPU? (GPU only; diagnostic.)

bench_fp8's do_bench median of the block row exceeds the sum of its kernels by ~1.5 ms, the bf16
te_compile row's by ~0.8 ms, torch's compiled bf16 row's by ~0.1 ms (H100, 2026-11-22). The host
needs ~4 ms to issue a step the GPU runs in ~13 ms, so without a synchronisation the queue stays
full and no host time shows. Per row (the bench_fp8 LayerNormMLP case, compiled):

* the caching allocator's counters over 20 steps issued back to back (``cudaMalloc`` /
  ``cudaFree`` calls and allocation retries; a ``cudaFree`` synchronises the device);
* ``enqueue ms``: host time to issue those 20 steps without waiting, per step, against the GPU
  time per step (after a synchronize): enqueue close to the GPU time means the host waited;
* the synchronising torch calls of one step (``torch.cuda.set_sync_debug_mode``).

Run under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` to compare.

    python -m bench.diag_sync [--rows block bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.diag_host import ROWS, compiled_rows

_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _steps(step, params, n: int) -> None:
    for _ in range(n):
        for p in params:
            p.grad = None
        step()


def report(row: str, step, params, n: int = 20) -> None:
    from triton.testing import do_bench

    _steps(step, params, 3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    _steps(step, params, n)
    enqueue = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / n * 1e3
    after = torch.cuda.memory_stats()
    deltas = ", ".join(f"{c} +{after.get(c, 0) - before.get(c, 0)}" for c in _COUNTERS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _steps(step, params, 1)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    syncs = sorted({str(w.message).splitlines()[0][:120] for w in caught})
    med = do_bench(step, warmup=50, rep=500, return_mode="median", grad_to_none=params)
    reserved = torch.cuda.memory_reserved() / 2**30
    print(f"\n## {row}")
    print(f"do_bench {med:.3f} ms | enqueue {enqueue:.3f} ms/step | wall {total:.3f} ms/step | "
          f"reserved {reserved:.1f} GiB")  # fmt: skip
    print(f"over {n} steps: {deltas}")
    print(f"synchronising torch calls in one step: {syncs or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()
    print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}")
    for row, step, params in compiled_rows(args.rows):
        report(row, step, params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
