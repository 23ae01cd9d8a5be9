"""The write-ahead log: its records and segments, appending, reading back, cutting a torn tail.

Theory of operation. The store's writer, after it applies a batch and before
it answers the callers, appends the batch's entries to the log: one record a
batch (group commit). A record is ``[u32 length][u32 crc32][payload]``, the
payload a ``ParameterUpdate`` in Thrift's binary protocol whose parameters
carry their version and origin, so replaying it is a merge (last writer
wins): replay is idempotent. The log is cut into segments
(``wal-00000001.log``, ...); a snapshot cuts it (a new segment begins).

A parameter too large for one record is written first as records of pieces,
and the batch's record, always last, commits it: replay applies it only with
that record, so a crash amid the batch leaves none of it (see
:meth:`WriteAheadLog.append`).

Reading back, a record cut short or failing its checksum at the end of the
last segment is a torn write: it is cut off, with a warning. Damage anywhere
else is an error: the node refuses to start rather than lose data silently,
and says what starting anyway would lose. With ``ignore_corrupt_log``
(``--ignore-corrupt-log``) it starts from the log up to the damage: that
segment is cut there, and its whole copy and every later segment are kept
aside (``wal-N.log.corrupt-<time>``), never deleted, as a warning says.

:class:`WriteAheadLog` holds the log's state (the segment being written, its
descriptor, what is not synced yet); :class:`~.datadir.DataDir` is one, with
the directory around it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ParamSyncError
from ..store.table import Entry, ParameterTable, lww_key
from ..values import pieces
from ..wire import thrift
from ..wire.binary import BinaryReader, BinaryWriter
from . import PersistenceError

__all__ = ["SEGMENT_FILE", "WriteAheadLog", "fsync_dir", "segment_name", "write_record"]

log = logging.getLogger(__name__)

_RECORD = struct.Struct("!II")  # length, crc32
# A segment's file name: its number.
SEGMENT_FILE = re.compile(r"wal-(\d{8})\.log")


def segment_name(n: int) -> str:
    return f"wal-{n:08d}.log"


def write_record(fd: int, message: Any) -> int:
    """Append ``message`` (a Thrift struct) to ``fd`` as one record, ``[u32 length][u32
    crc32][payload]``, its binaries written from where they are (no copy); answer its bytes."""
    writer = BinaryWriter()
    writer.write_struct(message)
    parts, size = writer.getvalue()
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    buffers = [_RECORD.pack(size, crc), *parts]
    total = _RECORD.size + size
    written = os.writev(fd, buffers)
    while written < total:  # a short write: write the rest
        rest = b"".join(bytes(b) for b in buffers)[written:]
        written += os.write(fd, rest)
    return total


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _log_upload_id(key: str) -> str:
    """The upload id of a large parameter's pieces in the log, from a key that names it
    (``origin:version:name``).

    Fixed-length: a name (up to ``--max-name-bytes``) and an origin (a node id
    and more) make the key longer than an upload id may be
    (``pieces.MAX_UPLOAD_ID_BYTES``), which replay enforces. Ids are only
    matched within one replay, so a hash is as good as the key.
    """
    return "log:" + hashlib.sha256(key.encode(errors="surrogatepass")).hexdigest()


def _replayed(piece: Any) -> Any:
    """``piece``, read from the log, with an upload id that replay accepts.

    Logs written before ids were hashed (:func:`_log_upload_id`) name pieces
    ``log:origin:version:name``, which may be longer than an upload id may
    be: those updates were acknowledged, so such an id is hashed (every piece
    of the upload alike) rather than refused.
    """
    upload_id = piece.upload_id
    if isinstance(upload_id, str) and len(upload_id.encode()) > pieces.MAX_UPLOAD_ID_BYTES:
        piece.upload_id = _log_upload_id(upload_id)
    return piece


# The upload ids of pieces logged since a batch's last record commits them
# (see WriteAheadLog.append): _log_upload_id's. Older logs' ids name the parameter.
_COMMITTED_BY_RECORD = re.compile(r"log:[0-9a-f]{64}")


def _latest(params: Iterable[Any]) -> list[Any]:
    """``params`` with one per name: the largest ``(version, origin)``, as merge keeps.

    A batch is every update the writer applied at once, so its record may hold
    a name twice (two workers updating it together); one update may not.
    """
    latest: dict[str, Any] = {}
    for p in params:
        kept = latest.get(p.name)
        if kept is None or lww_key(p) > lww_key(kept):
            latest[p.name] = p
    return list(latest.values())


class _Damaged(Exception):
    """Replay met damage that is not a torn write, and was asked to go on without the rest."""

    def __init__(self, path: Path, pos: int, records: int) -> None:
        super().__init__(path, pos, records)
        self.path, self.pos, self.records = path, pos, records


class WriteAheadLog:
    """The log in a directory: replaying it, appending to it, syncing it.

    Args:
        path: the directory its segments are in.
        fsync: ``always``, ``batch`` or ``never`` (see :mod:`.datadir`).
        sync_interval: with ``fsync="batch"``, the longest a record waits for
            :meth:`sync` (seconds).
    """

    def __init__(self, path: Path, fsync: str, sync_interval: float) -> None:
        self.path = path
        self.fsync = fsync
        self.sync_interval = sync_interval  # with fsync=batch
        self.segment = 0  # the segment being written
        self._fd: int | None = None
        # Held while the log's fd is synced, or closed (and replaced): a sync
        # runs in a worker thread (fsync=batch), and a snapshot cuts the log on
        # the event loop's; without it the sync could fsync an fd closed under
        # it (EBADF: the node then takes no more updates) or, its number reused
        # by the next segment, the wrong file.
        self._fd_lock = threading.Lock()
        self.wal_bytes = 0  # bytes in the log since the last snapshot
        #: replay up to damage that is not a torn write, and set the rest aside
        self.ignore_corrupt_log = False
        self._last_sync = 0.0
        self._dirty = False
        self.records_written = 0

    # -- reading back -------------------------------------------------------------

    def _recover_log(self, start: int, table: ParameterTable) -> tuple[int, int]:
        """Replay the segments from ``start`` on into ``table``, then open the last for
        appending. Answer the records replayed and the bytes cut off as a torn write.
        """
        records_total = torn_total = 0
        segments = sorted(
            int(m[1]) for p in self.path.iterdir() if (m := SEGMENT_FILE.fullmatch(p.name))
        )
        segments = [n for n in segments if n >= start]
        # Large parameters are logged in pieces: put together here.
        uploads = pieces.Uploads(max_bytes=2**63, timeout=math.inf)
        held: list[Any] = []  # large parameters whole, waiting for their batch's record
        for i, n in enumerate(segments):
            last = i == len(segments) - 1
            try:
                records, torn = self._replay(n, table, uploads, held, last=last)
            except _Damaged as exc:
                records_total += exc.records
                self._set_aside_from(exc, segments[i + 1 :])
                segments = segments[: i + 1]
                break
            records_total += records
            torn_total += torn
        if uploads.statistics()["uploads_open"] or held:
            log.warning(
                "the log ends amid a batch with %d large parameters written in pieces (a "
                "crash while writing it: its updates were not acknowledged); it is dropped",
                uploads.statistics()["uploads_open"] + len(held),
            )
        self.segment = max([start, *segments], default=0) or 1
        self._open_segment(self.segment)
        return records_total, torn_total

    def _replay(
        self,
        n: int,
        table: ParameterTable,
        uploads: pieces.Uploads,
        held: list[Any],
        *,
        last: bool,
    ) -> tuple[int, int]:
        path = self.path / segment_name(n)
        records = 0
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise PersistenceError(f"cannot read {path}: {exc}") from exc
        pos = 0
        while pos < len(data):
            problem = ""
            end = len(data)
            if pos + _RECORD.size > len(data):
                problem = "a record header cut short"
            else:
                length, crc = _RECORD.unpack_from(data, pos)
                end = pos + _RECORD.size + length
                if length == 0:
                    problem = "an empty record (zeroed bytes)"  # never written: not a record
                elif end > len(data):
                    problem = f"a record of {length} bytes cut short"
                else:
                    payload = memoryview(data)[pos + _RECORD.size : end]
                    if zlib.crc32(payload) != crc:
                        problem = "a record failing its checksum"
            if problem:
                # A torn write damages only the last record, and may leave zeroed
                # bytes after it (a power cut): any other damage is not one.
                rest_is_zeros = not data[max(end, pos + _RECORD.size) :].strip(b"\0")
                if not last or not (end >= len(data) or rest_is_zeros):
                    self._damaged(path, pos, len(data), f"({problem}) and records follow it", n)
                    raise _Damaged(path, pos, records)
                torn = len(data) - pos
                log.warning(
                    "%s: cutting %d bytes at its end (%s: a write torn by a crash)",
                    path,
                    torn,
                    problem,
                )
                with open(path, "r+b") as f:
                    f.truncate(pos)
                    os.fsync(f.fileno())
                self.wal_bytes += pos
                return records, torn
            try:
                # A copy per record: the entries it leaves must not keep the segment alive.
                update = BinaryReader(bytes(payload)).read_struct(thrift.ParameterUpdate)
                params = []
                for p in update.params:
                    if p.total_bytes is None:
                        params.append(p)
                    elif _COMMITTED_BY_RECORD.fullmatch(p.upload_id or ""):
                        # Whole, it waits for its batch's record (see append).
                        if (whole := uploads.add(p)) is not None:
                            held.append(whole)
                    elif (whole := uploads.add(_replayed(p))) is not None:
                        params.append(whole)  # (older logs: applied once whole)
                if update.params and all(p.total_bytes is not None for p in update.params):
                    if params:
                        table.merge(_latest(params), update.timestamp)
                else:  # a batch's record: with the large ones it commits
                    params += held
                    held.clear()
                    table.merge(_latest(params), update.timestamp)
            except ParamSyncError as exc:
                self._damaged(path, pos, len(data), f"(a record that cannot be applied: {exc})", n)
                raise _Damaged(path, pos, records) from exc
            records += 1
            pos = end
        self.wal_bytes += pos
        return records, 0

    def _later(self, n: int) -> list[Path]:
        return sorted(
            p
            for p in self.path.iterdir()
            if (m := SEGMENT_FILE.fullmatch(p.name)) is not None and int(m[1]) > n
        )

    def _damaged(self, path: Path, pos: int, size: int, problem: str, n: int) -> None:
        """Raise PersistenceError for damage at byte ``pos`` of segment ``n`` (``path``, ``size``
        bytes), saying what starting anyway would lose, unless ``ignore_corrupt_log``."""
        if self.ignore_corrupt_log:
            return
        later = self._later(n)
        lost = f"its last {size - pos} bytes"
        if later:
            lost += f" and the {len(later)} segments after it ({', '.join(p.name for p in later)})"
        raise PersistenceError(
            f"{path} is damaged at byte {pos} {problem}: not a torn write; the node will not "
            f"start. To start anyway, pass --ignore-corrupt-log: the log is replayed up to "
            f"byte {pos} of {path.name}, losing the updates in {lost}, which are kept aside "
            "(--ignore-corrupt-snapshot is for snapshots: it does not skip this)"
        )

    def _set_aside_from(self, damaged: _Damaged, later: Sequence[int]) -> None:
        """Cut the damaged segment at the damage, keeping a whole copy of it and every
        later segment aside (``.corrupt-<time>``); say so."""
        stamp = time.strftime("%Y%m%dT%H%M%S")
        path, pos = damaged.path, damaged.pos
        copy = path.with_name(f"{path.name}.corrupt-{stamp}")
        with open(path, "rb") as src, open(copy, "xb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        moved = []
        for n in later:
            segment = self.path / segment_name(n)
            target = segment.with_name(f"{segment.name}.corrupt-{stamp}")
            os.rename(segment, target)
            moved.append(target)
        fsync_dir(self.path)
        with open(path, "r+b") as f:
            f.truncate(pos)
            os.fsync(f.fileno())
        self.wal_bytes += pos
        log.warning(
            "%s is damaged at byte %d: replayed up to there, as asked (--ignore-corrupt-log); "
            "the updates after it are lost. Its whole copy is kept as %s%s",
            path,
            pos,
            copy,
            "".join(f", and {p}" for p in moved),
        )

    # -- appending ----------------------------------------------------------------

    def _open_segment(self, n: int) -> None:
        path = self.path / segment_name(n)
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fsync_dir(self.path)
        self.segment = n

    def append(self, entries: Sequence[Entry], timestamp: int) -> None:
        """Write ``entries`` to the log (call from a worker thread for large ones).

        One record holds them, but for parameters too large for one record
        (more than ``pieces.INLINE_BYTES``): each of those is written first,
        as records of pieces, put together again on replay, and the record of
        the rest comes last. Replay applies a large one only with that record,
        so a crash amid the batch leaves none of it (its updates were not
        acknowledged). A name updated twice in the batch is written once.
        """
        assert self._fd is not None, "recover() opens the log"
        params = _latest(e.to_parameter() for e in entries)
        large = [p for p in params if memoryview(p.data).nbytes > pieces.INLINE_BYTES]
        for p in large:
            upload_id = _log_upload_id(f"{p.origin}:{p.version}:{p.name}")
            for piece in pieces.split(p, upload_id, pieces.PIECE_BYTES):
                self._write_record(thrift.ParameterUpdate(params=[piece], timestamp=timestamp))
        # Last, and always: the batch's record commits the large ones before it,
        # so that a crash amid them leaves none of the batch (see _replay).
        small = [p for p in params if memoryview(p.data).nbytes <= pieces.INLINE_BYTES]
        self._write_record(thrift.ParameterUpdate(params=small, timestamp=timestamp))

    def _write_record(self, update: Any) -> None:
        assert self._fd is not None, "recover() opens the log"
        total = write_record(self._fd, update)
        self.wal_bytes += total
        self.records_written += 1
        self._dirty = True

    # -- syncing ------------------------------------------------------------------

    def sync_due(self) -> bool:
        """Whether :meth:`sync` should run before the batch is answered."""
        if not self._dirty or self.fsync == "never":
            return False
        if self.fsync == "always":
            return True
        return time.monotonic() - self._last_sync >= self.sync_interval

    @property
    def dirty(self) -> bool:
        """Whether records were written since the last :meth:`sync`."""
        return self._dirty

    def sync(self) -> None:
        with self._fd_lock:
            if self._fd is not None and self._dirty:
                self._dirty = False  # before: a record written meanwhile stays dirty
                os.fsync(self._fd)
        self._last_sync = time.monotonic()
