"""Smoke tests for the runnable examples: each runs as a subprocess with a tiny config."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tqdm")  # the demo's progress bar; installed with the `demo` extra

ROOT = Path(__file__).resolve().parents[1]
TRAIN_GPT = ROOT / "examples" / "train_gpt.py"
TINY = [
    "--device", "cpu", "--steps", "20", "--layers", "1", "--width", "32", "--heads", "2",
    "--block-size", "32", "--batch-size", "8", "--sample-chars", "40",
]  # fmt: skip


def run_train_gpt(*extra: str) -> str:
    result = subprocess.run(
        [sys.executable, str(TRAIN_GPT), *TINY, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"train_gpt.py exited with {result.returncode}:\n{output}"
    return result.stdout


def report(stdout: str, label: str) -> str:
    """The value on the last line of ``stdout`` that starts with ``label:``."""
    matches = re.findall(rf"^{label}:\s+(.+)$", stdout, re.MULTILINE)
    assert matches, f"no '{label}' line in the output:\n{stdout}"
    return matches[-1].strip()


def test_train_gpt_compiles_without_graph_breaks_and_learns():
    stdout = run_train_gpt()
    assert report(stdout, "graph breaks") == "0"
    assert re.search(r"torch\._dynamo\.explain: 1 graph\(s\), 0 graph break\(s\)", stdout)
    # The script exits non-zero if the loss did not fall; check the report agrees.
    assert float(report(stdout, "final val loss")) < float(report(stdout, "initial val loss"))


def test_train_gpt_is_deterministic_given_a_seed():
    runs = [run_train_gpt("--no-compile", "--steps", "5", "--seed", "7") for _ in range(2)]
    for label in ("initial val loss", "final val loss"):
        assert report(runs[0], label) == report(runs[1], label)
    sample = [r.split("sample:\n", 1)[1].split("\n\n", 1)[0] for r in runs]
    assert sample[0] == sample[1]


def test_train_gpt_trains_in_fp8_with_delayed_scaling():
    # Tokens per step (8 x 32) and widths (32, 128) are multiples of 16, as FP8 GEMMs need.
    stdout = run_train_gpt("--recipe", "delayed", "--normalization", "RMSNorm")
    assert report(stdout, "graph breaks") == "0"
    assert float(report(stdout, "final val loss")) < float(report(stdout, "initial val loss"))
