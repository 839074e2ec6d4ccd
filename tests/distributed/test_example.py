"""Smoke test of examples/tensor_parallel.py under torchrun: two CPU processes with gloo, tiny
sizes (the same script runs NCCL on GPUs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "tensor_parallel.py"
TINY = ["--steps", "8", "--warmup", "2", "--layers", "1", "--width", "32", "--heads", "2",
        "--seq-len", "16", "--batch-size", "4", "--lr", "1e-2"]  # fmt: skip


def run_example(*extra: str, nproc: int = 2) -> str:
    # This checkout, on CPU; unbuffered, so every rank's lines reach the pipe as printed.
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone", str(SCRIPT), *TINY, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"tensor_parallel.py exited with {result.returncode}:\n{output}"
    return result.stdout


def report(stdout: str, label: str) -> str:
    matches = re.findall(rf"^{label}:\s+(.+)$", stdout, re.MULTILINE)
    assert matches, f"no '{label}' line in the output:\n{stdout}"
    return matches[-1].strip()


@pytest.mark.long_compile  # compiled on two ranks; see the eager run below, test_tensor_parallel.py
def test_compiled_tensor_and_sequence_parallel_with_profile():
    stdout = run_example("--tp", "2", "--sequence-parallel", "--profile")
    assert re.search(r"graphs compiled: 1 .*; graph breaks: 0$", stdout, re.M), stdout
    first, last = (float(v) for v in re.search(r"loss: (\S+) -> (\S+)", stdout).groups())
    assert last < first
    assert float(report(stdout, "tokens/s")) > 0
    busy = float(report(stdout, "comm fraction"))
    assert 0 < busy < 1
    assert 0 < float(report(stdout, "exposed comm fraction")) <= busy
    for rank in range(2):
        assert re.search(rf"^rank {rank}: tokens/s [\d,]+, peak memory [\d,.]+ MiB", stdout, re.M)


def test_fsdp2_with_fp8_delayed_scaling_eager():
    stdout = run_example("--dp", "2", "--recipe", "delayed", "--no-compile")
    assert "tp=1 dp=2" in stdout and "recipe=delayed" in stdout
    first, last = (float(v) for v in re.search(r"loss: (\S+) -> (\S+)", stdout).groups())
    assert last < first


def test_tensor_parallel_trains_the_same_model_as_one_process():
    """Every rank initialises its shard of the same full model, so TP=2 with sequence
    parallelism follows TP=1's loss curve (printed to 4 decimals)."""
    losses = {}
    for nproc, extra in ((1, ()), (2, ("--tp", "2", "--sequence-parallel"))):
        stdout = run_example("--no-compile", *extra, nproc=nproc)
        found = re.search(r"^loss: (\S+ -> \S+)", stdout, re.M)
        assert found, f"no loss line from {nproc} process(es):\n{stdout}"
        losses[nproc] = found.group(1)
    assert losses[1] == losses[2]


def test_bad_mesh_is_reported():
    example = load_script("tensor_parallel_example", SCRIPT)
    args = example.parse_args([*TINY, "--tp", "2", "--dp", "2"])
    with pytest.raises(SystemExit, match=r"--tp \(2\) x --dp \(2\) must equal the number of"):
        example.check_args(args, world=2)
    args = example.parse_args([*TINY, "--tp", "2", "--recipe", "delayed", "--width", "48"])
    with pytest.raises(SystemExit, match=r"FP8 GEMMs need --width / --tp \(24\) to be a multiple"):
        example.check_args(args, world=2)
    args = example.parse_args([*TINY, "--tp", "2", "--vocab", "101"])
    with pytest.raises(SystemExit, match=r"--vocab \(101\) must be divisible by --tp \(2\)"):
        example.check_args(args, world=2)


def test_comm_fraction_interval_arithmetic():
    """Concurrent collectives count once (their union), and the exposed part is what no other
    kernel overlaps: a sum of kernel times exceeded the wall time on 4 GPUs."""
    example = load_script("tensor_parallel_example", SCRIPT)
    comm = example._merge([(0, 4), (2, 6), (10, 12), (11, 11.5)])
    assert comm == [(0, 6), (10, 12)]
    assert example._length(comm) == 8
    other = example._merge([(5, 11), (1, 2)])
    assert example._overlap(comm, other) == 1 + 1 + 1  # (1, 2), (5, 6), (10, 11)
    assert example._overlap(comm, []) == 0
