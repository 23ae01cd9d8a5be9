"""The node's embedding tables: each table's spec, and the buckets of its rows held here.

A table (the IDL's ``Table``) is checked and completed once, by
:func:`table_spec`, into a :class:`TableSpec`. Its rows live in buckets
(``placement.bucket_of`` of the id); a node keeps a
:class:`~aioparamsync.values.rows.RowBlock` for each bucket it holds rows of.
Every row carries a version (the folds it has had), so the rows a primary
sends its replicas, or a node hands on, are merged by version: a row is
replaced only by a newer one, and replay or a message sent twice changes
nothing.

What a push folded is remembered by its request id (and bucket), so a push
sent again, whole or in part, folds each bucket once (:class:`RowLedger`).

Mutations are plain numpy calls with no ``await`` inside: on the event loop,
each is atomic. asyncio-free, like the parameter table.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._ext import compiled
from ..errors import ErrorCode, RequestError
from ..values import rules
from ..values.arrays import parse_dtype, wire_dtype
from ..values.compression import _from_le, _le_bytes
from ..values.parallel import in_parts
from ..values.rowcopy import SUM_CHUNK, gather, sum_repeats, take_rows
from ..values.rowindex import bucket_of, has_duplicates
from ..values.rows import BlockSpec, Init, RowBlock, RowRule
from ..values.rowspec import check_time
from ..values.rowwire import decode_ids, encode_ids
from ..wire import thrift

__all__ = [
    "DEFAULT_BUCKETS",
    "Folded",
    "RowLedger",
    "RowTable",
    "RowTables",
    "TableSpec",
    "counts_of",
    "table_spec",
]

#: buckets of a table when its creator says nothing
DEFAULT_BUCKETS = 64
MAX_BUCKETS = 1 << 16
MAX_DIM = 1 << 16
#: the rule of a table whose creator says nothing: adagrad, the field's default for embeddings
DEFAULT_RULE = "adagrad"

# The compiled walk and fold of every bucket at once (see RowTable._fold_held).
_crows, _crowfold = compiled("values._crows"), compiled("values._crowfold")

# Request ids a ledger remembers (the oldest are forgotten first).
LEDGER_SIZE = 100_000


def _bad(message: str) -> RequestError:
    return RequestError(ErrorCode.BAD_REQUEST, message)


@dataclass(frozen=True, slots=True)
class TableSpec:
    """A table checked and completed: what every node makes its rows by."""

    name: str
    dim: int
    dtype: np.dtype
    rows: BlockSpec  # what a bucket's block is made by
    buckets: int
    row_ttl: float  # seconds; 0: never
    wire: Any  # the IDL's Table, every default filled in

    @property
    def row_bytes(self) -> int:
        """What one row takes in a message: its values, its rule's state, its id and version."""
        return self.dim * (self.dtype.itemsize + 8 * len(self.rows.rule.state_names)) + 16

    def same(self, other: TableSpec) -> bool:
        """Whether ``other`` describes the same table (creating it again is no change)."""
        return self.rows == other.rows and (self.buckets, self.row_ttl) == (
            other.buckets,
            other.row_ttl,
        )


# The storage dtypes of values.rows, by wire dtype string.
_ROW_DTYPES = {"<f4": "float32", "<f8": "float64", "<f2": "float16", "bfloat16": "bfloat16"}


