"""te_compile: Transformer Engine-style training building blocks as ``torch.ops.te`` custom ops.

``import te_compile as te``; modules keep Transformer Engine's names (``te.Linear``, ...), every
op is callable as ``torch.ops.te.<name>`` and compiles with ``torch.compile(fullgraph=True)``.
"""

import os as _os

from te_compile import convert, distributed, functional, quantization, recipe
from te_compile import ops as ops
from te_compile._library import eager_fast_path_enabled, list_ops, set_eager_fast_path
from te_compile.functional import (
    apply_rotary_pos_emb,
    bulk_allocate,
    deinterleave_glu_tensor,
    interleave_glu_tensor,
    moe_permute,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from te_compile.kernels import STATIC_LAUNCH_ENV as _STATIC_LAUNCH_ENV
from te_compile.kernels import set_static_launch, static_launch_enabled
from te_compile.modules import (
    DotProductAttention,
    Fp8Padding,
    Fp8Unpadding,
    GroupedLinear,
    GroupedMLP,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    MultiheadAttention,
    RMSNorm,
    RopeScaling,
    RotaryPositionEmbedding,
    TransformerLayer,
    non_finite_amaxes,
)
from te_compile.quantization import (
    FP8MasterWeights,
    autocast,
    checkpoint,
    dequantize,
    fp8_autocast,
    fp8_model_init,
    get_device_compute_capability,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    is_nvfp4_available,
    make_graphed_callables,
    quantize,
    quantized_model_init,
)

__version__ = "0.1.0"

__all__ = [
    "DotProductAttention",
    "FP8MasterWeights",
    "Fp8Padding",
    "Fp8Unpadding",
    "GroupedLinear",
    "GroupedMLP",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "RMSNorm",
    "RopeScaling",
    "RotaryPositionEmbedding",
    "TransformerLayer",
    "__version__",
    "apply_rotary_pos_emb",
    "autocast",
    "bulk_allocate",
    "checkpoint",
    "convert",
    "deinterleave_glu_tensor",
    "dequantize",
    "distributed",
    "eager_fast_path_enabled",
    "fp8_autocast",
    "fp8_model_init",
    "functional",
    "get_device_compute_capability",
    "interleave_glu_tensor",
    "is_bf16_available",
    "is_fp8_available",
    "is_fp8_block_scaling_available",
    "is_mxfp8_available",
    "is_nvfp4_available",
    "list_ops",
    "make_graphed_callables",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
    "non_finite_amaxes",
    "quantization",
    "quantize",
    "quantized_model_init",
    "recipe",
    "set_eager_fast_path",
    "set_static_launch",
    "static_launch_enabled",
]

# Inductor launches our kernels with its static launcher unless the environment says otherwise
# (``kernels.set_static_launch``; before the first compile starts Inductor's workers).
if _STATIC_LAUNCH_ENV not in _os.environ:
    set_static_launch(True)
