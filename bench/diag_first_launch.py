"""What the host does before the GPU gets its first GEMM, per FP8 MLP row (GPU only; diagnostic).

Written on the guess that bench_fp8's ``do_bench`` starts each call with an empty queue, so that
host work before the first long kernel would be GPU idle time in the result; the tenth session's
``bench/diag_sync.py`` showed the host issues a step in ~3 ms, never waits and stays ahead, so
that time is hidden there. The FP8 rows spend 0.4-0.8 ms more outside their
kernels than bf16 (H100, 2026-11-22). This profiles one call per row (CPU activity only) and
prints, from the call's start: when the first kernel and the first GEMM are launched, and the
outermost host ops up to the first GEMM launch with their durations (profiler overhead
included: compare rows, not absolute times).

    python -m bench.diag_first_launch
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from bench.diag_host import ROWS, compiled_rows

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
_GEMM = ("_scaled_mm", "aten::mm", "aten::addmm", "aten::_scaled_mm", "cublas")


def _timeline(run) -> None:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
        torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    t0 = events[0].time_range.start
    first_launch = next((e for e in events if e.name in _LAUNCH), None)
    first_gemm = next((e for e in events if any(g in e.name for g in _GEMM)), None)
    end = first_gemm.time_range.start if first_gemm else events[-1].time_range.end
    if first_launch:
        print(f"  first kernel launch at {(first_launch.time_range.start - t0) / 1e3:.3f} ms")
    if first_gemm:
        print(f"  first GEMM ({first_gemm.name}) at {(end - t0) / 1e3:.3f} ms")
    # outermost events before the first GEMM: those not inside an earlier, longer one
    outer, covered = [], -1
    for e in events:
        if e.time_range.start >= end:
            break
        if e.time_range.start >= covered:
            outer.append(e)
            covered = e.time_range.end
    for e in outer[:25]:
        dur = (min(e.time_range.end, end) - e.time_range.start) / 1e3
        print(f"    {(e.time_range.start - t0) / 1e3:7.3f} ms  {dur:7.3f} ms  {e.name[:70]}")
    # one level down inside the longest outer event
    if outer:
        top = max(outer, key=lambda e: e.time_range.elapsed_us())
        inner = [
            e for e in events
            if top.time_range.start < e.time_range.start < min(top.time_range.end, end)
            and e.time_range.elapsed_us() > 20
        ]  # fmt: skip
        print(f"  inside {top.name[:50]}: events over 20 us before the first GEMM")
        for e in inner[:30]:
            print(
                f"    {(e.time_range.start - t0) / 1e3:7.3f} ms  "
                f"{e.time_range.elapsed_us() / 1e3:7.3f} ms  {e.name[:70]}"
            )


def main() -> int:
    for row, step, _params in compiled_rows(ROWS):
        print(f"\n## {row}")
        _timeline(step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
