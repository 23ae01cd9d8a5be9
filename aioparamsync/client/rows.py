"""Embedding tables from a client: create them, pull rows by id, push row gradients.

A table's rows are placed by bucket (``placement.bucket_of`` of the id, then
``placement.bucket_key``): a routed client cuts a pull or a push by the node
each bucket goes to (a push to its primary, a pull as ``read_from`` says:
with ``"any"``, a row pull may lag a push by a replication message),
sends the parts concurrently and puts the answers back in the order of the
ids. A part answered MOVED, or sent to a node that cannot be reached, is cut
again by the topology asked for anew; after ``MAX_MOVES`` it goes unrouted to
the client's node, which passes on what it does not hold. The table's bucket
count is what the cut needs: the client keeps the tables it created or read.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from types import EllipsisType
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..errors import ErrorCode, RequestError
from ..placement import bucket_key
from ..values.arrays import is_bfloat16, parse_dtype, wire_dtype
from ..values.rowcopy import put_rows, take_rows
from ..values.rowindex import bucket_of
from ..values.rowwire import ROW_ENCODINGS, decode_rows, encode_ids, encode_rows
from ..wire import METHODS, thrift
from .fetch import gather_all
from .pool import ConnectionPool
from .routing import MAX_MOVES

if TYPE_CHECKING:
    from .routing import Routes
    from .shared import Lane

__all__ = ["TableClient", "check_ids"]

INITS = ("zeros", "uniform", "normal")
_DTYPES = {
    "float32": "<f4",
    "float16": "<f2",
    "float64": "<f8",
    "bfloat16": "bfloat16",
}


def check_ids(ids: Any) -> np.ndarray:
    """``ids`` as a 1-D int64 array (a view where it already is one).

    Raises:
        ValueError: not 1-D, or not int64 (a Python list of ints is int64;
            cast other integer arrays with ``ids.astype(np.int64)``).
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids are a 1-D array of int64, not of shape {arr.shape}")
    if arr.dtype != np.int64:
        if arr.size == 0 and arr.dtype == np.float64:  # (np.asarray([]))
            return np.empty(0, np.int64)
        hint = " (cast with ids.astype(np.int64))" if arr.dtype.kind in "iu" else ""
        raise ValueError(f"ids are int64, not {arr.dtype}{hint}")
    return arr


def _dtype_string(dtype: Any) -> str:
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype is one of {', '.join(_DTYPES)}, not {dtype!r}") from None
    if not (dt.kind == "f" or is_bfloat16(dt)):
        raise ValueError(f"a table's values are floats (one of {', '.join(_DTYPES)}), not {dt}")
    return wire_dtype(dt)


