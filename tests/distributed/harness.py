"""Run a function on ``WORLD`` ranks (2; ``TE_COMPILE_TEST_WORLD=4`` for all GPUs of a 4-GPU
machine) spawned by the test itself, and compare a tensor-parallel module
with the single-process module of the same (full) weights.

``spawn(worker, backend)`` starts ``WORLD`` processes (torch.multiprocessing, ``spawn`` start
method, a FileStore rendezvous in a temporary directory: no port to pick), runs
``worker(rank, group, backend)`` in each with the process group initialised, and returns every
rank's result as a list indexed by rank; an exception on any rank fails the test with that
rank's traceback. Workers return ``{check name: None or failure message}`` (``run_checks``) so
that one process group serves many checks (each spawn costs a few seconds of interpreter and
torch start-up on the CI's two cores); ``spawn_checks`` merges the reports of all ranks into one
(a check passes when it passed on every rank; its message names each rank it failed on, as
``rank 1: <check>: <traceback>``), and ``assert_passed(report, name)`` fails a test with that
message. Every rank counts: a result that is wrong on rank 1 only fails the test.

gloo on CPU runs everywhere; NCCL needs ``WORLD`` CUDA GPUs (``BACKENDS`` skips it otherwise).
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from te_compile.distributed import shard_state_dict
from tests.mutation import plant
from tests.utils import assert_close, chain_roundings, keep_torch_default_device

WORLD = int(os.environ.get("TE_COMPILE_TEST_WORLD", "2"))
# A check that fails on one rank only leaves the other waiting in a collective: fail after this
# instead of hanging the test run.
TIMEOUT = datetime.timedelta(seconds=90)

BACKENDS = [
    pytest.param("gloo", id="gloo"),
    pytest.param(
        "nccl",
        id="nccl",
        marks=pytest.mark.skipif(
            not (torch.cuda.is_available() and torch.cuda.device_count() >= WORLD),
            reason=f"needs {WORLD} CUDA GPUs for NCCL; this machine has "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}",
        ),
    ),
]


def device_for(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def fsdp_mesh(device: torch.device):
    """The 1-D DeviceMesh over all ranks on ``device``'s type, for ``fully_shard(mesh=...)``.

    ``fully_shard`` without a mesh builds one on CUDA whenever CUDA is available, even when the
    process group is gloo and the model is on the CPU: it then moves the parameters to the GPU
    and runs gloo collectives on CUDA tensors (a spawned rank died with SIGSEGV on a GPU host)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (WORLD,))


