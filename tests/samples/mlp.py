"""Sample inputs of ``te::mlp_fwd`` (``te_compile/functional/mlp_ops.py``): every
activation and recipe kind, the norm prologue, ``main_grad`` and pre-quantised weights."""

from __future__ import annotations

import torch

from te_compile.functional.dense_weight import quantize_weight
from te_compile.functional.mlp_args import MLPArgs
from tests.samples import SampleInput, sample_tensor
from tests.samples.linear import specs, unit_rows


def mlp_samples(device: torch.device):
    # float32: a bf16 sample's intermediate roundings (z, h, dh) would move some FP8 codes of
    # the float64 reference by one step; the bf16 path is checked bit for bit against the
    # unfused ops in tests/functional/test_mlp.py.
    t = sample_tensor(device)

    def call(*args, **kw):
        return SampleInput(tuple(MLPArgs(*args, **kw)))

    def ints(*shape, amax):
        # Integers, amax a power of two: exact FP8 codes, so z = x W^T is an exact integer
        # however a GEMM accumulates (Hopper's FP8 GEMMs drop bits: a z that close to a clamp
        # limit would take the other side's derivative than the float64 reference).
        v = torch.randint(-amax, amax + 1, shape, device=device).float()
        v.view(-1)[0] = amax
        return v.requires_grad_()

    pending = {"grad_amax1": torch.zeros(1, device=device),
               "grad_amax2": torch.zeros(1, device=device)}  # fmt: skip
    # High precision: element-wise and gated, a norm prologue.
    yield call(t(2, 5, 16), t(24, 16), t(24), t(8, 24), t(8), "act=gelu")
    yield call(t(6, 16), t(32, 16), None, t(16, 16), None, "act=swiglu", norm_weight=t(16),
               norm_bias=t(16), norm="LayerNorm")  # fmt: skip
    cur = specs("current:e4m3")
    yield call(t(32, 16), t(64, 16), t(64), t(32, 64), t(32), "act=gelu", **cur, **pending)
    # The weight gradients into main_grad (fuse_wgrad_accumulation): high precision, FP8.
    yield call(t(2, 5, 16, grad=False), t(24, 16), t(24), t(8, 24), t(8), "act=gelu",
               main_grad1=t(24, 16, grad=False), main_grad2=t(8, 24, grad=False))  # fmt: skip
    yield call(t(32, 16), t(64, 16), t(64), t(32, 32), None, "act=swiglu", **cur, **pending,
               main_grad1=t(64, 16, grad=False), main_grad2=t(32, 32, grad=False))  # fmt: skip
    # 10 tokens (padded to 16 inside the ops), no biases, relu, E4M3 gradients.
    yield call(t(2, 5, 32), t(32, 32), None, t(16, 32), None, "act=relu",
               **specs("current:e4m3", g="current:e4m3"))  # fmt: skip
    # Float8BlockScaling's native GEMMs (feature sizes multiples of 512), power-of-two scales.
    block = specs("block:e4m3", "block:e4m3:128x128", "block:e4m3")
    yield call(t(24, 512), t(512, 512), t(512), t(512, 512), t(512), "act=gelu",
               **specs("block:e4m3:p2", "block:e4m3:128x128:p2", "block:e4m3:p2"))  # fmt: skip
    s1 = torch.tensor([64.0, 128.0, 2.0], device=device)
    s2 = torch.tensor([32.0, 64.0, 1.0], device=device)
    delayed = specs("delayed:e4m3")
    yield call(t(2, 16, 16), t(48, 16), t(48), t(16, 48), None, "act=silu", **delayed,
               scale1=s1, scale2=s2, **pending)  # fmt: skip
    # Norm prologues, norms exact in fp32 (``unit_rows``): LayerNorm, 10 tokens, current
    # scaling; RMSNorm under the native blockwise recipe.
    yield call(unit_rows(2, 5, 32, device=device), t(64, 32), t(64), t(32, 64), t(32),
               "act=gelu", **cur, **pending, norm_weight=t(32),
               norm_bias=torch.zeros(32, device=device, requires_grad=True),
               norm="LayerNorm:eps=1e-30")  # fmt: skip
    yield call(unit_rows(24, 512, device=device), t(512, 512), None, t(512, 512), None,
               "act=relu", **block, norm_weight=t(512), norm="RMSNorm:eps=1e-30")  # fmt: skip
    # Gated: fc1_weight [2 * ffn, hidden]; SwiGLU under current scaling, clamped SwiGLU under
    # delayed scaling (z = x W^T over 16 features, std 4.6: entries past its limit of 7), GEGLU
    # in 1x128 blocks.
    yield call(t(2, 5, 32), t(64, 32), t(64), t(16, 32), t(16), "act=swiglu", **cur, **pending)
    yield call(ints(32, 16, amax=2), ints(96, 16, amax=1), t(96), t(32, 48), None,
               "act=clamped_swiglu", **delayed, scale1=s1.clone(), scale2=s2.clone(),
               **pending)  # fmt: skip
    yield call(t(24, 512), t(1024, 512), t(1024), t(512, 512), t(512), "act=geglu", **block)
    # Clamped SwiGLU with other parameters (LayerNormMLP's activation_params): in high
    # precision and under current scaling (the activation op's path, not the fused kernel's).
    clamp = "act=clamped_swiglu:limit=2.5:alpha=1.25:offset=0.5"
    yield call(t(12, 16), t(64, 16), t(64), t(16, 32), t(16), clamp)
    yield call(ints(32, 16, amax=2), ints(96, 16, amax=1), None, t(32, 48), t(32), clamp, **cur,
               **pending)  # fmt: skip
    # Emulated: MXFP8 (E5M2 gradients), NVFP4, Float8BlockScaling 1x128 weight blocks.
    yield call(t(32, 64), t(64, 64), t(64), t(32, 64), t(32), "act=gelu",
               **specs("mxfp8:e4m3:emulate"))  # fmt: skip
    yield call(t(16, 32), t(64, 32), None, t(16, 32), t(16), "act=swiglu",
               **specs("nvfp4:emulate"))  # fmt: skip
    yield call(t(16, 32), t(32, 32), t(32), t(16, 32), None, "act=relu",
               **specs("block:e4m3:p2:emulate", g="block:e4m3:p2:emulate"))  # fmt: skip

    # Pre-quantised weights (functional.quantize_weight): both under current scaling, FC2's
    # only under delayed scaling (its weight slot), both in native 128x128 blocks.
    def pre(w, spec, scale=None):
        return quantize_weight(w.detach(), spec, scale)

    w1, w2 = t(64, 32), t(16, 64)
    both = {"fc1_weight_q": pre(w1, "current:e4m3"), "fc2_weight_q": pre(w2, "current:e4m3")}
    yield call(t(2, 8, 32), w1, t(64), w2, t(16), "act=gelu", **cur, **pending, **both)
    w1, w2 = t(96, 16), t(32, 48)
    yield call(t(32, 16), w1, t(96), w2, None, "act=swiglu", **delayed, scale1=s1.clone(),
               scale2=s2.clone(), **pending,
               fc2_weight_q=pre(w2, "delayed:e4m3", scale=s2))  # fmt: skip
    w1, w2 = t(512, 512), t(512, 512)
    yield call(t(24, 512), w1, None, w2, t(512), "act=relu", **block,
               fc1_weight_q=pre(w1, "block:e4m3:128x128"),
               fc2_weight_q=pre(w2, "block:e4m3:128x128"))  # fmt: skip
