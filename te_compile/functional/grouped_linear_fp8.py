r"""FP8 grouped linear, rowwise current or per-tensor delayed scaling: ``te::grouped_linear_fp8_*``.

The same math as ``te::grouped_linear_fwd`` (rows of ``inp`` split into groups by ``m_splits``,
group ``g`` times ``weight[g].T`` plus ``bias[g]``) with the forward and the dgrad GEMMs in FP8
(and the wgrad with ``fp8_wgrad``), scaled the way Hopper's grouped FP8 GEMM
``torch._scaled_grouped_mm`` takes them: one fp32 scale per row of the left operand and one per
(group, output column) of the 3-D right operand, each from the amax over the GEMM's
contraction dim (current scaling: measured now):

.. math::
    Y_g = \mathrm{diag}(s_x^{-1})\, X_8\, W_{8,g}^\top\, \mathrm{diag}(s_{w,g}^{-1}) + b_g,\qquad
    dX_g = \mathrm{diag}(s_{dy}^{-1})\, dY_8\, \tilde W_{8,g}\, \mathrm{diag}(\tilde s_{w,g}^{-1}),
    \qquad
    dW_g = dY_g^\top X_g \;\text{or}\;
    dW_g = \big(dY_{8,g}\, \mathrm{diag}(\hat s_{dy,g}^{-1})\big)^\top
           X_{8,g}\, \mathrm{diag}(\hat s_{x,g}^{-1})

* forward: ``X`` quantised per token row (amax over ``K``) and ``W`` per (group, output row)
  (amax over ``K``), both to ``fwd_dtype``;
* dgrad ``dX_g = dY_g W_g``: ``dY`` quantised per token row (amax over ``N``) to ``bwd_dtype``,
  ``W`` per (group, input column), i.e. amax over ``N``, the contraction dim of this GEMM, to
  ``fwd_dtype`` (the forward writes this copy, transposed to ``[G, K, N]``, and saves it);
* wgrad ``dW_g = dY_g^T X_g``: high precision (``torch._grouped_mm`` on CUDA), or with
  ``fp8_wgrad=True`` in FP8 with scales along the token dim: ``X`` per (group, input column)
  to ``fwd_dtype`` and ``dY`` per (group, output column) to ``bwd_dtype``, amax over the
  group's tokens (:math:`\hat s`), both written transposed with every group padded to a
  multiple of 16 tokens (zeros; the grouped GEMM's groups along its contraction dim must start
  at 16-byte offsets; :func:`quantize_group_columns`). The forward makes the input's copy and
  saves it instead of the input (half the bytes of bf16); the GEMM is
  ``torch._scaled_grouped_mm`` with offsets along the contraction dim and the promoted
  accumulation of a gradient GEMM.
  The bias gradient is the per-group sum of the high-precision ``dY``.

``recipe="delayed"`` (``DelayedScaling``): one given scale per tensor instead, ``scale`` ``[3]``
(input, weight, gradient) from ``te::delayed_scaling_update`` as in ``te::linear_fp8``: ``X`` and
``W`` (all groups) cast with ``scale[0]`` / ``scale[1]``, ``dY`` with ``scale[2]`` (the FP8
wgrad's copies too), each inverse
scale broadcast to the rowwise vectors the grouped GEMM takes (the dgrad copy of ``W`` is the
same bytes transposed). The forward returns ``[amax(X), amax(W)]``, the backward writes
``amax(dY)`` into ``grad_amax`` ``[1]`` (a mutated argument). Under ``recipe="rowwise"``
``scale`` is None, and the amaxes are measured (extra reads) only when ``grad_amax`` is given:
the first step of a delayed-scaling state runs current scaling and records them; else the amax
output is 0-element.

FP8 data crosses op boundaries as ``uint8`` views (see ``docs/fp8.md``). The input is saved in
high precision for the wgrad, or as its FP8 wgrad copy with ``fp8_wgrad``.

CUDA: ``torch._scaled_grouped_mm(a_8, b_8.transpose(-2, -1), scale_a [M], scale_b [G, N],
offs=offs, out_dtype=bfloat16)`` on device offsets (no host sync; ``a`` row-major, ``b``
column-major, fp32 inverse scales). That kernel takes E4M3 operands only and gives a bf16
output only. An E5M2 operand (the gradient under ``HYBRID``; both under ``Format.E5M2``) goes
in as the E4M3 codes of its values times ``2**-7``, its inverse scales times 128: E5M2's
largest value 57344 becomes E4M3's 448 and its 2 mantissa bits fit in E4M3's 3, so every E5M2
value down to ``amax / 57344`` of its slice is exact and the smaller ones are rounded to E4M3's
subnormal grid (a step of 0.25 in E5M2's scaled units: an error of at most ``amax * 2**-18.8``
on elements below ``amax * 2**-15.8``). The gradient's rowwise and per-group-column casts
write those codes directly (``e4m3_codes=True``); any other E5M2 operand is recoded by one
table-lookup pass over its bytes (``kernels.quantize.recode_e5m2_as_e4m3``). The emulation
below applies the same recoding, so the two paths see the same codes. float32 / float16 inputs
use the per-group loop below (it reads the splits on the host). The bias is added to the GEMM's
bf16 output (one more rounding, as in ``te::grouped_linear_fwd`` on CUDA).

CPU (and the definition of the FP8 GEMMs): exact emulation. The same FP8 values and scales,
the GEMM of the FP8 values in fp32 per group, the scales applied to the fp32 accumulator, the
bias added in fp32, rounded once to the input's dtype.

Shapes: ``in_features`` and ``out_features`` must be multiples of 16 (a ValueError otherwise);
the number of tokens per group is free, zero-size groups included (their weight and bias
gradients are zero). Zero rows get scale 1 (no NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_compile._library import HOST_SPLITS, SampleInput, differentiable, op
from te_compile.functional.gemm import quantize_per_tensor
from te_compile.functional.grouped_linear import (
    _INT_DTYPES,
    _device_splits,
    _empty,
    _host_splits,
    _row_bias,
    as_splits_tensor,
)
from te_compile.functional.quantize import quantize_tensorwise

__all__ = [
    "GROUPED_FP8_RECIPES",
    "grouped_linear_fp8",
    "grouped_linear_fp8_ref",
    "quantize_rowwise",
]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GROUPED_FP8_RECIPES = ("rowwise", "delayed")
_HIGH = (torch.float32, torch.bfloat16, torch.float16)


# 1. Quantisation and reference math ----------------------------------------------------------


def quantize_rowwise(
    x: Tensor, fp8_dtype: torch.dtype, dim: int = -1, e4m3_codes: bool = False
) -> tuple[Tensor, Tensor]:
    """``(data, scale_inv)``: ``x`` cast to ``fp8_dtype`` with one current scale per slice along
    ``dim`` (``fp8_max / amax`` over ``dim``; 1 for an all-zero or non-finite slice);
    ``scale_inv`` fp32 has ``x``'s shape without ``dim``. Computed in fp32 whatever ``x``'s
    dtype, so a float64 copy of a bf16/fp32 tensor gets the same bytes and scales. CUDA
    (float32/bfloat16/float16): one Triton kernel per call (``kernels.quantize.quantize_rowwise``,
    bit-identical, the kernel tests check it), the quantised dim moved last first.
    ``e4m3_codes``: an E5M2 result as the grouped GEMM takes it (:func:`_as_e4m3`; on CUDA
    written so by the same kernel)."""
    if x.is_cuda and x.dtype in _HIGH:
        from te_compile.kernels import quantize

        moved = dim not in (-1, x.ndim - 1)
        data, scale_inv = quantize.quantize_rowwise(
            x.movedim(dim, -1) if moved else x, fp8_dtype, e4m3_codes=e4m3_codes
        )
        return (data.movedim(-1, dim).contiguous() if moved else data), scale_inv
    if e4m3_codes:
        return _as_e4m3(*quantize_rowwise(x, fp8_dtype, dim))
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


def _dequantize(data: Tensor, scale_inv: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """``data * scale_inv`` (broadcast along ``dim``) in ``dtype``; exact in float64."""
    acc = torch.float64 if dtype is torch.float64 else torch.float32
    return (data.to(acc) * scale_inv.unsqueeze(dim).to(acc)).to(dtype)


def _fake_quant(x: Tensor, fp8_dtype: torch.dtype, dim: int, scale: Tensor | None = None) -> Tensor:
    """Quantised-dequantised ``x``: rowwise along ``dim``, or with the given per-tensor
    ``scale`` (``[1]``, delayed scaling); E5M2 values as the grouped GEMMs take them, recoded
    to E4M3 (:func:`_as_e4m3`)."""
    if scale is None:
        return _dequantize(*quantize_rowwise(x, fp8_dtype, dim, e4m3_codes=True), dim, x.dtype)
    data, scale_inv, _ = quantize_per_tensor(x.reshape(-1, x.shape[-1]), fp8_dtype, scale)
    data, scale_inv = _as_e4m3(data, scale_inv)
    acc = torch.float64 if x.dtype is torch.float64 else torch.float32
    return (data.to(acc) * scale_inv.to(acc)).to(x.dtype).reshape(x.shape)


def _slot(scale: Tensor | None, i: int) -> Tensor | None:
    return None if scale is None else scale[i : i + 1]


def _fake_quant_columns(x_g: Tensor, fp8_dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """A token group's wgrad operand: each column quantised over the group's rows (or with the
    per-tensor ``scale``), dequantised; an empty group stays empty."""
    return x_g if x_g.shape[0] == 0 else _fake_quant(x_g, fp8_dtype, 0, scale)


class _RefGroupedGemm(torch.autograd.Function):
    """``Y_g = fq(X_g) fq(W_g)^T`` with the FP8 op's gradients: dgrad from the rowwise-quantised
    gradient and the weight quantised along ``N``; wgrad from the unquantised ``dY`` and ``X``,
    or with ``fp8_wgrad`` from both quantised per (group, column) along the group's tokens."""

    @staticmethod
    def forward(ctx, x, w, splits, fwd_dtype, bwd_dtype, scale, fp8_wgrad):
        ctx.save_for_backward(x, w)
        ctx.splits, ctx.fwd_dtype, ctx.bwd_dtype, ctx.scale = splits, fwd_dtype, bwd_dtype, scale
        ctx.fp8_wgrad = fp8_wgrad
        xq = _fake_quant(x, fwd_dtype, -1, _slot(scale, 0))
        wq = _fake_quant(w, fwd_dtype, -1, _slot(scale, 1))
        outs = [x_g @ wq[g].t() for g, x_g in enumerate(xq.split(splits))]
        return torch.cat(outs) if outs else x.new_empty(0, w.shape[1])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dyq = _fake_quant(dy, ctx.bwd_dtype, -1, _slot(ctx.scale, 2))
        # Along N (rowwise), or the same per-tensor values as the forward's (delayed).
        wq_n = _fake_quant(w, ctx.fwd_dtype, 1, _slot(ctx.scale, 1))
        dx = torch.cat([d @ wq_n[g] for g, d in enumerate(dyq.split(ctx.splits))])
        pairs = zip(dy.split(ctx.splits), x.split(ctx.splits), strict=True)
        if ctx.fp8_wgrad:
            x_scale, g_scale = _slot(ctx.scale, 0), _slot(ctx.scale, 2)
            pairs = [
                (_fake_quant_columns(d, ctx.bwd_dtype, g_scale),
                 _fake_quant_columns(x_g, ctx.fwd_dtype, x_scale))
                for d, x_g in pairs
            ]  # fmt: skip
        dw = torch.stack([d.t() @ x_g for d, x_g in pairs])
        return dx, dw, None, None, None, None, None


