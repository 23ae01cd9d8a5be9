"""The fast paths of the small-call path keep the general path's behaviour.

* The binary protocol reads each struct with code made for its class, which
  expects the fields in id order and leaves anything else to the general
  walk: whatever the bytes (fields out of order, repeated, unknown, of
  another type, malformed, cut short), the outcome is the general walk's,
  values and errors alike.
* It writes each struct with code made for its class: the bytes are
  thriftpy2's (test_fuzz), a small message is one buffer, large binaries go
  by reference, and bad values are a LocalProtocolError.
* The store's writer makes a caller's answer with ``then``.
* A client's per-call deadlines share one timer per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
import time
from typing import Any, ClassVar

import numpy as np
import pytest
from codec_helpers import PROPERTY, GeneralReader, mutate, outcome
from hypothesis import example, given
from hypothesis import strategies as st

from aioparamsync import ParameterClient
from aioparamsync.errors import CallTimeout, LocalProtocolError
from aioparamsync.store.writer import ParameterStore
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

I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


# ---------------------------------------------------------------------------
# Bodies made of field chunks: in any order, repeated, unknown, mistyped


class LooseParameter:
    """Parameter's fields, none required, so that each can be written alone."""

    thrift_spec: ClassVar[dict] = {
        fid: (*spec[:-1], False) for fid, spec in thrift.Parameter.thrift_spec.items()
    }


def field_chunk(**values: Any) -> bytes:
    """One Parameter field as the binary protocol writes it (header and value)."""
    obj = LooseParameter()
    for name in ("name", "data", "version", "dtype", "shape", "origin"):
        setattr(obj, name, values.get(name))
    writer = codec.BinaryWriter()
    writer.write_struct(obj)
    return bytes(writer.out[:-1])  # without the STOP


texts = st.text(max_size=6)
parameter_chunks = st.one_of(
    texts.map(lambda v: field_chunk(name=v)),
    st.binary(max_size=12).map(lambda v: field_chunk(data=v)),
    st.integers(*I32).map(lambda v: field_chunk(version=v)),
    texts.map(lambda v: field_chunk(dtype=v)),
    st.lists(st.integers(*I64), max_size=3).map(lambda v: field_chunk(shape=v)),
    texts.map(lambda v: field_chunk(origin=v)),
    # an unknown field; a known id with another type; a string that is not UTF-8
    st.binary(max_size=6).map(lambda v: struct.pack("!bhi", 11, 99, len(v)) + v),
    st.integers(1, 6).map(lambda fid: struct.pack("!bhi", 8, fid, 7)),
    st.just(struct.pack("!bhi", 11, 1, 2) + b"\xff\xfe"),
)
parameter_bodies = st.lists(parameter_chunks, max_size=8).map(lambda c: b"".join(c) + b"\x00")


@st.composite
def update_bodies(draw: st.DrawFn) -> bytes:
    """A ParameterUpdate: its list of Parameter bodies and its timestamp, in any order."""
    params = draw(st.lists(parameter_bodies, max_size=3))
    chunks = [
        struct.pack("!bhbi", 15, 1, 12, len(params)) + b"".join(params),
        struct.pack("!bhq", 10, 2, draw(st.integers(*I64))),
    ]
    order = draw(st.permutations(chunks))
    repeat = draw(st.lists(st.sampled_from(chunks), max_size=1))
    return b"".join(order + repeat) + b"\x00"


def message(body: bytes, name: bytes = b"push_parameters") -> bytes:
    return struct.pack("!Ii", 0x80010001, len(name)) + name + struct.pack("!i", 1) + body


cuts = st.one_of(st.none(), st.integers(0, 10_000))
flip_lists = st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), max_size=2)


@PROPERTY
@given(body=parameter_bodies, cut=cuts, flips=flip_lists, stream=st.booleans())
@example(  # out of order
    body=field_chunk(data=b"x") + field_chunk(name="n") + b"\x00", cut=None, flips=[], stream=False
)
@example(  # repeated
    body=field_chunk(name="a") + field_chunk(name="b") + b"\x00", cut=None, flips=[], stream=False
)
@example(  # not UTF-8, then the STOP
    body=struct.pack("!bhi", 11, 1, 2) + b"\xff\xfe\x00", cut=None, flips=[], stream=False
)
def test_a_struct_reads_as_the_general_walk_reads_it(
    body: bytes, cut: int | None, flips: list, stream: bool
) -> None:
    data = mutate(message(body, b"x"), cut, flips)
    expected = outcome(GeneralReader, data, thrift.Parameter, stream)
    assert outcome(codec.BinaryReader, data, thrift.Parameter, stream) == expected


