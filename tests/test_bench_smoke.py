"""The benchmark runs end to end with tiny settings (structure only: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_helpers import run_bounded
from cpp_helpers import need_cpp_baseline

from aioparamsync._ext import compiled

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_node.py"
# (all but cpp, which its own test below runs: it skips where the C++ server cannot be built)
VARIANTS = {
    "ceiling",
    "ceiling-unix",
    "thriftpy2",
    "grpc",
    "node",
    "node-pure",
    "node-unix",
    "node-2proc",
}
SIZES = {4096, 128 * 1024}  # 128 KiB: above the 64 KiB large-frame threshold
CONNS = {1, 2}
RATIO_NAMES = (
    "update_throughput",
    "get_throughput",
    "update_p50_latency",
    "update_p99_latency",
    "get_p50_latency",
    "get_p99_latency",
    "server_peak_rss",
)


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_bench_node_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    plotting = importlib.util.find_spec("matplotlib") is not None
    cmd = [
        sys.executable, str(BENCH), "--variants", ",".join(sorted(VARIANTS)),
        "--sizes", "4KiB,128KiB", "--conns", "1,2", "--reps", "1",
        "--seconds", "0.05", "--max-calls", "20",
        "--json", str(out),
    ]  # fmt: skip
    if plotting:
        cmd += ["--plot", str(png)]
    rc, stdout, stderr = run_bounded(cmd, timeout=240)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    assert "/ ceiling" in stdout and "/ thriftpy2" in stdout
    assert "malloc tuned" in stdout

    doc = json.loads(out.read_text())
    rows = {(r["variant"], r["size"], r["conns"]): r for r in doc["rows"]}
    assert set(rows) == {(v, s, c) for v in VARIANTS for s in SIZES for c in CONNS}
    for row in rows.values():
        assert row["n"] == 1 and row["reps_planned"] == 1 and not row["cut_by_time"]
        for phase in ("update", "get"):
            for key in ("calls_per_s", "mb_per_s", "p50_ms", "p99_ms"):
                assert _positive(row[f"{phase}_{key}"]), (row, phase, key)
            assert row[f"{phase}_p99_ms"] >= row[f"{phase}_p50_ms"]
        assert _positive(row["server_peak_rss_mib"])

    assert len(doc["runs"]) == len(rows)
    for run in doc["runs"]:
        assert run["update"]["calls"] > 0 and run["get"]["calls"] > 0

    ratios = {(r["variant"], r["baseline"], r["size"], r["conns"]): r for r in doc["ratios"]}
    expected = {
        (v, b, s, c)
        for b in ("ceiling", "thriftpy2")
        for v in VARIANTS - {b}
        for s in SIZES
        for c in CONNS
    }
    assert set(ratios) == expected
    for ratio in ratios.values():
        for name in RATIO_NAMES:
            assert _positive(ratio[name]), (ratio, name)

    meta = doc["meta"]
    assert meta["cpus"] >= 1
    assert meta["malloc"] == "tuned" and meta["malloc_env"]
    if plotting:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_node_cpp_variant(tmp_path: Path) -> None:
    """Thrift's C++ server beside the node: real figures, and the node divided by it."""
    binary = need_cpp_baseline()
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(BENCH), "--variants", "cpp,node", "--sizes", "4KiB", "--conns", "2",
        "--reps", "1", "--seconds", "0.05", "--max-calls", "20", "--json", str(out),
    ]  # fmt: skip
    # (each run's warm-up checks the bytes come back equal, and the C++ server's versions:
    # a mismatch fails the run)
    rc, stdout, stderr = run_bounded(cmd, timeout=60)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    assert (
        f"cpp: Apache Thrift's C++ TThreadPoolServer, a pool thread per connection ({binary}), "
        "with {'MALLOC_ARENA_MAX': '1'}" in stdout  # (the malloc tuning's, for its threads)
    )
    assert "/ cpp" in stdout

    doc = json.loads(out.read_text())
    assert doc["meta"]["cpp_server"] == str(binary) and doc["meta"]["skipped"] == {}
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"cpp", "node"}
    cpp = rows["cpp"]
    assert (cpp["size"], cpp["conns"], cpp["n"]) == (4096, 2, 1)
    for phase in ("update", "get"):
        for key in ("calls_per_s", "mb_per_s", "p50_ms", "p99_ms"):
            assert _positive(cpp[f"{phase}_{key}"]), (cpp, phase, key)
    assert _positive(cpp["server_peak_rss_mib"])
    [run] = [r for r in doc["runs"] if r["variant"] == "cpp"]
    assert run["update"]["calls"] > 0 and run["get"]["calls"] > 0
    [ratio] = [r for r in doc["ratios"] if r["baseline"] == "cpp"]
    assert ratio["variant"] == "node"
    for name in RATIO_NAMES:
        assert _positive(ratio[name]), (ratio, name)


