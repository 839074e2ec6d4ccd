"""Part 4 of ``bench_overhead``: host us per fwd+bwd module call, te_compile against plain PyTorch.

For Linear, LayerNormLinear, LayerNormMLP, GroupedLinear (8 experts), DotProductAttention and
TransformerLayer, eager: te_compile's module in bf16 and under each recipe (Float8CurrentScaling,
DelayedScaling, Float8BlockScaling; MXFP8BlockScaling and NVFP4BlockScaling as optional rows,
emulated on every GPU), beside its plain-PyTorch equivalent in bf16 (nn.Linear; nn.LayerNorm +
nn.Linear; norm + two nn.Linear + GELU; a loop of nn.Linear over split tokens and
``torch._grouped_mm``; ``F.scaled_dot_product_attention``; a plain pre-norm transformer layer)
and Transformer Engine's published figures (TE issues #3523 and #2053, GB200).

One call is ``module(*inputs).backward(grad)`` with the forward inside ``te_compile.autocast``
for a recipe; parameter and input grads are set to None before each call. Timer: host clock
around many back-to-back calls, device synchronized at the ends of each trial only, median over
trials. The shapes are small (CUDA: 128 tokens, hidden 256) so that the GPU idles while the host
issues work and the figure is host time; on CUDA each case's notes give every row's GPU busy
time per call, which must stay well below its host time. On CPU the figure is host cost plus the
tiny shapes' CPU compute (FP8 GEMMs emulated in fp32).

Targets (issue 43), printed per row of the summary table: bf16 te <= plain PyTorch + 25 us per
call; under a recipe te <= 2x te's bf16 figure, and below TE's published figure where TE has one
(Linear: MXFP8 fwd+bwd 417-441 us, TE #3523).

    python -m bench.bench_overhead --only-modules            # this part alone
    python -m bench.bench_overhead --only-modules --smoke    # tiny and short (CPU is fine)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import te_compile
from bench import harness
from te_compile.quantization.recipe import Recipe


@dataclass(frozen=True)
class ModuleShapes:
    """Part 4's shapes: small, so that the GPU idles while the host issues a call."""

    seq: int
    batch: int
    hidden: int
    ffn: int
    heads: int
    experts: int = 8
    tokens_per_expert: int = 16  # NVFP4's grouped GEMMs need multiples of 16 per group

    @property
    def tokens(self) -> int:
        return self.seq * self.batch


MODULE_SHAPES = {
    "cuda": ModuleShapes(seq=64, batch=2, hidden=256, ffn=1024, heads=4),
    "cpu": ModuleShapes(seq=16, batch=2, hidden=128, ffn=256, heads=2),
}
MODULES = (
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "GroupedLinear",
    "DotProductAttention",
    "TransformerLayer",
)
BF16 = "bf16"
PRECISIONS: dict[str, Callable[[], Recipe] | None] = {
    BF16: None,
    "Float8CurrentScaling": te_compile.recipe.Float8CurrentScaling,
    "DelayedScaling": te_compile.recipe.DelayedScaling,
    "Float8BlockScaling": te_compile.recipe.Float8BlockScaling,
    "MXFP8BlockScaling": te_compile.recipe.MXFP8BlockScaling,  # optional rows: te_compile
    "NVFP4BlockScaling": te_compile.recipe.NVFP4BlockScaling,  # emulates them on every GPU
}
BF16_TARGET_US = 25.0  # te bf16 <= plain PyTorch + 25 us per module call
FP8_TARGET_RATIO = 2.0  # te under a recipe <= 2x te bf16
# Transformer Engine's published host time per call (GB200; µs), the table's reference column.
# #3523: CPU time per call; #2053: the forward of a bf16 Linear (hidden 2048, 8192 tokens).
TE_PUBLISHED = {
    ("Linear", BF16): "277-311 fwd+bwd (TE #3523); fwd 100 vs nn.Linear 37 (TE #2053)",
    ("Linear", "fp8"): "MXFP8 417-441 fwd+bwd (TE #3523)",
    ("LayerNormMLP", BF16): "fwd only 189-210 (TE #3523)",
}
TE_FP8_FWD_BWD_US = {"Linear": 417.0}  # an FP8 row is to be below TE's published figure


