r"""The MLP family: ``te::mlp_fwd`` / ``te::mlp_bwd``, every recipe, an optional norm prologue.

.. math::
    z = \mathrm{norm}(X) W_1^\top,\quad h = f(z + b_1),\quad Y = h W_2^\top + b_2

``inp`` ``[..., hidden]``, ``fc1_weight`` ``[F1, hidden]`` with ``F1 = 2 * ffn`` for a gated
activation (``GATED_ACTIVATIONS``, as LayerNormMLP lays them out: the activation half's rows first),
``fc2_weight`` ``[out, ffn]``. ``epilogue``: the activation as an ``EpilogueSpec`` string
(``functional.spec``: ``act`` with clamped SwiGLU's ``limit``, ``alpha``, ``offset``). The specs
(``input_spec``, ``weight_spec``, ``grad_spec``) and the prologue (``norm``, ``norm_weight``,
``norm_bias``) are the linear family's (``functional.linear_ops``), without NVFP4's options; per
GEMM: the delayed state (``scale1`` / ``scale2`` ``[3]``, ``grad_amax1`` / ``grad_amax2`` ``[1]``),
``te::linear``'s pre-quantised ``weight_q`` (``fc1_weight_q`` / ``fc2_weight_q``: ``saved`` then
holds no copy of that weight) and ``main_grad`` (``main_grad1`` / ``main_grad2``).

One op pair for the whole block, so that the activation and its gradient are never written in
high precision between two quantisations: on CUDA, for the per-tensor recipes and native
Float8BlockScaling, ``kernels.act_quantize`` computes :math:`h` from :math:`z` inside the
quantisation of the second GEMM's input, and :math:`dz = dh \odot f'(z + b_1)` (with
:math:`db_1`) inside the quantisation of the first GEMM's gradient: for ``z`` ``[T, F]``, a
write and two reads of :math:`h` and of :math:`dz` saved per step (a gated activation's halves
under one scale, or in 1x128 blocks that never straddle them). Elsewhere (the CPU, the emulated
recipes, high precision) the op composes the linear family's GEMMs (``functional.gemm``) and the
activation ops' implementations: the same bytes as ``linear -> bias_activation -> linear``
(compared bit for bit in the tests).

``saved``: quantised recipes ``[X^T, s_x, W_1^T, s_w1, z, h^T, s_h, W_2^T, s_w2]`` (FP8 bytes
and inverse scales as the linear family saves them; ``z`` with its rows padded to a multiple
of 16; native blockwise keeps the 1x128 scales of ``X^T`` and ``h^T`` as the wgrad GEMMs take
them, ``[M / 128, K]``), high precision ``[norm output (with a norm), z, h]``; then the norm's
``mean, rsigma``, then for the per-tensor recipes ``[amax(X), amax(W_1), amax(h),
amax(W_2)]`` (fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from te_compile._checks import (
    check_bool,
    check_choice,
    check_same_device,
    check_tensors,
    passed_once,
)
from te_compile._library import differentiable, op, use_fast_path
from te_compile.functional.activation import (
    GATED_ACTIVATIONS,
    activation_backward,
    activation_forward,
    activation_ref,
    fused_quantize_runs,
    gated_activation_ref,
)
from te_compile.functional.dense_weight import (
    check_weight_quantized,
    fake_copy,
    fp8_grad,
    refuse_fp8_weight_grad,
    weight_operand,
)
from te_compile.functional.family import (
    BwdArgs,
    check_gemm_args,
    check_gemm_tensors,
    save_for_backward_except_written,
)
from te_compile.functional.gemm import (
    PER_TENSOR,
    Operand,
    amax_buffer,
    empty,
    fp8_bytes,
    fp8_codes,
    gemm,
    gemm_kind,
    grad_amax_slots,
    hp_linear,
    hp_linear_backward,
    pad_rows,
    padded,
    quantize_operand,
    quantize_operands,
    scale_slots,
    unpad,
    wgrad_gemm,
)
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.functional.mlp_args import NORM_WEIGHT, MLPArgs, check_mlp
from te_compile.functional.prologue import (
    NORMALIZATIONS,
    Norm,
    fake_dnorm,
    fake_stats,
    norm_backward,
    norm_forward,
    norm_quantize,
    norm_ref,
)
from te_compile.functional.spec import (
    EpilogueSpec,
    NormSpec,
    QuantSpec,
    as_strings,
    backward_norm,
    eager_cached,
)

__all__ = ["mlp", "mlp_fast_path", "mlp_ref"]


# 1. Reference math ----------------------------------------------------------------------------


def mlp_ref(*args) -> Tensor:
    """Definition of correctness, differentiable, in the inputs' dtype (fp64 in the tests): the
    norm's reference, the recipe's GEMM (``functional.gemm_ref.quantized_linear_ref``) twice
    around the activation's reference."""
    a = MLPArgs(*args)
    x = norm_ref(a.inp, a.nrm)
    specs, ep = a.specs, a.ep
    z = quantized_linear_ref(x, a.fc1_weight, *specs, a.scale1)  # (a scale: delayed specs only)
    if ep.activation in GATED_ACTIVATIONS:
        h = gated_activation_ref(z, a.fc1_bias, ep.activation, *ep.params)
    else:
        h = activation_ref(z, a.fc1_bias, ep.activation)
    out = quantized_linear_ref(h, a.fc2_weight, *specs, a.scale2)
    return out if a.fc2_bias is None else out + a.fc2_bias


