r"""Triton kernels for the activation family (``te_compile.functional.activation``).

Every kernel loads its inputs once, computes in fp32 registers and rounds once on store.

Functions (``FN_*``; a gated activation applies one of them to its activation half):

.. math::
    \mathrm{gelu}(x) = \tfrac12 x\,(1 + \tanh u) = x\,\sigma(2u),
        \quad u = \sqrt{2/\pi}\,(x + 0.044715\,x^3)

    \mathrm{qgelu}(x) = x\,\sigma(1.702\,x), \quad \mathrm{silu}(x) = x\,\sigma(x),
    \quad \mathrm{relu}(x) = \max(x, 0), \quad \mathrm{srelu}(x) = \max(x, 0)^2

    \mathrm{clamped\_silu}(x) = c\,\sigma(\alpha c), \quad c = \min(x, \mathrm{limit}),
    \quad \mathrm{situ}(x) = \beta_1 \tanh(x/\beta_1)\,\sigma(x)

(``situ``'s :math:`\beta_1` arrives in the ``limit`` argument, :math:`\beta_2` in ``alpha``;
``tanh`` is evaluated as :math:`2\sigma(2x) - 1` on the same ``exp2`` path as the sigmoid.)

(gelu is evaluated through the identity :math:`\tfrac12(1 + \tanh u) = \sigma(2u)`: one ``exp``,
no ``tanh`` instruction needed, and it saturates cleanly for large :math:`|x|`.)

Kernels and layouts (all tensors contiguous, the caller flattens leading dims to rows):

* ``_flat_fwd_kernel`` / ``_flat_bwd_kernel``: element-wise without bias, over the flattened
  tensor with a 1-D grid of ``BLOCK``-element programs: ``y = f(x)``, ``dx = dy * f'(x)``.
* ``_rows_fwd_kernel`` / ``_rows_bwd_kernel``: a 2-D grid of ``[BLOCK_M, BLOCK_N]`` output tiles,
  for the element-wise activations with a bias (``y = f(x + b)``, bias ``[N]``) and for all gated
  activations. A gated input is ``[M, 2H]``, its output ``[M, H]``; output column ``j`` reads the
  activation column :math:`a(j) = \lfloor j/K \rfloor\,2K + (j \bmod K)` and the linear column
  :math:`a(j) + K`, where ``K`` is the GLU interleave size (blocks of K activation columns, then
  K linear columns). Contiguous halves are the special case ``K = H`` (:math:`a(j) = j`, linear
  column :math:`j + H`), so one kernel serves both layouts. The bias is ``[2H]``, laid out like
  the input columns. ``y = f(a) \cdot l``; for clamped SwiGLU ``l`` is first clamped to
  ``[-limit, limit]`` and ``glu_linear_offset`` is added; for SiTU-GLU it is soft-capped to
  :math:`\beta_2 \tanh(l/\beta_2)`.
* dbias is a two-stage reduction: the backward kernel's program ``p`` walks ``rows_per_program``
  rows and writes the fp32 column sums of ``dx`` it computed into row ``p`` of a
  ``[num_row_programs, N]`` buffer; a ``sum(0)`` over that small buffer finishes it. No atomics,
  so the result is deterministic.

Backward: ``da = dy * l * f'(a)`` and ``dl = dy * f(a)`` (times the clamp's mask for clamped
SwiGLU, times :math:`1 - \tanh^2(l/\beta_2)` for SiTU-GLU). Clamp derivatives follow
``torch.clamp``: the gradient passes where ``min <= x <= max``, inclusive.

The kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (the tests do, at small sizes).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from te_compile.kernels import cdiv, dense, launch, next_pow2, programs_per_sm, size_hint

__all__ = [
    "ALL_FUNCTIONS",
    "ALL_GATED",
    "FUNCTION_OF",
    "GATED",
    "FlatConfig",
    "RowsConfig",
    "activation_backward",
    "activation_forward",
    "flat_config",
    "rows_config",
]

FN_GELU = tl.constexpr(0)
FN_QGELU = tl.constexpr(1)
FN_RELU = tl.constexpr(2)
FN_SRELU = tl.constexpr(3)
FN_SILU = tl.constexpr(4)
FN_SIGMOID = tl.constexpr(5)
FN_CLAMPED_SILU = tl.constexpr(6)
FN_SITU = tl.constexpr(7)

# Public activation name -> device function applied to the input (element-wise) or to the
# activation half (gated).
FUNCTION_OF: dict[str, int] = {
    "gelu": FN_GELU.value,
    "qgelu": FN_QGELU.value,
    "relu": FN_RELU.value,
    "srelu": FN_SRELU.value,
    "silu": FN_SILU.value,
    "glu": FN_SIGMOID.value,
    "geglu": FN_GELU.value,
    "qgeglu": FN_QGELU.value,
    "reglu": FN_RELU.value,
    "sreglu": FN_SRELU.value,
    "swiglu": FN_SILU.value,
    "clamped_swiglu": FN_CLAMPED_SILU.value,
}
GATED = frozenset({"glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"})
# Every name these kernels run. ``FUNCTION_OF`` / ``GATED`` list the ones ``kernels.act_quantize``
# also runs (it applies clamped SwiGLU's default parameters as literals and has no SiTU-GLU up
# branch), so it refuses a name outside them rather than computing it wrong.
ALL_FUNCTIONS = {**FUNCTION_OF, "situglu": FN_SITU.value}
ALL_GATED = GATED | {"situglu"}


# Device functions ----------------------------------------------------------------------------


# On the GPU the sigmoid is two MUFU instructions with flush-to-zero (``ex2.approx.ftz``,
# ``rcp.approx.ftz``): the default ``exp`` and ``/`` of Triton lower to the same approximations
# wrapped in denormal range fix-ups, about eight more instructions an element, and the
# activation-quantise kernels (``kernels.act_quantize``) are bound by instruction issue, not
# memory (bench/results/2026-11-22_h100/sass_quantize.md). The fix-ups only matter where the
# result is a denormal: never here (the reciprocal's argument is at least 1, an ``exp2`` that
# small leaves ``1 + e == 1``). The interpreter (CPU) has no PTX: the portable form there.
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.version.hip is None)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2_neg_recip(t):
    """``1 / (1 + 2^t)`` in fp32; ``2^t`` overflows to inf for ``t > 128``: ``1 / inf = 0``, the
    right limit, no NaN."""
    if _PTX:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=f,f", [t], dtype=tl.float32, is_pure=True, pack=1
        )
        r = tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;",
            "=f,f",
            [1.0 + e],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        r = 1.0 / (1.0 + tl.exp2(t))
    return r


@triton.jit
def _sigmoid(x):
    return _exp2_neg_recip(x * -_LOG2E)


@triton.jit
def _gelu_sigmoid(x):
    """``sigmoid(2u)`` of gelu, ``2u = 2 sqrt(2/pi) (x + 0.044715 x^3)``, with the constants
    folded into the exponent: ``2^(x (k0 + k1 x^2))``."""
    K0: tl.constexpr = -1.5957691216057308 * 1.4426950408889634
    K1: tl.constexpr = -1.5957691216057308 * 1.4426950408889634 * 0.044715
    return _exp2_neg_recip(x * (K0 + K1 * (x * x)))


@triton.jit
def _tanh(x):
    """``tanh(x) = 2 sigmoid(2x) - 1``, saturating to +-1 without NaN."""
    return 2.0 * _sigmoid(2.0 * x) - 1.0


@triton.jit
def apply_act(x, FN: tl.constexpr, limit, alpha):
    """f(x) in fp32."""
    if FN == FN_GELU:
        y = x * _gelu_sigmoid(x)
    elif FN == FN_QGELU:
        y = x * _sigmoid(1.702 * x)
    elif FN == FN_RELU:
        y = tl.maximum(x, 0.0)
    elif FN == FN_SRELU:
        r = tl.maximum(x, 0.0)
        y = r * r
    elif FN == FN_SILU:
        y = x * _sigmoid(x)
    elif FN == FN_SIGMOID:
        y = _sigmoid(x)
    elif FN == FN_SITU:  # limit: beta1
        y = limit * _tanh(x / limit) * _sigmoid(x)
    else:  # FN_CLAMPED_SILU
        c = tl.minimum(x, limit)
        y = c * _sigmoid(alpha * c)
    return y


@triton.jit
def apply_dact(x, FN: tl.constexpr, limit, alpha):
    """f'(x) in fp32."""
    # Written as fused multiply-adds (s (1 - s) = s - s^2; d = p s (1 - s) + s) with the
    # constants gathered: a third fewer instructions than the textbook order. s - s^2 is one
    # FMA on the GPU (Triton contracts it), rounded once: no cancellation where s is near 1.
    if FN == FN_GELU:
        # d/dx [x s(v)] = s + x s (1 - s) v',  v = 2u = 2c (x + 0.044715 x^3)
        s = _gelu_sigmoid(x)
        p = x * (1.5957691216057308 + (1.5957691216057308 * 0.134145) * (x * x))
        d = p * (s - s * s) + s
    elif FN == FN_QGELU:
        s = _sigmoid(1.702 * x)
        d = (1.702 * x) * (s - s * s) + s
    elif FN == FN_RELU:
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif FN == FN_SRELU:
        d = 2.0 * tl.maximum(x, 0.0)
    elif FN == FN_SILU:
        s = _sigmoid(x)
        d = x * (s - s * s) + s
    elif FN == FN_SIGMOID:
        s = _sigmoid(x)
        d = s * (1.0 - s)
    elif FN == FN_SITU:
        t = _tanh(x / limit)
        s = _sigmoid(x)
        d = (1.0 - t * t) * s + limit * t * (s - s * s)
    else:  # FN_CLAMPED_SILU
        c = tl.minimum(x, limit)
        s = _sigmoid(alpha * c)
        d = tl.where(x <= limit, s + alpha * c * s * (1.0 - s), 0.0)
    return d


