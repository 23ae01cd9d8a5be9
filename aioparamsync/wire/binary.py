"""Thrift's binary protocol (strict): :class:`BinaryReader` and :class:`BinaryWriter`.

The binary protocol carries nearly every call, so both sides are written for
speed on top of the general walks of :class:`~.reader.Reader` and
:class:`~.writer.Writer`: the primitives inline their bounds checks, and a
struct is read and written by code made for its class (see
:mod:`.binary_codegen`), which leaves anything unusual to the general walk
here (:meth:`BinaryReader._read_fields`, :meth:`BinaryWriter._write_value`).
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar

from thriftpy2.thrift import TType

from .._ext import compiled
from ..errors import LocalProtocolError, RemoteProtocolError
from .binary_codegen import _BINARY_READERS, _BINARY_WRITERS, _binary_reader_of, _binary_writer_of
from .plan import _wire_type
from .protocol import (
    _S_DOUBLE,
    _S_FIELD,
    _S_I8,
    _S_I16,
    _S_LIST,
    _S_MAP,
    _T_BINARY,
    _T_BYTES,
    _T_I32,
    _T_I64,
    _T_LIST,
    _T_MAP,
    _T_SEQUENCES,
    _T_SET,
    _T_STOP,
    _T_STRING,
    _T_STRUCT,
    MAX_I32,
    _pack_i32,
    _pack_i64,
    _unpack_i16,
    _unpack_i32,
    _unpack_i64,
)
from .reader import MAX_DEPTH, Reader
from .writer import ZERO_COPY_MIN_BYTES, Chunks, Writer, _as_bytes_view

__all__ = ["BinaryReader", "BinaryWriter"]

_S_BIN_MSG = struct.Struct("!I")  # strict binary: version and type in one word
_S_MSG_HEAD = struct.Struct("!Ii")  # that word and the name's length

_BINARY_VERSION = 0x80010000


class BinaryReader(Reader):
    """Thrift's binary protocol (strict: every message starts 0x80 0x01)."""

    __slots__ = ()
    MIN_SIZE: ClassVar[dict[int, int]] = {
        TType.BOOL: 1,
        TType.BYTE: 1,
        TType.I16: 2,
        TType.I32: 4,
        TType.I64: 8,
        TType.DOUBLE: 8,
        TType.STRING: 4,
        TType.STRUCT: 1,
        TType.LIST: 5,
        TType.SET: 5,
        TType.MAP: 6,
    }
    FIXED_SIZE: ClassVar[dict[int, int]] = {
        TType.BOOL: 1,
        TType.BYTE: 1,
        TType.I16: 2,
        TType.I32: 4,
        TType.I64: 8,
        TType.DOUBLE: 8,
    }

    def read_message_begin(self) -> tuple[str, int, int]:
        # At once where it is all there and well formed; else step by step,
        # which says what is wrong.
        buf, pos, end = self.buf, self.pos, self.end
        if pos + 8 <= end:
            word, n = _S_MSG_HEAD.unpack_from(buf, pos)
            p = pos + 8
            if (
                word & 0xFFFF0000 == _BINARY_VERSION
                and 0 <= n <= self.name_limit
                and p + n + 4 <= end
            ):
                try:
                    name = str(buf[p : p + n], "utf-8")
                except UnicodeDecodeError:
                    pass
                else:
                    self.pos = p + n + 4
                    return name, word & 0xFF, _unpack_i32(buf, p + n)[0]
        word = _S_BIN_MSG.unpack_from(self.buf, self._take(4))[0]
        if word & 0xFFFF0000 != _BINARY_VERSION:
            raise RemoteProtocolError(f"bad binary protocol version word {word:#010x}")
        name = self._read_name()
        seqid = self._read_i32()
        return name, word & 0xFF, seqid

    def _field_begin(self) -> tuple[int, int]:
        pos = self.pos
        if pos >= self.end:
            self._overrun(1)  # the next byte tells a 1-byte STOP from a 3-byte header
        if self.buf[pos] == TType.STOP:
            self.pos = pos + 1
            return TType.STOP, 0
        return _S_FIELD.unpack_from(self.buf, self._take(3))

    def _list_begin(self) -> tuple[int, int]:
        return _S_LIST.unpack_from(self.buf, self._take(5))

    def _map_begin(self) -> tuple[int, int, int]:
        return _S_MAP.unpack_from(self.buf, self._take(6))

    # The primitives below are _take inlined: the same checks, in the same order.

    def _read_bool(self) -> bool:
        pos = self.pos
        if pos + 1 > self.end:
            self._overrun(1)
        self.pos = pos + 1
        return self.buf[pos] != 0

    def _read_i16(self) -> int:
        pos = self.pos
        if pos + 2 > self.end:
            self._overrun(2)
        self.pos = pos + 2
        return _unpack_i16(self.buf, pos)[0]

    def _read_i32(self) -> int:
        pos = self.pos
        if pos + 4 > self.end:
            self._overrun(4)
        self.pos = pos + 4
        return _unpack_i32(self.buf, pos)[0]

    def _read_i64(self) -> int:
        pos = self.pos
        if pos + 8 > self.end:
            self._overrun(8)
        self.pos = pos + 8
        return _unpack_i64(self.buf, pos)[0]

    def _read_double(self) -> float:
        pos = self.pos
        if pos + 8 > self.end:
            self._overrun(8)
        self.pos = pos + 8
        return _S_DOUBLE.unpack_from(self.buf, pos)[0]

    _read_length = _read_i32

    def _read_bytes_view(self) -> memoryview:
        pos = self.pos
        end = self.end
        if pos + 4 > end:
            self._overrun(4)
        n = _unpack_i32(self.buf, pos)[0]
        self.pos = pos = pos + 4
        if n < 0:
            raise RemoteProtocolError(f"negative length {n} at byte {pos}")
        if pos + n > end:
            self._overrun(n)
        self.pos = pos + n
        return self.buf[pos : pos + n]

    # -- the walk, specialised ---------------------------------------------------
    #
    # A struct is read by code made for its class (see binary_codegen): the
    # fields in id order, straight through. Anything else (a field out of
    # order, unknown, repeated or malformed, or too few bytes) is left to the
    # general walk, _read_fields, from that field on, so the outcome is the
    # general walk's, errors included.

    def read_struct(self, cls: Any) -> Any:
        read = _BINARY_READERS.get(cls)
        if read is None:
            read = _binary_reader_of(cls)
        return read(self)

    def _read_fields(self, by_id: dict[int, tuple[int, str, int, Any]], values: dict) -> None:
        """Read a struct's fields from ``self.pos`` into ``values``, up to its STOP.

        The hot primitives are inlined: every bounds check is still made
        before the bytes are read, with ``self.pos`` where ``_take`` would
        have it, so running out raises what it raises anywhere else.
        """
        buf = self.buf
        end = self.end
        pos = self.pos
        while True:
            if pos + 3 > end:  # room for a STOP only, or not even that
                if pos < end and buf[pos] == _T_STOP:
                    pos += 1
                    break
                self.pos = pos
                self._overrun(1 if pos >= end else 3)
            wire = buf[pos]
            if wire == _T_STOP:
                pos += 1
                break
            field = by_id.get(_unpack_i16(buf, pos + 1)[0])
            pos += 3
            if field is None or field[0] != wire:
                # a field of a newer IDL, or of another type (as a signed byte)
                self.pos = pos
                self.skip(wire - 256 if wire > 127 else wire)
                pos = self.pos
                continue
            ttype = field[2]
            if ttype in _T_BYTES:
                if pos + 4 > end:
                    self.pos = pos
                    self._overrun(4)
                n = _unpack_i32(buf, pos)[0]
                pos += 4
                if n < 0:
                    raise RemoteProtocolError(f"negative length {n} at byte {pos}")
                if pos + n > end:
                    self.pos = pos
                    self._overrun(n)
                if ttype == _T_BINARY:
                    values[field[1]] = buf[pos : pos + n]
                else:
                    try:
                        values[field[1]] = str(buf[pos : pos + n], "utf-8")
                    except UnicodeDecodeError as exc:
                        raise RemoteProtocolError(f"string is not valid UTF-8: {exc}") from None
                pos += n
            elif ttype == _T_I64:
                if pos + 8 > end:
                    self.pos = pos
                    self._overrun(8)
                values[field[1]] = _unpack_i64(buf, pos)[0]
                pos += 8
            elif ttype == _T_I32:
                if pos + 4 > end:
                    self.pos = pos
                    self._overrun(4)
                values[field[1]] = _unpack_i32(buf, pos)[0]
                pos += 4
            elif ttype == _T_STRUCT:
                self.pos = pos
                values[field[1]] = self.read_struct(field[3])
                pos = self.pos
            elif ttype == _T_LIST:
                self.pos = pos
                values[field[1]] = self._read_list(ttype, field[3])
                pos = self.pos
            else:
                self.pos = pos
                values[field[1]] = self._read_value(ttype, field[3])
                pos = self.pos
        self.pos = pos

    def _read_list(self, ttype: int, sub: Any) -> Any:
        etype, esub, ewire = sub
        pos = self.pos
        if pos + 5 > self.end:
            self._overrun(5)
        wire, count = _S_LIST.unpack_from(self.buf, pos)
        self.pos = pos + 5
        if count and wire != ewire:
            raise RemoteProtocolError(f"list of type {wire} where {etype} was expected")
        self._check_count_of(count, self.MIN_SIZE.get(wire, 1))
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise RemoteProtocolError(f"message nests deeper than {MAX_DEPTH} levels")
        if not count:
            items: list[Any] = []
        elif etype == _T_STRUCT:
            read_struct = self.read_struct
            items = [read_struct(esub) for _ in range(count)]
        elif etype == _T_I64:  # in one go (the count fits: checked above)
            items = list(struct.unpack_from(f"!{count}q", self.buf, self._take(8 * count)))
        elif etype == _T_STRING:
            read_string = self._read_string
            items = [read_string() for _ in range(count)]
        else:
            read_value = self._read_value
            items = [read_value(etype, esub) for _ in range(count)]
        self.depth -= 1
        return set(items) if ttype == _T_SET else items


