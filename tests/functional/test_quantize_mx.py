"""MXFP8 and NVFP4 quantisation (``te_compile.functional.quantize_mx``) beyond the registry test.

The ops are checked bit for bit against the independent quantisers of
``tests/utils/references.py``: a loop over blocks that picks each element's code by
nearest-value lookup over the format's finite values (ties to the even code, which is
round-to-nearest-even; the lookup saturates by itself), with the scale
from ``math.frexp`` (MXFP8) or numpy fp32 scalars in Transformer Engine's order of operations
(NVFP4). Round trips are checked against per-element bounds that follow from the formats:
half a grid step at the element's scaled magnitude, or the saturation gap.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from te_compile import _library
from te_compile.functional import quantize_mx as qmx
from te_compile.functional import quantize_mx_ref as qmxr
from tests.samples import SAMPLES
from tests.utils import DEVICES, assert_close, compile_counted, count_graph_breaks, references

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DTYPES = [E4M3, E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Mantissa bits of the MXFP8 element formats.
MBITS = {E4M3: 3, E5M2: 2}
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MX_SHAPES = [(1, 1), (3, 7), (5, 40), (33, 65), (2, 3, 64)]
NV_SHAPES = [(2, 2), (4, 18), (6, 40), (34, 66), (2, 3, 32)]


def _x(shape, dtype=torch.float32, device="cpu", spread=12):
    """Normal values times powers of two over ``2 * spread`` binades: blocks of varied scale."""
    x = torch.randn(*shape) * torch.exp2(torch.randint(-spread, spread + 1, shape).float())
    return x.to(device=device, dtype=dtype)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(_bits(actual.cpu()), _bits(expected.cpu()))


# Independent reference quantisers: tests/utils/references.py ---------------------------------

_mx_expected, _nvfp4_expected = references.mxfp8_rows, references.nvfp4_rows
_nvfp4_global = references.nvfp4_global


def _rows(x):
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


# Quantisation, bit for bit -----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
def test_quantize_mxfp8_matches_independent_reference(shape, dtype, fp8_dtype, device):
    x = _x(shape, dtype, device, spread=6 if dtype == torch.float16 else 12)
    data, scale, data_t, scale_t = qmx.quantize_mxfp8(x, fp8_dtype)
    x2 = _rows(x.cpu())
    for (d, s), xr in (((data, scale), x2), ((data_t, scale_t), x2.t())):
        d_exp, s_exp = _mx_expected(xr, fp8_dtype)
        assert d.dtype == fp8_dtype and s.dtype == torch.uint8
        _assert_same_bits(d.reshape(d_exp.shape).view(torch.uint8), d_exp)
        _assert_same_bits(s, s_exp)
    assert data.shape == x.shape and data_t.shape == x2.t().shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("global_amax", [None, 0.5, 1e30], ids=["own", "small", "large"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NV_SHAPES, ids=str)
def test_quantize_nvfp4_matches_independent_reference(shape, dtype, global_amax, device):
    x = _x(shape, dtype, device, spread=6 if dtype == torch.float16 else 12)
    ga = None if global_amax is None else torch.tensor([global_amax], device=device)
    data, scale, g, data_t, scale_t = qmx.quantize_nvfp4(x, ga)
    x2 = _rows(x.cpu())
    g_exp = _nvfp4_global(x2.abs().max().item() if ga is None else global_amax)
    assert g.shape == () and g.dtype == torch.float32 and g.item() == g_exp
    for (d, s), xr in (((data, scale), x2), ((data_t, scale_t), x2.t())):
        d_exp, s_exp = _nvfp4_expected(xr, g_exp)
        assert d.dtype == torch.uint8 and s.dtype == E4M3
        _assert_same_bits(d.reshape(d_exp.shape), d_exp)
        _assert_same_bits(s.view(torch.uint8), s_exp)
    assert data.shape == (*shape[:-1], shape[-1] // 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_dequantize_matches_independent_decoding(out_dtype, device):
    x = _x((6, 50), device=device)
    for fp8_dtype in FP8_DTYPES:
        data, scale, _, _ = qmx.quantize_mxfp8(x, fp8_dtype, columnwise=False)
        factor = torch.tensor([2.0 ** (b - 127) for b in scale.flatten().tolist()])
        expected = data.cpu().double() * factor.view(6, -1).repeat_interleave(32, 1)[:, :50]
        out = qmx.dequantize_mxfp8(data, scale, out_dtype)
        assert out.dtype == out_dtype and out.shape == x.shape
        torch.testing.assert_close(out.cpu(), expected.to(out_dtype), rtol=0, atol=0)
    data, scale, g, _, _ = qmx.quantize_nvfp4(x, columnwise=False)
    nibbles = torch.stack([data.cpu() & 15, data.cpu() >> 4], -1).view(6, 50).long()
    e2m1 = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7] * (1 - 2 * (nibbles >> 3))
    s = scale.cpu().double().repeat_interleave(16, 1)[:, :50]
    expected = (e2m1 * s).float() / g.cpu()  # exact product, then one fp32 division
    out = qmx.dequantize_nvfp4(data, scale, g, out_dtype)
    assert out.dtype == out_dtype and out.shape == x.shape
    torch.testing.assert_close(out.cpu(), expected.to(out_dtype), rtol=0, atol=0)


# Round trips within the format's error --------------------------------------------------------


def _half_step_mx(t, fp8_dtype):
    """Half the grid step of the fp8 format at magnitudes ``t`` (float64)."""
    emin = 1 - (7 if fp8_dtype == E4M3 else 15)
    e = torch.floor(torch.log2(t.clamp(min=2.0**emin))).clamp(min=emin)
    return torch.exp2(e - MBITS[fp8_dtype] - 1)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
def test_mxfp8_round_trip_error_bound(fp8_dtype):
    x = _x((16, 96), spread=20).double()
    data, scale, _, _ = qmx.quantize_mxfp8(x.float(), fp8_dtype, columnwise=False)
    y = qmx.dequantize_mxfp8(data, scale, torch.float32).double()
    unit = torch.exp2(scale.double() - 127).repeat_interleave(32, 1)  # 2**X per element
    t = x.abs() / unit
    max_value = torch.finfo(fp8_dtype).max
    bound = torch.where(t > max_value, t - max_value, _half_step_mx(t, fp8_dtype)) * unit
    assert ((y - x).abs() <= bound).all()
    # Hence elements in the format's normal range, unsaturated, are within 2**-(m+1) relative.
    normal = (t >= torch.finfo(fp8_dtype).smallest_normal) & (t <= max_value)
    assert ((y - x).abs() / x.abs())[normal].max() <= 2.0 ** -(MBITS[fp8_dtype] + 1)


def test_nvfp4_round_trip_error_bound():
    x = _x((16, 96), spread=20)
    data, scale, g, _, _ = qmx.quantize_nvfp4(x, columnwise=False)
    y = qmx.dequantize_nvfp4(data, scale, g, torch.float32).double()
    unit = (scale.double() / g.double()).repeat_interleave(16, 1)  # one E2M1 step of 1
    t = x.double().abs() / unit
    half_step = torch.where(t < 2, 0.25, torch.where(t < 4, 0.5, 1.0))
    # Plus a few fp32 roundings: the encode factor 1 / (s * (1 / g)) and the decode s / g.
    bound = torch.where(t > 6, t - 6, half_step) * unit + 2.0**-21 * x.double().abs()
    assert ((y - x.double()).abs() <= bound).all()
    # Hence E2M1 normals (|x| >= 1 step), unsaturated, are within 1/4 relative.
    normal = (t >= 1) & (t <= 6)
    assert ((y - x.double()).abs() / x.double().abs())[normal].max() <= 0.25 + 2.0**-21


# Layouts and options ---------------------------------------------------------------------


def test_columnwise_is_rowwise_of_the_transpose_and_flags_give_empty_outputs():
    x = _x((2, 35, 18))
    x2 = _rows(x)
    data, _, data_t, scale_t = qmx.quantize_mxfp8(x, E5M2)
    row_t = qmx.quantize_mxfp8(x2.t(), E5M2, columnwise=False)
    _assert_same_bits(data_t, row_t[0])
    _assert_same_bits(scale_t, row_t[1])
    only_row = qmx.quantize_mxfp8(x, E5M2, columnwise=False)
    _assert_same_bits(only_row[0], data)
    assert [t.numel() for t in only_row[2:]] == [0, 0]
    assert [t.dtype for t in only_row[2:]] == [E5M2, torch.uint8]
    only_col = qmx.quantize_mxfp8(x, E5M2, rowwise=False)
    assert [t.numel() for t in only_col[:2]] == [0, 0]
    _assert_same_bits(only_col[2], data_t)

    _, _, _, data_t, scale_t = qmx.quantize_nvfp4(x)
    row_t = qmx.quantize_nvfp4(x2.t(), x.abs().amax().float().view(1), columnwise=False)
    _assert_same_bits(data_t, row_t[0])
    _assert_same_bits(scale_t, row_t[1])
    assert data_t.shape == (18, 35) and scale_t.shape == (18, 5)
    only_col = qmx.quantize_nvfp4(x, rowwise=False)
    assert [t.numel() for t in only_col[:2]] == [0, 0]
    assert [t.dtype for t in only_col[:2]] == [torch.uint8, E4M3]
    _assert_same_bits(only_col[3], data_t)


def test_partial_last_block_is_quantised_as_zero_padded():
    x = _x((6, 45))
    padded = F.pad(x, (0, 19))  # K = 64: whole blocks for both formats
    d, s, _, _ = qmx.quantize_mxfp8(x, E4M3, columnwise=False)
    dp, sp, _, _ = qmx.quantize_mxfp8(padded, E4M3, columnwise=False)
    _assert_same_bits(d, dp[:, :45].contiguous())
    _assert_same_bits(s, sp[:, :2].contiguous())
    x = x[:, :44]
    padded = F.pad(x, (0, 20))
    d, s, g, _, _ = qmx.quantize_nvfp4(x, columnwise=False)
    dp, sp, gp, _, _ = qmx.quantize_nvfp4(padded, columnwise=False)
    assert g.item() == gp.item()
    _assert_same_bits(d, dp[:, :22].contiguous())
    _assert_same_bits(s, sp[:, :3].contiguous())


def test_empty_input():
    x = torch.empty(0, 32)
    data, scale, data_t, scale_t = qmx.quantize_mxfp8(x)
    assert data.shape == (0, 32) and scale.shape == (0, 1)
    assert data_t.shape == (32, 0) and scale_t.shape == (32, 0)
    data, scale, g, data_t, scale_t = qmx.quantize_nvfp4(x)
    assert data.shape == (0, 16) and scale.shape == (0, 2) and g.item() == 1.0
    assert data_t.shape == (32, 0) and scale_t.shape == (32, 0)
    assert qmx.dequantize_nvfp4(data, scale, g).shape == (0, 32)


# Scale rules and edge cases ----------------------------------------------------------------


def test_mxfp8_scale_follows_the_ocp_floor_rule_and_saturates():
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0] = 1.0, 500.0, 0.75, -3e38
    data, scale, _, _ = qmx.quantize_mxfp8(x, E4M3, columnwise=False)
    # floor(log2 amax) - 8 + 127: 1 -> 119; 500 -> 127 (500 / 1 saturates to 448);
    # 0.75 -> 118; 3e38 (2**127.8) -> 246.
    assert scale[:, 0].tolist() == [119, 127, 118, 246]
    assert data.float()[:, 0].tolist() == [256.0, 448.0, 384.0, -448.0]


def test_e2m1_rounds_to_nearest_even():
    # One block with amax 6 and global amax 448 * 6: block scale 1 and g = 1, so the values map
    # onto the grid unchanged. Ties: 0.25 0.75 1.25 1.75 2.5 3.5 5; then saturation.
    values = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -5, 0.2, 2.9, 4.9, 5.1, 0, -0.0]
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 8, 14, 0, 5, 6, 7, 0, 8]
    x = torch.tensor([values, values])
    data, scale, g, _, _ = qmx.quantize_nvfp4(x, torch.tensor([2688.0]), columnwise=False)
    assert g.item() == 1.0 and scale.float().flatten().tolist() == [1.0, 1.0]
    codes = torch.stack([data & 15, data >> 4], -1).view(2, 16)
    assert codes[0].tolist() == expected
    x = torch.tensor([[7.0, -100.0] + [0.0] * 14] * 2)  # global amax 1: the block saturates
    data, scale, g, _, _ = qmx.quantize_nvfp4(x, torch.tensor([1.0]), columnwise=False)
    assert scale.float()[0].tolist() == [448.0]
    assert qmx.dequantize_nvfp4(data, scale, g, torch.float32)[0, :2].tolist() == [1.0, -1.0]


def test_all_zero_blocks_give_finite_scales():
    x = torch.zeros(34, 40)
    x[0, 0] = 1.0  # one non-zero block; every other block is all zero
    data, scale, data_t, scale_t = qmx.quantize_mxfp8(x, E4M3)
    assert (scale.flatten()[1:] == 127).all() and (scale_t.flatten()[1:] == 127).all()
    assert (qmx.dequantize_mxfp8(data, scale, torch.float32) == x).all()
    assert (qmx.dequantize_mxfp8(data_t, scale_t, torch.float32) == x.t()).all()
    data, scale, g, _, _ = qmx.quantize_nvfp4(torch.zeros(4, 32))
    assert g.item() == 1.0 and (scale.float() == 0).all() and (data == 0).all()
    out = qmx.dequantize_nvfp4(data, scale, g, torch.float32)
    assert torch.equal(out, torch.zeros(4, 32))


def test_nonfinite_inputs_make_their_block_nan():
    x = _x((4, 64), spread=2)
    x[0, 3], x[2, 40] = float("nan"), float("inf")
    nan_blocks = torch.zeros(4, 64, dtype=torch.bool)
    nan_blocks[0, :32], nan_blocks[2, 32:] = True, True
    data, scale, _, _ = qmx.quantize_mxfp8(x, E4M3, columnwise=False)
    assert scale[0, 0] == scale[2, 1] == 255 and (scale == 255).sum() == 2
    assert (data.view(torch.uint8)[nan_blocks] == 0x7F).all()
    y = qmx.dequantize_mxfp8(data, scale, torch.float32)
    assert y[nan_blocks].isnan().all() and y[~nan_blocks].isfinite().all()
    # NVFP4: NaN block scales; the global scale falls back to 1 (amax is NaN).
    nan16 = torch.zeros(4, 64, dtype=torch.bool)
    nan16[0, :16], nan16[2, 32:48] = True, True
    data, scale, g, _, _ = qmx.quantize_nvfp4(x, columnwise=False)
    assert g.item() == 1.0
    assert scale.float().isnan().sum() == 2
    y = qmx.dequantize_nvfp4(data, scale, g, torch.float32)
    assert y[nan16].isnan().all() and y[~nan16].isfinite().all()


# NVFP4 in row groups (the grouped GEMMs' operands) ------------------------------------------


def _nvfp4_values_expected(x2):
    """fp32 values of ``x2`` quantised as one NVFP4 tensor, by the independent reference
    (dequantised in fp32: ``e2m1 * scale`` is exact, the division by ``g`` rounds once)."""
    g = _nvfp4_global(float(x2.double().abs().max()) if x2.numel() else 0.0)
    packed, scale = _nvfp4_expected(x2, g)
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(x2.shape)
    mag = torch.tensor(E2M1, dtype=torch.float64)[(codes & 7).long()]
    e2m1 = torch.where((codes & 8) != 0, -mag, mag)
    s = scale.view(E4M3).double().repeat_interleave(16, 1)[:, : x2.shape[1]]
    return (e2m1 * s).float() / torch.tensor(g, dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nvfp4_row_groups_quantise_every_group_as_its_own_tensor(dtype, device):
    """Groups of very different magnitude (one all-zero, one empty, one holding inf / NaN):
    every group's values are those of quantising it alone, by the independent reference."""
    splits = [6, 0, 10, 4, 12, 2]
    x = _x((34, 48), spread=3)
    gains = [2.0**-20, 1.0, 2.0**12, 0.0, 2.0**-3, 1.0]
    x = x * torch.tensor(gains).repeat_interleave(torch.tensor(splits))[:, None]
    x[30, 5], x[31, 20] = float("inf"), float("nan")  # the last group: g falls back to 1
    x = x.to(dtype)
    split_t = torch.tensor(splits, device=device)
    got = qmxr.nvfp4_qdq_row_groups(x.to(device), split_t).cpu()
    assert got.dtype == torch.float32 and got.shape == x.shape
    want = torch.cat([_nvfp4_values_expected(x_g) for x_g in x.split(splits)])
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # A single tensor-wide global scale would flush the small group to zero.
    whole = qmx.dequantize_nvfp4(*qmx.quantize_nvfp4(x.float().nan_to_num(0, 0, 0))[:3])
    assert not whole[:6].any() and (got[:6] != 0).float().mean() > 0.5
    # Leading dims flatten into rows.
    got3 = qmxr.nvfp4_qdq_row_groups(x[:32].reshape(4, 8, 48).to(device), split_t[:5].clone())
    torch.testing.assert_close(got3.reshape(32, 48).cpu(), got[:32], rtol=0, atol=0, equal_nan=True)


