"""Tensor parallelism of the fusible ops (``ops.Linear``, ``ops.BasicLinear`` + ``ops.Bias``
with TE's ``tensor_parallel_mode`` / ``tensor_parallel_group`` / ``sequence_parallel``) on two
ranks (gloo on CPU; NCCL where present) against the single-process ops with the same full
weights: output, input gradient and every parameter gradient (as this rank's shard), eagerly
(fused and unfused) and compiled with ``fullgraph=True``."""

from __future__ import annotations

import functools

import pytest
import torch

from te_compile import ops
from tests.distributed.harness import (
    BACKENDS,
    Case,
    assert_passed,
    compare,
    device_for,
    run_checks,
    spawn_checks,
)
from tests.utils import compile_counted

S, B, H, N = 8, 2, 16, 24


def _seq(width):
    def inputs(device, dtype):
        return torch.randn(S, B, width, device=device, dtype=dtype), ()

    return inputs


def _linear(in_f, out_f, mode, sp, bias=True):
    def build(group, dtype, device):
        tp = {}
        if group is not None:
            tp = {"tensor_parallel_mode": mode, "tensor_parallel_group": group,
                  "sequence_parallel": sp}  # fmt: skip
        op = ops.Linear(in_f, out_f, bias=bias, dtype=dtype, device=device, **tp)
        with torch.no_grad():
            if op.bias is not None:
                op.bias.normal_()
        return op

    return build


def _in_sequential(build, fuse):
    def wrapped(group, dtype, device):
        return ops.Sequential(build(group, dtype, device), ops.GELU(), fuse=fuse)

    return wrapped


def _basic_pair(group, dtype, device):
    """Column BasicLinear + sharded Bias, then row BasicLinear (the Megatron MLP), as basic ops."""
    col, row, bias = {}, {}, {}
    if group is not None:
        col = {"tensor_parallel_mode": "column", "tensor_parallel_group": group}
        row = {"tensor_parallel_mode": "row", "tensor_parallel_group": group}
        bias = {"tensor_parallel": True, "tensor_parallel_group": group}
    seq = ops.Sequential(
        ops.BasicLinear(H, N, dtype=dtype, device=device, **col),
        ops.Bias(N, dtype=dtype, device=device, **bias),
        ops.ReLU(),
        ops.BasicLinear(N, H, dtype=dtype, device=device, **row),
    )
    with torch.no_grad():
        seq[1].bias.normal_()
    return seq


CASES = {
    "linear_column": Case(_linear(H, N, "column", False), None, -1, _seq(H)),
    "linear_row": Case(_linear(N, H, "row", False), -1, None, _seq(N)),
    "linear_column_sp": Case(_linear(H, N, "column", True), 0, -1, _seq(H)),
    "linear_row_sp": Case(_linear(N, H, "row", True), -1, 0, _seq(N)),
    "linear_row_nobias": Case(_linear(N, H, "row", False, bias=False), -1, None, _seq(N)),
    "seq_column_gelu_fused": Case(
        _in_sequential(_linear(H, N, "column", True), True), 0, -1, _seq(H)
    ),
    "seq_row_gelu_fused": Case(_in_sequential(_linear(N, H, "row", True), True), -1, 0, _seq(N)),
    "seq_row_gelu_unfused": Case(_in_sequential(_linear(N, H, "row", True), False), -1, 0, _seq(N)),
    "basic_ops_mlp": Case(_basic_pair, None, None, _seq(H)),
}
COMPILED = ["linear_column_sp", "linear_row_sp", "seq_row_gelu_fused", "basic_ops_mlp"]


def _build(build, dtype, device, group):
    return build(group, dtype, device)


def _compiled(module):
    compiled, _ = compile_counted(module, backend="aot_eager")
    return compiled


def _worker(rank, group, backend):
    device = device_for(backend, rank)
    checks = {}
    for name, case in CASES.items():
        build = functools.partial(_build, case.build, torch.float64, device)
        c = Case(build, case.in_dim, case.out_dim, case.inputs)
        checks[name] = functools.partial(compare, c, rank, group, device, torch.float64)
        if name in COMPILED:
            checks[f"{name}_compiled"] = functools.partial(
                compare, c, rank, group, device, torch.float64, _compiled
            )

    def row_fusion_plan():
        seq = _in_sequential(_linear(N, H, "row", False), True)(group, torch.float64, device)
        # the activation applies after the reduction: only the bias joins the GEMM
        assert seq.fusions() == [
            ("ForwardLinearBiasActivation", ("0.basic_ops.0", "0.basic_ops.1"))
        ]

    def bad_sizes():
        with pytest.raises(ValueError, match="out_features"):
            ops.Linear(H, 3, tensor_parallel_mode="column", tensor_parallel_group=group)
        with pytest.raises(ValueError, match="size"):
            ops.Bias(3, tensor_parallel=True, tensor_parallel_group=group)

    checks["row_fusion_plan"] = row_fusion_plan
    checks["bad_sizes"] = bad_sizes
    return run_checks(checks)


@functools.cache
def _results(backend: str) -> dict:
    return spawn_checks(_worker, backend)


NAMES = [*CASES, *(f"{n}_compiled" for n in COMPILED), "row_fusion_plan", "bad_sizes"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_ops_tensor_parallel_matches_single_process(backend, name):
    assert_passed(_results(backend), name)
