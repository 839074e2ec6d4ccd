r"""What the GEMM op families (``linear``, ``mlp``, ``grouped_linear``) share: the recipe kinds,
the one table of operand quantisers and the one table of GEMM calls.

A family op takes the quantisation recipe as one spec string per operand role (``input_spec``,
``weight_spec``, ``grad_spec``: a ``functional.spec.QuantSpec`` each, whose docstring lists what
it holds); ``quantization.gemm.recipe_specs`` makes them from the recipe object and
:func:`check_specs` checks what joins the roles. Inside, each GEMM operand goes through
:data:`QUANTIZERS` (keyed by the spec's kind) and each GEMM through :data:`GEMMS` (keyed by
:func:`gemm_kind`):

==========  ==========================================  ===========================================
kind        operand quantiser                           GEMM (with ``emulate``)
==========  ==========================================  ===========================================
``""``      none (the operands in high precision)       ``"mm"``: ``F.linear`` / ``addmm``
current     per tensor, scale from this tensor's amax   ``"tensorwise"``: ``torch._scaled_mm``
                                                        (``"tensorwise_emulated"``)
delayed     per tensor, the given scale (amax history)  as current
block       1x128 / 128x128 blocks, fp32 scales         ``"blockwise"``: block-scaled
                                                        ``_scaled_mm`` (``"dequantized"``)
mxfp8       32-element blocks, E8M0 scales              ``"dequantized"`` only (native: Blackwell)
nvfp4       16-element E4M3 blocks and a global scale   ``"dequantized"`` only
==========  ==========================================  ===========================================

The grouped family's GEMMs on device offsets are two more entries, ``"grouped_mm"``
(``torch._grouped_mm``, high precision) and ``"scaled_grouped_mm"`` (``torch._scaled_grouped_mm``,
the per-tensor kinds with rowwise scales: their operands come from the current and delayed rows
with ``QuantSpec.row_scaled``). Given host ends instead, :func:`gemm` runs any entry group by
group in those layouts (the grouped family's CPU paths and emulations).

An :class:`Operand` is one GEMM operand quantised along its contraction dim (``data`` ``[M,
K]``, row-major) and, for the backward GEMMs, along the other dim, transposed (``data_t`` ``[K,
M]``): FP8 codes with their inverse scales, or, for an emulated GEMM of a block-scaled kind, the
dequantised fp32 values (exact) with 0-element scales. Rows are padded with zeros to a multiple
of 16 (:func:`pad_rows`). Adding a recipe kind: ``docs/op_mechanism.md``, "Adding a recipe".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import FP8_DTYPES, HIGH_DTYPES, check_choice, check_tensor
from te_compile._numerics import acc_dtype, reciprocal_rn
from te_compile.functional.quantize import (
    as_e4m3,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_current,
    quantize_current_ref,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_tensorwise_ref,
)
from te_compile.functional.quantize_mx import (
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)
from te_compile.functional.quantize_mx_ref import FOUR_OVER_SIX, mxfp8_qdq_tiles, nvfp4_qdq
from te_compile.functional.spec import QuantSpec
from te_compile.kernels import runs_triton

__all__ = [
    "BACKWARD_OVERRIDES",
    "BLOCK_KINDS",
    "FP8_DTYPES",
    "GEMMS",
    "HIGH_DTYPES",
    "PER_TENSOR",
    "QUANTIZERS",
    "Operand",
    "accumulate_wgrad",
    "blockwise_supported",
    "check_specs",
    "empty",
    "fp8_bytes",
    "fp8_codes",
    "gemm",
    "gemm_kind",
    "hp_linear",
    "hp_linear_backward",
    "pad_rows",
    "padded",
    "qdq_both",
    "quantize_operand",
    "quantize_operands",
    "quantize_per_tensor",
    "scale_slots",
    "unpad",
    "wgrad_gemm",
]

PER_TENSOR = ("current", "delayed")
# The backward GEMMs' operands: "" the recipe's quantised ones; "high_precision" the forward's
# high-precision input and weight; "dequantized" the forward's quantised ones, dequantised. The
# gradient is quantised only with "".
BACKWARD_OVERRIDES = ("", "high_precision", "dequantized")
# Block-scaled kinds and the multiple every GEMM dim (tokens included) must be of.
BLOCK_KINDS = {"block": 16, "mxfp8": 32, "nvfp4": 16}
# cuBLAS's blockwise-scaled GEMMs take E4M3 operands only.
_BLOCKWISE_FP8 = torch.float8_e4m3fn


def fp8_bytes(t: Tensor) -> Tensor:
    """FP8 codes cross op boundaries as their bytes (docs/fp8.md); other tensors as they are."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def fp8_codes(t: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return t.view(fp8_dtype) if t.dtype is torch.uint8 else t


def empty(like: Tensor) -> Tensor:
    """A fresh 0-element tensor: an output that is not computed (outputs may not alias)."""
    return like.new_empty(0)


def padded(rows: int) -> int:
    return (rows + 15) // 16 * 16


def pad_rows(t2: Tensor) -> Tensor:
    """``[M, K]`` with zero rows appended up to a multiple of 16 (``_scaled_mm``'s constraint);
    zero rows change neither an amax nor any other row of a GEMM's result."""
    extra = padded(t2.shape[0]) - t2.shape[0]
    return torch.nn.functional.pad(t2, (0, 0, 0, extra)) if extra else t2


