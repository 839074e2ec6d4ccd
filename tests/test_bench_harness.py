"""CPU test of bench/harness.py: timing, ratios, markdown table, JSON; and of bench_block's two
stacks under its weight mapping. No CUDA, no matplotlib."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.utils import assert_close

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # bench/ is not an installed package
    sys.path.insert(0, str(_ROOT))
harness = importlib.import_module("bench.harness")
bench_block = importlib.import_module("bench.bench_block")

FAST = {"repeat": 3, "min_trial_s": 0.002, "warmup_calls": 1}


def _timing(ms: float) -> harness.Timing:
    return harness.Timing(median_ms=ms, p20_ms=ms * 0.9, p80_ms=ms * 1.1, n=5, timer="wall")


def _fixed_result() -> harness.CaseResult:
    case = harness.Case("tiny", "4x4", flops=2e9, nbytes=4e6)
    rows = [
        harness.Row("base", _timing(2.0), "base"),
        harness.Row("slow", _timing(3.0), "base"),
        harness.Row("fast", _timing(0.5), "base"),
        harness.Row("other", _timing(4.0), "slow"),
        harness.Row("broken", None, "base", error="RuntimeError: boom"),
    ]
    return harness.CaseResult(case, rows, "wall", notes=["a note"])  # computes ratios


def test_ratio_arithmetic():
    res = _fixed_result()
    assert res.row("base").ratio == pytest.approx(1.0)
    assert res.row("slow").ratio == pytest.approx(1.5)
    assert res.row("fast").ratio == pytest.approx(0.25)
    assert res.row("other").ratio == pytest.approx(4.0 / 3.0)  # its own baseline
    assert res.row("broken").ratio is None


def test_markdown_table():
    md = harness.format_case_markdown(_fixed_result())
    lines = md.splitlines()
    assert lines[0] == "### tiny — 4x4"
    header = next(line for line in lines if line.startswith("| competitor"))
    assert header == "| competitor | median | p20 - p80 | TFLOP/s | GB/s | baseline | t / t_base |"
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| ---")]
    assert len(table) == 1 + 5
    by_name = {line.split(" | ")[0][2:]: line for line in table[1:]}
    # 2e9 FLOP in 2 ms = 1 TFLOP/s; 4e6 B in 2 ms = 2 GB/s
    assert by_name["base"] == (
        "| base | 2.000 ms | 1.800 ms - 2.200 ms | 1 | 2 | (itself) | 1.000x |"
    )
    assert "| 1.500x |" in by_name["slow"]
    assert "| 0.250x |" in by_name["fast"]
    assert "500.00 µs" in by_name["fast"]
    assert "| slow | 1.333x |" in by_name["other"]
    assert "error" in by_name["broken"] and "RuntimeError: boom" in by_name["broken"]
    assert "- a note" in lines


def test_run_case_cpu_and_json(tmp_path):
    a = torch.randn(64, 64)
    b = torch.randn(64, 64)
    case = harness.Case("mm", "64x64x64", flops=2 * 64**3)

    def boom():
        raise ValueError("broken competitor")

    res = harness.run_case(
        case,
        {"mm": lambda: a @ b, "add": lambda: a + b, "boom": boom},
        baseline="mm",
        device="cpu",
        timer="do_bench",  # falls back to the host clock on CPU
        verbose=False,
        **FAST,
    )
    assert res.timer == "wall"
    mm, add, broken = res.rows
    assert mm.timing.median_ms > 0 and mm.timing.timer == "wall"
    assert add.ratio == pytest.approx(add.timing.median_ms / mm.timing.median_ms)
    assert mm.ratio == pytest.approx(1.0)
    assert mm.tflops == pytest.approx(2 * 64**3 / (mm.timing.median_ms * 1e-3) / 1e12)
    assert broken.timing is None and "broken competitor" in broken.error

    meta = harness.collect_metadata("cpu")
    for key in ("date", "hostname", "torch", "triton", "gpu", "device"):
        assert key in meta
    assert meta["torch"] == torch.__version__ and meta["gpu"] is None
    report = harness.Report("bench_test", meta)
    report.add(res, echo=False)
    written = report.finish(tmp_path, chart=False)
    data = json.loads(written["json"].read_text())
    assert data["script"] == "bench_test" and data["metadata"]["device"] == "cpu"
    (case_d,) = data["cases"]
    assert case_d["name"] == "mm" and case_d["flops"] == 2 * 64**3 and case_d["timer"] == "wall"
    rows = {r["name"]: r for r in case_d["results"]}
    assert rows["add"]["ratio"] == pytest.approx(rows["add"]["median_ms"] / rows["mm"]["median_ms"])
    assert rows["add"]["baseline"] == "mm" and rows["boom"]["median_ms"] is None
    assert "### mm — 64x64x64" in written["md"].read_text()
    # a second run does not overwrite the first
    assert report.finish(tmp_path, chart=False)["json"].name == "bench_test_2.json"


def test_grad_to_none_and_rotation():
    w = torch.randn(4, requires_grad=True)
    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    seen = []

    def step(x):
        assert w.grad is None and x.grad is None  # cleared before every call
        seen.append(x)
        (w * x).sum().backward()

    fn = harness.rotating(step, [(x,) for x in xs], clear_grads=True)
    harness.time_fn(fn, device="cpu", grad_to_none=[w], number=5, repeat=2, warmup_calls=1)
    assert len(seen) == 1 + 2 * 5
    assert seen[:4] == [xs[0], xs[1], xs[2], xs[0]]


def test_rotation_helpers():
    calls = []
    fn = harness.rotating(lambda i: calls.append(i), [(0,), (1,)])
    for _ in range(3):
        fn()
    assert calls == [0, 1, 0]
    assert harness.num_input_sets(200 * 2**20, 50 * 2**20) == 1
    assert harness.num_input_sets(10 * 2**20, 50 * 2**20) == 11
    assert harness.num_input_sets(1, 50 * 2**20, max_sets=8) == 8


def test_formatting_and_paths():
    assert harness.format_time(0.0123) == "12.30 µs"
    assert harness.format_time(12.3456) == "12.346 ms"
    assert harness.format_time(None) == "—"
    assert harness._quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.2) == pytest.approx(1.8)
    meta = {"date": "2026-11-22T04:00:00+00:00", "gpu": "NVIDIA H100 80GB HBM3"}
    assert harness.default_out_dir(meta).name == "2026-11-22_nvidia-h100-80gb-hbm3"
    assert harness.default_out_dir({"date": "2026-11-22", "gpu": None}).name == "2026-11-22_cpu"

    parser = harness.add_common_args(argparse.ArgumentParser())
    args = parser.parse_args(["--smoke"])
    assert harness.resolve_out_dir(args, meta) is None
    args = parser.parse_args(["--out", "x/y"])
    assert harness.resolve_out_dir(args, meta) == Path("x/y")
    assert harness.resolve_out_dir(parser.parse_args([]), meta).parent == harness.RESULTS_DIR
    assert harness.resolve_timer("auto", torch.device("cpu")) == "wall"
    with pytest.raises(ValueError, match="baseline"):
        harness.run_case(harness.Case("c", "s"), {"a": lambda: None}, baseline="nope")


@pytest.mark.parametrize("arch", ["block", "layer"])
def test_block_stacks_agree_under_the_weight_mapping(arch):
    """bench_block's te_compile stack, loaded with the plain-PyTorch stack's weights through
    ``te_state_dict``, computes the same output and input gradient (fp32): the names, the QKV
    split (layer: GQA), te's SwiGLU halves and the RoPE convention agree."""
    bb, cpu = bench_block, torch.device("cpu")
    size = dataclasses.replace(bb.SMOKE_SIZES[arch], seq=20)
    weights = bb.make_weights(size, cpu)
    ref = bb.torch_stack(size, cpu).float()
    ref.load_state_dict(weights, strict=True)
    ours = bb.te_stack(size, cpu).float()
    ours.load_state_dict(bb.te_state_dict(weights, size), strict=True)
    x = torch.randn(size.input_shape, requires_grad=True)
    grad = torch.randn_like(x)
    expected = ref(x)
    expected.backward(grad)
    expected_dx, x.grad = x.grad, None
    actual = ours(x)
    actual.backward(grad)
    assert_close(actual, expected.double(), torch.float32, roundings=64)
    assert_close(x.grad, expected_dx.double(), torch.float32, roundings=64)


