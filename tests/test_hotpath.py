"""The small-call path: replies coalesced per read, in order; the writer's wake-up."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from thriftpy2.thrift import TApplicationException

from aioparamsync import Node, to_parameter
from aioparamsync.store import ParameterStore
from aioparamsync.wire import Receiver, decode_header, encode_message, method, thrift


class RecordingTransport:
    """Wraps a server connection's transport; records each write."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.writes: list[bytes] = []

    def writelines(self, parts: Any) -> None:
        self.writes.append(b"".join(bytes(p) for p in parts))
        self._transport.writelines(parts)

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def request(name: str, seqid: int, **args: Any) -> bytes:
    m = method(name)
    assert m is not None
    parts, _ = encode_message(name, 1, seqid, m.args(**args))
    return b"".join(bytes(p) for p in parts)


def get(seqid: int, *names: str) -> bytes:
    return request(
        "pull_parameters", seqid, request=thrift.ParameterRequest(param_names=list(names))
    )


def push(seqid: int, name: str, value: float) -> bytes:
    update = thrift.ParameterUpdate(
        params=[to_parameter(name, np.full(4, value, np.float32))], timestamp=1
    )
    return request("push_parameters", seqid, update=update)


async def replies(reader: asyncio.StreamReader, count: int) -> list[tuple[str, int, int, Any]]:
    """The next ``count`` replies: (name, message type, seqid, result or exception)."""
    receiver = Receiver(framed=True)
    found: list[tuple[str, int, int, Any]] = []
    while len(found) < count:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, f"EOF after {len(found)} replies"
        for frame in receiver.feed(data):
            name, mtype, seqid, body = decode_header(frame.payload, frame.protocol)
            m = method(name)
            cls = TApplicationException if mtype == 3 or m is None else m.result
            found.append((name, mtype, seqid, body.read_body(cls)))
    return found


async def connect(node: Node) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Any]:
    reader, writer = await asyncio.open_connection(*node.address)
    for _ in range(200):
        if node.server.connections:
            break
        await asyncio.sleep(0.005)
    (conn,) = node.server.connections
    recording = RecordingTransport(conn.transport)
    conn.transport = recording
    return reader, writer, recording


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


async def test_replies_to_one_read_go_out_in_one_write_in_order(node: Node) -> None:
    reader, writer, recording = await connect(node)
    writer.write(push(1, "a", 1.0))
    await replies(reader, 1)
    recording.writes.clear()
    # Three reads in one segment: answered at once, so written at once.
    writer.write(get(2, "a") + get(3, "missing") + get(4, "a"))
    got = await replies(reader, 3)
    assert [(name, seqid) for name, _, seqid, _ in got] == [
        ("pull_parameters", 2),
        ("pull_parameters", 3),
        ("pull_parameters", 4),
    ]
    assert [len(r.success.params) for *_, r in got] == [1, 0, 1]
    assert len(recording.writes) == 1
    await close(writer)


async def test_reads_behind_a_write_in_one_read_see_it_and_keep_their_order(node: Node) -> None:
    reader, writer, _ = await connect(node)
    writer.write(get(1, "w") + push(2, "w", 7.0) + get(3, "w") + push(4, "w", 8.0) + get(5, "w"))
    got = await replies(reader, 5)
    assert [seqid for _, _, seqid, _ in got] == [1, 2, 3, 4, 5]
    assert got[0][3].success.params == []
    assert got[1][3].success.versions == {"w": 1}
    assert got[2][3].success.params[0].version >= 1  # (the later write may be in too)
    assert got[3][3].success.versions == {"w": 2}
    (last,) = got[4][3].success.params
    assert last.version == 2
    assert np.frombuffer(last.data, np.float32)[0] == 8.0
    await close(writer)


async def test_replies_before_a_protocol_error_go_first(node: Node) -> None:
    reader, writer, _ = await connect(node)
    writer.write(push(1, "p", 1.0))
    await replies(reader, 1)
    # Two good calls, then a frame whose message has a bad version word, in one read.
    bad = b"\x80\x02\x00\x01" + b"\x00" * 8
    writer.write(get(2, "p") + get(3, "p") + len(bad).to_bytes(4, "big") + bad)
    got = await replies(reader, 3)
    assert [(seqid, mtype) for _, mtype, seqid, _ in got] == [(2, 2), (3, 2), (0, 3)]
    assert got[2][3].type == TApplicationException.PROTOCOL_ERROR
    assert await asyncio.wait_for(reader.read(), 10) == b""  # then the node half-closes
    await close(writer)


async def test_the_writer_wakes_for_each_submit_after_idling_and_on_close() -> None:
    store = ParameterStore()
    writer = asyncio.create_task(store.run())
    for i in range(3):
        param = thrift.Parameter(name="a", data=b"abcd")
        assert (await store.submit([param], i)).entries[0].version == i + 1
        await asyncio.sleep(0.01)  # the writer is idle again
    assert store.batches == 3
    store.close()
    await asyncio.wait_for(writer, 10)


async def test_a_cancelled_writer_leaves_submit_working() -> None:
    store = ParameterStore()
    writer = asyncio.create_task(store.run())
    await asyncio.sleep(0.01)
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)
    queued = store.submit([thrift.Parameter(name="a", data=b"abcd")], 1)  # no error
    assert not queued.done()
    again = asyncio.create_task(store.run())
    assert (await queued).entries[0].version == 1
    store.close()
    await asyncio.wait_for(again, 10)
