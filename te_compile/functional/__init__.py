"""Public functions over the ``torch.ops.te`` ops, one file per op family."""

from te_compile.functional.linear import linear, linear_ref

__all__ = ["linear", "linear_ref"]
