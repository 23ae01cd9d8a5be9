"""Concurrent writers at different nodes: every write kind, exact sums, no error, in a bound.

The scenario, deterministic: a cluster of node processes (N nodes, R, ``--acks``), one client
per node, each given that node's address alone (``route=False``: that node passes on what it
does not hold; or routed, new, so that its first calls go out before it has the topology),
and each client makes ``CALLS`` calls of one write kind at once, all of them at the same keys:
whole updates (``update_arrays``), gradient pushes of ones into ``sum`` and ``sgd``
parameters (``push_gradients``; in blocks, ``GradientPush.packed``, where the client is not
routed), row gradients of ones into an ``sgd`` table
(``push_row_gradients``). Every call must be answered ok within ``BOUND``; then the primaries
(a routed read) and every replica (each node alone, once replication has caught up) hold
exactly what was written: the sums of every push, one fold each, and for whole updates one
version per update.

One cluster per (N, R, acks) serves its tests (module-scoped, on one loop: asyncio's own);
each test writes keys of its own. The configurations cover 3 and 5 nodes, R 2 and 3, acks 1
and all, each once with the other values.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from cluster_helpers import (
    RETRY_WIRE,
    NodeProcess,
    ProcessCluster,
    eventually,
    spawn_cluster,
    wait_formed,
)

from aioparamsync import CallTimeout, ParameterClient, sgd, sum_rule
from aioparamsync.placement import bucket_key

KEYS = 24  # parameters (and rows) every call writes
ELEMENTS = 8  # float32 values each
CALLS = 20  # calls each client makes at once
BOUND = 8.0  # every call of a test is answered within this (seconds): no hang
SETTLE = 20.0  # the longest the replicas take to catch up (seconds; --acks 1 lags)
LR = 0.5  # the sgd rule's: -0.5 a fold of ones, exactly in float32
BUCKETS = 16
POLL = 0.2


@dataclass(frozen=True)
class Config:
    nodes: int
    replication: int
    acks: str

    def __str__(self) -> str:
        return f"{self.nodes}nodes-R{self.replication}-acks{self.acks}"


CONFIGS = [Config(3, 2, "all"), Config(3, 3, "1"), Config(5, 2, "1"), Config(5, 3, "all")]
KINDS = ["update_arrays", "push_gradients-sum", "push_gradients-sgd", "push_row_gradients"]
MODES = ["pinned", "routed"]

pytestmark = [
    pytest.mark.asyncio(loop_scope="module", loop_factories=["asyncio"]),
    pytest.mark.timeout(120),
]


@dataclass
class Cluster:
    config: Config
    nodes: list[NodeProcess]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=CONFIGS, ids=str)
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    config: Config = request.param
    procs = ProcessCluster(repair_interval=0.5, replication_factor=str(config.replication))
    try:
        nodes = await spawn_cluster(procs, config.nodes, ["--acks", config.acks])
        async with contextlib.AsyncExitStack() as stack:
            clients = {n.node_id: await stack.enter_async_context(n.client()) for n in nodes}
            await wait_formed(clients)
        yield Cluster(config, nodes)
    finally:
        await procs.close()
        procs.show_logs(20)


async def _all_answered(calls: list[Any], what: str) -> list[Any]:
    """Every call's answer; a call that raised, or any not answered within ``BOUND``, fails."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    done, pending = await asyncio.wait(tasks, timeout=BOUND)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    errors = [f"{type(t.exception()).__name__}: {t.exception()}" for t in done if t.exception()]
    assert not pending and not errors, (
        f"{what}: {len(pending)} of {len(tasks)} calls not answered within {BOUND} s, "
        f"{len(errors)} failed: {sorted(set(errors))[:3]}"
    )
    return [t.result() for t in tasks]


async def _where(cluster: Cluster, client: ParameterClient, table: str, ids: Any) -> str:
    """What each node holds of the rows, and the topology the client read them by and now."""
    said = []
    topology = client.routes.topology if client.routes is not None else None
    said.append(f"read at epoch {topology.epoch if topology else None}")
    for node in cluster.nodes:
        async with node.client() as alone:
            got = await alone.pull_rows(table, ids)
            said.append(f"node {node.node_id}: {sorted(set(got[:, 0]))}")
    async with cluster.nodes[0].client(route=True) as fresh:
        await fresh.pull_rows(table, ids)
        now = fresh.routes.topology if fresh.routes is not None else None
        said.append(f"epoch now {now.epoch if now else None}")
        if topology is not None and now is not None:
            moved = [
                b
                for b in range(BUCKETS)
                if topology.placement.replicas(bucket_key(table, b))[:1]
                != now.placement.replicas(bucket_key(table, b))[:1]
            ]
            said.append(f"buckets whose primary changed since: {moved}")
    return "; ".join(said)


async def _everywhere(cluster: Cluster, check: Any) -> None:
    """``check(client, where)`` passes at every node alone, once replication caught up."""

    async def all_nodes() -> None:
        for node in cluster.nodes:
            async with node.client() as client:
                await check(client, f"node {node.node_id}")

    await eventually(all_nodes, timeout=SETTLE, interval=POLL, retry_on=(*RETRY_WIRE, CallTimeout))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
