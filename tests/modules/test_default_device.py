"""``device=None``: Transformer Engine's default, CUDA where a CUDA device is present, unless
torch's default device is set (``torch.set_default_device``, ``with torch.device(...)``), which
then applies; without CUDA, torch's default device. On the CPU the resolution is checked with
CUDA's presence patched, and every module's parameters and buffers are checked to follow it by
making the default device ``meta`` for the test."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from te_compile import _checks
from tests.utils import requires_cuda

pytestmark = pytest.mark.te_default_device

MODULES = {
    "Linear": lambda: te.Linear(16, 8),
    "LayerNormLinear": lambda: te.LayerNormLinear(16, 8),
    "LayerNormMLP": lambda: te.LayerNormMLP(16, 32),
    "GroupedLinear": lambda: te.GroupedLinear(2, 16, 8),
    "GroupedMLP": lambda: te.GroupedMLP(2, 16, 32),
    "LayerNorm": lambda: te.LayerNorm(16),
    "RMSNorm": lambda: te.RMSNorm(16),
    "RotaryPositionEmbedding": lambda: te.RotaryPositionEmbedding(8),
    "DotProductAttention": lambda: te.DotProductAttention(4, 8, softmax_type="learnable"),
    "MultiheadAttention": lambda: te.MultiheadAttention(32, 4, softmax_type="learnable"),
    "TransformerLayer": lambda: te.TransformerLayer(32, 64, 4, softmax_type="learnable"),
    "ops.Linear": lambda: te.ops.Linear(16, 8),
    "ops.BasicLinear": lambda: te.ops.BasicLinear(16, 8),
    "ops.Bias": lambda: te.ops.Bias(8),
    "ops.GroupedLinear": lambda: te.ops.GroupedLinear(2, 16, 8),
    "ops.LayerNorm": lambda: te.ops.LayerNorm(16),
    "ops.RMSNorm": lambda: te.ops.RMSNorm(16),
    "ops.Quantize": lambda: te.ops.Quantize(),
    "convert.CausalLM": lambda: te.convert.CausalLM(64, 32, 64, 2, 4, 2, 8),
}


def _devices(module: torch.nn.Module) -> set[str]:
    tensors = [*module.parameters(), *module.buffers()]
    assert tensors, "the module has no state to place"
    return {t.device.type for t in tensors}


def test_device_none_is_cuda_where_present_unless_torch_default_is_set(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _checks.default_device("M", None) == "cuda"
    assert _checks.default_device("M", "cpu") == "cpu"
    with torch.device("meta"):
        assert _checks.default_device("M", None) is None
    torch.set_default_device("cpu")
    try:
        assert _checks.default_device("M", None) is None
    finally:
        torch.set_default_device(None)
    assert _checks.default_device("M", None) == "cuda"


def test_device_none_without_cuda_is_torch_default(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _checks.default_device("M", None) is None
    assert te.Linear(4, 4).weight.device.type == "cpu"


@pytest.mark.parametrize("name", MODULES)
def test_every_module_places_its_state_on_the_default(monkeypatch, name):
    """With the default device made ``meta`` and CUDA's presence patched, every parameter and
    buffer (the children's, FP8 state and sink logits included) lands on it; an explicit
    ``with torch.device("cpu")`` block keeps them on the CPU."""
    monkeypatch.setattr(_checks, "cuda_is_default", lambda: True)
    monkeypatch.setattr(_checks, "TE_DEFAULT_DEVICE", "meta")
    assert _devices(MODULES[name]()) == {"meta"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_checks, "cuda_is_default", _cuda_is_default)
    with torch.device("cpu"):
        assert _devices(MODULES[name]()) == {"cpu"}


_cuda_is_default = _checks.cuda_is_default


def test_a_bad_device_is_refused_by_name():
    with pytest.raises(ValueError, match="Linear: device is not a device"):
        te.Linear(4, 4, device="gpu0")


@requires_cuda
def test_cuda_modules_are_built_on_cuda_and_run():
    layer = te.TransformerLayer(64, 128, 4)
    assert _devices(layer) == {"cuda"}
    x = torch.randn(8, 2, 64, device="cuda")
    layer(x).sum().backward()
    assert layer.self_attention.proj.weight.grad.is_cuda
    with torch.device("cpu"):
        assert _devices(te.Linear(8, 8)) == {"cpu"}
