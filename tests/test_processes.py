"""``aioparamsync-node --processes N``: N node processes on one host, one cluster.

Real launcher processes on 127.0.0.1 (ports picked by the nodes: ``--port 0``),
real clients: the processes form one cluster and share the keys, a process
killed is started again and rejoins, SIGTERM stops them all, and flags that
cannot work are refused before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import LISTENING

from aioparamsync import ParameterClient
from aioparamsync.cli.node import build_parser
from aioparamsync.cli.processes import child_argv

CALL_TIMEOUT = 10.0
START_TIMEOUT = 60.0


class Launcher:
    """``python -m aioparamsync --processes N ...``, its listening lines collected."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.addresses: list[str] = []
        self.lines: list[str] = []
        self._new = asyncio.Event()
        self._pump = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            text = line.decode().rstrip("\n")
            self.lines.append(text)
            match = LISTENING.match(text)
            if match:
                self.addresses.append(f"{match['host']}:{match['port']}")
            self._new.set()
        self._new.set()

    async def listening(self, n: int) -> list[str]:
        async with asyncio.timeout(START_TIMEOUT):
            while len(self.addresses) < n:
                assert not self._pump.done(), f"the launcher ended: {self.lines}"
                self._new.clear()
                await self._new.wait()
        return self.addresses[:n]

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(pid) for pid in path.read_text().split()]

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(START_TIMEOUT):
            rc = await self.proc.wait()
            await self._pump
        return rc


@contextlib.asynccontextmanager
async def launched(*flags: str, env: dict[str, str] | None = None):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aioparamsync",
        "--port",
        "0",
        *flags,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    launcher = Launcher(proc)
    try:
        yield launcher
    finally:
        children = []
        with contextlib.suppress(OSError):
            children = launcher.children()
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        for pid in children:  # (only the launcher's own, by PID)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def members_up(address: str, n: int) -> list[str]:
    async with ParameterClient(address, timeout=CALL_TIMEOUT) as client:
        async with asyncio.timeout(START_TIMEOUT):
            while True:
                members = (await client.info()).topology.members
                up = [f"{m.host}:{m.port}" for m in members if m.state == "up"]
                if len(up) == n:
                    return sorted(up)
                await asyncio.sleep(0.1)


async def test_n_processes_form_one_cluster_and_share_the_keys() -> None:
    env = {**os.environ, "AIOPARAMSYNC_PROCESSES": "2"}  # (the flag's variable)
    async with launched("--replication-factor", "1", env=env) as launcher:
        addresses = await launcher.listening(2)
        assert len(set(addresses)) == 2
        assert await members_up(addresses[0], 2) == sorted(addresses)
        arrays = {f"k{i}": np.full(4, i, np.float32) for i in range(40)}
        async with ParameterClient(addresses[0], timeout=CALL_TIMEOUT) as client:
            await client.update_arrays(arrays)
        held = []
        for address in addresses:  # each process holds its share, and serves all
            async with ParameterClient(address, timeout=CALL_TIMEOUT) as client:
                held.append((await client.info()).parameter_count)
                got = await client.get_arrays(list(arrays))
            for name, array in arrays.items():
                np.testing.assert_array_equal(got[name], array)
        assert sum(held) == 40 and all(held), held
        assert len(launcher.children()) == 2
        assert await launcher.stop() == 0


@pytest.mark.parametrize(("flags", "r"), [((), 1), (("--replication-factor", "2"), 2)])
async def test_processes_hold_their_share_unless_a_replication_factor_is_given(
    flags: tuple[str, ...], r: int
) -> None:
    # (R = 3, every node's default, would put every key on each of 2 or 3 processes)
    async with launched("--processes", "2", *flags) as launcher:
        addresses = await launcher.listening(2)
        await members_up(addresses[0], 2)
        arrays = {f"k{i}": np.full(4, i, np.float32) for i in range(40)}
        async with ParameterClient(addresses[0], timeout=CALL_TIMEOUT) as client:
            assert (await client.topology()).replication_factor == r
            await client.update_arrays(arrays, acks="all")
        held = []
        for address in addresses:
            async with ParameterClient(address, timeout=CALL_TIMEOUT) as client:
                assert (await client.topology()).replication_factor == r
                held.append((await client.info()).parameter_count)
        if r == 1:
            assert sum(held) == 40 and all(held), held
        else:
            assert held == [40, 40]
        assert await launcher.stop() == 0


