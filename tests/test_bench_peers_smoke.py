"""benchmarks/bench_peers.py runs end to end with --smoke (structure only: no timing asserted).

Every system the machine has is run (on 127.0.0.1 only); one whose package or binary is
missing must be reported as skipped, with its reason, not fail the run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from cluster_helpers import run_bounded

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_peers.py"
SYSTEMS = ("aioparamsync", "redis", "torch-rpc", "ray", "grpc")
PEERS = SYSTEMS[1:]
WORKLOADS = ("A", "B", "C", "D")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _installed() -> dict[str, bool]:
    """What the script should find (as it looks for it)."""
    redis_server = shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()
    return {
        "aioparamsync": True,
        "redis": _has("redis") and bool(redis_server),
        "torch-rpc": _has("torch"),
        "ray": _has("ray"),
        "grpc": _has("grpc"),
    }


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_bench_peers_smoke(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    cmd = [sys.executable, str(BENCH), "--smoke", "--json", str(out)]
    rc, stdout, stderr = run_bounded(cmd, timeout=240)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr[-5000:]}"
    assert "workload (median)" in stdout

    doc = json.loads(out.read_text())
    installed = _installed()
    systems = doc["systems"]
    assert set(systems) == set(SYSTEMS)
    for name, state in systems.items():
        if installed[name]:
            assert state["status"] == "ran", (name, state)
        else:
            assert state["status"] == "skipped" and state["reason"], (name, state)
    ran = [s for s in SYSTEMS if systems[s]["status"] == "ran"]
    torch = installed["torch-rpc"]

    rows = {row["workload"]: row for row in doc["rows"]}
    assert set(rows) == (set(WORKLOADS) if torch else {"A", "B", "C"})
    for w, row in rows.items():
        assert set(row["columns"]) == set(SYSTEMS)
        for s in SYSTEMS:
            col = row["columns"][s]
            if s not in ran:
                assert col["skipped"], (w, s, col)
                continue
            assert col["n"] == 1, (w, s, col)
            if w in ("A", "B"):
                assert _positive(col["steps_per_s"]), (w, s, col)
            elif w == "C":
                assert col["complete"] and col["expected"] == 2 * doc["config"]["c_pushes"]
                assert col["lost"] >= 0 and col["uniform"], (s, col)
            else:
                assert col["complete"], (s, col)
                assert _positive(col["seconds"]) and _positive(col["loss"]), (s, col)
                assert col["loss"] < col["initial_loss"], (s, col)  # it learned something

    # The systems that fold on the server lose nothing (Redis, read-modify-write, may).
    for s in ("aioparamsync", "torch-rpc", "ray", "grpc"):
        if s in ran:
            assert rows["C"]["columns"][s]["lost"] == 0, (s, rows["C"]["columns"][s])

    ratios = {(r["workload"], r["peer"]): r for r in doc["ratios"]}
    assert set(ratios) == {(w, p) for w in rows for p in PEERS if p in ran}
    for (w, _), r in ratios.items():
        if w in ("A", "B"):
            assert _positive(r["throughput"]), r
        elif w == "D":
            assert _positive(r["time"]) and _positive(r["loss"]), r
        else:
            assert r["aioparamsync_lost"] == 0, r

    meta = doc["meta"]
    assert meta["cpus"] >= 1 and meta["python"]
    assert meta["versions"]["aioparamsync"]
    assert len(doc["runs"]) == len(ran) and all("results" in r for r in doc["runs"])
