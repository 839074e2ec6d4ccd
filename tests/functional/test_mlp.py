"""The MLP family (``te::mlp``: under FP8 the activation and its gradient fused into the
quantisations) beyond the registry test: the same bytes as the unfused ops (``linear ->
bias_activation -> linear``) in every precision, in every output, gradient, amax and written
gradient amax; LayerNormMLP takes it and matches its op-by-op path; errors."""

from __future__ import annotations

import math

import pytest
import torch

import te_compile
from te_compile import functional as F
from te_compile.functional.spec import as_specs
from te_compile.quantization import gemm
from tests.utils import (
    DEVICES,
    assert_bits_equal,
    assert_close,
    compile_counted,
    paired_grads,
    with_specs,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _params(device, dtype, d=64, f=128, n=48, bias=True, gated=False):
    """``fc1_weight [f1, d]`` (``f1 = 2f`` for a gated activation), ``fc2_weight [n, f]``."""

    def t(*shape, std=1.0):
        return (torch.randn(*shape, device=device) * std).to(dtype).requires_grad_()

    f1 = 2 * f if gated else f
    w1, w2 = t(f1, d, std=0.2), t(n, f, std=0.1)
    b1, b2 = (t(f1, std=0.5), t(n)) if bias else (None, None)
    return w1, b1, w2, b2


def _assert_grads_match(out, ref, params, b1, device, dtype=torch.bfloat16):
    """Every gradient bit-identical to the reference's, except ``b1``'s on the GPU: the fused
    kernel sums the bias gradient in another order than the activation's."""
    for p, g, r in paired_grads(out, ref, params):
        if p is b1 and device != "cpu":
            assert_close(g, r.double(), dtype=dtype, roundings=2, reduced=True)
        else:
            assert_bits_equal(g, r)


def _unfused(x, w1, b1, w2, b2, act, recipe, s1, s2, ga1, ga2, bwd):
    z, a1 = F.linear(
        x, w1, None, **with_specs(recipe=recipe, bwd_dtype=bwd), scale=s1, grad_amax=ga1,
        return_amax=True,
    )  # fmt: skip
    h = F.bias_activation(z, b1, act)
    out, a2 = F.linear(
        h, w2, b2, **with_specs(recipe=recipe, bwd_dtype=bwd), scale=s2, grad_amax=ga2,
        return_amax=True,
    )  # fmt: skip
    return out, torch.cat([a1, a2])


CASES = [
    pytest.param("gelu", "current", torch.bfloat16, True, E5M2, id="gelu-current-bf16"),
    pytest.param("silu", "delayed", torch.bfloat16, True, E5M2, id="silu-delayed-bf16"),
    pytest.param("relu", "current", torch.float32, False, E4M3, id="relu-current-fp32-e4m3"),
    pytest.param("srelu", "delayed", torch.float16, True, E5M2, id="srelu-delayed-fp16"),
    pytest.param("swiglu", "current", torch.bfloat16, True, E5M2, id="swiglu-current-bf16"),
    pytest.param("geglu", "delayed", torch.bfloat16, False, E5M2, id="geglu-delayed-bf16"),
    pytest.param("clamped_swiglu", "current", torch.float32, True, E4M3, id="clamped-swiglu-fp32"),
    pytest.param("reglu", "delayed", torch.float16, True, E5M2, id="reglu-delayed-fp16"),
]


@pytest.mark.parametrize("act,recipe,dtype,bias,bwd", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_same_bytes_as_the_unfused_ops(device, act, recipe, dtype, bias, bwd):
    w1, b1, w2, b2 = _params(device, dtype, bias=bias, gated=act in F.GATED_ACTIVATIONS)
    x = torch.randn(3, 7, 64, device=device).to(dtype).requires_grad_()  # 21 tokens: padded
    if act == "clamped_swiglu":
        x = x.detach().mul(4).requires_grad_()  # z past the clamps' limit of 7 on both halves
    delayed = recipe == "delayed"
    s1 = torch.tensor([40.0, 900.0, 2e3], device=device) if delayed else None
    s2 = torch.tensor([100.0, 2e3, 5e3], device=device) if delayed else None
    pending = [torch.zeros(1, device=device) for _ in range(4)]
    out, amax = F.mlp(
        x, w1, b1, w2, b2, act, **with_specs(recipe=recipe, bwd_dtype=bwd), scale1=s1,
        scale2=s2, grad_amax1=pending[0], grad_amax2=pending[1], return_amax=True,
    )  # fmt: skip
    ref, ref_amax = _unfused(x, w1, b1, w2, b2, act, recipe, s1, s2, *pending[2:], bwd)
    assert_bits_equal(out, ref)
    assert_bits_equal(amax, ref_amax)
    params = [p for p in (x, w1, b1, w2, b2) if p is not None]
    _assert_grads_match(out, ref, params, b1, device, dtype)
    assert_bits_equal(pending[0], pending[2])  # amax(dz), written by the backward
    assert_bits_equal(pending[1], pending[3])  # amax(dY)
    assert pending[0].item() > 0 and pending[1].item() > 0


def _block_unfused(x, w1, b1, w2, b2, act, pow2):
    kw = dict(recipe="block", fwd_dtype=E4M3, bwd_dtype=E4M3, power_2_scale=pow2,
              weight_block_rows=128)  # fmt: skip
    h = F.bias_activation(F.linear(x, w1, None, **with_specs(**kw)), b1, act)
    return F.linear(h, w2, b2, **with_specs(**kw))


@pytest.mark.parametrize("act,pow2", [("gelu", False), ("srelu", True), ("swiglu", False)])
@pytest.mark.parametrize("device", DEVICES)
def test_block_recipe_same_bytes_as_the_unfused_ops(device, act, pow2):
    """recipe="block" (native GEMMs) against linear -> bias_activation -> linear with the same
    recipe: on the CPU their GEMMs are emulated the same way."""
    if device == "cuda" and not te_compile.is_fp8_block_scaling_available():
        pytest.skip("no native blockwise FP8 GEMMs on this GPU")
    gated = act in F.GATED_ACTIVATIONS
    w1, b1, w2, b2 = _params(device, torch.bfloat16, d=512, f=512 if gated else 1024, n=512,
                             gated=gated)  # fmt: skip
    x = torch.randn(3, 16, 512, device=device).to(torch.bfloat16).requires_grad_()
    out = F.mlp(
        x, w1, b1, w2, b2, act, **with_specs(recipe="block", fwd_dtype=E4M3, bwd_dtype=E4M3,
                                             power_2_scale=pow2, weight_block_rows=128),
    )  # fmt: skip
    ref = _block_unfused(x, w1, b1, w2, b2, act, pow2)
    assert_bits_equal(out, ref)
    _assert_grads_match(out, ref, [x, w1, b1, w2, b2], b1, device)
    # 40 tokens are padded to 48 inside the op: the same rows as with 8 zero rows appended.
    x40 = x.detach().reshape(-1, 512)[:40]
    x48 = torch.cat([x40.detach(), x40.new_zeros(8, 512)])
    kw = with_specs(recipe="block", fwd_dtype=E4M3, bwd_dtype=E4M3, power_2_scale=pow2,
                    weight_block_rows=128)  # fmt: skip
    out40 = F.mlp(x40, w1, b1, w2, b2, act, **kw)
    assert_bits_equal(out40, F.mlp(x48, w1, b1, w2, b2, act, **kw)[:40])


EMULATED = [
    pytest.param("", {}, torch.bfloat16, id="bf16"),
    pytest.param("", {}, torch.float32, id="fp32"),
    pytest.param("mxfp8", {"emulate": True}, torch.bfloat16, id="mxfp8"),
    pytest.param("nvfp4", {"emulate": True, "bwd_dtype": E4M3}, torch.bfloat16, id="nvfp4"),
    pytest.param("block", {"emulate": True, "bwd_dtype": E4M3}, torch.bfloat16, id="block-emu"),
]


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("recipe,kw,dtype", EMULATED)
@pytest.mark.parametrize("device", DEVICES)
def test_composed_recipes_same_bytes_as_the_unfused_ops(device, recipe, kw, dtype, act):
    """High precision and the emulated recipes, where the op composes the implementations of
    the linear family and the activation ops: the same bytes as the ops called one by one."""
    gated = act in F.GATED_ACTIVATIONS
    w1, b1, w2, b2 = _params(device, dtype, d=64, f=64, n=32, gated=gated)
    x = torch.randn(2, 16, 64, device=device).to(dtype).requires_grad_()
    out = F.mlp(x, w1, b1, w2, b2, act, **with_specs(recipe=recipe, **kw))
    h = F.bias_activation(F.linear(x, w1, None, **with_specs(recipe=recipe, **kw)), b1, act)
    ref = F.linear(h, w2, b2, **with_specs(recipe=recipe, **kw))
    assert_bits_equal(out, ref)
    for _p, g, r in paired_grads(out, ref, [x, w1, b1, w2, b2]):
        assert_bits_equal(g, r)


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_without_graph_breaks_and_matches_eager(device):
    w1, b1, w2, b2 = _params(device, torch.bfloat16)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)

    def step(x, w1, b1, w2, b2):
        out = F.mlp(x, w1, b1, w2, b2, "gelu", **with_specs(recipe="current"))
        out.float().square().sum().backward()
        return out.detach()

    compiled, counter = compile_counted(
        lambda *a: F.mlp(*a, "gelu", **with_specs(recipe="current")), backend="aot_eager"
    )
    eager_out = step(x, w1, b1, w2, b2)
    eager_grads = [t.grad.clone() for t in (x, w1, b1, w2, b2)]
    for t in (x, w1, b1, w2, b2):
        t.grad = None
    out = compiled(x, w1, b1, w2, b2)
    out.float().square().sum().backward()
    assert counter.frame_count == 1
    assert_bits_equal(out, eager_out)
    for t, g in zip((x, w1, b1, w2, b2), eager_grads, strict=True):
        assert_close(t.grad, g.double(), dtype=torch.bfloat16, roundings=2, reduced=True)


def test_errors_name_the_argument():
    x, w1, w2 = torch.randn(16, 32), torch.randn(64, 32), torch.randn(16, 64)
    cur = with_specs(recipe="current")
    with pytest.raises(ValueError, match=r"te\.mlp: activation must be one of"):
        F.mlp(x, w1, None, w2, None, "swish")
    with pytest.raises(ValueError, match=r"fc1_weight \[2 \* ffn, hidden\] \(gated activation\)"):
        F.mlp(x, w1, None, w2, None, "swiglu")  # fc2_weight takes 64 features, not 32
    with pytest.raises(ValueError, match="multiples of 16"):
        F.mlp(torch.randn(16, 24), torch.randn(64, 24), None, w2, None, "gelu", **cur)
    with pytest.raises(ValueError, match="do not match"):
        F.mlp(x, w1, None, torch.randn(16, 48), None, "gelu")
    with pytest.raises(ValueError, match="fc1_bias must be"):
        F.mlp(x, w1, torch.randn(32), w2, None, "gelu")
    with pytest.raises(ValueError, match=r"an FP8 fc2_weight .* needs its pre-quantised operand"):
        F.mlp(x, w1, None, w2.to(E4M3), None, "gelu", **cur)  # FP8 primary weights: fc2_weight_q
    with pytest.raises(ValueError, match=r"a \"delayed\" spec needs scale1 \[3\]"):
        F.mlp(x, w1, None, w2, None, "gelu", **with_specs(recipe="delayed"))
    with pytest.raises(ValueError, match=r"te\.mlp: input_spec 'fp8': unknown token 'fp8'"):
        F.mlp(x, w1, None, w2, None, "gelu", input_spec="fp8")
    with pytest.raises(ValueError, match=r"te\.mlp: grad_spec 'current:e4m3:bad': unknown"):
        F.mlp(x, w1, None, w2, None, "gelu", **{**cur, "grad_spec": "current:e4m3:bad"})
    with pytest.raises(ValueError, match="mxfp8 GEMMs are emulated here"):
        F.mlp(x, w1, None, w2, None, "gelu", **with_specs(recipe="mxfp8"))
    nvfp4 = {"input_spec": "nvfp4:emulate", "weight_spec": "nvfp4:emulate"}
    for grad in ("nvfp4:emulate:sr", "nvfp4:emulate:rht:sr"):  # before the rng_state check
        with pytest.raises(ValueError, match=r"grad_spec .*: NVFP4's options are te::linear's"):
            F.mlp(x, w1, None, w2, None, "gelu", **nvfp4, grad_spec=grad)
    block = with_specs(recipe="block", bwd_dtype=E4M3)
    with pytest.raises(
        ValueError, match=r"native blockwise GEMMs \(specs without 'emulate'\).*512"
    ):
        F.mlp(x, w1, None, w2, None, "gelu", **with_specs(recipe="block", bwd_dtype=E4M3,
                                                          weight_block_rows=128))  # fmt: skip
    with pytest.raises(ValueError, match=r"scale1 is for \"delayed\" specs only"):
        F.mlp(x, w1, None, w2, None, "gelu", **block, scale1=torch.ones(3))
    with pytest.raises(ValueError, match="native blockwise GEMMs take E4M3 operands"):
        F.mlp(x, w1, None, w2, None, "gelu", **with_specs(recipe="block"))
    with pytest.raises(ValueError, match=r"te\.mlp: input_spec 'nvfp4:emulate:rht'.*te::linear"):
        F.mlp(x, w1, None, w2, None, "gelu", **with_specs(recipe="nvfp4", emulate=True, rht=True))
    for switch in ("zero_centered_gamma", "return_amax"):
        with pytest.raises(ValueError, match=rf"te\.mlp: {switch} must be a bool .*, got 'yes'"):
            F.mlp(x, w1, None, w2, None, "gelu", **{switch: "yes"})


RECIPES = [
    pytest.param(te_compile.recipe.Float8CurrentScaling, id="current"),
    pytest.param(te_compile.recipe.DelayedScaling, id="delayed"),
]


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
@pytest.mark.parametrize("recipe_cls", RECIPES)
@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_takes_the_fused_op_with_the_same_results(
    device, recipe_cls, act, monkeypatch
):
    """Three training steps of LayerNormMLP under each per-tensor recipe, fused and op by op
    (``quantization.gemm._FUSE_MLP = False``): the same outputs, gradients and scaling
    state."""
    _fused_and_plain_steps(device, recipe_cls(), 64, 128, monkeypatch, act)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not te_compile.is_fp8_block_scaling_available(),
    reason="Float8BlockScaling's fused MLP runs where its GEMMs are native (Hopper, CUDA 12.9+)",
)
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_layernorm_mlp_takes_the_fused_op_under_block_scaling(act, monkeypatch):
    recipe = te_compile.recipe.Float8BlockScaling()
    _fused_and_plain_steps("cuda", recipe, 512, 1024, monkeypatch, act)


