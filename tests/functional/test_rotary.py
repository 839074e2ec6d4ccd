"""Rotary position embeddings (``te.RotaryPositionEmbedding``, ``te.apply_rotary_pos_emb``,
``te::rotary_fwd/_bwd``) against a float64 reference written independently here: complex
multiplication of channel pairs by :math:`e^{i\\theta}`, sequence by sequence, with the
context-parallel chunks of ``freqs`` sliced as Transformer Engine's unfused path slices them.
All three formats, both layouts, partial rotary, uneven packed sequences, ``cp_size=2``,
gradients (and ``gradcheck`` with frequencies that differ within a pair), the frequency table,
compile with zero graph breaks and no recompile for new sizes, bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import te_compile as te
from te_compile.functional.rotary import rotary_frequencies
from tests.utils import (
    DEVICES,
    assert_close,
    assert_matches_eager,
    compile_counted,
    make_reference_and_test_tensors,
)

HEADS, HEAD_DIM = 3, 16
SEQ, BATCH = 6, 2
# Global cu_seqlens of the packed (thd) cases: uneven lengths; with cp_size=2 each length is a
# multiple of 2 * cp_size, and every rank holds half of each sequence.
CU_SEQLENS = {1: [0, 3, 8, 9, 15], 2: [0, 4, 12, 16, 28]}


# The reference ---------------------------------------------------------------------------------


def _cp_slice(freqs: torch.Tensor, n: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The rows of ``freqs`` a rank's ``n`` local positions stand for: the first ``n``, or with
    context parallelism two chunks of ``n / 2`` (chunks ``r`` and ``2 c - 1 - r`` of ``2 c``)."""
    if cp_size == 1:
        return freqs[:n]
    seg, full = n // 2, n * cp_size
    first = freqs[cp_rank * seg : (cp_rank + 1) * seg]
    return torch.cat([first, freqs[full - (cp_rank + 1) * seg : full - cp_rank * seg]])


def _rope_complex(x: torch.Tensor, angles: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x [s, ..., d]`` with its first ``2 * angles.shape[-1]`` channels taken as complex pairs
    (``x_2i + i x_2i+1`` interleaved, ``x_i + i x_i+h`` otherwise) times ``exp(i angle)``;
    ``angles [s, n]`` broadcast over the middle dims."""
    n = angles.shape[-1]
    rot, rest = x[..., : 2 * n], x[..., 2 * n :]
    if interleaved:
        pairs = rot.unflatten(-1, (n, 2))
    else:
        pairs = torch.stack((rot[..., :n], rot[..., n:]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())
    phase = torch.polar(torch.ones_like(angles), angles).view(
        angles.shape[0], *([1] * (x.dim() - 2)), n
    )
    out = torch.view_as_real(z * phase)
    out = out.flatten(-2) if interleaved else torch.cat((out[..., 0], out[..., 1]), dim=-1)
    return torch.cat((out, rest), dim=-1)


def reference(t, freqs, tensor_format, interleaved, cu_seqlens=None, cp_size=1, cp_rank=0):
    """float64 RoPE of ``t`` for ``freqs`` laid out as ``rotary_frequencies`` lays it out."""
    table = freqs.reshape(freqs.shape[0], -1).double()
    angles = table[:, 0::2] if interleaved else table[:, : table.shape[1] // 2]
    if tensor_format == "thd":
        bounds = [b // cp_size for b in cu_seqlens.tolist()]
        pieces = [
            _rope_complex(t[a:b], _cp_slice(angles, b - a, cp_size, cp_rank), interleaved)
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat([*pieces, t[bounds[-1] :]])  # tokens after the last sequence: as is
    if tensor_format == "bshd":
        t = t.transpose(0, 1)
    out = _rope_complex(t, _cp_slice(angles, t.shape[0], cp_size, cp_rank), interleaved)
    return out.transpose(0, 1) if tensor_format == "bshd" else out


def _inputs(tensor_format, cp_size, dtype, device, d=HEAD_DIM):
    """``(t_ref, t, cu_seqlens, max positions)`` for a case."""
    if tensor_format == "thd":
        cu = torch.tensor(CU_SEQLENS[cp_size], dtype=torch.int32, device=device)
        shape, positions = (CU_SEQLENS[cp_size][-1] // cp_size, HEADS, d), 12
    else:
        cu = None
        s_b = (SEQ, BATCH) if tensor_format == "sbhd" else (BATCH, SEQ)
        shape, positions = (*s_b, HEADS, d), SEQ * cp_size
    t_ref, t = make_reference_and_test_tensors(shape, dtype=dtype, device=device)
    return t_ref, t, cu, positions


# Numerics and gradients ------------------------------------------------------------------------

CP = [(1, 0), (2, 0), (2, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("cp", CP, ids=[f"cp{s}r{r}" for s, r in CP])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_forward_and_backward_match_float64_reference(
    tensor_format, interleaved, rotary_percent, cp, fused, dtype, device
):
    cp_size, cp_rank = cp
    t_ref, t, cu, positions = _inputs(tensor_format, cp_size, dtype, device)
    rope = te.RotaryPositionEmbedding(HEAD_DIM, rotary_percent, interleaved=interleaved)
    freqs = rope(positions)
    kw = {"cu_seqlens": cu, "cp_size": cp_size, "cp_rank": cp_rank}
    out = te.apply_rotary_pos_emb(
        t, freqs.to(device), tensor_format, interleaved=interleaved, fused=fused, **kw
    )
    expected = reference(t_ref, freqs, tensor_format, interleaved, **kw)
    assert out.dtype == dtype and out.shape == t.shape
    assert_close(out, expected, dtype)
    grad = torch.randn_like(expected).to(dtype)
    out.backward(grad.to(device))
    expected.backward(grad.double())
    assert_close(t.grad, t_ref.grad, dtype)


def _random_freqs(rows, d2, device="cpu"):
    """Frequencies that differ within every pair: the op's general per-channel rule."""
    return (torch.randn(rows, 1, 1, d2, dtype=torch.float64) * 3).to(device)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize(
    ("tensor_format", "shape", "cu", "cp"),
    [
        ("sbhd", (4, 2, 2, 6), None, (1, 0)),
        ("bshd", (2, 4, 2, 6), None, (2, 1)),
        ("thd", (7, 2, 6), [0, 2, 2, 7], (1, 0)),
        ("thd", (6, 2, 6), [0, 4, 12], (2, 1)),
    ],
)
def test_gradcheck_with_per_channel_frequencies(tensor_format, shape, cu, cp, interleaved):
    """The backward op is the exact transpose of the forward for any ``freqs`` (each channel's
    partner uses its own angle), an empty sequence included."""
    t = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    freqs = _random_freqs(8, 4)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)

    def f(x):
        return te.apply_rotary_pos_emb(
            x, freqs, tensor_format, interleaved=interleaved, cu_seqlens=cu_seqlens,
            cp_size=cp[0], cp_rank=cp[1],
        )  # fmt: skip

    assert torch.autograd.gradcheck(f, (t,))


