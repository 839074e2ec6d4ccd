"""FP8 primary weights (``quantization.primary``): modules built inside
``te.quantized_model_init`` keep their weights as FP8 codes with a scale, the forward uses them
without a weight cast, the gradient goes to ``main_grad`` and ``te.FP8MasterWeights`` keeps the
fp32 masters and refreshes the codes after each optimizer step."""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch

import te_compile as te
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    autocast,
    primary,
)
from tests.utils import (
    DEVICES,
    assert_close,
    assert_close_quantized,
    assert_single_graph,
    chain_roundings,
    compile_counted,
)

MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP")
E4M3 = torch.float8_e4m3fn


def _build(name, device, **kw):
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": device, **kw}
    if name == "Linear":
        return te.Linear(128, 64, **kw)
    if name == "LayerNormLinear":
        return te.LayerNormLinear(128, 64, **kw)
    return te.LayerNormMLP(128, 256, **kw)


def _primary(name, device, recipe, preserve=False):
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return _build(name, device)


def _fp8_names(m):
    return [n for n, p in m.named_parameters() if p.dtype == E4M3]


def _x(device, step=0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(96, 128, generator=g).to(device, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODULES)
def test_weights_are_fp8_codes_of_the_initial_values(device, name):
    recipe = Float8CurrentScaling()
    hp, m = _build(name, device), _primary(name, device, recipe, preserve=True)
    names = _fp8_names(m)
    assert names == ([n for n in ("weight", "fc1_weight", "fc2_weight") if hasattr(m, n)])
    for n in names:
        w, init = getattr(m, n), getattr(hp, n)
        assert torch.equal(w.get_high_precision_init_val(), init.detach().cpu())
        codes = te.functional.quantize_weight(init.detach(), "current:e4m3")  # fmt: skip
        assert torch.equal(w.detach().view(torch.uint8), codes[0])
        assert torch.equal(getattr(m, f"{n}_scale_inv"), codes[1])
        w.clear_high_precision_init_val()
        assert w.get_high_precision_init_val() is None
    plain = _primary(name, device, recipe)
    assert all(getattr(plain, n).get_high_precision_init_val() is None for n in names)


def _bytes(m):
    return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])


def test_bytes_per_weight_parameter():
    """1 byte per weight parameter (bf16: 2), plus 8 bytes of scale and amax per weight."""
    hp, m = _build("Linear", "cpu"), _primary("Linear", "cpu", Float8CurrentScaling())
    n = m.weight.numel()
    assert _bytes(hp) - _bytes(m) == n - 8
    assert m.weight.element_size() == 1 and hp.weight.element_size() == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODULES)
def test_forward_and_gradients_match_the_high_precision_module(device, name):
    """Under current scaling the FP8 weight is the cast the high-precision module makes each
    step: the same output, input gradient and (fp32) weight gradient, exactly."""
    recipe = Float8CurrentScaling()
    hp = _build(name, device, fuse_wgrad_accumulation=True)
    m = _primary(name, device, recipe)
    te.FP8MasterWeights(m)  # main_grad buffers
    for n in _fp8_names(m):
        getattr(hp, n).main_grad = torch.zeros(getattr(hp, n).shape, device=device)
    _assert_same_step(m, hp, device, recipe)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "recipe", [Float8CurrentScaling, DelayedScaling], ids=["current", "delayed"]
)
def test_layernorm_mlp_runs_the_fused_mlp_op(device, recipe, monkeypatch):
    """FP8 primary weights take te::mlp (the activation fused into the quantisations), not two
    te::linear calls, under both per-tensor recipes: one mlp call per forward."""
    from te_compile.quantization import gemm

    calls = []
    real = gemm.F.mlp
    monkeypatch.setattr(gemm.F, "mlp", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    m = _primary("LayerNormMLP", device, recipe())
    te.FP8MasterWeights(m)
    for step in range(2):  # delayed: its first step (current scaling) and a delayed step
        with autocast(recipe=recipe()):
            m(_x(device, step).requires_grad_()).sum().backward()
    assert len(calls) == 2


def _train(m, recipe, steps, primary, *args):
    """SGD on ``m(x, *args)`` with fp32 masters: FP8MasterWeights for FP8 weights; for
    high-precision weights the same loop by hand (main_grad, fp32 master, the bf16 weight copied
    from it). ``(losses, the FP8MasterWeights or None)``."""
    masters = None
    if primary:
        masters = te.FP8MasterWeights(m)
        opt = torch.optim.SGD([*masters.parameters(), *masters.other_parameters()], lr=0.5)
    else:  # the 2-D GEMM weights: weight, fc1_weight, weight0 ...
        hp = [p for n, p in m.named_parameters()
              if p.dim() == 2 and n.rstrip("0123456789").endswith("weight")]  # fmt: skip
        fp32 = [torch.nn.Parameter(p.detach().float()) for p in hp]
        if hasattr(m, "allocate_main_grad"):  # GroupedLinear: views of one [G, out, in] buffer
            m.allocate_main_grad()
        else:
            for p in hp:
                p.main_grad = torch.zeros(p.shape)
        others = [p for p in m.parameters() if all(p is not q for q in hp)]
        opt = torch.optim.SGD([*fp32, *others], lr=0.5)
    losses = []
    for _step in range(steps):
        with autocast(recipe=recipe):
            loss = m(_x("cpu"), *args).float().square().mean()  # one batch: the loss must fall
        loss.backward()
        losses.append(loss.detach())
        if primary:
            masters.step(opt)
        else:
            for p, master in zip(hp, fp32, strict=True):
                master.grad = p.main_grad.clone()
                p.main_grad.zero_()
            opt.step()
            with torch.no_grad():
                for p, master in zip(hp, fp32, strict=True):
                    p.copy_(master)
        opt.zero_grad()
    return torch.stack(losses), masters


@pytest.mark.parametrize("recipe", [Float8CurrentScaling, DelayedScaling])
@pytest.mark.parametrize("name", MODULES)
def test_training_tracks_high_precision_weights(name, recipe):
    """A few SGD steps with FP8 primary weights track the same recipe on bf16 weights (the FP8
    weight is cast from the fp32 master rather than from its bf16 rounding: FP8-level
    differences only)."""
    hp = _build(name, "cpu", fuse_wgrad_accumulation=True)
    m = _primary(name, "cpu", recipe(), preserve=True)
    losses, _ = _train(m, recipe(), 4, primary=True)
    ref, _ = _train(hp, recipe(), 4, primary=False)
    assert losses[-1] < losses[0]
    assert_close(losses, ref, torch.bfloat16, roundings=chain_roundings(torch.bfloat16, 4))


def _round_trip(name, recipe):
    """A module trained two steps, saved, loaded into a fresh one: the same output. Returns
    the fresh one."""
    m = _primary(name, "cpu", recipe)
    _train(m, recipe, 2, primary=True)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = _primary(name, "cpu", recipe)
    torch.manual_seed(1)
    fresh.load_state_dict(torch.load(buf))
    with autocast(recipe=recipe), torch.no_grad():
        assert torch.equal(fresh(_x("cpu", 7)), m(_x("cpu", 7)))
    return fresh


@pytest.mark.parametrize("name", MODULES)
def test_state_dict_round_trip(name):
    _round_trip(name, Float8CurrentScaling())


def _assert_compiled_step_as_eager(build, recipe, *args):
    """Two models from ``build()`` with FP8MasterWeights: the compiled loss of ``m(x, *args)``
    is one graph (aot_eager) and two steps give the eager losses and ``main_grad`` bits."""
    eager, compiled = build(), build()
    te.FP8MasterWeights(eager), te.FP8MasterWeights(compiled)

    def loss_fn(m, x):
        with autocast(recipe=recipe):
            return m(x, *args).float().square().mean()

    assert_single_graph(loss_fn, compiled, _x("cpu"))
    fn, counter = compile_counted(loss_fn, backend="aot_eager")
    for step in range(2):
        loss, loss0 = fn(compiled, _x("cpu", step)), loss_fn(eager, _x("cpu", step))
        assert torch.equal(loss, loss0)
        loss.backward()
        loss0.backward()
    assert counter.frame_count == 1
    for n in _fp8_names(eager):
        assert torch.equal(getattr(compiled, n).main_grad, getattr(eager, n).main_grad)


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_compiled_step_one_graph_values_as_eager(name):
    recipe = Float8CurrentScaling()
    _assert_compiled_step_as_eager(lambda: _primary(name, "cpu", recipe), recipe)


def test_refused_uses():
    recipe = Float8CurrentScaling()
    m = _primary("Linear", "cpu", recipe)
    with (
        autocast(enabled=False, calibrating=True),
        pytest.raises(NotImplementedError, match="got calibration"),
    ):
        m(_x("cpu"))
    x = _x("cpu")
    with autocast(recipe=recipe):
        y = m(x)
    y.float().sum().backward()  # no FP8MasterWeights: .grad in the nominal dtype, as in TE
    assert m.weight.grad.dtype == torch.bfloat16 and m.weight.dtype == E4M3
    dw = x.double().sum(0).expand(64, 128)
    assert_close_quantized(m.weight.grad, dw, "current", grad=True)
    with (
        pytest.raises(ValueError, match=r"enabled must be a bool \(True or False\), got 1"),
        te.fp8_model_init(enabled=1),
    ):
        pass
    with te.fp8_model_init(enabled=False):
        assert _build("Linear", "cpu").weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="no FP8 primary weights"):
        te.FP8MasterWeights(_build("Linear", "cpu"))


def test_transformer_layer_trains_with_fp8_weights():
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    with te.quantized_model_init(recipe=recipe):
        layer = te.TransformerLayer(128, 256, 4, **kw)
    assert len(_fp8_names(layer)) == 4  # QKV, projection, FC1, FC2
    masters = te.FP8MasterWeights(layer)
    opt = torch.optim.AdamW([*masters.parameters(), *masters.other_parameters()], lr=1e-3)
    x = torch.randn(16, 2, 128, dtype=torch.bfloat16)
    before = [w.detach().clone() for w in masters.parameters()]
    for _ in range(2):
        with autocast(recipe=recipe):
            loss = layer(x).float().square().mean()
        loss.backward()
        masters.step(opt)
        opt.zero_grad()
    assert all(not torch.equal(a, b) for a, b in zip(before, masters.parameters(), strict=True))
    for module, name, master, _ in masters._entries:  # the codes are the masters' casts
        w = getattr(module, name)
        codes = te.functional.quantize_weight(master, "current:e4m3")
        assert torch.equal(w.detach().view(torch.uint8), codes[0])
        assert torch.equal(getattr(module, f"{name}_scale_inv"), codes[1])
        assert not w.main_grad.any()


# Block-scaled recipes: Float8BlockScaling, MXFP8BlockScaling -----------------------------------

BLOCK = Float8BlockScaling()  # 128x128 weight blocks, power-of-two scales
BLOCK_1D = Float8BlockScaling(w_block_scaling_dim=1)  # 1x128 weight blocks: two casts
MXFP8 = MXFP8BlockScaling()  # 1x32 blocks along each dim: two casts
BLOCK_RECIPES = {"block": BLOCK, "block_1x128": BLOCK_1D, "mxfp8": MXFP8}
_COPY_RECIPES = {"current": Float8CurrentScaling(), "block": BLOCK, "mxfp8": MXFP8}


