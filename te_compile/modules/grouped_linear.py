"""``te_compile.GroupedLinear``: one linear layer per group of rows (mixture-of-experts experts).

``forward(inp, m_splits)``: ``inp`` is ``[sum(m_splits), in_features]``, rows grouped by expert
(or ``[..., in_features]``: its rows flattened, the output shaped ``[..., out_features]``);
``m_splits`` a list of ints or an integer tensor (on the input's device or the CPU; a device
tensor never syncs and, under ``torch.compile``, never recompiles when the splits change).

Two parameter layouts, with one state_dict format conversion between them:

* default (Transformer Engine's): ``weight0 .. weight{n-1}`` ``[out_features, in_features]``
  and ``bias0 ..``; the forward stacks them into the ``[num_gemms, out, in]`` tensor the grouped
  GEMM consumes (a copy of the weights per forward); the weight gradients come back as views of
  the grouped weight-gradient GEMM's single output buffer (one allocation, no copy).
* ``single_grouped_parameter=True``: one ``weight`` ``[num_gemms, out_features, in_features]``
  (and ``bias`` ``[num_gemms, out_features]``), passed to the op as is: no split or copy in the
  forward or the backward. The fast layout. Transformer Engine's names choose the two
  separately: ``single_grouped_weight`` (one ``weight``) and ``single_grouped_bias`` (one
  ``bias``); ``single_grouped_parameter=True`` is both.

A state_dict saved in either layout loads into a module of the other (``_load_from_state_dict``
converts exactly: stacking or unbinding).

Inside ``te_compile.autocast`` the GEMMs run with the recipe (``te::grouped_linear`` with the
recipe as data; ``torch._scaled_grouped_mm`` on CUDA): ``Float8CurrentScaling`` with
rowwise scales, ``DelayedScaling`` with per-tensor scales from the ``fp8_meta`` child's amax
history (input, weight and gradient of all groups; saved in the state_dict once used, as in
:class:`~te_compile.Linear`); Float8BlockScaling, MXFP8BlockScaling and NVFP4BlockScaling
emulated (exact quantisation, grouped GEMMs of the dequantised values; NVFP4 with a global
scale per expert for the tokens, the weight and the gradient, as each expert's own tensor).

``forward(inp, m_splits, is_first_microbatch=None)``: under an FP8 autocast, ``None`` casts the
weights every call; ``True`` casts all groups' weights (either layout) in one
``te::quantize_grouped_weight`` and keeps the FP8 copy (plain tensors, not in the state_dict);
``False`` reuses the kept copy without casting, however the weights changed since (gradient
accumulation: one cast per optimizer step), as in Transformer Engine and
:class:`~te_compile.Linear` (``quantization.gemm``, "Weight caching"). Outside an FP8 autocast
it changes nothing.

``fuse_wgrad_accumulation=True``: the weight gradient is accumulated in fp32 into a
``main_grad`` instead of producing ``.grad``: ``weight.main_grad`` ``[num_gemms, out, in]`` in the
single layout; in the default layout each ``weight{i}.main_grad`` (fp32, ``[out, in]``), as in
Transformer Engine. Where they are still the views of one buffer that
:meth:`GroupedLinear.allocate_main_grad` made, the grouped GEMM accumulates into that buffer;
otherwise (separate tensors, e.g. views of a data-parallel gradient buffer) it accumulates into an
fp32 ``[num_gemms, out, in]`` buffer made in the forward, loaded with the ``main_grad`` values just
before the op's backward and copied back after it (in the backward, or in :meth:`backward_dw`):
each group's gradient is then accumulated into its ``main_grad`` as a :class:`~te_compile.Linear`
accumulates into its own, bit for bit (the GEMM adds into the values; summing a separate product
into them would round otherwise).

Tensor parallelism (expert tensor parallelism; ``parallel_mode``, ``tp_group``, ``tp_size`` as
in :class:`~te_compile.Linear`): "column" shards every expert's ``out_features``, "row" its
``in_features`` and all-reduces the output, adding the biases after the sum. Sequence
parallelism is not supported: the tokens arrive grouped by expert, and gathering the ranks'
token shards would interleave the groups (shard tokens in the MoE token dispatcher instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from te_compile.distributed.tensor_parallel import TensorParallel, set_parallel_attributes
from te_compile.functional.grouped_gemm import checked_splits
from te_compile.modules._common import (
    DelayedWgrad,
    check_bool,
    check_positive,
    check_rng_tracker,
    default_device,
    eager_when_delaying_wgrad,
    init_method_or_default,
    params_dtype_or_default,
    rng_fork,
)
from te_compile.modules._te_signature import te_signature
from te_compile.ops.linear import GroupedParameters, grouped_primary_args
from te_compile.quantization import fp8_gemm as _fp8
from te_compile.quantization import gemm as _gemm
from te_compile.quantization import primary as _primary
from te_compile.quantization.te_extra_state import accept_te_extra_state

__all__ = ["GroupedLinear"]


class GroupedLinear(_primary.KeepFP8OnCast, GroupedParameters, DelayedWgrad, nn.Module):
    """``num_gemms`` independent linear layers applied to consecutive groups of rows.

    Args:
        num_gemms: number of groups (experts).
        in_features, out_features: sizes of every group's linear layer.
        bias: learn a bias per group.
        single_grouped_parameter: one ``[num_gemms, out, in]`` parameter instead of
            ``weight0..weight{n-1}``, and one bias (see the module docstring).
        single_grouped_weight, single_grouped_bias: Transformer Engine's names, the weight's
            and the bias's layout each (None: ``single_grouped_parameter``).
        params_dtype, device: of the parameters (defaults: torch's defaults).
        fuse_wgrad_accumulation: accumulate weight gradients into ``main_grad`` (fp32).
        init_method: initialises each group's ``[out, in]`` weight (default: N(0, 0.023)).
        parallel_mode, tp_group, tp_size: as in :class:`~te_compile.Linear`;
            ``sequence_parallel=True`` raises (see the module docstring).
        get_rng_state_tracker, rng_tracker_name: the weights are initialised inside
            ``get_rng_state_tracker().fork(rng_tracker_name)`` (the tracker's default state
            when the name is None), as in Transformer Engine (``rng_fork``).
        delay_wgrad_compute: the backward leaves the weight gradients to :meth:`backward_dw`
            (``DelayedWgrad``; also in ``eval()`` mode; under ``torch.compile`` the module runs
            eagerly behind a graph break).
        use_grouped_tensor: Transformer Engine's choice of its grouped-GEMM path; every call
            here runs the one grouped op, so it changes nothing but is checked as in TE (a bool
            or None; False with a single layout raises ValueError).
        save_original_input: the backward keeps the input itself rather than a quantised
            copy, and quantises it again in the backward (high precision, Float8CurrentScaling
            and the emulated block-scaled recipes, bit for bit as without it; DelayedScaling
            raises ValueError, as in Transformer Engine; the native Float8BlockScaling GEMMs
            raise NotImplementedError).

    Built inside ``te_compile.quantized_model_init`` the weights are FP8 codes with a scale
    each (``quantization.primary``: ``grouped_primary``, ``FP8MasterWeights``).
    """

    @te_signature("GroupedLinear")
    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        single_grouped_parameter: bool = False,
        single_grouped_weight: bool | None = None,
        single_grouped_bias: bool | None = None,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        init_method: Callable[[Tensor], None] | None = None,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        tp_group: object = None,
        tp_size: int | None = None,
        get_rng_state_tracker: Callable | None = None,
        rng_tracker_name: str | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        use_grouped_tensor: bool | None = None,
    ) -> None:
        super().__init__()
        owner = "GroupedLinear"
        self._init_delayed_wgrad(owner, delay_wgrad_compute)
        check_bool(owner, save_original_input=save_original_input)
        self.save_original_input = save_original_input
        check_rng_tracker(owner, get_rng_state_tracker, rng_tracker_name)
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        check_positive(
            owner, num_gemms=num_gemms, in_features=in_features, out_features=out_features
        )
        check_bool(
            owner, bias=bias, single_grouped_parameter=single_grouped_parameter,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation, sequence_parallel=sequence_parallel,
        )  # fmt: skip
        for name, flag in (("weight", single_grouped_weight), ("bias", single_grouped_bias)):
            if flag is not None:
                check_bool(owner, **{f"single_grouped_{name}": flag})
                if single_grouped_parameter and not flag:
                    raise ValueError(
                        f"{owner}: single_grouped_parameter=True is single_grouped_weight=True "
                        f"and single_grouped_bias=True; got single_grouped_{name}=False"
                    )
        single = single_grouped_parameter or bool(single_grouped_weight or single_grouped_bias)
        self.use_grouped_tensor = _grouped_tensor_path(use_grouped_tensor, single)
        device = default_device(owner, device)
        dtype = params_dtype_or_default(owner, params_dtype, device)
        if sequence_parallel is True:
            raise ValueError(
                f"{owner}: sequence_parallel=True is not supported (tokens grouped by expert "
                "cannot be gathered along dim 0); shard the tokens in the MoE token dispatcher"
            )
        self.tp = TensorParallel.create(owner, parallel_mode, False, tp_group, tp_size)
        if self.tp.mode == "column":
            out_features = self.tp.divide(owner, "out_features", out_features)
        elif self.tp.mode == "row":
            in_features = self.tp.divide(owner, "in_features", in_features)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        self.single_weight = (
            single_grouped_parameter if single_grouped_weight is None else single_grouped_weight
        )
        self.single_bias = (
            single_grouped_parameter if single_grouped_bias is None else single_grouped_bias
        )
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.init_method = init_method_or_default(owner, "init_method", init_method)
        factory = {"dtype": dtype, "device": device}
        if self.single_weight:
            self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, **factory))
        if self.single_bias:
            self.bias = (
                nn.Parameter(torch.empty(num_gemms, out_features, **factory)) if bias else None
            )
        # weight0, bias0, weight1, ... (Transformer Engine's order); in a single layout None, as
        # Transformer Engine leaves them there (every group's view: weights() / biases()).
        for i in range(num_gemms):
            w = None
            if not self.single_weight:
                w = nn.Parameter(torch.empty(out_features, in_features, **factory))
            self.register_parameter(f"weight{i}", w)
            b = None
            if bias and not self.single_bias:
                b = nn.Parameter(torch.empty(out_features, **factory))
            self.register_parameter(f"bias{i}", b)
        if self.tp.mode is not None:
            self.set_partition_stride(1)
        # Delayed-scaling state of the grouped GEMM (in the state_dict once delayed scaling ran).
        self.fp8_meta = _fp8.FP8GemmState(device)
        # A TE checkpoint's FP8 metadata: one TE GEMM per group, folded into our one state.
        accept_te_extra_state(self, ("fp8_meta",), (num_gemms,))
        # is_first_microbatch: all groups' weights as one kept [num_gemms, out, in] cast.
        self._fp8_weights = _gemm.kept_weights("weight")
        self.reset_parameters()
        _primary.make_primary(self, self._weight_names(), owner)

    @property
    def parallel_mode(self) -> str | None:
        return self.tp.mode

    @property
    def num_groups(self) -> int:
        return self.num_gemms

    @property
    def single_grouped_parameter(self) -> bool:
        """One ``weight`` and one ``bias`` (both single layouts)."""
        return self.single_weight and self.single_bias

    @property
    def single_grouped_weight(self) -> bool:
        return self.single_weight

    @property
    def single_grouped_bias(self) -> bool:
        return self.single_bias

    def set_tensor_parallel_group(self, tp_group: object) -> None:
        """Set the group of a module built with ``tp_size > 1`` and no ``tp_group``."""
        self.tp = self.tp.with_group("GroupedLinear", tp_group)

    def set_partition_stride(self, stride: int) -> None:
        """(Re)mark the parameters' tensor-parallel attributes; ``stride`` 2 for the FC1 of a
        gated activation (see ``te_compile/distributed/tensor_parallel.py``)."""
        column = self.tp.mode == "column"
        w_dim = (0 if column else 1) + (1 if self.single_weight else 0)
        b_dim = (1 if self.single_bias else 0) if column else -1
        for name, p in self.named_parameters(recurse=False):
            if name.startswith("weight"):
                set_parallel_attributes(p, w_dim, stride if column else 1)
            else:
                set_parallel_attributes(p, b_dim, stride if column else 1)

    # Parameters in either layout ---------------------------------------------------------------

    # (weights(), biases(), allocate_main_grad(), _primary_main_grad():
    # ops.linear.GroupedParameters)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        with (
            _primary.high_precision_init(self, self._weight_names()),
            rng_fork(self.get_rng_state_tracker, self.rng_tracker_name),
        ):
            for w in self.weights():
                self.init_method(w)
        for b in self.biases() or ():
            b.zero_()

    def _main_grad(self) -> Tensor:
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is None:
            raise ValueError(
                "GroupedLinear(fuse_wgrad_accumulation=True) needs main_grad: call "
                "module.allocate_main_grad() once (it creates one fp32 [num_gemms, out, in] "
                "buffer and sets weight.main_grad to it)"
            )
        return main_grad

    def _per_weight_main_grads(self, weights: tuple[Tensor, ...]) -> list[Tensor]:
        """Every ``weight{i}.main_grad`` (default layout), checked: fp32, the weight's shape."""
        main_grads = []
        for i, w in enumerate(weights):
            g = getattr(w, "main_grad", None)
            if g is None:
                raise ValueError(
                    f"GroupedLinear(fuse_wgrad_accumulation=True) needs weight{i}.main_grad: a "
                    "float32 tensor of the weight's shape for each weight{i} (e.g. `w.main_grad "
                    "= torch.zeros_like(w, dtype=torch.float32)`), or call "
                    "module.allocate_main_grad() once (one buffer, weight{i}.main_grad its "
                    "views)"
                )
            if g.dtype is not torch.float32 or g.shape != w.shape or g.device != w.device:
                raise ValueError(
                    f"GroupedLinear: weight{i}.main_grad must be float32 with weight{i}'s shape "
                    f"{list(w.shape)} on its device, got {g.dtype} {list(g.shape)} {g.device}"
                )
            main_grads.append(g)
        return main_grads

    def _per_weight_accumulation(
        self, weight: Tensor, params: tuple[Tensor, ...], defer: list | None
    ) -> tuple[Tensor, Tensor, list[Tensor] | None]:
        """``fuse_wgrad_accumulation`` in the default layout: the op's weight argument, the fp32
        ``[G, N, K]`` buffer the op accumulates into, and the weights' own ``main_grad`` tensors
        to add that buffer into afterwards (None where the buffer is theirs). Where every
        ``weight{i}.main_grad`` is still the view :meth:`allocate_main_grad` made, the op adds
        into that buffer directly; otherwise (each weight its own buffer, as Transformer Engine
        and Megatron-LM's gradient buffers set them) into a buffer of their own values (one fp32
        ``[G, N, K]`` buffer more): :class:`_LoadMainGrads` (on the op's output) stacks the
        ``main_grad`` tensors into it before the op's backward, :class:`_AddToMainGrads` (on
        its weight argument) copies it back after (delayed: :class:`_DeferredIntoMainGrads`)."""
        main_grads = self._per_weight_main_grads(params)
        views = self.__dict__.get("_main_grad_views", ())
        if len(views) == len(params) and all(
            g is v for g, v in zip(main_grads, views, strict=True)
        ):
            return weight, self._main_grad_buffer, None
        buffer = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        if defer is None:
            weight = _AddToMainGrads.apply(weight, buffer, *main_grads)
        return weight, buffer, main_grads

    # Forward -------------------------------------------------------------------------------------

    @eager_when_delaying_wgrad
    def forward(
        self,
        inp: Tensor,
        m_splits: Tensor | Sequence[int],
        is_first_microbatch: bool | None = None,
    ) -> Tensor:
        cache = None
        if is_first_microbatch is not None:
            _gemm.check_first_microbatch("GroupedLinear", is_first_microbatch)
            cache = _gemm.WeightCache(self._fp8_weights, is_first_microbatch)
        if not isinstance(inp, Tensor):
            raise TypeError(f"GroupedLinear: inp must be a torch.Tensor, got {type(inp).__name__}")
        params = (self.weight,) if self.single_weight else tuple(self.weights())
        fp8, fuse = _primary.is_primary(params[0]), self.fuse_wgrad_accumulation
        weight_q = None
        wanted = torch.is_grad_enabled() and any(p.requires_grad for p in params)
        # FP8 primary weights in the default layout with a main_grad each that the module takes
        # (fuse_wgrad_accumulation, or FP8MasterWeights'; Transformer Engine's tests,
        # Megatron-LM's buffers): as fuse_wgrad_accumulation below. Else their gradient goes to
        # the single weight's main_grad (taken likewise), or to the weights' .grad.
        own = (fp8 and not self.single_weight and wanted
               and all(_primary.taken_main_grad(p, fuse) is not None for p in params))  # fmt: skip
        taken = None if own or not fp8 else self._primary_main_grad(fuse)
        # FP8 primary weights: their codes, or outside an FP8 autocast their values, as TE
        primary = grouped_primary_args(self, self._weight_names(), inp.dtype, taken,
                                       to_leaves=not own and taken is None)  # fmt: skip
        if primary is not None:
            weight, weight_q = primary
            main_grad = taken
        elif self.single_weight:
            weight = self.weight
            main_grad = self._main_grad() if self.fuse_wgrad_accumulation else None
        else:
            weight, main_grad = torch.stack(params), None
        defer = self._wgrad_defer(*params)
        into = None  # the weights' own main_grads, loaded into main_grad and back
        per_weight = primary is None and not self.single_weight and self.fuse_wgrad_accumulation
        if own or (per_weight and wanted):
            weight, main_grad, into = self._per_weight_accumulation(weight, params, defer)
        bias = self._grouped_bias()
        # Transformer Engine's weight attribute: the gradient replaces main_grad's values.
        overwrite = main_grad is not None and bool(getattr(params[0], "overwrite_main_grad", 0))

        def gemm(x: Tensor, b: Tensor | None) -> Tensor:
            out = _gemm.grouped_linear(
                "GroupedLinear",
                self.fp8_meta,
                x,
                m_splits,
                weight,
                b,
                main_grad=main_grad,
                defer=defer,
                save_original_input=self.save_original_input,
                cache=cache,
                weight_quantized=weight_q,
                overwrite_main_grad=overwrite,
            )
            if into is not None and defer is None:  # main_grads loaded before the op's backward
                out = _LoadMainGrads.apply(out, main_grad, *into)
            return out

        def add_expert_bias(out: Tensor, b: Tensor) -> Tensor:
            splits = m_splits.to(b.device)
            return out + b.repeat_interleave(splits, dim=0, output_size=out.shape[0])

        # [..., in_features] (Transformer Engine's [seq, batch, hidden]): the rows flattened.
        rows = inp.reshape(-1, inp.shape[-1]) if inp.dim() > 2 else inp
        # A list becomes a tensor once; its sum is checked here (free on the host).
        n_rows = rows.shape[0] if rows.dim() == 2 else None
        m_splits = checked_splits("GroupedLinear", m_splits, n_rows, "inp's rows")
        # Row-parallel: each row's expert bias is added once, to the sum of the partial products.
        out, _ = self.tp.linear("GroupedLinear", gemm, rows, bias, add=add_expert_bias)
        if defer:  # the GEMM's [G, N, K] weight gradient goes to the module's weight(s)
            if into is not None:
                defer = [(_DeferredIntoMainGrads(d, main_grad, into), w) for d, w in defer]
            entry = [(d, params[0] if self.single_weight else params) for d, _ in defer]
            self._wgrad_queue(entry, out)
        return out.reshape(*inp.shape[:-1], out.shape[-1]) if inp.dim() > 2 else out

    # state_dict in either layout ---------------------------------------------------------------

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        shapes = {}
        for name, single in (("weight", self.single_weight), ("bias", self.single_bias)):
            param = getattr(self, name if single else f"{name}0", None)
            if param is not None:  # one group's shape
                shapes[name] = tuple(param.shape[1:] if single else param.shape)
        _convert_layout(
            state_dict, prefix, self.num_gemms, self.single_weight, self.single_bias, shapes
        )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}, "
            f"single_grouped_weight={self.single_weight}, "
            f"single_grouped_bias={self.single_bias}"
            + (", delay_wgrad_compute=True" if self.delay_wgrad_compute else "")
            + (", save_original_input=True" if self.save_original_input else "")
            + self.tp.describe()
        )


