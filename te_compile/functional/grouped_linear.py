r"""Grouped linear (mixture of experts): ``te::grouped_linear_fwd`` / ``te::grouped_linear_bwd``.

The rows of ``inp`` ``[M, in_features]`` are split into ``G`` consecutive groups of
``m_splits[g]`` rows (``sum(m_splits) == M``; zero-size groups allowed) and group ``g`` is
multiplied by its own weight:

.. math::
    Y_g = X_g W_g^\top + b_g, \qquad dX_g = dY_g W_g, \qquad dW_g = dY_g^\top X_g, \qquad
    db_g = \textstyle\sum_{rows\ of\ g} dY_g

``weight`` is ``[G, out_features, in_features]`` (one tensor: the layout of
``GroupedLinear(single_grouped_parameter=True)``, and what a grouped GEMM consumes without a
copy), ``bias`` ``[G, out_features]``.

``m_splits`` is an integer tensor of ``G`` elements, on the input's device or on the CPU. On CUDA
nothing here reads its values on the host: the group offsets are a device ``cumsum``, the GEMMs
are ``torch._grouped_mm`` with those offsets, the per-row bias is a ``repeat_interleave`` with a
static ``output_size``, ``dbias`` an ``index_add_``; a training step therefore never waits for
the GPU, and under ``torch.compile`` new splits are new *values*, not new shapes (no
recompilation). ``sum(m_splits) == M`` and ``m_splits >= 0`` are checked on the device
(``torch._assert_async``) on CUDA and on the host on the CPU. The public function also takes a
Python list (converted to a CPU tensor; under ``torch.compile`` a list is a constant, so pass a
tensor when the splits change from step to step).

``torch._grouped_mm`` needs bf16 operands with ``in_features`` and ``out_features`` multiples of
8 on Hopper; other dtypes and shapes run a per-group loop of GEMMs on CUDA, which reads the
splits on the host (one device sync per call).

CPU: the reference loop, fp32 (fp64 stays fp64) math rounded once.

Weight-gradient fusion: ``main_grad`` (fp32, weight's shape) receives ``+= dW`` instead of a
``dweight`` output, as in ``te::linear_bwd``. On the grouped-GEMM path ``dW`` itself comes out
of ``torch._grouped_mm`` in bf16 (it has no fp32 output) and is added to ``main_grad`` in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_compile._library import HOST_SPLITS, SampleInput, differentiable, op

__all__ = ["grouped_linear", "grouped_linear_ref"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)


# 1. Reference math --------------------------------------------------------------------------


def _acc(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def grouped_linear_ref(
    inp: Tensor, m_splits: Tensor | Sequence[int], weight: Tensor, bias: Tensor | None = None
) -> Tensor:
    """Definition of correctness: a loop over groups in fp32 (fp64 stays fp64), rounded once."""
    splits = m_splits.tolist() if isinstance(m_splits, Tensor) else list(m_splits)
    acc = _acc(inp)
    outs = []
    for g, x in enumerate(inp.to(acc).split(splits)):
        y = x @ weight[g].to(acc).t()
        outs.append(y if bias is None else y + bias[g].to(acc))
    out = torch.cat(outs) if outs else inp.new_empty(0, weight.shape[1], dtype=acc)
    return out.to(inp.dtype)


def _check_args(
    inp: Tensor, m_splits: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> None:
    """Static constraints shared by the implementations (eager) and the fake (trace time); the
    per-argument diagnosis runs only when the compound test fails."""
    if (
        inp.ndim == 2
        and weight.ndim == 3
        and inp.dtype in _FLOAT_DTYPES
        and weight.dtype is inp.dtype
        and inp.shape[1] == weight.shape[2]
        and m_splits.ndim == 1
        and m_splits.dtype in _INT_DTYPES
        and m_splits.shape[0] == weight.shape[0]
        and (m_splits.device == inp.device or m_splits.device.type == "cpu")
        and (bias is None or (bias.shape == weight.shape[:2] and bias.dtype is inp.dtype))
        and (
            main_grad is None
            or (main_grad.dtype is torch.float32 and main_grad.shape == weight.shape)
        )
    ):
        return
    raise ValueError(_diagnose(inp, m_splits, weight, bias, main_grad))


def _diagnose(
    inp: Tensor, m_splits: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> str:
    p = "te.grouped_linear: "
    if inp.ndim != 2:
        return p + f"inp must be 2-D [sum(m_splits), in_features], got shape {list(inp.shape)}"
    if weight.ndim != 3:
        return p + (
            f"weight must be 3-D [num_gemms, out_features, in_features], got shape "
            f"{list(weight.shape)}"
        )
    if inp.dtype not in _FLOAT_DTYPES:
        return p + f"inp.dtype must be a floating type, got {inp.dtype}"
    if weight.dtype != inp.dtype:
        return p + f"inp.dtype ({inp.dtype}) must equal weight.dtype ({weight.dtype})"
    if inp.shape[1] != weight.shape[2]:
        return p + (
            f"inp.shape[1] ({inp.shape[1]}) must equal in_features = weight.shape[2] "
            f"({weight.shape[2]})"
        )
    if m_splits.ndim != 1 or m_splits.dtype not in _INT_DTYPES:
        return p + (
            f"m_splits must be a 1-D int32/int64 tensor (or a list of ints), got "
            f"{m_splits.dtype} of shape {list(m_splits.shape)}"
        )
    if m_splits.shape[0] != weight.shape[0]:
        return p + (
            f"m_splits has {m_splits.shape[0]} groups but weight has num_gemms = {weight.shape[0]}"
        )
    if m_splits.device != inp.device and m_splits.device.type != "cpu":
        return (
            p + f"m_splits must be on inp's device ({inp.device}) or the CPU, got {m_splits.device}"
        )
    if bias is not None and bias.shape != weight.shape[:2]:
        return p + (
            f"bias must have shape [num_gemms, out_features] = {list(weight.shape[:2])}, got "
            f"{list(bias.shape)}"
        )
    if bias is not None and bias.dtype != inp.dtype:
        return p + f"bias.dtype ({bias.dtype}) must equal inp.dtype ({inp.dtype})"
    return p + (
        f"main_grad must be float32 with weight's shape {list(weight.shape)}, got "
        f"{main_grad.dtype} {list(main_grad.shape)}"
    )


def _host_splits(m_splits: Tensor, rows: int) -> list[int]:
    """The splits as Python ints, checked (CPU tensors: no device sync)."""
    splits = m_splits.tolist()
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(
            f"te.grouped_linear: m_splits must be >= 0 and sum to inp.shape[0] ({rows}), got "
            f"{splits if len(splits) <= 16 else '[...]'} (sum {sum(splits)})"
        )
    return splits


def _empty(like: Tensor) -> Tensor:
    """A gradient that is not computed: a fresh 0-element tensor (outputs may not alias)."""
    return like.new_empty(0)


# CUDA: grouped GEMMs on device offsets ------------------------------------------------------


def _use_grouped_mm(inp: Tensor, weight: Tensor) -> bool:
    return inp.dtype is torch.bfloat16 and inp.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0


def _device_splits(m_splits: Tensor, inp: Tensor) -> tuple[Tensor, Tensor]:
    """``(splits, offsets)`` on ``inp``'s device, offsets int32 (end of each group), with the
    constraints asserted on the device (no host sync)."""
    splits = m_splits.to(inp.device, non_blocking=True)
    offs = torch.cumsum(splits, 0, dtype=torch.int32)
    if splits.numel():
        ok = (offs[-1] == inp.shape[0]) & (splits >= 0).all()
        torch._assert_async(ok, "te.grouped_linear: m_splits must be >= 0 and sum to inp.shape[0]")
    return splits, offs


def _row_bias(bias: Tensor, splits: Tensor, rows: int) -> Tensor:
    """``bias[group of row]`` for every row: ``[rows, out_features]``, no host sync."""
    return torch.repeat_interleave(bias, splits, dim=0, output_size=rows)


def _fwd_cuda(inp: Tensor, m_splits: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if not _use_grouped_mm(inp, weight):
        return _fwd_loop(inp, _host_splits(m_splits, inp.shape[0]), weight, bias, None)
    splits, offs = _device_splits(m_splits, inp)
    out = torch._grouped_mm(inp, weight.transpose(-2, -1), offs=offs)
    if bias is not None:
        out += _row_bias(bias, splits, inp.shape[0])
    return out


def _fwd_loop(
    inp: Tensor, splits: list[int], weight: Tensor, bias: Tensor | None, acc: torch.dtype | None
) -> Tensor:
    """One GEMM per group, in ``acc`` (None: the input dtype), rounded once."""
    out = inp.new_empty(inp.shape[0], weight.shape[1])
    start = 0
    for g, rows in enumerate(splits):
        x = inp[start : start + rows]
        w = weight[g] if acc is None else weight[g].to(acc)
        y = (x if acc is None else x.to(acc)) @ w.t()
        if bias is not None:
            y = y + (bias[g] if acc is None else bias[g].to(acc))
        out[start : start + rows] = y
        start += rows
    return out


# 2. Forward op ------------------------------------------------------------------------------


@op("grouped_linear_fwd", opaque=HOST_SPLITS)
def grouped_linear_fwd(
    inp: Tensor, m_splits: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> Tensor:
    """``[M, out_features]``. Default (CPU) implementation: the reference loop, fp32 math."""
    _check_args(inp, m_splits, weight, bias, main_grad)
    return _fwd_loop(inp, _host_splits(m_splits, inp.shape[0]), weight, bias, _acc(inp))


@grouped_linear_fwd.register_kernel("cuda")
def _grouped_linear_fwd_cuda(inp, m_splits, weight, bias, main_grad):
    _check_args(inp, m_splits, weight, bias, main_grad)
    if inp.dtype is torch.float64:
        return _fwd_loop(inp, _host_splits(m_splits, inp.shape[0]), weight, bias, torch.float64)
    return _fwd_cuda(inp, m_splits, weight, bias)


# 3. Fake ------------------------------------------------------------------------------------


@grouped_linear_fwd.register_fake
def _grouped_linear_fwd_fake(inp, m_splits, weight, bias, main_grad):
    _check_args(inp, m_splits, weight, bias, main_grad)
    return inp.new_empty(inp.shape[0], weight.shape[1])


# 4. Backward op -----------------------------------------------------------------------------


def _bwd_loop(grad_out, inp, splits, weight, main_grad, has_bias, need_dgrad, need_wgrad, acc):
    """Per-group GEMMs in ``acc`` (None: the input dtype); dW and db summed in fp32 at least."""
    dtype = grad_out.dtype
    cast = (lambda t: t) if acc is None else (lambda t: t.to(acc))
    dinp = grad_out.new_empty(inp.shape) if need_dgrad else _empty(grad_out)
    want_dw = need_wgrad and main_grad is None
    dweight = grad_out.new_zeros(weight.shape) if want_dw else _empty(grad_out)
    dbias = grad_out.new_zeros(weight.shape[:2]) if has_bias else _empty(grad_out)
    start = 0
    for g, rows in enumerate(splits):
        dy, x = grad_out[start : start + rows], inp[start : start + rows]
        if need_dgrad:
            dinp[start : start + rows] = (cast(dy) @ cast(weight[g])).to(dtype)
        if need_wgrad and main_grad is not None:
            main_grad[g].addmm_(dy.t().float(), x.float())
        elif need_wgrad:
            dweight[g] = (cast(dy).t() @ cast(x)).to(dtype)
        if has_bias:
            dbias[g] = dy.sum(0, dtype=acc or torch.float32).to(dtype)
        start += rows
    return dinp, dweight, dbias


def _bwd_cuda(grad_out, inp, m_splits, weight, main_grad, has_bias, need_dgrad, need_wgrad):
    splits, offs = _device_splits(m_splits, inp)
    dinp = torch._grouped_mm(grad_out, weight, offs=offs) if need_dgrad else _empty(grad_out)
    dweight = _empty(grad_out)
    if need_wgrad:
        # Grouped along the reduction dim: [N, M] x [M, K] -> [G, N, K]. torch._grouped_mm only
        # outputs its operands' dtype (an fp32 out_dtype is refused, eager and meta), so with
        # main_grad dW is rounded to bf16 once and then accumulated in fp32 (no host sync).
        dw = torch._grouped_mm(grad_out.t(), inp, offs=offs)
        if main_grad is not None:
            main_grad.add_(dw)
        else:
            dweight = dw
    dbias = _empty(grad_out)
    if has_bias:
        groups = torch.arange(weight.shape[0], device=inp.device)
        row_group = torch.repeat_interleave(groups, splits, output_size=inp.shape[0])
        dbias = grad_out.new_zeros(weight.shape[:2], dtype=torch.float32)
        dbias = dbias.index_add_(0, row_group, grad_out.float()).to(grad_out.dtype)
    return dinp, dweight, dbias


@op("grouped_linear_bwd", mutates_args=("main_grad",), opaque=HOST_SPLITS)
def grouped_linear_bwd(
    grad_out: Tensor,
    inp: Tensor,
    m_splits: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)``; a gradient not computed is a 0-element tensor (dweight also
    when it went into ``main_grad``). Default (CPU): the reference loop, fp32 math."""
    splits = _host_splits(m_splits, inp.shape[0])
    acc = _acc(inp)
    return _bwd_loop(
        grad_out, inp, splits, weight, main_grad, has_bias, need_dgrad, need_wgrad, acc
    )


