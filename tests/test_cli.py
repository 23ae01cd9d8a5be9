"""``aioparamsync-node`` as a real process: flags, the listening line, signals, limits.

Every node is started with ``python -m aioparamsync --port 0 ...`` on 127.0.0.1,
so two runs of this file at once never clash. The ``spawn`` fixture kills (by
PID) whatever node a test leaves running, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    CALL_TIMEOUT,
    LISTENING,
    NODE_COMMAND,
    START_TIMEOUT,
    NodeProcess,
    free_port,
)

from aioparamsync import (
    ConnectError,
    ConnectionLostError,
    ParameterClient,
    RemoteProtocolError,
    RequestError,
    ServerError,
    __version__,
    from_parameter,
)
from aioparamsync.cli.node import build_parser
from aioparamsync.cli.options import byte_size, human_size
from aioparamsync.cli.taskdump import BEGIN as TASKS_BEGIN
from aioparamsync.cli.taskdump import END as TASKS_END
from aioparamsync.wire import MessageType, Protocol, decode_header, encode_message, method, thrift

pytestmark = pytest.mark.timeout(90)

NODE = NODE_COMMAND
# "Promptly": well under the node's 5 s grace for calls in flight.
PROMPT_SECONDS = 4.0
MIB = 1024 * 1024


async def stop(node: NodeProcess, sig: int = signal.SIGTERM) -> tuple[int, float]:
    """Signal the node; answer its exit code and how long it took to exit."""
    t0 = time.monotonic()
    node.signal(sig)
    rc = await node.wait_exit()
    return rc, time.monotonic() - t0


def client_of(node: NodeProcess, **kwargs) -> ParameterClient:
    kwargs.setdefault("timeout", CALL_TIMEOUT)
    kwargs.setdefault("connect_timeout", 5.0)
    return ParameterClient(node.address, **kwargs)


def run_cli(*args: str, timeout: float = START_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion (it is killed if it outlives ``timeout``)."""
    return subprocess.run(
        [*NODE, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_nothing_listens(port: int) -> None:
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.settimeout(5)
        s.connect(("127.0.0.1", port))


def assert_clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert " ERROR " not in stderr and " CRITICAL " not in stderr, stderr


def filler(nbytes: int) -> np.ndarray:
    return np.arange(nbytes, dtype=np.uint64).astype(np.uint8)


# -- the listening line and the node id ----------------------------------------------


async def test_listening_line_is_printed_once_and_names_host_port_by_default(spawn) -> None:
    node = await spawn()
    assert node.host == "127.0.0.1"
    assert 0 < node.port < 65536
    assert node.node_id == f"127.0.0.1:{node.port}"
    async with client_of(node) as client:
        assert await client.ping() == node.node_id
    rc, _ = await stop(node)
    assert rc == 0
    assert len(node.stdout_lines) == 1, node.stdout_lines
    assert node.stdout_lines[0].endswith("\n")
    assert LISTENING.match(node.stdout_lines[0].rstrip("\n"))
    assert_clean(node.stderr)


async def test_node_id_flag_shows_in_the_line_ping_and_info(spawn) -> None:
    node = await spawn("--node-id", "foo")
    assert node.node_id == "foo"
    assert node.stdout_lines[0] == f"aioparamsync-node foo listening on 127.0.0.1:{node.port}\n"
    async with client_of(node) as client:
        assert await client.ping() == "foo"
        info = await client.info()
        assert info.node_id == "foo"
        assert info.version == __version__
    rc, _ = await stop(node)
    assert rc == 0


async def test_two_nodes_on_port_zero_get_different_ports(spawn) -> None:
    a, b = await asyncio.gather(spawn(), spawn())
    assert a.port != b.port
    async with client_of(a) as ca, client_of(b) as cb:
        assert await ca.ping() == a.node_id
        assert await cb.ping() == b.node_id


# -- data through the process -------------------------------------------------------------


async def test_update_and_get_round_trip_numpy_arrays(spawn) -> None:
    node = await spawn()
    rng = np.random.default_rng(7)
    arrays = {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": np.arange(5, dtype=np.int64),
        "h": rng.standard_normal((2, 3, 4)).astype(np.float16),
        "mask": np.array([True, False, True]),
        "scalar": np.float64(3.5),
        "big": rng.standard_normal(MIB).astype(np.float32),  # 4 MiB: the large-frame path
    }
    async with client_of(node) as writer:
        assert await writer.update_arrays(arrays) == {name: 1 for name in arrays}
        assert await writer.update_arrays({"w": arrays["w"] * 2}) == {"w": 2}
    # A second client (fresh connections) reads what the first one wrote.
    async with client_of(node) as reader:
        got = await reader.get_arrays([*arrays, "missing"])
        assert set(got) == set(arrays)
        for name, expected in {**arrays, "w": arrays["w"] * 2}.items():
            expected = np.asarray(expected)
            assert got[name].dtype == expected.dtype, name
            assert got[name].shape == expected.shape, name
            np.testing.assert_array_equal(got[name], expected)
        response = await reader.get_parameters(["w", "b"], min_version=2)
        assert [p.name for p in response.params] == ["w"]
        assert response.params[0].version == 2
    rc, _ = await stop(node)
    assert rc == 0
    assert_clean(node.stderr)


# -- signals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_signal_stops_the_node_promptly_and_cleanly(spawn, sig) -> None:
    node = await spawn("--log-level", "info")
    async with client_of(node) as client:
        await client.update_arrays({"w": np.ones(4)})
        # An idle connection stays open: it must not hold the shutdown up.
        rc, took = await stop(node, sig)
        assert rc == 0, node.stderr
        assert took < PROMPT_SECONDS, f"took {took:.1f} s to exit"
        assert_clean(node.stderr)
        assert "KeyboardInterrupt" not in node.stderr
        # The node is gone: the next call cannot connect.
        with pytest.raises(ConnectError):
            await client.ping()


async def test_signal_with_no_connection_ever_made(spawn) -> None:
    node = await spawn()
    rc, took = await stop(node, signal.SIGTERM)
    assert (rc, node.stdout_lines[1:]) == (0, [])
    assert took < PROMPT_SECONDS
    assert_clean(node.stderr)


async def test_sigusr1_prints_every_tasks_stack_and_the_node_serves_on(spawn) -> None:
    node = await spawn()
    async with client_of(node) as client:
        await client.update_arrays({"w": np.ones(4)})
        # a call held at the node: its task is among those shown, where it waits
        held = asyncio.ensure_future(client.get_arrays(["w"], min_version=9, wait=30))
        await asyncio.sleep(0.2)
        node.proc.send_signal(signal.SIGUSR1)
        await node.wait_stderr(TASKS_END)
        dump = node.stderr[node.stderr.index(TASKS_BEGIN) :]
        assert re.search(r"\d+ tasks", dump.splitlines()[0]), dump
        # the held call's whole chain of awaits, down to the future it waits on
        assert re.search(r"aioparamsync/server/\S+:\d+ in \w+", dump), dump
        assert "waits on <Future pending" in dump, dump
        # and the node goes on: it takes writes, and the held call still waits
        await client.update_arrays({"w": np.full(4, 2.0)})
        await client.update_arrays({"w": np.full(4, 3.0)})
        assert not held.done()
        held.cancel()
        np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], np.full(4, 3.0))
    rc, _ = await stop(node, signal.SIGTERM)
    assert rc == 0, node.stderr


