"""Transformer block training step and compile time: a Llama-style decoder stack, fwd+bwd,
te_compile modules against the same stack in plain PyTorch (same weights).

Case (BENCHMARKS.md, "transformer block training step" and "compile time"). Per layer::

    x = x + proj(causal_sdpa(qkv(rmsnorm(x))))      # heads split, F.scaled_dot_product_attention
    x = x + fc2(silu(a) * b), [a, b] = fc1(rmsnorm(x)).chunk(2)     # SwiGLU MLP

then a final RMSNorm (``te.RMSNorm`` in the te_compile stack). No biases; bf16 parameters and
activations. SwiGLU follows te's convention: the first half of fc1's output goes through silu,
the second half is the linear gate input. The plain-PyTorch stack is ``nn.RMSNorm`` +
``nn.Linear(bias=False)`` for QKV (one fused Linear) / proj / fc1 / fc2. Two architectures
(``--arch``):

- ``block`` (default): multi-head attention, no RoPE, input [batch, seq, hidden]. The te_compile
  stack is ``te.LayerNormLinear(normalization="RMSNorm")`` (norm + QKV), ``te.Linear`` (proj),
  ``te.LayerNormMLP(normalization="RMSNorm", activation="swiglu")`` (norm + MLP).
- ``layer``: grouped-query attention (``groups`` key/value heads of ``d = hidden / heads``
  channels) with rotary embeddings on queries and keys, input [seq, batch, hidden]. The
  te_compile stack is ``te.TransformerLayer(..., num_gqa_groups=groups,
  normalization="RMSNorm", activation="swiglu", bias=False, self_attn_mask_type="causal")``
  called as ``layer(x, rotary_pos_emb=freqs)``, ``freqs = te.RotaryPositionEmbedding(d)(seq)``
  (base 10000). The plain layer splits its QKV output into queries, keys and values, applies
  RoPE as ``x cos + rotate_half(x) sin`` in fp32 (rounded once to bf16, as te's RoPE), and runs
  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``. The weights map as
  ``te_compile.convert`` maps a Hugging Face Llama's: the fused QKV weight's rows are te's
  ``query_weight``, ``key_weight``, ``value_weight`` (``TE_NAMES``). Both RoPE tables (te's
  ``freqs``; the plain cos / sin, fp32) are made once when the stack is built, outside the step.

Sizes (hidden / heads / ffn / seq / batch / layers): block: h1024 1024 / 16 / 4096 / 1024 / 8 / 8,
h2048 2048 / 16 / 8192 / 2048 / 4 / 4, h4096 4096 / 32 / 14336 / 2048 / 2 / 2; layer: l4096
4096 / 32 (8 groups) / 14336 / 2048 / 2 / 2. ``--smoke``: 64 / 4 / 128 / 16 / 2 / 2 (layer: 2
groups).

Rows, per mode (``eager``; ``compiled``: ``torch.compile(dynamic=False)``, default mode, not
fullgraph so that graph breaks are counted rather than fatal; ``reduce-overhead``:
``torch.compile(mode="reduce-overhead")``, CUDA only, ``torch.compiler.cudagraph_mark_step_begin()``
before each step; ``graphed``: eager modules captured whole into CUDA graphs, CUDA only, the te
rows by ``te.make_graphed_callables`` (with the row's recipe), the others by
``torch.cuda.make_graphed_callables``) and precision:

- ``torch bf16 <mode>``: the plain-PyTorch stack, the baseline of its mode (always run);
- ``te bf16 <mode>``: the te_compile stack;
- ``te FP8 current|delayed|block <mode>``: the te_compile stack inside
  ``te.autocast(recipe=Float8CurrentScaling() | DelayedScaling() | Float8BlockScaling())``
  (around the forward, inside the timed step; each row its own instance);
- ``torchao tensorwise|rowwise <mode>``: a copy of the plain-PyTorch stack converted with
  ``torchao.float8.convert_to_float8_training(Float8LinearConfig.from_recipe_name(...))``
  (skipped with a note when torchao is not importable).

One step is ``out = stack(x); out.backward(grad)`` with fixed random ``x`` (requires grad, its
grad cleared inside the step) and ``grad``; parameter grads are set to None before every step
(outside the timed region with the ``do_bench`` timer). Columns:

- median / p20 - p80 time per step (``bench/harness.py`` timers) and the ratio
  ``t / t(torch bf16, same mode)``;
- TFLOP/s of the model FLOPs (the same count for every row, so an FP8 row's figure is
  bf16-equivalent throughput)::

      FLOPs = layers * (6 * T * (h * (h + 2 * g * d) + h^2 + 3 * h * ffn) + 6 * b * s^2 * h)

  with ``T = b * s``, ``g`` key/value heads of ``d`` channels (``g * d = h`` without GQA, the
  block arch: ``4 * h^2 + 3 * h * ffn``). The first term is the GEMMs (QKV h * (h + 2gd), proj
  h^2, fc1 2*h*ffn, fc2 ffn*h per token; 2 FLOPs per multiply-add, forward once and backward
  twice: dgrad + wgrad). The second is causal attention: QK^T and PV are 2 * 2 * b * s^2 * h
  FLOPs forward over all query heads (GQA shares keys and values, not the work), halved by the
  causal mask, and the backward's four GEMMs (dV, dP, dQ, dK) are twice the forward; no
  recompute counted. Norms, SwiGLU, RoPE, softmax and residuals are not counted;
- first step (s): wall time of the row's first step, compilation included for compiled modes
  (each compiled row runs under ``torch._inductor.utils.fresh_cache()``, an empty Inductor /
  Triton cache directory, unless ``--warm-cache``; te_compile's own Triton kernels stay
  compiled in memory once an earlier row launched them);
- peak memory (GiB): ``torch.cuda.max_memory_allocated`` over the warm-up and timed steps,
  reset before them; only this row's stack lives on the GPU then (the weights wait on the host);
- graph breaks (compiled modes): compiled regions one steady-state step enters - 1 (profiler
  events "Torch-Compiled Region", one per call of a Dynamo-compiled frame: a graph that serves
  every layer after a break counts once per layer); graphs compiled after the first step
  (recompiles: delayed scaling's calibrated step) are noted under the table with the second
  step's seconds, as are Inductor's CUDA graph skips;
- rel. err out / dx: ``||a - b|| / ||b||`` of the output and of the input gradient against
  the plain-PyTorch bf16 eager stack on the same input, measured on a step after the timing
  (delayed scaling has its amax history by then).

``--profile`` (CUDA) adds each row's top kernels under the table.

    python -m bench.bench_block                                   # CUDA, block sizes, all rows
    python -m bench.bench_block --size h1024 --modes compiled --precisions bf16 current
    python -m bench.bench_block --smoke --device cpu              # tiny stack, runs on CPU
    python -m bench.bench_block --arch layer --size l4096 --modes compiled --precisions bf16 current
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python bench/bench_block.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import te_compile as te
from bench import harness
from te_compile.quantization.recipe import Recipe

DTYPE = torch.bfloat16
EPS = 1e-5
TE_BF16_RTOL = 5e-2  # te bf16 vs torch bf16 eager, relative L2 error: bf16 through the stack

MODES = ("eager", "compiled", "reduce-overhead", "graphed")
PRECISIONS = ("bf16", "current", "delayed", "block", "tensorwise", "rowwise")
# Not in the default list: current_fast, current scaling whose backward GEMMs accumulate fast
# (Float8CurrentScaling's fp8_gemm_dgrad / fp8_gemm_wgrad with use_split_accumulator=False).
_FAST = te.recipe.MMParams(use_split_accumulator=False)
TE_RECIPES: dict[str, Callable[[], Recipe]] = {
    "current": te.recipe.Float8CurrentScaling,
    "current_fast": lambda: te.recipe.Float8CurrentScaling(
        fp8_gemm_dgrad=_FAST, fp8_gemm_wgrad=_FAST
    ),
    "delayed": te.recipe.DelayedScaling,
    "block": te.recipe.Float8BlockScaling,
}
TORCHAO_RECIPES = ("tensorwise", "rowwise")

# Steps of 5-50 ms on an H100: half a second gives 10-100 samples per row.
BLOCK_TIMING = {"warmup_ms": 100, "rep_ms": 500, "repeat": 5, "min_trial_s": 0.1}


# --------------------------------------------------------------------------------------------
# Sizes and FLOPs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    """One stack's shape; ``groups``: key/value heads (None: as many as query heads, the block
    arch's plain multi-head attention); ``arch``: the architecture it is a size of (ARCHS)."""

    name: str
    hidden: int
    heads: int
    ffn: int
    seq: int
    batch: int
    layers: int
    groups: int | None = None
    arch: str = "block"

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"Size {self.name}: arch must be one of {ARCHS}, got {self.arch!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"Size {self.name}: heads must divide hidden, groups divide heads")
        if self.arch == "block" and self.kv_heads != self.heads:
            raise ValueError(f"Size {self.name}: the block arch has no GQA (groups=None)")

    @property
    def kv_heads(self) -> int:
        return self.heads if self.groups is None else self.groups

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_split(self) -> tuple[int, int, int]:
        """Rows of the fused QKV weight: queries, keys, values."""
        kv = self.kv_heads * self.head_dim
        return self.hidden, kv, kv

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """The stacks' input: [seq, batch, hidden] (layer arch, TransformerLayer's layout) or
        [batch, seq, hidden] (block arch)."""
        if self.arch == "layer":
            return self.seq, self.batch, self.hidden
        return self.batch, self.seq, self.hidden

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def gemm_params_per_layer(self) -> int:
        """QKV h*(h + 2*g*d) + proj h^2 + fc1 2*h*ffn + fc2 ffn*h (g*d = h without GQA)."""
        return self.hidden * sum(self.qkv_split) + self.hidden**2 + 3 * self.hidden * self.ffn

    @property
    def flops(self) -> int:
        """Model FLOPs of one fwd+bwd step (module docstring)."""
        gemms = 6 * self.tokens * self.gemm_params_per_layer
        attention = 6 * self.batch * self.seq**2 * self.hidden  # causal, fwd + 2x bwd
        return self.layers * (gemms + attention)

    def describe(self) -> str:
        gqa = f" (GQA, {self.kv_heads} groups), RoPE" if self.arch == "layer" else ""
        return (
            f"hidden {self.hidden}, {self.heads} heads{gqa}, ffn {self.ffn}, seq {self.seq}, "
            f"batch {self.batch}, {self.layers} layers, bf16"
        )


