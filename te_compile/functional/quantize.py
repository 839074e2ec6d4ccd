r"""FP8 quantisation: per-tensor (delayed and current scaling) and blockwise (1x128, 128x128).

Ops ``te::quantize_tensorwise``, ``te::quantize_current``, ``te::quantize_blockwise``,
``te::dequantize_tensorwise``, ``te::dequantize_blockwise``: plain, non-differentiable ops, for
the FP8 GEMM ops to call inside their own forward and backward. The input ``x`` of shape
``[..., K]`` is viewed as ``[M, K]``, every leading index flattened into ``M``. With
:math:`F` the largest finite value of the FP8 format (448 for ``torch.float8_e4m3fn``, 57344 for
``torch.float8_e5m2``) and all math in fp32:

.. math::
    q = \operatorname{fp8}\big(\operatorname{clamp}(x\,s,\,-F,\,F)\big), \qquad
    x \approx q \cdot s^{-1}, \qquad
    s(a) = \frac{F}{\max(a, \varepsilon)}

rounded to nearest even. The scale rule is Transformer Engine's ``compute_scale_from_amax``
(:func:`scale_from_amax`): ``s = 1`` where the (epsilon-clamped) amax is 0 (an all-zero
tensor or block: no NaN, no inf) or :math:`\infty`; an fp32 overflow of :math:`F/a` becomes
``FLT_MAX``; ``power_2_scale`` rounds ``s`` down to a power of two (then ``scale_inv`` is exact
and dequantisation loses nothing to it).

Recipes:

* **delayed scaling** (``quantize_tensorwise``): the scale is given (a 1-element fp32 tensor,
  from the amax history); one read of ``x`` casts it and measures its amax for the history.
* **current scaling** (``quantize_current``): the scale comes from this tensor's own amax.
  Every element's cast needs the *global* amax, which is known only after all of ``x`` has
  been read, so it takes two reads: an amax reduction kernel, then the cast kernel.
* **blockwise** (``quantize_blockwise``, Transformer Engine's ``Float8BlockScaling``): one
  scale per block of ``block_rows x 128`` elements of ``[M, K]``: 1x128 (``block_rows=1``,
  activations and gradients) or 128x128 (``block_rows=128``, weights). Block amaxes are
  reduced in registers; one read of ``x``.

Layouts (all outputs are fresh, contiguous tensors):

* ``data``: ``x``'s shape, FP8.
* ``data_t`` (``columnwise=True``, what the backward GEMMs read): ``[K, M]``, the transposed
  copy of the ``[M, K]`` view, written in the same pass as ``data``. Per-tensor scaling shares
  the scale. Blockwise 1x128 quantises :math:`x^T` with its *own* 1x128 blocks, which run along
  ``M``; 128x128 blocks of :math:`x^T` are the transposed blocks of ``x``, so there ``data_t``
  is ``data``'s ``[M, K]`` view transposed and ``scale_inv_t`` is ``scale_inv`` transposed.
  Without ``columnwise``, ``data_t`` and ``scale_inv_t`` are 0-element tensors (a schema
  cannot return an optional tensor).
* ``scale_inv`` (:math:`1/s`, what a scaled GEMM and dequantisation multiply by): per tensor
  ``[1]`` fp32; blockwise ``[ceil(M / block_rows), ceil(K / 128)]`` fp32, row-major, entry
  ``[i, j]`` for rows ``i*block_rows ...`` and columns ``j*128 ...``; ``scale_inv_t`` is
  ``[ceil(K / block_rows), ceil(M / 128)]`` for :math:`x^T` likewise. This is the compact
  layout. Transformer Engine's GEMM-ready layout differs (it stores 1x128 scales M-major,
  ``[ceil(K / 128), M]`` with ``M`` padded to a multiple of 4, and pads 128x128 scale rows to
  a multiple of 4), and ``torch._scaled_mm``'s blockwise modes have their own; converting to
  them belongs to the GEMM integration.
* ``amax``: ``[1]`` fp32, :math:`\max|x|` (blockwise ops do not return one).

The quantise ops return FP8 tensors; the dequantise *ops* take FP8 data as its uint8 bytes plus
its ``fp8_dtype`` (``docs/fp8.md``, "FP8 data crosses op boundaries as bytes").

Edge semantics: per tensor, an inf or NaN in ``x`` propagates to ``amax`` (inf or NaN: the
caller reports it, as Transformer Engine's recipes do: ``te.non_finite_amaxes``); finite
overflow, and inf, saturate to :math:`\pm F`; NaN stays NaN. Dequantisation saturates at the
output format's largest finite value (a power-of-two scale can put a code rounded up one ulp
past it, see ``_saturated``). Under current scaling an inf amax
gives ``s = 1`` (the rest of the tensor is cast unscaled, saturating), and a NaN amax gives a
NaN scale. Blockwise ops return no amax for a caller to report, so a block holding inf or NaN
gets a NaN scale (its codes and ``scale_inv`` are NaN): the whole block dequantises to NaN and
the GEMMs that read it give NaN, as MXFP8 and NVFP4 blocks do (``quantize_mx``), where
Transformer Engine saturates the inf to :math:`\pm F` and nothing reports it.

Shapes: quantisation works for any ``K`` (and ``M``, including 0); only an FP8 *GEMM* needs its
operand dims to be multiples of 16, and the GEMM families check that
(``functional.gemm.check_gemm_dims``).

Implementations: on CPU the reference math below (``*_ref``); on CUDA the Triton kernels of
``te_compile.kernels.quantize``, bit-identical to it (the kernel tests check it, under the
interpreter on CPU). Input dtypes: fp32, bf16, fp16; ``out_dtype`` of dequantisation likewise.

Public functions over these ops and ``quantize_mx``'s (``te.quantize`` / ``te.dequantize``, one
table per direction keyed by the recipe kind): ``functional.quantize_table``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from te_compile._checks import FP8_DTYPES, HIGH_DTYPES
from te_compile._library import op
from te_compile._numerics import div_rn, reciprocal_rn
from te_compile.functional import quantize_mx_ref
from te_compile.kernels import e5m2_to_e4m3_table, runs_triton, submodule

__all__ = [
    "FP8_DTYPES",
    "as_e4m3",
    "dequantize_blockwise_ref",
    "dequantize_tensorwise_ref",
    "quantize_blockwise_ref",
    "quantize_current_ref",
    "quantize_rowwise",
    "quantize_tensorwise_ref",
    "scale_from_amax",
]

BLOCK = 128  # elements of a quantisation block along the last dim
_FLT_MAX = torch.finfo(torch.float32).max


# 1. Reference math --------------------------------------------------------------------------


def _rows(t: Tensor) -> Tensor:
    """``[..., K]`` as fp32 ``[M, K]`` (``M`` may be 0, so not ``reshape(-1, K)``)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).float()


