"""FP8 under tensor parallelism, two ranks (gloo on CPU; NCCL on two GPUs where present).

Delayed scaling: the amaxes are max-reduced over the default group (which contains the
tensor-parallel group), so a rank's weight shard is scaled by the amax of the *full* weight and
a row-parallel input shard by the amax of the full input: the scaling state of the
tensor-parallel LayerNormMLP (with sequence parallelism) equals the single-process module's
bit for bit, step after step, and so do its outputs and gradients up to the rounding of the
row-parallel partial sums. Current scaling quantises each rank's tensors with their own amax
(as Transformer Engine does for weights; inputs are gathered in high precision first, which
gives the same FP8 values as Transformer Engine's amax-reduced FP8 all-gather): its error
against the high-precision model is that of the single-process FP8 model.
"""

from __future__ import annotations

import functools

import pytest
import torch

import te_compile as te
from te_compile.distributed import shard_state_dict
from tests.distributed.harness import (
    BACKENDS,
    WORLD,
    assert_passed,
    device_for,
    run_checks,
    spawn_checks,
)
from tests.utils import assert_close, compile_counted

S, B, H, FFN = 16, 2, 32, 64  # FP8 GEMMs want feature sizes (and shards) in multiples of 16
DTYPE = torch.bfloat16


def _pair(group, device, **kw):
    torch.manual_seed(0)
    full = te.LayerNormMLP(H, FFN, params_dtype=DTYPE, device=device, **kw)
    tp = te.LayerNormMLP(
        H, FFN, params_dtype=DTYPE, device=device, sequence_parallel=True, tp_group=group, **kw
    )
    tp.load_state_dict(shard_state_dict(tp, full.state_dict()))
    return full, tp


def _step(module, x, dy, recipe):
    x = x.detach().requires_grad_(True)
    with te.autocast(recipe=recipe):
        y = module(x)
    y.backward(dy)
    return y.detach(), x.grad


def _delayed(rank, group, device, compiled):
    full, tp = _pair(group, device)
    # Past the calibration step (a fresh state's first delayed step runs current scaling, whose
    # per-shard weight scales differ from the full model's): the delayed machinery from step 0.
    for module in (full, tp):
        module.fc1_fp8_meta.calibrated = module.fc2_fp8_meta.calibrated = True
    run = compile_counted(tp, backend="aot_eager")[0] if compiled else tp
    recipe = te.recipe.DelayedScaling(amax_history_len=4)
    steps = []  # compared after the last step: a rank that failed early would hang the other
    for step in range(3):
        x = torch.randn(S, B, H, device=device, dtype=DTYPE) * (1 + step)
        dy = torch.randn(S, B, H, device=device, dtype=DTYPE)
        y, dx = _step(full, x, dy, recipe)
        y_tp, dx_tp = _step(run, x.chunk(WORLD)[rank], dy.chunk(WORLD)[rank], recipe)
        states = []
        for name in ("fc1_fp8_meta", "fc2_fp8_meta"):
            a, b = getattr(tp, name), getattr(full, name)
            # The backward's gradient amax is this rank's until the next forward reduces it.
            grad_amax = a.grad_amax.clone()
            torch.distributed.all_reduce(grad_amax, torch.distributed.ReduceOp.MAX, group)
            for buf in ("amax_history", "scale", "fwd_amax"):
                states.append((f"{name}.{buf}", getattr(a, buf).clone(), getattr(b, buf).clone()))
            states.append((f"{name}.grad_amax (reduced)", grad_amax, b.grad_amax.clone()))
        steps.append((states, y_tp, y.chunk(WORLD)[rank], dx_tp, dx.chunk(WORLD)[rank]))
    for step, (states, y_tp, y, dx_tp, dx) in enumerate(steps):
        for what, a, b in states:
            assert torch.equal(a, b), f"step {step}: {what} differs:\n{a[:4]}\n{b[:4]}"
        # The row-parallel output is a sum of partial sums each rounded to bf16: an error
        # relative to the terms, not to their sum (which can cancel), hence ``reduced``.
        assert_close(y_tp, y, DTYPE, roundings=2, reduced=True)
        assert_close(dx_tp, dx, DTYPE, roundings=2, reduced=True)
    grads = shard_state_dict(tp, {n: p.grad for n, p in full.named_parameters()})
    for name, p in tp.named_parameters():
        assert_close(p.grad, grads[name], DTYPE, roundings=2, reduced=True)


def _error(y, y_ref):
    return ((y.double() - y_ref).norm() / y_ref.norm()).item()


def _current(rank, group, device):
    full, tp = _pair(group, device, activation="swiglu")
    compiled, counter = compile_counted(tp, backend="aot_eager")
    recipe = te.recipe.Float8CurrentScaling()
    x = torch.randn(S, B, H, device=device, dtype=DTYPE)
    dy = torch.randn(S, B, H, device=device, dtype=DTYPE)
    with torch.no_grad():
        y_hp = full(x).double()  # high precision (bf16 GEMMs): the baseline for FP8's error
    y_fp8, _ = _step(full, x, dy, recipe)
    y_tp, _ = _step(compiled, x.chunk(WORLD)[rank], dy.chunk(WORLD)[rank], recipe)
    assert counter.frame_count == 1
    shard = y_hp.chunk(WORLD)[rank]
    err_single, err_tp = _error(y_fp8.chunk(WORLD)[rank], shard), _error(y_tp, shard)
    assert 0 < err_tp < 2 * err_single, (err_tp, err_single)


def _worker(rank, group, backend):
    device = device_for(backend, rank)
    return run_checks(
        {
            "delayed_eager": functools.partial(_delayed, rank, group, device, False),
            "delayed_compiled": functools.partial(_delayed, rank, group, device, True),
            "current_compiled": functools.partial(_current, rank, group, device),
        }
    )


@functools.cache
def _results(backend):
    return spawn_checks(_worker, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["delayed_eager", "delayed_compiled", "current_compiled"])
def test_fp8_tensor_parallel_layernorm_mlp(backend, name):
    assert_passed(_results(backend), name)
