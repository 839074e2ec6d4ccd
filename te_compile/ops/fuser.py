"""``OperationFuser``: Transformer Engine's fuser of one run of ops, under TE's module name
(``transformer_engine.pytorch.ops.fuser``), for code that builds one directly.

Here the fuser is :class:`~te_compile.ops.Sequential` itself (its plan and its channel routing);
``OperationFuser(ops)`` is a ``Sequential`` of ``ops`` seen through TE's interface: building it
validates and captures the ops' extra tensor channels (locking them), ``num_extra_inputs`` is the
number of extra inputs the caller passes, and calling it runs the ops, returning what a
``Sequential`` returns.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from te_compile.ops.op import BasicOperation, FusibleOperation
from te_compile.ops.sequential import Sequential

__all__ = ["OperationFuser"]


class OperationFuser:
    """The fused pipeline of ``ops`` (basic ops and containers such as ``ops.Linear``)."""

    def __init__(self, ops: Sequence[FusibleOperation]) -> None:
        basic_ops: list[BasicOperation] = []
        for op in ops:
            if not isinstance(op, FusibleOperation):
                raise TypeError(
                    f"OperationFuser: ops must be te_compile.ops operations, got "
                    f"{type(op).__name__}"
                )
            basic_ops.extend(op.basic_ops if op.is_fused_op else (op,))
        self._basic_ops = basic_ops
        self._sequential = Sequential(*basic_ops)  # validates and locks the channels
        # TE's record of the routing: per op, per extra input, the (op index, extra output
        # index) of its channel's producer, None for the caller's.
        producers = {
            ch: (i, k)
            for i, op in enumerate(basic_ops)
            for k, ch in enumerate(op._extra_output_channels)
            if ch is not None
        }
        self._basic_op_extra_input_sources = [
            [None if ch is None else producers[ch] for ch in op._extra_input_channels]
            for op in basic_ops
        ]
        self.num_extra_inputs: int = self._sequential._num_extra_inputs

    def __call__(self, input: Tensor, *extra_inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        return self._sequential(input, *extra_inputs)
