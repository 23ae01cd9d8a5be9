"""Embedding tables' rows through memory shared with the node (``pull_rows``,
``push_row_gradients`` and ``assign_rows`` of a client on the node's host).

Real nodes in this process, real Unix sockets, real memfd segments: rows pulled and pushed so
give what TCP gives; rows pulled stay as they were while later pulls come; small or encoded
rows go in the message; and what goes wrong: rows in shared memory over TCP, a region that is
not the client's, a region the node cannot map, an answer outside the region lent, a node
that answers in the message.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from aioparamsync import ErrorCode, Node, ParameterClient, RemoteProtocolError, RequestError, sgd
from aioparamsync.client.shared import DECLINES, Lane, Segment
from aioparamsync.values.rowwire import encode_ids
from aioparamsync.wire import METHODS, thrift

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux's memfd")

DIM = 64
IDS = np.arange(0, 20_000, 2, dtype=np.int64)  # (10,000 rows of 256 bytes: 2.5 MiB)


@contextlib.asynccontextmanager
async def _clients(tmp_path: Path) -> AsyncIterator[tuple[ParameterClient, ParameterClient]]:
    """A client on the node's Unix socket, and one held to TCP (``shared_memory=0``)."""
    path = str(tmp_path / "node.sock")
    async with (
        Node(port=0, unix_socket=path) as node,
        ParameterClient(f"unix:{path}", timeout=20.0) as local,
        ParameterClient(node.address, timeout=20.0, shared_memory=0) as tcp,
    ):
        yield local, tcp


def _lane(client: ParameterClient) -> dict:
    return client.stats()["shared_memory"]


async def test_rows_through_shared_memory_give_what_tcp_gives(tmp_path: Path) -> None:
    async with _clients(tmp_path) as (local, tcp):
        await tcp.create_table("emb", DIM, init="normal", seed=3, rule=sgd(0.5))
        want = await tcp.pull_rows("emb", IDS)
        got = await local.pull_rows("emb", IDS)
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable and _lane(local)["reads"] == 1
        grads = np.random.default_rng(1).standard_normal((len(IDS), DIM)).astype(np.float32)
        result = await local.push_row_gradients("emb", IDS, grads)
        assert (result.rows, _lane(local)["pushes"]) == (len(IDS), 1)
        np.testing.assert_allclose(await tcp.pull_rows("emb", IDS), want - 0.5 * grads, rtol=1e-6)
        # repeated ids (summed first), a strided array of gradients, and rows set
        twice = np.concatenate([IDS, IDS[:100]])
        strided = np.ones((len(twice), 2 * DIM), np.float32)[:, ::2]
        await local.push_row_gradients("emb", twice, strided)
        expect = want - 0.5 * grads - 0.5
        expect[:100] -= 0.5
        np.testing.assert_allclose(await local.pull_rows("emb", IDS), expect, rtol=1e-6)
        await local.assign_rows("emb", IDS, np.full((len(IDS), DIM), 7.0, np.float32))
        assert (await tcp.pull_rows("emb", IDS) == 7.0).all()
        assert _lane(local)["pushes"] == 3 and _lane(local)["kept"] == 0
        # few rows (under 16 KiB) and encoded rows go in the message, as over TCP
        reads = _lane(local)["reads"]
        np.testing.assert_array_equal(
            await local.pull_rows("emb", IDS[:10]), await tcp.pull_rows("emb", IDS[:10])
        )
        half = await local.pull_rows("emb", IDS, encoding="fp16")
        assert half.dtype == np.float32 and (half == 7.0).all()
        assert _lane(local)["reads"] == reads
        del got, half
        gc.collect()
        assert _lane(local)["lent"] == 0


async def test_rows_pulled_are_not_written_over_by_later_pulls(tmp_path: Path) -> None:
    async with _clients(tmp_path) as (local, _):
        await local.create_table("emb", DIM, rule=sgd(1.0))
        held = []
        for _ in range(5):
            held.append(await local.pull_rows("emb", IDS))
            await local.push_row_gradients("emb", IDS, np.full((len(IDS), DIM), -1.0, np.float32))
        for step, rows in enumerate(held):
            assert (rows == step).all(), step
        assert _lane(local)["reads"] == 5 and _lane(local)["pushes"] == 5
        del held, rows
        gc.collect()
        assert _lane(local)["lent"] == 0  # (each region back once its array is gone)


