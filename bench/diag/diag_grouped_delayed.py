"""Host time against GPU time of the FP8 GroupedLinear's compiled training step (the
DelayedScaling row of bench_grouped spreads from call to call while its kernels do not), GPU only.

Times one compiled module's DelayedScaling training step (fwd+bwd, bench_grouped's 8-expert
shape) three ways: alone on a fresh module, after the same compiled module has also run the
current-scaling variants bench_grouped compiles before it (more cache entries for the
compiled frame), and then host time per call (CPU time to issue a step, the GPU synchronised
first and after), so a host-bound step shows as host time above GPU time; then both recipes
compiled with ``mode="reduce-overhead"`` (CUDA graphs). ``--no-profile`` skips the cProfile
listings, ``--graphs-only`` runs only the CUDA-graph part.

    python -m bench.diag.diag_grouped_delayed
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from triton.testing import do_bench

from bench.bench_grouped import (
    DTYPE,
    FP8_EXPERTS,
    IN_FEATURES,
    OUT_FEATURES,
    TOKENS,
    _bind,
    _make_te,
    _under_fp8,
    make_splits,
)


def _host_ms(step, x, dy, calls: int = 20) -> float:
    """Milliseconds of host time to issue one step (median over ``calls``)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(x).backward(dy)
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e3


def _report(name: str, step, x, dy) -> None:
    ms = do_bench(lambda: step(x).backward(dy), warmup=200, rep=1000, return_mode="median")
    print(f"  {name:48s} do_bench {ms:6.3f} ms   host {_host_ms(step, x, dy):6.3f} ms")


def main() -> int:
    device = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    splits = torch.tensor(make_splits(TOKENS, FP8_EXPERTS, 0), device=device)
    x = torch.randn(TOKENS, IN_FEATURES, device=device, dtype=DTYPE, requires_grad=True)
    dy = torch.randn(TOKENS, OUT_FEATURES, device=device, dtype=DTYPE)
    kw = {"fullgraph": True, "dynamic": False}
    if "--graphs-only" in sys.argv:
        _cuda_graphs(splits, x, dy)
        return 0

    fresh = torch.compile(_make_te(FP8_EXPERTS, IN_FEATURES, OUT_FEATURES, single=True,
                                   device=device), **kw)  # fmt: skip
    delayed = _under_fp8(_bind(fresh, splits), kind="DelayedScaling")
    _report("delayed, fresh module", delayed, x, dy)

    te = _make_te(FP8_EXPERTS, IN_FEATURES, OUT_FEATURES, single=True, device=device)
    shared = torch.compile(te, **kw)
    current = _under_fp8(_bind(shared, splits))
    hpw = _under_fp8(_bind(shared, splits), backward_override="high_precision")
    e4m3 = _under_fp8(_bind(shared, splits), "E4M3")
    for call in (current, hpw, e4m3):
        call(x).backward(dy)
    delayed_shared = _under_fp8(_bind(shared, splits), kind="DelayedScaling")
    _report("delayed, after the current-scaling variants", delayed_shared, x, dy)
    _report("current (HYBRID), same module", current, x, dy)
    _report("delayed again", delayed_shared, x, dy)
    if "--no-profile" not in sys.argv:
        for name, step in (("delayed", delayed), ("current", current)):
            _profile_host(name, step, x, dy)
    _cuda_graphs(splits, x, dy)
    return 0


def _cuda_graphs(splits, x, dy) -> None:
    """The same steps compiled with ``mode="reduce-overhead"`` (CUDA graphs replay the step's
    kernels without the host issuing each one)."""
    device = x.device
    for kind in ("DelayedScaling", "Float8CurrentScaling"):
        te = _make_te(FP8_EXPERTS, IN_FEATURES, OUT_FEATURES, single=True, device=device)
        graphed = torch.compile(te, mode="reduce-overhead", fullgraph=True, dynamic=False)
        call = _under_fp8(_bind(graphed, splits), kind=kind)

        def step(x, call=call, module=te):
            # Gradients dropped first: CUDA-graph steps cannot accumulate them (docs/graphs.md).
            for t in (*module.parameters(), x):
                t.grad = None
            torch.compiler.cudagraph_mark_step_begin()
            return call(x)

        try:
            for _ in range(3):  # the calibration step, recording, first replays
                step(x).backward(dy)
        except RuntimeError as exc:  # what we want to know
            print(f"  {kind}, reduce-overhead (CUDA graphs): {str(exc)[:300]}")
            continue
        _report(f"{kind}, reduce-overhead (CUDA graphs)", step, x, dy)


def _profile_host(name: str, step, x, dy, calls: int = 20) -> None:
    """Where the host time of ``calls`` steps goes (cProfile, top functions by own time)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step(x).backward(dy)
    prof.disable()
    torch.cuda.synchronize()
    print(f"host profile of {calls} {name} steps, by own time:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"host profile of {calls} {name} steps, by cumulative time:")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(35)


if __name__ == "__main__":
    sys.exit(main())
