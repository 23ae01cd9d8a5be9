"""A small read answered whole in C (``server/_cread.pyx``) is the Python path's reply, byte
for byte; anything it does not answer goes to the Python path, and nothing it is given
makes it fail."""

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
from aioparamsync.server import fastread
from aioparamsync.wire import SEED_IDL_PATH, MessageType, encode_message, method, thrift

pytestmark = pytest.mark.skipif(fastread._cread is None, reason="the compiled path is not built")

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
        fast = node.service.fast_read(_payload(name, request, seqid))
        held = all(n in NAMES and n != "big" for n in names)
        if fast is None:
            # (a name not held, or one under min_version, or a value sent by reference)
            version_ok = min_version is None or min_version <= 1
            assert not held or not version_ok, names
            continue
        reply, pull = fast
        assert pull == (name == "pull_parameters")
        assert reply == _python_reply(node, name, request, seqid), (names, min_version)
        answered += 1
    assert answered > 50  # (the common case is answered here)


async def test_a_read_asking_more_than_names_and_min_version_goes_to_the_python_path(
    node: Node,
) -> None:
    await _filled(node)
    plain = thrift.ParameterRequest(param_names=["w"])
    assert node.service.fast_read(_payload("get_parameters", plain)) is not None
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
        assert node.service.fast_read(_payload("get_parameters", request)) is None, extra
    # nor a partition's key, a write, a oneway call or a reply
    key = thrift.ParameterRequest(param_names=["w\x00p0"])
    assert node.service.fast_read(_payload("get_parameters", key)) is None
    update = thrift.ParameterUpdate(params=[thrift.Parameter(name="w", data=b"x")], timestamp=1)
    m = method("update_parameters")
    parts, _ = encode_message(m.name, MessageType.CALL, 1, m.args(update=update))
    assert node.service.fast_read(memoryview(b"".join(map(bytes, parts))[4:])) is None
    for mtype in (MessageType.ONEWAY, MessageType.REPLY):
        parts, _ = encode_message(
            "get_parameters", mtype, 1, method("get_parameters").args(request=plain)
        )
        assert node.service.fast_read(memoryview(b"".join(map(bytes, parts))[4:])) is None


async def test_a_node_starting_or_in_a_cluster_leaves_reads_to_the_python_path(
    node: Node,
) -> None:
    await _filled(node)
    payload = _payload("get_parameters", thrift.ParameterRequest(param_names=["w"]))
    node.service.starting = "joining its cluster"
    try:
        assert node.service.fast_read(payload) is None
    finally:
        node.service.starting = None
    assert node.service.fast_read(payload) is not None


@settings(max_examples=300, deadline=None)
@given(
    cut=st.integers(0, 200),
    flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)), max_size=4),
)
def test_no_bytes_make_it_fail_and_what_it_answers_is_what_python_answers(cut, flips) -> None:
    async def main() -> None:
        async with Node("127.0.0.1", 0) as node:
            await _filled(node)
            request = thrift.ParameterRequest(param_names=["w", "plain", "b"], min_version=1)
            data = bytearray(_payload("pull_parameters", request, 11))
            for at, value in flips:
                if at < len(data):
                    data[at] = value
            data = data[: len(data) - cut] if cut < len(data) else data[:0]
            fast = node.service.fast_read(memoryview(bytes(data)))
            if fast is None:
                return
            # Whatever it answered, the Python path answers the same bytes with.
            from aioparamsync.wire import decode_header
            from aioparamsync.wire.protocol import Protocol

            name, mtype, seqid, reader = decode_header(memoryview(bytes(data)), Protocol.BINARY)
            args = reader.read_body(method(name).args)
            assert mtype == MessageType.CALL
            assert fast[0] == _python_reply(node, name, args.request, seqid)

    asyncio.run(main())


async def test_a_founding_client_reads_through_it_and_each_read_is_observed(node: Node) -> None:
    """thriftpy2's stock aio client of the founding IDL: its gets are answered here."""
    seen: list[tuple[str, bool]] = []
    await _filled(node)
    node.server.call_observer = lambda name, seconds, exc: seen.append((name, exc is None))
    founding = thriftpy2.load(str(SEED_IDL_PATH), module_name="founding_fast_read_thrift")
    fast_read, answered = node.service.fast_read, []

    def counted(payload: Any) -> Any:
        answered.append(fast_read(payload))
        return answered[-1]

    node.server.handler.fast_read = counted  # (the connections take it as they open)
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
    finally:
        client.close()
    assert seen == [("get_parameters", True)] * 3
    assert len(answered) == 3 and None not in answered
