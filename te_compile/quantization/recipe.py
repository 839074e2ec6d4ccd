r"""Low-precision training recipes: Transformer Engine's names, fields and defaults.

A recipe says *how* tensors are quantised inside an :func:`~te_compile.quantization.autocast`
region. There are five, ordered by how finely the scale follows the data:

=====================  ===========  =====================================  ======================
recipe                 ``kind``     scale granularity                      scale dtype
=====================  ===========  =====================================  ======================
DelayedScaling         "delayed"    one per tensor, from an amax history   fp32
Float8CurrentScaling   "current"    one per tensor, from this tensor       fp32
Float8BlockScaling     "block"      1x128 (activations, grads), 128x128    fp32 (powers of 2
                                    (weights)                              by default)
MXFP8BlockScaling      "mxfp8"      1x32                                   E8M0 (a power of 2)
NVFP4BlockScaling      "nvfp4"      1x16 (16x16 for weights), and a        E4M3 per block,
                                    global fp32 per-tensor scale           fp32 global
=====================  ===========  =====================================  ======================

With ``amax`` the largest magnitude the scale must cover and ``fp8_max`` the format's largest
finite value (448 for E4M3, 57344 for E5M2), a per-tensor scale is

.. math::

    \mathrm{scale} = \frac{\mathrm{fp8\_max}}{\mathrm{amax}} \cdot 2^{-\mathrm{margin}},
    \qquad q = \mathrm{cast}(x \cdot \mathrm{scale}), \qquad x \approx q / \mathrm{scale}.

Delayed scaling takes ``amax`` from a history of the last ``amax_history_len`` steps (its
maximum, or the most recent entry), so quantising needs no extra pass over the data but can
overflow when a tensor grows quickly; current scaling measures this tensor's amax first. Block
recipes give each block its own scale, which keeps outliers from crushing the rest of the tensor.

Every recipe is a mutable dataclass, validated at construction and on every field assignment
(a refused value raises ``ValueError`` and is not kept; ``docs/fp8.md``, "Recipes are mutable
dataclasses, as TE's are"). ``backward_override`` (not for ``DelayedScaling``, as in TE) chooses
the backward GEMMs' operands: ``None``, ``"high_precision"`` or ``"dequantized"``.

Departures from Transformer Engine (each recipe's list: ``docs/te_compat.md``, "FP8 recipes
and autocast"): no default comes from ``NVTE_*`` variables; the per-operand ``QParams`` fields
(``fp4_quant_*``, ``fp8_quant_*``) follow the recipe's flags whenever a flag is set; ``fp8_dpa`` /
``fp8_mha`` accept only ``False`` (no FP8 attention); what the modules do not implement is
refused, not ignored (``quantization.gemm.recipe_specs`` names the field).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch

__all__ = [
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
    "get_align_size_for_quantization",
]

_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
_NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")
_AMAX_COMPUTE_ALGOS = ("max", "most_recent")
# The per-operand QParams fields of the FP8 recipes that have them.
FP8_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


class _FormatSpec(NamedTuple):
    max_fwd: float
    max_bwd: float
    dtype_fwd: torch.dtype
    dtype_bwd: torch.dtype


class Format(enum.Enum):
    """Low-precision data formats, as in TE (``Format.E4M3.value.max_fwd == 448``).

    ``E4M3`` / ``E5M2``: every FP8 tensor in that format; ``HYBRID``: forward tensors
    (activations, weights) in e4m3 for precision, backward tensors (gradients) in e5m2 for range;
    ``E2M1``: FP4, two values per byte, only NVFP4's ``fp4_format``.
    """

    E4M3 = _FormatSpec(448.0, 448.0, torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = _FormatSpec(57344.0, 57344.0, torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = _FormatSpec(448.0, 57344.0, torch.float8_e4m3fn, torch.float8_e5m2)
    E2M1 = _FormatSpec(6.0, 6.0, torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2)

    def __repr__(self) -> str:
        return f"Format.{self.name}"

    max_fwd = property(lambda self: self.value.max_fwd)
    max_bwd = property(lambda self: self.value.max_bwd)
    fwd_dtype = property(lambda self: self.value.dtype_fwd)
    bwd_dtype = property(lambda self: self.value.dtype_bwd)


_T = TypeVar("_T", bound=type)


def _with_field_types(cls: _T) -> _T:
    """Record on a dataclass each field's expected type: the type of its default (fields that
    default to None are checked by their class). Computed once here, so that validation under
    dynamo reads a plain dict rather than ``dataclasses.fields`` and its MISSING sentinel."""
    cls._field_types = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if default is not None:
            cls._field_types[f.name] = type(default)
    cls._field_names = tuple(f.name for f in dataclasses.fields(cls))
    return cls


def _check_field_types(obj: Any) -> None:
    """Each field must have its expected type; an int field rejects bool, a float field
    accepts int."""
    callables = getattr(type(obj), "_callable_fields", ())
    for name, expected in type(obj)._field_types.items():
        value = getattr(obj, name)
        if name in callables and callable(value):
            continue
        ok = isinstance(value, (int, float) if expected is float else expected)
        if not ok or (expected in (int, float) and isinstance(value, bool)):
            raise ValueError(
                f"{type(obj).__name__}: {name} must be of type {expected.__name__}, got {value!r}"
            )


# Default factories. A shared default instance would do for a frozen value, but dynamo cannot
# wrap an object held in ``__init__.__defaults__`` (nor a functools.partial, nor call the class
# as a factory), so a recipe with one could not be constructed inside a compiled region; a plain
# function can. The per-operand QParams fields (``_no_options``) are not constructor arguments
# (as in TE, where ``__post_init__`` sets them from the recipe's flags).
def _split_accumulation() -> MMParams:
    return MMParams(use_split_accumulator=True)


def _fast_accumulation() -> MMParams:
    return MMParams(use_split_accumulator=False)


def _no_options() -> QParams:
    return QParams()


def _fail(obj: Any, field: str, constraint: str) -> None:
    raise ValueError(f"{type(obj).__name__}: {field} {constraint}, got {getattr(obj, field)!r}")


@_with_field_types
@dataclasses.dataclass(frozen=True)
class QParams:
    """How one tensor role (input, weight, gradient) is quantised.

    ``power_2_scale``: round scales down to a power of two, so scaling is exact in any format.
    ``amax_epsilon``: lower bound on amax (keeps the scale finite for an all-zero tensor).
    ``random_hadamard_transform``, ``stochastic_rounding``, ``fp4_2d_quantization``: NVFP4 only.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_field_types(self)
        if self.amax_epsilon < 0:
            _fail(self, "amax_epsilon", "must be >= 0")
        if not self.amax_epsilon < math.inf:  # inf or NaN
            _fail(self, "amax_epsilon", "must be finite")


