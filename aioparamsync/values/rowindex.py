"""An int64 id -> dense int64 slot map for embedding rows, vectorised with numpy.

Theory of operation: open addressing with linear probing over a power-of-two
number of buckets. The table is one int64 array, ``table``: a bucket holds a
slot (``>= 0``), ``EMPTY`` (-1) or ``TOMBSTONE`` (-2); the id in a slot is
``slot_ids[slot]``, the dense slot -> id array the caller needs anyway. So no
id is a sentinel (INT64_MIN and INT64_MAX are ids like any other), and a
bucket costs 8 bytes. An id's home bucket is splitmix64's finaliser of its
bits, masked.

No Python object per row and no Python loop per id: every operation loops
over probe *rounds*; a round looks at the current bucket of every id still
unresolved, at once, and moves the rest one bucket on. When new ids are
placed, several may want one free bucket in the same round: each writes its
own number into that bucket and reads it back, so exactly one wins
(whichever write numpy kept) without a sort; the others probe on.

Slots are dense: the ``n`` live ids hold slots ``0 .. n-1``, and new ids get
the next slots in order of first appearance, so a caller keeps its rows in a
plain ``(n, dim)`` block. :meth:`RowIndex.remove` keeps them dense by
compaction (no free list): the ids in the highest slots move into the freed
ones, and the moves are answered so the caller moves its rows the same way.
Removal leaves tombstones (lookups probe past them, inserts reuse them);
they count towards the load, and the table is rebuilt when full + tombstones
would pass ``MAX_LOAD`` (doubling, if the live ids need it) or when
tombstones outnumber live ids (which may shrink it).
"""

from __future__ import annotations

import numpy as np

from .._ext import compiled
from ..placement import bucket_of as placement_bucket_of
from ..placement import mix64

__all__ = ["EMPTY", "MAX_LOAD", "TOMBSTONE", "RowIndex", "bucket_of", "has_duplicates"]

# Most (full + tombstone) buckets per bucket: linear probing degrades past 1/2.
MAX_LOAD = 0.5
# A rebuilt table is at most this full, so a rebuild's O(n) pays for n/2 inserts.
REBUILT_LOAD = 1 / 3
# Fewest buckets a table has (a power of two).
MIN_BUCKETS = 16
# The slot -> id array grows by at least this many slots, or by a quarter.
GROW_SLOTS = 64

# What a bucket of the table holds when it holds no slot.
EMPTY, TOMBSTONE = -1, -2
_NONE = np.empty(0, np.int64)
# The compiled lookup (see _crows.pyx), unless the pure path is asked for or it was not built.
_crows = compiled("values._crows")


def _buckets_for(n: int) -> int:
    # The fewest buckets (a power of two) that hold n ids at REBUILT_LOAD.
    need = max(MIN_BUCKETS, int(np.ceil(n / REBUILT_LOAD)))
    return 1 << (need - 1).bit_length()


