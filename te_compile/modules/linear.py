"""``te_compile.Linear``: Transformer Engine's ``Linear`` argument names on ``te::linear_fwd``.

Differences from ``nn.Linear`` that come from Transformer Engine: the weight is initialised by
``init_method`` (default: normal with std 0.023, TE's default), the bias with zeros;
``return_bias=True`` returns the bias instead of adding it, so a following op can fuse the add;
``fuse_wgrad_accumulation=True`` accumulates the weight gradient into ``weight.main_grad`` (fp32,
allocated by the caller, e.g. a Megatron-style distributed optimizer) instead of ``weight.grad``.
Unlike Transformer Engine, ``device=None`` means torch's current default device, not "cuda".

Inside ``te_compile.autocast(recipe=...)`` the GEMMs run in FP8 (``te::linear_fp8_fwd``) with
the recipe's scaling; the delayed-scaling state lives in the ``fp8_meta`` child module's buffers
(see ``te_compile/quantization/fp8_gemm.py``), so it is part of the state_dict.
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
from te_compile.quantization import fp8_gemm as _fp8

__all__ = ["Linear"]


class Linear(nn.Module):
    r"""Applies :math:`y = x W^\top + b` over the last dimension of ``inp``.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias.
        params_dtype: dtype of the parameters (default: ``torch.get_default_dtype()``).
        device: device of the parameters (default: torch's current default device).
        return_bias: return ``(out, bias)`` without adding the bias.
        init_method: called as ``init_method(weight)`` to initialise the weight.
        fuse_wgrad_accumulation: accumulate the weight gradient into ``weight.main_grad``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        init_method: Callable[[Tensor], None] | None = None,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        super().__init__()
        check_positive("Linear", in_features=in_features, out_features=out_features)
        dtype = params_dtype_or_default("Linear", params_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.init_method = init_method if init_method is not None else default_init_method
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.fp8_meta = _fp8.FP8GemmState(device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.init_method(self.weight)
        if self.bias is not None:
            self.bias.zero_()

    def _main_grad(self) -> Tensor:
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is None:
            raise RuntimeError(
                "Linear(fuse_wgrad_accumulation=True) needs weight.main_grad: a float32 tensor of "
                "the weight's shape, e.g. "
                "`m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)`"
            )
        return main_grad

    def forward(self, inp: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        main_grad = self._main_grad() if self.fuse_wgrad_accumulation else None
        bias = None if self.return_bias else self.bias
        out = _fp8.linear("Linear", self.fp8_meta, inp, self.weight, bias, main_grad)
        return (out, self.bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, params_dtype={self.weight.dtype}"
            + (", return_bias=True" if self.return_bias else "")
            + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else "")
        )
