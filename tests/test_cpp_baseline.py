"""The benchmarks' C++ baseline: Apache Thrift's C++ server for the founding IDL.

Built by ``benchmarks/cppserver.py`` (cached), started on 127.0.0.1 and port 0, called by
thriftpy2's stock client with the founding IDL, stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import thriftpy2
from cpp_helpers import cppserver, need_cpp_baseline
from thriftpy2.protocol import TBinaryProtocolFactory
from thriftpy2.rpc import make_client
from thriftpy2.transport import TFramedTransportFactory

from aioparamsync.wire import SEED_IDL_PATH

START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0
seed = thriftpy2.load(str(SEED_IDL_PATH), module_name="cpp_baseline_seed_thrift")


def test_the_build_is_cached() -> None:
    binary = need_cpp_baseline()  # built here, unless it was already
    t0 = time.monotonic()
    again = cppserver().build()
    took = time.monotonic() - t0
    assert again == binary and took < 2.0, took  # (2 x --version, no compile)
    assert binary.parent == cppserver().CACHE and os.access(binary, os.X_OK)


@contextlib.contextmanager
def serving(binary: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The server on 127.0.0.1, port 0: (its process, its port); killed by PID if it lingers."""
    proc = subprocess.Popen(
        [str(binary), "--port", "0", "--threads", "2"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT)
        line = proc.stdout.readline().decode() if ready else ""
        match = re.fullmatch(r"listening on 127\.0\.0\.1:(\d+)\n", line)
        assert match, f"the server printed {line!r}"
        yield proc, int(match.group(1))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(STOP_TIMEOUT)
        for f in (proc.stdout, proc.stderr):
            assert f is not None
            f.close()


def _client(port: int) -> Any:
    return make_client(
        seed.ParameterSyncService,
        "127.0.0.1",
        port,
        proto_factory=TBinaryProtocolFactory(),
        trans_factory=TFramedTransportFactory(),
        timeout=30_000,
    )


def test_the_server_keeps_versions_and_bytes_and_stops_on_sigterm() -> None:
    with serving(need_cpp_baseline()) as (proc, port):
        client = _client(port)
        try:
            # 14 updates of 20 MiB on one connection: frames above Thrift's default limit
            # (~16 MB), and more than 256 MiB in all (Thrift 0.17 counts a connection's
            # bytes against the message limit unless each message resets it).
            for version in range(1, 15):
                data = bytes([version]) * (20 << 20)
                param = seed.Parameter(name="w", data=data)
                client.update_parameters(seed.ParameterUpdate([param], timestamp=100 + version))
            got = client.get_parameters(seed.ParameterRequest(["w", "absent"]))
            assert [(p.name, p.version) for p in got.params] == [("w", 14)]
            assert got.params[0].data == data and got.timestamp == 114
            assert client.get_parameters(seed.ParameterRequest(["w"], min_version=15)).params == []

            client.broadcast_update(
                seed.ParameterUpdate([seed.Parameter(name="b", data=b"xy")], timestamp=7)
            )
            got = client.get_parameters(seed.ParameterRequest(["b"]))  # (after it, in order)
            assert [(p.name, p.data, p.version) for p in got.params] == [("b", b"xy", 1)]
            assert got.timestamp == 114  # the largest applied
        finally:
            client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(STOP_TIMEOUT) == 0


def test_one_message_larger_than_a_sockets_default_limit_is_taken() -> None:
    # 32 parameters of 4 MiB in one update (a scale-out worker's): 128 MiB, past the
    # 100 MB a TSocket takes by default, under the server's 256 MiB
    with serving(need_cpp_baseline()) as (_, port):
        client = _client(port)
        try:
            params = [seed.Parameter(name=f"k{i}", data=bytes([i]) * (4 << 20)) for i in range(32)]
            client.update_parameters(seed.ParameterUpdate(params, timestamp=1))
            got = client.get_parameters(seed.ParameterRequest([p.name for p in params]))
            assert [p.data[:1] for p in got.params] == [bytes([i]) for i in range(32)]
        finally:
            client.close()


def test_the_server_refuses_bad_flags() -> None:
    binary = need_cpp_baseline()
    for bad in (
        ["--threads", "0"],
        ["--port", "70000"],
        ["--port", "x"],
        ["--bogus", "1"],
        ["--port"],
    ):
        done = subprocess.run([str(binary), *bad], capture_output=True, text=True, timeout=10)
        assert done.returncode == 2 and "usage: param_server" in done.stderr, (bad, done)
        assert done.stdout == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_idle_server_stops_at_once(sig: int) -> None:
    with serving(need_cpp_baseline()) as (proc, _):
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(STOP_TIMEOUT) == 0
        assert time.monotonic() - t0 < 1.0
