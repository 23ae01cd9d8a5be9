"""Parameters stored as partitions, as a node serves them (see values.partitions).

For callers that know nothing of partitions (the founding client, any Apache
Thrift client, ``route=False``) a node cuts what they write and puts together
what they read; for every caller it checks, where a name is held, that a
write keeps the layout stored. A routed client does the cutting and the
putting together itself (:mod:`aioparamsync.client.routing`): it is answered
manifests and partitions as they are stored.

* A write of a large parameter (:meth:`Partitioned.write`): its manifest first,
  checked at the nodes holding its name (:meth:`Partitioned.checked`), then
  every partition, each part at its primary.
* A read (:meth:`Partitioned.whole`): the manifests in a response replaced by
  their parameters, whole, as one message must hold them (a header, or a
  piece, for a client reading in pieces).

A replacement (``replace``, or plain bytes over plain bytes: a founding
client's update replaces, as the seed's server does) stores its value whole
or as partitions as its size asks, whatever the stored layout. The switch is
one step where the name is held: of a name's whole entry and its manifest,
the table keeps the newer (see :mod:`aioparamsync.store.table`), so a reader
sees the old value or the new. Growing, the new partitions are written
first, then the manifest that makes them the value; shrinking, the whole
value replaces the manifest, then the old partitions are emptied (written as
empty bytes: a replica that missed it converges by last-writer-wins, as for
any write; their keys stay, holding nothing). The new version exceeds the
old (its oldest partition's), so versions only grow.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, RequestError
from ..placement import is_reserved, manifest_key, parse_key
from ..routing.partitions import collapse, cut, gather, manifests_of, readable_error
from ..store.checks import check_rule_fits
from ..store.cuts import new_call
from ..store.table import Entry
from ..values.arrays import describe_layout
from ..values.packing import shared_answer
from ..values.partitions import Layout, elements_of, per_partition
from ..wire import METHODS, thrift
from ..wire.writer import Chunks

if TYPE_CHECKING:
    from .handlers import ParameterService

__all__ = [
    "MAX_INLINE_BYTES",
    "Partitioned",
    "check_names",
    "inline_limit",
    "is_manifest",
    "piece_of",
    "replaces",
]

log = logging.getLogger(__name__)

# The largest parameter answered in one message: a Thrift binary holds less
# than 2 GiB (and the message has a little more than the data).
MAX_INLINE_BYTES = 2**31 - 1 - 64 * 1024


def inline_limit(request: Any) -> int:
    """The largest parameter a read answers with its data (larger: a header)."""
    limit = request.max_inline_bytes
    return MAX_INLINE_BYTES if limit is None else min(max(limit, 0), MAX_INLINE_BYTES)


def piece_of(request: Any, entries: list[Entry], max_bytes: int) -> list[Any]:
    """The piece ``[piece_offset, piece_offset + piece_bytes)`` of the one name asked."""
    offset, size = request.piece_offset, request.piece_bytes
    if len(request.param_names) != 1 or request.all_names:
        raise RequestError(ErrorCode.BAD_REQUEST, "a piece is read of exactly one name")
    if size is None or not 0 < size <= max_bytes or offset < 0:
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"a piece needs piece_offset >= 0 and piece_bytes from 1 to {max_bytes}",
        )
    if not entries:
        return []
    entry = entries[0]
    if offset >= max(entry.nbytes, 1):
        raise RequestError(
            ErrorCode.BAD_REQUEST,
            f"{entry.name!r} has {entry.nbytes} bytes; no piece starts at {offset}",
        )
    piece = entry.to_parameter(not request.without_rules)
    piece.data = entry.data[offset : offset + size]
    piece.offset, piece.total_bytes = offset, entry.nbytes
    return [piece]


def is_manifest(key: str) -> bool:
    """Whether ``key`` is a manifest's (see :func:`~aioparamsync.placement.manifest_key`)."""
    if "\x00" not in key:
        return False
    parsed = parse_key(key)
    return parsed is not None and parsed[1] is None


def check_names(names: Any) -> None:
    """Refuse names a client may not give: those holding NUL, but for partitions' and manifests'.

    (Those a routed client reads and writes, and sends to any node when it
    knows no primary.)
    """
    for name in names:
        if isinstance(name, str) and is_reserved(name) and parse_key(name) is None:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"{name!r}: a parameter's name may not hold NUL (nothing was applied)",
            )


