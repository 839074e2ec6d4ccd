r"""Normalisation basic ops over the trailing ``normalized_shape`` dims, through the te norm ops
(``te::layernorm_fwd``, ``te::rmsnorm_fwd``, ``te::l2normalization_fwd``; the math is in
``te_compile.functional.norm``).

``normalized_shape`` is an int or a sequence of ints (the trailing dims, normalised together as
one row); ``weight`` (and LayerNorm's ``bias``) have that shape. ``zero_centered_gamma=True``
stores :math:`\gamma - 1` (initialised to zeros), as in Transformer Engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from te_compile import functional as F
from te_compile._checks import check_bool, check_positive_finite, default_device
from te_compile.ops.op import BasicOperation, OpOutput, check_input

__all__ = ["L2Normalization", "LayerNorm", "RMSNorm"]


def _shape(owner: str, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        shape = (normalized_shape,)
    elif isinstance(normalized_shape, Sequence) and not isinstance(normalized_shape, str):
        shape = tuple(normalized_shape)
    else:
        shape = ()
    if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in shape):
        raise ValueError(
            f"{owner}: normalized_shape must be a positive int or a non-empty sequence of "
            f"positive ints, got {normalized_shape!r}"
        )
    return shape


def _eps(owner: str, eps: float) -> float:
    check_positive_finite(owner, eps=eps)
    return float(eps)


def _rows(owner: str, x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``x`` with its trailing ``shape`` dims flattened into one (a view when possible)."""
    if tuple(x.shape[x.dim() - len(shape) :]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"{owner}: the input's trailing dims {list(x.shape)} must equal "
            f"normalized_shape {list(shape)}"
        )
    return x if len(shape) == 1 else x.reshape(*x.shape[: x.dim() - len(shape)], math.prod(shape))


class _Norm(BasicOperation):
    has_bias: bool

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        zero_centered_gamma: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.normalized_shape = _shape(name, normalized_shape)
        self.eps = _eps(name, eps)
        check_bool(name, zero_centered_gamma=zero_centered_gamma)
        self.zero_centered_gamma = zero_centered_gamma
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{name}: dtype must be a floating torch.dtype, got {dtype!r}")
        device = default_device(name, device)
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(self.normalized_shape, **kw))
        self.bias = (
            nn.Parameter(torch.empty(self.normalized_shape, **kw)) if self.has_bias else None
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        if self.bias is not None:
            self.bias.zero_()

    def extra_repr(self) -> str:
        return (
            f"{list(self.normalized_shape)}, eps={self.eps}, "
            f"zero_centered_gamma={self.zero_centered_gamma}"
        )


class LayerNorm(_Norm):
    r""":math:`y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \varepsilon}}\gamma + \beta`."""

    has_bias = True

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        check_input("LayerNorm", x, param=self.weight)
        rows = _rows("LayerNorm", x, self.normalized_shape)
        y = F.layernorm(
            rows, self.weight.reshape(-1), self.bias.reshape(-1), self.eps, self.zero_centered_gamma
        )
        return y.reshape(x.shape), ()


class RMSNorm(_Norm):
    r""":math:`y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \varepsilon}}\gamma`."""

    has_bias = False

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        check_input("RMSNorm", x, param=self.weight)
        rows = _rows("RMSNorm", x, self.normalized_shape)
        y = F.rmsnorm(rows, self.weight.reshape(-1), self.eps, self.zero_centered_gamma)
        return y.reshape(x.shape), ()


class L2Normalization(BasicOperation):
    r""":math:`y = x / \sqrt{\sum x^2 + \varepsilon}` over the last dim (no parameters)."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = _eps("L2Normalization", eps)

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return F.l2normalization(x, self.eps), ()

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
