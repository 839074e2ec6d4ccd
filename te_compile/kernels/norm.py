r"""Triton kernels for LayerNorm, RMSNorm and L2 normalisation over the last dim.

The input is viewed as ``[M, N]`` (rows = every leading index, ``N`` = the normalised dim).
Per row, in fp32 whatever the storage dtype:

.. math::
    \text{LayerNorm:}\quad \mu = \tfrac1N \textstyle\sum_j x_j,\quad
        r = \big(\tfrac1N \textstyle\sum_j (x_j-\mu)^2 + \varepsilon\big)^{-1/2},\quad
        \hat x = (x-\mu)\,r,\quad y = \hat x\,\gamma + \beta

    \text{RMSNorm:}\quad r = \big(\tfrac1N \textstyle\sum_j x_j^2 + \varepsilon\big)^{-1/2},
        \quad \hat x = x\,r,\quad y = \hat x\,\gamma

    \text{L2:}\quad r = \big(\textstyle\sum_j x_j^2 + \varepsilon\big)^{-1/2},
        \quad y = \hat x = x\,r

with :math:`\gamma = w + 1` when the weight is stored zero-centred. The backward, with
:math:`g = dy\,\gamma` (:math:`g = dy` for L2) and :math:`\langle\cdot\rangle` the row mean
(the row *sum* for L2):

.. math::
    dx = r\,\big(g - \langle g\rangle - \hat x\,\langle \hat x\, g\rangle\big)
    \quad(\text{no } \langle g\rangle \text{ term for RMSNorm and L2}), \qquad
    d\gamma = \textstyle\sum_{rows} dy\,\hat x, \qquad d\beta = \textstyle\sum_{rows} dy

Layout of the work:

* forward: one program per tile of ``BLOCK_M`` rows. When a row fits in one tile
  (``N <= max block``) it is read once and kept in registers; longer rows loop over column
  chunks (LayerNorm: a mean pass, a variance pass around that mean, an output pass; RMSNorm and
  L2: a sum-of-squares pass and an output pass). The variance is always taken around the mean,
  never as :math:`E[x^2]-\mu^2`, which cancels catastrophically for rows with a large mean.
* backward: a two-stage reduction for :math:`d\gamma, d\beta`. Stage 1: a fixed number of
  programs (a few per SM), each owning a contiguous range of rows, computes ``dx`` for its rows
  and accumulates its partial :math:`d\gamma, d\beta` in fp32 into its own row of a
  ``[programs, N]`` buffer (no atomics, deterministic). Stage 2: ``torch.sum`` over programs.
  The partial buffer is ``programs * N * 4`` bytes, about 1% of the traffic at 16384 x 8192.

Wrappers make inputs contiguous, accept fp32/bf16/fp16 inputs with an fp32 or same-dtype weight,
and return outputs in the input dtype, statistics in fp32 of shape ``inp.shape[:-1]`` and weight
gradients in the weight's dtype. They run on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``
(the tests do that at small sizes). Every wrapper takes a keyword-only ``config`` that overrides
:func:`launch_config`: small tiles reach the chunked path and programs owning several row tiles
at sizes the interpreter runs quickly.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile.kernels import (
    bf16_bits,
    cdiv,
    dense,
    kernel_arg,
    launch,
    next_pow2,
    programs_per_sm,
    size_hint,
)
from te_compile.kernels.fp8 import (
    ROUNDING,
    abs_bits,
    as_rows,
    fold_amax,
    round_to,
    store_rounded,
)

__all__ = [
    "NormLaunchConfig",
    "l2normalization_bwd",
    "l2normalization_fwd",
    "launch_config",
    "layernorm_bwd",
    "layernorm_fwd",
    "norm_stats",
    "rmsnorm_bwd",
    "rmsnorm_fwd",
]

LAYERNORM: tl.constexpr = tl.constexpr(0)
RMSNORM: tl.constexpr = tl.constexpr(1)
L2NORM: tl.constexpr = tl.constexpr(2)


# Launch configuration ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NormLaunchConfig:
    """How one kernel launch tiles an ``[M, N]`` problem.

    ``block_n``: columns per tile, ``next_power_of_2(N)`` capped so that a tile's fp32 values
    stay in registers (forward: 16384 columns, i.e. up to 32 values per thread at 16 warps;
    backward: 8192, because it keeps about seven row-sized values live: x, dy, gamma, x_hat, g
    and the two gradient accumulators). ``chunked``: the row is longer than one tile, so the
    kernel loops over column chunks. ``block_m``: rows per tile, so that short rows still give
    each program a tile of at least ``_MIN_TILE`` elements (one row of 64 columns alone would
    leave most of a warp idle). ``num_warps``: about 16 fp32 values per thread, 4 to 16 warps;
    16 values of a 2-byte dtype are two 16-byte vector loads per thread.
    """

    block_m: int
    block_n: int
    num_warps: int
    chunked: bool


_FWD_MAX_BLOCK_N = 16384
_BWD_MAX_BLOCK_N = 8192
_MIN_TILE = 2048


@functools.lru_cache(maxsize=256)
def launch_config(n: int, backward: bool) -> NormLaunchConfig:
    """The tiling for rows of ``n`` elements (see :class:`NormLaunchConfig`)."""
    cap = _BWD_MAX_BLOCK_N if backward else _FWD_MAX_BLOCK_N
    block_n = min(next_pow2(n), cap)
    block_m = max(1, _MIN_TILE // block_n)
    num_warps = min(16, max(4, block_m * block_n // 512))
    return NormLaunchConfig(block_m, block_n, num_warps, chunked=n > block_n)


def _config(n: int, backward: bool, config: NormLaunchConfig | None) -> NormLaunchConfig:
    """``config`` (an override; tests use small tiles to reach the chunked and multi-tile paths
    at small sizes) or the default :func:`launch_config`. A symbolic ``n`` (a te op traced with
    dynamic shapes) is specialised (a guard on the row length): the tiling decides whether the
    kernel loops over column chunks, and a model's normalised size does not change between
    steps; the row count stays dynamic."""
    if config is None:
        return launch_config(int(n), backward)
    if n > config.block_n and not config.chunked:
        raise ValueError(f"NormLaunchConfig: rows of {n} > block_n ({config.block_n}) need chunked")
    return config


_SUM_BLOCK_N = 128  # columns per program of the backward's stage 2


def _max_bwd_programs(device: torch.device) -> int:
    """Stage-1 programs of the backward: two per SM fills an H100 with the 16-warp tiles of
    large rows while keeping the partial buffer small."""
    return programs_per_sm(device, 2)


# Kernels -------------------------------------------------------------------------------------


@triton.jit
def _gamma(W, c, N, ZERO_CENTERED_GAMMA: tl.constexpr):
    """The norm's weight for columns ``c`` in fp32 (``+ 1`` when zero-centred; 0 past ``N``)."""
    w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
    if ZERO_CENTERED_GAMMA:
        w += 1.0
    return w


