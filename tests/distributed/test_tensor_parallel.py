"""Every tensor-parallel mode of every module against the single-process module with the same
full weights, on two ranks (gloo on CPU; NCCL on two GPUs where present): the forward output,
the input gradient and every parameter gradient (as this rank's shard), eagerly and compiled
with ``fullgraph=True``; plus the configuration errors.

One spawned process group runs all eager checks and one all compiled checks (see harness.py);
each pytest case then reports its own check.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import te_compile as te
from te_compile import distributed as tedist
from te_compile.distributed import shard_tensor
from tests.distributed.harness import (
    BACKENDS,
    WORLD,
    Case,
    assert_passed,
    compare,
    device_for,
    run_checks,
    spawn_checks,
)
from tests.utils import GraphRecorder, assert_single_graph, compile_counted

S, B, H, FFN = 8, 2, 16, 32  # sequence (dim 0, split by sequence parallelism), batch, widths
SPLITS = [3, 0, 7]  # tokens per expert: an empty expert, odd counts


def _seq(width: int):
    def inputs(device, dtype):
        return torch.randn(S, B, width, device=device, dtype=dtype), ()

    return inputs


def _tokens(width: int):
    def inputs(device, dtype):
        return torch.randn(sum(SPLITS), width, device=device, dtype=dtype), (SPLITS,)

    return inputs


def _kw(group, dtype, device):
    return {"tp_group": group, "params_dtype": dtype, "device": device}


CASES: dict[str, Case] = {
    "linear_column": Case(
        lambda g, d, dev: te.Linear(H, 24, parallel_mode="column", **_kw(g, d, dev)),
        in_dim=None, out_dim=-1, inputs=_seq(H),
    ),
    "linear_row": Case(
        lambda g, d, dev: te.Linear(24, H, parallel_mode="row", **_kw(g, d, dev)),
        in_dim=-1, out_dim=None, inputs=_seq(24),
    ),
    "linear_column_sp": Case(
        lambda g, d, dev: te.Linear(
            H, 24, parallel_mode="column", sequence_parallel=g is not None, **_kw(g, d, dev)
        ),
        in_dim=0, out_dim=-1, inputs=_seq(H),
    ),
    "linear_row_sp": Case(
        lambda g, d, dev: te.Linear(
            24, H, parallel_mode="row", sequence_parallel=g is not None, **_kw(g, d, dev)
        ),
        in_dim=-1, out_dim=0, inputs=_seq(24),
    ),
    "layernorm_linear_column": Case(
        lambda g, d, dev: te.LayerNormLinear(H, 24, parallel_mode="column", **_kw(g, d, dev)),
        in_dim=None, out_dim=-1, inputs=_seq(H),
    ),
    "layernorm_linear_column_sp_rmsnorm": Case(
        lambda g, d, dev: te.LayerNormLinear(
            H, 24, normalization="RMSNorm", zero_centered_gamma=True, parallel_mode="column",
            sequence_parallel=g is not None, **_kw(g, d, dev),
        ),
        in_dim=0, out_dim=-1, inputs=_seq(H),
    ),
    "layernorm_sp": Case(
        lambda g, d, dev: te.LayerNorm(H, sequence_parallel=g is not None, **_kw(g, d, dev)),
        in_dim=0, out_dim=0, inputs=_seq(H),
    ),
    "rmsnorm_sp_zero_centered": Case(
        lambda g, d, dev: te.RMSNorm(
            H, zero_centered_gamma=True, sequence_parallel=g is not None, **_kw(g, d, dev)
        ),
        in_dim=0, out_dim=0, inputs=_seq(H),
    ),
    "layernorm_mlp": Case(
        lambda g, d, dev: te.LayerNormMLP(H, FFN, **_kw(g, d, dev)),
        in_dim=None, out_dim=None, inputs=_seq(H),
    ),
    "layernorm_mlp_sp_swiglu": Case(
        lambda g, d, dev: te.LayerNormMLP(
            H, FFN, activation="swiglu", sequence_parallel=g is not None, **_kw(g, d, dev)
        ),
        in_dim=0, out_dim=0, inputs=_seq(H),
    ),
    "grouped_linear_column": Case(
        lambda g, d, dev: te.GroupedLinear(3, H, 24, parallel_mode="column", **_kw(g, d, dev)),
        in_dim=None, out_dim=-1, inputs=_tokens(H),
    ),
    "grouped_linear_row_single_parameter": Case(
        lambda g, d, dev: te.GroupedLinear(
            3, 24, H, parallel_mode="row", single_grouped_parameter=True, **_kw(g, d, dev)
        ),
        in_dim=-1, out_dim=None, inputs=_tokens(24),
    ),
    "grouped_mlp_swiglu": Case(
        lambda g, d, dev: te.GroupedMLP(3, H, FFN, bias=True, **_kw(g, d, dev)),
        in_dim=None, out_dim=None, inputs=_tokens(H),
    ),
    "grouped_mlp_interleaved_per_expert_params": Case(
        lambda g, d, dev: te.GroupedMLP(
            3, H, FFN, glu_interleave_size=4, single_grouped_parameter=False, **_kw(g, d, dev)
        ),
        in_dim=None, out_dim=None, inputs=_tokens(H),
    ),
    "transformer_layer_gqa": Case(
        lambda g, d, dev: te.TransformerLayer(
            H, FFN, 4, num_gqa_groups=2, set_parallel_mode=True, hidden_dropout=0.0,
            attention_dropout=0.0, **_kw(g, d, dev),
        ),
        in_dim=None, out_dim=None, inputs=_seq(H), roundings=4,
    ),
    "transformer_layer_sp_rmsnorm_swiglu": Case(
        lambda g, d, dev: te.TransformerLayer(
            H, FFN, 4, set_parallel_mode=True, sequence_parallel=g is not None,
            normalization="RMSNorm", activation="swiglu", bias=False, hidden_dropout=0.0,
            attention_dropout=0.0, **_kw(g, d, dev),
        ),
        in_dim=0, out_dim=0, inputs=_seq(H), roundings=4,
    ),
}  # fmt: skip


def _with_mesh(build, dims):
    """``build`` with the tensor-parallel group given as a DeviceMesh instead of the group."""

    def build_mesh(group, dtype, device):
        if group is None:
            return build(None, dtype, device)
        shape = (1, WORLD) if len(dims) == 2 else (WORLD,)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=dims)
        return build(mesh if len(dims) == 1 else (mesh, "tp"), dtype, device)

    return build_mesh


def _deferred_group(group, dtype, device):
    """Built with tp_size and no group; the group is set afterwards (Transformer Engine's API)."""
    m = te.Linear(H, 24, parallel_mode="column", tp_size=WORLD if group else None,
                  params_dtype=dtype, device=device)  # fmt: skip
    if group is not None:
        m.set_tensor_parallel_group(group)
    return m


MESH_CASES = {
    "linear_column_1d_mesh": Case(
        _with_mesh(CASES["linear_column"].build, ("tp",)), None, -1, _seq(H)
    ),
    "layernorm_mlp_sp_2d_mesh_dim": Case(
        _with_mesh(CASES["layernorm_mlp_sp_swiglu"].build, ("dp", "tp")), 0, 0, _seq(H)
    ),
    "linear_column_deferred_group": Case(_deferred_group, None, -1, _seq(H)),
}

# The compiled checks, one case per communication pattern: the collectives expected in the
# forward and in the backward graph (besides their wait_tensor).
AG, RS, AR = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"
COMPILED = {
    "linear_row_sp": ({RS}, {AG, AR}),  # AR: the bias gradient (the bias sees a sequence shard)
    "layernorm_linear_column": (set(), {AR}),
    "layernorm_mlp_sp_swiglu": ({AG, RS}, {AG, RS, AR}),
    "grouped_linear_row_single_parameter": ({AR}, set()),
    "transformer_layer_sp_rmsnorm_swiglu": ({AG, RS}, {AG, RS, AR}),
}


def _per_rank(shape, device, salt):
    """Every rank's tensor (rank r's drawn from seed ``salt + r``): each rank knows them all."""
    gens = [torch.Generator().manual_seed(salt + r) for r in range(WORLD)]
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(device) for g in gens]


