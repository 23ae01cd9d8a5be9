"""Which path runs: the compiled fast path, or the pure-Python one.

A wheel built where there is a compiler holds C extensions (see
``hatch_build.py``): the binary protocol's struct codec
(``aioparamsync.wire._cbinary``), and any module it lists to compile from its
own source. Both paths answer the same, byte for byte; the test
suite runs on each.

``AIOPARAMSYNC_NO_EXT=1`` in the environment, when the package is first
imported, makes it run the pure-Python path even where the extensions are
there: the modules are imported from their ``.py`` sources and the compiled
codec is not installed. :func:`has_extension` says which path runs.

Run from a source tree (a checkout, where ``hatch_build.py`` is beside the
package), no extension module beside the sources is trusted: a build never puts
one there, so one found there was left by an older build, compiled from older
sources. The compiled modules of an editable install (``pip install -e .``) are
in site-packages instead, in ``_aioparamsync_compiled/``, with a manifest of
the tree and the sources they were compiled from; each is loaded only while
its source is unchanged. One edited (or changed by a ``git pull``) since
is imported from its source, with a warning, until ``pip install -e .``
compiles it again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["NO_EXT", "compiled", "compiled_modules", "fast_path", "has_extension"]

NO_EXT = os.environ.get("AIOPARAMSYNC_NO_EXT", "").strip().lower() not in ("", "0", "false", "no")

_PACKAGE = __name__.rpartition(".")[0]
_EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
# The package's directory; in a source tree, hatch_build.py is beside it.
_HERE = Path(__file__).resolve().parent
IN_SOURCE_TREE = (_HERE.parent / "hatch_build.py").is_file()
# Where an editable install keeps its extensions, in site-packages (hatch_build.EDITABLE_DIR).
EDITABLE_DIR = "_aioparamsync_compiled"
MANIFEST = "manifest.json"


class StaleExtensionWarning(RuntimeWarning):
    """A compiled module of an editable install is older than its source: the source runs."""


def _manifest(warn: bool) -> dict[str, tuple[Path, Path, str]]:
    """The editable install's manifest for this tree: each module's extension, source, hash.

    The first on ``sys.path`` made for this tree (others are other checkouts'); one
    that cannot be read is ignored, with a warning.
    """
    for entry in sys.path:
        path = Path(entry or ".") / EDITABLE_DIR / MANIFEST
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_text())
            if Path(content["tree"]) != _HERE.parent:
                continue
            return {
                name: (path.parent / m["extension"], _HERE.parent / m["source"], str(m["sha256"]))
                for name, m in dict(content["modules"]).items()
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if warn:
                warnings.warn(
                    f"aioparamsync: {path} cannot be read ({type(exc).__name__}: {exc}); "
                    "the compiled modules of the editable install are not used",
                    StaleExtensionWarning,
                    stacklevel=4,
                )
    return {}


def _editable_extensions(warn: bool) -> dict[str, str]:
    """The editable install's extensions for this tree whose source is unchanged, by module.

    Leaves out (warning, with ``warn``) those whose source changed since they were
    compiled, or whose file is missing.
    """
    fresh, stale = {}, []
    for name, (extension, source, digest) in sorted(_manifest(warn).items()):
        try:
            same = hashlib.sha256(source.read_bytes()).hexdigest() == digest
        except OSError:
            same = False
        if same and extension.is_file():
            fresh[name] = str(extension)
        else:
            stale.append(name)
    if stale and warn:
        warnings.warn(
            "aioparamsync: changed since `pip install -e .` compiled them, these modules "
            f"run from their sources (slower) until it compiles them again: {', '.join(stale)}",
            StaleExtensionWarning,
            stacklevel=3,
        )
    return fresh


class _SourcesFirst(importlib.abc.MetaPathFinder):
    """Finds the package's modules by their ``.py`` source, not an extension beside it.

    Those in ``compiled`` (an editable install's, unchanged since) are loaded from
    their extension instead, unless the pure path is asked for; in a source tree,
    a module with neither is not found (an extension beside it is a stale one).
    """

    def __init__(self, compiled: dict[str, str], strict: bool) -> None:
        self.compiled = compiled
        self.strict = strict

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PACKAGE + ".") or not path:
            return None
        if fullname in self.compiled and not NO_EXT:
            return self._compiled(fullname)
        details = (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES)
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, details).find_spec(fullname)
            if spec is not None:
                return spec
        if fullname in self.compiled:  # (no source: wire._cbinary, asked for by name)
            return self._compiled(fullname)
        if self.strict:
            message = f"no module named {fullname!r} built for this tree"
            raise ModuleNotFoundError(message, name=fullname)
        return None  # (no source: the usual finders look, e.g. for wire._cbinary)

    def _compiled(self, fullname: str) -> importlib.machinery.ModuleSpec:
        location = self.compiled[fullname]
        loader = importlib.machinery.ExtensionFileLoader(fullname, location)
        spec = importlib.util.spec_from_file_location(fullname, location, loader=loader)
        assert spec is not None  # (a loader is given)
        return spec


if (NO_EXT or IN_SOURCE_TREE) and not any(isinstance(f, _SourcesFirst) for f in sys.meta_path):
    _finder = _SourcesFirst(_editable_extensions(warn=not NO_EXT), strict=IN_SOURCE_TREE)
    sys.meta_path.insert(0, _finder)


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
