"""Durability: a write-ahead log of every applied batch, snapshots, and recovery.

Theory of operation. With ``--data-dir DIR`` the store's writer, after it
applies a batch and before it answers the callers, appends the batch's
entries to the write-ahead log (one record a batch: group commit) and, as
``--fsync`` says, flushes it to disk:

- ``always``: ``fsync`` before answering. An acknowledged update survives a
  crash of the process and of the machine.
- ``batch`` (the default): ``fsync`` at most every ``FSYNC_BATCH_SECONDS``.
  An acknowledged update is in the operating system's cache when it is
  answered, so it survives a crash of the process (``kill -9``); a crash of
  the machine may lose the last ``FSYNC_BATCH_SECONDS`` of updates.
- ``never``: the operating system writes when it likes; as ``batch`` for a
  crash of the process.

A record is ``[u32 length][u32 crc32][payload]``, the payload a
``ParameterUpdate`` in Thrift's binary protocol whose parameters carry their
version and origin, so replaying it is a merge (last writer wins): replay is
idempotent. The log is cut into segments (``wal-00000001.log``, ...).

A snapshot (``snapshot-N.safetensors``, readable by
``safetensors.numpy.load_file``, with ``snapshot-N.json`` beside it: each
parameter's version, origin, dtype, shape and crc32) holds the state at the
moment segment N began; once written, older segments and snapshots are
deleted. Snapshots are taken when the log has grown by
``snapshot_wal_bytes``, and at shutdown.

Recovery loads the newest snapshot and replays the segments from its number
on. A record cut short or failing its checksum at the end of the last
segment is a torn write: it is cut off, with a warning. Damage anywhere else,
or a snapshot that fails its checks, is an error: the node refuses to start
rather than lose data silently (``ignore_corrupt_snapshot`` overrides for a
snapshot: then it starts from what the log still holds). What a crash amid a
snapshot left behind (``.tmp`` files, a ``.safetensors`` without its
``.json``) is never read, so recovery removes it.

One node a directory: recovery takes an exclusive ``flock`` on ``LOCK`` in
it, held until :meth:`DataDir.close` (or the process's end, however it ends).
A second node on the same directory would delete the first one's log
segments at its first snapshot; it refuses to start instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import re
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ParamSyncError
from ..store.table import Entry, ParameterTable, lww_key
from ..values import pieces
from ..wire import thrift
from ..wire.codec import BinaryReader, BinaryWriter

__all__ = ["DataDir", "FSYNC_MODES", "PersistenceError"]

log = logging.getLogger(__name__)

FSYNC_MODES = ("always", "batch", "never")
# With --fsync batch: the longest an acknowledged update waits for fsync (seconds).
FSYNC_BATCH_SECONDS = 0.05
# Log bytes after which a snapshot is taken (and the log cut).
DEFAULT_SNAPSHOT_WAL_BYTES = 1024 * 1024 * 1024
# How often loading a snapshot reports its progress (seconds).
PROGRESS_SECONDS = 2.0

_RECORD = struct.Struct("!II")  # length, crc32
_SEGMENT = re.compile(r"wal-(\d{8})\.log")
_SNAPSHOT = re.compile(r"snapshot-(\d{8})\.json")
_SNAPSHOT_DATA = re.compile(r"snapshot-(\d{8})\.safetensors")
_SNAPSHOT_TMP = re.compile(r"snapshot-\d{8}\.(?:safetensors|json)\.tmp")
# The file whose flock keeps a second node out of a data directory in use.
LOCK_NAME = "LOCK"
# numpy dtype strings that safetensors has a name for (little-endian only).
_SAFETENSORS_DTYPES = {
    "<f8": "F64",
    "<f4": "F32",
    "<f2": "F16",
    "<i8": "I64",
    "<u8": "U64",
    "<i4": "I32",
    "<u4": "U32",
    "<i2": "I16",
    "<u2": "U16",
    "|i1": "I8",
    "|u1": "U8",
    "|b1": "BOOL",
    "<c8": "C64",
    "bfloat16": "BF16",  # (its wire bytes are little-endian, as safetensors wants)
}


class PersistenceError(ParamSyncError):
    """The data directory cannot be used as it is (damaged, or not ours)."""


@dataclass
class Recovered:
    """What recovery found."""

    snapshot: int | None = None
    parameters: int = 0
    records: int = 0
    torn_bytes: int = 0


_RULE_FIELDS = [field[1] for _, field in sorted(thrift.Rule.thrift_spec.items())]


def _rule(fields: Any, name: str, path: Path) -> Any:
    """The ``Rule`` a snapshot's metadata holds for ``name`` (None if none)."""
    if fields is None:
        return None
    if not isinstance(fields, dict) or not set(fields) <= set(_RULE_FIELDS):
        raise PersistenceError(f"snapshot {path}: {name!r} has a malformed rule {fields!r}")
    return thrift.Rule(**fields)


