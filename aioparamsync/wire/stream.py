"""Measuring an unframed message on a stream: :class:`StreamMeasure`.

Theory of operation. The measure walks a message with its protocol's reader
in stream mode, where running out of bytes raises :class:`~.reader.NeedData`
instead of a protocol error. A reader lasts one call; the measure keeps what
the walk needs between calls: the bytes walked so far, the container
elements counted (the per-message bound), and the stack of structs and
containers the walk is in (a struct's frame holds its last field id, which
compact field ids are deltas from). A step cut short by ``NeedData`` has
changed none of that, so the next call takes it again, whole.
"""

from __future__ import annotations

from typing import Any

from thriftpy2.thrift import TType

from ..errors import RemoteProtocolError
from .codec import _READERS
from .compact import CompactReader
from .idl import MAX_METHOD_NAME_BYTES
from .protocol import Protocol
from .reader import MAX_DEPTH, NeedData, OverLimit, Reader

__all__ = ["StreamMeasure"]


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
        reader = _READERS[self.protocol](
            buf, stream=True, limit=self.limit, name_limit=MAX_METHOD_NAME_BYTES
        )
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
                raise OverLimit(
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
