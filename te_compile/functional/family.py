"""What a GEMM family op's call needs beyond ``functional.gemm``'s tables: the checks of a
family function's scalar and tensor arguments, the backward op's parsed arguments
(:class:`BwdArgs`), a deferred weight gradient (:class:`DeferredWgrad`) and the save of the
tensors a backward writes (:func:`save_for_backward_except_written`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from te_compile._checks import (
    check_bool,
    check_finite,
    check_int,
    check_positive_finite,
    check_required,
    check_same_device,
    check_tensors,
)
from te_compile._library import stash_for_backward
from te_compile.functional.spec import EpilogueSpec, NormSpec, QuantSpec, as_specs, parse

__all__ = [
    "BwdArgs",
    "DeferredWgrad",
    "check_gemm_args",
    "check_gemm_tensors",
    "check_overwrite",
    "save_for_backward_except_written",
]

_GEMM_ARGS = ("weight", "bias", "main_grad")


def check_gemm_args(owner: str, **reals: object) -> None:
    """A family function's scalar arguments, used by the call or not (never silently ignored):
    ``norm_eps``, ``limit``, ``alpha``: positive; ``glu_linear_offset``, ``out_scale``: finite;
    ``glu_interleave_size``: None or an int >= 0."""
    for name, value in reals.items():
        if name in ("glu_linear_offset", "out_scale"):
            check_finite(owner, **{name: value})
        elif name != "glu_interleave_size":
            check_positive_finite(owner, **{name: value})
        elif value is not None:
            check_int(owner, 0, glu_interleave_size=value)


def check_overwrite(owner: str, overwrite_main_grad: bool, main_grad: Tensor | None) -> None:
    if overwrite_main_grad and main_grad is None:
        raise ValueError(f"{owner}: overwrite_main_grad=True needs main_grad (the fp32 buffer "
                         "whose values the weight gradient replaces)")  # fmt: skip


def check_gemm_tensors(
    owner: str, inp: object, weight: object, bias: object, main_grad: object, names=_GEMM_ARGS
) -> None:
    """A family function's input, weight, bias and main_grad (optional; ``names``: the last
    three's argument names): tensors on ``inp``'s device; one cheap test on the hot path, the
    checks naming the argument only if it fails."""
    if not (
        isinstance(inp, Tensor) and isinstance(weight, Tensor)
        and (bias is None or isinstance(bias, Tensor))
        and (main_grad is None or isinstance(main_grad, Tensor))):  # fmt: skip
        check_required(owner, inp=inp, **{names[0]: weight})
        check_tensors(owner, **{names[1]: bias, names[2]: main_grad})
    device = inp.device
    if (
        weight.device != device or (bias is not None and bias.device != device)
        or (main_grad is not None and main_grad.device != device)):  # fmt: skip
        tensors = dict(zip(names, (weight, bias, main_grad), strict=True))
        check_same_device(owner, "inp", inp, **tensors)


class BwdArgs(NamedTuple):
    """A dense family's backward op arguments after the tensors, parsed (``te::mlp_bwd`` always
    computes its weight gradients: ``need_wgrad`` True)."""

    x: QuantSpec
    w: QuantSpec
    g: QuantSpec
    norm: NormSpec
    ep: EpilogueSpec
    need_dbias: bool
    need_dgrad: bool
    need_wgrad: bool = True

    @classmethod
    def of(cls, input_spec, weight_spec, grad_spec, norm, epilogue, *need) -> BwdArgs:
        return cls(*as_specs(input_spec, weight_spec, grad_spec), parse(NormSpec, norm),
                   parse(EpilogueSpec, epilogue), *need)  # fmt: skip

    @property
    def recipe(self) -> str:
        return self.x.kind


class DeferredWgrad(NamedTuple):
    """A weight gradient left for later (``delay_wgrad=True``, Transformer Engine's
    ``delay_wgrad_compute``): the backward op copies its incoming gradient into ``stash``
    instead of running the wgrad GEMM; :meth:`compute` later runs the same backward op for the
    weight gradient alone on the saved tensors (``replay(stash)``): the same bits."""

    stash: Tensor
    version: int
    replay: Callable[[Tensor], Tensor | None]

    @classmethod
    def replaying(cls, stash: Tensor, bwd: Callable[..., tuple], lead: tuple, tensors: tuple,
                  n: int, scalars: tuple) -> DeferredWgrad:  # fmt: skip
        """One whose replay runs the family's backward op ``bwd`` for the weight gradient alone,
        ``bwd(grad, *lead, saved, *named, *scalars, False, False, True)``: ``tensors`` are the
        ``n`` named tensors of a forward call (``main_grad`` at 3, ``grad_amax`` at 5) then its
        ``saved``, ``scalars`` its strings."""

        def replay(grad: Tensor) -> Tensor | None:
            named, saved = list(tensors[:n]), list(tensors[n:])
            if named[5] is not None:  # the backward recorded amax(dY) already: not twice
                named[5] = torch.zeros_like(named[5])
            dweight = bwd(grad, *lead, saved, *named, *scalars, False, False, True)[1]
            return None if named[3] is not None else dweight

        return cls(stash, stash._version, replay)

    @property
    def ready(self) -> bool:
        """Whether the backward has run (it wrote ``stash``: its version counter moved)."""
        return self.stash._version != self.version

    def compute(self) -> Tensor | None:
        """The weight gradient, or None where it was accumulated into ``main_grad``."""
        return self.replay(self.stash)

    @staticmethod
    def check_stash(p: str, stash: Tensor | None, shape: tuple, inp: Tensor) -> None:
        """A family op's ``wgrad_stash`` (None, or the output's ``shape`` in ``inp``'s dtype and
        device); ``p`` begins the message."""
        if stash is not None and (
            stash.shape != shape or stash.dtype != inp.dtype or stash.device != inp.device
        ):
            raise ValueError(
                p + f"wgrad_stash must have the output's shape {list(shape)}, inp's dtype "
                f"{inp.dtype} and device, got {list(stash.shape)} {stash.dtype} {stash.device}"
            )

    @staticmethod
    def check(owner: str, delay_wgrad: object) -> None:
        """``delay_wgrad`` a bool, and eager: under ``torch.compile`` no tensor the backward
        writes (the stash) can leave the compiled graph."""
        check_bool(owner, delay_wgrad=delay_wgrad)
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                f"{owner}: delay_wgrad=True (delay_wgrad_compute) runs in eager mode only: the "
                "backward stores the output gradient for backward_dw(), which a compiled "
                "backward cannot hand out of its graph"
            )


def save_for_backward_except_written(ctx, tensors: Sequence[Tensor | None],
                                     written: Sequence[int]) -> None:  # fmt: skip
    """``ctx.save_for_backward(*tensors)`` but for those at positions ``written``, the caller's
    accumulators the backward writes (``main_grad``, a gradient amax), kept as ``ctx.written``
    out of autograd's version check, which would refuse a second forward's backward once the
    first wrote them (pipeline schedules); ``_library.stash_for_backward`` under compile."""
    stash_for_backward(ctx, "written", tuple(tensors[i] for i in written))
    ctx.save_for_backward(*(None if i in written else t for i, t in enumerate(tensors)))
