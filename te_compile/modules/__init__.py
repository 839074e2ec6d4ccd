"""nn.Modules with Transformer Engine's names; forward() calls te_compile.functional only."""

from te_compile.modules.linear import Linear

__all__ = ["Linear"]
