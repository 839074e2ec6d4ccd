"""The README's API tour runs as it stands: every Python block under "## API tour" is executed,
in a fresh interpreter each (the tour sets up a process group of its own), on the GPU when there
is one, else on the CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tour_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    tour = text.split("## API tour\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", tour, flags=re.DOTALL)


def test_the_tour_has_python_blocks():
    assert _tour_blocks(), "README.md: no ```python block under '## API tour'"


@pytest.mark.parametrize("index", range(len(_tour_blocks())))
def test_readme_api_tour_block_runs(index):
    block = _tour_blocks()[index]
    run = subprocess.run(
        [sys.executable, "-c", block], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"README API tour block {index} failed:\n{run.stderr[-4000:]}"
