"""te::bulk_allocate (csrc/bulk_allocate.cpp) and its wrapper te_compile.functional.allocate:
layout (alignment, no overlap, one allocation), lifetime, bad input, opcheck, torch.compile."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from te_compile.functional.allocate import bulk_allocate
from tests.samples.allocate import bulk_allocate_samples
from tests.utils import DEVICES, compile_counted, count_graph_breaks

OP = torch.ops.te.bulk_allocate.default

SHAPES = [(3, 5), (7,), (0, 4), (2, 3, 4), (), (1,), (33,)]
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.int64,
    torch.float16,
    torch.float64,
    torch.uint8,
    torch.int32,
]
ALIGNMENTS = [256, 1, 16, 1024, 2, 4096, 8]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _byte_ranges(tensors):
    return sorted((t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in tensors if t.numel())


def _count_allocations(fn, device: str) -> int:
    """Number of allocations of a non-zero size that ``fn()`` makes on ``device``."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        keep = fn()
        after = torch.cuda.memory_stats()["allocation.all.allocated"]
        del keep
        return after - before
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        keep = fn()
    del keep
    return sum(1 for e in prof.events() if e.name == "aten::empty" and e.cpu_memory_usage > 0)


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_dtypes_and_device(device):
    out = bulk_allocate(SHAPES, DTYPES, device=device, alignments=ALIGNMENTS)
    assert isinstance(out, list) and len(out) == len(SHAPES)
    for t, shape, dtype in zip(out, SHAPES, DTYPES, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.device.type == device
        assert t.is_contiguous() and not t.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_alignment(device):
    out = bulk_allocate(SHAPES, DTYPES, device=device, alignments=ALIGNMENTS)
    for t, alignment in zip(out, ALIGNMENTS, strict=True):
        if t.numel():
            assert t.data_ptr() % max(alignment, t.element_size()) == 0, (t.shape, alignment)
    # Default: 256 bytes each, also for odd sizes that would leave the next one unaligned.
    for t in bulk_allocate(
        [(3,), (5,), (1,)], [torch.uint8, torch.bfloat16, torch.float64], device
    ):
        assert t.data_ptr() % 256 == 0


@pytest.mark.parametrize("device", DEVICES)
def test_no_overlap_and_one_allocation(device):
    def make():
        return bulk_allocate(SHAPES, DTYPES, device=device, alignments=ALIGNMENTS)

    out = make()
    ranges = _byte_ranges(out)
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end <= start
    # All tensors lie in one span no larger than their bytes plus alignment padding ...
    span = ranges[-1][1] - ranges[0][0]
    assert span <= sum(_nbytes(t) + a for t, a in zip(out, ALIGNMENTS, strict=True))
    # ... which is one allocation (the zero-element tensor allocates nothing).
    assert _count_allocations(make, device) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_do_not_alias(device):
    """What the schema tells the compiler: separate storages, offset 0, nothing shared."""
    out = bulk_allocate(SHAPES, DTYPES, device=device)
    storages = {t.untyped_storage()._cdata for t in out if t.numel()}
    assert len(storages) == sum(1 for t in out if t.numel())
    for t in out:
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == _nbytes(t)


@pytest.mark.parametrize("device", DEVICES)
def test_writes_stay_in_their_tensor(device):
    out = bulk_allocate(SHAPES, DTYPES, device=device, alignments=ALIGNMENTS)
    for t in out:
        t.fill_(0)
    for i, t in enumerate(out):
        t.fill_(i + 1)
        for j, other in enumerate(out):
            expected = torch.full_like(other, j + 1 if j <= i else 0)
            assert torch.equal(other, expected), (i, j)


@pytest.mark.parametrize("device", DEVICES)
def test_buffer_outlives_all_but_one_tensor(device):
    out = bulk_allocate([(64,), (128,), (32,)], [torch.float32] * 3, device=device)
    kept = out[1]
    del out
    gc.collect()
    churn = [torch.full((128,), 7.0, device=device) for _ in range(16)]  # reuse freed memory
    kept.copy_(torch.arange(128, dtype=torch.float32, device=device))
    del churn
    gc.collect()
    assert torch.equal(kept.cpu(), torch.arange(128, dtype=torch.float32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine")
def test_buffer_freed_with_last_tensor_cuda():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = bulk_allocate([(1000,), (3000,)], [torch.float32, torch.bfloat16], device="cuda")
    assert torch.cuda.memory_allocated() > before
    first = out[0]
    del out
    assert torch.cuda.memory_allocated() > before
    del first
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("device", DEVICES)
def test_zero_element_tensors(device):
    out = bulk_allocate(
        [(0,), (4, 0), (0, 0, 3)], [torch.float32, torch.int8, torch.bfloat16], device
    )
    assert [t.shape for t in out] == [(0,), (4, 0), (0, 0, 3)]
    assert all(t.numel() == 0 and t.device.type == device for t in out)
    assert bulk_allocate([], [], device) == []
    mixed = bulk_allocate([(0,), (6,), (0, 2)], [torch.float32] * 3, device)
    mixed[1].fill_(3.0)
    assert torch.equal(mixed[1].cpu(), torch.full((6,), 3.0))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_fill(device):
    # Dirty the allocator's free memory first so that zeros are not there by chance.
    bulk_allocate([(4096,)], [torch.uint8], device)[0].fill_(255)
    out = bulk_allocate(SHAPES, DTYPES, device=device, alignments=ALIGNMENTS, zero=True)
    for t in out:
        assert torch.equal(t, torch.zeros_like(t))


def test_default_device_follows_torch_default():
    assert bulk_allocate([(2,)], [torch.float32])[0].device == torch.get_default_device()
    with torch.device("meta"):
        (t,) = bulk_allocate([(2, 3)], [torch.float16])
    assert t.device.type == "meta" and t.shape == (2, 3) and t.dtype == torch.float16


def test_all_dtypes_by_name():
    """Every non-quantized torch dtype reaches the C++ op by name and comes back."""
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    dtypes = sorted((d for d in dtypes if not str(d).startswith("torch.q")), key=str)
    out = bulk_allocate([(3,)] * len(dtypes), dtypes, "cpu", alignments=[1] * len(dtypes))
    assert [t.dtype for t in out] == dtypes


BAD_INPUTS = [
    # (kwargs, argument named in the message, fragment of the message)
    ({"shapes": [(2,), (3,)], "dtypes": [torch.float32]}, "dtypes", "len(shapes)=2, len(dtypes)=1"),
    (
        {"shapes": [(2,)], "dtypes": [torch.float32], "alignments": [16, 16]},
        "alignments",
        "len(alignments)=2",
    ),
    ({"shapes": [(2,)], "dtypes": [torch.float32], "alignments": [3]}, "alignments[0]", "got 3"),
    (
        {"shapes": [(2,)] * 2, "dtypes": [torch.float32] * 2, "alignments": [4, 0]},
        "alignments[1]",
        "got 0",
    ),
    ({"shapes": [(2,)], "dtypes": [torch.float32], "alignments": [-8]}, "alignments[0]", "got -8"),
    ({"shapes": [(2,)], "dtypes": [torch.float32], "alignments": [16.0]}, "alignments[0]", "16.0"),
    ({"shapes": [(2,), (3, -1)], "dtypes": [torch.float32] * 2}, "shapes[1]", "non-negative"),
    ({"shapes": [(2,)], "dtypes": ["float32"]}, "dtypes[0]", "got str 'float32'"),
    ({"shapes": [(2,), (2,)], "dtypes": [torch.int8, None]}, "dtypes[1]", "got NoneType"),
    ({"shapes": [4], "dtypes": [torch.float32]}, "shapes[0]", "(4,)"),
    ({"shapes": [(1,), None], "dtypes": [torch.float32] * 2}, "shapes[1]", "sequence of ints"),
    ({"shapes": [(2.0, 3)], "dtypes": [torch.float32]}, "shapes[0]", "(2.0, 3)"),
]


@pytest.mark.parametrize(("kwargs", "argument", "fragment"), BAD_INPUTS)
def test_bad_input_raises_value_error(kwargs, argument, fragment):
    with pytest.raises(ValueError, match="bulk_allocate") as info:
        bulk_allocate(device="cpu", **kwargs)
    assert argument in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize(("kwargs", "argument", "fragment"), BAD_INPUTS[2:4])
def test_bad_input_under_compile(kwargs, argument, fragment):
    """Under compile: ValueError with a graph break allowed; fullgraph=True makes Dynamo wrap
    it, keeping the message."""

    def fn(x):
        return bulk_allocate(device=x.device, **kwargs)[0]

    x = torch.zeros(1)
    with pytest.raises(ValueError) as info:
        torch.compile(fn, backend="eager")(x)
    assert argument in str(info.value) and fragment in str(info.value)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="bulk_allocate") as info:
        torch.compile(fn, backend="eager", fullgraph=True)(x)
    assert argument in str(info.value) and fragment in str(info.value)


OP_BAD_INPUTS = [
    (([2], [1], ["float32"], "cpu", [16, 16]), "lengths 1, 1 and 2"),
    (([2, 3], [1], ["float32"], "cpu", [16]), "ranks sum to 1 but dims has 2 entries"),
    (([2], [1], ["floaty"], "cpu", [16]), 'dtypes[0] = "floaty" is not a dtype name'),
    (([2], [1], ["float32"], "cpu", [24]), "alignments[0] must be a positive power of two"),
    (([2, -3], [1, 1], ["float32", "int8"], "cpu", [16, 16]), "tensor 1 has negative dimension -3"),
]


@pytest.mark.parametrize(("args", "fragment"), OP_BAD_INPUTS)
def test_op_bad_input_same_error_real_and_fake(args, fragment):
    """The C++ kernel and the fake impl check the same things with the same messages."""
    args = (*args[:3], torch.device(args[3]), args[4])
    with pytest.raises(ValueError, match="te::bulk_allocate") as real:
        OP(*args)
    with FakeTensorMode(), pytest.raises(ValueError, match="te::bulk_allocate") as fake:
        OP(*args)
    assert fragment in str(real.value) and fragment in str(fake.value)


def test_fake_impl_allocates_nothing():
    with FakeTensorMode():
        out = bulk_allocate([(1 << 20, 1 << 20), (0,)], [torch.float32, torch.int8], "cpu")
    assert all(isinstance(t, FakeTensor) for t in out)
    assert out[0].shape == (1 << 20, 1 << 20) and out[1].shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_samples(device):
    samples = bulk_allocate_samples(torch.device(device))
    assert samples
    for sample in samples:
        torch.library.opcheck(OP, sample.args, sample.kwargs)
        # Uninitialised outputs: every check but the by-value comparison of eager and compiled.
        torch.library.opcheck(
            OP,
            sample.args,
            {"zero": False},
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )


def _fill_and_compute(x: torch.Tensor, y: torch.Tensor):
    a, b, c, d = bulk_allocate(
        [x.shape, (x.shape[0],), (0, 3), (5,)],
        [x.dtype, torch.bfloat16, torch.int64, torch.int32],
        device=x.device,
        alignments=[256, 16, 1, 1024],
    )
    a.copy_(x * 2)
    b.copy_(x.sum(dim=1))
    d.fill_(7)
    return a + y, b * 3, c, d.cumsum(0)


def _fill_default_device(x: torch.Tensor):
    (a,) = bulk_allocate([x.shape], [x.dtype])
    a.copy_(x)
    return a * 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_matches_eager(device, dynamic):
    compiled, counter = compile_counted(_fill_and_compute, dynamic=dynamic)
    for rows in (4, 6):
        # Small integers: every result is exact, so eager and fused kernels agree bit for bit.
        x = torch.randint(-8, 8, (rows, 8), device=device).float()
        y = torch.randint(-8, 8, (8,), device=device).float()
        for got, want in zip(compiled(x, y), _fill_and_compute(x, y), strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert torch.equal(got, want)
    assert counter.frame_count == (1 if dynamic else 2)
    assert count_graph_breaks(_fill_and_compute, x, y) == (1, 0)


def test_compile_default_device():
    x = torch.randn(3, 4)
    compiled, counter = compile_counted(_fill_default_device)
    assert torch.equal(compiled(x), x * 2)
    assert counter.frame_count == 1
    assert count_graph_breaks(_fill_default_device, x) == (1, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_backward_through_bulk_tensors(device):
    def fn(x):
        (a,) = bulk_allocate([x.shape], [x.dtype], device=x.device)
        a.copy_(x * 3)
        return (a * a).sum()

    x = torch.randn(5, 3, device=device, requires_grad=True)
    compiled, _ = compile_counted(fn)
    compiled(x).backward()
    assert torch.allclose(x.grad, 18 * x.detach())
