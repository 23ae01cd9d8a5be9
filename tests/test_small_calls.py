"""Small calls answered in C (``server/_csmall.pyx``): a small read's reply is the Python
path's, byte for byte, and a founding update's entries and reply are too; anything else
goes to the Python path, and nothing it is given makes it fail."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest
import thriftpy2
from hypothesis import given, settings
from hypothesis import strategies as st
from thriftpy2.contrib.aio.protocol import TAsyncBinaryProtocolFactory
from thriftpy2.contrib.aio.transport import TAsyncFramedTransportFactory
from thriftpy2.rpc import make_aio_client

from aioparamsync import Node, ParameterClient, sgd
from aioparamsync.errors import RequestError
from aioparamsync.server import smallcalls
from aioparamsync.wire import (
    SEED_IDL_PATH,
    MessageType,
    decode_header,
    encode_message,
    method,
    thrift,
)
from aioparamsync.wire.protocol import Protocol

pytestmark = pytest.mark.skipif(smallcalls._csmall is None, reason="the compiled path is not built")

NAMES = ["w", "b", "plain", "ruled", "émbedding", "empty", "big"]


async def _filled(node: Node) -> None:
    async with ParameterClient(node.address, route=False, shared_memory=0) as c:
        await c.update_arrays({"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
        await c.update_arrays({"w": np.ones((3, 4), np.float32)})  # (version 2)
        await c.update_arrays({"b": np.zeros(5, np.float64), "émbedding": np.ones(3, np.int8)})
        await c.update_parameters([thrift.Parameter(name="plain", data=b"founding bytes")])
        await c.update_parameters([thrift.Parameter(name="empty", data=b"")])
        await c.update_arrays({"ruled": np.ones(8, np.float32)}, rules=sgd(0.1, momentum=0.9))
        await c.update_arrays({"big": np.ones(8192, np.float32)})  # (32 KiB: by reference)


def _payload(name: str, request: Any, seqid: int = 7) -> memoryview:
    m = method(name)
    parts, _ = encode_message(name, MessageType.CALL, seqid, m.args(request=request))
    return memoryview(b"".join(bytes(p) for p in parts)[4:])  # (the frame's payload)


def _python_reply(node: Node, name: str, request: Any, seqid: int = 7) -> bytes:
    """What the Python path writes for the same read."""
    m = method(name)
    body = node.service.handle(m, m.args(request=request))
    parts, _ = encode_message(name, MessageType.REPLY, seqid, body)
    return b"".join(bytes(p) for p in parts)


@pytest.mark.parametrize("name", ["get_parameters", "pull_parameters"])
async def test_a_small_read_is_answered_as_the_python_path_answers_it(node: Node, name) -> None:
    await _filled(node)
    answered = 0
    rng = random.Random(3)
    for _ in range(300):
        names = rng.choices([*NAMES, "missing"], k=rng.randint(0, 6))
        min_version = rng.choice([None, 0, 1, 2, 3, -5])
        request = thrift.ParameterRequest(param_names=names, min_version=min_version)
        seqid = rng.randint(-(2**31), 2**31 - 1)
        fast = node.service.fast_calls(_payload(name, request, seqid))
        held = all(n in NAMES and n != "big" for n in names)
        if fast is None:
            # (a name not held, or one under min_version, or a value sent by reference)
            version_ok = min_version is None or min_version <= 1
            assert not held or not version_ok, names
            continue
        assert fast == (_python_reply(node, name, request, seqid), name), (names, min_version)
        answered += 1
    assert answered > 50  # (the common case is answered here)


async def test_a_read_asking_more_than_names_and_min_version_goes_to_the_python_path(
    node: Node,
) -> None:
    await _filled(node)
    plain = thrift.ParameterRequest(param_names=["w"])
    assert node.service.fast_calls(_payload("get_parameters", plain)) is not None
    for extra in (
        {"epoch": 1},
        {"wait_ms": 10},
        {"known_versions": {"w": 1}},
        {"all_names": True},
        {"encoding": "fp16"},
        {"max_inline_bytes": 10},
        {"without_rules": True},
        {"as_stored": False},
        {"packed": True},
    ):
        request = thrift.ParameterRequest(param_names=["w"], **extra)
        assert node.service.fast_calls(_payload("get_parameters", request)) is None, extra
    # nor a partition's key, a write, a oneway call or a reply
    key = thrift.ParameterRequest(param_names=["w\x00p0"])
    assert node.service.fast_calls(_payload("get_parameters", key)) is None
    update = thrift.ParameterUpdate(params=[thrift.Parameter(name="w", data=b"x")], timestamp=1)
    m = method("update_parameters")
    parts, _ = encode_message(m.name, MessageType.CALL, 1, m.args(update=update))
    assert node.service.fast_calls(memoryview(b"".join(map(bytes, parts))[4:])) is None
    for mtype in (MessageType.ONEWAY, MessageType.REPLY):
        parts, _ = encode_message(
            "get_parameters", mtype, 1, method("get_parameters").args(request=plain)
        )
        assert node.service.fast_calls(memoryview(b"".join(map(bytes, parts))[4:])) is None


async def test_a_node_starting_or_in_a_cluster_leaves_reads_to_the_python_path(
    node: Node,
) -> None:
    await _filled(node)
    payload = _payload("get_parameters", thrift.ParameterRequest(param_names=["w"]))
    node.service.starting = "joining its cluster"
    try:
        assert node.service.fast_calls(payload) is None
    finally:
        node.service.starting = None
    assert node.service.fast_calls(payload) is not None


@settings(max_examples=400, deadline=None)
@given(
    update=st.booleans(),
    cut=st.integers(0, 200),
    flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
)
def test_no_bytes_make_it_fail_and_what_it_answers_is_what_python_answers(
    update, cut, flips
) -> None:
    async def main() -> None:
        async with Node("127.0.0.1", 0) as node, Node("127.0.0.1", 0) as twin:
            for n in (node, twin):
                await _filled(n)
                await _python_update(n, [thrift.Parameter(name="b0", data=b"")], 2**41, 1)
            if update:
                params = [
                    thrift.Parameter(name="plain", data=b"0123456789", version=4),
                    thrift.Parameter(name="new", data=b"abc"),
                ]
                data = bytearray(_update_payload(params, 2**41 + 5, 11))
            else:
                request = thrift.ParameterRequest(param_names=["w", "plain", "b"], min_version=1)
                data = bytearray(_payload("pull_parameters", request, 11))
            for at, value in flips:
                if at < len(data):
                    data[at] = value
            data = data[: len(data) - cut] if cut < len(data) else data[:0]
            fast = node.service.fast_calls(memoryview(bytes(data)))
            if fast is None:
                assert _state(node) == _state(twin)  # (nothing applied)
                return
            # Whatever it answered, the Python path answers the same bytes with.
            name, mtype, seqid, reader = decode_header(memoryview(bytes(data)), Protocol.BINARY)
            args = reader.read_body(method(name).args)
            assert mtype == MessageType.CALL
            if name == "update_parameters":
                u = args.update
                assert fast[0] == await _python_update(twin, u.params, u.timestamp, seqid)
            else:
                assert fast[0] == _python_reply(twin, name, args.request, seqid).replace(
                    twin.service.store.table.origin.encode(),
                    node.service.store.table.origin.encode(),
                )
            assert _state(node) == _state(twin)

    asyncio.run(main())


async def test_a_founding_client_reads_through_it_and_each_read_is_observed(node: Node) -> None:
    """thriftpy2's stock aio client of the founding IDL: its gets are answered here."""
    seen: list[tuple[str, bool]] = []
    await _filled(node)
    node.server.call_observer = lambda name, seconds, exc: seen.append((name, exc is None))
    founding = thriftpy2.load(str(SEED_IDL_PATH), module_name="founding_fast_read_thrift")
    fast_calls, answered = node.service.fast_calls, []

    def counted(payload: Any) -> Any:
        answered.append(fast_calls(payload))
        return answered[-1]

    node.server.handler.fast_calls = counted  # (the connections take it as they open)
    client = await make_aio_client(
        founding.ParameterSyncService,
        "127.0.0.1",
        node.address[1],
        trans_factory=TAsyncFramedTransportFactory(),
        proto_factory=TAsyncBinaryProtocolFactory(),
        timeout=30_000,
    )
    try:
        for _ in range(3):
            request = founding.ParameterRequest(param_names=["plain", "w"])
            got = await client.get_parameters(request)
            assert [p.name for p in got.params] == ["plain", "w"]
            assert got.params[0].data == b"founding bytes"
            assert np.frombuffer(got.params[1].data, np.float32).tolist() == [1.0] * 12
            assert got.params[1].version == 2
        update = founding.ParameterUpdate(
            params=[founding.Parameter(name="plain", data=b"changed", version=0)], timestamp=9
        )
        await client.update_parameters(update)
        got = await client.get_parameters(founding.ParameterRequest(param_names=["plain"]))
        assert (got.params[0].data, got.params[0].version) == (b"changed", 2)
    finally:
        client.close()
    assert seen == [("get_parameters", True)] * 3 + [
        ("update_parameters", True),
        ("get_parameters", True),
    ]
    assert len(answered) == 5 and None not in answered


