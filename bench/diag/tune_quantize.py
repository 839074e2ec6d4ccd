"""Diagnostics for the FP8 per-tensor quantisation kernels on a GPU (not a benchmark of record):
a sweep of the cast kernels' tiles and warps at the MLP benchmark's largest tensor, with the
effective bandwidth of each launch, for ``quantize_current`` (amax pass + cast with the
transposed copy), ``quantize_tensorwise`` (delayed: one pass) and ``act_quantize`` (gelu fused,
forward and backward), and the activation kernel they replace, for comparison.

    python -m bench.diag.tune_quantize            # prints tables; GPU only
"""

from __future__ import annotations

import itertools

import torch
from triton.testing import do_bench

from te_compile.kernels import act_quantize as AQ
from te_compile.kernels import activation as A
from te_compile.kernels import quantize as Q

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def main(m: int = 16384, n: int = 16384, parts: str = "all") -> None:
    """``parts``: "all", "pertensor" (the per-tensor sweep) or "block" (the blockwise ones)."""
    torch.manual_seed(0)
    z = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(z)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([8.0], device="cuda")
    numel = m * n
    print(f"tensor [{m}, {n}] bf16; bytes per pass: read 2/elem, write 1+1/elem (data + data_t)")

    def row(name, fn, nbytes):
        ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
        print(f"  {name:<52} {ms * 1e3:8.0f} us  {_gbps(nbytes, ms):7.0f} GB/s")
        return ms

    if parts in ("all", "pertensor"):
        _per_tensor(z, g, b, scale, m, numel, row)
    if parts in ("all", "block"):
        _blockwise(z, g, b, m, numel, row)


def _per_tensor(z, g, b, scale, m, numel, row) -> None:
    print("reference launches (defaults):")
    row("amax", lambda: Q.amax(z), 2 * numel)
    row("gelu+bias fwd (activation kernel)", lambda: A.activation_forward(z, b, "gelu"), 4 * numel)
    row(
        "gelu+bias bwd + dbias (activation kernel)",
        lambda: A.activation_backward(g, z, b, "gelu", need_dbias=True),
        6 * numel,
    )
    print("sweep (block_m x block_k, warps):")
    results = []
    for bm, bk, warps in itertools.product((64, 128), (64, 128), (4, 8)):
        cfg = Q.QuantizeLaunchConfig(block_m=bm, block_k=bk, num_warps=warps)
        tag = f"{bm}x{bk} w{warps}"
        try:
            t_cur = row(
                f"quantize_current {tag}",
                lambda cfg=cfg: Q.quantize_current(z, E4M3, True, config=cfg),
                6 * numel,
            )
            t_del = row(
                f"quantize_tensorwise {tag}",
                lambda cfg=cfg: Q.quantize_tensorwise(z, scale, E4M3, True, config=cfg),
                4 * numel,
            )
            t_af = row(
                f"act_quantize gelu fwd current {tag}",
                lambda cfg=cfg: AQ.act_quantize(
                    z, b, None, "gelu", E4M3, None, m, True, False, config=cfg
                ),
                6 * numel,
            )
            t_ab = row(
                f"act_quantize gelu bwd current + dbias {tag}",
                lambda cfg=cfg: AQ.act_quantize(
                    z, b, g, "gelu", E5M2, None, m, True, True, config=cfg
                ),
                10 * numel,
            )
            t_ad = row(
                f"act_quantize gelu bwd delayed + dbias {tag}",
                lambda cfg=cfg: AQ.act_quantize(
                    z, b, g, "gelu", E5M2, scale, m, True, True, config=cfg
                ),
                6 * numel,
            )
        except Exception as e:  # a tile too large for the registers / shared memory
            print(f"  {tag}: {type(e).__name__}: {str(e)[:80]}")
            continue
        results.append((t_cur + t_af + t_ab, tag, t_cur, t_del, t_af, t_ab, t_ad))
    print("best by current (cast + fused fwd + fused bwd):")
    for total, tag, *ts in sorted(results)[:5]:
        print(
            f"  {tag:<12} total {total * 1e3:7.0f} us  " + " ".join(f"{t * 1e3:6.0f}" for t in ts)
        )


def _blockwise(z, g, b, m, numel, row) -> None:
    print("blockwise (Float8BlockScaling) casts, both layouts, by warps of a 128-row tile:")
    for warps in (4, 8, 16):
        cfg = Q.QuantizeLaunchConfig(block_num_warps=warps)
        for rows, what in ((1, "1x128"), (128, "128x128")):
            row(
                f"quantize_blockwise {what} w{warps}",
                lambda cfg=cfg, rows=rows: Q.quantize_blockwise(
                    z, E4M3, rows, False, True, config=cfg
                ),
                6 * numel,
            )
    # One 128x128 tile per program, or the split passes (the default). Programs walking a column
    # of tiles, with and without software pipelining (tl.range num_stages=2), are no faster (941
    # against 968 us forward at best on the H100), pipelined much slower; one 128x128 tile a
    # program read in [16..64, 128] row pieces twice, the columnwise pass re-reading from L2, is
    # slower than the split passes (889-1563 / 1819-4382 us against 649 / 1105). Those variants
    # are not in the library; their runs: bench/results/2026-11-22_h100/tune_quantize_block.log
    # and tune_quantize_block_reload.log.
    print("fused gelu + 1x128 cast (act_quantize_block): one 128x128 tile, or split passes:")
    variants = [dict(block_split=False, block_num_warps=8)]
    variants += [
        dict(block_split_m=bm, block_split_n=bn, num_warps=w)
        for bm, bn, w in ((32, 32, 4), (16, 32, 4), (32, 64, 4), (64, 32, 4), (32, 32, 8))
    ]
    for kw in variants:
        cfg = Q.QuantizeLaunchConfig(**kw)
        if cfg.block_split:
            tag = f"split {cfg.block_split_m}/{cfg.block_split_n} w{cfg.num_warps}"
        else:
            tag = f"one tile w{cfg.block_num_warps}"
        row(
            f"act_quantize_block gelu fwd {tag}",
            lambda cfg=cfg: AQ.act_quantize_block(
                z, b, None, "gelu", E4M3, m, False, False, config=cfg
            ),
            6 * numel,
        )
        row(
            f"act_quantize_block gelu bwd + dbias {tag}",
            lambda cfg=cfg: AQ.act_quantize_block(
                z, b, g, "gelu", E4M3, m, True, False, config=cfg
            ),
            8 * numel,
        )


if __name__ == "__main__":
    import sys

    main(parts=sys.argv[1] if len(sys.argv) > 1 else "all")
