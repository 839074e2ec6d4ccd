r"""The grouped linear family (mixture of experts): ``te::grouped_linear_fwd`` /
``te::grouped_linear_bwd``, every recipe.

The rows of ``inp`` ``[M, in_features]`` are split into ``G`` consecutive groups of
``m_splits[g]`` rows (``sum(m_splits) == M``; zero-size groups allowed) and group ``g`` is
multiplied by its own weight:

.. math::
    Y_g = X_g W_g^\top + b_g, \qquad dX_g = dY_g W_g, \qquad dW_g = dY_g^\top X_g, \qquad
    db_g = \textstyle\sum_{rows\ of\ g} dY_g

``weight`` is ``[G, out_features, in_features]`` (the layout of
``GroupedLinear(single_grouped_parameter=True)``, which a grouped GEMM consumes without a copy),
``bias`` ``[G, out_features]``. ``m_splits`` is an integer tensor of ``G`` elements, on the
input's device or on the CPU; the public function also takes a Python list (a constant under
``torch.compile``: pass a tensor when the splits change from step to step).

After the five tensors the op takes the recipe as data as ``te::linear`` does (the three specs,
with one power-of-two option and the input's format for the weight; ``scale``, ``grad_amax``,
``rng_state``) and ``backward`` (a ``BackwardSpec``: ``te::linear``'s overrides and
``save_input``, and ``fp8_wgrad``: per-tensor specs' wgrad GEMM in FP8 too, the input kept as
its FP8 wgrad operand). The GEMMs of each recipe are a row of :data:`GROUPED_GEMMS`
(``functional.grouped_gemm`` and ``functional.grouped_fp8``).

``saved`` is the row's forward's (the fake below gives every shape): the operands' copies the
backward GEMMs read (under an override nothing, or the dequantised ``[X, W]``), then the
per-tensor recipes' ``[amax(X), amax(W)]`` where
:func:`~te_compile.functional.grouped_linear_args.appends_amaxes`. A pre-quantised weight
(``weight_q``, ``functional.grouped_weight``) leaves the weight's copies out of ``saved``.

Under ``torch.compile`` Inductor traces into the calls whose GEMMs take device offsets, every
other call is kept whole (:func:`host_split_path`, ``docs/op_mechanism.md``). ``main_grad``
(fp32, weight's shape) receives ``+= dW`` instead of a ``dweight`` output, as in ``te::linear_bwd``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from te_compile._checks import check_bool, check_choice, check_tensors
from te_compile._library import HOST_SPLITS, differentiable, op
from te_compile._numerics import acc_dtype
from te_compile.functional.dense_weight import check_weight_quantized
from te_compile.functional.dropout_ops import new_rng_state
from te_compile.functional.family import (
    DeferredWgrad,
    check_gemm_tensors,
    check_overwrite,
    save_for_backward_except_written,
)
from te_compile.functional.gemm import (
    BACKWARD_OVERRIDES,
    PER_TENSOR,
    empty,
    qdq_both,
    quantize_per_tensor,
    scale_slots,
)
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.functional.grouped_fp8 import (
    per_tensor_backward,
    per_tensor_forward,
    wgrad_capacity,
)
from te_compile.functional.grouped_gemm import (
    GroupedRecipe,
    as_splits_tensor,
    blockwise_backward,
    blockwise_forward,
    checked_splits,
    dequantized_backward,
    dequantized_forward,
    dequantized_input,
    grouped_gemm_kind,
    high_precision_backward,
    high_precision_forward,
    nvfp4_dtype,
    nvfp4_input,
    nvfp4_weight,
    uses_grouped_mm,
)
from te_compile.functional.grouped_linear_args import (
    GroupedLinearArgs,
    appends_amaxes,
    check_grouped_linear,
    make_grouped_recipe,
)
from te_compile.functional.quantize import as_e4m3, quantize_rowwise
from te_compile.functional.quantize_mx_ref import nvfp4_qdq
from te_compile.functional.spec import BackwardSpec, QuantSpec, as_specs, as_strings, parse

__all__ = [
    "GROUPED_GEMMS",
    "as_splits_tensor",
    "grouped_linear",
    "grouped_linear_ref",
    "scaled_grouped_linear_ref",
]

_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


GROUPED_GEMMS: dict[str, tuple[Callable, Callable]] = {
    "grouped_mm": (high_precision_forward, high_precision_backward),
    "scaled_grouped_mm": (per_tensor_forward, per_tensor_backward),
    "blockwise": (blockwise_forward, blockwise_backward),
    "dequantized": (dequantized_forward, dequantized_backward),
}


# 1. Reference math ----------------------------------------------------------------------------


def grouped_linear_ref(
    inp: Tensor, m_splits: Tensor | Sequence[int], weight: Tensor, bias: Tensor | None = None
) -> Tensor:
    """High precision's definition: a loop over groups in fp32 (fp64 stays fp64), rounded once."""
    splits = m_splits.tolist() if isinstance(m_splits, Tensor) else list(m_splits)
    acc = acc_dtype(inp)
    outs = [inp.new_empty(0, weight.shape[1], dtype=acc)]  # (no groups: no rows)
    for g, x in enumerate(inp.to(acc).split(splits)):
        y = x @ weight[g].to(acc).t()
        outs.append(y if bias is None else y + bias[g].to(acc))
    return torch.cat(outs).to(inp.dtype)


