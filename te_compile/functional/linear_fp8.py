r"""FP8 linear with per-tensor scaling: ``te::linear_fp8_fwd`` / ``te::linear_fp8_bwd``.

The same math as ``te::linear_fwd`` with the three GEMMs in FP8 through ``torch._scaled_mm``
(fp32 accumulation, output in the input's dtype):

.. math::
    Y = (s_x^{-1} X_8)(s_w^{-1} W_8)^\top + b,\quad
    dX = (s_g^{-1} dY_8)(s_w^{-1} W_8),\quad
    dW = (s_g^{-1} dY_8)^\top (s_x^{-1} X_8)

where :math:`T_8 = \mathrm{sat}(s_T\,T)` is the saturating cast to the forward format (E4M3) for
``X`` and ``W`` and to the backward format (E5M2 under ``HYBRID``) for ``dY``. ``_scaled_mm``
wants its first operand row-major and its second column-major, so the forward op also writes the
transposed FP8 copies the backward GEMMs need, ``X_8^T`` and ``W_8^T``, and saves only FP8
tensors and their inverse scales (half of a bf16 save for the input). FP8 data crosses op
boundaries as its bytes (``uint8`` views): generic tensor code (opcheck, AOTAutograd's checks)
handles uint8 everywhere, while most ops have no FP8 kernel on the CPU.

Why a separate op pair instead of trailing arguments on ``te::linear_fwd``: FP8 adds inputs
(the delayed scales, the pending-amax buffer) and an output (the measured amaxes) that the
high-precision path never has; one op per precision keeps both schemas minimal. The scaling
*state* stays outside: ``recipe="current"`` measures each tensor's amax and scales it now;
``recipe="delayed"`` multiplies by ``scale`` ``[3]`` (input, weight, gradient) computed by
``te::delayed_scaling_update`` from earlier amaxes, and reports the amaxes it measured: the
forward's (input, weight) as an output the module copies into its buffer, the backward's by
writing ``grad_amax`` ``[1]`` (a mutated argument, like ``main_grad``; a buffer of its own,
since a saved tensor must not be modified between the forward and the backward).

Shapes: ``_scaled_mm`` needs ``in_features``, ``out_features`` and the number of tokens to be
multiples of 16. Feature sizes that are not raise a ValueError; the token count is padded with
zero rows to the next multiple of 16 inside the ops (the saved ``X_8^T`` has the padded width),
which changes neither the amaxes nor the result.
Zero tensors get scale 1 (no NaN); an inf/NaN input gives an inf/NaN amax, which the
delayed-scaling update ignores (keeps the old scale) and the caller can check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._library import SampleInput, differentiable, op
from te_compile.functional.norm import (
    layernorm_bwd,
    layernorm_fwd,
    layernorm_ref,
    rmsnorm_bwd,
    rmsnorm_fwd,
    rmsnorm_ref,
)
from te_compile.functional.quantize import (
    quantize_current,
    quantize_current_ref,
    quantize_tensorwise,
    quantize_tensorwise_ref,
)

__all__ = ["FP8_RECIPES", "linear_fp8", "linear_fp8_ref", "quantize_per_tensor"]

FP8_RECIPES = ("current", "delayed")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HIGH = (torch.float32, torch.bfloat16, torch.float16)


def quantize_per_tensor(
    x: Tensor, fp8_dtype: torch.dtype, scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(data, scale_inv, amax)`` of a 2-D tensor, by the reference quantisers of
    ``te_compile.functional.quantize`` on its fp32 values (so the float64 references of the
    tests quantise exactly as the ops do). ``scale=None``: current scaling with Transformer
    Engine's edge rules (scale 1 for an amax of 0 or inf, so an inf saturates; the largest fp32
    when the division overflows); else the given 1-element scale (delayed scaling)."""
    xf = x.float()
    if scale is None:
        data, _, scale_inv, amax = quantize_current_ref(xf, fp8_dtype, False)
        return data, scale_inv, amax
    data, _, amax = quantize_tensorwise_ref(xf, scale, fp8_dtype, False)
    return data, scale.reciprocal(), amax


