r"""The per-tensor FP8 grouped GEMMs, ``grouped_linear_ops.GROUPED_GEMMS``' ``"scaled_grouped_mm"``:
current scaling with rowwise scales, delayed scaling per tensor.

The same math as the high-precision grouped GEMMs with the forward and the dgrad GEMMs in FP8
(and the wgrad with ``fp8_wgrad``), scaled the way Hopper's grouped FP8 GEMM
``torch._scaled_grouped_mm`` takes them: one fp32 scale per row of the left operand and one per
(group, output column) of the 3-D right operand, each from the amax over the GEMM's
contraction dim (current scaling: measured now):

.. math::
    Y_g = \mathrm{diag}(s_x^{-1})\, X_8\, W_{8,g}^\top\, \mathrm{diag}(s_{w,g}^{-1}) + b_g,\qquad
    dX_g = \mathrm{diag}(s_{dy}^{-1})\, dY_8\, \tilde W_{8,g}\, \mathrm{diag}(\tilde s_{w,g}^{-1})

* forward: ``X`` per token row (amax over ``K``), ``W`` per (group, output row), to ``fwd_dtype``;
* dgrad ``dX_g = dY_g W_g``: ``dY`` per token row to ``bwd_dtype``, ``W`` per (group, input
  column), amax over ``N`` (the forward saves this copy, transposed to ``[G, K, N]``);
* wgrad ``dW_g = dY_g^T X_g``: high precision (``functional.grouped_gemm``'s), or with
  ``fp8_wgrad`` in FP8 with scales per (group, column), amax over the group's tokens, both
  operands written transposed with every group padded to a multiple of 16 tokens
  (:func:`quantize_group_columns`; the forward saves the input's copy instead of the input).
  The bias gradient is the per-group sum of the high-precision ``dY``.

The rowwise casts are the row-scaled ``"current"`` and ``"delayed"`` rows of
``functional.gemm.QUANTIZERS``. Delayed scaling: one given scale per tensor instead (``scale``
``[3]``: input, weight, gradient), each inverse scale
broadcast to the rowwise vectors the grouped GEMM takes; the forward returns ``[amax(X),
amax(W)]``, the backward writes ``amax(dY)`` into ``grad_amax``. Current scaling measures the
amaxes (a read of each operand more) only given ``grad_amax``: a delayed state's first step.

CUDA (bf16): ``functional.gemm.GEMMS["scaled_grouped_mm"]`` on device offsets (no host sync;
E4M3 codes on every path, ``functional.quantize.as_e4m3``). float32 / float16 inputs, the CPU and
``emulate``: the exact emulation per group (``"tensorwise_emulated"``, rounded once). Zero rows
get scale 1 (no NaN).
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import Tensor

from te_compile._numerics import reciprocal_rn
from te_compile.functional.gemm import (
    amax_buffer,
    empty,
    gemm,
    grad_amax_slots,
    quantize_operand,
    scale_slots,
    wgrad_gemm,
)
from te_compile.functional.grouped_gemm import (
    bwd_loop,
    device_splits,
    group_rows,
    grouped_mm_backward,
    host_splits,
    row_bias,
)
from te_compile.functional.quantize import as_e4m3
from te_compile.functional.quantize_mx_ref import tensor_amax
from te_compile.functional.spec import QuantSpec
from te_compile.kernels import runs_triton

__all__ = [
    "per_tensor_backward",
    "per_tensor_forward",
    "per_tensor_weight",
    "quantize_group_columns",
    "wgrad_capacity",
]


def _gemm_loop(
    aq: Tensor, sa: Tensor, bq: Tensor, sb: Tensor, splits: list[int], dtype, bias=None
) -> Tensor:
    """Exact emulation: rows of group ``g`` get ``(aq_g @ bq[g]^T) * (sa_g[:, None] * sb[g])``
    (+ ``bias[g]``) in fp32, rounded once (``aq`` ``[M, C]``, ``bq`` ``[G, P, C]`` as E4M3
    codes, scales ``[M]``, ``[G, P]``); the scales multiplied first (``docs/fp8.md``)."""
    (aq, sa), (bq, sb) = as_e4m3(aq, sa), as_e4m3(bq, sb)
    ends = list(accumulate(splits))
    return gemm("tensorwise_emulated", aq, sa, bq, sb, dtype, bias=bias, offs=ends)


def wgrad_capacity(rows: int, groups: int) -> int:
    """Columns of a wgrad operand's transposed copy: every group's rows rounded up to a multiple
    of 16 fit in ``rows + 15 * groups``, rounded up to 16 (a static shape)."""
    return (rows + 15 * groups + 15) // 16 * 16


def quantize_group_columns(
    x: Tensor,
    m_splits: Tensor,
    fp8_dtype: torch.dtype,
    scale: Tensor | None = None,
    splits_ends: tuple[Tensor, Tensor] | None = None,
    e4m3_codes: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """A grouped wgrad operand: ``(data_t, scale_inv, pad_ends)``. Every column of every token
    group of ``x`` ``[M, C]`` cast with its own current scale (amax over the group's rows; with
    ``scale`` ``[1]``: that per-tensor scale), written transposed into ``data_t`` ``[C,
    capacity]`` (:func:`wgrad_capacity`), each group's columns from a multiple of 16 (zero
    padding); ``scale_inv`` fp32 ``[G, C]`` (current: 1 for an empty group); ``pad_ends`` int32
    ``[G]``: the grouped GEMM's ``offs``. CUDA: one Triton launch on device offsets (the loop's
    bytes); ``splits_ends``: :func:`device_splits`' where the caller has them."""
    groups, c = m_splits.shape[0], x.shape[1]
    capacity = wgrad_capacity(x.shape[0], groups)
    if runs_triton(x):
        from te_compile.kernels import quantize_rows

        splits, ends = splits_ends if splits_ends is not None else device_splits(m_splits, x)
        pad_ends = torch.cumsum((splits + 15) // 16 * 16, 0, dtype=torch.int32)
        data_t, scale_inv = quantize_rows.quantize_group_columns(
            x, ends, pad_ends, capacity, fp8_dtype, scale=scale, e4m3_codes=e4m3_codes
        )
        return data_t, scale_inv, pad_ends
    splits = host_splits(m_splits, x.shape[0])
    data_t = torch.zeros(c, capacity, dtype=torch.uint8, device=x.device)
    scale_inv = torch.ones(groups, c, dtype=torch.float32, device=x.device)
    if scale is not None:  # every group's, empty ones too (correctly rounded, as the kernel's)
        scale_inv.copy_(reciprocal_rn(scale).expand(groups, c))
    offsets = list(accumulate(((m + 15) // 16 * 16 for m in splits), initial=0))
    for (g, span), m, dst in zip(group_rows(splits), splits, offsets[:-1], strict=True):
        if m:
            data, scale_inv[g], _ = _quantize(x[span].t(), fp8_dtype, scale, False)
            data_t[:, dst : dst + m] = data.view(torch.uint8)
    data_t = data_t.view(fp8_dtype)
    if e4m3_codes:
        data_t, scale_inv = as_e4m3(data_t, scale_inv)
    return data_t, scale_inv, torch.tensor(offsets[1:], dtype=torch.int32, device=x.device)


def _gemm_wgrad(
    dyt: Tensor, dys: Tensor, xt: Tensor, xs: Tensor, pad_ends: Tensor, native: bool, dtype,
    main_grad: Tensor | None, fast: bool = False):  # fmt: skip
    """The FP8 wgrad ``dW_g = (dY_g^T diag(dys_g)) (diag(xs_g) X_g)`` from the operands of
    :func:`quantize_group_columns` (grouped along their columns by ``pad_ends``): ``[G, N, K]``, or
    0-element where added to ``main_grad``. ``native``: the ``"scaled_grouped_mm"`` GEMM, else the
    exact emulation per group (``"tensorwise_emulated"``, in fp32 into ``main_grad``). ``fast``:
    ``fast_wgrad``."""
    if native:
        dw = gemm("scaled_grouped_mm", dyt, dys, xt, xs, torch.bfloat16, fast_accum=fast,
                  offs=pad_ends)  # fmt: skip
        if main_grad is None:
            return dw
        main_grad.add_(dw)
        return dw.new_empty(0)
    (dyt, dys), (xt, xs) = as_e4m3(dyt, dys), as_e4m3(xt, xs)
    return wgrad_gemm("tensorwise_emulated", dyt, dys, xt, xs, dtype, main_grad,
                      offs=pad_ends.tolist())  # fmt: skip


def _quantize(
    x: Tensor, fp8_dtype: torch.dtype, scale: Tensor | None, measure: bool, e4m3_codes=False,
    slot: tuple[Tensor, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(data, scale_inv, amax)`` of ``x`` cast along its last dim, ``scale_inv`` one per row:
    the row-scaled ``"current"`` (``scale`` None) or ``"delayed"`` row of
    ``functional.gemm.quantize_operand`` (``e4m3_codes`` and ``slot`` passed on). ``amax``:
    delayed scaling's; current scaling's ``[1]`` measured only with ``measure``, else
    0-element."""
    spec = QuantSpec("current" if scale is None else "delayed", fp8_dtype, row_scaled=True)
    q = quantize_operand(spec, x.flatten(0, -2), scale=scale, columnwise=False, slot=slot,
                         e4m3_codes=e4m3_codes)  # fmt: skip
    amax = tensor_amax(x).reshape(1) if scale is None and measure else q.amax
    return q.data.view(x.shape), q.scale.view(x.shape[:-1]), amax


def per_tensor_weight(
    weight: Tensor, fwd_dtype: torch.dtype, w_scale: Tensor | None, measure: bool, slot=None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``weight`` ``[G, N, K]`` as the per-tensor grouped GEMMs take it: ``(data [G, N, K],
    scale_inv [G, N], data_t [G, K, N], scale_inv_t [G, K], amax)`` (:func:`_quantize`), the
    dgrad copy along ``N`` (delayed: the forward's codes transposed). CUDA: the dgrad copy by
    one Triton kernel that reads ``weight`` along ``K`` and writes the FP8 data transposed
    (bit-identical), where a strided copy took about 0.5 ms at 8 x 2048 x 4096 on the H100. The
    forward's own cast and the pre-quantised weight (``functional.grouped_weight``) both come
    from here: the same bytes. ``slot``: :func:`_quantize`'s."""
    wq, ws, amax = _quantize(weight, fwd_dtype, w_scale, measure, slot=slot)
    if runs_triton(weight):
        from te_compile.kernels import quantize_rows

        wq_t, ws_t = quantize_rows.quantize_columnwise_transposed(weight, fwd_dtype, scale=w_scale)
    else:  # the transposed weight cast along N (delayed: the forward's codes, transposed)
        wq_t, ws_t, _ = _quantize(weight.transpose(1, 2), fwd_dtype, w_scale, False)
        wq_t = wq_t.contiguous()  # (one expert: the cast keeps the transposed view's strides)
    return wq, ws, wq_t, ws_t, amax


def per_tensor_forward(inp, m_splits, weight, bias, r, cuda, weight_q=None):
    """``saved = [W_8^T [G, K, N] (uint8), its inverse scales [G, K]]`` (not with ``weight_q``,
    :func:`per_tensor_weight`'s: the caller saves it), with ``fp8_wgrad`` then ``[X_8^T [K,
    capacity] (uint8), its inverse scales [G, K]]``, then the amaxes. A bf16 ``inp`` on CUDA, not
    ``r.x.emulate``: the grouped GEMM on device offsets, else the exact emulation per group."""
    native = cuda and inp.dtype is torch.bfloat16 and not r.x.emulate
    measure = r.grad_amax is not None
    s_x, s_w = scale_slots(r.scale, r.x.kind, 0, 1)
    fwd_dtype = r.x.fp8_dtype
    # Delayed scaling, both casts by the kernel: one [2] amax buffer they fold into (no cat).
    shared = s_x is not None and weight_q is None and runs_triton(inp) and runs_triton(weight)
    buf, (x_slot, w_slot) = amax_buffer(r.x.kind, inp, 2, shared)
    if weight_q is None:
        wq, ws, wq_t, ws_t, w_amax = per_tensor_weight(weight, fwd_dtype, s_w, measure, w_slot)
    else:  # pre-quantised (uint8 codes); its dgrad copy is the caller's to save
        wq, ws, wq_t, ws_t, w_amax = weight_q
        wq, wq_t = wq.view(fwd_dtype), wq_t.view(fwd_dtype)
    xq, xs, x_amax = _quantize(inp, fwd_dtype, s_x, measure, slot=x_slot)
    amaxes = [buf] if shared else [torch.cat([x_amax, w_amax])] if x_amax.numel() else []
    dsplits = device_splits(m_splits, inp) if native else None
    if native:
        out = gemm("scaled_grouped_mm", xq, xs, wq, ws, torch.bfloat16, fast_accum=True,
                   offs=dsplits[1])  # fmt: skip
        if bias is not None:
            out += row_bias(bias, dsplits[0], inp.shape[0])
    else:
        out = _gemm_loop(xq, xs, wq, ws, host_splits(m_splits, inp.shape[0]), inp.dtype, bias)
    if r.bw.override == "dequantized":  # the values the GEMM multiplied (E5M2: its E4M3 codes')
        pairs = as_e4m3(xq, xs), as_e4m3(wq, ws)
        return out, [*((q.float() * s.unsqueeze(-1)).to(inp.dtype) for q, s in pairs), *amaxes]
    saved = [wq_t.view(torch.uint8), ws_t] if weight_q is None and not r.bw.override else []
    if r.bw.fp8_wgrad:
        xt, xs_t, _ = quantize_group_columns(inp, m_splits, fwd_dtype, s_x, dsplits)
        saved += [xt.view(torch.uint8), xs_t]
    return out, saved + amaxes


def per_tensor_backward(grad_out, saved, inp, m_splits, weight, main_grad, r, has_bias,
                        need_dgrad, need_wgrad, cuda):  # fmt: skip
    """The dgrad in FP8; the wgrad in FP8 where the forward saved the input's FP8 copy (or
    ``r.bw.fp8_wgrad`` and the input kept), else in high precision."""
    native = cuda and grad_out.dtype is torch.bfloat16 and not r.x.emulate
    s_x, s_g = scale_slots(r.scale, r.x.kind, 0, 2)
    fwd_dtype, bwd_dtype = r.x.fp8_dtype, r.g.fp8_dtype
    wq_t, ws_t = saved[0].view(fwd_dtype), saved[1]
    dinp, dweight = empty(grad_out), empty(grad_out)
    if need_dgrad or r.grad_amax is not None:  # the dgrad operand; amax(dY) into grad_amax
        measure = r.grad_amax is not None
        # Delayed scaling by the kernel: amax(dY) folded into grad_amax itself, zeroed first.
        fold = measure and s_g is not None and runs_triton(grad_out)
        (slot,) = grad_amax_slots(r.x.kind, grad_out, r.grad_amax) if fold else (None,)
        gq, gs, g_amax = _quantize(grad_out, bwd_dtype, s_g, measure, e4m3_codes=True, slot=slot)
        if measure and not fold:
            r.grad_amax.copy_(g_amax)
    dsplits = device_splits(m_splits, grad_out) if native else None
    if need_wgrad and r.bw.fp8_wgrad and len(saved) == 2:  # save_original_input: quantised here
        saved = [*saved, *quantize_group_columns(inp, m_splits, fwd_dtype, s_x, dsplits)[:2]]
    if need_wgrad and len(saved) == 4:  # the forward saved the FP8 wgrad operand of the input
        dyt, dys, pad_ends = quantize_group_columns(
            grad_out, m_splits, bwd_dtype, s_g, dsplits, e4m3_codes=True
        )
        dweight = _gemm_wgrad(dyt, dys, saved[2].view(fwd_dtype), saved[3], pad_ends, native,
                              grad_out.dtype, main_grad, r.g.fast_wgrad)  # fmt: skip
        need_wgrad = False
    if native:
        if need_dgrad:
            dinp = gemm("scaled_grouped_mm", gq, gs, wq_t, ws_t, torch.bfloat16,
                        fast_accum=r.g.fast_dgrad, offs=dsplits[1])  # fmt: skip
        hp = grouped_mm_backward(grad_out, inp, dsplits, weight, main_grad, has_bias, False,
                                 need_wgrad)  # fmt: skip
    else:
        splits = host_splits(m_splits, grad_out.shape[0])
        if need_dgrad:
            dinp = _gemm_loop(gq, gs, wq_t, ws_t, splits, grad_out.dtype)
        hp = bwd_loop(grad_out, inp, splits, weight, main_grad, has_bias, False, need_wgrad,
                      torch.float32)  # fmt: skip
    return dinp, hp[1] if need_wgrad else dweight, hp[2]