async def _slow_reader(node: NodeProcess) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection whose tiny receive buffer keeps a large reply mostly in the node."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        async with asyncio.timeout(5):
            await asyncio.get_running_loop().sock_connect(sock, node.address)
        return await asyncio.open_connection(sock=sock, limit=64 * 1024)
    except BaseException:
        sock.close()
        raise


def _pull_request(seqid: int, *names: str) -> list:
    m = method("pull_parameters")
    assert m is not None
    request = thrift.ParameterRequest(param_names=list(names), min_version=0)
    parts, _ = encode_message(m.name, MessageType.CALL, seqid, m.args(request=request))
    return parts


def _decode_pull_reply(payload: bytes, seqid: int) -> dict[str, np.ndarray]:
    m = method("pull_parameters")
    assert m is not None and m.result is not None
    name, mtype, got_seqid, reader = decode_header(memoryview(payload), Protocol.BINARY)
    assert (name, mtype, got_seqid) == ("pull_parameters", MessageType.REPLY, seqid)
    result = reader.read_body(m.result)
    assert result.error is None
    return {p.name: from_parameter(p) for p in result.success.params}


async def test_sigterm_lets_a_reply_in_flight_finish(spawn) -> None:
    """Deterministic: SIGTERM lands while a 16 MiB reply is mostly still in the node.

    (Sending a 16 MiB *update* and SIGTERM "right after" is racy: whether the
    node has read the whole request when the signal lands is timing. Here the
    node has provably dispatched the call, as its reply has begun to arrive.)
    """
    node = await spawn("--log-level", "info")
    big = np.arange(4 * MIB, dtype=np.float32)  # 16 MiB
    async with client_of(node) as client:
        await client.update_arrays({"big": big})
    reader, writer = await _slow_reader(node)
    try:
        writer.writelines(_pull_request(7, "big"))
        await writer.drain()
        (size,) = struct.unpack("!i", await asyncio.wait_for(reader.readexactly(4), CALL_TIMEOUT))
        assert size > big.nbytes
        t0 = time.monotonic()
        node.signal(signal.SIGTERM)
        await node.wait_stderr("shutting down")  # the node is stopping, the reply unsent
        payload = await asyncio.wait_for(reader.readexactly(size), CALL_TIMEOUT)
        got = _decode_pull_reply(payload, 7)
        np.testing.assert_array_equal(got["big"], big)
        # Then the node closes the connection and exits.
        assert await asyncio.wait_for(reader.read(), CALL_TIMEOUT) == b""
    finally:
        writer.close()
    rc = await node.wait_exit()
    assert rc == 0
    assert time.monotonic() - t0 < PROMPT_SECONDS + 2
    assert_clean(node.stderr)


