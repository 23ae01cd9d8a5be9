"""A client pointed at a server that is no node fails at once, quoting what came back.

Real servers on 127.0.0.1 and a port the kernel picks: Python's own HTTP
server, a node's metrics port (Prometheus), servers that answer an HTTP status
line, a TLS alert or random bytes. Each call fails with a RemoteProtocolError
naming the address and the bytes, long before its deadline (the client's is 10
minutes here; each test is bounded far below). A server that accepts and closes
at once, or says nothing, keeps its own errors. The first bytes of a
connection are judged by a function with no I/O, tested first, whole and one
byte at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest
from raw_helpers import encoded

from aioparamsync import (
    CallTimeout,
    ConnectionLostError,
    Node,
    ParameterClient,
    ProtocolError,
    RemoteProtocolError,
    thrift,
)
from aioparamsync.client.connection import HEAD_BYTES, _reply_head
from aioparamsync.wire import MessageType, Protocol, method

pytestmark = pytest.mark.timeout(60)

# Far beyond each test's bound: a call that waited for its deadline fails the test.
LONG = 600.0
# The bound of what should fail at once.
AT_ONCE = 10.0
MAX_FRAME = 256 * 1024 * 1024


def _reply(protocol: Protocol = Protocol.BINARY, mtype: int = MessageType.REPLY) -> bytes:
    return encoded("ping", method("ping").result(success="n"), protocol=protocol, mtype=mtype)


# -- judging a connection's first bytes, with no I/O ----------------------------------------


@pytest.mark.parametrize(
    ("head", "within"),
    [
        (_reply(), 8),  # length, 80 01 00 02
        (_reply(mtype=MessageType.EXCEPTION), 8),
        (_reply(Protocol.COMPACT), 6),  # length, 82 41
        (_reply(Protocol.COMPACT, MessageType.EXCEPTION), 6),
        (b"\0\0\0\0" * 3 + _reply(), 20),  # empty frames first (Apache Thrift flushes them)
    ],
    ids=["binary", "binary exception", "compact", "compact exception", "after empty frames"],
)
def test_a_nodes_reply_is_told_by_its_header_and_not_before(head: bytes, within: int) -> None:
    verdicts = [_reply_head(head[:n], MAX_FRAME) for n in range(len(head) + 1)]
    assert verdicts.index(True) == within
    assert set(verdicts[:within]) == {None}  # a prefix of a reply is never refused
    assert set(verdicts[within:]) == {True}


@pytest.mark.parametrize(
    ("head", "within"),
    [
        (b"HTTP/1.0 400 Bad Request\r\n\r\n", 1),  # "H": a length of over 1.2 GB
        (b'<!DOCTYPE HTML>\n<html lang="en">', 1),
        (b"\x15\x03\x03\x00\x02\x02\x32", 1),  # a TLS alert
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 1),  # a TLS handshake
        (b"\x10\x00\x00\x01", 4),  # one byte over the largest frame
        (b"\x00\x00\x00\x20\x41\x42", 5),  # a frame of text
        (b"\x00\x00\x00\x20\x80\x02\x00\x02", 6),  # binary, but version 2
        (b"\x00\x00\x00\x20\x80\x01\x00\x01", 8),  # a call, not a reply
        (b"\x00\x00\x00\x20\x80\x01\x00\x04", 8),  # a oneway call
        (b"\x00\x00\x00\x20\x82\x22", 6),  # compact, version 2
        (b"\x00\x00\x00\x20\x82\x81", 6),  # compact, a oneway call
    ],
)
def test_what_cannot_begin_a_reply_is_refused_as_soon_as_it_shows(head, within) -> None:
    verdicts = [_reply_head(head[:n], MAX_FRAME) for n in range(1, len(head) + 1)]
    assert verdicts.index(False) + 1 == within
    assert set(verdicts[: within - 1]) <= {None}
    assert set(verdicts[within - 1 :]) == {False}


def test_the_largest_frame_is_the_clients() -> None:
    head = (1000).to_bytes(4, "big") + _reply()[4:8]
    assert _reply_head(head, 1000) is True
    assert _reply_head(head, 999) is False


@pytest.mark.parametrize("seed", range(200))
def test_random_bytes_are_refused_within_eight_bytes(seed: int) -> None:
    garbage = random.Random(seed).randbytes(64)
    verdict = _reply_head(garbage[:8], MAX_FRAME)
    # (a 1 in 2**30 chance of looking like a header: not among these seeds)
    assert verdict is False, garbage[:8]


# -- servers that are no node ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def tcp_server(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[tuple[str, int]]:
    """``serve(reader, writer)`` for each connection on 127.0.0.1; yields the address."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        server.close()


