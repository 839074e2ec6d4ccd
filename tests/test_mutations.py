"""The suite catches planted bugs: each case plants one small, realistic bug
(:mod:`tests.mutation.plant`) through the public modules, runs the existing tests that should
catch it in a subprocess, and asserts that every one of them fails with an assertion (not an
import error or a crash) while nothing was skipped.

The bugs: a zeroed output (LayerNormMLP under NVFP4 only), a sign flip (Linear), a 10% error of
a quantised output (Linear under each quantised recipe; under NVFP4, whose own bias reaches 8%
(``tests.utils.QUANTIZED_GAIN``), caught against the product of the quantised operands), a 50%
error in TransformerLayer's FP8 MLP branch, a wrong scale in the per-tensor quantiser (twice
the scale from the amax), and a weight gradient twice too large on rank 1 of a tensor-parallel
Linear. The unplanted suite runs these tests and passes, so a failure here is the plant's."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EDGE = "tests/test_edge_values.py"
NVFP4 = (
    "tests/modules/test_fp8_linear_module.py"
    "::test_nvfp4_forward_is_the_gemm_of_the_quantised_operands"
)

# plant -> the existing tests that must each fail with it.
CASES = {
    "zero_nvfp4_mlp": ["tests/fuzz/test_modules.py::test_layernorm_mlp"],
    "negate_linear": [
        f"{EDGE}::test_single_token[Linear-none]",
        "tests/modules/test_linear.py::test_matches_nn_linear_state_dict_compatible[dtype0-cpu]",
    ],
    "linear_10_percent": [
        # (a single token's 32 outputs are too few to tell 10% from quantisation noise)
        f"{EDGE}::test_values_at_the_dtype_max_pass_a_module_finite[Linear-current-fp32-cpu]",
        f"{EDGE}::test_delayed_scaling_saturates_in_a_module_forward_and_backward",
        f"{EDGE}::test_values_at_the_dtype_max_pass_a_module_finite[Linear-block-fp32-cpu]",
        # NVFP4: against the product of the quantised operands, not the format's own error
        f"{NVFP4}[Linear-2d_weight-cpu]",
        f"{NVFP4}[Linear-1d_weight-cpu]",
    ],
    # MXFP8 takes whole blocks of 32 tokens: its Linear is checked by the fuzz.
    "linear_10_percent_mxfp8": ["tests/fuzz/test_modules.py::test_linear"],
    "mlp_branch_50_percent": [
        f"{EDGE}::test_single_token[TransformerLayer-current]",
        f"{EDGE}::test_single_token[TransformerLayer-delayed]",
    ],
    "scale_2x": [
        f"{EDGE}::test_single_token[Linear-current]",
        f"{EDGE}::test_single_token[LayerNormMLP-current]",
    ],
    "grad_2x_on_rank_1": [
        "tests/distributed/test_tensor_parallel.py::test_matches_single_process[linear_column-gloo]",
    ],
}


@pytest.mark.parametrize("plant", sorted(CASES))
def test_planted_bug_fails_the_tests_that_cover_it(plant, tmp_path):
    report = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-p", "tests.mutation.plant", f"--plant={plant}", f"--junitxml={report}",
               "--fuzz-profile=mutation",
               *CASES[plant]]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
        failure = case.find("failure")
        results[name] = (
            "failed" if failure is not None else "error" if case.find("error") is not None
            else "skipped" if case.find("skipped") is not None else "passed",
            "" if failure is None else (failure.get("message") or "") + (failure.text or ""),
        )  # fmt: skip
    assert sorted(results) == sorted(CASES[plant]), (sorted(results), run.stdout[-2000:])
    for name, (outcome, message) in results.items():
        assert outcome == "failed", f"{plant}: {name} {outcome} with the bug planted"
        assert "AssertionError" in message, f"{plant}: {name} failed otherwise: {message[-1500:]}"