@_with_field_types
@dataclasses.dataclass(frozen=True)
class MMParams:
    """GEMM options. ``use_split_accumulator=False`` is Hopper's FP8 "fast accumulation"
    (cuBLASLt ``CUBLASLT_MATMUL_DESC_FAST_ACCUM``): faster, but partial sums lose precision."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self)


@_with_field_types
@dataclasses.dataclass
class Recipe:
    """Base of all recipes; not constructed directly.

    ``kind`` names the recipe in one short string (handy to branch on in traced code)."""

    kind: ClassVar[str]
    # True once construction validated the fields: then ``__setattr__`` validates each assignment.
    _constructed: ClassVar[bool] = False
    # The recipe-level flags that set one option of per-operand QParams fields:
    # flag -> (QParams option, the QParams fields it sets, whether the option is the flag's
    # negation). Applied at construction (TE's ``__post_init__``) and whenever the flag is set.
    _qparam_flags: ClassVar[dict[str, tuple[str, tuple[str, ...], bool]]] = {}
    # ``quantization.gemm``'s specs of a recipe, made at construction and at each field set
    # (eagerly): compiled code reads them from the memo, where they never appear or go.
    derive: ClassVar[Callable[[Recipe], Any] | None] = None

    def __post_init__(self) -> None:
        if type(self) is Recipe:
            raise TypeError(
                "Recipe is a base class: construct DelayedScaling, Float8CurrentScaling, "
                "Float8BlockScaling, MXFP8BlockScaling or NVFP4BlockScaling"
            )
        for flag in type(self)._qparam_flags:
            self._apply_flag(flag)
        self._validate()
        object.__setattr__(self, "_constructed", True)
        self._derive()

    def _derive(self) -> None:
        object.__setattr__(self, "_memo", {})  # a fresh memo (2.11's dynamo: no __dict__.pop)
        if Recipe.derive is not None and not torch.compiler.is_compiling():
            with contextlib.suppress(Exception):  # (an error is raised where it is read)
                self.memo()["specs"] = Recipe.derive(self)

    def _apply_flag(self, flag: str) -> None:
        """Set the option ``flag`` governs in each per-operand QParams it covers."""
        option, operands, negated = type(self)._qparam_flags[flag]
        value = getattr(self, flag)
        if isinstance(value, bool):  # otherwise _validate refuses the flag itself
            for name in operands:
                # dataclasses.replace without dataclasses.fields, which dynamo cannot trace
                q = getattr(self, name)
                values = {n: getattr(q, n) for n in QParams._field_names}
                values[option] = value != negated
                object.__setattr__(self, name, QParams(**values))

    def __setattr__(self, name: str, value: Any) -> None:
        """Set a field after construction, as TE code does (``recipe.margin = 1``): validated
        again, the old value kept when the new one is refused; not a field: ``AttributeError``."""
        if not self._constructed:  # the dataclass __init__
            object.__setattr__(self, name, value)
            return
        if name not in type(self)._field_names:
            raise AttributeError(
                f"{type(self).__name__} has no field {name!r}; its fields are "
                f"{', '.join(type(self)._field_names)}"
            )
        flags = type(self)._qparam_flags
        # The QParams fields a flag sets are restored with it when the new value is refused.
        names = (name, *flags[name][1]) if name in flags else (name,)
        old = [getattr(self, n) for n in names]
        object.__setattr__(self, name, value)
        try:
            if name in flags:
                self._apply_flag(name)
            self._validate()
        except ValueError:
            for n, v in zip(names, old, strict=True):
                object.__setattr__(self, n, v)
            raise
        finally:
            self._derive()

    def memo(self) -> dict[Any, Any]:
        """A dict of values derived from this recipe's fields alone, for eager callers to keep;
        emptied whenever a field is set, but for :attr:`derive`'s ``"specs"``, made again. Not a
        field: not compared, not printed."""
        return self.__dict__.setdefault("_memo", {})

    def _validate(self) -> None:
        _check_field_types(self)
        for name in ("fp8_dpa", "fp8_mha"):
            if getattr(self, name):
                _fail(self, name, "must be False (te_compile has no FP8 attention)")
        if self.backward_override not in _BACKWARD_OVERRIDES:
            _fail(self, "backward_override", f"must be one of {_BACKWARD_OVERRIDES}")
        # NVFP4's fp8_format is its block scales' (its _validate); the others' forward format.
        if self.kind != "nvfp4" and self.fp8_format in (Format.E5M2, Format.E2M1):
            _fail(self, "fp8_format", "must be Format.E4M3 or Format.HYBRID (E4M3 forward)")
        if "margin" in self._field_types and self.margin < 0:
            _fail(self, "margin", "must be >= 0")

    # TE's predicates, class methods: ``recipe.delayed()``, ``recipe.mxfp8()``, ...
    delayed = classmethod(lambda cls: issubclass(cls, DelayedScaling))
    float8_current_scaling = classmethod(lambda cls: issubclass(cls, Float8CurrentScaling))
    float8_current = float8_current_scaling  # the short name
    float8_per_tensor_scaling = classmethod(
        lambda cls: issubclass(cls, (DelayedScaling, Float8CurrentScaling))
    )
    float8_block_scaling = classmethod(lambda cls: issubclass(cls, Float8BlockScaling))
    mxfp8 = classmethod(lambda cls: issubclass(cls, MXFP8BlockScaling))
    nvfp4 = classmethod(lambda cls: issubclass(cls, NVFP4BlockScaling))


@_with_field_types
@dataclasses.dataclass
class DelayedScaling(Recipe):
    """Per-tensor scales from the amax history of past steps.

    ``margin`` (>= 0): the scale is divided by ``2**margin`` for headroom. ``fp8_format``:
    ``E4M3`` or ``HYBRID``. ``amax_history_len`` (>= 1): steps of amax history kept.
    ``amax_compute_algo``: ``"max"`` (largest amax in the history), ``"most_recent"``, or a
    callable; ``scaling_factor_compute_algo``: ``None`` (the scale formula in the module
    docstring) or a callable with TE's signature (both callables' arguments and results:
    ``docs/fp8.md``, "DelayedScaling's callables"). ``reduce_amax``: all-reduce amaxes (MAX)
    over the autocast's ``amax_reduction_group`` so every rank uses the same scales; with
    ``False`` each rank keeps its own. ``backward_override``: ``None`` only, as in TE.
    """

    kind: ClassVar[str] = "delayed"
    _callable_fields: ClassVar[tuple[str, ...]] = (
        "amax_compute_algo",
        "scaling_factor_compute_algo",
    )

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable[[torch.Tensor], torch.Tensor] = "max"
    scaling_factor_compute_algo: Callable[..., torch.Tensor] | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def _validate(self) -> None:
        super()._validate()
        if self.amax_history_len < 1:
            _fail(self, "amax_history_len", "must be >= 1")
        if not (callable(self.amax_compute_algo) or self.amax_compute_algo in _AMAX_COMPUTE_ALGOS):
            _fail(self, "amax_compute_algo", f"must be one of {_AMAX_COMPUTE_ALGOS} or a callable")
        algo = self.scaling_factor_compute_algo
        if algo is not None and not callable(algo):
            _fail(self, "scaling_factor_compute_algo", "must be None or a callable")
        if self.backward_override is not None:
            _fail(
                self,
                "backward_override",
                "must be None for delayed scaling (as in Transformer Engine)",
            )


@_with_field_types
@dataclasses.dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scales from each tensor's own amax, measured just before the cast.

    ``use_power_2_scales``: round scales down to powers of two; it sets ``power_2_scale`` of
    the per-operand ``fp8_quant_*``, which may be replaced one by one after construction (the
    modules' GEMMs refuse power-of-two scales, ``te_compile.quantize`` applies them).
    ``fp8_format``: ``E4M3`` or ``HYBRID``. ``fp8_gemm_*``: split accumulation off forward (the
    only setting implemented there), on for the backward GEMMs by default (TE's), where
    ``MMParams(use_split_accumulator=False)`` runs Hopper's fast FP8 accumulation.
    """

    kind: ClassVar[str] = "current"
    _qparam_flags: ClassVar[dict[str, tuple[str, tuple[str, ...], bool]]] = {
        "use_power_2_scales": ("power_2_scale", FP8_QPARAMS, False),
    }

    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = dataclasses.field(default_factory=_no_options, init=False)
    fp8_quant_fwd_weight: QParams = dataclasses.field(default_factory=_no_options, init=False)
    fp8_quant_bwd_grad: QParams = dataclasses.field(default_factory=_no_options, init=False)
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=_fast_accumulation)
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=_split_accumulation)
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=_split_accumulation)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def _validate(self) -> None:
        super()._validate()
        if self.fp8_gemm_fprop.use_split_accumulator:
            _fail(
                self,
                "fp8_gemm_fprop",
                "must be MMParams(use_split_accumulator=False): te_compile's per-tensor forward "
                "GEMMs run fast accumulation (TE's default)",
            )


