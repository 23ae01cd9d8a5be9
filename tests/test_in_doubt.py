"""A push whose outcome is unknown, sent again under its request id, folds once.

Two ways a push's outcome goes unknown (``Indeterminate``) after it was folded:

- its primary folded it, and the wait for its replicas' confirmation (``acks=all``) failed:
  the primary remembers the fold under the request id before it waits, so the push sent
  again folds nothing more there (and waits for the replicas once more);
- a node passed it on to the primary, which folded it, and the call broke before the answer
  came back: sent again while that primary cannot be reached, the node that passes it on
  does not send it to a next replica (whose memory of request ids is its own: it would fold
  it again) but fails ``INDETERMINATE`` until the primary answers, which folds it once; and
  sent again after the parameter moved to another primary (a join), it goes first to the
  node that folded it, which answers from its memory.

Under a coordinator, besides, a gradient push whose primary cannot be reached is folded by
no other node (``UNAVAILABLE``). The first case, and the move, run in-process (the fault
injected where the replicas confirm); the cut, as node processes, each behind a proxy
(``FaultProxy``) that cuts or stalls one node's links.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import (
    LocalCluster,
    ProcessCluster,
    assert_,
    eventually,
    node_client,
    open_clients,
    primary_of,
    wait_formed,
)
from test_coordinator import Etcd, need_etcd
from test_sharding import FaultProxy

from aioparamsync import (
    CallTimeout,
    ErrorCode,
    Indeterminate,
    NetworkError,
    ParameterClient,
    RequestError,
    sgd,
    sum_rule,
)
from aioparamsync.placement import Placement, bucket_key, bucket_of
from aioparamsync.server import forward
from aioparamsync.server.forward import InDoubt

pytestmark = pytest.mark.timeout(90)

FORM_TIMEOUT = 30.0
POLL = 0.2
RETRY = (AssertionError, NetworkError, CallTimeout)


def ones(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


# -- the record ------------------------------------------------------------------------------


def test_the_record_of_parts_in_doubt_is_bounded_and_refuses_only_what_went_out_of_reach() -> None:
    doubt = InDoubt(size=5)
    doubt.note("r1", ["a", "b", "c"], "n1")
    doubt.note("r2", ["x", "y"], "n2")
    doubt.note(None, ["q"], "n1")  # (a push without a request id: nothing to remember)
    assert len(doubt) == 5
    doubt.note("r3", ["z"], "n1")  # (past the size: the oldest id's keys are forgotten)
    assert len(doubt) == 3
    doubt.note("r2", ["x"], "n3")  # (sent again, in doubt again: where it went last)
    assert len(doubt) == 3
    # n2 is a member that is not live here; n1 and n3 are.
    cluster = types.SimpleNamespace(
        placement=Placement(["n1", "n2", "n3"], 2), live=frozenset({"n1", "n3"}), epoch=7
    )

    def refused(request_id: str, keys: list[str], target: str | None, tried: set[str]) -> bool:
        try:
            doubt.check(cluster, request_id, keys, target, frozenset(tried), "gradients")
        except Indeterminate as exc:
            assert exc.epoch == 7 and "cannot be reached now" in exc.message
            return True
        return False

    assert refused("r2", ["y"], "n1", set())  # (y went to n2, which is not live)
    assert not refused("r2", ["y"], "n2", set())  # (to n2 itself: it folds it once)
    assert not refused("r2", ["x"], "n1", set())  # (x went to n3, live, not tried)
    assert refused("r2", ["x"], None, {"n3"})  # (n3 tried and not reached)
    assert not refused("r1", ["a"], "n1", set())  # (forgotten)
    assert not refused("r3", ["other"], None, {"n1"})  # (not in doubt)
    assert not refused("r9", ["z"], None, {"n1"})  # (another push)
    assert doubt.refused == 2


# -- 1. the primary's replicas did not confirm ---------------------------------------------


@pytest.mark.parametrize("entry", ["primary", "other"])
async def test_a_push_folded_but_not_confirmed_folds_once_when_sent_again(
    entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """acks=all: the primary folds, its replicas' confirmation fails (injected: the first
    wait answers Indeterminate, as when a replica cannot be reached to confirm); the push,
    sent again under its request id (at the primary, or at the node that passes it on),
    folds nothing more and is answered once the replicas confirm."""
    cluster = LocalCluster(replication_factor=2)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await cluster.formed([a, b])
        async with node_client(a.address) as ca:
            await ca.update_arrays({"w": np.zeros(2, np.float32)}, rules=sum_rule(), acks="all")
        primary = primary_of([a, b], "w")
        other = b if primary is a else a
        await eventually(lambda: assert_("w" in other.table), timeout=10)
        confirm = primary.cluster.replicated
        waits: list[list[str]] = []

        async def fails_first(names: Any, *args: Any, **kwargs: Any) -> None:
            waits.append(list(names))
            if len(waits) == 1:
                raise Indeterminate(f"applied by {primary.node_id}, but replicas did not confirm")
            await confirm(names, *args, **kwargs)

        monkeypatch.setattr(primary.cluster, "replicated", fails_first)
        where = primary if entry == "primary" else other
        async with node_client(where.address) as client:
            with pytest.raises(Indeterminate, match="did not confirm"):
                await client.push_gradients({"w": ones(2)}, request_id="r1", acks="all")
            assert primary.table.entry("w").version == 2  # (folded, not confirmed)
            versions = await client.push_gradients({"w": ones(2)}, request_id="r1", acks="all")
            assert versions == {"w": 2}  # (the first fold's version: none made again)
            assert len(waits) == 2, waits  # (and the replicas' confirmation waited for)
            got = await client.get_arrays(["w"], min_version=2, wait=5)
            assert got["w"].tolist() == [1.0, 1.0]
        assert primary.table.entry("w").version == 2
    finally:
        await cluster.close()


async def test_a_push_in_doubt_whose_parameter_moved_is_answered_by_the_node_that_folded_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pushes (acks=all) a parameter whose primary is X: X folds it, its replicas'
    confirmation fails (injected), the push is Indeterminate at A. Y joins and becomes the
    parameter's primary. Sent again at A under its request id, the part goes to X first,
    which answers the fold it made from its memory (X is not the primary any more): Y folds
    nothing, one version in all."""
    r = 2
    ids = ["in-a", "in-x", "in-y"]  # (node ids of A, X and Y: placement is known before)
    name = next(
        n
        for n in (f"w{i}" for i in range(1000))
        if Placement(ids[:2], r).replicas(n)[0] == "in-x"
        and Placement(ids, r).replicas(n)[0] == "in-y"
    )
    cluster = LocalCluster(replication_factor=r)
    try:
        flags: dict[str, Any] = {"balance_interval": 0}
        a = await cluster.start(node_id=ids[0], **flags)
        x = await cluster.start(peers=[a], node_id=ids[1], **flags)
        await cluster.formed([a, x])
        async with node_client(a.address) as ca:
            await ca.update_arrays({name: np.zeros(2, np.float32)}, rules=sum_rule(), acks="all")
            confirm = x.cluster.replicated
            waits: list[list[str]] = []

            async def fails_first(names: Any, *args: Any, **kwargs: Any) -> None:
                waits.append(list(names))
                if len(waits) == 1:
                    raise Indeterminate("applied by in-x, but replicas did not confirm")
                await confirm(names, *args, **kwargs)

            monkeypatch.setattr(x.cluster, "replicated", fails_first)
            with pytest.raises(Indeterminate, match="did not confirm"):
                await ca.push_gradients({name: ones(2)}, request_id="r1", acks="all")
            assert x.table.entry(name).version == 2  # (folded at X)

            y = await cluster.start(peers=[a], node_id=ids[2], **flags)
            await cluster.formed([a, x, y])

            def moved_to_y() -> None:
                for node in (a, x, y):
                    assert forward.holder(node.cluster, name) == ids[2], node.node_id
                entry = y.table.entry(name)
                assert entry is not None and entry.version == 2, entry

            await eventually(moved_to_y, timeout=FORM_TIMEOUT)
            versions = await ca.push_gradients({name: ones(2)}, request_id="r1", acks="all")
            assert versions == {name: 2}  # (X's fold: Y folded nothing)
            got = await ca.get_arrays([name], min_version=2, wait=5)
            assert got[name].tolist() == [1.0, 1.0]
        assert y.table.entry(name).version == 2
    finally:
        await cluster.close()


