r"""The grouped linear family's splits and grouped GEMMs (``functional.grouped_linear_ops``),
forward and backward, every recipe's but the per-tensor ones (``functional.grouped_fp8``); their
table ``grouped_linear_ops.GROUPED_GEMMS`` is keyed by the GEMM kind (:func:`grouped_gemm_kind`):

=======================  ===================================================================
kind                     GEMMs
=======================  ===================================================================
``"grouped_mm"``         high precision: ``torch._grouped_mm`` on device offsets (CUDA, bf16,
                         dims multiples of 8), else a GEMM per group (fp32 math on the CPU)
``"scaled_grouped_mm"``  per-tensor recipes (``functional.grouped_fp8``)
``"blockwise"``          Float8BlockScaling, native: a blockwise ``torch._scaled_mm`` per expert
                         (host splits; every expert's tokens padded to 128 in one layout)
``"dequantized"``        the block-scaled recipes emulated: each expert's operands quantised
                         exactly as a dense GEMM quantises them (the backward's copies along
                         each expert's own tokens), dequantised, then high precision's grouped
                         GEMMs on CUDA, on the CPU per expert a dense Linear's, bit for bit
=======================  ===================================================================

Every row is ``forward(inp, m_splits, weight, bias, r, cuda, weight_q) -> (out, saved)``
(``weight_q``: the pre-quantised weight, or None) and ``backward(grad, saved, inp, m_splits,
weight, main_grad, r, has_bias, need_dgrad, need_wgrad, cuda) -> (dinp, dweight, dbias)``
(0-element where not computed or gone into ``main_grad``; ``saved`` without the amaxes a
forward appends), ``r`` a :class:`GroupedRecipe`. The device-offset paths never read device
splits on the host (``torch._assert_async`` checks them) and check CPU splits (a list's) there;
the loops read the splits on the host (for device splits, one sync on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import shown
from te_compile._numerics import acc_dtype
from te_compile.functional.gemm import (
    PER_TENSOR,
    block_scaled_mm,
    empty,
    gemm,
    padded,
    quantize_operand,
    wgrad_gemm,
)
from te_compile.functional.quantize import quantize_blockwise
from te_compile.functional.quantize_mx_ref import NVFP4_BLOCK, nvfp4_qdq
from te_compile.functional.spec import BackwardSpec, QuantSpec

__all__ = [
    "GroupedRecipe",
    "as_splits_tensor",
    "blockwise_backward",
    "blockwise_forward",
    "blockwise_weight",
    "bwd_loop",
    "checked_splits",
    "dequantized_backward",
    "dequantized_forward",
    "dequantized_weight",
    "device_splits",
    "group_rows",
    "grouped_gemm_kind",
    "grouped_mm_backward",
    "high_precision_backward",
    "high_precision_forward",
    "host_splits",
    "nvfp4_dtype",
    "nvfp4_input",
    "nvfp4_weight",
    "row_bias",
    "uses_grouped_mm",
]

_E4M3 = torch.float8_e4m3fn


def grouped_gemm_kind(recipe: str, emulate: bool) -> str:
    """The ``GROUPED_GEMMS`` row (module docstring) of a recipe kind."""
    if not recipe:
        return "grouped_mm"
    if recipe in PER_TENSOR:
        return "scaled_grouped_mm"
    return "blockwise" if recipe == "block" and not emulate else "dequantized"


class GroupedRecipe(NamedTuple):
    """A grouped linear op's recipe as its GEMMs take it: the input's, weight's and gradient's
    ``QuantSpec`` (the input's kind, format and ``emulate`` stand for the weight's: one format
    and power-of-two option, ``check_grouped_linear``), the ``BackwardSpec``, the delayed state
    and the stochastic rounding stream (None unless the gradient's spec rounds stochastically)."""

    x: QuantSpec = QuantSpec()
    w: QuantSpec = QuantSpec()
    g: QuantSpec = QuantSpec()
    bw: BackwardSpec = BackwardSpec()
    scale: Tensor | None = None
    grad_amax: Tensor | None = None
    rng_state: Tensor | None = None


# Splits ------------------------------------------------------------------------------------------


def as_splits_tensor(m_splits: Tensor | Sequence[int]) -> Tensor:
    """``m_splits`` as an integer tensor: tensors pass through, a list of ints becomes a CPU
    int64 tensor (a constant under ``torch.compile``)."""
    return checked_splits("te.as_splits_tensor", m_splits)


def checked_splits(
    owner: str, m_splits: object, rows: int | None = None, rows_name: str = "inp.shape[0]"
) -> Tensor:
    """:func:`as_splits_tensor` for ``owner``'s ``m_splits``, refused by name when neither a list
    of ints >= 0 nor a tensor. A list's sum is checked here (free: on the host) against ``rows``
    where given; a tensor's values where the GEMMs read them (:func:`host_splits`,
    :func:`device_splits`)."""
    if isinstance(m_splits, Tensor):
        return m_splits
    if not isinstance(m_splits, Sequence) or isinstance(m_splits, (str, bytes)):
        raise TypeError(
            f"{owner}: m_splits must be a list of ints >= 0 or an integer tensor (one size per "
            f"group), got {shown(m_splits)}"
        )
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in m_splits):
        raise ValueError(
            f"{owner}: m_splits must be a list of ints >= 0 or an integer tensor, got {m_splits!r}"
        )
    if rows is not None and sum(m_splits) != rows:
        raise ValueError(
            f"{owner}: m_splits must sum to {rows_name} ({rows}), got "
            f"{_shown(list(m_splits))} (sum {sum(m_splits)}; a list is checked on the call)"
        )
    return torch.tensor(list(m_splits), dtype=torch.int64)


