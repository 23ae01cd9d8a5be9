"""Reply order and read-your-writes: when each reply on a connection goes out.

Theory of operation. A connection carries many calls at a time (pipelining),
and its replies go out in the order of its requests, so clients that match
replies by seqid and clients that do not both work. A call that is not
answered the moment it arrives waits in a queue, in the order of the
requests; it is settled (given its reply) whenever its outcome is known, in
whatever order the outcomes come, and each flush sends the replies settled
at the front of the queue, up to the first one still owed. A read with
nothing owed before it (no call awaiting its reply, no write that may be
unapplied) skips the queue: it is answered at once, the common case.

Read-your-writes: a read on a connection waits for the writes sent before it
on that connection. The futures of the writes that may not be applied yet
are kept in the order they were sent, with the count of writes ever sent; a
read notes that count as it arrives, and goes to the handler once that many
first writes are all applied. Writes from one connection are applied in the
order they were sent, so the write to wait for is most often the oldest; but
a write's future may complete out of that order (a ``push_gradients`` sent
again answers the first push's future, which may be older than the writes
before it), so a read waits for the first of its writes that is not done.

Corking: while the requests of one read from the socket are dispatched, the
replies ready go to a list, and are written in one ``writelines`` at the end
of that callback, none later than that.

:class:`CallOrder` holds this state. It imports no asyncio and opens no
socket: it is the base of :class:`~aioparamsync.server.transport.ServerConnection`
(through :class:`~aioparamsync.server.dispatch.CallDispatch`), which gives it
the transport it writes to, the handler and the connection's flow control.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio

    from ..wire import Frame
    from .dispatch import Call

__all__ = ["MAX_PIPELINE", "CallOrder"]

# Calls one connection may have awaiting replies before it stops reading.
MAX_PIPELINE = 256


class CallOrder:
    """The calls of one connection awaiting their replies, and its writes not applied yet.

    What the connection provides (see
    :class:`~aioparamsync.server.transport.ServerConnection`): ``transport``,
    ``_read_paused`` and ``_closing``; ``_encode`` and ``_call_handler`` (from
    :class:`~aioparamsync.server.dispatch.CallDispatch`), ``_update_reading``
    and ``_maybe_finish``.
    """

    if TYPE_CHECKING:
        transport: asyncio.Transport | None
        _read_paused: bool
        _closing: bool

        def _encode(
            self, name: str, mtype: int, seqid: int, body: Any, frame: Frame
        ) -> list[Any]: ...
        def _call_handler(self, call: Call, args: Any, write: bool) -> Any: ...
        def _update_reading(self) -> None: ...
        def _maybe_finish(self) -> None: ...

    def __init__(self) -> None:
        self._calls: collections.deque[Call] = collections.deque()
        # The futures of the writes sent that may not be applied yet, in the order
        # they were sent (the applied ones at the front are dropped as they are
        # seen), and how many were ever put there: a read waits for the writes
        # sent before it (see _pending_write).
        self._unapplied: collections.deque[asyncio.Future] = collections.deque()
        self._writes_sent = 0
        # While a read's requests are dispatched: the replies to write at its end.
        self._out: list[Any] | None = None

    # -- read-your-writes ---------------------------------------------------------

    def _pending_write(self, sent: int) -> asyncio.Future | None:
        """The first write not applied yet of the first ``sent`` sent on the connection.

        None once they all are. Writes are applied in the order they were sent,
        so this is most often the oldest; but a write's future may complete out
        of that order (a push sent again answers the first push's future).
        """
        unapplied = self._unapplied
        while unapplied and unapplied[0].done():
            unapplied.popleft()
        index = self._writes_sent - len(unapplied)  # (of unapplied[0], counted as sent)
        for future in unapplied:
            if index >= sent:
                break
            if not future.done():
                return future
            index += 1
        return None

    def _read_after_writes(self, call: Call, args: Any, sent: int) -> None:
        """Call the handler for a read once the first ``sent`` writes are applied."""
        pending = self._pending_write(sent)
        if pending is None:
            self._call_handler(call, args, False)
        else:
            pending.add_done_callback(lambda _: self._read_after_writes(call, args, sent))

    # -- replies ------------------------------------------------------------------

    def _flush(self) -> None:
        """Send every reply that is ready and owed before any still pending.

        The replies ready at once go out in one write.
        """
        calls = self._calls
        transport = self.transport
        out: list[Any] | None = None
        while calls and calls[0].reply is not None:
            call = calls.popleft()
            if transport is None or transport.is_closing():
                continue
            mtype, body = call.reply  # type: ignore[misc]
            frame, call.frame = call.frame, None
            assert frame is not None  # (a call's reply is made once)
            # (the request's bytes are not needed once its reply is made: a call kept
            # after it, by a future it observed, keeps no frame of up to 256 MiB)
            parts = self._encode(call.method.name, mtype, call.seqid, body, frame)
            if out is None:
                out = parts
            else:
                out += parts
        if out is not None:
            self._send(out)
        self._replied()

    def _send(self, parts: list[Any]) -> None:
        """Write replies' buffers (the transport is open): now, or, corked, at the end of
        this callback."""
        if self._out is not None:
            self._out += parts
        else:
            self.transport.writelines(parts)  # type: ignore[union-attr]

    def _replied(self) -> None:
        """After replies went out: read again if reading waited for them (replies can only
        resume it), and end a closing connection that owes none."""
        if self._read_paused:
            self._update_reading()
        if self._closing:
            self._maybe_finish()

    def _uncork(self) -> None:
        """Write the replies held back while a read's requests were dispatched."""
        out, self._out = self._out, None
        transport = self.transport
        if out and transport is not None and not transport.is_closing():
            transport.writelines(out)
