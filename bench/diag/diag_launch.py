"""Host time of one eager Triton launch: ``kernels.EagerLauncher``'s direct launch of the
compiled kernel against Triton's own ``kernel[grid]`` path, on the per-tensor FP8 cast of a
small bf16 tensor (``kernels.quantize.quantize_current``: a zero-fill, the amax kernel and the
cast kernel, four allocations) and the RMSNorm forward kernel, and on a te.Linear fwd+bwd under
Float8CurrentScaling (six Triton launches per call), with the GPU idle (small shapes).

First the host's cost model: us per call of an allocation, an aten launch, a GEMM, a Triton
launch, with the GPU idle. Then where one launch's host time goes (:func:`launch_parts`), for
kernels of few and of many arguments: the launcher's key, the arguments bound in the kernel's
order, Triton's C launcher, and the whole launch.

    python -m bench.diag.diag_launch [--calls 2000]
    python -m bench.diag.diag_launch --parts-only    # the launch parts alone
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
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    trials = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
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


def _captured_launches(calls: dict) -> list[tuple]:
    """``(launcher, grid, args, kwargs)`` of every eager launch the callables make (each called
    twice: the second call launches directly), one per kernel."""
    seen, original = {}, EagerLauncher.__call__

    def capture(self, grid, *args, **kwargs):
        seen[self.kernel] = (self, grid, args, kwargs)
        return original(self, grid, *args, **kwargs)

    EagerLauncher.__call__ = capture
    try:
        for fn in calls.values():
            fn()
            fn()
    finally:
        EagerLauncher.__call__ = original
    return list(seen.values())


def launch_parts(calls: int, device: str = "cuda") -> None:
    """Host us of one eager launch's parts, per kernel (its argument count beside it): the
    launcher's key (``EagerLauncher._key``), the arguments bound in the kernel's order
    (``_bound``), Triton's C launcher on them (``direct_run``'s ``fire``), and the whole launch
    (``EagerLauncher.__call__``)."""
    from te_compile.kernels import fp8_scaling

    f32 = {"device": device, "dtype": torch.float32}
    hist, scale, amax = torch.zeros(1024, 3, **f32), torch.ones(3, **f32), torch.zeros(3, **f32)
    copy = torch.empty(12, **f32)[::4]
    x = torch.randn(128, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    bits = torch.zeros(2, **f32)
    cases = {
        "delayed update": lambda: fp8_scaling.delayed_scaling_update(
            [(hist, scale, amax, None)], copy, (448.0, 57344.0, 2), 0, True
        ),
        "paired cast": lambda: Q.quantize_pair(
            (x, w), torch.float8_e4m3fn, (True, True), bits, (0, 1)
        ),
        "rmsnorm_fwd": lambda: torch.ops.te.rmsnorm_fwd(x, w[0], 1e-5, False),
    }
    print("| kernel | arguments | key (us) | bind (us) | C launcher (us) | whole launch (us) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for launcher, grid, args, kwargs in _captured_launches(cases):
        name = getattr(launcher.kernel, "__name__", None) or launcher.kernel.fn.__name__
        n, parts = _parts(launcher, grid, args, kwargs, calls)
        print(f"| `{name}` | {n} | " + " | ".join(f"{v:.1f}" for v in parts) + " |")


def _parts(launcher, grid, args, kwargs, calls: int) -> tuple[int, list[float]]:
    """:func:`launch_parts`' row of one captured launch: its argument count and the four
    timings (the C launcher's NaN where the launch is not direct: Triton's interpreter)."""
    key = launcher._key(grid, args, kwargs)
    bound = launcher._bound(args, kwargs)
    known = launcher.compiled.get(key) if key is not None else None
    fire, grid3 = (known[1] if known is not None else None), (*grid, 1, 1)[:3]
    return len(bound), [
        _host_us(lambda: launcher._key(grid, args, kwargs), calls),
        _host_us(lambda: launcher._bound(args, kwargs), calls),
        _host_us(lambda: fire(grid3, key[0], bound), calls) if fire else float("nan"),
        _host_us(lambda: launcher(grid, *args, **kwargs), calls),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--parts-only", action="store_true", help="only the launch parts")
    args = parser.parse_args()
    if args.parts_only:
        launch_parts(args.calls)
        return
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
    launch_parts(args.calls)


if __name__ == "__main__":
    main()
