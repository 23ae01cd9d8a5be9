"""A client's shared memory with a node on its host (see :mod:`aioparamsync.values.sharedmem`).

A client whose addresses are all Unix sockets (``unix:PATH``: its node is on
this host) keeps a :class:`Lane`: segments of memory it makes as it needs
them (``memfd_create``, every page reserved when made), up to
``shared_memory`` bytes in all, and regions of them it lends to its calls.

* A read in blocks (``get_arrays``, ``get_parameters(packed=True)``) lends the
  node a region as large as that read's last answer; the node writes the
  raw parameters there. The arrays are read-only views of the region, which
  goes back to the lane once the last of them is gone (the lane makes another
  segment meanwhile, so arrays a caller keeps are never written over).
* A push, once a read has been answered so (the node maps this client's
  segments), writes its raw gradients into a region: the one copy of them
  this client makes. The region goes back when the push is answered.

A call that fails (a timeout, a broken connection) keeps its region from use
for the lane's life: the node may yet read or write it. Where memory cannot
be had (``/dev/shm`` or a cgroup full), or the node does not share, the calls
go over the socket as they would without a lane.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any

import numpy as np

from ..errors import RemoteProtocolError
from ..values.rowwire import rows_in, shareable
from ..values.sharedmem import (
    ALIGN,
    SHARED_MIN_BYTES,
    SharedView,
    aligned,
    pack_into,
    segment_of,
)
from ..wire import thrift
from .addresses import unix_path

__all__ = ["DEFAULT_SHARED_MEMORY_BYTES", "Lane", "Region", "lane_for", "may_share", "read_lent"]

log = logging.getLogger(__name__)

# The most shared memory a client makes by default (bytes, all its segments).
DEFAULT_SHARED_MEMORY_BYTES = 1 << 30
# A new segment holds at least this many bytes, and twice the region it is made for.
MIN_SEGMENT_BYTES = 64 << 20
# Reads answered in the message though lent room enough, after which a lane lends no more.
DECLINES = 2
# Reads whose answers' sizes a lane remembers (by the names read).
_MAX_READS = 64
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
IUF = "iuf"  # (numpy's dtype kinds a push writes into shared memory)


def lane_for(addresses: list[tuple[str, int]], limit: int) -> Lane | None:
    """A lane for a client of ``addresses``, if it may share memory with them: each a
    Unix socket, ``limit`` above 0, and this system able to (Linux's memfd).

    Raises:
        ValueError: ``limit`` is not a number of bytes (an int, 0 or more).
    """
    if not may_share(limit) or not addresses:
        return None
    if any(unix_path(host) is None for host, _ in addresses):
        return None
    return Lane(limit)


def may_share(limit: int) -> bool:
    """Whether a client may share memory: ``limit`` above 0, and this system able to.

    Raises:
        ValueError: ``limit`` is not a number of bytes (an int, 0 or more).
    """
    if type(limit) is not int or limit < 0:
        raise ValueError(f"shared_memory is a number of bytes, 0 or more, not {limit!r}")
    return limit > 0 and hasattr(os, "memfd_create") and hasattr(os, "posix_fallocate")


class Segment:
    """A memfd of ``size`` bytes, mapped, and its free extents (first fit)."""

    def __init__(self, size: int) -> None:
        self.name = f"aioparamsync-{secrets.token_hex(8)}"
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)  # (out of memory: here, not a SIGBUS later)
            self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.wire = segment_of(self.fd, self.name)
        self.size = size
        self.free = [(0, size)]  # (offset, size), by offset, none adjacent

    def take(self, size: int) -> int | None:
        for i, (offset, length) in enumerate(self.free):
            if length >= size:
                if length == size:
                    del self.free[i]
                else:
                    self.free[i] = (offset + size, length - size)
                return offset
        return None

    def give(self, offset: int, size: int) -> None:
        free = self.free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, size))
        if i + 1 < len(free) and offset + size == free[i + 1][0]:  # (joined to the next)
            free[i] = (offset, size + free.pop(i + 1)[1])
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # (and to the one before)
            start, length = free[i - 1]
            free[i - 1] = (start, length + free.pop(i)[1])

    def close(self) -> None:
        os.close(self.fd)
        with contextlib.suppress(BufferError):  # (arrays of it alive: unmapped when gone)
            self.map.close()


class Region:
    """``size`` bytes at ``offset`` of ``segment``, lent to a call."""

    __slots__ = ("offset", "segment", "shared", "size")

    def __init__(self, segment: Segment, offset: int, size: int) -> None:
        self.segment, self.offset, self.size = segment, offset, size
        self.shared = thrift.SharedRegion(segment=segment.wire, offset=offset, size=size)

    def view(self) -> SharedView:
        return SharedView(
            self.shared, memoryview(self.segment.map)[self.offset : self.offset + self.size]
        )


class Lane:
    """A client's segments and the regions lent of them (see the module's docstring)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.segments: list[Segment] = []
        self.made = 0  # bytes of all segments
        self.kept = 0  # bytes of regions kept from use (their calls failed)
        self.lent = 0  # bytes lent now
        self.shared_reads = self.shared_pushes = 0
        self.broken: str | None = None  # why no segment can be made (then none is)
        self.declined = 0  # reads the node answered in the message, room lent (see _declined)
        self._reads: dict[Hashable, int] = {}
        # (an array's region comes back in the thread that lets go of its last view)
        self._lock = threading.Lock()

    def stats(self) -> dict[str, Any]:
        return {
            "segments": len(self.segments),
            "bytes": self.made,
            "lent": self.lent,
            "kept": self.kept,
            "reads": self.shared_reads,
            "pushes": self.shared_pushes,
            "broken": self.broken,
        }

    def take(self, size: int) -> Region | None:
        """A region of at least ``size`` bytes, or None (over the limit, or no memory)."""
        size = max(aligned(size), ALIGN)
        with self._lock:
            found = self._found(size)
            if found is None and self._grown(size):
                found = self._found(size)
            if found is None:
                return None
            self.lent += size
        return Region(found[0], found[1], size)

    def _found(self, size: int) -> tuple[Segment, int] | None:
        for segment in self.segments:
            if (offset := segment.take(size)) is not None:
                return segment, offset
        return None

    def _grown(self, size: int) -> bool:
        """Whether a segment that holds ``size`` bytes was made (within the limit)."""
        if self.broken is not None:
            return False
        page = mmap.PAGESIZE
        room = (self.limit - self.made) // page * page
        made = min(room, -(-max(MIN_SEGMENT_BYTES, 2 * size) // page) * page)
        if made < size:
            return False
        try:
            segment = Segment(made)
        except OSError as exc:
            self.broken = f"cannot make {made} bytes of shared memory: {exc}"
            log.warning("%s; calls go over the socket", self.broken)
            return False
        self.segments.append(segment)
        self.made += made
        return True

    def give(self, region: Region) -> None:
        """``region`` back: its call is done with it."""
        with self._lock:
            self.lent -= region.size
            region.segment.give(region.offset, region.size)

    def _declined(self) -> None:
        """The node answered a read in the message where it had room in the region lent:
        it does not map this client's memory (another user, or a node that cannot see this
        process: another PID namespace). After ``DECLINES`` such answers, no more is lent,
        and the segments go (those arrays still hold, once they are gone)."""
        self.declined += 1
        if self.declined == DECLINES:
            log.info("the node answers in messages, not in shared memory: none is lent to it")
            self.close()  # (no segment is made after: take() answers None)
            self.made = 0
            self.broken = "the node does not map this client's memory"

    def keep(self, region: Region) -> None:
        """``region`` never lent again: its call failed, and the node may yet use it."""
        with self._lock:
            self.lent -= region.size
            self.kept += region.size

    # -- reads --------------------------------------------------------------------

    def for_read(self, names: list[str] | None) -> tuple[Hashable, Region | None]:
        """The key of a read of ``names``, and a region for its answer (if its size is
        known: that of the last answer to such a read)."""
        key = tuple(names) if names is not None else None
        size = self._reads.get(key)
        return key, (self.take(size) if size else None)

    def answered(self, key: Hashable, region: Region | None, response: Any) -> None:
        """Make ``response``'s blocks in ``region`` views of it (read-only; the region
        back to the lane when the last is gone); remember the answer's size.

        Raises:
            RemoteProtocolError: a block said to be in shared memory outside ``region``.
        """
        blocks = response.packed or ()
        shared = [b for b in blocks if b.shared is not None]
        if region is None or not shared:
            if region is not None:
                self.give(region)
            # (what would go through shared memory: the arrays of SHARED_MIN_BYTES or more;
            # a header's, in pieces, too)
            sizes = [
                n
                for p in response.params
                if p.dtype is not None
                and (n := len(p.data) if p.total_bytes is None else p.total_bytes)
                >= SHARED_MIN_BYTES
            ]
            if len(self._reads) >= _MAX_READS and key not in self._reads:
                self._reads.pop(next(iter(self._reads)))
            needed = self._reads[key] = sum(sizes) + ALIGN * (len(sizes) + 1) if sizes else 0
            if region is not None and 0 < needed <= region.size:
                self._declined()  # (room enough, and answered in the message)
            if shared:
                raise RemoteProtocolError("an answer in shared memory to a read that lent none")
            return
        holder = self._held_in(region, [b.shared for b in shared], "a block")
        start = region.offset
        for b in shared:
            b.data = holder[b.shared.offset - start : b.shared.offset - start + b.shared.size]
            b.shared = None
        self.shared_reads += 1

    def _held_in(self, region: Region, answered: list[Any], what: str) -> np.ndarray:
        """A read-only array of ``region``'s bytes, which goes back to the lane once the
        last array of it is gone; each of ``answered`` (``SharedRegion``s of an answer)
        checked to lie within it.

        Raises:
            RemoteProtocolError: one does not (``region`` given back).
        """
        for r in answered:
            start = r.offset - region.offset
            if (
                r.segment != region.shared.segment
                or not 0 <= start <= start + r.size <= region.size
            ):
                self.give(region)
                raise RemoteProtocolError(
                    f"{what} in shared memory at {r.offset} ({r.size} bytes) of {r.segment!r}, "
                    f"outside the region lent ({region.size} bytes at {region.offset})"
                )
        holder = np.frombuffer(region.view().view, np.uint8)
        holder.flags.writeable = False
        weakref.finalize(holder, self.give, region)
        return holder

    # -- pushes -------------------------------------------------------------------

    def for_push(
        self, grads: Mapping[str, Any]
    ) -> tuple[list[Any], Mapping[str, Any], Region | None]:
        """Blocks of the raw gradients of ``grads`` (numpy's, C-contiguous, of an integer
        or float dtype of numpy's own; of ``SHARED_MIN_BYTES`` or more) written into a
        region, the other gradients, and the region (None: none was to be had, and no
        blocks)."""
        groups: dict[str, list[tuple[str, Any, Any]]] = {}
        rest: dict[str, Any] = {}
        size = 0
        for name, g in grads.items():
            if (
                type(g) is np.ndarray
                and g.nbytes >= SHARED_MIN_BYTES
                and g.flags.c_contiguous
                and g.dtype.kind in IUF
            ):
                groups.setdefault(g.dtype.str, []).append((name, g.shape, g))
                size += g.nbytes
            else:
                rest[name] = g
        if not groups or (region := self.take(size + ALIGN * len(groups))) is None:
            return [], grads, None
        blocks = pack_into(region.view(), list(groups.items()))
        assert blocks is not None  # (the region was taken for them)
        self.shared_pushes += 1
        return blocks, rest, region

    # -- rows ---------------------------------------------------------------------

    def for_rows(self, nbytes: int) -> Region | None:
        """A region for a pull's ``nbytes`` of raw rows (None: too few, or no room)."""
        return self.take(nbytes) if nbytes >= SHARED_MIN_BYTES else None

    def rows_answered(self, region: Region | None, rows: Any) -> None:
        """Make ``rows`` (a pull's answer, the IDL's ``Rows``) a read-only view of
        ``region`` where the node wrote them there (the region back to the lane once
        the last array of it is gone); else ``region`` back.

        Raises:
            RemoteProtocolError: rows said to be in shared memory outside ``region``.
        """
        at = rows.shared
        if region is None or at is None:
            if region is not None:
                self.give(region)
                if rows.encoding is None:
                    self._declined()  # (room enough, and answered in the message)
            if at is not None:
                raise RemoteProtocolError("rows answered in shared memory to a pull that lent none")
            return
        holder = self._held_in(region, [at], "rows")
        start = at.offset - region.offset
        rows.data, rows.shared = holder[start : start + at.size], None
        self.shared_reads += 1

    def for_row_push(self, rows: np.ndarray) -> tuple[Any, Region] | None:
        """``rows`` (a ``(count, dim)`` float array) written into a region, as the IDL's
        ``Rows`` naming it, and the region; None (send them in the message) until the
        node has answered a read in shared memory, or for too few bytes, or no room."""
        if not self.shared_reads or rows.nbytes < SHARED_MIN_BYTES or not shareable(rows.dtype):
            return None
        region = self.take(rows.nbytes)
        if region is None:
            return None
        out = rows_in(region.view().view, rows)
        out.shared = thrift.SharedRegion(
            segment=region.shared.segment, offset=region.offset, size=rows.nbytes
        )
        self.shared_pushes += 1
        return out, region

    def close(self) -> None:
        with self._lock:
            for segment in self.segments:
                segment.close()
            self.segments.clear()
            self.broken = "closed"


async def read_lent(lane: Lane | None, request: Any, call: Callable[[], Awaitable[Any]]) -> Any:
    """``call()``'s answer to ``request`` (a read), lent a region of ``lane`` for its
    answer where it may be: in blocks (``packed``), not a long poll."""
    if lane is None or not request.packed or request.wait_ms is not None:
        return await call()
    key, region = lane.for_read(None if request.all_names else request.param_names)
    request.shared = None if region is None else region.shared
    try:
        response = await call()
    except BaseException:
        if region is not None:
            lane.keep(region)
        raise
    lane.answered(key, region, response)
    return response