def _block_cast(values, recipe):
    """The five tensors of ``values``' weight cast under ``recipe``, in FP8 codes: the codes,
    their scales, the dgrad GEMM's copy, its scales, a 0-element amax (a grouped ``[G, out,
    in]`` weight: each expert's cast, stacked)."""
    if values.dim() == 3:
        parts = [_block_cast(v, recipe) for v in values]
        return [*(torch.stack(t) for t in zip(*(p[:4] for p in parts), strict=True)), parts[0][4]]
    if recipe is MXFP8:
        return [*te.functional.quantize_mxfp8(values.float()), torch.empty(0)]
    spec = "block:e4m3:128x128:p2" if recipe is BLOCK else "block:e4m3:p2"
    return te.functional.quantize_weight(values, spec)


def _assert_kept_cast_of(m, values, recipe=BLOCK):
    """Each FP8 weight of ``m`` holds :func:`_block_cast` of ``values[name]``: the codes
    (Parameter), the rest as buffers (the dgrad GEMM's copy and its scales only where it is a
    cast of its own: of 128x128 blocks they are transposes)."""
    for n in _fp8_names(m):
        want = _block_cast(values[n].detach(), recipe)
        for suffix, w in zip(("", "_scale_inv", "_t", "_scale_inv_t", "_amax"), want, strict=True):
            if suffix == "":
                got = m.get_parameter(n)
            elif suffix.endswith("_t") and recipe is BLOCK:
                assert f"{n}{suffix}" not in dict(m.named_buffers())
                got = m.get_parameter(n) if suffix == "_t" else m.get_buffer(f"{n}_scale_inv")
                got = got.transpose(-2, -1)
            else:
                got = m.get_buffer(n + suffix)
            got, w = got.detach(), w.detach()
            if w.element_size() == 1:  # FP8 codes (or uint8 bytes), E8M0 scales
                got, w = got.view(torch.uint8), w.view(torch.uint8)
            assert torch.equal(got, w), n + suffix


def _kept_values(m, n, suffix=""):
    """FP8 weight ``n``'s values, fp32, from its codes and scales (``suffix="_t"``: from the
    dgrad GEMM's kept copy, ``[in, out]``; a grouped ``[G, ...]`` weight expert by expert)."""
    codes = m.get_buffer(n + suffix) if suffix else m.get_parameter(n).detach()
    scale = m.get_buffer(f"{n}_scale_inv{suffix}")
    if codes.dim() == 3:
        return torch.stack([_values(c, s) for c, s in zip(codes, scale, strict=True)])
    return _values(codes, scale)


def _values(codes, scale):
    if scale.dtype == torch.uint8:  # MXFP8's E8M0 scales
        return te.functional.dequantize_mxfp8(codes, scale, torch.float32)
    rows = 128 if scale.shape[0] != codes.shape[0] else 1
    scale = scale.repeat_interleave(rows, 0).repeat_interleave(128, 1)
    return codes.float() * scale[: codes.shape[0], : codes.shape[1]]


@pytest.mark.parametrize("name", MODULES)
def test_block_weights_keep_the_blockwise_cast_of_the_initial_values(name):
    """Under a block-scaled recipe each weight keeps its weight cast (the dgrad GEMM's copy too
    where it is not the transpose: 1x128 and MXFP8 blocks)."""
    hp = _build(name, "cpu")
    for recipe in BLOCK_RECIPES.values():
        m = _primary(name, "cpu", recipe, preserve=True)
        _assert_kept_cast_of(m, {n: getattr(hp, n) for n in _fp8_names(m)}, recipe)
        for n in _fp8_names(m):
            assert torch.equal(getattr(m, n).get_high_precision_init_val(), getattr(hp, n).detach())
            assert getattr(m, n).element_size() == 1


def _block_pair(m, hp, device):
    """``m`` (Float8BlockScaling FP8 weights) with FP8MasterWeights, and ``hp`` (high-precision
    weights) given their values (exact in bf16: codes times power-of-two scales) and fp32
    ``main_grad`` buffers."""
    te.FP8MasterWeights(m)
    with torch.no_grad():
        for n in _fp8_names(m):
            w = _kept_values(m, n)
            assert torch.equal(w.bfloat16().float(), w), n  # exact in bf16
            hp.get_parameter(n).copy_(w)
            hp.get_parameter(n).main_grad = torch.zeros(w.shape, device=device)
    return m, hp


def _step_both(m, hp, device, recipe):
    """One fwd+bwd of the FP8-weight module ``m`` and the high-precision ``hp`` on the same
    input and output gradient; the outputs are equal. Returns the two inputs."""
    x = _x(device).requires_grad_()
    x0 = x.detach().clone().requires_grad_()
    with autocast(recipe=recipe):
        y, y0 = m(x), hp(x0)
    assert torch.equal(y, y0)
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    return x, x0, g


def _assert_same_step(m, hp, device, recipe=BLOCK):
    """:func:`_step_both`, and the same input gradient, weight gradient (``main_grad``) and
    other gradients, exactly."""
    x, x0, _ = _step_both(m, hp, device, recipe)
    assert torch.equal(x.grad, x0.grad)
    for n in _fp8_names(m):
        w, w0 = m.get_parameter(n), hp.get_parameter(n)
        assert w.main_grad.any() and w.grad is None, n
        assert torch.equal(w.main_grad, w0.main_grad), n
    for (n, p), p0 in zip(m.named_parameters(), hp.parameters(), strict=True):
        if p.dtype != E4M3:
            assert torch.equal(p.grad, p0.grad), n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", MODULES)
def test_block_forward_and_gradients_match_the_dequantised_weights(device, name):
    """Under Float8BlockScaling the module with FP8 weights computes what the module with
    high-precision weights equal to their values computes (its cast of them gives the same
    blocks back): the same output, input gradient and fp32 weight gradient, exactly."""
    hp = _build(name, device, fuse_wgrad_accumulation=True)
    _assert_same_step(*_block_pair(_primary(name, device, BLOCK), hp, device), device)


@pytest.mark.parametrize("device", DEVICES)
def test_block_ops_linear_matches_the_dequantised_weight(device):
    hp = _ops_linear(device, accumulate_into_main_grad=True)
    _assert_same_step(*_block_pair(_ops_linear(device, BLOCK), hp, device), device)


@pytest.mark.parametrize("recipe", [BLOCK_1D, MXFP8], ids=["block_1x128", "mxfp8"])
def test_block_1d_weights_dgrad_reads_the_kept_second_cast(recipe):
    """1-D weight blocks (1x128, MXFP8's 1x32): the forward reads the codes (what the
    high-precision module of their values computes, exactly), the dgrad GEMM the kept cast
    along the other dim (``weight_t``), against float64 of the quantised gradient times its
    values; the weight gradient reads no weight (exactly the high-precision module's)."""
    from te_compile.functional.gemm import qdq_both
    from te_compile.quantization.gemm import recipe_specs

    m = _primary("Linear", "cpu", recipe)
    hp = _build("Linear", "cpu", fuse_wgrad_accumulation=True)
    te.FP8MasterWeights(m)
    spec = recipe_specs(recipe)[2]  # the gradient's (not emulated on CPU: the same casts)
    with torch.no_grad():
        hp.weight.copy_(_kept_values(m, "weight"))
    hp.weight.main_grad = torch.zeros(hp.weight.shape)
    x, _, g = _step_both(m, hp, "cpu", recipe)
    assert torch.equal(m.weight.main_grad, hp.weight.main_grad)
    g_q = qdq_both(g.float(), spec, columnwise=False)[0]
    w_t = _kept_values(m, "weight", "_t")
    assert_close(x.grad, g_q.double() @ w_t.double().T, torch.bfloat16)


@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES.values()), ids=list(BLOCK_RECIPES))
def test_block_master_step_requantises_and_training_tracks_high_precision(recipe):
    """FP8MasterWeights.step re-quantises each fp32 master into the codes and buffers by the
    recipe's weight cast; the losses track the high-precision module."""
    m = _primary("LayerNormMLP", "cpu", recipe, preserve=True)
    before = {n: getattr(m, n).detach().clone() for n in _fp8_names(m)}
    losses, masters = _train(m, recipe, 4, primary=True)
    hp = _build("LayerNormMLP", "cpu", fuse_wgrad_accumulation=True)
    ref, _ = _train(hp, recipe, 4, False)
    _assert_kept_cast_of(m, {e.name: e.master for e in masters._entries}, recipe)
    assert all(not torch.equal(getattr(m, n), w) for n, w in before.items())
    assert losses[-1] < losses[0]
    assert_close(losses, ref, torch.bfloat16, roundings=chain_roundings(torch.bfloat16, 4))


@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES.values()), ids=list(BLOCK_RECIPES))
@pytest.mark.parametrize("name", MODULES)
def test_block_state_dict_round_trip_and_high_precision_load(name, recipe):
    fresh = _round_trip(name, recipe)
    torch.manual_seed(5)
    hp = _build(name, "cpu")
    with torch.no_grad():
        for p in hp.parameters():
            p.normal_(0, 0.05)
    fresh.load_state_dict(hp.state_dict(), strict=False)  # quantised by the blocks
    _assert_kept_cast_of(fresh, {n: getattr(hp, n) for n in _fp8_names(fresh)}, recipe)
    with torch.no_grad(), autocast(recipe=recipe):
        assert torch.equal(fresh(_x("cpu", 3)), hp(_x("cpu", 3)))


def test_block_reset_parameters_requantises_and_in_place_writes_are_refused():
    with te.quantized_model_init(recipe=BLOCK, preserve_high_precision_init_val=True):
        m = te.Linear(64, 32)
    torch.manual_seed(123)
    m.reset_parameters()
    _assert_kept_cast_of(m, {"weight": m.weight.get_high_precision_init_val()})
    with torch.no_grad():
        m.weight.detach().copy_(torch.randn(m.weight.shape))
    with pytest.raises(RuntimeError, match="'weight' was written in place"), autocast(recipe=BLOCK):
        m(torch.randn(4, 64))


@pytest.mark.parametrize(
    ("name", "recipe"),
    [("Linear", BLOCK), ("LayerNormMLP", BLOCK), ("LayerNormMLP", MXFP8)],
    ids=["Linear-block", "LayerNormMLP-block", "LayerNormMLP-mxfp8"],
)
def test_block_compiled_step_one_graph_values_as_eager(name, recipe):
    _assert_compiled_step_as_eager(lambda: _primary(name, "cpu", recipe), recipe)