# Compile ------------------------------------------------------------------------------------


def _round_trip(x):
    data, scale, data_t, scale_t = qmx.quantize_mxfp8(x, E4M3)
    y1 = qmx.dequantize_mxfp8(data, scale, torch.float32)
    y2 = qmx.dequantize_mxfp8(data_t, scale_t, torch.bfloat16)
    data, scale, g, data_t, scale_t = qmx.quantize_nvfp4(x)
    y3 = qmx.dequantize_nvfp4(data, scale, g, torch.float32)
    y4 = qmx.dequantize_nvfp4(data_t, scale_t, g, torch.bfloat16)
    return y1, y2, y3, y4, scale, data_t


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_fullgraph_equals_eager(device):
    fn, counter = compile_counted(_round_trip, dynamic=True)
    # Inductor traces the implementation, which pads K to whole blocks: one graph serves every
    # shape whose K needs padding (a K of whole blocks compiles a second, padding-free graph).
    for shape in [(6, 40), (10, 72)]:
        x = _x(shape, torch.bfloat16, device, spread=4)
        for got, want in zip(fn(x), _round_trip(x), strict=True):
            _assert_same_bits(got, want)
    assert counter.frame_count == 1
    assert count_graph_breaks(_round_trip, _x((6, 40), device=device)) == (1, 0)


