"""Every timeout the client takes is None or a finite number of seconds above 0.

Each entry point is given each bad value against a real node on 127.0.0.1: it
raises a ValueError naming the argument, before anything is sent, so the
node's state and its request counter stay as they were.
"""

from __future__ import annotations

import asyncio
import decimal
import fractions
import math
import re

import numpy as np
import pytest
import trustme

from aioparamsync import Node, ParameterClient, sgd, thrift
from aioparamsync.client.addresses import check_seconds
from aioparamsync.errors import ClientClosedError
from aioparamsync.tls import client_context

pytestmark = pytest.mark.timeout(60)

# Not a deadline: 0 (every call would fail unsent), negatives, NaN, infinity
# (None says "no deadline"), bools (True is 1 to Python), and what is no number.
BAD = [
    0, 0.0, -0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "5", b"5", [1],
    decimal.Decimal("5"), 1j,
]  # fmt: skip
# Good ones come back as given.
GOOD = [0.25, 1, 30.0, np.float32(2.5), np.int64(3), fractions.Fraction(1, 2), 1e-6, 1e9]


@pytest.mark.parametrize("value", BAD, ids=repr)
def test_the_validator_refuses_what_is_no_deadline(value) -> None:
    with pytest.raises(ValueError, match=r"^timeout must be a finite number of seconds above 0"):
        check_seconds(value, "timeout")


@pytest.mark.parametrize("value", [None, *GOOD], ids=repr)
def test_the_validator_passes_deadlines_as_they_are(value) -> None:
    assert check_seconds(value, "timeout") is value


def test_a_wait_may_be_zero_but_nothing_worse() -> None:
    assert check_seconds(0, "wait", zero=True) == 0
    assert check_seconds(0.0, "wait", zero=True) == 0
    zeros = [v for v in BAD if type(v) in (int, float) and v == 0]
    assert len(zeros) == 3
    for value in [v for v in BAD if not any(v is z for z in zeros)]:
        with pytest.raises(ValueError, match=r"^wait must be a finite number of seconds 0 or more"):
            check_seconds(value, "wait", zero=True)


@pytest.mark.parametrize("value", BAD, ids=repr)
@pytest.mark.parametrize("argument", ["timeout", "connect_timeout"])
def test_the_constructor_refuses_a_bad_timeout(argument, value) -> None:
    with pytest.raises(ValueError, match=rf"^{argument} must be .* not {re.escape(repr(value))}$"):
        ParameterClient("127.0.0.1:9090", **{argument: value})


def test_the_constructor_takes_none_and_numbers() -> None:
    for value in [None, *GOOD]:
        client = ParameterClient("127.0.0.1:9090", timeout=value, connect_timeout=value)
        assert client.timeout is value and client.connect_timeout is value


# -- every call, against a node ----------------------------------------------------------------


def _calls(client: ParameterClient):
    """(name, make(timeout) -> coroutine) of every call that takes a timeout."""
    update = thrift.ParameterUpdate(
        params=[thrift.Parameter(name="w", data=np.ones(3).tobytes(), dtype="<f8", shape=[3])],
        timestamp=7,
    )
    grad = {"w": np.ones(3)}
    return [
        ("call", lambda t: client.call("push_parameters", timeout=t, update=update)),
        ("call, void", lambda t: client.call("update_parameters", timeout=t, update=update)),
        ("ping", lambda t: client.ping(timeout=t)),
        ("info", lambda t: client.info(timeout=t)),
        ("get_parameters", lambda t: client.get_parameters(["w"], timeout=t)),
        ("long poll", lambda t: client.get_parameters(["w"], 1, wait=1, timeout=t)),
        ("get_arrays", lambda t: client.get_arrays(["w"], timeout=t)),
        ("update_parameters", lambda t: client.update_parameters({"w": np.ones(3)}, timeout=t)),
        ("update_arrays", lambda t: client.update_arrays({"w": np.ones(3)}, timeout=t)),
        ("broadcast_update", lambda t: client.broadcast_update({"w": np.ones(3)}, timeout=t)),
        ("push_gradients", lambda t: client.push_gradients(grad, timeout=t)),
        ("push, topk", lambda t: client.push_gradients(grad, encoding="topk", timeout=t)),
        ("barrier", lambda t: client.barrier("g", "rank0", 1, 1, timeout=t)),
    ]  # fmt: skip


