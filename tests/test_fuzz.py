"""Property tests of the sans-IO wire (codec and framing), with hypothesis; no event loop.

(a) Whatever bytes arrive, ``Receiver`` + ``decode_header`` + ``read_body``
    either succeed or raise ``RemoteProtocolError``, never anything else; the
    outcome does not depend on how the bytes are split into reads; and what
    the receiver holds stays within ``max_frame_bytes``.
(b) The same invariant on mutations (flipped, inserted, deleted, overwritten
    bytes) of valid messages of every protocol and framing.
(c) Round trips: our encoding decodes to equal values, is byte for byte what
    thriftpy2 writes, and thriftpy2 reads it back to equal values.

Plus deterministic cases: counts and lengths claimed by hostile bytes are
refused before anything is allocated for them (measured with tracemalloc).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import struct
import time
import tracemalloc
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from thriftpy2.protocol import TBinaryProtocol, TCompactProtocol
from thriftpy2.protocol.binary import TBinaryProtocol as PyTBinaryProtocol
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TMemoryBuffer

from aioparamsync.errors import LocalProtocolError, RemoteProtocolError, RequestError
from aioparamsync.values.arrays import check_layout
from aioparamsync.wire import (
    MessageType,
    Protocol,
    Receiver,
    decode_header,
    encode_message,
    method,
    thrift,
)
from aioparamsync.wire.idl import MAX_METHOD_NAME_BYTES
from aioparamsync.wire.protocol import MAX_I32

FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
ROUND_TRIP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

PROTOCOLS = (Protocol.BINARY, Protocol.COMPACT)
I16 = (-(2**15), 2**15 - 1)
I32 = (-(2**31), 2**31 - 1)
I64 = (-(2**63), 2**63 - 1)


class _Empty:
    """A struct with no fields: decoding it skips every field (exercises ``skip``)."""

    thrift_spec: ClassVar[dict] = {}

    def __init__(self, **kwargs: Any) -> None:
        assert not kwargs


# Every struct a message body may be decoded as.
ALL_BODIES: list[type] = [_Empty, TApplicationException]
for _name in ("push_parameters", "update_parameters", "pull_parameters", "info", "ping"):
    ALL_BODIES.append(method(_name).args)
    ALL_BODIES.append(method(_name).result)
ALL_BODIES.append(method("broadcast_update").args)


def plain(value: Any) -> Any:
    """A thriftpy2 struct (or value) as plain comparable data; buffers as bytes."""
    if isinstance(value, (memoryview, bytearray)):
        return bytes(value)
    if isinstance(value, float) and math.isnan(value):
        return "NaN"  # so that equal decodings compare equal
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, set):
        return {plain(v) for v in value}
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    spec = getattr(value, "thrift_spec", None)
    if spec is not None:
        return (
            type(value).__name__,
            {f[1]: plain(getattr(value, f[1], None)) for f in spec.values()},
        )
    return value


def body_classes(name: str, mtype: int) -> list[type]:
    """The struct the message's own header implies, then every other one."""
    m = method(name)
    own: type | None = None
    if mtype == MessageType.EXCEPTION:
        own = TApplicationException
    elif m is not None:
        own = m.result if mtype == MessageType.REPLY else m.args
    return ([own] if own is not None else []) + [c for c in ALL_BODIES if c is not own]


def decode_frame(frame: Any) -> tuple:
    """Decode one frame every way we can; answer a summary of each outcome.

    Only RemoteProtocolError is caught: any other exception fails the test.
    """
    try:
        name, mtype, seqid, _ = decode_header(frame.payload, frame.protocol)
    except RemoteProtocolError:
        return ("bad header",)
    outcomes = []
    for cls in body_classes(name, mtype):
        _, _, _, reader = decode_header(frame.payload, frame.protocol)
        try:
            body = reader.read_body(cls)
        except RemoteProtocolError:
            outcomes.append(None)
        else:
            outcomes.append(plain(body))
    return (name, mtype, seqid, frame.protocol, frame.framed, outcomes)