def grouped_linear_fp8_ref(
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None = None,
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e5m2,
    scale: Tensor | None = None,
    fp8_wgrad: bool = False,
) -> Tensor:
    """Definition of correctness, differentiable: exact fake-quant emulation in the input's
    dtype (float64 in the tests). Operands quantised-dequantised as the op does (rowwise, or
    with the per-tensor delayed ``scale`` ``[3]``); the incoming gradient quantised for the
    dgrad GEMM; the wgrad from the high-precision gradient and input, or with ``fp8_wgrad``
    from both quantised per (group, column) over the group's tokens (``bwd_dtype`` /
    ``fwd_dtype``; per tensor under delayed scaling). The bias gradient is always the
    high-precision gradient's."""
    splits = m_splits.tolist() if isinstance(m_splits, Tensor) else list(m_splits)
    out = _RefGroupedGemm.apply(inp, weight, splits, fwd_dtype, bwd_dtype, scale, fp8_wgrad)
    if bias is not None:
        out = out + torch.repeat_interleave(bias, torch.tensor(splits), dim=0)
    return out


# Argument checks -------------------------------------------------------------------------------


def _check(
    inp, m_splits, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype,
    name: str = "te.grouped_linear_fp8",
) -> None:  # fmt: skip
    """Static constraints shared by the implementations (eager) and the fake (trace time);
    ``name`` begins the error messages."""
    p = f"{name}: "
    if main_grad is not None and (
        main_grad.dtype is not torch.float32 or main_grad.shape != weight.shape
    ):
        raise ValueError(
            p + f"main_grad must be float32 with weight's shape {list(weight.shape)}, got "
            f"{main_grad.dtype} {list(main_grad.shape)}"
        )
    if recipe not in GROUPED_FP8_RECIPES:
        raise ValueError(p + f"recipe must be one of {GROUPED_FP8_RECIPES}, got {recipe!r}")
    delayed = recipe == "delayed"
    if delayed and (scale is None or scale.shape != (3,) or scale.dtype is not torch.float32):
        raise ValueError(
            p + 'recipe="delayed" needs scale: a [3] float32 tensor (input, weight, gradient)'
        )
    if grad_amax is not None and (grad_amax.shape != (1,) or grad_amax.dtype is not torch.float32):
        raise ValueError(
            p + f"grad_amax, if given, must be a [1] float32 tensor, got {grad_amax.dtype} "
            f"{list(grad_amax.shape)}"
        )
    if not delayed and scale is not None:
        raise ValueError(p + 'scale is for recipe="delayed" only')
    if (
        inp.ndim == 2
        and weight.ndim == 3
        and inp.dtype in _HIGH
        and weight.dtype is inp.dtype
        and inp.shape[1] == weight.shape[2]
        and weight.shape[1] % 16 == 0
        and weight.shape[2] % 16 == 0
        and m_splits.ndim == 1
        and m_splits.dtype in _INT_DTYPES
        and m_splits.shape[0] == weight.shape[0]
        and (m_splits.device == inp.device or m_splits.device.type == "cpu")
        and (bias is None or (bias.shape == weight.shape[:2] and bias.dtype is inp.dtype))
        and fwd_dtype in _FP8_DTYPES
        and bwd_dtype in _FP8_DTYPES
    ):
        return
    raise ValueError(_diagnose(inp, m_splits, weight, bias, fwd_dtype, bwd_dtype, p))


