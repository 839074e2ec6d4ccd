"""FP8 recipes on the MLP block, fwd+bwd: te_compile.LayerNormMLP under each
``te_compile.autocast`` recipe against the bf16 block and torchao float8 training, all compiled.

Case (BENCHMARKS.md, "MLP fwd+bwd" / "FP8 recipes"): T=16384 tokens, hidden 4096, ffn 16384,
GELU (tanh) by default, ``--activation swiglu`` for SwiGLU (FC1 has 2 x 16384 outputs); bf16
parameters and activations, with biases. One timed call is ``block(x).backward(grad)``;
parameter gradients are set to None before every call (outside the timed region), x's inside.
FLOPs = 3 GEMM passes x 2 x T x (hidden x fc1_out + ffn x hidden), the same for every row (so an
FP8 row's TFLOP/s is bf16-equivalent throughput).

Rows, all ``torch.compile(fullgraph=True, dynamic=False)``, ratios against ``bf16 torch compiled``:

- ``bf16 torch compiled``: the plain PyTorch block (``bench_mlp.TorchMLP``), the baseline;
- ``bf16 te_compile compiled``: ``te_compile.LayerNormMLP``;
- ``te FP8 current|delayed|block compiled``: LayerNormMLP (each its own instance, same weights)
  called inside ``te_compile.autocast(recipe=Float8CurrentScaling() | DelayedScaling() |
  Float8BlockScaling())``; a recipe the modules do not implement yet shows as an error row;
- with ``--unfused``, ``te FP8 current|block op-by-op compiled``: the same recipes with
  LayerNormMLP's one-op path turned off (``quantization.gemm._FUSE_MLP = False``'s setting)
  around every call: linear, activation, linear, the
  activation written in bf16 between two quantisations (what the fused op saves);
- with ``--primary-weights``, ``te FP8 current|delayed primary weights compiled``: the block built
  inside ``te_compile.quantized_model_init(recipe=...)`` (FC1 / FC2 weights stored in FP8, no
  weight cast per call; their gradients accumulate into fp32 ``main_grad``), against the row of
  the same recipe with bf16 weights (cast every call; bf16 gradients);
- ``torchao tensorwise|rowwise``: a copy of the PyTorch block converted with torchao's
  ``convert_to_float8_training(Float8LinearConfig.from_recipe_name(...))`` (skipped with a note
  when torchao is not importable).

Under each table: the issue's speed targets (FP8 current >= 1.55x faster than bf16 compiled and
>= 1.08x faster than torchao tensorwise, delayed >= 1.6x, block >= 1.35x) with met / not met,
the bf16 rows' largest relative differences, and each FP8 row's SQNR (dB) of the output and of
the input gradient against ``bf16 torch compiled``.

    python -m bench.bench_fp8                        # CUDA, GELU
    python -m bench.bench_fp8 --activation swiglu --unfused
    python -m bench.bench_fp8 --primary-weights     # + FP8 primary weights (current, delayed)
    python -m bench.bench_fp8 --smoke                # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_fp8.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

import te_compile
from bench import harness
from bench.bench_linear import check_against_reference, fwd_bwd
from bench.bench_mlp import CHECK_RTOL, FULL, TorchMLP, _copy_weights
from te_compile.quantization import gemm
from te_compile.quantization.recipe import Recipe

SMOKE = (64, 32, 64)  # multiples of 16, as FP8 GEMMs need

BF16_TORCH = "bf16 torch compiled"
BF16_TE = "bf16 te_compile compiled"
TE_CURRENT = "te FP8 current compiled"
TE_DELAYED = "te FP8 delayed compiled"
TE_BLOCK = "te FP8 block compiled"
AO_TENSORWISE = "torchao tensorwise"
AO_ROWWISE = "torchao rowwise"

TE_RECIPES: dict[str, Callable[[], Recipe]] = {
    TE_CURRENT: te_compile.recipe.Float8CurrentScaling,
    TE_DELAYED: te_compile.recipe.DelayedScaling,
    TE_BLOCK: te_compile.recipe.Float8BlockScaling,
}
TORCHAO_RECIPES = {AO_TENSORWISE: "tensorwise", AO_ROWWISE: "rowwise"}
# --unfused: LayerNormMLP's FP8 block op by op.
UNFUSED = {
    TE_CURRENT: "te FP8 current op-by-op compiled",
    TE_BLOCK: "te FP8 block op-by-op compiled",
}

# --primary-weights: the per-tensor recipes with FP8 primary weights.
PRIMARY = {
    TE_CURRENT: "te FP8 current primary weights compiled",
    TE_DELAYED: "te FP8 delayed primary weights compiled",
}

# The targets: (row, minimum speedup, over which row): t_row / t_against <= 1 / speedup.
TARGETS: list[tuple[str, float, str]] = [
    (TE_CURRENT, 1.55, BF16_TORCH),
    (TE_CURRENT, 1.08, AO_TENSORWISE),
    (TE_DELAYED, 1.6, BF16_TORCH),
    (TE_BLOCK, 1.35, BF16_TORCH),
]

Call = Callable[[torch.Tensor], torch.Tensor]


def _under_autocast(recipe: Recipe, fn: Call) -> Call:
    """``fn(x)`` inside ``te_compile.autocast(recipe=recipe)`` (backward runs outside: the
    modules capture the recipe in forward)."""

    def call(x: torch.Tensor) -> torch.Tensor:
        with te_compile.autocast(recipe=recipe):
            try:
                return fn(x)
            except torch._dynamo.exc.Unsupported as exc:
                # An exception raised while tracing (the NotImplementedError of a recipe the
                # modules lack) reaches us as "Observed exception"; name the real one instead.
                if exc.__cause__ is None:
                    raise
                raise RuntimeError(f"under torch.compile: {exc.__cause__}") from exc

    return call


def _torchao_modules(
    ref: TorchMLP, kw: dict
) -> tuple[dict[str, tuple[Call, nn.Module]], str | None]:
    """The torchao rows (copies of ``ref`` converted to float8 training), or a note why none."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        return {}, f"torchao rows skipped: torchao is not importable ({exc})"
    rows: dict[str, tuple[Call, nn.Module]] = {}
    for name, recipe_name in TORCHAO_RECIPES.items():
        config = Float8LinearConfig.from_recipe_name(recipe_name)
        mod = convert_to_float8_training(copy.deepcopy(ref), config=config)
        rows[name] = (torch.compile(mod, **kw), mod)
    return rows, None


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of ``out`` against ``ref``, in dB (inf when equal)."""
    ref, out = ref.float(), out.float()
    noise = (out - ref).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def _out_and_dx(call: Call, params: Sequence[nn.Parameter], x, grad) -> tuple[torch.Tensor, ...]:
    xi = x.detach().clone().requires_grad_(True)
    out = call(xi)
    out.backward(grad)
    for p in params:
        p.grad = None
    return out.detach(), xi.grad


def sqnr_notes(
    modules: dict[str, tuple[Call, nn.Module]],
    fp8_rows: Sequence[str],
    x: torch.Tensor,
    grad: torch.Tensor,
) -> list[str]:
    """SQNR of each FP8 row's output and input gradient against BF16_TORCH.

    Each FP8 row runs twice and the second call is measured: delayed scaling's first call runs
    with the initial unit scales (no amax history yet), unlike every later training step.
    """
    ref_call, ref_mod = modules[BF16_TORCH]
    ref_out, ref_dx = _out_and_dx(ref_call, list(ref_mod.parameters()), x, grad)
    parts, warnings = [], []
    for name in fp8_rows:
        call, mod = modules[name]
        params = list(mod.parameters())
        try:
            _out_and_dx(call, params, x, grad)
            out, dx = _out_and_dx(call, params, x, grad)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            parts.append(f"{name} failed ({msg})")
            continue
        s_out, s_dx = sqnr_db(out, ref_out), sqnr_db(dx, ref_dx)
        parts.append(f"{name} {s_out:.1f} / {s_dx:.1f}")
        if not (torch.isfinite(out).all() and torch.isfinite(dx).all()):
            warnings.append(f"WARNING: {name} output or input gradient is not finite")
    note = f"SQNR (dB) vs {BF16_TORCH}, out / dx, 2nd call: " + "; ".join(parts)
    return [note, *warnings]


def target_notes(result: harness.CaseResult) -> list[str]:
    """One line per target: the measured speedup and whether the target is met."""
    times = {r.name: r.median_ms for r in result.rows}
    errors = {r.name: r.error for r in result.rows}
    lines = []
    for row, speedup, against in TARGETS:
        t, t_base = times.get(row), times.get(against)
        goal = f"{row} >= {speedup:g}x faster than {against}"
        if t is None or t_base is None:
            missing = [n for n, tt in ((row, t), (against, t_base)) if tt is None]
            why = ", ".join(f"{n} {'failed' if errors.get(n) else 'not run'}" for n in missing)
            lines.append(f"target {goal}: NOT MEASURED ({why})")
            continue
        got = t_base / t
        verdict = "met" if t / t_base <= 1 / speedup else "NOT MET"
        lines.append(f"target {goal}: {got:.3f}x ({t / t_base:.3f} of its time), {verdict}")
    return lines


def _primary_module(new_te: Callable[[], nn.Module], recipe: Recipe, ref: TorchMLP):
    """``new_te()`` built inside ``quantized_model_init(recipe)``, holding ``ref``'s weights
    (the FP8 ones through their fp32 masters), and the masters (kept alive with it)."""
    with te_compile.quantized_model_init(recipe=recipe):
        te = new_te.__wrapped__()
    masters = te_compile.FP8MasterWeights(te)
    with torch.no_grad():
        te.layer_norm_weight.copy_(ref.norm.weight)
        te.layer_norm_bias.copy_(ref.norm.bias)
        te.fc1_bias.copy_(ref.fc1.bias)
        te.fc2_bias.copy_(ref.fc2.bias)
        fc1, fc2 = masters.parameters()
        fc1.copy_(ref.fc1.weight)
        fc2.copy_(ref.fc2.weight)
    masters.refresh()
    return te, masters


def run_case(
    activation: str,
    t: int,
    d: int,
    f: int,
    *,
    device,
    timing,
    unfused: bool = False,
    primary_weights: bool = False,
) -> harness.CaseResult:
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    ref = TorchMLP(d, f, activation, device, dtype)

    def build() -> nn.Module:
        return te_compile.LayerNormMLP(
            d,
            f,
            activation=activation,
            normalization="LayerNorm",
            params_dtype=dtype,
            device=device,
        )

    def new_te() -> nn.Module:
        te = build()
        _copy_weights(te, ref)
        return te

    new_te.__wrapped__ = build

    x = torch.randn(t, d, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(t, d, device=device, dtype=dtype)
    kw = {"fullgraph": True, "dynamic": False}
    te_bf16 = new_te()
    modules: dict[str, tuple[Call, nn.Module]] = {
        BF16_TORCH: (torch.compile(ref, **kw), ref),
        BF16_TE: (torch.compile(te_bf16, **kw), te_bf16),
    }
    for name, recipe in TE_RECIPES.items():
        te = new_te()  # one instance per recipe: delayed scaling keeps state in its buffers
        modules[name] = (_under_autocast(recipe(), torch.compile(te, **kw)), te)
    for name, row in UNFUSED.items() if unfused else ():
        te = new_te()
        call = _under_autocast(TE_RECIPES[name](), torch.compile(te, **kw))
        modules[row] = (harness.with_setting(gemm, "_FUSE_MLP", False, call), te)
    keep_alive = []
    for name, row in PRIMARY.items() if primary_weights else ():
        te, masters = _primary_module(new_te, TE_RECIPES[name](), ref)
        keep_alive.append(masters)
        modules[row] = (_under_autocast(TE_RECIPES[name](), torch.compile(te, **kw)), te)
    ao_modules, ao_note = _torchao_modules(ref, kw)
    modules.update(ao_modules)
    fp8_rows = [n for n in modules if n not in (BF16_TORCH, BF16_TE)]

    notes = check_against_reference(
        {n: (modules[n][0], list(modules[n][1].parameters())) for n in (BF16_TORCH, BF16_TE)},
        x,
        grad,
        CHECK_RTOL,
    )
    notes += sqnr_notes(modules, fp8_rows, x, grad)
    if ao_note:
        notes.append(ao_note)
        print(f"  {ao_note}", file=sys.stderr)
    for note in notes:
        if note.startswith("WARNING"):
            print(f"  {note}", file=sys.stderr)

    fc1_out = 2 * f if activation == "swiglu" else f
    case = harness.Case(
        name=f"FP8 recipes, MLP fwd+bwd, {activation}",
        shape=f"T={t}, hidden {d}, ffn {f}, bf16 params",
        flops=3 * 2 * t * (d * fc1_out + f * d),
    )
    competitors = {
        name: harness.Competitor(
            fn=harness.rotating(fwd_bwd(call), [(x, grad)], clear_grads=True),
            grad_to_none=tuple(mod.parameters()),
            baseline=BF16_TORCH,
        )
        for name, (call, mod) in modules.items()
    }
    result = harness.run_case(case, competitors, device=device, notes=notes, **timing)
    result.notes[:0] = target_notes(result)
    del competitors, modules, keep_alive
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--activation", default="gelu", choices=["gelu", "swiglu"], help="default: gelu"
    )
    parser.add_argument(
        "--unfused", action="store_true", help="also the op-by-op FP8 block (current, block)"
    )
    parser.add_argument(
        "--primary-weights",
        action="store_true",
        help="also the per-tensor recipes with FP8 primary weights (quantized_model_init)",
    )
    args, device, timing, report = harness.start(
        parser, argv, "bench_fp8", full_timing=harness.GEMM_TIMING
    )
    t, d, f = SMOKE if args.smoke else FULL
    try:
        import torchao

        report.metadata["torchao"] = torchao.__version__
    except ImportError:
        report.metadata["torchao"] = None
    report.add(
        run_case(
            args.activation,
            t,
            d,
            f,
            device=device,
            timing=timing,
            unfused=args.unfused,
            primary_weights=args.primary_weights,
        )
    )
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
