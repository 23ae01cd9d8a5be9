"""The small-call path: replies coalesced per read, in order; the writer's wake-up;
the codec's in-place maps and lists read and write as the general walk does."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np
import pytest
from cluster_helpers import eventually
from codec_helpers import PROPERTY, GeneralReader, mutate, outcome
from hypothesis import example, given
from hypothesis import strategies as st
from thriftpy2.protocol import TBinaryProtocolFactory
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TMemoryBuffer

from aioparamsync import Node, ParameterClient, to_parameter
from aioparamsync.errors import LocalProtocolError, RequestError
from aioparamsync.store.writer import NOT_NOW, ParameterStore
from aioparamsync.wire import (
    MessageType,
    Protocol,
    Receiver,
    decode_header,
    encode_message,
    method,
    thrift,
)
from aioparamsync.wire import binary as codec


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

    def accepted() -> Any:
        connections = list(node.server.connections)
        assert len(connections) == 1, f"the node holds {len(connections)} connections"
        return connections[0]

    conn = await eventually(accepted, timeout=10)
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


# ---------------------------------------------------------------------------
# The codec: maps of strings to integers, lists of strings, read and written in place


def message(body: bytes) -> bytes:
    return struct.pack("!Ii", 0x80010002, 1) + b"x" + struct.pack("!i", 1) + body


def entry(key: bytes, value: int, size: int = 4) -> bytes:
    return struct.pack("!i", len(key)) + key + value.to_bytes(size, "big", signed=True)


keys = st.one_of(st.text(max_size=5).map(str.encode), st.just(b"\xff\xfe"))
entries = st.lists(st.tuples(keys, st.integers(-(2**31), 2**31 - 1)), max_size=4)


@st.composite
def update_results(draw: st.DrawFn) -> bytes:
    """An UpdateResult's body: versions (a map, its header maybe lying) and a timestamp."""
    found = draw(entries)
    count = draw(st.one_of(st.just(len(found)), st.integers(-2, 6)))
    kwire, vwire = draw(st.sampled_from([(11, 8), (11, 8), (8, 8), (11, 10)]))
    versions = struct.pack("!bhbbi", 13, 1, kwire, vwire, count)
    versions += b"".join(entry(k, v) for k, v in found)
    timestamp = struct.pack("!bhq", 10, 2, draw(st.integers(-(2**63), 2**63 - 1)))
    chunks = draw(st.permutations([versions, timestamp]))
    return b"".join(chunks) + b"\x00"


@PROPERTY
@given(
    body=update_results(),
    cut=st.one_of(st.none(), st.integers(0, 1000)),
    flips=st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 255)), max_size=2),
    stream=st.booleans(),
)
@example(body=struct.pack("!bhbbi", 13, 1, 11, 8, 0) + b"\x00", cut=None, flips=[], stream=False)
@example(  # a key that is not UTF-8, its value cut short
    body=struct.pack("!bhbbi", 13, 1, 11, 8, 1) + entry(b"\xff", 1)[:-2],
    cut=None,
    flips=[],
    stream=False,
)
def test_a_map_of_versions_reads_as_the_general_walk_reads_it(
    body: bytes, cut: int | None, flips: list, stream: bool
) -> None:
    data = mutate(message(body), cut, flips)
    expected = outcome(GeneralReader, data, thrift.UpdateResult, stream)
    assert outcome(codec.BinaryReader, data, thrift.UpdateResult, stream) == expected


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    """A ParameterRequest's body: param_names (a list, its header maybe lying) and more."""
    names = draw(st.lists(keys, max_size=4))
    count = draw(st.one_of(st.just(len(names)), st.integers(-2, 6)))
    wire = draw(st.sampled_from([11, 11, 8]))
    listed = struct.pack("!bhbi", 15, 1, wire, count)
    listed += b"".join(struct.pack("!i", len(n)) + n for n in names)
    min_version = struct.pack("!bhi", 8, 2, draw(st.integers(-(2**31), 2**31 - 1)))
    chunks = draw(st.permutations([listed, min_version]))
    return b"".join(chunks) + b"\x00"


