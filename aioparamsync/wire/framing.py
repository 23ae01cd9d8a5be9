"""Cutting a connection's bytes into messages: framed or not, binary or compact.

Theory of operation. A :class:`Receiver` is the receiving half of one
connection, with no I/O of its own: the transport asks it for a buffer
(:meth:`Receiver.get_buffer`), lets the socket fill it, and reports how many
bytes arrived (:meth:`Receiver.buffer_updated`), which answers the complete
messages, as :class:`Frame` objects. It fits ``asyncio.BufferedProtocol``
as is, and tests feed it bytes with :meth:`Receiver.feed`.

The first byte of a connection tells its framing. A strict binary message
starts 0x80 0x01 and a compact one 0x82; anything else is the first byte of
a 4-byte big-endian frame length, and each frame's first byte then tells its
protocol. A length must lie in ``0..max_frame_bytes``, checked before any
allocation: an HTTP request ("GET " reads as a 1.19 GB frame) or a TLS
handshake is refused at once. So is a frame whose first bytes begin no
message, as soon as they are there: a first byte of neither protocol, or a
method name longer than the IDL's longest (random bytes claim names of any
length, and the rest of such a frame would never come). An empty frame is
skipped (Apache Thrift's ``TFramedTransport`` sends one when flushed with
nothing written).

Small frames are read into one scratch buffer and copied out (one cheap
copy). A frame larger than ``LARGE_FRAME_BYTES`` gets one buffer of its exact
size that the socket fills directly, and the frame is handed out as a view of
it, so a 64 MiB parameter is never copied between the kernel and the store.
That buffer is allocated but not written (``numpy.empty``): its memory is
taken as the bytes arrive, so a header that promises 256 MiB and sends
nothing costs nothing, and no time is spent zeroing what the socket fills.
But a new buffer's pages are new to the process: the kernel zeroes each
before the socket fills it (a third of a 64 MiB push's time, in profiles).
So the buffer of a frame that no one holds any more (a push's gradients,
folded; a read's answer, dropped) is kept, one (:class:`_Kept`), and the
next large frame it fits is received into it. A frame an update's value keeps
is let go when a later update replaces that value: its memory is kept then by
:mod:`aioparamsync.blocks`, the next new buffer of its size.
Receivers may share a :class:`ReceiveBudget`, which bounds the bytes that
large frames being received hold at once, all connections together.

Unframed messages have no length: a
:class:`~aioparamsync.wire.stream.StreamMeasure` walks each one as its bytes
arrive, resuming where it stopped, to find where it ends.
"""

from __future__ import annotations

import collections
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..blocks import empty
from ..errors import RemoteProtocolError
from .codec import claimed_name_length
from .idl import MAX_METHOD_NAME_BYTES
from .protocol import Protocol
from .reader import OverLimit, name_too_long
from .stream import StreamMeasure

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_RECEIVING_BYTES",
    "Frame",
    "ReceiveBudget",
    "Receiver",
]

# Largest frame (or unframed message) a node accepts unless told otherwise.
DEFAULT_MAX_FRAME_BYTES = 256 * 1024 * 1024
# Bytes that large frames being received may hold, all connections together,
# unless told otherwise (see ReceiveBudget): room for two 64 MiB parameters,
# where eight concurrent 64 MiB updates keep the loopback's pace (1.00x the
# ceiling, against 0.88x with room for one: benchmarks/README.md).
DEFAULT_MAX_RECEIVING_BYTES = 128 * 1024 * 1024
# Bytes the socket reads at once into the scratch buffer.
SCRATCH_BYTES = 256 * 1024
# The largest buffer of a frame kept for the next one when no one holds it (see the
# module): a 64 MiB tensor's, with its message around it.
KEPT_BUFFER_BYTES = 65 * 1024 * 1024
# Frames larger than this are received into a buffer of their own.
LARGE_FRAME_BYTES = 64 * 1024
# The send buffer of each end of a Unix socket connection (the kernel caps it at
# net.core.wmem_max). Its default, 208 KiB, is far below what loopback TCP grows to:
# a push of 200 x 4 KiB woke its reader four times, and Unix sockets ran B's step at
# 0.83x TCP; with 4 MiB, at TCP's pace or above (see docs/performance.md).
UNIX_SEND_BUFFER_BYTES = 4 * 1024 * 1024

