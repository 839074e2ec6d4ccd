"""Which low-precision recipes the current GPU runs natively, with TE's function signatures.

=========================================  ==================================================
function                                   native when
=========================================  ==================================================
``is_bf16_available``                      compute capability >= 8.0 (Ampere and later):
                                           bf16 tensor-core GEMMs
``is_fp8_available``                       compute capability >= 8.9 (Ada, Hopper and later):
                                           DelayedScaling, Float8CurrentScaling
``is_fp8_block_scaling_available``         >= 9.0 (Hopper) and CUDA >= 12.9 (cuBLASLt's
                                           1x128 / 128x128 block-scaled GEMM)
``is_mxfp8_available``                     >= 10.0 (Blackwell)
``is_nvfp4_available``                     >= 10.0 (Blackwell)
=========================================  ==================================================

Each ``is_*_available`` returns a bool, or ``(available, reason)`` with ``return_reason=True``;
``reason`` is "" when available, else why not (the capability needed and the device's). Without
a CUDA device every answer is ``(False, "no CUDA device")``. ROCm builds answer False as well:
AMD's FP8 formats (``float8_e4m3fnuz``) are not the ones the recipes use.

"Not available" means "not native": te_compile still quantises exactly on any device and
emulates the low-precision GEMM by dequantising and multiplying in high precision.

The device is queried through :func:`torch.compiler.assume_constant_result`, so these functions
(and :func:`get_default_fp8_recipe`) can be called inside a ``fullgraph=True`` region: the answer
is computed once at trace time and becomes a constant of the graph.
"""

from __future__ import annotations

import functools

import torch

from te_compile._checks import check_bool
from te_compile.quantization.recipe import DelayedScaling, MXFP8BlockScaling, Recipe

__all__ = [
    "emulation_reason",
    "get_default_fp8_recipe",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
]


@torch.compiler.assume_constant_result
def _capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one (or on ROCm); read
    once per device (``autocast(recipe=None)`` asks on every entry)."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return None
    return _capability_of(torch.cuda.current_device())


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _native(minimum: tuple[int, int], what: str, return_reason: bool) -> bool | tuple[bool, str]:
    capability, reason = _capability(), ""  # reason: "" exactly when native
    if capability is None:
        reason = "no CUDA device"
    elif capability < minimum:
        have, need = ".".join(map(str, capability)), ".".join(map(str, minimum))
        reason = f"{what} needs compute capability {need} or higher; device has {have}"
    return (not reason, reason) if return_reason else not reason


def get_device_compute_capability() -> tuple[int, int]:
    """``(major, minor)`` compute capability of the current CUDA device; ``(0, 0)`` without a
    CUDA device and on ROCm, so ``>= (9, 0)`` reads "Hopper or later" on any machine."""
    return tuple(_capability() or (0, 0))


def is_bf16_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether bf16 GEMMs run natively (module docstring)."""
    check_bool("is_bf16_available", return_reason=return_reason)
    return _native((8, 0), "BF16", return_reason)


def is_fp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether per-tensor FP8 (delayed and current scaling) runs natively (module docstring)."""
    check_bool("is_fp8_available", return_reason=return_reason)
    return _native((8, 9), "FP8", return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether FP8 block scaling (1x128 / 128x128 scales) runs natively (module docstring)."""
    check_bool("is_fp8_block_scaling_available", return_reason=return_reason)
    ok, reason = _native((9, 0), "FP8 block scaling", return_reason=True)
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if ok and cuda < (12, 9):
        reason = f"FP8 block scaling needs CUDA 12.9 or newer; torch has {cuda[0]}.{cuda[1]}"
    return (not reason, reason) if return_reason else not reason


def is_mxfp8_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether MXFP8 runs natively (module docstring)."""
    check_bool("is_mxfp8_available", return_reason=return_reason)
    return _native((10, 0), "MXFP8", return_reason)


def is_nvfp4_available(return_reason: bool = False) -> bool | tuple[bool, str]:
    """Whether NVFP4 runs natively (module docstring)."""
    check_bool("is_nvfp4_available", return_reason=return_reason)
    return _native((10, 0), "NVFP4", return_reason)


def get_default_fp8_recipe() -> Recipe:
    """The recipe ``autocast(recipe=None)`` uses, chosen as TE does: ``MXFP8BlockScaling()``
    where MXFP8 is native (Blackwell), else ``DelayedScaling()``; a new recipe on each call
    (recipes are mutable), also inside a compiled region."""
    return MXFP8BlockScaling() if is_mxfp8_available() else DelayedScaling()


def emulation_reason(recipe: Recipe) -> str:
    """Why ``recipe``'s GEMMs are emulated on this machine (quantised operands multiplied in
    fp32), ``""`` where they run natively (the module table); MXFP8 and NVFP4 GEMMs are emulated
    everywhere (te_compile has no Blackwell GEMMs)."""
    if recipe.mxfp8() or recipe.nvfp4():
        return f"te_compile runs {type(recipe).__name__}'s GEMMs emulated on every GPU"
    native = is_fp8_block_scaling_available if recipe.float8_block_scaling() else is_fp8_available
    return native(return_reason=True)[1]  # "" where native
