"""The library's size rule: files split by responsibility, none over 800 lines."""

from __future__ import annotations

from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "te_compile"
MAX_LINES = 800


def test_no_library_file_over_800_lines():
    """A file that outgrows 800 lines holds more than one responsibility: split it (as
    ``kernels/fp8_scaling.py`` left ``kernels/quantize.py``) rather than let it grow."""
    sizes = {
        p.relative_to(LIBRARY).as_posix(): len(p.read_text().splitlines())
        for p in LIBRARY.rglob("*.py")
    }
    assert len(sizes) > 50, "te_compile's sources not found"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
