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


def _row(precision: str, size: bb.Size, weights, x, grad, device, top: int, cpp: bool) -> None:
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

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(4):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    sync()
    steady = (time.perf_counter() - t0) / 20 * 1e3
    hosts = []
    for _ in range(5):
        if cuda:
            torch.cuda._sleep(2_000_000_000)
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
        sync()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        sync()
    syncs: dict[str, int] = {}
    for e in prof.events():
        if e.name in _SYNCS:
            syncs[e.name] = syncs.get(e.name, 0) + 1
    name = spec.name + (" (cpp_wrapper)" if cpp else "")
    print(f"### {name}: steady {steady:.2f} ms/step, host {statistics.median(hosts):.2f} ms "
          f"(min {min(hosts):.2f}), syncs per step "
          f"{ {k: v / 3 for k, v in sorted(syncs.items())} }", flush=True)  # fmt: skip
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)
    bb.reset_between_rows(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="h1024", choices=list(bb.SIZES))
    p.add_argument("--precisions", nargs="+", default=["torch", "current", "delayed"])
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--smoke", action="store_true", help="bench_block's tiny size (any device)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cpp-wrapper", action="store_true", help="compile with cpp_wrapper=True")
    args = p.parse_args()
    bb.raise_recompile_limits()
    device = torch.device(args.device)
    size = bb.SMOKE_SIZES["block"] if args.smoke else bb.SIZES[args.size]
    weights = bb.make_weights(size, device)
    torch.manual_seed(0)
    shape = (size.batch, size.seq, size.hidden)
    x = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)
    for precision in args.precisions:
        _row(precision, size, weights, x, grad, device, args.top, args.cpp_wrapper)


if __name__ == "__main__":
    main()
