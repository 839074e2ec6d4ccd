r"""Activation basic ops, through ``te::activation_fwd`` / ``te::gated_activation_fwd``.

Element-wise: ``GELU`` (tanh approximation), ``QGELU`` (:math:`x\sigma(1.702x)`), ``ReLU``,
``SReLU`` (:math:`\max(x, 0)^2`), ``SiLU``. Gated, over the halves :math:`a, l` of the last dim
(which halves halve the last dim): ``GLU`` (:math:`\sigma(a)\,l`), ``GEGLU``, ``QGEGLU``,
``ReGLU``, ``SReGLU``, ``SwiGLU``, ``ClampedSwiGLU`` (GPT-OSS), ``SiTUGLU`` (soft-capped SiLU
GLU of Kimi K3: :math:`\beta_1\tanh(a/\beta_1)\,\sigma(a)\,\beta_2\tanh(l/\beta_2)`).
``glu_interleave_size=k``
reads the halves from alternating blocks of ``k`` columns (the layout of an interleaved FC1;
``te_compile.functional.activation`` has the details).

After a ``Bias`` (or ``BasicLinear, Bias``) the fuser gives the bias to the activation kernel,
whose backward returns the bias gradient from the same pass.

``cache_quantized_input=True`` (every activation, Transformer Engine's meaning): the forward
output is the exact activation, but the input is saved for the backward as FP8 (E4M3, one
current-scaling scale for the tensor, ``te::quantize_current``): one byte per element instead of
two or four; the backward dequantises it (``te::dequantize_tensorwise``) and differentiates at
the dequantised input, so the input gradient carries the FP8 rounding of the input, as in TE
(whose quantiser is also E4M3 current scaling, whatever the autocast). Such an activation is not
fused with a preceding ``Bias`` or ``BasicLinear`` (the fused ops save the high-precision input).

Post-scaled gated activations (Transformer Engine's mixture-of-experts ops, one extra input
``scales`` of the input's shape without its last dim, e.g. the router's per-token weights):
``ScaledSwiGLU`` (:math:`\mathrm{silu}(a)\,l\,s`) and ``ScaledClampedQGeGLU`` (the
``ClampedSwiGLU`` math times :math:`s`), ``ScaledSiTUGLU`` (the ``SiTUGLU`` math times
:math:`s`), and one element-wise, ``ScaledSReLU`` (:math:`\max(x, 0)^2\,s`). The
activation is the te op, the product with ``scales`` a broadcast multiply that autograd
differentiates (``scales`` gets :math:`\sum_j \mathrm{act}_j\,dy_j`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from te_compile import functional as F
from te_compile._checks import check_bool, check_finite, check_positive_finite
from te_compile.functional.activation import check_activation
from te_compile.ops.op import BasicOperation, OpOutput, check_extra_input

__all__ = [
    "GEGLU",
    "GELU",
    "GLU",
    "QGEGLU",
    "QGELU",
    "ClampedSwiGLU",
    "ReGLU",
    "ReLU",
    "SReGLU",
    "SReLU",
    "ScaledClampedQGeGLU",
    "ScaledSReLU",
    "ScaledSiTUGLU",
    "ScaledSwiGLU",
    "SiLU",
    "SiTUGLU",
    "SwiGLU",
]


_CACHE_FP8 = torch.float8_e4m3fn  # TE's cache quantiser: E4M3, current scaling


class _CachedQuantizedInput(torch.autograd.Function):
    """The activation of ``x``, with ``x`` saved for the backward as FP8 data and a scale."""

    @staticmethod
    def forward(ctx, x: Tensor, activation: str, gated: bool, config: tuple) -> Tensor:
        te = torch.ops.te
        if gated:
            y = te.gated_activation_fwd(x, None, activation, *config)
        else:
            y = te.activation_fwd(x, None, activation)
        data, _, scale_inv, _ = te.quantize_current(x, _CACHE_FP8, False)
        ctx.save_for_backward(data, scale_inv)
        ctx.activation, ctx.gated, ctx.config, ctx.dtype = activation, gated, config, x.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: Tensor):
        te = torch.ops.te
        data, scale_inv = ctx.saved_tensors
        x = te.dequantize_tensorwise(data.view(torch.uint8), scale_inv, _CACHE_FP8, ctx.dtype)
        if ctx.gated:
            dx, _ = te.gated_activation_bwd(dy, x, None, ctx.activation, *ctx.config, False)
        else:
            dx, _ = te.activation_bwd(dy, x, None, ctx.activation, False)
        return dx, None, None, None


def _check_interleave(owner: str, glu_interleave_size: Any) -> None:
    k = glu_interleave_size
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k <= 0):
        raise ValueError(f"{owner}: glu_interleave_size must be a positive int or None, got {k!r}")


class _Param:
    """An activation parameter, kept in its op's ``_config`` tuple (what ``config()`` returns):
    ``torch.compile`` takes a tuple of Python numbers for a constant, where a float attribute
    read through the fuser becomes a symbolic float once its value differs between compiles
    (or under ``dynamic=True``), which the fused GEMM's epilogue spec string cannot hold.
    Setting one checks it, as the constructor does."""

    def __init__(self, index: int, check: Callable[..., None]) -> None:
        self.index, self.check = index, check

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, op: Any, owner: type | None = None) -> Any:
        if op is None:
            return self
        value = op._config[self.index]
        return (value or None) if self.index == 0 else value

    def __set__(self, op: Any, value: Any) -> None:
        self.check(type(op).__name__, **{self.name: value})
        config = list(op._config)
        config[self.index] = (value or 0) if self.index == 0 else float(value)
        op._config = tuple(config)


class ActivationOperation(BasicOperation):
    """Base of the activation ops: ``activation`` names the te activation."""

    activation: ClassVar[str]
    gated: ClassVar[bool] = False
    # (glu_interleave_size or 0, limit, alpha, glu_linear_offset): see _Param.
    _config: tuple[int, float, float, float] = (0, 7.0, 1.702, 1.0)

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        check_bool(type(self).__name__, cache_quantized_input=cache_quantized_input)
        self.cache_quantized_input = cache_quantized_input

    def config(self) -> tuple[int, float, float, float]:
        """``(glu_interleave_size, limit, alpha, glu_linear_offset)`` of the te op."""
        return self._config

    def apply(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """This activation of ``x + bias`` in one fused op."""
        k, limit, alpha, offset = self.config()
        if self.cache_quantized_input and bias is None:
            check_activation(x, None, self.activation, k)
            config = (k, limit, alpha, offset)
            return _CachedQuantizedInput.apply(x, self.activation, self.gated, config)
        return F.bias_activation(
            x, bias, self.activation, k, limit=limit, alpha=alpha, glu_linear_offset=offset
        )

    def extra_repr(self) -> str:
        return "cache_quantized_input=True" if self.cache_quantized_input else ""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return self.apply(x, None), ()


class _GatedActivation(ActivationOperation):
    gated = True
    glu_interleave_size = _Param(0, _check_interleave)

    def __init__(
        self, *, cache_quantized_input: bool = False, glu_interleave_size: int | None = None
    ) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        self.glu_interleave_size = glu_interleave_size

    def extra_repr(self) -> str:
        k = self.glu_interleave_size
        own = [super().extra_repr()] + ([] if k is None else [f"glu_interleave_size={k}"])
        return ", ".join(p for p in own if p)


class GELU(ActivationOperation):
    r""":math:`\tfrac12 x(1 + \tanh(\sqrt{2/\pi}(x + 0.044715x^3)))`."""

    activation = "gelu"


class QGELU(ActivationOperation):
    r""":math:`x\,\sigma(1.702x)`."""

    activation = "qgelu"


class ReLU(ActivationOperation):
    r""":math:`\max(x, 0)`."""

    activation = "relu"


class SReLU(ActivationOperation):
    r""":math:`\max(x, 0)^2`."""

    activation = "srelu"


class SiLU(ActivationOperation):
    r""":math:`x\,\sigma(x)`."""

    activation = "silu"


class GLU(_GatedActivation):
    r""":math:`\sigma(a)\,l`."""

    activation = "glu"


class GEGLU(_GatedActivation):
    r""":math:`\mathrm{gelu}(a)\,l`."""

    activation = "geglu"


class QGEGLU(_GatedActivation):
    r""":math:`\mathrm{qgelu}(a)\,l`."""

    activation = "qgeglu"


class ReGLU(_GatedActivation):
    r""":math:`\max(a, 0)\,l`."""

    activation = "reglu"


class SReGLU(_GatedActivation):
    r""":math:`\max(a, 0)^2\,l`."""

    activation = "sreglu"


class SwiGLU(_GatedActivation):
    r""":math:`\mathrm{silu}(a)\,l`."""

    activation = "swiglu"


class _Clamped:
    """The clamped SwiGLU's parameters, in the op's ``limit``, ``alpha`` and
    ``glu_linear_offset`` slots."""

    limit = _Param(1, check_positive_finite)
    alpha = _Param(2, check_positive_finite)
    glu_linear_offset = _Param(3, check_finite)


class ClampedSwiGLU(_Clamped, _GatedActivation):
    r"""GPT-OSS SwiGLU: :math:`c\,\sigma(\alpha c)\,(\mathrm{clamp}(l, -L, L) + o)` with
    :math:`c = \min(a, L)`, ``limit`` :math:`L`, ``alpha`` :math:`\alpha`,
    ``glu_linear_offset`` :math:`o`."""

    activation = "clamped_swiglu"

    def __init__(
        self,
        *,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        cache_quantized_input: bool = False,
        glu_interleave_size: int | None = None,
    ) -> None:
        super().__init__(
            cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size
        )
        self.limit, self.alpha, self.glu_linear_offset = limit, alpha, glu_linear_offset

    def extra_repr(self) -> str:
        base = super().extra_repr()
        own = f"limit={self.limit}, alpha={self.alpha}, glu_linear_offset={self.glu_linear_offset}"
        return f"{own}, {base}" if base else own


class _SiTU:
    """``situglu``'s parameters: ``beta1`` and ``beta2`` travel in the op's ``limit`` and
    ``alpha`` slots, its ``glu_linear_offset`` slot is 0 (``functional.activation``)."""

    activation = "situglu"
    _config = (0, 4.0, 25.0, 0.0)
    beta1 = _Param(1, check_positive_finite)
    beta2 = _Param(2, check_positive_finite)

    def extra_repr(self) -> str:
        base = super().extra_repr()
        own = f"beta1={self.beta1}, beta2={self.beta2}"
        return f"{own}, {base}" if base else own


class SiTUGLU(_SiTU, _GatedActivation):
    r"""Soft-capped SiLU GLU (Kimi K3):
    :math:`\beta_1\tanh(a/\beta_1)\,\sigma(a)\;\beta_2\tanh(l/\beta_2)`, ``beta1``
    :math:`\beta_1` and ``beta2`` :math:`\beta_2` finite and > 0."""

    def __init__(
        self,
        *,
        beta1: float = 4.0,
        beta2: float = 25.0,
        cache_quantized_input: bool = False,
        glu_interleave_size: int | None = None,
    ) -> None:
        super().__init__(
            cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size
        )
        self.beta1, self.beta2 = beta1, beta2


class _PostScaled:
    """An activation times the extra input ``scales`` (``[...]``: the input's shape without its
    last dim), broadcast over the output's last dim."""

    num_extra_inputs = 1

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        (scales,) = extra_inputs
        check_extra_input(type(self).__name__, "scales", scales, x)
        if scales.shape != x.shape[:-1]:
            raise ValueError(
                f"{type(self).__name__}: scales (the extra input) must have the input's shape "
                f"without its last dim, {tuple(x.shape[:-1])}, got {tuple(scales.shape)}"
            )
        y = self.apply(x, None)
        return y * scales.unsqueeze(-1).to(y.dtype), ()