def delayed_on_cuda(*args: object) -> str | None:
    """``kept_whole`` of the FP8 GEMM ops: DelayedScaling on CUDA stays an opaque call. Traced
    through, the partitioner saved a slice of the recipe's scale state for the backward and
    Inductor reused that graph input as scratch memory for an inverse scale (writing into the
    state; cuBLAS refused the scale pointer 8 bytes into the buffer with
    CUBLAS_STATUS_NOT_SUPPORTED on the H100)."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    delayed = any(isinstance(a, str) and a == "delayed" for a in args)
    if delayed and first is not None and first.device.type == "cuda":
        return "DelayedScaling on CUDA: Inductor reuses a saved view of the scale state"
    return None


def _slots(scale: Tensor | None, recipe: str) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The delayed scales of a GEMM's input, weight and gradient as ``[1]`` tensors (``scale``
    ``[3]``), or three Nones under current scaling.

    Views: on CPU the traced code reads them; on CUDA the ops are kept whole under delayed
    scaling (:func:`delayed_on_cuda`)."""
    if recipe != "delayed":
        return None, None, None
    return scale[0:1], scale[1:2], scale[2:3]


def _quantize_both(
    x: Tensor, fp8_dtype: torch.dtype, scale: Tensor | None, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, data_t, scale_inv, amax)`` of a 2-D tensor; ``data_t`` (``[K, M]``, only with
    ``columnwise``, else 0-element) is the transposed copy a backward GEMM needs. Through the
    quantisation ops: on CUDA their Triton kernels write both copies in one pass, elsewhere
    the reference quantiser runs."""
    if scale is None:
        return quantize_current.eager(x, fp8_dtype, columnwise)
    data, data_t, amax = quantize_tensorwise.eager(x, scale, fp8_dtype, columnwise)
    return data, data_t, scale.reciprocal(), amax


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _norm_fwd(x, weight, bias, normalization, eps, zero_centered_gamma):
    """``(out, mean, rsigma)`` of ``te::layernorm_fwd`` / ``te::rmsnorm_fwd`` (``mean``
    0-element for RMSNorm)."""
    if normalization == "LayerNorm":
        return layernorm_fwd.eager(x, weight, bias, eps, zero_centered_gamma)
    out, rsigma = rmsnorm_fwd.eager(x, weight, eps, zero_centered_gamma)
    return out, rsigma.new_empty(0), rsigma


def _norm_quantize(
    x: Tensor, norm: tuple, fp8_dtype: torch.dtype, scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``_quantize_both`` (columnwise) of the norm of the 2-D ``x`` padded to a multiple of 16
    rows, and the norm's statistics: ``(data, data_t, scale_inv, amax, mean, rsigma)``.
    ``norm``: ``(weight, bias, normalization, eps, zero_centered_gamma)``. On CUDA the norm is
    never written (``kernels.act_quantize.norm_quantize``); elsewhere the norm op's output,
    padded, is quantised: the same values (the kernel rounds the norm to ``x``'s dtype)."""
    weight, bias, normalization, eps, zcg = norm
    if x.device.type == "cuda":
        from te_compile.kernels.act_quantize import norm_quantize

        return norm_quantize(
            x.contiguous(), weight, bias, normalization, eps, zcg, fp8_dtype, scale,
            _padded(x.shape[0]),
        )  # fmt: skip
    y, mean, rsigma = _norm_fwd(x, weight, bias, normalization, eps, zcg)
    data, data_t, scale_inv, amax = _quantize_both(_pad_rows(y), fp8_dtype, scale, True)
    return data, data_t, scale_inv, amax, mean, rsigma