# Without stochastic rounding: two modules' backward passes draw different random words.
NVFP4 = NVFP4BlockScaling(disable_stochastic_rounding=True)
NVFP4_1D = NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [NVFP4, NVFP4_1D], ids=["16x16", "1x16"])
@pytest.mark.parametrize("name", MODULES)
def test_nvfp4_forward_and_gradients_match_the_high_precision_module(name, recipe, device):
    """NVFP4BlockScaling: the kept elements, block scales (of 16x16 tiles, the recipe's
    default, whose columnwise copy is the transpose; or of 1x16 blocks, with a columnwise copy
    kept) and global scale are the cast the high-precision module makes each step, so the
    output, input gradient and fp32 weight gradient are equal, exactly; the values are those of
    ``te.quantize(w, recipe, role="weight")`` dequantised."""
    hp = _build(name, device, fuse_wgrad_accumulation=True)
    m = _primary(name, device, recipe)
    te.FP8MasterWeights(m)
    for n in _fp8_names(m):
        getattr(hp, n).main_grad = torch.zeros(getattr(hp, n).shape, device=device)
        w = getattr(hp, n).detach()
        q = te.quantize(w, recipe, role="weight")
        expected = te.dequantize(q, torch.float32)
        assert torch.equal(_weight_values(m, n), expected), n
        assert m.get_parameter(n).element_size() == 1  # an E2M1 value a byte
    _assert_same_step(m, hp, device, recipe)


def test_nvfp4_compiled_step_one_graph_values_as_eager():
    _assert_compiled_step_as_eager(lambda: _primary("Linear", "cpu", NVFP4), NVFP4)


def _weight_values(m, n):
    from te_compile.quantization.primary import weight_values

    return weight_values(m, n, torch.float32)


def test_nvfp4_weights_train_save_and_load():
    """FP8MasterWeights refreshes the NVFP4 weight from its fp32 master after each step (the
    loss falls); the state_dict round-trips the elements and scales; a bf16 checkpoint loads
    quantised."""
    m = _primary("Linear", "cpu", NVFP4)
    losses, _ = _train(m, NVFP4, 4, True)
    assert losses[-1] < losses[0]
    fresh = _primary("Linear", "cpu", NVFP4)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(_weight_values(fresh, "weight"), _weight_values(m, "weight"))
    hp = _build("Linear", "cpu")
    fresh.load_state_dict(hp.state_dict())
    q = te.quantize(hp.weight.detach(), NVFP4, role="weight")
    assert torch.equal(_weight_values(fresh, "weight"), te.dequantize(q, torch.float32))


def test_block_refused_uses():
    """A weight's recipe family is the autocast's (Transformer Engine's "Recipe mismatch"), the
    same weight blocks; MXFP8's 32x32 tiles are refused, dense and grouped, and NVFP4's tiles
    and 1x16 blocks serve only their own recipe."""
    m, per_tensor = (
        _primary("Linear", "cpu", BLOCK),
        _primary("Linear", "cpu", Float8CurrentScaling()),
    )
    with (
        autocast(recipe=Float8CurrentScaling()),
        pytest.raises(NotImplementedError, match=r"Recipe mismatch.*Float8BlockScaling blocks"),
    ):
        m(_x("cpu"))
    with autocast(recipe=BLOCK), pytest.raises(NotImplementedError, match="per-tensor FP8 codes"):
        per_tensor(_x("cpu"))
    with (
        autocast(recipe=Float8BlockScaling(w_block_scaling_dim=1)),
        pytest.raises(NotImplementedError, match="holds 128x128 blocks"),
    ):
        m(_x("cpu"))
    with autocast(recipe=MXFP8), pytest.raises(NotImplementedError, match="Recipe mismatch"):
        m(_x("cpu"))
    mx = _primary("Linear", "cpu", MXFP8)
    with autocast(recipe=BLOCK), pytest.raises(NotImplementedError, match="holds MXFP8 blocks"):
        mx(_x("cpu"))
    other = MXFP8BlockScaling(enable_2d_quantization=True)
    with pytest.raises(NotImplementedError, match=f"recipe.*got {type(other).__name__}"):
        _primary("Linear", "cpu", other)
    for other in (MXFP8BlockScaling(enable_2d_quantization=True),):
        for build in (lambda: te.GroupedLinear(G, 64, 32), lambda: te.ops.GroupedLinear(G, 64, 32)):
            with (
                te.quantized_model_init(recipe=other),
                pytest.raises(NotImplementedError, match=f"recipe.*got {type(other).__name__}"),
            ):
                build()
    nv = _primary("Linear", "cpu", NVFP4BlockScaling())
    nvfp4_1d = NVFP4BlockScaling(disable_2d_quantization=True)
    with autocast(recipe=nvfp4_1d), pytest.raises(NotImplementedError, match="holds 16x16 blocks"):
        nv(_x("cpu"))
    with autocast(recipe=NVFP4), pytest.raises(NotImplementedError, match="holds 1x16 blocks"):
        _primary("Linear", "cpu", nvfp4_1d)(_x("cpu"))


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "GroupedLinear"])
def test_a_recipe_with_other_fields_warns_that_the_quantizer_is_updated(name):
    """Transformer Engine's ``Quantizer is being updated`` warning: FP8 weights made under one
    recipe run under an unequal one (its test_quantizer_update: another amax history length),
    once a module (LayerNormMLP's two weights: one warning) and again only for a recipe unequal
    to the last; an equal recipe object and the same object are silent, and so is a module
    without FP8 weights. The codes stay as they were."""
    build = (lambda r: _grouped("cpu", r)) if name == "GroupedLinear" else (
        lambda r: _primary(name, "cpu", r))  # fmt: skip
    m = build(DelayedScaling(amax_history_len=1024))
    codes = {n: p.detach().clone() for n, p in m.named_parameters() if p.dtype == E4M3}
    args = (SPLITS,) if name == "GroupedLinear" else ()
    x = _x("cpu")

    def warned(recipe):
        with warnings.catch_warnings(record=True) as seen, autocast(recipe=recipe):
            warnings.simplefilter("always")
            m(x, *args)
        return [w for w in seen if "Quantizer is being updated" in str(w.message)]

    short = DelayedScaling(amax_history_len=1)
    first = warned(short)
    assert len(first) == 1 and first[0].filename == __file__, [str(w.message) for w in first]
    assert "amax_history_len=1024" in str(first[0].message)
    assert warned(short) == [] and warned(DelayedScaling(amax_history_len=1)) == []
    assert len(warned(DelayedScaling())) == 1
    assert all(torch.equal(p, codes[n]) for n, p in m.named_parameters() if n in codes)
    hp = _build("Linear", "cpu")
    with warnings.catch_warnings(record=True) as seen, autocast(recipe=DelayedScaling()):
        warnings.simplefilter("always")
        hp(x)
    assert not [w for w in seen if "Quantizer is being updated" in str(w.message)]


# GroupedLinear ---------------------------------------------------------------------------------

G, SPLITS = 3, [40, 0, 56]  # an expert without tokens


def _grouped(device, recipe=None, single=False, preserve=False, **kw):
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": device, "single_grouped_weight": single, **kw}
    if recipe is None:
        return te.GroupedLinear(G, 128, 64, **kw)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return te.GroupedLinear(G, 128, 64, **kw)


def _dequantized(m):
    """Each group's FP8 weight as the float64 values it stands for, ``[G, out, in]``."""
    if m.single_grouped_weight:
        return m.weight.detach().double() * m.weight_scale_inv.double()
    codes = [getattr(m, f"weight{i}").detach().double() for i in range(G)]
    scales = [getattr(m, f"weight{i}_scale_inv").double() for i in range(G)]
    return torch.stack([c * s for c, s in zip(codes, scales, strict=True)])


@pytest.mark.parametrize(
    "recipe", [Float8CurrentScaling, Float8BlockScaling], ids=["current", "block"]
)
@pytest.mark.parametrize("layout", ["Linear", "GroupedLinear", "GroupedLinear_single"])
def test_high_precision_backward_dgrad_reads_the_weight_values(layout, recipe):
    """``backward_override="high_precision"`` with FP8 weights, as Transformer Engine runs it:
    the forward GEMM reads the codes (the output without the override, exactly), the dgrad GEMM
    the weight's values in the input dtype (against float64 of the output gradient times them),
    the wgrad GEMM the high-precision input (``main_grad`` as the module with bf16 weights
    computes it, exactly); without FP8MasterWeights ``.grad`` gets it in the nominal dtype."""
    override = recipe(backward_override="high_precision")
    grouped, args = layout != "Linear", (SPLITS,) if layout != "Linear" else ()
    if grouped:
        single, fuse = layout.endswith("single"), {"fuse_wgrad_accumulation": True}
        m, hp = _grouped("cpu", recipe(), single=single), _grouped("cpu", single=single, **fuse)
        rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SPLITS))
    else:
        m = _primary("Linear", "cpu", recipe())
        hp = _build("Linear", "cpu", fuse_wgrad_accumulation=True)
    if recipe is Float8BlockScaling:
        values = torch.stack([_kept_values(m, n) for n in _fp8_names(m)]).reshape(-1, 64, 128)
    elif grouped:
        values = _dequantized(m)
    else:
        values = m.weight.detach().double() * m.weight_scale_inv.double()
    values = values.squeeze(0).bfloat16().double()  # as the op reads them: in the input dtype
    plain = copy.deepcopy(m)
    te.FP8MasterWeights(m)
    if grouped:
        hp.allocate_main_grad()
    else:
        hp.weight.main_grad = torch.zeros(hp.weight.shape)
    x = _x("cpu").requires_grad_()
    x0 = x.detach().clone().requires_grad_()
    with autocast(recipe=override):
        y, y0 = m(x, *args), hp(x0, *args)
    with autocast(recipe=recipe()):
        assert torch.equal(y, plain(x.detach(), *args))
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    if grouped:  # each token's row of dY times its expert's weight values
        expected = torch.einsum("tn,tnk->tk", g.double(), values[rows])
    else:
        expected = g.double() @ values
    assert_close(x.grad, expected, torch.bfloat16, reduced=True)
    for n in _fp8_names(m):  # (the expert without tokens: a zero gradient)
        w, w0 = m.get_parameter(n), hp.get_parameter(n)
        assert w.grad is None and torch.equal(w.main_grad, w0.main_grad), n
    assert m.get_parameter(_fp8_names(m)[-1]).main_grad.any()
    frozen = copy.deepcopy(plain).requires_grad_(False)  # the input's gradient still reads them
    x1 = x.detach().clone().requires_grad_()
    with autocast(recipe=override):
        frozen(x1, *args).backward(g)
    assert torch.equal(x1.grad, x.grad)
    with autocast(recipe=override):  # no main_grad: .grad in the nominal dtype
        plain(x.detach(), *args).float().square().mean().backward()
    assert all(plain.get_parameter(n).grad.dtype == torch.bfloat16 for n in _fp8_names(plain))


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_weights_are_fp8_codes_with_a_scale_per_weight(single):
    """``weight{i}``: the current-scaling cast of group i's initial values, its own scale;
    ``single_grouped_weight``: one cast (one scale) of the whole ``[G, out, in]`` weight."""

    def spread():  # an init_method drawing the groups far apart in amax, so in scale
        stds = iter([0.01, 0.02, 0.04])
        return lambda w: w.normal_(0.0, next(stds))

    hp = _grouped("cpu", single=single, init_method=spread())
    m = _grouped("cpu", Float8CurrentScaling(), single=single, preserve=True, init_method=spread())
    names = [f"weight{i}" for i in range(G)] if not single else ["weight"]
    assert _fp8_names(m) == names
    for n in names:
        init = getattr(hp, n).detach()
        assert torch.equal(getattr(m, n).get_high_precision_init_val(), init)
        flat = init.reshape(-1, init.shape[-1])
        codes = te.functional.quantize_weight(flat, "current:e4m3")
        assert torch.equal(getattr(m, n).detach().view(torch.uint8).reshape(flat.shape), codes[0])
        assert torch.equal(getattr(m, f"{n}_scale_inv"), codes[1])
    scales = {getattr(m, f"{n}_scale_inv").item() for n in names}
    assert len(scales) == len(names)  # per-group weights: a scale each


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [Float8CurrentScaling, DelayedScaling])
@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_forward_and_gradients_against_float64(device, recipe, single):
    """Output, input gradient and the weight gradient (into ``main_grad``) against the float64
    GEMMs of the weights the codes stand for, within the recipe's bounds; bias gradients as
    usual; ``weight.grad`` stays None."""
    m = _grouped(device, recipe(), single=single)
    te.FP8MasterWeights(m)
    x = _x(device).requires_grad_()
    with autocast(recipe=recipe()):
        y = m(x, SPLITS)
    g = torch.randn_like(y)
    y.backward(g)
    w, xd, gd = _dequantized(m).cpu(), x.detach().cpu().double(), g.cpu().double()
    bias = torch.stack([getattr(m, f"bias{i}").detach().cpu().double() for i in range(G)])
    rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SPLITS))
    y_ref = torch.einsum("mk,mnk->mn", xd, w[rows]) + bias[rows]
    dx_ref = torch.einsum("mn,mnk->mk", gd, w[rows])
    dw_ref = torch.stack([gd[rows == i].T @ xd[rows == i] for i in range(G)])
    assert_close_quantized(y, y_ref, "current")
    assert_close_quantized(x.grad, dx_ref, "current", grad=True)
    main_grad = m.weight.main_grad if single else torch.stack([getattr(m, f"weight{i}").main_grad
                                                               for i in range(G)])  # fmt: skip
    assert_close_quantized(main_grad, dw_ref, "current", grad=True)
    assert not main_grad[1].any()  # the expert without tokens
    for i in range(G):
        assert_close(getattr(m, f"bias{i}").grad, gd[rows == i].sum(0), torch.bfloat16,
                     reduced=True)  # fmt: skip
    assert all(getattr(m, n).grad is None for n in _fp8_names(m))