def _segment_name(n: int) -> str:
    return f"wal-{n:08d}.log"


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
# (see DataDir.append): _log_upload_id's. Older logs' ids name the parameter.
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DataDir:
    """A node's data directory: its log and snapshots.

    Args:
        path: the directory (made if missing).
        fsync: ``always``, ``batch`` or ``never`` (see the module's docstring).
        snapshot_wal_bytes: log bytes after which :meth:`snapshot_due` says so.
        ignore_corrupt_snapshot: start without a snapshot that fails its checks.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: str = "batch",
        snapshot_wal_bytes: int = DEFAULT_SNAPSHOT_WAL_BYTES,
        ignore_corrupt_snapshot: bool = False,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, not {fsync!r}")
        self.path = Path(path)
        self.fsync = fsync
        self.snapshot_wal_bytes = snapshot_wal_bytes
        self.ignore_corrupt_snapshot = ignore_corrupt_snapshot
        self.sync_interval = FSYNC_BATCH_SECONDS  # with fsync=batch
        self.segment = 0  # the segment being written
        self._fd: int | None = None
        # Held while the log's fd is synced, or closed (and replaced): a sync
        # runs in a worker thread (fsync=batch), and a snapshot cuts the log on
        # the event loop's; without it the sync could fsync an fd closed under
        # it (EBADF: the node then takes no more updates) or, its number reused
        # by the next segment, the wrong file.
        self._fd_lock = threading.Lock()
        self._lock_fd: int | None = None  # LOCK, flocked: from recover() to close()
        self.wal_bytes = 0  # bytes in the log since the last snapshot
        self._last_sync = 0.0
        self._dirty = False
        self.records_written = 0

    def __repr__(self) -> str:
        return f"<DataDir {str(self.path)!r} segment {self.segment}, fsync={self.fsync}>"

    # -- recovery -----------------------------------------------------------------

    def recover(self, table: ParameterTable) -> Recovered:
        """Lock the directory, load the newest snapshot and replay the log into ``table``;
        open the log.

        Raises:
            PersistenceError: the directory is damaged (see the module's docstring),
                or another node (or another DataDir) has it.
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PersistenceError(f"cannot use {self.path} as a data directory: {exc}") from exc
        if not os.access(self.path, os.W_OK):
            raise PersistenceError(f"data directory {self.path} is not writable")
        try:
            self._lock()
            try:
                self._remove_leftovers()
                return self._recover(table)
            except BaseException:
                # A DataDir that did not recover holds nothing: the directory may be
                # tried again (say with ignore_corrupt_snapshot) in this process.
                self._unlock()
                raise
        except OSError as exc:
            raise PersistenceError(f"cannot use {self.path} as a data directory: {exc}") from exc

    def _lock(self) -> None:
        """Take ``LOCK``'s flock, or raise PersistenceError: one node a directory.

        Two nodes on one directory would each delete the other's log segments
        as they snapshot, losing acknowledged updates. The kernel drops a
        flock when the process ends, however it ends, so a ``kill -9`` leaves
        no stale lock. The file stays when released (removing it would race
        with a node opening it); it holds its last holder's pid, for the
        message. A flock belongs to an open file: a second DataDir on the
        directory in the same process is kept out too.
        """
        if self._lock_fd is not None:
            return
        fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "pid unknown"
            raise PersistenceError(
                f"data directory {self.path} is in use by another node ({who}); the node "
                "will not start (two nodes on one directory delete each other's log)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # which drops the flock
            raise
        self._lock_fd = fd

    def _unlock(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)  # also for a child forked with the file
            finally:
                os.close(fd)

    def _remove_leftovers(self) -> None:
        """Remove what a crash amid writing a snapshot left: files a model's size.

        A snapshot is written to ``.tmp`` files renamed into place, its data
        first, its ``.json`` last (from then on it exists), and older ones
        are dropped ``.json`` first. So a crash leaves ``snapshot-N.*.tmp``,
        or a ``snapshot-N.safetensors`` without its ``.json``: recovery never
        loads either (only a snapshot with its ``.json``), and the snapshot
        before with the log from its number on still holds everything, so
        they would stay forever. Called under the lock: no node is writing a
        snapshot here now.
        """
        names = {p.name for p in self.path.iterdir()}
        for name in sorted(names):
            data = _SNAPSHOT_DATA.fullmatch(name)
            if not (
                _SNAPSHOT_TMP.fullmatch(name) or (data and f"snapshot-{data[1]}.json" not in names)
            ):
                continue
            path = self.path / name
            if not path.is_file():
                continue  # not something a snapshot writes: not ours to remove
            log.warning(
                "removing %s (%d MiB), left by a crash while a snapshot was written",
                path,
                path.stat().st_size >> 20,
            )
            path.unlink(missing_ok=True)

    def _recover(self, table: ParameterTable) -> Recovered:
        found = Recovered()
        snapshots = sorted(
            (int(m[1]) for p in self.path.iterdir() if (m := _SNAPSHOT.fullmatch(p.name))),
            reverse=True,
        )
        start = 0
        for n in snapshots:
            try:
                found.parameters = self._load_snapshot(n, table)
            except PersistenceError as exc:
                if not self.ignore_corrupt_snapshot:
                    raise PersistenceError(
                        f"{exc}; the node will not start without it (to start from what "
                        "the log still holds, losing what only the snapshot held, pass "
                        "--ignore-corrupt-snapshot)"
                    ) from exc
                log.error("%s: ignored, as asked", exc)
                continue
            found.snapshot = start = n
            break
        segments = sorted(
            int(m[1]) for p in self.path.iterdir() if (m := _SEGMENT.fullmatch(p.name))
        )
        segments = [n for n in segments if n >= start]
        # Large parameters are logged in pieces: put together here.
        uploads = pieces.Uploads(max_bytes=2**63, timeout=math.inf)
        held: list[Any] = []  # large parameters whole, waiting for their batch's record
        for i, n in enumerate(segments):
            last = i == len(segments) - 1
            records, torn = self._replay(n, table, uploads, held, last=last)
            found.records += records
            found.torn_bytes += torn
        if uploads.statistics()["uploads_open"] or held:
            log.warning(
                "the log ends amid a batch with %d large parameters written in pieces (a "
                "crash while writing it: its updates were not acknowledged); it is dropped",
                uploads.statistics()["uploads_open"] + len(held),
            )
        self.segment = max([start, *segments], default=0) or 1
        self._open_segment(self.segment)
        return found

    def _replay(
        self,
        n: int,
        table: ParameterTable,
        uploads: pieces.Uploads,
        held: list[Any],
        *,
        last: bool,
    ) -> tuple[int, int]:
        path = self.path / _segment_name(n)
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
                    raise PersistenceError(
                        f"{path} is damaged at byte {pos} ({problem}) and records follow "
                        "it: not a torn write; the node will not start"
                    )
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
                raise PersistenceError(
                    f"{path}: record at byte {pos} passes its checksum but cannot be applied: {exc}"
                ) from exc
            records += 1
            pos = end
        self.wal_bytes += pos
        return records, 0

    def _load_snapshot(self, n: int, table: ParameterTable) -> int:
        meta_path = self.path / f"snapshot-{n:08d}.json"
        data_path = self.path / f"snapshot-{n:08d}.safetensors"
        try:
            meta = json.loads(meta_path.read_text())
            params = meta["parameters"]
            timestamp = int(meta["timestamp"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PersistenceError(f"snapshot {meta_path} cannot be read: {exc!r}") from exc
        try:
            with open(data_path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise PersistenceError(f"snapshot {data_path} cannot be read: {exc}") from exc
        try:
            return self._merge_snapshot(meta_path, data_path, mapped, params, timestamp, table)
        except (KeyError, TypeError, ValueError) as exc:
            raise PersistenceError(
                f"snapshot {meta_path} does not describe {data_path}: {exc!r}"
            ) from exc

    def _merge_snapshot(
        self,
        meta_path: Path,
        data_path: Path,
        mapped: mmap.mmap,
        params: dict[str, Any],
        timestamp: int,
        table: ParameterTable,
    ) -> int:
        view = memoryview(mapped)
        try:
            (header_len,) = struct.unpack_from("<Q", view, 0)
            header = json.loads(bytes(view[8 : 8 + header_len]))
        except (struct.error, ValueError) as exc:
            raise PersistenceError(f"snapshot {data_path}: bad header: {exc}") from exc
        base = 8 + header_len
        total = sum(int(p["nbytes"]) for p in params.values()) or 1
        loaded = 0
        last_report = time.monotonic()
        wire = []
        for name, p in params.items():
            info = header.get(name)
            if info is None:
                raise PersistenceError(f"snapshot {data_path} lacks {name!r}")
            start, end = (base + int(x) for x in info["data_offsets"])
            if not base <= start <= end <= len(view) or end - start != int(p["nbytes"]):
                raise PersistenceError(f"snapshot {data_path}: {name!r} lies outside the file")
            data = view[start:end]
            if zlib.crc32(data) != p["crc32"]:
                raise PersistenceError(f"snapshot {data_path}: {name!r} fails its checksum")
            wire.append(
                thrift.Parameter(
                    name=name,
                    data=data,
                    version=p["version"],
                    dtype=p["dtype"],
                    shape=p["shape"],
                    origin=p["origin"],
                    rule=_rule(p.get("rule"), name, data_path),
                )
            )
            loaded += end - start
            now = time.monotonic()
            if now - last_report >= PROGRESS_SECONDS:
                log.info(
                    "loading %s: %d%% (%d of %d MiB)",
                    data_path.name,
                    100 * loaded // total,
                    loaded >> 20,
                    total >> 20,
                )
                last_report = now
        try:
            table.merge(wire, timestamp)
        except ParamSyncError as exc:
            raise PersistenceError(f"snapshot {data_path}: {exc}") from exc
        log.info("loaded %s: %d parameters, %d MiB", data_path.name, len(wire), loaded >> 20)
        return len(wire)

    # -- the log ------------------------------------------------------------------

    def _open_segment(self, n: int) -> None:
        path = self.path / _segment_name(n)
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        _fsync_dir(self.path)
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
        writer = BinaryWriter()
        writer.write_struct(update)
        parts, size = writer.getvalue()
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        buffers = [_RECORD.pack(size, crc), *parts]
        total = _RECORD.size + size
        written = os.writev(self._fd, buffers)
        while written < total:  # a short write: write the rest
            rest = b"".join(bytes(b) for b in buffers)[written:]
            written += os.write(self._fd, rest)
        self.wal_bytes += total
        self.records_written += 1
        self._dirty = True

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

    # -- snapshots ----------------------------------------------------------------

    def snapshot_due(self) -> bool:
        return self.wal_bytes >= self.snapshot_wal_bytes

    def start_snapshot(self) -> int:
        """Cut the log: later records go to a new segment. Answer the snapshot's number.

        Call between batches, capturing the table's entries at the same moment.
        """
        self.sync()
        self._open_segment(self.segment + 1)
        self.wal_bytes = 0
        return self.segment

    def write_snapshot(self, n: int, entries: Iterable[Entry], timestamp: int) -> Path:
        """Write snapshot ``n`` of ``entries`` (from a worker thread), then drop older files."""
        entries = list(entries)
        header: dict[str, Any] = {}
        params: dict[str, Any] = {}
        offset = 0
        for e in entries:
            dtype = _SAFETENSORS_DTYPES.get(e.dtype or "")
            shape = list(e.shape) if e.shape is not None else None
            if dtype is None or shape is None:
                dtype, st_shape = "U8", [e.nbytes]  # other layouts: their bytes
            else:
                st_shape = shape
            header[e.name] = {
                "dtype": dtype,
                "shape": st_shape,
                "data_offsets": [offset, offset + e.nbytes],
            }
            params[e.name] = {
                "version": e.version,
                "origin": e.origin,
                "dtype": e.dtype,
                "shape": shape,
                "nbytes": e.nbytes,
                "crc32": zlib.crc32(e.data),
            }
            if e.rule is not None:
                params[e.name]["rule"] = {
                    k: getattr(e.rule, k) for k in _RULE_FIELDS if getattr(e.rule, k) is not None
                }
            offset += e.nbytes
        header["__metadata__"] = {"format": "aioparamsync snapshot 1", "timestamp": str(timestamp)}
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
        data_path = self.path / f"snapshot-{n:08d}.safetensors"
        meta_path = self.path / f"snapshot-{n:08d}.json"
        tmp = data_path.with_suffix(".safetensors.tmp")
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for e in entries:
                f.write(e.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, data_path)
        meta = {"format": 1, "timestamp": timestamp, "parameters": params}
        tmp = meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, meta_path)  # the snapshot exists from here on
        _fsync_dir(self.path)
        self._drop_before(n)
        log.info(
            "snapshot %s written: %d parameters, %d MiB", data_path.name, len(entries), offset >> 20
        )
        return data_path

    def _drop_before(self, n: int) -> None:
        for p in self.path.iterdir():
            m = _SEGMENT.fullmatch(p.name) or _SNAPSHOT.fullmatch(p.name)
            if m and int(m[1]) < n:
                p.unlink()
                if p.suffix == ".json":
                    with contextlib.suppress(FileNotFoundError):
                        p.with_suffix(".safetensors").unlink()

    def close(self) -> None:
        """Sync and close the log; release the directory to another node."""
        try:
            if self._fd is not None:
                self.sync()
        finally:
            with self._fd_lock:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
            self._unlock()
