"""FP8 quantisation ops (``te_compile.functional.quantize``) beyond the registry test.

Bit-exact against the plain quantiser of ``tests/utils/references.py`` (``x.float() * scale``,
clamped, ``.to(fp8)``, with Transformer Engine's scale rule in Python floats), for every format
and mode; layouts; dequantisation round trip within the format's relative precision; edge
cases (zeros, inf, NaN, tiny amax, saturation, any K); compiled equals eager with no graph
break; bad input in eager and under compile. Runs on CPU (the reference implementation) and
CUDA (the Triton kernels).
"""

from __future__ import annotations

import math

import pytest
import torch

import te_compile as te
from te_compile import _library
from te_compile.functional import quantize as Q
from te_compile.functional import quantize_table as QT
from tests.samples import SAMPLES
from tests.utils import (
    DEVICES,
    assert_bits_equal,
    assert_close,
    compile_counted,
    count_graph_breaks,
    references,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
HIGH = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]
SHAPES = [(37, 45), (2, 3, 20), (17,), (1, 1), (257, 7), (0, 24), (5, 0)]
BLOCK_SHAPES = [(130, 200), (3, 50, 129), (1, 1), (257, 7), (128, 256), (0, 5)]
FLT_MAX = torch.finfo(torch.float32).max
OPS = [
    "quantize_tensorwise",
    "quantize_current",
    "quantize_blockwise",
    "dequantize_tensorwise",
    "dequantize_blockwise",
]


# The reference quantiser (independent of te_compile's *_ref): tests/utils/references.py -----

_te_scale, _cast, _inv = references.te_scale, references.fp8_cast, references.fp32_reciprocal
_rows, _amax, _ref_blocks = references.rows, references.amax_of, references.fp8_blocks


def _fmax(fp8):
    return torch.finfo(fp8).max


def _rand(shape, dtype, device, std=1.0):
    return (torch.randn(shape) * std).to(device=device, dtype=dtype)


