"""The harness counts every rank: a check that fails on rank 1 only fails its test, naming rank 1.

One gloo process group on the CPU runs planted failures (a plain assertion on rank 1 only, and a
tensor-parallel ``te.Linear`` whose weight gradient is doubled on rank 1 only) next to their
unplanted twins."""

from __future__ import annotations

import functools

import pytest
import torch

import te_compile as te
from tests.distributed.harness import (
    WORLD,
    Case,
    assert_passed,
    compare,
    merge_reports,
    run_checks,
    spawn_checks,
)

S, B, H, OUT = 4, 2, 8, 12


def _fail_on(ranks, rank):
    assert rank not in ranks, f"planted failure on rank {rank}"


def _linear(mode, doubled_on, rank, group):
    m = te.Linear(H if mode == "column" else OUT, OUT if mode == "column" else H,
                  parallel_mode=mode, tp_group=group, params_dtype=torch.float64)  # fmt: skip
    if group is not None and rank in doubled_on:
        m.weight.register_hook(lambda g: g * 2)
    return m


def _inputs(width):
    def inputs(device, dtype):
        return torch.randn(S, B, width, device=device, dtype=dtype), ()

    return inputs


def _worker(rank, group, backend):
    checks = {
        "passes": lambda: None,
        "fails_on_rank_1": functools.partial(_fail_on, {1}, rank),
        "fails_on_every_rank": functools.partial(_fail_on, set(range(WORLD)), rank),
    }
    for mode, in_dim, out_dim, width in (("column", None, -1, H), ("row", -1, None, OUT)):
        for name, doubled_on in (("", set()), ("_wgrad_doubled_on_rank_1", {1})):
            build = functools.partial(_linear, mode, doubled_on, rank)
            case = Case(build, in_dim, out_dim, _inputs(width))
            checks[f"linear_{mode}{name}"] = functools.partial(
                compare, case, rank, group, torch.device("cpu"), torch.float64
            )
    return run_checks(checks)


@functools.cache
def _report():
    return spawn_checks(_worker, "gloo")


def _failure(name):
    with pytest.raises(pytest.fail.Exception) as info:
        assert_passed(_report(), name)
    return str(info.value)


@pytest.mark.parametrize("name", ["passes", "linear_column", "linear_row"])
def test_checks_that_pass_on_every_rank_pass(name):
    assert_passed(_report(), name)


def test_a_failure_on_rank_1_only_fails_naming_rank_1():
    message = _failure("fails_on_rank_1")
    assert message.startswith("rank 1: fails_on_rank_1: Traceback"), message
    assert "planted failure on rank 1" in message
    assert "rank 0" not in message


def test_a_failure_on_every_rank_lists_every_rank():
    message = _failure("fails_on_every_rank")
    for rank in range(WORLD):
        assert f"rank {rank}: fails_on_every_rank: Traceback" in message, message
        assert f"planted failure on rank {rank}" in message


@pytest.mark.parametrize("mode", ["column", "row"])
def test_tensor_parallel_linear_with_a_wrong_weight_gradient_on_rank_1_only_fails(mode):
    name = f"linear_{mode}_wgrad_doubled_on_rank_1"
    message = _failure(name)
    assert message.startswith(f"rank 1: {name}: Traceback"), message
    assert "gradient of weight" in message
    assert "rank 0" not in message


def test_merge_reports():
    merged = merge_reports([{"a": None, "b": None, "c": "boom"}, {"a": None, "b": "bad"}])
    assert merged == {
        "a": None,
        "b": "rank 1: b: bad",
        "c": "rank 0: c: boom\nrank 1: c: not reported by this rank",
    }


def test_a_check_that_was_not_run_fails():
    with pytest.raises(pytest.fail.Exception, match="no check named 'missing'"):
        assert_passed({"a": None}, "missing")