def test_bench_overhead_module_part_smoke(tmp_path):
    """``bench_overhead --only-modules --smoke`` on CPU: part 4's summary has a row per module
    and precision (bf16, every native recipe, the optional MXFP8 / NVFP4), each with positive,
    finite te and plain-PyTorch figures and a verdict, in the JSON and in the markdown."""
    bench_overhead = importlib.import_module("bench.bench_overhead")
    bench_host = importlib.import_module("bench.bench_host")
    threads = torch.get_num_threads()  # the script sets 1 thread on CPU
    try:
        argv = ["--only-modules", "--smoke", "--device", "cpu", "--no-chart", "--out", tmp_path]
        assert bench_overhead.main([str(a) for a in argv]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "bench_overhead.json").read_text())
    assert [c["name"] for c in data["cases"]] == [
        f"host us per call: {m}" for m in bench_host.MODULES
    ]
    for case in data["cases"]:  # every te row timed (a plain alternative may be missing)
        assert all(r["median_ms"] for r in case["results"] if r["name"].startswith("te."))
    (section,) = data["sections"]
    rows = {(r["module"], r["precision"]): r for r in section["data"]}
    native = ["bf16", "Float8CurrentScaling", "DelayedScaling", "Float8BlockScaling"]
    assert set(native) <= set(bench_host.PRECISIONS)
    assert set(rows) == {(m, p) for m in bench_host.MODULES for p in bench_host.PRECISIONS}
    for row in rows.values():
        for key in ("te_us", "plain_us", "limit_us"):
            assert math.isfinite(row[key]) and row[key] > 0, (row, key)
        assert isinstance(row["met"], bool)
    assert rows[("Linear", "Float8CurrentScaling")]["te_published"].startswith("MXFP8 417-441")
    markdown = (tmp_path / "bench_overhead.md").read_text()
    assert section["markdown"] in markdown
    for module, precision in rows:
        assert f"| {module} | {precision} | " in markdown