def unpad(t2: Tensor, rows: int) -> Tensor:
    """The first ``rows`` rows of a GEMM result computed on padded operands (a copy: an op's
    output may not be a view of a buffer it made bigger)."""
    return t2[:rows].clone() if t2.shape[0] != rows else t2


def scale_slots(scale: Tensor | None, recipe: str, *slots: int) -> tuple[Tensor | None, ...]:
    """The delayed scales of a GEMM's ``slots`` (0 input, 1 weight, 2 gradient) as ``[1]`` views
    of ``scale`` ``[3]`` (``te::delayed_scaling_update``'s copy, never the state buffer, which a
    compiled step may donate), or Nones (every other kind); only those asked for (host time)."""
    return tuple(scale[i : i + 1] if recipe == "delayed" else None for i in slots)


# The NVFP4 options an operand role takes (what each is: ``QuantSpec``'s docstring).
_ROLE_OPTIONS = {"input": ("rht", "row_scaled", "four_over_six"), "weight": ("four_over_six",),
                 "grad": ("rht", "stochastic_rounding")}  # fmt: skip
_OPTIONS = ("rht", "stochastic_rounding", "row_scaled", "four_over_six", "fast_dgrad", "fast_wgrad")


def check_specs(
    p: str,
    specs: dict[str, QuantSpec],
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    rng_state: Tensor | None = None,
    like: Tensor | None = None,
    gemm: str = "",
) -> str:
    """The quantisation specs of a GEMM family op by argument name (``"input_spec"``,
    ``"grad_spec"``; any other a weight's) with a GEMM's delayed-scaling state (``scale{gemm}``
    ``[3]``, ``grad_amax{gemm}`` ``[1]``) and the stochastic-rounding stream (``rng_state``,
    int64 ``[2]`` on ``like``'s device); ``p`` begins the messages. Returns the recipe kind."""
    kind = _check_spec_set(p, tuple(specs.items()))
    g = specs.get("grad_spec")
    if kind == "delayed" and (scale is None or (scale.shape, scale.dtype) != ((3,), torch.float32)):
        raise ValueError(
            p + f'a "delayed" spec needs scale{gemm} [3] float32 (input, weight, grad)'
        )
    if kind != "delayed" and scale is not None:
        raise ValueError(p + f'scale{gemm} is for "delayed" specs only')
    if grad_amax is not None and (grad_amax.shape != (1,) or grad_amax.dtype is not torch.float32):
        raise ValueError(p + f"grad_amax{gemm} must be a [1] float32 tensor")
    if grad_amax is not None and kind not in PER_TENSOR:
        raise ValueError(p + f"grad_amax{gemm} is for the per-tensor kinds (current, delayed)")
    if g is None or not g.stochastic_rounding:
        if rng_state is not None:
            raise ValueError(p + "rng_state is for a grad_spec with 'sr' (stochastic rounding)")
    elif rng_state is None or (
        (rng_state.dtype, rng_state.shape, rng_state.device) != (torch.int64, (2,), like.device)
    ):
        got = "None" if rng_state is None else (
            f"{rng_state.dtype} {list(rng_state.shape)} on {rng_state.device}")  # fmt: skip
        raise ValueError(
            p + "stochastic rounding ('sr') needs rng_state: an int64 tensor [2] = (seed, "
            f"offset) on the input's device ({like.device}), got {got}"
        )
    return kind


@functools.lru_cache(maxsize=1024)
def _check_spec_set(p: str, items: tuple[tuple[str, QuantSpec], ...]) -> str:
    """:func:`check_specs`'s checks of the specs themselves, which depend on nothing else:
    cached (an eager GEMM call pays one look-up). Returns the recipe kind."""
    specs = dict(items)
    first = next(iter(specs.values()))
    kind, emulate = first.kind, first.emulate

    def given() -> str:  # the messages' strings, built only for an error
        return ", ".join(f"{name}={spec.encode()!r}" for name, spec in specs.items())

    for name, spec in specs.items():
        role = {"input_spec": "input", "grad_spec": "grad"}.get(name, "weight")
        at = p + f"{name} {spec.encode()!r}: "  # (cached: built once per spec set)
        if spec.kind != kind or spec.emulate != emulate:
            raise ValueError(p + f"the specs must share one kind and emulate, got {given()}")
        if not kind and spec != first:
            raise ValueError(at + "a high-precision spec ('') takes no other token")
        tiles = {"block": (1, 128), "mxfp8": (1, 32), "nvfp4": (1, 16)}
        rows = tiles.get(kind, (1,)) if role == "weight" else (1,)
        if spec.block_rows not in rows:
            raise ValueError(at + f"blocks of {spec.block_rows} rows are not implemented for "
                             f"{role} operands of {kind!r} (block rows {rows})")  # fmt: skip
        fast = ("fast_dgrad", "fast_wgrad") if role == "grad" and kind in PER_TENSOR else ()
        allowed = _ROLE_OPTIONS[role] if kind == "nvfp4" else fast
        if bad := [o for o in _OPTIONS if getattr(spec, o) and o not in allowed]:
            raise ValueError(at + f"{', '.join(bad)}: not an option of {role} operands" + (
                "" if kind == "nvfp4" else " (NVFP4's options; fast_dgrad / fast_wgrad: a "
                "per-tensor grad_spec's)"))  # fmt: skip
        if spec.four_over_six not in FOUR_OVER_SIX:
            raise ValueError(at + f"4over6 must be one of {FOUR_OVER_SIX[1:]}")
        if kind == "block" and not emulate and spec.fp8_dtype is not _BLOCKWISE_FP8:
            raise ValueError(at + "native blockwise GEMMs take E4M3 operands (add 'emulate' to "
                             "run other formats)")  # fmt: skip
    if kind in ("mxfp8", "nvfp4") and not emulate:
        raise ValueError(p + f"{kind} GEMMs are emulated here (native ones need Blackwell): add "
                         f"'emulate' to the specs, got {given()}")  # fmt: skip
    x, g = specs.get("input_spec"), specs.get("grad_spec")
    if x is not None and g is not None and x.rht != g.rht:
        raise ValueError(p + "rht (the Hadamard transform of the wgrad GEMM's operands) goes on "
                         f"input_spec and grad_spec together, got {given()}")  # fmt: skip
    return kind


