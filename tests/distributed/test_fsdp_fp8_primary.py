"""FSDP2 (``fully_shard``) of modules with FP8 primary weights (``te.quantized_model_init``) on
two ranks (gloo on CPU; NCCL on two GPUs where present), against the same model unsharded in
one process.

The parameters that are not FP8 (biases, norms) are fp32 here: FSDP2's own reduction of bf16
gradients on gloo differs from one process by a bf16 rounding (seen on a bias), which is
FSDP2's business, not the FP8 weights' (tests/distributed/test_fsdp.py compares within
roundings). The compiled case compiles each module with ``fullgraph=True`` (one graph each)
with the ``aot_eager`` backend, so AOTAutograd traces the backward and its reduce-scatter.
Delayed scaling and the compiled case run with ``--long-runs`` (CI time); they accumulate the
gradients of two micro-batches per step.

After each backward, every FP8 weight's fp32 ``main_grad`` is this rank's shard (the local
shard's shape), already reduce-scattered (equal to the unsharded ``main_grad``'s rows), and no
weight-sized fp32 tensor is kept on the module.

Every rank trains on the same batches, so FSDP2's mean of the ranks' gradients is exact (x/2 +
x/2 = x) and the sharded run must equal the unsharded one bit for bit: losses, the fp32
masters, the FP8 codes and their scales after each refresh (the amax all-reduced over the
group before the cast), the other parameters. Any difference is a sharding bug, not rounding.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import te_compile as te
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    autocast,
)
from tests.distributed.harness import (
    BACKENDS,
    WORLD,
    assert_passed,
    device_for,
    fsdp_mesh,
    run_checks,
    spawn_checks,
)
from tests.utils import assert_close_quantized

H, BATCH, STEPS = 32, 16, 3
E4M3 = torch.float8_e4m3fn
FP8_NAMES = ("0.weight", "1.fc1_weight", "1.fc2_weight")


def _model(device, recipe, seed=0):
    torch.manual_seed(seed)
    kw = {"params_dtype": torch.float32, "device": device}
    with te.quantized_model_init(recipe=recipe):
        return torch.nn.Sequential(te.Linear(H, 2 * H, **kw), te.LayerNormMLP(2 * H, 3 * H, **kw))


def _shard(model, compiled=None, **kw):
    kw.setdefault("mesh", fsdp_mesh(next(model.parameters()).device))
    for block in model:
        if compiled is not None:
            block.compile(fullgraph=True, backend=compiled)
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _batches(device):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, H, generator=g).to(device) for _ in range(STEPS)]


def _train(model, recipe, batches, micro=1, after_backward=None):
    """``micro`` backward calls per optimizer step (gradient accumulation: each batch split
    into ``micro`` micro-batches); ``after_backward(model, step)`` before each step."""
    masters = te.FP8MasterWeights(model)
    opt = torch.optim.SGD([*masters.parameters(), *masters.other_parameters()], lr=20.0)
    losses = []
    for step, batch in enumerate(batches):
        loss = 0.0
        for x in batch.chunk(micro):
            with autocast(recipe=recipe):
                part = model(x).float().square().mean() / micro
            part.backward()
            loss += part.detach()
        if after_backward is not None:
            after_backward(model, step)
        masters.step(opt)
        opt.zero_grad()
        losses.append(loss)
    return torch.stack(losses), masters


def _record_main_grads(rank, seen):
    """``after_backward`` of the unsharded model: this rank's rows of each fp32 main_grad
    (FSDP2's chunks: ``ceil(rows / world)`` rows per rank)."""

    def record(model, step):
        for name in FP8_NAMES:
            full = model.get_parameter(name).main_grad
            seen[step, name] = full.chunk(WORLD)[rank].clone()

    return record


def _check_sharded_main_grads(expected):
    """``after_backward`` of the sharded model: each FP8 weight's fp32 main_grad is this
    rank's shard (the local shard's shape), already reduce-scattered (equal to the unsharded
    main_grad's rows), and no weight-sized fp32 tensor is kept on the module."""

    def check(model, step):
        for name in FP8_NAMES:
            module_name, weight_name = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            param = model.get_parameter(name)
            main_grad = te.quantization.primary.primary_main_grad(module, weight_name)
            assert main_grad.dtype == torch.float32, name
            assert main_grad.shape == param.to_local().shape, (name, main_grad.shape)
            assert torch.equal(main_grad, expected[step, name]), name
            kept = [t for t in _tensors(vars(module)) if t.dtype == torch.float32]
            assert all(t.numel() < param.numel() for t in kept), (
                name,
                [t.shape for t in kept if t.numel() >= param.numel()],
            )

    return check


def _tensors(value):
    """Every tensor reachable from ``value`` (containers, a tensor's ``.grad`` and
    attributes)."""
    if isinstance(value, torch.Tensor):
        yield value
        if value.grad is not None:
            yield value.grad
        for v in vars(value).values():
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def _full(t, group):
    """The whole tensor of a DTensor shard (FP8 codes gathered as bytes: gloo has no float8;
    FSDP2's last shards may be short: padded to ``ceil(rows / world)`` rows for the gather)."""
    if not isinstance(t, DTensor):
        return t
    local = t.to_local()
    if local.dtype != E4M3:
        return t.full_tensor()
    rows = -(-t.shape[0] // WORLD)
    padded = local.view(torch.uint8).new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]] = local.view(torch.uint8)
    return funcol.wait_tensor(funcol.all_gather_tensor(padded, 0, group))[: t.shape[0]]


