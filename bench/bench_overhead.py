"""Eager overhead: what te_compile costs per call from Python, against plain PyTorch.

Part 1, "eager overhead" (BENCHMARKS.md): Linear 2048x1024 -> 1024 bf16 fwd+bwd,
``te_compile.Linear`` eager against ``nn.Linear`` eager. Target: te <= 1.25x. Timed with the
host clock (steady-state time per call, host overhead included: the number the target is about)
and, on CUDA, again as GPU kernel time (torch.profiler): wall >> kernels means host-bound. On CPU
the shape is tiny (16x64 -> 64), so the case measures host cost there as well.

Part 2, "op entry": host-clock cost of entering an op from Python, on tiny tensors so that host
cost dominates (median over trials of many back-to-back calls, device synchronized at the ends
of each trial): a direct call of a Python function doing ``torch.add(x, 1)``, the same as a
``torch.library.custom_op`` (with autograd registered, as every te op is), through a raw
``torch.library.Library`` definition, and as a ``torch.autograd.Function``; then a tiny linear
through ``F.linear``, ``nn.Linear`` / ``te_compile.Linear`` modules and the te_compile entries
returned by ``extra_entries()``. Each table is run with inputs that do not and that do require
grad. Part 2 is a host measurement and is meaningful on CPU too.

Part 3, "host time per op in a compiled graph": a chain of ``CHAIN`` calls of one op (RMSNorm,
SwiGLU, Linear) on tiny tensors, fwd+bwd, compiled with ``fullgraph=True``: the aten / torch
version, te_compile's op traced through by Inductor (the default), and te_compile's op kept
opaque (``torch._functorch.config.decompose_custom_triton_ops=False``: one dispatcher call per
op, as before ops were traced through). Host clock per step, divided by ``CHAIN``: what one op
costs the host in a compiled step. Target (issue 24): te <= aten + 5 us per op.

Part 4, "host us per module call" (``bench/bench_host.py``): every te module eager, fwd+bwd on
small shapes, in bf16 and under each recipe, beside its plain-PyTorch equivalent and TE's
published figures, with a summary table of the targets (issue 43). ``--only-modules`` runs it
alone.

    python -m bench.bench_overhead            # CUDA if present; results in bench/results/...
    python -m bench.bench_overhead --smoke    # tiny and short; nothing written without --out
    python -m bench.bench_overhead --only-modules   # part 4 alone
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_overhead.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import te_compile
from bench import bench_host, harness
from bench.bench_linear import NN_EAGER, TE_EAGER, run_shape

OVERHEAD_SHAPE = (2048, 1024, 1024)  # tokens, in, out
CHAIN = 16  # ops per compiled graph in part 3
COMPILED_TARGET_US = 5.0
TINY_SHAPE = (16, 64, 64)
TARGET_RATIO = 1.25

DIRECT = "direct Python fn"
F_LINEAR = "F.linear"

# --------------------------------------------------------------------------------------------
# Throwaway ops in the namespace te_bench (registered once per process)
# --------------------------------------------------------------------------------------------

_BENCH_OPS: dict[str, object] = {}


def add_one(x: torch.Tensor) -> torch.Tensor:
    return torch.add(x, 1)


class AddOneFunction(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.add(x, 1)

    @staticmethod
    def setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def bench_ops() -> dict[str, object]:
    """``custom_op``: te_bench::add_one (fake + autograd registered, like a te op);
    ``library``: te_bench::add_one_lib, Library.define + impl, no autograd kernel."""
    if not _BENCH_OPS:

        @torch.library.custom_op("te_bench::add_one", mutates_args=())
        def add_one_op(x: torch.Tensor) -> torch.Tensor:
            return torch.add(x, 1)

        @add_one_op.register_fake
        def _(x: torch.Tensor) -> torch.Tensor:
            return torch.empty_like(x)

        def _backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            return grad

        add_one_op.register_autograd(_backward)

        lib = torch.library.Library("te_bench", "FRAGMENT")
        lib.define("add_one_lib(Tensor x) -> Tensor")
        lib.impl("add_one_lib", add_one, "CompositeExplicitAutograd")

        _BENCH_OPS.update(custom_op=add_one_op, library=lib)
    return _BENCH_OPS


# --------------------------------------------------------------------------------------------
# >>> LEAD: te_compile's own op-entry mechanisms go here. <<<
# Everything is guarded (ImportError / hasattr) so that the script runs before they exist.
# An entry that raises when called shows up as an error row, it does not stop the run.
# --------------------------------------------------------------------------------------------


def extra_entries(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, Callable]:
    """Extra rows of the tiny-linear table: name -> zero-arg callable on (x, w, b).

    x: [tokens, in], w: [out, in], b: [out]; F.linear(x, w, b) is the baseline row.
    """
    entries: dict[str, Callable] = {}
    with contextlib.suppress(ImportError):  # the op mechanism; registers torch.ops.te.*
        import te_compile._library
    try:
        import te_compile.functional as te_functional
    except ImportError:
        te_functional = None

    te_ops = torch.ops.te
    if hasattr(te_ops, "linear_fwd"):  # adjust the arguments to the op's schema
        entries["torch.ops.te.linear_fwd (op path)"] = lambda: te_ops.linear_fwd(x, w, b, None)
    if te_functional is not None and hasattr(te_functional, "linear"):
        entries["te_compile.functional.linear"] = lambda: te_functional.linear(x, w, b)
        set_fast = getattr(te_compile, "set_eager_fast_path", None)
        is_fast = getattr(te_compile, "eager_fast_path_enabled", None)
        if set_fast is not None and is_fast is not None:

            def op_path() -> torch.Tensor:  # + ~0.3 us for the toggling
                previous = is_fast()
                set_fast(False)
                try:
                    return te_functional.linear(x, w, b)
                finally:
                    set_fast(previous)

            entries["te_compile.functional.linear, fast path off"] = op_path
    # e.g. an eager fast path:
    # if hasattr(te_compile._library, "eager_call"): entries["te fast path"] = lambda: ...
    return entries


def extra_add_entries(x: torch.Tensor) -> dict[str, Callable]:
    """Extra rows of the add-one table: ``torch.add(x, 1)`` defined with te_compile's
    mechanism (e.g. a ``te_bench::add_one`` made by ``te_compile._library``), if any."""
    entries: dict[str, Callable] = {}
    return entries


# --------------------------------------------------------------------------------------------
# Part 2: op entry tables
# --------------------------------------------------------------------------------------------


def add_entries(x: torch.Tensor) -> dict[str, Callable]:
    ops = bench_ops()
    custom = ops["custom_op"]
    overload = torch.ops.te_bench.add_one.default
    lib_overload = torch.ops.te_bench.add_one_lib.default
    return {
        DIRECT: lambda: add_one(x),
        "custom_op (CustomOpDef call)": lambda: custom(x),
        "custom_op (torch.ops.te_bench.add_one.default)": lambda: overload(x),
        "Library.define + impl, no autograd kernel": lambda: lib_overload(x),
        "torch.autograd.Function.apply": lambda: AddOneFunction.apply(x),
        **extra_add_entries(x),
    }


def linear_entries(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict[str, Callable]:
    out_f, in_f = w.shape
    ref = nn.Linear(in_f, out_f, device=x.device, dtype=x.dtype)
    entries: dict[str, Callable] = {
        F_LINEAR: lambda: F.linear(x, w, b),
        "nn.Linear module": lambda: ref(x),
    }
    te_linear = getattr(te_compile, "Linear", None)
    if te_linear is not None:
        te = te_linear(in_f, out_f, params_dtype=x.dtype, device=x.device)
        entries["te_compile.Linear module"] = lambda: te(x)
    entries.update(extra_entries(x, w, b))
    return entries


def run_entry_tables(device: torch.device, timing: dict) -> list[harness.CaseResult]:
    results = []
    for requires_grad in (False, True):
        grad_text = "inputs require grad" if requires_grad else "inputs do not require grad"
        torch.manual_seed(0)
        x = torch.randn(8, device=device, requires_grad=requires_grad)
        case = harness.Case("op entry: add one", f"float32 [8], {grad_text}")
        entries = add_entries(x)
        results.append(
            harness.run_case(case, entries, baseline=DIRECT, device=device, timer="wall", **timing)
        )

        tokens, in_f, out_f = 4, 16, 16
        x = torch.randn(tokens, in_f, device=device, requires_grad=requires_grad)
        w = torch.randn(out_f, in_f, device=device, requires_grad=requires_grad)
        b = torch.randn(out_f, device=device, requires_grad=requires_grad)
        case = harness.Case(
            "op entry: linear forward", f"float32 [{tokens},{in_f}] -> {out_f}, {grad_text}"
        )
        entries = linear_entries(x, w, b)
        note = "the module rows own parameters that require grad in both tables"
        results.append(
            harness.run_case(
                case,
                entries,
                baseline=F_LINEAR,
                device=device,
                timer="wall",
                notes=[note],
                **timing,
            )
        )
    return results


# --------------------------------------------------------------------------------------------
# Part 3: host time per op inside a compiled graph
# --------------------------------------------------------------------------------------------


def _chains(device: torch.device) -> dict[str, tuple[Callable, Callable, tuple]]:
    """Per op kind: ``(aten_step, te_step, inputs)``; each step maps the inputs through CHAIN
    calls of the op (weights shared along the chain)."""
    tef = te_compile.functional
    h = 64
    x = torch.randn(16, h, device=device, requires_grad=True)
    g = torch.randn(h, device=device, requires_grad=True)
    w = (torch.randn(h, h, device=device) / h**0.5).requires_grad_()
    x2 = torch.randn(16, 2 * h, device=device, requires_grad=True)

    def chain(op):
        def step(t, p):
            for _ in range(CHAIN):
                t = op(t, p)
            return t

        return step

    def swiglu_torch(t, _p):
        a, lin = t.chunk(2, -1)
        return torch.cat([F.silu(a) * lin] * 2, -1)

    def swiglu_te(t, _p):
        return torch.cat([tef.swiglu(t)] * 2, -1)

    return {
        "RMSNorm": (
            chain(lambda t, p: F.rms_norm(t, (h,), p, 1e-5)),
            chain(lambda t, p: tef.rmsnorm(t, p, 1e-5)),
            (x, g),
        ),
        "SwiGLU": (chain(swiglu_torch), chain(swiglu_te), (x2, g)),
        "Linear": (
            chain(lambda t, p: F.linear(t, p)),
            chain(lambda t, p: tef.linear(t, p)),
            (x, w),
        ),
    }


def run_compiled_op_tables(device: torch.device, timing: dict) -> list[harness.CaseResult]:
    results = []
    for kind, (aten_step, te_step, inputs) in _chains(device).items():

        def compiled(step, inputs=inputs, *, opaque=False):
            """Compiled on its first call, which is the competitor's first warm-up call: the
            harness times competitors one after the other, and all chains share one code object
            (Dynamo's cache key), so each starts from a reset and compiles in its own setting."""
            fn = None

            def call():
                nonlocal fn
                if fn is None:
                    torch._dynamo.reset()
                    fn = torch.compile(step, fullgraph=True)
                    with torch._functorch.config.patch(decompose_custom_triton_ops=not opaque):
                        fn(*inputs).sum().backward()
                fn(*inputs).sum().backward()

            return call

        entries = {
            f"torch {kind}, compiled": compiled(aten_step),
            f"te {kind}, compiled (traced through)": compiled(te_step),
            f"te {kind}, compiled (opaque ops)": compiled(te_step, opaque=True),
        }
        case = harness.Case(
            f"host time per op in a compiled graph: {kind}",
            f"{CHAIN} chained calls, fwd+bwd, float32 tiny tensors",
        )
        result = harness.run_case(
            case, entries, baseline=f"torch {kind}, compiled", device=device, timer="wall", **timing
        )
        base = result.row(f"torch {kind}, compiled").median_ms
        for name in list(entries)[1:]:
            t = result.row(name).median_ms
            if base is not None and t is not None:
                extra_us = (t - base) * 1e3 / CHAIN
                ok = "meets" if extra_us <= COMPILED_TARGET_US else "MISSES"
                result.notes.append(
                    f"{name}: {extra_us:+.2f} us per op over torch ({ok} <= "
                    f"{COMPILED_TARGET_US} us)"
                )
        results.append(result)
    return results


# --------------------------------------------------------------------------------------------
# Part 1: Linear fwd+bwd, eager
# --------------------------------------------------------------------------------------------


def run_linear_overhead(
    device: torch.device, smoke: bool, wall_timing: dict, kernel_timing: dict
) -> list[harness.CaseResult]:
    te_linear = getattr(te_compile, "Linear", None)
    if te_linear is None:
        print("te_compile.Linear does not exist yet: skipping the Linear case", file=sys.stderr)
        return []
    m, k, n = OVERHEAD_SHAPE if device.type == "cuda" and not smoke else TINY_SHAPE
    common = {"device": device, "dtype": torch.bfloat16, "compile_": False, "linear_cls": te_linear}
    results = [
        run_shape(m, k, n, **common, timing=wall_timing, timer="wall", case_name="eager overhead")
    ]
    wall = results[0]
    ratio = wall.row(TE_EAGER).ratio
    if ratio is None:
        verdict = "no ratio (a competitor failed)"
    else:
        ok = "meets" if ratio <= TARGET_RATIO else "MISSES"
        verdict = f"{ratio:.3f}x, {ok} the target <= {TARGET_RATIO}x"
    wall.notes.insert(0, f"{TE_EAGER} / {NN_EAGER} (host clock): {verdict}")
    if device.type == "cuda":
        results.append(
            run_shape(
                m,
                k,
                n,
                **common,
                timing=kernel_timing,
                timer="kernels",
                case_name="eager overhead, GPU kernel time",
            )
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(parser)
    parser.add_argument("--skip-linear", action="store_true", help="only the op-entry tables")
    parser.add_argument("--skip-entry", action="store_true", help="only the Linear case")
    parser.add_argument(
        "--skip-compiled", action="store_true", help="without part 3 (compiled graphs)"
    )
    parser.add_argument("--skip-modules", action="store_true", help="without part 4 (modules)")
    parser.add_argument(
        "--only-modules", action="store_true", help="only part 4: host us per module call"
    )
    parser.add_argument(
        "--modules",
        nargs="+",
        choices=bench_host.MODULES,
        default=bench_host.MODULES,
        metavar="NAME",
        help=f"part 4's modules (default: all): {', '.join(bench_host.MODULES)}",
    )
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=tuple(bench_host.PRECISIONS),
        default=tuple(bench_host.PRECISIONS),
        metavar="NAME",
        help=f"part 4's precisions (default: all): {', '.join(bench_host.PRECISIONS)}",
    )
    args = parser.parse_args(argv)
    if args.only_modules:
        args.skip_linear = args.skip_entry = args.skip_compiled = True

    device = harness.resolve_device(args)
    if args.smoke:
        wall_timing = {"repeat": 3, "min_trial_s": 0.01}
        entry_timing = {"repeat": 3, "min_trial_s": 0.01, "min_number": 100}
        kernel_timing = {"repeat": 3}
    else:
        wall_timing = {"repeat": 15, "min_trial_s": 0.1}
        entry_timing = {"repeat": 9, "min_trial_s": 0.1, "min_number": 1000}
        kernel_timing = {"repeat": 5}

    meta = harness.collect_metadata(device)
    meta["te_compile"] = getattr(te_compile, "__version__", None)
    meta["smoke"] = args.smoke
    meta["target_ratio"] = TARGET_RATIO
    report = harness.Report("bench_overhead", meta)
    print(report.header_markdown())
    if not args.skip_linear:
        for result in run_linear_overhead(device, args.smoke, wall_timing, kernel_timing):
            report.add(result)
    if not args.skip_entry:
        for result in run_entry_tables(device, entry_timing):
            report.add(result)
    if not args.skip_compiled:
        for result in run_compiled_op_tables(device, wall_timing):
            report.add(result)
    if not args.skip_modules:
        bench_host.run_module_tables(report, device, wall_timing, args.modules, args.precisions)
    report.finish(harness.resolve_out_dir(args, meta), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
