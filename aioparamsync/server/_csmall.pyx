# cython: language_level=3, boundscheck=False, wraparound=False
"""Small calls answered in C: from the request's bytes to the reply's, in one call.

A small read or update costs the node more in Python (the header, the arguments'
structs, the handler's checks, the store's, a ``Parameter`` per entry, the writer's walk)
than the system calls that carry it. :class:`FastCalls` does it all in C for the common
cases, each equal byte for byte (and, for an update, entry for entry) to what the Python
path makes of the same call and table; anything else answers None, and the Python path
answers the call as always, with its errors and their messages:

* a ``get_parameters`` or ``pull_parameters`` (``_answer_read``) whose request carries
  ``param_names`` and at most ``min_version``; every name held (no NUL in it: neither a
  partition nor a manifest), at that version or above, each value under
  ``ZERO_COPY_MIN_BYTES`` (the writer copies those too): the reply ``ParameterService._pull``
  then ``encode_message`` make;
* a founding client's ``update_parameters`` (``_apply_update``): parameters of a name,
  data and at most a version, and the update's timestamp; names the store takes (not
  reserved, not too long, none twice, no NUL), none stored as partitions, data that fits
  what is stored (plain bytes over an array: its size) and needs no cut: the entries
  ``ParameterTable.apply`` makes, stored by the table and fed to the store's subscribers
  as the writer does (``ParameterStore.applied_now``), and its empty reply.

The callers decide whether the node may answer a call so (it is up and alone, and owes
the connection nothing before it; for an update, the writer has nothing queued): see
:mod:`.smallcalls`. ``tests/test_small_calls.py`` compares the two paths.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.pyport cimport PY_SSIZE_T_MAX
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memchr, memcmp, memcpy

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    bint PyUnicode_CheckExact(object)
    bint PyLong_CheckExact(object)
    bint PyTuple_CheckExact(object)
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1

from ..wire.writer import ZERO_COPY_MIN_BYTES

# (a value of this size or more the writer sends by reference, not copied: so does the
# Python path, here alone)
cdef Py_ssize_t _SMALL = ZERO_COPY_MIN_BYTES
cdef uint32_t _CALL = 0x80010001
cdef uint32_t _REPLY = 0x80010002

# Thrift's binary type codes
cdef enum:
    T_STOP = 0
    T_I32 = 8
    T_I64 = 10
    T_STRING = 11
    T_STRUCT = 12
    T_LIST = 15

cdef const char* _GET = b"get_parameters"
cdef const char* _PULL = b"pull_parameters"
cdef const char* _UPDATE = b"update_parameters"
# What a call is, by its header (_kind)
cdef enum:
    OTHER = 0
    GET = 1
    PULL = 2
    UPDATE = 3


cdef inline uint32_t _u32(const uint8_t* p) noexcept:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef struct Out:
    char* buf
    Py_ssize_t size
    Py_ssize_t cap


cdef int _grow(Out* out, Py_ssize_t n) except -1:
    cdef Py_ssize_t want = out.size + n
    cdef Py_ssize_t cap
    cdef char* buf
    if want <= out.cap:
        return 0
    cap = max(want, 2 * out.cap)
    buf = <char*>realloc(out.buf, cap)
    if buf == NULL:
        raise MemoryError()
    out.buf, out.cap = buf, cap
    return 0


cdef inline int _put(Out* out, const void* p, Py_ssize_t n) except -1:
    _grow(out, n)
    memcpy(out.buf + out.size, p, n)
    out.size += n
    return 0


cdef inline int _put_u8(Out* out, uint8_t v) except -1:
    return _put(out, &v, 1)


cdef inline int _put_u32(Out* out, uint32_t u) except -1:
    cdef uint8_t b[4]
    b[0] = u >> 24
    b[1] = u >> 16
    b[2] = u >> 8
    b[3] = u
    return _put(out, b, 4)


cdef inline int _put_i64(Out* out, uint64_t u) except -1:
    cdef uint8_t b[8]
    cdef int k
    for k in range(8):
        b[7 - k] = <uint8_t>(u >> (8 * k))
    return _put(out, b, 8)


cdef inline int _put_field(Out* out, uint8_t kind, int fid) except -1:
    _put_u8(out, kind)
    _put_u8(out, <uint8_t>(fid >> 8))
    return _put_u8(out, <uint8_t>fid)


cdef object _framed(Out* out):
    """The reply written in ``out`` (after 4 bytes kept for it), its frame's length set."""
    cdef Py_ssize_t size = out.size - 4
    (<uint8_t*>out.buf)[0] = <uint8_t>(size >> 24)
    (<uint8_t*>out.buf)[1] = <uint8_t>(size >> 16)
    (<uint8_t*>out.buf)[2] = <uint8_t>(size >> 8)
    (<uint8_t*>out.buf)[3] = <uint8_t>size
    return PyBytes_FromStringAndSize(out.buf, out.size)


