"""The fusible-op API: ``te_compile.ops.Sequential`` of basic ops, with known patterns fused.

Basic ops (``nn.Module``\\ s, Transformer Engine's names) and what they compute::

    Linear (BasicLinear + Bias container, TE's state_dict keys)
    BasicLinear (x W^T)   Bias (x + b)   GroupedLinear (per-group x_g W_g^T + b_g; m_splits extra)
    GELU QGELU ReLU SReLU SiLU   GLU GEGLU QGEGLU ReGLU SReGLU SwiGLU ClampedSwiGLU SiTUGLU
    ScaledSwiGLU ScaledClampedQGeGLU ScaledSiTUGLU ScaledSReLU (times the extra input scales)
    LayerNorm RMSNorm L2Normalization   Dropout(p)   Quantize
    Identity Reshape ConstantScale   AddExtraInput (residual add)   MakeExtraOutput (branch)
    AllGather AllReduce ReduceScatter (functional collectives; identity without a group)

Fused ops and the fuser: ``te_compile.ops.fused`` (user fusions: ``register_forward_fusion``,
``register_backward_fusion``, ``register_forward_backward_fusion``); the container:
``te_compile.ops.Sequential`` (extra tensor channels: ``set_extra_input_channel`` /
``set_extra_output_channel``). User ops subclass ``BasicOperation`` in either protocol (TE's
``op_forward(ctx, input_, ...)`` / ``op_backward``, or ours; ``te_compile.ops.op``).
See ``docs/ops.md``.
"""

from te_compile.ops.activation import (
    GEGLU,
    GELU,
    GLU,
    QGEGLU,
    QGELU,
    ClampedSwiGLU,
    ReGLU,
    ReLU,
    ScaledClampedQGeGLU,
    ScaledSiTUGLU,
    ScaledSReLU,
    ScaledSwiGLU,
    SiLU,
    SiTUGLU,
    SReGLU,
    SReLU,
    SwiGLU,
)
from te_compile.ops.comm import AllGather, AllReduce, ReduceScatter
from te_compile.ops.dropout import Dropout
from te_compile.ops.fused import (
    FUSIONS,
    BackwardActivationBias,
    BackwardAddRMSNorm,
    BackwardLinearAdd,
    BackwardLinearScale,
    ForwardLinearBiasActivation,
    ForwardLinearBiasAdd,
    ForwardLinearScaleAdd,
    register_backward_fusion,
    register_forward_backward_fusion,
    register_forward_fusion,
)
from te_compile.ops.linear import BasicLinear, Bias, GroupedLinear, Linear
from te_compile.ops.norm import L2Normalization, LayerNorm, RMSNorm
from te_compile.ops.op import (
    BasicOperation,
    FusedOperation,
    FusibleOperation,
    OperationContext,
)
from te_compile.ops.quantize import Quantize
from te_compile.ops.sequential import Sequential
from te_compile.ops.structural import (
    AddExtraInput,
    ConstantScale,
    Identity,
    MakeExtraOutput,
    Reshape,
)

__all__ = [
    "FUSIONS",
    "GEGLU",
    "GELU",
    "GLU",
    "QGEGLU",
    "QGELU",
    "AddExtraInput",
    "AllGather",
    "AllReduce",
    "BackwardActivationBias",
    "BackwardAddRMSNorm",
    "BackwardLinearAdd",
    "BackwardLinearScale",
    "BasicLinear",
    "BasicOperation",
    "Bias",
    "ClampedSwiGLU",
    "ConstantScale",
    "Dropout",
    "ForwardLinearBiasActivation",
    "ForwardLinearBiasAdd",
    "ForwardLinearScaleAdd",
    "FusedOperation",
    "FusibleOperation",
    "GroupedLinear",
    "Identity",
    "L2Normalization",
    "LayerNorm",
    "Linear",
    "MakeExtraOutput",
    "OperationContext",
    "Quantize",
    "RMSNorm",
    "ReGLU",
    "ReLU",
    "ReduceScatter",
    "Reshape",
    "SReGLU",
    "SReLU",
    "ScaledClampedQGeGLU",
    "ScaledSReLU",
    "ScaledSiTUGLU",
    "ScaledSwiGLU",
    "Sequential",
    "SiLU",
    "SiTUGLU",
    "SwiGLU",
    "register_backward_fusion",
    "register_forward_backward_fusion",
    "register_forward_fusion",
]
