"""The one place for tolerances, float64 references, devices and graph-break counting.

Every test takes its tolerances from :func:`dtype_tols` and builds its reference with
:func:`to_reference` / :func:`make_reference_and_test_tensors`; a tolerance literal elsewhere
carries a ``# tol:`` comment saying why (tests/test_suite_layout.py checks it).
"""

from __future__ import annotations

import inspect
import math
import operator
import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._functorch.aot_autograd import aot_module_simplified

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU; none on this machine")

# The CPU case carries ``cpu_case``: CI runs it; the GPU suite (bench/gpu_suite.sh) deselects it
# and runs the CUDA cases CI cannot.
DEVICES = [
    pytest.param("cpu", id="cpu", marks=pytest.mark.cpu_case),
    pytest.param("cuda", id="cuda", marks=requires_cuda),
]


# The loosest tolerance a check may have (both rtol and atol; the suite's data is of order
# one). A result allowed to be off by more than 2^-5 (about 3%) is not checked: a wrong constant
# factor of a few percent (a scale of 1.05, a dropped term of that size) passes it, and with
# ``reduced`` (atol = rtol times the largest magnitude) the largest elements get twice rtol.
MAX_TOL = 2**-5

# rtol/atol of each format for a result rounded once: from the unit roundoff u (Transformer
# Engine's test tolerances; bfloat16's 1.6e-2 taken to the power of two below it, 4u).
_BASE_TOLS = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-6, "atol": 1e-5},
}


def keep_torch_default_device() -> None:
    """Modules built with ``device=None`` in this process go to torch's default device (the
    CPU), as the tests that pass no device mean, not to CUDA (Transformer Engine's default,
    ``te_compile._checks.default_device``): for processes the tests spawn, which
    ``tests/conftest.py``'s fixture doing the same does not reach."""
    from te_compile import _checks

    _checks.cuda_is_default = lambda: False


def max_roundings(dtype: torch.dtype) -> int:
    """The most roundings :func:`dtype_tols` accepts for ``dtype`` (both tolerances within
    :data:`MAX_TOL`): bfloat16 2, float16 31, float32 3124, float64 ~3e10."""
    if dtype not in _BASE_TOLS:
        raise ValueError(f"dtype_tols: no tolerance for {dtype}")
    return math.floor(MAX_TOL / max(_BASE_TOLS[dtype].values()))


def dtype_tols(dtype: torch.dtype, roundings: int = 1) -> dict[str, float]:
    """rtol/atol for comparing a result computed in ``dtype`` against a float64 reference.

    From the unit roundoff of each format (Transformer Engine's test tolerances), for a result
    rounded once. ``roundings``: a result that passed through a chain of that many ops, each
    rounding its output to ``dtype`` (a module's backward through several ops), can be off by
    that many roundoffs, so both tolerances scale with it.

    The product is capped: more than :func:`max_roundings` (both tolerances above
    :data:`MAX_TOL`, 2^-5) is refused with a ValueError, not clamped. A check that needs that
    many roundings in ``dtype`` bounds nothing there; it runs in a wider format, where the same
    roundings are a real bound (the fuzz tests of chains, attention and the transformer layer
    run in float32: :func:`capped_dtype`)."""
    if roundings < 1:
        raise ValueError(f"dtype_tols: roundings must be >= 1, got {roundings}")
    if roundings > max_roundings(dtype):
        raise ValueError(
            f"dtype_tols: {roundings} roundings of {dtype} exceed the cap of "
            f"{max_roundings(dtype)} (a tolerance above {MAX_TOL}); check in a wider dtype"
        )
    return {k: v * roundings for k, v in _BASE_TOLS[dtype].items()}