# ---------------------------------------------------------------------------
# A founding client's update_parameters


def _update_payload(params: list[Any], timestamp: int, seqid: int = 9, **extra: Any) -> memoryview:
    m = method("update_parameters")
    update = thrift.ParameterUpdate(params=params, timestamp=timestamp, **extra)
    parts, _ = encode_message(m.name, MessageType.CALL, seqid, m.args(update=update))
    return memoryview(b"".join(bytes(p) for p in parts)[4:])


async def _python_update(node: Node, params: list[Any], timestamp: int, seqid: int) -> bytes:
    """The Python path's reply to the same update (applied to ``node``), or the error."""
    m = method("update_parameters")
    update = thrift.ParameterUpdate(params=params, timestamp=timestamp)
    outcome = node.service.handle(m, m.args(update=update))
    if isinstance(outcome, asyncio.Future):
        outcome = await outcome
    parts, _ = encode_message(m.name, MessageType.REPLY, seqid, outcome)
    return b"".join(bytes(p) for p in parts)


def _state(node: Node) -> tuple[Any, ...]:
    table = node.service.store.table
    entries = sorted(
        (n, bytes(e.data), e.version, e.dtype, e.shape, e.rule, e.origin == table.origin, _kept(e))
        for n, e in table.by_name.items()
    )
    return table.timestamp, table.nbytes, entries


