"""Sharding, as processes: placement and balance, a node killed, one joining, one drained,
a partition healed, gradients folded at each key's primary.

Every node is a ``python -m aioparamsync`` child process on 127.0.0.1 and a port the kernel
picked (``ProcessCluster``; killed by PID at teardown). Every wait is a poll bounded by a
deadline (``eventually``), and no timing is asserted. The nodes run on uvloop in their own
processes; this test's loop runs only clients and the fault proxy, so each test runs on one
loop (asyncio's own), not on both as the in-process tests do.

"Settled" (``assert_placed``): every node is up and sees the same members up; none has keys
moving or under-replicated; and each key is held by exactly the nodes placement gives it
(``Placement(members up, R).replicas(key)``), so the nodes' parameter counts add up to R
times the keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import types
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from cluster_helpers import (
    LOOPBACK,
    NodeProcess,
    ProcessCluster,
    State,
    eventually,
    launch,
    open_clients,
    placement_of,
    run_process,
    spawn_cluster,
    wait_formed,
)
from test_interop import _generate, apache_client

from aioparamsync import (
    CallTimeout,
    NetworkError,
    ParameterClient,
    RequestError,
    sum_rule,
)
from aioparamsync.placement import DEFAULT_REPLICATION_FACTOR, Placement
from aioparamsync.wire import SEED_IDL_PATH

pytestmark = [
    # (see the module's docstring: the nodes are processes; one client loop is enough)
    pytest.mark.asyncio(loop_factories=["asyncio"]),
    # Each test takes 3 to 15 s here (2 cores); its waits are bounded below this.
    pytest.mark.timeout(90),
]

KiB = 1024
R = 2
# Polls over the wire retry these (a node busy or starting may be slow to answer).
RETRY = (AssertionError, NetworkError, CallTimeout)
# Bounds of the waits (seconds): a cluster forming; keys handed off and re-replicated
# (a link in backoff retries within links.BACKOFF_MAX, 5 s, and rebalancing rounds run at
# each new epoch and every repair interval); writers making progress.
FORM_TIMEOUT = 30.0
SETTLE_TIMEOUT = 45.0
PROGRESS_TIMEOUT = 30.0
POLL = 0.2  # (the nodes share 2 cores with this test: poll them gently)
CALL_TIMEOUT = 15.0


# The last lines of each node's log shown with a failure (what pytest shows of the
# teardown's output).
LOG_TAIL = 80


@pytest.fixture
async def procs() -> AsyncIterator[ProcessCluster]:
    """Node processes holding each key twice; every one is killed (by PID) at teardown,
    and its log printed (pytest shows it when the test failed)."""
    cluster = ProcessCluster(repair_interval=0.5, replication_factor=str(R))
    try:
        yield cluster
    finally:
        await cluster.close()
        cluster.show_logs(LOG_TAIL)


@pytest.fixture(scope="session")
def founding(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace | None:
    """Apache Thrift's Python of the founding IDL (as tests/test_interop.py makes it);
    None without the compiler (the test then skips that part, after the rest)."""
    if shutil.which("thrift") is None:
        return None
    return _generate(SEED_IDL_PATH, tmp_path_factory.mktemp("gen-seed-sharding"))


# -- helpers ----------------------------------------------------------------------------------


async def assert_placed(
    clients: Mapping[str, ParameterClient], names: Sequence[str], r: int = R
) -> dict[str, Any]:
    """Settled (see the module): answer each node's ``info()``, by node id.

    ``clients``: the nodes that are up (others may be in the topology, failed or left).
    """
    live = sorted(clients)
    infos = {}
    for node_id, client in clients.items():
        info = infos[node_id] = await client.info()
        states = {m.node_id: m.state for m in info.topology.members}
        up = sorted(m for m, s in states.items() if s == "up")
        assert info.state == "up" and up == live, f"{node_id} is {info.state} and sees {states}"
        assert not info.keys_moving, f"{node_id}: {info.keys_moving} keys moving"
        assert not info.under_replicated, f"{node_id}: {info.under_replicated} under-replicated"
    held = {}
    for node_id, client in clients.items():
        held[node_id] = {d.name for d in await client.call("digest")}
        assert held[node_id] <= set(names), f"{node_id} holds {held[node_id] - set(names)}"
    claims = {n: info.topology.claims or {} for n, info in infos.items()}
    assert len({tuple(sorted(c.items())) for c in claims.values()}) == 1, f"claims: {claims}"
    placement = Placement(live, r, claims[live[0]])  # (balance by bytes: claims move keys)
    wrong = {}
    for name in names:
        holders = {m for m, h in held.items() if name in h}
        if holders != set(placement.replicas(name)):
            wrong[name] = (sorted(holders), sorted(placement.replicas(name)))
    counts = {m: info.parameter_count for m, info in infos.items()}
    assert not wrong, (
        f"{len(wrong)} keys not held by their replicas (held by, placed at): "
        f"{dict(list(wrong.items())[:5])}; counts {counts}"
    )
    assert sum(counts.values()) == r * len(names), f"counts {counts} for {len(names)} keys"
    return infos


async def settled(
    clients: Mapping[str, ParameterClient], names: Sequence[str], r: int = R
) -> dict[str, Any]:
    return await eventually(
        lambda: assert_placed(clients, names, r),
        timeout=SETTLE_TIMEOUT,
        interval=POLL,
        retry_on=RETRY,
    )


async def read_state(client: ParameterClient, names: Sequence[str]) -> State:
    """name -> (version, origin, bytes), as ``client``'s node (or nodes) answer."""
    response = await client.get_parameters(list(names))
    return {p.name: (p.version, p.origin, bytes(p.data)) for p in response.params}


