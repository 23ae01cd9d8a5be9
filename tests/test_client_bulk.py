"""A large read or write on one connection holds up no other call of the client.

A proxy between the client and a node holds back the first connection's bytes
in one direction, mid-message: a large reply (or a large upload) is then under
way on it for as long as the test likes. Another call of the same client must
not queue behind it: the pool sends it on another connection. Nothing is
timed: the held transfer ends only when the test lets it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioparamsync import Node, ParameterClient

pytestmark = pytest.mark.timeout(60)

MiB = 1024 * 1024
# Bytes of the held direction let through before it is held (the start of the message).
LET_THROUGH = 256 * 1024
# How long a call behind the held transfer is given (far more than it takes).
DEADLINE = 20.0


class HoldingProxy:
    """A TCP proxy to a node whose first connection stops passing bytes one way.

    ``direction`` is "down" (node to client: a reply) or "up" (client to node:
    a request); after ``let_through`` bytes that way, the first connection
    holds the rest until :meth:`release`. Other connections pass freely.
    """

    def __init__(
        self, target: tuple[str, int], direction: str, let_through: int = LET_THROUGH
    ) -> None:
        self.target = target
        self.direction = direction
        self.let_through = let_through
        self.released = asyncio.Event()
        self.holding = asyncio.Event()  # set once the first connection holds bytes back
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> HoldingProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.released.set()
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    def release(self) -> None:
        self.released.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        first = self.connections == 0
        self.connections += 1
        node_reader, node_writer = await asyncio.open_connection(*self.target)
        try:
            await asyncio.gather(
                self._pump(reader, node_writer, held=first and self.direction == "up"),
                self._pump(node_reader, writer, held=first and self.direction == "down"),
            )
        except (ConnectionError, OSError):
            pass
        finally:
            self._tasks.discard(task)  # type: ignore[arg-type]
            for end in (writer, node_writer):
                end.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, held: bool
    ) -> None:
        passed = 0
        while data := await reader.read(64 * 1024):
            if held and passed >= self.let_through and not self.released.is_set():
                self.holding.set()
                await self.released.wait()
            passed += len(data)
            writer.write(data)
            await writer.drain()


@pytest.fixture
async def node_with_big() -> tuple[Node, np.ndarray]:
    big = np.arange(8 * MiB, dtype=np.float32)  # 32 MiB
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as setup:
        await setup.update_arrays({"big": big, "w": np.zeros(4, np.float32)})
        yield node, big


async def test_a_write_does_not_wait_behind_a_large_read(
    node_with_big: tuple[Node, np.ndarray],
) -> None:
    node, big = node_with_big
    async with (
        HoldingProxy(node.address, "down") as proxy,
        ParameterClient(("127.0.0.1", proxy.port), timeout=None, shared_memory=0) as client,
    ):
        read = asyncio.ensure_future(client.get_arrays(["big"]))
        await asyncio.wait_for(proxy.holding.wait(), DEADLINE)  # its reply is under way, held
        try:
            versions = await asyncio.wait_for(
                client.update_arrays({"w": np.ones(4, np.float32)}), DEADLINE
            )
            got = await asyncio.wait_for(client.get_arrays(["w"]), DEADLINE)
        finally:
            proxy.release()
        assert versions["w"] == 2 and got["w"].tolist() == [1.0] * 4
        assert not read.done(), "the large read ended before its reply was let through"
        np.testing.assert_array_equal((await read)["big"], big)


async def test_a_read_does_not_wait_behind_a_large_write(
    node_with_big: tuple[Node, np.ndarray],
) -> None:
    node, big = node_with_big
    async with (
        HoldingProxy(node.address, "up") as proxy,
        ParameterClient(("127.0.0.1", proxy.port), timeout=None, shared_memory=0) as client,
    ):
        await client.get_arrays(["w"])  # the first connection, open
        write = asyncio.ensure_future(client.update_arrays({"big": big[::-1].copy()}))
        await asyncio.wait_for(proxy.holding.wait(), DEADLINE)  # its upload is under way, held
        try:
            got = await asyncio.wait_for(client.get_arrays(["w"]), DEADLINE)
        finally:
            proxy.release()
        assert got["w"].tolist() == [0.0] * 4
        assert not write.done(), "the large write ended before its upload was let through"
        assert (await write)["big"] == 2
        np.testing.assert_array_equal((await client.get_arrays(["big"]))["big"], big[::-1])


async def test_a_write_sent_before_a_large_reply_starts_does_not_wait_for_it(
    node_with_big: tuple[Node, np.ndarray],
) -> None:
    """A call made while another is in flight on the only connection, its large reply not
    begun yet, goes on another connection: a node writes a large reply whole before it
    reads the next call (it stops reading while its writes wait), so a call pipelined
    behind it would wait for all of it (a training loop's push behind its pull)."""
    node, big = node_with_big
    async with (
        HoldingProxy(node.address, "down", let_through=1024) as proxy,
        ParameterClient(("127.0.0.1", proxy.port), timeout=None, shared_memory=0) as client,
    ):
        await client.get_arrays(["w"])  # the first connection, open (its small reply passes)
        read = asyncio.ensure_future(client.get_arrays(["big"]))
        await asyncio.sleep(0)  # (the read sent: in flight there, no byte of its reply back)
        try:
            versions = await asyncio.wait_for(
                client.update_arrays({"w": np.ones(4, np.float32)}), DEADLINE
            )
        finally:
            proxy.release()
        assert versions["w"] == 2
        assert proxy.connections >= 2
        np.testing.assert_array_equal((await read)["big"], big)