def test_a_rotation_preserves_each_pair_norm_and_inverts():
    """RoPE by theta then its backward (the rotation by -theta) gives the input back."""
    t = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, dtype=torch.float64)
    freqs = te.RotaryPositionEmbedding(HEAD_DIM)(SEQ).double()
    y = te.apply_rotary_pos_emb(t, freqs)
    assert_close(y.norm(dim=-1), t.norm(dim=-1), torch.float64)
    back = torch.ops.te.rotary_bwd(y, freqs, None, "sbhd", False, 1, 0)
    assert_close(back, t, torch.float64)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_tokens_outside_every_sequence_pass_through(fused):
    t = torch.randn(10, HEADS, HEAD_DIM)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = te.apply_rotary_pos_emb(
        t, te.RotaryPositionEmbedding(HEAD_DIM)(8), "thd", fused=fused, cu_seqlens=cu
    )
    assert torch.equal(out[7:], t[7:])
    assert not torch.equal(out[1:7], t[1:7])  # position 0 of each sequence is unrotated
    assert torch.equal(out[[0, 3]], t[[0, 3]])


def test_freqs_get_a_gradient_only_unfused():
    """As in Transformer Engine: the fused op gives ``freqs`` no gradient; the plain-torch path
    differentiates it."""
    t = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, dtype=torch.float64)
    for fused in (True, False):
        freqs = _random_freqs(SEQ, HEAD_DIM).requires_grad_()
        te.apply_rotary_pos_emb(t, freqs, fused=fused).sum().backward()
        assert (freqs.grad is None) == fused


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_leaves_dtypes_alone(device):
    """No autocast rule: the op runs in ``t``'s dtype, like Transformer Engine's RoPE."""
    t = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, device=device)
    rope = te.RotaryPositionEmbedding(HEAD_DIM, device=device)
    expected = te.apply_rotary_pos_emb(t, rope(SEQ))
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        freqs = rope(SEQ)  # no GEMM inside that autocast would run in bf16
        out = te.apply_rotary_pos_emb(t, freqs)
    assert freqs.dtype == out.dtype == torch.float32
    assert torch.equal(out, expected)


