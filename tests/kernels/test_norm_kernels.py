"""The normalisation Triton kernels (``te_compile.kernels.norm``: LayerNorm, RMSNorm, L2) against
float64 references from plain torch ops, called through their launch wrappers.

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` (small sizes). Explicit small launch
configurations reach, at a few dozen columns, the paths that the default configuration takes
only for long rows or many rows: rows cut into column chunks (a last chunk ending mid-tile), row
tiles cut by the end of the input, and a backward whose stage-1 programs each own several row
tiles and sum their partial weight gradients across them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.utils import (
    TRITON_DEVICE,
    assert_close,
    make_reference_and_test_tensors,
    requires_triton,
)

kernels = pytest.importorskip("te_compile.kernels.norm")
NormLaunchConfig = kernels.NormLaunchConfig

pytestmark = [pytest.mark.triton, requires_triton]

KINDS = ["layernorm", "rmsnorm", "l2normalization"]
KIND_CODE = {  # the private backward's first argument
    "layernorm": kernels.LAYERNORM.value,
    "rmsnorm": kernels.RMSNORM.value,
    "l2normalization": kernels.L2NORM.value,
}
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5

# Rows of 37 columns in chunks of 16: three chunks, the last one with 5 valid columns.
CHUNKED = NormLaunchConfig(block_m=2, block_n=16, num_warps=4, chunked=True)
# Whole rows of up to 64 columns, 2 rows per tile.
SMALL_TILES = NormLaunchConfig(block_m=2, block_n=64, num_warps=4, chunked=False)

# (kind, zero_centered_gamma, bias, fp32 weight with a low-precision input)
OPTIONS = [
    ("layernorm", False, True, False),
    ("layernorm", True, False, True),
    ("layernorm", True, True, False),
    ("rmsnorm", False, False, False),
    ("rmsnorm", True, False, True),
    ("l2normalization", False, False, False),
]
OPTION_IDS = ["-".join(str(v) for v in o) for o in OPTIONS]


def _reference(kind, x, w, b, zero_centered_gamma):
    """``(out, mean, rsigma)`` in float64 from torch's own ops; ``mean`` None but for LayerNorm."""
    if kind == "l2normalization":
        rsigma = torch.rsqrt((x * x).sum(-1) + EPS)
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + EPS), None, rsigma
    gamma = w + 1 if zero_centered_gamma else w
    if kind == "rmsnorm":
        rsigma = torch.rsqrt((x * x).mean(-1) + EPS)
        return F.rms_norm(x, x.shape[-1:], gamma, EPS), None, rsigma
    rsigma = torch.rsqrt(x.var(-1, unbiased=False) + EPS)
    return F.layer_norm(x, x.shape[-1:], gamma, b, EPS), x.mean(-1), rsigma


def _forward(kind, x, w, b, zero_centered_gamma, config):
    if kind == "layernorm":
        return kernels.layernorm_fwd(x, w, b, EPS, zero_centered_gamma, config=config)
    if kind == "rmsnorm":
        out, rsigma = kernels.rmsnorm_fwd(x, w, EPS, zero_centered_gamma, config=config)
    else:
        out, rsigma = kernels.l2normalization_fwd(x, EPS, config=config)
    return out, None, rsigma


def _backward(
    kind, dy, x, mean, rsigma, w, zero_centered_gamma, has_bias, config, programs, branch=None
):
    """``(dx, dw, db)`` through the public wrappers, or through ``_norm_bwd`` to set the number
    of stage-1 programs or to add a ``branch`` gradient (``rmsnorm_bwd`` takes one too)."""
    if programs is not None or (branch is not None and kind != "rmsnorm"):
        args = (KIND_CODE[kind], dy, x, mean, rsigma, w, zero_centered_gamma, has_bias)
        return kernels._norm_bwd(*args, config=config, programs=programs, branch=branch)
    if kind == "rmsnorm" and branch is not None:
        dx, dw = kernels.rmsnorm_bwd(dy, x, rsigma, w, zero_centered_gamma, config=config,
                                     branch=branch)  # fmt: skip
        return dx, dw, None
    if kind == "layernorm":
        return kernels.layernorm_bwd(
            dy, x, mean, rsigma, w, zero_centered_gamma, has_bias, config=config
        )
    if kind == "rmsnorm":
        dx, dw = kernels.rmsnorm_bwd(dy, x, rsigma, w, zero_centered_gamma, config=config)
        return dx, dw, None
    return kernels.l2normalization_bwd(dy, x, rsigma, config=config), None, None


