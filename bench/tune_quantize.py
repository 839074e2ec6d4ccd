"""Diagnostics for the FP8 per-tensor quantisation kernels on a GPU (not a benchmark of record):
a sweep of the cast kernels' tiles and warps at the MLP benchmark's largest tensor, with the
effective bandwidth of each launch, for ``quantize_current`` (amax pass + cast with the
transposed copy), ``quantize_tensorwise`` (delayed: one pass) and ``act_quantize`` (gelu fused,
forward and backward), and the activation kernel they replace, for comparison.

    python -m bench.tune_quantize            # prints tables; GPU only
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


def main(m: int = 16384, n: int = 16384) -> None:
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

    print("reference launches (defaults):")
    row("amax", lambda: Q.amax(z), 2 * numel)
    row("gelu+bias fwd (activation kernel)", lambda: A.activation_forward(z, b, "gelu"), 4 * numel)
    row(
        "gelu+bias bwd + dbias (activation kernel)",
        lambda: A.activation_backward(g, z, b, "gelu", need_dbias=True),
        6 * numel,
    )
    print("cast kernel (quantize_current, quantize_tensorwise), defaults and 64x128 w8:")
    for cfg in (Q.QuantizeLaunchConfig(), Q.QuantizeLaunchConfig(block_k=128, num_warps=8)):
        tag = f"{cfg.block_m}x{cfg.block_k} w{cfg.num_warps}"
        row(
            f"quantize_current {tag}",
            lambda cfg=cfg: Q.quantize_current(z, E4M3, True, config=cfg),
            6 * numel,
        )
        row(
            f"quantize_tensorwise {tag}",
            lambda cfg=cfg: Q.quantize_tensorwise(z, scale, E4M3, True, config=cfg),
            4 * numel,
        )
    print("act_quantize sweep (block_m x block_k, warps, programs per SM; None: a tile each):")
    results = []
    for (bm, bk), warps, per_sm in itertools.product(
        ((64, 64), (64, 128), (128, 64)), (4, 8), (4, 8, None)
    ):
        cfg = Q.QuantizeLaunchConfig(block_m=bm, block_k=bk, num_warps=warps)
        tag = f"{bm}x{bk} w{warps} p{per_sm}"

        def aq(grad, fp8, s, dbias, cfg=cfg, per_sm=per_sm):
            return AQ.act_quantize(
                z, b, grad, "gelu", fp8, s, m, True, dbias, config=cfg, programs_per_sm=per_sm
            )

        try:
            t_af = row(f"gelu fwd current {tag}", lambda: aq(None, E4M3, None, False), 6 * numel)
            t_df = row(f"gelu fwd delayed {tag}", lambda: aq(None, E4M3, scale, False), 4 * numel)
            t_ab = row(
                f"gelu bwd current + dbias {tag}", lambda: aq(g, E5M2, None, True), 10 * numel
            )
            t_ad = row(
                f"gelu bwd delayed + dbias {tag}", lambda: aq(g, E5M2, scale, True), 6 * numel
            )
        except Exception as e:  # a tile too large for the registers / shared memory
            print(f"  {tag}: {type(e).__name__}: {str(e)[:80]}")
            continue
        results.append((t_af + t_ab, t_df + t_ad, tag))
    print("blockwise 1x128 with the columnwise copy (128x128 tiles), by warps:")
    for warps in (4, 8, 16):
        cfg = Q.QuantizeLaunchConfig(block_num_warps=warps)
        row(
            f"quantize_blockwise 1x128 columnwise w{warps}",
            lambda cfg=cfg: Q.quantize_blockwise(z, E4M3, 1, False, True, config=cfg),
            4 * numel,
        )
    print("best by current (fused fwd + bwd), then by delayed:")
    for total, delayed, tag in sorted(results)[:4]:
        print(f"  {tag:<16} current {total * 1e3:7.0f} us  delayed {delayed * 1e3:7.0f} us")
    for total, delayed, tag in sorted(results, key=lambda r: r[1])[:4]:
        print(f"  {tag:<16} current {total * 1e3:7.0f} us  delayed {delayed * 1e3:7.0f} us")


if __name__ == "__main__":
    main()
