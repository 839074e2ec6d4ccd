"""``te_compile.kernels.act_quantize`` (activation fused into the FP8 per-tensor cast) against
the unfused kernels: the activation kernel in fp32, rounded to the model's dtype by torch,
zero rows appended, then the quantisation kernels; bit for bit (data, transposed data, scale,
amax), the bias gradient closely (a sum in another order).

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` (small sizes, small tiles: many
programs, tiles cut by the ends of the input and by the padding rows).
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import TRITON_DEVICE, assert_bits_equal, assert_close, requires_triton

act_q = pytest.importorskip("te_compile.kernels.act_quantize")
activation = pytest.importorskip("te_compile.kernels.activation")
quantize = pytest.importorskip("te_compile.kernels.quantize")

pytestmark = [pytest.mark.triton, requires_triton]

SMALL = quantize.QuantizeLaunchConfig(block_m=16, block_k=16)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _dev(t):
    return None if t is None else t.to(TRITON_DEVICE)


def _activation_padded(z, bias, grad, act, rows):
    """The activation (or its gradient) by the activation kernels in fp32, rounded once to
    ``z``'s dtype and zero-padded to ``z``'s rows; plus the fp32 bias gradient. A gated
    activation's output has half of ``z``'s columns, its gradient all of them."""
    zf = z[:rows].float()
    bf = None if bias is None else bias.float()
    dbias = None
    if grad is None:
        v = activation.activation_forward(zf, bf, act)
    else:
        v, dbias = activation.activation_backward(
            grad[:rows].float(), zf, bf, act, need_dbias=bias is not None
        )
    return torch.cat([v, v.new_zeros(z.shape[0] - rows, v.shape[1])]).to(z.dtype), dbias


def _unfused(z, bias, grad, act, fp8, scale, rows):
    """The unfused path: ``_activation_padded``, then ``quantize_current`` /
    ``quantize_tensorwise``; plus the fp32 bias gradient."""
    v, dbias = _activation_padded(z, bias, grad, act, rows)
    if scale is None:
        data, data_t, scale_inv, amax = quantize.quantize_current(v, fp8, True)
    else:
        data, data_t, _, amax = quantize.quantize_tensorwise(v, scale, fp8, True)
        scale_inv = scale.reciprocal()
    return (data, data_t, scale_inv, amax), dbias


def _check(actual, expected, actual_dbias, dbias, backward, has_bias, dtype):
    for a, e in zip(actual, expected, strict=True):
        assert a.device.type == TRITON_DEVICE
        assert_bits_equal(a, e)
    if backward and has_bias:
        assert actual_dbias.dtype == dtype
        assert_close(actual_dbias, dbias.double(), dtype=dtype)
    else:
        assert actual_dbias is None


CASES = [
    pytest.param("gelu", torch.bfloat16, True, None, id="gelu-bf16-bias-current"),
    pytest.param("silu", torch.float32, False, 4.0, id="silu-fp32-delayed"),
    pytest.param("srelu", torch.float16, True, 16.0, id="srelu-fp16-bias-delayed"),
    pytest.param("qgelu", torch.bfloat16, False, None, id="qgelu-bf16-current"),
    pytest.param("relu", torch.bfloat16, True, 0.5, id="relu-bf16-bias-delayed"),
    # Gated (z [M, 2N]): h [M, N] forward, dz [M, 2N] (both halves, one scale) backward.
    pytest.param("swiglu", torch.bfloat16, True, None, id="swiglu-bf16-bias-current"),
    pytest.param("geglu", torch.float32, False, 4.0, id="geglu-fp32-delayed"),
    pytest.param("clamped_swiglu", torch.bfloat16, True, None, id="clamped-swiglu-bf16-bias"),
    pytest.param("reglu", torch.float16, True, 16.0, id="reglu-fp16-bias-delayed"),
    pytest.param("qgeglu", torch.bfloat16, False, None, id="qgeglu-bf16-current"),
    pytest.param("sreglu", torch.bfloat16, True, 2.0, id="sreglu-bf16-bias-delayed"),
    pytest.param("glu", torch.bfloat16, False, None, id="glu-bf16-current"),
]


def _inputs(act, dtype, has_bias, backward, m_out, n):
    """``(z, bias, grad)`` for an activation with ``n`` output columns (``z`` has ``2n`` for a
    gated one, some of its entries past clamped SwiGLU's limit of 7)."""
    n_in = 2 * n if act in activation.GATED else n
    z = torch.randn(m_out, n_in) * 2
    z[1] *= 6
    bias = (torch.randn(n_in) * 0.5).to(dtype) if has_bias else None
    grad = (torch.randn(m_out, n) * 3).to(dtype) if backward else None
    return z.to(dtype), bias, grad


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("act,dtype,has_bias,scale", CASES)
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
# Padding rows and tiles cut at the edges (masked loads and stores), and a tensor the 16x16
# tiles of SMALL cover exactly (the kernels' unmasked EVEN path).
@pytest.mark.parametrize("m_out,rows,n", [(48, 37, 40), (32, 32, 48)], ids=["ragged", "even"])
def test_act_quantize_matches_unfused_kernels(
    act, dtype, has_bias, scale, backward, config, m_out, rows, n
):
    z, bias, grad = _inputs(act, dtype, has_bias, backward, m_out, n)
    s = None if scale is None else torch.tensor([scale])
    fp8 = E5M2 if backward else E4M3
    expected, dbias = _unfused(*map(_dev, (z, bias, grad)), act, fp8, _dev(s), rows)
    *actual, actual_dbias = act_q.act_quantize(
        *map(_dev, (z, bias, grad)), act, fp8, _dev(s), rows, True, True, config=config
    )
    _check(actual, expected, actual_dbias, dbias, backward, has_bias, dtype)


def test_act_quantize_padding_rows_are_zero_and_outside_the_amax():
    # relu(0 + bias) of a padding row would be the largest value: it must not set the scale.
    z = torch.zeros(32, 16)
    bias = torch.full((16,), 100.0)
    z[:5] = 1.0
    data, data_t, scale_inv, amax, _ = act_q.act_quantize(
        _dev(z), _dev(bias), None, "relu", E4M3, None, 5, True, False, config=SMALL
    )
    assert amax.item() == 101.0
    assert scale_inv.item() == pytest.approx(101.0 / 448.0)
    assert (data.view(torch.uint8)[5:] == 0).all() and (data.view(torch.uint8)[:5] != 0).all()
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t())


