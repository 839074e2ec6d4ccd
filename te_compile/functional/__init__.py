"""Public functions over the ``torch.ops.te`` ops, one file per op family."""

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
from te_compile.functional.attention import dot_product_attention
from te_compile.functional.dense_weight import WEIGHT_OPERAND, quantize_weight
from te_compile.functional.dropout_ops import dropout
from te_compile.functional.fake_quantize_ops import fake_quantize
from te_compile.functional.fp8_scaling import delayed_scaling_update
from te_compile.functional.fused_norm import branch_rmsnorm
from te_compile.functional.gemm import blockwise_supported
from te_compile.functional.glu_layout import deinterleave_glu_tensor, interleave_glu_tensor
from te_compile.functional.grouped_linear_ops import as_splits_tensor, grouped_linear
from te_compile.functional.grouped_weight import quantize_grouped_weight
from te_compile.functional.linear_ops import linear, linear_ref
from te_compile.functional.mlp_args import MLP_ACTIVATIONS
from te_compile.functional.mlp_ops import mlp
from te_compile.functional.moe import (
    moe_permute,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from te_compile.functional.norm import l2normalization, layernorm, rmsnorm
from te_compile.functional.quantize_mx import (
    dequantize_mxfp8,
    dequantize_nvfp4,
    quantize_mxfp8,
    quantize_nvfp4,
)
from te_compile.functional.rotary import apply_rotary_pos_emb, rotary_frequencies

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "MLP_ACTIVATIONS",
    "WEIGHT_OPERAND",
    "apply_rotary_pos_emb",
    "as_splits_tensor",
    "bias_activation",
    "blockwise_supported",
    "branch_rmsnorm",
    "bulk_allocate",
    "clamped_swiglu",
    "deinterleave_glu_tensor",
    "delayed_scaling_update",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "dot_product_attention",
    "dropout",
    "fake_quantize",
    "geglu",
    "gelu",
    "glu",
    "grouped_linear",
    "interleave_glu_tensor",
    "l2normalization",
    "layernorm",
    "linear",
    "linear_ref",
    "mlp",
    "moe_permute",
    "moe_permute_with_probs",
    "moe_sort_chunks_by_index",
    "moe_sort_chunks_by_index_with_probs",
    "moe_unpermute",
    "qgeglu",
    "qgelu",
    "quantize_grouped_weight",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_weight",
    "reglu",
    "relu",
    "rmsnorm",
    "rotary_frequencies",
    "silu",
    "sreglu",
    "srelu",
    "swiglu",
]