@pytest.mark.parametrize("recipe", [Float8CurrentScaling, DelayedScaling])
def test_grouped_training_tracks_high_precision_weights(recipe):
    """SGD steps with FP8 primary weights track the same recipe on bf16 weights, and after each
    step every ``weight{i}`` holds the cast of its fp32 master."""
    hp = _grouped("cpu", fuse_wgrad_accumulation=True)
    m = _grouped("cpu", recipe(), preserve=True)
    losses, masters = _train(m, recipe(), 4, True, SPLITS)
    ref, _ = _train(hp, recipe(), 4, False, SPLITS)
    assert losses[-1] < losses[0]
    assert_close(losses, ref, torch.bfloat16, roundings=chain_roundings(torch.bfloat16, 4))
    for module, name, master, _ in masters._entries:
        codes = te.functional.quantize_weight(master, "current:e4m3")
        assert torch.equal(getattr(module, name).detach().view(torch.uint8), codes[0])
        assert torch.equal(getattr(module, f"{name}_scale_inv"), codes[1])
        assert not getattr(module, name).main_grad.any()


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_one_group_is_a_linear(single):
    """``num_gemms=1`` (a ``weight0`` ``[out, in]``, or ``weight`` ``[1, out, in]``): output,
    input gradient and weight gradient of ``te.Linear`` with the same FP8 weight, within the
    recipe's bounds (the grouped GEMM scales its input per row, the dense one per tensor)."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe):
        grouped = te.GroupedLinear(1, 128, 64, bias=False, params_dtype=torch.bfloat16,
                                   single_grouped_weight=single)  # fmt: skip
        dense = te.Linear(128, 64, bias=False, params_dtype=torch.bfloat16)
    name = "weight" if single else "weight0"
    with torch.no_grad():
        dense.weight.copy_(getattr(grouped, name).reshape(dense.weight.shape))
        dense.weight_scale_inv.copy_(getattr(grouped, f"{name}_scale_inv"))
        dense.weight_amax.copy_(getattr(grouped, f"{name}_amax"))
    te.FP8MasterWeights(grouped), te.FP8MasterWeights(dense)
    x = _x("cpu").requires_grad_()
    x0 = x.detach().clone().requires_grad_()
    with autocast(recipe=recipe):
        y, y0 = grouped(x, [x.shape[0]]), dense(x0)
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    assert_close_quantized(y, y0.double(), "current")
    assert_close_quantized(x.grad, x0.grad.double(), "current", grad=True)
    main_grad = getattr(grouped, name).main_grad.reshape(dense.weight.shape)
    assert_close_quantized(main_grad, dense.weight.main_grad.double(), "current", grad=True)


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_state_dict_round_trip_and_layout(single):
    """The codes and their scales round-trip; a state_dict of FP8 weights in the other layout
    (whose scales differ) is refused by name."""
    recipe = Float8CurrentScaling()
    m = _grouped("cpu", recipe, single=single)
    _train(m, recipe, 2, True, SPLITS)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    fresh = _grouped("cpu", recipe, single=single)
    fresh.load_state_dict(state)
    with autocast(recipe=recipe), torch.no_grad():
        assert torch.equal(fresh(_x("cpu", 7), SPLITS), m(_x("cpu", 7), SPLITS))
    other = _grouped("cpu", recipe, single=not single)
    entry = "weight0" if not single else "weight"
    with pytest.raises(ValueError, match=f"state_dict entry '{entry}' holds FP8 primary weights"):
        other.load_state_dict(state)


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_compiled_step_one_graph_values_as_eager(single):
    recipe = Float8CurrentScaling()
    _assert_compiled_step_as_eager(lambda: _grouped("cpu", recipe, single=single), recipe, SPLITS)


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
@pytest.mark.parametrize(
    "recipe",
    [Float8CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling],
    ids=["current", "delayed", "block", "mxfp8"],
)
def test_grouped_delay_wgrad_compute_gives_the_backward_s_main_grad(recipe, single):
    """delay_wgrad_compute=True: the backward leaves main_grad alone, backward_dw() adds the
    weight gradient the backward would have added, bit for bit, over two steps."""
    runs = []
    for delay in (False, True):
        m = _grouped("cpu", recipe(), single=single, delay_wgrad_compute=delay)
        te.FP8MasterWeights(m)
        main_grad = m.weight.main_grad if single else m._main_grad_buffer
        for step in range(2):
            x = _x("cpu", step).requires_grad_()
            with autocast(recipe=recipe()):
                m(x, SPLITS).float().square().sum().backward()
            if delay:
                before = main_grad.clone()
                m.backward_dw()
                assert not torch.equal(main_grad, before)
        runs.append((main_grad.clone(), x.grad))
    (g0, dx0), (g1, dx1) = runs
    assert torch.equal(g1, g0) and torch.equal(dx1, dx0)
    assert g0.abs().sum() > 0


@pytest.mark.parametrize(
    "recipe",
    [Float8CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling],
    ids=["current", "delayed", "block", "mxfp8"],
)
@pytest.mark.parametrize("delay", [False, True], ids=["", "delay_wgrad"])
def test_grouped_weights_own_main_grads_get_the_buffer_s_gradient(recipe, delay):
    """Each weight{i} with a main_grad of its own (set by the user, as Transformer Engine's tests
    and Megatron-LM's gradient buffers do, not FP8MasterWeights' views): the backward adds the
    weight gradient into each one, bit for bit what FP8MasterWeights' buffer receives, over two
    steps, and leaves it alone without a gradient to give."""
    runs = []
    for own in (False, True):
        m = _grouped("cpu", recipe(), delay_wgrad_compute=delay, fuse_wgrad_accumulation=True)
        start = [torch.rand(64, 128, generator=torch.Generator().manual_seed(i)) for i in range(G)]
        if own:
            for i, g0 in enumerate(start):
                getattr(m, f"weight{i}").main_grad = g0.clone()
        else:  # the buffer starts from the same values
            te.FP8MasterWeights(m)
            m._main_grad_buffer.copy_(torch.stack(start))
        for step in range(2):
            x = _x("cpu", step).requires_grad_()
            with autocast(recipe=recipe()):
                m(x, SPLITS).float().square().sum().backward()
            if delay:
                m.backward_dw()
        grads = _grouped_main_grads(m)
        runs.append((grads, x.grad))
    (expected, dx0), (got, dx1) = runs
    assert torch.equal(got, expected) and torch.equal(dx1, dx0)
    assert not torch.equal(got, torch.stack(start))  # a gradient arrived
    with torch.no_grad(), autocast(recipe=recipe()):  # no gradient wanted: untouched
        m(_x("cpu"), SPLITS)
    assert torch.equal(_grouped_main_grads(m), got)


def test_grouped_refused_uses():
    recipe = Float8CurrentScaling()
    m = _grouped("cpu", recipe)
    calibrating = autocast(enabled=False, calibrating=True)
    with torch.no_grad(), calibrating, pytest.raises(NotImplementedError, match="calibration"):
        m(_x("cpu"), SPLITS)
    with autocast(recipe=recipe), torch.no_grad():  # inference needs no masters
        assert m(_x("cpu"), SPLITS).isfinite().all()
    x = _x("cpu")
    with autocast(recipe=recipe):  # no FP8MasterWeights: each weight's .grad, as in TE
        m(x, SPLITS).float().sum().backward()
    rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SPLITS))
    for i in range(G):
        grad = m.get_parameter(f"weight{i}").grad
        assert grad.dtype == torch.bfloat16
        dw = x[rows == i].double().sum(0).expand(grad.shape)
        assert_close_quantized(grad, dw, "current", grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mlp_fp8_weights_train_and_compile(device):
    """GroupedMLP's FC1 and FC2 hold FP8 weights: the output and input gradient against the
    float64 MLP of the weights the codes stand for (two quantised GEMMs), the loss falls under
    FP8MasterWeights, and the compiled step is one graph."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe):
        m = te.GroupedMLP(G, 128, 96, params_dtype=torch.bfloat16, device=device,
                          single_grouped_parameter=False)  # fmt: skip
    assert _fp8_names(m) == [f"fc{j}.weight{i}" for j in (1, 2) for i in range(G)]
    masters = te.FP8MasterWeights(m)
    x = _x(device).requires_grad_()
    with autocast(recipe=recipe):
        y = m(x, SPLITS)
    g = torch.randn_like(y)
    y.backward(g)
    rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SPLITS))
    w1, w2 = _dequantized(m.fc1).cpu()[rows], _dequantized(m.fc2).cpu()[rows]
    xd = x.detach().cpu().double().requires_grad_()
    a, b = torch.einsum("mk,mnk->mn", xd, w1).chunk(2, dim=-1)
    y_ref = torch.einsum("mk,mnk->mn", torch.nn.functional.silu(a) * b, w2)
    y_ref.backward(g.cpu().double())
    assert_close_quantized(y, y_ref, "current", gemms=2)
    assert_close_quantized(x.grad, xd.grad, "current", gemms=2, grad=True)
    opt = torch.optim.SGD(masters.parameters(), lr=0.5)
    opt.zero_grad()
    for n in _fp8_names(m):
        m.get_parameter(n).main_grad.zero_()

    def loss_fn(module, inp):  # a row's sum: gradients that move the FP8 codes at this lr
        with autocast(recipe=recipe):
            return module(inp, SPLITS).float().square().sum(-1).mean()

    losses = []
    for _step in range(3):
        loss = loss_fn(m, _x(device))
        loss.backward()
        masters.step(opt)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert_single_graph(loss_fn, m, _x(device))


