"""Membership in etcd (``--coordinator``): one view, fencing by lease, and what survives.

Real things only: a real etcd (Debian's ``etcd-server``) started on loopback
for each test, real node processes, faults injected by TCP proxies (the
node's connection to etcd, and its peer links, cut by the node's PID) and by
killing etcd. ``.ci/run`` installs etcd and sets ``AIOPARAMSYNC_REQUIRE_ETCD``:
there a missing etcd fails these tests; elsewhere they are skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cluster_helpers import (
    LOOPBACK,
    LocalCluster,
    NodeProcess,
    ProcessCluster,
    assert_,
    eventually,
    free_port,
    open_clients,
    placement_of,
)
from test_sharding import FaultProxy

from aioparamsync import (
    CallTimeout,
    ErrorCode,
    NetworkError,
    ParameterClient,
    ParamSyncError,
    RequestError,
    ServerError,
    sum_rule,
)
from aioparamsync.cluster.coordinator import Record, parse_coordinator
from aioparamsync.wire import thrift

pytestmark = [
    pytest.mark.asyncio(loop_factories=["asyncio"]),
    pytest.mark.timeout(180),
]

ETCD = shutil.which("etcd")
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_coordinator.py"
TTL = 3.0  # --failure-timeout: the lease's TTL (etcd grants no less than 2 s)
R = 2
RETRY = (AssertionError, NetworkError, CallTimeout, RequestError)
FORM_TIMEOUT = 40.0
SETTLE_TIMEOUT = 60.0
POLL = 0.2


# -- etcd ---------------------------------------------------------------------------------


class Etcd:
    """One etcd process on loopback, its data in ``data_dir`` (a restart keeps it)."""

    def __init__(self, data_dir: Path, tls: tuple[Path, Path, Path] | None = None) -> None:
        self.data_dir = data_dir
        self.tls = tls  # (its certificate, its key, the CA its clients' certificates are from)
        self.port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir.with_suffix(".log")

    @property
    def endpoint(self) -> str:
        return f"etcd://{LOOPBACK}:{self.port}"

    async def start(self) -> None:
        self._spawn()
        await eventually(self._serves, timeout=20.0, interval=0.1, retry_on=(Exception,))

    def _spawn(self) -> None:
        assert ETCD is not None
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://{LOOPBACK}:{self.port}", f"http://{LOOPBACK}:{self.peer_port}"
        tls = []
        if self.tls is not None:
            cert, key, ca = self.tls
            tls = [
                f"--cert-file={cert}",
                f"--key-file={key}",
                f"--trusted-ca-file={ca}",
                "--client-cert-auth",
            ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    ETCD,
                    "--name=test",
                    f"--data-dir={self.data_dir}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=test={peer}",
                    *tls,
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    async def _serves(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
        if self.tls is not None:  # (it listens: the nodes' TLS is what is tested)
            _, writer = await asyncio.open_connection(LOOPBACK, self.port)
            writer.close()
            return
        await self.call(lambda c: c.status())

    async def call(self, make: Any) -> Any:
        """``make(client)`` on a fresh aetcd client (the test's own look at etcd)."""
        import aetcd

        async with aetcd.Client(host=LOOPBACK, port=self.port) as client:
            async with asyncio.timeout(5.0):
                return await make(client)

    def kill(self) -> None:
        """SIGKILL, by its PID, and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def need_etcd() -> None:
    """Skip without etcd, or fail where it is required (``.ci/run``)."""
    if ETCD is None:
        if os.environ.get("AIOPARAMSYNC_REQUIRE_ETCD"):
            pytest.fail("etcd is not installed (apt-get install etcd-server), and is required here")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[Etcd]:
    need_etcd()
    server = Etcd(tmp_path / "etcd")
    await server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def procs() -> AsyncIterator[ProcessCluster]:
    cluster = ProcessCluster(repair_interval=0.5, replication_factor=str(R))
    try:
        yield cluster
    finally:
        cluster.show_logs()
        await cluster.close()


def coordinated(endpoint: str, prefix: str, *more: str) -> list[str]:
    return [
        "--coordinator",
        endpoint,
        "--coordinator-prefix",
        prefix,
        "--failure-timeout",
        str(TTL),
        "--acks",
        "all",
        *more,
    ]


def new_prefix() -> str:
    return f"/test/{uuid.uuid4().hex[:12]}"


async def members_in_etcd(server: Etcd, prefix: str) -> dict[str, tuple[dict[str, Any], int]]:
    """node id -> (its value, its mod revision), as etcd holds them."""
    found = await server.call(lambda c: c.get_prefix(f"{prefix}/members/".encode()))
    start = len(f"{prefix}/members/")
    return {kv.key[start:].decode(): (json.loads(kv.value), kv.mod_revision) for kv in found}


async def topologies(clients: Mapping[str, ParameterClient]) -> dict[str, Any]:
    return {node_id: await client.topology() for node_id, client in clients.items()}


async def agreed(clients: Mapping[str, ParameterClient], ids: set[str]) -> int:
    """Every node is up, sees exactly ``ids`` up, at one epoch; answers it."""
    tops = await topologies(clients)
    views = {n: (t.epoch, {m.node_id: m.state for m in t.members}) for n, t in tops.items()}
    epochs = {epoch for epoch, _ in views.values()}
    assert len(epochs) == 1, f"epochs differ: {views}"
    for node_id, (_, seen) in views.items():
        assert {m for m, s in seen.items() if s == "up"} == ids, f"{node_id} sees {seen}"
    return epochs.pop()


async def until_agreed(
    clients: Mapping[str, ParameterClient],
    ids: set[str] | None = None,
    timeout: float = FORM_TIMEOUT,
) -> int:
    """Wait until :func:`agreed` (every node up, seeing ``ids``, all of them by default,
    up at one epoch); answer the epoch."""
    wanted = set(clients) if ids is None else ids
    return await eventually(
        lambda: agreed(clients, wanted), timeout=timeout, interval=POLL, retry_on=RETRY
    )


async def replica_states(
    clients: Mapping[str, ParameterClient], names: Sequence[str]
) -> dict[tuple[str, str], tuple[int, bytes]]:
    """(node id, name) -> (version, bytes) at every replica of every name (by the topology)."""
    some = next(iter(clients.values()))
    topology = await some.topology()
    placement = placement_of(topology)
    held = {}
    for name in names:
        for node_id in placement.replicas(name):
            request = thrift.ParameterRequest(param_names=[name], epoch=topology.epoch)
            response = await clients[node_id].call("pull_parameters", request=request)
            for p in response.params:
                held[node_id, p.name] = (p.version, bytes(p.data))
            assert (node_id, name) in held, f"{node_id} holds no {name!r}"
    return held


# -- writers that remember what was acknowledged ------------------------------------------


@dataclass
class Write:
    writer: str
    name: str
    data: bytes
    started: float
    ended: float = 0.0
    version: int | None = None  # (acknowledged: the version it made)
    error: str = ""


@dataclass
class Writers:
    """Writers (one per client), each writing its names in turn with ``acks=all``."""

    clients: Mapping[str, ParameterClient]
    names: Sequence[str]
    writes: list[Write] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, who: str, client: ParameterClient) -> None:
        seq = 0
        while not self.stop.is_set():
            name = self.names[seq % len(self.names)]
            value = np.array([hash(who) % 1000, seq, time.monotonic_ns()], np.int64)
            write = Write(who, name, value.tobytes(), time.monotonic())
            self.writes.append(write)
            try:
                result = await client.update_parameters({name: value}, acks="all", timeout=2 * TTL)
                write.version = result[name]
            except ParamSyncError as exc:  # (refused, timed out, or broke: maybe applied)
                write.error = f"{type(exc).__name__}: {exc}"
            write.ended = time.monotonic()
            seq += 1
            await asyncio.sleep(0.05)

    def start(self) -> list[asyncio.Task[None]]:
        return [asyncio.ensure_future(self.run(w, c)) for w, c in self.clients.items()]

    def acknowledged(self) -> list[Write]:
        return [w for w in self.writes if w.version is not None]

    def last_acknowledged(self) -> dict[str, Write]:
        """Each name's acknowledged write that ended last."""
        last: dict[str, Write] = {}
        for w in sorted(self.acknowledged(), key=lambda w: w.ended):
            last[w.name] = w
        return last


def assert_acknowledged_survive(
    writers: Writers, held: Mapping[tuple[str, str], tuple[int, bytes]]
) -> None:
    """No replica lost an acknowledged write: what each holds of a name is a write no
    acknowledged write of that name began after the end of (the last acknowledged one, one
    concurrent with it, or one tried after it whose answer was an error: maybe applied)."""
    by_data = {w.data: w for w in writers.writes}
    acked: dict[str, list[Write]] = {}
    for w in writers.acknowledged():
        acked.setdefault(w.name, []).append(w)
    for (node_id, name), (_, data) in held.items():
        found = by_data.get(data)
        if found is None:
            assert not acked.get(name), f"{node_id} holds of {name!r} bytes no writer wrote"
            continue  # (the value from before the writers)
        later = [x for x in acked.get(name, ()) if x.started > found.ended]
        assert not later, (
            f"{node_id} holds of {name!r} the write of {found.writer} at {found.started:.2f}-"
            f"{found.ended:.2f} ({'acknowledged' if found.version is not None else found.error}"
            f"), but {len(later)} acknowledged writes began after it, the first by "
            f"{later[0].writer} at {later[0].started:.2f}"
        )


async def survive(
    writers: Writers, clients: Mapping[str, ParameterClient], names: Sequence[str]
) -> None:
    """Wait until every replica holds what :func:`assert_acknowledged_survive` asks."""

    async def check() -> None:
        assert_acknowledged_survive(writers, await replica_states(clients, names))

    await eventually(check, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)


# -- the tests ------------------------------------------------------------------------------


async def test_a_coordinator_is_etcd_endpoints() -> None:
    assert parse_coordinator("etcd://127.0.0.1:2379") == [("127.0.0.1", 2379)]
    assert parse_coordinator("etcd://a:1,[::1]:2, b:3") == [("a", 1), ("::1", 2), ("b", 3)]
    for bad in (
        "127.0.0.1:2379",
        "http://127.0.0.1:2379",
        "etcd://",
        "etcd://host",
        "etcd://host:port",
        "etcd://host:99999",
        "etcd://a:1,,b:2",
        "etcd://a:1/path",
    ):
        with pytest.raises(ValueError, match=r"etcd://|endpoint"):
            parse_coordinator(bad)


async def test_a_member_key_that_is_not_a_member_is_ignored() -> None:
    ok = Record("n1", "127.0.0.1", 9090, "up")
    assert Record.decode("n1", ok.encode()) == ok
    for raw in (
        b"",
        b"not json",
        b"[]",
        b'{"host": "h", "port": 1}',
        b'{"host": "h", "port": 0, "state": "up"}',
        b'{"host": "h", "port": "x", "state": "up"}',
        b'{"host": "h", "port": 1, "state": "sleeping"}',
        b'{"host": "h", "port": 1, "state": "up", "claims": ["k"]}',
        b'{"host": "h", "port": 1, "state": "up", "claims": {"k": "1"}}',
        b'{"host": "h", "port": 1, "state": "up", "claiming": {"k": 1.5}}',
    ):
        assert Record.decode("n1", raw) is None, raw
    # what a member claims (placement balanced by bytes) is in its record, and read back
    claiming = ok.with_state("up", {"k": 3, "\x00rows\x00t\x001": 4}, {"j": 5})
    assert Record.decode("n1", claiming.encode()) == claiming != ok
    assert dict(claiming.with_state("leaving").claims) == {"k": 3, "\x00rows\x00t\x001": 4}
    assert b"claim" not in ok.encode()  # (none: the record an older node writes)


async def test_nodes_share_one_view_whose_epoch_is_etcd_revision(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    prefix = new_prefix()
    flags = coordinated(etcd.endpoint, prefix)
    nodes = [await procs.spawn(extra=flags) for _ in range(3)]  # (no --peers: etcd has them)
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        ids = set(clients)
        epoch = await until_agreed(clients, ids)
        held = await members_in_etcd(etcd, prefix)
        assert set(held) == ids
        assert {v["state"] for v, _ in held.values()} == {"up"}
        # The epoch is etcd's revision of the last change to the members.
        assert epoch == max(rev for _, rev in held.values())
        config = await etcd.call(lambda c: c.get(f"{prefix}/config".encode()))
        assert json.loads(config.value) == {"replication_factor": R}
        # Workers need no etcd: a routed client learns the topology from a node.
        async with ParameterClient(nodes[0].address, timeout=10) as worker:
            names = [f"p{i}" for i in range(12)]
            await worker.update_arrays({n: np.full(4, i, np.float32) for i, n in enumerate(names)})
            got = await worker.get_arrays(names)
            assert [float(got[n][0]) for n in names] == list(range(12))
        states = await replica_states(clients, names)
        assert len(states) == R * len(names)


@pytest.mark.parametrize("peers_too", [True, False], ids=["etcd-and-peers", "etcd-only"])
async def test_a_cut_off_node_stops_acknowledging_and_acknowledged_writes_survive_the_heal(
    etcd: Etcd, procs: ProcessCluster, peers_too: bool
) -> None:
    """A cut off from etcd (and from its peers, or not) while clients write on both sides
    with acks=all: A acknowledges nothing past its lease, B and C take over once it
    expired, and after the heal every replica holds every name's last acknowledged write.
    Two rounds, each at a random cut point (the seed is printed)."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prefix = new_prefix()
    async with contextlib.AsyncExitStack() as stack:
        to_etcd = FaultProxy(etcd.port)
        proxies = [FaultProxy() for _ in range(3)]
        for proxy in (to_etcd, *proxies):
            await proxy.start()
            stack.push_async_callback(proxy.close)
        endpoint = f"etcd://{LOOPBACK}:{to_etcd.port}"
        nodes: list[NodeProcess] = []
        for i, proxy in enumerate(proxies):
            extra = coordinated(endpoint, prefix, "--advertise", proxy.address_text)
            nodes.append(await proxy.spawn(procs, [*extra, "--node-id", "abc"[i]]))
        a = nodes[0]
        clients = await open_clients(stack, nodes)
        ids = set(clients)
        await until_agreed(clients, ids)
        names = [f"k{i}" for i in range(6)]
        await clients["b"].update_arrays({n: np.zeros(3, np.int64) for n in names}, acks="all")

        for round_ in range(2):
            writers = Writers({"a": clients["a"], "b": clients["b"]}, names)
            tasks = writers.start()
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            cut = time.monotonic()
            to_etcd.cut_from(a.pid)
            if peers_too:
                proxies[0].cut()
                proxies[1].cut_from(a.pid)
                proxies[2].cut_from(a.pid)
            # (else A still reaches its peers: it fences itself, by its lease, alone)
            # Past the TTL, A's lease has expired; B and C take its names over.
            await asyncio.sleep(TTL + rng.uniform(1.0, 3.0))
            late = [w for w in writers.acknowledged() if w.writer == "a" and w.ended > cut + TTL]
            assert not late, f"round {round_}: A acknowledged past its lease: {late[:3]}"

            async def b_takes_writes(writers: Writers = writers, since: float = cut + TTL) -> None:
                done = {
                    w.name for w in writers.acknowledged() if w.writer == "b" and w.started > since
                }
                errors = [w.error for w in writers.writes if w.writer == "b" and w.error][-3:]
                assert done == set(names), (
                    f"B's side wrote only {sorted(done)} since A's lease; its last errors: {errors}"
                )

            await eventually(b_takes_writes, timeout=FORM_TIMEOUT, interval=POLL)
            for proxy in (to_etcd, *proxies):
                proxy.heal()
            # A learns its lease expired, drops what it did not get confirmed, joins again.
            await until_agreed(clients, ids, timeout=SETTLE_TIMEOUT)
            await asyncio.sleep(0.5)  # (writes on both sides again, after the heal)
            writers.stop.set()
            await asyncio.gather(*tasks)
            assert sum(1 for w in writers.acknowledged() if w.writer == "a") > 0

            await survive(writers, clients, names)


async def test_without_etcd_writes_stop_within_the_ttl_reads_go_on_and_both_come_back(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    prefix = new_prefix()
    flags = coordinated(etcd.endpoint, prefix)
    nodes = [await procs.spawn(extra=flags) for _ in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        ids = set(clients)
        await until_agreed(clients, ids)
        names = [f"e{i}" for i in range(6)]
        await clients[nodes[0].node_id].update_arrays(
            {n: np.full(2, i, np.float32) for i, n in enumerate(names)}
        )
        etcd.kill()
        killed = time.monotonic()

        async def every_node_refuses_writes() -> None:
            for node_id, client in clients.items():
                try:
                    await client.update_arrays({"e0": np.zeros(2, np.float32)})
                except RequestError as exc:
                    assert exc.code == ErrorCode.UNAVAILABLE, (node_id, exc)
                    assert "lease" in exc.message, exc.message
                else:
                    raise AssertionError(f"{node_id} took a write")

        await eventually(every_node_refuses_writes, timeout=2 * TTL, interval=POLL)
        assert time.monotonic() - killed < TTL + 2.0  # (TTL/2 after the last renewal)
        for client in clients.values():  # reads go on, from what each node holds
            got = await client.get_arrays(names)
            assert [float(got[n][0]) for n in names] == list(range(len(names)))
        await asyncio.sleep(TTL)
        await etcd.start()  # (its data kept: the leases survive, their TTL counted anew)

        async def every_node_takes_writes() -> None:
            for i, client in enumerate(clients.values()):
                await client.update_arrays({f"e{i}": np.full(2, 100 + i, np.float32)})

        await eventually(
            every_node_takes_writes, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY
        )
        await until_agreed(clients, ids, timeout=SETTLE_TIMEOUT)
        for client in clients.values():
            got = await client.get_arrays(names)
            assert [float(got[n][0]) for n in names] == [100, 101, 102, 3, 4, 5]


async def test_a_join_and_a_drain_during_writes_lose_no_acknowledged_write(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    prefix = new_prefix()
    flags = coordinated(etcd.endpoint, prefix)
    first = [await procs.spawn(extra=flags) for _ in range(2)]
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, first)
        await until_agreed(clients)
        names = [f"j{i}" for i in range(10)]
        writers = Writers(dict(clients), names)
        tasks = writers.start()
        await asyncio.sleep(1.0)
        joined = await procs.spawn(extra=flags)
        clients[joined.node_id] = await stack.enter_async_context(joined.client())
        await until_agreed(clients)
        await asyncio.sleep(1.0)
        leaving = first[1]
        writers.stop.set()  # (its writer stops before its node does)
        await asyncio.gather(*tasks)
        writers.stop.clear()
        del clients[leaving.node_id]
        tasks = [asyncio.ensure_future(writers.run(n, c)) for n, c in clients.items()]
        leaving.signal(signal.SIGTERM)  # a planned leave: it hands its keys off first
        assert await leaving.wait_exit(timeout=60.0) == 0
        held = await members_in_etcd(etcd, prefix)
        assert leaving.node_id not in held  # (its lease revoked: gone at once)
        await until_agreed(clients)

        async def said_left() -> None:  # (a planned leave: "left", not "failed")
            tops = await topologies(clients)
            seen = {n: {m.node_id: m.state for m in t.members} for n, t in tops.items()}
            assert all(s.get(leaving.node_id) == "left" for s in seen.values()), seen

        await eventually(said_left, timeout=FORM_TIMEOUT, interval=POLL)
        await asyncio.sleep(1.0)
        writers.stop.set()
        await asyncio.gather(*tasks)
        assert len(writers.acknowledged()) > 20

        await survive(writers, clients, names)


async def test_a_second_process_under_one_id_waits_for_the_first_lease(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    prefix = new_prefix()
    flags = [*coordinated(etcd.endpoint, prefix), "--node-id", "same"]
    first = await procs.spawn(extra=flags)
    port = free_port()
    pending = asyncio.ensure_future(procs.spawn(port=port, extra=flags))
    await asyncio.sleep(TTL)
    assert not pending.done(), "a second process took the id while the first held it"
    # It listens meanwhile (its address is its id), and serves nothing but ping and
    # info: alone, it would take every key as its own (writes a routed client sends to
    # the address of a node restarting there, from a topology before it failed).
    async with ParameterClient((LOOPBACK, port), route=False) as waiting:
        assert await waiting.ping()
        for call in (
            waiting.update_arrays({"w": np.ones(4, np.float32)}),
            waiting.get_arrays(["w"]),
        ):
            with pytest.raises(RequestError, match="registering with the coordinator") as info:
                await call
            assert info.value.code == ErrorCode.UNAVAILABLE
        with pytest.raises(ServerError, match=r"UNAVAILABLE: .* registering with the coordinator"):
            await waiting.topology()  # (no typed errors: a routed client asks another node)
    await first.kill()  # (no leave: its lease expires TTL later)
    killed = time.monotonic()
    second = await asyncio.wait_for(pending, 3 * TTL + 10)
    assert time.monotonic() - killed >= TTL - 1.0
    held = await members_in_etcd(etcd, prefix)
    assert held["same"][0]["port"] == second.port


async def test_a_node_refuses_a_cluster_of_another_replication_factor(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    prefix = new_prefix()
    await procs.spawn(extra=coordinated(etcd.endpoint, prefix))
    rc, err = await run_node(
        *coordinated(etcd.endpoint, prefix), "--replication-factor", "3", timeout=30.0
    )
    assert rc == 1, err
    assert "replication factor 2" in err and "started with 3" in err


async def test_a_node_that_cannot_reach_etcd_exits_with_a_clear_error() -> None:
    unused = f"etcd://{LOOPBACK}:{free_port()}"
    started = time.monotonic()
    rc, err = await run_node(*coordinated(unused, "/nowhere"), timeout=60.0)
    assert rc == 1, err
    assert "could not reach the coordinator within" in err and unused in err
    assert time.monotonic() - started < 40.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordinator", "http://127.0.0.1:2379"], "etcd://HOST:PORT"),
        (["--coordinator", "etcd://127.0.0.1"], "HOST:PORT"),
        (["--coordinator", "etcd://127.0.0.1:1", "--coordinator-prefix", "nope"], "prefix"),
        (["--coordinator", "etcd://127.0.0.1:1", "--coordinator-prefix", "/a//b/"], "prefix"),
    ],
)
async def test_bad_coordinator_flags_are_refused(flags: list[str], message: str) -> None:
    rc, err = await run_node("--port", "0", *flags, timeout=30.0)
    assert rc == 2, err
    assert message in err


async def test_the_coordinator_can_come_from_the_environment(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    prefix = new_prefix()
    env = {"AIOPARAMSYNC_COORDINATOR": etcd.endpoint, "AIOPARAMSYNC_COORDINATOR_PREFIX": prefix}
    rc, _ = await run_node(
        "--port", "0", "--coordinator", "bad", timeout=30.0, env=env
    )  # (a flag wins over its variable)
    assert rc == 2
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aioparamsync",
        "--port",
        "0",
        env={**os.environ, **env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30.0)
        assert b"listening on" in line
        node_id = line.split()[1].decode()
        held = await members_in_etcd(etcd, prefix)
        assert node_id in held
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30.0)


async def test_without_aetcd_the_node_says_which_extra_to_install() -> None:
    code = (
        "import sys; sys.modules['aetcd'] = None\n"
        "from aioparamsync.cli.node import main\n"
        "sys.exit(main(['--port', '0', '--coordinator', 'etcd://127.0.0.1:1']))\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60.0)
    assert proc.returncode == 1, err
    assert b"pip install '.[etcd]' in the checkout" in err
    assert b"Traceback" not in err


async def run_node(
    *flags: str, timeout: float, env: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Run a node to its exit (killed past ``timeout``); answer (exit code, stderr).

    On a port of its own unless ``flags`` name one (the default, 9090, may be another
    run's: the suite passes twice at once)."""
    if "--port" not in flags:
        flags = ("--port", "0", *flags)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aioparamsync",
        *flags,
        env={**os.environ, **(env or {})},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


async def test_the_coordinator_benchmark_runs_end_to_end(etcd: Etcd, tmp_path: Path) -> None:
    """benchmarks/bench_coordinator.py with tiny settings (no timing is asserted)."""
    out = tmp_path / "bench.json"
    flags = ["--nodes", "2", "--count", "20", "--reps", "1", "--etcd", etcd.endpoint]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(BENCH),
        *flags,
        "--json",
        str(out),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120.0)
    assert proc.returncode == 0, stderr.decode()
    assert b"etcd/peer" in stdout and b"failover s" in stdout
    doc = json.loads(await asyncio.to_thread(out.read_text))
    results = {r["kind"]: r for r in doc["results"]}
    assert set(results) == {"peer", "etcd"}
    for result in results.values():
        assert 0 < result["acks=all"]["p50_ms"] <= result["acks=all"]["p99_ms"]
    # With etcd, the killed primary is a member until its lease expires (TTL 3 s).
    assert results["etcd"]["failover_s"] is not None and results["etcd"]["failover_s"] > 1.0


async def test_etcd_is_reached_over_tls_with_the_nodes_certificate(
    tmp_path: Path, procs: ProcessCluster
) -> None:
    import trustme

    need_etcd()
    ca = trustme.CA()
    files = {n: tmp_path / f"{n}.pem" for n in ("ca", "etcd", "etcd-key", "node")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    served = ca.issue_cert("127.0.0.1")
    served.cert_chain_pems[0].write_to_path(str(files["etcd"]))
    served.private_key_pem.write_to_path(str(files["etcd-key"]))
    node_cert = ca.issue_cert("127.0.0.1", "localhost")
    node_cert.private_key_and_cert_chain_pem.write_to_path(str(files["node"]))
    server = Etcd(tmp_path / "etcd", tls=(files["etcd"], files["etcd-key"], files["ca"]))
    await server.start()
    try:
        prefix = new_prefix()
        tls = ["--tls-cert", str(files["node"]), "--tls-ca", str(files["ca"])]
        node = await procs.spawn(extra=[*coordinated(server.endpoint, prefix), *tls])
        assert "registered as joining" in node.stderr
        # Without the node's certificate (plain gRPC), etcd cannot be reached.
        rc, err = await run_node(*coordinated(server.endpoint, new_prefix()), timeout=60.0)
        assert rc == 1 and "could not reach the coordinator" in err, err
    finally:
        server.kill()


async def test_a_node_in_this_process_is_not_ready_while_it_cannot_renew_its_lease(
    etcd: Etcd, capsys: pytest.CaptureFixture[str]
) -> None:
    from aioparamsync import Node
    from aioparamsync.cli.ctl import main as ctl

    async def stats() -> dict[str, Any]:
        capsys.readouterr()
        rc = await asyncio.to_thread(ctl, ["--json", "stats", f"{LOOPBACK}:{node.port}"])
        out, err = capsys.readouterr()
        assert (rc, err) == (0, "")
        return json.loads(out)

    prefix = new_prefix()
    node = Node(port=0, coordinator=etcd.endpoint, coordinator_prefix=prefix, failure_timeout=TTL)
    async with node:
        assert node.readiness() == (True, f"up at epoch {node.cluster.epoch}")
        assert node.coordinator is not None and node.node_id in node.coordinator.members
        shown = await stats()
        assert (shown["coordinator"], shown["fenced"]) == (f"{etcd.endpoint} {prefix}", None)
        etcd.kill()

        def not_ready() -> None:
            ready, why = node.readiness()
            assert not ready and "takes no writes" in why and "lease" in why, why

        await eventually(not_ready, timeout=2 * TTL, interval=POLL)
        async with ParameterClient(node.address, timeout=5) as client:
            with pytest.raises(RequestError) as info:
                await client.update_arrays({"x": np.zeros(2, np.float32)})
            assert info.value.code == ErrorCode.UNAVAILABLE
        assert "lease" in (await stats())["fenced"]
        await etcd.start()
        await eventually(
            lambda: assert_(node.readiness()[0]), timeout=SETTLE_TIMEOUT, interval=POLL
        )


async def test_a_node_waits_until_its_own_watch_shows_an_epoch(etcd: Etcd) -> None:
    """``Cluster.caught_up``: what a member taking over as primary is answered after
    (see ``Transitions.take_over``). A node's view reaches an epoch by its own watch of
    etcd: a wait for a later one ends when a change comes (another node registers), or
    after its timeout, answering False."""
    from aioparamsync import Node

    options: dict[str, Any] = {
        "port": 0,
        "coordinator": etcd.endpoint,
        "coordinator_prefix": new_prefix(),
        "failure_timeout": TTL,
    }
    async with Node(**options) as a:
        # (its own "up" seen on its watch: no change of the members comes by itself now)
        await eventually(
            lambda: assert_(a.cluster.view.states.get(a.node_id) == "up"),
            timeout=SETTLE_TIMEOUT,
            interval=POLL,
        )
        now = a.cluster.epoch
        assert await a.cluster.caught_up(now) and await a.cluster.caught_up(None)
        assert not await a.cluster.caught_up(now + 1, timeout=0.3)  # (nothing changed)
        waiting = asyncio.ensure_future(a.cluster.caught_up(now + 1, timeout=SETTLE_TIMEOUT))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        async with Node(**options) as b:  # (its registration: a new revision of the members)
            assert await asyncio.wait_for(waiting, SETTLE_TIMEOUT)
            assert a.cluster.epoch > now and b.cluster.epoch >= now + 1


async def test_a_drain_the_coordinator_cannot_hear_of_keeps_the_node_and_its_keys(
    etcd: Etcd,
) -> None:
    """With etcd out of reach, a node asked to leave cannot say so (placement is etcd's): it
    hands nothing off, so it stays, holding its keys, and says why; once etcd is back, it
    leaves, handing them off. (It left, handing off none: with R=1 their only copies.)"""
    from aioparamsync import Node

    prefix = new_prefix()
    options: dict[str, Any] = {
        "port": 0,
        "coordinator": etcd.endpoint,
        "coordinator_prefix": prefix,
        "failure_timeout": TTL,
        "replication_factor": 1,
    }
    async with Node(**options) as a, Node(**options) as b:

        def both_live() -> None:
            assert a.cluster.live == b.cluster.live == {a.node_id, b.node_id}

        await eventually(both_live, timeout=SETTLE_TIMEOUT, interval=POLL)
        values = {f"w{i}": np.full(4, i, np.float32) for i in range(40)}
        async with ParameterClient(a.address, timeout=10) as client:
            await client.update_arrays(values)
        held = set(b.table.names())
        assert held, "placement gave b none of 40 keys"
        etcd.kill()
        with pytest.raises(RequestError) as refused:
            await b.leave(timeout=2.0)
        assert refused.value.code == ErrorCode.UNAVAILABLE, refused.value
        assert "it stays, holding its keys" in refused.value.message
        assert not b.left.is_set() and b.cluster.state == "up"
        assert held <= set(b.table.names())
        await etcd.start()
        await eventually(
            lambda: assert_(b.readiness()[0] and a.readiness()[0]),
            timeout=SETTLE_TIMEOUT,
            interval=POLL,
        )
        assert await b.leave(timeout=SETTLE_TIMEOUT) >= len(held)
        assert b.left.is_set()
        async with ParameterClient(a.address, timeout=10) as client:
            got = await client.get_arrays(list(values))
        assert {n: v.tolist() for n, v in got.items()} == {n: v.tolist() for n, v in values.items()}


async def test_rows_a_non_member_replicates_are_ignored_a_members_taken(etcd: Etcd) -> None:
    """A node whose lease expired is no member: rows it sends (``replicate_rows``) may
    be folds its replicas never confirmed, and are ignored, as its parameters are; the
    same rows from a member are taken."""
    from aioparamsync import Node, sgd
    from aioparamsync.values.rowwire import encode_ids
    from aioparamsync.wire import METHODS

    node = Node(
        port=0, coordinator=etcd.endpoint, coordinator_prefix=new_prefix(), failure_timeout=TTL
    )
    ids = np.arange(8, dtype=np.int64)
    async with node, ParameterClient(node.address, timeout=5, route=False) as client:
        await client.create_table("emb", 4, rule=sgd(1.0), buckets=1)
        await client.push_row_gradients("emb", ids, np.ones((8, 4), np.float32))
        table = node.service.rows.tables.tables["emb"]
        for sender, taken in (("127.0.0.1:1", False), (node.node_id, True)):
            delta = table.delta(0, None, sender)  # every row, newer, at 42
            versions = np.frombuffer(delta.versions, "<i8") + 5
            delta.versions = encode_ids(versions)
            delta.rows = np.full((len(versions), 4), 42.0, "<f4").tobytes()
            kept = await client.invoke(METHODS.replicate_rows, deltas=[delta])
            assert kept == (len(ids) if taken else 0), sender
            rows = await client.pull_rows("emb", ids)
            np.testing.assert_array_equal(rows, np.full((8, 4), 42.0 if taken else -1.0))


async def test_a_row_push_a_live_replica_cannot_take_is_refused_before_it_is_folded(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    """Tables as parameters: with acks=all, a push whose buckets have a replica live in
    etcd that this node cannot reach is refused (UNAVAILABLE) and folds nothing; once
    the replica is reached again, the push folds on both."""
    from aioparamsync import sgd

    prefix = new_prefix()
    async with contextlib.AsyncExitStack() as stack:
        proxies = [FaultProxy() for _ in range(2)]
        for proxy in proxies:
            await proxy.start()
            stack.push_async_callback(proxy.close)
        nodes = []
        for i, proxy in enumerate(proxies):
            extra = coordinated(etcd.endpoint, prefix, "--advertise", proxy.address_text)
            nodes.append(await proxy.spawn(procs, [*extra, "--node-id", "ab"[i]]))
        a = nodes[0]
        clients = await open_clients(stack, nodes)
        await until_agreed(clients)
        ids = np.arange(64, dtype=np.int64)
        ones = np.ones((len(ids), 4), np.float32)
        await clients["a"].create_table("emb", 4, rule=sgd(1.0), buckets=4)
        await clients["a"].push_row_gradients("emb", ids, ones, acks="all")

        async def link_to_b(state: str) -> None:
            peers = {p.node_id: p.state for p in (await clients["a"].info()).peers or []}
            assert (peers.get("b") == "up") == (state == "up"), peers

        proxies[1].cut_from(a.pid)  # A cannot reach B; both reach etcd: B stays live
        await eventually(lambda: link_to_b("down"), timeout=FORM_TIMEOUT, interval=POLL)
        with pytest.raises(RequestError) as info:
            await clients["a"].push_row_gradients("emb", ids, ones, acks="all")
        assert info.value.code == ErrorCode.UNAVAILABLE
        assert "nothing was applied" in info.value.message
        for node_id in ("a", "b"):  # (each answers from what it holds: every bucket, R=2)
            rows = await clients[node_id].pull_rows("emb", ids)
            np.testing.assert_array_equal(rows, np.full((len(ids), 4), -1.0), node_id)

        proxies[1].heal()
        await eventually(lambda: link_to_b("up"), timeout=FORM_TIMEOUT, interval=POLL)
        await clients["a"].push_row_gradients("emb", ids, ones, acks="all")
        for node_id in ("a", "b"):
            rows = await clients[node_id].pull_rows("emb", ids)
            np.testing.assert_array_equal(rows, np.full((len(ids), 4), -2.0), node_id)


async def one_view(clients: Mapping[str, ParameterClient], ids: set[str]) -> int:
    """Every node answers one topology: the same epoch, the same members in the same
    states, those up exactly ``ids``; answers the epoch."""
    tops = await topologies(clients)
    views = {n: (t.epoch, {m.node_id: m.state for m in t.members}) for n, t in tops.items()}
    assert len({(e, tuple(sorted(s.items()))) for e, s in views.values()}) == 1, (
        f"views differ: {views}"
    )
    epoch, seen = next(iter(views.values()))
    assert {m for m, s in seen.items() if s == "up"} == ids, f"up: {seen}"
    return epoch


async def until_one_view(clients: Mapping[str, ParameterClient]) -> int:
    """Wait until :func:`one_view`, every node up; answer the epoch."""
    return await eventually(
        lambda: one_view(clients, set(clients)),
        timeout=FORM_TIMEOUT,
        interval=POLL,
        retry_on=RETRY,
    )


def numbered(names: Sequence[str], base: int) -> dict[str, np.ndarray]:
    """Name ``i`` of ``names`` -> ``[base + i, base + i]``."""
    return {n: np.full(2, base + i, np.float32) for i, n in enumerate(names)}


async def assert_numbered(client: ParameterClient, names: Sequence[str], base: int) -> None:
    got = await client.get_arrays(names)
    assert {n: float(v[0]) for n, v in got.items()} == {n: base + i for i, n in enumerate(names)}


@pytest.mark.parametrize("fault", ["stalled", "stopped"])
async def test_a_node_whose_lease_expired_follows_the_members_again(
    etcd: Etcd, procs: ProcessCluster, fault: str
) -> None:
    """A's calls to etcd hang past its lease's TTL (stalled: the network drops its
    packets, so they time out rather than fail; stopped: A is SIGSTOPped): the others
    place it no more; healed, A registers anew. Then a node joins and another drains:
    every node, A too, answers one epoch and one set of members, and writes and reads
    routed through A reach every key."""
    prefix = new_prefix()
    async with contextlib.AsyncExitStack() as stack:
        to_etcd = FaultProxy(etcd.port)
        await to_etcd.start()
        stack.push_async_callback(to_etcd.close)
        flags = coordinated(f"etcd://{LOOPBACK}:{to_etcd.port}", prefix)
        nodes = [await procs.spawn(extra=[*flags, "--node-id", n]) for n in "abc"]
        a = nodes[0]
        clients = await open_clients(stack, nodes)
        await until_agreed(clients)
        names = [f"f{i}" for i in range(30)]
        await clients["b"].update_arrays(numbered(names, 0))

        if fault == "stalled":
            to_etcd.stall_from(a.pid)
        else:
            a.signal(signal.SIGSTOP)
        lost = await until_agreed({"b": clients["b"], "c": clients["c"]}, {"b", "c"})
        for t in (await topologies({"b": clients["b"], "c": clients["c"]})).values():
            assert {m.node_id: m.state for m in t.members}["a"] == "failed"  # (not "left")
        await asyncio.sleep(3 * TTL)  # (A's calls keep timing out meanwhile)
        if fault == "stalled":
            to_etcd.heal()
        else:
            a.signal(signal.SIGCONT)
        await a.wait_stderr("lost its lease", timeout=FORM_TIMEOUT)
        healed = await until_one_view(clients)
        assert healed > lost

        joined = await procs.spawn(extra=[*flags, "--node-id", "d"])
        clients["d"] = await stack.enter_async_context(joined.client())
        assert await until_one_view(clients) > healed
        await clients.pop("c").close()
        nodes[2].signal(signal.SIGTERM)  # a planned leave: it hands its keys off first
        assert await nodes[2].wait_exit(timeout=60.0) == 0
        await until_one_view(clients)

        # Through A: a routed client (it splits calls by A's topology) and a founding one.
        async with ParameterClient(a.address, timeout=10) as routed:
            await routed.update_arrays(numbered(names, 100))
            await assert_numbered(routed, names, 100)
        await clients["a"].update_arrays(numbered(names, 200))
        for client in clients.values():
            await assert_numbered(client, names, 200)
        states = await replica_states(clients, names)
        assert len(states) == R * len(names)


async def test_a_node_back_from_a_lost_lease_does_not_undo_keys_written_anew_meanwhile(
    etcd: Etcd, procs: ProcessCluster
) -> None:
    """One copy of each key (R=1). While A is stopped past its lease, its keys are placed
    on B and C, where no copy of them is: a write there makes them anew, from version 1.
    A resumed registers anew: its copies, from before, yield to those writes (the keys hold
    them, at versions above A's), and the keys no one wrote meanwhile are A's again, as
    they were. (See aioparamsync.cluster.recovered.)"""
    prefix = new_prefix()
    async with contextlib.AsyncExitStack() as stack:
        flags = coordinated(etcd.endpoint, prefix, "--replication-factor", "1")
        nodes = [await procs.spawn(extra=[*flags, "--node-id", n]) for n in "abc"]
        a = nodes[0]
        clients = await open_clients(stack, nodes)
        await until_agreed(clients)
        names = [f"g{i:02d}" for i in range(30)]
        for step in range(3):  # (each at version 3)
            await clients["b"].update_arrays(numbered(names, step))
        placement = placement_of(await clients["b"].topology())
        its = [n for n in names if placement.primary(n, {"a", "b", "c"}) == "a"]
        assert len(its) >= 2, f"A is the primary of {its} alone"
        anew, untouched = its[: len(its) // 2], its[len(its) // 2 :]

        a.signal(signal.SIGSTOP)
        others = {"b": clients["b"], "c": clients["c"]}
        await until_agreed(others, {"b", "c"})
        await eventually(
            lambda: clients["b"].update_arrays(numbered(anew, 100)),
            timeout=FORM_TIMEOUT,
            interval=POLL,
            retry_on=RETRY,
        )
        made = await clients["b"].get_parameters(anew)
        assert {p.version for p in made.params} == {1}  # (made anew: no copy was there)
        a.signal(signal.SIGCONT)
        await a.wait_stderr("lost its lease", timeout=FORM_TIMEOUT)
        await until_one_view(clients)

        async def as_expected() -> None:
            for me, client in clients.items():
                response = await client.get_parameters(names)
                got = {
                    p.name: (p.version, np.frombuffer(p.data, np.float32)[0])
                    for p in response.params
                }
                for i, n in enumerate(anew):  # the later write, at a version above A's
                    assert got[n][1] == 100 + i and got[n][0] > 3, (me, n, got[n])
                for n in untouched:  # as A held it
                    assert got[n] == (3, 2 + names.index(n)), (me, n, got[n])

        await eventually(as_expected, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY)


async def test_members_claim_keys_through_their_records_and_lose_no_fold(etcd: Etcd) -> None:
    """Placement balanced by bytes under a coordinator: a member claims keys by writing
    them into its own record, so every node sees the claim at one revision (the epoch);
    pushes meanwhile are each folded once; every node places keys by the same claims."""
    prefix = new_prefix()
    cluster = LocalCluster(replication_factor=1)
    nbytes = 64 * 1024
    names = [f"layer{i}.weight" for i in range(24)]
    try:
        kw: dict[str, Any] = {
            "coordinator": etcd.endpoint,
            "coordinator_prefix": prefix,
            "failure_timeout": TTL,
            "balance_interval": 0.3,
        }
        nodes = [await cluster.start(**kw) for _ in range(3)]
        ids = {n.node_id for n in nodes}

        def formed() -> None:
            for node in nodes:
                assert node.cluster.state == "up" and set(node.cluster.view.live) == ids

        await eventually(formed, timeout=30)
        async with ParameterClient(nodes[0].address, timeout=30) as client:
            zeros = np.zeros(nbytes // 4, np.float32)
            await client.update_arrays(dict.fromkeys(names, zeros), rules=sum_rule())

            def loads() -> list[int]:
                placement = nodes[0].cluster.placement
                load = dict.fromkeys(ids, 0)
                for name in names:
                    load[placement.primary(name, ids)] += nbytes
                return sorted(load.values())

            before, pushes = loads(), 0
            deadline = asyncio.get_running_loop().time() + 60
            while (max(loads()) > 1.1 * sum(loads()) / 3 or pushes < 10) and (
                asyncio.get_running_loop().time() < deadline
            ):
                await client.push_gradients(dict.fromkeys(names, np.ones(nbytes // 4, np.float32)))
                pushes += 1
            after = loads()
            assert max(after) <= 1.1 * sum(after) / 3, (before, after)

            def one_view() -> None:
                for node in nodes:
                    assert node.cluster.placement == nodes[0].cluster.placement
                    assert node.cluster.epoch == nodes[0].cluster.epoch

            await eventually(one_view, timeout=30)
            claims = dict(nodes[0].cluster.placement.claims)
            if max(before) > 1.1 * sum(before) / 3:  # (as hashing placed them: most runs)
                assert claims, before
            # the claims are in the claimers' records in etcd, as every node places by them
            held = await members_in_etcd(etcd, prefix)
            in_etcd = {k: m for m, (value, _) in held.items() for k in value.get("claims", {})}
            assert in_etcd == claims
            for node in nodes:
                async with ParameterClient(node.address, route=False, timeout=30) as alone:
                    got = await alone.get_arrays(names)
                    for name in names:
                        assert got[name].tolist() == [float(pushes)] * (nbytes // 4), name
    finally:
        await cluster.close()


async def test_a_claim_written_but_answered_as_failed_is_taken_back(etcd: Etcd) -> None:
    """etcd applies a claim's write but its answer is lost (the claimer sees a failure),
    and the write taking it back fails too: the claimer writes it back again until etcd
    answers, so its record claims nothing it has not settled, and every node places the
    key where it was, as the claimer does. (The fault is put in the claimer's own calls:
    the claim's write goes to etcd and is answered as failed; the first write taking it
    back fails without being sent.)"""
    prefix = new_prefix()
    cluster = LocalCluster(replication_factor=1)
    kw: dict[str, Any] = {
        "coordinator": etcd.endpoint,
        "coordinator_prefix": prefix,
        "failure_timeout": TTL,
        "balance_interval": 0,
    }
    try:
        a, b = await cluster.start(**kw), await cluster.start(**kw)

        def formed() -> None:
            for node in (a, b):
                assert node.cluster.state == "up" and node.cluster.settling is None
                assert set(node.cluster.view.live) == {a.node_id, b.node_id}

        await eventually(formed, timeout=30)
        key = next(
            k
            for k in (f"w{i}" for i in range(100))
            if a.cluster.placement.primary(k, a.cluster.live) == a.node_id
        )
        coordinator = b.cluster.coordinator
        assert coordinator is not None
        real = coordinator.set_state
        faults = ["lost answer", "not sent"]

        async def faulty(state: str, claims: Any = None, claiming: Any = None) -> bool:
            if claims and key in claims and faults[:1] == ["lost answer"]:
                faults.pop(0)
                await real(state, claims, claiming)
                return False
            if faults == ["not sent"] and not (claims and key in claims):
                faults.pop(0)
                return False
            return await real(state, claims, claiming)

        coordinator.set_state = faulty  # type: ignore[method-assign]
        assert not await b.cluster.transitions.claim([key])
        assert not faults  # (both faults met)
        assert key not in b.cluster.claims

        async def taken_back() -> None:
            held = await members_in_etcd(etcd, prefix)
            claimed = {k for value, _ in held.values() for k in value.get("claims", {})}
            assert key not in claimed, held
            for node in (a, b):
                assert node.cluster.placement.primary(key, node.cluster.live) == a.node_id

        await eventually(taken_back, timeout=30)
        async with ParameterClient(b.address, timeout=30) as client:
            await client.update_arrays({key: np.zeros(4, np.float32)}, rules=sum_rule())
            await client.push_gradients({key: np.ones(4, np.float32)})
            got = await client.get_arrays([key])
            assert got[key].tolist() == [1.0] * 4
    finally:
        await cluster.close()
