"""Property-based tests (hypothesis): odd shapes and option mixes that fixed cases miss."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import te_compile as te
from tests.utils import assert_close, make_reference_and_test_tensors

DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@settings(max_examples=40, deadline=None)
@given(
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    in_features=st.integers(1, 48),
    out_features=st.integers(1, 48),
    bias=st.booleans(),
    dtype=DTYPES,
    fast=st.booleans(),
)
def test_linear_any_shape(lead, in_features, out_features, bias, dtype, fast):
    x_ref, x = make_reference_and_test_tensors((*lead, in_features), dtype=dtype)
    w_ref, w = make_reference_and_test_tensors((out_features, in_features), dtype=dtype)
    b_ref, b = make_reference_and_test_tensors((out_features,), dtype=dtype)
    if not bias:
        b_ref = b = None
    te.set_eager_fast_path(fast)
    try:
        y = te.functional.linear(x, w, b)
    finally:
        te.set_eager_fast_path(True)
    y_ref = x_ref @ w_ref.t() + (b_ref if bias else 0)
    assert y.shape == y_ref.shape
    assert_close(y, y_ref, dtype)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, requires_grad=False)
    y.backward(dy)
    y_ref.backward(dy_ref)
    assert_close(x.grad, x_ref.grad, dtype)
    assert_close(w.grad, w_ref.grad, dtype)
    if bias:
        assert_close(b.grad, b_ref.grad, dtype)


SPEC = st.tuples(
    st.lists(st.integers(0, 7), min_size=0, max_size=3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64]),
    st.sampled_from([1, 2, 16, 64, 256, 4096]),
)


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(SPEC, min_size=0, max_size=12))
def test_bulk_allocate_layout(specs):
    shapes = [tuple(s) for s, _, _ in specs]
    dtypes = [d for _, d, _ in specs]
    alignments = [a for _, _, a in specs]
    out = te.bulk_allocate(shapes, dtypes, device="cpu", alignments=alignments)
    ranges = []
    for t, shape, dtype, alignment in zip(out, shapes, dtypes, alignments, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        if t.numel() == 0:
            continue
        start = t.data_ptr()
        assert start % max(alignment, t.element_size()) == 0
        ranges.append((start, start + t.numel() * t.element_size()))
    ranges.sort()
    for (_, end), (next_start, _) in itertools.pairwise(ranges):
        assert end <= next_start, "tensors overlap"
    if ranges:  # one allocation: the whole span is no larger than the sum plus padding
        span = ranges[-1][1] - ranges[0][0]
        padding = sum(max(a, 8) for a in alignments)
        assert span <= sum(e - s for s, e in ranges) + padding
