"""The compiled fast path, built with the wheel (a hatchling build hook).

What is compiled (with Cython, into C extensions):

* ``aioparamsync/wire/_cbinary.pyx``: the binary protocol's struct reader and
  writer, written for C (``aioparamsync.wire.binary`` uses it when present);
* ``aioparamsync/values/_crows.pyx``: the embedding rows' hashes, index lookup
  and row copy (``aioparamsync.values.rowindex`` and ``.rowcopy`` use it when
  present), and ``_crowfold.pyx`` beside it: the row rules' folds
  (``aioparamsync.values.rows`` and ``aioparamsync.store.rows``);
* ``aioparamsync/values/_cfold.pyx``: the training rules' arithmetic, one pass
  a fold (``aioparamsync.values.rules`` uses it when present);
* ``aioparamsync/_cblocks.pyx``: large blocks of memory kept for reuse once let go
  (the new arrays of a fold of a large tensor: ``aioparamsync.blocks``);
* ``aioparamsync/store/_centry.pyx``: a store's entries made by writing their slots
  (the new entries of a push's compiled fold: ``aioparamsync.store.table``);
* ``aioparamsync/values/_cpacking.pyx``: a push's blocks made gradients and a read's
  small tensors packed (the loops of ``aioparamsync.values.packing``);
* ``aioparamsync/server/_csmall.pyx``: small calls (a read, a founding client's update)
  answered whole, from the request's bytes to the reply's (``aioparamsync.server.smallcalls``);
* the modules in ``COMPILED_MODULES``, compiled from their Python source as
  they are: the same code, without the interpreter's dispatch (an extension
  module is imported in place of the ``.py`` beside it). None today: measured,
  none gained enough to pay for its compile (the figures are beside the list).

Out of tree: nothing is ever written beside the sources. Each module is
compiled in a temporary directory, several at a time, and the extension is kept
in ``build/aioparamsync-ext/`` under a key of all it was made from (its source,
this file, the versions of Cython and Python, the compiler's variables), so that
the next install (``pip install '.[torch]'`` after ``pip install .``) compiles
only what changed. The wheel takes the extensions by ``force_include``: in the
installed package, beside their sources. An editable install
(``pip install -e .``) puts them in ``_aioparamsync_compiled/`` in
site-packages, with a manifest of the sources they were compiled from;
``aioparamsync/_ext.py`` loads one only while its source is unchanged, and
warns and runs the source once it is edited (or pulled), until
``pip install -e .`` compiles it again.

Each step is a line on stderr, which pip shows with ``-v`` (without it, pip
shows its spinner, and all of the output only when the build fails).

The build never fails for want of a compiler: a failed compile warns, and the
wheel is the pure-Python one (everything works, more slowly).
``AIOPARAMSYNC_REQUIRE_EXT=1`` makes a failed compile fatal (``.ci/run`` and the
image's Dockerfile set it); ``AIOPARAMSYNC_NO_EXT=1`` skips the compile (and, at
run time, makes the package ignore extensions that are there: see
``aioparamsync/_ext.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# Modules compiled from their Python source, as they are (Cython's "pure Python" mode;
# a compiled coroutine function is one to inspect.iscoroutinefunction, its signature and
# docstring kept). None, as measured: benchmarks/bench_percall.py (CPU per call, best of
# 40 x 100 rounds, 8 connections, 4 KiB and 64 B parameters) ran as fast with the 15
# modules of the per-call path (wire, values.arrays, store, server, client) all left as
# Python as with all of them compiled: 0.95-1.02x on each side of each call. One at a time,
# most moved a figure by less than 7%, as much as modules of the server moved the client's
# (noise). The codec below alone makes the compiled path 1.11-1.22x faster than the pure
# one. A module goes here when such a figure shows it gains 10% or more.
COMPILED_MODULES: list[str] = []
# Written for Cython.
CYTHON_MODULES = [
    "aioparamsync/wire/_cbinary.pyx",
    "aioparamsync/values/_crows.pyx",
    "aioparamsync/values/_crowfold.pyx",
    "aioparamsync/values/_cfold.pyx",
    "aioparamsync/_cblocks.pyx",
    "aioparamsync/store/_centry.pyx",
    "aioparamsync/values/_cpacking.pyx",
    "aioparamsync/server/_csmall.pyx",
]

# Where extensions are kept between builds, under the project's root.
CACHE = Path("build", "aioparamsync-ext")
# Where an editable install puts them, in site-packages (aioparamsync/_ext.py looks there).
EDITABLE_DIR = "_aioparamsync_compiled"
MANIFEST = "manifest.json"
EXT_SUFFIX: str = sysconfig.get_config_var("EXT_SUFFIX")
COMPILER_DIRECTIVES = {
    # Annotations are for mypy; as types they would make Cython refuse
    # (say) a numpy integer where an int is annotated.
    "annotation_typing": False,
    "binding": True,
    "embedsignature": True,
}
# Added to the interpreter's flags (-g -O3 here) unless CFLAGS is set: no debug
# information, the same code; a quarter less time to compile (-O2 would halve it, but ran
# the codec up to 4% slower).
EXTRA_COMPILE_ARGS = ["-g0"]
# Added always (GCC and clang): the compiled folds (_cfold.pyx) round each operation as
# numpy does, so no multiply and add may be fused into one (which rounds once: GCC fuses
# by default where the target has the instruction, e.g. on arm64); and sqrt may vectorize
# (nothing reads errno).
FLOAT_COMPILE_ARGS = ["-ffp-contract=off", "-fno-math-errno"]
# The environment's variables that change what the compiler makes.
COMPILER_VARIABLES = ("CC", "CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED", "ARCHFLAGS")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def say(message: str) -> None:
    """One line of progress, on stderr (where pip -v shows it)."""
    print(f"aioparamsync: {message}", file=sys.stderr, flush=True)


def modules(count: int) -> str:
    return f"{count} module" if count == 1 else f"{count} modules"


def workers() -> int:
    """How many modules to compile at once: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