def test_bench_node_skips_cpp_where_it_cannot_be_built(tmp_path: Path) -> None:
    """No g++ on PATH: cpp is skipped, saying why, and the other variants run."""
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(BENCH), "--variants", "ceiling,cpp", "--sizes", "4KiB",
        "--conns", "1", "--reps", "1", "--seconds", "0.05", "--max-calls", "20",
        "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert "cpp skipped: `g++` is not on PATH" in done.stdout
    doc = json.loads(out.read_text())
    assert [r["variant"] for r in doc["rows"]] == ["ceiling"]
    assert "g++" in doc["meta"]["skipped"]["cpp"] and doc["meta"]["cpp_server"] is None


def test_bench_node_passes_node_args_and_reports_a_node_that_will_not_start(
    tmp_path: Path,
) -> None:
    out = tmp_path / "bench.json"
    base = [
        sys.executable, str(BENCH), "--variants", "node", "--sizes", "128KiB", "--conns", "2",
        "--reps", "1", "--seconds", "0.05", "--max-calls", "20",
    ]  # fmt: skip
    cmd = [*base, "--node-args=--max-receiving-bytes 128KiB", "--json", str(out)]
    rc, stdout, stderr = run_bounded(cmd, timeout=100)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    assert "the node runs with: --max-receiving-bytes 128KiB" in stdout
    doc = json.loads(out.read_text())
    assert doc["meta"]["node_args"] == ["--max-receiving-bytes", "128KiB"]
    assert [r["variant"] for r in doc["rows"]] == ["node"]

    rc, stdout, stderr = run_bounded([*base, "--node-args=--max-receiving-bytes lots"], timeout=100)
    assert rc == 1, f"exit {rc}\n{stdout}\n{stderr}"
    assert "bench_node: node server exited" in stderr and "'lots' is not a size" in stderr
    assert "Traceback" not in stderr


PERCALL = BENCH.parent / "bench_percall.py"


BUILT = importlib.util.find_spec("aioparamsync.wire._cbinary") is not None


@pytest.mark.parametrize(
    ("sides", "named", "paths"),
    [
        ([], ["server", "client"], ["pure"]),
        (["--sides", "server-wire,client-wire"], ["server-wire", "client-wire"], ["pure"]),
        pytest.param(
            [],  # the default: both paths
            ["server", "client"],
            ["compiled", "pure-Python"],
            marks=pytest.mark.skipif(not BUILT, reason="the compiled path is not built"),
        ),
    ],
)
def test_bench_percall_smoke(sides: list[str], named: list[str], paths: list[str]) -> None:
    cmd = [
        sys.executable, str(PERCALL), *sides,
        "--bytes", "128KiB", "--conns", "2", "--rounds", "3", "--reps", "2",
    ]  # fmt: skip
    if paths == ["pure"]:
        cmd += ["--paths", "pure"]
        paths = ["pure-Python"]
    rc, stdout, stderr = run_bounded(cmd, timeout=100)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    blocks: list[list[str]] = []  # each path's: its header line, then its figures
    for line in stdout.splitlines():
        if "bytes per parameter" in line:
            blocks.append([])
        blocks[-1].append(line)
    assert len(blocks) == len(paths), stdout
    for block, path in zip(blocks, paths, strict=True):
        assert f"the {path} path" in block[0], stdout
        lines = [line.split() for line in block[1:]]
        expected = [[op, side] for op in ("update", "get") for side in named]
        assert [line[:2] for line in lines] == expected
        for line in lines:
            best, median = float(line[2]), float(line[3])
            assert 0 < best <= median


def test_bench_percall_refuses_bad_arguments() -> None:
    for bad in (
        ["--conns", "0"],
        ["--ops", "put"],
        ["--sides", "both"],
        ["--bytes", "lots"],
        ["--paths", "fast"],
    ):
        rc, _, stderr = run_bounded([sys.executable, str(PERCALL), *bad], timeout=60)
        assert rc == 2, (bad, stderr)
        assert "error:" in stderr


