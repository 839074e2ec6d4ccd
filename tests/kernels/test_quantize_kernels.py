"""The FP8 quantisation Triton kernels (``te_compile.kernels.quantize``) against the CPU
reference implementation (``te_compile.functional.quantize.*_ref``, itself checked against an
independent quantiser in ``tests/functional/test_quantize.py``), bit for bit.

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` (small sizes). A launch configuration
of 16x16 tiles and 64-element amax steps over 3 programs reaches, at a few dozen elements, what
the defaults reach only on large tensors: many tiles, tiles cut by both ends of the input, and
amax programs that loop over several steps. The fp8 conversion itself is checked on every fp8
code, every midpoint between neighbouring codes and the fp32 values one ulp either side of it.
"""

from __future__ import annotations

import math

import pytest
import torch

from te_compile._numerics import reciprocal_rn
from te_compile.functional import quantize as Q
from te_compile.functional.gemm import _balanced
from te_compile.functional.quantize import as_e4m3
from te_compile.kernels import e5m2_to_e4m3_table
from tests.utils import TRITON_DEVICE, assert_bits_equal, requires_cuda, requires_triton

kernels = pytest.importorskip("te_compile.kernels.quantize")
row_kernels = pytest.importorskip("te_compile.kernels.quantize_rows")
scaling_kernels = pytest.importorskip("te_compile.kernels.fp8_scaling")

QuantizeLaunchConfig = kernels.QuantizeLaunchConfig

pytestmark = [pytest.mark.triton, requires_triton]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
SMALL = QuantizeLaunchConfig(block_m=16, block_k=16, amax_block=64, amax_programs=3)
# One 128x128 tile per program: few programs, which the interpreter runs fastest.
WIDE = QuantizeLaunchConfig(block_m=128, block_k=128)
FP8_POW2 = [pytest.param(E4M3, True, id="e4m3-pow2"), pytest.param(E5M2, False, id="e5m2")]
CONFIGS = [pytest.param(None, id="default"), pytest.param(SMALL, id="small")]
SHAPES = [(37, 45), (2, 3, 20), (17,), (1, 1), (0, 8), (5, 0)]
# [150, 129] and [257, 7]: tiles cut by the end of the input in M, in K, or both.
BLOCK_SHAPES = [(3, 50, 129), (1, 1), (257, 7), (0, 5)]


def _x(shape, dtype=torch.bfloat16, std=1.0):
    return (torch.randn(shape) * std).to(dtype)


def _assert_all_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert a.device.type == TRITON_DEVICE and a.is_contiguous()
        assert_bits_equal(a, e)


def _dev(t):
    return t.to(TRITON_DEVICE)


def _tensorwise_ref(x, scale, fp8, columnwise):
    """What ``kernels.quantize_tensorwise`` returns: the op's reference ``(data, data_t, amax)``
    with the inverse scale the cast writes, ``1 / scale`` correctly rounded, before the amax."""
    data, data_t, amax = Q.quantize_tensorwise_ref(x, scale, fp8, columnwise)
    return data, data_t, reciprocal_rn(scale), amax


