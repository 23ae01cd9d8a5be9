"""The nemesis: the plan's faults, made on the cluster at their times, and healed.

Theory of operation. :meth:`Nemesis.run` takes the plan's events in order, each at its time
(or once the one before is over: a join or a drain takes what it takes, bounded by
``EVENT_TIMEOUT``), and writes each as a :class:`~.history.Fault` from its start to its heal:

- ``kill``: SIGKILL a node, keep it down ``hold`` seconds, start it again on its port with
  its data directory (it keeps what it acknowledged);
- ``join``: start a new node with the cluster's seed (or the coordinator);
- ``drain``: a planned leave (the ``drain`` call); the node hands its keys off and exits;
- ``cut``: the peer link between two nodes refused both ways at their proxies, ``hold`` s;
- ``delay``: everything into a node held back ``latency`` s a chunk, ``hold`` s;
- ``etcd``: SIGKILL etcd, start it again with its data after ``hold`` s.

At most one fault is active at a time. :meth:`Nemesis.heal` stops what is left of the
schedule and undoes the fault in progress (the node started again, the proxies mended, etcd
back), so that the cluster can settle; what could not be done (a node that did not start
again, a drain that did not end) is a problem of the run, told in the report.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aioparamsync import ParamSyncError

from .cluster import ChaosCluster, Slot
from .history import Fault, History
from .plan import Event

__all__ = ["EVENT_TIMEOUT", "Nemesis"]

EVENT_TIMEOUT = 40.0  # the longest one fault may take to make and to heal (seconds)


class Nemesis:
    """Makes ``cluster``'s faults as ``events`` say; writes them into ``history``."""

    def __init__(
        self,
        cluster: ChaosCluster,
        events: tuple[Event, ...],
        history: History,
        clock: Callable[[], float],
    ) -> None:
        self.cluster = cluster
        self.events = events
        self.history = history
        self.clock = clock  # seconds since the workload began
        self.problems: list[str] = []
        self._undo: Callable[[], object] | None = None  # the heal of the fault in progress
        self._fault: Fault | None = None

    async def run(self) -> None:
        """Every event at its time (see the module); cancel it to stop early."""
        for event in self.events:
            await asyncio.sleep(max(0.0, event.at - self.clock()))
            try:
                async with asyncio.timeout(EVENT_TIMEOUT):
                    await self._make(event)
            except TimeoutError:
                problem = f"took over {EVENT_TIMEOUT} s"
            # (a node that did not start, see NodeExited; a drain the node refused)
            except (AssertionError, ParamSyncError) as exc:
                problem = f"failed: {type(exc).__name__}: {exc}"
            else:
                continue
            self.problems.append(f"nemesis: {event.describe()} {problem}")
            await self._stop_fault()
            return

    async def _make(self, event: Event) -> None:
        cluster = self.cluster
        slots = cluster.slots
        if event.kind == "join":
            fault = self._begin(event, ())
            slot = await cluster.join()
            fault.nodes = (slot.node_id,)
            self._end()
            return
        if event.kind == "drain":
            slot = slots[event.node]
            self._begin(event, (slot.node_id,))
            handed = await cluster.drain(slot)
            self._end(f"({handed} keys handed off)")
            return
        if event.kind == "kill":
            slot = slots[event.node]
            self._begin(event, (slot.node_id,), lambda: self._restart(slot))
            await cluster.kill(slot)
        elif event.kind == "cut":
            a, b = slots[event.node], slots[event.other]
            self._begin(event, (a.node_id, b.node_id), cluster.mend)
            cluster.cut(a, b)
        elif event.kind == "delay":
            slot = slots[event.node]
            assert slot.proxy is not None
            self._begin(event, (slot.node_id,), cluster.mend)
            slot.proxy.delay = event.latency
        else:
            self._begin(event, ("etcd",), cluster.start_etcd)
            cluster.kill_etcd()
        await asyncio.sleep(event.hold)
        await self._heal_fault()

    def _begin(
        self, event: Event, nodes: tuple[str, ...], undo: Callable[[], object] | None = None
    ) -> Fault:
        fault = Fault(event.kind, nodes, self.clock(), note=event.describe())
        self.history.faults.append(fault)
        self._fault, self._undo = fault, undo
        return fault

    def _end(self, note: str = "") -> None:
        assert self._fault is not None
        self._fault.end = self.clock()
        if note:
            self._fault.note += " " + note
        self._fault = self._undo = None

    async def _restart(self, slot: Slot) -> None:
        if not slot.running:
            await self.cluster.spawn(slot)

    async def _heal_fault(self) -> None:
        undo = self._undo
        if undo is not None:
            result = undo()
            if asyncio.iscoroutine(result):
                await result
        self._end()

    async def heal(self, task: asyncio.Task[None]) -> None:
        """Let the schedule (``task``, the running :meth:`run`) end, within
        ``EVENT_TIMEOUT``; past it, stop it and undo the fault in progress (see the module)."""
        await asyncio.wait({task}, timeout=EVENT_TIMEOUT)
        if task.done():
            task.result()  # (the harness's own error fails the test)
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self._fault is not None:
            self.problems.append(f"nemesis: {self._fault.describe()} cut short by the heal")
            await self._stop_fault()

    async def _stop_fault(self) -> None:
        """Undo the fault in progress, if any, within ``EVENT_TIMEOUT`` (a join or a drain
        cut short ends as it does)."""
        fault = self._fault
        if fault is None:
            return
        try:
            async with asyncio.timeout(EVENT_TIMEOUT):
                if self._undo is None:
                    self._end("(cut short)")
                else:
                    await self._heal_fault()
        except (TimeoutError, AssertionError) as exc:
            self.problems.append(f"nemesis: the heal of {fault.describe()} failed: {exc!r}")
