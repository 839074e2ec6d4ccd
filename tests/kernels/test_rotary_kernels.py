"""The rotary Triton kernel (``te_compile.kernels.rotary``) against the CPU implementation of
``te_compile.functional.rotary`` run in float64: forward and backward, every format and layout,
partial rotary, context parallelism, packed sequences with an empty one and tokens after the
last, positions past ``freqs``, strided inputs, fp32 / bf16 / fp16, and small launch tiles that
give programs several row, head and channel chunks. Run on CUDA, or on CPU tensors with
``TRITON_INTERPRET=1``."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch

from tests.utils import TRITON_DEVICE, assert_close, requires_triton

kernels = pytest.importorskip("te_compile.kernels.rotary")
ref = importlib.import_module("te_compile.functional.rotary")

pytestmark = [pytest.mark.triton, requires_triton]

SMALL = kernels.RotaryLaunchConfig(block_t=2, block_h=2, block_p=2, block_c=4, num_warps=4)
# Heads walked as a loop of unrolled groups: 4 heads a program, 2 at a time (3 heads: the second
# group is half masked).
LOOPED = kernels.RotaryLaunchConfig(2, 4, 2, 4, num_warps=4, head_unroll=2)
HEADS, HEAD_DIM = 3, 12


def _run_and_compare(t, freqs, cu, tensor_format, interleaved, cp, backward, config):
    out = kernels.rotary(
        t.to(TRITON_DEVICE),
        freqs.to(TRITON_DEVICE),
        None if cu is None else cu.to(TRITON_DEVICE),
        tensor_format,
        interleaved,
        *cp,
        backward=backward,
        config=config,
    )
    expected = ref.rotary_ref(
        t.double(), freqs, cu, tensor_format, interleaved, *cp, backward=backward
    )
    assert out.dtype == t.dtype and out.shape == t.shape and out.is_contiguous()
    assert_close(out, expected, t.dtype)


def _input(tensor_format, cp_size, dtype):
    if tensor_format == "thd":
        cu = torch.tensor([0, 4, 4, 12, 20] if cp_size == 2 else [0, 3, 3, 8, 9], dtype=torch.int32)
        return torch.randn(12, HEADS, HEAD_DIM).to(dtype), cu  # tokens after the last sequence
    shape = (5 if cp_size == 1 else 6, 2, HEADS, HEAD_DIM)
    t = torch.randn(*shape).to(dtype)
    return (t if tensor_format == "sbhd" else t.transpose(0, 1).contiguous()), None


# Every format x layout x rotated width x context-parallel split x direction, each in one of
# the three dtypes: the dtype is the sum of the other choices' indices mod 3, so that each dtype
# meets every value of every other argument (the dtype only changes the loads and stores; the
# full product, 144 cases, was a quarter of the interpreter pass's time).
_AXES = (
    ("sbhd", "bshd", "thd"), (False, True), (HEAD_DIM, 8), ((1, 0), (2, 1)), (False, True)
)  # fmt: skip
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CASES = [
    (*values, _DTYPES[sum(idx) % 3])
    for idx in itertools.product(*(range(len(a)) for a in _AXES))
    for values in [tuple(a[i] for a, i in zip(_AXES, idx, strict=True))]
]


@pytest.mark.parametrize(
    ("tensor_format", "interleaved", "d2", "cp", "backward", "dtype"),
    _CASES,
    ids=[
        f"{f}-{'interleaved' if i else 'half'}-{'full' if d == HEAD_DIM else 'partial'}"
        f"-cp{c[0]}-{'bwd' if b else 'fwd'}-{str(t).split('.')[-1]}"
        for f, i, d, c, b, t in _CASES
    ],
)
def test_matches_the_cpu_implementation(tensor_format, interleaved, d2, cp, backward, dtype):
    t, cu = _input(tensor_format, cp[0], dtype)
    freqs = torch.randn(12, 1, 1, d2) * 4  # pair members differ: the general per-channel rule
    _run_and_compare(t, freqs, cu, tensor_format, interleaved, cp, backward, SMALL)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("tensor_format", ["sbhd", "thd"])
def test_heads_in_a_loop_of_unrolled_groups(tensor_format, interleaved, backward):
    t, cu = _input(tensor_format, 1, torch.bfloat16)
    freqs = torch.randn(12, 1, 1, 8) * 4  # partial: pass-through programs walk the heads too
    _run_and_compare(t, freqs, cu, tensor_format, interleaved, (1, 0), backward, LOOPED)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_default_launch_config(interleaved):
    t = torch.randn(7, 3, 5, 64).to(torch.bfloat16)
    _run_and_compare(t, torch.randn(7, 1, 1, 48), None, "sbhd", interleaved, (1, 0), False, None)


def test_strided_input_and_freqs():
    """A query sliced out of a fused QKV tensor (heads strided), a freqs view with a row
    stride: no copy of the input, the same result."""
    qkv = torch.randn(6, 2, 3 * HEADS, HEAD_DIM)
    q = qkv[:, :, HEADS : 2 * HEADS]
    freqs = torch.randn(8, 1, 1, 2 * HEAD_DIM)[..., :HEAD_DIM]
    for backward in (False, True):
        _run_and_compare(q, freqs, None, "sbhd", False, (1, 0), backward, SMALL)


def test_positions_past_freqs_are_unrotated():
    """thd: a sequence longer than ``freqs`` (a case only CPU eager can reject) reads angle 0
    past the last row, as the CPU implementation does."""
    t = torch.randn(9, HEADS, HEAD_DIM)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    freqs = torch.randn(5, 1, 1, HEAD_DIM)
    _run_and_compare(t, freqs, cu, "thd", True, (1, 0), False, SMALL)
    args = (x.to(TRITON_DEVICE) for x in (t, freqs, cu))
    out = kernels.rotary(*args, "thd", True, 1, 0, config=SMALL)
    assert torch.equal(out[5:].cpu(), t[5:])


@pytest.mark.parametrize("n_seqs", [1, 2, 3, 7, 8, 9])
def test_binary_search_finds_every_sequence(n_seqs):
    """Sequence counts around powers of two: each token finds its sequence."""
    lengths = torch.randint(0, 4, (n_seqs,))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    t = torch.randn(int(cu[-1]) + 2, HEADS, HEAD_DIM)
    _run_and_compare(t, torch.randn(4, 1, 1, 4), cu, "thd", False, (1, 0), False, SMALL)


def test_launch_config_tiles_are_powers_of_two_and_bounded():
    for heads, pairs, passthrough in itertools.product(
        (1, 3, 8, 32, 128), (1, 32, 64, 96), (0, 64)
    ):
        cfg = kernels.launch_config(heads, pairs, passthrough)
        for size in (cfg.block_t, cfg.block_h, cfg.block_p, cfg.block_c):
            assert size >= 1 and size & (size - 1) == 0
        assert cfg.block_t * cfg.block_p * 2 <= 4096  # one head step's tile
        assert cfg.block_h <= min(max(heads, 1) * 2, 8) and cfg.block_p <= 64


def test_a_head_group_reaching_past_the_program_is_refused():
    t = torch.randn(4, 2, HEADS, HEAD_DIM)
    bad = kernels.RotaryLaunchConfig(2, 6, 2, 4, num_warps=4, head_unroll=4)
    with pytest.raises(ValueError, match=r"block_h \(6\) must be a multiple of head_unroll"):
        kernels.rotary(t.to(TRITON_DEVICE), torch.randn(8, 1, 1, HEAD_DIM).to(TRITON_DEVICE),
                       None, "sbhd", False, 1, 0, config=bad)  # fmt: skip
