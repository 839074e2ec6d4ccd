"""te::grouped_linear_fwd / te::grouped_linear_bwd: forward and backward against a float64 loop
of per-group linears, zero-size groups, many groups, main_grad accumulation, gradient subsets,
the grouped-GEMM (CUDA) path on CPU tensors, bad input, and compilation without recompiles."""

from __future__ import annotations

import importlib

import pytest
import torch

import te_compile.functional as tef
from tests.utils import (
    DEVICES,
    assert_close,
    compile_counted,
    make_reference_and_test_tensors,
    to_reference,
)

# ``te_compile.functional.grouped_linear`` is the public function; the modules hold the helpers.
GL = importlib.import_module("te_compile.functional.grouped_linear_ops")
GG = importlib.import_module("te_compile.functional.grouped_gemm")
# The backward op's rng_state and strings in high precision (no stream, "" specs, backward "").
_HP = (None, "", "", "", "")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ref_grouped_linear(x, splits, w, b):
    """float64 definition: group ``g`` of rows times ``w[g].T`` plus ``b[g]``."""
    outs = []
    for g, x_g in enumerate(x.split(list(splits))):
        y = x_g @ w[g].t()
        outs.append(y if b is None else y + b[g])
    return torch.cat(outs)


def cuda_adds_bias_after_rounding(device, bias):
    """On CUDA the bias is added to the GEMM's rounded output (grouped GEMM and per-group loop):
    one more rounding, relative to the GEMM output rather than to the sum, which can cancel."""
    return bias and device == "cuda"


def main_grad_dtype(device, dtype):
    """Accuracy of main_grad: fp32, except on the CUDA grouped-GEMM path (bf16, these shapes),
    where torch._grouped_mm rounds dW to bf16 before it is accumulated in fp32."""
    return dtype if device == "cuda" and dtype is torch.bfloat16 else torch.float32


def _as_kind(splits, kind, device):
    if kind == "list":
        return list(splits)
    if kind == "int64_cpu":
        return torch.tensor(splits, dtype=torch.int64)
    return torch.tensor(splits, dtype=torch.int32, device=device)


def _random_splits(num_groups, max_rows, generator):
    """Uneven splits, about a third of them zero."""
    splits = torch.randint(0, max_rows + 1, (num_groups,), generator=generator)
    splits[torch.rand(num_groups, generator=generator) < 0.3] = 0
    return splits.tolist()


def _check_against_reference(device, dtype, splits, bias, kind, in_features=24, out_features=16):
    num_groups = len(splits)
    x_ref, x = make_reference_and_test_tensors(
        (sum(splits), in_features), dtype=dtype, device=device
    )
    w_ref, w = make_reference_and_test_tensors(
        (num_groups, out_features, in_features), dtype=dtype, device=device
    )
    b_ref, b = make_reference_and_test_tensors(
        (num_groups, out_features), dtype=dtype, device=device
    )
    if not bias:
        b_ref = b = None
    y_ref = ref_grouped_linear(x_ref, splits, w_ref, b_ref)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype, device=device)
    y_ref.backward(dy_ref)

    y = tef.grouped_linear(x, _as_kind(splits, kind, device), w, b)
    y.backward(dy)
    assert y.shape == (sum(splits), out_features) and y.dtype == dtype
    extra = cuda_adds_bias_after_rounding(device, bias)
    assert_close(y, y_ref, dtype, roundings=1 + extra, reduced=extra)
    assert_close(x.grad, x_ref.grad, dtype)
    # Sums over the rows of a group: fp32 accumulation against float64 can cancel.
    assert_close(w.grad, w_ref.grad, dtype, reduced=True)
    if bias:
        assert_close(b.grad, b_ref.grad, dtype, reduced=True)
    # A group without rows has an exactly zero weight (and bias) gradient.
    for g, rows in enumerate(splits):
        if rows == 0:
            assert not w.grad[g].any() and (not bias or not b.grad[g].any())


