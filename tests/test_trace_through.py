"""Inductor traces into our ops: a compiled model of our modules runs no ``te`` op.

Every op except those ``te_compile._library.opaque_ops()`` lists (each with its reason) is
traced through by AOTAutograd: Inductor receives the op's implementation — the reference math
on CPU, the Triton kernels and cuBLAS calls on CUDA — and generates code that launches them
itself. Dynamo's graph keeps the ops by name (``test_dynamo_graph_names_the_ops``), as does
``torch.export``.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import te_compile as te
from te_compile._library import opaque_ops, registry
from tests.utils import (
    DEVICES,
    assert_close,
    assert_matches_eager,
    chain_roundings,
    requires_cuda,
    start_cuda_graph_case,
)

HIDDEN, FFN, TOKENS = 64, 128, 32

RECIPES = {
    "bf16": None,
    "current": te.recipe.Float8CurrentScaling,
    "delayed": te.recipe.DelayedScaling,
    "block": te.recipe.Float8BlockScaling,
    "mxfp8": te.recipe.MXFP8BlockScaling,
    # Stochastic rounding off: Inductor's generator draws other streams than eager's, and the
    # compiled block is compared with the eager one.
    "nvfp4": lambda: te.recipe.NVFP4BlockScaling(disable_stochastic_rounding=True),
}

# The ops whose implementation runs C++: their names, so that a new opaque op is a decision
# this file records. (The grouped GEMM ops are traced through on CUDA's device-offset paths and
# kept whole elsewhere: test_compiled_grouped_modules_trace_through_on_device_offsets.)
EXPECTED_OPAQUE = {"te::bulk_allocate"}


class Block(nn.Module):
    """Every dense module of the library, and a fused te.ops run, in one residual block."""

    def __init__(self, device: str) -> None:
        super().__init__()
        kw = {"device": device}
        self.norm = te.RMSNorm(HIDDEN, **kw)
        self.qkv = te.LayerNormLinear(HIDDEN, 3 * HIDDEN, bias=False, **kw)
        self.proj = te.Linear(3 * HIDDEN, HIDDEN, **kw)
        self.mlp = te.LayerNormMLP(
            HIDDEN, FFN, bias=False, normalization="RMSNorm", activation="swiglu", **kw
        )
        self.fused = te.ops.Sequential(  # te.ops: norm, then linear + bias + GELU as one op
            te.ops.LayerNorm(HIDDEN, **kw),
            te.ops.BasicLinear(HIDDEN, HIDDEN, **kw),
            te.ops.Bias(HIDDEN, **kw),
            te.ops.GELU(),
        )
        self.out_norm = te.LayerNorm(HIDDEN, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.qkv(self.norm(x)))
        x = x + self.fused(x)
        return self.out_norm(x + self.mlp(x))


def _te_calls(code: str) -> set[str]:
    return set(re.findall(r"torch\.ops\.te\.\w+", code))


def _step(model, x, recipe):
    def run():
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.float().square().sum().backward()
        return y

    return run


def test_opaque_ops_are_the_expected_ones():
    assert set(opaque_ops()) == EXPECTED_OPAQUE, opaque_ops()
    assert all(reason for reason in opaque_ops().values())


# The emulated block-scaled blocks are the largest graphs Inductor's CPU generator compiles here
# (up to two minutes on CI's 2 cores): long_compile. On the CPU by default, current scaling and
# bf16 keep this check, and tests/modules/test_fp8_linear_module.py compiles the emulated
# Float8BlockScaling and MXFP8 LayerNormMLP with Inductor.
_LONG = {"block", "mxfp8", "nvfp4"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "recipe",
    [pytest.param(r, marks=pytest.mark.long_compile) if r in _LONG else r for r in RECIPES],
)
def test_compiled_block_calls_no_te_op(device, recipe):
    factory = RECIPES[recipe]
    if factory is not None and device == "cuda":
        available = {
            "mxfp8": te.is_mxfp8_available,
            "nvfp4": te.is_nvfp4_available,
            "block": te.is_fp8_block_scaling_available,
        }.get(recipe, te.is_fp8_available)
        if not available():
            pytest.skip(f"{recipe} is emulated on this GPU; the CPU case covers the emulation")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(device)
    twin = Block(device)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(TOKENS, HIDDEN, device=device, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    rec = factory() if factory is not None else None
    twin_rec = factory() if factory is not None else None
    compiled = torch.compile(model, fullgraph=True)
    if recipe == "delayed":  # the first step calibrates (current scaling): check a delayed one
        _step(compiled, x, rec)()
        _step(twin, x_twin, twin_rec)()
        x.grad = x_twin.grad = None
    out, codes = run_and_get_code(_step(compiled, x, rec))
    assert len(codes) == 2, "one forward and one backward graph"
    calls = set().union(*map(_te_calls, codes))
    assert not calls, "Inductor's code enters te ops through the dispatcher"
    if device == "cuda" and recipe in ("current", "delayed"):
        # The casts take their FP8 outputs as they are (kernels.fp8.fp8_out): a view per launch
        # would be a dispatcher call of the host in the generated code.
        views = sum(code.count("aten.view.dtype(") for code in codes)
        assert views == 0, f"{views} dtype views issued by Inductor's code"
    expected = _step(twin, x_twin, twin_rec)()
    assert_matches_eager(out, expected, roundings=4)
    assert_matches_eager(x.grad, x_twin.grad, roundings=16)
    # The delayed-scaling state after a compiled step is eager's (a backward that reused a saved
    # view of the scale buffer once wrote an inverse scale into it). Up to the gradients'
    # difference: the gradient amaxes are measured on them (2% apart here on the CPU).
    state = {n: b for n, b in model.named_buffers() if n.endswith(("scale", "amax_history"))}
    for name, b in twin.named_buffers():
        if name in state:
            torch.testing.assert_close(state[name], b, rtol=0.1, atol=0, msg=name)


def test_dynamo_graph_names_the_ops():
    """Dynamo's graph (what graph-break tests and selective checkpointing see) keeps te ops."""
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    model = Block("cpu")
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, HIDDEN))
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {"te.rmsnorm_fwd.default", "te.linear_fwd.default"} <= targets, targets