# GroupedLinear, GroupedMLP, te.ops.GroupedLinear under the block-scaled recipes ----------------

LAYOUTS = {"ids": ["per_group", "single"], "argvalues": [False, True]}


@pytest.mark.parametrize("single", **LAYOUTS)
@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES.values()), ids=list(BLOCK_RECIPES))
def test_grouped_block_weights_keep_each_expert_s_cast(recipe, single):
    """Each expert's weight keeps its block cast, as a dense weight does (the single ``[G, out,
    in]`` weight: every expert cast on its own, no block across two, the tensors stacked)."""
    hp = _grouped("cpu", single=single)
    m = _grouped("cpu", recipe, single=single, preserve=True)
    names = ["weight"] if single else [f"weight{i}" for i in range(G)]
    assert _fp8_names(m) == names
    _assert_kept_cast_of(m, {n: getattr(hp, n) for n in names}, recipe)


def _grouped_block_step(m, hp, recipe, device="cpu"):
    """``m`` (grouped FP8 weights in blocks) with FP8MasterWeights and ``hp`` (bf16 weights equal
    to their values, exact in bf16) with a main_grad buffer: one step each on the same input
    and output gradient. The outputs, weight gradients (no weight read) and bias gradients are
    equal; returns ``(x, x0, g)``."""
    te.FP8MasterWeights(m)
    with torch.no_grad():
        for n in _fp8_names(m):
            w = _kept_values(m, n)
            assert torch.equal(w.bfloat16().float(), w), n
            hp.get_parameter(n).copy_(w)
    hp.allocate_main_grad()
    x = _x(device).requires_grad_()
    x0 = x.detach().clone().requires_grad_()
    with autocast(recipe=recipe):
        y, y0 = m(x, SPLITS), hp(x0, SPLITS)
    assert torch.equal(y, y0)
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    assert m._main_grad_buffer.any()
    assert torch.equal(m._main_grad_buffer, hp._main_grad_buffer)
    for n in _fp8_names(m):
        assert m.get_parameter(n).grad is None, n
    for b, b0 in zip(m.biases(), hp.biases(), strict=True):
        assert torch.equal(b.grad, b0.grad)
    return x, x0, g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("single", **LAYOUTS)
@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES.values()), ids=list(BLOCK_RECIPES))
def test_grouped_block_forward_and_gradients_match_the_dequantised_weights(recipe, single, device):
    """The grouped GEMM takes each expert's kept codes (native: Float8BlockScaling's 1x128 weight
    blocks on Hopper) or their values (emulated): what the module with bf16 weights equal to
    them computes, exactly (output, weight and bias gradients). The input
    gradient too for 128x128 blocks (the same values both ways); with 1-D blocks (1x128,
    MXFP8's 1x32) the dgrad GEMM reads the kept cast along the other dim (``weight_t``), where
    the bf16 module casts its weight again: against float64 of the quantised gradient times
    those values."""
    from te_compile.functional.gemm import qdq_both
    from te_compile.quantization.gemm import recipe_specs

    m = _grouped(device, recipe, single=single)
    hp = _grouped(device, single=single, fuse_wgrad_accumulation=True)
    x, x0, g = _grouped_block_step(m, hp, recipe, device)
    if recipe is BLOCK:
        assert torch.equal(x.grad, x0.grad)
        return
    names = _fp8_names(m)
    w_t = torch.cat([_kept_values(m, n, "_t").reshape(-1, 128, 64) for n in names]).cpu()
    rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SPLITS))
    g_q = qdq_both(g.float(), recipe_specs(recipe)[2], columnwise=False)[0].cpu()
    dx_ref = torch.einsum("mn,mkn->mk", g_q.double(), w_t.double()[rows])
    # reduced: a GPU GEMM's accumulation order moves the elements that cancel to near zero.
    assert_close(x.grad, dx_ref, torch.bfloat16, reduced=True)
    if recipe is MXFP8:  # here the bf16 module's second cast differs
        assert not torch.equal(x.grad, x0.grad)


@pytest.mark.parametrize("single", **LAYOUTS)
@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES.values()), ids=list(BLOCK_RECIPES))
def test_grouped_block_master_step_requantises_and_training_tracks_high_precision(recipe, single):
    """FP8MasterWeights.step re-quantises each expert's fp32 master into its codes and buffers;
    the losses track the bf16 module's; both layouts train alike, bit for bit (the same blocks
    per expert)."""
    m = _grouped("cpu", recipe, single=single, preserve=True)
    losses, masters = _train(m, recipe, 4, True, SPLITS)
    _assert_kept_cast_of(m, {e.name: e.master for e in masters._entries}, recipe)
    assert not _grouped_main_grads(m).any()
    assert losses[-1] < losses[0]
    if single:
        other, _ = _train(_grouped("cpu", recipe, preserve=True), recipe, 4, True, SPLITS)
        assert torch.equal(losses, other)
        return
    ref, _ = _train(_grouped("cpu", fuse_wgrad_accumulation=True), recipe, 4, False, SPLITS)
    assert_close(losses, ref, torch.bfloat16, roundings=chain_roundings(torch.bfloat16, 4))


@pytest.mark.parametrize("single", **LAYOUTS)
@pytest.mark.parametrize("recipe", [NVFP4, NVFP4_1D], ids=["16x16", "1x16"])
def test_grouped_nvfp4_weights_step_as_the_high_precision_module_and_train(recipe, single):
    """NVFP4BlockScaling primary weights on GroupedLinear: each expert keeps its own cast (E2M1
    values, block or tile scales, its own global scale), the values of ``te.quantize(w_i,
    recipe, role="weight")``; one step equals the bf16 module's, which casts the same weights
    each step: output, input gradient (with 1x16 blocks the dgrad GEMM reads the kept
    columnwise copy) and ``main_grad``, exactly. FP8MasterWeights trains it; the state_dict
    round-trips."""
    nv_splits = [48, 0, 48]  # NVFP4's grouped GEMMs take multiples of 16 tokens
    # Normal draws in float32: under torch 2.11 the default init of a bf16 weight gave every
    # expert the same amax (0.0762, 3.3 std: the tail of its bf16 normals looks capped).
    init = {"init_method": lambda w: w.copy_(torch.randn(w.shape) * 0.02)}
    m = _grouped("cpu", recipe, single=single, **init)
    hp = _grouped("cpu", single=single, fuse_wgrad_accumulation=True, **init)
    experts = [hp.weight[i] for i in range(G)] if single else list(hp.weights())
    kept = torch.cat([_weight_values(m, n).reshape(-1, 64, 128) for n in _fp8_names(m)])
    for i, w in enumerate(experts):
        q = te.quantize(w.detach(), recipe, role="weight")
        assert torch.equal(kept[i], te.dequantize(q, torch.float32)), i
    gs = torch.cat([m.get_buffer(f"{n}_amax").flatten() for n in _fp8_names(m)])
    assert gs.numel() == G and len(set(gs.tolist())) == G  # a global scale an expert
    te.FP8MasterWeights(m)
    hp.allocate_main_grad()
    x = _x("cpu").requires_grad_()
    x0 = x.detach().clone().requires_grad_()
    with autocast(recipe=recipe):
        y, y0 = m(x, nv_splits), hp(x0, nv_splits)
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    assert torch.equal(y, y0) and torch.equal(x.grad, x0.grad)
    assert m._main_grad_buffer.any() and torch.equal(m._main_grad_buffer, hp._main_grad_buffer)
    m = _grouped("cpu", recipe, single=single)
    losses, _ = _train(m, recipe, 4, True, nv_splits)
    assert losses[-1] < losses[0]
    fresh = _grouped("cpu", recipe, single=single)
    fresh.load_state_dict(m.state_dict())
    with autocast(recipe=recipe), torch.no_grad():
        assert torch.equal(fresh(_x("cpu", 7), nv_splits), m(_x("cpu", 7), nv_splits))


def _grouped_main_grads(m):
    return torch.stack([m.get_parameter(n).main_grad.reshape(-1, 64, 128) for n in _fp8_names(m)])


@pytest.mark.parametrize("single", **LAYOUTS)
@pytest.mark.parametrize("recipe", list(BLOCK_RECIPES.values()), ids=list(BLOCK_RECIPES))
def test_grouped_block_state_dict_round_trip_and_high_precision_load(recipe, single):
    """The codes and every scale round-trip (the same bytes, the same outputs); a state_dict of
    the bf16 module loads quantised, expert by expert."""
    m = _grouped("cpu", recipe, single=single)
    _train(m, recipe, 2, True, SPLITS)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    fresh = _grouped("cpu", recipe, single=single)
    fresh.load_state_dict(torch.load(buf))
    for (k, v), v0 in zip(fresh.state_dict().items(), m.state_dict().values(), strict=True):
        assert torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v,
                           v0.view(torch.uint8) if v0.element_size() == 1 else v0), k  # fmt: skip
    with autocast(recipe=recipe), torch.no_grad():
        assert torch.equal(fresh(_x("cpu", 7), SPLITS), m(_x("cpu", 7), SPLITS))
    torch.manual_seed(5)
    hp = _grouped("cpu", single=single)
    with torch.no_grad():
        for p in hp.parameters():
            p.normal_(0, 0.05)
    fresh.load_state_dict(hp.state_dict(), strict=False)
    _assert_kept_cast_of(fresh, {n: getattr(hp, n) for n in _fp8_names(fresh)}, recipe)
    with torch.no_grad(), autocast(recipe=recipe):
        assert torch.equal(fresh(_x("cpu", 3), SPLITS), hp(_x("cpu", 3), SPLITS))


@pytest.mark.parametrize(
    ("recipe", "single"), [(BLOCK, False), (MXFP8, True)], ids=["block-per_group", "mxfp8-single"]
)
def test_grouped_block_compiled_step_one_graph_values_as_eager(recipe, single):
    _assert_compiled_step_as_eager(lambda: _grouped("cpu", recipe, single=single), recipe, SPLITS)