def module_name(source: str) -> str:
    """``aioparamsync/wire/binary.py`` -> ``aioparamsync.wire.binary``."""
    return str(Path(source).with_suffix("")).replace(os.sep, ".").replace("/", ".")


def extension_path(source: str) -> str:
    """Where a module's extension goes: ``aioparamsync/wire/binary.cpython-311-...so``."""
    return Path(source).with_suffix("").as_posix() + EXT_SUFFIX


def cache_key(source_bytes: bytes) -> str:
    """The key of an extension: everything it is compiled from."""
    import Cython

    digest = hashlib.sha256(source_bytes)
    digest.update(Path(__file__).read_bytes())  # (the directives, flags and lists here)
    for part in (Cython.__version__, sys.version, EXT_SUFFIX):
        digest.update(b"\0" + part.encode())
    for name in COMPILER_VARIABLES:
        digest.update(f"\0{name}={os.environ.get(name, '')}".encode())
    return digest.hexdigest()[:20]


def compile_modules(sources: list[str], work: Path) -> dict[str, Path]:
    """Compile ``sources`` (paths under the root), ``workers()`` at a time, in ``work``.

    Returns:
        Each source's extension, under ``work``.
    """
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    extra = [] if os.environ.get("CFLAGS") or os.name == "nt" else EXTRA_COMPILE_ARGS
    extra = extra + ([] if os.name == "nt" else FLOAT_COMPILE_ARGS)
    extensions = [Extension(module_name(s), [s], extra_compile_args=extra) for s in sources]
    lock, done, started = threading.Lock(), [], time.monotonic()

    class Build(build_ext):  # type: ignore[misc,valid-type]
        def build_extension(self, ext: Any) -> None:
            began = time.monotonic()
            super().build_extension(ext)
            took = time.monotonic() - began
            with lock:
                done.append(ext.name)
                say(f"[{len(done)}/{len(extensions)}] {ext.name} ({took:.0f} s)")

    with contextlib.chdir(HERE):  # (relative paths: what tracebacks of compiled code name)
        cythonized = cythonize(
            extensions,
            build_dir=str(work / "c"),
            language_level=3,
            quiet=True,
            nthreads=workers(),
            compiler_directives=COMPILER_DIRECTIVES,
        )
        command = Build(Distribution({"name": "aioparamsync", "ext_modules": cythonized}))
        command.build_lib = str(work / "lib")
        command.build_temp = str(work / "temp")
        command.parallel = workers()
        command.ensure_finalized()
        command.run()
    say(f"compiled {modules(len(sources))} in {time.monotonic() - started:.0f} s")
    return {s: work / "lib" / extension_path(s) for s in sources}


