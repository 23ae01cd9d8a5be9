"""Embedding tables on the node: create_table, pull_rows, push_row_gradients, and between
nodes replicate_rows and bucket_rows.

Theory of operation. A table is made on every member: the node asked passes
it on to the others (``forwarded``); a node that missed it (down then, or
joined since) learns it from a peer when first asked for it, or from the
table carried by every ``RowDelta``. A table's rows are placed by bucket
(:func:`~aioparamsync.placement.bucket_key`), so a bucket is a key like a
parameter's name: its replicas hold its rows, its primary folds them.

- A pull is served from what this node holds; a routed one (``epoch`` set)
  naming a bucket it does not hold is answered MOVED; an unrouted one asks
  the buckets' holders for their rows and puts the answer together.
- A push is checked whole first (the table, the ids, every gradient finite),
  then cut by bucket primary: this node's part is folded here, each other
  part is passed on to its primary (``forwarded``, with this node's epoch),
  by the one forward policy of every key (:mod:`.forward`). A push folds each
  bucket once per request id (see :class:`~aioparamsync.store.rows.RowLedger`).
- The rows a fold changed go to the bucket's other replicas as a parameter's
  update does: offered to the links' outboxes (a link's
  :mod:`~aioparamsync.cluster.rowbox`), sent on the replication lane
  (``replicate_rows``), kept for the next connection when a send fails, and
  confirmed by the links' pings with ``acks=all``. A replica keeps a row
  unless it holds it at the same or a newer version.
- After a change of topology (:class:`~.bucketmoves.BucketMoves`) a node
  pulls the whole of each bucket it has become a replica of from the other
  replicas (``bucket_rows``), and hands each bucket it is no replica of any
  more to its replicas, dropping it once every one of them has it.

While a joining node takes its buckets over (``cluster.settling``) it folds
nothing, as for dense gradients: two primaries of one bucket would each
make a row's next version, and one would be lost.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import ErrorCode, ParamSyncError, RequestError
from ..placement import LEAVING, LEFT, bucket_key
from ..store.rows import RowTable, RowTables, counts_of, table_spec
from ..values.rowcopy import put_rows
from ..values.rowwire import (
    ROW_ENCODINGS,
    decode_ids,
    decode_rows,
    encode_ids,
    encode_rows,
    rows_out,
)
from ..wire import METHODS, Method, thrift
from . import forward
from .bucketmoves import PEER_TIMEOUT, BucketMoves
from .clusterview import ClusterView

__all__ = ["RowService"]


def _bucket_shown(key: str) -> str:
    """A bucket's key (see :func:`~aioparamsync.placement.bucket_key`) as errors show it:
    ``bucket 3 of table 'emb'``."""
    _, _, table, bucket = key.split("\x00", 3)
    return f"bucket {bucket} of table {table!r}"


log = logging.getLogger(__name__)


class RowService:
    """The row methods of one node (see the module).

    Args:
        cluster: the node's cluster, or None (a node alone).
        tables: the node's tables (made empty when None).
    """

    def __init__(self, cluster: ClusterView | None = None, tables: RowTables | None = None) -> None:
        self.cluster = cluster
        self.tables = tables if tables is not None else RowTables()
        self.passed_on = 0  # parts of row calls passed on to other nodes
        # (parts of pushes passed on whose calls ended unanswered: see forward.InDoubt)
        self.in_doubt = forward.InDoubt()
        self.replication_failures = 0
        #: the buckets pulled and handed off after a change of topology
        self.moves = BucketMoves(self)
        #: called with the deltas a fold or merge made, before it is answered
        #: (the node's data directory logs them), or None
        self.log: Any = None
        # The pushes under way, by (request id, table): the buckets each folds, and a
        # future done when it ends. One sent again meanwhile for some of the same buckets
        # waits for it, then folds only what it did not (see _push).
        self._pushing: dict[tuple[str, str], list[tuple[frozenset[int], asyncio.Future[None]]]] = {}

    def handlers(self) -> dict[Method, Any]:
        return {
            METHODS.create_table: self.create_table,
            METHODS.tables: self.list_tables,
            METHODS.pull_rows: self.pull_rows,
            METHODS.push_row_gradients: self.push,
            METHODS.replicate_rows: self.replicate,
            METHODS.bucket_rows: self.bucket_rows,
        }

    @property
    def _me(self) -> str:
        return self.cluster.me.node_id if self.cluster is not None else ""

    def _peers(self) -> bool:
        cluster = self.cluster
        return cluster is not None and bool(cluster.links)

    # -- tables -------------------------------------------------------------------

    def create_table(self, method: Method, args: Any) -> Any:
        spec = table_spec(args.table)
        if self.tables.create(spec)[1]:
            log.info("table %r made: %s", spec.name, spec.wire)
        if args.table.forwarded or not self._peers():
            return method.result(success=spec.wire)
        return asyncio.ensure_future(self._tell_members(method, spec))

    async def _tell_members(self, method: Method, spec: Any) -> Any:
        cluster = self.cluster
        assert cluster is not None
        passed = thrift.Table(**{**spec.wire.__dict__, "forwarded": True})
        targets = [m for m in cluster.live if m != self._me and m in cluster.by_id]

        async def tell(member: str) -> None:
            try:
                link = cluster.by_id[member]
                await link.proxy().invoke(METHODS.create_table, timeout=PEER_TIMEOUT, table=passed)
            except RequestError:
                raise  # (it holds another table of that name: the caller must know)
            except ParamSyncError as exc:
                log.info(
                    "table %r not told to %s (%s): it learns it when asked", spec.name, member, exc
                )

        await asyncio.gather(*(tell(m) for m in targets))
        return method.result(success=spec.wire)

    def list_tables(self, method: Method, args: Any) -> Any:
        return method.result(success=[t.spec.wire for t in self.tables.tables.values()])

    async def _table(self, name: Any) -> RowTable:
        """The table ``name``, learnt from a peer when this node does not know it yet."""
        if not isinstance(name, str):
            raise RequestError(ErrorCode.BAD_REQUEST, "the table's name is missing")
        table = self.tables.get(name)
        if table is not None:
            return table
        if self._peers():
            cluster = self.cluster
            assert cluster is not None
            for member in sorted(cluster.live):
                link = cluster.by_id.get(member)
                if link is None:
                    continue
                try:
                    known = await link.proxy().invoke(METHODS.tables, timeout=PEER_TIMEOUT)
                except ParamSyncError:
                    continue
                for t in known:
                    if t.name == name:
                        return self.tables.create(table_spec(t))[0]
        raise RequestError(ErrorCode.UNKNOWN_PARAMETER, f"no table {name!r}")

    def _table_now(self, name: Any) -> RowTable | None:
        return self.tables.get(name) if isinstance(name, str) else None

    # -- pulls ----------------------------------------------------------------------

    def pull_rows(self, method: Method, args: Any) -> Any:
        request = args.request
        if request is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the request is missing")
        if request.encoding is not None and request.encoding not in ROW_ENCODINGS:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"rows are encoded as one of {', '.join(ROW_ENCODINGS)}, not {request.encoding!r}",
            )
        ids = decode_ids(request.ids)
        table = self._table_now(request.table)
        if table is not None and (request.epoch is not None or not self._peers()):
            return method.result(success=self._pull_held(table, ids, request))
        return asyncio.ensure_future(self._pull(method, request, ids))

    async def _pull(self, method: Method, request: Any, ids: np.ndarray) -> Any:
        table = await self._table(request.table)
        if request.epoch is not None or not self._peers():
            return method.result(success=self._pull_held(table, ids, request))
        cluster = self.cluster
        assert cluster is not None
        positions_of: dict[str, np.ndarray] = {}
        for bucket, positions in table.by_bucket(ids):
            positions_of[bucket_key(table.spec.name, bucket)] = positions
        parts = forward.cut(
            cluster, positions_of, what="the pull", held_here=True, shown=_bucket_shown
        )
        out, answer = rows_out(request, len(ids), table.spec.dim, table.spec.dtype)

        def where(keys: list[str]) -> np.ndarray:
            return np.concatenate([positions_of[k] for k in keys])

        async def here(keys: list[str]) -> None:
            positions = where(keys)
            table.read_into(ids[positions], out, positions)

        async def send(link: Any, keys: list[str], fallback: bool) -> None:
            positions = where(keys)
            # (raw, and with this node's epoch: the holder answers what it holds, or MOVED)
            sub = thrift.RowsRequest(
                table=table.spec.name, ids=encode_ids(ids[positions]), epoch=cluster.epoch
            )
            answer = await link.proxy().invoke(METHODS.pull_rows, timeout=PEER_TIMEOUT, request=sub)
            self.passed_on += 1
            put_rows(out, positions, decode_rows(answer, count=len(positions), dim=table.spec.dim))

        async def part(node: str | None, keys: list[str]) -> None:
            if node is None:
                await here(keys)
            else:
                what = f"a pull of rows of table {table.spec.name!r}"
                await forward.pass_on(cluster, node, keys, send, here, what=what, idempotent=True)

        await asyncio.gather(*(part(node, keys) for node, keys in parts.items()))
        return method.result(success=answer or encode_rows(out, request.encoding))

    def _pull_held(self, table: RowTable, ids: np.ndarray, request: Any) -> Any:
        """The rows of ``ids``, all in buckets held here (else MOVED: see _check_held),
        as ``request`` asks them (``Rows``)."""
        self._check_held(table, ids, "does not hold")
        out, answer = rows_out(request, len(ids), table.spec.dim, table.spec.dtype)
        table.read_into(ids, out)
        return answer or encode_rows(out, request.encoding)

    def _check_held(
        self, table: RowTable, ids: np.ndarray, what: str, primary: bool = False
    ) -> None:
        """Refuse (MOVED) a routed call for buckets this node does not hold (is not the
        primary of, with ``primary``) at its epoch."""
        cluster = self.cluster
        if cluster is not None and cluster.links:
            keys = [bucket_key(table.spec.name, bucket) for bucket in table.buckets_in(ids)]
            forward.gate(cluster, keys, primary=primary, what=what, shown=_bucket_shown)

    # -- pushes ---------------------------------------------------------------------

    def push(self, method: Method, args: Any) -> Any:
        push = args.push
        if push is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the push is missing")
        if push.acks is not None and push.acks not in ("1", "all"):
            raise RequestError(ErrorCode.BAD_REQUEST, f'acks is "1" or "all", not {push.acks!r}')
        ids = decode_ids(push.ids)
        if self.cluster is not None and self.cluster.coordinator is not None:  # (fenced: refused)
            self.cluster.check_writable((), "1")
        return asyncio.ensure_future(self._push(method, push, ids))

    async def _push(self, method: Method, push: Any, ids: np.ndarray) -> Any:
        table = await self._table(push.table)
        grads = decode_rows(push.grads, count=len(ids), dim=table.spec.dim)
        table.check(ids, grads)
        if push.assign and len(np.unique(ids)) < len(ids):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"table {table.spec.name!r}: ids repeat; each row is set once",
            )
        if push.request_id is None:
            return await self._push_once(method, push, table, ids, grads)
        # A push sent again while the first is under way here (its caller saw another
        # part fail, and sent it all again): it waits, for what the first folds is
        # remembered only once it is folded, and would be folded twice. Only for a push
        # of some of the same buckets: parts of one call for other buckets (passed on
        # here from another node, while this node passes a part to that one) go on, or
        # the two nodes would wait for each other.
        key = (push.request_id, table.spec.name)
        mine = frozenset(table.buckets_in(ids))
        while waits := [f for buckets, f in self._pushing.get(key, ()) if buckets & mine]:
            await asyncio.wait(waits)
        entry = (mine, asyncio.get_running_loop().create_future())
        self._pushing.setdefault(key, []).append(entry)
        try:
            return await self._push_once(method, push, table, ids, grads)
        finally:
            under_way = self._pushing[key]
            under_way.remove(entry)
            if not under_way:
                del self._pushing[key]
            entry[1].set_result(None)

    async def _push_once(
        self, method: Method, push: Any, table: RowTable, ids: np.ndarray, grads: np.ndarray
    ) -> Any:
        name = table.spec.name
        done = self.tables.ledger.folded(push.request_id, name)
        rows = created = 0
        if done:
            keep = ~np.isin(table.buckets_of(ids), np.fromiter(done, np.int64, len(done)))
            if not keep.all():
                self.tables.ledger.repeated += 1
                rows += sum(done.values())
                ids, grads = ids[keep], grads[keep]
        if len(ids):
            if push.forwarded and push.epoch is not None:
                self._check_held(table, ids, "is not the primary of", primary=True)
            if push.forwarded or not self._peers():
                r, c = await self._fold_here(table, ids, grads, push)
            else:
                r, c = await self._fold_by_primary(table, ids, grads, push)
            rows, created = rows + r, created + c
        return method.result(success=thrift.RowsResult(rows=rows, created=created))

    async def _fold_here(
        self, table: RowTable, ids: np.ndarray, grads: np.ndarray, push: Any
    ) -> tuple[int, int]:
        cluster = self.cluster
        if cluster is not None and (
            cluster.links or cluster.settling is not None or cluster.coordinator is not None
        ):
            keys = [bucket_key(table.spec.name, b) for b in table.buckets_in(ids)]
            # (passed on here as a fallback, its primary out of reach: folded here
            # unless its holders changed; else only while this node is their primary)
            fallback = push.forwarded and push.epoch is None
            if (settling := cluster.settling) is not None:
                # (its buckets may move meanwhile, claimed by a member: see forward.unmoved)
                unmoved = forward.unmoved(cluster, keys, _bucket_shown)
                await settling
                if fallback:
                    unmoved()
            if not fallback:
                # (checked with no wait before the fold: the view may have changed since
                # the push was cut, between the awaits on its way here: a member joined
                # or claimed its buckets, and folds them from then on; folded here too,
                # one of the two versions would be lost. Refused: the part goes on to
                # the primary, and the entry node remembers it was folded there)
                forward.gate(
                    cluster,
                    keys,
                    primary=True,
                    what="is no longer the primary of",
                    then="nothing was folded",
                    shown=_bucket_shown,
                )
            if cluster.coordinator is not None:
                # (acks=all: refused before it is folded while a live replica of one of its
                # buckets cannot be reached, as a write of parameters is)
                acks = push.acks or cluster.acks
                cluster.check_writable(keys if acks == "all" else [], acks)
        changed, created = (table.assign if push.assign else table.fold)(ids, grads, time.time())
        folded = counts_of(changed)  # (grouped by bucket only to log or replicate them)
        self.tables.ledger.remember(push.request_id, table.spec.name, folded)
        if self.log is not None:  # (the changed rows copied only to go out)
            await self.log([table.delta(b, c, self._me) for b, c in changed.items()])
        await self._replicate(table, changed, push.acks)
        return sum(folded.values()), created

    async def _fold_by_primary(
        self, table: RowTable, ids: np.ndarray, grads: np.ndarray, push: Any
    ) -> tuple[int, int]:
        """Fold each bucket's rows at its primary, by the one forward policy (:mod:`.forward`)."""
        cluster = self.cluster
        assert cluster is not None
        positions_of: dict[str, np.ndarray] = {}
        bucket_of: dict[str, int] = {}
        for bucket, positions in table.by_bucket(ids):
            key = bucket_key(table.spec.name, bucket)
            positions_of[key], bucket_of[key] = positions, bucket
        parts = forward.cut(cluster, positions_of, what="the push", shown=_bucket_shown)

        def where(keys: list[str]) -> np.ndarray:
            return np.concatenate([positions_of[k] for k in keys])

        async def here(keys: list[str]) -> tuple[int, int]:
            positions = where(keys)
            return await self._fold_here(table, ids[positions], grads[positions], push)

        async def send(link: Any, keys: list[str], fallback: bool) -> tuple[int, int]:
            positions = where(keys)
            sub = thrift.RowPush(
                table=table.spec.name,
                ids=encode_ids(ids[positions]),
                grads=encode_rows(grads[positions]),
                request_id=push.request_id,
                # (to a next replica, its primary out of reach: folded where it arrives)
                epoch=None if fallback else cluster.epoch,
                acks=push.acks or cluster.acks,
                forwarded=True,
                assign=push.assign,
            )
            result = await link.proxy().invoke(
                METHODS.push_row_gradients, timeout=PEER_TIMEOUT, push=sub
            )
            self.passed_on += 1
            # (folded there: remembered here too, so that the push sent again to this
            # node, which may then be the buckets' holder, does not fold them again)
            if push.request_id is not None:
                self.tables.ledger.remember(
                    push.request_id,
                    table.spec.name,
                    {bucket_of[k]: len(np.unique(ids[positions_of[k]])) for k in keys},
                )
            return result.rows, result.created

        async def part(node: str | None, keys: list[str]) -> list[tuple[int, int]]:
            what = f"rows of table {table.spec.name!r}"
            if node is None:
                node = cluster.me.node_id  # (served here, or where its keys went)
            return await forward.pass_on(
                cluster,
                node,
                keys,
                send,
                here,
                what=what,
                in_doubt=self.in_doubt,
                request_id=push.request_id,
            )

        results = await asyncio.gather(*(part(node, keys) for node, keys in parts.items()))
        done = [r for rs in results for r in rs]
        return sum(r for r, _ in done), sum(c for _, c in done)

    # -- replication ------------------------------------------------------------------

    async def _replicate(
        self, table: RowTable, changed: Mapping[int, np.ndarray], acks: str | None
    ) -> None:
        """Offer each bucket's changed rows to the links of its other replicas (and of those
        to come, while members join or leave), as a parameter's update is offered; with
        acks=all, wait until they confirm them (:meth:`Cluster.replicated`)."""
        cluster = self.cluster
        if cluster is None or not cluster.links or not changed:
            return
        me, pending = self._me, cluster.pending
        keys = []
        for bucket, ids in changed.items():
            key = bucket_key(table.spec.name, bucket)
            keys.append(key)
            targets = set(cluster.placement.replicas(key))
            if pending is not None:
                targets.update(pending.replicas(key))
            for replica in targets:
                if replica != me and (link := cluster.by_id.get(replica)) is not None:
                    link.offer_rows(table, bucket, ids)
        if (acks or cluster.acks) == "all":
            try:
                await cluster.replicated(keys)
            except RequestError as exc:
                raise RequestError(
                    exc.code, f"rows of table {table.spec.name!r}: {exc.message}", exc.epoch
                ) from None

    async def send_deltas(self, replica: str, deltas: list[Any]) -> bool:
        """Send ``deltas`` to ``replica`` now, on the replication lane; whether it took them."""
        try:
            assert self.cluster is not None  # (a replica: a cluster's)
            link = self.cluster.by_id[replica]
            await link.replicate(METHODS.replicate_rows, timeout=PEER_TIMEOUT, deltas=deltas)
            return True
        except (ParamSyncError, KeyError) as exc:
            self.replication_failures += 1
            log.info("rows of %d buckets not sent to %s (%s)", len(deltas), replica, exc)
            return False

    def replicate(self, method: Method, args: Any) -> Any:
        deltas = args.deltas
        if not deltas or any(d is None or d.table is None for d in deltas):
            raise RequestError(ErrorCode.BAD_REQUEST, "the deltas are missing, or their table")
        self._check_leaving(deltas)
        outcome = self.merge(deltas)
        if isinstance(outcome, int):
            return method.result(success=outcome)
        merged = outcome

        async def logged() -> Any:
            return method.result(success=await merged)

        return asyncio.ensure_future(logged())

    def _check_leaving(self, deltas: list[Any]) -> None:
        """Refuse (UNAVAILABLE) rows handed to this node while it leaves: it holds no
        bucket to come, and what it hands on it has handed on already. (A member whose
        view is behind takes it for a holder still; it keeps the bucket until it sees
        where the bucket goes.) Rows its buckets' primaries replicate to it are kept:
        it serves them until it has gone."""
        cluster = self.cluster
        if cluster is None or cluster.state not in (LEAVING, LEFT):
            return
        placement, live = cluster.placement, cluster.live
        for delta in deltas:
            key = bucket_key(delta.table.name, delta.bucket)
            if placement.primary(key, live) != delta.from_peer:
                raise RequestError(
                    ErrorCode.UNAVAILABLE,
                    f"node {self._me} is leaving: it takes no rows handed to it "
                    f"(bucket {delta.bucket} of table {delta.table.name!r}); nothing was kept",
                )

    def merge(self, deltas: list[Any]) -> int | asyncio.Future[int]:
        """Keep the rows of ``deltas`` newer than those held (making their tables);
        answer how many were kept, or (with a data directory) a future of it, once
        they are logged."""
        kept_deltas, kept = [], 0
        now = time.time()
        cluster = self.cluster
        for delta in deltas:
            if cluster is not None and not cluster.trusted(delta.from_peer):
                # (a member whose lease expired: rows its replicas never confirmed,
                # as for parameters; see server.handlers)
                log.debug("rows from %s ignored: not a member", delta.from_peer)
                continue
            table = self.tables.create(table_spec(delta.table))[0]
            n = table.merge(delta, now)
            if n:
                kept += n
                kept_deltas.append(delta)
        if self.log is None or not kept:
            return kept
        log_rows = self.log

        async def logged() -> int:
            await log_rows(kept_deltas)
            return kept

        return asyncio.ensure_future(logged())

    def bucket_rows(self, method: Method, args: Any) -> Any:
        request = args.request
        if request is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the request is missing")
        table = self._table_now(request.table)
        if table is None:
            raise RequestError(ErrorCode.UNKNOWN_PARAMETER, f"no table {request.table!r}")
        bucket = request.bucket
        if not isinstance(bucket, int) or not 0 <= bucket < table.spec.buckets:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"table {table.spec.name!r} has no bucket {bucket!r}"
            )
        offset, limit = request.offset or 0, request.limit
        if offset < 0 or (limit is not None and limit < 1):
            raise RequestError(ErrorCode.BAD_REQUEST, "a page has an offset >= 0 and a limit >= 1")
        since = request.touched_since
        if since is not None and not math.isfinite(since):
            raise RequestError(ErrorCode.BAD_REQUEST, f"touched_since is a time, not {since}")
        span = slice(offset, None if limit is None else offset + limit)
        as_of = time.time()  # (before the rows are read: a row touched meanwhile comes again)
        delta = table.delta(bucket, None, self._me, span, since)
        block = table.blocks.get(bucket)
        delta.total = len(block) if block is not None else 0
        delta.as_of = as_of
        return method.result(success=delta)
