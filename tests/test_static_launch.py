"""Our Triton kernels under Inductor's static CUDA launcher.

Inductor launches the kernels of the te ops it traces through (user-defined Triton kernels, to
Inductor) with Triton's own launcher unless torch's ``static_launch_user_defined_triton_kernels``
is set; its static launcher takes less host time per launch, which a host-bound compiled FP8
step feels. ``import te_compile`` sets it unless the environment names it, and
``te.set_static_launch`` switches it (``docs/op_mechanism.md``). Inductor's compile workers
decide a kernel's launcher and read the option from the environment they start with, so the
switch is checked where the workers get it: the environment torch gives them (CPU cases), and a
compiled training step in a fresh process, whose Triton launches all go through the static
launcher (none through Triton's own, ``triton/backends/nvidia/driver.py``) with the output and
input gradient eager's, and all through Triton's once switched off (CUDA cases).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from te_compile.kernels import STATIC_LAUNCH_ENV
from tests.utils import requires_cuda

_ROOT = Path(__file__).resolve().parents[1]

_SWITCH = """
import sys
import torch._inductor.config as config
from torch._inductor.utils import python_subprocess_env
import te_compile as te
if sys.argv[1] != "import":
    te.set_static_launch(sys.argv[1] == "on")
worker = python_subprocess_env().get(sys.argv[2])
print("state", te.static_launch_enabled(), config.static_launch_user_defined_triton_kernels, worker)
"""


def _run(code: str, *args: str, env_value: str | None = None, **env: str) -> str:
    """The last ``state`` / ``launches`` line of ``code`` run in a fresh process, the static
    launch variable set to ``env_value`` (None: unset) before it starts."""
    env = {**os.environ, **env}
    env.pop(STATIC_LAUNCH_ENV, None)
    if env_value is not None:
        env[STATIC_LAUNCH_ENV] = env_value
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=_ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return [ln for ln in run.stdout.splitlines() if ln.startswith(("state", "launches"))][-1]


@pytest.mark.parametrize(
    "env_value, call, expected",
    [
        (None, "import", "True True 1"),  # on from the import
        ("0", "import", "False False 0"),  # the environment's choice is kept
        ("1", "import", "True True 1"),
        (None, "off", "False False 0"),
        # switched on: the workers follow; this process's config keeps the variable it was
        # imported with (torch gives the variable precedence over a set value)
        ("0", "on", "True False 1"),
    ],
)
def test_switch_reaches_the_compile_workers(env_value, call, expected):
    line = _run(_SWITCH, call, STATIC_LAUNCH_ENV, env_value=env_value)
    assert line == f"state {expected}"


_CHILD = """
import cProfile, pstats, sys
import torch
import te_compile as te
from tests.test_trace_through import HIDDEN, RECIPES, TOKENS, Block, _step
from tests.utils import assert_matches_eager

recipe, launcher = sys.argv[1:]
if launcher == "triton":
    te.set_static_launch(False)
torch.manual_seed(0)
model, twin = Block("cuda"), Block("cuda")
twin.load_state_dict(model.state_dict())
x = torch.randn(TOKENS, HIDDEN, device="cuda", requires_grad=True)
x_twin = x.detach().clone().requires_grad_()
compiled = torch.compile(model, fullgraph=True)
step, eager = _step(compiled, x, RECIPES[recipe]()), _step(twin, x_twin, RECIPES[recipe]())
for _ in range(2):  # compiles (delayed scaling: its calibration step, then the delayed graph)
    step()
    eager()
    x.grad = x_twin.grad = None
profile = cProfile.Profile()
out = profile.runcall(step)
torch.cuda.synchronize()
assert_matches_eager(out, eager(), roundings=4)
assert_matches_eager(x.grad, x_twin.grad, roundings=16)
calls = {"triton": 0, "static": 0}
for (path, _, name), row in pstats.Stats(profile).stats.items():
    if path.endswith("driver.py") and "nvidia" in path and name == "__call__":
        calls["triton"] += row[1]
    elif path.endswith("static_triton_launcher.py") and name == "run":
        calls["static"] += row[1]
print("launches", calls["triton"], calls["static"])
"""


@requires_cuda
@pytest.mark.parametrize("launcher", ["static", "triton"])
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_compiled_step_launcher(recipe, launcher, tmp_path):
    """By default (the import's setting) no launch of a compiled step goes through Triton's own
    launcher; switched off, ours do (Inductor's own kernels stay static)."""
    line = _run(_CHILD, recipe, launcher, TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    triton, static = map(int, line.split()[1:])
    assert static > 0, "no launch on Inductor's static launcher"
    if launcher == "static":
        assert triton == 0, f"{triton} launches of a compiled step on Triton's own launcher"
    else:
        assert triton > 0, "te.set_static_launch(False): no launch on Triton's own launcher"
