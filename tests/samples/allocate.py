"""Sample inputs of ``te::bulk_allocate`` (``te_compile/functional/allocate.py``)."""

from __future__ import annotations

import torch

from te_compile.functional.allocate import _DTYPE_NAMES
from tests.samples import SampleInput


def bulk_allocate_samples(device: torch.device) -> list[SampleInput]:
    """Sample calls of ``torch.ops.te.bulk_allocate`` for the registry's opcheck.

    ``zero=True`` throughout: opcheck compares eager and compiled outputs by value, which is
    meaningless for uninitialised memory."""

    def sample(shapes, dtypes, alignments):
        dims = [d for shape in shapes for d in shape]
        ranks = [len(shape) for shape in shapes]
        names = [_DTYPE_NAMES[dtype] for dtype in dtypes]
        return SampleInput((dims, ranks, names, device, list(alignments)), {"zero": True})

    f32, bf16, f16, i64, u8 = torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8
    return [
        sample([(4, 8), (3,), (2, 2, 2), ()], [f32, bf16, i64, f16], [256, 16, 1024, 1]),
        sample([(0,), (5, 0), (7,), (3, 5)], [f16, f32, u8, f32], [1, 16, 256, 1024]),
        sample([(1,)], [torch.float8_e4m3fn], [16]),
        sample([], [], []),
    ]
