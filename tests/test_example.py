"""``examples/train_async_sgd.py`` end to end: it trains, reports, and leaves no node running.

The script runs as a process with small settings, so each run takes seconds,
in both modes: workers pushing gradients that the nodes fold in (the default)
and workers overwriting the weights (``--mode overwrite``).
It prints the PIDs of the nodes it starts (``node pids: 1 2 3``); every test
checks that none of them runs once the script has exited, and kills (by PID)
whatever a failing run leaves behind. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import ignore_sigint, process_runs

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_async_sgd.py"
# Small settings: two nodes, three workers, a model of 64 -> 4.
SMALL = ["--nodes", "2", "--workers", "3", "--steps", "150", "--dim", "64", "--outputs", "4"]
# Bound of one run (starting the nodes imports numpy and thriftpy2 in each).
RUN_TIMEOUT = 120.0
# Bound of the script's exit once interrupted (it gives its nodes 10 s to stop).
EXIT_TIMEOUT = 30.0

PIDS = re.compile(r"^node pids: (\d+(?: \d+)*)$", re.MULTILINE)
ADDRESS = re.compile(r"^  node-\d+ on (\S+), pid \d+$", re.MULTILINE)
LOSS = re.compile(
    r"^held-out loss: initial (\S+) -> final (\S+) \(noise floor (\S+)\)$",
    re.MULTILINE,
)
TRAIN_LOSS = re.compile(
    r"^training loss: initial (\S+) -> final (\S+) \(the workers' shards\)$", re.MULTILINE
)
VERSION = re.compile(r"^the .* agree on the model \(version (\d+)\)", re.MULTILINE)
FOLDED = re.compile(r"^gradients folded in: (\d+) of (\d+) pushed$", re.MULTILINE)
WRITTEN = re.compile(r"^weights written: (\d+); the version advanced by (\d+) ", re.MULTILINE)
THROUGHPUT = re.compile(
    r"^throughput: (\d+) steps in (\S+) s = (\d+) steps/s, (\S+) MB/s", re.MULTILINE
)


def node_pids(stdout: str) -> list[int]:
    match = PIDS.search(stdout)
    assert match, f"no 'node pids:' line in:\n{stdout}"
    return [int(pid) for pid in match[1].split()]


def running(pid: int) -> bool:
    """Whether a node process with this PID runs (a zombie, or another program, does not)."""
    return process_runs(pid, b"aioparamsync")


def assert_all_stopped(pids: list[int]) -> None:
    # The script waited for its nodes; an orphan would still be running now.
    survivors = [pid for pid in pids if running(pid)]
    assert not survivors, f"node processes survived the script: {survivors}"


@contextlib.contextmanager
def cleanup(pids: list[int]) -> Iterator[None]:
    """Kill (by PID) any node in ``pids`` still running when the block ends."""
    try:
        yield
    finally:
        for pid in pids:
            if running(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )


@pytest.mark.parametrize("mode", [None, "gradients", "overwrite"], ids=["default", "g", "o"])
def test_the_example_trains_reports_and_stops_its_nodes(mode) -> None:
    pids: list[int] = []
    with cleanup(pids):
        result = run_example(*SMALL, *(["--mode", mode] if mode else []))
        pids.extend(node_pids(result.stdout))
        assert result.returncode == 0, result
        assert "Traceback" not in result.stderr
        assert len(pids) == 2
        assert_all_stopped(pids)
    out = result.stdout

    # The loss went down, on the training data and on the held-out set.
    loss = LOSS.search(out)
    assert loss, out
    initial, final, floor = map(float, loss.groups())
    assert final < initial / 20, out  # far below
    # It learned about all there is. (The floor is the true model's expected loss; on
    # the 4096 held-out samples it varies by about 1%, so a final loss may be below it.)
    assert 0.9 * floor <= final < 3 * floor, out
    train = TRAIN_LOSS.search(out)
    assert train, out
    train_initial, train_final = map(float, train.groups())
    assert train_final < train_initial / 20, out
    throughput = THROUGHPUT.search(out)
    assert throughput, out
    assert int(throughput[1]) == 3 * 150  # every step of every worker
    assert float(throughput[3]) > 0 and float(throughput[4]) > 0
    assert "the 2 nodes agree on the model (version " in out

    version = int(VERSION.search(out)[1])  # type: ignore[index]
    if mode == "overwrite":
        assert "mode: overwrite: " in out
        written = WRITTEN.search(out)
        assert written, out
        assert int(written[1]) == 450
        assert FOLDED.search(out) is None
    else:  # the default: gradients, folded in by the nodes, every one of them
        assert "mode: gradients: " in out
        folded = FOLDED.search(out)
        assert folded, out
        assert (int(folded[1]), int(folded[2])) == (450, 450), out
        # The weight was stored at version 1; each gradient folded in added one.
        assert version == 1 + 450, out
        assert WRITTEN.search(out) is None

    # Each line of the end once, the last one last.
    assert out.count("stopped 2 nodes") == 1, out
    assert out.count("held-out loss:") == 1 and out.count("throughput:") == 1, out
    assert out.rstrip().endswith("stopped 2 nodes")
    # Not a terminal: progress as plain lines on stderr, the last one complete, once.
    assert len(re.findall(r"step +450/450 +train loss", result.stderr)) == 1, result.stderr


@pytest.mark.parametrize("mode", ["gradients", "overwrite"])
def test_one_node_and_one_worker(mode) -> None:
    pids: list[int] = []
    with cleanup(pids):
        result = run_example(
            "--nodes", "1", "--workers", "1", "--steps", "300", "--dim", "16", "--mode", mode
        )  # fmt: skip
        pids.extend(node_pids(result.stdout))
        assert result.returncode == 0, result
        assert_all_stopped(pids)
    initial, final, _ = map(float, LOSS.search(result.stdout).groups())  # type: ignore[union-attr]
    assert final < initial / 20
    # One writer: no write is overwritten, and every step advances the version.
    assert int(VERSION.search(result.stdout)[1]) == 1 + 300  # type: ignore[index]


def read_until(process: subprocess.Popen[bytes], pattern: str, timeout: float) -> str:
    """What the process printed on stdout, once a line matches ``pattern`` (bounded)."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    os.set_blocking(fd, False)
    output = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            time.sleep(0.02)
            continue
        if not chunk:
            break  # it exited
        output += chunk
        if re.search(pattern, output.decode(errors="replace"), re.MULTILINE):
            return output.decode(errors="replace")
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{output.decode()}")


