"""Host time of one eager Triton launch: ``kernels.EagerLauncher``'s direct launch of the
compiled kernel against Triton's own ``kernel[grid]`` path, on the per-tensor FP8 cast of a
small bf16 tensor (``kernels.quantize.quantize_current``: a zero-fill, the amax kernel and the
cast kernel, four allocations) and the RMSNorm forward kernel, and on a te.Linear fwd+bwd under
Float8CurrentScaling (six Triton launches per call), with the GPU idle (small shapes).

First the host's cost model: us per call of an allocation, an aten launch, a GEMM, a Triton
launch, with the GPU idle.

    python -m bench.diag.diag_launch [--calls 2000]
"""

from __future__ import annotations

import argparse
import time

import torch

import te_compile as te
from te_compile.kernels import EagerLauncher
from te_compile.kernels import quantize as Q


def _host_us(fn, calls: int) -> float:
    """Median over 5 trials of the host time per call (synchronised at the end of a trial)."""
    fn()
    torch.cuda.synchronize()
    trials = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        trials.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(trials)[2]


def _through_triton(on: bool) -> None:
    for launcher in EagerLauncher._launchers.values():
        launcher.direct = not on
        launcher.compiled.clear()


def primitives(calls: int) -> None:
    """The host's cost model: us per call of the primitives an eager step is made of (one
    allocation, one aten kernel launch, one GEMM, one Triton launch through
    :class:`EagerLauncher`), so that a module's host time can be read as a count of them."""
    import triton
    import triton.language as tl

    from te_compile.kernels import launch

    @triton.jit
    def _touch(X, N: tl.constexpr):
        tl.store(X + tl.arange(0, N), tl.load(X + tl.arange(0, N)) + 1.0)

    a = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    small = torch.zeros(16, device="cuda")
    cases = {
        "python call of a no-op function": lambda: None,
        "torch.empty(256) (allocation, no launch)": lambda: torch.empty(256, device="cuda"),
        "t.view(-1) (no launch)": lambda: a.view(-1),
        "torch.zeros(2) (allocation + fill)": lambda: torch.zeros(2, device="cuda"),
        "t.add_(1) (one aten launch)": lambda: small.add_(1),
        "torch.mm 128x256x256 bf16": lambda: torch.mm(a, b),
        "torch._scaled_mm 128x256x256 e4m3": lambda: torch._scaled_mm(
            a8, b8, one, one, out_dtype=torch.bfloat16
        ),
        "Triton launch (kernels.launch, direct)": lambda: launch(_touch, (1,))(small, N=16),
    }
    print("| primitive | host us per call |")
    print("| --- | ---: |")
    for name, fn in cases.items():
        fn()
        print(f"| {name} | {_host_us(fn, calls):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    lin = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    xg = x.clone().requires_grad_()

    def linear_step():
        with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
            y = lin(xg)
        y.sum().backward()

    cases = {
        "quantize_current 128x256 (3 launches)": lambda: Q.quantize_current(
            x, torch.float8_e4m3fn, True
        ),
        "rmsnorm_fwd 128x256 (1 launch)": lambda: torch.ops.te.rmsnorm_fwd(x, w, 1e-5, False),
        "te.Linear fwd+bwd, Float8CurrentScaling": linear_step,
    }
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}")
    primitives(args.calls)
    print("| call | through Triton (us) | direct (us) | saved per call (us) |")
    print("| --- | ---: | ---: | ---: |")
    for name, fn in cases.items():
        fn()
        _through_triton(True)
        slow = _host_us(fn, args.calls)
        _through_triton(False)
        fast = _host_us(fn, args.calls)
        print(f"| {name} | {slow:.1f} | {fast:.1f} | {slow - fast:.1f} |")


if __name__ == "__main__":
    main()
