"""A follower: a read-only mirror of another cluster (``aioparamsync-node --follow``).

Theory of operation. A follower serves reads, long polls and watches from
what it holds, as any node does, and refuses every write, naming the
cluster it follows (the leader). It keeps a routed client to the leader and
watches every key there (the IDL's ``watch``, by the prefix "", at each
leader node: see :mod:`aioparamsync.client.watch`), the versions it holds
given as the versions seen: so it is answered only what changed since, at
its start, after a restart (with a data directory) or a cut. The keys that
changed (a parameter's name, or a partitioned one's manifest and partitions:
keys as the leader stores them) are read from the leader by their own names
and merged into the store as a peer's replication is: the leader's version
and origin kept, last-writer-wins. While one batch is read, what changes
meanwhile collects in the watch's table of versions, so a key written many
times is read once, at its newest: the follower's cost grows with what
changed, not with the rate of writes.

A follower can be followed: another follower's watch at it is answered as
any node's, from what it merged. Its lag is in ``info()``'s counters (and so
in ``aioparamsync-ctl stats`` and the metrics): ``follow_lag_ms``, how long
the oldest change heard of and not yet merged has waited (0: none);
``follow_versions_behind``, the sum over keys of the versions heard of and
not merged; ``follow_keys_pulled`` and ``follow_batches``.

Embedding tables' rows are followed by bucket: every ``ROWS_INTERVAL`` the
follower asks each bucket's primary for the rows touched since it last
asked (``bucket_rows`` with ``touched_since``, by the holder's own clock,
less ``CLOCK_MARGIN``), in pages, and merges them as a replica does (a row
kept at its newer version); every ``FULL_EVERY`` rounds it asks for every
row, which mends what a change of primary (another clock) or an eviction
between two pages may have skipped. Rows are a second or so behind, and a
row read at the leader counts as touched (it comes again).

A cluster of followers (``--follow`` with ``--peers`` among themselves) is
a cluster as any other, with a placement of its own: each follower takes
from the leader only the keys and buckets it holds by that placement (every
follower watches every key, and skips those of others), and the followers
move keys among themselves as members do when one joins or leaves. So a
fleet of followers holds a model larger than one of them, and its readers'
traffic is spread over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from .client.api import Address, ParameterClient
from .client.pool import ConnectionPool
from .client.watch import Watcher
from .errors import ClientClosedError, ParamSyncError
from .placement import bucket_key
from .server.handlers import ParameterService
from .store.rows import table_spec
from .store.writer import ParameterStore
from .wire import METHODS, thrift

__all__ = ["Follower"]

log = logging.getLogger(__name__)

# The most keys read from the leader in one call.
BATCH_KEYS = 256
# How long to wait before watching the leader again after the watch failed (seconds).
RETRY_AFTER = 1.0
# How long each watch call is held at a leader node (seconds).
WATCH_WAIT = 10.0
# Rows: how often the buckets are asked (seconds), the rows in one page, the margin
# taken off the holder's clock, and every how many rounds every row is asked for.
ROWS_INTERVAL = 1.0
ROWS_PAGE = 65_536
CLOCK_MARGIN = 2.0
FULL_EVERY = 60


class Follower:
    """Mirrors the cluster at ``addresses`` into ``store`` (see the module).

    Args:
        service: the node's service: it refuses writes while this follows.
        store: where what is read from the leader is merged.
        addresses: nodes of the cluster followed (any one will do).
        client_options: for the client to the leader (timeouts, TLS).
    """

    def __init__(
        self,
        service: ParameterService,
        store: ParameterStore,
        addresses: Sequence[Address],
        **client_options: Any,
    ) -> None:
        self.service = service
        self.store = store
        self.addresses = list(addresses)
        shown = ", ".join(a if isinstance(a, str) else f"{a[0]}:{a[1]}" for a in self.addresses)
        self.leader = shown
        # (what is pulled is stored: never views of memory shared with the leader)
        self._options = {"shared_memory": 0, **client_options}
        self._task: asyncio.Task[None] | None = None
        self._watcher: Watcher | None = None
        self._waiting_since: float | None = None  # (a change heard of and not merged)
        self.keys_pulled = 0
        self.batches = 0
        self.rows_pulled = 0
        service.following = f"is a read-only follower of {shown}: nothing was written; write there"
        service.statistics_hooks.append(self.statistics)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="aioparamsync-follow")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def statistics(self) -> Mapping[str, int]:
        """The lag: see the module."""
        behind = 0
        watcher = self._watcher
        if watcher is not None:
            table = self.store.table
            for key, version in watcher.keys.items():
                if not self._holds(key):
                    continue
                entry = table.entry(key)
                held = entry.version if entry is not None else 0
                if version > held:
                    behind += version - held
        since = self._waiting_since
        lag = 0 if since is None or not behind else round((time.monotonic() - since) * 1000)
        return {
            "follow_lag_ms": lag,
            "follow_versions_behind": behind,
            "follow_keys_pulled": self.keys_pulled,
            "follow_batches": self.batches,
            "follow_rows_pulled": self.rows_pulled,
        }

    def _holds(self, key: str) -> bool:
        """Whether this follower takes ``key`` (in a cluster of followers: one it holds)."""
        cluster = self.service.cluster
        return cluster is None or cluster.holds_here(key)

    async def _run(self) -> None:
        while True:
            try:
                async with ParameterClient(self.addresses, **self._options) as client:
                    await _both(self._follow(client), self._follow_rows(client))
            except asyncio.CancelledError:
                raise
            except (ParamSyncError, OSError) as exc:
                if isinstance(exc, ClientClosedError):
                    raise
                log.warning("following %s: %s; again in %g s", self.leader, exc, RETRY_AFTER)
            await asyncio.sleep(RETRY_AFTER)

    async def _follow(self, client: ParameterClient) -> None:
        table = self.store.table
        held = {name: e.version for name in table.names() if (e := table.entry(name)) is not None}
        watcher = self._watcher = Watcher(client, None, "", WATCH_WAIT, keys=True, seen=held)
        async for changed in watcher:
            if not changed:
                continue
            self._waiting_since = time.monotonic()
            keys = sorted(k for k in changed if self._holds(k))
            for i in range(0, len(keys), BATCH_KEYS):
                await self._pull(client, keys[i : i + BATCH_KEYS])
            self._waiting_since = None

    async def _pull(self, client: ParameterClient, keys: list[str]) -> None:
        """Read ``keys`` from the leader as they are, and merge them here."""
        response = await client.get_parameters(keys)
        params = [p for p in response.params if p.data is not None]
        if not params:
            return
        self.batches += 1
        self.keys_pulled += len(params)
        await self.store.submit(params, response.timestamp or 0, replicated=True)

    # -- rows -----------------------------------------------------------------------------

    async def _follow_rows(self, client: ParameterClient) -> None:
        """Every ``ROWS_INTERVAL``: each bucket of each table, what changed (see the module)."""
        marks: dict[tuple[str, int], float] = {}
        rounds = 0
        while True:
            if rounds % FULL_EVERY == 0:
                marks.clear()
            rounds += 1
            for spec in await client.invoke(METHODS.tables):
                self.service.rows.tables.create(table_spec(spec))
                for bucket in range(table_spec(spec).buckets):
                    if self._holds(bucket_key(spec.name, bucket)):
                        await self._pull_bucket(client, spec.name, bucket, marks)
            await asyncio.sleep(ROWS_INTERVAL)

    async def _pull_bucket(
        self, client: ParameterClient, table: str, bucket: int, marks: dict[tuple[str, int], float]
    ) -> None:
        since = marks.get((table, bucket))
        routes = client.routes
        pool = routes.pool_of(bucket_key(table, bucket)) if routes is not None else None
        offset, as_of = 0, None
        while True:
            request = thrift.BucketRequest(
                table=table, bucket=bucket, offset=offset, limit=ROWS_PAGE,
                touched_since=None if since is None else since - CLOCK_MARGIN,
            )  # fmt: skip
            if pool is None:
                delta = await client.invoke(METHODS.bucket_rows, request=request)
            else:
                delta = await ConnectionPool.invoke(pool, METHODS.bucket_rows, request=request)
            as_of = delta.as_of if as_of is None else as_of
            count = len(delta.ids) // 8
            if count:
                merged = self.service.rows.merge([delta])
                if not isinstance(merged, int):
                    await merged
                self.rows_pulled += count
            if count < ROWS_PAGE:
                break
            offset += count
        if as_of is not None:
            marks[(table, bucket)] = as_of


async def _both(*coroutines: Coroutine[Any, Any, None]) -> None:
    """Run ``coroutines`` until one fails (its error raised), the others then cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