cdef inline bint _put_str(Out* out, object s) except -1:
    """A str as the writer writes it (False: not an exact str, for the Python path)."""
    cdef Py_ssize_t n
    cdef const char* p
    if not PyUnicode_CheckExact(s):
        return False
    try:
        p = PyUnicode_AsUTF8AndSize(s, &n)
    except UnicodeEncodeError:
        return False  # (a lone surrogate: the Python path says what is wrong)
    _put_u32(out, <uint32_t>n)
    _put(out, p, n)
    return True


cdef inline bint _exact_i64(object v, int64_t* x) except -1:
    cdef int overflow = 0
    if not PyLong_CheckExact(v):
        return False
    x[0] = PyLong_AsLongLongAndOverflow(v, &overflow)
    return not overflow


cdef bint _put_entry(Out* out, object entry, object encode_rule) except -1:
    """One entry as its ``Parameter`` (Entry.to_parameter), written; False: not here."""
    cdef Py_buffer view
    cdef int64_t x
    cdef Py_ssize_t i, n
    data = entry.data
    if type(data) is not memoryview:
        return False
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len >= _SMALL:
            return False
        _put_field(out, T_STRING, 1)
        if not _put_str(out, entry.name):
            return False
        _put_field(out, T_STRING, 2)
        _put_u32(out, <uint32_t>view.len)
        _put(out, view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    if not _exact_i64(entry.version, &x) or x < -2147483648 or x > 2147483647:
        return False
    _put_field(out, T_I32, 3)
    _put_u32(out, <uint32_t>x)
    dtype = entry.dtype
    if dtype is not None:
        _put_field(out, T_STRING, 4)
        if not _put_str(out, dtype):
            return False
    shape = entry.shape
    if shape is not None:
        if not PyTuple_CheckExact(shape):
            return False
        n = len(shape)
        _put_field(out, T_LIST, 5)
        _put_u8(out, T_I64)
        _put_u32(out, <uint32_t>n)
        for i in range(n):
            if not _exact_i64(shape[i], &x):
                return False
            _put_i64(out, <uint64_t>x)
    origin = entry.origin
    if origin is not None:
        _put_field(out, T_STRING, 6)
        if not _put_str(out, origin):
            return False
    rule = entry.rule
    if rule is not None:
        encoded = encode_rule(rule)  # (the struct's fields and its STOP)
        _put_field(out, T_STRUCT, 10)
        _put(out, PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded))
    _put_u8(out, T_STOP)
    return True


cdef inline int _out_init(Out* out, Py_ssize_t cap) except -1:
    out.buf = <char*>malloc(cap)
    if out.buf == NULL:
        raise MemoryError()
    out.size, out.cap = 0, cap
    return 0


cdef inline int _reply_begin(Out* out, const char* name, Py_ssize_t name_len,
                             uint32_t seqid) except -1:
    """A reply's header, after 4 bytes kept for its frame's length (see _framed)."""
    _put_u32(out, 0)
    _put_u32(out, _REPLY)
    _put_u32(out, <uint32_t>name_len)
    _put(out, name, name_len)
    return _put_u32(out, seqid)


# Reading a call. Each answers the position after what it read, or -1 where the message
# is not one this module answers (it ends first, or holds another thing there).

