"""Every registered te op, checked the same way; a new op cannot skip this file.

For each op but the backward ops, on its sample inputs (``tests/samples``) on every device:
``torch.library.opcheck`` (all default tests), ``torch.compile(fullgraph=True, dynamic=True)``
with zero graph breaks, and forward and backward against the float64 reference (compiled by
Inductor on CUDA; on the CPU by AOTAutograd's ``aot_eager``, and by Inductor with
``--long-runs``). The reference is the independent one of
``tests/utils/references.py`` for the families whose library ``*_ref`` is their CPU
implementation (norm, activation, attention, fused_norm; the quantisers of quantize and
quantize_mx are compared with theirs bit for bit), the entry's own elsewhere. Backward ops get
their inputs by recording the calls the forward's autograd makes, so they are opchecked with
realistic arguments without a second sample list.

An op's samples are checked in parts of at most ``_part_size(name)`` samples, a test each, so
that the suite's workers (``pytest -n``) share an op with many samples. Every sample gets
``opcheck``'s schema, autograd-registration and fake-tensor checks. Its
``test_aot_dispatch_dynamic`` (AOTAutograd over the op with dynamic shapes, its costliest check)
runs on the first sample of each recipe kind and dtype: on CUDA, with ``--long-runs``, and for
the ops without a backward.
A differentiable op's on the CPU is left to the compiled check
(``test_forward_backward_vs_reference_eager_and_compiled``), which traces with AOTAutograd and
dynamic shapes every high-precision sample and the first quantised sample of each recipe kind
but NVFP4, and none of attention's and dropout's (their own tests compile them); every sample on
CUDA and with ``--long-runs``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import te_compile
from te_compile._library import registry
from tests.samples import SAMPLES
from tests.utils import (
    DEVICES,
    assert_bits_equal,
    assert_close,
    compile_counted,
    references,
    to_reference,
)

ENTRIES = registry()


def _is_backward(name: str) -> bool:
    return (
        ENTRIES[name].differentiable is not None
        and ENTRIES[name].differentiable.bwd.qualname == name
    )


# The ops called on their samples: every op but the backward ops, whose inputs are recorded.
FORWARD = sorted(name for name in ENTRIES if not _is_backward(name))
DIFFERENTIABLE = sorted(name for name in FORWARD if ENTRIES[name].differentiable)
# Non-differentiable ops with an independent reference (the quantisers): compared bit for bit.
EXACT = sorted(name for name in references.REFERENCES if not ENTRIES[name].differentiable)
_PART = 6
# te::mlp_fwd's quantised samples compile with Inductor for minutes each on CUDA (the emulated
# MXFP8 and NVFP4 ones most): one sample per test, else one test holds several of them and
# outlasts the GPU suite's call (in parts of 6, 310 s, over 430 s with every worker compiling).
_PART_SIZES = {"te::mlp_fwd": 1}


def _part_size(name: str) -> int:
    return _PART_SIZES.get(name, _PART)


def _samples(name: str, device: str):
    return list(SAMPLES[name](torch.device(device)))


def _n_parts(name: str) -> int:
    """How many parts op ``name``'s samples (counted on the CPU) make (one for an op without
    samples, whose tests fail, as ``test_every_forward_op_has_samples`` does)."""
    n = len(_samples(name, "cpu")) if name in SAMPLES else 0
    return max(1, -(-n // _part_size(name)))


def _parts(names: list[str]) -> list:
    """``(name, part)`` parameters: each op's samples in parts of ``_part_size(name)``."""
    params = []
    for name in names:
        n = _n_parts(name)
        params += [pytest.param(name, i, id=name if n == 1 else f"{name}[{i}]") for i in range(n)]
    return params


def _part(name: str, device: str, part: int) -> list:
    """Part ``part`` of op ``name``'s samples on ``device`` (the last part takes any samples
    past the CPU's count)."""
    last = _n_parts(name) - 1
    samples = _samples(name, device)
    size = _part_size(name)
    chosen = samples[part * size : None if part >= last else (part + 1) * size]
    if not chosen:
        pytest.skip(f"{name} has {len(samples)} samples on {device}: part {part} is empty")
    return chosen


def _clone(args):
    def c(x):
        return (
            x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        )

    return tree_map(c, args)


def _tensors(out):
    flat = []
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(o, torch.Tensor):
            flat.append(o)
    return flat


