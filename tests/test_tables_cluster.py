"""Embedding tables sharded by bucket over node processes: spread, joined, drained, killed.

Every node is a ``python -m aioparamsync`` child process on 127.0.0.1 (killed by PID at
teardown). The rows are pushed with ``sgd(1.0)`` and gradients of ones, so each row's
value is minus the number of pushes that touched it: what every replica must hold is
known exactly. Every wait is a poll bounded by a timeout.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Iterable, Mapping

import numpy as np
import pytest
from cluster_helpers import (
    LocalCluster,
    ProcessCluster,
    eventually,
    placement_of,
    run_process,
    spawn_cluster,
    wait_formed,
)

from aioparamsync import ErrorCode, ParameterClient, sgd
from aioparamsync.errors import CallTimeout, NetworkError, RequestError
from aioparamsync.placement import bucket_key, bucket_of

pytestmark = [pytest.mark.asyncio(loop_factories=["asyncio"]), pytest.mark.timeout(120)]

R = 2
RETRY = (AssertionError, NetworkError, CallTimeout)
SETTLE_TIMEOUT = 45.0
POLL = 0.2
DIM = 8
BUCKETS = 32
IDS = np.unique(np.random.default_rng(0).integers(-(2**40), 2**40, 3000)).astype(np.int64)
LOG_TAIL = 60


@pytest.fixture
async def procs() -> AsyncIterator[ProcessCluster]:
    cluster = ProcessCluster(repair_interval=0.5, replication_factor=str(R))
    try:
        yield cluster
    finally:
        await cluster.close()
        cluster.show_logs(LOG_TAIL)


async def rows_held(clients: Mapping[str, ParameterClient]) -> dict[str, int]:
    return {m: (await c.info()).counters["rows"] for m, c in clients.items()}


async def wait_placed(clients: Mapping[str, ParameterClient], total: int) -> dict[str, int]:
    """Until every node holds the rows of the buckets placement gives it, no more, no less
    (buckets moved, dropped): R copies of every row between them.

    (R copies in all is not enough: while buckets move, a node that held every bucket and
    has not dropped some yet, beside nodes that have pulled theirs, can add up to R too.)
    """
    buckets, counts = np.unique(bucket_of(IDS, BUCKETS), return_counts=True)
    assert total == len(IDS)

    async def check() -> dict[str, int]:
        # (placed as the topology now says: a balance round may claim buckets meanwhile)
        topology = await next(iter(clients.values())).topology()
        placement = placement_of(topology)
        assert sorted(placement.members) == sorted(clients), (placement, sorted(clients))
        placed = dict.fromkeys(placement.members, 0)
        for bucket, count in zip(buckets, counts, strict=True):
            for m in placement.replicas(bucket_key("emb", int(bucket))):
                placed[m] += int(count)
        assert sum(placed.values()) == R * total
        held = await rows_held(clients)
        assert held == placed, f"held {held}, placed {placed}"
        return held

    return await eventually(check, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)


async def assert_rows_everywhere(clients: Iterable[ParameterClient], expected: np.ndarray) -> None:
    """Each node, asked alone (it passes on what it does not hold), answers ``expected``."""
    for client in clients:
        np.testing.assert_array_equal(await client.pull_rows("emb", IDS), expected)


async def push_ones(client: ParameterClient, ids: np.ndarray, **kwargs: object) -> None:
    await client.push_row_gradients("emb", ids, np.ones((len(ids), DIM), np.float32), **kwargs)


async def test_rows_are_spread_over_the_nodes_and_every_node_answers_every_row(
    procs: ProcessCluster,
) -> None:
    nodes = await spawn_cluster(procs, 3)
    async with contextlib.AsyncExitStack() as stack:
        clients = {n.node_id: await stack.enter_async_context(n.client()) for n in nodes}
        await wait_formed(clients)
        routed = await stack.enter_async_context(
            ParameterClient([n.address_text for n in nodes], timeout=15)
        )
        await routed.routes.learn()  # (so that the pushes below are cut by the client)
        assert routed.routes.topology is not None and not routed.routes.topology.single
        await routed.create_table("emb", DIM, rule=sgd(1.0), buckets=BUCKETS)
        await push_ones(routed, IDS)  # cut by bucket primary, client side
        alone = list(clients.values())
        await push_ones(alone[1], IDS[::2].copy())  # cut by the node it reaches
        expected = -np.ones((len(IDS), DIM), np.float32)
        expected[::2] -= 1
        held = await wait_placed(clients, len(IDS))
        # Each node holds its share, not everything: adding nodes adds capacity.
        assert all(0 < h < len(IDS) for h in held.values()), held
        await assert_rows_everywhere([routed, *alone], expected)
        assert (await routed.pull_rows("emb", np.empty(0, np.int64))).shape == (0, DIM)
        # A node asked for a table made before it heard of it learns it from a peer.
        for c in alone:
            assert [t.name for t in await c.tables()] == ["emb"]


async def test_a_joining_node_takes_its_buckets_and_no_row_is_lost(procs: ProcessCluster) -> None:
    nodes = await spawn_cluster(procs, 2)
    async with contextlib.AsyncExitStack() as stack:
        clients = {n.node_id: await stack.enter_async_context(n.client()) for n in nodes}
        await wait_formed(clients)
        client = next(iter(clients.values()))
        await client.create_table("emb", DIM, rule=sgd(1.0), buckets=BUCKETS)
        await push_ones(client, IDS)
        joiner = await procs.spawn(peers=[nodes[0]])
        clients[joiner.node_id] = await stack.enter_async_context(joiner.client())
        await wait_formed(clients)
        await push_ones(client, IDS)  # during the moves, or after
        held = await wait_placed(clients, len(IDS))
        assert held[joiner.node_id] > 0, held
        await assert_rows_everywhere(clients.values(), -2 * np.ones((len(IDS), DIM)))


async def test_a_drained_node_hands_its_rows_off(procs: ProcessCluster) -> None:
    procs.replication_factor = "1"  # (its rows are nowhere else: the hand-off must carry them)
    nodes = await spawn_cluster(procs, 3, ["--drain-timeout", "20"])
    async with contextlib.AsyncExitStack() as stack:
        clients = {n.node_id: await stack.enter_async_context(n.client()) for n in nodes}
        await wait_formed(clients)
        client = clients[nodes[0].node_id]
        await client.create_table("emb", DIM, rule=sgd(1.0), buckets=BUCKETS)
        await push_ones(client, IDS)
        leaver = nodes[2]
        assert (await rows_held({leaver.node_id: clients[leaver.node_id]}))[leaver.node_id] > 0
        await clients.pop(leaver.node_id).close()
        rc, out, err = await run_process(
            sys.executable, "-m", "aioparamsync.ctl", "drain", "--timeout", "40",
            leaver.address_text, timeout=60,
        )  # fmt: skip
        assert rc == 0, f"drain exited {rc}:\n{out}{err}"
        assert await leaver.wait_exit(timeout=30) == 0

        async def handed() -> None:
            held = await rows_held(clients)
            assert sum(held.values()) == len(IDS), held

        await eventually(handed, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)
        await assert_rows_everywhere(clients.values(), -np.ones((len(IDS), DIM)))


async def test_a_node_killed_and_restarted_keeps_every_acknowledged_push(
    procs: ProcessCluster, tmp_path
) -> None:
    dirs = [tmp_path / f"n{i}" for i in range(3)]
    flags = ["--acks", "all", "--fsync", "always", "--failure-timeout", "1.5"]
    first = await procs.spawn(extra=[*flags, "--data-dir", str(dirs[0])])
    rest = [
        await procs.spawn(peers=[first], extra=[*flags, "--data-dir", str(d)]) for d in dirs[1:]
    ]
    nodes = [first, *rest]
    async with contextlib.AsyncExitStack() as stack:
        clients = {n.node_id: await stack.enter_async_context(n.client()) for n in nodes}
        await wait_formed(clients)
        client = clients[first.node_id]
        await client.create_table("emb", DIM, rule=sgd(1.0), buckets=BUCKETS)
        pushes = 3
        for _ in range(pushes):
            await push_ones(client, IDS)
        victim = nodes[2]
        port = victim.address[1]
        await clients.pop(victim.node_id).close()
        await victim.kill()  # SIGKILL: nothing written at the end
        # The survivors take over; a push is acknowledged again once they have.
        # (tried again under one request id: a part folded by a try is not folded again)
        await eventually(
            lambda: push_ones(client, IDS, request_id="after-the-kill"),
            timeout=SETTLE_TIMEOUT, interval=0.5, retry_on=(*RETRY, RequestError),
        )  # fmt: skip
        pushes += 1
        back = await procs.spawn(
            peers=[first], port=port, extra=[*flags, "--data-dir", str(dirs[2])]
        )
        clients[back.node_id] = await stack.enter_async_context(back.client())
        await wait_formed(clients)
        await wait_placed(clients, len(IDS))
        await assert_rows_everywhere(clients.values(), -pushes * np.ones((len(IDS), DIM)))


async def test_a_leaving_node_takes_no_rows_handed_to_it_but_its_primaries_replication() -> None:
    """A member whose view is behind may take a leaving node for a bucket's holder still
    and hand the bucket to it, after the leaving node handed it on: were it taken, both
    would drop it. A leaving node refuses rows handed to it (nothing kept), and keeps
    those the bucket's primary replicates to it (it serves them until it has gone)."""
    from aioparamsync.placement import LEAVING
    from aioparamsync.values.rowwire import encode_ids
    from aioparamsync.wire import METHODS

    local = LocalCluster(replication_factor=1)
    try:
        a = await local.start()
        b = await local.start(peers=[a])
        await local.formed([a, b])
        async with ParameterClient(a.address, timeout=10) as client:
            await client.create_table("emb", 4, rule=sgd(1.0), buckets=BUCKETS)
            await client.push_row_gradients("emb", IDS, np.ones((len(IDS), 4), np.float32))
        table_a = a.service.rows.tables.tables["emb"]
        table_b = b.service.rows.tables.tables["emb"]
        placement, live = b.cluster.placement, b.cluster.live
        primary = {k: placement.primary(bucket_key("emb", k), live) for k in range(BUCKETS)}
        at_a = next(k for k in range(BUCKETS) if primary[k] == a.node_id and k in table_a.blocks)
        at_b = next(k for k in range(BUCKETS) if primary[k] == b.node_id and k in table_b.blocks)
        before = bytes(table_b.delta(at_b, None, b.node_id).rows)
        b.cluster.set_state(LEAVING)
        # Rows of a bucket b is the primary of, handed to it by a (newer: kept, if taken).
        handed = table_b.delta(at_b, None, a.node_id)
        handed.versions = encode_ids(np.frombuffer(handed.versions, "<i8") + 5)
        handed.rows = np.full(len(handed.rows) // 4, 42.0, "<f4").tobytes()
        async with ParameterClient(b.address, timeout=10, route=False) as there:
            with pytest.raises(RequestError) as info:
                await there.invoke(METHODS.replicate_rows, deltas=[handed])
            assert info.value.code == ErrorCode.UNAVAILABLE and "leaving" in info.value.message
            assert bytes(table_b.delta(at_b, None, b.node_id).rows) == before
            replicated = table_a.delta(at_a, None, a.node_id)  # (from its primary: kept)
            kept = await there.invoke(METHODS.replicate_rows, deltas=[replicated])
        assert kept == len(table_a.blocks[at_a]) == len(table_b.blocks[at_a])
    finally:
        await local.close()
