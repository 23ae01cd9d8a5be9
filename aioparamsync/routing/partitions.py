"""Partitioned parameters on the way out and back: cut before sending, put together after reading.

The node (for callers that know no topology) and the routed client (for
itself) do the same: see :mod:`aioparamsync.values.partitions` for the layout.

* A read: the node holding a partitioned name answers its manifest (a
  routed read) or reads its partitions itself (any other). :func:`gather`
  reads the partitions a response's manifests name (``read``: a routed read
  of their keys, each part at its primary, concurrently) and puts each
  parameter together, or leaves it out when a partition did not qualify
  (``min_version``, ``known_versions``: the parameter's version is its oldest
  partition's).
* A write: :func:`cut` turns each large parameter of an update (or push)
  into its partitions, and names the manifests to write first (an update's:
  the node holding the name checks its layout there before any partition is
  written).
* Answers: :func:`collapse` turns the versions of partitions into their
  parameter's; :func:`readable` the keys in a message into names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..errors import ErrorCode, RequestError
from ..placement import parse_key
from ..values import partitions as layouts
from ..values.compression import decode_parameter
from ..values.partitions import Layout, readable
from ..wire import thrift
from .merge import read_part

__all__ = ["Replaced", "collapse", "cut", "gather", "manifests_of", "read_ahead", "readable"]

# How many times a read is made again when a parameter was replaced amid it.
READ_AGAIN = 3


class Replaced(RequestError):
    """(UNAVAILABLE) A partition read does not fit the manifest read before it: the
    parameter was replaced between the two. Reading again reads the new one."""


def readable_error(exc: RequestError) -> RequestError:
    """``exc`` with its message :func:`readable` (itself when there is nothing to change:
    re-raise it then, never ``raise exc from exc``: an exception that holds itself)."""
    message = readable(exc.message)
    if message == exc.message:
        return exc
    return RequestError.of(exc.code, message, exc.epoch)


def manifests_of(params: Sequence[Any]) -> dict[str, Layout]:
    """The layouts of the manifests among ``params``, by their parameter's name.

    Raises:
        RequestError: (UNAVAILABLE) a manifest that does not parse.
    """
    found = {}
    for p in params:
        if "\x00" not in p.name:
            continue
        parsed = parse_key(p.name)
        if parsed is None or parsed[1] is not None:
            continue
        try:
            found[parsed[0]] = Layout.from_bytes(p.data)
        except ValueError as exc:
            raise RequestError(
                ErrorCode.UNAVAILABLE, f"{parsed[0]!r}: its stored manifest: {exc}"
            ) from None
    return found


def read_ahead(request: Any, known: Mapping[str, Layout], most_bytes: int) -> tuple[Any, set[str]]:
    """``request`` (a routed read) asking also for the partitions of its names whose
    layouts the client has seen (``known``), up to ``most_bytes`` of them in all, so
    that they come with their manifests, in one round (each key from its own node), and
    :func:`gather` reads none after; and those keys (the caller drops any that come
    without their manifest: the parameter is whole now). A read that waits, asks for
    versions or pieces, or of every name, is as it is: a partition does not answer those
    as its manifest would."""
    names = request.param_names
    if (
        not names
        or request.all_names
        or request.known_versions
        or request.wait_ms
        or request.piece_offset is not None
        or request.as_stored
    ):
        return request, set()
    asked = set(names)
    ahead: list[str] = []
    for name in names:
        layout = known.get(name)
        if layout is None:
            continue
        most_bytes -= layout.nbytes
        if most_bytes < 0:
            break  # (the rest after the manifests, as before: one answer stays small)
        ahead += (key for key in layout.keys(name) if key not in asked)
    if not ahead:
        return request, set()
    return read_part(request, [*names, *ahead]), set(ahead)


async def gather(
    request: Any,
    response: Any,
    read: Callable[[Any], Awaitable[Any]],
    *,
    again: Callable[[], Awaitable[Any]] | None = None,
    encoding: str | None = None,
    max_nbytes: int | None = None,
    limits: bool = False,
    join: bool = True,
) -> Any:
    """``response`` with each manifest in it replaced by its parameter, whole (see the module).

    Args:
        again: makes the read ``response`` answers again, for when a parameter
            was replaced amid it (its partitions do not fit its manifest: see
            :class:`Replaced`); up to ``READ_AGAIN`` times. None: not again.

    The other arguments are :func:`_gather_once`'s.
    """
    left = READ_AGAIN
    while True:
        try:
            return await _gather_once(
                request,
                response,
                read,
                encoding=encoding,
                max_nbytes=max_nbytes,
                limits=limits,
                join=join,
            )
        except Replaced:
            if not left or again is None:
                raise
            left -= 1
            response = await again()


async def _gather_once(
    request: Any,
    response: Any,
    read: Callable[[Any], Awaitable[Any]],
    *,
    encoding: str | None = None,
    max_nbytes: int | None = None,
    limits: bool = False,
    join: bool = True,
) -> Any:
    """``response`` with each manifest in it replaced by its parameter, whole: one try.

    Args:
        request: the read ``response`` answers.
        response: its ``ParameterResponse``; partitions already in it (a read
            of every name) are used, the others read.
        read: reads a request of partition keys (routed: each at its primary).
        encoding: the encoding to ask partitions in (they are decoded here).
        max_nbytes: the largest an encoded partition may decode to.
        limits: answer as one message must (a node's answer): a parameter
            larger than the request's ``max_inline_bytes`` as a header (no
            data, ``total_bytes``), a piece (``piece_offset``) as that piece.
        join: put each parameter's bytes together in one buffer (else its
            data are the partitions' buffers: see ``values.partitions.assemble``).

    Raises:
        RequestError: what ``read`` raised, its keys as names.
    """
    found = manifests_of(response.params)
    if not found:
        return response
    limit = request.max_inline_bytes if limits else None
    piece = request.piece_offset if limits else None
    have = {p.name: p for p in response.params if "\x00" in p.name and p.total_bytes is None}
    headers: list[str] = []  # keys whose versions alone are wanted
    data: list[str] = []  # keys whose bytes are
    for name, layout in found.items():
        keys = layout.keys(name)
        if piece is not None:
            first, last = _overlap(name, layout, piece, request.piece_bytes)
            headers += keys
            data += keys[first : last + 1]
        elif limit is not None and layout.nbytes > max(limit, 0):
            headers += keys
        else:
            data += [k for k in keys if k not in have]
    answers = await asyncio.gather(
        *(
            _read_keys(request, found, keys, read, encoding, inline)
            for keys, inline in ((headers, 0), (data, None))
            if keys
        )
    )
    heads: dict[str, Any] = {}
    stamp = response.timestamp or 0
    for answer in answers:
        stamp = max(stamp, answer.timestamp or 0)
        for p in answer.params:
            (heads if p.total_bytes is not None else have)[p.name] = p
    params = [p for p in response.params if "\x00" not in p.name]
    for name, layout in found.items():
        keys = layout.keys(name)
        if piece is not None or (limit is not None and layout.nbytes > max(limit, 0)):
            got = [heads.get(k) or have.get(k) for k in keys]
            if any(part is None for part in got):
                continue
            whole = _header(name, layout, got)
            if piece is not None:
                first, last = _overlap(name, layout, piece, request.piece_bytes)
                chunk = [have.get(k) for k in keys[first : last + 1]]
                if any(part is None for part in chunk):
                    continue
                start = layout.bounds(first)[0] * layouts.itemsize(layout.dtype)
                joined = b"".join(
                    decode_parameter(part, max_nbytes=max_nbytes).data for part in chunk
                )
                begin = piece - start
                whole.data = memoryview(joined)[begin : begin + request.piece_bytes]
                whole.offset = piece
            params.append(whole)
            continue
        parts = [have.get(key) for key in keys]
        if any(part is None for part in parts):
            continue  # (a partition did not qualify: nor does the parameter)
        try:
            assembled = layouts.assemble(
                name,
                layout,
                [decode_parameter(part, max_nbytes=max_nbytes) for part in parts],
                join=join,
            )
        except ValueError as exc:
            # (a replace of the parameter came between its manifest and a partition)
            raise Replaced(ErrorCode.UNAVAILABLE, f"{exc}: read it again") from None
        params.append(assembled)
    return thrift.ParameterResponse(params=params, timestamp=stamp)


def _overlap(name: str, layout: Layout, offset: int, size: int | None) -> tuple[int, int]:
    """The first and last partitions bytes ``[offset, offset + size)`` of the whole fall in."""
    item = layouts.itemsize(layout.dtype)
    nbytes = layout.nbytes
    if size is None or size < 1 or offset < 0 or offset >= max(nbytes, 1):
        raise RequestError(
            ErrorCode.BAD_REQUEST, f"{name!r} has {nbytes} bytes; no piece starts at {offset}"
        )
    per_bytes = layout.per * item
    return offset // per_bytes, min(offset + size - 1, nbytes - 1) // per_bytes


def _header(name: str, layout: Layout, parts: Sequence[Any]) -> Any:
    """The whole's header (no data, ``total_bytes``): the oldest partition's version."""
    oldest = min(parts, key=lambda q: (q.version or 0, q.origin or ""))
    return thrift.Parameter(
        name=name,
        data=b"",
        version=oldest.version,
        dtype=layout.dtype,
        shape=None if layout.shape is None else list(layout.shape),
        origin=oldest.origin,
        rule=parts[0].rule,
        total_bytes=layout.nbytes,
    )


async def _read_keys(
    request: Any,
    found: Mapping[str, Layout],
    keys: list[str],
    read: Callable[[Any], Awaitable[Any]],
    encoding: str | None,
    inline: int | None,
) -> Any:
    """A read of partitions ``keys`` with the request's conditions (by their parameter's)."""
    sub = thrift.ParameterRequest(
        param_names=keys,
        min_version=request.min_version,
        wait_ms=request.wait_ms,
        encoding=None if inline == 0 else encoding,
        max_inline_bytes=inline,
    )
    wanted = set(keys)
    for field in ("known_versions", "known_origins"):
        given = getattr(request, field)
        if given:
            by_key: dict[str, Any] = {}
            for name, layout in found.items():
                if name in given:
                    by_key.update((k, given[name]) for k in layout.keys(name) if k in wanted)
            setattr(sub, field, by_key)
    try:
        return await read(sub)
    except RequestError as exc:
        if readable_error(exc) is exc:  # (then not `raise exc from exc`: it would hold
            raise  # itself, and with it every frame it passed, until a collection)
        raise readable_error(exc) from exc


def cut(
    items: Sequence[Any],
    partition_bytes: int,
    known: Mapping[str, Layout] | None = None,
    *,
    max_nbytes: int | None = None,
) -> tuple[list[Any], list[Any], dict[str, Layout]]:
    """Cut the large ones of ``items`` (parameters, or gradients) into their partitions.

    A name whose layout is ``known`` (its manifest as stored) is cut by it;
    another by ``partition_bytes`` (see :func:`~aioparamsync.values.partitions.layout_for`).

    Returns:
        ``(items, manifests, layouts)``: the items with each large one replaced
        by its partitions; the manifests of the large ones; their layouts.

    Raises:
        ValueError: an item cannot be cut (its data does not fit its layout,
            or it is encoded in a way that needs decoding first).
        RequestError: (LIMIT_EXCEEDED) an item claims more than ``max_nbytes``
            once decoded (a few bytes of topk can claim any shape).
    """
    out: list[Any] = []
    manifests: list[Any] = []
    chosen: dict[str, Layout] = {}
    for item in items:
        if "\x00" in item.name:
            out.append(item)
            continue
        layout = known.get(item.name) if known else None
        if layout is not None and not _fits(item, layout):
            layout = None  # (a replace, or a mistake the node will name)
        if layout is None:
            layout = layouts.layout_for(item, partition_bytes)
        if layout is None:
            out.append(item)
            continue
        if max_nbytes is not None and layout.nbytes > max_nbytes:
            raise RequestError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{item.name!r}: {layout.describe()} is {layout.nbytes} bytes, more than "
                f"{max_nbytes}",
            )
        chosen[item.name] = layout
        manifests.append(layouts.manifest(item, layout))
        out.extend(layouts.split(item, layout))
    return out, manifests, chosen


def _fits(item: Any, layout: Layout) -> bool:
    """Whether ``item`` is of ``layout`` (the same elements; an update's: dtype, shape too)."""
    if item.replace or layouts.elements_of(item) != layout.elements:
        return False
    if item.dtype != layout.dtype:
        return False
    shape = None if item.shape is None else tuple(int(d) for d in item.shape)
    return shape is None or layout.shape is None or shape == layout.shape


def collapse(versions: Mapping[str, int], chosen: Mapping[str, Layout]) -> dict[str, int]:
    """Versions of partitions and manifests as their parameters': each its oldest partition's.

    Raises:
        RequestError: (UNAVAILABLE) a partition of one of ``chosen`` (cut by
            the caller) is not in ``versions``: its part was not applied.
    """
    if not chosen and not any("\x00" in k for k in versions):
        return dict(versions)
    out: dict[str, int] = {}
    oldest: dict[str, int] = {}
    for key, version in versions.items():
        parsed = parse_key(key) if "\x00" in key else None
        if parsed is None:
            out[key] = version
        elif parsed[1] is not None:
            name = parsed[0]
            oldest[name] = min(version, oldest.get(name, version))
    for name, layout in chosen.items():
        missing = [i for i, key in enumerate(layout.keys(name)) if key not in versions]
        if missing:
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"{name!r}: partitions {missing} were not answered as applied; send it again",
            )
    out.update(oldest)
    return out