def _special_values(fp8):
    """Every finite fp8 value, the midpoints between neighbours and the fp32 values one ulp
    either side of them (ties and near-ties of round-to-nearest-even, carries into the exponent,
    subnormals), out-of-range, inf, NaN, signed zeros and fp32 subnormals; as a [M, 64] tensor."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    codes = codes[codes.isfinite()].unique()
    mids = (codes[1:] + codes[:-1]) / 2

    def step(t, ulps):
        return (t.abs().view(torch.int32) + ulps).view(torch.float32) * t.sign()

    special = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-40, 3e38, -1e6]
    values = torch.cat([codes, mids, step(mids, 1), step(mids, -1), torch.tensor(special)])
    return torch.cat([values, torch.zeros(-values.numel() % 64)]).view(-1, 64)


# The conversion ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", FP8)
def test_fp8_conversion_every_code_and_tie(fp8):
    x = _special_values(fp8)
    one = torch.ones(1)
    actual = kernels.quantize_tensorwise(_dev(x), _dev(one), fp8, True)
    _assert_all_equal(actual, _tensorwise_ref(x, one, fp8, True))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", FP8)
def test_fp8_decode_every_code(fp8, out_dtype):
    data = torch.arange(256, dtype=torch.uint8).view(fp8).view(4, 64)
    # scale_inv 3e-3: bf16 and fp16 outputs are rounded (ties included), fp16 ones underflow.
    scale_inv = torch.tensor([3e-3])
    actual = kernels.dequantize_tensorwise(_dev(data), _dev(scale_inv), out_dtype, config=SMALL)
    assert_bits_equal(actual, Q.dequantize_tensorwise_ref(data, scale_inv, out_dtype))


# Per-tensor -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(
    "fp8, dtype",
    [(E4M3, torch.bfloat16), (E5M2, torch.float32), (E4M3, torch.float16)],
    ids=["e4m3-bf16", "e5m2-fp32", "e4m3-fp16"],
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensorwise(shape, fp8, dtype, config):
    x = _x(shape, dtype, std=30.0)  # some values saturate
    scale = torch.tensor([8.0])
    for columnwise in (False, True):
        actual = kernels.quantize_tensorwise(_dev(x), _dev(scale), fp8, columnwise, config=config)
        _assert_all_equal(actual, _tensorwise_ref(x, scale, fp8, columnwise))


@pytest.mark.parametrize("pow2, eps", [(False, 0.0), (True, 0.0), (True, 2.0**-4)], ids=str)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_current(shape, fp8, pow2, eps):
    # SMALL: the amax of 3 programs looping over 64-element steps feeds 16x16 cast tiles (the
    # default tiles are covered by test_tensorwise and test_amax).
    x = _x(shape, std=1e-2)
    actual = kernels.quantize_current(_dev(x), fp8, True, eps, pow2, config=SMALL)
    _assert_all_equal(actual, Q.quantize_current_ref(x, fp8, True, eps, pow2))


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # amax 1e-44
@pytest.mark.parametrize("fp8", FP8)
def test_special_values_per_tensor(fp8):
    """inf, NaN, overflow and a subnormal-fp32 amax through both per-tensor paths."""
    x = torch.randn(3, 40)
    x[0, 1], x[0, 2], x[1, 3], x[2, 4] = float("inf"), -float("inf"), 1e30, float("nan")
    scale = torch.tensor([4.0])
    x_inf = torch.where(x.isnan(), 0.0, x)
    tiny = torch.full((3, 40), 1e-44)
    for t in (x, x_inf, tiny, torch.zeros(3, 40)):
        actual = kernels.quantize_tensorwise(_dev(t), _dev(scale), fp8, True, config=SMALL)
        _assert_all_equal(actual, _tensorwise_ref(t, scale, fp8, True))
        for pow2 in (False, True):
            actual = kernels.quantize_current(_dev(t), fp8, True, 0.0, pow2, config=SMALL)
            _assert_all_equal(actual, Q.quantize_current_ref(t, fp8, True, 0.0, pow2))


def test_amax():
    x = torch.randn(1000)
    x[777] = -50.0
    for config in (None, SMALL):  # SMALL: 3 programs, each looping over 6 steps of 64
        assert kernels.amax(_dev(x), config=config).item() == 50.0
    x[3] = float("inf")
    assert kernels.amax(_dev(x), config=SMALL).item() == float("inf")
    x[999] = float("nan")  # NaN wins over inf, in any program
    assert kernels.amax(_dev(x), config=SMALL).isnan().all()
    assert kernels.amax(_dev(torch.full((5,), -0.0))).item() == 0.0
    assert kernels.amax(_dev(torch.empty(0, 3))).item() == 0.0


# Blockwise ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("fp8, pow2", FP8_POW2)
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=str)
def test_blockwise(shape, fp8, pow2, block_rows):
    x = _x(shape)
    if x.numel():  # magnitudes from 1e-3 to 1e3 across the columns: every block its own scale
        x = x * torch.logspace(-3, 3, shape[-1]).to(x.dtype)
    runs = [(False, None), (True, None)]
    if block_rows == 1:
        runs.append((False, SMALL))  # rowwise-only 1x128: 16 rows per program
    for columnwise, config in runs:
        actual = kernels.quantize_blockwise(
            _dev(x), fp8, block_rows, pow2, columnwise, config=config
        )
        _assert_all_equal(actual, Q.quantize_blockwise_ref(x, fp8, block_rows, pow2, columnwise))


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("shape", [(256, 384), (48, 144)], ids=str)
def test_blockwise_writes_the_transposed_copy_into_given_views(shape, block_rows):
    """``out_t``: the transposed copy and its scales land in views of larger flat buffers (the
    grouped blockwise op packs experts so), the same bytes as a fresh call; the rest of the
    buffers is untouched; views of another shape are refused."""
    fp8, (m, k) = torch.float8_e4m3fn, shape
    x = _dev(_x(shape) * torch.logspace(-3, 3, k).to(torch.bfloat16))
    want = kernels.quantize_blockwise(x, fp8, block_rows, False, True)
    s_shape = want[3].shape
    data_buf = torch.full((k * m + 32,), 7, dtype=torch.uint8, device=x.device)
    scale_buf = torch.full((s_shape.numel() + 8,), -1.0, device=x.device)
    views = (data_buf[16 : 16 + k * m].view(k, m), scale_buf[8:].view(s_shape))
    actual = kernels.quantize_blockwise(x, fp8, block_rows, False, True, out_t=views)
    _assert_all_equal(actual, want)
    assert actual[2].data_ptr() == views[0].data_ptr()
    assert_bits_equal(views[0].view(fp8), want[2])
    assert (data_buf[:16] == 7).all() and (data_buf[16 + k * m :] == 7).all()
    assert (scale_buf[:8] == -1).all()
    # The scales rows-major (strides (1, K)), the layout cuBLAS's blockwise GEMM reads.
    rows_major = torch.empty(s_shape[1], s_shape[0], device=x.device).t()
    actual = kernels.quantize_blockwise(x, fp8, block_rows, False, True,
                                        out_t=(views[0], rows_major))  # fmt: skip
    assert actual[3] is rows_major and actual[3].stride() == (1, s_shape[0])
    assert_bits_equal(rows_major, want[3])
    with pytest.raises(ValueError, match="out_t must be"):
        kernels.quantize_blockwise(x, fp8, block_rows, False, True, out_t=(views[0].t(), views[1]))


@pytest.mark.parametrize("fp8, pow2", FP8_POW2)
@pytest.mark.parametrize("shape", [(256, 384), (3, 50, 129)], ids=str)
def test_blockwise_sums(shape, fp8, pow2):
    """``quantize_blockwise_sums``: the 1x128 cast in both layouts (on CUDA, whole bf16 tiles
    take the one-read CUDA kernel) and the fp32 column sums of the input."""
    x = _x(shape) * torch.logspace(-3, 3, shape[-1]).to(torch.bfloat16)
    *actual, sums = kernels.quantize_blockwise_sums(_dev(x), fp8, pow2)
    _assert_all_equal(actual, Q.quantize_blockwise_ref(x, fp8, 1, pow2, True))
    want = x.reshape(-1, shape[-1]).double().sum(0)
    assert sums.dtype == torch.float32 and sums.shape == want.shape
    # tol: fp32 column sums of values over six decades (not yet assert_close_sum)
    torch.testing.assert_close(sums.cpu().double(), want, rtol=1e-5, atol=1e-3)


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # amax 1e-44
@pytest.mark.parametrize("fp8, pow2", FP8_POW2)
def test_special_values_blockwise(fp8, pow2):
    x = torch.randn(130, 260)
    x[0, 1], x[5, 200], x[129, 259] = float("inf"), float("nan"), 1e30
    x[64:, 128:256] = 0.0  # all-zero blocks
    x[9, :128] = 1e-44  # a 1x128 block with a subnormal amax: scale FLT_MAX
    for block_rows in (1, 128):
        actual = kernels.quantize_blockwise(_dev(x), fp8, block_rows, pow2, True)
        _assert_all_equal(actual, Q.quantize_blockwise_ref(x, fp8, block_rows, pow2, True))


# (20, 150) with 16x16 tiles: scale blocks change inside a row of tiles.
DEQUANT_SHAPES = [((130, 200), WIDE), ((3, 50, 129), WIDE), ((20, 150), SMALL), ((1, 1), None)]


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("shape, config", DEQUANT_SHAPES, ids=lambda v: str(v)[:16])
def test_dequantize_blockwise(shape, config, block_rows):
    x = _x(shape, torch.float32, std=100.0)
    data, scale_inv, data_t, scale_inv_t = Q.quantize_blockwise_ref(
        x, E4M3, block_rows, False, True
    )
    for d, s, out_dtype in (
        (data, scale_inv, torch.bfloat16),
        (data_t, scale_inv_t, torch.float16),
    ):
        actual = kernels.dequantize_blockwise(
            _dev(d), _dev(s), block_rows, out_dtype, config=config
        )
        assert_bits_equal(actual, Q.dequantize_blockwise_ref(d, s, block_rows, out_dtype))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_tensorwise(shape):
    data, _, scale_inv, _ = Q.quantize_current_ref(_x(shape), E5M2, False)
    for out_dtype in (torch.float32, torch.bfloat16):
        actual = kernels.dequantize_tensorwise(_dev(data), _dev(scale_inv), out_dtype, config=SMALL)
        assert_bits_equal(actual, Q.dequantize_tensorwise_ref(data, scale_inv, out_dtype))


# Configuration and conversion paths -----------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="block_k must be a power of two, got 24"):
        QuantizeLaunchConfig(block_k=24)
    for name in ("amax_programs", "amax_per_sm", "amax_num_warps"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1, got 0"):
            QuantizeLaunchConfig(**{name: 0})


@requires_cuda
@pytest.mark.parametrize("fp8", FP8)
def test_software_conversion_matches_hardware_on_cuda(fp8):
    """The integer conversion the interpreter runs equals the GPU's cvt instructions."""
    x = _special_values(fp8).cuda()
    one = torch.ones(1, device="cuda")
    soft = QuantizeLaunchConfig(software_convert=True)
    hard = QuantizeLaunchConfig(software_convert=False)
    for a, b in zip(
        kernels.quantize_tensorwise(x, one, fp8, True, config=soft),
        kernels.quantize_tensorwise(x, one, fp8, True, config=hard),
        strict=True,
    ):
        assert_bits_equal(a, b.cpu())
    data = torch.arange(256, dtype=torch.uint8).view(fp8).view(4, 64).cuda()
    s = torch.tensor([3e-3], device="cuda")
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        a = kernels.dequantize_tensorwise(data, s, out_dtype, config=soft)
        b = kernels.dequantize_tensorwise(data, s, out_dtype, config=hard)
        assert_bits_equal(a, b.cpu())


