"""Specs: the GEMM families' configuration as short strings, one per role, parsed once.

A GEMM family op (``te::linear``, ``te::mlp``, ``te::grouped_linear``) takes its quantisation
as one string per operand role (``input_spec``, ``weight_spec``, ``grad_spec``: a
:class:`QuantSpec`), and its norm prologue (:class:`NormSpec`), epilogue (:class:`EpilogueSpec`)
and backward options (:class:`BackwardSpec`) as one string each. A string is ``:``-separated
tokens: a bare token names a choice (``"e5m2"``, ``"gelu"``) or sets a flag (``"rht"``), and
``name=value`` sets a number or a name (``"eps=1e-05"``; ``/`` stands for ``:`` in a value). A
field at its default is not written, so ``""`` is everything at its default (high precision,
no norm, no epilogue). Examples::

    current:e4m3                      per-tensor current scaling, E4M3
    delayed:e5m2                      per-tensor delayed scaling (the op's scale tensor), E5M2
    block:e4m3:128x128:p2             Float8BlockScaling 128x128 blocks, power-of-two scales
    mxfp8:e4m3:emulate                MXFP8, GEMM emulated (dequantised operands, fp32 GEMM)
    nvfp4:16x16:emulate:4over6=MSE/256  NVFP4 16x16 tiles with 4over6 block scaling
    RMSNorm:eps=1e-05:zero_centered   a norm prologue
    swiglu:interleave=4:scale=0.5     an epilogue

Why strings (``docs/op_mechanism.md``, "Why spec strings"): a schema takes primitives only,
and one string per role keeps it short and readable while a new recipe option becomes a field
here. :func:`parse` is cached; ``encode`` gives the canonical string back (``parse(s).encode()
== s`` for a canonical ``s``). ``quantization.gemm.recipe_specs`` makes the three quantisation
specs of a recipe object; ``functional.gemm.check_specs`` checks what joins the roles.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = [
    "BackwardSpec",
    "EpilogueSpec",
    "NormSpec",
    "QuantSpec",
    "as_specs",
    "as_strings",
    "backward_norm",
    "eager_cached",
    "parse",
    "parse_roles",
]

S = TypeVar("S")

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def eager_cached(
    maxsize: int, typed: bool = False
) -> Callable[[Callable[..., S]], Callable[..., S]]:
    """A function of hashable arguments whose eager calls are computed once per set of
    arguments (``typed``: and of their types, so that ``1`` and ``1.0`` stay apart), at most
    ``maxsize`` kept (past it the table starts over). Traced calls compute the value: dynamo
    folds it into a constant of the graph (or keeps symbolic floats symbolic) and never reads
    the table. An error is raised again on every call: it is not kept; an unhashable argument
    is passed to ``fn`` uncached (its checks name it)."""

    def deco(fn: Callable[..., S]) -> Callable[..., S]:
        table: dict[Any, S] = {}

        @functools.wraps(fn)
        def cached(*args: Any) -> S:
            if torch.compiler.is_compiling():
                return fn(*args)
            key = (args, tuple(map(type, args))) if typed else args
            try:
                value = table.get(key)
            except TypeError:  # an unhashable argument: fn's checks name it
                return fn(*args)
            if value is None:
                if len(table) >= maxsize:
                    table.clear()
                value = table[key] = fn(*args)
            return value

        return cached

    return deco


def _cached(build: Any) -> Any:
    """An ``encode`` method building each (frozen, hashable) spec's string once in eager calls
    (:func:`eager_cached`; a GEMM call encodes a dozen); traced code calls ``build``: dynamo
    cannot pass a spec through the table's ``*args`` in a higher-order op (checkpoint)."""
    cached = eager_cached(4096)(build)

    @functools.wraps(build)
    def encode(self) -> str:
        return build(self) if torch.compiler.is_compiling() else cached(self)

    return encode


def _flag(token: str) -> Any:
    return dataclasses.field(default=False, metadata={"flag": token})


def _choice(default: Any, choices: dict[str, Any]) -> Any:
    return dataclasses.field(default=default, metadata={"choices": choices})


def _value(default: Any, token: str) -> Any:
    return dataclasses.field(default=default, metadata={"value": token})


def _names(*names: str) -> dict[str, str]:
    return {name: name for name in names}


