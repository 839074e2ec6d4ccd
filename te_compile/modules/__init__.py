"""nn.Modules with Transformer Engine's names; forward() calls te_compile.functional only."""

from te_compile.modules.attention import DotProductAttention
from te_compile.modules.fp8_padding import Fp8Padding, Fp8Unpadding
from te_compile.modules.grouped_linear import GroupedLinear
from te_compile.modules.grouped_mlp import GroupedMLP, convert_glu_layout
from te_compile.modules.layernorm_linear import LayerNormLinear
from te_compile.modules.layernorm_mlp import LayerNormMLP
from te_compile.modules.linear import Linear
from te_compile.modules.multi_head_attention import MultiheadAttention
from te_compile.modules.norm import LayerNorm, RMSNorm
from te_compile.modules.rotary import RopeScaling, RotaryPositionEmbedding
from te_compile.modules.transformer_layer import TransformerLayer
from te_compile.quantization.fp8_gemm import non_finite_amaxes

__all__ = [
    "DotProductAttention",
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
    "convert_glu_layout",
    "non_finite_amaxes",
]
