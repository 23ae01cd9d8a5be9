"""Bytes in shared memory between a node and the workers on its host (the IDL's
``SharedRegion``).

A client connected to a node's Unix socket makes a *segment*: an anonymous file
(``memfd_create``) whose pages it reserves when it makes it (so memory running
out is an error then, never a ``SIGBUS`` later), mapped in both processes. It
names it ``FD:NAME``: its descriptor and the name it gave the file. The node
opens it as ``/proc/PID/fd/FD``, where PID is the socket's peer as the kernel
tells it (``SO_PEERCRED``: a client cannot name another process's files), checks
that it is that memfd, maps it once for the connection and drops it when the
connection closes. No file is left behind: the memory is freed when the last of
the two processes lets go of it, however the client ends.

A read that names a region (``ParameterRequest.shared``) is answered with the
raw parameters' bytes written there, in blocks (``Packed.shared``); the
client's arrays are views of them, and the region is not used again until
they are gone. A push's gradients are written by the client into a region and
read from there by the node; the client uses the region again only once the
push is answered. Over a socket whose peer is not of the node's user, or over
TCP, a region named is not used (a read) or refused (a push).

This module holds what both sides share: the names, :class:`SharedView` (a
region and its bytes), and :func:`pack_into` (blocks written into a region).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..wire import thrift
from ..wire.writer import ZERO_COPY_MIN_BYTES, Chunks

__all__ = [
    "ALIGN",
    "SEGMENT_NAME",
    "SHARED_MIN_BYTES",
    "SharedView",
    "aligned",
    "nbytes_of",
    "pack_into",
    "parse_segment",
    "segment_of",
]

# The least bytes of an array that goes through shared memory: the size under which
# the encoder copies a value into the message anyway (a smaller one goes there, in a
# block of its dtype's: see .packing), where its place in a region would cost more.
SHARED_MIN_BYTES = ZERO_COPY_MIN_BYTES
# A segment's file name (memfd_create's name): the prefix and 16 hex digits.
SEGMENT_NAME = re.compile(r"aioparamsync-[0-9a-f]{16}\Z")
# Each block's bytes begin at a multiple of this many bytes of its segment (a
# cache line: every dtype's arrays are aligned).
ALIGN = 64
# The most a descriptor's number may be in a segment's name.
_MAX_FD = 2**31 - 1


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return -(-n // ALIGN) * ALIGN


def segment_of(fd: int, name: str) -> str:
    """A segment's name on the wire: ``FD:NAME``."""
    return f"{fd}:{name}"


def parse_segment(segment: object) -> tuple[int, str]:
    """``(fd, name)`` of a segment's name on the wire.

    Raises:
        ValueError: not ``FD:NAME``, FD a descriptor's number and NAME one this
            package gives (``aioparamsync-`` and 16 hex digits).
    """
    fd, sep, name = segment.partition(":") if isinstance(segment, str) else ("", "", "")
    if not (sep and fd.isascii() and fd.isdigit() and SEGMENT_NAME.match(name)):
        raise ValueError(
            f"a shared memory segment is named FD:aioparamsync-<16 hex digits>, not {segment!r}"
        )
    if int(fd) > _MAX_FD:
        raise ValueError(f"{segment!r}: {fd} is no file descriptor's number")
    return int(fd), name


def nbytes_of(data: Any) -> int:
    """The bytes of a value (a buffer, or ``Chunks``: several)."""
    return data.nbytes if type(data) is Chunks else memoryview(data).nbytes


@dataclass(frozen=True, slots=True)
class SharedView:
    """A region of a segment (``shared``, the IDL's ``SharedRegion``) and its bytes
    (``view``, a writable memoryview of ``shared.size`` bytes)."""

    shared: Any
    view: memoryview


def pack_into(
    region: SharedView, groups: Sequence[tuple[str, Sequence[tuple[str, Sequence[int], Any]]]]
) -> list[Any] | None:
    """Blocks of ``groups`` (each ``(dtype, items)``, an item ``(name, shape, data)``,
    ``data`` C-contiguous) with their bytes written into ``region`` (``Packed.shared``
    set, ``data`` empty), each block's at an ``ALIGN``-ed offset; None, and nothing
    written, if they do not fit."""
    sizes = [sum(nbytes_of(data) for _, _, data in items) for _, items in groups]
    start, end = region.shared.offset, 0
    for size in sizes:
        end = aligned(start + end) - start + size
    if end > region.shared.size:
        return None
    out = np.frombuffer(region.view, np.uint8)
    segment, at, blocks = region.shared.segment, 0, []
    for (dtype, items), size in zip(groups, sizes, strict=True):
        at += aligned(start + at) - (start + at)  # (this block's first byte, aligned)
        names: list[str] = []
        shapes: list[int] = []
        pos = at
        for name, shape, data in items:
            for part in data if type(data) is Chunks else (data,):
                src = np.frombuffer(part, np.uint8)  # (memoryview.cast: not of every buffer)
                out[pos : pos + src.nbytes] = src
                pos += src.nbytes
            names.append(name)
            shapes.append(len(shape))
            shapes += shape
        shared = thrift.SharedRegion(segment=segment, offset=start + at, size=size)
        block = thrift.Packed(names=names, dtype=dtype, shapes=shapes, data=b"", shared=shared)
        blocks.append(block)
        at = pos
    return blocks
