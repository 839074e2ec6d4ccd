r"""Block-scaled linear, emulated: ``te::linear_block_scaled_fwd`` / ``_bwd`` for the MXFP8,
NVFP4 and FP8-blockwise recipes (Transformer Engine's ``MXFP8BlockScaling``,
``NVFP4BlockScaling``, ``Float8BlockScaling``).

Hopper has no tensor-core instructions for MX (32-element blocks, E8M0 scales) or NVFP4
(16-element blocks, E4M3 scales, a global scale) operands, so off Blackwell those GEMMs are
*emulated*; ``Float8BlockScaling`` (1x128 blocks for activations and gradients, 128x128 for
weights, fp32 scales) runs natively on Hopper through blockwise-scaled ``torch._scaled_mm``
(cuBLAS, CUDA 12.9+) when the caller asks for it (``native=True``; the modules do so where
``te.is_fp8_block_scaling_available()``); otherwise it is emulated too (``kind="block"``).
Emulated means: every operand is quantised exactly as the native recipe would (the quantisation
ops of ``te_compile.functional.quantize_mx`` and ``quantize``), dequantised and multiplied in fp32
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

Native blockwise (``native=True``, ``kind="block"`` only): the same quantisation ops, then the
three GEMMs read the FP8 data and the fp32 block scales directly (1x128 x 128x128 for the
forward and dgrad, 1x128 x 1x128 for wgrad); the forward saves the FP8 columnwise copies of
``X`` and ``W`` with their scales (as uint8 bytes), not dequantised ones. On CPU (the tests) the
same path runs with its GEMMs emulated by :func:`_block_scaled_mm`, so its plumbing (which
copy, which scale layout) is checked everywhere; on an H100 the GEMMs are cuBLAS's.

Shapes: in_features, out_features and the number of tokens must be multiples of 32 for MXFP8
and of 16 for NVFP4 and FP8 blockwise (partial 128-blocks are scaled on their own).
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op
from te_compile.functional.linear_fp8 import (
    _check_norm,
    _fake_dnorm,
    _fake_stats,
    _norm_fwd,
    _norm_needs_dgrad,
    _pad_rows,
    _padded,
    _save_norm,
    _through_norm,
    _with_norm_grads,
    norm_ref,
    unit_rows,
)
from te_compile.functional.quantize import dequantize_blockwise, quantize_blockwise
from te_compile.functional.quantize_mx import (
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)

__all__ = ["BLOCK_SCALED_KINDS", "linear_block_scaled", "native_block_supported", "qdq_both"]

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
        data, s, data_t, s_t = quantize_blockwise.eager(
            x, fp8_dtype, block_rows, power_2_scale, True
        )
        deq = dequantize_blockwise.eager
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


def _check(inp: Tensor, weight: Tensor, bias: Tensor | None, kind: str, norm=()) -> None:
    if norm:
        _check_norm("te.linear_block_scaled: ", inp, norm)
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


def _block_scaled_mm(
    a: Tensor,
    sa: Tensor,
    a_rows: int,
    b: Tensor,
    sb: Tensor,
    b_rows: int,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``dequant(a) @ dequant(b)^T``: ``a`` ``[M, K]`` and ``b`` ``[N, K]`` FP8 data, both
    quantised in blocks along K (``a_rows`` / ``b_rows`` x 128 elements, compact fp32 scale
    layout of ``quantize_blockwise``, or for 1x128 scales already outer-dim-major). CUDA: one
    blockwise-scaled ``torch._scaled_mm`` (its layouts: 1x128 scales outer-dim-major, 128x128
    scales as ``[K/128, N/128]``, ``mat2`` column-major). Elsewhere: dequantised in fp32 (exact)
    and multiplied in fp32. ``bias`` is added before the one rounding to ``out_dtype`` (in the
    GEMM's epilogue on CUDA). ``out``: a contiguous ``[M, N]`` tensor of ``out_dtype`` to
    write the result into (returned)."""
    if a.device.type != "cuda":
        deq = dequantize_blockwise.eager
        u8, f32 = torch.uint8, torch.float32
        a32 = deq(a.contiguous().view(u8), sa.contiguous(), a_rows, a.dtype, f32)
        b32 = deq(b.contiguous().view(u8), sb.contiguous(), b_rows, b.dtype, f32)
        res = torch.nn.functional.linear(a32, b32, None if bias is None else bias.float())
        return res.to(out_dtype) if out is None else out.copy_(res)
    scale_a = sa.t().contiguous().t() if a_rows == 1 else sa
    scale_b = sb.t().contiguous() if b_rows == 1 else sb.t()
    # Row-major operands with a leading dimension (column slices of a wider matrix) go in as
    # they are; cuBLAS reads the leading dimension.
    mat1, mat2 = _row_major(a), _row_major(b).t()
    into = {} if out is None else {"out": out}
    try:  # the bias in cuBLAS's epilogue, where the blockwise kernels take one
        return torch._scaled_mm(mat1, mat2, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                                **into)  # fmt: skip
    except RuntimeError:
        if bias is None and mat1.is_contiguous() and mat2.t().is_contiguous():
            raise
    # Refused: the bias after an fp32 GEMM, contiguous operands.
    mat1, mat2 = a.contiguous(), b.contiguous().t()
    if bias is None:
        return torch._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=out_dtype, **into)
    res = torch._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=torch.float32) + bias.float()
    return res.to(out_dtype) if out is None else out.copy_(res)