# -- 2. the call to the primary broke after the fold ---------------------------------------


@pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp"), reason="the fault proxy tells a node's links by /proc"
)
@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("kind", ["gradients", "rows"])
@pytest.mark.parametrize("members", ["peers", "coordinator"])
async def test_a_push_in_doubt_is_not_folded_at_a_next_replica_when_sent_again(
    kind: str, members: str, tmp_path: Path
) -> None:
    """Four nodes, each key on three. A client of node A alone pushes (acks=all) a key A
    does not hold, whose replicas are B (its primary), C and D; B folds it and waits for D
    to confirm (B's links to D are stalled), and A's links to B are cut: A's call to B
    breaks, the push is Indeterminate. Sent again at A under its request id, B out of A's
    reach: C folds nothing (the push is Indeterminate again). Healed, sent again: it folds
    once in all.

    Members by ``--peers``, A no longer counts B live once its links to B are down (the
    part would go to C as its primary, which refuses it: C sees B up); by a coordinator,
    B stays a member and live, A cannot reach it, and the part would go to C as a next
    replica's, folded where it arrives (twice, without the record of the first try); and a
    gradient's other pushes are folded only by B while it is a member."""
    procs = ProcessCluster(repair_interval=0.5, replication_factor="3")
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(procs.close)
        membership: list[str] = []
        if members == "coordinator":
            need_etcd()
            etcd = Etcd(tmp_path / "etcd")
            await etcd.start()
            stack.callback(etcd.kill)
            membership = ["--coordinator", etcd.endpoint, "--coordinator-prefix", "/in-doubt"]
        proxies = [FaultProxy() for _ in range(4)]
        for proxy in proxies:
            await proxy.start()
            stack.push_async_callback(proxy.close)
        nodes = []
        for i, proxy in enumerate(proxies):
            # (each node listens on a port of its own; its peers reach it through its proxy)
            flags = ["--advertise", proxy.address_text, "--balance-interval", "0"]
            flags += ["--failure-timeout", "60"]  # (B is never declared failed here)
            flags += membership or (["--peers", proxies[0].address_text] if i else [])
            nodes.append(await proxy.spawn(procs, flags))
        clients = await open_clients(stack, nodes)
        await wait_formed(clients, timeout=FORM_TIMEOUT)
        ids = [p.address_text for p in proxies]  # (each node's id: where its peers reach it)
        claims = dict((await clients[ids[0]].info()).topology.claims or {})  # (by bytes)
        placement = Placement(ids, 3, claims)
        request_id = f"in-doubt-{kind}"

        def not_at_a(keys: Any) -> tuple[Any, tuple[str, ...]]:
            """The first of ``keys`` (key, its key for placement) that A does not hold."""
            return next((k, p) for k, p in keys if ids[0] not in placement.replicas(p))

        if kind == "gradients":
            name, key = not_at_a((f"w{i}", f"w{i}") for i in range(1000))
            ca = clients[ids[0]]
            await ca.update_arrays({name: np.zeros(4, np.float32)}, rules=sum_rule(), acks="all")

            async def push() -> Any:
                return await ca.push_gradients({name: ones(4)}, request_id=request_id, acks="all")

            async def held(client: ParameterClient) -> list[float]:
                return (await client.get_arrays([name]))[name].tolist()

            folded_once = [1.0] * 4
        else:
            buckets = 64
            row, key = not_at_a(
                (i, bucket_key("emb", int(bucket_of(np.array([i]), buckets)[0])))
                for i in range(10_000)
            )
            ca = clients[ids[0]]
            await ca.create_table("emb", 4, rule=sgd(1.0), buckets=buckets)
            rows = np.array([row], np.int64)

            async def push() -> Any:
                return await ca.push_row_gradients(
                    "emb", rows, ones(1, 4), request_id=request_id, acks="all"
                )

            async def held(client: ParameterClient) -> list[float]:
                return (await client.pull_rows("emb", rows))[0].tolist()

            folded_once = [-1.0] * 4

        b_id, c_id, d_id = placement.replicas(key)
        by_id = dict(zip(ids, zip(nodes, proxies, strict=True), strict=True))
        (a, _), (b, pb), (_, pd) = by_id[ids[0]], by_id[b_id], by_id[d_id]
        cb, cc = clients[b_id], clients[c_id]
        pd.stall_from(b.pid)  # (B's links to D carry nothing: B's fold waits for D)
        first = asyncio.ensure_future(push())
        # (B folded it; C has it too, from B)
        await _eventually(lambda: _equal(held(cb), folded_once))
        pb.cut_from(a.pid)  # (A's links to B broken: its call to B with them)
        with pytest.raises(Indeterminate):
            await first

        async def b_cut_off_from_a() -> None:
            links = {p.address: p.state for p in (await ca.info()).peers or []}
            assert links[b_id] != "up", links

        await _eventually(b_cut_off_from_a)
        with pytest.raises(Indeterminate, match="cannot be reached now"):
            await push()  # (not to C, which would fold it again)
        counters = (await ca.info()).counters or {}
        held_back = {k: counters[k] for k in ("gradient_pushes_in_doubt", "row_pushes_in_doubt")}
        mine = "gradient_pushes_in_doubt" if kind == "gradients" else "row_pushes_in_doubt"
        assert held_back == {**dict.fromkeys(held_back, 0), mine: 1}, held_back
        await _eventually(lambda: _equal(held(cc), folded_once))  # (B's fold, once)
        if kind == "gradients" and members == "coordinator":
            # Another push of the key, B a member out of A's reach: folded by no other node
            # (B folds the key's other pushes meanwhile: two nodes folding it would make
            # versions beside each other's, one of the two lost by last-writer-wins).
            with pytest.raises(RequestError, match="only it applies them") as info:
                await ca.push_gradients({name: ones(4)}, request_id="another", acks="all")
            assert info.value.code == ErrorCode.UNAVAILABLE
            assert await held(cc) == folded_once

        for proxy in proxies:
            proxy.heal()
        await _eventually(push, retry=(*RETRY, RequestError))
        for client in clients.values():
            await _eventually(lambda c=client: _equal(held(c), folded_once))


async def _equal(got: Any, expected: list[float]) -> None:
    value = await got
    assert value == expected, value


async def _eventually(call: Any, retry: tuple[type[BaseException], ...] = RETRY) -> Any:
    return await eventually(call, timeout=FORM_TIMEOUT, interval=POLL, retry_on=retry)
