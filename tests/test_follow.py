"""Followers (``--follow``): read-only mirrors of a cluster, and mirrors of mirrors.

Real node processes on loopback, real clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import (
    ProcessCluster,
    assert_,
    eventually,
    free_port,
    open_clients,
    run_bounded,
    spawn_cluster,
    wait_formed,
)

from aioparamsync import ErrorCode, Node, ParameterClient, RequestError, sgd, sum_rule
from aioparamsync.wire import METHODS, thrift

pytestmark = pytest.mark.asyncio

NAMES = [f"layer{i}.w" for i in range(20)]
BIG = "embedding"  # (partitioned: --partition-bytes 4096)
PARTITION = 1024  # (its partitions' elements)
CONVERGE = 30.0  # the longest a follower takes to hold what was written (seconds)


def step_arrays(step: int) -> dict[str, np.ndarray]:
    arrays = {n: np.full(64, step, np.float32) for n in NAMES}
    arrays[BIG] = np.full(5000, step, np.float32)
    return arrays


async def converged(leader: ParameterClient, follower: ParameterClient) -> None:
    """The follower answers every name at the leader's version, with its values."""
    names = [*NAMES, BIG]
    want = await leader.get_parameters(names)
    versions = {p.name: p.version for p in want.params}
    got = await follower.get_parameters(names)
    assert {p.name: p.version for p in got.params} == versions
    theirs, ours = await leader.get_arrays(names), await follower.get_arrays(names)
    for name in names:
        np.testing.assert_array_equal(ours[name], theirs[name])


async def test_a_follower_and_its_follower_mirror_a_cluster_and_refuse_writes() -> None:
    async with (
        ProcessCluster(replication_factor="2") as procs,
        contextlib.AsyncExitStack() as stack,
    ):
        leaders = await spawn_cluster(procs, 2, extra=["--partition-bytes", "4096"])
        await wait_formed(await open_clients(stack, leaders))
        f1 = await procs.spawn(extra=["--follow", leaders[0].address_text])
        f2 = await procs.spawn(extra=["--follow", f1.address_text])
        writer = await stack.enter_async_context(ParameterClient(leaders[1].address, timeout=30))
        first = await stack.enter_async_context(f1.client())
        second = await stack.enter_async_context(f2.client())
        await writer.update_arrays(step_arrays(0))
        await writer.update_arrays({"g": np.zeros(8, np.float32)}, rules=sum_rule())

        # Under a steady write load (each call every name at one step), a reader of the
        # follower of the follower never sees a torn array, only versions that grow.
        stop = asyncio.Event()
        torn: list[str] = []

        async def read() -> int:
            reads, last = 0, {}
            while not stop.is_set():
                got = await second.get_parameters([*NAMES, BIG])
                arrays = await second.get_arrays([*NAMES, BIG])
                for name, array in arrays.items():
                    # (a partitioned one may mix partitions of two writes, as at the
                    # leader: docs/cluster.md, "What a reader may see"; each is whole)
                    per = PARTITION if name == BIG else array.size
                    for lo in range(0, array.size, per):
                        chunk = array[lo : lo + per]
                        if not (chunk == chunk[0]).all():
                            torn.append(name)
                for p in got.params:
                    assert p.version >= last.get(p.name, 0), p.name
                    last[p.name] = p.version
                reads += 1
                await asyncio.sleep(0.01)
            return reads

        reader = asyncio.ensure_future(read())
        for step in range(1, 51):
            await writer.update_arrays(step_arrays(step))
            await writer.push_gradients({"g": np.ones(8, np.float32)})
            await asyncio.sleep(0.02)
        stop.set()
        assert await reader > 0
        assert not torn, torn

        # Both converge on the leader's last versions and values ("at least the version
        # training just made": a long poll at the follower's follower).
        last = max(p.version for p in (await writer.get_parameters(NAMES)).params)
        await second.get_arrays(NAMES, min_version=last, wait=CONVERGE)
        for follower in (first, second):
            await eventually(lambda f=follower: converged(writer, f), timeout=CONVERGE)
            got = await follower.get_arrays(["g"])
            assert got["g"].tolist() == [50.0] * 8  # (every fold: the leader's value)

        # Rows of an embedding table too (by bucket, what changed since the last ask).
        await writer.create_table("emb", 8, rule=sgd(0.5), buckets=8)
        ids = np.arange(200, dtype=np.int64) * 7919
        for _ in range(3):
            await writer.push_row_gradients("emb", ids, np.ones((200, 8), np.float32))
        want = await writer.pull_rows("emb", ids)
        assert want.tolist() == [[-1.5] * 8] * 200
        for follower in (first, second):

            async def rows_here(f: ParameterClient = follower) -> None:
                np.testing.assert_array_equal(await f.pull_rows("emb", ids), want)

            await eventually(rows_here, timeout=CONVERGE, retry_on=(AssertionError, RequestError))
        await writer.push_row_gradients("emb", ids[:10], np.ones((10, 8), np.float32))
        want = await writer.pull_rows("emb", ids)
        await eventually(lambda: _rows_equal(second, ids, want), timeout=CONVERGE)

        # A write at a follower is refused, names the cluster it follows, and changes nothing.
        for call in (
            first.update_arrays({NAMES[0]: np.full(64, -1, np.float32)}),
            first.push_gradients({"g": np.ones(8, np.float32)}),
            second.update_arrays({"new": np.zeros(2, np.float32)}),
            first.push_row_gradients("emb", ids[:1], np.ones((1, 8), np.float32)),
        ):
            with pytest.raises(RequestError, match="read-only follower of") as info:
                await call
            assert info.value.code == ErrorCode.BAD_REQUEST
        assert (await first.get_arrays([NAMES[0]]))[NAMES[0]].tolist() == [50.0] * 64
        assert (await second.get_parameters(["new"])).params == []
        assert (await writer.get_arrays([NAMES[0]]))[NAMES[0]].tolist() == [50.0] * 64

        # Its lag, once it holds everything: none; and what it read.
        counters = (await first.info()).counters
        assert counters["follow_keys_pulled"] > 0 and counters["follow_batches"] > 0

        async def caught_up() -> None:
            counters = (await first.info()).counters
            assert counters["follow_versions_behind"] == 0 and counters["follow_lag_ms"] == 0

        await eventually(caught_up, timeout=CONVERGE)

        # watch at a follower sees the leader's writes
        changes = second.watch([NAMES[0]], wait=1.0)
        (version,) = (await anext(changes)).values()
        await writer.update_arrays({NAMES[0]: np.full(64, 99, np.float32)})
        assert await asyncio.wait_for(anext(changes), CONVERGE) == {NAMES[0]: version + 1}
        await changes.aclose()


