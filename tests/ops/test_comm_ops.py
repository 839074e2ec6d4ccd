"""AllGather / ReduceScatter / AllReduce over a real process group (two gloo processes):
forward and backward against the collectives' definitions, eager and compiled (the functional
collectives are in the graph, with no graph break)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from te_compile import ops
from tests.utils import keep_torch_default_device

WORLD = 2


def _x(rank, rows=4):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(rows, 8, generator=g)


def _dy(rank, rows):
    g = torch.Generator().manual_seed(20 + rank)
    return torch.randn(rows, 8, generator=g)


def _fwd_bwd(fn, rank, out_rows):
    x = _x(rank).requires_grad_()
    y = fn(x)
    y.backward(_dy(rank, out_rows))
    # clone(): an eager functional collective returns an AsyncCollectiveTensor, which waits for
    # the collective when an op reads it (pickling it would not).
    return y.detach().clone(), x.grad.clone()


def _worker(rank: int, init_file: str, results) -> None:
    keep_torch_default_device()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        group = dist.group.WORLD
        out = {}
        cases = {
            "all_gather": (ops.AllGather(group), 8),
            "reduce_scatter": (ops.ReduceScatter(group), 2),
            "all_reduce": (ops.AllReduce(group), 4),
        }
        for name, (op, rows) in cases.items():
            out[name] = _fwd_bwd(op, rank, rows)
            torch._dynamo.reset()
            compiled = torch.compile(op, fullgraph=True)
            out[name + "_compiled"] = _fwd_bwd(compiled, rank, rows)
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(ops.Sequential(ops.AllGather(group), ops.ReLU()))(
            _x(rank)
        )
        out["breaks"] = (explanation.graph_count, explanation.graph_break_count)
        out["world_size"] = cases["all_gather"][0].world_size
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_collectives_forward_and_backward_on_two_processes():
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_worker, args=(os.path.join(tmp, "init"), results), nprocs=WORLD, join=True)
        results = dict(results)
    xs = [_x(r) for r in range(WORLD)]
    for rank in range(WORLD):
        res = results[rank]
        assert res["world_size"] == WORLD and res["breaks"] == (1, 0)
        for suffix in ("", "_compiled"):
            # AllGather: concatenation; its gradient is the reduce-scatter of the gradients.
            y, dx = res["all_gather" + suffix]
            assert torch.equal(y, torch.cat(xs))
            dy_sum = sum(_dy(r, 8) for r in range(WORLD))
            torch.testing.assert_close(dx, dy_sum[4 * rank : 4 * rank + 4])
            # ReduceScatter: this rank's rows of the sum; its gradient is the all-gather.
            y, dx = res["reduce_scatter" + suffix]
            torch.testing.assert_close(y, sum(xs)[2 * rank : 2 * rank + 2])
            assert torch.equal(dx, torch.cat([_dy(r, 2) for r in range(WORLD)]))
            # AllReduce: the sum; the gradient passes through unchanged.
            y, dx = res["all_reduce" + suffix]
            torch.testing.assert_close(y, sum(xs))
            assert torch.equal(dx, _dy(rank, 4))
