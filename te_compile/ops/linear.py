r"""Linear basic ops: ``BasicLinear`` (:math:`y = x W^\top`, no bias), ``Bias`` (:math:`y = x + b`)
and ``GroupedLinear`` (one weight per group of rows).

As in Transformer Engine, the bias is its own op so that the fuser can put it where it is
cheapest: in the GEMM's epilogue after a ``BasicLinear``, in the activation kernel before an
activation, in the residual add's GEMM. ``Bias`` on its own is a broadcast add through torch
(a te op would only add a copy and hide the add from Inductor's fusion).

``BasicLinear`` goes through ``te::linear_fwd`` / ``te::linear_bwd`` with the recipe of an
enabled ``te_compile.autocast`` as data, its FP8 scaling state in the ``fp8_meta`` child module
(left out of the state_dict while unused, as for ``te.Linear``).

Tensor parallelism, with Transformer Engine's arguments (``tensor_parallel_mode``,
``tensor_parallel_group``, default the world group; ``sequence_parallel``): ``in_features`` and
``out_features`` are the full sizes, the weight is this rank's shard (``"column"``: rows, the
output sharded along its last dim; ``"row"``: columns, the input sharded along its last dim and
the partial outputs summed over the group), with the communication of
:class:`te_compile.distributed.TensorParallel` (sequence parallelism: the column input
all-gathered along dim 0, the row output reduce-scattered). ``Bias(tensor_parallel=True)`` holds
this rank's shard of a column-parallel bias. ``Linear`` is TE's ``BasicLinear`` + ``Bias``
container; row-parallel, its bias is added once, after the reduction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from te_compile._checks import check_bool, check_callable, check_tensor, default_device
from te_compile.distributed.tensor_parallel import TensorParallel, set_parallel_attributes
from te_compile.functional.grouped_gemm import checked_splits
from te_compile.ops.op import BasicOperation, FusibleOperation, OpOutput, check_input
from te_compile.quantization import fp8_gemm, gemm, primary
from te_compile.quantization.state import get_autocast_state
from te_compile.quantization.te_extra_state import accept_te_extra_state

__all__ = ["BasicLinear", "Bias", "GroupedLinear", "Linear"]

DEFAULT_INIT_STD = 0.023  # Transformer Engine's default weight init std


def _check_size(owner: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def _dtype(owner: str, dtype: torch.dtype | None) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{owner}: dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def _init(weight: Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=DEFAULT_INIT_STD)


def _tensor_parallel(
    owner: str, mode: str | None, group: Any, sequence_parallel: bool
) -> TensorParallel:
    """TE's canonicalisation: a mode without a group means the world group (no communication
    when ``torch.distributed`` is not initialised)."""
    if mode not in ("column", "row", None):
        raise ValueError(
            f"{owner}: tensor_parallel_mode must be 'column', 'row' or None, got {mode!r}"
        )
    check_bool(owner, sequence_parallel=sequence_parallel)
    if mode is None:
        if sequence_parallel:
            raise ValueError(
                f"{owner}: sequence_parallel=True needs tensor_parallel_mode 'column' or 'row'"
            )
        return TensorParallel()
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return TensorParallel(mode, sequence_parallel)  # one process: no communication
    return TensorParallel.create(owner, mode, sequence_parallel, group, None)


def _init_with_tracker(init: Callable[[], None], tracker: Callable[[], Any] | None) -> None:
    """``init()`` inside ``tracker().fork()`` (Megatron's model-parallel RNG) when given."""
    with tracker().fork() if tracker is not None else contextlib.nullcontext():
        init()


def dequantised_primary(weight: Tensor) -> bool:
    """An FP8 primary weight outside an FP8 autocast (and outside calibration): Transformer
    Engine dequantises it, the GEMMs run in high precision on its values (not sharded)."""
    state = get_autocast_state()
    return not (state.enabled or state.calibration) and type(weight.data) is Tensor


def primary_values(
    module: nn.Module, names: tuple[str, ...], dtype: torch.dtype, main_grad: Tensor | None
) -> Tensor:
    """FP8 weights ``names``' values in ``dtype`` (``G`` weights stacked ``[G, N, K]``) for a
    high-precision GEMM: a leaf whose gradient the op accumulates into ``main_grad``, or
    without one a tensor whose gradient goes to the weights' ``.grad`` (:class:`_ToWeights`)."""
    params = [getattr(module, n) for n in names]
    values = [primary.weight_values(module, n, dtype) for n in names]
    values = values[0] if len(values) == 1 else torch.stack(values)
    if main_grad is not None or not (params[0].requires_grad and torch.is_grad_enabled()):
        return values.requires_grad_(main_grad is not None and params[0].requires_grad)
    return _ToWeights.apply(values, *params)


def dense_primary(
    module: nn.Module, name: str, weight: Tensor, inp: object, accumulate: bool
) -> tuple[Tensor, Tensor | None, tuple[Tensor, ...] | None] | None:
    """The GEMM arguments ``(weight, main_grad, weight_quantized)`` of ``module``'s FP8 primary
    weight ``name`` (the Parameter ``weight``) for input ``inp``, or None where it is not FP8:
    inside an FP8 autocast the codes with their pre-quantised operand (``quantization.primary``),
    outside one a high-precision GEMM on their values (:func:`dequantised_primary`) in ``inp``'s
    dtype, no operand built. ``accumulate``: the module adds its gradient into ``main_grad``
    (``primary.taken_main_grad``)."""
    weight_q = None
    if primary.is_primary(weight) and dequantised_primary(weight):
        primary.check_unchanged(module, name, weight)
    else:
        weight_q = primary.primary_operand(module, name, weight)
        if weight_q is None:
            return None
    check_tensor(type(module).__name__, "inp", inp)
    if weight_q is None:
        main_grad = primary.taken_main_grad(weight, accumulate)
        return primary_values(module, (name,), inp.dtype, main_grad), main_grad, None
    return *primary.primary_weight(module, name, inp.dtype, accumulate), weight_q


def grouped_primary_args(
    module: nn.Module,
    names: tuple[str, ...],
    dtype: torch.dtype,
    main_grad: Tensor | None,
    to_leaves: bool,
) -> tuple[Tensor, list[Tensor] | None] | None:
    """The grouped GEMM's ``(weight, weight_quantized)`` for ``module``'s FP8 weights ``names``,
    or None where they are not FP8: inside an FP8 autocast ``primary.grouped_primary``'s stand-in
    and operand, outside one their values in ``dtype`` (:func:`dequantised_primary`; the gradient
    into ``main_grad`` where given), no operand built."""
    first = getattr(module, names[0])
    if not (primary.is_primary(first) and dequantised_primary(first)):
        return primary.grouped_primary(module, names, dtype, to_leaves=to_leaves)
    for n in names:
        primary.check_unchanged(module, n, getattr(module, n))
    return primary_values(module, names, dtype, main_grad), None


class _ToWeights(torch.autograd.Function):
    """``values`` as they are; their gradient goes to the FP8 Parameters ``params`` (in their
    ``grad_dtype``, the nominal dtype), ``[G, N, K]`` split per Parameter."""

    @staticmethod
    def forward(ctx, values: Tensor, *params: Tensor) -> Tensor:
        ctx.count = len(params)
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return None, *(grad.unbind(0) if ctx.count > 1 else (grad,))


class BasicLinear(primary.KeepFP8OnCast, BasicOperation):
    r""":math:`y = x W^\top` over the last dim; ``weight`` is ``[out_features, in_features]``.

    Args:
        in_features, out_features: sizes of the last dim of the input and the output (full
            sizes under tensor parallelism).
        device, dtype: of the weight (defaults: torch's defaults).
        tensor_parallel_mode: "column", "row" or None (see the module docstring).
        tensor_parallel_group: the group (default: the world group).
        sequence_parallel: the column input / row output sharded along dim 0.
        rng_state_tracker_function: returns a tracker whose ``fork()`` context the weight is
            initialised in (Megatron's ``CudaRNGStatesTracker``).
        accumulate_into_main_grad: accumulate the weight gradient into ``weight.main_grad``
            (fp32, set by the caller) instead of ``weight.grad``.
        userbuffers_options: must be None (no userbuffers comm-GEMM overlap here).
        init_method: ``init_method(weight)`` (default: normal, std 0.023, TE's default).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tensor_parallel_mode: str | None = None,
        tensor_parallel_group: Any = None,
        sequence_parallel: bool = False,
        rng_state_tracker_function: Callable[[], Any] | None = None,
        accumulate_into_main_grad: bool = False,
        userbuffers_options: dict | None = None,
        init_method: Callable[[Tensor], None] | None = None,
    ) -> None:
        super().__init__()
        _check_size("BasicLinear", in_features=in_features, out_features=out_features)
        check_bool("BasicLinear", accumulate_into_main_grad=accumulate_into_main_grad)
        if userbuffers_options is not None and not isinstance(userbuffers_options, dict):
            raise TypeError(
                "BasicLinear: userbuffers_options must be None (a dict of options is not "
                f"implemented), got {userbuffers_options!r}"
            )
        if userbuffers_options is not None:
            raise NotImplementedError(
                "BasicLinear: userbuffers_options must be None (no userbuffers comm-GEMM "
                f"overlap in te_compile), got {userbuffers_options!r}"
            )
        if rng_state_tracker_function is not None and not callable(rng_state_tracker_function):
            raise TypeError(
                "BasicLinear: rng_state_tracker_function must be callable or None, got "
                f"{rng_state_tracker_function!r}"
            )
        dtype = _dtype("BasicLinear", dtype)
        self.tp = _tensor_parallel(
            "BasicLinear", tensor_parallel_mode, tensor_parallel_group, sequence_parallel
        )
        self.in_features, self.out_features = in_features, out_features
        self.local_in_features, self.local_out_features = in_features, out_features
        if self.tp.mode == "column":
            self.local_out_features = self.tp.divide("BasicLinear", "out_features", out_features)
        elif self.tp.mode == "row":
            self.local_in_features = self.tp.divide("BasicLinear", "in_features", in_features)
        self.accumulate_into_main_grad = accumulate_into_main_grad
        device = default_device("BasicLinear", device)
        check_callable("BasicLinear", init_method=init_method)
        self.init_method = init_method or _init
        self.rng_state_tracker_function = rng_state_tracker_function
        shape = (self.local_out_features, self.local_in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        if self.tp.mode is not None:
            set_parallel_attributes(self.weight, 0 if self.tp.mode == "column" else 1)
        self.fp8_meta = fp8_gemm.FP8GemmState(device)
        accept_te_extra_state(self, ("fp8_meta",), slots=(2, 1))  # TE: input, weight / grad
        self.reset_parameters()
        primary.make_primary(self, ("weight",), "te.ops.BasicLinear")  # in quantized_model_init

    @property
    def tensor_parallel_mode(self) -> str | None:
        return self.tp.mode

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.size

    @property
    def sequence_parallel(self) -> bool:
        return self.tp.sequence_parallel

    @torch.no_grad()
    def reset_parameters(self) -> None:
        def init() -> None:
            self.init_method(self.weight)

        with primary.high_precision_init(self, ("weight",)):
            _init_with_tracker(init, self.rng_state_tracker_function)

    def main_grad(self) -> Tensor | None:
        """``weight.main_grad`` with ``accumulate_into_main_grad``, else None."""
        if not self.accumulate_into_main_grad:
            return None
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is None:
            raise RuntimeError(
                "BasicLinear(accumulate_into_main_grad=True) needs weight.main_grad: a float32 "
                "tensor of the weight's shape, e.g. "
                "`op.weight.main_grad = torch.zeros_like(op.weight, dtype=torch.float32)`"
            )
        return main_grad

    def linear(self, x: Tensor, bias: Tensor | None, **epilogue) -> Tensor | tuple[Tensor, ...]:
        """``x W^T + bias`` through ``te::linear`` with the recipe of the autocast state (high
        precision outside one) and the epilogue arguments of ``functional.linear``
        (``activation``, ``residual``, ``out_scale``, ``return_branch``): what the fused ops
        call, in every precision. FP8 primary weights (``quantized_model_init``): the codes are
        the GEMM's pre-quantised weight, the gradient goes to ``weight.main_grad``.

        An input whose dtype is not the weight's is cast to it, as Transformer Engine casts it
        (the output has the weight's dtype, the input's gradient its own); under
        ``torch.autocast`` the GEMM takes autocast's dtype instead."""
        fp8 = dense_primary(self, "weight", self.weight, x, self.accumulate_into_main_grad)
        if fp8 is not None:
            weight, main_grad, weight_q = fp8
        else:
            if x.dtype != self.weight.dtype and not torch.is_autocast_enabled(x.device.type):
                x = x.to(self.weight.dtype)
            weight, main_grad, weight_q = self.weight, self.main_grad(), None

        def run(inp: Tensor, b: Tensor | None) -> Tensor | tuple[Tensor, ...]:
            return gemm.linear("BasicLinear", self.fp8_meta, inp, weight, b, main_grad,
                               weight_quantized=weight_q, **epilogue)  # fmt: skip

        if self.tp.mode is None:
            return run(x, bias)
        return self.tp.linear("BasicLinear", run, x, bias)[0]

    def compute_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype the GEMM of input ``x`` computes in, which a bias in its epilogue must
        have: the weight's, or ``x``'s for FP8 primary weights."""
        return x.dtype if primary.is_primary(self.weight) else self.weight.dtype

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        check_input("BasicLinear", x, self.local_in_features, self.weight)  # this rank's features
        return self.linear(x, None), ()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"dtype={self.weight.dtype}"
        ) + self.tp.describe().replace("parallel_mode", "tensor_parallel_mode")


class Bias(BasicOperation):
    """:math:`y = x + b` with ``bias`` ``[size]`` added along the last dim (initialised to zero).

    Args:
        size: the last dim of the input (the full size with ``tensor_parallel``).
        device, dtype: of the bias (defaults: torch's defaults).
        tensor_parallel: the input and the bias are this rank's shard of the last dim (the
            output of a column-parallel linear): the bias holds ``size / group size`` values.
        tensor_parallel_group: the group (default: the world group).
    """

    def __init__(
        self,
        size: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tensor_parallel: bool = False,
        tensor_parallel_group: Any = None,
    ) -> None:
        super().__init__()
        _check_size("Bias", size=size)
        check_bool("Bias", tensor_parallel=tensor_parallel)
        mode = "column" if tensor_parallel else None
        self.tp = _tensor_parallel("Bias", mode, tensor_parallel_group, False)
        self.size = size
        device = default_device("Bias", device)
        self.local_size = self.tp.divide("Bias", "size", size) if tensor_parallel else size
        self.tensor_parallel = tensor_parallel
        self.bias = nn.Parameter(
            torch.zeros(self.local_size, dtype=_dtype("Bias", dtype), device=device)
        )
        if tensor_parallel:
            set_parallel_attributes(self.bias, 0)
        # Set by a row-parallel ``Linear`` under sequence parallelism: the bias is added to a
        # sequence shard, so its gradient is all-reduced over that linear's group.
        self._grad_reduce: TensorParallel | None = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.bias.zero_()

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        check_input("Bias", x, param=self.bias, param_name="bias")
        if x.shape[-1:] != self.bias.shape:
            raise ValueError(
                f"Bias: input's last dim ({x.shape[-1] if x.dim() else None}) must equal "
                f"size ({self.size}){' / the group size' if self.tensor_parallel else ''}"
            )
        bias = self.bias
        if self._grad_reduce is not None:
            bias = self._grad_reduce.sequence_parallel_param("Bias", bias)
        return x + bias, ()

    def te_vjp(self, dy: Tensor, grad_extra_outputs: tuple) -> tuple[Tensor, tuple, tuple]:
        """The backward inside a user fused op in TE's protocol (``ops.op``)."""
        return dy, (dy.reshape(-1, dy.shape[-1]).sum(0),), ()

    def extra_repr(self) -> str:
        tp = f", tensor_parallel=True, tp_size={self.tp.size}" if self.tensor_parallel else ""
        return f"size={self.size}, dtype={self.bias.dtype}{tp}"


class GroupedParameters:
    """A grouped GEMM's parameters in Transformer Engine's two layouts, for :class:`GroupedLinear`
    and ``te_compile.GroupedLinear``: one ``weight`` ``[num_groups, out, in]``
    (``single_grouped_weight``) or ``weight0 .. weight{G-1}``, and likewise the bias."""

    def _weight_names(self) -> tuple[str, ...]:
        if self.single_grouped_weight:
            return ("weight",)
        return tuple(f"weight{i}" for i in range(self.num_groups))

    def weights(self) -> list[Tensor]:
        """Every group's ``[out, in]`` weight (views of ``weight`` in the single layout)."""
        if self.single_grouped_weight:
            return list(self.weight.unbind(0))
        return [getattr(self, f"weight{i}") for i in range(self.num_groups)]

    def biases(self) -> list[Tensor] | None:
        """Every group's ``[out]`` bias (views of ``bias`` in the single layout); None without."""
        if not self.use_bias:
            return None
        if self.single_grouped_bias:
            return list(self.bias.unbind(0))
        return [getattr(self, f"bias{i}") for i in range(self.num_groups)]

    def _grouped_bias(self) -> Tensor | None:
        """The ``[G, out]`` bias operand: ``bias``, or the per-group biases stacked."""
        if not self.use_bias:
            return None
        return self.bias if self.single_grouped_bias else torch.stack(self.biases())

    def allocate_main_grad(self) -> Tensor:
        """The zeroed fp32 ``[num_groups, out, in]`` buffer weight gradients are accumulated into
        (``fuse_wgrad_accumulation``; FP8 primary weights', which ``FP8MasterWeights``
        allocates): ``weight.main_grad``, or ``weight{i}.main_grad = buffer[i]`` per group."""
        weights = self.weights()
        shape = (self.num_groups, self.out_features, self.in_features)
        buffer = torch.zeros(shape, dtype=torch.float32, device=weights[0].device)
        if self.single_grouped_weight:
            self.weight.main_grad = buffer
        else:
            for w, view in zip(weights, buffer.unbind(0), strict=True):
                w.main_grad = view
            # The views, to recognise them in the forward (then the op accumulates into buffer).
            self._main_grad_views = tuple(w.main_grad for w in weights)
        self._main_grad_buffer = buffer
        return buffer

    def _primary_main_grad(self, accumulate: bool = False) -> Tensor | None:
        """The ``[num_groups, out, in]`` fp32 buffer FP8 primary weights' gradient goes to:
        ``weight.main_grad``, or the buffer of the ``weight{i}.main_grad`` views, where the
        module accumulates into them (``accumulate``) or ``FP8MasterWeights`` made them
        (``primary.taken_main_grad``); None: to the weights' ``.grad``, as in TE."""
        if self.single_grouped_weight:
            return primary.taken_main_grad(self.weight, accumulate)
        taken = all(primary.taken_main_grad(w, accumulate) is not None for w in self.weights())
        return getattr(self, "_main_grad_buffer", None) if taken else None


class GroupedLinear(primary.KeepFP8OnCast, GroupedParameters, BasicOperation):
    r"""One linear layer per group of rows (mixture-of-experts experts):
    :math:`y_g = x_g W_g^\top + b_g`, through ``te::grouped_linear_fwd``.

    Takes one extra input, ``m_splits`` (rows per group: an integer tensor, on the input's device
    or the CPU, or a list of ints), as Transformer Engine's ``te.ops.GroupedLinear`` does:
    ``Sequential(..., GroupedLinear(...), ...)(x, m_splits)``.

    Parameters, Transformer Engine's two layouts, chosen for the weight and the bias separately:
    by default one Parameter per group, ``weight0 .. weight{G-1}`` ``[out_features,
    in_features]`` and ``bias0 ..`` ``[out_features]`` (the forward stacks them into the
    ``[G, out, in]`` operand of the grouped GEMM: one copy of the weights per forward);
    ``single_grouped_weight=True`` / ``single_grouped_bias=True``: one ``weight``
    ``[num_groups, out_features, in_features]`` / ``bias`` ``[num_groups, out_features]``,
    passed as they are (no copy). Transformer Engine honours True only with its
    ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` environment variable set (else it warns and builds
    per-group parameters); here True always builds the single layout. The attributes of the
    other layout are None, as in Transformer Engine. FP8 primary weights
    (``quantized_model_init``): per tensor a scale per ``weight{i}`` (one for the single
    ``weight``), in blocks each expert's own blocks (``quantization.primary``), the gradients
    accumulated into one ``[G, out, in]`` fp32 buffer that ``FP8MasterWeights`` allocates
    (``allocate_main_grad``; each ``weight{i}.main_grad`` a view of it).

    Inside ``te_compile.autocast`` the GEMMs run with the recipe
    as data (``te::grouped_linear``): rowwise scales under ``Float8CurrentScaling``,
    per-tensor delayed scales (``fp8_meta``) under ``DelayedScaling``; Float8BlockScaling and
    MXFP8BlockScaling are emulated (see :class:`te_compile.GroupedLinear`).

    ``scale_bias=True`` (with ``bias``; Transformer Engine's, for routing probabilities): a
    second extra input ``scales`` ``[rows]`` (one per token, the rows of ``x`` flattened) and
    :math:`y_t = x_t W_g^\top + s_t b_g` for token ``t`` of group ``g``; the product and the sum
    are taken in fp32 and rounded once, the bias's and the scales' gradients are
    :math:`\sum_t s_t dy_t` and :math:`\langle dy_t, b_g \rangle` (fp32, then their dtypes).
    ``Sequential(..., GroupedLinear(..., scale_bias=True), ...)(x, m_splits, scales)``. Without
    ``bias`` it is off (no second input), as in Transformer Engine.
    """

    num_extra_inputs = 1

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init_method: Callable[[Tensor], None] | None = None,
        scale_bias: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
    ) -> None:
        check_bool("GroupedLinear", bias=bias, scale_bias=scale_bias,
                   single_grouped_weight=single_grouped_weight,
                   single_grouped_bias=single_grouped_bias)  # fmt: skip
        # Before BasicOperation.__init__, which sizes the extra-input channels.
        self.scale_bias = scale_bias and bias
        if self.scale_bias:
            self.num_extra_inputs = 2
        super().__init__()
        _check_size(
            "GroupedLinear",
            num_groups=num_groups,
            in_features=in_features,
            out_features=out_features,
        )
        dtype = _dtype("GroupedLinear", dtype)
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        device = default_device("GroupedLinear", device)
        check_callable("GroupedLinear", init_method=init_method)
        self.init_method = init_method or _init
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias
        self.use_bias = bias
        kw = {"dtype": dtype, "device": device}
        weight = bias_ = None
        if single_grouped_weight:
            weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **kw))
        if bias and single_grouped_bias:
            bias_ = nn.Parameter(torch.empty(num_groups, out_features, **kw))
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias_)
        # weight0 .. then bias0 .. (Transformer Engine's order); None in a single layout.
        for i in range(num_groups):
            w = None
            if not single_grouped_weight:
                w = nn.Parameter(torch.empty(out_features, in_features, **kw))
            self.register_parameter(f"weight{i}", w)
        for i in range(num_groups):
            b = None
            if bias and not single_grouped_bias:
                b = nn.Parameter(torch.empty(out_features, **kw))
            self.register_parameter(f"bias{i}", b)
        self.fp8_meta = fp8_gemm.FP8GemmState(device)
        # TE's slots per group (input, weight / grad), folded into our one state.
        accept_te_extra_state(self, ("fp8_meta",), (num_groups,), slots=(2, 1))
        self.reset_parameters()
        primary.make_primary(self, self._weight_names(), "te.ops.GroupedLinear")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        with primary.high_precision_init(self, self._weight_names()):
            for w in self.weights():
                self.init_method(w)
        for b in self.biases() or ():
            b.zero_()

    def op_forward(self, x: Tensor, extra_inputs: tuple[Tensor, ...]) -> OpOutput:
        m_splits, *scales = extra_inputs
        main_grad, weight_q = None, None
        weight = self.weight if self.single_grouped_weight else torch.stack(self.weights())
        names = self._weight_names()
        taken = self._primary_main_grad() if primary.is_primary(getattr(self, names[0])) else None
        fp8 = grouped_primary_args(self, names, x.dtype, taken, to_leaves=taken is None)
        if fp8 is not None:  # FP8 primary weights: the gradient goes to main_grad, or .grad
            main_grad = taken
            weight, weight_q = fp8
        bias = None if self.scale_bias else self._grouped_bias()
        out = gemm.grouped_linear("GroupedLinear", self.fp8_meta, x, m_splits, weight, bias,
                                  main_grad=main_grad, weight_quantized=weight_q)  # fmt: skip
        if self.scale_bias:
            out = self._add_scaled_bias(out, m_splits, scales[0])
        return out, ()

    def _add_scaled_bias(self, out: Tensor, m_splits: Any, scales: Tensor) -> Tensor:
        """``out + scales[t] * bias[g]`` per token (``scale_bias``), in fp32, rounded once."""
        rows = out.reshape(-1, out.shape[-1])
        if not isinstance(scales, Tensor) or not scales.is_floating_point():
            raise TypeError(
                f"GroupedLinear(scale_bias=True): scales must be a floating tensor, got "
                f"{scales.dtype if isinstance(scales, Tensor) else type(scales).__name__}"
            )
        if scales.dim() != 1 or scales.shape[0] != rows.shape[0]:
            raise ValueError(
                f"GroupedLinear(scale_bias=True): scales must be [rows] = [{rows.shape[0]}] (one "
                f"per token), got {list(scales.shape)}"
            )
        splits = checked_splits("GroupedLinear", m_splits, rows.shape[0], "the input's rows")
        bias = self._grouped_bias()
        per_row = bias.repeat_interleave(splits.to(bias.device), dim=0, output_size=rows.shape[0])
        scaled = per_row.float() * scales.float().unsqueeze(-1)
        return (rows.float() + scaled).to(out.dtype).reshape(out.shape)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}"
            + (", single_grouped_weight=True" if self.single_grouped_weight else "")
            + (", single_grouped_bias=True" if self.single_grouped_bias else "")
            + (", scale_bias=True" if self.scale_bias else "")
        )


