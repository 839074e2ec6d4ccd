"""``te_compile.common``: the path Transformer Engine code imports its recipes by, so that
``from transformer_engine.common import recipe`` becomes ``from te_compile.common import
recipe`` (also ``import te_compile.common.recipe``). The module is :mod:`te_compile.recipe`."""

from te_compile.common import recipe

__all__ = ["recipe"]
