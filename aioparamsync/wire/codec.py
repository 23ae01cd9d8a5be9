"""Thrift's binary and compact protocols: bounds-checked, zero-copy, no I/O.

Theory of operation. A message is decoded from one contiguous buffer (a
frame's payload, or the bytes an unframed connection has received so far).
Every read checks the bytes left before it reads, so a message can never run
past the end of its buffer and a count (a list of 10**9 elements, a string of
2 GiB) is refused before anything is allocated for it. The structs are the
classes :func:`thriftpy2.load` generates; their ``thrift_spec`` drives the
walk, so the codec knows nothing of the IDL. ``binary`` fields decode to
read-only ``memoryview`` slices of the buffer (no copy: a 64 MiB parameter
stays where the socket put it) and encode by reference: the encoder returns a
list of buffers for a vectored write, the large ones being the caller's own.

Speed. Each struct class gets a plan once (its fields by id, their wire
types and normalised sub-specs, the required names), so the walk never looks
at a spec again. In the binary protocol, which carries nearly every call,
each class also gets code made for it: a reader that takes the fields in id
order straight through, leaving anything unusual (a field out of order,
unknown, repeated, malformed or cut short) to the general walk from there,
so that its outcome is the general walk's; and a writer with the field
headers packed once. Only our own constants go into that code; names and
sub-specs are its bound values, never its text.

Decoding on a stream (unframed connections) raises :class:`NeedData` with the
number of bytes the message needs at least, so the caller waits for that many
before trying again, instead of re-parsing on every packet.

Any malformed input raises :class:`~aioparamsync.errors.RemoteProtocolError`
and nothing else; a value that cannot be encoded raises
:class:`~aioparamsync.errors.LocalProtocolError`.
"""

from __future__ import annotations

import enum
import operator
import struct
from collections.abc import Callable
from typing import Any, ClassVar

from thriftpy2.thrift import TType

from ..errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "MessageType",
    "NeedData",
    "Protocol",
    "Reader",
    "decode_header",
    "encode_message",
    "StreamMeasure",
]

# Binary fields at least this long are sent by reference instead of being
# copied into the encoder's buffer (a copy is cheaper than a separate iovec
# for small ones).
ZERO_COPY_MIN_BYTES = 16 * 1024
# Deepest nesting of structs and containers a message may have.
MAX_DEPTH = 64
# Most container elements one message may hold, all containers together: it
# bounds the time one message can take to decode (about 1 s in Python).
MAX_ELEMENTS = 2_000_000
# The largest value a Thrift i32 length may have.
MAX_I32 = 2**31 - 1


class Protocol(enum.Enum):
    """A Thrift protocol, told by a message's first byte."""

    BINARY = 0x80
    COMPACT = 0x82


# (an enum's .value is slow to get)
_COMPACT_BYTE = Protocol.COMPACT.value
_PROTOCOL_BINARY = Protocol.BINARY


class MessageType(enum.IntEnum):
    CALL = 1
    REPLY = 2
    EXCEPTION = 3
    ONEWAY = 4


