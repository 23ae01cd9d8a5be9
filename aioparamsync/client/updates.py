"""What the client sends to change parameters: updates made of arrays, large ones in pieces.

:func:`make_update` makes the ``ParameterUpdate`` that
:meth:`~aioparamsync.client.ParameterClient.update_parameters` and
``broadcast_update`` send, from ``Parameter`` objects or arrays: each with
its rule, its encoding and whether it replaces the stored layout.
:func:`push_in_pieces` sends an update that holds parameters larger than one
message: each of those in pieces (see :mod:`aioparamsync.values.pieces`),
which the node applies once it is whole. (:mod:`.fetch` reads them back.)
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ..values import pieces
from ..values.arrays import to_parameter, to_parameters
from ..wire import METHODS, thrift
from .fetch import FETCH_CONCURRENCY, gather_or_stop

__all__ = ["make_update", "push_in_pieces"]


def make_update(
    params: Iterable[Any] | Mapping[str, Any],
    timestamp: int | None,
    *,
    rules: Any = None,
    encoding: str | None = None,
    replace: bool | Collection[str] = False,
) -> Any:
    """The ``ParameterUpdate`` of ``params``: ``Parameter`` objects, or a mapping of name -> array.

    Args:
        params: what to update.
        timestamp: the update's (None: now, in milliseconds).
        rules: one rule for every parameter, or a mapping of name -> rule.
        encoding: encode each array so (``params`` must then be a mapping).
        replace: True, False or the names of the parameters whose layout may
            change (see :meth:`~aioparamsync.client.ParameterClient.update_parameters`).

    Raises:
        TypeError: an encoded update of no mapping, or a ``replace`` that is
            no collection of names.
        ValueError: the ``"topk"`` encoding (for gradients only), or a
            ``replace`` that names a parameter the update does not hold.
    """
    if timestamp is None:
        timestamp = time.time_ns() // 1_000_000
    if encoding is not None:
        if not isinstance(params, Mapping):
            raise TypeError("an encoded update takes a mapping of name -> array")
        from ..values import compression

        if encoding == "topk":
            raise ValueError(compression.TOPK_IS_FOR_GRADIENTS)

        updates = [compression.encode(n, a, encoding) for n, a in params.items()]
    else:
        updates = to_parameters(params)
    if rules is not None:
        for p in updates:
            rule = rules.get(p.name) if isinstance(rules, Mapping) else rules
            if rule is not None:
                p.rule = rule
    if replace is True:
        for p in updates:
            p.replace = True
    elif replace is not False:
        names = _replaced_names(replace, {p.name for p in updates})
        for p in updates:
            if p.name in names:
                p.replace = True
    return thrift.ParameterUpdate(params=updates, timestamp=timestamp)


def _replaced_names(replace: Any, names: set[str]) -> set[str]:
    """The names ``replace`` (a collection of names) asks to replace, all in the update."""
    if isinstance(replace, str | bytes) or not isinstance(replace, Iterable):
        raise TypeError(
            f"replace is True, False or a collection of parameter names, not {replace!r}"
        )
    asked = set(replace)
    if not all(isinstance(n, str) for n in asked):
        raise TypeError("replace names parameters by their names (str)")
    if missing := asked - names:
        raise ValueError(f"replace names parameters the update does not hold: {sorted(missing)}")
    return asked


async def push_in_pieces(
    client: Any,
    update: Any,
    large: list[Any],
    params: Iterable[Any] | Mapping[str, Any],
    *,
    timeout: Any,
) -> dict[str, int]:
    """Send ``update``, which holds parameters larger than one message; answer their versions.

    Each of ``large`` goes in pieces of ``client.piece_bytes``, and the node
    applies it once it is whole: atomically by itself. The others go first,
    together, as one update.

    Args:
        client: a :class:`~aioparamsync.client.ParameterClient`.
        update: the ``ParameterUpdate`` (see :func:`make_update`); its
            ``params`` are changed.
        large: its parameters larger than ``client.max_inline_bytes``.
        params: what the update was made of: an encoded parameter still too
            large goes raw, from its array there.
        timeout: each message's, as ``client.invoke`` takes it.
    """
    versions: dict[str, int] = {}
    small = [p for p in update.params if memoryview(p.data).nbytes <= client.max_inline_bytes]
    if small:
        update.params = small
        result = await client.invoke(METHODS.push_parameters, timeout=timeout, update=update)
        versions.update(result.versions)
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def send(piece: Any) -> dict[str, int]:
        async with gate:
            message = thrift.ParameterUpdate(
                params=[piece], timestamp=update.timestamp, acks=update.acks
            )
            result = await client.invoke(METHODS.push_parameters, timeout=timeout, update=message)
        return dict(result.versions)

    for p in large:
        if p.encoding:
            # Pieces carry raw bytes (see pieces.split): too large even
            # encoded, this parameter goes raw.
            rule, replaced = p.rule, p.replace
            p = to_parameter(p.name, params[p.name])  # type: ignore[index]
            p.rule, p.replace = rule, replaced
        # (A piece that fails stops the others: none is sent after the
        # caller is told, so the node never puts together a torn array.)
        for done in await gather_or_stop(
            map(send, pieces.split(p, uuid.uuid4().hex, client.piece_bytes))
        ):
            versions.update(done)
    return versions