async def test_sigterm_keeps_a_reply_in_flight_when_a_call_is_pipelined_behind_it(spawn) -> None:
    node = await spawn("--log-level", "info")
    big = np.arange(4 * MIB, dtype=np.float32)  # 16 MiB, more than the node's write high mark
    async with client_of(node) as client:
        await client.update_arrays({"big": big})
    reader, writer = await _slow_reader(node)
    try:
        writer.writelines(_pull_request(7, "big"))
        await writer.drain()
        (size,) = struct.unpack("!i", await asyncio.wait_for(reader.readexactly(4), CALL_TIMEOUT))
        # The node has stopped reading this connection (its write buffer is full);
        # a second call now waits in the node's socket, unread.
        ping = method("ping")
        assert ping is not None
        writer.writelines(encode_message("ping", MessageType.CALL, 8, ping.args())[0])
        await writer.drain()
        await asyncio.sleep(0.1)
        node.signal(signal.SIGTERM)
        await node.wait_stderr("shutting down")
        payload = await asyncio.wait_for(reader.readexactly(size), CALL_TIMEOUT)
        np.testing.assert_array_equal(_decode_pull_reply(payload, 7)["big"], big)
    finally:
        writer.close()
    assert await node.wait_exit() == 0


# -- --max-frame-bytes ------------------------------------------------------------------


