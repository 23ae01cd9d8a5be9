"""A client that reaches a node on its host over TCP moves to the node's Unix socket
(``aioparamsync.client.local``), and shares memory with it there.

Real nodes (in this process, and as processes of their own), real TCP and Unix
sockets (abstract ones, and files in a temporary directory), real proxies: the
client moves and its reads and pushes come through shared memory, with the
values TCP gives; and where it must not or cannot move, it stays on TCP and
works as before: told not to (``shared_memory=0``), a node told not to listen
there (``local_socket=False``, ``--no-local-socket``), a TLS node, a proxy
between them, a socket gone, a node restarted on its port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trustme
from cluster_helpers import NODE_COMMAND, NodeProcess, assert_, eventually, free_port, launch
from raw_helpers import slow_link

from aioparamsync import Node, ParameterClient, sgd
from aioparamsync.server import transport
from aioparamsync.tls import client_context, server_context

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not hasattr(os, "memfd_create"),
    reason="Linux: abstract Unix sockets, memfd",
)

CALL_TIMEOUT = 20.0
MOVE_TIMEOUT = 10.0


def families(node: Node) -> list[int]:
    """The address family of each connection the node has open."""
    out = []
    for conn in node.server.connections:
        transport = conn.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            out.append(sock.family)
    return out


async def moved(client: ParameterClient, node: Node) -> str:
    """Wait until ``client`` is on the node's Unix socket, its TCP connections closed;
    answer the socket's path."""
    info = await client.info()
    assert info.local_socket and info.local_socket.startswith("unix:"), info.local_socket

    def there() -> None:
        assert client.locals == {0: info.local_socket[len("unix:") :]}, client.locals
        assert socket.AF_UNIX in families(node) and socket.AF_INET not in families(node)

    await eventually(there, timeout=MOVE_TIMEOUT, interval=0.01)
    return client.locals[0]


async def train(client: ParameterClient, steps: int) -> np.ndarray:
    """``steps`` steps of sgd(0.5) on w (1 MiB of float32, starting at 0) with gradients
    of ones; answer w as read after."""
    for _ in range(steps):
        w = (await client.get_arrays(["w"]))["w"]
        await client.push_gradients({"w": np.ones_like(w)})
    return (await client.get_arrays(["w"]))["w"]


@contextlib.asynccontextmanager
async def started(**kwargs: object) -> AsyncIterator[Node]:
    async with Node("127.0.0.1", 0, **kwargs) as node:  # type: ignore[arg-type]
        async with ParameterClient(node.address, shared_memory=0) as setup:
            await setup.update_arrays({"w": np.zeros(1 << 18, np.float32)}, rules=sgd(0.5))
        yield node


async def test_a_client_on_the_nodes_host_moves_to_its_unix_socket_and_shares_memory() -> None:
    async with started() as node, ParameterClient(node.address, timeout=CALL_TIMEOUT) as client:
        assert node.server.local_socket.startswith("unix:@aioparamsync-")
        await client.ping()
        path = await moved(client, node)
        assert path.startswith("@")
        w = await train(client, 3)
        np.testing.assert_array_equal(w, np.full(1 << 18, -1.5, np.float32))
        stats = client.stats()["shared_memory"]
        # (the first read learns the answer's size; the pushes share after a read did)
        assert stats["reads"] == 3 and stats["pushes"] == 2, stats
        assert client.host == "127.0.0.1"  # (the address given stays the client's)
        # Its address given as it is named: a client of the socket itself shares too.
        async with ParameterClient(f"unix:{path}", timeout=CALL_TIMEOUT) as direct:
            np.testing.assert_array_equal(await train(direct, 2), np.full(1 << 18, -2.5))
            assert direct.stats()["shared_memory"]["pushes"] == 1


async def test_calls_in_flight_as_it_moves_are_answered() -> None:
    async with started() as node, ParameterClient(node.address, timeout=CALL_TIMEOUT) as client:
        ones = np.ones(1 << 18, np.float32)
        # (the first answer starts the move; the others are on TCP as it goes)
        results = await asyncio.gather(
            *(client.push_gradients({"w": ones}) for _ in range(20)),
            *(client.get_arrays(["w"]) for _ in range(20)),
        )
        assert sorted(r["w"] for r in results[:20]) == list(range(2, 22))
        await moved(client, node)
        np.testing.assert_array_equal(await train(client, 0), np.full(1 << 18, -10.0))


@pytest.mark.parametrize("how", ["shared_memory=0", "local_socket=False"])
async def test_a_client_or_node_told_not_to_stays_on_tcp(how: str) -> None:
    client_args = {"shared_memory": 0} if how == "shared_memory=0" else {}
    node_args = {"local_socket": False} if how == "local_socket=False" else {}
    async with (
        started(**node_args) as node,
        ParameterClient(node.address, timeout=CALL_TIMEOUT, **client_args) as client,
    ):
        np.testing.assert_array_equal(await train(client, 3), np.full(1 << 18, -1.5))
        await asyncio.sleep(0.2)  # (time to move, were it to)
        assert client.locals == {} and "shared_memory" not in client.stats()
        assert set(families(node)) == {socket.AF_INET}
        if node_args:
            assert node.server.local_socket is None
            assert (await client.info()).local_socket is None


async def test_a_node_serving_tls_has_no_local_socket(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert, ca_file = tmp_path / "node.pem", tmp_path / "ca.pem"
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(cert))
    ca.cert_pem.write_to_path(str(ca_file))
    async with (
        Node("127.0.0.1", 0, ssl=server_context(str(cert))) as node,
        ParameterClient(node.address, ssl=client_context(str(ca_file))) as client,
    ):
        # (an abstract socket has no permissions: it would go around the TLS clients need)
        assert node.server.local_socket is None
        assert (await client.info()).local_socket is None
        await asyncio.sleep(0.2)
        assert client.locals == {}


