"""Watching parameters change: ``async for changed in client.watch(names)`` (or ``prefix=``).

Theory of operation. A node answers the IDL's ``watch`` with the keys it
holds whose version differs from what the caller has seen, holding the call
until one does (see :mod:`aioparamsync.server.watches`). A :class:`Watcher`
keeps one such call at each node that holds what it watches, each sent
again as soon as it is answered, with every version seen so far:

* a node alone (or a client that does not route), one call for everything;
* a routed client in a cluster: a watch of names is cut by the node each key
  is read from (its primary, or a replica: see :mod:`.routing`); a watch by
  prefix goes to every live member, each answering what it holds (a key
  several hold is taken at its newest version). A node that answers
  ``MOVED`` or cannot be reached makes the topology be asked for again, and
  the watch is cut anew.

A name stored whole is its own key. One stored as partitions is answered by
its manifest's key: the watcher reads the manifest (a few bytes), watches
the partitions where they are, and gives the name the version a read
answers, its oldest partition's, once it has heard of every partition.

What is yielded: ``{name: version}`` of the names whose version changed since
the last yield; the first yield, once every node has answered once, has every
name watched that exists. Between two yields changes are coalesced in the
watcher's table of versions, so a consumer slower than the writes sees the
newest version of each name, never a backlog; nothing grows with the rate of
writes. The calls end when the iteration does (``break``, ``aclose()``, the
client closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ClientClosedError, ErrorCode, ParamSyncError, RequestError
from ..placement import manifest_key, parse_key
from ..routing.partitions import manifests_of
from ..wire import METHODS, thrift
from .pool import ConnectionPool

if TYPE_CHECKING:
    from .api import ParameterClient

__all__ = ["WATCH_WAIT", "Watcher"]

log = logging.getLogger(__name__)

# How long each watch call is held at a node before it is sent again (seconds).
WATCH_WAIT = 10.0
# How long to wait before watching again at a node that failed (seconds).
RETRY_AFTER = 0.5


class Watcher:
    """One client's watch of ``names`` (or of the names starting with ``prefix``).

    Args:
        client: the client whose connections the calls take.
        names: the names to watch; or
        prefix: every name that starts with it ("": every one).
        wait: how long each call is held at a node (seconds).
        keys: yield the keys themselves (``{key: version}``: names, manifests'
            and partitions' keys, as stored), not names: for a mirror of the
            cluster (a follower), which reads and stores keys as they are.
        seen: versions already held of some keys: only newer ones are yielded
            (the first yield too).
    """

    def __init__(
        self,
        client: ParameterClient,
        names: Sequence[str] | None,
        prefix: str | None,
        wait: float = WATCH_WAIT,
        *,
        keys: bool = False,
        seen: dict[str, int] | None = None,
    ) -> None:
        self.client = client
        self.raw = keys
        self._seen = dict(seen or {})
        self.names = None if names is None else list(dict.fromkeys(names))
        self.prefix = prefix
        self.wait_ms = round(wait * 1000)
        #: each key's newest version heard of (a name, a manifest's, a partition's)
        self.keys: dict[str, int] = dict(self._seen)
        #: partitioned names: how many partitions, by the manifest's version read
        self.partitions: dict[str, tuple[int, int]] = {}
        self._changed = asyncio.Event()
        self._tasks: dict[Any, asyncio.Task[None]] = {}
        self._failure: BaseException | None = None

    # -- what is watched where ----------------------------------------------------------

    def _watched_keys(self) -> list[str]:
        """The keys of a watch by names: each name, and the partitions of those partitioned."""
        assert self.names is not None
        keys = list(self.names)
        for name in self.names:
            count = self.partitions.get(name)
            if count is not None:
                keys += [f"{name}\x00#{i}" for i in range(count[1])]
        return keys

    def _plan(self) -> dict[Any, tuple[list[str] | None, str | None]]:
        """What to watch at each node: ``{target: (keys, prefix)}``; the target None is
        the client's own node, unrouted."""
        routes = self.client.routes
        topology = None
        if routes is not None and routes.wanted():
            topology = routes.topology
        if topology is None or topology.single:
            return {None: (None if self.names is None else self._watched_keys(), self.prefix)}
        if self.names is None:
            live = sorted(m for m in topology.addresses if m in topology.live)
            return {m: (None, self.prefix) for m in live}
        assert routes is not None
        reads = routes.reads()
        by_target: dict[Any, tuple[list[str] | None, str | None]] = {}
        for key in self._watched_keys():
            target = routes.target(key, reads)
            keys, _ = by_target.setdefault(target, ([], None))
            assert keys is not None
            keys.append(key)
        return by_target

    # -- the calls ----------------------------------------------------------------------

    async def _call(self, target: Any, keys: list[str] | None, wait_ms: int) -> Any:
        """One watch call at ``target``; None when it must be cut anew (MOVED, unreachable)."""
        client = self.client
        if keys is not None:
            known = {k: self.keys[k] for k in keys if k in self.keys}
        else:
            known = self.keys
            topology = client.routes.topology if client.routes is not None else None
            if target is not None and topology is not None:
                held = topology.placement.holds  # (by prefix: what that node holds)
                known = {k: v for k, v in known.items() if held(target, k)}
        request = thrift.WatchRequest(
            names=keys, prefix=self.prefix if keys is None else None,
            known_versions=dict(known), wait_ms=wait_ms,
        )  # fmt: skip
        timeout = client._held_timeout(wait_ms / 1000, ...)
        if target is None:
            return await ConnectionPool.invoke(
                client, METHODS.watch, timeout=timeout, request=request
            )
        routes = client.routes
        assert routes is not None
        done, result = await routes.call_at(target, METHODS.watch, timeout, "request", request)
        return result if done else None

    def _heard(self, versions: dict[str, int]) -> bool:
        """Take a node's answer; whether anything is new."""
        keys = self.keys
        new = False
        for key, version in versions.items():
            if version > keys.get(key, -1):
                keys[key] = version
                new = True
        return new

    async def _layouts(self) -> bool:
        """Read the manifests of partitioned names not read at their version; whether
        the partitions watched changed (then the watch is cut anew)."""
        if self.raw:
            return False  # (keys as they are: partitions come by the prefix)
        stale = []
        for key, version in self.keys.items():
            parsed = parse_key(key)
            if parsed is None or parsed[1] is not None:
                continue
            name = parsed[0]
            if self.names is not None and name not in self.names:
                continue
            known = self.partitions.get(name)
            if known is None or known[0] < version:
                stale.append(key)
        if not stale:
            return False
        request = thrift.ParameterRequest(param_names=stale)
        response = await self.client.invoke(METHODS.pull_parameters, request=request)
        versions = {p.name: p.version for p in response.params}
        moved = False
        for name, layout in manifests_of(response.params).items():
            count = layout.count
            before = self.partitions.get(name)
            self.partitions[name] = (versions.get(manifest_key(name), 0), count)
            moved |= before is None or before[1] != count
        return moved and self.names is not None

    def versions(self) -> dict[str, int]:
        """Each name watched that exists: its version (a partitioned one's: its oldest
        partition's, once every partition was heard of); with ``keys``, each key's."""
        if self.raw:
            return dict(self.keys)
        found: dict[str, int] = {}
        parts: dict[str, dict[int, int]] = {}
        for key, version in self.keys.items():
            parsed = parse_key(key)
            if parsed is None:
                if key not in self.partitions:
                    found[key] = version
            elif parsed[1] is not None:
                parts.setdefault(parsed[0], {})[parsed[1]] = version
        for name, (_, count) in self.partitions.items():
            seen = parts.get(name, {})
            # (the partitions of its layout now: one cut anew may have had more)
            versions = [seen[i] for i in range(count) if i in seen]
            if len(versions) == count:
                found[name] = min(versions)
        if self.names is not None:
            return {n: found[n] for n in self.names if n in found}
        prefix = self.prefix or ""
        return {n: v for n, v in found.items() if n.startswith(prefix)}

    # -- following ----------------------------------------------------------------------

    async def _follow(self, target: Any, keys: list[str] | None) -> None:
        """Watch at ``target`` until cancelled (or it must be cut anew)."""
        while True:
            try:
                result = await self._call(target, keys, self.wait_ms)
            except Exception as exc:
                if not _passing(exc):
                    raise
                log.info("watch at %s failed (%s): watching again", target or "the node", exc)
                await asyncio.sleep(RETRY_AFTER)
                result = None
            if result is None:
                self._changed.set()  # (to be cut anew)
                self._tasks.pop(target, None)
                return
            if self._heard(result.versions):
                self._changed.set()

    def _start(self, plan: dict[Any, tuple[list[str] | None, str | None]]) -> None:
        for target, (keys, _) in plan.items():
            task = asyncio.ensure_future(self._follow(target, keys))
            task.add_done_callback(self._ended)
            self._tasks[target] = task

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            self._changed.set()

    async def _stop(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _snapshot(self) -> dict[Any, tuple[list[str] | None, str | None]]:
        """Every node asked once, at once (wait 0), until no new partition is learned;
        the plan it ends with. A node that fails for a passing reason (unreachable,
        restarting) is asked again, after ``RETRY_AFTER``."""
        while True:
            plan = self._plan()
            try:
                answers = await asyncio.gather(*(self._call(t, k, 0) for t, (k, _) in plan.items()))
                if all(a is not None for a in answers):
                    for answer in answers:
                        self._heard(answer.versions)
                    if not await self._layouts():
                        return plan
                    continue  # (partitions learned: cut anew, at once)
            except Exception as exc:
                if not _passing(exc):
                    raise
                log.info("could not watch (%s): trying again", exc)
            await asyncio.sleep(RETRY_AFTER)  # (cut anew: the topology was asked for again)

    async def __aiter__(self) -> AsyncIterator[dict[str, int]]:
        try:
            plan = await self._snapshot()
            reported = self.versions()
            seen = self._seen
            yield {n: v for n, v in reported.items() if seen.get(n) != v}
            self._start(plan)
            while True:
                await self._changed.wait()
                self._changed.clear()
                if self._failure is not None:
                    raise self._failure
                try:
                    cut_anew = await self._layouts()
                except Exception as exc:
                    if not _passing(exc):
                        raise
                    cut_anew = True
                if cut_anew or self._plan() != plan:
                    await self._stop()
                    plan = await self._snapshot()
                    self._start(plan)
                elif len(self._tasks) < len(plan):
                    self._start({t: p for t, p in plan.items() if t not in self._tasks})
                now = self.versions()
                changed = {n: v for n, v in now.items() if reported.get(n) != v}
                if changed:
                    reported = now
                    yield changed
        finally:
            await self._stop()


def _passing(exc: BaseException) -> bool:
    """Whether a watch call's failure passes (the node unreachable, restarting, slow):
    the watch goes on. Any other refusal, or the client closed, ends it."""
    if isinstance(exc, ClientClosedError):
        return False
    if isinstance(exc, RequestError):
        return exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT)
    return isinstance(exc, (ParamSyncError, OSError))
