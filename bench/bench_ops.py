"""te_compile.ops fused vs unfused: linear + bias + GELU and linear + bias + residual add,
fwd+bwd, eager and torch.compile.

Cases (issue 6): T=16384 tokens, 4096 -> 16384, bf16, one ``te_compile.ops.Sequential`` built
twice from the same basic ops, ``fuse=True`` (the default) and ``fuse=False``:

* ``BasicLinear, Bias, GELU``: fused into ``te::linear`` with the activation epilogue (GEMM,
  then the bias + GELU kernel; backward: GELU backward with dbias in one pass, then the GEMMs);
* ``BasicLinear, Bias, AddExtraInput``: fused into ``te::linear`` with the residual epilogue
  (the residual added in the GEMM's epilogue); the residual ``[T, 16384]`` requires grad, as
  the residual stream does.

One timed call is ``seq(x[, residual]).backward(grad)``; parameter (and residual) gradients are
set to None before every call. FLOPs = 3 GEMM passes x 2 x T x 4096 x 16384. Targets: fused
eager at least 1.1x faster than unfused eager (ratio <= 0.91 against it), fused compiled no
slower than unfused compiled (ratio <= 1.0, within noise).

    python -m bench.bench_ops                # CUDA
    python -m bench.bench_ops --smoke        # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_ops.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import harness
from bench.bench_linear import check_against_reference
from te_compile import ops

FULL = (16384, 4096, 16384)
SMOKE = (64, 32, 128)
CHECK_RTOL = 3e-2  # bf16 through a GEMM and an element-wise op, fused vs unfused rounding
EAGER_TARGET = 1 / 1.1  # fused eager time / unfused eager time
COMPILED_TARGET = 1.0  # fused compiled time / unfused compiled time

CASES: dict[str, Callable[[int, int], list[torch.nn.Module]]] = {
    "linear+bias+GELU": lambda k, n: [ops.BasicLinear(k, n), ops.Bias(n), ops.GELU()],
    "linear+bias+add": lambda k, n: [ops.BasicLinear(k, n), ops.Bias(n), ops.AddExtraInput()],
}


def _build(make, k: int, n: int, device, dtype, fuse: bool) -> ops.Sequential:
    torch.manual_seed(0)
    return ops.Sequential(*make(k, n), fuse=fuse).to(device=device, dtype=dtype)


def run_case(name: str, t: int, k: int, n: int, *, device, timing) -> harness.CaseResult:
    torch._dynamo.reset()
    dtype = torch.bfloat16
    make = CASES[name]
    fused = _build(make, k, n, device, dtype, fuse=True)
    unfused = _build(make, k, n, device, dtype, fuse=False)
    unfused.load_state_dict(fused.state_dict())
    with torch.no_grad():
        fused[1].bias.normal_()
        unfused[1].bias.copy_(fused[1].bias)
    assert fused.fusions() and not unfused.fusions()
    x = torch.randn(t, k, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(t, n, device=device, dtype=dtype)
    residual = None
    if name.endswith("add"):
        residual = torch.randn(t, n, device=device, dtype=dtype, requires_grad=True)
    extra = () if residual is None else (residual,)
    kw = {"fullgraph": True, "dynamic": False}
    modules = {
        "unfused eager": (unfused, unfused),
        "fused eager": (fused, fused),
        "unfused compiled": (torch.compile(unfused, **kw), unfused),
        "fused compiled": (torch.compile(fused, **kw), fused),
    }
    calls = {
        label: ((lambda inp, call=call: call(inp, *extra)), list(mod.parameters()))
        for label, (call, mod) in modules.items()
    }
    notes = check_against_reference(calls, x, grad, CHECK_RTOL)
    baselines = {
        "unfused eager": None,
        "fused eager": "unfused eager",
        "unfused compiled": None,
        "fused compiled": "unfused compiled",
    }

    def step(call):
        def run(inp, g):
            call(inp, *extra).backward(g)

        return run

    competitors = {
        label: harness.Competitor(
            fn=harness.rotating(step(call), [(x, grad)], clear_grads=True),
            grad_to_none=(*mod.parameters(), *extra),
            baseline=baselines[label],
        )
        for label, (call, mod) in modules.items()
    }
    case = harness.Case(
        name=f"ops.Sequential {name} fwd+bwd",
        shape=f"T={t}, {k} -> {n}, bf16",
        flops=3 * 2 * t * k * n,
    )
    notes.append(
        f"targets: fused eager <= {EAGER_TARGET:.3f}x unfused eager (1.1x faster); "
        f"fused compiled <= {COMPILED_TARGET:.2f}x unfused compiled"
    )
    result = harness.run_case(case, competitors, device=device, notes=notes, **timing)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=sorted(CASES), default=None, help="run one case")
    args, device, timing, report = harness.start(
        parser, argv, "bench_ops", full_timing=harness.GEMM_TIMING
    )
    t, k, n = SMOKE if args.smoke else FULL
    for name in [args.only] if args.only else CASES:
        report.add(run_case(name, t, k, n, device=device, timing=timing))
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