def test_every_op_is_covered():
    """Every op in the te namespace is in the registry, and every registry entry is testable:
    called on its samples, or the backward of an op that is."""
    dispatcher_ops = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("te::")}
    assert dispatcher_ops == set(te_compile.list_ops())
    for name, entry in ENTRIES.items():
        testable = name in SAMPLES or (
            _is_backward(name) and entry.differentiable.fwd.qualname in SAMPLES
        )
        assert testable, f"{name} has no sample inputs and is not the backward of a tested op"


def test_every_forward_op_has_samples():
    """``tests/samples`` has the samples of exactly the ops called on them: every op but the
    backward ops (a new op without samples fails here), and no op that is not registered."""
    assert sorted(SAMPLES) == FORWARD, (
        f"without samples: {sorted(set(FORWARD) - set(SAMPLES))}; "
        f"not registered or a backward op: {sorted(set(SAMPLES) - set(FORWARD))}"
    )


def _family(name: str) -> str:
    """The family (``tests/samples/<family>.py``, named after the ``te_compile/functional``
    file) whose samples forward op ``name`` takes."""
    return SAMPLES[name].__module__.rsplit(".", 1)[-1]


def test_families_with_their_own_references_have_independent_ones():
    """Every forward op of the families whose library ``*_ref`` is also their CPU implementation
    has a reference written apart from it (``tests/utils/references.py``), which the checks
    below use as the expected value; a new op of these families fails here until it has one."""
    ops = {name for name in FORWARD if _family(name) in references.FAMILIES}
    assert set(references.REFERENCES) == ops


_CHEAP_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")
_ALL_OPCHECKS = (*_CHEAP_OPCHECKS, "test_aot_dispatch_dynamic")


def _first_of_each_kind(name: str, device: str, by_dtype: bool = True) -> set[int]:
    """Indices of the first sample of each recipe kind (and dtype) of op ``name``."""
    first: dict[tuple, int] = {}
    for i, sample in enumerate(_samples(name, device)):
        tensors = _tensors(list(sample.args))
        dtype = tensors[0].dtype if tensors and by_dtype else None
        first.setdefault((_recipe_kind(name, sample), dtype), i)
    return set(first.values())


def _full_opchecks(name: str, device: str, request) -> set[int]:
    """The samples of op ``name`` that get ``test_aot_dispatch_dynamic``
    (:func:`_first_of_each_kind`); none of a differentiable op's on the CPU without
    ``--long-runs``: there
    ``test_forward_backward_vs_reference_eager_and_compiled`` traces the same first samples with
    AOTAutograd and dynamic shapes, forward and backward op, and compares them with the
    reference (the opcheck's AOTAutograd pass was a third of this file's time on CI); NVFP4's
    samples, which it runs eager there, are traced on CUDA and with ``--long-runs``."""
    if (device == "cpu" and name in DIFFERENTIABLE
            and not request.config.getoption("--long-runs")):  # fmt: skip
        return set()
    return _first_of_each_kind(name, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "part"), _parts(FORWARD))
def test_opcheck(name, part, device, request):
    full = _full_opchecks(name, device, request)
    for i, sample in enumerate(_part(name, device, part), start=part * _part_size(name)):
        utils = _ALL_OPCHECKS if i in full else _CHEAP_OPCHECKS
        args = _clone(sample.args)
        torch.library.opcheck(ENTRIES[name].overload, args, sample.kwargs, test_utils=utils)


class _RecordCalls(TorchDispatchMode):
    def __init__(self, targets):
        super().__init__()
        self.targets, self.calls = targets, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.targets:
            self.calls.append((func, tree_map(_snapshot, args), tree_map(_snapshot, kwargs)))
        return func(*args, **kwargs)


def _snapshot(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "part"), _parts(DIFFERENTIABLE))
def test_backward_op_opcheck(name, part, device, request):
    dop = ENTRIES[name].differentiable
    full = _full_opchecks(name, device, request)
    for i, sample in enumerate(_part(name, device, part), start=part * _part_size(name)):
        args = _clone(sample.args)
        with _RecordCalls({dop.bwd.overload}) as rec:  # an active mode forces the op path
            out = _tensors(dop(*args))
            torch.autograd.backward(out[0], torch.randn_like(out[0]))
        assert rec.calls, f"backward of {name} did not call {dop.bwd.qualname}"
        utils = _ALL_OPCHECKS if i in full else _CHEAP_OPCHECKS
        for func, bargs, bkwargs in rec.calls:
            torch.library.opcheck(func, bargs, bkwargs, test_utils=utils)


