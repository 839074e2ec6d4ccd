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
single layout; in the default layout ``weight{i}.main_grad`` must be ``buffer[i]`` of one fp32
``[num_gemms, out, in]`` buffer, which :meth:`GroupedLinear.allocate_main_grad` creates.

Tensor parallelism (expert tensor parallelism; ``parallel_mode``, ``tp_group``, ``tp_size`` as
in :class:`~te_compile.Linear`): "column" shards every expert's ``out_features``, "row" its
``in_features`` and all-reduces the output, adding the biases after the sum. Sequence
parallelism is not supported: the tokens arrive grouped by expert, and gathering the ranks'
token shards would interleave the groups (shard tokens in the MoE token dispatcher instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from te_compile.distributed.tensor_parallel import TensorParallel, set_parallel_attributes
from te_compile.functional.grouped_gemm import checked_splits
from te_compile.modules._common import (
    DelayedWgrad,
    check_bool,
    check_positive,
    check_rng_tracker,
    eager_when_delaying_wgrad,
    init_method_or_default,
    params_dtype_or_default,
    rng_fork,
)
from te_compile.quantization import fp8_gemm as _fp8
from te_compile.quantization import gemm as _gemm
from te_compile.quantization import primary as _primary

__all__ = ["GroupedLinear"]


class GroupedLinear(DelayedWgrad, nn.Module):
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
        save_original_input: the backward keeps the input itself rather than a quantised
            copy (high precision and Float8CurrentScaling do; DelayedScaling raises ValueError,
            as in Transformer Engine; the block-scaled recipes raise NotImplementedError).

    Built inside ``te_compile.quantized_model_init`` the weights are FP8 codes with a scale
    each (``quantization.primary``: ``grouped_primary``, ``FP8MasterWeights``).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
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
    ) -> None:
        super().__init__()
        owner = "GroupedLinear"
        self._init_delayed_wgrad(owner, delay_wgrad_compute)
        if _primary.init_state() is not None and delay_wgrad_compute:
            raise NotImplementedError(
                f"{owner}: delay_wgrad_compute=True with FP8 primary weights "
                "(quantized_model_init) is not supported; build it with "
                "delay_wgrad_compute=False"
            )
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
        for i in range(num_gemms):  # weight0, bias0, weight1, ... (Transformer Engine's order)
            if not self.single_weight:
                w = nn.Parameter(torch.empty(out_features, in_features, **factory))
                self.register_parameter(f"weight{i}", w)
            if not self.single_bias:
                b = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
                self.register_parameter(f"bias{i}", b)
        if self.tp.mode is not None:
            self.set_partition_stride(1)
        # Delayed-scaling state of the grouped GEMM (in the state_dict once delayed scaling ran).
        self.fp8_meta = _fp8.FP8GemmState(device)
        # is_first_microbatch: all groups' weights as one kept [num_gemms, out, in] cast.
        self._fp8_weights = _gemm.kept_weights("weight")
        self.reset_parameters()
        _primary.make_primary(self, self._weight_names(), owner)  # in quantized_model_init

    @property
    def parallel_mode(self) -> str | None:
        return self.tp.mode

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

    def _weight_names(self) -> tuple[str, ...]:
        if self.single_weight:
            return ("weight",)
        return tuple(f"weight{i}" for i in range(self.num_gemms))

    def weights(self) -> list[Tensor]:
        """Every group's ``[out, in]`` weight (views of ``weight`` in the single layout)."""
        if self.single_weight:
            return list(self.weight.unbind(0))
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def biases(self) -> list[Tensor] | None:
        if not self.use_bias:
            return None
        if self.single_bias:
            return list(self.bias.unbind(0))
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

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

    def allocate_main_grad(self) -> Tensor:
        """Allocate (zeroed) the fp32 ``[num_gemms, out, in]`` buffer weight gradients are
        accumulated into with ``fuse_wgrad_accumulation``, and point every weight's
        ``main_grad`` at it (``weight.main_grad`` or ``weight{i}.main_grad = buffer[i]``)."""
        first = self.weights()[0]
        shape = (self.num_gemms, self.out_features, self.in_features)
        buffer = torch.zeros(shape, dtype=torch.float32, device=first.device)
        if self.single_weight:
            self.weight.main_grad = buffer
        else:
            for i, w in enumerate(self.weights()):
                w.main_grad = buffer[i]
        self._main_grad_buffer = buffer
        return buffer

    def _main_grad(self) -> Tensor:
        if self.single_weight:
            main_grad = getattr(self.weight, "main_grad", None)
        else:
            main_grad = getattr(self, "_main_grad_buffer", None)
        if main_grad is None:
            raise ValueError(
                "GroupedLinear(fuse_wgrad_accumulation=True) needs main_grad: call "
                "module.allocate_main_grad() once (it creates one fp32 [num_gemms, out, in] "
                "buffer and points every weight's main_grad into it)"
            )
        return main_grad

    def _primary_main_grad(self, params: tuple[Tensor, ...]) -> Tensor | None:
        """The ``[num_gemms, out, in]`` fp32 buffer FP8 primary weights' gradient goes to
        (``FP8MasterWeights`` allocates it); None where no gradient is wanted."""
        main_grad = (getattr(self.weight, "main_grad", None) if self.single_weight
                     else getattr(self, "_main_grad_buffer", None))  # fmt: skip
        return _primary.required_main_grad("GroupedLinear", main_grad, params[0])

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
        primary = _primary.grouped_primary(self, self._weight_names(), inp.dtype)
        params = (self.weight,) if self.single_weight else tuple(self.weights())
        weight_q = None
        if primary is not None:  # FP8 primary weights: their gradient goes to main_grad
            weight, weight_q = primary
            main_grad = self._primary_main_grad(params)
        else:
            weight = self.weight if self.single_weight else torch.stack(self.weights())
            main_grad = self._main_grad() if self.fuse_wgrad_accumulation else None
        bias = None
        if self.use_bias:
            bias = self.bias if self.single_bias else torch.stack(self.biases())
        defer = self._wgrad_defer(*params)

        def gemm(x: Tensor, b: Tensor | None) -> Tensor:
            return _gemm.grouped_linear(
                "GroupedLinear",
                self.fp8_meta,
                x,
                m_splits,
                weight,
                b,
                main_grad,
                defer,
                self.save_original_input,
                cache,
                weight_q,
            )

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