# The binary protocol's version word of each message type; and each method
# name's length and bytes, as written after it (bounded, as error replies
# echo names that clients made up).
_BIN_VERSION_WORDS = [_S_BIN_MSG.pack(_BINARY_VERSION | t) for t in range(256)]
_BIN_NAMES: dict[str, bytes] = {}
_BIN_NAMES_MAX = 256


class BinaryWriter(Writer):
    __slots__ = ()

    def write_message_begin(self, name: str, mtype: int, seqid: int) -> None:
        if 0 <= mtype < 256:
            self.out += _BIN_VERSION_WORDS[mtype]
        else:
            self.out += _S_BIN_MSG.pack(_BINARY_VERSION | mtype)
        written = _BIN_NAMES.get(name)
        if written is not None:
            self.out += written
        else:
            self._write_bytes(name)
            if type(name) is str and len(_BIN_NAMES) < _BIN_NAMES_MAX:
                encoded = name.encode("utf-8")
                _BIN_NAMES[name] = _pack_i32(len(encoded)) + encoded
        self.out += _pack_i32(seqid)

    def _field_begin(self, ttype: int, fid: int, value: Any) -> bool:
        self.out += _S_FIELD.pack(_wire_type(ttype), fid)
        return False

    def _field_stop(self) -> None:
        self.out.append(TType.STOP)

    def _list_begin(self, etype: int, count: int) -> None:
        self.out += _S_LIST.pack(etype, count)

    def _map_begin(self, ktype: int, vtype: int, count: int) -> None:
        self.out += _S_MAP.pack(ktype, vtype, count)

    def _write_length(self, n: int) -> None:
        self.out += _pack_i32(n)

    def _write_scalar(self, ttype: int, value: Any) -> None:
        if ttype == TType.I32:
            self.out += _pack_i32(value)
        elif ttype == TType.I64:
            self.out += _pack_i64(value)
        elif ttype == TType.BOOL:
            self.out.append(1 if value else 0)
        elif ttype == TType.BYTE:
            self.out += _S_I8.pack(value)
        elif ttype == TType.I16:
            self.out += _S_I16.pack(value)
        elif ttype == TType.DOUBLE:
            self.out += _S_DOUBLE.pack(value)
        else:
            raise LocalProtocolError(f"unsupported type {ttype}")

    # -- the walk, specialised ---------------------------------------------------
    #
    # Writer's walk with field headers packed once per class and the hot
    # values (strings, binaries, i32, i64, lists of i64) inlined. A binary of
    # ZERO_COPY_MIN_BYTES or more still goes by reference (_write_view), which
    # starts a new ``out``: hence ``out = self.out`` after anything that may.

    def _write_bytes(self, value: Any) -> None:
        if type(value) is Chunks:
            self._write_chunks(value)
            return
        if isinstance(value, str):
            value = value.encode("utf-8")
        if type(value) is not bytes:
            value = _as_bytes_view(value)
        n = len(value)
        if n >= ZERO_COPY_MIN_BYTES:
            if n > MAX_I32:
                raise LocalProtocolError(f"a value of {n} bytes exceeds Thrift's 2 GiB")
            self.out += _pack_i32(n)
            self._write_view(value if type(value) is memoryview else memoryview(value))
        else:
            out = self.out
            out += _pack_i32(n)
            out += value

    def write_struct(self, obj: Any) -> None:
        write = _BINARY_WRITERS.get(type(obj))
        if write is None:
            write = _binary_writer_of(type(obj))
        write(self, obj)

    def _write_value(self, ttype: int, sub: Any, value: Any) -> None:
        if ttype in _T_BYTES:
            self._write_bytes(value)
        elif ttype == _T_STRUCT:
            self.write_struct(value)
        elif ttype in _T_SEQUENCES:
            etype, esub, ewire = sub
            items = value if type(value) is list else list(value)
            count = len(items)
            if etype == _T_I64 and count:
                self.out += struct.pack(f"!bi{count}q", ewire, count, *items)
                return
            self.out += _S_LIST.pack(ewire, count)
            if etype == _T_STRUCT:
                write_struct = self.write_struct
                for item in items:
                    write_struct(item)
            elif etype in _T_BYTES:
                write_bytes = self._write_bytes
                for item in items:
                    write_bytes(item)
            else:
                write_value = self._write_value
                for item in items:
                    write_value(etype, esub, item)
        elif ttype == _T_MAP:
            ktype, ksub, kwire, vtype, vsub, vwire = sub
            self.out += _S_MAP.pack(kwire, vwire, len(value))
            write_value = self._write_value
            for key, item in value.items():
                write_value(ktype, ksub, key)
                write_value(vtype, vsub, item)
        else:
            self._write_scalar(ttype, value)


# The compiled struct codec (see _cbinary.pyx) in place of the code made per
# class, unless the pure path is asked for or it was not built. The pure
# methods stay here, for the tests that compare the two.
PURE_READ_MESSAGE_BEGIN = BinaryReader.read_message_begin
PURE_READ_STRUCT = BinaryReader.read_struct
PURE_WRITE_STRUCT = BinaryWriter.write_struct
_cbinary = compiled("wire._cbinary")
COMPILED = _cbinary is not None
if _cbinary is not None:
    BinaryReader.read_message_begin = _cbinary.read_message_begin  # type: ignore[method-assign]
    BinaryReader.read_struct = _cbinary.read_struct  # type: ignore[method-assign]
    BinaryWriter.write_struct = _cbinary.write_struct  # type: ignore[method-assign]
