r"""The fused operations and the one list of fusions the fuser tries.

Each fusion replaces a run of consecutive basic ops (in forward order) with one te op pair:

* ``ForwardLinearBiasActivation``: ``BasicLinear, [Bias], <activation>`` -> ``te::linear``
  with the activation epilogue
* ``ForwardLinearScaleAdd``: ``BasicLinear, [Bias], ConstantScale, AddExtraInput`` ->
  ``te::linear`` with the residual epilogue and ``out_scale``
* ``ForwardLinearBiasAdd``: ``BasicLinear, [Bias], AddExtraInput`` -> ``te::linear`` with the
  residual epilogue
* ``BackwardLinearAdd``: ``MakeExtraOutput, BasicLinear, [Bias]`` -> ``te::linear`` with
  ``branch`` (the branch's gradient joins the dgrad GEMM)
* ``ForwardLinearBiasActivation``: ``BasicLinear, Bias`` -> ``te::linear`` (the bias in the
  GEMM's epilogue)
* ``BackwardActivationBias``: ``Bias, <activation>`` -> ``te::(gated_)activation_fwd/_bwd``
* ``BackwardAddRMSNorm``: ``MakeExtraOutput, RMSNorm`` -> ``te::branch_rmsnorm_fwd/_bwd``

(Transformer Engine's names for the fused ops; ``[...]`` is optional.)

What each fuses: the GEMM and the bias + activation kernel in the forward, the activation
backward with the bias gradient and then the GEMMs in the backward (linear + bias +
activation); the residual add in the GEMM's epilogue (linear + [scale] + add); the branch's
gradient in the dgrad GEMM's epilogue (``MakeExtraOutput`` before a linear: "dgrad + add") or in
the norm's backward ("add + RMSNorm backward"); the bias gradient in the activation's backward
pass (``Bias`` before an activation: "activation backward + dbias").

Order: the fusions are applied in the order of ``FUSIONS``, each over the whole run, so an
earlier one wins where two overlap (``MakeExtraOutput, BasicLinear, Bias, GELU`` becomes
``MakeExtraOutput`` and linear + bias + GELU: the forward fusion saves more than the branch
add). Runs are matched greedily from the left.

Every linear fusion is one ``te::linear`` call with an epilogue, with the recipe of an enabled
``te_compile.autocast`` as data (FP8 and the fusions combine on the same op). Fallbacks, taken
at call time (so that ``torch.compile`` guards on them): ``ForwardLinear*Add`` runs unfused
when the residual's shape or dtype is not the output's, and a fusion with a ``Bias`` when the
bias's dtype is not the input's or weight's (the unfused add promotes mixed dtypes; the fused
op requires one dtype).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from te_compile import functional as F
from te_compile.ops.activation import _Activation
from te_compile.ops.linear import BasicLinear, Bias
from te_compile.ops.norm import RMSNorm
from te_compile.ops.op import BasicOperation, FusedOperation, OpOutput
from te_compile.ops.structural import AddExtraInput, ConstantScale, MakeExtraOutput

__all__ = [
    "FUSIONS",
    "BackwardActivationBias",
    "BackwardAddRMSNorm",
    "BackwardLinearAdd",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "ForwardLinearScaleAdd",
    "fuse",
]


def _find(ops: Sequence[BasicOperation], cls: type) -> BasicOperation | None:
    return next((op for op in ops if isinstance(op, cls)), None)


class ForwardLinearBiasActivation(FusedOperation):
    """``BasicLinear, [Bias], [activation]`` (at least one of the two)."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear: BasicLinear = basic_ops[0]
        self.bias: Bias | None = _find(basic_ops, Bias)
        self.activation: _Activation | None = _find(basic_ops, _Activation)

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        bias = None if self.bias is None else self.bias.bias
        if bias is not None and bias.dtype != self.linear.weight.dtype:
            return self.unfused(x, extra_inputs)  # the unfused add promotes mixed dtypes
        act = self.activation
        if act is None:  # the bias in the GEMM's epilogue
            return self.linear.linear(x, bias), ()
        k, limit, alpha, offset = act.config()
        y = self.linear.linear(
            x, bias, activation=act.activation, glu_interleave_size=k, limit=limit, alpha=alpha,
            glu_linear_offset=offset,
        )  # fmt: skip
        return y, ()


