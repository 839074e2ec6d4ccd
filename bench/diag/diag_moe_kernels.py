"""Where the MoE layer's compiled FP8 step spends its GPU time, GPU only.

examples/moe_layer.py's layer (64 experts, top-2, hidden 4096, ffn 1408, 16384 tokens) compiled
with ``fullgraph=True``, bf16 and under each FP8 recipe named, next to the plain-PyTorch layer:
for each, the CUDA kernels of one fwd+bwd step (``torch.profiler``, averaged over 5 steps), the
25 longest by total time, the step's total kernel time and its split into GEMMs, FP8 casts and
the rest. Answers whether an FP8 step loses to its GEMMs or to its casts. ``--fp8-weights``:
each recipe also with FP8 expert weights (``te.quantized_model_init``), its step and, apart, the
optimizer step's refresh of the FP8 weights from their fp32 masters (``FP8MasterWeights``).

    python -m bench.diag.diag_moe_kernels --recipes current delayed --fp8-weights
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import te_compile as te
from examples.moe_layer import RECIPES, TeMoE, TorchMoE


def kernels(
    fn, x, steps: int = 5, refresh: bool = False
) -> tuple[list[tuple[str, int, float]], float]:
    """``([(name, calls per step, us per step)], total us per step)`` of ``fn``'s training step
    (``refresh``: of ``fn()``, an FP8 weight refresh)."""

    def step():
        if refresh:
            fn()
        else:
            fn(x).float().square().mean().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    calls: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            calls[e.name] += 1
            us[e.name] += e.device_time
    rows = sorted(((n, calls[n] // steps, us[n] / steps) for n in us), key=lambda r: -r[2])
    return rows, sum(r[2] for r in rows)


def kind(name: str) -> str:
    """``"GEMM"`` (cuBLAS, CUTLASS), ``"cast"`` (te's quantisation kernels) or ``"other"``."""
    if any(k in name for k in ("cutlass", "nvjet", "gemm", "sm90_xmma")):
        return "GEMM"
    if any(k in name for k in ("_rowwise", "_columnwise", "_balance_scales", "quantize", "amax")):
        return "cast"
    return "other"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="*", default=["current"], choices=sorted(RECIPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--fp8-weights", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    factory = {"device": "cuda", "dtype": torch.bfloat16}
    moe = TeMoE(64, 4096, 1408, 2, **factory)
    x = torch.randn(args.tokens, 4096, **factory, requires_grad=True)
    runs = {"torch bf16": torch.compile(TorchMoE(moe), fullgraph=True)}
    runs["te bf16"] = torch.compile(moe, fullgraph=True)
    for name in args.recipes:
        recipe = RECIPES[name]()

        def under(x, recipe=recipe):
            with te.autocast(recipe=recipe):
                return moe(x)

        runs[f"te {name}"] = torch.compile(under, fullgraph=True)
        if args.fp8_weights:
            with te.quantized_model_init(recipe=recipe):
                kept = TeMoE(64, 4096, 1408, 2, **factory)
            kept.load_state_dict(moe.state_dict())
            masters = te.FP8MasterWeights(kept)

            def under_kept(x, recipe=recipe, kept=kept):
                with te.autocast(recipe=recipe):
                    return kept(x)

            runs[f"te {name}, FP8 expert weights"] = torch.compile(under_kept, fullgraph=True)
            runs[f"FP8MasterWeights.refresh ({name})"] = masters.refresh
    for name, fn in runs.items():
        torch._dynamo.reset()
        rows, total = kernels(fn, x, refresh=name.startswith("FP8MasterWeights"))
        print(
            f"\n## {name}: {total:.0f} us of kernels per step, {sum(r[1] for r in rows)} launches"
        )
        sums = {k: sum(t for n, _, t in rows if kind(n) == k) for k in ("GEMM", "cast")}
        print(f"GEMMs {sums['GEMM']:.0f} us, FP8 casts {sums['cast']:.0f} us, other "
              f"{total - sum(sums.values()):.0f} us\n")  # fmt: skip
        print("| us | calls | kernel |\n| ---: | ---: | --- |")
        for n, c, t in rows[:25]:
            print(f"| {t:.0f} | {c} | `{n[:110]}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