def _kept(entry: Any) -> bool:
    """Whether the buffer an entry keeps alive is no more than its share (store.buffers.kept:
    a third more, at most, for its message's own fields)."""
    data = entry.data
    return data.readonly and memoryview(data.obj).nbytes * 3 <= data.nbytes * 4


UPDATE_NAMES = ["w", "b", "plain", "ruled", "new", "émbedding", "__metadata__", "", "x" * 1025]


async def test_a_founding_update_is_applied_as_the_python_path_applies_it() -> None:
    async with Node("127.0.0.1", 0) as fast, Node("127.0.0.1", 0) as python:
        for node in (fast, python):
            await _filled(node)
            # (the same timestamp at both: a client's are its clock's)
            await _python_update(node, [thrift.Parameter(name="b0", data=b"")], 2**41, 1)
        rng = random.Random(5)
        applied = refused = 0
        for step in range(400):
            params = [
                thrift.Parameter(
                    name=rng.choice(UPDATE_NAMES),
                    data=bytes(rng.choice([0, 1, 4, 20, 48, 4096])),
                    version=rng.choice([None, None, -3, 1, 5, 2**31 - 1]),
                )
                for _ in range(rng.choice([0, 1, 1, 2, 3]))
            ]
            timestamp = rng.randint(2**41 - 300, 2**41 + 300)
            seqid = rng.randint(-(2**31), 2**31 - 1)
            answered = fast.service.fast_calls(_update_payload(params, timestamp, seqid))
            try:
                expected = await _python_update(python, params, timestamp, seqid)
            except RequestError:
                assert answered is None, params  # (nothing applied: the Python path says why)
                refused += 1
            else:
                # (every update here is one for C: a founding client's, small)
                assert answered == (expected, "update_parameters"), params
                applied += 1
            assert _state(fast) == _state(python), (step, params)
        assert applied > 80 and refused > 80


