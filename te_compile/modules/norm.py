"""``te_compile.LayerNorm`` and ``te_compile.RMSNorm`` over the last dimension.

With ``zero_centered_gamma=True`` the weight is stored as :math:`\\gamma - 1` (initialised to
zeros) and the effective scale is ``weight + 1``, as in Transformer Engine: weight decay then
pulls the scale towards 1 instead of 0. ``device=None``: as in ``Linear`` ("cuda" where
present, unless torch's default device is set).

``sequence_parallel=True``: the norm runs on a rank's shard of the sequence, so its parameters'
gradients are partial sums over the tensor-parallel group. They are marked
(``param.sequence_parallel = True``, the attribute Megatron-style code all-reduces by, as
Transformer Engine marks them); with a ``tp_group`` the module all-reduces them itself, in the
backward (traced under ``torch.compile``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from te_compile import functional as F
from te_compile._checks import HIGH_DTYPES
from te_compile._library import use_fast_path
from te_compile.distributed import collectives as C
from te_compile.distributed.tensor_parallel import TensorParallel, set_parallel_attributes
from te_compile.modules._common import (
    check_bool,
    check_choice,
    check_eps,
    check_positive,
    default_device,
    params_dtype_or_default,
)
from te_compile.modules._te_signature import te_signature
from te_compile.quantization.gemm import quantized
from te_compile.quantization.te_extra_state import accept_te_extra_state

__all__ = ["NORMALIZATIONS", "LayerNorm", "PreNorm", "RMSNorm", "apply_normalization"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def apply_normalization(
    inp: Tensor,
    normalization: str,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
) -> Tensor:
    """The norm a module was configured with (``normalization`` already validated)."""
    if normalization == "RMSNorm":
        return F.rmsnorm(inp, weight, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return F.layernorm(inp, weight, bias, eps=eps, zero_centered_gamma=zero_centered_gamma)


def _normalized_size(owner: str, normalized_shape: object, hidden_size: object) -> int:
    """The last dimension's size from TE's ``normalized_shape`` or its older ``hidden_size``."""
    if hidden_size is not None:
        if normalized_shape is not None:
            raise ValueError(
                f"{owner}: pass normalized_shape or hidden_size (its older name), not both"
            )
        check_positive(owner, hidden_size=hidden_size)
        return hidden_size
    if normalized_shape is None:
        raise ValueError(f"{owner}: normalized_shape is required (the last dimension's size)")
    if isinstance(normalized_shape, (tuple, list, torch.Size)):
        if len(normalized_shape) != 1:
            raise ValueError(
                f"{owner}: normalized_shape must be an int or a one-element shape (the "
                f"normalisation is over the last dimension only), got {normalized_shape!r}"
            )
        (normalized_shape,) = normalized_shape
    check_positive(owner, normalized_shape=normalized_shape)
    return normalized_shape


class _Norm(nn.Module):
    normalization: str
    has_bias: bool

    @te_signature("LayerNorm")  # (RMSNorm's order is the same)
    def __init__(
        self,
        normalized_shape: int | Sequence[int] | None = None,
        eps: float = 1e-5,
        *,
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        hidden_size: int | None = None,
        sequence_parallel: bool = False,
        tp_group: object = None,
    ) -> None:
        """``normalized_shape``: the size of the last dimension, normalised over (an int or a
        one-element shape, as Transformer Engine takes it; ``hidden_size=`` is TE's older
        keyword for it). ``sequence_parallel`` / ``tp_group``: see the module docstring."""
        super().__init__()
        accept_te_extra_state(self)  # TE's norms (te.ops operations) save an empty one
        name = type(self).__name__
        hidden_size = _normalized_size(name, normalized_shape, hidden_size)
        check_eps(name, eps)
        check_bool(
            name, zero_centered_gamma=zero_centered_gamma, sequence_parallel=sequence_parallel
        )
        if tp_group is not None and not sequence_parallel:
            raise ValueError(
                f"{name}: tp_group is for sequence_parallel=True (a norm has no shards: the "
                "group only sums its parameters' gradients)"
            )
        self.sequence_parallel = sequence_parallel
        self.tp_group = C.resolve_group(tp_group, name)
        device = default_device(name, device)
        dtype = params_dtype_or_default(name, params_dtype, device)
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
            if self.has_bias
            else None
        )
        for p in (self.weight, self.bias):
            set_parallel_attributes(p, sequence_parallel=sequence_parallel)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, inp: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel and self.tp_group is not None:
            weight = C.all_reduce_grad(weight, self.tp_group)
            bias = None if bias is None else C.all_reduce_grad(bias, self.tp_group)
        return apply_normalization(
            inp, self.normalization, weight, bias, self.eps, self.zero_centered_gamma
        )

    def extra_repr(self) -> str:
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return (
            f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
            + sp
        )


class LayerNorm(_Norm):
    r""":math:`y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \varepsilon}} \gamma + \beta`
    over the last dimension (``normalized_shape``)."""

    normalization = "LayerNorm"
    has_bias = True


class RMSNorm(_Norm):
    r""":math:`y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \varepsilon}} \gamma`
    over the last dimension (``normalized_shape``)."""

    normalization = "RMSNorm"
    has_bias = False


class PreNorm(nn.Module):
    """Base of the modules that start with a norm (LayerNormLinear, LayerNormMLP): owns
    ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm), Transformer Engine's names."""

    def _init_norm(
        self,
        owner: str,
        hidden_size: int,
        eps: float,
        normalization: str,
        zero_centered_gamma: bool,
        factory: dict,
    ) -> None:
        check_eps(owner, eps)
        check_choice(owner, "normalization", normalization, NORMALIZATIONS)
        self.eps = float(eps)
        self.normalization = normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden_size, **factory))
        self.layer_norm_bias = (
            nn.Parameter(torch.empty(hidden_size, **factory))
            if normalization == "LayerNorm"
            else None
        )

    @torch.no_grad()
    def _reset_norm(self) -> None:
        self.layer_norm_weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
        if self.layer_norm_bias is not None:
            self.layer_norm_bias.zero_()

    def _mark_norm_parallel(self, sequence_parallel: bool) -> None:
        """Tensor-parallel attributes of the (replicated) norm parameters."""
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            set_parallel_attributes(p, sequence_parallel=sequence_parallel)

    def _fused_norm(self, inp: Tensor) -> bool:
        """Whether te.LayerNormMLP's norm runs as ``te::mlp``'s prologue: under FP8 (written
        straight into FP8 on CUDA), and in high precision on the eager fast path
        (``_library.use_fast_path``; no ``torch.autocast``; ``inp`` and the norm's weight of one
        dtype of ``_checks.HIGH_DTYPES``, as the prologue takes them): one op call less, the
        same kernels and bytes. Traced, or where a dispatch mode watches, a high-precision norm
        stays an op of its own, which selective activation checkpointing can recompute without
        recomputing the GEMMs. te.LayerNormLinear keeps it apart in high precision: its plain
        GEMM takes native autograd (``_library``'s ``native_autograd``), cheaper than
        ``te::linear``'s node with the prologue (measured on the CPU model of the CUDA path)."""
        if quantized():
            return True
        dtype = inp.dtype if isinstance(inp, Tensor) else None
        return (use_fast_path() and dtype in HIGH_DTYPES
                and self.layer_norm_weight.dtype == dtype
                and not torch._C._is_any_autocast_enabled())  # fmt: skip

    def _norm_spec(self) -> tuple[Tensor, Tensor | None, str, float, bool]:
        """The norm as an FP8 GEMM's prologue (``quantization.gemm.Norm``)."""
        return (
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.normalization,
            self.eps,
            self.zero_centered_gamma,
        )

    def _norm(self, inp: Tensor, tp: TensorParallel, owner: str) -> Tensor:
        """The norm; under sequence parallelism its parameters' gradients are all-reduced."""
        return apply_normalization(
            inp,
            self.normalization,
            tp.sequence_parallel_param(owner, self.layer_norm_weight),
            tp.sequence_parallel_param(owner, self.layer_norm_bias),
            self.eps,
            self.zero_centered_gamma,
        )
