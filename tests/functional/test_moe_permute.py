"""MoE token routing (``te.moe_permute``, ``te.moe_permute_with_probs``, ``te.moe_unpermute``,
``te.moe_sort_chunks_by_index`` and ``_with_probs``; ``te::moe_*``) against a float64 reference
written independently here: the permutation as a stable ``argsort`` of expert ids, unpermute as
a loop of ``index_add_`` over the top-k slots, the chunk sort as ``torch.cat`` of ``split``
chunks. Mask and index maps, dropped and padded rows, merging probabilities, gradients (autograd
of the reference), ``opcheck``, compile with zero graph breaks and no recompile as the routing
changes, bad input."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from tests.utils import DEVICES, assert_close, compile_counted, make_reference_and_test_tensors

TOKENS, EXPERTS, TOPK, HIDDEN = 9, 5, 2, 12


def _routing(tokens=TOKENS, experts=EXPERTS, k=TOPK, device="cpu", seed=0):
    """``(indices [T, K] int32, mask [T, E] bool, probs [T, E] fp32)``: distinct experts per
    token, probabilities on the routed slots only."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    idx = scores.topk(k, dim=1).indices.to(torch.int32)
    mask = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx.long(), True)
    probs = torch.softmax(scores, -1) * mask
    return idx.to(device), mask.to(device), probs.to(device)


# The reference -------------------------------------------------------------------------------