@pytest.mark.parametrize("recipe_cls", [pytest.param(None, id="bf16"), *RECIPES])
@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_accumulates_into_main_grad_in_the_fused_op(device, recipe_cls, monkeypatch):
    """``fuse_wgrad_accumulation=True``: ``te::mlp`` adds the weight gradients into
    ``main_grad`` (``main_grad1`` / ``main_grad2``), bit for bit what two ``te::linear`` calls
    accumulate, over three steps."""
    recipe = recipe_cls and recipe_cls()
    _fused_and_plain_steps(device, recipe, 64, 128, monkeypatch, "swiglu", main_grad=True)


def _fused_and_plain_steps(device, recipe, hidden, ffn, monkeypatch, act, main_grad=False):
    torch.manual_seed(0)
    kw = {"device": device, "params_dtype": torch.bfloat16, "fuse_wgrad_accumulation": main_grad}
    fused = te_compile.LayerNormMLP(hidden, ffn, activation=act, **kw)
    plain = te_compile.LayerNormMLP(hidden, ffn, activation=act, **kw)
    plain.load_state_dict(fused.state_dict())
    for m in (fused, plain) if main_grad else ():
        for w in (m.fc1_weight, m.fc2_weight):
            w.main_grad = torch.zeros(w.shape, device=device, dtype=torch.float32)
    calls = []
    real, real_fast = gemm.F.mlp, gemm.mlp_fast_path

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def counted_fast(*args, **kwargs):  # te::mlp's eager fast path
        out = real_fast(*args, **kwargs)
        calls.extend([1] if out is not None else [])
        return out

    results = {}
    for name, module, fuse in (("fused", fused, True), ("plain", plain, False)):
        monkeypatch.setattr(gemm, "_FUSE_MLP", fuse)
        monkeypatch.setattr(gemm.F, "mlp", counted)
        monkeypatch.setattr(gemm, "mlp_fast_path", counted_fast)
        torch.manual_seed(1)
        outs = []
        for _ in range(3):
            x = torch.randn(2, 24, hidden, device=device, dtype=torch.bfloat16)
            with te_compile.autocast(enabled=recipe is not None, recipe=recipe):
                out = module(x)
            out.float().square().mean().backward()
            outs.append(out.detach())
        grads = [p.main_grad if main_grad and p.grad is None else p.grad
                 for p in module.parameters()]  # fmt: skip
        results[name] = (outs, grads, [b.clone() for b in module.buffers()])
    assert len(calls) == 3  # the fused run only (te::mlp, or its fast path)
    for a, b in zip(results["fused"][0], results["plain"][0], strict=True):
        assert_bits_equal(a, b)
    for a, b in zip(results["fused"][2], results["plain"][2], strict=True):
        assert_bits_equal(a, b)
    for p, a, b in zip(fused.parameters(), results["fused"][1], results["plain"][1], strict=True):
        if p is fused.fc1_bias and device != "cpu":
            assert_close(a, b.double(), dtype=torch.bfloat16, roundings=2, reduced=True)
        else:
            assert_bits_equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_layernorm_mlp_calls_the_mlp_op_in_every_precision(device, monkeypatch):
    seen = []
    real, real_fast = gemm.F.mlp, gemm.mlp_fast_path

    def spy(*args, **kwargs):
        seen.append((args[5], as_specs(kwargs.get("input_spec", ""))[0].kind))  # bf16: none
        return real(*args, **kwargs)

    def spy_fast(*args, **kwargs):  # te::mlp's eager fast path: (..., activation, specs, ...)
        out = real_fast(*args, **kwargs)
        seen.extend([(args[5], args[6][0].kind)] if out is not None else [])
        return out

    monkeypatch.setattr(gemm.F, "mlp", spy)
    monkeypatch.setattr(gemm, "mlp_fast_path", spy_fast)
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    for act in ("gelu", "swiglu"):
        m = te_compile.LayerNormMLP(
            64, 64, activation=act, device=device, params_dtype=torch.bfloat16
        )
        with te_compile.autocast(recipe=te_compile.recipe.Float8CurrentScaling()):
            m(x)
        m(x)  # outside autocast: bf16
        with te_compile.autocast(recipe=te_compile.recipe.MXFP8BlockScaling()):
            m(x)  # emulated block formats: the same op
    assert seen == [(a, r) for a in ("gelu", "swiglu") for r in ("current", "", "mxfp8")]


