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

:mod:`.restore` writes a checkpoint back into a running cluster of any size,
through the normal write path, every file checked first.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
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
    filled: dict[str, int] = {}  # (bytes in each member's last batch)
    for key in keys:
        node, e = newest[key]
        batches = by_node.setdefault(node, [[]])
        if batches[-1] and filled.get(node, 0) + e.nbytes > READ_BYTES:
            batches.append([])
            filled[node] = 0
        batches[-1].append(key)
        filled[node] = filled.get(node, 0) + e.nbytes

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

    async def write_batch(names: list[str]) -> None:
        for p in (await _read(members, cut_id, newest, names)).values():
            if files.add(p):
                await asyncio.to_thread(files.flush)

    # (the parameters stored whole, about READ_BYTES at a time)
    batch: list[str] = []
    size = 0
    for name, (key,) in params.items():
        if key != name:
            continue
        nbytes = newest[name][1].nbytes
        if batch and size + nbytes > READ_BYTES:
            await write_batch(batch)
            batch, size = [], 0
        batch.append(name)
        size += nbytes
    if batch:
        await write_batch(batch)
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