def _mxfp8_round_trip(x):
    data, scale, data_t, scale_t = qmx.quantize_mxfp8(x, E4M3)
    return data, scale, data_t, scale_t, qmx.dequantize_mxfp8(data, scale, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_static_shape_of_partial_blocks_equals_eager(device):
    """MXFP8 alone, static shapes, K and M not multiples of 32: Inductor's CPU generator once
    split such loops by the block size and left the tail unwritten."""
    x = _x((48, 80), torch.bfloat16, device, spread=4)
    compiled = torch.compile(_mxfp8_round_trip, fullgraph=True)
    for got, want in zip(compiled(x), _mxfp8_round_trip(x), strict=True):
        _assert_same_bits(got, want)


# Bad input ------------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


_Q = _x((4, 32))
_MX = qmx.quantize_mxfp8(_Q, E4M3)
_NV = qmx.quantize_nvfp4(_Q)

BAD_INPUTS = [
    ("int x", qmx.quantize_mxfp8, lambda: (torch.ones(4, 32, dtype=torch.int32), E4M3),
     "x.dtype must be float32"),
    ("fp8_dtype", qmx.quantize_mxfp8, lambda: (_t(4, 32), torch.float16), "fp8_dtype must be"),
    ("0-dim x", qmx.quantize_mxfp8, lambda: (torch.tensor(1.0), E4M3), "x must have at least 1"),
    ("no direction", lambda x: qmx.quantize_mxfp8(x, rowwise=False, columnwise=False),
     lambda: (_t(4, 32),), "at least one of rowwise and columnwise"),
    ("odd K", qmx.quantize_nvfp4, lambda: (_t(4, 31),), "x.shape[-1] (K = 31) must be even"),
    ("odd M", qmx.quantize_nvfp4, lambda: (_t(3, 32),), "M = prod(x.shape[:-1]) = 3"),
    ("global_amax dtype", qmx.quantize_nvfp4,
     lambda: (_t(4, 32), torch.ones(1, dtype=torch.bfloat16)), "global_amax must be None or"),
    ("global_amax shape", qmx.quantize_nvfp4, lambda: (_t(4, 32), torch.ones(2)),
     "global_amax must be None or"),
    ("mx data dtype", qmx.dequantize_mxfp8, lambda: (_MX[0].float(), _MX[1]), "data must be"),
    ("mx scale shape", qmx.dequantize_mxfp8, lambda: (_MX[0], _MX[3]),
     "scale must hold E8M0 exponents (uint8) of shape [M, ceil(K/32)] = [4, 1]"),
    ("mx out_dtype", qmx.dequantize_mxfp8, lambda: (_MX[0], _MX[1], torch.int32),
     "out_dtype must be"),
    ("nv data dtype", qmx.dequantize_nvfp4, lambda: (_NV[0].float(), _NV[1], _NV[2]),
     "data must be a uint8"),
    ("nv scale dtype", qmx.dequantize_nvfp4, lambda: (_NV[0], _NV[1].float(), _NV[2]),
     "scale must be a torch.float8_e4m3fn"),
    ("nv scale shape", qmx.dequantize_nvfp4, lambda: (_NV[0], _NV[4], _NV[2]),
     "scale must hold E4M3 scales (their uint8 bytes: module docstring) of shape "
     "[M, ceil(K/16)] = [4, 2]"),
    ("nv global_scale", qmx.dequantize_nvfp4, lambda: (_NV[0], _NV[1], torch.ones(2)),
     "global_scale must be a float32 tensor with one element"),
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bad_input_raises_clear_error(case, compiled):
    _name, fn, make, message = case
    if compiled:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"te\.\w+: ") as info:
        fn(*make())
    assert message in str(info.value)
    if not compiled:
        assert info.type is ValueError


def test_ops_are_registered_with_sample_inputs():
    entries = _library.registry()
    for name in ["quantize_mxfp8", "dequantize_mxfp8", "quantize_nvfp4", "dequantize_nvfp4"]:
        assert f"te::{name}" in entries and f"te::{name}" in SAMPLES


# MXFP8 32x32 weight tiles (MXFP8BlockScaling(enable_2d_quantization=True)) ---------------------


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 96), (33, 65), (1, 40)], ids=str)
def test_mxfp8_32x32_tiles_match_independent_reference(shape, fp8_dtype):
    """One E8M0 scale per 32x32 tile (tiles cut by both ends included): the values against
    the tile-by-tile reference, and the GEMM operand's columnwise copy is the rowwise copy
    transposed (the forward and the dgrad GEMM see one quantised weight)."""
    from te_compile.functional.gemm import qdq_both
    from te_compile.functional.spec import QuantSpec

    x = _x(shape, spread=6)
    got = qmxr.mxfp8_qdq_tiles(x, fp8_dtype)
    assert torch.equal(got.double(), references.mxfp8_tiles(x, fp8_dtype))
    row, col_t = qdq_both(x, QuantSpec("mxfp8", fp8_dtype, 32, emulate=True))
    assert torch.equal(row, got) and torch.equal(col_t, got.t())
    if shape[0] > 1:  # 1x32 blocks of varied scale give other values than their tile's
        one_d, _ = qdq_both(x, QuantSpec("mxfp8", fp8_dtype, emulate=True))
        assert not torch.equal(one_d, got)


