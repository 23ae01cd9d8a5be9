# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The row index's lookup, compiled: one probe loop per id in C; and the ids' hashes,
the rows' copy, a pull's read of every bucket at once (:func:`gather_rows`), the walk
of a table's push (:func:`locate`) and the sums of repeated ids' gradients (the row
rules' folds: ``_crowfold.pyx``).

The same contract as :meth:`aioparamsync.values.rowindex.RowIndex.lookup` (its
numpy version probes every id at once, a round per bucket of the longest probe
path, with a few array operations a round: ~35 us of fixed cost per call and
~17 ns an id). Here each id walks its own probe path from its home bucket,
which the caller computes with the index's own hash (:func:`homes`), to the
bucket holding its slot or to an empty one. The table is never full (its load is
at most one half), so every walk ends.

The hash is :func:`aioparamsync.placement.mix64` (splitmix64's finaliser): here
:func:`homes` (an index's home buckets) and :func:`buckets` (a table's buckets,
as :func:`~aioparamsync.placement.bucket_of`) compute it in one pass, where numpy
makes seven; the tests compare them with placement's. Walks and copies fetch what
they read a few ids ahead (the rows are scattered over memory: a pull is mostly
waiting for them).

:mod:`.rowindex` uses it unless the pure path is asked for (see
:mod:`aioparamsync._ext`); the tests run both against the same model.
"""

from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cdef extern from *:
    """
    #if defined(__GNUC__) || defined(__clang__)
    #define APS_PREFETCH(p) __builtin_prefetch((p), 0, 0)
    #else
    #define APS_PREFETCH(p) ((void)0)
    #endif
    """
    void APS_PREFETCH(const void* p) nogil

cdef enum:
    # How many ids ahead a walk or a copy fetches what it will read (measured: 16 took a
    # pull's copy of 10^5 rows of 64 float32 from 2.7 to 2.1 ms; 8 did nearly as well).
    AHEAD = 16
    # A cache line's bytes (where the prefetches of a row fall).
    LINE = 64


cdef inline uint64_t _mix64(uint64_t x) noexcept nogil:
    # splitmix64's finaliser, as placement.mix64 computes it (modulo 2**64)
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= 0x94D049BB133111EBULL
    x ^= x >> 31
    return x


def homes(const int64_t[::1] ids, int64_t mask, int64_t[::1] out):
    """``out[i] = mix64(ids[i]) & mask`` (the ids' bits as uint64): a row index's home
    buckets."""
    cdef Py_ssize_t i, n = ids.shape[0]
    if out.shape[0] != n:
        raise ValueError("ids and out are of one length")
    if mask < 0:
        raise ValueError(f"a mask is not negative, not {mask}")
    with nogil:
        for i in range(n):
            out[i] = <int64_t>(_mix64(<uint64_t>ids[i]) & <uint64_t>mask)


def buckets(const int64_t[::1] ids, int64_t count, int64_t[::1] out):
    """``out[i] = (mix64(ids[i]) >> 32) % count``: the bucket of each id in a table of
    ``count`` buckets (:func:`aioparamsync.placement.bucket_of`)."""
    cdef Py_ssize_t i, n = ids.shape[0]
    if out.shape[0] != n:
        raise ValueError("ids and out are of one length")
    if count <= 0:
        raise ValueError(f"a table has one bucket or more, not {count}")
    cdef uint64_t c = <uint64_t>count
    with nogil:
        if c & (c - 1) == 0:  # (a power of two, as most tables have: no division)
            for i in range(n):
                out[i] = <int64_t>((_mix64(<uint64_t>ids[i]) >> 32) & (c - 1))
        else:
            for i in range(n):
                out[i] = <int64_t>((_mix64(<uint64_t>ids[i]) >> 32) % c)


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
            if i + AHEAD < n:
                APS_PREFETCH(&table[home[i + AHEAD] & mask])
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
    cdef Py_ssize_t i, line, n = slots.shape[0], width = source.shape[1]
    cdef const unsigned char* row
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
            if i + AHEAD < n:
                row = &source[slots[i + AHEAD], 0]
                line = 0
                while line < width:
                    APS_PREFETCH(row + line)
                    line += LINE
            memcpy(&out[where[i], 0], &source[slots[i], 0], width)


cdef Py_ssize_t _locate(
    list tables, list slot_ids, const int64_t* held, const int64_t[::1] ids,
    int64_t* slots, int64_t* owner,
) except -1:
    # slots[i] = the slot of ids[i] in the index of its bucket owner[i] (a slot below
    # held[owner[i]]), or -1; answers how many are -1. tables[b] and slot_ids[b]: bucket
    # b's index (as probe walks it), or None where the table holds no block of b.
    cdef Py_ssize_t i, b, n = ids.shape[0], count = len(tables), lost = 0
    if count <= 0 or len(slot_ids) != count:
        raise ValueError("tables and slot_ids are one per bucket, one or more")
    cdef const int64_t[::1] table
    cdef const int64_t[::1] sids
    cdef const int64_t** tab = <const int64_t**>calloc(count, sizeof(int64_t*))
    cdef const int64_t** sid = <const int64_t**>calloc(count, sizeof(int64_t*))
    cdef int64_t* masks = <int64_t*>calloc(count, sizeof(int64_t))
    cdef int64_t* homes = <int64_t*>malloc(max(n, 1) * sizeof(int64_t))
    cdef uint64_t h, c = <uint64_t>count
    cdef int64_t pos, slot, want, mask, steps
    try:
        if not (tab and sid and masks and homes):
            raise MemoryError()
        for b in range(count):
            if tables[b] is None:
                continue
            table, sids = tables[b], slot_ids[b]
            if table.shape[0] == 0 or table.shape[0] & (table.shape[0] - 1):
                raise ValueError("an index's buckets are a power of two")
            if held[b] > sids.shape[0]:
                raise ValueError("a block holds no more rows than its index has slots")
            tab[b], sid[b], masks[b] = &table[0], &sids[0], table.shape[0] - 1
        with nogil:
            for i in range(n):  # (each id's bucket and home, hashed once)
                h = _mix64(<uint64_t>ids[i])
                b = <Py_ssize_t>((h >> 32) & (c - 1) if c & (c - 1) == 0 else (h >> 32) % c)
                owner[i] = b
                homes[i] = <int64_t>(h & <uint64_t>masks[b])
            for i in range(n):  # (the walks, as probe's)
                if i + AHEAD < n and tab[owner[i + AHEAD]] != NULL:
                    APS_PREFETCH(&tab[owner[i + AHEAD]][homes[i + AHEAD]])
                b = owner[i]
                slots[i] = -1
                if tab[b] == NULL:
                    lost += 1
                    continue
                want, mask, pos = ids[i], masks[b], homes[i]
                steps = mask  # (a walk ends at an empty bucket, or after every one)
                while True:
                    slot = tab[b][pos]
                    if slot == -1:
                        break
                    if 0 <= slot < held[b] and sid[b][slot] == want:
                        slots[i] = slot
                        break
                    if steps == 0:
                        break
                    steps -= 1
                    pos = (pos + 1) & mask
                if slots[i] < 0:
                    lost += 1
        return lost
    finally:
        free(tab)
        free(sid)
        free(masks)
        free(homes)


def locate(
    list tables,
    list slot_ids,
    const int64_t[::1] held,
    const int64_t[::1] ids,
    int64_t[::1] slots,
    int64_t[::1] owner,
):
    """``owner[i]`` = the bucket of ``ids[i]`` (as :func:`buckets` computes it) and
    ``slots[i]`` = its slot in that bucket's index, or -1 where it has none; answers how
    many have none.

    ``tables[b]`` and ``slot_ids[b]`` are bucket ``b``'s index (as :func:`probe` walks
    it), or None where the table holds no block of ``b``; ``held[b]`` is how many of
    its slots are rows (a slot past it is not found). One walk for every bucket, as
    :func:`gather_rows` makes.
    """
    cdef Py_ssize_t n = ids.shape[0]
    if slots.shape[0] != n or owner.shape[0] != n:
        raise ValueError("ids, slots and owner are of one length")
    if held.shape[0] != len(tables):
        raise ValueError("held is one per bucket")
    if n == 0:
        return 0
    return _locate(tables, slot_ids, &held[0], ids, &slots[0], &owner[0])


def gather_rows(
    list tables,
    list slot_ids,
    list rows,
    const int64_t[::1] ids,
    unsigned char[:, ::1] out,
    int64_t[::1] missing,
):
    """``out[i] =`` the row of ``ids[i]`` in the block of its bucket, for rows of many
    blocks in one pass: answers how many ids have no row, their positions put in
    ``missing[:count]`` (ascending; their rows in ``out`` are left as they were).

    ``tables[b]``, ``slot_ids[b]`` and ``rows[b]`` are bucket ``b``'s block: its
    index's buckets and slots' ids (as :func:`probe` walks them) and its rows as
    bytes, or None where the table holds no block of ``b``; their length is the
    table's bucket count (the bucket of an id as :func:`buckets` computes it).
    What a pull spends where the rows of each bucket are read apart (ids cut by
    bucket, a walk and a copy a bucket, ``out`` written all over) is one walk here,
    and ``out`` written in order.
    """
    cdef Py_ssize_t i, b, line, n = ids.shape[0], width = out.shape[1]
    cdef Py_ssize_t count = len(tables), lost = 0
    if out.shape[0] != n or missing.shape[0] != n:
        raise ValueError("ids, out and missing are of one length")
    if count <= 0 or len(slot_ids) != count or len(rows) != count:
        raise ValueError("tables, slot_ids and rows are one per bucket, one or more")
    cdef const unsigned char[:, ::1] block
    cdef const unsigned char** first = <const unsigned char**>calloc(count, sizeof(void*))
    cdef int64_t* held = <int64_t*>calloc(count, sizeof(int64_t))
    cdef int64_t* slots = <int64_t*>malloc(max(n, 1) * sizeof(int64_t))
    cdef int64_t* owner = <int64_t*>malloc(max(n, 1) * sizeof(int64_t))
    cdef const unsigned char* row
    try:
        if not (first and held and slots and owner):
            raise MemoryError()
        for b in range(count):
            if tables[b] is None:
                continue
            block = rows[b]
            if block.shape[1] != width:
                raise ValueError("every block's rows are as wide as out's")
            # (a slot past the block's rows or ids would read out of bounds)
            held[b] = min(len(slot_ids[b]), block.shape[0])
            first[b] = &block[0, 0] if block.shape[0] else NULL
        _locate(tables, slot_ids, held, ids, slots, owner)
        with nogil:
            if width:
                for i in range(n):  # (the copies, as copy_rows')
                    if i + AHEAD < n and slots[i + AHEAD] >= 0:
                        row = first[owner[i + AHEAD]] + slots[i + AHEAD] * width
                        line = 0
                        while line < width:
                            APS_PREFETCH(row + line)
                            line += LINE
                    if slots[i] >= 0:
                        memcpy(&out[i, 0], first[owner[i]] + slots[i] * width, width)
            for i in range(n):
                if slots[i] < 0:
                    missing[lost] = i
                    lost += 1
        return lost
    finally:
        free(first)
        free(held)
        free(slots)
        free(owner)


ctypedef fused real:
    float
    double


def has_duplicates(const int64_t[::1] ids):
    """True if an id occurs twice in ``ids``: one pass, each id put in a hash set of its
    own (open addressing, by :func:`homes`' hash), where numpy sorts them."""
    cdef Py_ssize_t i, n = ids.shape[0]
    cdef uint64_t size = 16, mask, pos
    cdef int64_t want
    cdef bint found = False
    while size < 2 * <uint64_t>n:
        size *= 2
    mask = size - 1
    cdef unsigned char* used = <unsigned char*>calloc(size, 1)
    cdef int64_t* held = <int64_t*>malloc(size * sizeof(int64_t))
    if used == NULL or held == NULL:
        free(used)
        free(held)
        raise MemoryError()
    with nogil:
        for i in range(n):
            want = ids[i]
            pos = _mix64(<uint64_t>want) & mask
            while used[pos] and held[pos] != want:
                pos = (pos + 1) & mask
            if used[pos]:
                found = True
                break
            used[pos] = 1
            held[pos] = want
    free(used)
    free(held)
    return found


def first_seen(const int64_t[::1] ids, int64_t[::1] first, int64_t[::1] groups):
    """Number the distinct ids of ``ids`` in the order they first occur: ``groups[i]`` is
    the number of ``ids[i]``, ``first[g]`` the id numbered ``g``; answers how many there
    are. One pass, by a hash set of the ids (open addressing, by :func:`homes`' hash),
    where numpy's ``unique`` sorts them all."""
    cdef Py_ssize_t i, n = ids.shape[0], k = 0
    cdef uint64_t size = 16, mask, pos
    cdef int64_t want
    if first.shape[0] < n or groups.shape[0] < n:
        raise ValueError("first and groups have room for an entry an id")
    while size < 2 * <uint64_t>n:
        size *= 2
    mask = size - 1
    cdef int64_t* number = <int64_t*>malloc(size * sizeof(int64_t))
    if number == NULL:
        raise MemoryError()
    with nogil:
        for pos in range(size):
            number[pos] = -1
        for i in range(n):
            want = ids[i]
            pos = _mix64(<uint64_t>want) & mask
            while number[pos] >= 0 and first[number[pos]] != want:
                pos = (pos + 1) & mask
            if number[pos] < 0:
                number[pos] = k
                first[k] = want
                k += 1
            groups[i] = number[pos]
    free(number)
    return k


def sum_rows(
    const int64_t[::1] inverse,
    const real[:, ::1] grads,
    double[:, ::1] sums,
    Py_ssize_t step,
    const int64_t[::1] grad_rows=None,
):
    """``sums[inverse[i]] += grads[i]`` for every row ``i``, in float64, as
    :func:`aioparamsync.values.rows.sum_duplicates` adds them with numpy (a
    ``bincount`` a chunk of ``step`` rows: each row of a chunk summed from 0.0 in
    order, then into ``sums``): the same bits, with no array of a chunk's every sum
    (numpy makes and adds one of ``len(sums) * dim`` a chunk) and no float64 copy of
    the gradients. ``sums`` starts as zeros; its rows a chunk does not touch get
    nothing (numpy adds 0.0 to them, which changes no sum that is not -0.0, and
    none is: a sum from 0.0 is never -0.0).

    The rows are first put in order of their sums (a counting sort, which keeps each
    sum's rows in their order): each sum is then made whole, its chunk's part in a
    row of registers' worth, where adding into every sum at once would keep a chunk's
    part of all of them (``len(sums) * dim``) in memory. In one chunk (``step`` at
    least the rows), each row is added into its sum as it comes: the same additions.

    With ``grad_rows``, row ``i``'s gradient is ``grads[grad_rows[i]]`` (a table's
    push, summed where its gradients lie).
    """
    cdef Py_ssize_t i, j, p, r, at, chunk, part_of, n = inverse.shape[0], dim = grads.shape[1]
    cdef Py_ssize_t count = sums.shape[0], given = grads.shape[0]
    cdef bint indexed = grad_rows is not None
    if (grad_rows.shape[0] if indexed else given) != n or sums.shape[1] != dim:
        raise ValueError("inverse has a row a gradient, and sums are as wide as grads")
    if step < 1:
        raise ValueError(f"a chunk has one row or more, not {step}")
    for i in range(n):  # (checked first: a bad index raises, nothing is added)
        if not 0 <= inverse[i] < count:
            raise IndexError(f"row {i} sums into {inverse[i]}, out of {count}")
        if indexed and not 0 <= grad_rows[i] < given:
            raise IndexError(f"gradient {grad_rows[i]} is out of bounds")
    if n == 0 or dim == 0:
        return
    # (gradients read where they lie in a frame may be unaligned: each row is copied
    # into an aligned one first)
    cdef bint unaligned = (<size_t>&grads[0, 0]) % sizeof(real) != 0
    cdef int64_t* start = <int64_t*>calloc(count + 1, sizeof(int64_t))
    cdef int64_t* order = <int64_t*>malloc(n * sizeof(int64_t))
    cdef double* part = <double*>malloc(dim * sizeof(double))
    cdef real* line = <real*>malloc(dim * sizeof(real)) if unaligned else NULL
    if start == NULL or order == NULL or part == NULL or (unaligned and line == NULL):
        free(start)
        free(order)
        free(part)
        free(line)
        raise MemoryError()
    cdef const real* g
    cdef double* out
    with nogil:
        if step >= n:  # (one chunk: each row added into its sum as it comes, the same bits)
            for i in range(n):
                if i + AHEAD < n:  # (every line of the sum and, read by index, the row)
                    out = &sums[inverse[i + AHEAD], 0]
                    at = grad_rows[i + AHEAD] if indexed else -1
                    j = 0
                    while j < dim:
                        APS_PREFETCH(out + j)
                        if indexed:
                            APS_PREFETCH(&grads[at, 0] + j)
                        j += LINE // sizeof(double)
                g = &grads[grad_rows[i] if indexed else i, 0]
                if unaligned:
                    memcpy(line, g, dim * sizeof(real))
                    g = line
                out = &sums[inverse[i], 0]
                for j in range(dim):
                    out[j] += <double>g[j]
        else:  # (rows put in order of their sums, each sum made whole in turn)
            for i in range(n):  # (start[r + 1]: how many rows sum into r, then where r's end)
                start[inverse[i] + 1] += 1
            for r in range(count):
                start[r + 1] += start[r]
            for i in range(n):  # (start[r]: where r's next row goes, then where r's rows end)
                order[start[inverse[i]]] = i
                start[inverse[i]] += 1
            p = 0
            for r in range(count):
                out = &sums[r, 0]
                part_of = -1
                while p < start[r]:
                    i = order[p]
                    if p + AHEAD < n:
                        at = grad_rows[order[p + AHEAD]] if indexed else order[p + AHEAD]
                        g = &grads[at, 0]
                        j = 0
                        while j < dim:
                            APS_PREFETCH(g + j)
                            j += LINE // sizeof(real)
                    chunk = i // step
                    if chunk != part_of:
                        if part_of >= 0:
                            for j in range(dim):
                                out[j] += part[j]
                        for j in range(dim):
                            part[j] = 0.0
                        part_of = chunk
                    g = &grads[grad_rows[i] if indexed else i, 0]
                    if unaligned:
                        memcpy(line, g, dim * sizeof(real))
                        g = line
                    for j in range(dim):
                        part[j] += <double>g[j]
                    p += 1
                if part_of >= 0:
                    for j in range(dim):
                        out[j] += part[j]
    free(start)
    free(order)
    free(part)
    free(line)