class TableClient:
    """The embedding-table half of :class:`~aioparamsync.client.api.ParameterClient`."""

    routes: Routes | None
    _tables: dict[str, Any]  # name -> the IDL's Table, as created or read
    _lane: Lane | None  # (shared memory with the node connected to: see .shared)
    if TYPE_CHECKING:

        async def invoke(self, m: Any, /, *, timeout: Any = ..., **args: Any) -> Any: ...

    # -- tables -------------------------------------------------------------------

    async def create_table(
        self,
        name: str,
        dim: int,
        *,
        dtype: Any = "float32",
        init: str = "zeros",
        scale: float | None = None,
        seed: int = 0,
        rule: Any = None,
        buckets: int | None = None,
        row_ttl: float | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> Any:
        """Make an embedding table on every node; answer it (the IDL's ``Table``).

        Args:
            name: the table's name (any str without NUL).
            dim: the values per row.
            dtype: the values' type: float32, float16, float64 or bfloat16.
            init: how a row is made on its first touch: ``"zeros"``,
                ``"uniform"`` (U(-scale, scale)) or ``"normal"`` (N(0, scale^2));
                deterministic by (table, seed, id), on every node and restart.
            scale: uniform's bound or normal's standard deviation.
            seed: mixed into every row's initial values.
            rule: how row gradients fold: ``adagrad(lr)`` (the default, lr
                0.01), ``sgd(lr)`` or ``adam(lr)`` (lazy: only the rows a push
                touches step, each by its own step count).
            buckets: how many buckets the rows are placed in (default 64),
                fixed at creation: the most nodes a table spreads over.
            row_ttl: rows untouched this many seconds are dropped (None: never).

        The same table again is no error; another one under the same name is.

        Raises:
            ValueError: an argument out of its range.
            RequestError: the node refused it (the message says why).
        """
        if not isinstance(name, str) or not name or "\x00" in name:
            raise ValueError(f"a table's name is a non-empty str without NUL, not {name!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim is an int >= 1, not {dim!r}")
        if init not in INITS:
            raise ValueError(f"init is one of {', '.join(INITS)}, not {init!r}")
        table = thrift.Table(
            name=name,
            dim=dim,
            dtype=_dtype_string(dtype),
            init=init,
            scale=scale,
            seed=seed,
            rule=rule,
            buckets=buckets,
            row_ttl_seconds=row_ttl,
        )
        made = await self.invoke(METHODS.create_table, timeout=timeout, table=table)
        self._tables[name] = made
        return made

    async def tables(self, *, timeout: float | EllipsisType | None = ...) -> list[Any]:
        """Every embedding table the node knows (the IDL's ``Table``, defaults filled in)."""
        answer = await self.invoke(METHODS.tables, timeout=timeout)
        self._tables.update((t.name, t) for t in answer)
        return list(answer)

    async def _table(self, name: str, timeout: Any) -> Any:
        table = self._tables.get(name)
        if table is None:
            await self.tables(timeout=timeout)
            table = self._tables.get(name)
            if table is None:
                raise RequestError(ErrorCode.UNKNOWN_PARAMETER, f"no table {name!r}")
        return table

    # -- rows -----------------------------------------------------------------------

    async def pull_rows(
        self,
        table: str,
        ids: Any,
        *,
        encoding: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> np.ndarray:
        """The rows of ``ids`` (int64, repeats allowed), ``(len(ids), dim)``, in their order.

        Rows never touched are their initial values. ``encoding`` (``"fp16"``,
        ``"bf16"``, ``"int8"``: a float32 scale per row) makes the answer
        smaller on the wire; the array answered has the table's dtype.

        Raises:
            ValueError: ids not a 1-D int64 array, an unknown encoding.
            RequestError: no such table (UNKNOWN_PARAMETER), or the node refused.
        """
        ids = check_ids(ids)
        if encoding is not None and encoding not in ROW_ENCODINGS:
            raise ValueError(f"encoding is one of {', '.join(ROW_ENCODINGS)} or None")
        spec = await self._table(table, timeout)
        if not len(ids):  # (nothing to ask any node for)
            return np.empty((0, spec.dim), parse_dtype(spec.dtype))
        m = METHODS.pull_rows

        itemsize = parse_dtype(spec.dtype).itemsize

        async def call(pool: Any, positions: np.ndarray | None, epoch: int | None) -> np.ndarray:
            sub_ids = ids if positions is None else ids[positions]
            request = thrift.RowsRequest(
                table=table, ids=encode_ids(sub_ids), encoding=encoding, epoch=epoch
            )
            # (to the node connected to, epoch None: its answer may be in shared memory)
            lane = self._lane if epoch is None and encoding is None else None
            region = None if lane is None else lane.for_rows(len(sub_ids) * spec.dim * itemsize)
            if region is not None:
                request.shared = region.shared
            try:
                answer = await pool(m, "request", request)
            except BaseException:
                if region is not None and lane is not None:
                    lane.keep(region)  # (the node may write it yet)
                raise
            if lane is not None:
                lane.rows_answered(region, answer)
            return decode_rows(answer, count=len(sub_ids), dim=spec.dim)

        parts = await self._by_bucket(spec, ids, call, write=False, timeout=timeout)
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        out = np.empty((len(ids), spec.dim), parts[0][1].dtype)
        for positions, rows in parts:
            assert positions is not None  # (only a part that is the whole call has none)
            put_rows(out, positions, rows)
        return out

    async def push_row_gradients(
        self,
        table: str,
        ids: Any,
        grads: Any,
        *,
        encoding: str | None = None,
        request_id: str | None = None,
        acks: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> Any:
        """Fold ``grads[i]`` into row ``ids[i]`` by the table's rule.

        The gradients of a repeated id are summed, then each row folds once,
        at its bucket's primary; the push carries a request id (a new one by
        default): sent again under it, it is folded once. Answers the IDL's
        ``RowsResult``: distinct ``rows`` folded, ``created`` by this push.

        Raises:
            ValueError: ids not a 1-D int64 array, grads not ``(len(ids), dim)``
                floats, an unknown encoding.
            RequestError: no such table, non-finite gradients, or the node
                refused; nothing of the part it refused was folded.
        """
        return await self._push_rows(table, ids, grads, encoding, request_id, acks, timeout)

    async def assign_rows(
        self,
        table: str,
        ids: Any,
        rows: Any,
        *,
        encoding: str | None = None,
        request_id: str | None = None,
        acks: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> Any:
        """Set row ``ids[i]`` to ``rows[i]`` (say, embeddings trained elsewhere).

        Each row is set at its bucket's primary, at a new version, its rule's
        state made anew (as a new row's: Adagrad's sums, Adam's moments); the
        ids may not repeat. Sent again under its request id, it is applied
        once. Answers the IDL's ``RowsResult`` (``rows`` set, ``created``).

        Raises:
            ValueError: as :meth:`push_row_gradients`.
            RequestError: no such table, repeated ids, values not finite (unless
                the table's rule allows them), or the node refused.
        """
        return await self._push_rows(table, ids, rows, encoding, request_id, acks, timeout, True)

    async def _push_rows(
        self,
        table: str,
        ids: Any,
        grads: Any,
        encoding: str | None,
        request_id: str | None,
        acks: str | None,
        timeout: float | EllipsisType | None,
        assign: bool = False,
    ) -> Any:
        what = "rows" if assign else "grads"
        ids = check_ids(ids)
        grads = np.asarray(grads)
        spec = await self._table(table, timeout)
        if grads.shape != (len(ids), spec.dim):
            raise ValueError(
                f"{what} are (len(ids), dim) = ({len(ids)}, {spec.dim}), not {grads.shape}"
            )
        if not (grads.dtype.kind == "f" or is_bfloat16(grads.dtype)):
            raise ValueError(f"{what} are floats, not {grads.dtype}")
        if encoding is not None and encoding not in ROW_ENCODINGS:
            raise ValueError(f"encoding is one of {', '.join(ROW_ENCODINGS)} or None")
        if acks is not None and acks not in ("1", "all"):
            raise ValueError(f'acks is "1" or "all", not {acks!r}')
        if not len(ids):
            return thrift.RowsResult(rows=0, created=0)
        request_id = request_id or uuid.uuid4().hex
        m = METHODS.push_row_gradients

        async def call(pool: Any, positions: np.ndarray | None, epoch: int | None) -> Any:
            sub_ids = ids if positions is None else ids[positions]
            sub = grads if positions is None else take_rows(grads, positions)
            # (to the node connected to, epoch None: in shared memory, where it maps it)
            lane = self._lane if epoch is None and encoding is None else None
            shared = None if lane is None else lane.for_row_push(sub)
            push = thrift.RowPush(
                table=table,
                ids=encode_ids(sub_ids),
                grads=encode_rows(sub, encoding) if shared is None else shared[0],
                request_id=request_id,
                epoch=epoch,
                acks=acks,
                assign=assign or None,
            )
            try:
                result = await pool(m, "push", push)
            except BaseException:
                if shared is not None and lane is not None:
                    lane.keep(shared[1])  # (the node may read it yet)
                raise
            if shared is not None and lane is not None:
                lane.give(shared[1])
            return result

        parts = await self._by_bucket(spec, ids, call, write=True, timeout=timeout)
        rows = sum(r.rows for _, r in parts)
        created = sum(r.created for _, r in parts)
        return thrift.RowsResult(rows=rows, created=created)

    async def _by_bucket(
        self,
        spec: Any,
        ids: np.ndarray,
        call: Callable[..., Awaitable[Any]],
        *,
        write: bool,
        timeout: Any,
        moves: int = 0,
        positions: np.ndarray | None = None,
    ) -> list[tuple[np.ndarray | None, Any]]:
        """``call(send, positions, epoch)`` for each part of ``ids`` (those at
        ``positions``; None: all) cut by node, ``send(m, arg, value)`` sending to
        it; answers (positions, result) per part."""
        routes = self.routes
        client = self

        async def unrouted() -> Any:
            async def via(m: Any, arg: str, value: Any) -> Any:
                pool = cast(ConnectionPool, client)
                return await ConnectionPool.invoke(pool, m, timeout=timeout, **{arg: value})

            return await call(via, positions, None)

        if routes is None or not routes.wanted() or moves >= MAX_MOVES:
            return [(positions, await unrouted())]
        topology = routes.topology
        assert topology is not None
        here = ids if positions is None else ids[positions]
        buckets = bucket_of(here, spec.buckets)
        mode = "primary" if write else routes.reads()
        targets = {
            int(b): routes.target(bucket_key(spec.name, int(b)), mode) for b in np.unique(buckets)
        }
        by_target: dict[str | None, list[int]] = {}
        for b, t in targets.items():
            by_target.setdefault(t, []).append(b)
        if None in by_target:  # (no live replica known: the client's node passes it on)
            return [(positions, await unrouted())]
        cuts: dict[str, np.ndarray | None]
        if len(by_target) == 1 and positions is None:  # (all at one node: sent as they are)
            cuts = {cast(str, t): None for t in by_target}
        else:
            base = np.arange(len(ids)) if positions is None else positions
            cuts = {
                cast(str, t): base[np.isin(buckets, np.asarray(bs, np.int64))]
                for t, bs in by_target.items()
            }

        async def part(
            target: str, where: np.ndarray | None
        ) -> list[tuple[np.ndarray | None, Any]]:
            async def at(m: Any, arg: str, value: Any) -> Any:
                done, result = await routes.call_at(target, m, timeout, arg, value)
                if not done:
                    raise _Again
                return result

            try:
                answer = await call(at, where, topology.epoch)
            except _Again:
                return await self._by_bucket(
                    spec, ids, call, write=write, timeout=timeout, moves=moves + 1, positions=where
                )
            return [(where, answer)]

        answers = await gather_all(part(t, w) for t, w in cuts.items())
        return [p for answer in answers for p in answer]


class _Again(Exception):
    """A part to cut again (MOVED, or its node unreachable)."""
