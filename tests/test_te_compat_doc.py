"""docs/te_compat.md stays honest: every Transformer Engine name it marks "same" or "same with
differences" exists on ``te_compile`` at the path its second column gives, and every name it marks
"missing" does not exist on ``te_compile`` under Transformer Engine's path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import te_compile

DOC = Path(__file__).resolve().parent.parent / "docs" / "te_compat.md"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*(`[^`]+`|—)\s*\|\s*(.+?)\s*\|\s*$")
STATUSES = ("same with differences: ", "missing: ", "same")


def _rows() -> list[tuple[str, str | None, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            te_name, ours, status = m.groups()
            rows.append((te_name, None if ours == "—" else ours.strip("`"), status))
    return rows


ROWS = _rows()


def _resolve(path: str) -> bool:
    obj = te_compile
    for part in path.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def test_table_is_well_formed():
    assert len(ROWS) > 100
    names = [r[0] for r in ROWS]
    assert len(names) == len(set(names)), "a Transformer Engine name has two rows"
    for te_name, ours, status in ROWS:
        assert status == "same" or status.startswith(STATUSES[:2]), (te_name, status)
        if status.startswith("missing"):
            assert ours is None, f"{te_name}: missing but names {ours}"
        else:
            assert ours is not None, f"{te_name}: {status!r} needs a te_compile path"


@pytest.mark.parametrize(("te_name", "ours", "status"), ROWS, ids=[r[0] for r in ROWS])
def test_row_matches_package(te_name, ours, status):
    if status.startswith("missing"):
        assert not _resolve(te_name), f"te_compile.{te_name} exists but the table says missing"
    else:
        assert _resolve(ours), f"te_compile.{ours} does not exist but the table says {status!r}"


def test_recipes_import_by_transformer_engines_path():
    """``from transformer_engine.common import recipe`` has its counterpart: the same classes."""
    import importlib

    from te_compile.common import recipe

    module = importlib.import_module("te_compile.common.recipe")
    for name in te_compile.recipe.__all__:
        assert getattr(recipe, name) is getattr(te_compile.recipe, name)
        assert getattr(module, name) is getattr(te_compile.recipe, name)
