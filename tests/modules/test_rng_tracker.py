"""get_rng_state_tracker / rng_tracker_name (Transformer Engine's tensor-parallel RNG): weights
are initialised, and attention dropout masks drawn, inside the tracker's fork(); torch's
default generator is not advanced by them."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import te_compile as te
from tests.utils import assert_bits_equal


class Tracker:
    """A minimal CPU RNG states tracker, in the manner of Megatron's CudaRNGStatesTracker:
    named generator states, ``fork(name)`` swaps one in for torch's default generator."""

    def __init__(self, **seeds: int) -> None:
        self.states = {}
        self.forks: list[str] = []
        saved = torch.get_rng_state()
        for name, seed in seeds.items():
            torch.manual_seed(seed)
            self.states[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        self.forks.append(name)
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _tracker(seed=1, **more):
    tracker = Tracker(**{"model-parallel-rng": seed, **more})
    return tracker, lambda: tracker


GEMM_MODULES = {
    "Linear": lambda **kw: te.Linear(16, 32, **kw),
    "LayerNormLinear": lambda **kw: te.LayerNormLinear(16, 32, **kw),
    "LayerNormMLP": lambda **kw: te.LayerNormMLP(16, 32, **kw),
    "GroupedLinear": lambda **kw: te.GroupedLinear(2, 16, 32, **kw),
}


def _weights(m):
    return [p for n, p in m.named_parameters() if "weight" in n and "norm" not in n]


@pytest.mark.parametrize("name", list(GEMM_MODULES))
def test_weights_initialised_from_the_tracker(name):
    make = GEMM_MODULES[name]
    tracker, get = _tracker(seed=1)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    m1 = make(get_rng_state_tracker=get)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream did not move
    assert tracker.forks and set(tracker.forks) == {"model-parallel-rng"}
    m2 = make(get_rng_state_tracker=_tracker(seed=1)[1])
    m3 = make(get_rng_state_tracker=_tracker(seed=2)[1])
    for w1, w2, w3 in zip(_weights(m1), _weights(m2), _weights(m3), strict=True):
        assert_bits_equal(w1, w2)  # same tracker seed: same weights
        assert not torch.equal(w1, w3)  # another seed: other weights
    # The same draws as a plain module after seeding torch's generator with the tracker's seed.
    torch.manual_seed(1)
    for w, ref in zip(_weights(m1), _weights(make()), strict=True):
        assert_bits_equal(w, ref)


def test_rng_tracker_name_picks_the_state():
    tracker, get = _tracker(seed=1, experts=7)
    m = te.GroupedLinear(2, 16, 32, get_rng_state_tracker=get, rng_tracker_name="experts")
    assert tracker.forks == ["experts"]
    torch.manual_seed(7)
    ref = te.GroupedLinear(2, 16, 32)
    for w, r in zip(_weights(m), _weights(ref), strict=True):
        assert_bits_equal(w, r)


def test_attention_dropout_draws_from_the_tracker():
    q, k, v = (torch.randn(8, 2, 2, 16) for _ in range(3))

    def run(seed):
        tracker, get = _tracker(seed=seed)
        dpa = te.DotProductAttention(2, 16, attention_dropout=0.5, get_rng_state_tracker=get)
        torch.manual_seed(0)
        before = torch.get_rng_state()
        out = dpa(q, k, v)
        assert torch.equal(torch.get_rng_state(), before)
        assert tracker.forks == ["model-parallel-rng"]
        return out

    a, b, c = run(1), run(1), run(2)
    assert_bits_equal(a, b)
    assert not torch.equal(a, c)
    dpa = te.DotProductAttention(2, 16, attention_dropout=0.5)
    torch.manual_seed(1)  # the tracker's state is what torch's generator would have drawn
    assert_bits_equal(dpa(q, k, v), a)
    dpa.eval()  # no dropout: no draw
    tracker, get = _tracker()
    te.DotProductAttention(2, 16, attention_dropout=0.5, get_rng_state_tracker=get).eval()(q, k, v)
    assert tracker.forks == []


@pytest.mark.parametrize("cls", ["MultiheadAttention", "TransformerLayer"])
def test_attention_modules_pass_the_tracker_on(cls):
    tracker, get = _tracker(seed=3)
    kw = {"hidden_size": 32, "num_attention_heads": 2, "attention_dropout": 0.5}
    if cls == "TransformerLayer":
        kw |= {"ffn_hidden_size": 64, "hidden_dropout": 0.0}
    x = torch.randn(6, 2, 32)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    layer = getattr(te, cls)(**kw, get_rng_state_tracker=get)
    assert torch.equal(torch.get_rng_state(), before)
    n_init = len(tracker.forks)
    assert n_init >= (3 if cls == "TransformerLayer" else 2)  # QKV, proj (and the MLP)
    layer(x)
    assert len(tracker.forks) == n_init + 1  # the attention dropout mask
    assert torch.equal(torch.get_rng_state(), before)


def test_bad_tracker_arguments():
    with pytest.raises(TypeError, match="Linear: get_rng_state_tracker must be a callable"):
        te.Linear(4, 4, get_rng_state_tracker=3)
    with pytest.raises(TypeError, match="Linear: rng_tracker_name must be a str or None"):
        te.Linear(4, 4, get_rng_state_tracker=lambda: None, rng_tracker_name=5)
    with pytest.raises(TypeError, match=r"get_rng_state_tracker\(\) must return .* fork"):
        te.Linear(4, 4, get_rng_state_tracker=lambda: None)
    with pytest.raises(TypeError, match=r"Attention: get_rng_state_tracker"):
        te.TransformerLayer(16, 32, 2, get_rng_state_tracker=3)