def test_act_quantize_gated_backward_scales_both_halves_together():
    # dz's linear half (dh * f(a)) is far larger than its activation half: one tensor scale
    # from the amax of both, and the codes of each half where dz's columns are.
    m, n = 32, 16
    z = torch.cat([torch.full((m, n), 3.0), torch.full((m, n), 0.01)], 1)
    grad = torch.ones(m, n)
    data, data_t, scale_inv, amax, _ = act_q.act_quantize(
        _dev(z), None, _dev(grad), "swiglu", E4M3, None, m, True, False, config=SMALL
    )
    silu3 = 3.0 * torch.sigmoid(torch.tensor(3.0)).item()
    assert data.shape == (m, 2 * n) and data_t.shape == (2 * n, m)
    assert amax.item() == pytest.approx(silu3, rel=1e-6)
    assert scale_inv.item() == pytest.approx(silu3 / 448.0, rel=1e-6)
    values = data.float().cpu() * scale_inv.item()
    # tol: FP8 casts of silu(3): within one E4M3 step (three mantissa bits)
    assert torch.allclose(values[:, n:], torch.full((m, n), silu3), rtol=2**-3)
    assert (values[:, :n] > 0).all() and (values[:, :n] < 0.1).all()
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t())


def test_act_quantize_block_gated_backward_needs_whole_blocks_per_half():
    z, grad = _dev(torch.zeros(128, 2 * 192)), _dev(torch.zeros(128, 192))
    with pytest.raises(ValueError, match=r"half width that is a multiple of 128 .*, got 192"):
        act_q.act_quantize_block(z, None, grad, "swiglu", E4M3, 128, False, False)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        act_q.act_quantize(z, None, None, "swish", E4M3, None, 128, True, False)


# The default launch (a rowwise pass over [32, 128] tiles, a columnwise one over [128, 64]
# tiles; on a GPU whose extension has CUDA, whole bf16 gelu / swiglu tiles take csrc/block_cast.cu)
# and one 128x128 tile for both layouts.
BLOCK_LAUNCHES = pytest.mark.parametrize(
    "config",
    [None, quantize.QuantizeLaunchConfig(block_split=False)],
    ids=["split", "one-tile"],
)

