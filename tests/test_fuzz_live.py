"""Fuzzing a live node over real sockets, with hypothesis.

The invariant: whatever bytes a connection sends, the node answers, replies
with a protocol error, or closes that connection, within a bounded time; it
never raises anything into its event loop, never stops serving the others,
never lets a message that is not a valid update change its store, and its
memory stays bounded.

The node runs in a thread of its own (its own event loop), so that each
hypothesis example can drive plain blocking sockets against it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from test_fuzz import PROTOCOLS, _varint, encode, hostile_bytes, messages, mutate, mutations

from aioparamsync import Node, ParameterClient
from aioparamsync.wire import MessageType, Protocol, Receiver, decode_header, method
from aioparamsync.wire.idl import MAX_METHOD_NAME_BYTES

# How long one hostile connection may take to be answered or closed (seconds).
ANSWER_WITHIN = 5.0
# How much the node's process may grow over the whole fuzz run (bytes).
MEMORY_BOUND = 128 * 1024 * 1024
SENTINEL = "sentinel/never-in-a-fuzzed-message"
# The node's --max-frame-bytes.
LIMIT = 1 << 20
LIVE = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


class LiveNode:
    """A node on its own event loop in a thread, and a client of it on that loop."""

    def __init__(self, idle_timeout: float | None = ANSWER_WITHIN) -> None:
        self.loop = asyncio.new_event_loop()
        self.reported: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.reported.append(context))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node = Node("127.0.0.1", 0, max_frame_bytes=LIMIT, idle_timeout=idle_timeout)
        self.run(self.node.start())
        self.client = ParameterClient(self.node.address, timeout=ANSWER_WITHIN)
        self.baseline_rss = _rss()

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.node.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


def _live(idle_timeout: float | None) -> Iterator[LiveNode]:
    node = LiveNode(idle_timeout)
    node.run(node.client.update_arrays({SENTINEL: np.arange(8)}))
    try:
        yield node
    finally:
        node.close()


@pytest.fixture(scope="module")
def live() -> Iterator[LiveNode]:
    yield from _live(ANSWER_WITHIN)


@pytest.fixture(scope="module")
def patient() -> Iterator[LiveNode]:
    """A node that closes no silent connection: what it ends, it ends of itself."""
    yield from _live(None)


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send_and_drain(address: tuple[str, int], data: bytes, *, close_ours: bool = True) -> bytes:
    """Send ``data``, close our side (unless told not to: the node must end it itself),
    and read until the node closes: answer what came."""
    with socket.create_connection(address, timeout=ANSWER_WITHIN) as sock:
        try:
            sock.sendall(data)
            if close_ours:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the node closed already (e.g. refused a frame header at once)
        received = bytearray()
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                break
            except TimeoutError:
                raise AssertionError(
                    f"the node neither answered nor closed within {ANSWER_WITHIN} s"
                ) from None
            if not chunk:
                break
            received += chunk
    return bytes(received)


def valid_updates(data: bytes) -> bool:
    """Whether ``data`` holds a well-formed update call (one the node may apply).

    The node reads the messages in turn: one that is no request (a reply
    sent to it) or names no method is answered with an error and passed
    over; one it cannot decode ends the connection.
    """
    frames = []
    try:
        for frame in Receiver(LIMIT).feed(data):
            frames.append(frame)
    except Exception:  # noqa: BLE001 - bytes that are no frame: nothing after them is read
        pass
    for frame in frames:
        try:
            name, mtype, _, reader = decode_header(frame.payload, frame.protocol)
        except Exception:  # noqa: BLE001 - the connection ends here
            return False
        m = method(name)
        if m is None or mtype not in (MessageType.CALL, MessageType.ONEWAY):
            continue  # answered with an error, passed over
        try:
            reader.read_body(m.args)
        except Exception:  # noqa: BLE001 - the connection ends here
            return False
        if name in ("update_parameters", "push_parameters", "broadcast_update"):
            return True
    return False


def check(live: LiveNode, data: bytes) -> None:
    before = {n: live.node.table.entry(n) for n in live.node.table.names()}
    send_and_drain(live.node.address, data)
    # The others are still served, correctly.
    sentinel = live.run(live.client.get_arrays([SENTINEL]))[SENTINEL]
    assert sentinel.tolist() == list(range(8))
    after = {n: live.node.table.entry(n) for n in live.node.table.names()}
    if after != before:
        assert valid_updates(data), "a message that is not a valid update changed the store"
    assert not live.reported, f"the node's event loop reported errors: {live.reported}"
    grown = _rss() - live.baseline_rss
    assert grown < MEMORY_BOUND, f"the process grew by {grown >> 20} MiB"


@LIVE
@given(data=hostile_bytes())
def test_arbitrary_bytes_on_a_live_connection(live: LiveNode, data: bytes) -> None:
    check(live, data)


@LIVE
@given(
    msgs=st.lists(messages(), min_size=1, max_size=3),
    protocol=st.sampled_from(PROTOCOLS),
    framed=st.booleans(),
    ops=mutations,
)
def test_mutated_messages_on_a_live_connection(
    live: LiveNode, msgs: list, protocol: Protocol, framed: bool, ops: list
) -> None:
    data = b"".join(encode(m, protocol, framed) for m in msgs)
    check(live, mutate(data, ops))


# Zero bytes after a compact message's start: each is a STOP (or a 0 varint, or a NUL of
# its name), so a message that can end, ends within them, and the next "message" starts
# 0x00, which no message does: the node must answer and close, whatever came first.
ZEROS = bytes(64)


@st.composite
def compact_starts(draw: st.DrawFn) -> bytes:
    """0x82, then a version-and-type byte, a seqid and a method name's length as drawn
    (any length, up to 2**32), then some bytes of the name."""
    vt = draw(st.sampled_from([0x21, 0x41, 0x61, 0x81]) | st.integers(0, 255))
    seqid = draw(st.integers(0, 2**32 - 1))
    n = draw(
        st.integers(0, 2 * MAX_METHOD_NAME_BYTES)
        | st.integers(len(ZEROS), LIMIT)  # (more than ZEROS complete, less than the frame limit)
        | st.integers(0, 2**32 - 1)
    )
    name = draw(st.binary(max_size=min(n, 24)) | st.just(b"ping"[: min(n, 4)]))
    return bytes([0x82, vt]) + _varint(seqid) + _varint(n) + name


@settings(LIVE, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # (a hang: no shrinking)
@given(start=compact_starts())
@example(start=bytes([0x82, 0x21, 5]) + _varint(800_000) + b"pu")  # a name of 800 KB
def test_compact_garbage_is_answered_or_closed_without_our_eof(
    patient: LiveNode, start: bytes
) -> None:
    send_and_drain(patient.node.address, start + ZEROS, close_ours=False)
    sentinel = patient.run(patient.client.get_arrays([SENTINEL]))[SENTINEL]
    assert sentinel.tolist() == list(range(8))
    assert not patient.reported, f"the node's event loop reported errors: {patient.reported}"