def _push(table: str, ids: np.ndarray, segment: str, offset: int, size: int) -> thrift.RowPush:
    shared = thrift.SharedRegion(segment=segment, offset=offset, size=size)
    grads = thrift.Rows(count=len(ids), dim=DIM, dtype="<f4", data=b"", shared=shared)
    return thrift.RowPush(table=table, ids=encode_ids(ids), grads=grads)


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("over TCP", "reach only a node that maps the sender's memory"),
        ("not the client's", "is not that segment"),
        ("past its end", "is not within segment"),
        ("short", "are 1024 bytes, not 512"),
    ],
)
async def test_a_row_push_naming_memory_it_may_not_is_refused_and_folds_nothing(
    tmp_path: Path, how: str, says: str
) -> None:
    ids = np.arange(4, dtype=np.int64)
    async with _clients(tmp_path) as (local, tcp):
        await tcp.create_table("emb", DIM, rule=sgd(1.0))
        segment, other = Segment(1 << 16), Segment(1 << 16)
        try:
            np.frombuffer(segment.map, np.float32)[: 4 * DIM] = 1.0
            fd = segment.wire.partition(":")[0]
            push = {
                "over TCP": _push("emb", ids, segment.wire, 0, 1024),
                "not the client's": _push("emb", ids, f"{other.fd}:{segment.name}", 0, 1024),
                "past its end": _push("emb", ids, f"{fd}:{segment.name}", (1 << 16) - 512, 1024),
                "short": _push("emb", ids, segment.wire, 0, 512),
            }[how]
            client = tcp if how == "over TCP" else local
            with pytest.raises(RequestError) as info:
                await client.invoke(METHODS.push_row_gradients, push=push)
            assert info.value.code in (ErrorCode.BAD_REQUEST, ErrorCode.SHAPE_MISMATCH)
            assert says in info.value.message
            assert (await tcp.pull_rows("emb", ids) == 0).all()  # (nothing folded)
            await local.invoke(
                METHODS.push_row_gradients, push=_push("emb", ids, segment.wire, 0, 1024)
            )
            assert (await tcp.pull_rows("emb", ids) == -1.0).all()
        finally:
            segment.close()
            other.close()


async def test_a_row_pull_lending_a_region_the_node_cannot_map_is_answered_in_the_message(
    tmp_path: Path,
) -> None:
    async with _clients(tmp_path) as (local, tcp):
        await tcp.create_table("emb", DIM, init="normal")
        want = await tcp.pull_rows("emb", IDS)
        segment = Segment(1 << 22)
        try:
            for client, wire in ((local, "0:aioparamsync-0000000000000000"), (tcp, segment.wire)):
                shared = thrift.SharedRegion(segment=wire, offset=0, size=1 << 22)
                request = thrift.RowsRequest(table="emb", ids=encode_ids(IDS), shared=shared)
                answer = await client.invoke(METHODS.pull_rows, request=request)
                assert answer.shared is None
                np.testing.assert_array_equal(np.frombuffer(answer.data, "<f4"), want.ravel())
        finally:
            segment.close()


def _rows(region_of: thrift.SharedRegion | None, n: int = 100) -> thrift.Rows:
    return thrift.Rows(count=n, dim=DIM, dtype="<f4", data=b"", shared=region_of)


def test_rows_answered_outside_the_region_lent_or_where_none_was_are_refused() -> None:
    lane = Lane(1 << 30)
    try:
        region = lane.for_rows(100 * DIM * 4)
        assert region is not None and lane.for_rows(100) is None  # (too few bytes to lend)
        for offset, size, segment in (
            (region.offset + region.size - 8, 16, region.shared.segment),
            (region.offset - 64, 16, region.shared.segment),
            (region.offset, 16, "1:aioparamsync-0123456789abcdef"),
        ):
            at = thrift.SharedRegion(segment=segment, offset=offset, size=size)
            with pytest.raises(RemoteProtocolError, match="outside the region lent"):
                lane.rows_answered(region, _rows(at))
            assert lane.lent == 0  # (given back)
            region = lane.for_rows(100 * DIM * 4)
            assert region is not None
        lane.give(region)
        with pytest.raises(RemoteProtocolError, match="lent none"):
            lane.rows_answered(None, _rows(region.shared))
    finally:
        lane.close()


def test_a_node_that_answers_rows_in_the_message_is_lent_no_more() -> None:
    lane = Lane(1 << 30)
    try:
        for _ in range(DECLINES):
            region = lane.for_rows(100 * DIM * 4)
            assert region is not None
            answer = thrift.Rows(count=100, dim=DIM, dtype="<f4", data=bytes(100 * DIM * 4))
            lane.rows_answered(region, answer)
        assert lane.for_rows(100 * DIM * 4) is None and lane.made == 0
        assert lane.for_row_push(np.ones((100, DIM), np.float32)) is None
    finally:
        lane.close()
