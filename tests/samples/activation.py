"""Sample inputs of the activation ops (``te_compile/functional/activation.py``)."""

from __future__ import annotations

import torch

from tests.samples import SampleInput, sample_tensor


def _activation_samples(device: torch.device):
    t, bf16, fp16 = sample_tensor(device), torch.bfloat16, torch.float16
    yield SampleInput((t(5, 16), None, "gelu"))
    yield SampleInput((t(2, 3, 24, dtype=bf16), t(24, dtype=bf16), "qgelu"))
    yield SampleInput((t(7, 33), t(33), "relu"))
    yield SampleInput((t(4, 8, dtype=fp16), None, "srelu"))
    yield SampleInput((t(2, 3, 10, dtype=bf16), t(10, dtype=bf16), "silu"))


def _gated_samples(device: torch.device):
    t, bf16, fp16 = sample_tensor(device), torch.bfloat16, torch.float16
    yield SampleInput((t(5, 16), None, "swiglu", 0, 7.0, 1.702, 1.0))
    yield SampleInput((t(2, 3, 16, dtype=bf16), t(16, dtype=bf16), "geglu", 4, 7.0, 1.702, 1.0))
    yield SampleInput((t(6, 12), t(12), "glu", 0, 7.0, 1.702, 1.0))
    yield SampleInput((t(3, 8, dtype=fp16), None, "reglu", 2, 7.0, 1.702, 1.0))
    yield SampleInput((t(2, 2, 24, dtype=bf16), None, "sreglu", 1, 7.0, 1.702, 1.0))
    yield SampleInput((t(4, 32), t(32), "qgeglu", 8, 7.0, 1.702, 1.0))
    # A small limit so that both clamps cut.
    yield SampleInput(
        (t(2, 3, 32, dtype=bf16), t(32, dtype=bf16), "clamped_swiglu", 4, 0.75, 1.702, 0.5)
    )
    # Small betas (limit, alpha slots) so that both tanh caps bend; one default-beta sample.
    yield SampleInput((t(3, 5, 16), t(16), "situglu", 2, 0.5, 0.75, 0.0))
    yield SampleInput((t(4, 24, dtype=bf16), None, "situglu", 0, 4.0, 25.0, 0.0))
