"""Where the first compiled step's time goes: Dynamo, AOTAutograd, Inductor, C++/Triton compile.

Issue 41 item 3 asks that the first compiled step (fwd+bwd) of a stack of te_compile modules
cost at most 1.25x that of the same stack in plain PyTorch. This script measures, per row, the
first step of ``bench_block``'s stack (its model builders, imported) under
``torch.compile(dynamic=False)`` and breaks it down with ``torch._dynamo.utils.compile_times``:

- dynamo: Dynamo's frame compile (``_compile.compile_inner``) less the backend call
  (``OutputGraph.call_user_compiler``): bytecode analysis, tracing into the FX graph, guards;
- AOT: the backend call less Inductor's per-graph compiles (``compile_fx_inner``): the joint
  fwd+bwd trace through the dispatcher (fake tensors, te's meta functions, decompositions) and
  the partitioner;
- inductor: ``compile_fx_inner`` less its code-generation/compile part: graph passes, lowering,
  scheduling and fusion;
- codegen/compile: ``GraphLowering.compile_to_module`` (``codegen`` + loading the module:
  Inductor's wrapper code, the C++ kernels' compile on CPU, Triton's on CUDA), of which
  ``PyCodeCache.load_by_key_path`` (waiting for the kernels' compile) is shown apart;
- the backward graph is compiled lazily, at the first backward (``backward._backward_impl``):
  its time counts in AOT / Inductor / codegen like the forward's;
- generated kernels: ``torch._inductor.metrics.generated_kernel_count`` (C++ or Triton kernels
  Inductor wrote, forward and backward);
- nodes: FX nodes of Dynamo's graphs (a backend wrapper counts them) and of the AOT forward
  and backward graphs (an ``inner_compile`` wrapper), summed over graphs.

Rows: ``torch bf16`` (plain PyTorch), ``te bf16``, ``te FP8 current`` (Float8CurrentScaling)
and ``te FP8 delayed`` (DelayedScaling), whose second step compiles again (the delayed step,
with calibrated scales): ``te FP8 delayed step 2`` is that step's compile. Each row runs in a
fresh child process with an empty Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``, FX
graph and AOTAutograd caches off), after a throwaway compile that pays the process's one-time
costs (imports, compile workers, the C++ toolchain probe) and whose times are discarded.

On the CPU Inductor generates and compiles C++ (not Triton) and te's ops take their CPU paths,
so only the Dynamo / AOT parts and the node counts carry over to a GPU, roughly. With
``--cuda-paths`` (CPU) each row instead compiles te's CUDA code paths and Inductor's CUDA code
(``bench.diag.diag_launches``' patched copy of ``te_compile`` and ``sm90_compiler``: Triton code
for sm_90, no kernel compiled): Dynamo, AOT and Inductor then do the work they do on a GPU, and
the step stops where the generated code would run (DelayedScaling's states are marked
calibrated, so its one step is the delayed step's compile). Codegen's Triton compile and the
GPU's own times are not in it; both graphs compile before the run, so the backward's nodes
count in the AOT forward column and the graphs column reads 0.

    python -m bench.diag.diag_compile_time                      # smoke size, 2 layers, CPU
    python -m bench.diag.diag_compile_time --rows te-bf16 --layers 1 --json out.json
    python -m bench.diag.diag_compile_time --device cuda --size h4096   # real shapes (GPU)
    python -m bench.diag.diag_compile_time --cuda-paths --layers 4      # the GPU's phases, here
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("torch-bf16", "te-bf16", "te-current", "te-delayed")


# --------------------------------------------------------------------------------------------
# Child: one row in a fresh process
# --------------------------------------------------------------------------------------------


def _phase_times(metrics: dict[str, list[float]]) -> dict[str, float]:
    """The breakdown (module docstring) from ``compile_times``' raw per-function lists."""

    def total(*names: str) -> float:
        return sum(sum(v) for k, v in metrics.items() if k in names)

    frame = total("_compile.compile_inner")
    backend = total("OutputGraph.call_user_compiler")
    backward = total("backward._backward_impl")  # the backward graph's compile, run lazily
    inner = total("compile_fx_inner")
    codegen = total("GraphLowering.compile_to_module")
    return {
        "dynamo_s": frame - backend,
        "aot_s": backend + backward - inner,
        "inductor_s": inner - codegen,
        "codegen_s": codegen,
        "load_s": total("PyCodeCache.load_by_key_path"),
        "compile_s": frame + backward,
    }


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    if args.cuda_paths:  # the patched te_compile on PYTHONPATH comes first
        sys.path.append(str(ROOT))
    else:
        sys.path.insert(0, str(ROOT))
    import torch
    from torch._dynamo.utils import compilation_time_metrics, compile_times, counters
    from torch._inductor import metrics as inductor_metrics
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from bench import bench_block as bb

    device = torch.device(args.device)
    bb.raise_recompile_limits()
    if args.cuda_paths:
        from bench.diag.diag_launches import sm90_compiler

        sm90_compiler()
    with _stopped_at_run(args.cuda_paths):
        bb.warm_up_compiler(device)
    compilation_time_metrics.clear()
    counters.clear()

    nodes: dict[str, list[int]] = {"dynamo": [], "aot_fwd": [], "aot_bwd": []}
    ops: dict[str, int] = {}

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kw: Any) -> Any:
        kind = "aot_bwd" if kw.get("is_backward") else "aot_fwd"
        nodes[kind].append(len(gm.graph.nodes))
        for n in gm.graph.nodes:
            if n.op == "call_function":
                name = str(getattr(n.target, "__name__", n.target))
                if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
                    name = "wrap_triton:" + str(n.kwargs.get("kernel_idx"))
                ops[name] = ops.get(name, 0) + 1
        return compile_fx_inner(gm, example_inputs, **kw)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        nodes["dynamo"].append(len(gm.graph.nodes))
        return compile_fx(gm, example_inputs, inner_compile=inner)

    size = bb.SIZES[args.size] if args.size != "smoke" else bb.SMOKE_SIZES["block"]
    if args.layers is not None:
        size = bb.Size(
            size.name, size.hidden, size.heads, size.ffn, size.seq, size.batch, args.layers
        )
    impl, precision = args.row.split("-")
    spec = bb.RowSpec(impl, precision, "compiled")
    weights = bb.make_weights(size, device)
    torch.manual_seed(1)
    x = torch.randn(size.input_shape, device=device, dtype=bb.DTYPE, requires_grad=True)
    grad = torch.randn_like(x)
    model = bb.build_model(spec, size, weights, device)
    for m in model.modules() if args.cuda_paths else ():
        if hasattr(m, "calibrated"):  # (te's FP8 states: the delayed step's graph)
            m.calibrated = True
    fn = torch.compile(model, backend=backend, dynamic=False)
    if precision in bb.TE_RECIPES:
        recipe = bb.TE_RECIPES[precision]()

        def call(x: torch.Tensor) -> torch.Tensor:
            with bb.te.autocast(recipe=recipe):
                return fn(x)
    else:
        call = fn

    steps = []
    for step in range(args.steps):
        compilation_time_metrics.clear()
        for v in nodes.values():
            v.clear()
        ops.clear()
        inductor_metrics.reset()
        graphs0 = int(counters["stats"]["unique_graphs"])
        t0 = time.perf_counter()
        with _stopped_at_run(args.cuda_paths):
            bb.forward_backward(call, x, grad, cudagraphs=False)
        wall = time.perf_counter() - t0
        for p in model.parameters():
            p.grad = None
        metrics = {k: list(v) for k, v in compilation_time_metrics.items()}
        steps.append(
            {
                "step": step + 1,
                "wall_s": wall,
                "graphs": int(counters["stats"]["unique_graphs"]) - graphs0,
                "kernels": inductor_metrics.generated_kernel_count,
                **_phase_times(metrics),
                "nodes": {k: sum(v) for k, v in nodes.items()},
                "graph_nodes": {k: list(v) for k, v in nodes.items()},
                "top_ops": sorted(ops.items(), key=lambda kv: -kv[1])[:15],
                "compile_times": compile_times(repr="str", aggregate=True)
                if args.verbose
                else None,
                "metrics": {k: sum(v) for k, v in metrics.items()},
            }
        )
    return {"row": args.row, "layers": size.layers, "size": size.describe(), "steps": steps}


