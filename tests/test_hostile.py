"""Hostile peers on real sockets: whatever a connection sends, the node refuses it and goes on.

Each case opens a raw connection to a node on 127.0.0.1, sends bytes that are
not a valid exchange, and checks, within a few seconds:

- that the node answers with an error (a ``TApplicationException``,
  PROTOCOL_ERROR for bytes that are no valid message) and/or ends that
  connection;
- that a normal ``ParameterClient`` on the same node still gets correct
  results, and that the store did not change.

Nothing here sleeps to synchronise: every wait is a read, an EOF or a
condition, bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from raw_helpers import TIMEOUT, encoded, raw, wait_until
from thriftpy2.thrift import TApplicationException

from aioparamsync import ErrorCode, Node, ParameterClient
from aioparamsync.wire import (
    METHODS,
    MessageType,
    Protocol,
    Receiver,
    decode_header,
    method,
    thrift,
)
from aioparamsync.wire.idl import MAX_METHOD_NAME_BYTES

# What "at once" means for a refusal that needs no more bytes (seconds): far
# below any idle timeout, with room for a loaded machine. (That a reply comes
# at all, with no more bytes sent, already shows the node did not wait.)
AT_ONCE = 2.0

PROTOCOL_ERROR = TApplicationException.PROTOCOL_ERROR
UNKNOWN_METHOD = TApplicationException.UNKNOWN_METHOD
INVALID_MESSAGE_TYPE = TApplicationException.INVALID_MESSAGE_TYPE

W = np.arange(12, dtype=np.float32).reshape(3, 4)


# ---------------------------------------------------------------------------
# Nodes, clients and the store's state


@pytest.fixture
async def node_factory() -> AsyncIterator[Callable[..., Any]]:
    """Start nodes with other settings; like the ``node`` fixture, fail on loop errors."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    nodes: list[Node] = []

    async def make(**kwargs: Any) -> Node:
        n = Node("127.0.0.1", 0, **kwargs)
        await n.start()
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        await n.stop()
    await asyncio.sleep(0)
    assert not reported, f"the event loop reported errors: {reported}"


@dataclass(frozen=True)
class Snapshot:
    """What the store holds: names, versions, sizes and the node's timestamp."""

    entries: dict[str, tuple[int, int, str | None]]
    timestamp: int

    @classmethod
    def of(cls, node: Node) -> Snapshot:
        table = node.table
        entries = {}
        for name in table.names():
            e = table.entry(name)
            assert e is not None
            entries[name] = (e.version, e.nbytes, e.dtype)
        return cls(entries, table.timestamp)


async def seed(node: Node, client: ParameterClient) -> Snapshot:
    """Write the parameter "w" and answer the store's state."""
    assert await client.update_arrays({"w": W}, timestamp=1000) == {"w": 1}
    return Snapshot.of(node)


async def assert_intact(node: Node, client: ParameterClient, before: Snapshot) -> None:
    """The store is as before, and a normal client still gets correct results."""
    assert Snapshot.of(node) == before
    arrays = await client.get_arrays(["w", "evil"])
    assert list(arrays) == ["w"]
    np.testing.assert_array_equal(arrays["w"], W)
    assert await client.ping() == node.node_id


@pytest.fixture
async def seeded(node: Node, client: ParameterClient) -> Snapshot:
    return await seed(node, client)


# ---------------------------------------------------------------------------
# Raw connections


async def read_to_eof(reader: asyncio.StreamReader, timeout: float = TIMEOUT) -> bytes:
    """Everything the node sends until it ends the connection (fails after ``timeout``)."""
    data = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                break  # ended, if less politely
            if not chunk:
                break
            data += chunk
    return bytes(data)


@dataclass
class Reply:
    name: str
    mtype: int
    seqid: int
    body: Any
    protocol: Protocol
    framed: bool


def parse_replies(data: bytes) -> list[Reply]:
    """The node's messages in ``data`` (framed or not, either protocol), decoded."""
    receiver = Receiver()
    replies = []
    for frame in receiver.feed(data):
        replies.append(decode_reply(frame))
    assert receiver.pending_bytes == 0, "the node sent part of a message"
    return replies


def decode_reply(frame: Any) -> Reply:
    name, mtype, seqid, reader = decode_header(frame.payload, frame.protocol)
    if mtype == MessageType.EXCEPTION:
        body = reader.read_body(TApplicationException)
    else:
        assert mtype == MessageType.REPLY
        body = reader.read_body(method(name).result)
    return Reply(name, mtype, seqid, body, frame.protocol, frame.framed)


