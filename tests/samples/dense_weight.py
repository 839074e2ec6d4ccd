"""Sample inputs of ``te::quantize_weight`` (``te_compile/functional/dense_weight.py``)."""

from __future__ import annotations

import torch

from tests.samples import SampleInput


def _quantize_weight_samples(device: torch.device):
    def w(n, k, dtype=torch.bfloat16):
        return torch.randn(n, k, device=device, dtype=dtype)

    yield SampleInput((w(32, 16), "current:e4m3", None))
    scale = torch.tensor([8.0, 16.0, 1.0], device=device)
    yield SampleInput((w(16, 48, torch.float32), "delayed:e4m3", scale))
    yield SampleInput((w(512, 512), "block:e4m3:128x128", None))
    yield SampleInput((w(32, 256), "block:e4m3:p2", None))
    yield SampleInput((w(64, 32), "mxfp8:e4m3:emulate", None))
    yield SampleInput((w(32, 48), "nvfp4:emulate", None))
    yield SampleInput((w(32, 48), "nvfp4:16x16:emulate:4over6=MSE/256", None))