def _norm_bwd(dout, x, weight, mean, rsigma, normalization, zero_centered_gamma, has_bias):
    """``(dx, dweight, dbias)`` of the norm (``dbias`` 0-element without a bias)."""
    if normalization == "LayerNorm":
        return layernorm_bwd.eager(dout, x, mean, rsigma, weight, zero_centered_gamma, has_bias)
    dx, dw = rmsnorm_bwd.eager(dout, x, rsigma, weight, zero_centered_gamma)
    return dx, dw, dw.new_empty(0)


def _check_norm(p: str, inp: Tensor, norm: tuple) -> None:
    """The norm prologue's arguments (``norm`` as in :func:`_norm_quantize`)."""
    weight, bias, normalization, eps, _ = norm
    if normalization == "":
        if weight is not None or bias is not None:
            raise ValueError(p + 'norm_weight/norm_bias given with normalization="" (no norm)')
        return
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            p + f'normalization must be "", "LayerNorm" or "RMSNorm", got {normalization!r}'
        )
    k = inp.shape[-1]
    if weight is None or weight.shape != (k,) or weight.dtype not in _HIGH:
        raise ValueError(
            p + f"{normalization} needs norm_weight [{k}] (the input's last dim) of a float "
            f"dtype, got {None if weight is None else (list(weight.shape), weight.dtype)}"
        )
    if bias is not None and (normalization != "LayerNorm" or bias.shape != (k,)):
        raise ValueError(p + f"norm_bias must be None for RMSNorm and [{k}] for LayerNorm")
    if not eps > 0:
        raise ValueError(p + f"norm_eps must be > 0, got {eps}")


