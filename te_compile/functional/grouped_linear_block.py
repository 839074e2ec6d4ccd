r"""FP8 blockwise grouped linear, native: ``te::grouped_linear_block_fwd`` / ``_bwd``
(Transformer Engine's ``Float8BlockScaling`` on a ``GroupedLinear``).

Torch has no grouped blockwise-scaled GEMM, so each expert runs the three GEMMs of
``te::linear_block_scaled(native=True)`` on its own rows, one blockwise-scaled
``torch._scaled_mm`` (cuBLAS) each, as Transformer Engine's grouped GEMM on Hopper is a loop of
GEMMs too. Per expert ``g`` (its rows ``X_g`` of ``inp``, its gradient rows ``dY_g``):

.. math::
    Y_g = Q_K(X_g)\,Q_K(W_g)^\top + b_g,\qquad dX_g = Q_N(dY_g)\,Q_N(W_g),\qquad
    dW_g = Q_{M_g}(dY_g)^\top Q_{M_g}(X_g)

where :math:`Q_D` quantises to E4M3 in blocks along dim :math:`D`: 1x128 for ``X`` and ``dY``,
``weight_block_rows`` x 128 for ``W`` (1x128 or 128x128), fp32 scales (powers of two with
``power_2_scale``). The wgrad's blocks run along the expert's own tokens: the first block of
each expert starts at its first row, so an expert's scales never mix in another's tokens.

One quantisation pass per operand writes both directions for all experts (``quantize_blockwise``
with its transposed copy, the CUDA cast where it applies) over a layout in which every expert
starts at a multiple of 128 rows: ``inp`` itself when every expert's tokens are a multiple of
128, else one scatter into a static capacity of ``128 * (M // 128 + G)`` rows with zero rows
between experts (zero rows change no amax, no block and no result). So the transposed copy's
1x128 blocks along the tokens start at each expert, and each expert's GEMM operands are slices
of the copies, given to cuBLAS with a leading dimension and their scales already rows-major (no
copies). The forward saves the input's transposed FP8 copy and its scales (flat buffers of that
static size: the fake needs no splits) and each ``W_g``'s transposed copy; the backward needs
neither ``inp`` nor ``weight``. cuBLAS's blockwise GEMM refuses a row count that is not a
multiple of 16 (H100, torch 2.11): such an expert's forward and dgrad GEMMs run on its rows
padded to 16 (zeros of the layout) and copy the result's first rows. Zero-size experts are
skipped (their weight and bias gradients are zero).

The splits are read on the host: ``m_splits`` on the GPU costs a device sync (Transformer
Engine's grouped GEMMs take host splits; pass a list or a CPU tensor to avoid it). On CPU (the
tests) the same code runs with the GEMMs emulated by ``linear_block_scaled._block_scaled_mm``
(dequantised in fp32, exact, multiplied in fp32), so the layouts and offsets are checked
everywhere; on an H100 the GEMMs are cuBLAS's. The reference is the dense op's, expert by
expert.

Constraints: E4M3 both ways (cuBLAS's blockwise kernels take E4M3 only); ``in_features`` and
``out_features`` multiples of 16, and of 512 with 128x128 weight blocks (see
``linear_block_scaled.native_block_supported``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_compile._library import HOST_SPLITS, SampleInput, differentiable, op
from te_compile.functional.gemm import block_scaled_mm, blockwise_supported
from te_compile.functional.gemm import padded as _padded
from te_compile.functional.grouped_linear import _empty, _host_splits, as_splits_tensor
from te_compile.functional.grouped_linear_fp8 import _check as _check_grouped
from te_compile.functional.linear import quantized_linear_ref
from te_compile.functional.quantize import quantize_blockwise

__all__ = ["grouped_linear_block"]

_E4M3 = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_NAME = "te.grouped_linear_block"


def _check(inp, m_splits, weight, bias, main_grad, weight_block_rows) -> None:
    """Static constraints, shared by the implementations and the fake."""
    _check_grouped(inp, m_splits, weight, bias, main_grad, None, None, "rowwise", _E4M3, _E4M3,
                   name=_NAME)  # fmt: skip
    if weight_block_rows not in (1, 128):
        raise ValueError(
            f"{_NAME}: weight_block_rows must be 1 (1x128 blocks) or 128 (128x128), got "
            f"{weight_block_rows}"
        )
    if not blockwise_supported(weight[0], weight_block_rows, _E4M3, _E4M3):
        raise ValueError(
            f"{_NAME}: 128x128 weight blocks need in_features and out_features to be multiples "
            f"of 512 (cuBLAS's blockwise GEMM); weight is {list(weight.shape)}"
        )


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


def _quantize(x: Tensor, power_2_scale: bool, block_rows: int = 1, out_t=None):
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
    m16 = _padded(m)
    return out.copy_(block_scaled_mm(a[:m16], sa[:m16], b, sb, b_rows, dtype, bias)[:m])


# Forward op ------------------------------------------------------------------------------------


@op("grouped_linear_block_fwd", opaque=HOST_SPLITS)
def grouped_linear_block_fwd(
    inp: Tensor,
    m_splits: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    power_2_scale: bool,
    weight_block_rows: int,
) -> tuple[Tensor, list[Tensor]]:
    """``(out, saved)``: ``out`` ``[M, out_features]``; ``saved = [X^T codes (uint8, flat: the
    first ``K * width`` bytes are ``[K, width]``, every expert's tokens from a multiple of 128),
    their 1x128 scales (fp32, flat, ``[width / 128, K]``), W_g^T codes ``[K, N]`` (uint8) for
    each expert, their scales for each expert]``; ``width`` is ``M`` when every expert's tokens
    are a multiple of 128, else the static capacity ``128 * (M // 128 + G)``. ``main_grad`` is
    only carried to the backward."""
    _check(inp, m_splits, weight, bias, main_grad, weight_block_rows)
    groups, n, k = weight.shape
    rows = inp.shape[0]
    splits = _host_splits(m_splits, rows)
    firsts, starts, width = _plan(splits, rows)
    cap = _capacity(rows, groups)
    x_t = inp.new_empty(k * cap, dtype=torch.uint8)
    x_s = inp.new_empty(k * cap // 128, dtype=torch.float32)
    x = _padded_rows(inp, splits, firsts, starts, width)
    xd, xs, _, _ = _quantize(x, power_2_scale, 1, _transposed_views(x_t, x_s, width, k))
    out = inp.new_empty(rows, n)
    w_t, w_s = [], []
    for g, (m, row, pos) in enumerate(zip(splits, firsts, starts, strict=True)):
        wd, ws, wd_t, ws_t = _quantize(weight[g], power_2_scale, weight_block_rows)
        w_t.append(wd_t.view(torch.uint8))
        w_s.append(ws_t)
        if m:
            b = None if bias is None else bias[g]
            _gemm_rows(xd[pos:], xs[pos:], wd, ws, weight_block_rows, inp.dtype, b,
                       out[row : row + m])  # fmt: skip
    return out, [x_t, x_s, *w_t, *w_s]


@grouped_linear_block_fwd.register_fake
def _grouped_linear_block_fwd_fake(
    inp, m_splits, weight, bias, main_grad, power_2_scale, weight_block_rows
):  # fmt: skip
    _check(inp, m_splits, weight, bias, main_grad, weight_block_rows)
    groups, n, k = weight.shape
    cap = _capacity(inp.shape[0], groups)
    u8, f32 = torch.uint8, torch.float32
    w_t = [inp.new_empty(k, n, dtype=u8) for _ in range(groups)]
    w_rows = _cdiv(k, weight_block_rows)
    w_s = [inp.new_empty(w_rows, _cdiv(n, 128), dtype=f32) for _ in range(groups)]
    saved = [inp.new_empty(k * cap, dtype=u8), inp.new_empty(k * cap // 128, dtype=f32)]
    return inp.new_empty(inp.shape[0], n), saved + w_t + w_s


# Backward op -----------------------------------------------------------------------------------


@op("grouped_linear_block_bwd", mutates_args=("main_grad",), opaque=HOST_SPLITS)
def grouped_linear_block_bwd(
    grad_out: Tensor,
    saved: list[Tensor],
    m_splits: Tensor,
    main_grad: Tensor | None,
    power_2_scale: bool,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)``, 0-element where not computed (``dweight`` also when it was
    added to ``main_grad``, fp32). ``dY`` in the forward's padded layout, quantised once in
    1x128 blocks both ways; per expert the dgrad against the saved ``W_g^T`` and the wgrad
    against the saved ``X^T`` columns of the expert (blocks along its own tokens)."""
    x_t, x_s = saved[:2]
    groups = (len(saved) - 2) // 2
    w_t, w_s = saved[2 : 2 + groups], saved[2 + groups :]
    k, n = w_t[0].shape
    w_rows = 1 if w_s[0].shape[0] == k else 128  # k >= 16 > 1
    dtype = grad_out.dtype
    rows = grad_out.shape[0]
    splits = _host_splits(m_splits, rows)
    firsts, starts, width = _plan(splits, rows)
    dy = _padded_rows(grad_out, splits, firsts, starts, width)
    codes = grad_out.new_empty(n * width, dtype=torch.uint8)
    scales = grad_out.new_empty(n * width // 128, dtype=torch.float32)
    gd, gs, gd_t, gs_t = _quantize(dy, power_2_scale, 1, _transposed_views(codes, scales, width, n))
    xd_t, xs_t = _transposed_views(x_t, x_s, width, k)
    xd_t = xd_t.view(_E4M3)
    dinp = grad_out.new_empty(rows, k) if need_dgrad else _empty(grad_out)
    into_weight = need_wgrad and main_grad is None
    dweight = grad_out.new_zeros(groups, n, k) if into_weight else _empty(grad_out)
    dbias = grad_out.new_zeros(groups, n) if has_bias else _empty(grad_out)
    for g, (m, row, pos) in enumerate(zip(splits, firsts, starts, strict=True)):
        if not m:
            continue
        if need_dgrad:
            w = w_t[g].view(_E4M3)
            _gemm_rows(gd[pos:], gs[pos:], w, w_s[g], w_rows, dtype, None, dinp[row : row + m])
        if need_wgrad:
            cols, blocks = (
                slice(pos, pos + _padded(m)),
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


@grouped_linear_block_bwd.register_fake
def _grouped_linear_block_bwd_fake(
    grad_out, saved, m_splits, main_grad, power_2_scale, has_bias, need_dgrad, need_wgrad
):  # fmt: skip
    groups = (len(saved) - 2) // 2
    k, n = saved[2].shape
    dinp = grad_out.new_empty(grad_out.shape[0], k) if need_dgrad else _empty(grad_out)
    into_weight = need_wgrad and main_grad is None
    dweight = grad_out.new_empty(groups, n, k) if into_weight else _empty(grad_out)
    dbias = grad_out.new_empty(groups, n) if has_bias else _empty(grad_out)
    return dinp, dweight, dbias


# setup_context + autograd ----------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    _inp, m_splits, _weight, bias, main_grad, power_2_scale, _w_rows = inputs
    _out, saved = output
    ctx.mark_non_differentiable(*saved)
    ctx.save_for_backward(m_splits, main_grad, *saved)
    ctx.has_bias, ctx.power_2_scale = bias is not None, power_2_scale


def _backward(ctx, bwd, grad_out, _grad_saved):
    m_splits, main_grad, *saved = ctx.saved_tensors
    need_dgrad, _, need_wgrad, need_bgrad = ctx.needs_input_grad[:4]
    has_bias = ctx.has_bias and need_bgrad
    dinp, dweight, dbias = bwd(
        grad_out.contiguous(), saved, m_splits, main_grad, ctx.power_2_scale, has_bias,
        need_dgrad, need_wgrad,
    )  # fmt: skip
    return (
        dinp if need_dgrad else None,
        None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if has_bias else None,
        None,
        None,
        None,
    )


def _samples(device: torch.device):
    def t(*shape, dtype=torch.bfloat16, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    def splits(*values, on=device):
        return torch.tensor(values, device=on, dtype=torch.int64)

    # Experts of 17 / 0 / 40 tokens (the padded layout: experts from rows 0 and 128), a partial
    # 128-block of features (K = 144), 1x128 weight blocks, power-of-two scales, bias.
    yield SampleInput((t(57, 144), splits(17, 0, 40), t(3, 32, 144), t(3, 32), None, True, 1))
    # 128x128 weight blocks (features multiples of 512), an expert of 130 tokens (two blocks
    # along the tokens for the wgrad, the second partial), a CPU int32 m_splits.
    yield SampleInput(
        (t(146, 512), torch.tensor([16, 130], dtype=torch.int32), t(2, 512, 512), None, None,
         False, 128)
    )  # fmt: skip
    # The weight gradient added to main_grad (fp32), no input gradient, the first expert empty.
    yield SampleInput(
        (t(24, 32, grad=False), splits(0, 24, 0), t(3, 48, 32), t(3, 48),
         torch.zeros(3, 48, 32, device=device), False, 1)
    )  # fmt: skip
    # float32.
    f32 = torch.float32
    yield SampleInput(
        (t(40, 32, dtype=f32), splits(8, 32, on="cpu"), t(2, 16, 32, dtype=f32), None, None,
         True, 1)
    )  # fmt: skip


def _reference(inp, m_splits, weight, bias, main_grad, power_2_scale, weight_block_rows):
    """The dense op's reference (``linear_block_scaled._Reference``) on each expert's rows."""
    outs, row = [inp.new_zeros(0, weight.shape[1])], 0
    for g, m in enumerate(m_splits.tolist()):
        if m:
            b = None if bias is None else bias[g]
            y = quantized_linear_ref(inp[row : row + m], weight[g], "block", _E4M3, _E4M3,
                                     power_2_scale, weight_block_rows)  # fmt: skip
            outs.append(y if b is None else y + b)
        row += m
    return torch.cat(outs)


_grouped_linear_block = differentiable(
    grouped_linear_block_fwd,
    grouped_linear_block_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=_reference,
)


# Public function -------------------------------------------------------------------------------


def grouped_linear_block(
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    power_2_scale: bool = False,
    weight_block_rows: int = 128,
    main_grad: Tensor | None = None,
) -> Tensor:
    """:func:`te_compile.functional.grouped_linear` with Float8BlockScaling's native FP8 GEMMs
    (module docstring): E4M3 operands in 1x128 blocks (the weight in ``weight_block_rows`` x 128
    blocks), fp32 scales (powers of two with ``power_2_scale``). ``main_grad`` (fp32,
    ``weight``'s shape): the weight gradient is added to it instead of being returned. The
    splits are read on the host."""
    out, _saved = _grouped_linear_block(
        inp, as_splits_tensor(m_splits), weight, bias, main_grad, power_2_scale, weight_block_rows
    )
    return out