class _ScaledGLU(_PostScaled, _GatedActivation):
    """A gated activation times ``scales``; ``activation_recompute_in_mlp`` must be False (as
    in Transformer Engine, whose fused grouped MLP recomputes no scaled GLU)."""

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        activation_recompute_in_mlp: bool = False,
    ) -> None:
        super().__init__(glu_interleave_size=glu_interleave_size)
        check_bool(type(self).__name__, activation_recompute_in_mlp=activation_recompute_in_mlp)
        if activation_recompute_in_mlp:
            raise ValueError(
                f"{type(self).__name__}: activation_recompute_in_mlp=True: a scaled GLU does not "
                "support activation recomputation (Transformer Engine's fused grouped MLP has "
                "none for it); pass False"
            )
        self.activation_recompute_in_mlp = activation_recompute_in_mlp


class ScaledSReLU(_PostScaled, ActivationOperation):
    r""":math:`\max(x, 0)^2\,s` with ``scales`` :math:`s` the extra input.
    ``activation_recompute_in_mlp=True`` is Transformer Engine's request to its fused grouped
    MLP kernels (recompute the activation in the backward), which te_compile does not have:
    accepted and kept, the forward raises ``RuntimeError``, as TE's does outside that path."""

    activation = "srelu"

    def __init__(self, *, activation_recompute_in_mlp: bool = False) -> None:
        super().__init__()
        check_bool("ScaledSReLU", activation_recompute_in_mlp=activation_recompute_in_mlp)
        self.activation_recompute_in_mlp = activation_recompute_in_mlp

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        if self.activation_recompute_in_mlp:
            raise RuntimeError(
                "ScaledSReLU(activation_recompute_in_mlp=True) runs only inside Transformer "
                "Engine's fused grouped MLP kernels, which te_compile does not have"
            )
        return super().op_forward(x, extra_inputs)


