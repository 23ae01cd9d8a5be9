"""Raw connections to a node, for tests that speak the wire themselves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from aioparamsync.wire import MessageType, Protocol, encode_message

# The longest any one step may take (seconds).
TIMEOUT = 3.0


@contextlib.asynccontextmanager
async def raw(
    address: tuple[str, int],
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A plain TCP connection to ``address``, closed (bounded) at the end."""
    async with asyncio.timeout(TIMEOUT):
        reader, writer = await asyncio.open_connection(*address)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            async with asyncio.timeout(TIMEOUT):
                await writer.wait_closed()


async def wait_until(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    """Wait (bounded) for a condition on the node's state; not a fixed delay."""
    async with asyncio.timeout(timeout):
        # the node's state has no event to await: poll it
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


def encoded(
    name: str,
    args: Any,
    *,
    seqid: int = 1,
    protocol: Protocol = Protocol.BINARY,
    framed: bool = True,
    mtype: int = MessageType.CALL,
) -> bytes:
    """One message (a call, by default) as bytes, framed by default."""
    parts, size = encode_message(name, mtype, seqid, args, protocol, framed=framed)
    data = b"".join(bytes(p) for p in parts)
    assert len(data) == size
    return data


@contextlib.asynccontextmanager
async def slow_link(
    target: tuple[str, int], *, first_read_after: float = 0.0, reply_delay: float = 0.0
) -> AsyncIterator[tuple[str, int]]:
    """A proxy to ``target`` on 127.0.0.1: yields its address.

    Each connection is read from only after ``first_read_after`` seconds (the
    client's bytes wait in its own buffers meanwhile), and each chunk the
    target sends back is held ``reply_delay`` seconds.
    """
    relays: set[asyncio.Task] = set()

    async def pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
    ) -> None:
        try:
            while data := await reader.read(1 << 20):
                if delay:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def link(
        client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        await asyncio.sleep(first_read_after)
        target_reader, target_writer = await asyncio.open_connection(*target)
        relays.add(asyncio.ensure_future(pipe(client_reader, target_writer, 0)))
        relays.add(asyncio.ensure_future(pipe(target_reader, client_writer, reply_delay)))

    proxy = await asyncio.start_server(link, "127.0.0.1", 0)
    try:
        yield proxy.sockets[0].getsockname()[:2]
    finally:
        proxy.close()
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        await proxy.wait_closed()
