"""The run's cluster: node processes in slots, their proxies and data directories, and etcd.

Theory of operation. A :class:`Slot` is one node's place in the run: its port (the kernel's
pick at the first start, then kept, so a node killed comes back where it was, under the
same id), its data directory, its proxy
(where the plan cuts or delays links: every node then advertises its proxy, so peers and
routed clients reach it through it, while pinned clients connect straight to its port), and
the process now running there, if any. :class:`ChaosCluster` starts, kills, restarts, joins
and drains slots (as ``tests/test_sharding.py`` does, with ``cluster_helpers``), and starts
and kills etcd (as ``tests/test_coordinator.py`` does). Every process is killed by its PID
when the cluster closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster_helpers import LOOPBACK, NodeProcess, ProcessCluster
from test_coordinator import Etcd, need_etcd
from test_sharding import FaultProxy

from .plan import Plan

__all__ = ["ChaosCluster", "LinkProxy", "Slot"]

REPAIR_INTERVAL = 0.5  # --repair-interval of every node (seconds)
# --balance-interval of every node (seconds): members claim keys (placement balanced by
# bytes) while the workload runs and faults come, so claims are tested with the rest
BALANCE_INTERVAL = 0.5
DRAIN_TIMEOUT = 15.0  # --drain-timeout: the longest a drained node hands its keys off
DRAIN_WAIT = DRAIN_TIMEOUT + 10.0  # the longest a drain call and the node's exit may take


class _DelayedReader:
    """A stream reader whose every read waits ``proxy.delay`` seconds first."""

    def __init__(self, reader: asyncio.StreamReader, proxy: LinkProxy) -> None:
        self._reader, self._proxy = reader, proxy

    async def read(self, n: int) -> bytes:
        data = await self._reader.read(n)
        if data and self._proxy.delay:
            await asyncio.sleep(self._proxy.delay)
        return data


class LinkProxy(FaultProxy):
    """A :class:`FaultProxy` that also delays what it forwards (``delay`` seconds a chunk,
    both ways, on every connection into its node)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.delay = 0.0

    async def _pump(  # type: ignore[override]
        self, reader: Any, writer: asyncio.StreamWriter, pipe: Any
    ) -> None:
        await FaultProxy._pump(_DelayedReader(reader, self), writer, pipe)


@dataclass
class Slot:
    """One node's place (see the module)."""

    index: int
    port: int
    data_dir: Path | None
    proxy: LinkProxy | None = None
    proc: NodeProcess | None = None
    left: bool = False  # drained: it is no member any more

    @property
    def node_id(self) -> str:
        """Where peers reach it: its id (the proxy's address where there is one)."""
        return f"{LOOPBACK}:{self.proxy.port if self.proxy is not None else self.port}"

    @property
    def address(self) -> tuple[str, int]:
        """Its own port (pinned clients and the checks connect here, not through the proxy)."""
        return LOOPBACK, self.port

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.proc.returncode is None


