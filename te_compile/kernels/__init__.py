"""Device code only: Triton kernels and their launch wrappers (no torch.library here)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=32)
def programs_per_sm(device: torch.device, per_sm: int, off_cuda: int = 4) -> int:
    """``per_sm`` programs for every SM of ``device``'s GPU: the size of a launch of programs
    that each walk many row tiles. Off CUDA (the Triton interpreter) a fixed ``off_cuda``, so
    that tests exercise programs owning several tiles."""
    if device.type == "cuda":
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return off_cuda