@pytest.mark.parametrize("length", [1, 3, 16])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("split", [3, 2, 1], ids=["one_amax", "fwd_grad", "1_2"])
@pytest.mark.parametrize("limits", [[448.0, 448.0, 57344.0], [448.0] * 3], ids=["hybrid", "e4m3"])
def test_delayed_scaling_update_kernel_matches_reference(length, algo, margin, split, limits):
    """The one-launch update of the delayed-scaling state equals the plain-torch definition on
    a leading-rows slice of a larger history holding zero, inf and NaN amaxes: history rows and
    scales bit for bit; an untouched row below the slice stays as it was. The last amaxes come
    in one tensor or in two (``amax`` for the first ``split`` slots, ``amax_tail`` for the
    others: FP8GemmState's forward and gradient buffers), the limits as scalars."""
    from te_compile.functional.fp8_scaling import (
        _limit_runs,
        delayed_scaling_update_ref,
        scale_copy,
    )

    torch.manual_seed(length + margin)
    history = torch.rand(20, 3) * 10
    history[2, 0], history[1, 2], history[0, 1] = float("nan"), float("inf"), 0.0
    last = torch.tensor([0.0, 3.5, 1e-37])  # 1e-37: a scale past fp32, clamped
    scale = torch.rand(3) + 0.5
    h_ref, s_ref = history.clone(), scale.clone()
    delayed_scaling_update_ref(h_ref[:length], s_ref, last, limits, margin, algo)
    h, s = _dev(history.clone()), _dev(scale.clone())
    out = scale_copy(s).fill_(-1.0)
    head, tail = (_dev(last), None) if split == 3 else (_dev(last[:split]), _dev(last[split:]))
    # A second state of the same shapes in the same launch (a LayerNormMLP's two GEMMs), with
    # other values: each program updates its own state.
    history2, last2, scale2 = history.flip(0) * 0.5, last.flip(0) + 1.0, scale.flip(0)
    h2_ref, s2_ref = history2.clone(), scale2.clone()
    delayed_scaling_update_ref(h2_ref[:length], s2_ref, last2, limits, margin, algo)
    h2, s2 = _dev(history2.clone()), _dev(scale2.clone())
    head2, tail2 = (_dev(last2), None) if split == 3 else (_dev(last2[:split]), _dev(last2[split:]))
    first, second = (h[:length], s, head, tail), (h2[:length], s2, head2, tail2)
    scaling_kernels.delayed_scaling_update([first], out, _limit_runs(limits), margin, algo == "max")
    assert_bits_equal(h, h_ref)
    assert_bits_equal(s, s_ref)
    assert_bits_equal(out, s_ref)  # the strided copy of the new scales
    h.copy_(_dev(history)), s.copy_(_dev(scale))
    both = scale_copy(s, 2).fill_(-1.0)  # the first state as the launch's second program
    scaling_kernels.delayed_scaling_update([second, first], both, _limit_runs(limits), margin,
                                           algo == "max")  # fmt: skip
    assert_bits_equal(h, h_ref)
    assert_bits_equal(s, s_ref)
    assert_bits_equal(h2, h2_ref)
    assert_bits_equal(s2, s2_ref)
    assert_bits_equal(both, torch.cat([s2_ref, s_ref]))
    assert not torch.equal(s_ref, scale)  # the case does change some scales
    assert not torch.equal(s2_ref, s_ref)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(37, 45), (2, 3, 1100), (5, 16), (0, 32)])
