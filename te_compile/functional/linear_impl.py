"""The linear family's implementations: what ``te::linear_fwd`` / ``te::linear_bwd``
(``linear_ops.py``, which documents them) compute on each device (``cuda``: its numerics,
``linear_ops.py``'s "Numerics"). ``forward_impl``: the optional norm prologue, the operands
quantised through ``functional.gemm.QUANTIZERS``, the recipe's GEMM (``functional.gemm.GEMMS``),
the epilogue, the tensors the backward needs; ``backward_impl``: the epilogue's and the
prologue's backward around the dgrad and wgrad GEMMs (quantised: ``_quantized_backward``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._numerics import acc_dtype
from te_compile.functional.activation import activation_backward, activation_forward
from te_compile.functional.dense_weight import weight_operand
from te_compile.functional.family import BwdArgs
from te_compile.functional.gemm import (
    PER_TENSOR,
    accumulate_wgrad,
    amax_buffer,
    empty,
    fp8_bytes,
    fp8_codes,
    gemm,
    gemm_kind,
    grad_amax_slots,
    hp_linear,
    pad_rows,
    quantize_operand,
    quantize_operands,
    scale_slots,
    unpad,
    wgrad_gemm,
)
from te_compile.functional.linear_args import LinearArgs, check_linear
from te_compile.functional.prologue import Norm, norm_backward, norm_forward, norm_quantize
from te_compile.functional.quantize import dequantize_blockwise
from te_compile.functional.spec import QuantSpec


def forward_impl(a: LinearArgs, cuda: bool) -> tuple[Tensor, Tensor, list[Tensor]]:
    check_linear(a)
    inp, weight, bias, ep = a.inp, a.weight, a.bias, a.ep
    dtype, n = inp.dtype, weight.shape[0]
    branch = inp.clone(memory_format=torch.contiguous_format) if ep.branch else empty(inp)
    if a.plain:  # te.Linear in high precision: the hot path
        return hp_linear(inp, weight, bias, cuda), branch, []
    x2 = inp.reshape(-1, inp.shape[-1])
    saved, stats, amax = [], [], []
    fuse_bias = bias if not ep.activation else None
    xs, ws, _ = a.specs
    recipe, norm, bw, override = xs.kind, a.nrm, a.bw, a.bw.override
    m, acc = x2.shape[0], None if cuda or recipe else acc_dtype(inp)
    c = (lambda t: t) if acc is None else (lambda t: None if t is None else t.to(acc))
    if norm.normalization and (not recipe or override == "high_precision"):
        x2, *stats = norm_forward(x2, norm)  # saved: the high-precision GEMM input
        saved.append(x2)
    if not recipe:
        if cuda and a.residual is not None:  # one GEMM with the residual in its epilogue
            out = torch.addmm(a.residual.reshape(-1, n), x2, weight.t(), alpha=ep.scale)
            if bias is not None:
                out.add_(bias, alpha=ep.scale)
            return out.reshape(a.residual.shape), branch, saved + stats
        h = gemm("mm", c(x2), None, c(weight), None, dtype, bias=c(fuse_bias))
    else:
        prologue = norm if norm.normalization and override != "high_precision" else None
        h, xq, wq, q_amax, q_stats = quantized_gemm(
            x2, weight, fuse_bias, a.scale, xs, ws, prologue, a.weight_q, not bw.save_input
        )
        stats, amax = stats + q_stats, [] if q_amax is None else [q_amax]
        if override == "dequantized":  # the forward's operands, dequantised
            saved = [_dequantized(xs, xq, m, dtype), _dequantized(ws, wq, n, dtype)]
        elif bw.save_input and not override:  # the input itself is saved instead of its copy
            saved = [x2.new_empty(0, dtype=fp8_bytes(wq.data_t).dtype),
                     x2.new_empty(0, dtype=torch.float32)]  # fmt: skip
        elif not override:
            saved = [fp8_bytes(xq.data_t), xq.scale_t]
        if not override and a.weight_q is None:  # (a pre-quantised weight's are inputs)
            saved += [fp8_bytes(wq.data_t), wq.scale_t]
    y = h
    if ep.activation:
        y = activation_forward(h, c(bias), ep.activation, *ep.params)
        saved.append(h)
    if a.residual is not None:
        r = a.residual.reshape(y.shape)
        y = r.to(acc) + ep.scale * y if acc else torch.add(r, y, alpha=ep.scale)
    elif ep.scale != 1.0:
        y = y * ep.scale
    return y.to(dtype).reshape(*inp.shape[:-1], y.shape[-1]), branch, saved + stats + amax


def _dequantized(spec: QuantSpec, q, rows: int, dtype) -> Tensor:
    """The rowwise operand ``q`` (what the forward GEMM multiplied) dequantised to ``dtype``,
    its first ``rows`` rows (backward ``"dequantized"``)."""
    if gemm_kind(spec.kind, spec.emulate) == "dequantized":  # the dequantised fp32 values
        values = q.data
    elif spec.kind in PER_TENSOR:
        values = q.data.float() * q.scale
    else:
        values = dequantize_blockwise.eager(q.data.view(torch.uint8), q.scale, spec.block_rows,
                                            spec.fp8_dtype, torch.float32)  # fmt: skip
    # A copy where the values are the operand's own tensor (an output may not alias another).
    return values[:rows].to(dtype, copy=values is q.data)


def backward_impl(grad, grad_branch, saved, inp, weight, bias, main_grad, scale, grad_amax,
                  norm_weight, rng_state, c: BwdArgs, cuda: bool):  # fmt: skip
    dtype = grad.dtype
    ep, normalization = c.ep, c.norm.normalization
    # saved: the quantised copies [4] or the high-precision GEMM input (with a norm), then the
    # GEMM output before the activation (with one), then the norm's statistics.
    act, i = bool(ep.activation), 4 if c.recipe else int(bool(normalization))
    copies = saved[:4] if c.recipe else []
    h, stats = saved[i] if act else None, saved[i + act :]
    if copies and c.need_wgrad and copies[0].numel() == 0 and inp is not None and inp.numel():
        # save_input: the input's quantised transposed copy, made again here.
        x2 = inp.reshape(-1, inp.shape[-1])
        xq = quantize_operand(c.x, pad_rows(x2), scale=scale_slots(scale, c.recipe, 0)[0])
        copies = [fp8_bytes(xq.data_t), xq.scale_t, *copies[2:]]
    g2 = grad.reshape(-1, grad.shape[-1])
    acc = None if c.recipe or cuda else acc_dtype(grad)
    dy = g2 if acc is None else g2.to(acc)
    if ep.scale != 1.0:
        dy = dy * ep.scale
    dbias = None  # None: a 0-element output, made at the end
    if ep.activation:
        b = bias if acc is None or bias is None else bias.to(acc)
        dy, db = activation_backward(dy, h, b, ep.activation, *ep.params, c.need_dbias)
        if c.need_dbias:
            dbias = db.to(dtype)
    elif c.need_dbias and not (c.recipe == "block" and not c.x.emulate):  # native blockwise: g.sums
        dbias = (dy.sum(0) if cuda else dy.sum(0, dtype=acc or torch.float32)).to(dtype)
    b2 = None if grad_branch is None else grad_branch.reshape(-1, grad_branch.shape[-1])
    fused_branch = b2 is not None and not c.recipe and not normalization
    dinp = dweight = None
    if not c.recipe:
        x2 = saved[0] if normalization else inp.reshape(-1, inp.shape[-1])
        cast = (lambda t: t) if acc is None else (lambda t: t.to(acc))
        if c.need_dgrad:
            w = cast(weight)
            dinp = (torch.addmm(cast(b2), dy, w) if fused_branch else dy @ w).to(dtype)
        if c.need_wgrad and main_grad is not None:
            accumulate_wgrad(main_grad, dy, x2)
        elif c.need_wgrad:
            dweight = (dy.t() @ cast(x2)).to(dtype)
    else:
        dinp, dweight, db = _quantized_backward(dy, copies, main_grad, scale, grad_amax,
                                                rng_state, c, g2.shape[0])  # fmt: skip
        if db is not None:
            dbias = db.to(dtype)
    dnorm = [None, None]
    if dinp is not None:
        if normalization:
            dinp, *dnorm = norm_backward(dinp, inp, norm_weight, stats, c.norm)
        if b2 is not None and not fused_branch:
            dinp = dinp + b2
        dinp = dinp.reshape(*grad.shape[:-1], dinp.shape[-1])
    return tuple(empty(grad) if t is None else t for t in (dinp, dweight, dbias, *dnorm))


def _quantized_backward(dy, copies, main_grad, scale, grad_amax, rng_state, c: BwdArgs, m: int):
    """``(dinp 2-D, dweight, dbias)`` of a quantised recipe's GEMMs, each None where not computed;
    ``dbias`` only where the gradient's quantisation sums it (native blockwise)."""
    x_t, x_st, w_t, w_st = copies
    dtype = dy.dtype
    kind = gemm_kind(c.recipe, c.x.emulate)
    sums = c.need_dbias and kind == "blockwise" and not c.ep.activation
    (s_g,) = scale_slots(scale, c.recipe, 2)
    (slot,) = grad_amax_slots(c.recipe, dy, grad_amax)
    g = quantize_operand(c.g, pad_rows(dy), scale=s_g, columnwise=c.need_wgrad, mn_major=True,
                         sums=sums, rng_state=rng_state, slot=slot)  # fmt: skip
    if grad_amax is not None and slot is None:
        grad_amax.copy_(g.amax)
    dinp = None
    if c.need_dgrad:  # dX [M, K] = dY [M, N] @ W [N, K]; W^T [K, N] is the GEMM's b
        dinp = unpad(gemm(kind, g.data, g.scale, fp8_codes(w_t, c.w.fp8_dtype), w_st, dtype,
                          fast_accum=c.g.fast_dgrad, b_block_rows=c.w.block_rows), m)  # fmt: skip
    dweight = None
    if c.need_wgrad:  # dW [N, K] = dY^T [N, M] @ X [M, K]; X^T [K, M] is the GEMM's b
        dweight = wgrad_gemm(kind, g.data_t, g.scale_t, fp8_codes(x_t, c.x.fp8_dtype), x_st, dtype,
                             main_grad, c.g.fast_wgrad)  # fmt: skip
    return dinp, dweight, g.sums