def chain_roundings(dtype: torch.dtype, ops: int) -> int:
    """The ``roundings`` for a result through ``ops`` ops in a row, each rounding its output to
    ``dtype``: ``ops``, except in bfloat16, half that rounded up. bfloat16's tolerance per
    rounding is four unit roundoffs, and each op adds at most one to first order: two ops per
    rounding keep half of that as margin (for the rounded reference, and a later op amplifying an
    earlier op's error). A chain of more than four bfloat16 ops exceeds the cap."""
    return -(-ops // 2) if dtype == torch.bfloat16 else ops


def capped_dtype(dtype: torch.dtype, roundings: int) -> torch.dtype:
    """``dtype``, or float32 where ``roundings`` exceed its :func:`max_roundings`: the dtype a
    fuzz test of a chain that many roundings long runs in, so its bound means something."""
    return dtype if roundings <= max_roundings(dtype) else torch.float32


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    roundings: int = 1,
    reduced: bool = False,
    **kw: Any,
) -> None:
    """Compare ``actual`` (computed in ``dtype``) to a float64 reference, in float64 on the CPU.

    The reference is first rounded to ``dtype``: a result cannot be closer than its own format.
    ``roundings``: see :func:`dtype_tols`. ``reduced``: each element is a sum of products of
    *rounded* operands (a weight gradient downstream of rounded activation gradients); a one-ulp
    difference in an operand is relative to the terms, not to their sum, which can cancel to
    near zero, so the absolute tolerance becomes ``rtol`` times the largest expected magnitude."""
    expected = expected.detach().to(dtype).to(device="cpu", dtype=torch.float64)
    tols = dtype_tols(dtype, roundings)
    if reduced and expected.numel():
        tols["atol"] = max(tols["atol"], tols["rtol"] * expected.abs().max().item())
    torch.testing.assert_close(
        actual.detach().to(device="cpu", dtype=torch.float64), expected, **tols, **kw
    )


# Normwise relative error of a result computed under each quantised recipe against the float64
# result of the unquantised operands, ||actual - expected|| / ||expected||, for a result of one
# quantised GEMM: (forward, backward). A quantised element is off by up to half its format's
# spacing (E4M3 2^-4 relative, E5M2 2^-3, E2M1 up to 1/6 inside its block scale); a GEMM's sums
# average the elements' errors: E4M3 times E4M3 about 0.04, a HYBRID backward's E5M2 gradient
# about 0.1, NVFP4 0.15 - 0.2, more where the backward chains a gradient through an activation
# and a norm. Each value is the largest error per GEMM that the fuzz tests' 200-case profile
# and the module tests measure on results of 1,024 elements or more, plus a quarter.
QUANTIZED_REL_ERROR = {
    "current": (0.065, 0.21),  # HYBRID: E4M3 forward, E5M2 gradients
    "delayed": (0.07, 0.18),
    "block": (0.07, 0.17),  # E4M3 both ways
    "mxfp8": (0.08, 0.24),  # E4M3, power-of-two block scales
    "nvfp4": (0.23, 0.38),  # E2M1 elements, E4M3 block scales
}
# Round-to-nearest errors are nearly uncorrelated with the values, so the least-squares gain of
# the actual result over the expected one, <actual, expected> / <expected, expected>, is 1 up to
# a small bias (coarse formats round small values to zero: NVFP4's results are up to 8% short,
# its gradients 12%) and the noise of an inner product over ``n`` elements. A result off by a
# factor (a wrong scale, a zeroed or negated branch) moves the gain by that factor whatever the
# noise. The bias per recipe, (forward, backward): the largest measured, plus a quarter.
QUANTIZED_GAIN = {
    "current": (0.04, 0.08),
    "delayed": (0.04, 0.06),
    "block": (0.02, 0.04),
    "mxfp8": (0.06, 0.08),
    "nvfp4": (0.10, 0.15),
}
# A result of few elements (a norm's or a bias's gradient over a small hidden size) carries the
# errors of few quantised values: both bounds widen by these constants over sqrt(n), (error,
# forward gain, backward gain), fitted to the same measurements.
QUANTIZED_SMALL = (1.0, 0.6, 3.0)
# Quantisation errors of the GEMMs in a chain are independent: they add in quadrature, so the
# bound of a result that passed through ``gemms`` quantised GEMMs grows with sqrt(gemms), capped
# here, below the error of an all-zero result (1.0) or of a sign flip (2.0).
QUANTIZED_REL_ERROR_CAP = 0.75


def quantized_bound(recipe: str, gemms: int = 1, grad: bool = False, n: int | None = None) -> float:
    """The normwise relative error bound of a result of ``gemms`` quantised GEMMs in a row under
    ``recipe`` (a key of :data:`QUANTIZED_REL_ERROR`); ``grad``: a gradient (the backward's
    formats); ``n``: the result's elements (None: many)."""
    if gemms < 1:
        raise ValueError(f"quantized_bound: gemms must be >= 1, got {gemms}")
    small = QUANTIZED_SMALL[0] / math.sqrt(n) if n else 0.0
    bound = QUANTIZED_REL_ERROR[recipe][grad] * math.sqrt(gemms) + small
    return min(bound, QUANTIZED_REL_ERROR_CAP)