class GroupedLoop(nn.Module):
    """Plain-PyTorch GroupedLinear: one ``nn.Linear`` per expert over its slice of the tokens."""

    def __init__(self, splits: list[int], in_f: int, out_f: int, **kw: Any) -> None:
        super().__init__()
        self.splits = splits
        self.linears = nn.ModuleList(nn.Linear(in_f, out_f, **kw) for _ in splits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = x.split(self.splits)
        return torch.cat([lin(c) for lin, c in zip(self.linears, chunks, strict=True)])


class GroupedMM(nn.Module):
    """Plain-PyTorch GroupedLinear on ``torch._grouped_mm``: one grouped GEMM, each token's
    expert bias gathered."""

    def __init__(self, splits: list[int], in_f: int, out_f: int, **kw: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(len(splits), out_f, in_f, **kw) / in_f**0.5)
        self.bias = nn.Parameter(torch.randn(len(splits), out_f, **kw))
        sizes = torch.tensor(splits, device=kw["device"])
        self.register_buffer("offs", sizes.cumsum(0).to(torch.int32))
        self.register_buffer(
            "expert", torch.arange(len(splits), device=sizes.device).repeat_interleave(sizes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=self.offs)
        return out + self.bias[self.expert]


def sdpa_sbhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``F.scaled_dot_product_attention`` on sbhd tensors (te.DotProductAttention's
    default layout), output ``[s, b, h * d]`` as te's."""
    s, b, h, d = q.shape
    out = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


class PlainAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_sbhd(q, k, v)


class PlainLayer(nn.Module):
    """A plain pre-norm transformer layer with te.TransformerLayer's defaults (sbhd, causal):
    LayerNorm -> QKV -> SDPA -> projection -> residual -> LayerNorm -> FC1 -> GELU (tanh) ->
    FC2 -> residual, biases everywhere, no dropout."""

    def __init__(self, hidden: int, ffn: int, heads: int, **kw: Any) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden, **kw), nn.LayerNorm(hidden, **kw)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden, **kw), nn.Linear(hidden, hidden, **kw)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn, **kw), nn.Linear(ffn, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(s, b, 3, self.heads, -1).unbind(2)
        x = x + self.proj(sdpa_sbhd(q, k, v))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


@dataclass(frozen=True)
class ModuleCase:
    """A te module, its plain-PyTorch equivalents (row name -> builder) and its inputs' shapes;
    ``te_args`` follow the inputs in te's call (GroupedLinear's ``m_splits``)."""

    name: str
    new_te: Callable[[], nn.Module]
    plain: dict[str, Callable[[], nn.Module]]
    input_shapes: tuple[tuple[int, ...], ...]
    te_args: tuple = ()


def module_cases(s: ModuleShapes, device: torch.device) -> list[ModuleCase]:
    kw = {"device": device, "dtype": torch.bfloat16}
    te_kw = {"device": device, "params_dtype": torch.bfloat16}
    h, f, t = s.hidden, s.ffn, s.tokens
    splits = [s.tokens_per_expert] * s.experts
    qkv = (s.seq, s.batch, s.heads, h // s.heads)
    te = te_compile
    return [
        ModuleCase(
            "Linear",
            lambda: te.Linear(h, h, **te_kw),
            {"nn.Linear": lambda: nn.Linear(h, h, **kw)},
            ((t, h),),
        ),
        ModuleCase(
            "LayerNormLinear",
            lambda: te.LayerNormLinear(h, h, **te_kw),
            {
                "nn.LayerNorm + nn.Linear": lambda: nn.Sequential(
                    nn.LayerNorm(h, **kw), nn.Linear(h, h, **kw)
                )
            },
            ((t, h),),
        ),
        ModuleCase(
            "LayerNormMLP",
            lambda: te.LayerNormMLP(h, f, **te_kw),
            {
                "nn.LayerNorm + nn.Linear + GELU + nn.Linear": lambda: nn.Sequential(
                    nn.LayerNorm(h, **kw),
                    nn.Linear(h, f, **kw),
                    nn.GELU(approximate="tanh"),
                    nn.Linear(f, h, **kw),
                )
            },
            ((t, h),),
        ),
        ModuleCase(
            "GroupedLinear",
            lambda: te.GroupedLinear(s.experts, h, h, **te_kw),
            {
                f"{s.experts} x nn.Linear over split tokens": lambda: GroupedLoop(
                    splits, h, h, **kw
                ),
                "torch._grouped_mm": lambda: GroupedMM(splits, h, h, **kw),
            },
            ((sum(splits), h),),
            te_args=(splits,),
        ),
        ModuleCase(
            "DotProductAttention",
            lambda: te.DotProductAttention(s.heads, h // s.heads, attn_mask_type="causal"),
            {"F.scaled_dot_product_attention": PlainAttention},
            (qkv, qkv, qkv),
        ),
        ModuleCase(
            "TransformerLayer",
            lambda: te.TransformerLayer(
                h, f, s.heads, hidden_dropout=0.0, attention_dropout=0.0, **te_kw
            ),
            {"plain pre-norm layer": lambda: PlainLayer(h, f, s.heads, **kw)},
            ((s.seq, s.batch, h),),
        ),
    ]


def fwd_bwd(
    module: nn.Module,
    inputs: Sequence[torch.Tensor],
    args: tuple = (),
    recipe: Recipe | None = None,
) -> harness.Competitor:
    """One training call: ``module(*inputs, *args).backward(grad)``, the forward inside
    ``te_compile.autocast(recipe=recipe)`` when a recipe is given (backward outside, as in a
    training loop); parameter and input grads cleared before each call."""

    def forward() -> torch.Tensor:
        if recipe is None:
            return module(*inputs, *args)
        with te_compile.autocast(recipe=recipe):
            return module(*inputs, *args)

    grad = torch.randn_like(forward())

    def call() -> None:
        forward().backward(grad)

    return harness.Competitor(call, grad_to_none=(*inputs, *module.parameters()))


def _failed(exc: Exception) -> Callable[[], None]:
    """A competitor that could not be built: it raises, and shows as an error row."""

    def call() -> None:
        raise exc

    return call


def run_module_case(
    mc: ModuleCase, precisions: Sequence[str], device: torch.device, timing: dict
) -> harness.CaseResult:
    torch.manual_seed(0)
    inputs = [
        torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
        for shape in mc.input_shapes
    ]
    builders = {name: (new, (), None) for name, new in mc.plain.items()}
    for precision in precisions:  # a fresh te module per recipe: DelayedScaling keeps state
        recipe = PRECISIONS[precision]
        builders[f"te.{mc.name} {precision}"] = (
            mc.new_te,
            mc.te_args,
            None if recipe is None else recipe(),
        )
    competitors: dict[str, harness.CompetitorLike] = {}
    for name, (new, args, recipe) in builders.items():
        try:
            competitors[name] = fwd_bwd(new(), inputs, args, recipe)
        except Exception as exc:  # e.g. no torch._grouped_mm here: an error row, not a stop
            competitors[name] = _failed(exc)
    shape = " / ".join("x".join(map(str, s)) for s in mc.input_shapes)
    case = harness.Case(f"host us per call: {mc.name}", f"fwd+bwd, bf16 inputs {shape}")
    result = harness.run_case(
        case, competitors, baseline=next(iter(mc.plain)), device=device, timer="wall", **timing
    )
    if device.type == "cuda":
        result.notes += gpu_busy_notes(competitors, result)
    return result


def gpu_busy_notes(
    competitors: dict[str, harness.CompetitorLike], result: harness.CaseResult
) -> list[str]:
    """Per row, the GPU's busy time per call (summed kernel durations) against the host time:
    the host figure is host time only while the GPU idles, i.e. busy well below 100%."""
    notes = []
    for name, comp in competitors.items():
        host_ms = result.row(name).median_ms
        if not isinstance(comp, harness.Competitor) or not host_ms:
            continue
        try:
            busy = harness.time_kernels(comp.fn, grad_to_none=comp.grad_to_none, repeat=3)
        except Exception as exc:  # e.g. no CUPTI: the timings stand without the check
            notes.append(f"{name}: no GPU busy time ({type(exc).__name__}: {exc})"[:200])
            continue
        notes.append(
            f"{name}: GPU busy {busy.median_ms * 1e3:.1f} us per call "
            f"({busy.median_ms / host_ms:.0%} of its host time)"
        )
    return notes


def _us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1e3


def target_of(
    module: str, precision: str, plain_us: float | None, bf16_us: float | None
) -> tuple[float | None, str]:
    """The row's limit in µs and what sets it: bf16, plain PyTorch + 25 us; a recipe, 2x te's
    bf16 figure or TE's published figure, whichever is lower (None: a figure is missing)."""
    if precision == BF16:
        limit = None if plain_us is None else plain_us + BF16_TARGET_US
        return limit, f"plain + {BF16_TARGET_US:g}"
    if bf16_us is None:
        return None, f"{FP8_TARGET_RATIO:g}x bf16"
    limits = {f"{FP8_TARGET_RATIO:g}x bf16": FP8_TARGET_RATIO * bf16_us}
    if module in TE_FP8_FWD_BWD_US:
        limits["TE's figure"] = TE_FP8_FWD_BWD_US[module]
    label = min(limits, key=limits.__getitem__)
    return limits[label], label


def summary_rows(
    cases: Sequence[ModuleCase], results: Sequence[harness.CaseResult], precisions: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per module and precision: te's host us per call, the fastest plain-PyTorch
    equivalent's, the target and whether it is met."""
    rows = []
    for mc, result in zip(cases, results, strict=True):
        plain = {n: _us(result.row(n).median_ms) for n in mc.plain}
        plain = {n: t for n, t in plain.items() if t is not None}
        plain_name = min(plain, key=plain.__getitem__, default=None)
        te_us = {p: _us(result.row(f"te.{mc.name} {p}").median_ms) for p in precisions}
        for precision in precisions:
            limit, label = target_of(mc.name, precision, plain.get(plain_name), te_us.get(BF16))
            us = te_us[precision]
            rows.append(
                {
                    "module": mc.name,
                    "precision": precision,
                    "te_us": us,
                    "plain": plain_name,
                    "plain_us": plain.get(plain_name),
                    "limit_us": limit,
                    "target": label,
                    "met": None if us is None or limit is None else us <= limit,
                    "te_published": TE_PUBLISHED.get(
                        (mc.name, BF16 if precision == BF16 else "fp8")
                    ),
                }
            )
    return rows


def summary_markdown(rows: Sequence[dict[str, Any]], notes: Sequence[str]) -> str:
    def cell(x: float | None) -> str:
        return "—" if x is None else f"{x:.1f}"

    lines = [
        "### host us per fwd+bwd call, per module: te_compile, plain PyTorch, TE's published",
        "",
        "| module | precision | te µs | plain PyTorch µs | target µs | met | TE published µs |",
        "| --- | --- | ---: | ---: | --- | --- | --- |",
    ]
    for r in rows:
        met = {True: "met", False: "NOT MET", None: "—"}[r["met"]]
        lines.append(
            f"| {r['module']} | {r['precision']} | {cell(r['te_us'])} | {cell(r['plain_us'])} | "
            f"<= {cell(r['limit_us'])} ({r['target']}) | {met} | {r['te_published'] or '—'} |"
        )
    plain = dict.fromkeys(f"{r['module']}: {r['plain']}" for r in rows if r["plain"])
    notes = [
        f"plain PyTorch (bf16 eager; GroupedLinear: the faster row): {'; '.join(plain)}",
        *notes,
    ]
    return "\n".join([*lines, "", *(f"- {n}" for n in notes)]) + "\n"


def summary_notes(
    device: torch.device, shapes: ModuleShapes, precisions: Sequence[str]
) -> list[str]:
    notes = [
        f"shapes: {shapes.tokens} tokens (seq {shapes.seq} x batch {shapes.batch}), hidden "
        f"{shapes.hidden}, ffn {shapes.ffn}, {shapes.heads} heads; GroupedLinear "
        f"{shapes.experts} experts x {shapes.tokens_per_expert} tokens; median over trials of "
        "back-to-back calls, device synchronized at the ends of each trial",
        "DotProductAttention is quantized by no recipe (TE's default, fp8_dpa=False): its recipe "
        "rows time the autocast region around bf16 attention",
        "TE's published figures are TE's own, on GB200 (TE issues #3523, #2053), not measured "
        "here; Linear's recipe rows are held at or below the low end of TE's MXFP8 Linear "
        "figure, its only published FP8 one",
    ]
    if device.type == "cpu":
        notes.append(
            "CPU: each figure is host cost plus the tiny shapes' CPU compute (FP8 GEMMs emulated "
            "in fp32, quantisation in PyTorch): the targets are meant for CUDA"
        )
    with contextlib.suppress(ImportError):
        from te_compile.quantization.device import emulation_reason

        for precision in precisions:
            new = PRECISIONS[precision]
            reason = new is not None and device.type == "cuda" and emulation_reason(new())
            if reason:
                notes.append(f"{precision}: emulated ({reason})")
    return notes


def run_module_tables(
    report: harness.Report,
    device: torch.device,
    timing: dict,
    modules: Sequence[str] = MODULES,
    precisions: Sequence[str] = tuple(PRECISIONS),
) -> list[dict[str, Any]]:
    """Part 4: one case per module added to ``report`` as it is timed, then the summary table
    as a section; returns the summary's rows."""
    shapes = MODULE_SHAPES["cuda" if device.type == "cuda" else "cpu"]
    cases = [mc for mc in module_cases(shapes, device) if mc.name in modules]
    results = [report.add(run_module_case(mc, precisions, device, timing)) for mc in cases]
    rows = summary_rows(cases, results, precisions)
    report.add_section(summary_markdown(rows, summary_notes(device, shapes, precisions)), rows)
    return rows