def _fake_quant(x: Tensor, fp8_dtype: torch.dtype, scale: Tensor | None) -> Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype with a straight-through gradient."""
    q, s_inv, _ = quantize_per_tensor(x, fp8_dtype, scale)
    return x + ((q.float() * s_inv).to(x.dtype) - x).detach()


class _FakeQuantGrad(torch.autograd.Function):
    """Identity forward; the backward quantises the incoming gradient (current scaling, or
    the given scale), as the backward GEMMs of the FP8 op see it."""

    @staticmethod
    def forward(ctx, y, fp8_dtype, scale):
        ctx.fp8_dtype, ctx.scale = fp8_dtype, scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        g = grad.reshape(-1, grad.shape[-1])
        q, s_inv, _ = quantize_per_tensor(g, ctx.fp8_dtype, ctx.scale)
        return (q.float() * s_inv).to(grad.dtype).reshape(grad.shape), None, None


def linear_fp8_ref(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e5m2,
    scale: Tensor | None = None,
) -> Tensor:
    """Definition of correctness, differentiable: the GEMMs of the dequantised operands in the
    input's dtype (fp64 in the tests), the GEMM gradient quantised to ``bwd_dtype`` on its way
    back, the bias gradient not (it is a sum of the high-precision gradient)."""
    x = inp.reshape(-1, inp.shape[-1])
    x = _fake_quant(x, fwd_dtype, None if scale is None else scale[0:1])
    w = _fake_quant(weight, fwd_dtype, None if scale is None else scale[1:2])
    out = _FakeQuantGrad.apply(x @ w.t(), bwd_dtype, None if scale is None else scale[2:3])
    if bias is not None:
        out = out + bias
    return out.reshape(*inp.shape[:-1], weight.shape[0])


def _check(inp, weight, bias, scale, grad_amax, recipe, fwd_dtype, bwd_dtype, norm) -> None:
    _check_norm("te.linear_fp8: ", inp, norm)
    if (
        weight.ndim == 2
        and inp.ndim >= 1
        and inp.dtype in _HIGH
        and weight.dtype is inp.dtype
        and inp.shape[-1] == weight.shape[1]
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 16 == 0
        and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype is inp.dtype))
        and recipe in FP8_RECIPES
        and fwd_dtype in _FP8_DTYPES
        and bwd_dtype in _FP8_DTYPES
        and (recipe != "delayed" or (scale is not None and scale.shape == (3,)))
        and (grad_amax is None or grad_amax.shape == (1,))
    ):
        return
    p = "te.linear_fp8: "
    if recipe not in FP8_RECIPES:
        raise ValueError(p + f"recipe must be one of {FP8_RECIPES}, got {recipe!r}")
    if fwd_dtype not in _FP8_DTYPES or bwd_dtype not in _FP8_DTYPES:
        raise ValueError(p + f"fwd_dtype/bwd_dtype must be FP8 dtypes, got {fwd_dtype}/{bwd_dtype}")
    if weight.ndim != 2 or inp.ndim < 1 or inp.shape[-1] != weight.shape[1]:
        raise ValueError(
            p + f"inp [..., in_features] and weight [out_features, in_features] do not match: "
            f"{list(inp.shape)} and {list(weight.shape)}"
        )
    if inp.dtype not in _HIGH or weight.dtype != inp.dtype:
        raise ValueError(
            p + f"inp and weight must share a float32/bfloat16/float16 dtype, got {inp.dtype} "
            f"and {weight.dtype}"
        )
    if weight.shape[0] % 16 or weight.shape[1] % 16:
        raise ValueError(
            p + f"FP8 GEMMs need in_features ({weight.shape[1]}) and out_features "
            f"({weight.shape[0]}) to be multiples of 16"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != inp.dtype):
        raise ValueError(p + f"bias must be [{weight.shape[0]}] of dtype {inp.dtype}")
    raise ValueError(
        p + 'recipe="delayed" needs scale [3] (input, weight, grad); grad_amax must be [1]'
    )


def _fake_stats(inp: Tensor, rows: int, normalization: str) -> list[Tensor]:
    """The norm statistics a forward op with a norm prologue saves (none without one)."""
    if not normalization:
        return []
    f32 = torch.float32
    mean = inp.new_empty(rows if normalization == "LayerNorm" else 0, dtype=f32)
    return [mean, inp.new_empty(rows, dtype=f32)]


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _padded(rows):
    return (rows + 15) // 16 * 16


def _pad_rows(t2: Tensor) -> Tensor:
    """``[M, K]`` with zero rows appended up to a multiple of 16 (``_scaled_mm``'s constraint);
    zero rows change neither an amax nor any other row of a GEMM's result."""
    extra = _padded(t2.shape[0]) - t2.shape[0]
    return torch.nn.functional.pad(t2, (0, 0, 0, extra)) if extra else t2


# Forward op -----------------------------------------------------------------------------------


# A test and diagnostic override, not configuration (tests patch it): True runs every per-tensor
# FP8 GEMM as an fp32 GEMM of the exact FP8 values with the scales applied after (same
# quantisation, no FP8 tensor-core arithmetic), to separate the GEMM's arithmetic from the
# quantisation in a training run.
_EMULATE = False


def _scaled_mm(
    a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out_dtype, bias=None, fast_accum=False
) -> Tensor:
    """``(sa a) @ (sb b) + bias`` rounded to ``out_dtype`` (``a`` row-major, ``b``
    column-major, FP8; ``sa`` / ``sb`` one-element fp32 inverse scales). ``torch._scaled_mm``
    takes a bias only for a bf16/fp16 output; for fp32 (float32 parameters) the bias is added to
    the fp32 result, which is the same sum. ``fast_accum``: Hopper's FP8 tensor-core accumulation
    without the periodic promotion to fp32 (faster, less exact; see :func:`_gemm`)."""
    if _EMULATE:
        out = (a.float() @ b.float()) * (sa * sb)
        return (out if bias is None else out + bias.float()).to(out_dtype)
    kw = {"scale_a": sa, "scale_b": sb, "out_dtype": out_dtype, "use_fast_accum": fast_accum}
    if bias is not None and out_dtype is torch.float32:
        return torch._scaled_mm(a, b, **kw).add_(bias)
    return torch._scaled_mm(a, b, bias=bias, **kw)


def _gemm(a: Tensor, b_t: Tensor, sa: Tensor, sb: Tensor, out_dtype, bias=None) -> Tensor:
    """The forward GEMM, ``a @ b_t.t()`` (``b_t.t()`` is column-major), with fast accumulation:
    Transformer Engine's default for the forward GEMM (its gradient GEMMs, like ours, promote
    the partial sums to fp32: a gradient is a long sum of small terms)."""
    return _scaled_mm(a, b_t.t(), sa, sb, out_dtype, bias, fast_accum=True)


@op("linear_fp8_fwd", kept_whole=delayed_on_cuda)
def linear_fp8_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    scale: Tensor | None,
    grad_amax: Tensor | None,
    recipe: str,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    normalization: str = "",
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> tuple[Tensor, list[Tensor], Tensor]:
    """``(out, saved, amax)``: ``saved = [X_8^T, s_x^-1, W_8^T, s_w^-1]`` for the backward and
    ``amax = [amax(X), amax(W)]`` (fp32) for the delayed-scaling history. With a
    ``normalization``, ``X`` is the norm of ``inp`` (never written on CUDA) and ``saved`` ends
    with the norm's ``mean, rsigma``."""
    norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    _check(inp, weight, bias, scale, grad_amax, recipe, fwd_dtype, bwd_dtype, norm)
    s_x, s_w, _ = _slots(scale, recipe)
    x = inp.reshape(-1, inp.shape[-1])
    m = x.shape[0]
    stats = []
    if normalization:
        xq, xq_t, xs, xa, *stats = _norm_quantize(x, norm, fwd_dtype, s_x)
    else:
        xq, xq_t, xs, xa = _quantize_both(_pad_rows(x), fwd_dtype, s_x, True)
    wq, wq_t, ws, wa = _quantize_both(weight, fwd_dtype, s_w, True)
    out = _gemm(xq, wq, xs, ws, inp.dtype, bias)
    out = out[:m].clone() if out.shape[0] != m else out
    saved = [xq_t.view(torch.uint8), xs, wq_t.view(torch.uint8), ws, *stats]
    return out.reshape(*inp.shape[:-1], weight.shape[0]), saved, torch.cat([xa, wa])


@linear_fp8_fwd.register_fake
def _linear_fp8_fwd_fake(
    inp, weight, bias, main_grad, scale, grad_amax, recipe, fwd, bwd, norm_weight=None,
    norm_bias=None, normalization="", norm_eps=1e-5, zero_centered_gamma=False,
):  # fmt: skip
    norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    _check(inp, weight, bias, scale, grad_amax, recipe, fwd, bwd, norm)
    rows, k, n = inp.numel() // inp.shape[-1], weight.shape[1], weight.shape[0]
    m = _padded(rows)
    scalar = inp.new_empty(1, dtype=torch.float32)
    u8 = torch.uint8
    saved = [inp.new_empty(k, m, dtype=u8), scalar, inp.new_empty(k, n, dtype=u8)]
    saved.append(inp.new_empty(1, dtype=torch.float32))
    saved += _fake_stats(inp, rows, normalization)
    return inp.new_empty(*inp.shape[:-1], n), saved, inp.new_empty(2, dtype=torch.float32)


# Backward op ----------------------------------------------------------------------------------


@op("linear_fp8_bwd", mutates_args=("main_grad", "grad_amax"), kept_whole=delayed_on_cuda)
def linear_fp8_bwd(
    grad_out: Tensor,
    saved: list[Tensor],
    weight: Tensor,
    main_grad: Tensor | None,
    scale: Tensor | None,
    grad_amax: Tensor | None,
    recipe: str,
    fwd_dtype: torch.dtype,
    bwd_dtype: torch.dtype,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
    norm_inp: Tensor | None = None,
    norm_weight: Tensor | None = None,
    normalization: str = "",
    zero_centered_gamma: bool = False,
    has_norm_bias: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias, dnorm_weight, dnorm_bias)`` (0-element where not computed,
    dweight also when it went into ``main_grad``); writes ``amax(dY)`` into ``grad_amax`` when
    given. With a ``normalization``, ``norm_inp`` is the forward's input and ``dinp`` goes
    through the norm's backward (``need_dgrad``: any of the input and the norm's parameters
    needs a gradient)."""
    x_t, xs, w_t, ws, *stats = saved
    x_t, w_t = x_t.view(fwd_dtype), w_t.view(fwd_dtype)
    dtype = grad_out.dtype
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    m = dy.shape[0]
    gq, gq_t, gs, ga = _quantize_both(
        _pad_rows(dy), bwd_dtype, _slots(scale, recipe)[2], need_wgrad
    )
    if grad_amax is not None:
        grad_amax.copy_(ga)
    dinp = _empty(grad_out)
    if need_dgrad:
        # dX [M, K] = dY_8 [M, N] @ W_8 [N, K]; W_8 as column-major = (W_8^T [K, N]).t()
        dinp = _scaled_mm(gq, w_t.t(), gs, ws, dtype)
        dinp = dinp[:m].clone() if dinp.shape[0] != m else dinp
        dinp, *dnorm = _through_norm(dinp, norm_inp, norm_weight, stats, normalization,
                                     zero_centered_gamma, has_norm_bias)  # fmt: skip
        dinp = dinp.reshape(*grad_out.shape[:-1], w_t.shape[0])
    else:
        dnorm = [_empty(grad_out), _empty(grad_out)]
    dweight = _empty(grad_out)
    if need_wgrad:
        # dW [N, K] = dY_8^T [N, M] @ X_8 [M, K]; X_8 as column-major = (X_8^T [K, M]).t()
        out_dtype = torch.float32 if main_grad is not None else dtype
        dw = _scaled_mm(gq_t, x_t.t(), gs, xs, out_dtype)
        if main_grad is not None:
            main_grad.add_(dw)
        else:
            dweight = dw
    dbias = dy.sum(0, dtype=torch.float32).to(dtype) if has_bias else _empty(grad_out)
    return dinp, dweight, dbias, *dnorm


def _through_norm(dout, x, weight, stats, normalization, zcg, has_bias) -> list[Tensor]:
    """``[dx, dweight, dbias]`` of a norm prologue from the gradient of its output ``dout``
    (2-D), or ``[dout, empty, empty]`` without one."""
    if not normalization:
        return [dout, _empty(dout), _empty(dout)]
    x2 = x.reshape(-1, x.shape[-1])
    mean, rsigma = stats
    return list(_norm_bwd(dout, x2, weight, mean, rsigma, normalization, zcg, has_bias))


def _save_norm(ctx, inp: Tensor, norm_args) -> tuple[Tensor | None, Tensor | None]:
    """setup_context's share of a norm prologue. ``norm_args``: the op's inputs from
    ``norm_weight`` on (fewer where the defaults were not passed). Sets ``ctx.norm =
    (normalization, zero_centered_gamma, has_norm_bias)`` and returns the two tensors to save:
    ``(inp, norm_weight)``, or two Nones without a norm."""
    weight, bias, normalization, _eps, zcg = (*norm_args, None, None, "", 0.0, False)[:5]
    ctx.norm = (normalization, zcg, bias is not None)
    return (inp, weight) if normalization else (None, None)


def _norm_needs_dgrad(ctx, first: int) -> bool:
    """Whether a norm's parameters (the inputs at ``first`` and ``first + 1``) need a gradient:
    the GEMM's input gradient feeds theirs."""
    return bool(ctx.norm[0]) and any(ctx.needs_input_grad[first : first + 2])


