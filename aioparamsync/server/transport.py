"""The asyncio server at the edge: the listening socket and each connection's protocol.

Theory of operation. Each connection is a :class:`ServerConnection`, an
``asyncio.BufferedProtocol`` whose receiving side is a sans-IO
:class:`~aioparamsync.wire.Receiver` (the socket writes straight into its
buffers). Every complete message is handed on at once, in the event loop's
callback: to the handler (see :mod:`aioparamsync.server.dispatch`), its reply
in the order of the requests, each read after the writes sent before it on
the connection (see :mod:`aioparamsync.server.ordering`). This module holds
what touches the socket: the asyncio callbacks, flow control, the ends of a
connection, and the :class:`Server` that accepts connections and shuts them
down. A connection is closed only for bytes that are not valid messages
(after a protocol error reply), for idleness, or at shutdown; never because
a handler failed.

Backpressure: a connection stops reading while its transport's write buffer
is over ``WRITE_HIGH_BYTES`` or while ``MAX_PIPELINE`` of its calls await
their replies, so neither a slow reader nor a flood of calls queues
unbounded memory. Large frames being received share one budget of bytes
(``max_receiving_bytes``, a :class:`~aioparamsync.wire.ReceiveBudget`): a
connection whose next frame does not fit stops reading until frames ahead of
it are in, so eight clients replacing 64 MiB parameters at once hold one new
buffer at a time, not eight. Frames that hold the budget but move slower than
``STALLED_BYTES_PER_SECOND`` (a dead or crawling sender) do not hold the others
back: the next waiting frame is let in beyond the budget.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import secrets
import socket
import ssl as ssl_module
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from thriftpy2.thrift import TApplicationException

from ..errors import ErrorCode, RemoteProtocolError, RequestError
from ..wire import (
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_RECEIVING_BYTES,
    UNIX_SEND_BUFFER_BYTES,
    Frame,
    MessageType,
    Protocol,
    ReceiveBudget,
    Receiver,
    encode_message,
)
from .dispatch import CallDispatch, Handler, app_error
from .ordering import MAX_PIPELINE
from .shared import SharingHandler, peer_pid

__all__ = ["Handler", "ListenError", "Server", "ServerConfig", "ServerConnection"]

log = logging.getLogger(__name__)

# Write buffer size above which a connection stops reading (bytes).
WRITE_HIGH_BYTES = 8 * 1024 * 1024
# A connection with nothing in flight and silent this long is closed (seconds).
DEFAULT_IDLE_TIMEOUT = 600.0
# Client connections a node serves at once; more are refused.
DEFAULT_MAX_CONNECTIONS = 10_000
# After its last reply and EOF, how long a closing connection may keep sending
# before it is aborted (seconds; see ServerConnection._maybe_finish).
LINGER_SECONDS = 5.0
# While frames wait for the receive budget, how often the frames holding it are
# checked for progress (seconds), and the rate below which they count as stalled
# and the next waiting frame is let in beyond the budget (bytes per second).
BUDGET_CHECK_SECONDS = 0.5
STALLED_BYTES_PER_SECOND = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 9090
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    # Bytes that large frames being received may hold, all connections
    # together (see ReceiveBudget); None: no limit.
    max_receiving_bytes: int | None = DEFAULT_MAX_RECEIVING_BYTES
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # A call not answered within this many seconds gets an UNAVAILABLE error
    # (the work may still complete); None: no deadline.
    request_timeout: float | None = None
    ssl: ssl_module.SSLContext | None = None
    # Also listen on this Unix socket (colocated clients; without TLS: who may
    # connect is the file's permissions); None: TCP only.
    unix_path: str | None = None
    # Without unix_path and TLS: listen on an abstract Unix socket of a random name
    # too, which a client that reached the TCP port from this host moves to
    # (``local_socket``: it shares memory there). An abstract socket is no file:
    # nothing to remove, and seen only within this network namespace.
    local_socket: bool = True


# Where a closing connection's incoming bytes go (they are dropped).
_DISCARD = memoryview(bytearray(64 * 1024))


def _shutting_down() -> RequestError:
    """What a read held at shutdown is answered."""
    return RequestError(ErrorCode.UNAVAILABLE, "the node is shutting down")


class ServerConnection(CallDispatch, asyncio.BufferedProtocol):
    """One client's connection (see the module's docstring).

    Its calls are dispatched and their replies ordered by its bases,
    :class:`~aioparamsync.server.dispatch.CallDispatch` and
    :class:`~aioparamsync.server.ordering.CallOrder`; this class is the asyncio
    side: the protocol's callbacks, flow control, idleness and closing.
    """

    def __init__(self, server: Server) -> None:
        super().__init__(server)
        self.receiver = Receiver(server.config.max_frame_bytes, budget=server.budget)
        self.receiver.on_grant = self._budget_granted
        self.transport: asyncio.Transport | None = None
        # The loop (set by connection_made), kept: on CPython 3.11 every
        # asyncio.get_running_loop() makes a getpid() system call.
        self._loop: asyncio.AbstractEventLoop
        self.peer: Any = None
        self._shutting_down = False  # close() was called: the node is shutting down
        self._write_paused = False
        self._read_paused = False
        self._closing = False  # no new requests: finish, then close
        self._peer_eof = False
        self._eof_sent = False
        self._idle_handle: asyncio.TimerHandle | None = None
        self._last_activity = 0.0

    def __repr__(self) -> str:
        return (
            f"<ServerConnection {self.peer} [{len(self._calls)} calls awaiting replies"
            f"{', write paused' if self._write_paused else ''}"
            f"{', closing' if self._closing else ''}]>"
        )

    # -- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are no subclasses of asyncio.Transport.
        self.transport = transport = cast(asyncio.Transport, transport)
        self._loop = asyncio.get_running_loop()
        self.peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif sock is not None and sock.family == socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_SEND_BUFFER_BYTES)
            if pid := peer_pid(sock):
                self._handler = SharingHandler(self._handler, pid)  # (see .shared)
        transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES)
        if not self.server._register(self):
            transport.close()
            return
        self._touch()
        if self.server.config.idle_timeout:
            self._schedule_idle_check(self.server.config.idle_timeout)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._closing:
            return _DISCARD  # read what still comes, so closing sends no reset
        return self.receiver.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._last_activity = self._loop.time()
        self._counters["bytes_in"] += nbytes
        if self._closing:
            return
        try:
            frames = self.receiver.buffer_updated(nbytes)
        except RemoteProtocolError as exc:
            self._protocol_failure(exc, None)
            return
        if len(frames) <= 1:
            if frames:
                self._dispatch(frames[0])
                # (a large frame comes alone) It is handed on: its budget can go
                # to the next, which the older value it replaced leaves room for.
                self.receiver.release_handed()
            if self.receiver.waiting_for_budget:
                self._wait_for_budget()
            return
        # Several requests in one read: the replies ready by the end of this
        # callback go out in one write (corked), none later than that.
        self._out = []
        try:
            for frame in frames:
                if self._closing:
                    break
                self._dispatch(frame)
        finally:
            self._uncork()
        if self.receiver.waiting_for_budget:
            self._wait_for_budget()

    def eof_received(self) -> bool:
        self._peer_eof = True
        if not self._closing:
            try:
                self.receiver.check_eof()
            except RemoteProtocolError as exc:
                log.info("%s: %s", self.peer, exc)
                self._counters["protocol_errors"] += 1
            self._closing = True
            self.receiver.close()
        # Keep the socket open for the replies still owed; close after them.
        # A caller that has stopped sending is not held for: its long polls
        # and barriers end now. (TLS has no half-close: there the transport
        # closes itself, and asyncio warns of a True.)
        for held in list(self._held):
            held.cancel()
        self._maybe_finish()
        transport = self.transport
        return transport is None or transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.receiver.close()
        self.receiver.on_grant = None  # (a cycle through it kept the receiver's buffers)
        self._calls.clear()
        # (the last write's future, done, held for the read-your-writes of a next call
        # that will not come: its Call holds this connection, a cycle that kept the
        # future's traceback, and the request's bytes in its frames, for the collector)
        self._unapplied.clear()
        # Nobody is left to answer: stop the reads held for it (long polls,
        # barriers). A write is applied all the same.
        for held in list(self._held):
            held.cancel()
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if isinstance(self._handler, SharingHandler):
            self._handler.close()  # (its segments: unmapped once no call holds a view)
        self.server._unregister(self)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # -- bytes that are not messages ----------------------------------------------

    def _protocol_failure(
        self, exc: RemoteProtocolError, frame: Frame | None, *, name: str = "", seqid: int = 0
    ) -> None:
        """Bytes that are not a valid message: say so where we can, then close."""
        self._uncork()  # the replies before it go first
        self._counters["protocol_errors"] += 1
        log.info("%s: closing the connection: %s", self.peer, exc)
        self._closing = True
        self._calls.clear()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        protocol = (
            frame.protocol if frame is not None else (self.receiver.protocol or Protocol.BINARY)
        )
        framed = frame.framed if frame is not None else self.receiver.framed is not False
        error = app_error(TApplicationException.PROTOCOL_ERROR, str(exc))
        parts, _ = encode_message(
            name, MessageType.EXCEPTION, seqid, error, protocol, framed=framed
        )
        transport.writelines(parts)
        self._maybe_finish()

    # -- flow control and lifetime ------------------------------------------------

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        should_pause = not self._closing and (
            self._write_paused
            or len(self._calls) >= MAX_PIPELINE
            or self.receiver.waiting_for_budget
        )
        if should_pause and not self._read_paused:
            self._read_paused = True
            transport.pause_reading()
        elif not should_pause and self._read_paused:
            self._read_paused = False
            transport.resume_reading()

    def _wait_for_budget(self) -> None:
        """The next frame waits for room in the receive budget: stop reading till then."""
        self._counters["budget_waits"] += 1
        self._update_reading()
        self.server._watch_budget()

    def _budget_granted(self) -> None:
        # Called by the budget as another connection's frame completes: go on
        # from the event loop, not from inside that connection's callback.
        self._loop.call_soon(self._go_on)

    def _go_on(self) -> None:
        if self._closing:
            return
        self.buffer_updated(0)  # cuts the frame that waited, now with its buffer
        self._update_reading()

    def _maybe_finish(self) -> None:
        """Once closing and every reply is written: end the connection gracefully.

        Closing a socket with unread bytes in it makes the kernel send a reset,
        which can destroy replies still on their way. So the node half-closes
        (the peer reads every reply, then EOF), reads and drops whatever still
        comes, and closes on the peer's EOF or after ``LINGER_SECONDS``.
        """
        transport = self.transport
        if not self._closing or self._calls or transport is None or transport.is_closing():
            return
        self._uncork()  # the last replies go before the end
        if self._peer_eof or not transport.can_write_eof():
            transport.close()
        elif not self._eof_sent:
            self._eof_sent = True
            transport.write_eof()
            if self._read_paused:
                self._read_paused = False
                transport.resume_reading()
            self._loop.call_later(LINGER_SECONDS, self.abort)

    def _touch(self) -> None:
        self._last_activity = self._loop.time()

    def _schedule_idle_check(self, delay: float) -> None:
        self._idle_handle = self._loop.call_later(delay, self._idle_check)

    def _idle_check(self) -> None:
        timeout = self.server.config.idle_timeout
        assert timeout
        idle = self._loop.time() - self._last_activity
        if self._calls or idle < timeout:
            self._schedule_idle_check(max(timeout - idle, 0.05) if not self._calls else timeout)
            return
        log.info("%s: closing the connection after %.1f s of silence", self.peer, idle)
        self._counters["idle_closed"] += 1
        if self.receiver.pending_bytes:
            self._counters["protocol_errors"] += 1
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        """Take no new requests; finish the calls in flight, then close.

        See :meth:`Server.close`.
        """
        self._closing = True
        self._shutting_down = True
        self.receiver.close()
        self._update_reading()
        # Reads held for long polls and barriers end now, rather than at their deadline.
        closing = _shutting_down()
        for held in list(self._held):
            if not held.done():
                held.set_exception(closing)
        self._maybe_finish()

    def _end_held(self, held: asyncio.Future) -> None:
        """End a read held after its connection began closing, as those held before were.

        (A read behind writes is held only once they are applied, maybe after
        eof_received, connection_lost or close ended the held reads.)
        """
        transport = self.transport
        if self._peer_eof or transport is None or transport.is_closing():
            held.cancel()  # the caller stopped sending, or is gone (see eof_received)
        elif self._shutting_down:
            held.set_exception(_shutting_down())  # (see close)

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()


class Server:
    """Listens on one port and serves every connection with ``handler``.

    Args:
        handler: answers the requests (see :class:`Handler`).
        config: address and limits.
    """

    def __init__(self, handler: Handler, config: ServerConfig | None = None) -> None:
        #: set once :meth:`close` began: calls cancelled then are unfinished, not failed
        self.stopping = False
        self.handler = handler
        self.config = config or ServerConfig()
        self.connections: set[ServerConnection] = set()
        self.counters: collections.Counter[str] = collections.Counter()
        self.budget = ReceiveBudget(self.config.max_receiving_bytes)
        self._budget_check: asyncio.TimerHandle | None = None
        self._budget_mark = 0
        self._server: asyncio.Server | None = None
        self._unix_server: asyncio.Server | None = None
        #: where a client on this host may connect instead ("unix:PATH", "unix:@NAME"),
        #: once started; None: nowhere
        self.local_socket: str | None = None
        self._on_idle: Callable[[], None] | None = None
        # Told (method, seconds, error or None) as each call is settled (see metrics.py).
        self.call_observer: Callable[[str, float, BaseException | None], None] | None = None

    def __repr__(self) -> str:
        where = f"{self.address[0]}:{self.address[1]}" if self._server else "not listening"
        return f"<Server {where} [{len(self.connections)} connections]>"

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) it listens on (the real port when 0 was asked for)."""
        assert self._server is not None, "the server is not started"
        host, port = self._server.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ServerConnection(self),
            self.config.host,
            self.config.port,
            reuse_address=True,
            backlog=1024,
            ssl=self.config.ssl,
        )
        config = self.config
        try:
            if config.unix_path is not None:
                self._unix_server = await _listen_unix(
                    lambda: ServerConnection(self), config.unix_path
                )
                self.local_socket = f"unix:{config.unix_path}"
            elif config.local_socket and config.ssl is None and sys.platform == "linux":
                try:
                    self._unix_server, name = await _listen_abstract(lambda: ServerConnection(self))
                    self.local_socket = f"unix:@{name}"
                except OSError as exc:  # (a sandbox without Unix sockets: TCP alone)
                    log.warning("no local socket (clients on this host use TCP): %s", exc)
        except BaseException:
            self._server.close()
            raise

    def _register(self, conn: ServerConnection) -> bool:
        if self.stopping:
            # (accepted just before close() stopped listening: asyncio makes its transport a
            # turn or two later, after close() closed those it had, and would leave it open)
            return False
        if len(self.connections) >= self.config.max_connections:
            log.warning("refusing %s: %d connections open", conn.peer, len(self.connections))
            self.counters["connections_refused"] += 1
            return False
        self.connections.add(conn)
        self.counters["connections_total"] += 1
        return True

    def _watch_budget(self) -> None:
        """While frames wait for the budget, check that the frames holding it move."""
        if self._budget_check is None and self.budget.waiting:
            self._budget_mark = self.budget.received
            self._budget_check = asyncio.get_running_loop().call_later(
                BUDGET_CHECK_SECONDS, self._check_budget
            )

    def _check_budget(self) -> None:
        self._budget_check = None
        budget = self.budget
        if not budget.waiting:
            return
        moved = budget.received - self._budget_mark
        if moved < STALLED_BYTES_PER_SECOND * BUDGET_CHECK_SECONDS:
            log.info(
                "frames holding the receive budget moved %d bytes in %.1f s; "
                "letting the next of %d waiting frames in beyond it",
                moved,
                BUDGET_CHECK_SECONDS,
                budget.waiting,
            )
            self.counters["budget_overruns"] += 1
            budget.grant_next()
        self._watch_budget()

    def _unregister(self, conn: ServerConnection) -> None:
        self.connections.discard(conn)
        if not self.connections and self._on_idle is not None:
            self._on_idle()

    async def close(self, grace: float = 5.0) -> None:
        """Stop accepting, let the calls in flight finish (up to ``grace`` s), close the rest."""
        self.stopping = True
        if self._server is None:
            return
        if self._budget_check is not None:
            self._budget_check.cancel()
            self._budget_check = None
        self._server.close()
        if self._unix_server is not None:
            self._unix_server.close()
        for conn in list(self.connections):
            conn.close()
        if self.connections:
            drained = asyncio.get_running_loop().create_future()

            def on_idle() -> None:
                if not drained.done():
                    drained.set_result(None)

            self._on_idle = on_idle
            try:
                await asyncio.wait_for(drained, grace)
            except TimeoutError:
                log.warning("aborting %d connections after %.1f s", len(self.connections), grace)
                for conn in list(self.connections):
                    conn.abort()
        await self._server.wait_closed()
        if self._unix_server is not None:
            await self._unix_server.wait_closed()
            _remove_socket(self.config.unix_path)


class ListenError(OSError):
    """The Unix socket cannot be listened on (its message says where and why)."""


async def _listen_unix(factory: Callable[[], ServerConnection], path: str) -> asyncio.Server:
    """Listen on the Unix socket ``path``: a socket file left by a node that is gone
    is replaced; one a live server listens on, or any other file, is an error."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(mode):
            raise ListenError(f"cannot listen on unix:{path}: the file exists and is no socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # left by a node that is gone
        else:
            raise ListenError(f"cannot listen on unix:{path}: another server listens on it")
        finally:
            probe.close()
    loop = asyncio.get_running_loop()
    try:
        return await loop.create_unix_server(factory, path, backlog=1024)
    except OSError as exc:
        raise ListenError(f"cannot listen on unix:{path}: {exc}") from exc


async def _listen_abstract(factory: Callable[[], ServerConnection]) -> tuple[asyncio.Server, str]:
    """Listen on an abstract Unix socket of a random name (Linux); answer it and the name."""
    name = f"aioparamsync-{os.getpid()}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)  # (create_unix_server listens on it)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(factory, sock=sock, backlog=1024)
    except BaseException:
        sock.close()
        raise
    return server, name


def _remove_socket(path: str | None) -> None:
    if path is None:
        return
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