CALLS = [name for name, _ in _calls(ParameterClient("127.0.0.1:9090"))]


async def _state(node: Node) -> tuple:
    entry = node.table.entry("w")
    assert entry is not None
    return (entry.version, bytes(entry.data), node.server.counters["requests"])


@pytest.mark.parametrize("call", CALLS)
async def test_a_call_refuses_a_bad_timeout_before_sending_anything(node: Node, call) -> None:
    async with ParameterClient(node.address, timeout=30) as client:
        await client.update_arrays({"w": np.zeros(3)}, rules=sgd(0.5))
        make = dict(_calls(client))[call]
        before = await _state(node)
        for value in BAD:
            with pytest.raises(ValueError, match=r"^timeout must be a finite number") as info:
                await make(value)
            assert repr(value) in str(info.value)
            assert await _state(node) == before, f"timeout={value!r} changed the node"
        # ... and the same call with a good timeout, or none, goes through.
        for value in (None, 20, 15.5):
            await asyncio.wait_for(make(value), 25)


async def test_a_compressed_push_refused_for_its_timeout_keeps_its_error_feedback(
    node: Node,
) -> None:
    """The residuals are as if the refused push never happened (nothing was sent)."""
    grads = [np.array([3.0, -1.0, 0.5, 2.0]), np.array([0.25, 4.0, -2.0, 1.0])]
    stored = {}
    for name, refuse_first in (("plain", False), ("refused", True)):
        async with ParameterClient(node.address, timeout=30) as client:
            await client.update_arrays({name: np.zeros(4)}, rules=sgd(1.0))
            for grad in grads:
                if refuse_first:
                    with pytest.raises(ValueError, match="timeout"):
                        await client.push_gradients(
                            {name: grad}, encoding="topk", ratio=0.25, timeout=-1
                        )
                await client.push_gradients({name: grad}, encoding="topk", ratio=0.25)
            stored[name] = (await client.get_arrays([name]))[name]
    np.testing.assert_array_equal(stored["refused"], stored["plain"])


async def test_a_long_polls_wait_is_checked_like_a_timeout(node: Node, client) -> None:
    await client.update_arrays({"w": np.zeros(3)})
    requests = node.server.counters["requests"]
    for value in [-1, -0.001, math.nan, math.inf, True, False, "1", [1]]:
        with pytest.raises(ValueError, match=r"^wait must be a finite number of seconds 0 or more"):
            await client.get_parameters(["w"], wait=value)
    assert node.server.counters["requests"] == requests
    # 0 answers at once: what is there, or TIMEOUT naming what is not.
    assert list(await client.get_arrays(["w"], min_version=1, wait=0)) == ["w"]
    # A wait longer than the wire's i32 of milliseconds is the node's longest.
    poll = asyncio.ensure_future(client.get_arrays(["w"], min_version=2, wait=1e12, timeout=30))
    await client.update_arrays({"w": np.ones(3)})
    assert (await asyncio.wait_for(poll, 25))["w"].tolist() == [1.0, 1.0, 1.0]


async def test_a_connect_timeout_of_none_connects(node: Node) -> None:
    async with ParameterClient(node.address, connect_timeout=None, timeout=None) as client:
        assert await client.ping() == node.node_id


async def test_closing_a_client_while_it_connects_ends_the_connect_and_its_socket(
    tmp_path,
) -> None:
    """A client closed while a connection is still being made (here a TLS handshake the
    other end never answers) stops making it: the socket is closed then, not once the
    connect times out, and the call waiting for it fails as closed."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)  # (held open: it never answers the handshake)
        await accepted.put(reader)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = ParameterClient(
            f"127.0.0.1:{port}",
            ssl=client_context(str(tmp_path / "ca.pem")),
            connect_timeout=60,
            timeout=60,
        )
        call = asyncio.ensure_future(client.ping())
        reader = await asyncio.wait_for(accepted.get(), 10)
        await asyncio.sleep(0.05)  # (the handshake is under way)
        await client.close()
        with pytest.raises(ClientClosedError):
            await asyncio.wait_for(call, 10)
        while await asyncio.wait_for(reader.read(65536), 10):  # EOF: the client closed it
            pass
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
