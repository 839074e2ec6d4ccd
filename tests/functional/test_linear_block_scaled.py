"""FP8 blockwise linear beyond the registry test (which compares the emulated and the native
paths, GEMMs emulated on CPU, with the exact fake-quantised reference): on a GPU with
blockwise-scaled ``_scaled_mm``, cuBLAS's GEMMs against the emulation of the same quantised
operands, and the errors of the native path."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from te_compile import functional as F
from tests.utils import DEVICES, assert_close, paired_grads, requires_cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _run(native, x, w, b, power_2_scale, weight_block_rows):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    out = F.linear_block_scaled(
        x,
        w,
        b,
        kind="block",
        power_2_scale=power_2_scale,
        weight_block_rows=weight_block_rows,
        native=native,
    )
    torch.manual_seed(1)
    out.backward(torch.randn_like(out))
    return out, x.grad, w.grad, None if b is None else b.grad


@requires_cuda
@pytest.mark.skipif(
    torch.cuda.is_available() and not te.is_fp8_block_scaling_available(),
    reason="needs blockwise-scaled _scaled_mm (compute capability 9.0+, CUDA 12.9+)",
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("power_2_scale, weight_block_rows", [(True, 128), (False, 128), (True, 1)])
@pytest.mark.parametrize("m, k, n", [(256, 512, 1024), (160, 1024, 512)], ids=str)
def test_native_gemms_match_the_emulation(m, k, n, power_2_scale, weight_block_rows, bias):
    """Both paths quantise identically (same ops); the GEMMs differ only in accumulation order,
    each result rounded once to bf16: so they agree within two bf16 roundings, relative to the
    largest term (a sum of products cancels)."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    native = _run(True, x, w, b, power_2_scale, weight_block_rows)
    emulated = _run(False, x, w, b, power_2_scale, weight_block_rows)
    for a, e in zip(native, emulated, strict=True):
        if e is None:
            assert a is None
            continue
        assert_close(a, e.double(), torch.bfloat16, roundings=2, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_native_needs_block_kind_and_e4m3(device):
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kind='block' only"):
        F.linear_block_scaled(x, w, kind="mxfp8", native=True)
    with pytest.raises(ValueError, match="E4M3 operands"):
        F.linear_block_scaled(x, w, kind="block", bwd_dtype=E5M2, native=True)
    # 128x128 weight blocks: the weight's K / 128 scale dims must be multiples of 4.
    with pytest.raises(ValueError, match="multiples of 512"):
        F.linear_block_scaled(x, w, kind="block", native=True)
    assert F.native_block_supported(w, 1, E4M3, E4M3)
    assert not F.native_block_supported(w, 128, E4M3, E4M3)
    assert not F.native_block_supported(w, 1, E4M3, E5M2)


@pytest.mark.parametrize(
    "kind,native,normalization",
    [("block", True, "RMSNorm"), ("block", True, "LayerNorm"), ("mxfp8", False, "LayerNorm")],
    ids=["block-native-rmsnorm", "block-native-layernorm", "mxfp8-layernorm"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_prologue_same_bytes_as_the_norm_then_the_linear(device, kind, native, normalization):
    """``linear_block_scaled(..., normalization=...)`` (natively on CUDA the norm is quantised in
    1x128 blocks without being written) against the norm op followed by the linear: output and
    every gradient bit for bit."""
    if native and device == "cuda" and not te.is_fp8_block_scaling_available():
        pytest.skip("no native blockwise FP8 GEMMs on this GPU")
    torch.manual_seed(0)

    def t(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, device=device) * std + mean).bfloat16().requires_grad_()

    x, w, b = t(2, 32, 512, std=2.0, mean=0.5), t(512, 512, std=0.05), t(512)
    gamma, beta = t(512, std=0.2, mean=1.0), t(512, std=0.3)
    beta = beta if normalization == "LayerNorm" else None
    kw = dict(kind=kind, native=native, weight_block_rows=128 if kind == "block" else 1)
    out = F.linear_block_scaled(
        x, w, b, normalization=normalization, norm_weight=gamma, norm_bias=beta, **kw
    )
    ln = F.layernorm(x, gamma, beta) if normalization == "LayerNorm" else F.rmsnorm(x, gamma)
    ref = F.linear_block_scaled(ln, w, b, **kw)
    assert torch.equal(out, ref)
    params = [p for p in (x, gamma, beta, w, b) if p is not None]
    for _p, g, r in paired_grads(out, ref, params):
        assert torch.equal(g, r)
