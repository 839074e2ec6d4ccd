"""Tensor and sequence parallelism on ``torch.distributed`` functional collectives.

The collectives (:mod:`~te_compile.distributed.collectives`) trace into ``torch.compile``
graphs with zero graph breaks, with NCCL on GPUs and gloo on CPUs; the module settings and the
sharding rules are in :mod:`~te_compile.distributed.tensor_parallel`. FSDP2 (``fully_shard``)
needs nothing from here: the modules keep plain ``nn.Parameter``\\ s. See docs/distributed.md.
"""

from te_compile.distributed.collectives import (
    all_gather,
    all_reduce,
    all_reduce_grad,
    all_reduce_max,
    reduce_scatter,
    resolve_group,
    scatter,
)
from te_compile.distributed.cross_entropy import vocab_parallel_cross_entropy
from te_compile.distributed.tensor_parallel import (
    PARALLEL_MODES,
    TensorParallel,
    gather_optimizer_state_dict,
    gather_state_dict,
    set_parallel_attributes,
    shard_optimizer_state_dict,
    shard_state_dict,
    shard_tensor,
    unshard_tensor,
)
from te_compile.quantization.recompute import checkpoint

__all__ = [
    "PARALLEL_MODES",
    "TensorParallel",
    "all_gather",
    "all_reduce",
    "all_reduce_grad",
    "all_reduce_max",
    "checkpoint",
    "gather_optimizer_state_dict",
    "gather_state_dict",
    "reduce_scatter",
    "resolve_group",
    "scatter",
    "set_parallel_attributes",
    "shard_optimizer_state_dict",
    "shard_state_dict",
    "shard_tensor",
    "unshard_tensor",
    "vocab_parallel_cross_entropy",
]
