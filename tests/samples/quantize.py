"""Sample inputs of the FP8 quantisers (``te_compile/functional/quantize.py``): small and odd
shapes (partial 128-blocks, leading dims, 1-D, empty), bf16/fp32/fp16, both FP8 formats, saturating
values, an all-zero tensor."""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._checks import FP8_DTYPES, HIGH_DTYPES
from te_compile.functional.quantize import quantize_blockwise_ref, quantize_current_ref
from tests.samples import SampleInput


def _randn(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype, std: float = 1.0):
    return (torch.randn(shape, device=device) * std).to(dtype)


def _scalar(device: torch.device, value: float) -> Tensor:
    return torch.tensor([value], device=device)


_E4M3, _E5M2 = FP8_DTYPES


_F32, _BF16, _F16 = HIGH_DTYPES


def _tensorwise_samples(device: torch.device) -> list[SampleInput]:
    return [
        SampleInput((_randn(device, (37, 45), _BF16), _scalar(device, 0.5), _E4M3, True)),
        # std 100 at scale 1000: most values saturate
        SampleInput((_randn(device, (2, 3, 20), _F32, 100), _scalar(device, 1e3), _E5M2, False)),
        SampleInput((_randn(device, (17,), _F16), _scalar(device, 2.0), _E4M3, True)),
        SampleInput((_randn(device, (0, 24), _BF16), _scalar(device, 1.0), _E5M2, True)),
    ]


def _current_samples(device: torch.device) -> list[SampleInput]:
    return [
        SampleInput((_randn(device, (37, 45), _BF16), _E4M3, True)),
        SampleInput(
            (_randn(device, (3, 5, 33), _F32, 1e-3), _E5M2, False),
            {"amax_epsilon": 1e-2, "power_2_scale": True},
        ),
        SampleInput((torch.zeros(4, 16, device=device), _E4M3, True), {"power_2_scale": True}),
    ]


def _blockwise_samples(device: torch.device) -> list[SampleInput]:
    return [
        SampleInput((_randn(device, (130, 200), _BF16), _E4M3, 1, True, True)),
        SampleInput((_randn(device, (3, 50, 129), _F32, 10), _E5M2, 128, False, True)),
        SampleInput((_randn(device, (5, 300), _F32), _E4M3, 1, False, False)),
        SampleInput((_randn(device, (130, 20), _F16), _E5M2, 128, True, False)),
    ]


def _dequantize_tensorwise_samples(device: torch.device) -> list[SampleInput]:
    data, _, scale_inv, _ = quantize_current_ref(_randn(device, (37, 45), _BF16), _E4M3, False)
    data5, _, scale_inv5, _ = quantize_current_ref(_randn(device, (2, 3, 20), _F32), _E5M2, False)
    return [
        SampleInput((data.view(torch.uint8), scale_inv, _E4M3, _BF16)),
        SampleInput((data5.view(torch.uint8), scale_inv5, _E5M2, _F32)),
    ]


def _dequantize_blockwise_samples(device: torch.device) -> list[SampleInput]:
    x = _randn(device, (130, 200), _F32)
    data, scale_inv, data_t, scale_inv_t = quantize_blockwise_ref(x, _E4M3, 1, False, True)
    data128, scale_inv128, _, _ = quantize_blockwise_ref(
        _randn(device, (3, 50, 129), _BF16), _E5M2, 128, True, False
    )
    return [
        SampleInput((data.view(torch.uint8), scale_inv, 1, _E4M3, _F32)),
        SampleInput((data_t.view(torch.uint8), scale_inv_t, 1, _E4M3, _F16)),
        SampleInput((data128.view(torch.uint8), scale_inv128, 128, _E5M2, _BF16)),
    ]
