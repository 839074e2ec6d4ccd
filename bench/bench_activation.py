"""Activations forward and backward: te_compile against PyTorch under torch.compile (and eager)
and Liger-Kernel where it has the activation, with the fraction of the measured copy bandwidth.

Case (BENCHMARKS.md): a 16384 x 16384 bf16 input for every activation; a gated activation's
output is 16384 x 8192 (first half of the last dim through the activation, second half linear).
Minimum traffic: forward reads x and writes y; backward reads dy and x and writes dx.
Liger-Kernel (optional) gets SwiGLU's / GeGLU's two halves as two contiguous tensors, the layout
its API takes, so it is not charged for splitting a packed input.

    python -m bench.bench_activation                       # CUDA, every activation
    python -m bench.bench_activation --only gelu swiglu    # a subset
    python -m bench.bench_activation --smoke               # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_activation.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

import te_compile
from bench import harness, membound
from te_compile.functional import ACTIVATIONS, GATED_ACTIVATIONS

FULL_SHAPE = (16384, 16384)
SMOKE_SHAPE = (64, 256)
LIMIT, ALPHA = 7.0, 1.702


def _f(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation function ``name`` applies (gated: to the activation half), in torch ops."""
    if name in ("gelu", "geglu"):
        return F.gelu(x, approximate="tanh")
    if name in ("qgelu", "qgeglu"):
        return x * torch.sigmoid(1.702 * x)
    if name in ("relu", "reglu"):
        return torch.relu(x)
    if name in ("srelu", "sreglu"):
        return torch.relu(x).square()
    if name in ("silu", "swiglu"):
        return F.silu(x)
    if name == "glu":
        return torch.sigmoid(x)
    c = x.clamp(max=LIMIT)  # clamped_swiglu
    return c * torch.sigmoid(ALPHA * c)


def torch_reference(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name in ACTIVATIONS:
        return lambda x: _f(name, x)

    def gated(x: torch.Tensor) -> torch.Tensor:
        a, lin = x.chunk(2, dim=-1)
        if name == "clamped_swiglu":
            lin = lin.clamp(-LIMIT, LIMIT) + 1.0
        return _f(name, a) * lin

    return gated


def _liger(name: str, x: torch.Tensor):
    """(fn, inputs) of Liger-Kernel's version of ``name``, or None."""
    try:
        from liger_kernel.transformers import functional as lf
    except ImportError:
        return None
    if name == "srelu" and hasattr(lf, "liger_relu_squared"):
        return lf.liger_relu_squared, (x,)
    fn = {"swiglu": lf.liger_swiglu, "geglu": lf.liger_geglu}.get(name)
    if fn is None:
        return None
    a, b = (t.contiguous().detach().requires_grad_(True) for t in x.chunk(2, dim=-1))
    return fn, (a, b)


def implementations(name: str, x: torch.Tensor) -> dict:
    """name -> (fn, inputs); the first entry is the baseline of the ratios."""
    te_fn = lambda t: te_compile.functional.bias_activation(t, None, name)  # noqa: E731
    ref = torch_reference(name)
    kw = {"fullgraph": True, "dynamic": False}
    impls = {
        "torch compiled": (torch.compile(ref, **kw), (x,)),
        "torch eager": (ref, (x,)),
        "te_compile": (te_fn, (x,)),
        "te_compile compiled": (torch.compile(te_fn, **kw), (x,)),
    }
    liger = _liger(name, x) if x.is_cuda else None
    if liger is not None:
        impls["Liger-Kernel"] = liger
    return impls


def run_activation(
    name: str, m: int, n: int, *, device: torch.device, timing: dict, copy_gbps: float
) -> list[harness.CaseResult]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    gated = name in GATED_ACTIVATIONS
    x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    n_out = n // 2 if gated else n
    dy = torch.randn(m, n_out, device=device, dtype=dtype)
    impls = implementations(name, x)
    baseline = next(iter(impls))
    notes = [membound.compare(impls, dy)]
    esize = x.element_size()
    traffic = {"fwd": (m * n + m * n_out) * esize, "bwd": (2 * m * n + m * n_out) * esize}
    shape = f"{m}x{n}" + (f" -> {m}x{n_out}" if gated else "") + ", bf16"
    results = []
    for direction, nbytes in traffic.items():
        case = harness.Case(f"{name} {direction}", shape, nbytes=nbytes)
        if direction == "fwd":
            comps = {
                k: membound.forward_competitor(f, inp, baseline) for k, (f, inp) in impls.items()
            }
        else:
            comps = {
                k: membound.backward_competitor(f, inp, dy, baseline)
                for k, (f, inp) in impls.items()
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
    names = (*ACTIVATIONS, *GATED_ACTIVATIONS)
    parser.add_argument("--only", nargs="+", choices=names, default=list(names))
    args, device, timing, report = harness.start(
        parser, argv, "bench_activation", full_timing=harness.MEMORY_BOUND_TIMING
    )
    m, n = SMOKE_SHAPE if args.smoke else FULL_SHAPE
    copy_gbps = membound.copy_bandwidth(device, 2 * m * n * 2, timing)
    for name in args.only:
        for result in run_activation(name, m, n, device=device, timing=timing, copy_gbps=copy_gbps):
            report.add(result)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
