r"""Pre-quantised weight operands of the dense GEMM families (``linear``, ``mlp``):
``te::quantize_weight`` and the checks of its five tensors.

A family op may take its weight operand already quantised, as five plain tensors
(:data:`WEIGHT_OPERAND`, FP8 codes as their uint8 bytes) that :func:`quantize_weight` makes: the
``data`` ``[N, K]`` and ``scale`` the forward GEMM reads, the ``data_t`` ``[K, N]`` and
``scale_t`` the dgrad GEMM reads, and the ``amax`` ``[1]`` measured at the cast (per-tensor
kinds; 0-element otherwise). The op then does not quantise ``weight`` (it still takes it: its
shape, and its gradient). Modules use it for ``is_first_microbatch`` and FP8 primary weights
(``quantization.primary``; ``docs/fp8.md``); the grouped family's layouts are
``functional.grouped_weight``'s (``te::quantize_grouped_weight``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._checks import check_tensor, check_tensors
from te_compile._library import op
from te_compile.functional.gemm import (
    FP8_DTYPES,
    HIGH_DTYPES,
    PER_TENSOR,
    Operand,
    check_specs,
    quantize_operand,
    scale_slots,
)
from te_compile.functional.spec import QuantSpec, parse

__all__ = [
    "WEIGHT_OPERAND",
    "check_weight_operand",
    "check_weight_quantized",
    "check_weight_spec",
    "checked_weight_cast",
    "fake_copy",
    "fp8_grad",
    "fp8_weight_for_checks",
    "quantize_weight",
    "refuse_fp8_weight_grad",
    "weight_operand",
]


def check_weight_quantized(owner: str, name: str, value: object) -> None:
    """``value`` is None or :func:`quantize_weight`'s five tensors (a list or tuple)."""
    if value is None:
        return
    n = len(WEIGHT_OPERAND)
    if not (isinstance(value, (list, tuple)) and all(isinstance(t, Tensor) for t in value)):
        raise TypeError(
            f"{owner}: {name} must be None or the {n} tensors {WEIGHT_OPERAND} of "
            f"quantize_weight, got {value!r}"
        )
    if len(value) != n:
        raise ValueError(
            f"{owner}: {name} must be the {n} tensors {WEIGHT_OPERAND} of quantize_weight, got "
            f"{len(value)} tensors"
        )


# The five tensors of a pre-quantised weight, by the family ops' argument names.
WEIGHT_OPERAND = ("weight_data", "weight_scale", "weight_data_t", "weight_scale_t", "weight_amax")