async def test_max_frame_bytes_refuses_a_larger_update_and_keeps_serving(spawn) -> None:
    node = await spawn("--max-frame-bytes", "1048576")
    async with client_of(node) as client:
        # The node answers a PROTOCOL_ERROR (seqid 0) and closes the connection:
        # the client sees the connection break, never a ServerError.
        with pytest.raises(ConnectionLostError) as caught:
            await client.update_arrays({"big": filler(2 * MIB)})
        assert not isinstance(caught.value, ServerError)
        assert "connection" in str(caught.value)
        # The same client carries on, on a fresh connection.
        assert await client.update_arrays({"small": np.arange(4)}) == {"small": 1}
    async with client_of(node) as fresh:
        assert await fresh.update_arrays({"small": np.arange(8)}, replace=True) == {"small": 2}
        got = await fresh.get_arrays(["big", "small"])
        assert list(got) == ["small"]  # the refused update was not applied
        np.testing.assert_array_equal(got["small"], np.arange(8))
        info = await fresh.info()
        assert info.counters["protocol_errors"] >= 1
    rc, _ = await stop(node)
    assert rc == 0
    assert "1048576" in node.stderr  # the node logs why it closed the connection
    assert_clean(node.stderr)


async def test_a_message_over_max_frame_bytes_is_refused_naming_the_limit_to_raise(
    spawn,
) -> None:
    node = await spawn("--max-frame-bytes", "1MiB")
    hint = "more than the node's --max-frame-bytes (1048576 bytes, 1 MiB): raise it"
    async with client_of(node) as client:
        with pytest.raises(ConnectionLostError, match=re.escape(hint)):
            await client.update_arrays({"big": filler(2 * MIB)})
    # unframed (a buffered client's), the same
    message = encode_message(
        "update_parameters",
        MessageType.CALL,
        1,
        method("update_parameters").args(
            update=thrift.ParameterUpdate(
                params=[thrift.Parameter("big", bytes(2 * MIB))], timestamp=0
            )
        ),
        framed=False,
    )[0]
    with socket.create_connection(node.address, timeout=CALL_TIMEOUT) as sock:
        with contextlib.suppress(OSError):  # (the node may close before it has all)
            sock.sendall(b"".join(bytes(p) for p in message))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert hint in reply.decode(errors="replace"), reply