def ref_order(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The permuted order: ``(token, k)`` of each permuted row, by a stable sort of the
    flattened expert ids (expert-major, token order within an expert)."""
    flat = idx.reshape(-1).long().cpu()
    order = torch.argsort(flat, stable=True)
    return order // idx.shape[1], order % idx.shape[1]


def ref_permute(x, idx, num_out, probs_k=None):
    """float64 permuted rows ``[num_out, H]`` (and permuted probs of the ``[T, K]`` slots)."""
    token, k = ref_order(idx)
    token, k = token[:num_out], k[:num_out]
    out = x[token]
    pp = None if probs_k is None else probs_k[token, k]
    if pp is not None:
        out = out * (pp != 0).to(out.dtype)[:, None]
    return out, pp


def ref_unpermute(rows, idx, num_out, probs_k=None):
    """float64: each token's rows summed, weighted by the ``[T, K]`` probabilities."""
    token, k = ref_order(idx)
    token, k = token[:num_out], k[:num_out]
    w = torch.ones(num_out, dtype=rows.dtype) if probs_k is None else probs_k[token, k]
    out = torch.zeros(idx.shape[0], rows.shape[1], dtype=rows.dtype)
    return out.index_add(0, token, rows * w[:, None])


def mask_probs_as_k(probs, idx):
    """``[T, E]`` probabilities as the ``[T, K]`` slots of ``idx``."""
    return probs.gather(1, idx.long().cpu())


def _experts_sorted(idx):
    """For a mask map the slot order within a token is by expert: indices sorted per token
    give the same permutation as the mask."""
    return idx.sort(dim=1).values


# Permute / unpermute -------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("drop", [0, 4], ids=["all", "drop4"])
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_permute_unpermute_match_float64_reference(map_type, drop, dtype, device):
    idx, mask, _ = _routing(device=device)
    num_out = TOKENS * TOPK - drop
    x_ref, x = make_reference_and_test_tensors((TOKENS, HIDDEN), dtype=dtype, device=device)
    routing = mask if map_type == "mask" else idx
    out, row_id_map = te.moe_permute(x, routing, num_out, map_type=map_type)
    sort_idx = _experts_sorted(idx) if map_type == "mask" else idx
    expected, _ = ref_permute(x_ref, sort_idx, num_out)
    assert out.shape == (num_out, HIDDEN) and out.dtype == dtype
    assert_close(out, expected, dtype)
    grad = torch.randn(num_out, HIDDEN).to(dtype)
    out.backward(grad.to(device))
    expected.backward(grad.double())
    assert_close(x.grad, x_ref.grad, dtype, roundings=TOPK)

    # unpermute of fresh rows (the experts' outputs), without probabilities
    rows_ref, rows = make_reference_and_test_tensors((num_out, HIDDEN), dtype=dtype, device=device)
    y = te.moe_unpermute(rows, row_id_map, map_type=map_type, restore_shape=(TOKENS, HIDDEN))
    y_expected = ref_unpermute(rows_ref, sort_idx, num_out)
    assert_close(y, y_expected, dtype, roundings=TOPK)
    g = torch.randn(TOKENS, HIDDEN).to(dtype)
    y.backward(g.to(device))
    y_expected.backward(g.double())
    assert_close(rows.grad, rows_ref.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_unpermute_with_merging_probs_and_gradients(map_type, dtype, device):
    idx, mask, probs = _routing(device=device, seed=1)
    num_out = TOKENS * TOPK - 3
    routing = mask if map_type == "mask" else idx
    _, row_id_map = te.moe_permute(
        torch.randn(TOKENS, HIDDEN, device=device), routing, num_out, map_type=map_type
    )
    sort_idx = _experts_sorted(idx) if map_type == "mask" else idx
    p = probs if map_type == "mask" else mask_probs_as_k(probs.cpu(), idx).to(device)
    p_ref = p.detach().cpu().double().requires_grad_()
    p = p.detach().clone().requires_grad_()
    rows_ref, rows = make_reference_and_test_tensors((num_out, HIDDEN), dtype=dtype, device=device)
    y = te.moe_unpermute(rows, row_id_map, merging_probs=p, map_type=map_type)
    p_k_ref = p_ref if map_type == "index" else p_ref.gather(1, sort_idx.long().cpu())
    y_expected = ref_unpermute(rows_ref, sort_idx, num_out, p_k_ref)
    assert_close(y, y_expected, dtype, roundings=TOPK)
    g = torch.randn(TOKENS, HIDDEN).to(dtype)
    y.backward(g.to(device))
    y_expected.backward(g.double())
    assert_close(rows.grad, rows_ref.grad, dtype)
    assert_close(p.grad, p_ref.grad, dtype, reduced=True)
    # slots never routed (or dropped) get no gradient
    assert torch.all(p.grad.cpu()[row_id_map.cpu() < 0] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_permute_with_probs_pads_and_permutes_probs(device):
    idx, mask, probs = _routing(device=device, seed=2)
    probs = probs.clone()
    t0, e0 = 0, int(idx[0, 0])
    probs[t0, e0] = 0.0  # a routed padding slot: its row is written as 0
    num_out = TOKENS * TOPK
    x_ref, x = make_reference_and_test_tensors((TOKENS, HIDDEN), device=device)
    p_ref = probs.cpu().double().requires_grad_()
    p = probs.clone().requires_grad_()
    out, pp, row_id_map = te.moe_permute_with_probs(x, p, mask, num_out)
    sort_idx = _experts_sorted(idx).cpu()  # the float64 reference lives on the CPU
    exp_out, exp_pp = ref_permute(x_ref, sort_idx, num_out, p_ref.gather(1, sort_idx.long()))
    assert_close(out, exp_out, torch.float32)
    assert_close(pp, exp_pp, torch.float32)
    assert bool((out[row_id_map[t0, e0].long()] == 0).all())
    g, gp = torch.randn(num_out, HIDDEN), torch.randn(num_out)
    torch.autograd.backward((out, pp), (g.to(device), gp.to(device)))
    torch.autograd.backward((exp_out, exp_pp), (g.double(), gp.double()))
    assert_close(x.grad, x_ref.grad, torch.float32, roundings=TOPK)
    assert_close(p.grad, p_ref.grad, torch.float32)
    # unpermute with the probabilities inverts the permute: sum_k p_k x = x * sum_k p_k
    y = te.moe_unpermute(out, row_id_map, merging_probs=probs)
    keep = probs.masked_fill(probs == 0, 0.0).sum(1, keepdim=True)
    assert_close(y, x.detach().double() * keep.double(), torch.float32, roundings=TOPK)


@pytest.mark.parametrize("device", DEVICES)
def test_index_map_keeps_duplicate_and_out_of_order_experts_stable(device):
    idx = torch.tensor([[3, 0], [0, 3], [1, 1], [2, 0]], dtype=torch.int64, device=device)
    x = torch.arange(4.0, device=device)[:, None].expand(4, 3).contiguous()
    out, row_id_map = te.moe_permute(x, idx, map_type="index")
    # expert 0: tokens 0, 1, 3; expert 1: token 2 twice; expert 2: token 3; expert 3: 0, 1
    assert out[:, 0].tolist() == [0, 1, 3, 2, 2, 3, 0, 1]
    assert row_id_map.dtype == torch.int32 and row_id_map.shape == idx.shape
    y = te.moe_unpermute(out, row_id_map, map_type="index")
    torch.testing.assert_close(y, 2 * x)
    # as Transformer Engine reads it, num_out_tokens <= 0 keeps every row for an index map
    for n in (0, -1, None):
        assert te.moe_permute(x, idx, n, map_type="index")[0].shape == (8, 3)
    assert te.moe_permute(x, idx != 0, 0)[0].shape == (0, 3)  # the mask's 0 is 0 rows


# Chunk sort ----------------------------------------------------------------------------------


def ref_sort_chunks(x, sizes, order):
    """The chunks in ``order``; rows past the chunks keep their place."""
    total = sum(sizes)
    chunks = list(torch.split(x[:total], sizes))
    return torch.cat([chunks[i] for i in order] + [x[total:]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("sizes", "order"),
    [([3, 0, 4, 3], [2, 0, 3, 1]), ([10], [0]), ([1, 2, 3, 4], [3, 2, 1, 0]), ([2, 5], [1, 0])],
)
def test_sort_chunks_matches_reference(sizes, order, dtype, device):
    n = 10
    x_ref, x = make_reference_and_test_tensors((n, HIDDEN), dtype=dtype, device=device)
    p_ref, p = make_reference_and_test_tensors((n,), device=device)
    split = torch.tensor(sizes, device=device)
    index = torch.tensor(order, dtype=torch.int32, device=device)
    out, pp = te.moe_sort_chunks_by_index_with_probs(x, p, split, index)
    plain = te.moe_sort_chunks_by_index(x, split, index)
    exp = ref_sort_chunks(x_ref, sizes, order)
    exp_p = ref_sort_chunks(p_ref[:, None], sizes, order)[:, 0]
    assert_close(out, exp, dtype)
    assert torch.equal(plain, out)
    assert_close(pp, exp_p, torch.float32)
    g, gp = torch.randn(n, HIDDEN).to(dtype), torch.randn(n)
    torch.autograd.backward((out, pp), (g.to(device), gp.to(device)))
    torch.autograd.backward((exp, exp_p), (g.double(), gp.double()))
    assert_close(x.grad, x_ref.grad, dtype)
    assert_close(p.grad, p_ref.grad, torch.float32)


# opcheck -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_moe_op(device):
    """The registry test walks these samples too; here the public functions' cases directly."""
    idx, mask, probs = _routing(device=device)
    x = torch.randn(TOKENS, HIDDEN, device=device, requires_grad=True)
    ops = torch.ops.te
    torch.library.opcheck(ops.moe_permute_fwd, (x, mask, probs, TOKENS * TOPK, "mask"))
    torch.library.opcheck(ops.moe_permute_fwd, (x, idx, None, TOKENS * TOPK - 1, "index"))
    _, row_id_map = te.moe_permute(x, idx, map_type="index")
    rows = torch.randn(TOKENS * TOPK, HIDDEN, device=device, requires_grad=True)
    pk = torch.rand(TOKENS, TOPK, device=device, requires_grad=True)
    torch.library.opcheck(ops.moe_unpermute_fwd, (rows, row_id_map, pk))
    grad = torch.randn(TOKENS, HIDDEN, device=device)
    torch.library.opcheck(
        ops.moe_unpermute_bwd, (grad, rows.detach(), row_id_map, pk.detach(), TOKENS * TOPK)
    )
    torch.library.opcheck(ops.moe_permute_bwd, (rows.detach(), None, row_id_map, None))
    split = torch.tensor([4, 0, 5], device=device)
    order = torch.tensor([1, 2, 0], device=device)
    torch.library.opcheck(ops.moe_sort_chunks_fwd, (x, split, order, None))
    torch.library.opcheck(ops.moe_sort_chunks_bwd, (x.detach(), None, split, order))


# torch.compile -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_compiled_no_break_no_recompile_as_routing_changes(map_type, device):
    def layer(x, routing, probs, num_out):
        out, row_id_map = te.moe_permute(x, routing, num_out, map_type=map_type)
        out = out * 2.0
        return te.moe_unpermute(out, row_id_map, merging_probs=probs, map_type=map_type)

    compiled, counter = compile_counted(layer, dynamic=True)
    for seed, tokens in ((0, TOKENS), (1, TOKENS), (2, 13), (3, 7)):
        idx, mask, probs = _routing(tokens=tokens, device=device, seed=seed)
        routing = mask if map_type == "mask" else idx
        p = probs if map_type == "mask" else mask_probs_as_k(probs.cpu(), idx).to(device)
        x = torch.randn(tokens, HIDDEN, device=device, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        y = compiled(x, routing, p, tokens * TOPK)
        y_eager = layer(x_eager, routing, p, tokens * TOPK)
        torch.testing.assert_close(y, y_eager)
        y.sum().backward()
        y_eager.sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_sort_chunks_no_recompile_as_splits_change(device):
    def step(x, split, order):
        return te.moe_sort_chunks_by_index(x, split, order) + 1.0

    compiled, counter = compile_counted(step, dynamic=True)
    for sizes, order in (([3, 0, 4, 3], [2, 0, 3, 1]), ([5, 1, 1, 3], [0, 3, 1, 2])):
        x = torch.randn(10, HIDDEN, device=device)
        split = torch.tensor(sizes, device=device)
        idx = torch.tensor(order, device=device)
        torch.testing.assert_close(compiled(x, split, idx), step(x, split, idx))
    assert counter.frame_count == 1


# Bad input -----------------------------------------------------------------------------------


def _bad_cases():
    idx, mask, probs = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    n = TOKENS * TOPK
    permute = te.moe_permute
    return [
        (permute, (x.int(), mask, n), {}, "inp.dtype must be float32"),
        (permute, (x[0], mask, n), {}, "inp must be 2-D"),
        (permute, (x, mask.float(), n), {}, "routing_map.dtype must be bool or an integer"),
        (permute, (x, idx.float(), n), {"map_type": "index"}, "routing_map.dtype must be int32"),
        (permute, (x, mask[1:], n), {}, r"routing_map must be \[num_tokens, num_experts\]"),
        (
            permute,
            (x, idx[:, 0], n),
            {"map_type": "index"},
            r"routing_map must be \[num_tokens, topK",
        ),
        (permute, (x, mask, TOKENS * EXPERTS + 1), {}, r"num_out_tokens must be in \[0, 45\]"),
        (permute, (x, idx, n + 1), {"map_type": "index"}, r"num_out_tokens must be in \[0, 18\]"),
        (permute, (x, mask), {}, "num_out_tokens must be given for map_type='mask'"),
        (permute, (x, mask, 2.0), {}, "num_out_tokens must be an int"),
        (permute, (x, mask, n), {"map_type": "sparse"}, "map_type must be one of"),
        (te.moe_permute_with_probs, (x, probs[1:], mask, n), {}, r"probs must have shape \[9, 5\]"),
        (te.moe_permute_with_probs, (x, mask, mask, n), {}, "probs.dtype must be a floating"),
    ]


BAD = _bad_cases()


@pytest.mark.parametrize(("fn", "args", "kwargs", "match"), BAD, ids=[c[3] for c in BAD])
def test_bad_permute_arguments_name_the_argument_eager_and_compiled(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda *a: fn(*a, **kwargs), fullgraph=True)(*args)


def _bad_unpermute_cases():
    idx, _, _ = _routing()
    x = torch.randn(TOKENS, HIDDEN)
    rows, row_id_map = te.moe_permute(x, idx, map_type="index")
    un, sort = te.moe_unpermute, te.moe_sort_chunks_by_index
    split, order = torch.tensor([4, 5]), torch.tensor([1, 0])
    return [
        (un, (rows, row_id_map.long()), {}, "row_id_map must be the int32"),
        (un, (rows.int(), row_id_map), {}, "inp.dtype must be float32"),
        (un, (rows, row_id_map), {"map_type": "dense"}, "map_type must be one of"),
        (un, (rows, row_id_map), {"restore_shape": (4, HIDDEN)}, "restore_shape must be"),
        (un, (rows, row_id_map, torch.rand(TOKENS, 3)), {}, r"merging_probs must have shape"),
        (sort, (x, split.float(), order), {}, "split_sizes must be a 1-D int32 or int64"),
        (sort, (x, split, order[:1]), {}, "sorted_index must have one entry per chunk"),
        (sort, (x[0], split, order), {}, "inp must be 2-D"),
    ]


BAD_UNPERMUTE = _bad_unpermute_cases()


@pytest.mark.parametrize(
    ("fn", "args", "kwargs", "match"), BAD_UNPERMUTE, ids=[c[3] for c in BAD_UNPERMUTE]
)
def test_bad_unpermute_and_sort_arguments_eager_and_compiled(fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda *a: fn(*a, **kwargs), fullgraph=True)(*args)


def test_ops_check_their_arguments():
    with pytest.raises(ValueError, match="map_type must be one of"):
        torch.ops.te.moe_permute_fwd(
            torch.randn(2, 3), torch.ones(2, 2, dtype=torch.bool), None, 2, "x"
        )
