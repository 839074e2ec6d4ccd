r"""Block-scaled linear, emulated: ``te::linear_block_scaled_fwd`` / ``_bwd`` for the MXFP8,
NVFP4 and FP8-blockwise recipes (Transformer Engine's ``MXFP8BlockScaling``,
``NVFP4BlockScaling``, ``Float8BlockScaling``).

Hopper has no tensor-core instructions for MX (32-element blocks, E8M0 scales) or NVFP4
(16-element blocks, E4M3 scales, a global scale) operands, so off Blackwell those GEMMs are
*emulated*; ``Float8BlockScaling`` (1x128 blocks for activations and gradients, 128x128 for
weights, fp32 scales) runs natively on Hopper through blockwise-scaled ``_scaled_mm``, which is
not wired yet, so it is emulated here too (``kind="block"``). Emulated means: every operand is
quantised exactly as the native recipe would (the quantisation ops of
``te_compile.functional.quantize_mx`` and ``quantize``), dequantised and multiplied in fp32
(where every dequantised value is exact; the output is rounded once to the input's dtype).
The numerics are those of the recipe up to the GEMM's accumulation order; the speed is that of
an fp32 GEMM plus the quantisation passes, i.e. slower than bf16. Use it to test recipes and
train small models for numerics, not for speed.

Each GEMM quantises its operands in blocks along its contraction dim, as the hardware does:

.. math::
    Y = Q_K(X)\,Q_K(W)^\top + b,\qquad dX = Q_N(dY)\,Q_N(W),\qquad dW = Q_M(dY)^\top Q_M(X)

where :math:`Q_D` quantises in blocks along dim :math:`D`. One quantisation pass of ``X`` (and
of ``W``, ``dY``) yields both directions (``rowwise`` and ``columnwise``). The forward saves the
dequantised columnwise copies the backward GEMMs need (fp32: emulation does not save memory).
NVFP4's stochastic rounding and random Hadamard transform of the gradient (TE's options) are not
emulated: gradients are rounded to nearest.

Shapes: in_features, out_features and the number of tokens must be multiples of 32 for MXFP8
and of 16 for NVFP4 and FP8 blockwise (partial 128-blocks are scaled on their own).
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op
from te_compile.functional.quantize_mx import (
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)

__all__ = ["BLOCK_SCALED_KINDS", "linear_block_scaled", "qdq_both"]

BLOCK_SCALED_KINDS = {"mxfp8": 32, "nvfp4": 16, "block": 16}
_HIGH = (torch.float32, torch.bfloat16, torch.float16)


def qdq_both(
    x2: Tensor, kind: str, fp8_dtype: torch.dtype, block_rows: int = 1, power_2_scale: bool = False
) -> tuple[Tensor, Tensor]:
    """``(rowwise, columnwise^T)``: ``x2`` ``[M, K]`` quantised in blocks along K and along M
    (the latter returned transposed, ``[K, M]``), both dequantised to fp32, where every
    dequantised value is exact (an NVFP4 value times its E4M3 scale over the global scale is
    not always a bf16 number). fp64 input (the tests' references) is quantised from its fp32
    values and returned as fp64."""
    x = x2.float() if x2.dtype == torch.float64 else x2
    f32 = torch.float32
    if kind == "block":  # 1 x 128 (block_rows=1) or 128 x 128 blocks, fp32 scales
        data, s, data_t, s_t = torch.ops.te.quantize_blockwise(
            x, fp8_dtype, block_rows, power_2_scale, True
        )
        deq = torch.ops.te.dequantize_blockwise
        u8 = torch.uint8
        row = deq(data.view(u8), s, block_rows, fp8_dtype, f32)
        col_t = deq(data_t.view(u8), s_t, block_rows, fp8_dtype, f32)
    elif kind == "mxfp8":
        data, scale, data_t, scale_t = quantize_mxfp8(x, fp8_dtype)
        row, col_t = dequantize_mxfp8(data, scale, f32), dequantize_mxfp8(data_t, scale_t, f32)
    else:
        data, scale, g, data_t, scale_t = quantize_nvfp4(x)
        row = dequantize_nvfp4(data, scale, g, f32)
        col_t = dequantize_nvfp4(data_t, scale_t, g, f32)
    if x2.dtype == torch.float64:
        return row.double(), col_t.double()
    return row, col_t


def _check(inp: Tensor, weight: Tensor, bias: Tensor | None, kind: str) -> None:
    block = BLOCK_SCALED_KINDS.get(kind, 0)
    m = inp.numel() // inp.shape[-1] if inp.ndim >= 1 and inp.shape[-1] else 0
    if (
        block
        and weight.ndim == 2
        and inp.ndim >= 1
        and inp.dtype in _HIGH
        and weight.dtype is inp.dtype
        and inp.shape[-1] == weight.shape[1]
        and weight.shape[0] % block == 0
        and weight.shape[1] % block == 0
        and m % block == 0
        and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype is inp.dtype))
    ):
        return
    p = "te.linear_block_scaled: "
    if not block:
        raise ValueError(p + f"kind must be one of {tuple(BLOCK_SCALED_KINDS)}, got {kind!r}")
    if weight.ndim != 2 or inp.ndim < 1 or inp.shape[-1] != weight.shape[1]:
        raise ValueError(
            p + f"inp [..., in_features] and weight [out_features, in_features] do not match: "
            f"{list(inp.shape)} and {list(weight.shape)}"
        )
    if inp.dtype not in _HIGH or weight.dtype != inp.dtype:
        raise ValueError(
            p + f"inp and weight must share a float dtype: {inp.dtype}, {weight.dtype}"
        )
    if weight.shape[0] % block or weight.shape[1] % block or m % block:
        raise ValueError(
            p + f"{kind} needs in_features ({weight.shape[1]}), out_features ({weight.shape[0]}) "
            f"and the number of tokens ({m}) to be multiples of its block ({block})"
        )
    raise ValueError(p + f"bias must be [{weight.shape[0]}] of dtype {inp.dtype}")


@op("linear_block_scaled_fwd")
def linear_block_scaled_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kind: str,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    power_2_scale: bool,
    weight_block_rows: int,
) -> tuple[Tensor, list[Tensor]]:
    """``(out, [Q_M(X)^T, Q_N(W)^T])`` (see the module docstring); the same on every device.
    ``power_2_scale`` and ``weight_block_rows`` (1: 1x128, 128: 128x128) apply to ``block``."""
    _check(inp, weight, bias, kind)
    x = inp.reshape(-1, inp.shape[-1])
    x_row, x_col_t = qdq_both(x, kind, fwd_dtype, 1, power_2_scale)
    w_row, w_col_t = qdq_both(weight, kind, fwd_dtype, weight_block_rows, power_2_scale)
    out = torch.nn.functional.linear(x_row, w_row, None if bias is None else bias.float())
    out = out.to(inp.dtype).reshape(*inp.shape[:-1], weight.shape[0])
    return out, [x_col_t, w_col_t]


@linear_block_scaled_fwd.register_fake
def _fwd_fake(inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, weight_block_rows):
    _check(inp, weight, bias, kind)
    m, k, n = inp.numel() // inp.shape[-1], weight.shape[1], weight.shape[0]
    saved = [inp.new_empty(k, m, dtype=torch.float32), inp.new_empty(k, n, dtype=torch.float32)]
    return inp.new_empty(*inp.shape[:-1], n), saved


@op("linear_block_scaled_bwd")
def linear_block_scaled_bwd(
    grad_out: Tensor,
    saved: list[Tensor],
    kind: str,
    bwd_dtype: torch.dtype,
    power_2_scale: bool,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)``, 0-element where not computed."""
    x_col_t, w_col_t = saved
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    g_row, g_col_t = qdq_both(dy, kind, bwd_dtype, 1, power_2_scale)
    empty = grad_out.new_empty(0)
    dinp = empty
    dtype = grad_out.dtype
    if need_dgrad:  # [M, N] @ [N, K]
        dinp = (g_row @ w_col_t.t()).to(dtype).reshape(*grad_out.shape[:-1], w_col_t.shape[0])
    dweight = (g_col_t @ x_col_t.t()).to(dtype) if need_wgrad else empty.clone()  # [N, M] @ [M, K]
    dbias = dy.float().sum(0).to(dy.dtype) if has_bias else empty.clone()
    return dinp, dweight, dbias


@linear_block_scaled_bwd.register_fake
def _bwd_fake(grad_out, saved, kind, bwd_dtype, power_2_scale, has_bias, need_dgrad, need_wgrad):
    _x_col_t, w_col_t = saved
    k, n = w_col_t.shape
    dinp = grad_out.new_empty(*grad_out.shape[:-1], k) if need_dgrad else grad_out.new_empty(0)
    dweight = grad_out.new_empty(n, k) if need_wgrad else grad_out.new_empty(0)
    dbias = grad_out.new_empty(n) if has_bias else grad_out.new_empty(0)
    return dinp, dweight, dbias


def _setup_context(ctx, inputs, output) -> None:
    _inp, _weight, bias, kind, _fwd, bwd_dtype, power_2_scale, _w_rows = inputs
    _out, saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(*saved)
    ctx.kind, ctx.bwd_dtype, ctx.has_bias = kind, bwd_dtype, bias is not None
    ctx.power_2_scale = power_2_scale


def _backward(ctx, bwd, grad_out, _grad_saved):
    need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
    dinp, dweight, dbias = bwd(
        grad_out.contiguous(),
        list(ctx.saved_tensors),
        ctx.kind,
        ctx.bwd_dtype,
        ctx.power_2_scale,
        ctx.has_bias and need_bgrad,
        need_dgrad,
        need_wgrad,
    )
    return (
        dinp if need_dgrad else None,
        dweight if need_wgrad else None,
        dbias if ctx.has_bias and need_bgrad else None,
        *(None,) * 5,
    )


def _samples(device: torch.device):
    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    yield SampleInput((t(32, 64), t(32, 64), t(32), "mxfp8", e4m3, e4m3, False, 1))
    yield SampleInput((t(2, 16, 32, dtype=torch.float32), t(64, 32, dtype=torch.float32), None,
                       "mxfp8", e4m3, e5m2, False, 1))  # fmt: skip
    yield SampleInput((t(16, 32), t(48, 32), t(48), "nvfp4", e4m3, e4m3, False, 1))
    # Float8BlockScaling: 1x128 activations (a partial block: K=144), 128x128 weight tiles.
    yield SampleInput((t(32, 144), t(160, 144), None, "block", e4m3, e4m3, True, 128))


class _Reference(torch.autograd.Function):
    """The emulation written out with autograd.Function in the input's dtype (fp64 in the tests):
    autograd alone cannot express it, since each backward GEMM quantises its operands along a
    different dim than the forward did."""

    @staticmethod
    def forward(ctx, inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, w_rows):
        x = inp.reshape(-1, inp.shape[-1])
        x_row, x_col_t = qdq_both(x, kind, fwd_dtype, 1, power_2_scale)
        w_row, w_col_t = qdq_both(weight, kind, fwd_dtype, w_rows, power_2_scale)
        ctx.power_2_scale = power_2_scale
        ctx.save_for_backward(x_col_t, w_col_t)
        ctx.kind, ctx.bwd_dtype, ctx.shape, ctx.has_bias = (
            kind,
            bwd_dtype,
            inp.shape,
            bias is not None,
        )
        out = x_row @ w_row.t() + (0 if bias is None else bias)
        return out.reshape(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x_col_t, w_col_t = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])
        g_row, g_col_t = qdq_both(dy, ctx.kind, ctx.bwd_dtype, 1, ctx.power_2_scale)
        dinp = (g_row @ w_col_t.t()).reshape(ctx.shape)
        dbias = dy.sum(0) if ctx.has_bias else None
        return dinp, g_col_t @ x_col_t.t(), dbias, *(None,) * 5


def _reference(inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, w_rows):
    return _Reference.apply(inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, w_rows)


_linear_block_scaled = differentiable(
    linear_block_scaled_fwd,
    linear_block_scaled_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=_reference,
)


def linear_block_scaled(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    kind: str = "mxfp8",
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e4m3fn,
    power_2_scale: bool = False,
    weight_block_rows: int = 128,
) -> Tensor:
    """``inp @ weight.T + bias`` with MXFP8 (``kind="mxfp8"``, element formats ``fwd_dtype`` /
    ``bwd_dtype``) or NVFP4 (``kind="nvfp4"``) operands, emulated (module docstring)."""
    out, _saved = _linear_block_scaled(
        inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, weight_block_rows
    )
    return out