def _row_major(t: Tensor) -> Tensor:
    """``t`` when its rows are contiguous and 16-byte aligned (a leading dimension is fine),
    else a contiguous copy."""
    from te_compile.kernels import aligned16

    return t if t.stride(-1) == 1 and aligned16(t) else t.contiguous()


def _quantize_block(x2: Tensor, fp8_dtype: torch.dtype, block_rows: int, power_2_scale: bool):
    """``(data, scale_inv, data_t, scale_inv_t)`` of ``x2`` (contiguous copies)."""
    data, s, data_t, s_t = quantize_blockwise.eager(x2, fp8_dtype, block_rows, power_2_scale, True)
    return data, s, data_t.contiguous(), s_t.contiguous()


def _quantize_block_sums(dy: Tensor, fp8_dtype, power_2_scale: bool, sums: bool, mn_major=False):
    """``(*_quantize_block(dy, fp8_dtype, 1, power_2_scale), column sums)``: with ``sums``,
    ``dy``'s fp32 column sums (the bias gradient), else None. On CUDA one kernel reads ``dy``
    once for the casts and the sums (``kernels.quantize.quantize_blockwise_sums``; with
    ``mn_major``, both scale tensors in the GEMM's layout where its CUDA kernel runs)."""
    if sums and dy.is_cuda:
        from te_compile.kernels.quantize import quantize_blockwise_sums

        return quantize_blockwise_sums(dy, fp8_dtype, power_2_scale, mn_major=(mn_major,) * 2)
    data, s, data_t, s_t = _quantize_block(dy, fp8_dtype, 1, power_2_scale)
    return data, s, data_t, s_t, dy.sum(0, dtype=torch.float32) if sums else None


