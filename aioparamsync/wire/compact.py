"""Thrift's compact protocol: :class:`CompactReader` and :class:`CompactWriter`.

Varints, zigzag integers, field ids as deltas from the previous field's (so
each struct keeps its last field id, and a stack of them for the structs it
is in), and booleans carried in their field header. The primitives only: the
walks are :class:`~.reader.Reader`'s and :class:`~.writer.Writer`'s.
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar

from thriftpy2.thrift import TType

from ..errors import LocalProtocolError, RemoteProtocolError
from .plan import _wire_type
from .protocol import _S_I8, MAX_I32, Protocol
from .reader import Reader
from .writer import Writer

__all__ = ["CompactReader", "CompactWriter"]

_S_DOUBLE_LE = struct.Struct("<d")

# (an enum's .value is slow to get)
_COMPACT_BYTE = Protocol.COMPACT.value
_COMPACT_VERSION = 1

# Compact protocol type ids and the TType each stands for.
_CT_TO_TTYPE = {
    1: TType.BOOL,  # true, in a field header
    2: TType.BOOL,  # false, in a field header
    3: TType.BYTE,
    4: TType.I16,
    5: TType.I32,
    6: TType.I64,
    7: TType.DOUBLE,
    8: TType.STRING,
    9: TType.LIST,
    10: TType.SET,
    11: TType.MAP,
    12: TType.STRUCT,
}
_TTYPE_TO_CT = {
    TType.BOOL: 1,
    TType.BYTE: 3,
    TType.I16: 4,
    TType.I32: 5,
    TType.I64: 6,
    TType.DOUBLE: 7,
    TType.STRING: 8,
    TType.LIST: 9,
    TType.SET: 10,
    TType.MAP: 11,
    TType.STRUCT: 12,
}


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


class CompactReader(Reader):
    """Thrift's compact protocol (every message starts 0x82)."""

    __slots__ = ("_bool", "_fid_stack", "_last_fid")
    MIN_SIZE: ClassVar[dict[int, int]] = {TType.DOUBLE: 8}
    FIXED_SIZE: ClassVar[dict[int, int]] = {TType.BYTE: 1, TType.DOUBLE: 8}

    def __init__(
        self, buf: Any, *, stream: bool = False, limit: int = MAX_I32, name_limit: int = MAX_I32
    ) -> None:
        super().__init__(buf, stream=stream, limit=limit, name_limit=name_limit)
        self._last_fid = 0
        self._fid_stack: list[int] = []
        self._bool: bool | None = None

    def _varint(self, max_bytes: int) -> int:
        result = shift = 0
        buf, end = self.buf, self.end
        for _ in range(max_bytes):
            pos = self.pos
            if pos >= end:
                self._overrun(1)
            byte = buf[pos]
            self.pos = pos + 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
        raise RemoteProtocolError(f"varint longer than {max_bytes} bytes")

    def _ubyte(self) -> int:
        return self.buf[self._take(1)]

    def read_message_begin(self) -> tuple[str, int, int]:
        if self._ubyte() != _COMPACT_BYTE:
            raise RemoteProtocolError("not a compact protocol message")
        vt = self._ubyte()
        if vt & 0x1F != _COMPACT_VERSION:
            raise RemoteProtocolError(f"bad compact protocol version {vt & 0x1F}")
        seqid = self._varint(5)  # unsigned, not zigzag
        if seqid > 0xFFFFFFFF:
            raise RemoteProtocolError("seqid out of range")
        seqid = seqid - (1 << 32) if seqid > MAX_I32 else seqid
        name = self._read_name()
        return name, vt >> 5, seqid

    def _struct_begin(self) -> None:
        self._enter()
        self._fid_stack.append(self._last_fid)
        self._last_fid = 0

    def _struct_end(self) -> None:
        self.depth -= 1
        self._last_fid = self._fid_stack.pop()

    def _field_begin(self) -> tuple[int, int]:
        byte = self._ubyte()
        if byte == 0:
            return TType.STOP, 0
        ctype = byte & 0x0F
        delta = byte >> 4
        fid = self._last_fid + delta if delta else self._read_i16()
        ttype = _CT_TO_TTYPE.get(ctype)
        if ttype is None:
            raise RemoteProtocolError(f"unknown compact type {ctype}")
        if ttype == TType.BOOL:
            self._bool = ctype == 1
        self._last_fid = fid
        return ttype, fid

    def _elem_type(self, ctype: int) -> int:
        # In containers a bool is a byte, and some writers use type 1 or 2.
        ttype = _CT_TO_TTYPE.get(ctype)
        if ttype is None:
            raise RemoteProtocolError(f"unknown compact type {ctype}")
        return ttype

    def _list_begin(self) -> tuple[int, int]:
        byte = self._ubyte()
        count = byte >> 4
        if count == 15:
            count = self._varint(5)
            if count > MAX_I32:
                raise RemoteProtocolError(f"container size {count} out of range")
        return self._elem_type(byte & 0x0F), count

    def _map_begin(self) -> tuple[int, int, int]:
        count = self._varint(5)
        if count > MAX_I32:
            raise RemoteProtocolError(f"container size {count} out of range")
        if count == 0:
            return TType.STOP, TType.STOP, 0
        kv = self._ubyte()
        return self._elem_type(kv >> 4), self._elem_type(kv & 0x0F), count

    def _read_bool(self) -> bool:
        value = self._bool
        if value is not None:  # carried by the field header
            self._bool = None
            return value
        return self._ubyte() == 1

    def skip(self, wire: int) -> None:
        if wire == TType.BOOL and self._bool is not None:
            self._bool = None
            return
        super().skip(wire)

    def _read_int(self, max_bytes: int, bits: int) -> int:
        value = _zigzag(self._varint(max_bytes))
        if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
            raise RemoteProtocolError(f"{value} does not fit in i{bits}")
        return value

    def _read_i16(self) -> int:
        return self._read_int(3, 16)

    def _read_i32(self) -> int:
        return self._read_int(5, 32)

    def _read_i64(self) -> int:
        return self._read_int(10, 64)

    def _read_double(self) -> float:
        return _S_DOUBLE_LE.unpack_from(self.buf, self._take(8))[0]

    def _read_length(self) -> int:
        n = self._varint(5)
        if n > MAX_I32:
            raise RemoteProtocolError(f"length {n} out of range")
        return n


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _zigzag_enc(n: int, bits: int) -> int:
    if not -(1 << (bits - 1)) <= n < (1 << (bits - 1)):
        raise LocalProtocolError(f"{n} does not fit in i{bits}")
    return (n << 1) ^ (n >> (bits - 1))


