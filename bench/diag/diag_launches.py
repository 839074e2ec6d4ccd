"""Kernel launches per layer of a compiled training step, counted without a GPU.

How many launches does one ``bench_block`` layer (``te.LayerNormLinear`` qkv, ``te.Linear``
proj, ``te.LayerNormMLP``; causal SDPA) cost under each recipe, and which? Counted in the code
Inductor generates for the forward and the backward graph of ``torch.compile`` (one Triton
kernel, user or Inductor's, or one extern call per launch), with te's CUDA code paths traced on
CPU tensors:

* a copy of ``te_compile`` in a temporary directory, where every ``device.type == "cuda"`` /
  ``is_cuda`` check also accepts the CPU and every op runs its CUDA implementation (the Triton
  kernels, ``torch._scaled_mm``), imported by a child process;
* Inductor's Triton backend for the CPU (``cpu_backend="triton"``), which schedules and fuses
  as for a GPU, generating code for an sm_90 target that is not compiled or run;
* delayed scaling's states marked calibrated, so that the graph is the delayed step's (the
  second step of training).

The "op calls" column counts the other dispatcher calls the generated code makes on every step:
aten ops issued inline (``aten.view.dtype(buf, ...)`` as a kernel argument, for one), each a
few microseconds of host time with no kernel behind it.

Inductor's CUDA heuristics can differ in detail (a fusion more or less); the differences
between recipes are what this is for. The H200 count of record is ``bench_block``'s
"kernels/layer" (issue 41: 39 bf16, 84 current, 103 delayed before the delayed-scaling
launches were cut).

    python -m bench.diag.diag_launches                      # bf16, current, delayed
    python -m bench.diag.diag_launches --recipes delayed --list
    python -m bench.diag.diag_launches --model grouped_mlp  # te.GroupedMLP, 4 experts
    python -m bench.diag.diag_launches --dump /tmp/code     # each recipe's generated code
    python -m bench.diag.diag_launches --compile-times      # each kernel's Triton compile

``--model grouped_mlp`` counts a ``te.GroupedMLP`` step instead (4 experts, hidden 64, ffn 128,
SwiGLU, 64 tokens split ``[40, 0, 24, 0]`` by a device tensor) and lists the ``te`` ops
Inductor's code still calls (those kept whole).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("bf16", "current", "delayed")
# Device checks of te_compile that choose the CUDA code path: made true for CPU tensors.
_PATCHES = (
    (r'device\.type == "cuda"', 'device.type in ("cuda", "cpu")'),
    (r'device\.type != "cuda"', 'device.type not in ("cuda", "cpu")'),
    (r"\.is_cuda\b", ".is_cpu"),
    (r"pin_memory=(\w+)\.is_cpu", "pin_memory=False"),  # (no pinned memory without CUDA)
    (r"self\._impls\.get\(t\.device\.type,", 'self._impls.get("cuda",'),
    (r"per_sm \* torch\.cuda\.get_device_properties\(device\)\.multi_processor_count",
     "per_sm * 132"),
)  # fmt: skip
# A user or Inductor Triton kernel's ``.run(``, or an extern call (cuBLAS, SDPA, ...).
_LAUNCH = re.compile(r"(\w+)\.run\(|(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.[\w.]+)\(")
_INLINE_OP = re.compile(r"(?<![\w.])aten\.\w+\.\w+\(")  # an aten op issued inline, not a launch
_LOG_PREFIX = re.compile(r"^V\d+ [\d:.]+ \d+ \S+\] \[[^\]]*\] \[__output_code\] ?", re.M)


def _patched_copy(dest: Path) -> None:
    shutil.copytree(ROOT / "te_compile", dest / "te_compile")
    for path in (dest / "te_compile").rglob("*.py"):
        text = path.read_text()
        for pattern, repl in _PATCHES:
            text = re.sub(pattern, repl, text)
        path.write_text(text)


def launches(code: str) -> list[list[str]]:
    """The launches of each ``call`` of Inductor's generated modules in ``code``, in order."""
    calls = re.findall(r"    def call\(self, args\):\n(.*?)\n        return ", code, flags=re.S)
    out = []
    for body in calls:
        names = []
        for line in body.splitlines():
            m = _LAUNCH.match(line.strip())
            if m:
                names.append(m.group(1) or m.group(2))
        out.append(names)
    return out


def _grouped_mlp(te, torch):
    """``(module, input, extra args)`` of the ``grouped_mlp`` model."""
    m = te.GroupedMLP(4, 64, 128, activation="swiglu", params_dtype=torch.bfloat16, device="cpu")
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    return m, x, (torch.tensor([40, 0, 24, 0]),)


