"""The cluster: replication, membership, coalescing, repair, failover; in-process and as processes.

In-process tests run nodes on this test's loop (``repair_interval=0.2``); the
process tests run ``python -m aioparamsync`` children (``--repair-interval 0.5``)
and kill them by PID at cleanup. Everything is on 127.0.0.1 with ports from
port 0; every wait is a poll bounded by a deadline, and no timing is asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import numpy as np
import pytest
import uvloop
from cluster_helpers import (
    RETRY_WIRE,
    LocalCluster,
    ProcessCluster,
    State,
    address_text,
    assert_mesh,
    assert_mesh_over_wire,
    assert_same_wire_states,
    eventually,
    free_port,
    node_client,
    primary_of,
    table_state,
    watch_loop_errors,
    watched_cluster,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioparamsync import ConnectError, Node, ParameterClient, ServerError, to_parameter
from aioparamsync.cluster.links import PeerLink
from aioparamsync.cluster.view import View
from aioparamsync.placement import Placement
from aioparamsync.store.table import Entry
from aioparamsync.wire import METHODS, thrift

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    """In-process nodes; any error the loop reports fails the test."""
    async with watched_cluster(repair_interval=0.2) as nodes:
        yield nodes


@pytest.fixture
async def procs() -> AsyncIterator[ProcessCluster]:
    """``await procs.spawn(peers=[...], port=...)``; every process is killed at teardown."""
    nodes = ProcessCluster(repair_interval=0.5)
    try:
        yield nodes
    finally:
        await nodes.close()


async def three(cluster: LocalCluster) -> tuple[Node, Node, Node]:
    a = await cluster.start()
    b = await cluster.start(peers=[a])
    c = await cluster.start(peers=[a])
    await cluster.formed([a, b, c])
    return a, b, c


def value(*numbers: int) -> np.ndarray:
    return np.array(numbers, dtype=np.int64)


# -- 1. replication ----------------------------------------------------------------------


async def test_an_update_on_any_node_reaches_the_others_with_its_version_and_origin(
    cluster: LocalCluster,
) -> None:
    nodes = await three(cluster)
    for node in nodes:
        assert len(node.cluster.links) == 2
        assert all(link.state == "up" for link in node.cluster.links.values())

    expected: State = {}
    for i, writer in enumerate(nodes):
        async with node_client(writer.address, timeout=10) as client:
            versions = await client.update_arrays({f"w{i}": value(i, 1), "shared": value(i, 2)})
        assert versions == {f"w{i}": 1, "shared": i + 1}
        expected[f"w{i}"] = (1, writer.table.origin, value(i, 1).tobytes())
        expected["shared"] = (i + 1, writer.table.origin, value(i, 2).tobytes())
        # Wait for this write everywhere before the next one (so "shared" grows).
        await cluster.converged(nodes, dict(expected))

    # Readable over the wire on every node, the same bytes, version and origin.
    for reader in nodes:
        async with node_client(reader.address, timeout=10) as client:
            response = await client.get_parameters(sorted(expected))
        got = {p.name: (p.version, p.origin, bytes(p.data)) for p in response.params}
        assert got == expected, reader.node_id


# -- 2. membership ---------------------------------------------------------------------


async def test_a_node_joining_through_one_member_becomes_known_to_all_and_gets_the_data(
    cluster: LocalCluster,
) -> None:
    a, b, c = await three(cluster)
    written: dict[str, int] = {}
    for i, node in enumerate((a, b, c)):
        async with node_client(node.address, timeout=10) as client:
            written |= await client.update_arrays({f"p{i}": value(i), f"q{i}": value(i, i)})
    before = await cluster.converged([a, b, c])
    assert set(before) == set(written)

    d = await cluster.start(peers=[c])  # knows only c
    await cluster.formed([a, b, c, d])
    for node in (a, b, c):
        link = node.cluster.links[address_text(d.address)]
        assert (link.node_id, link.state) == (d.node_id, "up")
    # d got everything by repair (nothing was written since it joined).
    await cluster.converged([a, b, c, d], before)
    assert sum(link.repaired for link in d.cluster.links.values()) >= len(before)
    assert all(link.updates_sent == 0 for link in d.cluster.links.values())

    # And d's own updates reach everyone.
    async with node_client(d.address, timeout=10) as client:
        assert await client.update_arrays({"from_d": value(4)}) == {"from_d": 1}
    state = await cluster.converged([a, b, c, d])
    assert state["from_d"][:2] == (1, d.table.origin)


# -- 3. no re-broadcast ------------------------------------------------------------------


async def test_updates_received_from_a_peer_are_not_sent_on(cluster: LocalCluster) -> None:
    a, b, c = await three(cluster)
    n = 40
    async with node_client(a.address, timeout=10) as client:
        for i in range(n):
            await client.update_arrays({f"x{i % 7}": value(i)})
        # Some concurrent ones too (more chances to coalesce).
        await asyncio.gather(
            *(client.update_arrays({f"x{i % 7}": value(i)}) for i in range(n, 2 * n))
        )
    total = 2 * n
    state = await cluster.converged([a, b, c])
    assert {origin for _, origin, _ in state.values()} == {a.table.origin}

    await eventually(lambda: _assert_all_sent(a, total))
    for link in a.cluster.links.values():
        assert 1 <= link.updates_sent <= total, link
        assert link.send_failures == 0, link
    for node in (b, c):
        for link in node.cluster.links.values():
            assert (link.updates_sent, link.updates_coalesced) == (0, 0), (node.node_id, link)
            assert link.outbox == {}, link


# -- 4. coalescing, a bounded outbox, and a peer restarted empty ---------------------------


async def test_a_dead_peers_outbox_coalesces_and_a_restarted_peer_catches_up(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start()
    b = await cluster.start(peers=[a])
    await cluster.formed([a, b])
    b_port, b_address = b.port, address_text(b.address)
    await cluster.stop(b)

    names = [f"n{i}" for i in range(5)]
    last: dict[str, int] = {}
    async with node_client(a.address, timeout=10) as client:
        for i in range(200):
            name = names[i % len(names)]
            versions = await client.update_arrays({name: value(i)})
            assert versions[name] == last.get(name, 0) + 1  # every update succeeds
            last[name] = versions[name]
            if i % 50 == 0:
                await asyncio.sleep(0.05)  # let the link notice that b is gone

    link = a.cluster.links[b_address]
    stats = link.statistics()
    assert stats["outbox_depth"] <= len(names), stats
    assert stats["updates_coalesced"] > 0, stats
    await eventually(lambda: _assert_state(link, "backoff"))
    assert link.send_failures >= 1 and link.last_error, link.statistics()
    assert last == {name: 40 for name in names}

    # A new, empty node on b's port, seeded with a: it converges to a's values.
    b2 = await cluster.start(port=b_port, peers=[a])
    assert b2.node_id == b_address
    expected = {
        name: (40, a.table.origin, value(195 + i).tobytes()) for i, name in enumerate(names)
    }
    await cluster.converged([a, b2], expected)
    await cluster.formed([a, b2])
    await eventually(lambda: _assert_outbox_empty(link))


def _assert_state(link: Any, state: str) -> None:
    assert link.state == state, link


def _assert_outbox_empty(link: Any) -> None:
    assert link.outbox == {}, link


def _assert_all_sent(node: Node, total: int) -> None:
    """Each of the node's links has sent or coalesced every one of its ``total`` updates."""
    for link in node.cluster.links.values():
        assert link.outbox == {}, link
        assert link.updates_sent + link.updates_coalesced == total, link


