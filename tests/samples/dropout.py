"""Sample inputs of ``te::dropout_fwd`` (``te_compile/functional/dropout_ops.py``)."""

from __future__ import annotations

import torch

from tests.samples import SampleInput, sample_tensor


def _samples(device: torch.device):
    t = sample_tensor(device)

    def state(seed, offset):
        return torch.tensor([seed, offset], dtype=torch.int64, device=device)

    yield SampleInput((t(5, 16), state(1234, 0), 0.1))
    # Odd sizes (not a multiple of 4 elements), a 64-bit seed, a large offset.
    yield SampleInput((t(2, 3, 7, dtype=torch.bfloat16), state(2**40 + 7, 2**33 + 5), 0.5))
    yield SampleInput((t(33, dtype=torch.float16), state(-5, 3), 0.9))
    yield SampleInput((t(4, 8), state(99, 1), 0.0))
    yield SampleInput((t(3, 5), state(7, 7), 1.0))
