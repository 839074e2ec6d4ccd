"""Sample inputs of the MXFP8 and NVFP4 quantisers (``te_compile/functional/quantize_mx.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile.functional.quantize_mx_ref import quantize_mxfp8_ref, quantize_nvfp4_ref
from tests.samples import SampleInput


def _x(device: torch.device, *shape: int, dtype=torch.float32, spread: float = 4.0) -> Tensor:
    """Values over several binades, so blocks get different scales."""
    x = torch.randn(*shape) * torch.exp2(torch.randint(-4, 5, shape) * spread / 4)
    return x.to(device=device, dtype=dtype)


def _quantize_mxfp8_samples(device: torch.device):
    yield SampleInput((_x(device, 5, 40, dtype=torch.bfloat16), torch.float8_e4m3fn, True, True))
    yield SampleInput((_x(device, 2, 3, 64), torch.float8_e5m2, True, False))
    yield SampleInput((_x(device, 33, 7), torch.float8_e4m3fn, False, True))


def _dequantize_mxfp8_samples(device: torch.device):
    for shape, fp8_dtype, out_dtype in [
        ((5, 40), torch.float8_e4m3fn, torch.bfloat16),
        ((2, 3, 64), torch.float8_e5m2, torch.float32),
    ]:
        data, scale, _, _ = quantize_mxfp8_ref(_x(torch.device("cpu"), *shape), fp8_dtype)
        data = data.view(torch.uint8).to(device)
        yield SampleInput((data, scale.to(device), fp8_dtype, out_dtype))


def _quantize_nvfp4_samples(device: torch.device):
    yield SampleInput((_x(device, 6, 40, dtype=torch.bfloat16), None, True, True))
    yield SampleInput((_x(device, 2, 3, 32), torch.tensor([8.0], device=device), True, False))
    yield SampleInput((_x(device, 34, 7), None, False, True))


def _dequantize_nvfp4_samples(device: torch.device):
    for shape, out_dtype in [((6, 40), torch.bfloat16), ((2, 3, 32), torch.float32)]:
        data, scale, g, _, _ = quantize_nvfp4_ref(_x(torch.device("cpu"), *shape))
        scale = scale.view(torch.uint8).to(device)
        yield SampleInput((data.to(device), scale, g.to(device), out_dtype))