@pytest.mark.parametrize(
    ("sig", "inherited"),
    [(signal.SIGINT, None), (signal.SIGINT, ignore_sigint), (signal.SIGTERM, None)],
    ids=["SIGINT", "SIGINT-started-ignored", "SIGTERM"],
)
def test_an_interrupted_run_stops_every_node(sig, inherited, tmp_path) -> None:
    pids: list[int] = []
    with (tmp_path / "stderr").open("w+b") as stderr:
        process = subprocess.Popen(
            # Enough steps that it is still training when the signal comes.
            [sys.executable, str(EXAMPLE), *SMALL, "--steps", "1000000"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            preexec_fn=inherited,  # (one signal call in the child, before exec)
        )
        with cleanup(pids):
            try:
                stdout = read_until(process, r"^the cluster is ready", RUN_TIMEOUT)
                pids.extend(node_pids(stdout))
                assert all(running(pid) for pid in pids)
                wait_for_progress(stderr, RUN_TIMEOUT)
                process.send_signal(sig)  # to the script alone, not its nodes
                try:
                    rc = process.wait(timeout=EXIT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    stderr.seek(0)
                    tail = stderr.read().decode(errors="replace")[-4000:]
                    pytest.fail(f"no exit within {EXIT_TIMEOUT} s of {sig.name}; stderr:\n{tail}")
            finally:
                if process.poll() is None:
                    process.kill()  # by its PID
                    process.wait()
                assert process.stdout is not None
                process.stdout.close()
            assert rc == 130
            assert_all_stopped(pids)
        stderr.seek(0)
        errors = stderr.read().decode()
    assert "interrupted: every node was stopped" in errors
    assert "Traceback" not in errors


def wait_for_progress(stderr, timeout: float) -> None:
    """Wait until the script's first progress line (a second into training) is in ``stderr``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stderr.seek(0)
        if b"step" in stderr.read():
            return
        time.sleep(0.05)
    raise AssertionError(f"no progress line within {timeout} s")


@pytest.mark.parametrize("mode", ["gradients", "overwrite"])
def test_a_node_killed_mid_run_its_workers_move_on(mode, tmp_path) -> None:
    pids: list[int] = []
    with (tmp_path / "stderr").open("w+b") as stderr:
        # 3 nodes; 6000 steps of a small model: a few seconds of training.
        knobs = [*SMALL, "--nodes", "3", "--steps", "2000", "--mode", mode]
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLE), *knobs],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        with cleanup(pids):
            try:
                stdout = read_until(process, r"^the cluster is ready", RUN_TIMEOUT)
                pids.extend(node_pids(stdout))
                wait_for_progress(stderr, RUN_TIMEOUT)
                os.kill(pids[1], signal.SIGKILL)  # the second node, while it serves
                rest, _ = process.communicate(timeout=RUN_TIMEOUT)
            finally:
                if process.poll() is None:
                    process.kill()  # by its PID
                    process.wait()
            stdout += rest.decode()
            assert process.returncode == 0, stdout
            assert_all_stopped(pids)
        stderr.seek(0)
        errors = stderr.read().decode()
    assert "the 2 nodes still up agree on the model" in stdout and "1 went down" in stdout
    initial, final, _ = map(float, LOSS.search(stdout).groups())  # type: ignore[union-attr]
    assert final < initial / 20
    # The workers of the killed node said that they moved on.
    killed = ADDRESS.findall(stdout)[1]
    assert f"cannot connect to {killed}" in errors or "moving to node" in errors
    assert "Traceback" not in errors


def test_help_documents_the_knobs() -> None:
    result = run_example("--help")
    assert result.returncode == 0, result
    for knob in ("--nodes", "--workers", "--steps", "--dim", "--batch", "--lr", "--seed"):
        assert knob in result.stdout
    # --mode names both modes and says what each does.
    help_text = " ".join(result.stdout.split())
    assert "--mode {gradients,overwrite}" in help_text
    assert "gradients: push the gradient (push_gradients)" in help_text
    assert "overwrite: compute the new weights and write them (update_arrays)" in help_text
    assert "(default: gradients)" in help_text


@pytest.mark.parametrize(
    "args", [["--nodes", "0"], ["--lr", "-1"], ["--steps", "many"], ["--mode", "sum"]]
)
def test_bad_knobs_exit_2_and_start_nothing(args) -> None:
    result = run_example(*args)
    assert result.returncode == 2, result
    assert "node pids" not in result.stdout
    assert args[0] in result.stderr
