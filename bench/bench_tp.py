"""Tensor-parallel training throughput: TP=2 (two processes) against TP=1 (one process) on a GPT
block stack at the same global batch, and the fraction of step time spent in communication;
also TP x FSDP2 meshes and FP8 recipes (issue 8: TP=4/8 and 2-D meshes on one host).

Each configuration is one run of ``examples/tensor_parallel.py`` under ``torch.distributed.run``
(so this measures exactly what the example does: compiled blocks, AdamW, the profiler's
communication fraction over a few extra steps), one process per GPU (NCCL), or per CPU process
(gloo) without GPUs. The table reports, per configuration, global tokens/s (after the warm-up
steps that include compilation), the speed-up over TP=1, the scaling efficiency (speed-up /
number of GPUs), peak memory per rank, and the communication fraction. ``--mesh TPxDP`` runs
2-D meshes (FSDP2 over "dp", per-block compile): each data-parallel rank takes ``--batch-size``
sequences (the example's ``--batch-size`` is the global batch, so it gets ``batch * dp``), i.e.
every configuration runs the same batch per model replica and the speed-up over one GPU is
global tokens/s against the 1x1 run of the same recipe.

    python -m bench.bench_tp                          # 2 GPUs: TP=1 vs TP=2 (and TP=2 + SP)
    python -m bench.bench_tp --recipe delayed         # FP8 GEMMs in the blocks
    python -m bench.bench_tp --tp 1 2 4 8             # more GPUs
    python -m bench.bench_tp --mesh 1x1 4x1 2x2 --recipe none current   # 2-D meshes, FP8
    python -m bench.bench_tp --smoke                  # tiny sizes on CPU (gloo): runs, no numbers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_tp.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import harness

EXAMPLE = harness.REPO_ROOT / "examples" / "tensor_parallel.py"
BATCH_DEFAULT = 8  # examples/tensor_parallel.py's --batch-size
SMOKE_BATCH = 4
SMOKE = ["--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "16",
         "--steps", "6", "--warmup", "2", "--profile-steps", "2"]  # fmt: skip


def run_config(
    tp: int, sequence_parallel: bool, args, extra: list[str], dp: int = 1, recipe: str = "none"
) -> dict:
    """One torchrun of the example; its reported numbers."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd = [*launch, str(tp * dp), str(EXAMPLE), "--tp", str(tp), "--dp", str(dp)]
    cmd += ["--recipe", recipe, "--profile", *extra]
    cmd += ["--batch-size", str(args.batch_size * dp)]
    if sequence_parallel:
        cmd.append("--sequence-parallel")
    env = dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT))
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode != 0:
        raise SystemExit(f"bench_tp: {' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr}")
    out = result.stdout
    ranks = re.findall(r"^rank (\d+): tokens/s ([\d,]+), peak memory ([\d,.]+) MiB", out, re.M)
    return {
        "tp": tp,
        "dp": dp,
        "recipe": recipe,
        "sequence_parallel": sequence_parallel,
        "tokens_per_s": float(re.search(r"^tokens/s: (\S+)", out, re.M).group(1)),
        "comm_fraction": float(re.search(r"^comm fraction: (\S+)", out, re.M).group(1)),
        "exposed_comm_fraction": float(
            re.search(r"^exposed comm fraction: (\S+)", out, re.M).group(1)
        ),
        "peak_memory_mib": max(float(m.replace(",", "")) for _, _, m in ranks),
        "loss": re.search(r"^loss: (.+?) \(", out, re.M).group(1),
        "config": out.splitlines()[0] if out else "",
    }


def markdown(rows: list[dict], meta: dict) -> str:
    base = {r["recipe"]: r["tokens_per_s"] for r in rows if r["tp"] * r["dp"] == 1}
    lines = [
        f"# bench_tp ({meta.get('gpu') or 'cpu'}, torch {meta.get('torch')}, {meta.get('date')})",
        "",
        f"Config (first run): {rows[0]['config']}",
        "",
        "Speed-up: global tokens/s over the one-GPU run of the same recipe (same batch per model "
        "replica); scaling efficiency: speed-up / GPUs.",
        "",
        "| GPUs | TP | DP (FSDP2) | SP | recipe | tokens/s | speed-up vs 1 GPU "
        "| scaling efficiency | peak MiB / rank | comm % of step | exposed comm % | loss |",
        "| ---: | ---: | ---: | :---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        gpus = r["tp"] * r["dp"]
        one = base.get(r["recipe"])
        speedup = r["tokens_per_s"] / one if one else float("nan")
        lines.append(
            f"| {gpus} | {r['tp']} | {r['dp']} | {'yes' if r['sequence_parallel'] else 'no'} | "
            f"{r['recipe']} | {r['tokens_per_s']:,.0f} | {speedup:.2f}x | {speedup / gpus:.0%} | "
            f"{r['peak_memory_mib']:,.0f} | {100 * r['comm_fraction']:.1f} | "
            f"{100 * r['exposed_comm_fraction']:.1f} | {r['loss']} |"
        )
    return "\n".join(lines) + "\n"


def parse_mesh(text: str) -> tuple[int, int]:
    """ "4x2" -> (tp=4, dp=2)."""
    try:
        tp, dp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        msg = f"--mesh: expected TPxDP such as 2x2, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if tp < 1 or dp < 1:
        raise argparse.ArgumentTypeError(f"--mesh: TP and DP must be >= 1, got {text!r}")
    return tp, dp


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes to run (DP 1)")
    p.add_argument(
        "--mesh", type=parse_mesh, nargs="+", default=None, metavar="TPxDP",
        help="TP x DP (FSDP2) meshes to run instead of --tp, e.g. 1x1 4x1 2x2",
    )  # fmt: skip
    p.add_argument(
        "--recipe", choices=["none", "current", "delayed"], nargs="+", default=["none"],
        help="FP8 recipes (each runs every configuration)",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=int, default=BATCH_DEFAULT,
        help="sequences per model replica and step (the example's default)",
    )  # fmt: skip
    p.add_argument("--no-sequence-parallel", action="store_true", help="skip the TP+SP runs")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--out", type=Path, default=None, help="results directory")
    p.add_argument("--tag", default="", help="file names bench_tp_TAG.md/.json (several runs)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; CPU is fine")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    args, extra = p.parse_known_args(argv)  # anything else goes to the example (--layers ...)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        extra = SMOKE + extra
        args.batch_size = SMOKE_BATCH
    meshes = args.mesh or [(tp, 1) for tp in args.tp]
    meta = harness.collect_metadata(args.device)
    out = None
    if args.out is not None or not args.smoke:
        out = args.out or harness.default_out_dir(meta)
        out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_tp_{args.tag}" if args.tag else "bench_tp"
    rows = []
    for recipe in args.recipe:
        for tp, dp in meshes:
            for sp in (False, True):
                if sp and (tp == 1 or args.no_sequence_parallel):
                    continue
                rows.append(run_config(tp, sp, args, extra, dp=dp, recipe=recipe))
                print(f"recipe={recipe} tp={tp} dp={dp} sp={sp}: "
                      f"{rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)  # fmt: skip
                if out is not None:  # after every configuration: a cut-off run keeps its rows
                    (out / f"{stem}.md").write_text(markdown(rows, meta))
                    (out / f"{stem}.json").write_text(
                        json.dumps({"meta": meta, "rows": rows}, indent=2)
                    )
    print(markdown(rows, meta))
    if out is not None:
        print(f"wrote {out / stem}.md and {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
