"""Where the host time of an eager norm goes, piece by piece (fwd+bwd, GPU idle, small shape).

``bench_overhead --only-modules`` showed te.LayerNormLinear costing far more host time than
te.Linear plus nn.LayerNorm's difference; this times the layers of the norm's eager path
apart, in one process: the module, the public function, the autograd-free kernel wrappers,
one kernel launch, and aten's own ``native_layer_norm`` pair beside them.

    python -m bench.diag.diag_norm_host              # CUDA
    python -m bench.diag.diag_norm_host --tokens 128 --features 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import te_compile as te
from te_compile import functional as F


def per_call(fn, calls: int, sync) -> float:
    """us per call: the fastest of 7 trials of ``calls`` back-to-back calls."""
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--calls", type=int, default=200)
    a = p.parse_args()
    dev, dt, n = torch.device(a.device), torch.bfloat16, a.features
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(a.tokens, n, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(a.tokens, n, device=dev, dtype=dt)
    w = torch.ones(n, device=dev, dtype=dt, requires_grad=True)
    b = torch.zeros(n, device=dev, dtype=dt, requires_grad=True)
    kn = __import__("te_compile.kernels.norm", fromlist=["x"]) if dev.type == "cuda" else None

    def chain(mod):
        y = x
        for _ in range(4):
            y = mod(y)
        return y

    def fb(fn):
        def step():
            y = fn()
            y.backward(g)

        return step

    nn_ln = torch.nn.LayerNorm(n, device=dev, dtype=dt)
    te_ln = te.LayerNorm(n, device=dev, params_dtype=dt)
    nn_lin = torch.nn.Linear(n, n, device=dev, dtype=dt)
    te_lin = te.Linear(n, n, device=dev, params_dtype=dt)
    te_lnlin = te.LayerNormLinear(n, n, device=dev, params_dtype=dt)
    nn_lnlin = torch.nn.Sequential(nn_ln, nn_lin)
    xd = x.detach()
    rows = {
        "nn.LayerNorm module": fb(lambda: nn_ln(x)),
        "te.LayerNorm module": fb(lambda: te_ln(x)),
        "te.functional.layernorm": fb(lambda: F.layernorm(x, w, b)),
        "torch.ops.te.layernorm_fwd (no grad)": lambda: torch.ops.te.layernorm_fwd(
            xd, w.detach(), b.detach(), 1e-5, False
        ),
        "aten native_layer_norm fwd+bwd (no autograd)": lambda: (
            torch.ops.aten.native_layer_norm_backward(
                g,
                xd,
                [n],
                *torch.ops.aten.native_layer_norm(xd, [n], w.detach(), b.detach(), 1e-5)[1:],
                w.detach(),
                b.detach(),
                [True, True, True],
            )
        ),
        "nn.Linear": fb(lambda: nn_lin(x)),
        "te.Linear": fb(lambda: te_lin(x)),
        "nn.LayerNorm + nn.Linear": fb(lambda: nn_lnlin(x)),
        "te.LayerNormLinear": fb(lambda: te_lnlin(x)),
        "x.sum() fwd+bwd (autograd floor)": lambda: x.sum().backward(),
        "4 x nn.LayerNorm chained": fb(lambda: chain(nn_ln)),
        "4 x te.LayerNorm chained": fb(lambda: chain(te_ln)),
    }
    if kn is not None:
        wd, bd = w.detach(), b.detach()

        def kernels():
            _, mean, rs = kn.layernorm_fwd(xd, wd, bd, 1e-5, False)
            kn.layernorm_bwd(g, xd, mean, rs, wd, False, True)

        out = torch.empty_like(xd)
        mean = torch.empty(a.tokens, device=dev)
        rs = torch.empty(a.tokens, device=dev)

        def one_launch():
            kn.launch(kn._norm_fwd_kernel, (a.tokens // 4,))(
                xd, wd, bd, out, mean, rs, rs, 0, a.tokens, n, 1e-5,
                KIND=kn.LAYERNORM.value, HAS_BIAS=True, ZERO_CENTERED_GAMMA=False, BLOCK_M=4,
                BLOCK_N=n, CHUNKED=False, STORE_Y=True, AMAX=False, ROUND=0, SOFTWARE=False,
                num_warps=4,
            )  # fmt: skip

        rows["kernels.norm fwd+bwd wrappers (no autograd)"] = kernels
        rows["one norm kernel launch (EagerLauncher)"] = one_launch
        rows["torch.empty x1"] = lambda: torch.empty(a.tokens, device=dev)
    for multithreaded in (True, False):
        torch.autograd.set_multithreading_enabled(multithreaded)
        print(f"\n## autograd multithreading {multithreaded}\n")
        print("| piece | us per call |\n| --- | ---: |")
        for name, fn in rows.items():
            print(f"| {name} | {per_call(fn, a.calls, sync):.1f} |", flush=True)
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