@grouped_linear_bwd.register_kernel("cuda")
def _grouped_linear_bwd_cuda(
    grad_out, inp, m_splits, weight, main_grad, has_bias, need_dgrad, need_wgrad
):
    if inp.dtype is torch.float64 or not _use_grouped_mm(inp, weight):
        splits = _host_splits(m_splits, inp.shape[0])
        acc = torch.float64 if inp.dtype is torch.float64 else None
        return _bwd_loop(
            grad_out, inp, splits, weight, main_grad, has_bias, need_dgrad, need_wgrad, acc
        )
    return _bwd_cuda(grad_out, inp, m_splits, weight, main_grad, has_bias, need_dgrad, need_wgrad)


@grouped_linear_bwd.register_fake
def _grouped_linear_bwd_fake(
    grad_out, inp, m_splits, weight, main_grad, has_bias, need_dgrad, need_wgrad
):
    dinp = grad_out.new_empty(inp.shape) if need_dgrad else _empty(grad_out)
    want_dw = need_wgrad and main_grad is None
    dweight = grad_out.new_empty(weight.shape) if want_dw else _empty(grad_out)
    dbias = grad_out.new_empty(weight.shape[:2]) if has_bias else _empty(grad_out)
    return dinp, dweight, dbias


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    inp, m_splits, weight, bias, main_grad = inputs
    ctx.save_for_backward(inp, m_splits, weight, main_grad)
    ctx.has_bias = bias is not None


