"""``te_compile.recipe``: the low-precision recipes, under the name Transformer Engine users
import them by (``from transformer_engine.common import recipe``). Defined in
``te_compile.quantization.recipe``."""

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
)

__all__ = [
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
]
