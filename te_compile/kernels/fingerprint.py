"""The source digest of te_compile in AOTAutograd's cache key.

AOTAutograd's cache keys a graph that calls a traced-through op on the sources of the op's
Triton kernels (``_library``'s table of them), not on the Python that the op runs to launch
them: without more, a graph cached by one te_compile would be reused by another whose op
implementations differ (an upgrade, an edit), with the old code's kernels and launches.
:data:`SOURCE` holds a digest of every ``.py`` file of the package, and :func:`_te_compile_source`
names it: the cache key takes in a kernel's source with the values of the globals it names, so
the digest becomes part of every key. The kernel is never launched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import triton

SOURCE = ""  # set by ``digest_sources`` before the first key is computed


@triton.jit
def _te_compile_source():
    SOURCE  # noqa: B018  (named for the cache key only)


def digest_sources(root: Path | None = None) -> str:
    """Set :data:`SOURCE` to the sha256 of the Python sources (paths and contents) of the
    package at ``root`` (default: this te_compile) and return it."""
    global SOURCE
    root = Path(__file__).resolve().parents[1] if root is None else root
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    SOURCE = h.hexdigest()
    return SOURCE
