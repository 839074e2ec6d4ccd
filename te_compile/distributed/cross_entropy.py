r"""Cross-entropy over logits whose vocabulary dim is sharded over the tensor-parallel group.

A column-parallel LM head (``te.Linear(width, vocab, parallel_mode="column")``) leaves rank
``r`` with the logits of classes ``[r V_r, (r + 1) V_r)``. Gathering the whole ``[tokens,
vocab]`` logits to take the loss would cost a vocabulary-sized all-gather and the full softmax
on every rank; instead, per token :math:`t` with target :math:`y`:

.. math::
    m = \max_r \max_{c \in r} z_c,\qquad
    S = \sum_r \sum_{c \in r} e^{z_c - m},\qquad
    \ell = \log S - (z_y - m)

three all-reduces of one value per token (max, sum, and the target's shifted logit, which only
its owner contributes). The max is a constant shift (no gradient, as in any stable softmax);
the sum and the target logit go through :func:`~te_compile.distributed.collectives.all_reduce`,
whose backward is the identity, so each rank's gradient is its shard of
:math:`\mathrm{softmax}(z) - \mathrm{onehot}(y)` scaled by the reduction, exactly what
``F.cross_entropy`` on the gathered logits gives. Math in fp32 (fp64 stays fp64). Collectives
are functional: a compiled training step keeps zero graph breaks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from te_compile._checks import check_tensor
from te_compile.distributed.collectives import all_reduce, all_reduce_max, resolve_group

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group: Any = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """``F.cross_entropy`` of the logits gathered along their last dim over ``group`` (rank
    order), without gathering them. ``logits`` ``[..., V / tp]`` this rank's vocabulary shard;
    ``target`` ``[...]`` global class indices (the same on every rank of the group);
    ``ignore_index`` targets count neither in the loss nor in the mean; ``reduction`` "mean",
    "sum" or "none". ``group`` None (or a group of one): plain ``F.cross_entropy``."""
    owner = "vocab_parallel_cross_entropy"
    check_tensor(owner, "logits", logits)
    check_tensor(owner, "target", target, floating=False, min_dim=0)
    if target.is_floating_point() or target.is_complex() or target.dtype is torch.bool:
        raise ValueError(
            f"{owner}: target must be an integer tensor of class indices, got {target.dtype}"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{owner}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(
            f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', "
            f"got {reduction!r}"
        )
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_cross_entropy: target {list(target.shape)} must be logits' shape "
            f"without the vocabulary dim, {list(logits.shape[:-1])}"
        )
    acc = torch.float64 if logits.dtype is torch.float64 else torch.float32
    group = resolve_group(group, owner, "group")
    if group is None or dist.get_world_size(group) == 1:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(acc),
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction=reduction,
        ).reshape(target.shape if reduction == "none" else ())
    z = logits.to(acc)
    local = z.shape[-1]
    first = dist.get_rank(group) * local
    shifted = z - all_reduce_max(z.amax(-1), group).unsqueeze(-1)
    total = all_reduce(shifted.exp().sum(-1), group)
    index = target - first
    owned = (index >= 0) & (index < local)
    picked = shifted.gather(-1, index.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = all_reduce(torch.where(owned, picked, 0.0), group)
    valid = target != ignore_index
    loss = torch.where(valid, total.log() - target_logit, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
