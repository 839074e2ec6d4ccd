import functools
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

# Inductor's caches in a fresh folder per run (unless one is given), set before torch is
# imported (torch writes its default into the environment on first use): a cache key does not
# cover the implementation of a custom op traced through, so a cache left by an earlier version
# of te_compile would serve that version's code. CI starts cold; so does every run here. The
# xdist workers inherit the folder.
_FRESH_INDUCTOR_CACHE = None
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _FRESH_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="te-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _FRESH_INDUCTOR_CACHE

# AOTAutograd's cache is off for the test run: its key walks the source of every Triton kernel
# of every te op in a graph (a bytecode scan per kernel and call, not memoised), a fifth of a
# CPU compile's time here, while a cold cache (see above) serves few hits. Inductor's FX graph
# cache stays on.
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
# Inductor's CPU kernels are generated without SIMD vectors: gcc compiles scalar loops in three
# quarters of the time, and what the CPU tests check (the traced graph, graph breaks, our ops'
# math against float64) does not depend on it. Set TORCHINDUCTOR_VEC_ISA_OK=1 for vector code.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# The GPU suite's part 1 (bench/gpu_suite.sh) spreads its xdist workers over the machine's GPUs:
# TE_COMPILE_TEST_SPREAD_GPUS=n shows worker k only the (k mod n)-th visible GPU (set before
# torch reads it). Without it every worker shares GPU 0, which time-slices between a few dozen
# processes.
_SPREAD = int(os.environ.get("TE_COMPILE_TEST_SPREAD_GPUS", "0"))
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _SPREAD > 1 and _WORKER.startswith("gw"):
    _GPUS = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(_SPREAD)))).split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = _GPUS[int(_WORKER[2:]) % len(_GPUS)]

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch._inductor.config  # noqa: E402

# Without a GPU, and in every xdist worker (the GPU suite runs one per core), each process holds
# a core: Inductor compiles in the process itself instead of starting its own pool of compile
# processes (each one importing torch; a pool per worker oversubscribes the host many times over).
if not torch.cuda.is_available() or "PYTEST_XDIST_WORKER" in os.environ:
    torch._inductor.config.compile_threads = 1
# For the same reason an xdist worker runs its CPU kernels (eager ops, the OpenMP loops of
# Inductor's C++ code) on one thread: a pool of one thread per core in each of a few dozen
# workers oversubscribes the host, and OpenMP's spinning threads then starve every other worker.
if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(1)

# Hypothesis settings of the fuzz tests (tests/fuzz/), chosen with --fuzz-profile: "ci"
# (the default) is seeded and derandomized with a few examples per test, so `make test` stays
# fast and reproducible; "full" draws 200 random cases per test.
FUZZ_PROFILES = {
    "ci": {"max_examples": 10, "derandomize": True},
    "full": {"max_examples": 200, "derandomize": False},
    # ci's examples without shrinking a failure: tests/test_mutations.py plants bugs that every
    # example catches, and shrinking each to a minimal case would only cost time.
    "mutation": {"max_examples": 10, "derandomize": True, "no_shrink": True},
}


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-profile",
        choices=sorted(FUZZ_PROFILES),
        default="ci",
        help="hypothesis profile of tests/fuzz/: ci (seeded, few cases), full "
        "(200 random cases per module and function) or mutation (ci's cases, a failure not "
        "shrunk)",
    )
    parser.addoption(
        "--long-runs",
        action="store_true",
        help="tests/test_long_run.py under every recipe (default: delayed scaling, whose "
        "scaling state evolves over the run; the emulated block-scaled ones take minutes), and "
        "the delayed-scaling and compiled cases of tests/distributed/test_fsdp_fp8_primary.py, "
        "Inductor's Linear in tests/modules/test_pipeline_schedule.py, every bad value of the "
        "walker (tests/test_bad_inputs.py) under torch.compile, Inductor on the CPU in "
        "tests/test_registry.py (and every quantised sample compiled there), and the tests "
        "marked long_compile",
    )
    parser.addoption(
        "--balance-by",
        metavar="FILE",
        help="seconds per test from an earlier run (lines 'seconds<TAB>classname::name' as "
        "bench/suite_summary.py writes them, '#' comments): under pytest-xdist's worksteal "
        "scheduler, each worker's first share of the tests then holds an equal share of the "
        "known seconds, longest first (bench/gpu_suite.sh)",
    )