def _grouped_tensor_path(use_grouped_tensor: object, single: bool) -> bool:
    """Transformer Engine's ``use_grouped_tensor``: its choice between a native grouped GEMM and
    a per-expert split-quantize path. Here every layout and recipe runs the one grouped op
    (``te::grouped_linear``), so both values give the same results; the checks are TE's: a bool
    or None (None: True for the single layouts, which need that path in TE, else False), and a
    single layout with False is refused."""
    if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
        raise TypeError(
            f"GroupedLinear: use_grouped_tensor must be a bool or None, got "
            f"{use_grouped_tensor!r} ({type(use_grouped_tensor).__name__})"
        )
    if use_grouped_tensor is False and single:
        raise ValueError(
            "GroupedLinear: single_grouped_weight / single_grouped_bias (single_grouped_parameter) "
            "need use_grouped_tensor=True (Transformer Engine's split-quantize path takes "
            "per-expert parameters only): pass use_grouped_tensor=True or None, or build the "
            "per-expert layout"
        )
    return single if use_grouped_tensor is None else use_grouped_tensor


class _AddToMainGrads(torch.autograd.Function):
    """The stacked ``[G, N, K]`` weight, unchanged, for weights that each have their own
    ``main_grad`` (``fuse_wgrad_accumulation``, the default layout, buffers not made by
    ``allocate_main_grad``). The grouped op accumulates the weight gradient in fp32 into
    ``buffer``, which :class:`_LoadMainGrads` filled with the ``main_grad`` values (and gives the
    weight none); this node's backward, which autograd runs after the op's (the op's weight
    argument is this node's output), copies ``buffer[i]`` into ``main_grads[i]``. The
    accumulators are kept on ``ctx``, out of the version-counter check, as the op keeps its
    ``main_grad``."""

    @staticmethod
    def forward(ctx, weight: Tensor, buffer: Tensor, *main_grads: Tensor) -> Tensor:
        ctx.written = (buffer, *main_grads)  # dynamo keeps ctx attributes out of the check too
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, _grad: Tensor) -> tuple[None, ...]:
        buffer, *main_grads = ctx.written
        torch._foreach_copy_(main_grads, list(buffer.unbind(0)))
        return (None,) * (2 + len(main_grads))  # the weight gradient went to main_grad


