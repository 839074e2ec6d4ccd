"""The activation Triton kernels (``te_compile.kernels.activation``) against the float64
reference math of ``te_compile.functional.activation``, called through their launch wrappers.

Run on CUDA, or on CPU tensors with ``TRITON_INTERPRET=1`` (small sizes: each case takes a
fraction of a second in the interpreter). Explicit small launch configurations put several
programs on every axis, so the masks (numel not a multiple of the block, columns cut inside an
interleave block, rows past the end) and the dbias partial sums over many row programs are
exercised, not only the one-program case.
"""

from __future__ import annotations

import pytest
import torch

from te_compile.functional.activation import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    activation_ref,
    gated_activation_ref,
)
from tests.utils import (
    TRITON_DEVICE,
    assert_close,
    make_reference_and_test_tensors,
    requires_triton,
)

kernels = pytest.importorskip("te_compile.kernels.activation")
FlatConfig, RowsConfig = kernels.FlatConfig, kernels.RowsConfig

pytestmark = [pytest.mark.triton, requires_triton]

DTYPES = [torch.float32, torch.bfloat16]
SMALL_ROWS = RowsConfig(block_m=2, block_n=16, num_warps=4, rows_per_program=4)


def _check(activation, shape, dtype, *, bias, k=0, limit=7.0, alpha=1.702, offset=1.0, config=None):
    """Forward, dinp and dbias of the kernels vs autograd through the float64 reference."""
    gated = activation in GATED_ACTIVATIONS
    x_ref, x = make_reference_and_test_tensors(shape, dtype=dtype, device=TRITON_DEVICE)
    b_ref = b = None
    if bias:
        b_ref, b = make_reference_and_test_tensors(shape[-1:], dtype=dtype, device=TRITON_DEVICE)
    if gated:
        y_ref = gated_activation_ref(x_ref, b_ref, activation, k, limit, alpha, offset)
    else:
        y_ref = activation_ref(x_ref, b_ref, activation)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, device=TRITON_DEVICE)
    y_ref.backward(dy_ref)

    x, dy = x.detach(), dy.detach()
    b = None if b is None else b.detach()
    args = (activation, k, limit, alpha, offset)
    y = kernels.activation_forward(x, b, *args, config=config)
    dx, db = kernels.activation_backward(dy, x, b, *args, need_dbias=bias, config=config)
    assert y.shape == y_ref.shape and y.dtype == dtype and y.is_contiguous()
    assert_close(y, y_ref, dtype)
    assert_close(dx, x_ref.grad, dtype)
    if bias:
        assert db.dtype == dtype
        assert_close(db, b_ref.grad, dtype)
    else:
        assert db is None


def test_kernel_table_covers_every_public_name():
    assert set(kernels.ALL_FUNCTIONS) == {*ACTIVATIONS, *GATED_ACTIVATIONS}
    assert set(GATED_ACTIVATIONS) == kernels.ALL_GATED
    # The activation-quantise kernels' tables: all but situglu (whose betas they cannot take).
    assert set(kernels.FUNCTION_OF) == {*ACTIVATIONS, *GATED_ACTIVATIONS} - {"situglu"}
    assert kernels.ALL_GATED - {"situglu"} == kernels.GATED