BLOCK_CASES = [
    pytest.param("gelu", torch.bfloat16, True, False, id="gelu-bf16-bias"),
    pytest.param("silu", torch.float32, False, True, id="silu-fp32-pow2"),
    pytest.param("srelu", torch.float16, True, False, id="srelu-fp16-bias"),
    pytest.param("swiglu", torch.bfloat16, True, False, id="swiglu-bf16-bias"),
    pytest.param("clamped_swiglu", torch.float32, False, True, id="clamped-swiglu-fp32-pow2"),
]


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("act,dtype,has_bias,pow2", BLOCK_CASES)
# Padding rows and 128-blocks cut at both edges; and whole 128x128 tiles (the EVEN path).
@pytest.mark.parametrize("m_out,rows,n", [(160, 150, 200), (256, 256, 128)], ids=["ragged", "even"])
@BLOCK_LAUNCHES
def test_act_quantize_block_matches_unfused_kernels(
    act, dtype, has_bias, pow2, backward, m_out, rows, n, config
):
    if act in activation.GATED and backward and n % 128:
        n = 256  # a gated gradient's halves are whole blocks (the ragged edge is in the rows)
    z, bias, grad = _inputs(act, dtype, has_bias, backward, m_out, n)
    z[3, :40] *= 300  # a block with a large amax next to ordinary ones
    v, dbias = _activation_padded(*map(_dev, (z, bias, grad)), act, rows)
    expected = quantize.quantize_blockwise(v, E4M3, 1, pow2, True)
    *actual, actual_dbias = act_q.act_quantize_block(
        *map(_dev, (z, bias, grad)), act, E4M3, rows, True, pow2, config=config
    )
    _check(actual, expected, actual_dbias, dbias, backward, has_bias, dtype)


# Norm prologues (norm_quantize): the norm kernels' output, never written, quantised. -----------

norm_k = pytest.importorskip("te_compile.kernels.norm")

NORM_CASES = [
    pytest.param("LayerNorm", torch.bfloat16, True, False, None, id="ln-bf16-beta-current"),
    pytest.param("LayerNorm", torch.float16, False, True, 4.0, id="ln-fp16-zc-delayed"),
    pytest.param("RMSNorm", torch.bfloat16, False, True, None, id="rms-bf16-zc-current"),
    pytest.param("RMSNorm", torch.float32, False, False, 8.0, id="rms-fp32-delayed"),
]


def _norm_padded(x, weight, bias, normalization, zcg, m_out, config=None):
    """The norm forward kernel's output, zero-padded to ``m_out`` rows, and ``(mean, rsigma)``.
    On the GPU the kernel's own store (the unfused path); the interpreter truncates fp32 to
    bf16 in its store, so there the kernel runs in fp32 and torch rounds to nearest even as the
    GPU does (the statistics always come from ``x``'s dtype: the reduction order of a compiled
    kernel depends on how many elements a thread loads)."""

    def run(t):
        if normalization == "LayerNorm":
            return norm_k.layernorm_fwd(t, weight, bias, 1e-5, zcg, config=config)
        y, rsigma = norm_k.rmsnorm_fwd(t, weight, 1e-5, zcg, config=config)
        return y, rsigma.new_empty(0), rsigma

    y, mean, rsigma = run(x)
    if TRITON_DEVICE != "cuda":
        y = run(x.float())[0].to(x.dtype)
    y = torch.cat([y, y.new_zeros(m_out - x.shape[0], x.shape[1])])
    return y, mean, rsigma


def _norm_inputs(normalization, dtype, has_beta, zcg, rows, n):
    x = (torch.randn(rows, n) * 3 + 1).to(dtype)
    x[2, :7] *= 40  # one row with a large spread
    w = torch.randn(n) * 0.3 + (0.0 if zcg else 1.0)  # an fp32 gamma with a low-precision x
    b = (torch.randn(n) * 0.5).to(dtype) if has_beta else None
    return _dev(x), _dev(w), _dev(b)


@pytest.mark.parametrize("normalization,dtype,has_beta,zcg,scale", NORM_CASES)
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("m_out,rows,n", [(48, 37, 40), (32, 32, 48)], ids=["ragged", "even"])
def test_norm_quantize_matches_unfused_kernels(
    normalization, dtype, has_beta, zcg, scale, config, m_out, rows, n
):
    x, w, b = _norm_inputs(normalization, dtype, has_beta, zcg, rows, n)
    s = None if scale is None else _dev(torch.tensor([scale]))
    y, mean, rsigma = _norm_padded(x, w, b, normalization, zcg, m_out)
    if s is None:
        expected = quantize.quantize_current(y, E4M3, True)
    else:
        data, data_t, _, amax = quantize.quantize_tensorwise(y, s, E4M3, True)
        expected = (data, data_t, s.reciprocal(), amax)
    *actual, a_mean, a_rsigma = act_q.norm_quantize(
        x, w, b, normalization, 1e-5, zcg, E4M3, s, m_out, config=config
    )
    for a, e in zip(actual, expected, strict=True):
        assert a.device.type == TRITON_DEVICE
        assert_bits_equal(a, e)
    assert_bits_equal(a_mean, mean)
    assert_bits_equal(a_rsigma, rsigma)