def _norm_quantize_block(x, norm, fp8_dtype, power_2_scale, mn_major=(False, False)):
    """``(data, scale_inv, data_t, scale_inv_t, mean, rsigma)``: the norm prologue (``norm`` as
    in ``linear_fp8._norm_quantize``) in 1x128 blocks, rows padded to a multiple of 16
    (``kernels.act_quantize.norm_quantize_block`` on CUDA: the norm is never written, and
    ``mn_major`` asks for its scales in the GEMM's layout; elsewhere the norm op's output,
    padded, quantised: the same bytes, compact scales)."""
    weight, bias, normalization, eps, zcg = norm
    if x.device.type == "cuda":
        from te_compile.kernels.act_quantize import norm_quantize_block

        return norm_quantize_block(
            x.contiguous(), weight, bias, normalization, eps, zcg, fp8_dtype,
            _padded(x.shape[0]), power_2_scale, mn_major=mn_major,
        )  # fmt: skip
    y, mean, rsigma = _norm_fwd(x, weight, bias, normalization, eps, zcg)
    data, s, data_t, s_t = _quantize_block(_pad_rows(y), fp8_dtype, 1, power_2_scale)
    return data, s, data_t, s_t, mean, rsigma


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
    native: bool,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    normalization: str = "",
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> tuple[Tensor, list[Tensor]]:
    """``(out, saved)``: emulated, ``saved = [Q_M(X)^T, Q_N(W)^T]`` dequantised (see the module
    docstring); ``native`` (``kind="block"``), ``saved = [X^T data, its scales, W^T data, its
    scales]`` (FP8 bytes as uint8). ``power_2_scale`` and ``weight_block_rows`` (1: 1x128,
    128: 128x128) apply to ``block``. With a ``normalization`` (LayerNormLinear), ``X`` is the
    norm of ``inp`` (natively: quantised without being written, on CUDA) and ``saved`` ends with
    its ``mean, rsigma``."""
    norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    _check(inp, weight, bias, kind, norm)
    _check_native(native, kind, weight, weight_block_rows, fwd_dtype, bwd_dtype)
    x = inp.reshape(-1, inp.shape[-1])
    stats = []
    if native:
        u8 = torch.uint8
        if normalization:
            xd, xs, xd_t, xs_t, *stats = _norm_quantize_block(x, norm, fwd_dtype, power_2_scale)
        else:
            xd, xs, xd_t, xs_t = _quantize_block(x, fwd_dtype, 1, power_2_scale)
        wd, ws, wd_t, ws_t = _quantize_block(weight, fwd_dtype, weight_block_rows, power_2_scale)
        out = _block_scaled_mm(xd, xs, 1, wd, ws, weight_block_rows, inp.dtype, bias)
        out = out.reshape(*inp.shape[:-1], weight.shape[0])
        return out, [xd_t.view(u8), xs_t, wd_t.view(u8), ws_t, *stats]
    if normalization:
        x, *stats = _norm_fwd(x, norm_weight, norm_bias, normalization, norm_eps,
                              zero_centered_gamma)  # fmt: skip
    x_row, x_col_t = qdq_both(x, kind, fwd_dtype, 1, power_2_scale)
    w_row, w_col_t = qdq_both(weight, kind, fwd_dtype, weight_block_rows, power_2_scale)
    out = torch.nn.functional.linear(x_row, w_row, None if bias is None else bias.float())
    out = out.to(inp.dtype).reshape(*inp.shape[:-1], weight.shape[0])
    return out, [x_col_t, w_col_t, *stats]


def native_block_supported(
    weight: Tensor, weight_block_rows: int, fwd_dtype: torch.dtype, bwd_dtype: torch.dtype
) -> bool:
    """Whether the native blockwise GEMMs take these operands (the device aside): E4M3 in both
    directions (cuBLAS's blockwise kernels take E4M3 operands) and, with 128x128 weight blocks,
    both feature counts multiples of 512 (the weight's K / 128 scale dimension, in_features for
    the forward and out_features for dgrad, a multiple of 4). On the H100 (torch 2.11,
    2026-11-22) other widths gave wrong dgrad products with the compact scale layout, and a
    padded one was refused; 1x128 weight blocks have no such limit."""
    return _native_dtypes_ok(fwd_dtype, bwd_dtype) and _native_shapes_ok(weight, weight_block_rows)


def _native_dtypes_ok(fwd_dtype: torch.dtype, bwd_dtype: torch.dtype) -> bool:
    return fwd_dtype == bwd_dtype == _NATIVE_FP8


def _native_shapes_ok(weight: Tensor, weight_block_rows: int) -> bool:
    return weight_block_rows == 1 or (weight.shape[0] % 512 == 0 and weight.shape[1] % 512 == 0)


# The FP8 format of the native path (the forward's, saved as bytes, and the gradient's).
_NATIVE_FP8 = torch.float8_e4m3fn


