"""Sample inputs of ``te::grouped_linear_fwd`` (``te_compile/functional/grouped_linear_ops.py``):
every recipe kind, empty groups, per-expert bias, ``main_grad``, the backward options (the
overrides among them) and pre-quantised weights."""

from __future__ import annotations

import functools

import torch

from te_compile.functional.grouped_linear_args import GroupedLinearArgs
from te_compile.functional.grouped_weight import quantize_grouped_weight
from tests.samples import SampleInput, sample_tensor
from tests.samples.linear import specs


def grouped_linear_samples(device: torch.device):
    t = sample_tensor(device)

    bf = functools.partial(t, dtype=torch.bfloat16)
    zeros = functools.partial(torch.zeros, device=device)

    def splits(*values, on=device):
        return torch.tensor(values, device=on, dtype=torch.int64)

    def call(*args, **kw):
        return SampleInput(tuple(GroupedLinearArgs(*args, **kw)) if kw else args)

    def bf_40x16(*counts, bias=True):  # bf16: input [40, 16], m_splits, weight [3, 32, 16], bias
        return bf(40, 16), splits(*counts), bf(3, 32, 16), bf(3, 32) if bias else None

    f16 = torch.float16
    # High precision: a zero-size group, a CPU m_splits, bf16 (the grouped GEMM on CUDA), fp16
    # with no input gradient, the weight gradient into main_grad.
    yield call(t(10, 16), splits(3, 0, 7), t(3, 8, 16), t(3, 8), None)
    yield call(t(9, 16), splits(9, on="cpu"), t(1, 8, 16), None, None)
    yield call(bf(12, 32), splits(5, 4, 3, 0), bf(4, 16, 32), None, None)
    yield call(t(6, 8, dtype=f16, grad=False), splits(2, 4), t(2, 8, 8, dtype=f16),
               t(2, 8, dtype=f16), None)  # fmt: skip
    yield call(t(7, 16), splits(4, 3), t(2, 8, 16), None, zeros(2, 8, 16))
    # Per-tensor FP8: current scaling rowwise (a zero-size group; a CPU int32 m_splits with
    # empty first and last groups and no input gradient; float32, one group, E4M3 gradients).
    cur = specs("current:e4m3")
    yield call(*bf_40x16(11, 0, 29), None, **cur)
    cpu_i32 = torch.tensor([0, 7, 13, 0], dtype=torch.int32)
    yield call(bf(20, 32, grad=False), cpu_i32, bf(4, 16, 32), None, None, **cur)
    cur_e4 = specs("current:e4m3", g="current:e4m3")
    yield call(t(24, 32), splits(24, on="cpu"), t(1, 16, 32), t(1, 16), None, **cur_e4)
    # Delayed scaling: given per-tensor scales (powers of two: exact in every dtype), the
    # gradient's amax written into grad_amax.
    scale = torch.tensor([8.0, 16.0, 2048.0], device=device)
    delayed = specs("delayed:e4m3")
    yield call(*bf_40x16(11, 0, 29), None, **delayed, scale=scale, grad_amax=zeros(1))
    # Weight gradient accumulated into main_grad (fp32), current scaling with the amaxes
    # measured (a delayed state's calibration step).
    yield call(bf(24, 16), splits(8, 16), bf(2, 32, 16), None, zeros(2, 32, 16), **cur,
               grad_amax=zeros(1))  # fmt: skip
    # FP8 wgrad: E4M3 both ways, groups of 17 / 0 / 23 rows (padded to 32 / 0 / 32 in the
    # transposed operands), bias; with an E5M2 gradient, delayed scaling, into main_grad.
    yield call(*bf_40x16(17, 0, 23), None, **cur_e4, backward="fp8_wgrad")
    yield call(*bf_40x16(11, 29, 0, bias=False), zeros(3, 32, 16), **delayed, scale=scale.clone(),
               grad_amax=zeros(1), backward="fp8_wgrad")  # fmt: skip
    # save_input: the FP8 wgrad operand quantised again in the backward from the input.
    yield call(*bf_40x16(17, 0, 23), None, **cur, backward="save_input:fp8_wgrad")
    # Float8BlockScaling, native (its GEMMs emulated off CUDA): experts of 17 / 0 / 40 tokens
    # (the padded layout: experts from rows 0 and 128), a partial 128-block of features
    # (K = 144), 1x128 weight blocks, power-of-two scales, bias; 128x128 weight blocks (features
    # multiples of 512), an expert of 130 tokens, a CPU int32 m_splits; main_grad, no input
    # gradient, the first expert empty; float32.
    block_p2 = specs("block:e4m3:p2", g="block:e4m3:p2")
    block = specs("block:e4m3", g="block:e4m3")
    yield call(bf(57, 144), splits(17, 0, 40), bf(3, 32, 144), bf(3, 32), None, **block_p2)
    yield call(bf(146, 512), torch.tensor([16, 130], dtype=torch.int32), bf(2, 512, 512), None,
               None, **specs("block:e4m3", "block:e4m3:128x128", "block:e4m3"))  # fmt: skip
    yield call(bf(24, 32, grad=False), splits(0, 24, 0), bf(3, 48, 32), bf(3, 48),
               zeros(3, 48, 32), **block)  # fmt: skip
    yield call(t(40, 32), splits(8, 32, on="cpu"), t(2, 16, 32), None, None, **block_p2)
    # The emulated recipes: MXFP8 (E5M2 gradients), NVFP4 (a global scale per expert),
    # Float8BlockScaling with 128x128 weight blocks that straddle two experts (N = 32).
    mx = specs("mxfp8:e4m3:emulate")
    yield call(t(40, 64), splits(11, 0, 29), t(3, 32, 64), t(3, 32), None, **mx)
    yield call(t(32, 32), splits(16, 16), t(2, 16, 32), None, None, **specs("nvfp4:emulate"))
    # NVFP4's options: the transform of the wgrad operands, stochastic rounding, 4over6, tiles.
    yield call(t(48, 32), splits(32, 0, 16), t(3, 16, 32), t(3, 16), None,
               **specs("nvfp4:emulate:rht:4over6=MSE/256", "nvfp4:16x16:emulate:4over6=MAE/448",
                       "nvfp4:emulate:rht:sr"),
               rng_state=torch.tensor([3, 5], device=device))  # fmt: skip
    yield call(t(24, 32), splits(16, 8), t(2, 32, 32), t(2, 32), zeros(2, 32, 32),
               **specs("block:e4m3:emulate", "block:e4m3:128x128:emulate",
                       "block:e4m3:emulate"))  # fmt: skip
    # save_input, emulated: the input's dequantised copy made again in the backward (MXFP8 with
    # a bias; NVFP4 with its transform, into main_grad).
    yield call(t(40, 64), splits(11, 0, 29), t(3, 32, 64), t(3, 32), None, **mx,
               backward="save_input")  # fmt: skip
    yield call(t(32, 32), splits(16, 16), t(2, 16, 32), None, zeros(2, 16, 32),
               **specs("nvfp4:emulate:rht", "nvfp4:emulate", "nvfp4:emulate:rht"),
               backward="save_input")  # fmt: skip

    # Backward overrides: high precision's backward on the input and the weight (current
    # scaling into main_grad), or on the forward's dequantised operands (current scaling's
    # rowwise ones, MXFP8's blocks).
    yield call(*bf_40x16(11, 0, 29), zeros(3, 32, 16), **cur, backward="high_precision")
    yield call(*bf_40x16(11, 0, 29), None, **cur, backward="dequantized")
    yield call(t(40, 64), splits(11, 0, 29), t(3, 32, 64), t(3, 32), None, **mx,
               backward="dequantized")  # fmt: skip

    # A pre-quantised weight (functional.grouped_weight): delayed with the FP8 wgrad into
    # main_grad, native blockwise (the stacked dgrad copies); the other kinds' kept weights are
    # checked bit for bit in tests/modules/test_fp8_weight_cache.py.
    w = bf(3, 32, 16)
    s = scale.clone()
    q = quantize_grouped_weight(w.detach(), "delayed:e4m3", s)
    yield call(bf(40, 16), splits(11, 29, 0), w, None, zeros(3, 32, 16), **delayed, scale=s,
               grad_amax=zeros(1), backward="fp8_wgrad", weight_q=q)  # fmt: skip
    w = bf(3, 32, 144)
    q = quantize_grouped_weight(w.detach(), "block:e4m3:p2")
    yield call(bf(57, 144), splits(17, 0, 40), w, bf(3, 32), None, **block_p2, weight_q=q)
