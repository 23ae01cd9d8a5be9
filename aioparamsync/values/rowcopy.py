"""Whole rows moved by index: ``out[where] = rows[slots]`` of ``(n, dim)`` arrays; and
the rows of repeated ids summed (:func:`sum_duplicates`).

numpy moves a 2-D array's rows by an index array element by element, through a
temporary (``out[where] = rows[slots]`` gathers, then scatters). An embedding table
moves many short rows so, in every pull, push and fold. Here a row's bytes are copied
once: by the compiled ``copy_rows`` (see ``_crows.pyx``) where it was built, else as
records (one ``void`` of a row's bytes, which numpy copies whole). Rows of another
dtype, or arrays that are not C-contiguous, go as numpy does it (converting).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from .._ext import compiled
from .parallel import in_parts
from .rowindex import has_duplicates

__all__ = ["gather", "put_rows", "records", "sum_duplicates", "sum_repeats", "take_rows"]

# Most gradient elements summed at once (bounds the flat index array np.bincount takes).
SUM_CHUNK = 1 << 21

# The compiled row copy (see _crows.pyx), unless the pure path is asked for or not built.
_crows = compiled("values._crows")


def records(rows: np.ndarray) -> np.ndarray:
    """``(n, dim)`` rows as ``n`` records of their bytes (a view), when C-contiguous.

    numpy gathers and scatters whole rows by an index array several times faster so
    (a copy of each record's bytes) than as a 2-D array (element by element): a
    pull of 10^5 rows of 64 float32 spends ~2.5 ms there instead of ~10.
    """
    if rows.ndim != 2 or not rows.flags.c_contiguous or not rows.shape[1]:
        return rows
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).reshape(-1)


def take_rows(rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``rows[positions]`` of ``(n, dim)`` rows (a new array), gathered row by row (see
    :func:`put_rows`)."""
    if _crows is not None and rows.ndim == 2 and rows.flags.c_contiguous:
        out = np.empty((len(positions), rows.shape[1]), rows.dtype)
        put_rows(out, np.arange(len(positions)), rows, positions)
        return out
    whole = records(rows)
    if whole is rows:
        return rows[positions]
    return whole[positions].view(rows.dtype).reshape(len(positions), rows.shape[1])


def put_rows(
    out: np.ndarray, positions: np.ndarray, rows: np.ndarray, slots: np.ndarray | None = None
) -> None:
    """``out[positions] = rows[slots]`` (``rows`` with no ``slots``) of ``(n, dim)`` rows.

    Row by row, its bytes copied once, where both are contiguous rows of one dtype (the
    compiled ``copy_rows``; else as records: see :func:`records`); otherwise as numpy
    does it, converting.
    """
    if out.dtype != rows.dtype or out.ndim != 2 or rows.ndim != 2:
        out[positions] = rows if slots is None else rows[slots]
        return
    if _crows is not None and out.flags.c_contiguous and rows.flags.c_contiguous:
        chosen = np.arange(len(rows)) if slots is None else np.asarray(slots, np.int64)
        _crows.copy_rows(_as_bytes(rows), chosen, _as_bytes(out), np.asarray(positions, np.int64))
        return
    into, whole = records(out), records(rows)
    if into is out or whole is rows:
        out[positions] = rows if slots is None else rows[slots]
    else:
        into[positions] = whole if slots is None else whole[slots]


def _as_bytes(rows: np.ndarray) -> np.ndarray:
    # (n, dim) C-contiguous rows as (n, dim * itemsize) bytes: a view
    return rows.view(np.uint8).reshape(rows.shape[0], rows.shape[1] * rows.itemsize)


def gather(
    blocks: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray] | None],
    ids: np.ndarray,
    out: np.ndarray,
) -> np.ndarray | None:
    """``out[i] =`` the row of ``ids[i]`` in ``blocks[its bucket]``, all ids in one
    compiled pass (a large pull's ids in parts, on several cores at once: see
    :func:`~aioparamsync.values.parallel.in_parts`); answers the positions of the ids
    with no row there (their rows in ``out`` left as they were), ascending.

    ``blocks``: one per bucket of the table (the bucket of an id as
    :func:`~aioparamsync.placement.bucket_of` computes it), each a block's
    ``layout()`` or None. Answers None, having done nothing, where this cannot be done
    so (the pure path, or rows not of ``out``'s dtype, both C-contiguous): the caller
    reads the rows bucket by bucket.
    """
    if _crows is None or out.ndim != 2 or not out.flags.c_contiguous:
        return None
    tables: list[np.ndarray | None] = []
    slot_ids: list[np.ndarray | None] = []
    rows: list[np.ndarray | None] = []
    for block in blocks:
        table, sids, values = block if block is not None else (None, None, None)
        if values is not None and (
            values.dtype != out.dtype or values.ndim != 2 or not values.flags.c_contiguous
        ):
            return None
        tables.append(table)
        slot_ids.append(sids)
        rows.append(None if values is None else _as_bytes(values))
    missing = np.empty(len(ids), np.int64)
    want, into = np.ascontiguousarray(ids, np.int64), _as_bytes(out)

    def part(p: slice) -> np.ndarray:  # (parts on several cores at once: see in_parts)
        lost = _crows.gather_rows(tables, slot_ids, rows, want[p], into[p], missing[p])
        return missing[p][:lost] + p.start

    parts = cast(list[np.ndarray], in_parts(part, len(want), into.shape[1]))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def sum_duplicates(
    ids: np.ndarray, grads: np.ndarray, dtype: Any = np.float32, at: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Sum the rows of ``grads`` whose ids are equal.

    Args:
        ids: int64, ``(n,)``.
        grads: ``(n, dim)``, any float dtype.
        dtype: the dtype of the answered sums (they are added in float64).
        at: where ``ids``' gradients are in ``grads`` (``grads[at[i]]``: a table's push,
            summed where it lies); None: ``grads[i]``.

    Returns:
        ``(unique_ids, sums)``: ``ids`` and their gradients (cast) when no id repeats,
        else the sorted distinct ids and an ``(k, dim)`` array.

    Added by ``_crows.sum_rows``, or by ``np.bincount`` a chunk at a time: the same bits.
    """
    if not has_duplicates(ids):
        return ids, (grads if at is None else take_rows(grads, at)).astype(dtype, copy=False)
    return sum_repeats(ids, grads, dtype, at)


def sum_repeats(
    ids: np.ndarray,
    grads: np.ndarray,
    dtype: Any = np.float32,
    at: np.ndarray | None = None,
    step: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`sum_duplicates` of ``ids`` its caller knows to repeat: the sorted distinct
    ids and their sums (summed by chunks of ``step`` rows, by default ``SUM_CHUNK``
    elements' worth)."""
    crows = _crows if grads.dtype in (np.float32, np.float64) else None
    if crows is not None:
        uniq, inverse = _unique(crows, ids)
    else:
        uniq, inverse = np.unique(ids, return_inverse=True)
    k, dim = len(uniq), grads.shape[1]
    step, inverse = step or max(1, SUM_CHUNK // dim), inverse.reshape(-1)
    if crows is not None:
        sums = np.zeros((k, dim), np.float64)
        rows = None if at is None else np.ascontiguousarray(at, np.int64)
        crows.sum_rows(inverse, np.require(grads, None, ("C",)), sums, step, rows)
        return uniq, sums.astype(dtype)
    if at is not None:
        grads = take_rows(grads, at)
    sums, columns = np.zeros(k * dim, np.float64), np.arange(dim, dtype=np.int64)
    for start in range(0, len(ids), step):
        flat = (inverse[start : start + step, None] * dim + columns).reshape(-1)
        weights = grads[start : start + step].astype(np.float64).reshape(-1)
        sums += np.bincount(flat, weights=weights, minlength=k * dim)
    return uniq, sums.reshape(k, dim).astype(dtype)


def _unique(crows: Any, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(ids, return_inverse=True)``, the same arrays: the distinct ids found
    by a hash set (compiled ``first_seen``), then only they sorted, not every id."""
    ids = np.ascontiguousarray(ids, np.int64)
    first, groups = np.empty(len(ids), np.int64), np.empty(len(ids), np.int64)
    k = crows.first_seen(ids, first, groups)
    order = np.argsort(first[:k])
    rank = np.empty(k, np.int64)
    rank[order] = np.arange(k)
    return first[order], rank[groups]