_S_LEN = struct.Struct("!i")
# The first byte of each protocol's messages (an enum's .value is slow to get).
_BINARY_BYTE = Protocol.BINARY.value
_COMPACT_BYTE = Protocol.COMPACT.value
_PROTOCOL_BINARY = Protocol.BINARY
_FRAME_PROTOCOLS = {_BINARY_BYTE: Protocol.BINARY, _COMPACT_BYTE: Protocol.COMPACT}


@dataclass(frozen=True, slots=True, init=False)
class Frame:
    """One complete message as received.

    Attributes:
        payload: the message's bytes (read-only; a binary field decoded from it
            is a view of it, so it lives as long as such a view does).
        protocol: its protocol.
        framed: whether it came in a frame (a reply goes back the same way).
    """

    payload: memoryview
    protocol: Protocol
    framed: bool

    def __init__(self, payload: memoryview, protocol: Protocol, framed: bool) -> None:
        # Its slots set directly: half the time of a frozen dataclass's own
        # __init__ (which goes through object.__setattr__), once per message.
        _set_payload(self, payload)
        _set_protocol(self, protocol)
        _set_framed(self, framed)


_set_payload = vars(Frame)["payload"].__set__
_set_protocol = vars(Frame)["protocol"].__set__
_set_framed = vars(Frame)["framed"].__set__


def _describe_length(header: bytes, size: int) -> str | None:
    """What the bytes of a frame length that cannot be one look like, if anything."""
    if header.isascii() and header.decode("ascii").isprintable():
        return f"{header!r}: this looks like text, e.g. HTTP; the node speaks Thrift"
    if header[:2] in (b"\x16\x03", b"\x16\x02"):
        return "this looks like a TLS handshake; the node is not using TLS"
    return None


def _size(nbytes: int) -> str:
    """``268435456`` -> ``"268435456 bytes, 256 MiB"``; sizes that are no whole MiB as bytes."""
    mib, rest = divmod(nbytes, 1 << 20)
    return f"{nbytes} bytes, {mib} MiB" if mib and not rest else f"{nbytes} bytes"