def _encode(spec: Any) -> str:
    tokens = []
    for name, default, meta in _FIELDS[type(spec)]:
        value = getattr(spec, name)
        if value == default:
            continue
        if "flag" in meta:
            tokens.append(meta["flag"])
        elif "choices" in meta:
            tokens.append(meta["tokens"][value])
        else:
            # f"{}": a float's repr, and what dynamo traces for a float it made symbolic (a
            # SymFloat under dynamic=True; repr() of one is a graph break).
            text = value if isinstance(value, str) else f"{value}"
            tokens.append(f"{meta['value']}={text.replace(':', '/')}")
    return ":".join(tokens)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantised. ``kind``: ``""`` (high precision), ``"current"``,
    ``"delayed"``, ``"block"``, ``"mxfp8"``, ``"nvfp4"``; ``fp8_dtype``: the FP8 element format
    (NVFP4's block scales are E4M3 whatever it says); ``block_rows``: 128 for Float8BlockScaling's
    128x128 blocks, 32 for MXFP8's 32x32 weight tiles, 16 for NVFP4's 16x16 tiles, else 1;
    ``power_2_scale``; ``emulate``: the GEMM multiplies the exact quantised values in fp32
    instead of calling the scaled GEMM (the same for all operands of a GEMM); NVFP4's options:
    ``rht`` (the random Hadamard transform of the columnwise copy: input and gradient together),
    ``stochastic_rounding`` (gradient), ``row_scaled`` (a global scale per row: input; for the
    per-tensor kinds, one scale per row: the grouped family's operands, refused in op specs),
    ``four_over_six`` (4over6 block scaling: input, weight;
    ``functional.quantize_mx_ref.FOUR_OVER_SIX``); the per-tensor kinds' gradient options
    ``fast_dgrad`` / ``fast_wgrad``: the dgrad / wgrad GEMM (both read the gradient) accumulates
    in the tensor cores' own precision, without Hopper's split (promoted) accumulation
    (Transformer Engine's ``MMParams(use_split_accumulator=False)``)."""

    kind: str = _choice("", _names("current", "delayed", "block", "mxfp8", "nvfp4"))
    fp8_dtype: torch.dtype = _choice(_E4M3, {"e4m3": _E4M3, "e5m2": _E5M2})  # noqa: RUF009
    block_rows: int = _choice(1, {"128x128": 128, "32x32": 32, "16x16": 16})
    power_2_scale: bool = _flag("p2")
    emulate: bool = _flag("emulate")
    rht: bool = _flag("rht")
    stochastic_rounding: bool = _flag("sr")
    row_scaled: bool = _flag("row_scaled")
    four_over_six: str = _value("", "4over6")
    fast_dgrad: bool = _flag("fast_dgrad")
    fast_wgrad: bool = _flag("fast_wgrad")

    @_cached
    def encode(self) -> str:
        """The canonical string; an FP8 kind's format is always written."""
        kind, _, rest = _encode(self).partition(":")
        fp8 = self.kind in ("current", "delayed", "block", "mxfp8") and self.fp8_dtype is _E4M3
        return ":".join(t for t in (kind, "e4m3" if fp8 else "", rest) if t)

    def options(self) -> dict[str, Any]:
        """NVFP4's options that are on, by ``functional.gemm.quantize_operand``'s names."""
        on = {"rht": self.rht, "row_scaled": self.row_scaled, "four_over_six": self.four_over_six}
        return {name: value for name, value in on.items() if value}


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A norm prologue: ``normalization`` (``""`` none, ``"LayerNorm"``, ``"RMSNorm"``),
    ``eps``, ``zero_centered_gamma``; ``bias``: the norm has a bias, for a backward op (which
    does not take the bias itself; a forward op reads its ``norm_bias``)."""

    normalization: str = _choice("", _names("LayerNorm", "RMSNorm"))
    eps: float = _value(1e-5, "eps")
    zero_centered_gamma: bool = _flag("zero_centered")
    bias: bool = _flag("bias")

    encode = _cached(_encode)


@dataclasses.dataclass(frozen=True)
class EpilogueSpec:
    """An epilogue ``residual + scale * activation(y + bias)``: ``activation`` (``""`` none, or
    a name of ``functional.activation``) with ``interleave`` (the GLU layout's
    ``glu_interleave_size``), ``limit``, ``alpha``, ``offset`` (clamped SwiGLU's
    ``glu_linear_offset``); ``scale`` (``out_scale``); ``branch``: also return a copy of the
    input (a residual branch)."""

    activation: str = _value("", "act")
    interleave: int = _value(0, "interleave")
    limit: float = _value(7.0, "limit")
    alpha: float = _value(1.702, "alpha")
    offset: float = _value(1.0, "offset")
    scale: float = _value(1.0, "scale")
    branch: bool = _flag("branch")

    encode = _cached(_encode)

    @property
    def params(self) -> tuple[int, float, float, float]:
        """``(glu_interleave_size, limit, alpha, glu_linear_offset)``, the activation ops'."""
        return (self.interleave, self.limit, self.alpha, self.offset)


@dataclasses.dataclass(frozen=True)
class BackwardSpec:
    """What a GEMM's backward runs on: ``override`` (``""`` the recipe's quantised operands;
    ``"high_precision"`` / ``"dequantized"``: Transformer Engine's ``backward_override``);
    ``save_input``: the backward keeps the input itself and quantises it again
    (``save_original_input``); ``fp8_wgrad``: the grouped family's per-tensor wgrad GEMM in
    FP8; ``overwrite_main_grad``: the weight gradient replaces ``main_grad``'s values instead of
    adding to them (Transformer Engine's ``weight.overwrite_main_grad``)."""

    override: str = _choice("", _names("high_precision", "dequantized"))
    save_input: bool = _flag("save_input")
    fp8_wgrad: bool = _flag("fp8_wgrad")
    overwrite_main_grad: bool = _flag("overwrite")

    encode = _cached(_encode)


def backward_norm(norm: str, bias: bool) -> str:
    """A forward op's ``norm`` string as its backward op takes it: ``bias`` set where given."""
    return dataclasses.replace(parse(NormSpec, norm), bias=True).encode() if bias else norm


def _bad(cls: type, name: str, text: str, why: str) -> ValueError:
    tokens = []
    for _, _, meta in _FIELDS[cls]:
        tokens += [meta["flag"]] if "flag" in meta else list(meta.get("choices", ()))
        tokens += [meta["value"] + "=..."] if "value" in meta else []
    return ValueError(f"{name} {text!r}: {why} ({cls.__name__} tokens: {', '.join(tokens)})")


# ``(name, default, metadata)`` of each spec class's fields, read once (dynamo, which traces
# :func:`_encode` in a family function, cannot trace ``dataclasses.fields``); a field with
# choices also has ``tokens``, value -> token: a look-up where dynamo would trace a generator.
_FIELDS: dict[type, tuple[tuple[str, Any, dict[str, Any]], ...]] = {
    cls: tuple((f.name, f.default, {**f.metadata, "tokens": {v: k for k, v in
                f.metadata.get("choices", {}).items()}}) for f in dataclasses.fields(cls))
    for cls in (QuantSpec, NormSpec, EpilogueSpec, BackwardSpec)}  # fmt: skip


@functools.lru_cache(maxsize=1024)
def parse(cls: type[S], text: str, name: str = "spec") -> S:
    """The ``cls`` spec that ``text`` encodes (module docstring); ``name`` (the argument) begins
    the error messages. Cached: an op pays one look-up per string."""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str ({cls.__name__}), got {text!r}")
    values: dict[str, Any] = {}
    for token in text.split(":") if text else ():
        key, eq, raw = token.partition("=")
        for field, default, meta in _FIELDS[cls]:
            if eq and meta.get("value") == key:
                try:
                    value = type(default)(raw.replace("/", ":"))
                except ValueError:
                    raise _bad(cls, name, text, f"{key} takes a {type(default).__name__}, "
                               f"got {raw!r}") from None  # fmt: skip
            elif not eq and meta.get("flag") == token:
                value = True
            elif not eq and token in meta.get("choices", ()):
                value = meta["choices"][token]
            else:
                continue
            if field in values:
                raise _bad(cls, name, text, f"{field} given twice")
            values[field] = value
            break
        else:
            raise _bad(cls, name, text, f"unknown token {token!r}")
    return cls(**values)


ROLES = ("input_spec", "weight_spec", "grad_spec")


def as_specs(*specs: str | QuantSpec) -> tuple[QuantSpec, ...]:
    """Spec objects of spec strings (or objects)."""
    return tuple(s if isinstance(s, QuantSpec) else parse(QuantSpec, s) for s in specs)


def as_strings(*specs: str | QuantSpec) -> list[str]:
    """Spec strings of spec objects (or strings): what an op's schema takes."""
    return [s.encode() if isinstance(s, QuantSpec) else s for s in specs]


def parse_roles(owner: str, *texts: str) -> tuple[QuantSpec, QuantSpec, QuantSpec]:
    """A GEMM family op's three operand specs (``input_spec``, ``weight_spec``, ``grad_spec``),
    each parsed with its argument named after ``owner`` in the errors."""
    return tuple(parse(QuantSpec, t, n) for t, n in zip(texts, _role_names(owner), strict=True))  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _role_names(owner: str) -> tuple[str, str, str]:
    """The three spec arguments' names as :func:`parse_roles`'s errors begin them."""
    return tuple(f"{owner}: {role}" for role in ROLES)  # type: ignore[return-value]
