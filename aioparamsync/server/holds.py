"""Callers a node holds: long polls (stale-synchronous training) and barriers (bulk-synchronous).

A long poll waits until every requested parameter exists with at least a
version; a barrier waits until a named group's workers all reach a step. The
most reported pain of parameter servers is a silent hang, so each waiter
says, while it waits, whom it is waiting for (:meth:`Waiting.report`, shown
by ``info`` and ``aioparamsync-ctl waiting``), and every wait has a deadline
after which it fails with ``TIMEOUT``, naming what never came.

Wake-ups are driven by the store's feed of applied entries (local and
replicated alike): a waiter is looked at only when a name it waits for
changes, so a thousand idle waiters cost nothing per update.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ErrorCode, RequestError
from ..placement import parse_key
from ..store.table import Entry
from ..store.writer import ParameterStore
from ..wire import thrift

__all__ = ["MAX_GROUPS", "MAX_WAIT_MS", "MAX_WORLD_SIZE", "Waiting"]

# The longest a caller may be held (milliseconds).
MAX_WAIT_MS = 3_600_000
# A wait with no wait_ms: held this long (milliseconds).
DEFAULT_WAIT_MS = 600_000
# Barrier groups a node keeps (to make room, one nobody waits at is forgotten),
# and workers in one group.
MAX_GROUPS = 10_000
MAX_WORLD_SIZE = 100_000
# Names listed in a waiter's report (the rest are counted).
REPORT_NAMES = 20


def _wait_seconds(wait_ms: int | None) -> float:
    if wait_ms is None:
        wait_ms = DEFAULT_WAIT_MS
    if wait_ms < 0:
        raise RequestError(ErrorCode.BAD_REQUEST, f"wait_ms must not be negative, not {wait_ms}")
    return min(wait_ms, MAX_WAIT_MS) / 1000


def _listed(names: Iterable[str]) -> list[str]:
    names = sorted(names)
    if len(names) > REPORT_NAMES:
        return [*names[:REPORT_NAMES], f"... and {len(names) - REPORT_NAMES} more"]
    return names


@dataclass(eq=False)
class _Poll:
    """A long poll: waits for ``missing`` to reach ``min_version``."""

    missing: set[str]
    min_version: int
    future: asyncio.Future
    started: float
    count: int  # names asked


@dataclass(eq=False)
class _Group:
    """A barrier group: its size and the step each worker has reached."""

    world_size: int
    reached: dict[str, int] = field(default_factory=dict)
    # step -> the futures of the workers waiting for it
    waiting: dict[int, list[tuple[str, asyncio.Future, float]]] = field(default_factory=dict)


class Waiting:
    """The long polls and barriers of one node.

    Args:
        store: its feed of applied entries wakes the long polls.
    """

    def __init__(self, store: ParameterStore) -> None:
        self.store = store
        self._polls: dict[str, set[_Poll]] = {}  # by each name a poll still misses
        self._all_polls: set[_Poll] = set()
        self._groups: dict[str, _Group] = {}
        self.timeouts = 0
        store.subscribe(self._applied)

    def __repr__(self) -> str:
        barriers = sum(len(w) for g in self._groups.values() for w in g.waiting.values())
        return f"<Waiting [{len(self._all_polls)} polls | {barriers} at barriers]>"

    # -- long polls ---------------------------------------------------------------------

    def poll(self, names: Sequence[str], min_version: int, wait_ms: int | None) -> asyncio.Future:
        """A future done once every name exists with ``version >= min_version``.

        Already so: a done future. Else it fails with ``TIMEOUT`` after
        ``wait_ms`` milliseconds, naming the parameters that did not come.
        """
        seconds = _wait_seconds(wait_ms)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        table = self.store.table
        missing = set()
        for name in names:
            entry = table.entry(name)
            if entry is None or entry.version < min_version:
                missing.add(name)
        if not missing:
            future.set_result(None)
            return future
        poll = _Poll(missing, min_version, future, time.monotonic(), len(set(names)))
        self._all_polls.add(poll)
        for name in missing:
            self._polls.setdefault(name, set()).add(poll)
        timer = loop.call_later(seconds, self._poll_expired, poll, seconds)

        def done(_: asyncio.Future) -> None:
            timer.cancel()
            self._forget(poll)

        future.add_done_callback(done)
        return future

    def _poll_expired(self, poll: _Poll, seconds: float) -> None:
        if poll.future.done():
            return
        self.timeouts += 1
        shown = ", ".join(repr(n) for n in _listed(poll.missing))
        poll.future.set_exception(
            RequestError(
                ErrorCode.TIMEOUT,
                f"waited {seconds:g} s for version {poll.min_version}; still missing "
                f"{len(poll.missing)} of {poll.count}: {shown}",
            )
        )

    def _forget(self, poll: _Poll) -> None:
        self._all_polls.discard(poll)
        for name in poll.missing:
            polls = self._polls.get(name)
            if polls is not None:
                polls.discard(poll)
                if not polls:
                    del self._polls[name]

    def _applied(self, entries: Sequence[Entry], replicated: bool) -> None:
        if not self._polls:
            return
        version: int | None
        for entry in entries:
            name, version = entry.name, entry.version  # (version None: any)
            polls = self._polls.get(name)
            if not polls and "\x00" in name:
                # (a name waited for that comes as partitions: its manifest, written
                # after them, answers the poll; the read puts them together)
                parsed = parse_key(name)
                if parsed is not None and parsed[1] is None:
                    name = parsed[0]
                    polls = self._polls.get(name)
                    version = None
            if not polls:
                continue
            for poll in list(polls):
                if version is None or version >= poll.min_version:
                    poll.missing.discard(name)
                    polls.discard(poll)
                    if not poll.missing and not poll.future.done():
                        poll.future.set_result(None)
            if not polls:
                self._polls.pop(name, None)

    # -- barriers -----------------------------------------------------------------------

    def barrier(self, request: Any) -> asyncio.Future:
        """A future of the ``BarrierResult`` once ``world_size`` workers reach ``step``.

        Raises:
            RequestError: (BAD_REQUEST) a malformed request or one that
                disagrees with the group's size; (LIMIT_EXCEEDED) too many
                groups or workers.
        """
        if request is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the barrier request is missing")
        group_name, worker, step, size = (
            request.group,
            request.worker,
            request.step,
            request.world_size,
        )
        if not group_name or not worker:
            raise RequestError(ErrorCode.BAD_REQUEST, "a barrier needs a group and a worker")
        if not 1 <= size <= MAX_WORLD_SIZE:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"world_size must be from 1 to {MAX_WORLD_SIZE}, not {size}",
            )
        seconds = _wait_seconds(request.wait_ms)
        group = self._groups.get(group_name)
        if (
            group is not None
            and not group.waiting
            and (group.world_size != size or step < group.reached.get(worker, step))
        ):
            # Nobody waits, and this call is not of the run the group saw: a
            # worker went back (restarted from a checkpoint, or a new job under
            # the same name) or the job has another size. The group starts
            # afresh: the old run's steps would let this worker through alone.
            del self._groups[group_name]
            group = None
        if group is None:
            if len(self._groups) >= MAX_GROUPS and not self._forget_an_idle_group():
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"the node holds {MAX_GROUPS} barrier groups, each with workers waiting",
                )
            group = self._groups[group_name] = _Group(size)
        if group.world_size != size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"group {group_name!r} has world_size {group.world_size}; {worker!r} says {size}",
            )
        if worker not in group.reached and len(group.reached) >= size:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"group {group_name!r} already has its {size} workers; {worker!r} is one more",
            )
        group.reached[worker] = max(step, group.reached.get(worker, step))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        waiting = group.waiting.setdefault(step, [])
        waiting.append((worker, future, time.monotonic()))
        self._open(group_name, group)
        if not future.done():
            timer = loop.call_later(
                seconds, self._barrier_expired, group_name, group, step, future, seconds
            )

            def done(_: asyncio.Future) -> None:
                # Answered, timed out, or its caller left: no longer waiting.
                timer.cancel()
                self._leave(group, step, future)

            future.add_done_callback(done)
        return future

    def _forget_an_idle_group(self) -> bool:
        """Make room: forget the oldest group nobody waits at (False: there is none).

        Nothing is lost with it: with nobody waiting, every barrier it opened
        has been answered, and its workers' next calls start it afresh.
        """
        for name, group in self._groups.items():
            if not group.waiting:
                del self._groups[name]
                return True
        return False

    @staticmethod
    def _leave(group: _Group, step: int, future: asyncio.Future) -> None:
        waiting = group.waiting.get(step)
        if waiting is not None:
            waiting[:] = [w for w in waiting if w[1] is not future]
            if not waiting:
                del group.waiting[step]

    def _open(self, name: str, group: _Group) -> None:
        """Answer every waiter whose step all of the group has reached."""
        if len(group.reached) < group.world_size:
            return
        lowest = min(group.reached.values())
        for step in [s for s in group.waiting if s <= lowest]:
            result = thrift.BarrierResult(
                group=name,
                step=step,
                workers=sorted(w for w, s in group.reached.items() if s >= step),
            )
            for _, future, _ in group.waiting.pop(step):
                if not future.done():
                    future.set_result(result)

    def _barrier_expired(
        self, name: str, group: _Group, step: int, future: asyncio.Future, seconds: float
    ) -> None:
        if future.done():
            return
        self.timeouts += 1
        self._leave(group, step, future)
        absent = self._absent(group, step)
        future.set_exception(
            RequestError(
                ErrorCode.TIMEOUT,
                f"barrier {name!r} step {step}: waited {seconds:g} s for "
                f"{len(absent)} of {group.world_size} workers: {', '.join(_listed(absent))}",
            )
        )

    @staticmethod
    def _absent(group: _Group, step: int) -> list[str]:
        behind = [f"{w} (at step {s})" for w, s in group.reached.items() if s < step]
        unseen = group.world_size - len(group.reached)
        if unseen:
            behind.append(f"{unseen} never seen")
        return behind

    # -- what is waiting ---------------------------------------------------------------

    def report(self) -> list[Any]:
        """One ``Waiter`` per held caller: what it waits for, and for how long."""
        now = time.monotonic()
        found = []
        for poll in itertools.islice(self._all_polls, 1000):
            found.append(
                thrift.Waiter(
                    kind="pull",
                    what=f"{poll.count} parameters at version >= {poll.min_version}",
                    waiting_for=_listed(poll.missing),
                    seconds=now - poll.started,
                )
            )
        for name, group in self._groups.items():
            for step, waiters in group.waiting.items():
                absent = self._absent(group, step)
                for worker, future, started in waiters:
                    if future.done():
                        continue
                    found.append(
                        thrift.Waiter(
                            kind="barrier",
                            what=f"group {name!r} step {step}",
                            waiting_for=_listed(absent),
                            seconds=now - started,
                            who=worker,
                        )
                    )
        return found

    def statistics(self) -> dict[str, int]:
        """Counts of what waits (safe to call from another thread: it reads copies)."""
        groups = list(self._groups.values())
        return {
            "long_polls_waiting": len(self._all_polls),
            "barrier_waiters": sum(len(w) for g in groups for w in list(g.waiting.values())),
            "barrier_groups": len(groups),
            "wait_timeouts": self.timeouts,
        }