async def test_a_reply_over_the_clients_max_frame_bytes_names_the_clients_limit(spawn) -> None:
    node = await spawn()
    async with client_of(node) as client:
        await client.update_arrays({"half": filler(MIB // 2)})
    hint = r"more than ParameterClient\(max_frame_bytes=...\), this client's limit \(65536 bytes"
    async with client_of(node, max_frame_bytes=65536, piece_bytes=32768) as client:
        with pytest.raises(RemoteProtocolError, match=hint):  # (its first reply)
            await client.get_arrays(["half"])
    limited = {"max_frame_bytes": 65536, "piece_bytes": 32768, "max_connections": 1}
    async with client_of(node, **limited) as client:
        await client.ping()  # (a reply seen on the connection: a node's)
        # (the connection breaks; the read, idempotent, may be sent again on a fresh one)
        with pytest.raises((ConnectionLostError, RemoteProtocolError), match=hint):
            await client.get_arrays(["half"])


@pytest.mark.parametrize(
    ("spec", "limit"),
    [
        ("1048576", MIB),
        ("64KiB", 64 * 1024),
        ("1MiB", MIB),
        ("1m", MIB),
        ("64k", 64 * 1024),
        ("1MB", MIB),
    ],
)
async def test_max_frame_bytes_sizes_parse_and_set_the_limit(spawn, spec, limit) -> None:
    node = await spawn("--max-frame-bytes", spec)
    async with client_of(node) as client:
        # The message around the data takes ~100 bytes: 1 KiB less fits.
        assert await client.update_arrays({"fits": filler(limit - 1024)}) == {"fits": 1}
        with pytest.raises(ConnectionLostError):
            await client.update_arrays({"too_big": filler(limit + 1)})
        assert set(await client.get_arrays(["fits", "too_big"])) == {"fits"}


@pytest.mark.parametrize(("spec", "budget"), [("64MiB", 64 * MIB), ("1g", 1024 * MIB), ("0", None)])
def test_max_receiving_bytes_parses_a_size_or_0_for_no_limit(spec, budget) -> None:
    args = build_parser().parse_args(["--max-receiving-bytes", spec])
    assert args.max_receiving_bytes == budget


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        pytest.param("--max-frame-bytes", "8", id="max-frame-bytes-8"),
        pytest.param("--idle-timeout", "nan", id="idle-timeout-nan"),
    ],
)
async def test_values_the_node_cannot_use_are_refused_up_front(spawn, flag, value) -> None:
    node = await spawn(flag, value, listening=False)
    started = await node.wait_line_or_exit()
    assert not started, f"the node started with {flag} {value}: {node.stdout_lines}"
    assert await node.wait_exit() == 2
    assert flag in node.stderr


# -- bad flags -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--port", "70000"], ["--port", "70000"]),
        (["--port", "abc"], ["--port", "'abc'"]),
        (["--port", "-1"], ["--port", "-1"]),
        (["--max-frame-bytes", "0"], ["--max-frame-bytes", "'0'"]),
        (["--max-frame-bytes", "12XB"], ["--max-frame-bytes", "'12XB'"]),
        (["--max-upload-bytes", "lots"], ["--max-upload-bytes", "'lots'"]),
        (["--max-receiving-bytes", "-1"], ["--max-receiving-bytes", "'-1'"]),
        (["--max-receiving-bytes", "half"], ["--max-receiving-bytes", "'half'"]),
        (["--idle-timeout", "-1"], ["--idle-timeout", "'-1'"]),
        (["--idle-timeout", "soon"], ["--idle-timeout", "'soon'"]),
        (["--log-level", "loud"], ["--log-level", "'loud'"]),
        (["--bogus"], ["unrecognized arguments", "--bogus"]),
        (["--peers", "a:b"], ["--peers", "'b'"]),
        (["--peers", ","], ["--peers", "no address"]),
        (["--advertise", "nohost"], ["--advertise", "host:port"]),
        (["--advertise", "0.0.0.0:9000"], ["--advertise", "every interface", "peers can reach"]),
        (["--advertise", "[::]:9000"], ["--advertise", "every interface", "peers can reach"]),
        (
            ["--host", "0.0.0.0", "--peers", "127.0.0.1:9"],
            ["--host 0.0.0.0", "--peers", "--advertise HOST:PORT", "peers can reach"],
        ),
        (
            ["--host", "::", "--peers", "127.0.0.1:9"],
            ["--host ::", "--peers", "--advertise HOST:PORT", "peers can reach"],
        ),
        (["--unreachable-warning", "-1"], ["--unreachable-warning", "'-1'"]),
        (["--unreachable-warning", "soon"], ["--unreachable-warning", "'soon'"]),
        (["--repair-interval", "0"], ["--repair-interval", "'0'"]),
        (["--replication-factor", "0"], ["--replication-factor", "at least 1 node"]),
        (["--replication-factor", "-2"], ["--replication-factor", "at least 1 node"]),
        (["--replication-factor", "most"], ["--replication-factor", "'most'", "or all"]),
        (["--acks", "2"], ["--acks", "'2'"]),
        (["--failure-timeout", "0"], ["--failure-timeout", "'0'"]),
        (["--drain-timeout", "never"], ["--drain-timeout", "'never'"]),
        (["--partition-bytes", "-1"], ["--partition-bytes", "'-1'"]),
        (["--partition-bytes", "big"], ["--partition-bytes", "'big'"]),
        (["--fsync", "sometimes"], ["--fsync", "'sometimes'"]),
        (["--data-dir", ""], ["--data-dir", "an empty path"]),
        (["--data-dir", " "], ["--data-dir", "an empty path"]),
        (["--fsync", "always"], ["--fsync", "need --data-dir"]),
        (["--ignore-corrupt-snapshot"], ["--ignore-corrupt-snapshot", "need --data-dir"]),
        (["--ignore-corrupt-log"], ["--ignore-corrupt-log", "need --data-dir"]),
        (["--max-connections", "0"], ["--max-connections", "'0'"]),
        (["--fold-threads", "0"], ["--fold-threads", "'0': must be at least 1"]),
        (["--fold-threads", "all"], ["--fold-threads", "'all' is not a whole number"]),
        (["--max-name-bytes", "many"], ["--max-name-bytes", "'many'"]),
        (["--port"], ["--port", "expected one argument"]),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_flags_exit_2_naming_the_flag_and_listen_nowhere(args, expected) -> None:
    port = free_port()
    # --port first: a bad value later on the line still overrides it.
    result = run_cli("--port", str(port), *args)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: aioparamsync-node")
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("aioparamsync-node: error: ")
    for text in expected:
        assert text in error, error
    assert_nothing_listens(port)


def test_port_in_use_exits_1_without_a_traceback() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--port", str(port))
        assert result.returncode == 1, result
        assert result.stdout == ""
        assert f"aioparamsync-node: cannot listen on 127.0.0.1:{port}" in result.stderr
        assert "Traceback" not in result.stderr
        # Our listener is untouched.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


def test_a_unix_socket_that_cannot_be_made_exits_1_naming_its_path(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "node.sock"
    port = free_port()
    result = run_cli("--port", str(port), "--unix-socket", str(path))
    assert result.returncode == 1, result
    assert result.stdout == ""
    assert f"aioparamsync-node: cannot listen on unix:{path}" in result.stderr
    assert "Traceback" not in result.stderr
    assert_nothing_listens(port)


# -- the limits --------------------------------------------------------------------------


async def test_the_limit_flags_set_the_nodes_limits(spawn) -> None:
    node = await spawn(
        "--max-name-bytes", "8", "--max-params-per-update", "2", "--max-names-per-request", "3"
    )  # fmt: skip
    async with client_of(node) as client:
        with pytest.raises(RequestError, match="of 9 bytes is longer than 8"):
            await client.update_arrays({"x" * 9: np.arange(2)})
        three = {name: np.arange(2) for name in ("a", "b", "c")}
        with pytest.raises(RequestError, match="3 parameters in one request; the limit is 2"):
            await client.update_arrays(three)
        with pytest.raises(RequestError, match="4 names in one request; the limit is 3"):
            await client.get_arrays(["a", "b", "c", "d"])
        # Within the limits, all is served; nothing refused was stored.
        assert await client.update_arrays({"x" * 8: np.arange(2), "a": np.arange(2)}) == {
            "x" * 8: 1,
            "a": 1,
        }
        assert sorted(await client.get_arrays(["x" * 8, "a", "b"])) == ["a", "x" * 8]
    rc, _ = await stop(node)
    assert rc == 0
    assert_clean(node.stderr)


# -- --help and --version -------------------------------------------------------------------


def test_help_lists_every_flag_and_exits_0() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result
    assert result.stderr == ""
    assert result.stdout.startswith("usage: aioparamsync-node")
    flags = {
        "-h", "--help", "--host", "--port", "--node-id", "--peers", "--advertise", "--follow",
        "--balance-interval",
        "--replication-factor", "--acks", "--failure-timeout", "--drain-timeout",
        "--partition-bytes", "--repair-interval", "--unreachable-warning", "--data-dir", "--fsync",
        "--ignore-corrupt-snapshot", "--ignore-corrupt-log",
        "--max-frame-bytes", "--max-upload-bytes", "--max-receiving-bytes", "--idle-timeout",
        "--log-level", "--version",
        "--request-timeout", "--max-connections", "--max-names-per-request",
        "--max-params-per-update", "--max-name-bytes", "--tls-cert", "--tls-key", "--tls-ca",
        "--metrics-port", "--peers-dns", "--peers-dns-interval", "--unix-socket",
        "--no-local-socket", "--processes",
        "--coordinator", "--coordinator-prefix", "--fold-threads",
    }  # fmt: skip
    declared = {s for a in build_parser()._actions for s in a.option_strings}
    assert declared == flags, "a flag was added or removed: update this test"
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", result.stdout), flag
    for choice in ("debug", "info", "warning", "error", "always", "batch", "never"):
        assert choice in result.stdout


SIZE_FLAGS = [
    "--max-frame-bytes",
    "--max-upload-bytes",
    "--max-receiving-bytes",
    "--partition-bytes",
]


def test_help_shows_sizes_in_units_the_size_flags_read() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result
    shown = " ".join(result.stdout.split())  # (argparse wraps lines)
    actions = {s: a for a in build_parser()._actions for s in a.option_strings}
    declared = {s for s, a in actions.items() if a.metavar == "SIZE"}
    assert declared == set(SIZE_FLAGS), "a size flag was added: check its help"
    for flag in SIZE_FLAGS:
        action = actions[flag]
        assert action.help is not None
        [default] = re.findall(r"\(default: ([^)]+)\)", action.help)
        assert re.fullmatch(r"\d+[KMG]iB", default), f"{flag}: {default}"
        # What the help shows, given back to the flag, is the default.
        assert action.type is not None and action.type(default) == action.default, flag
        assert f"(default: {default})" in shown, flag
    for raw in (str(MIB * 256), str(MIB * 128), str(16 * 1024 * MIB)):
        assert raw not in result.stdout
    assert "256MiB" in shown and "128MiB" in shown and "16GiB" in shown


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (0, "0"),
        (1000, "1000"),
        (1024, "1KiB"),
        (1536, "1536"),
        (3 * 1024 + 1, "3073"),
        (64 * MIB, "64MiB"),
        (MIB * 1024 * 3, "3GiB"),
        (MIB * 1536, "1536MiB"),
        (16 * 1024 * MIB * 1024, "16384GiB"),
    ],
)
def test_human_size_is_exact_and_reads_back(value, shown) -> None:
    assert human_size(value) == shown
    assert byte_size(shown) == value