def table_spec(t: Any) -> TableSpec:
    """Check the IDL's ``Table`` ``t`` and fill in its defaults.

    Raises:
        RequestError: (BAD_REQUEST) a field out of its range; the message names it.
    """
    if t is None:
        raise _bad("the table is missing")
    name = t.name
    if not isinstance(name, str) or not name or "\x00" in name:
        raise _bad(f"a table's name is a non-empty string without NUL, not {name!r}")
    if not isinstance(t.dim, int) or not 1 <= t.dim <= MAX_DIM:
        raise _bad(f"table {name!r}: dim is in [1, {MAX_DIM}], not {t.dim!r}")
    try:
        dtype = parse_dtype(t.dtype if t.dtype is not None else "<f4")
    except RequestError as exc:
        raise _bad(f"table {name!r}: {exc.message}") from None
    if wire_dtype(dtype) not in _ROW_DTYPES:
        raise _bad(
            f"table {name!r}: a row's values are float16, 32, 64 or bfloat16, not {t.dtype!r}"
        )
    buckets = t.buckets if t.buckets is not None else DEFAULT_BUCKETS
    if not isinstance(buckets, int) or not 1 <= buckets <= MAX_BUCKETS:
        raise _bad(f"table {name!r}: buckets is in [1, {MAX_BUCKETS}], not {buckets!r}")
    ttl = t.row_ttl_seconds or 0.0
    if not (isinstance(ttl, (int, float)) and math.isfinite(ttl) and ttl >= 0):
        raise _bad(f"table {name!r}: row_ttl_seconds is a number >= 0, not {ttl!r}")
    kind = t.init or "zeros"
    scale = t.scale if t.scale is not None else (0.0 if kind == "zeros" else 0.01)
    rule = t.rule if t.rule is not None else thrift.Rule(kind=DEFAULT_RULE)
    try:
        init = Init(kind, scale, t.seed if t.seed is not None else 0)
        row_rule = RowRule.of(rule)
        rows = BlockSpec(name, t.dim, _ROW_DTYPES[wire_dtype(dtype)], init, row_rule)
    except RequestError as exc:
        raise _bad(f"table {name!r}: {exc.message}") from None
    wire = thrift.Table(
        name=name,
        dim=t.dim,
        dtype=wire_dtype(dtype),
        init=init.kind,
        scale=float(init.scale),
        seed=int(init.seed),
        rule=thrift.Rule(
            kind=row_rule.kind,
            lr=row_rule.lr,
            momentum=0.0,
            weight_decay=0.0,
            beta1=row_rule.beta1,
            beta2=row_rule.beta2,
            eps=row_rule.eps,
            initial_accumulator=row_rule.initial_accumulator,
            allow_nonfinite=row_rule.allow_nonfinite,
        ),
        buckets=buckets,
        row_ttl_seconds=float(ttl),
    )
    return TableSpec(name, t.dim, dtype, rows, buckets, float(ttl), wire)


