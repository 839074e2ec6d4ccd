"""te::delayed_scaling_update: the delayed-scaling buffer update, eager and compiled."""

from __future__ import annotations

import math

import pytest
import torch

import te_compile
from te_compile.functional import fp8_scaling
from te_compile.functional.fp8_scaling import FP32_MAX, update_states
from te_compile.quantization import DelayedScaling, Format
from te_compile.quantization.fp8_gemm import _custom_update
from tests.utils import DEVICES, compile_counted

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _update(history, scale, pending, limits, margin=0, algo="max"):
    torch.ops.te.delayed_scaling_update(history, scale, pending, limits, margin, algo)


@pytest.mark.parametrize("device", DEVICES)
def test_history_rolls_and_scale_follows_the_max(device):
    history = torch.zeros(3, 2, device=device)
    scale = torch.ones(2, device=device)
    limits = [E4M3_MAX, E5M2_MAX]
    for amaxes in ([2.0, 8.0], [4.0, 1.0], [1.0, 1.0], [0.5, 0.5]):
        _update(history, scale, torch.tensor(amaxes, device=device), limits)
    # Newest first; the oldest ([2, 8]) fell out of the 3-long window.
    assert history.tolist() == [[0.5, 0.5], [1.0, 1.0], [4.0, 1.0]]
    assert scale.tolist() == [E4M3_MAX / 4.0, E5M2_MAX / 1.0]


@pytest.mark.parametrize("device", DEVICES)
def test_most_recent_and_margin(device):
    history = torch.tensor([[8.0]], device=device).repeat(4, 1)
    scale = torch.ones(1, device=device)
    _update(history, scale, torch.tensor([2.0], device=device), [E4M3_MAX], 2, "most_recent")
    assert scale.item() == E4M3_MAX / 2.0 / 4.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan])
def test_zero_or_non_finite_amax_keeps_the_scale(device, bad):
    history = torch.zeros(1, 2, device=device)
    scale = torch.tensor([3.0, 5.0], device=device)
    _update(history, scale, torch.tensor([bad, 2.0], device=device), [E4M3_MAX, E4M3_MAX])
    assert scale[0].item() == 3.0 and scale[1].item() == E4M3_MAX / 2.0


@pytest.mark.parametrize("device", DEVICES)
def test_returns_a_copy_of_the_new_scales_one_slot_per_16_bytes(device):
    """The op returns the new scales in a tensor of its own (not the buffer, which the update
    writes too), each slot 16-byte aligned: the GEMMs' ``_scaled_mm`` scale views."""
    history, scale = torch.zeros(2, 3, device=device), torch.ones(3, device=device)
    amax = torch.tensor([2.0, 4.0, 8.0], device=device)
    limits = [E4M3_MAX, E4M3_MAX, E5M2_MAX]
    out = torch.ops.te.delayed_scaling_update(history, scale, amax, limits, 0, "max")
    assert out.tolist() == scale.tolist() == [E4M3_MAX / 2.0, E4M3_MAX / 4.0, E5M2_MAX / 8.0]
    assert out.untyped_storage().data_ptr() != scale.untyped_storage().data_ptr()
    assert all(out[i : i + 1].data_ptr() % 16 == 0 for i in range(3))


# Transformer Engine's test_scale_update_numeric_scenarios: amax -> the scale from a scale of 1.
_AMAX_CASES = {
    "zero": (0.0, 1.0),
    "tiny": (E4M3_MAX / FP32_MAX / 2, FP32_MAX),  # fp8_max / amax overflows fp32
    "normal": (0.75, E4M3_MAX / 0.75),
    "inf": (math.inf, 1.0),
    "nan": (math.nan, 1.0),
}


