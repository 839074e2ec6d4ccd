r"""The normalisation prologue of the GEMM op families (LayerNormLinear, LayerNormMLP): a
LayerNorm or RMSNorm of the op's input, in front of its first GEMM.

A family op takes the prologue as ``norm`` (a ``functional.spec.NormSpec`` string, ``""``: none),
``norm_weight`` and ``norm_bias``; :class:`Norm` holds them parsed. Per-tensor recipes and native
Float8BlockScaling write the norm straight into FP8 on CUDA (``kernels.act_quantize``: the norm is
never written in high precision); everywhere else the norm op's implementation runs and its output,
rows padded, is quantised: the same values (the kernel rounds the norm to the input's dtype first).
The forward saves the norm's ``mean, rsigma`` (``mean`` 0-element for RMSNorm) at the end of its
saved list; the backward runs the norm's backward on the GEMM's input gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile.functional.gemm import (
    HIGH_DTYPES,
    Operand,
    empty,
    pad_rows,
    padded,
    quantize_operand,
)
from te_compile.functional.norm import (
    layernorm_bwd,
    layernorm_fwd,
    layernorm_ref,
    rmsnorm_bwd,
    rmsnorm_fwd,
    rmsnorm_ref,
)
from te_compile.functional.spec import NormSpec, QuantSpec

__all__ = [
    "NORMALIZATIONS",
    "Norm",
    "check_norm",
    "fake_dnorm",
    "fake_stats",
    "norm_backward",
    "norm_forward",
    "norm_quantize",
    "norm_ref",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class Norm(NamedTuple):
    """A norm prologue: the op's arguments from ``norm_weight`` to ``zero_centered_gamma``."""

    weight: Tensor | None = None
    bias: Tensor | None = None
    normalization: str = ""
    eps: float = 1e-5
    zero_centered_gamma: bool = False


def check_norm(p: str, inp: Tensor, norm: Norm) -> None:
    """The prologue's arguments (``p`` begins the messages)."""
    weight, bias, normalization, eps, _ = norm
    if inp.ndim < 1:
        raise ValueError(p + "inp must have at least 1 dimension [..., hidden], got a 0-dim tensor")
    if normalization == "":
        if weight is not None or bias is not None:
            raise ValueError(p + 'norm_weight/norm_bias given with normalization="" (no norm)')
        return
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            p + f'normalization must be "", "LayerNorm" or "RMSNorm", got {normalization!r}'
        )
    k = inp.shape[-1]
    if weight is None or weight.shape != (k,) or weight.dtype not in HIGH_DTYPES:
        raise ValueError(
            p + f"{normalization} needs norm_weight [{k}] (inp's last dim) of a float "
            f"dtype, got {None if weight is None else (list(weight.shape), weight.dtype)}"
        )
    if bias is not None and (normalization != "LayerNorm" or bias.shape != (k,)):
        raise ValueError(p + f"norm_bias must be None for RMSNorm and [{k}] for LayerNorm")
    if not 0 < eps < math.inf:
        raise ValueError(p + f"norm_eps must be > 0 and finite, got {eps}")


def norm_forward(x2: Tensor, norm: Norm) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rsigma)`` by ``te::layernorm_fwd`` / ``te::rmsnorm_fwd``'s implementation."""
    weight, bias, normalization, eps, zcg = norm
    if normalization == "LayerNorm":
        return layernorm_fwd.eager(x2, weight, bias, eps, zcg)
    out, rsigma = rmsnorm_fwd.eager(x2, weight, eps, zcg)
    return out, rsigma.new_empty(0), rsigma


def norm_quantize(
    spec: QuantSpec,
    x2: Tensor,
    norm: Norm,
    *,
    scale: Tensor | None = None,
    mn_major: bool = False,
    slot: tuple[Tensor, int] | None = None,
) -> tuple[Operand, Tensor, Tensor]:
    """``(operand, mean, rsigma)``: the norm of ``x2`` ``[M, K]``, rows padded to a multiple of
    16, as the first GEMM's input operand quantised as ``spec`` says (``gemm.quantize_operand``'s
    arguments, ``slot`` included). On CUDA the per-tensor kinds and native 1x128 blocks quantise
    the norm without writing it (``kernels.act_quantize.norm_quantize(_block)``, which take the
    :class:`Norm` fields in order; ``mn_major``: the block scales in the GEMM's layout);
    elsewhere the norm op's output is quantised."""
    m_out, fp8_dtype = padded(x2.shape[0]), spec.fp8_dtype
    if x2.device.type == "cuda" and spec.kind in ("current", "delayed"):
        from te_compile.kernels.act_quantize import norm_quantize as kernel

        bits, i = slot if slot is not None else (None, 0)
        data, data_t, scale_inv, amax, mean, rsigma = kernel(
            x2.contiguous(), *norm, fp8_dtype, scale, m_out, amax=bits, slot=i
        )
        return Operand(data, scale_inv, data_t, scale_inv, amax), mean, rsigma
    if x2.device.type == "cuda" and spec.kind == "block" and not spec.emulate:
        from te_compile.kernels.act_quantize import norm_quantize_block

        data, s, data_t, s_t, mean, rsigma = norm_quantize_block(
            x2.contiguous(), *norm, fp8_dtype, m_out, spec.power_2_scale, mn_major=(mn_major,) * 2
        )
        return Operand(data, s, data_t, s_t, x2.new_empty(0, dtype=torch.float32)), mean, rsigma
    y, mean, rsigma = norm_forward(x2, norm)
    return quantize_operand(spec, pad_rows(y), scale=scale, slot=slot), mean, rsigma


def norm_backward(
    dout: Tensor, inp: Tensor, weight: Tensor, stats: list[Tensor], norm: NormSpec
) -> list[Tensor]:
    """``[dx, dweight, dbias]`` of the norm of ``inp`` (its ``[M, K]`` view) from the gradient
    of its output ``dout`` (2-D; ``dbias`` 0-element without a bias); ``stats``: the forward's
    ``[mean, rsigma]``."""
    mean, rsigma = stats
    x2, zcg = inp.reshape(-1, inp.shape[-1]), norm.zero_centered_gamma
    if norm.normalization == "LayerNorm":
        return list(layernorm_bwd.eager(dout, x2, mean, rsigma, weight, zcg, norm.bias))
    dx, dw = rmsnorm_bwd.eager(dout, x2, rsigma, weight, zcg)
    return [dx, dw, empty(dw)]


def norm_ref(inp: Tensor, norm: Norm) -> Tensor:
    """The prologue's output by the norm references, differentiable (``inp`` without a norm)."""
    weight, bias, normalization, eps, zcg = norm
    if normalization == "LayerNorm":
        return layernorm_ref(inp, weight, bias, eps, zcg)[0]
    if normalization == "RMSNorm":
        return rmsnorm_ref(inp, weight, eps, zcg)[0]
    return inp


def fake_stats(inp: Tensor, rows: int, normalization: str) -> list[Tensor]:
    """The statistics a forward op with a norm prologue saves (none without one)."""
    if not normalization:
        return []
    mean = inp.new_empty(rows if normalization == "LayerNorm" else 0, dtype=torch.float32)
    return [mean, inp.new_empty(rows, dtype=torch.float32)]


def fake_dnorm(like: Tensor, norm_weight, normalization, has_norm_bias, need) -> list[Tensor]:
    if not (normalization and need):
        return [empty(like), empty(like)]
    dbias = norm_weight.new_empty(norm_weight.shape) if has_norm_bias else empty(norm_weight)
    return [norm_weight.new_empty(norm_weight.shape), dbias]
