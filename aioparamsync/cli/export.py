"""``aioparamsync-ctl export``: a running cluster's parameters in one safetensors file.

Theory of operation. :func:`export` asks the node for every parameter's
header (name, dtype, shape, size and version, without the data: one call,
which the node answers from every member), checks the names it was given
against them, and writes the file's header from them
(:mod:`aioparamsync.persistence.safetensors_format`: our own code, so the
export needs no package). Then it reads the parameters in the file's order
and writes their bytes as they come, through a routed client (each read goes
to the node that holds what it reads): a partitioned parameter a partition
at a time, small ones a batch of at most ``BATCH_BYTES`` at a time, a
parameter stored whole in one read (in pieces when larger than a message).
So what it holds at once is one partition, one batch or one parameter, never
the model. Once every byte is written, the header is written again, of the
same length, with the versions read in its metadata; the file, written under
a temporary name beside its own, is then renamed into place, so an export
that fails leaves no file.

Each parameter is as it was when it was read: the file is no cut across
them, and a partitioned one written to meanwhile may hold partitions of two
writes (its version is then its oldest partition's). A parameter whose
layout changed between its header and its read fails the export.

Embedding tables are not written: a table has no whole to read (its rows
exist once touched, and are read by id).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import ParamSyncError
from ..persistence.safetensors_format import Tensor, file_header, safetensors_dtype
from ..placement import is_reserved, manifest_key, parse_key, partition_key
from ..routing.partitions import manifests_of
from ..values.partitions import Layout, itemsize
from ..wire import METHODS, thrift
from .output import dtype_name, format_size, print_json

__all__ = [
    "ExportError",
    "NoSuchParameters",
    "add_parser",
    "export",
    "headers",
    "nbytes_of",
    "run_export",
]

# The most bytes of parameters stored whole read in one call (and held at once).
BATCH_BYTES = 8 * 1024 * 1024
# The most manifests asked for in one call.
PROBE_NAMES = 1000
# The file's format, in its metadata.
FORMAT = "aioparamsync export 1"
# What a version or timestamp takes at most in the header (an i64, its sign included).
_WIDEST = -(2**63)

HELP = """\
Write the parameters of the node's cluster (all of them, or the NAMEs) to FILE in
safetensors, under their names and whole (a partitioned one put together): read it
with safetensors.numpy.load_file or safetensors.torch.load_file (pip install safetensors,
or the package's [export] extra). The file's metadata holds "versions" (JSON: each
name's version, as read) and "timestamp" (the node's). A parameter of plain bytes
(sent without a dtype) is written as uint8, one-dimensional. Embedding tables are not
written: a table is read by row id (pull_rows), it has no whole. Each parameter is as
it was when read, one after another (not one cut across all of them: stop the writers
for one). The file is written under a temporary name beside FILE and renamed into place
once complete (a FILE there is replaced); an export that fails leaves nothing.
"""


class ExportError(ParamSyncError):
    """The export cannot be done (the file cannot be written, a parameter cannot be held...)."""


class NoSuchParameters(ExportError):
    """Names given that are no parameters: ``problems``, a line for each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def add_parser(command: Any) -> None:
    """The ``export`` command's arguments, on the parser ``command(name, summary)`` makes."""
    sub = command("export", "write the cluster's parameters, whole, to a safetensors file")
    sub.description = HELP
    sub.add_argument("file", type=Path, metavar="FILE", help="the safetensors file to write")
    sub.add_argument(
        "names", nargs="*", metavar="NAME", help="a parameter to write (default: every one)"
    )
    sub.set_defaults(route=True)  # (each read at the node holding it)


# -- what there is ----------------------------------------------------------------------------


async def headers(client: Any) -> list[Any]:
    """Every parameter of the cluster, as a header (no data), by name.

    (``max_inline_bytes=0``: the node answers each parameter that holds any
    bytes without them: dtype, shape, version, ``total_bytes``.)
    """
    request = thrift.ParameterRequest(param_names=[], all_names=True, max_inline_bytes=0)
    response = await client.invoke(METHODS.pull_parameters, request=request)
    return sorted(response.params, key=lambda p: p.name)


def nbytes_of(p: Any) -> int:
    """The bytes of a parameter the node answered, with or without its data."""
    return p.total_bytes if p.total_bytes is not None else memoryview(p.data).nbytes


@dataclass(frozen=True)
class Planned:
    """A parameter to write: how the file has it, and how the node does."""

    name: str
    dtype: str  # safetensors'
    shape: list[int]
    nbytes: int
    wire_dtype: str | None  # as stored (None: plain bytes)
    wire_shape: list[int] | None
    swap: np.dtype | None = None  # big-endian: read as this, written little-endian

    @property
    def tensor(self) -> Tensor:
        return self.name, self.dtype, self.shape, self.nbytes


def plan(p: Any) -> Planned:
    """How parameter ``p`` (a header) goes in the file.

    Raises:
        ExportError: its dtype is none safetensors has.
    """
    nbytes = nbytes_of(p)
    shape = None if p.shape is None else [int(d) for d in p.shape]
    if p.dtype is None:
        return Planned(p.name, "U8", [nbytes], nbytes, None, shape)
    if shape is None:
        shape = [nbytes // itemsize(p.dtype)]
    found = safetensors_dtype(p.dtype)
    if found is None:
        raise ExportError(
            f"{p.name!r} is {dtype_name(p.dtype)}, which safetensors has no dtype for: "
            "name the parameters to export without it"
        )
    st, swap = found
    return Planned(p.name, st, shape, nbytes, p.dtype, shape, swap)


def choose(found: Sequence[Any], tables: Iterable[str], names: Sequence[str]) -> list[str]:
    """What is wrong with ``names`` (those to export; none: all), one line a name."""
    have = {p.name for p in found}
    tables = set(tables)
    problems = []
    for name in dict.fromkeys(names):
        if name in have:
            continue
        if name in tables:
            problems.append(f"{name!r} is an embedding table: tables are not exported")
        elif is_reserved(name):
            what = parse_key(name)
            hint = f" (a key of {what[0]!r}: name it)" if what is not None else ""
            problems.append(f"{name!r} is no parameter's name{hint}")
        else:
            problems.append(f"no parameter {name!r}")
    return problems


# -- the file -------------------------------------------------------------------------------


def _metadata(versions: dict[str, int], timestamp: int) -> dict[str, str]:
    return {
        "format": FORMAT,
        "versions": json.dumps(versions, separators=(",", ":")),
        "timestamp": str(timestamp),
    }


class _File:
    """The file being written: under a temporary name beside its own until it is complete."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.is_dir():
            raise ExportError(f"cannot write {path}: it is a directory")
        self.tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as exc:
            raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
        self.f: BinaryIO = os.fdopen(fd, "wb")

    def write(self, data: Any) -> None:
        try:
            self.f.write(data)
        except OSError as exc:
            raise ExportError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def rewrite_header(self, head: bytes) -> None:
        self.f.seek(0)
        self.write(head)

    def finish(self) -> None:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            raise ExportError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def discard(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


# -- reading and writing ----------------------------------------------------------------------


def _changed(name: str, why: str) -> ExportError:
    return ExportError(f"{name!r} {why} during the export: run it again")


def _write_part(out: _File, planned: Planned, p: Any) -> None:
    data = p.data
    if planned.swap is not None:  # (safetensors holds little-endian values)
        swapped = np.frombuffer(data, planned.swap)
        data = swapped.astype(swapped.dtype.newbyteorder("<"))
    out.write(memoryview(data).cast("B"))


async def _layouts(client: Any, names: Sequence[str]) -> dict[str, Layout]:
    """The layouts of the partitioned ones among ``names``, from their manifests."""
    found: dict[str, Layout] = {}
    for i in range(0, len(names), PROBE_NAMES):
        keys = [manifest_key(n) for n in names[i : i + PROBE_NAMES]]
        found.update(manifests_of((await client.get_parameters(keys)).params))
    return found


async def _partitioned(
    client: Any, out: _File, planned: Planned, layout: Layout
) -> tuple[int, int]:
    """Write a partitioned parameter a partition at a time; answer its version (its
    oldest partition's) and the largest timestamp read."""
    name = planned.name
    if layout.nbytes != planned.nbytes or layout.dtype != planned.wire_dtype:
        raise _changed(name, "was replaced")
    oldest: tuple[int, str] | None = None
    stamp = 0
    for i in range(layout.count):
        response = await client.get_parameters([partition_key(name, i)])
        if not response.params:
            raise _changed(name, f"lost its partition {i}")
        stamp = max(stamp, response.timestamp or 0)
        part = response.params[0]
        del response  # (let go of it before the next read)
        lo, hi = layout.bounds(i)
        if memoryview(part.data).nbytes != (hi - lo) * itemsize(layout.dtype):
            raise _changed(name, "was replaced")
        _write_part(out, planned, part)
        if oldest is None or (part.version, part.origin or "") < oldest:
            oldest = (part.version, part.origin or "")
        del part
    return (oldest[0] if oldest is not None else 0), stamp


async def _whole(
    client: Any, out: _File, batch: Sequence[Planned], versions: dict[str, int]
) -> int:
    """Write parameters stored whole, read in one call; answer the timestamp read.

    (Its own function, so that what it read is let go before the next read.)
    """
    response = await client.get_parameters([t.name for t in batch])
    got = {p.name: p for p in response.params}
    for planned in batch:
        p = got.get(planned.name)
        if p is None:
            raise _changed(planned.name, "was deleted")
        shape = None if p.shape is None else [int(d) for d in p.shape]
        as_read = (p.dtype, shape, memoryview(p.data).nbytes)
        if as_read != (planned.wire_dtype, planned.wire_shape, planned.nbytes):
            raise _changed(planned.name, "was replaced")
        _write_part(out, planned, p)
        versions[planned.name] = p.version
    return response.timestamp or 0


def _batches(todo: Sequence[Planned], layouts: dict[str, Layout]) -> list[list[Planned]]:
    """The parameters in order, in reads: a partitioned or large one alone, small ones together."""
    out: list[list[Planned]] = []
    size = 0
    joinable = False  # (the last batch takes more)
    for planned in todo:
        if planned.name in layouts or planned.nbytes > BATCH_BYTES:
            out.append([planned])
            joinable = False
        elif joinable and size + planned.nbytes <= BATCH_BYTES:
            out[-1].append(planned)
            size += planned.nbytes
        else:
            out.append([planned])
            size, joinable = planned.nbytes, True
    return out


async def export(client: Any, path: Path, names: Sequence[str]) -> dict[str, Any]:
    """Write the parameters ``names`` (none: all) of ``client``'s cluster to ``path``.

    Answers what was written: ``parameters``, ``bytes``, the ``versions`` read,
    and ``tables`` (the names of the embedding tables, not written).

    Raises:
        NoSuchParameters: a name is no parameter (nothing is written).
        ExportError: a parameter cannot be held or changed meanwhile, the file
            cannot be written. (The file is then not there.)
        ParamSyncError: the node could not be reached, refused, failed.
    """
    found = await headers(client)
    tables = [t.name for t in await client.tables()]
    problems = choose(found, tables, names)
    if problems:
        raise NoSuchParameters(problems)
    wanted = set(names)
    todo = [plan(p) for p in found if not wanted or p.name in wanted]
    placeholder = dict.fromkeys((t.name for t in todo), _WIDEST)
    first = file_header([t.tensor for t in todo], _metadata(placeholder, _WIDEST))
    layouts = await _layouts(client, [t.name for t in todo])
    out = _File(path)
    try:
        out.write(first)
        versions: dict[str, int] = {}
        stamp = 0
        for batch in _batches(todo, layouts):
            if batch[0].name in layouts:
                name = batch[0].name
                versions[name], read_at = await _partitioned(client, out, batch[0], layouts[name])
                stamp = max(stamp, read_at)
                continue
            stamp = max(stamp, await _whole(client, out, batch, versions))
        last = file_header(
            [t.tensor for t in todo], _metadata(versions, stamp), size=len(first) - 8
        )
        out.rewrite_header(last)
        out.finish()
    except BaseException:
        out.discard()
        raise
    return {
        "parameters": len(todo),
        "bytes": sum(t.nbytes for t in todo),
        "versions": versions,
        "tables": tables,
    }


async def run_export(client: Any, args: argparse.Namespace) -> int:
    """``aioparamsync-ctl export``: answers the exit code (3: a NAME is no parameter)."""
    try:
        done = await export(client, args.file, args.names)
    except NoSuchParameters as exc:
        where = f"{client.host}:{client.port}"
        for line in exc.problems:
            print(f"aioparamsync-ctl: {line} on {where}; nothing written", file=sys.stderr)
        return 3
    if args.json:
        print_json({"file": str(args.file), **done})
        return 0
    n, tables = done["parameters"], done["tables"]
    note = f"; {len(tables)} embedding tables not written ({', '.join(tables)})" if tables else ""
    print(
        f"wrote {n} parameter{'' if n == 1 else 's'} ({format_size(done['bytes'])}) "
        f"to {args.file}{note}"
    )
    return 0