class NeedData(Exception):
    """A message on a stream needs at least ``needed`` bytes (from its start)."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


_S_I8 = struct.Struct("!b")
_S_I16 = struct.Struct("!h")
_S_I32 = struct.Struct("!i")
_S_I64 = struct.Struct("!q")
_S_DOUBLE = struct.Struct("!d")
_S_DOUBLE_LE = struct.Struct("<d")
_S_BIN_MSG = struct.Struct("!I")  # strict binary: version and type in one word
_S_MSG_HEAD = struct.Struct("!Ii")  # that word and the name's length
_S_FIELD = struct.Struct("!bh")
_S_LIST = struct.Struct("!bi")
_S_MAP = struct.Struct("!bbi")

_unpack_i16 = _S_I16.unpack_from
_unpack_i32 = _S_I32.unpack_from
_unpack_i64 = _S_I64.unpack_from
_pack_i32 = _S_I32.pack
_pack_i64 = _S_I64.pack

# TType's values, as plain ints (the walk compares them a lot).
_T_STOP = TType.STOP
_T_I32 = TType.I32
_T_I64 = TType.I64
_T_STRING = TType.STRING
_T_BINARY = TType.BINARY
_T_STRUCT = TType.STRUCT
_T_LIST = TType.LIST
_T_SET = TType.SET
_T_MAP = TType.MAP
_T_BYTES = frozenset((_T_STRING, _T_BINARY))  # both are strings on the wire
_T_SEQUENCES = frozenset((_T_LIST, _T_SET))

_BINARY_VERSION = 0x80010000
_COMPACT_VERSION = 1

# The spec's "binary" is a string on the wire.
_WIRE_TYPE = {TType.BINARY: TType.STRING, TType.UTF8: TType.STRING, TType.UTF16: TType.STRING}
_SCALAR_TYPES = frozenset(
    (TType.BOOL, TType.BYTE, TType.I16, TType.I32, TType.I64, TType.DOUBLE, TType.STRING)
)
_CONTAINER_TYPES = frozenset((TType.STRUCT, TType.LIST, TType.SET, TType.MAP))


def _wire_type(ttype: int) -> int:
    return _WIRE_TYPE.get(ttype, ttype)


def _split_spec(spec: Any) -> tuple[int, Any]:
    """An element spec is a bare type or a (type, sub-spec) pair."""
    if isinstance(spec, tuple):
        return spec[0], spec[1]
    return spec, None


def _field_sub_spec(field: tuple) -> Any:
    # (type, name, required), (type, name, enum, required), (type, name, sub, required)
    return field[2] if len(field) == 4 and field[0] in _CONTAINER_TYPES else None


# ---------------------------------------------------------------------------
# Plans: what the walk needs of a struct class, worked out once per class
#
# A spec's sub-specs come in several shapes (a bare type or a (type, sub)
# pair, enums in the sub-spec's place...). A plan normalises them once, so
# the walk never looks at a spec again:
#   LIST / SET -> (element type, element sub, element wire type)
#   MAP        -> (key type, key sub, key wire, value type, value sub, value wire)
#   STRUCT     -> the struct class
#   otherwise  -> None


def _norm_sub(ttype: int, sub: Any) -> Any:
    if ttype == TType.LIST or ttype == TType.SET:
        etype, esub = _split_spec(sub)
        return etype, _norm_sub(etype, esub), _wire_type(etype)
    if ttype == TType.MAP:
        (ktype, ksub), (vtype, vsub) = _split_spec(sub[0]), _split_spec(sub[1])
        return (
            ktype,
            _norm_sub(ktype, ksub),
            _wire_type(ktype),
            vtype,
            _norm_sub(vtype, vsub),
            _wire_type(vtype),
        )
    if ttype == TType.STRUCT:
        return sub
    return None


class _Plan:
    """A struct class's fields, ready for the walk.

    Attributes:
        by_id: field id -> (wire type, name, type, normalised sub-spec), for reading.
        in_order: (name, field id, type, normalised sub-spec, required,
            binary field header or None) by field id, for writing.
        required: names of the required fields.
    """

    __slots__ = ("by_id", "in_order", "required")

    def __init__(self, cls: Any) -> None:
        self.by_id: dict[int, tuple[int, str, int, Any]] = {}
        in_order = []
        for fid, field in sorted(cls.thrift_spec.items()):
            ttype, name = field[0], field[1]
            sub = _norm_sub(ttype, _field_sub_spec(field))
            wire = _wire_type(ttype)
            is_required = field[-1] is True
            self.by_id[fid] = (wire, name, ttype, sub)
            # None: not a valid binary field header (refused when written)
            header = (
                _S_FIELD.pack(wire, fid) if -128 <= wire < 128 and -(2**15) <= fid < 2**15 else None
            )
            in_order.append((name, fid, ttype, sub, is_required, header))
        self.in_order: tuple[tuple[str, int, int, Any, bool, bytes | None], ...] = tuple(in_order)
        # in the spec's order, so that the first one missing is named
        self.required: tuple[str, ...] = tuple(
            f[1] for f in cls.thrift_spec.values() if f[-1] is True
        )


_PLANS: dict[Any, _Plan] = {}


def _plan(cls: Any) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
    return plan


def _build(cls: Any, plan: _Plan, values: dict[str, Any]) -> Any:
    """The decoded struct, once its required fields are known to be there."""
    for name in plan.required:
        if name not in values:
            raise RemoteProtocolError(f"required field {cls.__name__}.{name} is missing")
    return cls(**values)


# ---------------------------------------------------------------------------
# Reading


class Reader:
    """Walks one message in a buffer; the protocol's primitives are subclasses'.

    Args:
        buf: the bytes (any buffer); kept, not copied.
        stream: True where more bytes may follow (unframed): running out
            raises :class:`NeedData` instead of a protocol error.
        limit: with ``stream``, the most bytes a message may take.
    """

    __slots__ = ("buf", "depth", "elements", "end", "limit", "pos", "stream")
    # The fewest bytes an element of each wire type takes (refuses counts
    # that cannot fit in what is left before anything is allocated).
    MIN_SIZE: ClassVar[dict[int, int]] = {}
    # Wire types whose list elements all take the same bytes (a walk that
    # only measures steps over many at once).
    FIXED_SIZE: ClassVar[dict[int, int]] = {}

    def __init__(self, buf: Any, *, stream: bool = False, limit: int = MAX_I32) -> None:
        if type(buf) is memoryview and buf.readonly and buf.format == "B" and buf.ndim == 1:
            self.buf = buf  # a frame's payload: already what we need
        else:
            view = memoryview(buf)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            self.buf = view.toreadonly()
        view = self.buf
        self.pos = 0
        self.end = len(view)
        self.stream = stream
        self.limit = limit
        self.depth = 0
        self.elements = 0

    # -- bounds -------------------------------------------------------------

    def _take(self, n: int) -> int:
        """Reserve n bytes; answer where they start."""
        pos = self.pos
        if n < 0:
            raise RemoteProtocolError(f"negative length {n} at byte {pos}")
        if pos + n > self.end:
            self._overrun(n)
        self.pos = pos + n
        return pos

    def _overrun(self, n: int) -> None:
        if self.stream:
            if self.pos + n > self.limit:
                raise RemoteProtocolError(
                    f"message needs {self.pos + n} bytes, more than the limit of {self.limit}"
                )
            raise NeedData(self.pos + n)
        raise RemoteProtocolError(
            f"read of {n} bytes at byte {self.pos} runs past the end of the message "
            f"({self.end} bytes)"
        )

    def _check_count(self, count: int, elem_types: tuple[int, ...]) -> None:
        least = 0
        for t in elem_types:
            least += self.MIN_SIZE.get(t, 1)
        self._check_count_of(count, least)

    def _check_count_of(self, count: int, least: int) -> None:
        """Refuse ``count`` elements of at least ``least`` bytes each that cannot fit."""
        if count < 0:
            raise RemoteProtocolError(f"negative container size {count}")
        room = (self.limit if self.stream else self.end) - self.pos
        if count * least > room:
            raise RemoteProtocolError(
                f"container of {count} elements cannot fit in the {room} bytes left"
            )
        self.elements += count
        if self.elements > MAX_ELEMENTS:
            raise RemoteProtocolError(f"message holds more than {MAX_ELEMENTS} container elements")

    def _enter(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise RemoteProtocolError(f"message nests deeper than {MAX_DEPTH} levels")

    # -- primitives (per protocol) -------------------------------------------

    def read_message_begin(self) -> tuple[str, int, int]:
        raise NotImplementedError

    def _field_begin(self) -> tuple[int, int]:
        """Answer (wire type, field id); type STOP ends the struct."""
        raise NotImplementedError

    def _struct_begin(self) -> None:
        self._enter()

    def _struct_end(self) -> None:
        self.depth -= 1

    def _list_begin(self) -> tuple[int, int]:
        raise NotImplementedError

    def _map_begin(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def _read_bool(self) -> bool:
        raise NotImplementedError

    def _read_byte(self) -> int:
        return _S_I8.unpack_from(self.buf, self._take(1))[0]

    def _read_i16(self) -> int:
        raise NotImplementedError

    def _read_i32(self) -> int:
        raise NotImplementedError

    def _read_i64(self) -> int:
        raise NotImplementedError

    def _read_double(self) -> float:
        raise NotImplementedError

    def _read_length(self) -> int:
        raise NotImplementedError

    def _read_bytes_view(self) -> memoryview:
        n = self._read_length()
        pos = self._take(n)
        return self.buf[pos : pos + n]

    def _read_string(self) -> str:
        view = self._read_bytes_view()
        try:
            return str(view, "utf-8")
        except UnicodeDecodeError as exc:
            raise RemoteProtocolError(f"string is not valid UTF-8: {exc}") from None

    # -- the walk --------------------------------------------------------------

    def read_struct(self, cls: Any) -> Any:
        """Decode a struct of the thriftpy2 class ``cls``."""
        plan = _PLANS.get(cls) or _plan(cls)
        by_id = plan.by_id
        values: dict[str, Any] = {}
        self._struct_begin()
        while True:
            wire, fid = self._field_begin()
            if wire == TType.STOP:
                break
            field = by_id.get(fid)
            if field is None or field[0] != wire:
                self.skip(wire)  # a field of a newer IDL, or of another type
                continue
            values[field[1]] = self._read_value(field[2], field[3])
        self._struct_end()
        return _build(cls, plan, values)

    def _read_value(self, ttype: int, sub: Any) -> Any:
        """Read a value of spec type ``ttype`` (``sub``: its normalised sub-spec)."""
        if ttype == TType.BINARY:
            return self._read_bytes_view()
        if ttype == TType.STRING:
            return self._read_string()
        if ttype == TType.I32:
            return self._read_i32()
        if ttype == TType.I64:
            return self._read_i64()
        if ttype == TType.STRUCT:
            return self.read_struct(sub)
        if ttype == TType.LIST or ttype == TType.SET:
            return self._read_list(ttype, sub)
        if ttype == TType.MAP:
            return self._read_map(sub)
        if ttype == TType.BOOL:
            return self._read_bool()
        if ttype == TType.BYTE:
            return self._read_byte()
        if ttype == TType.I16:
            return self._read_i16()
        if ttype == TType.DOUBLE:
            return self._read_double()
        raise RemoteProtocolError(f"unsupported type {ttype}")

    def _read_list(self, ttype: int, sub: Any) -> Any:
        etype, esub, ewire = sub
        wire, count = self._list_begin()
        if count and wire != ewire:
            raise RemoteProtocolError(f"list of type {wire} where {etype} was expected")
        self._check_count(count, (wire,))
        self._enter()
        items = [self._read_value(etype, esub) for _ in range(count)]
        self.depth -= 1
        return set(items) if ttype == TType.SET else items

    def _read_map(self, sub: Any) -> dict:
        ktype, ksub, kwire_want, vtype, vsub, vwire_want = sub
        kwire, vwire, count = self._map_begin()
        if count and (kwire != kwire_want or vwire != vwire_want):
            raise RemoteProtocolError(f"map of types {kwire}, {vwire} is not the expected one")
        self._check_count(count, (kwire, vwire))
        self._enter()
        result = {}
        for _ in range(count):
            key = self._read_value(ktype, ksub)
            result[key] = self._read_value(vtype, vsub)
        self.depth -= 1
        return result

    def skip(self, wire: int) -> None:
        """Step over one value of wire type ``wire``."""
        if wire == TType.STRUCT:
            self._struct_begin()
            while True:
                ftype, _ = self._field_begin()
                if ftype == TType.STOP:
                    break
                self.skip(ftype)
            self._struct_end()
        elif wire == TType.LIST or wire == TType.SET:
            etype, count = self._list_begin()
            self._check_count(count, (etype,))
            self._enter()
            for _ in range(count):
                self.skip(etype)
            self.depth -= 1
        elif wire == TType.MAP:
            ktype, vtype, count = self._map_begin()
            self._check_count(count, (ktype, vtype))
            self._enter()
            for _ in range(count):
                self.skip(ktype)
                self.skip(vtype)
            self.depth -= 1
        elif wire == TType.STRING:
            self._take(self._read_length())
        elif wire in _SCALAR_TYPES:
            self._read_value(wire, None)
        else:
            raise RemoteProtocolError(f"unknown type {wire}")

    def read_body(self, cls: Any) -> Any:
        """Decode the message's struct and check that it ends the buffer."""
        body = self.read_struct(cls)
        if not self.stream and self.pos != self.end:
            raise RemoteProtocolError(
                f"{self.end - self.pos} bytes follow the message in its frame"
            )
        return body


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
            if word & 0xFFFF0000 == _BINARY_VERSION and n >= 0 and p + n + 4 <= end:
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
        name = self._read_string()
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
    # A struct is read by code made for its class (see _binary_reader): the
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


