"""The pool: a client's connections to its node, and how each call goes over them.

Theory of operation. A client keeps up to ``max_connections`` connections
(:class:`~aioparamsync.client.connection._Connection`) to its node and sends
each call on the one with the fewest calls in flight, opening another while
every open one is busy. A call never pipelines behind a large message under
way on a connection (a large read's reply arriving, a large write's upload
going out): it waits for a new connection instead, so a write does not wait
for a large read to end, nor a read for a large write. Given several
addresses (nodes of one cluster), it uses one node at a time and moves to
the next when that one cannot be reached, or keeps breaking connections.

A connection that breaks fails its calls in flight with
:class:`~aioparamsync.errors.ConnectionLostError` and leaves the pool; the
next call opens a fresh one. How a call is retried follows its method's
traits in the method table (see :mod:`aioparamsync.wire.idl`): reads are
retried on a fresh connection; writes are not (their outcome is unknown: the
error says so), except idempotent ones such as gradient pushes, which carry
a request id the node applies once. A call that fails because the server is
no node (a :class:`~aioparamsync.errors.RemoteProtocolError`) is not retried.

A call the node holds (a long poll, a barrier) goes on a connection of its
own, so it never holds up the replies of the calls pipelined behind it.
Such connections are kept, idle, for the next held call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl as ssl_module
from collections.abc import Callable, Iterable
from types import EllipsisType
from typing import Any, Self

from ..errors import (
    CallTimeout,
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    ConnectTimeout,
    RequestError,
    ServerError,
)
from ..wire import Method, method
from .addresses import Address, check_seconds, parse_addresses, unix_path
from .connection import _Connection
from .local import PROBE_TIMEOUT, local_socket_of, on_this_host, open_unix

__all__ = ["ConnectionPool"]

log = logging.getLogger(__name__)

# How long close() waits for its connections to finish closing (seconds).
CLOSE_TIMEOUT = 1.0
# Idle connections kept for calls the node holds (long polls, barriers).
MAX_SPARE_CONNECTIONS = 4


class ConnectionPool:
    """A client's connections to its node, and :meth:`invoke`, which sends a call on them.

    The base of :class:`~aioparamsync.client.ParameterClient`, which adds the
    numpy API; its docstring says what the arguments are.

    Raises:
        ValueError: ``max_connections`` below 1, no address or one that is
            not ``host:port`` or ``unix:PATH``, ``ssl`` with a ``unix:`` address,
            or a timeout out of its range (see
            :func:`~aioparamsync.client.addresses.check_seconds`).
    """

    def __init__(
        self,
        address: Address | Iterable[Address],
        *,
        timeout: float | None,
        connect_timeout: float | None,
        max_connections: int,
        max_frame_bytes: int,
        ssl: ssl_module.SSLContext | None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.addresses = parse_addresses(address)
        if ssl is not None and any(unix_path(host) is not None for host, _ in self.addresses):
            raise ValueError(
                "a node's Unix socket speaks no TLS (who may connect is the file's "
                "permissions): connect to unix:PATH without ssl, or to its TCP port with it"
            )
        self._current = 0  # the node in use: self.addresses[self._current]
        self.timeout = check_seconds(timeout, "timeout")
        self.connect_timeout = check_seconds(connect_timeout, "connect_timeout")
        self.max_connections = max_connections
        self.max_frame_bytes = max_frame_bytes
        self.ssl = ssl
        self._connections: list[_Connection] = []
        self._connecting: asyncio.Future[_Connection] | None = None
        self._spare: list[_Connection] = []  # idle connections for held calls
        self._holding: set[_Connection] = set()  # connections a held call is on
        self._closed = False
        self.connects = 0  # connections opened so far (a new one means a new session)
        #: ask a node reached over TCP on this host for its Unix socket, and move there
        #: (see .local); set by ParameterClient
        self.find_local = False
        #: the Unix socket a node of self.addresses named, by its index (see .local)
        self.locals: dict[int, str] = {}
        self._asked: set[int] = set()  # (the indexes of the nodes asked so far)
        self._ask_local = False  # (ask at the next answer: find_local, and not asked)
        self._asking: asyncio.Future[None] | None = None
        self._retired: set[_Connection] = set()  # (TCP ones left for a local socket)
        #: bytes sent and received on every connection, framing included
        self.traffic: dict[str, int] = {"bytes_sent": 0, "bytes_received": 0}

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

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every connection; calls in flight fail with ConnectionLostError.

        Returns once the connections have closed (a TLS connection takes a round
        trip to shut down), or after ``CLOSE_TIMEOUT`` seconds.
        """
        self._closed = True
        connecting = self._connecting
        if connecting is not None:
            # (a connection still being made: its socket is closed as the connect unwinds,
            # not left to finish after this, or never, if the loop ends first)
            connecting.cancel()
        if self._asking is not None:
            self._asking.cancel()
        connections, self._connections = self._connections, []
        connections += [*self._spare, *self._holding, *self._retired]
        self._spare.clear()
        for conn in connections:
            conn.close()
        waits: list[asyncio.Future[Any]] = [conn.closed for conn in connections]
        if connecting is not None:
            waits.append(connecting)
        if waits:
            await asyncio.wait(waits, timeout=CLOSE_TIMEOUT)

    # -- the pool -------------------------------------------------------------------

    async def _connect(self, *, pooled: bool = True) -> _Connection:
        """Connect to the node in use, or else to the next that answers, in turn.

        The connection joins the pool, unless not ``pooled`` (a held call's).
        """
        failures: list[ConnectError | ConnectTimeout] = []
        for attempt in range(len(self.addresses)):
            index = (self._current + attempt) % len(self.addresses)
            host, port = self.addresses[index]
            if unix_path(host) is not None:
                where = host
            else:
                where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            factory = functools.partial(_Connection, self.max_frame_bytes, self.traffic, where)
            try:
                async with asyncio.timeout(self.connect_timeout):
                    conn, local = await self._open(index, factory)
            except TimeoutError:
                failures.append(
                    ConnectTimeout(f"no connection to {where} within {self.connect_timeout} s")
                )
                continue
            except OSError as exc:
                failures.append(ConnectError(f"cannot connect to {where}: {exc}"))
                continue
            if index != self._current:
                log.warning("moving to node %s (%s)", where, failures[-1])
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
        self._on_connection(local)
        return conn

    async def _open(
        self, index: int, factory: Callable[[], _Connection]
    ) -> tuple[_Connection, bool]:
        """A connection to the node of ``self.addresses[index]``, and whether it is on a
        Unix socket: its own (``unix:PATH``), or the one it named (see :mod:`.local`)."""
        loop = asyncio.get_running_loop()
        host, port = self.addresses[index]
        path = unix_path(host)
        if path is not None:
            return await open_unix(loop, factory, path), True
        local = self.locals.get(index)
        if local is not None:
            try:
                return await open_unix(loop, factory, local), True
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                # (the node restarted, or is gone: over TCP, and asked again)
                log.info("%s:%d: unix:%s: %s; over TCP", host, port, local, exc)
                del self.locals[index]
                self._asked.discard(index)
                self._ask_local = self.find_local
        _, conn = await loop.create_connection(factory, host, port, ssl=self.ssl)
        local = self.locals.get(index)
        if local is None:
            return conn, False
        try:  # (named while this one opened: there instead)
            moved = await open_unix(loop, factory, local)
        except OSError:
            return conn, False
        conn.close()
        return moved, True

    def _ask(self, conn: _Connection) -> None:
        """A call was answered on ``conn``: a node, perhaps on this host; ask it for its
        Unix socket (once, in the background, on that connection: see :mod:`.local`)."""
        self._ask_local = False
        index = self._current
        if index in self._asked or index in self.locals or self.ssl is not None:
            return
        if unix_path(self.addresses[index][0]) is not None or not on_this_host(conn):
            return
        self._asked.add(index)
        self._asking = asyncio.ensure_future(self._move_local(conn, index))

    async def _move_local(self, conn: _Connection, index: int) -> None:
        """Where the node of ``conn`` names its Unix socket: new calls go there, and the
        connections open now close once their calls are answered."""
        loop = asyncio.get_running_loop()
        where = conn.address

        def opened(path: str) -> Any:
            factory = functools.partial(
                _Connection, self.max_frame_bytes, self.traffic, f"{where} (unix:{path})"
            )
            return open_unix(loop, factory, path)

        timeout = min(PROBE_TIMEOUT, self.connect_timeout or PROBE_TIMEOUT)
        found = await local_socket_of(conn, self.addresses[index][1], timeout, opened)
        if found is None:
            return
        local, path = found
        if self._closed or self._current != index:
            local.close()
            return
        self.locals[index] = path
        log.debug("%s: on this host, at unix:%s", where, path)
        retired, self._connections = self._connections, [local]
        retired += self._spare
        self._spare.clear()
        self.connects += 1
        self._on_connection(True)
        self._retired.update(retired)
        while any(c.pending or c.using for c in retired):
            busy = [f for c in retired for f in c.pending.values()]
            await (asyncio.wait(busy) if busy else asyncio.sleep(0.01))
        for old in retired:
            old.close()  # (a call that got it from _acquire meanwhile opens another)

    def _on_connection(self, local: bool) -> None:
        """A connection was opened: to a node on this host's Unix socket (``local``) or not."""

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

    async def _acquire(self, write: bool = False) -> _Connection:
        while True:
            conn = self._acquire_now(write)
            if conn is not None:
                return conn
            connecting = self._connecting
            assert connecting is not None
            try:
                conn = await asyncio.shield(connecting)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if connecting.cancelled() and self._closed and not (task and task.cancelling()):
                    raise ClientClosedError("the client was closed") from None  # (by close())
                raise
            if conn.usable or conn not in self._retired:
                return conn
            # (opened, then left for the node's Unix socket before this call was sent on it)

    def _acquire_now(self, write: bool = False) -> _Connection | None:
        """The connection to send on, or None to wait for ``_connecting``.

        Opens another connection while every open one is busy (and the pool has room).
        A ``write`` is not pipelined behind a read in flight (see below).
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
            best = min(connections, key=lambda c: (c.moving_bulk, len(c.pending)), default=None)
        if best is not None and (not best.pending or len(connections) >= self.max_connections):
            return best
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        if best is None or best.moving_bulk or (write and best.reading):
            # (a large read or write under way on it: a call pipelined behind it would
            # wait for all of it; so would a write behind a read in flight, whose reply
            # may be large: a node writes a reply whole before it reads the next call, so
            # an update would wait for a pull of the whole model. The new connection is
            # not long coming. A read stays behind what was sent before it: in order
            # after the writes, read-your-writes, even of one that timed out.)
            return None
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
                    conn = self._acquire_now(m.writes)
                    if conn is None:  # none open: wait for one, within the deadline
                        async with asyncio.timeout_at(when):
                            conn = await self._acquire(m.writes)
                    if oneway or conn._write_paused:
                        conn.using += 1  # (not closed under it, left for a local socket)
                        try:
                            result = await conn.call(m, message, when)
                        finally:
                            conn.using -= 1
                        break
                    # conn.call's common case, without a coroutine of its own
                    seqid, future = conn.send(m, message, when)
                    try:
                        result = await future
                    finally:
                        conn.forget(seqid, when)
                        # (an error the future holds has this frame in its traceback, and
                        # this frame the request: without this, a cycle kept its bytes)
                        del future
                    if self._ask_local:
                        self._ask(conn)
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
            error = result.error
            raise RequestError.of(error.code, error.message, error.epoch)
        if 0 not in result.thrift_spec:
            return None  # a void method (update_parameters): its result has no success
        if result.success is None:
            raise ServerError(f"{m.name}: the node sent no result")
        return result.success
