"""Bulk allocation: many tensors from one device allocation, as ``te::bulk_allocate``.

Why: creating hundreds of small tensors one at a time (per-expert weight gradients of a
mixture-of-experts layer, FP8 scale and amax tensors, ...) pays an allocator call and its
bookkeeping per tensor, which dominates when the tensors are small. ``bulk_allocate`` makes one
allocation and returns the tensors carved out of it, each starting at an address that is a
multiple of its alignment (256 bytes by default, what vectorised kernels and cuBLAS like).

The op is C++ (``csrc/bulk_allocate.cpp``). Each returned tensor has its own storage that keeps
the shared buffer alive, and no two tensors overlap, so — as the schema says — the outputs do not
alias each other: the compiler may treat them as independent fresh tensors, exactly what the
fake implementation below produces. Like ``torch.empty`` the memory is uninitialised unless
``zero=True``, which clears the whole buffer with one fill instead of one per tensor.

Schema (the dispatcher has no nested lists, so shapes are flattened)::

    te::bulk_allocate(SymInt[] dims, int[] ranks, str[] dtypes, Device device,
                      int[] alignments, bool zero=False) -> Tensor[]

Tensor ``i`` has ``ranks[i]`` dimensions, taken in order from ``dims``; ``dtypes`` are names
(``"float32"``, ``"bfloat16"``: ``str(dtype)`` without ``"torch."``) because opcheck's schema
check cannot handle a ``ScalarType[]`` argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from te_compile import _csrc
from te_compile._checks import check_bool, check_device
from te_compile._library import extern_op

__all__ = ["bulk_allocate"]

_csrc.load()

DEFAULT_ALIGNMENT = 256


# The op takes dtype names ("float32"); every dtype is an attribute of the torch module.
_DTYPE_NAMES = {
    v: str(v).removeprefix("torch.") for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_INTS = (int, torch.SymInt)


def _bulk_allocate_fake(dims, ranks, dtypes, device, alignments, zero=False):
    """Fresh, independent tensors of the requested shapes; checks what the C++ kernel checks."""
    if len(dtypes) != len(ranks) or len(alignments) != len(ranks):
        raise ValueError(
            "te::bulk_allocate: ranks, dtypes and alignments need one entry per tensor, "
            f"got lengths {len(ranks)}, {len(dtypes)} and {len(alignments)}"
        )
    if any(r < 0 for r in ranks):
        raise ValueError(f"te::bulk_allocate: negative entry in ranks {ranks}")
    if sum(ranks) != len(dims):
        raise ValueError(
            f"te::bulk_allocate: ranks sum to {sum(ranks)} but dims has {len(dims)} entries"
        )
    out, start = [], 0
    for i, (rank, name, alignment) in enumerate(zip(ranks, dtypes, alignments, strict=True)):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f'te::bulk_allocate: dtypes[{i}] = "{name}" is not a dtype name (expected e.g. '
                '"float32")'
            )
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(
                f"te::bulk_allocate: alignments[{i}] must be a positive power of two, got "
                f"{alignment}"
            )
        shape = dims[start : start + rank]
        start += rank
        for d in shape:
            torch._check_value(
                d >= 0, lambda i=i, d=d: f"te::bulk_allocate: tensor {i} has negative dimension {d}"
            )
        make = torch.zeros if zero else torch.empty
        out.append(make(shape, dtype=dtype, device=device))
    return out


_op = extern_op(
    "bulk_allocate",
    fake=_bulk_allocate_fake,
    opaque="C++ (csrc/bulk_allocate.cpp): one host call allocates many tensors; under "
    "torch.compile Inductor plans the same buffers itself, so the op is never on a compiled path",
)


def bulk_allocate(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    device: torch.device | str | None = None,
    alignments: Sequence[int] | None = None,
    *,
    zero: bool = False,
) -> list[torch.Tensor]:
    """Tensors of the given shapes and dtypes on ``device``, all from one allocation.

    ``device`` defaults to ``torch.get_default_device()``, ``alignments`` to 256 bytes each
    (tensor ``i`` starts at a multiple of ``max(alignments[i], dtypes[i].itemsize)`` bytes).
    Uninitialised like ``torch.empty``, or zeros with ``zero=True``. Raises ValueError naming
    the argument for mismatched lengths, negative dimensions, non-dtype entries or alignments
    that are not positive powers of two (under ``torch.compile(fullgraph=True)`` Dynamo reports
    it as an ``Unsupported`` error that carries the same message).
    """
    for name, value in (("shapes", shapes), ("dtypes", dtypes), ("alignments", alignments)):
        if value is not None and (isinstance(value, (str, bytes)) or not hasattr(value, "__len__")):
            raise TypeError(f"bulk_allocate: {name} must be a sequence, got {value!r}")
    check_bool("bulk_allocate", zero=zero)
    check_device("bulk_allocate", "device", device)
    n = len(shapes)
    if len(dtypes) != n or (alignments is not None and len(alignments) != n):
        raise ValueError(
            "bulk_allocate: shapes, dtypes and alignments must have the same length, got "
            f"len(shapes)={n}, len(dtypes)={len(dtypes)}, len(alignments)="
            f"{n if alignments is None else len(alignments)}"
        )
    # One pass per argument, each a cheap loop: this runs on every eager call.
    dims: list[int] = []
    ranks: list[int] = []
    for i, shape in enumerate(shapes):
        try:
            dims.extend(shape)
        except TypeError:
            raise ValueError(
                f"bulk_allocate: shapes[{i}] must be a sequence of ints, got {shape!r}; "
                f"write ({shape},) for a 1-D shape"
            ) from None
        ranks.append(len(shape))
    for d in dims:
        if not isinstance(d, _INTS) or d < 0:  # the first shape that holds a bad entry
            for i, shape in enumerate(shapes):
                if any(not isinstance(d, _INTS) or d < 0 for d in shape):
                    raise ValueError(
                        f"bulk_allocate: shapes[{i}] must hold non-negative ints, got "
                        f"{tuple(shape)}"
                    )
    names = [_DTYPE_NAMES.get(d) if isinstance(d, torch.dtype) else None for d in dtypes]
    if None in names:
        i = names.index(None)
        raise ValueError(
            f"bulk_allocate: dtypes[{i}] must be a torch.dtype, got "
            f"{type(dtypes[i]).__name__} {dtypes[i]!r}"
        )
    alignments = [DEFAULT_ALIGNMENT] * n if alignments is None else list(alignments)
    for i, a in enumerate(alignments):
        if not isinstance(a, int) or a <= 0 or a & (a - 1):
            raise ValueError(
                f"bulk_allocate: alignments[{i}] must be an int that is a positive power of two, "
                f"got {a!r}"
            )
    if device is not None:
        device = torch.device(device)
    elif torch.compiler.is_compiling():
        # Dynamo cannot trace torch.get_default_device(); a 0-element factory call follows the
        # same default (torch.set_default_device / `with torch.device(...)`) and is dead code.
        device = torch.empty(0).device
    else:
        device = torch.get_default_device()
    return _op(dims, ranks, names, device, alignments, zero=zero)
