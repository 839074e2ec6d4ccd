"""LayerNorm and RMSNorm forward and backward: te_compile against PyTorch eager, PyTorch under
torch.compile and Liger-Kernel, with the fraction of the measured copy bandwidth.

Cases (BENCHMARKS.md): 16384 x 4096 and 16384 x 8192, bf16 input, bf16 weight (and bias), over
the last dim. Minimum traffic: forward reads x and writes y (2 * M * N * 2 bytes; parameters and
statistics are < 0.1%), backward reads x and dy and writes dx (3 * M * N * 2 bytes).
Liger-Kernel is optional (``pip install liger-kernel``); without it its rows are absent.

    python -m bench.bench_norm               # CUDA, results in bench/results/<date>_<gpu>/
    python -m bench.bench_norm --smoke       # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_norm.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

import te_compile
from bench import harness, membound

FULL_SHAPES = [(16384, 4096), (16384, 8192)]
SMOKE_SHAPES = [(64, 256)]
EPS = 1e-5


def _liger() -> dict[str, Callable[..., torch.Tensor]]:
    try:
        from liger_kernel.transformers.functional import liger_layer_norm, liger_rms_norm
    except ImportError:
        return {}
    return {
        "LayerNorm": lambda x, w, b: liger_layer_norm(x, w, b, EPS),
        # Liger's default casting ("llama"); in_place=False so repeated backwards see the same dy.
        "RMSNorm": lambda x, w: liger_rms_norm(x, w, EPS, in_place=False),
    }


def implementations(kind: str, device: torch.device) -> dict[str, Callable[..., torch.Tensor]]:
    """name -> fn(x, w[, b]) for one norm kind; the first is the baseline of the ratios."""
    if kind == "LayerNorm":
        torch_fn = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS)  # noqa: E731
        te_fn = lambda x, w, b: te_compile.functional.layernorm(x, w, b, EPS)  # noqa: E731
    else:
        torch_fn = lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS)  # noqa: E731
        te_fn = lambda x, w: te_compile.functional.rmsnorm(x, w, EPS)  # noqa: E731
    compile_kw = {"fullgraph": True, "dynamic": False}
    impls = {
        "torch compiled": torch.compile(torch_fn, **compile_kw),
        "torch eager": torch_fn,
        "te_compile": te_fn,
        "te_compile compiled": torch.compile(te_fn, **compile_kw),
    }
    if device.type == "cuda" and kind in _liger():
        impls["Liger-Kernel"] = _liger()[kind]
    return impls


def run_kind(
    kind: str, m: int, n: int, *, device: torch.device, timing: dict, copy_gbps: float
) -> list[harness.CaseResult]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n, device=device, dtype=dtype)).requires_grad_(True)
    b = (0.1 * torch.randn(n, device=device, dtype=dtype)).requires_grad_(True)
    inputs = (x, w, b) if kind == "LayerNorm" else (x, w)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    impls = implementations(kind, device)
    baseline = next(iter(impls))
    notes = [membound.compare({k: (f, inputs) for k, f in impls.items()}, dy)]
    esize = x.element_size()
    results = []
    for direction, nbytes in (("fwd", 2 * m * n * esize), ("bwd", 3 * m * n * esize)):
        case = harness.Case(f"{kind} {direction}", f"{m}x{n}, bf16", nbytes=nbytes)
        if direction == "fwd":
            comps = {k: membound.forward_competitor(f, inputs, baseline) for k, f in impls.items()}
        else:
            comps = {
                k: membound.backward_competitor(f, inputs, dy, baseline) for k, f in impls.items()
            }
        result = harness.run_case(case, comps, device=device, notes=notes, **timing)
        result.notes.append(membound.percent_of_copy(result, copy_gbps))
        results.append(result)
        del comps
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    args, device, timing, report = harness.start(
        parser, argv, "bench_norm", full_timing=harness.MEMORY_BOUND_TIMING
    )
    report.metadata["liger_kernel"] = "absent" if not _liger() else _liger_version()
    shapes = SMOKE_SHAPES if args.smoke else FULL_SHAPES
    for m, n in shapes:
        copy_gbps = membound.copy_bandwidth(device, 2 * m * n * 2, timing)
        for kind in ("LayerNorm", "RMSNorm"):
            for result in run_kind(kind, m, n, device=device, timing=timing, copy_gbps=copy_gbps):
                report.add(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


def _liger_version() -> str:
    from importlib.metadata import version

    try:
        return version("liger-kernel")
    except Exception:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
