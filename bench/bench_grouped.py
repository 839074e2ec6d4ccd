"""GroupedLinear fwd+bwd: te_compile.GroupedLinear against ``torch._grouped_mm`` and a
per-expert loop of ``nn.Linear``.

Case (BENCHMARKS.md, "GroupedLinear fwd+bwd"): 8 and 64 experts, uneven token splits summing to
32768 tokens (seeded; a few zero-size groups at 64 experts), 4096 -> 2048, bf16, no bias. One
timed call is ``out = f(x, splits); out.backward(grad)`` with a fixed random (never zero)
``grad`` and ``x.requires_grad``: three grouped GEMMs (forward, dgrad, wgrad), FLOPs =
3 * 2 * tokens * in * out. Weight gradients are set to None before every timed call (do_bench
``grad_to_none``, outside the timed region), x's gradient inside the call
(``harness.rotating(clear_grads=True)``).

Competitors, all holding the same weights, all ratios against ``torch._grouped_mm compiled``:

- ``torch._grouped_mm``: ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` with ``w`` an
  ``[E, out, in]`` leaf parameter and ``offs = cumsum(splits)`` (int32, on the device); its
  autograd formula gives the backward. Compiled (``fullgraph=True, dynamic=False``) and eager.
- ``nn.Linear loop``: one ``nn.Linear`` per expert over ``x.split(splits)``, then ``torch.cat``
  (eager).
- ``te_compile.GroupedLinear`` with ``single_grouped_parameter=True`` (one ``weight``
  ``[E, out, in]``), called as ``module(x, splits_tensor)`` with the splits as an int64 tensor
  on the device, eager and compiled; and the default layout (``weight0..weight{E-1}``), eager.

- ``te_compile.GroupedLinear FP8 current``: the same module inside
  ``te_compile.autocast(recipe=Float8CurrentScaling())`` (HYBRID: the three grouped GEMMs in FP8
  with rowwise scales through ``torch._scaled_grouped_mm``, the E5M2 gradient as E4M3 codes,
  the wgrad's operands quantised per expert and column along the tokens), eager and compiled,
  at 8 experts (issue 5's case); compiled also with ``backward_override="high_precision"``
  (the FP8 forward, bf16 dgrad and wgrad from the kept bf16 input), under ``Format.E4M3``, and
  under ``DelayedScaling``; and under
  ``Float8BlockScaling`` (E4M3, 1x128 / 128x128 blocks: a blockwise GEMM per expert,
  ``te::grouped_linear`` with ``"block"`` specs, the splits
  given as a CPU tensor as Transformer Engine takes them), also emulated
  (``quantization.gemm._NATIVE_BLOCK = False``'s setting). Checked against the bf16 reference at
  Transformer Engine's e4m3 tolerance (rtol 0.125) instead of 2e-2.

Targets (checked and stated under each table): te_compile.GroupedLinear reaches >= 0.97x the
throughput of ``torch._grouped_mm`` (t / t_base <= 1/0.97) and, at 64 experts, >= 2x that of
the ``nn.Linear`` loop (t_te / t_loop <= 0.5); at 8 experts, FP8 >= 1.3x faster than the same
module in bf16 (compiled against compiled, eager against eager).

    python -m bench.bench_grouped                # CUDA, results in bench/results/<date>_<gpu>/
    python -m bench.bench_grouped --smoke        # tiny shapes, runs on CPU
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python bench/bench_grouped.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

import te_compile
from bench import harness
from bench.bench_linear import _rel_err, fwd_bwd
from te_compile.quantization import gemm

TOKENS, IN_FEATURES, OUT_FEATURES = 32768, 4096, 2048
EXPERTS = [8, 64]
SMOKE_TOKENS, SMOKE_IN, SMOKE_OUT = 256, 64, 32
SMOKE_EXPERTS = [4, 8]
SPLIT_SEED = 1234
DTYPE = torch.bfloat16  # torch._grouped_mm (compiled) takes bf16 only, on CPU too
CHECK_RTOL = 2e-2

GMM_COMPILED = "torch._grouped_mm compiled"
GMM_EAGER = "torch._grouped_mm eager"
LOOP = "nn.Linear loop eager"
TE_EAGER = "te_compile.GroupedLinear eager"
TE_COMPILED = "te_compile.GroupedLinear compiled"
TE_MULTI_EAGER = "te_compile.GroupedLinear (weight0..) eager"
TE_FP8_EAGER = "te_compile.GroupedLinear FP8 current eager"
TE_FP8_COMPILED = "te_compile.GroupedLinear FP8 current compiled"
TE_FP8_HPW_COMPILED = "te_compile.GroupedLinear FP8 current, high-precision backward, compiled"
TE_FP8_E4M3_COMPILED = "te_compile.GroupedLinear FP8 current E4M3 compiled"
TE_FP8_DELAYED_COMPILED = "te_compile.GroupedLinear FP8 delayed compiled"
TE_FP8_BLOCK_COMPILED = "te_compile.GroupedLinear FP8 block compiled"
TE_FP8_BLOCK_EMULATED_COMPILED = "te_compile.GroupedLinear FP8 block emulated compiled"
# The compiled FP8 rows besides TE_FP8_COMPILED, each checked against the bf16 module.
TE_FP8_OTHER_COMPILED = (
    TE_FP8_HPW_COMPILED,
    TE_FP8_E4M3_COMPILED,
    TE_FP8_DELAYED_COMPILED,
    TE_FP8_BLOCK_COMPILED,
    TE_FP8_BLOCK_EMULATED_COMPILED,
)
FP8_EXPERTS = 8  # the FP8 rows run at this expert count (issue 5's target)
FP8_RTOL = 0.125  # Transformer Engine's e4m3 tolerance

MIN_THROUGHPUT_VS_GMM = 0.97  # te >= 0.97x torch._grouped_mm throughput
MIN_SPEEDUP_VS_LOOP = 2.0  # te >= 2x the nn.Linear loop, at 64 experts (and more)
MIN_FP8_SPEEDUP = 1.3  # FP8 >= 1.3x faster than bf16, 8 experts


def zero_groups(experts: int, smoke: bool) -> int:
    """How many empty experts a case has: 3 of 64, none of 8 (smoke: 1 of 4, 2 of 8)."""
    return max(1, experts // 4) if smoke else experts // 20


def make_splits(total: int, experts: int, n_zero: int, seed: int = SPLIT_SEED) -> list[int]:
    """Deterministic uneven split of ``total`` tokens over ``experts`` groups.

    Lognormal group weights (sigma 0.75: the largest group is a few times the smallest),
    ``n_zero`` random groups set to zero, rounded down, the remainder handed to the groups with
    the largest fractional parts; sums exactly to ``total``.
    """
    if not 0 <= n_zero < experts:
        raise ValueError(f"make_splits: need 0 <= n_zero < experts, got {n_zero}, {experts}")
    g = torch.Generator().manual_seed(seed + experts)
    w = torch.empty(experts, dtype=torch.float64).log_normal_(0.0, 0.75, generator=g)
    w[torch.randperm(experts, generator=g)[:n_zero]] = 0.0
    raw = w / w.sum() * total
    counts = raw.floor().long()
    frac = torch.where(w > 0, raw - counts, -1.0)  # zero groups never get the remainder
    deficit = total - int(counts.sum())
    counts[frac.argsort(descending=True)[:deficit]] += 1
    splits = counts.tolist()
    assert sum(splits) == total and sum(s == 0 for s in splits) == n_zero, splits
    return splits


class TorchGroupedMM(nn.Module):
    """The plain-PyTorch grouped linear: one ``[E, out, in]`` weight, ``torch._grouped_mm``."""

    def __init__(self, experts: int, in_features: int, out_features: int, device, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(experts, out_features, in_features, device=device, dtype=dtype)
        )

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)


class LinearLoop(nn.Module):
    """One ``nn.Linear`` per expert over ``x.split(splits)``, concatenated."""

    def __init__(self, experts: int, in_features: int, out_features: int, device, dtype) -> None:
        super().__init__()
        self.linears = nn.ModuleList(
            nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        parts = x.split(splits)
        return torch.cat([lin(p) for lin, p in zip(self.linears, parts, strict=True)])


def _stacked_wgrad(module: nn.Module, experts: int) -> torch.Tensor | None:
    """The weight gradient as ``[E, out, in]``, whatever the module's weight layout."""
    if isinstance(module, LinearLoop):
        weights = [lin.weight for lin in module.linears]
    elif isinstance(getattr(module, "weight", None), torch.Tensor):  # one grouped weight
        return module.weight.grad
    else:  # te_compile.GroupedLinear's default layout: weight0 .. weight{E-1}
        weights = [getattr(module, f"weight{i}") for i in range(experts)]
    # A weight that got no gradient (an empty expert) counts as a zero gradient.
    return torch.stack([w.grad if w.grad is not None else torch.zeros_like(w) for w in weights])


