"""Bad inputs the one-argument walker (tests/test_bad_inputs.py) cannot make, each refused with a
ValueError or TypeError naming the argument and the constraint: an ``ops.Sequential``'s extra
inputs (positional, ``*extra_inputs``), a GroupedLinear ``state_dict`` saved in the other
parameter layout, the splits of a grouped GEMM under a recipe whose own constraints fail too,
and a module moved to another device than its input. A few of them, and of the walker's kinds
(``m_splits`` not a list, a required tensor None, a parameter on another device), run again
under ``torch.compile(fullgraph=True)``: the same message at trace time."""

from __future__ import annotations

import pytest
import torch

import te_compile as te
from te_compile import recipe as R

F = te.functional


def _x(*shape):
    return torch.randn(*shape)


def _residual_sequential(fuse: bool):
    """Linear then AddExtraInput: fused (the residual in the GEMM's epilogue) or not."""
    return te.ops.Sequential(te.ops.Linear(16, 8), te.ops.AddExtraInput(), fuse=fuse)


# (id, call, exception, the message's words): each names the argument and the constraint.
_EXTRA_INPUTS = [
    *(
        (
            f"residual_shape_fuse_{fuse}",
            lambda fuse=fuse: _residual_sequential(fuse)(_x(6, 16), _x(3, 8)),
            ValueError,
            r"AddExtraInput: residual \(its extra input\) must have the input's shape \(6, 8\) "
            r"or broadcast to it",
        )
        for fuse in (True, False)
    ),
    *(
        (
            f"residual_float_fuse_{fuse}",
            lambda fuse=fuse: _residual_sequential(fuse)(_x(6, 16), 1.5),
            TypeError,
            r"AddExtraInput: residual \(its extra input, one of forward's extra_inputs\) must be "
            r"a torch.Tensor, got 1.5",
        )
        for fuse in (True, False)
    ),
    (
        "residual_device",
        lambda: _residual_sequential(True)(_x(6, 16), _x(6, 8).to("meta")),
        ValueError,
        r"AddExtraInput: residual \(its extra input\) and input must be on one device, got "
        r"residual on meta and input on cpu",
    ),
    (
        "residual_in_place_shape",
        lambda: te.ops.AddExtraInput(in_place=True)(_x(6, 8), _x(8)),
        ValueError,
        r"AddExtraInput\(in_place=True\): the extra input's shape \(\(8,\)\) must be the input's",
    ),
    (
        "scales_float",
        lambda: te.ops.ScaledSwiGLU()(_x(6, 16), 2.0),
        TypeError,
        r"ScaledSwiGLU: scales \(its extra input, one of forward's extra_inputs\) must be a "
        r"torch.Tensor, got 2.0",
    ),
    (
        "ops_m_splits_int",
        lambda: te.ops.Sequential(te.ops.GroupedLinear(2, 16, 8))(_x(6, 16), 6),
        TypeError,
        r"m_splits must be a list of ints >= 0 or an integer tensor \(one size per group\), "
        r"got 6",
    ),
]


