"""Sample inputs of ``te::rotary_fwd`` (``te_compile/functional/rotary.py``)."""

from __future__ import annotations

import torch

from te_compile.functional.rotary import rotary_frequencies
from tests.samples import SampleInput, sample_tensor


def _samples(device: torch.device):
    t = sample_tensor(device)

    def freqs(rows, d2, interleaved=False):
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d2, 2, dtype=torch.float32) / d2)
        return rotary_frequencies(inv_freq.to(device), rows, interleaved=interleaved)

    def cu(*values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    yield SampleInput((t(5, 2, 3, 8), freqs(7, 8), None, "sbhd", False, 1, 0))
    # bshd, interleaved, partial rotary (8 of 12 channels), a transposed (strided) input.
    bshd = torch.randn(5, 2, 3, 12, device=device, dtype=torch.bfloat16).transpose(0, 1)
    yield SampleInput((bshd.requires_grad_(), freqs(6, 8, True), None, "bshd", True, 1, 0))
    # thd, uneven sequences, freqs whose pair members differ (the backward's partner sines).
    rand = torch.randn(6, 1, 1, 6, device=device) * 3
    yield SampleInput((t(11, 2, 8, dtype=torch.float16), rand, cu(0, 3, 7, 11), "thd", False, 1, 0))
    # Context parallelism: rank 1 of 2 (sbhd), rank 0 of 2 (thd, interleaved, int64 offsets).
    yield SampleInput((t(4, 2, 2, 8), freqs(8, 8), None, "sbhd", False, 2, 1))
    thd_cp = (t(8, 2, 6), freqs(8, 4, True), cu(0, 4, 12, 16, dtype=torch.int64))
    yield SampleInput((*thd_cp, "thd", True, 2, 0))