def _shown(splits: list[int]) -> str:
    return str(splits) if len(splits) <= 16 else "[...]"


# High precision ("grouped_mm") ------------------------------------------------------------------


def host_splits(m_splits: Tensor, rows: int) -> list[int]:
    """The splits as Python ints, checked (CPU tensors: no device sync)."""
    splits = m_splits.tolist()
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(
            f"te.grouped_linear: m_splits must be >= 0 and sum to inp.shape[0] ({rows}), got "
            f"{_shown(splits)} (sum {sum(splits)}; a CPU tensor, read on the host where the "
            "GEMMs split by it)"
        )
    return splits


def uses_grouped_mm(inp: Tensor, weight: Tensor) -> bool:
    """Whether a high-precision call on CUDA takes ``torch._grouped_mm`` (bf16, sizes multiples
    of 8) rather than a GEMM per group (:func:`group_rows`)."""
    return inp.dtype is torch.bfloat16 and inp.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0


def device_splits(m_splits: Tensor, inp: Tensor) -> tuple[Tensor, Tensor]:
    """``(splits, offsets)`` on ``inp``'s device, offsets int32 (end of each group). Splits on
    the CPU (a list's) are checked and summed on the host and reach the device in one copy
    (pinned, asynchronous); a device tensor is summed and checked on the device (no host sync)."""
    if m_splits.device.type == "cpu":
        splits = host_splits(m_splits, inp.shape[0])
        both = torch.tensor([*splits, *accumulate(splits)], dtype=torch.int32,
                            pin_memory=inp.is_cuda).to(inp.device, non_blocking=True)  # fmt: skip
        return both[: len(splits)], both[len(splits) :]
    splits = m_splits.to(inp.device, non_blocking=True)
    offs = torch.cumsum(splits, 0, dtype=torch.int32)
    if splits.numel():
        torch._assert_async(
            (offs[-1] == inp.shape[0]) & (splits >= 0).all(),
            "te.grouped_linear: m_splits must be >= 0 and sum to inp.shape[0] (a device tensor, "
            "checked on the device: its values are not read on the host)",
        )
    return splits, offs


def row_bias(bias: Tensor, splits: Tensor, rows: int) -> Tensor:
    """``bias[group of row]`` for every row: ``[G, ...]`` to ``[rows, ...]``, no host sync."""
    return torch.repeat_interleave(bias, splits, dim=0, output_size=rows)


