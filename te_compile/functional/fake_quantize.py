r"""Fake quantisation: ``te::fake_quantize_fwd`` / ``te::fake_quantize_bwd``.

.. math::
    y = \mathrm{dq}(\mathrm{q}(x)), \qquad dx = \mathrm{dq}(\mathrm{q}_g(dy))
    \ \text{(or } dx = dy \text{ when the gradient is not quantised)}

with :math:`\mathrm{q}` one of the quantisers of ``te_compile.functional.quantize`` (``kind``:
``"current"`` per-tensor current scaling, ``"block"`` 1x128 / 128x128 blocks, ``"mxfp8"``,
``"nvfp4"``) and :math:`\mathrm{dq}` its inverse, back to the input's dtype: the values an FP8
GEMM sees, as a plain tensor. This is what ``te_compile.ops.Quantize`` runs: Transformer Engine
hands the next op the quantised tensor itself, while here quantised data never crosses an op
boundary except as plain tensors, so the op passes on the dequantised values (the next FP8 GEMM
re-quantises them, exactly for the per-tensor and block kinds whose scale they reproduce).
The gradient is straight-through, or quantised with ``grad_kind`` (the backward's format).

``kind="none"`` leaves the forward values as they are (a copy: an op's output may not alias its
input), for a ``Quantize`` that only quantises the gradient. Delayed scaling needs an amax
history and is not an option here.

``row_splits`` (an integer tensor, on any device) cuts the rows of ``inp`` (its leading dims
flattened) into consecutive groups that are quantised as separate tensors, forward and backward:
the grouped GEMMs' operands, one group per expert. It matters to NVFP4, whose global scale is
then per group (:func:`~te_compile.functional.quantize_mx.nvfp4_qdq_row_groups`); MXFP8 and
1x128 blocks never span two rows, so for them the groups change nothing. Per-tensor current
scaling and 128x128 blocks would need per-group scales, which are not built: they raise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._checks import check_bool, check_choice, check_tensor
from te_compile._library import SampleInput, differentiable, op
from te_compile.functional import quantize as _q
from te_compile.functional.quantize_mx import nvfp4_qdq_row_groups

__all__ = ["FAKE_QUANTIZE_KINDS", "fake_quantize", "fake_quantize_ref", "qdq"]

FAKE_QUANTIZE_KINDS = ("none", "current", "block", "mxfp8", "nvfp4")
_HIGH = (torch.float32, torch.bfloat16, torch.float16)


# 1. Reference math ----------------------------------------------------------------------------


def qdq(
    x: Tensor,
    kind: str,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2: bool,
    row_splits: Tensor | None = None,
) -> Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype (fp64 input is quantised from fp32); NVFP4
    with ``row_splits``: a global scale per group of rows (``block_rows=16``: 16x16 tiles)."""
    if kind == "none":
        return x.clone(memory_format=torch.contiguous_format)
    src = x if x.dtype in _HIGH else x.float()
    if kind == "nvfp4" and row_splits is not None:
        tiles = block_rows == 16
        return nvfp4_qdq_row_groups(src.contiguous(), row_splits, tiles).to(x.dtype)
    kw = {"fp8_dtype": fp8_dtype, "power_2_scale": power_2}
    if kind == "block":
        kw["block_rows"] = block_rows
    if kind in ("mxfp8", "nvfp4"):
        kw = {"fp8_dtype": fp8_dtype} if kind == "mxfp8" else {}
    q = _q.quantize(src.contiguous(), kind, **kw)
    return _q.dequantize(q, src.dtype).to(x.dtype)


def _qdq_groups(x: Tensor, kind: str, fp8_dtype, block_rows, power_2, splits) -> Tensor:
    """:func:`qdq` of every group of rows on its own (host splits): the reference for
    ``row_splits``."""
    if splits is None:
        return qdq(x, kind, fp8_dtype, block_rows, power_2)
    rows = x.reshape(-1, x.shape[-1])
    parts = [qdq(g, kind, fp8_dtype, block_rows, power_2) for g in rows.split(splits.tolist())]
    return torch.cat(parts).view(x.shape) if parts else x.clone()