def _check_native(
    native: bool,
    kind: str,
    weight: Tensor,
    weight_block_rows: int,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
) -> None:
    if not native:
        return
    if kind != "block":
        raise ValueError(f"te.linear_block_scaled: native GEMMs exist for kind='block' only, "
                         f"got kind={kind!r}")  # fmt: skip
    if not _native_dtypes_ok(fwd_dtype, bwd_dtype):
        raise ValueError(
            f"te.linear_block_scaled: native blockwise GEMMs take E4M3 operands; got fwd_dtype="
            f"{fwd_dtype}, bwd_dtype={bwd_dtype}"
        )
    if not _native_shapes_ok(weight, weight_block_rows):
        raise ValueError(
            "te.linear_block_scaled: native GEMMs with 128x128 weight blocks need in_features and "
            f"out_features to be multiples of 512; weight is {list(weight.shape)}"
        )


def _cdiv(a, b):
    return -(-a // b)


@linear_block_scaled_fwd.register_fake
def _fwd_fake(
    inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, weight_block_rows, native,
    norm_weight=None, norm_bias=None, normalization="", norm_eps=1e-5, zero_centered_gamma=False,
):  # fmt: skip
    norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    _check(inp, weight, bias, kind, norm)
    _check_native(native, kind, weight, weight_block_rows, fwd_dtype, bwd_dtype)
    m, k, n = inp.numel() // inp.shape[-1], weight.shape[1], weight.shape[0]
    out = inp.new_empty(*inp.shape[:-1], n)
    f32, u8 = torch.float32, torch.uint8
    stats = _fake_stats(inp, m, normalization)
    if native:
        saved = [
            inp.new_empty(k, m, dtype=u8),
            inp.new_empty(k, _cdiv(m, 128), dtype=f32),
            inp.new_empty(k, n, dtype=u8),
            inp.new_empty(_cdiv(k, weight_block_rows), _cdiv(n, 128), dtype=f32),
        ]
        return out, saved + stats
    return out, [inp.new_empty(k, m, dtype=f32), inp.new_empty(k, n, dtype=f32), *stats]


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
    norm_inp: Tensor | None = None,
    norm_weight: Tensor | None = None,
    normalization: str = "",
    zero_centered_gamma: bool = False,
    has_norm_bias: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias, dnorm_weight, dnorm_bias)``, 0-element where not computed.
    ``saved`` is the forward's: two dequantised copies (emulated) or four (data, scales) tensors
    (native), then the norm's statistics with a ``normalization`` (``norm_inp``: the forward's
    input; ``dinp`` goes through the norm's backward)."""
    n_stats = 2 if normalization else 0
    saved, stats = saved[: len(saved) - n_stats], saved[len(saved) - n_stats :]
    if len(saved) == 4:
        dinp, dweight, dbias = _native_bwd(grad_out, saved, bwd_dtype, power_2_scale, has_bias,
                                           need_dgrad, need_wgrad)  # fmt: skip
    else:
        dinp, dweight, dbias = _emulated_bwd(grad_out, saved, kind, bwd_dtype, power_2_scale,
                                             has_bias, need_dgrad, need_wgrad)  # fmt: skip
    dnorm = [grad_out.new_empty(0), grad_out.new_empty(0)]
    if need_dgrad and normalization:
        norm = (norm_weight, stats, normalization, zero_centered_gamma, has_norm_bias)
        dx, *dnorm = _through_norm(dinp.reshape(-1, dinp.shape[-1]), norm_inp, *norm)
        dinp = dx.reshape(dinp.shape)
    return dinp, dweight, dbias, *dnorm


