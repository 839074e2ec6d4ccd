"""Fuzz tests of ``te.ops``: random ``Sequential`` chains of every basic op, the fusions'
patterns among them, against float64 references (``common``)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import te_compile as te
from tests.fuzz.common import (
    _FUSION_MOTIFS,
    _OPS_ACT,
    _OPS_GLU,
    _OPS_SCALED,
    DTYPES,
    FUZZ,
    SEED,
    _build_chain,
    _norm_cond,
    _randomize,
)
from tests.utils import assert_close, assert_close_sum, capped_dtype, to_reference

_MOTIFS = [
    *_FUSION_MOTIFS,
    *([op] for op in ["Linear", "Bias", "act", "glu", "scaled_glu", "LayerNorm", "RMSNorm",
                      "L2Normalization", "ConstantScale", "Identity", "Reshape", "AddExtraInput",
                      "MakeExtraOutput", "GroupedLinear"]),
]  # fmt: skip


@st.composite
def _op_chain(draw):
    steps = []
    for motif in draw(st.lists(st.sampled_from(_MOTIFS), min_size=1, max_size=4)):
        for kind in motif:
            if kind == "Bias?":
                if not draw(st.booleans()):
                    continue
                kind = "Bias"
            if kind == "act":
                kind = draw(st.sampled_from(sorted(_OPS_ACT)))
            elif kind == "glu":
                kind = draw(st.sampled_from(sorted(_OPS_GLU)))
            elif kind == "scaled_glu":
                kind = draw(st.sampled_from(sorted(_OPS_SCALED)))
            steps.append((kind, {
                "features": draw(st.integers(2, 12)), "bias": draw(st.booleans()),
                "zc": draw(st.booleans()), "interleave": draw(st.sampled_from([None, 1, 2])),
                "scale": draw(st.sampled_from([0.5, -2.0])), "groups": draw(st.integers(1, 3)),
                "flat": draw(st.booleans()),
            }))  # fmt: skip
    return steps


@FUZZ
@given(seed=SEED, dtype=DTYPES, steps=_op_chain(), hidden=st.integers(2, 12),
       lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), fuse=st.booleans(),
       data=st.data())  # fmt: skip
def test_ops_sequential(seed, dtype, steps, hidden, lead, fuse, data):
    """A random ``te.ops.Sequential`` of every basic op (linears, biases, element-wise, gated and
    scaled gated activations, norms, scale, identity, reshape, extra inputs and outputs, grouped
    linear), the fusions' patterns among them, fused or not: outputs, extra outputs and the
    gradients of the input, the extra inputs and the parameters against plain torch."""
    torch.manual_seed(seed)
    # Widths from 2: a norm of a single value, or of values all proportional to one input
    # value, is scale invariant, and its gradient a cancellation to (nearly) zero.
    # Each op rounds once (a linear's bias, a gated op or a grouped linear may add an op in
    # front: at most two refs a step), and the gradients one more; a norm's condition number,
    # known once the reference ran, multiplies them: chains with a norm run in float32, the
    # others where their length is within the cap of the dtype drawn (bfloat16: never).
    norms = any(kind in ("LayerNorm", "RMSNorm") for kind, _ in steps)
    dtype = torch.float32 if norms else capped_dtype(dtype, 2 * len(steps) + 2)
    ops, refs, extras, scaled_terms = _build_chain(steps, hidden, lead, dtype, data)
    m = te.ops.Sequential(*ops, fuse=fuse)
    params = _randomize(m, dtype, fan_in=True)
    x = torch.randn(*lead, hidden).to(dtype).requires_grad_()
    extras = [e.requires_grad_() if isinstance(e, torch.Tensor) else e for e in extras]
    x_ref, extras_ref = to_reference(x), to_reference(extras)
    outs = m(x, *extras)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    y_ref, more, it = x_ref, [], iter(extras_ref)
    cond = 1.0
    for i, ref in enumerate(refs):
        if type(m[i]).__name__ in ("LayerNorm", "RMSNorm"):
            cond = max(cond, _norm_cond(y_ref.detach(), type(m[i]).__name__))
        y_ref = ref(y_ref, params, f"{i}.", it, more)
    outs_ref = [y_ref, *more]
    # Each op rounds once; a norm amplifies its input's roundoff by its condition number.
    roundings = (len(refs) + 1) * max(1, math.ceil(cond))
    assert len(outs) == len(outs_ref)
    for out, ref in zip(outs, outs_ref, strict=True):
        assert out.shape == ref.shape and out.dtype == dtype
        assert_close(out, ref, dtype, roundings=roundings, reduced=True)
    grads = [torch.randn(o.shape).to(dtype) for o in outs]
    sum((o * g).sum() for o, g in zip(outs, grads, strict=True)).backward()
    sum((o * to_reference(g)).sum() for o, g in zip(outs_ref, grads, strict=True)).backward()
    # A scaled activation's scales get sum_j dy_j glu_j: its terms' magnitudes bound the error
    # (a norm next is invariant to a row's scale, and that sum cancels to zero).
    sums = {id(s): (g.abs() * y.grad.abs()).sum(-1) for s, g, y in scaled_terms
            if y.grad is not None}  # fmt: skip
    checks = [(x.grad, x_ref.grad, None)]
    checks += [(p.grad, params[n].grad, None) for n, p in m.named_parameters()]
    checks += [(e.grad, r.grad, sums.get(id(r))) for e, r in zip(extras, extras_ref, strict=True)
               if isinstance(e, torch.Tensor)]  # fmt: skip
    for actual, expected, magnitude in checks:
        if expected is None:  # an input no output depends on
            assert actual is None or not actual.any()
        elif magnitude is not None:
            assert_close_sum(actual, expected, dtype, magnitude.detach(), roundings + 1)
        else:
            assert_close(actual, expected, dtype, roundings=roundings + 1, reduced=True)
