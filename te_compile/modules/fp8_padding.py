"""``te_compile.Fp8Padding`` / ``Fp8Unpadding``: Transformer Engine's row padding of grouped GEMM
inputs, each group's rows padded with zero rows to a multiple of ``align_size``.

``Fp8Padding(num_gemms, align_size=None)(inp, m_splits) -> (out, padded_m_splits)``: group ``g``'s
``m_splits[g]`` rows of ``inp`` (consecutive, in order) followed by zero rows up to
``padded_m_splits[g] = ceil(m_splits[g] / align_size) * align_size``; ``inp [..., features]`` is
taken as ``[rows, features]`` and the result is 2-D, as in Transformer Engine.
``Fp8Unpadding(num_gemms, align_size=None)(inp, m_splits) -> out`` drops them again
(``m_splits``: the unpadded sizes). Each is the other's backward.

``m_splits`` is a list of ints, as in Transformer Engine: the padded row count is a shape, so it
is known on the host. (te_compile's grouped modules take any row counts in every recipe, so the
padding is needed only by code written for Transformer Engine.) Under ``torch.compile`` the
splits are constants of the graph: a new routing recompiles, as for any list of sizes.

``align_size=None``: 32 under an MXFP8 recipe, 128 under NVFP4, else 16, as Transformer Engine
picks (``quantization.get_align_size_for_quantization``). It reads the recipe of the autocast
region active at every ``forward`` (Transformer Engine reads it once, at the first forward, and
keeps it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_compile._checks import shown
from te_compile.modules._common import check_positive
from te_compile.quantization.recipe import get_align_size_for_quantization
from te_compile.quantization.state import get_autocast_state

__all__ = ["Fp8Padding", "Fp8Unpadding"]


def _align(align_size: int | None) -> int:
    if align_size is not None:
        return align_size
    return get_align_size_for_quantization(get_autocast_state().recipe)


def _check_splits(owner: str, num_gemms: int, inp: Tensor, m_splits: object) -> list[int]:
    if not isinstance(inp, Tensor):
        raise TypeError(f"{owner}: inp must be a torch.Tensor, got {type(inp).__name__}")
    if isinstance(m_splits, (Tensor, str)) or not isinstance(m_splits, Sequence):
        raise TypeError(
            f"{owner}: m_splits must be a list of ints (the padded row count is a shape, known "
            f"on the host), got {shown(m_splits)}"
        )
    splits = list(m_splits)
    if len(splits) != num_gemms:
        raise ValueError(
            f"{owner}: m_splits must have num_gemms={num_gemms} entries, got {m_splits!r}"
        )
    for m in splits:
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{owner}: m_splits must hold ints >= 0, got {splits}")
    if inp.dim() < 2:
        raise ValueError(
            f"{owner}: inp must be [rows, features] (or [..., features]), got {inp.dim()} dims"
        )
    return splits


def _check_init(owner: str, num_gemms: int, align_size: int | None) -> None:
    check_positive(owner, num_gemms=num_gemms)
    if align_size is not None:
        check_positive(owner, align_size=align_size)


def _padded(splits: list[int], align: int) -> list[int]:
    return [(m + align - 1) // align * align for m in splits]


class Fp8Padding(nn.Module):
    """Pads each group's rows of a grouped GEMM input with zero rows to a multiple of
    ``align_size`` (module docstring)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        _check_init("Fp8Padding", num_gemms, align_size)
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: Tensor, m_splits: Sequence[int]) -> tuple[Tensor, list[int]]:
        owner = "Fp8Padding"
        splits = _check_splits(owner, self.num_gemms, inp, m_splits)
        rows = inp.reshape(-1, inp.shape[-1])
        if sum(splits) != rows.shape[0]:
            raise ValueError(
                f"{owner}: m_splits must sum to inp's {rows.shape[0]} rows, got {splits} (sum "
                f"{sum(splits)})"
            )
        padded = _padded(splits, _align(self.align_size))
        if padded == splits:
            return rows, splits
        groups = zip(rows.split(splits), splits, padded, strict=True)
        out = torch.cat([F.pad(x, (0, 0, 0, p - m)) for x, m, p in groups])
        return out, padded

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"


class Fp8Unpadding(nn.Module):
    """Drops the zero rows :class:`Fp8Padding` added: ``m_splits`` are the unpadded sizes
    (module docstring)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        _check_init("Fp8Unpadding", num_gemms, align_size)
        self.num_gemms, self.align_size = num_gemms, align_size

    def forward(self, inp: Tensor, m_splits: Sequence[int]) -> Tensor:
        owner = "Fp8Unpadding"
        splits = _check_splits(owner, self.num_gemms, inp, m_splits)
        padded = _padded(splits, _align(self.align_size))
        rows = inp.reshape(-1, inp.shape[-1])
        if sum(padded) != rows.shape[0]:
            raise ValueError(
                f"{owner}: inp has {rows.shape[0]} rows, m_splits padded to a multiple of "
                f"{_align(self.align_size)} sum to {sum(padded)}"
            )
        if padded == splits:
            return rows
        return torch.cat([x[:m] for x, m in zip(rows.split(padded), splits, strict=True)])

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"
