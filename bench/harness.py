"""A small harness to time competitors side by side in one process run.

Usage, in a bench script::

    report = Report("bench_linear", collect_metadata(device))
    case = Case("Linear fwd+bwd", "16384x4096 -> 16384, bf16", flops=3 * 2 * M * N * K)
    competitors = {"nn.Linear eager": fn_a, "te_compile.Linear eager": fn_b}  # zero-arg callables
    report.add(run_case(case, competitors, baseline="nn.Linear eager", device=device))
    report.finish(out_dir)  # prints the markdown, writes JSON (+ PNG)

Timers
------
``do_bench``  CUDA only: ``triton.testing.do_bench(..., return_mode="median")``. Time of one
              call between CUDA events; the L2 cache is flushed (a 256 MB memset) before every
              call and ``grad_to_none`` tensors get ``.grad = None`` before every call (outside
              the timed region). Host work shorter than the flush is hidden; a host-bound call
              is timed as GPU time plus the GPU's wait for the host, i.e. neither kernel time
              nor steady-state time. The timer for GPU-bound cases.
``wall``      host clock (``time.perf_counter``): ``number`` back-to-back calls per trial, a device
              synchronize at both ends, ``repeat`` trials, median of per-call times. This is the
              steady-state time per call, host overhead included, so it is the timer for eager
              overhead. Clearing ``grad_to_none`` happens inside the loop (a few hundred ns per
              tensor, paid equally by every competitor). On CPU this is the only timer.
``kernels``   CUDA only: sum of the durations of the CUDA kernels (and memsets / copies) one
              call launches, from ``torch.profiler``: pure GPU busy time, whatever the host
              does. Compare with ``wall`` to see how host-bound a call is.
``auto``      ``do_bench`` on CUDA when triton is importable, else ``wall``.

On CPU, ``do_bench`` and ``kernels`` fall back to ``wall``.

Ratios are ``t / t_baseline`` (lower is better; 1.25 means 25% slower than the baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"


def _cuda_at_least(major: int, minor: int) -> bool:
    version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return version >= (major, minor)


# After a torch.profiler session Kineto keeps CUPTI attached unless TEARDOWN_CUPTI=1
# (pytorch#144455): every later CUDA launch and runtime call then pays CUPTI's callbacks, so a
# row timed after another row's kernel count (the benches count each row's kernels with the
# profiler) would be slowed by that count, and more the more it launches. The benches tear
# CUPTI down after each session unless the caller set the variable; CUDA 12.6 and newer tear
# down safely around CUDA graphs (older CUDA crashed re-initialising it).
if _cuda_at_least(12, 6):
    os.environ.setdefault("TEARDOWN_CUPTI", "1")

TIMERS = ("auto", "do_bench", "wall", "kernels")


# --------------------------------------------------------------------------------------------
# Cases and competitors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One benchmark case. ``flops`` / ``nbytes`` are per call and give TFLOP/s / GB/s."""

    name: str
    shape: str
    flops: float | None = None
    nbytes: float | None = None


@dataclass(frozen=True)
class Competitor:
    """A zero-arg callable plus what the timer needs to know about it.

    ``grad_to_none``: tensors whose ``.grad`` is set to None before every timed call (so that a
    backward pass allocates fresh gradients instead of accumulating, as after
    ``zero_grad(set_to_none=True)``). ``baseline``: the competitor this one's ratio is taken
    against (overrides the case-wide baseline).
    """

    fn: Callable[[], object]
    grad_to_none: tuple[torch.Tensor, ...] = ()
    baseline: str | None = None


CompetitorLike = Callable[[], object] | Competitor


def as_competitor(obj: CompetitorLike) -> Competitor:
    if isinstance(obj, Competitor):
        return obj
    if callable(obj):
        return Competitor(fn=obj)
    raise TypeError(f"competitor must be a zero-arg callable or a Competitor, got {type(obj)}")


