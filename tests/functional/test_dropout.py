"""Dropout (``te::dropout_fwd/_bwd``): the Philox4x32-10 generator against the published known
answers, the mask as a pure function of ``(seed, offset, index)``, the forward and backward
against a reference built from that mask, the drop rate, and the point of the explicit RNG
state: activation checkpointing recomputes the same mask, eager and compiled."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.utils.checkpoint

from te_compile import functional as F
from te_compile import ops
from tests.utils import DEVICES, assert_bits_equal

D = importlib.import_module("te_compile.functional.dropout_ops")


def _state(seed, offset, device="cpu"):
    return torch.tensor([seed, offset], dtype=torch.int64, device=device)


# Known-answer vectors of Random123 (kat_vectors, philox4x32_10): counter, key -> output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KAT)
def test_philox_matches_the_known_answers(counter, key, expected):
    words = D.philox4x32(
        tuple(torch.tensor(c) for c in counter), tuple(torch.tensor(k) for k in key)
    )
    assert tuple(int(w) for w in words) == expected


def test_words_are_the_philox_outputs_in_element_order():
    seed, offset = 0x1234_5678_9ABC, 0x42_0000_0007
    words = D.random_words(_state(seed, offset), 10)
    for i in range(10):
        g = torch.tensor(i // 4)
        out = D.philox4x32(
            (g, torch.tensor(0), torch.tensor(offset & 0xFFFFFFFF), torch.tensor(offset >> 32)),
            (torch.tensor(seed & 0xFFFFFFFF), torch.tensor(seed >> 32)),
        )
        assert int(words[i]) == int(out[i % 4])


def test_mask_is_a_function_of_seed_offset_and_index():
    m = D.dropout_mask(_state(7, 0), (64, 33), 0.5)
    assert torch.equal(m, D.dropout_mask(_state(7, 0), (64, 33), 0.5))
    # The mask of a shape is the prefix of the flat stream: element order, not shape, matters.
    assert torch.equal(m.reshape(-1)[:100], D.dropout_mask(_state(7, 0), (100,), 0.5))
    assert not torch.equal(m, D.dropout_mask(_state(8, 0), (64, 33), 0.5))
    assert not torch.equal(m, D.dropout_mask(_state(7, 1), (64, 33), 0.5))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_drop_rate_is_p(p):
    n = 1 << 16
    dropped = (~D.dropout_mask(_state(2024, 5), (n,), p)).sum().item()
    # Binomial(n, p): 6 standard deviations.
    assert abs(dropped - n * p) < 6 * math.sqrt(n * p * (1 - p))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_forward_and_backward_use_the_same_mask(p, dtype, device):
    state = _state(99, 3, device)
    x = torch.randn(7, 13, dtype=dtype, device=device, requires_grad=True)
    y = F.dropout(x, p, rng_state=state)
    keep = D.dropout_mask(state.cpu(), x.shape, p).to(device)
    scale = 0.0 if p == 1 else 1 / (1 - p)
    expected = torch.where(keep, x.float() * scale, 0.0).to(dtype)
    if p == 0:
        assert y is x  # no op at all
        return
    assert_bits_equal(y, expected.cpu())
    dy = torch.randn_like(y)
    y.backward(dy)
    assert_bits_equal(x.grad, torch.where(keep, dy.float() * scale, 0.0).to(dtype).cpu())


def test_eval_mode_and_p_zero_are_the_identity():
    x = torch.randn(4, 8)
    op = ops.Dropout(0.5)
    op.eval()
    assert op(x) is x
    assert ops.Dropout(0.0)(x) is x
    op.train()
    assert not torch.equal(op(x), x)


def test_the_module_draws_its_state_from_torch_generator():
    x = torch.randn(64, 64)
    torch.manual_seed(5)
    a = ops.Dropout(0.5)(x)
    torch.manual_seed(5)
    b = ops.Dropout(0.5)(x)
    c = ops.Dropout(0.5)(x)
    assert torch.equal(a, b) and not torch.equal(b, c)
    torch.manual_seed(5)
    state = D.new_rng_state(x.device)
    assert torch.equal(a, F.dropout(x, 0.5, rng_state=state))


def _block():
    torch.manual_seed(0)
    return ops.Sequential(
        ops.BasicLinear(16, 32), ops.Bias(32), ops.GELU(), ops.Dropout(0.5), ops.BasicLinear(32, 8)
    )


def _grads_of(fn, block, x):
    for p in block.parameters():
        p.grad = None
    xi = x.detach().requires_grad_()
    torch.manual_seed(123)
    y = fn(xi)
    y.backward(torch.ones_like(y))
    return y.detach(), xi.grad, [p.grad for p in block.parameters()]


def test_checkpoint_recomputes_the_same_mask_eager():
    block, x = _block(), torch.randn(6, 16)

    def ckpt(t):
        return torch.utils.checkpoint.checkpoint(block, t, use_reentrant=False)

    y, dx, dparams = _grads_of(block, block, x)
    y_c, dx_c, dparams_c = _grads_of(ckpt, block, x)
    assert torch.equal(y, y_c) and torch.equal(dx, dx_c)
    for a, b in zip(dparams, dparams_c, strict=True):
        assert torch.equal(a, b)


def test_checkpoint_recomputes_the_same_mask_compiled():
    """Compiled with checkpointing, the backward's mask is the forward's: the gradient is
    nonzero exactly where the output is (GELU keeps zeros zero and nothing else)."""
    torch.manual_seed(0)
    x = torch.randn(8, 64, requires_grad=True)

    def f(t):
        return ops.GELU()(ops.Dropout(0.5)(t))

    def step(t):
        return torch.utils.checkpoint.checkpoint(f, t, use_reentrant=False)

    y = torch.compile(step, fullgraph=True)(x)
    y.backward(torch.ones_like(y))
    kept = y.detach() != 0
    assert 0 < kept.float().mean() < 1
    assert torch.equal(x.grad != 0, kept)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"p": 1.5}, r"te.dropout: p must be a float in \[0, 1\], got 1.5"),
        ({"p": 0.5, "rng_state": torch.zeros(2, dtype=torch.int32)}, "rng_state must be an int64"),
        ({"p": 0.5, "rng_state": torch.zeros(3, dtype=torch.int64)}, r"tensor \[2\] = \(seed"),
        ({"p": 0.5, "training": "no"}, r"te.dropout: training must be a bool \(True or False\)"),
    ],
)
def test_bad_arguments_name_the_argument_eager_and_compiled(kwargs, match):
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match=match):
        F.dropout(x, **kwargs)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda t: F.dropout(t, **kwargs), fullgraph=True)(x)


def test_op_level_p_check_names_p():
    with pytest.raises(ValueError, match=r"te.dropout: p must be in \[0, 1\], got -0.5"):
        torch.ops.te.dropout_fwd(torch.randn(3), _state(1, 2), -0.5)
