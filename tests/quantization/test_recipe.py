"""Recipes: TE's defaults, validation messages, immutability, and device capability checks."""

import dataclasses
import math
import re

import pytest
import torch
import torch._dynamo

import te_compile as te
import te_compile.quantization as q
from te_compile.quantization import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
)
from te_compile.quantization import device as device_mod
from tests.utils import HAS_CUDA, compile_counted, count_graph_breaks

RECIPES = [
    DelayedScaling,
    Float8CurrentScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
]

# Defaults of transformer_engine.common.recipe (TE main, 2026), field by field. Fields left out
# here are left out of te_compile on purpose (see the recipe module docstring).
TE_DEFAULTS = {
    DelayedScaling: {
        "margin": 0,
        "fp8_format": Format.HYBRID,
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
        "scaling_factor_compute_algo": None,
        "reduce_amax": True,
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
    Float8CurrentScaling: {
        "use_power_2_scales": False,
        "fp8_format": Format.HYBRID,
        "fp8_quant_fwd_inp": QParams(power_2_scale=False, amax_epsilon=0.0),
        "fp8_quant_fwd_weight": QParams(power_2_scale=False, amax_epsilon=0.0),
        "fp8_quant_bwd_grad": QParams(power_2_scale=False, amax_epsilon=0.0),
        "fp8_gemm_fprop": MMParams(use_split_accumulator=False),
        "fp8_gemm_dgrad": MMParams(use_split_accumulator=True),
        "fp8_gemm_wgrad": MMParams(use_split_accumulator=True),
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
    Float8BlockScaling: {
        "use_f32_scales": False,
        "fp8_format": Format.E4M3,
        "fp8_quant_fwd_inp": QParams(power_2_scale=True, amax_epsilon=0.0),
        "fp8_quant_fwd_weight": QParams(power_2_scale=True, amax_epsilon=0.0),
        "fp8_quant_bwd_grad": QParams(power_2_scale=True, amax_epsilon=0.0),
        "x_block_scaling_dim": 1,
        "w_block_scaling_dim": 2,
        "grad_block_scaling_dim": 1,
        "fp8_gemm_fprop": MMParams(use_split_accumulator=True),
        "fp8_gemm_dgrad": MMParams(use_split_accumulator=True),
        "fp8_gemm_wgrad": MMParams(use_split_accumulator=True),
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
    MXFP8BlockScaling: {
        "margin": 0,
        "fp8_format": Format.E4M3,
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
        "enable_2d_quantization": False,
    },
    NVFP4BlockScaling: {
        "disable_rht": False,
        "disable_stochastic_rounding": False,
        "disable_2d_quantization": False,
        "row_scaled_activation": False,
        "nvfp4_4over6": "none",
        "nvfp4_4over6_e4m3_use_256": "all",
        "nvfp4_4over6_err_mode": "MAE",
        "fp4_format": Format.E2M1,
        "fp8_format": Format.E4M3,
        "fp4_quant_fwd_inp": QParams(random_hadamard_transform=True),
        "fp4_quant_fwd_weight": QParams(fp4_2d_quantization=True),
        "fp4_quant_bwd_grad": QParams(random_hadamard_transform=True, stochastic_rounding=True),
        "fp8_dpa": False,
        "fp8_mha": False,
        "backward_override": None,
    },
}
TE_QPARAMS_DEFAULTS = {
    "power_2_scale": False,
    "amax_epsilon": 0.0,
    "random_hadamard_transform": False,
    "stochastic_rounding": False,
    "fp4_2d_quantization": False,
}


# ---------------------------------------------------------------------------------------------
# Formats and defaults
# ---------------------------------------------------------------------------------------------


def test_format_dtypes_and_max_values():
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert (Format.E4M3.fwd_dtype, Format.E4M3.bwd_dtype) == (e4m3, e4m3)
    assert (Format.E5M2.fwd_dtype, Format.E5M2.bwd_dtype) == (e5m2, e5m2)
    assert (Format.HYBRID.fwd_dtype, Format.HYBRID.bwd_dtype) == (e4m3, e5m2)
    assert Format.E4M3.max_fwd == Format.E4M3.max_bwd == torch.finfo(e4m3).max == 448
    assert Format.E5M2.max_fwd == Format.E5M2.max_bwd == torch.finfo(e5m2).max == 57344
    assert (Format.HYBRID.max_fwd, Format.HYBRID.max_bwd) == (448, 57344)
    assert Format.E2M1.max_fwd == 6 and Format.E2M1.fwd_dtype == torch.float4_e2m1fn_x2
    # TE's spelling of the same numbers.
    assert Format.HYBRID.value.max_fwd == 448 and Format.HYBRID.value.max_bwd == 57344
    assert repr(Format.HYBRID) == "Format.HYBRID"


@pytest.mark.parametrize("cls", RECIPES, ids=lambda c: c.__name__)
def test_defaults_equal_transformer_engine(cls):
    recipe = cls()
    assert {name: getattr(recipe, name) for name in TE_DEFAULTS[cls]} == TE_DEFAULTS[cls]
    fields = {f.name for f in dataclasses.fields(cls)}
    assert fields <= set(TE_DEFAULTS[cls]), "a field that TE does not have"


def test_qparams_and_mmparams_defaults():
    assert dataclasses.asdict(QParams()) == TE_QPARAMS_DEFAULTS
    assert MMParams().use_split_accumulator is True


def test_block_constants():
    assert Float8BlockScaling.block_len == 128
    assert (MXFP8BlockScaling.block_len, MXFP8BlockScaling.scale_dtype) == (
        32,
        torch.float8_e8m0fnu,
    )
    assert (NVFP4BlockScaling.block_len, NVFP4BlockScaling.scale_dtype) == (
        16,
        torch.float8_e4m3fn,
    )
    assert NVFP4BlockScaling.global_scale_dtype == torch.float32


def test_quant_params_follow_instance_fields():
    assert Float8CurrentScaling(use_power_2_scales=True).fp8_quant_fwd_weight.power_2_scale
    assert not Float8BlockScaling(use_f32_scales=True).fp8_quant_bwd_grad.power_2_scale
    nvfp4 = NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    )
    assert nvfp4.fp4_quant_fwd_inp == nvfp4.fp4_quant_fwd_weight == QParams()
    assert nvfp4.fp4_quant_bwd_grad == QParams()


_KINDS = {
    DelayedScaling: "delayed",
    Float8CurrentScaling: "current",
    Float8BlockScaling: "block",
    MXFP8BlockScaling: "mxfp8",
    NVFP4BlockScaling: "nvfp4",
}


@pytest.mark.parametrize("cls", RECIPES, ids=lambda c: c.__name__)
def test_kind_and_predicates(cls):
    recipe = cls()
    assert recipe.kind == _KINDS[cls]
    predicates = {
        "delayed": recipe.delayed(),
        "current": recipe.float8_current_scaling(),
        "block": recipe.float8_block_scaling(),
        "mxfp8": recipe.mxfp8(),
        "nvfp4": recipe.nvfp4(),
    }
    assert [k for k, v in predicates.items() if v] == [recipe.kind]
    assert recipe.float8_current() == recipe.float8_current_scaling()
    assert recipe.float8_per_tensor_scaling() == (recipe.kind in ("delayed", "current"))


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

BAD = [
    (DelayedScaling, {"margin": -1}, "DelayedScaling: margin must be >= 0, got -1"),
    (DelayedScaling, {"margin": 1.5}, "DelayedScaling: margin must be of type int, got 1.5"),
    (DelayedScaling, {"margin": True}, "margin must be of type int, got True"),
    (DelayedScaling, {"fp8_format": "HYBRID"}, "fp8_format must be of type Format, got 'HYBRID'"),
    (
        DelayedScaling,
        {"fp8_format": Format.E5M2},
        "DelayedScaling: fp8_format must be Format.E4M3 or Format.HYBRID (E4M3 forward), "
        "got Format.E5M2",
    ),
    (DelayedScaling, {"fp8_format": Format.E2M1}, "fp8_format must be Format.E4M3 or"),
    (DelayedScaling, {"amax_history_len": 0}, "amax_history_len must be >= 1, got 0"),
    (
        DelayedScaling,
        {"amax_compute_algo": "mean"},
        "amax_compute_algo must be one of ('max', 'most_recent') or a callable, got 'mean'",
    ),
    (
        DelayedScaling,
        {"scaling_factor_compute_algo": "max"},
        "scaling_factor_compute_algo must be None or a callable, got 'max'",
    ),
    (DelayedScaling, {"reduce_amax": 1}, "reduce_amax must be of type bool, got 1"),
    (DelayedScaling, {"fp8_dpa": True}, "fp8_dpa must be False (te_compile has no FP8 attention)"),
    (
        DelayedScaling,
        {"backward_override": "high_precision"},
        "backward_override must be None for delayed scaling (as in Transformer Engine)",
    ),
    (Float8CurrentScaling, {"fp8_format": Format.E5M2}, "fp8_format must be Format.E4M3 or"),
    (
        Float8CurrentScaling,
        {"backward_override": "fast"},
        "backward_override must be one of (None, 'high_precision', 'dequantized'), got 'fast'",
    ),
    (Float8CurrentScaling, {"fp8_gemm_fprop": False}, "fp8_gemm_fprop must be of type MMParams"),
    (Float8BlockScaling, {"backward_override": "fp8"}, "backward_override must be one of"),
    (
        Float8CurrentScaling,
        {"fp8_gemm_fprop": MMParams(use_split_accumulator=True)},
        "fp8_gemm_fprop must be MMParams(use_split_accumulator=False): te_compile's per-tensor "
        "forward GEMMs run fast accumulation",
    ),
    (
        Float8BlockScaling,
        {"x_block_scaling_dim": 3},
        "x_block_scaling_dim must be 1 (1x128 blocks) or 2 (128x128 blocks), got 3",
    ),
    (
        Float8BlockScaling,
        {"w_block_scaling_dim": 0},
        "w_block_scaling_dim must be 1 (1x128 blocks) or 2",
    ),
    (
        Float8BlockScaling,
        {"x_block_scaling_dim": 2},
        "x_block_scaling_dim and w_block_scaling_dim cannot both be 2 (no 2D-by-2D block GEMM)",
    ),
    (
        Float8BlockScaling,
        {"grad_block_scaling_dim": 2},
        "grad_block_scaling_dim and w_block_scaling_dim cannot both be 2",
    ),
    (
        Float8BlockScaling,
        {"x_block_scaling_dim": 2, "w_block_scaling_dim": 1, "grad_block_scaling_dim": 2},
        "grad_block_scaling_dim and x_block_scaling_dim cannot both be 2",
    ),
    (
        Float8BlockScaling,
        {"fp8_gemm_wgrad": MMParams(use_split_accumulator=False)},
        "fp8_gemm_wgrad must use use_split_accumulator=True with block scaling",
    ),
    (Float8BlockScaling, {"fp8_format": Format.E5M2}, "fp8_format must be Format.E4M3 or"),
    (Float8BlockScaling, {"fp8_mha": True}, "fp8_mha must be False"),
    (MXFP8BlockScaling, {"margin": -2}, "MXFP8BlockScaling: margin must be >= 0, got -2"),
    (MXFP8BlockScaling, {"fp8_format": Format.E5M2}, "fp8_format must be Format.E4M3 or"),
    (NVFP4BlockScaling, {"fp4_format": Format.E4M3}, "fp4_format must be Format.E2M1"),
    (
        NVFP4BlockScaling,
        {"fp8_format": Format.HYBRID},
        "fp8_format must be Format.E4M3 (the block-scale format), got Format.HYBRID",
    ),
    (NVFP4BlockScaling, {"disable_rht": "yes"}, "disable_rht must be of type bool, got 'yes'"),
    (
        NVFP4BlockScaling,
        {"nvfp4_4over6": "both"},
        "nvfp4_4over6 must be one of ('none', 'weights', 'activations', 'all'), got 'both'",
    ),
    (
        NVFP4BlockScaling,
        {"nvfp4_4over6_e4m3_use_256": "input"},
        "nvfp4_4over6_e4m3_use_256 must be one of ('none', 'weights', 'activations', 'all')",
    ),
    (
        NVFP4BlockScaling,
        {"nvfp4_4over6_err_mode": "mse"},
        "nvfp4_4over6_err_mode must be one of ('MAE', 'MSE'), got 'mse'",
    ),
    (
        NVFP4BlockScaling,
        {"row_scaled_activation": 1},
        "row_scaled_activation must be of type bool, got 1",
    ),
    (QParams, {"amax_epsilon": -1.0}, "QParams: amax_epsilon must be >= 0, got -1.0"),
    (QParams, {"amax_epsilon": math.inf}, "QParams: amax_epsilon must be finite, got inf"),
    (QParams, {"amax_epsilon": math.nan}, "QParams: amax_epsilon must be finite, got nan"),
    (DelayedScaling, {"reduce_amax": "no"}, "reduce_amax must be of type bool, got 'no'"),
    (Float8CurrentScaling, {"use_power_2_scales": 1}, "use_power_2_scales must be of type bool"),
    (QParams, {"power_2_scale": None}, "QParams: power_2_scale must be of type bool, got None"),
    (MMParams, {"use_split_accumulator": 1}, "use_split_accumulator must be of type bool"),
]


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"), BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _ in BAD]
)
def test_invalid_fields_raise_naming_field_and_constraint(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (DelayedScaling, {"fp8_format": Format.E4M3, "amax_compute_algo": "most_recent"}),
        (DelayedScaling, {"margin": 2, "amax_history_len": 1, "reduce_amax": False}),
        (Float8CurrentScaling, {"fp8_format": Format.E4M3, "use_power_2_scales": True}),
        (Float8BlockScaling, {"x_block_scaling_dim": 2, "w_block_scaling_dim": 1}),
        (Float8BlockScaling, {"fp8_format": Format.HYBRID, "use_f32_scales": True}),
        (MXFP8BlockScaling, {"fp8_format": Format.HYBRID, "margin": 1}),
        (NVFP4BlockScaling, {"disable_rht": True, "disable_stochastic_rounding": True}),
        (NVFP4BlockScaling, {"row_scaled_activation": True, "backward_override": "dequantized"}),
        (NVFP4BlockScaling, {"nvfp4_4over6": "all", "nvfp4_4over6_err_mode": "MSE"}),
        (QParams, {"amax_epsilon": 0}),
    ],
)
def test_valid_non_defaults_construct(cls, kwargs):
    assert cls(**kwargs) == cls(**kwargs)


