#!/usr/bin/env python3
"""Build Apache Thrift's C++ server (``benchmarks/cpp/param_server.cpp``), the benchmarks' baseline.

``build()`` generates the founding IDL's C++ (``thrift --gen cpp idl/ml_param_sync.thrift``)
and compiles it with the server (``g++ -O2 -std=c++17 ... -lthrift -lpthread``), against
Debian's ``libthrift-dev``. The binary is cached in ``build/cpp-baseline/``, named by a hash
of the source, the IDL and the versions of ``g++`` and ``thrift``: the next call only runs
the two ``--version`` commands. ``build(program="loadgen")`` builds the C++ load generator
(``benchmarks/cpp/loadgen.cpp``, Thrift's own client) the same way.
``python benchmarks/cppserver.py [loadgen]`` builds one and prints its path.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "benchmarks" / "cpp" / "param_server.cpp"
#: what build() builds: program name -> its source
PROGRAMS = {"param_server": SOURCE, "loadgen": REPO / "benchmarks" / "cpp" / "loadgen.cpp"}
IDL = REPO / "idl" / "ml_param_sync.thrift"
CACHE = REPO / "build" / "cpp-baseline"
NAME = "param_server"
INSTALL = "apt-get install libthrift-dev libboost-dev thrift-compiler g++"
# The headers the build needs, and the Debian package of each: libthrift-dev 0.17's
# headers include boost's, but the package does not depend on libboost-dev.
HEADERS = {"thrift/Thrift.h": "libthrift-dev", "boost/scoped_array.hpp": "libboost-dev"}
BUILD_TIMEOUT = 300.0  # (about 5 s on 2 cores)


class CppBaselineUnavailable(RuntimeError):
    """The C++ server cannot be built here: ``reason`` says what is missing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False
    )


def _tool(name: str, package: str) -> tuple[str, str]:
    """The tool's path and what its ``--version`` says."""
    path = shutil.which(name)
    if path is None:
        raise CppBaselineUnavailable(f"`{name}` is not on PATH (package {package}): {INSTALL}")
    done = _run([path, "--version"])
    return path, (done.stdout + done.stderr).strip()


def _check_headers(gxx: str) -> None:
    """Preprocess an include of each header: a missing one is named with its package."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cpp"
        for header, package in HEADERS.items():
            probe.write_text(f"#include <{header}>\n")
            done = _run([gxx, "-std=c++17", "-E", "-o", os.devnull, str(probe)])
            if done.returncode != 0:
                missing = re.search(r"fatal error: (\S+): No such file", done.stderr)
                raise CppBaselineUnavailable(
                    f"the header <{missing.group(1) if missing else header}> is missing "
                    f"(package {package}): {INSTALL}"
                )


def build(out_dir: Path | None = None, program: str = NAME) -> Path:
    """The path of the built ``program`` (built now unless cached in ``out_dir``).

    Raises:
        CppBaselineUnavailable: ``g++``, ``thrift`` or the headers are missing, or the
            build failed (its output in the reason).
    """
    source = PROGRAMS[program]
    out_dir = CACHE if out_dir is None else Path(out_dir)
    gxx, gxx_version = _tool("g++", "g++")
    thrift, thrift_version = _tool("thrift", "thrift-compiler")
    versions = f"{gxx_version}\0{thrift_version}".encode()
    key = hashlib.sha256()
    for part in (source.read_bytes(), IDL.read_bytes(), versions):
        key.update(hashlib.sha256(part).digest())
    binary = out_dir / f"{program}-{key.hexdigest()[:16]}"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    _check_headers(gxx)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built in a directory of its own, moved into place whole: a concurrent build, or one
    # interrupted, never leaves a partial binary under the cached name.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        gen = Path(tmp)
        steps = [
            [thrift, "--gen", "cpp", "-out", str(gen), str(IDL)],
            [gxx, "-O2", "-std=c++17", "-I", str(gen), "-o", str(gen / program), str(source),
             str(gen / "ParameterSyncService.cpp"), str(gen / "ml_param_sync_types.cpp"),
             "-lthrift", "-lpthread"],
        ]  # fmt: skip
        for cmd in steps:
            done = _run(cmd, cwd=gen)
            if done.returncode != 0:
                raise CppBaselineUnavailable(
                    f"`{' '.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-3000:]}"
                )
        os.replace(gen / program, binary)
    for old in out_dir.glob(f"{program}-*"):  # builds of other sources or compilers
        if old != binary:
            old.unlink(missing_ok=True)
    return binary


def main(argv: list[str]) -> int:
    program = argv[0] if argv else NAME
    if program not in PROGRAMS or len(argv) > 1:
        print(f"usage: cppserver.py [{'|'.join(PROGRAMS)}]", file=sys.stderr)
        return 2
    try:
        print(build(program=program))
    except CppBaselineUnavailable as exc:
        print(f"cppserver: {exc.reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