def _group_sums(grad: Tensor, splits: Tensor, groups: int) -> Tensor:
    """Every group's column sums of ``grad`` (a bias gradient): one fp32 ``index_add_`` by the
    device ``splits``, no host sync."""
    row_group = row_bias(torch.arange(groups, device=grad.device), splits, grad.shape[0])
    out = grad.new_zeros(groups, grad.shape[1], dtype=torch.float32)
    return out.index_add_(0, row_group, grad.float()).to(grad.dtype)


def group_rows(splits: list[int]):
    """``(g, slice of group g's rows)`` for every group of the host ``splits``."""
    start = 0
    for g, m in enumerate(splits):
        yield g, slice(start, start + m)
        start += m


def bwd_loop(grad_out, inp, splits, weight, main_grad, has_bias, need_dgrad, need_wgrad, acc):
    """Per-group GEMMs in ``acc`` (None: the input dtype); db, and dW into ``main_grad``, summed
    in fp32 at least. Only the wgrad reads ``inp``, only the dgrad ``weight``'s values."""
    dtype, mm, ends = grad_out.dtype, acc or grad_out.dtype, list(accumulate(splits))
    dinp, dweight, dbias = empty(grad_out), empty(grad_out), empty(grad_out)  # (no aliases)
    dy = grad_out.to(mm)  # (cast once for both GEMMs)
    if need_dgrad:  # (dY_g @ W_g: the entry's a @ b.T of W^T)
        dinp = gemm("mm", dy, None, weight.to(mm).transpose(1, 2), None, dtype, offs=ends)
    if need_wgrad and main_grad is None:
        dweight = gemm("mm", dy.t(), None, inp.to(mm).t(), None, dtype, offs=ends)
    if has_bias:
        dbias = grad_out.new_empty(weight.shape[:2])
    for g, span in group_rows(splits):
        if need_wgrad and main_grad is not None:
            main_grad[g].addmm_(grad_out[span].t().float(), inp[span].float())
        if has_bias:
            dbias[g] = grad_out[span].sum(0, dtype=acc or torch.float32).to(dtype)
    return dinp, dweight, dbias


def grouped_mm_backward(
    grad_out, inp, dsplits, weight, main_grad, has_bias, need_dgrad, need_wgrad
):
    """:func:`high_precision_backward` by ``torch._grouped_mm`` on :func:`device_splits`'
    ``dsplits`` (no host sync)."""
    (splits, offs), dtype = dsplits, grad_out.dtype
    dinp, dweight = empty(grad_out), empty(grad_out)
    if need_dgrad:
        dinp = gemm("grouped_mm", grad_out, None, weight.transpose(-2, -1), None, dtype, offs=offs)
    # Grouped along the reduction dim: [N, M] x [M, K] -> [G, N, K], in the operands' dtype
    # (the GEMM's only output), so with main_grad dW is rounded to bf16 once and then
    # accumulated in fp32 (no host sync).
    if need_wgrad:
        dweight = gemm("grouped_mm", grad_out.t(), None, inp.t(), None, dtype, offs=offs)
    if need_wgrad and main_grad is not None:
        main_grad.add_(dweight)
        dweight = empty(grad_out)
    dbias = _group_sums(grad_out, splits, weight.shape[0]) if has_bias else empty(grad_out)
    return dinp, dweight, dbias


# Float8BlockScaling, native ("blockwise") ------------------------------------------------------