TENSORS = BENCH.parent / "bench_tensors.py"


@pytest.mark.parametrize("pure", [False, True], ids=["default", "pure"])
def test_bench_tensors_smoke(tmp_path: Path, pure: bool) -> None:
    out = tmp_path / "tensors.json"
    cmd = [sys.executable, str(TENSORS), "--count", "3", "--elements", "5", "--number", "2"]
    cmd += ["--reps", "1", "--json", str(out)]
    env = {**os.environ, "AIOPARAMSYNC_NO_EXT": "1"} if pure else None
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert (figures["count"], figures["elements"]) == (3, 5)
    compiled_here = compiled("values._cfold") is not None  # (as the child reads the environment)
    assert figures["path"] == ("pure" if pure or not compiled_here else "compiled")
    parts = ["fold", "answer, rules", "answer, no rules", "decode, rules", "decode, no rules"]
    for part in [*parts, "to_parameter", "from_parameter"]:
        assert figures[part] > 0 and math.isfinite(figures[part]), part
        assert part in done.stdout
    for bad in (["--count", "0"], ["--reps", "-1"], ["--elements", "many"]):
        refused = subprocess.run(
            [sys.executable, str(TENSORS), *bad], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2 and "error:" in refused.stderr, bad


PUSH = BENCH.parent / "bench_push.py"


def test_bench_push_smoke(tmp_path: Path) -> None:
    out = tmp_path / "push.json"
    cmd = [
        sys.executable, str(PUSH), "--sizes", "4KiB,64KiB", "--rules", "sgd,adam",
        "--count", "2", "--paths", "compiled,pure", "--json", str(out),
    ]  # fmt: skip
    rc, stdout, stderr = run_bounded(cmd, timeout=100)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    rows = json.loads(out.read_text())
    expected = [
        (p, b, r) for p in ("compiled", "pure") for b in (4096, 65536) for r in ("sgd", "adam")
    ]
    assert [(r["path"], r["bytes"], r["rule"]) for r in rows] == expected
    assert all(r["update_s"] > 0 and r["push_s"] > 0 for r in rows)
    assert len([line for line in stdout.splitlines() if "push / update" in line]) == len(rows)


def test_bench_push_refuses_bad_arguments() -> None:
    for bad in (["--rules", "rmsprop"], ["--paths", "fast"], ["--sizes", "lots"]):
        rc, _, stderr = run_bounded([sys.executable, str(PUSH), *bad], timeout=60)
        assert rc == 2, (bad, stderr)
        assert "error:" in stderr


SMALLCALLS = BENCH.parent / "bench_smallcalls.py"


def test_bench_smallcalls_drives_each_server_with_the_cpp_load_generator(tmp_path: Path) -> None:
    """The C++ client against the C++ server and the node (compiled, and pure): real calls,
    each get checked by the load generator, and the node divided by the C++ server."""
    need_cpp_baseline()
    out = tmp_path / "small.json"
    cmd = [
        sys.executable, str(SMALLCALLS), "--variants", "cpp,node,node-pure", "--sizes", "4KiB",
        "--conns", "2", "--reps", "1", "--seconds", "0.2", "--warmup", "0.05",
        "--json", str(out),
    ]  # fmt: skip
    rc, stdout, stderr = run_bounded(cmd, timeout=120)
    assert rc == 0, f"exit {rc}\n{stdout}\n{stderr}"
    runs = json.loads(out.read_text())
    assert sorted(r["variant"] for r in runs) == ["cpp", "node", "node-pure"]
    for run in runs:
        for op in ("update", "get"):
            phase = run[op]
            assert phase["op"] == op and (phase["conns"], phase["size"]) == (2, 4096)
            assert phase["calls"] > 0 and _positive(phase["calls_per_s"]), (run["variant"], op)
            assert phase["p50_us"] <= phase["p99_us"]
    assert "| / cpp (u/g) |" in stdout
    assert [line.split("|")[3].strip() for line in stdout.splitlines() if "|   4KiB |" in line] == [
        "cpp",
        "node",
        "node-pure",
    ]


def test_bench_smallcalls_refuses_bad_flags() -> None:
    for flags in (["--variants", "nope"], ["--reps", "0"], ["--conns", "0"], ["--seconds", "-1"]):
        rc, _, stderr = run_bounded([sys.executable, str(SMALLCALLS), *flags], timeout=60)
        assert rc == 2, (flags, stderr)
