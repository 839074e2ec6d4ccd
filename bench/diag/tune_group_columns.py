"""Launch sweep of ``kernels.quantize_rows.quantize_group_columns`` (the grouped FP8 wgrad's
operands: per (token group, column) current scales, transposed into 16-padded groups) at
bench_grouped's shapes: 32768 tokens in 8 uneven groups, 4096 columns (the input) and 2048
(the gradient), bf16. Prints us per call and the bandwidth of its minimal traffic (the input
read twice, the FP8 copy written once) next to a device copy of the input. GPU only.

    python -m bench.diag.tune_group_columns
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from triton.testing import do_bench

from te_compile.kernels import quantize_rows

CONFIGS = [  # (block_n rows, block_k columns, num_warps)
    (64, 64, 4), (128, 32, 4), (256, 16, 4), (128, 64, 8), (256, 32, 8), (64, 128, 4),
    (32, 128, 4), (128, 128, 8), (256, 64, 8), (512, 16, 8),
]  # fmt: skip


def main() -> int:
    torch.manual_seed(0)
    groups, m = 8, 32768
    w = torch.rand(groups) + 0.2
    splits = (w / w.sum() * m).floor().to(torch.int64)
    splits[-1] += m - splits.sum()
    splits = splits.cuda()
    ends = splits.cumsum(0).to(torch.int32)
    pad_ends = ((splits + 15) // 16 * 16).cumsum(0).to(torch.int32)
    capacity = (m + 15 * groups + 15) // 16 * 16
    print(f"{torch.cuda.get_device_name()}, splits {splits.tolist()}")
    for k in (4096, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        gbytes = (2 * x.numel() * 2 + x.numel()) / 1e9
        ms = do_bench(lambda x=x: x.clone(), warmup=25, rep=200)
        print(
            f"[{m}, {k}] copy: {ms * 1e3:7.1f} us ({2 * x.numel() * 2 / 1e9 / ms * 1e3:6.0f} GB/s)"
        )
        for bn, bk, nw in CONFIGS:

            def call(x=x, bn=bn, bk=bk, nw=nw):
                return quantize_rows.quantize_group_columns(
                    x, ends, pad_ends, capacity, torch.float8_e4m3fn,
                    block_n=bn, block_k=bk, num_warps=nw,
                )  # fmt: skip

            try:
                ms = do_bench(call, warmup=25, rep=200)
            except Exception as exc:  # a config that does not compile: say so, go on
                print(f"  {bn:4d} x {bk:4d} w{nw}: {type(exc).__name__}")
                continue
            print(f"  {bn:4d} x {bk:4d} w{nw}: {ms * 1e3:7.1f} us ({gbytes / ms * 1e3:6.0f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