class ScaledSwiGLU(_ScaledGLU):
    r""":math:`\mathrm{silu}(a)\,l\,s` with ``scales`` :math:`s` the extra input."""

    activation = "swiglu"


class ScaledClampedQGeGLU(_Clamped, _ScaledGLU):
    r"""``ClampedSwiGLU``'s :math:`c\,\sigma(\alpha c)\,(\mathrm{clamp}(l, -L, L) + o)` times
    the extra input ``scales``; ``limit``, ``alpha``, ``glu_linear_offset`` as there."""

    activation = "clamped_swiglu"

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        activation_recompute_in_mlp: bool = False,
        *,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
    ) -> None:
        super().__init__(glu_interleave_size, activation_recompute_in_mlp)
        self.limit, self.alpha, self.glu_linear_offset = limit, alpha, glu_linear_offset


class ScaledSiTUGLU(_SiTU, _ScaledGLU):
    r"""``SiTUGLU``'s :math:`\beta_1\tanh(a/\beta_1)\,\sigma(a)\,\beta_2\tanh(l/\beta_2)`
    times the extra input ``scales``; ``beta1``, ``beta2`` as there."""

    def __init__(
        self,
        glu_interleave_size: int | None = None,
        *,
        activation_recompute_in_mlp: bool = False,
        beta1: float = 4.0,
        beta2: float = 25.0,
    ) -> None:
        super().__init__(glu_interleave_size, activation_recompute_in_mlp)
        self.beta1, self.beta2 = beta1, beta2
