"""``te_compile.LayerNormMLP``: norm -> FC1 -> activation -> FC2, with Transformer Engine's names.

.. math::
    y = \\mathrm{act}(\\mathrm{norm}(x) W_1^\\top + b_1) W_2^\\top + b_2

Parameters: ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm), ``fc1_weight``
``[F1, hidden_size]`` with ``F1 = 2 * ffn_hidden_size`` for gated activations (first half:
activation input, second half: linear input, as in Transformer Engine), ``fc1_bias``,
``fc2_weight`` ``[hidden_size, ffn_hidden_size]``, ``fc2_bias``.

One op for the block, ``te::mlp_fwd`` (``functional.mlp_ops``), under FP8 with the norm as its
prologue (without tensor parallelism and ``return_layernorm_output``), the autocast recipe as
data:
FC1 runs without its bias, the activation adds it (and returns ``dbias`` from its backward's
pass); under FP8 the activation and its gradient are fused into the quantisations.

The two GEMMs run as two ``te::linear`` calls around the activation (the same bytes, without
the fusion) where ``te::mlp`` does not implement what is asked of it
(``quantization.gemm.MLP_AS_TWO_LINEARS``; docs/op_mechanism.md says why for each):
``delay_wgrad_compute`` (the weight gradients wait for ``backward_dw``), ``checkpoint=True``
(FC1's output is recomputed), a recipe's ``backward_override``, calibration
(``calibrating=True``), NVFP4's per-operand options (the Hadamard transform,
stochastic rounding, row-scaled activations, 4over6) and a weight's ``overwrite_main_grad``
(Transformer Engine's attribute: its gradient replaces ``main_grad``'s values).
``fuse_wgrad_accumulation`` and FP8 primary weights (``quantized_model_init``: the
pre-quantised weights ``fc1_weight_q`` / ``fc2_weight_q``, the gradients into ``main_grad1`` /
``main_grad2``) run in ``te::mlp``.

Tensor parallelism: with a ``tp_group`` (or ``tp_size > 1``) FC1 is column-parallel and FC2
row-parallel, as Transformer Engine's ``set_parallel_mode=True``: each rank holds
``ffn_hidden_size / tp_size`` of the intermediate features (for gated activations its shard of
both halves: ``fc1_weight`` is ``[2 * ffn / tp, hidden]`` = [activation shard; linear shard],
``partition_stride`` 2), and the output is all-reduced over the group, or reduce-scattered
along dim 0 with ``sequence_parallel=True`` (the norm then runs on the sequence shard and the
input of FC1 is all-gathered). FC2's bias is added after the reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from te_compile._checks import check_int
from te_compile.distributed.tensor_parallel import TensorParallel, set_parallel_attributes
from te_compile.functional.activation import (
    CLAMPED_SWIGLU_DEFAULTS,
    GATED_ACTIVATIONS,
    MODULE_ACTIVATIONS,
    check_gated_params,
)
from te_compile.modules._common import (
    DelayedWgrad,
    check_bool,
    check_choice,
    check_positive,
    check_rng_tracker,
    default_device,
    eager_when_delaying_wgrad,
    init_method_or_default,
    params_dtype_or_default,
    rng_fork,
    weight_main_grad,
)
from te_compile.modules._te_signature import te_signature
from te_compile.modules.norm import PreNorm
from te_compile.ops.linear import dense_primary
from te_compile.quantization import fp8_gemm as _fp8
from te_compile.quantization import gemm as _gemm
from te_compile.quantization import primary as _primary
from te_compile.quantization.te_extra_state import accept_te_extra_state

__all__ = ["LayerNormMLP"]


def _activation_params(owner: str, activation: str, params: object) -> dict[str, float]:
    """``activation_params`` checked: a dict of ``clamped_swiglu``'s parameters (empty for
    the other activations, which take none)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise TypeError(f"{owner}: activation_params must be a dict or None, got {params!r}")
    if params and activation != "clamped_swiglu":
        raise ValueError(
            f"{owner}: activation_params are for activation='clamped_swiglu' only (limit, "
            f"alpha, glu_linear_offset); activation={activation!r} takes none, got {params!r}"
        )
    names = tuple(CLAMPED_SWIGLU_DEFAULTS)
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise ValueError(f"{owner}: activation_params keys must be among {names}, got {unknown}")
    full = {**CLAMPED_SWIGLU_DEFAULTS, **params}
    check_gated_params(f"{owner}: activation_params", full["limit"], full["alpha"],
                       full["glu_linear_offset"])  # fmt: skip
    return {name: float(value) for name, value in params.items()}


