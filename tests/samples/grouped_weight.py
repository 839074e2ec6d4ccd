"""Sample inputs of ``te::quantize_grouped_weight``
(``te_compile/functional/grouped_weight.py``)."""

from __future__ import annotations

import torch

from tests.samples import SampleInput, sample_tensor


def _samples(device: torch.device):
    t, bf16 = sample_tensor(device), torch.bfloat16
    # Two layouts (a full opcheck costs ~3 s each on the CPU): tests/modules/
    # test_fp8_weight_cache.py checks every kind's bytes and its fake's shapes.
    yield SampleInput((t(3, 32, 16, dtype=bf16, grad=False), "current:e4m3", None))
    yield SampleInput((t(2, 32, 144, dtype=bf16, grad=False), "block:e4m3:p2", None))
