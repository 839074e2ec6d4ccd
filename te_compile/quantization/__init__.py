"""Low-precision recipes, the autocast state modules read, and device capability checks.

``recipe``: the recipe dataclasses (TE's names, defaults and mutability). ``state``:
``autocast``, ``fp8_autocast`` and ``get_autocast_state``. ``recompute``: ``checkpoint``,
activation checkpointing that recomputes FP8 modules exactly. ``graph``:
``make_graphed_callables``, CUDA graphs of modules' forward and backward with their FP8 state
updates inside. ``device``: which recipes the GPU runs natively, the compute capability.
"""

from te_compile.quantization.api import dequantize, quantize
from te_compile.quantization.device import (
    get_default_fp8_recipe,
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
)
from te_compile.quantization.graph import make_graphed_callables
from te_compile.quantization.primary import FP8MasterWeights, fp8_model_init, quantized_model_init
from te_compile.quantization.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
    get_align_size_for_quantization,
)
from te_compile.quantization.recompute import checkpoint
from te_compile.quantization.state import AutocastState, autocast, fp8_autocast, get_autocast_state

__all__ = [
    "AutocastState",
    "DelayedScaling",
    "FP8MasterWeights",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
    "autocast",
    "checkpoint",
    "dequantize",
    "fp8_autocast",
    "fp8_model_init",
    "get_align_size_for_quantization",
    "get_autocast_state",
    "get_default_fp8_recipe",
    "get_device_compute_capability",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "make_graphed_callables",
    "quantize",
    "quantized_model_init",
]