class LayerNormMLP(_primary.KeepFP8OnCast, DelayedWgrad, PreNorm):
    """A transformer MLP block with its pre-norm.

    Args:
        hidden_size: input and output features.
        ffn_hidden_size: intermediate features (per half, for gated activations).
        eps: the norm's epsilon.
        bias: learn FC1's and FC2's biases.
        activation: any name in ``te.functional.ACTIVATIONS`` or ``GATED_ACTIVATIONS``.
        fuse_wgrad_accumulation: accumulate FC1's and FC2's weight gradients into
            ``fc1_weight.main_grad`` / ``fc2_weight.main_grad`` (fp32, allocated by the caller)
            instead of ``.grad`` (in ``te::mlp``'s backward op).
        checkpoint: recompute the norm, FC1 and the activation in the backward instead of
            saving their outputs (FC2 is not recomputed); FP8 state included, as
            :func:`~te_compile.checkpoint` does it.
        activation_params: the activation's parameters, for ``clamped_swiglu`` only:
            ``{"limit": ..., "alpha": ...}`` (Transformer Engine's keys) and
            ``"glu_linear_offset"`` (default 7.0, 1.702, 1.0).
        normalization: "LayerNorm" or "RMSNorm".
        zero_centered_gamma: store the norm's scale as gamma - 1.
        return_layernorm_output: also return the norm's output.
        return_bias: return FC2's bias instead of adding it.
        params_dtype, device: of the parameters (defaults: torch's defaults).
        init_method, output_layer_init_method: initialise FC1's and FC2's weights.
        sequence_parallel, tp_group, tp_size: as in :class:`~te_compile.Linear`; FC1 is
            column-parallel and FC2 row-parallel when there is more than one shard.
        delay_wgrad_compute: the backward leaves FC1's and FC2's weight gradients to
            :meth:`backward_dw` (``DelayedWgrad``; under ``torch.compile`` the module runs
            eagerly behind a graph break; the GEMMs then run as two
            linear ops; not with ``checkpoint``).
        get_rng_state_tracker, rng_tracker_name: the weights are initialised inside
            ``get_rng_state_tracker().fork(rng_tracker_name)`` (the tracker's default state
            when the name is None), as in Transformer Engine (``rng_fork``).
    """

    @te_signature("LayerNormMLP")
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: dict[str, float] | None = None,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[Tensor], None] | None = None,
        output_layer_init_method: Callable[[Tensor], None] | None = None,
        sequence_parallel: bool = False,
        tp_group: object = None,
        tp_size: int | None = None,
        fuse_wgrad_accumulation: bool = False,
        checkpoint: bool = False,
        delay_wgrad_compute: bool = False,
        get_rng_state_tracker: Callable | None = None,
        rng_tracker_name: str | None = None,
    ) -> None:
        super().__init__()
        owner = "LayerNormMLP"
        self._init_delayed_wgrad(owner, delay_wgrad_compute)
        check_rng_tracker(owner, get_rng_state_tracker, rng_tracker_name)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        if checkpoint and delay_wgrad_compute:
            raise NotImplementedError(
                f"{owner}: checkpoint=True with delay_wgrad_compute=True is not supported (the "
                "recomputed FC1 would queue its weight gradient a second time)"
            )
        check_positive(owner, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        check_bool(
            owner, bias=bias, zero_centered_gamma=zero_centered_gamma,
            return_layernorm_output=return_layernorm_output, return_bias=return_bias,
            sequence_parallel=sequence_parallel, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            checkpoint=checkpoint,
        )  # fmt: skip
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.checkpoint = checkpoint
        check_choice(owner, "activation", activation, MODULE_ACTIVATIONS)
        self.activation_params = _activation_params(owner, activation, activation_params)
        device = default_device(owner, device)
        dtype = params_dtype_or_default(owner, params_dtype, device)
        if tp_size is not None:
            check_int(owner, 1, tp_size=tp_size)
        parallel = tp_group is not None or (tp_size or 1) > 1 or sequence_parallel
        # "column" stands for the pair: FC1 column-parallel, FC2 row-parallel.
        self.tp = TensorParallel.create(
            owner, "column" if parallel else None, sequence_parallel, tp_group, tp_size
        )
        if self.tp.mode is not None:
            ffn_hidden_size = self.tp.divide(owner, "ffn_hidden_size", ffn_hidden_size)
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.activation = activation
        self.gated = activation in GATED_ACTIVATIONS
        self.return_layernorm_output = return_layernorm_output
        self.return_bias = return_bias
        self.init_method = init_method_or_default(owner, "init_method", init_method)
        self.output_layer_init_method = init_method_or_default(
            owner, "output_layer_init_method", output_layer_init_method
        )
        factory = {"dtype": dtype, "device": device}
        fc1_out = 2 * ffn_hidden_size if self.gated else ffn_hidden_size
        self._init_norm(owner, hidden_size, eps, normalization, zero_centered_gamma, factory)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **factory))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **factory)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, **factory))
        self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        self.fc1_fp8_meta = _fp8.FP8GemmState(device)
        self.fc2_fp8_meta = _fp8.FP8GemmState(device)
        # A TE checkpoint's FP8 metadata: TE's GEMM 1 is FC1, GEMM 2 FC2.
        accept_te_extra_state(self, ("fc1_fp8_meta", "fc2_fp8_meta"), (1, 1))
        self._fp8_weights = _gemm.kept_weights("fc1_weight", "fc2_weight")  # is_first_microbatch
        if self.tp.mode is not None:
            stride = 2 if self.gated else 1
            set_parallel_attributes(self.fc1_weight, 0, stride)
            set_parallel_attributes(self.fc1_bias, 0, stride)
            set_parallel_attributes(self.fc2_weight, 1)
            set_parallel_attributes(self.fc2_bias, sequence_parallel=self.tp.sequence_parallel)
            self._mark_norm_parallel(self.tp.sequence_parallel)
        self.reset_parameters()
        _primary.make_primary(self, ("fc1_weight", "fc2_weight"), "LayerNormMLP")

    @property
    def sequence_parallel(self) -> bool:
        return self.tp.sequence_parallel

    def set_tensor_parallel_group(self, tp_group: object) -> None:
        """Set the group of a module built with ``tp_size > 1`` and no ``tp_group``."""
        self.tp = self.tp.with_group("LayerNormMLP", tp_group)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self._reset_norm()
        with (
            _primary.high_precision_init(self, ("fc1_weight", "fc2_weight")),
            rng_fork(self.get_rng_state_tracker, self.rng_tracker_name),
        ):
            self.init_method(self.fc1_weight)
            self.output_layer_init_method(self.fc2_weight)
        for bias in (self.fc1_bias, self.fc2_bias):
            if bias is not None:
                bias.zero_()

    @eager_when_delaying_wgrad
    def forward(
        self, inp: Tensor, is_first_microbatch: bool | None = None
    ) -> Tensor | tuple[Tensor, ...]:
        owner = "LayerNormMLP"
        tp = self.tp
        cache = None
        if is_first_microbatch is not None:
            _gemm.check_first_microbatch(owner, is_first_microbatch)
            cache = _gemm.WeightCache(self._fp8_weights, is_first_microbatch)
        if not (tp.active or self.return_layernorm_output) and self._fused_norm(inp):
            # FP8: one op, the norm its prologue (written straight into FP8 on CUDA); in high
            # precision too where PreNorm._fused_norm says.
            fc2_bias = None if self.return_bias else self.fc2_bias
            out = self._fc1_act_fc2(owner, inp, fc2_bias, self._norm_spec(), cache)
            return (out, self.fc2_bias) if self.return_bias else out
        ln_out = self._norm(inp, tp, owner)
        # FC1 column-parallel, FC2 row-parallel: the input gathered, the output reduced.
        out, fc2_bias = tp.pair(
            owner, lambda x, b: self._fc1_act_fc2(owner, x, b, None, cache), ln_out, self.fc2_bias,
            add_bias=not self.return_bias,
        )  # fmt: skip
        extra: tuple[Tensor | None, ...] = ()
        if self.return_bias:
            extra += (fc2_bias,)
        if self.return_layernorm_output:
            extra += (ln_out,)
        return (out, *extra) if extra else out

    def _fc1_act_fc2(
        self,
        owner: str,
        inp: Tensor,
        fc2_bias: Tensor | None,
        norm: _gemm.Norm | None = None,
        cache: _gemm.WeightCache | None = None,
    ) -> Tensor:
        """The two GEMMs and the activation as one op (``te::mlp``, the activation fused into
        the quantisations under FP8; with ``norm``, ``inp`` is normalised inside it)."""
        metas = (self.fc1_fp8_meta, self.fc2_fp8_meta)
        w1, b1, w2 = self.fc1_weight, self.fc1_bias, self.fc2_weight
        main_grads = None
        if self.fuse_wgrad_accumulation:
            main_grads = (weight_main_grad(owner, w1), weight_main_grad(owner, w2))
        fuse, wq = self.fuse_wgrad_accumulation, (None, None)
        fp8 = [dense_primary(self, "fc1_weight", w1, inp, fuse),
               dense_primary(self, "fc2_weight", w2, inp, fuse)]  # fmt: skip
        if fp8[0] is not None:  # FP8 primary weights: their gradients go to main_grad, or .grad
            (w1, g1, q1), (w2, g2, q2) = fp8
            main_grads, wq = (g1, g2), (q1, q2)
        defer = self._wgrad_defer(w1, w2)
        out = _gemm.mlp(owner, metas, inp, w1, b1, self.activation, w2, fc2_bias, norm=norm,
                        activation_params=self.activation_params, main_grads=main_grads,
                        recompute_fc1=self.checkpoint, cache=cache, weights_quantized=wq,
                        defer=defer)  # fmt: skip
        self._wgrad_queue(defer, out)
        return out

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, normalization={self.normalization}, eps={self.eps}"
            + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else "")
            + (", checkpoint=True" if self.checkpoint else "")
            + (", delay_wgrad_compute=True" if self.delay_wgrad_compute else "")
            + self.tp.describe().replace("parallel_mode='column', ", "")
        )
