"""Gradient check of the demo GPT on the GPU: per-parameter gradient error of the GPU model
(bf16 and fp32, eager and compiled, FP8 recipes) against the same model in float64 on the CPU
(is a loss gap a gradient error?), and a check that a forward + backward leaves every parameter
and the input untouched (a kernel writing into a saved buffer or a weight would not show in one
gradient). ``--device cpu`` runs the script itself on the CPU.

    python -m bench.diag.diag_gpt_grads [--layers 2] [--out DIR]

Prints one table: rows are parameters, columns the runs, entries the norm-wise relative error
``|g - g_ref| / |g_ref|``; the last lines give the worst entry per run and whether anything was
modified in place.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from tests.utils import load_script

TRAIN_GPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("diag_gpt_grads: no CUDA GPU (--device cpu runs the script on the CPU)")
    gpt = load_script("train_gpt_example", TRAIN_GPT)
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=73, block_size=256, layers=args.layers, width=384, heads=6)
    base = gpt.GPT(cfg, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for q in base.parameters():
            if q.dim() == 1:
                q.add_(torch.randn_like(q) * 0.1)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    idx = torch.randint(0, 73, (args.batch_size, 256))
    targets = torch.randint(0, 73, (args.batch_size, 256))

    ref = gpt.GPT(cfg, torch.float64, torch.device("cpu"))
    ref.load_state_dict({k: v.double() for k, v in state.items()})
    ref(idx, targets).backward()
    ref_grads = {n: q.grad for n, q in ref.named_parameters()}

    runs = {}
    for dtype in (torch.bfloat16, torch.float32):
        for recipe in ("none", "current", "delayed", "block"):
            for compiled in (False, True):
                if dtype == torch.float32 and recipe != "none":
                    continue
                name = f"{str(dtype)[6:]}/{recipe}/{'compiled' if compiled else 'eager'}"
                model = gpt.GPT(dataclasses.replace(cfg, recipe=recipe), dtype, device)
                model.load_state_dict(state)
                before = {k: v.clone() for k, v in model.state_dict().items()}
                x, y = idx.to(device), targets.to(device)
                x0 = x.clone()
                run = torch.compile(model, fullgraph=True) if compiled else model
                run(x, y).backward()
                changed = [k for k, v in model.state_dict().items()
                           if k in before and not torch.equal(v, before[k])]  # fmt: skip
                if not torch.equal(x, x0):
                    changed.append("<input>")
                errs = {}
                for n, q in model.named_parameters():
                    g = ref_grads[n]
                    errs[n] = ((q.grad.double().cpu() - g).norm() / g.norm()).item()
                runs[name] = (errs, changed)
    names = list(ref_grads)
    cols = list(runs)
    lines = ["| parameter | " + " | ".join(cols) + " |", "| --- |" + " ---: |" * len(cols)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{runs[c][0][n]:.2e}" for c in cols) + " |")
    lines.append("")
    for c in cols:
        errs, changed = runs[c]
        worst = max(errs, key=errs.get)
        lines.append(f"- {c}: worst {worst} {errs[worst]:.3e}; median "
                     f"{sorted(errs.values())[len(errs) // 2]:.3e}; "
                     f"modified by fwd+bwd: {changed or 'nothing'}")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "diag_gpt_grads.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
