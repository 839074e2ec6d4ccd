"""Sample inputs of the norm ops (``te_compile/functional/norm.py``); ``te::branch_rmsnorm_fwd``
(``fused_norm.py``) takes ``te::rmsnorm_fwd``'s."""

from __future__ import annotations

import torch

from tests.samples import SampleInput, sample_tensor


def _layernorm_samples(device: torch.device):
    t = sample_tensor(device)
    bf16, fp16 = torch.bfloat16, torch.float16
    yield SampleInput((t(5, 16), t(16), t(16), 1e-5, False))
    # bf16 activations with fp32 parameters, 3-D, zero-centred gamma.
    yield SampleInput((t(2, 3, 24, dtype=bf16), t(24), t(24), 1e-5, True))
    yield SampleInput((t(7, 33, dtype=bf16), t(33, dtype=bf16), None, 1e-3, False))
    yield SampleInput((t(3, 4, 8, dtype=fp16), t(8, dtype=fp16), t(8, dtype=fp16), 1e-5, True))


def rmsnorm_samples(device: torch.device):
    t = sample_tensor(device)
    yield SampleInput((t(5, 16), t(16), 1e-5, False))
    yield SampleInput((t(2, 3, 24, dtype=torch.bfloat16), t(24), 1e-5, True))
    yield SampleInput((t(7, 33, dtype=torch.bfloat16), t(33, dtype=torch.bfloat16), 1e-3, False))
    yield SampleInput((t(3, 4, 8, dtype=torch.float16), t(8, dtype=torch.float16), 1e-5, True))


def _l2normalization_samples(device: torch.device):
    t = sample_tensor(device)
    yield SampleInput((t(5, 16), 1e-6))
    yield SampleInput((t(2, 3, 24, dtype=torch.bfloat16), 1e-6))
    yield SampleInput((t(7, 33, dtype=torch.float16), 1e-3))
