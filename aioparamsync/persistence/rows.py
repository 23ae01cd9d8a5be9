"""Durable embedding tables: a log of the rows each fold changed, and snapshots of every row.

Theory of operation. The tables live in ``<data-dir>/rows/``:

- ``rows-N.log``: records ``[u32 length][u32 crc32][payload]``, each payload a
  ``RowDelta`` in Thrift's binary protocol: the rows (values, state and
  version) a fold made or a merge kept, written before the push or the
  replication message is answered, and synced as ``--fsync`` says. Only the
  rows a push changed are written, never a whole table. Replaying a record is
  a merge by row version (a row is replaced only by a newer one), so replay
  is idempotent and a record written twice changes nothing.
- ``rows-N.safetensors``: every row of every table at the moment log N began,
  as tensors ``<table>/<bucket>/ids``, ``.../versions``, ``.../rows`` (``(count,
  dim)`` in the table's dtype) and ``.../state<i>`` (the rule's state), with the
  tables themselves (JSON) in its metadata: ``safetensors.numpy.load_file``
  reads it. It is written to a ``.tmp`` file, synced, then renamed.

When the logs since the last snapshot pass ``snapshot_bytes``, a new log is
begun and a snapshot of that moment written; then the older files go.
Recovery loads the newest snapshot and replays every log from its number on;
a record cut short or failing its checksum at the very end of the last log is
a torn write (the push it held was not answered) and is cut off with a
warning; damage anywhere else refuses the start (nothing is lost silently).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import struct
import time
import zlib
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..store.rows import RowTables, table_spec
from ..wire import thrift
from ..wire.binary import BinaryReader
from . import PersistenceError
from .safetensors_format import SAFETENSORS_DTYPES, Tensor, file_header
from .wal import fsync_dir, write_record

__all__ = ["ROWS_DIR", "RowStore"]

log = logging.getLogger(__name__)

#: the directory of the tables in a data directory
ROWS_DIR = "rows"
_RECORD = struct.Struct("!II")  # length, crc32
LOG_FILE = re.compile(r"rows-(\d{8})\.log")
SNAPSHOT_FILE = re.compile(r"rows-(\d{8})\.safetensors")
# Logged bytes since the last snapshot that make the next one due.
SNAPSHOT_BYTES = 256 * 1024 * 1024
# Records larger than this are written from a worker thread.
INLINE_BYTES = 1024 * 1024
_FORMAT = "aioparamsync rows 1"


def _name(n: int, suffix: str) -> str:
    return f"rows-{n:08d}.{suffix}"


class RowStore:
    """The files of a node's tables (see the module).

    Args:
        data_dir: the node's data directory (its ``rows/`` holds the tables).
        fsync: ``"always"`` (each record synced before it is answered),
            ``"batch"`` (at most every ``sync_interval`` seconds) or ``"never"``.
        snapshot_bytes: logged bytes that make a snapshot due.
    """

    def __init__(
        self,
        data_dir: Path,
        fsync: str = "batch",
        sync_interval: float = 0.1,
        snapshot_bytes: int = SNAPSHOT_BYTES,
    ) -> None:
        self.path = Path(data_dir) / ROWS_DIR
        self.fsync = fsync
        self.sync_interval = sync_interval
        self.snapshot_bytes = snapshot_bytes
        self.segment = 0
        self.logged_bytes = 0  # since the last snapshot
        self.records = 0
        self._fd: int | None = None
        self._last_sync = time.monotonic()
        self._lock = asyncio.Lock()
        self._tables: RowTables | None = None
        self._me = ""

    # -- recovery -------------------------------------------------------------------

    def recover(self, tables: RowTables, me: str = "") -> dict[str, int]:
        """Load the newest snapshot and replay the logs into ``tables``. (The directory,
        and a new log in it, are made when the first rows are written.)

        Raises:
            PersistenceError: a damaged file (see the module).
        """
        self._tables, self._me = tables, me
        if not self.path.exists():
            self.segment = 1
            return {"snapshot_rows": 0, "records": 0, "torn_bytes": 0}
        try:
            for p in self.path.iterdir():
                if p.name.endswith(".tmp"):
                    p.unlink()
            snapshots = sorted(
                (int(m[1]) for p in self.path.iterdir() if (m := SNAPSHOT_FILE.fullmatch(p.name))),
                reverse=True,
            )
            logs = sorted(
                int(m[1]) for p in self.path.iterdir() if (m := LOG_FILE.fullmatch(p.name))
            )
        except OSError as exc:
            raise PersistenceError(f"cannot read the tables in {self.path}: {exc}") from exc
        start = snapshots[0] if snapshots else 0
        rows = self._load_snapshot(start, tables) if snapshots else 0
        replayed = torn = 0
        later = [n for n in logs if n >= start]
        for i, n in enumerate(later):
            r, t = self._replay(n, tables, last=i == len(later) - 1)
            replayed, torn = replayed + r, torn + t
        self.segment = max([start, *later]) + 1
        if replayed or rows:
            log.info(
                "tables recovered: %d tables, %d rows from snapshot %d, %d log records",
                len(tables), rows, start, replayed,
            )  # fmt: skip
        return {"snapshot_rows": rows, "records": replayed, "torn_bytes": torn}

    def _load_snapshot(self, n: int, tables: RowTables) -> int:
        path = self.path / _name(n, "safetensors")
        try:
            raw = path.read_bytes()
            (head_len,) = struct.unpack_from("<Q", raw)
            header = json.loads(raw[8 : 8 + head_len])
            meta = header.pop("__metadata__")
            if meta.get("format") != _FORMAT:
                raise ValueError(f"format {meta.get('format')!r}")
            specs = json.loads(meta["tables"])
        except (OSError, ValueError, KeyError, struct.error) as exc:
            raise PersistenceError(f"snapshot {path} cannot be read: {exc}") from exc
        body = memoryview(raw)[8 + head_len :]

        def tensor(key: str) -> memoryview:
            entry = header[key]
            start, end = entry["data_offsets"]
            return body[start:end]

        rows = 0
        try:
            for spec in specs:
                fields = {k: v for k, v in spec.items() if k not in ("rule", "_buckets")}
                wire = thrift.Table(**fields, rule=thrift.Rule(**spec["rule"]))
                table = tables.create(table_spec(wire))[0]
                for bucket in spec["_buckets"]:
                    prefix = f"{spec['name']}/{bucket}/"
                    states = sorted(k for k in header if k.startswith(prefix + "state"))
                    delta = thrift.RowDelta(
                        table=table.spec.wire,
                        bucket=bucket,
                        ids=tensor(prefix + "ids"),
                        versions=tensor(prefix + "versions"),
                        rows=tensor(prefix + "rows"),
                        state=[tensor(k) for k in states],
                        from_peer=self._me,
                    )
                    rows += table.merge(delta, time.time())
        except Exception as exc:
            raise PersistenceError(f"snapshot {path} is damaged: {exc}") from exc
        return rows

    def _replay(self, n: int, tables: RowTables, last: bool) -> tuple[int, int]:
        path = self.path / _name(n, "log")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PersistenceError(f"cannot read {path}: {exc}") from exc
        offset = records = 0
        while offset < len(data):
            head = data[offset : offset + _RECORD.size]
            ok = len(head) == _RECORD.size
            if ok:
                size, crc = _RECORD.unpack(head)
                payload = data[offset + _RECORD.size : offset + _RECORD.size + size]
                ok = len(payload) == size and zlib.crc32(payload) == crc
            if not ok:
                torn = len(data) - offset
                if not last:
                    raise PersistenceError(f"{path} is damaged at byte {offset}")
                log.warning("%s: a torn record of %d bytes at its end, cut off", path, torn)
                with open(path, "r+b") as f:
                    f.truncate(offset)
                    os.fsync(f.fileno())
                return records, torn
            try:
                delta = BinaryReader(payload).read_struct(thrift.RowDelta)
                table = tables.create(table_spec(delta.table))[0]
                table.merge(delta, time.time())
            except Exception as exc:
                raise PersistenceError(f"{path}: record at byte {offset}: {exc}") from exc
            records += 1
            offset += _RECORD.size + size
        return records, 0

    # -- writing --------------------------------------------------------------------

    def _open(self, n: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self.path.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(
            self.path / _name(n, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        fsync_dir(self.path)

    def _write(self, deltas: list[Any]) -> int:
        if self._fd is None:
            self._open(self.segment)
        assert self._fd is not None
        total = sum(write_record(self._fd, delta) for delta in deltas)
        if self.fsync == "always" or (
            self.fsync == "batch" and time.monotonic() - self._last_sync >= self.sync_interval
        ):
            os.fsync(self._fd)
            self._last_sync = time.monotonic()
        return total

    async def log(self, deltas: list[Any]) -> None:
        """Write ``deltas`` to the log (synced as ``fsync`` says); a snapshot when due."""
        async with self._lock:
            size = sum(len(d.rows) for d in deltas)
            if size > INLINE_BYTES or self.fsync == "always":
                written = await asyncio.to_thread(self._write, deltas)
            else:
                written = self._write(deltas)
            self.logged_bytes += written
            self.records += len(deltas)
            if self.logged_bytes >= self.snapshot_bytes:
                await self._snapshot_now()

    async def _snapshot_now(self) -> None:
        assert self._tables is not None
        n = self.segment + 1
        self._open(n)  # what is logged from here on is after the snapshot
        self.segment = n
        self.logged_bytes = 0
        tensors = self._export(self._tables)
        await asyncio.to_thread(self._write_snapshot, n, *tensors)

    def snapshot(self) -> None:
        """Write a snapshot of the tables now (the node is stopping), and begin a new log."""
        if self._tables is None:
            return
        n = self.segment + 1
        self._open(n)
        self.segment = n
        self.logged_bytes = 0
        self._write_snapshot(n, *self._export(self._tables))

    def _export(self, tables: RowTables) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
        specs, arrays = [], {}
        for table in tables.tables.values():
            w = table.spec.wire
            spec = {k: getattr(w, k) for k in ("name", "dim", "dtype", "init", "scale", "seed",
                                               "buckets", "row_ttl_seconds")}  # fmt: skip
            spec["rule"] = {k: v for k, v in w.rule.__dict__.items() if v is not None}
            buckets = []
            for bucket in sorted(table.blocks):
                got = table.blocks[bucket].rows_of(None)
                prefix = f"{w.name}/{bucket}/"
                arrays[prefix + "ids"] = np.ascontiguousarray(got.ids, "<i8")
                arrays[prefix + "versions"] = np.ascontiguousarray(got.versions, "<i8")
                arrays[prefix + "rows"] = np.ascontiguousarray(got.rows)
                for i, state in enumerate(table.spec.rows.rule.state_names):
                    arrays[f"{prefix}state{i}"] = np.ascontiguousarray(got.state[state])
                buckets.append(bucket)
            spec["_buckets"] = buckets
            specs.append(spec)
        return specs, arrays

    def _write_snapshot(
        self, n: int, specs: list[dict[str, Any]], arrays: dict[str, np.ndarray]
    ) -> None:
        tensors: list[Tensor] = []
        for key, arr in arrays.items():
            dtype = SAFETENSORS_DTYPES.get(
                "bfloat16" if arr.dtype.name == "bfloat16" else arr.dtype.str
            )
            if dtype is None:
                raise PersistenceError(f"{key}: dtype {arr.dtype} has no safetensors name")
            tensors.append((key, dtype, arr.shape, arr.nbytes))
        metadata = {"format": _FORMAT, "tables": json.dumps(specs)}
        path = self.path / _name(n, "safetensors")
        tmp = path.with_suffix(".safetensors.tmp")
        with open(tmp, "wb") as f:
            f.write(file_header(tensors, metadata))
            for arr in arrays.values():
                f.write(memoryview(cast(Any, arr.reshape(-1).view(np.uint8))))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.path)
        for p in self.path.iterdir():  # what the snapshot holds, older files held
            m = LOG_FILE.fullmatch(p.name) or SNAPSHOT_FILE.fullmatch(p.name)
            if m and int(m[1]) < n:
                p.unlink()

    def sync(self) -> None:
        if self._fd is not None and self.fsync != "never":
            os.fsync(self._fd)
            self._last_sync = time.monotonic()

    def close(self) -> None:
        """Write the last snapshot and close the log."""
        if self._fd is None:
            return
        try:
            if self.records or self.logged_bytes:
                self.snapshot()
            else:
                self.sync()
        finally:
            os.close(self._fd)
            self._fd = None