class ReceiveBudget:
    """The bytes that large frames being received may hold, all connections together.

    A large frame takes its memory as it arrives, beside what the node already
    holds: eight clients each replacing a 64 MiB parameter would otherwise have
    eight new buffers filling at once next to the eight stored ones. So a
    :class:`Receiver` asks the budget before it allocates a large frame's buffer.
    A frame that does not fit waits (its owner stops reading, and TCP holds the
    sender back) until frames ahead of it are complete. A frame bigger than the
    whole budget goes when nothing else is being received. Waiters are let in
    in the order they asked, so a stream of smaller frames cannot starve a big
    one. Frames received one after another finish sooner, on average, than
    frames received side by side; the price is that fewer bytes are in flight
    at once (one or two sockets' buffers, not eight): on loopback, eight
    concurrent 64 MiB updates went at 0.88x the ceiling with room for one
    frame, and 1.00x with room for two, the default (see ``benchmarks/README.md``).

    A :class:`Receiver` asks for a frame's bytes beyond its first
    ``LARGE_FRAME_BYTES``, as smaller frames ask for nothing: a 64 MiB
    parameter's message is a little over 64 MiB (its header, name, dtype and
    shape), and a budget of 128 MiB is meant to take two of them.

    It is accounting only, with no clock and no I/O: a frame that must wait
    leaves a callback, called (from :meth:`release`, :meth:`cancel` or
    :meth:`grant_next`) once its bytes are granted. Its owner watches
    :attr:`received` to tell a budget held by frames that no longer move, and
    lets the next frame in with :meth:`grant_next` (see ``aioparamsync.server.transport``).

    Args:
        limit: in bytes; ``None``: no limit, every frame goes at once.
    """

    def __init__(self, limit: int | None = DEFAULT_MAX_RECEIVING_BYTES) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"a receive budget must be at least 1 byte, not {limit}")
        self.limit = limit
        self.in_use = 0  # bytes granted to frames not yet complete
        self.received = 0  # bytes that have arrived into granted buffers, ever
        self._waiting: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()

    def __repr__(self) -> str:
        return (
            f"<ReceiveBudget {self.in_use} of {self.limit} bytes in use, "
            f"{len(self._waiting)} frames waiting>"
        )

    @property
    def waiting(self) -> int:
        """How many frames wait for room."""
        return len(self._waiting)

    def reserve(self, nbytes: int, on_grant: Callable[[], None]) -> bool:
        """Take ``nbytes`` if they fit now (True); else queue ``on_grant`` (False)."""
        if not self._waiting and self._fits(nbytes):
            self.in_use += nbytes
            return True
        self._waiting.append((nbytes, on_grant))
        return False

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` took (or granted); let waiters in."""
        self.in_use -= nbytes
        self._grant(force=False)

    def cancel(self, on_grant: Callable[[], None]) -> None:
        """Withdraw a waiting request (its connection went away)."""
        self._waiting = collections.deque(w for w in self._waiting if w[1] != on_grant)
        self._grant(force=False)

    def grant_next(self) -> None:
        """Let the first waiting frame in, whether or not it fits."""
        self._grant(force=True)

    def _fits(self, nbytes: int) -> bool:
        return self.limit is None or self.in_use == 0 or self.in_use + nbytes <= self.limit

    def _grant(self, *, force: bool) -> None:
        waiting = self._waiting
        while waiting:
            nbytes, on_grant = waiting[0]
            if not force and not self._fits(nbytes):
                return
            force = False
            waiting.popleft()
            self.in_use += nbytes
            on_grant()


class Receiver:
    """The receiving half of one connection (see the module's docstring).

    Args:
        max_frame_bytes: the largest frame or unframed message accepted.
        framed: ``None`` to tell from the first byte; ``True`` to accept only
            frames (a client's connection).
        budget: shared with other receivers; a large frame waits for room in it
            before its buffer is allocated (see :class:`ReceiveBudget`). While
            it waits, :attr:`waiting_for_budget` is true and the owner should
            stop reading; once room is granted, :attr:`on_grant` is called, and
            the owner calls ``buffer_updated(0)`` to go on. A large frame's
            share is given back when the owner calls :meth:`release_handed`
            (after handing the frame on) or :meth:`close`.
        limit_name: what sets ``max_frame_bytes``, named in the error that
            refuses a larger message (a node's flag; a client's own option).

    Raises (from :meth:`buffer_updated`):
        RemoteProtocolError: the bytes cannot be a valid message; the
            connection is beyond repair.
    """

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        *,
        framed: bool | None = None,
        budget: ReceiveBudget | None = None,
        limit_name: str = "the node's --max-frame-bytes",
    ) -> None:
        if max_frame_bytes < 16:
            raise ValueError(f"max_frame_bytes must be at least 16, not {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.limit_name = limit_name
        self.framed = framed
        self.protocol: Protocol | None = None  # of the unframed stream
        self._scratch = bytearray(SCRATCH_BYTES)
        # Slices of this copy once (a bytearray's slice is a copy of its own).
        self._scratch_view = memoryview(self._scratch)
        self._start = 0  # unread bytes are _scratch[_start:_end]
        self._end = 0
        self._large: memoryview | None = None  # a large frame being filled
        self._large_filled = 0
        self._begun_checked = False  # the method name the frame being received claims: checked
        self._stream = bytearray()  # unframed: bytes of the message(s) so far
        self._measure: StreamMeasure | None = None  # unframed: the walk of the message
        self.bytes_received = 0
        self._budget = budget
        # Bytes asked of the budget for the large frame (next or being filled);
        # granted unless waiting_for_budget.
        self._reserved = 0
        self._handed = 0  # bytes granted for large frames handed out, not yet released
        self.waiting_for_budget = False
        self.on_grant: Callable[[], None] | None = None

    def __repr__(self) -> str:
        mode = {None: "undecided", True: "framed", False: "unframed"}[self.framed]
        pending = self.pending_bytes
        return f"<Receiver {mode}, {pending} bytes of an incomplete message>"

    @property
    def receiving_large(self) -> bool:
        """Whether a large frame (over ``LARGE_FRAME_BYTES``) is arriving now."""
        return self._large is not None

    @property
    def pending_bytes(self) -> int:
        """Bytes received that are not yet part of a complete message."""
        return self._end - self._start + self._large_filled + len(self._stream)

    def get_buffer(self) -> memoryview:
        """A buffer for the socket to fill (``BufferedProtocol.get_buffer``)."""
        if self._large is not None:
            return self._large[self._large_filled :]
        if self._end == len(self._scratch):
            # Move the partial message to the front to make room.
            unread = self._end - self._start
            view = self._scratch_view
            view[:unread] = view[self._start : self._end]
            self._start, self._end = 0, unread
        return self._scratch_view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last buffer; answer complete frames."""
        self.bytes_received += nbytes
        frames: list[Frame] = []
        if self._large is not None:
            self._large_filled += nbytes
            if self._budget is not None:
                self._budget.received += nbytes
            self._check_begun(self._large[: self._large_filled])
            if self._large_filled == len(self._large):
                frames.append(self._finish_large())
            return frames
        self._end += nbytes
        if self.framed is None:
            self._sniff()
        if self.framed:
            self._cut_frames(frames)
        elif self.framed is False:
            self._cut_stream(frames)
        return frames

    def feed(self, data: bytes) -> list[Frame]:
        """Receive ``data`` as if the socket had written it (tests, and copying callers).

        Raises:
            BufferError: the receiver has no room for the rest: it waits for its
                budget with its scratch buffer full (a socket would have stopped
                reading).
        """
        frames: list[Frame] = []
        view = memoryview(data)
        while view:
            buf = self.get_buffer()
            if not buf:
                raise BufferError(
                    f"no room for {len(view)} more bytes: the receiver waits for its budget"
                )
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            frames += self.buffer_updated(n)
        return frames

    def close(self) -> None:
        """Done with this connection: give back what it holds of the budget."""
        self._large = None
        self._large_filled = 0
        if self._budget is not None:
            self._drop_reservation()
            self.release_handed()

    def _granted(self) -> None:
        self.waiting_for_budget = False
        if self.on_grant is not None:
            self.on_grant()

    def check_eof(self) -> None:
        """The peer closed its side: raise if it left a message unfinished."""
        if self.pending_bytes:
            raise RemoteProtocolError(
                f"connection closed with {self.pending_bytes} bytes of an unfinished message"
            )

    # -- framed ------------------------------------------------------------------

    def _sniff(self) -> None:
        if self._end == self._start:
            return
        first = self._scratch[self._start]
        if first == _BINARY_BYTE:
            self.framed, self.protocol = False, Protocol.BINARY
        elif first == _COMPACT_BYTE:
            self.framed, self.protocol = False, Protocol.COMPACT
        else:
            self.framed = True

    def _cut_frames(self, frames: list[Frame]) -> None:
        scratch = self._scratch_view
        while self._end - self._start >= 4:
            start = self._start
            size = _S_LEN.unpack_from(scratch, start)[0]
            if size < 0 or size > self.max_frame_bytes:
                guess = _describe_length(bytes(scratch[start : start + 4]), size)
                what = f"frame length {size}" + (f" ({guess})" if guess else "")
                hint = f": {self._raise_limit()}" if guess is None and size > 0 else ""
                raise RemoteProtocolError(f"{what} is outside 0..{self.max_frame_bytes}{hint}")
            if size == 0:
                self._start = start + 4
                continue
            available = self._end - start - 4
            self._check_begun(scratch[start + 4 : min(self._end, start + 4 + size)])
            if size > LARGE_FRAME_BYTES and available < size:
                budget = self._budget
                if budget is not None and not self._reserved:
                    self._reserved = size - LARGE_FRAME_BYTES  # (see ReceiveBudget)
                    if not budget.reserve(self._reserved, self._granted):
                        self.waiting_for_budget = True
                        break
                elif self.waiting_for_budget:
                    break
                # Give the socket a buffer of the frame's exact size.
                self._large = memoryview(_kept.take(size))  # type: ignore[arg-type]
                self._large[:available] = scratch[start + 4 : self._end]  # one copy
                self._large_filled = available
                self._start = self._end = 0
                return
            if available < size:
                break
            if self._reserved:
                self._drop_reservation()  # the frame came whole after all
            payload = memoryview(bytes(scratch[start + 4 : start + 4 + size]))  # one copy
            self._start = start + 4 + size
            self._begun_checked = False
            if payload[0] == _BINARY_BYTE:  # (self._frame's common case, inlined)
                frames.append(Frame(payload, _PROTOCOL_BINARY, True))
            else:
                frames.append(self._frame(payload))
        if self._start == self._end:
            self._start = self._end = 0

    def _drop_reservation(self) -> None:
        budget = self._budget
        assert budget is not None
        reserved, self._reserved = self._reserved, 0
        if self.waiting_for_budget:
            self.waiting_for_budget = False
            budget.cancel(self._granted)
        elif reserved:
            budget.release(reserved)

    def release_handed(self) -> None:
        """Give back the budget of the large frames answered so far.

        Called by the owner once it has handed them on (to the store, which
        then lets go of the older values they replace), so that the memory of
        the next frame can be what those values leave.
        """
        if self._handed:
            handed, self._handed = self._handed, 0
            assert self._budget is not None
            self._budget.release(handed)

    def _finish_large(self) -> Frame:
        assert self._large is not None
        payload = self._large.toreadonly()
        self._large = None
        self._large_filled = 0
        self._begun_checked = False
        # The budget is given back once the frame is handed on (release_handed).
        self._handed += self._reserved
        self._reserved = 0
        return self._frame(payload)

    def _raise_limit(self) -> str:
        """Which limit a message larger than ``max_frame_bytes`` would need raised."""
        return f"more than {self.limit_name} ({_size(self.max_frame_bytes)}): raise it"

    def _check_begun(self, begun: memoryview) -> None:
        """Refuse a frame from its first bytes, ``begun``, where they are no message's
        start: a first byte of neither protocol, or a method name longer than any
        (so a frame of garbage is refused at once, not once its claimed length has come)."""
        if self._begun_checked or not begun:
            return
        protocol = _FRAME_PROTOCOLS.get(begun[0])
        if protocol is None:
            self._frame(begun)  # (raises: neither binary nor compact)
            return
        n = claimed_name_length(begun, protocol)
        if n is None:
            return  # (not there yet: looked at again as more arrives)
        if n > MAX_METHOD_NAME_BYTES:
            raise name_too_long(n, MAX_METHOD_NAME_BYTES)
        self._begun_checked = True

    def _frame(self, payload: memoryview) -> Frame:
        first = payload[0]
        if first == _BINARY_BYTE:
            return Frame(payload, Protocol.BINARY, True)
        if first == _COMPACT_BYTE:
            return Frame(payload, Protocol.COMPACT, True)
        raise RemoteProtocolError(
            f"frame starts with byte {first:#04x}: neither binary (0x80) nor compact (0x82)"
        )

    # -- unframed -------------------------------------------------------------

    def _cut_stream(self, frames: list[Frame]) -> None:
        stream = self._stream
        stream += self._scratch_view[self._start : self._end]
        self._start = self._end = 0
        assert self.protocol is not None
        while stream:
            if self._measure is None:
                if stream[0] != self.protocol.value:
                    raise RemoteProtocolError(
                        f"unframed message starts with byte {stream[0]:#04x}, "
                        f"not {self.protocol.value:#04x}"
                    )
                self._measure = StreamMeasure(self.protocol, self.max_frame_bytes)
            try:
                size = self._measure.feed(stream)
            except OverLimit as exc:
                raise RemoteProtocolError(f"{exc}: {self._raise_limit()}") from None
            if size is None:
                return
            self._measure = None
            with memoryview(stream) as view:  # released before the del below
                payload = bytes(view[:size])  # one copy
            del stream[:size]
            frames.append(Frame(memoryview(payload), self.protocol, False))


class _Kept:
    """The buffer of a large frame, kept for the next one once no one holds it.

    One buffer, of at most ``KEPT_BUFFER_BYTES``: a frame's views (and their
    parameters') hold it while they live; then only this does, and a frame of
    at most its size and at least half of it is received into it (its pages
    are the process's already: see the module). Process-wide, not per
    connection: a node's pushes come on many, one after another.
    """

    __slots__ = ("buffer", "lock")

    def __init__(self) -> None:
        self.buffer: np.ndarray | None = None
        # (event loops in other threads receive too: the blocking client's, a node's)
        self.lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self.lock:
            buffer = self.buffer
            # (held here, by self and by getrefcount's argument: no one else holds it)
            if (
                buffer is not None
                and sys.getrefcount(buffer) == 3
                and size <= len(buffer) < 2 * size
            ):
                return buffer[:size]  # (a view: it holds the buffer while it lives)
            new = empty(size)  # (reuses a block a replaced value let go, if one fits)
            if size <= KEPT_BUFFER_BYTES:
                self.buffer = new  # (held by the frame now: kept once it is let go)
            return new


_kept = _Kept()