cdef inline Py_ssize_t _args_at(const uint8_t* p, Py_ssize_t n, Py_ssize_t pos,
                                uint32_t* seqid) noexcept:
    """After the method's name: the seqid, then the arguments' field 1, a struct."""
    if n - pos < 4 + 3:
        return -1
    seqid[0] = _u32(p + pos)
    pos += 4
    if p[pos] != T_STRUCT or p[pos + 1] != 0 or p[pos + 2] != 1:
        return -1
    return pos + 3


cdef inline Py_ssize_t _field_at(const uint8_t* p, Py_ssize_t n, Py_ssize_t pos,
                                 uint8_t* kind, int* fid) noexcept:
    """A field's header: its type (T_STOP: the struct ends) and id."""
    if pos >= n:
        return -1
    kind[0] = p[pos]
    if kind[0] == T_STOP:
        return pos + 1
    if n - pos < 3:
        return -1
    fid[0] = (p[pos + 1] << 8) | p[pos + 2]
    return pos + 3


cdef inline Py_ssize_t _list_at(const uint8_t* p, Py_ssize_t n, Py_ssize_t pos, uint8_t elem,
                                Py_ssize_t most, Py_ssize_t least, Py_ssize_t* count) noexcept:
    """A list's header: of ``elem`` elements, at most ``most`` (each ``least`` bytes or more)."""
    if n - pos < 5 or p[pos] != elem:
        return -1
    count[0] = <Py_ssize_t>_u32(p + pos + 1)
    pos += 5
    if count[0] > most or count[0] > (n - pos) // least:
        return -1
    return pos


cdef inline Py_ssize_t _string_at(const uint8_t* p, Py_ssize_t n, Py_ssize_t pos,
                                  Py_ssize_t* length) noexcept:
    """A string's or a binary's length; its bytes at the position answered."""
    if n - pos < 4:
        return -1
    length[0] = <Py_ssize_t>_u32(p + pos)  # (a negative i32 is past the end too)
    pos += 4
    if length[0] > n - pos:
        return -1
    return pos


cdef object _name(const uint8_t* p, Py_ssize_t length):
    """The name of ``length`` bytes at ``p``; None where it holds NUL (a partition's or a
    manifest's key) or is no UTF-8 (the Python path says what is wrong)."""
    if memchr(p, 0, length) != NULL:
        return None
    try:
        return PyUnicode_DecodeUTF8(<const char*>p, length, NULL)
    except UnicodeDecodeError:
        return None


cdef inline int _kind(object payload) except -1:
    """Which call ``payload`` begins as (a cheap first look: OTHER, GET, PULL, UPDATE)."""
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef Py_ssize_t name_len
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t*>view.buf
        if view.len < 8 + 17 or _u32(p) != _CALL:
            return OTHER
        name_len = <Py_ssize_t>_u32(p + 4)
        if name_len == 14 and memcmp(p + 8, _GET, 14) == 0:
            return GET
        if name_len == 15 and memcmp(p + 8, _PULL, 15) == 0:
            return PULL
        if name_len == 17 and memcmp(p + 8, _UPDATE, 17) == 0:
            return UPDATE
        return OTHER
    finally:
        PyBuffer_Release(&view)


cdef class FastCalls:
    """``service``'s small calls in C: ``fast(payload)`` is the framed reply to the call in
    ``payload`` (a framed binary message's) and the name of its method, or None. A read
    is answered while ``may_read(service)``, an update while ``may_write(service)``;
    ``encode_rule(rule)`` writes a rule's struct, ``make_entry(...)`` makes an ``Entry``."""

    cdef object service, may_read, may_write, encode_rule, make_entry

    def __init__(self, service, may_read, may_write, encode_rule, make_entry):
        self.service = service
        self.may_read = may_read
        self.may_write = may_write
        self.encode_rule = encode_rule
        self.make_entry = make_entry

    def __call__(self, payload):
        cdef int kind = _kind(payload)
        if kind == OTHER:
            return None
        if kind == UPDATE:
            if not self.may_write(self.service):
                return None
            return _apply_update(payload, self.service, self.make_entry)
        if not self.may_read(self.service):
            return None
        table = self.service.store.table
        return _answer_read(
            payload, kind == PULL, table.by_name, table.timestamp,
            table.limits.max_names_per_request, self.encode_rule,
        )