@pytest.mark.parametrize(
    "call, error, words", [c[1:] for c in _EXTRA_INPUTS], ids=[c[0] for c in _EXTRA_INPUTS]
)
def test_extra_input_is_refused_by_name(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_a_residual_that_broadcasts_is_added():
    """The shape check lets through what the add broadcasts without growing the output."""
    seq = _residual_sequential(fuse=False)
    x, r = _x(6, 16), _x(8)
    torch.testing.assert_close(seq(x, r), seq[0](x) + r, rtol=0, atol=0)


def _grouped(single: bool):
    return te.GroupedLinear(2, 16, 8, single_grouped_weight=single, single_grouped_bias=single)


def _edited(state: dict, key: str, value: torch.Tensor | None) -> dict:
    state = dict(state)
    if value is None:
        del state[key]
    else:
        state[key] = value
    return state


# (id, loading module's layout, state_dict of the other layout edited, the message's words)
_STATES = [
    (
        "per_group_weight_shape",
        True,
        lambda s: _edited(s, "weight0", _x(3, 16)),
        r"state_dict entry 'weight0' has shape \[3, 16\]; expected one group's \[8, 16\]",
    ),
    (
        "per_group_weight_missing",
        True,
        lambda s: _edited(s, "weight1", None),
        r"state_dict holds 'weight0' .* but not 'weight1'",
    ),
    (
        "per_group_bias_shape",
        True,
        lambda s: _edited(s, "bias1", _x(3)),
        r"state_dict entry 'bias1' has shape \[3\]; expected one group's \[8\]",
    ),
    (
        "grouped_weight_shape",
        False,
        lambda s: _edited(s, "weight", _x(2, 3, 16)),
        r"state_dict entry 'weight' has shape \[2, 3, 16\]; expected \[num_gemms, \*one "
        r"group's shape\] = \[2, 8, 16\]",
    ),
]


@pytest.mark.parametrize(
    "single, edit, words", [c[1:] for c in _STATES], ids=[c[0] for c in _STATES]
)
def test_grouped_state_dict_of_the_other_layout_is_refused_by_entry(single, edit, words):
    state = edit(_grouped(not single).state_dict())
    with pytest.raises(ValueError, match=words):
        _grouped(single).load_state_dict(state)


def test_grouped_splits_are_checked_before_the_recipe():
    """A list's sum is known on the host: it is refused first, not after the recipe's feature
    sizes (MXFP8 needs multiples of 32, which 16 x 8 is not either)."""
    module = te.GroupedLinear(2, 16, 8)
    with te.autocast(recipe=R.MXFP8BlockScaling()):
        with pytest.raises(
            ValueError, match=r"m_splits must sum to inp's rows \(6\), got \[2, 3\]"
        ):
            module(_x(6, 16), [2, 3])
        with pytest.raises(ValueError, match=r"m_splits must sum to inp.shape\[0\] \(6\)"):
            F.grouped_linear(_x(6, 16), [2, 3], _x(2, 8, 16), input_spec="mxfp8:e4m3:emulate",
                             weight_spec="mxfp8:e4m3:emulate",
                             grad_spec="mxfp8:e5m2:emulate")  # fmt: skip


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: te.Linear(16, 8, device="meta"), r"inp and weight must be on one device"),
        (lambda: te.LayerNorm(16, device="meta"), r"inp and weight must be on one device"),
        (lambda: te.GroupedLinear(2, 16, 8, device="meta"), r"inp and weight must be on one"),
        (
            lambda: te.MultiheadAttention(16, 2, device="meta"),
            r"hidden_states must be on the module's device \(meta\), got cpu",
        ),
    ],
    ids=["Linear", "LayerNorm", "GroupedLinear", "MultiheadAttention"],
)
def test_a_module_on_another_device_than_its_input_is_refused(make, words):
    """Not silently computed on the meta device, nor a device error naming no argument."""
    module = make()
    args = (_x(6, 16), [2, 4]) if isinstance(module, te.GroupedLinear) else (_x(4, 2, 16),)
    with pytest.raises(ValueError, match=words):
        module(*args)


def test_a_cuda_input_to_a_cpu_module_says_how_to_place_the_module():
    """A module on the CPU fed a CUDA input (or the reverse): the refusal says where a module
    built without ``device=`` goes and how to place it (only ``.device`` is read, so no GPU is
    needed)."""
    from types import SimpleNamespace

    from te_compile._checks import check_same_device

    cuda, cpu = (
        SimpleNamespace(device=torch.device("cuda", 0)),
        SimpleNamespace(device=torch.device("cpu")),
    )
    with pytest.raises(ValueError, match=r"on cuda:0 and weight on cpu \(a module .* \.cuda\(\)"):
        check_same_device("te.linear", "inp", cuda, weight=cpu)
    with pytest.raises(ValueError, match=r"on meta\Z"):
        check_same_device(
            "te.linear", "inp", cpu, weight=SimpleNamespace(device=torch.device("meta"))
        )