async def test_a_follower_killed_and_restarted_reads_only_what_changed(tmp_path: Path) -> None:
    async with ProcessCluster() as procs, contextlib.AsyncExitStack() as stack:
        leader = await procs.spawn(extra=["--partition-bytes", "4096"])
        writer = await stack.enter_async_context(leader.client())
        await writer.update_arrays(step_arrays(0))
        data = ["--data-dir", str(tmp_path), "--follow", leader.address_text]
        follower = await procs.spawn(extra=data)
        async with follower.client() as client:
            await eventually(lambda: converged(writer, client), timeout=CONVERGE)
        port = follower.port
        await follower.kill()  # (kill -9)

        await writer.update_arrays({n: np.full(64, 1, np.float32) for n in NAMES[:3]})
        again = await procs.spawn(port=port, extra=data)
        async with again.client() as client:
            await eventually(lambda: converged(writer, client), timeout=CONVERGE)
            counters = (await client.info()).counters
            # (what changed while it was away: 3 names, not the 20 and the embedding's keys)
            assert counters["follow_keys_pulled"] == 3, counters


async def test_a_cluster_of_followers_holds_a_share_each_and_serves_every_key() -> None:
    async with (
        ProcessCluster(replication_factor="2") as procs,
        ProcessCluster(replication_factor="1") as fprocs,
        contextlib.AsyncExitStack() as stack,
    ):
        leaders = await spawn_cluster(procs, 2, extra=["--partition-bytes", "4096"])
        await wait_formed(await open_clients(stack, leaders))
        writer = await stack.enter_async_context(ParameterClient(leaders[1].address, timeout=30))
        await writer.update_arrays(step_arrays(1))
        await writer.create_table("emb", 8, rule=sgd(0.5), buckets=8)
        ids = np.arange(300, dtype=np.int64) * 7919
        await writer.push_row_gradients("emb", ids, np.ones((300, 8), np.float32))

        # Two followers, a cluster of their own (R=1 among them): each takes its share.
        extra = ["--follow", leaders[0].address_text, "--partition-bytes", "4096"]
        followers = await spawn_cluster(fprocs, 2, extra=extra)
        own = await open_clients(stack, followers)
        await wait_formed(own)
        reader = await stack.enter_async_context(ParameterClient(followers[0].address, timeout=30))
        await eventually(lambda: converged(writer, reader), timeout=CONVERGE)
        want = await writer.pull_rows("emb", ids)
        await eventually(lambda: _rows_equal(reader, ids, want), timeout=CONVERGE)
        at_leader = (await writer.info()).parameter_count
        counts = [(await c.info()).parameter_count for c in own.values()]
        assert all(0 < n < at_leader for n in counts) and sum(counts) >= at_leader, counts

        # New writes reach them; writes at them are refused.
        await writer.update_arrays(step_arrays(2))
        await eventually(lambda: converged(writer, reader), timeout=CONVERGE)
        for client in own.values():
            with pytest.raises(RequestError, match="read-only follower of"):
                await client.update_arrays({NAMES[0]: np.zeros(64, np.float32)})
        assert (await writer.get_arrays([NAMES[0]]))[NAMES[0]].tolist() == [2.0] * 64