def test_base_recipe_is_not_constructible():
    with pytest.raises(TypeError, match="Recipe is a base class"):
        Recipe()


# ---------------------------------------------------------------------------------------------
# Mutable as TE's dataclasses, validated on every assignment, guarded by torch.compile
# ---------------------------------------------------------------------------------------------


CHANGES = [
    (DelayedScaling, "margin", 2),
    (Float8CurrentScaling, "fp8_format", Format.E4M3),
    (Float8BlockScaling, "use_f32_scales", True),
    (MXFP8BlockScaling, "margin", 1),
    (NVFP4BlockScaling, "disable_rht", True),
]


@pytest.mark.parametrize(("cls", "field", "value"), CHANGES, ids=[c[0].__name__ for c in CHANGES])
def test_fields_can_be_set_after_construction(cls, field, value):
    recipe = cls()
    setattr(recipe, field, value)
    assert getattr(recipe, field) == value and recipe == cls(**{field: value})
    assert recipe != cls()
    with pytest.raises(TypeError):  # mutable: not hashable, as in TE
        hash(recipe)


@pytest.mark.parametrize("cls", RECIPES, ids=lambda c: c.__name__)
def test_bad_assignment_raises_and_keeps_the_old_value(cls):
    recipe = cls()
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}: fp8_format must be")):
        recipe.fp8_format = Format.E5M2
    assert recipe == cls()
    with pytest.raises(AttributeError, match=f"{cls.__name__} has no field 'backwards_override'"):
        recipe.backwards_override = "high_precision"  # a typo is not stored and ignored


