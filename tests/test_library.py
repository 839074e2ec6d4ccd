"""The op mechanism: the eager fast path and the op path run the same implementation and agree
bitwise, and the op path is taken whenever something may be watching."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import te_compile as te
from te_compile import _library
from tests.samples import SAMPLES
from tests.utils import DEVICES

DIFFERENTIABLE = {
    n: e.differentiable
    for n, e in _library.registry().items()
    if e.differentiable and e.differentiable.fwd.qualname == n
}


def _clone(args):
    return tree_map(
        lambda x: (
            x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
        ),
        args,
    )


def _run(dop, args, fast: bool):
    previous = te.eager_fast_path_enabled()
    te.set_eager_fast_path(fast)
    try:
        args = _clone(args)
        out = dop(*args)
        first = out[0] if isinstance(out, tuple) else out
        first.backward(torch.ones_like(first))
        grads = [a.grad if isinstance(a, torch.Tensor) else None for a in args]
        mutated = [a for a in args if isinstance(a, torch.Tensor) and not a.requires_grad]
        return out, grads, mutated
    finally:
        te.set_eager_fast_path(previous)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_fast_path_and_op_path_agree_bitwise(name, device):
    dop = DIFFERENTIABLE[name]
    for sample in SAMPLES[name](torch.device(device)):
        fast = _run(dop, sample.args, fast=True)
        slow = _run(dop, sample.args, fast=False)
        flat_fast = torch.utils._pytree.tree_leaves(fast)
        flat_slow = torch.utils._pytree.tree_leaves(slow)
        assert len(flat_fast) == len(flat_slow)
        for a, b in zip(flat_fast, flat_slow, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b)
            else:
                assert a == b


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _linear_args():
    return torch.randn(2, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)


def test_dispatch_mode_forces_op_path():
    x, w = _linear_args()
    with _Count() as mode:
        te.functional.linear(x, w).sum().backward()
    assert "te.linear_fwd.default" in mode.seen and "te.linear_bwd.default" in mode.seen


def test_profiler_sees_ops_by_name():
    x, w = _linear_args()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        te.functional.linear(x, w).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"te::linear_fwd", "te::linear_bwd"} <= names


def test_fast_path_autograd_nodes():
    """Fast path without main_grad: native autograd only (no Python node); with main_grad: the
    op's own autograd.Function; op path: the custom op's autograd node."""
    x, w = _linear_args()
    assert _library._use_fast_path()
    assert type(te.functional.linear(x, w).grad_fn).__name__ == "MmBackward0"  # no bias
    y = te.functional.linear(x, w, main_grad=torch.zeros(3, 4))
    assert type(y.grad_fn).__name__ == "te_linear_fwdBackward"
    te.set_eager_fast_path(False)
    try:
        assert not _library._use_fast_path()
        node = type(te.functional.linear(x, w).grad_fn).__name__
        assert node not in ("MmBackward0", "te_linear_fwdBackward")
    finally:
        te.set_eager_fast_path(True)


def test_checkpoint_recomputes_through_fast_path():
    x, w = _linear_args()
    y = torch.utils.checkpoint.checkpoint(
        lambda x: te.functional.linear(x, w).relu(), x, use_reentrant=False
    )
    y.sum().backward()
    expected_w = w.detach().clone().requires_grad_()
    xe = x.detach().clone().requires_grad_()
    (xe @ expected_w.t()).relu().sum().backward()
    torch.testing.assert_close(x.grad, xe.grad)
    torch.testing.assert_close(w.grad, expected_w.grad)


def test_list_ops_names():
    names = te.list_ops()
    assert "te::linear_fwd" in names and "te::linear_bwd" in names
    assert names == sorted(names)


GEMM_FAMILIES = ("linear", "mlp", "grouped_linear")


def test_op_schemas_stay_readable():
    """A person calling ``torch.ops.te.*`` reads the schema: at most 24 arguments per op, 20
    per GEMM family op (the recipe travels as one spec string per operand role,
    docs/op_mechanism.md)."""
    widths = {}
    for name in te.list_ops():
        overload = getattr(torch.ops.te, name.removeprefix("te::")).default
        widths[name] = len(overload._schema.arguments)
    assert len(widths) > 30
    too_wide = {n: w for n, w in widths.items() if w > 24}
    gemm = [f"te::{f}_{d}" for f in GEMM_FAMILIES for d in ("fwd", "bwd")]
    too_wide |= {n: widths[n] for n in gemm if widths[n] > 20}
    assert not too_wide, too_wide


def test_explained_training_step_sees_no_more_graphs_than_plain_pytorch():
    """A step that calls ``loss.backward()`` breaks the graph there; the eager backward that
    follows runs our ops' Python backward, which dynamo must not trace as graphs of its own
    (it does not see an aten op's C++ backward either)."""
    torch.manual_seed(0)

    def counts(model: torch.nn.Module) -> tuple[int, int]:
        x = torch.randn(8, 2, 64, requires_grad=True)

        def step(x):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            return loss

        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(x)
        return explained.graph_count, explained.graph_break_count

    plain = counts(torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)))
    assert counts(te.LayerNormLinear(64, 64)) == plain
    assert counts(te.TransformerLayer(64, 128, 4, params_dtype=torch.float32)) == plain