_S_HEAD_I32 = struct.Struct("!bhi")  # a field header and the 4 bytes after it
_S_HEAD_I64 = struct.Struct("!bhq")  # a field header and the 8 bytes after it
_S_HEAD_LIST = struct.Struct("!bhbi")  # a field header and a list's header
_S_HEAD_MAP = struct.Struct("!bhbbi")  # a field header and a map's header
# Lists of a few i64 (shapes), by count: unpacked without making a format each time.
_UNPACK_I64S = [struct.Struct(f"!{n}q").unpack_from for n in range(9)]


_BINARY_READERS: dict[Any, Callable[[BinaryReader], Any]] = {}


def _binary_reader_of(cls: Any) -> Callable[[BinaryReader], Any]:
    read = _BINARY_READERS.get(cls)
    if read is None:
        read = _BINARY_READERS[cls] = _binary_reader(cls)
    return read


def _lazy_reader(env: dict[str, Any], key: str, cls: Any) -> Callable[[BinaryReader], Any]:
    """A stand-in for the reader of ``cls`` in ``env[key]``: on its first call it
    puts the real one there (made then, so that recursive structs are no problem)."""

    def first_call(reader: BinaryReader) -> Any:
        read = env[key] = _binary_reader_of(cls)
        return read(reader)

    return first_call


