# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The row rules' folds, compiled: ``sgd`` and ``adagrad`` in place, the rows of one
block (:func:`fold_rows`, a block's fold) or of every block of a table at once
(:func:`fold_held`, a table's push, its rows found by ``_crows.locate``).

Each element as numpy computes :meth:`RowBlock._fold_chunk
<aioparamsync.values.rows.RowBlock>`'s gathered rows, operation by operation (the
tests compare the bits). The rows are scattered over memory: a fold fetches every
line of what it will read and write a few rows ahead, and is mostly waiting for it.

:mod:`.rows` and :mod:`aioparamsync.store.rows` use it unless the pure path is asked
for (see :mod:`aioparamsync._ext`).
"""

from libc.math cimport sqrt, sqrtf
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

import numpy as np

from aioparamsync.values.rowindex import has_duplicates

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define APS_PREFETCH(p) __builtin_prefetch((p), 0, 0)
    #define APS_PREFETCH_W(p) __builtin_prefetch((p), 1, 3)
    #else
    #define APS_PREFETCH(p) ((void)0)
    #define APS_PREFETCH_W(p) ((void)0)
    #endif
    """
    void APS_PREFETCH(const void* p) nogil
    void APS_PREFETCH_W(const void* p) nogil

cdef enum:
    # How many rows ahead a fold fetches what it will read and write (as _crows' walks).
    AHEAD = 16
    # A cache line's bytes (where the prefetches of a row fall).
    LINE = 64


ctypedef fused real:
    float
    double


def fold_rows(
    real[:, ::1] rows,
    real[:, ::1] sums,
    const int64_t[::1] slots,
    const real[:, ::1] grads,
    double lr,
    double eps,
    bint adagrad,
    const int64_t[::1] grad_rows=None,
):
    """Fold ``grads[i]`` into ``rows[slots[i]]`` in place, by ``sgd``
    (``w -= lr * g``) or, with ``adagrad``, by Adagrad (``s += g * g``, then
    ``w -= lr * (g / (sqrt(s) + eps))``, ``s`` the row's ``sums``; ``sums`` is
    ``rows`` itself for ``sgd``, and not read).

    Each element as numpy computes :meth:`RowBlock._fold_chunk
    <aioparamsync.values.rows.RowBlock>`'s gathered rows, operation by operation,
    the scalars first converted to the rows' type: the same bits (the tests
    compare them). The slots are distinct (a row folded twice would see its own
    first fold, where numpy's gather sees the old row for both); checked first,
    with their bounds: a bad one raises, and nothing is written.

    With ``grad_rows``, the gradient of ``slots[i]`` is ``grads[grad_rows[i]]``
    (a table's push folds each bucket's part where it lies in the push, with no
    copy of it).
    """
    cdef Py_ssize_t i, j, n = slots.shape[0], dim = rows.shape[1], held = rows.shape[0]
    cdef Py_ssize_t given = grads.shape[0], at
    cdef int64_t slot
    cdef real r_lr = <real>lr, r_eps = <real>eps
    cdef real* w
    cdef const real* gr
    cdef bint indexed = grad_rows is not None
    if grads.shape[1] != dim or (grads.shape[0] != n if not indexed else grad_rows.shape[0] != n):
        raise ValueError("grads are (len(slots), the rows' width), or indexed by grad_rows")
    if indexed:
        for i in range(n):
            if not 0 <= grad_rows[i] < given:
                raise IndexError(f"gradient {grad_rows[i]} is out of bounds")
    if adagrad and (sums.shape[0] != held or sums.shape[1] != dim):
        raise ValueError("adagrad's sums are of the rows' shape")
    for i in range(n):  # (checked first: a bad slot raises, nothing is written)
        if not 0 <= slots[i] < held:
            raise IndexError(f"row {slots[i]} is out of bounds")
    if has_duplicates(np.asarray(slots)):  # (a hash set of the slots: not a mark a row)
        raise ValueError("a row is folded twice in one call")
    if n == 0 or dim == 0:
        return
    # (gradients read where they lie in a frame may be unaligned: each row is copied
    # into an aligned one first, a memcpy of a row that is in the cache by then)
    cdef bint unaligned = (<size_t>&grads[0, 0]) % sizeof(real) != 0
    cdef real* line = <real*>malloc(dim * sizeof(real)) if unaligned else NULL
    if unaligned and line == NULL:
        raise MemoryError()
    with nogil:
        for i in range(n):
            if i + AHEAD < n:  # (each line of the row, its sums and its gradient)
                w, gr = &rows[slots[i + AHEAD], 0], &grads[grad_rows[i + AHEAD], 0] if indexed else NULL
                j = 0
                while j < dim:
                    APS_PREFETCH_W(w + j)
                    if adagrad:
                        APS_PREFETCH_W(&sums[slots[i + AHEAD], 0] + j)
                    if indexed:
                        APS_PREFETCH(gr + j)
                    j += LINE // sizeof(real)
            slot = slots[i]
            w = &rows[slot, 0]
            at = grad_rows[i] if indexed else i
            gr = &grads[at, 0]
            if unaligned:
                memcpy(line, gr, dim * sizeof(real))
                gr = line
            _fold_row(w, &sums[slot, 0] if adagrad else NULL, gr, dim, r_lr, r_eps)
    free(line)


cdef inline void _fold_row(
    real* w, real* acc, const real* gr, Py_ssize_t dim, real r_lr, real r_eps
) noexcept nogil:
    # One row's fold: Adagrad's where acc (the row's sums) is given, else sgd's.
    cdef Py_ssize_t j
    cdef real g, s
    if acc != NULL:
        for j in range(dim):
            g = gr[j]
            s = acc[j] + g * g
            acc[j] = s
            w[j] = w[j] - r_lr * (g / (_sqrt(s) + r_eps))
    else:
        for j in range(dim):
            w[j] = w[j] - r_lr * gr[j]


def fold_held(
    list rows,
    list sums,
    list versions,
    list touched,
    const int64_t[::1] slots,
    const int64_t[::1] owner,
    const real[:, ::1] grads,
    double lr,
    double eps,
    bint adagrad,
    double stamp,
):
    """Fold ``grads[i]`` into row ``slots[i]`` of bucket ``owner[i]``'s block (as
    :func:`locate` finds them), for the rows of every bucket in one pass, as
    :func:`fold_rows` folds each row (the same bits); and each such row's version
    grows by one, its time is ``stamp``.

    ``rows[b]``, ``sums[b]`` (Adagrad's; for ``sgd``, not read), ``versions[b]`` and
    ``touched[b]`` are bucket ``b``'s block's arrays, or None where it has none. The
    rows are distinct (the caller's ids are). Every slot and bucket is checked first:
    a bad one raises, and nothing is written.
    """
    cdef Py_ssize_t i, j, b, n = slots.shape[0], dim = grads.shape[1], count = len(rows)
    if grads.shape[0] != n or owner.shape[0] != n:
        raise ValueError("slots, owner and grads are of one length")
    if len(sums) != count or len(versions) != count or len(touched) != count:
        raise ValueError("rows, sums, versions and touched are one per bucket")
    cdef real[:, ::1] block
    cdef real[:, ::1] acc
    cdef int64_t[::1] ver
    cdef double[::1] when
    cdef real** first = <real**>calloc(max(count, 1), sizeof(void*))
    cdef real** sum_of = <real**>calloc(max(count, 1), sizeof(void*))
    cdef int64_t** ver_of = <int64_t**>calloc(max(count, 1), sizeof(void*))
    cdef double** when_of = <double**>calloc(max(count, 1), sizeof(void*))
    cdef int64_t* held = <int64_t*>calloc(max(count, 1), sizeof(int64_t))
    cdef real* line = <real*>malloc(max(dim, 1) * sizeof(real))
    cdef real r_lr = <real>lr, r_eps = <real>eps
    cdef real* w
    cdef const real* gr
    cdef int64_t slot
    cdef bint unaligned = n > 0 and dim > 0 and (<size_t>&grads[0, 0]) % sizeof(real) != 0
    try:
        if not (first and sum_of and ver_of and when_of and held and line):
            raise MemoryError()
        for b in range(count):
            if rows[b] is None:
                continue
            block, ver, when = rows[b], versions[b], touched[b]
            if adagrad:
                acc = sums[b]
            else:
                acc = block
            if block.shape[1] != dim or acc.shape[1] != dim:
                raise ValueError("every block's rows are as wide as grads")
            held[b] = min(block.shape[0], acc.shape[0], ver.shape[0], when.shape[0])
            if held[b]:
                first[b], sum_of[b] = &block[0, 0], &acc[0, 0]
                ver_of[b], when_of[b] = &ver[0], &when[0]
        for i in range(n):  # (checked first: a bad one raises, nothing is written)
            if not (0 <= owner[i] < count and 0 <= slots[i] < held[owner[i]]):
                raise IndexError(f"row {slots[i]} of bucket {owner[i]} is not held")
        with nogil:
            for i in range(n):
                if i + AHEAD < n:  # (each line of the row, its sums, version and time)
                    b, slot = owner[i + AHEAD], slots[i + AHEAD]
                    j = 0
                    while j < dim:
                        APS_PREFETCH_W(first[b] + slot * dim + j)
                        if adagrad:
                            APS_PREFETCH_W(sum_of[b] + slot * dim + j)
                        j += LINE // sizeof(real)
                    APS_PREFETCH_W(ver_of[b] + slot)
                    APS_PREFETCH_W(when_of[b] + slot)
                b, slot = owner[i], slots[i]
                w = first[b] + slot * dim
                gr = &grads[i, 0]
                if unaligned:
                    memcpy(line, gr, dim * sizeof(real))
                    gr = line
                _fold_row(w, sum_of[b] + slot * dim if adagrad else NULL, gr, dim, r_lr, r_eps)
                ver_of[b][slot] += 1
                when_of[b][slot] = stamp
    finally:
        free(first)
        free(sum_of)
        free(ver_of)
        free(when_of)
        free(held)
        free(line)


cdef inline real _sqrt(real x) noexcept nogil:
    if real is float:
        return sqrtf(x)
    else:
        return sqrt(x)