def receive(
    chunks: list[bytes], max_frame_bytes: int, framed: bool | None
) -> tuple[list, bool, int]:
    """Feed the chunks to a receiver; answer (decoded frames, failed, pending bytes)."""
    receiver = Receiver(max_frame_bytes, framed=framed)
    decoded: list = []
    try:
        for chunk in chunks:
            frames = receiver.feed(chunk)
            # Memory: what the receiver holds is one message at most.
            assert receiver.pending_bytes <= max_frame_bytes + 4, receiver
            for frame in frames:
                if frame.framed:
                    # (unframed: see test_unframed_message_larger_than_the_limit)
                    assert 0 < len(frame.payload) <= max_frame_bytes
                decoded.append(decode_frame(frame))
    except RemoteProtocolError:
        return decoded, True, -1
    with contextlib.suppress(RemoteProtocolError):
        receiver.check_eof()
    return decoded, False, receiver.pending_bytes


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


def is_unframed(data: bytes, framed: bool | None) -> bool:
    return framed is None and data[:1] in (b"\x80", b"\x82")


def check_invariant(
    data: bytes, cuts: list[int], max_frame_bytes: int, framed: bool | None
) -> None:
    """Whole, byte by byte, and in random chunks: only RemoteProtocolError, same outcome."""
    whole = receive([data], max_frame_bytes, framed)
    bytewise = receive([data[i : i + 1] for i in range(len(data))], max_frame_bytes, framed)
    chunked = receive(split(data, cuts), max_frame_bytes, framed)
    for other in (bytewise, chunked):
        # The same bytes fail or not whatever the reads; frames cut before a
        # failure within one read are dropped with it, so compare prefixes.
        assert other[1] == whole[1]
        if whole[1]:
            assert other[0][: len(whole[0])] == whole[0]
        else:
            assert other == whole


# ---------------------------------------------------------------------------
# Strategies

names = st.text(max_size=12)
# A message's method name: none is longer than the longest method's (see decode_header).
method_names = names.filter(lambda n: len(n.encode()) <= MAX_METHOD_NAME_BYTES)
dtypes = st.one_of(
    st.none(),
    st.sampled_from(["<f4", "<f8", "|u1", "<i8", "|b1", ">c16", "<f2"]),
    st.text(max_size=6),
)
shapes = st.one_of(st.none(), st.lists(st.integers(*I64), max_size=4))
parameters = st.builds(
    thrift.Parameter,
    name=names,
    data=st.binary(max_size=48),
    version=st.integers(*I32),
    dtype=dtypes,
    shape=shapes,
)
updates = st.builds(
    thrift.ParameterUpdate, params=st.lists(parameters, max_size=3), timestamp=st.integers(*I64)
)
requests = st.builds(
    thrift.ParameterRequest,
    param_names=st.lists(names, max_size=4),
    min_version=st.integers(*I32),  # absent decodes as its default, 0
)
update_results = st.builds(
    thrift.UpdateResult,
    versions=st.dictionaries(names, st.integers(*I32), max_size=3),
    timestamp=st.integers(*I64),
)
node_infos = st.builds(
    thrift.NodeInfo,
    node_id=names,
    version=names,
    parameter_count=st.integers(*I64),
    parameter_bytes=st.integers(*I64),
    timestamp=st.integers(*I64),
    uptime_seconds=st.floats(allow_nan=False),
    counters=st.dictionaries(names, st.integers(*I64), max_size=3),
)
seqids = st.integers(*I32)


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, int, int, Any]:
    """(name, message type, seqid, body) of a message of the service, calls and replies."""
    kind = draw(
        st.sampled_from(
            [
                "push",
                "update",
                "broadcast",
                "pull",
                "get",
                "ping",
                "info",
                "push_reply",
                "push_error",
                "pull_reply",
                "info_reply",
                "exception",
            ]
        )
    )
    seqid = draw(seqids)
    call, reply = MessageType.CALL, MessageType.REPLY
    if kind in ("push", "update", "broadcast"):
        name = {
            "push": "push_parameters",
            "update": "update_parameters",
            "broadcast": "broadcast_update",
        }[kind]
        mtype = MessageType.ONEWAY if kind == "broadcast" else call
        return name, mtype, seqid, method(name).args(update=draw(updates))
    if kind in ("pull", "get"):
        name = "pull_parameters" if kind == "pull" else "get_parameters"
        return name, call, seqid, method(name).args(request=draw(requests))
    if kind in ("ping", "info"):
        return kind, call, seqid, method(kind).args()
    if kind == "push_reply":
        result = method("push_parameters").result(success=draw(update_results))
        return "push_parameters", reply, seqid, result
    if kind == "push_error":
        error = thrift.ParameterError(code=draw(st.integers(1, 5)), message=draw(names))
        return "push_parameters", reply, seqid, method("push_parameters").result(error=error)
    if kind == "pull_reply":
        response = thrift.ParameterResponse(
            params=draw(st.lists(parameters, max_size=3)), timestamp=draw(st.integers(*I64))
        )
        return "pull_parameters", reply, seqid, method("pull_parameters").result(success=response)
    if kind == "info_reply":
        return "info", reply, seqid, method("info").result(success=draw(node_infos))
    error = TApplicationException(type=draw(st.integers(0, 10)), message=draw(names))
    return draw(method_names), MessageType.EXCEPTION, seqid, error