def _with_norm_grads(ctx, grads: list, dnorm_weight: Tensor, dnorm_bias: Tensor) -> tuple:
    """``grads`` (one per input before ``norm_weight``) completed to one per input: the norm
    parameters' gradients where needed (``ctx.norm`` as :func:`_save_norm` set it), None
    after them."""
    need = ctx.needs_input_grad
    first = len(grads)
    if len(need) > first:
        has_bias = ctx.norm[2]
        grads = [
            *grads,
            dnorm_weight if need[first] else None,
            dnorm_bias if has_bias and need[first + 1] else None,
        ]
    return tuple(grads[: len(need)]) + (None,) * (len(need) - len(grads))


def _fake_dnorm(like: Tensor, norm_weight, normalization, has_norm_bias, need) -> list[Tensor]:
    if not (normalization and need):
        return [_empty(like), _empty(like)]
    dbias = norm_weight.new_empty(norm_weight.shape) if has_norm_bias else _empty(norm_weight)
    return [norm_weight.new_empty(norm_weight.shape), dbias]


@linear_fp8_bwd.register_fake
def _linear_fp8_bwd_fake(
    grad_out, saved, weight, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype,
    has_bias, need_dgrad, need_wgrad, norm_inp=None, norm_weight=None, normalization="",
    zero_centered_gamma=False, has_norm_bias=False,
):  # fmt: skip
    k = weight.shape[1]
    dinp = grad_out.new_empty(*grad_out.shape[:-1], k) if need_dgrad else _empty(grad_out)
    want_dw = need_wgrad and main_grad is None
    dweight = grad_out.new_empty(weight.shape) if want_dw else _empty(grad_out)
    dbias = grad_out.new_empty(weight.shape[0]) if has_bias else _empty(grad_out)
    dnorm = _fake_dnorm(grad_out, norm_weight, normalization, has_norm_bias, need_dgrad)
    return dinp, dweight, dbias, *dnorm