async def test_an_update_asking_more_goes_to_the_python_path(node: Node) -> None:
    await _filled(node)
    p = [thrift.Parameter(name="plain", data=b"0123456789abcd")]
    before = _state(node)
    for extra in ({"acks": "all"}, {"epoch": 3}, {"call": "c1"}, {"from_peer": "n"}):
        assert node.service.fast_calls(_update_payload(p, 1, **extra)) is None, extra
    for more in ({"dtype": "uint8"}, {"shape": [14]}, {"replace": True}, {"rule": sgd(0.1)}):
        q = [thrift.Parameter(name="plain", data=b"0123456789abcd", **more)]
        assert node.service.fast_calls(_update_payload(q, 1)) is None, more
    # a key with NUL, data that does not fit what is stored, a name twice
    for q in (
        [thrift.Parameter(name="w\x00p0", data=b"x")],
        [thrift.Parameter(name="w", data=b"x")],
        [thrift.Parameter(name="new", data=b"x"), thrift.Parameter(name="new", data=b"y")],
    ):
        assert node.service.fast_calls(_update_payload(q, 1)) is None, q
    assert _state(node) == before
    assert node.service.fast_calls(_update_payload(p, 1)) is not None


async def test_an_update_waits_its_turn_behind_the_writers_queue(node: Node) -> None:
    await _filled(node)
    store = node.service.store
    queued = store.submit([thrift.Parameter(name="plain", data=b"first")], 1)
    p = [thrift.Parameter(name="plain", data=b"second")]
    assert node.service.fast_calls(_update_payload(p, 2)) is None
    await queued
    assert node.service.fast_calls(_update_payload(p, 2)) is not None
    assert bytes(store.table.entry("plain").data) == b"second"
    node.service.following = "following n9"  # (a follower takes no writes)
    assert node.service.fast_calls(_update_payload(p, 3)) is None
    read = _payload("get_parameters", thrift.ParameterRequest(param_names=["plain"]))
    assert node.service.fast_calls(read) is not None


async def test_a_founding_update_wakes_the_reads_and_watches_waiting_for_it(node: Node) -> None:
    """As a batch of the writer does, an update applied in C is fed to the store's
    subscribers: a long poll for its version is answered, a watch sees it."""
    await _filled(node)
    async with ParameterClient(node.address, route=False, shared_memory=0) as client:
        poll = asyncio.ensure_future(client.get_parameters(["plain"], 2, wait=30.0))
        changes = client.watch(["plain"], wait=30.0)
        assert await anext(changes) == {"plain": 1}
        seen = asyncio.ensure_future(anext(changes))
        await asyncio.sleep(0.05)
        assert not poll.done() and not seen.done()
        p = [thrift.Parameter(name="plain", data=b"the next bytes")]
        assert node.service.fast_calls(_update_payload(p, 3)) is not None
        async with asyncio.timeout(10):
            got = await poll
            assert await seen == {"plain": 2}
        assert (bytes(got.params[0].data), got.params[0].version) == (b"the next bytes", 2)
        await changes.aclose()
