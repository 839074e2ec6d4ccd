"""Where a compiled ``bench_block`` step's host time goes, per precision (CUDA).

``bench_block``'s compiled rows can be host-bound at h1024 (delayed scaling slower than bf16 in
some processes while its CUDA-graph row is 1.27x faster): this separates, per row, in one
process,

* ``steady ms``: wall time per step over 20 back-to-back steps, one sync at the end;
* ``host ms``: the host's time to issue one step while the GPU sleeps (median of 5);
* ``syncs``: host-device synchronisations per step (profiler events ``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaMemcpy`` / ``cudaMemcpyAsync`` device to host waits);
* the host events with the most self CPU time over 3 profiled steps.

    python -m bench.diag.diag_compiled_host --size h1024 --precisions torch current delayed
    python -m bench.diag.diag_compiled_host --size h1024 --cpp-wrapper  # Inductor's C++ wrapper
    python -m bench.diag.diag_compiled_host --smoke --device cpu   # the script itself
    python -m bench.diag.diag_compiled_host --size h1024 --rounds 7  # rows timed in alternation
    python -m bench.diag.diag_compiled_host --precisions torch current current:triton --rounds 7
    python -m bench.diag.diag_compiled_host --precisions current --cprofile 20  # Python's view

The other rows' Triton kernels run on Inductor's static launcher (``import te_compile`` selects
it, ``te.set_static_launch``). A precision ending in ``:triton`` is compiled with Triton's own
launcher for our kernels (torch's default), so that an A/B of the launcher runs in one process
(compiled in this process: the compile workers would not see the option set here). Its
``--cprofile`` shows our launches in Triton's launcher (``triton/backends/nvidia/driver.py``),
the other rows' none.

``--cprofile N`` profiles N steps per row with ``cProfile`` while the GPU sleeps and prints
the functions with the most own time and the most cumulative time: which Python (Inductor's
wrapper, its launchers, AOTAutograd's runtime wrappers, dynamo's guards as time of the frame's
caller) the host spends a step in.

``--rounds N`` builds every row first and then times them in ``N`` rounds, the order rotated
each round, so that a slow stretch of the host reaches every row: each row's speed against the
first row (torch) is taken within a round, and the table gives the median over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench import bench_block as bb

_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
          "cudaEventSynchronize", "aten::_local_scalar_dense", "aten::item")  # fmt: skip


def _build(precision: str, size: bb.Size, weights, x, grad, device, cpp: bool):
    """``(row name, step)``: the row's compiled stack, one fwd+bwd per ``step()``, warmed up."""
    precision, triton = precision.removesuffix(":triton"), precision.endswith(":triton")
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import CompiledTritonKernels
    from torch._inductor.codecache import PyCodeCache

    inductor_config.static_launch_user_defined_triton_kernels = not triton
    # A kernel's launcher is chosen when it is compiled: a row whose code or kernels another row
    # already compiled in this process reuses them, launchers included (PyCodeCache's modules,
    # CompiledTritonKernels' kernels), and the on-disk caches would serve them too.
    PyCodeCache.cache_clear(purge=False)
    CompiledTritonKernels.cache_clear()
    inductor_config.force_disable_caches = triton
    # Inductor's compile workers decide a kernel's launcher with their own copy of the config,
    # which never sees the option set here: a :triton row compiles in this process.
    threads = inductor_config.compile_threads
    if triton:
        inductor_config.compile_threads = 1
    spec = bb.RowSpec("torch" if precision == "torch" else "te", "bf16" if precision == "torch"
                      else precision, "compiled")  # fmt: skip
    model = bb.build_model(spec, size, weights, device)
    params = list(model.parameters())
    if cpp:  # Inductor's C++ wrapper: the graph's launches issued from C++, not Python
        compiled = torch.compile(model, dynamic=False, options={"cpp_wrapper": True})
        recipe = bb.TE_RECIPES[precision]() if precision in bb.TE_RECIPES else None

        def call(x: torch.Tensor) -> torch.Tensor:
            with bb.te.autocast(enabled=recipe is not None, recipe=recipe):
                return compiled(x)

    else:
        call = bb.make_call(spec, model, x)

    def step() -> None:
        bb.clear_grads(params, x)
        bb.forward_backward(call, x, grad, False)

    for _ in range(4):
        step()
    _sync(device)
    inductor_config.static_launch_user_defined_triton_kernels = True
    inductor_config.force_disable_caches = False
    inductor_config.compile_threads = threads
    return spec.name + (" (cpp_wrapper)" if cpp else "") + (
        " (Triton's launcher)" if triton else ""
    ), step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steady(step, device: torch.device, steps: int = 20) -> float:
    """ms per step over ``steps`` back-to-back steps, one sync at the end."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / steps * 1e3


def _host(step, device: torch.device, trials: int = 5) -> float:
    """Median ms to issue one step while the GPU sleeps."""
    hosts = []
    for _ in range(trials):
        if device.type == "cuda":
            torch.cuda._sleep(2_000_000_000)
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
        _sync(device)
    return statistics.median(hosts)


def _row(name: str, step, device, top: int) -> None:
    steady, host = _steady(step, device), _host(step, device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        _sync(device)
    syncs: dict[str, int] = {}
    for e in prof.events():
        if e.name in _SYNCS:
            syncs[e.name] = syncs.get(e.name, 0) + 1
    print(f"### {name}: steady {steady:.2f} ms/step, host {host:.2f} ms, syncs per step "
          f"{ {k: v / 3 for k, v in sorted(syncs.items())} }", flush=True)  # fmt: skip
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)


def _cprofile(name: str, step, device, steps: int, top: int) -> None:
    """``cProfile`` over ``steps`` steps issued while the GPU sleeps: the host's Python alone."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(steps):  # one step per sleep: more launches would fill the launch queue
        if device.type == "cuda":
            torch.cuda._sleep(2_000_000_000)
        prof.enable()
        step()
        prof.disable()
        _sync(device)
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        print(f"### {name}: cProfile of {steps} steps, by {key}\n{out.getvalue()}", flush=True)