# 1. Forward and backward against float64 -------------------------------------------------------

SPLITS = {
    "uneven": [5, 3, 9, 2],
    "first_empty": [0, 6, 3, 4],
    "middle_empty": [4, 0, 0, 7],
    "last_empty": [3, 8, 1, 0],
    "all_but_one_empty": [0, 0, 11, 0],
    "single_group": [13],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", SPLITS.values(), ids=SPLITS.keys())
@pytest.mark.parametrize("kind", ["list", "int64_cpu", "int32"])
def test_matches_reference(device, dtype, splits, kind):
    _check_against_reference(device, dtype, splits, bias=True, kind=kind)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_without_bias(device, dtype):
    _check_against_reference(device, dtype, [4, 0, 6], bias=False, kind="int64_cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_groups_uneven_splits(device, dtype):
    splits = _random_splits(256, 3, torch.Generator().manual_seed(1))
    assert 0 in splits and len(set(splits)) > 2
    _check_against_reference(
        device, dtype, splits, True, "int64_cpu", in_features=8, out_features=8
    )


@pytest.mark.parametrize("device", DEVICES)
def test_op_path_matches_fast_path(device):
    """The op path (dispatcher) and the eager fast path give identical results."""
    import te_compile as te

    splits = torch.tensor([3, 0, 5])
    x = torch.randn(8, 16, device=device, requires_grad=True)
    w = torch.randn(3, 8, 16, device=device, requires_grad=True)
    b = torch.randn(3, 8, device=device, requires_grad=True)
    results = []
    previous = te.eager_fast_path_enabled()
    try:
        for fast in (True, False):
            te.set_eager_fast_path(fast)
            y = tef.grouped_linear(x, splits, w, b)
            grads = torch.autograd.grad(y.square().sum(), (x, w, b))
            results.append((y, *grads))
    finally:
        te.set_eager_fast_path(previous)
    for a, e in zip(*results, strict=True):
        assert torch.equal(a, e)


# 2. main_grad and gradient subsets --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_main_grad_accumulates_in_fp32(device, dtype, compiled):
    splits = [3, 0, 6]
    x_ref, x = make_reference_and_test_tensors((9, 16), dtype=dtype, device=device)
    w_ref, w = make_reference_and_test_tensors((3, 8, 16), dtype=dtype, device=device)
    main_grad = torch.zeros(3, 8, 16, device=device, dtype=torch.float32)
    fn = lambda x, s, w, mg: tef.grouped_linear(x, s, w, main_grad=mg)  # noqa: E731
    if compiled:
        fn, _ = compile_counted(fn, backend="aot_eager")
    for _step in range(2):
        fn(x, torch.tensor(splits), w, main_grad).sum().backward()
    ref_grouped_linear(x_ref, splits, w_ref, None).sum().backward()
    assert w.grad is None, "with main_grad the weight gradient must not go to weight.grad"
    # Two accumulations of the same gradient, in fp32 from dtype operands: fp32-accurate (but
    # see main_grad_dtype).
    assert_close(main_grad, 2 * w_ref.grad, main_grad_dtype(device, dtype))
    assert not main_grad[1].any()
    assert_close(x.grad, 2 * x_ref.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", ["input", "weight", "bias", "input+weight", "weight+bias"])
def test_only_needed_gradients_are_computed(device, needs):
    splits = [2, 0, 3]
    x = torch.randn(5, 8, device=device, requires_grad="input" in needs)
    w = torch.randn(3, 4, 8, device=device, requires_grad="weight" in needs)
    b = torch.randn(3, 4, device=device, requires_grad="bias" in needs)
    tef.grouped_linear(x, splits, w, b).sum().backward()
    assert (x.grad is not None) == ("input" in needs)
    assert (w.grad is not None) == ("weight" in needs)
    assert (b.grad is not None) == ("bias" in needs)
    x_ref, w_ref, b_ref = (to_reference(t) for t in (x, w, b))
    ref_grouped_linear(x_ref, splits, w_ref, b_ref).sum().backward()
    for t, r in ((x, x_ref), (w, w_ref), (b, b_ref)):
        if t.grad is not None:
            assert_close(t.grad, r.grad, torch.float32, reduced=True)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_skips_gradients_not_needed(device):
    """A gradient not needed (or one that went into main_grad) is a 0-element tensor."""
    x, dy = torch.randn(5, 8, device=device), torch.randn(5, 4, device=device)
    w, splits = torch.randn(3, 4, 8, device=device), torch.tensor([2, 0, 3])

    def bwd(dy, x, splits, w, main_grad, has_bias, need_dgrad, need_wgrad):
        return torch.ops.te.grouped_linear_bwd(
            dy, [], x, splits, w, main_grad, None, None, *_HP, has_bias, need_dgrad, need_wgrad
        )

    dinp, dweight, dbias = bwd(dy, x, splits, w, None, False, False, True)
    assert dinp.numel() == 0 and dbias.numel() == 0 and dweight.shape == w.shape
    dinp, dweight, dbias = bwd(dy, x, splits, w, None, True, True, False)
    assert dinp.shape == x.shape and dweight.numel() == 0 and dbias.shape == (3, 4)
    main_grad = torch.zeros(3, 4, 8, device=device)
    _, dweight, _ = bwd(dy, x, splits, w, main_grad, False, False, True)
    assert dweight.numel() == 0 and main_grad.any()


# 3. The grouped-GEMM (CUDA) path, on CPU tensors ---------------------------------------------
#
# On CUDA, bf16 with in/out features multiples of 8 runs ``grouped_gemm.high_precision_forward`` /
# ``high_precision_backward`` (``cuda=True``) as
# ``torch._grouped_mm`` on device offsets, a ``repeat_interleave`` row bias and an ``index_add_``
# dbias, with no host sync. ``torch._grouped_mm`` also runs on CPU bf16 tensors, so calling these
# helpers (and the registered CUDA kernels) directly on CPU tensors checks that path's logic —
# offsets, transposes, zero-size groups, bias, main_grad — in CI without a GPU.

CUDA_PATH_SPLITS = {
    "uneven": [5, 3, 9, 2],
    "first_empty": [0, 6, 3, 4],
    "middle_empty": [4, 0, 0, 7],
    "last_empty": [3, 8, 1, 0],
    "all_but_one_empty": [0, 0, 11, 0],
    "single_group": [13],
}


def _cuda_path_case(splits, split_dtype, bias, in_features=24, out_features=16):
    bf16 = torch.bfloat16
    num_groups = len(splits)
    x_ref, x = make_reference_and_test_tensors((sum(splits), in_features), dtype=bf16)
    w_ref, w = make_reference_and_test_tensors((num_groups, out_features, in_features), dtype=bf16)
    b_ref, b = make_reference_and_test_tensors((num_groups, out_features), dtype=bf16)
    if not bias:
        b_ref = b = None
    y_ref = ref_grouped_linear(x_ref, splits, w_ref, b_ref)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=bf16)
    y_ref.backward(dy_ref)
    assert GG.uses_grouped_mm(x, w)
    args = (x.detach(), torch.tensor(splits, dtype=split_dtype), w.detach())
    return args, b, dy, (y_ref, x_ref, w_ref, b_ref)


@pytest.mark.parametrize("splits", CUDA_PATH_SPLITS.values(), ids=CUDA_PATH_SPLITS.keys())
def test_cpu_splits_reach_the_device_checked_on_the_host(splits):
    """CPU splits (a list's) give the device-offset GEMMs the sizes and their running sums (the
    ``offs`` of ``torch._grouped_mm``) in one copy, checked on the host: a bad sum or a negative
    size raises at once, naming the constraint, instead of a device-side assert later."""
    x = torch.empty(sum(splits), 8)
    sizes, offs = GG.device_splits(torch.tensor(splits), x)
    assert sizes.dtype is offs.dtype is torch.int32
    assert sizes.tolist() == splits and offs.tolist() == torch.tensor(splits).cumsum(0).tolist()
    for bad in ([*splits[:-1], splits[-1] + 1], [-1, *splits[1:-1], splits[-1] + 1 + splits[0]]):
        with pytest.raises(ValueError, match=r"m_splits must be >= 0 and sum to inp\.shape\[0\]"):
            GG.device_splits(torch.tensor(bad), x)


@pytest.mark.parametrize("splits", CUDA_PATH_SPLITS.values(), ids=CUDA_PATH_SPLITS.keys())
@pytest.mark.parametrize("split_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_path_helpers_match_reference_on_cpu(splits, split_dtype, bias):
    bf16 = torch.bfloat16
    (x, s, w), b, dy, (y_ref, x_ref, w_ref, b_ref) = _cuda_path_case(splits, split_dtype, bias)
    b = None if b is None else b.detach()
    y = GG.high_precision_forward(x, s, w, b, None, True)[0]
    assert y.shape == y_ref.shape and y.dtype == bf16
    # The bias is added to the bf16 GEMM output: two roundings, the first relative to the GEMM
    # output, not to the sum (which can cancel), hence ``reduced``.
    assert_close(y, y_ref, bf16, roundings=2 if bias else 1, reduced=bias)
    dinp, dweight, dbias = GG.high_precision_backward(
        dy, [], x, s, w, None, None, bias, True, True, cuda=True
    )
    assert_close(dinp, x_ref.grad, bf16)
    assert_close(dweight, w_ref.grad, bf16, reduced=True)
    if bias:
        assert_close(dbias, b_ref.grad, bf16, reduced=True)
    else:
        assert dbias.numel() == 0
    for g, rows in enumerate(splits):
        if rows == 0:
            assert not dweight[g].any() and (not bias or not dbias[g].any())


def test_cuda_path_many_groups_on_cpu():
    splits = _random_splits(256, 3, torch.Generator().manual_seed(2))
    (x, s, w), b, dy, (y_ref, x_ref, w_ref, b_ref) = _cuda_path_case(
        splits, torch.int64, True, 8, 8
    )
    bf16 = torch.bfloat16
    assert_close(
        GG.high_precision_forward(x, s, w, b.detach(), None, True)[0],
        y_ref,
        bf16,
        roundings=2,
        reduced=True,
    )
    dinp, dweight, dbias = GG.high_precision_backward(
        dy, [], x, s, w, None, None, True, True, True, cuda=True
    )
    assert_close(dinp, x_ref.grad, bf16)
    assert_close(dweight, w_ref.grad, bf16, reduced=True)
    assert_close(dbias, b_ref.grad, bf16, reduced=True)


def test_cuda_path_main_grad_and_gradient_subsets_on_cpu():
    (x, s, w), _b, dy, (_y, x_ref, w_ref, _b_ref) = _cuda_path_case(
        [4, 0, 7, 2], torch.int64, False
    )
    main_grad = torch.zeros(w.shape, dtype=torch.float32)
    for _step in range(2):
        dinp, dweight, dbias = GG.high_precision_backward(
            dy, [], x, s, w, main_grad, None, False, False, True, cuda=True
        )
        assert dinp.numel() == 0 and dweight.numel() == 0 and dbias.numel() == 0
    # torch._grouped_mm has no fp32 output: dW is rounded to bf16 once, then accumulated in fp32.
    _, dweight, _ = GG.high_precision_backward(
        dy, [], x, s, w, None, None, False, False, True, cuda=True
    )
    assert torch.equal(main_grad, 2 * dweight.float())
    assert_close(main_grad / 2, w_ref.grad, torch.bfloat16, reduced=True)
    dinp, dweight, dbias = GG.high_precision_backward(
        dy, [], x, s, w, None, None, False, True, False, cuda=True
    )
    assert dweight.numel() == 0 and dbias.numel() == 0
    assert_close(dinp, x_ref.grad, torch.bfloat16)


@pytest.mark.parametrize(
    "dtype, features",
    [(torch.bfloat16, 16), (torch.bfloat16, 12), (torch.float32, 16), (torch.float64, 16)],
    ids=["grouped_mm", "bf16_unaligned_loop", "fp32_loop", "fp64_loop"],
)
def test_registered_cuda_kernels_on_cpu(dtype, features):
    """The CUDA kernels' dispatch (grouped GEMM, or the per-group loop for other dtypes/shapes)
    called directly on CPU tensors."""
    splits = [3, 0, 6, 2]
    x_ref, x = make_reference_and_test_tensors((11, features), dtype=dtype)
    w_ref, w = make_reference_and_test_tensors((4, 8, features), dtype=dtype)
    b_ref, b = make_reference_and_test_tensors((4, 8), dtype=dtype)
    y_ref = ref_grouped_linear(x_ref, splits, w_ref, b_ref)
    dy_ref, dy = make_reference_and_test_tensors(y_ref.shape, dtype=dtype)
    y_ref.backward(dy_ref)
    s = torch.tensor(splits)
    x, w, b = x.detach(), w.detach(), b.detach()
    y, _saved = GL._grouped_linear_fwd_cuda(x, s, w, b, None)
    assert_close(y, y_ref, dtype, roundings=2, reduced=True)
    dinp, dweight, dbias = GL._grouped_linear_bwd_cuda(
        dy, [], x, s, w, None, None, None, *_HP, True, True, True
    )
    assert_close(dinp, x_ref.grad, dtype, roundings=2)
    assert_close(dweight, w_ref.grad, dtype, roundings=2, reduced=True)
    assert_close(dbias, b_ref.grad, dtype, roundings=2, reduced=True)


# 4. Bad input ----------------------------------------------------------------------------------


def _args(**override):
    args = {
        "x": torch.randn(10, 16),
        "s": torch.tensor([3, 0, 7]),
        "w": torch.randn(3, 8, 16),
        "b": torch.randn(3, 8),
        "mg": None,
    }
    args.update(override)
    return args


BAD_INPUTS = [
    # (id, arguments, message fragment)
    ("weight_rank", lambda: _args(w=torch.randn(8, 16)), "weight must be 3-D"),
    ("in_features", lambda: _args(w=torch.randn(3, 8, 15)), "must equal in_features"),
    ("num_gemms", lambda: _args(s=torch.tensor([3, 7])), "m_splits has 2 groups but weight"),
    ("splits_float", lambda: _args(s=torch.tensor([3.0, 0.0, 7.0])), "m_splits must be a 1-D"),
    ("splits_2d", lambda: _args(s=torch.tensor([[3, 0, 7]])), "m_splits must be a 1-D"),
    ("bias_shape", lambda: _args(b=torch.randn(3, 7)), "bias must have shape"),
    ("bias_dtype", lambda: _args(b=torch.randn(3, 8).half()), "bias.dtype"),
    ("dtype_mix", lambda: _args(w=torch.randn(3, 8, 16).half()), "must equal weight.dtype"),
    ("inp_rank", lambda: _args(x=torch.randn(2, 5, 16)), "inp must be 2-D"),
    ("main_grad", lambda: _args(mg=torch.zeros(3, 8, 16).half()), "main_grad must be float32"),
    ("list_float", lambda: _args(s=[3, 0.0, 7]), "m_splits must be a list of ints"),
    ("list_bool", lambda: _args(s=[3, True, 6]), "m_splits must be a list of ints"),
    # Values, not shapes: checked on the host for CPU tensors (on CUDA: a device assert).
    ("splits_sum", lambda: _args(s=torch.tensor([3, 0, 6])), "sum to inp.shape[0] (10)"),
    ("splits_negative", lambda: _args(s=torch.tensor([3, -1, 8])), "m_splits must be >= 0"),
    ("list_sum", lambda: _args(s=[3, 0, 8]), "sum to inp.shape[0] (10)"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
@pytest.mark.parametrize("mode", ["fast", "op", "compiled"])
def test_bad_input_raises_clear_error(case, mode):
    import te_compile as te

    _id, make, message = case
    a = make()
    a["x"].requires_grad_()

    def call(x, s, w, b, mg):
        return tef.grouped_linear(x, s, w, b, main_grad=mg)

    previous = te.eager_fast_path_enabled()
    te.set_eager_fast_path(mode == "fast")
    fn = compile_counted(call, backend="aot_eager")[0] if mode == "compiled" else call
    try:
        with pytest.raises(Exception) as info:
            fn(a["x"], a["s"], a["w"], a["b"], a["mg"])
    finally:
        te.set_eager_fast_path(previous)
    assert "te.grouped_linear: " in str(info.value)
    assert message in str(info.value)
    if mode == "compiled":
        # Raised at trace time (the fake, or the list conversion) or, for split values on the
        # CPU, at run time; dynamo wraps a trace-time error, naming the ValueError.
        assert info.type is ValueError or "ValueError" in str(info.value)
    else:
        assert info.type is ValueError


@pytest.mark.parametrize("switch", ["fp8_wgrad", "save_original_input", "return_amax"])
def test_switches_must_be_bools(switch):
    a = _args(w=torch.randn(3, 16, 16), b=torch.randn(3, 16))  # FP8 GEMMs: multiples of 16
    kw = {"input_spec": "current:e4m3", "weight_spec": "current:e4m3",
          "grad_spec": "current:e5m2", switch: "yes"}  # fmt: skip
    with pytest.raises(ValueError, match=rf"te\.grouped_linear: {switch} must be a bool"):
        tef.grouped_linear(a["x"], a["s"], a["w"], a["b"], **kw)


# 5. Compilation --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_changing_splits_do_not_recompile(device):
    """A tensor m_splits is a value: new splits (and, with dynamic shapes, new row counts) reuse
    the graph, and the compiled function equals eager."""

    def fn(x, s, w, b):
        return tef.grouped_linear(x, s, w, b)

    compiled, counter = compile_counted(fn, dynamic=True)
    w = torch.randn(4, 8, 16, device=device, requires_grad=True)
    b = torch.randn(4, 8, device=device, requires_grad=True)
    for splits in ([3, 0, 7, 2], [0, 12, 0, 0], [5, 5, 1, 1], [2, 9, 0, 6]):
        x = torch.randn(sum(splits), 16, device=device, requires_grad=True)
        s = torch.tensor(splits, device=device)
        outs = []
        for f in (compiled, fn):
            y = f(x, s, w, b)
            outs.append((y, *torch.autograd.grad(y.square().sum(), (x, w, b))))
        for c, e in zip(*outs, strict=True):
            assert_close(c, e.double(), torch.float32)
        assert counter.frame_count == 1


@pytest.mark.parametrize("kind", ["grouped_mm", "scaled_grouped_mm"])
def test_grouped_gemm_entries_refuse_a_bias(kind):
    """The grouped GEMM entries take no bias (the family adds each group's by rows): one given
    is refused, not dropped."""
    G = importlib.import_module("te_compile.functional.gemm")
    a, b = torch.zeros(16, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 16, dtype=torch.bfloat16)
    offs = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped GEMM entries take no bias"):
        G.gemm(kind, a, torch.ones(16), b, torch.ones(2, 16), torch.bfloat16,
               bias=torch.zeros(2, 16), offs=offs)  # fmt: skip