def _bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def _assert_same_state(model, reference, group):
    state = model.state_dict()
    for name, expected in reference.state_dict().items():
        got = _full(state[name], group)
        assert torch.equal(_bits(got), _bits(expected)), (
            f"{name} differs",
            (got.float() - expected.float()).abs().max(),
            expected.abs().max(),
        )


def _train_matches_unsharded(rank, group, device, recipe, compiled, micro=1):
    batches = _batches(device)
    reference = _model(device, recipe)
    main_grads = {}
    ref_losses, ref_masters = _train(
        reference, recipe, batches, micro, _record_main_grads(rank, main_grads)
    )

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager") if compiled else None
    model = _shard(_model(device, recipe), compiled=counter)
    for name in FP8_NAMES:  # the sharded weight: this rank's rows of the FP8 codes
        p = model.get_parameter(name)
        assert isinstance(p, DTensor) and p.dtype == E4M3, name
        rows = torch.empty(p.shape, device="meta").chunk(WORLD)[rank].shape  # FSDP2's chunks
        assert p.to_local().shape == rows, name
    seen = {}  # the weights the forward gets: the all-gathered FP8 codes, whole

    def record(module, _args):
        for n in ("weight", "fc1_weight", "fc2_weight"):
            if hasattr(module, n):
                w = getattr(module, n)
                seen[n] = (isinstance(w, DTensor), w.dtype, tuple(w.shape))

    for block in model:
        block.register_forward_pre_hook(record)
    losses, masters = _train(model, recipe, batches, micro, _check_sharded_main_grads(main_grads))

    assert seen == {"weight": (False, E4M3, (2 * H, H)),
                    "fc1_weight": (False, E4M3, (3 * H, 2 * H)),
                    "fc2_weight": (False, E4M3, (2 * H, 3 * H))}, seen  # fmt: skip
    assert torch.equal(losses, ref_losses), (losses, ref_losses)
    assert losses[-1] < losses[0], losses
    _assert_same_state(model, reference, group)
    for master, expected in zip(masters.parameters(), ref_masters.parameters(), strict=True):
        assert isinstance(master, DTensor)
        assert torch.equal(master.full_tensor(), expected)
    if compiled:
        assert counter.frame_count == 2, f"one graph per module, got {counter.frame_count}"