def _emulated_bwd(grad_out, saved, kind, bwd_dtype, power_2_scale, has_bias, need_dgrad,
                  need_wgrad):  # fmt: skip
    x_col_t, w_col_t = saved
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    g_row, g_col_t = qdq_both(dy, kind, bwd_dtype, 1, power_2_scale)
    empty = grad_out.new_empty(0)
    dinp = empty
    dtype = grad_out.dtype
    if need_dgrad:  # [M, N] @ [N, K]
        dinp = (g_row @ w_col_t.t()).to(dtype).reshape(*grad_out.shape[:-1], w_col_t.shape[0])
    dweight = (g_col_t @ x_col_t.t()).to(dtype) if need_wgrad else empty.clone()  # [N, M] @ [M, K]
    dbias = dy.sum(0, dtype=torch.float32).to(dy.dtype) if has_bias else empty.clone()
    return dinp, dweight, dbias


def _native_bwd(grad_out, saved, bwd_dtype, power_2_scale, has_bias, need_dgrad, need_wgrad):
    """dgrad ``dY @ W`` (1x128 x 128x128 blocks along N) and wgrad ``dY^T @ X`` (1x128 x 1x128
    along M) from the FP8 copies the forward saved."""
    xd_t, xs_t, wd_t, ws_t = saved
    k, n = wd_t.shape
    w_rows = 1 if ws_t.shape[0] == k else 128  # the weight's block rows (k >= 16)
    dy = grad_out.reshape(-1, n)
    dtype = grad_out.dtype
    gd, gs, gd_t, gs_t, db = _quantize_block_sums(dy, bwd_dtype, power_2_scale, has_bias, True)
    fwd_dtype = _NATIVE_FP8
    empty = grad_out.new_empty(0)
    dinp = empty
    if need_dgrad:
        w_t = wd_t.view(fwd_dtype)  # [K, N]: W^T in blocks along N
        dinp = _block_scaled_mm(gd, gs, 1, w_t, ws_t, w_rows, dtype)
        dinp = dinp.reshape(*grad_out.shape[:-1], k)
    dweight = empty.clone()
    if need_wgrad:
        dweight = _block_scaled_mm(gd_t, gs_t, 1, xd_t.view(fwd_dtype), xs_t, 1, dtype)
    dbias = db.to(dtype) if has_bias else empty.clone()
    return dinp, dweight, dbias


@linear_block_scaled_bwd.register_fake
def _bwd_fake(
    grad_out, saved, kind, bwd_dtype, power_2_scale, has_bias, need_dgrad, need_wgrad,
    norm_inp=None, norm_weight=None, normalization="", zero_centered_gamma=False,
    has_norm_bias=False,
):  # fmt: skip
    saved = saved[: len(saved) - (2 if normalization else 0)]
    w_col_t = saved[-2] if len(saved) == 4 else saved[1]
    k, n = w_col_t.shape
    dinp = grad_out.new_empty(*grad_out.shape[:-1], k) if need_dgrad else grad_out.new_empty(0)
    dweight = grad_out.new_empty(n, k) if need_wgrad else grad_out.new_empty(0)
    dbias = grad_out.new_empty(n) if has_bias else grad_out.new_empty(0)
    dnorm = _fake_dnorm(grad_out, norm_weight, normalization, has_norm_bias, need_dgrad)
    return dinp, dweight, dbias, *dnorm


def _setup_context(ctx, inputs, output) -> None:
    inp, _weight, bias, kind, _fwd, bwd_dtype, power_2_scale, _w_rows, _native, *norm = inputs
    _out, saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(*_save_norm(ctx, inp, norm), *saved)
    ctx.kind, ctx.bwd_dtype, ctx.has_bias = kind, bwd_dtype, bias is not None
    ctx.power_2_scale = power_2_scale


def _backward(ctx, bwd, grad_out, _grad_saved):
    norm_inp, norm_weight, *saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_wgrad, need_bgrad = need[1:3]
    normalization, zcg, has_norm_bias = ctx.norm
    need_dgrad = need[0] or _norm_needs_dgrad(ctx, 9)
    dinp, dweight, dbias, dnorm_w, dnorm_b = bwd(
        grad_out.contiguous(), saved, ctx.kind, ctx.bwd_dtype, ctx.power_2_scale,
        ctx.has_bias and need_bgrad, need_dgrad, need_wgrad, norm_inp, norm_weight,
        normalization, zcg, has_norm_bias,
    )  # fmt: skip
    grads = [
        dinp if need[0] else None,
        dweight if need_wgrad else None,
        dbias if ctx.has_bias and need_bgrad else None,
        *(None,) * 6,
    ]
    return _with_norm_grads(ctx, grads, dnorm_w, dnorm_b)