@PROPERTY
@given(update=update_bodies(), cut=cuts, flips=flip_lists, stream=st.booleans())
def test_nested_structs_read_as_the_general_walk_reads_them(
    update: bytes, cut: int | None, flips: list, stream: bool
) -> None:
    args = struct.pack("!bh", 12, 1) + update + b"\x00"  # push_parameters_args.update
    data = mutate(message(args), cut, flips)
    cls = method("push_parameters").args
    expected = outcome(GeneralReader, data, cls, stream)
    assert outcome(codec.BinaryReader, data, cls, stream) == expected


def test_fields_out_of_order_are_read() -> None:
    body = (
        field_chunk(shape=[2, 3])
        + field_chunk(data=b"abcdef")
        + struct.pack("!bhi", 11, 42, 3)  # unknown: skipped
        + b"new"
        + field_chunk(name="w")
        + b"\x00"
    )
    data = message(body, b"x")
    _, _, _, reader = decode_header(data, Protocol.BINARY)
    p = reader.read_body(thrift.Parameter)
    assert (p.name, bytes(p.data), p.shape, p.version) == ("w", b"abcdef", [2, 3], 0)


def test_binary_fields_are_read_only_views_of_the_frame() -> None:
    m = method("push_parameters")
    param = thrift.Parameter(name="w", data=b"\x01" * 100, dtype="|u1")
    args = m.args(update=thrift.ParameterUpdate(params=[param], timestamp=1))
    parts, _ = encode_message(m.name, MessageType.CALL, 1, args)
    frame = Receiver(framed=True).feed(b"".join(bytes(p) for p in parts))[0]
    _, _, _, reader = decode_header(frame.payload, frame.protocol)
    data = reader.read_body(m.args).update.params[0].data
    assert isinstance(data, memoryview) and data.readonly
    assert data.obj is frame.payload.obj  # no copy


def test_a_missing_required_field_is_named_in_both_paths() -> None:
    data = message(field_chunk(data=b"x") + b"\x00", b"x")
    for reader_cls in (codec.BinaryReader, GeneralReader):
        assert outcome(reader_cls, data, thrift.Parameter, False) == (
            "RemoteProtocolError",
            "required field Parameter.name is missing",
        )


# ---------------------------------------------------------------------------
# Writing


def test_a_small_message_is_one_buffer_with_its_frame_length() -> None:
    result = method("push_parameters").result(
        success=thrift.UpdateResult(versions={"w": 3}, timestamp=5)
    )
    parts, size = encode_message("push_parameters", MessageType.REPLY, 9, result)
    assert len(parts) == 1 and len(parts[0]) == size
    assert struct.unpack_from("!i", parts[0])[0] == size - 4
    unframed, _ = encode_message("push_parameters", MessageType.REPLY, 9, result, framed=False)
    assert bytes(parts[0][4:]) == b"".join(bytes(p) for p in unframed)


def test_a_large_binary_goes_by_reference() -> None:
    payload = bytes(range(256)) * 256  # 64 KiB
    m = method("push_parameters")
    param = thrift.Parameter(name="w", data=payload)
    args = m.args(update=thrift.ParameterUpdate(params=[param], timestamp=1))
    parts, size = encode_message(m.name, MessageType.CALL, 1, args)
    by_reference = [p for p in parts if isinstance(p, memoryview) and p.obj is payload]
    assert len(by_reference) == 1
    assert struct.unpack_from("!i", parts[0])[0] == size - 4 == sum(len(p) for p in parts) - 4


