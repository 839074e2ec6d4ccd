"""``te_compile.LayerNormLinear``: a norm followed by a Linear, with Transformer Engine's names.

Parameters: ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm), ``weight``
``[out_features, in_features]``, ``bias``. ``forward`` returns ``out``, then ``bias`` if
``return_bias`` (not added, so the caller can fuse the add), then the norm's output if
``return_layernorm_output`` — the order Transformer Engine uses.

Tensor parallelism: ``parallel_mode="column"`` only (the norm needs every input feature, so a
row-parallel LayerNormLinear would normalise a shard of them). The norm runs on the replicated
input, or with ``sequence_parallel=True`` on this rank's sequence shard (dim 0), whose output is
then all-gathered before the GEMM; the norm's parameters are marked ``sequence_parallel`` and
their gradients all-reduced over the group (see ``te_compile/distributed/tensor_parallel.py``).
The layer-norm output returned by ``return_layernorm_output`` is the local (not gathered) one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from te_compile.distributed.tensor_parallel import TensorParallel, set_parallel_attributes
from te_compile.modules._common import (
    DelayedWgrad,
    NamedSlices,
    check_bool,
    check_positive,
    check_rng_tracker,
    default_device,
    eager_when_delaying_wgrad,
    init_method_or_default,
    params_dtype_or_default,
    parse_parameters_split,
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

__all__ = ["LayerNormLinear"]


class LayerNormLinear(_primary.KeepFP8OnCast, DelayedWgrad, NamedSlices, PreNorm):
    r""":math:`y = \mathrm{norm}(x) W^\top + b`, the norm over ``in_features``.

    Args:
        in_features, out_features: sizes of the input and output features.
        eps: the norm's epsilon.
        bias: learn the Linear's additive bias.
        normalization: "LayerNorm" or "RMSNorm".
        zero_centered_gamma: store the norm's scale as gamma - 1.
        return_layernorm_output: also return the norm's output.
        return_bias: return the bias instead of adding it.
        params_dtype, device: of the parameters (defaults: torch's defaults).
        init_method: called as ``init_method(weight)`` (default: normal, std 0.023).
        fuse_wgrad_accumulation: accumulate the weight gradient into ``weight.main_grad``
            (fp32, allocated by the caller) instead of ``weight.grad``, as
            :class:`~te_compile.Linear`.
        parallel_mode: "column" or None; sequence_parallel, tp_group, tp_size: as in
            :class:`~te_compile.Linear`.
        parameters_split: named row blocks of the weight, as in :class:`~te_compile.Linear`.
        delay_wgrad_compute: the backward leaves the weight gradient to :meth:`backward_dw`
            (``DelayedWgrad``; also in ``eval()`` mode; under ``torch.compile`` the module runs
            eagerly behind a graph break).
        get_rng_state_tracker, rng_tracker_name: the weights are initialised inside
            ``get_rng_state_tracker().fork(rng_tracker_name)`` (the tracker's default state
            when the name is None), as in Transformer Engine (``rng_fork``).
    """

    @te_signature("LayerNormLinear")
    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        return_layernorm_output: bool = False,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[Tensor], None] | None = None,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        tp_group: object = None,
        tp_size: int | None = None,
        parameters_split: dict[str, int] | tuple[str, ...] | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        get_rng_state_tracker: Callable | None = None,
        rng_tracker_name: str | None = None,
    ) -> None:
        super().__init__()
        owner = "LayerNormLinear"
        check_positive(owner, in_features=in_features, out_features=out_features)
        self._init_delayed_wgrad(owner, delay_wgrad_compute)
        check_rng_tracker(owner, get_rng_state_tracker, rng_tracker_name)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        check_bool(
            owner, bias=bias, zero_centered_gamma=zero_centered_gamma,
            return_layernorm_output=return_layernorm_output, return_bias=return_bias,
            sequence_parallel=sequence_parallel, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
        )  # fmt: skip
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        device = default_device(owner, device)
        dtype = params_dtype_or_default(owner, params_dtype, device)
        self.tp = TensorParallel.create(
            owner, parallel_mode, sequence_parallel, tp_group, tp_size, modes=("column", None)
        )
        split_tp = self.tp.size if self.tp.mode == "column" else 1
        parts = parse_parameters_split(owner, parameters_split, out_features, split_tp)
        if self.tp.mode == "column":
            out_features = self.tp.divide(owner, "out_features", out_features)
        self.in_features, self.out_features = in_features, out_features
        self.return_layernorm_output = return_layernorm_output
        self.return_bias = return_bias
        self.init_method = init_method_or_default(owner, "init_method", init_method)
        factory = {"dtype": dtype, "device": device}
        self._init_norm(owner, in_features, eps, normalization, zero_centered_gamma, factory)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.fp8_meta = _fp8.FP8GemmState(device)
        accept_te_extra_state(self, ("fp8_meta",))  # a TE checkpoint's FP8 metadata
        self._fp8_weights = _gemm.kept_weights("weight")  # is_first_microbatch
        self._init_slices(parts)
        if self.tp.mode is not None:
            parts = self._split_parts(self.tp.size)
            set_parallel_attributes(self.weight, 0, parts=parts)
            set_parallel_attributes(self.bias, 0, parts=parts)
            self._mark_norm_parallel(self.tp.sequence_parallel)
        self.reset_parameters()
        _primary.make_primary(self, ("weight",), "LayerNormLinear")  # in quantized_model_init

    @property
    def parallel_mode(self) -> str | None:
        return self.tp.mode

    @property
    def sequence_parallel(self) -> bool:
        return self.tp.sequence_parallel

    def set_tensor_parallel_group(self, tp_group: object) -> None:
        """Set the group of a module built with ``tp_size > 1`` and no ``tp_group``."""
        self.tp = self.tp.with_group("LayerNormLinear", tp_group)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self._reset_norm()
        with (
            _primary.high_precision_init(self, ("weight",)),
            rng_fork(self.get_rng_state_tracker, self.rng_tracker_name),
        ):
            self.init_method(self.weight)
        if self.bias is not None:
            self.bias.zero_()

    @eager_when_delaying_wgrad
    def forward(
        self, inp: Tensor, is_first_microbatch: bool | None = None
    ) -> Tensor | tuple[Tensor, ...]:
        owner = "LayerNormLinear"
        add_bias = not self.return_bias
        param = weight = self.weight
        main_grad = weight_main_grad(owner, param) if self.fuse_wgrad_accumulation else None
        wq = None
        fp8 = dense_primary(self, "weight", param, inp, self.fuse_wgrad_accumulation)
        if fp8 is not None:  # FP8 primary weight: its gradient goes to main_grad, or .grad
            weight, main_grad, wq = fp8
        cache = None
        if is_first_microbatch is not None:
            _gemm.check_first_microbatch(owner, is_first_microbatch)
            cache = _gemm.WeightCache(self._fp8_weights, is_first_microbatch)
        defer = self._wgrad_defer(param)
        tp = self.tp
        if not (tp.active or self.return_layernorm_output) and _gemm.quantized():
            # FP8: one op, the norm its prologue (written straight into FP8 on CUDA). In high
            # precision the norm stays an op of its own, which selective activation
            # checkpointing can recompute without recomputing the GEMM.
            norm, bias = self._norm_spec(), self.bias if add_bias else None
            out = _gemm.linear(owner, self.fp8_meta, inp, weight, bias, main_grad, norm=norm,
                               cache=cache, weight_quantized=wq, defer=defer)  # fmt: skip
        else:

            def gemm(x: Tensor, bias: Tensor | None) -> Tensor:
                return _gemm.linear(owner, self.fp8_meta, x, weight, bias, main_grad,
                                    cache=cache, weight_quantized=wq, defer=defer)  # fmt: skip

            ln_out = self._norm(inp, tp, owner)
            if tp.mode is None:  # no tensor parallelism: the GEMM alone (the hot path)
                out = gemm(ln_out, self.bias if add_bias else None)
            else:
                out, _ = tp.linear(owner, gemm, ln_out, self.bias, add_bias=add_bias)
        self._wgrad_queue(defer, out)
        extra: tuple[Tensor | None, ...] = ()
        if self.return_bias:
            extra += (self.bias,)
        if self.return_layernorm_output:
            extra += (ln_out,)
        return (out, *extra) if extra else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, normalization={self.normalization}, eps={self.eps}"
            + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else "")
            + (", delay_wgrad_compute=True" if self.delay_wgrad_compute else "")
            + self.tp.describe()
        )
