# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The binary protocol's struct reader and writer, compiled.

The same contract as the code :mod:`.binary_codegen` makes for each struct
class, and built the same way: the common case is done here, in C, and
anything unusual is left to the pure-Python walk of :class:`.binary.BinaryReader`
and :class:`.binary.BinaryWriter`, so that its outcome (a value, or an error
and its message) is the pure walk's.

Reading: a field whose header, type and bytes are all as expected is read
here; at anything else (a field unknown or of another type, a length that is
negative or runs past the end, invalid UTF-8, a container too deep) the rest
of the struct is read by ``_read_fields``, the general walk, from that field
on. Checks that count (``_check_count_of``: container sizes and the elements
of a message) are the pure methods, called from here.

Writing: values of the usual types (str, small bytes, int in range, float,
True/False, lists and maps of them, nested structs) are written here; any
other value goes to the writer's own methods (``_write_bytes``,
``_write_value``, the packers), which write it or raise what the pure code
raises. A binary of ``ZERO_COPY_MIN_BYTES`` or more always goes to
``_write_bytes``, which sends it by reference.

:func:`read_struct` and :func:`write_struct` are installed as the methods of
those classes by :mod:`.binary` unless the pure path is asked for (see
:mod:`aioparamsync._ext`).
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_FromLongLong
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from thriftpy2.thrift import TType

from ..errors import LocalProtocolError, RemoteProtocolError
from .binary_codegen import _PACK_LIST_I64S
from .plan import _plan
from .protocol import _S_LIST, _S_MAP, _pack_i32, _pack_i64
from .reader import MAX_DEPTH
from .writer import ZERO_COPY_MIN_BYTES

import struct as _struct

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1
    bint PyLong_CheckExact(object)
    bint PyFloat_CheckExact(object)
    bint PyBytes_CheckExact(object)
    bint PyUnicode_CheckExact(object)
    bint PyList_CheckExact(object)
    bint PyDict_CheckExact(object)
    ctypedef struct PyByteArrayObject:
        Py_ssize_t ob_alloc  # (the bytes allocated; the size is what is used of them)

__all__ = ["read_message_begin", "read_struct", "write_struct"]

# How a field is read and written here.
cdef enum Kind:
    K_OTHER = 0   # by the pure methods
    K_BINARY
    K_STRING
    K_I32
    K_I64
    K_BOOL
    K_BYTE
    K_I16
    K_DOUBLE
    K_STRUCT
    K_LIST_STRUCT
    K_LIST_I64
    K_LIST_I32
    K_LIST_STRING
    K_LIST_BINARY
    K_MAP_STRING_I32
    K_MAP_STRING_I64

cdef int T_STOP = TType.STOP
cdef int T_BOOL = TType.BOOL
cdef int T_BYTE = TType.BYTE
cdef int T_DOUBLE = TType.DOUBLE
cdef int T_I16 = TType.I16
cdef int T_I32 = TType.I32
cdef int T_I64 = TType.I64
cdef int T_STRING = TType.STRING
cdef int T_STRUCT = TType.STRUCT
cdef int T_MAP = TType.MAP
cdef int T_SET = TType.SET
cdef int T_LIST = TType.LIST
cdef int T_BINARY = TType.BINARY

cdef int _MAX_DEPTH = MAX_DEPTH
cdef Py_ssize_t _SMALL = ZERO_COPY_MIN_BYTES
_DEEP = f"message nests deeper than {MAX_DEPTH} levels"
_list_header = _S_LIST.pack
_map_header = _S_MAP.pack


cdef inline int _min_size(int wire) noexcept:
    """BinaryReader.MIN_SIZE.get(wire, 1)."""
    if wire == T_I16:
        return 2
    if wire == T_I32 or wire == T_STRING:
        return 4
    if wire == T_I64 or wire == T_DOUBLE:
        return 8
    if wire == T_LIST or wire == T_SET:
        return 5
    if wire == T_MAP:
        return 6
    return 1