def quantized_gain_bound(recipe: str, grad: bool = False, n: int | None = None) -> float:
    """How far from 1 the gain of a result under ``recipe`` may be (:data:`QUANTIZED_GAIN`),
    for a result of ``n`` elements (None: many)."""
    small = QUANTIZED_SMALL[1 + grad] / math.sqrt(n) if n else 0.0
    return QUANTIZED_GAIN[recipe][grad] + small


def assert_close_quantized(
    actual: torch.Tensor,
    expected: torch.Tensor,
    recipe: str,
    gemms: int = 1,
    grad: bool = False,
    subtract: torch.Tensor | None = None,
    bound: float | None = None,
    gain: bool = True,
    norm: float = 0.0,
) -> None:
    """``actual`` (computed under the quantised ``recipe``: a key of
    :data:`QUANTIZED_REL_ERROR`) against the float64 reference of the unquantised operands:
    same shape, finite, normwise relative error within :func:`quantized_bound` for a result
    that passed through ``gemms`` quantised GEMMs (an MLP's FC1 then FC2), and a gain within
    :func:`quantized_gain_bound` of 1. ``grad``: a gradient. ``subtract``: a part of both results
    that the quantised GEMMs did not produce (a residual input, or the incoming gradient that a
    residual passes back), taken off both before the comparison so that it cannot hide an
    error of the branches. ``bound``: the normwise and gain bound of a result whose error is
    known otherwise (every element within its format's largest rounding error). ``gain=False``:
    a gradient through a softmax of quantised scores (attention), whose noise biases the
    softmax's gradient (gains of 0.89 seen under per-tensor FP8); the normwise bound stays.
    ``norm``: the errors are relative to at least this norm (a group's share of the whole
    tensor's, whose per-tensor scale quantises a small group more coarsely than its own
    would)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    actual = actual.detach().to(device="cpu", dtype=torch.float64)
    expected = expected.detach().to(device="cpu", dtype=torch.float64)
    assert actual.isfinite().all()
    if subtract is not None:
        subtract = subtract.detach().to(device="cpu", dtype=torch.float64)
        actual, expected = actual - subtract, expected - subtract
    scale = expected.norm().item()
    if scale == 0 and norm == 0:
        assert actual.norm() == 0
        return
    against = max(scale, norm)
    error = (actual - expected).norm().item() / against
    # The gain's distance from 1, measured against the same norm.
    ratio = 1 + ((actual - expected) * expected).sum().item() / (max(scale, 1e-300) * against)
    if bound is None:
        bound = quantized_bound(recipe, gemms, grad, expected.numel())
        gain_bound = quantized_gain_bound(recipe, grad, expected.numel())
    else:
        gain_bound = bound
    what = "gradient" if grad else "result"
    assert error <= bound, (
        f"{recipe}: normwise relative error of the {what} {error:.4f} > {bound:.4f} "
        f"({gemms} quantised GEMMs)"
    )
    assert not gain or abs(ratio - 1) <= gain_bound, (
        f"{recipe}: the {what} is {ratio:.4f} times the expected one (|gain - 1| > "
        f"{gain_bound:.4f}): a wrong scale, sign or branch, not quantisation noise"
    )


def assert_close_quantized_groups(
    actual: torch.Tensor,
    expected: torch.Tensor,
    recipe: str,
    splits: Sequence[int],
    gemms: int = 1,
    grad: bool = False,
) -> None:
    """:func:`assert_close_quantized` for each group of a grouped GEMM's rows (``splits``: the
    rows per group along dim 0; empty groups must be empty): one wrong group among many is not
    averaged away. A group's errors are relative to at least its share of the
    whole result's norm (``sqrt(rows / all rows)`` of it): the per-tensor recipes scale the whole
    tensor at once, so a group of small values is quantised more coarsely than its own scale
    would, and an error of that size is not the group's own."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    total, rows = expected.detach().double().norm().item(), max(expected.shape[0], 1)
    pairs = zip(actual.split(list(splits)), expected.split(list(splits)), strict=True)
    for i, (a, e) in enumerate(pairs):
        try:
            share = total * math.sqrt(a.shape[0] / rows)
            assert_close_quantized(a, e, recipe, gemms, grad, norm=share)
        except AssertionError as err:
            raise AssertionError(f"group {i}: {err}") from None


