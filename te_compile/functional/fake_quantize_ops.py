r"""Fake quantisation: ``te::fake_quantize_fwd`` / ``te::fake_quantize_bwd``.

.. math::
    y = \mathrm{dq}(\mathrm{q}(x)), \qquad dx = \mathrm{dq}(\mathrm{q}_g(dy))
    \ \text{(or } dx = dy \text{ when the gradient is not quantised)}

with :math:`\mathrm{q}` the quantiser of ``spec`` (a ``functional.spec.QuantSpec`` string:
``"current:..."`` per-tensor current scaling, ``"block:..."`` 1x128 / 128x128 blocks,
``"mxfp8:..."``, ``"nvfp4"``; the GEMMs' vocabulary) and :math:`\mathrm{dq}` its inverse, back to
the input's dtype: the values an FP8 GEMM sees, as a plain tensor. This is what
``te_compile.ops.Quantize`` runs: Transformer Engine hands the next op the quantised tensor
itself, while here quantised data never crosses an op boundary except as plain tensors, so the op
passes on the dequantised values (the next FP8 GEMM re-quantises them, exactly for the per-tensor
and block kinds whose scale they reproduce). The gradient is straight-through, or quantised with
``grad_spec`` (the backward's format).

``spec=""`` leaves the forward values as they are (a copy: an op's output may not alias its
input), for a ``Quantize`` that only quantises the gradient. Delayed scaling needs an amax
history and is not an option here, nor are NVFP4's GEMM options (Hadamard transform,
stochastic rounding, row scaling); NVFP4's 4over6 block scaling is an option of ``spec`` (the
input's, as Transformer Engine's input quantiser applies it), never of ``grad_spec``;
``emulate`` changes nothing here.

``row_splits`` (an integer tensor, on any device) cuts the rows of ``inp`` (its leading dims
flattened) into consecutive groups that are quantised as separate tensors, forward and backward:
the grouped GEMMs' operands, one group per expert. It matters to NVFP4, whose global scale is
then per group (:func:`~te_compile.functional.quantize_mx_ref.nvfp4_qdq_row_groups`); MXFP8 and
1x128 blocks never span two rows, so for them the groups change nothing. Per-tensor current
scaling and 128x128 blocks would need per-group scales, which are not built: they raise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from te_compile._checks import HIGH_DTYPES, INDEX_DTYPES, check_tensor
from te_compile._library import differentiable, op
from te_compile.functional import quantize_table as _q
from te_compile.functional.quantize_mx_ref import nvfp4_qdq, nvfp4_qdq_row_groups
from te_compile.functional.spec import QuantSpec, as_strings, parse

__all__ = ["fake_quantize", "fake_quantize_ref", "qdq"]

_KINDS = ("", "current", "block", "mxfp8", "nvfp4")


# 1. Reference math ----------------------------------------------------------------------------


def qdq(
    x: Tensor,
    kind: str,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2: bool,
    row_splits: Tensor | None = None,
    four_over_six: str = "",
) -> Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype (fp64 input is quantised from fp32); NVFP4
    with ``row_splits``: a global scale per group of rows (``block_rows=16``: 16x16 tiles);
    ``four_over_six``: NVFP4's 4over6 block scaling (blocks along the last dim)."""
    if not kind:
        return x.clone(memory_format=torch.contiguous_format)
    src = x if x.dtype in HIGH_DTYPES else x.float()
    if four_over_six:
        rows = src.reshape(-1, src.shape[-1])
        y, _ = nvfp4_qdq(rows, columnwise=False, four_over_six=four_over_six)
        return y.to(x.dtype).view(x.shape)
    if kind == "nvfp4" and row_splits is not None:
        return nvfp4_qdq_row_groups(src.contiguous(), row_splits, block_rows == 16).to(x.dtype)
    # The kinds but "block" take 1 block row here (NVFP4's 16x16 tiles only with row_splits).
    rows = block_rows if kind == "block" else 1
    q = _q.quantize(src.contiguous(), kind, fp8_dtype=fp8_dtype, block_rows=rows,
                    power_2_scale=power_2)  # fmt: skip
    return _q.dequantize(q, src.dtype).to(x.dtype)


def _qdq_spec(x: Tensor, spec: str, splits: Tensor | None = None) -> Tensor:
    s = parse(QuantSpec, spec)
    return qdq(x, s.kind, s.fp8_dtype, s.block_rows, s.power_2_scale, splits, s.four_over_six)


def _qdq_groups(x: Tensor, spec: str, splits) -> Tensor:
    """:func:`qdq` of every group of rows on its own (host splits): the reference for
    ``row_splits``."""
    if splits is None:
        return _qdq_spec(x, spec)
    parts = [_qdq_spec(g, spec) for g in x.reshape(-1, x.shape[-1]).split(splits.tolist())]
    return torch.cat(parts).view(x.shape) if parts else x.clone()


class _Reference(torch.autograd.Function):
    """Differentiable reference (for the tests): qdq forward, qdq'd or straight gradient; with
    ``row_splits``, every group of rows quantised as its own tensor."""

    @staticmethod
    def forward(ctx, x, spec, grad_spec, splits):
        ctx.config = (grad_spec, splits)
        return _qdq_groups(x, spec, splits)

    @staticmethod
    def backward(ctx, grad):
        grad_spec, splits = ctx.config
        if grad_spec:
            grad = _qdq_groups(grad, grad_spec, splits)
        return grad, None, None, None


