r"""Fake quantisation: ``te::fake_quantize_fwd`` / ``te::fake_quantize_bwd``.

.. math::
    y = \mathrm{dq}(\mathrm{q}(x)), \qquad dx = \mathrm{dq}(\mathrm{q}_g(dy))
    \ \text{(or } dx = dy \text{ when the gradient is not quantised)}

with :math:`\mathrm{q}` one of the quantisers of ``te_compile.functional.quantize`` (``kind``:
``"current"`` per-tensor current scaling, ``"block"`` 1x128 / 128x128 blocks, ``"mxfp8"``,
``"nvfp4"``) and :math:`\mathrm{dq}` its inverse, back to the input's dtype: the values an FP8
GEMM sees, as a plain tensor. This is what ``te_compile.ops.Quantize`` runs: Transformer Engine
hands the next op the quantised tensor itself, while here quantised data never crosses an op
boundary except as plain tensors, so the op passes on the dequantised values (the next FP8 GEMM
re-quantises them, exactly for the per-tensor and block kinds whose scale they reproduce).
The gradient is straight-through, or quantised with ``grad_kind`` (the backward's format).

``kind="none"`` leaves the forward values as they are (a copy: an op's output may not alias its
input), for a ``Quantize`` that only quantises the gradient. Delayed scaling needs an amax
history and is not an option here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op
from te_compile.functional import quantize as _q

__all__ = ["FAKE_QUANTIZE_KINDS", "fake_quantize", "fake_quantize_ref"]

FAKE_QUANTIZE_KINDS = ("none", "current", "block", "mxfp8", "nvfp4")
_HIGH = (torch.float32, torch.bfloat16, torch.float16)


# 1. Reference math ----------------------------------------------------------------------------


def _qdq(x: Tensor, kind: str, fp8_dtype: torch.dtype, block_rows: int, power_2: bool) -> Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype (fp64 input is quantised from fp32)."""
    if kind == "none":
        return x.clone(memory_format=torch.contiguous_format)
    src = x if x.dtype in _HIGH else x.float()
    kw = {"fp8_dtype": fp8_dtype, "power_2_scale": power_2}
    if kind == "block":
        kw["block_rows"] = block_rows
    if kind in ("mxfp8", "nvfp4"):
        kw = {"fp8_dtype": fp8_dtype} if kind == "mxfp8" else {}
    q = _q.quantize(src.contiguous(), kind, **kw)
    return _q.dequantize(q, src.dtype).to(x.dtype)


class _Reference(torch.autograd.Function):
    """Differentiable reference (for the tests): qdq forward, qdq'd or straight gradient."""

    @staticmethod
    def forward(ctx, x, kind, fp8_dtype, block_rows, power_2, grad_kind, grad_dtype, grad_rows):
        ctx.config = (grad_kind, grad_dtype, grad_rows, power_2)
        return _qdq(x, kind, fp8_dtype, block_rows, power_2)

    @staticmethod
    def backward(ctx, grad):
        grad_kind, grad_dtype, grad_rows, power_2 = ctx.config
        dx = grad if grad_kind == "none" else _qdq(grad, grad_kind, grad_dtype, grad_rows, power_2)
        return dx, *(None for _ in range(7))


def fake_quantize_ref(
    inp: Tensor,
    kind: str,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2_scale: bool,
    grad_kind: str,
    grad_fp8_dtype: torch.dtype,
    grad_block_rows: int,
) -> Tensor:
    return _Reference.apply(
        inp, kind, fp8_dtype, block_rows, power_2_scale, grad_kind, grad_fp8_dtype, grad_block_rows
    )


