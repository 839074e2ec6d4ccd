"""Sample inputs of ``te::linear_fwd`` (``te_compile/functional/linear_ops.py``):
every recipe kind, the norm prologue, each epilogue, the backward overrides, ``main_grad``,
pre-quantised weights and odd shapes."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from te_compile.functional.dense_weight import quantize_weight
from te_compile.functional.linear_args import LinearArgs
from tests.samples import SampleInput, sample_tensor


def _call(inp, weight, bias=None, main_grad=None, **kw) -> SampleInput:
    """A sample: the four tensors, or every argument when any other is given."""
    if not kw:
        return SampleInput((inp, weight, bias, main_grad))
    return SampleInput(tuple(LinearArgs(inp, weight, bias, main_grad, **kw)))


def specs(x: str, w: str | None = None, g: str | None = None) -> dict[str, str]:
    """The three specs (the weight's as the input's, the gradient's E5M2 unless given)."""
    return {"input_spec": x, "weight_spec": x if w is None else w,
            "grad_spec": x.replace("e4m3", "e5m2") if g is None else g}  # fmt: skip


def unit_rows(*shape: int, device) -> Tensor:
    """``±1`` with each row summing to 0 (requires grad): LayerNorm / RMSNorm of it with
    ``eps=1e-30`` is exactly ``x * gamma + beta`` (mean 0, variance 1 and ``rsigma`` 1 in fp32
    and float64), for registry samples of ops that quantise a norm's output."""
    half = torch.randint(0, 2, (*shape[:-1], shape[-1] // 2), device=device) * 2.0 - 1.0
    perm = torch.randperm(shape[-1], device=device)
    return torch.cat([half, -half], -1)[..., perm].to(torch.float32).contiguous().requires_grad_()


def linear_samples(device: torch.device):
    t = sample_tensor(device)

    bf = functools.partial(t, dtype=torch.bfloat16)
    zeros = functools.partial(torch.zeros, device=device)

    fp16 = torch.float16
    # High precision.
    yield _call(t(5, 16), t(8, 16), t(8))
    yield _call(t(2, 3, 16), t(24, 16))
    yield _call(bf(7, 32), bf(12, 32), bf(12))
    yield _call(t(3, 4, 8, dtype=fp16), t(6, 8, dtype=fp16), t(6, dtype=fp16))
    # Input that needs no gradient (first layer), weight gradient into main_grad.
    yield _call(t(6, 16, grad=False), t(4, 16), t(4), zeros(4, 16))
    # Epilogues in high precision: bias + activation (gated ones, interleaved GLU layout, a
    # clamped SwiGLU whose limit cuts), residual add with a scale, a branch output.
    yield _call(t(5, 16), t(24, 16), t(24), epilogue="act=gelu")
    yield _call(bf(2, 3, 16), bf(32, 16), epilogue="act=relu")
    yield _call(bf(7, 32), bf(16, 32), bf(16), epilogue="act=swiglu:interleave=4")
    yield _call(t(6, 16, grad=False), t(16, 16), t(16), zeros(16, 16),
                epilogue="act=clamped_swiglu:interleave=2:limit=0.75:offset=0.5")  # fmt: skip
    yield _call(t(5, 16), t(24, 16), t(24), residual=t(5, 24))
    yield _call(bf(2, 3, 16), bf(8, 16), residual=bf(2, 3, 8), epilogue="scale=0.5")
    yield _call(t(6, 16, grad=False), t(8, 16), t(8), zeros(8, 16), residual=t(6, 8),
                epilogue="scale=-2.0")  # fmt: skip
    yield _call(t(5, 16), t(24, 16), t(24), epilogue="branch")
    yield _call(t(4, 8, dtype=fp16), t(12, 8, dtype=fp16), t(12, dtype=fp16), epilogue="branch")
    yield _call(t(6, 16), t(8, 16), t(8), zeros(8, 16), epilogue="branch")
    # A norm prologue in high precision (LayerNorm, zero-centred gamma).
    yield _call(t(2, 5, 16), t(8, 16), t(8), norm_weight=t(16), norm_bias=t(16),
                norm="LayerNorm:zero_centered")  # fmt: skip
    # Per-tensor FP8. 10 tokens: padded to 16 inside the ops.
    cur = specs("current:e4m3")
    yield _call(bf(32, 16), bf(16, 16), bf(16), **cur)
    yield _call(bf(2, 5, 16), bf(32, 16), bf(32), **cur)
    scale = torch.tensor([8.0, 16.0, 1.0], device=device)
    pending = zeros(1)
    delayed = specs("delayed:e4m3")
    yield _call(bf(2, 16, 32), bf(48, 32), **delayed, scale=scale, grad_amax=pending)
    cur_e4 = specs("current:e4m3", g="current:e4m3")
    yield _call(t(16, 32), t(16, 32), None, zeros(16, 32), **cur_e4)
    # The backward GEMMs with fast accumulation (Float8CurrentScaling's MMParams).
    yield _call(
        bf(32, 16), bf(16, 16), **specs("current:e4m3", g="current:e5m2:fast_dgrad:fast_wgrad")
    )
    # float32 with a bias: _scaled_mm refuses a bias with an fp32 output (added after it).
    yield _call(t(16, 32), t(32, 32), t(32), **cur)
    # Norm prologues: inputs whose norm is exact in fp32 and float64 alike (``unit_rows``; the
    # FP8 codes of a computed value one fp32 rounding from a code boundary would differ).
    yield _call(unit_rows(2, 5, 32, device=device), t(16, 32), t(16), **cur, norm_weight=t(32),
                norm_bias=zeros(32).requires_grad_(), norm="LayerNorm:eps=1e-30")  # fmt: skip
    yield _call(unit_rows(16, 32, device=device), t(32, 32), **delayed, scale=scale.clone(),
                grad_amax=pending.clone(), norm_weight=t(32), norm="RMSNorm:eps=1e-30")  # fmt: skip
    # FP8 with an epilogue: bias + GELU, residual add, branch.
    yield _call(t(32, 16), t(32, 16), t(32), **cur, epilogue="act=gelu")
    yield _call(t(2, 8, 32), t(16, 32), t(16), **cur, residual=t(2, 8, 16), epilogue="scale=2.0")
    yield _call(t(16, 32), t(16, 32), None, **cur, epilogue="branch")
    # Block-scaled recipes, emulated: MXFP8 (E5M2 gradients in fp32), NVFP4, Float8BlockScaling
    # with 1x128 activations (a partial block: K=144) and 128x128 weight tiles.
    mx = specs("mxfp8:e4m3:emulate", g="mxfp8:e4m3:emulate")
    yield _call(bf(32, 64), bf(32, 64), bf(32), **mx)
    yield _call(t(2, 16, 32), t(64, 32), **specs("mxfp8:e4m3:emulate"))
    nv = specs("nvfp4:emulate")
    yield _call(bf(16, 32), bf(48, 32), bf(48), **nv)
    yield _call(bf(32, 144), bf(160, 144),
                **specs("block:e4m3:p2:emulate", "block:e4m3:128x128:p2:emulate",
                         "block:e4m3:p2:emulate"))  # fmt: skip
    # Native blockwise (its GEMMs emulated off CUDA), a bias, 1x128 weight blocks, main_grad.
    blk = specs("block:e4m3", "block:e4m3:128x128", "block:e4m3")
    yield _call(bf(32, 512), bf(512, 512), bf(512), **blk)
    blk_p2 = specs("block:e4m3:p2", g="block:e4m3:p2")
    yield _call(bf(48, 256), bf(32, 256), None, zeros(32, 256), **blk_p2)
    # Norm prologues: native blockwise with RMSNorm, emulated MXFP8 with LayerNorm.
    yield _call(unit_rows(32, 512, device=device), t(512, 512), t(512), **blk, norm_weight=t(512),
                norm="RMSNorm:eps=1e-30")  # fmt: skip
    yield _call(unit_rows(32, 64, device=device), t(32, 64), **mx, norm_weight=t(64),
                norm_bias=zeros(64).requires_grad_(), norm="LayerNorm:eps=1e-30")  # fmt: skip
    # save_input: the input itself saved, its transposed copy quantised in the backward
    # (per-tensor current scaling, in bf16 and with GELU; emulated MXFP8; native blockwise).
    yield _call(bf(2, 16, 32), bf(32, 32), bf(32), **cur, backward="save_input")
    yield _call(t(2, 16, 32), t(32, 32), t(32), **cur, epilogue="act=gelu", backward="save_input")
    yield _call(t(32, 64), t(32, 64), t(32), **mx, backward="save_input")
    yield _call(bf(32, 512), bf(512, 512), None, **blk, backward="save_input")
    # Backward overrides: high-precision backward GEMMs on the forward's high-precision operands
    # (the norm's output saved) or on its dequantised FP8 operands.
    yield _call(unit_rows(2, 8, 32, device=device), t(16, 32), t(16), **cur, epilogue="act=gelu",
                norm_weight=t(32), norm="RMSNorm:eps=1e-30", backward="high_precision")  # fmt: skip
    yield _call(bf(20, 32), bf(16, 32), bf(16), **cur, backward="dequantized")
    yield _call(unit_rows(32, 64, device=device), t(32, 64), **mx, norm_weight=t(64),
                norm="LayerNorm:eps=1e-30", backward="dequantized")  # fmt: skip
    yield _call(bf(32, 512), bf(512, 512), None, zeros(512, 512), **blk, backward="dequantized")
    yield _call(t(16, 32), t(48, 32), **nv, backward="high_precision")
    # NVFP4's recipe options: 16x16 weight tiles, the random Hadamard transform of the wgrad
    # GEMM's operands, stochastic rounding of the gradient (a fixed stream); with a norm.
    rng = torch.tensor([3, 5], device=device)
    yield _call(bf(32, 48), bf(32, 48), bf(32),
                **specs("nvfp4:emulate:rht", "nvfp4:16x16:emulate", "nvfp4:emulate:rht:sr"),
                rng_state=rng)  # fmt: skip
    yield _call(unit_rows(16, 32, device=device), t(48, 32),
                **specs("nvfp4:emulate:rht", "nvfp4:emulate", "nvfp4:emulate:rht:sr"),
                norm_weight=t(32), norm="RMSNorm:eps=1e-30", rng_state=rng.clone())  # fmt: skip
    yield _call(t(32, 32), t(16, 32), t(16),
                **specs("nvfp4:emulate:row_scaled", "nvfp4:16x16:emulate", "nvfp4:emulate"),
                backward="dequantized")  # fmt: skip
    # 4over6 block scaling of the input (with the transform of its wgrad copy) and of the
    # weight's 16x16 tiles.
    yield _call(bf(32, 48), bf(32, 48),
                **specs("nvfp4:emulate:rht:4over6=MAE/448",
                         "nvfp4:16x16:emulate:4over6=MSE/256", "nvfp4:emulate:rht"))  # fmt: skip

    # A pre-quantised weight (functional.dense_weight.quantize_weight): per tensor, delayed (its
    # weight slot), native blockwise with 128x128 blocks, emulated MXFP8, with a dequantised
    # backward.
    def pre(w, specs, scale=None, **kw):
        q = quantize_weight(w.detach(), specs["weight_spec"], scale)
        return dict(**specs, weight_q=q, scale=scale, **kw)

    w = bf(32, 16)
    yield _call(bf(2, 5, 16), w, bf(32), **pre(w, cur))
    w = t(48, 32)
    yield _call(t(16, 32), w, None, zeros(48, 32),
                **pre(w, delayed, scale=scale.clone(), grad_amax=pending.clone()))  # fmt: skip
    w = bf(512, 512)
    yield _call(bf(32, 512), w, **pre(w, blk))
    w = t(32, 64)
    yield _call(t(32, 64), w, t(32), **pre(w, mx))
    w = bf(16, 32)
    yield _call(bf(20, 32), w, **pre(w, cur, backward="dequantized"))