def _collective_cases(rank):
    """name: (function, replicated input?, output shape, expected output from every rank's
    input, expected input gradient from every rank's output gradient)."""
    cat, chunk = torch.cat, lambda t, d: t.chunk(WORLD, d)[rank]
    return {
        "all_gather": (functools.partial(tedist.all_gather, dim=1), False, (4, 6 * WORLD),
                       lambda xs: cat(xs, 1), lambda gs: chunk(sum(gs), 1)),
        "reduce_scatter": (tedist.reduce_scatter, False, (4 // WORLD, 6),
                           lambda xs: chunk(sum(xs), 0), lambda gs: cat(gs, 0)),
        "all_reduce": (tedist.all_reduce, False, (4, 6),
                       lambda xs: sum(xs), lambda gs: gs[rank]),
        "all_reduce_grad": (tedist.all_reduce_grad, False, (4, 6),
                            lambda xs: xs[rank], lambda gs: sum(gs)),
        "scatter": (tedist.scatter, True, (4 // WORLD, 6),
                    lambda xs: chunk(xs[0], 0), lambda gs: cat(gs, 0)),
    }  # fmt: skip


def _collectives(rank, group, device, compiled):
    """Each collective's forward and backward against the values it must produce; compiled:
    all of them in one ``fullgraph=True`` function, with zero graph breaks (dynamo's explain)."""
    cases = _collective_cases(rank)
    xs = _per_rank((4, 6), device, 0)
    inputs = {n: (xs[0] if rep else xs[rank]).clone().requires_grad_(True)
              for n, (_, rep, *_) in cases.items()}  # fmt: skip
    grads = {n: _per_rank(shape, device, 100) for n, (_, _, shape, *_) in cases.items()}

    def run(inputs):
        return {n: fn(inputs[n], group) for n, (fn, *_) in cases.items()}

    if compiled:
        detached = {n: x.detach() for n, x in inputs.items()}
        assert_single_graph(run, detached)
        run = compile_counted(run, backend="aot_eager")[0]
    outs = run(inputs)
    torch.autograd.backward([outs[n] for n in cases], [grads[n][rank] for n in cases])
    for name, (_, _, _, out, grad) in cases.items():
        # float64 sums of more than two ranks' tensors depend on the order of the additions
        torch.testing.assert_close(outs[name], out(xs), msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(
            inputs[name].grad, grad(grads[name]), msg=lambda m, n=name: f"{n} gradient: {m}"
        )


def _eager_worker(rank, group, backend):
    device = device_for(backend, rank)
    checks = {}
    for name, case in {**CASES, **MESH_CASES}.items():
        build = functools.partial(_build, case.build, torch.float64, device)
        checks[name] = functools.partial(
            compare, Case(build, case.in_dim, case.out_dim, case.inputs), rank, group, device,
            torch.float64,
        )  # fmt: skip
    # fp32 and bf16 on one case each: partial sums rounded before the reduction.
    for dtype in (torch.float32, torch.bfloat16):
        case = CASES["layernorm_mlp_sp_swiglu"]
        build = functools.partial(_build, case.build, dtype, device)
        checks[f"layernorm_mlp_sp_swiglu_{dtype}"] = functools.partial(
            compare, Case(build, 0, 0, case.inputs, roundings=4), rank, group, device, dtype
        )
    checks.update(_error_checks(group, device))
    checks["collectives"] = functools.partial(_collectives, rank, group, device, False)
    checks["vocab_parallel_cross_entropy"] = functools.partial(
        _vocab_ce, rank, group, device, False
    )
    return run_checks(checks)


def _vocab_ce(rank, group, device, compiled):
    """Loss and logits gradient of the vocabulary-sharded cross-entropy against F.cross_entropy
    on the whole logits (float64; targets in every shard, some ignored); compiled: one graph,
    zero breaks. Reductions "sum" and "none" eager."""
    gen = torch.Generator().manual_seed(7)
    full = (torch.randn(6, 5, 4 * WORLD, generator=gen, dtype=torch.float64) * 3).to(device)
    target = torch.randint(0, 4 * WORLD, (6, 5), generator=gen).to(device)
    target[0, :2] = -100
    ref_in = full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), ignore_index=-100)
    ref.backward()
    shard = full.chunk(WORLD, -1)[rank].clone().requires_grad_(True)
    fn = functools.partial(tedist.vocab_parallel_cross_entropy, group=group)
    if compiled:
        assert_single_graph(fn, shard.detach(), target)
        fn, counter = compile_counted(fn, backend="aot_eager")
    loss = fn(shard, target)
    loss.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(shard.grad, ref_in.grad.chunk(WORLD, -1)[rank])
    if compiled:
        assert counter.frame_count == 1
        return
    for reduction in ("sum", "none"):
        got = tedist.vocab_parallel_cross_entropy(shard, target, group, reduction=reduction)
        want = F.cross_entropy(full.transpose(1, 2), target, reduction=reduction)
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match=r"target \[6\] must be logits' shape"):
        tedist.vocab_parallel_cross_entropy(shard, target[:, 0], group)