def encode(msg: tuple[str, int, int, Any], protocol: Protocol, framed: bool) -> bytes:
    parts, size = encode_message(*msg, protocol, framed=framed)
    data = b"".join(bytes(p) for p in parts)
    assert len(data) == size
    return data


def thriftpy2_encode(
    msg: tuple[str, int, int, Any], protocol: Protocol, pure: bool = False
) -> bytes:
    name, mtype, seqid, body = msg
    buf = TMemoryBuffer()
    if protocol is Protocol.COMPACT:
        proto = TCompactProtocol(buf)
    else:
        cls = PyTBinaryProtocol if pure else TBinaryProtocol
        proto = cls(buf, strict_read=True, strict_write=True)
    proto.write_message_begin(name, mtype, seqid)
    proto.write_struct(body)
    proto.write_message_end()
    return buf.getvalue()


def thriftpy2_decode(data: bytes, protocol: Protocol, cls: type) -> tuple[str, int, int, Any]:
    buf = TMemoryBuffer(data)
    if protocol is Protocol.COMPACT:
        proto = TCompactProtocol(buf)
    else:
        proto = TBinaryProtocol(buf, strict_read=True, strict_write=True)
    name, mtype, seqid = proto.read_message_begin()
    body = cls()
    proto.read_struct(body)
    proto.read_message_end()
    return name, mtype, seqid, body


max_frame_sizes = st.sampled_from([16, 64, 512, 4096, 70_000])
framings = st.sampled_from([None, True])  # sniff (a node), or frames only (a client)
cut_lists = st.lists(st.integers(0, 10_000), max_size=8)


# ---------------------------------------------------------------------------
# (a) arbitrary bytes


def _header(protocol: Protocol, name: bytes, mtype: int, seqid: int) -> bytes:
    if protocol is Protocol.BINARY:
        return struct.pack("!Ii", 0x80010000 | mtype, len(name)) + name + struct.pack("!i", seqid)
    return bytes([0x82, (mtype << 5) | 1, seqid & 0x7F, len(name) & 0x7F]) + name[:127]