def quantized_gemm(x2: Tensor, weight: Tensor, bias: Tensor | None, scale: Tensor | None,
                   xs: QuantSpec, ws: QuantSpec, norm: Norm | None, weight_q=None,
                   x_t: bool = True):  # fmt: skip
    """A quantised recipe's forward GEMM: ``(h [M, N], xq, wq, amax, stats)``, ``x2`` through
    the optional ``norm`` prologue (fused into the cast, ``stats`` its statistics) and ``weight``
    (or its pre-quantised ``weight_q``) quantised by ``xs`` / ``ws`` (``x_t``: the input's
    transposed copy too), ``bias`` in the GEMM; ``amax``: the per-tensor recipes' ``[amax(X),
    amax(W)]``, else None. :func:`forward_impl`'s, and te.Linear's FP8 eager fast path's."""
    s_x, s_w = scale_slots(scale, xs.kind, 0, 1)
    # The input's and the weight's amax in one buffer (a pre-quantised weight has its own).
    bits, (a_x, a_w) = amax_buffer(xs.kind, x2, 2, shared=weight_q is None)
    xq, stats = None, []
    if norm is not None:
        xq, *stats = norm_quantize(xs, x2, norm, scale=s_x, slot=a_x)
    if xq is None and weight_q is None:  # both casts in one launch where they can be
        xq, wq = quantize_operands((xs, ws), (pad_rows(x2), weight), (s_x, s_w), (a_x, a_w),
                                   (x_t, True))  # fmt: skip
    else:  # pre-quantised: a copy is an input's
        if xq is None:
            xq = quantize_operand(xs, pad_rows(x2), scale=s_x, columnwise=x_t, slot=a_x)
        wq = weight_operand(weight_q, ws, weight, s_w, slot=a_w)
    h = gemm(gemm_kind(xs.kind, xs.emulate), xq.data, xq.scale, wq.data, wq.scale, x2.dtype,
             bias=bias, fast_accum=True, b_block_rows=ws.block_rows)  # fmt: skip
    amax = bits if bits is not None or xs.kind not in PER_TENSOR else torch.cat([xq.amax, wq.amax])
    return unpad(h, x2.shape[0]), xq, wq, amax, stats
