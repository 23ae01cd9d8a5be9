"""Watch: ``client.watch(names | prefix)`` yields ``{name: version}`` as names change.

Real nodes on loopback (one alone, and a sharded cluster in this process), real clients.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from cluster_helpers import LocalCluster, assert_, eventually

from aioparamsync import (
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    SyncParameterClient,
    sum_rule,
)
from aioparamsync.placement import Placement, partition_key
from aioparamsync.server.watches import MAX_PREFIX_WATCHES
from aioparamsync.wire import METHODS, thrift

pytestmark = pytest.mark.asyncio

NEXT = 10.0  # the longest a test waits for the next change to be yielded (seconds)


@pytest.fixture
async def node() -> Any:
    node = Node("127.0.0.1", 0, partition_bytes=4096)
    await node.start()
    try:
        yield node
    finally:
        await node.stop()


def small(value: float, n: int = 4) -> np.ndarray:
    return np.full(n, value, np.float32)


async def test_a_watch_yields_the_current_versions_then_each_change(node: Node) -> None:
    async with ParameterClient(node.address) as writer, ParameterClient(node.address) as client:
        await writer.update_arrays({"a": small(1)}, rules=sum_rule())
        await writer.update_arrays({"big": small(1, 5000)})  # (5 partitions)
        changes = client.watch(["a", "big", "later"], wait=0.5)
        assert await anext(changes) == {"a": 1, "big": 1}
        await writer.update_arrays({"a": small(2)})
        assert await asyncio.wait_for(anext(changes), NEXT) == {"a": 2}
        await writer.update_arrays({"big": small(2, 5000)})
        assert await asyncio.wait_for(anext(changes), NEXT) == {"big": 2}
        await writer.update_arrays({"later": small(0), "unwatched": small(0)})
        assert await asyncio.wait_for(anext(changes), NEXT) == {"later": 1}
        # (a gradient folds a new version too)
        await writer.push_gradients({"a": small(1)})
        assert await asyncio.wait_for(anext(changes), NEXT) == {"a": 3}
        await changes.aclose()
    # what the node held for the watch ends with it (at most a wait later)
    await eventually(lambda: assert_(len(node.service.watches) == 0))


async def test_a_slow_consumer_sees_the_newest_version_not_a_backlog(node: Node) -> None:
    async with ParameterClient(node.address) as writer, ParameterClient(node.address) as client:
        await writer.update_arrays({"a": small(0), "b": small(0)})
        changes = client.watch(["a", "b"], wait=0.5)
        assert await anext(changes) == {"a": 1, "b": 1}
        for step in range(50):  # (nobody reads the watch meanwhile)
            await writer.update_arrays({"a": small(step)})
        await writer.update_arrays({"b": small(1)})

        async def newest() -> dict[str, int]:
            seen: dict[str, int] = {}
            while seen != {"a": 51, "b": 2}:
                changed = await anext(changes)
                assert all(seen.get(n, 0) < v for n, v in changed.items()), (seen, changed)
                seen.update(changed)
            return seen

        await asyncio.wait_for(newest(), NEXT)
        await changes.aclose()


async def test_a_watch_by_prefix_sees_names_that_come(node: Node) -> None:
    async with ParameterClient(node.address) as writer, ParameterClient(node.address) as client:
        await writer.update_arrays({"layer.0": small(0), "other": small(0)})
        changes = client.watch(prefix="layer.", wait=0.5)
        assert await anext(changes) == {"layer.0": 1}
        await writer.update_arrays({"layer.1": small(0, 3000), "other": small(1)})
        assert await asyncio.wait_for(anext(changes), NEXT) == {"layer.1": 1}
        await changes.aclose()
        everything = client.watch(prefix="")
        assert await anext(everything) == {"layer.0": 1, "layer.1": 1, "other": 2}
        await everything.aclose()


async def test_a_watch_is_checked(node: Node) -> None:
    async with ParameterClient(node.address) as client:
        with pytest.raises(ValueError, match="one of the two"):
            await anext(client.watch())
        with pytest.raises(ValueError, match="one of the two"):
            await anext(client.watch(["a"], prefix="a"))
        with pytest.raises(TypeError, match="not one string"):
            await anext(client.watch("a"))
        with pytest.raises(ValueError, match="wait"):
            await anext(client.watch(["a"], wait=0))

        async def refused(request: Any, code: ErrorCode, match: str) -> None:
            with pytest.raises(RequestError, match=match) as info:
                await client.invoke(METHODS.watch, request=request)
            assert info.value.code == code

        W = thrift.WatchRequest
        await refused(W(), ErrorCode.BAD_REQUEST, "one of the two")
        await refused(W(names=["a"], prefix=""), ErrorCode.BAD_REQUEST, "one of the two")
        await refused(W(names=[]), ErrorCode.BAD_REQUEST, "no names")
        await refused(W(names=["\x00barrier\x00g"]), ErrorCode.BAD_REQUEST, "no parameter")
        await refused(W(names=["a"], wait_ms=-1), ErrorCode.BAD_REQUEST, "negative")
        limit = node.store.table.limits.max_names_per_request
        many = [f"n{i}" for i in range(limit + 1)]
        await refused(W(names=many), ErrorCode.LIMIT_EXCEEDED, "limit")
        await refused(
            W(prefix="", known_versions=dict.fromkeys(many, 1)), ErrorCode.LIMIT_EXCEEDED, "limit"
        )
        # a node holds a bounded number of watches by prefix: past it, a clear refusal
        held = [
            asyncio.ensure_future(client.invoke(METHODS.watch, request=W(prefix="", wait_ms=5000)))
            for _ in range(MAX_PREFIX_WATCHES)
        ]
        await eventually(
            lambda: assert_(len(node.service.watches) == MAX_PREFIX_WATCHES), timeout=30
        )
        await refused(W(prefix="", wait_ms=5000), ErrorCode.LIMIT_EXCEEDED, "by prefix")
        await client.update_arrays({"a": small(0)})  # (answers every one of them)
        answers = await asyncio.wait_for(asyncio.gather(*held), NEXT)
        assert all(a.versions == {"a": 1} for a in answers)
        # and the node serves on
        assert (await client.get_arrays(["a"]))["a"].tolist() == [0, 0, 0, 0]


async def test_the_blocking_client_watches_too(node: Node) -> None:
    async with ParameterClient(node.address) as writer:
        await writer.update_arrays({"a": small(0)})
        seen: list[dict[str, int]] = []
        done = threading.Event()

        def follow() -> None:
            with SyncParameterClient(node.address) as client:
                for changed in client.watch(["a"], wait=0.5):
                    seen.append(changed)
                    if len(seen) == 2:
                        break
            done.set()

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        await eventually(lambda: assert_(len(seen) == 1))
        await writer.update_arrays({"a": small(1)})
        await eventually(lambda: assert_(done.is_set()), timeout=NEXT)
        thread.join(5)
        assert seen == [{"a": 1}, {"a": 2}]


# -- in a cluster -------------------------------------------------------------------------


async def test_a_watch_follows_names_held_by_different_nodes() -> None:
    cluster = LocalCluster(replication_factor=1)
    try:
        a = await cluster.start(partition_bytes=4096)
        nodes = [a] + [await cluster.start(peers=[a], partition_bytes=4096) for _ in range(2)]
        await cluster.formed(nodes)
        ids = sorted(n.node_id for n in nodes)
        placement = Placement(ids, 1)
        live = frozenset(ids)
        names = [f"p{i}" for i in range(12)]
        # (and a name each node holds: 12 hashed over 3 random ids miss one node in ~2%)
        names += [
            next(q for q in (f"q{i}" for i in range(10_000)) if placement.primary(q, live) == m)
            for m in ids
        ]
        assert len({placement.primary(n, live) for n in names}) == 3  # (every node holds some)
        holders = {placement.primary(partition_key("big", i), live) for i in range(8)}
        assert len(holders) > 1  # (big's 8 partitions at several nodes)
        async with (
            ParameterClient(a.address) as writer,
            ParameterClient(nodes[1].address) as client,
        ):
            await writer.update_arrays({n: small(0) for n in names} | {"big": small(0, 8192)})
            await client.topology()
            await eventually(lambda: assert_(client.routes.wanted()))
            changes = client.watch([*names, "big"], wait=0.5)
            first = await asyncio.wait_for(anext(changes), NEXT)
            assert first == dict.fromkeys([*names, "big"], 1)
            for name in names[:3]:
                await writer.update_arrays({name: small(1)})
                assert await asyncio.wait_for(anext(changes), NEXT) == {name: 2}
            await writer.update_arrays({"big": small(1, 8192)})
            assert await asyncio.wait_for(anext(changes), NEXT) == {"big": 2}
            await changes.aclose()

            by_prefix = client.watch(prefix="p1", wait=0.5)
            assert await asyncio.wait_for(anext(by_prefix), NEXT) == {
                "p1": 2, "p10": 1, "p11": 1
            }  # fmt: skip
            await writer.update_arrays({"p11": small(2)})
            assert await asyncio.wait_for(anext(by_prefix), NEXT) == {"p11": 2}
            await by_prefix.aclose()

        # a client that does not route is told a watch is routed here
        async with ParameterClient(a.address, route=False) as unrouted:
            with pytest.raises(RequestError, match="routed") as info:
                await anext(unrouted.watch(["p0"]))
            assert info.value.code == ErrorCode.BAD_REQUEST
    finally:
        await cluster.close()


async def test_a_watch_goes_on_across_a_restart_of_its_node(tmp_path: Any) -> None:
    first = Node("127.0.0.1", 0, data_dir=str(tmp_path))
    await first.start()
    port = first.address[1]
    second = None
    try:
        async with ParameterClient(first.address, timeout=5, connect_timeout=1) as writer:
            await writer.update_arrays({"a": small(0)})
        async with ParameterClient(first.address, timeout=5, connect_timeout=1) as client:
            changes = client.watch(["a"], wait=0.5)
            assert await anext(changes) == {"a": 1}
            await first.stop()
            second = Node("127.0.0.1", port, data_dir=str(tmp_path))
            await second.start()
            async with ParameterClient(second.address) as writer:
                await writer.update_arrays({"a": small(1)})
            assert await asyncio.wait_for(anext(changes), NEXT) == {"a": 2}
            await changes.aclose()
    finally:
        for node in (first, second):
            if node is not None:
                await node.stop()
