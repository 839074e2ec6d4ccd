"""Per-operand quantisation parameters of a recipe (Transformer Engine's ``QParams`` fields:
``NVFP4BlockScaling.fp4_quant_*``, ``Float8CurrentScaling.fp8_quant_*``): set from the recipe's
flags at construction, overridable per operand afterwards, and read by
``quantization.gemm.recipe_specs`` for that operand only; what no kernel runs is refused."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re

import pytest
import torch

import te_compile as te
from te_compile import functional as F
from te_compile.functional.gemm_ref import quantized_linear_ref
from te_compile.quantization import Float8CurrentScaling, NVFP4BlockScaling, QParams
from te_compile.quantization.gemm import recipe_specs
from tests.utils import assert_close, compile_counted, to_reference, with_specs

E4M3 = torch.float8_e4m3fn
NVFP4 = {"recipe": "nvfp4", "emulate": True, "fwd_dtype": E4M3, "bwd_dtype": E4M3}
# TE's default NVFP4 recipe as te::linear options: 16x16 weight tiles, the Hadamard transform
# of the wgrad operands, stochastic rounding of the gradient.
DEFAULT = {"weight_block_rows": 16, "rht": True, "stochastic_rounding": True}


def _nvfp4(start: dict[str, bool], **qparams: QParams) -> NVFP4BlockScaling:
    recipe = NVFP4BlockScaling(**start)
    for name, q in qparams.items():
        setattr(recipe, name, q)
    return recipe


_ALL_OFF = {"disable_rht": True, "disable_stochastic_rounding": True,
            "disable_2d_quantization": True}  # fmt: skip

# (recipe flags, per-operand overrides, the te::linear options the recipe must then run).
NVFP4_CASES = {
    "weight-1d": ({}, {"fp4_quant_fwd_weight": QParams()},
                  {"rht": True, "stochastic_rounding": True}),
    "grad-no-sr": ({}, {"fp4_quant_bwd_grad": QParams(random_hadamard_transform=True)},
                   {"weight_block_rows": 16, "rht": True}),
    "no-rht": ({}, {"fp4_quant_fwd_inp": QParams(),
                    "fp4_quant_bwd_grad": QParams(stochastic_rounding=True)},
               {"weight_block_rows": 16, "stochastic_rounding": True}),
    "te-vanilla": ({}, {"fp4_quant_fwd_inp": QParams(), "fp4_quant_fwd_weight": QParams(),
                        "fp4_quant_bwd_grad": QParams()}, {}),
    "weight-2d-only": (_ALL_OFF, {"fp4_quant_fwd_weight": QParams(fp4_2d_quantization=True)},
                       {"weight_block_rows": 16}),
    "grad-sr-only": (_ALL_OFF, {"fp4_quant_bwd_grad": QParams(stochastic_rounding=True)},
                     {"stochastic_rounding": True}),
    "rht-only": (_ALL_OFF, {"fp4_quant_fwd_inp": QParams(random_hadamard_transform=True),
                            "fp4_quant_bwd_grad": QParams(random_hadamard_transform=True)},
                 {"rht": True}),
}  # fmt: skip


def _seeded(fn):
    torch.manual_seed(0)
    return fn()


def _setup():
    torch.manual_seed(0)
    m = te.Linear(64, 48, bias=False, params_dtype=torch.float32)
    x = torch.randn(32, 64, requires_grad=True)
    dy = torch.randn(32, 48)
    return m, x, dy


def _module(m, x, dy, recipe):
    def run():
        with te.autocast(recipe=recipe):
            out = m(x)
        return (out, *torch.autograd.grad(out, (x, m.weight), dy))

    return _seeded(run)


def _functional(m, x, dy, options):
    def run():
        out = F.linear(x, m.weight, **with_specs(**NVFP4, **options))
        return (out, *torch.autograd.grad(out, (x, m.weight), dy))

    return _seeded(run)


@pytest.mark.parametrize("case", list(NVFP4_CASES))
def test_nvfp4_operand_qparams_change_that_operand_only(case):
    """te.Linear under a recipe with a per-operand override runs te::linear with exactly that
    operand's options (bit for bit, the same stochastic-rounding stream), which differs from
    the recipe without the override, and matches the float64 definition where no stochastic
    rounding is drawn."""
    flags, qparams, options = NVFP4_CASES[case]
    m, x, dy = _setup()
    got = _module(m, x, dy, _nvfp4(flags, **qparams))
    for a, b in zip(got, _functional(m, x, dy, options), strict=True):
        assert torch.equal(a, b)
    plain = _module(m, x, dy, NVFP4BlockScaling(**flags))
    assert not all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))
    x64, w64 = to_reference(x), to_reference(m.weight)
    spec = with_specs(
        recipe="nvfp4", **{k: v for k, v in options.items() if k != "stochastic_rounding"}
    )
    ref = quantized_linear_ref(x64, w64, **spec)
    assert_close(got[0], ref, torch.float32)  # the forward draws no random numbers
    if not options.get("stochastic_rounding"):
        ref_dx, ref_dw = torch.autograd.grad(ref, (x64, w64), to_reference(dy))
        assert_close(got[1], ref_dx, torch.float32)
        assert_close(got[2], ref_dw, torch.float32, reduced=True)


def test_nvfp4_operand_qparams_reach_te_quantize():
    x = torch.randn(64, 32)
    recipe = NVFP4BlockScaling()
    assert te.quantize(x, recipe, role="weight").block_rows == 16
    recipe.fp4_quant_fwd_weight = QParams()
    assert te.quantize(x, recipe, role="weight").block_rows == 1
    recipe.fp4_quant_bwd_grad = QParams(random_hadamard_transform=True)
    te.quantize(x, recipe, role="grad")  # no stochastic rounding left to refuse


def test_operand_qparams_compile_and_recompile_when_set():
    """A compiled module reads the per-operand fields (guards on them): setting one after a
    compiled call recompiles rather than reusing a graph of the old value."""
    m, x, _ = _setup()
    x = x.detach()
    recipe = NVFP4BlockScaling(disable_stochastic_rounding=True)
    compiled, counter = compile_counted(m, backend="eager")
    with te.autocast(recipe=recipe):
        tiles = compiled(x)
        recipe.fp4_quant_fwd_weight = QParams()
        rows = compiled(x)
        eager = m(x)
    assert torch.equal(rows, eager) and not torch.equal(rows, tiles)
    assert counter.frame_count == 2


# Refusals ----------------------------------------------------------------------------------------

NVFP4_REFUSED = [
    ("fp4_quant_fwd_weight", QParams(random_hadamard_transform=True, fp4_2d_quantization=True),
     NotImplementedError, "fp4_quant_fwd_weight.random_hadamard_transform=True is not implemented"),
    ("fp4_quant_fwd_inp", QParams(random_hadamard_transform=True, stochastic_rounding=True),
     NotImplementedError, "fp4_quant_fwd_inp.stochastic_rounding=True is not implemented"),
    ("fp4_quant_fwd_weight", QParams(stochastic_rounding=True),
     NotImplementedError, "fp4_quant_fwd_weight.stochastic_rounding=True is not implemented"),
    ("fp4_quant_fwd_inp", QParams(random_hadamard_transform=True, fp4_2d_quantization=True),
     NotImplementedError, "fp4_quant_fwd_inp.fp4_2d_quantization=True is not implemented"),
    ("fp4_quant_bwd_grad", QParams(random_hadamard_transform=True, fp4_2d_quantization=True),
     NotImplementedError, "fp4_quant_bwd_grad.fp4_2d_quantization=True is not implemented"),
    ("fp4_quant_bwd_grad", QParams(random_hadamard_transform=True, power_2_scale=True),
     NotImplementedError, "fp4_quant_bwd_grad.power_2_scale=True is not implemented"),
    ("fp4_quant_fwd_inp", QParams(random_hadamard_transform=True, amax_epsilon=1e-3),
     NotImplementedError, "fp4_quant_fwd_inp.amax_epsilon=0.001 is not implemented"),
    ("fp4_quant_bwd_grad", QParams(stochastic_rounding=True),
     ValueError, "fp4_quant_fwd_inp.random_hadamard_transform and "
                 "fp4_quant_bwd_grad.random_hadamard_transform must be equal"),
]  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("name", "qparams", "error", "message"), NVFP4_REFUSED)
def test_nvfp4_operand_qparams_not_implemented_raise(name, qparams, error, message, compiled):
    """An option on an operand no kernel applies it to is refused, naming the field, by
    recipe_specs (the modules, te.quantize) rather than ignored; setting it is accepted (TE
    code sets the three fields one after the other)."""
    recipe = NVFP4BlockScaling()
    setattr(recipe, name, qparams)
    m = te.Linear(64, 16, params_dtype=torch.float32)
    run = compile_counted(m, backend="eager")[0] if compiled else m
    with (
        pytest.raises(error if not compiled else Exception, match=re.escape(message)),
        te.autocast(recipe=recipe),
    ):
        run(torch.randn(32, 64))
    with pytest.raises(error, match=re.escape(message)):
        te.quantize(torch.randn(32, 64), recipe, role="input")


def test_current_scaling_operand_power_2_scale_reaches_te_quantize():
    torch.manual_seed(0)
    x = torch.randn(64, 32) * 3
    recipe = Float8CurrentScaling()
    recipe.fp8_quant_fwd_weight = QParams(power_2_scale=True)
    p2 = te.quantize(x, Float8CurrentScaling(use_power_2_scales=True), role="weight")
    default = te.quantize(x, Float8CurrentScaling(), role="weight")
    weight = te.quantize(x, recipe, role="weight")
    assert torch.equal(te.dequantize(weight, torch.float32), te.dequantize(p2, torch.float32))
    assert not torch.equal(te.dequantize(weight, torch.float32),
                           te.dequantize(default, torch.float32))  # fmt: skip
    scale = weight.scale_inv.double()
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    for role in ("input", "grad"):  # the other operands keep the default
        a, b = te.quantize(x, recipe, role=role), te.quantize(x, Float8CurrentScaling(), role=role)
        assert torch.equal(te.dequantize(a, torch.float32), te.dequantize(b, torch.float32))
    assert [s.power_2_scale for s in recipe_specs(recipe)] == [False, True, False]


def test_current_scaling_operand_options_the_modules_do_not_implement_raise():
    recipe = Float8CurrentScaling()
    recipe.fp8_quant_bwd_grad = QParams(power_2_scale=True)
    message = "autocast: Float8CurrentScaling with fp8_quant_bwd_grad.power_2_scale=True is not"
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        te.autocast(recipe=recipe)
    m = te.Linear(64, 16, params_dtype=torch.float32)
    recipe = Float8CurrentScaling()
    with te.autocast(recipe=recipe):
        recipe.fp8_quant_fwd_inp = QParams(power_2_scale=True)  # after autocast checked it
        with pytest.raises(NotImplementedError, match=re.escape("fp8_quant_fwd_inp.power_2")):
            m(torch.randn(32, 64))
    recipe = Float8CurrentScaling()
    recipe.fp8_quant_fwd_inp = QParams(amax_epsilon=1e-6)
    with pytest.raises(NotImplementedError, match=re.escape("fp8_quant_fwd_inp.amax_epsilon")):
        te.quantize(torch.randn(32, 64), recipe)
    for option in ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"):
        recipe = Float8CurrentScaling()
        recipe.fp8_quant_fwd_weight = QParams(**{option: True})
        with pytest.raises(NotImplementedError, match=f"fp8_quant_fwd_weight.{option}=True"):
            te.quantize(torch.randn(32, 64), recipe, role="weight")


def test_block_scaling_operand_power_2_scale_changes_that_operand_only():
    """Float8BlockScaling's per-operand ``power_2_scale`` (TE's block quantisers read it per
    operand): fp32 scales on the weight alone, the input and gradient keeping powers of two."""
    torch.manual_seed(0)
    m = te.Linear(128, 128, bias=False, params_dtype=torch.float32)
    x = torch.randn(32, 128, requires_grad=True)
    dy = torch.randn(32, 128)
    recipe = te.recipe.Float8BlockScaling()
    recipe.fp8_quant_fwd_weight = QParams()

    def module(r):
        with te.autocast(recipe=r):
            out = m(x)
        return (out, *torch.autograd.grad(out, (x, m.weight), dy))

    specs = {"input_spec": "block:e4m3:p2", "weight_spec": "block:e4m3:128x128",
             "grad_spec": "block:e4m3:p2"}  # fmt: skip
    got = module(recipe)
    emulated = {k: v + ":emulate" for k, v in specs.items()}  # no native block GEMM on a CPU
    out = F.linear(x, m.weight, **emulated)
    expected = (out, *torch.autograd.grad(out, (x, m.weight), dy))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], module(te.recipe.Float8BlockScaling())[0])
    x64, w64 = to_reference(x), to_reference(m.weight)
    ref = quantized_linear_ref(x64, w64, **specs)
    assert_close(got[0], ref, torch.float32)
    grouped = te.GroupedLinear(2, 128, 128, params_dtype=torch.float32)
    with (
        te.autocast(recipe=recipe),
        pytest.raises(ValueError, match="one power-of-two option for all operands"),
    ):
        grouped(x.detach(), [16, 16])


# The fields as recipe fields ---------------------------------------------------------------------


def test_flags_set_the_options_they_govern():
    """At construction the fields are TE's (``__post_init__`` from the flags); a flag set later
    sets its own option in the fields it covers and leaves the rest of each field alone."""
    recipe = NVFP4BlockScaling()
    recipe.fp4_quant_bwd_grad = QParams(random_hadamard_transform=True)
    recipe.disable_rht = True
    assert recipe.fp4_quant_fwd_inp == recipe.fp4_quant_bwd_grad == QParams()
    assert recipe.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    recipe.disable_2d_quantization = True
    assert recipe.fp4_quant_fwd_weight == QParams()
    with pytest.raises(ValueError, match="disable_rht must be of type bool"):
        recipe.disable_rht = 0
    assert recipe.disable_rht and recipe.fp4_quant_fwd_inp == QParams()  # left as they were
    current = Float8CurrentScaling()
    current.use_power_2_scales = True
    assert current.fp8_quant_fwd_weight == QParams(power_2_scale=True)
    block = te.recipe.Float8BlockScaling()
    assert block.fp8_quant_bwd_grad == QParams(power_2_scale=True)
    block.use_f32_scales = True
    assert block.fp8_quant_bwd_grad == QParams()
    with pytest.raises(ValueError, match="fp4_quant_fwd_inp must be of type QParams"):
        recipe.fp4_quant_fwd_inp = {"random_hadamard_transform": True}
    with pytest.raises(TypeError):
        NVFP4BlockScaling(fp4_quant_fwd_inp=QParams())  # not a constructor argument, as in TE


def test_operand_qparams_compare_print_and_copy_with_the_recipe():
    recipe = NVFP4BlockScaling()
    recipe.fp4_quant_fwd_weight = QParams()
    assert recipe != NVFP4BlockScaling()
    assert "fp4_quant_fwd_weight=QParams(power_2_scale=False" in repr(recipe)
    assert copy.copy(recipe) == copy.deepcopy(recipe) == recipe
    assert copy.deepcopy(recipe).fp4_quant_fwd_weight == QParams()
    assert pickle.loads(pickle.dumps(recipe)) == recipe  # a checkpoint keeps the override
    # dataclasses.replace constructs anew: the fields come from the flags again (as in TE).
    again = dataclasses.replace(recipe, backward_override="dequantized")
    assert again.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
