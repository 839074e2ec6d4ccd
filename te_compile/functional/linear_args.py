"""The linear family's arguments (``LinearArgs``, which parses the spec strings) and their checks
(``linear_ops.py`` defines the ops), shared by the implementations (eager) and the fakes (trace
time), so a bad argument raises the same ValueError, naming it, in eager and under
``torch.compile``: ``check_linear_tensors`` the four tensors (the hot path), ``check_linear``
the whole call (recipe, prologue, epilogue, backward, pre-quantised weight).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import FLOAT_DTYPES, check_finite, passed_once
from te_compile.functional.activation import GATED_ACTIVATIONS, check_activation, check_gated_params
from te_compile.functional.dense_weight import check_weight_operand, fp8_weight_for_checks
from te_compile.functional.family import DeferredWgrad
from te_compile.functional.gemm import HIGH_DTYPES, check_gemm_dims, check_specs
from te_compile.functional.prologue import Norm, check_norm
from te_compile.functional.spec import (
    BackwardSpec,
    EpilogueSpec,
    NormSpec,
    QuantSpec,
    parse,
    parse_roles,
)


class LinearArgs(NamedTuple):
    """The forward op's arguments, by name (a call passes the first four, or all)."""

    inp: Tensor
    weight: Tensor
    bias: Tensor | None = None
    main_grad: Tensor | None = None
    input_spec: str = ""
    weight_spec: str = ""
    grad_spec: str = ""
    scale: Tensor | None = None
    grad_amax: Tensor | None = None
    rng_state: Tensor | None = None
    norm: str = ""
    norm_weight: Tensor | None = None
    norm_bias: Tensor | None = None
    epilogue: str = ""
    residual: Tensor | None = None
    backward: str = ""
    weight_q: list[Tensor] | None = None
    wgrad_stash: Tensor | None = None

    @property
    def specs(self) -> tuple[QuantSpec, QuantSpec, QuantSpec]:
        return parse_roles("te.linear", self.input_spec, self.weight_spec, self.grad_spec)

    @property
    def ep(self) -> EpilogueSpec:
        return parse(EpilogueSpec, self.epilogue, "te.linear: epilogue")

    @property
    def bw(self) -> BackwardSpec:
        return parse(BackwardSpec, self.backward, "te.linear: backward")

    @property
    def plain(self) -> bool:
        """High precision without a prologue or an epilogue: ``te.Linear``'s hot path."""
        return not (
            self.input_spec or self.weight_spec or self.grad_spec or self.norm or self.epilogue
            or self.backward or self.scale is not None or self.grad_amax is not None
            or self.rng_state is not None or self.norm_weight is not None
            or self.norm_bias is not None or self.residual is not None
            or self.weight_q is not None or self.wgrad_stash is not None)  # fmt: skip

    @property
    def nrm(self) -> Norm:
        n = parse(NormSpec, self.norm, "te.linear: norm")
        return Norm(self.norm_weight, self.norm_bias, n.normalization, n.eps,
                    n.zero_centered_gamma)  # fmt: skip


NORM_WEIGHT, RESIDUAL = (LinearArgs._fields.index(n) for n in ("norm_weight", "residual"))


def out_features(n: int, activation: str) -> int:
    return n // 2 if activation in GATED_ACTIVATIONS else n


def check_main_grad(p: str, g: Tensor | None, w: Tensor, names=("main_grad", "weight")) -> None:
    if g is not None and (g.dtype is not torch.float32 or g.shape != w.shape):
        raise ValueError(
            p + f"{names[0]} must be float32 with {names[1]}'s shape {list(w.shape)}, "
            f"got {g.dtype} {list(g.shape)}"
        )


def check_fp8_input(p: str, inp: Tensor) -> None:
    if inp.dtype not in HIGH_DTYPES:
        raise ValueError(p + f"FP8 recipes take float32/bfloat16/float16 inputs, got {inp.dtype}")