def test_grouped_block_refused_uses():
    """The recipe family and the weight blocks are the autocast's, as for dense weights."""
    m = _grouped("cpu", BLOCK)
    te.FP8MasterWeights(m)
    refusals = [
        (Float8CurrentScaling(), r"Recipe mismatch for 'weight'.*Float8BlockScaling blocks"),
        (BLOCK_1D, "holds 128x128 blocks"),
        (MXFP8, "Recipe mismatch"),
    ]
    for recipe, match in refusals:
        with autocast(recipe=recipe), pytest.raises(NotImplementedError, match=match):
            m(_x("cpu"), SPLITS)
    per_tensor = _grouped("cpu", Float8CurrentScaling())
    with (
        autocast(recipe=BLOCK),
        torch.no_grad(),
        pytest.raises(NotImplementedError, match="per-tensor FP8 codes"),
    ):
        per_tensor(_x("cpu"), SPLITS)


def test_grouped_block_operand_of_the_wrong_shape_is_refused_by_name():
    """The emulated grouped GEMM's pre-quantised weight may carry the dgrad copy (``[G, N,
    K]``); another shape is refused, naming it."""
    w = torch.randn(G, 64, 128, dtype=torch.bfloat16)
    spec = "mxfp8:e4m3:emulate"
    q = te.functional.quantize_grouped_weight(w, spec)
    for bad in (w.transpose(1, 2).contiguous(), w.float()):
        with pytest.raises(
            ValueError, match=r"weight_data_t must be torch\.bfloat16 \[3, 64, 128\]"
        ):
            te.functional.grouped_linear(_x("cpu"), SPLITS, w, input_spec=spec, weight_spec=spec,
                                         grad_spec="mxfp8:e5m2:emulate",
                                         weight_quantized=[q[0], q[1], bad, *q[3:]])  # fmt: skip


@pytest.mark.parametrize("recipe", [BLOCK, MXFP8], ids=["block", "mxfp8"])
def test_grouped_mlp_block_fp8_weights_match_and_train(recipe):
    """GroupedMLP's FC1 and FC2 keep block-scaled FP8 weights: the output is the bf16 module's
    of their values, bit for bit; the loss falls under FP8MasterWeights."""

    def build(fp8):
        torch.manual_seed(0)
        kw = {"params_dtype": torch.bfloat16, "single_grouped_parameter": False}
        if not fp8:
            return te.GroupedMLP(G, 128, 128, **kw)
        with te.quantized_model_init(recipe=recipe):
            return te.GroupedMLP(G, 128, 128, **kw)

    m, hp = build(True), build(False)
    assert _fp8_names(m) == [f"fc{j}.weight{i}" for j in (1, 2) for i in range(G)]
    masters = te.FP8MasterWeights(m)
    with torch.no_grad():
        for n in _fp8_names(m):
            module, name = n.split(".")
            hp.get_parameter(n).copy_(_kept_values(getattr(m, module), name))
    with autocast(recipe=recipe), torch.no_grad():
        assert torch.equal(m(_x("cpu"), SPLITS), hp(_x("cpu"), SPLITS))
    opt = torch.optim.SGD(masters.parameters(), lr=0.5)
    losses = []
    for step in range(3):
        with autocast(recipe=recipe):
            loss = m(_x("cpu", step), SPLITS).float().square().sum(-1).mean()
        loss.backward()
        masters.step(opt)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("single", **LAYOUTS)
@pytest.mark.parametrize("recipe", [BLOCK, MXFP8], ids=["block", "mxfp8"])
def test_ops_grouped_linear_block_matches_the_dequantised_weights(recipe, single):
    """te.ops.GroupedLinear with block-scaled FP8 weights computes what the op with bf16 weights
    equal to their values computes: the output and the weight gradient (fp32 main_grad, the
    bf16 op's .grad its rounding) exactly; the input gradient too for 128x128 blocks."""
    flags = {"single_grouped_weight": single, "single_grouped_bias": single}

    def build(fp8):
        torch.manual_seed(0)
        if not fp8:
            return te.ops.GroupedLinear(G, 128, 64, dtype=torch.bfloat16, **flags)
        with te.quantized_model_init(recipe=recipe):
            return te.ops.GroupedLinear(G, 128, 64, dtype=torch.bfloat16, **flags)

    op, hp = build(True), build(False)
    te.FP8MasterWeights(op)
    with torch.no_grad():
        for n in _fp8_names(op):
            hp.get_parameter(n).copy_(_kept_values(op, n))
    x = _x("cpu").requires_grad_()
    x0 = x.detach().clone().requires_grad_()
    with autocast(recipe=recipe):
        y, y0 = te.ops.Sequential(op)(x, SPLITS), te.ops.Sequential(hp)(x0, SPLITS)
    assert torch.equal(y, y0)
    g = torch.randn_like(y)
    y.backward(g)
    y0.backward(g)
    assert (recipe is BLOCK) == torch.equal(x.grad, x0.grad)
    for n in _fp8_names(op):
        main_grad = op.get_parameter(n).main_grad
        assert main_grad.any() or n == "weight1", n  # the expert without tokens
        assert torch.equal(main_grad.bfloat16(), hp.get_parameter(n).grad), n


# te.ops ----------------------------------------------------------------------------------------


