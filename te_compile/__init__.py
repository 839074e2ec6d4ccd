"""te_compile: Transformer Engine-style training building blocks as ``torch.ops.te`` custom ops.

``import te_compile as te``; modules keep Transformer Engine's names (``te.Linear``, ...), every
op is callable as ``torch.ops.te.<name>`` and compiles with ``torch.compile(fullgraph=True)``.
"""

from te_compile import functional
from te_compile._library import eager_fast_path_enabled, list_ops, set_eager_fast_path
from te_compile.functional import bulk_allocate, deinterleave_glu_tensor, interleave_glu_tensor
from te_compile.modules import (
    GroupedLinear,
    GroupedMLP,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
)

__version__ = "0.1.0"

__all__ = [
    "GroupedLinear",
    "GroupedMLP",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
    "__version__",
    "bulk_allocate",
    "deinterleave_glu_tensor",
    "eager_fast_path_enabled",
    "functional",
    "interleave_glu_tensor",
    "list_ops",
    "set_eager_fast_path",
]