def _binary_reader(cls: Any) -> Callable[[BinaryReader], Any]:
    """Make the code that reads a struct of class ``cls`` (BinaryReader.read_struct).

    It expects each field in id order and reads it in place when its header
    is there and its bytes are all there; else it moves on to the next one.
    A STOP after a field ends the struct at once (the fields after it are
    absent). Whatever it does not read (it never reads past ``end``, and
    breaks off on a bad length or invalid UTF-8) the general walk reads from
    there, so the outcome is the general walk's. Names and sub-specs are the
    code's constants, never its text. A nested struct is read by its class's
    own code, called directly.
    """
    plan = _plan(cls)
    env: dict[str, Any] = {
        "CLS": cls,
        "MAX_DEPTH": MAX_DEPTH,
        "RemoteProtocolError": RemoteProtocolError,
        "BY_ID": plan.by_id,
        "U_BH": _S_FIELD.unpack_from,  # a field header
        "U_BHI": _S_HEAD_I32.unpack_from,
        "U_BHQ": _S_HEAD_I64.unpack_from,
        "U_BHBI": _S_HEAD_LIST.unpack_from,
        "U_BHBBI": _S_HEAD_MAP.unpack_from,
        "U_I": _unpack_i32,
        "U_Q": _unpack_i64,
        "U_QS": _UNPACK_I64S,
        "UNPACK": struct.unpack_from,
    }
    code = [
        "def read(self):",
        "    depth = self.depth + 1",
        "    if depth > MAX_DEPTH:",
        "        raise RemoteProtocolError(DEEP)",
        "    self.depth = depth",
        "    buf = self.buf",
        "    end = self.end",
        "    pos = self.pos",
        "    values = {}",
        "    while True:  # once: a break goes on to the general walk",
    ]
    env["DEEP"] = f"message nests deeper than {MAX_DEPTH} levels"
    # The end: a STOP, read here; else (and after any break) the general walk.
    finish = ["{}self.depth = depth - 1"]
    for i, name in enumerate(plan.required):
        env[f"R{i}"], env[f"MISSING{i}"] = name, f"required field {cls.__name__}.{name} is missing"
        finish += [f"{{}}if R{i} not in values:", f"{{}}    raise RemoteProtocolError(MISSING{i})"]
    finish += ["{}return CLS(**values)"]
    # After a field: a STOP ends the struct (no need to look for the fields after it).
    stop_after = [
        "                if pos < end and buf[pos] == 0:",
        "                    self.pos = pos + 1",
        *(line.format(" " * 20) for line in finish),
    ]
    for i, (name, fid, ttype, sub, _, header) in enumerate(plan.in_order):
        if header is None:
            continue  # not a binary field header: the general walk's
        fid, ttype, wire = int(fid), int(ttype), int(_wire_type(ttype))
        env[f"N{i}"], env[f"S{i}"] = name, sub
        match = f"            if f == {fid} and w == {wire}:"
        if ttype in _T_BYTES:
            code += [
                "        if pos + 7 <= end:",
                "            w, f, n = U_BHI(buf, pos)",
                match,
                "                p = pos + 7",
                "                if n < 0 or p + n > end:",
                "                    break",
            ]
            if ttype == _T_BINARY:
                code += [f"                values[N{i}] = buf[p : p + n]"]
            else:
                code += [
                    "                try:",
                    f"                    values[N{i}] = str(buf[p : p + n], 'utf-8')",
                    "                except UnicodeDecodeError:",
                    "                    break",
                ]
            code += ["                pos = p + n"]
        elif ttype in (_T_I32, _T_I64):
            size, unpack = (7, "U_BHI") if ttype == _T_I32 else (11, "U_BHQ")
            code += [
                f"        if pos + {size} <= end:",
                f"            w, f, n = {unpack}(buf, pos)",
                match,
                f"                values[N{i}] = n",
                f"                pos += {size}",
            ]
        elif ttype == _T_LIST and sub[0] in (_T_I64, _T_STRUCT):
            # The list's header too, then as BinaryReader._read_list reads it
            # (the same checks, in the same order); any other list, its way.
            etype, esub, ewire = sub
            code += [
                "        if pos + 8 <= end:",
                "            w, f, e, count = U_BHBI(buf, pos)",
                f"            if f == {fid} and w == {wire} and e == {int(ewire)} and count >= 0 "
                "and depth < MAX_DEPTH:",
                "                self.pos = pos + 8",
            ]
            if etype == _T_I64:
                code += [
                    "                self._check_count_of(count, 8)",
                    "                pos += 8",
                    "                if pos + 8 * count > end:",
                    "                    self._overrun(8 * count)",
                    "                if count < 9:",
                    f"                    values[N{i}] = list(U_QS[count](buf, pos))",
                    "                else:",
                    f"                    values[N{i}] = list(UNPACK(f'!{{count}}q', buf, pos))",
                    "                pos += 8 * count",
                ]
            else:
                env[f"RS{i}"] = _lazy_reader(env, f"RS{i}", esub)
                code += [
                    "                self._check_count_of(count, 1)",
                    "                self.depth = depth + 1",
                    "                if count == 1:",
                    f"                    values[N{i}] = [RS{i}(self)]",
                    "                else:",
                    f"                    values[N{i}] = [RS{i}(self) for _ in range(count)]",
                    "                self.depth = depth",
                    "                pos = self.pos",
                ]
        elif ttype == _T_LIST and sub[0] == _T_STRING:
            # e.g. names: the list's header too, then as BinaryReader._read_list
            # reads it (the same checks, in the same order); it breaks off where
            # that would raise.
            code += [
                "        if pos + 8 <= end:",
                "            w, f, e, count = U_BHBI(buf, pos)",
                f"            if f == {fid} and w == {wire} and count >= 0 and depth < MAX_DEPTH "
                f"and (not count or e == {int(sub[2])}):",
                "                self.pos = pos + 8",
                "                self._check_count_of(count, 4)",
                "                p = pos + 8",
                "                found = []",
                "                for _ in range(count):",
                "                    if p + 4 > end:",
                "                        break",
                "                    n = U_I(buf, p)[0]",
                "                    p += 4",
                "                    if n < 0 or p + n > end:",
                "                        break",
                "                    try:",
                "                        found.append(str(buf[p : p + n], 'utf-8'))",
                "                    except UnicodeDecodeError:",
                "                        break",
                "                    p += n",
                "                else:",
                f"                    values[N{i}] = found",
                "                    pos = p",
                "                if pos != p:  # (the general walk counts them again)",
                "                    self.elements -= count",
                "                    break",
            ]
        elif (
            ttype == _T_MAP
            and sub[0] == _T_STRING
            and sub[3] in (_T_I32, _T_I64)
            and -128 <= int(sub[2]) < 128
            and -128 <= int(sub[5]) < 128
        ):
            # e.g. versions by name: the map's header too, then as
            # BinaryReader._read_map reads it (the same checks, in the same
            # order); it breaks off where that would raise.
            _, _, kwire, vtype, _, vwire = sub
            size, unpack = (4, "U_I") if vtype == _T_I32 else (8, "U_Q")
            code += [
                "        if pos + 9 <= end:",
                "            w, f, kw, vw, count = U_BHBBI(buf, pos)",
                f"            if f == {fid} and w == {wire} and count >= 0 and depth < MAX_DEPTH "
                f"and (not count or (kw == {int(kwire)} and vw == {int(vwire)})):",
                "                self.pos = pos + 9",
                f"                self._check_count_of(count, {4 + size})",
                "                p = pos + 9",
                "                found = {}",
                "                for _ in range(count):",
                "                    if p + 4 > end:",
                "                        break",
                "                    n = U_I(buf, p)[0]",
                "                    p += 4",
                f"                    if n < 0 or p + n + {size} > end:",
                "                        break",
                "                    try:",
                "                        key = str(buf[p : p + n], 'utf-8')",
                "                    except UnicodeDecodeError:",
                "                        break",
                "                    p += n",
                f"                    found[key] = {unpack}(buf, p)[0]",
                f"                    p += {size}",
                "                else:",
                f"                    values[N{i}] = found",
                "                    pos = p",
                "                if pos != p:  # (the general walk counts them again)",
                "                    self.elements -= count",
                "                    break",
            ]
        else:
            if ttype == _T_STRUCT:
                env[f"RS{i}"] = _lazy_reader(env, f"RS{i}", sub)
                reading = f"RS{i}(self)"
            elif ttype in _T_SEQUENCES:
                reading = f"self._read_list({ttype}, S{i})"
            elif ttype == _T_MAP:
                reading = f"self._read_map(S{i})"
            else:
                reading = f"self._read_value({ttype}, S{i})"
            code += [
                "        if pos + 3 <= end:",
                "            w, f = U_BH(buf, pos)",
                match,
                "                self.pos = pos + 3",
                f"                values[N{i}] = {reading}",
                "                pos = self.pos",
            ]
        code += stop_after
    code += [
        "        if pos < end and buf[pos] == 0:",
        "            self.pos = pos + 1",
        *(line.format(" " * 12) for line in finish),
        "        break",
        "    self.pos = pos",
        "    self._read_fields(BY_ID, values)",
        *(line.format(" " * 4) for line in finish),
    ]
    exec(compile("\n".join(code), "<aioparamsync.wire.codec: binary struct reader>", "exec"), env)
    read: Callable[[BinaryReader], Any] = env["read"]
    return read


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

    def __init__(self, buf: Any, *, stream: bool = False, limit: int = MAX_I32) -> None:
        super().__init__(buf, stream=stream, limit=limit)
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
        name = self._read_string()
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