def check_gemm_dims(
    p: str, recipe: str, w: QuantSpec, tokens: int | None, gemms: str = "GEMMs", **dims: int
) -> None:
    """``dims`` (two or more features by name) multiples of 16 (per tensor) or of ``recipe``'s
    block, and of 512 with native 128x128 weight blocks; MXFP8's and NVFP4's ``tokens`` too
    (others pad rows; None: the grouped family's, checked per group). ``gemms``: the messages'
    name of the GEMMs."""
    multiple = 16 if recipe in PER_TENSOR else BLOCK_KINDS.get(recipe, 1)
    parts = [f"{name} ({d})" for name, d in dims.items()]
    names = ", ".join(parts[:-1]) + " and " + parts[-1]
    if any(d % multiple for d in dims.values()):
        kind = "FP8" if recipe in PER_TENSOR else recipe  # (delayed calibrates with current)
        raise ValueError(p + f"{kind} {gemms} need {names} to be multiples of {multiple}")
    if recipe in ("mxfp8", "nvfp4") and tokens is not None and tokens % multiple:
        raise ValueError(p + f"{recipe} needs the number of tokens ({tokens}) to be a multiple "
                         f"of {multiple}")  # fmt: skip
    native_128 = recipe == "block" and not w.emulate and w.block_rows == 128
    if native_128 and any(d % 512 for d in dims.values()):
        raise ValueError(p + "native blockwise GEMMs (specs without 'emulate') with 128x128 "
                         f"weight blocks need {names} to be multiples of 512")  # fmt: skip


def blockwise_supported(
    weight: Tensor, weight_block_rows: int, fwd_dtype: torch.dtype, bwd_dtype: torch.dtype
) -> bool:
    """Whether the native blockwise GEMMs take these operands (the device aside): E4M3 in both
    directions (cuBLAS's blockwise kernels take E4M3 only) and, with 128x128 weight blocks, both
    feature counts multiples of 512 (the K / 128 scale dim a multiple of 4: on the H100, torch
    2.11, other widths gave wrong dgrad products and a padded layout was refused)."""
    p = "te.blockwise_supported"
    check_tensor(p, "weight", weight, min_dim=2)
    check_choice(p, "fwd_dtype", fwd_dtype, FP8_DTYPES)
    check_choice(p, "bwd_dtype", bwd_dtype, FP8_DTYPES)
    rows = weight_block_rows  # an int (a SymInt where dynamic shapes trace it), not a bool
    if isinstance(rows, bool) or not isinstance(rows, (int, torch.SymInt)) or rows not in (1, 128):
        raise ValueError(f"{p}: weight_block_rows must be 1 or 128, got {rows!r}")
    return fwd_dtype == bwd_dtype == _BLOCKWISE_FP8 and (
        rows == 1 or (weight.shape[-2] % 512 == 0 and weight.shape[-1] % 512 == 0)
    )


# Operand quantisation: one table, keyed by the recipe kind ------------------------------------


class Operand(NamedTuple):
    """A GEMM operand (module docstring): ``data`` ``[M, K]`` and its inverse ``scale``, ``data_t``
    ``[K, M]`` (0-element without ``columnwise``) and ``scale_t``, ``amax`` ``[1]`` (per-tensor
    kinds; else 0-element), ``sums``: the fp32 column sums (``sums=True``: a bias gradient)."""

    data: Tensor
    scale: Tensor
    data_t: Tensor
    scale_t: Tensor
    amax: Tensor
    sums: Tensor | None = None


