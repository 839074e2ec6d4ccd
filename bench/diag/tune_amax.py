"""Diagnostics for the amax pass of current scaling on a GPU (not a benchmark of record): the
library's ``_amax_kernel`` (contiguous chunks, one atomic per program) over elements per step,
warps and programs per SM, and two variants written here for comparison, at the weight and
gradient shapes of bench_block's h2048 / h4096 layers; each launch's median us and GB/s.

* ``strided``: program ``p`` reduces steps ``p, p + P, p + 2P, ...`` (all programs sweep the
  tensor together) instead of a contiguous chunk;
* ``staged``: the library's loop as ``tl.range(..., num_stages=3)`` (software-pipelined loads).

    python -m bench.diag.tune_amax            # GPU only; writes to stdout
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from te_compile.kernels import cdiv, programs_per_sm
from te_compile.kernels import quantize as Q
from te_compile.kernels.fp8 import abs_bits

SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (16384, 2048), (8192, 2048)]


@triton.jit
def _strided(X, AMAX_BITS, numel, programs, BLOCK_SIZE: tl.constexpr):
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    for s in range(tl.program_id(0) * BLOCK_SIZE, numel, programs * BLOCK_SIZE):
        offs = s + tl.arange(0, BLOCK_SIZE)
        x = tl.load(X + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
    tl.atomic_max(AMAX_BITS.to(tl.pointer_type(tl.int32)), tl.max(acc, axis=0))


@triton.jit
def _staged(X, AMAX_BITS, numel, chunk, BLOCK_SIZE: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * chunk
    end = tl.minimum(start + chunk, numel)
    acc = tl.zeros([BLOCK_SIZE], dtype=tl.int32)
    for s in tl.range(start, end, BLOCK_SIZE, num_stages=3):
        offs = s + tl.arange(0, BLOCK_SIZE)
        x = tl.load(X + offs, mask=offs < end, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
    tl.atomic_max(AMAX_BITS.to(tl.pointer_type(tl.int32)), tl.max(acc, axis=0))


def _sweep(shape: tuple[int, int], out: torch.Tensor) -> list[tuple[float, str]]:
    """``(ms, tag)`` of every launch at ``shape``, fastest first; a wrong amax is reported."""
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    ref = x.abs().max().float().reshape(1)
    results = []

    def run(tag, fn):
        out.zero_()
        fn()
        if not torch.equal(out, ref):
            print(f"  {tag}: WRONG amax {out.item()} != {ref.item()}")
            return
        results.append((do_bench(fn, warmup=10, rep=50, return_mode="median"), tag))

    def library(kernel, grid, args, block, warps):
        return lambda: kernel[grid](*args, BLOCK_SIZE=block, num_warps=warps)

    sweep = itertools.product((2048, 4096, 8192, 16384), (4, 8, 16), (4, 16, 64, 4096))
    for block, warps, per_sm in sweep:
        programs = min(cdiv(n, block), programs_per_sm(x.device, per_sm))
        chunk = cdiv(cdiv(n, programs), block) * block
        grid = (cdiv(n, chunk),)
        tag = f"block {block} w{warps} {per_sm}/SM"
        run(f"library {tag}", library(Q._amax_kernel, grid, (x, out, 0, n, chunk), block, warps))
        run(f"staged {tag}", library(_staged, grid, (x, out, n, chunk), block, warps))
        run(f"strided {tag}", library(_strided, (programs,), (x, out, n, programs), block, warps))
    return sorted(results)


def main() -> None:
    torch.manual_seed(0)
    out = torch.zeros(1, device="cuda")
    totals: dict[str, list[float]] = {}
    for shape in SHAPES:
        results = _sweep(shape, out)
        for ms, tag in results:
            totals.setdefault(tag, []).append(ms)
        nbytes = 2 * shape[0] * shape[1]
        default = next(ms for ms, tag in results if tag == "library block 4096 w4 4/SM")
        print(f"[{shape[0]}, {shape[1]}] bf16, {nbytes / 1e6:.0f} MB; library default "
              f"{default * 1e3:.1f} us ({nbytes / default / 1e6:.0f} GB/s); best:")  # fmt: skip
        for ms, tag in results[:8]:
            print(f"  {tag:<36} {ms * 1e3:7.1f} us  {nbytes / ms / 1e6:5.0f} GB/s")
    # The library launch fastest over all shapes together (4096 per SM: one step a program).
    ranked = sorted((sum(t), tag) for tag, t in totals.items() if len(t) == len(SHAPES))
    print("all shapes, summed:")
    for total, tag in ranked[:6]:
        print(f"  {tag:<36} {total * 1e3:7.1f} us")
    best = next(tag for _, tag in ranked if tag.startswith("library"))
    default = sum(totals["library block 4096 w4 4/SM"]) * 1e3
    print(f"BEST {best} (default {default:.1f} us)")


if __name__ == "__main__":
    main()