def assert_close_sum(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    magnitude: torch.Tensor,
    roundings: int = 1,
) -> None:
    """:func:`assert_close` for a result whose elements are sums of many rounded terms (a
    gradient summed over tokens): its error is bounded by the roundoff times the sum of the
    terms' magnitudes (``magnitude``: that sum, e.g. the reference evaluated on absolute values),
    not by the magnitude of the sum, which can cancel to near zero. The absolute tolerance is
    ``rtol`` times the largest such magnitude."""
    expected = expected.detach().to(dtype).to(device="cpu", dtype=torch.float64)
    tols = dtype_tols(dtype, roundings)
    if magnitude.numel():
        tols["atol"] = max(tols["atol"], tols["rtol"] * magnitude.abs().max().item())
    torch.testing.assert_close(
        actual.detach().to(device="cpu", dtype=torch.float64), expected, **tols
    )


def assert_matches_eager(compiled: torch.Tensor, eager: torch.Tensor, roundings: int = 2) -> None:
    """A compiled result against the eager one, within ``roundings`` roundoffs of the dtype.
    Not bit for bit: Inductor traces into our ops and generates its own code for the aten math
    around the kernels (on CPU all of it: the reference math), so its vectorised ``exp`` and
    ``tanh``, fused multiply-adds, reduction orders and GEMM epilogues (a bias added after the
    GEMM instead of in cuBLAS's epilogue) may differ from eager by an ulp, as they do for any
    compiled PyTorch code."""
    torch.testing.assert_close(compiled, eager, **dtype_tols(eager.dtype, roundings))


def start_cuda_graph_case(recipe: Any) -> None:
    """The start of a ``mode="reduce-overhead"`` test under ``recipe`` (a recipe factory, None
    for bf16): skipped without FP8 on this GPU; Dynamo reset, its counters (``cudagraph_skips``
    among them) cleared, the seed set."""
    from te_compile import is_fp8_available

    if recipe is not None and not is_fp8_available():
        pytest.skip("no FP8 on this GPU")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)


def to_reference(value: Any) -> Any:
    """float64 CPU copy of a tensor (keeping requires_grad), or of each tensor in a tuple/list."""
    if isinstance(value, torch.Tensor):
        ref = value.detach().to(
            device="cpu", dtype=torch.float64 if value.is_floating_point() else None
        )
        return ref.requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(to_reference(v) for v in value)
    return value


