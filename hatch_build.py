"""The compiled fast path, built with the wheel (a hatchling build hook).

What is compiled (with Cython, into C extensions beside the sources):

* ``aioparamsync/wire/_cbinary.pyx``: the binary protocol's struct reader and
  writer, written for C (``aioparamsync.wire.binary`` uses it when present);
* the modules of the per-call path in ``COMPILED_MODULES``, compiled from
  their Python source as they are: the same code, without the interpreter's
  dispatch. An extension module is imported in place of the ``.py`` beside it.

The build never fails for want of a compiler: a failed compile warns, and the
wheel is the pure-Python one (everything works, more slowly).
``AIOPARAMSYNC_REQUIRE_EXT=1`` makes a failed compile fatal (``.ci/run`` sets
it); ``AIOPARAMSYNC_NO_EXT=1`` skips the compile (and, at run time, makes the
package ignore extensions that are there: see ``aioparamsync/_ext.py``).

Run as a script (``python hatch_build.py``), it compiles in place: what an
editable install does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Compiled from their Python source, as they are (Cython's "pure Python" mode): the
# modules of the per-call path. (A compiled coroutine function is one to
# inspect.iscoroutinefunction, and its signature and docstring are kept.)
COMPILED_MODULES = [
    "aioparamsync/wire/binary.py",
    "aioparamsync/wire/codec.py",
    "aioparamsync/wire/framing.py",
    "aioparamsync/wire/reader.py",
    "aioparamsync/wire/writer.py",
    "aioparamsync/values/arrays.py",
    "aioparamsync/store/table.py",
    "aioparamsync/store/writer.py",
    "aioparamsync/server/dispatch.py",
    "aioparamsync/server/ordering.py",
    "aioparamsync/server/transport.py",
    "aioparamsync/client/connection.py",
    "aioparamsync/client/pool.py",
    "aioparamsync/client/updates.py",
    "aioparamsync/client/api.py",
]
# Written for Cython.
CYTHON_MODULES = ["aioparamsync/wire/_cbinary.pyx"]


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def extension_paths() -> list[Path]:
    """The extension modules a compile makes, where it puts them."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return [
        HERE / (str(Path(m).with_suffix("")) + suffix) for m in CYTHON_MODULES + COMPILED_MODULES
    ]


def compile_in_place() -> None:
    """Compile every module in place (beside its source)."""
    from Cython.Build import cythonize
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    os.chdir(HERE)
    extensions = [
        Extension(str(Path(m).with_suffix("")).replace("/", "."), [m])
        for m in CYTHON_MODULES + COMPILED_MODULES
    ]
    modules = cythonize(
        extensions,
        build_dir="build/cython",
        language_level=3,
        quiet=True,
        nthreads=os.cpu_count() or 1,
        compiler_directives={
            # Annotations are for mypy; as types they would make Cython refuse
            # (say) a numpy integer where an int is annotated.
            "annotation_typing": False,
            "binding": True,
            "embedsignature": True,
        },
    )
    dist = Distribution({"name": "aioparamsync", "ext_modules": modules})
    command = build_ext(dist)
    command.inplace = True
    command.build_temp = "build/temp"
    command.parallel = os.cpu_count() or 1
    command.ensure_finalized()
    command.run()


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # run as a script, outside a build
    BuildHookInterface = object  # type: ignore[assignment,misc]


class CustomBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """Compile the extensions; on failure warn (or fail with AIOPARAMSYNC_REQUIRE_EXT)."""

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel" or _flag("AIOPARAMSYNC_NO_EXT"):
            return
        command = [sys.executable, str(HERE / "hatch_build.py")]
        result = subprocess.run(command, cwd=HERE, capture_output=True, text=True)
        built = [p for p in extension_paths() if p.exists()]
        if result.returncode != 0 or len(built) != len(extension_paths()):
            message = (
                "aioparamsync: the compiled fast path was not built; the package runs "
                "its pure-Python path (slower per call).\n"
                f"{result.stdout[-4000:]}{result.stderr[-4000:]}"
            )
            if _flag("AIOPARAMSYNC_REQUIRE_EXT"):
                raise RuntimeError(message)
            warnings.warn(message, stacklevel=1)
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        if version != "editable":  # (an editable install finds them in the source tree)
            build_data["artifacts"].extend(str(p.relative_to(HERE)) for p in built)


if __name__ == "__main__":
    compile_in_place()