@pytest.mark.parametrize("flag", [[], ["--autograd-on-caller"]], ids=["default", "on-caller"])
def test_autograd_on_caller_is_applied_and_recorded(flag):
    """``--autograd-on-caller`` turns autograd's device threads off for the run (the benches'
    rows then all run their backward on the calling thread) and the report's metadata and header
    say so; without it the default is left as it is."""
    parser = harness.add_common_args(argparse.ArgumentParser())
    args = parser.parse_args(["--device", "cpu", *flag])
    with torch.autograd.set_multithreading_enabled(True):  # restores the default after
        harness.resolve_device(args)
        meta = harness.collect_metadata("cpu")
        on_caller = not torch._C._is_multithreading_enabled()
    assert on_caller == bool(flag)
    assert meta["autograd_multithreading"] is not bool(flag)
    header = harness.Report("x", meta).header_markdown()
    assert ("backward on the calling thread" in header) == bool(flag)


def test_counting_on_the_fast_path_leaves_compiled_code_alone():
    """``harness.eager_fast_path_kept`` (kernel counts of eager rows) keeps te's eager calls on
    their fast path under a profiler, and a compiled step profiled inside it neither recompiles
    nor traces the fast path (which dynamo cannot: a graph break at every op). It once swapped
    ``_library._use_fast_path`` for a function without the compile check: the compiled rows
    recompiled while their kernels were counted, broke at every te op and, under FP8, failed."""
    from torch._dynamo.utils import counters

    import te_compile as te
    from bench import harness
    from te_compile import _library

    torch._dynamo.reset()
    counters.clear()
    layer = te.Linear(32, 32, params_dtype=torch.float32)
    x = torch.randn(8, 32, requires_grad=True)
    step = torch.compile(lambda t: layer(t).sum())
    step(x).backward()
    graphs = counters["stats"]["unique_graphs"]
    with torch.profiler.profile():
        assert not _library._use_fast_path()  # profiled: the op path, which profiles name
        with harness.eager_fast_path_kept():
            assert _library._use_fast_path()  # what the helper is for
            step(x).backward()
    assert counters["stats"]["unique_graphs"] == graphs
    assert not counters["graph_break"]
