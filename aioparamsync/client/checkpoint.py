"""Consistent checkpoints of a whole cluster, and their restore into any cluster.

Theory of operation. :func:`checkpoint` makes one cut across every member
(the IDL's ``cut``: see :mod:`aioparamsync.server.cuts` and
:mod:`aioparamsync.store.cuts`): it has every live member *hold* the client
writes it has not applied, finds the calls cut among nodes that some member
applied a part of and another not (*torn* at the cut), has the members
*admit* those calls' parts until each is whole, then has every member *take*
what it holds (references to its immutable entries), then every member let
writes in again. Writes wait for a few round trips, not for the copy. So for every
update call (``update_arrays``, ``push_gradients``, cut among nodes by a
routed client or by a node passing parts on), the checkpoint holds all of
its parameters or none. A call whose writer died amid it cannot be made
whole: after ``admit_seconds`` the checkpoint is taken without it, and the
manifest lists it under ``"torn_calls"``.

Then it reads each key from a member holding the key's newest version in
the cut, puts partitioned parameters together, and writes:

* ``parameters-NNNNN.safetensors``: each parameter under its own name, whole,
  with its dtype and shape (at most ``FILE_BYTES`` a file; a larger
  parameter alone). Plain bytes (a founding client's, no dtype) are ``U8``.
* ``table-NNNNN.safetensors`` per embedding table: ``ids`` (int64), ``rows``
  and ``versions`` of every row the table holds. Rows are read after the
  cut, bucket by bucket: each row whole (a row's folds are atomic), not at
  one step across rows; row pushes are not held by the cut.
* ``manifest.json``: the cut's id and time, each parameter's file, version,
  dtype, shape, rule and CRC-32, each table's spec, file and row count.

All of it is written in a temporary directory beside ``directory`` and renamed
into place when complete: a checkpoint that fails leaves nothing.

:func:`restore` reads a checkpoint (checking every file against the manifest
before it writes anything) and writes it through the normal write path: the
tables created as they were, every parameter replaced by its value and rule
(in updates of at most ``RESTORE_BYTES``), and every table's rows set. It works
on a cluster of any size: placement is the target's. Versions are the target's
own (new writes); the manifest keeps the checkpoint's. Optimizer state
(Adam's moments, momentum buffers, row accumulators) starts afresh.
"""

from __future__ import annotations

import asyncio
import json
import math
import mmap
import os
import secrets
import shutil
import struct
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError, ParamSyncError
from ..persistence.safetensors_format import file_header, safetensors_dtype
from ..placement import LIVE, bucket_key, is_reserved, parse_key
from ..store.cuts import MAX_HOLD_MS, call_keys
from ..store.table import lww_key
from ..values.arrays import parse_dtype, wire_dtype
from ..values.partitions import Layout, assemble, itemsize
from ..values.rowwire import decode_ids
from ..wire import METHODS, thrift
from .pool import ConnectionPool

if TYPE_CHECKING:
    from .api import ParameterClient

__all__ = [
    "FORMAT",
    "MAX_HOLD_MS",
    "MANIFEST",
    "CheckpointError",
    "checkpoint",
    "read_manifest",
    "restore",
]

FORMAT = "aioparamsync-checkpoint/1"
MANIFEST = "manifest.json"
# The most bytes of parameters in one file (a larger parameter has one of its own).
FILE_BYTES = 1 << 30
# The most bytes asked of a member in one read of the cut, and sent in one update
# by a restore.
READ_BYTES = 256 << 20
RESTORE_BYTES = 64 << 20
ROWS_PAGE = 65_536
# Cuts tried while the members keep changing.
CUT_ATTEMPTS = 3


# -- taking one --------------------------------------------------------------------------