# The frequency table ---------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True])
def test_frequencies_follow_transformer_engine(interleaved):
    dim, base, offset = 12, 500.0, 3
    freqs = te.RotaryPositionEmbedding(dim, rotary_base=base, interleaved=interleaved)(5, offset)
    assert freqs.shape == (5, 1, 1, dim) and freqs.dtype == torch.float32
    theta = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(5, dtype=torch.float64) + offset, theta)
    layout = angles.repeat_interleave(2, -1) if interleaved else torch.cat((angles, angles), -1)
    assert_close(freqs.reshape(5, dim), layout, torch.float32)


def test_rotary_percent_sets_the_rotary_dim():
    rope = te.RotaryPositionEmbedding(64, rotary_percent=0.25)
    assert rope(4).shape == (4, 1, 1, 16)
    assert_close(rope.inv_freq, 10000.0 ** (-torch.arange(0, 16, 2).double() / 16), torch.float32)


def test_position_interpolation_needs_both_arguments():
    """Fixed scaling by the factor up to ``pretrained * factor`` positions, dynamic scaling
    beyond; the factor alone scales nothing (Transformer Engine's rule)."""
    plain = te.RotaryPositionEmbedding(8)
    scaled = te.RotaryPositionEmbedding(
        8, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=8
    )
    assert_close(scaled(10), plain(10) / 2, torch.float32)
    assert_close(scaled(20), plain(20) * (8 / 20), torch.float32)
    alone = te.RotaryPositionEmbedding(8, seq_len_interpolation_factor=2)
    assert torch.equal(alone(10), plain(10))


def test_inv_freq_is_in_the_state_dict():
    rope = te.RotaryPositionEmbedding(8)
    assert list(rope.state_dict()) == ["inv_freq"]


def _llama3_inv_freq_ref(dim, base, factor, low, high, original):
    """Llama 3's rule per frequency, in float64, by wavelength (as Meta's reference states it):
    shorter than ``original / high`` kept, longer than ``original / low`` divided by ``factor``,
    between them a blend linear in ``original / wavelength``. Also returns which branch each
    frequency took."""
    out, branches = [], []
    for i in range(0, dim, 2):
        freq = base ** (-i / dim)
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(freq)
            branches.append("kept")
        elif wavelength > original / low:
            out.append(freq / factor)
            branches.append("divided")
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
            branches.append("blended")
    return torch.tensor(out, dtype=torch.float64), branches


@pytest.mark.parametrize(
    ("dim", "base", "factor", "low", "high", "original"),
    [
        (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1 / 3.2 / 3.3
        (16, 10000.0, 8.0, 1.0, 4.0, 32),  # tests/test_convert.py's small model
        (96, 20000.0, 3.0, 2.0, 5.0, 1000),
    ],
)
def test_llama3_scaling_matches_an_independent_reference(dim, base, factor, low, high, original):
    scaling = te.RopeScaling("llama3", factor, low, high, original)
    rope = te.RotaryPositionEmbedding(dim, rotary_base=base, rope_scaling=scaling)
    expected, branches = _llama3_inv_freq_ref(dim, base, factor, low, high, original)
    assert set(branches) == {"kept", "divided", "blended"}  # every branch is checked
    # Relative error per frequency: they span seven decades (Llama 3.1's slowest is 3e-7, below
    # assert_close's absolute tolerance). fp32's power (of a rounded exponent) and the blend
    # measure up to a third of one rounding's tolerance; two keep a margin.
    ratio = rope.inv_freq.double() / expected
    assert_close(ratio, torch.ones_like(ratio), torch.float32, roundings=2)
    assert list(rope.state_dict()) == ["inv_freq"]


def test_linear_scaling_divides_the_frequencies():
    plain = te.RotaryPositionEmbedding(16)
    scaled = te.RotaryPositionEmbedding(16, rope_scaling=te.RopeScaling("linear", 4.0))
    assert torch.equal(scaled.inv_freq, plain.inv_freq / 4.0)
    assert_close(scaled(40), plain(40).double() / 4, torch.float32)


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "low_freq_factor is a"),
        ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor must be a positive float"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192},
            "high_freq_factor must be greater than low_freq_factor",
        ),
        ({**_YARN, "beta_fast": -1.0}, "beta_fast must be a positive"),
        ({**_YARN, "low_freq_factor": 1.0}, "low_freq_factor is a field of rope_type='llama3'"),
        ({**_YARN, "truncate": 1}, "truncate must be a bool or None, got 1"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "beta_slow": 2.0}, "beta_slow is a field of "
         "rope_type='yarn'"),
    ],
)  # fmt: skip
def test_rope_scaling_refuses_inconsistent_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        te.RopeScaling(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 0}, "dim must be a positive int, got 0"),
        ({"dim": 8, "rotary_percent": 0.0}, r"rotary_percent must be a float in \(0, 1\]"),
        ({"dim": 8, "rotary_percent": 1.5}, r"rotary_percent must be a float in \(0, 1\]"),
        (
            {"dim": 10, "rotary_percent": 0.5},
            r"int\(dim \* rotary_percent\) must be an even number >= 2.*got 5",
        ),
        ({"dim": 8, "seq_len_interpolation_factor": -1}, "seq_len_interpolation_factor must"),
        ({"dim": 8, "pretrained_max_position_embeddings": 2.5}, "pretrained_max_position_emb"),
        ({"dim": 8, "rotary_base": 0}, "rotary_base must be a positive number"),
        ({"dim": 8, "interleaved": 1}, "interleaved must be a bool"),
    ],
)
def test_module_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match="RotaryPositionEmbedding: " + match):
        te.RotaryPositionEmbedding(**kwargs)


