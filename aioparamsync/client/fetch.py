"""Reading a parameter larger than one message, in pieces; and gathering calls that stop together.

A node answers a parameter larger than a request's ``max_inline_bytes``
without data (``total_bytes`` set, see :mod:`aioparamsync.values.pieces`);
:func:`fetch` then reads its pieces (``piece_offset``, ``piece_bytes``) into
one numpy buffer, a few at once, checking that every piece is of the same
version (else it starts over). Peer links read a peer's large parameters the
same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, TypeVar, cast

import numpy as np

from ..errors import ErrorCode, RequestError
from ..values.pieces import PIECE_BYTES
from ..wire import METHODS, thrift

__all__ = ["fetch", "fetch_all", "gather_all", "gather_or_stop"]

T = TypeVar("T")

# Pieces a reader asks for at once; tries before it gives up on a parameter
# that keeps changing while it reads.
FETCH_CONCURRENCY = 4
FETCH_TRIES = 3


async def fetch_all(
    pool: Any, params: list[Any], piece_bytes: int, *, timeout: Any = ...
) -> list[Any]:
    """``params`` of an answer, those answered without data (headers) read in pieces, at
    once (an answer holds at most ``max_inline_bytes`` of data: the rest comes so)."""

    async def whole(p: Any) -> Any:
        if p.total_bytes is None:
            return p
        return await fetch(pool, p, piece_bytes, timeout=timeout)

    return await gather_or_stop(whole(p) for p in params)


async def gather_all(calls: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` of ``calls``, except that the first failure is raised only
    once every call has ended.

    For the parts of one write: a caller told it failed sends it again, and a
    part still under way when it does (at a node that has not remembered yet
    what it applied under the write's id) could be applied twice.
    """
    answers = await asyncio.gather(*calls, return_exceptions=True)
    failed = next((a for a in answers if isinstance(a, BaseException)), None)
    if failed is None:
        return answers  # type: ignore[return-value]
    # The error's traceback holds this frame: it must not hold the error (nor the
    # others, whose frames hold the parts' bytes), or the two are a cycle.
    answers.clear()
    try:
        raise failed
    finally:
        del failed


async def gather_or_stop(calls: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` of ``calls``, except that when one fails the others stop.

    They are cancelled and waited for before the first failure is raised, so
    nothing of a failed upload or read goes on once its caller has been told it
    failed: no piece of the caller's array is sent later (the caller may reuse
    the array), and no piece is read into a buffer it has dropped.
    """
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await _stop(tasks)
        tasks.clear()  # (the error's traceback holds this frame, a task the error: a cycle)
        raise


async def _stop(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until each has ended."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def fetch(
    client: Any,
    header: Any,
    piece_bytes: int = PIECE_BYTES,
    *,
    timeout: Any = ...,
    as_stored: bool | None = None,
) -> Any:
    """Read a parameter a node answered without data (its ``total_bytes`` set), in pieces.

    Args:
        client: a :class:`~aioparamsync.client.ParameterClient` (or anything
            with its ``invoke``).
        header: the ``Parameter`` the node answered: name, version, total_bytes.
        piece_bytes: the size of each piece asked for.
        timeout: each read's, as ``client.invoke`` takes it (the whole read's
            deadline is its caller's).
        as_stored: read what the node stores, never passed on (``ParameterRequest.as_stored``:
            a peer's repair).

    Returns:
        The whole ``Parameter``: its data one writable numpy buffer's bytes.

    Raises:
        RequestError: (UNAVAILABLE) the parameter changed under every try;
            or what the node answered.
    """
    name = header.name
    for _ in range(FETCH_TRIES):
        buffer, versions = await _read_pieces(client, header, piece_bytes, timeout, as_stored)
        if versions == {(header.version, header.origin)}:
            return thrift.Parameter(
                name=name,
                data=memoryview(cast(Any, buffer)),
                version=header.version,
                dtype=header.dtype,
                shape=header.shape,
                origin=header.origin,
                rule=header.rule,
            )
        # It changed while we read: read the newest whole again.
        response = await client.invoke(
            METHODS.pull_parameters,
            timeout=timeout,
            request=thrift.ParameterRequest(
                param_names=[name], max_inline_bytes=0, as_stored=as_stored
            ),
        )
        if not response.params:
            raise RequestError(ErrorCode.UNKNOWN_PARAMETER, f"{name!r} is gone")
        header = response.params[0]
    raise RequestError(
        ErrorCode.UNAVAILABLE, f"{name!r} changed during each of {FETCH_TRIES} reads of it"
    )


async def _read_pieces(
    client: Any, header: Any, piece_bytes: int, timeout: Any, as_stored: bool | None
) -> tuple[np.ndarray, set[tuple[int, str]]]:
    """Every piece of ``header``'s parameter, into one buffer; and the versions they had."""
    name, total = header.name, header.total_bytes
    buffer = np.empty(total, np.uint8)
    versions: set[tuple[int, str]] = set()
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def piece(offset: int) -> None:
        async with gate:
            request = thrift.ParameterRequest(
                param_names=[name],
                piece_offset=offset,
                piece_bytes=piece_bytes,
                as_stored=as_stored,
            )
            response = await client.invoke(
                METHODS.pull_parameters, timeout=timeout, request=request
            )
        if not response.params:
            raise RequestError(ErrorCode.UNKNOWN_PARAMETER, f"{name!r} is gone")
        p = response.params[0]
        data = memoryview(p.data).cast("B")
        if p.offset != offset or p.total_bytes != total or offset + data.nbytes > total:
            versions.add((-1, "changed size"))
            return
        versions.add((p.version, p.origin))
        buffer[offset : offset + data.nbytes] = np.frombuffer(data, np.uint8)

    await gather_or_stop(piece(o) for o in range(0, total, piece_bytes))
    return buffer, versions
