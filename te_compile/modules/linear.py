"""``te_compile.Linear``: Transformer Engine's ``Linear`` argument names on ``te::linear_fwd``.

Differences from ``nn.Linear`` that come from Transformer Engine: the weight is initialised by
``init_method`` (default: normal with std 0.023, TE's default), the bias with zeros;
``return_bias=True`` returns the bias instead of adding it, so a following op can fuse the add;
``fuse_wgrad_accumulation=True`` accumulates the weight gradient into ``weight.main_grad`` (fp32,
allocated by the caller, e.g. a Megatron-style distributed optimizer) instead of ``weight.grad``.
``device=None``: "cuda" where a CUDA device is present, as in Transformer Engine, unless
torch's default device is set (``torch.set_default_device``, ``with torch.device("meta")``),
which then applies; without CUDA, torch's default device (``_checks.default_device``).

Tensor parallelism (``parallel_mode``, ``sequence_parallel``, ``tp_group``, ``tp_size``), as in
Transformer Engine: "column" shards ``out_features`` (the weight and bias hold this rank's rows;
the output is this rank's slice of the features), "row" shards ``in_features`` (the input is this
rank's slice, the output is summed over the group, then the full bias is added). ``in_features``
and ``out_features`` are the full sizes; the attributes of the same names hold the local ones,
as in Transformer Engine. See ``te_compile/distributed/tensor_parallel.py`` for the
communication and the parameter attributes.

Inside ``te_compile.autocast(recipe=...)`` the GEMMs run with the recipe (``te::linear_fwd``
with the recipe as data, ``quantization.gemm``); the delayed-scaling state lives in the
``fp8_meta`` child module's buffers (see ``te_compile/quantization/fp8_gemm.py``), so it is part
of the state_dict.
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
from te_compile.ops.linear import dense_primary
from te_compile.quantization import fp8_gemm as _fp8
from te_compile.quantization import gemm as _gemm
from te_compile.quantization import primary as _primary
from te_compile.quantization.te_extra_state import accept_te_extra_state

__all__ = ["Linear"]


class Linear(_primary.KeepFP8OnCast, DelayedWgrad, NamedSlices, nn.Module):
    r"""Applies :math:`y = x W^\top + b` over the last dimension of ``inp``.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias.
        params_dtype: dtype of the parameters (default: ``torch.get_default_dtype()``).
        device: device of the parameters (default: torch's current default device).
        return_bias: return ``(out, bias)`` without adding the bias.
        init_method: called as ``init_method(weight)`` to initialise the weight.
        fuse_wgrad_accumulation: accumulate the weight gradient into ``weight.main_grad``.
        parallel_mode: "column", "row" or None (not tensor-parallel).
        sequence_parallel: the input ("column") or output ("row") is sharded along dim 0.
        tp_group: the tensor-parallel group: a ProcessGroup, a 1-D DeviceMesh or
            ``(mesh, dim_name)``. None: no communication (``tp_size`` must then be 1, or the
            group is set later with :meth:`set_tensor_parallel_group`).
        tp_size: number of shards; None: the group's size (1 without a group).
        parameters_split: named row blocks of the weight (a dict of names to sizes, or names
            that split ``out_features`` evenly), e.g. ``{"query": q, "key": k, "value": v}``:
            state_dict keys and attributes ``<name>_weight`` / ``<name>_bias``, as in
            Transformer Engine; the module keeps one fused Parameter (``NamedSlices``).
        delay_wgrad_compute: the backward leaves the weight gradient to :meth:`backward_dw`
            (``DelayedWgrad``; also in ``eval()`` mode; under ``torch.compile`` the module runs
            eagerly behind a graph break).
        save_original_input: under an FP8 recipe the backward keeps the input itself (no
            bytes of its own where the caller keeps it, e.g. an input several modules read)
            rather than its quantised transposed copy, and quantises it again for the wgrad
            GEMM: the same gradients. Not with DelayedScaling (ValueError, as in Transformer
            Engine).
        get_rng_state_tracker, rng_tracker_name: the weights are initialised inside
            ``get_rng_state_tracker().fork(rng_tracker_name)`` (the tracker's default state
            when the name is None), as in Transformer Engine (``rng_fork``).

    ``forward(inp, is_first_microbatch=None)``: under an FP8 autocast, ``None`` casts the weight
    every call; ``True`` casts it and keeps the FP8 copy (plain tensors, not in the state_dict);
    ``False`` reuses the kept copy without casting (gradient accumulation: one cast per
    optimizer step), as in Transformer Engine (``quantization.gemm``, "Weight caching").
    """

    @te_signature("Linear")
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        return_bias: bool = False,
        init_method: Callable[[Tensor], None] | None = None,
        fuse_wgrad_accumulation: bool = False,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        tp_group: object = None,
        tp_size: int | None = None,
        parameters_split: dict[str, int] | tuple[str, ...] | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        get_rng_state_tracker: Callable | None = None,
        rng_tracker_name: str | None = None,
    ) -> None:
        super().__init__()
        check_positive("Linear", in_features=in_features, out_features=out_features)
        self._init_delayed_wgrad("Linear", delay_wgrad_compute)
        check_bool("Linear", save_original_input=save_original_input)
        self.save_original_input = save_original_input
        check_rng_tracker("Linear", get_rng_state_tracker, rng_tracker_name)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        check_bool(
            "Linear", bias=bias, return_bias=return_bias,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, sequence_parallel=sequence_parallel,
        )  # fmt: skip
        device = default_device("Linear", device)
        dtype = params_dtype_or_default("Linear", params_dtype, device)
        self.tp = TensorParallel.create(
            "Linear", parallel_mode, sequence_parallel, tp_group, tp_size
        )
        split_tp = self.tp.size if self.tp.mode == "column" else 1
        parts = parse_parameters_split("Linear", parameters_split, out_features, split_tp)
        if self.tp.mode == "column":
            out_features = self.tp.divide("Linear", "out_features", out_features)
        elif self.tp.mode == "row":
            in_features = self.tp.divide("Linear", "in_features", in_features)
        self.in_features = in_features
        self.out_features = out_features
        self.return_bias = return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.init_method = init_method_or_default("Linear", "init_method", init_method)
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.fp8_meta = _fp8.FP8GemmState(device)
        accept_te_extra_state(self, ("fp8_meta",))  # a TE checkpoint's FP8 metadata
        self._fp8_weights = _gemm.kept_weights("weight")  # is_first_microbatch
        self._init_slices(parts)
        if self.tp.mode is not None:
            column = self.tp.mode == "column"
            parts = self._split_parts(self.tp.size) if column else None
            set_parallel_attributes(self.weight, 0 if column else 1, parts=parts)
            row_sp = not column and self.tp.sequence_parallel
            set_parallel_attributes(
                self.bias, 0 if column else -1, sequence_parallel=row_sp, parts=parts
            )
        self.reset_parameters()
        _primary.make_primary(self, ("weight",), "Linear")  # inside quantized_model_init

    @property
    def parallel_mode(self) -> str | None:
        return self.tp.mode

    @property
    def sequence_parallel(self) -> bool:
        return self.tp.sequence_parallel

    def set_tensor_parallel_group(self, tp_group: object) -> None:
        """Set the group of a module built with ``tp_size > 1`` and no ``tp_group``."""
        self.tp = self.tp.with_group("Linear", tp_group)

    @torch.no_grad()
    def reset_parameters(self) -> None:
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
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        param = weight = self.weight
        main_grad = weight_main_grad("Linear", param) if self.fuse_wgrad_accumulation else None
        wq = None
        fp8 = dense_primary(self, "weight", param, inp, self.fuse_wgrad_accumulation)
        if fp8 is not None:  # FP8 primary weight: its gradient goes to main_grad, or .grad
            weight, main_grad, wq = fp8
        cache = None
        if is_first_microbatch is not None:
            _gemm.check_first_microbatch("Linear", is_first_microbatch)
            cache = _gemm.WeightCache(self._fp8_weights, is_first_microbatch)
        defer = self._wgrad_defer(param)
        kw = {"defer": defer, "cache": cache, "weight_quantized": wq}
        if self.save_original_input and _gemm.quantized():
            kw["save_original_input"] = True
        if self.tp.mode is None:  # no tensor parallelism: the GEMM alone (the hot path)
            bias = None if self.return_bias else self.bias
            out = _gemm.linear("Linear", self.fp8_meta, inp, weight, bias, main_grad, **kw)
            self._wgrad_queue(defer, out)
            return (out, self.bias) if self.return_bias else out

        def gemm(x: Tensor, bias: Tensor | None) -> Tensor:
            return _gemm.linear("Linear", self.fp8_meta, x, weight, bias, main_grad, **kw)

        # Row-parallel: the bias is added once, to the sum of the partial products.
        add_bias = not self.return_bias
        out, bias = self.tp.linear("Linear", gemm, inp, self.bias, add_bias=add_bias)
        self._wgrad_queue(defer, out)
        return (out, bias) if self.return_bias else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, params_dtype={self.weight.dtype}"
            + (", return_bias=True" if self.return_bias else "")
            + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else "")
            + (", delay_wgrad_compute=True" if self.delay_wgrad_compute else "")
            + (", save_original_input=True" if self.save_original_input else "")
            + self.tp.describe()
        )