async def read_replies(
    reader: asyncio.StreamReader, count: int, timeout: float = TIMEOUT
) -> list[Reply]:
    """Read exactly ``count`` replies (the connection stays open)."""
    receiver = Receiver()
    replies: list[Reply] = []
    async with asyncio.timeout(timeout):
        while len(replies) < count:
            chunk = await reader.read(65536)
            assert chunk, f"the node closed the connection after {len(replies)} replies"
            replies += [decode_reply(f) for f in receiver.feed(chunk)]
    assert len(replies) == count and receiver.pending_bytes == 0
    return replies


def assert_error(reply: Reply, kind: int = PROTOCOL_ERROR) -> TApplicationException:
    assert reply.mtype == MessageType.EXCEPTION, reply
    assert reply.body.type == kind, reply.body
    return reply.body


async def exchange(
    address: tuple[str, int], payload: bytes, *, eof: bool = False, timeout: float = TIMEOUT
) -> tuple[list[Reply], float]:
    """Send ``payload`` on a fresh connection, read until the node ends it.

    Answers the node's replies and how long it took to end the connection.
    """
    async with raw(address) as (reader, writer):
        start = time.monotonic()
        writer.write(payload)
        if eof:
            writer.write_eof()
        data = await read_to_eof(reader, timeout)
        elapsed = time.monotonic() - start
    return parse_replies(data), elapsed


async def assert_refused(
    address: tuple[str, int],
    payload: bytes,
    *,
    within: float = AT_ONCE,
    name: str = "",
    seqid: int = 0,
    protocol: Protocol = Protocol.BINARY,
    framed: bool = True,
) -> str:
    """The node answers ``payload`` with one PROTOCOL_ERROR and ends the connection.

    Answers the error's message.
    """
    replies, elapsed = await exchange(address, payload)
    assert len(replies) == 1, replies
    reply = replies[0]
    error = assert_error(reply)
    assert (reply.name, reply.seqid) == (name, seqid)
    assert (reply.protocol, reply.framed) == (protocol, framed)
    assert elapsed < within, f"refused after {elapsed:.2f} s"
    return error.message


# ---------------------------------------------------------------------------
# Messages, valid and crafted


def evil_push(data: bytes = b"\x00" * 4, **param: Any) -> Any:
    """push_parameters args that would store "evil" if they got through."""
    p = thrift.Parameter(name="evil", data=data, **param)
    return method("push_parameters").args(update=thrift.ParameterUpdate(params=[p], timestamp=9999))


def ping_call(seqid: int = 7, protocol: Protocol = Protocol.BINARY, framed: bool = True) -> bytes:
    return encoded("ping", method("ping").args(), seqid=seqid, protocol=protocol, framed=framed)


def frame(payload: bytes, size: int | None = None) -> bytes:
    return struct.pack("!i", len(payload) if size is None else size) + payload


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def binary_call(name: str, body: bytes, seqid: int = 5, mtype: int = MessageType.CALL) -> bytes:
    """A strict binary message: header by hand, then ``body`` (the args struct's bytes)."""
    n = name.encode()
    return struct.pack("!Ii", 0x80010000 | mtype, len(n)) + n + struct.pack("!i", seqid) + body


def compact_call(name: str, body: bytes, seqid: int = 5, mtype: int = MessageType.CALL) -> bytes:
    n = name.encode()
    return bytes([0x82, (mtype << 5) | 1]) + varint(seqid) + varint(len(n)) + n + body


# One Parameter(name="evil", data=b"abcd"), as the first of the list's elements.
_BIN_PARAM = (
    struct.pack("!bhi", 11, 1, 4) + b"evil" + struct.pack("!bhi", 11, 2, 4) + b"abcd" + b"\x00"
)
_CMP_PARAM = b"\x18\x04evil" + b"\x18\x04abcd" + b"\x00"


def binary_huge_list(count: int = 1_000_000_000) -> bytes:
    """args.update (field 1, struct) -> params (field 1, list<struct>) claiming ``count``."""
    return (
        struct.pack("!bh", 12, 1)
        + struct.pack("!bh", 15, 1)
        + struct.pack("!bi", 12, count)
        + _BIN_PARAM
        + b"\x00\x00"
    )