@_with_field_types
@dataclasses.dataclass
class Float8BlockScaling(Recipe):
    """FP8 with one fp32 scale per block of ``block_len`` (128) values.

    ``*_block_scaling_dim``: 1 for 1x128 blocks (one row segment), 2 for 128x128 tiles; by default
    activations (``x``) and gradients (``grad``) use 1x128 and weights (``w``) 128x128, which
    Hopper's blockwise-scaled GEMM takes natively. No GEMM may have both operands 2D.
    ``use_f32_scales``: keep scales as any fp32 value; by default they are powers of two. It sets
    ``power_2_scale`` of the per-operand ``fp8_quant_*``, which may be replaced one by one after
    construction (the grouped GEMMs take one setting for all three). ``fp8_gemm_*``: split
    accumulation is required.
    """

    kind: ClassVar[str] = "block"
    block_len: ClassVar[int] = 128
    _qparam_flags: ClassVar[dict[str, tuple[str, tuple[str, ...], bool]]] = {
        "use_f32_scales": ("power_2_scale", FP8_QPARAMS, True),
    }

    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = dataclasses.field(default_factory=_no_options, init=False)
    fp8_quant_fwd_weight: QParams = dataclasses.field(default_factory=_no_options, init=False)
    fp8_quant_bwd_grad: QParams = dataclasses.field(default_factory=_no_options, init=False)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = dataclasses.field(default_factory=_split_accumulation)
    fp8_gemm_dgrad: MMParams = dataclasses.field(default_factory=_split_accumulation)
    fp8_gemm_wgrad: MMParams = dataclasses.field(default_factory=_split_accumulation)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None

    def _validate(self) -> None:
        super()._validate()
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for name in dims:
            if getattr(self, name) not in (1, 2):
                _fail(self, name, "must be 1 (1x128 blocks) or 2 (128x128 blocks)")
        # fprop multiplies x by w, dgrad grad by w, wgrad grad by x: no GEMM of two 2D operands.
        for a, b in ((0, 1), (2, 1), (2, 0)):
            if getattr(self, dims[a]) == 2 and getattr(self, dims[b]) == 2:
                _fail(self, dims[a], f"and {dims[b]} cannot both be 2 (no 2D-by-2D block GEMM)")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, name).use_split_accumulator:
                _fail(self, name, "must use use_split_accumulator=True with block scaling")


