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
* ``BackwardLinearScale``: ``BasicLinear, ConstantScale`` -> ``te::linear`` with ``out_scale``
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
op requires one dtype). Under tensor parallelism (``BasicLinear(tensor_parallel_mode=...)``)
only the bias joins a row-parallel GEMM (added once, after the reduction), and no branch joins a
tensor-parallel GEMM (its input is gathered or its gradient reduced around the GEMM).

User fusions, as in Transformer Engine: ``register_forward_backward_fusion(func)``,
``register_forward_fusion(func)`` and ``register_backward_fusion(func)`` add ``func(ops, *,
recipe) -> ops`` (``prepend=True``: first of its kind). The fuser calls the joint ones, then the
forward ones, then the backward ones, each on the list the previous left, with the recipe of the
enclosing autocast (None outside one), and only then the table above on the basic ops they left:
the table fuses patterns Transformer Engine's built-in fusions do not (linear + activation), so a
user function sees the basic ops wherever TE's would. A function replaces runs of consecutive
basic ops with fused ops (``FusedOperation(basic_ops)`` subclasses implementing
``op_forward(x, extra_inputs)``, or TE's ``fuser_forward`` / ``fuser_backward``: a fused op
with only ``fuser_forward`` runs its basic ops' ``op_backward`` in the backward, one with only
``fuser_backward`` their ``op_forward`` in the forward). Here the forward and backward plans
are one list, so a backward-only fusion sees the ops that no earlier fusion took.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from te_compile import functional as F
from te_compile.ops.activation import ActivationOperation
from te_compile.ops.linear import BasicLinear, Bias
from te_compile.ops.norm import RMSNorm
from te_compile.ops.op import BasicOperation, FusedOperation, OpOutput
from te_compile.ops.structural import AddExtraInput, ConstantScale, MakeExtraOutput, store_into

__all__ = [
    "FUSIONS",
    "BackwardActivationBias",
    "BackwardAddRMSNorm",
    "BackwardLinearAdd",
    "BackwardLinearScale",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "ForwardLinearScaleAdd",
    "fuse",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
]


def _find(ops: Sequence[BasicOperation], cls: type) -> BasicOperation | None:
    return next((op for op in ops if isinstance(op, cls)), None)


def _tp_mode(op: BasicLinear) -> str | None:
    return op.tp.mode if op.tp.active else None


class ForwardLinearBiasActivation(FusedOperation):
    """``BasicLinear, [Bias], [activation]`` (at least one of the two)."""

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        act = _find(basic_ops, ActivationOperation)
        if act is not None and (act.num_extra_inputs or act.cache_quantized_input):
            return False  # ScaledSwiGLU's scales; an FP8-cached input
        # Row-parallel: the activation applies to the reduced sum, after the collective.
        return _tp_mode(basic_ops[0]) != "row" or act is None

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear: BasicLinear = basic_ops[0]
        self.bias: Bias | None = _find(basic_ops, Bias)
        self.activation: ActivationOperation | None = _find(basic_ops, ActivationOperation)

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        bias = None if self.bias is None else self.bias.bias
        if bias is not None and bias.dtype != self.linear.compute_dtype(x):
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
    """``BasicLinear, [Bias], [ConstantScale], AddExtraInput``: ``r + alpha * (x W^T + b)``;
    with ``AddExtraInput(in_place=True)`` the sum is then written into ``r``, the output."""

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        return _tp_mode(basic_ops[0]) != "row"

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear: BasicLinear = basic_ops[0]
        self.bias: Bias | None = _find(basic_ops, Bias)
        scale = _find(basic_ops, ConstantScale)
        self.alpha = 1.0 if scale is None else scale.scale
        self.in_place = _find(basic_ops, AddExtraInput).in_place

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        (residual,) = extra_inputs
        w, dtype = self.linear.weight, self.linear.compute_dtype(x)
        if (
            not isinstance(residual, Tensor)  # AddExtraInput refuses it by name
            or residual.device != x.device
            or residual.shape != (*x.shape[:-1], w.shape[0])
            or residual.dtype != x.dtype
            or x.dtype != dtype
            or (self.bias is not None and self.bias.bias.dtype != dtype)
        ):
            return self.unfused(x, extra_inputs)
        bias = None if self.bias is None else self.bias.bias
        y = self.linear.linear(x, bias, residual=residual, out_scale=self.alpha)
        return (store_into(residual, y) if self.in_place else y), ()


class ForwardLinearScaleAdd(ForwardLinearBiasAdd):
    """``BasicLinear, [Bias], ConstantScale, AddExtraInput``: ``r + alpha * (x W^T + b)``."""


class BackwardLinearScale(FusedOperation):
    """``BasicLinear, ConstantScale``: ``alpha * x W^T`` from the GEMM's epilogue; the backward
    scales the output's gradient in the same op (the dgrad and wgrad GEMMs read ``alpha dy``)."""

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        return _tp_mode(basic_ops[0]) is None

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        linear, scale = self.basic_ops
        return linear.linear(x, None, out_scale=scale.scale), ()