@contextlib.contextmanager
def _stopped_at_run(cuda_paths: bool) -> Iterator[None]:
    """``--cuda-paths``: the compile finishes, then running its code (sm_90 Triton on CPU
    tensors) fails; the step's compile is what is measured."""
    try:
        yield
    except Exception as e:
        if not cuda_paths:
            raise
        # (shown: a compile that failed earlier would make the times a partial compile's)
        print(f"(stopped: {type(e).__name__}: {str(e)[:100]})", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Parent: one child per row, a table
# --------------------------------------------------------------------------------------------


def row_steps(row: str, cuda_paths: bool = False) -> int:
    return 2 if row == "te-delayed" and not cuda_paths else 1


def run_row(row: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="diag_compile_") as tmp:
        env = dict(os.environ)
        env.update(
            TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"),
            TRITON_CACHE_DIR=str(Path(tmp) / "triton"),
            TORCHINDUCTOR_FX_GRAPH_CACHE="0",
            TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        )
        out = Path(tmp) / "row.json"
        steps = row_steps(row, args.cuda_paths)
        cmd = [sys.executable, "-m", "bench.diag.diag_compile_time", "--child", row]
        cmd += ["--device", args.device, "--steps", str(steps), "--json-child", str(out)]
        cmd += ["--size", args.size]
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        if args.verbose:
            cmd.append("--verbose")
        cwd = ROOT
        if args.cuda_paths:  # a child importing the patched copy first (module docstring)
            from bench.diag.diag_launches import _patched_copy

            cwd = Path(tmp) / "src"
            _patched_copy(cwd)
            env.update(PYTHONPATH=os.pathsep.join([str(cwd), str(ROOT)]), TRITON_INTERPRET="0")
            cmd.append("--cuda-paths")
        print(f"  {row} ...", file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=cwd, env=env, check=True)
        return json.loads(out.read_text())


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        "| row | first step (s) | dynamo (s) | AOT (s) | Inductor (s) | codegen + compile (s) "
        "| of which kernel compile (s) | graphs | generated kernels "
        "| nodes: dynamo / AOT fwd / AOT bwd |"
    )
    lines = [header, "| --- |" + " ---: |" * 9]
    for res in results:
        for st in res["steps"]:
            name = res["row"].replace("-", " ", 1)
            if name.startswith("te ") and name != "te bf16":
                name = name.replace("te ", "te FP8 ")
            if len(res["steps"]) > 1:
                name += f" step {st['step']}"
            n = st["nodes"]
            lines.append(
                f"| {name} | {st['wall_s']:.2f} | {st['dynamo_s']:.2f} | {st['aot_s']:.2f} "
                f"| {st['inductor_s']:.2f} | {st['codegen_s']:.2f} | {st['load_s']:.2f} "
                f"| {st['graphs']} | {st['kernels']} "
                f"| {n['dynamo']} / {n['aot_fwd']} / {n['aot_bwd']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="default: cpu")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument(
        "--size", choices=["smoke", "h1024", "h2048", "h4096"], default="smoke",
        help="bench_block's block stack at this size (default: its smoke size)",
    )  # fmt: skip
    parser.add_argument(
        "--layers", type=int, default=None, help="layers of the stack (default: the size's)"
    )
    parser.add_argument("--json", type=Path, help="write every row's measurements here")
    parser.add_argument("--verbose", action="store_true", help="print compile_times per step")
    parser.add_argument(
        "--cuda-paths", action="store_true", help="CPU: compile te's CUDA paths for sm_90 (docs)"
    )
    parser.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.row = args.child
        result = run_child(args)
        args.json_child.write_text(json.dumps(result, indent=1))
        return 0
    results = []
    for row in args.rows:  # each row's line as it ends: a run stopped by a time limit keeps them
        results.append(run_row(row, args))
        print(*format_table(results[-1:]).splitlines()[2:], sep="\n", flush=True)
    print(format_table(results))
    for res in results:
        for st in res["steps"]:
            print(f"\n{res['row']} step {st['step']}: top AOT ops {st['top_ops']}")
            if st["compile_times"]:
                print(st["compile_times"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
