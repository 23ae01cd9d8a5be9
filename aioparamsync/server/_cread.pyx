# cython: language_level=3, boundscheck=False, wraparound=False
"""A small read answered in C: from the request's bytes to the reply's, in one call.

A ``get_parameters`` or ``pull_parameters`` that names a few small parameters, all held,
costs the node more in Python (the header, the arguments' structs, the handler's checks,
a ``Parameter`` per entry, the writer's walk) than in the system calls that carry it.
:func:`answer_read` does all of it in C for the common case: a framed binary call whose
request carries ``param_names`` and at most ``min_version``; every name held (no NUL in
it: neither a partition nor a manifest), at that version or above, each value under
``ZERO_COPY_MIN_BYTES`` (the writer copies those too). It answers the reply's bytes,
frame header and all, equal byte for byte to what the Python path (``ParameterService._pull``
then ``encode_message``) writes for the same request and table; anything else answers
None, and the Python path answers the call as always (with its errors and their
messages). ``tests/test_fast_read.py`` compares the two.

The callers decide whether the node may answer a read so (it is up and alone, and owes
the connection no write before this call): see :mod:`.fastread`.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
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
    T_BOOL = 2
    T_I32 = 8
    T_I64 = 10
    T_STRING = 11
    T_STRUCT = 12
    T_LIST = 15

cdef const char* _GET = b"get_parameters"
cdef const char* _PULL = b"pull_parameters"


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


cdef inline int _field(Out* out, uint8_t kind, int fid) except -1:
    _put_u8(out, kind)
    _put_u8(out, <uint8_t>(fid >> 8))
    return _put_u8(out, <uint8_t>fid)


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
        _field(out, T_STRING, 1)
        if not _put_str(out, entry.name):
            return False
        _field(out, T_STRING, 2)
        _put_u32(out, <uint32_t>view.len)
        _put(out, view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    if not _exact_i64(entry.version, &x) or x < -2147483648 or x > 2147483647:
        return False
    _field(out, T_I32, 3)
    _put_u32(out, <uint32_t>x)
    dtype = entry.dtype
    if dtype is not None:
        _field(out, T_STRING, 4)
        if not _put_str(out, dtype):
            return False
    shape = entry.shape
    if shape is not None:
        if not PyTuple_CheckExact(shape):
            return False
        n = len(shape)
        _field(out, T_LIST, 5)
        _put_u8(out, T_I64)
        _put_u32(out, <uint32_t>n)
        for i in range(n):
            if not _exact_i64(shape[i], &x):
                return False
            _put_i64(out, <uint64_t>x)
    origin = entry.origin
    if origin is not None:
        _field(out, T_STRING, 6)
        if not _put_str(out, origin):
            return False
    rule = entry.rule
    if rule is not None:
        encoded = encode_rule(rule)  # (the struct's fields and its STOP)
        _field(out, T_STRUCT, 10)
        _put(out, PyBytes_AS_STRING(encoded), PyBytes_GET_SIZE(encoded))
    _put_u8(out, T_STOP)
    return True


cdef inline bint _is_read(object payload) except -1:
    """Whether ``payload`` begins as a call of one of the two reads (a cheap first look)."""
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef Py_ssize_t name_len
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t*>view.buf
        if view.len < 8 + 14 or _u32(p) != _CALL:
            return False
        name_len = <Py_ssize_t>_u32(p + 4)
        return (name_len == 14 and memcmp(p + 8, _GET, 14) == 0) or (
            name_len == 15 and view.len >= 8 + 15 and memcmp(p + 8, _PULL, 15) == 0
        )
    finally:
        PyBuffer_Release(&view)


cdef class FastRead:
    """``service``'s fast read: ``fast_read(payload)`` is :func:`answer_read`'s answer
    with its table, while ``may(service)`` says the node may answer so; else None."""

    cdef object service, may, encode_rule

    def __init__(self, service, may, encode_rule):
        self.service = service
        self.may = may
        self.encode_rule = encode_rule

    def __call__(self, payload):
        if not _is_read(payload) or not self.may(self.service):
            return None
        table = self.service.store.table
        return answer_read(
            payload, table.by_name, table.timestamp, table.limits.max_names_per_request,
            self.encode_rule,
        )


def answer_read(object payload, dict entries, object timestamp, Py_ssize_t max_names,
                object encode_rule):
    """The reply to the read in ``payload`` (a framed binary message, without its frame
    header), framed, and whether it is a ``pull_parameters`` (else ``get_parameters``); or
    None, for the Python path.

    ``entries``: the table's, by name; ``timestamp``: the table's; ``max_names``: the most
    names one request may hold; ``encode_rule(rule)``: a rule's struct, written (its fields
    and STOP), as bytes.
    """
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef Py_ssize_t n, pos, name_len, count, i, length
    cdef uint8_t kind
    cdef int fid
    cdef bint pull, seen_names = False, seen_min = False
    cdef int64_t min_version = 0, version, ts
    cdef uint32_t seqid
    cdef Out out
    cdef list names = None
    cdef list found
    cdef set asked
    if not _exact_i64(timestamp, &ts):
        return None
    PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t*>view.buf
        n = view.len
        # The header: a call, of one of the two reads, by name.
        if n < 12 or _u32(p) != _CALL:
            return None
        name_len = <Py_ssize_t>_u32(p + 4)
        if name_len == 14 and n >= 8 + 14 and memcmp(p + 8, _GET, 14) == 0:
            pull = False
        elif name_len == 15 and n >= 8 + 15 and memcmp(p + 8, _PULL, 15) == 0:
            pull = True
        else:
            return None
        pos = 8 + name_len
        if n - pos < 4 + 3:
            return None
        seqid = _u32(p + pos)
        pos += 4
        # The arguments: field 1, the request, and nothing else.
        if p[pos] != T_STRUCT or p[pos + 1] != 0 or p[pos + 2] != 1:
            return None
        pos += 3
        while True:
            if pos >= n:
                return None
            kind = p[pos]
            if kind == T_STOP:
                pos += 1
                break
            if n - pos < 3:
                return None
            fid = (p[pos + 1] << 8) | p[pos + 2]
            pos += 3
            if fid == 1 and kind == T_LIST and not seen_names:
                seen_names = True
                if n - pos < 5 or p[pos] != T_STRING:
                    return None
                count = <Py_ssize_t>_u32(p + pos + 1)
                pos += 5
                if count < 0 or count > max_names or count > (n - pos) // 4:
                    return None
                names = []
                for i in range(count):
                    if n - pos < 4:
                        return None
                    length = <Py_ssize_t>_u32(p + pos)
                    pos += 4
                    if length < 0 or length > n - pos:
                        return None
                    if memchr(p + pos, 0, length) != NULL:
                        return None  # (a partition's or a manifest's key)
                    try:
                        name = PyUnicode_DecodeUTF8(<const char*>(p + pos), length, NULL)
                    except UnicodeDecodeError:
                        return None
                    names.append(name)
                    pos += length
            elif fid == 2 and kind == T_I32 and not seen_min:
                seen_min = True
                if n - pos < 4:
                    return None
                min_version = <int32_t>_u32(p + pos)
                pos += 4
            else:
                return None
        if not seen_names or pos + 1 != n or p[pos] != T_STOP:
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

    out.buf = <char*>malloc(256 + 64 * len(found))
    if out.buf == NULL:
        raise MemoryError()
    out.size, out.cap = 0, 256 + 64 * len(found)
    try:
        _put_u32(&out, 0)  # (the frame's length, at the end)
        _put_u32(&out, _REPLY)
        _put_u32(&out, <uint32_t>name_len)
        _put(&out, _PULL if pull else _GET, name_len)
        _put_u32(&out, seqid)
        _field(&out, T_STRUCT, 0)  # success
        _field(&out, T_LIST, 1)  # ParameterResponse.params
        _put_u8(&out, T_STRUCT)
        _put_u32(&out, <uint32_t>len(found))
        for entry in found:
            if not _put_entry(&out, entry, encode_rule):
                return None
        _field(&out, T_I64, 2)  # ParameterResponse.timestamp
        _put_i64(&out, <uint64_t>ts)
        _put_u8(&out, T_STOP)  # ParameterResponse
        _put_u8(&out, T_STOP)  # the result
        (<uint8_t*>out.buf)[0] = <uint8_t>((out.size - 4) >> 24)
        (<uint8_t*>out.buf)[1] = <uint8_t>((out.size - 4) >> 16)
        (<uint8_t*>out.buf)[2] = <uint8_t>((out.size - 4) >> 8)
        (<uint8_t*>out.buf)[3] = <uint8_t>(out.size - 4)
        return PyBytes_FromStringAndSize(out.buf, out.size), pull
    finally:
        free(out.buf)