# Norm prologue (LayerNormMLP): the norm written straight into FC1's FP8 input. ------------------

NORM_CASES = [
    pytest.param("LayerNorm", "current", False, id="layernorm-current"),
    pytest.param("RMSNorm", "delayed", True, id="rmsnorm-zc-delayed"),
    pytest.param("LayerNorm", "block", True, id="layernorm-zc-block"),
    pytest.param("RMSNorm", "block", False, id="rmsnorm-block"),
]


@pytest.mark.parametrize("normalization,recipe,zcg", NORM_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_norm_prologue_same_bytes_as_the_norm_then_the_mlp(device, normalization, recipe, zcg):
    """``mlp(..., normalization=...)`` against the norm op followed by ``mlp``: output,
    amaxes and every gradient (the norm's parameters included) bit for bit (the first bias
    gradient closely on CUDA, as above)."""
    block = recipe == "block"
    if block and device == "cuda" and not te_compile.is_fp8_block_scaling_available():
        pytest.skip("no native blockwise FP8 GEMMs on this GPU")
    d, f = (512, 1024) if block else (64, 128)
    w1, b1, w2, b2 = _params(device, torch.bfloat16, d=d, f=f, n=d)
    x = (torch.randn(3, 7, d, device=device) * 2 + 0.5).bfloat16().requires_grad_()
    gamma = (torch.randn(d, device=device) * 0.2 + (0 if zcg else 1)).bfloat16().requires_grad_()
    beta = (torch.randn(d, device=device) * 0.3).bfloat16().requires_grad_()
    beta = beta if normalization == "LayerNorm" else None
    kw = {"return_amax": True}
    if block:
        kw |= with_specs(recipe=recipe, fwd_dtype=E4M3, bwd_dtype=E4M3, weight_block_rows=128)
    else:
        kw |= with_specs(recipe=recipe)
    if recipe == "delayed":
        kw.update(scale1=torch.tensor([30.0, 900.0, 2e3], device=device),
                  scale2=torch.tensor([100.0, 2e3, 5e3], device=device))  # fmt: skip
    out, amax = F.mlp(
        x, w1, b1, w2, b2, "gelu", normalization=normalization, norm_weight=gamma,
        norm_bias=beta, zero_centered_gamma=zcg, **kw,
    )  # fmt: skip
    if normalization == "LayerNorm":
        ln = F.layernorm(x, gamma, beta, zero_centered_gamma=zcg)
    else:
        ln = F.rmsnorm(x, gamma, zero_centered_gamma=zcg)
    ref, ref_amax = F.mlp(ln, w1, b1, w2, b2, "gelu", **kw)
    assert_bits_equal(out, ref)
    assert_bits_equal(amax, ref_amax)
    params = [p for p in (x, gamma, beta, w1, b1, w2, b2) if p is not None]
    _assert_grads_match(out, ref, params, b1, device)


def test_norm_prologue_errors_name_the_argument():
    x, w1, w2 = torch.randn(16, 32), torch.randn(64, 32), torch.randn(16, 64)
    with pytest.raises(ValueError, match=r"te\.mlp: normalization must be"):
        F.mlp(x, w1, None, w2, None, "gelu", normalization="L2", norm_weight=torch.ones(32))
    with pytest.raises(ValueError, match=r"te\.mlp: LayerNorm needs norm_weight \[32\]"):
        F.mlp(x, w1, None, w2, None, "gelu", normalization="LayerNorm")
    with pytest.raises(
        ValueError, match=r"te\.mlp: norm_eps must be a positive float \(finite, > 0\), got inf"
    ):
        F.mlp(x, w1, None, w2, None, "gelu", normalization="RMSNorm", norm_weight=torch.ones(32),
              norm_eps=math.inf)  # fmt: skip


def test_every_case_run_as_two_linears_is_documented():
    """``quantization.gemm.mlp_as_two_linears``, the one place that sends LayerNormMLP to two
    ``te::linear`` calls: each reason it may give is named in LayerNormMLP's docstring and in
    docs/op_mechanism.md, and is selected by its own condition alone; no condition, no
    reason."""
    from pathlib import Path

    from te_compile.modules import layernorm_mlp
    from te_compile.quantization.state import AutocastState

    docs = (Path(__file__).resolve().parents[2] / "docs" / "op_mechanism.md").read_text()
    for reason in gemm.MLP_AS_TWO_LINEARS:
        assert reason in layernorm_mlp.__doc__ and reason in docs, reason
    r = te_compile.recipe
    plain = {"disable_rht": True, "disable_stochastic_rounding": True}
    off = AutocastState(False, None, None)

    def on(recipe):
        return AutocastState(True, recipe, None)

    def call(state, recompute_fc1=False, defer=None, overwrite=False):
        return gemm.mlp_as_two_linears(state, recompute_fc1, defer, overwrite)

    reasons = {
        "delay_wgrad_compute": call(off, defer=[]),
        "checkpoint=True": call(off, recompute_fc1=True),
        "backward_override": call(on(r.Float8CurrentScaling(backward_override="dequantized"))),
        "calibrating=True": call(AutocastState(False, r.DelayedScaling(), None, True)),
        "Hadamard transform": call(on(r.NVFP4BlockScaling(disable_stochastic_rounding=True))),
        "stochastic rounding": call(on(r.NVFP4BlockScaling(disable_rht=True))),
        "row-scaled activations": call(
            on(r.NVFP4BlockScaling(**plain, row_scaled_activation=True))
        ),
        "4over6": call(on(r.NVFP4BlockScaling(**plain, nvfp4_4over6="weights"))),
        "overwrite_main_grad": call(off, overwrite=True),
    }
    assert set(reasons) == set(gemm.MLP_AS_TWO_LINEARS)
    assert all(got == reason for reason, got in reasons.items()), reasons
    for state in (off, on(r.NVFP4BlockScaling(**plain)), on(r.Float8CurrentScaling())):
        assert call(state) == ""


def test_fp8_weight_gradient_needs_a_main_grad():
    """te.mlp with FP8 primary weights: a backward that wants an FP8 weight's gradient without
    its main_grad buffer is refused naming it (main_grad2 here; FC1's goes to main_grad1)."""
    x = torch.randn(16, 32, requires_grad=True)
    w1, w2 = torch.randn(64, 32), torch.randn(16, 64)
    cur = with_specs(recipe="current")
    q1, q2 = (F.quantize_weight(w, cur["weight_spec"]) for w in (w1, w2))
    c1, c2 = w1.to(E4M3).requires_grad_(), w2.to(E4M3).requires_grad_()
    y = F.mlp(x, c1, None, c2, None, "gelu", fc1_weight_quantized=q1, fc2_weight_quantized=q2,
              main_grad1=torch.zeros(64, 32), **cur)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"an FP8 fc2_weight's gradient needs main_grad2"):
        y.sum().backward()
