"""The MXFP8 / NVFP4 Triton kernels (``te_compile.kernels.quantize_mx``) against the CPU
reference of ``te_compile.functional.quantize_mx_ref``, bit for bit, through their launch wrappers.

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` (small sizes). Shapes reach the
masking paths of the 64 x 64 tiles: single elements, partial blocks (K or M not a multiple of
32 / 16), several tiles in both directions with a partial last tile, and 3-D inputs. Special
values (NaN, inf, zeros, fp32 subnormals, values near the fp32 max, E2M1 ties) check the bit
tricks the kernels use in place of fp8 casts.
"""

from __future__ import annotations

import pytest
import torch

from te_compile.functional import quantize_mx_ref as ref
from tests.utils import TRITON_DEVICE, requires_triton

kernels = pytest.importorskip("te_compile.kernels.quantize_mx")

pytestmark = [pytest.mark.triton, requires_triton]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SWEEP_DTYPES = DTYPES[:2]  # fp16 inputs: test_float16 and the special values
MX_SHAPES = [(1, 1), (3, 7), (33, 65), (70, 100), (2, 3, 64)]
NV_SHAPES = [(2, 2), (4, 18), (34, 66), (70, 100), (2, 3, 32)]


def _x(shape, dtype=torch.float32, spread=12):
    """Normal values times powers of two over ``2 * spread`` binades: blocks of varied scale."""
    x = torch.randn(*shape) * torch.exp2(torch.randint(-spread, spread + 1, shape).float())
    return x.to(dtype)


def _specials(dtype=torch.float32):
    """[64, 48]: rows of special values, the rest normal values over many binades."""
    x = _x((64, 48), spread=10)
    x[0, :32] = 0.0
    x[1, 5], x[2, 40], x[3, 0] = float("nan"), float("inf"), -float("inf")
    x[4] = 1e-40  # fp32 subnormal (0 in bf16/fp16)
    x[5] *= 1e-37
    x[6] = 3e38 if dtype != torch.float16 else 6e4
    x[7, :16] = -0.0
    x[8], x[9] = 479.0, 500.0  # E4M3 saturation after a 2**0 scale
    x[10] = torch.linspace(0, 7, 48)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -5, 7, -7, 0.1, 2.9, 4.9, 5.1]
    x[11, :16] = torch.tensor(ties)  # E2M1 ties and saturation when the block scale is 1
    x[12:16] = torch.arange(-24, 24).float() * 0.125  # exact grid points and ties once scaled
    return x.to(dtype)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.is_contiguous()
    assert torch.equal(_bits(actual.cpu()), _bits(expected.cpu()))