async def checkpoint(
    client: ParameterClient,
    directory: str | os.PathLike[str],
    *,
    hold_ms: int = 10_000,
    admit_seconds: float = 5.0,
) -> dict[str, Any]:
    """Write the cluster ``client`` talks to into ``directory`` at one cut; answer the
    manifest written (see the module).

    Args:
        directory: a new directory (or an empty one) to write the checkpoint in.
        hold_ms: how long each member may hold writes at most (it ends the hold
            by itself then, and the checkpoint fails).
        admit_seconds: how long to wait for the parts of calls torn at the cut.

    Raises:
        CheckpointError: ``directory`` is not new or empty, a member could not
            take part, or the files could not be written. Nothing is left.
    """
    target = Path(directory)
    tmp = await asyncio.to_thread(_new_directory, target, secrets.token_hex(8))
    try:
        for attempt in range(CUT_ATTEMPTS):
            cut_id = secrets.token_hex(8)
            members = await _members(client)
            try:
                before = await _epochs(members)
                started = time.time()
                held, torn = await _cut(members, cut_id, hold_ms, admit_seconds)
                # (a member that joined meanwhile held nothing, and may have sent writes
                # made after the cut to the others as replication: made again)
                if await _epochs(members) != before:
                    if attempt + 1 < CUT_ATTEMPTS:
                        continue
                    raise CheckpointError(
                        f"the cluster's members changed during each of {CUT_ATTEMPTS} cuts; "
                        "try again once they settle"
                    )
                manifest = await _write(client, members, cut_id, held, tmp)
                break
            finally:
                await asyncio.gather(
                    *(_step(m, cut_id, "end") for m in members.values()), return_exceptions=True
                )
                await asyncio.gather(*(m.close() for m in members.values()), return_exceptions=True)
        manifest.update(cut=cut_id, taken=started, torn_calls=sorted(torn))
        await asyncio.to_thread(_finish, tmp, target, manifest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _new_directory(target: Path, cut_id: str) -> Path:
    """The directory to write a checkpoint in, beside ``target`` (which must be new or
    empty), until it is complete."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(f"{target} exists and is not an empty directory")
    tmp = target.with_name(f".{target.name}.{cut_id}.tmp")
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise CheckpointError(f"cannot write {target}: {exc.strerror or exc}") from None
    return tmp


def _finish(tmp: Path, target: Path, manifest: dict[str, Any]) -> None:
    try:
        _write_json(tmp / MANIFEST, manifest)
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except OSError as exc:
        raise CheckpointError(f"cannot write {target}: {exc.strerror or exc}") from None


async def _epochs(members: dict[str, Any]) -> list[int]:
    """Each member's epoch, as it sees its cluster."""
    try:
        return [t.epoch for t in await asyncio.gather(*(m.topology() for m in members.values()))]
    except ParamSyncError as exc:
        raise CheckpointError(f"a member could not be asked for its topology: {exc}") from exc


async def _members(client: ParameterClient) -> dict[str, Any]:
    """A client of each live member (routing off), by node id."""
    from .api import ParameterClient

    topology = await client.topology()
    live = [m for m in topology.members or () if m.state in LIVE and m.port]
    if not live:  # (a node alone, in no cluster)
        address = client.addresses[client._current]
        return {"": ParameterClient(address, route=False, ssl=client.ssl, timeout=client.timeout)}
    return {
        m.node_id: ParameterClient(
            (m.host, m.port), route=False, ssl=client.ssl, timeout=client.timeout
        )
        for m in live
    }


async def _step(member: Any, cut_id: str, phase: str, **fields: Any) -> Any:
    request = thrift.CutRequest(id=cut_id, phase=phase, **fields)
    return await member.invoke(METHODS.cut, request=request)


async def _at_all(members: dict[str, Any], cut_id: str, phase: str, **fields: Any) -> list[Any]:
    try:
        return list(
            await asyncio.gather(*(_step(m, cut_id, phase, **fields) for m in members.values()))
        )
    except ParamSyncError as exc:
        raise CheckpointError(f"the cut failed at its {phase!r} step: {exc}") from exc


async def _cut(
    members: dict[str, Any], cut_id: str, hold_ms: int, admit_seconds: float
) -> tuple[dict[str, list[Any]], set[str]]:
    """Make the cut (see the module); answer each member's keys in it, and the calls
    left torn."""
    calls: dict[str, set[str]] = {}

    def heard(answers: Sequence[Any]) -> set[str]:
        for answer in answers:
            for call, keys in (answer.calls or {}).items():
                calls.setdefault(call, set()).update(keys)
        return {c for c, keys in calls.items() if len(keys) < call_keys(c)}

    torn = heard(await _at_all(members, cut_id, "hold", hold_ms=hold_ms))
    deadline = time.monotonic() + admit_seconds
    while torn and time.monotonic() < deadline:
        torn = heard(await _at_all(members, cut_id, "admit", calls=sorted(torn)))
        if torn:
            await asyncio.sleep(0.005)
    taken = await _at_all(members, cut_id, "take")
    # (released once every member took its part: else one releasing early would
    # replicate writes made after the cut to one still taking its part)
    await _at_all(members, cut_id, "release")
    return {node: answer.keys or [] for node, answer in zip(members, taken, strict=True)}, torn


# -- writing it ------------------------------------------------------------------------


def _write_json(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")


def _plan(held: dict[str, list[Any]]) -> tuple[dict[str, tuple[str, Any]], dict[str, list[str]]]:
    """Where to read each key (the member with its newest version), and each parameter's
    keys: its own, or its manifest's then its partitions' (in order)."""
    newest: dict[str, tuple[str, Any]] = {}
    for node, keys in held.items():
        for e in keys:
            have = newest.get(e.name)
            if have is None or lww_key(have[1]) < lww_key(e):
                newest[e.name] = (node, e)
    whole: dict[str, Any] = {}
    manifests: dict[str, Any] = {}
    for key, (_, e) in newest.items():
        if not is_reserved(key):
            whole[key] = e
        elif (parsed := parse_key(key)) is not None and parsed[1] is None:
            manifests[parsed[0]] = e
    params: dict[str, list[str]] = {}
    for name in sorted({*whole, *manifests}):
        m, w = manifests.get(name), whole.get(name)
        if m is not None and (w is None or lww_key(w) < lww_key(m)):
            params[name] = [m.name]  # (its partitions: once its manifest is read)
        else:
            params[name] = [name]
    return newest, params


async def _read(
    members: dict[str, Any], cut_id: str, newest: dict[str, tuple[str, Any]], keys: list[str]
) -> dict[str, Any]:
    """The cut's value of each of ``keys``, each read from its member."""
    by_node: dict[str, list[list[str]]] = {}
    for key in keys:
        node, e = newest[key]
        batches = by_node.setdefault(node, [[]])
        if batches[-1] and sum(newest[k][1].nbytes for k in batches[-1]) + e.nbytes > READ_BYTES:
            batches.append([])
        batches[-1].append(key)

    async def read(node: str, names: list[str]) -> list[Any]:
        try:
            answer = await _step(members[node], cut_id, "read", names=names)
        except ParamSyncError as exc:
            raise CheckpointError(f"reading the cut at {node}: {exc}") from exc
        return list(answer.params or [])

    found = await asyncio.gather(*(read(n, b) for n, bs in by_node.items() for b in bs))
    return {p.name: p for ps in found for p in ps}


async def _whole(
    members: dict[str, Any], cut_id: str, newest: dict[str, tuple[str, Any]], name: str, key: str
) -> Any:
    """Parameter ``name`` whole, as the cut holds it (``key``: its own or its manifest's)."""
    (p,) = (await _read(members, cut_id, newest, [key])).values()
    if key == name:
        return p
    layout = Layout.from_bytes(p.data)
    keys = layout.keys(name)
    missing = [k for k in keys if k not in newest]
    if missing:
        raise CheckpointError(f"{name!r}: the cut holds no partition {missing[0]!r}")
    parts = await _read(members, cut_id, newest, keys)
    try:
        whole = assemble(name, layout, [parts[k] for k in keys])
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    whole.rule = next((parts[k].rule for k in keys if parts[k].rule is not None), p.rule)
    return whole


def _rule(rule: Any) -> dict[str, Any] | None:
    if rule is None:
        return None
    return {k: v for k, v in vars(rule).items() if v is not None}


class _Files:
    """Parameters written into files of at most FILE_BYTES each."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.pending: list[tuple[Any, str, list[int], np.ndarray]] = []
        self.pending_bytes = 0
        self.count = 0
        self.entries: dict[str, dict[str, Any]] = {}

    def add(self, p: Any) -> bool:
        """Add ``p`` to the next file; answer whether that is full (to :meth:`flush`)."""
        data = np.frombuffer(memoryview(p.data).cast("B"), np.uint8)
        if p.dtype is None:
            st, shape = "U8", [len(data)]
        else:
            found = safetensors_dtype(p.dtype)
            if found is None:
                raise CheckpointError(f"{p.name!r} is {p.dtype}, which safetensors has no name for")
            st, swap = found
            if swap is not None:  # (big-endian: written little-endian)
                data = np.frombuffer(data, swap).astype(swap.newbyteorder("<")).view(np.uint8)
            if p.shape is not None:
                shape = [int(d) for d in p.shape]
            else:
                shape = [len(data) // itemsize(p.dtype)]
        self.pending.append((p, st, shape, data))
        self.pending_bytes += len(data)
        return self.pending_bytes >= FILE_BYTES

    def flush(self) -> None:
        if not self.pending:
            return
        self.count += 1
        name = f"parameters-{self.count:05d}.safetensors"
        tensors = [(p.name, st, shape, len(data)) for p, st, shape, data in self.pending]
        with open(self.directory / name, "wb") as f:
            f.write(file_header(tensors, {"format": FORMAT}))
            for p, _, _, data in self.pending:
                f.write(data.data)
                self.entries[p.name] = {
                    "file": name,
                    "dtype": p.dtype,
                    "shape": None if p.shape is None else [int(d) for d in p.shape],
                    "version": p.version,
                    "origin": p.origin,
                    "rule": _rule(p.rule),
                    "crc32": zlib.crc32(data.data),
                    "nbytes": len(data),
                }
            f.flush()
            os.fsync(f.fileno())
        self.pending, self.pending_bytes = [], 0


async def _write(
    client: ParameterClient,
    members: dict[str, Any],
    cut_id: str,
    held: dict[str, list[Any]],
    directory: Path,
) -> dict[str, Any]:
    newest, params = _plan(held)
    files = _Files(directory)
    small = [name for name, (key,) in params.items() if key == name]
    batch: list[str] = []
    for name in [*small, None]:
        if name is not None and (not batch or sum(newest[k][1].nbytes for k in batch) < READ_BYTES):
            batch.append(name)
            continue
        for p in (await _read(members, cut_id, newest, batch)).values():
            if files.add(p):
                await asyncio.to_thread(files.flush)
        batch = [] if name is None else [name]
    for name, (key,) in params.items():
        if key != name and files.add(await _whole(members, cut_id, newest, name, key)):
            await asyncio.to_thread(files.flush)
    await asyncio.to_thread(files.flush)
    return {
        "format": FORMAT,
        "parameters": files.entries,
        "tables": await _write_tables(client, directory),
    }


async def _table_rows(client: ParameterClient, spec: Any) -> dict[str, np.ndarray]:
    """Every row of table ``spec``: ids, rows and versions, bucket by bucket from each
    bucket's primary, a page at a time."""
    dtype = parse_dtype(spec.dtype or "<f4")
    ids, rows, versions = [], [], []
    for bucket in range(spec.buckets):
        pool = client.routes.pool_of(bucket_key(spec.name, bucket)) if client.routes else None
        offset = 0
        while True:
            request = thrift.BucketRequest(
                table=spec.name, bucket=bucket, offset=offset, limit=ROWS_PAGE
            )
            if pool is None:
                delta = await client.invoke(METHODS.bucket_rows, request=request)
            else:
                delta = await ConnectionPool.invoke(pool, METHODS.bucket_rows, request=request)
            got = decode_ids(delta.ids)
            ids.append(got)
            versions.append(decode_ids(delta.versions, "versions"))
            rows.append(np.frombuffer(delta.rows, dtype).reshape(-1, spec.dim))
            if len(got) < ROWS_PAGE:
                break
            offset += len(got)
    return {
        "ids": np.concatenate(ids) if ids else np.empty(0, np.int64),
        "rows": np.concatenate(rows) if rows else np.empty((0, spec.dim), dtype),
        "versions": np.concatenate(versions) if versions else np.empty(0, np.int64),
    }


async def _write_tables(client: ParameterClient, directory: Path) -> dict[str, Any]:
    tables: dict[str, Any] = {}
    for n, spec in enumerate(await client.invoke(METHODS.tables), 1):
        arrays = await _table_rows(client, spec)
        name = f"table-{n:05d}.safetensors"
        crc = await asyncio.to_thread(_write_arrays, directory / name, arrays)
        tables[spec.name] = {
            "file": name,
            "spec": _table_dict(spec),
            "rows": len(arrays["ids"]),
            "crc32": crc,
        }
    return tables


def _write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Write ``arrays`` as a safetensors file; answer the CRC-32 of each one's bytes."""
    tensors = []
    for key, a in arrays.items():
        found = safetensors_dtype(wire_dtype(a.dtype))
        assert found is not None  # (a table's dtypes, ids and versions: all have a name)
        tensors.append((key, found[0], list(a.shape), a.nbytes))
    crc = {}
    with open(path, "wb") as f:
        f.write(file_header(tensors, {"format": FORMAT}))
        for key, a in arrays.items():
            data = np.ascontiguousarray(a).view(np.uint8).reshape(-1).data
            f.write(data)
            crc[key] = zlib.crc32(data)
        f.flush()
        os.fsync(f.fileno())
    return crc


def _table_dict(spec: Any) -> dict[str, Any]:
    out = {k: v for k, v in vars(spec).items() if v is not None and k != "forwarded"}
    if spec.rule is not None:
        out["rule"] = _rule(spec.rule)
    return out


# -- restoring one -------------------------------------------------------------------------


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint in ``directory``, checked for its shape.

    Raises:
        CheckpointError: no checkpoint there, or a manifest that is not one.
    """
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory} holds no checkpoint (no {MANIFEST})") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is no {FORMAT} manifest")
    if not isinstance(manifest.get("parameters"), dict) or not isinstance(
        manifest.get("tables"), dict
    ):
        raise CheckpointError(f"{path} lacks its parameters or tables")
    return manifest


class _Tensors:
    """The tensors of one safetensors file of a checkpoint, mapped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            (length,) = struct.unpack_from("<Q", self.map, 0)
            self.header = json.loads(bytes(self.map[8 : 8 + length]))
        except (OSError, ValueError, struct.error) as exc:
            raise CheckpointError(f"{path} cannot be read: {exc}") from None
        self.base = 8 + length

    def data(self, name: str, crc32: int | None) -> memoryview:
        info = self.header.get(name)
        if not isinstance(info, dict):
            raise CheckpointError(f"{self.path} lacks {name!r}")
        start, end = (self.base + int(x) for x in info["data_offsets"])
        if not self.base <= start <= end <= len(self.map):
            raise CheckpointError(f"{name!r} lies outside {self.path}")
        data = memoryview(self.map)[start:end]
        if crc32 is not None and zlib.crc32(data) != crc32:
            raise CheckpointError(f"{name!r} in {self.path} fails its checksum")
        return data


async def restore(client: ParameterClient, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the checkpoint in ``directory`` into the cluster ``client`` talks to; answer
    its manifest (see the module).

    Raises:
        CheckpointError: no checkpoint there, or a file of it is damaged
            (found before anything is written).
        RequestError: the cluster refused a write (say, a table of the same
            name with another spec).
    """
    manifest, params, tables = await asyncio.to_thread(_load, Path(directory))
    for spec, _ in tables:
        await client.invoke(METHODS.create_table, table=spec)
    batch: list[Any] = []
    size = 0
    for p in [*params, None]:
        if p is not None and (not batch or size + memoryview(p.data).nbytes <= RESTORE_BYTES):
            batch.append(p)
            size += memoryview(p.data).nbytes
            continue
        if batch:
            await client.update_parameters(batch, replace=True, acks="all")
        batch, size = ([p], memoryview(p.data).nbytes) if p is not None else ([], 0)
    for spec, arrays in tables:
        ids = np.frombuffer(arrays["ids"], "<i8")
        rows = np.frombuffer(arrays["rows"], parse_dtype(spec.dtype or "<f4"))
        rows = rows.reshape(len(ids), spec.dim)
        for start in range(0, len(ids), ROWS_PAGE):
            end = start + ROWS_PAGE
            await client.assign_rows(spec.name, ids[start:end], rows[start:end], acks="all")
    return manifest


def _load(base: Path) -> tuple[dict[str, Any], list[Any], list[tuple[Any, dict[str, Any]]]]:
    """The checkpoint in ``base``: its manifest, parameters and tables, every byte checked."""
    manifest = read_manifest(base)
    files: dict[str, _Tensors] = {}

    def tensors(name: Any) -> _Tensors:
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise CheckpointError(f"the manifest names no file of the checkpoint: {name!r}")
        if name not in files:
            files[name] = _Tensors(base / name)
        return files[name]

    params = []
    try:
        for name, info in manifest["parameters"].items():
            data = tensors(info["file"]).data(name, info["crc32"])
            rule = None if info.get("rule") is None else thrift.Rule(**info["rule"])
            shape = info.get("shape")
            if info.get("dtype") is not None and shape is not None:
                want = math.prod(shape) * itemsize(info["dtype"])
                if want != data.nbytes:
                    raise CheckpointError(
                        f"{name!r} in {info['file']} has {data.nbytes} bytes, not the "
                        f"{want} of {info['dtype']} {shape}"
                    )
            params.append(
                thrift.Parameter(
                    name=name,
                    data=data,
                    dtype=info.get("dtype"),
                    shape=None if shape is None else [int(d) for d in shape],
                    rule=rule,
                    replace=True,
                )
            )
        tables = []
        for info in manifest["tables"].values():
            spec = dict(info["spec"])
            if spec.get("rule") is not None:
                spec["rule"] = thrift.Rule(**spec["rule"])
            file = tensors(info["file"])
            crc = info.get("crc32", {})
            arrays = {k: file.data(k, crc.get(k)) for k in ("ids", "rows")}
            tables.append((thrift.Table(**spec), arrays))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{base / MANIFEST} does not describe the checkpoint: {exc!r}"
        ) from None
    return manifest, params, tables