def _rounds(rows: list, device, rounds: int) -> None:
    """Every row timed once per round, the rows' order rotated each round, so that a drift of
    the host's speed reaches every row alike; per row the median over the rounds of its steady
    ms, its host ms and its speed against the first row measured in the same round."""
    steady: dict[str, list[float]] = {name: [] for name, _ in rows}
    host: dict[str, list[float]] = {name: [] for name, _ in rows}
    speed: dict[str, list[float]] = {name: [] for name, _ in rows}
    for r in range(rounds):
        order = rows[r % len(rows) :] + rows[: r % len(rows)]
        for name, step in order:
            steady[name].append(_steady(step, device))
            host[name].append(_host(step, device, trials=3))
        base = steady[rows[0][0]][-1]
        for name, _ in rows:
            speed[name].append(base / steady[name][-1])
    print(f"| row ({rounds} rounds) | steady ms: median (min-max) | host ms | speed vs "
          f"{rows[0][0]}: median (min-max) |\n| --- | ---: | ---: | ---: |")  # fmt: skip
    med = statistics.median
    for name, _ in rows:
        st, sp = steady[name], speed[name]
        print(f"| {name} | {med(st):.2f} ({min(st):.2f}-{max(st):.2f}) | {med(host[name]):.2f} "
              f"| {med(sp):.3f}x ({min(sp):.3f}-{max(sp):.3f}) |", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="h1024", choices=list(bb.SIZES))
    p.add_argument("--precisions", nargs="+", default=["torch", "current", "delayed"])
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--smoke", action="store_true", help="bench_block's tiny size (any device)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cpp-wrapper", action="store_true", help="compile with cpp_wrapper=True")
    p.add_argument("--rounds", type=int, default=0,
                   help="build every row, then time them in this many alternating rounds "
                        "(speeds against the first row of each round; no profile)")  # fmt: skip
    p.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                   help="after the rounds (or instead of the profile), cProfile this many steps "
                        "per row")  # fmt: skip
    args = p.parse_args()
    bb.raise_recompile_limits()
    device = torch.device(args.device)
    size = bb.SMOKE_SIZES["block"] if args.smoke else bb.SIZES[args.size]
    weights = bb.make_weights(size, device)
    torch.manual_seed(0)
    shape = (size.batch, size.seq, size.hidden)
    x = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    cpp = args.cpp_wrapper
    if args.rounds:  # every row built first, then timed in alternation
        rows = [_build(p, size, weights, x, grad, device, cpp) for p in args.precisions]
        _rounds(rows, device, args.rounds)
        for name, step in rows if args.cprofile else ():
            _cprofile(name, step, device, args.cprofile, args.top)
        return
    for precision in args.precisions:
        name, step = _build(precision, size, weights, x, grad, device, cpp)
        if args.cprofile:
            _cprofile(name, step, device, args.cprofile, args.top)
        else:
            _row(name, step, device, args.top)
        bb.reset_between_rows(device)


if __name__ == "__main__":
    main()