class _Reference(torch.autograd.Function):
    """Differentiable reference (for the tests): qdq forward, qdq'd or straight gradient; with
    ``row_splits``, every group of rows quantised as its own tensor."""

    @staticmethod
    def forward(
        ctx, x, kind, fp8_dtype, block_rows, power_2, grad_kind, grad_dtype, grad_rows, splits
    ):
        ctx.config = (grad_kind, grad_dtype, grad_rows, power_2, splits)
        return _qdq_groups(x, kind, fp8_dtype, block_rows, power_2, splits)

    @staticmethod
    def backward(ctx, grad):
        grad_kind, grad_dtype, grad_rows, power_2, splits = ctx.config
        if grad_kind != "none":
            grad = _qdq_groups(grad, grad_kind, grad_dtype, grad_rows, power_2, splits)
        return grad, *(None for _ in range(8))


def fake_quantize_ref(
    inp: Tensor,
    kind: str,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2_scale: bool,
    grad_kind: str,
    grad_fp8_dtype: torch.dtype,
    grad_block_rows: int,
    row_splits: Tensor | None = None,
) -> Tensor:
    return _Reference.apply(
        inp,
        kind,
        fp8_dtype,
        block_rows,
        power_2_scale,
        grad_kind,
        grad_fp8_dtype,
        grad_block_rows,
        row_splits,
    )


def _check(inp: Tensor, kind: str, grad_kind: str, config=(), row_splits=None) -> None:
    """``config``: ``((kind, block_rows), (grad_kind, grad_block_rows))`` for the
    ``row_splits`` checks."""
    kinds = FAKE_QUANTIZE_KINDS
    if inp.dtype in _HIGH and inp.dim() >= 1 and kind in kinds and grad_kind in kinds:
        if row_splits is not None:
            _check_row_splits(row_splits, config)
        return
    p = "te.fake_quantize: "
    for name, value in (("kind", kind), ("grad_kind", grad_kind)):
        if value not in FAKE_QUANTIZE_KINDS:
            raise ValueError(p + f"{name} must be one of {FAKE_QUANTIZE_KINDS}, got {value!r}")
    raise ValueError(
        p + f"inp must be float32, bfloat16 or float16 with at least 1 dim, got {inp.dtype} "
        f"of shape {list(inp.shape)}"
    )


def _check_row_splits(row_splits: Tensor, config) -> None:
    p = "te.fake_quantize: "
    if row_splits.dim() != 1 or row_splits.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            p + f"row_splits must be a 1-D int32 or int64 tensor, got {row_splits.dtype} of "
            f"shape {list(row_splits.shape)}"
        )
    for name, (kind, rows) in zip(("kind", "grad_kind"), config, strict=True):
        if kind == "current" or (kind == "block" and rows != 1):
            what = f"{name}={kind!r}" + (f" with {name[:-4]}block_rows={rows}" * (kind == "block"))
            raise ValueError(
                f"{p}row_splits needs per-group scales, which {what} does not have: use "
                "'nvfp4', 'mxfp8', 'block' with 1x128 blocks or 'none'"
            )


def _assert_splits_cover(row_splits: Tensor | None, x: Tensor) -> None:
    """The groups must cover the rows exactly: asserted on the device (no host sync)."""
    if row_splits is None:
        return
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    ok = (row_splits.sum() == rows) & (row_splits >= 0).all()
    torch._assert_async(ok, "te.fake_quantize: row_splits must be >= 0 and sum to the row count")


# 2. Forward op / 3. fake ----------------------------------------------------------------------


@op("fake_quantize_fwd")
def fake_quantize_fwd(
    inp: Tensor,
    kind: str,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2_scale: bool,
    grad_kind: str,
    grad_fp8_dtype: torch.dtype,
    grad_block_rows: int,
    row_splits: Tensor | None = None,
) -> Tensor:
    """``dequantize(quantize(inp))``: the quantisation ops for the device (Triton on CUDA;
    NVFP4 in row groups: torch ops)."""
    config = ((kind, block_rows), (grad_kind, grad_block_rows))
    _check(inp, kind, grad_kind, config, row_splits)
    _assert_splits_cover(row_splits, inp)
    return qdq(inp, kind, fp8_dtype, block_rows, power_2_scale, row_splits)


@fake_quantize_fwd.register_fake
def _fake_quantize_fwd_fake(
    inp, kind, fp8_dtype, block_rows, power_2, grad_kind, g_dtype, g_rows, row_splits=None
):
    _check(inp, kind, grad_kind, ((kind, block_rows), (grad_kind, g_rows)), row_splits)
    return inp.new_empty(inp.shape)


# 4. Backward op -------------------------------------------------------------------------------


