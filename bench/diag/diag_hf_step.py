"""Where a compiled training step of ``examples/convert_hf_llama.py``'s models spends its time:
the Hugging Face Llama against its conversion to te_compile TransformerLayers (GPU defaults:
hidden 1024, 4 layers, batch 4 x seq 1024, bf16).

For each model: the wall time of a step (forward, loss, backward; synchronised, median of
``--iters``; gradients set to None before each step, and also accumulated) against the sum of
its CUDA kernels' durations (a step whose wall time is well above its kernel time is bound by
the host), then the kernels of a step by total time.

    python -m bench.diag.diag_hf_step            # GPU only; writes to stdout
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import te_compile as te
from bench.harness import _cuda_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import convert_hf_llama as ex


def _walls(step, params, iters: int, accumulate: bool = False) -> list[float]:
    out = []
    for _ in range(iters):
        for p in params:
            if not accumulate:
                p.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _report(name: str, step, params, iters: int, top: int) -> None:
    for _ in range(3):  # compile, warm up
        step()
    wall = statistics.median(_walls(step, params, iters))
    accumulating = statistics.median(_walls(step, params, iters, accumulate=True))
    per: dict[str, list[float]] = {}
    for kname, us in _cuda_kernels(step, params, 3):
        per.setdefault(kname, []).append(us)
    total = sum(sum(v) for v in per.values()) / 3e3
    n = sum(len(v) for v in per.values()) // 3
    print(f"\n## {name}: wall {wall:.2f} ms/step ({accumulating:.2f} accumulating into .grad), "
          f"kernels {total:.2f} ms/step, {n} kernels/step")  # fmt: skip
    for kname, v in sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(v) / 3e3:7.3f} ms  x{len(v) // 3:<4d} {kname[:110]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--arch", default="llama")
    args = p.parse_args(argv)
    cfg = argparse.Namespace(arch=args.arch, device="cuda", dtype=torch.bfloat16, hidden=1024,
                             layers=4, heads=16, kv_heads=4, ffn=2816, vocab=32000, batch=4,
                             seq=1024)  # fmt: skip
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}")
    hf = ex.build_hf(cfg).train()
    ours = te.convert.from_hf(hf).train()
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), device="cuda")
    models = {
        "te_compile": (ours, lambda b: ex.loss_of(ours(b), b), {"fullgraph": True}),
        "transformers": (hf, lambda b: ex.loss_of(hf(b).logits, b), {}),
    }
    for name, (model, loss_fn, kw) in models.items():
        torch._dynamo.reset()
        compiled = torch.compile(loss_fn, **kw)
        params = [q for q in model.parameters() if q.requires_grad]
        _report(name, lambda c=compiled: c(ids).backward(), params, args.iters, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