# Representative cases of each kind: the same message eager and at trace time.
_COMPILED = {
    "grouped_linear_m_splits_int": lambda: (
        F.grouped_linear,
        {"inp": _x(6, 16), "m_splits": 6, "weight": _x(2, 8, 16)},
    ),
    "GroupedLinear_m_splits_none": lambda: (
        te.GroupedLinear(2, 16, 8),
        {"inp": _x(6, 16), "m_splits": None},
    ),
    "GroupedLinear_m_splits_sum": lambda: (
        te.GroupedLinear(2, 16, 8),
        {"inp": _x(6, 16), "m_splits": [2, 3]},
    ),
    "linear_weight_none": lambda: (F.linear, {"inp": _x(6, 16), "weight": None}),
    "layernorm_weight_none": lambda: (
        F.layernorm,
        {"inp": _x(6, 16), "weight": None, "bias": torch.zeros(16)},
    ),
    "linear_weight_meta": lambda: (
        F.linear,
        {"inp": _x(6, 16), "weight": _x(8, 16).to("meta")},
    ),
    "Linear_inp_meta": lambda: (te.Linear(16, 8), {"inp": _x(6, 16).to("meta")}),
    "grouped_linear_weight_meta": lambda: (
        F.grouped_linear,
        {"inp": _x(6, 16), "m_splits": [2, 4], "weight": _x(2, 8, 16).to("meta")},
    ),
}


@pytest.mark.parametrize("case", sorted(_COMPILED))
def test_the_same_message_at_trace_time(case):
    """Dynamo reports the exception a traced check raised inside its own (``Unsupported:
    Observed exception``), with the message: the message is what must be the same."""
    fn, kwargs = _COMPILED[case]()
    with pytest.raises((ValueError, TypeError)) as eager:
        fn(**kwargs)
    compiled = torch.compile(lambda kw: fn(**kw), backend="eager", fullgraph=True)
    with pytest.raises(Exception) as traced:
        compiled(kwargs)
    assert str(eager.value) in str(traced.value)


def test_the_same_extra_input_message_at_trace_time():
    seq = _residual_sequential(fuse=True)
    x, r = _x(6, 16), _x(3, 8)
    with pytest.raises(ValueError) as eager:
        seq(x, r)
    compiled = torch.compile(seq, backend="eager", fullgraph=True)
    with pytest.raises(Exception) as traced:
        compiled(x, r)
    assert str(eager.value) in str(traced.value)


def test_checks_passed_once_are_skipped_only_for_arguments_like_the_passed():
    """``_checks.passed_once`` keeps the keys of arguments that passed: the same shapes, dtypes,
    devices and values skip the check; a tensor of another dtype, ``1`` for ``True`` or a
    failing call run it (a failure raises every time)."""
    from te_compile._checks import passed_once

    calls = []

    @passed_once
    def check(args):
        calls.append(args)
        if args[1] is not True:
            raise ValueError("flag must be True")

    x = torch.zeros(2, 3)
    check((x, True, [x]))
    check((torch.ones(2, 3), True, [torch.ones(2, 3)]))  # other data, the same metadata
    assert len(calls) == 1
    check((x.double(), True, [x]))
    check((x, True, [x.double()]))
    assert len(calls) == 3
    for _ in range(2):
        with pytest.raises(ValueError, match="flag must be True"):
            check((x, 1, [x]))
    assert len(calls) == 5


def test_an_op_call_like_a_passed_one_but_for_a_dtype_is_refused():
    """The family ops' checks run once per kind of arguments (``check_mlp`` / ``check_linear``
    are ``passed_once``): after good calls, a bias of another dtype is still refused by name."""
    x, w1, w2 = (torch.randn(*s, dtype=torch.bfloat16) for s in ((4, 16), (32, 16), (8, 32)))
    b1, b2 = torch.zeros(32, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16)
    for _ in range(2):
        torch.ops.te.mlp_fwd(x, w1, b1, w2, b2, "act=gelu")
        torch.ops.te.linear_fwd(x, w1, b1, None)
    with pytest.raises(ValueError, match="fc2_bias must be"):
        torch.ops.te.mlp_fwd(x, w1, b1, w2, b2.float(), "act=gelu")
    with pytest.raises(ValueError, match=r"bias.dtype \(torch.float32\)"):
        torch.ops.te.linear_fwd(x, w1, b1.float(), None)
