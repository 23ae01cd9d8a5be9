"""Which path runs: the compiled fast path, or the pure-Python one.

A wheel built where there is a compiler holds C extensions (see
``hatch_build.py``): the binary protocol's struct codec
(``aioparamsync.wire._cbinary``) and the modules of the per-call path compiled
from their own source. Both paths answer the same, byte for byte; the test
suite runs on each.

``AIOPARAMSYNC_NO_EXT=1`` in the environment, when the package is first
imported, makes it run the pure-Python path even where the extensions are
there: the modules are imported from their ``.py`` sources and the compiled
codec is not installed. :func:`has_extension` says which path runs.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["NO_EXT", "compiled", "compiled_modules", "fast_path", "has_extension"]

NO_EXT = os.environ.get("AIOPARAMSYNC_NO_EXT", "").strip().lower() not in ("", "0", "false", "no")

_PACKAGE = __name__.rpartition(".")[0]
_EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


class _SourcesFirst(importlib.abc.MetaPathFinder):
    """Finds the package's modules by their ``.py`` source, not the extension beside it."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PACKAGE + ".") or not path:
            return None
        details = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, details).find_spec(fullname)
            if spec is not None:
                return spec
        return None  # (no source: the usual finders look, e.g. for wire._cbinary)


if NO_EXT and not any(isinstance(f, _SourcesFirst) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourcesFirst())


def compiled(name: str) -> ModuleType | None:
    """The extension module ``name`` (relative to the package), or None.

    None when the pure path is asked for, or when it was not built.
    """
    if NO_EXT:
        return None
    try:
        return importlib.import_module(f"{_PACKAGE}.{name}")
    except ImportError:
        return None


def compiled_modules() -> list[str]:
    """The package's modules loaded now that are extensions (compiled), by name."""
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith(_PACKAGE + ".")
        and (getattr(module, "__file__", None) or "").endswith(_EXTENSION_SUFFIXES)
    )


def has_extension() -> bool:
    """True where the compiled fast path runs (its binary codec is installed)."""
    from .wire import binary

    return binary.COMPILED


def fast_path() -> str:
    """Which path runs, as the node tells it (its info, its metric): compiled or pure."""
    return "compiled" if has_extension() else "pure"
