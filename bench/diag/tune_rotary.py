"""A sweep of the RoPE kernel's launch parameters on a GPU (not a benchmark of record): does
another tiling bring the query tensor's forward and backward from ~76% of copy bandwidth
(``bench_rope``, H200) to the 85% target?

For ``q sbhd`` (``[4096, 2, 32, 128]`` bf16), forward and backward, every ``RotaryLaunchConfig``
of ``block_t x block_h`` in a grid around the default (up to all 32 heads a program, walked in
unrolled groups of ``head_unroll``), ``block_p`` 64 (a 128-channel head in one chunk), 4 or 8
warps: the kernel's time (``torch.profiler`` kernel durations, as ``bench_rope --timer
kernels``) and its share of the copy bandwidth measured the same way on the same bytes. ``q thd``
(``[8192, 32, 128]``, 8 sequences): the default and the best eight of ``q sbhd``. The default
tiling's row is marked.

    python -m bench.diag.tune_rotary            # prints a table; GPU only
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import te_compile as te
from bench.harness import time_kernels
from te_compile.kernels import rotary as R


def _case(name: str):
    dev, dtype = "cuda", torch.bfloat16
    if name == "q thd":
        x = torch.randn(8192, 32, 128, device=dev, dtype=dtype)
        cu = torch.tensor([0, 700, 1900, 2300, 4100, 5000, 6600, 7100, 8192], device=dev)
        return x, te.RotaryPositionEmbedding(128, device=dev)(8192), cu.int(), "thd"
    x = torch.randn(4096, 2, 32, 128, device=dev, dtype=dtype)
    return x, te.RotaryPositionEmbedding(128, device=dev)(4096), None, "sbhd"


def main() -> int:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}\n")
    print(
        "| case | block_t x block_h x block_p | warps | fwd us | bwd us | % of copy (fwd / bwd) |"
    )
    print("| --- | --- | ---: | ---: | ---: | --- |")
    best = _sweep("q sbhd", _grid())
    _sweep("q thd", best[:8])
    return 0


def _grid() -> list:
    configs = []
    for block_t, block_h, unroll, warps in itertools.product(
        (8, 16, 32), (4, 8, 16, 32), (4, 8), (4, 8)
    ):
        if unroll <= block_h:
            configs.append(R.RotaryLaunchConfig(block_t, block_h, 64, 128, warps, unroll))
    return configs


def _sweep(name: str, grid: list) -> list:
    """Prints the best twelve rows and the default's; returns the configs, fastest first."""
    x, freqs, cu, fmt = _case(name)
    src = x.view(-1).view(torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_us = time_kernels(lambda: dst.copy_(src)).median_ms * 1e3
    default = R.launch_config(32, 64, 0)
    configs = {default, *grid}
    rows = []
    for cfg in sorted(configs, key=lambda c: dataclasses.astuple(c)):
        times = []
        for backward in (False, True):

            def fn(cfg=cfg, backward=backward):
                R.rotary(x, freqs, cu, fmt, False, 1, 0, backward=backward, config=cfg)

            fn()  # compile this specialisation outside the profile
            times.append(time_kernels(fn).median_ms * 1e3)
        rows.append((cfg, *times))
    rows.sort(key=lambda r: r[1] + r[2])
    for cfg, fwd, bwd in rows[:12]:
        mark = " (default)" if cfg == default else ""
        tile = f"{cfg.block_t} x {cfg.block_h} (by {cfg.head_unroll}) x {cfg.block_p}{mark}"
        share = f"{100 * copy_us / fwd:.0f}% / {100 * copy_us / bwd:.0f}%"
        print(f"| {name} | {tile} | {cfg.num_warps} | {fwd:.1f} | {bwd:.1f} | {share} |")
    fwd, bwd = next((f, b) for c, f, b in rows if c == default)
    print(f"| {name} | default | {default.num_warps} | {fwd:.1f} | {bwd:.1f} | "
          f"{100 * copy_us / fwd:.0f}% / {100 * copy_us / bwd:.0f}% |")  # fmt: skip
    return [cfg for cfg, *_ in rows]


if __name__ == "__main__":
    sys.exit(main())