def _backward(ctx, bwd, grad_out):
    inp, m_splits, weight, main_grad = ctx.saved_tensors
    need_dgrad, _, need_wgrad, need_bgrad = ctx.needs_input_grad[:4]
    dinp, dweight, dbias = bwd(
        grad_out.contiguous(),
        inp,
        m_splits,
        weight,
        main_grad,
        ctx.has_bias and need_bgrad,
        need_dgrad,
        need_wgrad,
    )
    return (
        dinp if need_dgrad else None,
        None,
        dweight if need_wgrad and main_grad is None else None,
        dbias if ctx.has_bias and need_bgrad else None,
        None,
    )


def _sample_inputs(device: torch.device):
    def t(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    def splits(*values, on=device):
        return torch.tensor(values, device=on, dtype=torch.int64)

    yield SampleInput((t(10, 16), splits(3, 0, 7), t(3, 8, 16), t(3, 8), None))
    yield SampleInput((t(9, 16), splits(9, on="cpu"), t(1, 8, 16), None, None))
    bf16 = torch.bfloat16
    yield SampleInput(
        (t(12, 32, dtype=bf16), splits(5, 4, 3, 0), t(4, 16, 32, dtype=bf16), None, None)
    )
    yield SampleInput(
        (
            t(6, 8, dtype=torch.float16, grad=False),
            splits(2, 4),
            t(2, 8, 8, dtype=torch.float16),
            t(2, 8, dtype=torch.float16),
            None,
        )
    )
    # Weight gradient into main_grad.
    yield SampleInput(
        (t(7, 16), splits(4, 3), t(2, 8, 16), None, torch.zeros(2, 8, 16, device=device))
    )


_grouped_linear = differentiable(
    grouped_linear_fwd,
    grouped_linear_bwd,
    setup_context=_setup_context,
    backward=_backward,
    sample_inputs=_sample_inputs,
    reference=lambda inp, m_splits, weight, bias, main_grad: grouped_linear_ref(
        inp, m_splits, weight, bias
    ),
)


# Public function ------------------------------------------------------------------------------


def as_splits_tensor(m_splits: Tensor | Sequence[int]) -> Tensor:
    """``m_splits`` as an integer tensor: tensors pass through, a list of ints becomes a CPU
    int64 tensor (a constant under ``torch.compile``)."""
    if isinstance(m_splits, Tensor):
        return m_splits
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in m_splits):
        raise ValueError(
            f"te.grouped_linear: m_splits must be a list of ints or an integer tensor, got "
            f"{m_splits!r}"
        )
    return torch.tensor(list(m_splits), dtype=torch.int64)


def grouped_linear(
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    main_grad: Tensor | None = None,
) -> Tensor:
    """Rows of ``inp`` split into groups by ``m_splits``; group ``g`` gets
    ``inp_g @ weight[g].T + bias[g]`` (see the module docstring), through
    ``te::grouped_linear_fwd``."""
    return _grouped_linear(inp, as_splits_tensor(m_splits), weight, bias, main_grad)
