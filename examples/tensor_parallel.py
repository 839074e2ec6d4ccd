"""Train a GPT block stack with tensor (and sequence) parallelism, optionally FSDP2, compiled.

Launch with torchrun, one process per GPU (or per CPU process with gloo when there is no GPU)::

    torchrun --nproc-per-node 2 examples/tensor_parallel.py --tp 2 --sequence-parallel
    torchrun --nproc-per-node 8 examples/tensor_parallel.py --tp 4 --dp 2 --recipe delayed
    torchrun --nproc-per-node 2 examples/tensor_parallel.py --tp 2 --profile   # comm fraction

The ranks form a ``dp x tp`` DeviceMesh (dims "dp", "tp"). Within a "tp" group each block is
the Megatron layout built from te_compile modules: the pre-norm + fused QKV projection is a
column-parallel ``LayerNormLinear`` (each rank holds ``heads / tp`` whole heads), attention runs
on the local heads, the output projection is a row-parallel ``Linear``, and the MLP a
``LayerNormMLP`` (FC1 column-, FC2 row-parallel): two all-reduces per block forward, two
backward. ``--sequence-parallel`` keeps the residual stream sharded along the sequence between
blocks (activations ``[seq, batch, width]``, sequence first): each all-reduce becomes an
all-gather plus a reduce-scatter, and norms, residual adds and dropout-free element-wise work
run on ``seq / tp`` tokens. With ``--dp > 1`` every block (then the root) is wrapped with FSDP2
``fully_shard`` over the "dp" dim, after ``torch.compile(fullgraph=True)`` per block, the order
torchtitan uses. Embeddings and the final norm are replicated over "tp"; the LM head is
column-parallel over the vocabulary and the loss a vocabulary-parallel cross-entropy
(``te_compile.distributed.vocab_parallel_cross_entropy``: no gather of the logits).

The data is synthetic and learnable: sequence ``i`` is ``(start_i + stride_i * t)`` modulo a
quarter of the vocabulary (the loss falls within a few steps from ``ln(vocab)`` towards
``ln(vocab / 4)``, then further as attention learns the strides). Every configuration sees the
same global batch (``--batch-size`` sequences per step, split over "dp"), so runs with different
``--tp``/``--dp`` are comparable. The script prints, per rank, tokens/s (global tokens per
second of step time, after ``--warmup`` steps that include compilation) and peak memory (CUDA:
max allocated; CPU: the process's peak RSS); with ``--profile``, the fraction of step time spent
in communication, from ``torch.profiler`` over a few extra steps (CUDA: NCCL kernel time; CPU:
time the host spends inside gloo collectives and waiting for them). It exits with status 1 if
the loss did not fall, so it doubles as a smoke test.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time

import torch
import torch._dynamo.testing
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import te_compile as te
from te_compile import distributed as tedist

RECIPES = {
    "none": lambda: None,
    "current": te.recipe.Float8CurrentScaling,
    "delayed": lambda: te.recipe.DelayedScaling(amax_history_len=16),
}
DEFAULTS = {
    "cpu": dict(layers=2, width=64, heads=4, seq_len=64, batch_size=8, vocab=128),
    "cuda": dict(layers=8, width=2048, heads=16, seq_len=2048, batch_size=8, vocab=32768),
}
# Names of the profiler events that are communication: NCCL kernels on the GPU; on the CPU the
# c10d / gloo ops and the waits for them (gloo runs collectives on its own threads).
COMM_EVENTS = ("nccl", "gloo", "c10d", "wait_tensor", "all_gather", "allgather", "all_reduce",
               "allreduce", "reduce_scatter", "reducescatter")  # fmt: skip


class Attention(nn.Module):
    def __init__(self, args, tp_group, dtype, device) -> None:
        super().__init__()
        self.local_heads = args.heads // args.tp
        self.head_dim = args.width // args.heads
        kw = {"sequence_parallel": args.sequence_parallel, "tp_group": tp_group,
              "params_dtype": dtype, "device": device}  # fmt: skip
        # Rows of the QKV weight are ordered [head][q, k, v][head_dim]: a column-parallel shard
        # of the rows is a set of whole heads.
        self.qkv = te.LayerNormLinear(args.width, 3 * args.width, parallel_mode="column", **kw)
        self.proj = te.Linear(args.width, args.width, parallel_mode="row", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [seq, batch, local_heads * 3 * head_dim], the whole sequence
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_heads, 3, self.head_dim).permute(3, 1, 2, 0, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.permute(2, 0, 1, 3).reshape(s, b, -1))


class Block(nn.Module):
    def __init__(self, args, tp_group, dtype, device) -> None:
        super().__init__()
        self.attn = Attention(args, tp_group, dtype, device)
        self.mlp = te.LayerNormMLP(
            args.width, 4 * args.width, sequence_parallel=args.sequence_parallel,
            tp_group=tp_group, params_dtype=dtype, device=device,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class GPT(nn.Module):
    def __init__(self, args, tp_group, dtype, device) -> None:
        super().__init__()
        self.tp_group = tedist.resolve_group(tp_group) if args.tp > 1 else None
        self.sequence_parallel = args.sequence_parallel
        self.recipe = RECIPES[args.recipe]()
        kw = {"dtype": dtype, "device": device}
        self.tok_emb = nn.Embedding(args.vocab, args.width, **kw)
        self.pos_emb = nn.Embedding(args.seq_len, args.width, **kw)
        blocks = (Block(args, tp_group, dtype, device) for _ in range(args.layers))
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = te.LayerNorm(args.width, params_dtype=dtype, device=device)
        # Column-parallel over the vocabulary: each rank holds vocab / tp rows of the head and
        # its logits; the loss is reduced across the shards without gathering them.
        self.head = te.Linear(args.width, args.vocab, bias=False, parallel_mode="column",
                              tp_group=tp_group, params_dtype=dtype, device=device)  # fmt: skip

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = (self.tok_emb(idx) + self.pos_emb(pos)).transpose(0, 1)  # [seq, batch, width]
        if self.sequence_parallel:
            x = tedist.scatter(x, self.tp_group, 0)  # this rank's sequence shard
        with te.autocast(enabled=self.recipe is not None, recipe=self.recipe):
            for block in self.blocks:
                x = block(x)
        if self.sequence_parallel:
            x = tedist.all_gather(x, self.tp_group, 0)
        logits = self.head(self.ln_f(x)).transpose(0, 1)  # [batch, seq, vocab / tp]
        return tedist.vocab_parallel_cross_entropy(logits, targets, self.tp_group)


@torch.no_grad()
def init_weights(model: nn.Module, tp_rank: int, tp: int, seed: int) -> None:
    """Each parameter is drawn whole (N(0, 0.02); norm weights 1, biases 0) from a generator
    seeded by its index, and every rank keeps its tensor-parallel shard of it: all ``--tp``
    settings start from the same model, and the shards on different ranks differ (the modules'
    own init would give every rank the same shard)."""
    for i, (name, p) in enumerate(model.named_parameters()):
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
        shape = [n * tp if d == dim else n for d, n in enumerate(p.shape)]
        if p.dim() > 1:
            gen = torch.Generator().manual_seed(seed * 10_007 + i)
            full = torch.randn(shape, generator=gen) * 0.02
        else:
            full = torch.full(shape, 1.0 if name.endswith("weight") else 0.0)
        p.copy_(tedist.shard_tensor(full, dim, getattr(p, "partition_stride", 1), tp_rank, tp))


def batch(args, step: int, dp_rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's share of the global batch of step ``step`` (the same on its TP ranks)."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step)
    n = args.batch_size
    used = max(args.vocab // 4, 2)
    start = torch.randint(0, used, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    seq = (start + stride * torch.arange(args.seq_len + 1)) % used
    seq = seq.chunk(args.dp)[dp_rank].to(device)
    return seq[:, :-1], seq[:, 1:]


def check_args(args, world: int) -> None:
    def fail(msg: str) -> None:
        raise SystemExit(f"tensor_parallel.py: {msg}")

    if args.tp * args.dp != world:
        fail(f"--tp ({args.tp}) x --dp ({args.dp}) must equal the number of processes ({world})")
    if args.vocab is not None and args.vocab % args.tp:
        fail(f"--vocab ({args.vocab}) must be divisible by --tp ({args.tp}): the LM head is split")
    if args.heads % args.tp or args.width % args.heads:
        fail(f"--heads ({args.heads}) must divide --width and be divisible by --tp ({args.tp})")
    if args.batch_size % args.dp:
        fail(f"--batch-size ({args.batch_size}) must be divisible by --dp ({args.dp})")
    if args.sequence_parallel and args.seq_len % args.tp:
        fail(f"--seq-len ({args.seq_len}) must be divisible by --tp with --sequence-parallel")
    if args.recipe != "none" and (args.width // args.tp) % 16:
        fail(f"FP8 GEMMs need --width / --tp ({args.width // args.tp}) to be a multiple of 16")


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "max allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak RSS"  # KiB on Linux


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_fraction(model, opt, args, dp_rank, device, step0: int) -> tuple[float, float]:
    """``(busy, exposed)``: fractions of the wall time of ``--profile-steps`` steps during which
    communication runs, and during which it runs with nothing else to overlap it.

    CUDA: busy is the union of the NCCL kernels' intervals on the timeline (a sum of their times
    counts concurrent kernels on FSDP2's and the tensor-parallel streams twice, and exceeded the
    wall time on 4 H200s, 2026-11-22); exposed is the part of that union in which no other kernel
    runs. An NCCL kernel is busy from its launch until its peers arrive, so busy includes the
    wait for the slowest rank. CPU (gloo, collectives on gloo's own threads): busy is the union
    of the c10d / gloo events, exposed the union of the waits for them on the training thread."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for step in range(step0, step0 + args.profile_steps):
            train_step(model, opt, args, step, dp_rank, device)
        synchronize(device)
        wall_us = (time.perf_counter() - start) * 1e6
    comm, other = [], []
    for event in prof.events():
        name, span = event.name.lower(), (event.time_range.start, event.time_range.end)
        if device.type == "cuda":
            if event.device_type == DeviceType.CUDA:
                (comm if "nccl" in name else other).append(span)
        elif any(k in name for k in COMM_EVENTS):
            (other if "wait" in name else comm).append(span)
    comm, other = _merge(comm), _merge(other)
    if device.type == "cuda":
        busy, exposed = _length(comm), _length(comm) - _overlap(comm, other)
    else:  # the waits are exposed; the collectives themselves ran on gloo's threads
        busy, exposed = _length(_merge(comm + other)), _length(other)
    return busy / wall_us, exposed / wall_us


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, args, step: int, dp_rank: int, device) -> torch.Tensor:
    idx, targets = batch(args, step, dp_rank, device)
    loss = model(idx, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: all)")
    p.add_argument("--dp", type=int, default=1, help="FSDP2 (data-parallel) size")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="none", help="FP8 recipe")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps (compilation)")
    p.add_argument("--profile", action="store_true", help="report the communication fraction")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--no-compile", action="store_true")
    for name in ("layers", "width", "heads", "seq-len", "batch-size", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None, help="default depends on the device")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    for key, value in DEFAULTS[device_type].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.tp is None:
        args.tp = world // args.dp
    check_args(args, world)
    mesh = init_device_mesh(device_type, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")

    model = GPT(args, (mesh, "tp"), dtype, device)
    init_weights(model, mesh.get_local_rank("tp"), args.tp, args.seed)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    for block in model.blocks:
        if not args.no_compile:
            block.compile(fullgraph=True, backend=counter)
        if args.dp > 1:
            fully_shard(block, mesh=mesh["dp"])
    if args.dp > 1:
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{world} ranks ({device_type}): tp={args.tp} dp={args.dp} sequence_parallel="
              f"{args.sequence_parallel} recipe={args.recipe} dtype={dtype} compile="
              f"{not args.no_compile}; {args.layers} layers, width {args.width}, {args.heads} "
              f"heads; {params:,} parameters per tp rank")  # fmt: skip

    losses, timed_s = [], 0.0
    for step in range(args.steps):
        start = time.perf_counter()
        losses.append(train_step(model, opt, args, step, dp_rank, device))
        synchronize(device)
        if step >= args.warmup:
            timed_s += time.perf_counter() - start
    timed = args.steps - args.warmup
    tok_s = timed * args.batch_size * args.seq_len / timed_s if timed > 0 else float("nan")
    memory, kind = peak_memory_mib(device)
    fraction = None
    if args.profile:
        fraction, exposed = comm_fraction(model, opt, args, dp_rank, device, args.steps)
    line = f"rank {rank}: tokens/s {tok_s:,.0f}, peak memory {memory:,.1f} MiB ({kind})"
    if fraction is not None:
        line += (
            f", communication {100 * fraction:.1f}% of step time "
            f"({100 * exposed:.1f}% not overlapped)"
        )
    # One write with its newline: with unbuffered stdout print() writes the text and the "\n"
    # separately, and another rank's line could land between them (seen in CI, 2026-11-22).
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    # The loss of the global batch: the mean of the DP ranks' losses (equal-sized shares).
    ends = torch.stack([losses[0], losses[-1]]).float()
    dist.all_reduce(ends, group=mesh.get_group("dp"))
    first, last = (ends / args.dp).tolist()
    if rank == 0:
        print(
            f"loss: {first:.4f} -> {last:.4f} (uniform guess {math.log(args.vocab):.4f})",
            flush=True,
        )
        print(f"tokens/s: {tok_s:.1f}")
        if fraction is not None:
            print(f"comm fraction: {fraction:.4f}")
            print(f"exposed comm fraction: {exposed:.4f}")
        if not args.no_compile:
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            print(f"graphs compiled: {counter.frame_count} (blocks share one when their guards "
                  f"pass); graph breaks: {breaks}")  # fmt: skip
        sys.stdout.flush()
    # Every rank's collectives (FSDP2's reduce-scatters included) finish before any rank tears
    # down its process group: a gloo rank that left early aborted its peer once ("terminate
    # called without an active exception", a CI run on 2 loaded cores).
    dist.barrier()
    dist.destroy_process_group()
    if not last < first:
        print("FAILED: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
