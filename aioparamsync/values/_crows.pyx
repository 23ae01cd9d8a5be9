# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The row index's lookup, compiled: one probe loop per id in C.

The same contract as :meth:`aioparamsync.values.rowindex.RowIndex.lookup` (its
numpy version probes every id at once, a round per bucket of the longest probe
path, with a few array operations a round: ~35 us of fixed cost per call and
~17 ns an id). Here each id walks its own probe path from its home bucket,
which the caller computes with the index's own hash (so there is one hash, in
:mod:`aioparamsync.placement`), to the bucket holding its slot or to an empty
one. The table is never full (its load is at most one half), so every walk ends.

:mod:`.rowindex` uses it unless the pure path is asked for (see
:mod:`aioparamsync._ext`); the tests run both against the same model.
"""

from libc.stdint cimport int64_t
from libc.string cimport memcpy


def probe(
    const int64_t[::1] table,
    const int64_t[::1] slot_ids,
    const int64_t[::1] ids,
    const int64_t[::1] home,
    int64_t[::1] out,
):
    """``out[i]`` = the slot of ``ids[i]`` (its walk starting at ``home[i]``), or -1.

    ``table``'s length is a power of two; a bucket holds a slot (>= 0), -1 (empty)
    or -2 (a tombstone, walked past).
    """
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef int64_t mask = table.shape[0] - 1
    cdef int64_t pos, slot, want
    if home.shape[0] != n or out.shape[0] != n:
        raise ValueError("ids, home and out are of one length")
    with nogil:
        for i in range(n):
            want = ids[i]
            pos = home[i] & mask
            while True:
                slot = table[pos]
                if slot == -1:
                    out[i] = -1
                    break
                if slot >= 0 and slot_ids[slot] == want:
                    out[i] = slot
                    break
                pos = (pos + 1) & mask


def copy_rows(
    const unsigned char[:, ::1] source,
    const int64_t[::1] slots,
    unsigned char[:, ::1] out,
    const int64_t[::1] where,
):
    """``out[where[i]] = source[slots[i]]``, each row's bytes copied once (no temporary:
    numpy's ``out[where] = source[slots]`` gathers into one, then scatters it)."""
    cdef Py_ssize_t i, n = slots.shape[0], width = source.shape[1]
    cdef Py_ssize_t rows_in = source.shape[0], rows_out = out.shape[0]
    if where.shape[0] != n or out.shape[1] != width:
        raise ValueError("slots and where are of one length, source and out of one width")
    for i in range(n):  # (checked first: a bad index raises, nothing is written)
        if not (0 <= slots[i] < rows_in and 0 <= where[i] < rows_out):
            raise IndexError(f"row {slots[i]} -> {where[i]} is out of bounds")
    if width == 0:
        return
    with nogil:
        for i in range(n):
            memcpy(&out[where[i], 0], &source[slots[i], 0], width)