class ChaosCluster:
    """The nodes of one run (see the module); :meth:`close` stops everything it started."""

    def __init__(self, plan: Plan, tmp: Path, log_level: str = "warning") -> None:
        self.plan = plan
        self.tmp = tmp
        self.log_level = log_level  # (every node's --log-level)
        self.procs = ProcessCluster(REPAIR_INTERVAL, str(plan.replication))
        self.slots: list[Slot] = []
        self.etcd: Etcd | None = None
        self.prefix = f"/chaos/{plan.seed}-{uuid.uuid4().hex[:8]}"

    # -- starting ----------------------------------------------------------------------

    async def start(self) -> None:
        """etcd (with a coordinator), then the plan's nodes: the first, then the rest."""
        if self.plan.coordinator:
            need_etcd()
            self.etcd = Etcd(self.tmp / "etcd")
            await self.etcd.start()
        for _ in range(self.plan.nodes):
            await self._new_slot()
        await self.spawn(self.slots[0])
        await asyncio.gather(*(self.spawn(s) for s in self.slots[1:]))

    async def _new_slot(self) -> Slot:
        index = len(self.slots)
        data_dir = self.tmp / f"n{index}" if self.plan.data_dir else None
        slot = Slot(index, 0, data_dir)  # (its port: the one the kernel gives it first)
        if self.plan.proxies:
            slot.proxy = LinkProxy(0)  # (pointed at the node once it listens)
            await slot.proxy.start()
        self.slots.append(slot)
        return slot

    def _flags(self, slot: Slot) -> list[str]:
        plan = self.plan
        flags = [
            "--acks",
            plan.acks,
            "--failure-timeout",
            str(plan.failure_timeout),
            "--drain-timeout",
            str(DRAIN_TIMEOUT),
            "--log-level",
            self.log_level,
            "--balance-interval",
            str(BALANCE_INTERVAL),
        ]
        if slot.proxy is not None:
            flags += ["--advertise", slot.node_id]
        if slot.data_dir is not None:
            flags += ["--data-dir", str(slot.data_dir)]
        if self.etcd is not None:
            flags += ["--coordinator", self.etcd.endpoint, "--coordinator-prefix", self.prefix]
        else:
            seeds = [s.node_id for s in self.slots if s is not slot and s.running]
            if seeds:
                flags += ["--peers", seeds[0]]
        return flags

    async def spawn(self, slot: Slot) -> NodeProcess:
        """Start the node of ``slot`` on a port the kernel picks, or restart it on the
        port it had (so under the same id), with its data."""
        slot.proc = await self.procs.spawn(port=slot.port, extra=self._flags(slot))
        slot.port = slot.proc.port
        if slot.proxy is not None:
            slot.proxy.target = slot.address
        assert slot.proc.node_id == slot.node_id, (slot.proc.node_id, slot.node_id)
        return slot.proc

    # -- what the nemesis does -----------------------------------------------------------

    async def kill(self, slot: Slot) -> None:
        """SIGKILL the node (what it acknowledged is in its data directory)."""
        assert slot.proc is not None
        await slot.proc.kill()

    async def join(self) -> Slot:
        """A new node, joining the cluster."""
        slot = await self._new_slot()
        await self.spawn(slot)
        return slot

    async def drain(self, slot: Slot) -> int:
        """A planned leave: the node hands its keys off and exits; answers how many."""
        assert slot.proc is not None
        async with slot.proc.client(timeout=DRAIN_WAIT) as client:
            handed = await client.call("drain", wait_ms=int(DRAIN_TIMEOUT * 1000))
        await slot.proc.wait_exit(timeout=DRAIN_WAIT)
        slot.left = True
        return int(handed)

    def cut(self, a: Slot, b: Slot) -> None:
        """Cut the peer link between ``a`` and ``b``, both ways (each proxy refuses the
        other's connections, known by its PID)."""
        assert a.proxy and b.proxy and a.proc and b.proc
        b.proxy.cut_from(a.proc.pid)
        a.proxy.cut_from(b.proc.pid)

    def mend(self) -> None:
        """Every proxy lets every connection through again, undelayed."""
        for slot in self.slots:
            if slot.proxy is not None:
                slot.proxy.heal()
                slot.proxy.delay = 0.0

    def kill_etcd(self) -> None:
        assert self.etcd is not None
        self.etcd.kill()

    async def start_etcd(self) -> None:
        """etcd again, with its data (leases survive; their TTL is counted anew)."""
        assert self.etcd is not None
        if self.etcd.proc is None or self.etcd.proc.poll() is not None:
            await self.etcd.start()

    # -- the members ---------------------------------------------------------------------

    def members(self) -> list[Slot]:
        """The slots whose node is a member now or should be (not drained)."""
        return [s for s in self.slots if not s.left and s.proc is not None]

    def dump_tasks(self) -> None:
        """Ask every running node for its tasks' stacks (``kill -USR1``): a run that hangs
        shows what each node waited for (:meth:`show_logs` prints the first dump)."""
        for slot in self.slots:
            if slot.running and slot.proc is not None and not slot.proc.stopped:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.proc.send_signal(signal.SIGUSR1)

    def show_logs(self, tail: int = 40) -> None:
        self.procs.show_logs(tail)

    def save_logs(self, into: Path) -> list[Path]:
        """Every node process's whole log so far into ``into``, one file each
        (``node-<n>-<its port>.log``, in the order they started: a restart is another)."""
        saved = []
        for n, node in enumerate(self.procs.started):
            port = (node.node_id or "unknown").rpartition(":")[2]
            path = into / f"node-{n}-{port}.log"
            path.write_text("".join(node.stderr_lines))
            saved.append(path)
        return saved

    async def close(self) -> None:
        await self.procs.close()
        for slot in self.slots:
            if slot.proxy is not None:
                with contextlib.suppress(Exception):
                    await slot.proxy.close()
        if self.etcd is not None:
            self.etcd.kill()