def _build(build, dtype, device, group):
    return build(group, dtype, device)


def _compiled_worker(rank, group, backend):
    device = device_for(backend, rank)
    checks = {}
    for name in COMPILED:
        case = CASES[name]
        build = functools.partial(_build, case.build, torch.float64, device)
        checks[name] = functools.partial(_compiled_check, name, build, rank, group, device)
    checks["collectives"] = functools.partial(_collectives, rank, group, device, True)
    checks["vocab_parallel_cross_entropy"] = functools.partial(_vocab_ce, rank, group, device, True)
    return run_checks(checks)


def _compiled_check(name, build, rank, group, device):
    case = CASES[name]
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled = {}

    def compile_fn(module):
        compiled["fn"], compiled["counter"] = compile_counted(module, backend=recorder)
        return compiled["fn"]

    compare(Case(build, case.in_dim, case.out_dim, case.inputs), rank, group, device,
            torch.float64, compile_fn=compile_fn)  # fmt: skip
    assert compiled["counter"].frame_count == 1, "expected one graph (fullgraph, no recompile)"
    expected = COMPILED[name]
    for graph, want in zip((recorder.forward, recorder.backward), expected, strict=True):
        found = {op.split(".")[1] for op in graph if op.startswith("_c10d_functional.")}
        assert found - {"wait_tensor"} == want, recorder.summary()
        assert any(op.startswith("te.") or "(te." in op for op in graph), recorder.summary()


