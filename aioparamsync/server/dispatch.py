"""From a request to its reply: each message handed to the handler, its outcome made a reply.

Theory of operation. Every complete message a connection receives is decoded
at once, in the event loop's callback, and handed to the handler, which
answers either the reply or a future of it. A read with nothing owed before
it is answered there and then; any other call becomes a :class:`Call` in the
connection's queue (see :mod:`aioparamsync.server.ordering`), settled when its
outcome is known: at once, when its handler's future is done (the call is
that future's done callback), or at the request deadline. A write's future
is kept until it is applied, for the reads sent after it to wait for; a read
held by the handler (a long poll, a barrier) is kept until it ends, for the
connection to end it if it closes first.

Errors: a handler's :class:`~aioparamsync.errors.RequestError` becomes the
method's declared ``ParameterError`` where it has one, else a
``TApplicationException``; any other error becomes a
``TApplicationException`` (INTERNAL_ERROR) and is logged. A failed handler
fails its call, never its connection.

:class:`CallDispatch` holds no socket: it is the base of
:class:`~aioparamsync.server.transport.ServerConnection`, which feeds it the
frames it receives and gives it the transport and its flow control.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any
from typing import Protocol as TypingProtocol

from thriftpy2.thrift import TApplicationException

from ..errors import (
    ErrorCode,
    LocalProtocolError,
    RemoteProtocolError,
    RequestError,
    drop_tracebacks,
)
from ..wire import Frame, MessageType, Method, decode_header, encode_message, method, thrift
from ..wire.protocol import CALL, ONEWAY, REPLY
from .ordering import MAX_PIPELINE, CallOrder

if TYPE_CHECKING:
    from .transport import Server

__all__ = ["Call", "CallDispatch", "Handler"]

log = logging.getLogger(__name__)

# The message types a request may have, and a reply's (an enum member is slow to get).
_REQUEST_TYPES = frozenset((CALL, ONEWAY))


class Handler(TypingProtocol):
    """What the server calls for each request."""

    #: names of the methods that change state (reads wait for them)
    writes: frozenset[str]

    def handle(self, method: Method, args: Any) -> Any:
        """Answer the result struct, or a future of it (None for oneway)."""


class Call:
    """A call awaiting its reply, in its connection's order.

    It is also the done callback of its handler's future (``call(future)``
    settles it), so a call that goes through a future costs no closure.
    """

    __slots__ = ("conn", "frame", "method", "reply", "seqid", "started")

    def __init__(self, conn: CallDispatch, method_: Method, seqid: int, frame: Frame) -> None:
        self.conn = conn
        self.method = method_
        self.seqid = seqid
        self.frame: Frame | None = frame  # (None once its reply is made: see CallOrder)
        self.reply: tuple[int, Any] | None = None  # (message type, struct) once known
        self.started = 0.0  # time.perf_counter() at dispatch, when calls are observed

    def __call__(self, future: asyncio.Future) -> None:
        """Settle the call with its handler's future, once that is done."""
        if future.cancelled():
            self.conn._settle(self, None, asyncio.CancelledError())
        else:
            exc = future.exception()
            self.conn._settle(self, None if exc else future.result(), exc)


def app_error(kind: int, message: str) -> TApplicationException:
    return TApplicationException(type=kind, message=message)