cdef class _Fields:
    """A struct class's plan (see :mod:`.plan`), in C arrays for the walks here."""

    cdef object cls
    cdef object new      # cls.__new__, where the struct can be made without its __init__
    cdef dict defaults   # then: its fields' defaults, in the order __init__ sets them
    cdef object by_id
    cdef tuple required
    cdef list names
    cdef list subs       # the normalised sub-spec of each field (for the pure methods)
    cdef list classes    # the struct class of a struct field or a list's elements, else None
    cdef list headers    # the binary field header, or None
    cdef list missing    # the error when a required field is missing (writing)
    cdef list no_header
    cdef int n
    cdef int* fid
    cdef int* ttype
    cdef int* wire
    cdef int* kind
    cdef int* ewire      # a list's element wire type, a map's key wire type
    cdef int* vwire      # a map's value wire type
    cdef bint* is_required

    def __cinit__(self):
        self.n = 0
        self.fid = self.ttype = self.wire = self.kind = self.ewire = self.vwire = NULL
        self.is_required = NULL

    def __dealloc__(self):
        free(self.fid)
        free(self.ttype)
        free(self.wire)
        free(self.kind)
        free(self.ewire)
        free(self.vwire)
        free(self.is_required)

    cdef int find(self, int fid, int hint) noexcept:
        """The index of field ``fid`` (looked for at ``hint`` first), or -1."""
        cdef int i
        if hint < self.n and self.fid[hint] == fid:
            return hint
        for i in range(self.n):
            if self.fid[i] == fid:
                return i
        return -1


cdef dict _FIELDS = {}
# The kind of a field of each scalar type.
cdef dict _SCALAR_KINDS = {
    T_BINARY: K_BINARY,
    T_STRING: K_STRING,
    T_I32: K_I32,
    T_I64: K_I64,
    T_BOOL: K_BOOL,
    T_BYTE: K_BYTE,
    T_I16: K_I16,
    T_DOUBLE: K_DOUBLE,
}


cdef _Fields _fields_of(object cls):
    cdef _Fields f = _FIELDS.get(cls)
    if f is not None:
        return f
    plan = _plan(cls)  # (raises, for an object that is no struct, what the pure code raises)
    f = _Fields()
    f.cls = cls
    f.by_id = plan.by_id
    init = getattr(cls.__init__, "__code__", None)
    spec = getattr(cls, "default_spec", None)
    if (
        init is not None
        and init.co_filename == f"<generated {cls.__name__}.__init__>"
        and spec is not None
        and [name for name, _ in spec] == list(init.co_varnames[1 : init.co_argcount])
        and "__setattr__" not in cls.__dict__
    ):
        # thriftpy2's generated __init__ (each argument set as the attribute of
        # its name, defaults as declared): made with the same attributes, in the
        # same order, without calling it.
        f.new = cls.__new__
        f.defaults = dict(spec)
    f.required = plan.required
    f.names, f.subs, f.classes, f.headers, f.missing, f.no_header = [], [], [], [], [], []
    cdef int n = len(plan.in_order)
    f.fid = <int*>malloc(n * sizeof(int) + 1)
    f.ttype = <int*>malloc(n * sizeof(int) + 1)
    f.wire = <int*>malloc(n * sizeof(int) + 1)
    f.kind = <int*>malloc(n * sizeof(int) + 1)
    f.ewire = <int*>malloc(n * sizeof(int) + 1)
    f.vwire = <int*>malloc(n * sizeof(int) + 1)
    f.is_required = <bint*>malloc(n * sizeof(bint) + 1)
    if (f.fid == NULL or f.ttype == NULL or f.wire == NULL or f.kind == NULL
            or f.ewire == NULL or f.vwire == NULL or f.is_required == NULL):
        raise MemoryError()
    f.n = n
    cdef int i = 0, ttype, kind
    for name, fid, ttype_, sub, required, header in plan.in_order:
        ttype = int(ttype_)
        wire = plan.by_id[fid][0]
        f.names.append(name)
        f.subs.append(sub)
        f.headers.append(header)
        f.missing.append(f"required field {cls.__name__}.{name} is missing")
        f.no_header.append(f"field {cls.__name__}.{name}: no binary field header")
        f.fid[i] = fid if -(2**15) <= fid < 2**15 else 2**16  # (never matches a header)
        f.ttype[i] = ttype
        f.wire[i] = int(wire) if -128 <= wire < 128 else 2**16
        f.is_required[i] = bool(required)
        f.ewire[i] = f.vwire[i] = -1
        kind = _SCALAR_KINDS.get(ttype, K_OTHER)
        klass = None
        if ttype == T_STRUCT:
            kind, klass = K_STRUCT, sub
        elif ttype == T_LIST and -128 <= int(sub[2]) < 128:
            f.ewire[i] = int(sub[2])
            if sub[0] == T_STRUCT:
                kind, klass = K_LIST_STRUCT, sub[1]
            elif sub[0] == T_I64:
                kind = K_LIST_I64
            elif sub[0] == T_I32:
                kind = K_LIST_I32
            elif sub[0] == T_STRING:
                kind = K_LIST_STRING
            elif sub[0] == T_BINARY:
                kind = K_LIST_BINARY
        elif (ttype == T_MAP and sub[0] == T_STRING and sub[3] in (T_I32, T_I64)
                and -128 <= int(sub[2]) < 128 and -128 <= int(sub[5]) < 128):
            f.ewire[i], f.vwire[i] = int(sub[2]), int(sub[5])
            kind = K_MAP_STRING_I32 if sub[3] == T_I32 else K_MAP_STRING_I64
        f.kind[i] = kind
        f.classes.append(klass)
        i += 1
    _FIELDS[cls] = f
    return f