# Bit-exact against the reference, every format and mode ----------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensorwise_bit_exact(shape, fp8, dtype, columnwise, device):
    x = _rand(shape, dtype, device, std=30.0)  # e4m3 at scale 16: some values saturate
    scale = torch.tensor([16.0 if fp8 == E4M3 else 1000.0], device=device)
    data, data_t, amax = torch.ops.te.quantize_tensorwise(x, scale, fp8, columnwise)
    x2 = _rows(x)
    expected = _cast(x2, scale.item(), fp8)
    assert_bits_equal(data, expected.view(shape))
    if columnwise:
        assert_bits_equal(data_t, expected.t())
    else:
        assert data_t.numel() == 0 and data_t.dtype == fp8
    assert_bits_equal(amax, torch.tensor([_amax(x2)]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pow2, eps", [(False, 0.0), (True, 0.0), (False, 2.0**-4)], ids=str)
@pytest.mark.parametrize("dtype", HIGH)
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_current_bit_exact(shape, fp8, dtype, pow2, eps, device):
    x = _rand(shape, dtype, device, std=1e-2)  # amax below eps = 2^-4 for small shapes
    data, data_t, scale_inv, amax = torch.ops.te.quantize_current(x, fp8, True, eps, pow2)
    x2 = _rows(x)
    scale = _te_scale(_amax(x2), fp8, eps, pow2)
    expected = _cast(x2, scale, fp8)
    assert_bits_equal(data, expected.view(shape))
    assert_bits_equal(data_t, expected.t())
    assert_bits_equal(scale_inv, _inv(scale))
    assert_bits_equal(amax, torch.tensor([_amax(x2)]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("columnwise", [False, True], ids=["rowwise", "columnwise"])
@pytest.mark.parametrize("pow2", [False, True], ids=["scale", "pow2"])
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=str)
def test_blockwise_bit_exact(shape, fp8, block_rows, pow2, columnwise, device):
    # Rows of very different magnitudes, so each block gets its own scale.
    x = _rand(shape, torch.bfloat16, device)
    if x.numel():
        x = x * torch.logspace(-3, 3, shape[-1], device=device).to(torch.bfloat16)
    data, scale_inv, data_t, scale_inv_t = torch.ops.te.quantize_blockwise(
        x, fp8, block_rows, pow2, columnwise
    )
    x2 = _rows(x)
    expected, expected_inv = _ref_blocks(x2, fp8, block_rows, pow2)
    assert_bits_equal(data, expected.view(shape))
    assert_bits_equal(scale_inv, expected_inv)
    if not columnwise:
        assert data_t.numel() == 0 and scale_inv_t.numel() == 0
        return
    # x^T in its own blocks: 1x128 along M; for 128x128, the transposed blocks of x.
    expected_t, expected_inv_t = _ref_blocks(x2.t(), fp8, block_rows, pow2)
    assert_bits_equal(data_t, expected_t)
    assert_bits_equal(scale_inv_t, expected_inv_t)
    if block_rows == 128:
        assert_bits_equal(data_t, expected.t())
        assert_bits_equal(scale_inv_t, expected_inv.t())


def _saturating(codes, y, out_dtype):
    """fp32 ``y`` (codes times scales) in ``out_dtype``, the products of finite codes
    saturating at its largest finite value (as dequantisation does)."""
    big = torch.finfo(out_dtype).max
    return torch.where(codes.float().isinf(), y, y.clamp(-big, big)).to(out_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_saturates_at_the_output_format_max(device):
    """A code times its scale past the output format's max (a power-of-two scale puts
    ``FLT_MAX * 2**-120`` at E4M3 256, and ``256 * 2**120`` is 2**128) dequantises to the
    format's max, not inf; an E5M2 infinity stays infinite."""
    codes = torch.tensor([[256.0, -256.0, 1.0]], device=device).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([2.0**120], device=device)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.finfo(out_dtype).max
        expected = torch.tensor([[big, -big, 2.0**120]], dtype=torch.float64).clamp(-big, big)
        out = torch.ops.te.dequantize_tensorwise(
            codes.view(torch.uint8), scale_inv, torch.float8_e4m3fn, out_dtype
        )
        assert_close(out, expected, out_dtype)
        out = torch.ops.te.dequantize_blockwise(
            codes.view(torch.uint8), scale_inv.reshape(1, 1), 1, torch.float8_e4m3fn, out_dtype
        )
        assert_close(out, expected, out_dtype)
    inf = torch.tensor([[math.inf, -math.inf]], device=device).to(torch.float8_e5m2)
    out = torch.ops.te.dequantize_tensorwise(
        inf.view(torch.uint8), torch.ones(1, device=device), torch.float8_e5m2, torch.float32
    )
    assert out.isinf().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", HIGH)
@pytest.mark.parametrize("fp8", FP8)
def test_dequantize_bit_exact(fp8, out_dtype, device):
    # Every FP8 code (NaNs included) times a scale_inv that is not a power of two.
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).reshape(2, 128)
    codes = torch.cat([codes, codes.flip(0)], 1).to(device)  # [2, 256]: two column blocks
    scale_inv = torch.tensor([3.0e-3], device=device)
    out = torch.ops.te.dequantize_tensorwise(codes.view(torch.uint8), scale_inv, fp8, out_dtype)
    expected = _saturating(codes.cpu(), codes.cpu().float() * scale_inv.item(), out_dtype)
    assert_bits_equal(out, expected)
    block_inv = torch.tensor([[1e-3, 7.0], [0.5, 3e4]], device=device)
    for block_rows in (1, 128):
        s = block_inv[: -(-2 // block_rows)]
        expected = codes.cpu().float() * s.cpu().repeat_interleave(block_rows, 0)[
            :2
        ].repeat_interleave(128, 1)
        out = torch.ops.te.dequantize_blockwise(
            codes.view(torch.uint8), s, block_rows, fp8, out_dtype
        )
        assert_bits_equal(out, _saturating(codes.cpu(), expected, out_dtype))


# Layouts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_layouts(device):
    """Leading dims flatten into M; per-tensor scales are [1]; blockwise scale_inv is
    [ceil(M / block_rows), ceil(K / 128)] and scale_inv_t is the same for x^T."""
    x = _rand((3, 50, 129), torch.bfloat16, device)  # M = 150, K = 129
    q = QT.quantize(x, "current", fp8_dtype=E5M2, columnwise=True)
    assert q.data.shape == x.shape and q.data_t.shape == (129, 150)
    assert q.scale_inv.shape == (1,) and q.amax.shape == (1,)
    assert q.scale_inv_t is q.scale_inv
    assert torch.equal(q.data_t.view(torch.uint8), q.data.reshape(150, 129).t().view(torch.uint8))
    for block_rows, shape, shape_t in [(1, (150, 2), (129, 2)), (128, (2, 2), (2, 2))]:
        q = QT.quantize(x, "block", block_rows=block_rows, columnwise=True)
        assert q.data.shape == x.shape and q.data_t.shape == (129, 150)
        assert q.scale_inv.shape == shape and q.scale_inv_t.shape == shape_t
        assert q.scale_inv.dtype == q.scale_inv_t.dtype == torch.float32
        assert q.amax is None and q.kind == "block" and q.block_rows == block_rows
    q = QT.quantize(x, "block")
    assert q.data_t is None and q.scale_inv_t is None
    for t in (q.data, q.scale_inv):
        assert t.is_contiguous()


# Round trip -------------------------------------------------------------------------------------


def _round_trip_bound(x, fp8, scale_inv):
    """|dequant(quant(x)) - x| for a value in range: half an ulp of the format (relative
    ``eps / 2``), or half a subnormal step (``tiny * eps / 2``) times ``scale_inv``, plus the fp32
    roundings of ``x * scale`` and of ``1 / scale``."""
    fi = torch.finfo(fp8)
    rel = fi.eps / 2 + 4 * torch.finfo(torch.float32).eps
    return rel * x.abs() + fi.tiny * fi.eps / 2 * scale_inv


def _expand(scale_inv, block_rows, m, k):
    return scale_inv.repeat_interleave(block_rows, 0)[:m].repeat_interleave(128, 1)[:, :k]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["delayed", "current", "block-1", "block-128"])
@pytest.mark.parametrize("fp8", FP8)
def test_round_trip_error_within_format_precision(kind, fp8, device):
    shape = (150, 300)
    x = _rand(shape, torch.float32, device) * torch.logspace(-4, 4, 300, device=device)
    kwargs = {"fp8_dtype": fp8, "columnwise": True}
    if kind == "delayed":
        # A scale that keeps x in range, as the amax history would.
        kwargs["scale"] = torch.tensor([_fmax(fp8) / x.abs().max().item() / 2], device=device)
    elif kind.startswith("block"):
        kwargs["block_rows"] = int(kind.split("-")[1])
    q = QT.quantize(x, kind.split("-")[0], **kwargs)
    for columnwise in (False, True):
        ref = (x.t() if columnwise else x).cpu()
        out = QT.dequantize(q, torch.float32, columnwise=columnwise).cpu()
        s = (q.scale_inv_t if columnwise else q.scale_inv).cpu()
        if kind.startswith("block"):
            s = _expand(s, q.block_rows, *ref.shape)
        assert out.shape == ref.shape
        err = (out - ref).abs()
        assert (err <= _round_trip_bound(ref, fp8, s)).all(), err.max()


# Edge cases --------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_all_zero_input_gives_scale_one(fp8, device):
    x = torch.zeros(4, 200, device=device, dtype=torch.bfloat16)
    for pow2 in (False, True):
        data, data_t, scale_inv, amax = torch.ops.te.quantize_current(x, fp8, True, 0.0, pow2)
        assert scale_inv.item() == 1.0 and amax.item() == 0.0
        assert (data.float() == 0).all() and (data_t.float() == 0).all()
        data, scale_inv, data_t, scale_inv_t = torch.ops.te.quantize_blockwise(
            x, fp8, 1, pow2, True
        )
        assert (scale_inv == 1).all() and (scale_inv_t == 1).all()
        assert (data.float() == 0).all() and (data_t.float() == 0).all()
    # amax_epsilon floors the amax: an all-zero tensor then gets fp8_max / eps.
    _, _, scale_inv, amax = torch.ops.te.quantize_current(x, fp8, False, 0.5)
    assert_bits_equal(scale_inv, _inv(_fmax(fp8) / 0.5))
    assert amax.item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_inf_and_nan(fp8, device):
    inf, nan, fmax = math.inf, math.nan, _fmax(fp8)
    x = torch.randn(3, 256)
    x[0, 5], x[0, 6], x[0, 7] = inf, -inf, 1e30  # row 0: inf, -inf and finite overflow
    x[2, 200] = nan  # row 2, second 128-column block: NaN
    x = x.to(device)
    scale = torch.tensor([2.0], device=device)

    data, _, amax = torch.ops.te.quantize_tensorwise(x, scale, fp8, False)
    assert math.isnan(amax.item())  # NaN wins over inf: the caller sees it
    d = data.float().cpu()
    assert d[0, 5].item() == fmax and d[0, 6].item() == -fmax and d[0, 7].item() == fmax
    assert math.isnan(d[2, 200].item()) and d.isnan().sum() == 1

    x_inf = x.clone()
    x_inf[2, 200] = 1.0
    data, _, amax = torch.ops.te.quantize_tensorwise(x_inf, scale, fp8, False)
    assert amax.item() == inf
    # Current scaling with an inf amax: scale 1, values saturate, no NaN.
    data, _, scale_inv, amax = torch.ops.te.quantize_current(x_inf, fp8, False)
    assert amax.item() == inf and scale_inv.item() == 1.0
    assert not data.float().isnan().any()
    assert_bits_equal(data, _cast(x_inf.cpu(), 1.0, fp8))
    # Current scaling with a NaN amax: a NaN scale (reported through amax).
    _, _, scale_inv, amax = torch.ops.te.quantize_current(x, fp8, False)
    assert math.isnan(amax.item()) and math.isnan(scale_inv.item())

    # Blockwise: each block on its own, and a blockwise cast returns no amax to report, so a
    # block holding inf (row 0's first) or NaN (row 2's second) gets a NaN scale and NaN
    # codes: it dequantises to NaN, never to +-fmax; every other block stays finite. 1x128:
    # scales [3, 2]; 128x128: [1, 2], both blocks bad; the transposed 1x128 copy: blocks of
    # x^T along M, bad for the columns that hold inf or NaN.
    bad_cols = x.cpu().isfinite().logical_not().any(0)  # [256]
    for block_rows, bad_scales in ((1, [[1, 0], [0, 0], [0, 1]]), (128, [[1, 1]])):
        data, scale_inv, data_t, scale_inv_t = torch.ops.te.quantize_blockwise(
            x, fp8, block_rows, False, True
        )
        bad_scales = torch.tensor(bad_scales, dtype=torch.bool)
        assert torch.equal(scale_inv.cpu().isnan(), bad_scales), block_rows
        assert scale_inv.cpu()[~bad_scales].isfinite().all()
        bad = bad_scales.repeat_interleave(block_rows, 0)[:3].repeat_interleave(128, 1)
        for d, s, want in ((data, scale_inv, bad), (data_t, scale_inv_t, None)):
            out = torch.ops.te.dequantize_blockwise(
                d.view(torch.uint8), s, block_rows, fp8, torch.float32
            ).cpu()
            if want is None:  # x^T
                want = bad.t() if block_rows == 128 else bad_cols[:, None].expand(256, 3)
            assert torch.equal(out.isnan(), want), block_rows
            assert torch.equal(d.float().cpu().isnan(), want), block_rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8)
def test_tiny_amax_gives_flt_max_scale(fp8, device):
    """fp8_max / amax overflows fp32 for a subnormal amax: the scale is FLT_MAX (2^127 with
    power-of-two scales), as in Transformer Engine."""
    x = torch.full((2, 8), 1e-44, device=device)
    _, _, scale_inv, _ = torch.ops.te.quantize_current(x, fp8, False)
    assert_bits_equal(scale_inv, _inv(FLT_MAX))
    _, _, scale_inv, _ = torch.ops.te.quantize_current(x, fp8, False, 0.0, True)
    assert scale_inv.item() == 2.0**-127


@pytest.mark.parametrize("device", DEVICES)
def test_power_of_two_scales_are_exact(device):
    x = _rand((5, 300), torch.float32, device, std=3.0)
    q = QT.quantize(x, "block", power_2_scale=True)
    exponents = torch.frexp(q.scale_inv)[0]
    assert (exponents == 0.5).all()  # mantissa 1: powers of two
    q = QT.quantize(x, "current", power_2_scale=True)
    assert torch.frexp(q.scale_inv)[0].item() == 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 7, 13, 100, 129])
def test_any_k_quantises(k, device):
    """Quantisation needs no alignment; only an FP8 GEMM does (gemm.check_gemm_dims)."""
    x = _rand((6, k), torch.bfloat16, device)
    for kind, kwargs in [
        ("current", {}),
        ("block", {"block_rows": 1}),
        ("block", {"block_rows": 128}),
    ]:
        q = QT.quantize(x, kind, columnwise=True, **kwargs)
        assert q.data.shape == (6, k) and q.data_t.shape == (k, 6)


# Public functions, compile -------------------------------------------------------------------


def _quantize_all(x, scale):
    """Every kind, quantised and dequantised: what a compiled FP8 step does."""
    outs = []
    for kind, kwargs in [
        ("delayed", {"scale": scale, "fp8_dtype": E5M2}),
        ("current", {"power_2_scale": True}),
        ("block", {"block_rows": 1}),
        ("block", {"block_rows": 128, "power_2_scale": True}),
    ]:
        q = QT.quantize(x, kind, columnwise=True, **kwargs)
        outs += [t for t in q[:5] if t is not None]
        outs += [QT.dequantize(q, torch.bfloat16), QT.dequantize(q, torch.float32, columnwise=True)]
    return outs


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_equals_eager(device):
    """Bitwise equal to eager, and no recompile for new shapes (dynamic). Every block count
    stays >= 2: a count of 1 is a specialised size (0/1 specialisation) and would recompile.
    The first compile may take two frames: under ``dynamic=True`` dynamo first traces the float
    default ``amax_epsilon=0.0`` as a symbolic float, then restarts with it specialised."""
    fn, counter = compile_counted(_quantize_all, dynamic=True)
    scale = torch.tensor([4.0], device=device)
    first = None
    for shape in [(130, 200), (200, 300), (257, 129)]:
        x = _rand(shape, torch.bfloat16, device)
        compiled, eager = fn(x, scale), _quantize_all(x, scale)
        first = first or counter.frame_count
        assert len(compiled) == len(eager)
        for c, e in zip(compiled, eager, strict=True):
            assert_bits_equal(c, e.cpu())
    assert counter.frame_count == first <= 2
    graphs, breaks = count_graph_breaks(
        _quantize_all, _rand((4, 64), torch.bfloat16, device), scale
    )
    assert (graphs, breaks) == (1, 0)


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_static_shape_of_partial_blocks_equals_eager(device, block_rows):
    """One kind alone, static shapes, M and K not multiples of 128: Inductor's CPU generator
    once split such loops by the block size and left the tail unwritten."""

    def fn(x):
        q = QT.quantize(x, "block", columnwise=True, block_rows=block_rows)
        outs = [t for t in q[:5] if t is not None]
        deq = QT.dequantize(q, torch.float32), QT.dequantize(q, torch.float32, columnwise=True)
        return outs + list(deq)

    x = _rand((130, 200), torch.float32, device)
    for c, e in zip(torch.compile(fn, fullgraph=True)(x), fn(x), strict=True):
        assert_bits_equal(c, e)


def test_ops_are_registered_with_sample_inputs():
    """tests/test_registry.py opchecks every registered op with its sample inputs."""
    entries = _library.registry()
    for name in OPS:
        assert entries[f"te::{name}"].differentiable is None
        assert list(SAMPLES[f"te::{name}"](torch.device("cpu")))


# Bad input ---------------------------------------------------------------------------------------


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _u8(*shape):
    return _x(*shape).to(E4M3).view(torch.uint8)


_ONE = torch.ones(1)
BAD_INPUTS = [
    (
        "int input",
        "quantize_current",
        lambda: torch.ops.te.quantize_current(torch.ones(4, 8, dtype=torch.int32), E4M3, False),
        "x.dtype must be torch.float32, torch.bfloat16 or torch.float16",
    ),
    (
        "fp64 input",
        "quantize_blockwise",
        lambda: torch.ops.te.quantize_blockwise(
            _x(4, 8, dtype=torch.float64), E4M3, 1, False, False
        ),
        "x.dtype must be",
    ),
    (
        "0-dim input",
        "quantize_tensorwise",
        lambda: torch.ops.te.quantize_tensorwise(torch.tensor(1.0), _ONE, E4M3, False),
        "x must have at least 1 dim",
    ),
    (
        "not an fp8 dtype",
        "quantize_current",
        lambda: torch.ops.te.quantize_current(_x(4, 8), torch.float16, False),
        "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.float16",
    ),
    (
        "scale with 2 elements",
        "quantize_tensorwise",
        lambda: torch.ops.te.quantize_tensorwise(_x(4, 8), torch.ones(2), E4M3, False),
        "scale must be a 1-element torch.float32 tensor, got shape [2]",
    ),
    (
        "bf16 scale",
        "quantize_tensorwise",
        lambda: torch.ops.te.quantize_tensorwise(
            _x(4, 8), torch.ones(1, dtype=torch.bfloat16), E4M3, False
        ),
        "dtype torch.bfloat16",
    ),
    (
        "block_rows 64",
        "quantize_blockwise",
        lambda: torch.ops.te.quantize_blockwise(_x(4, 8), E4M3, 64, False, False),
        "block_rows must be 1 (1x128 blocks) or 128 (128x128 blocks), got 64",
    ),
    (
        "negative epsilon",
        "quantize_current",
        lambda: torch.ops.te.quantize_current(_x(4, 8), E4M3, False, -1.0),
        "amax_epsilon must be finite and >= 0, got -1.0",
    ),
    (
        "dequantize fp8-typed data",
        "dequantize_tensorwise",
        lambda: torch.ops.te.dequantize_tensorwise(_x(4, 8).to(E4M3), _ONE, E4M3, torch.float32),
        "data must be the uint8 bytes of the fp8 data (data.view(torch.uint8)) with at least 1 "
        "dim, got torch.float8_e4m3fn",
    ),
    (
        "dequantize as a non-fp8 dtype",
        "dequantize_blockwise",
        lambda: torch.ops.te.dequantize_blockwise(
            _u8(4, 8), torch.ones(4, 1), 1, torch.int8, torch.float32
        ),
        "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.int8",
    ),
    (
        "dequantize to int",
        "dequantize_tensorwise",
        lambda: torch.ops.te.dequantize_tensorwise(_u8(4, 8), _ONE, E4M3, torch.int32),
        "out_dtype must be torch.float32, torch.bfloat16 or torch.float16, got torch.int32",
    ),
    (
        "blockwise scale_inv shape",
        "dequantize_blockwise",
        lambda: torch.ops.te.dequantize_blockwise(
            _u8(4, 300), torch.ones(4, 2), 1, E4M3, torch.float32
        ),
        "scale_inv must have shape [ceil(M / 1), ceil(K / 128)] = [4, 3]",
    ),
    (
        "blockwise scale_inv rank",
        "dequantize_blockwise",
        lambda: torch.ops.te.dequantize_blockwise(_u8(4, 8), _ONE, 128, E5M2, torch.float32),
        "scale_inv must be a 2-dim torch.float32 tensor",
    ),
    (
        "unknown recipe kind",
        "quantize",
        lambda: QT.quantize(_x(4, 8), "mxfp9"),
        "recipe_kind must be one of ('block', 'current', 'delayed', 'mxfp8', 'nvfp4'), got 'mxfp9'",
    ),
    (
        "delayed without scale",
        "quantize",
        lambda: QT.quantize(_x(4, 8), "delayed"),
        'recipe_kind "delayed" needs scale=',
    ),
    (
        "scale with current",
        "quantize",
        lambda: QT.quantize(_x(4, 8), "current", scale=_ONE),
        'scale= is only for recipe_kind "delayed"',
    ),
    (
        "columnwise dequantize without data_t",
        "dequantize",
        lambda: QT.dequantize(QT.quantize(_x(4, 8), "current"), torch.float32, columnwise=True),
        "columnwise=True needs q.data_t",
    ),
    (
        "columnwise not a bool",
        "quantize",
        lambda: QT.quantize(_x(4, 8), "current", columnwise="yes"),
        "columnwise must be a bool (True or False), got 'yes'",
    ),
    (
        "power_2_scale not a bool",
        "quantize",
        lambda: QT.quantize(_x(4, 8), "block", power_2_scale=1),
        "power_2_scale must be a bool (True or False), got 1",
    ),
    (
        "dequantize columnwise not a bool",
        "dequantize",
        lambda: QT.dequantize(QT.quantize(_x(4, 8), "current"), torch.float32, columnwise="no"),
        "columnwise must be a bool (True or False), got 'no'",
    ),
    (
        "fp8_max zero",
        "scale_from_amax",
        lambda: Q.scale_from_amax(torch.ones(3), 0.0),
        "fp8_max must be finite and > 0, got 0.0",
    ),
    (
        "fp8_max nan",
        "scale_from_amax",
        lambda: Q.scale_from_amax(torch.ones(3), math.nan),
        "fp8_max must be finite and > 0, got nan",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_bad_input_raises_clear_error(case, mode):
    _name, name, call, message = case
    fn = call if mode == "eager" else torch.compile(call, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=rf"te\.{name}: ") as info:
        fn()
    assert message in str(info.value)
    if mode == "eager":
        assert info.type is ValueError


@pytest.mark.parametrize("value", [0.0, -2.0, math.nan, math.inf])
def test_quantize_refuses_a_scale_that_is_not_finite_and_positive(value):
    """A delayed scale of 0 / inf would cast everything to 0 / +-fp8_max, NaN everything to
    NaN, a negative one flip the signs: refused by name (read on the host in eager)."""
    scale = torch.tensor([value])
    message = rf"te\.quantize: scale must be finite and > 0, got {value}"
    with pytest.raises(ValueError, match=message):
        QT.quantize(_x(4, 8), "delayed", scale=scale)
    with pytest.raises(ValueError, match=message):
        te.quantize(_x(4, 8), te.recipe.DelayedScaling(), scale=scale)