def _ops_linear(device, recipe=None, **kw):
    torch.manual_seed(0)
    kw = {"dtype": torch.bfloat16, "device": device, **kw}
    if recipe is None:
        return te.ops.Linear(128, 64, **kw)
    with te.quantized_model_init(recipe=recipe):
        return te.ops.Linear(128, 64, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_ops_linear_matches_the_high_precision_op(device):
    """``te.ops.Linear`` (alone: one ``te::linear`` with the bias in its epilogue) and inside a
    ``Sequential`` fused with SwiGLU: under current scaling the FP8 weight is the cast the
    high-precision op makes each step, so outputs and gradients are the same bits."""
    recipe = Float8CurrentScaling()
    hp = _ops_linear(device, accumulate_into_main_grad=True)
    m = _ops_linear(device, recipe)
    assert _fp8_names(m) == ["basic_ops.0.weight"]
    te.FP8MasterWeights(m)
    hp.weight.main_grad = torch.zeros(hp.weight.shape, device=device)
    for wrap in (lambda op: op, lambda op: te.ops.Sequential(op, te.ops.SwiGLU())):
        x = _x(device).requires_grad_()
        x0 = x.detach().clone().requires_grad_()
        with autocast(recipe=recipe):
            y, y0 = wrap(m)(x), wrap(hp)(x0)
        assert torch.equal(y, y0)
        g = torch.randn_like(y)
        y.backward(g)
        y0.backward(g)
        assert torch.equal(x.grad, x0.grad)
        assert torch.equal(m.weight.main_grad, hp.weight.main_grad)
        assert torch.equal(m.bias.grad, hp.bias.grad)
        assert m.weight.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_ops_grouped_linear_against_float64(device, single):
    """te.ops.GroupedLinear's FP8 weights in Transformer Engine's per-group layout (a scale per
    weight{i}, each main_grad a view of one [G, N, K] buffer) and in the single layout."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    flags = {"single_grouped_weight": single, "single_grouped_bias": single}
    with te.quantized_model_init(recipe=recipe):
        op = te.ops.GroupedLinear(G, 128, 64, dtype=torch.bfloat16, device=device, **flags)
    te.FP8MasterWeights(op)
    x = _x(device).requires_grad_()
    with autocast(recipe=recipe):
        y = te.ops.Sequential(op)(x, SPLITS)
    g = torch.randn_like(y)
    y.backward(g)
    rows = torch.repeat_interleave(torch.arange(G), torch.tensor(SPLITS))
    names = ["weight"] if single else [f"weight{i}" for i in range(G)]
    w = torch.cat([getattr(op, n).detach().double().reshape(-1, 64, 128).cpu()
                   * getattr(op, f"{n}_scale_inv").double().cpu()
                   for n in names])[rows]  # fmt: skip
    xd, gd = x.detach().cpu().double(), g.cpu().double()
    bias = torch.stack(op.biases()).detach().cpu().double()[rows]
    assert_close_quantized(y, torch.einsum("mk,mnk->mn", xd, w) + bias, "current")
    assert_close_quantized(x.grad, torch.einsum("mn,mnk->mk", gd, w), "current", grad=True)
    dw = torch.stack([gd[rows == i].T @ xd[rows == i] for i in range(G)])
    main_grad = torch.stack([getattr(op, n).main_grad.reshape(-1, 64, 128) for n in names])
    assert_close_quantized(main_grad.reshape(G, 64, 128), dw, "current", grad=True)
    assert all(getattr(op, n).grad is None for n in names)
    bare = _ops_grouped_without_masters(device, recipe, flags)  # no FP8MasterWeights: .grad
    bare.load_state_dict(op.state_dict())
    with autocast(recipe=recipe):
        te.ops.Sequential(bare)(x.detach(), SPLITS).backward(g)
    grads = torch.stack([getattr(bare, n).grad.reshape(-1, 64, 128) for n in names])
    assert grads.dtype == torch.bfloat16
    assert_close_quantized(grads.reshape(G, 64, 128), dw, "current", grad=True)


@pytest.mark.parametrize("recipe", _COPY_RECIPES.values(), ids=_COPY_RECIPES.keys())
@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_ops_outside_fp8_autocast_compute_with_the_weight_values(grouped, recipe):
    """Outside an FP8 autocast te.ops' FP8 weights are dequantised (as Transformer Engine
    does): a high-precision GEMM of their values against float64, the weight gradient into
    main_grad (FP8MasterWeights), else into .grad in the nominal dtype (as in TE)."""
    torch.manual_seed(0)
    names = [f"weight{i}" for i in range(G)] if grouped else ["weight"]
    with te.quantized_model_init(recipe=recipe):
        if grouped:
            op = te.ops.GroupedLinear(G, 128, 64, bias=False, dtype=torch.bfloat16)
        else:
            op = te.ops.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    run = (lambda x: op(x, SPLITS)) if grouped else op
    splits = SPLITS if grouped else [96]
    x = _x("cpu").requires_grad_()
    with torch.no_grad():
        y0 = run(x)
    g = torch.randn_like(y0)
    run(x).backward(g)  # no main_grad: .grad
    grads = [op.get_parameter(n).grad.clone() for n in names] if grouped else [op.weight.grad]
    x.grad = None
    te.FP8MasterWeights(op)
    y = run(x)
    assert torch.equal(y, y0) and y.dtype == torch.bfloat16
    y.backward(g)
    owner = op if grouped else op.basic_ops[0]
    ws = [_kept_values(owner, n).double() if recipe is not _COPY_RECIPES["current"]
          else owner.get_parameter(n).detach().double() * owner.get_buffer(f"{n}_scale_inv")
          for n in names]  # fmt: skip
    ws = [w.to(torch.bfloat16).double() for w in ws]  # the GEMM's operand: values in x's dtype
    xs, gs = x.detach().double().split(splits), g.double().split(splits)
    assert_close(y, torch.cat([a @ w.T for a, w in zip(xs, ws, strict=True)]), torch.bfloat16)
    dx = torch.cat([d @ w for d, w in zip(gs, ws, strict=True)])
    assert_close(x.grad, dx, torch.bfloat16)
    for n, d, a, grad in zip(names, gs, xs, grads, strict=True):
        main_grad = op.get_parameter(n).main_grad if grouped else op.weight.main_grad
        assert_close(main_grad, d.T @ a, torch.bfloat16)
        assert grad.dtype == torch.bfloat16
        assert_close(grad, d.T @ a, torch.bfloat16)


def _ops_grouped_without_masters(device, recipe, flags):
    with te.quantized_model_init(recipe=recipe):
        return te.ops.GroupedLinear(G, 128, 64, dtype=torch.bfloat16, device=device, **flags)


def test_ops_sequential_trains_and_compiles_to_one_graph():
    """A fused te.ops stack with FP8 weights (norm, linear + bias + SwiGLU, grouped linear):
    the loss falls under FP8MasterWeights and the compiled step is one graph, the same values
    as eager."""
    recipe = Float8CurrentScaling()

    def build():
        torch.manual_seed(0)
        with te.quantized_model_init(recipe=recipe):
            return te.ops.Sequential(
                te.ops.LayerNorm(128, dtype=torch.bfloat16),
                te.ops.Linear(128, 256, dtype=torch.bfloat16), te.ops.SwiGLU(),
                te.ops.GroupedLinear(G, 128, 64, dtype=torch.bfloat16),
            )  # fmt: skip

    def loss_fn(model, x):
        with autocast(recipe=recipe):
            return model(x, SPLITS).float().square().mean()

    eager, compiled = build(), build()
    assert len(_fp8_names(eager)) == 1 + G  # the Linear's weight, weight0 .. of the grouped one
    m_eager, m_compiled = te.FP8MasterWeights(eager), te.FP8MasterWeights(compiled)
    opts = [torch.optim.SGD([*m.parameters(), *m.other_parameters()], lr=2.0)
            for m in (m_eager, m_compiled)]  # fmt: skip
    assert_single_graph(loss_fn, compiled, _x("cpu"))
    fn, counter = compile_counted(loss_fn, backend="aot_eager")
    losses = []
    for step in range(3):
        loss, loss0 = fn(compiled, _x("cpu", step)), loss_fn(eager, _x("cpu", step))
        assert torch.equal(loss, loss0)
        loss.backward()
        loss0.backward()
        for masters, opt in zip((m_eager, m_compiled), opts, strict=True):
            masters.step(opt)
            opt.zero_grad()
        losses.append(loss0.item())
    assert counter.frame_count == 1
    assert losses[-1] < losses[0], losses


_RESET = {
    "Linear": lambda: te.Linear(64, 32),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 96),
    "GroupedLinear": lambda: te.GroupedLinear(G, 64, 32),
    "GroupedLinear_single": lambda: te.GroupedLinear(G, 64, 32, single_grouped_weight=True),
    "ops.BasicLinear": lambda: te.ops.BasicLinear(64, 32),
    "ops.GroupedLinear": lambda: te.ops.GroupedLinear(G, 64, 32),
    "ops.GroupedLinear_single": lambda: te.ops.GroupedLinear(G, 64, 32, single_grouped_weight=True),
}


@pytest.mark.parametrize("name", list(_RESET))
def test_reset_parameters_reinitialises_and_requantises(name):
    """``reset_parameters()`` on FP8 weights initialises high-precision values and casts them
    into the codes, scale and amax (as at construction); the kept initial value is the new
    one."""
    with te.quantized_model_init(
        recipe=Float8CurrentScaling(), preserve_high_precision_init_val=True
    ):
        m = _RESET[name]()
    names = _fp8_names(m)
    before = {n: m.get_parameter(n).detach().view(torch.uint8).clone() for n in names}
    torch.manual_seed(123)
    m.reset_parameters()
    for n in names:
        w = m.get_parameter(n)
        init = w.get_high_precision_init_val()
        assert w.dtype == E4M3 and init.dtype == torch.float32
        flat = init.reshape(-1, init.shape[-1])
        codes = te.functional.quantize_weight(flat, "current:e4m3")
        assert torch.equal(w.detach().view(torch.uint8).reshape(flat.shape), codes[0]), n
        assert torch.equal(m.get_buffer(f"{n}_scale_inv"), codes[1]), n
        assert torch.equal(m.get_buffer(f"{n}_amax"), codes[4]), n
        assert not torch.equal(w.detach().view(torch.uint8), before[n]), n


@pytest.mark.parametrize("name", MODULES)
def test_a_high_precision_state_dict_loads_quantised(name):
    """A checkpoint of the model without FP8 weights loads into one with them: each weight is
    quantised (current scaling of the weight, as FP8MasterWeights casts), codes, scale and
    amax, and the module computes what one built from those weights computes. Copied into the
    codes as they were, the values would have lost the weight's scale (every result wrong)."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(5)
    hp = _build(name, "cpu")
    with torch.no_grad():
        for p in hp.parameters():
            p.normal_(0, 0.05)
    m = _primary(name, "cpu", recipe)
    m.load_state_dict(hp.state_dict(), strict=False)
    for n in _fp8_names(m):
        codes = te.functional.quantize_weight(getattr(hp, n).detach(), "current:e4m3")
        assert torch.equal(getattr(m, n).detach().view(torch.uint8), codes[0])
        assert torch.equal(getattr(m, f"{n}_scale_inv"), codes[1])
        assert torch.equal(getattr(m, f"{n}_amax"), codes[4])
    with torch.no_grad(), autocast(recipe=recipe):  # the cast the FP8 run of ``hp`` makes
        assert torch.equal(m(_x("cpu", 3)), hp(_x("cpu", 3)))


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_an_fp8_weight_written_in_place_is_refused_by_name(name):
    """``weight.detach().copy_(values)`` casts the values to float8 without the weight's scale: the
    next forward refuses it, naming the weight, instead of computing with codes that no longer match
    their scale. A copy of the module (new storage, same values) is no write."""
    recipe = Float8CurrentScaling()
    m = copy.deepcopy(_primary(name, "cpu", recipe))
    n = _fp8_names(m)[0]
    with autocast(recipe=recipe):
        m(_x("cpu"))  # unchanged: runs
    with torch.no_grad():
        getattr(m, n).detach().copy_(torch.randn(getattr(m, n).shape, dtype=torch.bfloat16))
    written = rf"FP8 weight '{n}' was written in place"
    with pytest.raises(RuntimeError, match=written), autocast(recipe=recipe):
        m(_x("cpu"))
    m.load_state_dict(_primary(name, "cpu", recipe).state_dict())  # set again: runs
    with autocast(recipe=recipe):
        m(_x("cpu"))


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "GroupedLinear"])
def test_an_fp8_weight_replaced_without_its_scale_is_refused_by_name(name):
    """A new Parameter of FP8 codes leaves the module's scale buffer behind, which belongs to
    the old codes. Codes bit for bit those of a live FP8 weight kept alike take that weight's
    scale (Transformer Engine's tests share weights as ``dst.weight =
    Parameter(src.weight.clone())``, where the clone carries its scale): the module then
    computes what the source computes, bit for bit. Codes of no live weight, or of two whose
    scales differ, are refused at the next forward, naming the weight, instead of computing
    with the wrong scale. Assigned together with their scale, the codes compute what the
    module they came from computes; a Parameter on the same storage is no change."""
    recipe = Float8CurrentScaling()
    grouped = name == "GroupedLinear"
    # Modules of earlier tests that only a reference cycle keeps (a kept pytest.raises holds
    # its frame) are still live FP8 weights: the same codes under another scale would make the
    # clone below ambiguous, and refused, as it should be. They go first.
    gc.collect()

    def build(gain: float, seed: int = 0) -> torch.nn.Module:
        if grouped:
            with te.quantized_model_init(recipe=recipe):
                m = te.GroupedLinear(2, 128, 64, params_dtype=torch.bfloat16)
        else:
            m = _primary(name, "cpu", recipe)
        torch.manual_seed(seed)
        with torch.no_grad():
            for n in _fp8_names(m):
                w = m.get_parameter(n)
                w.copy_(torch.randn(w.shape, dtype=torch.float64) * gain)  # quantises
        return m

    def run(m: torch.nn.Module) -> torch.Tensor:
        with autocast(recipe=recipe), torch.no_grad():
            return m(_x("cpu"), [40, 56]) if grouped else m(_x("cpu"))

    src, dst = build(8.0, seed=1), build(0.01)  # (one seed: the same codes, other scales)
    n = _fp8_names(dst)[-1]
    assert not torch.equal(dst.get_buffer(f"{n}_scale_inv"), src.get_buffer(f"{n}_scale_inv"))
    setattr(dst, n, torch.nn.Parameter(dst.get_parameter(n).detach(), requires_grad=False))
    run(dst)  # the same storage: runs
    refused = pytest.raises(RuntimeError, match=rf"FP8 weight '{n}' was replaced by other codes")
    shared = build(0.01)
    for k in _fp8_names(shared):  # TE's way: the clone's scale comes from its live source
        setattr(shared, k, torch.nn.Parameter(src.get_parameter(k).detach().clone()))
    assert torch.equal(run(shared), run(src))
    w = shared.get_parameter(n)  # TE's attributes on the new Parameter too
    assert w.grad_dtype == torch.bfloat16 and w.get_high_precision_init_val() is None
    codes = src.get_parameter(n).detach().clone()
    other = (codes.view(torch.uint8) ^ 1).view(codes.dtype)  # the codes of no live weight
    setattr(dst, n, torch.nn.Parameter(other))
    with refused:
        run(dst)
    twin = copy.deepcopy(src)  # the same codes, another scale: which one is meant is unknown
    twin.get_buffer(f"{n}_scale_inv").mul_(2)
    setattr(dst, n, torch.nn.Parameter(codes))
    with refused:
        run(dst)
    del twin, shared
    with torch.no_grad():
        for k in _fp8_names(dst):
            setattr(dst, k, torch.nn.Parameter(src.get_parameter(k).detach().clone()))
            dst.get_buffer(f"{k}_scale_inv").copy_(src.get_buffer(f"{k}_scale_inv"))
    assert torch.equal(run(dst), run(src))