# ---------------------------------------------------------------------------
# Reading

cdef inline int32_t _i32_at(const uint8_t* p) noexcept:
    return <int32_t>((<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3])


cdef inline int64_t _i64_at(const uint8_t* p) noexcept:
    cdef uint64_t v = 0
    cdef int k
    for k in range(8):
        v = (v << 8) | p[k]
    return <int64_t>v


cdef inline int16_t _i16_at(const uint8_t* p) noexcept:
    return <int16_t>((<uint32_t>p[0] << 8) | p[1])


def read_message_begin(self):
    """A message's header (BinaryReader.read_message_begin): at once where it is all
    there and well formed, else by the pure method, which says what is wrong."""
    cdef Py_buffer view
    cdef Py_ssize_t pos = self.pos, end = self.end, n
    cdef uint32_t word
    cdef const uint8_t* data
    if PyObject_GetBuffer(self.buf, &view, PyBUF_SIMPLE) < 0:
        raise BufferError("the reader's buffer is not contiguous")
    try:
        data = <const uint8_t*>view.buf
        if pos + 8 <= end:
            word = <uint32_t>_i32_at(data + pos)
            n = _i32_at(data + pos + 4)
            if (word & 0xFFFF0000 == 0x80010000 and 0 <= n <= self.name_limit
                    and pos + 8 + n + 4 <= end):
                try:
                    name = PyUnicode_DecodeUTF8(<const char*>data + pos + 8, n, NULL)
                except UnicodeDecodeError:
                    pass
                else:
                    self.pos = pos + 8 + n + 4
                    return name, <int>(word & 0xFF), _i32_at(data + pos + 8 + n)
    finally:
        PyBuffer_Release(&view)
    from .binary import PURE_READ_MESSAGE_BEGIN  # (imported by now: it installs this)

    return PURE_READ_MESSAGE_BEGIN(self)


def read_struct(self, cls):
    """Read a struct of class ``cls`` at the reader's position (BinaryReader.read_struct)."""
    cdef Py_buffer view
    buf = self.buf
    if PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0:
        raise BufferError("the reader's buffer is not contiguous")
    try:
        return _read(self, _fields_of(cls), buf, <const uint8_t*>view.buf, self.end)
    finally:
        PyBuffer_Release(&view)


