"""Delayed-scaling amaxes are max-reduced over the amax reduction group (two gloo processes)."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import te_compile as te
from tests.utils import keep_torch_default_device


def _worker(rank: int, world: int, init_file: str, results) -> None:
    keep_torch_default_device()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same weights on both ranks
        m = te.Linear(32, 16, params_dtype=torch.bfloat16)
        recipe = te.recipe.DelayedScaling(amax_history_len=4)
        compiled = torch.compile(m, fullgraph=True)
        for _ in range(2):
            # Rank-dependent inputs and gradients: rank 1's amaxes are 3x rank 0's.
            x = torch.full((16, 32), float(1 + 2 * rank), dtype=torch.bfloat16)
            with te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                y = compiled(x)
            y.backward(torch.full_like(y, float(1 + 2 * rank)))
        # Step 1's forward folded in step 0's amaxes (input and gradient), reduced.
        results[rank] = (m.fp8_meta.amax_history[0].tolist(), m.fp8_meta.fwd_amax.tolist())
    finally:
        dist.destroy_process_group()


def test_amaxes_are_max_reduced_over_the_group():
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        (hist0, fwd0), (hist1, fwd1) = results[0], results[1]
    assert hist0 == hist1 and fwd0 == fwd1, "every rank must see the same reduced amaxes"
    assert hist0[0] == 3.0 and fwd0[0] == 3.0  # the input amax is rank 1's
    assert hist0[2] == 3.0  # the gradient amax, reduced when folded into the history
