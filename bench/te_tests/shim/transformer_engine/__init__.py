"""A stand-in ``transformer_engine`` package that runs Transformer Engine's PyTorch tests
against ``te_compile`` (issue 44's measure; see ``bench/te_tests/README.md``).

Importing it installs a meta-path finder that maps

- ``transformer_engine.pytorch`` and its submodules onto ``te_compile`` and its submodules
  (``transformer_engine.pytorch.ops`` is a view of ``te_compile.ops``, ...),
- ``transformer_engine.common.recipe`` onto ``te_compile.common.recipe``,
- ``transformer_engine_torch`` (TE's C++ extension) onto a module of stubs, but for the
  queries in :data:`ENVIRONMENT` (facts about this machine, never a computed result).

A name te_compile lacks resolves to a stub: calling, instantiating, iterating or indexing it
raises :class:`ShimMissing` naming it, so every test failure through a TE internal can be told
apart from a failure of te_compile. Test-side helpers the tests import from the library are
registered in :data:`STANDINS` (by bare name, consulted before te_compile) by the conftest.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["COLLECTING", "ENVIRONMENT", "STANDINS", "ShimMissing", "stub"]

#: True while pytest collects (set by the conftest): a stub called then, at module level or in
#: a parameter list, gives a placeholder that raises ShimMissing when used, so collection goes
#: on and the tests that use it fail by name.
COLLECTING = False

#: Names (bare, e.g. ``"Float8Quantizer"``) that resolve to the given object in every
#: ``transformer_engine.pytorch`` module, before te_compile is consulted.
STANDINS: dict[str, object] = {}

#: ``transformer_engine_torch`` functions whose answer is a fact about the environment the tests
#: run in: no CUDA library here, so no cuBLASLt (version 0, as a version below every minimum;
#: the tests of TE's cuBLASLt grouped GEMM then skip for their cuBLAS requirement).
ENVIRONMENT: dict[str, object] = {"get_cublasLt_version": lambda: 0}

_TE = "transformer_engine"
_PT = "transformer_engine.pytorch"
_TEX = "transformer_engine_torch"


class ShimMissing(RuntimeError):
    """A Transformer Engine internal te_compile does not have was used."""


def _missing(name: str) -> ShimMissing:
    return ShimMissing(f"shim: {name} is a TE internal te_compile lacks")


class _StubMeta(type):
    """Metaclass of the stubs: a stub is a class (tests subclass TE classes and use them in
    ``isinstance``) that raises :class:`ShimMissing` when used."""

    def __call__(cls, *args, **kwargs):
        if cls.__dict__.get("_shim_stub", False):
            if COLLECTING:
                return _Placeholder(cls._shim_name)
            raise _missing(cls._shim_name)
        return super().__call__(*args, **kwargs)

    def __getattr__(cls, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return stub(f"{cls._shim_name}.{attr}")

    def __iter__(cls):
        raise _missing(cls._shim_name)

    def __len__(cls):
        raise _missing(cls._shim_name)

    def __getitem__(cls, key):
        raise _missing(cls._shim_name)

    def __setitem__(cls, key, value):
        raise _missing(cls._shim_name)

    def __contains__(cls, item):
        raise _missing(cls._shim_name)

    def __enter__(cls):
        raise _missing(cls._shim_name)

    def __exit__(cls, *exc):
        return False


class _Placeholder:
    """What a stub called during collection gives: raises ShimMissing when used."""

    def __init__(self, name: str):
        object.__setattr__(self, "_shim_name", name)

    def __repr__(self):
        return f"shim-placeholder({self._shim_name})"

    def __getattr__(self, attr):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise _missing(f"{self._shim_name}(...).{attr}")

    def __setattr__(self, attr, value):
        raise _missing(f"{self._shim_name}(...).{attr}")

    def __call__(self, *args, **kwargs):
        raise _missing(f"{self._shim_name}(...)")

    def __iter__(self):
        raise _missing(f"{self._shim_name}(...)")

    def __getitem__(self, key):
        raise _missing(f"{self._shim_name}(...)")


_STUBS: dict[str, type] = {}


def stub(name: str) -> type:
    """The stub standing for the TE name ``name`` (one object per name)."""
    if name not in _STUBS:
        short = name.rsplit(".", 1)[-1]
        _STUBS[name] = _StubMeta(short, (), {"_shim_stub": True, "_shim_name": name})
    return _STUBS[name]


def _stub_module(fullname: str) -> types.ModuleType:
    mod = types.ModuleType(fullname)
    mod.__path__ = []  # a package: deeper submodules resolve too

    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        if attr in STANDINS:
            return STANDINS[attr]
        if fullname == _TEX and attr in ENVIRONMENT:
            return ENVIRONMENT[attr]
        return stub(f"{fullname}.{attr}")

    mod.__getattr__ = __getattr__
    mod.__shim_stub__ = True
    return mod


def _proxy_module(fullname: str, target: types.ModuleType) -> types.ModuleType:
    """A module named ``fullname`` whose attributes are ``target``'s, stand-ins first; a
    submodule of ``target`` comes back as its own proxy, a missing name as a stub."""
    mod = types.ModuleType(fullname, getattr(target, "__doc__", None))
    mod.__path__ = []
    mod.__shim_target__ = target

    def __getattr__(attr: str):
        if attr in STANDINS:
            return STANDINS[attr]
        if attr.startswith("__") and attr.endswith("__"):
            return getattr(target, attr)
        try:
            value = getattr(target, attr)
        except AttributeError:
            try:  # a submodule not yet imported
                importlib.import_module(f"{target.__name__}.{attr}")
                value = getattr(target, attr)
            except ImportError:
                return stub(f"{fullname}.{attr}")
        if isinstance(value, types.ModuleType) and value.__name__.startswith(target.__name__ + "."):
            return importlib.import_module(f"{fullname}.{value.__name__.rsplit('.', 1)[-1]}")
        return value

    def __dir__():
        return sorted(set(dir(target)) | set(STANDINS))

    mod.__getattr__ = __getattr__
    mod.__dir__ = __dir__
    return mod


def _target_name(fullname: str) -> str | None:
    if fullname == _PT:
        return "te_compile"
    if fullname.startswith(_PT + "."):
        return "te_compile" + fullname[len(_PT) :]
    if fullname == f"{_TE}.common" or fullname.startswith(f"{_TE}.common."):
        return "te_compile.common" + fullname[len(f"{_TE}.common") :]
    return None


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        fullname = spec.name
        target = _target_name(fullname)
        if target is not None:
            try:
                return _proxy_module(fullname, importlib.import_module(target))
            except ImportError as exc:
                # only "te_compile has no such module" is a stub; a broken import is an error
                missing = getattr(exc, "name", None)
                if missing is None or not target.startswith(missing):
                    raise
        return _stub_module(fullname)

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _TEX or _target_name(fullname) is not None:
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())


def __getattr__(attr: str):
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    if attr in ("pytorch", "common"):
        return importlib.import_module(f"{_TE}.{attr}")
    return stub(f"{_TE}.{attr}")