def compact_huge_list(count: int = 1_000_000_000) -> bytes:
    # field 1 struct (0x1c), field 1 list (0x19), list header: size follows (0xf) of structs (0xc)
    return b"\x1c\x19\xfc" + varint(count) + _CMP_PARAM + b"\x00\x00"


@contextlib.contextmanager
def allocates_less_than(limit: int) -> Any:
    """Fail if the process's Python allocations peak above ``limit`` bytes meanwhile."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"allocations peaked at {peak / 2**20:.1f} MiB"


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


@contextlib.contextmanager
def resident_memory_grows_less_than(limit: int) -> Any:
    """Fail if the process's peak resident memory grows by ``limit`` bytes or more meanwhile.

    (Reserving address space that nothing writes to costs no memory: a large
    frame's buffer is reserved when its header arrives, and filled as its
    bytes do.)
    """
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak (VmHWM) to the current resident size
    before = _status("VmRSS")
    yield
    grown = _status("VmHWM") - before
    assert grown < limit, f"resident memory grew by {grown / 2**20:.1f} MiB"


# ---------------------------------------------------------------------------
# Not Thrift at all


@pytest.mark.parametrize("seed", range(6))
async def test_random_garbage(
    node: Node, client: ParameterClient, seeded: Snapshot, seed: int
) -> None:
    rng = random.Random(seed)
    size = [1, 3, 17, 512, 64 * 1024, 1024 * 1024][seed]
    garbage = rng.randbytes(size)
    # Whatever it is, once the peer has said all it will say, the node ends the
    # connection, and all it may have answered is errors.
    replies, _ = await exchange(node.address, garbage, eof=True)
    for reply in replies:
        assert_error(reply, reply.body.type)
    await assert_intact(node, client, seeded)


@pytest.mark.parametrize("first", [0x7F, 0x16, 0xFF, 0x41])
async def test_random_garbage_refused_without_eof(
    node: Node, client: ParameterClient, seeded: Snapshot, first: int
) -> None:
    """Garbage whose first 4 bytes are no possible frame length is refused at once."""
    garbage = bytes([first]) + random.Random(first).randbytes(4095)
    await assert_refused(node.address, garbage)
    await assert_intact(node, client, seeded)


@pytest.mark.parametrize(
    "text",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /rpc HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"*1\r\n$4\r\nPING\r\n",
    ],
    ids=["http-get", "http-post", "http2-preface", "ssh", "redis"],
)
async def test_text_protocols_refused_at_once(
    node: Node, client: ParameterClient, seeded: Snapshot, text: bytes
) -> None:
    """ "GET " reads as a frame of 1.19 GB: refused at once, not awaited."""
    message = await assert_refused(node.address, text)
    assert str(struct.unpack("!i", text[:4])[0]) in message, message
    if text[:4].decode().isprintable():
        assert "looks like text" in message, message
    await assert_intact(node, client, seeded)


async def test_tls_client_hello_refused_at_once(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    hello = (
        b"\x16\x03\x01\x02\x00"  # record: handshake, TLS 1.0, 512 bytes
        + b"\x01\x00\x01\xfc\x03\x03"  # ClientHello, TLS 1.2
        + bytes(range(32))  # random
        + b"\x20"
        + bytes(32)  # session id
        + b"\x00\x04\x13\x01\x13\x02\x01\x00"  # cipher suites, compression
    )
    message = await assert_refused(node.address, hello)
    assert "TLS" in message, message
    await assert_intact(node, client, seeded)


# ---------------------------------------------------------------------------
# Frame lengths


@pytest.mark.parametrize(
    "size", [-1, -256, 0x7FFFFFFF, 2**28 + 1], ids=["-1", "-256", "2GiB", "256MiB+1"]
)
async def test_impossible_frame_lengths_refused_at_once(
    node: Node, client: ParameterClient, seeded: Snapshot, size: int
) -> None:
    message = await assert_refused(node.address, struct.pack("!i", size))
    assert str(size) in message
    await assert_intact(node, client, seeded)


async def test_empty_frame_is_skipped(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    """A 0 length is an empty frame (TFramedTransport flushing nothing): skipped, not an error."""
    async with raw(node.address) as (reader, writer):
        writer.write(frame(b"") + frame(b"") + ping_call(seqid=3))
        [reply] = await read_replies(reader, 1)
        assert (reply.name, reply.mtype, reply.seqid) == ("ping", MessageType.REPLY, 3)
        assert reply.body.success == node.node_id
    await assert_intact(node, client, seeded)


async def test_frame_length_limit_is_exact(node_factory: Callable[..., Any]) -> None:
    """A frame of max_frame_bytes is served; one byte more is refused on its header alone."""
    limit = 4096
    node = await node_factory(max_frame_bytes=limit)
    async with ParameterClient(node.address, timeout=10) as client:
        before = await seed(node, client)
        for size in (limit + 1, 2 * limit, 2**31 - 1):
            message = await assert_refused(node.address, struct.pack("!i", size))
            assert str(size) in message and str(limit) in message
        await assert_intact(node, client, before)

        # Exactly the limit: a push of "fits" whose frame is max_frame_bytes long.
        def push(n: int) -> bytes:
            p = thrift.Parameter(name="fits", data=b"\x01" * n)
            update = thrift.ParameterUpdate(params=[p], timestamp=2000)
            return encoded("push_parameters", method("push_parameters").args(update=update))

        data = push(limit - (len(push(0)) - 4))
        assert len(data) == limit + 4
        async with raw(node.address) as (reader, writer):
            writer.write(data)
            [reply] = await read_replies(reader, 1)
        assert reply.mtype == MessageType.REPLY and reply.body.success.versions == {"fits": 1}
        assert node.table.entry("fits").nbytes == limit - (len(push(0)) - 4)


async def test_frame_starting_with_neither_protocol(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    message = await assert_refused(node.address, frame(b"\x00" * 16))
    assert "neither binary" in message
    await assert_intact(node, client, seeded)


# ---------------------------------------------------------------------------
# Frames and messages that disagree


async def test_truncated_frame_then_eof(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    """A header promising N bytes, fewer sent, then EOF: the node ends it, applies nothing."""
    data = encoded("push_parameters", evil_push(b"\x00" * 400))
    errors = node.server.counters["protocol_errors"]
    replies, _ = await exchange(node.address, data[: len(data) // 2], eof=True)
    assert replies == []  # nothing to answer: no message arrived whole
    assert node.server.counters["protocol_errors"] == errors + 1
    await assert_intact(node, client, seeded)


async def test_truncated_large_frame_then_eof(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    """The same with a frame above the size that gets a buffer of its own."""
    data = encoded("push_parameters", evil_push(b"\x00" * 200_000))
    replies, _ = await exchange(node.address, data[:100_000], eof=True)
    assert replies == []
    await assert_intact(node, client, seeded)


async def test_message_runs_past_the_end_of_its_frame(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    message = encoded("push_parameters", evil_push(), seqid=41, framed=False)
    for cut in (1, 5, len(message) - 30):  # the header (27 bytes) stays whole
        # (the frame's bytes alone: what follows a frame is the next frame's start)
        text = await assert_refused(
            node.address, frame(message[: len(message) - cut]), name="push_parameters", seqid=41
        )
        assert "past the end" in text
    await assert_intact(node, client, seeded)


async def test_frame_with_trailing_bytes(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    message = encoded("push_parameters", evil_push(), seqid=42, framed=False)
    for trailer in (b"\x00", b"\x00" * 7, ping_call()):
        text = await assert_refused(
            node.address, frame(message + trailer), name="push_parameters", seqid=42
        )
        assert f"{len(trailer)} bytes follow" in text
    await assert_intact(node, client, seeded)


# Each protocol, framed and not.
EVERY_FRAMING = pytest.mark.parametrize(
    ("protocol", "framed"),
    [
        (Protocol.BINARY, True),
        (Protocol.BINARY, False),
        (Protocol.COMPACT, True),
        (Protocol.COMPACT, False),
    ],
    ids=["binary-framed", "binary-unframed", "compact-framed", "compact-unframed"],
)


def name_claim(protocol: Protocol, framed: bool, n: int) -> bytes:
    """The start of a call whose method name claims ``n`` bytes, of which 2 are sent."""
    if protocol is Protocol.BINARY:
        start = struct.pack("!Ii", 0x80010000 | MessageType.CALL, n) + b"pu"
    else:
        start = bytes([0x82, (MessageType.CALL << 5) | 1]) + varint(5) + varint(n) + b"pu"
    return frame(start, n + 64) if framed else start  # (a frame that would hold it all)


@pytest.mark.parametrize("n", [800_000, MAX_METHOD_NAME_BYTES + 1], ids=["800KB", "longest+1"])
@EVERY_FRAMING
async def test_a_method_name_longer_than_any_is_refused_without_waiting_for_it(
    node: Node, client: ParameterClient, seeded: Snapshot, protocol: Protocol, framed: bool, n: int
) -> None:
    # (it names no method: the node does not wait for its bytes, up to the frame limit)
    replies, elapsed = await exchange(node.address, name_claim(protocol, framed, n))
    [reply] = replies
    text = assert_error(reply).message
    assert f"method name of {n} bytes: longer than any method's" in text, text
    assert elapsed < AT_ONCE
    await assert_intact(node, client, seeded)


@pytest.mark.parametrize("framed", [True, False], ids=["framed", "unframed"])
@pytest.mark.parametrize("protocol", [Protocol.BINARY, Protocol.COMPACT], ids=["binary", "compact"])
async def test_the_longest_method_name_is_served(
    node: Node, protocol: Protocol, framed: bool
) -> None:
    longest = max((m.name for m in METHODS), key=len)
    assert len(longest) == MAX_METHOD_NAME_BYTES
    request = method(longest).args()  # (push_row_gradients without its push: BAD_REQUEST)
    async with raw(node.address) as (reader, writer):
        writer.write(encoded(longest, request, seqid=3, protocol=protocol, framed=framed))
        [reply] = await read_replies(reader, 1)
    assert (reply.name, reply.seqid, reply.mtype) == (longest, 3, MessageType.REPLY)


# ---------------------------------------------------------------------------
# Counts that cannot be: refused before anything is allocated


HUGE_LISTS = {
    "binary-framed": (
        frame(binary_call("push_parameters", binary_huge_list())),
        Protocol.BINARY,
        True,
    ),
    "binary-framed-2**31-1": (
        frame(binary_call("update_parameters", binary_huge_list(2**31 - 1))),
        Protocol.BINARY,
        True,
    ),
    "binary-unframed": (binary_call("push_parameters", binary_huge_list()), Protocol.BINARY, False),
    "compact-framed": (
        frame(compact_call("push_parameters", compact_huge_list())),
        Protocol.COMPACT,
        True,
    ),
    "compact-unframed": (
        compact_call("update_parameters", compact_huge_list()),
        Protocol.COMPACT,
        False,
    ),
    "compact-unframed-2**32": (
        compact_call("push_parameters", compact_huge_list(2**32)),
        Protocol.COMPACT,
        False,
    ),
}


@pytest.mark.parametrize("case", HUGE_LISTS.values(), ids=HUGE_LISTS.keys())
async def test_list_of_a_billion_parameters_fails_fast_without_allocating(
    node: Node, client: ParameterClient, seeded: Snapshot, case: tuple[bytes, Protocol, bool]
) -> None:
    data, protocol, framed = case
    with allocates_less_than(16 * 2**20):
        replies, elapsed = await exchange(node.address, data)
    assert elapsed < AT_ONCE
    [reply] = replies
    text = assert_error(reply).message
    assert "cannot fit" in text or "out of range" in text or "limit" in text, text
    assert (reply.protocol, reply.framed) == (protocol, framed)
    if framed:  # the frame was whole: the error names the call
        assert reply.seqid == 5 and reply.name.endswith("_parameters")
    await assert_intact(node, client, seeded)


@pytest.mark.parametrize("framed", [True, False], ids=["framed", "unframed"])
async def test_string_of_2_gib_fails_fast(
    node: Node, client: ParameterClient, seeded: Snapshot, framed: bool
) -> None:
    body = (
        struct.pack("!bh", 12, 1)  # args.update
        + struct.pack("!bh", 15, 1)  # update.params
        + struct.pack("!bi", 12, 1)  # one Parameter
        + struct.pack("!bhi", 11, 1, 2**31 - 1)  # its name: 2 GiB
        + b"evil"
    )
    message = binary_call("push_parameters", body)
    with allocates_less_than(16 * 2**20):
        replies, elapsed = await exchange(node.address, frame(message) if framed else message)
    [reply] = replies
    assert_error(reply)
    assert elapsed < AT_ONCE
    await assert_intact(node, client, seeded)


NESTED = {
    # field 99 (unknown, so skipped) holding structs in structs
    "binary-structs": binary_call("push_parameters", struct.pack("!bh", 12, 99) * 5000),
    # field 99: list of one list of one list ...
    "binary-lists": binary_call(
        "push_parameters", struct.pack("!bh", 15, 99) + struct.pack("!bi", 15, 1) * 5000
    ),
    # field 1 is a struct in every struct of the IDL's reach; compact field header 0x1c
    "compact-structs": compact_call("push_parameters", b"\x1c" * 5000),
    "binary-invalid-type": binary_call("push_parameters", struct.pack("!bh", 0x7F, 1) + bytes(16)),
    "binary-negative-type": binary_call("push_parameters", struct.pack("!bh", -3, 1) + bytes(16)),
    "binary-void-type": binary_call("push_parameters", struct.pack("!bh", 1, 1) + bytes(16)),
    "compact-invalid-type": compact_call("push_parameters", b"\x1d" + bytes(16)),
    "compact-invalid-element-type": compact_call("push_parameters", b"\x1c\x19\x1d" + bytes(16)),
}


@pytest.mark.parametrize("framed", [True, False], ids=["framed", "unframed"])
@pytest.mark.parametrize("message", NESTED.values(), ids=NESTED.keys())
async def test_deep_nesting_and_invalid_types(
    node: Node, client: ParameterClient, seeded: Snapshot, message: bytes, framed: bool
) -> None:
    protocol = Protocol.BINARY if message[0] == 0x80 else Protocol.COMPACT
    replies, elapsed = await exchange(node.address, frame(message) if framed else message)
    [reply] = replies
    text = assert_error(reply).message
    assert "deeper" in text or "type" in text, text
    assert (reply.protocol, reply.framed) == (protocol, framed)
    assert elapsed < AT_ONCE
    await assert_intact(node, client, seeded)


# ---------------------------------------------------------------------------
# Valid messages the node does not serve: an error, and the connection stays


@EVERY_FRAMING
async def test_unknown_method_then_a_valid_call_on_the_same_connection(
    node: Node, client: ParameterClient, seeded: Snapshot, protocol: Protocol, framed: bool
) -> None:
    unknown = encoded(
        "drop_parameters", method("ping").args(), seqid=11, protocol=protocol, framed=framed
    )
    async with raw(node.address) as (reader, writer):
        writer.write(unknown)
        [reply] = await read_replies(reader, 1)
        assert_error(reply, UNKNOWN_METHOD)
        assert (reply.name, reply.seqid) == ("drop_parameters", 11)
        assert (reply.protocol, reply.framed) == (protocol, framed)
        # the same connection goes on serving
        writer.write(ping_call(seqid=12, protocol=protocol, framed=framed))
        [reply] = await read_replies(reader, 1)
        assert (reply.name, reply.mtype, reply.seqid) == ("ping", MessageType.REPLY, 12)
        assert reply.body.success == node.node_id
    await assert_intact(node, client, seeded)


async def test_known_method_with_the_wrong_message_type(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    """A push sent as a REPLY (or EXCEPTION) is refused, and not applied."""
    async with raw(node.address) as (reader, writer):
        for seqid, mtype in ((21, MessageType.REPLY), (22, MessageType.EXCEPTION)):
            writer.write(encoded("push_parameters", evil_push(), seqid=seqid, mtype=mtype))
            [reply] = await read_replies(reader, 1)
            assert_error(reply, INVALID_MESSAGE_TYPE)
            assert reply.seqid == seqid
        writer.write(ping_call(seqid=23))
        [reply] = await read_replies(reader, 1)
        assert reply.body.success == node.node_id
    await assert_intact(node, client, seeded)


async def test_unknown_oneway_is_dropped_and_the_connection_stays(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    async with raw(node.address) as (reader, writer):
        oneway = encoded("fire_and_forget", method("ping").args(), mtype=MessageType.ONEWAY)
        writer.write(oneway + ping_call(seqid=31))
        [reply] = await read_replies(reader, 1)  # only the ping's
        assert (reply.name, reply.seqid) == ("ping", 31)
    await assert_intact(node, client, seeded)


async def test_invalid_update_is_refused_and_not_applied(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    """Well-formed messages with contents the store refuses: an error, the store unchanged."""
    bad = [
        evil_push(dtype="<f4", shape=[3]),  # 4 bytes are not 3 floats
        evil_push(dtype=","),  # numpy raises SyntaxError on this one
        evil_push(dtype="O"),
        evil_push(dtype="<f4", shape=[-1]),
        evil_push(shape=[-2, -2]),  # negative dims whose product is the size
        method("push_parameters").args(update=None),
    ]
    async with raw(node.address) as (reader, writer):
        for i, args in enumerate(bad):
            writer.write(encoded("push_parameters", args, seqid=100 + i))
        replies = await read_replies(reader, len(bad))
    for i, reply in enumerate(replies):
        assert reply.seqid == 100 + i
        assert reply.mtype == MessageType.REPLY and reply.body.error is not None, reply
    await assert_intact(node, client, seeded)
    # the writer is alive: updates still apply
    assert await client.update_arrays({"w": W}) == {"w": 2}


# ---------------------------------------------------------------------------
# Silence and stalls


async def test_silent_connection_closed_after_idle_timeout(
    node_factory: Callable[..., Any],
) -> None:
    node = await node_factory(idle_timeout=0.3)
    async with ParameterClient(node.address, timeout=10) as client:
        before = await seed(node, client)
        async with raw(node.address) as (reader, _):
            start = time.monotonic()
            assert await read_to_eof(reader) == b""
            assert 0.2 < time.monotonic() - start < TIMEOUT
        assert node.server.counters["idle_closed"] >= 1
        await assert_intact(node, client, before)


async def test_silent_connection_stays_open_with_the_default_idle_timeout(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    async with raw(node.address) as (reader, writer):
        for i in range(5):
            assert await client.update_arrays({"x": np.full(3, i, np.int64)}) == {"x": i + 1}
            assert (await client.get_arrays(["x"]))["x"].tolist() == [i] * 3
        # still open: it answers a call now
        writer.write(ping_call(seqid=51))
        [reply] = await read_replies(reader, 1)
        assert reply.body.success == node.node_id
    assert node.server.counters["idle_closed"] == 0


@pytest.mark.parametrize(
    "part",
    [
        encoded("push_parameters", evil_push(b"\x00" * 400))[:200],  # half a small frame
        encoded("push_parameters", evil_push(b"\x00" * 100_000))[:30_000],  # half a large one
        b"\x00\x00",  # half a frame header
        encoded("push_parameters", evil_push(), framed=False)[:30],  # half an unframed message
    ],
    ids=["small-frame", "large-frame", "header", "unframed"],
)
async def test_half_a_message_then_stall_closed_by_idle_timeout(
    node_factory: Callable[..., Any], part: bytes
) -> None:
    node = await node_factory(idle_timeout=0.3)
    async with ParameterClient(node.address, timeout=10) as client:
        before = await seed(node, client)
        errors = node.server.counters["protocol_errors"]
        replies, elapsed = await exchange(node.address, part)
        assert replies == [] and elapsed < TIMEOUT
        assert node.server.counters["protocol_errors"] == errors + 1
        await assert_intact(node, client, before)


async def test_valid_call_then_half_close_gets_its_reply(node: Node) -> None:
    """The polite end of the spectrum: a call and EOF at once still gets its reply, then EOF."""
    replies, _ = await exchange(node.address, ping_call(seqid=61), eof=True)
    [reply] = replies
    assert (reply.name, reply.seqid, reply.body.success) == ("ping", 61, node.node_id)


# ---------------------------------------------------------------------------
# Many at once


def _hostile_payloads() -> list[tuple[bytes, bool]]:
    """(bytes, then EOF?) of every kind; each makes the node end the connection."""
    push = encoded("push_parameters", evil_push(b"\x00" * 400))
    return [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", False),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", False),
        (struct.pack("!i", -1), False),
        (struct.pack("!i", 0x7FFFFFFF), False),
        (frame(binary_call("push_parameters", binary_huge_list())), False),
        (binary_call("push_parameters", binary_huge_list()), False),
        (compact_call("push_parameters", compact_huge_list()), False),
        (frame(binary_call("push_parameters", struct.pack("!bh", 12, 99) * 500)), False),
        (push[: len(push) // 2], True),  # truncated, then EOF
        (push[:100], False),  # stalls: the idle timeout ends it
        (b"", False),  # silent: the idle timeout ends it
        (random.Random(7).randbytes(5000), True),
    ]


async def test_fifty_hostile_connections_while_a_client_updates(
    node_factory: Callable[..., Any],
) -> None:
    node = await node_factory(idle_timeout=0.5)
    payloads = _hostile_payloads()

    async def hostile(i: int) -> list[Reply]:
        data, eof = payloads[i % len(payloads)]
        replies, _ = await exchange(node.address, data, eof=eof, timeout=10)
        for reply in replies:
            assert_error(reply)
        return replies

    async with ParameterClient(node.address, timeout=10) as client:
        before = await seed(node, client)
        attacks = [asyncio.ensure_future(hostile(i)) for i in range(50)]
        for i in range(2, 32):
            values = W * i
            assert await client.update_arrays({"w": values}) == {"w": i}
            np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], values)
        results = await asyncio.gather(*attacks)
        assert sum(len(r) for r in results) >= 30  # the refused ones were told why
        assert Snapshot.of(node).entries.keys() == before.entries.keys()
        assert node.table.entry("w").version == 31
        await wait_until(lambda: len(node.server.connections) <= client.max_connections)


# ---------------------------------------------------------------------------
# Regressions: each of these once got past the node


@pytest.mark.parametrize(
    "body",
    [
        # update: params=[evil], timestamp = 2**69-ish (a 10-byte varint)
        b"\x1c\x19\x1c" + _CMP_PARAM + b"\x16" + b"\xfe" + b"\xff" * 8 + b"\x7f" + b"\x00\x00",
        # update: params=[evil with version 2**33 - 1], timestamp 1
        b"\x1c\x19\x1c\x18\x04evil\x18\x04abcd\x15\xfe\xff\xff\xff\x7f\x00\x16\x02\x00\x00",
    ],
    ids=["timestamp", "version"],
)
async def test_compact_out_of_range_integers_do_not_poison_the_store(
    node: Node, client: ParameterClient, seeded: Snapshot, body: bytes
) -> None:
    async with raw(node.address) as (reader, writer):
        writer.write(frame(compact_call("push_parameters", body)))
        [reply] = await read_replies(reader, 1)
    assert reply.mtype == MessageType.EXCEPTION, reply
    await assert_intact(node, client, seeded)


def assert_shape_mismatch(reply: Reply, seqid: int) -> None:
    assert (reply.name, reply.mtype, reply.seqid) == ("push_parameters", MessageType.REPLY, seqid)
    assert reply.body.error is not None, reply.body
    assert reply.body.error.code == ErrorCode.SHAPE_MISMATCH, reply.body.error


async def test_shape_with_a_huge_product_is_refused_as_a_mismatch(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    attack = encoded("push_parameters", evil_push(dtype="<f4", shape=[2**62] * 300), seqid=72)
    async with raw(node.address) as (reader, writer):
        writer.write(attack)
        [reply] = await read_replies(reader, 1)
    await assert_intact(node, client, seeded)
    assert_shape_mismatch(reply, 72)


async def test_many_huge_dimensions_do_not_block_the_node(
    node: Node, client: ParameterClient, seeded: Snapshot
) -> None:
    attack = encoded("push_parameters", evil_push(dtype="<f4", shape=[2**62] * 30_000), seqid=71)
    async with raw(node.address) as (reader, writer):
        start = time.monotonic()
        writer.write(attack)
        [reply] = await read_replies(reader, 1)
        refused_after = time.monotonic() - start
    await assert_intact(node, client, seeded)
    assert refused_after < 0.5, f"refused after {refused_after:.2f} s"
    assert_shape_mismatch(reply, 71)


async def test_frame_header_alone_does_not_allocate_the_frame(
    node_factory: Callable[..., Any],
) -> None:
    node = await node_factory(max_frame_bytes=256 * 2**20)
    with resident_memory_grows_less_than(16 * 2**20):
        replies, _ = await exchange(
            node.address, struct.pack("!i", 256 * 2**20) + b"\x80", eof=True
        )
    assert replies == []


async def test_unframed_call_split_before_its_last_byte_is_served(node: Node) -> None:
    call = ping_call(seqid=81, framed=False)
    async with raw(node.address) as (reader, writer):
        writer.write(call[:-1])
        await writer.drain()
        await wait_until(lambda: node.server.counters["bytes_in"] >= len(call) - 1)
        writer.write(call[-1:])
        [reply] = await read_replies(reader, 1, timeout=1.0)
        assert (reply.name, reply.seqid) == ("ping", 81)


async def test_unframed_message_larger_than_the_limit_is_refused(
    node_factory: Callable[..., Any],
) -> None:
    node = await node_factory(max_frame_bytes=4096)
    async with ParameterClient(node.address, timeout=10) as client:
        before = await seed(node, client)
        big = encoded("push_parameters", evil_push(b"\x00" * 16_000), framed=False)
        replies, _ = await exchange(node.address, big, eof=True)
        assert [(r.mtype, getattr(r.body, "type", None)) for r in replies] == [
            (MessageType.EXCEPTION, PROTOCOL_ERROR)
        ]
        await assert_intact(node, client, before)