# The recipe kinds a sample of a GEMM family op can name (a string argument).
_QUANTISED_KINDS = {"current", "delayed", "block", "mxfp8", "nvfp4"}
_BLOCK_KINDS = {"block", "mxfp8", "nvfp4"}
# Not compiled by the CPU's default run of the compiled check (its costliest trace).
_CPU_EAGER_ONLY = {"nvfp4"}
# Ops whose samples the CPU's default run checks eager only: their compiled CPU paths are the
# subject of their own tests (compiled fullgraph, no recompile on new sizes, against eager).
_CPU_EAGER_ONLY_OPS = {
    "te::attention_fwd": "tests/functional/test_attention.py, tests/modules/test_attention.py",
    "te::dropout_fwd": "tests/functional/test_dropout.py (the compiled checkpointed mask)",
}
_ACTIVATIONS = set(te_compile.functional.ACTIVATIONS + te_compile.functional.GATED_ACTIVATIONS)


_BACKWARD_OVERRIDES = {"high_precision", "dequantized"}


def _strings(sample) -> set[str]:
    """A sample's string arguments and the tokens of its spec strings (``functional.spec``; a
    ``name=value`` token gives its value)."""
    strings = {a for a in sample.args if isinstance(a, str)}
    return strings | {t.partition("=")[2] or t for a in strings for t in a.split(":")}


def _recipe_kind(name: str, sample) -> str | None:
    """The quantised recipe kind a sample of op ``name`` runs, or None (high precision)."""
    kinds = _strings(sample) & _QUANTISED_KINDS
    return next(iter(kinds), None)


def _requantising(name: str, sample) -> bool:
    """Samples that quantise an intermediate they compute, or run long fp32 sums next to a
    quantisation: te::mlp quantises the activation of its first GEMM's output and the gradient
    of that activation, te::linear with an activation epilogue the activation's gradient; the
    op computes it in fp32, the reference in float64, so a value within an fp32 rounding of an
    FP8 rounding boundary lands one FP8 step away (seen: one activation code of 1024 on the
    CPU). Judged like a reduction. So are te::linear's and te::grouped_linear's block-scaled
    samples, which run GEMMs of K=512 (native blockwise needs that) in fp32 and, with a norm
    prologue, the norm's backward (a cancelling sum) on their result: a bf16 gradient whose
    512-term fp32 sum cancels to near 0 is off by more than its own rounding (seen with another
    upstream gradient: 1.4e-5 on a value of 2e-4)."""
    kind = _recipe_kind(name, sample)
    if kind is None:
        return False
    if name == "te::mlp_fwd":
        return True
    strings = _strings(sample)
    if name == "te::grouped_linear_fwd":
        return kind in _BLOCK_KINDS
    return name == "te::linear_fwd" and (kind in _BLOCK_KINDS or bool(strings & _ACTIVATIONS))


def _tolerance(name: str, device: str, dtype: torch.dtype, sample) -> dict:
    """``assert_close`` arguments for a sample of op ``name``'s results in ``dtype`` on
    ``device``.

    CPU: one rounding of ``dtype`` (the CPU implementations define the op). CUDA: a GPU GEMM or
    reduction accumulates in fp32 in its own order before its one rounding, so next to a rounding
    boundary it lands one step away from the rounded float64 result, and where a sum cancels the
    difference is relative to its terms (seen on the H100 for the bf16 GEMM ops, 2026-11-22):
    two roundings, relative to the largest value (so are :func:`_requantising` samples
    everywhere, at bf16's tolerance). Hopper's FP8 tensor cores accumulate with fewer bits than
    fp32 (partial sums are promoted only every so often; an fp32-output FP8 GEMM was 5e-3
    relative off on the H100): quantised samples' fp32 results are judged at bf16's
    tolerance."""
    if _requantising(name, sample):
        return {"dtype": torch.bfloat16 if dtype == torch.float32 else dtype, "roundings": 2,
                "reduced": True}  # fmt: skip
    if _strings(sample) & _BACKWARD_OVERRIDES:
        # The backward GEMMs multiply operands rounded to the input dtype (the dequantised FP8
        # values, as in TE): each rounding is relative to a term of a sum that may cancel.
        return {"dtype": dtype, "roundings": 2, "reduced": True}
    if name == "te::mlp_fwd":  # high precision: z and h rounded, as the unfused ops round them
        return {"dtype": dtype, "roundings": 2, "reduced": True}
    if torch.device(device).type != "cuda":
        return {"dtype": dtype}
    if _recipe_kind(name, sample) is not None and dtype == torch.float32:
        dtype = torch.bfloat16
    return {"dtype": dtype, "roundings": 2, "reduced": True}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "part"), _parts(DIFFERENTIABLE))