def test_rowwise_kernel_matches_reference(fp8, dtype, shape):
    """The one-launch rowwise quantisation (grouped FP8 GEMMs) equals the torch definition in
    ``functional.quantize.quantize_rowwise`` bit for bit: rows cut by the block
    (45, 1100 > one 1024-wide block), an all-zero row, a row holding inf, one holding NaN, one
    holding only subnormal-sized values, and a saturating row."""
    from te_compile.functional.quantize import quantize_rowwise as reference

    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 3
    flat = x.view(-1, shape[-1])
    if flat.shape[0] >= 5:
        flat[0] = 0.0
        flat[1, 3] = float("inf")
        flat[2, 1] = float("nan")
        flat[3] = torch.randn(shape[-1]) * 1e-30
        flat[4, -1] = 1e6
    x = x.to(dtype)
    data, scale_inv = row_kernels.quantize_rowwise(_dev(x), fp8, block_m=4, block_k=32)
    want_data, want_scale_inv = reference(x, fp8)
    assert_bits_equal(data, want_data)
    assert_bits_equal(scale_inv, want_scale_inv)


@pytest.mark.parametrize("e4m3_codes", [False, True], ids=["fp8", "e4m3_codes"])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 45), (2, 3, 1100), (0, 32), (3, 0)])
@pytest.mark.parametrize("special", ["finite", "nan"])
def test_rowwise_kernel_with_a_given_scale_is_the_per_tensor_cast(
    special, shape, dtype, fp8, e4m3_codes
):
    """With a given scale (delayed scaling), the rowwise kernel writes the per-tensor cast's
    bytes (``functional.gemm.quantize_per_tensor``; E4M3 codes with ``e4m3_codes``, as
    ``functional.quantize.as_e4m3`` recodes them), the scale's inverse in every row, and
    folds ``max|x|`` into its slot of the amax buffer in the same pass: saturating,
    subnormal-sized, inf and (``nan``) NaN entries, rows cut by the block; scale and amax go
    together."""
    from te_compile.functional.gemm import quantize_per_tensor

    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 3
    flat = x.view(math.prod(shape[:-1]), shape[-1])
    if flat.numel() and flat.shape[0] >= 4:
        flat[0, -1] = 1e6  # saturates
        flat[1] = torch.randn(shape[-1]) * 1e-30
        flat[2, 3] = float("nan") if special == "nan" else -7.5
        flat[3, 1] = float("inf") if special == "nan" else 2.0
    x = x.to(dtype)
    scale = torch.tensor([2.0**5 * 1.3])
    amax = _dev(torch.zeros(2))  # folded into slot 1; slot 0 is another cast's
    data, scale_inv = row_kernels.quantize_rowwise(
        _dev(x), fp8, scale=_dev(scale), amax=amax, amax_slot=1, e4m3_codes=e4m3_codes,
        block_m=4, block_k=32,
    )  # fmt: skip
    want_data, want_inv, want_amax = quantize_per_tensor(flat.to(dtype), fp8, scale)
    want_inv = want_inv.expand(flat.shape[0])
    if e4m3_codes:
        want_data, want_inv = as_e4m3(want_data, want_inv)
    assert_bits_equal(data.view(flat.shape), want_data)
    assert_bits_equal(scale_inv.reshape(-1), want_inv)
    assert_bits_equal(amax.cpu(), torch.stack([torch.zeros(()), want_amax.reshape(()).float()]))
    with pytest.raises(ValueError, match="scale and amax go together"):
        row_kernels.quantize_rowwise(_dev(x), fp8, scale=_dev(scale))