def value(writer: int, key: int, seq: int) -> np.ndarray:
    """A write's value, distinct for each (writer, key, seq): 4 KiB."""
    array = np.zeros(512, np.int64)
    array[:3] = writer, key, seq
    return array


@dataclass
class Writers:
    """Writer coroutines, each writing its own keys in turn, one write at a time.

    A write that fails (a network error, a refusal, a timeout) is not acknowledged; it may
    or may not have been applied. ``attempts[name]``: the bytes of every write of ``name``
    made, in order (each distinct); ``acked[name]``: (attempt, version) of each one
    acknowledged, in order.
    """

    client: ParameterClient
    keys: Sequence[Sequence[str]]  # each writer's keys
    acks: str | None = None
    attempts: dict[str, list[bytes]] = field(default_factory=dict)
    acked: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)  # acknowledged writes, by writer
    failures: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def write(self, writer: int, name: str, seq: int) -> bool:
        array = value(writer, int(name[1:]), seq)
        attempts = self.attempts.setdefault(name, [])
        attempts.append(array.tobytes())
        try:
            versions = await self.client.update_arrays({name: array}, acks=self.acks)
        except (NetworkError, RequestError, CallTimeout) as exc:
            self.failures.append(f"{name}: {type(exc).__name__}: {exc}")
            return False
        self.acked.setdefault(name, []).append((len(attempts) - 1, versions[name]))
        return True

    def start(self) -> None:
        self.counts = [0] * len(self.keys)
        self._tasks = [
            asyncio.ensure_future(self._run(w, names)) for w, names in enumerate(self.keys)
        ]

    async def _run(self, writer: int, names: Sequence[str]) -> None:
        seq = 0
        while not self._stop.is_set():
            seq += 1
            if await self.write(writer, names[seq % len(names)], seq):
                self.counts[writer] += 1
            else:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.01)  # (leave the 2 cores to the nodes too)

    async def progressed(self, more_than: Sequence[int]) -> None:
        """Wait until each writer has more acknowledged writes than ``more_than`` says."""

        def check() -> None:
            for task in self._tasks:
                if task.done():
                    task.result()  # (a writer's own error fails the test)
                    raise RuntimeError("a writer ended")
            assert all(c > m for c, m in zip(self.counts, more_than, strict=True)), (
                f"acknowledged writes {self.counts}, waiting for more than {list(more_than)}; "
                f"last failures {self.failures[-3:]}"
            )

        await eventually(check, timeout=PROGRESS_TIMEOUT, interval=POLL)

    async def stop(self) -> None:
        self._stop.set()
        async with asyncio.timeout(CALL_TIMEOUT * 2):
            await asyncio.gather(*self._tasks)  # (a writer's own error fails the test)

    async def close(self) -> None:
        """Cancel the writers still running (a test that failed midway)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def check(self, state: State, where: str) -> None:
        """Every key holds its last acknowledged write, or a write attempted after it.

        Per key (one writer writes each key, one write at a time), ``state`` must hold the
        bytes of the write acknowledged last, or of one attempted after it (not
        acknowledged: its outcome is unknown), at a version no lower than any acknowledged.
        """
        lost = []
        for name, acked in self.acked.items():
            attempts = self.attempts[name]
            last, _ = acked[-1]
            highest = max(v for _, v in acked)
            assert name in state, f"{where}: {name!r} is missing (acknowledged at v{highest})"
            version, _, data = state[name]
            assert data in attempts, f"{where}: {name!r} v{version} holds bytes never written"
            held = attempts.index(data)
            if held < last or version < highest:
                lost.append(
                    f"{name!r}: write #{last} acknowledged last (v{acked[-1][1]}; highest "
                    f"acknowledged v{highest}), {where} has write #{held} at v{version}"
                )
        assert not lost, f"acknowledged writes lost ({len(lost)}): {lost[:5]}"


async def check_everywhere(
    writers: Writers, routed: ParameterClient, clients: Mapping[str, ParameterClient]
) -> None:
    """What ``writers`` acknowledged reads back through the routed client and every node."""
    names = sorted(writers.acked)
    writers.check(await read_state(routed, names), "the routed client")
    for node_id, client in clients.items():
        writers.check(await read_state(client, names), f"node {node_id}")


async def written(
    stack: contextlib.AsyncExitStack, nodes: Sequence[NodeProcess], names: Sequence[str], n: int
) -> tuple[dict[str, ParameterClient], ParameterClient, Writers]:
    """The cluster formed, ``n`` writers (not started) of ``names`` through a routed client,
    each name written once: (a client of each node by id, the routed client, the writers)."""
    clients = await open_clients(stack, nodes)
    await wait_formed(clients)
    routed = await stack.enter_async_context(
        ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT)
    )
    writers = Writers(routed, keys_of(names, n))
    stack.push_async_callback(writers.close)
    for w, keys in enumerate(writers.keys):
        for name in keys:
            assert await writers.write(w, name, 0), writers.failures
    return clients, routed, writers


def keys_of(names: Sequence[str], writers: int) -> list[list[str]]:
    """``names`` dealt to ``writers`` (each key is written by one writer only)."""
    return [list(names[w::writers]) for w in range(writers)]


# -- 1. placement, balance, and every name through every node -------------------------------

N_KEYS = 100
ELEMENTS = 4 * KiB  # float32: 16 KiB each
# Each key is on R=2 of the 5 nodes, as the ranking of a hash of (node id, key) puts it, and
# the node ids are 127.0.0.1:<a port the kernel picked>: a node's count of the 100 keys is
# binomial, B(100, 2/5): 40 give or take 4.9. Its share of the keys' bytes (all keys are the
# same size) is its count / 100. Outside [0.15, 0.65] (5 standard deviations) the chance is
# 1.5e-7 per node, under 1e-6 for any of the 5: a run never fails on it by chance. (Bounds
# of [0.2, 0.6] would fail one run in about 8000.)
SHARE_BOUNDS = (0.15, 0.65)


async def test_keys_are_placed_on_two_of_five_nodes_and_every_node_answers_every_name(
    procs: ProcessCluster, founding: types.SimpleNamespace | None
) -> None:
    nodes = await spawn_cluster(procs, 5)
    names = [f"layer{i:03d}.weight" for i in range(N_KEYS)]
    arrays = {
        name: np.arange(ELEMENTS, dtype=np.float32) + i * ELEMENTS for i, name in enumerate(names)
    }
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        await wait_formed(clients)
        routed = await stack.enter_async_context(
            ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT)
        )
        versions: dict[str, int] = {}
        for i in range(0, N_KEYS, 10):
            versions |= await routed.update_arrays({n: arrays[n] for n in names[i : i + 10]})
        assert versions == dict.fromkeys(names, 1)

        infos = await settled(clients, names)
        total = N_KEYS * ELEMENTS * 4
        shares = {m: info.parameter_bytes / total for m, info in infos.items()}
        low, high = SHARE_BOUNDS
        assert all(low <= s <= high for s in shares.values()), f"shares of the bytes: {shares}"

        # Every name, through every node alone (each passes on what it does not hold),
        # and through the routed client: the bytes written, version 1, one origin.
        expected = {name: arrays[name].tobytes() for name in names}
        origins: dict[str, str] = {}
        for where, client in [("routed", routed), *clients.items()]:
            state = await read_state(client, names)
            assert set(state) == set(names), f"{where} lacks {sorted(set(names) - set(state))}"
            for name, (version, origin, data) in state.items():
                assert (version, data) == (1, expected[name]), f"{where}: {name!r} v{version}"
                assert origins.setdefault(name, origin) == origin, f"{where}: {name!r} {origin}"

        # The founding IDL's get_parameters, from Apache Thrift's generated client.
        if founding is None:
            pytest.skip(
                "Apache Thrift's compiler (`thrift`) is not on PATH: the rest of this test "
                "passed, the reads by its generated client were not made"
            )
        T = founding.ttypes
        for node in nodes:
            async with apache_client(founding, node) as thrift_client:
                response = await thrift_client.get_parameters(T.ParameterRequest(names))
            got = {p.name: (p.version, p.data) for p in response.params}
            assert got == {n: (1, expected[n]) for n in names}, f"founding client at {node}"


# -- 2. a node killed under writes -----------------------------------------------------------

FAILURE_TIMEOUT = 2.0


async def test_a_killed_node_loses_no_acknowledged_write_and_its_keys_are_copied_again(
    procs: ProcessCluster,
) -> None:
    nodes = await spawn_cluster(
        procs, 4, ["--acks", "all", "--failure-timeout", str(FAILURE_TIMEOUT)]
    )
    names = [f"k{i:02d}" for i in range(40)]
    async with contextlib.AsyncExitStack() as stack:
        clients, routed, writers = await written(stack, nodes, names, 2)
        infos = await settled(clients, names)

        # The victim: not the routed client's node; the primary of the most keys.
        placement = placement_of(next(iter(infos.values())).topology)
        primaries = [placement.primary(n, set(clients)) for n in names]
        victim = max(nodes[1:], key=lambda n: primaries.count(n.node_id))
        its_keys = [n for n, p in zip(names, primaries, strict=True) if p == victim.node_id]
        assert its_keys

        writers.start()
        await writers.progressed([5, 5])
        loop = asyncio.get_running_loop()
        before = list(writers.counts)
        await victim.kill()  # SIGKILL
        killed_at = loop.time()
        survivors = {m: c for m, c in clients.items() if m != victim.node_id}
        acked_before = {n: len(writers.acked[n]) for n in its_keys}

        def failed_over() -> None:
            # Past the failure timeout, writes of the victim's keys are acknowledged again.
            assert loop.time() - killed_at > FAILURE_TIMEOUT + 1
            again = [n for n in its_keys if len(writers.acked[n]) > acked_before[n] + 1]
            assert again, f"no key of the victim written since; failures {writers.failures[-3:]}"

        await eventually(failed_over, timeout=PROGRESS_TIMEOUT, interval=POLL)
        await writers.progressed([c + 10 for c in before])
        await writers.stop()

        await settled(survivors, names)
        await check_everywhere(writers, routed, survivors)


# -- 3. a node joining under writes ----------------------------------------------------------


async def test_a_node_joining_takes_its_share_and_no_acknowledged_write_is_lost(
    procs: ProcessCluster,
) -> None:
    nodes = await spawn_cluster(procs, 3)
    names = [f"k{i:02d}" for i in range(60)]
    async with contextlib.AsyncExitStack() as stack:
        clients, routed, writers = await written(stack, nodes, names, 2)
        before = {m: info.parameter_count for m, info in (await settled(clients, names)).items()}

        writers.start()
        await writers.progressed([5, 5])
        joiner = await procs.spawn(peers=[nodes[0]])
        all_clients = {**clients, **(await open_clients(stack, [joiner]))}
        await settled(all_clients, names)
        await writers.progressed([c + 10 for c in writers.counts])
        await writers.stop()

        infos = await settled(all_clients, names)
        after = {m: info.parameter_count for m, info in infos.items()}
        assert after[joiner.node_id] > 0, after
        # (a member joining only takes keys: none of the others holds more than before)
        assert all(after[m] <= before[m] for m in before), f"before {before}, after {after}"
        assert sum(after[m] for m in before) == R * len(names) - after[joiner.node_id]
        await check_everywhere(writers, routed, all_clients)


# -- 4. a node drained --------------------------------------------------------------------------

HANDED_OFF = re.compile(r"handed off (\d+) keys")


async def test_a_drained_node_hands_its_keys_off_and_exits_by_itself(
    procs: ProcessCluster,
) -> None:
    nodes = await spawn_cluster(procs, 4, ["--drain-timeout", "20"])
    names = [f"k{i:02d}" for i in range(60)]
    async with contextlib.AsyncExitStack() as stack:
        clients, routed, writers = await written(stack, nodes, names, 1)
        counts = {m: info.parameter_count for m, info in (await settled(clients, names)).items()}

        leaver = nodes[3]
        await clients.pop(leaver.node_id).close()
        rc, out, err = await run_process(
            sys.executable,
            "-m",
            "aioparamsync.ctl",
            "drain",
            "--timeout",
            "40",
            leaver.address_text,
            timeout=60,
        )
        assert rc == 0, f"aioparamsync-ctl drain exited {rc}:\n{out}{err}"
        handed = HANDED_OFF.search(out)
        assert handed is not None, out
        assert int(handed[1]) == counts[leaver.node_id], (out, counts)
        exit_code = await leaver.wait_exit(timeout=30)
        assert exit_code == 0, f"the drained node exited {exit_code}:\n{leaver.stderr}"

        await settled(clients, names)
        await check_everywhere(writers, routed, clients)


# -- 5. a partition healed ----------------------------------------------------------------------


def _process_holds(pid: int, local_port: int, remote_port: int) -> bool:
    """Whether process ``pid`` holds the TCP socket from ``local_port`` to ``remote_port``
    (both on this host): Linux's /proc/net/tcp gives the socket's inode, /proc/PID/fd its owner.
    (/proc/net/tcp6 too: a dual-stack socket, as gRPC makes, reaches 127.0.0.1 from there.)
    """
    inodes = set()
    rows = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as table:
            rows += table.readlines()[1:]
    if not rows:
        return False
    for row in rows:
        fields = row.split()
        local, remote = fields[1].split(":")[1], fields[2].split(":")[1]
        if int(local, 16) == local_port and int(remote, 16) == remote_port:
            inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    fds = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                if os.readlink(f"{fds}/{fd}") in inodes:
                    return True
    return False


@dataclass(eq=False)
class _Pipe:
    """One connection through a :class:`FaultProxy`: its two ends, its client's port, and
    whether bytes flow through it (they wait while it is stalled)."""

    ends: list[asyncio.StreamWriter]
    client_port: int
    flowing: asyncio.Event = field(default_factory=asyncio.Event)


class FaultProxy:
    """A TCP proxy in front of one node (as asyncpg's ``_testbase/fuzzer.py``).

    It forwards bytes both ways between each connection it accepts and the node.
    :meth:`cut` closes every connection and refuses new ones; :meth:`cut_from` does so
    for the connections made by one process (a node's links to this one);
    :meth:`stall_from` keeps that process's connections, and accepts its new ones, but
    forwards none of their bytes (a network that drops packets: calls hang, they do not
    fail); :meth:`heal` lets connections through again (stalled bytes flow on). It
    listens on a port the kernel picks. In front of a node it starts (:meth:`spawn`), it
    learns the node's port once the node listens; what it accepts before waits for it.
    """

    def __init__(self, target_port: int | None = None) -> None:
        self.target = (LOOPBACK, target_port or 0)
        self._known = asyncio.Event()  # (the target's port)
        if target_port is not None:
            self._known.set()
        self.port = 0
        self.cut_all = False
        self.cut_pids: set[int] = set()
        self.stall_pids: set[int] = set()
        self.refused = 0
        self._server: asyncio.Server | None = None
        self._pipes: dict[asyncio.Task[Any], _Pipe] = {}

    @property
    def address_text(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, LOOPBACK, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def spawn(self, procs: ProcessCluster, extra: Iterable[str] = ()) -> NodeProcess:
        """A node of ``procs`` behind this proxy, on a port the kernel picks for it (a
        port found free before could be taken meanwhile, by any connection's own end)."""
        node = await procs.spawn(extra=extra)
        self.target = (LOOPBACK, node.port)
        self._known.set()
        return node

    def _made_by(self, pids: Iterable[int], client_port: int) -> bool:
        return any(_process_holds(pid, client_port, self.port) for pid in pids)

    def _refuses(self, client_port: int) -> bool:
        return self.cut_all or self._made_by(self.cut_pids, client_port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client_port = writer.get_extra_info("peername")[1]
        if self._refuses(client_port):
            self.refused += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        pipe = self._pipes[task] = _Pipe([writer], client_port)
        if not self._made_by(self.stall_pids, client_port):
            pipe.flowing.set()
        try:
            try:
                await self._known.wait()
                node_reader, node_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            pipe.ends.append(node_writer)
            if self._refuses(client_port):  # (cut while it connected)
                return
            await asyncio.gather(
                self._pump(reader, node_writer, pipe), self._pump(node_reader, writer, pipe)
            )
        finally:
            del self._pipes[task]
            for end in pipe.ends:
                end.transport.abort()

    @staticmethod
    async def _pump(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pipe: _Pipe
    ) -> None:
        try:
            while data := await reader.read(64 * KiB):
                await pipe.flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()  # (one way ends: both do)

    def _abort(self, chosen: Iterable[_Pipe]) -> None:
        for pipe in list(chosen):
            for end in pipe.ends:
                end.transport.abort()

    def cut(self) -> None:
        self.cut_all = True
        self._abort(self._pipes.values())

    def cut_from(self, pid: int) -> None:
        self.cut_pids.add(pid)
        self._abort(p for p in self._pipes.values() if self._made_by([pid], p.client_port))

    def stall_from(self, pid: int) -> None:
        self.stall_pids.add(pid)
        for pipe in list(self._pipes.values()):
            if self._made_by([pid], pipe.client_port):
                pipe.flowing.clear()

    def heal(self) -> None:
        self.cut_all = False
        self.cut_pids.clear()
        self.stall_pids.clear()
        for pipe in self._pipes.values():
            pipe.flowing.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._abort(self._pipes.values())
        tasks = list(self._pipes)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def assert_states(
    clients: Mapping[str, ParameterClient], names: Sequence[str], expected: State | None = None
) -> State:
    """Every node answers the same (version, origin, bytes) for every name (``expected``)."""
    states = {node_id: await read_state(client, names) for node_id, client in clients.items()}
    if expected is None:
        expected = next(iter(states.values()))
    assert set(expected) == set(names), f"holds {sorted(expected)}"
    for node_id, state in states.items():
        differ = {n: state.get(n, (None, None))[:2] for n in names if state.get(n) != expected[n]}
        wanted = {n: expected[n][:2] for n in differ}
        assert not differ, f"{node_id} answers {differ}, not {wanted} (or other bytes)"
    return expected


async def _peer_links(client: ParameterClient) -> dict[str, str]:
    """The node's peer links: address -> state."""
    return {p.address: p.state for p in (await client.info()).peers or []}


@pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp"), reason="the fault proxy tells a node's links by /proc"
)
async def test_writes_on_both_sides_of_a_healed_partition_converge_everywhere(
    procs: ProcessCluster,
) -> None:
    # Each node behind its own proxy, which its peers reach it through (--advertise); it
    # listens on its own port. The partition cuts C off both ways: the links to C at C's
    # proxy, and C's links to A and B at theirs (C's connections, known by its PID).
    async with contextlib.AsyncExitStack() as stack:
        proxies = [FaultProxy() for _ in range(3)]
        for proxy in proxies:
            await proxy.start()
            stack.push_async_callback(proxy.close)
        pa, pb, pc = proxies

        def flags(proxy: FaultProxy, *seeds: FaultProxy) -> list[str]:
            extra = ["--replication-factor", "all", "--advertise", proxy.address_text]
            if seeds:
                extra += ["--peers", ",".join(s.address_text for s in seeds)]
            return extra

        a = await pa.spawn(procs, flags(pa))
        b, c = await asyncio.gather(pb.spawn(procs, flags(pb, pa)), pc.spawn(procs, flags(pc, pa)))
        clients = await open_clients(stack, [a, b, c])
        ca, cb, cc = clients.values()
        assert list(clients) == [p.address_text for p in proxies]  # (ids: where peers reach)
        await wait_formed(clients)

        async def mesh_through_proxies() -> None:
            for node_id, client in clients.items():
                others = {p.address_text for p in proxies} - {node_id}
                links = await _peer_links(client)
                assert links == dict.fromkeys(others, "up"), f"{node_id}: {links}"

        await eventually(mesh_through_proxies, timeout=FORM_TIMEOUT, interval=POLL, retry_on=RETRY)

        names = [f"s{i}" for i in range(9)]
        await ca.update_arrays({n: np.zeros(8) for n in names})

        await eventually(
            lambda: assert_states(clients, names),
            timeout=FORM_TIMEOUT,
            interval=POLL,
            retry_on=RETRY,
        )

        pc.cut()
        pa.cut_from(c.pid)
        pb.cut_from(c.pid)

        async def c_cut_off() -> None:
            for client, others in ((ca, [pc]), (cb, [pc]), (cc, [pa, pb])):
                links = await _peer_links(client)
                assert all(links[p.address_text] != "up" for p in others), links

        await eventually(c_cut_off, timeout=FORM_TIMEOUT, interval=POLL, retry_on=RETRY)

        # The same keys written on both sides: A ahead on some (more writes), C on others,
        # and as many writes on both on the rest (last-writer-wins by origin decides).
        for i, name in enumerate(names):
            for j in range(1 + i % 3):
                await ca.update_arrays({name: np.full(8, 100.0 * i + j)})
            for j in range(1 + (i // 3) % 3):
                await cc.update_arrays({name: np.full(8, -100.0 * i - j)})
        at_a, at_c = await read_state(ca, names), await read_state(cc, names)
        # B has A's writes (A and B still reach each other), and none of C's.
        await eventually(
            lambda: assert_states({b.node_id: cb}, names, at_a),
            timeout=FORM_TIMEOUT,
            interval=POLL,
            retry_on=RETRY,
        )
        assert await read_state(ca, names) == at_a, "C's writes reached A through the cut"
        assert await read_state(cc, names) == at_c, "A's writes reached C through the cut"
        assert all(at_a[n][1] != at_c[n][1] for n in names)  # (two origins: two sides)
        assert pc.refused + pa.refused + pb.refused > 0  # (links retried, and were refused)

        for proxy in proxies:
            proxy.heal()
        # last writer wins: the larger (version, origin) of each key
        expected = {n: max(at_a[n], at_c[n], key=lambda s: (s[0], s[1])) for n in names}
        await eventually(
            lambda: assert_states(clients, names, expected),
            timeout=SETTLE_TIMEOUT,
            interval=POLL,
            retry_on=RETRY,
        )
        # Both sides won somewhere (C's origin or A's decides the ties, not all of them).
        assert {expected[n][1] for n in names} == {at_a[names[0]][1], at_c[names[0]][1]}


# -- 6. gradients pushed at every node ----------------------------------------------------------


async def test_gradients_pushed_concurrently_at_every_node_are_each_folded_once(
    procs: ProcessCluster,
) -> None:
    nodes = await spawn_cluster(procs, 3)
    names = [f"g{i:02d}" for i in range(12)]
    shape = (16, 16)
    pushers_per_node, pushes_each = 5, 6  # each node's client: 5 concurrent pushers
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        await wait_formed(clients)
        routed = await stack.enter_async_context(
            ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT)
        )
        await routed.update_arrays(
            {n: np.zeros(shape, np.float32) for n in names}, rules=sum_rule()
        )
        await settled(clients, names)

        ones = {n: np.ones(shape, np.float32) for n in names}

        async def pusher(client: ParameterClient) -> None:
            for _ in range(pushes_each):
                await client.push_gradients(ones)

        async with asyncio.timeout(90):
            await asyncio.gather(
                *(pusher(c) for c in clients.values() for _ in range(pushers_per_node))
            )
        pushes = len(nodes) * pushers_per_node * pushes_each

        async def folded_once_everywhere() -> None:
            for node_id, client in clients.items():
                response = await client.get_parameters(names)
                got = {p.name: p for p in response.params}
                for name in names:
                    p = got[name]
                    array = np.frombuffer(p.data, np.float32)
                    assert (array == pushes).all(), (
                        f"{node_id}: {name!r} v{p.version} holds {sorted(set(array.tolist()))}, "
                        f"{pushes} pushes of ones made"
                    )
                    assert p.version == 1 + pushes, f"{node_id}: {name!r} v{p.version}"

        await eventually(
            folded_once_everywhere, timeout=SETTLE_TIMEOUT, interval=POLL, retry_on=RETRY
        )
        await settled(clients, names)


# -- 7. a large parameter, partitioned ------------------------------------------------------------


async def test_a_large_parameter_spreads_over_node_processes_and_outlives_a_killed_one(
    procs: ProcessCluster, founding: types.SimpleNamespace | None
) -> None:
    # 4 MiB of float32 in partitions of 128 KiB (--partition-bytes): 32 of them, each on 2
    # of 4 nodes (as a fair coin each), so each node holds about half of the bytes, never
    # all: 28 or more of 32 at one of 4 nodes has odds of about 1 in 26,000.
    flags = ["--partition-bytes", "128KiB", "--failure-timeout", str(FAILURE_TIMEOUT)]
    nodes = await spawn_cluster(procs, 4, flags)
    w = np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024)
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        await wait_formed(clients)
        routed = await stack.enter_async_context(
            ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT)
        )
        await routed.routes.learn()
        assert routed.routes.topology is not None
        assert routed.routes.topology.partition_bytes == 128 * KiB
        assert await routed.update_arrays({"w": w}, rules=sum_rule(), acks="all") == {"w": 1}
        held = {m: (await c.info()).parameter_bytes for m, c in clients.items()}
        assert sum(held.values()) >= 2 * w.nbytes, held
        assert all(0 < b < 28 / 32 * w.nbytes for b in held.values()), f"bytes held: {held}"

        victim = nodes[-1]
        assert await victim.kill() == -signal.SIGKILL
        del clients[victim.node_id]
        # Reads and gradient pushes go on, at each partition's next replica.
        assert np.array_equal((await routed.get_arrays(["w"]))["w"], w)
        assert await routed.push_gradients({"w": np.ones_like(w)}, acks="all") == {"w": 2}
        for node_id, client in clients.items():
            got = (await client.get_arrays(["w"]))["w"]
            bad = np.flatnonzero(got.reshape(-1) != (w + 1).reshape(-1))
            assert got.shape == w.shape and not bad.size, f"{node_id}: {bad.size} elements differ"
        if founding is None:
            pytest.skip("Apache Thrift's compiler (`thrift`) is not on PATH: the rest passed")
        T = founding.ttypes
        async with apache_client(founding, nodes[1]) as thrift_client:
            response = await thrift_client.get_parameters(T.ParameterRequest(["w"]))
        assert [(p.name, p.version, p.data) for p in response.params] == [
            ("w", 2, (w + 1).tobytes())
        ]


# -- 8. a node of another replication factor ------------------------------------------------------

# What a refusal says: "node X has replication factor A, node Y B: ..."
REFUSAL = re.compile(r"node \S+ has replication factor (\S+), node \S+ (\S+): ")


async def spawn_with_factor(
    procs: ProcessCluster, r: str | None, peers: Sequence[NodeProcess] = ()
) -> NodeProcess:
    """A node of replication factor ``r`` (None: started without the flag: the default)."""
    flags = ["--port", "0", "--repair-interval", str(procs.repair_interval)]
    if r is not None:
        flags += ["--replication-factor", r]
    if peers:
        flags += ["--peers", ",".join(p.address_text for p in peers)]
    node = await launch(*flags)
    procs.started.append(node)
    await node.wait_listening()
    return node


def assert_names_both(text: str, values: set[str]) -> None:
    """``text`` is a refusal naming both replication factors, ``values``."""
    found = REFUSAL.search(text)
    assert found is not None and set(found.groups()) == values, text


@pytest.mark.parametrize(
    ("who_announces", "cluster_r", "odd_r"),
    [
        ("odd", "2", None),  # it forgot the flag: the default (3)
        ("odd", "all", "2"),
        ("others", "2", "all"),
        ("others", "all", None),
    ],
)
async def test_a_node_of_another_replication_factor_is_refused_both_ways(
    procs: ProcessCluster, who_announces: str, cluster_r: str, odd_r: str | None
) -> None:
    """Three nodes of one replication factor and an odd one of another: whichever
    announces itself to whom, they form no cluster. The odd node's links, and theirs to
    it, are "refused", naming both values (info, logs at ERROR); no key is placed on it,
    and every name is read whole through every node of the cluster."""
    values = {cluster_r, odd_r or str(DEFAULT_REPLICATION_FACTOR)}
    flags = ["--replication-factor", cluster_r]
    if who_announces == "odd":
        nodes = await spawn_cluster(procs, 3, flags)
        odd = await spawn_with_factor(procs, odd_r, peers=nodes[:1])
    else:  # (each given the odd node first: it learns the others from one another)
        odd = await spawn_with_factor(procs, odd_r)
        nodes = [await procs.spawn(peers=[odd], extra=flags)]
        nodes += [await procs.spawn(peers=[odd, nodes[0]], extra=flags) for _ in range(2)]
    names = [f"r{i:02d}" for i in range(30)]
    async with contextlib.AsyncExitStack() as stack:
        clients = await open_clients(stack, nodes)
        await wait_formed(clients)  # (the three alone, each up)
        odd_client = await stack.enter_async_context(odd.client())

        async def odd_is_refused() -> None:
            info = await odd_client.info()
            assert info.peers and all(p.state == "refused" for p in info.peers), info.peers
            for p in info.peers:
                assert_names_both(p.last_error or "", values)
            assert [m.node_id for m in info.topology.members] == [odd.node_id]

        await eventually(odd_is_refused, timeout=FORM_TIMEOUT, interval=POLL, retry_on=RETRY)
        # The nodes it announced itself to, or that announced themselves to it, have a
        # refused link to it (the others do not know it).
        told = {nodes[0].node_id} if who_announces == "odd" else set(clients)
        by_id = {n.node_id: n for n in nodes}
        for node_id, client in clients.items():
            links = {p.address: p for p in (await client.info()).peers or []}
            link = links.get(odd.address_text)
            if node_id not in told:
                assert link is None, f"{node_id} linked the odd node: {link}"
                continue
            assert link is not None and link.state == "refused", (node_id, link)
            assert_names_both(link.last_error or "", values)
            errors = [line for line in by_id[node_id].stderr_lines if " ERROR " in line]
            assert errors, f"{node_id} logged no error"
            assert_names_both(errors[0], values)
        errors = [line for line in odd.stderr_lines if " ERROR " in line]
        assert errors, odd.stderr
        assert_names_both(errors[0], values)

        async with ParameterClient(nodes[1].address, timeout=CALL_TIMEOUT) as routed:
            await routed.update_arrays({n: np.full(4, i, np.float32) for i, n in enumerate(names)})
            r = 3 if cluster_r == "all" else int(cluster_r)
            await settled(clients, names, r)
            for where, client in [("routed", routed), *clients.items()]:
                got = await client.get_arrays(names)
                assert sorted(got) == names, f"{where} lacks {sorted(set(names) - set(got))}"
        assert (await odd_client.info()).parameter_count == 0  # (none placed on it)


@pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp"), reason="the fault proxy tells a node's links by /proc"
)
async def test_a_push_at_the_primary_waits_for_a_parameter_just_made_at_another_replica(
    procs: ProcessCluster,
) -> None:
    """An update is applied at any replica of its names; a gradient is folded at the
    primary. A parameter made at one replica and pushed to at once at its primary, before
    replication brought it there, waits there for it (a bounded time) rather than being
    refused as unknown. Here A's links to B are held back while A makes the parameter."""
    async with contextlib.AsyncExitStack() as stack:
        proxies = [FaultProxy() for _ in range(2)]
        for proxy in proxies:
            await proxy.start()
            stack.push_async_callback(proxy.close)
        pa, pb = proxies

        def flags(proxy: FaultProxy, *seeds: FaultProxy) -> list[str]:
            extra = ["--replication-factor", "2", "--advertise", proxy.address_text]
            extra += ["--balance-interval", "0"]
            return extra + (["--peers", ",".join(s.address_text for s in seeds)] if seeds else [])

        a = await pa.spawn(procs, flags(pa))
        b = await pb.spawn(procs, flags(pb, pa))
        clients = await open_clients(stack, [a, b])
        ca, cb = clients.values()
        await wait_formed(clients)
        members = list(clients)  # (ids: where peers reach them)
        name = next(
            n
            for n in (f"w{i}" for i in range(100))
            if Placement(members, 2).replicas(n)[0] == pb.address_text
        )
        pb.stall_from(a.pid)  # (A's links to B carry nothing until healed)
        await ca.update_arrays({name: np.zeros(4, np.float32)}, rules=sum_rule())
        asyncio.get_running_loop().call_later(0.3, pb.heal)
        await cb.push_gradients({name: np.ones(4, np.float32)})
        for client in (ca, cb):
            got = await eventually(
                lambda c=client: _one_fold(c, name), timeout=FORM_TIMEOUT, interval=POLL
            )
            assert got == [1.0] * 4


async def _one_fold(client: ParameterClient, name: str) -> list[float]:
    values = (await client.get_arrays([name]))[name].tolist()
    assert values == [1.0] * 4, values
    return values