def _check(
    kind,
    shape,
    dtype,
    *,
    zero_centered_gamma=False,
    bias=True,
    weight_dtype=None,
    config=None,
    bwd_config=None,
    programs=None,
    branch=False,
):
    """Forward (output, statistics) and backward (dx, dgamma, dbeta) of the kernels vs autograd
    through the float64 reference. ``config`` is used for both directions unless ``bwd_config``
    is given. ``branch``: a residual branch's gradient joins dx (the reference adds it to the
    input's gradient)."""
    weight_dtype = weight_dtype or dtype
    bias = bias and kind == "layernorm"
    n = shape[-1]
    x_ref, x = make_reference_and_test_tensors(shape, dtype=dtype, device=TRITON_DEVICE)
    w_ref = w = b_ref = b = None
    if kind != "l2normalization":
        w_ref, w = make_reference_and_test_tensors((n,), dtype=weight_dtype, device=TRITON_DEVICE)
    if bias:
        b_ref, b = make_reference_and_test_tensors((n,), dtype=weight_dtype, device=TRITON_DEVICE)
    y_ref, mean_ref, rsigma_ref = _reference(kind, x_ref, w_ref, b_ref, zero_centered_gamma)
    dy_ref, dy = make_reference_and_test_tensors(shape, dtype=dtype, device=TRITON_DEVICE)
    y_ref.backward(dy_ref)
    grad_branch = None
    if branch:
        branch_ref, grad_branch = make_reference_and_test_tensors(
            shape, dtype=dtype, device=TRITON_DEVICE
        )
        x_ref.grad += branch_ref
        grad_branch = grad_branch.detach()
    x, dy = x.detach(), dy.detach()
    w = None if w is None else w.detach()
    b = None if b is None else b.detach()

    y, mean, rsigma = _forward(kind, x, w, b, zero_centered_gamma, config)
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    assert_close(y, y_ref, dtype)
    stats = [(rsigma, rsigma_ref)] + ([(mean, mean_ref)] if kind == "layernorm" else [])
    for stat, ref in stats:
        # fp32 math on dtype-representable inputs: fp32-accurate whatever the input dtype.
        assert stat.dtype == torch.float32 and stat.shape == shape[:-1]
        assert_close(stat, ref, torch.float32)

    dx, dw, db = _backward(
        kind, dy, x, mean, rsigma, w, zero_centered_gamma, bias, bwd_config or config, programs,
        grad_branch,
    )  # fmt: skip
    assert dx.shape == x.shape and dx.dtype == dtype
    assert_close(dx, x_ref.grad, dtype)
    if w is None:
        assert dw is None
    else:
        assert dw.shape == w.shape and dw.dtype == weight_dtype
        assert_close(dw, w_ref.grad, weight_dtype)
    if bias:
        assert db.shape == b.shape and db.dtype == weight_dtype
        assert_close(db, b_ref.grad, weight_dtype)
    else:
        assert db is None