def _error_checks(group, device):
    """Configuration errors that need an initialised group."""

    def tp_size_mismatch():
        with pytest.raises(ValueError, match=r"tp_size \(3\) must equal the size of tp_group"):
            te.Linear(H, 24, parallel_mode="column", tp_group=group, tp_size=3)

    def two_d_mesh():
        mesh = init_device_mesh(device.type, (1, WORLD), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match=r"tp_group must be a 1-D DeviceMesh.*mesh\['tp'\]"):
            te.Linear(H, 24, parallel_mode="column", tp_group=mesh)
        with pytest.raises(ValueError, match=r"'cp' is not a dim of the mesh"):
            te.Linear(H, 24, parallel_mode="column", tp_group=(mesh, "cp"))

    def set_group_of_other_size():
        m = te.Linear(H, 24, parallel_mode="row", tp_size=2 * WORLD)
        with pytest.raises(ValueError, match=r"must equal the tp_size the module was built with"):
            m.set_tensor_parallel_group(group)

    def sequence_not_divisible():
        m = te.Linear(24, H, parallel_mode="row", sequence_parallel=True, tp_group=group,
                      device=device)  # fmt: skip
        with pytest.raises(ValueError, match=r"dim 0 of the tensor \(3\) must be divisible"):
            m(torch.randn(3, 24 // WORLD, device=device))

    def deepcopy_and_pickle():
        m = te.Linear(H, 24, parallel_mode="row", tp_group=group, device=device)
        x = torch.randn(4, H // WORLD, device=device)
        assert torch.equal(copy.deepcopy(m)(x), m(x)), "a deep copy shares the group"
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        with pytest.raises(RuntimeError, match=r"set_tensor_parallel_group"):
            loaded(x)
        loaded.set_tensor_parallel_group(group)
        assert torch.equal(loaded(x), m(x))

    return {
        "error_tp_size_mismatch": tp_size_mismatch,
        "deepcopy_and_pickle": deepcopy_and_pickle,
        "error_two_d_mesh": two_d_mesh,
        "error_set_group_of_other_size": set_group_of_other_size,
        "error_sequence_not_divisible": sequence_not_divisible,
    }


@functools.cache
def _results(kind: str, backend: str) -> dict:
    worker = {"eager": _eager_worker, "compiled": _compiled_worker}[kind]
    return spawn_checks(worker, backend)


def _check(kind: str, backend: str, name: str) -> None:
    assert_passed(_results(kind, backend), name)


EAGER_NAMES = [*CASES, *MESH_CASES, "layernorm_mlp_sp_swiglu_torch.float32",
               "layernorm_mlp_sp_swiglu_torch.bfloat16"]  # fmt: skip
ERROR_NAMES = ["deepcopy_and_pickle", "error_tp_size_mismatch", "error_two_d_mesh",
               "error_set_group_of_other_size", "error_sequence_not_divisible"]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_collectives_forward_and_backward(backend, kind):
    _check(kind, backend, "collectives")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_vocab_parallel_cross_entropy_matches_gathered_logits(backend, kind):
    _check(kind, backend, "vocab_parallel_cross_entropy")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", EAGER_NAMES)
def test_matches_single_process(backend, name):
    _check("eager", backend, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_fullgraph_matches_single_process_with_collectives_in_graph(backend, name):
    _check("compiled", backend, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ERROR_NAMES)
def test_bad_group_configuration_raises(backend, name):
    _check("eager", backend, name)


# Single-process checks: no group needed -------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: te.Linear(16, 25, parallel_mode="column", tp_size=2),
         r"Linear: out_features \(25\) must be divisible by tp_size \(2\)"),
        (lambda: te.Linear(25, 16, parallel_mode="row", tp_size=2),
         r"Linear: in_features \(25\) must be divisible by tp_size \(2\)"),
        (lambda: te.Linear(16, 16, parallel_mode="diagonal"),
         r"Linear: parallel_mode must be one of \('column', 'row', None\), got 'diagonal'"),
        (lambda: te.Linear(16, 16, parallel_mode="column", sequence_parallel=True),
         r"Linear: sequence_parallel=True needs a tensor-parallel group"),
        (lambda: te.Linear(16, 16, sequence_parallel=True, tp_size=2),
         r"Linear: sequence_parallel=True needs parallel_mode 'column' or 'row'"),
        (lambda: te.Linear(16, 16, parallel_mode="row", tp_size=0),
         r"Linear: tp_size must be a positive int or None, got 0"),
        (lambda: te.Linear(16, 16, parallel_mode="row", tp_group="tp"),
         r"Linear: tp_group must be a torch.distributed.ProcessGroup"),
        (lambda: te.LayerNormLinear(16, 16, parallel_mode="row", tp_size=2),
         r"LayerNormLinear: parallel_mode must be one of \('column', None\), got 'row'"),
        (lambda: te.LayerNormLinear(16, 30, parallel_mode="column", tp_size=4),
         r"LayerNormLinear: out_features \(30\) must be divisible by tp_size \(4\)"),
        (lambda: te.LayerNormMLP(16, 30, tp_size=4),
         r"LayerNormMLP: ffn_hidden_size \(30\) must be divisible by tp_size \(4\)"),
        (lambda: te.LayerNormMLP(16, 32, sequence_parallel=True),
         r"LayerNormMLP: sequence_parallel=True needs a tensor-parallel group"),
        (lambda: te.GroupedLinear(2, 16, 16, parallel_mode="column", sequence_parallel=True),
         r"GroupedLinear: sequence_parallel=True is not supported"),
        (lambda: te.GroupedMLP(2, 16, 32, sequence_parallel=True, tp_size=2),
         r"GroupedMLP: sequence_parallel=True is not supported"),
        (lambda: te.GroupedLinear(2, 16, 18, parallel_mode="column", tp_size=4),
         r"GroupedLinear: out_features \(18\) must be divisible by tp_size \(4\)"),
        (lambda: te.GroupedMLP(2, 16, 32, glu_interleave_size=16, tp_size=4),
         r"GroupedMLP: ffn_hidden_size / tp_size \(32 / 4\) must be a multiple of "
         r"glu_interleave_size \(16\)"),
    ],
)  # fmt: skip
def test_bad_configuration_raises_naming_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_forward_without_the_group_raises():
    m = te.Linear(16, 16, parallel_mode="column", tp_size=2)
    with pytest.raises(RuntimeError, match=r"call module.set_tensor_parallel_group\(group\)"):
        m(torch.randn(4, 16))


def test_no_group_and_tp_size_one_is_the_plain_module():
    """parallel_mode with tp_size 1 and no group: no sharding and no communication, the same
    result as the module without parallel_mode (only the attributes differ)."""
    torch.manual_seed(0)
    plain = te.LayerNormMLP(16, 32, activation="swiglu")
    torch.manual_seed(0)
    tp1 = te.LayerNormMLP(16, 32, activation="swiglu", tp_size=1)
    torch.manual_seed(0)
    col = te.Linear(16, 24, parallel_mode="column")
    assert col.weight.shape == (24, 16) and col.weight.partition_dim == 0
    x = torch.randn(4, 16)
    torch.testing.assert_close(tp1(x), plain(x), rtol=0, atol=0)
    assert not hasattr(plain.fc1_weight, "tensor_model_parallel")


def test_parameter_attributes():
    lin = te.Linear(16, 24, parallel_mode="row", sequence_parallel=True, tp_size=2)
    assert (lin.weight.tensor_model_parallel, lin.weight.partition_dim) == (True, 1)
    assert (lin.bias.tensor_model_parallel, lin.bias.sequence_parallel) == (False, True)
    assert lin.in_features == 8 and lin.weight.shape == (24, 8)
    mlp = te.LayerNormMLP(16, 32, activation="swiglu", sequence_parallel=True, tp_size=2)
    assert mlp.fc1_weight.shape == (32, 16) and mlp.fc1_weight.partition_stride == 2
    assert mlp.fc2_weight.partition_dim == 1 and mlp.fc2_bias.sequence_parallel
    assert mlp.layer_norm_weight.sequence_parallel and not mlp.layer_norm_weight.partition_dim + 1
    grouped = te.GroupedLinear(2, 16, 24, parallel_mode="column", tp_size=2)
    assert grouped.weight0.shape == (12, 16) and grouped.bias1.partition_dim == 0


def test_shard_tensor_with_stride_takes_each_half_s_shard():
    full = torch.arange(8).reshape(8, 1)  # [act 0..3 | linear 4..7]
    assert shard_tensor(full, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    assert shard_tensor(full, 0, 1, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"dim 0 \(8\) does not split into 6 equal chunks"):
        shard_tensor(full, 0, 2, 0, 3)
