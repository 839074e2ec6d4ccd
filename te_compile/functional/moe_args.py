"""The arguments of the MoE routing functions (``functional/moe.py``): each check raises a
ValueError that names the function, the argument and the constraint, the same in eager and
while ``torch.compile`` traces (shapes, dtypes and Python scalars only: no tensor data read)."""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_choice,
    check_same_device,
    check_tensor,
)

MAP_TYPES = ("mask", "index")
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64)


def fail(prefix: str, message: str) -> None:
    raise ValueError(f"{prefix}: {message}")


def _check_float(prefix: str, name: str, t: Tensor, dims: int) -> None:
    if t.dtype not in FLOAT_DTYPES:
        fail(prefix, f"{name}.dtype must be float32, bfloat16, float16 or float64, got {t.dtype}")
    if t.dim() != dims:
        fail(prefix, f"{name} must be {dims}-D, got {t.dim()}-D {list(t.shape)}")


def _check_probs(prefix: str, name: str, probs: Tensor | None, shape, inp: Tensor) -> None:
    if probs is None:
        return
    if not probs.is_floating_point():
        fail(prefix, f"{name}.dtype must be a floating type, got {probs.dtype}")
    if tuple(probs.shape) != tuple(shape):
        fail(prefix, f"{name} must have shape {list(shape)}, got {list(probs.shape)}")
    check_same_device(prefix, "inp", inp, **{name: probs})


def check_permute_args(
    inp: Tensor,
    routing_map: Tensor,
    probs: Tensor | None,
    num_out_tokens: int,
    map_type: str,
    prefix: str = "te.moe_permute",
) -> None:
    """Shapes, dtypes and scalars of a permute (the same message in eager and at trace time)."""
    check_choice(prefix, "map_type", map_type, MAP_TYPES)
    _check_float(prefix, "inp", inp, 2)
    if routing_map.dtype not in (_MASK_DTYPES if map_type == "mask" else INDEX_DTYPES):
        kinds = "bool or an integer type" if map_type == "mask" else "int32 or int64"
        fail(
            prefix,
            f"routing_map.dtype must be {kinds} for map_type={map_type!r}, got {routing_map.dtype}",
        )
    if routing_map.dim() != 2 or routing_map.shape[0] != inp.shape[0]:
        what = "[num_tokens, num_experts]" if map_type == "mask" else "[num_tokens, topK]"
        fail(
            prefix,
            f"routing_map must be {what} with num_tokens = inp.shape[0] "
            f"({inp.shape[0]}), got {list(routing_map.shape)}",
        )
    check_same_device(prefix, "inp", inp, routing_map=routing_map)
    _check_probs(prefix, "probs", probs, routing_map.shape, inp)
    slots = routing_map.shape[0] * routing_map.shape[1]
    if not 0 <= num_out_tokens <= slots:
        fail(
            prefix,
            f"num_out_tokens must be in [0, {slots}] (num_tokens * "
            f"routing_map.shape[1]), got {num_out_tokens}",
        )


def check_unpermute_args(
    inp: Tensor, row_id_map: Tensor, merging_probs: Tensor | None, prefix: str = "te.moe_unpermute"
) -> None:
    _check_float(prefix, "inp", inp, 2)
    if row_id_map.dtype != torch.int32 or row_id_map.dim() != 2:
        fail(
            prefix,
            f"row_id_map must be the int32 [num_tokens, slots] map moe_permute "
            f"returned, got {row_id_map.dtype} {list(row_id_map.shape)}",
        )
    check_same_device(prefix, "inp", inp, row_id_map=row_id_map)
    _check_probs(prefix, "merging_probs", merging_probs, row_id_map.shape, inp)


def check_sort_chunks_args(
    inp: Tensor,
    split_sizes: Tensor,
    sorted_index: Tensor,
    probs: Tensor | None,
    prefix: str = "te.moe_sort_chunks_by_index",
) -> None:
    _check_float(prefix, "inp", inp, 2)
    for name, t in (("split_sizes", split_sizes), ("sorted_index", sorted_index)):
        if t.dtype not in INDEX_DTYPES or t.dim() != 1 or t.shape[0] < 1:
            fail(
                prefix,
                f"{name} must be a 1-D int32 or int64 tensor with at least one chunk, "
                f"got {t.dtype} {list(t.shape)}",
            )
        check_same_device(prefix, "inp", inp, **{name: t})
    if sorted_index.shape[0] != split_sizes.shape[0]:
        fail(
            prefix,
            f"sorted_index must have one entry per chunk ({split_sizes.shape[0]}), "
            f"got {sorted_index.shape[0]}",
        )
    _check_probs(prefix, "probs", probs, inp.shape[:1], inp)


def int_arg(prefix: str, name: str, value) -> int:
    """An int ``>= -1`` (None: -1, the default)."""
    if value is None:
        return -1
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool) or not value >= -1:
        fail(prefix, f"{name} must be an int >= -1 or None, got {value!r}")
    return value


def check_tensor_args(prefix: str, optional: tuple[str, ...] = (), **tensors: object) -> None:
    """Each value is a tensor (None only for the names in ``optional``): a list, a number or
    None is refused by name before the shape checks read it."""
    for name, t in tensors.items():
        if t is not None or name not in optional:
            check_tensor(prefix, name, t, floating=False, min_dim=0)


def num_out(prefix: str, routing_map: Tensor, num_out_tokens, map_type: str) -> int:
    """``num_out_tokens`` resolved: for indices, ``T * K`` when not positive (None, -1, 0: as
    Transformer Engine reads it); the mask needs it (0 is 0 rows there)."""
    n = int_arg(prefix, "num_out_tokens", num_out_tokens)
    check_choice(prefix, "map_type", map_type, MAP_TYPES)
    if map_type == "index" and routing_map.dim() == 2:
        return n if n > 0 else routing_map.shape[0] * routing_map.shape[1]
    if n >= 0 or routing_map.dim() != 2:  # (a bad routing_map: refused by the op's check)
        return n
    fail(
        prefix,
        "num_out_tokens must be given for map_type='mask': the number of routed tokens, "
        "routing_map.sum() (not read here: that would synchronise with the device)",
    )