class RowIndex:
    """A map int64 id -> int64 slot, the slots of ``n`` ids being ``0 .. n-1``.

    Every method takes and answers whole numpy arrays. See the module's
    docstring for the layout and the slot compaction on :meth:`remove`.
    """

    def __init__(self, capacity: int = 0) -> None:
        """An empty index with room for ``capacity`` ids before its first rebuild."""
        self._alloc(_buckets_for(capacity))
        self._slot_ids = np.empty(max(capacity, 1), np.int64)  # never empty: _find reads [0]
        self._len = 0

    def _alloc(self, buckets: int) -> None:
        self._table = np.full(buckets, EMPTY, np.int64)
        self._mask = np.uint64(buckets - 1)
        self._tombs = 0

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"<RowIndex {self._len} ids, {self.buckets} buckets, {self._tombs} tombstones>"

    @property
    def buckets(self) -> int:
        """The number of buckets (a power of two)."""
        return len(self._table)

    @property
    def nbytes(self) -> int:
        """Bytes held: the buckets and the slot -> id array, its spare capacity included."""
        return int(self._table.nbytes + self._slot_ids.nbytes)

    def ids(self, slots: np.ndarray | None = None) -> np.ndarray:
        """The id in each of ``slots`` (default: of every slot, in slot order); a new array."""
        if slots is None:
            return self._slot_ids[: self._len].copy()
        return self._slot_ids[: self._len][slots]

    def slots(self) -> np.ndarray:
        """Every slot in use, in the order :meth:`ids` answers their ids: ``0 .. len-1``."""
        return np.arange(self._len, dtype=np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id (int64, ``ids``' shape), -1 where an id is absent."""
        ids = _as_ids(ids)
        if _crows is not None:  # (the same walk, an id at a time, in C: see _crows.pyx)
            want = np.ascontiguousarray(ids).reshape(-1)
            out = np.empty(want.shape, np.int64)
            _crows.probe(self._table, self._slot_ids, want, self._home(want), out)
            return out.reshape(ids.shape)
        return self.pure_lookup(ids)

    def pure_lookup(self, ids: np.ndarray) -> np.ndarray:
        """:meth:`lookup` in numpy (what runs without the compiled path)."""
        ids = _as_ids(ids)
        pos = self._find(ids)
        return np.where(pos >= 0, self._table[pos], -1)

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Add the absent ids; answer the slot of every id given (ids may repeat).

        New ids get the next free slots (``len .. len+k-1``) in the order
        of their first appearance in ``ids``.
        """
        ids = _as_ids(ids)
        slots = self.lookup(ids)
        missing = np.flatnonzero(slots < 0)
        if missing.size:
            new = ids.reshape(-1)[missing]
            inverse, distinct = _first_appearance(new)
            slots.reshape(-1)[missing] = self._len + inverse
            self._add(distinct)
        return slots

    def remove(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove the ids present (absent ones are ignored), keeping the slots dense.

        Returns:
            ``(moved_from, moved_to)``: the ids that were in slots
            ``moved_from`` (all ``>= len`` now) are in slots ``moved_to``
            (freed ones) now; the caller moves its rows likewise, e.g.
            ``rows[moved_to] = rows[moved_from]``.
        """
        pos = self._find(np.unique(_as_ids(ids)))
        pos = pos[pos >= 0]
        if not pos.size:
            return _NONE, _NONE
        freed = self._table[pos]
        self._table[pos] = TOMBSTONE
        self._tombs += len(pos)
        old_len, new_len = self._len, self._len - len(pos)
        holes = np.sort(freed[freed < new_len])
        tail = np.ones(old_len - new_len, bool)
        tail[freed[freed >= new_len] - new_len] = False
        movers = new_len + np.flatnonzero(tail)
        mover_ids = self._slot_ids[movers]
        self._table[self._find(mover_ids)] = holes
        self._slot_ids[holes] = mover_ids
        self._len = new_len
        if self._tombs > self._len:  # probes wade through tombstones: rebuild, maybe smaller
            self._rebuild(self._len)
        return movers, holes

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Its buckets and its slots' ids, as the compiled walks read them (see _crows)."""
        return self._table, self._slot_ids

    def _home(self, ids: np.ndarray) -> np.ndarray:
        if _crows is not None and _flat_ids(ids):
            out = np.empty(len(ids), np.int64)
            _crows.homes(ids, int(self._mask), out)
            return out
        return (mix64(ids.view(np.uint64)) & self._mask).astype(np.int64)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        # The bucket of each id, -1 where absent: probe until the id or an empty bucket.
        out = np.full(ids.shape, -1, np.int64)
        flat = out.reshape(-1)
        todo = np.arange(ids.size)
        want = ids.reshape(-1)
        pos = self._home(want)
        mask = int(self._mask)
        known = self._slot_ids
        while todo.size:
            slot = self._table[pos]
            hit = known[np.maximum(slot, 0)] == want
            hit &= slot >= 0
            flat[todo[hit]] = pos[hit]
            more = (slot != EMPTY) & ~hit
            todo, want, pos = todo[more], want[more], (pos[more] + 1) & mask
        return out

    def _add(self, new_ids: np.ndarray) -> None:
        # New, distinct, absent ids take slots len, len+1, ... in their order.
        k = len(new_ids)
        if self._len + self._tombs + k > MAX_LOAD * self.buckets:
            self._rebuild(self._len + k)
        end = self._len + k
        if end > len(self._slot_ids):
            grown = np.empty(max(end, len(self._slot_ids) * 5 // 4 + GROW_SLOTS), np.int64)
            grown[: self._len] = self._slot_ids[: self._len]
            self._slot_ids = grown
        self._slot_ids[self._len : end] = new_ids
        self._place(np.arange(self._len, end, dtype=np.int64))
        self._len = end

    def _place(self, slots: np.ndarray) -> None:
        # Put the slots of distinct absent ids (in slot_ids already) in the first
        # non-full bucket of each id's probe path.
        todo = slots
        pos = self._home(self._slot_ids[slots])
        mask = int(self._mask)
        table = self._table
        while todo.size:
            free = np.flatnonzero(table[pos] < 0)
            cand, cpos = todo[free], pos[free]
            was_tomb = table[cpos] == TOMBSTONE
            table[cpos] = cand  # several may share a bucket: one write survives, the winner's
            won = table[cpos] == cand
            self._tombs -= int(np.count_nonzero(won & was_tomb))  # one winner per bucket
            left = np.ones(len(todo), bool)
            left[free[won]] = False
            todo, pos = todo[left], (pos[left] + 1) & mask

    def _rebuild(self, need: int) -> None:
        # A fresh table sized for ``need`` ids, with the live ones and no tombstones.
        self._alloc(_buckets_for(need))
        self._place(np.arange(self._len, dtype=np.int64))
        spare = len(self._slot_ids) - self._len
        if spare > self._len + 2 * GROW_SLOTS:  # give back most of a shrunk slot array
            self._slot_ids = self._slot_ids[: self._len + self._len // 4 + GROW_SLOTS].copy()


def _first_appearance(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # (inverse, distinct): the distinct ids in order of first appearance, and
    # where in them each id is. Sorts without a stable sort (numpy's default
    # sort is several times faster), the common all-distinct case in one sort.
    ranked = np.sort(ids)
    if not ranked.size or (ranked[1:] != ranked[:-1]).all():
        return np.arange(len(ids), dtype=np.int64), ids
    uniq, inverse = np.unique(ids, return_inverse=True)
    first = np.full(len(uniq), len(ids), np.int64)
    np.minimum.at(first, inverse.reshape(-1), np.arange(len(ids), dtype=np.int64))
    by_first = np.argsort(first)  # firsts are distinct: any sort is stable here
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(len(by_first))
    return rank[inverse.reshape(-1)], uniq[by_first]


def bucket_of(ids: np.ndarray, buckets: int) -> np.ndarray:
    """:func:`aioparamsync.placement.bucket_of`, in one compiled pass where it was built."""
    if _crows is not None and _flat_ids(ids):
        out = np.empty(len(ids), np.int64)
        _crows.buckets(ids, buckets, out)
        return out
    return placement_bucket_of(ids, buckets)


def has_duplicates(ids: np.ndarray) -> bool:
    """True if an id occurs twice in ``ids`` (int64, 1-D): by a hash set, compiled where it
    was built (10^5 ids: ~1 ms, where numpy's sort takes 3.8)."""
    if _crows is not None and _flat_ids(ids):
        return bool(_crows.has_duplicates(ids))
    ranked = np.sort(ids)  # numpy's default sort: much faster than np.unique's
    return bool((ranked[1:] == ranked[:-1]).any())


def _flat_ids(ids: np.ndarray) -> bool:
    return ids.dtype == np.int64 and ids.ndim == 1 and ids.flags.c_contiguous


def _as_ids(ids: np.ndarray) -> np.ndarray:
    # The caller (RowBlock) checks dtypes for the user; here int64 is only ensured.
    return np.ascontiguousarray(ids, dtype=np.int64)