def test_every_traced_op_has_no_opaque_reason():
    for name, entry in registry().items():
        assert (entry.opaque is None) == (name not in EXPECTED_OPAQUE), name


@requires_cuda
@pytest.mark.parametrize("recipe", ["bf16", "current", "delayed", "block"])
def test_block_trains_under_cuda_graphs(recipe):
    """``mode="reduce-overhead"``: the block's training steps are captured in CUDA graphs (no
    skip: no host sync, no CPU tensor, no allocation outside the graphs' pool) and match eager."""
    factory = RECIPES[recipe]
    if factory is not None and recipe == "block" and not te.is_fp8_block_scaling_available():
        pytest.skip("Float8BlockScaling is emulated on this GPU")
    start_cuda_graph_case(factory)
    eager, graphed = Block("cuda"), Block("cuda")
    graphed.load_state_dict(eager.state_dict())
    call = torch.compile(graphed, mode="reduce-overhead", fullgraph=True)
    rec_eager = factory() if factory is not None else None
    rec_graphed = factory() if factory is not None else None
    for step in range(4):
        # Gradients are set to None before each step, as an optimizer's zero_grad does: a
        # gradient accumulated into across replays would be a CUDA-graph output that the next
        # replay overwrites (PyTorch's CUDA graph trees refuse that access).
        for p in (*eager.parameters(), *graphed.parameters()):
            p.grad = None
        x = torch.randn(TOKENS, HIDDEN, device="cuda")
        torch.compiler.cudagraph_mark_step_begin()
        out = _step(call, x.clone().requires_grad_(), rec_graphed)().detach().clone()
        expected = _step(eager, x.clone().requires_grad_(), rec_eager)()
        assert_matches_eager(out, expected, roundings=4 if step == 0 else 8)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@requires_cuda
