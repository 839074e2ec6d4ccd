"""Planted bugs for :mod:`tests.test_mutations`: a pytest plugin (``-p tests.mutation.plant
--plant=NAME``) that breaks te_compile in one small, realistic way before the tests run, so
that the mutation test can assert that the suite's own tests catch it.

Each bug goes through the public modules (a module's ``forward``) or replaces one library
function everywhere it was imported by name. Spawned ranks of the distributed tests apply the
same bug: the harness calls :func:`apply_from_env` (the name travels in ``TE_COMPILE_PLANT``,
which the plugin sets and the ranks inherit)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

import te_compile as te
from te_compile.quantization import get_autocast_state

ENV = "TE_COMPILE_PLANT"


def _quantized() -> bool:
    state = get_autocast_state()
    return state.enabled and state.recipe is not None


def _recipe_is(name: str) -> bool:
    return _quantized() and type(get_autocast_state().recipe).__name__ == name


def _wrap_forward(cls: type, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    forward = cls.forward

    def planted(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if isinstance(out, tuple):
            return (change(out[0]), *out[1:])
        return change(out)

    cls.forward = planted


def _replace_everywhere(original: Callable, replacement: Callable) -> None:
    """``replacement`` for every module-level name bound to ``original`` in te_compile."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("te_compile") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


def _zero_nvfp4_mlp() -> None:
    """LayerNormMLP returns zeros under NVFP4 (and is right otherwise)."""
    _wrap_forward(te.LayerNormMLP, lambda y: y * 0 if _recipe_is("NVFP4BlockScaling") else y)


def _negate_linear() -> None:
    """Linear's output has the wrong sign, in every precision."""
    _wrap_forward(te.Linear, lambda y: -y)


def _linear_10_percent() -> None:
    """Linear's output is 10% too large under every quantised recipe."""
    _wrap_forward(te.Linear, lambda y: y * 1.1 if _quantized() else y)


def _linear_10_percent_mxfp8() -> None:
    """Linear's output is 10% too large under MXFP8 only."""
    _wrap_forward(te.Linear, lambda y: y * 1.1 if _recipe_is("MXFP8BlockScaling") else y)


def _mlp_branch_50_percent() -> None:
    """A quantised LayerNormMLP (TransformerLayer's MLP branch) is 50% too large."""
    _wrap_forward(te.LayerNormMLP, lambda y: y * 1.5 if _quantized() else y)


def _scale_2x() -> None:
    """The per-tensor scale from an amax is twice what it should be (the largest values of every
    current-scaled tensor saturate)."""
    from te_compile.functional import quantize

    original = quantize.scale_from_amax

    def planted(*args, **kwargs):
        return original(*args, **kwargs) * 2

    _replace_everywhere(original, planted)


def _grad_2x_on_rank_1() -> None:
    """A tensor-parallel Linear's weight gradient is twice too large on rank 1 only (a local
    shard, nothing communicated)."""
    init = te.Linear.__init__

    def planted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        group = kwargs.get("tp_group")
        if group is not None and torch.distributed.get_rank() == 1:
            self.weight.register_hook(lambda g: g * 2)

    te.Linear.__init__ = planted


PLANTS: dict[str, Callable[[], None]] = {
    "zero_nvfp4_mlp": _zero_nvfp4_mlp,
    "negate_linear": _negate_linear,
    "linear_10_percent": _linear_10_percent,
    "linear_10_percent_mxfp8": _linear_10_percent_mxfp8,
    "mlp_branch_50_percent": _mlp_branch_50_percent,
    "scale_2x": _scale_2x,
    "grad_2x_on_rank_1": _grad_2x_on_rank_1,
}


def apply_from_env() -> None:
    """Plant the bug named in ``TE_COMPILE_PLANT``, if any (a spawned rank's entry)."""
    name = os.environ.get(ENV)
    if name:
        PLANTS[name]()


def pytest_addoption(parser):
    parser.addoption("--plant", choices=sorted(PLANTS), help="the bug to plant (tests/mutation)")


def pytest_configure(config):
    name = config.getoption("--plant")
    if name:
        os.environ[ENV] = name
        PLANTS[name]()
