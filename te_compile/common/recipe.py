"""``te_compile.common.recipe``: :mod:`te_compile.recipe` under Transformer Engine's import path
(``transformer_engine.common.recipe``)."""

from te_compile.recipe import *  # noqa: F403 (the same names, one definition)
from te_compile.recipe import __all__  # noqa: F401