# setup_context + autograd --------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype, *norm = inputs
    _out, saved, amax = output
    ctx.mark_non_differentiable(amax, *saved)
    normed = _save_norm(ctx, inp, norm)
    ctx.save_for_backward(weight, main_grad, scale, grad_amax, *normed, *saved)
    ctx.recipe, ctx.has_bias = recipe, bias is not None
    ctx.fwd_dtype, ctx.bwd_dtype = fwd_dtype, bwd_dtype


def _backward(ctx, bwd, grad_out, _grad_saved, _grad_amax):
    weight, main_grad, scale, grad_amax, norm_inp, norm_weight, *saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_wgrad, need_bgrad = need[1:3]
    normalization, zcg, has_norm_bias = ctx.norm
    need_dgrad = need[0] or _norm_needs_dgrad(ctx, 9)
    dinp, dweight, dbias, dnorm_w, dnorm_b = bwd(
        grad_out.contiguous(),
        saved,
        weight,
        main_grad,
        scale,
        grad_amax,
        ctx.recipe,
        ctx.fwd_dtype,
        ctx.bwd_dtype,
        ctx.has_bias and need_bgrad,
        need_dgrad,
        need_wgrad,
        norm_inp,
        norm_weight,
        normalization,
        zcg,
        has_norm_bias,
    )
    grads = [
        dinp if need[0] else None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if ctx.has_bias and need_bgrad else None,
        *(None,) * 6,
    ]
    return _with_norm_grads(ctx, grads, dnorm_w, dnorm_b)


