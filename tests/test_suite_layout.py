"""The suite's layout that `make test` relies on."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_triton_marked_tests_live_in_tests_kernels():
    """`make test` runs Triton's interpreter over tests/kernels only (collecting the whole tree a
    second time costs CI's run a quarter of a minute): a test marked ``triton`` elsewhere would
    never run on the CPU."""
    marked = {
        p.relative_to(TESTS).as_posix()
        for p in TESTS.rglob("*.py")
        if p.name != Path(__file__).name and re.search(r"mark\.triton\b", p.read_text())
    }
    assert marked, "no test is marked triton"
    assert all(m.startswith("kernels/") for m in marked), sorted(marked)