cdef object _read(object self, _Fields f, object buf, const uint8_t* data, Py_ssize_t end):
    cdef int depth = self.depth + 1
    if depth > _MAX_DEPTH:
        raise RemoteProtocolError(_DEEP)
    self.depth = depth
    cdef Py_ssize_t pos = self.pos, p, n, count, j
    cdef int i, wire, fid, hint = 0, kind, vsize
    cdef bint general = False
    cdef dict values = {}
    cdef list items
    cdef dict found
    cdef _Fields sub
    cdef double d
    cdef uint64_t bits
    while True:
        if pos >= end:
            general = True
            break
        wire = data[pos]
        if wire == T_STOP:
            pos += 1
            break
        if pos + 3 > end:
            general = True
            break
        fid = _i16_at(data + pos + 1)
        i = f.find(fid, hint)
        if i < 0 or f.wire[i] != wire:
            general = True  # (the general walk steps over it)
            break
        hint = i + 1
        p = pos + 3
        kind = f.kind[i]
        if kind == K_BINARY or kind == K_STRING:
            if p + 4 > end:
                general = True
                break
            n = _i32_at(data + p)
            p += 4
            if n < 0 or p + n > end:
                general = True
                break
            if kind == K_BINARY:
                value = buf[p : p + n]
            else:
                try:
                    value = PyUnicode_DecodeUTF8(<const char*>data + p, n, NULL)
                except UnicodeDecodeError:
                    general = True
                    break
            p += n
        elif kind == K_I32:
            if p + 4 > end:
                general = True
                break
            value = _i32_at(data + p)
            p += 4
        elif kind == K_I64:
            if p + 8 > end:
                general = True
                break
            value = PyLong_FromLongLong(_i64_at(data + p))
            p += 8
        elif kind == K_BOOL or kind == K_BYTE:
            if p + 1 > end:
                general = True
                break
            if kind == K_BOOL:
                value = data[p] != 0
            else:
                value = <int>(<signed char>data[p])
            p += 1
        elif kind == K_I16:
            if p + 2 > end:
                general = True
                break
            value = _i16_at(data + p)
            p += 2
        elif kind == K_DOUBLE:
            if p + 8 > end:
                general = True
                break
            bits = <uint64_t>_i64_at(data + p)
            memcpy(&d, &bits, 8)
            value = d
            p += 8
        elif kind == K_STRUCT:
            self.pos = p
            value = _read(self, _fields_of(f.classes[i]), buf, data, end)
            p = self.pos
        elif kind >= K_LIST_STRUCT:
            # A list's or a map's header, then as BinaryReader._read_list and
            # Reader._read_map read them: the same checks, in the same order.
            if kind >= K_MAP_STRING_I32:
                if p + 6 > end:
                    general = True
                    break
                count = _i32_at(data + p + 2)
                if count < 0 or depth >= _MAX_DEPTH or (
                    count and (data[p] != f.ewire[i] or data[p + 1] != f.vwire[i])
                ):
                    general = True
                    break
                self.pos = p + 6
                self._check_count_of(count, _min_size(data[p]) + _min_size(data[p + 1]))
                p += 6
            else:
                if p + 5 > end:
                    general = True
                    break
                count = _i32_at(data + p + 1)
                if count < 0 or depth >= _MAX_DEPTH or (count and data[p] != f.ewire[i]):
                    general = True
                    break
                self.pos = p + 5
                self._check_count_of(count, _min_size(data[p]))
                p += 5
            self.depth = depth + 1
            if kind == K_LIST_STRUCT:
                sub = _fields_of(f.classes[i])
                items = []
                for j in range(count):
                    items.append(_read(self, sub, buf, data, end))
                p = self.pos
                value = items
            elif kind == K_LIST_I64 or kind == K_LIST_I32:
                vsize = 8 if kind == K_LIST_I64 else 4
                if p + vsize * count > end:
                    general = True
                else:
                    items = [None] * count
                    for j in range(count):
                        if vsize == 8:
                            items[j] = PyLong_FromLongLong(_i64_at(data + p))
                        else:
                            items[j] = _i32_at(data + p)
                        p += vsize
                    value = items
            elif kind == K_LIST_STRING or kind == K_LIST_BINARY:
                items = [None] * count
                for j in range(count):
                    if p + 4 > end:
                        general = True
                        break
                    n = _i32_at(data + p)
                    p += 4
                    if n < 0 or p + n > end:
                        general = True
                        break
                    if kind == K_LIST_BINARY:
                        items[j] = buf[p : p + n]
                    else:
                        try:
                            items[j] = PyUnicode_DecodeUTF8(<const char*>data + p, n, NULL)
                        except UnicodeDecodeError:
                            general = True
                            break
                    p += n
                value = items
            else:
                vsize = 4 if kind == K_MAP_STRING_I32 else 8
                found = {}
                for j in range(count):
                    if p + 4 > end:
                        general = True
                        break
                    n = _i32_at(data + p)
                    p += 4
                    if n < 0 or p + n + vsize > end:
                        general = True
                        break
                    try:
                        key = PyUnicode_DecodeUTF8(<const char*>data + p, n, NULL)
                    except UnicodeDecodeError:
                        general = True
                        break
                    p += n
                    if vsize == 4:
                        found[key] = _i32_at(data + p)
                    else:
                        found[key] = PyLong_FromLongLong(_i64_at(data + p))
                    p += vsize
                value = found
            self.depth = depth
            if general:
                # (the general walk reads the container again, and counts it again)
                self.elements -= count
                break
        else:
            self.pos = p
            value = self._read_value(f.ttype[i], f.subs[i])
            p = self.pos
        values[f.names[i]] = value
        pos = p
    self.pos = pos
    if general:
        self._read_fields(f.by_id, values)
    self.depth = depth - 1
    for name in f.required:
        if name not in values:
            raise RemoteProtocolError(f"required field {f.cls.__name__}.{name} is missing")
    if f.new is None:
        return f.cls(**values)
    cdef dict attributes = f.defaults.copy()
    attributes.update(values)
    obj = f.new(f.cls)
    obj.__dict__ = attributes
    return obj


