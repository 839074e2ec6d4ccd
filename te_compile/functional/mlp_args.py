"""The MLP family's arguments and their checks (``mlp_ops.py`` defines the ops): ``MLPArgs``
names the forward op's arguments and parses its specs; ``check_mlp``, shared by the implementation
(eager) and the fake (trace time), raises the same ValueError, naming the argument, in both."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import HIGH_DTYPES, check_choice, passed_once
from te_compile.functional.activation import ACTIVATIONS, GATED_ACTIVATIONS, check_gated_params
from te_compile.functional.dense_weight import check_weight_operand, fp8_weight_for_checks
from te_compile.functional.gemm import check_gemm_dims, check_specs
from te_compile.functional.linear_args import check_main_grad
from te_compile.functional.prologue import Norm, check_norm
from te_compile.functional.spec import EpilogueSpec, NormSpec, QuantSpec, parse, parse_roles

__all__ = ["MLP_ACTIVATIONS", "NORM_WEIGHT", "MLPArgs", "check_mlp"]

MLP_ACTIVATIONS = (*ACTIVATIONS, *GATED_ACTIVATIONS)


class MLPArgs(NamedTuple):
    """The forward op's arguments, by name."""

    inp: Tensor
    fc1_weight: Tensor
    fc1_bias: Tensor | None
    fc2_weight: Tensor
    fc2_bias: Tensor | None
    epilogue: str
    input_spec: str = ""
    weight_spec: str = ""
    grad_spec: str = ""
    scale1: Tensor | None = None
    scale2: Tensor | None = None
    grad_amax1: Tensor | None = None
    grad_amax2: Tensor | None = None
    norm: str = ""
    norm_weight: Tensor | None = None
    norm_bias: Tensor | None = None
    fc1_weight_q: list[Tensor] | None = None
    fc2_weight_q: list[Tensor] | None = None
    main_grad1: Tensor | None = None
    main_grad2: Tensor | None = None

    @property
    def specs(self) -> tuple[QuantSpec, QuantSpec, QuantSpec]:
        return parse_roles("te.mlp", self.input_spec, self.weight_spec, self.grad_spec)

    @property
    def ep(self) -> EpilogueSpec:
        return parse(EpilogueSpec, self.epilogue, "te.mlp: epilogue")

    @property
    def nrm(self) -> Norm:
        n = parse(NormSpec, self.norm, "te.mlp: norm")
        return Norm(self.norm_weight, self.norm_bias, n.normalization, n.eps,
                    n.zero_centered_gamma)  # fmt: skip


NORM_WEIGHT = MLPArgs._fields.index("norm_weight")


@passed_once
def check_mlp(a: MLPArgs) -> None:
    p = "te.mlp: "
    inp = a.inp
    pairs = ((a.fc1_weight, a.fc1_weight_q), (a.fc2_weight, a.fc2_weight_q))
    w1, w2 = (fp8_weight_for_checks("te.mlp", f"fc{i}_weight", w, q, inp.dtype, f"main_grad{i}")
              for i, (w, q) in enumerate(pairs, 1))  # fmt: skip
    check_norm(p, inp, a.nrm)
    ep = a.ep
    check_choice("te.mlp", "activation", ep.activation, MLP_ACTIVATIONS)
    if (ep.interleave, ep.scale, ep.branch) != (0, 1.0, False):
        raise ValueError(
            p + f"epilogue {a.epilogue!r}: te::mlp takes the activation with limit, alpha and "
            "offset (interleave, scale and branch are te::linear's)"
        )
    check_gated_params("te.mlp", ep.limit, ep.alpha, ep.offset)
    x, w, _ = specs = a.specs
    recipe = x.kind
    named = dict(zip(("input_spec", "weight_spec", "grad_spec"), specs, strict=True))
    for name, spec in named.items():  # first: check_specs would ask for the linear's rng_state
        if spec.options() or spec.stochastic_rounding:
            raise ValueError(
                p + f"{name} {spec.encode()!r}: NVFP4's options are te::linear's "
                "(quantization.gemm.mlp runs two te::linear calls for them)"
            )
    for i, scale, grad_amax in ((1, a.scale1, a.grad_amax1), (2, a.scale2, a.grad_amax2)):
        check_specs(p, named, scale, grad_amax, gemm=str(i))
    dtypes = HIGH_DTYPES if recipe else (*HIGH_DTYPES, torch.float64)
    if inp.dtype not in dtypes or w1.dtype != inp.dtype or w2.dtype != inp.dtype:
        raise ValueError(
            p + f"inp, fc1_weight and fc2_weight must share a float dtype "
            f"({'float32/bfloat16/float16 with an FP8 recipe' if recipe else 'any'}), got "
            f"{inp.dtype}, {w1.dtype}, {w2.dtype}"
        )
    gated = ep.activation in GATED_ACTIVATIONS
    if (
        w1.ndim != 2
        or w2.ndim != 2
        or inp.shape[-1] != w1.shape[1]
        or (gated and w1.shape[0] % 2)
        or w2.shape[1] != w1.shape[0] // (1 + gated)  # ffn: half of FC1's for a gated one
    ):
        fc1 = "[2 * ffn, hidden] (gated activation)" if gated else "[ffn, hidden]"
        raise ValueError(
            p + f"inp [..., hidden], fc1_weight {fc1} and fc2_weight [out, ffn] do not "
            f"match: {list(inp.shape)}, {list(w1.shape)}, {list(w2.shape)}"
        )
    rows = inp.numel() // inp.shape[-1] if inp.shape[-1] else 0
    check_gemm_dims(p, recipe, w, rows, hidden=w1.shape[1], ffn=w2.shape[1],
                    fc1_out=w1.shape[0], out=w2.shape[0])  # fmt: skip
    for i, wt, b, q, g in ((1, w1, a.fc1_bias, a.fc1_weight_q, a.main_grad1),
                           (2, w2, a.fc2_bias, a.fc2_weight_q, a.main_grad2)):  # fmt: skip
        if b is not None and (b.shape != wt.shape[:1] or b.dtype != inp.dtype):
            raise ValueError(p + f"fc{i}_bias must be [{wt.shape[0]}] of dtype {inp.dtype}")
        check_main_grad(p, g, wt, (f"main_grad{i}", f"fc{i}_weight"))
        check_weight_operand(p + f"fc{i}_", recipe, wt, w.block_rows, w.emulate, q)
