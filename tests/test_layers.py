"""The layers import as the design says: the sans-IO ones alone, the package root lazily.

Each check runs in a fresh interpreter (what a module imports is decided once
per process). The layering itself, lower never importing higher, is
import-linter's contract in pyproject.toml, run by ``.ci/run``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What the sans-IO layers may not bring in.
HEAVY = ("asyncio", "uvloop", "torch", "ray", "matplotlib")
LAYERS_ABOVE = (
    "aioparamsync.client",
    "aioparamsync.server",
    "aioparamsync.cluster.links",
    "aioparamsync.cluster.membership",
    "aioparamsync.node",
    "aioparamsync.persistence",
    "aioparamsync.store.writer",
)


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(json.loads(result.stdout))


def roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.mark.parametrize(
    "module",
    [
        "aioparamsync.wire",
        "aioparamsync.values.arrays",
        "aioparamsync.values.compression",
        "aioparamsync.values.rules",
        "aioparamsync.values.pieces",
        "aioparamsync.store.table",
        "aioparamsync.placement",
    ],
)
def test_a_sans_io_layer_imports_alone(module: str) -> None:
    loaded = loaded_after(f"import {module}")
    assert module in loaded
    assert not roots(loaded) & set(HEAVY), sorted(roots(loaded) & set(HEAVY))
    above = {m for m in loaded if m.startswith(LAYERS_ABOVE)}
    assert not above, sorted(above)


def test_the_package_root_is_light_and_lazy() -> None:
    loaded = loaded_after("import aioparamsync")
    ours = {m for m in loaded if m.startswith("aioparamsync")}
    # (_ext: which path runs, compiled or pure; it imports the standard library only)
    expected = {"aioparamsync", "aioparamsync._ext", "aioparamsync._version", "aioparamsync.errors"}
    assert ours == expected, sorted(ours)
    assert not roots(loaded) & {*HEAVY, "numpy", "thriftpy2"}
    # The public names load what they need when first used, and only that.
    loaded = loaded_after("import aioparamsync; aioparamsync.sgd")
    assert "aioparamsync.values.rules" in loaded and "asyncio" not in roots(loaded)
    loaded = loaded_after("from aioparamsync import ParameterClient, Node")
    assert {"aioparamsync.client.api", "aioparamsync.node"} <= loaded
    assert not roots(loaded) & {"torch", "ray", "matplotlib"}  # (aioparamsync.torch brings torch)


def test_every_public_name_resolves() -> None:
    import aioparamsync

    for name in aioparamsync.__all__:
        assert getattr(aioparamsync, name) is not None, name
    assert set(dir(aioparamsync)) >= set(aioparamsync.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = aioparamsync.nothing_here