def replaces(p: Any, stored_dtype: str | None) -> bool:
    """Whether a write of ``p`` may change the layout of a parameter stored as
    ``stored_dtype``: it says ``replace``, or it is plain bytes over plain bytes."""
    return bool(p.replace) or (p.dtype is None and stored_dtype is None)


@dataclass(frozen=True)
class _Stored:
    """What is stored of a name: whole (``layout`` None), or as partitions."""

    version: int
    dtype: str | None
    nbytes: int
    rule: Any
    layout: Layout | None

    def describe(self) -> str:
        if self.layout is not None:
            return self.layout.describe()
        return f"{describe_layout(self.nbytes, self.dtype, None)} ({self.nbytes} bytes), whole"


def _describe(p: Any) -> str:
    n = memoryview(p.data).nbytes
    return describe_layout(n, p.dtype, tuple(p.shape) if p.shape is not None else None)


def _stamped(update: Any, params: Sequence[Any], keys: Sequence[str]) -> Any:
    """``update`` stamped as one call (see :mod:`aioparamsync.store.cuts`) that writes
    ``params`` and ``keys``, in several writes here and at other nodes."""
    stamped = copy.copy(update)
    stamped.call = new_call(len({*(p.name for p in params), *keys}))
    return stamped


def _carry_rule(p: Any, rule: Any) -> None:
    """Give ``p`` (a replacement of its own: a copy) the rule stored, if it has none and it fits."""
    if p.rule is None and rule is not None:
        try:
            check_rule_fits(p.name, rule, p.dtype)
        except RequestError:
            return  # (e.g. floats replaced by bytes: no rule applies, as ParameterTable.apply)
        p.rule = rule