def _ref_quant(t: Tensor, r: GroupedRecipe, role: int, columns: bool, rows: int = 1) -> Tensor:
    """``t`` ``[m, C]``, an operand of ``role`` (0 input, 1 weight, 2 gradient),
    quantised-dequantised as the recipe's GEMMs take it: along ``C`` or, with ``columns``, along
    ``m`` (one group's or expert's tokens). Per-tensor recipes: rowwise, or with the delayed
    scale, E5M2 recoded to E4M3 (exact in float64); block-scaled: in ``rows`` x 128 blocks
    (MXFP8: 32 elements), along ``m`` a partial last block as if padded with zeros."""
    fp8_dtype = r.g.fp8_dtype if role == 2 else r.x.fp8_dtype
    if r.x.kind in PER_TENSOR:
        scale, dim = scale_slots(r.scale, r.x.kind, role)[0], 0 if columns else -1
        if t.shape[0] == 0:
            return t
        if scale is None:
            data, scale_inv = quantize_rowwise(t, fp8_dtype, dim, e4m3_codes=True)
            scale_inv = scale_inv.unsqueeze(dim)
        else:
            data, scale_inv, _ = quantize_per_tensor(t.reshape(-1, t.shape[-1]), fp8_dtype, scale)
            data, scale_inv = as_e4m3(data.view(t.shape), scale_inv)
        acc = acc_dtype(t)
        return (data.to(acc) * scale_inv.to(acc)).to(t.dtype)
    spec = QuantSpec(r.x.kind, fp8_dtype, rows, r.x.kind == "block" and r.w.power_2_scale)
    if not columns:
        return qdq_both(t, spec, columnwise=False)[0].to(t.dtype)
    m = t.shape[0]
    padded_t = torch.nn.functional.pad(t.t(), (0, -m % (32 if r.x.kind == "mxfp8" else 128)))
    return qdq_both(padded_t, spec, columnwise=False)[0].to(t.dtype)[:, :m].t()


def _ref_copies(x: Tensor, w: Tensor, splits: list[int], r: GroupedRecipe) -> tuple[Tensor, ...]:
    """``(X, W, X_col, W_col)``: the forward GEMM's operands and the copies the backward GEMMs
    read, quantised-dequantised: ``W_col`` along ``out_features`` (128x128 weight blocks: the
    forward's), ``X_col`` along each group's own tokens (per-tensor recipes without
    ``fp8_wgrad``: ``X``). NVFP4: a dense GEMM's per expert (``nvfp4_input`` / ``nvfp4_weight``)."""
    if r.x.kind == "nvfp4":
        (xq, x_col), (wq, w_col) = nvfp4_input(x, torch.tensor(splits), r), nvfp4_weight(w, r)
        return xq, wq, x_col, w_col
    w_rows = r.w.block_rows if r.x.kind == "block" else 1
    wq = torch.stack([_ref_quant(w_g, r, 1, False, w_rows) for w_g in w])
    w_col = wq if w_rows != 1 else torch.stack([_ref_quant(w_g, r, 1, True) for w_g in w])
    x_col = x
    if r.x.kind not in PER_TENSOR or r.bw.fp8_wgrad:
        x_col = torch.cat([_ref_quant(x_g, r, 0, True) for x_g in x.split(splits)])
    return _ref_quant(x, r, 0, False), wq, x_col, w_col


