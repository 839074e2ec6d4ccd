"""``te_compile.LayerNormLinear``: a norm followed by a Linear, with Transformer Engine's names.

Parameters: ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm), ``weight``
``[out_features, in_features]``, ``bias``. ``forward`` returns ``out``, then ``bias`` if
``return_bias`` (not added, so the caller can fuse the add), then the norm's output if
``return_layernorm_output`` — the order Transformer Engine uses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from te_compile.modules._common import (
    check_positive,
    default_init_method,
    params_dtype_or_default,
)
from te_compile.modules.norm import PreNorm
from te_compile.quantization import fp8_gemm as _fp8

__all__ = ["LayerNormLinear"]


class LayerNormLinear(PreNorm):
    r""":math:`y = \mathrm{norm}(x) W^\top + b`, the norm over ``in_features``.

    Args:
        in_features, out_features: sizes of the input and output features.
        eps: the norm's epsilon.
        bias: learn the Linear's additive bias.
        normalization: "LayerNorm" or "RMSNorm".
        zero_centered_gamma: store the norm's scale as gamma - 1.
        return_layernorm_output: also return the norm's output.
        return_bias: return the bias instead of adding it.
        params_dtype, device: of the parameters (defaults: torch's defaults).
        init_method: called as ``init_method(weight)`` (default: normal, std 0.023).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        owner = "LayerNormLinear"
        check_positive(owner, in_features=in_features, out_features=out_features)
        dtype = params_dtype_or_default(owner, params_dtype)
        self.in_features, self.out_features = in_features, out_features
        self.return_layernorm_output = return_layernorm_output
        self.return_bias = return_bias
        self.init_method = init_method if init_method is not None else default_init_method
        factory = {"dtype": dtype, "device": device}
        self._init_norm(owner, in_features, eps, normalization, zero_centered_gamma, factory)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.fp8_meta = _fp8.FP8GemmState(device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self._reset_norm()
        self.init_method(self.weight)
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, inp: Tensor) -> Tensor | tuple[Tensor, ...]:
        ln_out = self._norm(inp)
        bias = None if self.return_bias else self.bias
        out = _fp8.linear("LayerNormLinear", self.fp8_meta, ln_out, self.weight, bias)
        extra: tuple[Tensor | None, ...] = ()
        if self.return_bias:
            extra += (self.bias,)
        if self.return_layernorm_output:
            extra += (ln_out,)
        return (out, *extra) if extra else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, normalization={self.normalization}, eps={self.eps}"
        )