def _weight_shapes(recipe: str, n: int, k: int, block_rows: int, emulate: bool):
    """``[(shape, dtype)]`` of the five tensors of a pre-quantised ``[n, k]`` weight."""
    f32, u8 = torch.float32, torch.uint8
    if recipe in PER_TENSOR:
        return [((n, k), u8), ((1,), f32), ((k, n), u8), ((1,), f32), ((1,), f32)]
    if emulate:  # dequantised values (every block-scaled kind when its GEMM is emulated)
        return [((n, k), f32), ((0,), f32), ((k, n), f32), ((0,), f32), ((0,), f32)]
    s, s_t = (-(-n // block_rows), -(-k // 128)), (-(-k // block_rows), -(-n // 128))
    return [((n, k), u8), (s, f32), ((k, n), u8), (s_t, f32), ((0,), f32)]


def fake_copy(like: Tensor, recipe: str, n: int, k: int, block_rows: int, emulate: bool) -> list:
    """Fakes of the transposed copy ``[k, n]`` of an ``[n, k]`` operand and of its scales, as
    :func:`quantize_weight` makes a weight's (an input's: ``block_rows`` 1)."""
    shapes = _weight_shapes(recipe, n, k, block_rows, emulate)[2:4]
    return [like.new_empty(shape, dtype=dtype) for shape, dtype in shapes]


def check_weight_operand(
    p: str, recipe: str, weight: Tensor, block_rows: int, emulate: bool, tensors, shapes=None
) -> None:
    """The pre-quantised weight ``tensors`` (None, or :func:`quantize_weight`'s five, argument
    ``weight_q`` after ``p``'s prefix) of a family op whose weight is ``weight`` (``[N, K]``, or
    ``[G, N, K]``: then each tensor has the leading ``G``). ``shapes``: the five ``(shape,
    dtype)`` the tensors must have, where a family lays them out otherwise (the grouped family:
    ``functional.grouped_weight``)."""
    if tensors is None:
        return
    owner, lead = p.split(": ", 1)
    check_weight_quantized(owner, lead + "weight_q", tensors)
    if not recipe:
        raise ValueError(p + "a pre-quantised weight needs a quantised recipe (recipe is '')")
    maker = "quantize_weight" if shapes is None else "quantize_grouped_weight"
    if shapes is None:
        *lead, n, k = weight.shape
        per_weight = _weight_shapes(recipe, n, k, block_rows, emulate)
        shapes = [((*lead, *shape), dtype) for shape, dtype in per_weight]
    for name, t, (want, dtype) in zip(WEIGHT_OPERAND, tensors, shapes, strict=True):
        codes = dtype is torch.uint8 and t.dtype in FP8_DTYPES
        if tuple(t.shape) != tuple(want) or not (t.dtype is dtype or codes):
            raise ValueError(
                p + f"{name} must be {dtype} {list(want)} for recipe {recipe!r} (emulate="
                f"{emulate}) and weight {list(weight.shape)}, got {t.dtype} {list(t.shape)} "
                f"(make it with te_compile.functional.{maker})"
            )


def fp8_weight_for_checks(
    owner: str, name: str, weight: Tensor, weight_q, dtype: torch.dtype, main_grad: str
) -> Tensor:
    """``weight`` (argument ``name``) as a family's checks see it. An FP8 weight (FP8 primary
    weights: the codes stand for the weight) needs its pre-quantised operand ``weight_q`` (argument
    ``{name}_q``), else a ValueError naming it; it is then checked as a meta tensor of its shape in
    ``dtype`` (the input's). Its gradient goes to ``main_grad`` (the argument's name)."""
    if weight.dtype not in FP8_DTYPES:
        return weight
    if weight_q is None:
        raise ValueError(
            f"{owner}: an FP8 {name} ({weight.dtype}) needs its pre-quantised operand "
            f"({name}_q: {', '.join(WEIGHT_OPERAND)}); its gradient goes to {main_grad} (fp32)"
        )
    return torch.empty(weight.shape, dtype=dtype, device="meta")


def fp8_grad(weight: Tensor) -> bool:
    """Whether ``weight``'s gradient would be FP8: an FP8 weight without a high-precision
    ``grad_dtype`` (FP8 primary weights have their nominal dtype there)."""
    return weight.dtype in FP8_DTYPES and (not weight.is_leaf or weight.grad_dtype in FP8_DTYPES)


def refuse_fp8_weight_grad(owner: str, name: str, main_grad: str) -> None:
    """The backward's error for an FP8 weight ``name`` whose gradient is wanted without a
    ``main_grad`` buffer (argument ``main_grad``) nor a high-precision ``grad_dtype``."""
    raise RuntimeError(
        f"{owner}: an FP8 {name}'s gradient needs {main_grad} (fp32) or a high-precision "
        f"{name}.grad_dtype (a leaf's), and neither was given"
    )


def weight_operand(
    tensors, spec: QuantSpec, weight: Tensor, scale: Tensor | None, slot=None
) -> Operand:
    """A GEMM's weight :class:`Operand`: ``weight`` quantised by ``spec`` (``scale``: its delayed
    scale; ``slot``: as ``gemm.quantize_operand``'s), or its five pre-quantised ``tensors``
    where given (codes viewed as the spec's format)."""
    if tensors is None:
        return quantize_operand(spec, weight, scale=scale, slot=slot)
    data, s, data_t, s_t, amax = tensors
    if data.dtype is torch.uint8:
        data, data_t = data.view(spec.fp8_dtype), data_t.view(spec.fp8_dtype)
    return Operand(data, s, data_t, s_t, amax)


def check_weight_spec(
    p: str, spec: str, scale: Tensor | None, weight: Tensor, dims: int, layout: str = ""
) -> QuantSpec:
    """A weight cast op's arguments, in eager and at trace time: the weight spec (a quantised
    kind) with its delayed scales ``[3]``; ``weight`` floating, of ``dims`` dims (``layout``)."""
    w = parse(QuantSpec, spec, p + "spec")
    if not w.kind:
        raise ValueError(p + "spec must be a quantised kind, got ''")
    check_specs(p, {"spec": w}, scale)
    if weight.dim() != dims or weight.dtype not in HIGH_DTYPES + (torch.float64,):
        raise ValueError(
            p + f"weight must be a {dims}-D floating tensor{layout}, got {weight.dim()}-D "
            f"{weight.dtype}"
        )
    return w


@op("quantize_weight")
def quantize_weight_op(weight: Tensor, spec: str, scale: Tensor | None) -> list[Tensor]:
    """``te::quantize_weight``: :func:`quantize_weight` without the argument checks."""
    w = check_weight_spec("te.quantize_weight: ", spec, scale, weight, 2)
    q = quantize_operand(w, weight, scale=scale_slots(scale, w.kind, 1)[0])
    data, data_t = (t.view(torch.uint8) if t.dtype in FP8_DTYPES else t for t in (q.data, q.data_t))
    # Fresh outputs (an op's outputs may not alias): per tensor, the copies share one scale;
    # 128x128 blocks give data_t and scale_t as transposed views of data and scale.
    if w.kind == "block" and w.block_rows == 128 and not w.emulate:
        data_t = data_t.clone(memory_format=torch.contiguous_format)
    scale_t = q.scale_t.clone(memory_format=torch.contiguous_format)  # a few bytes
    amax = q.amax if w.kind in PER_TENSOR else weight.new_empty(0, dtype=torch.float32)
    return [data, q.scale, data_t, scale_t, amax]


def quantize_weight(
    weight: Tensor, spec: str | QuantSpec, scale: Tensor | None = None
) -> list[Tensor]:
    """``weight`` ``[N, K]`` as the family ops' pre-quantised weight operand (module docstring):
    ``[data, scale, data_t, scale_t, amax]``, quantised as the op would quantise it inside with the
    weight spec ``spec`` (``functional.spec.QuantSpec``; ``scale``: the GEMM's delayed scales
    ``[3]``, whose weight slot is used, with a ``"delayed"`` spec). ``te::quantize_weight`` after
    the checks of its arguments (the dispatcher's type errors would not name them)."""
    return quantize_weight_op(*checked_weight_cast("te.quantize_weight", weight, spec, scale))


def checked_weight_cast(
    owner: str, weight: Tensor, spec: str | QuantSpec, scale: Tensor | None
) -> tuple[Tensor, str, Tensor | None]:
    """The arguments of a weight cast op (``te::quantize_weight``, ``te::quantize_grouped_weight``)
    checked by name, the spec as its string."""
    check_tensor(owner, "weight", weight)
    check_tensors(owner, scale=scale)
    if not isinstance(spec, (str, QuantSpec)):
        raise TypeError(f"{owner}: spec must be a QuantSpec or its str, got {spec!r}")
    return weight, spec.encode() if isinstance(spec, QuantSpec) else spec, scale


@quantize_weight_op.register_fake
def _quantize_weight_fake(weight, spec, scale):
    w = check_weight_spec("te.quantize_weight: ", spec, scale, weight, 2)
    shapes = _weight_shapes(w.kind, *weight.shape, w.block_rows, w.emulate)
    return [weight.new_empty(shape, dtype=dtype) for shape, dtype in shapes]
