"""FP8 state of one GEMM and the dispatch from the autocast recipe to the FP8 linear ops.

Every module GEMM that can run in FP8 owns an :class:`FP8GemmState` child module. Its buffers
are the delayed-scaling state (Transformer Engine's "fp8 meta"), persistent so that a
state_dict save/load resumes training exactly:

* ``amax_history`` ``[1024, 3]``: per slot (input, weight, gradient) the last amaxes, newest in
  row 0; a recipe's ``amax_history_len`` (at most 1024) uses the first rows;
* ``scale`` ``[3]``: the scales the next casts use;
* ``fwd_amax`` ``[2]`` / ``grad_amax`` ``[1]``: the amaxes the last forward / backward measured.
  Two buffers, because the backward op writes ``grad_amax`` after the forward saved it, and a
  saved tensor that shares storage with one the forward then writes would fail autograd's
  version check.

A state that was never used (delayed scaling never ran: zero history, unit scales) is left out
of the state_dict and, when absent from a loaded one, reset to that initial value: a module that
never ran in FP8 keeps the state_dict of its ``torch.nn`` counterpart (``te.Linear`` <->
``nn.Linear``, both ways); one trained with delayed scaling saves and restores its history.

Under ``DelayedScaling`` each forward first folds the last amaxes into the history and
recomputes the scales (``te::delayed_scaling_update``, a mutating op: compiled steps update the
buffers with zero graph breaks), then runs ``te::linear_fp8_fwd`` with a copy of the scales.

**The first delayed step is calibrated.** With an empty history every scale would be 1 (what
Transformer Engine does): a typical model's gradients (~1e-5 and below) then mostly underflow
E5M2 and its weights sit in E4M3's subnormals, so the first optimizer step, and Adam's moments
for many steps after it, see a wrong gradient (the demo GPT's first-step gradients are 100%
off, and its 300-step loss ended 0.7-8.6% above bf16 at every seed; calibrated, it tracks current
scaling: ``bench/results/2026-11-23_h100/README.md``). So a state's first step under
``DelayedScaling`` runs current scaling and records the amaxes it measured; the next step folds
them into the history. ``calibrated`` (a Python bool, saved with the buffers: a loaded
state_dict that holds them is calibrated) is what a compiled step specialises on: one
recompile after the first step.
With ``amax_reduction_group`` (or ``reduce_amax`` and an initialised default process group)
the amaxes are max-reduced over the group with a functional all-reduce (traced by
torch.compile): the forward's before they are recorded, the gradient's when it is folded into
the history at the next forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from te_compile import functional as F
from te_compile.quantization.device import is_fp8_block_scaling_available
from te_compile.quantization.state import AutocastState, get_autocast_state

# A test and benchmark override, not configuration (tests/ and bench/ patch it); False:
# GroupedLinear's wgrad GEMM in high precision, the input kept in high precision for it
# instead of its FP8 copy.
_GROUPED_FP8_WGRAD = True

__all__ = ["MAX_AMAX_HISTORY", "FP8GemmState", "grouped_linear", "non_finite_amaxes"]

MAX_AMAX_HISTORY = 1024


class FP8GemmState(nn.Module):
    """The FP8 scaling state of one GEMM (see the module docstring)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        kw = {"dtype": torch.float32, "device": device}
        self.register_buffer("amax_history", torch.zeros(MAX_AMAX_HISTORY, 3, **kw))
        self.register_buffer("scale", torch.ones(3, **kw))
        self.register_buffer("fwd_amax", torch.zeros(2, **kw))
        self.register_buffer("grad_amax", torch.zeros(1, **kw))
        # Whether a delayed-scaling step ran here (module docstring): the first one is current.
        self.calibrated = False
        self._register_state_dict_hook(_drop_if_unused)

    def is_unused(self) -> bool:
        """True while delayed scaling never ran (a host sync: for state_dict, not forward)."""
        if self.calibrated:
            return False
        return not bool(self.amax_history.any()) and bool((self.scale == 1).all())

    def _apply(self, fn, recurse=True):
        # The scaling state stays float32 when the model is cast (``.to(torch.bfloat16)``,
        # ``.half()``): the delayed-scaling update needs fp32, and a bf16 amax history would
        # round the scales. Only the device follows.
        def keep_float32(t: Tensor) -> Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        return super()._apply(keep_float32, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        names = ("amax_history", "scale", "fwd_amax", "grad_amax")
        # Saved only once used, so a state_dict that holds the state is calibrated.
        self.calibrated = any(prefix + n in state_dict for n in names)
        if not self.calibrated:
            fresh = FP8GemmState(self.scale.device)
            for n in names:
                state_dict[prefix + n] = getattr(fresh, n)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def grouped_linear(
        self,
        owner: str,
        state: AutocastState,
        inp: Tensor,
        m_splits: Tensor | Sequence[int],
        weight: Tensor,
        bias: Tensor | None,
        main_grad: Tensor | None = None,
    ) -> Tensor:
        """The grouped GEMM of a GroupedLinear (``weight`` ``[G, N, K]``, the weight gradient
        added to ``main_grad`` when given) with the FP8 recipe of ``state``:
        ``Float8CurrentScaling`` with rowwise scales (what Hopper's grouped FP8 GEMM takes),
        ``DelayedScaling`` with this state's per-tensor scales (input, weight and gradient of
        all groups); the forward, dgrad and wgrad GEMMs in FP8 (the wgrad's operands quantised
        per expert and column along the tokens; ``_GROUPED_FP8_WGRAD = False``: the wgrad in
        high precision). Torch's grouped FP8 GEMM takes E4M3 only: an E5M2 gradient goes in as
        E4M3 codes (``functional.grouped_linear_fp8``). ``Float8BlockScaling`` runs natively
        where the dense one does (:func:`_native_block`; ``te::grouped_linear_block``: a
        blockwise GEMM per expert, host splits), the other block-scaled recipes are emulated
        (:func:`_grouped_block_emulated`)."""
        recipe = state.recipe
        if recipe.float8_block_scaling():
            native = _native_grouped_block(owner, recipe, inp, m_splits, weight, bias, main_grad)
            if native is not None:
                return native
        if recipe.mxfp8() or recipe.nvfp4() or recipe.float8_block_scaling():
            return _grouped_block_emulated(owner, recipe, inp, m_splits, weight, bias, main_grad)
        fmt = recipe.fp8_format
        kw = {"fwd_dtype": fmt.fwd_dtype, "bwd_dtype": fmt.bwd_dtype, "main_grad": main_grad}
        kw["fp8_wgrad"] = _GROUPED_FP8_WGRAD
        scale = self.delayed_scale(owner, state)
        if scale is None and not recipe.delayed():
            return F.grouped_linear_fp8(inp, m_splits, weight, bias, **kw)
        # Delayed scaling; its calibration step (no scale yet) runs rowwise current scaling and
        # records the amaxes it measures.
        out, amax = F.grouped_linear_fp8(
            inp, m_splits, weight, bias, recipe="rowwise" if scale is None else "delayed",
            scale=scale, grad_amax=self.grad_amax, return_amax=True, **kw,
        )  # fmt: skip
        self.record(amax, state)
        return out

    def delayed_scale(self, owner: str, state: AutocastState) -> Tensor | None:
        """None under current scaling and at the first delayed step (the calibration step: the
        caller runs current scaling and records the amaxes); else fold the last amaxes into the
        history, recompute the scales and return a copy of them (the ``[3]`` the FP8 ops take)."""
        recipe = state.recipe
        if recipe.float8_current():
            return None
        if not recipe.delayed():
            raise NotImplementedError(
                f"{owner}: the {type(recipe).__name__} recipe is not implemented"
            )
        length = recipe.amax_history_len
        if length > MAX_AMAX_HISTORY:
            raise ValueError(
                f"{owner}: DelayedScaling.amax_history_len ({length}) must be <= "
                f"{MAX_AMAX_HISTORY}, the history these buffers hold"
            )
        if not self.calibrated:
            self.calibrated = True
            return None
        fmt = recipe.fp8_format
        limits = [fmt.max_fwd, fmt.max_fwd, fmt.max_bwd]
        history = self.amax_history[:length]
        # The gradient amax of the last backward is reduced here, when it is folded in (the
        # backward op has no group); the forward amaxes were reduced when recorded.
        last = _reduce_amax(torch.cat([self.fwd_amax, self.grad_amax]), state, recipe)
        torch.ops.te.delayed_scaling_update(
            history, self.scale, last, limits, recipe.margin, recipe.amax_compute_algo
        )
        return self.scale.clone()

    def record(self, amax: Tensor, state: AutocastState) -> None:
        """Keep the forward's ``[amax(input), amax(weight)]``: delayed scaling folds them into
        the history at the next forward (reduced over the amax group first); under current
        scaling they are kept for :func:`non_finite_amaxes`."""
        if state.recipe.delayed():
            amax = _reduce_amax(amax, state, state.recipe)
        self.fwd_amax.copy_(amax)


def grouped_linear(
    owner: str,
    meta: FP8GemmState,
    inp: Tensor,
    m_splits: Tensor | Sequence[int],
    weight: Tensor,
    bias: Tensor | None,
    main_grad: Tensor | None = None,
) -> Tensor:
    """A module's grouped GEMM: FP8 with ``meta``'s state inside an enabled
    ``te_compile.autocast`` (:meth:`FP8GemmState.grouped_linear`), else
    ``te::grouped_linear_fwd``."""
    state = get_autocast_state()
    if not state.enabled:
        return F.grouped_linear(inp, m_splits, weight, bias, main_grad=main_grad)
    return meta.grouped_linear(owner, state, inp, m_splits, weight, bias, main_grad)


def _native_block(recipe, inp: Tensor, weights: tuple[Tensor, ...], w_rows: int) -> bool:
    """Whether Float8BlockScaling's GEMMs with these weights run natively (as
    ``quantization.gemm.gemm_args`` decides it)."""
    from te_compile.quantization import gemm

    fmt = recipe.fp8_format
    return (
        inp.device.type == "cuda"
        and gemm._NATIVE_BLOCK
        and is_fp8_block_scaling_available()
        and all(F.blockwise_supported(w, w_rows, fmt.fwd_dtype, fmt.bwd_dtype) for w in weights)
    )


def _block_dims(owner: str, recipe) -> tuple[int, bool]:
    """Float8BlockScaling's ``(weight block rows, power-of-two scales)``; 128x128 activation or
    gradient blocks are refused."""
    if recipe.x_block_scaling_dim != 1 or recipe.grad_block_scaling_dim != 1:
        raise NotImplementedError(
            f"{owner}: Float8BlockScaling with 128x128 activation or gradient blocks is not "
            "implemented (1x128, the default, is)"
        )
    return (128 if recipe.w_block_scaling_dim == 2 else 1), not recipe.use_f32_scales


def _native_grouped_block(owner, recipe, inp, m_splits, weight, bias, main_grad) -> Tensor | None:
    """Float8BlockScaling on a grouped GEMM with native blockwise GEMMs (one per expert,
    ``te::grouped_linear_block``) where the dense op would run natively and the input is bf16
    (cuBLAS's blockwise GEMMs give bf16); None otherwise (the caller emulates)."""
    w_rows, power_2 = _block_dims(owner, recipe)
    if inp.dtype is not torch.bfloat16 or not _native_block(recipe, inp, (weight[0],), w_rows):
        return None
    return F.grouped_linear_block(
        inp, m_splits, weight, bias, power_2_scale=power_2, weight_block_rows=w_rows,
        main_grad=main_grad,
    )  # fmt: skip


def _grouped_block_emulated(owner, recipe, inp, m_splits, weight, bias, main_grad) -> Tensor:
    """Float8BlockScaling / MXFP8BlockScaling on a grouped GEMM, emulated: torch has no grouped
    block-scaled GEMM, so the operands are quantised exactly and dequantised to the model's
    dtype (``te::fake_quantize``), and the bf16 / fp32 grouped GEMMs (``te::grouped_linear``)
    run on those values. The input in blocks along ``in_features`` (1x128 or 32 elements),
    each expert's weight in the recipe's weight blocks (128x128 by default for
    Float8BlockScaling), the incoming gradient in blocks along ``out_features``; the dgrad and
    the wgrad both see that gradient and the forward's quantised input and weight (Transformer
    Engine quantises the wgrad's operands along the tokens instead). The bias and its gradient
    stay in high precision. Numerics, not speed."""
    fwd, bwd = recipe.fp8_format.fwd_dtype, recipe.fp8_format.bwd_dtype
    w_rows, power_2 = 1, False
    if recipe.nvfp4():
        return _grouped_nvfp4_emulated(inp, m_splits, weight, bias, main_grad)
    if recipe.mxfp8():
        kind = "mxfp8"
    else:
        kind = "block"
        w_rows, power_2 = _block_dims(owner, recipe)
    kw = {"fp8_dtype": fwd, "power_2_scale": power_2}
    x = F.fake_quantize(inp, kind, block_rows=1, **kw)
    g, n, k = weight.shape
    if w_rows == 1 or n % w_rows == 0:  # no block of rows straddles two experts
        w = F.fake_quantize(weight.reshape(g * n, k), kind, block_rows=w_rows, **kw).view(g, n, k)
    else:
        w = torch.stack([F.fake_quantize(w_g, kind, block_rows=w_rows, **kw) for w_g in weight])
    out = F.grouped_linear(x, m_splits, w, None, main_grad=main_grad)
    out = F.fake_quantize(
        out, "none", grad_kind=kind, grad_fp8_dtype=bwd, grad_block_rows=1, power_2_scale=power_2
    )
    return _plus_expert_bias(out, bias, m_splits)


def _grouped_nvfp4_emulated(inp, m_splits, weight, bias, main_grad) -> Tensor:
    """NVFP4 on a grouped GEMM, emulated as :func:`_grouped_block_emulated` does, with the
    global scale per expert as Transformer Engine's grouped quantisation has it: each expert's
    tokens, weight and gradient rows are quantised as a tensor of their own (``row_splits``:
    group amaxes on the device, no host sync)."""
    splits = F.as_splits_tensor(m_splits)
    g, n, k = weight.shape
    per_expert = torch.full((g,), n, dtype=torch.int64, device=weight.device)
    x = F.fake_quantize(inp, "nvfp4", row_splits=splits)
    w = F.fake_quantize(weight.reshape(g * n, k), "nvfp4", row_splits=per_expert).view(g, n, k)
    out = F.grouped_linear(x, splits, w, None, main_grad=main_grad)
    e4m3 = torch.float8_e4m3fn
    out = F.fake_quantize(out, "none", grad_kind="nvfp4", grad_fp8_dtype=e4m3, row_splits=splits)
    return _plus_expert_bias(out, bias, splits)


def _plus_expert_bias(out: Tensor, bias: Tensor | None, m_splits) -> Tensor:
    """``out`` plus every row's expert bias, in high precision (no host sync)."""
    if bias is None:
        return out
    splits = F.as_splits_tensor(m_splits).to(bias.device)
    return out + bias.repeat_interleave(splits, dim=0, output_size=out.shape[0])


def non_finite_amaxes(model: nn.Module) -> dict[str, list[str]]:
    """The FP8 GEMMs of ``model`` whose last measured amaxes are inf or NaN: ``{name: ["input",
    "weight", "grad" (those that were)]}``, empty when all are finite. An inf or NaN in an input,
    weight or gradient shows up here after the step that saw it (per-tensor recipes, current and
    delayed); delayed scaling keeps its previous scale for such a slot. One host sync per call:
    call it when logging, not every step."""
    report = {}
    for name, state in model.named_modules():
        if isinstance(state, FP8GemmState):
            amax = torch.cat([state.fwd_amax, state.grad_amax]).isfinite().tolist()
            bad = [
                slot for slot, ok in zip(("input", "weight", "grad"), amax, strict=True) if not ok
            ]
            if bad:
                report[name] = bad
    return report


def _drop_if_unused(module: FP8GemmState, state_dict, prefix: str, local_metadata) -> None:
    if module.is_unused():
        for name in ("amax_history", "scale", "fwd_amax", "grad_amax"):
            state_dict.pop(prefix + name, None)


def _reduce_amax(amax: Tensor, state: AutocastState, recipe) -> Tensor:
    """Max over the amax reduction group (functional collective: traced by torch.compile)."""
    group = state.amax_reduction_group
    if group is None:
        if not (recipe.reduce_amax and torch.distributed.is_initialized()):
            return amax
        group = torch.distributed.group.WORLD
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(amax, "max", group)
