"""Host time per call of the per-tensor FP8 GEMM entry points against ``torch.mm`` (CUDA).

A compiled FP8 step at hidden 1024 is host-bound, and ``aten::_scaled_mm`` costs ~2.5x the
host time of ``aten::mm`` per call in its profile. This times, with the GPU asleep (so the host
never waits), ``calls`` back-to-back calls of each variant at one GEMM shape and prints host us
per call, median of ``repeats``:

* ``mm`` (bf16), ``F.linear`` (bf16): the high-precision GEMM;
* ``_scaled_mm`` as the dense family calls it (``[1]`` fp32 inverse scales, bf16 out), with
  ``use_fast_accum``, with a bias, into a preallocated ``out=``, with 0-dim scales;
* ``F.scaled_mm`` (torch's public scaled GEMM, tensorwise recipes), where torch has it.

    python -m bench.diag.diag_scaled_mm_host
    python -m bench.diag.diag_scaled_mm_host --m 8192 --n 3072 --k 1024 --calls 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F


def _host_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(1_000_000_000)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    dev, bf16, e4m3 = torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn
    a = torch.randn(args.m, args.k, device=dev, dtype=bf16)
    w = torch.randn(args.n, args.k, device=dev, dtype=bf16)
    bias = torch.randn(args.n, device=dev, dtype=bf16)
    aq, wq = a.to(e4m3), w.to(e4m3)
    sa, sb = torch.ones(1, device=dev), torch.ones(1, device=dev)
    sa0, sb0 = sa.reshape(()), sb.reshape(())
    out = torch.empty(args.m, args.n, device=dev, dtype=bf16)
    wt = wq.t()
    variants: dict[str, Callable[[], object]] = {
        "mm bf16": lambda: torch.mm(a, w.t()),
        "F.linear bf16": lambda: F.linear(a, w),
        "_scaled_mm": lambda: torch._scaled_mm(aq, wt, scale_a=sa, scale_b=sb, out_dtype=bf16),
        "_scaled_mm fast_accum": lambda: torch._scaled_mm(
            aq, wt, scale_a=sa, scale_b=sb, out_dtype=bf16, use_fast_accum=True
        ),
        "_scaled_mm bias": lambda: torch._scaled_mm(
            aq, wt, scale_a=sa, scale_b=sb, bias=bias, out_dtype=bf16
        ),
        "_scaled_mm out=": lambda: torch._scaled_mm(
            aq, wt, scale_a=sa, scale_b=sb, out_dtype=bf16, out=out
        ),
        "_scaled_mm 0-dim scales": lambda: torch._scaled_mm(
            aq, wt, scale_a=sa0, scale_b=sb0, out_dtype=bf16
        ),
    }
    if hasattr(F, "scaled_mm"):
        tw = F.ScalingType.TensorWise
        variants["F.scaled_mm tensorwise"] = lambda: F.scaled_mm(aq, wt, sa, tw, sb, tw)
    shape = f"[{args.m}, {args.k}] x [{args.k}, {args.n}]"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {shape}, "
          f"{args.calls} calls x {args.repeats}")  # fmt: skip
    print("| variant | host us / call |\n| --- | ---: |")
    for name, fn in variants.items():
        try:
            print(f"| {name} | {_host_us(fn, args.calls, args.repeats):.1f} |", flush=True)
        except Exception as exc:  # report and keep going
            print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:120]} |", flush=True)


if __name__ == "__main__":
    main()