class _RefGrouped(torch.autograd.Function):
    """Every quantised recipe but the native blockwise one, in the input's dtype: ``Y_g = X_g
    W_g^T``, ``dX_g = dY_g W_{col,g}``, ``dW_g = dY_g^T X_{col,g}`` of :func:`_ref_copies`'
    values and ``dY`` quantised-dequantised as the operands it meets."""

    @staticmethod
    def forward(ctx, x, w, splits, r: GroupedRecipe):
        xq, wq, x_col, w_col = _ref_copies(x, w, splits, r)
        ctx.save_for_backward(x_col, w_col)
        ctx.splits, ctx.r = splits, r
        outs = [x_g @ wq[g].t() for g, x_g in enumerate(xq.split(splits))]
        return torch.cat(outs) if outs else x.new_empty(0, w.shape[1])

    @staticmethod
    def backward(ctx, dy):
        x_col, w_col = ctx.saved_tensors
        splits, r = ctx.splits, ctx.r
        if r.x.kind == "nvfp4":  # stochastic rounding from one stream over the whole gradient
            g_row, g_col_t = nvfp4_qdq(dy, rht=r.g.rht, rng_state=r.rng_state,
                                       row_splits=torch.tensor(splits))  # fmt: skip
            g_row, g_cols = g_row.to(dy.dtype), g_col_t.t().to(dy.dtype).split(splits)
        else:
            g_cols = dy.split(splits)
            if r.x.kind not in PER_TENSOR or r.bw.fp8_wgrad:
                g_cols = [_ref_quant(d, r, 2, True) for d in g_cols]
            g_row = _ref_quant(dy, r, 2, False)
        dx = torch.cat([d @ w_col[i] for i, d in enumerate(g_row.split(splits))])
        parts = zip(g_cols, x_col.split(splits), strict=True)
        dw = torch.stack([d.t() @ x_g for d, x_g in parts])
        return dx, dw, None, None


def scaled_grouped_linear_ref(
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None = None,
    fwd_dtype: torch.dtype = _E4M3,
    bwd_dtype: torch.dtype = _E5M2,
    scale: Tensor | None = None,
    fp8_wgrad: bool = False,
) -> Tensor:
    """The per-tensor recipes' definition, differentiable (:func:`_reference` of their specs):
    current scaling, or delayed with ``scale`` ``[3]``; ``fp8_wgrad``: the wgrad in FP8 too."""
    kind = "current" if scale is None else "delayed"
    x, g = (QuantSpec(kind, dtype).encode() for dtype in (fwd_dtype, bwd_dtype))
    args = (inp, as_splits_tensor(m_splits), weight, bias, None, x, x, g, scale)
    return _reference(*args, None, None, BackwardSpec(fp8_wgrad=fp8_wgrad).encode())


def _reference(*args):
    """Every recipe's definition, in the inputs' dtype (float64 in the tests)."""
    a = GroupedLinearArgs(*args)
    if a.bw.override:  # the recipe's forward value, with the gradients of the grouped GEMM of the
        # high-precision operands or ("dequantized") of the forward's dequantised ones
        value = _reference(*a._replace(backward="")).detach()
        x, w = a.inp, a.weight
        if a.bw.override == "dequantized":
            xq, wq = _ref_copies(x, w, a.m_splits.tolist(), a.grouped_recipe)[:2]
            x, w = x + (xq - x).detach(), w + (wq - w).detach()
        y = grouped_linear_ref(x, a.m_splits, w, a.bias)
        return y + (value - y).detach()
    inp, weight, bias = a.inp, a.weight, a.bias
    x, w, g = a.specs
    if not x.kind:
        return grouped_linear_ref(inp, a.m_splits, weight, bias)
    splits = a.m_splits.tolist()
    if grouped_gemm_kind(x.kind, x.emulate) == "blockwise":  # the dense op's, per expert
        outs = [quantized_linear_ref(x_i, weight[i], x, w, g)
                for i, x_i in enumerate(inp.split(splits)) if x_i.shape[0]]  # fmt: skip
        out = torch.cat([inp.new_zeros(0, weight.shape[1]), *outs])
    else:
        out = _RefGrouped.apply(inp, weight, splits, a.grouped_recipe)
    return out if bias is None else out + torch.repeat_interleave(bias, torch.tensor(splits), 0)


# 2. Forward op ------------------------------------------------------------------------------


