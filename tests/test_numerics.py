"""``te_compile._numerics``: correctly rounded divisions, eager and compiled, on every device."""

from __future__ import annotations

import pytest
import torch

from te_compile._numerics import div_rn, reciprocal_rn
from tests.utils import DEVICES, assert_bits_equal


def _operands(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    a = torch.exp2(torch.randint(-30, 30, (4096,)).float()) * (1 + torch.rand(4096))
    b = torch.exp2(torch.randint(-30, 30, (4096,)).float()) * (1 + torch.rand(4096))
    return a.to(device), b.to(device)


def test_quotients_are_the_correctly_rounded_ones():
    """The float64 quotient rounded once to float32 equals the float32 division of the CPU
    (IEEE, correctly rounded); a number over a tensor is one division, not the number times
    the tensor's reciprocal (which differs here in some elements)."""
    a, b = _operands("cpu")
    assert_bits_equal(div_rn(a, b), a / b)
    assert_bits_equal(reciprocal_rn(b), torch.div(torch.ones_like(b), b))
    assert_bits_equal(div_rn(448.0, b), torch.div(torch.full_like(b, 448.0), b))
    assert (448.0 * b.reciprocal() != torch.div(torch.full_like(b, 448.0), b)).any()
    assert div_rn(a.double(), b.double()).dtype == torch.float64


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_equals_eager(device):
    """Inductor's code (on CUDA Triton, whose fp32 ``/`` is approximate) gives eager's bits."""
    a, b = _operands(device)

    def f(x, y):
        return div_rn(x, y), reciprocal_rn(y), div_rn(2688.0, y)

    compiled = torch.compile(f, fullgraph=True)
    for got, want in zip(compiled(a, b), f(a, b), strict=True):
        assert_bits_equal(got.cpu(), want.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
def test_a_number_operand_is_captured_in_a_cuda_graph():
    """A number operand becomes a tensor on the device without a host-to-device copy, which a
    CUDA graph capture refuses (the FP8 modules' graphed callables divide by scales this way)."""
    _, b = _operands("cuda")
    want = div_rn(2688.0, b), reciprocal_rn(b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = div_rn(2688.0, b), reciprocal_rn(b)
    graph.replay()
    for g, w in zip(got, want, strict=True):
        assert_bits_equal(g.cpu(), w.cpu())