def quantize_per_tensor(
    x: Tensor, fp8_dtype: torch.dtype, scale: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(data, scale_inv, amax)`` of a 2-D tensor by the reference quantisers on its fp32
    values (the tests' float64 references: the ops' bytes); ``scale``: None for current scaling
    (Transformer Engine's edge rules), else the ``[1]`` delayed scale."""
    if scale is None:
        data, _, scale_inv, amax = quantize_current_ref(x.float(), fp8_dtype, False)
        return data, scale_inv, amax
    data, _, amax = quantize_tensorwise_ref(x.float(), scale, fp8_dtype, False)
    return data, reciprocal_rn(scale), amax


def qdq_both(
    x2: Tensor, spec: QuantSpec, rng_state: Tensor | None = None, columnwise: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(rowwise, columnwise^T)``: ``x2`` ``[M, K]`` quantised by a block-scaled ``spec`` in
    blocks along K and along M (the latter transposed, ``[K, M]``; None without ``columnwise``,
    but for NVFP4), both dequantised to fp32, where every value is exact (fp64 input, the tests'
    references: quantised from its fp32 values, returned as fp64). NVFP4's options:
    ``functional.quantize_mx_ref.nvfp4_qdq`` (``rng_state``: stochastic rounding)."""
    x = x2.float() if x2.dtype == torch.float64 else x2
    f32, fp8_dtype, rows = torch.float32, spec.fp8_dtype, spec.block_rows
    if spec.kind == "block":  # 1 x 128 (block_rows=1) or 128 x 128 blocks, fp32 scales
        data, s, data_t, s_t = quantize_blockwise.eager(x, fp8_dtype, rows, spec.power_2_scale,
                                                        columnwise)  # fmt: skip
        deq = dequantize_blockwise.eager
        row = deq(data.view(torch.uint8), s, rows, fp8_dtype, f32)
        col_t = deq(data_t.view(torch.uint8), s_t, rows, fp8_dtype, f32) if columnwise else None
    elif spec.kind == "mxfp8" and rows == 32:  # 32x32 tiles: both copies the same values
        row = mxfp8_qdq_tiles(x, fp8_dtype)
        col_t = row.t().contiguous() if columnwise else None
    elif spec.kind == "mxfp8":
        data, scale, data_t, scale_t = quantize_mxfp8(x, fp8_dtype, columnwise=columnwise)
        row = dequantize_mxfp8(data, scale, f32)
        col_t = dequantize_mxfp8(data_t, scale_t, f32) if columnwise else None
    elif rows != 1 or rng_state is not None or spec.options():
        row, col_t = nvfp4_qdq(x, tiles=rows == 16, rng_state=rng_state, **spec.options())
    else:
        data, scale, g, data_t, scale_t = quantize_nvfp4(x)
        row = dequantize_nvfp4(data, scale, g, f32)
        col_t = dequantize_nvfp4(data_t, scale_t, g, f32)
    if x2.dtype == torch.float64:
        return row.double(), None if col_t is None else col_t.double()
    return row, col_t


def _col_sums(x2: Tensor, sums: bool) -> Tensor | None:
    return x2.sum(0, dtype=torch.float32) if sums else None


# Every entry: (spec, x2, scale, columnwise, mn_major, sums, rng_state, slot, e4m3_codes).
def _quantize_per_tensor(spec, x2, scale, columnwise, mn_major, sums, rng_state, slot,
                         e4m3_codes) -> Operand:  # fmt: skip
    """Current (``scale`` None) or delayed scaling, both copies in one pass (one Triton kernel on
    CUDA, the reference elsewhere); ``slot``: the amax buffer's element (:func:`amax_buffer`).
    ``row_scaled``: :func:`_quantize_rows`, or delayed without the kernel this cast, its inverse
    scale repeated per row."""
    fp8_dtype, (bits, i) = spec.fp8_dtype, slot or (None, 0)  # (the kernels' defaults)
    if spec.row_scaled and (scale is None or runs_triton(x2)):
        return _quantize_rows(spec, x2, scale, slot, e4m3_codes)
    if scale is None and slot is None:
        data, data_t, scale_inv, amax = quantize_current.eager(x2, fp8_dtype, columnwise)
    elif scale is None:
        from te_compile.kernels.quantize import quantize_current as cast

        data, data_t, scale_inv, amax = cast(x2, fp8_dtype, columnwise, amax=bits, slot=i)
    elif slot is not None or x2.is_cuda:
        # The cast writes 1 / scale too: no reciprocal kernel in a compiled graph.
        from te_compile.kernels.quantize import quantize_tensorwise as cast

        data, data_t, scale_inv, amax = cast(x2, scale, fp8_dtype, columnwise, amax=bits, slot=i)
    else:
        data, data_t, amax = quantize_tensorwise.eager(x2, scale, fp8_dtype, columnwise)
        scale_inv = reciprocal_rn(scale)
    rows = scale_inv.expand(x2.shape[0]).contiguous() if spec.row_scaled else scale_inv
    return Operand(data, rows, data_t, scale_inv, amax, _col_sums(x2, sums))


def _quantize_rows(spec, x2, scale, slot, e4m3_codes) -> Operand:
    """``row_scaled`` per-tensor kinds (the grouped GEMMs' operands): one inverse scale per row,
    no columnwise copy. Current scaling: each row's own (:func:`quantize_rowwise`), no amax.
    Delayed (a kernel casts): ``scale`` for every row, the amax folded into ``slot``'s buffer
    (else a new ``[1]``) in the same pass. ``e4m3_codes``: E5M2 as E4M3 codes (:func:`as_e4m3`),
    in the same pass."""
    none = x2.new_empty(0, dtype=torch.float32)
    if scale is None:
        data, scale_inv = quantize_rowwise(x2, spec.fp8_dtype, e4m3_codes=e4m3_codes)
        return Operand(data, scale_inv, none, none, none)
    from te_compile.kernels import quantize_rows
    from te_compile.kernels.quantize import amax_bits

    amax, i = slot or (amax_bits(x2), 0)
    data, scale_inv = quantize_rows.quantize_rowwise(
        x2, spec.fp8_dtype, scale=scale, amax=amax, amax_slot=i, e4m3_codes=e4m3_codes
    )
    return Operand(data, scale_inv, none, none, amax)


def _quantize_dequantized(spec, x2, scale, columnwise, mn_major, sums, rng_state, *_) -> Operand:
    """MXFP8, NVFP4 and emulated Float8BlockScaling: the dequantised values (exact)."""
    row, col_t = qdq_both(x2, spec, rng_state, columnwise)
    none = x2.new_empty(0, dtype=torch.float32)
    col_t = none.clone() if col_t is None else col_t
    return Operand(row, none, col_t, none.clone(), none.clone(), _col_sums(x2, sums))


def _quantize_block(spec, x2, scale, columnwise, mn_major, sums, rng_state, *_) -> Operand:
    """Float8BlockScaling: FP8 codes and fp32 block scales (emulated: dequantised); with ``sums``
    on CUDA one kernel for the casts and the column sums (``mn_major``: the GEMM's layout)."""
    if spec.emulate:
        return _quantize_dequantized(spec, x2, scale, columnwise, mn_major, sums, rng_state)
    none = x2.new_empty(0, dtype=torch.float32)
    fp8_dtype, rows, p2 = spec.fp8_dtype, spec.block_rows, spec.power_2_scale
    if sums and x2.is_cuda and rows == 1:
        from te_compile.kernels.quantize import quantize_blockwise_sums

        data, s, data_t, s_t, total = quantize_blockwise_sums(
            x2, fp8_dtype, p2, mn_major=(mn_major, mn_major)
        )
        return Operand(data, s, data_t, s_t, none, total)
    data, s, data_t, s_t = quantize_blockwise.eager(x2, fp8_dtype, rows, p2, True)
    return Operand(data, s, data_t.contiguous(), s_t.contiguous(), none, _col_sums(x2, sums))


QUANTIZERS: dict[str, Callable[..., Operand]] = {
    "current": _quantize_per_tensor,
    "delayed": _quantize_per_tensor,
    "block": _quantize_block,
    "mxfp8": _quantize_dequantized,
    "nvfp4": _quantize_dequantized,
}


def quantize_operand(
    spec: QuantSpec,
    x2: Tensor,
    *,
    scale: Tensor | None = None,
    columnwise: bool = True,
    mn_major: bool = False,
    sums: bool = False,
    rng_state: Tensor | None = None,
    slot: tuple[Tensor, int] | None = None,
    e4m3_codes: bool = False,
) -> Operand:
    """``x2`` ``[M, K]`` as an :class:`Operand` quantised as ``spec`` says (``scale``: the
    ``[1]`` delayed scale; ``mn_major``: 1x128 block scales in the blockwise GEMM's layout where
    a CUDA kernel writes them; ``rng_state``: with the spec's ``stochastic_rounding``; ``slot``:
    a per-tensor kind's element of the GEMM's amax buffer, :func:`amax_buffer`; ``e4m3_codes``:
    a row-scaled E5M2 operand as the grouped GEMM takes it, :func:`_quantize_rows`)."""
    rng_state = rng_state if spec.stochastic_rounding else None
    return QUANTIZERS[spec.kind](spec, x2, scale, columnwise, mn_major, sums, rng_state, slot,
                                 e4m3_codes)  # fmt: skip


def quantize_operands(
    specs: tuple[QuantSpec, QuantSpec],
    x2: tuple[Tensor, Tensor],
    scale: tuple[Tensor | None, Tensor | None],
    slot: tuple[tuple[Tensor, int] | None, tuple[Tensor, int] | None],
    columnwise: tuple[bool, bool] = (True, True),
) -> list[Operand]:
    """:func:`quantize_operand` of two tensors (a GEMM's input and weight, an MLP's weights): two
    per-tensor casts to one format into one amax buffer (CUDA) as one amax launch and one cast
    launch (``kernels.quantize.quantize_pair``), the same bits."""
    (a, b), (s_a, s_b) = specs, slot
    calls = zip(specs, x2, scale, columnwise, slot, strict=True)
    if not (s_a and s_b and s_a[0] is s_b[0] and a.kind == b.kind and a.fp8_dtype is b.fp8_dtype
            and (scale[0] is None) == (scale[1] is None)):  # fmt: skip
        return [quantize_operand(p, t, scale=sc, columnwise=c, slot=i) for p, t, sc, c, i in calls]
    from te_compile.kernels.quantize import quantize_pair

    out = quantize_pair(x2, a.fp8_dtype, columnwise, s_a[0], (s_a[1], s_b[1]), scale)
    return [Operand(data, s_inv, data_t, s_inv, amax) for data, data_t, s_inv, amax in out]


def amax_buffer(
    recipe: str, x2: Tensor, n: int, shared: bool = True
) -> tuple[Tensor | None, list[tuple[Tensor, int] | None]]:
    """The amax output of a GEMM family's call under a per-tensor ``recipe`` on CUDA (and
    ``shared``: no operand pre-quantised with an amax of its own): one zeroed ``[n]`` buffer
    (``kernels.quantize.amax_bits``) and its slots ``(buffer, i)``, one per cast, which fold
    their amaxes into it (one fill, no gather). Elsewhere ``(None, [None] * n)``."""
    if not shared or recipe not in PER_TENSOR or not x2.is_cuda:
        return None, [None] * n
    from te_compile.kernels.quantize import amax_bits

    bits = amax_bits(x2, n)
    return bits, [(bits, i) for i in range(n)]


def grad_amax_slots(
    recipe: str, x2: Tensor, *grad_amax: Tensor | None
) -> list[tuple[Tensor, int] | None]:
    """``slot=`` of a backward's gradient casts, one per ``grad_amax``: on CUDA under a per-tensor
    ``recipe`` that buffer itself (a new one for None), zeroed; else None (the caller copies)."""
    if recipe not in PER_TENSOR or not x2.is_cuda:
        return [None] * len(grad_amax)
    from te_compile.kernels.quantize import zero_amaxes

    outs = [x2.new_empty(1, dtype=torch.float32) if a is None else a for a in grad_amax]
    zero_amaxes(*outs)
    return [(a, 0) for a in outs]


# GEMMs: one table, keyed by gemm_kind(recipe, emulate) ----------------------------------------


def _row_major(t: Tensor) -> Tensor:
    """``t`` when its rows are contiguous and 16-byte aligned (a leading dimension is fine),
    else a contiguous copy."""
    from te_compile.kernels import aligned16

    return t if t.stride(-1) == 1 and aligned16(t) else t.contiguous()


def block_scaled_mm(
    a: Tensor,
    sa: Tensor,
    b: Tensor,
    sb: Tensor,
    b_rows: int,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``dequant(a) @ dequant(b)^T``: ``a`` ``[M, K]`` in 1x128 blocks along K, ``b`` ``[N, K]``
    in ``b_rows`` x 128 blocks (compact fp32 scale layout of ``quantize_blockwise``, or for 1x128
    scales already outer-dim-major). CUDA: one blockwise-scaled ``torch._scaled_mm`` (its
    layouts: 1x128 scales outer-dim-major, 128x128 scales as ``[K/128, N/128]``, ``mat2``
    column-major). Elsewhere: dequantised in fp32 (exact) and multiplied in fp32. ``bias`` is
    added before the one rounding to ``out_dtype`` (in the GEMM's epilogue on CUDA). ``out``: a
    contiguous ``[M, N]`` tensor of ``out_dtype`` to write the result into (returned)."""
    if a.device.type != "cuda":
        deq = dequantize_blockwise.eager
        u8, f32 = torch.uint8, torch.float32
        a32 = deq(a.contiguous().view(u8), sa.contiguous(), 1, a.dtype, f32)
        b32 = deq(b.contiguous().view(u8), sb.contiguous(), b_rows, b.dtype, f32)
        res = torch.nn.functional.linear(a32, b32, None if bias is None else bias.float())
        return res.to(out_dtype) if out is None else out.copy_(res)
    scale_a = sa.t().contiguous().t()
    scale_b = sb.t().contiguous() if b_rows == 1 else sb.t()
    # Row-major operands with a leading dimension (column slices of a wider matrix) go in as
    # they are; cuBLAS reads the leading dimension.
    mat1, mat2 = _row_major(a), _row_major(b).t()
    into = {} if out is None else {"out": out}
    if bias is not None and out_dtype is torch.float32:
        # cuBLAS's blockwise kernels take a bias only for a 16-bit output (torch 2.11); decided
        # here, not on the refusal below: under torch.compile the call is traced, not run. The
        # fp32 sum after the GEMM is the epilogue's.
        res = torch._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=out_dtype, **into)
        return res.add_(bias)
    try:  # the bias in cuBLAS's epilogue, where the blockwise kernels take one
        return torch._scaled_mm(mat1, mat2, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                                **into)  # fmt: skip
    except RuntimeError:
        if bias is None and mat1.is_contiguous() and mat2.t().is_contiguous():
            raise
    # Refused: the bias after an fp32 GEMM, contiguous operands.
    mat1, mat2 = a.contiguous(), b.contiguous().t()
    if bias is None:
        return torch._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=out_dtype, **into)
    res = torch._scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype=torch.float32) + bias.float()
    return res.to(out_dtype) if out is None else out.copy_(res)


# Every entry computes ``a @ b.T (+ bias)``: ``a`` [M, K] and ``b`` [N, K] row-major operands of
# the kind (their inverse scales ``sa`` / ``sb``), the result rounded once to ``out_dtype``. The
# grouped entries take ``offs``, the int32 ends of the groups on the device (None for the others):
# ``a`` [M, K] grouped by rows against ``b`` [G, N, K] (forward, dgrad), or ``a`` [N, M] and
# ``b`` [K, M] grouped along M (a wgrad: [G, N, K]); their bias is None (the grouped family adds
# each group's by rows).
def _mm(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs) -> Tensor:
    """High precision (or the caller's fp32 accumulation type on the CPU): cuBLAS through
    ``F.linear``, the bias in the GEMM's epilogue."""
    return torch.nn.functional.linear(a, b, bias)


def _tensorwise(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs) -> Tensor:
    """``torch._scaled_mm`` of the FP8 operands (``b.t()``: column-major, as it wants its second;
    ``sa`` / ``sb`` ``[1]`` fp32 inverse scales); it takes a bias only for a 16-bit output, so
    an fp32 one adds it after (the same sum). ``fast_accum``: Hopper's FP8 accumulation without
    periodic promotion (TE's default for the forward GEMM). Off CUDA it is
    :func:`_tensorwise_emulated`: torch's CPU FP8 GEMM is a reference loop, some hundred times
    slower than the fp32 GEMM of the same (exact) values, and the grouped family's CPU GEMMs
    are that emulation already."""
    if a.device.type != "cuda":
        return _tensorwise_emulated(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, None)
    kw = {"scale_a": sa, "scale_b": sb, "out_dtype": out_dtype, "use_fast_accum": fast_accum}
    if bias is not None and out_dtype is torch.float32:
        return torch._scaled_mm(a, b.t(), **kw).add_(bias)
    return torch._scaled_mm(a, b.t(), bias=bias, **kw)


def _tensorwise_emulated(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs) -> Tensor:
    """The per-tensor GEMM as an fp32 GEMM of the exact FP8 values with the scales applied
    after: the same quantisation, no FP8 tensor-core arithmetic (separates the GEMM's
    arithmetic from the quantisation in a training run)."""
    out = (a.float() @ b.float().t()) * (sa * sb)
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _blockwise(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs) -> Tensor:
    return block_scaled_mm(a, sa, b, sb, b_rows, out_dtype, bias)


def _dequantized(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs) -> Tensor:
    """Emulation of a block-scaled GEMM: the dequantised (exact) operands multiplied in fp32 (or
    fp64, the tests' references), the bias added before the one rounding."""
    b_ = None if bias is None else bias.to(a.dtype)
    return torch.nn.functional.linear(a, b, b_).to(out_dtype)


def _balanced(sa: Tensor, sb: Tensor) -> tuple[Tensor, Tensor]:
    """``(sa * 2**-s, sb * 2**s)``: the same products ``sa[i] * sb[j]``, the largest exponents of
    the two evened out (``docs/fp8.md``), from the bits of the positive fp32 scales. No host sync.
    On CUDA, up to 64k scales: one Triton launch of one program for these torch ops; more: the
    torch ops (their reductions and products over every SM, fused by Inductor; the one program
    loops: about 160 us a call at 64 experts x 2816 rows)."""
    if sa.is_cuda and sa.numel() + sb.numel() <= 1 << 16:
        from te_compile.kernels import quantize_rows

        return quantize_rows.balance_scales(sa.contiguous(), sb.contiguous())

    def exponent(t: Tensor) -> Tensor:  # biased, of the largest (0 for none)
        if not t.numel():
            return t.new_zeros((), dtype=torch.int32)
        return (t.amax().view(torch.int32) >> 23) & 0xFF

    s = torch.div(exponent(sa) - exponent(sb), 2, rounding_mode="floor").clamp(-126, 126)
    return sa * ((127 - s) << 23).view(torch.float32), sb * ((127 + s) << 23).view(torch.float32)


def _no_grouped_bias(bias: Tensor | None) -> None:
    if bias is not None:  # (a per-group bias needs the groups' rows: the family adds it)
        raise ValueError("functional.gemm: the grouped GEMM entries take no bias")


def _grouped_mm(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs) -> Tensor:
    """High precision, grouped: ``torch._grouped_mm``, its operands' dtype out (it refuses an
    fp32 ``out_dtype``, eager and meta)."""
    _no_grouped_bias(bias)
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)


def _scaled_grouped_mm(a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, offs) -> Tensor:
    """The per-tensor kinds, grouped, rowwise scaled: ``sa`` one inverse scale per row of ``a``
    and ``sb`` one per (group, row of ``b``) (``[G, N]``; a wgrad's ``sa`` ``[G, N]`` too), the
    operands as E4M3 codes (:func:`as_e4m3`). CUDA: ``torch._scaled_grouped_mm`` with the scales
    balanced (:func:`_balanced`). Elsewhere (tests of this path): the bf16 grouped GEMM of the
    same FP8 values, the scales multiplied together first, then applied in fp32."""
    _no_grouped_bias(bias)
    a, sa = as_e4m3(a, sa)
    b, sb = as_e4m3(b, sb)
    if a.is_cuda:
        if b.dim() == 2:  # a wgrad: both operands' scales per (group, row), flat
            sa, sb = sa.reshape(-1), sb.reshape(-1)
        sa, sb = _balanced(sa, sb)
        return torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=offs,
                                        out_dtype=out_dtype, use_fast_accum=fast_accum)  # fmt: skip
    bf16 = torch.bfloat16
    acc = torch._grouped_mm(a.to(bf16), b.to(bf16).transpose(-2, -1), offs=offs).float()
    if b.dim() == 2:
        return (acc * (sa[:, :, None] * sb[:, None, :])).to(out_dtype)
    splits = torch.diff(offs, prepend=offs.new_zeros(1))
    col = torch.repeat_interleave(sb, splits, dim=0, output_size=a.shape[0])
    return (acc * (sa[:, None] * col)).to(out_dtype)


GEMMS: dict[str, Callable[..., Tensor]] = {
    "mm": _mm,
    "tensorwise": _tensorwise,
    "tensorwise_emulated": _tensorwise_emulated,
    "blockwise": _blockwise,
    "dequantized": _dequantized,
    "grouped_mm": _grouped_mm,
    "scaled_grouped_mm": _scaled_grouped_mm,
}


def gemm_kind(recipe: str, emulate: bool) -> str:
    """The :data:`GEMMS` entry of a recipe kind."""
    if not recipe:
        return "mm"
    if recipe in PER_TENSOR:
        return "tensorwise_emulated" if emulate else "tensorwise"
    return "dequantized" if emulate else "blockwise"


def gemm(
    kind: str,
    a: Tensor,
    sa: Tensor | None,
    b: Tensor,
    sb: Tensor | None,
    out_dtype: torch.dtype,
    *,
    bias: Tensor | None = None,
    fast_accum: bool = False,
    b_block_rows: int = 1,
    offs: Tensor | list[int] | None = None,
) -> Tensor:
    """``a @ b.T (+ bias)`` through the :data:`GEMMS` entry ``kind`` (see the table; ``offs``:
    the grouped entries' group ends on the device, or host ends (a list): any entry run group by
    group, :func:`_per_group`)."""
    if isinstance(offs, list):
        return _per_group(GEMMS[kind], a, sa, b, sb, out_dtype, bias, fast_accum, b_block_rows,
                          offs)  # fmt: skip
    return GEMMS[kind](a, sa, b, sb, out_dtype, bias, fast_accum, b_block_rows, offs)


def _per_group(entry, a, sa, b, sb, out_dtype, bias, fast_accum, b_rows, ends: list[int]):
    """An entry group by group in the grouped entries' layouts on host ``ends``: ``a``'s rows of
    group ``g`` against ``b[g]`` (``sa`` per row, ``sb`` / ``bias`` per group), or with a 2-D
    ``b`` both operands' columns of group ``g`` (a wgrad; ``sa`` / ``sb`` per group). The
    emulated block-scaled kinds' 0-element scales pass as they are (a row slice of one too)."""
    wgrad = b.dim() == 2
    shape = (len(ends), a.shape[0], b.shape[0]) if wgrad else (a.shape[0], b.shape[1])
    out = a.new_empty(shape, dtype=out_dtype)
    for g, span in enumerate(map(slice, [0, *ends[:-1]], ends)):
        part = (slice(None), span) if wgrad else span
        s_a = sa if sa is None or (wgrad and sa.dim() < 2) else sa[g if wgrad else span][:, None]
        s_b = sb[g] if sb is not None and sb.dim() > 1 else sb
        out[g if wgrad else span] = entry(a[part], s_a, b[part] if wgrad else b[g], s_b, out_dtype,
                                          None if bias is None else bias[g], fast_accum, b_rows,
                                          None)  # fmt: skip
    return out


def hp_linear(inp: Tensor, weight: Tensor, bias: Tensor | None, cuda: bool) -> Tensor:
    """``inp @ weight.T + bias`` in high precision: on CUDA cuBLAS in the input dtype (the bias
    in its epilogue); elsewhere (the definition of correctness) ``acc_dtype`` math, rounded once."""
    if cuda:
        return torch.nn.functional.linear(inp, weight, bias)
    acc = acc_dtype(inp)
    b = None if bias is None else bias.to(acc)
    return torch.nn.functional.linear(inp.to(acc), weight.to(acc), b).to(inp.dtype)


def hp_linear_backward(grad, inp, weight, main_grad, need_dbias, need_dgrad, need_wgrad,
                       cuda: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(dinp, dweight, dbias)`` of :func:`hp_linear` (0-element where not asked for, or where
    ``main_grad`` took it), computed as :func:`hp_linear` computes, each rounded once."""
    dtype = grad.dtype
    acc = None if cuda else acc_dtype(grad)
    dy = grad.reshape(-1, grad.shape[-1])
    dinp = dweight = dbias = None  # 0-element where not computed: made at the end, not before
    if need_dgrad:
        dinp = (grad.to(acc) @ weight.to(acc)).to(dtype) if acc else grad @ weight
    if need_wgrad:
        x = inp.reshape(-1, inp.shape[-1])
        if main_grad is not None:
            accumulate_wgrad(main_grad, dy, x)
        else:
            dweight = (dy.t().to(acc) @ x.to(acc)).to(dtype) if acc else dy.t() @ x
    if need_dbias:
        dbias = dy.sum(0, dtype=acc).to(dtype) if acc else dy.sum(0)
    return tuple(empty(grad) if t is None else t for t in (dinp, dweight, dbias))


def wgrad_gemm(kind, a, sa, b, sb, out_dtype, main_grad: Tensor | None, fast=False,
               offs: list[int] | None = None) -> Tensor:  # fmt: skip
    """A quantised recipe's weight gradient ``a @ b.T``; with ``main_grad`` (fp32) added into it
    (an fp32 GEMM output but for the blockwise kind) and a 0-element tensor returned.
    ``fast``: the grad spec's ``fast_wgrad``; ``offs``: :func:`gemm`'s host ends."""
    if main_grad is None:
        return gemm(kind, a, sa, b, sb, out_dtype, fast_accum=fast, offs=offs)
    out = out_dtype if kind == "blockwise" else torch.float32
    main_grad.add_(gemm(kind, a, sa, b, sb, out, fast_accum=fast, offs=offs))
    return main_grad.new_empty(0, dtype=out_dtype)


def accumulate_wgrad(main_grad: Tensor, dy: Tensor, x: Tensor) -> None:
    """``main_grad += dy^T x`` for high-precision operands, accumulated in fp32: one cuBLAS call
    with fp32 output and beta=1 on CUDA."""
    if main_grad.is_cuda and dy.dtype != torch.float32 and torch._C._len_torch_dispatch_stack():
        # Traced (torch.compile): torch 2.11's decomposition of addmm's out_dtype overload
        # reads out_dtype as beta; the GEMM with an fp32 output, then the add.
        main_grad.add_(torch.mm(dy.t(), x, out_dtype=torch.float32))
    elif main_grad.is_cuda and dy.dtype != torch.float32:
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(dy.t().float(), x.float())