def _samples(device: torch.device):
    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    yield SampleInput((t(32, 64), t(32, 64), t(32), "mxfp8", e4m3, e4m3, False, 1, False))
    yield SampleInput((t(2, 16, 32, dtype=torch.float32), t(64, 32, dtype=torch.float32), None,
                       "mxfp8", e4m3, e5m2, False, 1, False))  # fmt: skip
    yield SampleInput((t(16, 32), t(48, 32), t(48), "nvfp4", e4m3, e4m3, False, 1, False))
    # Float8BlockScaling: 1x128 activations (a partial block: K=144), 128x128 weight tiles.
    yield SampleInput((t(32, 144), t(160, 144), None, "block", e4m3, e4m3, True, 128, False))
    # The native path (GEMMs emulated off CUDA), with a bias and 1x128 weight blocks too.
    yield SampleInput((t(32, 512), t(512, 512), t(512), "block", e4m3, e4m3, False, 128, True))
    yield SampleInput((t(48, 256), t(32, 256), None, "block", e4m3, e4m3, True, 1, True))
    # Norm prologues (LayerNormLinear), norms exact in fp32 and float64 (``unit_rows``): native
    # blockwise with RMSNorm, emulated MXFP8 with LayerNorm.
    f32 = torch.float32
    yield SampleInput(
        (unit_rows(32, 512, device=device), t(512, 512, dtype=f32), t(512, dtype=f32), "block",
         e4m3, e4m3, False, 128, True, t(512, dtype=f32), None, "RMSNorm", 1e-30, False)
    )  # fmt: skip
    yield SampleInput(
        (unit_rows(32, 64, device=device), t(32, 64, dtype=f32), None, "mxfp8", e4m3, e4m3,
         False, 1, False, t(64, dtype=f32), torch.zeros(64, device=device, requires_grad=True),
         "LayerNorm", 1e-30, False)
    )  # fmt: skip


class _Reference(torch.autograd.Function):
    """The emulation written out with autograd.Function in the input's dtype (fp64 in the tests):
    autograd alone cannot express it, since each backward GEMM quantises its operands along a
    different dim than the forward did."""

    @staticmethod
    def forward(ctx, inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, w_rows, _nat):
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
        return dinp, g_col_t @ x_col_t.t(), dbias, *(None,) * 6


def _reference(
    inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, w_rows, native, *norm
):  # fmt: skip
    """The emulation (the native path quantises identically; only its GEMMs differ), after the
    norm's reference when there is a norm prologue."""
    return _Reference.apply(
        norm_ref(inp, norm), weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, w_rows,
        native,
    )  # fmt: skip


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
    native: bool = False,
    normalization: str = "",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> Tensor:
    """``inp @ weight.T + bias`` with MXFP8 (``kind="mxfp8"``, element formats ``fwd_dtype`` /
    ``bwd_dtype``) or NVFP4 (``kind="nvfp4"``) operands, emulated, or FP8 blockwise
    (``kind="block"``): native GEMMs with ``native=True`` (the caller checks
    ``te.is_fp8_block_scaling_available()``; E4M3 both ways, cuBLAS's blockwise kernels take
    E4M3 operands), else emulated (module docstring). ``normalization`` ("LayerNorm" /
    "RMSNorm", with ``norm_weight`` and for LayerNorm optionally ``norm_bias``): ``norm(inp)``
    is the GEMM's input, quantised without being written on the native CUDA path."""
    norm = ()
    if normalization or norm_weight is not None or norm_bias is not None:
        norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    out, _saved = _linear_block_scaled(
        inp, weight, bias, kind, fwd_dtype, bwd_dtype, power_2_scale, weight_block_rows, native,
        *norm,
    )  # fmt: skip
    return out