def test_enable_2d_quantization_tiles_the_weight_only():
    """MXFP8BlockScaling(enable_2d_quantization=True) gives the weight 32x32 tiles (inputs and
    gradients keep 1x32 blocks); te.Linear's output is the float64 GEMM of those operands."""
    import te_compile as te
    from te_compile.quantization import MXFP8BlockScaling, autocast
    from te_compile.quantization.gemm import recipe_specs

    recipe = MXFP8BlockScaling(enable_2d_quantization=True)
    assert [s.block_rows for s in recipe_specs(recipe)] == [1, 32, 1]
    assert [s.block_rows for s in recipe_specs(MXFP8BlockScaling())] == [1, 1, 1]
    torch.manual_seed(0)
    m = te.Linear(64, 96, params_dtype=torch.float32)
    x = _x((32, 64), spread=4)
    with autocast(recipe=recipe):
        y = m(x)
    xq = qmxr.dequantize_mxfp8_ref(
        *qmxr.quantize_mxfp8_ref(x, E4M3, True, False)[:2], torch.float64
    )
    wq = references.mxfp8_tiles(m.weight.detach(), E4M3)
    expected = xq @ wq.t() + m.bias.detach().double()
    assert_close(y, expected, torch.float32)  # the emulated GEMM: fp32 sums of exact values


def test_enable_2d_quantization_refused_by_grouped_linear():
    """The grouped GEMMs do not tile the weight: GroupedLinear refuses the recipe by its field,
    eager and compiled."""
    import te_compile as te
    from te_compile.quantization import MXFP8BlockScaling, autocast

    g = te.GroupedLinear(2, 64, 64, params_dtype=torch.float32)
    x = torch.randn(64, 64)
    recipe = MXFP8BlockScaling(enable_2d_quantization=True)
    for fn in (g, torch.compile(g, fullgraph=True)):
        with autocast(recipe=recipe), pytest.raises(Exception, match="enable_2d_quantization"):
            fn(x, [32, 32])
