"""Sample inputs of ``te::fake_quantize_fwd`` (``te_compile/functional/fake_quantize_ops.py``)."""

from __future__ import annotations

import torch

from tests.samples import SampleInput, sample_tensor


def _samples(device: torch.device):
    t = sample_tensor(device)

    bf16, e4m3 = torch.bfloat16, "e4m3"
    yield SampleInput((t(5, 32), "current:e4m3", "current:e5m2"))
    yield SampleInput((t(3, 2, 128, dtype=bf16), "block:e4m3:p2", "block:e5m2:p2"))
    yield SampleInput((t(4, 64), "mxfp8:e4m3", "mxfp8:e5m2"))
    yield SampleInput((t(4, 64, dtype=bf16), "nvfp4", f"block:{e4m3}"))
    yield SampleInput((t(4, 64, dtype=bf16), "nvfp4:4over6=MAE/256", "nvfp4"))
    yield SampleInput((t(6, 48, dtype=torch.float16), "", f"current:{e4m3}"))
    # NVFP4 in row groups (an empty one, and 128 rows split mid-block-column), both ways.
    splits = torch.tensor([40, 0, 24, 64], device=device)
    yield SampleInput((t(128, 32, dtype=bf16), "nvfp4", "nvfp4", splits))
    yield SampleInput((t(2, 8, 32), "mxfp8:e4m3", "nvfp4", splits.new_tensor([6, 10])))
