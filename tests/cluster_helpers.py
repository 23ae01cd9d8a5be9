"""Test helpers: in-process clusters, node processes (and the ``spawn`` fixture's), bounded polls.

Everything listens on 127.0.0.1 and a port the kernel picks (port 0), and every
wait is bounded by a deadline. Node processes are killed by PID at cleanup,
and a process that was SIGSTOPped is SIGCONTed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aioparamsync import CallTimeout, NetworkError, Node, ParameterClient
from aioparamsync.cli.taskdump import BEGIN as TASKS_BEGIN
from aioparamsync.cli.taskdump import END as TASKS_END
from aioparamsync.placement import PLACED, Placement

LOOPBACK = "127.0.0.1"
# Default bound of a wait for the cluster to converge (seconds): generous, as
# a peer in backoff may wait up to peers.BACKOFF_MAX (5 s) before it retries.
CONVERGE_TIMEOUT = 15.0
POLL_INTERVAL = 0.02

NODE_COMMAND = [sys.executable, "-m", "aioparamsync"]
LISTENING = re.compile(
    r"^aioparamsync-node (?P<node_id>\S+) listening on (?P<host>\S+):(?P<port>\d+)"
    r"(?: and unix:\S+)?$"
)
# The first start imports numpy and thriftpy2: generous, but bounded.
START_TIMEOUT = 30.0
EXIT_TIMEOUT = 10.0
CALL_TIMEOUT = 15.0

# name -> (version, origin, bytes): what a replica holds.
State = dict[str, tuple[int, str, bytes]]


# -- polling -------------------------------------------------------------------------------


def assert_(condition: bool) -> None:
    """``assert condition``, as a call (for ``eventually(lambda: assert_(...))``)."""
    assert condition


def _state_and_parent(stat: str) -> tuple[str, int]:
    """A process's state letter and parent PID, from its ``/proc/PID/stat``."""
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def process_runs(pid: int, marker: bytes) -> bool:
    """Whether process ``pid`` runs (a zombie does not) with ``marker`` in its command
    line (a PID reused by another program does not count)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return marker in cmdline and _state_and_parent(stat)[0] != "Z"


def children_of(pid: int) -> list[int]:
    """The PIDs of the live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, ppid = _state_and_parent((entry / "stat").read_text())
        except OSError:
            continue
        if ppid == pid and state != "Z":
            found.append(int(entry.name))
    return found


def ignore_sigint() -> None:
    """What a script's ``cmd &`` does to a background job: it starts with SIGINT ignored.
    (A ``preexec_fn``: a test starts a process so, to see it handle SIGINT anyway.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def eventually(
    check: Callable[[], Any],
    *,
    timeout: float = CONVERGE_TIMEOUT,
    interval: float = POLL_INTERVAL,
    retry_on: tuple[type[BaseException], ...] = (AssertionError,),
) -> Any:
    """Call ``check`` until it returns without raising one of ``retry_on``; answer its value.

    ``check`` may be a plain or an async function; it asserts what it waits for.
    Past ``timeout`` seconds, its last error is raised.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            return result
        except retry_on as exc:
            if loop.time() >= deadline:
                raise AssertionError(f"not so within {timeout} s: {exc}") from exc
        await asyncio.sleep(interval)


def free_port() -> int:
    """A port nothing listens on (it was free a moment ago), for a process to listen on later.

    Picked below the kernel's range of ephemeral ports: the kernel gives a connection's
    own end a port of that range, and one it gave meanwhile (to any test's connection)
    would take a port found free there before the process listens on it. Below it, only
    another explicit bind can (another free_port, of some 20,000 ports).
    """
    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(FIRST_PICKED_PORT, low)
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{FIRST_PICKED_PORT}, {low}) after 100 tries")


# free_port's range starts here (above the ports services are commonly configured on)
FIRST_PICKED_PORT = 10_000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > FIRST_PICKED_PORT + 1000 else 32768