def _forward(a: GroupedLinearArgs, cuda: bool) -> tuple[Tensor, list[Tensor]]:
    check_grouped_linear(a)
    r = a.grouped_recipe
    forward, _ = GROUPED_GEMMS[grouped_gemm_kind(r.x.kind, r.x.emulate)]
    if a.bw.save_input:  # no FP8 copy of the input: the backward quantises it again
        r = r._replace(bw=dataclasses.replace(r.bw, fp8_wgrad=False))
    out, saved = forward(a.inp, a.m_splits, a.weight, a.bias, r, cuda, a.weight_q)
    if a.bw.save_input and forward is dequantized_forward:  # the input's copy: made again
        saved = saved[1:]
    return out, saved


def host_split_path(*args: object, **kwargs: object) -> str | None:
    """``kept_whole`` of the family's ops, forward and backward calls alike: None (trace
    through) for a call whose GEMMs take device offsets — on CUDA with the splits on the device,
    the high-precision ``torch._grouped_mm`` path and the per-tensor FP8 recipes'
    ``torch._scaled_grouped_mm`` (bf16, not emulated, no backward override) — the reason to keep
    it whole otherwise: the per-group loops read the splits on the host."""
    if len(args) < 2 or not isinstance(args[1], (list, tuple)):  # grouped_linear_fwd
        a = GroupedLinearArgs(*args, **kwargs)
        data = inp = a.inp
        m_splits, weight, quantised, backward = a.m_splits, a.weight, a.input_spec, a.backward
    else:  # grouped_linear_bwd(grad_out, saved, inp, m_splits, weight, ..., input_spec, ...)
        data, inp, m_splits, weight = args[0], args[2], args[3], args[4]
        quantised = args[9] if len(args) > 9 else kwargs.get("input_spec", "")
        backward = args[12] if len(args) > 12 else kwargs.get("backward", "")
    if not quantised:
        on_device = isinstance(inp, Tensor) and inp.device.type == "cuda"
        offsets = on_device and m_splits.device == inp.device and uses_grouped_mm(inp, weight)
        return None if offsets else HOST_SPLITS
    spec = parse(QuantSpec, quantised)
    offsets = (
        grouped_gemm_kind(spec.kind, spec.emulate) == "scaled_grouped_mm"
        and not parse(BackwardSpec, backward).override
        and data.device.type == "cuda"
        and data.dtype is torch.bfloat16
        and m_splits.device == data.device
    )
    return None if offsets else HOST_SPLITS