@triton.jit
def _gamma_beta(
    y, W, B, c, N, KIND: tl.constexpr, ZERO_CENTERED_GAMMA: tl.constexpr, HAS_BIAS: tl.constexpr
):
    """The normalised tile ``y`` (columns ``c``) times gamma, plus beta: the forward's output."""
    if KIND != L2NORM:
        y = y * _gamma(W, c, N, ZERO_CENTERED_GAMMA)[None, :]
    if HAS_BIAS:
        y += tl.load(B + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _inv_sigma(sum_sq, N, eps, KIND: tl.constexpr):
    if KIND == L2NORM:
        return 1.0 / tl.sqrt(sum_sq + eps)
    return 1.0 / tl.sqrt(sum_sq / N + eps)


@triton.jit(do_not_specialize=["AMAX_SLOT"])  # one compile for every slot
def _norm_fwd_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSIGMA,
    AMAX_BITS,
    AMAX_SLOT,
    M,
    N,
    eps,
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED_GAMMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,
    STORE_Y: tl.constexpr,
    AMAX: tl.constexpr,
    ROUND: tl.constexpr,
    SOFTWARE: tl.constexpr,
):
    """``STORE_Y``: write the output (else only the statistics). ``AMAX``: fold the amax of
    the output, rounded to the model's dtype (``ROUND``), into ``AMAX_BITS[AMAX_SLOT]``
    (``abs_bits`` max): the first pass of a current-scaling FP8 cast of the output that is
    never written (``kernels.act_quantize.norm_quantize``)."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    eps = tl.cast(eps, tl.float32)
    AMAX_BITS = AMAX_BITS.to(tl.pointer_type(tl.int32)) + AMAX_SLOT
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    row_off = rows.to(tl.int64)[:, None] * N
    cols = tl.arange(0, BLOCK_N)
    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
    if not CHUNKED:
        # The whole row is one tile: read it once, keep it in registers.
        mask = row_mask[:, None] & (cols[None, :] < N)
        x = tl.load(X + row_off + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if KIND == LAYERNORM:
            mean = tl.sum(x, axis=1) / N
            x = tl.where(mask, x - mean[:, None], 0.0)
        rsigma = _inv_sigma(tl.sum(x * x, axis=1), N, eps, KIND)
        y = _gamma_beta(x * rsigma[:, None], W, B, cols, N, KIND, ZERO_CENTERED_GAMMA, HAS_BIAS)
        if STORE_Y:
            tl.store(Y + row_off + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        if AMAX:
            a = tl.where(mask, abs_bits(round_to(y, ROUND, SOFTWARE)), 0)
            fold_amax(AMAX_BITS, tl.max(tl.max(a, axis=1), axis=0))
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if KIND == LAYERNORM:
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < N)
                acc += tl.load(X + row_off + c[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=1) / N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < N)
            x = tl.load(X + row_off + c[None, :], mask=mask, other=0.0).to(tl.float32)
            x = tl.where(mask, x - mean[:, None], 0.0)
            acc += x * x
        rsigma = _inv_sigma(tl.sum(acc, axis=1), N, eps, KIND)
        if STORE_Y or AMAX:  # else only the statistics
            amax = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < N)
                x = tl.load(X + row_off + c[None, :], mask=mask, other=0.0).to(tl.float32)
                y = (x - mean[:, None]) * rsigma[:, None]
                y = _gamma_beta(y, W, B, c, N, KIND, ZERO_CENTERED_GAMMA, HAS_BIAS)
                if STORE_Y:
                    tl.store(Y + row_off + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
                if AMAX:
                    a = tl.where(mask, abs_bits(round_to(y, ROUND, SOFTWARE)), 0)
                    amax = tl.maximum(amax, a)
            if AMAX:
                fold_amax(AMAX_BITS, tl.max(tl.max(amax, axis=1), axis=0))
    if KIND == LAYERNORM:
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSIGMA + rows, rsigma, mask=row_mask)


@triton.jit
def _load_tile(X, DY, W, row_off, c, N, mask, mean, rsigma, KIND: tl.constexpr, ZCG: tl.constexpr):
    """One backward tile in fp32: ``(dy, x_hat, g)``. Masked lanes load ``dy = 0``, so they add
    nothing to any row sum or gradient even where ``x_hat`` is not 0 there."""
    x = tl.load(X + row_off + c[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row_off + c[None, :], mask=mask, other=0.0).to(tl.float32)
    x_hat = (x - mean[:, None]) * rsigma[:, None]
    g = dy
    if KIND != L2NORM:
        g = dy * _gamma(W, c, N, ZCG)[None, :]
    return dy, x_hat, g


@triton.jit
def _norm_bwd_kernel(
    DY,
    X,
    W,
    MEAN,
    RSIGMA,
    DX,
    DW_PARTIAL,
    DB_PARTIAL,
    BRANCH,
    M,
    N,
    rows_per_program,
    KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ZERO_CENTERED_GAMMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,
    HAS_BRANCH: tl.constexpr,
):
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)
    partial = pid.to(tl.int64) * N
    # Row sums of the dx formula are means for LayerNorm/RMSNorm and sums for L2.
    scale = 1.0 if KIND == L2NORM else 1.0 / N
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(row_start, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        row_off = rows.to(tl.int64)[:, None] * N
        rsigma = tl.load(RSIGMA + rows, mask=row_mask, other=0.0)
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        if KIND == LAYERNORM:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        if not CHUNKED:
            mask = row_mask[:, None] & (cols[None, :] < N)
            dy, x_hat, g = _load_tile(
                X, DY, W, row_off, cols, N, mask, mean, rsigma, KIND, ZERO_CENTERED_GAMMA
            )
            c1 = tl.sum(x_hat * g, axis=1) * scale
            dx = g - x_hat * c1[:, None]
            if KIND == LAYERNORM:
                dx -= (tl.sum(g, axis=1) * scale)[:, None]
            dx = dx * rsigma[:, None]
            if HAS_BRANCH:  # a residual branch's gradient, added before the one rounding
                dx += tl.load(BRANCH + row_off + cols[None, :], mask=mask).to(tl.float32)
            tl.store(DX + row_off + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            dw_acc += dy * x_hat
            if HAS_BIAS:
                db_acc += dy
        else:
            sum_xg = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            sum_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < N)
                dy, x_hat, g = _load_tile(
                    X, DY, W, row_off, c, N, mask, mean, rsigma, KIND, ZERO_CENTERED_GAMMA
                )
                sum_xg += x_hat * g
                sum_g += g
            c1 = tl.sum(sum_xg, axis=1) * scale
            c2 = tl.sum(sum_g, axis=1) * scale
            for start in range(0, N, BLOCK_N):
                c = start + cols
                mask = row_mask[:, None] & (c[None, :] < N)
                dy, x_hat, g = _load_tile(
                    X, DY, W, row_off, c, N, mask, mean, rsigma, KIND, ZERO_CENTERED_GAMMA
                )
                dx = g - x_hat * c1[:, None]
                if KIND == LAYERNORM:
                    dx -= c2[:, None]
                dx = dx * rsigma[:, None]
                if HAS_BRANCH:
                    dx += tl.load(BRANCH + row_off + c[None, :], mask=mask).to(tl.float32)
                tl.store(DX + row_off + c[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                if KIND != L2NORM:
                    # The program owns this row of the partial buffer: read-modify-write,
                    # no atomics. The buffer starts at zero (the wrapper allocates it so).
                    p = partial + c
                    tl.store(
                        DW_PARTIAL + p,
                        tl.load(DW_PARTIAL + p, mask=c < N) + tl.sum(dy * x_hat, axis=0),
                        mask=c < N,
                    )
                    if HAS_BIAS:
                        tl.store(
                            DB_PARTIAL + p,
                            tl.load(DB_PARTIAL + p, mask=c < N) + tl.sum(dy, axis=0),
                            mask=c < N,
                        )
    if KIND != L2NORM and not CHUNKED:
        tl.store(DW_PARTIAL + partial + cols, tl.sum(dw_acc, axis=0), mask=cols < N)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + partial + cols, tl.sum(db_acc, axis=0), mask=cols < N)


@triton.jit
def _partials_sum_kernel(
    DW_P, DB_P, DW, DB, P, N,
    HAS_BIAS: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Stage 2 of the backward: the column sums of the ``[P, N]`` fp32 partials of ``dw`` (and
    ``db``), rounded once to the weight's dtype; both outputs in one launch."""
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dw = tl.zeros([BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    for p in range(0, P, BLOCK_P):
        r = p + tl.arange(0, BLOCK_P)
        mask = (r < P)[:, None] & (c < N)[None, :]
        offs = r[:, None] * N + c[None, :]
        dw += tl.sum(tl.load(DW_P + offs, mask=mask, other=0.0), axis=0)
        if HAS_BIAS:
            db += tl.sum(tl.load(DB_P + offs, mask=mask, other=0.0), axis=0)
    store_rounded(DW + c, dw, c < N, BF16_BITS)
    if HAS_BIAS:
        store_rounded(DB + c, db, c < N, BF16_BITS)


# Launch wrappers -----------------------------------------------------------------------------


def _like(t: Tensor) -> Tensor:
    """A new contiguous tensor of ``t``'s shape and dtype: the kernels write it as ``[M, N]``
    rows, and it is returned as it is, without a view."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _norm_fwd(
    kind: int,
    inp: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    *,
    config: NormLaunchConfig | None = None,
    store_y: bool = True,
    amax: Tensor | None = None,
    slot: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rsigma)``; without ``store_y`` ``out`` is a 0-element tensor (statistics
    only). ``amax`` (a zero or running max,
    ``kernels.quantize.amax_bits``): the output's amax, rounded to the input's dtype, is folded
    into its element ``slot``."""
    x, m, n = as_rows(inp)
    out = _like(inp) if store_y else x.new_empty(0)
    stats = inp.shape[:-1]
    rsigma = torch.empty(stats, device=x.device, dtype=torch.float32)
    layernorm = kind == LAYERNORM.value
    mean = torch.empty(stats if layernorm else (0,), device=x.device, dtype=torch.float32)
    cfg = _config(n, False, config)
    if m > 0:
        launch(_norm_fwd_kernel, (cdiv(m, cfg.block_m),))(
            x,
            x if weight is None else dense(weight),
            x if bias is None else dense(bias),
            out,
            mean if layernorm else rsigma,
            rsigma,
            rsigma if amax is None else amax,
            slot,
            m,
            n,
            eps,
            KIND=kind,
            HAS_BIAS=bias is not None,
            ZERO_CENTERED_GAMMA=zero_centered_gamma,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            CHUNKED=cfg.chunked,
            STORE_Y=store_y,
            AMAX=amax is not None,
            ROUND=ROUNDING.get(x.dtype, 0),
            SOFTWARE=x.device.type != "cuda",
            num_warps=cfg.num_warps,
        )
    return out, mean, rsigma


def norm_stats(
    normalization: str,
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    amax: Tensor | None,
    *,
    config: NormLaunchConfig | None = None,
    slot: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(mean, rsigma)`` of "LayerNorm" or "RMSNorm" (``mean`` 0-element for RMSNorm) as the
    forward kernels compute them, without writing the output; with ``amax``
    (``kernels.quantize.amax_bits``) the amax of the output rounded to ``inp``'s dtype is folded
    into its element ``slot``. The statistics pass of the norm fused into an FP8 cast
    (``kernels.act_quantize.norm_quantize``)."""
    kind = LAYERNORM.value if normalization == "LayerNorm" else RMSNORM.value
    _, mean, rsigma = _norm_fwd(
        kind, inp, weight, bias, eps, zero_centered_gamma, config=config, store_y=False,
        amax=amax, slot=slot,
    )  # fmt: skip
    return mean, rsigma


def _norm_bwd(
    kind: int,
    grad_out: Tensor,
    inp: Tensor,
    mean: Tensor | None,
    rsigma: Tensor,
    weight: Tensor | None,
    zero_centered_gamma: bool,
    has_bias: bool,
    *,
    config: NormLaunchConfig | None = None,
    programs: int | None = None,
    branch: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``programs``: at most this many stage-1 programs (default :func:`_max_bwd_programs`).
    ``branch`` (``inp``'s shape and dtype): a gradient added to ``dx`` in fp32 before its one
    rounding, the residual branch's of a fused pre-norm block."""
    (x, m, n), dy = as_rows(inp), as_rows(grad_out)[0]
    if branch is not None and (branch.shape != inp.shape or branch.dtype != inp.dtype):
        raise ValueError(
            f"norm backward: branch must have inp's shape {list(inp.shape)} and dtype "
            f"{inp.dtype}, got {list(branch.shape)} {branch.dtype}"
        )
    dx = _like(inp)
    cfg = _config(n, True, config)
    # Stage 1 grid: at most `programs`, each owning whole tiles of rows (at least one tile, so
    # that 0 rows give 0 programs, not a division by 0).
    rows = size_hint(m)
    programs = min(cdiv(rows, cfg.block_m), programs or _max_bwd_programs(x.device))
    rows_per_program = cdiv(cdiv(rows, max(programs, 1)), cfg.block_m) * cfg.block_m
    rows_per_program = max(rows_per_program, cfg.block_m)
    programs = cdiv(m, rows_per_program)
    # Chunked rows accumulate into the buffers across row tiles, so they must start at zero.
    alloc = torch.zeros if cfg.chunked or programs == 0 else torch.empty
    dw_p, db_p = (alloc(programs, n, device=x.device, dtype=torch.float32) if need else None
                  for need in (kind != L2NORM.value, has_bias))  # fmt: skip
    if m > 0:
        rsigma = dense(rsigma)
        launch(_norm_bwd_kernel, (programs,))(
            dy,
            x,
            x if weight is None else dense(weight),
            rsigma if mean is None else dense(mean),
            rsigma,
            dx,
            # Unused: rsigma, read only (a view or alias of a written one costs Inductor a copy).
            rsigma if dw_p is None else dw_p,
            rsigma if db_p is None else db_p,
            dy if branch is None else as_rows(branch)[0],  # (unused without a branch)
            m,
            n,
            rows_per_program,
            KIND=kind,
            HAS_BIAS=has_bias,
            ZERO_CENTERED_GAMMA=zero_centered_gamma,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            CHUNKED=cfg.chunked,
            HAS_BRANCH=branch is not None,
            num_warps=cfg.num_warps,
        )
    if weight is None:
        return dx, None, None
    # Stage 2: sum the per-program partials (fp32), round once to the weight's dtype; two
    # outputs, not views of one (custom ops' outputs must not alias).
    dw = torch.empty(n, device=x.device, dtype=weight.dtype)
    db = torch.empty_like(dw) if has_bias else None
    if n:
        launch(_partials_sum_kernel, (cdiv(n, _SUM_BLOCK_N),))(
            dw_p, dw_p if db_p is None else db_p, kernel_arg(dw),
            kernel_arg(dw if db is None else db), programs, n, HAS_BIAS=has_bias,
            BF16_BITS=bf16_bits(dw), BLOCK_P=32, BLOCK_N=_SUM_BLOCK_N,
        )  # fmt: skip
    return dx, dw, db


def layernorm_fwd(
    inp: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    zero_centered_gamma: bool,
    *,
    config: NormLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, mean, rsigma)``; ``mean`` and ``rsigma`` are fp32 of shape ``inp.shape[:-1]``."""
    return _norm_fwd(LAYERNORM.value, inp, weight, bias, eps, zero_centered_gamma, config=config)


def layernorm_bwd(
    grad_out: Tensor,
    inp: Tensor,
    mean: Tensor,
    rsigma: Tensor,
    weight: Tensor,
    zero_centered_gamma: bool,
    has_bias: bool,
    *,
    config: NormLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(dinp, dweight, dbias)``; ``dbias`` is None unless ``has_bias``."""
    dx, dw, db = _norm_bwd(
        LAYERNORM.value,
        grad_out,
        inp,
        mean,
        rsigma,
        weight,
        zero_centered_gamma,
        has_bias,
        config=config,
    )
    return dx, dw, db


def rmsnorm_fwd(
    inp: Tensor,
    weight: Tensor,
    eps: float,
    zero_centered_gamma: bool,
    *,
    config: NormLaunchConfig | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, rsigma)``; ``rsigma`` is fp32 of shape ``inp.shape[:-1]``."""
    out, _, rsigma = _norm_fwd(
        RMSNORM.value, inp, weight, None, eps, zero_centered_gamma, config=config
    )
    return out, rsigma


def rmsnorm_bwd(
    grad_out: Tensor,
    inp: Tensor,
    rsigma: Tensor,
    weight: Tensor,
    zero_centered_gamma: bool,
    *,
    config: NormLaunchConfig | None = None,
    branch: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(dinp, dweight)``; ``branch``: :func:`_norm_bwd`'s, added into ``dinp``."""
    dx, dw, _ = _norm_bwd(
        RMSNORM.value,
        grad_out,
        inp,
        None,
        rsigma,
        weight,
        zero_centered_gamma,
        False,
        config=config,
        branch=branch,
    )
    return dx, dw


def l2normalization_fwd(
    inp: Tensor, eps: float, *, config: NormLaunchConfig | None = None
) -> tuple[Tensor, Tensor]:
    """``(out, rsigma)`` with ``rsigma = 1/sqrt(sum(x^2) + eps)``, fp32 of shape
    ``inp.shape[:-1]``."""
    out, _, rsigma = _norm_fwd(L2NORM.value, inp, None, None, eps, False, config=config)
    return out, rsigma


def l2normalization_bwd(
    grad_out: Tensor, inp: Tensor, rsigma: Tensor, *, config: NormLaunchConfig | None = None
) -> Tensor:
    """``dinp``."""
    dx, _, _ = _norm_bwd(
        L2NORM.value, grad_out, inp, None, rsigma, None, False, False, config=config
    )
    return dx
