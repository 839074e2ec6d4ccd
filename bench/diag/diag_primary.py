"""FP8 primary weights of the grouped modules: memory, speed, host time and Inductor's code.

Modules (bf16 activations, no bias, the splits an int64 tensor on the device):

* ``GroupedLinear``: bench_grouped's FP8 case, 8 experts, 32768 tokens in its uneven splits,
  4096 -> 2048;
* ``GroupedMLP``: the MoE layer's experts (``examples/moe_layer.py``), 64 experts, hidden 4096,
  ffn 1408, SwiGLU, 32768 rows (16384 tokens, top-2), uneven splits.

Rows per module, all ``torch.compile(fullgraph=True, dynamic=False)`` inside
``te_compile.autocast`` of the row's recipe (current or delayed scaling):

* ``bf16 weights``: the weights in bf16, cast to FP8 in every step, bf16 gradients;
* ``FP8 weights``: built inside ``te_compile.quantized_model_init(recipe=...)``, one FP8
  weight (and scale) per expert; ``FP8 weights, single``: one ``[E, out, in]`` FP8 weight
  with one scale (GroupedLinear's ``single_grouped_weight``). Their gradients go to the fp32
  ``main_grad`` of ``te_compile.FP8MasterWeights``.

Columns: ``median ms`` (triton's do_bench of one forward + backward, L2 flushed); ``host ms``
(the host's time to issue one step while the GPU is held busy: launch and Python cost, and the
wait for the GPU where the step synchronises; ``--where-host-waits`` profiles it); ``syncs``
(synchronising CUDA calls of one step, ``torch.cuda.set_sync_debug_mode``; the first one's
Python stack goes to stderr); ``te calls`` (the ``torch.ops.te.*`` ops that Inductor's generated
code of the step calls rather than tracing into: calls kept whole, ``docs/op_mechanism.md``; 0:
Inductor launches every kernel itself); ``model B/param`` (bytes of the module's parameters and
buffers per weight parameter) and ``train B/param`` (the same plus what the training state
adds: the bf16 rows' gradients, the FP8 rows' fp32 masters and ``main_grad``; an optimizer's
own state comes on top of both), tensor sizes; ``step MB`` (peak CUDA memory of a step above
what was allocated before it).

    python -m bench.diag.diag_primary                     # CUDA; a markdown table on stdout
    python -m bench.diag.diag_primary --modules mlp --recipes current
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

import te_compile
from bench import harness
from bench.bench_grouped import make_splits

DTYPE = torch.bfloat16
CASES = {
    # name: (experts, rows, hidden, out_or_ffn, empty experts)
    "linear": (8, 32768, 4096, 2048, 0),
    "mlp": (64, 32768, 4096, 1408, 3),
}
RECIPES = {
    "current": te_compile.recipe.Float8CurrentScaling,
    "delayed": te_compile.recipe.DelayedScaling,
}
LAYOUTS = ("bf16 weights", "FP8 weights", "FP8 weights, single")


def _build(case: str, layout: str, recipe) -> nn.Module:
    experts, _rows, hidden, width, _ = CASES[case]
    kw = {"params_dtype": DTYPE, "device": "cuda", "bias": False}
    single = layout.endswith("single")
    torch.manual_seed(0)
    with te_compile.quantized_model_init(enabled=layout != "bf16 weights", recipe=recipe):
        if case == "linear":
            return te_compile.GroupedLinear(
                experts, hidden, width, single_grouped_weight=single, **kw
            )
        return te_compile.GroupedMLP(experts, hidden, width, single_grouped_parameter=single, **kw)


def _weight_numel(module: nn.Module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if "weight" in n)


def _nbytes(tensors) -> int:
    """Bytes of the storages under ``tensors``, each storage once (views of one buffer, such as
    the experts' ``main_grad``, count as the buffer)."""
    storages = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _syncs(run, label: str) -> int:
    """Synchronising CUDA calls of one ``run()``; the first one's Python stack to stderr."""
    stacks = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            stacks.append(traceback.format_stack(limit=14)[:-1])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        warnings.showwarning = record
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if stacks:
        print(f"first synchronising call of {label}:", "".join(stacks[0]), file=sys.stderr)
    return len(stacks)


def _longest_host_calls(run, label: str, n: int = 2) -> None:
    """Where the host waits: ``n`` steps issued while the GPU sleeps, profiled; the host-side
    events (ops and CUDA runtime calls) with the longest single durations, to stderr."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(2_000_000_000)
        for _ in range(n):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.time_range.elapsed_us(), reverse=True)
    print(f"longest host events of {label} ({n} steps, GPU asleep ~1 s):", file=sys.stderr)
    for e in events[:14]:
        print(f"  {e.time_range.elapsed_us() / 1e3:9.3f} ms  {e.name[:90]}", file=sys.stderr)


def measure(
    case: str, layout: str, recipe_name: str, where_host_waits: bool = False
) -> dict[str, object]:
    from torch._inductor.utils import run_and_get_code
    from triton.testing import do_bench

    torch._dynamo.reset()
    experts, rows, hidden, width, n_zero = CASES[case]
    out_width = hidden if case == "mlp" else width
    splits = torch.tensor(make_splits(rows, experts, n_zero), device="cuda")
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    grad = torch.randn(rows, out_width, device="cuda", dtype=DTYPE)
    module = _build(case, layout, RECIPES[recipe_name]())
    masters = None if layout == "bf16 weights" else te_compile.FP8MasterWeights(module)
    call = torch.compile(module, fullgraph=True, dynamic=False)
    recipe = RECIPES[recipe_name]()
    params = list(module.parameters())

    def run():
        x.grad = None
        with te_compile.autocast(recipe=recipe):
            y = call(x, splits)
        y.backward(grad)

    _, codes = run_and_get_code(run)
    te_calls = sorted({c for code in codes for c in re.findall(r"torch\.ops\.te\.(\w+)", code)})
    for _ in range(3):
        run()
    model = _nbytes([*params, *module.buffers()])
    if masters is None:
        train = model + _nbytes(p.grad for p in params)
    else:
        main_grads = [getattr(p, "main_grad", None) for p in params]
        train = model + _nbytes(masters.parameters()) + _nbytes(main_grads)
    for p in params:
        p.grad = None
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    step_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    syncs = _syncs(run, f"{case} {recipe_name} {layout}")
    host = harness.host_ms(run, torch.device("cuda"))
    if where_host_waits:
        _longest_host_calls(run, f"{case} {recipe_name} {layout}")
    grads = [p for p in params if p.dtype != torch.float8_e4m3fn]
    median = do_bench(run, warmup=100, rep=1000, return_mode="median", grad_to_none=grads)
    numel = _weight_numel(module)
    del masters
    return {
        "median ms": f"{median:.3f}",
        "host ms": f"{host:.3f}",
        "syncs": str(syncs),
        "te calls": ", ".join(te_calls) or "0",
        "model B/param": f"{model / numel:.3f}",
        "train B/param": f"{train / numel:.3f}",
        "step MB": f"{step_mb:.0f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modules", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument(
        "--where-host-waits",
        action="store_true",
        help="also profile the issue of 8 steps and list the longest host events (stderr)",
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}")
    columns = None
    for case in args.modules:
        experts, rows, hidden, width, n_zero = CASES[case]
        print(f"\n### {case}: {experts} experts ({n_zero} empty), {rows} rows, {hidden}, {width}")
        for recipe_name in args.recipes:
            for layout in args.layouts:
                try:
                    result = measure(case, layout, recipe_name, args.where_host_waits)
                except Exception as exc:  # a row that fails is reported, the others still run
                    result = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:160]}
                if columns is None and "error" not in result:
                    columns = list(result)
                    print("\n| recipe | weights | " + " | ".join(columns) + " |")
                    print("| --- | --- |" + " ---: |" * len(columns))
                cells = [str(result.get(c, "")) for c in columns or []]
                if "error" in result:
                    cells = [result["error"]]
                print(f"| {recipe_name} | {layout} | " + " | ".join(cells) + " |", flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