class _LoadMainGrads(torch.autograd.Function):
    """The grouped op's output, unchanged; its backward, which autograd runs before the op's
    (the gradient reaches the op through it), stacks the ``main_grads`` into ``buffer``, so the
    op accumulates into their values as of its backward (:class:`_AddToMainGrads`)."""

    @staticmethod
    def forward(ctx, out: Tensor, buffer: Tensor, *main_grads: Tensor) -> Tensor:
        ctx.written = (buffer, *main_grads)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        buffer, *main_grads = ctx.written
        # Read after the gradient exists: a copy that does not depend on it is, traced, a value
        # of the forward's inputs, which the partitioner computes in the forward graph (the
        # main_grads of that time: a pipeline's F1 F2 B2 B1 then lost B2's gradient).
        after = grad.new_ones((), dtype=torch.bool)
        buffer.copy_(torch.where(after, torch.stack(main_grads), buffer))
        return (grad, *(None,) * (1 + len(main_grads)))


class _DeferredIntoMainGrads(NamedTuple):
    """A :class:`~te_compile.functional.family.DeferredWgrad` of weights that each have their own
    ``main_grad`` (:class:`_AddToMainGrads`, with ``delay_wgrad_compute``): :meth:`compute`
    stacks the ``main_grads`` into ``buffer``, runs the op's weight-gradient GEMMs into it, then
    copies ``buffer[i]`` back into ``main_grads[i]``."""

    deferred: Any
    buffer: Tensor
    main_grads: list[Tensor]

    @property
    def ready(self) -> bool:
        return self.deferred.ready

    def compute(self) -> None:
        torch._foreach_copy_(list(self.buffer.unbind(0)), self.main_grads)
        self.deferred.compute()  # None: accumulated into buffer
        torch._foreach_copy_(self.main_grads, list(self.buffer.unbind(0)))


