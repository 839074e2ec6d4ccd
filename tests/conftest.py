from collections import Counter

import pytest
import torch
import torch._dynamo


def pytest_configure(config):
    """Every recompilation logs its reason (the guard that failed): pytest shows it with the
    captured output of a test that fails on a frame count, passing tests stay quiet."""
    torch._logging.set_logs(recompiles=True)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Each test starts from a clean dynamo cache and a fixed seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield


def pytest_terminal_summary(terminalreporter):
    """Skips folded by reason: a few lines above the result line, not one per test site.

    Failures and errors keep pytest's own short summary (``-rfE`` in pyproject.toml)."""
    reasons = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.section("skips by reason", sep="-")
        for reason, count in reasons.most_common():
            terminalreporter.line(f"{count:6d}  {reason}")
