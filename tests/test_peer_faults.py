"""Replication under faults and limits: a dead owner, lower request limits, small frames.

In-process nodes on this test's loop, on 127.0.0.1 and ports from port 0;
every wait is a poll bounded by a deadline, and no timing is asserted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from cluster_helpers import (
    LocalCluster,
    address_text,
    eventually,
    node_client,
    table_state,
    watched_cluster,
)

from aioparamsync import ErrorCode, Node, ParameterClient, RequestError, sum_rule
from aioparamsync.store.table import Limits

pytestmark = pytest.mark.timeout(60)

KiB = 1024
# Long enough for a peer in backoff to come back (peers.BACKOFF_MAX is 5 s),
# short enough that a test of a bug not fixed fails soon.
WAIT = 10.0


def _cluster_fixture(repair_interval: float) -> Any:
    async def fixture() -> AsyncIterator[LocalCluster]:
        async with watched_cluster(repair_interval) as nodes:
            yield nodes

    return pytest.fixture(fixture)


# In-process nodes; any error the loop reports fails the test.
cluster = _cluster_fixture(repair_interval=0.2)
# The same, with repair only when a link (re)connects: what reaches a peer
# later came by its outbox.
quiet_cluster = _cluster_fixture(repair_interval=3600.0)


def _holds(node: Node, names: list[str]) -> None:
    assert set(names) <= set(node.table.names()), (
        f"{node.node_id} lacks {sorted(set(names) - set(node.table.names()))}"
    )


def _same(a: Node, b: Node) -> None:
    assert table_state(a) == table_state(b), (
        f"{a.node_id} holds {sorted(a.table.names())}, {b.node_id} {sorted(b.table.names())}"
    )


# -- 1. a stopped owner's parameters -----------------------------------------------------


async def test_gradients_of_a_stopped_owners_parameter_meet_at_one_survivor(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start()
    b = await cluster.start(peers=[a])
    c = await cluster.start(peers=[a])
    await cluster.formed([a, b, c])
    name = next(
        n
        for i in range(1000)
        if (owner := a.cluster.owner(n := f"w{i}")) is not None and owner.node_id == c.node_id
    )
    async with node_client(a.address) as ca, node_client(b.address) as cb:
        await ca.update_arrays({name: np.zeros(1, np.float64)}, rules=sum_rule())
        await cluster.converged([a, b, c])
        c_address = address_text(c.address)
        await cluster.stop(c)

        def c_is_down() -> None:
            for node in (a, b):
                link = node.cluster.links[c_address]
                assert link.state == "backoff", f"{node.node_id} -> {link!r}"

        await eventually(c_is_down, timeout=WAIT)
        # The survivors agree on one of them; C, remembered, owns nothing.
        at_a, at_b = a.cluster.owner(name), b.cluster.owner(name)
        assert (at_a, at_b) in {
            (None, b.cluster.links[address_text(a.address)]),
            (a.cluster.links[address_text(b.address)], None),
        }, f"owner of {name!r}: at A {at_a!r}, at B {at_b!r}"

        rounds = 20
        grads = {name: np.ones(1, np.float64)}
        for _ in range(rounds):
            await asyncio.gather(ca.push_gradients(grads), cb.push_gradients(grads))
        await cluster.converged([a, b], timeout=WAIT)
        got = (await ca.get_arrays([name]))[name]
        assert got.tolist() == [2.0 * rounds], f"{2 * rounds} gradients of 1 pushed; {got}"
        assert a.service.forward_failures == b.service.forward_failures == 0


# -- 2. limits of one request --------------------------------------------------------------

LIMITS = Limits(max_names_per_request=16, max_params_per_update=16)


async def _write_32(node: Node) -> list[str]:
    """Two updates of 16 parameters each (each within LIMITS); answer the names."""
    names = []
    async with node_client(node.address) as client:
        for k in range(2):
            arrays = {f"p{k}_{i}": np.full(4, k * 16 + i, np.float32) for i in range(16)}
            await client.update_arrays(arrays)
            names += arrays
    return names


async def test_a_late_joiner_pulls_more_parameters_than_one_request_may_name(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start(limits=LIMITS)
    names = await _write_32(a)
    b = await cluster.start(peers=[a], limits=LIMITS)

    def caught_up() -> None:
        _holds(b, names)
        _same(a, b)
        link = b.cluster.links[address_text(a.address)]
        assert link.state == "up", f"{link!r}: {link.last_error}"

    await eventually(caught_up, timeout=WAIT)
    assert a.store.updates_refused == b.store.updates_refused == 0


async def _a_with_b_down(cluster: LocalCluster, **options: Any) -> tuple[Node, int]:
    """Node a, and the port of its peer b, which joined it and was stopped (same options)."""
    a = await cluster.start(**options)
    b = await cluster.start(peers=[a], **options)  # (on a port the kernel picks: b's now)
    port = b.port
    await cluster.formed([a, b])
    await cluster.stop(b)
    return a, port


async def test_an_outbox_larger_than_one_update_may_hold_reaches_its_peer(
    quiet_cluster: LocalCluster,
) -> None:
    a, b_port = await _a_with_b_down(quiet_cluster, limits=LIMITS)
    names = await _write_32(a)  # B is down: its outbox at A holds 32
    b = await quiet_cluster.start(peers=[a], port=b_port, limits=LIMITS)

    def caught_up() -> None:
        _holds(b, names)
        _same(a, b)
        link = a.cluster.links[address_text(b.address)]
        assert link.state == "up" and not link.outbox, f"{link!r}: {link.last_error}"

    await eventually(caught_up, timeout=WAIT)
    # Nothing refused: not one oneway batch counted as sent but dropped.
    assert b.store.updates_refused == 0


# -- 3. frames smaller than a batch, or than a parameter -----------------------------------

FRAME = 64 * KiB


async def test_updates_larger_than_a_frame_reach_a_peer_and_do_not_hold_back_later_ones(
    quiet_cluster: LocalCluster,
) -> None:
    a, b_port = await _a_with_b_down(quiet_cluster, max_frame_bytes=FRAME)
    # While B is down, A takes updates that each fit a frame, but not together.
    small = {f"x{i}": np.full(6 * KiB, i, np.float32) for i in range(3)}  # 24 KiB each
    # (a client sends a parameter larger than a frame in pieces)
    client = node_client(a.address, max_inline_bytes=16 * KiB, piece_bytes=16 * KiB)
    async with client:
        for name, array in small.items():
            await client.update_arrays({name: array})
        await client.update_arrays({"big": np.arange(40 * KiB, dtype=np.float32)})  # 160 KiB
        b = await quiet_cluster.start(peers=[a], port=b_port, max_frame_bytes=FRAME)
        await eventually(lambda: _holds(b, [*small, "big"]), timeout=WAIT)
        # Later updates, by the outbox alone (B repairs only when its link connects).
        await client.update_arrays({"z": np.zeros(4, np.float32)})
        await client.update_arrays({"big2": np.ones(40 * KiB, np.float32)})

    def caught_up() -> None:
        _holds(b, ["z", "big2"])
        _same(a, b)
        link = a.cluster.links[address_text(b.address)]
        assert link.state == "up" and not link.outbox, f"{link!r}: {link.last_error}"

    await eventually(caught_up, timeout=WAIT)


# -- 4. a push folded in parts ---------------------------------------------------------------


async def _two_owners(cluster: LocalCluster) -> tuple[Node, Node, str, str]:
    """Nodes a and b, and two parameters (zeros, summed): one a folds, one b folds."""
    a = await cluster.start()
    b = await cluster.start(peers=[a])
    await cluster.formed([a, b])
    names = [f"p{i}" for i in range(200)]
    mine = next(n for n in names if a.cluster.owner(n) is None)
    theirs = next(n for n in names if a.cluster.owner(n) is not None)
    async with node_client(a.address) as client:
        await client.update_arrays({mine: np.zeros(4), theirs: np.zeros(4)}, rules=sum_rule())
    await cluster.converged([a, b])
    return a, b, mine, theirs


async def _folded_once(client: ParameterClient, names: list[str]) -> None:
    async def once() -> None:
        got = await client.get_arrays(names)
        assert all(got[n].tolist() == [1.0] * 4 for n in names), got

    await eventually(once, timeout=WAIT)


async def test_a_push_one_part_of_which_cannot_be_folded_folds_no_part(
    cluster: LocalCluster,
) -> None:
    a, _, mine, theirs = await _two_owners(cluster)
    async with node_client(a.address) as client:
        with pytest.raises(RequestError) as refused:  # the shape of theirs is wrong
            await client.push_gradients({mine: np.ones(4), theirs: np.ones(3)})
        assert refused.value.code == ErrorCode.SHAPE_MISMATCH
        got = await client.get_arrays([mine, theirs])
        assert got[mine].tolist() == [0.0] * 4 and got[theirs].tolist() == [0.0] * 4


async def test_a_push_sent_again_after_one_part_failed_folds_each_part_once(
    cluster: LocalCluster,
) -> None:
    a, b, mine, theirs = await _two_owners(cluster)
    grads = {mine: np.ones(4), theirs: np.ones(4)}
    async with node_client(a.address) as at_a, node_client(b.address) as at_b:
        b.store.max_pending = 0  # the owner of theirs refuses for now: mine is folded
        with pytest.raises(RequestError) as refused:
            await at_a.push_gradients(grads, request_id="step-1")
        assert refused.value.code == ErrorCode.UNAVAILABLE
        b.store.max_pending = 10_000
        await at_a.push_gradients(grads, request_id="step-1")  # the retry
        # And sent again at the other node (say, the worker moved on): nothing more.
        await at_b.push_gradients(grads, request_id="step-1")

        await _folded_once(at_a, [mine, theirs])
        await cluster.converged([a, b])
        await _folded_once(at_b, [mine, theirs])


async def test_a_push_sent_again_at_the_owner_of_one_part_folds_the_rest(
    cluster: LocalCluster,
) -> None:
    a, b, mine, theirs = await _two_owners(cluster)
    grads = {mine: np.ones(4), theirs: np.ones(4)}
    async with node_client(a.address) as at_a, node_client(b.address) as at_b:
        a.store.max_pending = 0  # a refuses its own part; theirs is folded at b
        with pytest.raises(RequestError):
            await at_a.push_gradients(grads, request_id="X")
        a.store.max_pending = 10_000
        # Sent again at b, which folded one part of it: it folds the other, once.
        versions = await at_b.push_gradients(grads, request_id="X")
        assert set(versions) == {mine, theirs}

        await _folded_once(at_b, [mine, theirs])


# -- 5. a part with no replica left ----------------------------------------------------------


@pytest.mark.parametrize("write", ["push_gradients", "update_arrays"])
async def test_a_part_none_of_whose_replicas_is_up_fails_unavailable_and_lands_nowhere(
    cluster: LocalCluster, write: str
) -> None:
    """The part is never applied at a node that does not hold its key (it would start the
    key anew there, and fold a gradient into nothing)."""
    a = await cluster.start(replication_factor=2)
    b = await cluster.start(peers=[a], replication_factor=2)
    c = await cluster.start(peers=[a], replication_factor=2)
    await cluster.formed([a, b, c])

    def placed_over_three() -> None:  # (formed: linked; placed, once each is seen up)
        assert len(a.cluster.placement.members) == 3, a.cluster.placement

    await eventually(placed_over_three, timeout=WAIT)
    names = [f"w{i}" for i in range(200)]
    theirs = next(n for n in names if not a.cluster.placement.holds(a.node_id, n))
    async with node_client(a.address) as client:
        await client.update_arrays({theirs: np.zeros(4)}, rules=sum_rule())
        await cluster.converged([b, c])
        down = [address_text(b.address), address_text(c.address)]
        await cluster.stop(b)
        await cluster.stop(c)

        def both_down() -> None:
            assert all(a.cluster.links[x].state == "backoff" for x in down)

        await eventually(both_down, timeout=WAIT)
        with pytest.raises(RequestError) as refused:
            if write == "push_gradients":
                await client.push_gradients({theirs: np.ones(4)})
            else:
                await client.update_arrays({theirs: np.ones(4)})
        assert refused.value.code == ErrorCode.UNAVAILABLE, refused.value
        assert "no replica" in refused.value.message
        assert theirs not in a.table.names()
