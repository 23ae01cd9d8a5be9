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

Salvaging (``salvage=True``, what ``--ignore-corrupt-snapshot`` asks for):
each parameter has its own crc32, so one that fails its checks is dropped
and every other one kept. A parameter stored as partitions is dropped whole
when any of its keys (a partition, its manifest) fails: half of one is no
value. Damage to what describes the file (its ``.json``, its header) leaves
nothing to salvage: that is still an error.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ParamSyncError
from ..placement import parse_key
from ..store.table import Entry, ParameterTable
from ..values.partitions import readable
from ..wire import thrift
from . import PersistenceError
from .safetensors_format import SAFETENSORS_DTYPES, Tensor, file_header

__all__ = ["DATA_FILE", "META_FILE", "TMP_FILE", "Loaded", "load", "paths", "write"]

log = logging.getLogger(__name__)

# How often loading a snapshot reports its progress (seconds).
PROGRESS_SECONDS = 2.0

# A snapshot's two files, named by its number (its .json makes it exist).
META_FILE = re.compile(r"snapshot-(\d{8})\.json")
DATA_FILE = re.compile(r"snapshot-(\d{8})\.safetensors")
# What a snapshot is written to before it is renamed into place.
TMP_FILE = re.compile(r"snapshot-\d{8}\.(?:safetensors|json)\.tmp")
_RULE_FIELDS = [field[1] for _, field in sorted(thrift.Rule.thrift_spec.items())]


def paths(directory: Path, n: int) -> tuple[Path, Path]:
    """Snapshot ``n``'s data and metadata files in ``directory``."""
    return directory / f"snapshot-{n:08d}.safetensors", directory / f"snapshot-{n:08d}.json"


def _rule(fields: Any, shown: str) -> Any:
    """The ``Rule`` a snapshot's metadata holds for a key (None if none)."""
    if fields is None:
        return None
    if not isinstance(fields, dict) or not set(fields) <= set(_RULE_FIELDS):
        raise _Damaged(f"{shown} has a malformed rule {fields!r}")
    return thrift.Rule(**fields)


# -- reading ----------------------------------------------------------------------


@dataclass
class Loaded:
    """What :func:`load` merged, and (salvaging) what it dropped.

    Attributes:
        parameters: the keys merged into the table.
        dropped: each parameter dropped (a name, for one stored as partitions
            too), with why: its damaged keys and what is wrong with each.
    """

    parameters: int = 0
    dropped: dict[str, str] = field(default_factory=dict)


def load(directory: Path, n: int, table: ParameterTable, *, salvage: bool = False) -> Loaded:
    """Merge snapshot ``n`` in ``directory`` into ``table``; answer what it merged.

    With ``salvage``, the parameters that fail their checks are dropped (see
    the module) and the others merged; else nothing is merged.

    Raises:
        PersistenceError: the snapshot cannot be read, or (not salvaging)
            fails its checks. The table is then unchanged.
    """
    data_path, meta_path = paths(directory, n)
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
        return _merge_snapshot(data_path, mapped, params, timestamp, table, salvage)
    except (KeyError, TypeError, ValueError) as exc:
        raise PersistenceError(
            f"snapshot {meta_path} does not describe {data_path}: {exc!r}"
        ) from exc


def _merge_snapshot(
    data_path: Path,
    mapped: mmap.mmap,
    params: dict[str, Any],
    timestamp: int,
    table: ParameterTable,
    salvage: bool,
) -> Loaded:
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
    damaged: dict[str, list[str]] = {}  # parameter -> what is wrong with its keys
    for name, p in params.items():
        try:
            wire.append(_checked(view, base, header, name, p))
        except _Damaged as exc:
            if not salvage:
                raise PersistenceError(f"snapshot {data_path}: {exc}") from None
            damaged.setdefault(_parameter_of(name), []).append(str(exc))
            continue
        loaded += int(p["nbytes"])
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
    if damaged:
        wire = [p for p in wire if _parameter_of(p.name) not in damaged]
    try:
        table.merge(wire, timestamp)
    except ParamSyncError as exc:
        raise PersistenceError(f"snapshot {data_path}: {exc}") from exc
    log.info("loaded %s: %d parameters, %d MiB", data_path.name, len(wire), loaded >> 20)
    return Loaded(len(wire), {name: "; ".join(why) for name, why in damaged.items()})


def _parameter_of(key: str) -> str:
    """The parameter a key belongs to: its own name, or a partition's or manifest's name."""
    parsed = parse_key(key) if "\x00" in key else None
    return key if parsed is None else parsed[0]


class _Damaged(Exception):
    """One key of a snapshot fails its checks (the message says how, its key readable)."""


def _checked(view: memoryview, base: int, header: dict[str, Any], name: str, p: Any) -> Any:
    """The ``Parameter`` of ``name`` in the snapshot, checked against its ``.json``.

    Raises:
        _Damaged: it is missing from the file, lies outside it, fails its
            checksum, or has a malformed rule.
    """
    shown = readable(repr(name))
    info = header.get(name)
    if info is None:
        raise _Damaged(f"the file lacks {shown}")
    start, end = (base + int(x) for x in info["data_offsets"])
    if not base <= start <= end <= len(view) or end - start != int(p["nbytes"]):
        raise _Damaged(f"{shown} lies outside the file")
    data = view[start:end]
    if zlib.crc32(data) != p["crc32"]:
        raise _Damaged(f"{shown} fails its checksum")
    return thrift.Parameter(
        name=name,
        data=data,
        version=p["version"],
        dtype=p["dtype"],
        shape=p["shape"],
        origin=p["origin"],
        rule=_rule(p.get("rule"), shown),
    )


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
    data_path, meta_path = paths(directory, n)
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