async def test_a_process_that_dies_is_started_again_and_rejoins() -> None:
    async with launched("--processes", "2") as launcher:
        addresses = await launcher.listening(2)
        await members_up(addresses[0], 2)
        survivor, victim = addresses[0], addresses[1]
        pid = next(p for p in launcher.children() if listens_on(p, victim))
        os.kill(pid, signal.SIGKILL)
        (*_, again) = await launcher.listening(3)
        assert again != victim  # (port 0: a port of its own again)
        up = await members_up(survivor, 2)
        assert again in up and survivor in up
        assert len(launcher.children()) == 2
        assert await launcher.stop() == 0


def listens_on(pid: int, address: str) -> bool:
    """Whether process ``pid`` listens on ``address`` (its sockets, from /proc)."""
    port = int(address.rsplit(":", 1)[1])
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[9] in inodes and fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
            return True
    return False


async def test_a_process_that_cannot_start_stops_the_launcher_with_why(tmp_path: Path) -> None:
    sock = tmp_path / "missing" / "node.sock"
    async with launched("--processes", "2", "--unix-socket", str(sock)) as launcher:
        async with asyncio.timeout(START_TIMEOUT):
            rc = await launcher.proc.wait()
            stderr = await launcher.proc.stderr.read()  # type: ignore[union-attr]
    assert rc == 1
    assert b"process 0 of 2 exited with 1 before it listened" in stderr
    assert f"cannot listen on unix:{sock}".encode() in stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--processes", "0"], "0 processes: from 1 to 1024"),
        (["--processes", "two"], "'two' is not a number of processes"),
        (["--processes", "2", "--host", "0.0.0.0"], "pass --advertise HOST:PORT"),
        (["--processes", "2", "--advertise", "10.0.0.1:9000"], "needs a --port (not 0)"),
    ],
)
async def test_flags_that_cannot_work_are_refused(flags: list[str], message: str) -> None:
    async with launched(*flags) as launcher, asyncio.timeout(START_TIMEOUT):
        rc = await launcher.proc.wait()
        err = await launcher.proc.stderr.read()  # type: ignore[union-attr]
    assert rc == 2, (launcher.lines, err)
    assert message in err.decode()


def test_each_process_gets_its_own_port_id_data_socket_and_metrics() -> None:
    argv = [
        "--processes=3",
        "--port",
        "9000",
        "--node-id",
        "ps",
        "--data-dir",
        "/data",
        "--metrics-port",
        "9100",
        "--unix-socket",
        "/run/ps.sock",
        "--advertise",
        "10.0.0.7:9000",
        "--peers",
        "10.0.0.8:9000",
    ]
    args: argparse.Namespace = build_parser().parse_args(argv)
    parser = build_parser()
    first = parser.parse_args(child_argv(argv, args, 0, None))
    assert (first.port, first.node_id, first.data_dir) == (9000, "ps-0", "/data/shard-0")
    assert (first.metrics_port, first.unix_socket, first.processes) == (9100, "/run/ps.sock", 1)
    assert first.advertise == ("10.0.0.7", 9000) and first.peers == [("10.0.0.8", 9000)]
    third = parser.parse_args(child_argv(argv, args, 2, "10.0.0.7:9000"))
    assert (third.port, third.node_id, third.data_dir) == (9002, "ps-2", "/data/shard-2")
    assert (third.metrics_port, third.unix_socket) == (9102, "/run/ps.sock.2")
    assert third.advertise == ("10.0.0.7", 9002)
    assert third.peers == [("10.0.0.7", 9000), ("10.0.0.8", 9000)]
    # with --port 0, each picks its own (and so do the metrics)
    argv = ["--port", "0", "--processes", "2", "--metrics-port", "0"]
    args = build_parser().parse_args(argv)
    second = parser.parse_args(child_argv(argv, args, 1, "127.0.0.1:5000"))
    assert (second.port, second.metrics_port, second.processes) == (0, 0, 1)
    assert second.peers == [("127.0.0.1", 5000)]


def test_the_processes_share_the_hosts_cores_out_for_their_folds() -> None:
    parser = build_parser()
    for n in (1, 2, 3, 64):
        argv = ["--port", "0", "--processes", str(n)]
        child = parser.parse_args(child_argv(argv, parser.parse_args(argv), 0, None))
        assert child.fold_threads == max(1, min(4, (os.cpu_count() or 1) // n))
    argv = ["--port", "0", "--processes", "2", "--fold-threads", "3"]
    child = parser.parse_args(child_argv(argv, parser.parse_args(argv), 1, "127.0.0.1:5000"))
    assert child.fold_threads == 3  # (as given)
