"""The dropout Triton kernel (``te_compile.kernels.dropout``) against the CPU implementation of
``te_compile.functional.dropout_ops``, bit for bit: the Philox words (64-bit seeds and offsets,
sizes that are not a multiple of 4 or of the block) and the outputs (every dtype, special
values, p = 0 and 1). Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.utils import TRITON_DEVICE, assert_bits_equal, requires_triton

kernels = pytest.importorskip("te_compile.kernels.dropout")
ref = importlib.import_module("te_compile.functional.dropout_ops")

pytestmark = [pytest.mark.triton, requires_triton]

STATES = [(1234, 0), (2**40 + 7, 2**33 + 5), (-5, 3), (2**62 - 1, 2**62 - 3)]


def _state(seed, offset, device="cpu"):
    return torch.tensor([seed, offset], dtype=torch.int64, device=device)


@pytest.mark.parametrize(("seed", "offset"), STATES)
@pytest.mark.parametrize("numel", [1, 37, kernels.BLOCK + 6])
def test_words_match_the_cpu_generator(seed, offset, numel):
    words = kernels.random_words(_state(seed, offset, TRITON_DEVICE), numel)
    assert torch.equal(words.cpu(), ref.random_words(_state(seed, offset), numel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
def test_dropout_matches_the_cpu_reference_bitwise(p, dtype):
    x = torch.randn(3, 700).to(dtype)
    specials = [1e-40, -0.0, float("inf"), float("nan"), 3e38, -1e-3]
    x[0, : len(specials)] = torch.tensor(specials).to(dtype)
    state = _state(5, 9)
    out = kernels.dropout(
        x.to(TRITON_DEVICE), state.to(TRITON_DEVICE), ref.threshold(p), ref.scale(p)
    )
    assert_bits_equal(out, ref.dropout_ref(x, state, p))
