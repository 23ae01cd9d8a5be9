"""The async client: a pool of pipelined connections to a node, and a numpy API.

Theory of operation. A :class:`ParameterClient` keeps up to
``max_connections`` connections to its node and sends each call on the one
with the fewest calls in flight, opening another while every open one is
busy. A connection carries many calls at once: each gets a seqid, and the
reply with that seqid resolves it, so hundreds of coroutines can share one
client. A call that times out or is cancelled forgets its seqid, and its late
reply is dropped (a later call never reads an earlier call's reply).

A connection that breaks fails its calls in flight with
:class:`~aioparamsync.errors.ConnectionLostError` and leaves the pool; the
next call opens a fresh one. Reads are retried once on a fresh connection;
writes are not (their outcome is unknown: the error says so), except
gradient pushes, which carry a request id the node applies once.

Until its first reply, a connection checks that what comes begins a framed
Thrift reply. A server that answers anything else is no node (an HTTP server
such as a node's metrics port, a TLS one, a wrong port): every call on the
connection fails at once with a
:class:`~aioparamsync.errors.RemoteProtocolError` that quotes what it sent,
and is not retried. (Each connection's first seqid reads as the end of an
HTTP request's head, so an HTTP server answers rather than waits.)

A call the node holds (a long poll, a barrier) goes on a connection of its
own, so it never holds up the replies of the calls pipelined behind it.

Flow control: a connection sends a message only while less than
``WRITE_HIGH_BYTES`` wait in its buffer, so eight concurrent 64 MiB updates
queue about one message in user space per connection. Arrays are sent by reference, without a
copy: do not change an array until the call sending it has returned.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import numbers
import socket
import ssl as ssl_module
import time
import uuid
from collections.abc import Collection, Iterable, Mapping
from types import EllipsisType
from typing import Any, cast

import numpy as np
from thriftpy2.thrift import TApplicationException

from ..errors import (
    CallTimeout,
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    ConnectTimeout,
    ParamSyncError,
    RemoteProtocolError,
    RequestError,
    ServerError,
)
from ..values import pieces
from ..values.arrays import from_parameter, to_parameter, to_parameters
from ..wire import (
    DEFAULT_MAX_FRAME_BYTES,
    METHODS,
    MessageType,
    Method,
    Receiver,
    decode_header,
    encode_message,
    method,
    thrift,
)
from .fetch import FETCH_CONCURRENCY, fetch, gather_or_stop

__all__ = ["ParameterClient", "parse_address"]

log = logging.getLogger(__name__)

# Default deadline of one call, connecting included (seconds).
DEFAULT_TIMEOUT = 60.0
# Default deadline of opening one connection (seconds).
DEFAULT_CONNECT_TIMEOUT = 10.0
# Default number of connections a client keeps to its node.
DEFAULT_MAX_CONNECTIONS = 4
# How long close() waits for its connections to finish closing (seconds).
CLOSE_TIMEOUT = 1.0
# Unsent bytes above which a connection's next send waits.
WRITE_HIGH_BYTES = 1024 * 1024
# A call's deadline may be met this early (seconds): the loop's timers are
# not more precise than that.
TIMER_SLACK = 0.001
# Idle connections kept for calls the node holds (long polls, barriers).
MAX_SPARE_CONNECTIONS = 4
# A held call's deadline is its wait plus this (seconds), so that the node's
# TIMEOUT, which says what never came, arrives before the client gives up.
HOLD_MARGIN = 5.0
# The seqid of each connection's first call. Its bytes are b"\r\n\r\n", which end
# an HTTP request's head: an HTTP server reached by mistake (a node's metrics
# port, say) answers that call at once, and the client fails with what it said
# (see _reply_head) rather than at the call's deadline.
FIRST_SEQID = 0x0D0A0D0A
# How many of a connection's first bytes are kept until they show a framed
# Thrift reply: what an error quotes of a server that speaks something else.
HEAD_BYTES = 48
# The most milliseconds a wait_ms field holds (an i32); nodes cap waits far lower.
MAX_WAIT_MS = 2**31 - 1


Address = str | tuple[str, int]


def parse_addresses(addresses: Address | Iterable[Address]) -> list[tuple[str, int]]:
    """One address, ``"h1:p1,h2:p2"``, or a list of addresses -> ``[(host, port), ...]``.

    Raises:
        ValueError: not addresses, or none.
    """
    if isinstance(addresses, str):
        items: list[Address] = [a for a in addresses.split(",") if a.strip()]
    elif isinstance(addresses, tuple) and len(addresses) == 2 and isinstance(addresses[1], int):
        items = [addresses]
    else:
        items = list(addresses)
    if not items:
        raise ValueError("no address given")
    return [parse_address(a.strip() if isinstance(a, str) else a) for a in items]


def parse_address(address: Address) -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"`` or ``(host, port)`` -> ``(host, port)``.

    Raises:
        ValueError: not an address.
    """
    if isinstance(address, tuple):
        host, port = address
    else:
        host, sep, port_text = str(address).rpartition(":")
        if not sep or not host:
            raise ValueError(f"{address!r} is not host:port")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            port = int(port_text)
        except ValueError:
            raise ValueError(f"{address!r}: port {port_text!r} is not a number") from None
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is out of range")
    return str(host), int(port)