def test_e5m2_to_e4m3_table_is_exact_down_to_one():
    """Every finite E5M2 value of magnitude 1 or more times ``2**-7`` is an E4M3 value (the code
    holds it exactly, 57344 -> 448), smaller ones are E4M3's round-to-nearest-even of it (on the
    subnormal grid, steps of ``2**-9``), inf and NaN give NaN."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e5m2 = codes.view(E5M2).double()
    got = e5m2_to_e4m3_table(torch.device("cpu")).view(E4M3).double()
    finite = torch.isfinite(e5m2)
    assert torch.isnan(got[~finite]).all() and finite.sum() == 256 - 8  # inf, 3 NaNs a sign
    shifted = e5m2[finite] * 2.0**-7
    exact = e5m2[finite].abs() >= 1
    assert torch.equal(got[finite][exact], shifted[exact])
    assert got[finite].abs().max() == 448
    small = got[finite][~exact]
    assert torch.equal(small, (shifted[~exact] * 2.0**9).round() * 2.0**-9)  # round half even


def test_e5m2_to_e4m3_table_first_made_while_tracing():
    """Asked for the first time while a graph is traced (fake tensors: AOTAutograd tracing a
    grouped FP8 op for Inductor), the table is made of real codes, eager's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import te_compile.kernels as k

    expected = e5m2_to_e4m3_table(torch.device("cpu"))
    k._e5m2_to_e4m3_codes.cache_clear()
    with FakeTensorMode():
        k._e5m2_to_e4m3_codes()
    assert torch.equal(e5m2_to_e4m3_table(torch.device("cpu")), expected)


