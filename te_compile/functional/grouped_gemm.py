r"""The grouped GEMMs of the grouped linear family (``functional.grouped_linear``): one table,
:data:`GROUPED_GEMMS`, keyed by :func:`grouped_gemm_kind` (the recipe kind and ``emulate``),
each row the forward and the backward of the GEMMs of every group of rows, with the operand
quantisation of its kind.

The rows of ``inp`` ``[M, K]`` are split into ``G`` consecutive groups of ``m_splits[g]`` rows
(zero-size groups allowed), group ``g`` multiplied by ``weight[g]`` ``[N, K]``:

=======================  ===================================================================
kind                     GEMMs
=======================  ===================================================================
``"grouped_mm"``         high precision: ``torch._grouped_mm`` on device offsets (CUDA, bf16,
                         dims multiples of 8), else a GEMM per group (fp32 math on the CPU)
``"scaled_grouped_mm"``  per-tensor recipes: ``torch._scaled_grouped_mm`` with rowwise scales
                         (current scaling: one per row of ``X`` and per (group, column) of
                         ``W``; delayed: the per-tensor scales broadcast) on device offsets
                         (CUDA, bf16); elsewhere, and with ``emulate``, the exact emulation per
                         group; the wgrad in high precision or, with ``fp8_wgrad``, in FP8 with
                         scales along each group's tokens
``"blockwise"``          Float8BlockScaling, native: a blockwise-scaled ``torch._scaled_mm`` per
                         expert (host splits; every expert's tokens padded to 128 in one
                         layout)
``"dequantized"``        the block-scaled recipes emulated: the operands quantised exactly and
                         dequantised to the model's dtype (NVFP4: a global scale per expert for
                         each expert's tokens, weight and gradient), the high-precision grouped
                         GEMMs on those values
=======================  ===================================================================

``m_splits`` is an integer tensor on the input's device or the CPU; the device-offset paths
never read it on the host (``torch._assert_async`` checks ``sum == M`` and ``>= 0``), the loops
do (one sync on CUDA).

FP8 specifics (``"scaled_grouped_mm"``): torch's grouped FP8 GEMM takes E4M3 operands only and
gives a bf16 output only. An E5M2 operand (the gradient under ``HYBRID``) goes in as the E4M3
codes of its values times ``2**-7``, its inverse scales times 128 (:func:`as_e4m3`): E5M2's
largest value 57344 becomes E4M3's 448 and its 2 mantissa bits fit in E4M3's 3, so every E5M2
value down to ``amax / 57344`` of its slice is exact and the smaller ones are rounded to E4M3's
subnormal grid. The emulation applies the same recoding, so the two paths see the same codes.
The FP8 wgrad's operands are written transposed with every group padded to a multiple of 16
tokens (:func:`quantize_group_columns`; the grouped GEMM's groups along its contraction dim
must start at 16-byte offsets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile.functional.fake_quantize import qdq
from te_compile.functional.gemm import (
    HIGH_DTYPES,
    PER_TENSOR,
    block_scaled_mm,
    empty,
    padded,
    quantize_per_tensor,
)
from te_compile.functional.quantize import quantize_blockwise, quantize_tensorwise

__all__ = [
    "GROUPED_GEMMS",
    "GroupedRecipe",
    "as_e4m3",
    "as_splits_tensor",
    "device_splits",
    "grouped_gemm_kind",
    "host_splits",
    "quantize_group_columns",
    "quantize_rowwise",
    "row_bias",
    "wgrad_capacity",
]

_INT_DTYPES = (torch.int32, torch.int64)
_E4M3 = torch.float8_e4m3fn


class GroupedRecipe(NamedTuple):
    """The recipe arguments of a grouped linear op (``functional.gemm``'s, plus the delayed
    state and ``fp8_wgrad``)."""

    recipe: str = ""
    fwd_dtype: torch.dtype = _E4M3
    bwd_dtype: torch.dtype = torch.float8_e5m2
    power_2_scale: bool = False
    weight_block_rows: int = 1
    emulate: bool = False
    scale: Tensor | None = None
    grad_amax: Tensor | None = None
    fp8_wgrad: bool = False


# Splits ------------------------------------------------------------------------------------------


def as_splits_tensor(m_splits: Tensor | Sequence[int]) -> Tensor:
    """``m_splits`` as an integer tensor: tensors pass through, a list of ints becomes a CPU
    int64 tensor (a constant under ``torch.compile``)."""
    if isinstance(m_splits, Tensor):
        return m_splits
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in m_splits):
        raise ValueError(
            f"te.grouped_linear: m_splits must be a list of ints or an integer tensor, got "
            f"{m_splits!r}"
        )
    return torch.tensor(list(m_splits), dtype=torch.int64)


# High precision ("grouped_mm") ------------------------------------------------------------------


def _acc(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def host_splits(m_splits: Tensor, rows: int) -> list[int]:
    """The splits as Python ints, checked (CPU tensors: no device sync)."""
    splits = m_splits.tolist()
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(
            f"te.grouped_linear: m_splits must be >= 0 and sum to inp.shape[0] ({rows}), got "
            f"{splits if len(splits) <= 16 else '[...]'} (sum {sum(splits)})"
        )
    return splits


def _use_grouped_mm(inp: Tensor, weight: Tensor) -> bool:
    return inp.dtype is torch.bfloat16 and inp.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0


def device_splits(m_splits: Tensor, inp: Tensor) -> tuple[Tensor, Tensor]:
    """``(splits, offsets)`` on ``inp``'s device, offsets int32 (end of each group), with the
    constraints asserted on the device (no host sync)."""
    splits = m_splits.to(inp.device, non_blocking=True)
    offs = torch.cumsum(splits, 0, dtype=torch.int32)
    if splits.numel():
        ok = (offs[-1] == inp.shape[0]) & (splits >= 0).all()
        torch._assert_async(ok, "te.grouped_linear: m_splits must be >= 0 and sum to inp.shape[0]")
    return splits, offs


def row_bias(bias: Tensor, splits: Tensor, rows: int) -> Tensor:
    """``bias[group of row]`` for every row: ``[rows, out_features]``, no host sync."""
    return torch.repeat_interleave(bias, splits, dim=0, output_size=rows)


def _grouped_mm_forward(
    inp: Tensor, m_splits: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor:
    if not _use_grouped_mm(inp, weight):
        return _fwd_loop(inp, host_splits(m_splits, inp.shape[0]), weight, bias, None)
    splits, offs = device_splits(m_splits, inp)
    out = torch._grouped_mm(inp, weight.transpose(-2, -1), offs=offs)
    if bias is not None:
        out += row_bias(bias, splits, inp.shape[0])
    return out


def _fwd_loop(
    inp: Tensor, splits: list[int], weight: Tensor, bias: Tensor | None, acc: torch.dtype | None
) -> Tensor:
    """One GEMM per group, in ``acc`` (None: the input dtype), rounded once."""
    out = inp.new_empty(inp.shape[0], weight.shape[1])
    start = 0
    for g, rows in enumerate(splits):
        x = inp[start : start + rows]
        w = weight[g] if acc is None else weight[g].to(acc)
        y = (x if acc is None else x.to(acc)) @ w.t()
        if bias is not None:
            y = y + (bias[g] if acc is None else bias[g].to(acc))
        out[start : start + rows] = y
        start += rows
    return out


def _bwd_loop(grad_out, inp, splits, weight, main_grad, has_bias, need_dgrad, need_wgrad, acc):
    """Per-group GEMMs in ``acc`` (None: the input dtype); dW and db summed in fp32 at least."""
    dtype = grad_out.dtype
    cast = (lambda t: t) if acc is None else (lambda t: t.to(acc))
    dinp = grad_out.new_empty(inp.shape) if need_dgrad else empty(grad_out)
    want_dw = need_wgrad and main_grad is None
    dweight = grad_out.new_zeros(weight.shape) if want_dw else empty(grad_out)
    dbias = grad_out.new_zeros(weight.shape[:2]) if has_bias else empty(grad_out)
    start = 0
    for g, rows in enumerate(splits):
        dy, x = grad_out[start : start + rows], inp[start : start + rows]
        if need_dgrad:
            dinp[start : start + rows] = (cast(dy) @ cast(weight[g])).to(dtype)
        if need_wgrad and main_grad is not None:
            main_grad[g].addmm_(dy.t().float(), x.float())
        elif need_wgrad:
            dweight[g] = (cast(dy).t() @ cast(x)).to(dtype)
        if has_bias:
            dbias[g] = dy.sum(0, dtype=acc or torch.float32).to(dtype)
        start += rows
    return dinp, dweight, dbias


def _grouped_mm_backward(
    grad_out, inp, m_splits, weight, main_grad, has_bias, need_dgrad, need_wgrad
):
    splits, offs = device_splits(m_splits, inp)
    dinp = torch._grouped_mm(grad_out, weight, offs=offs) if need_dgrad else empty(grad_out)
    dweight = empty(grad_out)
    if need_wgrad:
        # Grouped along the reduction dim: [N, M] x [M, K] -> [G, N, K]. torch._grouped_mm only
        # outputs its operands' dtype (an fp32 out_dtype is refused, eager and meta), so with
        # main_grad dW is rounded to bf16 once and then accumulated in fp32 (no host sync).
        dw = torch._grouped_mm(grad_out.t(), inp, offs=offs)
        if main_grad is not None:
            main_grad.add_(dw)
        else:
            dweight = dw
    dbias = empty(grad_out)
    if has_bias:
        groups = torch.arange(weight.shape[0], device=inp.device)
        row_group = torch.repeat_interleave(groups, splits, output_size=inp.shape[0])
        dbias = grad_out.new_zeros(weight.shape[:2], dtype=torch.float32)
        dbias = dbias.index_add_(0, row_group, grad_out.float()).to(grad_out.dtype)
    return dinp, dweight, dbias


# Per-tensor FP8 ("scaled_grouped_mm") ---------------------------------------------------------


def quantize_rowwise(
    x: Tensor, fp8_dtype: torch.dtype, dim: int = -1, e4m3_codes: bool = False
) -> tuple[Tensor, Tensor]:
    """``(data, scale_inv)``: ``x`` cast to ``fp8_dtype`` with one current scale per slice along
    ``dim`` (``fp8_max / amax`` over ``dim``; 1 for an all-zero or non-finite slice);
    ``scale_inv`` fp32 has ``x``'s shape without ``dim``. Computed in fp32 whatever ``x``'s
    dtype, so a float64 copy of a bf16/fp32 tensor gets the same bytes and scales. CUDA
    (float32/bfloat16/float16): one Triton kernel per call (``kernels.quantize.quantize_rowwise``,
    bit-identical, the kernel tests check it), the quantised dim moved last first.
    ``e4m3_codes``: an E5M2 result as the grouped GEMM takes it (:func:`as_e4m3`; on CUDA
    written so by the same kernel)."""
    if x.is_cuda and x.dtype in HIGH_DTYPES:
        from te_compile.kernels import quantize

        moved = dim not in (-1, x.ndim - 1)
        data, scale_inv = quantize.quantize_rowwise(
            x.movedim(dim, -1) if moved else x, fp8_dtype, e4m3_codes=e4m3_codes
        )
        return (data.movedim(-1, dim).contiguous() if moved else data), scale_inv
    if e4m3_codes:
        return as_e4m3(*quantize_rowwise(x, fp8_dtype, dim))
    xf = x.float()
    limit = torch.finfo(fp8_dtype).max
    amax = xf.abs().amax(dim, keepdim=True)
    # Tensor divisions, correctly rounded: `limit / amax` would be reciprocal(amax) * limit in
    # torch (two roundings), and reciprocal() on the CPU is not correctly rounded either.
    one = torch.ones_like(amax)
    scale = torch.where(amax > 0, torch.div(torch.full_like(amax, limit), amax), one)
    scale = torch.where(torch.isfinite(scale), scale, one)
    data = (xf * scale).clamp(-limit, limit).to(fp8_dtype)
    return data, torch.div(one, scale).squeeze(dim)


def _gemm_loop(
    aq: Tensor, sa: Tensor, bq: Tensor, sb: Tensor, splits: list[int], dtype, bias=None
) -> Tensor:
    """Exact emulation: rows of group ``g`` get ``(aq_g @ bq[g]^T) * sa_g[:, None] * sb[g]``
    (+ ``bias[g]``), in fp32, rounded once to ``dtype``. ``aq`` ``[M, C]`` and ``bq``
    ``[G, P, C]`` FP8 (E5M2 as its E4M3 codes, :func:`as_e4m3`, as on the GPU), ``sa`` ``[M]``
    and ``sb`` ``[G, P]`` fp32 inverse scales."""
    aq, sa = as_e4m3(aq, sa)
    bq, sb = as_e4m3(bq, sb)
    out = torch.empty(aq.shape[0], bq.shape[1], dtype=dtype, device=aq.device)
    start = 0
    for g, rows in enumerate(splits):
        acc = aq[start : start + rows].float() @ bq[g].float().t()
        acc = acc * sa[start : start + rows, None] * sb[g]
        if bias is not None:
            acc = acc + bias[g].float()
        out[start : start + rows] = acc.to(dtype)
        start += rows
    return out


def _use_native(inp: Tensor) -> bool:
    """The grouped (device-offset, no host sync) CUDA path: bf16 output only."""
    return inp.dtype is torch.bfloat16


def as_e4m3(q: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """A GEMM operand in E4M3 codes: E4M3 ``q`` as is; E5M2 ``q`` recoded to the E4M3 codes of
    its values times ``2**-7`` with its inverse scales ``s`` times 128 (exact for every value
    of magnitude 1 or more, i.e. down to ``amax / 57344`` of its slice; smaller ones are
    rounded to E4M3's subnormal grid: ``kernels.quantize.e5m2_to_e4m3_table``). Hopper's grouped
    FP8 GEMM takes E4M3 operands only; every grouped GEMM here, on any device, sees the same
    codes."""
    if q.dtype is not torch.float8_e5m2:
        return q, s
    from te_compile.kernels import quantize

    if q.is_cuda:
        codes = quantize.recode_e5m2_as_e4m3(q)
    else:
        table = quantize.e5m2_to_e4m3_table(q.device)
        codes = table[q.view(torch.uint8).long()].view(torch.float8_e4m3fn)
    return codes, s * 128.0


def _gemm_grouped(
    aq: Tensor, sa: Tensor, bq: Tensor, sb: Tensor, splits: Tensor, offs: Tensor, fast_accum=False
) -> Tensor:
    """The grouped GEMM of :func:`_gemm_loop` on device offsets, bf16 output, no host sync:
    ``torch._scaled_grouped_mm`` on the E4M3 codes of the operands (:func:`as_e4m3`; ``a``
    row-major, ``b`` column-major, scales ``[M]`` and ``[G, P]`` fp32; ``fast_accum``: Hopper's
    fast FP8 accumulation, which the forward GEMM uses as in ``te::linear_fp8``, ~20% faster at
    32768 x 4096 -> 2048 on the H100, 2026-11-23; the dgrad promotes its partial sums to fp32).
    CPU tensors (tests of this path): the bf16 grouped GEMM of the same FP8 values, scales
    after in fp32."""
    aq, sa = as_e4m3(aq, sa)
    bq, sb = as_e4m3(bq, sb)
    if aq.is_cuda:
        return torch._scaled_grouped_mm(
            aq, bq.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )  # fmt: skip
    bf16 = torch.bfloat16
    acc = torch._grouped_mm(aq.to(bf16), bq.to(bf16).transpose(-2, -1), offs=offs)
    col = torch.repeat_interleave(sb, splits, dim=0, output_size=aq.shape[0])
    return (acc.float() * sa[:, None] * col).to(bf16)


def _quantize_weight_dgrad(weight: Tensor, fwd_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``weight`` ``[G, N, K]`` quantised per (group, input column), amax over ``N``: data
    transposed to ``[G, K, N]`` (row-major along ``N``, the dgrad GEMM's contraction dim) and
    inverse scales ``[G, K]``. CUDA: one Triton kernel reads ``weight`` along ``K`` and writes
    the FP8 data transposed (``kernels.quantize.quantize_columnwise_transposed``, bit-identical
    to the path below: the kernel tests check it); the path below first copies the transposed
    bf16 weight (a strided copy: most likely the 0.5 ms element-wise kernel of the H100 profile,
    2026-11-22)."""
    if weight.is_cuda and weight.dtype in HIGH_DTYPES:
        from te_compile.kernels import quantize

        return quantize.quantize_columnwise_transposed(weight, fwd_dtype)
    data, scale_inv = quantize_rowwise(weight.transpose(1, 2), fwd_dtype)  # along N, last
    return data.contiguous(), scale_inv


def wgrad_capacity(rows: int, groups: int) -> int:
    """Columns of a wgrad operand's transposed copy: every group's rows rounded up to a multiple
    of 16 fit in ``rows + 15 * groups``, rounded up to 16 (a static shape)."""
    return (rows + 15 * groups + 15) // 16 * 16


def quantize_group_columns(
    x: Tensor,
    m_splits: Tensor,
    fp8_dtype: torch.dtype,
    scale: Tensor | None = None,
    device_splits: tuple[Tensor, Tensor] | None = None,
    e4m3_codes: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """A grouped wgrad operand: ``(data_t, scale_inv, pad_ends)``. Every column of every token
    group of ``x`` ``[M, C]`` cast with its own current scale (amax over the group's rows;
    with ``scale`` ``[1]``: that per-tensor scale), written transposed into ``data_t``
    ``[C, capacity]`` (:func:`wgrad_capacity`) with each group's columns starting at a
    multiple of 16 (zero padding); ``scale_inv`` fp32 ``[G, C]`` (current scaling: 1 for an
    empty group) and
    ``pad_ends`` int32 ``[G]``, the padded groups' end offsets: the grouped GEMM's ``offs``.
    CUDA (float32/bfloat16/float16): one Triton launch on device offsets
    (``kernels.quantize.quantize_group_columns``, the same bytes as the loop below);
    ``device_splits``: the ``(splits, ends)`` of :func:`device_splits` when the caller has
    them already; ``e4m3_codes``: as in :func:`quantize_rowwise`."""
    groups, c = m_splits.shape[0], x.shape[1]
    capacity = wgrad_capacity(x.shape[0], groups)
    if x.is_cuda and x.dtype in HIGH_DTYPES:
        from te_compile.kernels import quantize

        splits, ends = device_splits or device_splits(m_splits, x)
        pad_ends = torch.cumsum((splits + 15) // 16 * 16, 0, dtype=torch.int32)
        data_t, scale_inv = quantize.quantize_group_columns(
            x, ends, pad_ends, capacity, fp8_dtype, scale=scale, e4m3_codes=e4m3_codes
        )
        return data_t, scale_inv, pad_ends
    splits = host_splits(m_splits, x.shape[0])
    data_t = torch.zeros(c, capacity, dtype=torch.uint8, device=x.device)
    scale_inv = torch.ones(groups, c, dtype=torch.float32, device=x.device)
    if scale is not None:  # every group's, empty ones too (correctly rounded, as the kernel's)
        scale_inv.copy_(torch.div(torch.ones_like(scale), scale).expand(groups, c))
    padded = [(m + 15) // 16 * 16 for m in splits]
    start = dst = 0
    for g, (m, p) in enumerate(zip(splits, padded, strict=True)):
        if m:
            x_g = x[start : start + m]
            if scale is None:
                data, scale_inv[g] = quantize_rowwise(x_g.t(), fp8_dtype)
            else:
                data, inv, _ = quantize_per_tensor(x_g, fp8_dtype, scale)
                data, scale_inv[g] = data.t(), inv.reshape(())
            data_t[:, dst : dst + m] = data.view(torch.uint8)
        start, dst = start + m, dst + p
    pad_ends = torch.tensor(padded, dtype=torch.int64).cumsum(0).to(torch.int32)
    data_t = data_t.view(fp8_dtype)
    if e4m3_codes:
        data_t, scale_inv = as_e4m3(data_t, scale_inv)
    return data_t, scale_inv, pad_ends.to(x.device)


def _gemm_wgrad(
    dyt: Tensor, dys: Tensor, xt: Tensor, xs: Tensor, pad_ends: Tensor, native: bool, dtype,
    main_grad: Tensor | None,
):  # fmt: skip
    """The FP8 wgrad ``dW_g = (dY_g^T diag(dys_g)) (diag(xs_g) X_g)`` from the operands of
    :func:`quantize_group_columns` (``dyt`` ``[N, P]``, ``xt`` ``[K, P]``, grouped along ``P``
    by ``pad_ends``): ``[G, N, K]`` in ``dtype``, or added to ``main_grad`` (fp32; None is
    returned then), both operands as E4M3 codes (:func:`as_e4m3`). ``native`` (bf16):
    ``torch._scaled_grouped_mm`` with the scales ``[G*N]`` / ``[G*K]`` and the promoted (not
    fast) accumulation of a gradient GEMM, bf16 out (CPU tensors, tests of this path: the bf16
    grouped GEMM of the FP8 values, scales after in fp32). Otherwise exact emulation per group:
    the fp32 GEMM of the FP8 values, the scales applied, rounded once (added in fp32 to
    ``main_grad``)."""
    dyt, dys = as_e4m3(dyt, dys)
    xt, xs = as_e4m3(xt, xs)
    if native:
        if dyt.is_cuda:
            dw = torch._scaled_grouped_mm(
                dyt, xt.t(), dys.reshape(-1), xs.reshape(-1), offs=pad_ends,
                out_dtype=torch.bfloat16, use_fast_accum=False,
            )  # fmt: skip
        else:
            acc = torch._grouped_mm(
                dyt.to(torch.bfloat16), xt.to(torch.bfloat16).t(), offs=pad_ends
            )
            dw = (acc.float() * dys[:, :, None] * xs[:, None, :]).to(torch.bfloat16)
        if main_grad is None:
            return dw
        main_grad.add_(dw)
        return None
    ends = [0, *pad_ends.tolist()]
    groups, n = dys.shape
    out = None if main_grad is not None else dys.new_empty(groups, n, xs.shape[1], dtype=dtype)
    for g in range(groups):
        cols = slice(ends[g], ends[g + 1])
        acc = (dyt[:, cols].float() @ xt[:, cols].float().t()) * dys[g][:, None] * xs[g]
        if main_grad is not None:
            main_grad[g].add_(acc)
        else:
            out[g] = acc.to(dtype)
    return out


def _quantize_delayed(
    x: Tensor, fp8_dtype: torch.dtype, scale: Tensor, rows: tuple[int, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """``x`` (viewed 2-D over its last dim) cast with the per-tensor ``scale`` ``[1]``:
    ``(data of x's shape, inverse scale broadcast to rows, amax [1])`` (the quantisation op:
    one Triton pass on CUDA)."""
    data, _, amax = quantize_tensorwise.eager(x.reshape(-1, x.shape[-1]), scale, fp8_dtype, False)
    scale_inv = scale.reciprocal().expand(rows).contiguous()
    return data.view(x.shape), scale_inv, amax


def _transposed_codes(weight: Tensor, wq: Tensor, scale: Tensor, fp8_dtype) -> Tensor:
    """Per tensor, the dgrad copy ``[G, K, N]`` of the weight is its codes ``wq`` transposed. On
    CUDA one Triton pass casts ``weight`` again and stores it transposed (the same bytes:
    ``kernels.quantize.quantize_columnwise_transposed`` with the given scale); a strided uint8
    transpose of the codes took 0.48 ms at 8 x 2048 x 4096 on the H100 (2026-11-22)."""
    if weight.is_cuda and weight.dtype in HIGH_DTYPES:
        from te_compile.kernels import quantize

        return quantize.quantize_columnwise_transposed(weight, fp8_dtype, scale=scale)[0]
    return wq.view(torch.uint8).transpose(1, 2).contiguous().view(fp8_dtype)


def _slot(scale: Tensor | None, i: int) -> Tensor | None:
    return None if scale is None else scale[i : i + 1]


def _amax(x: Tensor) -> Tensor:
    """``max |x|`` as a 0-dim fp32 tensor (0 for an empty ``x``, NaN if it holds one)."""
    return x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)


def _quantize_grad(grad_out, scale, grad_amax, bwd_dtype):
    """The dgrad operand: rowwise (E5M2 as E4M3 codes), or per tensor with ``scale[2]``; its
    amax written into ``grad_amax`` when given."""
    if scale is None:
        if grad_amax is not None:
            grad_amax.copy_(_amax(grad_out).reshape(1))
        return quantize_rowwise(grad_out, bwd_dtype, e4m3_codes=True)
    gq, gs, amax = _quantize_delayed(grad_out, bwd_dtype, scale[2:3], (grad_out.shape[0],))
    if grad_amax is not None:
        grad_amax.copy_(amax)
    return gq, gs


def _scaled_forward(
    inp, m_splits, weight, bias, scale, fwd_dtype, fp8_wgrad: bool, native: bool, measure: bool
):
    g, n, k = weight.shape
    if scale is None:
        xq, xs = quantize_rowwise(inp, fwd_dtype)
        wq, ws = quantize_rowwise(weight, fwd_dtype)
        wq_t, ws_t = _quantize_weight_dgrad(weight, fwd_dtype)
        # Measured only when asked for (grad_amax given): a read of each operand more.
        amax = inp.new_empty(0, dtype=torch.float32)
        if measure:
            amax = torch.stack([_amax(inp), _amax(weight)])
    else:
        xq, xs, x_amax = _quantize_delayed(inp, fwd_dtype, scale[0:1], (inp.shape[0],))
        wq, ws, w_amax = _quantize_delayed(weight, fwd_dtype, scale[1:2], (g, n))
        wq_t = _transposed_codes(weight, wq, scale[1:2], fwd_dtype)
        ws_t = ws[:, :1].expand(g, k).contiguous()
        amax = torch.cat([x_amax, w_amax])
    dsplits = None
    if native:
        dsplits = splits, offs = device_splits(m_splits, inp)
        out = _gemm_grouped(xq, xs, wq, ws, splits, offs, fast_accum=True)
        if bias is not None:
            out += row_bias(bias, splits, inp.shape[0])
    else:
        splits = host_splits(m_splits, inp.shape[0])
        out = _gemm_loop(xq, xs, wq, ws, splits, inp.dtype, bias)
    saved = [wq_t.view(torch.uint8), ws_t]
    if fp8_wgrad:
        x_scale = _slot(scale, 0)
        xt, xs_t, _ = quantize_group_columns(inp, m_splits, fwd_dtype, x_scale, dsplits)
        saved += [xt.view(torch.uint8), xs_t]
    return out, amax, saved


def _scaled_backward(
    grad_out, saved, inp, m_splits, main_grad, scale, grad_amax, fwd_dtype, bwd_dtype, has_bias,
    need_dgrad, need_wgrad, native,
):  # fmt: skip
    wq_t, ws_t = saved[:2]
    wq_t = wq_t.view(fwd_dtype)
    dtype = grad_out.dtype
    groups, k, n = wq_t.shape
    rows = grad_out.shape[0]
    dinp, dweight, dbias = empty(grad_out), empty(grad_out), empty(grad_out)
    if need_dgrad or grad_amax is not None:
        gq, gs = _quantize_grad(grad_out, scale, grad_amax, bwd_dtype)
    dsplits = device_splits(m_splits, grad_out) if native else None
    if need_wgrad and len(saved) == 4:  # the forward saved the FP8 wgrad operand of the input
        dyt, dys, pad_ends = quantize_group_columns(
            grad_out, m_splits, bwd_dtype, _slot(scale, 2), dsplits, e4m3_codes=True
        )
        dw = _gemm_wgrad(
            dyt, dys, saved[2].view(fwd_dtype), saved[3], pad_ends, native, dtype, main_grad
        )
        dweight = empty(grad_out) if dw is None else dw
        need_wgrad = False
    if native:
        splits, offs = dsplits
        if need_dgrad:
            dinp = _gemm_grouped(gq, gs, wq_t, ws_t, splits, offs)
        if need_wgrad:
            # [N, M] x [M, K] -> [G, N, K], grouped along the reduction dim, high precision
            # (bf16 out: torch's grouped GEMM has no fp32 output; added to main_grad in fp32).
            dweight = torch._grouped_mm(grad_out.t(), inp, offs=offs)
            if main_grad is not None:
                main_grad.add_(dweight)
                dweight = empty(grad_out)
        if has_bias:
            group_ids = torch.arange(groups, device=grad_out.device)
            row_group = torch.repeat_interleave(group_ids, splits, output_size=rows)
            dbias = grad_out.new_zeros(groups, n, dtype=torch.float32)
            dbias = dbias.index_add_(0, row_group, grad_out.float()).to(dtype)
        return dinp, dweight, dbias
    splits = host_splits(m_splits, rows)
    if need_dgrad:
        dinp = _gemm_loop(gq, gs, wq_t, ws_t, splits, dtype)
    if need_wgrad and main_grad is None:
        dweight = grad_out.new_zeros(groups, n, k)
    if has_bias:
        dbias = grad_out.new_zeros(groups, n)
    start = 0
    for g, m in enumerate(splits):
        dy = grad_out[start : start + m].float()
        if need_wgrad and main_grad is not None:
            main_grad[g].addmm_(dy.t(), inp[start : start + m].float())
        elif need_wgrad:
            dweight[g] = (dy.t() @ inp[start : start + m].float()).to(dtype)
        if has_bias:
            dbias[g] = dy.sum(0).to(dtype)
        start += m
    return dinp, dweight, dbias


# Float8BlockScaling, native ("blockwise") ------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _capacity(rows: int, groups: int) -> int:
    """Static token capacity of the padded layout: every expert's tokens rounded up to 128 fit
    in ``128 * (rows // 128 + groups)``."""
    return 128 * (rows // 128 + groups)


def _plan(splits: Sequence[int], rows: int) -> tuple[list[int], list[int], int]:
    """``(first row of each expert in inp, first row in the padded layout, padded rows)``. When
    every expert's tokens are a multiple of 128 the padded layout is ``inp`` itself; otherwise
    each expert starts at a multiple of 128 of a ``_capacity`` layout (zero rows between)."""
    firsts, starts, row, pos = [], [], 0, 0
    for m in splits:
        firsts.append(row)
        starts.append(pos)
        row, pos = row + m, pos + _cdiv(m, 128) * 128
    if all(m % 128 == 0 for m in splits):
        return firsts, firsts, rows
    return firsts, starts, _capacity(rows, len(splits))


def _padded_rows(x: Tensor, splits, firsts, starts, width: int) -> Tensor:
    """``x`` in the padded layout (one scatter; the original when they coincide)."""
    if width == x.shape[0] and starts == firsts:
        return x
    index = torch.cat(
        [torch.arange(p, p + m) for p, m in zip(starts, splits, strict=True)]
        + [torch.empty(0, dtype=torch.int64)]
    )
    out = x.new_zeros(width, x.shape[1])
    return out.index_copy_(0, index.to(x.device, non_blocking=True), x)


def _quantize_block(x: Tensor, power_2_scale: bool, block_rows: int = 1, out_t=None):
    """``(data, scale_inv, data_t, scale_inv_t)`` of ``x`` in E4M3, one pass for both directions;
    the transposed copy written into ``out_t`` when given (its scales may be rows-major, the
    GEMM's layout; on CUDA the kernel writes them in place)."""
    if x.is_cuda:
        from te_compile.kernels.quantize import quantize_blockwise as kernel

        return kernel(x, _E4M3, block_rows, power_2_scale, True, out_t=out_t)
    data, s, data_t, s_t = quantize_blockwise.eager(x, _E4M3, block_rows, power_2_scale, True)
    if out_t is None:
        return data, s, data_t, s_t
    out_t[0].copy_(data_t.view(out_t[0].dtype))
    out_t[1].copy_(s_t)
    return data, s, out_t[0].view(_E4M3), out_t[1]


def _transposed_views(codes: Tensor, scales: Tensor, width: int, k: int):
    """``[K, width]`` codes and their ``[K, width / 128]`` scales, rows-major (strides
    ``(1, K)``: an expert's columns are then in cuBLAS's layout without a copy), over the
    first elements of flat buffers."""
    return codes[: k * width].view(k, width), scales[: k * width // 128].view(-1, k).t()


def _gemm_rows(a, sa, b, sb, b_rows, dtype, bias, out):
    """``out`` ``[m, N]`` (a row slice of the result) from the first ``m`` rows of ``a``, whose
    rows beyond ``m`` up to a multiple of 16 are zeros (the padded layout). cuBLAS's blockwise
    GEMM refuses a row count that is not a multiple of 16 (H100, torch 2.11: the 8-expert
    benchmark's 7 such experts gave 14 refusals, seen as the fallback's 14 device copies), so
    such an expert runs on its rows padded to 16 and the first ``m`` rows are copied out."""
    m = out.shape[0]
    if m % 16 == 0:
        return block_scaled_mm(a[:m], sa[:m], b, sb, b_rows, dtype, bias, out=out)
    m16 = padded(m)
    return out.copy_(block_scaled_mm(a[:m16], sa[:m16], b, sb, b_rows, dtype, bias)[:m])


def _blockwise_forward(inp, m_splits, weight, bias, power_2_scale, weight_block_rows):
    """``(out, saved)``: ``out`` ``[M, out_features]``; ``saved = [X^T codes (uint8, flat: the
    first ``K * width`` bytes are ``[K, width]``, every expert's tokens from a multiple of 128),
    their 1x128 scales (fp32, flat, ``[width / 128, K]``), W_g^T codes ``[K, N]`` (uint8) for
    each expert, their scales for each expert]``; ``width`` is ``M`` when every expert's tokens
    are a multiple of 128, else the static capacity ``128 * (M // 128 + G)``. ``main_grad`` is
    only carried to the backward."""
    groups, n, k = weight.shape
    rows = inp.shape[0]
    splits = host_splits(m_splits, rows)
    firsts, starts, width = _plan(splits, rows)
    cap = _capacity(rows, groups)
    x_t = inp.new_empty(k * cap, dtype=torch.uint8)
    x_s = inp.new_empty(k * cap // 128, dtype=torch.float32)
    x = _padded_rows(inp, splits, firsts, starts, width)
    xd, xs, _, _ = _quantize_block(x, power_2_scale, 1, _transposed_views(x_t, x_s, width, k))
    out = inp.new_empty(rows, n)
    w_t, w_s = [], []
    for g, (m, row, pos) in enumerate(zip(splits, firsts, starts, strict=True)):
        wd, ws, wd_t, ws_t = _quantize_block(weight[g], power_2_scale, weight_block_rows)
        w_t.append(wd_t.view(torch.uint8))
        w_s.append(ws_t)
        if m:
            b = None if bias is None else bias[g]
            _gemm_rows(xd[pos:], xs[pos:], wd, ws, weight_block_rows, inp.dtype, b,
                       out[row : row + m])  # fmt: skip
    return out, [x_t, x_s, *w_t, *w_s]


def _blockwise_backward(
    grad_out, saved, m_splits, main_grad, power_2_scale, w_rows, has_bias, need_dgrad, need_wgrad
):  # fmt: skip
    """``(dinp, dweight, dbias)``, 0-element where not computed (``dweight`` also when it was
    added to ``main_grad``, fp32). ``dY`` in the forward's padded layout, quantised once in
    1x128 blocks both ways; per expert the dgrad against the saved ``W_g^T`` and the wgrad
    against the saved ``X^T`` columns of the expert (blocks along its own tokens)."""
    x_t, x_s = saved[:2]
    groups = (len(saved) - 2) // 2
    w_t, w_s = saved[2 : 2 + groups], saved[2 + groups :]
    k, n = w_t[0].shape
    dtype = grad_out.dtype
    rows = grad_out.shape[0]
    splits = host_splits(m_splits, rows)
    firsts, starts, width = _plan(splits, rows)
    dy = _padded_rows(grad_out, splits, firsts, starts, width)
    codes = grad_out.new_empty(n * width, dtype=torch.uint8)
    scales = grad_out.new_empty(n * width // 128, dtype=torch.float32)
    gd, gs, gd_t, gs_t = _quantize_block(
        dy, power_2_scale, 1, _transposed_views(codes, scales, width, n)
    )
    xd_t, xs_t = _transposed_views(x_t, x_s, width, k)
    xd_t = xd_t.view(_E4M3)
    dinp = grad_out.new_empty(rows, k) if need_dgrad else empty(grad_out)
    into_weight = need_wgrad and main_grad is None
    dweight = grad_out.new_zeros(groups, n, k) if into_weight else empty(grad_out)
    dbias = grad_out.new_zeros(groups, n) if has_bias else empty(grad_out)
    for g, (m, row, pos) in enumerate(zip(splits, firsts, starts, strict=True)):
        if not m:
            continue
        if need_dgrad:
            w = w_t[g].view(_E4M3)
            _gemm_rows(gd[pos:], gs[pos:], w, w_s[g], w_rows, dtype, None, dinp[row : row + m])
        if need_wgrad:
            cols, blocks = (
                slice(pos, pos + padded(m)),
                slice(pos // 128, pos // 128 + _cdiv(m, 128)),
            )
            a, sa = gd_t[:, cols], gs_t[:, blocks]
            b, sb = xd_t[:, cols], xs_t[:, blocks]
            if into_weight:
                block_scaled_mm(a, sa, b, sb, 1, dtype, out=dweight[g])
            else:
                main_grad[g].add_(block_scaled_mm(a, sa, b, sb, 1, dtype))
        if has_bias:
            dbias[g] = grad_out[row : row + m].sum(0, dtype=torch.float32).to(dtype)
    return dinp, dweight, dbias


# Emulated block-scaled recipes ("dequantized") --------------------------------------------------


def _qdq_operands(inp, m_splits, weight, r: GroupedRecipe) -> tuple[Tensor, Tensor]:
    """``(X, W)`` quantised exactly and dequantised to their dtype: ``X`` in blocks along
    ``in_features`` (1x128 or 32 elements), each expert's weight in the recipe's weight blocks;
    NVFP4 with a global scale per expert for its tokens and its weight (``row_splits``: group
    amaxes on the device, no host sync)."""
    g, n, k = weight.shape
    if r.recipe == "nvfp4":
        per_expert = torch.full((g,), n, dtype=torch.int64, device=weight.device)
        x = qdq(inp, "nvfp4", _E4M3, 1, False, m_splits)
        return x, qdq(weight.reshape(g * n, k), "nvfp4", _E4M3, 1, False, per_expert).view(g, n, k)
    w_rows = r.weight_block_rows if r.recipe == "block" else 1
    p2 = r.power_2_scale if r.recipe == "block" else False
    x = qdq(inp, r.recipe, r.fwd_dtype, 1, p2)
    if w_rows == 1 or n % w_rows == 0:  # no block of rows straddles two experts
        w = qdq(weight.reshape(g * n, k), r.recipe, r.fwd_dtype, w_rows, p2).view(g, n, k)
    else:
        w = torch.stack([qdq(w_g, r.recipe, r.fwd_dtype, w_rows, p2) for w_g in weight])
    return x, w


def _group_sums(grad: Tensor, m_splits: Tensor, groups: int, cuda: bool) -> Tensor:
    """Every group's column sums of ``grad`` (a bias gradient), fp32 accumulation: on CUDA an
    ``index_add_`` over the device splits (no host sync), else a sum per group."""
    rows, n = grad.shape
    if cuda:
        splits, _ = device_splits(m_splits, grad)
        row_group = torch.repeat_interleave(
            torch.arange(groups, device=grad.device), splits, output_size=rows
        )
        out = grad.new_zeros(groups, n, dtype=torch.float32)
        return out.index_add_(0, row_group, grad.float()).to(grad.dtype)
    out, start = grad.new_zeros(groups, n), 0
    for g, m in enumerate(host_splits(m_splits, rows)):
        out[g] = grad[start : start + m].sum(0, dtype=torch.float32).to(grad.dtype)
        start += m
    return out


# The table ---------------------------------------------------------------------------------------
#
# forward(inp, m_splits, weight, bias, r, cuda) -> (out, saved)
# backward(grad, saved, inp, m_splits, weight, main_grad, r, has_bias, need_dgrad, need_wgrad,
#          cuda) -> (dinp, dweight, dbias), 0-element where not computed (dweight also when it
#          went into main_grad). ``saved`` excludes the amaxes the forward appends.


def _hp_forward(inp, m_splits, weight, bias, r, cuda):
    if not cuda or inp.dtype is torch.float64:
        splits = host_splits(m_splits, inp.shape[0])
        return _fwd_loop(inp, splits, weight, bias, _acc(inp)), []
    return _grouped_mm_forward(inp, m_splits, weight, bias), []


def _hp_backward(grad, saved, inp, m_splits, weight, main_grad, r, has_bias, dgrad, wgrad, cuda):
    if not cuda or inp.dtype is torch.float64 or not _use_grouped_mm(inp, weight):
        splits = host_splits(m_splits, inp.shape[0])
        acc = None if cuda and inp.dtype is not torch.float64 else _acc(inp)
        return _bwd_loop(grad, inp, splits, weight, main_grad, has_bias, dgrad, wgrad, acc)
    return _grouped_mm_backward(grad, inp, m_splits, weight, main_grad, has_bias, dgrad, wgrad)


def _per_tensor_forward(inp, m_splits, weight, bias, r, cuda):
    """Current scaling rowwise, delayed per tensor; ``saved`` ends with ``[amax(X), amax(W)]``
    under delayed scaling, and under current scaling when ``grad_amax`` is given (a delayed
    state's calibration step: the amaxes cost a read of each operand more)."""
    native = cuda and _use_native(inp) and not r.emulate
    measure = r.grad_amax is not None
    scale = r.scale if r.recipe == "delayed" else None
    out, amax, saved = _scaled_forward(
        inp, m_splits, weight, bias, scale, r.fwd_dtype, r.fp8_wgrad, native, measure
    )
    return out, saved + ([amax] if amax.numel() else [])


def _per_tensor_backward(grad, saved, inp, m_splits, weight, main_grad, r, has_bias, dgrad,
                         wgrad, cuda):  # fmt: skip
    native = cuda and _use_native(grad) and not r.emulate
    scale = r.scale if r.recipe == "delayed" else None
    return _scaled_backward(
        grad, saved, inp, m_splits, main_grad, scale, r.grad_amax, r.fwd_dtype, r.bwd_dtype,
        has_bias, dgrad, wgrad, native,
    )  # fmt: skip


def _native_block_forward(inp, m_splits, weight, bias, r, cuda):
    return _blockwise_forward(inp, m_splits, weight, bias, r.power_2_scale, r.weight_block_rows)


def _native_block_backward(grad, saved, inp, m_splits, weight, main_grad, r, has_bias, dgrad,
                           wgrad, cuda):  # fmt: skip
    return _blockwise_backward(grad, saved, m_splits, main_grad, r.power_2_scale,
                               r.weight_block_rows, has_bias, dgrad, wgrad)  # fmt: skip


def _dequantized_forward(inp, m_splits, weight, bias, r, cuda):
    """The high-precision grouped GEMM of the quantised-dequantised operands; the bias added to
    its rounded output in high precision; ``saved = [X, W]`` (dequantised)."""
    x, w = _qdq_operands(inp, m_splits, weight, r)
    out, _ = _hp_forward(x, m_splits, w, None, r, cuda)
    if bias is not None:
        splits = m_splits.to(bias.device)
        out = out + bias.repeat_interleave(splits, dim=0, output_size=out.shape[0])
    return out, [x, w]


def _dequantized_backward(grad, saved, inp, m_splits, weight, main_grad, r, has_bias, dgrad,
                          wgrad, cuda):  # fmt: skip
    """The gradient quantised in blocks along ``out_features`` (NVFP4: per expert), then the
    high-precision grouped backward against the forward's dequantised operands; the bias
    gradient from the high-precision gradient."""
    x, w = saved
    p2 = r.power_2_scale if r.recipe == "block" else False
    if r.recipe == "nvfp4":
        g = qdq(grad, "nvfp4", _E4M3, 1, False, m_splits)
    else:
        g = qdq(grad, r.recipe, r.bwd_dtype, 1, p2)
    dinp, dweight, _ = _hp_backward(g, [], x, m_splits, w, main_grad, r, False, dgrad, wgrad,
                                    cuda)  # fmt: skip
    dbias = _group_sums(grad, m_splits, w.shape[0], cuda) if has_bias else empty(grad)
    return dinp, dweight, dbias


GROUPED_GEMMS: dict[str, tuple[Callable, Callable]] = {
    "grouped_mm": (_hp_forward, _hp_backward),
    "scaled_grouped_mm": (_per_tensor_forward, _per_tensor_backward),
    "blockwise": (_native_block_forward, _native_block_backward),
    "dequantized": (_dequantized_forward, _dequantized_backward),
}


def grouped_gemm_kind(recipe: str, emulate: bool) -> str:
    """The :data:`GROUPED_GEMMS` row of a recipe kind."""
    if not recipe:
        return "grouped_mm"
    if recipe in PER_TENSOR:
        return "scaled_grouped_mm"
    return "blockwise" if recipe == "block" and not emulate else "dequantized"