def _grouped(buckets: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(bucket, positions)`` of ``buckets`` (each id's), positions ascending, each
    bucket once."""
    # (a stable sort of 16-bit keys is numpy's radix sort: a few times faster)
    order = np.argsort(buckets.astype(np.uint16), kind="stable")
    cuts = np.flatnonzero(np.diff(buckets[order])) + 1
    for positions in np.split(order, cuts):
        if len(positions):
            yield int(buckets[positions[0]]), positions


class Folded(Mapping[int, np.ndarray]):
    """The distinct ids a compiled fold folded (``ids``), by bucket (``owner``, each
    id's), grouped only once asked: a node with no replica to send them to and no log
    to write asks only their :meth:`counts`."""

    def __init__(self, ids: np.ndarray, owner: np.ndarray) -> None:
        self._ids, self._owner = ids, owner
        self._counts: dict[int, int] | None = None
        self._groups: dict[int, np.ndarray] | None = None

    def counts(self) -> dict[int, int]:
        """How many ids of each bucket were folded."""
        if self._counts is None:
            counts = np.bincount(self._owner)
            buckets = np.flatnonzero(counts)
            self._counts = dict(zip(buckets.tolist(), counts[buckets].tolist(), strict=True))
        return self._counts

    def _grouped(self) -> dict[int, np.ndarray]:
        if self._groups is None:
            self._groups = {b: self._ids[p] for b, p in _grouped(self._owner)}
        return self._groups

    def __getitem__(self, bucket: int) -> np.ndarray:
        return self._grouped()[bucket]

    def __iter__(self) -> Iterator[int]:
        return iter(self._grouped())

    def __len__(self) -> int:
        return len(self.counts())


def counts_of(changed: Mapping[int, np.ndarray]) -> dict[int, int]:
    """How many ids of each bucket a fold or an assign changed (see :class:`Folded`)."""
    if isinstance(changed, Folded):
        return changed.counts()
    return {bucket: len(ids) for bucket, ids in changed.items()}


class RowTable:
    """One table on one node: its spec and a block for each bucket it holds rows of."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.blocks: dict[int, RowBlock] = {}

    def __repr__(self) -> str:
        return f"<RowTable {self.spec.name!r} dim={self.spec.dim}: {self.rows} rows here>"

    @property
    def rows(self) -> int:
        return sum(len(b) for b in self.blocks.values())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks.values())

    def block(self, bucket: int) -> RowBlock:
        """The block of ``bucket``, made empty when there is none."""
        block = self.blocks.get(bucket)
        if block is None:
            block = self.blocks[bucket] = RowBlock(self.spec.rows)
        return block

    def buckets_of(self, ids: np.ndarray) -> np.ndarray:
        return bucket_of(ids, self.spec.buckets)

    def buckets_in(self, ids: np.ndarray) -> list[int]:
        """The buckets ``ids`` fall in, each once, ascending (counted: numpy's unique sorts)."""
        counts = np.bincount(self.buckets_of(ids), minlength=self.spec.buckets)
        return np.flatnonzero(counts).tolist()

    def by_bucket(self, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
        """``(bucket, positions)`` of ``ids``, positions ascending, each bucket once."""
        return _grouped(self.buckets_of(ids))

    def pull(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` in their order: those held here, else their initial values
        (a read makes no row: only a push does, so reads cost no memory)."""
        out = np.empty((len(ids), self.spec.dim), self.spec.dtype)
        self.read_into(ids, out)
        return out

    def read_into(self, ids: np.ndarray, out: np.ndarray, where: np.ndarray | None = None) -> None:
        """``out[where[i]] =`` the row of ``ids[i]`` (``where`` None: ``out[i]``), as
        :meth:`pull` reads it, with no array of its own in between."""
        s = self.spec
        if where is None and len(self.blocks) <= len(ids):
            # (in one pass over every bucket, where it is compiled: see rowcopy.gather)
            layouts: list[Any] = [None] * s.buckets
            for bucket, held in self.blocks.items():
                layouts[bucket] = held.layout()
            missing = gather(layouts, ids, out)
            if missing is not None:
                if len(missing):
                    out[missing] = s.rows.init.values(s.name, ids[missing], s.dim, s.dtype)
                return
        for bucket, positions in self.by_bucket(ids):
            block = self.blocks.get(bucket)
            wanted = ids[positions]
            at = positions if where is None else where[positions]
            if block is not None:
                block.read_into(wanted, out, at)
            else:
                out[at] = s.rows.init.values(s.name, wanted, s.dim, s.dtype)

    def check(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Refuse (BAD_REQUEST, SHAPE_MISMATCH) what a fold could not take, before any fold."""
        if grads.shape != (len(ids), self.spec.dim):
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"table {self.spec.name!r}: gradients of shape {grads.shape} for {len(ids)} "
                f"ids of width {self.spec.dim}",
            )
        rules.check_finite(f"table {self.spec.name!r}: gradients", grads, self.spec.wire.rule)

    def fold(
        self, ids: np.ndarray, grads: np.ndarray, now: float
    ) -> tuple[Mapping[int, np.ndarray], int]:
        """Fold ``grads`` into the rows of ``ids`` (checked: see :meth:`check`).

        Answers the distinct ids folded, by bucket, and how many rows were made.
        """
        # (each bucket's gradients folded where they lie in the push: see RowBlock.fold;
        # made contiguous here, if they are not, not once a bucket)
        grads = np.require(grads, None, ("C",))
        before, now = self.rows, check_time("now", now)
        held = self._fold_held(ids, grads, now)
        if held is None:
            return self._by_block(ids, lambda block, i, at: block.fold(i, grads, now, at))
        # (the ids folded by bucket, in the order each block's fold answers them)
        folded, owner = held
        changed = Folded(folded, owner)
        for bucket in changed.counts():
            self.blocks[bucket].make(folded[:0], now)  # (its clock: see RowBlock.make)
        return changed, self.rows - before

    def _fold_held(
        self, ids: np.ndarray, grads: np.ndarray, now: float
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`fold`'s folds in one compiled pass over every bucket (``_crows.locate``
        and ``_crowfold.fold_held``: the same bits as each block's fold) where it can
        be: the rule is ``sgd`` or ``adagrad``, the gradients of the rows' dtype. The
        gradients of a repeated id are summed first, and the missing rows made, as each
        block's fold does. Answers the distinct ids folded and the bucket of each; None,
        having changed nothing, where it cannot be done so (the caller folds block by
        block)."""
        rule, dtype = self.spec.rows.rule, self.spec.rows.dtype
        if _crows is None or _crowfold is None or rule.kind not in ("sgd", "adagrad"):
            return None
        if grads.dtype != dtype:
            return None
        if not len(ids) or len(self.blocks) > len(ids):
            return None
        ids = np.ascontiguousarray(ids, np.int64)
        if has_duplicates(ids):
            # (summed first, each row's gradients in order from 0.0, as each block sums
            # its part: one chunk, unless a part is longer; then each block's way)
            step = max(1, SUM_CHUNK // self.spec.dim)
            if np.bincount(self.buckets_of(ids)).max() > step:
                return None
            ids, grads = sum_repeats(ids, grads, self.spec.rows.work_dtype, step=len(ids))
            if grads.dtype != dtype:
                return None
        n = len(ids)
        slots, owner = np.empty(n, np.int64), np.empty(n, np.int64)
        layouts = self._locate(ids, slots, owner)
        if layouts is None:
            return None
        lost = np.flatnonzero(slots < 0)
        if len(lost):  # (made first, as each block's fold makes them; then walked again)
            for bucket, positions in _grouped(owner[lost]):
                self.block(bucket).make(ids[lost[positions]], now)
            layouts = self._locate(ids, slots, owner)
            assert layouts is not None and (slots >= 0).all()
        arrays = [[None if a is None else a[k] for a in layouts] for k in range(2, 6)]
        scalars = (rule.lr, rule.eps, rule.kind == "adagrad", now)

        def fold(p: slice) -> None:  # (rows of one id each: parts on several cores at once)
            _crowfold.fold_held(*arrays, slots[p], owner[p], grads[p], *scalars)

        in_parts(fold, n, grads.itemsize * self.spec.dim)
        return ids, owner

    def _locate(self, ids: np.ndarray, slots: np.ndarray, owner: np.ndarray) -> list[Any] | None:
        """Each id's bucket and slot (-1: no row) into ``owner`` and ``slots``, by one walk
        of every block's index; answers the blocks' :meth:`RowBlock.fold_layout` (None
        for a bucket with no block), or None where the compiled fold does not take them."""
        assert _crows is not None  # (_fold_held asked)
        layouts: list[Any] = [None] * self.spec.buckets
        for bucket, block in self.blocks.items():
            layouts[bucket] = block.fold_layout()
            if layouts[bucket] is None:
                return None
        held = np.array([0 if a is None else min(map(len, a[1:])) for a in layouts], np.int64)
        index = [None if a is None else a[0] for a in layouts]
        slot_ids = [None if a is None else a[1] for a in layouts]
        locate = _crows.locate

        def walk(p: slice) -> None:  # (each id found alone: parts on several cores at once)
            locate(index, slot_ids, held, ids[p], slots[p], owner[p])

        in_parts(walk, len(ids), self.spec.dtype.itemsize * self.spec.dim)
        return layouts

    def assign(
        self, ids: np.ndarray, rows: np.ndarray, now: float
    ) -> tuple[dict[int, np.ndarray], int]:
        """Set the rows of ``ids`` to ``rows`` (see :meth:`RowBlock.assign`); answers as
        :meth:`fold` does."""
        return self._by_block(ids, lambda block, i, at: block.assign(i, take_rows(rows, at), now))

    def _by_block(self, ids: np.ndarray, change: Any) -> tuple[dict[int, np.ndarray], int]:
        """``change(block, ids, positions)`` of each bucket's part (``ids`` at
        ``positions``); the ids it changed by bucket, and how many rows were made."""
        changed: dict[int, np.ndarray] = {}
        created = 0
        for bucket, positions in self.by_bucket(ids):
            block = self.block(bucket)
            before = len(block)
            changed[bucket] = change(block, ids[positions], positions)
            created += len(block) - before
        return changed, created

    def delta(
        self,
        bucket: int,
        ids: np.ndarray | None,
        me: str,
        span: slice | None = None,
        touched_since: float | None = None,
    ) -> Any:
        """The IDL's ``RowDelta`` of the rows ``ids`` of ``bucket`` (None: every row, or
        those of ``span``, in the block's order; of those touched since ``touched_since``)."""
        block = self.blocks.get(bucket)
        if block is None:
            block = RowBlock(self.spec.rows)  # (not kept: an empty bucket stays absent)
        got = block.rows_of(ids, span, touched_since)
        return thrift.RowDelta(
            table=self.spec.wire,
            bucket=bucket,
            ids=encode_ids(got.ids),
            versions=encode_ids(got.versions),
            rows=_le_bytes(got.rows),
            state=[_le_bytes(got.state[n]) for n in self.spec.rows.rule.state_names],
            from_peer=me,
        )

    def merge(self, delta: Any, now: float) -> int:
        """Keep the rows of ``delta`` newer than those held; answer how many were kept.

        Raises:
            RequestError: (BAD_REQUEST) a delta whose arrays do not agree.
        """
        bucket = delta.bucket
        if not isinstance(bucket, int) or not 0 <= bucket < self.spec.buckets:
            raise _bad(f"table {self.spec.name!r} has no bucket {bucket!r}")
        ids = decode_ids(delta.ids)
        versions = decode_ids(delta.versions, "versions")
        if len(versions) != len(ids):
            raise _bad(f"{len(ids)} ids with {len(versions)} versions")
        if len(ids) and not (self.buckets_of(ids) == bucket).all():
            raise _bad(f"rows of other buckets sent as bucket {bucket}")
        rows, state = _arrays(self.spec, delta, len(ids))
        return self.block(bucket).merge(ids, rows, state, versions=versions, now=now)

    def evict(self, now: float) -> int:
        """Drop rows untouched for the table's ``row_ttl``; answer how many."""
        ttl = self.spec.row_ttl
        if not ttl:
            return 0
        return sum(len(b.evict(now - ttl)) for b in self.blocks.values())


def _arrays(spec: TableSpec, delta: Any, n: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The rows and rule state of a ``RowDelta`` of ``n`` rows (views), checked for size."""
    dim, work = spec.dim, spec.rows.work_dtype
    names = spec.rows.rule.state_names
    state_in = list(delta.state or [])
    got = len(delta.rows) if delta.rows is not None else 0
    if got != n * dim * spec.dtype.itemsize:
        raise _bad(f"a delta of {n} rows of width {dim} has {got} bytes of rows")
    if len(state_in) != len(names):
        raise _bad(f"rule {spec.rows.rule.kind} keeps {len(names)} states, not {len(state_in)}")
    rows = _from_le(delta.rows, spec.dtype).reshape(n, dim)
    state = {}
    for name, data in zip(names, state_in, strict=True):
        dt, shape = (np.dtype(np.int64), (n,)) if name == "step" else (work, (n, dim))
        if len(data) != math.prod(shape) * dt.itemsize:
            raise _bad(f"state {name!r} of {n} rows has {len(data)} bytes")
        state[name] = _from_le(data, dt).reshape(shape)
    return rows, state


class RowLedger:
    """What pushes folded, by request id and bucket: a push sent again folds each bucket once."""

    def __init__(self, size: int = LEDGER_SIZE) -> None:
        self.size = size
        self._folded: collections.OrderedDict[tuple[str, str], dict[int, int]] = (
            collections.OrderedDict()
        )
        self.repeated = 0

    def folded(self, request_id: str | None, table: str) -> dict[int, int]:
        """bucket -> rows folded of the buckets already folded under ``request_id``."""
        if request_id is None:
            return {}
        return self._folded.get((request_id, table), {})

    def remember(self, request_id: str | None, table: str, buckets: dict[int, int]) -> None:
        if request_id is None or not buckets:
            return
        key = (request_id, table)
        self._folded.setdefault(key, {}).update(buckets)
        self._folded.move_to_end(key)
        while len(self._folded) > self.size:
            self._folded.popitem(last=False)


class RowTables:
    """Every table a node knows, by name."""

    def __init__(self) -> None:
        self.tables: dict[str, RowTable] = {}
        self.ledger = RowLedger()

    def __len__(self) -> int:
        return len(self.tables)

    def __contains__(self, name: object) -> bool:
        return name in self.tables

    def get(self, name: str) -> RowTable | None:
        return self.tables.get(name)

    def create(self, spec: TableSpec) -> tuple[RowTable, bool]:
        """The table of ``spec``, and whether it is new.

        Raises:
            RequestError: (BAD_REQUEST) another table of that name exists.
        """
        held = self.tables.get(spec.name)
        if held is not None:
            if not held.spec.same(spec):
                raise _bad(
                    f"a table {spec.name!r} exists, and differs: {_describe(held.spec.wire)}; "
                    f"asked: {_describe(spec.wire)}"
                )
            return held, False
        table = self.tables[spec.name] = RowTable(spec)
        return table, True

    def statistics(self) -> dict[str, int]:
        return {
            "tables": len(self.tables),
            "rows": sum(t.rows for t in self.tables.values()),
            "row_bytes": sum(t.nbytes for t in self.tables.values()),
        }


def _describe(t: Any) -> str:
    r = t.rule
    return (
        f"dim {t.dim}, {t.dtype}, init {t.init}({t.scale}), seed {t.seed}, {t.buckets} buckets, "
        f"rule {r.kind}(lr={r.lr})"
    )