async def test_concurrent_writers_at_every_node_are_each_applied_once(
    cluster: Cluster, kind: str, mode: str
) -> None:
    prefix = f"{kind}-{mode}"
    names = [f"{prefix}/p{i:02d}" for i in range(KEYS)]
    writers = len(cluster.nodes)
    total = writers * CALLS
    async with contextlib.AsyncExitStack() as stack:
        setup = await stack.enter_async_context(cluster.nodes[0].client(route=True))
        if kind == "push_row_gradients":
            table = f"{prefix}/rows"
            await setup.create_table(table, ELEMENTS, rule=sgd(1.0), buckets=BUCKETS)
        else:
            rule = sgd(LR) if kind.endswith("sgd") else sum_rule()
            zeros = {n: np.zeros(ELEMENTS, np.float32) for n in names}
            await setup.update_arrays(zeros, rules=rule, acks="all")
        clients = [
            await stack.enter_async_context(
                ParameterClient(n.address, route=mode == "routed", timeout=BOUND + 10.0)
            )
            for n in cluster.nodes
        ]

        if kind == "update_arrays":
            calls = [
                c.update_arrays(
                    {n: np.full(ELEMENTS, 1 + w * CALLS + i, np.float32) for n in names}
                )
                for w, c in enumerate(clients)
                for i in range(CALLS)
            ]
        elif kind == "push_row_gradients":
            ids = np.arange(KEYS, dtype=np.int64)
            ones = np.ones((KEYS, ELEMENTS), np.float32)
            calls = [c.push_row_gradients(table, ids, ones) for c in clients for _ in range(CALLS)]
        else:
            ones = {n: np.ones(ELEMENTS, np.float32) for n in names}
            for c in clients:
                # (as once a node answered a read in blocks: a client not routed sends its
                # gradients in blocks, GradientPush.packed, which the node passes on by
                # Parameter; a routed one sends Parameters, each part to its primary)
                c._packs = True
            calls = [c.push_gradients(ones) for c in clients for _ in range(CALLS)]
        answers = await _all_answered(calls, f"{cluster.config} {mode} {kind}")

        if kind == "push_row_gradients":
            expected = np.full((KEYS, ELEMENTS), -float(total), np.float32)
            # (the client knows the topology, so that it reads at the primaries: its first
            # routed call goes to its node while it asks, and there, with --acks 1, a replica
            # may lag the primary by replication messages)
            assert setup.routes is not None
            await setup.routes.learn()
            rows = await setup.pull_rows(table, ids)
            if not np.array_equal(rows, expected):
                where = await _where(cluster, setup, table, ids)
                raise AssertionError(f"rows hold {sorted(set(rows[:, 0]))}; {where}")

            async def rows_held(client: ParameterClient, where: str) -> None:
                got = await client.pull_rows(table, ids)
                assert np.array_equal(got, expected), f"{where}: rows {sorted(set(got[:, 0]))}"

            await _everywhere(cluster, rows_held)
            return

        if kind == "update_arrays":
            # Concurrent whole writes resolve by last-writer-wins: every node ends with the
            # same one of them for each key, at a version no lower than any acknowledged.
            acked = {n: max(a[n] for a in answers) for n in names}

            async def agreed() -> None:
                states = {}
                for node in cluster.nodes:
                    async with node.client() as client:
                        params = (await client.get_parameters(names)).params
                    states[node.node_id] = _state(params, names, f"node {node.node_id}")
                first = next(iter(states.values()))
                for node_id, state in states.items():
                    differ = sorted(n for n in names if state[n] != first[n])
                    assert not differ, f"node {node_id} differs at {differ[:4]}"
                wrong = {
                    n: (v, x[0])
                    for n, (v, x) in first.items()
                    if v < acked[n] or len(set(x)) != 1 or not 1 <= x[0] <= total
                }
                assert not wrong, f"keys not as written (version, value): {wrong}"

            await eventually(
                agreed, timeout=SETTLE, interval=POLL, retry_on=(*RETRY_WIRE, CallTimeout)
            )
            return

        # Every push folded once, at one node: the sum of all, one version each, everywhere.
        value = (-LR if kind.endswith("sgd") else 1.0) * total
        final = {n: (1 + total, (value,) * ELEMENTS) for n in names}
        got = _state((await setup.get_parameters(names)).params, names, "the primaries")
        assert got == final, (
            f"the primaries hold, after {total} pushes of ones (version, value): "
            f"{ {n: (v, x[0]) for n, (v, x) in got.items() if (v, x) != final[n]} }"
        )

        async def held(client: ParameterClient, where: str) -> None:
            got = _state((await client.get_parameters(names)).params, names, where)
            assert got == final, (
                f"{where} holds (version, value) "
                f"{ {n: (v, x[0]) for n, (v, x) in got.items() if (v, x) != final[n]} }"
            )

        await _everywhere(cluster, held)


def _state(params: list[Any], names: list[str], where: str) -> dict[str, tuple[int, tuple]]:
    """name -> (version, values) of a read of ``names``, every one of them there."""
    got = {p.name: (p.version, tuple(np.frombuffer(p.data, np.float32).tolist())) for p in params}
    assert set(got) == set(names), f"{where} lacks {sorted(set(names) - set(got))}"
    return got