def _check(inp: Tensor, kind: str, grad_kind: str) -> None:
    kinds = FAKE_QUANTIZE_KINDS
    if inp.dtype in _HIGH and inp.dim() >= 1 and kind in kinds and grad_kind in kinds:
        return
    p = "te.fake_quantize: "
    for name, value in (("kind", kind), ("grad_kind", grad_kind)):
        if value not in FAKE_QUANTIZE_KINDS:
            raise ValueError(p + f"{name} must be one of {FAKE_QUANTIZE_KINDS}, got {value!r}")
    raise ValueError(
        p + f"inp must be float32, bfloat16 or float16 with at least 1 dim, got {inp.dtype} "
        f"of shape {list(inp.shape)}"
    )


# 2. Forward op / 3. fake ----------------------------------------------------------------------


@op("fake_quantize_fwd")
def fake_quantize_fwd(
    inp: Tensor,
    kind: str,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2_scale: bool,
    grad_kind: str,
    grad_fp8_dtype: torch.dtype,
    grad_block_rows: int,
) -> Tensor:
    """``dequantize(quantize(inp))``: the quantisation ops for the device (Triton on CUDA)."""
    _check(inp, kind, grad_kind)
    return _qdq(inp, kind, fp8_dtype, block_rows, power_2_scale)


@fake_quantize_fwd.register_fake
def _fake_quantize_fwd_fake(inp, kind, fp8_dtype, block_rows, power_2, grad_kind, g_dtype, g_rows):
    _check(inp, kind, grad_kind)
    return inp.new_empty(inp.shape)


# 4. Backward op -------------------------------------------------------------------------------


@op("fake_quantize_bwd")
def fake_quantize_bwd(
    grad: Tensor, grad_kind: str, grad_fp8_dtype: torch.dtype, grad_block_rows: int, power_2: bool
) -> Tensor:
    """``dequantize(quantize(grad))`` with the gradient's quantiser."""
    return _qdq(grad, grad_kind, grad_fp8_dtype, grad_block_rows, power_2)


@fake_quantize_bwd.register_fake
def _fake_quantize_bwd_fake(grad, grad_kind, grad_fp8_dtype, grad_block_rows, power_2):
    return grad.new_empty(grad.shape)


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    _inp, _kind, _dtype, _rows, power_2, grad_kind, grad_dtype, grad_rows = inputs
    ctx.config = (grad_kind, grad_dtype, grad_rows, power_2)


def _backward(ctx, bwd, grad):
    # Straight through (grad_kind "none"): the incoming gradient itself, no op.
    dx = grad if ctx.config[0] == "none" else bwd(grad.contiguous(), *ctx.config)
    return dx, *(None for _ in range(7))


def _samples(device: torch.device):
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    yield SampleInput((t(5, 32), "current", e4m3, 1, False, "current", e5m2, 1))
    yield SampleInput(
        (t(3, 2, 128, dtype=torch.bfloat16), "block", e4m3, 1, True, "block", e5m2, 1)
    )
    yield SampleInput((t(4, 64), "mxfp8", e4m3, 1, False, "mxfp8", e5m2, 1))
    yield SampleInput((t(4, 64, dtype=torch.bfloat16), "nvfp4", e4m3, 1, False, "block", e4m3, 1))
    yield SampleInput((t(6, 48, dtype=torch.float16), "none", e4m3, 1, False, "current", e4m3, 1))


_fake_quantize = differentiable(
    fake_quantize_fwd,
    fake_quantize_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=fake_quantize_ref,
)


# Public function ------------------------------------------------------------------------------


def fake_quantize(
    inp: Tensor,
    kind: str,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    block_rows: int = 1,
    power_2_scale: bool = False,
    grad_kind: str = "none",
    grad_fp8_dtype: torch.dtype = torch.float8_e5m2,
    grad_block_rows: int = 1,
) -> Tensor:
    """``inp`` quantised and dequantised with ``kind`` (see the module docstring); the gradient
    straight through (``grad_kind="none"``) or quantised and dequantised with ``grad_kind``."""
    return _fake_quantize(
        inp, kind, fp8_dtype, block_rows, power_2_scale, grad_kind, grad_fp8_dtype, grad_block_rows
    )
