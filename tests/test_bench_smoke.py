"""The benchmark runs end to end with tiny settings (no timing is asserted)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_node.py"


def test_bench_node_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(BENCH),
        "--sizes", "4KiB", "--conns", "1", "--reps", "1", "--seconds", "0.2",
        "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            # SIGTERM lets the benchmark stop the servers it started.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr}"
    assert "node / ceiling" in stdout

    doc = json.loads(out.read_text())
    rows = {(r["variant"], r["size"], r["conns"]): r for r in doc["rows"]}
    assert set(rows) == {("ceiling", 4096, 1), ("node", 4096, 1)}
    for row in rows.values():
        assert row["n"] == 1
        for phase in ("update", "get"):
            assert row[f"{phase}_calls_per_s"] > 0
            assert row[f"{phase}_mb_per_s"] > 0
            assert row[f"{phase}_p50_ms"] > 0
            assert row[f"{phase}_p99_ms"] >= row[f"{phase}_p50_ms"]
        assert row["server_peak_rss_mib"] > 0
    assert len(doc["runs"]) == 2
    for run in doc["runs"]:
        assert run["update"]["calls"] > 0 and run["get"]["calls"] > 0
    [ratio] = doc["ratios"]
    assert ratio["update_throughput"] > 0 and ratio["get_throughput"] > 0
    assert doc["meta"]["cpus"] >= 1
