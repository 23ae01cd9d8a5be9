"""The rows of embedding tables waiting for one peer: a link's second outbox.

A table's rows are keys too (a bucket of rows is placed as a parameter is:
see :func:`aioparamsync.placement.bucket_key`), and they reach their replicas
the way parameters do: offered to the link of each replica as they are
folded, sent by the link's own task on its replication lane (see
:mod:`.links`), confirmed by the link's ping for ``acks=all``, kept for the
next connection when a send fails.

Backpressure: what waits is, per bucket, the ids of the rows changed, not
the rows: the rows are read from the table when the link sends them, so a
lagging peer gets the newest of each row once, however often it changed,
and a slow or dead peer costs at most one id per row of the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ..store.rows import RowTable

__all__ = ["RowOutbox"]

# Most bytes of rows (values and state) in one replication message.
ROWS_BATCH_BYTES = 16 * 1024 * 1024

# (table name, bucket) -> the table, the ids of its rows changed
Waiting = dict[tuple[str, int], tuple["RowTable", np.ndarray]]


class RowOutbox:
    """Changed rows by bucket, for one peer (see the module)."""

    def __init__(self) -> None:
        self.waiting: Waiting = {}
        self.rows_coalesced = 0  # rows offered again while they waited

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def __len__(self) -> int:
        return len(self.waiting)

    def offer(self, table: RowTable, bucket: int, ids: np.ndarray) -> None:
        """Note that rows ``ids`` of ``bucket`` of ``table`` changed (never blocks)."""
        key = (table.spec.name, bucket)
        held = self.waiting.get(key)
        if held is not None:
            union = np.union1d(held[1], ids)
            self.rows_coalesced += len(held[1]) + len(ids) - len(union)
            ids = union
        self.waiting[key] = (table, ids)

    def take(self) -> Waiting:
        """Everything waiting, and the outbox empty."""
        taken, self.waiting = self.waiting, {}
        return taken

    def put_back(self, taken: Waiting) -> None:
        """What a send took and did not send: waiting again (with what came meanwhile)."""
        for (_, bucket), (table, ids) in taken.items():
            key = (table.spec.name, bucket)
            held = self.waiting.get(key)
            self.waiting[key] = (table, ids if held is None else np.union1d(held[1], ids))

    @staticmethod
    def messages(taken: Waiting, me: str) -> Iterator[list[Any]]:
        """The replication messages of ``taken``: each a list of deltas (the IDL's
        ``RowDelta``), read from the tables now, of ``ROWS_BATCH_BYTES`` at most."""
        deltas: list[Any] = []
        size = 0
        for key, (table, ids) in taken.items():
            per_row = table.spec.row_bytes
            step = max(1, ROWS_BATCH_BYTES // per_row)
            for start in range(0, len(ids), step):
                part = ids[start : start + step]
                if deltas and size + len(part) * per_row > ROWS_BATCH_BYTES:
                    yield deltas
                    deltas, size = [], 0
                deltas.append(table.delta(key[1], part, me))
                size += len(part) * per_row
        if deltas:
            yield deltas