def _cache_dir(work: Path) -> Path:
    """The cache under the root; where it cannot be written, one for this build only."""
    try:
        (HERE / CACHE).mkdir(parents=True, exist_ok=True)
        return HERE / CACHE
    except OSError:
        return work / "cache"


def build_extensions(work: Path) -> dict[str, tuple[Path, str]]:
    """Every module's extension: compiled now, or kept from an earlier build.

    Returns:
        Each source's extension file and the SHA-256 of the source it was compiled from.
    """
    cache = _cache_dir(work)
    cache.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, tuple[Path, str]] = {}
    for source in CYTHON_MODULES + COMPILED_MODULES:
        data = (HERE / source).read_bytes()
        cached = cache / f"{module_name(source)}-{cache_key(data)}{EXT_SUFFIX}"
        wanted[source] = (cached, hashlib.sha256(data).hexdigest())
    missing = [s for s, (cached, _) in wanted.items() if not cached.is_file()]
    if len(missing) < len(wanted):
        say(f"{modules(len(wanted) - len(missing))} compiled already ({cache})")
    if missing:
        say(
            f"compiling {modules(len(missing))} with Cython, "
            f"{min(workers(), len(missing))} at a time (AIOPARAMSYNC_NO_EXT=1 installs without)"
        )
        for source, made in compile_modules(missing, work).items():
            cached = wanted[source][0]
            for old in cache.glob(f"{module_name(source)}-*{EXT_SUFFIX}"):
                old.unlink(missing_ok=True)  # (an older key of the same module)
            partial = cached.with_name(f".{cached.name}.{os.getpid()}")
            shutil.copy2(made, partial)
            partial.replace(cached)  # (whole or not at all, for a build running beside)
    return wanted


def editable_files(built: dict[str, tuple[Path, str]], work: Path) -> dict[str, str]:
    """What an editable wheel holds: the extensions and their manifest, in EDITABLE_DIR."""
    entries, files = {}, {}
    for source, (cached, digest) in built.items():
        entries[module_name(source)] = {
            "extension": extension_path(source),
            "source": source,
            "sha256": digest,
        }
        files[str(cached)] = f"{EDITABLE_DIR}/{extension_path(source)}"
    manifest = work / MANIFEST
    manifest.write_text(json.dumps({"tree": str(HERE), "modules": entries}, indent=1))
    files[str(manifest)] = f"{EDITABLE_DIR}/{MANIFEST}"
    return files


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # imported outside a build (the tests read the lists above)
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """Compile the extensions; on failure warn (or fail with AIOPARAMSYNC_REQUIRE_EXT)."""

    work: tempfile.TemporaryDirectory[str] | None = None

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        if _flag("AIOPARAMSYNC_NO_EXT"):
            say("AIOPARAMSYNC_NO_EXT is set: not compiled, the pure-Python package")
            return
        self.work = tempfile.TemporaryDirectory(prefix="aioparamsync-build-")
        work = Path(self.work.name)
        try:
            built = build_extensions(work)
        except Exception as exc:  # (whatever stops the compile: no compiler, an error)
            message = (
                "aioparamsync: the compiled fast path was not built; the package runs "
                f"its pure-Python path (slower per call): {type(exc).__name__}: {exc}"
            )
            if _flag("AIOPARAMSYNC_REQUIRE_EXT"):
                raise RuntimeError(f"{message} (AIOPARAMSYNC_REQUIRE_EXT is set)") from exc
            print(message, file=sys.stderr, flush=True)
            warnings.warn(message, stacklevel=1)
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version == "editable":
            build_data["force_include_editable"] = editable_files(built, work)
        else:
            build_data["force_include"].update(
                {str(cached): extension_path(source) for source, (cached, _) in built.items()}
            )

    def finalize(self, version: str, build_data: dict, artifact_path: str) -> None:
        if self.work is not None:
            self.work.cleanup()
            self.work = None