def rotating(
    fn: Callable[..., object],
    input_sets: Sequence[Sequence[Any]],
    *,
    clear_grads: bool = False,
) -> Callable[[], object]:
    """Zero-arg callable that calls ``fn(*input_sets[i])`` with i cycling 0, 1, 2, ...

    Use it so that consecutive calls do not find their inputs in L2 (see ``num_input_sets``).
    ``clear_grads=True`` sets ``.grad = None`` on the set's tensors that require grad right
    before each call (inside the timed region, ~0.1 us per tensor): cheaper than listing every
    set's tensors in ``grad_to_none``, which the wall timer clears on every call.
    """
    if not input_sets:
        raise ValueError("rotating: input_sets must not be empty")
    sets = [tuple(s) for s in input_sets]
    if clear_grads:
        pairs = [
            (s, tuple(t for t in s if isinstance(t, torch.Tensor) and t.requires_grad))
            for s in sets
        ]
        cycle = itertools.cycle(pairs)

        def call_clearing() -> object:
            args, grads = next(cycle)
            for t in grads:
                t.grad = None
            return fn(*args)

        return call_clearing
    if len(sets) == 1:
        only = sets[0]
        return lambda: fn(*only)
    it = itertools.cycle(sets)
    return lambda: fn(*next(it))


def with_setting(obj: object, name: str, value: object, fn: Callable[..., Any]) -> Callable:
    """``fn`` called with ``obj.name`` set to ``value`` (restored after every call): a module
    flag read while tracing, so a compiled ``fn`` guards on it and keeps its own graph."""

    def call(*args: Any, **kwargs: Any) -> Any:
        previous = getattr(obj, name)
        setattr(obj, name, value)
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(obj, name, previous)

    return call


def l2_cache_bytes(device: torch.device | str | None = None) -> int:
    """L2 size of the CUDA device (50 MiB, H100's size, when unknown or not CUDA)."""
    default = 50 * 2**20
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        return int(getattr(props, "L2_cache_size", default) or default)
    return default


def num_input_sets(set_nbytes: int, cache_nbytes: int, max_sets: int = 64) -> int:
    """How many input sets to rotate so that a set is evicted before it is used again.

    1 when one set is already bigger than twice the cache; otherwise enough sets that their
    total is at least twice the cache (capped at ``max_sets``).
    """
    if set_nbytes <= 0:
        raise ValueError("num_input_sets: set_nbytes must be positive")
    if set_nbytes >= 2 * cache_nbytes:
        return 1
    return min(max_sets, math.ceil(2 * cache_nbytes / set_nbytes) + 1)


def tensors_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    n: int  # number of samples the quantiles are over (calls for do_bench, trials for wall)
    timer: str
    calls_per_sample: int = 1