@triton.jit
def _act_columns(cols, K, GATED: tl.constexpr):
    """Input column of the activation operand of output columns ``cols`` (see module doc)."""
    if GATED:
        blk = cols // K
        a_col = blk * 2 * K + (cols - blk * K)
    else:
        a_col = cols
    return a_col


# Kernels -------------------------------------------------------------------------------------


@triton.jit
def _flat_fwd_kernel(x_ptr, y_ptr, numel, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = apply_act(x, FN, 0.0, 0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flat_bwd_kernel(g_ptr, x_ptr, dx_ptr, numel, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dx = g * apply_dact(x, FN, 0.0, 0.0)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_fwd_kernel(
    x_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    limit,
    alpha,
    offset,
    FN: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # N output columns; the input has 2N columns when GATED, else N.
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    limit = tl.cast(limit, tl.float32)
    alpha = tl.cast(alpha, tl.float32)
    offset = tl.cast(offset, tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    a_col = _act_columns(cols, K, GATED)
    n_in = 2 * N if GATED else N
    x_row = rows.to(tl.int64)[:, None] * n_in
    a = tl.load(x_ptr + x_row + a_col[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        a += tl.load(b_ptr + a_col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = apply_act(a, FN, limit, alpha)
    if GATED:
        lin = tl.load(x_ptr + x_row + (a_col + K)[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            lin += tl.load(b_ptr + a_col + K, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if FN == FN_CLAMPED_SILU:
            lin = tl.minimum(tl.maximum(lin, -limit), limit) + offset
        elif FN == FN_SITU:  # alpha: beta2
            lin = alpha * _tanh(lin / alpha)
        y = y * lin
    y_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptr + y_off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_bwd_kernel(
    g_ptr,
    x_ptr,
    b_ptr,
    dx_ptr,
    part_ptr,
    M,
    N,
    K,
    rows_per_program,
    limit,
    alpha,
    offset,
    FN: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DBIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # With DBIAS each program walks rows_per_program rows, adding its tiles into [BLOCK_M,
    # BLOCK_N] accumulators (element-wise, in registers) and reduces them over rows once at the
    # end: a reduction across warps per tile made the loop latency-bound (see rows_config).
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    limit = tl.cast(limit, tl.float32)
    alpha = tl.cast(alpha, tl.float32)
    offset = tl.cast(offset, tl.float32)
    pid_m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    a_col = _act_columns(cols, K, GATED)
    l_col = a_col + K
    n_in = 2 * N if GATED else N
    if HAS_BIAS:
        b_a = tl.load(b_ptr + a_col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            b_l = tl.load(b_ptr + l_col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    acc_a = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_l = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(0, rows_per_program, BLOCK_M):
        rows = pid_m * rows_per_program + r + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_mask[None, :]
        x_row = rows.to(tl.int64)[:, None] * n_in
        g_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
        g = tl.load(g_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + x_row + a_col[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += b_a
        if GATED:
            lin = tl.load(x_ptr + x_row + l_col[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                lin += b_l
            dl = g * apply_act(a, FN, limit, alpha)
            if FN == FN_CLAMPED_SILU:
                dl = tl.where((lin >= -limit) & (lin <= limit), dl, 0.0)
                lin = tl.minimum(tl.maximum(lin, -limit), limit) + offset
            elif FN == FN_SITU:
                t2 = _tanh(lin / alpha)
                dl = dl * (1.0 - t2 * t2)
                lin = alpha * t2
            da = g * lin * apply_dact(a, FN, limit, alpha)
            tl.store(dx_ptr + x_row + l_col[None, :], dl.to(dx_ptr.dtype.element_ty), mask=mask)
            if DBIAS:
                acc_l += tl.where(mask, dl, 0.0)
        else:
            da = g * apply_dact(a, FN, limit, alpha)
        tl.store(dx_ptr + x_row + a_col[None, :], da.to(dx_ptr.dtype.element_ty), mask=mask)
        if DBIAS:
            acc_a += tl.where(mask, da, 0.0)
    if DBIAS:
        part_row = part_ptr + pid_m.to(tl.int64) * n_in
        tl.store(part_row + a_col, tl.sum(acc_a, axis=0), mask=col_mask)
        if GATED:
            tl.store(part_row + l_col, tl.sum(acc_l, axis=0), mask=col_mask)


# Launch configurations -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlatConfig:
    """Flat kernels: ``block`` elements per program."""

    block: int
    num_warps: int


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """Row kernels: ``[block_m, block_n]`` output tiles; in the backward with dbias each program
    walks ``rows_per_program`` rows (a multiple of ``block_m``) before writing its partial sums."""

    block_m: int
    block_n: int
    num_warps: int
    rows_per_program: int

    def __post_init__(self) -> None:
        if self.rows_per_program <= 0 or self.rows_per_program % self.block_m:
            raise ValueError(
                f"RowsConfig: rows_per_program ({self.rows_per_program}) must be a positive "
                f"multiple of block_m ({self.block_m})"
            )


def flat_config(numel: int, device: torch.device) -> FlatConfig:
    """These kernels are bandwidth bound. 2048 elements over 4 warps gives each thread 16
    contiguous elements (two 16-byte loads in bf16), enough bytes in flight per SM, and at the
    sizes that matter (16384^2) hundreds of thousands of programs, so no tail effect. The
    interpreter runs one program at a time in numpy, so there fewer, larger programs are faster."""
    if device.type != "cuda":
        return FlatConfig(block=min(4096, next_pow2(max(numel, 1))), num_warps=1)
    return FlatConfig(block=2048, num_warps=4)


def rows_config(m: int, n: int, device: torch.device, *, dbias: bool) -> RowsConfig:
    """Tiles of ~4096 output elements, at most 256 columns wide: a row segment of 256 bf16 is 512
    contiguous bytes (full 128-byte lines, 16-byte vectors), and 16 rows per tile keep enough
    loads in flight. With dbias, each program walks many row tiles, accumulating element-wise
    into register tiles and reducing over rows once, into its row of an fp32 ``[programs, N]``
    partial buffer summed afterwards; the row programs are capped at about ``_DBIAS_PER_SM``
    programs per SM in all, the launch the norm backward runs at 80% of copy bandwidth with.
    History (H100, 2026-11-22): with a cross-warp row reduction per tile, gelu backward with
    dbias at 16384 x 16384 took 1.68 ms (4 programs per SM), 1.46 ms (32 per SM) and 1.65 ms
    (4 tiles per program, unrolled), about 3x its copy time; the per-tile reduction, common to
    all three, was the suspect. This layout: 0.58 ms (gelu) and 0.94 ms (swiglu, 16384 x 32768
    in) in the MLP benchmark on the same GPU, faster than Inductor's fused kernel (0.67 / 1.62)."""
    block_n = min(256, next_pow2(max(n, 1)))
    block_m = min(max(1, 4096 // block_n), next_pow2(max(m, 1)))
    num_warps = 8 if block_m * block_n >= 4096 else 4
    row_blocks = cdiv(m, block_m)
    if not dbias:
        return RowsConfig(block_m, block_n, num_warps, block_m)
    target = programs_per_sm(device, _DBIAS_PER_SM)
    programs = max(1, min(row_blocks, target // cdiv(n, block_n)))
    return RowsConfig(block_m, block_n, num_warps, cdiv(row_blocks, programs) * block_m)


_DBIAS_PER_SM = 4


# Launch wrappers -----------------------------------------------------------------------------


def _rows_shape(x: torch.Tensor, gated: bool) -> tuple[int, int, int]:
    n_in = x.shape[-1]
    n = n_in // 2 if gated else n_in
    return x.numel() // max(n_in, 1), n, n_in


def activation_forward(
    inp: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    *,
    config: FlatConfig | RowsConfig | None = None,
) -> torch.Tensor:
    """``activation(inp + bias)`` (element-wise) or the gated activation of ``inp + bias``.

    Arguments are trusted (``te_compile.functional.activation`` validates them). The output is a
    new contiguous tensor of the input's dtype."""
    fn = ALL_FUNCTIONS[activation]
    gated = activation in ALL_GATED
    x = dense(inp)
    if not gated and bias is None:
        out = torch.empty_like(x)
        if x.numel():
            cfg = config or flat_config(x.numel(), x.device)
            grid = (cdiv(x.numel(), cfg.block),)
            launch(_flat_fwd_kernel, grid)(
                x, out, x.numel(), fn, cfg.block, num_warps=cfg.num_warps
            )
        return out
    m, n, _ = _rows_shape(x, gated)
    out = x.new_empty((*x.shape[:-1], n))
    if out.numel():
        cfg = config or rows_config(size_hint(m), n, x.device, dbias=False)
        grid = (cdiv(m, cfg.block_m), cdiv(n, cfg.block_n))
        launch(_rows_fwd_kernel, grid)(
            x,
            x if bias is None else dense(bias),
            out,
            m,
            n,
            (glu_interleave_size or n) if gated else 1,
            limit,
            alpha,
            glu_linear_offset,
            fn,
            gated,
            bias is not None,
            cfg.block_m,
            cfg.block_n,
            num_warps=cfg.num_warps,
        )
    return out


def activation_backward(
    grad: torch.Tensor,
    inp: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    glu_interleave_size: int = 0,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    *,
    need_dbias: bool = False,
    config: FlatConfig | RowsConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dinp, dbias)`` for the forward above; ``dbias`` is None unless ``need_dbias`` (which
    needs a bias). ``dbias`` is the column sum of ``dinp`` before its rounding, in fp32, then
    cast to the bias dtype."""
    fn = ALL_FUNCTIONS[activation]
    gated = activation in ALL_GATED
    x, g = dense(inp), dense(grad)
    dx = torch.empty_like(x)
    if not gated and bias is None:
        if x.numel():
            cfg = config or flat_config(x.numel(), x.device)
            grid = (cdiv(x.numel(), cfg.block),)
            launch(_flat_bwd_kernel, grid)(
                g, x, dx, x.numel(), fn, cfg.block, num_warps=cfg.num_warps
            )
        return dx, None
    m, n, n_in = _rows_shape(x, gated)
    dbias = need_dbias and bias is not None
    if m == 0 or n == 0:
        return dx, (torch.zeros_like(bias) if dbias else None)
    cfg = config or rows_config(size_hint(m), n, x.device, dbias=dbias)
    if dbias:
        # The partial buffer's row count comes from the size hint, so under torch.compile with
        # dynamic shapes it is a constant: a symbolic count would be specialised where it is 1
        # (a size-1 dim) and the next row count would recompile. The programs then share the
        # actual rows (a multiple of block_m each); programs past the end write zero partials.
        programs = max(1, cdiv(size_hint(m), cfg.rows_per_program))
        rows_per_program = cdiv(cdiv(m, programs), cfg.block_m) * cfg.block_m
    else:
        rows_per_program = cfg.block_m
        programs = cdiv(m, rows_per_program)
    part = torch.empty((programs, n_in), device=x.device, dtype=torch.float32) if dbias else dx
    launch(_rows_bwd_kernel, (programs, cdiv(n, cfg.block_n)))(
        g,
        x,
        x if bias is None else dense(bias),
        dx,
        part,
        m,
        n,
        (glu_interleave_size or n) if gated else 1,
        rows_per_program,
        limit,
        alpha,
        glu_linear_offset,
        fn,
        gated,
        bias is not None,
        dbias,
        cfg.block_m,
        cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return dx, (part.sum(0).to(bias.dtype) if dbias else None)