class ForwardLinearBiasAdd(FusedOperation):
    """``BasicLinear, [Bias], [ConstantScale], AddExtraInput``: ``r + alpha * (x W^T + b)``."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear: BasicLinear = basic_ops[0]
        self.bias: Bias | None = _find(basic_ops, Bias)
        scale = _find(basic_ops, ConstantScale)
        self.alpha = 1.0 if scale is None else scale.scale

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        (residual,) = extra_inputs
        w = self.linear.weight
        if (
            residual.shape != (*x.shape[:-1], w.shape[0])
            or residual.dtype != x.dtype
            or x.dtype != w.dtype
            or (self.bias is not None and self.bias.bias.dtype != w.dtype)
        ):
            return self.unfused(x, extra_inputs)
        bias = None if self.bias is None else self.bias.bias
        return self.linear.linear(x, bias, residual=residual, out_scale=self.alpha), ()


class ForwardLinearScaleAdd(ForwardLinearBiasAdd):
    """``BasicLinear, [Bias], ConstantScale, AddExtraInput``: ``r + alpha * (x W^T + b)``."""


class BackwardLinearAdd(FusedOperation):
    """``MakeExtraOutput, BasicLinear, [Bias]``: the branch's gradient joins the dgrad GEMM."""

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear: BasicLinear = basic_ops[1]
        self.bias: Bias | None = _find(basic_ops, Bias)

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        bias = None if self.bias is None else self.bias.bias
        if bias is not None and bias.dtype != self.linear.weight.dtype:
            return self.unfused(x, extra_inputs)
        y, branch = self.linear.linear(x, bias, return_branch=True)
        return y, (branch,)


class BackwardActivationBias(FusedOperation):
    """``Bias, activation``: one activation op with the bias; its backward returns the bias
    gradient from the activation backward's pass."""

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        bias, act = self.basic_ops
        if bias.bias.dtype != x.dtype:
            return self.unfused(x, extra_inputs)  # the unfused add promotes mixed dtypes
        return act.apply(x, bias.bias), ()


class BackwardAddRMSNorm(FusedOperation):
    """``MakeExtraOutput, RMSNorm`` (1-D ``normalized_shape``): the branch's gradient is added
    inside the norm's backward."""

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        return len(basic_ops[1].normalized_shape) == 1

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        norm = self.basic_ops[1]
        y, branch = F.branch_rmsnorm(x, norm.weight, norm.eps, norm.zero_centered_gamma)
        return y, (branch,)


def _optional(cls: type) -> tuple[type, None]:
    return (cls, None)


# (fused op, pattern): a pattern entry is a basic-op class, or _optional(class).
FUSIONS: tuple[tuple[type[FusedOperation], tuple], ...] = (
    (ForwardLinearBiasActivation, (BasicLinear, _optional(Bias), _Activation)),
    (ForwardLinearScaleAdd, (BasicLinear, _optional(Bias), ConstantScale, AddExtraInput)),
    (ForwardLinearBiasAdd, (BasicLinear, _optional(Bias), AddExtraInput)),
    (BackwardLinearAdd, (MakeExtraOutput, BasicLinear, _optional(Bias))),
    (ForwardLinearBiasActivation, (BasicLinear, Bias)),
    (BackwardActivationBias, (Bias, _Activation)),
    (BackwardAddRMSNorm, (MakeExtraOutput, RMSNorm)),
)


def _match(pattern: tuple, ops: Sequence[object], start: int) -> int:
    """Length of the run of ``ops`` from ``start`` that ``pattern`` matches (0: none)."""
    i = start
    for entry in pattern:
        optional = isinstance(entry, tuple)
        cls = entry[0] if optional else entry
        if i < len(ops) and isinstance(ops[i], cls):
            i += 1
        elif not optional:
            return 0
    return i - start


def fuse(ops: Sequence[BasicOperation]) -> list[BasicOperation | FusedOperation]:
    """``ops`` with every run that a fusion of :data:`FUSIONS` matches replaced by the fused op."""
    steps: list[BasicOperation | FusedOperation] = list(ops)
    for fused_cls, pattern in FUSIONS:
        i, out = 0, []
        while i < len(steps):
            n = _match(pattern, steps, i)
            if n and fused_cls.accepts(steps[i : i + n]):
                out.append(fused_cls(steps[i : i + n]))
                i += n
            else:
                out.append(steps[i])
                i += 1
        steps = out
    return steps
