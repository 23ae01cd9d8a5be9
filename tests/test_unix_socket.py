"""Colocated workers over a Unix socket: ``--unix-socket PATH`` and ``unix:PATH`` addresses.

Real sockets in a temporary directory: a node serving TCP and a Unix socket at
once, our client and Apache Thrift's generated one on the socket, a node
process started with the flag (and its environment variable), and what goes
wrong: a path taken by a live node, a file that is no socket, a path too long,
bad addresses, TLS asked for where none is spoken.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import launch

from aioparamsync import ConnectError, Node, ParameterClient
from aioparamsync.client.addresses import parse_address, parse_addresses
from aioparamsync.server.transport import ListenError

CALL_TIMEOUT = 10.0


def is_socket(path: str) -> bool:
    return Path(path).is_socket()


@pytest.fixture
def sock_path(tmp_path: Path) -> str:
    return str(tmp_path / "node.sock")


async def test_a_node_serves_tcp_and_its_unix_socket_alike(sock_path: str) -> None:
    big = np.random.default_rng(0).random(300_000, dtype=np.float32)  # (sent by reference)
    async with (
        Node(port=0, unix_socket=sock_path) as node,
        ParameterClient(f"unix:{sock_path}", timeout=CALL_TIMEOUT) as local,
        ParameterClient(node.address, timeout=CALL_TIMEOUT) as remote,
    ):
        assert is_socket(sock_path)
        await local.update_arrays({"big": big, "small": np.arange(4, dtype=np.int64)})
        got = await remote.get_arrays(["big", "small"])
        np.testing.assert_array_equal(got["big"], big)
        await remote.update_arrays({"small": np.full(4, 7, np.int64)})
        # read-your-writes on the socket, calls in flight at once
        results = await asyncio.gather(*(local.get_arrays(["small", "big"]) for _ in range(16)))
        for r in results:
            np.testing.assert_array_equal(r["small"], np.full(4, 7, np.int64))
            np.testing.assert_array_equal(r["big"], big)
        assert (await local.info()).node_id == node.node_id
    assert not is_socket(sock_path)  # removed when the node stops


async def test_the_generated_apache_thrift_client_works_over_the_unix_socket(
    sock_path: str,
) -> None:
    from test_interop import APACHE_STACKS, _generate

    from aioparamsync.wire import IDL_PATH

    gen = _generate(IDL_PATH, Path(sock_path).parent / "gen")
    from thrift.transport import TSocket

    async with Node(port=0, unix_socket=sock_path):
        transport_cls, protocol_cls = APACHE_STACKS["framed-binary"]
        tsock = TSocket.TSocket(unix_socket=sock_path)
        tsock.setTimeout(10_000)
        transport = transport_cls(tsock)
        client = gen.service.Client(protocol_cls(transport))
        data = np.arange(6, dtype=np.float32).tobytes()

        def calls() -> bytes:
            transport.open()
            try:
                param = gen.ttypes.Parameter(name="w", data=data, dtype="float32", shape=[6])
                client.update_parameters(gen.ttypes.ParameterUpdate(params=[param], timestamp=1))
                request = gen.ttypes.ParameterRequest(param_names=["w"])
                return client.get_parameters(request).params[0].data
            finally:
                transport.close()

        assert await asyncio.to_thread(calls) == data


async def test_a_socket_file_left_by_a_node_that_is_gone_is_replaced(sock_path: str) -> None:
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(sock_path)  # bound, never listening: what a killed node leaves
    left.close()
    async with (
        Node(port=0, unix_socket=sock_path),
        ParameterClient(f"unix:{sock_path}", timeout=CALL_TIMEOUT) as client,
    ):
        await client.ping()


async def test_a_path_a_live_node_listens_on_is_refused_and_left_to_it(sock_path: str) -> None:
    async with (
        Node(port=0, unix_socket=sock_path),
        ParameterClient(f"unix:{sock_path}", timeout=CALL_TIMEOUT) as client,
    ):
        await client.update_arrays({"w": np.ones(3, np.float32)})
        second = Node(port=0, unix_socket=sock_path)
        with pytest.raises(ListenError, match="another server listens on it"):
            await second.start()
        await second.stop()
        # the first node still serves its socket
        np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], np.ones(3))


@pytest.mark.parametrize("what", ["regular file", "directory", "too long", "no directory"])
async def test_a_path_that_cannot_be_a_socket_is_a_clear_error(tmp_path: Path, what: str) -> None:
    path = tmp_path / "node.sock"
    if what == "regular file":
        path.write_text("keep me")
    elif what == "directory":
        path.mkdir()
    elif what == "too long":
        path = tmp_path / ("x" * 120)
    else:
        path = tmp_path / "missing" / "node.sock"
    node = Node(port=0, unix_socket=path)
    with pytest.raises(ListenError, match=re.escape(f"cannot listen on unix:{path}")):
        await node.start()
    await node.stop()
    if what == "regular file":
        assert path.read_text() == "keep me"  # never removed


async def test_the_node_process_takes_the_flag_and_its_environment_variable(
    tmp_path: Path,
) -> None:
    for how in ("flag", "environment"):
        path = str(tmp_path / f"{how}.sock")
        if how == "flag":
            node = await launch("--port", "0", "--unix-socket", path)
        else:
            os.environ["AIOPARAMSYNC_UNIX_SOCKET"] = path
            try:
                node = await launch("--port", "0")
            finally:
                del os.environ["AIOPARAMSYNC_UNIX_SOCKET"]
        try:
            await node.wait_listening()
            assert node.stdout_lines[0].rstrip("\n").endswith(f" and unix:{path}")
            async with ParameterClient(f"unix:{path}", timeout=CALL_TIMEOUT) as client:
                await client.update_arrays({"w": np.arange(3, dtype=np.float32)})
            async with ParameterClient(node.address, timeout=CALL_TIMEOUT) as client:
                got = await client.get_arrays(["w"])
            np.testing.assert_array_equal(got["w"], np.arange(3, dtype=np.float32))
        finally:
            await node.close()


async def test_a_second_node_process_on_a_taken_path_exits_with_why(sock_path: str) -> None:
    first = await launch("--port", "0", "--unix-socket", sock_path)
    try:
        await first.wait_listening()
        second = await launch("--port", "0", "--unix-socket", sock_path)
        rc = await second.wait_exit()
        assert rc == 1
        assert f"cannot listen on unix:{sock_path}: another server listens on it" in second.stderr
        assert is_socket(sock_path)
    finally:
        await first.close()


def test_unix_addresses_parse_and_bad_ones_are_refused() -> None:
    assert parse_address("unix:/run/ps.sock") == ("unix:/run/ps.sock", 0)
    assert parse_address(("unix:/run/ps.sock", 0)) == ("unix:/run/ps.sock", 0)
    assert parse_addresses("unix:/a.sock,127.0.0.1:9") == [("unix:/a.sock", 0), ("127.0.0.1", 9)]
    for bad in ("unix:", "unix:/a\0b"):
        with pytest.raises(ValueError, match="unix:PATH"):
            parse_address(bad)
    with pytest.raises(ValueError, match="no TLS"):
        ParameterClient("unix:/run/ps.sock", ssl=ssl.create_default_context())


async def test_a_socket_nobody_listens_on_is_a_connect_error_naming_it(sock_path: str) -> None:
    async with ParameterClient(f"unix:{sock_path}", connect_timeout=2.0) as client:
        with pytest.raises(ConnectError, match=re.escape(f"cannot connect to unix:{sock_path}")):
            await client.ping()


def _wmem_max() -> int:
    return int(Path("/proc/sys/net/core/wmem_max").read_text())


async def test_both_ends_of_a_unix_socket_send_from_a_large_buffer(sock_path: str) -> None:
    # (the kernel's default, 208 KiB, made the step of many small tensors slower than TCP's)
    from aioparamsync.wire import UNIX_SEND_BUFFER_BYTES

    most = _wmem_max()
    want = min(UNIX_SEND_BUFFER_BYTES, most)  # (the kernel answers twice what it keeps)
    async with (
        Node(port=0, unix_socket=sock_path) as node,
        ParameterClient(f"unix:{sock_path}", timeout=CALL_TIMEOUT) as client,
    ):
        await client.ping()
        (conn,) = client._connections
        ends = [conn.transport.get_extra_info("socket")]
        ends += [c.transport.get_extra_info("socket") for c in node.server.connections]
        assert len(ends) == 2
        for sock in ends:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * want
