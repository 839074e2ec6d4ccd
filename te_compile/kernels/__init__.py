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


@functools.lru_cache(maxsize=64)
def _host_constant(values: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.pin_memory() if pinned else tensor


def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device`` (not to be written to). On CUDA: a pinned host copy
    made once and an asynchronous copy per call. A device tensor cached across calls would, when
    first made inside a CUDA graph's warm-up (``torch.compile(mode="reduce-overhead")``), live in
    the graph's memory pool untracked, which its CUDA graphs refuse; a copy from pageable memory
    would make the host wait for the GPU. The copy from pinned memory does neither and is
    captured into the graph."""
    if device.type != "cuda":
        return _host_constant(values, dtype, False)
    return _host_constant(values, dtype, True).to(device, non_blocking=True)
