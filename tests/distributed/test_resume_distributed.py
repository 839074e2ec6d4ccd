"""Save, load, continue on two ranks through ``torch.distributed.checkpoint``: a tensor-parallel
model (its state gathered into full tensors, ``te.distributed.gather_state_dict``) and an FSDP2
model (DTensor state) resume bit for bit, under high precision and delayed scaling.

A rank's tensor-parallel shard is a plain tensor; handed to ``torch.distributed.checkpoint`` as
it is, it would be taken for a replica of the other ranks' shards and only one kept (the test
checks that this indeed loses data, so that the gathered path is the one that matters).
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import te_compile as te
from te_compile.distributed import (
    gather_optimizer_state_dict,
    gather_state_dict,
    shard_optimizer_state_dict,
    shard_state_dict,
)
from te_compile.recipe import DelayedScaling
from tests.distributed.harness import (
    BACKENDS,
    WORLD,
    assert_passed,
    device_for,
    fsdp_mesh,
    run_checks,
    spawn_checks,
)

H = 32
RECIPES = {"none": None, "delayed": DelayedScaling(amax_history_len=4)}


class TPBlock(torch.nn.Module):
    def __init__(self, group, device) -> None:
        super().__init__()
        kw = {"tp_group": group, "device": device}
        self.qkv = te.Linear(H, 3 * H, parallel_mode="column",
                             parameters_split=("query", "key", "value"), **kw)  # fmt: skip
        self.proj = te.Linear(3 * H, H, parallel_mode="row", **kw)
        self.mlp = te.LayerNormMLP(H, 2 * H, activation="swiglu", **kw)

    def forward(self, x):
        x = x + self.proj(torch.tanh(self.qkv(x)))
        return x + self.mlp(x)


def _tp_block(group, device) -> TPBlock:
    """This rank's shard of one full TPBlock (the modules' own initialisation would give every
    rank the same shard, and a shard mixed up with another rank's would go unnoticed)."""
    torch.manual_seed(0)
    model = TPBlock(group, device)
    model.load_state_dict(shard_state_dict(model, TPBlock(None, device).state_dict()))
    return model


def _batch(step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, H, generator=g).to(device)


def _train(model, opt, recipe, steps) -> list[float]:
    losses = []
    for step in steps:
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(_batch(step, next(model.parameters()).device)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _tp_resume(rank, group, device, recipe, path):
    def build():
        model = _tp_block(group, device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    _train(model, opt, recipe, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": gather_state_dict(model, msd), "optim": gather_optimizer_state_dict(model, osd)},
        checkpoint_id=path,
    )
    continued = _train(model, opt, recipe, range(2, 4))

    fresh, fresh_opt = build()
    _train(fresh, fresh_opt, recipe, range(7, 8))  # state of its own, to be replaced
    msd, osd = get_state_dict(fresh, fresh_opt)
    full = {
        "model": gather_state_dict(fresh, msd),
        "optim": gather_optimizer_state_dict(fresh, osd),
    }
    dcp.load(full, checkpoint_id=path)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=shard_state_dict(fresh, full["model"]),
        optim_state_dict=shard_optimizer_state_dict(fresh, full["optim"]),
    )  # fmt: skip
    resumed = _train(fresh, fresh_opt, recipe, range(2, 4))
    assert resumed == continued, (resumed, continued)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def _every_rank(t: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _tp_shards_alone_lose_data(rank, group, device, path):
    """The rank-local state handed to torch.distributed.checkpoint as it is: the shards are
    taken for replicas, one rank's is kept and every rank loads that one back (the reason for
    gather_state_dict). Which rank's is kept is torch's choice."""
    model = _tp_block(group, device)
    dcp.save(model.state_dict(), checkpoint_id=path)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=path)
    own, loaded = model.state_dict()["proj.weight"], state["proj.weight"]
    owns, loadeds = _every_rank(own, group), _every_rank(loaded, group)
    assert not torch.equal(owns[0], owns[1]), "the ranks' shards must differ"
    assert all(torch.equal(t, loadeds[0]) for t in loadeds), "every rank loads the same shard"
    kept = [r for r, t in enumerate(owns) if torch.equal(t, loaded)]
    assert len(kept) == 1, f"expected one rank's shard kept for all; ranks {kept} match"


def _fsdp_resume(rank, group, device, recipe, path):
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            te.LayerNormLinear(H, H, device=device),
            te.LayerNormMLP(H, 2 * H, activation="swiglu", device=device),
        )
        mesh = fsdp_mesh(device)
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    _train(model, opt, recipe, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    continued = _train(model, opt, recipe, range(2, 4))

    fresh, fresh_opt = build()
    _train(fresh, fresh_opt, recipe, range(7, 8))
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    resumed = _train(fresh, fresh_opt, recipe, range(2, 4))
    assert resumed == continued, (resumed, continued)


def _worker(rank, group, backend, root):
    device = device_for(backend, rank)
    checks = {}
    for name, recipe in RECIPES.items():
        checks[f"tp_{name}"] = functools.partial(
            _tp_resume, rank, group, device, recipe, f"{root}/tp_{name}"
        )
        checks[f"fsdp2_{name}"] = functools.partial(
            _fsdp_resume, rank, group, device, recipe, f"{root}/fsdp_{name}"
        )
    checks["tp_shards_alone"] = functools.partial(
        _tp_shards_alone_lose_data, rank, group, device, f"{root}/plain"
    )
    return run_checks(checks)


@functools.cache
def _results(backend):
    with tempfile.TemporaryDirectory() as root:
        return spawn_checks(functools.partial(_worker, root=root), backend)


NAMES = [f"{kind}_{r}" for kind in ("tp", "fsdp2") for r in RECIPES] + ["tp_shards_alone"]


@pytest.mark.skipif(WORLD != 2, reason="written for two ranks")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", NAMES)
def test_distributed_checkpoint_resumes_bit_for_bit(backend, name):
    assert_passed(_results(backend), name)