class Linear(FusibleOperation):
    r""":math:`y = x W^\top + b`: Transformer Engine's ``ops.Linear``, a container of a
    ``BasicLinear`` (``basic_ops[0]``) and, with ``bias``, a ``Bias`` (``basic_ops[1]``); the
    state_dict keys are TE's (``basic_ops.0.weight``, ``basic_ops.1.bias``), ``weight`` and
    ``bias`` are the basic ops' parameters. On its own it runs as one ``te::linear`` (the bias in
    the GEMM's epilogue); inside a ``Sequential`` its basic ops join their neighbours' fusions.

    Args: those of :class:`BasicLinear` and ``bias`` (default True). Tensor-parallel: column, the
    bias is this rank's shard; row, the bias is replicated and added once after the reduction
    (under sequence parallelism its gradient is all-reduced over the group).
    """

    is_fused_op = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        tensor_parallel_mode: str | None = None,
        tensor_parallel_group: Any = None,
        sequence_parallel: bool = False,
        rng_state_tracker_function: Callable[[], Any] | None = None,
        accumulate_into_main_grad: bool = False,
    ) -> None:
        super().__init__()
        check_bool("Linear", bias=bias)
        for name, value in (("tensor_parallel_mode", tensor_parallel_mode),):
            if value not in ("column", "row", None):
                raise ValueError(f"Linear: {name} must be 'column', 'row' or None, got {value!r}")
        linear = BasicLinear(
            in_features, out_features, device=device, dtype=dtype,
            tensor_parallel_mode=tensor_parallel_mode, tensor_parallel_group=tensor_parallel_group,
            sequence_parallel=sequence_parallel,
            rng_state_tracker_function=rng_state_tracker_function,
            accumulate_into_main_grad=accumulate_into_main_grad,
        )  # fmt: skip
        ops: list[BasicOperation] = [linear]
        if bias:
            column = linear.tp.mode == "column" and linear.tp.size > 1
            group = linear.tp.group if column else None
            b = Bias(out_features, device=device, dtype=dtype, tensor_parallel=column,
                     tensor_parallel_group=group)  # fmt: skip
            if linear.tp.mode == "row" and linear.tp.sequence_parallel:
                b._grad_reduce = linear.tp
                set_parallel_attributes(b.bias, -1, sequence_parallel=True)
            elif linear.tp.mode == "row":
                set_parallel_attributes(b.bias, -1)
            ops.append(b)
        self.basic_ops = nn.ModuleList(ops)
        self.in_features, self.out_features = in_features, out_features

    @property
    def weight(self) -> nn.Parameter:
        return self.basic_ops[0].weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.basic_ops[1].bias if len(self.basic_ops) > 1 else None

    def __setattr__(self, name: str, value: Any) -> None:
        # Replacing ``weight`` / ``bias`` replaces the basic op's parameter (TE's behaviour).
        if name == "weight" and "basic_ops" in self._modules:
            self.basic_ops[0].weight = value
        elif name == "bias" and "basic_ops" in self._modules:
            if len(self.basic_ops) < 2:
                raise ValueError("Linear: cannot set bias on a Linear built with bias=False")
            self.basic_ops[1].bias = value
        else:
            super().__setattr__(name, value)

    def forward(self, input: Tensor) -> Tensor:
        linear = self.basic_ops[0]
        check_input("Linear", input, linear.local_in_features, linear.weight)
        bias = self.bias
        if bias is not None and bias.dtype != self.basic_ops[0].compute_dtype(input):
            x, _ = self.basic_ops[0].op_forward(input, ())
            return self.basic_ops[1].op_forward(x, ())[0]
        return self.basic_ops[0].linear(input, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