def _entry(rank, worker, backend, init_file, results, errors) -> None:
    keep_torch_default_device()
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=TIMEOUT
    )
    try:
        plant.apply_from_env()  # a bug planted by tests/test_mutations.py, if any
        torch.manual_seed(0)  # fresh processes do not start from the same RNG state
        results[rank] = worker(rank, dist.group.WORLD, backend)
    except BaseException:
        errors[rank] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    # The results are with the parent (the manager's dicts); leave without the interpreter's
    # shutdown, where a rank once aborted ("terminate called without an active exception": a
    # native thread still joinable at exit, a passing check reported as a crash).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable[[int, Any, str], Any], backend: str) -> list[Any]:
    """``worker(rank, group, backend)`` on ``WORLD`` processes; every rank's return value, in
    rank order."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results, errors = manager.dict(), manager.dict()
        mp.spawn(
            _entry,
            args=(worker, backend, os.path.join(tmp, "init"), results, errors),
            nprocs=WORLD,
            join=True,
        )
        errors, results = dict(errors), dict(results)
    if errors:
        pytest.fail("\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    missing = [r for r in range(WORLD) if r not in results]
    if missing:
        pytest.fail(f"ranks {missing} returned no result")
    return [results[r] for r in range(WORLD)]


Report = dict[str, str | None]


def merge_reports(reports: Sequence[Report]) -> Report:
    """One report from every rank's (``reports[rank]``): a check passes when it passed on every
    rank; otherwise its message lists each rank it failed on, ``rank r: <check>: <message>``. A
    check that some rank did not report fails on that rank."""
    names = list(dict.fromkeys(name for report in reports for name in report))
    merged: Report = {}
    for name in names:
        failures = []
        for rank, report in enumerate(reports):
            if name not in report:
                failures.append(f"rank {rank}: {name}: not reported by this rank")
            elif report[name] is not None:
                failures.append(f"rank {rank}: {name}: {report[name]}")
        merged[name] = "\n".join(failures) if failures else None
    return merged


def spawn_checks(worker: Callable[[int, Any, str], Report], backend: str) -> Report:
    """``spawn`` of a worker that returns ``run_checks``'s report: every rank's report merged
    (``merge_reports``)."""
    reports = spawn(worker, backend)
    for rank, report in enumerate(reports):
        if not isinstance(report, dict):
            pytest.fail(f"rank {rank} returned {type(report).__name__}, not a report dict")
    return merge_reports(reports)


def assert_passed(report: Report, name: str) -> None:
    """Fail unless check ``name`` passed on every rank (``spawn_checks``'s report), with every
    failing rank's message."""
    if name not in report:
        pytest.fail(f"no check named {name!r} was run; the report has {sorted(report)}")
    if report[name] is not None:
        pytest.fail(report[name], pytrace=False)


def run_checks(checks: dict[str, Callable[[], None]]) -> Report:
    """Run every check; ``{name: None}`` when it passed, else its exception text."""
    report: Report = {}
    for name, check in checks.items():
        try:
            check()
            report[name] = None
        except Exception:
            report[name] = traceback.format_exc()
    return report


def _shard(t: torch.Tensor, dim: int | None, rank: int) -> torch.Tensor:
    return t if dim is None else t.chunk(WORLD, dim=dim)[rank].contiguous()


@dataclass
class Case:
    """A module built twice: ``build(tp_group)`` with the group, ``build(None)`` without.

    ``in_dim``/``out_dim``: the dim along which the tensor-parallel module's input/output is
    this rank's shard of the single-process one (None: replicated). ``inputs(device, dtype)``
    builds the full input and any extra forward arguments (the same on every rank)."""

    build: Callable[[Any], torch.nn.Module]
    in_dim: int | None
    out_dim: int | None
    inputs: Callable[[torch.device, torch.dtype], tuple[torch.Tensor, tuple]]
    roundings: int = 1
    extra: dict = field(default_factory=dict)


def compare(
    case: Case,
    rank: int,
    group: Any,
    device: torch.device,
    dtype: torch.dtype,
    compile_fn: Callable[[torch.nn.Module], Callable] | None = None,
) -> torch.nn.Module:
    """Forward output, input gradient and every parameter gradient of the tensor-parallel
    module against the single-process module with the same full weights (the gradients as this
    rank's shards). ``compile_fn`` wraps the tensor-parallel module (e.g. torch.compile)."""
    torch.manual_seed(0)  # the same full weights, inputs and output gradients on every rank
    full = case.build(None).to(device)
    tp = case.build(group).to(device)
    tp.load_state_dict(shard_state_dict(tp, full.state_dict()))
    x, extra = case.inputs(device, dtype)
    x.requires_grad_(True)
    y = full(x, *extra)
    dy = torch.randn_like(y)
    y.backward(dy)

    x_tp = _shard(x.detach(), case.in_dim, rank).requires_grad_(True)
    run = tp if compile_fn is None else compile_fn(tp)
    y_tp = run(x_tp, *extra)
    y_tp.backward(_shard(dy, case.out_dim, rank))

    kw = {"roundings": chain_roundings(dtype, case.roundings)}
    assert_close(y_tp, _shard(y.detach(), case.out_dim, rank), dtype, **kw)
    assert_close(x_tp.grad, _shard(x.grad, case.in_dim, rank), dtype, **kw)
    full_grads = {n: p.grad for n, p in full.named_parameters()}
    sharded = shard_state_dict(tp, full_grads)
    for name, p in tp.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        try:
            assert_close(p.grad, sharded[name], dtype, reduced=True, **kw)
        except AssertionError as err:
            raise AssertionError(f"gradient of {name}: {err}") from None
    return tp