@pytest.mark.parametrize(
    "cls", [Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling]
)
@pytest.mark.parametrize("value", ["high_precision", "dequantized", None])
def test_backward_override_values(cls, value):
    assert cls(backward_override=value).backward_override == value
    recipe = cls()
    recipe.backward_override = value
    assert recipe == cls(backward_override=value)


def test_delayed_scaling_refuses_backward_override_on_assignment():
    recipe = DelayedScaling()
    with pytest.raises(ValueError, match="backward_override must be None for delayed scaling"):
        recipe.backward_override = "dequantized"
    assert recipe.backward_override is None


def test_delayed_scaling_takes_callables():
    def scaling(amax, scale, fp8_max, recipe):
        return fp8_max / amax

    recipe = DelayedScaling(scaling_factor_compute_algo=scaling, amax_compute_algo=torch.amax)
    assert recipe.scaling_factor_compute_algo is scaling and recipe.amax_compute_algo is torch.amax
    recipe.scaling_factor_compute_algo = None
    assert recipe == DelayedScaling(amax_compute_algo=torch.amax)


def test_field_set_under_a_compiled_function_recompiles():
    """A compiled function that read a field recompiles when the field is set, and reuses its
    first graph when the field is set back: it never runs with a stale recipe."""
    recipe = Float8CurrentScaling()

    def fn(x):
        return x * (2 if recipe.backward_override == "high_precision" else 3)

    compiled, counter = compile_counted(fn, backend="eager")
    x = torch.ones(2)
    torch.testing.assert_close(compiled(x), 3 * x)
    recipe.backward_override = "high_precision"
    torch.testing.assert_close(compiled(x), 2 * x)
    assert counter.frame_count == 2
    recipe.backward_override = None
    torch.testing.assert_close(compiled(x), 3 * x)
    assert counter.frame_count == 2


