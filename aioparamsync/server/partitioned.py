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
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, RequestError
from ..placement import is_reserved, manifest_key, parse_key
from ..routing.partitions import collapse, cut, gather, manifests_of, readable_error
from ..store.table import Entry
from ..values.partitions import Layout, elements_of, per_partition
from ..wire import METHODS, thrift
from ..wire.writer import Chunks

if TYPE_CHECKING:
    from .handlers import ParameterService

__all__ = ["MAX_INLINE_BYTES", "Partitioned", "check_names", "inline_limit", "is_manifest"]

# The largest parameter answered in one message: a Thrift binary holds less
# than 2 GiB (and the message has a little more than the data).
MAX_INLINE_BYTES = 2**31 - 1 - 64 * 1024


def inline_limit(request: Any) -> int:
    """The largest parameter a read answers with its data (larger: a header)."""
    limit = request.max_inline_bytes
    return MAX_INLINE_BYTES if limit is None else min(max(limit, 0), MAX_INLINE_BYTES)


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
        # (an encoding needs the bytes in one buffer; else each partition's are sent as stored)
        gathered = await gather(
            request, response, self.read_keys, limits=True, join=bool(request.encoding)
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
                    p = self.service._encoded(entry, request.encoding)
            params.append(p)
        gathered.params = params
        return gathered

    async def read_keys(self, request: Any) -> Any:
        """A read of partitions' keys: each part where it is held (here, or at its primary)."""
        router = self.service.router
        parts = None if router.alone() else router.read_parts(request.param_names)
        if parts is None:
            outcome = self.service._pull_here(request)
            return await outcome if isinstance(outcome, asyncio.Future) else outcome
        return await router.read(request, parts, self.service._pull_here, METHODS.pull_parameters)

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
        """
        ready = self.service._incoming(params)  # (pieces put together, encoded ones decoded)
        if not ready:  # (a piece of an upload, not the last)
            return thrift.UpdateResult(versions={}, timestamp=self.service.store.timestamp)
        ready = await self._typed(ready)
        try:
            # (no bound: they are decoded, their data checked as they are cut)
            items, manifests, chosen = cut(ready, self.partition_bytes)
        except ValueError as exc:
            raise RequestError(ErrorCode.SHAPE_MISMATCH, str(exc)) from None
        if manifests:
            await self._write_keys(update, manifests, acks)
        result = await self._write_keys(update, items, acks)
        result.versions = collapse(result.versions, chosen)
        return result

    async def _typed(self, params: Sequence[Any]) -> Sequence[Any]:
        """``params`` with large plain bytes of a partitioned parameter's size in its layout.

        (As plain bytes of the stored size keep a stored parameter's dtype and
        shape: a founding client's update is cut as the stored one is.)
        """
        plain = [p.name for p in params if p.dtype is None and self.large(p)]
        if not plain:
            return params
        request = thrift.ParameterRequest(param_names=[manifest_key(n) for n in plain])
        stored = manifests_of((await self.read_keys(request)).params)
        out = []
        for p in params:
            layout = stored.get(p.name) if p.dtype is None else None
            if (
                layout is not None
                and layout.dtype is not None
                and not p.encoding
                and memoryview(p.data).nbytes == layout.nbytes
            ):
                p = copy.copy(p)
                p.dtype, p.shape = layout.dtype, list(layout.shape or [layout.elements])
            out.append(p)
        return out

    async def _write_keys(self, update: Any, params: Sequence[Any], acks: str) -> Any:
        """``params`` (keys of partitions and manifests too) written where they are held."""
        router = self.service.router
        parts = None
        if not router.alone():
            parts = router.write_parts(list(dict.fromkeys(p.name for p in params)))
        try:
            return await self.service._write_parts(update, params, parts, acks)
        except RequestError as exc:
            raise readable_error(exc) from exc

    def checked(self, params: Sequence[Any]) -> Sequence[Any]:
        """``params`` to apply here, with their layouts checked against those stored as partitions.

        A manifest may not change the layout stored (unless its parameter's
        update says ``replace``), nor cut a parameter stored whole; a
        parameter stored as partitions may not be written whole. A manifest
        without a shape takes the stored one (as an update without one does).

        Raises:
            RequestError: (SHAPE_MISMATCH) a layout the update may not make.
        """
        table = self.service.store.table
        out = None
        for i, p in enumerate(params):
            name = p.name
            if "\x00" not in name:
                held = table.entry(manifest_key(name))
                if held is not None:
                    raise RequestError(
                        ErrorCode.SHAPE_MISMATCH,
                        f"{name!r} is stored as {Layout.from_bytes(held.data).describe()}; a "
                        f"write of it must hold more than {self.partition_bytes} bytes of "
                        "float32 (give a smaller one another name)",
                    )
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

    def _checked_manifest(self, name: str, p: Any) -> Any:
        table = self.service.store.table
        try:
            given = Layout.from_bytes(p.data)
        except ValueError as exc:
            raise RequestError(ErrorCode.BAD_REQUEST, f"{name!r}: {exc}") from None
        whole = table.entry(name)
        if whole is not None:
            raise RequestError(
                ErrorCode.SHAPE_MISMATCH,
                f"{name!r} is stored whole ({whole.nbytes} bytes); it cannot be stored as "
                f"{given.describe()} (its --partition-bytes was larger when it was made)",
            )
        held = table.entry(p.name)
        if held is None:
            return p
        stored = Layout.from_bytes(held.data)
        if p.replace:
            return p
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