# torch.compile -----------------------------------------------------------------------------------


def _te_calls(code: str) -> set[str]:
    return {line for line in code.splitlines() if "torch.ops.te." in line}


# Each layout compiles its own graphs (20 s on CI's CPU): sbhd-half and bshd-interleaved cover
# both formats and both rotation styles; the other two are long_compile (their eager math is
# checked above).


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("tensor_format", "interleaved"),
    [
        pytest.param("sbhd", False, id="sbhd-half"),
        pytest.param("sbhd", True, id="sbhd-interleaved", marks=pytest.mark.long_compile),
        pytest.param("bshd", False, id="bshd-half", marks=pytest.mark.long_compile),
        pytest.param("bshd", True, id="bshd-interleaved"),
    ],
)
def test_compiled_has_no_break_and_no_recompile(tensor_format, interleaved, device):
    """One frame for every sequence length and batch size (``dynamic=True``), the frequency
    table made inside the compiled region; Inductor traces into the op (no te op is called
    through the dispatcher); results and gradients as eager."""
    rope = te.RotaryPositionEmbedding(HEAD_DIM, 0.5, interleaved=interleaved, device=device)

    def step(q):
        s = q.shape[0] if tensor_format == "sbhd" else q.shape[1]
        return te.apply_rotary_pos_emb(q, rope(s), tensor_format, interleaved=interleaved)

    compiled, counter = compile_counted(step, dynamic=True)
    for s, b in ((8, 2), (5, 3), (11, 4)):
        shape = (s, b, HEADS, HEAD_DIM) if tensor_format == "sbhd" else (b, s, HEADS, HEAD_DIM)
        q = torch.randn(*shape, device=device, requires_grad=True)
        q_eager = q.detach().clone().requires_grad_()
        out, codes = run_and_get_code(lambda q=q: compiled(q))
        assert all(not _te_calls(code) for code in codes)
        expected = step(q_eager)
        assert_matches_eager(out, expected)
        grad = torch.randn_like(out)
        out.backward(grad)
        expected.backward(grad)
        assert_matches_eager(q.grad, q_eager.grad)
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_thd_has_no_recompile_for_new_packings(device):
    """Packed sequences: new token counts and sequence counts reuse the graph; positions come
    from ``cu_seqlens`` on the device (no host read)."""
    freqs = te.RotaryPositionEmbedding(HEAD_DIM, device=device)(16)

    def step(q, cu):
        return te.apply_rotary_pos_emb(q, freqs, "thd", cu_seqlens=cu)

    compiled, counter = compile_counted(step, dynamic=True)
    for cu in ([0, 5, 9, 12], [0, 2, 9, 10, 14], [0, 16, 20, 21, 22, 23]):
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        q = torch.randn(cu[-1], HEADS, HEAD_DIM, device=device, requires_grad=True)
        q_eager = q.detach().clone().requires_grad_()
        out = compiled(q, cu_seqlens)
        expected = step(q_eager, cu_seqlens)
        assert_matches_eager(out, expected)
        out.sum().backward()
        expected.sum().backward()
        assert_matches_eager(q.grad, q_eager.grad)
    assert counter.frame_count == 1


# Bad input ---------------------------------------------------------------------------------------


