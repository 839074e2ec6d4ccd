"""Sample inputs of ``te::delayed_scaling_update`` (``te_compile/functional/fp8_scaling.py``)."""

from __future__ import annotations

import torch

from tests.samples import SampleInput


def _samples(device: torch.device):
    limits = [448.0, 448.0, 57344.0]
    history, scale, last_amax = (torch.rand(4, 3, device=device), torch.ones(3, device=device),
                               torch.rand(3, device=device))  # fmt: skip
    yield SampleInput((history, scale, last_amax, limits, 0, "max"))
    # A zero last_amax amax keeps its old scale; margin 1 halves the new one.
    history, scale = torch.zeros(1, 2, device=device), torch.ones(2, device=device)
    last_amax = torch.tensor([0.0, 2.0], device=device)
    yield SampleInput((history, scale, last_amax, limits[:2], 1, "most_recent"))
    # A tiny amax: the scale overflows fp32 and becomes its largest finite value.
    history, last_amax = torch.zeros(2, 1, device=device), torch.tensor([1e-37], device=device)
    yield SampleInput((history, torch.ones(1, device=device), last_amax, limits[:1], 0, "max"))
    # The forward's and the backward's amaxes in their own buffers (FP8GemmState's).
    history, scale = torch.rand(3, 3, device=device), torch.rand(3, device=device) + 0.5
    fwd, grad = torch.rand(2, device=device), torch.rand(1, device=device)
    yield SampleInput((history, scale, fwd, limits, 0, "max", grad))


def _pair_samples(device: torch.device):
    """Two states of one LayerNormMLP (the forward's and the backward's amaxes in their own
    buffers), one updated by "max" over a leading-rows slice of a longer history."""
    limits = [448.0, 448.0, 57344.0]
    for algo, rows in (("max", 3), ("most_recent", 1)):
        states = []
        for _ in range(2):
            history = torch.rand(5, 3, device=device)[:rows]
            states += [history, torch.rand(3, device=device) + 0.5,
                       torch.rand(2, device=device), torch.rand(1, device=device)]  # fmt: skip
        yield SampleInput((*states, limits, 1, algo))
