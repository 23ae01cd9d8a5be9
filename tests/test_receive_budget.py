"""The receive budget: large frames being received share one bound of memory.

Accounting first (``ReceiveBudget``, then ``Receiver`` fed by hand), then a live
node: concurrent large updates all land, one at a time, and a sender that stops
halfway through a frame does not hold the others back.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest
from cluster_helpers import eventually
from hypothesis import given, settings
from hypothesis import strategies as st

from aioparamsync import Node, ParameterClient
from aioparamsync.wire import ReceiveBudget, Receiver
from aioparamsync.wire.framing import LARGE_FRAME_BYTES, SCRATCH_BYTES

MIB = 1024 * 1024


def charge(size: int) -> int:
    """What a large frame of ``size`` bytes is counted for (its first 64 KiB are free)."""
    return size - LARGE_FRAME_BYTES


def framed(nbytes: int, fill: int = 7) -> bytes:
    """A frame whose payload is ``nbytes`` long (starting as a binary call does: its
    version word, and a method name of no bytes)."""
    head = struct.pack("!Ii", 0x80010001, 0)
    return struct.pack("!i", nbytes) + head + bytes([fill]) * (nbytes - len(head))


# -- the accounting ----------------------------------------------------------------------------


def test_frames_are_let_in_in_the_order_they_asked() -> None:
    budget = ReceiveBudget(100)
    granted: list[str] = []
    assert budget.reserve(60, lambda: granted.append("a"))
    assert not budget.reserve(60, lambda: granted.append("b"))  # 120 > 100
    assert not budget.reserve(10, lambda: granted.append("c"))  # fits, but b asked first
    assert not budget.reserve(500, lambda: granted.append("d"))  # larger than the budget
    assert budget.waiting == 3 and granted == []
    budget.release(60)
    assert granted == ["b", "c"] and budget.in_use == 70
    budget.release(60)
    assert granted == ["b", "c"]  # d goes alone, when nothing else is received
    budget.release(10)
    assert granted == ["b", "c", "d"] and budget.in_use == 500
    budget.release(500)
    assert budget.in_use == 0 and budget.waiting == 0


def test_a_withdrawn_request_lets_the_next_one_in() -> None:
    budget = ReceiveBudget(100)
    granted: list[str] = []

    def first() -> None:
        granted.append("first")

    assert budget.reserve(90, lambda: granted.append("holder"))
    assert not budget.reserve(50, first)
    assert not budget.reserve(5, lambda: granted.append("small"))
    budget.cancel(first)  # its connection went away
    assert granted == ["small"] and budget.in_use == 95 and budget.waiting == 0


def test_grant_next_lets_the_first_waiter_in_beyond_the_budget() -> None:
    budget = ReceiveBudget(100)
    granted: list[str] = []
    assert budget.reserve(100, lambda: None)
    assert not budget.reserve(100, lambda: granted.append("b"))
    assert not budget.reserve(100, lambda: granted.append("c"))
    budget.grant_next()
    assert granted == ["b"] and budget.in_use == 200 and budget.waiting == 1


def test_no_limit_lets_every_frame_in_at_once() -> None:
    budget = ReceiveBudget(None)
    assert all(budget.reserve(1 << 30, lambda: None) for _ in range(8))
    assert budget.in_use == 8 << 30 and budget.waiting == 0


@pytest.mark.parametrize("limit", [0, -1])
def test_a_budget_must_hold_something(limit: int) -> None:
    with pytest.raises(ValueError, match="at least 1 byte"):
        ReceiveBudget(limit)


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 100),
    steps=st.lists(
        st.tuples(st.sampled_from(["ask", "done", "leave", "stalled"]), st.integers(1, 150)),
        max_size=60,
    ),
)
def test_the_budget_keeps_its_books_whatever_happens(limit: int, steps) -> None:
    """Frames ask, finish, leave while waiting, or stall; the books always balance."""
    budget = ReceiveBudget(limit)
    holding: list[int] = []  # granted, not released: their sizes
    waiting: list[tuple[int, object]] = []  # asked, not granted, in order
    order: list[int] = []  # ids in the order they were let in
    asked = 0

    def asker(ident: int, size: int):
        def on_grant() -> None:
            waiting.remove(next(w for w in waiting if w[0] == ident))
            holding.append(size)
            order.append(ident)

        return on_grant

    callbacks: dict[int, object] = {}
    for action, n in steps:
        if action == "ask":
            asked += 1
            callback = callbacks[asked] = asker(asked, n)
            waiting.append((asked, n))
            if budget.reserve(n, callback):  # type: ignore[arg-type]
                waiting.pop()
                holding.append(n)
                order.append(asked)
        elif action == "done" and holding:
            budget.release(holding.pop(n % len(holding)))
        elif action == "leave" and waiting:
            ident, _ = waiting[n % len(waiting)]
            waiting.remove(next(w for w in waiting if w[0] == ident))
            budget.cancel(callbacks[ident])  # type: ignore[arg-type]
        elif action == "stalled" and waiting:
            head = waiting[0][0]
            budget.grant_next()
            assert head in order  # let in, whether or not it fits
        assert budget.in_use == sum(holding)
        assert budget.waiting == len(waiting)
        # Nobody waits for an empty budget, and nobody ahead of a waiter could have gone in.
        assert not waiting or budget.in_use > 0
        assert order == sorted(order)  # first come, first in
        if budget.in_use <= limit:
            assert not waiting or budget.in_use + waiting[0][1] > limit


# -- receivers sharing a budget ----------------------------------------------------------------


def test_a_large_frame_waits_until_the_one_ahead_is_handed_on() -> None:
    size = 4 * SCRATCH_BYTES  # received into a buffer of its own
    budget = ReceiveBudget(size)
    first, second = Receiver(budget=budget), Receiver(budget=budget)
    woken: list[bool] = []
    second.on_grant = lambda: woken.append(True)
    one, two = framed(size, 1), framed(size, 2)

    assert first.feed(one[:1000]) == [] and budget.in_use == charge(size)
    assert second.feed(two[:1000]) == []
    assert second.waiting_for_budget and budget.waiting == 1

    frames = first.feed(one[1000:])
    assert len(frames) == 1 and frames[0].payload == one[4:]
    assert not woken, "granted before the frame ahead was handed on"
    first.release_handed()
    assert woken and not second.waiting_for_budget and budget.in_use == charge(size)

    assert second.buffer_updated(0) == []  # goes on: its buffer is allocated now
    frames = second.feed(two[1000:])
    assert len(frames) == 1 and frames[0].payload == two[4:]
    second.release_handed()
    assert budget.in_use == 0 and budget.waiting == 0


def test_a_budget_of_two_parameters_takes_two_messages_of_them_at_once() -> None:
    # A parameter's message is its data plus a header: a budget of twice the
    # data takes two such messages, not one.
    data = 4 * SCRATCH_BYTES
    size = data + 100
    budget = ReceiveBudget(2 * data)
    receivers = [Receiver(budget=budget) for _ in range(3)]
    for r in receivers:
        assert r.feed(framed(size)[:1000]) == []
    assert [r.waiting_for_budget for r in receivers] == [False, False, True]
    assert budget.in_use == 2 * charge(size) <= 2 * data


def test_a_waiting_frame_that_arrives_whole_withdraws_its_request() -> None:
    size = LARGE_FRAME_BYTES + 1000  # large, but it fits in the scratch buffer
    budget = ReceiveBudget(charge(size))
    first, second = Receiver(budget=budget), Receiver(budget=budget)
    one, two = framed(size, 1), framed(size, 2)
    assert first.feed(one[:100]) == []
    assert second.feed(two[:100]) == [] and second.waiting_for_budget
    frames = second.feed(two[100:])
    assert len(frames) == 1 and frames[0].payload == two[4:]
    assert not second.waiting_for_budget and budget.waiting == 0
    assert budget.in_use == charge(size)  # still the first frame's


def test_closing_a_receiver_gives_back_what_it_held_and_withdraws_what_it_asked() -> None:
    size = 4 * SCRATCH_BYTES
    budget = ReceiveBudget(size)
    holder, waiter, last = (Receiver(budget=budget) for _ in range(3))
    woken: list[bool] = []
    last.on_grant = lambda: woken.append(True)
    assert holder.feed(framed(size)[:5000]) == []
    assert waiter.feed(framed(size)[:10]) == [] and last.feed(framed(size)[:10]) == []
    assert budget.waiting == 2
    waiter.close()
    assert budget.waiting == 1 and not woken
    holder.close()  # mid-frame
    assert woken and budget.in_use == charge(size) and budget.waiting == 0
    last.close()
    assert budget.in_use == 0


def test_feeding_a_waiting_receiver_past_its_scratch_buffer_is_an_error() -> None:
    size = 4 * SCRATCH_BYTES
    budget = ReceiveBudget(size)
    holder, waiter = Receiver(budget=budget), Receiver(budget=budget)
    assert holder.feed(framed(size)[:1000]) == []
    with pytest.raises(BufferError, match="waits for its budget"):
        waiter.feed(framed(size)[: 2 * SCRATCH_BYTES])
    assert waiter.waiting_for_budget and budget.in_use == charge(size)


def test_a_receiver_without_a_budget_takes_any_frame_at_once() -> None:
    size = 4 * SCRATCH_BYTES
    receivers = [Receiver() for _ in range(3)]
    for r in receivers:
        assert r.feed(framed(size)[:1000]) == [] and not r.waiting_for_budget
    for r in receivers:
        assert len(r.feed(framed(size)[1000:])) == 1


# -- a live node -------------------------------------------------------------------------------


async def test_concurrent_large_updates_take_turns_and_all_land() -> None:
    arrays = {f"w{i}": np.full(MIB // 2, i, np.float32) for i in range(6)}  # 2 MiB each
    # Room for one of them at a time.
    async with Node("127.0.0.1", 0, max_receiving_bytes=3 * MIB) as node:
        clients = [ParameterClient(node.address, max_connections=1) for _ in arrays]
        try:
            for version in (1, 2, 3):
                updates = [
                    c.update_arrays({name: array + version})
                    for c, (name, array) in zip(clients, arrays.items(), strict=True)
                ]
                results = await asyncio.wait_for(asyncio.gather(*updates), 30)
                assert results == [{n: version} for n in arrays]
            got = await clients[0].get_arrays(list(arrays))
            for name, array in arrays.items():
                np.testing.assert_array_equal(got[name], array + 3)
            assert node.server.counters["budget_waits"] > 0
            assert node.server.counters["budget_overruns"] == 0
            assert node.server.budget.in_use == 0 and node.server.budget.waiting == 0
        finally:
            for client in clients:
                await client.close()


async def test_a_sender_that_stops_halfway_does_not_hold_the_others_back() -> None:
    async with Node("127.0.0.1", 0, max_receiving_bytes=MIB) as node:
        host, port = node.address
        stalled = socket.create_connection((host, port))
        try:
            # The start of a 1 MiB frame, then nothing: it holds the whole budget.
            stalled.sendall(framed(MIB)[: 300 * 1024])
            budget = node.server.budget

            async def holds() -> None:
                assert budget.in_use >= charge(MIB)

            await eventually(holds)
            async with ParameterClient(node.address) as client:
                update = client.update_arrays({"w": np.ones(MIB // 4, np.float32)})  # 1 MiB
                assert await asyncio.wait_for(update, 10) == {"w": 1}
                assert node.server.counters["budget_overruns"] >= 1
                np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], 1)
        finally:
            stalled.close()

        async def given_back() -> None:
            assert budget.in_use == 0 and budget.waiting == 0

        await eventually(given_back)