# -- 5. concurrent conflicting writes (property) ---------------------------------------------

NAMES = ["p", "q", "r"]
# One write: (node, client on that node, names, explicit version or 0).
_write = st.tuples(
    st.integers(0, 2),
    st.integers(0, 1),
    st.lists(st.sampled_from(NAMES), min_size=1, max_size=2, unique=True),
    st.one_of(st.just(0), st.just(0), st.integers(1, 12)),
)
# A schedule: groups of writes run at once (gather), and what to do between groups.
_schedule = st.lists(
    st.tuples(
        st.lists(_write, min_size=1, max_size=4),
        st.sampled_from(["nothing", "yield", "sleep"]),
    ),
    min_size=1,
    max_size=6,
)

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.mark.parametrize("loop_factory", list(LOOPS.values()), ids=list(LOOPS))
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schedule=_schedule)
def test_concurrent_conflicting_writes_converge_to_the_largest_version_and_origin(
    loop_factory: Any, schedule: list[Any]
) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(asyncio.wait_for(_conflicting_writes(schedule), 30))


async def _conflicting_writes(schedule: list[Any]) -> None:
    reported = watch_loop_errors(asyncio.get_running_loop())
    cluster = LocalCluster(repair_interval=0.2)
    clients: list[list[ParameterClient]] = []
    try:
        nodes = await three(cluster)
        clients = [[node_client(n.address, timeout=10) for _ in range(2)] for n in nodes]
        answered: dict[str, list[tuple[int, str, bytes]]] = {name: [] for name in NAMES}
        serial = iter(range(1_000_000))

        async def write(node_i: int, client_i: int, names: list[str], version: int) -> None:
            data = {name: value(next(serial), node_i) for name in names}
            params = [to_parameter(name, array, version=version) for name, array in data.items()]
            versions = await clients[node_i][client_i].update_parameters(params)
            assert set(versions) == set(names)
            for name in names:
                assert versions[name] >= max(version, 1)
                answered[name].append(
                    (versions[name], nodes[node_i].table.origin, data[name].tobytes())
                )

        for group, pause in schedule:
            await asyncio.gather(*(write(*w) for w in group))
            if pause == "yield":
                await asyncio.sleep(0)
            elif pause == "sleep":
                await asyncio.sleep(0.01)

        # The winner of each name: the largest (version, origin) any client was answered.
        expected = {name: max(writes) for name, writes in answered.items() if writes}
        # Three live nodes, repair every 0.2 s: a short bound keeps shrinking affordable.
        await cluster.converged(nodes, expected, timeout=5)
    finally:
        for pair in clients:
            for client in pair:
                await client.close()
        await cluster.close()
    await asyncio.sleep(0)
    assert not reported, f"the event loop reported errors: {reported}"


