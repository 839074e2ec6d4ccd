"""Activation checkpointing over te_compile modules: ``torch.utils.checkpoint`` recomputes the
forward in the backward with the same results (dropout masks included: checkpoint restores the
RNG state), and selective activation checkpointing chooses what to save by te op name, eagerly
and compiled with ``fullgraph=True``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import te_compile as te
from tests.utils import GraphRecorder, compile_counted


class Block(torch.nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.qkv = te.LayerNormLinear(16, 16)
        self.mlp = te.LayerNormMLP(16, 32, activation="swiglu", normalization="RMSNorm")
        self.dropout = dropout

    def forward(self, x):
        x = x + F.dropout(self.qkv(x), self.dropout, training=True)
        return x + self.mlp(x)


class OpCounter(TorchDispatchMode):
    """Counts te ops by name (``te.linear_fwd.default``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("te."):
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


_GEMMS = (torch.ops.te.linear_fwd.default, torch.ops.te.mlp_fwd.default)


def _save_te_gemms(ctx, op, *args, **kwargs):
    """Keep the GEMM outputs (te::linear_fwd, te::mlp_fwd), recompute the norms."""
    if op in _GEMMS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAC = functools.partial(create_selective_checkpoint_contexts, _save_te_gemms)


def _grads(block, x, run):
    torch.manual_seed(1)  # the dropout masks
    x = x.detach().requires_grad_(True)
    run(block, x).square().sum().backward()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    block.zero_grad()
    return grads


def _plain(block, x):
    return block(x)


def _checkpointed(block, x, context_fn=None):
    kw = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(block, x, use_reentrant=False, **kw)


@pytest.mark.parametrize("context_fn", [None, SAC], ids=["full", "selective"])
def test_checkpoint_recomputes_the_same_gradients_with_dropout(context_fn):
    block = Block(dropout=0.5)
    x = torch.randn(4, 8, 16)
    expected = _grads(block, x, _plain)
    actual = _grads(block, x, functools.partial(_checkpointed, context_fn=context_fn))
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)  # the same ops on the same values


@pytest.mark.parametrize(
    ("context_fn", "recomputed_gemms"), [(None, 1), (SAC, 0)], ids=["full", "selective"]
)
def test_selective_policy_saves_the_te_ops_it_names(context_fn, recomputed_gemms):
    block = Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    with OpCounter() as forward:
        y = _checkpointed(block, x, context_fn)
    with OpCounter() as backward:
        y.sum().backward()
    assert forward.calls["te.linear_fwd.default"] == 1
    assert forward.calls["te.mlp_fwd.default"] == 1
    # The norms are recomputed either way; the GEMMs only without the selective policy.
    assert backward.calls.get("te.linear_fwd.default", 0) == recomputed_gemms
    assert backward.calls.get("te.mlp_fwd.default", 0) == recomputed_gemms
    assert backward.calls["te.layernorm_fwd.default"] == 1
    assert backward.calls["te.rmsnorm_fwd.default"] == 1
    assert backward.calls["te.linear_bwd.default"] == 1
    assert backward.calls["te.mlp_bwd.default"] == 1


def test_compiled_selective_checkpoint_recomputes_norms_not_gemms():
    block = Block()
    x = torch.randn(4, 8, 16)
    expected = _grads(block, x, _plain)
    recorder = GraphRecorder()
    compiled, counter = compile_counted(
        functools.partial(_checkpointed, context_fn=SAC), backend=recorder
    )
    actual = _grads(block, x, compiled)
    assert counter.frame_count == 1
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)
    backward = recorder.backward
    assert {"te.linear_fwd.default", "te.mlp_fwd.default"} <= set(recorder.forward)
    assert "te.linear_fwd.default" not in backward, recorder.summary()
    assert "te.mlp_fwd.default" not in backward, recorder.summary()
    assert {"te.layernorm_fwd.default", "te.rmsnorm_fwd.default"} <= set(backward), (
        recorder.summary()
    )