def _bad_cases():
    t4 = torch.randn(4, 2, 2, 8)
    t3 = torch.randn(6, 2, 8)
    f = rotary_frequencies(torch.tensor([1.0, 0.1]), 8)  # [8, 1, 1, 4]
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return [
        ((t4, f), {"tensor_format": "hsbd"}, "tensor_format must be one of"),
        ((t4.int(), f), {}, "t.dtype must be float32"),
        ((t4, f.int()), {}, "freqs.dtype must be a floating type"),
        ((t3, f), {}, "t must be 4-D"),
        ((t4, f), {"tensor_format": "thd"}, "t must be 3-D"),
        ((t4, f.reshape(8, 4)), {}, r"freqs must be \[s2, 1, 1, d2\]"),
        ((t4, torch.randn(8, 1, 1, 10)), {}, r"freqs.shape\[-1\] \(the rotary dim, 10\) must be"),
        ((t4, torch.randn(8, 1, 1, 3)), {}, r"freqs.shape\[-1\] \(the rotary dim, 3\) must be"),
        ((t4, f[:3]), {}, "freqs has 3 positions, fewer than the sequence length 4"),
        ((t4, f[:6]), {"cp_size": 2, "cp_rank": 1}, "fewer than the sequence length 4 times"),
        ((t4[:3], f), {"cp_size": 2}, "local sequence length must be even, got 3"),
        ((t4, f), {"cp_size": 2, "cp_rank": 2}, r"cp_rank must be in \[0, cp_size\)"),
        ((t4, f), {"cp_size": 0}, "cp_size must be >= 1, got 0"),
        ((t4, f), {"cp_size": 2.0}, "cp_size must be an int"),
        ((t3, f), {"tensor_format": "thd"}, "cu_seqlens is required for tensor_format='thd'"),
        ((t3, f), {"tensor_format": "thd", "cu_seqlens": cu.float()}, "cu_seqlens must be an int"),
        ((t3, f), {"tensor_format": "thd", "cu_seqlens": cu[:1]}, r"tensor \[n \+ 1\] \(n >= 1\)"),
        ((t4, f), {"cu_seqlens": cu}, "cu_seqlens is only for tensor_format='thd'"),
        ((t4, f), {"start_positions": cu[:2]}, "start_positions must be None"),
    ]


BAD = _bad_cases()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize(("args", "kwargs", "match"), BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_name_the_argument_eager_and_compiled(args, kwargs, match, fused):
    kwargs = {**kwargs, "fused": fused}
    with pytest.raises(ValueError, match="te.apply_rotary_pos_emb: .*" + match):
        te.apply_rotary_pos_emb(*args, **kwargs)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=match):
        torch.compile(lambda a, b: te.apply_rotary_pos_emb(a, b, **kwargs), fullgraph=True)(*args)


@pytest.mark.parametrize(
    ("cu", "cp_size", "match"),
    [
        ([0, 4, 2, 6], 1, r"cu_seqlens must be non-decreasing from 0, got \[0, 4, 2, 6\]"),
        ([0, 4, 9], 1, r"cu_seqlens\[-1\] // cp_size \(9\) exceeds the 6 tokens of t"),
        ([0, 4, 10], 2, r"multiple of 2 \* cp_size, got \[4, 6\]"),
        ([0, 6], 1, "freqs has 4 positions, fewer than the longest sequence in cu_seqlens"),
    ],
)
def test_cu_seqlens_values_are_checked_eagerly_on_the_cpu(cu, cp_size, match):
    """Checks that read ``cu_seqlens`` run where that costs no device sync: CPU eager."""
    t = torch.randn(6, 2, 8)
    freqs = torch.randn(4, 1, 1, 4)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        te.apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu_seqlens, cp_size=cp_size)


def test_op_checks_its_arguments():
    with pytest.raises(ValueError, match="tensor_format must be one of"):
        torch.ops.te.rotary_fwd(
            torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4), None, "x", False, 1, 0
        )


def test_positional_arguments_in_transformer_engines_order():
    """TE's fourth positional argument is ``start_positions`` (None here), then
    ``interleaved``, ``fused``: TE code that passes them positionally means the same here."""
    t = torch.randn(SEQ, 2, 3, 8)
    freqs = te.RotaryPositionEmbedding(8, interleaved=True)(SEQ)
    by_keyword = te.apply_rotary_pos_emb(t, freqs, "sbhd", interleaved=True, fused=False)
    assert torch.equal(te.apply_rotary_pos_emb(t, freqs, "sbhd", None, True, False), by_keyword)