def scale_from_amax(
    amax: Tensor, fp8_max: float, amax_epsilon: float = 0.0, power_2_scale: bool = False
) -> Tensor:
    """Transformer Engine's ``compute_scale_from_amax``, elementwise on fp32 ``amax``:
    ``fp8_max / max(amax, amax_epsilon)``; 1 where that is a division by 0 or by inf; ``FLT_MAX``
    where it overflows; rounded down to a power of two with ``power_2_scale``; NaN for NaN.
    ``fp8_max`` (the format's largest finite value) must be finite and > 0."""
    if not 0 < fp8_max < math.inf:
        raise ValueError(f"te.scale_from_amax: fp8_max must be finite and > 0, got {fp8_max}")
    amax = amax.float()
    eps = torch.full((), amax_epsilon, dtype=torch.float32, device=amax.device)
    amax = torch.where(amax < eps, eps, amax)  # not clamp_min: a NaN amax stays NaN
    scale = div_rn(fp8_max, amax)
    scale = torch.where(torch.isinf(scale), _FLT_MAX, scale)
    if power_2_scale:
        # Keep sign and exponent (0xFF800000): 2^floor(log2 s) for every finite s > 0.
        pow2 = (scale.view(torch.int32) & -8388608).view(torch.float32)
        scale = torch.where(torch.isnan(scale), scale, pow2)
    return torch.where((amax == 0) | torch.isinf(amax), 1.0, scale)