# Launch configuration ------------------------------------------------------------------------


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_launch_config(backward):
    cap = kernels._BWD_MAX_BLOCK_N if backward else kernels._FWD_MAX_BLOCK_N
    for n in [1, 2, 37, 64, 129, 1000, 4096, 8192, 8193, 16384, 16385, 65536]:
        cfg = kernels.launch_config(n, backward)
        assert cfg.block_n & (cfg.block_n - 1) == 0, n  # a power of two
        assert cfg.chunked == (n > cfg.block_n), n
        if cfg.chunked:
            assert cfg.block_n == cap, n
        else:  # the smallest power of two that holds the row
            assert n <= cfg.block_n < 2 * n and cfg.block_n <= cap, n
        assert cfg.block_m >= 1 and cfg.block_m & (cfg.block_m - 1) == 0, n
        assert 4 <= cfg.num_warps <= 16, n
    assert kernels.launch_config(cap, backward).block_n == cap
    assert kernels.launch_config(cap + 1, backward).chunked


def test_config_override_must_chunk_long_rows():
    x = torch.randn(2, 37, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="chunked"):
        kernels.l2normalization_fwd(x, EPS, config=NormLaunchConfig(2, 16, 4, chunked=False))


# Numerics --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, zero_centered_gamma, bias, fp32_weight", OPTIONS, ids=OPTION_IDS)
def test_options(kind, zero_centered_gamma, bias, fp32_weight, dtype):
    opts = {
        "zero_centered_gamma": zero_centered_gamma,
        "bias": bias,
        "weight_dtype": torch.float32 if fp32_weight else dtype,
    }
    _check(kind, (5, 37), dtype, **opts)  # default configuration: one tile, one row each
    # 7 rows of 37 in chunks of 16, 2 rows per tile: the last tile is half outside the input.
    _check(kind, (7, 37), dtype, config=CHUNKED, **opts)
    # Backward: 13 rows in tiles of 2, at most 3 programs -> 6 rows (3 tiles) per program, the
    # last program 1 row; once with whole rows, once chunked (partials summed in the buffer).
    _check(kind, (13, 37), dtype, config=SMALL_TILES, programs=3, **opts)
    _check(kind, (13, 37), dtype, config=CHUNKED, programs=3, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (1, 37), (3, 129), (4, 1000), (2, 3, 37)], ids=str)
def test_odd_shapes(kind, shape, dtype):
    _check(kind, shape, dtype, zero_centered_gamma=True)


@pytest.mark.parametrize("kind", KINDS)
def test_float16(kind):
    _check(kind, (3, 4, 40), torch.float16, zero_centered_gamma=True)
    _check(kind, (5, 40), torch.float16, weight_dtype=torch.float32, config=CHUNKED, programs=2)


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_edges(kind):
    # One column; columns an exact multiple of the chunk; a single chunk of a chunked config;
    # one row per tile with 2 programs over 5 rows (3 + 2).
    one_row = NormLaunchConfig(block_m=1, block_n=16, num_warps=4, chunked=True)
    _check(kind, (3, 1), torch.float32, config=CHUNKED)
    _check(kind, (3, 48), torch.float32, config=CHUNKED)
    _check(kind, (3, 16), torch.float32, config=CHUNKED)
    _check(kind, (5, 33), torch.float32, config=one_row, programs=2)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_stage_two_sums_many_partials(kind):
    # 70 stage-1 programs of one row each: the stage-2 sum walks 3 blocks of 32 partial rows
    # (the last partly masked) over 130 columns (2 column programs of 128).
    one_row = NormLaunchConfig(block_m=1, block_n=256, num_warps=4, chunked=False)
    _check(kind, (70, 130), torch.bfloat16, config=one_row, programs=70)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_long_rows_default_config(kind, dtype):
    # 65536 columns: past both caps, so the default configuration chunks forward and backward.
    assert kernels.launch_config(65536, False).chunked
    assert kernels.launch_config(65536, True).chunked
    _check(kind, (2, 65536), dtype, weight_dtype=torch.float32)


