"""Every CUDA kernel of one fwd+bwd step, eager against compiled: does Inductor add kernels
around the te ops it traces (copies of a kernel's inputs or outputs, say)?

For each case, the kernels of one step (``torch.profiler``; name, count, us) for the te op
called eagerly and under ``torch.compile(fullgraph=True)``. A compiled step should launch the
eager step's Triton kernels and cuBLAS calls and nothing more than the fusions Inductor makes
of the glue; a ``triton_poi_fused_..._view`` or ``copy`` kernel of a tensor's size that eager
does not run is a copy the compiled graph added.

    python -m bench.diag.diag_kernels                 # CUDA; writes to stdout
    python -m bench.diag.diag_kernels --cases rope
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import te_compile as te
from bench.harness import _cuda_kernels


def _rope() -> tuple[Callable[[], object], list[torch.Tensor]]:
    x = torch.randn(4096, 2, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = te.RotaryPositionEmbedding(128, device="cuda")(4096)
    dy = torch.randn_like(x)
    return (lambda: te.apply_rotary_pos_emb(x, freqs, "sbhd").backward(dy)), [x]


def _dropout() -> tuple[Callable[[], object], list[torch.Tensor]]:
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    return (lambda: te.functional.dropout(x, 0.1).backward(dy)), [x]


def _linear(recipe) -> Callable[[], tuple[Callable[[], object], list[torch.Tensor]]]:
    def make():
        lin = te.Linear(4096, 4096, bias=False, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)

        def step():
            with te.autocast(recipe=recipe()):
                y = lin(x)
            y.backward(dy)

        return step, [x, lin.weight]

    return make


CASES = {
    "rope": _rope,
    "dropout": _dropout,
    "linear_current": _linear(te.recipe.Float8CurrentScaling),
    "linear_mxfp8": _linear(te.recipe.MXFP8BlockScaling),
}


def _table(fn: Callable[[], object], params: list[torch.Tensor]) -> list[str]:
    fn()
    fn()
    per: dict[str, list[float]] = {}
    for name, us in _cuda_kernels(fn, params, 3):
        per.setdefault(name, []).append(us)
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))
    total = sum(sum(v) for v in per.values()) / 3
    lines = [f"  total {total:.1f} us/step"]
    lines += [f"  {sum(v) / 3:8.1f} us  x{len(v) // 3:<3d} {n[:110]}" for n, v in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}")
    for name in args.cases:
        torch._dynamo.reset()
        try:
            step, params = CASES[name]()
            print(f"\n## {name} eager")
            print("\n".join(_table(step, params)))
            print(f"\n## {name} compiled")
            print("\n".join(_table(torch.compile(step, fullgraph=False), params)))
        except Exception as e:  # a case that cannot run here (MXFP8 GEMMs need sm100)
            print(f"  {name}: {type(e).__name__}: {str(e)[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
