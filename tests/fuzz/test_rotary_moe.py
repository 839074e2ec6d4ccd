"""Fuzz tests of rotary embeddings and MoE token routing against float64 and index references
(``common``)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

import te_compile as te
from tests.fuzz.common import (
    DTYPES,
    FUZZ,
    SEED,
    _rotate,
)
from tests.utils import assert_close, capped_dtype, to_reference


@FUZZ
@given(seed=SEED, dtype=DTYPES, fmt=st.sampled_from(["sbhd", "bshd", "thd"]),
       interleaved=st.booleans(), fused=st.booleans(), seq=st.integers(1, 12),
       batch=st.integers(1, 3), heads=st.integers(1, 3), half=st.integers(1, 8),
       extra=st.integers(0, 5), percent=st.sampled_from([1.0, 0.5]), offset=st.integers(0, 6),
       base=st.sampled_from([10000.0, 500.0]), interp=st.sampled_from([None, (2.0, 4), (0.5, 64)]),
       data=st.data())  # fmt: skip
def test_rotary(seed, dtype, fmt, interleaved, fused, seq, batch, heads, half, extra, percent,
                offset, base, interp, data):  # fmt: skip
    """``te.RotaryPositionEmbedding`` (``te.functional.rotary_frequencies``: base, partial
    rotation, offset, position interpolation, both frequency layouts) and
    ``te.apply_rotary_pos_emb`` in every tensor format (``thd``: random packed sequences, tokens
    past the last one unrotated), fused or not, against ``x cos f + rotate(x) sin f``."""
    torch.manual_seed(seed)
    dtype = capped_dtype(dtype, 2 if fused else 4)  # the gradient of freqs: 4 roundings
    dim = 2 * half if percent == 1.0 else 4 * half
    factor, pretrained = interp or (None, None)
    rope = te.RotaryPositionEmbedding(dim, rotary_percent=percent, rotary_base=base,
                                      interleaved=interleaved, seq_len_interpolation_factor=factor,
                                      pretrained_max_position_embeddings=pretrained)  # fmt: skip
    length = seq + data.draw(st.integers(0, 3), label="extra positions")
    freqs = rope(length, offset)
    pos = torch.arange(length, dtype=torch.float64) + offset
    if interp is not None:
        pos = pos / (length / pretrained if length > pretrained * factor else factor)
    angles = pos[:, None] * rope.inv_freq.double()[None, :]
    angles = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    assert freqs.shape == (length, 1, 1, 2 * (dim * percent // 2)) and freqs.dtype == torch.float32
    assert_close(freqs.squeeze(1).squeeze(1), angles, torch.float32, roundings=2)

    head_dim = dim + extra
    if fmt == "thd":
        lengths = data.draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
        bounds = [0, *itertools.accumulate(lengths)]
        cu = torch.tensor(bounds, dtype=torch.int32)
        total = bounds[-1] + data.draw(st.integers(0, 2), label="tokens in no sequence")
        shape, positions = (total, heads, head_dim), torch.full((total,), -1)
        for a, b in itertools.pairwise(bounds):
            positions[a:b] = torch.arange(b - a)
    else:
        cu = None
        shape = (seq, batch, heads, head_dim) if fmt == "sbhd" else (batch, seq, heads, head_dim)
        positions = torch.arange(seq)
    x = torch.randn(shape).to(dtype).requires_grad_()
    f_in = freqs.detach().requires_grad_(not fused)
    y = te.apply_rotary_pos_emb(x, f_in, fmt, interleaved=interleaved, fused=fused, cu_seqlens=cu)
    x_ref, f_ref = to_reference(x), to_reference(f_in)
    f_tok = f_ref.squeeze(1).squeeze(1)[positions.clamp(min=0)]  # [s or t, d2]
    if fmt == "sbhd":
        f_tok = f_tok[:, None, None]
    elif fmt == "bshd":
        f_tok = f_tok[None, :, None]
    else:
        f_tok = f_tok[:, None] * (positions >= 0)[:, None, None]  # unrotated: angle 0
    d2 = f_tok.shape[-1]
    rot = x_ref[..., :d2]
    y_ref = torch.cat((rot * f_tok.cos() + _rotate(rot, interleaved) * f_tok.sin(),
                       x_ref[..., d2:]), -1)  # fmt: skip
    assert_close(y, y_ref, dtype, roundings=2)
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    assert_close(x.grad, x_ref.grad, dtype, roundings=2)
    if not fused:  # autograd differentiates freqs too: a sum over tokens and heads
        assert_close(f_in.grad, f_ref.grad, dtype, roundings=4, reduced=True)


def _route_ref(routing_map, map_type):
    """``(token, slot)`` of each permuted row in order: experts ascending, tokens in order (for
    indices the stable sort of the flattened ``[T * K]`` ids)."""
    if map_type == "mask":
        expert, token = routing_map.t().nonzero(as_tuple=True)
        return token, expert
    order = torch.argsort(routing_map.flatten(), stable=True)
    k = routing_map.shape[1]
    return order // k, order % k


def _permute_ref(x, token, keep, rows, weight=None):
    """``rows`` rows: ``x[token]`` (times ``weight``) for the first ``keep``, zeros after."""
    moved = x.index_select(0, token[:keep])
    if weight is not None:
        moved = moved * weight[:keep, None]
    return torch.cat((moved, x.new_zeros(rows - keep, x.shape[1])))


@FUZZ
@given(seed=SEED, dtype=DTYPES, tokens=st.integers(0, 12), experts=st.integers(1, 6),
       topk=st.integers(1, 3), hidden=st.integers(1, 24),
       kind=st.sampled_from(["mask", "index", "mask_probs"]), merging=st.booleans(),
       data=st.data())  # fmt: skip
def test_moe_permute_unpermute(seed, dtype, tokens, experts, topk, hidden, kind, merging, data):
    """``te.moe_permute`` (mask or index maps) / ``te.moe_permute_with_probs`` and
    ``te.moe_unpermute`` (with or without merging probabilities) for random routings, dropped
    (``num_out_tokens`` below the routed count) and padded (above it, or probability-0 slots)
    rows, against index_select / index_add references; gradients of the tokens and of the
    probabilities."""
    torch.manual_seed(seed)
    dtype = capped_dtype(dtype, topk + 1)  # a token's gradient: the sum of its topk rows
    map_type = "index" if kind == "index" else "mask"
    if map_type == "mask":
        routing_map = torch.rand(tokens, experts) < data.draw(st.floats(0, 1), label="density")
        slots = experts
    else:
        routing_map = torch.randint(0, experts, (tokens, topk))  # repeats allowed: each a row
        slots = topk
    token, slot = _route_ref(routing_map, map_type)
    routed = len(token)
    # For indices a num_out_tokens that is not positive means all T * K rows.
    lowest = 0 if map_type == "mask" else 1
    if map_type == "mask" or (routed and data.draw(st.booleans(), label="explicit num_out")):
        rows = data.draw(st.integers(lowest, min(routed + 2, tokens * slots)), label="num_out")
        num_out = rows
    else:
        rows, num_out = routed, data.draw(st.sampled_from([-1, 0]), label="num_out_tokens")
    keep = min(rows, routed)
    x = torch.randn(tokens, hidden).to(dtype).requires_grad_()
    x_ref = to_reference(x)
    if kind == "mask_probs":
        probs = torch.rand(tokens, experts).to(dtype)
        probs[torch.rand(tokens, experts) < 0.2] = 0  # padding slots
        probs.requires_grad_()
        y, y_probs, row_id_map = te.moe_permute_with_probs(x, probs, routing_map, num_out)
        p_ref = to_reference(probs)
        p_moved = p_ref[token, slot]
        y_ref = _permute_ref(x_ref, token, keep, rows, (p_moved != 0).double())
        probs_ref = torch.cat((p_moved[:keep], p_moved.new_zeros(rows - keep)))
        assert_close(y_probs, probs_ref, dtype)
    else:
        y, row_id_map = te.moe_permute(x, routing_map.int() if map_type == "index" else
                                       routing_map, num_out, map_type=map_type)  # fmt: skip
        y_ref = _permute_ref(x_ref, token, keep, rows)
    assert torch.equal(y.detach().double(), y_ref.detach())  # a permutation: exact
    dy = torch.randn(y.shape).to(dtype)
    loss, loss_ref = (y * dy).sum(), (y_ref * to_reference(dy)).sum()
    if kind == "mask_probs":
        dp = torch.randn(y_probs.shape).to(dtype)
        loss, loss_ref = loss + (y_probs * dp).sum(), loss_ref + (probs_ref * dp.double()).sum()
    loss.backward()
    loss_ref.backward()
    assert_close(x.grad, x_ref.grad, dtype, roundings=topk + 1)
    if kind == "mask_probs":
        assert_close(probs.grad, p_ref.grad, dtype)

    # Unpermute other rows with the same map: out[t] = sum_s w[t, s] rows[row of (t, s)].
    z = torch.randn(rows, hidden).to(dtype).requires_grad_()
    w = torch.rand(tokens, slots).to(dtype).requires_grad_() if merging else None
    z_ref, w_ref = to_reference(z), to_reference(w)
    out = te.moe_unpermute(z, row_id_map, merging_probs=w, map_type=map_type,
                           restore_shape=(tokens, hidden))  # fmt: skip
    weight = w_ref[token[:keep], slot[:keep]] if merging else None
    moved = z_ref[:keep] * (weight[:, None] if merging else 1)
    out_ref = z_ref.new_zeros(tokens, hidden).index_add(0, token[:keep], moved)
    # fp32 sums rounded once; with repeated rows a sum of up to topk terms
    assert_close(out, out_ref, dtype, roundings=2, reduced=True)
    dout = torch.randn(out.shape).to(dtype)
    out.backward(dout)
    out_ref.backward(to_reference(dout))
    assert_close(z.grad, z_ref.grad, dtype, roundings=2)
    if merging:
        assert_close(w.grad, w_ref.grad, dtype, roundings=2, reduced=True)


@FUZZ
@given(seed=SEED, dtype=DTYPES, chunks=st.integers(1, 5), hidden=st.integers(1, 16),
       with_probs=st.booleans(), data=st.data())  # fmt: skip
def test_moe_sort_chunks(seed, dtype, chunks, hidden, with_probs, data):
    """``te.moe_sort_chunks_by_index`` (``_with_probs``): random chunk sizes (empty ones too),
    a random order, rows past the chunks in place; exact, forward and backward."""
    torch.manual_seed(seed)
    sizes = data.draw(st.lists(st.integers(0, 4), min_size=chunks, max_size=chunks))
    order = data.draw(st.permutations(range(chunks)))
    rows = sum(sizes) + data.draw(st.integers(0, 3), label="rows past the chunks")
    index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
    split_sizes, sorted_index = (torch.tensor(v, dtype=index_dtype) for v in (sizes, order))
    x = torch.randn(rows, hidden).to(dtype).requires_grad_()
    x_ref = to_reference(x)
    pieces = x_ref[: sum(sizes)].split(sizes)
    src = torch.arange(rows)
    src_pieces = src[: sum(sizes)].split(sizes)
    src_order = torch.cat([*(src_pieces[i] for i in order), src[sum(sizes) :]])
    y_ref = torch.cat([*(pieces[i] for i in order), x_ref[sum(sizes) :]])
    if with_probs:
        probs = torch.rand(rows).to(dtype).requires_grad_()
        y, y_probs = te.moe_sort_chunks_by_index_with_probs(x, probs, split_sizes, sorted_index)
        assert torch.equal(y_probs, probs.detach()[src_order])
        if rows == 0:
            return
        dp = torch.randn(rows).to(dtype)
        y_probs.backward(dp, retain_graph=True)
        expected = torch.zeros(rows, dtype=dtype).index_add(0, src_order, dp)
        assert torch.equal(probs.grad, expected)
    else:
        y = te.moe_sort_chunks_by_index(x, split_sizes, sorted_index)
    assert torch.equal(y.detach().double(), y_ref.detach())
    if rows == 0:
        return
    dy = torch.randn(y.shape).to(dtype)
    y.backward(dy)
    y_ref.backward(to_reference(dy))
    assert torch.equal(x.grad.double(), x_ref.grad)