# 2. Forward op ----------------------------------------------------------------------------------


def _native_block(spec: QuantSpec) -> bool:
    return spec.kind == "block" and not spec.emulate


def _act_operand(spec: QuantSpec, z, bias, grad, ep: EpilogueSpec, scale, rows, need_dbias,
                 slot=None) -> tuple[Operand, Tensor | None]:  # fmt: skip
    """``(operand, dbias)``: the activation of ``z + bias`` (forward) or its gradient ``grad *
    f'(z + bias)`` (backward, ``dbias`` with ``need_dbias``) as the next GEMM's operand,
    quantised by ``spec``, rows past ``rows`` zero. On CUDA, for what ``fused_quantize_runs``
    admits, in the fused kernels (per-tensor, native 1x128 blocks with the scales in the GEMM's
    layout); elsewhere the activation op's implementation, rounded to ``z``'s dtype, zero rows
    appended, quantised. ``slot``: as ``gemm.quantize_operand``'s."""
    recipe, fp8_dtype, activation = spec.kind, spec.fp8_dtype, ep.activation
    fused = z.is_cuda and fused_quantize_runs(activation, ep.params[1:])  # no interleave here
    if fused and recipe in PER_TENSOR:
        from te_compile.kernels.act_quantize import act_quantize

        bits, i = slot if slot is not None else (None, 0)
        data, data_t, s, amax, dbias = act_quantize(
            z, bias, grad, activation, fp8_dtype, scale, rows, True, need_dbias, amax=bits, slot=i
        )
        return Operand(data, s, data_t, s, amax), dbias
    if fused and _native_block(spec):
        from te_compile.kernels.act_quantize import act_quantize_block

        data, s, data_t, s_t, dbias = act_quantize_block(
            z, bias, grad, activation, fp8_dtype, rows, need_dbias, spec.power_2_scale,
            mn_major=(True, True))  # fmt: skip
        return Operand(data, s, data_t, s_t, z.new_empty(0, dtype=torch.float32)), dbias
    if grad is None:
        v, dbias = activation_forward(z[:rows], bias, activation, *ep.params), None
    else:
        v, dbias = activation_backward(grad[:rows], z[:rows], bias, activation, *ep.params,
                                       need_dbias=need_dbias)  # fmt: skip
    operand = quantize_operand(spec, pad_rows(v), scale=scale, slot=slot)
    return operand, dbias if need_dbias else None


def _saved_scale(spec: QuantSpec, s_t: Tensor) -> Tensor:
    """Native blockwise keeps the 1x128 scales of a transposed copy as the wgrad GEMM takes
    them, ``[M / 128, K]`` (no copy when the kernels wrote them rows-major)."""
    return s_t.t().contiguous() if _native_block(spec) else s_t


