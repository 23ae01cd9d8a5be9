"""Snapshots: the table in safetensors, with the JSON of versions and origins beside it.

Theory of operation. A snapshot (``snapshot-N.safetensors``, readable by
``safetensors.numpy.load_file``, with ``snapshot-N.json`` beside it: each
parameter's version, origin, dtype, shape and crc32) holds the state at the
moment segment N of the log began. It is written to ``.tmp`` files renamed
into place, its data first, its ``.json`` last: from then on it exists, and
without its ``.json`` a ``.safetensors`` is never read. Loading one checks
every parameter against its ``.json`` (where it lies in the file, its size,
its crc32) and merges them all into the table (last writer wins); a snapshot
that fails its checks is a :class:`~aioparamsync.persistence.PersistenceError`.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import ParamSyncError
from ..store.table import Entry, ParameterTable
from ..wire import thrift
from . import PersistenceError
from .safetensors_format import SAFETENSORS_DTYPES, Tensor, file_header

__all__ = ["DATA_FILE", "META_FILE", "TMP_FILE", "load", "write"]

log = logging.getLogger(__name__)

# How often loading a snapshot reports its progress (seconds).
PROGRESS_SECONDS = 2.0

# A snapshot's two files, named by its number (its .json makes it exist).
META_FILE = re.compile(r"snapshot-(\d{8})\.json")
DATA_FILE = re.compile(r"snapshot-(\d{8})\.safetensors")
# What a snapshot is written to before it is renamed into place.
TMP_FILE = re.compile(r"snapshot-\d{8}\.(?:safetensors|json)\.tmp")
_RULE_FIELDS = [field[1] for _, field in sorted(thrift.Rule.thrift_spec.items())]


def _paths(directory: Path, n: int) -> tuple[Path, Path]:
    """Snapshot ``n``'s data and metadata files in ``directory``."""
    return directory / f"snapshot-{n:08d}.safetensors", directory / f"snapshot-{n:08d}.json"


def _rule(fields: Any, name: str, path: Path) -> Any:
    """The ``Rule`` a snapshot's metadata holds for ``name`` (None if none)."""
    if fields is None:
        return None
    if not isinstance(fields, dict) or not set(fields) <= set(_RULE_FIELDS):
        raise PersistenceError(f"snapshot {path}: {name!r} has a malformed rule {fields!r}")
    return thrift.Rule(**fields)


# -- reading ----------------------------------------------------------------------


def load(directory: Path, n: int, table: ParameterTable) -> int:
    """Merge snapshot ``n`` in ``directory`` into ``table``; answer how many parameters it held.

    Raises:
        PersistenceError: the snapshot cannot be read, or fails its checks.
    """
    data_path, meta_path = _paths(directory, n)
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
        return _merge_snapshot(meta_path, data_path, mapped, params, timestamp, table)
    except (KeyError, TypeError, ValueError) as exc:
        raise PersistenceError(
            f"snapshot {meta_path} does not describe {data_path}: {exc!r}"
        ) from exc


def _merge_snapshot(
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


# -- writing ----------------------------------------------------------------------


def write(directory: Path, n: int, entries: Sequence[Entry], timestamp: int) -> tuple[Path, int]:
    """Write snapshot ``n`` of ``entries`` in ``directory``, each file synced.

    The directory itself is not synced: the caller does that. Answer the
    snapshot's data file and the bytes of data it holds.
    """
    tensors: list[Tensor] = []
    params: dict[str, Any] = {}
    offset = 0
    for e in entries:
        dtype = SAFETENSORS_DTYPES.get(e.dtype or "")
        shape = list(e.shape) if e.shape is not None else None
        if dtype is None or shape is None:
            tensors.append((e.name, "U8", [e.nbytes], e.nbytes))  # other layouts: their bytes
        else:
            tensors.append((e.name, dtype, shape, e.nbytes))
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
    metadata = {"format": "aioparamsync snapshot 1", "timestamp": str(timestamp)}
    data_path, meta_path = _paths(directory, n)
    tmp = data_path.with_suffix(".safetensors.tmp")
    with open(tmp, "wb") as f:
        f.write(file_header(tensors, metadata))
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
    return data_path, offset