def check_grouped(
    calls: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module]],
    x: torch.Tensor,
    grad: torch.Tensor,
    experts: int,
    rtol: float,
    rtol_of: dict[str, float] | None = None,
) -> list[str]:
    """Run each competitor once and compare out / dx / dw with the first one.

    Like ``bench_linear.check_against_reference``, with the weight gradient compared as one
    ``[E, out, in]`` tensor whatever the parameter layout. Also the first (compiling) call of
    the compiled competitors. ``rtol_of``: per-competitor tolerances (FP8 rows) instead of
    ``rtol``. Returns notes.
    """
    results: dict[str, list[torch.Tensor | None] | str] = {}
    for name, (call, module) in calls.items():
        xi = x.detach().clone().requires_grad_(True)
        try:
            out = call(xi)
            out.backward(grad)
            results[name] = [out.detach(), xi.grad, _stacked_wgrad(module, experts)]
        except Exception as exc:
            results[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        module.zero_grad(set_to_none=True)
    ref_name = next(iter(calls))
    ref = results[ref_name]
    if isinstance(ref, str):
        return [f"WARNING: correctness check skipped: reference {ref_name} failed ({ref})"]
    parts, warnings = [], []
    for name, res in results.items():
        if name == ref_name:
            continue
        if isinstance(res, str):
            warnings.append(f"WARNING: {name} failed in the correctness check: {res}")
            continue
        errs = [_rel_err(a, b) for a, b in zip(res, ref, strict=True)]
        parts.append(f"{name} " + "/".join(f"{e:.1e}" for e in errs))
        tol = (rtol_of or {}).get(name, rtol)
        if not all(e <= tol for e in errs):  # also catches NaN
            warnings.append(f"WARNING: {name} differs from {ref_name} beyond rtol={tol:g}")
    notes = [f"max rel. diff vs {ref_name} (out/dx/dw): " + "; ".join(parts)] if parts else []
    return notes + warnings


def target_note(
    result: harness.CaseResult, name: str, against: str, max_ratio: float, what: str
) -> str:
    """ "target ...: t_name / t_against = r (<= max_ratio): met / NOT met / not measured"."""
    rows = {r.name: r for r in result.rows}
    a, b = rows.get(name), rows.get(against)
    head = f"target {what}: t({name}) / t({against})"
    if a is None or b is None or a.median_ms is None or not b.median_ms:
        return f"{head}: not measured"
    ratio = a.median_ms / b.median_ms
    verdict = "target met" if ratio <= max_ratio else "target NOT met"
    return f"{head} = {ratio:.3f} (needs <= {max_ratio:.3f}): {verdict}"


def _bind(module: Callable[..., torch.Tensor], splits: object) -> Callable[..., torch.Tensor]:
    """``x -> module(x, splits)``."""
    return lambda x: module(x, splits)


def _under_fp8(
    call: Callable[[torch.Tensor], torch.Tensor],
    fp8_format: str = "HYBRID",
    kind: str = "Float8CurrentScaling",
    **fields: object,
) -> Callable[..., torch.Tensor]:
    """``call`` inside ``te_compile.autocast(recipe=<kind>(fp8_format=..., **fields))`` (HYBRID:
    E5M2 gradients; E4M3: every GEMM E4M3, all three in ``torch._scaled_grouped_mm``'s reach)."""
    fmt = getattr(te_compile.recipe.Format, fp8_format)
    recipe = getattr(te_compile.recipe, kind)(fp8_format=fmt, **fields)

    def fp8_call(x: torch.Tensor) -> torch.Tensor:
        with te_compile.autocast(recipe=recipe):
            return call(x)

    return fp8_call


def _make_te(experts: int, k: int, n: int, *, single: bool, device) -> nn.Module:
    return te_compile.GroupedLinear(
        experts,
        k,
        n,
        bias=False,
        single_grouped_parameter=single,
        params_dtype=DTYPE,
        device=device,
    )


def run_case(
    experts: int,
    tokens: int,
    k: int,
    n: int,
    *,
    n_zero: int,
    loop_target: bool,
    compile_: bool,
    fp8: bool = False,
    device: torch.device,
    timing: dict,
    timer: str = "auto",
) -> tuple[harness.CaseResult, list[int]]:
    torch._dynamo.reset()  # fresh compile per case
    torch.manual_seed(0)
    splits = make_splits(tokens, experts, n_zero)
    offs = torch.tensor(splits, device=device).cumsum(0).to(torch.int32)
    splits_t = torch.tensor(splits, dtype=torch.int64, device=device)

    gmm = TorchGroupedMM(experts, k, n, device, DTYPE)
    with torch.no_grad():
        gmm.weight.normal_(0.0, k**-0.5)
    loop = LinearLoop(experts, k, n, device, DTYPE)
    with torch.no_grad():
        for i, lin in enumerate(loop.linears):
            lin.weight.copy_(gmm.weight[i])

    notes: list[str] = []
    te = te_multi = te_fp8 = None
    if not hasattr(te_compile, "GroupedLinear"):
        notes.append("te_compile.GroupedLinear does not exist (yet): te rows skipped")
    else:
        try:
            te = _make_te(experts, k, n, single=True, device=device)
            te_multi = _make_te(experts, k, n, single=False, device=device)
            with torch.no_grad():
                te.weight.copy_(gmm.weight)
                for i in range(experts):
                    getattr(te_multi, f"weight{i}").copy_(gmm.weight[i])
            if fp8:
                te_fp8 = _make_te(experts, k, n, single=True, device=device)
                with torch.no_grad():
                    te_fp8.weight.copy_(gmm.weight)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            notes.append(f"WARNING: building te_compile.GroupedLinear failed ({msg}): rows skipped")
            te = te_multi = te_fp8 = None
    for note in notes:
        print(f"  [GroupedLinear, {experts} experts] {note}", file=sys.stderr)

    kw = {"fullgraph": True, "dynamic": False}
    # name -> (call(x) -> out, module holding the weights)
    modules: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], nn.Module]] = {}
    if compile_:
        gmm_c = torch.compile(gmm, **kw)
        modules[GMM_COMPILED] = (_bind(gmm_c, offs), gmm)
    modules[GMM_EAGER] = (_bind(gmm, offs), gmm)
    modules[LOOP] = (_bind(loop, splits), loop)
    if te is not None:
        modules[TE_EAGER] = (_bind(te, splits_t), te)
        if compile_:
            te_c = torch.compile(te, **kw)
            modules[TE_COMPILED] = (_bind(te_c, splits_t), te)
    if te_multi is not None:
        modules[TE_MULTI_EAGER] = (_bind(te_multi, splits_t), te_multi)
    if te_fp8 is not None:
        modules[TE_FP8_EAGER] = (_under_fp8(_bind(te_fp8, splits_t)), te_fp8)
        if compile_:
            te_fp8_c = torch.compile(te_fp8, **kw)
            modules[TE_FP8_COMPILED] = (_under_fp8(_bind(te_fp8_c, splits_t)), te_fp8)
            # backward_override="high_precision": the forward in FP8, the backward in bf16 on
            # the input and weight kept in bf16.
            hpw = _under_fp8(_bind(te_fp8_c, splits_t), backward_override="high_precision")
            modules[TE_FP8_HPW_COMPILED] = (hpw, te_fp8)
            modules[TE_FP8_E4M3_COMPILED] = (_under_fp8(_bind(te_fp8_c, splits_t), "E4M3"), te_fp8)
            delayed = _under_fp8(_bind(te_fp8_c, splits_t), kind="DelayedScaling")
            modules[TE_FP8_DELAYED_COMPILED] = (delayed, te_fp8)
            # Float8BlockScaling (E4M3, 1x128 tokens, 128x128 weight blocks): a blockwise
            # GEMM per expert (te::grouped_linear with "block" specs), which reads the splits
            # on the host: given as a CPU tensor, as Transformer Engine takes them (no device
            # sync).
            host_splits = torch.tensor(splits, dtype=torch.int64)
            block = _under_fp8(_bind(te_fp8_c, host_splits), "E4M3", kind="Float8BlockScaling")
            modules[TE_FP8_BLOCK_COMPILED] = (block, te_fp8)
            # quantization.gemm._NATIVE_BLOCK = False's setting: the same quantisation, bf16 grouped
            # GEMMs of the dequantised values.
            emulated = functools.partial(harness.with_setting, gemm, "_NATIVE_BLOCK", False)
            modules[TE_FP8_BLOCK_EMULATED_COMPILED] = (emulated(block), te_fp8)
    baseline = GMM_COMPILED if compile_ else GMM_EAGER

    esize = torch.empty((), dtype=DTYPE).element_size()
    n_sets = harness.num_input_sets(
        (tokens * k + tokens * n) * esize, harness.l2_cache_bytes(device)
    )
    xs = [torch.randn(tokens, k, device=device, dtype=DTYPE, requires_grad=True)]
    xs += [torch.randn_like(xs[0]).requires_grad_(True) for _ in range(n_sets - 1)]
    grads = [torch.randn(tokens, n, device=device, dtype=DTYPE) for _ in range(n_sets)]
    sets = list(zip(xs, grads, strict=True))

    # Reference of the check: the eager torch._grouped_mm (the compiled rows get compared to
    # it, and this run is their compiling first call).
    check_order = [GMM_EAGER, *(name for name in modules if name != GMM_EAGER)]
    check_notes = check_grouped(
        {name: modules[name] for name in check_order},
        xs[0],
        grads[0],
        experts,
        CHECK_RTOL,
        {name: FP8_RTOL for name in (TE_FP8_EAGER, TE_FP8_COMPILED, *TE_FP8_OTHER_COMPILED)},
    )
    for note in check_notes:
        if note.startswith("WARNING"):
            print(f"  [GroupedLinear, {experts} experts] {note}", file=sys.stderr)
    notes += check_notes
    nonzero = [s for s in splits if s]
    notes.append(
        f"splits (seed {SPLIT_SEED}): min/median/max of non-empty groups "
        f"{min(nonzero)}/{sorted(nonzero)[len(nonzero) // 2]}/{max(nonzero)}, "
        f"{n_zero} empty group(s); full list in the JSON metadata"
    )
    if n_sets > 1:
        notes.append(f"{n_sets} rotating (x, grad) input sets")

    case = harness.Case(
        name=f"GroupedLinear fwd+bwd, {experts} experts",
        shape=f"{tokens} tokens in uneven splits, {k} -> {n}, bf16, no bias",
        flops=3 * 2 * tokens * k * n,
    )
    competitors = {
        name: harness.Competitor(
            fn=harness.rotating(fwd_bwd(call), sets, clear_grads=True),
            grad_to_none=tuple(mod.parameters()),
            baseline=baseline,
        )
        for name, (call, mod) in modules.items()
    }
    result = harness.run_case(case, competitors, device=device, timer=timer, notes=notes, **timing)

    max_vs_gmm = 1.0 / MIN_THROUGHPUT_VS_GMM
    what = f">= {MIN_THROUGHPUT_VS_GMM}x torch._grouped_mm throughput"
    if compile_:
        result.notes.append(target_note(result, TE_COMPILED, GMM_COMPILED, max_vs_gmm, what))
    result.notes.append(target_note(result, TE_EAGER, GMM_EAGER, max_vs_gmm, what))
    if loop_target:
        max_vs_loop = 1.0 / MIN_SPEEDUP_VS_LOOP
        what = f">= {MIN_SPEEDUP_VS_LOOP:g}x the nn.Linear loop"
        result.notes.append(target_note(result, TE_EAGER, LOOP, max_vs_loop, what))
        if compile_:
            result.notes.append(target_note(result, TE_COMPILED, LOOP, max_vs_loop, what))

    if te_fp8 is not None:
        what = f">= {MIN_FP8_SPEEDUP:g}x faster than bf16"
        if compile_:
            result.notes.append(
                target_note(result, TE_FP8_COMPILED, TE_COMPILED, 1 / MIN_FP8_SPEEDUP, what)
            )
            for row in TE_FP8_OTHER_COMPILED:
                result.notes.append(
                    target_note(result, row, TE_COMPILED, 1 / MIN_FP8_SPEEDUP, what)
                )
        result.notes.append(target_note(result, TE_FP8_EAGER, TE_EAGER, 1 / MIN_FP8_SPEEDUP, what))

    del competitors, modules, xs, grads, sets, gmm, loop, te, te_multi, te_fp8
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, splits


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_args(parser)
    parser.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=None,
        metavar="E",
        help=f"expert counts (default: {EXPERTS}; with --smoke {SMOKE_EXPERTS}); the loop "
        "target is checked from 64 experts up (with --smoke: at the largest count)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    args = parser.parse_args(argv)
    harness.PROFILE = args.profile  # harness.start sets it for the other scripts

    device = harness.resolve_device(args)
    if device.type != "cuda" and not args.smoke:
        parser.error("full-size shapes need a CUDA GPU; use --smoke on CPU")
    if args.smoke:
        tokens, k, n = SMOKE_TOKENS, SMOKE_IN, SMOKE_OUT
        timing = {"warmup_ms": 5, "rep_ms": 20, "repeat": 3, "min_trial_s": 0.01}
    else:
        tokens, k, n = TOKENS, IN_FEATURES, OUT_FEATURES
        timing = {"warmup_ms": 200, "rep_ms": 1000, "repeat": 7, "min_trial_s": 0.1}
    experts_list = args.experts or (SMOKE_EXPERTS if args.smoke else EXPERTS)

    meta = harness.collect_metadata(device)
    meta["te_compile"] = getattr(te_compile, "__version__", None)
    meta["dtype"] = "bfloat16"
    meta["smoke"] = args.smoke
    report = harness.Report("bench_grouped", meta)
    print(report.header_markdown())
    # The compiled FP8 module gets one graph per recipe and setting (delayed scaling two: its
    # calibration step, then the calibrated one): more than dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    for experts in experts_list:
        result, splits = run_case(
            experts,
            tokens,
            k,
            n,
            n_zero=zero_groups(experts, args.smoke),
            loop_target=experts >= 64 or (args.smoke and experts == max(experts_list)),
            compile_=not args.no_compile,
            fp8=experts == FP8_EXPERTS or (args.smoke and experts == min(experts_list)),
            device=device,
            timing=timing,
        )
        report.metadata[f"m_splits_{experts}_experts"] = splits
        report.add(result)
    report.finish(harness.resolve_out_dir(args, meta), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