@pytest.mark.parametrize(
    "param",
    [
        thrift.Parameter(data=b"x"),  # required name missing
        thrift.Parameter(name="w", data=memoryview(bytes(8))[::2]),  # not contiguous
        thrift.Parameter(name="w", data=b"x", version=1.5),
        thrift.Parameter(name="w", data=b"x", shape=[1.5]),
        thrift.Parameter(name="w", data=b"x", version=2**31),
        thrift.Parameter(name="\udc80", data=b"x"),
    ],
    ids=["missing", "strided", "float-i32", "float-list", "i32-overflow", "surrogate"],
)
@pytest.mark.parametrize("protocol", [Protocol.BINARY, Protocol.COMPACT])
def test_values_that_cannot_be_encoded_are_local_protocol_errors(
    param: Any, protocol: Protocol
) -> None:
    m = method("push_parameters")
    args = m.args(update=thrift.ParameterUpdate(params=[param], timestamp=1))
    with pytest.raises(LocalProtocolError):
        encode_message(m.name, MessageType.CALL, 1, args, protocol)


def test_an_unknown_method_name_is_echoed_without_growing_a_cache() -> None:
    error = thrift.ParameterError(code=1, message="m")
    for i in range(2 * codec._BIN_NAMES_MAX):
        name = f"made-up-{i}"
        parts, _ = encode_message(name, MessageType.EXCEPTION, 1, error, framed=False)
        got, mtype, seqid, _ = decode_header(b"".join(bytes(p) for p in parts), Protocol.BINARY)
        assert (got, mtype, seqid) == (name, MessageType.EXCEPTION, 1)
    assert len(codec._BIN_NAMES) <= codec._BIN_NAMES_MAX


# ---------------------------------------------------------------------------
# The store's writer makes the answer


def _param(name: str) -> Any:
    return thrift.Parameter(name=name, data=b"abcd")


async def test_then_answers_with_what_it_makes_and_fails_alone() -> None:
    store = ParameterStore()
    writer = asyncio.create_task(store.run())
    made = store.submit([_param("a")], 1, then=lambda applied: ("made", applied.entries[0].version))
    broken = store.submit([_param("b")], 2, then=lambda applied: 1 // 0)
    plain_future = store.submit([_param("c")], 3)
    assert await made == ("made", 1)
    with pytest.raises(ZeroDivisionError):
        await broken
    assert (await plain_future).entries[0].name == "c"
    assert "b" in store.table  # applied: only its answer failed
    store.close()
    await writer


# ---------------------------------------------------------------------------
# Per-call deadlines on one timer per connection


@contextlib.asynccontextmanager
async def silent_server():
    """A peer that reads every call and answers none."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        server.close()


async def test_a_shorter_deadline_after_a_longer_one_is_kept() -> None:
    async with silent_server() as address, ParameterClient(address, max_connections=1) as client:
        slow = asyncio.ensure_future(client.ping(timeout=30))
        await asyncio.sleep(0.05)
        start = time.monotonic()
        with pytest.raises(CallTimeout, match="ping"):
            await client.ping(timeout=0.2)
        assert time.monotonic() - start < 2
        (conn,) = client._connections
        assert len(conn._deadlines) == 1  # the slow call's
        slow.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await slow
        assert not conn._deadlines and not conn.pending


async def test_deadlines_expire_in_order_on_one_connection() -> None:
    async with silent_server() as address, ParameterClient(address, max_connections=1) as client:
        timeouts = [0.3, 0.1, 0.2]
        start = time.monotonic()
        calls = [asyncio.ensure_future(client.ping(timeout=t)) for t in timeouts]
        finished: list[float] = []
        for call in asyncio.as_completed(calls):
            with pytest.raises(CallTimeout):
                await call
            finished.append(time.monotonic() - start)
        assert finished == sorted(finished)
        assert all(f >= t - 0.01 for f, t in zip(finished, sorted(timeouts), strict=True))
        (conn,) = client._connections
        assert not conn._deadlines and not conn.pending


async def test_no_deadline_arms_no_timer() -> None:
    async with silent_server() as address, ParameterClient(address, timeout=None) as client:
        call = asyncio.ensure_future(client.ping())
        await asyncio.sleep(0.05)
        (conn,) = client._connections
        assert conn._timer is None and not conn._deadlines
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call


def test_np_arrays_encode_as_their_bytes() -> None:
    array = np.arange(6, dtype="<f4").reshape(2, 3)
    param = thrift.Parameter(name="w", data=memoryview(array), dtype="<f4", shape=[2, 3])
    body = codec.BinaryWriter()
    body.write_struct(param)
    assert array.tobytes() in bytes(body.out)
    assert list(itertools.islice(iter(bytes(body.out)), 3)) == [11, 0, 1]
