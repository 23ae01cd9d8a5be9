"""Watches: a caller held until a key it watches changes (the IDL's ``watch``).

A watch names keys (parameters' names, or a partitioned parameter's own
keys) or a prefix of names, and the version of each key its caller has
seen. It is answered the keys whose version here differs from what the
caller has seen (or that it has not seen), with the version held: at once
when there are some, else as soon as one changes, or empty once ``wait_ms``
has passed. A name stored as partitions is answered by its manifest's key
(see :mod:`aioparamsync.placement`): the caller learns the partitions from
the manifest and watches them where they are (see
:mod:`aioparamsync.client.watch`).

Wake-ups are driven by the store's feed of applied entries (local and
replicated alike, so a replica serves watches too), as the long polls' are:
a watch by names is looked at only when one of its keys changes, one by
prefix when a key of a name with that prefix does. Nothing queues here: the
answer is made from what the table holds when it is answered, so a slow
watcher sees the newest versions, never a backlog.

Bounds: ``MAX_WATCHES`` held at once on a node, ``MAX_PREFIX_WATCHES`` of
them by prefix (each looks at every key applied); the names of one watch and
its known versions as any request's (``max_names_per_request``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ErrorCode, RequestError
from ..placement import is_reserved, manifest_key, parse_key
from ..store.table import Entry
from ..store.writer import ParameterStore
from ..wire import Method, thrift
from .holds import _wait_seconds
from .routing import Router

__all__ = ["MAX_PREFIX_WATCHES", "MAX_WATCHES", "Watches"]

# The most watches a node holds at once, and of those by prefix.
MAX_WATCHES = 10_000
MAX_PREFIX_WATCHES = 1_000


@dataclass(eq=False)
class _Watch:
    """One held watch: its keys (or prefix), what its caller has seen, its answer."""

    keys: tuple[str, ...] | None
    prefix: str | None
    known: dict[str, int]
    method: Method
    future: asyncio.Future | None = None


def _name_of(key: str) -> str | None:
    """The parameter's name ``key`` is (a name, a partition's or manifest's key); None:
    no parameter's key (a barrier's, a table bucket's)."""
    if not is_reserved(key):
        return key
    parsed = parse_key(key)
    return None if parsed is None else parsed[0]


class Watches:
    """The watches held by one node (see the module).

    Args:
        store: its feed of applied entries wakes the watches.
        router: what this node holds, in a cluster.
    """

    def __init__(self, store: ParameterStore, router: Router) -> None:
        self.store = store
        self.router = router
        self._by_key: dict[str, set[_Watch]] = {}
        self._prefixed: set[_Watch] = set()
        self._all: set[_Watch] = set()
        self.answered = 0  # watches answered with a change
        store.subscribe(self._applied)

    def __len__(self) -> int:
        return len(self._all)

    # -- the call ---------------------------------------------------------------------

    def handle(self, method: Method, args: Any) -> Any:
        """The IDL's ``watch``: its result, or a future of it (held)."""
        request = args.request
        if request is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the watch request is missing")
        names, prefix = request.names, request.prefix
        if (names is None) == (prefix is None):
            raise RequestError(
                ErrorCode.BAD_REQUEST, "a watch names its keys or gives a prefix: one of the two"
            )
        limit = self.store.table.limits.max_names_per_request
        known = request.known_versions or {}
        if names is not None:
            if not names:
                raise RequestError(ErrorCode.BAD_REQUEST, "a watch of no names")
            for name in names:
                if not isinstance(name, str) or not name or _name_of(name) is None:
                    raise RequestError(
                        ErrorCode.BAD_REQUEST, f"{name!r} is no parameter's name or key"
                    )
        for count, what in ((len(names or ()), "names"), (len(known), "known versions")):
            if count > limit:
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"{count} {what} in one watch; the limit is {limit}",
                )
        seconds = _wait_seconds(request.wait_ms)
        router = self.router
        if request.epoch is not None:
            if names is not None:
                router.check_routed(names)
        elif not router.serves_all():
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                "this node holds a share of the cluster's keys: a watch is sent to the nodes "
                "that hold them, routed by the topology (ParameterClient.watch does so)",
            )
        keys = None if names is None else tuple(dict.fromkeys(names))
        watch = _Watch(keys, prefix, known, method)
        changed = self._changed(watch)
        if changed or seconds == 0:
            return method.result(success=thrift.WatchResult(versions=changed))
        if len(self._all) >= MAX_WATCHES or (
            prefix is not None and len(self._prefixed) >= MAX_PREFIX_WATCHES
        ):
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"this node holds {len(self._all)} watches ({len(self._prefixed)} by prefix), "
                f"its most ({MAX_WATCHES}, {MAX_PREFIX_WATCHES}): watch fewer, or wait less",
            )
        loop = asyncio.get_running_loop()
        watch.future = future = loop.create_future()
        self._hold(watch)
        timer = loop.call_later(seconds, self._answer, watch, {})

        def done(_: asyncio.Future) -> None:
            timer.cancel()
            self._forget(watch)

        future.add_done_callback(done)
        return future

    def _changed(self, watch: _Watch) -> dict[str, int]:
        """The keys of ``watch`` held here at another version than its caller saw."""
        table = self.store.table
        known = watch.known
        changed: dict[str, int] = {}
        if watch.keys is not None:
            for key in watch.keys:
                entry = table.entry(key)
                if entry is None and not is_reserved(key):
                    key = manifest_key(key)  # (stored as partitions: its manifest says so)
                    entry = table.entry(key)
                if entry is not None and known.get(key) != entry.version:
                    changed[key] = entry.version
            return changed
        prefix = watch.prefix
        assert prefix is not None
        for key in table.names():
            name = _name_of(key)
            if name is None or not name.startswith(prefix):
                continue
            entry = table.entry(key)
            if entry is not None and known.get(key) != entry.version:
                changed[key] = entry.version
        return changed

    # -- holding ----------------------------------------------------------------------

    @staticmethod
    def _woken_by(watch: _Watch) -> list[str]:
        """The keys whose change wakes a watch by names: each, and a name's manifest."""
        assert watch.keys is not None
        keys = list(watch.keys)
        keys += [manifest_key(k) for k in watch.keys if not is_reserved(k)]
        return keys

    def _hold(self, watch: _Watch) -> None:
        self._all.add(watch)
        if watch.keys is None:
            self._prefixed.add(watch)
            return
        for key in self._woken_by(watch):
            self._by_key.setdefault(key, set()).add(watch)

    def _forget(self, watch: _Watch) -> None:
        self._all.discard(watch)
        if watch.keys is None:
            self._prefixed.discard(watch)
            return
        for key in self._woken_by(watch):
            held = self._by_key.get(key)
            if held is not None:
                held.discard(watch)
                if not held:
                    del self._by_key[key]

    def _answer(self, watch: _Watch, changed: dict[str, int]) -> None:
        future = watch.future
        if future is not None and not future.done():
            result = thrift.WatchResult(versions=changed)
            future.set_result(watch.method.result(success=result))

    def _applied(self, entries: Sequence[Entry], replicated: bool) -> None:
        if not self._all:
            return
        woken: set[_Watch] = set()
        by_key = self._by_key
        for entry in entries:
            key = entry.name
            if by_key:
                held = by_key.get(key)
                if held:
                    woken.update(held)
            if self._prefixed:
                name = _name_of(key)
                if name is not None:
                    woken.update(w for w in self._prefixed if name.startswith(w.prefix or ""))
        for watch in woken:
            changed = self._changed(watch)
            if changed:
                self.answered += 1
                self._answer(watch, changed)