def _samples(device: torch.device):
    def t(*shape, dtype=torch.bfloat16, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    yield SampleInput((t(32, 16), t(16, 16), t(16), None, None, None, "current", e4m3, e5m2))
    # 10 tokens: padded to 16 inside the ops.
    yield SampleInput((t(2, 5, 16), t(32, 16), t(32), None, None, None, "current", e4m3, e5m2))
    scale = torch.tensor([8.0, 16.0, 1.0], device=device)
    pending = torch.zeros(1, device=device)
    yield SampleInput((t(2, 16, 32), t(48, 32), None, None, scale, pending, "delayed", e4m3, e5m2))
    yield SampleInput(
        (t(16, 32, dtype=torch.float32), t(16, 32, dtype=torch.float32), None,
         torch.zeros(16, 32, device=device), None, None, "current", e4m3, e4m3)
    )  # fmt: skip
    # float32 with a bias: _scaled_mm refuses a bias with an fp32 output (added after it).
    f32 = torch.float32
    yield SampleInput(
        (t(16, 32, dtype=f32), t(32, 32, dtype=f32), t(32, dtype=f32), None, None, None,
         "current", e4m3, e5m2)
    )  # fmt: skip
    # Norm prologues (LayerNormLinear): LayerNorm, 10 tokens, current scaling; RMSNorm,
    # delayed scaling. Inputs whose norm is exact in fp32 and float64 alike (``unit_rows``; the
    # FP8 codes of a computed value one fp32 rounding from a code boundary would differ).
    yield SampleInput(
        (unit_rows(2, 5, 32, device=device), t(16, 32, dtype=f32), t(16, dtype=f32), None,
         None, None, "current", e4m3, e5m2, t(32, dtype=f32),
         torch.zeros(32, device=device, requires_grad=True), "LayerNorm", 1e-30, False)
    )  # fmt: skip
    yield SampleInput(
        (unit_rows(16, 32, device=device), t(32, 32, dtype=f32), None, None, scale.clone(),
         pending.clone(), "delayed", e4m3, e5m2, t(32, dtype=f32), None, "RMSNorm", 1e-30, False)
    )  # fmt: skip


def unit_rows(*shape: int, device, dtype: torch.dtype = torch.float32) -> Tensor:
    """``±1`` with each row summing to 0 (requires grad): LayerNorm / RMSNorm of it with
    ``eps=1e-30`` is exactly ``x * gamma + beta`` (mean 0, variance 1 and ``rsigma`` 1 in fp32
    and float64), for registry samples of ops that quantise a norm's output."""
    half = torch.randint(0, 2, (*shape[:-1], shape[-1] // 2), device=device) * 2.0 - 1.0
    perm = torch.randperm(shape[-1], device=device)
    return torch.cat([half, -half], -1)[..., perm].to(dtype).contiguous().requires_grad_()


def norm_ref(inp: Tensor, norm: tuple) -> Tensor:
    """The output of a norm prologue (``norm`` as in :func:`_norm_quantize`; ``inp`` itself
    when ``normalization`` is ""), by the norm references, differentiable."""
    weight, bias, normalization, eps, zcg = (*norm, None, None, "", 1e-5, False)[:5]
    if normalization == "LayerNorm":
        return layernorm_ref(inp, weight, bias, eps, zcg)[0]
    if normalization == "RMSNorm":
        return rmsnorm_ref(inp, weight, eps, zcg)[0]
    return inp


def _reference(
    inp, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype, *norm
):  # fmt: skip
    delayed_scale = scale if recipe == "delayed" else None
    x = norm_ref(inp, norm)
    return linear_fp8_ref(x, weight, bias, fwd_dtype, bwd_dtype, delayed_scale)


_linear_fp8 = differentiable(
    linear_fp8_fwd,
    linear_fp8_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=_reference,
)


def linear_fp8(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    recipe: str = "current",
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e5m2,
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    main_grad: Tensor | None = None,
    return_amax: bool = False,
    normalization: str = "",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``inp @ weight.T + bias`` with FP8 GEMMs (module docstring). ``grad_amax`` (``[1]``
    fp32) receives the gradient's amax in the backward; ``return_amax=True`` also returns
    ``[amax(inp), amax(weight)]``. ``normalization`` ("LayerNorm" or "RMSNorm", with
    ``norm_weight`` and for LayerNorm optionally ``norm_bias``): ``norm(inp) @ weight.T + bias``,
    the norm written straight into FP8 (module docstring); the amax is the norm's."""
    norm = ()
    if normalization or norm_weight is not None or norm_bias is not None:
        norm = (norm_weight, norm_bias, normalization, norm_eps, zero_centered_gamma)
    out, _saved, amax = _linear_fp8(
        inp, weight, bias, main_grad, scale, grad_amax, recipe, fwd_dtype, bwd_dtype, *norm
    )
    return (out, amax) if return_amax else out