@_with_field_types
@dataclasses.dataclass
class MXFP8BlockScaling(Recipe):
    """MXFP8 (OCP microscaling): one E8M0 scale (a power of two) per ``block_len`` (32)
    consecutive values along the GEMM's reduction dimension.

    Rowwise and columnwise blocks differ, so a tensor and its transpose are each quantised from
    the high-precision values. ``enable_2d_quantization``: weights get one scale per 32x32 tile
    instead, so the forward and the dgrad GEMM see the same quantised weight (inputs and
    gradients keep 1x32 blocks). ``fp8_format``: ``E4M3`` or ``HYBRID``. ``margin`` (>= 0) as
    in :class:`DelayedScaling`. Native GEMMs need Blackwell; elsewhere the GEMM is emulated.
    """

    kind: ClassVar[str] = "mxfp8"
    block_len: ClassVar[int] = 32
    scale_dtype: ClassVar[torch.dtype] = torch.float8_e8m0fnu

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    enable_2d_quantization: bool = False


@_with_field_types
@dataclasses.dataclass
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, one E4M3 scale per ``block_len`` (16) values and one fp32 global
    scale per tensor (two levels, since E4M3 alone cannot span a tensor's range).

    TE's default training recipe adds three techniques, each with a switch to turn it off, that
    the emulated GEMMs apply as TE does (``docs/fp8.md``, "NVFP4's recipe options"): 16x16 weight
    tiles (``disable_2d_quantization``; QParams ``fp4_quant_fwd_weight``), the random Hadamard
    transform of the wgrad GEMM's operands (``disable_rht``; ``fp4_quant_fwd_inp``,
    ``fp4_quant_bwd_grad``), stochastic rounding of the gradient (``disable_stochastic_rounding``;
    ``fp4_quant_bwd_grad``). Each switch sets its option in those per-operand QParams, which may
    be replaced one by one after construction (``recipe.fp4_quant_fwd_weight = QParams()``, as
    TE's tests do) within what the GEMMs apply (``quantization.gemm.recipe_specs`` refuses the
    rest).

    ``row_scaled_activation``: one global scale per row of the forward GEMM's input; it needs a
    ``backward_override``, as in TE. ``nvfp4_4over6`` / ``nvfp4_4over6_e4m3_use_256`` (scopes
    ``"none"``, ``"weights"``, ``"activations"``, ``"all"``) and ``nvfp4_4over6_err_mode``
    (``"MAE"``, ``"MSE"``): 4over6 block scaling of the weights and the forward input (each block's
    amax mapped to E2M1's 4 or 6, whichever errs less; gradients never). ``fp4_format`` must be
    ``E2M1`` and ``fp8_format`` (the block scales) ``E4M3``. Native GEMMs need Blackwell;
    elsewhere the GEMM is emulated.
    """

    kind: ClassVar[str] = "nvfp4"
    block_len: ClassVar[int] = 16
    scale_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn
    global_scale_dtype: ClassVar[torch.dtype] = torch.float32
    _qparam_flags: ClassVar[dict[str, tuple[str, tuple[str, ...], bool]]] = {
        "disable_rht": (
            "random_hadamard_transform",
            ("fp4_quant_fwd_inp", "fp4_quant_bwd_grad"),
            True,
        ),
        "disable_stochastic_rounding": ("stochastic_rounding", ("fp4_quant_bwd_grad",), True),
        "disable_2d_quantization": ("fp4_2d_quantization", ("fp4_quant_fwd_weight",), True),
    }

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    fp4_quant_fwd_inp: QParams = dataclasses.field(default_factory=_no_options, init=False)
    fp4_quant_fwd_weight: QParams = dataclasses.field(default_factory=_no_options, init=False)
    fp4_quant_bwd_grad: QParams = dataclasses.field(default_factory=_no_options, init=False)

    def _validate(self) -> None:
        super()._validate()
        if self.fp4_format is not Format.E2M1:
            _fail(self, "fp4_format", "must be Format.E2M1")
        if self.fp8_format is not Format.E4M3:
            _fail(self, "fp8_format", "must be Format.E4M3 (the block-scale format)")
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            if getattr(self, name) not in _NVFP4_4OVER6_SCOPES:
                _fail(self, name, f"must be one of {_NVFP4_4OVER6_SCOPES}")
        if self.nvfp4_4over6_err_mode not in _NVFP4_4OVER6_ERR_MODES:
            _fail(self, "nvfp4_4over6_err_mode", f"must be one of {_NVFP4_4OVER6_ERR_MODES}")


def get_align_size_for_quantization(recipe: Recipe | None) -> int:
    """The row alignment grouped GEMM inputs are padded to under ``recipe`` (Transformer
    Engine's ``quantization.get_align_size_for_quantization``, what ``Fp8Padding`` /
    ``Fp8Unpadding`` use when not given ``align_size``): 32 under MXFP8 (its 32-element
    blocks), 128 under NVFP4 (the 128-row tiles of its swizzled scales and of the Hadamard
    transform's columnwise copy), else 16; ``None`` (no recipe) gives 16."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            "get_align_size_for_quantization: recipe must be a Recipe or None, got "
            f"{type(recipe).__name__}"
        )
    return 16 if recipe is None else {"mxfp8": 32, "nvfp4": 128}.get(recipe.kind, 16)