@pytest.mark.parametrize("numel", [0, 1, 255, 4096 * 3 + 17])
def test_recode_e5m2_kernel_matches_the_table(numel):
    """``recode_e5m2_as_e4m3`` maps every byte through the table (all 256 codes, a tail cut by
    the block), and refuses a non-E5M2 input by name."""
    torch.manual_seed(numel)
    codes = torch.randint(0, 256, (numel,), dtype=torch.int32).to(torch.uint8)
    codes[: min(numel, 256)] = torch.arange(min(numel, 256), dtype=torch.int32).to(torch.uint8)
    data = codes.view(E5M2)
    got = row_kernels.recode_e5m2_as_e4m3(_dev(data), block=1024)
    table = e5m2_to_e4m3_table(torch.device("cpu"))
    assert got.dtype is E4M3
    assert torch.equal(got.cpu().view(torch.uint8), table[codes.long()])
    with pytest.raises(ValueError, match="data must be float8_e5m2"):
        row_kernels.recode_e5m2_as_e4m3(_dev(data.view(E4M3)))


@pytest.mark.parametrize("given", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("rows", [37, 0])
def test_kernels_write_e5m2_as_e4m3_codes(rows, given):
    """``e4m3_codes=True``: the rowwise and the group-column casts store an E5M2 result as its
    E4M3 codes with the inverse scales times 128, bit for bit the torch definition followed by
    the recoding (``functional.quantize.as_e4m3``); inf / NaN / subnormal-sized /
    saturating entries, empty rows and groups; E4M3 casts are unchanged by the flag."""
    import importlib

    GF = importlib.import_module("te_compile.functional.grouped_fp8")
    torch.manual_seed(rows)
    x = torch.randn(rows, 45) * 3
    if rows:
        x[0] = 0.0
        x[1, 3], x[2, 1] = float("inf"), float("nan")
        x[3] = torch.randn(45) * 1e-30
        x[4, -1] = 1e6
        x[:, 5] = torch.randn(rows) * 1e-4  # values below 1 in E5M2's scaled units
    x = x.to(torch.bfloat16)
    if not given:
        data, inv = row_kernels.quantize_rowwise(_dev(x), E5M2, e4m3_codes=True, block_k=32)
        want_data, want_inv = as_e4m3(*Q.quantize_rowwise(x, E5M2))
        assert data.dtype is E4M3
        assert_bits_equal(data, want_data)
        assert_bits_equal(inv, want_inv)
        e4 = row_kernels.quantize_rowwise(_dev(x), E4M3, e4m3_codes=True, block_k=32)
        _assert_all_equal(e4, Q.quantize_rowwise(x, E4M3))
    splits = torch.tensor([rows - rows // 2, 0, rows // 2])
    scale = torch.tensor([2.0**12]) if given else None
    want_data, want_inv, want_ends = GF.quantize_group_columns(x, splits, E5M2, scale)
    want_data, want_inv = as_e4m3(want_data, want_inv)
    data_t, scale_inv = row_kernels.quantize_group_columns(
        _dev(x), _dev(splits.cumsum(0).to(torch.int32)), _dev(want_ends), want_data.shape[1],
        E5M2, scale=None if scale is None else _dev(scale), e4m3_codes=True, block_n=16,
        block_k=16,
    )  # fmt: skip
    assert data_t.dtype is E4M3
    assert_bits_equal(data_t, want_data)
    assert_bits_equal(scale_inv, want_inv)


def test_kernels_write_e5m2_as_e4m3_codes_at_default_launch():
    """The same at the launch parameters the grouped op uses (1024-wide row blocks, 128 x 32
    column tiles) on a 300 x 2048 gradient, values over the whole E5M2 range."""
    import importlib

    GF = importlib.import_module("te_compile.functional.grouped_fp8")
    torch.manual_seed(7)
    x = torch.randn(300, 2048) * torch.logspace(-14, 2, 2048, base=2.0)
    x = x.to(torch.bfloat16)
    data, inv = row_kernels.quantize_rowwise(_dev(x), E5M2, e4m3_codes=True)
    want = as_e4m3(*Q.quantize_rowwise(x, E5M2))
    _assert_all_equal((data, inv), want)
    splits = torch.tensor([100, 0, 200])
    want_data, want_inv, want_ends = GF.quantize_group_columns(x, splits, E5M2)
    want_data, want_inv = as_e4m3(want_data, want_inv)
    got = row_kernels.quantize_group_columns(
        _dev(x), _dev(splits.cumsum(0).to(torch.int32)), _dev(want_ends), want_data.shape[1],
        E5M2, e4m3_codes=True,
    )  # fmt: skip
    _assert_all_equal(got, (want_data, want_inv))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 70, 45), (2, 16, 130), (40, 9), (2, 0, 8)])