def _assert_same_values(actual, expected):
    """Equal values, NaN where NaN (a NaN's payload may differ between implementations)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def _check_mxfp8(x, fp8_dtype, rowwise=True, columnwise=True):
    out = kernels.quantize_mxfp8(x.to(TRITON_DEVICE), fp8_dtype, rowwise, columnwise)
    expected = ref.quantize_mxfp8_ref(x, fp8_dtype, rowwise, columnwise)
    for a, e in zip(out, expected, strict=True):
        _assert_same(a, e)
    return out


def _check_nvfp4(x, global_amax=None, rowwise=True, columnwise=True):
    expected = ref.quantize_nvfp4_ref(x, global_amax, rowwise, columnwise)
    g = expected[2].to(TRITON_DEVICE)
    out = kernels.quantize_nvfp4(x.to(TRITON_DEVICE), g, rowwise, columnwise)
    for a, e in zip(out, expected[:2] + expected[3:], strict=True):
        _assert_same(a, e)
    return expected


# Quantisation --------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
def test_quantize_mxfp8(shape, dtype, fp8_dtype):
    _check_mxfp8(_x(shape, dtype), fp8_dtype)


@pytest.mark.parametrize("global_amax", [None, 0.5], ids=["own", "small"])
@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", NV_SHAPES, ids=str)
def test_quantize_nvfp4(shape, dtype, global_amax):
    ga = None if global_amax is None else torch.tensor([global_amax])
    _check_nvfp4(_x(shape, dtype), ga)


def test_float16():
    x = _x((33, 66), torch.float16, spread=6)
    _check_mxfp8(x, E4M3)
    _check_mxfp8(x[:, :65], E5M2)
    _check_nvfp4(x[:32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(dtype):
    x = _specials(dtype)
    for fp8_dtype in (E4M3, E5M2):
        _check_mxfp8(x, fp8_dtype)
    _check_nvfp4(x)  # global scale 1: the amax is NaN
    finite = x.clone()
    finite[1:4] = 1.0
    for global_amax in (None, 2688.0, 1.0, 1e-39):  # own amax, g = 1, saturating, g = FLT_MAX
        _check_nvfp4(finite, None if global_amax is None else torch.tensor([global_amax]))


def test_one_direction():
    x = _x((34, 70))
    _check_mxfp8(x, E4M3, rowwise=True, columnwise=False)
    _check_mxfp8(x, E5M2, rowwise=False, columnwise=True)
    _check_nvfp4(x, rowwise=True, columnwise=False)
    _check_nvfp4(x[:33, :4], rowwise=True, columnwise=False)  # odd M is fine rowwise
    _check_nvfp4(x[:, :7], rowwise=False, columnwise=True)  # odd K is fine columnwise


def test_empty_input():
    for shape in [(0, 32), (4, 0)]:
        x = torch.empty(shape)
        _check_mxfp8(x, E4M3)
        _check_nvfp4(x)


# Dequantisation ------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_dequantize_mxfp8(out_dtype):
    for x, fp8_dtype in [(_x((70, 100)), E4M3), (_x((2, 3, 64)), E5M2), (_specials(), E4M3)]:
        data, scale, data_t, scale_t = ref.quantize_mxfp8_ref(x, fp8_dtype)
        for d, s in ((data, scale), (data_t, scale_t)):
            out = kernels.dequantize_mxfp8(d.to(TRITON_DEVICE), s.to(TRITON_DEVICE), out_dtype)
            _assert_same_values(out, ref.dequantize_mxfp8_ref(d, s, out_dtype))
    # Every fp8 code under every scale exponent, 0 (2**-127) and 255 (NaN) included.
    for fp8_dtype in (E4M3, E5M2):
        data = torch.arange(256, dtype=torch.uint8).repeat(8, 1).view(fp8_dtype)
        scale = torch.tensor([0, 1, 100, 127, 128, 200, 254, 255], dtype=torch.uint8)
        scale = scale[:, None].repeat(1, 8)
        out = kernels.dequantize_mxfp8(data.to(TRITON_DEVICE), scale.to(TRITON_DEVICE), out_dtype)
        _assert_same_values(out, ref.dequantize_mxfp8_ref(data, scale, out_dtype))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_dequantize_nvfp4(out_dtype):
    for x in [_x((70, 100)), _x((2, 3, 32)), _specials()]:
        data, scale, g, data_t, scale_t = ref.quantize_nvfp4_ref(x)
        for d, s in ((data, scale), (data_t, scale_t)):
            args = (d.to(TRITON_DEVICE), s.to(TRITON_DEVICE), g.to(TRITON_DEVICE))
            out = kernels.dequantize_nvfp4(*args, out_dtype)
            _assert_same_values(out, ref.dequantize_nvfp4_ref(d, s, g, out_dtype))
    # Every byte (two E2M1 codes) under a spread of E4M3 scales, NaN and negative included.
    data = torch.arange(256, dtype=torch.uint8).view(8, 32)
    scale = torch.arange(3, 256, 4, dtype=torch.uint8).view(8, 8)[:, :4].contiguous().view(E4M3)
    g = torch.tensor(3.0)
    args = (data.to(TRITON_DEVICE), scale.to(TRITON_DEVICE), g.to(TRITON_DEVICE))
    out = kernels.dequantize_nvfp4(*args, out_dtype)
    _assert_same_values(out, ref.dequantize_nvfp4_ref(data, scale, g, out_dtype))