def test_runs_triton_keeps_no_tensor_alive():
    """``kernels.runs_triton`` (the functional ops' device choice) answers per call and keeps
    no reference: a cache keyed on tensors would hold them, and their memory, alive."""
    import gc
    import weakref

    from te_compile.kernels import runs_triton

    t = torch.zeros(3)
    alive = weakref.ref(t)
    assert not runs_triton(t) and not runs_triton(torch.zeros(1, dtype=torch.float64))
    del t
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("recipe", [None, "Float8CurrentScaling"])
def test_eager_backward_makes_no_zero_gradients_for_saved_outputs(recipe):
    """An op returns the tensors its backward keeps (FP8 copies among them) as outputs marked
    non-differentiable; autograd must not fill a zero gradient for each of them every backward
    (an allocation and a kernel each, read by no one)."""
    m = te.LayerNormMLP(64, 64, params_dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    r = None if recipe is None else getattr(te.recipe, recipe)()
    with warnings.catch_warnings(), te.autocast(enabled=r is not None, recipe=r):
        warnings.filterwarnings("ignore", message=".*emulated")  # (CPU: said once a process)
        loss = m(x).float().sum()  # the fast path: no mode is watching the forward
    with _Count() as mode:
        loss.backward()
    assert "te.mlp_bwd.default" not in mode.seen  # the eager backward, not the op path's
    assert "aten.zeros.default" not in mode.seen, mode.seen
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_an_unused_differentiable_output_gets_a_zero_gradient():
    """Of ``linear(..., return_branch=True)``'s two differentiable outputs only the branch (the
    input) is used: the op's backward gets zeros for the other, as autograd would give, and both
    paths agree bitwise."""
    torch.manual_seed(0)
    inp, weight = torch.randn(4, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    grads = []
    for fast in (True, False):
        te.set_eager_fast_path(fast)
        try:
            x, w = inp.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
            _out, branch = te.functional.linear(x, w, return_branch=True)
            (branch * torch.arange(16.0)).sum().backward()
            grads.append((x.grad, w.grad))
        finally:
            te.set_eager_fast_path(True)
    (gx, gw), (sx, sw) = grads
    assert torch.equal(gx, torch.arange(16.0).expand(4, 16))  # the branch is the input
    assert torch.equal(gw, torch.zeros(8, 16))
    assert torch.equal(gx, sx) and torch.equal(gw, sw)


def _plain_op_samples(name, device):
    return [sample.args for sample in SAMPLES[f"te::{name}"](torch.device(device))]


@pytest.mark.parametrize("device", DEVICES)
def test_plain_op_fast_path_agrees_with_the_op_and_versions_what_it_writes(device):
    """A non-differentiable op called eagerly runs its implementation without the dispatcher
    (``Op.__call__``): outputs and the buffers it writes equal the op path's bit for bit, and a
    written buffer, passed by position or by name, gets a new version, as the dispatcher's call
    gives it (on CUDA a Triton kernel writes it, which no version counter sees)."""
    from te_compile.functional.fp8_scaling import delayed_scaling_update_op as op

    names = [a.name for a in op.overload._schema.arguments]
    for args in _plain_op_samples("delayed_scaling_update", device):
        results = []
        for fast, by_name in ((True, False), (True, True), (False, False)):
            te.set_eager_fast_path(fast)
            try:
                mine = _clone(args)
                versions = [t._version for t in mine[:2]]
                out = op(**dict(zip(names, mine, strict=False))) if by_name else op(*mine)
                assert all(t._version > v for t, v in zip(mine[:2], versions, strict=True))
                results.append([out, *mine[:2]])
            finally:
                te.set_eager_fast_path(True)
        for other in results[1:]:
            for a, b in zip(results[0], other, strict=True):
                assert torch.equal(a, b)


def test_bump_written_versions_the_written_arguments_by_position_and_by_name():
    """The fast path's version bump (a Triton write bumps no counter) finds each written
    argument wherever the call put it, and only those."""
    from te_compile.functional.fp8_scaling import delayed_scaling_update_op as op

    h, s, a = torch.zeros(4, 3), torch.ones(3), torch.zeros(3)
    calls = [
        ((h, s, a), {}),
        ((h,), {"scale": s, "amax": a}),
        ((), {"amax_history": h, "scale": s}),
    ]
    for args, kwargs in calls:
        before = [t._version for t in (h, s, a)]
        op._bump_written(args, kwargs)
        assert [t._version - v for t, v in zip((h, s, a), before, strict=True)] == [1, 1, 0]


def _overload(qualname):
    namespace, name = qualname.split("::")
    return getattr(getattr(torch.ops, namespace), name).default


def test_every_op_that_writes_an_argument_versions_it_on_the_dispatcher_path():
    """A ``Library``-defined op gets no version bump for what it writes (``custom_op`` registers
    one): every te op with a written argument has its ADInplaceOrView kernel, so a write by a
    Triton kernel, which no version counter sees, still makes a new version (the CUDA case of
    the test above runs it)."""
    writers = [
        name
        for name in te.list_ops()
        if any(
            a.alias_info is not None and a.alias_info.is_write
            for a in _overload(name)._schema.arguments
        )
    ]
    assert "te::delayed_scaling_update" in writers
    for name in writers:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "ADInplaceOrView"), name


def test_plain_op_takes_the_op_path_where_autograd_or_a_mode_watches(monkeypatch):
    from te_compile.functional.quantize import quantize_current as op

    calls = []
    overload = op.overload
    monkeypatch.setattr(op, "overload", lambda *a, **k: calls.append(1) or overload(*a, **k))
    x = torch.randn(4, 8)
    op(x, torch.float8_e4m3fn, True)
    assert calls == []  # eager, nothing watching: the implementation directly
    op(x.requires_grad_(), torch.float8_e4m3fn, True)
    assert calls == [1]  # an input that requires grad: the op (it has no autograd formula)
    with torch.no_grad():
        op(x, torch.float8_e4m3fn, True)
    assert calls == [1]
    with torch.enable_grad():  # in a list argument too
        assert not _library.plain_fast_path([1, [torch.ones(1), x]])
    with _Count() as mode:
        op(x.detach(), torch.float8_e4m3fn, True)
    assert calls == [1, 1] and "te.quantize_current.default" in mode.seen
    # A tensor subclass (an asynchronous collective's result, a DTensor): the dispatcher, which
    # waits for or unwraps it; a parameter is a plain tensor.
    op(x.detach().as_subclass(_Subclass), torch.float8_e4m3fn, True)
    assert calls == [1, 1, 1]
    assert not _library.plain_fast_path([1, [torch.ones(1).as_subclass(_Subclass)]])
    op(torch.nn.Parameter(x.detach(), requires_grad=False), torch.float8_e4m3fn, True)
    assert calls == [1, 1, 1]


class _Subclass(torch.Tensor):
    """A tensor subclass (stands for an asynchronous collective's result)."""