# The architectures (--arch), as the case titles name them.
ARCHS = {
    "block": "te.LayerNormLinear / te.Linear / te.LayerNormMLP stack",
    "layer": "te.TransformerLayer stack",
}
SIZES = {
    "h1024": Size("h1024", 1024, 16, 4096, 1024, 8, 8),
    "h2048": Size("h2048", 2048, 16, 8192, 2048, 4, 4),
    "h4096": Size("h4096", 4096, 32, 14336, 2048, 2, 2),
    "l4096": Size("l4096", 4096, 32, 14336, 2048, 2, 2, groups=8, arch="layer"),
}
# Multiples of 16, as FP8 GEMMs need (the layer's QKV: 64 + 2 * 2 * 16 = 128 rows).
SMOKE_SIZES = {
    "block": Size("smoke", 64, 4, 128, 16, 2, 2),
    "layer": Size("smoke", 64, 4, 128, 16, 2, 2, groups=2, arch="layer"),
}
ROPE_BASE = 10000.0  # te.RotaryPositionEmbedding's default rotary_base


# --------------------------------------------------------------------------------------------
# The two stacks
# --------------------------------------------------------------------------------------------


def causal_attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, s, 3h] -> causal SDPA over ``heads`` heads -> [b, s, h]."""
    b, s, three_h = qkv.shape
    h = three_h // 3
    q, k, v = (t.view(b, s, heads, h // heads).transpose(1, 2) for t in qkv.split(h, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, s, h)


class TorchLayer(nn.Module):
    """The block arch's layer in plain PyTorch, input [b, s, h]."""

    def __init__(self, size: Size, device: torch.device) -> None:
        super().__init__()
        kw = {"device": device, "dtype": DTYPE}
        h, f = size.hidden, size.ffn
        self.heads = size.heads
        self.attn_norm = nn.RMSNorm(h, eps=EPS, **kw)
        self.qkv = nn.Linear(h, sum(size.qkv_split), bias=False, **kw)
        self.proj = nn.Linear(h, h, bias=False, **kw)
        self.mlp_norm = nn.RMSNorm(h, eps=EPS, **kw)
        self.fc1 = nn.Linear(h, 2 * f, bias=False, **kw)
        self.fc2 = nn.Linear(f, h, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_attention(self.qkv(self.attn_norm(x)), self.heads))
        return x + self.mlp(x)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        a, gate = self.fc1(self.mlp_norm(x)).chunk(2, dim=-1)  # te's SwiGLU: silu(first half)
        return self.fc2(F.silu(a) * gate)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` in fp32, rounded once to ``x``'s dtype (as te's RoPE)."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


class TorchRoPE(nn.Module):
    """The plain stack's RoPE table, made once at construction: cos and sin (fp32,
    [s, 1, 1, d]) of the angles ``p * base^(-2i/d)``, the ``d/2`` frequencies repeated for both
    halves (``rotate_half``'s pairing; te.RotaryPositionEmbedding's frequencies and layout)."""

    def __init__(self, size: Size, device: torch.device) -> None:
        super().__init__()
        d = size.head_dim
        inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.arange(size.seq, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


class TorchTransformerLayer(TorchLayer):
    """The layer arch's layer in plain PyTorch, input [s, b, h] (te.TransformerLayer's layout):
    fused QKV (rows: queries, keys, values), RoPE on queries and keys, causal SDPA with
    ``enable_gqa``; the MLP as the block arch's."""

    def __init__(self, size: Size, device: torch.device) -> None:
        super().__init__(size, device)
        self.kv_heads, self.head_dim, self.split = size.kv_heads, size.head_dim, size.qkv_split

    def forward(
        self, x: torch.Tensor, rotary_pos_emb: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        s, b, h = x.shape
        cos, sin = rotary_pos_emb
        q, k, v = self.qkv(self.attn_norm(x)).split(self.split, dim=-1)
        q = apply_rope(q.view(s, b, self.heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(s, b, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(s, b, self.kv_heads, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(y.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.mlp(x)


class TeRoPE(nn.Module):
    """The te stack's RoPE table, made once at construction:
    ``te.RotaryPositionEmbedding(head_dim)(seq)``, fp32 [s, 1, 1, d]."""

    def __init__(self, size: Size, device: torch.device) -> None:
        super().__init__()
        rope = te.RotaryPositionEmbedding(size.head_dim, rotary_base=ROPE_BASE, device=device)
        self.register_buffer("freqs", rope(size.seq), persistent=False)

    def forward(self) -> torch.Tensor:
        return self.freqs


def te_transformer_layer(size: Size, device: torch.device) -> te.TransformerLayer:
    """The layer arch's te layer, configured as ``te_compile.convert`` builds a Llama's:
    separate query / key / value weights (``fuse_qkv_params=False``: one fused Parameter, rows
    ``[q; k; v]``), RMSNorm, SwiGLU, causal, [s, b, h]; no biases, no dropout."""
    return te.TransformerLayer(
        size.hidden,
        size.ffn,
        size.heads,
        num_gqa_groups=size.kv_heads,
        layernorm_epsilon=EPS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type="causal",
        normalization="RMSNorm",
        activation="swiglu",
        bias=False,
        params_dtype=DTYPE,
        device=device,
    )


class TeLayer(nn.Module):
    """The block arch's layer from te_compile modules, input [b, s, h]."""

    def __init__(self, size: Size, device: torch.device) -> None:
        super().__init__()
        kw = {"params_dtype": DTYPE, "device": device}
        h = size.hidden
        self.heads = size.heads
        self.qkv = te.LayerNormLinear(h, 3 * h, eps=EPS, bias=False, normalization="RMSNorm", **kw)
        self.proj = te.Linear(h, h, bias=False, **kw)
        self.mlp = te.LayerNormMLP(
            h, size.ffn, eps=EPS, bias=False, activation="swiglu", normalization="RMSNorm", **kw
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(causal_attention(self.qkv(x), self.heads))
        return x + self.mlp(x)


class Stack(nn.Module):
    """``layers`` decoder layers, then a final RMSNorm. ``rope`` (layer arch): a module whose
    output (the RoPE table, a buffer) every layer gets as ``rotary_pos_emb``."""

    def __init__(
        self, layers: list[nn.Module], norm: nn.Module, rope: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rope = rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw = {} if self.rope is None else {"rotary_pos_emb": self.rope()}
        for layer in self.layers:
            x = layer(x, **kw)
        return self.norm(x)


def torch_stack(size: Size, device: torch.device) -> Stack:
    norm = nn.RMSNorm(size.hidden, eps=EPS, device=device, dtype=DTYPE)
    if size.arch == "layer":
        layers = [TorchTransformerLayer(size, device) for _ in range(size.layers)]
        return Stack(layers, norm, TorchRoPE(size, device))
    return Stack([TorchLayer(size, device) for _ in range(size.layers)], norm)


def te_stack(size: Size, device: torch.device) -> Stack:
    norm = te.RMSNorm(size.hidden, eps=EPS, params_dtype=DTYPE, device=device)
    if size.arch == "layer":
        layers = [te_transformer_layer(size, device) for _ in range(size.layers)]
        return Stack(layers, norm, TeRoPE(size, device))
    return Stack([TeLayer(size, device) for _ in range(size.layers)], norm)


# Plain-PyTorch parameter name (within a layer) -> te_compile's, per arch. A tuple splits the
# tensor's rows (Size.qkv_split) over te's names: TransformerLayer's query / key / value
# weights, as te_compile.convert maps a Hugging Face Llama's q/k/v_proj.
_TE_QKV = "self_attention.layernorm_qkv."
TE_NAMES: dict[str, dict[str, str | tuple[str, ...]]] = {
    "block": {
        "attn_norm.weight": "qkv.layer_norm_weight",
        "qkv.weight": "qkv.weight",
        "proj.weight": "proj.weight",
        "mlp_norm.weight": "mlp.layer_norm_weight",
        "fc1.weight": "mlp.fc1_weight",
        "fc2.weight": "mlp.fc2_weight",
    },
    "layer": {
        "attn_norm.weight": _TE_QKV + "layer_norm_weight",
        "qkv.weight": tuple(_TE_QKV + f"{part}_weight" for part in ("query", "key", "value")),
        "proj.weight": "self_attention.proj.weight",
        "mlp_norm.weight": "layernorm_mlp.layer_norm_weight",
        "fc1.weight": "layernorm_mlp.fc1_weight",  # silu half first, as te's SwiGLU
        "fc2.weight": "layernorm_mlp.fc2_weight",
    },
}


def te_state_dict(weights: dict[str, torch.Tensor], size: Size) -> dict[str, torch.Tensor]:
    """The plain-PyTorch stack's parameters under the te_compile stack's names."""
    names = TE_NAMES[size.arch]
    out = {}
    for name, tensor in weights.items():
        if not name.startswith("layers."):
            out[name] = tensor
            continue
        _, index, rest = name.split(".", 2)
        target = names[rest]
        if isinstance(target, str):
            out[f"layers.{index}.{target}"] = tensor
            continue
        for part, rows in zip(target, tensor.split(size.qkv_split), strict=True):
            out[f"layers.{index}.{part}"] = rows
    return out


def make_weights(size: Size, device: torch.device) -> dict[str, torch.Tensor]:
    """The shared weights, on the host: ``nn.Linear``'s default init, and norm scales
    1 + 0.1 N(0, 1) (not all ones, so that a mix-up of the norms would show in the errors)."""
    torch.manual_seed(0)
    stack = torch_stack(size, device)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return {k: v.detach().cpu() for k, v in stack.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowSpec:
    impl: str  # "torch" | "te" | "torchao"
    precision: str  # one of PRECISIONS
    mode: str  # one of MODES
    opaque: bool = False  # te ops kept as opaque calls (not traced through by Inductor)

    @property
    def name(self) -> str:
        te_fp8 = self.impl == "te" and self.precision != "bf16"
        label = f"FP8 {self.precision}" if te_fp8 else self.precision
        return f"{self.impl} {label} {self.mode}" + (" (opaque ops)" if self.opaque else "")

    @property
    def baseline(self) -> str:
        return RowSpec("torch", "bf16", self.mode).name


def row_specs(
    modes: Sequence[str], precisions: Sequence[str], *, torchao: bool, opaque: bool = False
) -> list[RowSpec]:
    """Every row, grouped by mode; ``torch bf16`` always (the mode's baseline). ``opaque``: each
    compiled te row also with the te ops kept opaque (what Inductor gets without tracing into
    them: the cost of a dispatcher call per op, measured side by side)."""
    specs = []
    for mode in modes:
        specs.append(RowSpec("torch", "bf16", mode))
        for p in precisions:
            if p == "bf16" or p in TE_RECIPES:
                specs.append(RowSpec("te", p, mode))
                if opaque and mode in ("compiled", "reduce-overhead"):
                    specs.append(RowSpec("te", p, mode, opaque=True))
            elif p in TORCHAO_RECIPES and torchao:
                specs.append(RowSpec("torchao", p, mode))
    return specs


def torchao_available() -> tuple[bool, str | None]:
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        return False, f"torchao rows skipped: torchao is not importable ({exc})"
    return True, None


def build_model(
    spec: RowSpec, size: Size, weights: dict[str, torch.Tensor], device: torch.device
) -> nn.Module:
    """The row's stack on ``device``, holding ``weights``."""
    if spec.impl == "te":
        model = te_stack(size, device)
        model.load_state_dict(te_state_dict(weights, size), strict=True)
        return model
    model = torch_stack(size, device)
    model.load_state_dict(weights, strict=True)
    if spec.impl == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(spec.precision)
        model = convert_to_float8_training(model, config=config)
    return model


def make_call(
    spec: RowSpec, model: nn.Module, x: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The model compiled (or CUDA-graphed) per the row's mode, under te's autocast for the te
    FP8 rows; ``x``: the sample input a graphed row is captured with."""
    recipe = TE_RECIPES[spec.precision]() if spec.precision in TE_RECIPES else None
    if spec.mode == "graphed":
        sample = (x.detach().clone().requires_grad_(),)
        if spec.impl == "te":
            return te.make_graphed_callables(
                model, sample, enabled=recipe is not None, recipe=recipe
            )
        return torch.cuda.make_graphed_callables(model, sample)
    fn: Callable[[torch.Tensor], torch.Tensor] = model
    if spec.mode != "eager":
        mode = "reduce-overhead" if spec.mode == "reduce-overhead" else None
        fn = torch.compile(model, mode=mode, dynamic=False)
    if spec.impl != "te" or recipe is None:
        return fn

    def under_autocast(x: torch.Tensor) -> torch.Tensor:
        with te.autocast(recipe=recipe):
            return fn(x)

    return under_autocast


def forward_backward(
    call: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    grad: torch.Tensor,
    cudagraphs: bool,
) -> torch.Tensor:
    """One training step (no optimizer): fwd, bwd; returns the output."""
    if cudagraphs:
        torch.compiler.cudagraph_mark_step_begin()
    x.grad = None
    out = call(x)
    out.backward(grad)
    return out


def clear_grads(params: Sequence[torch.Tensor], x: torch.Tensor) -> None:
    for p in params:
        p.grad = None
    x.grad = None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def dynamo_graphs() -> int:
    """Graphs Dynamo compiled since the last ``reset_between_rows``."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compiled_regions_per_step(step: Callable[[], None]) -> int:
    """Compiled regions one step enters (torch.profiler's "Torch-Compiled Region" events, one
    per call of a Dynamo-compiled frame; the compiled backward is not one). One graph means no
    break; a graph reused for every layer counts once per call, unlike Dynamo's unique graphs."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU]) as prof:
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        step()
    return sum(e.name.startswith("Torch-Compiled Region") for e in prof.events())


def cudagraph_skips() -> int:
    return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


@dataclass
class RowOutcome:
    row: harness.Row
    extras: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def run_row(
    spec: RowSpec,
    size: Size,
    weights: dict[str, torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    *,
    device: torch.device,
    timing: dict[str, Any],
    warm_cache: bool,
    calibrate_eagerly: bool = False,
) -> RowOutcome:
    """Build, compile (first step), time, measure peak memory and errors of one row;
    ``calibrate_eagerly``: a compiled delayed-scaling row runs its calibration step eagerly
    first (``docs/fp8.md``), so that its first compiled step is the delayed step's one compile."""
    compiled = spec.mode in ("compiled", "reduce-overhead")
    cache = (
        torch._inductor.utils.fresh_cache()
        if compiled and not warm_cache
        else contextlib.nullcontext()
    )
    print(f"  [{size.name}] {spec.name} ...", file=sys.stderr, flush=True)
    reset_between_rows(device)
    # te ops are traced through unless AOTAutograd is told to keep custom Triton ops whole.
    ops_mode = torch._functorch.config.patch(decompose_custom_triton_ops=not spec.opaque)
    try:
        with cache, ops_mode:
            return _measure_row(
                spec, size, weights, inputs, reference, device, timing, calibrate_eagerly
            )
    except Exception as exc:  # report and keep going: one broken row != no data
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"  [{size.name}] {spec.name} FAILED: {msg}", file=sys.stderr, flush=True)
        return RowOutcome(harness.Row(spec.name, None, spec.baseline, error=msg))
    finally:
        reset_between_rows(device)


def _measure_row(
    spec: RowSpec,
    size: Size,
    weights: dict[str, torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    timing: dict[str, Any],
    calibrate_eagerly: bool = False,
) -> RowOutcome:
    x, grad = inputs
    compiled = spec.mode in ("compiled", "reduce-overhead")
    cudagraphs = spec.mode == "reduce-overhead"
    model = build_model(spec, size, weights, device)
    params = list(model.parameters())
    call = make_call(spec, model, x)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step() -> None:  # nothing kept across steps
        # The parameters' gradients are dropped first, as zero_grad(set_to_none=True) does: a
        # gradient accumulated across CUDA-graph steps reads a graph output a later replay
        # overwrote (pytorch#169545; triton's do_bench drops them only in its timed loop).
        clear_grads(params, x)
        forward_backward(call, x, grad, cudagraphs)

    eager_calibration_s = None
    if calibrate_eagerly and compiled and spec.impl == "te" and spec.precision == "delayed":
        eager = make_call(RowSpec(spec.impl, spec.precision, "eager"), model, x)
        sync()
        t0 = time.perf_counter()
        clear_grads(params, x)
        forward_backward(eager, x, grad, cudagraphs=False)
        sync()
        eager_calibration_s = time.perf_counter() - t0
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    first_step_s = time.perf_counter() - t0
    graphs = dynamo_graphs()
    # The second step on its own: delayed scaling compiles its calibrated graph here.
    t0 = time.perf_counter()
    step()
    sync()
    second_step_s = time.perf_counter() - t0
    clear_grads(params, x)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = harness.time_fn(step, device=device, grad_to_none=params, warmup_calls=2, **timing)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None

    regions = compiled_regions_per_step(step) if compiled else None
    # One step: two FP8 steps of the h1024 stack (~1,400 launches) fill CUDA's launch queue,
    # and the host then waits for the sleeping GPU (500 ms "host time", H200 2026-11-29).
    host = harness.host_ms(step, device, calls=1)
    kernels = harness.kernels_per_call(step, params) if device.type == "cuda" else None
    clear_grads(params, x)
    out = forward_backward(call, x, grad, cudagraphs).detach().clone()
    dx = x.grad.detach().clone()
    clear_grads(params, x)
    ref_out, ref_dx = reference
    extras: dict[str, Any] = {
        "impl": spec.impl,
        "precision": spec.precision,
        "mode": spec.mode,
        "first_step_s": first_step_s,
        "second_step_s": second_step_s,
        "eager_calibration_s": eager_calibration_s,
        "host_ms": host,
        "kernels_per_layer": None if kernels is None else kernels / size.layers,
        "peak_mem_bytes": peak,
        "graphs_first_step": graphs if compiled else None,
        "recompiled_graphs": dynamo_graphs() - graphs if compiled else None,
        "compiled_regions_per_step": regions,
        "graph_breaks": max(regions - 1, 0) if regions is not None else None,
        "cudagraph_skips": cudagraph_skips() if cudagraphs else None,
        "rel_err_out": rel_err(out, ref_out),
        "rel_err_dx": rel_err(dx, ref_dx),
    }
    notes = row_notes(spec, extras)
    if harness.PROFILE and device.type == "cuda":  # --profile: where the step's GPU time goes
        notes.append(f"kernels of {spec.name}: " + harness.kernel_breakdown(step, params))
    return RowOutcome(harness.Row(spec.name, t, spec.baseline), extras, notes)


def row_notes(spec: RowSpec, extras: dict[str, Any]) -> list[str]:
    """Recompiles, CUDA graph skips, non-finite or too-large errors of one row."""
    notes = []
    if extras.get("eager_calibration_s") is not None:
        notes.append(f"{spec.name}: calibration step run eagerly before the first compiled step "
                     f"({extras['eager_calibration_s']:.3g} s, not in its first step)")  # fmt: skip
    if extras["recompiled_graphs"]:
        notes.append(f"{spec.name}: {extras['recompiled_graphs']} graph(s) compiled after step 1 "
                     f"(step 2: {extras['second_step_s']:.3g} s)")  # fmt: skip
    if extras["cudagraph_skips"]:
        notes.append(f"{spec.name}: Inductor skipped CUDA graphs ({extras['cudagraph_skips']}x)")
    errs = (extras["rel_err_out"], extras["rel_err_dx"])
    if not all(math.isfinite(e) for e in errs):
        notes.append(f"WARNING: {spec.name}: output or input gradient is not finite")
    elif spec.precision == "bf16" and max(errs) > TE_BF16_RTOL:
        notes.append(f"WARNING: {spec.name} differs from torch bf16 eager beyond {TE_BF16_RTOL:g}")
    return notes


def reset_between_rows(device: torch.device) -> None:
    """Fresh Dynamo state and counters, memory handed back."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up_compiler(device: torch.device) -> None:
    """Compile and run a tiny fwd+bwd once (in a throwaway cache dir), so that the first
    compiled row does not also pay the process's one-time costs (Inductor's imports, its
    compile workers, the C++ toolchain probe on CPU)."""
    lin = nn.Linear(32, 96, bias=False, device=device, dtype=DTYPE)
    norm = nn.RMSNorm(32, eps=EPS, device=device, dtype=DTYPE)
    x = torch.randn(2, 16, 32, device=device, dtype=DTYPE, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.silu(causal_attention(lin(norm(x)), 2))

    with torch._inductor.utils.fresh_cache():
        torch.compile(fn, dynamic=False)(x).sum().backward()
    reset_between_rows(device)


def reference_outputs(
    size: Size,
    weights: dict[str, torch.Tensor],
    inputs: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of the plain-PyTorch bf16 eager stack."""
    x, grad = inputs
    model = build_model(RowSpec("torch", "bf16", "eager"), size, weights, device)
    out = forward_backward(model, x, grad, cudagraphs=False).detach()
    dx = x.grad.detach().clone()
    x.grad = None
    return out, dx


# --------------------------------------------------------------------------------------------
# Results: the harness's case, with the block's extra columns
# --------------------------------------------------------------------------------------------


@dataclass
class BlockCaseResult(harness.CaseResult):
    """A harness case plus, per row, first step, peak memory, graph breaks and errors."""

    extras: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for r in d["results"]:
            r.update(self.extras.get(r["name"], {}))
        return d


def _cell(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if x is None else format(x * scale, spec)


def format_block_markdown(result: harness.CaseResult) -> str:
    extras = getattr(result, "extras", {})
    header = [
        "row",
        "median",
        "p20 - p80",
        "TFLOP/s",
        "t / t(torch bf16, same mode)",
        "host ms",
        "kernels / layer",
        "first step (s)",
        "peak mem (GiB)",
        "graph breaks",
        "rel. err out / dx",
    ]
    align = ["---", *["---:"] * (len(header) - 1)]
    lines = [
        f"### {result.case.name} — {result.case.shape}",
        "",
        f"timer: {harness._TIMER_TEXT.get(result.timer, result.timer)}; ratios are against "
        "the plain-PyTorch bf16 row of the same mode (< 1 is faster).",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join(align) + " |",
    ]
    for r in result.rows:
        e = extras.get(r.name, {})
        if r.timing is None:
            cells = [r.name, "error", r.error or "?", *["—"] * (len(header) - 3)]
        else:
            errs = (e.get("rel_err_out"), e.get("rel_err_dx"))
            cells = [
                r.name,
                harness.format_time(r.timing.median_ms),
                f"{harness.format_time(r.timing.p20_ms)} - {harness.format_time(r.timing.p80_ms)}",
                harness.format_rate(r.tflops),
                "(baseline)" if r.baseline == r.name else _cell(r.ratio, ".3f") + "x",
                _cell(e.get("host_ms"), ".3g"),
                _cell(e.get("kernels_per_layer"), ".0f"),
                _cell(e.get("first_step_s"), ".3g"),
                _cell(e.get("peak_mem_bytes"), ".2f", 2.0**-30),
                "—" if e.get("graph_breaks") is None else str(e["graph_breaks"]),
                " / ".join(_cell(x, ".1e") for x in errs),
            ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if result.notes:
        lines.append("")
        lines += [f"- {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


class BlockReport(harness.Report):
    """The harness's report (JSON, markdown, chart) with the block's table."""

    def add(self, result: harness.CaseResult, *, echo: bool = True) -> harness.CaseResult:
        self.cases.append(result)
        if echo:
            print(format_block_markdown(result), flush=True)
        return result

    def markdown(self) -> str:
        return "\n".join([self.header_markdown(), *map(format_block_markdown, self.cases)])


def case_notes(size: Size, skipped: Sequence[str]) -> list[str]:
    h, s, b = size.hidden, size.seq, size.batch
    if size.kv_heads == size.heads:
        gemms = "4h^2 + 3h*ffn"
    else:
        gemms = f"h*(h + 2*g*d) + h^2 + 3h*ffn, g*d = {size.kv_heads}*{size.head_dim}"
    return [
        f"FLOPs/step = layers * (6 * T * ({gemms}) + 6 * b * s^2 * h) = "
        f"{size.flops / 1e9:.4g} GFLOP (T = b*s = {b * s}; causal attention, no recompute; "
        f"norms / SwiGLU / softmax / RoPE not counted)",
        "first step: compilation included for compiled rows (each under an empty Inductor / "
        "Triton cache dir unless --warm-cache); peak mem: max_memory_allocated over the "
        "warm-up and timed steps (this row's stack only)",
        "host ms: the host's time to issue one step while the GPU sleeps (a step whose host "
        "ms exceeds its median is host-bound; on the CPU, the step's wall time); kernels / "
        "layer: CUDA kernels one step launches (torch.profiler: Triton, cuBLAS, copies), "
        "divided by the layers",
        "graph breaks: compiled regions entered per step - 1; rel. err: ||a - b|| / ||b|| of the "
        f"output / input gradient against torch bf16 eager (hidden {h}, seq {s})",
        *skipped,
    ]


def run_size(
    size: Size,
    specs: Sequence[RowSpec],
    *,
    device: torch.device,
    timing: dict[str, Any],
    warm_cache: bool,
    skipped: Sequence[str],
    calibrate_eagerly: bool = False,
) -> BlockCaseResult:
    """One table: every row on the same weights and input."""
    weights = make_weights(size, device)
    torch.manual_seed(1)
    x = torch.randn(size.input_shape, device=device, dtype=DTYPE)
    inputs = (x.requires_grad_(True), torch.randn_like(x))
    reset_between_rows(device)
    reference = reference_outputs(size, weights, inputs, device)
    outcomes = []
    for spec in specs:
        outcome = run_row(
            spec,
            size,
            weights,
            inputs,
            reference,
            device=device,
            timing=timing,
            warm_cache=warm_cache,
            calibrate_eagerly=calibrate_eagerly,
        )
        outcomes.append(outcome)
        # Each row's time as soon as it is measured: a run stopped by a time limit keeps them.
        ms = outcome.row.median_ms
        done = f"{ms:.3f} ms" if ms is not None else f"error: {outcome.row.error}"
        print(f"  [{size.name}] {spec.name}: {done}", file=sys.stderr, flush=True)
    notes = case_notes(size, skipped)
    for o in outcomes:
        notes += o.notes
    for note in notes:
        if note.startswith("WARNING"):
            print(f"  [{size.name}] {note}", file=sys.stderr)
    case = harness.Case(
        name=f"transformer block training step, {ARCHS[size.arch]}, {size.name}",
        shape=size.describe(),
        flops=size.flops,
    )
    return BlockCaseResult(
        case,
        [o.row for o in outcomes],
        harness.resolve_timer("auto", device),
        notes,
        extras={o.row.name: o.extras for o in outcomes},
    )


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def raise_recompile_limits() -> None:
    """Rows must not hit Dynamo's recompile limits (each row also starts from a reset)."""
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4096)
    else:  # older torch
        cfg.cache_size_limit = max(cfg.cache_size_limit, 64)
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4096)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, torch.device, dict, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch",
        choices=list(ARCHS),
        default="block",
        help="block: te.LayerNormLinear / Linear / LayerNormMLP layers, no GQA, no RoPE; "
        "layer: te.TransformerLayer with GQA and RoPE (default: block)",
    )
    parser.add_argument(
        "--size",
        nargs="+",
        choices=list(SIZES),
        help="sizes to run, of the chosen arch (default: all of the arch; --smoke runs its "
        "tiny size instead): " + ", ".join(f"{n} ({s.arch})" for n, s in SIZES.items()),
    )
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="default: all"
    )
    parser.add_argument(
        "--precisions",
        nargs="+",
        choices=(*PRECISIONS, "current_fast"),
        default=list(PRECISIONS),
        help="bf16 (te), te FP8 current / delayed / block, torchao tensorwise / rowwise "
        "(default: these; torch bf16 always runs as the baseline); current_fast: current "
        "scaling with the backward GEMMs' fast accumulation",
    )
    parser.add_argument(
        "--opaque",
        action="store_true",
        help="also run each compiled te row with the te ops opaque (not traced through)",
    )
    parser.add_argument(
        "--triton-launcher",
        action="store_true",
        help="Inductor launches our Triton kernels with Triton's own launcher "
        "(te.set_static_launch(False), torch's default) instead of its static CUDA launcher, "
        "which import te_compile selects; for an A/B of the launcher run once with and once "
        "without. Which launcher ran shows in a profile (python -m bench.diag.diag_compiled_host "
        "--cprofile 3: Triton's is triton/backends/nvidia/driver.py)",
    )
    parser.add_argument(
        "--calibrate-eagerly",
        action="store_true",
        help="compiled te FP8 delayed rows: run DelayedScaling's calibration step eagerly before "
        "the first compiled step (docs/fp8.md), which is then the one compile of the delayed "
        "graph; the eager step's seconds are in the row's notes",
    )
    parser.add_argument(
        "--warm-cache",
        action="store_true",
        help="keep the Inductor / Triton caches (default: an empty cache dir per compiled row, "
        "so that the first step is a cold compile)",
    )
    started = harness.start(parser, argv, "bench_block", full_timing=BLOCK_TIMING)
    args = started[0]
    if args.size is None:
        args.size = [name for name, size in SIZES.items() if size.arch == args.arch]
    other = [name for name in args.size if SIZES[name].arch != args.arch]
    if other:
        parser.error(f"--size {' '.join(other)}: not a size of --arch {args.arch}")
    return started


def main(argv: Sequence[str] | None = None) -> int:
    args, device, timing, started = parse_args(argv)
    report = BlockReport(started.script, started.metadata)
    raise_recompile_limits()
    if "compiled" in args.modes or "reduce-overhead" in args.modes:
        warm_up_compiler(device)
    has_torchao, torchao_note = torchao_available()
    if has_torchao:
        import torchao

        report.metadata["torchao"] = torchao.__version__
    modes = list(args.modes)
    skipped = []
    for mode in ("reduce-overhead", "graphed"):
        if device.type != "cuda" and mode in modes:
            modes.remove(mode)
            skipped.append(f"{mode} rows skipped: CUDA graphs need a CUDA device")
    if torchao_note and set(args.precisions) & set(TORCHAO_RECIPES):
        skipped.append(torchao_note)
    for note in skipped:
        print(f"  {note}", file=sys.stderr)
    if args.triton_launcher:  # before the first compile starts Inductor's workers
        te.set_static_launch(False)
    report.metadata["static_launch"] = te.static_launch_enabled()
    specs = row_specs(modes, args.precisions, torchao=has_torchao, opaque=args.opaque)
    sizes = [SMOKE_SIZES[args.arch]] if args.smoke else [SIZES[name] for name in args.size]
    report.metadata.update(
        arch=args.arch,
        sizes=[s.name for s in sizes],
        modes=modes,
        precisions=list(args.precisions),
    )
    for size in sizes:
        report.add(
            run_size(
                size,
                specs,
                device=device,
                timing=timing,
                warm_cache=args.warm_cache,
                skipped=skipped,
                calibrate_eagerly=args.calibrate_eagerly,
            )
        )
    report.finish(harness.resolve_out_dir(args, report.metadata), chart=not args.no_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