@PROPERTY
@given(
    body=requests(),
    cut=st.one_of(st.none(), st.integers(0, 1000)),
    flips=st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 255)), max_size=2),
    stream=st.booleans(),
)
@example(body=struct.pack("!bhbi", 15, 1, 11, 0) + b"\x00", cut=None, flips=[], stream=False)
@example(  # a name that is not UTF-8
    body=struct.pack("!bhbi", 15, 1, 11, 1) + struct.pack("!i", 1) + b"\xff\x00",
    cut=None,
    flips=[],
    stream=False,
)
def test_a_list_of_names_reads_as_the_general_walk_reads_it(
    body: bytes, cut: int | None, flips: list, stream: bool
) -> None:
    data = mutate(message(body), cut, flips)
    expected = outcome(GeneralReader, data, thrift.ParameterRequest, stream)
    assert outcome(codec.BinaryReader, data, thrift.ParameterRequest, stream) == expected


def thriftpy2_bytes(obj: Any) -> bytes:
    buf = TMemoryBuffer()
    TBinaryProtocolFactory().get_protocol(buf).write_struct(obj)
    return buf.getvalue()


def ours(obj: Any) -> bytes:
    writer = codec.BinaryWriter()
    writer.write_struct(obj)
    parts, _ = writer.getvalue()
    return b"".join(bytes(p) for p in parts)


texts = st.text(max_size=6)


@PROPERTY
@given(
    versions=st.dictionaries(texts, st.integers(-(2**31), 2**31 - 1), max_size=4),
    names=st.lists(texts, max_size=4),
    shape=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12),
)
def test_maps_and_lists_are_written_as_thriftpy2_writes_them(
    versions: dict, names: list, shape: list
) -> None:
    for obj in (
        thrift.UpdateResult(versions=versions, timestamp=7),
        thrift.ParameterRequest(param_names=names, min_version=1),
        thrift.Parameter(name="w", data=b"ab", shape=shape),
        thrift.ParameterUpdate(
            params=[thrift.Parameter(name=n, data=b"") for n in names], timestamp=1
        ),
    ):
        assert ours(obj) == thriftpy2_bytes(obj)
    request = thrift.ParameterRequest(param_names=names)
    _, _, _, reader = decode_header(message(ours(request)), Protocol.BINARY)
    assert reader.read_body(thrift.ParameterRequest).param_names == names


class Name(str):
    pass


def test_keys_and_names_of_other_types_go_the_general_way() -> None:
    big = "k" * codec.ZERO_COPY_MIN_BYTES
    obj = thrift.UpdateResult(versions={Name("a"): 1, big: 2}, timestamp=3)
    assert ours(obj) == thriftpy2_bytes(thrift.UpdateResult(versions={"a": 1, big: 2}, timestamp=3))
    request = thrift.ParameterRequest(param_names=(n for n in ["a", b"b"]))
    assert ours(request) == thriftpy2_bytes(thrift.ParameterRequest(param_names=["a", "b"]))


@pytest.mark.parametrize(
    "obj",
    [
        thrift.UpdateResult(versions={"a": 2**31}, timestamp=1),
        thrift.UpdateResult(versions={"a": None}, timestamp=1),
        thrift.UpdateResult(versions={1: 1}, timestamp=1),
        thrift.ParameterRequest(param_names=["a", None]),
        thrift.ParameterRequest(param_names=["\udc80"]),
        thrift.ParameterUpdate(params=[object()], timestamp=1),
        thrift.ParameterUpdate(params=5, timestamp=1),
    ],
    ids=["overflow", "none-value", "int-key", "none-name", "surrogate", "no-struct", "no-list"],
)
def test_bad_maps_and_lists_are_local_protocol_errors(obj: Any) -> None:
    with pytest.raises(LocalProtocolError):
        encode_message("x", MessageType.REPLY, 1, obj)


def test_a_struct_of_a_subclass_is_written_as_its_own_class() -> None:
    class Special(thrift.Parameter):  # type: ignore[misc, name-defined]
        pass

    update = thrift.ParameterUpdate(params=[Special(name="s", data=b"x")], timestamp=1)
    plain = thrift.ParameterUpdate(params=[thrift.Parameter(name="s", data=b"x")], timestamp=1)
    assert ours(update) == thriftpy2_bytes(plain)


# ---------------------------------------------------------------------------
# A write's reply in the writer's step (the store's Answer tells its observer at once)


