"""LayerNormMLP fwd+bwd: te_compile.LayerNormMLP against the same block in plain PyTorch
(``nn.LayerNorm`` -> ``nn.Linear`` -> activation -> ``nn.Linear``), eager and torch.compile.

Case (BENCHMARKS.md, "MLP fwd+bwd"): T=16384 tokens, hidden 4096, ffn 16384, GELU (tanh) and
SwiGLU (FC1 has 2 x 16384 outputs), bf16 parameters and activations, with biases. One timed
call is ``block(x).backward(grad)``; parameter gradients are set to None before every call
(outside the timed region). FLOPs = 3 GEMM passes x 2 x T x (hidden x fc1_out + ffn x hidden).
The ratio that matters is ``te_compile compiled`` against ``torch compiled`` (target <= 1.03).

    python -m bench.bench_mlp                # CUDA
    python -m bench.bench_mlp --smoke        # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_mlp.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import te_compile
from bench import harness
from bench.bench_linear import check_against_reference, fwd_bwd

FULL = (16384, 4096, 16384)
SMOKE = (64, 32, 128)
CHECK_RTOL = 3e-2  # bf16 through two GEMMs, a norm and an activation


class TorchMLP(nn.Module):
    """The plain-PyTorch block LayerNormMLP replaces."""

    def __init__(self, hidden: int, ffn: int, activation: str, device, dtype) -> None:
        super().__init__()
        self.activation = activation
        fc1_out = 2 * ffn if activation == "swiglu" else ffn
        kw = {"device": device, "dtype": dtype}
        self.norm = nn.LayerNorm(hidden, eps=1e-5, **kw)
        self.fc1 = nn.Linear(hidden, fc1_out, **kw)
        self.fc2 = nn.Linear(ffn, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        if self.activation == "swiglu":
            a, lin = h.chunk(2, dim=-1)
            h = F.silu(a) * lin
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)


def _copy_weights(te: nn.Module, ref: TorchMLP) -> None:
    with torch.no_grad():
        te.layer_norm_weight.copy_(ref.norm.weight)
        te.layer_norm_bias.copy_(ref.norm.bias)
        te.fc1_weight.copy_(ref.fc1.weight)
        te.fc1_bias.copy_(ref.fc1.bias)
        te.fc2_weight.copy_(ref.fc2.weight)
        te.fc2_bias.copy_(ref.fc2.bias)


def run_case(activation: str, t: int, d: int, f: int, *, device, timing) -> harness.CaseResult:
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    ref = TorchMLP(d, f, activation, device, dtype)
    te = te_compile.LayerNormMLP(
        d, f, activation=activation, normalization="LayerNorm", params_dtype=dtype, device=device
    )
    _copy_weights(te, ref)
    x = torch.randn(t, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(t, d, device=device, dtype=dtype)
    kw = {"fullgraph": True, "dynamic": False}
    modules = {
        "torch compiled": (torch.compile(ref, **kw), ref),
        "torch eager": (ref, ref),
        "te_compile eager": (te, te),
        "te_compile compiled": (torch.compile(te, **kw), te),
    }
    notes = check_against_reference(
        {name: (call, list(mod.parameters())) for name, (call, mod) in modules.items()},
        x,
        grad,
        CHECK_RTOL,
    )
    fc1_out = 2 * f if activation == "swiglu" else f
    case = harness.Case(
        name=f"LayerNormMLP fwd+bwd, {activation}",
        shape=f"T={t}, hidden {d}, ffn {f}, bf16",
        flops=3 * 2 * t * (d * fc1_out + f * d),
    )
    competitors = {
        name: harness.Competitor(
            fn=harness.rotating(fwd_bwd(call), [(x, grad)], clear_grads=True),
            grad_to_none=tuple(mod.parameters()),
            baseline="torch compiled",
        )
        for name, (call, mod) in modules.items()
    }
    result = harness.run_case(case, competitors, device=device, notes=notes, **timing)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    args, device, timing, report = harness.start(
        parser, argv, "bench_mlp", full_timing=harness.GEMM_TIMING
    )
    t, d, f = SMOKE if args.smoke else FULL
    for activation in ("gelu", "swiglu"):
        report.add(run_case(activation, t, d, f, device=device, timing=timing))
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