def check_linear_tensors(
    inp: Tensor, weight: Tensor, bias: Tensor | None, main_grad: Tensor | None
) -> None:
    """The four tensors (the hot path: plain tests, each error naming its argument)."""
    if weight.dim() != 2:
        raise ValueError(
            f"te.linear: weight must be 2-D [out_features, in_features], got {weight.dim()}-D"
        )
    if inp.dim() < 1:
        raise ValueError("te.linear: inp must have at least 1 dimension")
    if inp.dtype not in FLOAT_DTYPES:
        raise ValueError(f"te.linear: inp.dtype must be a floating type, got {inp.dtype}")
    if inp.dtype != weight.dtype:
        raise ValueError(
            f"te.linear: inp.dtype ({inp.dtype}) must equal weight.dtype ({weight.dtype}); "
            "use torch.autocast or cast the input"
        )
    if inp.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"te.linear: inp.shape[-1] ({inp.shape[-1]}) must equal in_features = "
            f"weight.shape[1] ({weight.shape[1]})"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"te.linear: bias must have shape [out_features] = [{weight.shape[0]}], "
            f"got {list(bias.shape)}"
        )
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(
            f"te.linear: bias.dtype ({bias.dtype}) must equal weight.dtype ({weight.dtype})"
        )
    check_main_grad("te.linear: ", main_grad, weight)


@passed_once
def check_linear(a: LinearArgs) -> None:
    inp = a.inp
    weight = fp8_weight_for_checks("te.linear", "weight", a.weight, a.weight_q, inp.dtype,
                                   "main_grad")  # fmt: skip
    if weight is not a.weight and a.bw.override == "high_precision":
        raise ValueError(
            "te.linear: backward 'high_precision' needs a high-precision weight, got "
            f"{a.weight.dtype} (FP8 primary weights)"
        )
    check_linear_tensors(inp, weight, a.bias, a.main_grad)
    if a.plain:
        return
    p = "te.linear: "
    x, w, g = a.specs
    ep, bw, norm = a.ep, a.bw, a.nrm
    recipe = check_specs(p, {"input_spec": x, "weight_spec": w, "grad_spec": g}, a.scale,
                         a.grad_amax, a.rng_state, inp)  # fmt: skip
    if x.row_scaled and not bw.override:
        raise ValueError(
            p + "a row_scaled input_spec needs backward 'high_precision' or 'dequantized' (a "
            f"row-scaled NVFP4 input has no columnwise copy), got backward={a.backward!r}"
        )
    if bw.save_input and x.four_over_six:
        raise NotImplementedError(
            p + "backward 'save_input' with 4over6 block scaling of the input is not "
            "implemented: the backward would quantise the input again without it"
        )
    if a.weight_q is not None and w.four_over_six:
        raise ValueError(
            p + "4over6 in weight_spec is for a weight the op quantises; a pre-quantised weight "
            "(weight_q) carries its own quantisation (quantize_weight's spec)"
        )
    n, k = weight.shape
    if recipe:
        check_fp8_input(p, inp)
        check_gemm_dims(p, recipe, w, inp.numel() // k if k else 0, in_features=k, out_features=n)
    if bw.fp8_wgrad:
        raise ValueError(p + "backward 'fp8_wgrad' is for the grouped family")
    if bw.override and not recipe:
        raise ValueError(p + "backward 'high_precision' / 'dequantized' is for a quantised recipe")
    if bw.save_input:
        if recipe == "delayed":
            raise ValueError(
                p + "backward 'save_input' (save_original_input) does not work with the "
                "delayed-scaling recipe (DelayedScaling): the backward would quantise the input "
                "again with a scale the amax-history update may have changed"
            )
        if not recipe or a.norm or bw.override == "dequantized":
            raise ValueError(
                p + "backward 'save_input' is for a quantised linear without a norm prologue and "
                f"without 'dequantized', got norm={a.norm!r}, backward={a.backward!r}"
            )
    check_weight_operand(p, recipe, weight, w.block_rows, w.emulate, a.weight_q)
    check_finite("te.linear", out_scale=ep.scale)
    check_norm(p, inp, norm)
    if ep.activation:
        if a.residual is not None or ep.branch:
            raise ValueError(p + "activation cannot be combined with residual or branch")
        gemm_out = torch.empty((*inp.shape[:-1], n), dtype=inp.dtype, device="meta")
        check_activation(gemm_out, a.bias, ep.activation, ep.interleave)
        check_gated_params("te.linear", ep.limit, ep.alpha, ep.offset)
    shape = (*inp.shape[:-1], out_features(n, ep.activation))
    DeferredWgrad.check_stash(p, a.wgrad_stash, shape, inp)
    if a.residual is not None and (a.residual.shape != shape or a.residual.dtype != inp.dtype):
        raise ValueError(
            p + f"residual must have the output's shape {list(shape)} and inp's dtype "
            f"{inp.dtype}, got {list(a.residual.shape)} {a.residual.dtype}"
        )
