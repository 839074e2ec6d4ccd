"""The grouped linear family's arguments and their checks (``grouped_linear_ops.py`` defines the
ops): ``GroupedLinearArgs`` names the forward op's arguments and parses its specs; the checks are
shared by the implementations (eager) and the fake (trace time), so a bad argument raises the
same ValueError in both."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import FLOAT_DTYPES, INDEX_DTYPES
from te_compile.functional.family import DeferredWgrad
from te_compile.functional.gemm import PER_TENSOR, check_gemm_dims, check_specs
from te_compile.functional.grouped_gemm import GroupedRecipe, grouped_gemm_kind
from te_compile.functional.grouped_weight import check_grouped_weight_operand
from te_compile.functional.linear_args import check_fp8_input, check_main_grad
from te_compile.functional.spec import BackwardSpec, QuantSpec, parse, parse_roles

__all__ = ["GroupedLinearArgs", "appends_amaxes", "check_grouped_linear", "make_grouped_recipe"]


class GroupedLinearArgs(NamedTuple):
    """The forward op's arguments, by name (a call passes the first five, or all)."""

    inp: Tensor
    m_splits: Tensor
    weight: Tensor
    bias: Tensor | None = None
    main_grad: Tensor | None = None
    input_spec: str = ""
    weight_spec: str = ""
    grad_spec: str = ""
    scale: Tensor | None = None
    grad_amax: Tensor | None = None
    rng_state: Tensor | None = None
    backward: str = ""
    weight_q: list[Tensor] | None = None
    wgrad_stash: Tensor | None = None

    @property
    def specs(self) -> tuple[QuantSpec, QuantSpec, QuantSpec]:
        return parse_roles("te.grouped_linear", self.input_spec, self.weight_spec, self.grad_spec)

    @property
    def bw(self) -> BackwardSpec:
        return parse(BackwardSpec, self.backward, "te.grouped_linear: backward")

    @property
    def grouped_recipe(self) -> GroupedRecipe:
        return make_grouped_recipe(self.specs, self.scale, self.grad_amax, self.bw, self.rng_state)


def make_grouped_recipe(specs, scale, grad_amax, bw: BackwardSpec, rng_state) -> GroupedRecipe:
    """The recipe of an op's parsed specs and state (``rng_state`` only for stochastic rounding)."""
    sr = specs[2].stochastic_rounding
    return GroupedRecipe(*specs, bw, scale, grad_amax, rng_state if sr else None)


def appends_amaxes(recipe: str, grad_amax: Tensor | None) -> bool:
    """Whether the forward appends the amaxes of its operands to ``saved``."""
    return recipe == "delayed" or (recipe == "current" and grad_amax is not None)