async def test_a_follower_says_what_it_is_not_with() -> None:
    with pytest.raises(ValueError, match="follower has no coordinator"):
        Node("127.0.0.1", 0, follow=["127.0.0.1:1"], coordinator="etcd://127.0.0.1:2")
    for extra in (["--coordinator", "etcd://127.0.0.1:2"], ["--processes", "2"]):
        rc, _, stderr = run_bounded(
            [sys.executable, "-m", "aioparamsync", "--follow", "127.0.0.1:1", *extra], timeout=60
        )
        assert rc == 2 and "--follow" in stderr and "not with" in stderr, stderr
    rc, _, stderr = run_bounded(
        [sys.executable, "-m", "aioparamsync", "--follow", "nowhere"], timeout=60
    )
    assert rc == 2 and "--follow" in stderr, stderr
    env = {**os.environ, "AIOPARAMSYNC_FOLLOW": "nowhere"}  # (the flag's variable)
    argv = [sys.executable, "-m", "aioparamsync"]
    done = await asyncio.to_thread(
        subprocess.run, argv, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "AIOPARAMSYNC_FOLLOW" in done.stderr, done.stderr


async def test_a_follower_of_a_node_not_yet_up_serves_and_catches_up_once_it_is() -> None:
    async with ProcessCluster() as procs, contextlib.AsyncExitStack() as stack:
        port = free_port()
        follower = await procs.spawn(extra=["--follow", f"127.0.0.1:{port}"])
        client = await stack.enter_async_context(follower.client())
        assert (await client.get_parameters(NAMES)).params == []  # (it serves meanwhile)
        leader = await procs.spawn(port=port, extra=["--partition-bytes", "4096"])
        writer = await stack.enter_async_context(leader.client())
        await writer.update_arrays(step_arrays(3))
        await eventually(lambda: converged(writer, client), timeout=CONVERGE)
        assert_(follower.proc.returncode is None)


async def _rows_equal(client: ParameterClient, ids: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_array_equal(await client.pull_rows("emb", ids), want)


async def test_a_bucket_answers_the_rows_touched_since_a_time_of_its_clock() -> None:
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        await client.create_table("t", 4, rule=sgd(1.0), buckets=1)
        ask = thrift.BucketRequest
        first = await client.invoke(METHODS.bucket_rows, request=ask(table="t", bucket=0))
        assert first.total == 0 and first.as_of > 0
        await client.push_row_gradients("t", np.arange(5, dtype=np.int64), np.ones((5, 4)))
        since = await client.invoke(
            METHODS.bucket_rows, request=ask(table="t", bucket=0, touched_since=first.as_of)
        )
        assert len(since.ids) == 5 * 8 and since.total == 5
        later = await client.invoke(
            METHODS.bucket_rows, request=ask(table="t", bucket=0, touched_since=since.as_of + 60)
        )
        assert later.ids == b"" and later.total == 5
        for bad in (float("nan"), float("inf")):
            with pytest.raises(RequestError, match="touched_since") as info:
                await client.invoke(
                    METHODS.bucket_rows, request=ask(table="t", bucket=0, touched_since=bad)
                )
            assert info.value.code == ErrorCode.BAD_REQUEST
