"""Parameters larger than one message travel in pieces.

A Thrift ``binary`` and a frame hold less than 2 GiB, and a node takes frames
up to ``--max-frame-bytes``. So a larger parameter is sent as pieces:
``Parameter`` structs whose ``data`` is the byte range ``[offset, offset +
len(data))`` of the whole (``total_bytes``), every piece carrying the whole's
name, dtype, shape, version, origin and rule, and one ``upload_id``.

Writing: :func:`split` cuts a parameter into pieces (views of its bytes, no
copy); a node puts the pieces of each upload together in an
:class:`Uploads` (one buffer of the whole's size, filled in place) and
applies the parameter as one update once every byte has come, so no reader
ever sees part of it. A write-ahead log and a peer link use the same pieces.

Reading: a request's ``max_inline_bytes`` makes the node answer a larger
parameter without data (``total_bytes`` set); the client
(:func:`aioparamsync.client.fetch.fetch`) then reads its pieces
(``piece_offset``, ``piece_bytes``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ..errors import ErrorCode, RequestError
from ..wire import thrift
from .arrays import check_layout

__all__ = [
    "INLINE_BYTES",
    "PIECE_BYTES",
    "Uploads",
    "split",
]

# Parameters larger than this travel in pieces (bytes).
INLINE_BYTES = 128 * 1024 * 1024
# The size of a piece (bytes).
PIECE_BYTES = 64 * 1024 * 1024
# Longest id of an upload (bytes).
MAX_UPLOAD_ID_BYTES = 256
# An upload that receives nothing this long is dropped (seconds).
UPLOAD_TIMEOUT = 300.0
# Bytes a node holds in unfinished uploads, by default.
MAX_UPLOAD_BYTES = 16 * 1024**3


def split(param: Any, upload_id: str, piece_bytes: int = PIECE_BYTES) -> list[Any]:
    """Cut a whole ``Parameter`` into pieces of at most ``piece_bytes`` (views, no copy)."""
    if piece_bytes < 1:
        raise ValueError(f"piece_bytes must be at least 1, not {piece_bytes}")
    if param.encoding:
        raise ValueError(f"{param.name!r} is encoded ({param.encoding}): pieces carry raw bytes")
    data = memoryview(param.data).cast("B")
    total = data.nbytes
    return [
        thrift.Parameter(
            name=param.name,
            data=data[offset : offset + piece_bytes],
            version=param.version,
            dtype=param.dtype,
            shape=param.shape,
            origin=param.origin,
            rule=param.rule,
            replace=param.replace,
            offset=offset,
            total_bytes=total,
            upload_id=upload_id,
        )
        for offset in range(0, max(total, 1), piece_bytes)
    ]


@dataclass(eq=False)
class _Upload:
    first: Any  # the first piece: what every other must agree with
    buffer: np.ndarray
    starts: list[int] = field(default_factory=list)  # sorted starts of the pieces held
    ends: list[int] = field(default_factory=list)  # their ends, in the same order
    filled: int = 0
    seen: float = 0.0


_SAME = ("name", "version", "dtype", "shape", "origin", "total_bytes", "replace")


class Uploads:
    """Pieces being put together: a node's (or a log replay's) staging area.

    Args:
        max_bytes: the most bytes all unfinished uploads may hold.
        timeout: an upload that receives nothing this long is dropped.
        clock: seconds, for the timeout.
    """

    def __init__(
        self,
        max_bytes: int = MAX_UPLOAD_BYTES,
        timeout: float = UPLOAD_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.clock = clock
        self._uploads: dict[str, _Upload] = {}
        self.staged_bytes = 0
        self.completed = 0
        self.dropped = 0

    def __repr__(self) -> str:
        return f"<Uploads [{len(self._uploads)} open | {self.staged_bytes} bytes staged]>"

    def __len__(self) -> int:
        """How many uploads are open."""
        return len(self._uploads)

    def add(self, piece: Any) -> Any | None:
        """Take one piece; answer the whole ``Parameter`` once it is complete, else None.

        The whole's ``data`` is a read-only view of the buffer the pieces
        were put together in.

        Raises:
            RequestError: a malformed piece (BAD_REQUEST, SHAPE_MISMATCH), one
                that disagrees with its upload, or no room (LIMIT_EXCEEDED).
                The upload keeps what it had.
        """
        self.sweep()
        name, upload_id, total = piece.name, piece.upload_id, piece.total_bytes
        if not isinstance(name, str) or not name:
            raise RequestError(ErrorCode.BAD_REQUEST, "a piece's parameter name is empty")
        if not upload_id or len(upload_id.encode()) > MAX_UPLOAD_ID_BYTES:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{name!r}: a piece needs an upload_id of 1 to {MAX_UPLOAD_ID_BYTES} bytes",
            )
        if piece.encoding:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{name!r}: pieces are not encoded")
        data = memoryview(piece.data).cast("B") if piece.data is not None else None
        offset = piece.offset
        if data is None or offset is None or total is None:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"{name!r}: a piece needs data, offset and total_bytes"
            )
        end = offset + data.nbytes
        if total < 1 or offset < 0 or end > total or (data.nbytes == 0 and total > 0):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{name!r}: a piece of {data.nbytes} bytes at {offset} does not fit in {total}",
            )
        upload = self._uploads.get(upload_id)
        if upload is None:
            check_layout(name, total, piece.dtype, piece.shape)
            if self.staged_bytes + total > self.max_bytes:
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"{name!r}: {total} bytes would take the node's unfinished uploads past "
                    f"{self.max_bytes} bytes; try again later",
                )
            upload = _Upload(piece, np.empty(total, np.uint8))  # not zeroed: filled below
            self._uploads[upload_id] = upload
            self.staged_bytes += total
        else:
            for attribute in _SAME:
                if getattr(piece, attribute) != getattr(upload.first, attribute):
                    raise RequestError(
                        ErrorCode.BAD_REQUEST,
                        f"{name!r}: a piece of upload {upload_id!r} has another {attribute}",
                    )
        upload.seen = self.clock()
        i = bisect.bisect_right(upload.starts, offset)
        if i and upload.starts[i - 1] == offset and upload.ends[i - 1] == end:
            return None  # the same piece again (a peer's resend): nothing new
        if (i and upload.ends[i - 1] > offset) or (
            i < len(upload.starts) and upload.starts[i] < end
        ):
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{name!r}: a piece at {offset}..{end} overlaps one upload {upload_id!r} has",
            )
        upload.buffer[offset:end] = np.frombuffer(data, np.uint8)
        upload.starts.insert(i, offset)
        upload.ends.insert(i, end)
        upload.filled += data.nbytes
        if upload.filled < total:
            return None
        del self._uploads[upload_id]
        self.staged_bytes -= total
        self.completed += 1
        first = upload.first
        return thrift.Parameter(
            name=first.name,
            data=memoryview(cast(Any, upload.buffer)).toreadonly(),
            version=first.version,
            dtype=first.dtype,
            shape=first.shape,
            origin=first.origin,
            rule=first.rule,
            replace=first.replace,
        )

    def sweep(self) -> None:
        """Drop the uploads that have received nothing for ``timeout`` seconds."""
        if not self._uploads:
            return
        limit = self.clock() - self.timeout
        for upload_id in [u for u, up in self._uploads.items() if up.seen < limit]:
            upload = self._uploads.pop(upload_id)
            self.staged_bytes -= upload.buffer.nbytes
            self.dropped += 1

    def statistics(self) -> dict[str, int]:
        return {
            "uploads_open": len(self._uploads),
            "upload_bytes_staged": self.staged_bytes,
            "uploads_completed": self.completed,
            "uploads_dropped": self.dropped,
        }