@pytest.mark.parametrize("recipe", ["bf16", "current", "delayed"])
def test_grouped_mlp_trains_under_cuda_graphs(recipe):
    """``mode="reduce-overhead"`` on a GroupedMLP traced through (the splits a device tensor,
    changing every step): its steps are captured in CUDA graphs, no skip, and match eager."""
    factory = RECIPES[recipe]
    start_cuda_graph_case(factory)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    eager, graphed = te.GroupedMLP(3, HIDDEN, FFN, **kw), te.GroupedMLP(3, HIDDEN, FFN, **kw)
    graphed.load_state_dict(eager.state_dict())
    call = torch.compile(graphed, mode="reduce-overhead", fullgraph=True)
    rec_eager = factory() if factory is not None else None
    rec_graphed = factory() if factory is not None else None
    for splits in ([40, 0, 24], [8, 32, 24], [64, 0, 0], [16, 16, 32]):
        for p in (*eager.parameters(), *graphed.parameters()):
            p.grad = None
        m_splits = torch.tensor(splits, device="cuda")
        x = torch.randn(TOKENS * 2, HIDDEN, device="cuda", dtype=torch.bfloat16)
        torch.compiler.cudagraph_mark_step_begin()
        graphed_call = functools.partial(call, m_splits=m_splits)
        out = _step(graphed_call, x.clone().requires_grad_(), rec_graphed)().detach().clone()
        expected = _step(functools.partial(eager, m_splits=m_splits), x.clone().requires_grad_(),
                         rec_eager)()  # fmt: skip
        assert_matches_eager(out, expected, roundings=chain_roundings(out.dtype, 4))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