class CallDispatch(CallOrder):
    """Hands a connection's requests to the handler and makes replies of what it answers.

    What the connection provides (see
    :class:`~aioparamsync.server.transport.ServerConnection`): ``peer``, ``_loop``,
    ``_protocol_failure`` and ``_end_held``, besides what :class:`CallOrder` needs.
    """

    if TYPE_CHECKING:
        peer: Any
        _loop: asyncio.AbstractEventLoop

        def _protocol_failure(
            self, exc: RemoteProtocolError, frame: Frame | None, *, name: str = "", seqid: int = 0
        ) -> None: ...
        def _end_held(self, held: asyncio.Future) -> None: ...

    def __init__(self, server: Server) -> None:
        super().__init__()
        self.server = server
        # The server's, kept for the per-call paths (neither is ever replaced).
        self._counters = server.counters
        self._handler = server.handler
        self._writes = server.handler.writes
        self._request_timeout = server.config.request_timeout
        self._held: set[asyncio.Future] = set()  # reads the handler holds (long polls)
        # Small calls answered whole in C, where the handler has them (see _dispatch).
        self._fast_calls = getattr(server.handler, "fast_calls", None)

    # -- requests -----------------------------------------------------------------

    def _dispatch(self, frame: Frame) -> None:
        counters = self._counters
        counters["requests"] += 1
        fast = self._fast_calls
        if (
            fast is not None
            and frame.framed
            and not self._calls
            and (not self._unapplied or self._pending_write(self._writes_sent) is None)
        ):
            # A call owed nothing before it whose reply the handler makes whole (a small
            # read or update, in C).
            started = time.perf_counter() if self.server.call_observer is not None else 0.0
            answered = fast(frame.payload)
            if answered is not None:
                self._fast_reply(answered, started)
                return
        try:
            name, mtype, seqid, reader = decode_header(frame.payload, frame.protocol)
        except RemoteProtocolError as exc:
            self._protocol_failure(exc, frame)
            return
        m = method(name)
        if m is None or mtype not in _REQUEST_TYPES:
            counters["errors"] += 1
            if mtype == MessageType.ONEWAY:
                log.info("%s: oneway call of unknown method %r dropped", self.peer, name)
                return
            call = Call(self, Method(name, type(None), None, False), seqid, frame)
            if m is None:
                error = app_error(TApplicationException.UNKNOWN_METHOD, f"unknown method {name!r}")
            else:
                error = app_error(
                    TApplicationException.INVALID_MESSAGE_TYPE, f"message type {mtype} for {name!r}"
                )
            call.reply = (MessageType.EXCEPTION, error)
            self._calls.append(call)
            self._flush()
            return
        try:
            args = reader.read_body(m.args)
        except RemoteProtocolError as exc:
            self._protocol_failure(exc, frame, name=name, seqid=seqid)
            return
        calls = self._calls
        write = name in self._writes
        if (
            not calls
            and not write
            and not m.oneway
            and (not self._unapplied or self._pending_write(self._writes_sent) is None)
        ):
            # A read with nothing owed before it: answered at once, in the common
            # case, without queueing (see _answer).
            self._answer(m, seqid, frame, args)
        else:
            call = Call(self, m, seqid, frame)
            if self.server.call_observer is not None:
                call.started = time.perf_counter()
            if not m.oneway:
                calls.append(call)
            if write:
                outcome = self._call_handler(call, args, True)
                if isinstance(outcome, asyncio.Future) and not outcome.done():
                    # (Not always a new future: a push_gradients sent again answers
                    # the first push's, which may be older than the writes before.)
                    unapplied = self._unapplied
                    while unapplied and unapplied[0].done():
                        unapplied.popleft()
                    unapplied.append(outcome)
                    self._writes_sent += 1
            elif self._unapplied:
                # Read-your-writes: run the read once the writes before it are applied.
                self._read_after_writes(call, args, self._writes_sent)
            else:
                self._call_handler(call, args, False)
        if len(calls) >= MAX_PIPELINE:  # (a dispatch can only pause reading)
            self._update_reading()

    def _fast_reply(self, answered: tuple[bytes, str], started: float) -> None:
        """Send the reply the handler's ``fast_calls`` made: (its bytes, framed; the
        method's name), as :meth:`_answer` sends one."""
        reply, name = answered
        if started and (observe := self.server.call_observer) is not None:
            observe(name, time.perf_counter() - started, None)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self._counters["bytes_out"] += len(reply)
            self._send([reply])
        self._replied()

    def _answer(self, m: Method, seqid: int, frame: Frame, args: Any) -> None:
        """Call the handler for a read that is owed first; reply at once if it answers at once.

        What _call_handler, _settle and _flush do for such a call, without a
        Call in the queue; an answer that is a future is queued as usual.
        """
        started = time.perf_counter() if self.server.call_observer is not None else 0.0
        error: Exception | None = None
        try:
            outcome = self._handler.handle(m, args)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
            error = exc
        else:
            if isinstance(outcome, asyncio.Future):
                call = Call(self, m, seqid, frame)
                call.started = started
                self._calls.append(call)
                self._await(call, outcome, False)
                return
        if started and (observe := self.server.call_observer) is not None:
            observe(m.name, time.perf_counter() - started, error)
        if error is None:
            mtype, body = REPLY, outcome
        else:
            self._counters["errors"] += 1
            mtype, body = self._error_reply(m, error)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            self._send(self._encode(m.name, mtype, seqid, body, frame))
        self._replied()

    def _call_handler(self, call: Call, args: Any, write: bool) -> Any:
        try:
            outcome = self._handler.handle(call.method, args)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
            self._settle(call, None, exc)
            return None
        if isinstance(outcome, asyncio.Future):
            self._await(call, outcome, write)
        else:
            self._settle(call, outcome, None)
        return outcome

    def _await(self, call: Call, outcome: asyncio.Future, write: bool) -> None:
        """Settle ``call`` once its handler's future ``outcome`` is done.

        A write's future may be the store's ``Answer``, which its writer tells
        the moment it answers it (``eager``): the reply then goes out in the
        writer's step, a pass of the loop before the done callback (which then
        finds the call settled).
        """
        outcome.add_done_callback(call)  # call(outcome) settles it
        if write:
            try:  # noqa: SIM105 - (contextlib.suppress costs more, once per write)
                outcome.eager = call  # type: ignore[attr-defined]
            except AttributeError:
                pass  # another future: its done callback settles it
        elif not outcome.done():
            # A read held for a long poll or a barrier: it has its own deadline.
            self._held.add(outcome)
            outcome.add_done_callback(self._held.discard)
            if self._closing:
                # (A read that waited for writes, and is held only now.)
                self._end_held(outcome)
            return
        deadline = self._request_timeout
        if deadline is not None and not call.method.oneway:
            self._loop.call_later(deadline, self._expire, call, deadline)

    def _expire(self, call: Call, deadline: float) -> None:
        if call.reply is None:
            self._counters["timeouts"] += 1
            error = RequestError(
                ErrorCode.INDETERMINATE if call.method.writes else ErrorCode.UNAVAILABLE,
                f"{call.method.name} not done within {deadline} s; it may still complete",
            )
            self._settle(call, None, error)

    # -- outcomes -----------------------------------------------------------------

    def _settle(self, call: Call, result: Any, exc: BaseException | None) -> None:
        if call.reply is not None:
            return  # settled already (its deadline passed, or its future told at once)
        if call.started and (observe := self.server.call_observer) is not None:
            observe(call.method.name, time.perf_counter() - call.started, exc)
        m = call.method
        if exc is None:
            call.reply = (REPLY, result)
            if m.oneway:
                return  # (settled: a oneway call has no reply to send)
        else:
            self._counters["errors"] += 1
            if m.oneway:
                call.reply = (REPLY, None)  # (settled)
                log.warning("%s: oneway %s failed: %s", self.peer, m.name, exc)
                return
            call.reply = self._error_reply(m, exc)
        self._flush()

    def _error_reply(self, m: Method, exc: BaseException) -> tuple[int, Any]:
        """The reply to a call that failed with ``exc`` (logged if it is not a refusal);
        ``exc``'s tracebacks are dropped (see drop_tracebacks)."""
        try:
            return self._reply_to(m, exc)
        finally:
            drop_tracebacks(exc)

    def _reply_to(self, m: Method, exc: BaseException) -> tuple[int, Any]:
        if isinstance(exc, RequestError):
            if m.typed_errors and m.result is not None:
                error = thrift.ParameterError(
                    code=int(exc.code), message=exc.message, epoch=exc.epoch
                )
                return MessageType.REPLY, m.result(error=error)
            return MessageType.EXCEPTION, app_error(TApplicationException.UNKNOWN, str(exc))
        if isinstance(exc, asyncio.CancelledError):
            if self.server.stopping and m.typed_errors and m.result is not None:
                # (the node stops with the call unfinished: another node may take it)
                unfinished = RequestError(
                    ErrorCode.INDETERMINATE if m.writes else ErrorCode.UNAVAILABLE,
                    f"the node is shutting down: {m.name} was not finished (a write may "
                    "have been applied); try again, at another node",
                )
                return self._reply_to(m, unfinished)
            return MessageType.EXCEPTION, app_error(
                TApplicationException.INTERNAL_ERROR, f"{m.name} was cancelled (shutting down)"
            )
        log.error("%s: %s failed", self.peer, m.name, exc_info=exc)
        return MessageType.EXCEPTION, app_error(
            TApplicationException.INTERNAL_ERROR, f"{m.name} failed: {type(exc).__name__}: {exc}"
        )

    def _encode(self, name: str, mtype: int, seqid: int, body: Any, frame: Frame) -> list[Any]:
        """A reply's buffers (counted as sent)."""
        try:
            parts, size = encode_message(
                name, mtype, seqid, body, frame.protocol, framed=frame.framed
            )
        except LocalProtocolError as exc:
            log.error("%s: cannot encode the reply to %s: %s", self.peer, name, exc)
            error = app_error(
                TApplicationException.INTERNAL_ERROR, f"cannot encode the reply: {exc}"
            )
            parts, size = encode_message(
                name, MessageType.EXCEPTION, seqid, error, frame.protocol, framed=frame.framed
            )
        self._counters["bytes_out"] += size
        return parts