def check_seconds(value: Any, what: str, *, zero: bool = False) -> Any:
    """``value`` if it is a deadline or a wait in seconds: None, or a finite number above 0.

    Every timeout the client takes goes through here, so that ``timeout=0``
    (which would fail every call before it is sent), a negative or NaN
    deadline, infinity (None says "no deadline") or ``True`` is refused where
    it is given, not turned into a puzzling failure later.

    Args:
        value: the number of seconds, or None.
        what: the argument's name, for the error.
        zero: 0 is allowed too (a long poll's ``wait=0``: answer at once).

    Raises:
        ValueError: anything else (bools and non-numbers included).
    """
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
        if math.isfinite(seconds) and (seconds > 0 or (zero and seconds == 0)):
            return value
    bound = "0 or more" if zero else "above 0"
    raise ValueError(f"{what} must be a finite number of seconds {bound}, or None, not {value!r}")


def _ping_method() -> Method:
    m = method("ping")
    assert m is not None, "the IDL has ping"
    return m


# A ping follows each oneway call on its connection (see _Connection.call).
_PING = _ping_method()
_PING_ARGS = _PING.args()

# Message types as plain ints, for the per-call paths (an enum member is slow to get).
_CALL, _REPLY, _EXCEPTION, _ONEWAY = (
    int(t) for t in (MessageType.CALL, MessageType.REPLY, MessageType.EXCEPTION, MessageType.ONEWAY)
)


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
        return message[3] in (_REPLY, _EXCEPTION) if len(message) == 4 else None
    if message[0] == 0x82:  # compact: 82, then type << 5 | version
        if len(message) < 2:
            return None
        return message[1] & 0x1F == 1 and message[1] >> 5 in (_REPLY, _EXCEPTION)
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
        self.receiver = Receiver(max_frame_bytes, framed=True)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future] = {}
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
    def usable(self) -> bool:
        return self.lost is None and self.transport is not None and not self.transport.is_closing()

    # -- asyncio callbacks ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no subclasses of asyncio.Transport.
        self.transport = transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
                if future is None and mtype == _EXCEPTION and seqid == 0:
                    # About no call (ours are never 0): the node refused the connection.
                    error = reader.read_body(TApplicationException)
                    self._break(ServerError(f"the node refused: {error.message}", error.type or 0))
                    return
                if future is None or future.done():
                    continue  # its caller gave up (timeout, cancellation)
                m = method(name)
                if mtype == _EXCEPTION:
                    error = reader.read_body(TApplicationException)
                    future.set_exception(ServerError(error.message or "", error.type or 0))
                elif mtype == _REPLY and m is not None and m.result is not None:
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
        verdict = _reply_head(head, self.receiver.max_frame_bytes)
        if verdict is False:
            self._break(
                RemoteProtocolError(f"the server at {self.address} answered " + _what_came(head))
            )
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
            parts, size = encode_message(m.name, _ONEWAY, seqid, args)
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
        parts, size = encode_message(m.name, _CALL, seqid, args)
        self.traffic["bytes_sent"] += size
        future = self._loop.create_future()
        self.pending[seqid] = future
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
        if when is not None:
            self._deadlines.pop(seqid, None)
            self._borrowing.discard(seqid)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class ParameterClient:
    """An async client of a node (or of the first reachable of several).

    Safe to share among many coroutines: calls are pipelined over a small pool
    of connections. Given several addresses (nodes of one cluster), it uses one
    node at a time and moves to the next when that one cannot be reached.
    Use it as an async context manager, or call :meth:`close`::

        async with ParameterClient("127.0.0.1:9090") as client:
            versions = await client.update_arrays({"w": weights})
            arrays = await client.get_arrays(["w"])

    Args:
        address: ``"host:port"``, ``(host, port)``, or several of them (a
            list, or ``"host:port,host:port"``).
        timeout: default deadline of each call in seconds (None: no deadline).
        connect_timeout: deadline of opening a connection (seconds; None: none).
        max_connections: connections to keep to the node.
        max_frame_bytes: the largest reply accepted.
        max_inline_bytes: parameters larger than this travel in pieces of
            ``piece_bytes``, both ways (see :mod:`aioparamsync.values.pieces`): so a
            parameter may be larger than a frame, or than 2 GiB.
        piece_bytes: the size of those pieces.
        ssl: an ``ssl.SSLContext`` to reach TLS nodes with (see :mod:`aioparamsync.tls`).

    Every timeout, here and per call, is None or a finite number of seconds
    above 0; anything else (0, a negative number, NaN, infinity, a bool) is a
    ValueError where it is given.

    Raises:
        ValueError: an argument out of its range (see above for timeouts).
    """

    def __init__(
        self,
        address: Address | Iterable[Address],
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_inline_bytes: int = pieces.INLINE_BYTES,
        piece_bytes: int = pieces.PIECE_BYTES,
        ssl: ssl_module.SSLContext | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.addresses = parse_addresses(address)
        self._current = 0  # the node in use: self.addresses[self._current]
        self.timeout = check_seconds(timeout, "timeout")
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        self.max_connections = max_connections
        self.max_frame_bytes = max_frame_bytes
        if not 0 < piece_bytes < max_frame_bytes or max_inline_bytes < 0:
            raise ValueError(
                "piece_bytes must be above 0 and below max_frame_bytes, and max_inline_bytes "
                "not negative"
            )
        self.max_inline_bytes = max_inline_bytes
        self.piece_bytes = piece_bytes
        self.ssl = ssl
        self._connections: list[_Connection] = []
        self._connecting: asyncio.Future[_Connection] | None = None
        self._spare: list[_Connection] = []  # idle connections for held calls
        self._holding: set[_Connection] = set()  # connections a held call is on
        self._closed = False
        self.connects = 0  # connections opened so far (a new one means a new session)
        #: bytes sent and received on every connection, framing included
        self.traffic: dict[str, int] = {"bytes_sent": 0, "bytes_received": 0}
        self._feedback: Any = None  # compression.ErrorFeedback, made when first needed
        # The last push with error feedback under a caller's request id, and what
        # it sent: sent again under that id, it goes as it went (see push_gradients).
        self._last_push: tuple[str, list[Any]] | None = None

    @property
    def host(self) -> str:
        return self.addresses[self._current][0]

    @property
    def port(self) -> int:
        return self.addresses[self._current][1]

    def __repr__(self) -> str:
        active = sum(1 for c in self._connections if c.pending)
        in_flight = sum(len(c.pending) for c in self._connections)
        state = "closed" if self._closed else f"{self.host}:{self.port}"
        return (
            f"<ParameterClient {state} [Calls: {in_flight} in flight | Connections: "
            f"{active} active, {len(self._connections) - active} idle]>"
        )

    async def __aenter__(self) -> ParameterClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection; calls in flight fail with ConnectionLostError.

        Returns once the connections have closed (a TLS connection takes a round
        trip to shut down), or after ``CLOSE_TIMEOUT`` seconds.
        """
        self._closed = True
        connections, self._connections = self._connections, []
        connections += [*self._spare, *self._holding]
        self._spare.clear()
        for conn in connections:
            conn.close()
        if connections:
            await asyncio.wait([conn.closed for conn in connections], timeout=CLOSE_TIMEOUT)

    # -- the pool -------------------------------------------------------------------

    async def _connect(self, *, pooled: bool = True) -> _Connection:
        """Connect to the node in use, or else to the next that answers, in turn.

        The connection joins the pool, unless not ``pooled`` (a held call's).
        """
        loop = asyncio.get_running_loop()
        failures: list[ConnectError | ConnectTimeout] = []
        for attempt in range(len(self.addresses)):
            index = (self._current + attempt) % len(self.addresses)
            host, port = self.addresses[index]
            where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                async with asyncio.timeout(self.connect_timeout):
                    _, conn = await loop.create_connection(
                        functools.partial(_Connection, self.max_frame_bytes, self.traffic, where),
                        host,
                        port,
                        ssl=self.ssl,
                    )
            except TimeoutError:
                failures.append(
                    ConnectTimeout(
                        f"no connection to {host}:{port} within {self.connect_timeout} s"
                    )
                )
                continue
            except OSError as exc:
                failures.append(ConnectError(f"cannot connect to {host}:{port}: {exc}"))
                continue
            if index != self._current:
                log.warning("moving to node %s:%d (%s)", host, port, failures[-1])
                for old in self._connections:
                    old.close()  # keep one node per client: reads see one node's state
                self._connections.clear()
                self._current = index
            break
        else:
            if len(failures) == 1:
                raise failures[0]
            raise ConnectError(
                "no node is reachable: " + "; ".join(str(f) for f in failures)
            ) from failures[-1]
        if self._closed:
            conn.close()
            raise ClientClosedError("the client was closed")
        if pooled:
            self._connections.append(conn)
        self.connects += 1
        return conn

    async def _call_held(self, m: Method, message: Any, when: float | None) -> Any:
        """Send a call the node holds on a connection of its own."""
        conn = None
        while self._spare:
            candidate = self._spare.pop()
            if candidate.usable:
                conn = candidate
                break
        if conn is None:
            async with asyncio.timeout_at(when):
                conn = await self._connect(pooled=False)
        self._holding.add(conn)
        answered = False
        try:
            result = await conn.call(m, message, when)
            answered = True
            return result
        finally:
            self._holding.discard(conn)
            # A connection whose call timed out may yet carry its late reply:
            # never reuse it.
            if answered and conn.usable and not self._closed:
                if len(self._spare) < MAX_SPARE_CONNECTIONS:
                    self._spare.append(conn)
                else:
                    conn.close()
            else:
                conn.close()

    async def _acquire(self) -> _Connection:
        conn = self._acquire_now()
        if conn is not None:
            return conn
        assert self._connecting is not None
        return await asyncio.shield(self._connecting)

    def _acquire_now(self) -> _Connection | None:
        """The connection to send on, or None to wait for ``_connecting``.

        Opens another connection while every open one is busy (and the pool has room).
        """
        if self._closed:
            raise ClientClosedError("the client is closed")
        connections = self._connections
        best: _Connection | None
        if len(connections) == 1:  # the common case, without a new list
            best = connections[0] if connections[0].usable else None
            if best is None:
                connections.clear()
        else:
            connections = self._connections = [c for c in connections if c.usable]
            best = min(connections, key=lambda c: len(c.pending), default=None)
        if best is not None and (not best.pending or len(connections) >= self.max_connections):
            return best
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        return best  # a busy one: pipeline on it while another opens

    def _move_on(self) -> None:
        """Use the next node: the one in use keeps breaking connections."""
        if len(self.addresses) > 1:
            self._current = (self._current + 1) % len(self.addresses)
            log.warning("moving to node %s:%d", self.host, self.port)
            for conn in self._connections:
                conn.close()
            self._connections = []

    def _connected(self, future: asyncio.Future) -> None:
        self._connecting = None
        if not future.cancelled():
            future.exception()  # retrieved here; raised to the callers that await it

    async def call(
        self, name: str, /, *, timeout: float | EllipsisType | None = ..., **args: Any
    ) -> Any:
        """Call the IDL method ``name`` with its arguments; answer its result.

        The arguments and the result are the IDL's structs (``aioparamsync.thrift``).
        A read is retried once on a fresh connection if its connection breaks; a
        write is not (its outcome is then unknown).

        Raises:
            ValueError: no such method, or a ``timeout`` that is neither None
                nor a finite number of seconds above 0.
            RequestError: the node refused the call (its ``ParameterError``).
            RemoteProtocolError: what came back is not a framed Thrift message
                (the address is not a node's: an HTTP server, say).
            ServerError: the node failed, or does not know the method.
            CallTimeout, NetworkError, ClientClosedError: see :mod:`aioparamsync.errors`.
        """
        m = method(name)
        if m is None:
            raise ValueError(f"the IDL has no method {name!r}")
        return await self.invoke(m, timeout=timeout, **args)

    async def invoke(
        self, m: Method, /, *, timeout: float | EllipsisType | None = ..., **args: Any
    ) -> Any:
        """:meth:`call` by the method's entry in the method table (``wire.METHODS.ping``).

        How a call is sent and retried follows the method's traits (see
        :mod:`aioparamsync.wire.idl`): a read is retried on a fresh connection
        (with several nodes, from the second try on at the next node); an
        idempotent write once, at the same node, which knows its request id;
        any other write never. A held call gets a connection of its own.
        """
        if isinstance(timeout, EllipsisType):
            deadline = self.timeout
        else:
            deadline = check_seconds(timeout, "timeout")
        message = m.args(**args)
        # A read is retried on a fresh connection; with several nodes, from the
        # second try on at the next node (the first may be dying). An idempotent
        # write once, at the same node (which knows its request id).
        retries = int(m.idempotent) if m.writes else max(len(self.addresses), 2) - 1
        tries = 0
        oneway = m.oneway
        held = m.held == "always" or (
            m.held == "wait_ms" and getattr(args.get("request"), "wait_ms", None) is not None
        )
        when = None if deadline is None else asyncio.get_running_loop().time() + deadline
        try:
            while True:
                try:
                    if held:
                        result = await self._call_held(m, message, when)
                        break
                    conn = self._acquire_now()
                    if conn is None:  # none open: wait for one, within the deadline
                        async with asyncio.timeout_at(when):
                            conn = await self._acquire()
                    if oneway or conn._write_paused:
                        result = await conn.call(m, message, when)
                        break
                    # conn.call's common case, without a coroutine of its own
                    seqid, future = conn.send(m, message, when)
                    try:
                        result = await future
                    finally:
                        conn.forget(seqid, when)
                    break
                except ConnectionLostError:
                    if retries == 0 or self._closed:
                        raise
                    retries -= 1
                    tries += 1
                    if tries > 1:
                        self._move_on()
        except TimeoutError:
            raise CallTimeout(f"{m.name} did not complete within {deadline} s") from None
        if result is None:
            return None
        if getattr(result, "error", None) is not None:
            raise RequestError(result.error.code, result.error.message)
        if 0 not in result.thrift_spec:
            return None  # a void method (update_parameters): its result has no success
        if result.success is None:
            raise ServerError(f"{m.name}: the node sent no result")
        return result.success

    # -- the API --------------------------------------------------------------------

    async def get_parameters(
        self,
        names: Iterable[str] | None,
        min_version: int = 0,
        *,
        wait: float | None = None,
        known_versions: Mapping[str, int | tuple[int, str]] | None = None,
        encoding: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> Any:
        """Fetch parameters: those of ``names`` that exist with ``version >= min_version``.

        The response is one consistent snapshot: an update is in it wholly or
        not at all. Names that do not qualify are left out.

        Args:
            names: the parameters' names; None: every parameter the node holds.
            min_version: leave out parameters older than this.
            wait: a long poll (stale-synchronous training): wait up to this
                many seconds for every name to reach ``min_version``; the
                call's deadline is extended by as much. 0: answer at once,
                or ``TIMEOUT`` naming what is not there yet.
            known_versions: a delta pull: the version held of each name, or
                its ``(version, origin)`` as a response gave them; a parameter
                comes back only if the node has a newer one. With the origin,
                also the same version from another writer that won (two
                nodes wrote it at once: last-writer-wins).
            encoding: ask for the data encoded (``"fp16"``, ``"bf16"``,
                ``"int8"``, ``"zlib"``; see :mod:`aioparamsync.values.compression`).
            timeout: this call's deadline (seconds; default: the client's).

        Returns:
            A ``ParameterResponse``: ``params`` (each ``data`` a read-only view
            of the received bytes; ``encoding`` set where encoded) and the
            node's ``timestamp``.

        Raises:
            RequestError: the node refused the request (e.g. too many names),
                or ``TIMEOUT``: the wait ended first (the message names the
                parameters that did not come).
            CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
        """
        if isinstance(names, (str, bytes)):
            raise TypeError("names must be a list of names, not one string")
        request = thrift.ParameterRequest(
            param_names=list(names) if names is not None else [],
            min_version=min_version,
            all_names=True if names is None else None,
            encoding=encoding,
        )
        if known_versions is not None:
            versions, origins = {}, {}
            for name, held in known_versions.items():
                if isinstance(held, tuple):
                    versions[name], origins[name] = held
                else:
                    versions[name] = held
            request.known_versions = versions
            request.known_origins = origins or None
        if wait is not None:
            check_seconds(wait, "wait", zero=True)
            request.wait_ms = min(round(wait * 1000), MAX_WAIT_MS)
            timeout = self._held_timeout(wait, timeout)
        request.max_inline_bytes = self.max_inline_bytes
        # (time.monotonic: no getpid() system call, as asyncio.get_running_loop() makes on 3.11)
        started = time.monotonic()
        response = await self.invoke(METHODS.pull_parameters, timeout=timeout, request=request)
        if any(p.total_bytes is not None for p in response.params):
            # Larger than one message: answered without data; read in pieces,
            # within what is left of this call's deadline.
            deadline = self.timeout if isinstance(timeout, EllipsisType) else timeout
            left = None if deadline is None else deadline - (time.monotonic() - started)
            try:
                async with asyncio.timeout(left):
                    response.params = [
                        p
                        if p.total_bytes is None
                        else await fetch(self, p, self.piece_bytes, timeout=timeout)
                        for p in response.params
                    ]
            except TimeoutError:
                raise CallTimeout(f"pull_parameters did not complete within {deadline} s") from None
        return response

    def _held_timeout(
        self, wait: float, timeout: float | EllipsisType | None
    ) -> float | EllipsisType | None:
        if isinstance(timeout, EllipsisType):
            return None if self.timeout is None else wait + HOLD_MARGIN + self.timeout
        return timeout

    async def update_parameters(
        self,
        params: Iterable[Any] | Mapping[str, Any],
        *,
        rules: Any = None,
        encoding: str | None = None,
        replace: bool | Collection[str] = False,
        timestamp: int | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, int]:
        """Apply an update atomically: every parameter in it, or none.

        A stored parameter keeps its dtype and shape: an update that gives it
        another is refused (``SHAPE_MISMATCH``, naming both layouts) unless
        ``replace`` says to replace it.

        A parameter larger than ``max_inline_bytes`` (see the constructor)
        goes in pieces, and the node applies it once it is whole: atomically
        by itself, not together with the rest of the update.

        Args:
            params: ``Parameter`` objects, or a mapping of name -> array.
            rules: the rule :meth:`push_gradients` folds gradients in by
                (see :mod:`aioparamsync.values.rules`): one for every parameter, or
                a mapping of name -> rule. Parameters without one keep theirs.
            encoding: send arrays encoded (``"fp16"``, ``"bf16"``, ``"int8"``,
                ``"zlib"``); the node stores them decoded. An array larger than
                ``max_inline_bytes`` even encoded goes raw, in pieces.
            replace: replace stored parameters whose dtype or shape the update
                changes: True for every parameter of the update, or the names
                of those to replace. (Their rule stays if it fits the new
                dtype; their optimizer state starts again.)
            timestamp: the update's timestamp (default: now, in milliseconds).
            timeout: this call's deadline (seconds; default: the client's).

        Returns:
            The version each parameter now has.

        Raises:
            RequestError: the node refused the update (nothing was applied).
            ConnectionLostError: the connection broke; the update may or may
                not have been applied.
        """
        update = self._update(params, timestamp, rules=rules, encoding=encoding, replace=replace)
        large = [p for p in update.params if memoryview(p.data).nbytes > self.max_inline_bytes]
        if not large:
            result = await self.invoke(METHODS.push_parameters, timeout=timeout, update=update)
            return dict(result.versions)
        # Larger than one message: each such parameter in pieces, applied once
        # whole; the others together, as one update.
        versions: dict[str, int] = {}
        small = [p for p in update.params if memoryview(p.data).nbytes <= self.max_inline_bytes]
        if small:
            update.params = small
            result = await self.invoke(METHODS.push_parameters, timeout=timeout, update=update)
            versions.update(result.versions)
        gate = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def send(piece: Any) -> dict[str, int]:
            async with gate:
                message = thrift.ParameterUpdate(params=[piece], timestamp=update.timestamp)
                result = await self.invoke(METHODS.push_parameters, timeout=timeout, update=message)
            return dict(result.versions)

        for p in large:
            if p.encoding:
                # Pieces carry raw bytes (see pieces.split): too large even
                # encoded, this parameter goes raw.
                rule, replaced = p.rule, p.replace
                p = to_parameter(p.name, params[p.name])  # type: ignore[index]
                p.rule, p.replace = rule, replaced
            # (A piece that fails stops the others: none is sent after the
            # caller is told, so the node never puts together a torn array.)
            for done in await gather_or_stop(
                map(send, pieces.split(p, uuid.uuid4().hex, self.piece_bytes))
            ):
                versions.update(done)
        return versions

    async def push_gradients(
        self,
        grads: Mapping[str, Any],
        *,
        encoding: str | None = None,
        ratio: float = 0.01,
        error_feedback: bool = True,
        request_id: str | None = None,
        timestamp: int | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, int]:
        """Fold gradients into their parameters on the node, by each parameter's rule.

        The parameters must exist with a rule (see :meth:`update_parameters`).
        All gradients of one push are applied together, or none. The push
        carries a request id (a new one by default): sent again with the same
        id, it is applied once, and a broken connection is retried so. (In a
        cluster a push is folded in parts, one at each parameter's owner; if
        one part is refused after others were folded, sending the push again
        under its id folds the rest, each part once: see the README.)

        Args:
            grads: name -> gradient array (the parameter's shape).
            encoding: compress them: ``"fp16"``, ``"bf16"``, ``"int8"``,
                ``"topk"`` (the ``ratio`` largest by magnitude) or ``"zlib"``.
            ratio: the share of elements ``"topk"`` sends.
            error_feedback: with a lossy encoding, keep what compression left
                out of each gradient and add it to the next one (so nothing
                is lost over time; see :class:`~aioparamsync.values.compression.ErrorFeedback`).
            request_id: the push's id (default: a new UUID). With error
                feedback, the last push sent under your id is sent again as
                it was when you push under that id again (a retry after a
                timeout), so that its gradients count once.
            timestamp: the push's timestamp (default: now, in milliseconds).
            timeout: this call's deadline (seconds; default: the client's).

        Returns:
            The version each parameter now has.

        Raises:
            RequestError: the node refused the push (nothing was applied):
                e.g. UNKNOWN_PARAMETER, or a parameter without a rule, or a
                gradient of another shape (SHAPE_MISMATCH).
        """
        if not isinstance(grads, Mapping):
            raise TypeError("grads must be a mapping of name -> array")
        feedback, kept = None, {}
        last = self._last_push
        try:
            if request_id is not None and last is not None and last[0] == request_id:
                # Sent again (a retry): what went the first time. Error feedback
                # counted it once; encoding it anew would count it twice.
                params = last[1]
            elif encoding is None:
                params = [to_parameter(name, g) for name, g in grads.items()]
            else:
                from ..values import compression

                if encoding in compression.LOSSY and error_feedback:
                    if self._feedback is None:
                        self._feedback = compression.ErrorFeedback()
                    feedback = self._feedback
                    kept = feedback.kept(grads)
                    encode = feedback.encode
                else:
                    encode = compression.encode
                params = [encode(name, g, encoding, ratio=ratio) for name, g in grads.items()]
                if feedback is not None and request_id is not None:
                    self._last_push = (request_id, params)
            push = thrift.GradientPush(
                grads=params,
                request_id=request_id or uuid.uuid4().hex,
                timestamp=timestamp if timestamp is not None else time.time_ns() // 1_000_000,
            )
            result = await self.invoke(METHODS.push_gradients, timeout=timeout, push=push)
        except (RequestError, TypeError, ValueError):
            # Not applied (refused by the node, or never sent): error feedback
            # keeps the residuals it had, so what this push would have sent is
            # neither lost nor sent twice by the next. (After a timeout or a
            # broken connection the push may have been applied: then the
            # residuals stay as sent; a retry under the same request_id is
            # applied once.)
            if feedback is not None:
                feedback.restore(kept)
                self._last_push = None  # (to be encoded again, from the old residuals)
            raise
        return dict(result.versions)

    async def barrier(
        self,
        group: str,
        worker: str,
        step: int,
        world_size: int,
        *,
        timeout: float | None = 600.0,
    ) -> Any:
        """Wait until ``world_size`` workers of ``group`` have reached ``step``.

        Bulk-synchronous training: each worker calls it after each step. Every
        worker of a group must use the same node. While it waits, the node's
        ``info`` (and ``aioparamsync-ctl waiting``) shows who is missing.

        Args:
            group: the barrier's name.
            worker: this worker's name, unique in the group.
            step: the step this worker has finished.
            world_size: how many workers the group has.
            timeout: the longest to wait (seconds; None: the node's maximum).

        Returns:
            A ``BarrierResult``: the group, the step, the workers that passed.

        Raises:
            RequestError: ``TIMEOUT`` (naming the workers that did not come),
                or BAD_REQUEST (e.g. a world_size the group disagrees with).
        """
        if not isinstance(group, str) or not isinstance(worker, str):
            raise TypeError(
                f"a barrier's group and worker are names (str), e.g. worker=f'rank{{rank}}'; "
                f"got {type(group).__name__} and {type(worker).__name__}"
            )
        check_seconds(timeout, "timeout")
        request = thrift.BarrierRequest(
            group=group,
            worker=worker,
            step=step,
            world_size=world_size,
            # (at least 1 ms: 0 would be no wait at all)
            wait_ms=None if timeout is None else min(max(round(timeout * 1000), 1), MAX_WAIT_MS),
        )
        deadline = None if timeout is None else timeout + HOLD_MARGIN
        return await self.invoke(METHODS.barrier, timeout=deadline, request=request)

    async def broadcast_update(
        self,
        params: Iterable[Any] | Mapping[str, Any],
        *,
        timestamp: int | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> None:
        """Send an update oneway: no reply, and no error from the node if it refuses it.

        Returns once the node has read and applied it (a ``ping`` follows it on
        the connection, and the node answers reads in order), so the arrays may
        change again and a later read on any client sees it.
        """
        update = self._update(params, timestamp)
        await self.invoke(METHODS.broadcast_update, timeout=timeout, update=update)

    async def get_arrays(
        self,
        names: Iterable[str] | None,
        min_version: int = 0,
        *,
        wait: float | None = None,
        known_versions: Mapping[str, int | tuple[int, str]] | None = None,
        encoding: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, np.ndarray]:
        """Fetch parameters as numpy arrays, by name (see :meth:`get_parameters`).

        Raw data comes as read-only views of the received bytes (no copy);
        encoded data is decoded into new arrays.
        """
        response = await self.get_parameters(
            names,
            min_version,
            wait=wait,
            known_versions=known_versions,
            encoding=encoding,
            timeout=timeout,
        )
        return {p.name: _array(p) for p in response.params}

    async def update_arrays(
        self,
        arrays: Mapping[str, Any],
        *,
        rules: Any = None,
        encoding: str | None = None,
        replace: bool | Collection[str] = False,
        timestamp: int | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, int]:
        """Store numpy arrays (any numeric dtype and shape) atomically; answer their versions.

        A stored parameter keeps its dtype and shape unless ``replace`` names
        it. See :meth:`update_parameters` for ``rules``, ``encoding`` and
        ``replace``.
        """
        if not isinstance(arrays, Mapping):
            raise TypeError("arrays must be a mapping of name -> array")
        return await self.update_parameters(
            arrays,
            rules=rules,
            encoding=encoding,
            replace=replace,
            timestamp=timestamp,
            timeout=timeout,
        )

    async def ping(self, *, timeout: float | EllipsisType | None = ...) -> str:
        """Answer the node's id."""
        return await self.invoke(METHODS.ping, timeout=timeout)

    async def info(self, *, timeout: float | EllipsisType | None = ...) -> Any:
        """The node's ``NodeInfo`` (what ``aioparamsync-ctl stats`` shows).

        Its fields: ``node_id``; ``version``, the aioparamsync release the
        node runs (not a parameter's version); ``parameter_count`` and
        ``parameter_bytes``, the parameters it holds and their bytes;
        ``timestamp``, the largest update timestamp it has applied (0 before
        any); ``uptime_seconds``, since the node was made; ``counters``, by
        name, each there from the start (0 until it counts): the server's
        ``requests`` (messages received), ``errors`` (calls answered with an
        error), ``protocol_errors``, ``timeouts``, ``bytes_in`` and
        ``bytes_out`` (of every connection to its port, framing included),
        ``connections_total``, ``connections_refused``, ``idle_closed``,
        ``budget_waits``, ``budget_overruns``; the store's
        (``updates_applied``, ``updates_refused``, ``batches``, ``pending``,
        ...), the waits' (``long_polls_waiting``, ``barrier_waiters``,
        ``wait_timeouts``, ...), the uploads' and the gradient pushes';
        ``peers``, a ``PeerInfo`` per peer link (state, outbox depth, updates
        sent and coalesced, send failures, replication lag, last error,
        parameters repaired); ``waiting``, a ``Waiter`` per long poll or
        barrier held (what it waits for, whom, and for how many seconds).
        """
        return await self.invoke(METHODS.info, timeout=timeout)

    @staticmethod
    def _update(
        params: Iterable[Any] | Mapping[str, Any],
        timestamp: int | None,
        *,
        rules: Any = None,
        encoding: str | None = None,
        replace: bool | Collection[str] = False,
    ) -> Any:
        if timestamp is None:
            timestamp = time.time_ns() // 1_000_000
        if encoding is not None:
            if not isinstance(params, Mapping):
                raise TypeError("an encoded update takes a mapping of name -> array")
            from ..values import compression

            if encoding == "topk":
                raise ValueError(compression.TOPK_IS_FOR_GRADIENTS)

            updates = [compression.encode(n, a, encoding) for n, a in params.items()]
        else:
            updates = to_parameters(params)
        if rules is not None:
            for p in updates:
                rule = rules.get(p.name) if isinstance(rules, Mapping) else rules
                if rule is not None:
                    p.rule = rule
        if replace is True:
            for p in updates:
                p.replace = True
        elif replace is not False:
            names = _replaced_names(replace, {p.name for p in updates})
            for p in updates:
                if p.name in names:
                    p.replace = True
        return thrift.ParameterUpdate(params=updates, timestamp=timestamp)


def _replaced_names(replace: Any, names: set[str]) -> set[str]:
    """The names ``replace`` (a collection of names) asks to replace, all in the update."""
    if isinstance(replace, str | bytes) or not isinstance(replace, Iterable):
        raise TypeError(
            f"replace is True, False or a collection of parameter names, not {replace!r}"
        )
    asked = set(replace)
    if not all(isinstance(n, str) for n in asked):
        raise TypeError("replace names parameters by their names (str)")
    if missing := asked - names:
        raise ValueError(f"replace names parameters the update does not hold: {sorted(missing)}")
    return asked


def _array(p: Any) -> np.ndarray:
    """The array of a received ``Parameter``, decoded if it is encoded."""
    if not p.encoding:
        return from_parameter(p)
    from ..values import compression

    return compression.decode(p)
