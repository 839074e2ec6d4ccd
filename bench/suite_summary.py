"""Summary of a GPU test-suite part (``bench/gpu_suite.sh``): reads the JUnit XML files the
part wrote under ``OUT`` and prints markdown: counts per run, every failure and error with the
first lines of its message, and the 30 slowest tests. Writes beside them ``durations_PART.tsv``:
the seconds of every test that took one or more (``seconds<TAB>classname::name``), what
``pytest --balance-by`` reads; ``bench/gpu_durations.tsv`` is the last full run's.

    python bench/suite_summary.py OUT PART
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RUNS = {"1": ["part1"], "2": ["part2", "long_cases", "long_runs"]}


def main(out: str, part: str) -> None:
    cases, lines = [], [f"# GPU test suite, part {part}", ""]
    lines += [
        "| run | passed | failed | errors | skipped | seconds |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in RUNS[part]:
        path = Path(out) / f"{run}.xml"
        if not path.exists():
            lines.append(f"| {run} | not run (no XML: stopped by the time limit?) | | | | |")
            continue
        suite = ET.parse(path).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        lines.append(
            f"| {run} | {n - f - e - s} | {f} | {e} | {s} | {float(suite.get('time', 0)):.0f} |"
        )
        for case in suite.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            cases.append((float(case.get("time", 0)), name, case))
    bad = [
        (name, c)
        for _, name, c in cases
        if c.find("failure") is not None or c.find("error") is not None
    ]
    lines += ["", f"## Failures and errors ({len(bad)})", ""]
    for name, c in bad:
        node = c.find("failure") if c.find("failure") is not None else c.find("error")
        message = (node.get("message") or "").strip().splitlines()[:3]
        lines.append(f"- `{name}`: " + " / ".join(m.strip() for m in message)[:300])
    slow = sorted((c for c in cases if c[0] >= 1.0), key=lambda x: -x[0])
    (Path(out) / f"durations_{part}.tsv").write_text("".join(f"{t:.1f}\t{n}\n" for t, n, _ in slow))
    lines += ["", "## The 30 slowest tests", "", "| seconds | test |", "| ---: | --- |"]
    for t, name, _ in sorted(cases, key=lambda x: -x[0])[:30]:
        lines.append(f"| {t:.1f} | `{name}` |")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:3])