class BackwardLinearAdd(FusedOperation):
    """``MakeExtraOutput, BasicLinear, [Bias]``: the branch's gradient joins the dgrad GEMM."""

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        return _tp_mode(basic_ops[1]) is None

    def __init__(self, basic_ops: Sequence[BasicOperation]) -> None:
        super().__init__(basic_ops)
        self.linear: BasicLinear = basic_ops[1]
        self.bias: Bias | None = _find(basic_ops, Bias)

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        bias = None if self.bias is None else self.bias.bias
        if bias is not None and bias.dtype != self.linear.compute_dtype(x):
            return self.unfused(x, extra_inputs)
        y, branch = self.linear.linear(x, bias, return_branch=True)
        return y, (branch,)


class BackwardActivationBias(FusedOperation):
    """``Bias, activation``: one activation op with the bias; its backward returns the bias
    gradient from the activation backward's pass."""

    @classmethod
    def accepts(cls, basic_ops: Sequence[BasicOperation]) -> bool:
        act = basic_ops[1]
        return not (act.num_extra_inputs or act.cache_quantized_input)

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
    (ForwardLinearBiasActivation, (BasicLinear, _optional(Bias), ActivationOperation)),
    (ForwardLinearScaleAdd, (BasicLinear, _optional(Bias), ConstantScale, AddExtraInput)),
    (ForwardLinearBiasAdd, (BasicLinear, _optional(Bias), AddExtraInput)),
    (BackwardLinearAdd, (MakeExtraOutput, BasicLinear, _optional(Bias))),
    (BackwardLinearScale, (BasicLinear, ConstantScale)),
    (ForwardLinearBiasActivation, (BasicLinear, Bias)),
    (BackwardActivationBias, (Bias, ActivationOperation)),
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


FusionFunction = Callable[..., list]
# The user fusions by pass, in the order they are applied (see the module docstring).
_USER_FUSIONS: dict[str, list[FusionFunction]] = {
    "forward_backward": [],
    "forward": [],
    "backward": [],
}


def _register(kind: str, func: FusionFunction, prepend: bool) -> None:
    if not callable(func):
        raise TypeError(f"register_{kind}_fusion: op_fusion_func must be callable, got {func!r}")
    if not isinstance(prepend, bool):
        raise TypeError(f"register_{kind}_fusion: prepend must be a bool, got {prepend!r}")
    funcs = _USER_FUSIONS[kind]
    if prepend:
        funcs.insert(0, func)
    else:
        funcs.append(func)


def register_forward_backward_fusion(op_fusion_func: FusionFunction, prepend: bool = False) -> None:
    """Add a joint fusion ``op_fusion_func(ops, *, recipe) -> ops`` (see the module docstring)."""
    _register("forward_backward", op_fusion_func, prepend)


def register_forward_fusion(op_fusion_func: FusionFunction, prepend: bool = False) -> None:
    """Add a forward fusion ``op_fusion_func(ops, *, recipe) -> ops``: its fused ops implement
    the forward (``fuser_forward``), the basic ops' backward runs unfused."""
    _register("forward", op_fusion_func, prepend)


def register_backward_fusion(op_fusion_func: FusionFunction, prepend: bool = False) -> None:
    """Add a backward fusion ``op_fusion_func(ops, *, recipe) -> ops``: its fused ops implement
    the backward (``fuser_backward``), the basic ops' forward runs unfused."""
    _register("backward", op_fusion_func, prepend)


def user_fusions_version() -> tuple[int, ...]:
    """Changes when a fusion is registered (a Sequential re-plans then)."""
    return tuple(id(f) for kind in _USER_FUSIONS.values() for f in kind)


def _user_fuse(steps: list, recipe: Any) -> list:
    basic = [op for s in steps for op in (s.basic_ops if isinstance(s, FusedOperation) else (s,))]
    for kind in ("forward_backward", "forward", "backward"):
        passes = ("forward", "backward") if kind == "forward_backward" else (kind,)
        for func in _USER_FUSIONS[kind]:
            steps = list(func(list(steps), recipe=recipe))
            for step in steps:  # the passes a TE-protocol fused op is used for (op.py)
                if isinstance(step, FusedOperation) and not hasattr(step, "_te_passes"):
                    step._te_passes = passes
    flat = [op for s in steps for op in (s.basic_ops if isinstance(s, FusedOperation) else (s,))]
    if len(flat) != len(basic) or any(a is not b for a, b in zip(flat, basic, strict=True)):
        raise RuntimeError(
            "te_compile.ops: a registered fusion function returned ops that do not expand to "
            f"the basic ops it was given (given {[type(o).__name__ for o in basic]}, got "
            f"{[type(o).__name__ for o in steps]})"
        )
    return steps


def fuse(
    ops: Sequence[BasicOperation], recipe: Any = None
) -> list[BasicOperation | FusedOperation]:
    """``ops`` with every run that a fusion of :data:`FUSIONS` matches replaced by the fused op,
    after the registered user fusions (with ``recipe``) took theirs."""
    steps: list[BasicOperation | FusedOperation] = list(ops)
    if steps and user_fusions_version():
        steps = _user_fuse(steps, recipe)
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