def _timing_of(samples_ms: Sequence[float], *, timer: str, calls_per_sample: int) -> Timing:
    """Median and p20/p80 of per-call times (one sample per trial)."""
    ordered = sorted(samples_ms)
    return Timing(
        median_ms=statistics.median(ordered),
        p20_ms=_quantile(ordered, 0.2),
        p80_ms=_quantile(ordered, 0.8),
        n=len(ordered),
        timer=timer,
        calls_per_sample=calls_per_sample,
    )


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (same convention as torch.quantile / numpy default)."""
    if not sorted_values:
        raise ValueError("_quantile of an empty sequence")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _clear_grads(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def resolve_timer(timer: str, device: torch.device) -> str:
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}, got {timer!r}")
    if timer == "auto":
        if device.type == "cuda":
            try:
                import triton.testing  # noqa: F401
            except ImportError:
                return "wall"
            return "do_bench"
        return "wall"
    if timer in ("do_bench", "kernels") and device.type != "cuda":
        return "wall"  # CPU fallback (smoke runs)
    return timer


def time_do_bench(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 100.0,
    rep_ms: float = 500.0,
    grad_to_none: Sequence[torch.Tensor] = (),
) -> Timing:
    """GPU time per call from ``triton.testing.do_bench`` (median, with p20 / p80)."""
    from triton.testing import do_bench

    kwargs: dict[str, Any] = {"warmup": warmup_ms, "rep": rep_ms, "return_mode": "median"}
    bench_fn = fn
    if grad_to_none:
        if "grad_to_none" in inspect.signature(do_bench).parameters:
            kwargs["grad_to_none"] = list(grad_to_none)
        else:  # old triton: clear inside the timed call (host-only cost)

            def bench_fn() -> object:
                _clear_grads(grad_to_none)
                return fn()

    # quantiles take precedence over return_mode; the 0.5 quantile is the median.
    p20, p50, p80 = do_bench(bench_fn, quantiles=[0.2, 0.5, 0.8], **kwargs)
    n = max(1, int(rep_ms / max(p50, 1e-6)))  # approximately what do_bench ran
    return Timing(float(p50), float(p20), float(p80), n=n, timer="do_bench")


def time_kernels(
    fn: Callable[[], object],
    *,
    grad_to_none: Sequence[torch.Tensor] = (),
    calls: int = 20,
    repeat: int = 5,
) -> Timing:
    """GPU busy time per call: summed CUDA kernel durations recorded by torch.profiler."""
    per_call_ms = []
    for _ in range(repeat):
        total_us = sum(us for _name, us in _cuda_kernels(fn, grad_to_none, calls))
        if total_us <= 0:
            raise RuntimeError("torch.profiler recorded no CUDA kernels (is CUPTI available?)")
        per_call_ms.append(total_us / calls / 1e3)
    return _timing_of(per_call_ms, timer="kernels", calls_per_sample=calls)


@contextlib.contextmanager
def eager_fast_path_kept() -> Iterator[None]:
    """While profiling: te_compile's eager calls keep their fast path. An eager te op call
    takes the op path (the dispatcher, autograd's generated node) while a profiler runs, so
    that profiles name the ops; that path's autograd fills zero gradients for the outputs that
    got none, kernels the fast path (the one unprofiled eager calls take) does not launch."""
    from te_compile import _library

    kept = _library._op_path_when_profiled
    _library._op_path_when_profiled = False
    try:
        yield
    finally:
        _library._op_path_when_profiled = kept


def _cuda_kernels(
    fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor], calls: int
) -> list[tuple[str, float]]:
    """``(name, us)`` of every CUDA kernel of ``calls`` calls of ``fn`` (torch.profiler, te's
    eager calls on their fast path); the ``.grad`` of ``grad_to_none`` is cleared before each
    call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with (
        warnings.catch_warnings(),
        eager_fast_path_kept(),
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
    ):
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        for _ in range(calls):
            _clear_grads(grad_to_none)
            fn()
        torch.cuda.synchronize()
    return [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def host_ms(fn: Callable[[], object], device: torch.device, calls: int = 2) -> float:
    """The host's time to issue one of ``calls`` calls of ``fn``: on CUDA while the GPU sleeps
    (a ~1 s ``torch.cuda._sleep`` queued first, so the host never waits for the device unless
    ``fn`` syncs; few calls, as a full launch queue would make the host wait); on the CPU, the
    calls' wall time."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e3
    if cuda:
        torch.cuda.synchronize(device)
    return t


def kernels_per_call(
    fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] = (), calls: int = 3
) -> float:
    """CUDA kernels one call of ``fn`` launches (torch.profiler: Triton, cuBLAS, copies)."""
    return len(_cuda_kernels(fn, grad_to_none, calls)) / calls


def _calibrate(trial: Callable[[int], float], min_trial_s: float, min_number: int) -> int:
    """Smallest n in 1, 2, 5, 10, 20, 50, ... (>= min_number) whose trial lasts min_trial_s."""
    for mult in itertools.count():
        for base in (1, 2, 5):
            n = base * 10**mult
            if n >= min_number and trial(n) >= min_trial_s:
                return n
    raise AssertionError("unreachable")


def time_wall(
    fn: Callable[[], object],
    *,
    device: torch.device | str = "cpu",
    grad_to_none: Sequence[torch.Tensor] = (),
    repeat: int = 7,
    number: int | None = None,
    min_trial_s: float = 0.05,
    min_number: int = 1,
) -> Timing:
    """Host-clock time per call: ``repeat`` trials of ``number`` back-to-back calls.

    ``number`` is calibrated (1, 2, 5, 10, 20, 50, ...) so that a trial lasts at least
    ``min_trial_s`` and is at least ``min_number``, unless given.
    """
    sync = _synchronizer(torch.device(device))
    grads = tuple(grad_to_none)

    def trial(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        if grads:
            for _ in range(n):
                _clear_grads(grads)
                fn()
        else:
            for _ in range(n):
                fn()
        sync()
        return time.perf_counter() - t0

    if number is None:
        number = _calibrate(trial, min_trial_s, min_number)
    per_call_ms = [trial(number) / number * 1e3 for _ in range(repeat)]
    return _timing_of(per_call_ms, timer="wall", calls_per_sample=number)


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device | str = "cpu",
    timer: str = "auto",
    grad_to_none: Sequence[torch.Tensor] = (),
    warmup_calls: int = 3,
    warmup_ms: float = 100.0,
    rep_ms: float = 500.0,
    repeat: int = 7,
    number: int | None = None,
    min_trial_s: float = 0.05,
    min_number: int = 1,
) -> Timing:
    """Warm up (``warmup_calls`` calls: the first compiles under torch.compile), then time."""
    device = torch.device(device)
    sync = _synchronizer(device)
    for _ in range(warmup_calls):
        _clear_grads(grad_to_none)
        fn()
    sync()
    timer = resolve_timer(timer, device)
    if timer == "do_bench":
        return time_do_bench(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)
    if timer == "kernels":
        return time_kernels(fn, grad_to_none=grad_to_none, repeat=repeat)
    return time_wall(
        fn,
        device=device,
        grad_to_none=grad_to_none,
        repeat=repeat,
        number=number,
        min_trial_s=min_trial_s,
        min_number=min_number,
    )


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    timing: Timing | None
    baseline: str | None
    ratio: float | None = None  # t / t_baseline
    tflops: float | None = None
    gbps: float | None = None
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        return self.timing.median_ms if self.timing is not None else None


@dataclass
class CaseResult:
    case: Case
    rows: list[Row]
    timer: str
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        compute_throughput(self.case, self.rows)
        compute_ratios(self.rows)

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self.case),
            "timer": self.timer,
            "notes": list(self.notes),
            "results": [
                {
                    "name": r.name,
                    "median_ms": r.median_ms,
                    "p20_ms": r.timing.p20_ms if r.timing else None,
                    "p80_ms": r.timing.p80_ms if r.timing else None,
                    "samples": r.timing.n if r.timing else None,
                    "calls_per_sample": r.timing.calls_per_sample if r.timing else None,
                    "timer": r.timing.timer if r.timing else None,
                    "tflops": r.tflops,
                    "gbps": r.gbps,
                    "baseline": r.baseline,
                    "ratio": r.ratio,
                    "error": r.error,
                }
                for r in self.rows
            ],
        }


def compute_ratios(rows: Sequence[Row]) -> None:
    """Fill ``row.ratio = t / t_baseline`` in place (None where either time is missing)."""
    by_name = {r.name: r for r in rows}
    for r in rows:
        base = by_name.get(r.baseline) if r.baseline is not None else None
        if r.median_ms is None or base is None or not base.median_ms:
            r.ratio = None
        else:
            r.ratio = r.median_ms / base.median_ms


def compute_throughput(case: Case, rows: Sequence[Row]) -> None:
    """Fill ``row.tflops`` / ``row.gbps`` in place from the case's flops / nbytes."""
    for r in rows:
        seconds = r.median_ms * 1e-3 if r.median_ms else None
        r.tflops = case.flops / seconds / 1e12 if case.flops and seconds else None
        r.gbps = case.nbytes / seconds / 1e9 if case.nbytes and seconds else None


def run_case(
    case: Case,
    competitors: Mapping[str, CompetitorLike],
    *,
    baseline: str | None = None,
    device: torch.device | str = "cpu",
    timer: str = "auto",
    notes: Sequence[str] = (),
    verbose: bool = True,
    **timing_kwargs: Any,
) -> CaseResult:
    """Time every competitor of ``case`` (in the given order) and compute ratios.

    ``baseline`` names the competitor ratios are taken against; a ``Competitor`` may name its
    own. A competitor that raises is reported with its error and the run goes on.
    ``timing_kwargs`` go to ``time_fn`` (warmup_calls, warmup_ms, rep_ms, repeat, number, ...).
    """
    device = torch.device(device)
    comps = {name: as_competitor(c) for name, c in competitors.items()}
    for name, c in comps.items():
        b = c.baseline or baseline
        if b is not None and b not in comps:
            raise ValueError(f"baseline {b!r} of competitor {name!r} is not a competitor")
    resolved = resolve_timer(timer, device)
    rows: list[Row] = []
    for name, c in comps.items():
        base = c.baseline or baseline
        if verbose:
            print(f"  [{case.name}] {name} ...", file=sys.stderr, flush=True)
        try:
            t = time_fn(
                c.fn, device=device, timer=resolved, grad_to_none=c.grad_to_none, **timing_kwargs
            )
        except Exception as exc:  # report and keep going: one broken competitor != no data
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            print(f"  [{case.name}] {name} FAILED: {msg}", file=sys.stderr, flush=True)
            rows.append(Row(name, None, base, error=msg))
            continue
        rows.append(Row(name, t, base))
    notes = list(notes)
    if PROFILE and device.type == "cuda":
        for name, c in comps.items():
            try:
                notes.append(f"kernels of {name}: " + kernel_breakdown(c.fn, c.grad_to_none))
            except Exception as exc:  # a diagnostic: never lose the timings for it
                notes.append(f"kernels of {name}: {type(exc).__name__}: {exc}"[:300])
    return CaseResult(case, rows, resolved, notes)  # fills throughput and ratios


# Set by ``start`` from ``--profile``: each case then also lists where each competitor's GPU
# time goes, kernel by kernel (torch.profiler), in its notes.
PROFILE = False


def kernel_breakdown(
    fn: Callable[[], object],
    grad_to_none: Sequence[torch.Tensor] = (),
    calls: int = 5,
    top: int | None = None,
) -> str:
    """The ``top`` CUDA kernels by total time (default: ``$BENCH_PROFILE_TOP`` or 8), as
    ``name xN: us/call`` (one line)."""
    top = int(os.environ.get("BENCH_PROFILE_TOP", "8")) if top is None else top
    fn()  # warm: compiles and autotuning stay out of the profile
    per_kernel: dict[str, list[float]] = {}
    for name, us in _cuda_kernels(fn, grad_to_none, calls):
        per_kernel.setdefault(name, []).append(us)
    total = sum(sum(v) for v in per_kernel.values()) / calls
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    parts = [f"{name[:60]} x{len(v) // calls}: {sum(v) / calls:.0f} us" for name, v in ranked]
    return f"total {total:.0f} us/call; " + "; ".join(parts)


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------

_TIMER_TEXT = {
    "do_bench": "triton do_bench, GPU time per call (CUDA events, L2 flushed), median",
    "wall": "host clock, steady-state time per call (back-to-back calls, synced), median",
    "kernels": "GPU kernel time per call (sum of CUDA kernel durations, torch.profiler), median",
}


def format_time(ms: float | None) -> str:
    if ms is None:
        return "—"
    if ms >= 1000:
        return f"{ms / 1e3:.3f} s"
    if ms >= 1:
        return f"{ms:.3f} ms"
    return f"{ms * 1e3:.2f} µs"


def _fmt(x: float | None, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def format_rate(x: float | None) -> str:
    """Throughput: one decimal from 100 up, else 3 significant digits."""
    if x is None:
        return "—"
    return f"{x:.1f}" if abs(x) >= 100 else f"{x:.3g}"


def format_case_markdown(result: CaseResult) -> str:
    case = result.case
    has_flops = case.flops is not None
    has_bytes = case.nbytes is not None
    header = ["competitor", "median", "p20 - p80"]
    if has_flops:
        header.append("TFLOP/s")
    if has_bytes:
        header.append("GB/s")
    header += ["baseline", "t / t_base"]
    align = ["---", "---:", "---:"] + ["---:"] * (has_flops + has_bytes) + ["---", "---:"]
    lines = [
        f"### {case.name} — {case.shape}",
        "",
        f"timer: {_TIMER_TEXT.get(result.timer, result.timer)}; t / t_base < 1 is faster.",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
    ]
    for r in result.rows:
        if r.timing is None:
            cells = [r.name, "error", r.error or "?"]
            cells += ["—"] * (has_flops + has_bytes)
            cells += [r.baseline or "—", "—"]
        else:
            cells = [r.name, format_time(r.timing.median_ms)]
            cells.append(f"{format_time(r.timing.p20_ms)} - {format_time(r.timing.p80_ms)}")
            if has_flops:
                cells.append(format_rate(r.tflops))
            if has_bytes:
                cells.append(format_rate(r.gbps))
            is_base = r.baseline == r.name
            cells.append("(itself)" if is_base else (r.baseline or "—"))
            cells.append(_fmt(r.ratio, ".3f") + ("x" if r.ratio is not None else ""))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if result.notes:
        lines.append("")
        lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Metadata, report, output
# --------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def collect_metadata(device: torch.device | str | None = None) -> dict[str, Any]:
    """GPU name, versions, ISO date, hostname (and git commit when there is one)."""
    device = torch.device(device) if device is not None else None
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    meta: dict[str, Any] = {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "autograd_multithreading": torch._C._is_multithreading_enabled(),
        "teardown_cupti": os.environ.get("TEARDOWN_CUPTI"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version,
        "device": str(device) if device is not None else None,
        "gpu": None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch_threads": torch.get_num_threads(),
        "argv": list(sys.argv),
        "git_commit": _git("rev-parse", "HEAD"),
    }
    if device is not None and device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda_driver_capability"] = list(torch.cuda.get_device_capability(device))
    status = _git("status", "--porcelain")
    meta["git_dirty"] = bool(status) if meta["git_commit"] else None
    return meta


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_out_dir(meta: Mapping[str, Any]) -> Path:
    """``bench/results/<YYYY-MM-DD>_<gpu-slug>/`` (``cpu`` when no GPU)."""
    date = str(meta.get("date", ""))[:10] or datetime.now().strftime("%Y-%m-%d")
    return RESULTS_DIR / f"{date}_{slug(meta.get('gpu') or 'cpu')}"


def _free_path(directory: Path, stem: str, suffix: str) -> Path:
    """``stem.suffix``, or ``stem_2.suffix``, ``stem_3.suffix``... so no run is overwritten."""
    path = directory / f"{stem}{suffix}"
    k = 2
    while path.exists():
        path = directory / f"{stem}_{k}{suffix}"
        k += 1
    return path


class Report:
    """Collects case results of one script run; prints and writes them."""

    def __init__(self, script: str, metadata: Mapping[str, Any]) -> None:
        self.script = script
        self.metadata = dict(metadata)
        self.cases: list[CaseResult] = []
        self.sections: list[dict[str, Any]] = []

    def add(self, result: CaseResult, *, echo: bool = True) -> CaseResult:
        self.cases.append(result)
        if echo:
            print(format_case_markdown(result), flush=True)
        return result

    def add_section(self, markdown: str, data: Any = None, *, echo: bool = True) -> None:
        """A markdown section built from the cases (e.g. a summary table with targets): written
        after the cases in the markdown, and with ``data`` (its numbers) under ``sections`` in
        the JSON."""
        self.sections.append({"markdown": markdown, "data": data})
        if echo:
            print(markdown, flush=True)

    def header_markdown(self) -> str:
        m = self.metadata
        return (
            f"## {self.script}\n\n"
            f"{m.get('date')} · {m.get('gpu') or 'CPU (' + str(m.get('cpu')) + ')'} · "
            f"torch {m.get('torch')} · triton {m.get('triton')} · host {m.get('hostname')}"
            + (" · backward on the calling thread" if m.get("autograd_multithreading") is False
               else "")
            + "\n"
        )  # fmt: skip

    def markdown(self) -> str:
        sections = [s["markdown"] for s in self.sections]
        return "\n".join(
            [self.header_markdown(), *map(format_case_markdown, self.cases), *sections]
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "script": self.script,
            "metadata": self.metadata,
            "cases": [c.to_dict() for c in self.cases],
            "sections": list(self.sections),
        }

    def write_json(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    def write_chart(self, path: Path) -> Path | None:
        """Bar chart of median times, one panel per case; None when matplotlib is missing."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: skipping the PNG chart", file=sys.stderr)
            return None
        cases = [c for c in self.cases if any(r.timing for r in c.rows)]
        if not cases:
            return None
        fig, axes = plt.subplots(
            len(cases), 1, figsize=(11, 1.0 + 0.45 * sum(len(c.rows) + 2 for c in cases))
        )
        axes = [axes] if len(cases) == 1 else list(axes)
        for ax, res in zip(axes, cases, strict=True):
            rows = [r for r in res.rows if r.timing is not None]
            names = [r.name for r in rows]
            times = [r.timing.median_ms for r in rows if r.timing is not None]
            unit, scale = ("ms", 1.0) if max(times) >= 1 else ("µs", 1e3)
            vals = [t * scale for t in times]
            bars = ax.barh(names, vals, color="tab:blue")
            ax.invert_yaxis()
            for bar, r in zip(bars, rows, strict=True):
                label = f" {bar.get_width():.3g} {unit}"
                if r.ratio is not None and r.baseline != r.name:
                    label += f"  ({r.ratio:.2f}x {r.baseline})"
                ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center")
            ax.set_xlim(0, max(vals) * 2.0)
            ax.set_xlabel(f"median time per call ({unit}), lower is better")
            ax.set_title(f"{res.case.name} — {res.case.shape}", fontsize=10)
        m = self.metadata
        fig.suptitle(
            f"{self.script}: {m.get('gpu') or 'CPU'} · torch {m.get('torch')} · {m.get('date')}",
            fontsize=10,
        )
        fig.tight_layout(rect=(0, 0, 1, 0.98))
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def finish(self, out_dir: Path | None, *, chart: bool = True) -> dict[str, Path]:
        """Write ``<script>.json``, ``<script>.md`` (and ``.png``) into ``out_dir`` if given."""
        written: dict[str, Path] = {}
        if out_dir is None:
            print("(no --out: results not written)", file=sys.stderr)
            return written
        out_dir.mkdir(parents=True, exist_ok=True)
        stem = _free_path(out_dir, self.script, ".json").stem
        written["json"] = self.write_json(out_dir / f"{stem}.json")
        md = out_dir / f"{stem}.md"
        md.write_text(self.markdown())
        written["md"] = md
        if chart:
            png = self.write_chart(out_dir / f"{stem}.png")
            if png is not None:
                written["png"] = png
        for kind, path in written.items():
            print(f"wrote {kind}: {path}", file=sys.stderr)
        return written


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for JSON / markdown / PNG results (default: bench/results/<date>_<gpu>/; "
        "with --smoke, nothing is written unless --out is given)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes and short timing: checks that the script runs (CPU is fine)",
    )
    parser.add_argument(
        "--device", default=None, help="cuda or cpu (default: cuda when available, else cpu)"
    )
    parser.add_argument("--no-chart", action="store_true", help="do not draw the PNG chart")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also list each competitor's top CUDA kernels (torch.profiler) in the case notes",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: 1 on CPU, where the runs measure host overhead "
        "and thread hand-offs only add noise; torch's default on CUDA)",
    )
    parser.add_argument(
        "--autograd-on-caller",
        action="store_true",
        help="run every backward on the calling thread "
        "(torch.autograd.set_multithreading_enabled(False), for the plain-PyTorch rows too): by "
        "default autograd hands a CUDA backward to its device thread, and a backward with Python "
        "nodes (te_compile's ops, Transformer Engine's modules) pays thread hand-offs there",
    )
    return parser


def resolve_device(args: argparse.Namespace) -> torch.device:
    """The device from ``--device`` (default cuda if available); applies ``--threads`` and
    ``--autograd-on-caller``."""
    if args.device:
        device = torch.device(args.device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(threads)
    if getattr(args, "autograd_on_caller", False):
        torch.autograd.set_multithreading_enabled(False)
    if device.type == "cuda":
        with torch.cuda.device(device):  # create the CUDA context on this thread
            torch.cuda.current_blas_handle()
    return device


SMOKE_TIMING = {"warmup_ms": 5, "rep_ms": 20, "repeat": 3, "min_trial_s": 0.01}
GEMM_TIMING = {"warmup_ms": 200, "rep_ms": 1000, "repeat": 5, "min_trial_s": 0.1}
MEMORY_BOUND_TIMING = {"warmup_ms": 50, "rep_ms": 300, "repeat": 5, "min_trial_s": 0.1}


def start(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    script: str,
    *,
    full_timing: Mapping[str, Any],
) -> tuple[argparse.Namespace, torch.device, dict[str, Any], Report]:
    """The common start of a bench script whose full-size cases need CUDA: parse (``parser``
    already has the script's own options; the common ones are added here), pick the device and
    the timing (``SMOKE_TIMING`` with --smoke), and open the report (metadata printed)."""
    add_common_args(parser)
    args = parser.parse_args(argv)
    global PROFILE
    PROFILE = bool(getattr(args, "profile", False))
    device = resolve_device(args)
    if device.type != "cuda" and not args.smoke:
        parser.error("full-size shapes need a CUDA GPU; use --smoke on CPU")
    meta = collect_metadata(device)
    meta["smoke"] = args.smoke
    try:
        import te_compile

        meta["te_compile"] = te_compile.__version__
    except ImportError:
        meta["te_compile"] = None
    report = Report(script, meta)
    print(report.header_markdown())
    return args, device, dict(SMOKE_TIMING if args.smoke else full_timing), report


def resolve_out_dir(args: argparse.Namespace, meta: Mapping[str, Any]) -> Path | None:
    if args.out is not None:
        return Path(args.out)
    if args.smoke:
        return None
    return default_out_dir(meta)