def check_grouped_linear(a: GroupedLinearArgs) -> None:
    p = "te.grouped_linear: "
    inp, m_splits, weight, bias = a[:4]
    if inp.ndim != 2:
        raise ValueError(
            p + f"inp must be 2-D [sum(m_splits), in_features], got shape {list(inp.shape)}"
        )
    if weight.ndim != 3:
        raise ValueError(
            p + f"weight must be 3-D [num_gemms, out_features, in_features], got shape "
            f"{list(weight.shape)}"
        )
    if inp.dtype not in FLOAT_DTYPES:
        raise ValueError(p + f"inp.dtype must be a floating type, got {inp.dtype}")
    if weight.dtype != inp.dtype:
        raise ValueError(p + f"inp.dtype ({inp.dtype}) must equal weight.dtype ({weight.dtype})")
    if inp.shape[1] != weight.shape[2]:
        raise ValueError(
            p + f"inp.shape[1] ({inp.shape[1]}) must equal in_features = weight.shape[2] "
            f"({weight.shape[2]})"
        )
    if m_splits.ndim != 1 or m_splits.dtype not in INDEX_DTYPES:
        raise ValueError(
            p + f"m_splits must be a 1-D int32/int64 tensor (or a list of ints), got "
            f"{m_splits.dtype} of shape {list(m_splits.shape)}"
        )
    if m_splits.shape[0] != weight.shape[0]:
        raise ValueError(
            p + f"m_splits has {m_splits.shape[0]} groups but weight has num_gemms = "
            f"{weight.shape[0]}"
        )
    if m_splits.device != inp.device and m_splits.device.type != "cpu":
        raise ValueError(
            p + f"m_splits must be on inp's device ({inp.device}) or the CPU, got {m_splits.device}"
        )
    if bias is not None and bias.shape != weight.shape[:2]:
        raise ValueError(
            p + f"bias must have shape [num_gemms, out_features] = {list(weight.shape[:2])}, got "
            f"{list(bias.shape)}"
        )
    if bias is not None and bias.dtype != inp.dtype:
        raise ValueError(p + f"bias.dtype ({bias.dtype}) must equal inp.dtype ({inp.dtype})")
    check_main_grad(p, a.main_grad, weight)
    DeferredWgrad.check_stash(p, a.wgrad_stash, (inp.shape[0], weight.shape[1]), inp)
    if not (
        a.input_spec or a.weight_spec or a.grad_spec or a.backward or a.scale is not None
        or a.grad_amax is not None or a.rng_state is not None or a.weight_q is not None
    ):  # fmt: skip
        return  # high precision: the hot path
    (x, w, g), bw = a.specs, a.bw
    recipe = check_specs(p, {"input_spec": x, "weight_spec": w, "grad_spec": g}, a.scale,
                         a.grad_amax, a.rng_state, a.inp)  # fmt: skip
    dequantized_save_input = bw.save_input and bw.override == "dequantized"
    if bw.override and (not recipe or bw.fp8_wgrad or dequantized_save_input):
        raise ValueError(
            p + f"backward {a.backward!r}: 'high_precision' / 'dequantized' is for a quantised "
            "recipe, without 'fp8_wgrad' (the backward GEMMs are high precision's) and, with "
            "'dequantized', without 'save_input' (the dequantised input is saved)"
        )
    # the emulated block-scaled kinds quantise a kept input again: their quantisation is
    # deterministic (native blockwise: below)
    if bw.save_input and recipe == "delayed":
        raise ValueError(
            p + "backward 'save_input' (save_original_input) works with high precision, current "
            "scaling and the emulated block-scaled GEMMs, not with 'delayed' specs "
            "(DelayedScaling: the backward would quantise the input again with a scale the "
            "update may have changed)"
        )
    blockwise = grouped_gemm_kind(recipe, x.emulate) == "blockwise"
    if bw.save_input and blockwise:
        raise NotImplementedError(
            p + "backward 'save_input' (save_original_input) is not implemented for the native "
            "blockwise GEMMs (block specs without 'emulate'); emulate them or save the copy"
        )
    if bw.fp8_wgrad and recipe not in PER_TENSOR:
        raise ValueError(p + "backward 'fp8_wgrad' is for the per-tensor kinds (current, delayed)")
    if x.row_scaled and not bw.override:
        raise ValueError(p + "a row_scaled input_spec needs backward 'high_precision' or "
                         f"'dequantized', got backward={a.backward!r}")  # fmt: skip
    if w.fp8_dtype is not x.fp8_dtype or not x.power_2_scale == w.power_2_scale == g.power_2_scale:
        raise ValueError(
            p + "the grouped GEMMs take the input's format for the weight and one power-of-two "
            f"option for all operands, got input_spec={a.input_spec!r}, "
            f"weight_spec={a.weight_spec!r}, grad_spec={a.grad_spec!r}"
        )
    if recipe == "mxfp8" and w.block_rows != 1:
        raise NotImplementedError(
            p + f"weight_spec {a.weight_spec!r}: MXFP8's 32x32 weight tiles "
            "(MXFP8BlockScaling(enable_2d_quantization=True)) are not implemented by the grouped "
            "GEMMs; use enable_2d_quantization=False"
        )
    check_grouped_weight_operand(p, recipe, a.weight, w.block_rows, w.emulate, a.weight_q)
    q = a.weight_q  # without its dgrad copy, NVFP4's is the weight's transpose: 16x16 tiles
    own_copy = q is not None and not q[2].numel() and w.block_rows != 16
    if q is not None and recipe == "nvfp4" and (w.four_over_six or own_copy):
        raise ValueError(
            p + "an NVFP4 pre-quantised weight needs a weight_spec without 4over6 and, without "
            f"its dgrad copy, 16x16 tiles (the copy is then the weight), got {a.weight_spec!r}"
        )
    if not recipe:
        return
    check_fp8_input(p, a.inp)
    _, n, k = a.weight.shape
    check_gemm_dims(p, recipe, w, None, "grouped GEMMs", in_features=k, out_features=n)
    if (
        recipe == "nvfp4"
        and m_splits.device.type == "cpu"
        and not isinstance(m_splits, torch._subclasses.FakeTensor)
        and any(int(m) % 16 for m in m_splits.tolist())
    ):
        raise ValueError(
            p + "nvfp4 grouped GEMMs need every group's token count (m_splits) to be a "
            f"multiple of 16 (blocks of 16 tokens along M), got {m_splits.tolist()} "
            "(te.Fp8Padding pads them)"
        )