def sm90_compiler(compile_kernels: bool = False) -> None:
    """Make this process's ``torch.compile`` generate Inductor's CUDA code for CPU tensors (the
    module docstring's second point): Triton's active driver says sm_90, Inductor's CPU backend
    is Triton, the backward graph compiles with the forward's, and no kernel is compiled unless
    ``compile_kernels``. The generated code cannot run: a step stops there."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime import triton_heuristics
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):  # (--compile-times: what Inductor's compile asks)
            return 0

        launcher_cls = staticmethod(lambda src, metadata: None)

    driver.set_active(_Sm90())  # wrap_triton analyses the kernels for this target
    inductor_config.cpu_backend = "triton"
    functorch_config.force_non_lazy_backward_lowering = True  # both graphs, before any run
    if not compile_kernels:
        triton_heuristics.CachingAutotuner.precompile = lambda self, *a, **k: None


def _child(recipe: str, model: str, compile_times: bool = False) -> None:
    import torch

    import te_compile as te
    from bench.bench_block import SMOKE_SIZES, TeLayer

    sm90_compiler(compile_kernels=compile_times)
    if compile_times:
        times = _timed_compiles()
    torch.manual_seed(0)
    size = SMOKE_SIZES["block"]
    if model == "grouped_mlp":
        layer, x, extra = _grouped_mlp(te, torch)
    else:
        layer, extra = TeLayer(size, torch.device("cpu")), ()
        x = torch.randn(size.input_shape, dtype=torch.bfloat16, requires_grad=True)
    for m in layer.modules():
        if hasattr(m, "calibrated"):
            m.calibrated = True
    factory = {"current": te.recipe.Float8CurrentScaling, "delayed": te.recipe.DelayedScaling}
    rec = factory[recipe]() if recipe in factory else None

    def step(x):
        with te.autocast(enabled=rec is not None, recipe=rec):
            return layer(x, *extra)

    try:
        torch.compile(step, fullgraph=True)(x)
    except Exception as e:  # the generated code cannot run here: its text is what counts
        print(f"(stopped at running the code: {type(e).__name__})", file=sys.stderr)
    if compile_times:
        total: dict[str, list[float]] = {}
        for name, s in times:
            total.setdefault(name, []).append(s)
        print(f"{recipe}: {len(times)} Triton compiles, {sum(s for _, s in times):.1f} s")
        for name, ss in sorted(total.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {sum(ss):6.2f} s  {len(ss):3d}x  {name}")


def _timed_compiles() -> list[tuple[str, float]]:
    """Triton's compile of every kernel (Inductor's and te's) for sm_90 with the wheel's ptxas,
    each timed, serially (one compile thread); the compiled kernels are never loaded."""
    import time

    import torch._inductor.config as inductor_config
    import triton
    import triton.compiler.compiler as triton_compiler
    from triton.backends.compiler import GPUTarget

    inductor_config.compile_threads = 1
    times: list[tuple[str, float]] = []
    compile_ = triton_compiler.compile

    def timed(src, target=None, options=None, **kwargs):  # (Inductor asks for the CPU target)
        t0 = time.perf_counter()
        try:
            return compile_(src, target=GPUTarget("cuda", 90, 32), options=options, **kwargs)
        finally:
            name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")
            times.append((name, time.perf_counter() - t0))

    triton_compiler.compile = triton.compile = timed
    triton_compiler.CompiledKernel._init_handles = lambda self: None  # no GPU to load onto
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--list", action="store_true", help="every launch, by kernel name")
    parser.add_argument("--model", choices=("layer", "grouped_mlp"), default="layer")
    parser.add_argument("--dump", type=Path, help="write each recipe's generated code here")
    parser.add_argument(
        "--compile-times", action="store_true",
        help="Triton's compile of each kernel instead (sm_90, serial): the first step's share",
    )  # fmt: skip
    parser.add_argument("--child", choices=RECIPES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.model, args.compile_times)
        return
    with tempfile.TemporaryDirectory() as tmp:
        _patched_copy(Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(ROOT)]),
               "TRITON_INTERPRET": "0"}  # fmt: skip
        child = [sys.executable, "-m", "bench.diag.diag_launches", "--model", args.model]
        if args.compile_times:  # empty caches: every kernel compiled here
            env.update(TRITON_CACHE_DIR=str(Path(tmp) / "triton"),
                       TORCHINDUCTOR_CACHE_DIR=str(Path(tmp) / "inductor"))  # fmt: skip
            for recipe in args.recipes:
                subprocess.run([*child, "--child", recipe, "--compile-times"], cwd=tmp, env=env,
                               check=False)  # fmt: skip
            return
        env["TORCH_LOGS"] = "output_code"
        print("| recipe | forward | backward | per layer | op calls |")
        print("| --- | ---: | ---: | ---: | ---: |")
        listing = []
        for recipe in args.recipes:
            run = subprocess.run([*child, "--child", recipe], cwd=tmp, env=env,
                                 capture_output=True, text=True, check=False)  # fmt: skip
            code = _LOG_PREFIX.sub("", run.stderr)
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{recipe}.py").write_text(code)
            graphs = launches(code)
            if len(graphs) != 2:
                sys.exit(
                    f"{recipe}: expected a forward and a backward graph:\n{run.stderr[-3000:]}"
                )
            fwd, bwd = map(len, graphs)
            bodies = re.findall(r"    def call\(self, args\):\n(.*?)\n        return ", code, re.S)
            ops = sum(len(_INLINE_OP.findall(body)) for body in bodies)
            print(f"| {recipe} | {fwd} | {bwd} | {fwd + bwd} | {ops} |")
            te_calls = sorted({k for g in graphs for k in g if k.startswith("torch.ops.te.")})
            if te_calls:
                listing.append(f"\n{recipe}: te ops kept whole: {', '.join(te_calls)}")
            for name, graph in zip(("forward", "backward"), graphs, strict=True):
                listing.append(f"\n{recipe}, {name}:" + "".join(f"\n    {k}" for k in graph))
        if args.list:
            print("\n".join(listing))


if __name__ == "__main__":
    main()