def test_field_set_after_a_forward_applies_to_the_next():
    """Eager GEMM calls keep what they derive from a recipe in its memo (``Recipe.memo``: the
    specs, built once rather than per call); setting a field rebuilds it, so the next forward
    quantises as the new value says, bit for bit as a recipe built with that value."""
    torch.manual_seed(0)
    m = te.Linear(64, 16, params_dtype=torch.float32)
    x = torch.randn(32, 64)
    recipe = Float8CurrentScaling()
    with te.autocast(recipe=recipe):
        m(x)
        assert len(recipe.memo()) > 1  # the specs, and what the forward kept
        assert recipe.memo()["specs"][2].fp8_dtype is torch.float8_e5m2  # HYBRID's gradient
        recipe.fp8_format = Format.E4M3
        assert list(recipe.memo()) == ["specs"]  # made again from the new value alone
        assert recipe.memo()["specs"][2].fp8_dtype is torch.float8_e4m3fn
        out = m(x)
    with te.autocast(recipe=Float8CurrentScaling(fp8_format=Format.E4M3)):
        torch.testing.assert_close(out, m(x), rtol=0, atol=0)
    with te.autocast(recipe=recipe):
        recipe.fp8_quant_fwd_inp = QParams(power_2_scale=True)
        with pytest.raises(NotImplementedError, match=re.escape("fp8_quant_fwd_inp.power_2")):
            m(x)
    used = Float8CurrentScaling()
    with te.autocast(recipe=used):
        m(x)
    # The memo is no field: not compared, not printed.
    assert used.memo() and used == Float8CurrentScaling()
    assert repr(used) == repr(Float8CurrentScaling())


