"""A node restarted from its data directory meets a cluster that went on without it.

With one copy of each key (R=1) a killed node takes its keys' only copies with it: the others
place those keys elsewhere, and a write there makes a key anew, from version 1. When the node
comes back with its data directory, its copies (of higher versions, from before) must not win
over those later writes by last-writer-wins, and the keys no one wrote meanwhile come back as
they were. Where every node restarted, their copies compare by last-writer-wins as before. (See
``aioparamsync.cluster.recovered``.) Node processes killed with SIGKILL, real data directories;
every wait is a poll bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import (
    NodeProcess,
    ProcessCluster,
    eventually,
    free_port,
    open_clients,
    placement_of,
    wait_formed,
)

from aioparamsync import CallTimeout, NetworkError, ParameterClient, RequestError
from aioparamsync.cluster.recovered import covers, newer
from aioparamsync.persistence.datadir import DataDir
from aioparamsync.server.digests import digest
from aioparamsync.store.table import ParameterTable, lww_key
from aioparamsync.store.writer import ParameterStore
from aioparamsync.wire import thrift

pytestmark = pytest.mark.timeout(240)

FAILURE_TIMEOUT = 1.5
SETTLE_TIMEOUT = 45.0
POLL = 0.2
RETRY = (AssertionError, NetworkError, CallTimeout, RequestError)
WRITES = 5  # each key's version before the kill


@pytest.fixture
async def procs() -> AsyncIterator[ProcessCluster]:
    cluster = ProcessCluster(repair_interval=0.5, replication_factor="1")
    try:
        yield cluster
    finally:
        await cluster.close()
        cluster.show_logs(60)


def flags(data_dir: Path, r: str) -> list[str]:
    return [
        "--replication-factor", r,
        "--failure-timeout", str(FAILURE_TIMEOUT),
        "--acks", "all",
        "--data-dir", str(data_dir),
    ]  # fmt: skip


async def start(
    procs: ProcessCluster, data: Path, name: str, r: str, port: int, peers: Sequence[NodeProcess]
) -> NodeProcess:
    return await procs.spawn(peers=peers, port=port, extra=flags(data / name, r))


async def write_all(client: ParameterClient, values: Mapping[str, float]) -> None:
    await client.update_arrays({n: np.full(4, v, np.float32) for n, v in values.items()})


async def read(client: ParameterClient, names: Sequence[str]) -> dict[str, tuple[int, float]]:
    """name -> (version, value) as the cluster answers (through ``client``'s node)."""
    response = await client.get_parameters(list(names))
    found = {}
    for p in response.params:
        values = np.frombuffer(p.data, np.float32)
        assert (values == values[0]).all(), f"{p.name} torn: {values}"
        found[p.name] = (p.version, float(values[0]))
    return found


async def until_seen_as(clients: Mapping[str, ParameterClient], node_id: str, state: str) -> None:
    async def check() -> None:
        for me, client in clients.items():
            states = {m.node_id: m.state for m in (await client.info()).topology.members}
            assert states.get(node_id) == state, f"{me} sees {states}"

    await eventually(check, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)


async def kill_and_write_anew(
    victim: NodeProcess,
    clients: Mapping[str, ParameterClient],
    entry: ParameterClient,
    names: Sequence[str],
) -> dict[str, ParameterClient]:
    """Kill ``victim`` (the primary of ``names``, R=1), wait until the others see it failed,
    then write ``names`` through ``entry`` (the i-th: 100 + i). Its keys are placed on the
    others now, where no copy of them is: the write makes them anew, at version 1. Answers
    the survivors' clients."""
    await victim.kill()
    survivors = {m: c for m, c in clients.items() if m != victim.node_id}
    await until_seen_as(survivors, victim.node_id, "failed")
    await eventually(
        lambda: write_all(entry, {n: 100 + i for i, n in enumerate(names)}),
        timeout=SETTLE_TIMEOUT,
        interval=POLL,
        retry_on=RETRY,
    )
    made = await read(entry, names)
    assert {v for v, _ in made.values()} == {1}, made
    return survivors


async def test_a_restarted_node_yields_its_copies_to_keys_written_anew_while_it_was_away(
    procs: ProcessCluster, tmp_path: Path
) -> None:
    ports = [free_port() for _ in range(3)]
    first = await start(procs, tmp_path, "n0", "1", ports[0], [])
    rest = [await start(procs, tmp_path, f"n{i}", "1", ports[i], [first]) for i in (1, 2)]
    nodes = [first, *rest]
    victim = nodes[2]
    names = [f"k{i:02d}" for i in range(30)]
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        await wait_formed(clients)
        entry = clients[first.node_id]  # (a node's client: it passes each key to its primary)
        for step in range(1, WRITES + 1):
            await write_all(entry, {n: step for n in names})
        info = await entry.info()
        placement = placement_of(info.topology)
        its = [n for n in names if placement.primary(n, set(clients)) == victim.node_id]
        assert len(its) >= 2, f"the victim is the primary of {its} alone"
        anew, untouched = its[: len(its) // 2], its[len(its) // 2 :]

        await kill_and_write_anew(victim, clients, entry, anew)

        back = await start(procs, tmp_path, "n2", "1", ports[2], [first])
        assert back.node_id == victim.node_id
        clients[back.node_id] = await stack.enter_async_context(back.client())
        await wait_formed(clients)

        async def as_expected() -> None:
            for me, client in clients.items():
                got = await read(client, names)
                for i, n in enumerate(anew):  # the later write, at a version above the old
                    assert got[n][1] == 100 + i and got[n][0] > WRITES, (me, n, got[n])
                for n in untouched:  # as it was: read back from the data directory
                    assert got[n] == (WRITES, WRITES), (me, n, got[n])
                others = [n for n in names if n not in its]
                assert all(got[n] == (WRITES, WRITES) for n in others), (me, got)
            counts = [(await c.info()).parameter_count for c in clients.values()]
            assert sum(counts) == len(names), f"{counts}: a key held twice, or not at all"
            assert (await clients[back.node_id].info()).parameter_count == len(its)

        await eventually(as_expected, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)
        # Once more after a restart: what the node wrote to its files since holds.
        await back.kill()
        await until_seen_as({first.node_id: entry}, back.node_id, "failed")
        again = await start(procs, tmp_path, "n2", "1", ports[2], [first])
        clients[again.node_id] = await stack.enter_async_context(again.client())
        await wait_formed(clients)
        await eventually(as_expected, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)


async def test_keys_written_anew_keep_growing_where_a_member_that_joined_meanwhile_holds_them(
    procs: ProcessCluster, tmp_path: Path
) -> None:
    """The restarted node is no longer the primary of some of its keys: a member that
    joined while it was away ranks above it. Those keys' primary (not the restarted
    node) holds them written anew at lower versions: it raises their versions above
    the restarted node's old ones, so no reader sees a key's version go back."""
    ports = [free_port() for _ in range(4)]
    first = await start(procs, tmp_path, "n0", "1", ports[0], [])
    rest = [await start(procs, tmp_path, f"n{i}", "1", ports[i], [first]) for i in (1, 2)]
    nodes = [first, *rest]
    victim = nodes[2]
    names = [f"k{i:02d}" for i in range(90)]
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        await wait_formed(clients)
        entry = clients[first.node_id]
        for step in range(1, WRITES + 1):
            await write_all(entry, {n: step for n in names})
        placement = placement_of((await entry.info()).topology)
        its = [n for n in names if placement.primary(n, set(clients)) == victim.node_id]

        survivors = await kill_and_write_anew(victim, clients, entry, its)
        joined = await start(procs, tmp_path, "n3", "1", ports[3], [first])
        survivors[joined.node_id] = clients[joined.node_id] = await stack.enter_async_context(
            joined.client()
        )
        await until_seen_as(survivors, joined.node_id, "up")

        async def handed_off() -> None:  # (to the member that joined: each key held once)
            counts = [(await c.info()).parameter_count for c in survivors.values()]
            assert sum(counts) == len(names), counts

        await eventually(handed_off, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)

        back = await start(procs, tmp_path, "n2", "1", ports[2], [first])
        clients[back.node_id] = await stack.enter_async_context(back.client())
        await wait_formed(clients)
        placement = placement_of((await entry.info()).topology)
        moved = [n for n in its if placement.primary(n, set(clients)) == joined.node_id]
        assert moved, f"no key of {victim.node_id} went to {joined.node_id}: {its}"

        async def as_expected() -> None:
            for me, client in clients.items():
                got = await read(client, names)
                for i, n in enumerate(its):  # the later write, at a version above the old
                    assert got[n][1] == 100 + i and got[n][0] > WRITES, (me, n, got[n])
                others = [n for n in names if n not in its]
                assert all(got[n] == (WRITES, WRITES) for n in others), (me, got)
            counts = [(await c.info()).parameter_count for c in clients.values()]
            assert sum(counts) == len(names), f"{counts}: a key held twice, or not at all"

        await eventually(as_expected, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)


async def test_nodes_all_restarted_keep_the_later_writes_of_the_last_one_down(
    procs: ProcessCluster, tmp_path: Path
) -> None:
    """Two nodes holding every key (R=2). A is killed; B takes more writes alone; B is
    killed. A restarts first (its copies older), then B: B's later writes win, as by
    last-writer-wins (neither copy is live: neither yields)."""
    ports = [free_port() for _ in range(2)]
    a = await start(procs, tmp_path, "a", "2", ports[0], [])
    b = await start(procs, tmp_path, "b", "2", ports[1], [a])
    names = [f"k{i:02d}" for i in range(12)]
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, [a, b])
        await wait_formed(clients)
        for step in range(1, WRITES + 1):
            await write_all(clients[b.node_id], {n: step for n in names})
        await a.kill()
        await until_seen_as({b.node_id: clients[b.node_id]}, a.node_id, "failed")
        await eventually(
            lambda: write_all(clients[b.node_id], dict.fromkeys(names, 50.0)),
            timeout=SETTLE_TIMEOUT,
            interval=POLL,
            retry_on=RETRY,
        )
        later = await read(clients[b.node_id], names)
        assert {v for v, _ in later.values()} == {WRITES + 1}, later
        await b.kill()

        a2 = await start(procs, tmp_path, "a", "2", ports[0], [b])
        ca = await stack.enter_async_context(a2.client())
        assert await read(ca, names) == dict.fromkeys(names, (WRITES, WRITES))  # alone: its own
        b2 = await start(procs, tmp_path, "b", "2", ports[1], [a2])
        clients = {a2.node_id: ca, b2.node_id: await stack.enter_async_context(b2.client())}
        await wait_formed(clients)

        async def as_expected() -> None:
            for me, client in clients.items():
                digest = {d.name: d.version for d in await client.call("digest")}
                assert digest == dict.fromkeys(names, WRITES + 1), (me, digest)
                assert await read(client, names) == later, me

        await eventually(as_expected, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)


# -- the parts, in-process: the table's marks, the lift, the digest, the rules --------------


def _param(name: str, value: float, version: int = 0, **kw: Any) -> Any:
    data = np.full(4, value, np.float32).tobytes()
    return thrift.Parameter(name=name, data=data, version=version, dtype="<f4", shape=[4], **kw)


def _item(name: str, version: int, recovered: bool | None = None, origin: str = "x") -> Any:
    return thrift.DigestEntry(
        name=name, version=version, origin=origin, nbytes=16, recovered=recovered
    )


async def test_a_data_directory_read_at_start_marks_its_entries_until_each_is_written(
    tmp_path: Path,
) -> None:
    table = ParameterTable("n")
    first = DataDir(tmp_path, fsync="always")
    first.recover(table)
    store = ParameterStore(table, data_dir=first)
    writer = asyncio.ensure_future(store.run())
    await store.update([_param("a", 1), _param("b", 2), _param("c", 3)], 1)
    store.close()
    await writer
    first.close()

    again = ParameterTable("n")
    data_dir = DataDir(tmp_path)
    try:
        data_dir.recover(again)
    finally:
        data_dir.close()
    assert all(again.recovered_entry(n) is again.entry(n) is not None for n in "abc")
    assert {d.name: d.recovered for d in digest(again)} == dict.fromkeys("abc", True)
    again.apply([_param("a", 9)], 2)  # written: live from now on
    again.merge([_param("b", 8, version=7, origin="y")], 3)  # replicated, newer
    again.merge([_param("c", 8, version=1, origin="a")], 4)  # replicated, older: not taken
    assert again.recovered_entry("a") is None and again.recovered_entry("b") is None
    assert again.recovered_entry("c") is again.entry("c")
    assert "a" not in again.recovered  # (forgotten once seen changed)
    assert {d.name: d.recovered for d in digest(again)} == {"a": None, "b": None, "c": True}
    again.drop({"c": lww_key(again.entry("c"))})
    assert again.recovered_entry("c") is None
    assert ParameterTable("fresh").recovered_entry("a") is None


async def test_a_lift_raises_versions_keeping_values_rules_and_optimizer_state() -> None:
    table = ParameterTable("n")
    adam = thrift.Rule(kind="adam", lr=0.1)
    table.apply([_param("w", 1, rule=adam), _param("v", 1)], 1)
    table.fold([_param("w", 1)], 2)  # (adam's moments kept by the node)
    before = table.entry("w")
    store = ParameterStore(table)
    fed: list[Any] = []
    store.subscribe(lambda entries, replicated: fed.append((entries, replicated)))
    writer = asyncio.ensure_future(store.run())
    try:
        lifted = await store.lift({"w": 10, "v": 1, "absent": 5, "too-far": 2**31})
    finally:
        store.close()
        await writer
    assert lifted == 1  # v is at 1 already; absent and too-far are not lifted
    w = table.entry("w")
    assert (w.version, w.origin, bytes(w.data), w.rule) == (10, "n", bytes(before.data), adam)
    assert table.entry("v").version == 1
    assert [([e.name for e in entries], replicated) for entries, replicated in fed] == [
        (["w"], False)  # (replicated to the others, as a write made here)
    ]
    other = ParameterTable("m")
    other.apply([_param("w", 1, rule=adam)], 1)
    other.fold([_param("w", 1)], 2)
    table.fold([_param("w", 1)], 3)
    other.fold([_param("w", 1)], 3)
    assert bytes(table.entry("w").data) == bytes(other.entry("w").data)  # (the same step 2)


def test_a_recovered_copy_does_not_win_over_a_live_one() -> None:
    table = ParameterTable("n")
    table.apply([_param("old", 1, version=14), _param("live", 1, version=14)], 1)
    table.mark_recovered()
    table.apply([_param("live", 2)], 2)  # (v15, live)
    # Pulled in repair: a newer copy, unless it is recovered and this node's live.
    assert newer(table, _item("new", 1))  # (none here)
    assert newer(table, _item("old", 15)) and newer(table, _item("old", 15, recovered=True))
    assert not newer(table, _item("old", 13))
    assert newer(table, _item("live", 16)) and not newer(table, _item("live", 16, True))
    # A hand-off's target holds this node's copy.
    old, live = table.entry("old"), table.entry("live")
    assert covers(table, _item("old", 1), old)  # (any live copy, over a recovered one)
    assert not covers(table, _item("old", 1, recovered=True), old)
    assert covers(table, _item("old", 14, recovered=True, origin="n"), old)
    assert covers(table, _item("live", 15, origin="n"), live)
    assert covers(table, _item("live", 15, recovered=True, origin="n"), live)  # (one write)
    assert not covers(table, _item("live", 14), live)
    assert not covers(table, _item("live", 16, recovered=True), live)
