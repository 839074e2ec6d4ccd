"""``te.Fp8Padding`` / ``te.Fp8Unpadding`` with Transformer Engine's semantics, written from its
documented behaviour: each group's rows padded with zero rows to a multiple of ``align_size``
(when not given, ``get_align_size_for_quantization``: 32 under MXFP8, 128 under NVFP4, else
16), the padded splits returned, the unpadding dropping them; gradients flow back through both;
a grouped GEMM on the padded rows gives the unpadded result; bad arguments name themselves,
eagerly and under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from tests.utils import DEVICES, compile_counted


def _expected(x: torch.Tensor, splits: list[int], align: int) -> torch.Tensor:
    parts, start = [], 0
    for m in splits:
        p = -(-m // align) * align
        part = torch.zeros(p, x.shape[-1], dtype=x.dtype, device=x.device)
        part[:m] = x[start : start + m]
        parts.append(part)
        start += m
    return torch.cat(parts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [None, 8, 32])
def test_pads_each_group_with_zero_rows_and_unpads(align, device):
    splits = [5, 0, 16, 17]
    x = torch.randn(sum(splits), 12, device=device, requires_grad=True)
    out, padded = te.Fp8Padding(4, align)(x, splits)
    a = align or 16
    assert padded == [-(-m // a) * a for m in splits]
    assert torch.equal(out, _expected(x.detach(), splits, a))
    back = te.Fp8Unpadding(4, align)(out, splits)
    assert torch.equal(back, x.detach())
    g = torch.randn_like(back)
    back.backward(g)
    assert torch.equal(x.grad, g)  # each row's gradient, once; the padding rows' dropped


def test_default_alignment_follows_the_active_recipe():
    splits = [3, 20]
    x = torch.randn(23, 32)
    pad = te.Fp8Padding(2)
    with te.autocast(recipe=te.recipe.MXFP8BlockScaling()):
        _, mx = pad(x, splits)
    with te.autocast(recipe=te.recipe.NVFP4BlockScaling()):
        _, nv = pad(x, splits)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        _, cur = pad(x, splits)
    _, plain = pad(x, splits)
    assert mx == [32, 32] and nv == [128, 128] and cur == [16, 32] and plain == [16, 32]


@pytest.mark.parametrize(
    ("recipe", "align"),
    [
        (None, 16),
        (te.recipe.DelayedScaling(), 16),
        (te.recipe.Float8CurrentScaling(), 16),
        (te.recipe.Float8BlockScaling(), 16),
        (te.recipe.MXFP8BlockScaling(), 32),
        (te.recipe.NVFP4BlockScaling(), 128),
        (te.recipe.NVFP4BlockScaling(disable_2d_quantization=True), 128),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, int) else str(v),
)
def test_align_size_for_quantization_is_transformer_engines(recipe, align):
    assert te.quantization.get_align_size_for_quantization(recipe) == align


def test_align_size_for_quantization_names_a_bad_recipe():
    with pytest.raises(TypeError, match="get_align_size_for_quantization: recipe must be a Recipe"):
        te.quantization.get_align_size_for_quantization("mxfp8")


def test_aligned_splits_pass_through_and_3d_input_is_rows():
    x = torch.randn(2, 16, 8)  # 32 rows
    out, padded = te.Fp8Padding(2)(x, [16, 16])
    assert padded == [16, 16] and out.shape == (32, 8) and torch.equal(out, x.reshape(32, 8))
    assert torch.equal(te.Fp8Unpadding(2)(out, [16, 16]), out)


def test_a_grouped_gemm_on_padded_rows_gives_the_unpadded_result():
    """What Transformer Engine code does with it: pad -> GroupedLinear -> unpad, under FP8."""
    torch.manual_seed(0)
    splits = [7, 30, 1]
    lin = te.GroupedLinear(3, 32, 16, bias=False)
    x = torch.randn(sum(splits), 32)
    with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
        padded_x, padded = te.Fp8Padding(3)(x, splits)
        y = te.Fp8Unpadding(3)(lin(padded_x, padded), splits)
        # Zero rows add nothing to a group's amax: the same quantisation as without padding.
        expected = lin(x, splits)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bad_arguments_name_themselves(compiled):
    pad, unpad = te.Fp8Padding(2), te.Fp8Unpadding(2)

    def run(module, *args):
        fn = compile_counted(lambda *a: module(*a))[0] if compiled else module
        return fn(*args)

    x = torch.randn(10, 4)
    cases = [
        (pad, (x, [5]), ValueError, "m_splits must have num_gemms=2 entries, got [5]"),
        (pad, (x, [5, 4]), ValueError, "m_splits must sum to inp's 10 rows, got [5, 4]"),
        (pad, (x, [11, -1]), ValueError, "m_splits must hold ints >= 0"),
        (pad, (x, torch.tensor([5, 5])), TypeError, "m_splits must be a list of ints"),
        (pad, (torch.randn(10), [5, 5]), ValueError, "inp must be [rows, features]"),
        (unpad, (x, [5, 5]), ValueError, "inp has 10 rows, m_splits padded"),
    ]
    for module, args, error, message in cases:
        # Under compile the error reaches the caller from dynamo, with the message.
        expected = Exception if compiled else error
        with pytest.raises(expected, match=message.replace("[", r"\[").replace("]", r"\]")):
            run(module, *args)
    for cls in (te.Fp8Padding, te.Fp8Unpadding):
        with pytest.raises(ValueError, match="num_gemms"):
            cls(0)
        with pytest.raises(ValueError, match="align_size"):
            cls(2, align_size=0)


def test_compiles_without_graph_breaks():
    pad, unpad = te.Fp8Padding(2), te.Fp8Unpadding(2)
    lin = te.GroupedLinear(2, 8, 8, bias=False)

    def block(x):
        px, padded = pad(x, [3, 9])
        return unpad(lin(px, padded), [3, 9])

    compiled, counter = compile_counted(block)
    x = torch.randn(12, 8)
    torch.testing.assert_close(compiled(x), block(x))
    assert counter.frame_count == 1