def make_reference_and_test_tensors(
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    requires_grad: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same random values twice: a float64 CPU reference and a ``dtype`` test tensor on ``device``.

    The test tensor is drawn first and the reference is made from it, so both hold exactly the
    same (``dtype``-representable) numbers."""
    test = torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
    ref = test.detach().to(device="cpu", dtype=torch.float64)
    return ref.requires_grad_(requires_grad), test.requires_grad_(requires_grad)


def count_graph_breaks(fn: Callable, *args: Any, **kwargs: Any) -> tuple[int, int]:
    """``(graph_count, graph_break_count)`` of ``fn(*args)`` under dynamo."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    return explanation.graph_count, explanation.graph_break_count


def assert_single_graph(fn: Callable, *args: Any, **kwargs: Any) -> None:
    """``fn(*args)`` traces as one graph with zero breaks; on failure the message lists
    dynamo's break reasons (torch versions differ in what they trace)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = [r.reason for r in explanation.break_reasons]
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), reasons


def load_script(name: str, path: Any) -> Any:
    """The Python file ``path`` (an example script) imported as module ``name``, registered in
    ``sys.modules`` (dataclasses look their module up there)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class FrameCounter(torch._dynamo.testing.CompileCounterWithBackend):
    """Counts frames compiled (``frame_count``), not calls of the backend: a compile that
    dynamo restarts calls the backend again for the same frame. With ``dynamic=True`` every
    float attribute a model reads (a norm's ``eps``) is traced as a symbol and then
    specialised, and dynamo restarts the analysis (plain ``nn.LayerNorm`` does too); on a cold
    Inductor cache that doubled the backend calls of one compile."""

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self._compiles: set[str] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        compiled = super().__call__(gm, example_inputs)
        self._compiles.add(str(torch._guards.CompileContext.current_compile_id()))
        self.frame_count = len(self._compiles)
        return compiled


def behaviour_backend(device: str | torch.device = "cpu") -> str:
    """The backend of a test whose subject is a module's behaviour under compile (one graph, no
    recompile, eager's values), not Inductor's code: Inductor on CUDA, AOTAutograd's graphs on
    the CPU (the same trace, fakes and saved tensors; Inductor's CPU code is the subject of
    tests/test_trace_through.py and of each op family's compile tests, docs/testing.md)."""
    return "inductor" if torch.device(device).type == "cuda" else "aot_eager"


def compile_counted(fn: Callable, backend: str = "inductor", **compile_kwargs: Any):
    """``torch.compile(fn, fullgraph=True, ...)`` and a :class:`FrameCounter`."""
    counter = FrameCounter(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, **compile_kwargs), counter


class GraphRecorder:
    """A torch.compile backend that records the op sequence of the forward and backward graphs
    AOTAutograd produces, then runs them unchanged (eager).

    By default AOTAutograd keeps our ops by name here (``decompose_custom_triton_ops`` off, as
    ``torch.export`` does): the snapshots are of te ops. With ``trace_through=True`` the graphs
    are the ones Inductor receives, every traced-through te op replaced by its implementation."""

    def __init__(self, trace_through: bool = False) -> None:
        self.forward: list[str] = []
        self.backward: list[str] = []
        self.trace_through = trace_through

    @staticmethod
    def _ops(gm: torch.fx.GraphModule) -> list[str]:
        names = []
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            name = str(node.target)
            if isinstance(node.target, torch._ops.HigherOrderOperator) and node.args:
                name += f"({node.args[0]})"  # e.g. auto_functionalized_v2(te.linear_bwd.default)
            names.append(name)
        return names

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        def fw(g: torch.fx.GraphModule, _inputs: Any):
            self.forward = self._ops(g)
            return g

        def bw(g: torch.fx.GraphModule, _inputs: Any):
            self.backward = self._ops(g)
            return g

        with torch._functorch.config.patch(decompose_custom_triton_ops=self.trace_through):
            return aot_module_simplified(gm, example_inputs, fw_compiler=fw, bw_compiler=bw)

    def summary(self, te_only: bool = False) -> str:
        """One op per line (snapshots stay within the line length and diff line by line).
        ``te_only``: just our ops (``te.*``, also when functionalised), for snapshots whose aten
        decompositions differ between torch versions."""

        def keep(ops):
            return [op for op in ops if not te_only or op.startswith("te.") or "(te." in op]

        lines = ["forward:", *(f"  {op}" for op in keep(self.forward))]
        return "\n".join([*lines, "backward:", *(f"  {op}" for op in keep(self.backward))])


# Triton kernels run on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
# which `make test` sets for a second pass over the tests marked `triton`).
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
requires_triton = pytest.mark.skipif(
    not (HAS_CUDA or TRITON_INTERPRET),
    reason="Triton kernels need a CUDA GPU or TRITON_INTERPRET=1 (make test runs them that way)",
)
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"


def paired_grads(out, ref, params):
    """``(param, d out / d param, d ref / d param)`` for each of ``params``, both backwards fed
    the same random incoming gradient: two implementations' gradients side by side."""
    grad = torch.randn_like(out)
    return zip(
        params,
        torch.autograd.grad(out, params, grad),
        torch.autograd.grad(ref, params, grad),
        strict=True,
    )


def assert_bits_equal(actual, expected):
    """Same dtype, shape and bits (signed zeros count); NaN where ``expected`` is NaN, whatever
    its payload (torch on CPU and the GPU's conversions may encode NaN differently)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    actual, expected = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    nan = expected.float().isnan()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[actual.element_size()]
    differ = (actual.float().isnan() != nan) | (~nan & (actual.view(bits) != expected.view(bits)))
    if differ.any():
        mask = (1 << (8 * actual.element_size())) - 1

        def show(t, i):
            return f"{t[i].item()!r} (0x{int(t.view(bits)[i]) & mask:x})"

        where = [tuple(i) for i in differ.nonzero()[:8].tolist()]
        pairs = [f"{i}: {show(actual, i)} vs {show(expected, i)}" for i in where]
        raise AssertionError(
            f"{int(differ.sum())} of {differ.numel()} elements differ; first: " + "; ".join(pairs)
        )


def assert_fast_path_gives_op_bytes(
    make: Callable, weights: Callable, recipe: Callable, device: str, fuse_wgrad: bool,
    node: str, op: str,
) -> None:  # fmt: skip
    """Three FP8 training steps of the module ``make()`` builds (seeded; its 1-D parameters
    moved off their zero or one init, so that biases and norm scalars reach the kernels) under
    ``te.autocast(recipe=recipe())`` (None: high precision) give the same bytes on the eager
    fast path and on the op
    path: the outputs, the input gradients, ``weights(module)``'s ``main_grad`` (``fuse_wgrad``;
    zeros first) or ``.grad``, the 1-D parameters' gradients and the ``state_dict``'s tensors
    (the delayed-scaling state); the fast path's outputs come from the autograd node ``node``,
    the op path's from the op ``op``'s."""
    import te_compile as te
    from te_compile import _library

    def run(fast: bool) -> tuple[list, set]:
        _library.set_eager_fast_path(fast)
        try:
            torch.manual_seed(0)
            m = make()
            with torch.no_grad():
                for p in m.parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn(p.shape, device=device) * 0.1)
            for w in weights(m) if fuse_wgrad else ():
                w.main_grad = torch.zeros(w.shape, device=device)
            outs, nodes = [], set()
            for step in range(3):
                x = (torch.randn(4, 8, 64) * (1 + step)).to(device, torch.bfloat16)
                x.requires_grad_(True)
                with te.autocast(enabled=recipe is not None, recipe=recipe and recipe()):
                    y = m(x)
                nodes.add(type(y.grad_fn).__name__)
                w = torch.linspace(-1, 1, y.numel(), device=device).reshape(y.shape)
                (y.float() * w).sum().backward()
                outs += [y.detach(), x.grad]
            outs += [w.main_grad if fuse_wgrad else w.grad for w in weights(m)]
            outs += [p.grad for p in m.parameters() if p.dim() == 1]  # the biases, the norm's
            outs += [v for _, v in sorted(m.state_dict().items()) if isinstance(v, torch.Tensor)]
            return outs, nodes
        finally:
            _library.set_eager_fast_path(True)

    (fast, fast_nodes), (on_op, op_nodes) = run(True), run(False)
    assert fast_nodes == {node}
    assert len(op_nodes) == 1 and op in op_nodes.pop()  # the op's autograd node
    assert len(fast) == len(on_op)
    for a, b in zip(fast, on_op, strict=True):
        assert torch.equal(a, b)


def bad_scalar_arguments(fn: Callable, given: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(argument, bad value)`` for every scalar switch and float of ``fn``'s signature not in
    ``given``: a bool (a bool default or annotation) gets a truthy non-bool (``"yes"``, ``1``),
    a float (a float default or annotation) gets NaN and inf. Walkers over constructors assert
    each is refused with a ValueError naming the argument: the walker reads the signatures, so
    a new parameter cannot skip the check."""
    cases = []
    for name, p in inspect.signature(fn).parameters.items():
        if name in given or name == "self":
            continue
        if isinstance(p.default, bool) or p.annotation in (bool, "bool"):
            cases += [(name, "yes"), (name, 1)]
        elif isinstance(p.default, float) or p.annotation in (float, "float"):
            cases += [(name, math.nan), (name, math.inf)]
    return cases


