"""Sparse embedding tables: rows made on first touch, folded by sgd, adagrad or lazy adam.

An embedding table (:class:`BlockSpec`) has a name, a row width ``dim``, a
storage dtype, an initializer (:class:`Init`) and a fold rule
(:class:`RowRule`). Its ids are any int64s, not a dense range; a
:class:`RowBlock` holds the rows of one bucket of one table: a
:class:`~.rowindex.RowIndex` (id -> dense slot), the ``(capacity, dim)``
block of rows, the rule's state in blocks of the same layout, and the time
each row was last touched (for eviction).

Rows are made by the initializer the first time they are touched, and the
initial row of an id is a pure function of (table, id, seed): a
counter-based hash (splitmix64), not a random stream. So every replica and
every restart makes the same row, whichever other rows exist and in
whatever order they were touched, and a row that was evicted before it was
ever folded is made again exactly as it was.

A fold first sums the gradients of an id that occurs more than once (in
float64), then folds each touched row once, by torch.optim's arithmetic,
computed in float32 (float64 for float64 tables):

- ``sgd``: ``w -= lr*g``.
- ``adagrad`` (torch.optim.Adagrad, no lr_decay, no weight decay):
  ``s += g^2; w -= lr * g / (sqrt(s) + eps)``.
- ``adam``, lazy (torch.optim.SparseAdam's arithmetic): ``t += 1``,
  ``m += (1-b1)*(g-m); v += (1-b2)*(g^2-v)``,
  ``w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)`` (eps not rescaled, unlike
  torch.optim.Adam). Only the touched rows' ``m``, ``v`` change, and each row
  counts its own steps ``t`` (the folds that touched it): SparseAdam counts
  one global step, which means nothing across shards, and replicas that see
  different batches. The two agree whenever every step touches every row.

Nothing here knows of asyncio or the network, and a method either changes
the block as asked or raises :class:`RequestError` having changed nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from .._ext import compiled
from ..errors import ErrorCode
from .rowcopy import put_rows, sum_duplicates, sum_repeats, take_rows
from .rowindex import RowIndex, has_duplicates
from .rowspec import (
    DTYPES,
    INIT_KINDS,
    RULE_KINDS,
    BlockSpec,
    Init,
    RowRule,
    _bad,
    check_steps,
    check_time,
    check_times,
    normal,
    uniform,
    zeros,
)
from .rules import all_finite

__all__ = [
    "DTYPES",
    "INIT_KINDS",
    "RULE_KINDS",
    "BlockSpec",
    "Init",
    "RowBlock",
    "RowData",
    "RowRule",
    "normal",
    "sum_duplicates",
    "uniform",
    "zeros",
]

# The row block grows by at least this many rows, or by a quarter (amortised O(1) per row).
GROW_ROWS = 64
# Elements folded at once (the same cache argument: 2x faster for adam than all at once).
FOLD_CHUNK = 1 << 16
_crowfold = compiled("values._crowfold")  # (see _crowfold.pyx; None: the pure path)


def _is_float(dtype: np.dtype) -> bool:
    ml = sys.modules.get("ml_dtypes")  # a bfloat16 array means ml_dtypes was imported
    return dtype.kind == "f" or (ml is not None and dtype == np.dtype(ml.bfloat16))


class RowData(NamedTuple):
    """Rows as plain arrays, for replication: ids, their rows, the rule's state of each,
    and each row's version (the folds it has had)."""

    ids: np.ndarray
    rows: np.ndarray
    state: dict[str, np.ndarray]
    versions: np.ndarray


