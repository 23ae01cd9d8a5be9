"""The errors aioparamsync raises, grouped by cause.

Every error derives from :class:`ParamSyncError`. Where a standard exception
fits, ours derives from it too, so ``except TimeoutError`` or
``except ValueError`` work as a user expects.

- :class:`ProtocolError`: bytes that are not a valid message.
  :class:`RemoteProtocolError` means the other side sent them (close that
  connection); :class:`LocalProtocolError` means we were asked to send
  something the protocol cannot carry.
- :class:`RequestError`: the node understood the request and refused it
  (bad names, data that does not match its dtype and shape, limits); it
  carries the wire's :class:`ErrorCode`. :class:`Moved` is the one whose
  code is ``MOVED``: the node does not hold what was asked of it at its
  epoch (ask for the topology again); :class:`Indeterminate` the one whose
  code is ``INDETERMINATE``: a write that may or may not have been applied.
  Every other code of a write means nothing of it was applied.
- :class:`ServerError`: the node failed or does not know the method (a
  ``TApplicationException`` on the wire).
- :class:`NetworkError`: :class:`ConnectError`, :class:`ConnectionLostError`.
- :class:`CallTimeout`, :class:`ConnectTimeout`: deadlines.
- :class:`ClientClosedError`: the client was closed by its owner.
- :class:`RunningLoopError`: a blocking call from a thread that runs an event loop.
"""

from __future__ import annotations

import contextlib
import enum

__all__ = [
    "CallTimeout",
    "ClientClosedError",
    "ConnectError",
    "ConnectTimeout",
    "ConnectionLostError",
    "ErrorCode",
    "Indeterminate",
    "LocalProtocolError",
    "Moved",
    "NetworkError",
    "ParamSyncError",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestError",
    "RunningLoopError",
    "ServerError",
]


class ErrorCode(enum.IntEnum):
    """The codes of the wire's ``ParameterError`` (see ``idl/aioparamsync.thrift``)."""

    BAD_REQUEST = 1
    UNKNOWN_PARAMETER = 2
    SHAPE_MISMATCH = 3
    LIMIT_EXCEEDED = 4
    UNAVAILABLE = 5
    TIMEOUT = 6
    MOVED = 7
    INDETERMINATE = 8


class ParamSyncError(Exception):
    """Base of every error aioparamsync raises."""


class ProtocolError(ParamSyncError):
    """Bytes that are not a valid Thrift message."""


class RemoteProtocolError(ProtocolError):
    """The other side sent bytes that are not a valid message."""


class LocalProtocolError(ProtocolError, ValueError):
    """A value that the protocol cannot carry was given to be sent."""


class RequestError(ParamSyncError, ValueError):
    """The node refused a request (the wire's ``ParameterError``).

    Attributes:
        code: why, as an :class:`ErrorCode`.
        message: the node's explanation.
        epoch: with ``MOVED``, the epoch of the node's topology (else None).
    """

    def __init__(self, code: ErrorCode | int, message: str, epoch: int | None = None) -> None:
        with contextlib.suppress(ValueError):  # a newer node's code: keep the number
            code = ErrorCode(code)
        self.code = code
        self.message = message
        self.epoch = epoch
        name = code.name if isinstance(code, ErrorCode) else str(code)
        super().__init__(f"{name}: {message}")

    def __reduce__(self):  # keeps pickling (multiprocessing) working
        return (RequestError.of, (self.code, self.message, self.epoch))

    @staticmethod
    def of(code: ErrorCode | int, message: str, epoch: int | None = None) -> RequestError:
        """The error for a code from the wire: a :class:`Moved` for ``MOVED``."""
        if code == ErrorCode.MOVED:
            return Moved(message, epoch)
        if code == ErrorCode.INDETERMINATE:
            return Indeterminate(message, epoch)
        return RequestError(code, message, epoch)


class Moved(RequestError):
    """The node does not hold (or is not the primary of) what was asked, at its ``epoch``.

    Nothing was done there. The caller asks for the topology again, or passes
    the call on to the holder as it sees it (see :mod:`aioparamsync.server.forward`).
    """

    def __init__(self, message: str, epoch: int | None = None) -> None:
        super().__init__(ErrorCode.MOVED, message, epoch)


class Indeterminate(RequestError):
    """A write that may or may not have been applied: its outcome is not known.

    It was applied by the node, but a live replica did not confirm it
    (``acks=all``), or a node it was passed on to did not answer, or the node
    stopped before it finished. Read it back to know; a gradient push sent
    again under its request id folds once.
    """

    def __init__(self, message: str, epoch: int | None = None) -> None:
        super().__init__(ErrorCode.INDETERMINATE, message, epoch)


class ServerError(ParamSyncError):
    """The node answered with a ``TApplicationException``.

    Attributes:
        type: the ``TApplicationException`` type (e.g. 1 = unknown method).
    """

    def __init__(self, message: str, type: int = 0) -> None:
        self.type = type
        super().__init__(message)


class NetworkError(ParamSyncError, ConnectionError):
    """The connection to a node failed."""


class ConnectError(NetworkError):
    """No connection to the node could be made."""


class ConnectionLostError(NetworkError):
    """The connection broke while a call was in flight; the call's outcome is unknown."""


class CallTimeout(ParamSyncError, TimeoutError):
    """A call did not complete within its timeout."""


class ConnectTimeout(CallTimeout):
    """No connection could be made within the timeout."""


class ClientClosedError(ParamSyncError, RuntimeError):
    """The client was closed; no more calls can be made on it."""


class CheckpointError(ParamSyncError):
    """A checkpoint that cannot be taken or restored (the message says why)."""


class RunningLoopError(ParamSyncError, RuntimeError):
    """A blocking client's method was called from a thread that runs an event loop.

    It would stall every task of that loop until answered (and, on the
    client's own loop, never be answered): async code uses
    :class:`~aioparamsync.ParameterClient` and awaits its methods.
    """


def drop_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of every exception it chains (cause, context).

    A node calls it once a refused or failed call's error has been logged and is
    answered. A traceback holds every frame the exception passed through, and each frame
    what it held: a request's decoded values, a 64 MiB frame of it. Where one of those
    frames also holds the exception (a future set with it, a task that raised it), the
    two form a cycle that only the garbage collector frees, and every bad request would
    leave its bytes behind until its next pass.
    """
    pending = [exc]
    seen: set[int] = set()
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending.extend(c for c in (e.__cause__, e.__context__) if c is not None)