def pytest_configure(config):
    """Every recompilation logs its reason (the guard that failed): pytest shows it with the
    captured output of a test that fails on a frame count, passing tests stay quiet. Registers
    the hypothesis profile "te-fuzz" the fuzz tests take their settings from (--fuzz-profile);
    no global profile is loaded, so other hypothesis tests keep their own settings."""
    torch._logging.set_logs(recompiles=True)
    try:
        from hypothesis import HealthCheck, Phase, settings
    except ImportError:  # an install without the test extras (tests/test_without_triton.py)
        return
    profile = dict(FUZZ_PROFILES[config.getoption("--fuzz-profile")])
    if profile.pop("no_shrink", False):
        profile["phases"] = [Phase.explicit, Phase.reuse, Phase.generate]
    settings.register_profile(
        "te-fuzz",
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=True,
        **profile,
    )


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from a clean dynamo cache and a fixed seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _modules_on_torch_default_device(request, monkeypatch):
    """On a CUDA machine a module built with ``device=None`` goes to CUDA, Transformer Engine's
    default (``te_compile._checks.default_device``); the tests that build modules without a
    device mean torch's default device (the CPU, where their inputs are), so they get it. The
    tests of the CUDA default are marked ``te_default_device``."""
    if torch.cuda.is_available() and "te_default_device" not in request.keywords:
        from te_compile import _checks

        monkeypatch.setattr(_checks, "cuda_is_default", lambda: False)


def _junit_name(item) -> str:
    """``classname::name`` as pytest's JUnit XML writes a test (bench/suite_summary.py)."""
    parts = item.nodeid.split("::")
    parts[0] = parts[0].removesuffix(".py").replace("/", ".")
    return ".".join(parts[:-1]) + "::" + parts[-1]


def _balance(items, seconds: dict, workers: int) -> None:
    """Reorder ``items`` in place into ``workers`` contiguous shares, as xdist's worksteal
    scheduler deals them out at the start (the first ``workers - N % workers`` get ``N //
    workers`` tests, the rest one more): each test, longest first (a test not in ``seconds``
    counts a second), goes to the share with the fewest seconds that still has room. Idle
    workers steal the second half of a busy worker's queue: the short tests."""
    n = len(items)
    sizes = [n // workers + (i >= workers - n % workers) for i in range(workers)]
    shares = [[] for _ in sizes]
    load = [0.0] * workers
    for item in sorted(items, key=lambda it: -seconds.get(_junit_name(it), 1.0)):
        k = min((i for i in range(workers) if len(shares[i]) < sizes[i]), key=load.__getitem__)
        shares[k].append(item)
        load[k] += seconds.get(_junit_name(item), 1.0)
    items[:] = [item for share in shares for item in share]


# The directories of the GPU suite's part 1 (bench/gpu_suite.sh), where a test runs on the CPU
# unless its file names CUDA: modules and tensors are made on the default device, the CPU.
_PART1_DIRS = ("functional", "kernels", "modules", "ops", "quantization")
_NAMES_CUDA = re.compile("cuda|DEVICES|TRITON_DEVICE", re.IGNORECASE)


@functools.cache
def cpu_only_file(path: Path) -> bool:
    """True for a test file of part 1's directories whose source never names CUDA (no
    ``"cuda"`` device, ``DEVICES``, ``TRITON_DEVICE``, ``HAS_CUDA`` or ``requires_cuda``):
    everything it runs, it runs on the CPU, as CI does."""
    return path.parent.name in _PART1_DIRS and not _NAMES_CUDA.search(path.read_text())


def pytest_itemcollected(item):
    """A test of a :func:`cpu_only_file` carries the marker ``cpu_only``: CI runs it, the GPU
    suite leaves it out (``-m "not cpu_only"``), as it leaves out ``cpu_case``."""
    if cpu_only_file(item.path):
        item.add_marker(pytest.mark.cpu_only)


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected
def pytest_collection_modifyitems(config, items):
    """With ``--balance-by`` in an xdist worker, the tests are dealt into balanced shares
    (``_balance``); every worker orders the same collection the same way.

    Tests marked ``long_compile`` (Inductor's CPU code generation of the largest graphs:
    minutes of ``make test`` on a 2-core CI machine) run with ``--long-runs`` or where a GPU is
    present; elsewhere a smaller sibling of each covers the same path (see docs/testing.md)."""
    workers = getattr(config, "workerinput", {}).get("workercount", 0)
    if config.getoption("--balance-by") and workers > 1:
        with open(config.getoption("--balance-by")) as f:
            rows = (line.rstrip("\n").split("\t", 1) for line in f if line[:1] not in "#\n")
            _balance(items, {name: float(t) for t, name in rows}, workers)
    if config.getoption("--long-runs") or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="long_compile: Inductor's CPU compile of a large graph "
                            "(--long-runs or a GPU machine runs it)")  # fmt: skip
    for item in items:
        if "long_compile" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Skips folded by reason: a few lines above the result line, not one per test site.

    Failures and errors keep pytest's own short summary (``-rfE`` in pyproject.toml)."""
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skips by reason", sep="-")
        for reason, count in reasons.most_common():
            terminalreporter.line(f"{count:6d}  {reason}")


def pytest_unconfigure(config):
    if _FRESH_INDUCTOR_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_FRESH_INDUCTOR_CACHE, ignore_errors=True)
