"""One connection to a node: pipelined calls matched to their replies by seqid.

Theory of operation. A connection carries many calls at once: each gets a
seqid, and the reply with that seqid resolves it, so hundreds of coroutines
can share one client. A call that times out or is cancelled forgets its
seqid, and its late reply is dropped (a later call never reads an earlier
call's reply). The calls' deadlines share one timer, armed at the earliest
of them. A connection that breaks fails its calls in flight with
:class:`~aioparamsync.errors.ConnectionLostError`; a oneway call is followed
by a ``ping``, so that a broken connection is not taken for a sent message.

Until its first reply, a connection checks that what comes begins a framed
Thrift reply. A server that answers anything else is no node (an HTTP server
such as a node's metrics port, a TLS one, a wrong port): every call on the
connection fails at once with a
:class:`~aioparamsync.errors.RemoteProtocolError` that quotes what it sent,
and is not retried. (Each connection's first seqid reads as the end of an
HTTP request's head, so an HTTP server answers rather than waits.)

Flow control: a connection sends a message only while less than
``WRITE_HIGH_BYTES`` wait in its buffer, so eight concurrent 64 MiB updates
queue about one message in user space per connection. Arrays are sent by reference, without a
copy: do not change an array until the call sending it has returned.

The pool that keeps these connections, and retries calls, is :mod:`.pool`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from typing import Any, cast

from thriftpy2.thrift import TApplicationException

from ..errors import ConnectionLostError, ParamSyncError, RemoteProtocolError, ServerError
from ..wire import UNIX_SEND_BUFFER_BYTES, Method, Receiver, decode_header, encode_message, method
from ..wire.protocol import CALL, EXCEPTION, MAX_I32, ONEWAY, REPLY

__all__ = ["_Connection"]

log = logging.getLogger(__name__)

# Unsent bytes above which a connection's next send waits.
WRITE_HIGH_BYTES = 1024 * 1024
# A call's deadline may be met this early (seconds): the loop's timers are
# not more precise than that.
TIMER_SLACK = 0.001
# The seqid of each connection's first call. Its bytes are b"\r\n\r\n", which end
# an HTTP request's head: an HTTP server reached by mistake (a node's metrics
# port, say) answers that call at once, and the client fails with what it said
# (see _reply_head) rather than at the call's deadline.
FIRST_SEQID = 0x0D0A0D0A
# How many of a connection's first bytes are kept until they show a framed
# Thrift reply: what an error quotes of a server that speaks something else.
HEAD_BYTES = 48
# What sets the largest reply a client takes (named when one is larger).
CLIENT_LIMIT = "ParameterClient(max_frame_bytes=...), this client's limit"


def _ping_method() -> Method:
    m = method("ping")
    assert m is not None, "the IDL has ping"
    return m


# A ping follows each oneway call on its connection (see _Connection.call).
_PING = _ping_method()
_PING_ARGS = _PING.args()


def _reply_head(head: bytes | bytearray, max_frame_bytes: int) -> bool | None:
    """Whether a connection's first bytes can begin a framed Thrift reply; None: too few to tell.

    A node answers in frames: a 4-byte big-endian length in
    ``1..max_frame_bytes`` (empty frames are skipped), then the header of a
    reply or an exception, binary (``80 01 .. TT``) or compact (``82``, then
    the type and version 1 in one byte). An HTTP answer ("HTTP" reads as a
    1.2 GB frame), a TLS alert or random bytes fail this within a few bytes.
    """
    start = 0
    while head[start : start + 4] == b"\0\0\0\0":
        start += 4
    length = head[start : start + 4]
    # The smallest length these bytes can begin is already too large?
    if int.from_bytes(bytes(length).ljust(4, b"\0"), "big") > max_frame_bytes:
        return False
    message = head[start + 4 : start + 8]
    if not message:
        return None
    if message[0] == 0x80:  # binary: 80 01, a byte, the message type
        if len(message) > 1 and message[1] != 0x01:
            return False
        return message[3] in (REPLY, EXCEPTION) if len(message) == 4 else None
    if message[0] == 0x82:  # compact: 82, then type << 5 | version
        if len(message) < 2:
            return None
        return message[1] & 0x1F == 1 and message[1] >> 5 in (REPLY, EXCEPTION)
    return False


def _what_came(head: bytes | bytearray) -> str:
    """The bytes a server answered, quoted, with a guess at what it speaks."""
    shown = repr(bytes(head[:HEAD_BYTES]))
    if len(head) > HEAD_BYTES:
        shown = shown[:-1] + "..." + shown[-1]
    lowered = bytes(head).lower()
    if lowered.startswith(b"http/") or b"<html" in lowered or b"<!doctype" in lowered:
        guess = ": it speaks HTTP (is this the node's metrics port?)"
    elif head[:1] in (b"\x15", b"\x16") and head[1:2] == b"\x03":
        guess = ": it speaks TLS (connect with ssl=, see aioparamsync.tls)"
    else:
        guess = ""
    return f"{shown}, which is not a framed Thrift message{guess}"


class _Connection(asyncio.BufferedProtocol):
    """One connection: pipelined calls matched to replies by seqid."""

    def __init__(self, max_frame_bytes: int, traffic: dict[str, int], address: str = "") -> None:
        self.traffic = traffic  # the client's byte counters
        self.address = address  # "host:port", for errors
        self.receiver = Receiver(max_frame_bytes, framed=True, limit_name=CLIENT_LIMIT)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.using = 0  # (calls waiting to send on it: see ConnectionPool._move_local)
        self._reads: set[int] = set()  # (the seqids of the reads among them)
        self._seqids = itertools.count(FIRST_SEQID - 1)  # (see FIRST_SEQID)
        # The first bytes received, until they show a framed Thrift reply
        # (then None): a server that speaks something else is told apart from
        # a node, and quoted (see _check_head). The buffer they were read into:
        self._head: bytearray | None = bytearray()
        self._buffer: memoryview | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._write_paused = False  # (self._writable cleared: a cheaper test of it)
        self.lost: BaseException | None = None
        # The loop, kept: on CPython 3.11 every asyncio.get_running_loop() makes a
        # getpid() system call. (A connection is made by its loop's protocol factory.)
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        # Per-call deadlines share one timer, armed at the earliest of them:
        # cheaper than an asyncio.timeout (a timer and a cancellation) per call.
        self._deadlines: dict[int, float] = {}  # seqid -> loop time
        # Calls with a deadline whose message holds the caller's own memory (a
        # large binary value, sent by reference): see _expire.
        self._borrowing: set[int] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0

    def __repr__(self) -> str:
        state = "lost" if self.lost else "open"
        return f"<Connection {state} [{len(self.pending)} calls in flight]>"

    @property
    def _who(self) -> str:
        return f"the node at {self.address}" if self.address else "the node"

    @property
    def moving_bulk(self) -> bool:
        """Whether a large message is on its way now, out (sends wait for the buffer
        to drain) or in: a call pipelined behind it would wait for all of it."""
        return self._write_paused or self.receiver.receiving_large

    @property
    def reading(self) -> bool:
        """Whether a read is in flight: its reply may be large, and the node writes it
        whole before it reads the next call (a call pipelined behind it waits for it)."""
        return bool(self._reads)

    @property
    def usable(self) -> bool:
        return self.lost is None and self.transport is not None and not self.transport.is_closing()

    # -- asyncio callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no subclasses of asyncio.Transport.
        self.transport = transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif sock is not None and sock.family == socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
        # A send waits while more than this is unsent (flow control).
        transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES)

    def get_buffer(self, sizehint: int) -> memoryview:
        buffer = self.receiver.get_buffer()
        if self._head is not None:
            self._buffer = buffer
        return buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.traffic["bytes_received"] += nbytes
        if self._head is not None and not self._check_head(nbytes):
            return
        seqid, future = 0, None
        try:
            for frame in self.receiver.buffer_updated(nbytes):
                name, mtype, seqid, reader = decode_header(frame.payload, frame.protocol)
                future = self.pending.pop(seqid, None)
                if future is None and mtype == EXCEPTION and seqid == 0:
                    # About no call (ours are never 0): the node refused the connection.
                    error = reader.read_body(TApplicationException)
                    self._break(ServerError(f"the node refused: {error.message}", error.type or 0))
                    return
                if future is None or future.done():
                    continue  # its caller gave up (timeout, cancellation)
                m = method(name)
                if mtype == EXCEPTION:
                    error = reader.read_body(TApplicationException)
                    future.set_exception(ServerError(error.message or "", error.type or 0))
                elif mtype == REPLY and m is not None and m.result is not None:
                    future.set_result(reader.read_body(m.result))
                else:
                    raise RemoteProtocolError(f"unexpected reply {name!r} of type {mtype}")
        except RemoteProtocolError as exc:
            if future is not None and not future.done():
                self.pending[seqid] = future  # its reply was the bad one: fail it too
            self._break(exc)

    def _check_head(self, nbytes: int) -> bool:
        """Until the first reply shows a framed Thrift message, look at what came.

        Answers False once the connection is broken for it: the server at the
        other end is no node (an HTTP server, a TLS one, something else), and
        every call on the connection fails with a RemoteProtocolError quoting
        what it sent, at once rather than at the call's deadline.
        """
        head, buffer = self._head, self._buffer
        assert head is not None and buffer is not None
        head += buffer[: min(nbytes, HEAD_BYTES + 1 - len(head))]  # (+1: more came?)
        limit = self.receiver.max_frame_bytes
        verdict = _reply_head(head, limit)
        if verdict is False:
            if _reply_head(head, MAX_I32):  # (a node's reply, larger than this client takes)
                start = 0
                while head[start : start + 4] == b"\0\0\0\0":  # (empty frames)
                    start += 4
                size = int.from_bytes(head[start : start + 4], "big")
                error = RemoteProtocolError(
                    f"{self._who} answered a reply of {size} bytes, more than {CLIENT_LIMIT} "
                    f"({limit} bytes): raise it"
                )
            else:
                error = RemoteProtocolError(
                    f"the server at {self.address} answered " + _what_came(head)
                )
            self._break(error)
            return False
        if verdict or len(head) > HEAD_BYTES:  # (only empty frames so far: let it be)
            self._head = self._buffer = None
        return True

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        why = f"{self._who} closed the connection{f': {exc}' if exc else ''}"
        self._break(ConnectionLostError(why))
        self._write_paused = False
        self._writable.set()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._writable.clear()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._writable.set()

    # -- calls --------------------------------------------------------------------

    def _closed_error(self) -> ParamSyncError:
        """What a call sent on this connection, closed, fails with."""
        if self._head is not None and isinstance(self.lost, RemoteProtocolError):
            return RemoteProtocolError(str(self.lost))  # (see _break)
        # (Closing, not yet lost: the node's end of it came first.)
        why = self.lost or f"{self._who} closed the connection"
        return ConnectionLostError(f"the connection is closed: {why}")

    def _break(self, exc: BaseException) -> None:
        # Before a first reply showed a node (see _check_head), a protocol error
        # says the server is something else: the calls fail with it, as is.
        # After, bytes that are not a valid message broke a node's connection.
        not_a_node = self._head is not None and isinstance(exc, RemoteProtocolError)
        if self.lost is None:
            self.lost = exc
            if isinstance(exc, RemoteProtocolError) and not not_a_node:
                log.warning("closing a connection: the node sent an invalid message: %s", exc)
        pending, self.pending = self.pending, {}
        self._reads.clear()
        self._deadlines.clear()
        self._borrowing.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for future in pending.values():
            if future.done():
                continue
            if not_a_node:
                error: ParamSyncError = RemoteProtocolError(str(exc))
            else:
                error = ConnectionLostError(f"the connection broke during the call: {self.lost}")
                error.__cause__ = self.lost
            future.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def _expire(self) -> None:
        self._timer = None
        now = self._loop.time() + TIMER_SLACK
        deadlines = self._deadlines
        borrowed = False
        for seqid in [s for s, when in deadlines.items() if when <= now]:
            del deadlines[seqid]
            future = self.pending.pop(seqid, None)  # a late reply is dropped
            if future is not None and not future.done():
                future.set_exception(TimeoutError())
                borrowed = borrowed or seqid in self._borrowing
        transport = self.transport
        if borrowed and transport is not None and transport.get_write_buffer_size():
            # Part of a message is still unsent, maybe that of an expired call
            # that lent the caller's memory (large values go by reference on
            # uvloop): sent later, it would come from memory the caller may
            # change now that the call has failed, and the node would take a
            # mix that nobody sent. Drop it unsent (the node refuses a cut
            # message) and end the connection.
            transport.abort()
            self._break(ConnectionLostError("a call timed out with a message not yet sent whole"))
            return
        if deadlines:
            when = min(deadlines.values())
            self._timer = self._loop.call_at(when, self._expire)
            self._timer_when = when

    async def call(self, m: Method, args: Any, when: float | None = None) -> Any:
        """Send one call; answer its result struct (None for oneway calls).

        Raises:
            TimeoutError: not answered by the loop time ``when`` (None: no deadline).
        """
        if self._write_paused:
            async with asyncio.timeout_at(when):
                # Again after each wake-up: the calls woken with this one may
                # have filled the buffer (one message at a time goes past it).
                while self._write_paused:
                    await self._writable.wait()
        if m.oneway:
            if not self.usable:
                raise self._closed_error()
            assert self.transport is not None
            seqid = next(self._seqids) % 0x7FFFFFFF + 1  # 1..2**31-1; 0 is never a call
            parts, size = encode_message(m.name, ONEWAY, seqid, args)
            self.traffic["bytes_sent"] += size
            self.transport.writelines(parts)
            # A ping behind it: its reply comes once the node has read (and,
            # read-your-writes, applied) the oneway message, so our buffers are
            # free again and a broken connection is not taken for a sent message.
            await self.call(_PING, _PING_ARGS, when)
            return None
        seqid, future = self.send(m, args, when)
        try:
            return await future
        finally:
            self.forget(seqid, when)
            del future  # (no cycle through an error it holds: see ConnectionPool.invoke)

    def send(self, m: Method, args: Any, when: float | None) -> tuple[int, asyncio.Future]:
        """Send a two-way call now; answer its seqid and the future of its result.

        The caller awaits the future, then calls :meth:`forget` (however it ends).
        Only while the connection is writable (see :meth:`call`).

        Raises:
            ConnectionLostError: the connection is closed.
        """
        transport = self.transport
        if self.lost is not None or transport is None or transport.is_closing():
            raise self._closed_error()
        seqid = next(self._seqids) % 0x7FFFFFFF + 1  # 1..2**31-1; 0 is never a call
        parts, size = encode_message(m.name, CALL, seqid, args)
        self.traffic["bytes_sent"] += size
        future = self._loop.create_future()
        self.pending[seqid] = future
        if not m.writes:
            self._reads.add(seqid)
        if when is not None:  # failed with TimeoutError if not answered by then
            self._deadlines[seqid] = when
            if len(parts) > 1:  # (a message without such values is one buffer)
                self._borrowing.add(seqid)
            if self._timer is None or when < self._timer_when:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self._loop.call_at(when, self._expire)
                self._timer_when = when
        transport.writelines(parts)
        return seqid, future

    def forget(self, seqid: int, when: float | None) -> None:
        """The call ``seqid`` is over (answered, timed out, cancelled or broken)."""
        self.pending.pop(seqid, None)
        self._reads.discard(seqid)
        if when is not None:
            self._deadlines.pop(seqid, None)
            self._borrowing.discard(seqid)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
