"""The cluster benchmark runs end to end with tiny settings (no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cluster_helpers import run_bounded

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cluster.py"


def test_bench_cluster_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(BENCH),
        "--peers-list", "0,2", "--sizes", "4KiB", "--count", "20", "--lag-count", "5",
        "--seconds", "0.5", "--probe-seconds", "0.1", "--json", str(out),
    ]  # fmt: skip
    rc, stdout, stderr = run_bounded(cmd, timeout=60)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    assert "upper bound" in stdout.lower() and "lag p50 ms" in stdout

    doc = json.loads(out.read_text())
    rows = {(r["peers"], r["size"]): r for r in doc["rows"]}
    assert set(rows) == {(0, 4096), (2, 4096)}
    for row in rows.values():
        assert row["update_calls"] > 0
        assert row["update_calls_per_s"] > 0
        assert row["update_p50_ms"] > 0
        assert row["update_p99_ms"] >= row["update_p50_ms"]
        assert row["update_p50_vs_p0"] > 0
        assert row["processes"] == row["peers"] + 2
    assert rows[(0, 4096)]["update_p50_vs_p0"] == 1.0
    assert rows[(0, 4096)]["lag_p50_ms"] is None

    two = rows[(2, 4096)]
    assert two["lag_updates"] > 0 and two["lag_timeouts"] == 0
    assert two["lag_p50_ms"] > 0
    assert two["lag_p99_ms"] >= two["lag_p50_ms"]
    assert two["lag_max_ms"] >= two["lag_p99_ms"]
    assert 0 <= two["lag_low_p50_ms"] <= two["lag_p50_ms"]
    assert two["poll_rtt_p50_ms"] > 0
    assert two["update_sent_per_peer"] > 0

    runs = {(r["peers"], r["size"]): r for r in doc["runs"]}
    assert runs[(0, 4096)]["links"] == [] and runs[(0, 4096)]["lag"] is None
    assert runs[(2, 4096)]["counters_settled"]
    links = runs[(2, 4096)]["links"]
    assert len(links) == 2
    lag_updates = runs[(2, 4096)]["lag"]["updates"]
    for link in links:
        assert link["state"] == "up"
        # Every update of phase 1 was sent or replaced by a newer one before it was.
        assert link["update_sent"] + link["update_coalesced"] == two["update_calls"]
        assert link["update_sent"] > 0
        assert link["lag_sent"] == lag_updates
    meta = doc["meta"]
    assert meta["cpus"] >= 1
    assert meta["background_cpu_before"] >= 0 and meta["background_cpu_after"] >= 0
    for row in rows.values():  # counted in clock ticks: a tiny run may show 0
        assert min(row["node0_cpu"], row["peers_cpu"], row["driver_cpu"], row["other_cpu"]) >= 0