def _cast(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    fp8_max = torch.finfo(fp8_dtype).max
    return (x * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def _transpose(t: Tensor) -> Tensor:
    """A new contiguous transposed copy; not ``.t().contiguous()``, which returns ``t`` itself
    (an alias of another output) when a dim is 1."""
    return t.t().clone(memory_format=torch.contiguous_format)


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    """An output that is not computed: a fresh 0-element tensor."""
    return like.new_empty(0, dtype=dtype)


def quantize_tensorwise_ref(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(data, data_t, amax)`` with the given scale (delayed scaling)."""
    x2 = _rows(x)
    q = _cast(x2, scale.reshape(()).float(), fp8_dtype)
    data_t = _transpose(q) if columnwise else _empty(x, fp8_dtype)
    return q.view(x.shape), data_t, quantize_mx_ref.tensor_amax(x2).reshape(1)


def quantize_current_ref(
    x: Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, data_t, scale_inv, amax)`` with the scale from ``x``'s own amax."""
    x2 = _rows(x)
    amax = quantize_mx_ref.tensor_amax(x2).reshape(1)
    scale = scale_from_amax(amax, torch.finfo(fp8_dtype).max, amax_epsilon, power_2_scale)
    q = _cast(x2, scale, fp8_dtype)
    data_t = _transpose(q) if columnwise else _empty(x, fp8_dtype)
    return q.view(x.shape), data_t, reciprocal_rn(scale), amax


def _block_cast(
    x2: Tensor, fp8_dtype: torch.dtype, block_rows: int, power_2_scale: bool
) -> tuple[Tensor, Tensor]:
    """fp32 ``[M, K]`` in ``block_rows x 128`` blocks: ``(q [M, K], scale_inv [Mb, Kb])``."""
    m, k = x2.shape
    mb, kb = _scale_shape(m, k, block_rows)
    # Zero padding to whole blocks: it never raises a block's amax.
    blocks = F.pad(x2, (0, kb * BLOCK - k, 0, mb * block_rows - m)).view(mb, block_rows, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = scale_from_amax(amax, torch.finfo(fp8_dtype).max, 0.0, power_2_scale)
    # A block holding inf gets a NaN scale, as one holding NaN does (module docstring).
    scale = torch.where(torch.isinf(amax), math.nan, scale)
    q = _cast(x2.contiguous(), _per_element(scale, m, k, block_rows), fp8_dtype)
    return q, reciprocal_rn(scale)


def _per_element(scale: Tensor, m: int, k: int, block_rows: int) -> Tensor:
    """The ``[Mb, Kb]`` block scales spread over the ``[M, K]`` elements (not a broadcast over
    a padded, blocked view: :func:`quantize_mx_ref.spread_blocks` says why)."""
    spread = quantize_mx_ref.spread_blocks
    return spread(spread(scale, 0, m, block_rows), 1, k, BLOCK)


def quantize_blockwise_ref(
    x: Tensor, fp8_dtype: torch.dtype, block_rows: int, power_2_scale: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale_inv, data_t, scale_inv_t)``; layouts in the module docstring."""
    x2 = _rows(x)
    q, scale_inv = _block_cast(x2, fp8_dtype, block_rows, power_2_scale)
    if not columnwise:
        data_t, scale_inv_t = _empty(x, fp8_dtype), _empty(x, torch.float32)
    elif block_rows == 1:
        data_t, scale_inv_t = _block_cast(x2.t(), fp8_dtype, 1, power_2_scale)
    else:
        data_t, scale_inv_t = _transpose(q), _transpose(scale_inv)
    return q.view(x.shape), scale_inv, data_t, scale_inv_t


def _saturated(q: Tensor, y: Tensor, out_dtype: torch.dtype) -> Tensor:
    """fp32 ``y = q * scale_inv`` rounded to ``out_dtype``, saturating at its largest finite
    value where the code ``q`` is finite (an E5M2 infinity stays infinite, NaN stays NaN).
    Power-of-two scales can make a code rounded up to the next power of two dequantise
    one ulp past the source format's max: ``FLT_MAX * 2**-120`` rounds to E4M3 256, and
    ``256 * 2**120 = 2**128`` is fp32 inf (fp16 65504 likewise gives 65536); saturated, it is
    the format's max, off by less than the quantisation error."""
    big = torch.finfo(out_dtype).max
    return torch.where(q.isinf(), y, y.clamp(-big, big)).to(out_dtype)


def dequantize_tensorwise_ref(data: Tensor, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``fp32(data) * scale_inv`` rounded to ``out_dtype``, saturating."""
    q = data.float()
    return _saturated(q, q * scale_inv.reshape(()).float(), out_dtype)


def dequantize_blockwise_ref(
    data: Tensor, scale_inv: Tensor, block_rows: int, out_dtype: torch.dtype
) -> Tensor:
    """``fp32(data) * scale_inv`` of each ``block_rows x 128`` block, rounded to ``out_dtype``,
    saturating."""
    q = _rows(data).contiguous()  # (fp32: _rows casts)
    out = q * _per_element(scale_inv.float(), *q.shape, block_rows)
    return _saturated(q, out, out_dtype).view(data.shape)


# Argument checks: the same ValueError in eager (implementations) and at trace time (fakes).


def _check_x(name: str, x: Tensor, fp8_dtype: torch.dtype) -> None:
    check_high_dtype(name, "x.dtype", x.dtype)
    if x.dim() < 1:
        raise ValueError(f"te.{name}: x must have at least 1 dim (K), got a 0-dim tensor")
    check_fp8_dtype(name, fp8_dtype)


def check_high_dtype(name: str, arg: str, dtype: torch.dtype) -> None:
    """fp32, bf16 or fp16 (the quantise ops' inputs, the dequantise ops' outputs; also MX's)."""
    if dtype not in HIGH_DTYPES:
        raise ValueError(
            f"te.{name}: {arg} must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
        )


def check_fp8_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"te.{name}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}"
        )


def _check_per_tensor_scale(name: str, arg: str, scale: Tensor, x: Tensor) -> None:
    torch._check_value(
        scale.numel() == 1 and scale.dtype == torch.float32,
        lambda: (
            f"te.{name}: {arg} must be a 1-element torch.float32 tensor, got shape "
            f"{list(scale.shape)} and dtype {scale.dtype}"
        ),
    )
    if scale.device != x.device:
        raise ValueError(
            f"te.{name}: {arg} must be on the input's device ({x.device}), got {scale.device}"
        )


def _check_block_rows(name: str, block_rows: int) -> None:
    if block_rows not in (1, BLOCK):
        raise ValueError(
            f"te.{name}: block_rows must be 1 (1x128 blocks) or 128 (128x128 blocks), "
            f"got {block_rows}"
        )


def _check_quantize_current(name: str, x: Tensor, fp8_dtype: torch.dtype, eps: float) -> None:
    _check_x(name, x, fp8_dtype)
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"te.{name}: amax_epsilon must be finite and >= 0, got {eps}")


def check_dequantize(
    name: str, data: Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    """A dequantise op's FP8 bytes and dtypes (this module's and ``quantize_mx``'s MXFP8)."""
    if data.dtype != torch.uint8 or data.dim() < 1:
        raise ValueError(
            f"te.{name}: data must be the uint8 bytes of the fp8 data "
            f"(data.view(torch.uint8)) with at least 1 dim, got {data.dtype} of shape "
            f"{list(data.shape)}"
        )
    check_fp8_dtype(name, fp8_dtype)
    check_high_dtype(name, "out_dtype", out_dtype)


def _scale_shape(m: int, k: int, block_rows: int) -> tuple[int, int]:
    """``[ceil(M / block_rows), ceil(K / 128)]``: the block scales of ``[M, K]`` data."""
    return (m + block_rows - 1) // block_rows, (k + BLOCK - 1) // BLOCK


def _check_block_scale_inv(name: str, data: Tensor, scale_inv: Tensor, block_rows: int) -> None:
    _check_block_rows(name, block_rows)
    m, k = math.prod(data.shape[:-1]), data.shape[-1]
    if scale_inv.dtype != torch.float32 or scale_inv.dim() != 2:
        raise ValueError(
            f"te.{name}: scale_inv must be a 2-dim torch.float32 tensor, got shape "
            f"{list(scale_inv.shape)} and dtype {scale_inv.dtype}"
        )
    expected = _scale_shape(m, k, block_rows)
    for d in range(2):
        torch._check_value(
            scale_inv.shape[d] == expected[d],
            lambda: (
                f"te.{name}: scale_inv must have shape [ceil(M / {block_rows}), ceil(K / 128)] "
                f"= {list(expected)} for data of shape {list(data.shape)} (M = {m}, K = {k}), "
                f"got {list(scale_inv.shape)}"
            ),
        )
    if scale_inv.device != data.device:
        raise ValueError(
            f"te.{name}: scale_inv must be on data's device ({data.device}), got {scale_inv.device}"
        )


_kernels = functools.partial(submodule, "quantize")  # Triton: imported on first CUDA use


# Per row: the grouped GEMMs' operands (``functional.gemm``'s row-scaled per-tensor rows) --


def quantize_rowwise(
    x: Tensor, fp8_dtype: torch.dtype, dim: int = -1, e4m3_codes: bool = False
) -> tuple[Tensor, Tensor]:
    """``(data, scale_inv)``: ``x`` cast to ``fp8_dtype`` with one current scale per slice along
    ``dim`` (``fp8_max / amax``; 1 for an all-zero or non-finite slice), in fp32 whatever
    ``x``'s dtype (a float64 copy gets the same bytes). CUDA: one Triton kernel, bit-identical.
    ``e4m3_codes``: an E5M2 result as the grouped GEMM takes it (:func:`as_e4m3`)."""
    if runs_triton(x):
        from te_compile.kernels import quantize_rows

        moved = dim not in (-1, x.ndim - 1)
        data, scale_inv = quantize_rows.quantize_rowwise(
            x.movedim(dim, -1) if moved else x, fp8_dtype, e4m3_codes=e4m3_codes
        )
        return (data.movedim(-1, dim).contiguous() if moved else data), scale_inv
    if e4m3_codes:
        return as_e4m3(*quantize_rowwise(x, fp8_dtype, dim))
    xf = x.float()
    limit = torch.finfo(fp8_dtype).max
    amax = xf.abs().amax(dim, keepdim=True)
    scale = div_rn(limit, amax)
    scale = torch.where((amax > 0) & torch.isfinite(scale), scale, 1.0)
    data = (xf * scale).clamp(-limit, limit).to(fp8_dtype)
    return data, reciprocal_rn(scale).squeeze(dim)


def as_e4m3(q: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """A grouped GEMM operand in E4M3 codes: E4M3 ``q`` as is; E5M2 ``q`` recoded to the E4M3
    codes of its values times ``2**-7``, its inverse scales ``s`` times 128 (``docs/fp8.md``)."""
    if q.dtype is not torch.float8_e5m2:
        return q, s
    if q.is_cuda:
        from te_compile.kernels import quantize_rows

        codes = quantize_rows.recode_e5m2_as_e4m3(q)
    else:
        codes = e5m2_to_e4m3_table(q.device)[q.view(torch.uint8).long()].view(torch.float8_e4m3fn)
    return codes, s * 128.0


# 2. Ops (on CPU the reference math; on CUDA the Triton kernels) ------------------------------


@op("quantize_tensorwise")
def quantize_tensorwise(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Delayed scaling: returns ``(data, data_t, amax)``; ``data_t`` is ``[K, M]`` with
    ``columnwise``, else 0-element. One read of ``x``."""
    _check_x("quantize_tensorwise", x, fp8_dtype)
    _check_per_tensor_scale("quantize_tensorwise", "scale", scale, x)
    if not x.is_cuda:
        return quantize_tensorwise_ref(x, scale, fp8_dtype, columnwise)
    data, data_t, _, amax = _kernels().quantize_tensorwise(x, scale, fp8_dtype, columnwise)
    return data, data_t, amax


@op("quantize_current")
def quantize_current(
    x: Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Current scaling: returns ``(data, data_t, scale_inv, amax)``. Two reads of ``x``: the
    global amax must be known before the first element is cast."""
    _check_quantize_current("quantize_current", x, fp8_dtype, amax_epsilon)
    impl = _kernels().quantize_current if x.is_cuda else quantize_current_ref
    return impl(x, fp8_dtype, columnwise, amax_epsilon, power_2_scale)


@op("quantize_blockwise")
def quantize_blockwise(
    x: Tensor, fp8_dtype: torch.dtype, block_rows: int, power_2_scale: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Blockwise scaling: returns ``(data, scale_inv, data_t, scale_inv_t)`` (layouts in the
    module docstring). One read of ``x``."""
    _check_x("quantize_blockwise", x, fp8_dtype)
    _check_block_rows("quantize_blockwise", block_rows)
    impl = _kernels().quantize_blockwise if x.is_cuda else quantize_blockwise_ref
    return impl(x, fp8_dtype, block_rows, power_2_scale, columnwise)


@op("dequantize_tensorwise")
def dequantize_tensorwise(
    data: Tensor, scale_inv: Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> Tensor:
    """``data`` (the uint8 bytes of ``fp8_dtype`` values) times ``scale_inv``, rounded to
    ``out_dtype``; ``data``'s shape."""
    check_dequantize("dequantize_tensorwise", data, fp8_dtype, out_dtype)
    _check_per_tensor_scale("dequantize_tensorwise", "scale_inv", scale_inv, data)
    impl = _kernels().dequantize_tensorwise if data.is_cuda else dequantize_tensorwise_ref
    return impl(data.view(fp8_dtype), scale_inv, out_dtype)


@op("dequantize_blockwise")
def dequantize_blockwise(
    data: Tensor, scale_inv: Tensor, block_rows: int, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> Tensor:
    """``data`` (the uint8 bytes of ``fp8_dtype`` values) times ``scale_inv`` per block of the
    ``[M, K]`` view (``block_rows x 128``), rounded to ``out_dtype``; ``data``'s shape."""
    check_dequantize("dequantize_blockwise", data, fp8_dtype, out_dtype)
    _check_block_scale_inv("dequantize_blockwise", data, scale_inv, block_rows)
    impl = _kernels().dequantize_blockwise if data.is_cuda else dequantize_blockwise_ref
    return impl(data.view(fp8_dtype), scale_inv, block_rows, out_dtype)


# 3. Fakes -----------------------------------------------------------------------------------


def _fake_fp8(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool, scalars: int = 0):
    """``(data, data_t, *scalars)``: ``x``'s shape, ``[K, M]`` or 0-element, then ``scalars``
    fp32 ``[1]`` tensors."""
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    data_t = x.new_empty((k, m), dtype=fp8_dtype) if columnwise else _empty(x, fp8_dtype)
    ones = (x.new_empty((1,), dtype=torch.float32) for _ in range(scalars))
    return x.new_empty(x.shape, dtype=fp8_dtype), data_t, *ones


@quantize_tensorwise.register_fake
def _quantize_tensorwise_fake(x, scale, fp8_dtype, columnwise):
    _check_x("quantize_tensorwise", x, fp8_dtype)
    _check_per_tensor_scale("quantize_tensorwise", "scale", scale, x)
    return _fake_fp8(x, fp8_dtype, columnwise, 1)


@quantize_current.register_fake
def _quantize_current_fake(x, fp8_dtype, columnwise, amax_epsilon=0.0, power_2_scale=False):
    _check_quantize_current("quantize_current", x, fp8_dtype, amax_epsilon)
    return _fake_fp8(x, fp8_dtype, columnwise, 2)


@quantize_blockwise.register_fake
def _quantize_blockwise_fake(x, fp8_dtype, block_rows, power_2_scale, columnwise):
    _check_x("quantize_blockwise", x, fp8_dtype)
    _check_block_rows("quantize_blockwise", block_rows)
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    data, data_t = _fake_fp8(x, fp8_dtype, columnwise)
    scale_inv = x.new_empty(_scale_shape(m, k, block_rows), dtype=torch.float32)
    t = _scale_shape(k, m, block_rows) if columnwise else (0,)
    return data, scale_inv, data_t, x.new_empty(t, dtype=torch.float32)


@dequantize_tensorwise.register_fake
def _dequantize_tensorwise_fake(data, scale_inv, fp8_dtype, out_dtype):
    check_dequantize("dequantize_tensorwise", data, fp8_dtype, out_dtype)
    _check_per_tensor_scale("dequantize_tensorwise", "scale_inv", scale_inv, data)
    return data.new_empty(data.shape, dtype=out_dtype)


@dequantize_blockwise.register_fake
def _dequantize_blockwise_fake(data, scale_inv, block_rows, fp8_dtype, out_dtype):
    check_dequantize("dequantize_blockwise", data, fp8_dtype, out_dtype)
    _check_block_scale_inv("dequantize_blockwise", data, scale_inv, block_rows)
    return data.new_empty(data.shape, dtype=out_dtype)