def test_field_set_inside_a_compiled_region_applies_to_its_gemms():
    """A field set in compiled code drops the memo of the old values (the memo is reset by an
    assignment torch 2.11's dynamo traces): the GEMMs after it in the same graph quantise as the
    new value says. Here E4M3 gradients instead of HYBRID's E5M2, bit for bit as eager."""
    torch.manual_seed(0)
    m = te.Linear(64, 16, params_dtype=torch.float32)
    x, grad = torch.randn(32, 64), torch.randn(32, 16) * 1e-3
    recipe = Float8CurrentScaling()
    with te.autocast(recipe=recipe):
        m(x)  # the memo now holds HYBRID's specs

    def forward(xx: torch.Tensor, r, set_format: bool = False) -> torch.Tensor:
        if set_format:
            r.fp8_format = Format.E4M3
        with te.autocast(recipe=r):
            return m(xx)

    def dgrad(fn, *args) -> torch.Tensor:
        xx = x.clone().requires_grad_()
        fn(xx, *args).backward(grad)
        return xx.grad

    got = dgrad(torch.compile(forward, backend="aot_eager", fullgraph=True), recipe, True)
    assert recipe.fp8_format is Format.E4M3
    e4m3 = dgrad(forward, Float8CurrentScaling(fp8_format=Format.E4M3))
    torch.testing.assert_close(got, e4m3, rtol=0, atol=0)
    assert not torch.equal(got, dgrad(forward, Float8CurrentScaling()))  # (HYBRID's differs)


def test_equality_depends_on_class_and_fields():
    assert DelayedScaling() != DelayedScaling(margin=1)
    assert MXFP8BlockScaling() != Float8BlockScaling()  # no shared fields decide equality


