"""``te_compile.ops.Sequential`` as a container: nn.Sequential's behaviour (names, state_dict,
indexing and mutation, which re-plans the fusions), plain modules splitting the runs of basic
ops, extra inputs and outputs in order, fuse on/off, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from te_compile import ops
from tests.utils import DEVICES, assert_close


def _mlp():
    return [ops.BasicLinear(8, 16), ops.Bias(16), ops.GELU(), ops.BasicLinear(16, 8), ops.Bias(8)]


def test_is_an_nn_sequential_with_the_same_state_dict_keys():
    seq = ops.Sequential(*_mlp())
    plain = nn.Sequential(*_mlp())
    assert isinstance(seq, nn.Sequential)
    assert (
        list(seq.state_dict())
        == list(plain.state_dict())
        == [
            "0.weight",
            "1.bias",
            "3.weight",
            "4.bias",
        ]
    )
    assert len(seq) == 5 and isinstance(seq[2], ops.GELU)
    assert [type(m) for m in seq] == [type(m) for m in plain]
    seq.load_state_dict(plain.state_dict())
    assert torch.equal(seq[0].weight, plain[0].weight)


def test_fusions_lists_the_plan_and_fuse_false_turns_it_off():
    seq = ops.Sequential(*_mlp())
    assert seq.fusions() == [
        ("ForwardLinearBiasActivation", ("0", "1", "2")),
        ("ForwardLinearBiasActivation", ("3", "4")),
    ]
    off = ops.Sequential(*_mlp(), fuse=False)
    assert off.fusions() == [] and "fuse=False" in repr(off)
    seq.fuse = False
    assert seq.fusions() == []
    seq.fuse = True
    assert len(seq.fusions()) == 2


def test_mutating_the_module_list_replans():
    seq = ops.Sequential(ops.BasicLinear(8, 16), ops.Bias(16))
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1"))]
    seq.append(ops.GELU())
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1", "2"))]
    seq[2] = ops.Identity()  # __setitem__
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1"))]
    del seq[1]
    assert seq.fusions() == []
    seq.insert(1, ops.Bias(16))
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1"))]
    seq.insert(1, nn.Identity())  # a plain module between them splits the run
    assert seq.fusions() == []
    seq.pop(1)
    seq.extend([ops.SiLU()])
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1"))]
    seq.add_module("late", ops.ReLU())  # SiLU then ReLU: nothing new to fuse
    assert [n for n, _ in seq.named_children()] == ["0", "1", "2", "3", "late"]


def test_plain_modules_run_between_the_fused_runs():
    torch.manual_seed(0)
    norm = nn.LayerNorm(16)
    seq = ops.Sequential(ops.BasicLinear(8, 16), ops.Bias(16), norm, ops.BasicLinear(16, 4))
    assert seq.fusions() == [("ForwardLinearBiasActivation", ("0", "1"))]
    x = torch.randn(3, 8)
    expected = norm(x @ seq[0].weight.t() + seq[1].bias) @ seq[3].weight.t()
    assert_close(seq(x), expected.double(), torch.float32, roundings=3, reduced=True)
    # Hooks on plain modules run (they are called as modules).
    seen = []
    norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    seq(x)
    assert seen == [torch.Size([3, 16])]


def test_extra_inputs_and_outputs_in_order():
    seq = ops.Sequential(
        ops.MakeExtraOutput(),
        ops.ConstantScale(2.0),
        ops.AddExtraInput(),
        ops.MakeExtraOutput(),
        ops.ConstantScale(3.0),
        ops.AddExtraInput(),
    )
    x, a, b = torch.randn(4), torch.randn(4), torch.randn(4)
    y, first, second = seq(x, a, b)
    assert torch.equal(first, x)
    assert torch.equal(second, 2 * x + a)
    assert torch.equal(y, 3 * (2 * x + a) + b)
    with pytest.raises(ValueError, match=r"Sequential: expected 2 extra input\(s\)"):
        seq(x, a)


def test_grouped_linear_takes_its_m_splits_before_a_later_residual():
    torch.manual_seed(0)
    seq = ops.Sequential(ops.GroupedLinear(2, 8, 8), ops.AddExtraInput())
    x, residual = torch.randn(5, 8), torch.randn(5, 8)
    m_splits = torch.tensor([2, 3])
    w, b = seq[0].weights(), seq[0].biases()  # weight0, weight1 (TE's per-group layout)
    expected = torch.cat([x[:2] @ w[0].t() + b[0], x[2:] @ w[1].t() + b[1]]) + residual
    assert_close(seq(x, m_splits, residual), expected.double(), torch.float32, roundings=2)


@pytest.mark.parametrize("device", DEVICES)
def test_to_and_deepcopy_keep_the_fused_ops_on_the_right_parameters(device):
    seq = ops.Sequential(*_mlp())
    x = torch.randn(3, 8)
    y = seq(x)
    moved = copy.deepcopy(seq).to(device=device, dtype=torch.float64)
    assert moved.fusions() == seq.fusions()
    assert moved[0].weight is not seq[0].weight
    with torch.no_grad():
        seq[0].weight.zero_()  # the copy does not see it
    y64 = moved(x.to(device, torch.float64))
    assert y64.dtype == torch.float64
    assert_close(y64, y.double(), torch.float32, roundings=4, reduced=True)


def test_nested_sequential_runs_as_a_plain_module():
    inner = ops.Sequential(ops.BasicLinear(8, 8), ops.Bias(8))
    outer = ops.Sequential(inner, ops.GELU())
    assert outer.fusions() == [] and inner.fusions()
    x = torch.randn(2, 8)
    assert torch.equal(outer(x), ops.GELU()(inner(x)))
