"""Where an eager module call's host time goes, without a profiler: wall time per piece.

``diag_eager_host`` profiles a call (cProfile, torch.profiler), which slows the host and can
hide a cost that depends on timing (the host waiting for the device, an allocator or a launch
queue): te.Linear's eager DelayedScaling step costs 340-700 us more host time than current
scaling on the H200, and neither profiler shows where. This wraps named functions with
``time.perf_counter`` timers (nothing else runs between calls), times many fwd+bwd calls, and
prints each piece's wall time per call as quantiles, so that a piece whose cost is bimodal or
waits shows at p90 where its median does not.

A piece is ``module:name``: the function ``name`` as ``module`` calls it (its global), wrapped
there. The default pieces follow te.Linear's forward: the module's call into
``quantization.gemm.linear``, its ``gemm_args`` and ``delayed_scales``, the family function
``functional.linear`` and ``_outputs`` (the amaxes recorded); ``forward`` and ``backward`` are
the whole directions.

    python -m bench.diag.diag_eager_pieces                          # te.Linear, CUDA
    python -m bench.diag.diag_eager_pieces --recipes current delayed --calls 400
    python -m bench.diag.diag_eager_pieces --device cpu --features 64 --tokens 16
    python -m bench.diag.diag_eager_pieces --pieces te_compile.functional.linear_ops:_linear
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import te_compile as te
from te_compile.quantization import recipe as R

RECIPES = {"bf16": None, "current": R.Float8CurrentScaling, "delayed": R.DelayedScaling}
PIECES = (
    "te_compile.modules.linear:_gemm",  # (a module: its ``linear`` is what te.Linear calls)
    "te_compile.quantization.gemm:gemm_args",
    "te_compile.quantization.gemm:delayed_scales",
    "te_compile.quantization.gemm:F",  # (a package: its ``linear``)
    "te_compile.quantization.gemm:_outputs",
)


def _timed(fn, times: list[float]):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t0)

    return wrapper


class _Proxy:
    """A module seen through one timed function, ``attr``; every other name passes through."""

    def __init__(self, target, attr: str, times: list[float]) -> None:
        self._target, self._attr = target, attr
        self._fn = _timed(getattr(target, attr), times)

    def __getattr__(self, name: str):
        return self._fn if name == self._attr else getattr(self._target, name)


@contextlib.contextmanager
def timed_pieces(pieces: list[str], times: dict[str, list[float]]):
    """Wrap each piece (``module:name``) for the duration; a name bound to a module (``_gemm``)
    or a package (``F``) wraps its ``linear``."""
    undo = []
    try:
        for piece in pieces:
            where, name = piece.split(":")
            module = importlib.import_module(where)
            original = getattr(module, name)
            times[piece] = []
            if isinstance(original, type(sys)):
                setattr(module, name, _Proxy(original, "linear", times[piece]))
            else:
                setattr(module, name, _timed(original, times[piece]))
            undo.append((module, name, original))
        yield
    finally:
        for module, name, original in reversed(undo):
            setattr(module, name, original)


def quantiles(values: list[float], calls: int) -> str:
    """Calls of the piece per fwd+bwd call, then its wall us per call as quantiles."""
    us = sorted(v * 1e6 for v in values)
    if not us:
        return "not called"
    at = lambda q: us[min(len(us) - 1, int(q * len(us)))]  # noqa: E731
    return (
        f"{len(us) / calls:4.1f}x  p10 {at(0.1):8.1f}  p50 {statistics.median(us):8.1f}  "
        f"p90 {at(0.9):8.1f}  max {us[-1]:8.1f}"
    )


def run(module, x, recipe, pieces: list[str], calls: int, sync) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"forward": [], "backward": []}
    for _ in range(30):  # warm-up, outside the timers (the first delayed step calibrates)
        with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            y = module(x)
        y.sum().backward()
    sync()
    with timed_pieces(pieces, times):
        for _ in range(calls):
            t0 = time.perf_counter()
            with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
                y = module(x)
            t1 = time.perf_counter()
            y.sum().backward()
            t2 = time.perf_counter()
            times["forward"].append(t1 - t0)
            times["backward"].append(t2 - t1)
        sync()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=list(RECIPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=300, help="timed fwd+bwd calls per recipe")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--pieces", nargs="+", default=list(PIECES), help="module:name each")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("diag_eager_pieces: no CUDA device (--device cpu times the CPU path)")
    torch.manual_seed(0)
    torch.autograd.set_multithreading_enabled(False)  # the backward on this thread, timed
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    n, t = args.features, args.tokens
    x = torch.randn(t, n, dtype=torch.bfloat16, device=args.device, requires_grad=True)
    print(f"te.Linear({n}, {n}), bf16 input {t} x {n}, {args.device}; wall us per call")
    for name in args.recipes:
        module = te.Linear(n, n, params_dtype=torch.bfloat16, device=args.device)
        recipe = RECIPES[name]() if RECIPES[name] is not None else None
        times = run(module, x, recipe, args.pieces, args.calls, sync)
        print(f"=== {name}")
        for piece, values in times.items():
            print(f"  {piece:48s} {quantiles(values, args.calls)}")


if __name__ == "__main__":
    main()
