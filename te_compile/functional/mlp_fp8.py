r"""FP8 MLP with per-tensor scaling: ``te::mlp_fp8_fwd`` / ``te::mlp_fp8_bwd``.

.. math::
    z = X W_1^\top,\quad h = f(z + b_1),\quad Y = h W_2^\top + b_2

with the four GEMMs of :func:`linear_fp8` (forward, dgrad, wgrad of each linear; FP8 through
``torch._scaled_mm``, E4M3 forward, the gradient format backward) and the same bytes as
``linear_fp8 -> bias_activation -> linear_fp8``, but one op pair for the whole block, so that the
activation and its gradient are never written in high precision between two quantisations: on
CUDA ``kernels.act_quantize`` computes :math:`h` from :math:`z` inside the quantisation of the
second GEMM's input, and :math:`dz = dh \odot f'(z + b_1)` (with :math:`db_1`) inside the
quantisation of the first GEMM's gradient. What that saves per step, for ``z`` ``[T, F]``: the
write and two reads of :math:`h` and of :math:`dz` (current scaling reads :math:`z` twice
instead; delayed scaling once).

Saved for the backward: the FP8 transposed copies of ``X``, ``W_1``, ``h``, ``W_2`` with their
inverse scales, and ``z`` (the activation's input, as the unfused path saves it).

Element-wise activations (gelu, qgelu, relu, srelu, silu) and gated ones (``GATED_ACTIVATIONS``,
as LayerNormMLP lays them out: ``fc1_weight`` ``[2 * ffn, hidden]``, the activation half's rows
first; clamped SwiGLU with ``bias_activation``'s default ``limit`` / ``alpha`` /
``glu_linear_offset``). For a gated one :math:`h = f(a) \odot l` is quantised from ``z``'s two
halves, and both halves of :math:`dz` (``[T, 2F]``) are quantised from one read of :math:`dh`
and ``z`` under one scale (per tensor) or in 1x128 blocks that never straddle the halves.
``recipe="block"`` is Float8BlockScaling with
native blockwise GEMMs (1x128 blocks for ``X``, ``h`` and the gradients, 128x128 for the
weights, E4M3 both ways, feature sizes multiples of 512; ``power_2_scale`` as the recipe's
``use_f32_scales=False``): the same structure with ``kernels.act_quantize.act_quantize_block``
and the GEMMs of ``linear_block_scaled(native=True)``; its inverse scales are block scales.
``scale1`` / ``scale2`` (delayed scaling, ``[3]`` each: input, weight, gradient of each GEMM)
and the written ``grad_amax1`` / ``grad_amax2`` are those of ``linear_fp8`` per GEMM; the
forward returns ``[amax(X), amax(W_1), amax(h), amax(W_2)]`` (per-tensor recipes). Token counts
that are not multiples of 16 are padded inside the ops, as in ``linear_fp8``.

The default (CPU) implementation composes the unfused ops' CPU implementations; the two paths
are compared bit for bit in the tests (the bias gradient, a sum in another order, closely).
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op
from te_compile.functional.activation import (
    GATED_ACTIVATIONS,
    activation_bwd,
    activation_fwd,
    activation_ref,
    gated_activation_bwd,
    gated_activation_fwd,
    gated_activation_ref,
)
from te_compile.functional.linear_block_scaled import (
    _block_scaled_mm,
    _norm_quantize_block,
    _quantize_block,
    _quantize_block_sums,
    native_block_supported,
)
from te_compile.functional.linear_block_scaled import (
    _reference as _block_reference,
)
from te_compile.functional.linear_fp8 import (
    _FP8_DTYPES,
    _HIGH,
    FP8_RECIPES,
    _check_norm,
    _fake_dnorm,
    _fake_stats,
    _gemm,
    _norm_needs_dgrad,
    _norm_quantize,
    _pad_rows,
    _padded,
    _quantize_both,
    _save_norm,
    _scaled_mm,
    _slots,
    _through_norm,
    _with_norm_grads,
    delayed_on_cuda,
    linear_fp8_ref,
    norm_ref,
    unit_rows,
)

__all__ = ["FUSED_ACTIVATIONS", "MLP_FP8_RECIPES", "mlp_fp8", "mlp_fp8_ref"]

FUSED_ACTIVATIONS = ("gelu", "qgelu", "relu", "srelu", "silu", *GATED_ACTIVATIONS)
# "block": Float8BlockScaling's native GEMMs (1x128 blocks for X, h and the gradients, 128x128
# for the weights, E4M3 both ways), as ``linear_block_scaled(..., native=True)`` runs them.
MLP_FP8_RECIPES = (*FP8_RECIPES, "block")


def mlp_fp8_ref(
    inp: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    activation: str,
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e5m2,
    scale1: Tensor | None = None,
    scale2: Tensor | None = None,
) -> Tensor:
    """Definition of correctness, differentiable: ``linear_fp8_ref`` twice around the
    activation reference (in the input's dtype: fp64 in the tests)."""
    z = linear_fp8_ref(inp, fc1_weight, None, fwd_dtype, bwd_dtype, scale1)
    h = _activation_ref(z, fc1_bias, activation)
    return linear_fp8_ref(h, fc2_weight, fc2_bias, fwd_dtype, bwd_dtype, scale2)


def _activation_ref(z: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    if activation in GATED_ACTIVATIONS:
        return gated_activation_ref(z, bias, activation)
    return activation_ref(z, bias, activation)


def _ffn(w1: Tensor, activation: str) -> int:
    """The activation's output features: FC1's, or half of them for a gated activation."""
    return w1.shape[0] // 2 if activation in GATED_ACTIVATIONS else w1.shape[0]


def _check(
    inp, w1, b1, w2, b2, scale1, scale2, ga1, ga2, activation, recipe, fwd, bwd, pow2, norm
) -> None:
    p = "te.mlp_fp8: "
    _check_norm(p, inp, norm)
    if activation not in FUSED_ACTIVATIONS:
        raise ValueError(p + f"activation must be one of {FUSED_ACTIVATIONS}, got {activation!r}")
    if recipe not in MLP_FP8_RECIPES:
        raise ValueError(p + f"recipe must be one of {MLP_FP8_RECIPES}, got {recipe!r}")
    if fwd not in _FP8_DTYPES or bwd not in _FP8_DTYPES:
        raise ValueError(p + f"fwd_dtype/bwd_dtype must be FP8 dtypes, got {fwd}/{bwd}")
    if inp.dtype not in _HIGH or w1.dtype != inp.dtype or w2.dtype != inp.dtype:
        raise ValueError(
            p + f"inp, fc1_weight and fc2_weight must share a float32/bfloat16/float16 dtype, "
            f"got {inp.dtype}, {w1.dtype}, {w2.dtype}"
        )
    gated = activation in GATED_ACTIVATIONS
    if (
        w1.ndim != 2
        or w2.ndim != 2
        or inp.ndim < 1
        or inp.shape[-1] != w1.shape[1]
        or (gated and w1.shape[0] % 2)
        or w2.shape[1] != _ffn(w1, activation)
    ):
        fc1 = "[2 * ffn, hidden] (gated activation)" if gated else "[ffn, hidden]"
        raise ValueError(
            p + f"inp [..., hidden], fc1_weight {fc1} and fc2_weight [out, ffn] do not "
            f"match: {list(inp.shape)}, {list(w1.shape)}, {list(w2.shape)}"
        )
    if w1.shape[0] % 16 or w1.shape[1] % 16 or w2.shape[0] % 16 or w2.shape[1] % 16:
        raise ValueError(
            p + f"FP8 GEMMs need hidden ({w1.shape[1]}), ffn ({w2.shape[1]}), fc1 out "
            f"({w1.shape[0]}) and out ({w2.shape[0]}) sizes that are multiples of 16"
        )
    if recipe == "block" and any(t is not None for t in (scale1, scale2, ga1, ga2)):
        raise ValueError(
            p + 'recipe="block" takes no scale1/scale2/grad_amax1/grad_amax2 (per-tensor state)'
        )
    if pow2 and recipe != "block":
        raise ValueError(p + f'power_2_scale applies to recipe="block", got recipe={recipe!r}')
    if recipe == "block" and not (
        native_block_supported(w1, 128, fwd, bwd) and native_block_supported(w2, 128, fwd, bwd)
    ):
        raise ValueError(
            p + 'recipe="block" runs the native blockwise GEMMs: fwd_dtype and bwd_dtype must be '
            f"float8_e4m3fn (got {fwd}/{bwd}) and hidden, ffn and out multiples of 512 (got "
            f"{w1.shape[1]}, {w1.shape[0]}, {w2.shape[0]})"
        )
    for name, b, n in (("fc1_bias", b1, w1.shape[0]), ("fc2_bias", b2, w2.shape[0])):
        if b is not None and (b.shape != (n,) or b.dtype != inp.dtype):
            raise ValueError(p + f"{name} must be [{n}] of dtype {inp.dtype}")
    for name, s in (("scale1", scale1), ("scale2", scale2)):
        if recipe == "delayed" and (s is None or s.shape != (3,)):
            raise ValueError(p + f'recipe="delayed" needs {name} [3] (input, weight, grad)')
    for name, g in (("grad_amax1", ga1), ("grad_amax2", ga2)):
        if g is not None and g.shape != (1,):
            raise ValueError(p + f"{name} must be [1], got {list(g.shape)}")


def _activation_eager(z, bias, grad, activation, need_dbias):
    """``(activation of z + bias, None)`` or with ``grad`` ``(its gradient, dbias)`` by the
    activation ops' implementations (gated: contiguous halves, clamped SwiGLU's defaults)."""
    if activation in GATED_ACTIVATIONS:
        if grad is None:
            return gated_activation_fwd.eager(z, bias, activation), None
        return gated_activation_bwd.eager(grad, z, bias, activation, 0, 7.0, 1.702, 1.0, need_dbias)
    if grad is None:
        return activation_fwd.eager(z, bias, activation), None
    return activation_bwd.eager(grad, z, bias, activation, need_dbias)


def _act_quantize(z, bias, grad, activation, fp8_dtype, scale, rows, need_dbias):
    """``(data, data_t, scale_inv, amax, dbias)`` of the activation of ``z + bias`` (forward) or
    of its gradient ``grad * f'(z + bias)`` (backward), rows past ``rows`` zero: on CUDA in the
    fused kernels; elsewhere the unfused ops' implementations (activation, rounded to ``z``'s
    dtype, zero rows appended, quantised)."""
    if z.device.type == "cuda":
        from te_compile.kernels.act_quantize import act_quantize

        return act_quantize(z, bias, grad, activation, fp8_dtype, scale, rows, True, need_dbias)
    v, dbias = _activation_eager(z[:rows], bias, None if grad is None else grad[:rows], activation,
                                 need_dbias)  # fmt: skip
    data, data_t, scale_inv, amax = _quantize_both(_pad_rows(v), fp8_dtype, scale, True)
    return data, data_t, scale_inv, amax, dbias if need_dbias else None


def _act_quantize_block(
    z, bias, grad, activation, fp8_dtype, rows, need_dbias, power_2_scale, mn_major
):  # fmt: skip
    """``(data, scale_inv, data_t, scale_inv_t, dbias)``: :func:`_act_quantize` in 1x128 blocks
    (``kernels.act_quantize.act_quantize_block`` on CUDA, scales M-major where ``mn_major``
    asks; elsewhere the unfused ops, compact scales)."""
    if z.device.type == "cuda":
        from te_compile.kernels.act_quantize import act_quantize_block

        return act_quantize_block(
            z, bias, grad, activation, fp8_dtype, rows, need_dbias, power_2_scale,
            mn_major=mn_major,
        )  # fmt: skip
    v, dbias = _activation_eager(z[:rows], bias, None if grad is None else grad[:rows], activation,
                                 need_dbias)  # fmt: skip
    data, s, data_t, s_t = _quantize_block(_pad_rows(v), fp8_dtype, 1, power_2_scale)
    return data, s, data_t, s_t, dbias if need_dbias else None


def _u8(t: Tensor) -> Tensor:
    return t.view(torch.uint8)


# Forward op -----------------------------------------------------------------------------------


@op("mlp_fp8_fwd", kept_whole=delayed_on_cuda)
def mlp_fp8_fwd(
    inp: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    scale1: Tensor | None,
    scale2: Tensor | None,
    grad_amax1: Tensor | None,
    grad_amax2: Tensor | None,
    activation: str,
    recipe: str,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    power_2_scale: bool = False,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    normalization: str = "",
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> tuple[Tensor, list[Tensor], Tensor]:
    """``(out, saved, amax)``: ``saved = [X_8^T, s_x^-1, W1_8^T, s_w1^-1, z, h_8^T, s_h^-1,
    W2_8^T, s_w2^-1]``, ``amax = [amax(X), amax(W1), amax(h), amax(W2)]`` (fp32; 0 elements
    for ``recipe="block"``, whose inverse scales are the block scales of the transposed copies,
    X's and h's as the wgrad GEMMs take them, ``[M / 128, K]``;
    ``power_2_scale`` applies to it). With a ``normalization`` (LayerNormMLP), ``X`` is the
    norm of ``inp`` (never written on CUDA) and ``saved`` ends with its ``mean, rsigma``."""
    norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    args = (scale1, scale2, grad_amax1, grad_amax2, activation, recipe, fwd_dtype, bwd_dtype)
    _check(inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *args, power_2_scale, norm)
    if recipe == "block":
        return _block_fwd(inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, fwd_dtype,
                          power_2_scale, norm)  # fmt: skip
    (s_x, s_w1, _), (s_h, s_w2, _) = _slots(scale1, recipe), _slots(scale2, recipe)
    x = inp.reshape(-1, inp.shape[-1])
    m = x.shape[0]
    dtype = inp.dtype
    stats = []
    if normalization:
        xq, xq_t, xs, xa, *stats = _norm_quantize(x, norm, fwd_dtype, s_x)
    else:
        xq, xq_t, xs, xa = _quantize_both(_pad_rows(x), fwd_dtype, s_x, True)
    w1q, w1q_t, w1s, w1a = _quantize_both(fc1_weight, fwd_dtype, s_w1, True)
    z = _gemm(xq, w1q, xs, w1s, dtype)
    hq, hq_t, hs, ha, _ = _act_quantize(z, fc1_bias, None, activation, fwd_dtype, s_h, m, False)
    w2q, w2q_t, w2s, w2a = _quantize_both(fc2_weight, fwd_dtype, s_w2, True)
    out = _gemm(hq, w2q, hs, w2s, dtype, fc2_bias)
    out = out[:m].clone() if out.shape[0] != m else out
    saved = [_u8(xq_t), xs, _u8(w1q_t), w1s, z, _u8(hq_t), hs, _u8(w2q_t), w2s, *stats]
    amax = torch.cat([xa, w1a, ha, w2a])
    return out.reshape(*inp.shape[:-1], fc2_weight.shape[0]), saved, amax


def _block_fwd(inp, w1, b1, w2, b2, activation, fwd_dtype, pow2, norm):
    """The forward of ``recipe="block"``: 1x128-block X and h, 128x128-block weights."""
    x = inp.reshape(-1, inp.shape[-1])
    m = x.shape[0]
    stats = []
    if norm[2]:
        xq, xs, xq_t, xs_t, *stats = _norm_quantize_block(x, norm, fwd_dtype, pow2, (True, True))
    else:
        xq, xs, xq_t, xs_t = _quantize_block(_pad_rows(x), fwd_dtype, 1, pow2)
    w1q, w1s, w1q_t, w1s_t = _quantize_block(w1, fwd_dtype, 128, pow2)
    z = _block_scaled_mm(xq, xs, 1, w1q, w1s, 128, inp.dtype)
    hq, hs, hq_t, hs_t, _ = _act_quantize_block(
        z, b1, None, activation, fwd_dtype, m, False, pow2, (True, True)
    )
    w2q, w2s, w2q_t, w2s_t = _quantize_block(w2, fwd_dtype, 128, pow2)
    out = _block_scaled_mm(hq, hs, 1, w2q, w2s, 128, inp.dtype, b2)
    out = out[:m].clone() if out.shape[0] != m else out
    # The transposed copies' scales are saved as the wgrad GEMMs take them: [M / 128, K]
    # (no copy when the kernels wrote them rows-major).
    xs_t, hs_t = xs_t.t().contiguous(), hs_t.t().contiguous()
    saved = [_u8(xq_t), xs_t, _u8(w1q_t), w1s_t, z, _u8(hq_t), hs_t, _u8(w2q_t), w2s_t, *stats]
    return out.reshape(*inp.shape[:-1], w2.shape[0]), saved, inp.new_empty(0, dtype=torch.float32)


@mlp_fp8_fwd.register_fake
def _mlp_fp8_fwd_fake(
    inp, w1, b1, w2, b2, scale1, scale2, ga1, ga2, activation, recipe, fwd, bwd, pow2=False,
    norm_weight=None, norm_bias=None, normalization="", norm_eps=1e-5, zero_centered_gamma=False,
):  # fmt: skip
    norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    args = (scale1, scale2, ga1, ga2, activation, recipe, fwd, bwd, pow2, norm)
    _check(inp, w1, b1, w2, b2, *args)
    rows = inp.numel() // inp.shape[-1]
    m = _padded(rows)
    d, f1, f, n = w1.shape[1], w1.shape[0], w2.shape[1], w2.shape[0]
    u8, f32 = torch.uint8, torch.float32
    block = recipe == "block"

    def scales(rows, cols):  # [cols / 128, rows] block scales of a transposed copy, or a scalar
        return inp.new_empty(*((-(-cols // 128), rows) if block else (1,)), dtype=f32)

    w_scales = [scales(f1 // 128, d), scales(n // 128, f)] if block else [scales(0, 0)] * 2
    saved = [
        inp.new_empty(d, m, dtype=u8), scales(d, m), inp.new_empty(d, f1, dtype=u8),
        w_scales[0].clone(), inp.new_empty(m, f1), inp.new_empty(f, m, dtype=u8), scales(f, m),
        inp.new_empty(f, n, dtype=u8), w_scales[1].clone(),
        *_fake_stats(inp, rows, normalization),
    ]  # fmt: skip
    return inp.new_empty(*inp.shape[:-1], n), saved, inp.new_empty(0 if block else 4, dtype=f32)


# Backward op ----------------------------------------------------------------------------------


@op("mlp_fp8_bwd", mutates_args=("grad_amax1", "grad_amax2"), kept_whole=delayed_on_cuda)
def mlp_fp8_bwd(
    grad_out: Tensor,
    saved: list[Tensor],
    fc1_bias: Tensor | None,
    scale1: Tensor | None,
    scale2: Tensor | None,
    grad_amax1: Tensor | None,
    grad_amax2: Tensor | None,
    activation: str,
    recipe: str,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    power_2_scale: bool,
    has_fc2_bias: bool,
    need_dgrad: bool,
    norm_inp: Tensor | None = None,
    norm_weight: Tensor | None = None,
    normalization: str = "",
    zero_centered_gamma: bool = False,
    has_norm_bias: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dinp, dfc1_weight, dfc1_bias, dfc2_weight, dfc2_bias, dnorm_weight, dnorm_bias)``
    (0-element where not computed); writes ``amax(dz)`` / ``amax(dY)`` into ``grad_amax1`` /
    ``grad_amax2`` (per-tensor recipes). With a ``normalization``, ``norm_inp`` is the
    forward's input and ``dinp`` goes through the norm's backward (``need_dgrad``: any of the
    input and the norm's parameters needs a gradient)."""
    norm = (norm_inp, norm_weight, saved[9:], normalization, zero_centered_gamma, has_norm_bias)
    if recipe == "block":
        return _block_bwd(grad_out, saved[:9], fc1_bias, activation, fwd_dtype, bwd_dtype,
                          power_2_scale, has_fc2_bias, need_dgrad, norm)  # fmt: skip
    x_t, xs, w1_t, w1s, z, h_t, hs, w2_t, w2s = saved[:9]
    x_t, w1_t, h_t, w2_t = (t.view(fwd_dtype) for t in (x_t, w1_t, h_t, w2_t))
    s_dz, s_dy = _slots(scale1, recipe)[2], _slots(scale2, recipe)[2]
    dtype = grad_out.dtype
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    m = dy.shape[0]
    gq, gq_t, gs, ga = _quantize_both(_pad_rows(dy), bwd_dtype, s_dy, True)
    if grad_amax2 is not None:
        grad_amax2.copy_(ga)
    # fc2: dh [M, F] = dY_8 @ W2_8; dW2 [N, F] = dY_8^T @ h_8
    dh = _scaled_mm(gq, w2_t.t(), gs, w2s, dtype)
    dw2 = _scaled_mm(gq_t, h_t.t(), gs, hs, dtype)
    db2 = dy.sum(0, dtype=torch.float32).to(dtype) if has_fc2_bias else dy.new_empty(0)
    dq, dq_t, ds, da, db1 = _act_quantize(
        z, fc1_bias, dh, activation, bwd_dtype, s_dz, m, fc1_bias is not None
    )
    if grad_amax1 is not None:
        grad_amax1.copy_(da)
    # fc1: dX [M, D] = dz_8 @ W1_8; dW1 [F, D] = dz_8^T @ X_8
    dinp, dnorm = _dgrad_through_norm(
        need_dgrad, lambda: _scaled_mm(dq, w1_t.t(), ds, w1s, dtype), m, grad_out, norm
    )
    dw1 = _scaled_mm(dq_t, x_t.t(), ds, xs, dtype)
    return dinp, dw1, dy.new_empty(0) if db1 is None else db1, dw2, db2, *dnorm


def _dgrad_through_norm(need_dgrad, dgrad, m, grad_out, norm) -> tuple[Tensor, list[Tensor]]:
    """``(dinp, [dnorm_weight, dnorm_bias])``: the first GEMM's dgrad (``dgrad()``, padded
    rows dropped) through the norm prologue's backward when there is one."""
    if not need_dgrad:
        return grad_out.new_empty(0), [grad_out.new_empty(0), grad_out.new_empty(0)]
    dinp = dgrad()
    dinp = dinp[:m].clone() if dinp.shape[0] != m else dinp
    dinp, *dnorm = _through_norm(dinp, *norm)
    return dinp.reshape(*grad_out.shape[:-1], dinp.shape[-1]), dnorm


def _block_bwd(
    grad_out, saved, b1, activation, fwd_dtype, bwd_dtype, pow2, has_b2, need_dgrad, norm
):  # fmt: skip
    """The backward of ``recipe="block"``: the GEMMs of ``linear_block_scaled``'s native
    backward, twice, with ``dz`` quantised by the fused kernel."""
    x_t, xs_t, w1_t, w1s_t, z, h_t, hs_t, w2_t, w2s_t = saved
    x_t, w1_t, h_t, w2_t = (t.view(fwd_dtype) for t in (x_t, w1_t, h_t, w2_t))
    dtype = grad_out.dtype
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    m = dy.shape[0]
    gq, gs, gq_t, gs_t, db2 = _quantize_block_sums(_pad_rows(dy), bwd_dtype, pow2, has_b2, True)
    # fc2: dh [M, F] = dY @ W2 (W2^T in 128x128 blocks along N); dW2 [N, F] = dY^T @ h
    dh = _block_scaled_mm(gq, gs, 1, w2_t, w2s_t, 128, dtype)
    dw2 = _block_scaled_mm(gq_t, gs_t, 1, h_t, hs_t.t(), 1, dtype)
    db2 = db2.to(dtype) if has_b2 else dy.new_empty(0)
    need_db1 = b1 is not None
    dq, ds, dq_t, ds_t, db1 = _act_quantize_block(
        z, b1, dh, activation, bwd_dtype, m, need_db1, pow2, (True, True)
    )
    # fc1: dX [M, D] = dz @ W1; dW1 [F, D] = dz^T @ X
    dinp, dnorm = _dgrad_through_norm(
        need_dgrad, lambda: _block_scaled_mm(dq, ds, 1, w1_t, w1s_t, 128, dtype), m, grad_out, norm
    )
    dw1 = _block_scaled_mm(dq_t, ds_t, 1, x_t, xs_t.t(), 1, dtype)
    return dinp, dw1, dy.new_empty(0) if db1 is None else db1, dw2, db2, *dnorm


@mlp_fp8_bwd.register_fake
def _mlp_fp8_bwd_fake(
    grad_out, saved, fc1_bias, scale1, scale2, ga1, ga2, activation, recipe, fwd_dtype,
    bwd_dtype, power_2_scale, has_fc2_bias, need_dgrad, norm_inp=None, norm_weight=None,
    normalization="", zero_centered_gamma=False, has_norm_bias=False,
):  # fmt: skip
    w1_t, w2_t = saved[2], saved[7]
    d, f1, f, n = w1_t.shape[0], w1_t.shape[1], w2_t.shape[0], w2_t.shape[1]
    empty = grad_out.new_empty(0)
    dinp = grad_out.new_empty(*grad_out.shape[:-1], d) if need_dgrad else empty
    db1 = grad_out.new_empty(f1) if fc1_bias is not None else grad_out.new_empty(0)
    db2 = grad_out.new_empty(n) if has_fc2_bias else grad_out.new_empty(0)
    dnorm = _fake_dnorm(grad_out, norm_weight, normalization, has_norm_bias, need_dgrad)
    return dinp, grad_out.new_empty(f1, d), db1, grad_out.new_empty(n, f), db2, *dnorm


# setup_context + autograd --------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, _w1, b1, _w2, b2, scale1, scale2, ga1, ga2, *config = inputs
    _out, saved, amax = output
    ctx.mark_non_differentiable(amax, *saved)
    normed = _save_norm(ctx, inp, config[5:])
    ctx.save_for_backward(b1, scale1, scale2, ga1, ga2, *normed, *saved)
    ctx.config = (*config[:5], False)[:5]  # power_2_scale defaults to False
    ctx.has_fc2_bias = b2 is not None


def _backward(ctx, bwd, grad_out, _grad_saved, _grad_amax):
    b1, scale1, scale2, ga1, ga2, norm_inp, norm_weight, *saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    normalization, zcg, has_norm_bias = ctx.norm
    need_dgrad = need[0] or _norm_needs_dgrad(ctx, 14)
    dinp, dw1, db1, dw2, db2, dnw, dnb = bwd(
        grad_out.contiguous(), saved, b1, scale1, scale2, ga1, ga2, *ctx.config,
        ctx.has_fc2_bias, need_dgrad, norm_inp, norm_weight, normalization, zcg, has_norm_bias,
    )  # fmt: skip
    grads = [
        dinp if need[0] else None,
        dw1 if need[1] else None,
        db1 if b1 is not None and need[2] else None,
        dw2 if need[3] else None,
        db2 if ctx.has_fc2_bias and need[4] else None,
        *(None,) * 9,
    ]
    return _with_norm_grads(ctx, grads, dnw, dnb)


def _samples(device: torch.device):
    # float32: a bf16 sample's intermediate roundings (z, h, dh) would move some FP8 codes of
    # the float64 reference by one step; the bf16 path is checked bit for bit against the
    # unfused ops in tests/functional/test_mlp_fp8.py.
    def t(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=torch.float32, requires_grad=grad)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    pending = [torch.zeros(1, device=device), torch.zeros(1, device=device)]
    yield SampleInput(
        (t(32, 16), t(64, 16), t(64), t(32, 64), t(32), None, None, *pending, "gelu", "current",
         e4m3, e5m2)
    )  # fmt: skip
    # 10 tokens (padded to 16 inside the ops), no biases, relu, E4M3 gradients.
    yield SampleInput(
        (t(2, 5, 32), t(32, 32), None, t(16, 32), None, None, None, None, None, "relu",
         "current", e4m3, e4m3)
    )  # fmt: skip
    # Float8BlockScaling's native GEMMs (feature sizes multiples of 512), power-of-two scales.
    yield SampleInput(
        (t(24, 512), t(512, 512), t(512), t(512, 512), t(512), None, None, None, None, "gelu",
         "block", e4m3, e4m3, True)
    )  # fmt: skip
    s1 = torch.tensor([64.0, 128.0, 2.0], device=device)
    s2 = torch.tensor([32.0, 64.0, 1.0], device=device)
    yield SampleInput(
        (t(2, 16, 16), t(48, 16), t(48), t(16, 48), None, s1, s2, *pending, "silu", "delayed",
         e4m3, e5m2)
    )  # fmt: skip
    # Norm prologues (LayerNormMLP), norms exact in fp32 (``unit_rows``): LayerNorm, 10 tokens,
    # current scaling; RMSNorm under the native blockwise recipe.
    yield SampleInput(
        (unit_rows(2, 5, 32, device=device), t(64, 32), t(64), t(32, 64), t(32), None, None,
         *pending, "gelu", "current", e4m3, e5m2, False, t(32),
         torch.zeros(32, device=device, requires_grad=True), "LayerNorm", 1e-30, False)
    )  # fmt: skip
    yield SampleInput(
        (unit_rows(24, 512, device=device), t(512, 512), None, t(512, 512), None, None, None,
         None, None, "relu", "block", e4m3, e4m3, False, t(512), None, "RMSNorm", 1e-30, False)
    )  # fmt: skip
    # Gated: fc1_weight [2 * ffn, hidden]; SwiGLU under current scaling, clamped SwiGLU under
    # delayed scaling (z = x W^T over 16 features, std 4: entries past its limit of 7), GEGLU
    # in 1x128 blocks.
    yield SampleInput(
        (t(2, 5, 32), t(64, 32), t(64), t(16, 32), t(16), None, None, *pending, "swiglu",
         "current", e4m3, e5m2)
    )  # fmt: skip
    yield SampleInput(
        (t(32, 16), t(96, 16), t(96), t(32, 48), None, s1, s2, *pending, "clamped_swiglu",
         "delayed", e4m3, e5m2)
    )  # fmt: skip
    yield SampleInput(
        (t(24, 512), t(1024, 512), t(1024), t(512, 512), t(512), None, None, None, None, "geglu",
         "block", e4m3, e4m3)
    )  # fmt: skip


def _reference(
    inp, w1, b1, w2, b2, scale1, scale2, ga1, ga2, activation, recipe, fwd, bwd, pow2=False,
    *norm,
):  # fmt: skip
    inp = norm_ref(inp, norm)
    if recipe == "block":  # linear_block_scaled's reference twice around the activation's
        z = _block_reference(inp, w1, None, "block", fwd, bwd, pow2, 128, True)
        h = _activation_ref(z, b1, activation)
        return _block_reference(h, w2, b2, "block", fwd, bwd, pow2, 128, True)
    s1, s2 = (scale1, scale2) if recipe == "delayed" else (None, None)
    return mlp_fp8_ref(inp, w1, b1, w2, b2, activation, fwd, bwd, s1, s2)


_mlp_fp8 = differentiable(
    mlp_fp8_fwd,
    mlp_fp8_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=_reference,
)


def mlp_fp8(
    inp: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    activation: str = "gelu",
    *,
    recipe: str = "current",
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e5m2,
    scale1: Tensor | None = None,
    scale2: Tensor | None = None,
    grad_amax1: Tensor | None = None,
    grad_amax2: Tensor | None = None,
    power_2_scale: bool = False,
    return_amax: bool = False,
    normalization: str = "",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``activation(inp @ fc1_weight.T + fc1_bias) @ fc2_weight.T + fc2_bias`` with FP8 GEMMs and
    the activation fused into the quantisations (module docstring). ``return_amax=True`` also
    returns ``[amax(inp), amax(fc1_weight), amax(h), amax(fc2_weight)]``. ``normalization``
    ("LayerNorm" or "RMSNorm", with ``norm_weight`` and for LayerNorm optionally
    ``norm_bias``): ``inp`` is normalised first, the norm written straight into FP8 (as
    ``linear_fp8``'s); the first amax is then the norm's."""
    norm = ()
    if normalization or norm_weight is not None or norm_bias is not None:
        norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    out, _saved, amax = _mlp_fp8(
        inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, scale1, scale2, grad_amax1, grad_amax2,
        activation, recipe, fwd_dtype, bwd_dtype, power_2_scale, *norm,
    )  # fmt: skip
    return (out, amax) if return_amax else out