def gemm_specs(
    recipe: str,
    fwd_dtype: torch.dtype = torch.float8_e4m3fn,
    bwd_dtype: torch.dtype = torch.float8_e5m2,
    power_2_scale: bool = False,
    weight_block_rows: int = 1,
    emulate: bool = False,
    rht: bool = False,
    stochastic_rounding: bool = False,
    row_scaled: bool = False,
    input_4over6: str = "",
    weight_4over6: str = "",
) -> dict[str, Any]:
    """The GEMM family functions' ``input_spec`` / ``weight_spec`` / ``grad_spec`` of a recipe
    kind with these settings (``functional.spec.QuantSpec``; ``""``: high precision)."""
    from te_compile.functional.spec import QuantSpec

    if not recipe:
        return {"input_spec": "", "weight_spec": "", "grad_spec": ""}
    x = QuantSpec(recipe, fwd_dtype, 1, power_2_scale, emulate, rht, False, row_scaled,
                  input_4over6)  # fmt: skip
    w = QuantSpec(recipe, fwd_dtype, weight_block_rows, power_2_scale, emulate,
                  four_over_six=weight_4over6)  # fmt: skip
    g = QuantSpec(recipe, bwd_dtype, 1, power_2_scale, emulate, rht, stochastic_rounding)
    return {"input_spec": x, "weight_spec": w, "grad_spec": g}


_SPEC_ARGS = set(inspect.signature(gemm_specs).parameters)


def with_specs(**kw: Any) -> dict[str, Any]:
    """``kw`` with the recipe arguments of :func:`gemm_specs` (``recipe``, ``fwd_dtype``, ...,
    ``weight_4over6``) turned into the three specs; the other arguments as they are."""
    flat = {k: kw.pop(k) for k in list(kw) if k in _SPEC_ARGS}
    return {**gemm_specs(**flat), **kw} if flat else kw