def test_columnwise_transposed_kernel_matches_rowwise_of_the_transpose(fp8, dtype, shape):
    """``quantize_columnwise_transposed(x)`` equals ``quantize_rowwise(x.transpose(-2, -1))`` (the
    torch definition) bit for bit: tiles cut along N and K (64 x 64), an all-zero column, one
    holding inf, one NaN, one of subnormal-sized values, a saturating one."""
    from te_compile.functional.quantize import quantize_rowwise as reference

    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 3
    if shape[-2] >= 2 and shape[-1] >= 5:
        x[..., 0] = 0.0
        x[..., 3, 1] = float("inf") if shape[-2] > 3 else 0.0
        x[..., 1, 2] = float("nan")
        x[..., 3] = torch.randn(x[..., 3].shape) * 1e-30
        x[..., -1, 4] = 1e6
    x = x.to(dtype)
    data_t, scale_inv = row_kernels.quantize_columnwise_transposed(_dev(x), fp8)
    if shape[-2] == 0:  # empty columns: amax 0, scale 1 (torch's amax refuses an empty dim)
        assert data_t.shape == (*shape[:-2], shape[-1], 0)
        assert torch.equal(scale_inv.cpu(), torch.ones(*shape[:-2], shape[-1]))
        return
    want_data, want_scale_inv = reference(x.transpose(-2, -1).contiguous(), fp8)
    assert data_t.shape == want_data.shape
    assert_bits_equal(data_t, want_data)
    assert_bits_equal(scale_inv, want_scale_inv)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_columnwise_transposed_kernel_with_a_given_scale(fp8, dtype):
    """With ``scale`` (delayed scaling) the transposed copy is the per-tensor cast's codes,
    transposed: ``quantize_tensorwise`` of each matrix, bit for bit (saturation included)."""
    torch.manual_seed(0)
    x = (torch.randn(3, 70, 45) * 3).to(dtype)
    x[1, 5, 7] = 1e4  # saturates at this scale
    scale = torch.tensor([64.0])
    data_t, _ = row_kernels.quantize_columnwise_transposed(_dev(x), fp8, scale=_dev(scale))
    for b in range(3):
        want, *_ = kernels.quantize_tensorwise(_dev(x[b]), _dev(scale), fp8, False)
        assert_bits_equal(data_t[b], want.t().contiguous())


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("given", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize(
    "splits", [[17, 0, 40, 5], [0, 0], [16, 32], [70]], ids=["uneven", "empty", "aligned", "one"]
)
def test_group_columns_kernel_matches_the_torch_loop(fp8, dtype, given, splits):
    """``quantize_group_columns`` (the grouped FP8 wgrad's operands: each token group's columns
    quantised over its rows, written transposed into 16-aligned column ranges) equals the torch
    loop of ``functional.grouped_fp8`` bit for bit: data including the zero padding and
    the unused tail, scales, padded offsets. Groups cut by the 16 x 16 tiles, an all-zero
    column, inf / NaN / subnormal-sized / saturating columns, empty groups."""
    from te_compile.functional.grouped_fp8 import quantize_group_columns as reference

    torch.manual_seed(len(splits) + sum(splits))
    m, k = sum(splits), 45
    x = torch.randn(m, k) * 3
    if m > 20:
        x[:, 0] = 0.0
        x[3, 1] = float("inf")
        x[1, 2] = float("nan")
        x[:, 3] = torch.randn(m) * 1e-30
        x[-1, 4] = 1e6
    x = x.to(dtype)
    m_splits = torch.tensor(splits)
    scale = torch.tensor([64.0]) if given else None
    want_data, want_inv, want_ends = reference(x, m_splits, fp8, scale)
    ends = _dev(m_splits.cumsum(0).to(torch.int32))
    data_t, scale_inv = row_kernels.quantize_group_columns(
        _dev(x), ends, _dev(want_ends), want_data.shape[1], fp8,
        scale=None if scale is None else _dev(scale), block_n=16, block_k=16,
    )  # fmt: skip
    assert data_t.shape == (k, (m + 15 * len(splits) + 15) // 16 * 16)
    assert_bits_equal(data_t, want_data)
    assert_bits_equal(scale_inv, want_inv)
    # Group g starts at a multiple of 16; its padding and the tail are zero codes.
    starts = [0, *want_ends.tolist()]
    for g, rows in enumerate(splits):
        assert starts[g] % 16 == 0 and starts[g + 1] - starts[g] == (rows + 15) // 16 * 16
        assert not data_t[:, starts[g] + rows : starts[g + 1]].view(torch.uint8).any()
    assert not data_t[:, starts[-1] :].view(torch.uint8).any()


@pytest.mark.parametrize("sizes", [(4, 3), (3000, 1), (1, 2500)])
def test_balance_scales_kernel_equals_the_torch_ops(sizes):
    """The one-launch balancing of a grouped GEMM's two scale vectors (CUDA) gives the bits of
    ``gemm._balanced``'s torch ops (the CPU path), across several 1024-element chunks
    and with either vector the larger."""
    torch.manual_seed(0)
    na, nb = sizes
    sa = torch.exp2(torch.randint(-40, 120, (na,)).float()) * (1 + torch.rand(na))
    sb = torch.exp2(torch.randint(-60, 20, (nb,)).float()) * (1 + torch.rand(nb))
    for a, b in ((sa, sb), (sb, sa)):
        want = _balanced(a, b)
        got = row_kernels.balance_scales(a.to(TRITON_DEVICE), b.to(TRITON_DEVICE))
        for g, w in zip(got, want, strict=True):
            assert_bits_equal(g.cpu(), w)


PAIRS = [
    pytest.param(((37, 45), (2, 3, 20)), id="two-shapes"),
    pytest.param(((16, 16), (33, 17)), id="whole-and-cut-tiles"),
    pytest.param(((5, 0), (9, 7)), id="one-empty"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("columnwise", [(True, True), (False, True)], ids=str)
@pytest.mark.parametrize("shapes", PAIRS)
def test_pair_equals_two_single_casts(shapes, columnwise, delayed, config):
    """``quantize_pair`` (both amax passes in one launch, both casts in one) gives each tensor
    the bits, the inverse scale and the amax slot that the single casts give, with the slots
    either way round; a tensor of another dtype, or an empty one, goes through the single casts."""
    torch.manual_seed(0)
    x = [_dev(_x(shapes[0], std=3.0)), _dev(_x(shapes[1], std=0.25))]
    scales = (_dev(torch.tensor([2.0**-3])), _dev(torch.tensor([6.0]))) if delayed else (None,) * 2
    for slots in ((0, 1), (1, 0)):
        bits = kernels.amax_bits(x[0], 2)
        got = kernels.quantize_pair(x, E4M3, columnwise, bits, slots, scales, config=config)
        ref_bits = kernels.amax_bits(x[0], 2)
        for i, (t, c, slot) in enumerate(zip(x, columnwise, slots, strict=True)):
            if delayed:
                want = kernels.quantize_tensorwise(t, scales[i], E4M3, c, config=config,
                                                   amax=ref_bits, slot=slot)  # fmt: skip
            else:
                want = kernels.quantize_current(t, E4M3, c, config=config, amax=ref_bits,
                                                slot=slot)  # fmt: skip
            _assert_all_equal(got[i][:3], want[:3])
        assert_bits_equal(bits, ref_bits)
        assert bits[slots[1]] > 0 and (bits[slots[0]] > 0 or not x[0].numel())


def test_pair_of_two_dtypes_casts_each_alone():
    """A bf16 and an fp32 tensor (two GUARD settings, so not one launch): the single casts."""
    x = [_dev(_x((20, 24))), _dev(_x((12, 8), dtype=torch.float32))]
    bits, ref_bits = (kernels.amax_bits(x[0], 2) for _ in range(2))
    got = kernels.quantize_pair(x, E5M2, (True, False), bits, (0, 1), config=SMALL)
    for i, t in enumerate(x):
        want = kernels.quantize_current(t, E5M2, i == 0, config=SMALL, amax=ref_bits, slot=i)
        _assert_all_equal(got[i][:3], want[:3])
    assert_bits_equal(bits, ref_bits)
