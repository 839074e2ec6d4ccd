"""Loads ``te_compile._C``, the compiled extension whose import registers the C++ ``te::`` ops.

The extension has no Python functions; loading the shared library runs its
``TORCH_LIBRARY_FRAGMENT(te, m)`` registrations, after which the ops are reachable as
``torch.ops.te.<name>``. Modules that wrap a C++ op call :func:`load` before touching it.
"""

from __future__ import annotations

import importlib

import torch  # noqa: F401  (libtorch must be loaded before the extension that links to it)

_loaded = False


def load() -> None:
    """Import ``te_compile._C`` once; a clear ImportError if it is missing or does not load."""
    global _loaded
    if _loaded:
        return
    try:
        importlib.import_module("te_compile._C")
    except ImportError as e:
        raise ImportError(
            "te_compile's C++ extension te_compile._C is not built, or was built against another "
            "torch than the one installed. Build it from the repository root with:\n"
            "    pip install -e . --no-build-isolation\n"
            f"(original error: {e})"
        ) from e
    _loaded = True
