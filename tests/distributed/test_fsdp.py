"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over te_compile modules on two ranks (gloo on
CPU; NCCL on two GPUs where present), in torchtitan's order: activation checkpointing, then
``torch.compile(fullgraph=True)`` per block, then ``fully_shard`` per block and on the root.

Each rank trains on its half of the global batch; the parameters after a few SGD steps equal
those of the single-process model trained on the whole batch (FSDP2 averages the gradients).
The modules hold plain ``nn.Parameter``s, so nothing here is specific to te_compile.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import te_compile as te
from tests.distributed.harness import (
    BACKENDS,
    WORLD,
    assert_passed,
    device_for,
    fsdp_mesh,
    run_checks,
    spawn_checks,
)
from tests.utils import assert_close

H, BATCH, STEPS = 16, 8, 3


class Block(torch.nn.Module):
    def __init__(self, device) -> None:
        super().__init__()
        self.qkv = te.LayerNormLinear(H, H, device=device)
        self.proj = te.Linear(H, H, device=device)
        self.mlp = te.LayerNormMLP(H, 2 * H, activation="swiglu", device=device)

    def forward(self, x):
        x = x + self.proj(torch.tanh(self.qkv(x)))
        return x + self.mlp(x)


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(device), Block(device), te.LayerNorm(H, device=device))


def _save_gemms(ctx, op, *args, **kwargs):
    if op is torch.ops.te.linear_fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _train(model, batches, rank=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x in batches:
        if rank is not None:
            x = x.chunk(WORLD)[rank]
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _fsdp(rank, device, selective_ac):
    torch.manual_seed(1)  # the same global batches on every rank
    batches = [torch.randn(BATCH, 4, H, device=device) for _ in range(STEPS)]
    reference = _model(device)
    _train(reference, batches)

    model = _model(device)
    mesh = fsdp_mesh(device)
    counter = torch._dynamo.testing.CompileCounter()
    for i, block in enumerate(model[:2]):
        if selective_ac:
            context_fn = functools.partial(create_selective_checkpoint_contexts, _save_gemms)
            block = checkpoint_wrapper(block, context_fn=context_fn)
            model[i] = block
        block.compile(fullgraph=True, backend=counter)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, batches, rank)

    assert counter.frame_count == 2, f"one graph per block, got {counter.frame_count}"
    state = model.state_dict()
    for name, expected in reference.state_dict().items():
        key = name if name in state else name.replace(".", "._checkpoint_wrapped_module.", 1)
        assert_close(state[key].full_tensor(), expected, torch.float32, roundings=STEPS)
    pairs = zip(reference.parameters(), _model(device).parameters(), strict=True)
    assert all(not torch.equal(p, q) for p, q in pairs), "training must change every parameter"


def _worker(rank, group, backend):
    device = device_for(backend, rank)
    return run_checks(
        {
            "fsdp2_compiled_blocks": functools.partial(_fsdp, rank, device, False),
            "fsdp2_compiled_blocks_selective_ac": functools.partial(_fsdp, rank, device, True),
        }
    )


@functools.cache
def _results(backend):
    return spawn_checks(_worker, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["fsdp2_compiled_blocks", "fsdp2_compiled_blocks_selective_ac"])
def test_fsdp2_matches_single_process_training(backend, name):
    assert_passed(_results(backend), name)
