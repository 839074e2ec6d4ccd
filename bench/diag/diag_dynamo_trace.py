"""Where dynamo's tracing time goes: the Python functions it traces, sampled.

``diag_compile_time``'s "dynamo" column is the time dynamo takes to turn a ``bench_block`` stack's
forward into a graph; this says which functions of the traced code (te's modules, the
``quantization`` layer, the family functions, the benchmark's own code) that time is spent in.
Dynamo interprets each traced function's bytecode; a profiler signal (process CPU time, every 2
ms) records, for each sample, the functions whose bytecode dynamo is interpreting at that moment
(the innermost is the "self" one). Nothing is instrumented, so the totals are dynamo's own.

The stack runs te's CUDA code paths on the CPU (``bench.diag.diag_launches``' patched copy of
``te_compile``, in a child process) and stops at the backend: only the forward's trace is timed,
after untimed traces of the same stack. DelayedScaling's states are marked calibrated.

    python -m bench.diag.diag_dynamo_trace                      # te-current, h1024, 8 layers
    python -m bench.diag.diag_dynamo_trace --row torch-bf16     # the plain-PyTorch stack
    python -m bench.diag.diag_dynamo_trace --row te-delayed --top 40
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import CodeType

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("torch-bf16", "te-bf16", "te-current", "te-delayed")


def _name(code: CodeType) -> str:
    path = code.co_filename
    short = path.split("/te_compile/")[-1] if "/te_compile/" in path else Path(path).name
    return f"{short}:{code.co_firstlineno} {code.co_name}"


def run_child(args: argparse.Namespace) -> None:
    import torch
    from torch._dynamo.symbolic_convert import InstructionTranslatorBase

    from bench import bench_block as bb

    device = torch.device("cpu")
    base = bb.SIZES[args.size]
    size = bb.Size(base.name, base.hidden, base.heads, base.ffn, base.seq, base.batch, args.layers)
    impl, precision = args.row.split("-")
    weights = bb.make_weights(size, device)
    model = bb.build_model(bb.RowSpec(impl, precision, "compiled"), size, weights, device)
    for m in model.modules():
        if hasattr(m, "calibrated"):  # (te's FP8 states: the delayed step's graph)
            m.calibrated = True
    x = torch.randn(size.input_shape, dtype=bb.DTYPE, requires_grad=True)
    recipe = bb.TE_RECIPES[precision]() if precision in bb.TE_RECIPES else None

    def stop(gm: torch.fx.GraphModule, example_inputs: list) -> None:
        raise RuntimeError("traced")  # the backend: nothing after dynamo runs

    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    samples = [0, 0]  # all, outside any traced function

    def sample(signum: int, frame) -> None:
        samples[0] += 1
        seen: set[str] = set()
        while frame is not None:
            tracer = frame.f_locals.get("self") if frame.f_code.co_name == "step" else None
            if isinstance(tracer, InstructionTranslatorBase):
                key = _name(tracer.f_code)
                if not seen:
                    own[key] += 1
                if key not in seen:
                    inclusive[key] += 1
                    seen.add(key)
            frame = frame.f_back
        samples[1] += not seen

    times = []
    for rep in range(args.reps):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=stop, dynamic=False)
        timed = rep == args.reps - 1
        if timed:
            signal.signal(signal.SIGPROF, sample)
            signal.setitimer(signal.ITIMER_PROF, 0.002, 0.002)
        t0 = time.process_time()
        try:
            if recipe is None:
                compiled(x)
            else:
                with bb.te.autocast(recipe=recipe):
                    compiled(x)
        except Exception as e:  # the backend's stop, wrapped by dynamo
            if "traced" not in str(e):
                raise
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0, 0)
        times.append(time.process_time() - t0)
    total, n = times[-1], max(samples[0], 1)
    print(f"{args.row}, {size.describe()}: dynamo's forward trace {total:.2f} s of CPU time "
          f"(earlier traces: {', '.join(f'{t:.2f}' for t in times[:-1])}); {samples[0]} "
          f"samples, {samples[1]} outside any traced function")  # fmt: skip
    for title, table in (("inclusive", inclusive), ("self", own)):
        print(f"\n| traced function | {title} s |\n| --- | ---: |")
        for key, count in table.most_common(args.top):
            print(f"| `{key}` | {count / n * total:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=ROWS, default="te-current")
    parser.add_argument("--size", choices=("h1024", "h2048", "h4096"), default="h1024")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3, help="traces; the last is sampled")
    parser.add_argument("--top", type=int, default=25, help="rows of each table")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.append(str(ROOT))
        from bench.diag.diag_launches import sm90_compiler

        sm90_compiler()
        run_child(args)
        return
    from bench.diag.diag_launches import _patched_copy

    with tempfile.TemporaryDirectory(prefix="diag_dynamo_") as tmp:
        src = Path(tmp) / "src"
        _patched_copy(src)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(ROOT)]),
               "TRITON_INTERPRET": "0"}  # fmt: skip
        cmd = [sys.executable, "-m", "bench.diag.diag_dynamo_trace", *sys.argv[1:], "--child"]
        sys.exit(subprocess.run(cmd, cwd=src, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
