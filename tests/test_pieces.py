"""Parameters larger than one message, in pieces: staging, reading, the log, the cluster."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from cluster_helpers import LocalCluster, ProcessCluster, eventually
from raw_helpers import slow_link

from aioparamsync import (
    CallTimeout,
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    sum_rule,
    thrift,
)
from aioparamsync.client.fetch import fetch
from aioparamsync.values import pieces as pieces_module
from aioparamsync.values.arrays import from_parameter, to_parameter
from aioparamsync.values.pieces import Uploads, split
from aioparamsync.wire import METHODS

pytestmark = pytest.mark.timeout(60)

KIB = 1024


def whole(name: str = "w", n: int = 10_000, seed: int = 0) -> object:
    return to_parameter(name, np.random.default_rng(seed).standard_normal(n).astype(np.float32))


# -- staging --------------------------------------------------------------------------------


def test_split_cuts_views_that_cover_the_whole() -> None:
    p = whole()
    parts = split(p, "u", 4096)
    assert [q.offset for q in parts] == list(range(0, 40_000, 4096))
    assert {q.total_bytes for q in parts} == {40_000}
    assert b"".join(bytes(q.data) for q in parts) == bytes(p.data)
    assert all(
        (q.name, q.dtype, q.shape, q.upload_id) == ("w", "<f4", [10_000], "u") for q in parts
    )
    with pytest.raises(ValueError):
        split(p, "u", 0)
    p.encoding = "zlib"
    with pytest.raises(ValueError, match="pieces carry raw bytes"):
        split(p, "u", 4096)


@pytest.mark.parametrize("order", ["forward", "backward", "shuffled"])
def test_pieces_in_any_order_make_the_whole_once(order: str) -> None:
    p = whole()
    parts = split(p, "u", 3000)
    if order == "backward":
        parts.reverse()
    elif order == "shuffled":
        np.random.default_rng(3).shuffle(parts)
    uploads = Uploads()
    done = [uploads.add(q) for q in parts]
    assert all(d is None for d in done[:-1])
    made = done[-1]
    assert made is not None and made.total_bytes is None and made.offset is None
    assert bytes(made.data) == bytes(p.data) and memoryview(made.data).readonly
    np.testing.assert_array_equal(from_parameter(made), from_parameter(p))
    assert uploads.statistics() == {
        "uploads_open": 0,
        "upload_bytes_staged": 0,
        "uploads_completed": 1,
        "uploads_dropped": 0,
    }


def test_a_piece_sent_again_is_taken_once() -> None:
    parts = split(whole(), "u", 30_000)
    uploads = Uploads()
    assert uploads.add(parts[0]) is None
    assert uploads.add(parts[0]) is None  # a resend: nothing new
    assert uploads.add(parts[1]) is not None


def piece(**changes) -> object:
    p = split(whole(), "u", 16_000)[1]
    for key, value in changes.items():
        setattr(p, key, value)
    return p


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"name": ""}, ErrorCode.BAD_REQUEST),
        ({"upload_id": ""}, ErrorCode.BAD_REQUEST),
        ({"upload_id": "x" * 300}, ErrorCode.BAD_REQUEST),
        ({"offset": -1}, ErrorCode.BAD_REQUEST),
        ({"offset": 39_000}, ErrorCode.BAD_REQUEST),  # runs past the end
        ({"offset": None}, ErrorCode.BAD_REQUEST),
        ({"total_bytes": 0}, ErrorCode.BAD_REQUEST),
        ({"total_bytes": 40_001}, ErrorCode.SHAPE_MISMATCH),  # not the dtype's size
        ({"data": b""}, ErrorCode.BAD_REQUEST),
        ({"encoding": "zlib"}, ErrorCode.BAD_REQUEST),
        ({"dtype": "object"}, ErrorCode.SHAPE_MISMATCH),
    ],
)
def test_malformed_pieces_are_refused(changes: dict, code: ErrorCode) -> None:
    with pytest.raises(RequestError) as info:
        Uploads().add(piece(**changes))
    assert info.value.code == code


def test_pieces_that_disagree_or_overlap_are_refused_and_the_upload_goes_on() -> None:
    p = whole()
    parts = split(p, "u", 16_000)
    uploads = Uploads()
    uploads.add(parts[0])
    other = split(whole(seed=1), "u", 16_000)[1]
    other.version = 7
    with pytest.raises(RequestError, match="another version"):
        uploads.add(other)
    overlapping = split(p, "u", 16_000)[1]
    overlapping.offset, overlapping.data = 8_000, bytes(p.data)[8_000:24_000]
    with pytest.raises(RequestError, match="overlaps"):
        uploads.add(overlapping)
    assert uploads.add(parts[1]) is None
    made = uploads.add(parts[2])
    assert made is not None and bytes(made.data) == bytes(p.data)


def test_uploads_are_bounded_and_abandoned_ones_dropped() -> None:
    clock = [1000.0]
    uploads = Uploads(max_bytes=50_000, timeout=60, clock=lambda: clock[0])
    uploads.add(split(whole(), "a", 16_000)[0])
    with pytest.raises(RequestError) as info:
        uploads.add(split(whole("v"), "b", 16_000)[0])
    assert info.value.code == ErrorCode.LIMIT_EXCEEDED
    assert uploads.statistics()["upload_bytes_staged"] == 40_000
    clock[0] += 59
    uploads.add(split(whole(), "a", 16_000)[1])  # seen now: kept
    assert uploads.statistics()["uploads_open"] == 1
    clock[0] += 61
    uploads.sweep()
    assert uploads.statistics()["uploads_open"] == 0
    assert uploads.statistics()["uploads_dropped"] == 1
    uploads.add(split(whole("v"), "b", 16_000)[0])  # room again


# -- a live node ----------------------------------------------------------------------------


async def test_an_abandoned_upload_is_dropped_though_no_piece_follows(node: Node) -> None:
    node.service.uploads.timeout = 0.2
    first = split(to_parameter("big", np.ones(1000, np.float32)), "abandoned", 1000)[0]
    async with ParameterClient(node.address) as c:  # 1 piece of 4, then the caller is gone
        await c.call("push_parameters", update=thrift.ParameterUpdate(params=[first], timestamp=1))
    assert node.service.uploads.statistics()["uploads_open"] == 1

    async def dropped() -> None:
        stats = node.service.uploads.statistics()
        assert stats["uploads_open"] == 0 and stats["upload_bytes_staged"] == 0
        assert stats["uploads_dropped"] == 1

    await eventually(dropped, timeout=5)


async def test_a_node_puts_pieces_together_and_reads_them_out(
    node: Node, client: ParameterClient
) -> None:
    p = whole(n=100_000)
    p.rule = sum_rule()
    parts = split(p, "up-1", 64 * KIB)
    for q in parts[:-1]:
        versions = await client.update_parameters([q])
        assert versions == {}  # not whole yet: nothing applied
        assert (await client.get_parameters(["w"])).params == []
    assert await client.update_parameters([parts[-1], whole("small", 3)]) == {"w": 1, "small": 1}
    assert node.service.uploads.statistics()["uploads_completed"] == 1

    # Larger than max_inline_bytes: a header, then its pieces.
    request = thrift.ParameterRequest(param_names=["w", "small"], max_inline_bytes=1000)
    response = await client.call("pull_parameters", request=request)
    header, small = response.params
    assert (header.data, header.total_bytes, header.version, header.dtype) == (
        b"",
        400_000,
        1,
        "<f4",
    )
    assert header.rule == sum_rule() and small.total_bytes is None and len(small.data) == 12
    got = await fetch(client, header, 50_000)
    np.testing.assert_array_equal(from_parameter(got), from_parameter(p))
    # One piece, at most what remains.
    request = thrift.ParameterRequest(param_names=["w"], piece_offset=390_000, piece_bytes=50_000)
    (last,) = (await client.call("pull_parameters", request=request)).params
    assert (last.offset, last.total_bytes, len(last.data)) == (390_000, 400_000, 10_000)
    assert bytes(last.data) == bytes(p.data)[390_000:]


@pytest.mark.parametrize(
    "request_",
    [
        thrift.ParameterRequest(param_names=["w", "v"], piece_offset=0, piece_bytes=10),
        thrift.ParameterRequest(param_names=[], all_names=True, piece_offset=0, piece_bytes=10),
        thrift.ParameterRequest(param_names=["w"], piece_offset=0),
        thrift.ParameterRequest(param_names=["w"], piece_offset=0, piece_bytes=0),
        thrift.ParameterRequest(param_names=["w"], piece_offset=-1, piece_bytes=10),
        thrift.ParameterRequest(param_names=["w"], piece_offset=40_000, piece_bytes=10),
        thrift.ParameterRequest(param_names=["w"], piece_offset=0, piece_bytes=2**40),
    ],
)
async def test_bad_piece_reads_are_refused(client: ParameterClient, request_) -> None:
    await client.update_parameters([whole()])
    with pytest.raises(RequestError) as info:
        await client.call("pull_parameters", request=request_)
    assert info.value.code == ErrorCode.BAD_REQUEST


async def test_a_piece_read_of_a_missing_name_answers_nothing(client: ParameterClient) -> None:
    request = thrift.ParameterRequest(param_names=["nope"], piece_offset=0, piece_bytes=10)
    assert (await client.call("pull_parameters", request=request)).params == []


async def test_fetch_starts_over_when_the_parameter_changes_while_read(
    client: ParameterClient,
) -> None:
    await client.update_parameters([whole(n=50_000)])
    request = thrift.ParameterRequest(param_names=["w"], max_inline_bytes=0)
    (header,) = (await client.call("pull_parameters", request=request)).params

    class Changing:
        """Calls through to the node; after the first piece read, changes the parameter."""

        changed = False

        async def invoke(self, m, **args):
            result = await client.invoke(m, **args)
            if args["request"].piece_offset is not None and not self.changed:
                self.changed = True
                await client.update_parameters([whole(n=50_000, seed=9)])
            return result

    got = await fetch(Changing(), header, 20_000)
    assert got.version == 2
    assert bytes(got.data) == bytes(whole(n=50_000, seed=9).data)


# -- the log and the cluster, with small pieces ------------------------------------------


@pytest.fixture
def small_pieces(monkeypatch) -> None:
    """Parameters over 64 KiB travel (and are logged) in 16 KiB pieces."""
    monkeypatch.setattr(pieces_module, "INLINE_BYTES", 64 * KIB)
    monkeypatch.setattr(pieces_module, "PIECE_BYTES", 16 * KIB)


async def test_large_parameters_are_logged_in_pieces_and_recovered(small_pieces, tmp_path) -> None:
    big, small = whole("big", 100_000), whole("small", 10)
    async with Node("127.0.0.1", 0, data_dir=tmp_path) as node:
        async with ParameterClient(node.address) as client:
            await client.update_parameters([big, small])
        records = node.data_dir.records_written
    assert records == 1 + 25  # the small one, then 400 000 bytes in 16 KiB pieces
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address) as client,
    ):
        got = await client.get_parameters(["big", "small"])
    assert {p.name: bytes(p.data) for p in got.params} == {
        "big": bytes(big.data),
        "small": bytes(small.data),
    }


async def test_peers_send_and_repair_large_parameters_in_pieces(small_pieces) -> None:
    cluster = LocalCluster()
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await cluster.formed([a, b])
        big = whole("big", 100_000)
        async with ParameterClient(a.address, route=False) as client:  # (written at a)
            await client.update_parameters([big])

        def replicated() -> None:
            entry = b.store.table.entry("big")
            assert entry is not None and bytes(entry.data) == bytes(big.data)

        await eventually(replicated)
        assert b.service.uploads.statistics()["uploads_completed"] == 1
        # A node that joins later gets it by repair (a digest, then pieces).
        c = await cluster.start(peers=[a])

        def repaired() -> None:
            entry = c.store.table.entry("big")
            assert entry is not None and bytes(entry.data) == bytes(big.data)

        await eventually(repaired)
    finally:
        await cluster.close()


async def test_the_cli_bounds_the_bytes_staged() -> None:
    procs = ProcessCluster()
    try:
        node = await procs.spawn(extra=["--max-upload-bytes", "100KiB"])
        async with node.client() as client:
            parts = split(whole(n=50_000), "u", 64 * KIB)  # 200 000 bytes
            with pytest.raises(RequestError) as info:
                await client.update_parameters([parts[0]])
            assert info.value.code == ErrorCode.LIMIT_EXCEEDED
            assert "102400" in str(info.value)
            assert (await client.info()).counters["uploads_open"] == 0
    finally:
        await procs.close()


# -- the client -----------------------------------------------------------------------------


async def test_the_client_sends_and_reads_large_parameters_in_pieces(node: Node) -> None:
    big = np.random.default_rng(5).standard_normal((300, 100)).astype(np.float32)  # 120 000 B
    async with ParameterClient(node.address, max_inline_bytes=50_000, piece_bytes=16_000) as c:
        versions = await c.update_arrays({"big": big, "small": np.arange(3)})
        assert versions == {"big": 1, "small": 1}
        assert node.service.uploads.statistics()["uploads_completed"] == 1
        got = await c.get_arrays(["big", "small", "missing"])
        assert sorted(got) == ["big", "small"]
        np.testing.assert_array_equal(got["big"], big)
        assert got["big"].shape == (300, 100) and got["big"].dtype == np.float32
        np.testing.assert_array_equal(got["small"], np.arange(3))
        assert (await c.update_arrays({"big": big * 2})) == {"big": 2}
        np.testing.assert_array_equal((await c.get_arrays(["big"]))["big"], big * 2)
    # A client that reads whole messages gets it whole (it is under 2 GiB).
    async with ParameterClient(node.address) as whole_reader:
        np.testing.assert_array_equal((await whole_reader.get_arrays(["big"]))["big"], big * 2)


async def test_a_piece_that_fails_stops_the_others(node: Node) -> None:
    w = np.ones(64 * 1024, np.float32)  # 256 KiB: 16 pieces of 16 KiB
    async with ParameterClient(
        node.address, max_inline_bytes=64 * 1024, piece_bytes=16 * 1024
    ) as c:
        await c.ping()

        def sending() -> list[asyncio.Task]:
            return [
                t
                for t in asyncio.all_tasks()
                if "update_parameters.<locals>.send" in t.get_coro().__qualname__ and not t.done()
            ]

        with pytest.raises(CallTimeout):
            await c.update_arrays({"w": w}, timeout=0.0001)
        assert sending() == []  # nothing of the failed call goes on
        w[:] = 7  # so the caller may reuse its array
        await asyncio.sleep(0.3)
        got = await c.get_arrays(["w"])
        assert "w" not in got or np.unique(got["w"]).size == 1  # never a torn array


async def test_a_read_in_pieces_keeps_the_calls_deadline(node: Node) -> None:
    small = {"max_inline_bytes": 64 * 1024, "piece_bytes": 16 * 1024}
    async with ParameterClient(node.address, **small) as c:
        await c.update_arrays({"w": np.arange(64 * 1024, dtype=np.float32)})  # 16 pieces

    async with (
        slow_link(node.address, reply_delay=0.2) as address,  # each reply 0.2 s late
        ParameterClient(address, **small) as c,
    ):
        started = time.monotonic()
        with pytest.raises(CallTimeout, match=r"within 0\.5 s"):
            await c.get_arrays(["w"], timeout=0.5)
        assert time.monotonic() - started < 0.5 + 0.3  # not a piece's own timeout later


@pytest.mark.parametrize("encoding", ["fp16", "zlib"])
async def test_an_encoded_parameter_too_large_for_one_message_goes_raw_in_pieces(
    node: Node, encoding: str
) -> None:
    big = np.random.default_rng(6).standard_normal(50_000).astype(np.float32)  # 200 000 B
    # Encoded, still over max_inline_bytes (fp16: 100 000 B; zlib barely shrinks noise).
    async with ParameterClient(node.address, max_inline_bytes=50_000, piece_bytes=16_000) as c:
        assert await c.update_arrays({"big": big}, encoding=encoding, rules=sum_rule()) == {
            "big": 1
        }
        assert node.service.uploads.statistics()["uploads_completed"] == 1
        got = await c.get_arrays(["big"])
        np.testing.assert_array_equal(got["big"], big)  # raw: exact, not rounded to fp16
        assert node.store.table.entry("big").rule == sum_rule()


def test_client_piece_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ParameterClient("127.0.0.1:1", piece_bytes=0)
    with pytest.raises(ValueError):
        ParameterClient("127.0.0.1:1", piece_bytes=2**40)
    with pytest.raises(ValueError):
        ParameterClient("127.0.0.1:1", max_inline_bytes=-1)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_parameter_larger_than_2_gib(node: Node) -> None:
    """More than a Thrift binary (and a frame) can hold: in pieces both ways, whole at the end."""
    n = (2**31 + 64 * 1024**2) // 8  # 2 GiB + 64 MiB
    big = np.arange(n, dtype=np.uint64)
    async with ParameterClient(node.address, timeout=240) as client:
        assert await client.update_arrays({"huge": big}) == {"huge": 1}
        # Stored as partitions (see aioparamsync.values.partitions): every byte held.
        table = node.store.table
        held = [table.entry(k) for k in table.names() if k.startswith("huge\x00#")]
        assert sum(e.nbytes for e in held if e is not None) > big.nbytes
        del held
        got = (await client.get_arrays(["huge"]))["huge"]
        assert got.shape == (n,) and got.dtype == np.uint64
        assert np.array_equal(got, big)
        del got
        # A client that cannot take pieces is told why, not sent a broken message.
        request = thrift.ParameterRequest(param_names=["huge"])
        with pytest.raises(RequestError) as info:
            await client.call("pull_parameters", request=request)
        assert info.value.code == ErrorCode.LIMIT_EXCEEDED
        assert "in pieces" in str(info.value)


def test_the_table_refuses_a_piece_that_was_not_put_together() -> None:
    from aioparamsync.store.table import ParameterTable

    table = ParameterTable("n")
    with pytest.raises(RequestError, match="piece"):
        table.apply([split(whole(), "u", 16_000)[0]], 1)
    assert len(table) == 0


@pytest.mark.asyncio
async def test_a_read_of_many_parameters_answers_those_past_max_inline_bytes_as_headers() -> None:
    # (a whole model from one node: no answer outgrows a message; the client reads the rest)
    async with (
        Node("127.0.0.1", 0) as node,
        ParameterClient(node.address, max_inline_bytes=1 << 20, piece_bytes=1 << 18) as client,
    ):
        arrays = {f"p{i}": np.full(65536, i, np.float32) for i in range(8)}  # 256 KiB each
        await client.update_arrays(arrays)
        request = thrift.ParameterRequest(param_names=list(arrays), max_inline_bytes=1 << 20)
        answer = await client.invoke(METHODS.pull_parameters, request=request)
        inline = [p for p in answer.params if p.total_bytes is None]
        headers = [p for p in answer.params if p.total_bytes is not None]
        assert sum(len(p.data) for p in inline) <= 1 << 20
        assert (len(inline), len(headers)) == (4, 4)
        assert all(p.total_bytes == 1 << 18 and not p.data for p in headers)
        got = await client.get_arrays(list(arrays))
        for name, value in arrays.items():
            np.testing.assert_array_equal(got[name], value)
        # A caller that reads no pieces (no max_inline_bytes) is answered everything, as before.
        request = thrift.ParameterRequest(param_names=list(arrays))
        answer = await client.invoke(METHODS.pull_parameters, request=request)
        assert all(p.total_bytes is None for p in answer.params)
