"""Embedding tables' buckets after a change of topology (see :mod:`.rows`).

At each round of the node's rebalancer, a node pulls the whole of each bucket
it has become a replica of from the other replicas (``bucket_rows``, page by
page), and hands each bucket it is no replica of any more to its replicas
(``replicate_rows``), dropping it once every one of them has it and no newer
epoch has come meanwhile (as :mod:`..cluster.rebalance` does for parameters).

A node that becomes a bucket's primary (it claimed the bucket, or joined)
pulls it again from the others, of the rows touched since it last did: what
its primary folded meanwhile reached it through that node's outbox, which may
not have been sent yet; and from then on this node folds the bucket's rows,
on top of what it holds. It folds nothing until that round is done (the
round runs in its settle: see ``Transitions.take_over``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, ParamSyncError, RequestError
from ..placement import JOINING, LEAVING, bucket_key
from ..store.rows import RowTable, table_spec
from ..wire import METHODS, thrift

if TYPE_CHECKING:
    from .clusterview import ClusterView
    from .rows import RowService

__all__ = ["BucketMoves"]

log = logging.getLogger(__name__)

# The deadline of a call to a peer (seconds).
PEER_TIMEOUT = 30.0
# About the bytes of rows one message moves when a bucket moves.
PAGE_BYTES = 8 * 1024 * 1024


class BucketMoves:
    """The buckets of ``rows``' tables pulled and handed off (see the module)."""

    def __init__(self, rows: RowService) -> None:
        self.rows = rows
        # (table, bucket) -> the placement this node last took it at, and whether it was
        # the bucket's primary then; or the placement it last handed it off at
        self._synced: dict[tuple[str, int], tuple[Any, bool]] = {}
        self._handed: dict[tuple[str, int], Any] = {}
        # (table, bucket) -> member -> when (by that member's clock) it last read this
        # node the rows of the bucket (see _take); dropped with the bucket's mark
        self._as_of: dict[tuple[str, int], dict[str, float]] = {}
        # the epoch at which this node last learnt every member's tables (see _learn_tables)
        self._tables_at: int | None = None

    @property
    def cluster(self) -> ClusterView | None:
        """The node's cluster (the rows service's)."""
        return self.rows.cluster

    async def round(self) -> int:
        """Pull the buckets this node newly holds; hand off those it is to hold no more.

        By the placement to come (members joining or leaving counted): a
        leaving node hands every bucket on before it goes, and keeps serving
        them until it has (its folds meanwhile reach the holders to come as
        well: see :meth:`.RowService._replicate`); it drops a bucket once it is no replica
        of it now and every holder to come has it. Also drops the rows past
        their tables' ``row_ttl``. A round drops nothing once a newer epoch has come
        (as :mod:`..cluster.rebalance`'s). Answers the buckets that still wait.
        """
        rows = self.rows
        for table in list(rows.tables.tables.values()):
            table.evict(time.time())
        cluster = self.cluster
        if cluster is None or not cluster.links:
            return 0
        me, now, epoch = cluster.me.node_id, cluster.placement, cluster.epoch
        after = cluster.pending or now
        # (while it joins or takes over: what a round moves is the buckets of the tables
        # it knows; other times a table it lacks is learnt when asked for: see RowService)
        taking_over = cluster.state == JOINING or cluster.settling is not None
        if taking_over and self._tables_at != epoch and await self._learn_tables():
            self._tables_at = epoch
        waiting = 0
        for table in list(rows.tables.tables.values()):
            for bucket in range(table.spec.buckets):
                key = bucket_key(table.spec.name, bucket)
                mark = (table.spec.name, bucket)
                holders = after.replicas(key)
                if me in holders:
                    self._handed.pop(mark, None)
                    synced = (after, now.primary(key, cluster.live) == me)
                    was = self._synced.get(mark)
                    if was != synced:
                        # (and the members it read the bucket from before, live still: a
                        # node that joined, or claimed the bucket, read it whole from its
                        # old holders, which the placement no longer names once it is
                        # the primary: what they folded since comes from them)
                        read = [m for m in self._as_of.get(mark, ()) if m in cluster.live]
                        sources = {*holders, *now.replicas(key), *read} - {me}
                        # (became its primary, holding it at this placement already: of
                        # the rows touched since; else whole)
                        since = was is not None and was[0] == after and synced[1]
                        if await self._take(table, bucket, sources, since):
                            # (taken from every holder only once all are up: one down
                            # now is asked again at a later round)
                            if all(self._up(m) and cluster.trusted(m) for m in sources):
                                self._synced[mark] = synced
                        else:
                            waiting += 1
                    continue
                self._synced.pop(mark, None)
                self._as_of.pop(mark, None)
                if bucket not in table.blocks or cluster.state == JOINING:
                    # (a joining node hands nothing on, as for parameters: by a view
                    # that may be behind, it could hand a bucket a leaving member
                    # just handed to it back to that member, and both drop it)
                    continue
                if self._handed.get(mark) != after:
                    if not holders or not all(self._up(h) for h in holders if h != me):
                        # (kept here until every holder to come is up to take it: a
                        # leaving node waits for one that joins, whose link comes up,
                        # rather than go with the bucket; no holder at all: stuck)
                        waiting += bool(holders) and cluster.state == LEAVING
                        continue
                    if not await self._hand_off(table, bucket, holders):
                        waiting += 1
                        continue
                    self._handed[mark] = after
                if me not in now.replicas(key):
                    if cluster.epoch != epoch:
                        # (handed off for the placement before a newer epoch: the
                        # next round, which that epoch starts, decides)
                        waiting += 1
                        continue
                    # (another round, the claim's or the periodic one, may have
                    # dropped it meanwhile)
                    table.blocks.pop(bucket, None)
                    self._handed.pop(mark, None)
        return waiting

    async def _learn_tables(self) -> bool:
        """Make the tables the members up hold that this node does not know yet (a node
        that joins, or was cut off when one was made): a round moves the buckets of the
        tables it knows; whether every member up answered."""
        cluster = self.cluster
        assert cluster is not None  # (a round runs in a cluster)
        tables = self.rows.tables
        members = [m for m in cluster.by_id if self._up(m) and cluster.trusted(m)]

        async def learn(member: str) -> bool:
            try:
                link = cluster.by_id[member]
                known = await link.proxy().invoke(METHODS.tables, timeout=PEER_TIMEOUT)
            except ParamSyncError:
                return False
            for t in known:
                if t.name in tables:
                    continue
                try:
                    tables.create(table_spec(t))
                except RequestError as exc:  # (a spec this node cannot take: the rest go on)
                    log.warning("table %r of %s not made here: %s", t.name, member, exc.message)
            return True

        return all(await asyncio.gather(*(learn(m) for m in members)))

    async def _take(
        self, table: RowTable, bucket: int, sources: Iterable[str], since: bool = False
    ) -> bool:
        """Merge the rows of ``bucket`` every other live one of ``sources`` holds, page by
        page (with ``since``, those touched since it last answered: see the module);
        whether every one answered."""
        cluster = self.cluster
        assert cluster is not None  # (a round runs in a cluster)
        me = cluster.me.node_id
        # (not from a member whose lease expired: what it holds may lose acknowledged rows)
        others = [m for m in sources if m != me and self._up(m) and cluster.trusted(m)]
        page = self._page_rows(table)
        ok = True
        for member in others:
            offset, total = 0, 1
            read_at = self._as_of.setdefault((table.spec.name, bucket), {})
            touched_since = read_at.get(member) if since else None
            while offset < total:
                request = thrift.BucketRequest(
                    table=table.spec.name,
                    bucket=bucket,
                    offset=offset,
                    limit=page,
                    touched_since=touched_since,
                )
                try:
                    link = cluster.by_id[member]
                    delta = await link.proxy().invoke(
                        METHODS.bucket_rows, timeout=PEER_TIMEOUT, request=request
                    )
                except RequestError as exc:
                    ok = ok and exc.code == ErrorCode.UNKNOWN_PARAMETER  # (no such table there)
                    break
                except ParamSyncError:
                    ok = False
                    break
                if table.merge(delta, time.time()) and self.rows.log is not None:
                    await self.rows.log([delta])
                if offset == 0 and delta.as_of is not None:
                    read_at[member] = delta.as_of  # (read before its first page's rows)
                total = delta.total or 0
                offset += page
        return ok

    async def _hand_off(self, table: RowTable, bucket: int, holders: Iterable[str]) -> bool:
        """Give every row of ``bucket`` to each of ``holders``, page by page; whether every
        one of them took it (each must be linked)."""
        rows, cluster = self.rows, self.cluster
        assert cluster is not None  # (a round runs in a cluster)
        me = cluster.me.node_id
        holders = [h for h in holders if h != me]
        block = table.blocks[bucket]
        page = self._page_rows(table)
        for offset in range(0, max(len(block), 1), page):
            delta = table.delta(bucket, None, me, slice(offset, offset + page))
            sent = await asyncio.gather(*(rows.send_deltas(h, [delta]) for h in holders))
            if not all(sent):
                return False
        return True

    def _up(self, member: str) -> bool:
        """Whether this node's link to ``member`` is up (it may be joining)."""
        cluster = self.cluster
        link = cluster.by_id.get(member) if cluster is not None else None
        return link is not None and link.state == "up"

    @staticmethod
    def _page_rows(table: RowTable) -> int:
        """Rows of a page of a bucket moved between nodes (values and state: ~PAGE_BYTES)."""
        return max(1, PAGE_BYTES // table.spec.row_bytes)
