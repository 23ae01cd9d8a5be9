"""The node's side of shared memory: the segments a connection's client names
(see :mod:`aioparamsync.values.sharedmem`).

A connection on the node's Unix socket whose peer is of the node's user
(``SO_PEERCRED``) gets a :class:`SharingHandler` in front of the node's
handler. Before a read or a push goes on, it maps the regions the call names:
a read's (``ParameterRequest.shared``, ``RowsRequest.shared``) becomes
``request.lent``, a :class:`SharedView` the read writes its answer into (one
that cannot be mapped is not used: the answer is sent); a push's blocks'
(``Packed.shared``) and a row push's rows' (``Rows.shared``) become their
``data``, views of the client's bytes (one that cannot be mapped refuses the
push, BAD_REQUEST, before anything is folded). Any other
connection has no such handler: a region it names is not used, or refused
(:func:`aioparamsync.values.packing.gradients_of`).
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import socket
import struct
from typing import Any

from ..errors import ErrorCode, RequestError
from ..values.sharedmem import SharedView, parse_segment

__all__ = ["MAX_SEGMENTS", "Segments", "SharingHandler", "peer_pid"]

log = logging.getLogger(__name__)

# Segments mapped for one connection at once (beyond: the least recently named
# is let go; named again, it is mapped again).
MAX_SEGMENTS = 64
# Read-ahead of a segment's pages when it is mapped (Linux's MAP_POPULATE).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_READS = frozenset({"get_parameters", "pull_parameters"})


def peer_pid(sock: Any) -> int | None:
    """The pid of a Unix socket's peer, if the kernel tells it and the peer is of this
    process's user (else None: it shares no memory)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (AttributeError, OSError):  # (not Linux)
        return None
    pid, uid, _ = struct.unpack("3i", creds)
    return pid if pid > 0 and uid == os.geteuid() else None


class Segments:
    """The segments of the process ``pid`` mapped here, by their names on the wire."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._maps: collections.OrderedDict[str, memoryview] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._maps)

    def region(self, shared: Any) -> SharedView:
        """The bytes of the region ``shared`` (a ``SharedRegion``).

        Raises:
            RequestError: (BAD_REQUEST) a segment that is not the client's (see
                :meth:`_map`), or a region that is not within it.
        """
        segment, offset, size = shared.segment, shared.offset, shared.size
        view = self._maps.get(segment)
        if view is None:
            view = self._map(segment)
        else:
            self._maps.move_to_end(segment)
        if not (
            isinstance(offset, int)
            and isinstance(size, int)
            and offset >= 0
            and size >= 0
            and offset + size <= view.nbytes
        ):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"a shared region of {size} bytes at {offset} is not within segment "
                f"{segment!r} ({view.nbytes} bytes)",
            )
        return SharedView(shared, view[offset : offset + size])

    def _map(self, segment: str) -> memoryview:
        try:
            fd, name = parse_segment(segment)
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, str(exc)) from None
        path = f"/proc/{self.pid}/fd/{fd}"
        try:
            # (the client's descriptor fd is that memfd: not some other file of it)
            if os.readlink(path) != f"/memfd:{name} (deleted)":
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"segment {segment!r}: the client's descriptor {fd} is not that segment",
                )
            f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"segment {segment!r}: the client's descriptor {fd} cannot be opened "
                f"({exc.strerror})",
            ) from None
        try:
            size = os.fstat(f).st_size
            if size == 0:
                raise RequestError(ErrorCode.BAD_REQUEST, f"segment {segment!r} is empty")
            mapped = mmap.mmap(f, size, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"segment {segment!r} cannot be mapped ({exc.strerror})"
            ) from None
        finally:
            os.close(f)
        view = self._maps[segment] = memoryview(mapped)
        if len(self._maps) > MAX_SEGMENTS:
            self._maps.popitem(last=False)  # (unmapped once no view of it is left)
        return view

    def close(self) -> None:
        self._maps.clear()


class SharingHandler:
    """The node's handler, for a connection whose client shares memory with the node:
    the regions its reads and pushes name, mapped first (see the module's docstring)."""

    def __init__(self, handler: Any, pid: int) -> None:
        self.inner = handler
        self.writes = handler.writes
        self.segments = Segments(pid)
        self._told = False  # (a region that could not be mapped was logged)

    def handle(self, method: Any, args: Any) -> Any:
        name = method.name
        if name == "push_gradients":
            push = args.push
            for block in (push.packed if push is not None else None) or ():
                if block.shared is not None:
                    block.data = self.segments.region(block.shared).view
                    block.shared = None
        elif name == "push_row_gradients":
            push = args.push
            grads = push.grads if push is not None else None
            if grads is not None and grads.shared is not None:
                grads.data = self.segments.region(grads.shared).view
                grads.shared = None
        elif name in _READS or name == "pull_rows":
            request = args.request
            if (
                request is not None
                and request.shared is not None
                and (name == "pull_rows" or request.packed)
            ):
                try:
                    request.lent = self.segments.region(request.shared)
                except RequestError as exc:
                    if not self._told:
                        log.info("pid %d: answers sent, not shared: %s", self.segments.pid, exc)
                        self._told = True
        return self.inner.handle(method, args)

    def close(self) -> None:
        self.segments.close()
