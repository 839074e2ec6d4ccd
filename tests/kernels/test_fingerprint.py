"""AOTAutograd's cache key covers te_compile's Python sources, not only its Triton kernels'
(``te_compile.kernels.fingerprint``): a graph cached by one te_compile is not reused by
another whose op implementations differ."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import te_compile

pytest.importorskip("triton")  # the key is built from Triton kernel objects


def test_the_cache_key_source_of_the_trace_through_kernels_holds_the_package_digest():
    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code as key_source,
    )

    from te_compile._library import _trace_through_kernels
    from te_compile.kernels import fingerprint

    kernels = _trace_through_kernels()
    marker = [k for k in kernels if k is fingerprint._te_compile_source]
    assert len(marker) == 1
    set_by_the_table = fingerprint.SOURCE  # set when the kernel table was built
    assert set_by_the_table == fingerprint.digest_sources()
    assert len(set_by_the_table) == 64
    assert f"SOURCE = {set_by_the_table!r}" in key_source(marker[0])


def test_the_digest_changes_with_any_source_file(tmp_path):
    from te_compile.kernels.fingerprint import digest_sources

    package = Path(te_compile.__file__).parent
    copy = tmp_path / "te_compile"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    before = digest_sources(copy)
    assert digest_sources(copy) == before  # deterministic
    impl = copy / "functional" / "linear_impl.py"
    impl.write_text(impl.read_text() + "\n# an edit\n")
    assert digest_sources(copy) != before
    edited = digest_sources(copy)
    (copy / "functional" / "new_module.py").write_text("")
    assert digest_sources(copy) not in (before, edited)
    digest_sources()  # restore this package's digest
