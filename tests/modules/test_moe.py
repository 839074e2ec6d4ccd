"""A mixture-of-experts layer built on GroupedMLP: a device-side router produces ``m_splits``,
the training step compiles once with ``fullgraph=True`` and never recompiles or syncs with the
host when the routing changes."""

from __future__ import annotations

import expecttest
import pytest
import torch
from torch import nn

import te_compile as te
from tests.utils import DEVICES, GraphRecorder, assert_close, behaviour_backend, compile_counted

# Ops that copy a device value to the host (a sync on CUDA) or give data-dependent shapes.
HOST_SYNC_OPS = ("_local_scalar_dense", "aten.item", "nonzero", "bincount", "unique", ".tolist")


class MoE(nn.Module):
    """Top-k softmax router -> permute tokens by expert -> GroupedMLP -> weighted combine."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, topk: int = 2, **mlp_kw) -> None:
        super().__init__()
        self.num_experts, self.topk = num_experts, topk
        self.router = nn.Linear(hidden, num_experts, bias=False, device=mlp_kw.get("device"))
        self.experts = te.GroupedMLP(num_experts, hidden, ffn, **mlp_kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, expert = self.router(x).softmax(-1).topk(self.topk, dim=-1)
        flat = expert.flatten()
        order = flat.argsort(stable=True)  # rows grouped by expert
        token = order // self.topk
        # Tokens per expert, on the device (bincount's output size would depend on the data).
        m_splits = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        m_splits = m_splits.index_add_(0, flat, torch.ones_like(flat))
        y = self.experts(x[token], m_splits) * probs.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, token, y)


def _step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = (model(x) - target).square().mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("device", DEVICES)
def test_training_step_compiles_once_and_matches_eager(device):
    torch.manual_seed(0)
    eager = MoE(8, 32, 64, glu_interleave_size=8, device=device)
    compiled_model = MoE(8, 32, 64, glu_interleave_size=8, device=device)
    compiled_model.load_state_dict(eager.state_dict())
    # The forward and (through AOTAutograd) the backward graph are compiled.
    compiled, counter = compile_counted(compiled_model, backend=behaviour_backend(device))
    splits_seen = set()
    for i in range(4):
        x = torch.randn(48, 32, device=device) * (1 + i)
        target = torch.randn(48, 32, device=device)
        with torch.no_grad():  # a different routing every step
            eager.router.weight.normal_()
            compiled_model.router.weight.copy_(eager.router.weight)
            expert = eager.router(x).topk(2, dim=-1).indices.flatten()
            splits_seen.add(tuple(torch.bincount(expert, minlength=8).tolist()))
        for p in (*eager.parameters(), *compiled_model.parameters()):
            p.grad = None
        expected = _step(eager, x, target)
        assert_close(_step(compiled, x, target), expected, torch.float32)
        for p, q in zip(compiled_model.parameters(), eager.parameters(), strict=True):
            assert_close(p.grad, q.grad, torch.float32, reduced=True)
        assert counter.frame_count == 1, "a new token split must not recompile"
    assert len(splits_seen) > 1, "the test must exercise different splits"


class TestMoEGraph(expecttest.TestCase):
    def test_compiled_graph_has_no_host_sync(self):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MoE(4, 16, 32)
        rec = GraphRecorder()
        x = torch.randn(12, 16, requires_grad=True)
        torch.compile(model, backend=rec, fullgraph=True)(x).sum().backward()
        for op in (*rec.forward, *rec.backward):
            assert not any(s in op for s in HOST_SYNC_OPS), f"host sync in the graph: {op}"
        # Only our ops: the aten ops around them decompose differently across torch versions.
        self.assertExpectedInline(
            rec.summary(te_only=True),
            """\
forward:
  te.grouped_linear_fwd.default
  te.gated_activation_fwd.default
  te.grouped_linear_fwd.default
backward:
  auto_functionalized_v2(te.grouped_linear_bwd.default)
  te.gated_activation_bwd.default
  auto_functionalized_v2(te.grouped_linear_bwd.default)""",
        )
