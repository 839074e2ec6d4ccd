r"""MXFP8 and NVFP4 block quantisation: ``te::quantize_mxfp8`` / ``te::dequantize_mxfp8`` and
``te::quantize_nvfp4`` / ``te::dequantize_nvfp4``.

The quantisation is exact: bit for bit as defined below, on CPU and CUDA alike. Native MX/NVFP4
GEMMs exist only on Blackwell; elsewhere the recipes that use these ops emulate the GEMM by
dequantising and running a bf16 GEMM, which gives the numerics of the format without its speed.

The schemas are the op functions' signatures below (public functions of the same names add
defaults). The dequantise *ops* take fp8 inputs as their uint8 bytes (MXFP8 ``data``, with its
``fp8_dtype``; NVFP4's E4M3 ``scale``: ``docs/fp8.md``, "FP8 data crosses op boundaries as
bytes"); the public :func:`dequantize_mxfp8` / :func:`dequantize_nvfp4` take the fp8 tensors.

The input ``x`` ``[..., K]`` is viewed as ``[M, K]`` (``M`` = product of the leading dims).
*Rowwise* blocks are ``1 x B`` runs along ``K``; *columnwise* blocks are ``B x 1`` runs along
``M``, quantised from the same ``x`` and stored transposed, as ``[K, M]`` data whose rows are the
blocks (what the GEMM of a backward pass reads, e.g. ``x^T`` for a weight gradient). Either
direction can be skipped; its outputs are then 0-element tensors of the same dtypes.

MXFP8 (OCP Microscaling spec v1.0), ``B = 32``, elements E4M3 or E5M2
----------------------------------------------------------------------------------------------

Per block, with :math:`e_{max}` the exponent of the largest power of two of the element format
(8 for E4M3, whose max is 448; 15 for E5M2, max 57344):

.. math::
    X = \lfloor \log_2 \max_i |x_i| \rfloor - e_{max}, \qquad
    q_i = \mathrm{sat}\big(\mathrm{rne}(x_i / 2^X)\big)

``X`` is stored as E8M0: a ``uint8`` biased exponent ``X + 127`` (127 is :math:`2^0`), clamped
to [0, 254]. Dividing by a power of two is exact, and :math:`|x_i| / 2^X < 2^{e_{max}+1}`; values
above the element max (448 for E4M3) saturate to it, as the spec allows. Dequantisation is
:math:`q_i \cdot 2^X`.

* ``data`` ``[..., K]`` fp8 (``x``'s shape), ``scale`` ``[M, ceil(K/32)]`` uint8;
  ``data_t`` ``[K, M]`` fp8, ``scale_t`` ``[K, ceil(M/32)]`` uint8.
* Scales are in this plain row-major layout; cuBLAS's swizzled ("128x4" tiled) scale layout that
  native MX GEMMs on Blackwell consume is not produced.
* Scale rule: the spec's floor rule above. Transformer Engine rounds the exponent up instead
  (:math:`\lceil \log_2(\mathrm{amax}/\mathrm{max}) \rceil`, no saturation needed); the two
  agree unless the block amax's mantissa exceeds the element max's (e.g. E4M3 amax in
  (448, 512) times a power of two), where the floor rule keeps one more bit and saturates.

NVFP4 (NVIDIA), ``B = 16``, elements E2M1 with an E4M3 block scale and an fp32 global scale
----------------------------------------------------------------------------------------------

E2M1 magnitudes are {0, 0.5, 1, 1.5, 2, 3, 4, 6}. With ``amax`` the tensor's max ``|x|`` (or
``global_amax`` when given) and ``b`` a block's max ``|x|``, all in fp32 (Transformer Engine's
formulas and order of operations):

.. math::
    g = \min\!\big(\tfrac{448 \cdot 6}{\mathrm{amax}}, \mathrm{FLT\_MAX}\big), \qquad
    s = \mathrm{e4m3}\big(\min(b \cdot (g \cdot \tfrac16), 448)\big), \qquad
    q_i = \mathrm{sat}_6\big(\mathrm{rne}_{E2M1}(x_i \cdot \min(\tfrac{1}{s\,\cdot\,(1/g)},
    \mathrm{FLT\_MAX}))\big)

so that a block's max lands near 6 and dequantisation is :math:`q_i \cdot s / g`.

* ``data`` ``[..., K/2]`` uint8 — two E2M1 codes per byte, the **even** element in the **low**
  nibble (``byte = code[2j] | code[2j+1] << 4``), each code ``sign << 3 | magnitude index``;
  ``scale`` ``[M, ceil(K/16)]`` ``torch.float8_e4m3fn``; ``global_scale`` a 0-dim fp32 tensor
  ``g`` (the *encode* scale: dequantise divides by it); ``data_t`` ``[K, M/2]`` uint8 and
  ``scale_t`` ``[K, ceil(M/16)]`` e4m3, the columnwise pair, with the same ``g``.
* ``K`` must be even for rowwise output and ``M`` even for columnwise output (whole bytes).
* Rounding: to nearest on the E2M1 grid, ties to the even code (0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Stochastic rounding and Transformer
  Engine's other NVFP4 options are the GEMM families' (``quantize_mx_ref.nvfp4_qdq``).

Edge cases (both formats)
-------------------------

* ``K`` (or ``M`` columnwise) not a multiple of ``B``: the last block is partial, quantised as if
  zero-padded to ``B`` (zeros do not change its max); the padding is not stored.
* All-zero block: MXFP8 stores the scale 127 (:math:`2^0`; any scale decodes zeros to zeros, and
  1 is the neutral one). NVFP4 stores the E4M3 scale 0 and zero codes; dequantisation gives 0,
  never NaN (``s / g`` with ``g > 0``). An NVFP4 block whose scale underflows E4M3 to 0 also
  stores zero codes (signed zeros), where Transformer Engine stores saturated codes under the
  0 scale: the dequantised values are 0 either way.
* A block holding inf or NaN: its scale is NaN (MXFP8: E8M0 ``0xFF``; NVFP4: E4M3 ``0x7F``), so
  the whole block dequantises to NaN; its data bytes are fixed (MXFP8: ``0x7F``, NVFP4: zero
  codes). NVFP4's global scale falls back to 1 when ``amax`` is 0 or inf (as in Transformer
  Engine) or NaN; the other blocks are then quantised against ``g = 1``.
* Overflow saturates: elements to the element max, an NVFP4 block scale to 448 (possible when a
  ``global_amax`` smaller than the tensor's is passed).

Implementations: on CPU the reference math (``*_ref``, in ``functional.quantize_mx_ref``); on
CUDA the Triton kernels of ``te_compile.kernels.quantize_mx`` (one read of ``x`` for both
directions; tests/kernels runs them under the Triton interpreter). NVFP4 without a
``global_amax`` first reduces ``x`` to its amax (a torch reduction: every block's scale depends
on it), so it reads ``x`` twice. Inputs are fp32, bf16 or fp16; all math is fp32.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from te_compile._checks import FP8_DTYPES, HIGH_DTYPES, check_bool, check_tensor
from te_compile._library import op
from te_compile.functional.quantize import check_dequantize, check_fp8_dtype, check_high_dtype
from te_compile.functional.quantize_mx_ref import (
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    dequantize_mxfp8_ref,
    dequantize_nvfp4_ref,
    nvfp4_global_scale,
    quantize_mxfp8_ref,
    quantize_nvfp4_ref,
    tensor_amax,
)
from te_compile.kernels import submodule

__all__ = [
    "check_quantize_nvfp4",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
]

# Argument checks (eager and fakes: shapes and dtypes only) -----------------------------------


def _check_input(name: str, x: Tensor, rowwise: bool, columnwise: bool) -> None:
    if x.dtype not in HIGH_DTYPES:
        raise ValueError(f"te.{name}: x.dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"te.{name}: x must have at least 1 dim ([..., K]), got a 0-dim tensor")
    if not (rowwise or columnwise):
        raise ValueError(f"te.{name}: at least one of rowwise and columnwise must be True")


def _check_quantize_mxfp8(x: Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool):
    _check_input("quantize_mxfp8", x, rowwise, columnwise)
    check_fp8_dtype("quantize_mxfp8", fp8_dtype)


def check_quantize_nvfp4(x: Tensor, global_amax: Tensor | None, rowwise: bool, columnwise: bool):
    _check_input("quantize_nvfp4", x, rowwise, columnwise)
    if rowwise and x.shape[-1] % 2:
        raise ValueError(
            f"te.quantize_nvfp4: x.shape[-1] (K = {x.shape[-1]}) must be even for rowwise "
            "output: two E2M1 values per byte"
        )
    if columnwise and (m := math.prod(x.shape[:-1])) % 2:
        raise ValueError(
            f"te.quantize_nvfp4: the row count M = prod(x.shape[:-1]) = {m} must be even for "
            "columnwise output: two E2M1 values per byte"
        )
    g = global_amax
    if g is not None and (g.dtype, g.numel(), g.device) != (torch.float32, 1, x.device):
        raise ValueError(
            "te.quantize_nvfp4: global_amax must be None or a float32 tensor with one element "
            f"on x's device ({x.device}), got {g.dtype} of shape {list(g.shape)} on {g.device}"
        )


def _check_scale(name: str, data: Tensor, scale: Tensor, k: int, block: int, what: str) -> None:
    """``scale`` must be uint8 ``[M, ceil(K / block)]`` for ``data`` ``[..., *]`` (K elements
    per row); ``what`` says what its bytes hold."""
    m = math.prod(data.shape[:-1])
    expected = [m, -(-k // block)]
    if scale.dtype != torch.uint8 or list(scale.shape) != expected:
        raise ValueError(
            f"te.{name}: scale must hold {what} of shape [M, ceil(K/{block})] = {expected} for "
            f"data of shape {list(data.shape)}, got {scale.dtype} of shape {list(scale.shape)}"
        )
    if scale.device != data.device:
        raise ValueError(f"te.{name}: scale must be on data's device ({data.device})")


def _check_dequantize_mxfp8(
    data: Tensor, scale: Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> None:
    check_dequantize("dequantize_mxfp8", data, fp8_dtype, out_dtype)
    k = data.shape[-1]
    _check_scale("dequantize_mxfp8", data, scale, k, MXFP8_BLOCK, "E8M0 exponents (uint8)")


def _check_dequantize_nvfp4(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> None:
    if data.dtype != torch.uint8 or data.ndim < 1:
        raise ValueError(
            "te.dequantize_nvfp4: data must be a uint8 tensor (two E2M1 codes per byte) with at "
            f"least 1 dim, got {data.dtype} of shape {list(data.shape)}"
        )
    what = "E4M3 scales (their uint8 bytes: module docstring)"
    _check_scale("dequantize_nvfp4", data, scale, 2 * data.shape[-1], NVFP4_BLOCK, what)
    g = global_scale
    if (g.dtype, g.numel(), g.device) != (torch.float32, 1, data.device):
        raise ValueError(
            "te.dequantize_nvfp4: global_scale must be a float32 tensor with one element on "
            f"data's device ({data.device}), got {g.dtype} of shape {list(g.shape)} on {g.device}"
        )
    check_high_dtype("dequantize_nvfp4", "out_dtype", out_dtype)


_kernels = functools.partial(submodule, "quantize_mx")  # Triton: imported on first CUDA use


# 2. Ops (on CPU the reference math; on CUDA the Triton kernels) ------------------------------


@op("quantize_mxfp8")
def quantize_mxfp8_op(
    x: Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(data, scale, data_t, scale_t)``."""
    _check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)
    impl = _kernels().quantize_mxfp8 if x.is_cuda else quantize_mxfp8_ref
    return impl(x, fp8_dtype, rowwise, columnwise)


