"""Tensor-parallel training throughput: TP=2 (two processes) against TP=1 (one process) on a GPT
block stack at the same global batch, and the fraction of step time spent in communication.

Each configuration is one run of ``examples/tensor_parallel.py`` under ``torch.distributed.run``
(so this measures exactly what the example does: compiled blocks, AdamW, the profiler's
communication fraction over a few extra steps), one process per GPU (NCCL), or per CPU process
(gloo) without GPUs. The table reports, per configuration, global tokens/s (after the warm-up
steps that include compilation), the speed-up over TP=1, the scaling efficiency (speed-up /
number of GPUs), peak memory per rank, and the communication fraction.

    python -m bench.bench_tp                          # 2 GPUs: TP=1 vs TP=2 (and TP=2 + SP)
    python -m bench.bench_tp --recipe delayed         # FP8 GEMMs in the blocks
    python -m bench.bench_tp --tp 1 2 4 8             # more GPUs
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
SMOKE = ["--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
         "--steps", "6", "--warmup", "2", "--profile-steps", "2"]  # fmt: skip


def run_config(tp: int, sequence_parallel: bool, args, extra: list[str]) -> dict:
    """One torchrun of the example; its reported numbers."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd = [*launch, str(tp), str(EXAMPLE), "--tp", str(tp), "--recipe", args.recipe, "--profile"]
    cmd += extra
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
        "sequence_parallel": sequence_parallel,
        "tokens_per_s": float(re.search(r"^tokens/s: (\S+)", out, re.M).group(1)),
        "comm_fraction": float(re.search(r"^comm fraction: (\S+)", out, re.M).group(1)),
        "peak_memory_mib": max(float(m.replace(",", "")) for _, _, m in ranks),
        "loss": re.search(r"^loss: (.+?) \(", out, re.M).group(1),
        "config": out.splitlines()[0] if out else "",
    }


def markdown(rows: list[dict], meta: dict) -> str:
    base = next((r["tokens_per_s"] for r in rows if r["tp"] == 1), None)
    lines = [
        f"# bench_tp ({meta.get('gpu') or 'cpu'}, torch {meta.get('torch')}, {meta.get('date')})",
        "",
        f"Config (TP=1 run): {rows[0]['config']}",
        "",
        "| TP | SP | tokens/s | speed-up vs TP=1 | scaling efficiency | peak MiB / rank "
        "| comm % of step | loss |",
        "| ---: | :---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        speedup = r["tokens_per_s"] / base if base else float("nan")
        lines.append(
            f"| {r['tp']} | {'yes' if r['sequence_parallel'] else 'no'} | "
            f"{r['tokens_per_s']:,.0f} | {speedup:.2f}x | {speedup / r['tp']:.0%} | "
            f"{r['peak_memory_mib']:,.0f} | {100 * r['comm_fraction']:.1f} | {r['loss']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes to run")
    p.add_argument("--recipe", choices=["none", "current", "delayed"], default="none")
    p.add_argument("--no-sequence-parallel", action="store_true", help="skip the TP+SP runs")
    p.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    p.add_argument("--out", type=Path, default=None, help="results directory")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; CPU is fine")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    args, extra = p.parse_known_args(argv)  # anything else goes to the example (--layers ...)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        extra = SMOKE + extra
    rows = []
    for tp in args.tp:
        for sp in (False, True):
            if sp and (tp == 1 or args.no_sequence_parallel):
                continue
            rows.append(run_config(tp, sp, args, extra))
            print(f"tp={tp} sp={sp}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    meta = harness.collect_metadata(args.device)
    text = markdown(rows, meta)
    print(text)
    if args.out is not None or not args.smoke:
        out = args.out or harness.default_out_dir(meta)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_tp.md").write_text(text)
        (out / "bench_tp.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {out / 'bench_tp.md'} and bench_tp.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