class RowBlock:
    """The rows of one bucket of one table, their rule state and last-touched times.

    Rows ``0 .. len-1`` of every block are live (the index's dense slots); the
    blocks grow by ``max(GROW_ROWS, capacity/4)`` rows and shrink after a
    large eviction. Rule state is kept in :attr:`BlockSpec.work_dtype`.
    """

    def __init__(self, spec: BlockSpec, capacity: int = 0) -> None:
        """An empty block of table ``spec`` with room for ``capacity`` rows."""
        self._spec = spec
        self._dtype = spec.np_dtype
        self._work = spec.work_dtype
        self._index = RowIndex(capacity)
        self._clock = 0.0  # the latest time seen: what rows made without a time get
        self._rows = np.empty((capacity, spec.dim), self._dtype)
        self._touched = np.empty(capacity, np.float64)
        # Each row's version: the folds it has had (replicas keep the newest).
        self._versions = np.empty(capacity, np.int64)
        self._state: dict[str, np.ndarray] = {}
        for name in spec.rule.state_names:
            shape = (capacity,) if name == "step" else (capacity, spec.dim)
            self._state[name] = np.empty(shape, np.int64 if name == "step" else self._work)

    @property
    def spec(self) -> BlockSpec:
        """The table this block holds rows of."""
        return self._spec

    @property
    def capacity(self) -> int:
        """Rows the blocks have room for before they grow."""
        return len(self._rows)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        s = self._spec
        kind = f"{s.name!r} dim={s.dim} {s.dtype} {s.rule.kind}"
        return f"<RowBlock {kind}: {len(self)} rows, {self.nbytes / 1e6:.1f} MB>"

    def memory(self) -> dict[str, int]:
        """Bytes held by part: ``index``, ``rows``, ``touched``, ``state`` (spare capacity too)."""
        return {
            "index": self._index.nbytes,
            "rows": self._rows.nbytes,
            "touched": self._touched.nbytes + self._versions.nbytes,
            "state": sum(a.nbytes for a in self._state.values()),
        }

    @property
    def nbytes(self) -> int:
        """All the bytes the block holds."""
        return sum(self.memory().values())

    # -- reading ----------------------------------------------------------------------------

    def pull(self, ids: np.ndarray, *, now: float | None = None) -> np.ndarray:
        """The rows of ``ids``, in that order, making the missing ones by the initializer.

        Args:
            ids: int64, ``(n,)``; ids may repeat.
            now: if given, every row pulled is stamped as touched at ``now``;
                rows made without it get the latest time the block has seen.

        Returns:
            A new ``(n, dim)`` array of the table's dtype.

        Raises:
            RequestError: ``ids`` is not a 1-D int64 array, or ``now`` not finite.
        """
        ids = _check_ids(ids)
        stamp = None if now is None else check_time("now", now)
        slots = self._ensure(ids, stamp)
        if stamp is not None:
            self._touch(slots, stamp)
        return self._rows[slots]

    def peek(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``ids`` without making any: ``(rows, found)``.

        ``found[i]`` says whether ``ids[i]`` has a row; where it has none,
        ``rows[i]`` is what :meth:`pull` would make (the initializer's row).
        """
        ids = _check_ids(ids)
        slots = self._index.lookup(ids)
        found = slots >= 0
        rows = np.empty((len(ids), self._spec.dim), self._dtype)
        rows[found] = self._rows[slots[found]]
        if not found.all():
            rows[~found] = self._initial(ids[~found])
        return rows, found

    def read_into(self, ids: np.ndarray, out: np.ndarray, where: np.ndarray) -> None:
        """``out[where[i]] =`` the row of ``ids[i]``, made by the initializer where there
        is none (and not kept: :meth:`peek` without its copy)."""
        slots = self._index.lookup(_check_ids(ids))
        found = slots >= 0
        if found.all():
            put_rows(out, where, self._rows, slots)
            return
        put_rows(out, where[found], self._rows, slots[found])
        out[where[~found]] = self._initial(ids[~found])

    def layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Its index's buckets and slots' ids, and its rows: what a compiled read walks."""
        return (*self._index.arrays, self._rows)

    def fold_layout(self) -> tuple[np.ndarray, ...] | None:
        """What a compiled fold of a table's push walks and writes (``_crowfold.fold_held``):
        :meth:`layout`, then the sums Adagrad keeps (the rows for ``sgd``), versions and
        times; None where that fold does not take this block's rule or dtype."""
        if self._folds_in_place(self._rows) is None:
            return None
        return (*self.layout(), self._state.get("sum", self._rows), self._versions, self._touched)

    def make(self, ids: np.ndarray, now: float) -> None:
        """Make the rows of ``ids`` that have none, as a fold at ``now`` does first, and
        count ``now`` as seen (a compiled fold stamps the rows it folds itself)."""
        stamp = check_time("now", now)
        if len(ids):
            self._ensure(_check_ids(ids), stamp)
        self._clock = max(self._clock, stamp)

    def rows_of(
        self,
        ids: np.ndarray | None = None,
        span: slice | None = None,
        touched_since: float | None = None,
    ) -> RowData:
        """The ids of ``ids`` that have rows (None: every row, in slot order, or those of
        ``span`` of the slots; with ``touched_since``, of the rows touched at or after
        it), in that order, with copies of their rows, state and versions."""
        if ids is None:
            slots = np.arange(len(self))
            if touched_since is not None:
                slots = slots[self._touched[: len(self)] >= touched_since]
            slots = slots[span or slice(None)]
            ids = self._index.ids(slots)
        else:
            ids = _check_ids(ids)
            slots = self._index.lookup(ids)
            keep = slots >= 0
            ids, slots = ids[keep], slots[keep]
        state = {name: a[slots] for name, a in self._state.items()}
        return RowData(ids, self._rows[slots], state, self._versions[slots])

    def export(self) -> dict[str, np.ndarray]:
        """Every row as plain arrays (for a snapshot): ``ids``, ``rows``, ``touched``, state.

        The arrays are copies, in slot order; :meth:`from_export` rebuilds the block.
        """
        n = len(self)
        out = {"ids": self._index.ids(), "rows": self._rows[:n].copy()}
        out["touched"] = self._touched[:n].copy()
        out["versions"] = self._versions[:n].copy()
        out.update((name, a[:n].copy()) for name, a in self._state.items())
        return out

    # -- changing ---------------------------------------------------------------------------

    def fold(
        self, ids: np.ndarray, grads: np.ndarray, now: float, at: np.ndarray | None = None
    ) -> np.ndarray:
        """Fold a batch's gradients into its rows by the table's rule.

        Missing rows are made first; the gradients of an id that occurs more
        than once are summed and folded once.

        Args:
            ids: int64, ``(n,)``.
            grads: ``(n, dim)``, a float dtype, every value finite.
            now: the time the rows are stamped as touched at.
            at: where ``ids``' gradients are in ``grads`` (a table's push, which its
                caller checked whole; each bucket's part is folded where it lies,
                uncopied, where the compiled fold can); None: ``grads[i]``.

        Returns:
            The ids of the changed rows, each once (int64).

        Raises:
            RequestError: (SHAPE_MISMATCH) ``ids`` or ``grads`` of the wrong
                dtype or shape; (BAD_REQUEST) a value not finite. The block is
                then unchanged.
        """
        ids = _check_ids(ids)
        stamp = check_time("now", now)
        # (with ``at``, the caller checked the values: each is finite once, not again here)
        finite = at is None and not self._spec.rule.allow_nonfinite
        uniq, summed = ids, grads
        if at is not None and has_duplicates(ids):  # (summed where they lie in the push)
            uniq, summed = sum_repeats(ids, grads, self._work, at)
            at = None
        elif at is not None and self._folds_in_place(grads) is None:
            summed, at = take_rows(grads, at).astype(self._work, copy=False), None
        elif at is None:
            grads = _check_rows("grads", grads, len(ids), self._spec.dim, finite=finite)
            uniq, summed = sum_duplicates(ids, grads, self._work)
        slots = self._ensure(uniq, stamp)
        self._fold_rows(slots, summed, at)
        self._versions[slots] += 1
        self._touch(slots, stamp)
        return uniq.copy()

    def assign(self, ids: np.ndarray, rows: np.ndarray, now: float) -> np.ndarray:
        """Set the rows of ``ids`` to ``rows`` (made first where missing), each at a new
        version, its rule's state made anew (as a new row's); answer ``ids``.

        Raises:
            RequestError: ``ids`` repeat, or not int64 (1-D); ``rows`` not
                ``(n, dim)`` floats, or (unless the rule allows it) not finite.
                The block is then unchanged.
        """
        ids = _check_ids(ids)
        if has_duplicates(ids):
            raise _bad(f"table {self._spec.name!r}: ids repeat; each row is set once")
        finite = not self._spec.rule.allow_nonfinite
        rows = _check_rows("rows", rows, len(ids), self._spec.dim, finite=finite)
        stamp = check_time("now", now)
        slots = self._ensure(ids, stamp)
        with np.errstate(over="ignore"):  # a float16 row may overflow to inf
            self._rows[slots] = rows
        for name, a in self._state.items():
            a[slots] = self._spec.rule.initial_accumulator if name == "sum" else 0
        self._versions[slots] += 1
        self._touch(slots, stamp)
        return ids.copy()

    def merge(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        state: Mapping[str, np.ndarray] | None = None,
        versions: np.ndarray | None = None,
        *,
        now: float | None = None,
    ) -> int:
        """Install rows from a replica, making slots as needed; answer how many were kept.

        Args:
            ids: int64, ``(n,)``, distinct.
            rows: ``(n, dim)``, a float dtype, finite (cast to the table's dtype).
            state: the rule's state of each row (:attr:`RowRule.state_names`), as
                :meth:`rows_of` answers it; ``None`` only for a rule with none.
            versions: each row's version (int64 >= 0): a row is kept only if it
                is newer than the one held (or none is), so a delta received
                twice, late or out of order changes nothing. None: every row is
                installed wholesale, at version 0.
            now: the time the rows are stamped as touched at (default: the
                latest the block has seen).

        Raises:
            RequestError: a bad array (dtype, shape, repeated id, a value not
                finite, a negative step count, accumulator or version); nothing changes.
        """
        ids, rows, checked = self._check_install(ids, rows, state)
        if versions is None:
            versions = np.zeros(len(ids), np.int64)
        else:
            versions = check_steps(versions, len(ids), "versions")
            held = self._index.lookup(ids)
            newer = held < 0
            have = ~newer
            newer[have] = versions[have] > self._versions[held[have]]
            if not newer.all():
                ids, rows, versions = ids[newer], rows[newer], versions[newer]
                checked = {name: a[newer] for name, a in checked.items()}
        stamp = self._clock if now is None else check_time("now", now)
        self._install(ids, rows, checked, np.full(len(ids), stamp), versions)
        self._clock = max(self._clock, stamp)
        return len(ids)

    def evict(self, older_than: float) -> np.ndarray:
        """Drop the rows last touched before ``older_than``; answer their ids."""
        stamp = check_time("older_than", older_than)
        n = len(self)
        gone = self._index.ids(np.flatnonzero(self._touched[:n] < stamp))
        moved_from, moved_to = self._index.remove(gone)
        for a in self._blocks():
            a[moved_to] = a[moved_from]
        n = len(self)
        if self.capacity > 2 * n + GROW_ROWS:  # give most of the memory back
            self._resize(n + max(GROW_ROWS, n // 4), n)
        return gone

    @classmethod
    def from_export(cls, spec: BlockSpec, arrays: Mapping[str, np.ndarray]) -> RowBlock:
        """A block of table ``spec`` holding the rows :meth:`export` answered.

        ``touched`` may be left out (every row is then stamped 0.0).

        Raises:
            RequestError: a missing, unknown or bad array; ids repeated.
        """
        arrays = dict(arrays)
        known = {"ids", "rows", "touched", "versions", *spec.rule.state_names}
        if not {"ids", "rows"} <= set(arrays) <= known:
            raise _bad(
                f"table {spec.name!r}: an export has {', '.join(sorted(known))} "
                f"(touched and versions optional), not {', '.join(sorted(arrays))}"
            )
        state = {name: arrays[name] for name in spec.rule.state_names if name in arrays}
        block = cls(spec, capacity=len(_check_ids(arrays["ids"])))
        ids, rows, checked = block._check_install(arrays["ids"], arrays["rows"], state)
        touched = np.zeros(len(ids))
        if "touched" in arrays:
            touched = check_times(arrays["touched"], len(ids))
        versions = np.zeros(len(ids), np.int64)
        if "versions" in arrays:
            versions = check_steps(arrays["versions"], len(ids), "versions")
        block._install(ids, rows, checked, touched, versions)
        block._clock = float(touched.max(initial=0.0))
        return block

    # -- inside -----------------------------------------------------------------------------

    def _blocks(self) -> list[np.ndarray]:
        return [self._rows, self._touched, self._versions, *self._state.values()]

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        return self._spec.init.values(self._spec.name, ids, self._spec.dim, self._dtype)

    def _touch(self, slots: np.ndarray, stamp: float) -> None:
        self._touched[slots] = stamp
        self._clock = max(self._clock, stamp)

    def _insert(self, ids: np.ndarray) -> tuple[np.ndarray, int, int]:
        # The slots of ids, the new ones (old .. new-1) with room but no values yet.
        old = len(self._index)
        slots = self._index.insert(ids)
        new = len(self._index)
        if new > self.capacity:
            self._resize(max(new, self.capacity + max(GROW_ROWS, self.capacity // 4)), old)
        return slots, old, new

    def _ensure(self, ids: np.ndarray, stamp: float | None) -> np.ndarray:
        # The slots of ids, the missing rows made by the initializer.
        slots, old, new = self._insert(ids)
        if new > old:
            fresh = self._index.ids(np.arange(old, new))
            self._spec.init.fill(self._rows[old:new], self._spec.name, fresh)
            self._touched[old:new] = self._clock if stamp is None else stamp
            self._versions[old:new] = 0
            for name, a in self._state.items():
                a[old:new] = self._spec.rule.initial_accumulator if name == "sum" else 0
        return slots

    def _resize(self, capacity: int, keep: int) -> None:
        # New blocks of ``capacity`` rows holding the first ``keep`` rows of the old ones.
        def moved(a: np.ndarray) -> np.ndarray:
            out = np.empty((capacity, *a.shape[1:]), a.dtype)
            out[:keep] = a[:keep]
            return out

        self._rows, self._touched = moved(self._rows), moved(self._touched)
        self._versions = moved(self._versions)
        self._state = {name: moved(a) for name, a in self._state.items()}

    def _folds_in_place(self, g: np.ndarray) -> np.ndarray | None:
        # g as the compiled fold takes it, if it does: sgd and adagrad, rows and g of one
        # dtype, float32 or float64 (the same bits as _fold_chunk's); else None.
        rule, rows = self._spec.rule, self._rows
        fits = rows.dtype == g.dtype and rows.dtype in (np.float32, np.float64)
        if _crowfold is None or rule.kind not in ("sgd", "adagrad") or not fits:
            return None
        return np.require(g, None, ("C",))  # (unaligned, as in a frame: read so)

    def _fold_rows(self, slots: np.ndarray, g: np.ndarray, at: np.ndarray | None = None) -> None:
        # Each slot once; g is (len(slots), dim) in the working dtype (or g[at] is). In
        # place, compiled, where it can (_folds_in_place); else by chunks of rows whose
        # temporaries stay in the cache.
        rule, rows, adagrad = self._spec.rule, self._rows, self._spec.rule.kind == "adagrad"
        if (fast := self._folds_in_place(g)) is not None and _crowfold is not None:
            slots = np.ascontiguousarray(slots, np.int64)
            sums, eps = (self._state["sum"], rule.eps) if adagrad else (rows, 0.0)
            at = None if at is None else np.ascontiguousarray(at, np.int64)
            _crowfold.fold_rows(rows, sums, slots, fast, rule.lr, eps, adagrad, at)
            return
        assert at is None  # (only where the compiled fold takes it: see fold)
        step = max(1, FOLD_CHUNK // self._spec.dim)
        for start in range(0, len(slots), step):
            self._fold_chunk(slots[start : start + step], g[start : start + step])

    def _fold_chunk(self, slots: np.ndarray, g: np.ndarray) -> None:
        rule, work = self._spec.rule, self._work
        # (whole rows gathered and put back row by row: see put_rows)
        w = take_rows(self._rows, slots).astype(work, copy=False)  # a copy already
        with np.errstate(over="ignore"):  # an overflow gives inf, as torch does
            if rule.kind == "sgd":
                w -= rule.lr * g
            elif rule.kind == "adagrad":
                s = take_rows(self._state["sum"], slots)
                s += g * g
                w -= rule.lr * (g / (np.sqrt(s) + rule.eps))
                put_rows(self._state["sum"], slots, s)
            else:  # adam, in torch.optim.SparseAdam's order of operations
                b1, b2 = rule.beta1, rule.beta2
                step = self._state["step"][slots] + 1
                m = take_rows(self._state["exp_avg"], slots)
                v = take_rows(self._state["exp_avg_sq"], slots)
                m += (g - m) * (1 - b1)
                v += (g * g - v) * (1 - b2)
                t = step.astype(np.float64)
                size = rule.lr * np.sqrt(1 - b2**t) / (1 - b1**t)
                w -= size.astype(work)[:, None] * (m / (np.sqrt(v) + rule.eps))
                self._state["step"][slots] = step
                put_rows(self._state["exp_avg"], slots, m)
                put_rows(self._state["exp_avg_sq"], slots, v)
            put_rows(self._rows, slots, w)  # a float16 row may overflow to inf here

    def _check_install(
        self, ids: Any, rows: Any, state: Mapping[str, np.ndarray] | None
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        ids = _check_ids(ids)
        if has_duplicates(ids):
            raise _bad(f"table {self._spec.name!r}: ids repeat; each row is installed once")
        dim, n = self._spec.dim, len(ids)
        # (rows a rule that allows non-finite gradients folded may hold NaN or inf)
        finite = not self._spec.rule.allow_nonfinite
        rows = _check_rows("rows", rows, n, dim, finite=finite)
        names = self._spec.rule.state_names
        given = dict(state or {})
        if set(given) != set(names):
            raise _bad(
                f"table {self._spec.name!r}: rule {self._spec.rule.kind} keeps state "
                f"{list(names)}, not {sorted(given)}"
            )
        checked = {}
        for name in names:
            if name == "step":
                checked[name] = check_steps(given[name], n)
                continue
            a = _check_rows(name, given[name], n, dim, finite=finite)
            if name != "exp_avg" and (a < 0).any():
                raise _bad(f"{name}: a sum of squares cannot be negative")
            checked[name] = a
        return ids, rows, checked

    def _install(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        state: dict[str, np.ndarray],
        touched: np.ndarray,
        versions: np.ndarray,
    ) -> None:
        slots, _, _ = self._insert(ids)
        with np.errstate(over="ignore"):  # a float16 row may overflow to inf
            self._rows[slots] = rows
        self._touched[slots] = touched
        self._versions[slots] = versions
        for name, a in state.items():
            self._state[name][slots] = a


def _check_ids(ids: Any) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.dtype != np.int64:
        raise _bad(f"ids must be int64, not {ids.dtype}", ErrorCode.SHAPE_MISMATCH)
    if ids.ndim != 1:
        raise _bad(f"ids must be 1-D, not of shape {ids.shape}", ErrorCode.SHAPE_MISMATCH)
    return ids


def _check_rows(what: str, rows: Any, n: int, dim: int, *, finite: bool = True) -> np.ndarray:
    rows = np.asarray(rows)
    if not _is_float(rows.dtype):
        raise _bad(f"{what} must be of a float dtype, not {rows.dtype}", ErrorCode.SHAPE_MISMATCH)
    if rows.shape != (n, dim):
        raise _bad(
            f"{what} must have shape ({n}, {dim}) (a row of {dim} per id), not {rows.shape}",
            ErrorCode.SHAPE_MISMATCH,
        )
    if finite and not all_finite(rows):
        ok = np.isfinite(rows)
        if not ok.all():
            raise _bad(f"{what} has {ok.size - np.count_nonzero(ok)} NaN or infinite values")
    return rows