# ---------------------------------------------------------------------------
# Writing

# A message's buffer past this grows by half of itself at a time, not by an eighth.
cdef Py_ssize_t _GROW_FROM = 64 * 1024


cdef inline int _put(bytearray out, const void* p, Py_ssize_t n) except -1:
    # A bytearray grows by an eighth (CPython's bytearray_resize), each time by a realloc
    # that copies it unless the block can grow where it is: a message of many small
    # binaries (200 x 4 KiB) was copied ~8 times over as it was written, where the heap
    # is in use (732 us to encode such a push in a client's loop, 124 us in a fresh
    # process). Grown by half, it is copied ~2 times over at most; at most a third of
    # what it holds is spare. (Resized back to what is used, it keeps what it holds:
    # CPython shrinks a bytearray's block only below half of it.)
    cdef Py_ssize_t size = PyByteArray_GET_SIZE(out)
    cdef Py_ssize_t want = size + n
    if want >= (<PyByteArrayObject*>out).ob_alloc and want > _GROW_FROM:
        if PyByteArray_Resize(out, want + want // 2) < 0:
            return -1
    if PyByteArray_Resize(out, want) < 0:
        return -1
    memcpy(PyByteArray_AS_STRING(out) + size, p, n)
    return 0


cdef inline int _put_u8(bytearray out, uint8_t v) except -1:
    return _put(out, &v, 1)


cdef inline int _put_i32(bytearray out, int64_t v) except -1:
    cdef uint8_t b[4]
    cdef uint32_t u = <uint32_t>v
    b[0] = u >> 24
    b[1] = u >> 16
    b[2] = u >> 8
    b[3] = u
    return _put(out, b, 4)


cdef inline int _put_i64(bytearray out, uint64_t u) except -1:
    cdef uint8_t b[8]
    cdef int k
    for k in range(8):
        b[7 - k] = <uint8_t>(u >> (8 * k))
    return _put(out, b, 8)


cdef inline bint _small_i32(object v, int64_t* out) except -1:
    """An exact int that fits an i32 (into ``out``); else the pure packer's."""
    cdef int overflow = 0
    cdef long long x
    if not PyLong_CheckExact(v):
        return False
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow or x < -2147483648 or x > 2147483647:
        return False
    out[0] = x
    return True


cdef inline bint _small_i64(object v, int64_t* out) except -1:
    cdef int overflow = 0
    cdef long long x
    if not PyLong_CheckExact(v):
        return False
    x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow:
        return False
    out[0] = x
    return True


cdef bytearray _write_bytes(object self, bytearray out, object v):
    """A string or binary value: in place if small (as the code made for a struct
    writes it), else by the writer's ``_write_bytes``. Answers ``self.out``."""
    cdef const char* p
    cdef Py_ssize_t n
    cdef Py_buffer view
    if PyUnicode_CheckExact(v):
        try:
            p = PyUnicode_AsUTF8AndSize(v, &n)
        except UnicodeEncodeError:
            v.encode("utf-8")  # (raises what the pure code raises)
            raise
        if n < _SMALL:
            _put_i32(out, n)
            _put(out, p, n)
            return out
        v = v.encode("utf-8")
    elif PyBytes_CheckExact(v):
        n = PyBytes_GET_SIZE(v)
        if n < _SMALL:
            _put_i32(out, n)
            _put(out, PyBytes_AS_STRING(v), n)
            return out
    elif type(v) is memoryview:
        if v.nbytes < _SMALL and v.format == "B" and v.ndim == 1 and v.c_contiguous:
            PyObject_GetBuffer(v, &view, PyBUF_SIMPLE)
            try:
                _put_i32(out, view.len)
                _put(out, view.buf, view.len)
            finally:
                PyBuffer_Release(&view)
            return out
    self._write_bytes(v)
    return self.out


def write_struct(self, obj):
    """Write ``obj``, a struct (BinaryWriter.write_struct)."""
    _write(self, obj)


cdef _write(object self, object obj):
    cdef _Fields f = _fields_of(type(obj))
    cdef bytearray out = self.out
    cdef int i, kind
    cdef int64_t x
    cdef double d
    cdef uint64_t bits
    cdef Py_ssize_t count, j
    cdef list items
    for i in range(f.n):
        try:
            v = getattr(obj, f.names[i])
        except AttributeError:
            v = None
        if v is None:
            if f.is_required[i]:
                raise LocalProtocolError(f.missing[i])
            continue
        header = f.headers[i]
        if header is None:
            raise LocalProtocolError(f.no_header[i])
        _put(out, PyBytes_AS_STRING(header), 3)
        kind = f.kind[i]
        if kind == K_BINARY or kind == K_STRING:
            out = _write_bytes(self, out, v)
        elif kind == K_I32:
            if _small_i32(v, &x):
                _put_i32(out, x)
            else:
                out += _pack_i32(v)
        elif kind == K_I64:
            if _small_i64(v, &x):
                _put_i64(out, <uint64_t>x)
            else:
                out += _pack_i64(v)
        elif kind == K_DOUBLE and PyFloat_CheckExact(v):
            d = PyFloat_AS_DOUBLE(v)
            memcpy(&bits, &d, 8)
            _put_i64(out, bits)
        elif kind == K_BOOL and (v is True or v is False):
            _put_u8(out, 1 if v is True else 0)
        elif kind == K_STRUCT:
            _write(self, v)
            out = self.out
        elif K_LIST_STRUCT <= kind <= K_LIST_BINARY:
            items = v if PyList_CheckExact(v) else list(v)
            count = len(items)
            if kind == K_LIST_I64:
                j = 0
                while j < count and _small_i64(items[j], &x):
                    j += 1
                if j < count:  # (not all ints of 64 bits: the pure packers say why)
                    if count < 9:
                        out += _PACK_LIST_I64S[count](f.ewire[i], count, *items)
                    else:
                        out += _struct.pack(f"!bi{count}q", f.ewire[i], count, *items)
                else:
                    _put_u8(out, f.ewire[i])
                    _put_i32(out, count)
                    for j in range(count):
                        _small_i64(items[j], &x)
                        _put_i64(out, <uint64_t>x)
            elif kind == K_LIST_I32:
                j = 0
                while j < count and _small_i32(items[j], &x):
                    j += 1
                if j < count:  # (not all ints of 32 bits: the pure writer says why)
                    self._write_value(f.ttype[i], f.subs[i], items)
                    out = self.out
                else:
                    _put_u8(out, f.ewire[i])
                    _put_i32(out, count)
                    for j in range(count):
                        _small_i32(items[j], &x)
                        _put_i32(out, x)
            else:
                out += _list_header(f.ewire[i], count)
                if kind == K_LIST_STRUCT:
                    for item in items:
                        _write(self, item)
                    out = self.out
                else:
                    for item in items:
                        out = _write_bytes(self, out, item)
        elif kind == K_MAP_STRING_I32 or kind == K_MAP_STRING_I64:
            out += _map_header(f.ewire[i], f.vwire[i], len(v))
            for key, item in v.items():
                out = _write_bytes(self, out, key)
                if kind == K_MAP_STRING_I32:
                    if _small_i32(item, &x):
                        _put_i32(out, x)
                    else:
                        out += _pack_i32(item)
                elif _small_i64(item, &x):
                    _put_i64(out, <uint64_t>x)
                else:
                    out += _pack_i64(item)
        else:
            self._write_value(f.ttype[i], f.subs[i], v)
            out = self.out
    _put_u8(out, 0)
