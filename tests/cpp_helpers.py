"""Test helpers: the benchmarks' C++ baseline (Apache Thrift's C++ server), built or skipped.

``benchmarks/cppserver.py`` builds it from Debian's ``libthrift-dev`` and caches it. Where
it cannot be built, a test of it skips, saying why; ``.ci/run`` installs what it needs and
sets ``AIOPARAMSYNC_REQUIRE_CPP_BASELINE``, and there it fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

CPPSERVER = Path(__file__).resolve().parent.parent / "benchmarks" / "cppserver.py"


def cppserver() -> Any:
    """``benchmarks/cppserver.py`` as a module (the benchmarks are no package)."""
    module = sys.modules.get("cppserver")
    if module is None:
        spec = importlib.util.spec_from_file_location("cppserver", CPPSERVER)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["cppserver"] = module
    return module


def cpp_baseline_missing() -> str | None:
    """Why the C++ server cannot be built here, or None once it is built (and cached).

    Fails the test where the baseline is required (``.ci/run``).
    """
    module = cppserver()
    try:
        module.build()
    except module.CppBaselineUnavailable as exc:
        if os.environ.get("AIOPARAMSYNC_REQUIRE_CPP_BASELINE"):
            pytest.fail(f"the C++ baseline is required here, and cannot be built: {exc.reason}")
        return str(exc.reason)
    return None


def need_cpp_baseline() -> Path:
    """The C++ server's binary; skips the test where it cannot be built."""
    missing = cpp_baseline_missing()
    if missing is not None:
        pytest.skip(f"the C++ baseline cannot be built: {missing}")
    return Path(cppserver().build())