def test_recipe_argument_guards_recompile():
    """A recipe passed to a compiled function is a constant: guarded on its type and on the
    fields read, so an equal recipe reuses the graph and a different one recompiles."""

    def fn(x, recipe):
        return x * recipe.fp8_format.max_fwd + (recipe.margin if recipe.delayed() else 0)

    compiled, counter = compile_counted(fn, backend="eager")
    x = torch.ones(3)
    torch.testing.assert_close(compiled(x, DelayedScaling()), fn(x, DelayedScaling()))
    torch.testing.assert_close(compiled(x, DelayedScaling()), fn(x, DelayedScaling()))
    assert counter.frame_count == 1
    torch.testing.assert_close(compiled(x, DelayedScaling(margin=3)), fn(x, DelayedScaling(3)))
    torch.testing.assert_close(compiled(x, MXFP8BlockScaling()), fn(x, MXFP8BlockScaling()))
    assert counter.frame_count == 3


@pytest.mark.parametrize("cls", RECIPES, ids=lambda c: c.__name__)
def test_recipe_built_inside_compiled_region(cls):
    def fn(x):
        recipe = cls(fp8_dpa=False)  # the constructor, its defaults and __post_init__ all trace
        return x * recipe.fp8_format.max_fwd

    assert count_graph_breaks(fn, torch.ones(2)) == (1, 0)
    compiled, _ = compile_counted(fn, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(2)), fn(torch.ones(2)))


def test_invalid_recipe_under_compile_names_field():
    def fn(x):
        return x * DelayedScaling(margin=-1).margin

    torch._dynamo.reset()
    with pytest.raises(ValueError, match=re.escape("margin must be >= 0, got -1")):
        torch.compile(fn, backend="eager")(torch.ones(2))


# ---------------------------------------------------------------------------------------------
# Device capability
# ---------------------------------------------------------------------------------------------

AVAILABILITY = [
    q.is_fp8_available,
    q.is_fp8_block_scaling_available,
    q.is_mxfp8_available,
    q.is_nvfp4_available,
]


@pytest.mark.parametrize("check", AVAILABILITY, ids=lambda f: f.__name__)
def test_availability_return_types(check):
    available = check()
    assert isinstance(available, bool)
    result = check(return_reason=True)
    assert isinstance(result, tuple) and result[0] is available and isinstance(result[1], str)
    assert (result[1] == "") == available


@pytest.mark.skipif(HAS_CUDA, reason="checks the answers without a CUDA device")
@pytest.mark.parametrize("check", AVAILABILITY, ids=lambda f: f.__name__)
def test_availability_without_cuda(check):
    assert check() is False
    assert check(return_reason=True) == (False, "no CUDA device")


@pytest.mark.skipif(HAS_CUDA, reason="checks the answer without a CUDA device")
def test_default_recipe_without_cuda_is_delayed_scaling():
    assert q.get_default_fp8_recipe() == DelayedScaling()


@pytest.mark.parametrize(
    ("capability", "cuda", "expected"),
    [
        # capability, torch's CUDA version -> fp8, block, mxfp8, nvfp4
        ((8, 0), "12.9", (False, False, False, False)),
        ((8, 9), "12.9", (True, False, False, False)),
        ((9, 0), "12.8", (True, False, False, False)),
        ((9, 0), "12.9", (True, True, False, False)),
        ((10, 0), "13.0", (True, True, True, True)),
        ((12, 0), "12.9", (True, True, True, True)),
    ],
)
def test_availability_thresholds(monkeypatch, capability, cuda, expected):
    monkeypatch.setattr(device_mod, "_capability", lambda: capability)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert tuple(check() for check in AVAILABILITY) == expected
    for check, ok in zip(AVAILABILITY, expected, strict=True):
        reason = check(return_reason=True)[1]
        assert (reason == "") == ok
        if not ok:
            assert re.search(r"needs (compute capability|CUDA) \d+\.\d+", reason), reason
    default = MXFP8BlockScaling() if expected[2] else DelayedScaling()
    assert q.get_default_fp8_recipe() == default


def test_availability_reason_names_capabilities(monkeypatch):
    monkeypatch.setattr(device_mod, "_capability", lambda: (9, 0))
    assert q.is_mxfp8_available(return_reason=True) == (
        False,
        "MXFP8 needs compute capability 10.0 or higher; device has 9.0",
    )


def test_availability_inside_compiled_region():
    def fn(x):
        if q.is_fp8_available():
            return x * 2
        return x * int(q.get_default_fp8_recipe().delayed())

    assert count_graph_breaks(fn, torch.ones(2)) == (1, 0)
    compiled, _ = compile_counted(fn, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(2)), fn(torch.ones(2)))
