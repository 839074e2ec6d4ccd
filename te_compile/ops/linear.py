r"""Linear basic ops: ``BasicLinear`` (:math:`y = x W^\top`, no bias), ``Bias`` (:math:`y = x + b`)
and ``GroupedLinear`` (one weight per group of rows).

As in Transformer Engine, the bias is its own op so that the fuser can put it where it is
cheapest: in the GEMM's epilogue after a ``BasicLinear``, in the activation kernel before an
activation, in the residual add's GEMM. ``Bias`` on its own is a broadcast add through torch
(a te op would only add a copy and hide the add from Inductor's fusion).

``BasicLinear`` goes through ``te::linear_fwd`` / ``te::linear_bwd`` with the recipe of an
enabled ``te_compile.autocast`` as data, its FP8 scaling state in the ``fp8_meta`` child module
(left out of the state_dict while unused, as for ``te.Linear``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from te_compile._checks import check_bool, check_callable, check_device
from te_compile.ops.op import BasicOperation, OpOutput, check_input
from te_compile.quantization import fp8_gemm, gemm

__all__ = ["BasicLinear", "Bias", "GroupedLinear"]

DEFAULT_INIT_STD = 0.023  # Transformer Engine's default weight init std


def _check_size(owner: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def _dtype(owner: str, dtype: torch.dtype | None) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{owner}: dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _init(weight: Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


class BasicLinear(BasicOperation):
    r""":math:`y = x W^\top` over the last dim; ``weight`` is ``[out_features, in_features]``.

    Args:
        in_features, out_features: sizes of the last dim of the input and the output.
        device, dtype: of the weight (defaults: torch's defaults).
        accumulate_into_main_grad: accumulate the weight gradient into ``weight.main_grad``
            (fp32, set by the caller) instead of ``weight.grad``.
        init_method: ``init_method(weight)`` (default: normal, std 0.023, TE's default).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        accumulate_into_main_grad: bool = False,
        init_method: Callable[[Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        _check_size("BasicLinear", in_features=in_features, out_features=out_features)
        check_bool("BasicLinear", accumulate_into_main_grad=accumulate_into_main_grad)
        dtype = _dtype("BasicLinear", dtype)
        self.in_features, self.out_features = in_features, out_features
        self.accumulate_into_main_grad = accumulate_into_main_grad
        check_device("BasicLinear", "device", device)
        check_callable("BasicLinear", init_method=init_method)
        self.init_method = init_method or _init
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.fp8_meta = fp8_gemm.FP8GemmState(device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.init_method(self.weight)

    def main_grad(self) -> Tensor | None:
        """``weight.main_grad`` with ``accumulate_into_main_grad``, else None."""
        if not self.accumulate_into_main_grad:
            return None
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is None:
            raise RuntimeError(
                "BasicLinear(accumulate_into_main_grad=True) needs weight.main_grad: a float32 "
                "tensor of the weight's shape, e.g. "
                "`op.weight.main_grad = torch.zeros_like(op.weight, dtype=torch.float32)`"
            )
        return main_grad

    def linear(self, x: Tensor, bias: Tensor | None, **epilogue) -> Tensor | tuple[Tensor, ...]:
        """``x W^T + bias`` through ``te::linear`` with the recipe of the autocast state (high
        precision outside one) and the epilogue arguments of ``functional.linear``
        (``activation``, ``residual``, ``out_scale``, ``return_branch``): what the fused ops
        call, in every precision."""
        main_grad = self.main_grad()
        return gemm.linear(
            "BasicLinear", self.fp8_meta, x, self.weight, bias, main_grad, **epilogue
        )

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        check_input("BasicLinear", x, self.in_features)
        return self.linear(x, None), ()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dtype={self.weight.dtype}"
        )


class Bias(BasicOperation):
    """:math:`y = x + b` with ``bias`` ``[size]`` added along the last dim (initialised to zero).

    Args:
        size: the last dim of the input.
        device, dtype: of the bias (defaults: torch's defaults).
    """

    def __init__(
        self,
        size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_size("Bias", size=size)
        self.size = size
        check_device("Bias", "device", device)
        self.bias = nn.Parameter(torch.zeros(size, dtype=_dtype("Bias", dtype), device=device))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.bias.zero_()

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        check_input("Bias", x)
        if x.shape[-1:] != self.bias.shape:
            raise ValueError(
                f"Bias: input's last dim ({x.shape[-1] if x.dim() else None}) must equal "
                f"size ({self.size})"
            )
        return x + self.bias, ()

    def extra_repr(self) -> str:
        return f"size={self.size}, dtype={self.bias.dtype}"


class GroupedLinear(BasicOperation):
    r"""One linear layer per group of rows (mixture-of-experts experts):
    :math:`y_g = x_g W_g^\top + b_g`, through ``te::grouped_linear_fwd``.

    Takes one extra input, ``m_splits`` (rows per group: an integer tensor, on the input's device
    or the CPU, or a list of ints), as Transformer Engine's ``te.ops.GroupedLinear`` does:
    ``Sequential(..., GroupedLinear(...), ...)(x, m_splits)``. Parameters in the single grouped
    layout: ``weight`` ``[num_groups, out_features, in_features]``, ``bias``
    ``[num_groups, out_features]``. Inside ``te_compile.autocast`` the GEMMs run with the recipe
    as data (``te::grouped_linear``): rowwise scales under ``Float8CurrentScaling``,
    per-tensor delayed scales (``fp8_meta``) under ``DelayedScaling``; Float8BlockScaling and
    MXFP8BlockScaling are emulated (see :class:`te_compile.GroupedLinear`).
    """

    num_extra_inputs = 1

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init_method: Callable[[Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        _check_size(
            "GroupedLinear",
            num_groups=num_groups,
            in_features=in_features,
            out_features=out_features,
        )
        check_bool("GroupedLinear", bias=bias)
        dtype = _dtype("GroupedLinear", dtype)
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        check_device("GroupedLinear", "device", device)
        check_callable("GroupedLinear", init_method=init_method)
        self.init_method = init_method or _init
        kw = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **kw)) if bias else None
        self.fp8_meta = fp8_gemm.FP8GemmState(device)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for w in self.weight.unbind(0):
            self.init_method(w)
        if self.bias is not None:
            self.bias.zero_()

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        (m_splits,) = extra_inputs
        out = gemm.grouped_linear(
            "GroupedLinear", self.fp8_meta, x, m_splits, self.weight, self.bias
        )
        return out, ()

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