def test_mixed_configs():
    # Forward whole-row tiles, backward chunked on the same statistics (and the reverse).
    _check("layernorm", (6, 40), torch.float32, config=SMALL_TILES, bwd_config=CHUNKED)
    _check("rmsnorm", (6, 40), torch.bfloat16, config=CHUNKED, bwd_config=SMALL_TILES)


# A residual branch's gradient ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_branch_gradient_joins_dx(kind, dtype):
    """``dx + dB`` (``te::branch_rmsnorm_bwd``'s on CUDA): whole rows, chunked rows, and
    programs that own several row tiles."""
    _check(kind, (5, 37), dtype, branch=True)
    _check(kind, (7, 37), dtype, config=CHUNKED, programs=3, branch=True)
    _check(kind, (13, 37), dtype, config=SMALL_TILES, programs=3, branch=True)


@pytest.mark.parametrize("config", [SMALL_TILES, CHUNKED], ids=["rows", "chunked"])
def test_branch_gradient_is_added_before_the_one_rounding(config):
    """fp16: the kernel's fp32 ``dx`` plus the branch, rounded once, bit for bit. The fp32 ``dx``
    is the same kernel's on the same values in fp32 (its math is fp32 whatever the dtype); a
    second rounding (``dx`` rounded, then the add) differs from it in some elements. (fp16, not
    bf16: Triton's interpreter stores fp32 as bf16 without rounding to nearest; its fp16 store
    rounds to nearest, as CUDA's stores of both do.)"""
    torch.manual_seed(0)
    shape, half = (9, 37), torch.float16
    x, dy, branch = (torch.randn(shape, device=TRITON_DEVICE).to(half) for _ in range(3))
    w = torch.randn(shape[-1], device=TRITON_DEVICE).to(half)
    _, rsigma = kernels.rmsnorm_fwd(x.float(), w.float(), EPS, False, config=config)
    dx32, _ = kernels.rmsnorm_bwd(dy.float(), x.float(), rsigma, w.float(), False, config=config)
    dx, _ = kernels.rmsnorm_bwd(dy, x, rsigma, w, False, config=config, branch=branch)
    assert torch.equal(dx, (dx32 + branch.float()).to(half))
    assert not torch.equal(dx, dx32.to(half) + branch)  # (the test can tell them apart)


def test_branch_gradient_must_match_the_input():
    x = torch.randn(3, 16, device=TRITON_DEVICE)
    _, rsigma = kernels.rmsnorm_fwd(x, torch.ones(16, device=TRITON_DEVICE), EPS, False)
    for branch in (torch.zeros(3, 15, device=TRITON_DEVICE), torch.zeros_like(x).double()):
        with pytest.raises(ValueError, match="branch must have inp's shape"):
            kernels.rmsnorm_bwd(x, x, rsigma, torch.ones(16, device=TRITON_DEVICE), False,
                                branch=branch)  # fmt: skip


# Empty input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [None, CHUNKED], ids=["default", "chunked"])
@pytest.mark.parametrize("shape", [(0, 16), (0, 3, 16)], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_empty_input(kind, shape, config):
    x = torch.empty(shape, device=TRITON_DEVICE, dtype=torch.bfloat16)
    w = torch.randn(16, device=TRITON_DEVICE)
    b = torch.randn(16, device=TRITON_DEVICE) if kind == "layernorm" else None
    y, mean, rsigma = _forward(kind, x, w, b, False, config)
    assert y.shape == shape and y.dtype == x.dtype
    assert rsigma.shape == shape[:-1] and rsigma.dtype == torch.float32
    if kind == "layernorm":
        assert mean.shape == shape[:-1] and mean.dtype == torch.float32
    dx, dw, db = _backward(
        kind, torch.empty_like(y), x, mean, rsigma, w, False, b is not None, config, None
    )
    assert dx.shape == shape and dx.dtype == x.dtype
    if kind != "l2normalization":
        assert torch.equal(dw, torch.zeros_like(w))
    if b is not None:
        assert torch.equal(db, torch.zeros_like(b))