@st.composite
def hostile_bytes(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes; often behind a valid message header so the body decoder sees them."""
    body = draw(st.binary(max_size=160))
    how = draw(st.sampled_from(["raw", "framed", "unframed"]))
    if how == "raw":
        return body
    protocol = draw(st.sampled_from(PROTOCOLS))
    name = draw(st.sampled_from([b"push_parameters", b"pull_parameters", b"info", b"x"]))
    message = _header(protocol, name, draw(st.integers(0, 7)), draw(st.integers(0, 127))) + body
    if how == "unframed":
        return message
    size = draw(st.one_of(st.just(len(message)), st.integers(-(2**31), 2**31 - 1)))
    return struct.pack("!i", size) + message


@FUZZ
@given(data=hostile_bytes(), cuts=cut_lists, max_frame_bytes=max_frame_sizes, framed=framings)
@example(data=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", cuts=[3], max_frame_bytes=4096, framed=None)
@example(
    data=b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", cuts=[], max_frame_bytes=16, framed=None
)
@example(data=b"\xff\xff\xff\xff", cuts=[], max_frame_bytes=16, framed=None)
@example(data=b"\x00\x00\x00\x00", cuts=[], max_frame_bytes=16, framed=True)
@example(data=b"\x80\x01", cuts=[1], max_frame_bytes=16, framed=None)
@example(data=b"\x82", cuts=[], max_frame_bytes=16, framed=None)
@example(data=b"\x00\x00\x00\x01\x00", cuts=[], max_frame_bytes=16, framed=None)
def test_arbitrary_bytes_parse_or_raise_remote_protocol_error(
    data: bytes, cuts: list[int], max_frame_bytes: int, framed: bool | None
) -> None:
    check_invariant(data, cuts, max_frame_bytes, framed)


# ---------------------------------------------------------------------------
# (b) mutations of valid messages

INTERESTING_I32 = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 10**9, 0x0F000000]
mutations = st.lists(
    st.one_of(
        st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
        st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=4)),
        st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 4)),
        st.tuples(st.just("set32"), st.integers(0, 10**6), st.sampled_from(INTERESTING_I32)),
        st.tuples(st.just("varint"), st.integers(0, 10**6), st.integers(1, 12)),
        st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    ),
    min_size=1,
    max_size=4,
)


def mutate(data: bytes, ops: list[tuple[str, int, Any]]) -> bytes:
    buf = bytearray(data)
    for op, where, arg in ops:
        pos = where % (len(buf) + 1)
        if op == "flip" and pos < len(buf):
            buf[pos] ^= arg
        elif op == "insert":
            buf[pos:pos] = arg
        elif op == "delete":
            del buf[pos : pos + arg]
        elif op == "set32":
            buf[pos : pos + 4] = struct.pack("!I", arg)
        elif op == "varint":  # an overlong varint: continuation bits set
            buf[pos:pos] = b"\xff" * arg + b"\x01"
        elif op == "truncate":
            del buf[pos:]
    return bytes(buf)


@FUZZ
@given(
    msgs=st.lists(messages(), min_size=1, max_size=3),
    protocol=st.sampled_from(PROTOCOLS),
    framed=st.booleans(),
    ops=mutations,
    cuts=cut_lists,
    max_frame_bytes=st.sampled_from([64, 4096, 1 << 20]),
)
def test_mutated_messages_parse_or_raise_remote_protocol_error(
    msgs: list, protocol: Protocol, framed: bool, ops: list, cuts: list[int], max_frame_bytes: int
) -> None:
    data = b"".join(encode(m, protocol, framed) for m in msgs)
    check_invariant(mutate(data, ops), cuts, max_frame_bytes, None)


@FUZZ
@given(
    msgs=st.lists(st.tuples(messages(), st.sampled_from(PROTOCOLS)), min_size=1, max_size=3),
    ops=mutations,
    cuts=cut_lists,
)
def test_mutated_mixed_protocol_frames(msgs: list, ops: list, cuts: list[int]) -> None:
    """Framed, each frame may use either protocol (the receiver tells each frame's)."""
    data = b"".join(encode(m, p, True) for m, p in msgs)
    check_invariant(mutate(data, ops), cuts, 1 << 20, True)


# ---------------------------------------------------------------------------
# (c) round trips


@ROUND_TRIP
@given(
    update=updates,
    seqid=seqids,
    name=st.sampled_from(["push_parameters", "update_parameters", "broadcast_update"]),
    cuts=cut_lists,
)
def test_parameter_update_round_trip(update: Any, seqid: int, name: str, cuts: list[int]) -> None:
    m = method(name)
    mtype = MessageType.ONEWAY if m.oneway else MessageType.CALL
    args = m.args(update=update)
    for protocol in PROTOCOLS:
        for framed in (True, False):
            data = encode((name, mtype, seqid, args), protocol, framed)
            for chunks in ([data], split(data, cuts)):
                receiver = Receiver(1 << 20)
                frames = [f for c in chunks for f in receiver.feed(c)]
                assert receiver.pending_bytes == 0
                assert len(frames) == 1
                frame = frames[0]
                assert (frame.protocol, frame.framed) == (protocol, framed)
                got_name, got_type, got_seqid, reader = decode_header(frame.payload, frame.protocol)
                assert (got_name, got_type, got_seqid) == (name, mtype, seqid)
                body = reader.read_body(m.args)
                assert plain(body) == plain(args)
                for p in body.update.params:
                    assert isinstance(p.data, memoryview) and p.data.readonly
            # A decoded message encodes to the very same bytes.
            assert encode((name, mtype, seqid, body), protocol, framed) == data


@ROUND_TRIP
@given(msg=messages().filter(lambda m: m[2] >= 0))
def test_byte_identical_to_thriftpy2(msg: tuple[str, int, int, Any]) -> None:
    """Our bytes are thriftpy2's (strict binary, compact), and thriftpy2 reads them back."""
    name, mtype, seqid, body = msg
    for protocol in PROTOCOLS:
        ours = encode(msg, protocol, framed=False)
        assert ours == thriftpy2_encode(msg, protocol)
        if protocol is Protocol.BINARY:
            assert ours == thriftpy2_encode(msg, protocol, pure=True)
        assert encode(msg, protocol, framed=True) == struct.pack("!i", len(ours)) + ours
        got_name, got_type, got_seqid, got = thriftpy2_decode(ours, protocol, type(body))
        assert (got_name, got_type, got_seqid) == (name, mtype, seqid)
        assert plain(got) == plain(body)
        # ...and we read thriftpy2's bytes to the same values.
        _, _, _, reader = decode_header(thriftpy2_encode(msg, protocol), protocol)
        assert plain(reader.read_body(type(body))) == plain(body)


@ROUND_TRIP
@given(msg=messages())
def test_negative_seqid_round_trip(msg: tuple[str, int, int, Any]) -> None:
    """Seqids are i32 on the wire in both protocols, negative ones included."""
    for protocol in PROTOCOLS:
        data = encode(msg, protocol, framed=False)
        name, mtype, seqid, reader = decode_header(data, protocol)
        assert (name, mtype, seqid) == msg[:3]
        assert plain(reader.read_body(type(msg[3]))) == plain(msg[3])


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=["binary", "compact"])
def test_a_method_name_longer_than_any_is_refused_once_its_length_is_read(
    protocol: Protocol,
) -> None:
    long = "x" * (MAX_METHOD_NAME_BYTES + 1)
    data = encode((long, MessageType.CALL, 1, method("ping").args()), protocol, framed=False)
    with pytest.raises(RemoteProtocolError, match=f"method name of {len(long)} bytes"):
        decode_header(data, protocol)
    # (a caller that wants any name says so)
    assert decode_header(data, protocol, name_limit=MAX_I32)[0] == long
    # On a stream, and in a frame not whole yet: refused from the name's length alone.
    start = data[: data.index(b"xx")]
    with pytest.raises(RemoteProtocolError, match="longer than any method's"):
        Receiver().feed(start)
    with pytest.raises(RemoteProtocolError, match="longer than any method's"):
        Receiver().feed(struct.pack("!i", len(data)) + start)


# ---------------------------------------------------------------------------
# Deterministic: giant claims are refused before anything is allocated


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bin_push(body: bytes, name: bytes = b"push_parameters") -> bytes:
    return _header(Protocol.BINARY, name, MessageType.CALL, 1) + body


def _compact_push(body: bytes, name: bytes = b"push_parameters") -> bytes:
    return bytes([0x82, 0x21, 1]) + _varint(len(name)) + name + body


# args.update (struct 1) -> params (list 1) of structs
_BIN_LIST = struct.pack("!bh", 12, 1) + struct.pack("!bh", 15, 1)
_CMP_LIST = bytes([0x1C, 0x19])

GIANT_CLAIMS = {
    "binary list of 10**9 parameters": _bin_push(_BIN_LIST + struct.pack("!bi", 12, 10**9)),
    "binary list of 2**31-1 parameters": _bin_push(_BIN_LIST + struct.pack("!bi", 12, 2**31 - 1)),
    "binary negative list size": _bin_push(_BIN_LIST + struct.pack("!bi", 12, -1)),
    "binary name of 2 GiB": struct.pack("!Ii", 0x80010001, 2**31 - 1) + b"push",
    "binary string of 2 GiB in a parameter": _bin_push(
        _BIN_LIST + struct.pack("!bi", 12, 1) + struct.pack("!bhi", 11, 1, 2**31 - 1) + b"abc"
    ),
    "binary map of 10**9 (skipped field)": _bin_push(
        struct.pack("!bh", 13, 99) + struct.pack("!bbi", 11, 8, 10**9)
    ),
    "binary set of 10**9 (skipped field)": _bin_push(
        struct.pack("!bh", 14, 99) + struct.pack("!bi", 10, 10**9)
    ),
    "binary nested lists, 10000 deep": _bin_push(
        struct.pack("!bh", 15, 99) + struct.pack("!bi", 15, 1) * 10_000
    ),
    "binary nested structs, 10000 deep": _bin_push(struct.pack("!bh", 12, 99) * 10_000),
    "binary invalid type byte": _bin_push(struct.pack("!bh", 0x7F, 1) + b"\x00" * 8),
    "compact list of 10**9 parameters": _compact_push(_CMP_LIST + b"\xfc" + _varint(10**9)),
    "compact list of 2**32 parameters": _compact_push(_CMP_LIST + b"\xfc" + _varint(2**32)),
    "compact list size varint of 5 bytes": _compact_push(_CMP_LIST + b"\xfc" + b"\xff" * 5),
    "compact string of 2 GiB": _compact_push(_CMP_LIST + b"\x1c\x18" + _varint(2**31 - 1)),
    # field 99 in the long form: the type, then the id as a zigzag varint (198)
    "compact map of 10**9 (skipped field)": _compact_push(
        b"\x0b\xc6\x01" + _varint(10**9) + b"\x88"
    ),
    "compact nested lists, 10000 deep": _compact_push(b"\x09\xc6\x01" + b"\x19" * 10_000),
    "compact nested structs, 10000 deep": _compact_push(b"\x1c" * 10_000),
    "compact invalid type nibble": _compact_push(b"\x1d" + b"\x00" * 8),
}


@pytest.mark.parametrize("framed", [True, False], ids=["framed", "unframed"])
@pytest.mark.parametrize("payload", GIANT_CLAIMS.values(), ids=GIANT_CLAIMS.keys())
def test_giant_claims_fail_fast_without_allocating(payload: bytes, framed: bool) -> None:
    data = struct.pack("!i", len(payload)) + payload if framed else payload
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        receiver = Receiver()  # the default limit: 256 MiB
        start = time.perf_counter()
        with pytest.raises(RemoteProtocolError):
            for frame in receiver.feed(data):
                name, _, _, reader = decode_header(frame.payload, frame.protocol)
                reader.read_body(method(name).args)
            receiver.check_eof()
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0
    # The receiver's 256 KiB scratch buffer and a copy of the message, no more.
    assert peak < 2 * 1024 * 1024, f"peak {peak} bytes"


# ---------------------------------------------------------------------------
# Deterministic: known bugs (see each reason); strict, so a fix flips them


def _compact_push_timestamp(varint: bytes) -> bytes:
    # update: params = [Parameter(name="p", data=b"abcd")], timestamp = <varint>
    body = (
        b"\x1c\x19\x1c" + b"\x18\x01p" + b"\x18\x04abcd" + b"\x00" + b"\x16" + varint + b"\x00\x00"
    )
    return _compact_push(body)


@pytest.mark.parametrize(
    "varint",
    [b"\xfe" + b"\xff" * 8 + b"\x7f", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x02"],
    ids=["i64-69-bits", "i64-2**64"],
)
def test_compact_decodes_only_in_range_integers(varint: bytes) -> None:
    _, _, _, reader = decode_header(_compact_push_timestamp(varint), Protocol.COMPACT)
    try:
        body = reader.read_body(method("push_parameters").args)
    except RemoteProtocolError:
        return  # refused: fine
    assert I64[0] <= body.update.timestamp <= I64[1], body.update.timestamp


def test_compact_i32_in_range() -> None:
    # Parameter.version (i32, field 3) as a 5-byte varint of 2**34 - 2 -> 2**33 - 1
    body = (
        b"\x1c\x19\x1c\x18\x01p\x18\x04abcd\x15" + b"\xfe\xff\xff\xff\x7f" + b"\x00\x16\x02\x00\x00"
    )
    _, _, _, reader = decode_header(_compact_push(body), Protocol.COMPACT)
    try:
        args = reader.read_body(method("push_parameters").args)
    except RemoteProtocolError:
        return
    version = args.update.params[0].version
    assert I32[0] <= version <= I32[1], version
    # whatever we decode we can encode again
    encode_message("push_parameters", 1, 1, args, Protocol.COMPACT)


@FUZZ
@example(name="p", nbytes=4, dtype=",", shape=None)
@example(name="p", nbytes=4, dtype="a", shape=None)  # deprecated alias: warns
@example(name="p", nbytes=4, dtype=None, shape=[-2, -2])
@given(
    name=st.text(min_size=1, max_size=8),
    nbytes=st.integers(0, 64),
    dtype=st.one_of(st.none(), st.text(max_size=6), st.sampled_from(["<f4", "|b1", "<c8"])),
    shape=st.one_of(st.none(), st.lists(st.integers(*I64), max_size=4)),
)
def test_check_layout_raises_only_request_error(
    name: str, nbytes: int, dtype: str | None, shape: list[int] | None
) -> None:
    """The store's validation of hostile layouts answers, or refuses with RequestError."""
    with contextlib.suppress(RequestError):
        check_layout(name, nbytes, dtype, shape)


@pytest.mark.parametrize("dtype", [",", ",d", "i4,,", "O", "S4", "i4,i4", "2i4", "(2,)f4", ""])
def test_check_layout_hostile_dtype_string(dtype: str) -> None:
    """numpy raises SyntaxError on some strings: still a RequestError."""
    with pytest.raises(RequestError):
        check_layout("p", 4, dtype, None)


@pytest.mark.parametrize("dtype", ["<f4", None])
def test_check_layout_shape_with_a_huge_product(dtype: str | None) -> None:
    with pytest.raises(RequestError):
        check_layout("p", 4, dtype, [2**62] * 300)


def test_unframed_receive_is_not_quadratic() -> None:
    m = method("push_parameters")
    p = thrift.Parameter(name="p", data=b"", shape=[1] * 100_000)
    args = m.args(update=thrift.ParameterUpdate(params=[p], timestamp=1))
    framed = encode(("push_parameters", 1, 1, args), Protocol.BINARY, True)
    unframed = encode(("push_parameters", 1, 1, args), Protocol.BINARY, False)

    def receive_in(data: bytes, chunk: int) -> float:
        receiver = Receiver()
        start = time.perf_counter()
        frames = [f for i in range(0, len(data), chunk) for f in receiver.feed(data[i : i + chunk])]
        assert len(frames) == 1
        return time.perf_counter() - start

    baseline = receive_in(framed, 8192)
    # one decode of the whole message, as the node does after receiving it
    start = time.perf_counter()
    _, _, _, reader = decode_header(framed[4:], Protocol.BINARY)
    reader.read_body(m.args)
    one_pass = time.perf_counter() - start
    elapsed = receive_in(unframed, 8192)
    assert elapsed < 5 * (baseline + one_pass) + 0.05, (elapsed, baseline, one_pass)


def test_local_protocol_error_for_out_of_range_values() -> None:
    """Values a protocol cannot carry are refused on encode, in both protocols."""
    for protocol in PROTOCOLS:
        for bad in (2**63, -(2**63) - 1):
            update = thrift.ParameterUpdate(params=[], timestamp=bad)
            with pytest.raises(LocalProtocolError):
                encode_message(
                    "push_parameters", 1, 1, method("push_parameters").args(update=update), protocol
                )
