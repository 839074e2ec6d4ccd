"""Linear fwd+bwd: te_compile.Linear against nn.Linear, eager and torch.compile.

Cases (BENCHMARKS.md): tokens 16384, 4096 -> 16384 and 16384 -> 4096, bf16, with bias;
``--square`` adds 8192 x 8192 -> 8192. One timed call is ``out = m(x); out.backward(grad)``
with a fixed random (never zero) ``grad`` and ``x.requires_grad``, so it is three GEMMs
(forward, dgrad, wgrad) plus the bias gradient: FLOPs = 3 * 2*M*N*K. Weight and bias gradients
are set to None before every timed call (do_bench ``grad_to_none``, outside the timed region),
x's gradient inside the call (``harness.rotating(clear_grads=True)``, a host-side assignment).

Ratios: eager rows against ``nn.Linear eager``, compiled rows against ``nn.Linear compiled``.

    python -m bench.bench_linear                 # CUDA, results in bench/results/<date>_<gpu>/
    python -m bench.bench_linear --smoke         # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_linear.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

import te_compile
from bench import harness

# (tokens M, in_features K, out_features N)
FULL_SHAPES = [(16384, 4096, 16384), (16384, 16384, 4096)]
SQUARE_SHAPE = (8192, 8192, 8192)
SMOKE_SHAPES = [(64, 32, 128), (64, 128, 32)]
SMOKE_SQUARE = (64, 64, 64)

NN_EAGER = "nn.Linear eager"
TE_EAGER = "te_compile.Linear eager"
NN_COMPILED = "nn.Linear compiled"
TE_COMPILED = "te_compile.Linear compiled"

# Largest relative difference (max |a - b| / max |b|) to nn.Linear eager before a warning.
CHECK_RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def fwd_bwd(module: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., None]:
    def step(x: torch.Tensor, grad: torch.Tensor) -> None:
        module(x).backward(grad)

    return step


def _rel_err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return float("nan")
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check_against_reference(
    calls: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Sequence[nn.Parameter]]],
    x: torch.Tensor,
    grad: torch.Tensor,
    rtol: float,
) -> list[str]:
    """Run each competitor once on the same input and compare with the first one.

    Also serves as the first (compiling) call of the compiled competitors. Returns notes.
    """
    results: dict[str, list[torch.Tensor | None] | str] = {}
    for name, (call, params) in calls.items():
        xi = x.detach().clone().requires_grad_(True)
        try:
            out = call(xi)
            out.backward(grad)
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            continue
        results[name] = [out.detach(), xi.grad, *(p.grad for p in params)]
        for p in params:
            p.grad = None
    ref_name = next(iter(calls))
    ref = results[ref_name]
    if isinstance(ref, str):
        return [f"correctness check skipped: reference {ref_name} failed ({ref})"]
    parts, warnings = [], []
    for name, res in results.items():
        if name == ref_name:
            continue
        if isinstance(res, str):
            warnings.append(f"WARNING: {name} failed in the correctness check: {res}")
            continue
        errs = [_rel_err(a, b) for a, b in zip(res, ref, strict=True)]
        parts.append(f"{name} " + "/".join(f"{e:.1e}" for e in errs))
        if not all(e <= rtol for e in errs):  # also catches NaN
            warnings.append(f"WARNING: {name} differs from {ref_name} beyond rtol={rtol:g}")
    notes = [f"max rel. diff vs {ref_name} (out/dx/dw/db): " + "; ".join(parts)] if parts else []
    return notes + warnings


def run_shape(
    m: int,
    k: int,
    n: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    compile_: bool,
    compile_mode: str | None = None,
    timing: dict,
    case_name: str = "Linear fwd+bwd",
    timer: str = "auto",
    linear_cls: Callable[..., nn.Module] | None = None,
) -> harness.CaseResult:
    """One case: nn.Linear vs te_compile.Linear (``linear_cls``), eager (and compiled)."""
    torch._dynamo.reset()  # fresh compile per case: no recompiles into dynamic shapes
    torch.manual_seed(0)
    ref = nn.Linear(k, n, bias=True, device=device, dtype=dtype)
    te = (linear_cls or te_compile.Linear)(k, n, bias=True, params_dtype=dtype, device=device)
    with torch.no_grad():
        te.weight.copy_(ref.weight)
        te.bias.copy_(ref.bias)

    esize = torch.empty((), dtype=dtype).element_size()
    n_sets = harness.num_input_sets((m * k + m * n) * esize, harness.l2_cache_bytes(device))
    xs = [torch.randn(m, k, device=device, dtype=dtype, requires_grad=True) for _ in range(n_sets)]
    grads = [torch.randn(m, n, device=device, dtype=dtype) for _ in range(n_sets)]
    sets = list(zip(xs, grads, strict=True))

    modules: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module, str]] = {
        NN_EAGER: (ref, ref, NN_EAGER),
        TE_EAGER: (te, te, NN_EAGER),
    }
    if compile_:
        kw = {"fullgraph": True, "dynamic": False, "mode": compile_mode}
        modules[NN_COMPILED] = (torch.compile(ref, **kw), ref, NN_COMPILED)
        modules[TE_COMPILED] = (torch.compile(te, **kw), te, NN_COMPILED)

    case = harness.Case(
        name=case_name,
        shape=f"{m}x{k} -> {n}, {str(dtype).removeprefix('torch.')}, bias",
        flops=3 * 2 * m * n * k,
    )
    notes = check_against_reference(
        {name: (call, list(mod.parameters())) for name, (call, mod, _) in modules.items()},
        xs[0],
        grads[0],
        CHECK_RTOL.get(dtype, 2e-2),
    )
    if n_sets > 1:
        notes.append(f"{n_sets} rotating (x, grad) input sets")
    for note in notes:
        if note.startswith("WARNING"):
            print(f"  [{case.name}] {note}", file=sys.stderr)
    competitors = {
        name: harness.Competitor(
            fn=harness.rotating(fwd_bwd(call), sets, clear_grads=True),
            grad_to_none=tuple(mod.parameters()),
            baseline=base,
        )
        for name, (call, mod, base) in modules.items()
    }
    result = harness.run_case(case, competitors, device=device, timer=timer, notes=notes, **timing)
    del competitors, modules, xs, grads, sets, ref, te
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(parser)
    parser.add_argument("--square", action="store_true", help="also run 8192x8192 -> 8192")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument(
        "--compile-mode", default=None, help="torch.compile mode (default: torch's default)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)

    device = harness.resolve_device(args)
    if device.type != "cuda" and not args.smoke:
        parser.error("full-size shapes need a CUDA GPU; use --smoke on CPU")
    dtype = getattr(torch, args.dtype)
    shapes = list(SMOKE_SHAPES if args.smoke else FULL_SHAPES)
    if args.square:
        shapes.append(SMOKE_SQUARE if args.smoke else SQUARE_SHAPE)
    if args.smoke:
        timing = {"warmup_ms": 5, "rep_ms": 20, "repeat": 3, "min_trial_s": 0.01}
    else:
        timing = {"warmup_ms": 200, "rep_ms": 1000, "repeat": 7, "min_trial_s": 0.1}

    meta = harness.collect_metadata(device)
    meta["te_compile"] = getattr(te_compile, "__version__", None)
    meta["dtype"] = args.dtype
    meta["compile_mode"] = args.compile_mode
    meta["smoke"] = args.smoke
    report = harness.Report("bench_linear", meta)
    print(report.header_markdown())
    for m, k, n in shapes:
        report.add(
            run_shape(
                m,
                k,
                n,
                device=device,
                dtype=dtype,
                compile_=not args.no_compile,
                compile_mode=args.compile_mode,
                timing=timing,
            )
        )
    report.finish(harness.resolve_out_dir(args, meta), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
