"""A connection's order, on real sockets: reads behind writes, and how they end.

- A read pipelined behind a write is called (and maybe held, as a long poll)
  only once the write is applied: if the client has gone, stopped sending or
  the node is shutting down by then, it is released as the reads held before
  it were, not kept until its deadline.
- Read-your-writes holds whatever a write answers: a push_gradients sent again
  (whose answer is the first push's, already done) does not let the next read
  skip the writes before it.

Nothing here sleeps to synchronise: every wait is a read, an EOF or a
condition, bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from raw_helpers import TIMEOUT, encoded, raw, wait_until
from thriftpy2.thrift import TApplicationException

from aioparamsync import ErrorCode, Node
from aioparamsync.wire import (
    MessageType,
    Receiver,
    decode_header,
    method,
    thrift,
)

# How long a long poll asks to be held (ms): far beyond any wait here.
HOUR_MS = 3_600_000


# ---------------------------------------------------------------------------
# Raw connections and messages


def decode_reply(frame: Any) -> tuple[str, int, int, Any]:
    name, mtype, seqid, reader = decode_header(frame.payload, frame.protocol)
    if mtype == MessageType.EXCEPTION:
        return name, int(mtype), seqid, reader.read_body(TApplicationException)
    assert mtype == MessageType.REPLY
    return name, int(mtype), seqid, reader.read_body(method(name).result)


async def read_to_eof(reader: asyncio.StreamReader) -> list[tuple[str, int, int, Any]]:
    """The replies the node sends until it ends the connection (bounded)."""
    receiver = Receiver()
    replies = []
    async with asyncio.timeout(TIMEOUT):
        while chunk := await reader.read(65536):
            replies += [decode_reply(f) for f in receiver.feed(chunk)]
    assert receiver.pending_bytes == 0, "the node sent part of a message"
    return replies


async def read_replies(reader: asyncio.StreamReader, count: int) -> list[tuple[str, int, int, Any]]:
    """Read exactly ``count`` replies (the connection stays open)."""
    receiver = Receiver()
    replies: list[tuple[str, int, int, Any]] = []
    async with asyncio.timeout(TIMEOUT):
        while len(replies) < count:
            chunk = await reader.read(65536)
            assert chunk, f"the node closed the connection after {len(replies)} replies"
            replies += [decode_reply(f) for f in receiver.feed(chunk)]
    assert len(replies) == count and receiver.pending_bytes == 0
    return replies


def push(seqid: int, name: str, data: bytes, **param: Any) -> bytes:
    p = thrift.Parameter(name=name, data=data, **param)
    update = thrift.ParameterUpdate(params=[p], timestamp=seqid)
    return encoded("push_parameters", method("push_parameters").args(update=update), seqid=seqid)


def pull(seqid: int, name: str, **request: Any) -> bytes:
    request_ = thrift.ParameterRequest(param_names=[name], **request)
    return encoded("pull_parameters", method("pull_parameters").args(request=request_), seqid=seqid)


def push_gradients(seqid: int, request_id: str) -> bytes:
    g = thrift.Parameter(name="g", data=np.ones(4, np.float32).tobytes(), dtype="<f4", shape=[4])
    args = method("push_gradients").args(push=thrift.GradientPush(grads=[g], request_id=request_id))
    return encoded("push_gradients", args, seqid=seqid)


def a_write_then_a_long_poll() -> bytes:
    """A write, and a long poll (of a name nobody writes) pipelined behind it."""
    return push(1, "w", b"\0" * 16) + pull(2, "never", wait_ms=HOUR_MS)


def polls_waiting(node: Node) -> int:
    return node.service.waiting.statistics()["long_polls_waiting"]


def hold_writes(node: Node) -> None:
    """Keep the client writes the node reads from now on unapplied (as a cut holds them),
    until ``node.service.store.release()``: a read pipelined behind one waits for it. (An
    update the writer would apply next, alone, it applies at once.)"""
    node.service.store.start_hold()


async def both_read(node: Node) -> None:
    """Until the node has read the write and the poll (not applied: see hold_writes)."""
    async with asyncio.timeout(TIMEOUT):
        while node.server.counters["requests"] < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
    assert "w" not in node.table


# ---------------------------------------------------------------------------
# A read held only once the writes before it are applied


async def test_a_long_poll_behind_a_write_ends_with_its_closed_connection(node: Node) -> None:
    hold_writes(node)
    async with raw(node.address) as (_, writer):
        writer.write(a_write_then_a_long_poll())
        writer.close()  # at once: the poll is held after the node saw the EOF
        await both_read(node)
        node.service.store.release()
    # The poll is not held for a client that is gone, nor its connection kept.
    await wait_until(lambda: not node.server.connections and polls_waiting(node) == 0)
    assert "w" in node.table  # the write is applied all the same


async def test_a_long_poll_behind_a_write_ends_at_the_callers_eof(node: Node) -> None:
    hold_writes(node)
    async with raw(node.address) as (reader, writer):
        writer.write(a_write_then_a_long_poll())
        writer.write_eof()  # stops sending, still reads
        await both_read(node)
        node.service.store.release()
        replies = await read_to_eof(reader)  # both replies, then the node ends it
    assert [(name, seqid) for name, _, seqid, _ in replies] == [
        ("push_parameters", 1),
        ("pull_parameters", 2),
    ]
    assert replies[0][3].success.versions == {"w": 1}
    _, mtype, _, error = replies[1]
    assert mtype == MessageType.EXCEPTION, replies[1]
    assert error.type == TApplicationException.INTERNAL_ERROR
    await wait_until(lambda: not node.server.connections and polls_waiting(node) == 0)


async def test_a_long_poll_behind_a_write_is_answered_at_shutdown() -> None:
    node = Node("127.0.0.1", 0)
    await node.start()
    stopping: asyncio.Task | None = None
    try:
        hold_writes(node)
        async with raw(node.address) as (reader, writer):
            writer.write(a_write_then_a_long_poll())
            await both_read(node)
            # So the poll is called, and held, only after close() ended the held reads.
            start = time.monotonic()
            stopping = asyncio.ensure_future(node.stop(grace=30.0))
            await asyncio.sleep(0)  # (stop has begun)
            node.service.store.release()  # (the write is applied now)
            # Both replies, then the node ends the connection (before the fix:
            # the push's reply only, then nothing for the whole grace).
            replies = await read_to_eof(reader)
        async with asyncio.timeout(TIMEOUT):
            await asyncio.shield(stopping)
        elapsed = time.monotonic() - start
    finally:
        if stopping is None:
            await node.stop()
        elif not stopping.done():
            for conn in list(node.server.connections):
                conn.abort()
            await stopping
    assert elapsed < TIMEOUT
    assert [(name, seqid) for name, _, seqid, _ in replies] == [
        ("push_parameters", 1),
        ("pull_parameters", 2),
    ]
    assert replies[0][3].success.versions == {"w": 1}
    # As a poll held before close() is answered (see ServerConnection.close).
    error = replies[1][3].error
    assert error is not None, replies[1]
    assert error.code == ErrorCode.UNAVAILABLE
    assert error.message == "the node is shutting down"


# ---------------------------------------------------------------------------
# Read-your-writes and a repeated push


async def test_a_read_behind_a_repeated_push_sees_the_write_before_it(node: Node) -> None:
    async with raw(node.address) as (reader, writer):
        g = thrift.Parameter(
            name="g",
            data=np.zeros(4, np.float32).tobytes(),
            dtype="<f4",
            shape=[4],
            rule=thrift.Rule(kind="sum"),
        )
        setup = method("push_parameters").args(
            update=thrift.ParameterUpdate(
                params=[g, thrift.Parameter(name="b", data=b"old!")], timestamp=1
            )
        )
        writer.write(encoded("push_parameters", setup, seqid=1) + push_gradients(2, "X"))
        first = await read_replies(reader, 2)
        assert first[1][3].success.versions == {"g": 2}
        # A write, the push X again (answered with the first push's outcome, done
        # long ago) and a read, pipelined: the read must see the write.
        writer.write(push(3, "b", b"new!") + push_gradients(4, "X") + pull(5, "b"))
        got = await read_replies(reader, 3)
    assert [(name, seqid) for name, _, seqid, _ in got] == [
        ("push_parameters", 3),
        ("push_gradients", 4),
        ("pull_parameters", 5),
    ]
    assert got[0][3].success.versions == {"b": 2}
    assert got[1][3].success.versions == {"g": 2}  # (not applied twice)
    (b,) = got[2][3].success.params
    assert (bytes(b.data), b.version) == (b"new!", 2)
