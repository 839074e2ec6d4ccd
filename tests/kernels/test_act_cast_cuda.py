"""csrc/block_cast.cu: the one-read CUDA forms of the Float8BlockScaling casts write the same bytes
as the Triton kernels they stand in for (``cuda_kernels=False``): ``te_cuda::act_cast_1x128``,
the fused gelu or swiglu + 1x128 cast (``kernels.act_quantize.act_quantize_block``; swiglu's
backward casts both halves of dz, one CTA per half's tile) and the plain 1x128
cast of a bf16 tensor ("identity", with the column sums a bias gradient needs;
``kernels.quantize.quantize_blockwise`` / ``quantize_blockwise_sums``), and
``te_cuda::cast_128x128``, a weight's 128x128 cast with its transpose. CUDA only."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; none on this machine", allow_module_level=True)

from te_compile.kernels import act_quantize as act_q
from te_compile.kernels import quantize

if quantize._cuda_op("act_cast_1x128") is None:
    pytest.skip(
        "te_compile._C was built without CUDA (no nvcc at install)", allow_module_level=True
    )

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TRITON = quantize.QuantizeLaunchConfig(cuda_kernels=False)


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("fp8,pow2", [(E4M3, False), (E4M3, True), (E5M2, False)],
                         ids=["e4m3", "e4m3-pow2", "e5m2"])  # fmt: skip
@pytest.mark.parametrize("m,n", [(256, 384), (384, 128)])
def test_cuda_cast_matches_triton(act, backward, has_bias, fp8, pow2, m, n):
    torch.manual_seed(0)
    n_in = 2 * n if act == "swiglu" else n  # swiglu: z = [a | l]
    z = (torch.randn(m, n_in, device="cuda") * 2).to(torch.bfloat16)
    z[3, :40] *= 300  # a block with a large amax next to ordinary ones
    z[128:256, 128:256] = 0  # an all-zero tile: scale 1, zero codes
    z[5, 7] = float("inf")  # the block holding it: a NaN scale, NaN codes
    if act == "swiglu":  # the linear half: an all-zero tile, an inf
        z[128:256, n : n + 128] = 0
        z[9, n + 3] = float("-inf")
    bias = (torch.randn(n_in, device="cuda") * 0.5).to(torch.bfloat16) if has_bias else None
    grad = (torch.randn(m, n, device="cuda") * 3).to(torch.bfloat16) if backward else None
    need_dbias = backward and has_bias
    args = (z, bias, grad, act, fp8, m, need_dbias, pow2)
    *want, want_db = act_q.act_quantize_block(*args, config=TRITON)
    *got, got_db = act_q.act_quantize_block(*args)
    for name, a, b in zip(("data", "scale_inv", "data_t", "scale_inv_t"), got, want, strict=True):
        if a.dtype == fp8:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        else:  # the block holding inf has a NaN gradient, amax and scale: NaN == NaN here
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)
    # the scales written in the blockwise GEMM's layout (strides (1, rows)): same values
    *mn, _ = act_q.act_quantize_block(*args, mn_major=(True, True))
    for a, b, rows in ((mn[1], want[1], m), (mn[3], want[3], want[2].shape[0])):
        assert a.stride() == (1, rows)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(mn[0].view(torch.uint8), want[0].view(torch.uint8))
    if need_dbias:  # fp32 partial sums over other row tiles: same to rounding
        # tol: bf16 dbias from fp32 partial sums over other row tiles (not yet the helper)
        torch.testing.assert_close(got_db, want_db, rtol=1e-2, atol=1e-2, equal_nan=True)
    else:
        assert got_db is None and want_db is None


def test_cuda_cast_is_used_only_where_it_applies(monkeypatch):
    """Ragged shapes, fp32 inputs, other activations and inputs not 16-byte aligned stay on
    Triton; whole bf16 gelu and swiglu tiles take the CUDA kernel."""
    calls = []
    real = quantize._cuda_op("act_cast_1x128")
    monkeypatch.setattr(quantize, "_cuda_op", lambda name: lambda *a: calls.append(1) or real(*a))
    z = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    act_q.act_quantize_block(z, None, None, "gelu", E4M3, 256, False, False)
    assert len(calls) == 1
    act_q.act_quantize_block(z, None, None, "swiglu", E4M3, 256, False, False)
    assert len(calls) == 2
    act_q.act_quantize_block(z, None, None, "silu", E4M3, 256, False, False)
    act_q.act_quantize_block(z, None, None, "clamped_swiglu", E4M3, 256, False, False)
    act_q.act_quantize_block(z, None, None, "gelu", E4M3, 200, False, False)
    act_q.act_quantize_block(z.float(), None, None, "gelu", E4M3, 256, False, False)
    shifted = torch.empty(256 * 256 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(256, 256)
    act_q.act_quantize_block(shifted.copy_(z), None, None, "gelu", E4M3, 256, False, False)
    assert len(calls) == 2  # not 16-byte aligned: Triton


def _assert_same_cast(got, want, fp8):
    for name, a, b in zip(("data", "scale_inv", "data_t", "scale_inv_t"), got, want, strict=True):
        if a.dtype == fp8:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("fp8,pow2", [(E4M3, False), (E4M3, True), (E5M2, False)],
                         ids=["e4m3", "e4m3-pow2", "e5m2"])  # fmt: skip
@pytest.mark.parametrize("shape", [(256, 384), (2, 128, 256)])
def test_identity_cast_matches_triton(fp8, pow2, shape):
    """``quantize_blockwise(x, 1x128, columnwise)`` of a bf16 tensor in whole tiles: the CUDA
    kernel's bytes equal the Triton kernel's; ``quantize_blockwise_sums`` adds x's column
    sums (fp32, to rounding)."""
    torch.manual_seed(1)
    x = (torch.randn(*shape, device="cuda") * 3).to(torch.bfloat16)
    x2 = x.view(-1, shape[-1])
    x2[7, :100] *= 1000
    x2[128:, :128] = 0
    x2[9, 3] = float("-inf")
    args = (x, fp8, 1, pow2, True)
    want = quantize.quantize_blockwise(*args, config=TRITON)
    _assert_same_cast(quantize.quantize_blockwise(*args), want, fp8)
    *got, sums = quantize.quantize_blockwise_sums(x, fp8, pow2)
    _assert_same_cast(got, want, fp8)
    # tol: fp32 column sums in another order (not yet assert_close_sum)
    torch.testing.assert_close(sums, x2.float().sum(0), rtol=1e-5, atol=1e-3, equal_nan=True)
    *mn, _ = quantize.quantize_blockwise_sums(x, fp8, pow2, mn_major=(True, False))
    assert mn[1].stride() == (1, x2.shape[0]) and mn[3].is_contiguous()
    _assert_same_cast(mn, want, fp8)
    *got_t, sums_t = quantize.quantize_blockwise_sums(x, fp8, pow2, config=TRITON)
    _assert_same_cast(got_t, want, fp8)
    # tol: as above, the Triton kernel's sums against the CUDA kernel's
    torch.testing.assert_close(sums_t, sums, rtol=1e-5, atol=1e-3, equal_nan=True)


def test_identity_cast_is_used_only_where_it_applies(monkeypatch):
    """1x128 columnwise casts of bf16 whole tiles take the CUDA kernel; rowwise only, fp32 and
    ragged shapes stay on Triton."""
    calls = []
    real = quantize._cuda_op("act_cast_1x128")
    monkeypatch.setattr(quantize, "_cuda_op", lambda name: lambda *a: calls.append(1) or real(*a))
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    quantize.quantize_blockwise(x, E4M3, 1, False, True)
    quantize.quantize_blockwise_sums(x, E4M3, False)
    assert len(calls) == 2
    quantize.quantize_blockwise(x, E4M3, 1, False, False)
    quantize.quantize_blockwise(x.float(), E4M3, 1, False, True)
    quantize.quantize_blockwise_sums(x[:200], E4M3, False)
    assert len(calls) == 2


@pytest.mark.parametrize("fp8,pow2", [(E4M3, False), (E4M3, True), (E5M2, False)],
                         ids=["e4m3", "e4m3-pow2", "e5m2"])  # fmt: skip
@pytest.mark.parametrize("shape", [(256, 384), (384, 128)])
def test_cast_128x128_matches_triton(fp8, pow2, shape):
    """A weight's 128x128 cast with its transpose: CUDA bytes equal to the Triton kernel's (an
    all-zero block, a block with inf, one with NaN, blocks of very different magnitudes)."""
    torch.manual_seed(2)
    x = torch.randn(*shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")
    x = x.to(torch.bfloat16)
    x[:128, :128] = 0
    x[130, 5] = float("inf")
    x[200, 100] = float("nan")
    args = (x, fp8, 128, pow2, True)
    want = quantize.quantize_blockwise(*args, config=TRITON)
    _assert_same_cast(quantize.quantize_blockwise(*args), want, fp8)


def test_cast_128x128_is_used_only_where_it_applies(monkeypatch):
    calls = []
    real = quantize._cuda_op("cast_128x128")
    monkeypatch.setattr(
        quantize, "_cuda_op", lambda name: lambda *a: calls.append(name) or real(*a)
    )
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    quantize.quantize_blockwise(w, E4M3, 128, False, True)
    assert calls == ["cast_128x128"]
    quantize.quantize_blockwise(w[:, :200], E4M3, 128, False, True)  # ragged: Triton
    quantize.quantize_blockwise(w.half(), E4M3, 128, False, True)  # fp16: Triton
    quantize.quantize_blockwise(w, E4M3, 128, False, False)  # rowwise only: Triton
    assert calls == ["cast_128x128"]