@pytest.mark.parametrize("normalization,dtype,has_beta,zcg,scale", NORM_CASES[:3])
@pytest.mark.parametrize("m_out,rows,n", [(160, 150, 256), (128, 128, 128)], ids=["ragged", "even"])
@BLOCK_LAUNCHES
def test_norm_quantize_block_matches_unfused_kernels(
    normalization, dtype, has_beta, zcg, scale, m_out, rows, n, config
):
    pow2 = scale is not None  # power-of-two scales in the delayed-scaling case
    x, w, b = _norm_inputs(normalization, dtype, has_beta, zcg, rows, n)
    y, mean, rsigma = _norm_padded(x, w, b, normalization, zcg, m_out)
    expected = quantize.quantize_blockwise(y, E4M3, 1, pow2, True)
    *actual, a_mean, a_rsigma = act_q.norm_quantize_block(
        x, w, b, normalization, 1e-5, zcg, E4M3, m_out, pow2, config=config
    )
    for a, e in zip(actual, expected, strict=True):
        assert_bits_equal(a, e)
    assert_bits_equal(a_mean, mean)
    assert_bits_equal(a_rsigma, rsigma)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-tile-rows", "chunked-rows"])
def test_norm_stats_amax_is_that_of_the_rounded_output(chunked):
    # Rows longer than one tile take the kernel's chunked path (its amax accumulates across
    # chunks); the statistics equal those of the kernel that writes the output.
    config = norm_k.NormLaunchConfig(4, 16, 4, chunked=True) if chunked else None
    x, w, b = _norm_inputs("LayerNorm", torch.bfloat16, True, False, 19, 40)
    _, mean, rsigma = norm_k.layernorm_fwd(x, w, b, 1e-5, False, config=config)
    bits = _dev(torch.zeros(1, dtype=torch.int32))  # kernels.quantize.amax_bits
    s_mean, s_rsigma = norm_k.norm_stats("LayerNorm", x, w, b, 1e-5, False, bits, config=config)
    assert_bits_equal(s_mean, mean)
    assert_bits_equal(s_rsigma, rsigma)
    expected = _norm_padded(x, w, b, "LayerNorm", False, 19, config)[0].float().abs().max()
    assert bits.view(torch.float32).item() == expected.item()


_SLOT_CASTS = {
    "quantize_current": lambda x, s, **kw: quantize.quantize_current(x, E4M3, True, **kw),
    "quantize_tensorwise": lambda x, s, **kw: quantize.quantize_tensorwise(
        x, s, E4M3, True, **kw
    ),
    "act_quantize": lambda x, s, **kw: act_q.act_quantize(
        x, None, None, "gelu", E4M3, s, x.shape[0], True, False, **kw
    ),
    "norm_quantize": lambda x, s, **kw: act_q.norm_quantize(
        x, torch.ones(x.shape[1], device=x.device, dtype=x.dtype), None, "RMSNorm", 1e-5,
        False, E4M3, s, x.shape[0], **kw
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "name,delayed",
    [(n, False) for n in _SLOT_CASTS if n != "quantize_tensorwise"]
    + [(n, True) for n in _SLOT_CASTS if n != "quantize_current"],
)
def test_a_cast_given_a_slot_of_a_shared_amax_buffer_writes_only_that_slot(name, delayed):
    """The casts of one GEMM share one zeroed amax buffer, each folding into its own element
    (``functional.gemm.amax_buffer``): the codes, the scale and the amax equal those of a cast
    with a buffer of its own; the other elements stay zero (a cast that folded into element 0,
    or all of them, fails)."""
    g = torch.Generator().manual_seed(3)
    x = _dev(torch.randn(32, 48, generator=g, dtype=torch.bfloat16) * 3)
    scale = _dev(torch.tensor([2.0])) if delayed else None
    own = _SLOT_CASTS[name](x, scale)
    bits = quantize.amax_bits(x, 3)
    shared = _SLOT_CASTS[name](x, scale, amax=bits, slot=2)
    n_codes = 3  # data, data_t, scale_inv
    for a, e in zip(shared[:n_codes], own[:n_codes], strict=True):
        assert_bits_equal(a, e)
    amax = bits.view(torch.float32)
    assert_bits_equal(amax[2:], own[3])
    assert own[3].item() > 0
    assert torch.equal(bits[:2], torch.zeros_like(bits[:2]))
    assert shared[3].data_ptr() == bits.data_ptr()  # the caller's whole buffer, as fp32