def _diagnose(inp, m_splits, weight, bias, fwd_dtype, bwd_dtype, p: str) -> str:
    if fwd_dtype not in _FP8_DTYPES or bwd_dtype not in _FP8_DTYPES:
        return p + f"fwd_dtype/bwd_dtype must be FP8 dtypes, got {fwd_dtype}/{bwd_dtype}"
    if inp.ndim != 2 or weight.ndim != 3 or inp.shape[1] != weight.shape[2]:
        return p + (
            f"inp [sum(m_splits), in_features] and weight [num_gemms, out_features, "
            f"in_features] do not match: {list(inp.shape)} and {list(weight.shape)}"
        )
    if inp.dtype not in _HIGH or weight.dtype != inp.dtype:
        return p + (
            f"inp and weight must share a float32/bfloat16/float16 dtype, got {inp.dtype} and "
            f"{weight.dtype}"
        )
    if weight.shape[1] % 16 or weight.shape[2] % 16:
        return p + (
            f"FP8 grouped GEMMs need in_features ({weight.shape[2]}) and out_features "
            f"({weight.shape[1]}) to be multiples of 16"
        )
    if m_splits.ndim != 1 or m_splits.dtype not in _INT_DTYPES:
        return p + (
            f"m_splits must be a 1-D int32/int64 tensor (or a list of ints), got "
            f"{m_splits.dtype} of shape {list(m_splits.shape)}"
        )
    if m_splits.shape[0] != weight.shape[0]:
        return p + (
            f"m_splits has {m_splits.shape[0]} groups but weight has num_gemms = {weight.shape[0]}"
        )
    if m_splits.device != inp.device and m_splits.device.type != "cpu":
        return (
            p + f"m_splits must be on inp's device ({inp.device}) or the CPU, got {m_splits.device}"
        )
    return p + (
        f"bias must be [num_gemms, out_features] = {list(weight.shape[:2])} of dtype {inp.dtype}, "
        f"got {list(bias.shape)} {bias.dtype}"
    )


