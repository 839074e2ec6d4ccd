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


_TOL = re.compile(r"\b[ra]tol=(?!0\b)[-\w.*]+")


def test_tolerance_literals_come_from_tests_utils_or_say_why():
    """No ``rtol=`` / ``atol=`` with a value other than ``0`` outside tests/utils without a
    ``# tol:`` comment on its line or the three above (a call split over lines) saying why it is
    not from the helpers
    (``dtype_tols`` / ``assert_close`` / ``assert_close_sum`` / ``assert_matches_eager``).
    Exact comparisons (``rtol=0, atol=0``) and a name (``**tols``, ``rtol=tol``) pass; ``0``
    must be the whole value. A ``rel=`` of ``pytest.approx`` is not covered."""
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel.startswith("utils/") or path.name == Path(__file__).name:
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            literals = [m for m in _TOL.findall(line) if re.search(r"\d", m.split("=")[1])]
            if literals and not any("# tol:" in lines[j] for j in range(max(0, i - 3), i + 1)):
                bad.append(f"{rel}:{i + 1}: {line.strip()}")
    assert not bad, "tolerance literals without '# tol:'\n" + "\n".join(bad)
