r"""Triton kernels for FP8 quantisation: per-tensor (delayed / current scaling) and blockwise.
The encoding they share (formats, scale rule, software conversions, launch configuration) is in
``kernels.fp8``; per-row and per-column scaling (the grouped FP8 GEMMs) in
``kernels.quantize_rows``.

The input is viewed as ``[M, K]`` (every leading index is a row). All math is fp32, whatever the
storage dtype; for a scale :math:`s` and the format's largest finite value :math:`F`
(448 for E4M3, 57344 for E5M2):

.. math::
    q = \operatorname{fp8}\big(\operatorname{clamp}(x\,s,\,-F,\,F)\big), \qquad
    s(a) = F / \max(a, \varepsilon) \;\;(\text{1 where that max is 0 or } \infty)

rounded to nearest even; NaN stays NaN, everything else saturates to :math:`\pm F`. The scale
rule is Transformer Engine's ``compute_scale_from_amax``: an fp32 overflow of :math:`F/a` (a
subnormal ``a``) becomes ``FLT_MAX``; with power-of-two scales the fp32 mantissa is cleared
(:math:`2^{\lfloor\log_2 s\rfloor}`); a NaN amax gives a NaN scale, and so does a block's
inf amax (``functional.quantize``'s edge semantics: blockwise casts report nothing, so such a
block dequantises to NaN instead of saturating). Division is
``div_rn`` (correctly rounded; Triton's ``/`` on CUDA is not), so the results match torch.

Kernels:

* ``_amax_kernel``: :math:`\max|x|` over the whole tensor. A fixed number of programs each
  reduce a contiguous chunk in registers and fold it into one fp32 with a single atomic max.
  The maximum is taken over the *int32 bits* of :math:`|x|`: for non-negative floats the
  integer order is the float order, and every NaN lies above :math:`+\infty`, so the integer
  max is a NaN-propagating float max (the float ``max`` of Triton is not NaN-propagating) and
  the int32 atomic max needs no compare-and-swap loop. The amax buffers are fp32, folded into
  through an int32 pointer.
* ``_cast_kernel``: per-tensor cast of one ``BLOCK_M x BLOCK_K`` tile per program: ``data``,
  and with ``COLUMNWISE`` the transposed tile into ``data_t`` (``[K, M]``) from the same
  registers, so ``x`` is read once. Delayed scaling loads the given scale and folds the tile's
  amax into the amax output (one pass); current scaling loads the amax of ``_amax_kernel`` and
  derives the scale in every program (a second pass). Program (0, 0) writes ``scale_inv``
  either way. ``_amax_pair_kernel`` and ``_cast_pair_kernel`` run the passes of two tensors
  (a GEMM's input and weight, an MLP's two weights) in one launch each: every tensor's programs
  are a range of one 1-D grid, each doing what the single kernel's program does
  (:func:`quantize_pair`).
* ``_block_kernel``: blockwise cast of one tile of 128 columns per program, ``BLOCK_M`` rows
  (128 for 128x128 blocks and whenever the columnwise copy is made). Block amaxes are reduced in
  registers: per row for 1x128 blocks (and per column for the columnwise 1x128 copy of
  :math:`x^T`, whose blocks run along ``M``), over the whole tile for 128x128 blocks, where the
  columnwise copy is the transposed tile with the same scale.
* ``_dequant_kernel``: ``fp32(q) * scale_inv`` (one per tensor, or per block) to ``out_dtype``,
  saturating at its largest finite value.

Delayed scaling's state update is ``kernels.fp8_scaling``'s kernel.

Storage: the kernels compute fp8 codes as uint8 bits. On CUDA a Triton kernel takes its fp8 outputs
as they are and stores the codes bitcast to their type (``kernels.fp8.fp8_out`` / ``as_stored``: no
``view`` per launch, which under ``torch.compile`` was a dispatcher call of the host each); off
CUDA, and for fp8 inputs and the CUDA C++ casts, tensors cross the boundary as their ``torch.uint8``
bit pattern (``tensor.view(torch.uint8)``). On CUDA the conversion is the hardware's
(``cvt.rn.satfinite``, round to nearest even). Under ``TRITON_INTERPRET=1`` it cannot be: Triton's
interpreter (3.x) converts fp32 to fp8 rounding half *up* on the dropped bits with no carry into the
exponent (127.9 becomes 64), without NaN handling, and fp32 to bf16 by truncation. So off CUDA (or
when :attr:`QuantizeLaunchConfig.software_convert` asks for it) the kernels encode and decode fp8,
and round bf16 outputs, with integer bit arithmetic that is exact on every backend; the CPU tests
check it bit for bit against torch's conversions, and a CUDA test checks that both conversion paths
agree.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from te_compile import _csrc
from te_compile._numerics import reciprocal_rn
from te_compile.kernels import aligned16, cdiv, dense, launch, programs_per_sm, tracing
from te_compile.kernels.fp8 import (
    BLOCK,
    DEFAULT_CONFIG,
    FORMATS,
    QuantizeLaunchConfig,
    abs_bits,
    as_rows,
    as_stored,
    block_scale,
    cast_args,
    cast_fp8,
    fp8_args,
    fp8_out,
    from_fp8_bits,
    grid_2d,
    rounded_out,
    software_convert,
    store_rounded,
    tile_scale,
    uint8_view,
)

__all__ = [
    "QuantizeLaunchConfig",
    "amax",
    "dequantize_blockwise",
    "dequantize_tensorwise",
    "quantize_blockwise",
    "quantize_current",
    "quantize_pair",
    "quantize_tensorwise",
]


@triton.jit
def _amax_chunk(X, AMAX_BITS, AMAX_SLOT, pid, numel, chunk, BLOCK_SIZE: tl.constexpr):
    """Program ``pid`` of an amax pass: reduces elements ``[pid * chunk, (pid + 1) * chunk)`` of
    ``X``; one atomic max into element ``AMAX_SLOT`` of ``AMAX_BITS``."""
    start = pid.to(tl.int64) * chunk
    end = tl.minimum(start + chunk, numel)
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    for s in range(start, end, BLOCK_SIZE):
        offs = s + tl.arange(0, BLOCK_SIZE)
        x = tl.load(X + offs, mask=offs < end, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
    tl.atomic_max(AMAX_BITS.to(tl.pointer_type(tl.int32)) + AMAX_SLOT, tl.max(acc, axis=0))


@triton.jit(do_not_specialize=["AMAX_SLOT"])  # one compile for every slot
def _amax_kernel(X, AMAX_BITS, AMAX_SLOT, numel, chunk, BLOCK_SIZE: tl.constexpr):
    """``_amax_chunk`` of program ``p``: elements ``[p * chunk, (p + 1) * chunk)``."""
    _amax_chunk(X, AMAX_BITS, AMAX_SLOT, tl.program_id(0), numel, chunk, BLOCK_SIZE)


@triton.jit(do_not_specialize=["SLOT0", "SLOT1"])
def _amax_pair_kernel(
    X0, X1, AMAX_BITS, SLOT0, SLOT1, numel0, chunk0, programs0, numel1, chunk1,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """The amax passes of two tensors in one launch: the first ``programs0`` programs reduce
    ``X0`` into ``AMAX_SLOT`` ``SLOT0``, the others ``X1`` into ``SLOT1``."""
    pid = tl.program_id(0)
    if pid < programs0:
        _amax_chunk(X0, AMAX_BITS, SLOT0, pid, numel0, chunk0, BLOCK_SIZE)
    else:
        _amax_chunk(X1, AMAX_BITS, SLOT1, pid - programs0, numel1, chunk1, BLOCK_SIZE)


@triton.jit
def _zero_kernel(A, B, TWO: tl.constexpr):
    tl.store(A, 0.0)
    if TWO:
        tl.store(B, 0.0)


@triton.jit
def _cast_tile(
    X, SCALE, AMAX_BITS, AMAX_SLOT, DATA, DATA_T, SCALE_INV, M, K, pid_m, pid_k, fp8_max, eps,
    E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr, FROM_AMAX: tl.constexpr, POW2: tl.constexpr, COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Per-tensor cast of tile ``(pid_m, pid_k)``. ``FROM_AMAX`` (current scaling): the scale
    comes from the amax in ``AMAX_BITS[AMAX_SLOT]``; otherwise (delayed scaling) ``SCALE`` is
    given and the tile's amax is folded into it. Tile (0, 0) writes ``SCALE_INV``."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    eps = tl.cast(eps, tl.float32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    first = (pid_m == 0) & (pid_k == 0)
    amax = AMAX_BITS.to(tl.pointer_type(tl.int32)) + AMAX_SLOT
    scale = tile_scale(SCALE, amax, SCALE_INV, x, first, fp8_max, eps, FROM_AMAX, POW2)
    q = cast_fp8(x * scale, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
    tl.store(DATA + rows.to(tl.int64)[:, None] * K + cols[None, :], as_stored(q, DATA), mask=mask)
    if COLUMNWISE:
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
        tl.store(DATA_T + offs_t, as_stored(tl.trans(q), DATA_T), mask=mask_t)


@triton.jit(do_not_specialize=["AMAX_SLOT"])  # one compile for every slot
def _cast_kernel(
    X, SCALE, AMAX_BITS, AMAX_SLOT, DATA, DATA_T, SCALE_INV, M, K, fp8_max, eps,
    E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr, FROM_AMAX: tl.constexpr, POW2: tl.constexpr, COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``_cast_tile`` of the program's tile: the per-tensor cast of both recipes."""
    _cast_tile(X, SCALE, AMAX_BITS, AMAX_SLOT, DATA, DATA_T, SCALE_INV, M, K, tl.program_id(0),
               tl.program_id(1), fp8_max, eps, E4M3, MBITS, BIAS, SOFTWARE, GUARD, FROM_AMAX,
               POW2, COLUMNWISE, BLOCK_M, BLOCK_K)  # fmt: skip


