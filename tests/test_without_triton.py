"""A plain install (no Triton) runs every module, recipe and op on CPU, forward and backward.

Triton is not a dependency of the package: only the code that launches a Triton kernel (CUDA
tensors, or the interpreter in tests) imports ``te_compile.kernels.<submodule>``. CI always has
Triton, so this test hides it: one subprocess blocks every ``triton`` import before importing
te_compile, then trains a step of every module and of ``te.ops.Sequential`` (GroupedLinear
included) under every recipe, and calls every registered op on its sample inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class _NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, _NoTriton())
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the blocker did not hide triton")

    import torch

    import te_compile as te
    from te_compile import _checks, ops

    _checks.cuda_is_default = lambda: False  # the modules below: on the CPU, as their inputs
    from te_compile._library import registry
    from tests.samples import SAMPLES
    from te_compile.recipe import (
        DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling,
        NVFP4BlockScaling,
    )

    RECIPES = {
        "none": None, "current": Float8CurrentScaling(), "delayed": DelayedScaling(),
        "block": Float8BlockScaling(), "mxfp8": MXFP8BlockScaling(),
        "nvfp4": NVFP4BlockScaling(),
    }
    H, TOKENS = 32, 32
    SPLITS = torch.tensor([16, 0, 16])  # NVFP4's grouped GEMMs: multiples of 16 per group
    MODULES = {
        "Linear": lambda: te.Linear(H, H),
        "LayerNormLinear": lambda: te.LayerNormLinear(H, H),
        "LayerNormMLP": lambda: te.LayerNormMLP(H, 2 * H),
        "LayerNorm": lambda: te.LayerNorm(H),
        "RMSNorm": lambda: te.RMSNorm(H),
        "GroupedLinear": lambda: te.GroupedLinear(3, H, H),
        "GroupedMLP": lambda: te.GroupedMLP(3, H, H),
        "ops.Sequential": lambda: ops.Sequential(
            ops.LayerNorm(H), ops.BasicLinear(H, 2 * H), ops.Bias(2 * H), ops.SwiGLU(),
            ops.GroupedLinear(3, H, H),
        ),
    }
    GROUPED = ("GroupedLinear", "GroupedMLP", "ops.Sequential")
    GROUPED_NVFP4 = NVFP4BlockScaling()  # its Hadamard transform and stochastic rounding too

    failures = []
    for recipe_name, recipe in RECIPES.items():
        for name, make in MODULES.items():
            try:
                torch.manual_seed(0)
                module = make()
                x = torch.randn(TOKENS, H, requires_grad=True)
                grouped_nvfp4 = name in GROUPED and recipe_name == "nvfp4"
                rec = GROUPED_NVFP4 if grouped_nvfp4 else recipe
                with te.autocast(enabled=recipe is not None, recipe=rec):
                    y = module(x, SPLITS) if name in GROUPED else module(x)
                y.float().square().sum().backward()
                grads = [x.grad] + [p.grad for p in module.parameters()]
                assert all(g is not None and torch.isfinite(g).all() for g in grads), "grads"
                assert torch.isfinite(y).all(), "output"
            except Exception as e:
                failures.append(f"{name} under {recipe_name}: {e!r}")

    for op_name, entry in sorted(registry().items()):
        for sample in SAMPLES[op_name](torch.device("cpu")) if op_name in SAMPLES else ():
            try:
                call = entry.differentiable or entry.overload
                out = call(*sample.args, **sample.kwargs)
                first = out[0] if isinstance(out, (tuple, list)) and out else out
                if entry.differentiable is not None and first.requires_grad:
                    first.backward(torch.ones_like(first))
            except Exception as e:
                failures.append(f"{op_name}: {e!r}")

    imported = sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))
    assert not imported, imported
    print("\\n".join(failures) if failures else "OK")
    """
)


def test_every_module_recipe_and_op_runs_on_cpu_without_triton():
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("TRITON_INTERPRET", None)
    # A CPU machine: on a GPU host, modules would default to the GPU, where Triton is needed.
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=root, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1:] == ["OK"], result.stdout[-4000:]