GROUPED_CASES = ["bf16", "bf16_mlp", "fp8_per_group", "fp8_single", "fp8_mlp", "delayed_mlp"]
_CPU_GROUPED_CASES = ("bf16_mlp", "fp8_mlp")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_compiled_grouped_modules_trace_through_on_device_offsets(device, case):
    """GroupedLinear / GroupedMLP in bf16, with FP8 primary weights under current scaling
    (``quantized_model_init``, per-expert or one weight), and a GroupedMLP under delayed
    scaling (its states calibrated: the delayed step's graph), the splits a device tensor. On
    CUDA the grouped GEMMs take device offsets (``torch._grouped_mm``, and
    ``torch._scaled_grouped_mm`` for the per-tensor FP8 recipes), which Inductor traces into:
    its code of the training step calls no te op. On the CPU (per-group loops) the grouped GEMM
    op is kept whole, once in the forward and once in the backward, and everything around it
    (the FP8 weights' operands, the activation, the scales) is traced through. The step's
    output, input gradient and weight gradients (``main_grad`` for FP8 weights) match eager."""
    fp8 = case.startswith(("fp8", "delayed"))
    if device == "cpu" and case not in _CPU_GROUPED_CASES:
        pytest.skip("the CPU runs bf16_mlp and fp8_mlp only (Inductor's C++ compile time)")
    if fp8 and device == "cuda" and not te.is_fp8_available():
        pytest.skip("no FP8 on this GPU; the CPU case covers the emulation")
    delayed = case.startswith("delayed")
    recipe = (te.recipe.DelayedScaling if delayed else te.recipe.Float8CurrentScaling)()
    recipe = recipe if fp8 else None
    experts, splits = 3, torch.tensor([40, 0, 24], device=device)

    def build():
        torch.manual_seed(0)
        kw = {"params_dtype": torch.bfloat16, "device": device}
        with te.quantized_model_init(enabled=fp8 and not delayed, recipe=recipe):
            if case.endswith("mlp"):
                m = te.GroupedMLP(experts, HIDDEN, FFN, single_grouped_parameter=False, **kw)
            else:
                single = case == "fp8_single"
                m = te.GroupedLinear(experts, HIDDEN, HIDDEN, single_grouped_weight=single, **kw)
        for state in m.modules():  # the delayed step's graph, not the calibration step's
            if hasattr(state, "calibrated"):
                state.calibrated = delayed
        return m, te.FP8MasterWeights(m) if fp8 and not delayed else None

    (model, _masters), (twin, _twin_masters) = build(), build()

    torch._dynamo.reset()
    x = torch.randn(64, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_()
    compiled = torch.compile(model, fullgraph=True)
    out, codes = run_and_get_code(_step(lambda inp: compiled(inp, splits), x, recipe))
    assert len(codes) == 2, "one forward and one backward graph"
    fwd, bwd = (_te_calls(code) for code in codes)
    if device == "cuda":
        assert fwd | bwd == set(), "Inductor's code enters te ops through the dispatcher"
    else:
        assert fwd == {"torch.ops.te.grouped_linear_fwd"}, fwd
        assert bwd == {"torch.ops.te.grouped_linear_bwd"}, bwd
    expected = _step(lambda inp: twin(inp, splits), x_twin, recipe)()
    # The gradients are sums over tokens: their tolerance scales with the largest magnitude.
    assert_matches_eager(out, expected, roundings=chain_roundings(out.dtype, 4))
    assert_close(x.grad, x_twin.grad, x.dtype, roundings=2, reduced=True)
    for name, p in model.named_parameters():
        grad, grad_twin = (getattr(q, "main_grad", q.grad) for q in (p, twin.get_parameter(name)))
        assert grad is not None, name
        assert_close(grad, grad_twin, grad.dtype, roundings=2, reduced=True)


def test_kernel_write_analysis_runs_once_per_signature(monkeypatch):
    """torch's analysis of the tensors a Triton kernel writes (TTIR built and walked per
    ``wrap_triton`` launch and compile stage) runs once per kernel and argument signature for
    ours (``kernels.memoize_write_analysis``): the same answers as torch's own function, a
    constexpr's value and a Triton integer specialisation (a multiple of 16) telling signatures
    apart, other integers not."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the analysis builds TTIR for a GPU target, not the interpreter's")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    from te_compile import kernels
    from te_compile.kernels import quantize, quantize_rows

    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    name = next(
        (n for n in ("identify_accessed_tensors", "identify_mutated_tensors") if hasattr(wrap, n)),
        None,
    )
    if name is None:
        pytest.skip("this torch has neither analysis function")

    class Sm90:  # TTIR needs a target; this machine may have no GPU
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(driver, "_active", Sm90())  # restored after the test
    kernels.memoize_write_analysis()
    memoized = getattr(wrap, name)
    assert memoized.te_memoized
    built = []
    generate = wrap.generate_ttir
    monkeypatch.setattr(wrap, "generate_ttir", lambda *a, **k: built.append(1) or generate(*a, **k))

    def writes(result) -> set[str]:
        deps = result.read_writes.writes if hasattr(result, "read_writes") else result
        return {getattr(d, "name", d) for d in deps}

    a, b = torch.zeros(1), torch.zeros(1)
    zero = quantize._zero_kernel
    for two, expected in ((True, {"A", "B"}), (False, {"A"})):
        kwargs = {"A": a, "B": b, "TWO": two}
        before = len(built)
        assert writes(memoized(zero, kwargs, {})) == expected
        assert writes(memoized(zero, dict(kwargs), {})) == expected  # the memo's answer
        assert writes(memoized.__wrapped__(zero, kwargs, {})) == expected  # torch's own
        assert len(built) == before + 2, "one analysis by the memo, one by torch's function"
    # As torch passes a launch with options: the kernel inside an Autotuner of one config.
    import triton

    tuned = triton.autotune(configs=[triton.Config({}, num_warps=4)], key=[])(zero)
    before = len(built)
    for _ in range(2):
        assert writes(memoized(tuned, {"A": a, "B": b, "TWO": True}, {})) == {"A", "B"}
    assert len(built) == before + 1
    src, dst, table = (torch.zeros(512, dtype=torch.uint8) for _ in range(3))
    recode = quantize_rows._recode_kernel
    before = len(built)
    for n in (300, 301, 320):  # 320: a multiple of 16, specialised by Triton
        kwargs = {"SRC": src, "DST": dst, "TABLE": table, "N": n, "BLOCK_SIZE": 128}
        assert writes(memoized(recode, kwargs, {})) == {"DST"}
    assert len(built) == before + 2