# Each sample with another signature (a string argument, a None pattern) is a graph of its own:
# an op with many samples recompiles past dynamo's default limit of 8 by design.
@torch._dynamo.config.patch(recompile_limit=64)
def test_forward_backward_vs_reference_eager_and_compiled(name, part, device, request):
    dop = ENTRIES[name].differentiable
    # Inductor on CUDA, where it launches our Triton kernels. On the CPU, AOTAutograd's graphs
    # run as they are (same trace, fakes, saved tensors and backward ops) unless --long-runs:
    # Inductor's CPU code generation of every sample is most of make test's time on a cold
    # cache; tests/test_trace_through.py and the compiled-step tests compile with it on the CPU.
    inductor = device == "cuda" or request.config.getoption("--long-runs")
    backend = "inductor" if inductor else "aot_eager"
    # Dynamic shapes for every sample on CUDA and with --long-runs; on the CPU by default only
    # for the high-precision ones: tracing the quantised samples' emulated math symbolically
    # took two thirds of this test's time there (the quantisers' dynamic compiles are in
    # tests/functional/test_quantize.py and test_quantize_mx.py).
    compiled, counter = compile_counted(lambda *a: dop(*a), backend=backend, dynamic=True)
    static = compiled  # (a function of its own: dynamo caches graphs per code object)
    if not inductor:
        static = torch.compile(lambda *a: dop(*a), backend=counter, fullgraph=True, dynamic=False)
    # On the CPU by default, of the quantised samples only the first of each recipe kind is
    # also compiled, NVFP4's not at all (tracing the emulated block-scaled math of each is most
    # of this file's time; NVFP4's quantisers compile with Inductor in
    # tests/functional/test_quantize_mx.py); every sample is compiled on CUDA and with
    # --long-runs.
    first = _first_of_each_kind(name, device, by_dtype=False)
    n_compiled = 0
    for i, sample in enumerate(_part(name, device, part), start=part * _part_size(name)):
        kind = _recipe_kind(name, sample)
        sampled = kind is None or (i in first and kind not in _CPU_EAGER_ONLY)
        runs = (dop, compiled if kind is None else static)
        if not inductor and (name in _CPU_EAGER_ONLY_OPS or not sampled):
            runs = (dop,)
        n_compiled += len(runs) - 1
        ref_args = to_reference(sample.args)
        ref_out = _tensors(references.REFERENCES.get(name, dop.reference)(*ref_args))
        dtype = _tensors(sample.args)[0].dtype
        tols = _tolerance(name, device, dtype, sample)
        # The same (dtype-representable) upstream gradient for the reference and the test.
        grad = torch.randn_like(ref_out[0]).to(dtype).to(torch.float64)
        torch.autograd.backward(ref_out[0], grad)
        for run in runs:
            args = _clone(sample.args)
            out = _tensors(run(*args))
            for o, r in zip(out, ref_out, strict=False):
                assert_close(o, r, **tols)
            out[0].backward(grad.to(device=out[0].device, dtype=out[0].dtype))
            checked = 0
            for a, r in zip(args, ref_args, strict=True):
                if isinstance(a, torch.Tensor) and a.grad is not None:
                    assert_close(a.grad, r.grad, **tols)
                    checked += 1
            assert checked > 0, "no gradient reached any input"
    assert counter.frame_count >= min(n_compiled, 1)
    # One graph per distinct input signature (dtype/rank/None pattern), never a break.
    sample = _part(name, device, part)[0]
    explanation = torch._dynamo.explain(lambda *a: dop(*a))(*_clone(sample.args))
    assert explanation.graph_break_count == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", EXACT)
def test_vs_independent_reference_bit_for_bit(name, device):
    """The quantisers' outputs, bit for bit, against ``tests/utils/references.py`` (the formats
    define every bit: scales, codes, saturation, rounding to nearest even)."""
    for sample in _samples(name, device):
        out = _tensors(ENTRIES[name].overload(*sample.args, **sample.kwargs))
        cpu = tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, sample.args)
        expected = _tensors(references.REFERENCES[name](*cpu, **sample.kwargs))
        assert len(out) == len(expected), name
        for o, e in zip(out, expected, strict=True):
            assert_bits_equal(o, e)
