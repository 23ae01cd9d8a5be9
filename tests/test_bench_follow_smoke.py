"""The followers' benchmark runs end to end with tiny settings (no timing is asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cluster_helpers import run_bounded

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_follow.py"


def test_bench_follow_smoke(tmp_path: Path) -> None:
    out = tmp_path / "follow.json"
    cmd = [sys.executable, str(BENCH), "--keys", "50", "--batch", "5", "--rate", "20",
           "--seconds", "1", "--json", str(out)]  # fmt: skip
    rc, stdout, stderr = run_bounded(cmd, timeout=120)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    assert "| follower of it |" in stdout
    doc = json.loads(out.read_text())
    rows = {r["who"]: r for r in doc["rows"]}
    assert set(rows) == {"follower", "follower of it"}
    for row in rows.values():
        assert row["writes"] > 0 and row["missed"] == 0
        assert row["lag_p50_ms"] > 0 and row["lag_max_ms"] >= row["lag_p99_ms"] >= 0
        # (fewer than written when writes to a key coalesced while it read)
        assert row["keys_pulled"] > 0 and row["batches"] > 0