# Per-activation parameter slots: clamped_swiglu with both clamps cutting randn inputs; situglu
# with betas (limit, alpha slots) small enough that both tanh caps bend, and no offset.
PARAMS = {
    "clamped_swiglu": {"limit": 0.75, "offset": 0.5},
    "situglu": {"limit": 0.5, "alpha": 0.75, "offset": 0.0},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_flat(activation, dtype):
    # 1041 elements in blocks of 256: five programs, the last one masked.
    _check(activation, (3, 347), dtype, bias=False, config=FlatConfig(block=256, num_warps=4))
    _check(activation, (2, 5, 24), dtype, bias=False)  # default configuration


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_elementwise(activation, dtype):
    # 7 rows x 37 columns in 2 x 16 tiles, 4 rows per program: 2 row programs, 3 column blocks.
    _check(activation, (7, 37), dtype, bias=True, config=SMALL_ROWS)
    _check(activation, (2, 3, 40), dtype, bias=True)


# Every gated activation in every layout (k = 0: contiguous halves), with a bias in half of
# them: each activation and each layout both with and without one.
_GATED_CASES = [
    (a, k, (i + j) % 2 == 1)
    for i, a in enumerate(GATED_ACTIVATIONS)
    for j, k in enumerate([0, 1, 2, 8, 32])
]


@pytest.mark.parametrize(
    ("activation", "k", "bias"),
    _GATED_CASES,
    ids=[f"{a}-k{k}-{'bias' if b else 'nobias'}" for a, k, b in _GATED_CASES],
)
def test_gated(activation, k, bias):
    # H = 64 output columns; the small tiles cut the columns into 4 blocks and rows into 3.
    params = PARAMS.get(activation, {})
    _check(activation, (5, 128), torch.float32, bias=bias, k=k, config=SMALL_ROWS, **params)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "clamped_swiglu", "situglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_low_precision(activation, dtype):
    params = PARAMS.get(activation, {})
    _check(activation, (2, 3, 96), dtype, bias=True, k=8, **params)
    _check(activation, (4, 96), dtype, bias=False, **params)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp2")  # 2^t -> inf, by design
def test_situglu_default_betas_and_saturation():
    """Default betas (4, 25) on inputs scaled to reach both caps; large |a| and |l| saturate
    tanh to +-1 without NaN."""
    _check("situglu", (6, 64), torch.float32, bias=True, k=4, limit=4.0, alpha=25.0, offset=0.0)
    x = torch.tensor([[-200.0, -9.0, 0.0, 9.0, 200.0, 1e-4, -60.0, 60.0, 400.0, -400.0]])
    x = x.to(TRITON_DEVICE)
    y = kernels.activation_forward(x, None, "situglu", 0, 4.0, 25.0, 0.0)
    dx, _ = kernels.activation_backward(torch.ones_like(y), x, None, "situglu", 0, 4.0, 25.0, 0.0)
    y_ref = gated_activation_ref(x.double(), None, "situglu", 0, 4.0, 25.0, 0.0)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert_close(y, y_ref, torch.float32)


@pytest.mark.parametrize("k", [0, 1, 8])
def test_gated_single_row_and_odd_width(k):
    # H = 24 with blocks of 16 columns: the second column block ends inside an interleave block.
    _check("swiglu", (1, 48), torch.float32, bias=True, k=k, config=SMALL_ROWS)
    _check("reglu", (1, 48), torch.float32, bias=False, k=k)
    _check("sreglu", (9, 48), torch.bfloat16, bias=True, k=k)


def test_single_row_elementwise():
    _check("gelu", (1, 33), torch.float32, bias=True, config=SMALL_ROWS)
    _check("silu", (1,), torch.float32, bias=False)


def test_dbias_sums_over_many_row_programs():
    # 37 rows, 4 per program: 10 partial rows to reduce; 1 row per tile: 4 steps per program.
    config = RowsConfig(block_m=1, block_n=16, num_warps=1, rows_per_program=4)
    _check("qgelu", (37, 20), torch.float32, bias=True, config=config)
    _check("glu", (37, 40), torch.float32, bias=True, k=2, config=config)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_empty_input(activation):
    x = torch.empty(0, 16, device=TRITON_DEVICE)
    b = torch.randn(16, device=TRITON_DEVICE)
    y = kernels.activation_forward(x, b, activation)
    dx, db = kernels.activation_backward(torch.empty_like(y), x, b, activation, need_dbias=True)
    assert y.shape == ((0, 8) if activation == "swiglu" else (0, 16))
    assert dx.shape == x.shape
    assert torch.equal(db, torch.zeros_like(b))


def test_rows_config_validates_rows_per_program():
    with pytest.raises(ValueError, match="multiple of block_m"):
        RowsConfig(block_m=4, block_n=16, num_warps=4, rows_per_program=6)