async def test_a_node_with_a_unix_socket_file_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # (given relative, named whole: clients run elsewhere)
    path = str(tmp_path / "ps.sock")
    async with (
        started(unix_socket="ps.sock") as node,
        ParameterClient(node.address, timeout=CALL_TIMEOUT) as client,
    ):
        assert node.server.local_socket == f"unix:{path}"
        await client.ping()
        assert await moved(client, node) == path
        np.testing.assert_array_equal(await train(client, 2), np.full(1 << 18, -1.0))
        assert client.stats()["shared_memory"]["pushes"] >= 1


async def test_a_socket_the_client_cannot_reach_leaves_it_on_tcp(tmp_path: Path) -> None:
    """As in a container of its own (another network namespace, another file system):
    the node names a socket that is not there for the client."""
    path = str(tmp_path / "ps.sock")
    async with started(unix_socket=path) as node:
        os.unlink(path)
        async with ParameterClient(node.address, timeout=CALL_TIMEOUT) as client:
            np.testing.assert_array_equal(await train(client, 3), np.full(1 << 18, -1.5))
            await asyncio.sleep(0.2)
            assert client.locals == {} and set(families(node)) == {socket.AF_INET}


async def test_a_client_through_a_proxy_stays_on_tcp() -> None:
    """A proxy on this host, on a port of its own (a tunnel, a fault injector): the node
    is not gone around."""
    async with (
        started() as node,
        slow_link(node.address) as address,
        ParameterClient(address, timeout=CALL_TIMEOUT) as client,
    ):
        np.testing.assert_array_equal(await train(client, 3), np.full(1 << 18, -1.5))
        await asyncio.sleep(0.2)
        assert client.locals == {} and set(families(node)) == {socket.AF_INET}


async def test_a_node_restarted_on_its_port_is_found_again() -> None:
    port = free_port()
    first = Node("127.0.0.1", port)
    await first.start()
    running = True
    try:
        async with ParameterClient(("127.0.0.1", port), timeout=CALL_TIMEOUT) as client:
            await client.update_arrays({"w": np.zeros(1 << 18, np.float32)}, rules=sgd(0.5))
            before = await moved(client, first)
            await first.stop()
            running = False
            async with Node("127.0.0.1", port) as second:
                # (its old socket is gone: the client connects over TCP, asks again, moves)
                await eventually(client.ping, timeout=MOVE_TIMEOUT, retry_on=(Exception,))
                await client.update_arrays({"w": np.zeros(1 << 18, np.float32)}, rules=sgd(0.5))
                after = await moved(client, second)
                assert after != before
                np.testing.assert_array_equal(await train(client, 2), np.full(1 << 18, -1.0))
                assert client.stats()["shared_memory"]["pushes"] >= 1
    finally:
        if running:
            await first.stop()


async def test_the_node_process_names_its_socket_unless_told_not_to() -> None:
    for flags, local in (((), True), (("--no-local-socket",), False)):
        proc = await launch("--port", "0", *flags)
        try:
            await proc.wait_listening()
            async with ParameterClient(proc.address, timeout=CALL_TIMEOUT) as client:
                info = await client.info()
                if local:
                    assert info.local_socket.startswith("unix:@aioparamsync-"), info
                    await eventually(lambda: assert_(bool(client.locals)), timeout=MOVE_TIMEOUT)
                else:
                    assert info.local_socket is None
                    await asyncio.sleep(0.2)
                    assert client.locals == {}
                await client.update_arrays({"w": np.zeros(4, np.float32)})
                assert (await client.get_arrays(["w"]))["w"].tolist() == [0.0] * 4
        finally:
            await proc.close()


@pytest.mark.skipif(
    shutil.which("unshare") is None or os.geteuid() != 0, reason="unshare --pid needs root"
)
async def test_a_node_that_cannot_see_the_client_is_lent_no_memory_after_two_reads() -> None:
    """A node in a PID namespace of its own (a container without a shared PID namespace)
    is on this network namespace's abstract socket, but cannot open the client's memory:
    it answers in messages, and after two reads that lent it room the client lends none,
    and gives back the segment it made."""
    proc = NodeProcess(
        await asyncio.create_subprocess_exec(
            *("unshare", "--pid", "--fork", "--kill-child", *NODE_COMMAND, "--port", "0"),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    )
    try:
        await proc.wait_listening()
        async with ParameterClient(proc.address, timeout=CALL_TIMEOUT) as client:
            await client.update_arrays({"w": np.zeros(1 << 18, np.float32)}, rules=sgd(0.5))
            await eventually(lambda: assert_(bool(client.locals)), timeout=MOVE_TIMEOUT)
            np.testing.assert_array_equal(await train(client, 4), np.full(1 << 18, -2.0))
            stats = client.stats()["shared_memory"]
            assert (stats["reads"], stats["pushes"]) == (0, 0), stats
            assert (stats["segments"], stats["bytes"], stats["lent"]) == (0, 0, 0), stats
    finally:
        await proc.close()


async def test_a_node_that_cannot_listen_on_a_local_socket_serves_over_tcp(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As in a sandbox that refuses Unix sockets: the node starts all the same, says so,
    and names no socket; its clients stay on TCP."""

    async def refused(factory: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(transport, "_listen_abstract", refused)
    async with started() as node, ParameterClient(node.address, timeout=CALL_TIMEOUT) as client:
        assert node.server.local_socket is None
        assert "no local socket" in caplog.text
        np.testing.assert_array_equal(await train(client, 2), np.full(1 << 18, -1.0))
        await asyncio.sleep(0.2)
        assert client.locals == {}
