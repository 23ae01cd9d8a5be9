"""Restoring a checkpoint (see :mod:`.checkpoint`) into a running cluster of any size.

:func:`restore` reads the checkpoint's manifest and files, checking every
tensor against the manifest (sizes, CRC-32) before it writes anything, then
writes through the normal write path: the tables made as they were, every
parameter replaced by its value and rule (in updates of at most
``RESTORE_BYTES``), every table's rows set (``assign_rows``). Placement is the
target's; versions are its own (new writes); optimizer state starts afresh.
"""

from __future__ import annotations

import asyncio
import json
import math
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointError
from ..values.arrays import parse_dtype
from ..values.partitions import itemsize
from ..wire import METHODS, thrift
from .checkpoint import FORMAT, MANIFEST, RESTORE_BYTES, ROWS_PAGE

if TYPE_CHECKING:
    from .api import ParameterClient

__all__ = ["read_manifest", "restore"]


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