@triton.jit(do_not_specialize=["SLOT0", "SLOT1"])
def _cast_pair_kernel(
    X0, SCALE0, SLOT0, DATA0, DATA_T0, SCALE_INV0, M0, K0,
    X1, SCALE1, SLOT1, DATA1, DATA_T1, SCALE_INV1, M1, K1, AMAX_BITS, fp8_max, eps,
    E4M3: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr, SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr, FROM_AMAX: tl.constexpr, POW2: tl.constexpr,
    COLUMNWISE0: tl.constexpr, COLUMNWISE1: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The casts of two tensors (``_cast_kernel`` each) in one launch over a 1-D grid: the first
    ``cdiv(M0, BLOCK_M) * cdiv(K0, BLOCK_K)`` programs take ``X0``'s tiles, the others
    ``X1``'s; both tensors non-empty, their amaxes in one ``AMAX_BITS``."""
    pid = tl.program_id(0)
    tiles_k0 = tl.cdiv(K0, BLOCK_K)
    tiles0 = tl.cdiv(M0, BLOCK_M) * tiles_k0
    if pid < tiles0:
        _cast_tile(X0, SCALE0, AMAX_BITS, SLOT0, DATA0, DATA_T0, SCALE_INV0, M0, K0,
                   pid // tiles_k0, pid % tiles_k0, fp8_max, eps, E4M3, MBITS, BIAS, SOFTWARE,
                   GUARD, FROM_AMAX, POW2, COLUMNWISE0, BLOCK_M, BLOCK_K)  # fmt: skip
    else:
        p = pid - tiles0
        tiles_k1 = tl.cdiv(K1, BLOCK_K)
        _cast_tile(X1, SCALE1, AMAX_BITS, SLOT1, DATA1, DATA_T1, SCALE_INV1, M1, K1,
                   p // tiles_k1, p % tiles_k1, fp8_max, eps, E4M3, MBITS, BIAS, SOFTWARE,
                   GUARD, FROM_AMAX, POW2, COLUMNWISE1, BLOCK_M, BLOCK_K)  # fmt: skip


@triton.jit
def cast_1x128(
    x, a, AXIS: tl.constexpr, fp8_max, E4M3: tl.constexpr, MBITS: tl.constexpr,
    BIAS: tl.constexpr, SOFTWARE: tl.constexpr, POW2: tl.constexpr, GUARD: tl.constexpr,
):  # fmt: skip
    """A tile ``x`` (``a = abs_bits(x)``) cast in blocks along ``AXIS`` (1: each row of the
    tile is one block, 0: each column): ``(codes, inverse scale of each block)``."""
    amax = tl.max(a, axis=AXIS).to(tl.float32, bitcast=True)
    scale = block_scale(amax, fp8_max, POW2)
    if AXIS == 1:
        q = cast_fp8(x * scale[:, None], fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
    else:
        q = cast_fp8(x * scale[None, :], fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
    return q, tl.math.div_rn(1.0, scale)


@triton.jit
def _block_kernel(
    X,
    DATA,
    SCALE_INV,
    DATA_T,
    SCALE_INV_T,
    M,
    K,
    fp8_max,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr,
    GUARD: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    COLUMNWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Blockwise cast of a ``BLOCK_M x BLOCK_K`` tile (``BLOCK_K`` = 128; ``BLOCK_M`` = 128
    for 128x128 blocks and with ``COLUMNWISE``)."""
    # Inductor passes Python floats as fp64; Triton's own launcher as fp32.
    fp8_max = tl.cast(fp8_max, tl.float32)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    a = abs_bits(x)  # padding lanes are 0 and never raise a block's amax
    n_kb = tl.cdiv(K, BLOCK_K)
    mask_t = (cols[:, None] < K) & (rows[None, :] < M)
    offs_t = cols.to(tl.int64)[:, None] * M + rows[None, :]
    if BLOCK_ROWS == 1:
        q, scale_inv = cast_1x128(x, a, 1, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
        tl.store(SCALE_INV + rows.to(tl.int64) * n_kb + pid_k, scale_inv, mask=rows < M)
        if COLUMNWISE:
            # x^T in 1x128 blocks along M: one block per column of this tile.
            q_t, s_t = cast_1x128(x, a, 0, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, POW2, GUARD)
            tl.store(DATA_T + offs_t, as_stored(tl.trans(q_t), DATA_T), mask=mask_t)
            n_mb = tl.cdiv(M, BLOCK_M)
            tl.store(SCALE_INV_T + cols.to(tl.int64) * n_mb + pid_m, s_t, mask=cols < K)
    else:
        amax = tl.max(tl.max(a, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = block_scale(amax, fp8_max, POW2)
        q = cast_fp8(x * scale, fp8_max, E4M3, MBITS, BIAS, SOFTWARE, GUARD)
        scale_inv = tl.math.div_rn(1.0, scale)
        tl.store(SCALE_INV + pid_m * n_kb + pid_k, scale_inv)
        if COLUMNWISE:
            # A 128x128 block of x^T is the transposed block of x: same scale, same codes.
            tl.store(DATA_T + offs_t, as_stored(tl.trans(q), DATA_T), mask=mask_t)
            tl.store(SCALE_INV_T + pid_k * tl.cdiv(M, BLOCK_M) + pid_m, scale_inv)
    tl.store(DATA + offs, as_stored(q, DATA), mask=mask)


@triton.jit
def _dequant_kernel(
    DATA,
    SCALE_INV,
    OUT,
    M,
    K,
    E4M3: tl.constexpr,
    MBITS: tl.constexpr,
    BIAS: tl.constexpr,
    SOFTWARE: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    OUT_MAX: tl.constexpr,
):
    """``OUT = fp32(DATA) * SCALE_INV``; one scale (``BLOCK_ROWS == 0``) or one per block of
    ``BLOCK_ROWS x 128``. ``BF16_BITS``: ``OUT`` is a bf16 output seen as uint16, rounded here.
    Saturates at ``OUT_MAX``, the output's largest finite value, where the code is finite (NaN
    stays NaN), as the reference does."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    q = tl.load(DATA + offs, mask=mask, other=0)
    v = from_fp8_bits(q, E4M3, MBITS, BIAS, SOFTWARE)
    if BLOCK_ROWS == 0:
        s = tl.load(SCALE_INV)
    else:
        n_kb = tl.cdiv(K, 128)
        s_offs = (rows // BLOCK_ROWS).to(tl.int64)[:, None] * n_kb + (cols // 128)[None, :]
        s = tl.load(SCALE_INV + s_offs, mask=mask, other=0.0)
    y = v * s
    finite_code = tl.abs(v) < float("inf")  # an E5M2 infinity stays infinite
    y = tl.where(finite_code, tl.clamp(y, -OUT_MAX, OUT_MAX, propagate_nan=tl.PropagateNan.ALL), y)
    store_rounded(OUT + offs, y, mask, BF16_BITS)


# Launch wrappers -----------------------------------------------------------------------------


def amax_bits(like: Tensor, n: int = 1) -> Tensor:
    """A zeroed ``[n]`` fp32 buffer on ``like``'s device that kernels fold amaxes into (module
    docstring), one per element (the casts of one GEMM share one buffer, each given its slot as
    an int: one zero fill, no gather after; a view would be copied around the write by
    Inductor). Made from ``like`` (``new_zeros``): no device object per call."""
    return like.new_zeros(n, dtype=torch.float32)


def zero_amaxes(a: Tensor, b: Tensor | None = None) -> None:
    """Zero the ``[1]`` amax buffers ``a`` (and ``b``) in place, in one launch (Inductor's fill
    of a graph input would be a new buffer, copied in after the kernels that fold into it)."""
    launch(_zero_kernel, (1,))(a, a.new_empty(0) if b is None else b, TWO=b is not None)


def amax(x: Tensor, *, config: QuantizeLaunchConfig | None = None) -> Tensor:
    """``max|x|`` as a 1-element fp32 tensor (0 for an empty ``x``; NaN if any is NaN)."""
    return _amax_bits(x, config or DEFAULT_CONFIG)


def _amax_bits(x: Tensor, cfg: QuantizeLaunchConfig, out: Tensor | None = None, slot: int = 0):
    """:func:`amax`, folded into ``out[slot]`` (:func:`amax_bits`) where ``out`` is given."""
    x = dense(x)
    out = amax_bits(x) if out is None else out
    n = x.numel()
    if n:
        programs, chunk = _amax_split(x, cfg)
        launch(_amax_kernel, (programs,))(
            x, out, slot, n, chunk, BLOCK_SIZE=cfg.amax_block, num_warps=cfg.amax_num_warps
        )
    return out


def _amax_split(x: Tensor, cfg: QuantizeLaunchConfig) -> tuple[int, int]:
    """``(programs, chunk)`` of a non-empty ``x``'s amax pass: elements per program."""
    n = x.numel()
    cap = cfg.amax_programs or programs_per_sm(x.device, cfg.amax_per_sm)
    programs = min(cdiv(n, cfg.amax_block), cap)
    chunk = cdiv(cdiv(n, programs), cfg.amax_block) * cfg.amax_block
    return cdiv(n, chunk), chunk


@functools.cache
def _cuda_op(name: str):
    """``torch.ops.te_cuda.<name>`` (csrc/block_cast.cu) when the C++ extension was built with
    CUDA, else None (a CPU build, or no extension: the Triton kernels run)."""
    try:
        _csrc.load()
    except ImportError:
        return None
    return getattr(torch.ops.te_cuda, name, None)


def cuda_cast(cfg: QuantizeLaunchConfig, name: str, m: int, n: int, *tensors: Tensor | None):
    """The CUDA block cast ``name`` (``act_cast_1x128`` or ``cast_128x128``: both layouts, one
    read) when it covers a ``[m, n]`` call on ``tensors`` (the input, and the bias / gradient
    where given): CUDA bf16 tensors, 16-byte aligned, ``m`` and ``n`` whole 128x128 tiles; else
    None (the Triton kernels run)."""
    if not cfg.cuda_kernels or not (0 < m // BLOCK <= 65535 and m % BLOCK == 0 and n % BLOCK == 0):
        return None
    given = [t for t in tensors if t is not None]
    if tracing() or not all(
        t.is_cuda and t.dtype is torch.bfloat16 and aligned16(t) for t in given
    ):
        return None  # the C++ kernel has no fake: traced code launches the Triton kernels
    return _cuda_op(name)


def _one(scale: Tensor) -> Tensor:
    """A delayed scale as the ``[1]`` contiguous tensor the casts read (the ``[1]`` views of
    ``functional.gemm.scale_slots`` as they are: no torch call)."""
    return scale if scale.shape == (1,) and scale.is_contiguous() else dense(scale.reshape(1))


def _transposed(x: Tensor, m: int, k: int, dtype: torch.dtype, columnwise: bool) -> Tensor:
    return x.new_empty((k, m) if columnwise else (0,), dtype=dtype)


def _cast(
    shape: torch.Size,
    x: Tensor,
    scale: Tensor,
    bits: Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    cfg: QuantizeLaunchConfig,
    from_amax: bool,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
    slot: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The per-tensor cast of both recipes: ``(data, data_t, scale_inv, amax)`` (``_cast_kernel``'s
    ``FROM_AMAX``) of ``x``, ``as_rows`` of a tensor of ``shape``, the shape of ``data``; the
    amax in ``bits[slot]``."""
    m, k = x.shape
    data = torch.empty(shape, device=x.device, dtype=fp8_dtype)
    data_t = _transposed(x, m, k, fp8_dtype, columnwise)
    if not from_amax and not m * k:
        return data, data_t, reciprocal_rn(scale), bits
    scale_inv = torch.empty(1, device=x.device, dtype=torch.float32)
    launch(_cast_kernel, grid_2d(m, k, cfg.block_m, cfg.block_k))(
        x,
        scale,
        bits,
        slot,
        fp8_out(data),
        fp8_out(data_t),
        scale_inv,
        m,
        k,
        FORMATS[fp8_dtype].max,
        amax_epsilon,
        **cast_args(fp8_dtype, software_convert(x.device, cfg), x.dtype),
        FROM_AMAX=from_amax,
        POW2=power_2_scale,
        COLUMNWISE=columnwise,
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )
    return data, data_t, scale_inv, bits


def quantize_tensorwise(
    x: Tensor,
    scale: Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    *,
    config: QuantizeLaunchConfig | None = None,
    amax: Tensor | None = None,
    slot: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Delayed scaling: ``(data, data_t, scale_inv, amax)`` from one read of ``x`` (see the
    op; ``scale_inv``: ``1 / scale`` correctly rounded, written by the cast, ``reciprocal_rn``'s
    value; for an empty ``x`` computed by that function). ``amax``: a GEMM's zeroed buffer
    (:func:`amax_bits`) whose element ``slot`` takes the amax; the returned ``amax`` is then that
    whole buffer as fp32."""
    scale = _one(scale)
    cfg = config or DEFAULT_CONFIG
    bits = amax_bits(x) if amax is None else amax
    return _cast(x.shape, as_rows(x)[0], scale, bits, fp8_dtype, columnwise, cfg, False,
                 slot=slot)  # fmt: skip


def quantize_current(
    x: Tensor,
    fp8_dtype: torch.dtype,
    columnwise: bool,
    amax_epsilon: float = 0.0,
    power_2_scale: bool = False,
    *,
    config: QuantizeLaunchConfig | None = None,
    amax: Tensor | None = None,
    slot: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Current scaling: ``(data, data_t, scale_inv, amax)``; two reads of ``x`` (the amax
    reduction, then the cast). ``amax`` / ``slot``: as :func:`quantize_tensorwise`'s."""
    cfg = config or DEFAULT_CONFIG
    x2 = as_rows(x)[0]
    bits = _amax_bits(x2, cfg, amax, slot)
    # SCALE (the second ``bits``) is unused with FROM_AMAX.
    return _cast(x.shape, x2, bits, bits, fp8_dtype, columnwise, cfg, True, amax_epsilon,
                 power_2_scale, slot)  # fmt: skip


def quantize_pair(
    x: tuple[Tensor, Tensor],
    fp8_dtype: torch.dtype,
    columnwise: tuple[bool, bool],
    bits: Tensor,
    slots: tuple[int, int],
    scale: tuple[Tensor | None, Tensor | None] = (None, None),
    *,
    config: QuantizeLaunchConfig | None = None,
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Two per-tensor casts to one ``fp8_dtype``, each tensor's result bit for bit the one
    :func:`quantize_current` (``scale`` ``(None, None)``) or :func:`quantize_tensorwise` (the
    delayed ``scale`` of each) gives with ``amax=bits`` and its slot, in one launch for both
    amax passes and one for both casts (a GEMM's two operands: two launches fewer). Tensors of
    two dtypes or an empty one are cast one after the other."""
    cfg = config or DEFAULT_CONFIG
    x2 = [as_rows(t)[0] for t in x]
    from_amax = scale[0] is None
    if x2[0].dtype != x2[1].dtype or not all(t.numel() for t in x2):
        if from_amax:
            return [quantize_current(t, fp8_dtype, c, config=cfg, amax=bits, slot=i)
                    for t, c, i in zip(x, columnwise, slots, strict=True)]  # fmt: skip
        return [quantize_tensorwise(t, s, fp8_dtype, c, config=cfg, amax=bits, slot=i)
                for t, s, c, i in zip(x, scale, columnwise, slots, strict=True)]  # fmt: skip
    if from_amax:  # both amax passes; the casts read the amaxes (SCALE unused)
        (p0, c0), (p1, c1) = (_amax_split(t, cfg) for t in x2)
        launch(_amax_pair_kernel, (p0 + p1,))(
            x2[0], x2[1], bits, *slots, x2[0].numel(), c0, p0, x2[1].numel(), c1,
            BLOCK_SIZE=cfg.amax_block, num_warps=cfg.amax_num_warps,
        )  # fmt: skip
        scale = (bits, bits)
    else:
        scale = tuple(_one(s) for s in scale)
    out, args = [], []
    for t, xt, s, c, i in zip(x, x2, scale, columnwise, slots, strict=True):
        m, k = xt.shape
        data = torch.empty(t.shape, device=t.device, dtype=fp8_dtype)
        data_t = _transposed(xt, m, k, fp8_dtype, c)
        scale_inv = torch.empty(1, device=t.device, dtype=torch.float32)
        out.append((data, data_t, scale_inv, bits))
        args += [xt, s, i, fp8_out(data), fp8_out(data_t), scale_inv, m, k]
    tiles = sum(cdiv(t.shape[0], cfg.block_m) * cdiv(t.shape[1], cfg.block_k) for t in x2)
    launch(_cast_pair_kernel, (tiles,))(
        *args, bits, FORMATS[fp8_dtype].max, 0.0,
        **cast_args(fp8_dtype, software_convert(x2[0].device, cfg), x2[0].dtype),
        FROM_AMAX=from_amax, POW2=False, COLUMNWISE0=columnwise[0],
        COLUMNWISE1=columnwise[1], BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out


def quantize_blockwise(
    x: Tensor,
    fp8_dtype: torch.dtype,
    block_rows: int,
    power_2_scale: bool,
    columnwise: bool,
    *,
    out_t: tuple[Tensor, Tensor] | None = None,
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Blockwise: ``(data, scale_inv, data_t, scale_inv_t)``, one read of ``x`` (see the op).
    ``out_t`` (with ``columnwise``): ``(data_t, scale_inv_t)`` to write the transposed copy
    into, e.g. views of a larger buffer, returned: ``data_t`` contiguous ``[K, M]`` of
    ``fp8_dtype`` or uint8, ``scale_inv_t`` fp32, compact or rows-major (strides ``(1, K)``,
    the GEMM's layout, :func:`block_scales`; written in place by the CUDA kernel, else
    through a compact copy)."""
    cfg = config or DEFAULT_CONFIG
    x2, m, k = as_rows(x)
    block_m = cfg.block_m if block_rows == 1 and not columnwise else BLOCK
    data = torch.empty(x.shape, device=x.device, dtype=fp8_dtype)
    f32 = torch.float32
    scale_inv = x.new_empty((cdiv(m, block_rows), cdiv(k, BLOCK)), dtype=f32)
    t_shape = (cdiv(k, block_rows), cdiv(m, BLOCK)) if columnwise else (0,)
    if out_t is None:
        data_t = _transposed(x, m, k, fp8_dtype, columnwise)
        scale_inv_t = x.new_empty(t_shape, dtype=f32)
    else:
        data_t, given_scale_t = out_t
        if not (
            columnwise
            and data_t.shape == (k, m)
            and data_t.dtype in (fp8_dtype, torch.uint8)
            and given_scale_t.shape == t_shape
            and given_scale_t.dtype is f32
            and data_t.is_contiguous()
            and (given_scale_t.is_contiguous() or given_scale_t.stride() == (1, t_shape[0]))
        ):
            raise ValueError(
                f"quantize_blockwise: out_t must be ([{k}, {m}] {fp8_dtype} or uint8, contiguous; "
                f"{list(t_shape)} float32, compact or with strides (1, {t_shape[0]})) with "
                "columnwise=True"
            )
        data_t = data_t.view(fp8_dtype)
        scale_inv_t = given_scale_t
    name = "act_cast_1x128" if block_rows == 1 else "cast_128x128"
    cuda = cuda_cast(cfg, name, m, k, x2) if columnwise else None
    if cuda is None and not scale_inv_t.is_contiguous():  # the Triton kernel writes compact
        scale_inv_t = x.new_empty(t_shape, dtype=f32)
    f = FORMATS[fp8_dtype]
    if cuda is not None and block_rows == 1:  # one read, both layouts (csrc/block_cast.cu)
        cuda(x2, None, None, uint8_view(data).view(m, k), scale_inv, uint8_view(data_t),
             scale_inv_t, None, f.max, f.e4m3, power_2_scale, "identity")  # fmt: skip
    elif cuda is not None:
        cuda(x2, uint8_view(data).view(m, k), scale_inv, uint8_view(data_t), scale_inv_t, f.max,
             f.e4m3, power_2_scale)  # fmt: skip
    elif m * k:
        launch(_block_kernel, (cdiv(m, block_m), cdiv(k, BLOCK)))(
            x2,
            fp8_out(data),
            scale_inv,
            fp8_out(data_t),
            scale_inv_t,
            m,
            k,
            f.max,
            **cast_args(fp8_dtype, software_convert(x.device, cfg), x.dtype),
            POW2=power_2_scale,
            BLOCK_ROWS=block_rows,
            COLUMNWISE=columnwise,
            BLOCK_M=block_m,
            BLOCK_K=BLOCK,
            num_warps=cfg.block_num_warps if block_m == BLOCK else cfg.num_warps,
        )
    if out_t is not None and scale_inv_t is not out_t[1]:
        scale_inv_t = out_t[1].copy_(scale_inv_t)
    return data, scale_inv, data_t, scale_inv_t


def block_scales(x: Tensor, rows: int, blocks: int, mn_major: bool) -> Tensor:
    """An fp32 ``[rows, blocks]`` block-scale tensor on ``x``'s device: compact, or with
    ``mn_major`` rows-major (strides ``(1, rows)``), the layout cuBLAS's blockwise-scaled GEMM
    takes for a 1x128-scaled operand (``functional.gemm.block_scaled_mm`` then
    passes it without a copy)."""
    if mn_major:
        return x.new_empty((blocks, rows), dtype=torch.float32).t()
    return x.new_empty((rows, blocks), dtype=torch.float32)


def quantize_blockwise_sums(
    x: Tensor,
    fp8_dtype: torch.dtype,
    power_2_scale: bool,
    *,
    mn_major: tuple[bool, bool] = (False, False),
    config: QuantizeLaunchConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``quantize_blockwise(x, fp8_dtype, 1, power_2_scale, True)`` and the fp32 column sums
    of ``x`` (``[K]``; a bias gradient when ``x`` is an output gradient): ``(data, scale_inv,
    data_t, scale_inv_t, sums)``. Where the CUDA kernel covers ``x``, one read of it: the sums
    are per-128-row-tile partials added afterwards (another order than ``x.sum(0)``: equal to
    rounding), and ``mn_major`` asks for ``scale_inv`` / ``scale_inv_t`` in the GEMM's layout
    (:func:`block_scales`; elsewhere they are compact: callers take either)."""
    cfg = config or DEFAULT_CONFIG
    x2, m, k = as_rows(x)
    cuda = cuda_cast(cfg, "act_cast_1x128", m, k, x2)
    if cuda is None:
        return (*quantize_blockwise(x, fp8_dtype, 1, power_2_scale, True, config=cfg),
                x2.sum(0, dtype=torch.float32))  # fmt: skip
    data = torch.empty(x.shape, device=x.device, dtype=fp8_dtype)
    data_t = x.new_empty((k, m), dtype=fp8_dtype)
    scale_inv = block_scales(x, m, k // BLOCK, mn_major[0])
    scale_inv_t = block_scales(x, k, m // BLOCK, mn_major[1])
    part = x.new_empty((m // BLOCK, k), dtype=torch.float32)
    f = FORMATS[fp8_dtype]
    cuda(x2, None, None, uint8_view(data).view(m, k), scale_inv, uint8_view(data_t), scale_inv_t,
         part, f.max, f.e4m3, power_2_scale, "identity")  # fmt: skip
    return data, scale_inv, data_t, scale_inv_t, part.sum(0)


def _dequantize(
    data: Tensor,
    scale_inv: Tensor,
    block_rows: int,
    out_dtype: torch.dtype,
    cfg: QuantizeLaunchConfig,
) -> Tensor:
    q, m, k = as_rows(data)
    out = torch.empty(data.shape, device=data.device, dtype=out_dtype)
    software = software_convert(data.device, cfg)
    out_arg, bf16_bits = rounded_out(out, software)
    if m * k:
        launch(_dequant_kernel, grid_2d(m, k, cfg.block_m, cfg.block_k))(
            uint8_view(q),
            scale_inv.contiguous(),
            out_arg,
            m,
            k,
            **fp8_args(data.dtype, software),
            BF16_BITS=bf16_bits,
            BLOCK_ROWS=block_rows,
            BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_k,
            OUT_MAX=torch.finfo(out_dtype).max,
            num_warps=cfg.num_warps,
        )
    return out


def dequantize_tensorwise(
    data: Tensor,
    scale_inv: Tensor,
    out_dtype: torch.dtype,
    *,
    config: QuantizeLaunchConfig | None = None,
) -> Tensor:
    """``fp32(data) * scale_inv`` rounded to ``out_dtype``; ``scale_inv`` has one element."""
    return _dequantize(data, scale_inv.reshape(1), 0, out_dtype, config or DEFAULT_CONFIG)


def dequantize_blockwise(
    data: Tensor,
    scale_inv: Tensor,
    block_rows: int,
    out_dtype: torch.dtype,
    *,
    config: QuantizeLaunchConfig | None = None,
) -> Tensor:
    """``fp32(data) * scale_inv`` per ``block_rows x 128`` block of the ``[M, K]`` view."""
    return _dequantize(data, scale_inv, block_rows, out_dtype, config or DEFAULT_CONFIG)
