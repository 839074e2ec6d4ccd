"""Where an eager module call's host time goes: cProfile of fwd+bwd calls per recipe.

``bench_overhead --only-modules`` gives the host us per call of each module; this says which
Python functions and torch calls make it up (own time and cumulative time), for one module at
a small shape, so that the GPU stays idle and only the host shows.

    python -m bench.diag.diag_eager_host                       # te.Linear, CUDA
    python -m bench.diag.diag_eager_host --module LayerNormLinear --recipes bf16 current
    python -m bench.diag.diag_eager_host --device cpu          # the CPU path (other code)
    python -m bench.diag.diag_eager_host --device cpu --tokens 8 --features 64 --top 40
    python -m bench.diag.diag_eager_host --device cpu --tokens 8 --features 64 --top 0 \\
        --timer process --threads 1 --plain --recipes bf16 current delayed  # timings, nn's
    python -m bench.diag.diag_eager_host --plain --top 0 --autograd-on-caller  # no GIL handoff
    python -m bench.diag.diag_eager_host --attribute --syncs --autograd-on-caller  # CUDA only:
        # the time without Triton launches / _scaled_mm, and each host-device sync of a call

On CPU the kernels are the reference math (FP8 GEMMs emulated), so a tiny shape (8 x 64) keeps
their share small and the Python above them (modules, ``quantization.gemm``, the family
functions, ``_library``'s eager path: the same code as on CUDA) shows in the profile.

``--cuda-paths`` (CPU only) runs the CUDA code paths instead, in a child process importing a
copy of ``te_compile`` whose CUDA checks accept the CPU (``bench.diag.diag_launches``'s
patches), with every Triton launch a no-op, ``torch._scaled_mm`` an empty output, the fused
attention kernels (``aten._efficient_attention_*``) zeros and the high-precision GEMMs
(``aten.mm`` / ``addmm`` / ``bmm``, te's and the plain module's) zeros of their shapes, each
through a Python kernel of about cuBLAS's host cost: the host cost of the CUDA eager path's
Python on a machine without a GPU (the launches themselves are not in it).
``--module TransformerLayer``: ``te.TransformerLayer(n, 4n, 4 heads)`` without dropout on
``[tokens / 2, 2, n]``, against ``bench_host``'s plain pre-norm layer; ``--module
DotProductAttention``: causal ``te.DotProductAttention`` (4 heads of ``n / 4``) on ``q, k, v``
``[tokens / 2, 2, 4, n / 4]``, against ``F.scaled_dot_product_attention`` (bench_host's; with
``--cuda-paths`` that plain row computes its attention on the CPU while te's kernels are null:
compare it on a GPU).

    python -m bench.diag.diag_eager_host --device cpu --cuda-paths --timer process --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import te_compile as te
from bench.bench_host import MODULES  # (bench_overhead's modules: one list)
from te_compile.quantization import recipe as R

RECIPES = {
    "bf16": None,
    "current": R.Float8CurrentScaling,
    "delayed": R.DelayedScaling,
    "block": R.Float8BlockScaling,
}
HEADS = 4  # TransformerLayer's (bench_host's), ffn 4 x hidden, input [tokens / 2, 2, hidden]
EXPERTS = 8  # GroupedLinear's, the tokens split evenly (bench_host's case)


def _step(module: torch.nn.Module, x: torch.Tensor, recipe) -> None:
    # bf16: no autocast at all, as the plain module has none (a disabled one builds the default
    # recipe on entry, ~20 us of host per call that is not the module's)
    with te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
        y = module(x)
    y.sum().backward()


class _Split(torch.nn.Module):
    """A grouped module called as ``module(x, splits)`` (the tokens split evenly)."""

    def __init__(self, module: torch.nn.Module, tokens: int) -> None:
        super().__init__()
        self.module, self.splits = module, [tokens // EXPERTS] * EXPERTS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x, self.splits)


class _QKV(torch.nn.Module):
    """An attention module called on ``x`` ``[s, b, 3, heads, d]`` as ``module(q, k, v)``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(*x.unbind(2))


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``y.sum().backward()``
    gives a stride-0 gradient, which ``torch._grouped_mm``'s backward refuses (torch 2.11 and
    2.13: "Invalid strides/sizes"); te's op makes its gradient contiguous itself. One copy
    kernel in the plain module's backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _WithDenseGrad(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DenseGrad.apply(self.module(x))