def _checkpoint_round_trip(rank, group, device):
    """DCP saves the sharded FP8 codes (DTensors) and the replicated scales; a fresh sharded
    model loads them and computes the same outputs."""
    recipe = Float8CurrentScaling()
    model = _shard(_model(device, recipe))
    _train(model, recipe, _batches(device))
    paths = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(paths, group=group)
    path = os.path.join(paths[0], "ckpt")
    dcp.save(model.state_dict(), checkpoint_id=path)
    fresh = _shard(_model(device, recipe, seed=1)).requires_grad_(False)  # inference only
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    x = torch.randn(BATCH, H, generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad(), autocast(recipe=recipe):
        assert torch.equal(fresh(x), model(x))
    _assert_same_state(fresh, _unsharded_copy(model, device, recipe, group), group)


def _unsharded_copy(model, device, recipe, group):
    copy = _model(device, recipe, seed=2)
    state = {k: _full(v, group) for k, v in model.state_dict().items()}
    copy.load_state_dict({k: v.view(E4M3) if k in FP8_NAMES else v for k, v in state.items()})
    return copy


def _cast_weights_refused(rank, group, device):
    recipe = Float8CurrentScaling()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard(_model(device, recipe), mp_policy=mp)
    te.FP8MasterWeights(model)
    with autocast(recipe=recipe):
        try:
            model(_batches(device)[0])
        except ValueError as err:
            assert "arrived as torch.bfloat16" in str(err) and "param_dtype=None" in str(err)
        else:
            raise AssertionError("a bf16 copy of the FP8 codes must be refused")


def _reset_refused(rank, group, device):
    """reset_parameters() of a sharded FP8 weight: refused (it would cast each shard with the
    scale of its own rows), by name."""
    model = _shard(_model(device, Float8CurrentScaling()))
    try:
        model[0].reset_parameters()
    except NotImplementedError as err:
        assert "'weight' is sharded" in str(err) and "before sharding" in str(err), err
    else:
        raise AssertionError("reset_parameters() of a sharded FP8 weight must be refused")


def _delayed_wgrad_refused(rank, group, device):
    """A delayed weight gradient of a sharded FP8 weight (te.Linear, GroupedLinear) is refused."""
    recipe = Float8CurrentScaling()
    with te.quantized_model_init(recipe=recipe):
        block = te.Linear(H, 2 * H, params_dtype=torch.float32, device=device,
                          delay_wgrad_compute=True)  # fmt: skip
    dense = torch.nn.Sequential(block, torch.nn.LayerNorm(2 * H, device=device))
    grouped = _grouped_model(device, recipe, False, delay_wgrad_compute=True)
    for model in (_shard(dense), _shard(grouped)):
        te.FP8MasterWeights(model)
        with autocast(recipe=recipe):
            try:
                model(_batches(device)[0])
            except NotImplementedError as err:
                assert "delay_wgrad_compute=True" in str(err), err
            else:
                raise AssertionError(f"{model[0]}: a delayed wgrad of a sharded FP8 weight")


def _blocks_refused(rank, group, device):
    """FP8 weights kept in blocks (Float8BlockScaling, MXFP8), dense or grouped, sharded by
    FSDP2: FP8MasterWeights refuses them by name (the sharded refresh is per tensor)."""
    for recipe in (Float8BlockScaling(), MXFP8BlockScaling()):
        for model in (_model(device, recipe), _grouped_model(device, recipe, False)):
            try:
                te.FP8MasterWeights(_shard(model))
            except NotImplementedError as err:
                assert "sharded by FSDP2 and kept in blocks" in str(err), err
            else:
                raise AssertionError(f"{type(recipe).__name__}: sharded block-scaled weights")


SPLITS = [5, 0, 11]  # BATCH rows over three experts, one without tokens


class _Experts(torch.nn.Module):
    def __init__(self, grouped):
        super().__init__()
        self.experts = grouped

    def forward(self, x):
        return self.experts(x, SPLITS)


def _grouped_model(device, recipe, single, **extra):
    torch.manual_seed(0)
    kw = {"params_dtype": torch.float32, "device": device, "single_grouped_weight": single,
          **extra}  # fmt: skip
    with te.quantized_model_init(recipe=recipe):
        experts = te.GroupedLinear(len(SPLITS), H, 2 * H, **kw)
    return torch.nn.Sequential(_Experts(experts), torch.nn.LayerNorm(2 * H, device=device))


def _grouped_matches_unsharded(rank, group, device, single):
    """GroupedLinear's FP8 weights sharded: ``weight{i}`` on their rows, or the one ``[G, out,
    in]`` weight on its groups (3 over 2 ranks: uneven); each weight's gradient reduce-scattered
    into its sharded main_grad; the same losses, codes, scales and masters as unsharded."""
    recipe, batches = Float8CurrentScaling(), _batches(device)
    reference = _grouped_model(device, recipe, single)
    ref_losses, ref_masters = _train(reference, recipe, batches)
    model = _shard(_grouped_model(device, recipe, single))
    names = ["weight"] if single else [f"weight{i}" for i in range(len(SPLITS))]
    for name in names:
        p = model[0].experts.get_parameter(name)
        assert isinstance(p, DTensor) and p.dtype == E4M3, name
        assert p.to_local().shape == torch.empty(p.shape, device="meta").chunk(WORLD)[rank].shape
    losses, masters = _train(model, recipe, batches)
    assert torch.equal(losses, ref_losses), (losses, ref_losses)
    assert losses[-1] < losses[0], losses
    _assert_same_state(model, reference, group)
    for master, expected in zip(masters.parameters(), ref_masters.parameters(), strict=True):
        assert torch.equal(master.full_tensor(), expected)


def _tensor_parallel(rank, group, device, grouped):
    """FP8 weights of a column- then a row-parallel ``Linear`` (``grouped``: ``GroupedLinear``,
    expert tensor parallelism, per-group weights): each rank casts its own shard (a scale per
    shard); the output, the input gradient and each shard's ``main_grad`` against the float64
    GEMMs of the gathered dequantised shards (the biases start at zero)."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(rank)  # each rank initialises its own shards
    kw = {"params_dtype": torch.float32, "device": device, "tp_group": group}
    groups = len(SPLITS)
    with te.quantized_model_init(recipe=recipe):
        if grouped:
            col = te.GroupedLinear(groups, H, 2 * H, parallel_mode="column", **kw)
            row = te.GroupedLinear(groups, 2 * H, H, parallel_mode="row", **kw)
        else:
            col = te.Linear(H, 2 * H, parallel_mode="column", **kw)
            row = te.Linear(2 * H, H, parallel_mode="row", **kw)
    te.FP8MasterWeights(torch.nn.Sequential(col, row))
    names = [f"weight{i}" for i in range(groups)] if grouped else ["weight"]
    x = _batches(device)[0].requires_grad_()  # the same on every rank
    with autocast(recipe=recipe):
        y = row(col(x, SPLITS), SPLITS) if grouped else row(col(x))
    g = _batches(device)[1]
    y.backward(g)

    def gathered(m, name, dim):
        w = m.get_parameter(name).detach().double() * m.get_buffer(f"{name}_scale_inv").double()
        parts = [torch.empty_like(w) for _ in range(WORLD)]
        dist.all_gather(parts, w.contiguous(), group=group)
        return torch.cat(parts, dim).requires_grad_()

    w1 = [gathered(col, n, 0) for n in names]
    w2 = [gathered(row, n, 1) for n in names]
    rows = torch.repeat_interleave(torch.arange(groups), torch.tensor(SPLITS)) if grouped else None
    xd = x.detach().double().requires_grad_()
    if grouped:
        w1s, w2s = torch.stack(w1)[rows], torch.stack(w2)[rows]
        hidden = torch.einsum("mk,mnk->mn", xd, w1s)
        y_ref = torch.einsum("mk,mnk->mn", hidden, w2s)
    else:
        y_ref = xd @ w1[0].T @ w2[0].T
    y_ref.backward(g.double())
    assert_close_quantized(y, y_ref, "current", gemms=2)
    assert_close_quantized(x.grad, xd.grad, "current", gemms=2, grad=True)
    for n, full1, full2 in zip(names, w1, w2, strict=True):
        for m, expected in ((col, full1.grad.chunk(WORLD, 0)[rank]),
                            (row, full2.grad.chunk(WORLD, 1)[rank])):  # fmt: skip
            main_grad = m.get_parameter(n).main_grad
            assert main_grad.shape == m.get_parameter(n).shape
            if expected.norm() > 0:  # an expert without tokens has a zero gradient
                assert_close_quantized(main_grad, expected, "current", gemms=2, grad=True)
            else:
                assert not main_grad.any()


def _worker(names, rank, group, backend):
    device = device_for(backend, rank)
    train = functools.partial(_train_matches_unsharded, rank, group, device)
    checks = {
        "current": functools.partial(train, Float8CurrentScaling(), False),
        "delayed": functools.partial(train, DelayedScaling(), False, micro=2),
        "current_compiled": functools.partial(train, Float8CurrentScaling(), True, micro=2),
        "checkpoint": functools.partial(_checkpoint_round_trip, rank, group, device),
        "param_dtype_refused": functools.partial(_cast_weights_refused, rank, group, device),
        "delay_wgrad_refused": functools.partial(_delayed_wgrad_refused, rank, group, device),
        "reset_refused": functools.partial(_reset_refused, rank, group, device),
        "blocks_refused": functools.partial(_blocks_refused, rank, group, device),
        "tensor_parallel": functools.partial(_tensor_parallel, rank, group, device, False),
        "tensor_parallel_grouped": functools.partial(_tensor_parallel, rank, group, device, True),
        "grouped": functools.partial(_grouped_matches_unsharded, rank, group, device, False),
        "grouped_single": functools.partial(_grouped_matches_unsharded, rank, group, device, True),
    }
    return run_checks({name: checks[name] for name in names})


DEFAULT = ("current", "checkpoint", "param_dtype_refused", "delay_wgrad_refused", "grouped",
           "grouped_single", "reset_refused", "blocks_refused", "tensor_parallel",
           "tensor_parallel_grouped")  # fmt: skip
LONG = ("delayed", "current_compiled")  # --long-runs: CI's time is tight


@functools.cache
def _results(backend, names):
    return spawn_checks(functools.partial(_worker, names), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DEFAULT + LONG)
def test_fsdp2_fp8_primary_weights(backend, name, request):
    long_runs = request.config.getoption("--long-runs")
    if name in LONG and not long_runs:
        pytest.skip(
            "FSDP2 with FP8 primary weights: delayed scaling and torch.compile run with --long-runs"
        )
    assert_passed(_results(backend, DEFAULT + LONG if long_runs else DEFAULT), name)
