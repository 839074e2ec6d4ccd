"""The MoE routing Triton kernel (``te_compile.kernels.moe``) against the CPU implementation of
``te_compile.functional.moe`` run in float64: the weighted row gather alone (empty slots, rows
with no slot, odd hidden sizes with small channel tiles) and every ``te::moe_*`` op's CUDA path
(the op's row movement through the kernel) for fp32 / bf16 / fp16. Run on CUDA, or on CPU
tensors with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.utils import TRITON_DEVICE, assert_close, chain_roundings, requires_triton

kernels = pytest.importorskip("te_compile.kernels.moe")
ref = importlib.import_module("te_compile.functional.moe")

pytestmark = [pytest.mark.triton, requires_triton]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("block_h", [None, 4], ids=["default", "block4"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_sum_matches_reference(dtype, weighted, block_h):
    x = torch.randn(7, 13).to(dtype)
    index = torch.tensor([[0, 3, -1], [-1, -1, -1], [6, 1, 2], [5, -1, 4]], dtype=torch.int32)
    weight = torch.rand(4, 3) if weighted else None
    out = kernels.gather_sum(
        x.to(TRITON_DEVICE),
        index.to(TRITON_DEVICE),
        None if weight is None else weight.to(TRITON_DEVICE),
        block_h=block_h,
    )
    xd = x.double()
    w = torch.ones(4, 3, dtype=torch.float64) if weight is None else weight.double()
    expected = torch.stack(
        [
            sum((w[r, s] * xd[i] for s, i in enumerate(index[r].tolist()) if i >= 0), xd[0] * 0)
            for r in range(4)
        ]
    )
    assert out.dtype == dtype and out.shape == (4, 13)
    assert_close(out, expected, dtype, roundings=chain_roundings(dtype, 3))


def _routing(tokens=9, experts=5, k=2):
    scores = torch.rand(tokens, experts)
    idx = scores.topk(k, dim=1).indices.to(torch.int32)
    mask = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx.long(), True)
    return idx, mask, torch.softmax(scores, -1) * mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_op_paths_through_the_kernel_match_the_cpu_implementation(map_type, dtype, monkeypatch):
    # The ops take the Triton path for tensors of the Triton device; on CPU under the
    # interpreter the test sends them there by declaring the CPU a Triton device.
    monkeypatch.setattr(ref, "runs_triton", lambda x: x.dtype != torch.float64)
    idx, mask, probs = _routing()
    routing = mask if map_type == "mask" else idx
    p = probs if map_type == "mask" else probs.gather(1, idx.long())
    n = 15
    x = torch.randn(9, 12).to(dtype)
    dev = TRITON_DEVICE
    out, row_id_map, _ = ref.moe_permute_fwd.eager(x.to(dev), routing.to(dev), None, n, map_type)
    exp_out, exp_map, _ = ref.moe_permute_ref(x.double(), routing, None, n, map_type)
    assert torch.equal(row_id_map.cpu(), exp_map)
    assert_close(out, exp_out, dtype)
    y = ref.moe_unpermute_fwd.eager(out, row_id_map, p.to(dev))
    assert_close(y, ref.moe_unpermute_ref(exp_out, exp_map, p.double()), dtype, roundings=2)
    g = torch.randn(9, 12).to(dtype)
    gi, gp = ref.moe_unpermute_bwd.eager(g.to(dev), out, row_id_map, p.to(dev), n)
    egi, egp = ref.moe_unpermute_bwd_ref(g.double(), exp_out, exp_map, p.double(), n)
    assert_close(gi, egi, dtype)
    assert_close(gp, egp, torch.float32, roundings=2, reduced=True)
    gb, _ = ref.moe_permute_bwd.eager(out, None, row_id_map, None)
    egb, _ = ref.moe_permute_bwd_ref(exp_out, None, exp_map, None)
    assert_close(gb, egb, dtype, roundings=2)
    split = torch.tensor([3, 0, 4, 2], device=dev)
    order = torch.tensor([2, 0, 3, 1], device=dev)
    s, _ = ref.moe_sort_chunks_fwd.eager(x.to(dev), split, order, None)
    es, _ = ref.moe_sort_chunks_ref(x.double(), split.cpu(), order.cpu(), None)
    assert_close(s, es, dtype)
    sb, _ = ref.moe_sort_chunks_bwd.eager(s, None, split, order)
    assert_close(sb, x.double(), dtype)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_a_compacted_wide_map_gives_the_same_sums(weighted):
    """A mask-wide row_id_map (9 slots, most empty; a token with none, one with all): each
    token's routed slots move to its first columns in slot order, the kernel reads ``count``
    of them, and the sums equal the uncompacted map's."""
    tokens, slots = 6, 9
    routed = torch.rand(tokens, slots) < 0.3
    routed[0] = False
    routed[1] = True
    rows = int(routed.sum())
    row_id_map = torch.full((tokens, slots), -1, dtype=torch.int32)
    row_id_map[routed] = torch.randperm(rows, dtype=torch.int32)
    weight = torch.rand(tokens, slots) if weighted else None
    index, w, count = ref._compact(row_id_map, weight)
    for t in range(tokens):
        kept = row_id_map[t][routed[t]]
        assert int(count[t]) == kept.numel()
        assert torch.equal(index[t, : kept.numel()], kept)
        assert bool((index[t, kept.numel() :] == -1).all())
        if weighted:
            assert torch.equal(w[t, : kept.numel()], weight[t][routed[t]])
    x = torch.randn(rows, 11)
    dev = TRITON_DEVICE
    out = kernels.gather_sum(
        x.to(dev), index.to(dev), None if w is None else w.to(dev), count.to(dev), block_h=4
    )
    expected = ref.moe_unpermute_ref(x.double(), row_id_map, None if w is None else weight.double())
    assert_close(out, expected, torch.float32, roundings=3)
    # Slots past a row's count are not read: a count of 0 gives a zero row.
    out = kernels.gather_sum(x.to(dev), index.to(dev), None, torch.zeros_like(count).to(dev))
    assert bool((out == 0).all())


@pytest.mark.parametrize("block_h", [None, 4], ids=["default", "block4"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_dot_matches_reference(dtype, block_h):
    """The unpermute backward's one pass: each row its token's gradient times a weight, and
    that gradient's dot with the row of the forward input; a row with no token is 0."""
    g = torch.randn(5, 13).to(dtype)
    x = torch.randn(6, 13).to(dtype)
    index = torch.tensor([4, -1, 0, 2, 2, 1], dtype=torch.int32)
    weight = torch.rand(6)
    dev = TRITON_DEVICE
    out, dot = kernels.gather_dot(
        g.to(dev), index.to(dev), weight.to(dev), x.to(dev), block_h=block_h
    )
    exp_out, exp_dot = ref._gather_dot_ref(g.double(), index.long(), weight.double(), x.double())
    assert out.dtype == dtype and dot.dtype == torch.float32
    assert_close(out, exp_out, dtype)
    assert_close(dot[index >= 0], exp_dot[index >= 0], torch.float32, roundings=13, reduced=True)
    assert float(dot[1]) == 0.0
