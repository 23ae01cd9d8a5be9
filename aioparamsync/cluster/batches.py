"""What a link sends in one message: batches of entries cut to a node's limits.

An update over ``inline_bytes`` goes alone, in pieces (see
:mod:`aioparamsync.values.pieces`); the others go together, up to a number of
parameters and of bytes (see :class:`~.membership.Cluster`'s limits).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from ..store.table import Entry
from ..values import pieces

__all__ = ["PARAM_OVERHEAD", "batches", "messages"]

# What a parameter takes in a message besides its data, name and origin (its
# dtype, shape, version, rule and upload id, and Thrift's field headers): an
# estimate on the safe side, counted when cutting batches.
PARAM_OVERHEAD = 512


def messages(entries: list[Entry], inline_bytes: int, piece_bytes: int) -> Iterable[list[Any]]:
    """The replication messages of a batch: one, or the pieces of a large parameter.

    A parameter over ``inline_bytes`` is alone in its batch (see
    :func:`batches`) and goes in pieces of ``piece_bytes``.
    """
    if len(entries) == 1 and entries[0].nbytes > inline_bytes:
        e = entries[0]
        # The same id for every resend of this version, so a receiver that has
        # some of its pieces already keeps them; hashed, as an upload id is
        # short (pieces.MAX_UPLOAD_ID_BYTES) and a name need not be.
        key = hashlib.blake2b(f"{e.origin}\0{e.version}\0{e.name}".encode(), digest_size=16)
        for piece in pieces.split(e.to_parameter(), f"peer:{key.hexdigest()}", piece_bytes):
            yield [piece]
    else:
        yield [e.to_parameter() for e in entries]


def _wire_bytes(item: Any) -> int:
    """About what an entry (or a digest item) takes in a message, data and fields."""
    return item.nbytes + len(item.name.encode()) + len(item.origin.encode()) + PARAM_OVERHEAD


def batches(items: Iterable[Any], max_items: int, max_bytes: int) -> Iterable[list[Any]]:
    """Cut ``items`` into lists of at most ``max_items`` items and ``max_bytes`` bytes.

    An item larger than ``max_bytes`` (by :func:`_wire_bytes`) is alone in its list.
    """
    batch: list[Any] = []
    size = 0
    for item in items:
        n = _wire_bytes(item)
        if batch and (len(batch) >= max_items or size + n > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch
