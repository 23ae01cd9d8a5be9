"""A link's outbox of table rows: coalesced by bucket, read from the table when sent."""

from __future__ import annotations

import time

import numpy as np

from aioparamsync.cluster.rowbox import ROWS_BATCH_BYTES, RowOutbox
from aioparamsync.store.rows import RowTables, table_spec
from aioparamsync.values.rowwire import decode_ids
from aioparamsync.wire import thrift

DIM = 8


def make_table(name: str = "emb", buckets: int = 4):
    spec = table_spec(
        thrift.Table(name=name, dim=DIM, buckets=buckets, rule=thrift.Rule(kind="sgd", lr=1.0))
    )
    return RowTables().create(spec)[0]


def fold_ones(table, ids: np.ndarray) -> dict[int, np.ndarray]:
    changed, _ = table.fold(ids, np.ones((len(ids), DIM), np.float32), time.time())
    return changed


def sent_rows(box: RowOutbox) -> dict[int, float]:
    """id -> its first value, of every row the outbox's messages carry now."""
    got: dict[int, float] = {}
    for deltas in RowOutbox.messages(box.take(), "n0"):
        for delta in deltas:
            ids = decode_ids(delta.ids)
            rows = np.frombuffer(delta.rows, "<f4").reshape(len(ids), DIM)
            got.update(zip(ids.tolist(), rows[:, 0].tolist(), strict=True))
    return got


def test_rows_offered_twice_wait_once_and_go_at_their_newest() -> None:
    table = make_table()
    box = RowOutbox()
    for ids in (np.arange(10), np.arange(5, 15)):
        for bucket, changed in fold_ones(table, ids).items():
            box.offer(table, bucket, changed)
    assert box.rows_coalesced == 5  # ids 5..9 waited already
    got = sent_rows(box)
    assert sorted(got) == list(range(15))
    assert all(got[i] == (-2.0 if 5 <= i < 10 else -1.0) for i in got), got
    assert not box  # taken


def test_what_a_failed_send_took_waits_again_with_what_came_meanwhile() -> None:
    table = make_table(buckets=1)
    box = RowOutbox()
    for bucket, changed in fold_ones(table, np.arange(4)).items():
        box.offer(table, bucket, changed)
    taken = box.take()
    for bucket, changed in fold_ones(table, np.arange(2, 6)).items():
        box.offer(table, bucket, changed)  # while the send was under way
    box.put_back(taken)
    assert sorted(sent_rows(box)) == list(range(6))


def test_messages_are_bounded_in_bytes() -> None:
    table = make_table(buckets=1)
    rows = ROWS_BATCH_BYTES // table.spec.row_bytes * 2 + 7
    box = RowOutbox()
    for bucket, changed in fold_ones(table, np.arange(rows)).items():
        box.offer(table, bucket, changed)
    messages = list(RowOutbox.messages(box.take(), "n0"))
    assert len(messages) == 3
    for deltas in messages:
        assert (
            sum(len(decode_ids(d.ids)) for d in deltas) * table.spec.row_bytes <= ROWS_BATCH_BYTES
        )
    assert sum(len(decode_ids(d.ids)) for m in messages for d in m) == rows
