"""The data directory: its lock, what lives where, and recovery (a snapshot, then the log).

Theory of operation. With ``--data-dir DIR`` the store's writer, after it
applies a batch and before it answers the callers, appends the batch's
entries to the write-ahead log (:mod:`.wal`: one record a batch, group
commit) and, as ``--fsync`` says, flushes it to disk:

- ``always``: ``fsync`` before answering. An acknowledged update survives a
  crash of the process and of the machine.
- ``batch`` (the default): ``fsync`` at most every ``FSYNC_BATCH_SECONDS``.
  An acknowledged update is in the operating system's cache when it is
  answered, so it survives a crash of the process (``kill -9``); a crash of
  the machine may lose the last ``FSYNC_BATCH_SECONDS`` of updates.
- ``never``: the operating system writes when it likes; as ``batch`` for a
  crash of the process.

What lives where: the log's segments (``wal-00000001.log``, ...), the
snapshots (:mod:`.snapshot`: ``snapshot-N.safetensors`` with
``snapshot-N.json`` beside it, the state at the moment segment N began), and
``LOCK``. Snapshots are taken when the log has grown by
``snapshot_wal_bytes``, and at shutdown; once one is written, older segments
and snapshots are deleted.

Recovery loads the newest snapshot and replays the segments from its number
on. A record cut short or failing its checksum at the end of the last
segment is a torn write: it is cut off, with a warning. Damage anywhere else,
or a snapshot that fails its checks, is an error: the node refuses to start
rather than lose data silently, saying which flag would start it and what
that loses. ``ignore_corrupt_log`` overrides for the log (see :mod:`.wal`);
``ignore_corrupt_snapshot`` for a
snapshot: each parameter has its own checksum, so only those that fail theirs
are dropped (one stored as partitions, whole); the rest is loaded, the log
replayed over it (bringing back what it holds of the dropped ones), the
damaged files kept aside (``snapshot-N.safetensors.corrupt-<time>``, and its
``.json`` so), never deleted, and a new snapshot written of what the node
recovered, all said in a warning. What a crash amid a snapshot left behind
(``.tmp`` files, a ``.safetensors`` without its ``.json``) is never read, so
recovery removes it.

One node a directory: recovery takes an exclusive ``flock`` on ``LOCK`` in
it, held until :meth:`DataDir.close` (or the process's end, however it ends).
A second node on the same directory would delete the first one's log
segments at its first snapshot; it refuses to start instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..store.table import Entry, ParameterTable
from . import PersistenceError, snapshot
from .wal import SEGMENT_FILE, WriteAheadLog, fsync_dir

__all__ = ["DataDir", "FSYNC_MODES", "PersistenceError"]

log = logging.getLogger(__name__)

FSYNC_MODES = ("always", "batch", "never")
# With --fsync batch: the longest an acknowledged update waits for fsync (seconds).
FSYNC_BATCH_SECONDS = 0.05
# Log bytes after which a snapshot is taken (and the log cut).
DEFAULT_SNAPSHOT_WAL_BYTES = 1024 * 1024 * 1024
# The file whose flock keeps a second node out of a data directory in use.
LOCK_NAME = "LOCK"


@dataclass
class Recovered:
    """What recovery found.

    Attributes:
        snapshot: the number of the snapshot loaded (None: none).
        parameters: the keys it held (that were loaded).
        records: the log's records replayed.
        torn_bytes: the bytes cut off the log's end (a torn write).
        dropped: parameters a damaged snapshot held that were dropped, with why
            (``ignore_corrupt_snapshot``).
        set_aside: the damaged snapshots' files, moved aside.
    """

    snapshot: int | None = None
    parameters: int = 0
    records: int = 0
    torn_bytes: int = 0
    dropped: dict[str, str] = field(default_factory=dict)
    set_aside: list[Path] = field(default_factory=list)


class DataDir(WriteAheadLog):
    """A node's data directory: its log and snapshots.

    The log's appending and syncing (:meth:`append`, :meth:`sync_due`,
    :meth:`sync`, :attr:`dirty`) are :class:`~.wal.WriteAheadLog`'s.

    Args:
        path: the directory (made if missing).
        fsync: ``always``, ``batch`` or ``never`` (see the module's docstring).
        snapshot_wal_bytes: log bytes after which :meth:`snapshot_due` says so.
        ignore_corrupt_snapshot: start without what fails its checks in a snapshot.
        ignore_corrupt_log: start from the log up to damage that is no torn write
            (see :mod:`.wal`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: str = "batch",
        snapshot_wal_bytes: int = DEFAULT_SNAPSHOT_WAL_BYTES,
        ignore_corrupt_snapshot: bool = False,
        ignore_corrupt_log: bool = False,
    ) -> None:
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync must be one of {FSYNC_MODES}, not {fsync!r}")
        super().__init__(Path(path), fsync, FSYNC_BATCH_SECONDS)
        self.snapshot_wal_bytes = snapshot_wal_bytes
        self.ignore_corrupt_snapshot = ignore_corrupt_snapshot
        self.ignore_corrupt_log = ignore_corrupt_log
        self._lock_fd: int | None = None  # LOCK, flocked: from recover() to close()

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
            data = snapshot.DATA_FILE.fullmatch(name)
            if not (
                snapshot.TMP_FILE.fullmatch(name)
                or (data and f"snapshot-{data[1]}.json" not in names)
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
            (int(m[1]) for p in self.path.iterdir() if (m := snapshot.META_FILE.fullmatch(p.name))),
            reverse=True,
        )
        start = 0
        damaged: list[tuple[int, str, snapshot.Loaded | None]] = []
        for n in snapshots:
            try:
                loaded: snapshot.Loaded | None = snapshot.load(self.path, n, table)
            except PersistenceError as exc:
                if not self.ignore_corrupt_snapshot:
                    raise PersistenceError(
                        f"{exc}; the node will not start without it. To start anyway, pass "
                        "--ignore-corrupt-snapshot: the parameters that pass their checksums "
                        "are kept and the log replayed over them; what only the damaged ones "
                        "held in the snapshot is lost (the file is kept aside)"
                    ) from exc
                try:
                    loaded = snapshot.load(self.path, n, table, salvage=True)
                except PersistenceError as again:
                    loaded = None
                    exc = again
                damaged.append((n, str(exc), loaded))
                if loaded is None:
                    continue  # (nothing in it could be read: an older one, or the log alone)
                found.dropped.update(loaded.dropped)
            assert loaded is not None
            found.parameters = loaded.parameters
            found.snapshot = start = n
            break
        found.records, found.torn_bytes = self._recover_log(start, table)
        if damaged:
            self._replace_damaged(damaged, table, found)
        table.mark_recovered()  # (a cluster's live copies win over these: see cluster.recovered)
        return found

    def _replace_damaged(
        self,
        damaged: list[tuple[int, str, snapshot.Loaded | None]],
        table: ParameterTable,
        found: Recovered,
    ) -> None:
        """Write a snapshot of what was recovered, then set the damaged ones aside; say so.

        In this order: until the new snapshot exists, the damaged one is where
        it was (a crash here leaves the directory as it was found); once it
        exists, the damaged files are renamed before anything older is dropped.
        """
        n = self.start_snapshot()
        entries = [e for name in table.names() if (e := table.entry(name)) is not None]
        data_path, _ = snapshot.write(self.path, n, entries, table.timestamp)
        fsync_dir(self.path)
        for number, problem, loaded in damaged:
            aside = self._set_aside(number)
            found.set_aside += aside
            where = " and ".join(str(p) for p in aside) or "nowhere (its files are gone)"
            if loaded is None:
                log.warning(
                    "%s: nothing in it can be read, so it is ignored, as asked (what only it "
                    "held is lost unless the log holds it); its files are kept as %s",
                    problem,
                    where,
                )
                continue
            dropped = "; ".join(f"{name!r} ({why})" for name, why in loaded.dropped.items())
            log.warning(
                "snapshot %s is damaged: %d parameter%s dropped, as asked: %s. The %d keys of "
                "it that pass their checks are kept and the log replayed over them (bringing "
                "back what it holds of the dropped ones). The damaged files are kept as %s",
                snapshot.paths(self.path, number)[0],
                len(loaded.dropped),
                "" if len(loaded.dropped) == 1 else "s",
                dropped,
                loaded.parameters,
                where,
            )
        self._drop_before(n)
        log.warning(
            "snapshot %s written: what the node recovered (%d keys)", data_path.name, len(entries)
        )

    def _set_aside(self, n: int) -> list[Path]:
        """Rename snapshot ``n``'s files to ``<name>.corrupt-<time>``; answer the new paths.

        (Names that recovery neither reads nor removes, nor a snapshot replaces.)
        """
        stamp = time.strftime("%Y%m%dT%H%M%S")
        moved = []
        for path in snapshot.paths(self.path, n):
            if not path.exists():
                continue
            target = path.with_name(f"{path.name}.corrupt-{stamp}")
            count = 1
            while target.exists():
                count += 1
                target = path.with_name(f"{path.name}.corrupt-{stamp}-{count}")
            os.rename(path, target)
            moved.append(target)
        fsync_dir(self.path)
        return moved

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
        data_path, nbytes = snapshot.write(self.path, n, entries, timestamp)
        fsync_dir(self.path)
        self._drop_before(n)
        log.info(
            "snapshot %s written: %d parameters, %d MiB", data_path.name, len(entries), nbytes >> 20
        )
        return data_path

    def _drop_before(self, n: int) -> None:
        for p in self.path.iterdir():
            m = SEGMENT_FILE.fullmatch(p.name) or snapshot.META_FILE.fullmatch(p.name)
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
