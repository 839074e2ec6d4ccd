"""Diagnostics for the norm kernels on a GPU (not a benchmark of record): a sweep of the
backward's launch parameters, and the host-side cost per call of the eager and compiled paths.

    python -m bench.diag.tune_norm            # prints tables; GPU only
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import te_compile
from te_compile.kernels import norm as K


def sweep_bwd(kind: str, m: int, n: int) -> None:
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    w = torch.randn(n, device=dev, dtype=torch.bfloat16)
    if kind == "LayerNorm":
        _, mean, rs = K.layernorm_fwd(x, w, w, 1e-5, False)
    else:
        mean = None
        _, rs = K.rmsnorm_fwd(x, w, 1e-5, False)
    nbytes = 3 * m * n * 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = K.launch_config(n, True)
    rows = []
    for block_m, warps, per_sm in itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 4, 8)):
        block_n = default.block_n
        if block_m * block_n > 16384:
            continue
        cfg = K.NormLaunchConfig(block_m, block_n, warps, chunked=n > block_n)

        def fn(cfg=cfg, per_sm=per_sm):
            return K._norm_bwd(
                K.LAYERNORM.value if kind == "LayerNorm" else K.RMSNORM.value,
                dy,
                x,
                mean,
                rs,
                w,
                False,
                kind == "LayerNorm",
                config=cfg,
                programs=per_sm * sms,
            )

        try:
            ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as e:
            print(f"  {block_m} {warps} {per_sm}: {type(e).__name__}")
            continue
        rows.append((ms, block_m, warps, per_sm))
    rows.sort()
    print(f"### {kind} bwd {m}x{n}: default {default}")
    for ms, bm, wp, ps in rows[:6] + rows[-2:]:
        print(
            f"  block_m={bm} warps={wp} programs/SM={ps}: {ms * 1e3:.1f} us "
            f"{nbytes / ms / 1e6:.0f} GB/s"
        )


def host_overhead() -> None:
    """Per-call host time at a GPU-trivial shape: the loop never waits for the GPU, so the
    time per call is what the host spends issuing it."""
    dev = "cuda"
    x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    kw = {"fullgraph": True, "dynamic": False}
    te_fn = lambda x, w, b: te_compile.functional.layernorm(x, w, b, 1e-5)  # noqa: E731
    th_fn = lambda x, w, b: F.layer_norm(x, (1024,), w, b, 1e-5)  # noqa: E731
    cases = {
        "te eager": te_fn,
        "te compiled": torch.compile(te_fn, **kw),
        "torch eager": th_fn,
        "torch compiled": torch.compile(th_fn, **kw),
        "te op direct": lambda x, w, b: torch.ops.te.layernorm_fwd(x, w, b, 1e-5, False),
    }
    xa = torch.randn(256, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    sw = lambda x, w, b: te_compile.functional.swiglu(xa)  # noqa: E731
    cases["te swiglu eager"] = sw
    cases["te swiglu compiled"] = torch.compile(sw, **kw)
    for name, fn in cases.items():
        for _ in range(20):
            fn(x, w, b)
        torch.cuda.synchronize()
        n = 500
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x, w, b)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"  host fwd {name}: {(t1 - t0) / n * 1e6:.1f} us/call")
    # The compiled te call under the profiler: where the host time goes.
    from torch.profiler import ProfilerActivity, profile

    f = cases["te compiled"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            f(x, w, b)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    host_overhead()
    for kind, n in itertools.product(("LayerNorm", "RMSNorm"), (4096, 8192)):
        sweep_bwd(kind, 16384, n)
