"""Why te.Linear's eager fwd+bwd costs more host time under DelayedScaling than under current
scaling: host us per call of the whole step, of the forward with and without an autograd graph,
of the autocast region alone and of the delayed update op alone; then torch.profiler's CPU ops.

    python host_delayed_linear.py [cuda|cpu]
"""

import functools
import gc
import statistics
import sys
import time

import torch

import te_compile as te
from te_compile.functional import fp8_scaling
from te_compile.quantization import recipe as R

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, n=100, trials=15):
    for _ in range(20):
        fn()
    sync()
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out), min(out), max(out)


def report(name, r):
    print(f"{name:60s} median {r[0]:8.1f} us  min {r[1]:8.1f}  max {r[2]:8.1f}", flush=True)


def step(m, x, rec):
    with te.autocast(recipe=rec):
        y = m(x)
    y.sum().backward()


def fwd(m, x, rec, grad=True):
    with torch.set_grad_enabled(grad), te.autocast(recipe=rec):
        return m(x)


def region(rec):
    with te.autocast(recipe=rec):
        pass


def update_args(m, rec):
    meta, fmt = m.fp8_meta, rec.fp8_format
    limits = [fmt.max_fwd, fmt.max_fwd, fmt.max_bwd]
    hist = meta.amax_history[: rec.amax_history_len]
    return hist, meta.scale, meta.fwd_amax, limits, meta.grad_amax


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    for name, rec in (("current", R.Float8CurrentScaling()), ("delayed", R.DelayedScaling())):
        m = te.Linear(256, 256, params_dtype=torch.bfloat16, device=DEV)
        report(f"{name}: fwd+bwd", timed(functools.partial(step, m, x, rec)))
        gc.disable()
        report(f"{name}: fwd+bwd, gc disabled", timed(functools.partial(step, m, x, rec)))
        gc.enable()
        report(f"{name}: fwd (graph built, freed)", timed(functools.partial(fwd, m, x, rec)))
        report(f"{name}: fwd under no_grad", timed(functools.partial(fwd, m, x, rec, False)))
        report(f"{name}: autocast enter/exit alone", timed(functools.partial(region, rec)))
        if name == "delayed":
            hist, scale, amax, limits, tail = update_args(m, rec)
            algo = rec.amax_compute_algo
            op = functools.partial(fp8_scaling.delayed_scaling_update_op, hist, scale, amax,
                                   limits, rec.margin, algo, tail)  # fmt: skip
            report("delayed_scaling_update_op alone (op dispatch)", timed(op))
            impl = functools.partial(fp8_scaling._update, [(hist, scale, amax, tail)], limits,
                                     rec.margin, algo)  # fmt: skip
            report("its implementation without the dispatcher", timed(impl))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                step(m, x, rec)
            sync()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