def test_help_says_how_to_install_the_extras_from_the_checkout() -> None:
    result = run_cli("--help")
    shown = " ".join(result.stdout.split())
    assert "pip install '.[metrics]'" in shown
    assert "aioparamsync[" not in shown


def test_help_describes_memory_and_data_dir() -> None:
    result = run_cli("--help")
    assert "(in memory)" not in result.stdout
    description = " ".join(build_parser().description.split())
    assert "memory" in description and "--data-dir" in description


async def test_the_startup_line_says_where_the_data_is_kept(spawn, tmp_path: Path) -> None:
    memory = await spawn()
    kept = await spawn("--data-dir", str(tmp_path / "data"))
    assert f"listening on 127.0.0.1:{memory.port}, in memory\n" in memory.stderr
    assert f"listening on 127.0.0.1:{kept.port}, data in {tmp_path / 'data'}\n" in kept.stderr
    assert "in memory" not in kept.stderr
    for node in (memory, kept):
        rc, _ = await stop(node)
        assert rc == 0


def test_version_prints_the_version_and_exits_0() -> None:
    result = run_cli("--version")
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        f"aioparamsync-node {__version__}\n",
        "",
    )


def test_console_script_is_the_same_cli() -> None:
    # pip puts the script beside the interpreter of the environment it installs into.
    script = Path(sys.executable).with_name("aioparamsync-node")
    assert script.exists(), f"{script} is missing: is the package installed?"
    result = subprocess.run(
        [str(script), "--version"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, f"aioparamsync-node {__version__}\n")


# -- --idle-timeout -------------------------------------------------------------------------


async def test_idle_timeout_closes_silent_connections(spawn) -> None:
    node = await spawn("--idle-timeout", "0.5")
    t0 = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(*node.address), 5)
    try:
        async with client_of(node) as client:
            assert await client.ping() == node.node_id
            # The raw connection said nothing: the node closes it.
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert time.monotonic() - t0 >= 0.4
            # The client's connection went silent too and is closed; the client
            # carries on with a fresh one.
            await asyncio.sleep(1.0)
            info = await client.info()
            assert info.counters["idle_closed"] >= 2
            assert await client.ping() == node.node_id
    finally:
        writer.close()
    rc, _ = await stop(node)
    assert rc == 0
    assert_clean(node.stderr)


