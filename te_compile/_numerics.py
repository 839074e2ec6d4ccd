"""Arithmetic whose rounding is the same in eager, on the CPU and in Inductor's generated code.

Inductor lowers an fp32 tensor division on CUDA to Triton's ``/``, which is an approximate
division (``div.full.f32``, up to two ulps off), and ``reciprocal`` to ``1 / x``; eager CUDA and
the CPU divide correctly rounded. A scale computed by a traced-through op would then differ by
an ulp between eager and compiled runs, and a value next to a rounding boundary of the format
(an E2M1 step is a quarter of a block's range) would get another code. :func:`div_rn` divides in
float64 and rounds once to float32: the float64 quotient of two float32 values rounded to
float32 is the correctly rounded float32 quotient (53 >= 2 * 24 + 2 bits: the double rounding is
innocuous), and every backend divides float64 correctly rounded."""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(t: Tensor) -> torch.dtype:
    """The dtype high-precision math computes in: fp32, or fp64 for an fp64 ``t``."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def div_rn(a: Tensor | float, b: Tensor | float) -> Tensor:
    """``a / b`` correctly rounded to the result's dtype (float32 for float32 or lower operands;
    float64 stays float64), on every device, eager and compiled. One of the two may be a Python
    number."""
    t = a if isinstance(a, Tensor) else b
    assert isinstance(t, Tensor), "div_rn: one operand must be a tensor"
    out = torch.promote_types(
        a.dtype if isinstance(a, Tensor) else torch.float32,
        b.dtype if isinstance(b, Tensor) else torch.float32,
    )
    if out == torch.float64:
        return torch.div(a, b)
    # A number becomes a 0-dim float64 tensor (``number / tensor`` would be computed as the
    # number times the tensor's reciprocal, rounding twice), filled on the tensor's device: a
    # host-to-device copy (``new_tensor``) cannot be captured in a CUDA graph.
    a64, b64 = (
        v.double() if isinstance(v, Tensor) else t.new_full((), v, dtype=torch.float64)
        for v in (a, b)
    )
    return torch.div(a64, b64).to(out)


def reciprocal_rn(x: Tensor) -> Tensor:
    """``1 / x`` correctly rounded (:func:`div_rn`)."""
    return div_rn(1.0, x)