@op("dequantize_mxfp8")
def dequantize_mxfp8_op(
    data: Tensor, scale: Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype
) -> Tensor:
    """``data`` (the uint8 bytes of ``fp8_dtype`` values) dequantised to ``out_dtype``."""
    _check_dequantize_mxfp8(data, scale, fp8_dtype, out_dtype)
    impl = _kernels().dequantize_mxfp8 if data.is_cuda else dequantize_mxfp8_ref
    return impl(data.view(fp8_dtype), scale, out_dtype)


@op("quantize_nvfp4")
def quantize_nvfp4_op(
    x: Tensor, global_amax: Tensor | None, rowwise: bool, columnwise: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(data, scale, global_scale, data_t, scale_t)``."""
    check_quantize_nvfp4(x, global_amax, rowwise, columnwise)
    if not x.is_cuda:
        return quantize_nvfp4_ref(x, global_amax, rowwise, columnwise)
    g = nvfp4_global_scale(tensor_amax(x) if global_amax is None else global_amax)
    data, scale, data_t, scale_t = _kernels().quantize_nvfp4(x, g, rowwise, columnwise)
    return data, scale, g, data_t, scale_t


@op("dequantize_nvfp4")
def dequantize_nvfp4_op(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``data`` dequantised to ``out_dtype``; ``scale`` is the uint8 bytes of the E4M3 scales."""
    _check_dequantize_nvfp4(data, scale, global_scale, out_dtype)
    impl = _kernels().dequantize_nvfp4 if data.is_cuda else dequantize_nvfp4_ref
    return impl(data, scale.view(torch.float8_e4m3fn), global_scale, out_dtype)


# 3. Fakes -------------------------------------------------------------------------------------


@quantize_mxfp8_op.register_fake
def _quantize_mxfp8_fake(x, fp8_dtype, rowwise, columnwise):
    _check_quantize_mxfp8(x, fp8_dtype, rowwise, columnwise)
    m, k, b = math.prod(x.shape[:-1]), x.shape[-1], MXFP8_BLOCK
    data = x.new_empty(x.shape if rowwise else (0,), dtype=fp8_dtype)
    scale = x.new_empty((m, (k + b - 1) // b) if rowwise else (0,), dtype=torch.uint8)
    data_t = x.new_empty((k, m) if columnwise else (0,), dtype=fp8_dtype)
    scale_t = x.new_empty((k, (m + b - 1) // b) if columnwise else (0,), dtype=torch.uint8)
    return data, scale, data_t, scale_t


@dequantize_mxfp8_op.register_fake
def _dequantize_mxfp8_fake(data, scale, fp8_dtype, out_dtype):
    _check_dequantize_mxfp8(data, scale, fp8_dtype, out_dtype)
    return data.new_empty(data.shape, dtype=out_dtype)


@quantize_nvfp4_op.register_fake
def _quantize_nvfp4_fake(x, global_amax, rowwise, columnwise):
    check_quantize_nvfp4(x, global_amax, rowwise, columnwise)
    m, k, b = math.prod(x.shape[:-1]), x.shape[-1], NVFP4_BLOCK
    u8, e4m3 = torch.uint8, torch.float8_e4m3fn
    data = x.new_empty((*x.shape[:-1], k // 2) if rowwise else (0,), dtype=u8)
    scale = x.new_empty((m, (k + b - 1) // b) if rowwise else (0,), dtype=e4m3)
    data_t = x.new_empty((k, m // 2) if columnwise else (0,), dtype=u8)
    scale_t = x.new_empty((k, (m + b - 1) // b) if columnwise else (0,), dtype=e4m3)
    return data, scale, x.new_empty((), dtype=torch.float32), data_t, scale_t


@dequantize_nvfp4_op.register_fake
def _dequantize_nvfp4_fake(data, scale, global_scale, out_dtype):
    _check_dequantize_nvfp4(data, scale, global_scale, out_dtype)
    return data.new_empty((*data.shape[:-1], 2 * data.shape[-1]), dtype=out_dtype)


# Public functions -----------------------------------------------------------------------------


def _check_public(
    owner: str,
    tensors: dict[str, object],
    rowwise: object = True,
    columnwise: object = True,
    **dtypes: object,
) -> None:
    """The public functions' argument types, by name, before the ops' schema parser sees them
    (it would raise a RuntimeError naming the op's own parameters); ``tensors`` holds the
    required ones (None refused)."""
    for name, t in tensors.items():
        check_tensor(owner, name, t, floating=False, min_dim=0)
    check_bool(owner, rowwise=rowwise, columnwise=columnwise)
    for name, dtype in dtypes.items():
        if name == "fp8_dtype":
            check_fp8_dtype(owner.removeprefix("te."), dtype)
        if name == "out_dtype" and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"{owner}: out_dtype must be a floating torch.dtype, got {dtype!r}")


def quantize_mxfp8(
    x: Tensor,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MXFP8 of ``x`` ``[..., K]``: ``(data, scale, data_t, scale_t)``, see the module docstring
    for the layouts; a direction not asked for gives 0-element tensors."""
    _check_public("te.quantize_mxfp8", {"x": x}, rowwise, columnwise, fp8_dtype=fp8_dtype)
    return quantize_mxfp8_op(x, fp8_dtype, rowwise, columnwise)


def dequantize_mxfp8(
    data: Tensor, scale: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Inverse of :func:`quantize_mxfp8` for one direction: ``(data, scale)`` or
    ``(data_t, scale_t)`` (which gives ``x`` transposed, ``[K, M]``)."""
    _check_public("te.dequantize_mxfp8", {"data": data, "scale": scale}, out_dtype=out_dtype)
    if data.dtype not in FP8_DTYPES:  # the op takes the bytes (module docstring)
        raise ValueError(
            "te.dequantize_mxfp8: data must be a float8_e4m3fn or float8_e5m2 tensor, got "
            f"{data.dtype}"
        )
    return dequantize_mxfp8_op(data.view(torch.uint8), scale, data.dtype, out_dtype)


def quantize_nvfp4(
    x: Tensor,
    global_amax: Tensor | None = None,
    *,
    rowwise: bool = True,
    columnwise: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """NVFP4 of ``x`` ``[..., K]``: ``(data, scale, global_scale, data_t, scale_t)``, see the
    module docstring; ``global_amax`` (fp32, one element) replaces the tensor's own amax."""
    tensors = {"x": x} if global_amax is None else {"x": x, "global_amax": global_amax}
    _check_public("te.quantize_nvfp4", tensors, rowwise, columnwise)
    return quantize_nvfp4_op(x, global_amax, rowwise, columnwise)


def dequantize_nvfp4(
    data: Tensor, scale: Tensor, global_scale: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Inverse of :func:`quantize_nvfp4` for one direction: ``(data, scale, global_scale)`` or
    ``(data_t, scale_t, global_scale)`` (which gives ``x`` transposed, ``[K, M]``)."""
    tensors = {"data": data, "scale": scale, "global_scale": global_scale}
    _check_public("te.dequantize_nvfp4", tensors, out_dtype=out_dtype)
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"te.dequantize_nvfp4: scale must be a torch.float8_e4m3fn tensor, got {scale.dtype}"
        )
    return dequantize_nvfp4_op(data, scale.view(torch.uint8), global_scale, out_dtype)