def fake_quantize_ref(
    inp: Tensor, spec: str, grad_spec: str = "", row_splits: Tensor | None = None
) -> Tensor:
    return _Reference.apply(inp, spec, grad_spec, row_splits)


def _check(inp: Tensor, spec: str, grad_spec: str, row_splits=None) -> None:
    p = "te.fake_quantize: "
    for name, text in (("spec", spec), ("grad_spec", grad_spec)):
        s = parse(QuantSpec, text, p + name)
        rows = (1, 128) if s.kind == "block" else (1,)
        gemm_option = s.rht or s.stochastic_rounding or s.row_scaled
        four_over_six = s.four_over_six and (name == "grad_spec" or row_splits is not None)
        if s.kind not in _KINDS or s.block_rows not in rows or gemm_option or four_over_six:
            raise ValueError(
                p + f"{name} must be one of the kinds {_KINDS} without NVFP4's GEMM options "
                f"(rht, sr, row_scaled; 4over6 in spec only, without row_splits) and with "
                f"128x128 blocks for 'block' only, got {text!r}"
            )
        if row_splits is not None and (s.kind == "current" or s.block_rows == 128):
            raise ValueError(
                f"{p}row_splits needs per-group scales, which {name}={text!r} does not have: "
                "use 'nvfp4', 'mxfp8', 'block' with 1x128 blocks or ''"
            )
    if inp.dtype not in HIGH_DTYPES or inp.dim() < 1:
        raise ValueError(
            p + f"inp must be float32, bfloat16 or float16 with at least 1 dim, got {inp.dtype} "
            f"of shape {list(inp.shape)}"
        )
    if row_splits is not None and (row_splits.dim() != 1 or row_splits.dtype not in INDEX_DTYPES):
        raise ValueError(
            p + f"row_splits must be a 1-D int32 or int64 tensor, got {row_splits.dtype} of "
            f"shape {list(row_splits.shape)}"
        )


# 2. Forward op / 3. fake ----------------------------------------------------------------------


@op("fake_quantize_fwd")
def fake_quantize_fwd(
    inp: Tensor, spec: str, grad_spec: str = "", row_splits: Tensor | None = None
) -> Tensor:
    """``dequantize(quantize(inp))``: the quantisation ops for the device (Triton on CUDA;
    NVFP4 in row groups: torch ops)."""
    _check(inp, spec, grad_spec, row_splits)
    if row_splits is not None:  # the groups must cover the rows: asserted on the device (no sync)
        rows = inp.numel() // inp.shape[-1] if inp.shape[-1] else 0
        ok = (row_splits.sum() == rows) & (row_splits >= 0).all()
        torch._assert_async(
            ok, "te.fake_quantize: row_splits must be >= 0 and sum to the row count"
        )
    return _qdq_spec(inp, spec, row_splits)


@fake_quantize_fwd.register_fake
def _fake_quantize_fwd_fake(inp, spec, grad_spec="", row_splits=None):
    _check(inp, spec, grad_spec, row_splits)
    return inp.new_empty(inp.shape)


# 4. Backward op -------------------------------------------------------------------------------


@op("fake_quantize_bwd")
def fake_quantize_bwd(grad: Tensor, grad_spec: str, row_splits: Tensor | None) -> Tensor:
    """``dequantize(quantize(grad))`` with the gradient's quantiser."""
    return _qdq_spec(grad, grad_spec, row_splits)


@fake_quantize_bwd.register_fake
def _fake_quantize_bwd_fake(grad, grad_spec, row_splits):
    return grad.new_empty(grad.shape)


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    # `grad_spec` and `row_splits` are absent from `inputs` when left at their defaults.
    _inp, _spec, *rest = inputs
    ctx.grad_spec = rest[0] if rest else ""
    ctx.save_for_backward(*rest[1:])


def _backward(ctx, bwd, grad):
    # Straight through (grad_spec ""): the incoming gradient itself, no op.
    splits = ctx.saved_tensors[0] if ctx.saved_tensors else None
    dx = bwd(grad.contiguous(), ctx.grad_spec, splits) if ctx.grad_spec else grad
    # One gradient per argument passed (a trailing default is not).
    return dx, *(None for _ in range(len(ctx.needs_input_grad) - 1))


_fake_quantize = differentiable(
    fake_quantize_fwd,
    fake_quantize_bwd,
    setup_context=_setup_context,
    backward=_backward,
    reference=fake_quantize_ref,
)


# Public function ------------------------------------------------------------------------------


def fake_quantize(
    inp: Tensor,
    spec: str | QuantSpec,
    *,
    grad_spec: str | QuantSpec = "",
    row_splits: Tensor | None = None,
) -> Tensor:
    """``inp`` quantised and dequantised as ``spec`` (a ``functional.spec.QuantSpec`` or its
    string) says, its gradient as ``grad_spec`` says: the module docstring."""
    p = "te.fake_quantize"
    check_tensor(p, "inp", inp, floating=False, min_dim=0)
    if row_splits is not None:
        check_tensor(p, "row_splits", row_splits, floating=False, min_dim=0)
    return _fake_quantize(inp, *as_strings(spec, grad_spec), row_splits)