# -- 6. client failover ------------------------------------------------------------------------


async def test_a_client_of_several_addresses_fails_over_and_names_them_all_at_the_end(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start()
    b = await cluster.start(peers=[a])
    await cluster.formed([a, b])
    dead = ("127.0.0.1", free_port())
    addresses = [dead, a.address, b.address]
    async with node_client(addresses, timeout=10, connect_timeout=5) as client:
        assert await client.ping() == a.node_id  # the dead one is skipped
        assert (client.host, client.port) == a.address
        assert await client.update_arrays({"w": value(1)}) == {"w": 1}

        await cluster.stop(a)
        assert await client.ping() == b.node_id  # moves to b
        assert (client.host, client.port) == b.address
        # b holds what was written on a, and takes the writes now.
        assert await client.update_arrays({"w": value(2)}) == {"w": 2}
        got = await client.get_arrays(["w"])
        np.testing.assert_array_equal(got["w"], value(2))
        assert table_state(b)["w"][:2] == (2, b.table.origin)

        await cluster.stop(b)
        with pytest.raises(ConnectError) as caught:
            await client.ping()
        message = str(caught.value)
        for address in addresses:
            assert address_text(address) in message, message


# -- 7. info() over the wire ---------------------------------------------------------------------


async def test_info_shows_the_peers_and_their_counters(cluster: LocalCluster) -> None:
    a, b, c = await three(cluster)
    async with node_client(a.address, timeout=10) as client:
        for i in range(10):
            await client.update_arrays({f"i{i % 3}": value(i)})
    await cluster.converged([a, b, c])
    await eventually(lambda: _assert_all_sent(a, 10))

    async with node_client(a.address, timeout=10) as client:
        info = await client.info()
    assert info.node_id == a.node_id
    peers = {p.node_id: p for p in info.peers}
    assert set(peers) == {b.node_id, c.node_id}
    for node in (b, c):
        p = peers[node.node_id]
        assert p.address == address_text(node.address)
        assert p.state == "up"
        assert p.outbox_depth == 0
        assert p.send_failures == 0
        assert 1 <= p.updates_sent <= 10
        assert p.updates_sent + p.updates_coalesced == 10
        assert p.lag_seconds == 0.0  # nothing waits
        assert p.repaired >= 0
    async with node_client(b.address, timeout=10) as client:
        info_b = await client.info()
    assert {p.node_id for p in info_b.peers} == {a.node_id, c.node_id}
    assert all(p.updates_sent == 0 and p.state == "up" for p in info_b.peers)

    # A peer gone: its state and its failures show.
    c_id = c.node_id
    await cluster.stop(c)
    async with node_client(a.address, timeout=10) as client:
        await client.update_arrays({"after": value(0)})

        async def c_in_backoff() -> Any:
            info = await client.info()
            p = {p.node_id: p for p in info.peers}[c_id]
            assert p.state == "backoff" and p.send_failures >= 1, p
            return p

        p = await eventually(c_in_backoff)
    assert p.last_error
    assert p.outbox_depth <= 1


# -- the view -------------------------------------------------------------------------------


def test_a_view_is_one_epochs_members_frozen_and_replaced_whole() -> None:
    states = {"a": "up", "b": "leaving", "c": "joining", "d": "down", "e": "failed"}
    view = View.of(7, states, leaving=["b"], replication_factor=2)
    assert (view.epoch, dict(view.states)) == (7, states)
    assert view.placement == Placement(["a", "b", "d"], 2)  # (up, leaving, down)
    assert view.pending == Placement(["a", "c", "d"], 2)  # (b gone, c come)
    assert view.live == {"a", "b"}
    states["a"] = "failed"  # (the view keeps its own)
    assert view.states["a"] == "up" and view.same({**states, "a": "up"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.epoch = 8  # type: ignore[misc]
    later = view.at(9)
    assert (later.epoch, later.placement, view.epoch) == (9, view.placement, 7)
    name = next(f"k{i}" for i in range(100) if "c" in view.pending.replicas(f"k{i}"))
    assert view.holds("c", name) and not view.placement.holds("c", name)
    settled = View.of(10, {"a": "up", "d": "up"}, (), 2, before=view)
    assert settled.pending is None and settled.placement.members == ("a", "d")
    assert str(settled) == "epoch 10: a up, d up (R=2)"


# -- nodes of another replication factor ----------------------------------------------------------


async def test_a_node_of_another_replication_factor_is_refused_and_not_ready(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start(replication_factor=2)
    b = await cluster.start(peers=[a], replication_factor=2)
    await cluster.formed([a, b])
    odd = await cluster.start(peers=[a])  # (every node holds every key: "all")
    both = f"node {odd.node_id} has replication factor all, node {a.node_id} 2"

    def refused() -> None:
        links = {n: link.state for n, link in odd.cluster.links.items()}
        assert links == {address_text(a.address): "refused"}, links
        ready, why = odd.readiness()
        assert not ready and why.startswith("in no cluster: ") and both in why, why

    await eventually(refused)
    link = a.cluster.links[address_text(odd.address)]  # (made for it, refused)
    assert link.state == "refused" and both in link.last_error
    assert address_text(odd.address) not in b.cluster.links  # (a does not tell of it)
    for node in (a, b):
        assert {m.node_id for m in node.cluster.topology().members} == {a.node_id, b.node_id}
        assert node.readiness()[0], node.readiness()
    async with ParameterClient(a.address, timeout=10) as routed:
        await routed.update_arrays({f"k{i}": value(i) for i in range(20)})
        assert len(await routed.get_arrays([f"k{i}" for i in range(20)])) == 20
    assert not list(odd.table.names())  # (no key placed on it, none sent to it)
    assert [m.node_id for m in odd.cluster.topology().members] == [odd.node_id]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replication_factor": -1}, "replication factor is at least 1, or 0"),
        ({"refused": "no"}, "refused is for an answer to announce"),
    ],
)
async def test_a_bad_announce_is_refused_and_adds_nothing(
    cluster: LocalCluster, fields: dict[str, Any], message: str
) -> None:
    a = await cluster.start()
    member = thrift.Member(node_id="x", host="127.0.0.1", port=free_port(), **fields)
    async with node_client(a.address, timeout=10) as client:
        with pytest.raises(ServerError, match=message):
            await client.invoke(METHODS.announce, member=member)
        assert not (await client.info()).peers


async def test_an_announce_of_another_replication_factor_is_answered_refused(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start(replication_factor=2)
    async with node_client(a.address, timeout=10) as client:
        for r, said in ((3, "3"), (0, "all")):
            port = free_port()
            member = thrift.Member(node_id=f"odd{r}", host="127.0.0.1", port=port, state="up")
            member.replication_factor = r
            answer = await client.invoke(METHODS.announce, member=member)
            assert [m.node_id for m in answer] == [a.node_id], answer  # (no member told)
            assert answer[0].replication_factor == 2
            assert f"node odd{r} has replication factor {said}, node {a.node_id} 2" in (
                answer[0].refused
            )
            peer = {p.node_id: p for p in (await client.info()).peers}[f"odd{r}"]
            assert peer.state == "refused" and said in peer.last_error, peer
        assert [m.node_id for m in (await client.topology()).members] == [a.node_id]


# -- regressions: each of these once kept a cluster from converging -----------------------------
# A correct cluster converges here within a few repair rounds (0.2 s) and backoffs
# (from 0.05 s); BUG_DEADLINE bounds the wait, far above that.
BUG_DEADLINE = 3.0


async def test_a_node_restarted_under_its_id_and_written_before_catching_up_converges(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start()
    b = await cluster.start(peers=[a])
    await cluster.formed([a, b])
    async with node_client(b.address, timeout=10) as client:
        assert await client.update_arrays({"x": value(1)}) == {"x": 1}
    await cluster.converged([a, b])
    port, b_id = b.port, b.node_id
    await cluster.stop(b)

    # b again, empty, on its port; a client writes before it has caught up (made
    # deterministic: it joins a only after the write, as if its repair were slow).
    b2 = await cluster.start(port=port)
    assert b2.node_id == b_id
    async with node_client(b2.address, timeout=10) as client:
        assert await client.update_arrays({"x": value(2)}) == {"x": 1}
    b2.cluster.add(*a.address)
    await cluster.formed([a, b2])
    # Today: a holds (1, b, [1]) and b2 holds (1, b, [2]), forever.
    await cluster.converged([a, b2], timeout=BUG_DEADLINE)


async def test_a_peer_restarted_at_its_address_without_seeds_is_rejoined(
    cluster: LocalCluster,
) -> None:
    # A long repair interval: no repair round falls between b's stop and its restart.
    a = await cluster.start(repair_interval=30)
    b = await cluster.start(peers=[a], repair_interval=30)
    await cluster.formed([a, b])
    port = b.port
    await cluster.stop(b)
    b2 = await cluster.start(port=port, repair_interval=30)  # no --peers: a must find it
    async with node_client(a.address, timeout=10) as client:
        await client.update_arrays({"from_a": value(1)})  # a's link to b sends: it reconnects
    # Today: a's link is "up" (it reached b2), b2 has no link at all.
    await eventually(lambda: assert_mesh([a, b2]), timeout=BUG_DEADLINE)


async def test_a_member_back_at_a_new_address_under_its_id_is_linked_again(
    cluster: LocalCluster,
) -> None:
    a = await cluster.start()
    b = await cluster.start(peers=[a], node_id="b")
    await cluster.formed([a, b])
    await cluster.stop(b)
    b2 = await cluster.start(peers=[a], node_id="b")  # another port, the same id
    # Today: a keeps one link, to b's old address, in backoff.
    await eventually(lambda: assert_mesh([a, b2]), timeout=BUG_DEADLINE)


# -- 8..10. node processes -------------------------------------------------------------------


async def chain(procs: ProcessCluster) -> list[Any]:
    """Three processes: b seeded with a, c seeded with b; answer once they form a mesh."""
    a = await procs.spawn()
    b = await procs.spawn(peers=[a])
    c = await procs.spawn(peers=[b])
    nodes = [a, b, c]
    await eventually(lambda: assert_mesh_over_wire(nodes), retry_on=RETRY_WIRE)
    return nodes


async def test_processes_formed_with_peers_replicate(procs: ProcessCluster) -> None:
    nodes = await chain(procs)
    async with (
        nodes[0].client() as ca,
        nodes[1].client() as cb,
        nodes[2].client() as cc,
    ):
        clients = [ca, cb, cc]
        assert await cc.update_arrays({"from_c": value(3)}) == {"from_c": 1}
        # Replication is asynchronous: wait until a holds c's write before a writes over it.
        await eventually(lambda: assert_same_wire_states(clients, {"from_c"}), retry_on=RETRY_WIRE)
        assert await ca.update_arrays(
            {"from_a": value(1), "from_c": value(1, 1)}, replace=["from_c"]
        ) == {
            "from_a": 1,
            "from_c": 2,
        }
        state = await eventually(
            lambda: assert_same_wire_states(clients, {"from_a", "from_c"}), retry_on=RETRY_WIRE
        )
    state = by_node_id(state)
    assert state["from_a"] == (1, nodes[0].node_id, value(1).tobytes())
    assert state["from_c"] == (2, nodes[0].node_id, value(1, 1).tobytes())


async def test_a_killed_node_restarted_empty_on_its_port_catches_up(procs: ProcessCluster) -> None:
    a, b, c = await chain(procs)
    async with a.client() as ca, b.client() as cb, c.client() as cc:

        async def up() -> None:  # (a write at a node still joining is applied by another)
            assert (await cc.info()).state == "up"

        await eventually(up, retry_on=RETRY_WIRE)
        await cc.update_arrays({"c0": value(0), "shared": value(0)})
        # (Else c's write could die with it: only c would have held it.)
        await eventually(
            lambda: assert_same_wire_states([ca, cb, cc], {"c0", "shared"}), retry_on=RETRY_WIRE
        )
    c_port, c_id = c.port, c.node_id
    assert await c.kill() == -signal.SIGKILL

    # Writes on a and b, alternating, while c is dead; note what each was answered.
    answered: dict[str, list[tuple[int, str, bytes]]] = {
        "c0": [(1, c_id, value(0).tobytes())],
        "shared": [(1, c_id, value(0).tobytes())],
    }
    async with a.client() as ca, b.client() as cb:
        for i in range(30):
            node, client = (a, ca) if i % 2 else (b, cb)
            name = f"k{i % 8}" if i % 5 else "shared"
            versions = await client.update_arrays({name: value(i)})
            answered.setdefault(name, []).append((versions[name], node.node_id, value(i).tobytes()))

        c2 = await procs.spawn(port=c_port, peers=[a])  # empty, knowing only a
        assert (c2.port, c2.node_id) == (c_port, c_id)
        async with c2.client() as cc2:
            state = await eventually(
                lambda: assert_same_wire_states([ca, cb, cc2], answered), retry_on=RETRY_WIRE
            )
    # Last writer wins: each name holds the largest (version, origin) answered.
    assert by_node_id(state) == {name: max(writes) for name, writes in answered.items()}
    await eventually(lambda: assert_mesh_over_wire([a, b, c2]), retry_on=RETRY_WIRE)


def by_node_id(state: State) -> State:
    """A state with each origin cut to its node id (a process's run is not known here)."""
    return {name: (v, origin.rsplit("@", 1)[0], data) for name, (v, origin, data) in state.items()}


async def _median_update_latency(client: ParameterClient, names: list[str], count: int) -> float:
    times = []
    for i in range(count):
        t0 = time.perf_counter()
        await client.update_arrays({names[i % len(names)]: value(i)})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def test_a_sigstopped_peer_neither_slows_the_others_nor_grows_their_outboxes(
    procs: ProcessCluster,
) -> None:
    a, b, c = await chain(procs)
    names = [f"s{i}" for i in range(5)]
    async with a.client() as ca, b.client() as cb:
        before_a = await _median_update_latency(ca, names, 50)
        before_b = await _median_update_latency(cb, names, 50)

        c.signal(signal.SIGSTOP)
        try:
            during_a = await _median_update_latency(ca, names, 50)
            during_b = await _median_update_latency(cb, names, 50)
            # Keep writing past a repair round (0.5 s): the links to c then
            # wait on c's digest reply, and their outboxes coalesce. Watch
            # those outboxes in info() all along.
            deepest = {a.node_id: 0, b.node_id: 0}
            to_c = {}
            for i in range(20):
                await asyncio.gather(
                    ca.update_arrays({names[i % 5]: value(i)}),
                    cb.update_arrays({names[(i + 2) % 5]: value(i)}),
                )
                for node, client in ((a, ca), (b, cb)):
                    info = await client.info()
                    (p,) = [p for p in info.peers if p.node_id == c.node_id]
                    assert p.outbox_depth <= len(names), p
                    deepest[node.node_id] = max(deepest[node.node_id], p.outbox_depth)
                    to_c[node.node_id] = p
                await asyncio.sleep(0.05)
        finally:
            c.signal(signal.SIGCONT)

        print(
            f"\nmedian update latency (50 small updates each): "
            f"a {before_a * 1e3:.3f} ms before, {during_a * 1e3:.3f} ms during SIGSTOP of c; "
            f"b {before_b * 1e3:.3f} ms before, {during_b * 1e3:.3f} ms during"
        )
        for node_id, p in to_c.items():
            print(
                f"{node_id} -> c while stopped: state {p.state}, outbox {p.outbox_depth} "
                f"(deepest seen {deepest[node_id]}), "
                f"sent {p.updates_sent}, coalesced {p.updates_coalesced}, "
                f"lag {p.lag_seconds:.3f} s"
            )

        async with c.client() as cc:
            await eventually(
                lambda: assert_same_wire_states([ca, cb, cc], names), retry_on=RETRY_WIRE
            )


async def test_a_node_stopped_gracefully_first_sends_its_outboxes(cluster: LocalCluster) -> None:
    # No periodic repair: only the stopping node's outbox can bring b the writes.
    a = await cluster.start(repair_interval=3600)
    b = await cluster.start(peers=[a], repair_interval=3600)
    await cluster.formed([a, b])
    big = np.arange(1 << 19, dtype=np.int64)  # 4 MiB: sending takes a while
    async with node_client(a.address, timeout=30) as client:
        await asyncio.gather(*(client.update_arrays({f"g{i}": big + i}) for i in range(16)))
    expected = {
        name: (e.version, e.origin, bytes(e.data))
        for name in a.table.names()
        if (e := a.table.entry(name))
    }
    await cluster.stop(a)  # at once: its links still hold what they have not sent
    got = {
        name: (e.version, e.origin, bytes(e.data))
        for name in b.table.names()
        if (e := b.table.entry(name))
    }
    assert got == expected


async def test_entries_a_link_takes_back_leave_its_outbox_undrained() -> None:
    # A member's new link takes its old link's outbox (or a failed send puts its
    # batch back): a drain at shutdown must wait for them.
    link = PeerLink(cast(Any, None), "127.0.0.1", 9)  # never started: nothing is sent
    assert link.drained.is_set()
    entry = Entry("w", memoryview(b"x"), 1, None, None, "a@1")
    link.offer([entry], taken_back=True)
    assert link.outbox == {"w": entry}
    assert not link.drained.is_set()


async def test_a_peers_repair_read_is_answered_from_the_store_never_passed_on() -> None:
    """A node's repair asks a peer for what that peer *stores* (``as_stored``): the peer
    answers its own copy, even of a key another node is the primary of (a copy it keeps
    until the hand-off), and never passes the read on. Passed on, it could wait for the
    very node repairing, behind writes that wait for that repair (a joining node folds
    nothing until its repair is done): the cycle a randomized run found."""
    async with watched_cluster(repair_interval=60.0) as nodes:
        nodes.replication_factor = 1
        a = await nodes.start()
        b = await nodes.start(peers=[a])
        await nodes.formed([a, b])
        name = next(f"k{i}" for i in range(1000) if primary_of([a, b], f"k{i}") is a)
        async with node_client(a.address) as client:
            await client.update_arrays({name: np.ones(4, np.float32)})
        # b keeps a copy of its own (as a node keeps a key until its new holder confirms it)
        stale = to_parameter(name, np.zeros(4, np.float32), version=7)
        stale.origin = b.node_id
        await b.store.update([stale], b.store.timestamp, replicated=True)

        async with node_client(b.address) as client:
            passed_on = await client.invoke(
                METHODS.pull_parameters, request=thrift.ParameterRequest(param_names=[name])
            )
            stored = await client.invoke(
                METHODS.pull_parameters,
                request=thrift.ParameterRequest(param_names=[name, "nowhere"], as_stored=True),
            )
        # (a client that knows no topology is answered by the primary, a)
        assert [(p.name, p.version) for p in passed_on.params] == [(name, 1)]
        # (the repair gets what b stores, and nothing of what b lacks)
        assert [(p.name, p.version) for p in stored.params] == [(name, 7)]
        np.testing.assert_array_equal(np.frombuffer(stored.params[0].data, np.float32), 0.0)
        assert b.service.router.passed_on == 1