@op("mlp_fwd")
def mlp_fwd(
    inp: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    epilogue: str,
    input_spec: str = "",
    weight_spec: str = "",
    grad_spec: str = "",
    scale1: Tensor | None = None,
    scale2: Tensor | None = None,
    grad_amax1: Tensor | None = None,
    grad_amax2: Tensor | None = None,
    norm: str = "",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    fc1_weight_q: list[Tensor] | None = None,
    fc2_weight_q: list[Tensor] | None = None,
    main_grad1: Tensor | None = None,
    main_grad2: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """``(out, saved)`` (module docstring)."""
    a = MLPArgs(inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, epilogue, input_spec, weight_spec,
                grad_spec, scale1, scale2, grad_amax1, grad_amax2, norm, norm_weight, norm_bias,
                fc1_weight_q, fc2_weight_q, main_grad1, main_grad2)  # fmt: skip
    check_mlp(a)
    inp, w1, b1, w2, b2 = a.inp, a.fc1_weight, a.fc1_bias, a.fc2_weight, a.fc2_bias
    x2 = inp.reshape(-1, inp.shape[-1])
    xs, ws, _ = a.specs
    m, dtype, recipe, ep, norm = x2.shape[0], inp.dtype, xs.kind, a.ep, a.nrm
    stats, saved = [], []
    if not recipe:
        if norm.normalization:
            x2, *stats = norm_forward(x2, norm)
            saved.append(x2)
        z = hp_linear(x2, w1, None, x2.is_cuda)
        h = activation_forward(z, b1, ep.activation, *ep.params)
        out = hp_linear(h, w2, b2, x2.is_cuda)
        return out.reshape(*inp.shape[:-1], w2.shape[0]), [*saved, z, h, *stats]
    kind, rows = gemm_kind(recipe, xs.emulate), ws.block_rows
    (s_x, s_w1), (s_h, s_w2) = (scale_slots(s, recipe, 0, 1) for s in (a.scale1, a.scale2))
    q1, q2 = a.fc1_weight_q, a.fc2_weight_q  # pre-quantised: setup_context saves their copies
    # The four amaxes (X, W1, h, W2) in one buffer (pre-quantised weights have their own).
    shared = q1 is None and q2 is None
    bits, (a_x, a_w1, a_h, a_w2) = amax_buffer(recipe, x2, 4, shared=shared)
    if norm.normalization:
        xq, *stats = norm_quantize(xs, x2, norm, scale=s_x, mn_major=_native_block(xs), slot=a_x)
    else:
        xq = quantize_operand(xs, pad_rows(x2), scale=s_x, slot=a_x)
    if shared:  # both weights' casts in one launch where they can be
        w1q, w2q = quantize_operands((ws, ws), (w1, w2), (s_w1, s_w2), (a_w1, a_w2))
    else:
        w1q, w2q = weight_operand(q1, ws, w1, s_w1, a_w1), weight_operand(q2, ws, w2, s_w2, a_w2)
    z = gemm(kind, xq.data, xq.scale, w1q.data, w1q.scale, dtype, fast_accum=True,
             b_block_rows=rows)  # fmt: skip
    hq, _ = _act_operand(xs, z, b1, None, ep, s_h, m, False, a_h)
    out = unpad(gemm(kind, hq.data, hq.scale, w2q.data, w2q.scale, dtype, bias=b2, fast_accum=True,
                     b_block_rows=rows), m)  # fmt: skip
    w1_copy = [] if q1 is not None else [fp8_bytes(w1q.data_t), w1q.scale_t]
    w2_copy = [] if q2 is not None else [fp8_bytes(w2q.data_t), w2q.scale_t]
    saved = [
        fp8_bytes(xq.data_t), _saved_scale(xs, xq.scale_t), *w1_copy, z,
        fp8_bytes(hq.data_t), _saved_scale(xs, hq.scale_t), *w2_copy, *stats]  # fmt: skip
    if bits is not None:
        saved.append(bits)
    elif recipe in PER_TENSOR:
        saved.append(torch.cat([xq.amax, w1q.amax, hq.amax, w2q.amax]))
    return out.reshape(*inp.shape[:-1], w2.shape[0]), saved


@mlp_fwd.register_fake
def _mlp_fwd_fake(*args):
    a = MLPArgs(*args)
    check_mlp(a)
    inp, (f1, d), (n, f) = a.inp, a.fc1_weight.shape, a.fc2_weight.shape
    rows = inp.numel() // inp.shape[-1]
    out = inp.new_empty(*inp.shape[:-1], n)
    normalization = a.nrm.normalization
    stats = fake_stats(inp, rows, normalization)
    xs, ws, _ = a.specs
    if not xs.kind:
        normed = [inp.new_empty(rows, d)] if normalization else []
        return out, [*normed, inp.new_empty(rows, f1), inp.new_empty(rows, f), *stats]
    m = padded(rows)

    def copy(n, k):  # an activation's transposed copy [k, n] (native blockwise: scales [n/128, k])
        data, s = fake_copy(inp, xs.kind, n, k, 1, xs.emulate)
        return [data, s.new_empty(s.shape[::-1]) if _native_block(xs) else s]

    def weight_copy(n, k, q):  # a pre-quantised weight's copy is its input's (setup_context)
        return [] if q is not None else fake_copy(inp, xs.kind, n, k, ws.block_rows, xs.emulate)

    saved = [*copy(m, d), *weight_copy(f1, d, a.fc1_weight_q), inp.new_empty(m, f1), *copy(m, f),
             *weight_copy(n, f, a.fc2_weight_q), *stats]  # fmt: skip
    if xs.kind in PER_TENSOR:
        saved.append(inp.new_empty(4, dtype=torch.float32))
    return out, saved


# 3. Backward op ---------------------------------------------------------------------------------


@op("mlp_bwd", mutates_args=("grad_amax1", "grad_amax2", "main_grad1", "main_grad2"))
def mlp_bwd(
    grad: Tensor,
    saved: list[Tensor],
    inp: Tensor | None,
    fc1_weight: Tensor | None,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor | None,
    scale1: Tensor | None,
    scale2: Tensor | None,
    grad_amax1: Tensor | None,
    grad_amax2: Tensor | None,
    main_grad1: Tensor | None,
    main_grad2: Tensor | None,
    norm_weight: Tensor | None,
    input_spec: str,
    weight_spec: str,
    grad_spec: str,
    norm: str,
    epilogue: str,
    need_db2: bool,
    need_dgrad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dinp, dfc1_weight, dfc1_bias, dfc2_weight, dfc2_bias, dnorm_weight, dnorm_bias)``
    (0-element where not computed); writes ``amax(dz)`` / ``amax(dY)`` into ``grad_amax1`` /
    ``grad_amax2`` (per-tensor recipes); ``dfc1_weight`` / ``dfc2_weight`` are added into
    ``main_grad1`` / ``main_grad2`` where given. ``inp``: with a norm or in high precision;
    ``fc1_weight`` / ``fc2_weight``: in high precision; the strings are the forward's, ``norm``
    with ``bias`` where the norm has one. ``need_dgrad``: any of the input and the norm's
    parameters needs a gradient."""
    c = BwdArgs.of(input_spec, weight_spec, grad_spec, norm, epilogue, need_db2, need_dgrad)
    w1, b1, w2 = fc1_weight, fc1_bias, fc2_weight
    dtype = grad.dtype
    dy = grad.reshape(-1, grad.shape[-1])
    m = dy.shape[0]
    ep, normalization, recipe = c.ep, c.norm.normalization, c.x.kind
    n_stats = 2 if normalization else 0
    stats = saved[len(saved) - n_stats :]
    need_db1 = b1 is not None
    if not recipe:
        z, h = saved[-2 - n_stats], saved[-1 - n_stats]
        x2 = saved[0] if normalization else inp.reshape(-1, inp.shape[-1])
        dh, dw2, db2 = hp_linear_backward(dy, h, w2, main_grad2, c.need_dbias, True, True,
                                          dy.is_cuda)  # fmt: skip
        dz, db1 = activation_backward(dh, z, b1, ep.activation, *ep.params, need_dbias=need_db1)
        dinp, dw1, _ = hp_linear_backward(dz, x2, w1, main_grad1, False, c.need_dgrad, True,
                                          dz.is_cuda)  # fmt: skip
    else:
        x_t, xs, w1_t, w1s, z, h_t, hs, w2_t, w2s = saved[:9]
        x_t, h_t = fp8_codes(x_t, c.x.fp8_dtype), fp8_codes(h_t, c.x.fp8_dtype)
        w1_t, w2_t = fp8_codes(w1_t, c.w.fp8_dtype), fp8_codes(w2_t, c.w.fp8_dtype)
        if _native_block(c.x):  # the 1x128 scales as the wgrad GEMM takes them (_saved_scale)
            xs, hs = xs.t(), hs.t()
        kind, rows = gemm_kind(recipe, c.x.emulate), c.w.block_rows
        (s_dz,), (s_dy,) = scale_slots(scale1, recipe, 2), scale_slots(scale2, recipe, 2)
        sums = c.need_dbias and _native_block(c.x)
        a_dz, a_dy = grad_amax_slots(recipe, dy, grad_amax1, grad_amax2)
        g = quantize_operand(c.g, pad_rows(dy), scale=s_dy, mn_major=True, sums=sums, slot=a_dy)
        if grad_amax2 is not None and a_dy is None:
            grad_amax2.copy_(g.amax)
        # fc2: dh [M, F] = dY @ W2 (W2^T is the GEMM's b); dW2 [N, F] = dY^T @ h
        fast_d, fast_w = c.g.fast_dgrad, c.g.fast_wgrad
        dh = gemm(kind, g.data, g.scale, w2_t, w2s, dtype, fast_accum=fast_d, b_block_rows=rows)
        dw2 = wgrad_gemm(kind, g.data_t, g.scale_t, h_t, hs, dtype, main_grad2, fast_w)
        acc = None if dy.is_cuda else torch.float32  # CUDA: fp32 accumulation, one launch
        db2 = g.sums if sums else (dy.sum(0, dtype=acc) if c.need_dbias else None)
        dq, db1 = _act_operand(c.g, z, b1, dh, ep, s_dz, m, need_db1, a_dz)
        if grad_amax1 is not None and a_dz is None:
            grad_amax1.copy_(dq.amax)
        # fc1: dX [M, D] = dz @ W1; dW1 [F1, D] = dz^T @ X
        dinp = None
        if c.need_dgrad:
            dinp = unpad(gemm(kind, dq.data, dq.scale, w1_t, w1s, dtype, fast_accum=fast_d,
                              b_block_rows=rows), m)  # fmt: skip
        dw1 = wgrad_gemm(kind, dq.data_t, dq.scale_t, x_t, xs, dtype, main_grad1, fast_w)
    dnorm = [None, None]  # None: a 0-element output, made at the end
    if c.need_dgrad and normalization:
        dinp, *dnorm = norm_backward(dinp, inp, norm_weight, stats, c.norm)
    dinp = dinp.reshape(*grad.shape[:-1], dinp.shape[-1]) if c.need_dgrad else None
    db1 = None if db1 is None else db1.to(dtype)
    db2 = None if db2 is None or not c.need_dbias else db2.to(dtype)
    return tuple(empty(grad) if t is None else t for t in (dinp, dw1, db1, dw2, db2, *dnorm))


@mlp_bwd.register_fake
def _mlp_bwd_fake(*args):
    grad, saved, _inp, w1, b1, w2, *_, mg1, mg2, norm_weight = args[:13]
    c = BwdArgs.of(*args[13:])
    if c.x.kind:
        (d, f1), (f, n) = saved[2].shape, saved[7].shape
    else:
        (f1, d), (n, f) = w1.shape, w2.shape
    dinp = grad.new_empty(*grad.shape[:-1], d) if c.need_dgrad else empty(grad)
    db1 = grad.new_empty(f1) if b1 is not None else empty(grad)
    db2 = grad.new_empty(n) if c.need_dbias else empty(grad)
    dnorm = fake_dnorm(grad, norm_weight, c.norm.normalization, c.norm.bias, c.need_dgrad)
    dw1 = grad.new_empty(f1, d) if mg1 is None else empty(grad)
    dw2 = grad.new_empty(n, f) if mg2 is None else empty(grad)
    return dinp, dw1, db1, dw2, db2, *dnorm


# 4. setup_context + autograd ----------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    a = MLPArgs(*inputs)
    _out, saved = output
    ctx.mark_non_differentiable(*saved)
    recipe, q1, q2 = a.specs[0].kind, a.fc1_weight_q, a.fc2_weight_q
    saved = list(saved[:-1] if recipe in PER_TENSOR else saved)  # the amaxes: for the caller
    if q1 is not None:  # a pre-quantised weight: its transposed copy is an input
        saved[2:2] = [q1[2], q1[3]]
    if q2 is not None:
        saved[7:7] = [q2[2], q2[3]]
    hp, normed = not recipe, bool(a.nrm.normalization)
    tensors = (
        a.inp if hp or normed else None, a.fc1_weight if hp else None, a.fc1_bias,
        a.fc2_weight if hp else None, a.scale1, a.scale2, a.grad_amax1, a.grad_amax2,
        a.main_grad1, a.main_grad2, a.norm_weight if normed else None, *saved)  # fmt: skip
    # The gradient amax and main_grad buffers (positions 6 to 9): written by the backward.
    save_for_backward_except_written(ctx, tensors, (6, 7, 8, 9))
    norm = backward_norm(a.norm, normed and a.norm_bias is not None)
    ctx.scalars = (a.input_spec, a.weight_spec, a.grad_spec, norm, a.epilogue)
    ctx.has_fc2_bias, ctx.has_norm, ctx.has_norm_bias = (
        a.fc2_bias is not None, normed, a.norm_bias is not None)  # fmt: skip
    # FP8 weights (FP8 primary weights) without a main_grad: their gradient has nowhere to go.
    pairs = ((a.fc1_weight, a.main_grad1), (a.fc2_weight, a.main_grad2))
    ctx.fp8_weights = tuple(g is None and fp8_grad(w) for w, g in pairs)


def _backward(ctx, bwd, grad, _grad_saved):
    inp, w1, b1, w2, s1, s2, _, _, _, _, norm_weight, *saved = ctx.saved_tensors
    ga1, ga2, mg1, mg2 = ctx.written
    need = ctx.needs_input_grad
    need_norm = ctx.has_norm and any(need[NORM_WEIGHT : NORM_WEIGHT + 2])
    need_db2 = ctx.has_fc2_bias and need[4]
    for i, fp8_weight in enumerate(ctx.fp8_weights, 1):
        if fp8_weight and need[2 * i - 1]:
            refuse_fp8_weight_grad("te.mlp", f"fc{i}_weight", f"main_grad{i}")
    mg1, mg2 = mg1 if need[1] else None, mg2 if need[3] else None  # (as te::linear's)
    dinp, dw1, db1, dw2, db2, dnw, dnb = bwd(
        grad.contiguous(), saved, inp, w1, b1, w2, s1, s2, ga1, ga2, mg1, mg2, norm_weight,
        *ctx.scalars, need_db2, need[0] or need_norm)  # fmt: skip
    grads = [None] * len(need)
    grads[:5] = [
        dinp if need[0] else None,
        dw1 if need[1] and mg1 is None else None,
        db1 if b1 is not None and need[2] else None,
        dw2 if need[3] and mg2 is None else None,
        db2 if need_db2 else None,
    ]
    if need_norm:  # (a call passes no trailing argument left at its default)
        grads[NORM_WEIGHT] = dnw if need[NORM_WEIGHT] else None
        if ctx.has_norm_bias and need[NORM_WEIGHT + 1]:
            grads[NORM_WEIGHT + 1] = dnb
    return tuple(grads)


_mlp = differentiable(
    mlp_fwd, mlp_bwd, setup_context=_setup_context, backward=_backward, reference=mlp_ref
)


# The argument names of each GEMM's weight, bias and main_grad (family.check_gemm_tensors).
_GEMM_NAMES = tuple((f"fc{i}_weight", f"fc{i}_bias", f"main_grad{i}") for i in (1, 2))
_OPTIONAL = ("scale1", "scale2", "grad_amax1", "grad_amax2", "norm_weight", "norm_bias")


def _check_tensors(inp, w1, b1, w2, b2, mg1, mg2, *optional) -> None:
    """:func:`mlp`'s checks of its tensor arguments (``optional``: as :data:`_OPTIONAL`)."""
    check_gemm_tensors("te.mlp", inp, w1, b1, mg1, _GEMM_NAMES[0])
    check_gemm_tensors("te.mlp", inp, w2, b2, mg2, _GEMM_NAMES[1])
    if any(t is not None for t in optional):
        check_tensors("te.mlp", **dict(zip(_OPTIONAL, optional, strict=True)))
        check_same_device("te.mlp", "inp", inp, norm_weight=optional[4], norm_bias=optional[5])


@eager_cached(1024, typed=True)
def _scalar_specs(normalization, norm_eps, zero_centered_gamma, activation, limit, alpha,
                  glu_linear_offset) -> tuple[str, str]:  # fmt: skip
    """:func:`mlp`'s scalar arguments checked (each error names its argument) and encoded: the
    ``norm`` and ``epilogue`` strings of ``te::mlp_fwd``. They depend on the values alone (and
    their types), so an eager call computes them once."""
    check_bool("te.mlp", zero_centered_gamma=zero_centered_gamma)
    check_gemm_args(
        "te.mlp", norm_eps=norm_eps, limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset
    )
    check_choice("te.mlp", "normalization", normalization, ("", *NORMALIZATIONS))
    norm = NormSpec(normalization, float(norm_eps), zero_centered_gamma) if normalization else None
    epilogue = EpilogueSpec(activation, 0, float(limit), float(alpha), float(glu_linear_offset))
    return norm.encode() if norm else "", epilogue.encode()


def mlp(
    inp: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    activation: str = "gelu",
    *,
    input_spec: str | QuantSpec = "",
    weight_spec: str | QuantSpec = "",
    grad_spec: str | QuantSpec = "",
    scale1: Tensor | None = None,
    scale2: Tensor | None = None,
    grad_amax1: Tensor | None = None,
    grad_amax2: Tensor | None = None,
    normalization: str = "",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    norm_eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    return_amax: bool = False,
    fc1_weight_quantized: Sequence[Tensor] | None = None,
    fc2_weight_quantized: Sequence[Tensor] | None = None,
    main_grad1: Tensor | None = None,
    main_grad2: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``activation(norm(inp) @ fc1_weight.T + fc1_bias) @ fc2_weight.T + fc2_bias`` through
    ``te::mlp_fwd`` (module docstring). The arguments are :func:`~te_compile.functional.linear`'s,
    per GEMM where they are per GEMM (``scale1`` / ``scale2``, ``grad_amax1`` / ``grad_amax2``,
    ``fc1_weight_quantized`` / ``fc2_weight_quantized``, ``main_grad1`` / ``main_grad2``); the
    activation is quantised as an input, its gradient as a gradient; ``limit`` / ``alpha`` /
    ``glu_linear_offset`` are ``clamped_swiglu``'s. ``return_amax=True`` also returns ``[amax(X),
    amax(fc1_weight), amax(h), amax(fc2_weight)]`` (per-tensor recipes; 0-element otherwise)."""
    check_weight_quantized("te.mlp", "fc1_weight_quantized", fc1_weight_quantized)
    check_weight_quantized("te.mlp", "fc2_weight_quantized", fc2_weight_quantized)
    check_bool("te.mlp", return_amax=return_amax)
    _check_tensors(inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, main_grad1, main_grad2,
                   scale1, scale2, grad_amax1, grad_amax2, norm_weight, norm_bias)  # fmt: skip
    norm, epilogue = _scalar_specs(normalization, norm_eps, zero_centered_gamma, activation, limit,
                                   alpha, glu_linear_offset)  # fmt: skip
    specs = as_strings(input_spec, weight_spec, grad_spec)
    out, saved = _mlp(
        inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, epilogue, *specs, scale1, scale2,
        grad_amax1, grad_amax2, norm, norm_weight, norm_bias,
        None if fc1_weight_quantized is None else list(fc1_weight_quantized),
        None if fc2_weight_quantized is None else list(fc2_weight_quantized), main_grad1,
        main_grad2)  # fmt: skip
    if not return_amax:
        return out
    per_tensor = specs[0].startswith(PER_TENSOR)  # (a str: the op took it)
    return out, saved[-1] if per_tensor else inp.new_empty(0, dtype=torch.float32)


# Eager fast path ------------------------------------------------------------------------------


class _FastMLP(torch.autograd.Function):
    """``te::mlp`` in high precision or under a per-tensor recipe, without pre-quantised
    weights, eager: the op's own implementations (``mlp_fwd.eager`` / ``mlp_bwd.eager``: the same
    calls, the same bits) in an autograd node of their own, without the op's argument checks per
    call, its generic autograd glue and the encoding of its arguments (:func:`mlp_fast_path`)."""

    @staticmethod
    def forward(ctx, inp, w1, b1, w2, b2, scale1, scale2, norm_weight, norm_bias, strings,
                written):  # fmt: skip
        (x, w, g, norm, epilogue, bwd_norm), (ga1, ga2, mg1, mg2) = strings, written
        out, saved = mlp_fwd.eager(inp, w1, b1, w2, b2, epilogue, x, w, g, scale1, scale2,
                                   ga1, ga2, norm, norm_weight, norm_bias, None, None, mg1,
                                   mg2)  # fmt: skip
        amax = saved.pop() if x else inp.new_empty(0, dtype=torch.float32)
        hp = not x  # high precision: the backward's GEMMs read the input and the weights
        kept = (inp if hp or norm else None, w1 if hp else None, w2 if hp else None,
                norm_weight if norm else None)  # fmt: skip
        ctx.save_for_backward(*kept, b1, scale1, scale2, *saved)
        ctx.te = (x, w, g, bwd_norm, epilogue), written, b2 is not None
        ctx.mark_non_differentiable(amax)
        ctx.set_materialize_grads(False)  # (the amax gets no gradient)
        return out, amax

    @staticmethod
    def backward(ctx, grad, _):
        inp, w1, w2, norm_weight, b1, s1, s2, *saved = ctx.saved_tensors  # (read once)
        strings, (ga1, ga2, mg1, mg2), has_b2 = ctx.te
        need = ctx.needs_input_grad
        need_norm = norm_weight is not None and any(need[7:9])
        mg1, mg2 = mg1 if need[1] else None, mg2 if need[3] else None  # (as _backward's)
        dinp, dw1, db1, dw2, db2, dnw, dnb = mlp_bwd.eager(
            grad.contiguous(), saved, inp, w1, b1, w2, s1, s2, ga1, ga2, mg1, mg2,
            norm_weight, *strings, has_b2 and need[4], need[0] or need_norm)  # fmt: skip
        return (dinp if need[0] else None, dw1 if need[1] and mg1 is None else None,
                db1 if b1 is not None and need[2] else None,
                dw2 if need[3] and mg2 is None else None, db2 if has_b2 and need[4] else None,
                None, None, dnw if need_norm and need[7] else None,
                dnb if need_norm and need[8] else None, None, None)  # fmt: skip


@eager_cached(1024)
def _strings(specs: tuple, norm: str, epilogue: str, norm_bias: bool) -> tuple[str, ...]:
    """The op's spec strings, then ``norm`` and ``epilogue``, then the backward's ``norm``
    (``bias`` set where the norm has one, as ``_setup_context`` encodes it)."""
    return (*as_strings(*specs), norm, epilogue, backward_norm(norm, bool(norm) and norm_bias))


@passed_once
def _check_fast(args: tuple) -> None:
    """:func:`mlp`'s checks of a :func:`mlp_fast_path` call, once per kind of call (the op's
    own, ``check_mlp``, run in ``mlp_fwd``)."""
    _check_tensors(*args)


def mlp_fast_path(
    inp: Tensor,
    fc1_weight: Tensor,
    fc1_bias: Tensor | None,
    fc2_weight: Tensor,
    fc2_bias: Tensor | None,
    activation: str,
    specs: tuple[QuantSpec, QuantSpec, QuantSpec],
    scales: tuple[Tensor | None, Tensor | None],
    grad_amaxes: tuple[Tensor | None, Tensor | None],
    main_grads: tuple[Tensor | None, Tensor | None] = (None, None),
    norm: Norm | None = None,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
) -> tuple[Tensor, Tensor] | None:
    """``(out, amaxes)`` of ``mlp(inp, ..., input_spec=..., scale1=..., ..., return_amax=True)``
    under the per-tensor or high-precision ``specs`` (``scales``, ``grad_amaxes``,
    ``main_grads``: per GEMM; ``norm``: the prologue, ``prologue.Norm``; in high precision the
    amaxes 0-element), the same bits and errors, through the eager fast path
    (``_library.use_fast_path``: eager, nothing watching; no ``torch.autocast``) without the
    op's layers: te.LayerNormMLP's hot path. None where it does not apply (the caller then calls
    :func:`mlp`). The checks run once per set of shapes, dtypes, devices and arguments."""
    if not use_fast_path() or torch._C._is_any_autocast_enabled():
        return None
    nw, nb, *scalars = norm if norm is not None else (None, None, "", 1e-5, False)
    norm_text, epilogue = _scalar_specs(*scalars, activation, limit, alpha, glu_linear_offset)
    strings = _strings(tuple(specs), norm_text, epilogue, nb is not None)
    args = (inp, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *scales, nw, nb)
    written = (*grad_amaxes, *main_grads)
    _check_fast((*args[:5], *main_grads, *scales, *grad_amaxes, nw, nb))
    return _FastMLP.apply(*args, strings, written)
