"""The per-tensor quantisation launches of one bench_block layer, kernel by kernel, at the
block's shapes (not a benchmark of record): where current scaling's amax passes and delayed
scaling's amax-folding casts spend their time, and at what bandwidth.

For each size (h2048, h4096: SwiGLU ``z`` ``[T, 2F]``, its gradient ``dh`` ``[T, F]``, fc1's
and fc2's weights, an activation gradient ``[T, H]``) and each launch configuration, the fused
SwiGLU quantisation forward and backward and the plain per-tensor casts, current and delayed,
run under ``torch.profiler``; each kernel's median us and the GB/s of the bytes it must move.

    python -m bench.diag.diag_amax_passes            # GPU only; writes to stdout
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.harness import _cuda_kernels
from te_compile.kernels import act_quantize as AQ
from te_compile.kernels import quantize as Q

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SIZES = {"h2048": (8192, 2048, 8192), "h4096": (4096, 4096, 14336)}  # tokens, hidden, ffn
CONFIGS = {
    "64x64 w4 (default)": {},
    "64x128 w4": {"block_k": 128},
    "128x64 w4": {"block_m": 128},
    "128x128 w8": {"block_m": 128, "block_k": 128, "num_warps": 8},
}


def _cases(t: int, h: int, f: int) -> list[tuple[str, object, int, int]]:
    """``(name, fn, bytes of the amax pass, bytes of the cast)`` of each quantisation."""
    d = dict(device="cuda", dtype=torch.bfloat16)
    z, dh, dy = torch.randn(t, 2 * f, **d), torch.randn(t, f, **d), torch.randn(t, h, **d)
    weights = {"w1": torch.randn(2 * f, h, **d), "w2": torch.randn(h, f, **d)}
    scale = torch.tensor([8.0], device="cuda")
    cases = []
    for recipe, s in (("current", None), ("delayed", scale)):
        cases.append((f"swiglu fwd {recipe}",
                      lambda cfg, s=s: AQ.act_quantize(z, None, None, "swiglu", E4M3, s, t, True,
                                                       False, config=cfg),
                      4 * t * f, 6 * t * f))  # fmt: skip
        cases.append((f"swiglu bwd {recipe}",
                      lambda cfg, s=s: AQ.act_quantize(z, None, dh, "swiglu", E5M2, s, t, True,
                                                       False, config=cfg),
                      6 * t * f, 10 * t * f))  # fmt: skip
    for name, w in weights.items():
        n = w.numel()
        cases.append((f"{name} {list(w.shape)} current",
                      lambda cfg, w=w: Q.quantize_current(w, E4M3, True, config=cfg), 2 * n,
                      4 * n))  # fmt: skip
        cases.append((f"{name} {list(w.shape)} delayed",
                      lambda cfg, w=w: Q.quantize_tensorwise(w, scale, E4M3, True, config=cfg),
                      0, 4 * n))  # fmt: skip
    n = dy.numel()
    cases.append((f"dy {list(dy.shape)} current",
                  lambda cfg: Q.quantize_current(dy, E5M2, True, config=cfg),
                  2 * n, 4 * n))  # fmt: skip
    return cases


def main() -> None:
    torch.manual_seed(0)
    for size, (t, h, f) in SIZES.items():
        print(f"## {size}: tokens {t}, hidden {h}, ffn {f}")
        cases = _cases(t, h, f)
        for label, kw in CONFIGS.items():
            cfg = Q.QuantizeLaunchConfig(**kw)
            print(f"### {label}")
            for name, fn, amax_bytes, cast_bytes in cases:
                for _ in range(3):
                    fn(cfg)
                times = defaultdict(list)
                for kname, us in _cuda_kernels(lambda fn=fn, cfg=cfg: fn(cfg), (), 20):
                    times[kname].append(us)
                parts = []
                for kname, us in sorted(times.items()):
                    med = statistics.median(us)
                    nbytes = amax_bytes if "amax" in kname else cast_bytes
                    gbps = (
                        f" {nbytes / med / 1e3:5.0f} GB/s"
                        if "amax" in kname or "cast" in kname
                        else ""
                    )
                    parts.append(f"{kname} {med:7.1f} us{gbps}")
                print(f"  {name:<28} " + "; ".join(parts))


if __name__ == "__main__":
    main()