@op("fake_quantize_bwd")
def fake_quantize_bwd(
    grad: Tensor,
    grad_kind: str,
    grad_fp8_dtype: torch.dtype,
    grad_block_rows: int,
    power_2: bool,
    row_splits: Tensor | None,
) -> Tensor:
    """``dequantize(quantize(grad))`` with the gradient's quantiser."""
    return qdq(grad, grad_kind, grad_fp8_dtype, grad_block_rows, power_2, row_splits)


@fake_quantize_bwd.register_fake
def _fake_quantize_bwd_fake(grad, grad_kind, grad_fp8_dtype, grad_block_rows, power_2, splits):
    return grad.new_empty(grad.shape)


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    # `row_splits` is absent from `inputs` when left at its default.
    _inp, _kind, _dtype, _rows, power_2, grad_kind, grad_dtype, grad_rows, *splits = inputs
    ctx.config = (grad_kind, grad_dtype, grad_rows, power_2)
    ctx.save_for_backward(*splits)


def _backward(ctx, bwd, grad):
    # Straight through (grad_kind "none"): the incoming gradient itself, no op.
    splits = ctx.saved_tensors[0] if ctx.saved_tensors else None
    dx = grad if ctx.config[0] == "none" else bwd(grad.contiguous(), *ctx.config, splits)
    # One gradient per argument passed (a trailing default is not).
    return dx, *(None for _ in range(len(ctx.needs_input_grad) - 1))


def _samples(device: torch.device):
    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    yield SampleInput((t(5, 32), "current", e4m3, 1, False, "current", e5m2, 1))
    yield SampleInput(
        (t(3, 2, 128, dtype=torch.bfloat16), "block", e4m3, 1, True, "block", e5m2, 1)
    )
    yield SampleInput((t(4, 64), "mxfp8", e4m3, 1, False, "mxfp8", e5m2, 1))
    yield SampleInput((t(4, 64, dtype=torch.bfloat16), "nvfp4", e4m3, 1, False, "block", e4m3, 1))
    yield SampleInput((t(6, 48, dtype=torch.float16), "none", e4m3, 1, False, "current", e4m3, 1))
    # NVFP4 in row groups (an empty one, and 128 rows split mid-block-column), both ways.
    splits = torch.tensor([40, 0, 24, 64], device=device)
    yield SampleInput(
        (t(128, 32, dtype=torch.bfloat16), "nvfp4", e4m3, 1, False, "nvfp4", e4m3, 1, splits)
    )
    yield SampleInput(
        (t(2, 8, 32), "mxfp8", e4m3, 1, False, "nvfp4", e4m3, 1, splits.new_tensor([6, 10]))
    )


_fake_quantize = differentiable(
    fake_quantize_fwd,
    fake_quantize_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_samples,
    reference=fake_quantize_ref,
)


# Public function ------------------------------------------------------------------------------


def fake_quantize(
    inp: Tensor,
    kind: str,
    *,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    block_rows: int = 1,
    power_2_scale: bool = False,
    grad_kind: str = "none",
    grad_fp8_dtype: torch.dtype = torch.float8_e5m2,
    grad_block_rows: int = 1,
    row_splits: Tensor | None = None,
) -> Tensor:
    """``inp`` quantised and dequantised with ``kind`` (see the module docstring); the gradient
    straight through (``grad_kind="none"``) or quantised and dequantised with ``grad_kind``;
    ``row_splits``: groups of rows quantised as separate tensors."""
    p = "te.fake_quantize"
    check_bool(p, power_2_scale=power_2_scale)
    check_tensor(p, "inp", inp, floating=False, min_dim=0)
    if row_splits is not None:
        check_tensor(p, "row_splits", row_splits, floating=False, min_dim=0)
    for name, value in (("fp8_dtype", fp8_dtype), ("grad_fp8_dtype", grad_fp8_dtype)):
        check_choice(p, name, value, (torch.float8_e4m3fn, torch.float8_e5m2))
    for name, value in (("block_rows", block_rows), ("grad_block_rows", grad_block_rows)):
        check_choice(p, name, value, (1, 128))
    args = (inp, kind, fp8_dtype, block_rows, power_2_scale, grad_kind, grad_fp8_dtype)
    if row_splits is None:
        return _fake_quantize(*args, grad_block_rows)
    return _fake_quantize(*args, grad_block_rows, row_splits)
