"""Sharding inside one process: who holds what, routing, passing on, acks, hand-off, memory.

Real nodes on loopback (``LocalCluster``), real clients; the tests with node
processes (kills, joins, drains, partitions) are in ``test_sharding.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from typing import Any

import numpy as np
import pytest
from cluster_helpers import CONVERGE_TIMEOUT, LocalCluster, assert_, eventually, free_port

from aioparamsync import ErrorCode, Node, ParameterClient, RequestError, sgd, sum_rule, thrift
from aioparamsync.client.routing import CHANGING_REFRESH_SECONDS, REFRESH_SECONDS, Topology
from aioparamsync.placement import Placement, barrier_key

pytestmark = pytest.mark.asyncio

R = 2
NAMES = [f"p{i}" for i in range(40)]


def arrays(offset: float = 0.0) -> dict[str, np.ndarray]:
    return {n: np.full(256, i + offset, np.float32) for i, n in enumerate(NAMES)}


@pytest.fixture
async def sharded() -> Any:
    cluster = LocalCluster(replication_factor=R)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        c = await cluster.start(peers=[a])
        nodes = [a, b, c]

        def formed() -> None:
            for node in nodes:
                assert node.cluster.state == "up"
                assert node.cluster.live == {n.node_id for n in nodes}, node.cluster.live

        await eventually(formed)
        yield nodes
    finally:
        await cluster.close()


def holders(nodes: list[Node], name: str) -> set[str]:
    return {n.node_id for n in nodes if name in n.table}


async def test_each_name_is_held_by_its_r_replicas_alone(sharded: list[Node]) -> None:
    nodes = sharded
    async with ParameterClient(nodes[0].address, timeout=10) as client:
        await client.update_arrays(arrays())
    placement = Placement([n.node_id for n in nodes], R)

    def placed() -> None:
        for name in NAMES:
            assert holders(nodes, name) == set(placement.replicas(name)), name

    await eventually(placed)
    # 40 keys, 2 copies over 3 nodes: each holds about 2/3 of them, not all.
    assert sum(len(n.table) for n in nodes) == R * len(NAMES)
    assert all(len(n.table) < len(NAMES) for n in nodes)


async def test_a_routed_client_sends_each_name_to_its_primary(sharded: list[Node]) -> None:
    nodes = sharded
    async with ParameterClient(nodes[0].address, timeout=10) as client:
        await client.update_arrays(arrays())  # (before the topology is known: passed on)
        await eventually(lambda: assert_routed(client))
        before = [n.service.router.passed_on for n in nodes]
        await client.update_arrays(arrays(1))
        got = await client.get_arrays(NAMES)
        assert all((got[n] == v).all() for n, v in arrays(1).items())
        # Routed: no node had to pass anything on.
        assert [n.service.router.passed_on for n in nodes] == before


def assert_routed(client: ParameterClient) -> None:
    assert client.routes is not None and client.routes.topology is not None
    assert not client.routes.topology.single


async def test_every_node_answers_every_name_for_a_client_that_knows_no_topology(
    sharded: list[Node],
) -> None:
    nodes = sharded
    async with ParameterClient(nodes[1].address, timeout=10) as writer:
        await writer.update_arrays(arrays(), acks="all")
    for node in nodes:
        async with ParameterClient(node.address, timeout=10, route=False) as client:
            got = await client.get_arrays(NAMES)
            assert set(got) == set(NAMES), node.node_id
            assert all((got[n] == v).all() for n, v in arrays().items())
            # A write through any node reaches each name's holders.
            await client.update_arrays({"x": np.arange(3.0)})
            response = await client.get_parameters(None)  # every name, from every holder
            assert {p.name for p in response.params} == {*NAMES, "x"}
    assert holders(nodes, "x") == set(Placement([n.node_id for n in nodes], R).replicas("x"))


async def test_a_routed_request_for_a_name_a_node_does_not_hold_is_answered_moved(
    sharded: list[Node],
) -> None:
    nodes = sharded
    placement = Placement([n.node_id for n in nodes], R)
    name = next(n for n in NAMES if nodes[0].node_id not in placement.replicas(n))
    async with ParameterClient(nodes[0].address, timeout=10, route=False) as client:
        request = thrift.ParameterRequest(param_names=[name], epoch=1)
        with pytest.raises(RequestError) as info:
            await client.call("pull_parameters", request=request)
        assert info.value.code == ErrorCode.MOVED
        assert info.value.epoch == nodes[0].cluster.epoch
        assert nodes[0].node_id in info.value.message
        update = thrift.ParameterUpdate(
            params=[thrift.Parameter(name=name, data=b"1234")], timestamp=1, epoch=1
        )
        with pytest.raises(RequestError) as info:
            await client.call("push_parameters", update=update)
        assert info.value.code == ErrorCode.MOVED
    assert name not in nodes[0].table  # (nothing applied)


async def test_acks_all_answers_once_every_live_replica_holds_the_write(
    sharded: list[Node],
) -> None:
    nodes = sharded
    async with ParameterClient(nodes[0].address, timeout=10) as client:
        for step in range(20):  # (the first ones passed on, the others routed)
            await client.update_arrays(
                {n: np.full(4, step, np.float32) for n in NAMES[:5]}, acks="all"
            )
            for name in NAMES[:5]:
                for node in nodes:
                    entry = node.table.entry(name)
                    if entry is not None:
                        assert entry.version == step + 1, (node.node_id, name)
                assert len(holders(nodes, name)) == R


async def test_acks_other_than_1_or_all_are_refused(sharded: list[Node]) -> None:
    async with ParameterClient(sharded[0].address, timeout=10, route=False) as client:
        with pytest.raises(ValueError, match="acks"):
            await client.update_arrays({"w": np.ones(2)}, acks="2")
        update = thrift.ParameterUpdate(
            params=[thrift.Parameter(name="w", data=b"12345678")], timestamp=1, acks="most"
        )
        with pytest.raises(RequestError) as info:
            await client.call("push_parameters", update=update)
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert "most" in info.value.message
        assert all("w" not in n.table for n in sharded)


async def test_gradients_pushed_at_every_node_fold_once_each_at_the_primary(
    sharded: list[Node],
) -> None:
    nodes = sharded
    names = NAMES[:6]
    async with ParameterClient(nodes[0].address, timeout=10) as client:
        await client.update_arrays(
            {n: np.zeros(8, np.float32) for n in names}, rules=sum_rule(), acks="all"
        )
    clients = [ParameterClient(n.address, timeout=10, route=False) for n in nodes]
    try:
        pushes = 10
        await asyncio.gather(
            *(
                c.push_gradients({n: np.ones(8, np.float32) for n in names})
                for c in clients
                for _ in range(pushes)
            )
        )
        got = await clients[0].get_arrays(names)
        assert all((got[n] == pushes * len(clients)).all() for n in names), got
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_a_barrier_is_held_by_the_primary_of_its_group_whichever_node_is_asked(
    sharded: list[Node],
) -> None:
    nodes = sharded
    clients = [ParameterClient(n.address, timeout=10, route=False) for n in nodes]
    try:
        results = await asyncio.gather(
            *(c.barrier("g", f"w{i}", 1, len(clients)) for i, c in enumerate(clients))
        )
        assert all(sorted(r.workers) == ["w0", "w1", "w2"] for r in results)
        primary = Placement([n.node_id for n in nodes], R).primary(
            barrier_key("g"), {n.node_id for n in nodes}
        )
        holder = next(n for n in nodes if n.node_id == primary)
        assert holder.service.waiting.statistics()["barrier_groups"] == 1
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_a_node_that_leaves_hands_its_keys_off_before_it_stops() -> None:
    cluster = LocalCluster(replication_factor=R)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        c = await cluster.start(peers=[a])
        await eventually(lambda: _all_up([a, b, c]))
        async with ParameterClient(a.address, timeout=10) as client:
            await client.update_arrays(arrays(), acks="all")
        held = len(c.table)
        assert 0 < held < len(NAMES)
        assert await c.leave(timeout=10) == held
        await cluster.stop(c)

        def rehomed() -> None:
            for name in NAMES:
                assert holders([a, b], name) == {a.node_id, b.node_id}, name

        await eventually(rehomed)
        async with ParameterClient(a.address, timeout=10) as client:
            got = await client.get_arrays(NAMES)
        assert all((got[n] == v).all() for n, v in arrays().items())
    finally:
        await cluster.close()


async def test_a_node_that_joins_pulls_its_share_and_the_old_holders_drop_it() -> None:
    cluster = LocalCluster(replication_factor=1)
    try:
        a = await cluster.start()
        async with ParameterClient(a.address, timeout=10) as client:
            await client.update_arrays(arrays())
        assert len(a.table) == len(NAMES)
        b = await cluster.start(peers=[a])
        placement = Placement([a.node_id, b.node_id], 1)
        mine = {n for n in NAMES if placement.replicas(n) == (b.node_id,)}
        assert mine  # (40 names, 2 nodes: some are b's)

        def moved() -> None:
            assert b.cluster.state == "up"
            assert set(b.table.names()) == mine
            assert set(a.table.names()) == set(NAMES) - mine

        await eventually(moved)
        for node in (a, b):
            async with ParameterClient(node.address, timeout=10, route=False) as client:
                got = await client.get_arrays(NAMES)
            assert all((got[n] == v).all() for n, v in arrays().items())
    finally:
        await cluster.close()


def _all_up(nodes: list[Node]) -> None:
    for node in nodes:
        assert node.cluster.state == "up"
        assert node.cluster.live == {n.node_id for n in nodes}


async def test_digest_for_refuses_a_node_outside_its_members(sharded: list[Node]) -> None:
    async with ParameterClient(sharded[0].address, timeout=10, route=False) as client:
        request = thrift.DigestRequest(for_node="nobody", members=["a", "b"])
        with pytest.raises(RequestError) as info:
            await client.call("digest_for", request=request)
        assert info.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(RequestError):
            await client.call("digest_for", request=None)


async def test_a_hand_off_is_answered_only_the_keys_the_node_will_hold() -> None:
    """A member whose view is behind may hand a key to a node that no longer holds it
    (it is leaving, and handed the key on already; a claim took it): were it answered
    that the node holds the key, both would drop it. Asked by a hand-off, a node answers
    only the keys it will hold by its own view, and none while it leaves; asked by
    anything else, every key named that it holds."""
    from aioparamsync.placement import LEAVING
    from aioparamsync.values.arrays import to_parameter

    cluster = LocalCluster(repair_interval=60.0, replication_factor=1)  # (no rounds)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await cluster.formed([a, b])
        live = {a.node_id, b.node_id}
        name = next(n for n in NAMES if a.cluster.placement.primary(n, live) == a.node_id)
        async with ParameterClient(a.address, timeout=10) as client:
            await client.update_arrays({name: np.ones(4, np.float32)})
        # b keeps a copy too (as a node keeps a key until its new holders confirm it)
        copy = to_parameter(name, np.ones(4, np.float32), version=1)
        copy.origin = a.table.entry(name).origin
        await b.store.update([copy], b.store.timestamp, replicated=True)

        async def answered(node: Node, handing: bool | None) -> list[tuple[str, int]]:
            request = thrift.DigestRequest(names=[name, "nowhere"], handing=handing)
            async with ParameterClient(node.address, timeout=10, route=False) as there:
                digest = await there.call("digest_for", request=request)
            return [(d.name, d.version) for d in digest]

        assert await answered(a, True) == [(name, 1)]  # (its primary)
        for handing in (None, False):
            assert await answered(b, handing) == [(name, 1)]
        assert await answered(b, True) == []  # (no replica of it, by its view)
        a.cluster.set_state(LEAVING)
        assert await answered(a, True) == []
        assert await answered(a, None) == [(name, 1)]
    finally:
        await cluster.close()


async def test_lift_raises_the_keys_a_node_is_the_primary_of_and_replicates_them(
    sharded: list[Node],
) -> None:
    nodes = sharded
    by_id = {n.node_id: n for n in nodes}
    async with ParameterClient(nodes[0].address, timeout=10) as client:
        await client.update_arrays(arrays())
        live = {n.node_id for n in nodes}
        placement = nodes[0].cluster.placement
        name = NAMES[0]
        primary = by_id[placement.primary(name, live)]
        other = next(n for n in nodes if n is not primary)
        before = primary.table.entry(name)
        assert before is not None and before.version == 1
        async with ParameterClient(other.address, timeout=10, route=False) as there:
            # Not its primary: left as it is (its answer says so).
            digest = await there.call("lift", request=thrift.LiftRequest(floors={name: 7}))
            assert [(d.name, d.version) for d in digest if d.name == name] in ([], [(name, 1)])
        async with ParameterClient(primary.address, timeout=10, route=False) as there:
            floors = {name: 7, NAMES[1]: 1, "nowhere": 3}
            digest = await there.call("lift", request=thrift.LiftRequest(floors=floors))
        answered = {d.name: d.version for d in digest}
        assert answered[name] == 7 and "nowhere" not in answered
        after = primary.table.entry(name)
        assert after is not None and after.version == 7
        assert after.origin == primary.table.origin  # (the primary's own write)
        assert np.array_equal(after.array, before.array)  # (its value kept)

        def replicated() -> None:
            for node in nodes:
                if name in node.table:
                    assert node.table.entry(name).version == 7, node.node_id  # type: ignore[union-attr]

        await eventually(replicated)
        got = await client.get_parameters([name])
        assert got.params[0].version == 7
        # A floor at or below the version: nothing changes.
        async with ParameterClient(primary.address, timeout=10, route=False) as there:
            digest = await there.call("lift", request=thrift.LiftRequest(floors={name: 3}))
        assert [d.version for d in digest] == [7]


async def test_lift_refuses_what_does_not_hold_together(sharded: list[Node]) -> None:
    async with ParameterClient(sharded[0].address, timeout=10, route=False) as client:
        for request in (None, thrift.LiftRequest(), thrift.LiftRequest(floors={"p0": 0})):
            with pytest.raises(RequestError) as info:
                await client.call("lift", request=request)
            assert info.value.code == ErrorCode.BAD_REQUEST, request
        many = {f"k{i}": 2 for i in range(100_001)}
        with pytest.raises(RequestError) as info:
            await client.call("lift", request=thrift.LiftRequest(floors=many))
        assert info.value.code == ErrorCode.LIMIT_EXCEEDED


async def test_the_topology_names_every_member_its_state_and_r(sharded: list[Node]) -> None:
    async with ParameterClient(sharded[0].address, timeout=10) as client:
        topology = await client.topology()
        info = await client.info()
    assert topology.replication_factor == R
    assert {(m.node_id, m.state) for m in topology.members} == {(n.node_id, "up") for n in sharded}
    assert topology.epoch == sharded[0].cluster.epoch
    assert info.topology.epoch >= topology.epoch
    assert info.state == "up"
    assert info.keys_moving == 0


async def test_a_client_that_learned_a_member_joining_soon_routes_to_it_once_up() -> None:
    """A node that joined holds its share, but a call routed by the topology before
    (the member joining) is still served where it is sent, from what that node holds
    (every key is on every node here): no MOVED tells the client. It asks for the
    topology again soon (not after the 30 s of a steady one), so it finds the member."""
    cluster = LocalCluster(replication_factor=3)
    try:
        a = await cluster.start()
        nodes = [a, await cluster.start(peers=[a]), await cluster.start(peers=[a])]

        def formed() -> None:
            for node in nodes:
                assert node.cluster.state == "up"
                assert node.cluster.live == {n.node_id for n in nodes}, node.cluster.live

        await eventually(formed)
        async with ParameterClient(a.address, timeout=10) as client:
            await client.update_arrays(arrays())
            await eventually(lambda: assert_routed(client))
            routes = client.routes
            assert routes is not None
            # What the client learns while the third node is joining.
            joining = nodes[2].node_id
            answer = await client.topology()
            for member in answer.members:
                if member.node_id == joining:
                    member.state = "joining"
            routes.topology = Topology(answer)
            routes._learned_at = time.monotonic()
            assert joining not in routes.topology.live
            learned = routes.refreshes
            started = time.monotonic()

            async def routes_to_it() -> None:
                got = await client.get_arrays(NAMES)  # served, from a and b
                assert all((got[n] == v).all() for n, v in arrays().items())
                assert routes.topology is not None and joining in routes.topology.live

            await eventually(routes_to_it)
            assert routes.refreshes == learned + 1
            assert time.monotonic() - started < CHANGING_REFRESH_SECONDS + 5
            # Steady again: the next refresh is the steady one's.
            assert routes.topology.refresh_after == REFRESH_SECONDS
    finally:
        await cluster.close()


async def test_a_node_alone_answers_a_topology_of_itself() -> None:
    async with Node(port=0) as node, ParameterClient(node.address, timeout=10) as client:
        topology = await client.topology()
        assert [(m.node_id, m.state) for m in topology.members] == [(node.node_id, "up")]


async def test_a_parameter_kept_from_a_larger_frame_does_not_keep_the_frame_alive() -> None:
    """A node keeps each parameter of a batch on its own: replacing four of five values
    frees their bytes (a view into the frame would keep all five alive)."""
    mib = 1024 * 1024
    # (every parameter whole: this is about how an entry keeps the frame it came in)
    async with (
        Node(port=0, partition_bytes=0) as node,
        ParameterClient(node.address, timeout=30) as client,
    ):
        await client.update_arrays({f"v{i}": np.full(mib, i, np.uint8) for i in range(5)})
        for i in range(5):
            data = node.table.entry(f"v{i}").data
            whole = memoryview(data.obj).nbytes if data.obj is not None else data.nbytes
            assert whole <= data.nbytes * 4 // 3, (i, whole)
        # One value alone in its frame is kept as received, without a copy.
        await client.update_arrays({"big": np.zeros(4 * mib, np.uint8)})
        data = node.table.entry("big").data
        assert memoryview(data.obj).nbytes < data.nbytes + 4096


async def test_a_node_logs_what_it_holds_and_after_a_restart_catches_up_the_rest(
    tmp_path: Any,
) -> None:
    cluster = LocalCluster(replication_factor=R)
    data = tmp_path / "a"
    try:
        a = await cluster.start(data_dir=data)
        port = a.port
        async with ParameterClient(a.address, timeout=10) as client:
            await client.update_arrays(arrays())  # a alone: it holds every key
        b = await cluster.start(peers=[a])
        c = await cluster.start(peers=[a])
        placement = Placement([a.node_id, b.node_id, c.node_id], R)
        share = {n for n in NAMES if a.node_id in placement.replicas(n)}

        def handed_off() -> None:
            _all_up([a, b, c])
            assert set(a.table.names()) == share
            assert a.cluster.rebalancer.moving == 0

        await eventually(handed_off)
        await cluster.stop(a)  # (not a leave: it is to come back)
        async with ParameterClient(b.address, timeout=10, route=False) as client:
            await client.update_arrays(arrays(100))  # each key has a live replica
        a = await cluster.start(data_dir=data, port=port, peers=[b])
        # Its files hold its share alone (what it handed off was dropped from them) ...
        assert set(a.table.names()) == share
        # ... at the versions it had; it catches up on what was written while it was away.

        def caught_up() -> None:
            _all_up([a, b, c])
            assert set(a.table.names()) == share
            for name in share:
                assert bytes(a.table.entry(name).data) == arrays(100)[name].tobytes(), name

        await eventually(caught_up)
    finally:
        await cluster.close()


async def _second_node_leaves(cluster: LocalCluster) -> asyncio.Task:
    """Start the second node's leave (its start may not have returned yet); answer its
    task once the first node is at a newer epoch."""
    first = cluster.running[0]
    epoch = first.cluster.epoch

    def started() -> None:
        assert len(cluster.running) == 2

    await eventually(started)
    task = asyncio.ensure_future(cluster.stop(cluster.running[1], leave=True))

    def newer() -> None:
        assert first.cluster.epoch != epoch

    await eventually(newer)
    return task


def _noting(one_round: Any, leaving: list[asyncio.Task], ended: asyncio.Event) -> Any:
    """``one_round`` that sets ``ended`` once a round in which the leave began has ended."""

    async def noted() -> int:
        answer = await one_round()
        if leaving:
            ended.set()
        return answer

    return noted


async def test_a_hand_off_that_sees_a_newer_epoch_drops_nothing_and_loses_nothing() -> None:
    """a holds every key when b joins (R=1) and hands b its share; while b confirms,
    b starts to leave (a newer epoch, in which a holds every key again). The round
    drops nothing (what b confirmed was for the placement before); b hands all back."""
    cluster = LocalCluster(replication_factor=1)
    try:
        a = await cluster.start()
        async with ParameterClient(a.address, timeout=10) as client:
            await client.update_arrays(arrays())
        rebalancer = a.cluster.rebalancer
        hand_to, drop, one_round = rebalancer._hand_to, a.cluster.store.drop, rebalancer.round
        leaving: list[asyncio.Task] = []
        ended = asyncio.Event()  # the round in which b started to leave has ended
        wrong: list[str] = []  # names a dropped while the placement gives them to it

        async def hand_to_then_b_leaves(link: Any, entries: Any) -> set[str]:
            held = await hand_to(link, entries)
            if held and not leaving:
                leaving.append(await _second_node_leaves(cluster))
            return held

        async def checked_drop(held: Any) -> int:
            after = a.cluster.pending or a.cluster.placement
            wrong.extend(n for n in held if after.holds(a.node_id, n))
            return await drop(held)

        rebalancer._hand_to = hand_to_then_b_leaves  # type: ignore[method-assign]
        rebalancer.round = _noting(one_round, leaving, ended)  # type: ignore[method-assign]
        a.cluster.store.drop = checked_drop  # type: ignore[method-assign]
        await cluster.start(peers=[a])
        async with asyncio.timeout(CONVERGE_TIMEOUT):
            await ended.wait()
        assert rebalancer.aborted == 1
        assert not wrong, f"dropped while placed here: {sorted(wrong)}"

        def left() -> None:
            assert leaving and leaving[0].done()

        await eventually(left)
        await leaving[0]

        def all_back() -> None:
            assert a.cluster.live == {a.node_id}
            assert set(a.table.names()) == set(NAMES)
            for name, array in arrays().items():
                assert bytes(a.table.entry(name).data) == array.tobytes(), name

        await eventually(all_back)
        assert not wrong, f"dropped while placed here: {sorted(wrong)}"
    finally:
        await cluster.close()


async def test_a_bucket_hand_off_that_sees_a_newer_epoch_keeps_the_bucket() -> None:
    """The same for an embedding table's buckets: a handed one bucket to b when b
    starts to leave; a keeps that bucket (the very block: it was not dropped and
    handed back), and every row is on a once b has left."""
    cluster = LocalCluster(replication_factor=1)
    try:
        a = await cluster.start()
        ids = np.arange(2000, dtype=np.int64)
        async with ParameterClient(a.address, timeout=10) as client:
            await client.create_table("emb", 4, rule=sgd(1.0), buckets=16)
            await client.push_row_gradients("emb", ids, np.ones((len(ids), 4), np.float32))
        rows = a.service.rows
        table = rows.tables.tables["emb"]
        blocks = dict(table.blocks)  # bucket -> its block, before b joins
        assert len(blocks) == 16
        moves, hooks = rows.moves, a.cluster.rebalancer.hooks
        hand_off, rebalance = moves._hand_off, hooks[hooks.index(moves.round)]
        leaving: list[asyncio.Task] = []
        handed: list[int] = []  # the bucket handed off when b started to leave
        ended = asyncio.Event()

        async def hand_off_then_b_leaves(table: Any, bucket: int, holders: Any) -> bool:
            ok = await hand_off(table, bucket, holders)
            if ok and not leaving:
                handed.append(bucket)
                leaving.append(await _second_node_leaves(cluster))
            return ok

        moves._hand_off = hand_off_then_b_leaves  # type: ignore[method-assign]
        hooks[hooks.index(moves.round)] = _noting(rebalance, leaving, ended)
        await cluster.start(peers=[a])
        async with asyncio.timeout(CONVERGE_TIMEOUT):
            await ended.wait()
        assert table.blocks.get(handed[0]) is blocks[handed[0]]

        def all_back() -> None:
            assert leaving and leaving[0].done()
            assert a.cluster.live == {a.node_id}
            assert sorted(table.blocks) == sorted(blocks)

        await eventually(all_back)
        await leaving[0]
        async with ParameterClient(a.address, timeout=10) as client:
            pulled = await client.pull_rows("emb", ids)
        np.testing.assert_array_equal(pulled, np.full((len(ids), 4), -1.0, np.float32))
    finally:
        await cluster.close()


async def test_a_write_no_live_replica_can_take_is_refused_and_applies_nothing() -> None:
    cluster = LocalCluster(replication_factor=1)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await eventually(lambda: _all_up([a, b]))
        placement = Placement([a.node_id, b.node_id], 1)
        name = next(n for n in NAMES if placement.replicas(n) == (b.node_id,))
        await cluster.stop(b)  # down (its failure timeout, 30 s, has not passed)
        async with ParameterClient(a.address, timeout=10, route=False) as client:
            with pytest.raises(RequestError) as info:
                await client.update_arrays({name: np.ones(3), "other": np.ones(3)})
        assert info.value.code == ErrorCode.UNAVAILABLE
        assert b.node_id in info.value.message
        assert name not in a.table
    finally:
        await cluster.close()


# -- where reads go ------------------------------------------------------------------------


async def _bytes_out(nodes: list[Node]) -> dict[str, int]:
    return {n.node_id: n.server.counters["bytes_out"] for n in nodes}


@pytest.mark.parametrize("acks", ["1", "all"])
async def test_reads_spread_over_the_replicas_by_default_where_writes_wait_for_every_one(
    acks: str,
) -> None:
    cluster = LocalCluster(replication_factor=R)
    try:
        a = await cluster.start(acks=acks)
        nodes = [
            a,
            await cluster.start(peers=[a], acks=acks),
            await cluster.start(peers=[a], acks=acks),
        ]
        await cluster.formed(nodes)
        ids = sorted(n.node_id for n in nodes)
        placement = Placement(ids, R)
        live = frozenset(ids)
        # 20 names whose primary is node a: read from their primary alone, only a answers
        names = [
            n for n in (f"q{i}" for i in range(400)) if placement.primary(n, live) == a.node_id
        ]
        names = names[:20]
        value = np.zeros(64 * 1024, np.float32)  # 256 KiB each
        async with ParameterClient(a.address, timeout=10) as client:
            assert (await client.topology()).acks == acks
            await client.update_arrays({n: value for n in names})
            await client.get_arrays(names)  # (the topology known: routed from here on)
            before = await _bytes_out(nodes)
            for _ in range(3):
                got = await client.get_arrays(names)
                assert set(got) == set(names)
            after = await _bytes_out(nodes)
        others = sum(after[n.node_id] - before[n.node_id] for n in nodes if n is not a)
        if acks == "all":
            # (each name read from one of its 2 replicas, chosen by the client's own hash)
            assert others > 256 * 1024, (before, after)
        else:
            assert others < 64 * 1024, (before, after)
    finally:
        await cluster.close()


async def test_a_replica_behind_is_not_read_past_what_the_client_wrote() -> None:
    """A read from a replica that has not yet received this client's write is read
    again from the primary: the client reads its own writes, and never older."""
    throttle = _load_throttle()
    cluster = LocalCluster(replication_factor=R)
    try:
        a = await cluster.start()
        # (everything sent to b, from a or from the client, crosses a slow link of its own:
        # 2 MiB of replication takes ~2 s, a read of a few bytes is answered at once)
        async with contextlib.AsyncExitStack() as stack:
            for attempt in range(5):  # (the free port may be taken before b binds it)
                port = free_port()
                link = throttle.Throttle(("127.0.0.1", port), mbit=8, rtt_ms=0)
                await link.__aenter__()
                try:
                    b = await cluster.start(peers=[a], port=port, advertise=link.address)
                except OSError as exc:
                    await link.__aexit__(None, None, None)
                    if exc.errno != errno.EADDRINUSE or attempt == 4:
                        raise
                    continue
                stack.push_async_exit(link.__aexit__)
                break
            ids = {a.node_id, b.node_id}
            await eventually(lambda: assert_(a.cluster.live == b.cluster.live == ids))
            async with ParameterClient(a.address, timeout=30, read_from="any") as client:
                await client.topology()
                routes = client.routes
                assert routes is not None
                await routes.learn()
                # a name whose primary is a, and which this client reads from b
                name = next(
                    n
                    for n in (f"r{i}" for i in range(1000))
                    if Placement(ids, R).primary(n, frozenset(ids)) == a.node_id
                    and routes.target(n, "any") == b.node_id
                )
                big = np.arange(512 * 1024, dtype=np.float32)  # 2 MiB
                await client.update_arrays({name: np.zeros_like(big)})
                await eventually(lambda: assert_(b.table.entry(name) is not None), timeout=30)
                (version,) = (await client.update_arrays({name: big})).values()
                assert b.table.entry(name).version < version  # (still on its way to b)
                got = await client.get_parameters([name])
                assert [p.version for p in got.params] == [version]
                np.testing.assert_array_equal((await client.get_arrays([name]))[name], big)
                assert routes.reread >= 1
                # once b has it, b answers it
                await eventually(
                    lambda: assert_(b.table.entry(name).version == version), timeout=30
                )
                reread = routes.reread
                np.testing.assert_array_equal((await client.get_arrays([name]))[name], big)
                assert routes.reread == reread
    finally:
        await cluster.close()


def _load_throttle() -> Any:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "throttle.py"
    spec = importlib.util.spec_from_file_location("throttle", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("throttle", module)
    spec.loader.exec_module(module)
    return module


async def test_a_read_without_rules_is_answered_so_routed_and_passed_on(
    sharded: list[Node],
) -> None:
    nodes = sharded
    async with ParameterClient(nodes[0].address, timeout=10) as writer:
        await writer.update_arrays(arrays(), rules=sgd(0.25), acks="all")
        await eventually(lambda: assert_routed(writer))
        for route in (True, False):  # (routed; passed on by the node asked)
            async with ParameterClient(nodes[1].address, timeout=10, route=route) as reader:
                without = await reader.get_parameters(NAMES, rules=False)
                assert sorted(p.name for p in without.params) == sorted(NAMES)
                assert all(p.rule is None for p in without.params), route
                full = await reader.get_parameters(NAMES)
                assert all(p.rule == sgd(0.25) for p in full.params), route
                assert {p.name: bytes(p.data) for p in without.params} == {
                    p.name: bytes(p.data) for p in full.params
                }
