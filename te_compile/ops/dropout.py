"""``Dropout(p)``: zero each element with probability ``p`` and scale the rest by ``1/(1-p)``,
in training mode, through ``te::dropout_fwd`` / ``te::dropout_bwd``.

Every call draws a fresh ``(seed, offset)`` from torch's default generator of the input's device
(so ``torch.manual_seed`` makes runs repeatable) and passes it to the op, which derives the mask
from it with a counter-based generator (``te_compile.functional.dropout``). The backward
recomputes the mask instead of saving it, and ``torch.utils.checkpoint`` recomputes the same mask
(it restores the generator state that drew the seed), eager and compiled. In eval mode, or with
``p == 0``, the op is the identity.
"""

from __future__ import annotations

from torch import Tensor

from te_compile import functional as F
from te_compile.ops.op import BasicOperation, OpOutput

__all__ = ["Dropout"]


class Dropout(BasicOperation):
    """Dropout with drop probability ``p`` in ``[0, 1]``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be a float in [0, 1], got {p!r}")
        self.p = float(p)

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        return F.dropout(x, self.p, training=self.training), ()

    def extra_repr(self) -> str:
        return f"p={self.p}"
