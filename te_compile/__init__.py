"""te_compile: Transformer Engine-style training building blocks as ``torch.ops.te`` custom ops.

``import te_compile as te``; modules keep Transformer Engine's names (``te.Linear``, ...), every
op is callable as ``torch.ops.te.<name>`` and compiles with ``torch.compile(fullgraph=True)``.
"""

from te_compile import functional
from te_compile._library import eager_fast_path_enabled, list_ops, set_eager_fast_path
from te_compile.functional import bulk_allocate
from te_compile.modules import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "RMSNorm",
    "__version__",
    "bulk_allocate",
    "eager_fast_path_enabled",
    "functional",
    "list_ops",
    "set_eager_fast_path",
]