# -- configuration by environment ---------------------------------------------------------


def test_every_flag_has_a_variable_and_the_command_line_wins() -> None:
    from aioparamsync.cli.node import env_name, from_environment

    parser = build_parser()
    assert env_name("--data-dir") == "AIOPARAMSYNC_DATA_DIR"
    env = {
        "AIOPARAMSYNC_PORT": "9191",
        "AIOPARAMSYNC_PEERS": "127.0.0.1:9000,127.0.0.1:9001",
        "AIOPARAMSYNC_PARTITION_BYTES": "1MiB",
        "AIOPARAMSYNC_IGNORE_CORRUPT_SNAPSHOT": "yes",
        "AIOPARAMSYNC_LOG_LEVEL": "debug",
        "OTHER": "x",
    }
    args = parser.parse_args([*from_environment(parser, ["--port", "9292"], env), "--port", "9292"])
    assert args.port == 9292  # the flag wins
    assert args.peers == [("127.0.0.1", 9000), ("127.0.0.1", 9001)]
    assert args.partition_bytes == 1 << 20 and args.ignore_corrupt_snapshot
    assert args.log_level == "debug"
    # A switch set false is not set; nothing set is the defaults.
    off = {"AIOPARAMSYNC_IGNORE_CORRUPT_SNAPSHOT": "off"}
    assert not parser.parse_args(from_environment(parser, [], off)).ignore_corrupt_snapshot
    assert from_environment(parser, [], {}) == []
    assert parser.parse_args([*from_environment(parser, ["--port=1"], env), "--port=1"]).port == 1


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("AIOPARAMSYNC_PORT", "abc", "AIOPARAMSYNC_PORT='abc' (for --port): 'abc' is not a port"),
        ("AIOPARAMSYNC_LOG_LEVEL", "loud", "(for --log-level): one of debug, info"),
        ("AIOPARAMSYNC_IGNORE_CORRUPT_SNAPSHOT", "maybe", "a switch is one of 1/true"),
        ("AIOPARAMSYNC_PARTITION_BYTES", "-3", "AIOPARAMSYNC_PARTITION_BYTES='-3'"),
    ],
)
def test_a_bad_variable_is_refused_naming_it(variable: str, value: str, message: str) -> None:
    import os

    result = subprocess.run(
        NODE,
        env={**os.environ, variable: value},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        check=False,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("given", ["/job/", "/job//", "/aioparamsync/job/", "/job"])
def test_a_coordinator_prefix_is_taken_with_or_without_a_trailing_slash(given: str) -> None:
    # (etcd's users write a prefix "/job/"; its keys are the same as under "/job")
    from aioparamsync.cli.node import from_environment

    parser = build_parser()
    expected = given.rstrip("/")
    assert parser.parse_args(["--coordinator-prefix", given]).coordinator_prefix == expected
    variable = from_environment(parser, [], {"AIOPARAMSYNC_COORDINATOR_PREFIX": given})
    assert parser.parse_args(variable).coordinator_prefix == expected


@pytest.mark.parametrize("given", ["/", "//", "job/", "/a//b/", ""])
def test_a_coordinator_prefix_that_is_no_path_is_refused(given: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--coordinator-prefix", given])
    assert exited.value.code == 2
    assert "a prefix is a path like /aioparamsync/NAME" in capsys.readouterr().err


def test_help_says_flags_can_come_from_the_environment() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    assert "AIOPARAMSYNC_<FLAG>" in result.stdout and "wins over its variable" in result.stdout


async def test_a_node_configured_by_environment_serves() -> None:
    import os

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *NODE,
        env={**os.environ, "AIOPARAMSYNC_PORT": str(port), "AIOPARAMSYNC_NODE_ID": "from-env"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = b""
        while b"listening on" not in line:  # (log lines come first)
            line = await asyncio.wait_for(proc.stderr.readline(), START_TIMEOUT)
            assert line, "the node exited before it listened"
        assert f"listening on 127.0.0.1:{port}" in line.decode(), line
        async with ParameterClient(f"127.0.0.1:{port}") as client:
            assert await client.ping() == "from-env"
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), START_TIMEOUT)