# GEMMs -----------------------------------------------------------------------------------------


def _gemm_loop(
    aq: Tensor, sa: Tensor, bq: Tensor, sb: Tensor, splits: list[int], dtype, bias=None
) -> Tensor:
    """Exact emulation: rows of group ``g`` get ``(aq_g @ bq[g]^T) * sa_g[:, None] * sb[g]``
    (+ ``bias[g]``), in fp32, rounded once to ``dtype``. ``aq`` ``[M, C]`` and ``bq``
    ``[G, P, C]`` FP8 (E5M2 as its E4M3 codes, :func:`_as_e4m3`, as on the GPU), ``sa`` ``[M]``
    and ``sb`` ``[G, P]`` fp32 inverse scales."""
    aq, sa = _as_e4m3(aq, sa)
    bq, sb = _as_e4m3(bq, sb)
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


def _as_e4m3(q: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
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
    ``torch._scaled_grouped_mm`` on the E4M3 codes of the operands (:func:`_as_e4m3`; ``a``
    row-major, ``b`` column-major, scales ``[M]`` and ``[G, P]`` fp32; ``fast_accum``: Hopper's
    fast FP8 accumulation, which the forward GEMM uses as in ``te::linear_fp8``, ~20% faster at
    32768 x 4096 -> 2048 on the H100, 2026-11-23; the dgrad promotes its partial sums to fp32).
    CPU tensors (tests of this path): the bf16 grouped GEMM of the same FP8 values, scales
    after in fp32."""
    aq, sa = _as_e4m3(aq, sa)
    bq, sb = _as_e4m3(bq, sb)
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
    if weight.is_cuda and weight.dtype in _HIGH:
        from te_compile.kernels import quantize

        return quantize.quantize_columnwise_transposed(weight, fwd_dtype)
    data, scale_inv = quantize_rowwise(weight.transpose(1, 2), fwd_dtype)  # along N, last
    return data.contiguous(), scale_inv


def _wgrad_capacity(rows: int, groups: int) -> int:
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
    ``[C, capacity]`` (:func:`_wgrad_capacity`) with each group's columns starting at a
    multiple of 16 (zero padding); ``scale_inv`` fp32 ``[G, C]`` (current scaling: 1 for an
    empty group) and
    ``pad_ends`` int32 ``[G]``, the padded groups' end offsets: the grouped GEMM's ``offs``.
    CUDA (float32/bfloat16/float16): one Triton launch on device offsets
    (``kernels.quantize.quantize_group_columns``, the same bytes as the loop below);
    ``device_splits``: the ``(splits, ends)`` of :func:`_device_splits` when the caller has
    them already; ``e4m3_codes``: as in :func:`quantize_rowwise`."""
    groups, c = m_splits.shape[0], x.shape[1]
    capacity = _wgrad_capacity(x.shape[0], groups)
    if x.is_cuda and x.dtype in _HIGH:
        from te_compile.kernels import quantize

        splits, ends = device_splits or _device_splits(m_splits, x)
        pad_ends = torch.cumsum((splits + 15) // 16 * 16, 0, dtype=torch.int32)
        data_t, scale_inv = quantize.quantize_group_columns(
            x, ends, pad_ends, capacity, fp8_dtype, scale=scale, e4m3_codes=e4m3_codes
        )
        return data_t, scale_inv, pad_ends
    splits = _host_splits(m_splits, x.shape[0])
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
        data_t, scale_inv = _as_e4m3(data_t, scale_inv)
    return data_t, scale_inv, pad_ends.to(x.device)


def _gemm_wgrad(
    dyt: Tensor, dys: Tensor, xt: Tensor, xs: Tensor, pad_ends: Tensor, native: bool, dtype,
    main_grad: Tensor | None,
):  # fmt: skip
    """The FP8 wgrad ``dW_g = (dY_g^T diag(dys_g)) (diag(xs_g) X_g)`` from the operands of
    :func:`quantize_group_columns` (``dyt`` ``[N, P]``, ``xt`` ``[K, P]``, grouped along ``P``
    by ``pad_ends``): ``[G, N, K]`` in ``dtype``, or added to ``main_grad`` (fp32; None is
    returned then), both operands as E4M3 codes (:func:`_as_e4m3`). ``native`` (bf16):
    ``torch._scaled_grouped_mm`` with the scales ``[G*N]`` / ``[G*K]`` and the promoted (not
    fast) accumulation of a gradient GEMM, bf16 out (CPU tensors, tests of this path: the bf16
    grouped GEMM of the FP8 values, scales after in fp32). Otherwise exact emulation per group:
    the fp32 GEMM of the FP8 values, the scales applied, rounded once (added in fp32 to
    ``main_grad``)."""
    dyt, dys = _as_e4m3(dyt, dys)
    xt, xs = _as_e4m3(xt, xs)
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


# 2. Forward op -------------------------------------------------------------------------------


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
    if weight.is_cuda and weight.dtype in _HIGH:
        from te_compile.kernels import quantize

        return quantize.quantize_columnwise_transposed(weight, fp8_dtype, scale=scale)[0]
    return wq.view(torch.uint8).transpose(1, 2).contiguous().view(fp8_dtype)


def _forward(
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
    device_splits = None
    if native:
        device_splits = splits, offs = _device_splits(m_splits, inp)
        out = _gemm_grouped(xq, xs, wq, ws, splits, offs, fast_accum=True)
        if bias is not None:
            out += _row_bias(bias, splits, inp.shape[0])
    else:
        splits = _host_splits(m_splits, inp.shape[0])
        out = _gemm_loop(xq, xs, wq, ws, splits, inp.dtype, bias)
    saved = [wq_t.view(torch.uint8), ws_t]
    if fp8_wgrad:
        x_scale = _slot(scale, 0)
        xt, xs_t, _ = quantize_group_columns(inp, m_splits, fwd_dtype, x_scale, device_splits)
        saved += [xt.view(torch.uint8), xs_t]
    return out, amax, saved


@op("grouped_linear_fp8_fwd", opaque=HOST_SPLITS)
def grouped_linear_fp8_fwd(
    inp: Tensor,
    m_splits: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    scale: Tensor | None,
    grad_amax: Tensor | None,
    recipe: str,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    fp8_wgrad: bool = False,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(out, amax, saved)``: ``out`` ``[M, out_features]``; ``amax`` ``[amax(inp),
    amax(weight)]`` under ``recipe="delayed"``, and under "rowwise" when ``grad_amax`` is given
    (measured for a delayed-scaling state's first step), else 0-element; ``saved = [W_8
    [G, K, N] (uint8 bytes of fwd_dtype, quantised along N or per tensor), its inverse scales
    [G, K] fp32]`` for the dgrad, and with ``fp8_wgrad`` also the input's wgrad operand ``[X_8^T
    [K, capacity] (uint8, per group and column along the tokens, or per tensor), its inverse
    scales [G, K]]`` (:func:`quantize_group_columns`; the backward then needs no ``inp``).
    ``main_grad`` and ``grad_amax`` are only carried to the backward. Default (CPU): exact
    emulation (module docstring)."""
    _check(inp, m_splits, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype)
    measure = grad_amax is not None
    return _forward(inp, m_splits, weight, bias, scale, fwd_dtype, fp8_wgrad, False, measure)


@grouped_linear_fp8_fwd.register_kernel("cuda")
def _grouped_linear_fp8_fwd_cuda(
    inp, m_splits, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype,
    fp8_wgrad=False,
):  # fmt: skip
    _check(inp, m_splits, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype)
    native, measure = _use_native(inp), grad_amax is not None
    return _forward(inp, m_splits, weight, bias, scale, fwd_dtype, fp8_wgrad, native, measure)


# 3. Fake ---------------------------------------------------------------------------------------


@grouped_linear_fp8_fwd.register_fake
def _grouped_linear_fp8_fwd_fake(
    inp, m_splits, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype,
    fp8_wgrad=False,
):  # fmt: skip
    _check(inp, m_splits, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype)
    g, n, k = weight.shape
    saved = [inp.new_empty(g, k, n, dtype=torch.uint8), inp.new_empty(g, k, dtype=torch.float32)]
    if fp8_wgrad:
        capacity = _wgrad_capacity(inp.shape[0], g)
        saved += [
            inp.new_empty(k, capacity, dtype=torch.uint8),
            inp.new_empty(g, k, dtype=torch.float32),
        ]
    measured = recipe == "delayed" or grad_amax is not None
    amax = inp.new_empty(2 if measured else 0, dtype=torch.float32)
    return inp.new_empty(inp.shape[0], n), amax, saved


# 4. Backward op --------------------------------------------------------------------------------


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


def _backward_impl(
    grad_out, saved, inp, m_splits, main_grad, scale, grad_amax, fwd_dtype, bwd_dtype, has_bias,
    need_dgrad, need_wgrad, native,
):  # fmt: skip
    wq_t, ws_t = saved[:2]
    wq_t = wq_t.view(fwd_dtype)
    dtype = grad_out.dtype
    groups, k, n = wq_t.shape
    rows = grad_out.shape[0]
    dinp, dweight, dbias = _empty(grad_out), _empty(grad_out), _empty(grad_out)
    if need_dgrad or grad_amax is not None:
        gq, gs = _quantize_grad(grad_out, scale, grad_amax, bwd_dtype)
    device_splits = _device_splits(m_splits, grad_out) if native else None
    if need_wgrad and len(saved) == 4:  # the forward saved the FP8 wgrad operand of the input
        dyt, dys, pad_ends = quantize_group_columns(
            grad_out, m_splits, bwd_dtype, _slot(scale, 2), device_splits, e4m3_codes=True
        )
        dw = _gemm_wgrad(
            dyt, dys, saved[2].view(fwd_dtype), saved[3], pad_ends, native, dtype, main_grad
        )
        dweight = _empty(grad_out) if dw is None else dw
        need_wgrad = False
    if native:
        splits, offs = device_splits
        if need_dgrad:
            dinp = _gemm_grouped(gq, gs, wq_t, ws_t, splits, offs)
        if need_wgrad:
            # [N, M] x [M, K] -> [G, N, K], grouped along the reduction dim, high precision
            # (bf16 out: torch's grouped GEMM has no fp32 output; added to main_grad in fp32).
            dweight = torch._grouped_mm(grad_out.t(), inp, offs=offs)
            if main_grad is not None:
                main_grad.add_(dweight)
                dweight = _empty(grad_out)
        if has_bias:
            group_ids = torch.arange(groups, device=grad_out.device)
            row_group = torch.repeat_interleave(group_ids, splits, output_size=rows)
            dbias = grad_out.new_zeros(groups, n, dtype=torch.float32)
            dbias = dbias.index_add_(0, row_group, grad_out.float()).to(dtype)
        return dinp, dweight, dbias
    splits = _host_splits(m_splits, rows)
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


@op("grouped_linear_fp8_bwd", mutates_args=("main_grad", "grad_amax"), opaque=HOST_SPLITS)
def grouped_linear_fp8_bwd(
    grad_out: Tensor,
    saved: list[Tensor],
    inp: Tensor | None,
    m_splits: Tensor,
    main_grad: Tensor | None,
    scale: Tensor | None,
    grad_amax: Tensor | None,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)``, 0-element where not computed (dweight also when it went
    into ``main_grad``, fp32, added to); with ``scale`` (delayed) the
    gradient is cast with ``scale[2]`` and ``amax(grad_out)`` written into ``grad_amax`` when
    given. The wgrad is FP8 when ``saved`` holds the forward's four tensors (``fp8_wgrad``:
    ``grad_out`` quantised per group and column along the tokens in ``bwd_dtype``, or with
    ``scale[2]``; :func:`_gemm_wgrad`), else high precision from ``inp`` (needed only then;
    None otherwise). Default (CPU): exact emulation for the FP8 GEMMs, fp32 per-group loop for
    a high-precision wgrad and dbias, each rounded once."""
    return _backward_impl(
        grad_out, saved, inp, m_splits, main_grad, scale, grad_amax, fwd_dtype, bwd_dtype,
        has_bias, need_dgrad, need_wgrad, native=False,
    )  # fmt: skip


@grouped_linear_fp8_bwd.register_kernel("cuda")
def _grouped_linear_fp8_bwd_cuda(
    grad_out, saved, inp, m_splits, main_grad, scale, grad_amax, fwd_dtype, bwd_dtype, has_bias,
    need_dgrad, need_wgrad,
):  # fmt: skip
    return _backward_impl(
        grad_out, saved, inp, m_splits, main_grad, scale, grad_amax, fwd_dtype, bwd_dtype,
        has_bias, need_dgrad, need_wgrad, native=_use_native(grad_out),
    )  # fmt: skip


@grouped_linear_fp8_bwd.register_fake
def _grouped_linear_fp8_bwd_fake(
    grad_out, saved, inp, m_splits, main_grad, scale, grad_amax, fwd_dtype, bwd_dtype, has_bias,
    need_dgrad, need_wgrad,
):  # fmt: skip
    groups, k, n = saved[0].shape
    if need_wgrad and len(saved) == 2:
        torch._check(inp is not None, lambda: "te.grouped_linear_fp8_bwd: wgrad needs inp")
    dinp = grad_out.new_empty(grad_out.shape[0], k) if need_dgrad else _empty(grad_out)
    want_dw = need_wgrad and main_grad is None
    dweight = grad_out.new_empty(groups, n, k) if want_dw else _empty(grad_out)
    dbias = grad_out.new_empty(groups, n) if has_bias else _empty(grad_out)
    return dinp, dweight, dbias


# 5. setup_context + autograd -------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, m_splits, _weight, bias, main_grad, scale, grad_amax, _recipe, fwd, bwd, *fp8_wgrad = (
        inputs
    )
    _out, amax, saved = output
    ctx.mark_non_differentiable(amax, *saved)
    # With the FP8 wgrad the forward saved the input's FP8 copy: the input itself is not kept.
    kept = None if fp8_wgrad and fp8_wgrad[0] else inp
    ctx.save_for_backward(kept, m_splits, main_grad, scale, grad_amax, *saved)
    ctx.has_bias = bias is not None
    ctx.fwd_dtype, ctx.bwd_dtype = fwd, bwd


def _backward(ctx, bwd, grad_out, _grad_amax, _grad_saved):
    inp, m_splits, main_grad, scale, grad_amax, *saved = ctx.saved_tensors
    need_dgrad, _, need_wgrad, need_bgrad = ctx.needs_input_grad[:4]
    has_bias = ctx.has_bias and need_bgrad
    dinp, dweight, dbias = bwd(
        grad_out.contiguous(),
        saved,
        inp if need_wgrad and len(saved) == 2 else None,
        m_splits,
        main_grad,
        scale,
        grad_amax,
        ctx.fwd_dtype,
        ctx.bwd_dtype,
        has_bias,
        need_dgrad,
        need_wgrad,
    )
    return (
        dinp if need_dgrad else None,
        None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if has_bias else None,
        # main_grad .. bwd_dtype, and fp8_wgrad where the call passed it (a trailing argument
        # left at its default does not reach the autograd function).
        *(None,) * (len(ctx.needs_input_grad) - 4),
    )


def _samples(device: torch.device):
    def t(*shape, dtype=torch.bfloat16, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    def splits(*values, on=device):
        return torch.tensor(values, device=on, dtype=torch.int64)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    rowwise = (None, None, None, "rowwise")
    # A zero-size group in the middle, bias.
    yield SampleInput((t(40, 16), splits(11, 0, 29), t(3, 32, 16), t(3, 32), *rowwise, e4m3, e5m2))
    # A CPU m_splits tensor (int32), first and last groups empty, no input gradient.
    yield SampleInput(
        (t(20, 32, grad=False), torch.tensor([0, 7, 13, 0], dtype=torch.int32), t(4, 16, 32),
         None, *rowwise, e4m3, e5m2)
    )  # fmt: skip
    # float32, one group, E4M3 gradient.
    f32 = torch.float32
    yield SampleInput(
        (t(24, 32, dtype=f32), splits(24, on="cpu"), t(1, 16, 32, dtype=f32), t(1, 16, dtype=f32),
         *rowwise, e4m3, e4m3)
    )  # fmt: skip
    # Delayed scaling: given per-tensor scales (powers of two: exact in every dtype), the
    # gradient's amax written into grad_amax.
    scale = torch.tensor([8.0, 16.0, 2048.0], device=device)
    grad_amax = torch.zeros(1, device=device)
    yield SampleInput(
        (t(40, 16), splits(11, 0, 29), t(3, 32, 16), t(3, 32), None, scale, grad_amax, "delayed",
         e4m3, e5m2)
    )  # fmt: skip
    # Weight gradient accumulated into main_grad (fp32), rowwise.
    yield SampleInput(
        (t(24, 16), splits(8, 16), t(2, 32, 16), None, torch.zeros(2, 32, 16, device=device),
         None, None, "rowwise", e4m3, e5m2)
    )  # fmt: skip
    # FP8 wgrad: E4M3 both ways (torch's grouped FP8 GEMM on CUDA), groups of 17 / 0 / 23 rows
    # (padded to 32 / 0 / 32 in the transposed operands), bias.
    yield SampleInput(
        (t(40, 16), splits(17, 0, 23), t(3, 32, 16), t(3, 32), *rowwise, e4m3, e4m3, True)
    )  # fmt: skip
    # FP8 wgrad with an E5M2 gradient, delayed scaling, into main_grad.
    yield SampleInput(
        (t(40, 16), splits(11, 29, 0), t(3, 32, 16), None, torch.zeros(3, 32, 16, device=device),
         scale.clone(), torch.zeros(1, device=device), "delayed", e4m3, e5m2, True)
    )  # fmt: skip


def _reference(
    inp, m_splits, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype,
    fp8_wgrad=False,
):  # fmt: skip
    return grouped_linear_fp8_ref(
        inp, m_splits, weight, bias, fwd_dtype, bwd_dtype, scale, fp8_wgrad
    )


_grouped_linear_fp8 = differentiable(
    grouped_linear_fp8_fwd,
    grouped_linear_fp8_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=_reference,
)


# Public function -------------------------------------------------------------------------------


def grouped_linear_fp8(
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    recipe: str = "rowwise",
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e5m2,
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    main_grad: Tensor | None = None,
    fp8_wgrad: bool = False,
    return_amax: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`te_compile.functional.grouped_linear` with FP8 forward and dgrad GEMMs (module
    docstring), through ``te::grouped_linear_fp8_fwd``: ``recipe="rowwise"`` (current scaling
    with rowwise scales) or ``"delayed"`` (per-tensor ``scale`` ``[3]``); ``grad_amax`` ``[1]``
    receives the gradient's amax in the backward (under "rowwise" it also makes the forward
    measure its amaxes: a read of each operand more). ``main_grad`` (fp32, ``weight``'s shape):
    the weight gradient is added to it instead of being returned. ``fp8_wgrad=True``: the
    wgrad GEMM in FP8 too, its operands quantised per (group, column) along the tokens (the
    input's in the forward, which then keeps that FP8 copy instead of the input; the
    gradient's in ``bwd_dtype``); native on CUDA with E4M3 both ways. ``return_amax=True``
    also returns the forward's ``[amax(inp), amax(weight)]`` (0-element under "rowwise" without
    ``grad_amax``)."""
    out, amax, _saved = _grouped_linear_fp8(
        inp, as_splits_tensor(m_splits), weight, bias, main_grad, scale, grad_amax, recipe,
        fwd_dtype, bwd_dtype, fp8_wgrad,
    )  # fmt: skip
    return (out, amax) if return_amax else out