_READERS: dict[Protocol, type[Reader]] = {
    Protocol.BINARY: BinaryReader,
    Protocol.COMPACT: CompactReader,
}


def decode_header(
    payload: Any, protocol: Protocol, *, stream: bool = False, limit: int = MAX_I32
) -> tuple[str, int, int, Reader]:
    """Read a message's header: answer (name, type, seqid, reader).

    ``reader.read_body(cls)`` then decodes the struct that follows.
    """
    # (an enum's hash is slow: test for the usual protocol first)
    reader_cls = BinaryReader if protocol is _PROTOCOL_BINARY else _READERS[protocol]
    reader = reader_cls(payload, stream=stream, limit=limit)
    name, mtype, seqid = reader.read_message_begin()
    return name, mtype, seqid, reader


class StreamMeasure:
    """Finds where an unframed message ends, as its bytes arrive.

    An unframed message has no length, so it has to be walked to be cut. The
    walk keeps its place (an explicit stack of the structs and containers it
    is in) and resumes there when more bytes arrive, so a message costs one
    walk whatever the number of packets it comes in. Each step reads one
    field header, one container header or one scalar, and changes the walk's
    state only once the step's bytes are all there.

    Args:
        protocol: the stream's protocol.
        limit: the most bytes a message may take.
    """

    def __init__(self, protocol: Protocol, limit: int) -> None:
        self.protocol = protocol
        self.limit = limit
        self.pos = 0  # bytes of the message walked so far
        self.elements = 0
        # None until the message header is read; then frames of
        # ["S", last field id] | ["L", element type, left] | ["M", key, value, left]
        self._stack: list[list[int | str]] | None = None

    def feed(self, buf: Any) -> int | None:
        """Walk on through ``buf`` (the message's bytes so far, from its start).

        Returns:
            The message's length once it is complete, else None.

        Raises:
            RemoteProtocolError: it is not a valid message, or is longer than ``limit``.
        """
        reader = _READERS[self.protocol](buf, stream=True, limit=self.limit)
        reader.pos = self.pos
        reader.elements = self.elements
        try:
            if self._stack is None:
                reader.read_message_begin()
                self.pos = reader.pos
                self._stack = [["S", 0]]
            while self._stack:
                self._step(reader, self._stack)
                self.pos = reader.pos
                self.elements = reader.elements
            if self.pos > self.limit:
                raise RemoteProtocolError(
                    f"message of {self.pos} bytes is longer than the limit of {self.limit}"
                )
            return self.pos
        except NeedData:
            return None
        finally:
            # Let the caller resize ``buf`` (a bytearray) whatever happened here.
            if reader.buf is not buf:
                reader.buf.release()

    @staticmethod
    def _open(reader: Reader, wire: int) -> list[int | str] | None:
        """Read a container's header: answer its frame (None for a scalar, skipped)."""
        if wire == TType.STRUCT:
            return ["S", 0]
        if wire == TType.LIST or wire == TType.SET:
            etype, count = reader._list_begin()
            reader._check_count(count, (etype,))
            return ["L", etype, count]
        if wire == TType.MAP:
            ktype, vtype, count = reader._map_begin()
            reader._check_count(count, (ktype, vtype))
            return ["M", ktype, vtype, 2 * count]
        reader.skip(wire)
        return None

    def _step(self, reader: Reader, stack: list[list[Any]]) -> None:
        if len(stack) > MAX_DEPTH:
            raise RemoteProtocolError(f"message nests deeper than {MAX_DEPTH} levels")
        top = stack[-1]
        if top[0] == "S":
            if isinstance(reader, CompactReader):
                reader._last_fid = top[1]
                reader._bool = None
            wire, fid = reader._field_begin()
            if wire == TType.STOP:
                stack.pop()
                return
            if (
                wire == TType.BOOL
                and isinstance(reader, CompactReader)
                and reader._bool is not None
            ):
                frame = None  # the value was in the field header
            else:
                frame = self._open(reader, wire)
            top[1] = fid
        elif top[0] == "L":
            if top[2] == 0:
                stack.pop()
                return
            size = reader.FIXED_SIZE.get(top[1])
            if size:
                # Step over every element that has arrived (at least one:
                # NeedData until it has). They were counted when the list opened.
                n = min(top[2], max((reader.end - reader.pos) // size, 1))
                reader._take(n * size)
                top[2] -= n
                return
            frame = self._open(reader, top[1])
            top[2] -= 1
        else:
            if top[3] == 0:
                stack.pop()
                return
            frame = self._open(reader, top[1] if top[3] % 2 == 0 else top[2])
            top[3] -= 1
        if frame is not None:
            stack.append(frame)


# ---------------------------------------------------------------------------
# Writing


def _as_bytes_view(value: Any) -> memoryview:
    view = value if isinstance(value, memoryview) else memoryview(value)
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except TypeError as exc:
            raise LocalProtocolError(f"binary value must be a C-contiguous buffer: {exc}") from None
    elif not view.c_contiguous:
        raise LocalProtocolError("binary value must be a C-contiguous buffer")
    return view


class Writer:
    """Encodes into a list of buffers: its own bytes, and large binaries by reference."""

    __slots__ = ("out", "parts", "size")

    def __init__(self) -> None:
        self.out = bytearray()
        self.parts: list[Any] = []
        self.size = 0  # bytes in parts (not counting out)

    def _write_view(self, view: memoryview) -> None:
        if len(view) >= ZERO_COPY_MIN_BYTES:
            if self.out:
                self.parts.append(self.out)
                self.size += len(self.out)
                self.out = bytearray()
            self.parts.append(view)
            self.size += len(view)
        else:
            self.out += view

    def getvalue(self) -> tuple[list[Any], int]:
        """Answer (buffers, total length)."""
        parts = self.parts
        if self.out:
            parts.append(self.out)
        return parts, self.size + len(self.out)

    # -- per protocol ---------------------------------------------------------

    def write_message_begin(self, name: str, mtype: int, seqid: int) -> None:
        raise NotImplementedError

    def _field_begin(self, ttype: int, fid: int, value: Any) -> bool:
        """Write a field header; answer True where it carried the value."""
        raise NotImplementedError

    def _field_stop(self) -> None:
        raise NotImplementedError

    def _struct_begin(self) -> None:
        pass

    def _struct_end(self) -> None:
        pass

    def _list_begin(self, etype: int, count: int) -> None:
        raise NotImplementedError

    def _map_begin(self, ktype: int, vtype: int, count: int) -> None:
        raise NotImplementedError

    def _write_scalar(self, ttype: int, value: Any) -> None:
        raise NotImplementedError

    def _write_length(self, n: int) -> None:
        raise NotImplementedError

    # -- the walk ---------------------------------------------------------------

    def write_struct(self, obj: Any) -> None:
        cls = type(obj)
        plan = _PLANS.get(cls) or _plan(cls)
        self._struct_begin()
        for name, fid, ttype, sub, required, _ in plan.in_order:
            value = getattr(obj, name, None)
            if value is None:
                if required:
                    raise LocalProtocolError(f"required field {cls.__name__}.{name} is missing")
                continue
            if not self._field_begin(ttype, fid, value):
                self._write_value(ttype, sub, value)
        self._field_stop()
        self._struct_end()

    def _write_value(self, ttype: int, sub: Any, value: Any) -> None:
        """Write a value of spec type ``ttype`` (``sub``: its normalised sub-spec)."""
        if ttype in _T_BYTES:
            if isinstance(value, str):
                value = value.encode("utf-8")
            view = _as_bytes_view(value)
            if len(view) > MAX_I32:
                raise LocalProtocolError(f"a value of {len(view)} bytes exceeds Thrift's 2 GiB")
            self._write_length(len(view))
            self._write_view(view)
        elif ttype == _T_STRUCT:
            self.write_struct(value)
        elif ttype in _T_SEQUENCES:
            etype, esub, ewire = sub
            items = list(value)
            self._list_begin(ewire, len(items))
            for item in items:
                self._write_value(etype, esub, item)
        elif ttype == _T_MAP:
            ktype, ksub, kwire, vtype, vsub, vwire = sub
            self._map_begin(kwire, vwire, len(value))
            for key, item in value.items():
                self._write_value(ktype, ksub, key)
                self._write_value(vtype, vsub, item)
        else:
            self._write_scalar(ttype, value)


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


_BINARY_WRITERS: dict[Any, Callable[[BinaryWriter, Any], None]] = {}
# A list's header and its few i64 (shapes), by count: packed without making a format each time.
_PACK_LIST_I64S = [struct.Struct(f"!bi{n}q").pack for n in range(9)]


def _binary_writer_of(cls: Any) -> Callable[[BinaryWriter, Any], None]:
    write = _BINARY_WRITERS.get(cls)
    if write is None:
        write = _BINARY_WRITERS[cls] = _binary_writer(cls)
    return write


def _lazy_writer(env: dict[str, Any], key: str, cls: Any) -> Callable[[BinaryWriter, Any], None]:
    """A stand-in for the writer of ``cls`` in ``env[key]``: on its first call it
    puts the real one there (made then, so that recursive structs are no problem)."""

    def first_call(writer: BinaryWriter, obj: Any) -> None:
        write = env[key] = _binary_writer_of(cls)
        write(writer, obj)

    return first_call


def _binary_writer(cls: Any) -> Callable[[BinaryWriter, Any], None]:
    """Make the code that writes a struct of class ``cls`` (BinaryWriter.write_struct).

    Field by field in id order, as Writer.write_struct: a header packed once,
    the common values written in place (strings, binaries, i32, i64, and
    lists of structs, strings or i64, maps of strings to i32 or i64), the
    others (and every binary that goes by reference) by the writer's
    methods. A nested struct of the field's class is written by that class's
    own code, called directly (any other object, by ``write_struct``). Names
    are the code's constants, never its text.
    """
    plan = _plan(cls)
    env: dict[str, Any] = {
        "LocalProtocolError": LocalProtocolError,
        "PACK_I32": _pack_i32,
        "PACK_I64": _pack_i64,
        "PACK_LIST": _S_LIST.pack,
        "PACK_MAP": _S_MAP.pack,
        "PACK_LIST_I64S": _PACK_LIST_I64S,
        "PACK": struct.pack,
        "SMALL": ZERO_COPY_MIN_BYTES,
    }
    # A string or binary ``{value}`` (in place if it is small text or bytes, or
    # a small flat view of bytes: what _write_bytes would do with them).
    write_bytes = [
        "{0}if type({1}) is str:",
        "{0}    {1} = {1}.encode('utf-8')",
        "{0}if type({1}) is bytes and len({1}) < SMALL:",
        "{0}    out += PACK_I32(len({1}))",
        "{0}    out += {1}",
        "{0}elif (",
        "{0}    type({1}) is memoryview and {1}.nbytes < SMALL and {1}.format == 'B'",
        "{0}    and {1}.ndim == 1 and {1}.c_contiguous",
        "{0}):",
        "{0}    out += PACK_I32({1}.nbytes)",
        "{0}    out += {1}",
        "{0}else:",
        "{0}    self._write_bytes({1})",
        "{0}    out = self.out",
    ]
    # Every field's value at once (as getattr(obj, name, None) each, if one is missing).
    names = [name for name, *_ in plan.in_order]
    env["GET"] = operator.attrgetter(*names) if names else None
    code = ["def write(self, obj):"]
    if names:
        targets = ", ".join(f"v{i}" for i in range(len(names))) + ("," if len(names) == 1 else "")
        code += [
            "    try:",
            f"        {targets} = {'(GET(obj),)' if len(names) == 1 else 'GET(obj)'}",
            "    except AttributeError:",
            *(f"        v{i} = getattr(obj, N{i}, None)" for i in range(len(names))),
        ]
    code += ["    out = self.out"]
    for i, (name, _, ttype, sub, required, header) in enumerate(plan.in_order):
        ttype = int(ttype)
        env[f"N{i}"], env[f"H{i}"], env[f"S{i}"] = name, header, sub
        env[f"MISSING{i}"] = f"required field {cls.__name__}.{name} is missing"
        env[f"NO_HEADER{i}"] = f"field {cls.__name__}.{name}: no binary field header"
        code += [f"    v = v{i}"]
        if required:
            code += ["    if v is None:", f"        raise LocalProtocolError(MISSING{i})"]
        code += ["    if v is not None:"]
        if header is None:
            code += [f"        raise LocalProtocolError(NO_HEADER{i})"]
            continue
        code += [f"        out += H{i}"]
        if ttype in _T_BYTES:
            code += [line.format(" " * 8, "v") for line in write_bytes]
        elif ttype == _T_I32:
            code += ["        out += PACK_I32(v)"]
        elif ttype == _T_I64:
            code += ["        out += PACK_I64(v)"]
        elif ttype == _T_STRUCT:
            env[f"C{i}"], env[f"W{i}"] = sub, _lazy_writer(env, f"W{i}", sub)
            code += [
                f"        if type(v) is C{i}:",
                f"            W{i}(self, v)",
                "        else:",
                "            self.write_struct(v)",
                "        out = self.out",
            ]
        elif ttype == _T_LIST and sub[0] in (_T_STRUCT, _T_I64, _T_STRING, _T_BINARY):
            # As BinaryWriter._write_value writes a list, in place.
            etype, esub, ewire = sub
            code += [
                "        items = v if type(v) is list else list(v)",
                "        count = len(items)",
            ]
            if etype == _T_I64:
                code += [
                    "        if not count:",
                    f"            out += PACK_LIST({int(ewire)}, 0)",
                    "        elif count < 9:",
                    f"            out += PACK_LIST_I64S[count]({int(ewire)}, count, *items)",
                    "        else:",
                    f"            out += PACK(f'!bi{{count}}q', {int(ewire)}, count, *items)",
                ]
            elif etype == _T_STRUCT:
                env[f"C{i}"], env[f"W{i}"] = esub, _lazy_writer(env, f"W{i}", esub)
                code += [
                    f"        out += PACK_LIST({int(ewire)}, count)",
                    "        for item in items:",
                    f"            if type(item) is C{i}:",
                    f"                W{i}(self, item)",
                    "            else:",
                    "                self.write_struct(item)",
                    "        out = self.out",
                ]
            else:
                code += [
                    f"        out += PACK_LIST({int(ewire)}, count)",
                    "        for item in items:",
                    *(line.format(" " * 12, "item") for line in write_bytes),
                ]
        elif ttype == _T_MAP and sub[0] == _T_STRING and sub[3] in (_T_I32, _T_I64):
            # As BinaryWriter._write_value writes such a map, in place.
            _, _, kwire, vtype, _, vwire = sub
            pack = "PACK_I32" if vtype == _T_I32 else "PACK_I64"
            code += [
                f"        out += PACK_MAP({int(kwire)}, {int(vwire)}, len(v))",
                "        for key, item in v.items():",
                *(line.format(" " * 12, "key") for line in write_bytes),
                f"            out += {pack}(item)",
            ]
        else:
            code += [f"        self._write_value({ttype}, S{i}, v)", "        out = self.out"]
    code += ["    out.append(0)"]
    exec(compile("\n".join(code), "<aioparamsync.wire.codec: binary struct writer>", "exec"), env)
    write: Callable[[BinaryWriter, Any], None] = env["write"]
    return write


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


_WRITERS: dict[Protocol, type[Writer]] = {
    Protocol.BINARY: BinaryWriter,
    Protocol.COMPACT: CompactWriter,
}


def encode_message(
    name: str,
    mtype: int,
    seqid: int,
    body: Any,
    protocol: Protocol = Protocol.BINARY,
    *,
    framed: bool = True,
) -> tuple[list[Any], int]:
    """Encode one message; answer (buffers for ``writelines``, total bytes).

    Large ``binary`` values are in the list by reference: they must not change
    until the buffers are written. A message without any is one buffer.

    Raises:
        LocalProtocolError: a value the protocol cannot carry.
    """
    writer = BinaryWriter() if protocol is _PROTOCOL_BINARY else _WRITERS[protocol]()
    if framed:
        writer.out += b"\0\0\0\0"  # the frame's length, known at the end
    try:
        writer.write_message_begin(name, mtype, seqid)
        writer.write_struct(body)
    except LocalProtocolError:
        raise
    except (struct.error, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise LocalProtocolError(f"cannot encode {name}: {exc}") from None
    parts, size = writer.getvalue()
    if framed:
        if size - 4 > MAX_I32:
            raise LocalProtocolError(f"message of {size - 4} bytes exceeds Thrift's 2 GiB frame")
        _S_I32.pack_into(parts[0], 0, size - 4)  # parts[0] starts with the 4 bytes
    return parts, size