async def test_the_writer_tells_an_answers_observer_before_its_done_callbacks() -> None:
    store = ParameterStore()
    writer = asyncio.create_task(store.run())
    order: list[str] = []
    good = store.submit([thrift.Parameter(name="a", data=b"abcd")], 1)
    bad = store.submit([thrift.Parameter(name="", data=b"abcd")], 2)
    for name, future in (("good", good), ("bad", bad)):
        assert future.eager is None
        future.add_done_callback(lambda f, name=name: order.append(f"{name} callback"))
        future.eager = lambda f, name=name: order.append(f"{name} told, done={f.done()}")
    await asyncio.gather(good, bad, return_exceptions=True)
    await asyncio.sleep(0)
    assert order.index("good told, done=True") < order.index("good callback")
    assert order.index("bad told, done=True") < order.index("bad callback")
    assert good.eager is None and bad.eager is None  # told once
    store.close()
    await writer


async def test_an_update_is_applied_at_once_only_when_the_writer_would_apply_it_next() -> None:
    store = ParameterStore()
    fed: list[list[str]] = []
    store.subscribe(lambda entries, replicated: fed.append([e.name for e in entries]))
    p = thrift.Parameter(name="a", data=b"abcd")
    assert store.apply_now([p], 1, lambda a: a) is NOT_NOW  # (no writer running)
    writer = asyncio.create_task(store.run())
    await asyncio.sleep(0)
    applied = store.apply_now([p], 3, lambda a: ("told", a.entries[0].version, a.timestamp))
    assert applied == ("told", 1, 3) and store.table.entry("a").version == 1
    assert fed == [["a"]] and store.updates_applied == 1
    # Behind a queued update, it waits its turn (and is applied after it).
    queued = store.submit([thrift.Parameter(name="a", data=b"efgh")], 4)
    assert store.apply_now([p], 5, lambda a: a) is NOT_NOW
    assert (await queued).entries[0].version == 2
    # A refused update raises, and nothing of it is applied.
    bad = [thrift.Parameter(name="b", data=b"x"), thrift.Parameter(name="", data=b"x")]
    with pytest.raises(RequestError):
        store.apply_now(bad, 6, lambda a: a)
    assert store.table.entry("b") is None and store.updates_refused == 1
    # Nor while a cut holds the writes, nor once closed.
    store.start_hold()
    assert store.apply_now([p], 7, lambda a: a) is NOT_NOW
    store.release()
    store.close()
    assert store.apply_now([p], 8, lambda a: a) is NOT_NOW
    await writer
    assert store.table.entry("a").version == 2


async def test_a_failing_observer_fails_nothing_else(caplog) -> None:
    store = ParameterStore()
    writer = asyncio.create_task(store.run())
    future = store.submit([thrift.Parameter(name="a", data=b"abcd")], 1)
    future.eager = lambda f: 1 // 0
    assert (await future).entries[0].version == 1
    assert (await store.submit([thrift.Parameter(name="a", data=b"abcd")], 2)).entries
    assert "observer" in caplog.text
    store.close()
    await writer


async def test_each_call_is_observed_once(node: Node) -> None:
    seen: list[tuple[str, bool]] = []
    node.server.call_observer = lambda name, seconds, exc: seen.append((name, exc is None))
    # (no topology call; nor info and ping, asking for the node's Unix socket)
    async with ParameterClient(node.address, route=False, shared_memory=0) as client:
        await client.update_arrays({"w": np.ones(4, np.float32)})
        await client.broadcast_update({"w": np.zeros(4, np.float32)})  # oneway, then a ping
        await client.get_arrays(["w"])
        with pytest.raises(RequestError):
            await client.update_parameters([thrift.Parameter(name="", data=b"x")])
    assert seen == [
        ("push_parameters", True),
        ("broadcast_update", True),
        ("ping", True),
        ("pull_parameters", True),
        ("push_parameters", False),
    ]


async def test_a_retried_push_shares_its_answer_and_both_callers_get_it(node: Node) -> None:
    async with ParameterClient(node.address) as setup:
        await setup.update_arrays({"g": np.zeros(2, np.float32)}, rules=thrift.Rule(kind="sgd"))
    async with ParameterClient(node.address) as a, ParameterClient(node.address) as b:
        grads = {"g": np.ones(2, np.float32)}
        first, second = await asyncio.gather(
            a.push_gradients(grads, request_id="r-1"), b.push_gradients(grads, request_id="r-1")
        )
    assert first == second == {"g": 2}