cdef object _answer_read(object payload, bint pull, dict entries, object timestamp,
                         Py_ssize_t max_names, object encode_rule):
    """The reply to the read in ``payload`` (a framed binary message, without its frame
    header; a ``pull_parameters`` or, not ``pull``, a ``get_parameters``: see _kind),
    framed, and the method's name; or None, for the Python path.

    ``entries``: the table's, by name; ``timestamp``: the table's; ``max_names``: the most
    names one request may hold; ``encode_rule(rule)``: a rule's struct, written (its fields
    and STOP), as bytes.
    """
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef Py_ssize_t n, pos, name_len, count, i, length
    cdef uint8_t kind
    cdef int fid = 0
    cdef bint seen_names = False, seen_min = False
    cdef int64_t min_version = 0, version, ts
    cdef uint32_t seqid
    cdef Out out
    cdef list names = None
    cdef list found
    cdef set asked
    if not _exact_i64(timestamp, &ts):
        return None
    name_len = 15 if pull else 14
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t*>view.buf
        n = view.len
        pos = _args_at(p, n, 8 + name_len, &seqid)
        while pos >= 0:
            pos = _field_at(p, n, pos, &kind, &fid)
            if pos < 0 or kind == T_STOP:
                break
            if fid == 1 and kind == T_LIST and not seen_names:
                seen_names = True
                pos = _list_at(p, n, pos, T_STRING, max_names, 4, &count)
                if pos < 0:
                    return None
                names = []
                for i in range(count):
                    pos = _string_at(p, n, pos, &length)
                    if pos < 0:
                        return None
                    name = _name(p + pos, length)
                    if name is None:
                        return None
                    names.append(name)
                    pos += length
            elif fid == 2 and kind == T_I32 and not seen_min and n - pos >= 4:
                seen_min = True
                min_version = <int32_t>_u32(p + pos)
                pos += 4
            else:
                return None
        if pos < 0 or not seen_names or pos + 1 != n or p[pos] != T_STOP:
            return None
    finally:
        PyBuffer_Release(&view)

    # The entries: every name held, at min_version or above; a name asked twice, once.
    found = []
    asked = set() if len(names) > 1 else None
    for name in names:
        entry = entries.get(name)
        if entry is None:
            return None
        if not _exact_i64(entry.version, &version) or version < min_version:
            return None
        if asked is not None:
            if name in asked:
                continue
            asked.add(name)
        found.append(entry)

    _out_init(&out, 256 + 64 * len(found))
    try:
        _reply_begin(&out, _PULL if pull else _GET, name_len, seqid)
        _put_field(&out, T_STRUCT, 0)  # success
        _put_field(&out, T_LIST, 1)  # ParameterResponse.params
        _put_u8(&out, T_STRUCT)
        _put_u32(&out, <uint32_t>len(found))
        for entry in found:
            if not _put_entry(&out, entry, encode_rule):
                return None
        _put_field(&out, T_I64, 2)  # ParameterResponse.timestamp
        _put_i64(&out, <uint64_t>ts)
        _put_u8(&out, T_STOP)  # ParameterResponse
        _put_u8(&out, T_STOP)  # the result
        return _framed(&out), "pull_parameters" if pull else "get_parameters"
    finally:
        free(out.buf)


cdef object _MAX_VERSION = 2**31 - 1
cdef str _RESERVED = "__metadata__"


cdef object _apply_update(object payload, object service, object make_entry):
    """Apply the founding ``update_parameters`` in ``payload`` (a framed binary message,
    without its frame header: see _kind) to ``service``'s store, and answer its reply,
    framed, and the method's name; or None, with nothing applied, for the Python path.
    ``make_entry``: makes a store's ``Entry``."""
    cdef Py_buffer view
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        return _update_at(payload, service, make_entry, <const uint8_t*>view.buf, view.len)
    finally:
        PyBuffer_Release(&view)


