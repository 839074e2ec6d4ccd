"""Sample inputs of every te op but the backward ops: test data, kept out of the library.

:data:`SAMPLES` maps an op's qualified name (``"te::linear_fwd"``) to its sample function,
``fn(device) -> Iterable[SampleInput]``; ``tests/samples/<family>.py`` holds a family's.
``tests/test_registry.py`` runs every op on its samples and fails for a forward op without any,
so an op cannot be added untested. Backward ops get their inputs from the calls their forward's
autograd makes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class SampleInput:
    """One call of an op for the registry test: positional args (tensors that should receive
    gradients have ``requires_grad=True``) and keyword args."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


SampleFn = Callable[[torch.device], Iterable[SampleInput]]


def sample_tensor(device: torch.device) -> Callable[..., torch.Tensor]:
    """``t(*shape, dtype=torch.float32, grad=True)``: a sample function's ``torch.randn``
    tensor on ``device`` (``requires_grad=grad``)."""

    def t(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    return t


# The families import SampleInput and sample_tensor from above.
from tests.samples import (  # noqa: E402
    activation,
    allocate,
    attention,
    dense_weight,
    dropout,
    fake_quantize,
    fp8_scaling,
    grouped_linear,
    grouped_weight,
    linear,
    mlp,
    moe,
    norm,
    quantize,
    quantize_mx,
    rotary,
)

SAMPLES: dict[str, SampleFn] = {
    "te::activation_fwd": activation._activation_samples,
    "te::attention_fwd": attention._samples,
    "te::branch_rmsnorm_fwd": norm.rmsnorm_samples,  # te::rmsnorm_fwd's arguments
    "te::bulk_allocate": allocate.bulk_allocate_samples,
    "te::delayed_scaling_update": fp8_scaling._samples,
    "te::delayed_scaling_update_pair": fp8_scaling._pair_samples,
    "te::dequantize_blockwise": quantize._dequantize_blockwise_samples,
    "te::dequantize_mxfp8": quantize_mx._dequantize_mxfp8_samples,
    "te::dequantize_nvfp4": quantize_mx._dequantize_nvfp4_samples,
    "te::dequantize_tensorwise": quantize._dequantize_tensorwise_samples,
    "te::dropout_fwd": dropout._samples,
    "te::fake_quantize_fwd": fake_quantize._samples,
    "te::gated_activation_fwd": activation._gated_samples,
    "te::grouped_linear_fwd": grouped_linear.grouped_linear_samples,
    "te::l2normalization_fwd": norm._l2normalization_samples,
    "te::layernorm_fwd": norm._layernorm_samples,
    "te::linear_fwd": linear.linear_samples,
    "te::mlp_fwd": mlp.mlp_samples,
    "te::moe_permute_fwd": moe._permute_samples,
    "te::moe_sort_chunks_fwd": moe._sort_samples,
    "te::moe_unpermute_fwd": moe._unpermute_samples,
    "te::quantize_blockwise": quantize._blockwise_samples,
    "te::quantize_current": quantize._current_samples,
    "te::quantize_grouped_weight": grouped_weight._samples,
    "te::quantize_mxfp8": quantize_mx._quantize_mxfp8_samples,
    "te::quantize_nvfp4": quantize_mx._quantize_nvfp4_samples,
    "te::quantize_tensorwise": quantize._tensorwise_samples,
    "te::quantize_weight": dense_weight._quantize_weight_samples,
    "te::rmsnorm_fwd": norm.rmsnorm_samples,
    "te::rotary_fwd": rotary._samples,
}