class Partitioned:
    """A node's partitioned parameters (see the module).

    Args:
        service: the node's service: its store, its router, and how it reads
            and writes what it holds.
        partition_bytes: parameters of more elements than this many bytes of
            float32 are stored as partitions; 0: every one whole.
    """

    def __init__(self, service: ParameterService, partition_bytes: int) -> None:
        if partition_bytes < 0:
            raise ValueError(f"partition_bytes must be 0 or more, not {partition_bytes}")
        self.service = service
        self.partition_bytes = partition_bytes

    def manifests(self, names: Sequence[str], entries: Sequence[Entry]) -> list[Entry]:
        """The manifests held here of those of ``names`` not among ``entries``."""
        table = self.service.store.table
        found = {e.name for e in entries}
        return [
            e
            for n in names
            if n not in found
            and "\x00" not in n
            and (e := table.entry(manifest_key(n))) is not None
        ]

    async def whole(self, request: Any, outcome: Any) -> Any:
        """A response with each partitioned parameter in it put together.

        (A node answers a name stored as partitions by its manifest: see
        ``ParameterService._read``.)

        Keys of partitions and manifests the request named (a routed client
        that sent its part here, a peer's repair) are answered as they are.
        """
        response = await outcome if isinstance(outcome, asyncio.Future) else outcome
        asked = set(request.param_names or ())
        if all(p.name in asked for p in response.params if "\x00" in p.name):
            return response

        def again() -> Any:  # (as _pull read it: the parameter replaced amid it, the new one)
            return self.read_keys(request)

        # (an encoding needs the bytes in one buffer; else each partition's are sent as stored)
        gathered = await gather(
            request,
            response,
            self.read_keys,
            again=None if request.all_names else again,
            limits=True,
            join=bool(request.encoding),
        )
        limit = inline_limit(request)
        params = []
        for p in gathered.params:
            if "\x00" in p.name and p.name not in asked:
                continue  # (a read of every name: the partitions are in their parameter)
            if p.total_bytes is None and "\x00" not in p.name:
                data = p.data
                nbytes = data.nbytes if type(data) is Chunks else memoryview(data).nbytes
                if nbytes > limit:  # (a client that cannot take pieces)
                    raise RequestError(
                        ErrorCode.LIMIT_EXCEEDED,
                        f"{p.name!r} has {nbytes} bytes, more than one message holds: read "
                        "it in pieces (ParameterRequest.max_inline_bytes)",
                    )
                if request.encoding and p.shape is not None:
                    entry = Entry(
                        p.name,
                        memoryview(p.data),
                        p.version,
                        p.dtype,
                        tuple(p.shape),
                        p.origin,
                        p.rule,
                    )
                    p = self.service.encoded(entry, request.encoding)
            params.append(p)
        gathered.params = params
        lent = getattr(request, "lent", None)  # (a region of the client's: see .shared)
        if lent is not None and request.without_rules and not request.encoding:
            return shared_answer(gathered, lent)
        return gathered

    async def read_keys(self, request: Any) -> Any:
        """A read of partitions' keys: each part where it is held (here, or at its primary)."""
        router = self.service.router
        parts = None if router.alone() else router.read_parts(request.param_names)
        if parts is None:
            outcome = self.service.pull_here(request)
            return await outcome if isinstance(outcome, asyncio.Future) else outcome
        return await router.read(request, parts, self.service.pull_here, METHODS.pull_parameters)

    def large(self, p: Any) -> bool:
        """Whether ``p`` is a parameter to store as partitions (not one of them)."""
        n = elements_of(p)
        return (
            n is not None
            and n > per_partition(self.partition_bytes, p.dtype is None)
            and "\x00" not in p.name
        )

    async def write(self, update: Any, params: Sequence[Any], acks: str) -> Any:
        """An update with large parameters: their manifests first, then every partition.

        Each manifest is written (and checked, against the layout stored) at
        the nodes that hold its name before any partition is: a change of
        layout the update may not make is refused with nothing applied. The
        partitions and the update's other parameters then go, as one update,
        each part to its primary; the answer gives each parameter the version
        of its oldest partition.

        A replacement of a parameter stored whole, or in other partitions,
        writes its partitions first and its manifest last (see the module);
        a parameter stored whole that the update keeps the layout of stays
        whole (made when ``--partition-bytes`` was larger).
        """
        ready = self.service.incoming(params)  # (pieces put together, encoded ones decoded)
        if not ready:  # (a piece of an upload, not the last)
            return thrift.UpdateResult(versions={}, timestamp=self.service.store.timestamp)
        stored = await self._stored([p.name for p in ready if self.large(p)])
        ready = self._typed(ready, stored)
        whole = [p for p in ready if self._stays_whole(p, stored.get(p.name))]
        uncut = {id(p) for p in whole}
        try:
            # (no bound: they are decoded, their data checked as they are cut)
            items, manifests, chosen = cut(
                [p for p in ready if id(p) not in uncut], self.partition_bytes
            )
        except ValueError as exc:
            raise RequestError(ErrorCode.SHAPE_MISMATCH, str(exc)) from None
        by_name = {p.name: p for p in ready}
        changing = {
            name: held
            for name, layout in chosen.items()
            if (held := stored.get(name)) is not None and self._changes(by_name[name], held, layout)
        }
        if changing:
            items = await self._grown(items, changing)
        replaced = {manifest_key(name) for name in changing}
        first = [m for m in manifests if m.name not in replaced]
        last = [m for m in manifests if m.name in replaced]
        stale = [
            key
            for name, held in changing.items()
            if held.layout is not None
            for key in held.layout.keys(name)[chosen[name].count :]
        ]
        update = _stamped(update, [*first, *items, *whole, *last], stale)
        if first:
            await self._write_keys(update, first, acks)
        # (a replacement's partitions at every live replica before its manifest: a read
        # at any of them finds them)
        result = await self._write_keys(update, [*items, *whole], "all" if changing else acks)
        if last:  # (the new partitions are all written: the manifest makes them the value)
            await self._write_keys(update, last, acks)
        await self._empty(update, stale, acks)
        result.versions = collapse(result.versions, chosen)
        return result

    def _stays_whole(self, p: Any, held: _Stored | None) -> bool:
        """Whether large ``p`` is written whole: it updates one stored whole, keeping its size."""
        return (
            held is not None
            and held.layout is None
            and not replaces(p, held.dtype)
            and memoryview(p.data).nbytes == held.nbytes
        )

    @staticmethod
    def _changes(p: Any, held: _Stored, layout: Layout) -> bool:
        """Whether ``p``, cut by ``layout``, replaces what is stored by another layout.

        Raises:
            RequestError: (SHAPE_MISMATCH) it would, but may not: a write of a
                parameter stored whole that is no replacement. (One stored as
                partitions is checked with its manifest, where its name is held.)
        """
        if held.layout is None:
            if not replaces(p, held.dtype):
                raise RequestError(
                    ErrorCode.SHAPE_MISMATCH,
                    f"{p.name!r} is stored as {held.describe()}; the update has {_describe(p)}. "
                    "An update keeps a parameter's layout: replace it (replace=True; on the "
                    "wire, Parameter.replace) to store it so",
                )
            return True
        return held.layout != layout and replaces(p, held.layout.dtype)

    async def _grown(self, items: Sequence[Any], changing: Mapping[str, _Stored]) -> list[Any]:
        """``items`` with the partitions of ``changing`` past the version stored, and its rule."""
        oldest = await self._oldest(
            {n: held.layout for n, held in changing.items() if held.layout is not None}
        )
        out = []
        for item in items:
            parsed = parse_key(item.name) if "\x00" in item.name else None
            held = changing.get(parsed[0]) if parsed is not None else None
            if held is not None:
                version, rule = oldest.get(parsed[0], (held.version, held.rule))  # type: ignore[index]
                item = copy.copy(item)
                item.version = max(item.version or 0, version + 1)
                _carry_rule(item, rule)
            out.append(item)
        return out

    async def _stored(self, names: Sequence[str]) -> dict[str, _Stored]:
        """What is stored of ``names`` (those that are): one read, without their data."""
        if not names:
            return {}
        # (a name stored as partitions is answered by its manifest, whole: see _read)
        request = thrift.ParameterRequest(param_names=list(names), max_inline_bytes=0)
        response = await self.read_keys(request)
        found = {}
        for p in response.params:
            if "\x00" not in p.name:
                nbytes = p.total_bytes if p.total_bytes is not None else memoryview(p.data).nbytes
                found[p.name] = _Stored(p.version or 0, p.dtype, nbytes, p.rule, None)
        for name, layout in manifests_of(response.params).items():
            found.setdefault(name, _Stored(0, layout.dtype, layout.nbytes, None, layout))
        return found

    async def _oldest(self, layouts: Mapping[str, Layout]) -> dict[str, tuple[int, Any]]:
        """The version of each parameter stored as ``layouts`` (its oldest partition's), and
        its rule: one read of their partitions, without their data."""
        keys = [key for name, layout in layouts.items() for key in layout.keys(name)]
        if not keys:
            return {}
        request = thrift.ParameterRequest(param_names=keys, max_inline_bytes=0)
        found: dict[str, tuple[int, Any]] = {}
        for p in (await self.read_keys(request)).params:
            parsed = parse_key(p.name)
            if parsed is None or parsed[1] is None:
                continue
            version, rule = found.get(parsed[0], (p.version or 0, p.rule))
            found[parsed[0]] = (min(version, p.version or 0), rule if rule is not None else p.rule)
        return found

    async def _empty(self, update: Any, keys: Sequence[str], acks: str) -> None:
        """Write the partitions ``keys`` of a layout replaced as empty bytes (see the module).

        The replacement is applied already: a partition that cannot be
        emptied now is left (logged); what it holds is no parameter's.
        """
        if not keys:
            return
        empty = [thrift.Parameter(name=key, data=b"", replace=True) for key in keys]
        try:
            await self._write_keys(update, empty, acks)
        except RequestError as exc:
            log.warning(
                "the replaced partitions %s were not all emptied: %s", keys[:3], exc.message
            )

    def _typed(self, params: Sequence[Any], stored: Mapping[str, _Stored]) -> Sequence[Any]:
        """``params`` with large plain bytes of a partitioned parameter's size in its layout.

        (As plain bytes of the stored size keep a stored parameter's dtype and
        shape: a founding client's update is cut as the stored one is.)
        """
        out = []
        for p in params:
            held = stored.get(p.name) if p.dtype is None and not p.encoding else None
            layout = held.layout if held is not None else None
            if (
                layout is not None
                and layout.dtype is not None
                and memoryview(p.data).nbytes == layout.nbytes
            ):
                p = copy.copy(p)
                p.dtype, p.shape = layout.dtype, list(layout.shape or [layout.elements])
            out.append(p)
        return out

    def shrinking(self, params: Sequence[Any]) -> dict[str, Layout]:
        """The layouts of those of ``params`` (held here, not large) that replace a parameter
        stored here as partitions: they are written by :meth:`shrink`.

        Raises:
            RequestError: (SHAPE_MISMATCH) one that may not replace it (see :meth:`checked`).
        """
        table = self.service.store.table
        found: dict[str, Layout] = {}
        for p in params:
            if "\x00" in p.name:
                continue
            key = table.partner(p.name)
            if key is None:
                break  # (no manifest is held here)
            held = table.entry(key)
            if held is not None:
                layout = Layout.from_bytes(held.data)
                self._check_whole(p, layout)
                found[p.name] = layout
        if found and not self.service.router.alone():
            parts = self.service.router.write_parts(list(found))
            if parts is not None:  # (held here only as a replica being handed on: not here)
                found = {n: found[n] for n in parts.get(None, ())}
        return found

    async def shrink(
        self,
        update: Any,
        params: Sequence[Any],
        parts: Any,
        acks: str,
        layouts: Mapping[str, Layout],
    ) -> Any:
        """Write ``params``, some of which replace parameters stored as ``layouts``, whole.

        Each of those gets a version past its oldest partition's (and its rule,
        if it has none and the rule fits); once applied, their partitions are emptied.
        """
        oldest = await self._oldest(layouts)
        out = []
        for p in params:
            if p.name in layouts:
                p = copy.copy(p)
                version, rule = oldest.get(p.name, (0, None))
                p.version = max(p.version or 0, version + 1)
                _carry_rule(p, rule)
            out.append(p)
        emptied = [key for name, layout in layouts.items() for key in layout.keys(name)]
        update = _stamped(update, out, emptied)
        # (at every live replica before the partitions are emptied: none reads them then)
        result = await self.service.write_parts(update, out, parts, "all")
        await self._empty(update, emptied, acks)
        return result

    async def _write_keys(self, update: Any, params: Sequence[Any], acks: str) -> Any:
        """``params`` (keys of partitions and manifests too) written where they are held."""
        router = self.service.router
        parts = None
        if not router.alone():
            parts = router.write_parts(list(dict.fromkeys(p.name for p in params)))
        try:
            return await self.service.write_parts(update, params, parts, acks)
        except RequestError as exc:
            if readable_error(exc) is exc:  # (then not `raise exc from exc`: it would hold
                raise  # itself, and with it every frame it passed, until a collection)
            raise readable_error(exc) from exc

    def checked(self, params: Sequence[Any]) -> Sequence[Any]:
        """``params`` to apply here, with their layouts checked against those stored as partitions.

        A manifest may not change the layout stored, nor cut a parameter
        stored whole, and a parameter stored as partitions may not be written
        whole, unless its update is a replacement (:func:`replaces`). A
        manifest without a shape takes the stored one (as an update without
        one does).

        Raises:
            RequestError: (SHAPE_MISMATCH) a layout the update may not make.
        """
        table = self.service.store.table
        out = None
        for i, p in enumerate(params):
            name = p.name
            if "\x00" not in name:
                key = table.partner(name)
                if key is not None and (held := table.entry(key)) is not None:
                    self._check_whole(p, Layout.from_bytes(held.data))
                continue
            parsed = parse_key(name)
            if parsed is None or parsed[1] is not None:
                continue
            checked = self._checked_manifest(parsed[0], p)
            if checked is not p:
                if out is None:
                    out = list(params)
                out[i] = checked
        return params if out is None else out

    def _check_whole(self, p: Any, stored: Layout) -> None:
        """Refuse (SHAPE_MISMATCH) a write of ``p`` whole over a parameter stored as ``stored``
        that is no replacement."""
        if not replaces(p, stored.dtype):
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{p.name!r} is stored as {stored.describe()}; the update has {_describe(p)}, "
                f"which is stored whole (up to {self.partition_bytes} bytes of float32). An "
                "update keeps a parameter's layout: replace it (replace=True; on the wire, "
                "Parameter.replace) to store it so",
            )

    def _checked_manifest(self, name: str, p: Any) -> Any:
        table = self.service.store.table
        try:
            given = Layout.from_bytes(p.data)
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{name!r}: {exc}") from None
        whole = table.entry(name)
        if whole is not None:
            if p.replace or (given.dtype is None and whole.dtype is None):
                return p  # (a replacement: the manifest replaces the whole, see the module)
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r} is stored whole ({whole.nbytes} bytes); the update has "
                f"{given.describe()}. An update keeps a parameter's layout: replace it "
                "(replace=True; on the wire, Parameter.replace) to store it so",
            )
        held = table.entry(p.name)
        if held is None:
            return p
        stored = Layout.from_bytes(held.data)
        if p.replace or (given.dtype is None and stored.dtype is None):
            return p  # (a replacement: plain bytes over plain bytes, too)
        if (
            given.dtype != stored.dtype
            or given.elements != stored.elements
            or (given.shape is not None and given.shape != stored.shape)
        ):
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r} is {stored.describe()}; the update has {given.describe()}: set "
                "replace to replace it",
            )
        if given.per != stored.per:
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r} is stored in partitions of {stored.per} elements; this node cuts "
                f"{given.per} (is --partition-bytes the same on every node?)",
            )
        if given.shape is None and stored.shape is not None:
            kept = copy.copy(p)
            kept.data = stored.to_bytes()
            return kept
        return p