@contextlib.contextmanager
def python_http_server():
    """``http.server`` in a thread: it answers what is no HTTP request with a 400 page."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass  # (its access log would go to stderr)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield server.server_address[:2]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=AT_ONCE)


async def answers_a_request_head(reader, writer) -> None:
    # As an HTTP server does: nothing until the request's head is in.
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()


async def answers_at_once(reader, writer) -> None:
    writer.write(b"HTTP/1.0 200 OK\r\nServer: x\r\n\r\nhello\n")
    await writer.drain()
    await reader.read()  # (until the client goes)


def sends(data: bytes):
    async def serve(reader, writer) -> None:
        writer.write(data)
        await writer.drain()
        await reader.read()  # open: it is the bytes that tell, not a close

    return serve


async def fails_at_once(address, call=lambda c: c.ping(), *, addresses=None) -> RemoteProtocolError:
    async with ParameterClient(addresses or address, timeout=LONG) as client:
        with pytest.raises(RemoteProtocolError) as info:
            async with asyncio.timeout(AT_ONCE):
                await call(client)
    error = info.value
    host, port = address
    assert str(error).startswith(f"the server at {host}:{port} answered b"), error
    assert "which is not a framed Thrift message" in str(error)
    assert isinstance(error, ProtocolError) and not isinstance(error, ConnectionLostError)
    return error


async def test_pythons_http_server() -> None:
    with python_http_server() as address:
        error = await fails_at_once(address)
    assert "b'<!DOCTYPE HTML>" in str(error)  # its 400 page
    assert str(error).endswith("it speaks HTTP (is this the node's metrics port?)")


async def test_a_nodes_metrics_port() -> None:
    pytest.importorskip("prometheus_client")
    async with Node("127.0.0.1", 0, metrics_port=0) as node:
        assert node.metrics_address is not None
        error = await fails_at_once(node.metrics_address)
        assert "is this the node's metrics port?" in str(error)
        # ... and the node itself still answers.
        async with ParameterClient(node.address) as client:
            assert await client.ping() == node.node_id


async def test_a_server_that_answers_once_the_request_head_is_in() -> None:
    async with tcp_server(answers_a_request_head) as address:
        error = await fails_at_once(address)
    assert "b'HTTP/1.1 400 Bad Request\\r\\n" in str(error)


async def test_a_server_that_answers_before_anything_is_sent() -> None:
    async with tcp_server(answers_at_once) as address:
        error = await fails_at_once(address)
    expected = "b'HTTP/1.0 200 OK\\r\\nServer: x\\r\\n\\r\\nhello\\n'"
    assert f"answered {expected}, which" in str(error)  # whole: shorter than HEAD_BYTES


@pytest.mark.parametrize("extra", [0, 1, 1000])
async def test_a_long_answer_is_quoted_in_part(extra: int) -> None:
    page = b"HTTP/1.0 200 OK\r\n\r\n".ljust(HEAD_BYTES, b"x") + b"y" * extra
    async with tcp_server(sends(page)) as address:
        error = await fails_at_once(address)
    quoted = repr(page[:HEAD_BYTES])
    if extra:
        quoted = quoted[:-1] + "...'"
    assert f"answered {quoted}, which" in str(error)


async def test_a_tls_server_that_sends_an_alert() -> None:
    async with tcp_server(sends(b"\x15\x03\x03\x00\x02\x02\x32")) as address:
        error = await fails_at_once(address)
    assert str(error).endswith("it speaks TLS (connect with ssl=, see aioparamsync.tls)")


@pytest.mark.parametrize("seed", range(5))
async def test_a_server_that_sends_random_bytes(seed: int) -> None:
    garbage = random.Random(seed).randbytes(40)
    async with tcp_server(sends(garbage)) as address:
        error = await fails_at_once(address)
    assert f"answered {garbage!r}, which is not a framed Thrift message" in str(error)


async def test_every_call_on_the_connection_fails_with_it_and_so_does_the_next() -> None:
    async with (
        tcp_server(answers_a_request_head) as address,
        ParameterClient(address, timeout=LONG, max_connections=1) as client,
    ):
        async with asyncio.timeout(AT_ONCE):
            outcomes = await asyncio.gather(
                *(client.ping() for _ in range(20)),
                client.info(),
                client.get_arrays(["w"]),
                client.update_arrays({"w": np.zeros(3)}),
                return_exceptions=True,
            )
            assert all(isinstance(o, RemoteProtocolError) for o in outcomes), outcomes
            assert len({str(o) for o in outcomes}) == 1
            # A new call makes a new connection, and meets the same server.
            with pytest.raises(RemoteProtocolError, match=r"HTTP/1\.1 400"):
                await client.push_gradients({"w": np.zeros(3)})
            with pytest.raises(RemoteProtocolError):
                await client.call("update_parameters", update=thrift.ParameterUpdate([], 0))


async def test_a_oneway_call_fails_with_it_too() -> None:
    async with tcp_server(answers_a_request_head) as address:
        await fails_at_once(address, lambda c: c.broadcast_update({"w": np.zeros(3)}))


async def test_failing_over_is_not_for_a_server_that_is_no_node(node: Node) -> None:
    # (Not a connection that failed: the address is wrong, and the user must know.)
    async with tcp_server(answers_at_once) as address:
        await fails_at_once(address, addresses=[address, node.address])


# -- what keeps its own error ------------------------------------------------------------------


async def test_a_server_that_accepts_and_closes_at_once_is_a_lost_connection() -> None:
    async def close(reader, writer) -> None:
        pass

    async with (
        tcp_server(close) as address,
        ParameterClient(address, timeout=LONG) as client,
        asyncio.timeout(AT_ONCE),
    ):
        host, port = address
        with pytest.raises(ConnectionLostError, match=f"the node at {host}:{port} closed"):
            await client.ping()  # (a read: tried twice)
        with pytest.raises(ConnectionLostError, match="closed the connection"):
            await client.update_arrays({"w": np.zeros(3)})


async def test_a_server_that_says_nothing_is_a_timeout() -> None:
    async def silent(reader, writer) -> None:
        await reader.read()

    async with (
        tcp_server(silent) as address,
        ParameterClient(address, timeout=0.2) as client,
        asyncio.timeout(AT_ONCE),
    ):
        with pytest.raises(CallTimeout, match=r"ping did not complete within 0\.2 s"):
            await client.ping()


async def test_a_valid_prefix_cut_short_is_a_lost_connection() -> None:
    async def half(reader, writer) -> None:
        await reader.read(1)
        writer.write(_reply()[:6])  # a reply's length and half its header, then a close

    async with (
        tcp_server(half) as address,
        ParameterClient(address, timeout=LONG) as client,
        asyncio.timeout(AT_ONCE),
    ):
        with pytest.raises(ConnectionLostError, match="closed the connection"):
            await client.ping()


async def test_a_node_answering_in_compact_is_a_node() -> None:
    async def compact(reader, writer) -> None:
        while head := await reader.readexactly(4):
            frame = await reader.readexactly(int.from_bytes(head, "big"))
            seqid = int.from_bytes(frame[12:16], "big")  # (binary: 80 01 00 01, "ping")
            writer.write(
                encoded(
                    "ping",
                    method("ping").result(success="compact"),
                    seqid=seqid,
                    protocol=Protocol.COMPACT,
                    mtype=MessageType.REPLY,
                )
            )

    async with (
        tcp_server(compact) as address,
        ParameterClient(address, timeout=LONG) as client,
        asyncio.timeout(AT_ONCE),
    ):
        assert await client.ping() == "compact"
        assert await client.ping() == "compact"
