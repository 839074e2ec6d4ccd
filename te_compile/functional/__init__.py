"""Public functions over the ``torch.ops.te`` ops, one file per op family."""

from te_compile.functional.allocate import bulk_allocate
from te_compile.functional.linear import linear, linear_ref

__all__ = ["bulk_allocate", "linear", "linear_ref"]