@op("grouped_linear_fwd", kept_whole=host_split_path)
def grouped_linear_fwd(
    inp: Tensor,
    m_splits: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None,
    input_spec: str = "",
    weight_spec: str = "",
    grad_spec: str = "",
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    rng_state: Tensor | None = None,
    backward: str = "",
    weight_q: list[Tensor] | None = None,
    wgrad_stash: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """``(out [M, out_features], saved)`` (module docstring); ``main_grad`` is only carried to the
    backward. CPU: fp32 math (fp64 stays fp64), the exact emulation of FP8 GEMMs."""
    a = GroupedLinearArgs(inp, m_splits, weight, bias, main_grad, input_spec, weight_spec,
                          grad_spec, scale, grad_amax, rng_state, backward, weight_q,
                          wgrad_stash)  # fmt: skip
    return _forward(a, cuda=False)


@grouped_linear_fwd.register_kernel("cuda")
def _grouped_linear_fwd_cuda(*args):
    return _forward(GroupedLinearArgs(*args), cuda=True)


# 3. Fake ------------------------------------------------------------------------------------


@grouped_linear_fwd.register_fake
def _grouped_linear_fwd_fake(*args):
    a = GroupedLinearArgs(*args)
    check_grouped_linear(a)
    inp = a.inp
    g, n, k = a.weight.shape
    u8, f32 = torch.uint8, torch.float32
    x, w, _ = a.specs
    kind = grouped_gemm_kind(x.kind, x.emulate)
    saved = []
    pre = a.weight_q is not None  # the weight's copies are inputs, not in saved
    if a.bw.override:  # the dequantised X and W, or nothing
        dequantized = a.bw.override == "dequantized"
        saved = [inp.new_empty(inp.shape), inp.new_empty(a.weight.shape)] if dequantized else []
    elif kind == "scaled_grouped_mm":
        saved = [] if pre else [inp.new_empty(g, k, n, dtype=u8), inp.new_empty(g, k, dtype=f32)]
        if a.bw.fp8_wgrad and not a.bw.save_input:
            cap = wgrad_capacity(inp.shape[0], g)
            saved += [inp.new_empty(k, cap, dtype=u8), inp.new_empty(g, k, dtype=f32)]
    elif kind == "blockwise":
        cap = 128 * (inp.shape[0] // 128 + g)
        w_rows = -(-k // w.block_rows)
        saved = [inp.new_empty(k * cap, dtype=u8), inp.new_empty(k * cap // 128, dtype=f32)]
        if not pre:
            saved += [inp.new_empty(k, n, dtype=u8) for _ in range(g)]
            saved += [inp.new_empty(w_rows, -(-n // 128), dtype=f32) for _ in range(g)]
    elif kind == "dequantized":
        dtype = nvfp4_dtype(inp) if x.kind == "nvfp4" else inp.dtype
        saved = [] if a.bw.save_input else [inp.new_empty(inp.shape, dtype=dtype)]
        if not pre:
            saved.append(a.weight.new_empty(a.weight.shape, dtype=dtype))
    if kind == "scaled_grouped_mm" and appends_amaxes(x.kind, a.grad_amax):
        saved.append(inp.new_empty(2, dtype=f32))
    return inp.new_empty(inp.shape[0], n), saved


# 4. Backward op -----------------------------------------------------------------------------


@op(
    "grouped_linear_bwd",
    mutates_args=("main_grad", "grad_amax", "wgrad_stash"),
    kept_whole=host_split_path,
)
def grouped_linear_bwd(
    grad_out: Tensor,
    saved: list[Tensor],
    inp: Tensor | None,
    m_splits: Tensor,
    weight: Tensor,
    main_grad: Tensor | None,
    scale: Tensor | None,
    grad_amax: Tensor | None,
    rng_state: Tensor | None,
    input_spec: str,
    weight_spec: str,
    grad_spec: str,
    backward: str,
    has_bias: bool,
    need_dgrad: bool,
    need_wgrad: bool,
    wgrad_stash: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dinp, dweight, dbias)``, 0-element where not computed or gone into ``main_grad``.
    ``saved``: the forward's without the amaxes; ``inp`` only where read (:func:`_for_backward`).
    Writes ``amax(dY)`` into ``grad_amax`` when given. ``wgrad_stash``: ``grad_out`` copied into
    it, the weight gradient not computed (``DeferredWgrad`` replays this op for it)."""
    args = (grad_out, saved, inp, m_splits, weight, main_grad, scale, grad_amax, rng_state,
            input_spec, weight_spec, grad_spec, backward, has_bias, need_dgrad, need_wgrad,
            wgrad_stash)  # fmt: skip
    return _backward_op(args, cuda=False)


def _bwd_args(args: tuple):
    """The 9 tensors, the parsed specs, ``(has_bias, need_dgrad, need_wgrad)`` and the stash of
    a backward call; a ``wgrad_stash`` takes the weight gradient's place (``need_wgrad`` False)."""
    stash = args[16] if len(args) > 16 else None
    need = (*args[13:15], args[15] and stash is None)  # has_bias, need_dgrad, need_wgrad
    return args[:9], as_specs(*args[9:12]), parse(BackwardSpec, args[12]), need, stash


def _backward_op(args: tuple, cuda: bool) -> tuple[Tensor, Tensor, Tensor]:
    tensors, specs, bw, need, stash = _bwd_args(args)
    grad_out, saved, inp, m_splits, weight, main_grad, scale, grad_amax, rng_state = tensors
    if stash is not None:
        stash.copy_(grad_out)
    r = make_grouped_recipe(specs, scale, grad_amax, bw, rng_state)
    _, backward = GROUPED_GEMMS[grouped_gemm_kind(r.x.kind, r.x.emulate)]
    if bw.save_input and backward is dequantized_backward:  # the kept input quantised again
        saved = [dequantized_input(inp, m_splits, r) if need[2] else inp, *saved]
    return backward(grad_out, saved, inp, m_splits, weight, main_grad, r, *need, cuda)


@grouped_linear_bwd.register_kernel("cuda")
def _grouped_linear_bwd_cuda(*args):
    return _backward_op(args, cuda=True)


@grouped_linear_bwd.register_fake
def _grouped_linear_bwd_fake(*args):
    (grad_out, _, inp, _, weight, main_grad, *_), (x, *_), bw, need, _ = _bwd_args(args)
    has_bias, need_dgrad, need_wgrad = need
    g, n, k = weight.shape
    if need_wgrad and x.kind in ("", *PER_TENSOR) and not bw.fp8_wgrad:
        torch._check(inp is not None, lambda: "te.grouped_linear_bwd: the wgrad needs inp")
    dinp = grad_out.new_empty(grad_out.shape[0], k) if need_dgrad else empty(grad_out)
    dweight = grad_out.new_empty(g, n, k) if need_wgrad and main_grad is None else empty(grad_out)
    dbias = grad_out.new_empty(g, n) if has_bias else empty(grad_out)
    return dinp, dweight, dbias


# 5. setup_context + autograd ------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    a = GroupedLinearArgs(*inputs)
    _out, saved = output
    ctx.mark_non_differentiable(*saved)
    tensors, ctx.scalars = _for_backward(a, saved)
    # main_grad and grad_amax (positions 3 and 5): written by the backward.
    save_for_backward_except_written(ctx, (*tensors, a.wgrad_stash), (3, 5))
    ctx.has_bias, ctx.overwrite = a.bias is not None, a.bw.overwrite_main_grad


def _for_backward(a: GroupedLinearArgs, saved: list[Tensor]) -> tuple[tuple, tuple]:
    """What the backward op takes from a forward call's ``saved`` (the tensors, then the
    strings), the amaxes left out. The input is read by a high-precision wgrad (the others read
    the forward's copies) and by a backward that quantises it again (``save_input``)."""
    x, bw = a.specs[0], a.bw
    if appends_amaxes(x.kind, a.grad_amax):
        saved = saved[:-1]
    if bw.override:  # high precision's backward on the high-precision or dequantised X and W
        inp, weight = saved if bw.override == "dequantized" else (a.inp, a.weight)
        return (inp, a.m_splits, weight, a.main_grad, None, None, None), ("", "", "", "")
    keeps_inp = not x.kind or bw.save_input or (x.kind in PER_TENSOR and not bw.fp8_wgrad)
    if a.weight_q is not None:  # the weight's copies for the backward are inputs
        _, _, data_t, scale_t, _ = a.weight_q
        kind = grouped_gemm_kind(x.kind, x.emulate)
        if kind == "scaled_grouped_mm":
            saved = [data_t, scale_t, *saved]
        elif kind == "blockwise":  # stacked: the backward reads them so
            saved = [*saved, data_t, scale_t]
        else:  # the dgrad copy (W along N) where given; else NVFP4's W (16x16 tiles: its own
            # dgrad copy), the others' 0-element: made from weight in the backward
            own = x.kind == "nvfp4" and not data_t.numel()
            saved = [*saved, a.weight_q[0 if own else 2]]
    tensors = (a.inp if keeps_inp else None, a.m_splits, a.weight, a.main_grad, a.scale,
               a.grad_amax, a.rng_state, *saved)  # fmt: skip
    return tensors, (a.input_spec, a.weight_spec, a.grad_spec, a.backward)


def _backward(ctx, bwd, grad_out, _grad_saved):
    inp, m_splits, weight, _, scale, _, rng_state, *saved, stash = ctx.saved_tensors
    main_grad, grad_amax = ctx.written
    need = ctx.needs_input_grad
    need_dgrad, need_wgrad = need[0], need[2]
    has_bias = ctx.has_bias and need[3]
    if need_wgrad and ctx.overwrite:  # (a deferred wgrad adds to the zeros)
        main_grad.zero_()
    dinp, dweight, dbias = bwd(
        grad_out.contiguous(), saved, inp, m_splits, weight, main_grad, scale, grad_amax,
        rng_state, *ctx.scalars, has_bias, need_dgrad, need_wgrad,
        *(() if stash is None else (stash,)))  # fmt: skip
    dweight = dweight if need_wgrad and main_grad is None and stash is None else None
    grads = (dinp if need_dgrad else None, None, dweight, dbias if has_bias else None)
    return grads + (None,) * (len(need) - 4)


_grouped_linear = differentiable(
    grouped_linear_fwd,
    grouped_linear_bwd,
    setup_context=_setup_context,
    backward=_backward,
    reference=_reference,
)


# Public function ------------------------------------------------------------------------------


def grouped_linear(
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    main_grad: Tensor | None = None,
    input_spec: str | QuantSpec = "",
    weight_spec: str | QuantSpec = "",
    grad_spec: str | QuantSpec = "",
    scale: Tensor | None = None,
    grad_amax: Tensor | None = None,
    rng_state: Tensor | None = None,
    fp8_wgrad: bool = False,
    return_amax: bool = False,
    delay_wgrad: bool = False,
    save_original_input: bool = False,
    weight_quantized: Sequence[Tensor] | None = None,
    backward_override: str = "",
    overwrite_main_grad: bool = False,
) -> Tensor | tuple[Tensor, ...]:
    """Rows of ``inp`` split into groups by ``m_splits``; group ``g`` gets
    ``inp_g @ weight[g].T + bias[g]`` through ``te::grouped_linear_fwd`` (module docstring; by
    default high precision). The arguments are :func:`~te_compile.functional.linear`'s, per
    expert: the specs (NVFP4's options apply to each expert's GEMMs; ``rng_state`` is one stream
    over the whole gradient; every group's token count a multiple of 16), ``scale``,
    ``grad_amax``, ``main_grad``, ``delay_wgrad``, ``backward_override`` and
    ``weight_quantized`` (:func:`~te_compile.functional.quantize_grouped_weight`'s five
    tensors). ``fp8_wgrad`` (per-tensor specs): the wgrad GEMM in FP8 too.
    ``save_original_input=True``: with ``fp8_wgrad`` the backward keeps ``inp`` itself rather
    than its FP8 copy and quantises it again (the same gradients); high precision and the
    high-precision wgrad keep ``inp`` anyway; other recipes raise. ``return_amax=True`` also
    returns ``[amax(inp), amax(weight)]`` (delayed scaling, or current scaling given
    ``grad_amax``; 0-element otherwise), after the ``DeferredWgrad``."""
    check_weight_quantized("te.grouped_linear", "weight_quantized", weight_quantized)
    check_gemm_tensors("te.grouped_linear", inp, weight, bias, main_grad)
    rows = inp.shape[0] if inp.dim() == 2 else None  # a 3-D inp: refused by the op's check
    args = (inp, checked_splits("te.grouped_linear", m_splits, rows), weight, bias, main_grad)
    specs = as_strings(input_spec, weight_spec, grad_spec)
    stash = None
    if delay_wgrad:
        DeferredWgrad.check("te.grouped_linear", delay_wgrad)
        rows = inp.shape[0] if inp.dim() else 0
        stash = inp.new_empty(rows, weight.shape[1] if weight.dim() == 3 else 0)
    if (
        any(specs) or scale is not None or grad_amax is not None or rng_state is not None
        or fp8_wgrad or stash is not None or save_original_input or weight_quantized is not None
        or backward_override or overwrite_main_grad is not False):  # fmt: skip
        flags = {"fp8_wgrad": fp8_wgrad, "save_original_input": save_original_input}
        check_bool("te.grouped_linear", **flags, overwrite_main_grad=overwrite_main_grad)
        check_overwrite("te.grouped_linear", overwrite_main_grad, main_grad)
        check_choice("te.grouped_linear", "backward_override", backward_override,
                     BACKWARD_OVERRIDES)  # fmt: skip
        check_tensors("te.grouped_linear", scale=scale, grad_amax=grad_amax)
        if rng_state is None and isinstance(specs[2], str) and "sr" in specs[2].split(":"):
            rng_state = new_rng_state(inp.device)
        backward = BackwardSpec(backward_override, save_original_input, fp8_wgrad,
                                overwrite_main_grad).encode()  # fmt: skip
        weight_q = None if weight_quantized is None else list(weight_quantized)
        args += (*specs, scale, grad_amax, rng_state, backward, weight_q, stash)
    out, saved = _grouped_linear(*args)
    if not (return_amax or stash is not None):
        return out
    check_bool("te.grouped_linear", return_amax=return_amax)
    result = (out,) if stash is None else (out, _deferred(args, saved))
    if return_amax:
        kind = specs[0].partition(":")[0] if isinstance(specs[0], str) else ""
        measured = appends_amaxes(kind, grad_amax)
        result += (saved[-1] if measured else inp.new_empty(0, dtype=torch.float32),)
    return result


def _deferred(args: tuple, saved: list[Tensor]) -> DeferredWgrad:
    a = GroupedLinearArgs(*args)
    tensors, scalars = _for_backward(a, saved)
    bwd = torch.ops.te.grouped_linear_bwd
    return DeferredWgrad.replaying(a.wgrad_stash, bwd, (), tensors, 7, scalars)
