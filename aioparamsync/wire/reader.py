"""The reader: one message walked in one buffer, every read bounds-checked.

Theory of operation. A message is decoded from one contiguous buffer (a
frame's payload, or the bytes an unframed connection has received so far).
Every read checks the bytes left before it reads, so a message can never run
past the end of its buffer and a count (a list of 10**9 elements, a string of
2 GiB) is refused before anything is allocated for it. ``binary`` fields
decode to read-only ``memoryview`` slices of the buffer (no copy: a 64 MiB
parameter stays where the socket put it). :class:`Reader` holds the bounds
and the general walk, driven by each struct class's plan; the protocols'
primitives are its subclasses' (:mod:`.binary`, :mod:`.compact`).

Decoding on a stream (unframed connections) raises :class:`NeedData` with the
number of bytes the message needs at least, so the caller waits for that many
before trying again, instead of re-parsing on every packet.
"""

from __future__ import annotations

from typing import Any, ClassVar

from thriftpy2.thrift import TType

from ..errors import RemoteProtocolError
from .plan import _PLANS, _build, _plan
from .protocol import _S_I8, MAX_I32

__all__ = ["NeedData", "OverLimit", "Reader", "name_too_long"]

# Deepest nesting of structs and containers a message may have.
MAX_DEPTH = 64
# Most container elements one message may hold, all containers together: it
# bounds the time one message can take to decode (about 1 s in Python).
MAX_ELEMENTS = 2_000_000

_SCALAR_TYPES = frozenset(
    (TType.BOOL, TType.BYTE, TType.I16, TType.I32, TType.I64, TType.DOUBLE, TType.STRING)
)


def name_too_long(n: int, limit: int) -> RemoteProtocolError:
    """What a message whose method name claims ``n`` bytes, more than ``limit``, is."""
    return RemoteProtocolError(f"method name of {n} bytes: longer than any method's ({limit})")


class OverLimit(RemoteProtocolError):
    """A message on a stream longer than the reader's ``limit`` (its receiver's frame limit)."""


class NeedData(Exception):
    """A message on a stream needs at least ``needed`` bytes (from its start)."""

    def __init__(self, needed: int) -> None:
        super().__init__(needed)
        self.needed = needed


class Reader:
    """Walks one message in a buffer; the protocol's primitives are subclasses'.

    Args:
        buf: the bytes (any buffer); kept, not copied.
        stream: True where more bytes may follow (unframed): running out
            raises :class:`NeedData` instead of a protocol error.
        limit: with ``stream``, the most bytes a message may take.
        name_limit: the longest method name a message may have (bytes): a
            longer one is refused as soon as its length is read, not waited for.
    """

    __slots__ = ("buf", "depth", "elements", "end", "limit", "name_limit", "pos", "stream")
    # The fewest bytes an element of each wire type takes (refuses counts
    # that cannot fit in what is left before anything is allocated).
    MIN_SIZE: ClassVar[dict[int, int]] = {}
    # Wire types whose list elements all take the same bytes (a walk that
    # only measures steps over many at once).
    FIXED_SIZE: ClassVar[dict[int, int]] = {}

    def __init__(
        self, buf: Any, *, stream: bool = False, limit: int = MAX_I32, name_limit: int = MAX_I32
    ) -> None:
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
        self.name_limit = name_limit
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
                raise OverLimit(
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

    def _read_name(self) -> str:
        """A message's method name; one of more than ``name_limit`` bytes is refused
        at once, before its bytes are taken (on a stream: waited for)."""
        start = self.pos
        n = self._read_length()
        if n > self.name_limit:
            raise name_too_long(n, self.name_limit)
        self.pos = start
        return self._read_string()

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
