"""Our Triton kernels under Inductor's static CUDA launcher (CUDA).

Inductor launches the kernels of the te ops it traces through (user-defined Triton kernels, to
Inductor) with Triton's own launcher unless ``torch._inductor.config.
static_launch_user_defined_triton_kernels`` is set; its static launcher takes less host time
per launch, which a host-bound compiled FP8 step feels (``docs/fp8.md``, "Limits"). Inductor's
compile workers decide a kernel's launcher, and they read the option from the environment
(``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1``): set in a running process it
does not reach them. So the case compiles in a fresh process with the variable set, and checks
there that every Triton launch of a compiled training step goes through the static launcher (no
call of Triton's own, ``triton/backends/nvidia/driver.py``) and that the step's output and
input gradient are eager's, as ``tests/test_trace_through.py`` checks them under the default
launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import requires_cuda

_CHILD = """
import cProfile, pstats, sys
import torch
from tests.test_trace_through import HIDDEN, RECIPES, TOKENS, Block, _step
from tests.utils import assert_matches_eager

recipe = sys.argv[1]
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
@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_compiled_step_runs_on_the_static_launcher(recipe, tmp_path):
    env = dict(os.environ, TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS="1",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path))  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _CHILD, recipe], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("launches")][-1]
    triton, static = map(int, line.split()[1:])
    assert triton == 0, f"{triton} launches of a compiled step on Triton's own launcher"
    assert static > 0, "no launch on Inductor's static launcher"