cdef object _update_at(object payload, object service, object make_entry,
                       const uint8_t* p, Py_ssize_t n):
    """:func:`_apply_update` of the message at ``p``, ``n`` bytes (``payload``'s, held)."""
    cdef Py_ssize_t pos, count, i, length, nbytes, whole_len, start
    cdef Py_ssize_t max_params, max_name_bytes, max_whole
    cdef uint8_t kind, inner
    cdef int fid = 0
    cdef int64_t ts = 0, given
    cdef uint32_t seqid
    cdef bint seen_params = False, seen_ts = False, has_name, has_data, has_version
    cdef list found = None  # (name, start, length, given version) of each parameter
    cdef Out out
    store = service.store
    table = store.table
    limits = table.limits
    max_params = limits.max_params_per_update
    max_name_bytes = limits.max_name_bytes
    partition_bytes = service.partitioned.partition_bytes
    max_whole = partition_bytes if partition_bytes else PY_SSIZE_T_MAX
    whole = payload.obj  # (the frame's own bytes: a value kept is a view of them, or a copy)
    if type(whole) is not bytes:
        return None
    whole_len = PyBytes_GET_SIZE(whole)
    pos = _args_at(p, n, 8 + 17, &seqid)
    while pos >= 0:
        pos = _field_at(p, n, pos, &kind, &fid)
        if pos < 0 or kind == T_STOP:
            break
        if fid == 1 and kind == T_LIST and not seen_params:
            seen_params = True
            pos = _list_at(p, n, pos, T_STRUCT, max_params, 8, &count)
            if pos < 0:
                return None
            found = []
            for i in range(count):
                has_name = has_data = has_version = False
                given = 0
                while True:
                    pos = _field_at(p, n, pos, &inner, &fid)
                    if pos < 0:
                        return None
                    if inner == T_STOP:
                        break
                    if inner == T_STRING and (fid == 1 or fid == 2):
                        pos = _string_at(p, n, pos, &length)
                        if pos < 0:
                            return None
                        if fid == 1:
                            if has_name or length == 0 or length > max_name_bytes:
                                return None
                            name = _name(p + pos, length)
                            if name is None:
                                return None
                            has_name = True
                        else:
                            if has_data or length > max_whole:
                                return None
                            start, nbytes = pos, length
                            has_data = True
                        pos += length
                    elif inner == T_I32 and fid == 3 and not has_version and n - pos >= 4:
                        given = <int32_t>_u32(p + pos)
                        pos += 4
                        has_version = True
                    else:
                        return None
                if not (has_name and has_data):
                    return None
                found.append((name, start, nbytes, given))
        elif fid == 2 and kind == T_I64 and not seen_ts and n - pos >= 8:
            ts = <int64_t>((<uint64_t>_u32(p + pos) << 32) | _u32(p + pos + 4))
            pos += 8
            seen_ts = True
        else:
            return None
    if pos < 0 or not (seen_params and seen_ts) or pos + 1 != n or p[pos] != T_STOP:
        return None

    # What ParameterTable.check refuses (and apply does): none of it here.
    entries = table.by_name
    origin = table.origin
    names = set() if len(found) > 1 else None
    made = []
    for name, start, nbytes, given in found:
        if name == _RESERVED:
            return None
        if names is not None:
            if name in names:
                return None
            names.add(name)
        current = entries.get(name)
        dtype = shape = rule = None
        version = 1 if given < 1 else given
        if current is not None:
            stored = current.version
            if stored >= _MAX_VERSION:
                return None
            if current.dtype is not None:  # (plain bytes over an array: its size)
                if nbytes != current.data.nbytes:
                    return None
                dtype, shape = current.dtype, current.shape
            rule = current.rule
            version = max(stored + 1, given)
        if whole_len * 3 > max(nbytes, 0) * 4:  # (as store.buffers.kept decides)
            data = memoryview(PyBytes_FromStringAndSize(<const char*>(p + start), nbytes))
        else:
            data = payload[start : start + nbytes]
        made.append(make_entry(name, data, version, dtype, shape, origin, rule))
    store.applied_now(made, ts)

    _out_init(&out, 64)
    try:
        _reply_begin(&out, _UPDATE, 17, seqid)
        _put_u8(&out, T_STOP)  # the result: void
        return _framed(&out), "update_parameters"
    finally:
        free(out.buf)