def _capacity(rows: int, groups: int) -> int:
    """Static token count of the padded layout (every expert's tokens rounded up to 128)."""
    return 128 * (rows // 128 + groups)


def _padded(x: Tensor, m_splits: Tensor):
    """``(splits, first row of each expert in the padded layout, padded rows, x in it)``: ``x``
    itself when every expert's tokens are a multiple of 128, else each expert from a multiple of
    128 of a :func:`_capacity` layout (zero rows between; one scatter)."""
    rows = x.shape[0]
    splits = host_splits(m_splits, rows)
    starts = list(accumulate((-(-m // 128) * 128 for m in splits), initial=0))[:-1]
    if all(m % 128 == 0 for m in splits):
        return splits, starts, rows, x
    width = _capacity(rows, len(splits))
    index = torch.cat([torch.arange(p, p + m) for p, m in zip(starts, splits, strict=True)])
    out = x.new_zeros(width, x.shape[1]).index_copy_(0, index.to(x.device, non_blocking=True), x)
    return splits, starts, width, out


def _quantize_block(x: Tensor, power_2_scale: bool, size: int):
    """``(data, scale_inv, data_t, scale_inv_t, codes, scales)``: ``x`` ``[width, C]`` in 1x128
    E4M3 blocks (one pass), the transposed copy written into new flat buffers ``codes`` and
    ``scales`` with room for ``size`` rows (:func:`_transposed_views`)."""
    width, c = x.shape
    codes = x.new_empty(c * size, dtype=torch.uint8)
    scales = x.new_empty(c * size // 128, dtype=torch.float32)
    out_t = _transposed_views(codes, scales, width, c)
    if x.is_cuda:
        from te_compile.kernels.quantize import quantize_blockwise as kernel

        return *kernel(x, _E4M3, 1, power_2_scale, True, out_t=out_t), codes, scales
    data, s, data_t, s_t = quantize_blockwise.eager(x, _E4M3, 1, power_2_scale, True)
    out_t[0].copy_(data_t.view(out_t[0].dtype))
    out_t[1].copy_(s_t)
    return data, s, out_t[0].view(_E4M3), out_t[1], codes, scales


def _transposed_views(codes: Tensor, scales: Tensor, width: int, k: int):
    """``[K, width]`` codes and ``[K, width / 128]`` scales (rows-major, strides ``(1, K)``: an
    expert's columns in cuBLAS's layout without a copy) over the start of flat buffers."""
    return codes[: k * width].view(k, width), scales[: k * width // 128].view(-1, k).t()


def _gemm_rows(a, sa, b, sb, b_rows, dtype, bias, out):
    """``out`` ``[m, N]`` (a row slice of the result) from the first ``m`` rows of ``a``, whose
    rows beyond ``m`` up to a multiple of 16 are zeros (the padded layout). cuBLAS's blockwise
    GEMM refuses a row count that is not a multiple of 16 (H100, torch 2.11), so such an expert
    runs on its rows padded to 16 and the first ``m`` rows are copied out."""
    m = out.shape[0]
    if m % 16 == 0:
        return block_scaled_mm(a[:m], sa[:m], b, sb, b_rows, dtype, bias, out=out)
    m16 = padded(m)
    return out.copy_(block_scaled_mm(a[:m16], sa[:m16], b, sb, b_rows, dtype, bias)[:m])


def blockwise_weight(
    weight: Tensor, power_2_scale: bool, weight_block_rows: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``weight`` ``[G, N, K]`` pre-quantised for the native blockwise GEMMs: every expert's
    ``functional.gemm.quantize_operand`` (the forward's cast) stacked, E4M3 codes as uint8."""
    spec = QuantSpec("block", _E4M3, weight_block_rows, power_2_scale)
    parts = [quantize_operand(spec, w_g)[:4] for w_g in weight]
    data, s, data_t, s_t = (torch.stack(list(t)) for t in zip(*parts, strict=True))
    return data.view(torch.uint8), s, data_t.view(torch.uint8), s_t


def blockwise_forward(inp, m_splits, weight, bias, r, cuda, weight_q=None):
    """``saved = [X^T codes, their 1x128 scales, each expert's W_g^T codes [K, N] (uint8), each
    expert's scales]``, the input's in :func:`_quantize_block`'s flat buffers (uint8, fp32; as
    :func:`_transposed_views`, every expert's tokens from a multiple of 128). With ``weight_q``
    (:func:`blockwise_weight`) ``saved`` ends after the input's copy (the caller saves the
    weight's). Under ``r.bw.override`` nothing, or the forward's operands dequantised."""
    groups, n = weight.shape[:2]
    splits, starts, _, x = _padded(inp, m_splits)
    xd, xs, _, _, x_t, x_s = _quantize_block(x, r.w.power_2_scale, _capacity(inp.shape[0], groups))
    out = inp.new_empty(inp.shape[0], n)
    w_t, w_s = [], []
    spec = QuantSpec("block", _E4M3, r.w.block_rows, r.w.power_2_scale)  # the weight's
    for (g, span), m, pos in zip(group_rows(splits), splits, starts, strict=True):
        if weight_q is None:
            wd, ws, wd_t, ws_t = quantize_operand(spec, weight[g])[:4]
            w_t.append(wd_t.view(torch.uint8))
            w_s.append(ws_t)
        else:
            wd, ws = weight_q[0][g].view(_E4M3), weight_q[1][g]
        if m:
            b = None if bias is None else bias[g]
            _gemm_rows(xd[pos:], xs[pos:], wd, ws, r.w.block_rows, inp.dtype, b, out[span])
    if r.bw.override == "dequantized":
        return out, [_cast(inp, r, r.x.fp8_dtype), dequantized_weight(weight, r)]
    return out, [] if r.bw.override else [x_t, x_s, *w_t, *w_s]


def blockwise_backward(grad_out, saved, inp, m_splits, weight, main_grad, r, has_bias,
                       need_dgrad, need_wgrad, cuda):  # fmt: skip
    """``dY`` in the forward's padded layout, quantised once in 1x128 blocks both ways; per expert
    the dgrad against the saved ``W_g^T``, the wgrad against its saved ``X^T`` columns."""
    w_rows = r.w.block_rows
    groups, n, k = weight.shape
    if saved[2].dim() == 3:  # a pre-quantised weight's stacked copies
        w_t, w_s = saved[2].unbind(0), saved[3].unbind(0)
    else:
        w_t, w_s = saved[2 : 2 + groups], saved[2 + groups :]
    dtype = grad_out.dtype
    splits, starts, width, dy = _padded(grad_out, m_splits)
    gd, gs, gd_t, gs_t, _, _ = _quantize_block(dy, r.w.power_2_scale, width)
    xd_t, xs_t = _transposed_views(*saved[:2], width, k)
    dinp = grad_out.new_empty(grad_out.shape[0], k) if need_dgrad else empty(grad_out)
    into_weight = need_wgrad and main_grad is None
    dweight = grad_out.new_zeros(groups, n, k) if into_weight else empty(grad_out)
    dbias = grad_out.new_zeros(groups, n) if has_bias else empty(grad_out)
    for (g, span), m, pos in zip(group_rows(splits), splits, starts, strict=True):
        if not m:
            continue
        if need_dgrad:
            w = w_t[g].view(_E4M3)
            _gemm_rows(gd[pos:], gs[pos:], w, w_s[g], w_rows, dtype, None, dinp[span])
        if need_wgrad:
            cols = slice(pos, pos + padded(m))
            blocks = slice(pos // 128, pos // 128 - (-m // 128))
            a, sa = gd_t[:, cols], gs_t[:, blocks]
            b, sb = xd_t[:, cols].view(_E4M3), xs_t[:, blocks]
            if into_weight:
                block_scaled_mm(a, sa, b, sb, 1, dtype, out=dweight[g])
            else:
                main_grad[g].add_(block_scaled_mm(a, sa, b, sb, 1, dtype))
        if has_bias:
            dbias[g] = grad_out[span].sum(0, dtype=torch.float32).to(dtype)
    return dinp, dweight, dbias


# Emulated block-scaled recipes ("dequantized") --------------------------------------------------


def _cast(x2: Tensor, r: GroupedRecipe, fp8_dtype: torch.dtype, block_rows: int = 1,
          dest: Tensor | None = None) -> Tensor:  # fmt: skip
    """``x2`` ``[M, K]`` quantised exactly (``functional.gemm.quantize_operand``'s rowwise copy) and
    dequantised to its dtype, saturating at its largest value (an E5M2 infinity stays infinite).
    With ``dest``: the columnwise copy (blocks along ``M``), transposed back, rows ``dest``."""
    p2 = r.x.kind == "block" and r.w.power_2_scale
    spec = QuantSpec(r.x.kind, fp8_dtype, block_rows, p2, emulate=True)
    if dest is None:
        values = quantize_operand(spec, x2.contiguous(), columnwise=False).data
    else:
        values = quantize_operand(spec, x2, columnwise=True).data_t.t()[dest]
    big = torch.finfo(x2.dtype).max
    return torch.where(values.isinf(), values, values.clamp(-big, big)).to(x2.dtype)


def _cast_columns(x2: Tensor, m_splits: Tensor, r: GroupedRecipe, fp8_dtype: torch.dtype):
    """``x2`` ``[M, K]`` as :func:`_cast`, but quantised along ``M`` with every group of
    ``m_splits`` rows on its own (a dense GEMM's per group). Each group is moved to a multiple of
    the block length in a zero-padded layout of static size (zero rows change no block's amax),
    quantised there in one call and gathered back; no host sync."""
    rows, k = x2.shape
    step = 32 if r.x.kind == "mxfp8" else 128
    splits = m_splits.to(x2.device, non_blocking=True)
    pad = -splits % step  # each group's zero rows up to a multiple of step
    shift = torch.cumsum(pad, 0) - pad
    dest = torch.arange(rows, device=x2.device) + row_bias(shift, splits, rows)
    width = (rows + splits.shape[0] * (step - 1) + step - 1) // step * step
    layout = x2.new_zeros(width, k).index_copy_(0, dest, x2)
    return _cast(layout, r, fp8_dtype, 1, dest)


def _weight_columns(weight: Tensor, w: Tensor | None, r: GroupedRecipe) -> Tensor:
    """The dgrad's weight operand: ``weight`` ``[G, N, K]`` quantised along ``N`` per expert;
    128x128 blocks are the same both ways, so ``w``, the forward's copy (made where None)."""
    if r.x.kind == "block" and r.w.block_rows != 1:
        return w if w is not None else dequantized_weight(weight, r)
    g, n, k = weight.shape
    per_expert = torch.full((g,), n, dtype=torch.int64, device=weight.device)
    return _cast_columns(weight.reshape(g * n, k), per_expert, r, r.x.fp8_dtype).view(g, n, k)


def dequantized_weight(weight: Tensor, r: GroupedRecipe) -> Tensor:
    """``W`` ``[G, N, K]`` quantised exactly per expert (NVFP4: :func:`nvfp4_weight`) and
    dequantised: the emulated forward's weight operand, also as a pre-quantised weight."""
    g, n, k = weight.shape
    if r.x.kind == "nvfp4":
        return nvfp4_weight(weight, r)[0]
    w_rows = r.w.block_rows if r.x.kind == "block" else 1
    if w_rows == 1 or n % w_rows == 0:  # no block of rows straddles two experts
        return _cast(weight.reshape(g * n, k), r, r.x.fp8_dtype, w_rows).view(g, n, k)
    return torch.stack([_cast(w_g, r, r.x.fp8_dtype, w_rows) for w_g in weight])


# The rows of grouped_linear_ops.GROUPED_GEMMS (module docstring) -----------------------------


def high_precision_forward(inp, m_splits, weight, bias, r, cuda, weight_q=None):
    """Per group a dense ``te::linear``'s GEMM (``functional.gemm.hp_linear``'s math), or
    ``torch._grouped_mm`` (:func:`uses_grouped_mm`)."""
    if not cuda or not uses_grouped_mm(inp, weight):  # (CPU: acc_dtype math, rounded once)
        acc = inp.dtype if cuda else acc_dtype(inp)
        ends = list(accumulate(host_splits(m_splits, inp.shape[0])))
        b = None if bias is None else bias.to(acc)
        return gemm("mm", inp.to(acc), None, weight.to(acc), None, inp.dtype, bias=b, offs=ends), []
    splits, offs = device_splits(m_splits, inp)
    out = gemm("grouped_mm", inp, None, weight, None, inp.dtype, offs=offs)
    if bias is not None:
        out += row_bias(bias, splits, inp.shape[0])
    return out, []


def high_precision_backward(
    grad, saved, inp, m_splits, weight, main_grad, r, has_bias, dgrad, wgrad, cuda
):
    if not cuda or not uses_grouped_mm(inp, weight):
        splits = host_splits(m_splits, inp.shape[0])
        acc = None if cuda and inp.dtype is not torch.float64 else acc_dtype(inp)
        return bwd_loop(grad, inp, splits, weight, main_grad, has_bias, dgrad, wgrad, acc)
    dsplits = device_splits(m_splits, inp)
    return grouped_mm_backward(grad, inp, dsplits, weight, main_grad, has_bias, dgrad, wgrad)


def nvfp4_dtype(t: Tensor) -> torch.dtype:
    """NVFP4's dequantised operands' dtype for activations ``t``: on the CPU the exact fp32 values
    a dense ``te::linear`` multiplies (rarely bf16's); CUDA's grouped GEMMs take ``t``'s."""
    return t.dtype if t.is_cuda else acc_dtype(t)


def nvfp4_input(inp, m_splits, r: GroupedRecipe) -> tuple[Tensor, Tensor]:
    """``(X, X^T's copy)`` quantised as NVFP4 per expert (a global scale each), the wgrad's copy
    along the tokens (with ``r.x.rht``), dequantised to :func:`nvfp4_dtype`."""
    if inp.is_cuda:  # blocks of 16 tokens along M must not straddle two experts (no host sync)
        torch._assert_async((m_splits % NVFP4_BLOCK == 0).all())
    x_row, x_col_t = nvfp4_qdq(inp, rht=r.x.rht, four_over_six=r.x.four_over_six,
                               row_scaled=r.x.row_scaled, row_splits=m_splits)  # fmt: skip
    dtype = nvfp4_dtype(inp)
    return x_row.to(dtype), x_col_t.t().to(dtype).contiguous()


def nvfp4_weight(weight: Tensor, r: GroupedRecipe) -> tuple[Tensor, Tensor]:
    """``(W, W^T's copy)`` as :func:`nvfp4_input`, the dgrad's copy along ``out_features`` (with
    16x16 tiles: the same values)."""
    g, n, k = weight.shape
    per_expert = torch.full((g,), n, dtype=torch.int64, device=weight.device)
    w_row, w_col_t = nvfp4_qdq(weight.reshape(g * n, k), tiles=r.w.block_rows == 16,
                               four_over_six=r.w.four_over_six, row_splits=per_expert)  # fmt: skip
    dtype = nvfp4_dtype(weight)
    return (w_row.to(dtype).view(g, n, k), w_col_t.t().to(dtype).reshape(g, n, k).contiguous())


def dequantized_input(inp: Tensor, m_splits: Tensor, r: GroupedRecipe) -> Tensor:
    """The input's copy :func:`dequantized_forward` saves first, made again from ``inp`` by a
    backward that kept the input (``save_input``): deterministic, the same values."""
    if r.x.kind == "nvfp4":
        return nvfp4_input(inp, m_splits, r)[1]
    return _cast_columns(inp, m_splits, r, r.x.fp8_dtype)


def dequantized_forward(inp, m_splits, weight, bias, r, cuda, weight_q=None):
    """The high-precision grouped GEMM of the quantised-dequantised operands (CUDA: the bias
    added to its rounded output; CPU: in the GEMM, as a dense ``te::linear``'s); ``saved = [X,
    W]``, the backward GEMMs' copies, ``[X]`` with ``weight_q`` (the caller saves the weight's:
    NVFP4's 16x16 tiles make ``W`` its own, the others' is ``weight_q[2]`` where given, else
    made from ``weight`` in the backward)."""
    if r.x.kind == "nvfp4":
        x, x_col = nvfp4_input(inp, m_splits, r)
        w, w_col = nvfp4_weight(weight, r) if weight_q is None else (weight_q[0], None)
    else:  # the backward GEMMs' copies, quantised along the other dim (as the dense family's)
        x = _cast(inp, r, r.x.fp8_dtype)
        w = dequantized_weight(weight, r) if weight_q is None else weight_q[0]
        x_col = None if r.bw.override else _cast_columns(inp, m_splits, r, r.x.fp8_dtype)
        w_col = None if r.bw.override or weight_q is not None else _weight_columns(weight, w, r)
    out, _ = high_precision_forward(x, m_splits, w, None if cuda else bias, r, cuda)
    if cuda and bias is not None:
        out = out + row_bias(bias, device_splits(m_splits, out)[0], out.shape[0])
    out = out.to(inp.dtype)  # (NVFP4 on the CPU: fp32, rounded once, as te::linear's)
    if r.bw.override == "dequantized":  # the forward's operands in the input dtype (a fresh copy)
        return out, [x.to(inp.dtype), w.to(inp.dtype, copy=weight_q is not None)]
    return out, [] if r.bw.override else [t for t in (x_col, w_col) if t is not None]


def dequantized_backward(grad, saved, inp, m_splits, weight, main_grad, r, has_bias, dgrad,
                          wgrad, cuda):  # fmt: skip
    """The gradient quantised along ``out_features`` for the dgrad and along each expert's tokens
    for the wgrad, then the high-precision grouped GEMMs against the forward's copies (CPU: a
    dense Linear's per group); the bias gradient the high-precision one's."""
    x, w = saved
    if r.x.kind == "nvfp4":  # dgrad on the rowwise copy, wgrad on the columnwise one
        g_row, g_col_t = nvfp4_qdq(grad, columnwise=wgrad, rht=r.g.rht, rng_state=r.rng_state,
                                   row_splits=m_splits)  # fmt: skip
        dtype = nvfp4_dtype(grad)
        g_row, g_col = g_row.to(dtype), g_col_t.t().to(dtype) if wgrad else None
    else:
        if not w.numel() and weight.numel():  # a pre-quantised weight's: made from weight here
            w = _weight_columns(weight, None, r)
        g_row = _cast(grad, r, r.g.fp8_dtype) if dgrad else None
        g_col = _cast_columns(grad, m_splits, r, r.g.fp8_dtype) if wgrad else None
    dinp, dweight = empty(grad), empty(grad)  # (outputs: no aliases)
    if cuda:  # the high-precision grouped GEMMs
        if dgrad:
            dinp = high_precision_backward(g_row, [], x, m_splits, w, main_grad, r, False, True,
                                           False, cuda)[0]  # fmt: skip
        if wgrad:
            dweight = high_precision_backward(g_col, [], x, m_splits, w, main_grad, r, False,
                                              False, True, cuda)[1]  # fmt: skip
    else:  # per group a dense te::linear's "dequantized" GEMMs: its gradients bit for bit
        ends = list(accumulate(host_splits(m_splits, x.shape[0])))
        none, f32 = empty(grad), torch.float32
        if dgrad:
            b = w.transpose(1, 2).to(f32).contiguous()
            dinp = gemm("dequantized", g_row.to(f32), none, b, none, grad.dtype, offs=ends)
        if wgrad:
            a, b = g_col.t().to(f32).contiguous(), x.t().to(f32).contiguous()
            dweight = wgrad_gemm("dequantized", a, none, b, none, grad.dtype, main_grad, offs=ends)
    dbias = empty(grad)  # fp32 sums: on CUDA over the device splits, else per group
    if has_bias and cuda:
        dbias = _group_sums(grad, device_splits(m_splits, grad)[0], w.shape[0])
    elif has_bias:
        splits = host_splits(m_splits, grad.shape[0])
        dbias = bwd_loop(grad, None, splits, w, None, True, False, False, torch.float32)[2]
    return dinp, dweight, dbias