def _convert_layout(
    state_dict: dict,
    prefix: str,
    num_gemms: int,
    single_weight: bool,
    single_bias: bool,
    shapes: dict[str, tuple[int, ...]],
) -> None:
    """Rewrite, in place, the entries of ``state_dict`` under ``prefix`` saved in the other
    layout into this module's layout (exact: stacking / unbinding copies values). ``shapes``:
    one group's shape of each parameter the module has; an entry of another shape, or a
    per-group set with entries missing, is refused naming the entry (also under
    ``strict=False``, which does not reach here: a partial set cannot make the parameter)."""
    for name, single in (("weight", single_weight), ("bias", single_bias)):
        grouped = prefix + name
        per_group = [f"{prefix}{name}{i}" for i in range(num_gemms)]
        other = per_group[0] if single else grouped  # the other layout's (first) entry
        if name == "weight" and other + "_scale_inv" in state_dict and other in state_dict:
            raise ValueError(
                f"GroupedLinear: state_dict entry {other!r} holds FP8 primary weights saved with "
                f"single_grouped_weight={not single}, and this module has "
                f"single_grouped_weight={single}: FP8 codes keep the scale of their layout (one "
                "per group, or one for all), so they load into a module of the same layout only"
            )
        shape = shapes.get(name)
        present = [k for k in per_group if k in state_dict]
        if single and grouped not in state_dict and present:
            missing = [k for k in per_group if k not in state_dict]
            if missing:
                raise ValueError(
                    f"GroupedLinear: state_dict holds {present[0]!r} (the per-group layout, "
                    f"single_grouped_{name}=False) but not {missing[0]!r}: the {num_gemms} "
                    f"entries {name}0 .. {name}{num_gemms - 1} are stacked into this module's "
                    f"{grouped!r}"
                )
            for k in per_group:
                if shape is not None and tuple(state_dict[k].shape) != shape:
                    raise ValueError(
                        f"GroupedLinear: state_dict entry {k!r} has shape "
                        f"{list(state_dict[k].shape)}; expected one group's {list(shape)} (they "
                        f"are stacked into this module's {grouped!r})"
                    )
            state_dict[grouped] = torch.stack([state_dict.pop(k) for k in per_group])
        elif not single and grouped in state_dict and not present:
            tensor = state_dict.pop(grouped)
            if tensor.dim() == 0 or tensor.shape[0] != num_gemms:
                raise ValueError(
                    f"GroupedLinear: state_dict entry {grouped!r} has shape {list(tensor.shape)}; "
                    f"expected dim 0 = num_gemms = {num_gemms}"
                )
            if shape is not None and tuple(tensor.shape[1:]) != shape:
                raise ValueError(
                    f"GroupedLinear: state_dict entry {grouped!r} has shape {list(tensor.shape)}; "
                    f"expected [num_gemms, *one group's shape] = {[num_gemms, *shape]}"
                )
            for k, t in zip(per_group, tensor.unbind(0), strict=True):
                state_dict[k] = t.clone()