@pytest.mark.parametrize("grouped", [False, True], ids=["BasicLinear", "GroupedLinear"])
@pytest.mark.parametrize("recipe", _COPY_RECIPES.values(), ids=_COPY_RECIPES.keys())
def test_weight_copy_quantises_as_construction_does(recipe, grouped):
    """``weight.copy_(values)`` (Transformer Engine's ``QuantizedTensor.copy_``) quantises the
    values with the weight's recipe: codes and buffers bit for bit those of a module built
    from the same values, whose dequantised values are the values to E4M3's half ulp; the same
    after a deep copy of the module. Outside no_grad, torch's error (in-place on a leaf)."""
    torch.manual_seed(0)
    values = torch.randn(64, 128, dtype=torch.float64) * 0.05
    n = "weight1" if grouped else "weight"

    def build(init=None):
        with te.quantized_model_init(recipe=recipe):
            if grouped:
                return te.ops.GroupedLinear(2, 128, 64, bias=False, init_method=init)
            return te.ops.BasicLinear(128, 64, init_method=init)

    built = build(lambda w: w.copy_(values))  # the construction path: cast at init
    for m in (build(), copy.deepcopy(build())):
        with torch.no_grad():
            assert m.get_parameter(n).copy_(values) is m.get_parameter(n)
        for key, want in built.state_dict().items():
            if key.startswith(n) and not key.endswith("_extra_state"):
                got = m.state_dict()[key]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), key
    if recipe is _COPY_RECIPES["current"]:  # one scale: amax to 448, E4M3's half ulp
        scale = m.get_buffer(f"{n}_scale_inv").double()
        # tol: scale_inv is amax / 448 rounded to fp32 (2**-24 relative); E4M3 codes round to
        # half an ulp (1/16 relative), subnormals to half of 2**-9 times the scale.
        assert torch.allclose(scale, values.abs().max() / 448, rtol=2**-20)
        got = m.get_parameter(n).detach().double() * scale
        assert (got - values).abs().le(values.abs() / 16 + 2.0**-10 * scale).all()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        m.get_parameter(n).copy_(values)


@pytest.mark.parametrize("single", [False, True], ids=["per_group", "single"])
def test_grouped_fp8_weight_written_in_place_is_refused_by_name(single):
    recipe = Float8CurrentScaling()
    with te.quantized_model_init(recipe=recipe):
        m = te.GroupedLinear(2, 128, 64, params_dtype=torch.bfloat16, single_grouped_weight=single)
    name = "weight" if single else "weight1"
    with autocast(recipe=recipe), torch.no_grad():
        m(_x("cpu"), [40, 56])
        getattr(m, name).detach().copy_(torch.randn(getattr(m, name).shape, dtype=torch.bfloat16))
    written = rf"FP8 weight '{name}' was written in place"
    with pytest.raises(RuntimeError, match=written), autocast(recipe=recipe), torch.no_grad():
        m(_x("cpu"), [40, 56])


_CASTS = {
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
    "float": (lambda m: m.float(), torch.float32),
    "to_float32": (lambda m: m.to(torch.float32), torch.float32),
}
_CAST_RECIPES = {
    "current": Float8CurrentScaling,
    "delayed": DelayedScaling,
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
}


def _cast_build(name):
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16}
    if name == "GroupedLinear":
        return te.GroupedLinear(2, 128, 64, **kw)
    if name == "ops.Linear":
        return te.ops.Linear(128, 64, dtype=torch.bfloat16)
    return _build(name, "cpu")


def _fp8_state(m):
    """The FP8 weights' codes and their buffers, as bytes (uint8 views), by name."""
    names = _fp8_names(m)
    kept = {n: p for n, p in m.named_parameters() if n in names}
    for n, b in m.named_buffers():
        if any(n.startswith(w + "_") for w in names):
            kept[n] = b
    return {n: (t.dtype, t.detach().clone().view(torch.uint8)) for n, t in kept.items()}


@pytest.mark.parametrize("cast", list(_CASTS))
@pytest.mark.parametrize("recipe", list(_CAST_RECIPES))
@pytest.mark.parametrize("name", [*MODULES, "GroupedLinear", "ops.Linear"])
def test_dtype_cast_of_the_module_keeps_the_fp8_weights(name, recipe, cast):
    """``module.half()`` / ``.bfloat16()`` / ``.float()`` / ``.to(dtype)`` leave each FP8 weight's
    codes and buffers (scales, amax, the dgrad GEMM's copy) bit for bit (cast, the codes would
    turn into their values without the scale), cast every other floating-point parameter, and
    the module then computes in the input's dtype what a module built the same way, with only
    those parameters cast, computes."""
    make_recipe = _CAST_RECIPES[recipe]
    apply_cast, dtype = _CASTS[cast]
    with te.quantized_model_init(recipe=make_recipe()):
        m, want = _cast_build(name), _cast_build(name)
    before = _fp8_state(m)
    assert before, "no FP8 weights"
    apply_cast(m)
    after = _fp8_state(m)
    assert after.keys() == before.keys()
    for n, (dt, data) in before.items():
        assert after[n][0] == dt, n
        assert torch.equal(after[n][1], data), n
    fp8 = set(_fp8_names(want))
    with torch.no_grad():  # the expected module: only the other parameters cast
        for n, p in want.named_parameters():
            if n not in fp8 and p.is_floating_point():
                p.data = p.data.to(dtype)
    for (n, p), (_, q) in zip(m.named_parameters(), want.named_parameters(), strict=True):
        assert p.dtype == q.dtype, n
    x = _x("cpu").to(dtype)
    args = (x, [48, 48]) if name == "GroupedLinear" else (x,)
    with torch.no_grad(), autocast(recipe=make_recipe()):
        y = m(*args)
        y_want = want(*args)
    assert y.dtype == dtype
    assert torch.equal(y, y_want)


def test_reset_parameters_after_a_cast_requantises_in_the_new_dtype():
    """After ``.half()`` an FP8 weight's nominal dtype is float16: ``reset_parameters()``
    initialises in it and casts the values into codes and scale again (the weight stays FP8)."""
    with te.quantized_model_init(recipe=BLOCK, preserve_high_precision_init_val=True):
        m = te.Linear(64, 32)
    m.half()
    assert m.weight.dtype == E4M3
    torch.manual_seed(123)
    m.reset_parameters()
    assert m.weight.dtype == E4M3
    init = m.weight.get_high_precision_init_val()
    assert init.dtype == torch.float16
    _assert_kept_cast_of(m, {"weight": init})


@pytest.mark.parametrize("override", [None, "high_precision"], ids=["", "high_precision"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize(
    "name", ["Linear", "LayerNormMLP", "ops.BasicLinear", "GroupedLinear", "GroupedLinear_single"]
)
def test_a_main_grad_the_module_was_not_told_of_is_left_alone(name, accumulate, override):
    """A ``main_grad`` the user set on an FP8 weight goes to the module only with its
    ``fuse_wgrad_accumulation`` / ``accumulate_into_main_grad``; without, the gradient goes to
    ``.grad`` in the nominal dtype and ``main_grad`` keeps its values, as in Transformer Engine
    (whose fusible-ops test sets ``main_grad`` to 0.5 either way), also where the dgrad GEMM
    reads the weight's values (``backward_override="high_precision"``). ``FP8MasterWeights``'
    own ``main_grad`` takes the gradient whatever the flags. Both ways, the same gradient."""
    recipe = fwd = Float8CurrentScaling(backward_override=override)
    grouped = name.startswith("Grouped")

    def build():
        flag = {"accumulate_into_main_grad" if name.startswith("ops") else
                "fuse_wgrad_accumulation": accumulate}  # fmt: skip
        if grouped:
            return _grouped("cpu", fwd, single=name.endswith("single"), **flag)
        with te.quantized_model_init(recipe=fwd):
            torch.manual_seed(0)
            if name.startswith("ops"):
                return te.ops.BasicLinear(128, 64, dtype=torch.bfloat16, **flag)
            return _build(name, "cpu", **flag)

    def step(m):
        with autocast(recipe=recipe):
            m(_x("cpu"), *((SPLITS,) if grouped else ())).float().square().sum().backward()

    m = build()
    for n in _fp8_names(m):
        m.get_parameter(n).main_grad = torch.full(m.get_parameter(n).shape, 0.5)
    step(m)
    masters = build()
    te.FP8MasterWeights(masters)
    step(masters)
    for n in _fp8_names(m):
        w, want = m.get_parameter(n), masters.get_parameter(n).main_grad
        if accumulate:  # 0.5 + the gradient, rounded once more
            assert w.grad is None, n
            assert_close(w.main_grad, want.double() + 0.5, torch.float32, roundings=2)
        else:
            assert torch.equal(w.main_grad, torch.full_like(w.main_grad, 0.5)), n
            assert w.grad.dtype == torch.bfloat16 and torch.equal(w.grad, want.bfloat16()), n


@pytest.mark.parametrize(
    "recipe", [Float8CurrentScaling(), Float8BlockScaling()], ids=["current", "block"]
)
@pytest.mark.parametrize("name", MODULES)
def test_a_model_with_fp8_weights_pickles_whole(name, recipe):
    """``torch.save(model)`` / ``torch.load``: the same codes and buffers, the same forward, and
    the loaded weights quantise on ``weight.copy_(values)`` as the saved ones do; the saved
    module keeps its weights' methods."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU's emulation notice
        m = _primary(name, "cpu", recipe)
        buffer = io.BytesIO()
        torch.save(m, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        _assert_same_state(loaded, m)
        with autocast(recipe=recipe):
            assert torch.equal(loaded(_x("cpu")), m(_x("cpu")))
        n = _fp8_names(m)[0]
        values = torch.randn(getattr(m, n).shape, dtype=torch.bfloat16)
        with torch.no_grad():
            getattr(m, n).copy_(values)
            getattr(loaded, n).copy_(values)
        _assert_same_state(loaded, m)
        with autocast(recipe=recipe):
            assert torch.equal(loaded(_x("cpu", 1)), m(_x("cpu", 1)))


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x, y = sa[k], sb[k]
        if x.dtype == E4M3:
            x, y = x.view(torch.uint8), y.view(torch.uint8)
        assert torch.equal(x, y), k


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), BLOCK], ids=["current", "block"])
@pytest.mark.parametrize("name", [*MODULES, "GroupedLinear"])
def test_modules_outside_fp8_autocast_compute_with_the_weight_values(name, recipe):
    """Outside an FP8 autocast the FP8 weights are dequantised, as Transformer Engine does: the
    module computes as its high-precision twin holding the values the codes stand for (output
    and input gradient bit for bit), the weight gradient into ``.grad`` in the nominal dtype,
    or with ``FP8MasterWeights`` into ``main_grad`` (against float64)."""
    grouped = name == "GroupedLinear"
    m = _grouped("cpu", recipe) if grouped else _primary(name, "cpu", recipe)
    twin = _grouped("cpu") if grouped else _build(name, "cpu")
    names = _fp8_names(m)
    state = {k: v for k, v in m.state_dict().items() if k in twin.state_dict()}
    state.update({n: primary.weight_values(m, n, torch.bfloat16) for n in names})
    twin.load_state_dict(state)
    args = (SPLITS,) if grouped else ()
    runs = []
    for module in (m, twin):
        x = _x("cpu").requires_grad_()
        y = module(x, *args)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
        y.backward(g)
        runs.append((y, x.grad, [module.get_parameter(n).grad for n in names]))
    (y, dx, dws), (y_hp, dx_hp, dws_hp) = runs
    assert torch.equal(y, y_hp) and torch.equal(dx, dx_hp)
    for dw, dw_hp in zip(dws, dws_hp, strict=True):
        assert dw.dtype == torch.bfloat16 and torch.equal(dw, dw_hp)
    if name != "Linear":
        return
    te.FP8MasterWeights(m)  # the gradient goes to main_grad
    x = _x("cpu").requires_grad_()
    m(x).backward(g)
    assert_close(m.weight.main_grad, g.double().T @ x.double(), torch.bfloat16)