@pytest.mark.parametrize("path", ["op", "callable"])
@pytest.mark.parametrize("case", list(_AMAX_CASES))
def test_scale_of_each_amax_case(case, path):
    """An amax of 0, inf or NaN keeps the scale; one so small that the scale overflows fp32
    gives fp32's largest finite value, never inf; the same through the op and through the
    update a recipe with an ``amax_compute_algo`` callable runs (``fp8_gemm._custom_update``)."""
    amax, expected = _AMAX_CASES[case]
    history, scale = torch.zeros(1, 1), torch.ones(1)
    last = torch.tensor([amax])
    if path == "op":
        _update(history, scale, last, [E4M3_MAX])
    else:
        recipe = DelayedScaling(fp8_format=Format.E4M3, amax_compute_algo=lambda h: h[0])
        limits = [E4M3_MAX, E4M3_MAX, E4M3_MAX]
        history, scale = history.expand(1, 3).clone(), scale.expand(3).clone()
        _custom_update(history, scale, last.expand(3), limits, recipe)
    assert torch.equal(scale, torch.full_like(scale, expected))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_update_mutates_buffers_like_eager(device):
    def step(history, scale, pending, x):
        _update(history, scale, pending, [E4M3_MAX])
        pending.copy_(x.abs().amax().reshape(1))  # what a forward op would record
        return x * scale

    state = [torch.zeros(2, 1, device=device), torch.ones(1, device=device)]
    state += [torch.zeros(1, device=device)]
    compiled_state = [t.clone() for t in state]
    compiled, counter = compile_counted(step)
    for i in range(3):
        x = torch.randn(8, device=device) * (i + 1)
        assert torch.equal(compiled(*compiled_state, x), step(*state, x))
        for a, b in zip(compiled_state, state, strict=True):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"algo": "mean"}, "amax_compute_algo must be one of"),
        ({"margin": -1}, "margin must be an int >= 0"),
        ({"limits": [E4M3_MAX]}, "fp8_max of length slots"),
        ({"limits": [E4M3_MAX, 0.0]}, r"fp8_max .* must be finite and > 0, got \[448.0, 0.0\]"),
        ({"limits": [-1.0, E4M3_MAX]}, "fp8_max .* must be finite and > 0"),
        ({"limits": [E4M3_MAX, math.nan]}, "fp8_max .* must be finite and > 0"),
        ({"limits": [math.inf, E4M3_MAX]}, "fp8_max .* must be finite and > 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    """Refused on every call: the update's checks are memoised per shapes and arguments, and a
    call that passed them with the same tensors first does not let the bad value through."""
    good = {"limits": [E4M3_MAX, E4M3_MAX], "margin": 0, "algo": "max"}
    _update(torch.zeros(2, 2), torch.ones(2), torch.zeros(2), **good)
    args = {**good, **kwargs}
    with pytest.raises(ValueError, match=match):
        _update(torch.zeros(2, 2), torch.ones(2), torch.zeros(2), **args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_amax_in_two_buffers_is_the_concatenated_update(device, algo):
    """``amax`` for the first slots and ``amax_tail`` for the others (FP8GemmState's forward and
    gradient buffers, read in place) update the state exactly as their concatenation does."""
    torch.manual_seed(0)
    history, scale = torch.rand(4, 3, device=device) * 10, torch.rand(3, device=device) + 0.5
    fwd, grad = torch.tensor([0.0, 3.5], device=device), torch.tensor([7.0], device=device)
    limits = [E4M3_MAX, E4M3_MAX, E5M2_MAX]
    h1, s1, h2, s2 = history.clone(), scale.clone(), history.clone(), scale.clone()
    out1 = torch.ops.te.delayed_scaling_update(h1, s1, torch.cat([fwd, grad]), limits, 1, algo)
    out2 = torch.ops.te.delayed_scaling_update(h2, s2, fwd, limits, 1, algo, grad)
    for a, b in ((h1, h2), (s1, s2), (out1, out2)):
        assert torch.equal(a, b)
    assert out2.stride() == (4,)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"limits": [E4M3_MAX, E5M2_MAX, E4M3_MAX]}, "one format's largest value for the first"),
        ({"tail": torch.zeros(2)}, r"amax and amax_tail, 1-D, together \[slots\]"),
        ({"tail": torch.zeros(1, 1)}, r"amax and amax_tail, 1-D, together \[slots\]"),
        ({"tail": torch.zeros(1, dtype=torch.float64)}, "expected float32"),
    ],
)
def test_bad_amax_tail_or_limit_runs(kwargs, match):
    """The limits are two runs (the kernel takes them as two scalars); ``amax`` and
    ``amax_tail`` together give one amax per slot."""
    args = {"limits": [E4M3_MAX, E4M3_MAX, E5M2_MAX], "tail": torch.zeros(1), **kwargs}
    with pytest.raises(ValueError, match=match):
        torch.ops.te.delayed_scaling_update(
            torch.zeros(2, 3), torch.ones(3), torch.zeros(2), args["limits"], 0, "max",
            args["tail"],
        )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pair", [False, True], ids=["one", "pair"])
def test_module_update_direct_gives_the_ops_bytes_and_versions(device, pair, monkeypatch):
    """``update_states`` (a module's eager update: the op's implementation without its entry)
    leaves the states and returns the copy as the op path does, bit for bit, and moves the
    written buffers' versions on as the op does (on CUDA, where a kernel's write moves none by
    itself); with the fast path off it calls the op, and a compiled call traces the op."""
    limits = [E4M3_MAX, E4M3_MAX, E5M2_MAX]

    def states():
        g = torch.Generator().manual_seed(3)
        return [[(torch.rand(5, 3, generator=g) * (k + 1)).to(device)[:4],
                 (torch.rand(3, generator=g) + 0.5).to(device),
                 (torch.rand(2, generator=g) * 4).to(device), torch.rand(1, generator=g).to(device)]
                for k in range(2 if pair else 1)]  # fmt: skip

    calls = []
    for name in ("delayed_scaling_update_op", "delayed_scaling_update_pair"):
        real = getattr(fp8_scaling, name)
        monkeypatch.setattr(fp8_scaling, name, lambda *a, real=real: calls.append(a) or real(*a))

    def run(fast: bool):
        st, previous = states(), te_compile.eager_fast_path_enabled()
        written = [t for state in st for t in state[:2]]
        versions = [t._version for t in written]
        calls.clear()
        te_compile.set_eager_fast_path(fast)
        try:
            out = update_states(st, limits, 1, "max")
        finally:
            te_compile.set_eager_fast_path(previous)
        return st, out, len(calls), [t._version > v for t, v in zip(written, versions, strict=True)]

    direct, op = run(True), run(False)
    for got, want in zip(direct[0], op[0], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(direct[1], op[1]) and direct[1].stride() == (4,)
    assert direct[3] == op[3] == [True] * (4 if pair else 2)
    assert (direct[2], op[2]) == (0, 1)
    fn, counter = compile_counted(lambda *st: update_states([st, *rest], limits, 1, "max"))
    (first, *rest), _ = states(), calls.clear()
    assert torch.equal(fn(*first), op[1]) and counter.frame_count == 1 and len(calls) == 1


class _Reduced(torch.Tensor):
    """Stands for an amax of another tensor type (a functional all-reduce's result)."""


def test_module_update_of_amaxes_of_another_type_goes_through_the_dispatcher(monkeypatch):
    """An amax that is not a plain tensor (reduced over the amax group: an asynchronous
    collective's result) takes the op through the dispatcher (which waits for it), not the
    direct call nor the op's own eager shortcut; the bytes are the direct call's."""
    calls = []
    op = fp8_scaling.delayed_scaling_update_op
    monkeypatch.setattr(op, "eager", lambda *a: pytest.fail("the op's eager shortcut ran"))
    monkeypatch.setattr(fp8_scaling, "delayed_scaling_update_op",
                        lambda *a: calls.append(a) or op(*a))  # fmt: skip

    def states(kind):
        g = torch.Generator().manual_seed(4)
        fwd = (torch.rand(2, generator=g) * 4).as_subclass(kind)
        return [(torch.rand(4, 3, generator=g), torch.ones(3), fwd, torch.rand(1, generator=g))]

    plain, reduced = states(torch.Tensor), states(_Reduced)
    want = update_states(plain, [448.0] * 3, 0, "max")
    assert calls == []
    got = update_states(reduced, [448.0] * 3, 0, "max")
    assert len(calls) == 1 and torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(reduced[0][:2], plain[0][:2], strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_pair_is_the_two_updates(device, algo, compiled):
    """``te::delayed_scaling_update_pair`` (a LayerNormMLP's two states in one launch) leaves
    both states as two ``te::delayed_scaling_update`` calls do, bit for bit, and returns their
    scales' copies one after the other, one slot per 16 bytes; eager and compiled."""
    torch.manual_seed(1)
    limits = [E4M3_MAX, E4M3_MAX, E5M2_MAX]
    states = []
    for k in range(2):
        history = torch.rand(6, 3, device=device) * (k + 1)
        states.append([history, torch.rand(3, device=device) + 0.5,
                       torch.rand(2, device=device) * 4, torch.rand(1, device=device)])  # fmt: skip
    singles = [[t.clone() for t in st] for st in states]
    copies = [
        torch.ops.te.delayed_scaling_update(h[:4], s, fwd, limits, 1, algo, grad)
        for h, s, fwd, grad in singles
    ]

    def pair(h, s, fwd, grad, h2, s2, fwd2, grad2):
        return torch.ops.te.delayed_scaling_update_pair(
            h[:4], s, fwd, grad, h2[:4], s2, fwd2, grad2, limits, 1, algo
        )

    fn = torch.compile(pair, fullgraph=True) if compiled else pair
    out = fn(*states[0], *states[1])
    for got, want in zip(states, singles, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(out, torch.cat(copies)) and out.stride() == (4,)
    assert not torch.equal(copies[0], copies[1])
    with pytest.raises(ValueError, match="the second state must have the first's shapes"):
        torch.ops.te.delayed_scaling_update_pair(*states[0], states[1][0][:2], *states[1][1:],
                                                 limits, 1, algo)  # fmt: skip
