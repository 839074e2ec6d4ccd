"""The suite's layout that `make test` relies on."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

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


class _Node:
    """A stand-in for xdist's WorkerController: records the test indices it is sent."""

    shutting_down = False

    def __init__(self, i):
        self.gateway = SimpleNamespace(id=f"gw{i}")
        self.sent = []

    def send_runtest_some(self, indices):
        self.sent += indices


def test_balance_by_gives_each_worker_an_equal_share_of_the_seconds():
    """``pytest --balance-by`` (bench/gpu_suite.sh): fed the reordered collection, xdist's own
    worksteal scheduler hands every worker a first share whose known seconds are within the
    longest test of each other's, longest first; every test is dealt exactly once."""
    from xdist.scheduler import WorkStealingScheduling

    from tests.conftest import _balance, _junit_name

    workers = 4
    items = [SimpleNamespace(nodeid=f"tests/a/test_x.py::test_{i}[p{i}]") for i in range(103)]
    # Long tests bunched at the start, as collection order puts one file's compiles together.
    seconds = {_junit_name(it): 300.0 - 10 * i for i, it in enumerate(items[:12])}
    assert _junit_name(items[0]) == "tests.a.test_x::test_0[p0]"
    order = list(items)
    _balance(order, seconds, workers)
    assert sorted(it.nodeid for it in order) == sorted(it.nodeid for it in items)

    sched = WorkStealingScheduling(SimpleNamespace(getvalue=lambda k: [f"{workers}*popen"]))
    nodes = [_Node(i) for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, [it.nodeid for it in order])
    sched.schedule()
    loads = []
    for node in nodes:
        share = [seconds.get(_junit_name(order[i]), 1.0) for i in node.sent]
        assert share == sorted(share, reverse=True)
        loads.append(sum(share))
    assert sum(len(n.sent) for n in nodes) == len(items)
    assert max(loads) - min(loads) <= 300.0, loads
    # Unbalanced, the first worker would get every long test.
    assert max(loads) < sum(seconds.values()) / 2


def test_cpu_only_marks_exactly_the_part1_files_that_never_name_cuda(tmp_path):
    """``cpu_only`` (the GPU suite leaves those tests to CI): a part 1 file that names CUDA in
    any of the ways the suite selects a GPU is not marked, whatever the case; one that does not
    is; files outside part 1's directories never are (their examples pick a GPU themselves)."""
    from tests.conftest import cpu_only_file

    assert cpu_only_file(TESTS / "modules" / "test_zero_tokens.py")
    assert not cpu_only_file(TESTS / "functional" / "test_linear.py")
    assert not cpu_only_file(TESTS / "test_examples.py")
    modules = tmp_path / "modules"
    modules.mkdir()
    body = "def test_x():\n    x = torch.ones(2{})\n"
    for i, names_cuda in enumerate(
        ("", ', device="cuda"', ", device=DEVICES[1]", ", device=TRITON_DEVICE", ").CUDA(")
    ):
        path = modules / f"test_{i}.py"
        path.write_text(("@requires_cuda\n" if i == 0 else "") + body.format(names_cuda))
        assert cpu_only_file(path) is False, path.read_text()
    plain = modules / "test_plain.py"
    plain.write_text(body.format(", dtype=torch.float64"))
    assert cpu_only_file(plain)