def plain(name: str, n: int, tokens: int, **kw) -> torch.nn.Module:
    """The plain-PyTorch equivalent of ``te.<name>(n, n)`` (bench_host's, at these sizes)."""
    linear = lambda: torch.nn.Linear(n, n, **kw)  # noqa: E731
    if name == "GroupedLinear":
        from bench.bench_host import GroupedMM

        return _WithDenseGrad(GroupedMM([tokens // EXPERTS] * EXPERTS, n, n, **kw))
    if name == "DotProductAttention":
        from bench.bench_host import PlainAttention

        return _QKV(PlainAttention())
    if name == "TransformerLayer":
        from bench.bench_host import PlainLayer

        return PlainLayer(n, 4 * n, HEADS, **kw)
    if name == "Linear":
        return linear()
    if name == "LayerNormLinear":
        return torch.nn.Sequential(torch.nn.LayerNorm(n, **kw), linear())
    return torch.nn.Sequential(
        torch.nn.LayerNorm(n, **kw), linear(), torch.nn.GELU(approximate="tanh"), linear()
    )


def attribute(module: torch.nn.Module, x: torch.Tensor, name: str, clock, calls: int) -> None:
    """How much of a fwd+bwd call's host time the launches take, on CUDA: the call timed as it
    is, with every Triton launch a no-op, with ``torch._scaled_mm`` an uninitialised output of
    its shape, and with both (the outputs, and the module's FP8 state after them, are then
    garbage; only the host time is read). What is left with both off is the Python, the
    allocations and the aten launches around them."""
    from te_compile import kernels

    recipe = _recipe(name)
    launcher_of, scaled_mm = kernels.EagerLauncher.of, torch._scaled_mm
    rows = {}
    for label, null_launch, null_mm in (
        ("as is", False, False),
        ("no Triton launch", True, False),
        ("no _scaled_mm", False, True),
        ("neither", True, True),
    ):
        if null_launch:
            kernels.EagerLauncher.of = _NULL_LAUNCHER
        if null_mm:
            torch._scaled_mm = _empty_mm
        try:
            rows[label] = time_calls(module, x, recipe, clock, calls)
        finally:
            kernels.EagerLauncher.of, torch._scaled_mm = launcher_of, scaled_mm
    print(f"=== {name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in rows.items()))


def syncs(module: torch.nn.Module, x: torch.Tensor, name: str) -> None:
    """Every host-device synchronisation one fwd+bwd call makes, on CUDA
    (``torch.cuda.set_sync_debug_mode("warn")``), with the te_compile frames above each: a sync
    makes the host wait for the GPU's queue, so an eager step of large kernels pays it as host
    time (after a warm-up call, so that first-call checks are not counted)."""
    import traceback
    import warnings

    recipe = _recipe(name)
    _step(module, x, recipe)
    torch.cuda.synchronize()
    seen: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if "prototype feature" in str(message):  # the debug mode's notice on its first use
            return
        frames = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack()
                  if "te_compile" in f.filename]  # fmt: skip
        seen.append(f"{str(message).splitlines()[0][:80]} <- {' < '.join(reversed(frames[-4:]))}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _step(module, x, recipe)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"=== {name}: {len(seen)} synchronisations per fwd+bwd call")
    for line in seen:
        print(f"  {line}")


def time_calls(module: torch.nn.Module, x: torch.Tensor, recipe, clock, calls: int) -> float:
    """us per fwd+bwd call: the fastest of 5 trials of ``calls`` back-to-back calls."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(30):
        _step(module, x, recipe)
    sync()
    trials = []
    for _ in range(5):
        t0 = clock()
        for _ in range(calls):
            _step(module, x, recipe)
        sync()
        trials.append((clock() - t0) / calls * 1e6)
    return min(trials)


def count_ops(module: torch.nn.Module, x: torch.Tensor, recipe) -> None:
    """The torch ops one fwd+bwd call enters (torch.profiler's CPU events of ``aten::`` ops,
    nested ones included; te's calls on their eager fast path), where each top-level one comes
    from, the host's self time by event and, on CUDA, the kernels it launches, each with its
    count."""
    from torch.profiler import ProfilerActivity, profile

    from bench.harness import eager_fast_path_kept

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    calls = 10
    with eager_fast_path_kept(), profile(activities=activities, with_stack=True) as prof:
        for _ in range(calls):
            _step(module, x, recipe)
        if x.is_cuda:
            torch.cuda.synchronize()
    rows = [(e.count / calls, e.key) for e in prof.key_averages() if e.key.startswith("aten::")]

    # Top level: entered from Python or by autograd's engine (C++ backward nodes), not by
    # another op: each pays the dispatcher's entry on the host, a no-op one too. (An op below
    # another through Python frames, --cuda-paths' stub kernels' own ops, is not top level.)
    def inside_an_op(e) -> bool:
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        return parent is not None

    top = [e for e in prof.events() if e.name.startswith("aten::") and not inside_an_op(e)]
    print(f"top-level torch ops per call: {len(top) / calls:.0f}")
    counts: dict[str, int] = {}
    for e in top:
        counts[e.name] = counts.get(e.name, 0) + 1
    print(
        "  "
        + ", ".join(
            f"{k[6:]} {n / calls:g}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1])
        )
    )
    print(f"torch ops per call (top level and nested): {sum(n for n, _ in rows):.0f}")
    for n, key in sorted(rows, reverse=True):
        print(f"  {n:5.1f}  {key}")
    # Where each top-level op comes from: the innermost Python frames above it.
    sources: dict[tuple[str, str], int] = {}
    for e in top:
        frames, parent = [], e.cpu_parent
        while parent is not None and len(frames) < 4:
            if ".py(" in parent.name:
                frames.append(parent.name.rsplit("/", 1)[-1])
            parent = parent.cpu_parent
        key = (e.name, " < ".join(frames))
        sources[key] = sources.get(key, 0) + 1
    for (name, where), n in sorted(sources.items(), key=lambda kv: -kv[1]):
        print(f"  {n / calls:5.1f}  {name} from {where}")
    # Where the host's time goes below Python (cProfile sees run_backward as one C call): each
    # event's self time, autograd's nodes (autograd::engine::evaluate_function) and the CUDA
    # runtime's calls (cudaLaunchKernel, ...) included; the profiler's own cost inflates all.
    timed = sorted(
        (
            (e.self_cpu_time_total / calls, e.count / calls, e.key)
            for e in prof.key_averages()
            if e.device_type.name == "CPU"
        ),
        reverse=True,
    )
    print("host us per call by event (self time, under the profiler), the top 25:")
    for us, n, key in timed[:25]:
        print(f"  {us:8.1f}  {n:5.1f}x  {key[:100]}")
    if x.is_cuda:
        kernels = [(e.count / calls, e.key) for e in prof.key_averages()
                   if e.device_type.name == "CUDA"]  # fmt: skip
        print(f"kernels per call: {sum(n for n, _ in kernels):.0f}")
        for n, key in sorted(kernels, reverse=True):
            print(f"  {n:5.1f}  {key[:100]}")


def profile_recipe(
    module: torch.nn.Module,
    x: torch.Tensor,
    name: str,
    top: int,
    clock,
    calls: int,
    ops: bool = False,
) -> None:
    recipe = _recipe(name)
    us = time_calls(module, x, recipe, clock, calls)
    print(f"=== {name}: {us:.1f} us per fwd+bwd call")
    if ops:
        count_ops(module, x, recipe)
    if top <= 0:
        return
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        _step(module, x, recipe)
    sync()
    prof.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        text = out.getvalue()
        print(text[text.index("ncalls") :] if "ncalls" in text else text)


def _cuda_paths_child() -> int:
    """Run this script again with ``--child`` on a patched copy of ``te_compile``."""
    from bench.diag.diag_launches import ROOT, _patched_copy

    with tempfile.TemporaryDirectory() as tmp:
        _patched_copy(Path(tmp))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join((tmp, str(ROOT)))}
        cmd = [sys.executable, "-m", "bench.diag.diag_eager_host", *sys.argv[1:], "--child"]
        return subprocess.run(cmd, env=env, cwd=tmp, check=False).returncode


_ATEN_STUBS = None  # the child's aten library of stub kernels (kept alive)


def _shapes_only(op):
    """A CPU kernel for ``op``: its meta function's outputs as CPU zeros (no stray denormals to
    slow the CPU math after it)."""

    def meta(a):
        return a.to("meta") if isinstance(a, torch.Tensor) else a

    def kernel(*args, **kwargs):
        out = op(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})
        zeros = lambda o: torch.zeros(o.shape, dtype=o.dtype)  # noqa: E731
        return tuple(zeros(o) if isinstance(o, torch.Tensor) else o for o in out)

    return kernel


def _zeros_mm(a, b, *args, **kwargs):
    return a.new_zeros(a.shape[0], b.shape[1])


def _zeros_addmm(bias, a, b, *args, **kwargs):
    return a.new_zeros(a.shape[0], b.shape[1])


def _zeros_bmm(a, b, *args, **kwargs):
    return a.new_zeros(a.shape[0], a.shape[1], b.shape[2])


def _attention_grads(grad, q, k, v, bias, *args, **kwargs):
    """``_efficient_attention_backward``'s outputs, zeros: ``(dq, dk, dv, dbias)``."""
    dbias = torch.empty(0) if bias is None else torch.zeros_like(bias)
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias


def _recipe(name: str):
    """A new recipe object of ``RECIPES``' ``name`` (None: bf16, no autocast)."""
    return RECIPES[name]() if RECIPES[name] is not None else None


class _NullLaunch:
    def __call__(self, grid, *args, **kwargs) -> None:
        return None


# ``kernels.EagerLauncher.of`` with every launch a no-op.
_NULL_LAUNCHER = classmethod(lambda cls, kernel: _NullLaunch())


def _empty_mm(a, b, *args, out_dtype=None, **kwargs):
    """``torch._scaled_mm`` as an uninitialised output of its shape (no GEMM)."""
    return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or torch.bfloat16, device=a.device)


def _null_kernels() -> None:
    """No Triton launch; ``torch._scaled_mm`` an uninitialised output of its shape, the fused
    attention kernels and the high-precision GEMMs zeros of theirs."""
    from te_compile import kernels

    kernels.EagerLauncher.of = _NULL_LAUNCHER
    torch._scaled_mm = _empty_mm
    # The fused attention kernels: zeros of their meta functions' shapes on the CPU.
    global _ATEN_STUBS
    _ATEN_STUBS = torch.library.Library("aten", "IMPL")
    fwd = torch.ops.aten._efficient_attention_forward.default
    _ATEN_STUBS.impl("_efficient_attention_forward", _shapes_only(fwd), "CPU")
    _ATEN_STUBS.impl("_efficient_attention_backward", _attention_grads, "CPU")
    # cuBLAS's GEMMs: zeros of their shapes, for te's and the plain module's alike (the CPU's
    # bf16 GEMMs would otherwise be most of a small call's time, and no part of a GPU's host).
    for name, kernel in (("mm", _zeros_mm), ("addmm", _zeros_addmm), ("bmm", _zeros_bmm)):
        _ATEN_STUBS.impl(name, kernel, "CPU")
    print(f"(CUDA code paths on the CPU, null launches and GEMMs: {kernels.__file__})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", choices=MODULES, default="Linear")
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=list(RECIPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--top", type=int, default=25, help="rows of each profile table (0: none)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timing trial")
    parser.add_argument(
        "--timer",
        choices=("wall", "process"),
        default="wall",
        help="process: this process's CPU time (steady on a CPU machine others share)",
    )
    parser.add_argument(
        "--plain", action="store_true", help="also time the plain-PyTorch equivalent (bf16)"
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (process timer: 1)")
    parser.add_argument(
        "--autograd-on-caller",
        action="store_true",
        help="run the backward on the calling thread (torch.autograd.set_multithreading_enabled"
        "(False)): on CUDA autograd runs Python backward functions on its device thread, and "
        "the GIL passes between the two threads at every one",
    )
    parser.add_argument("--tokens", type=int, default=128, help="rows of the input")
    parser.add_argument("--features", type=int, default=256, help="in and out features")
    parser.add_argument(
        "--cuda-paths", action="store_true", help="CPU: the CUDA code paths, null launches"
    )
    parser.add_argument(
        "--ops", action="store_true", help="list the torch ops (and kernels) of one call"
    )
    parser.add_argument(
        "--single-weight",
        action="store_true",
        help="GroupedLinear: one [G, N, K] weight and one [G, N] bias "
        "(single_grouped_parameter=True) instead of a parameter per expert",
    )
    parser.add_argument(
        "--attribute",
        action="store_true",
        help="CUDA: time each recipe also without Triton launches / _scaled_mm (attribute())",
    )
    parser.add_argument(
        "--syncs", action="store_true", help="CUDA: list each host-device sync of a call (syncs())"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cuda_paths and not args.child:
        sys.exit(_cuda_paths_child())
    if args.child:
        _null_kernels()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("diag_eager_host: no CUDA device (--device cpu profiles the CPU path)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": args.device}
    n, t = args.features, args.tokens
    if args.module == "GroupedLinear":
        single = {"single_grouped_parameter": True} if args.single_weight else {}
        module = _Split(te.GroupedLinear(EXPERTS, n, n, **kw, **single), t)
    elif args.module == "TransformerLayer":
        no_dropout = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
        module = te.TransformerLayer(n, 4 * n, HEADS, **no_dropout, **kw)
    elif args.module == "DotProductAttention":
        module = _QKV(te.DotProductAttention(HEADS, n // HEADS, attn_mask_type="causal"))
    else:
        module = getattr(te, args.module)(n, n, **kw)
    shapes = {"TransformerLayer": (t // 2, 2, n), "DotProductAttention": (t // 2, 2, 3, HEADS,
                                                                          n // HEADS)}  # fmt: skip
    shape = shapes.get(args.module, (t, n))
    x = torch.randn(shape, dtype=torch.bfloat16, device=args.device, requires_grad=True)
    print(f"te.{args.module}, hidden {n}, bf16 input {list(shape)}, {args.device}")
    clock = time.process_time if args.timer == "process" else time.perf_counter
    with torch.autograd.set_multithreading_enabled(not args.autograd_on_caller):
        if args.plain:
            ref = plain(args.module, n, t, dtype=torch.bfloat16, device=args.device)
            us = time_calls(ref, x, None, clock, args.calls)
            print(f"=== plain PyTorch: {us:.1f} us per fwd+bwd call")
        for name in args.recipes:
            if args.attribute or args.syncs:
                if args.syncs:
                    syncs(module, x, name)
                if args.attribute:
                    attribute(module, x, name, clock, args.calls)
                continue
            profile_recipe(module, x, name, args.top, clock, args.calls, args.ops)


if __name__ == "__main__":
    main()