class CompactWriter(Writer):
    __slots__ = ("_fid_stack", "_last_fid")

    def __init__(self) -> None:
        super().__init__()
        self._last_fid = 0
        self._fid_stack: list[int] = []

    def write_message_begin(self, name: str, mtype: int, seqid: int) -> None:
        self.out.append(_COMPACT_BYTE)
        self.out.append((mtype << 5) | _COMPACT_VERSION)
        self.out += _varint(seqid & 0xFFFFFFFF)
        self._write_value(TType.STRING, None, name)

    def _struct_begin(self) -> None:
        self._fid_stack.append(self._last_fid)
        self._last_fid = 0

    def _struct_end(self) -> None:
        self._last_fid = self._fid_stack.pop()

    def _field_begin(self, ttype: int, fid: int, value: Any) -> bool:
        is_bool = ttype == TType.BOOL
        ctype = (1 if value else 2) if is_bool else _TTYPE_TO_CT[_wire_type(ttype)]
        delta = fid - self._last_fid
        if 0 < delta <= 15:
            self.out.append((delta << 4) | ctype)
        else:
            self.out.append(ctype)
            self.out += _varint(_zigzag_enc(fid, 16))
        self._last_fid = fid
        return is_bool

    def _field_stop(self) -> None:
        self.out.append(0)

    def _list_begin(self, etype: int, count: int) -> None:
        ctype = _TTYPE_TO_CT[etype]
        if count < 15:
            self.out.append((count << 4) | ctype)
        else:
            self.out.append(0xF0 | ctype)
            self.out += _varint(count)

    def _map_begin(self, ktype: int, vtype: int, count: int) -> None:
        if count == 0:
            self.out.append(0)
        else:
            self.out += _varint(count)
            self.out.append((_TTYPE_TO_CT[ktype] << 4) | _TTYPE_TO_CT[vtype])

    def _write_length(self, n: int) -> None:
        self.out += _varint(n)

    def _write_scalar(self, ttype: int, value: Any) -> None:
        if ttype == TType.I32:
            self.out += _varint(_zigzag_enc(value, 32))
        elif ttype == TType.I64:
            self.out += _varint(_zigzag_enc(value, 64))
        elif ttype == TType.BOOL:
            self.out.append(1 if value else 2)
        elif ttype == TType.BYTE:
            self.out += _S_I8.pack(value)
        elif ttype == TType.I16:
            self.out += _varint(_zigzag_enc(value, 16))
        elif ttype == TType.DOUBLE:
            self.out += _S_DOUBLE_LE.pack(value)
        else:
            raise LocalProtocolError(f"unsupported type {ttype}")