def address_text(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


# -- in-process nodes --------------------------------------------------------------------


def table_state(node: Node) -> State:
    """What ``node``'s table holds, read directly."""
    state = {}
    for name in node.table.names():
        entry = node.table.entry(name)
        assert entry is not None
        state[name] = (entry.version, entry.origin, bytes(entry.data))
    return state


def assert_same_tables(nodes: Iterable[Node], expected: State | None = None) -> State:
    """Every node holds the same names with the same (version, origin, bytes)."""
    nodes = list(nodes)
    first = table_state(nodes[0])
    for node in nodes[1:]:
        other = table_state(node)
        assert set(other) == set(first), (
            f"{node.node_id} holds {sorted(other)}, {nodes[0].node_id} holds {sorted(first)}"
        )
        for name, value in first.items():
            assert other[name] == value, _differ(
                name, node.node_id, other[name], nodes[0].node_id, value
            )
    if expected is not None:
        assert first == expected, f"the replicas agree on {first}, expected {expected}"
    return first


def _differ(name: str, who: str, got: Any, other: str, value: Any) -> str:
    """Why two replicas of ``name`` differ: (version, origin), or the bytes alone."""
    if got[:2] == value[:2]:
        return f"{name!r}: {who} and {other} both have {value[:2]} but different bytes"
    return f"{name!r}: {who} has {got[:2]}, {other} has {value[:2]}"


def assert_mesh(nodes: Iterable[Node]) -> None:
    """Each node has exactly one link to each other node, up, knowing its id; each is up
    (it has joined: pulled what it holds) and settled (every member up answered that it
    knows: until then the node folds nothing and claims nothing)."""
    nodes = list(nodes)
    for node in nodes:
        assert node.cluster.state == "up", f"{node.node_id} is {node.cluster.state}"
        assert node.cluster.settling is None, f"{node.node_id} is settling"
        others = {address_text(o.address): o.node_id for o in nodes if o is not node}
        links = node.cluster.links
        assert set(links) == set(others), f"{node.node_id} links to {sorted(links)}"
        for address, link in links.items():
            assert link.state == "up", f"{node.node_id} -> {address}: {link!r}"
            assert link.node_id == others[address], f"{node.node_id} -> {address}: {link!r}"


def node_client(address: Any, **kwargs: Any) -> ParameterClient:
    """A client of that node alone, not routed by the topology: what it writes is
    applied there (its origin), where that node holds it, as by a founding client."""
    return ParameterClient(address, route=False, **kwargs)


def placement_of(topology: Any) -> Placement:
    """The placement a topology (as a node answers it) gives: its members placed, its
    replication factor and the keys its members claim (balance by bytes moves keys
    off their rendezvous ranking, every ``--balance-interval`` seconds)."""
    placed = [m.node_id for m in topology.members if m.state in PLACED]
    return Placement(placed, topology.replication_factor or None, topology.claims)


def primary_of(nodes: Iterable[Node], name: str) -> Node:
    """The node that is the primary of ``name`` (as the first node sees the cluster)."""
    nodes = list(nodes)
    view = nodes[0].cluster
    primary = view.placement.primary(name, view.live)
    return next(n for n in nodes if n.node_id == primary)


class LocalCluster:
    """Nodes in this process; :meth:`close` stops those still running.

    Its nodes hold every key (replication factor "all", the founding
    article's broadcast) unless told otherwise: the tests of replication
    itself (links, repair, faults) compare every node's table; the sharding
    tests pass their own ``replication_factor``.
    """

    def __init__(self, repair_interval: float = 0.2, replication_factor: int | None = None) -> None:
        self.repair_interval = repair_interval
        self.replication_factor = replication_factor
        self.running: list[Node] = []

    async def start(
        self, *, peers: Iterable[Node | tuple[str, int]] = (), port: int = 0, **kwargs: Any
    ) -> Node:
        kwargs.setdefault("repair_interval", self.repair_interval)
        kwargs.setdefault("replication_factor", self.replication_factor)
        kwargs.setdefault("drain_timeout", 5.0)
        seeds = [p.address if isinstance(p, Node) else p for p in peers]
        node = Node(LOOPBACK, port, peers=seeds, **kwargs)
        await node.start()
        self.running.append(node)
        return node

    async def stop(self, node: Node, *, leave: bool = False) -> None:
        """Stop ``node``: as one that is to come back (its peers see it down), or
        after it left the cluster (``leave``: it hands its keys off first)."""
        self.running.remove(node)
        await node.stop(leave=leave)

    async def close(self) -> None:
        while self.running:
            await self.stop(self.running[-1])

    async def formed(self, nodes: Iterable[Node], timeout: float = CONVERGE_TIMEOUT) -> None:
        nodes = list(nodes)
        await eventually(lambda: assert_mesh(nodes), timeout=timeout)

    async def converged(
        self,
        nodes: Iterable[Node],
        expected: State | None = None,
        timeout: float = CONVERGE_TIMEOUT,
    ) -> State:
        nodes = list(nodes)
        return await eventually(lambda: assert_same_tables(nodes, expected), timeout=timeout)


# -- node processes --------------------------------------------------------------------------


class NodeExited(AssertionError):
    """The node exited (or never printed its listening line) when it should be serving."""


# The ``spawn`` fixture (conftest.py): ``await spawn(*flags, listening=True)``.
Spawn = Callable[..., Awaitable["NodeProcess"]]


def watch_loop_errors(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    """What ``loop`` reports as errors from now on (a test asserts it stays empty)."""
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    return reported


@contextlib.asynccontextmanager
async def watched_cluster(repair_interval: float) -> AsyncIterator[LocalCluster]:
    """In-process nodes, closed at the end; any error the loop reports fails the test."""
    reported = watch_loop_errors(asyncio.get_running_loop())
    nodes = LocalCluster(repair_interval=repair_interval)
    try:
        yield nodes
    finally:
        await nodes.close()
    await asyncio.sleep(0)
    assert not reported, f"the event loop reported errors: {reported}"


async def launch(*flags: str) -> NodeProcess:
    """Start ``python -m aioparamsync *flags`` (not yet waited for: see ``wait_listening``)."""
    proc = await asyncio.create_subprocess_exec(
        *NODE_COMMAND,
        *flags,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    return NodeProcess(proc)


class NodeProcess:
    """One ``python -m aioparamsync`` child process, its output pumped into lists."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._changed = asyncio.Event()
        assert proc.stdout is not None and proc.stderr is not None
        self._pumps = [
            asyncio.ensure_future(self._pump(proc.stdout, self.stdout_lines)),
            asyncio.ensure_future(self._pump(proc.stderr, self.stderr_lines)),
        ]
        self.node_id = ""
        self.host = ""
        self.port = 0
        self.stopped = False  # SIGSTOPped and not SIGCONTed since

    def __repr__(self) -> str:
        return f"<NodeProcess {self.pid} {self.node_id or '?'}>"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def address_text(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def stdout(self) -> str:
        return "".join(self.stdout_lines)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    async def _pump(self, stream: asyncio.StreamReader, lines: list[str]) -> None:
        while line := await stream.readline():
            lines.append(line.decode(errors="replace"))
            self._changed.set()
        self._changed.set()

    async def _until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"node {self.pid}: no {what} within {timeout} s; stderr:\n{self.stderr}"
            ) from None

    async def wait_line_or_exit(self, timeout: float = START_TIMEOUT) -> bool:
        """Wait for a first line on stdout or the end of output; answer whether a line came."""
        await self._until(
            lambda: bool(self.stdout_lines) or all(p.done() for p in self._pumps),
            timeout,
            "listening line or exit",
        )
        return bool(self.stdout_lines)

    async def wait_listening(self, timeout: float = START_TIMEOUT) -> None:
        """Wait for the listening line; learn the node's id, host and port from it."""
        if not await self.wait_line_or_exit(timeout):
            rc = await self.wait_exit()
            raise NodeExited(f"node exited with {rc} before listening; stderr:\n{self.stderr}")
        match = LISTENING.match(self.stdout_lines[0].rstrip("\n"))
        assert match, f"unparseable first line: {self.stdout_lines[0]!r}"
        self.node_id = match["node_id"]
        self.host = match["host"]
        self.port = int(match["port"])

    async def wait_stderr(self, text: str, timeout: float = EXIT_TIMEOUT) -> None:
        await self._until(
            lambda: text in self.stderr or all(p.done() for p in self._pumps),
            timeout,
            f"{text!r} on stderr",
        )
        assert text in self.stderr, f"the node exited without writing {text!r}:\n{self.stderr}"

    async def wait_exit(self, timeout: float = EXIT_TIMEOUT) -> int:
        """Wait for the process to exit and its output to end; answer its exit code."""
        async with asyncio.timeout(timeout):
            rc = await self.proc.wait()
            await asyncio.gather(*self._pumps)
        return rc

    def signal(self, sig: int) -> None:
        if sig == signal.SIGSTOP:
            self.stopped = True
        self.proc.send_signal(sig)
        if sig == signal.SIGCONT:
            self.stopped = False

    async def kill(self, timeout: float = EXIT_TIMEOUT) -> int:
        """SIGKILL (after SIGCONT, if stopped) and reap; answer the exit code."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                if self.stopped:
                    self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
        self.stopped = False
        async with asyncio.timeout(timeout):
            rc = await self.proc.wait()
            await asyncio.gather(*self._pumps, return_exceptions=True)
        return rc

    async def close(self) -> None:
        """Kill the process if it still runs (by its PID), and reap it, quietly."""
        with contextlib.suppress(TimeoutError):
            await self.kill()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    def client(self, **kwargs: Any) -> ParameterClient:
        kwargs.setdefault("timeout", CALL_TIMEOUT)
        kwargs.setdefault("connect_timeout", 5.0)
        kwargs.setdefault("route", False)  # (this node's client: see node_client)
        return ParameterClient(self.address, **kwargs)


class ProcessCluster:
    """Starts node processes; :meth:`close` kills (by PID) every one still running.

    As :class:`LocalCluster`, its nodes hold every key unless told otherwise
    (``replication_factor``, or ``--replication-factor`` in ``extra``).
    """

    def __init__(self, repair_interval: float = 0.5, replication_factor: str = "all") -> None:
        self.repair_interval = repair_interval
        self.replication_factor = replication_factor
        self.started: list[NodeProcess] = []

    async def spawn(
        self, *, peers: Iterable[NodeProcess] = (), port: int = 0, extra: Iterable[str] = ()
    ) -> NodeProcess:
        flags = ["--port", str(port), "--repair-interval", str(self.repair_interval)]
        extra = list(extra)
        if "--replication-factor" not in extra:
            flags += ["--replication-factor", self.replication_factor]
        peers = list(peers)
        if peers:
            flags += ["--peers", ",".join(p.address_text for p in peers)]
        node = await launch(*flags, *extra)
        self.started.append(node)
        await node.wait_listening()
        return node

    async def __aenter__(self) -> ProcessCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """The logs' ends shown (pytest prints them if the test failed), every process killed."""
        self.show_logs()
        await self.close()

    def show_logs(self, tail: int = 80) -> None:
        """Print the end of every node's log (pytest shows it when the test failed), and
        before it the first dump of its tasks (``kill -USR1``) if it was asked for one."""
        for node in self.started:
            lines = node.stderr_lines
            dump = next((i for i, line in enumerate(lines) if line.startswith(TASKS_BEGIN)), None)
            if dump is not None and dump < len(lines) - tail:
                ends = (i for i in range(dump, len(lines)) if lines[i].startswith(TASKS_END))
                end = next(ends, len(lines) - 1)
                print(f"--- node {node.node_id or '?'} (pid {node.pid}), its tasks when asked:")
                print("".join(lines[dump : end + 1]), end="")
            print(f"--- node {node.node_id or '?'} (pid {node.pid}), its log's end:")
            print("".join(lines[-tail:]), end="")

    async def close(self) -> None:
        for node in self.started:
            with contextlib.suppress(TimeoutError):
                await node.kill()
        # Last resort, should the wait above have timed out: the PID is not
        # reaped yet (returncode None), so it is still ours.
        for node in self.started:
            if node.proc.returncode is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(node.pid, sig)


async def wire_state(client: ParameterClient) -> State:
    """What a node holds, over the wire: its digest, then every parameter's bytes."""
    digest = await client.call("digest")
    response = await client.get_parameters([d.name for d in digest])
    return {p.name: (p.version, p.origin, bytes(p.data)) for p in response.params}


async def assert_same_wire_states(
    clients: Iterable[ParameterClient], expected_names: Iterable[str] | None = None
) -> State:
    states = [await wire_state(c) for c in clients]
    first = states[0]
    if expected_names is not None:
        assert set(first) == set(expected_names), f"holds {sorted(first)}"
    for i, other in enumerate(states[1:], 1):
        assert set(other) == set(first), f"node #{i} holds {sorted(other)}, #0 {sorted(first)}"
        for name, value in first.items():
            assert other[name] == value, _differ(name, f"node #{i}", other[name], "node #0", value)
    return first


async def assert_mesh_over_wire(nodes: Iterable[NodeProcess]) -> None:
    """Each node's info() shows every other node (id and address) up, and nothing else."""
    nodes = list(nodes)
    for node in nodes:
        async with node.client() as client:
            info = await client.info()
        others = {o.node_id: o.address_text for o in nodes if o is not node}
        peers = {p.node_id: (p.address, p.state) for p in info.peers or []}
        assert peers == {i: (a, "up") for i, a in others.items()}, f"{node.node_id} sees {peers}"


# Network errors while a node (re)starts are expected in a poll: retry them.
RETRY_WIRE = (AssertionError, NetworkError)


async def run_process(
    *argv: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run ``argv`` to its end without blocking the loop; past ``timeout`` s kill it (by PID).

    Answers (exit code, stdout, stderr). A timeout raises ``TimeoutError``.
    """
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def run_bounded(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    """Run ``cmd`` to its end; past ``timeout`` s SIGTERM it (it stops what it started).

    Answers (exit code, stdout, stderr).
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    return proc.returncode, stdout, stderr


# -- clusters of node processes -------------------------------------------------------------


async def spawn_cluster(
    procs: ProcessCluster, n: int, extra: Sequence[str] = ()
) -> list[NodeProcess]:
    """``n`` nodes: the first, then the others together, each given the first as its peer."""
    first = await procs.spawn(extra=extra)
    rest = await asyncio.gather(*(procs.spawn(peers=[first], extra=extra) for _ in range(n - 1)))
    return [first, *rest]


async def open_clients(
    stack: contextlib.AsyncExitStack, nodes: Iterable[NodeProcess]
) -> dict[str, ParameterClient]:
    """A client of each node alone (``route=False``), by node id."""
    return {n.node_id: await stack.enter_async_context(n.client()) for n in nodes}


async def wait_formed(clients: Mapping[str, ParameterClient], timeout: float = 30.0) -> None:
    """Every node is up and sees exactly these nodes, each up."""
    ids = set(clients)

    async def check() -> None:
        views = {}
        for node_id, client in clients.items():
            info = await client.info()
            views[node_id] = (info.state, {m.node_id: m.state for m in info.topology.members})
        wrong = {
            node_id: f"is {state}, sees {seen}"
            for node_id, (state, seen) in views.items()
            if state != "up" or seen != dict.fromkeys(ids, "up")
        }
        assert not wrong, f"not formed: {wrong}"

    await eventually(check, timeout=timeout, interval=0.2, retry_on=(*RETRY_WIRE, CallTimeout))
