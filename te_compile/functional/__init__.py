"""Public functions over the ``torch.ops.te`` ops, one file per op family."""

from te_compile.functional import quantize as _quantize_module  # noqa: F401  (registers ops)
from te_compile.functional.activation import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    bias_activation,
    clamped_swiglu,
    geglu,
    gelu,
    glu,
    qgeglu,
    qgelu,
    reglu,
    relu,
    silu,
    sreglu,
    srelu,
    swiglu,
)
from te_compile.functional.allocate import bulk_allocate
from te_compile.functional.dropout import dropout
from te_compile.functional.fake_quantize import fake_quantize
from te_compile.functional.fp8_scaling import delayed_scaling_update
from te_compile.functional.fused_linear import linear_bias_activation
from te_compile.functional.fused_linear_add import branch_linear, linear_add
from te_compile.functional.fused_norm import branch_rmsnorm
from te_compile.functional.glu_layout import deinterleave_glu_tensor, interleave_glu_tensor
from te_compile.functional.grouped_linear import as_splits_tensor, grouped_linear
from te_compile.functional.grouped_linear_block import grouped_linear_block
from te_compile.functional.grouped_linear_fp8 import grouped_linear_fp8
from te_compile.functional.linear import linear, linear_ref
from te_compile.functional.linear_block_scaled import linear_block_scaled, native_block_supported
from te_compile.functional.linear_fp8 import linear_fp8
from te_compile.functional.mlp_fp8 import FUSED_ACTIVATIONS as FP8_FUSED_ACTIVATIONS
from te_compile.functional.mlp_fp8 import mlp_fp8
from te_compile.functional.norm import l2normalization, layernorm, rmsnorm
from te_compile.functional.quantize_mx import (
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)

__all__ = [
    "ACTIVATIONS",
    "FP8_FUSED_ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "as_splits_tensor",
    "bias_activation",
    "branch_linear",
    "branch_rmsnorm",
    "bulk_allocate",
    "clamped_swiglu",
    "deinterleave_glu_tensor",
    "delayed_scaling_update",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "dropout",
    "fake_quantize",
    "geglu",
    "gelu",
    "glu",
    "grouped_linear",
    "grouped_linear_block",
    "grouped_linear_fp8",
    "interleave_glu_tensor",
    "l2normalization",
    "layernorm",
    "linear",
    "linear_add",
    "linear_bias_activation",
    "linear_block_scaled",
    "linear_fp8",
    "linear_ref",
    "mlp_fp8",
    "native_block_supported",
    "qgeglu",
    "qgelu",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "reglu",
    "relu",
    "rmsnorm",
    "silu",
    "sreglu",
    "srelu",
    "swiglu",
]
