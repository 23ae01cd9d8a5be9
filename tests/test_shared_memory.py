"""Colocated workers through memory shared with their node (``aioparamsync.client.shared``).

Real nodes (in this process, and one as a process of its own), real Unix
sockets in a temporary directory, real memfd segments: reads and pushes give
the same values as over TCP; arrays read stay as they were while later reads
come; and what goes wrong: a region or segment that is not the client's, a
push naming shared memory over TCP, an answer outside the region lent, a
limit too small, a call that fails, bad arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import mmap
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import assert_, eventually, launch

from aioparamsync import ErrorCode, Node, ParameterClient, RemoteProtocolError, RequestError, sgd
from aioparamsync.client.shared import Lane, Segment, lane_for
from aioparamsync.values.sharedmem import ALIGN, SharedView, aligned, pack_into, parse_segment
from aioparamsync.wire import METHODS, thrift

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux's memfd")

CALL_TIMEOUT = 20.0


def _model() -> dict[str, np.ndarray]:
    """Several dtypes and shapes, small and large (the largest stored as partitions)."""
    rng = np.random.default_rng(5)
    out = {f"w/{i}": rng.standard_normal(50 + i, dtype=np.float32) for i in range(12)}
    out["m"] = rng.standard_normal((6, 7))
    out["h"] = rng.standard_normal(16).astype(np.float16)
    out["scalar"] = np.array(2.5, np.float32)
    out["big"] = rng.standard_normal(3 << 20, dtype=np.float32)  # (12 MiB: partitioned)
    out["mid"] = rng.standard_normal((300, 300), dtype=np.float32)
    return out


def _grads(model: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    return {n: np.full(a.shape, 0.25 * (step + 1), a.dtype) for n, a in model.items()}


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name], a, err_msg=name)


@contextlib.asynccontextmanager
async def _node(tmp_path: Path) -> AsyncIterator[tuple[Node, str]]:
    path = str(tmp_path / "node.sock")
    async with Node(port=0, unix_socket=path) as node:
        yield node, f"unix:{path}"


def _memfds() -> list[str]:
    """The segments this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if (link := os.readlink(f"/proc/self/fd/{fd}")).startswith("/memfd:aioparamsync-"):
                out.append(link)
    return out


async def test_reads_and_pushes_through_shared_memory_give_what_tcp_gives(tmp_path: Path) -> None:
    model = _model()
    async with (
        _node(tmp_path) as (node, local),
        ParameterClient(local, timeout=CALL_TIMEOUT) as shared,
        ParameterClient(node.address, timeout=CALL_TIMEOUT) as remote,
    ):
        await remote.update_arrays(model, rules=sgd(0.5))
        _same(await shared.get_arrays(list(model)), model)  # (its size learnt: over the socket)
        assert shared.stats()["shared_memory"]["reads"] == 0
        for step in range(3):
            got = await shared.get_arrays(list(model))
            _same(got, await remote.get_arrays(list(model)))
            assert all(not a.flags.writeable for a in got.values())
            versions = await shared.push_gradients(_grads(model, step))
            assert versions == {n: step + 2 for n in model}
        stats = shared.stats()["shared_memory"]
        assert stats["reads"] == 3 and stats["pushes"] == 3 and stats["kept"] == 0
        want = {n: a - sum(0.5 * 0.25 * (s + 1) for s in range(3)) for n, a in model.items()}
        got = await remote.get_arrays(list(model))
        for name, a in want.items():
            np.testing.assert_allclose(got[name], a.astype(model[name].dtype), rtol=1e-3)
        # every name at once (all_names), and a read of a few, go so too
        everything = await shared.get_parameters(None, rules=False, packed=True)
        everything = await shared.get_parameters(None, rules=False, packed=True)
        names = [n for b in everything.packed for n in b.names]
        assert sorted(names + [p.name for p in everything.params]) == sorted(model)
        in_shared = {
            n for b in everything.packed if isinstance(b.data, np.ndarray) for n in b.names
        }
        assert in_shared == {"big", "mid"}  # (views of shared memory; the small ones sent)
        assert shared.stats()["shared_memory"]["reads"] == 4
        del everything, got
        gc.collect()
    # (closed with the client, and unmapped by the node once the connection is)
    await eventually(lambda: assert_(_memfds() == []))


async def test_arrays_read_are_not_written_over_by_later_reads(tmp_path: Path) -> None:
    names = ["a", "b"]
    async with _node(tmp_path) as (_, local), ParameterClient(local) as client:
        await client.update_arrays({n: np.zeros(1 << 20, np.float32) for n in names}, rules=sgd(1))
        await client.get_arrays(names)
        held = []
        for _ in range(6):
            held.append(await client.get_arrays(names))
            await client.push_gradients({n: np.full(1 << 20, -1.0, np.float32) for n in names})
        for step, arrays in enumerate(held):
            assert all((a == step).all() for a in arrays.values()), step
        lane = client.stats()["shared_memory"]
        assert lane["reads"] == 6 and lane["lent"] >= 6 * 2 * (4 << 20)
        del held, arrays
        gc.collect()
        assert client.stats()["shared_memory"]["lent"] == 0  # (back once the arrays are gone)
        await client.get_arrays(names)
        assert client.stats()["shared_memory"]["segments"] == lane["segments"]  # (used again)


async def test_a_node_process_shares_memory_with_its_clients(tmp_path: Path) -> None:
    path = str(tmp_path / "node.sock")
    proc = await launch("--port", "0", "--unix-socket", path)
    try:
        await proc.wait_listening()
        model = {"w": np.arange(1 << 20, dtype=np.float32), "v": np.ones((3, 4))}
        async with (
            ParameterClient(f"unix:{path}", timeout=CALL_TIMEOUT) as a,
            ParameterClient(f"unix:{path}", timeout=CALL_TIMEOUT) as b,
        ):
            await a.update_arrays(model, rules=sgd(1.0))
            for client in (a, b, a, b):
                await client.get_arrays(list(model))
                await client.push_gradients({n: np.ones_like(x) for n, x in model.items()})
            got = await b.get_arrays(list(model))
            _same(got, {n: x - 4 for n, x in model.items()})
            for client in (a, b):
                stats = client.stats()["shared_memory"]
                assert stats["reads"] >= 1 and stats["pushes"] >= 1, stats
    finally:
        await proc.close()


async def test_a_client_over_tcp_or_of_several_kinds_of_address_shares_nothing(
    tmp_path: Path,
) -> None:
    async with _node(tmp_path) as (node, local):
        host, port = node.address
        for address in (node.address, f"{local},{host}:{port}"):
            async with ParameterClient(address) as client:
                assert client._lane is None and "shared_memory" not in client.stats()
        async with ParameterClient(local, shared_memory=0) as client:
            assert client._lane is None


@pytest.mark.parametrize("limit", [-1, 1.5, True, "1G", None])
def test_shared_memory_is_a_number_of_bytes(limit: object) -> None:
    with pytest.raises(ValueError, match="shared_memory is a number of bytes"):
        ParameterClient("unix:/nonexistent.sock", shared_memory=limit)  # type: ignore[arg-type]


async def test_reads_larger_than_the_limit_go_over_the_socket(tmp_path: Path) -> None:
    model = {"w": np.arange(1 << 20, dtype=np.float32)}
    async with _node(tmp_path) as (_, local), ParameterClient(local, shared_memory=1 << 20) as c:
        await c.update_arrays(model, rules=sgd(1.0))
        for _ in range(3):
            _same(await c.get_arrays(["w"]), model)
        assert c.stats()["shared_memory"] | {"broken": None} == {
            "segments": 0,
            "bytes": 0,
            "lent": 0,
            "kept": 0,
            "reads": 0,
            "pushes": 0,
            "broken": None,
        }


async def _push_raw(client: ParameterClient, blocks: list) -> object:
    push = thrift.GradientPush(grads=[], packed=blocks, request_id=os.urandom(8).hex())
    return await client.invoke(METHODS.push_gradients, push=push)


def _block(segment: str, offset: int, size: int, name: str = "w", n: int = 4) -> thrift.Packed:
    shared = thrift.SharedRegion(segment=segment, offset=offset, size=size)
    return thrift.Packed(names=[name], dtype="<f4", shapes=[1, n], data=b"", shared=shared)


@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("name", "a shared memory segment is named FD:aioparamsync-"),
        ("huge fd", "is no file descriptor's number"),
        ("not that memfd", "is not that segment"),
        ("no such fd", "cannot be opened"),
        ("past its end", "is not within segment"),
        ("negative offset", "is not within segment"),
        ("short", "ends within 'w'"),
    ],
)
async def test_a_push_naming_memory_that_is_not_the_clients_is_refused(
    tmp_path: Path, how: str, says: str
) -> None:
    async with _node(tmp_path) as (_, local), ParameterClient(local) as client:
        await client.update_arrays({"w": np.zeros(4, np.float32)}, rules=sgd(1.0))
        segment = Segment(1 << 16)
        other = Segment(1 << 16)
        try:
            np.frombuffer(segment.map, np.float32)[:4] = 1.0
            wire = segment.wire
            fd, name = parse_segment(wire)
            block = {
                "name": _block(f"{fd}/{name}", 0, 16),
                "huge fd": _block(f"{2**40}:{name}", 0, 16),
                "not that memfd": _block(f"{other.fd}:{name}", 0, 16),
                "no such fd": _block(f"{2**30}:{name}", 0, 16),  # (above any fd limit)
                "past its end": _block(wire, (1 << 16) - 8, 16),
                "negative offset": _block(wire, -16, 16),
                "short": _block(wire, 0, 8),
            }[how]
            with pytest.raises(RequestError) as info:
                await _push_raw(client, [block])
            assert info.value.code == ErrorCode.BAD_REQUEST
            assert says in info.value.message
            # nothing was folded; the same push in the client's segment is
            _same(await client.get_arrays(["w"]), {"w": np.zeros(4, np.float32)})
            await _push_raw(client, [_block(wire, 0, 16)])
            _same(await client.get_arrays(["w"]), {"w": np.full(4, -1.0, np.float32)})
        finally:
            segment.close()
            other.close()


async def test_a_push_in_shared_memory_over_tcp_is_refused(tmp_path: Path) -> None:
    async with (
        _node(tmp_path) as (node, _),
        ParameterClient(node.address) as client,
    ):
        await client.update_arrays({"w": np.zeros(4, np.float32)}, rules=sgd(1.0))
        segment = Segment(1 << 16)
        try:
            with pytest.raises(RequestError, match="only from a client on the node's Unix socket"):
                await _push_raw(client, [_block(segment.wire, 0, 16)])
            # a read lending a region over TCP is answered in the message
            request = thrift.ParameterRequest(
                param_names=["w"],
                without_rules=True,
                packed=True,
                shared=thrift.SharedRegion(segment=segment.wire, offset=0, size=64),
            )
            response = await client.invoke(METHODS.get_parameters, request=request)
            assert [b.shared for b in response.packed] == [None]
            assert bytes(response.packed[0].data) == bytes(16)
        finally:
            segment.close()


async def test_a_read_lending_a_region_the_node_cannot_map_is_answered_in_the_message(
    tmp_path: Path,
) -> None:
    w = np.arange(8192, dtype=np.float32)  # (32 KiB: it would go in shared memory)
    async with _node(tmp_path) as (_, local), ParameterClient(local) as client:
        await client.update_arrays({"w": w})
        for segment, size in (("0:aioparamsync-0000000000000000", 1 << 16), ("nonsense", 1 << 16)):
            request = thrift.ParameterRequest(
                param_names=["w"],
                without_rules=True,
                packed=True,
                shared=thrift.SharedRegion(segment=segment, offset=0, size=size),
            )
            response = await client.invoke(METHODS.get_parameters, request=request)
            assert response.packed is None and bytes(response.params[0].data) == w.tobytes()


async def test_a_failed_push_keeps_its_region_from_use(tmp_path: Path) -> None:
    async with _node(tmp_path) as (_, local), ParameterClient(local) as client:
        await client.update_arrays({"w": np.zeros(8192, np.float32)}, rules=sgd(1.0))
        await client.get_arrays(["w"])
        await client.get_arrays(["w"])
        with pytest.raises(RequestError) as info:  # (refused: a gradient of another shape)
            await client.push_gradients({"w": np.ones(8191, np.float32)})
        assert info.value.code == ErrorCode.SHAPE_MISMATCH
        stats = client.stats()["shared_memory"]
        assert stats["kept"] == aligned(8191 * 4 + ALIGN) and stats["pushes"] == 1
        await client.push_gradients({"w": np.ones(8192, np.float32)})
        _same(await client.get_arrays(["w"]), {"w": np.full(8192, -1.0, np.float32)})
        assert client.stats()["shared_memory"]["kept"] == aligned(8191 * 4 + ALIGN)


async def test_a_push_refused_before_it_is_sent_gives_its_region_back(tmp_path: Path) -> None:
    async with _node(tmp_path) as (_, local), ParameterClient(local) as client:
        await client.update_arrays({"w": np.zeros(8192, np.float32)}, rules=sgd(1.0))
        await client.get_arrays(["w"])
        await client.get_arrays(["w"])
        lent = client.stats()["shared_memory"]["lent"]  # (of reads: none, or the last's)
        with pytest.raises(TypeError):  # (written into a region, then a gradient of no array)
            await client.push_gradients({"w": np.ones(8192, np.float32), "v": object()})
        stats = client.stats()["shared_memory"]
        assert stats["pushes"] == 1 and stats["lent"] == lent and stats["kept"] == 0
        await client.push_gradients({"w": np.ones(8192, np.float32)})
        _same(await client.get_arrays(["w"]), {"w": np.full(8192, -1.0, np.float32)})


def test_an_answer_outside_the_region_lent_is_refused() -> None:
    lane = Lane(1 << 30)
    try:
        key, region = lane.for_read(["w"])
        assert region is None  # (its size not yet known)
        w = thrift.Parameter(name="w", data=bytes(1 << 14), dtype="<f4", shape=[1 << 12])
        lane.answered(key, None, thrift.ParameterResponse(params=[w], timestamp=0, packed=[]))
        key, region = lane.for_read(["w"])
        assert region is not None and region.size == (1 << 14) + 2 * ALIGN  # (and room)
        for offset, size, segment in (
            (region.offset + region.size - 8, 16, region.shared.segment),
            (region.offset - 64, 16, region.shared.segment),
            (region.offset, 16, "1:aioparamsync-0123456789abcdef"),
        ):
            bad = _block(segment, offset, size)
            response = thrift.ParameterResponse(params=[], timestamp=0, packed=[bad])
            with pytest.raises(RemoteProtocolError, match="outside the region lent"):
                lane.answered(key, region, response)
            assert lane.lent == 0  # (given back)
            key, region = lane.for_read(["w"])
            assert region is not None
        # no region lent, yet an answer in shared memory
        lane.give(region)
        response = thrift.ParameterResponse(params=[], timestamp=0, packed=[_block("x", 0, 16)])
        with pytest.raises(RemoteProtocolError, match="lent none"):
            lane.answered(key, None, response)
    finally:
        lane.close()


def test_a_segments_free_extents_are_taken_first_fit_and_joined_when_given_back() -> None:
    segment = Segment(1 << 16)
    try:
        rng = np.random.default_rng(1)
        taken: list[tuple[int, int]] = []
        for _ in range(400):
            if taken and rng.random() < 0.45:
                offset, size = taken.pop(int(rng.integers(len(taken))))
                segment.give(offset, size)
            else:
                size = int(rng.integers(1, 64)) * ALIGN
                if (offset := segment.take(size)) is not None:
                    assert all(offset + size <= o or o + s <= offset for o, s in taken)
                    assert offset + size <= segment.size
                    taken.append((offset, size))
            free = segment.free
            assert free == sorted(free)
            assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(free))  # (none adjacent)
            assert sum(s for _, s in free) + sum(s for _, s in taken) == segment.size
        for offset, size in taken:
            segment.give(offset, size)
        assert segment.free == [(0, segment.size)]
    finally:
        segment.close()


def test_blocks_are_written_aligned_and_not_at_all_where_they_do_not_fit() -> None:
    buffer = bytearray(4096)
    view = memoryview(buffer)[64:1088]
    lent = SharedView(thrift.SharedRegion(segment="s", offset=64, size=1024), view)
    a, b = np.arange(3, dtype=np.float32), np.arange(5, dtype=np.int16)
    blocks = pack_into(lent, [("<f4", [("a", a.shape, a)]), ("<i2", [("b", b.shape, b)])])
    assert blocks is not None
    assert [(x.shared.offset, x.shared.size) for x in blocks] == [(64, 12), (128, 10)]
    assert bytes(buffer[64:76]) == a.tobytes() and bytes(buffer[128:138]) == b.tobytes()
    assert all(x.data == b"" for x in blocks)
    big = np.zeros(1000, np.int16)  # (2000 bytes: more than the region)
    before = bytes(buffer)
    assert pack_into(lent, [("<i2", [("big", big.shape, big)])]) is None
    assert bytes(buffer) == before


def test_a_lane_makes_no_segment_it_cannot_use() -> None:
    page = mmap.PAGESIZE
    lane = Lane(3 * page + 100)  # (a limit that is no whole number of pages)
    try:
        assert lane.take(3 * page + 64) is None
        assert lane.stats()["segments"] == 0
        region = lane.take(3 * page)
        assert region is not None and lane.stats()["bytes"] == 3 * page
        assert lane.take(64) is None  # (the 100 bytes left are no page)
        lane.give(region)
        assert lane.take(3 * page) is not None and lane.stats()["segments"] == 1
    finally:
        lane.close()


async def test_a_read_that_outgrows_its_region_goes_in_pieces_as_it_would(
    tmp_path: Path,
) -> None:
    small = {"w": np.arange(1000, dtype=np.float32)}
    large = {"w": np.arange(1 << 19, dtype=np.float32)}  # (2 MiB: more than a frame here)
    async with (
        _node(tmp_path) as (_, local),
        ParameterClient(
            local, max_frame_bytes=1 << 20, max_inline_bytes=1 << 16, piece_bytes=1 << 18
        ) as client,
    ):
        await client.update_arrays(small)
        _same(await client.get_arrays(["w"]), small)  # (its size learnt)
        await client.update_arrays(large, replace=True)
        _same(await client.get_arrays(["w"]), large)  # (its region too small: in pieces)
        _same(await client.get_arrays(["w"]), large)  # (its region large enough)
        assert client.stats()["shared_memory"]["reads"] == 1


def test_a_sync_client_gives_regions_back_from_the_callers_thread(tmp_path: Path) -> None:
    from aioparamsync import SyncParameterClient

    path = str(tmp_path / "node.sock")

    async def serve(stop: asyncio.Event) -> None:
        async with Node(port=0, unix_socket=path):
            await stop.wait()

    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    server = threading.Thread(target=loop.run_until_complete, args=(serve(stop),))
    server.start()
    try:
        for _ in range(200):
            if os.path.exists(path):
                break
            time.sleep(0.05)
        model = {f"p{i}": np.full(1000 * (i + 1), float(i), np.float32) for i in range(8)}
        with SyncParameterClient(f"unix:{path}") as client:
            client.update_arrays(model)
            for _ in range(100):
                got = client.get_arrays(list(model))  # (the last read's arrays let go here)
            _same(got, model)
            del got
            gc.collect()
            stats = client.stats()["shared_memory"]
            assert stats["reads"] == 99 and stats["lent"] == 0 and stats["segments"] == 1
    finally:
        loop.call_soon_threadsafe(stop.set)
        server.join(30)
        loop.close()


def test_lane_for_shares_only_with_unix_sockets() -> None:
    assert lane_for([("unix:/x.sock", 0)], 0) is None
    assert lane_for([("127.0.0.1", 9090)], 1 << 20) is None
    assert lane_for([("unix:/x.sock", 0), ("127.0.0.1", 9090)], 1 << 20) is None
    lane = lane_for([("unix:/x.sock", 0), ("unix:/y.sock", 0)], 1 << 20)
    assert isinstance(lane, Lane)
    lane.close()


async def test_concurrent_reads_and_pushes_of_one_client_share_its_segments(
    tmp_path: Path,
) -> None:
    names = [f"p{i}" for i in range(4)]
    async with _node(tmp_path) as (_, local), ParameterClient(local) as client:
        await client.update_arrays(
            {n: np.zeros(1 << 18, np.float32) for n in names}, rules=sgd(1.0)
        )
        await client.get_arrays(names)

        async def worker(name: str) -> None:
            for _ in range(10):
                await client.get_arrays([name])
                await client.get_arrays(names)
                await client.push_gradients({name: np.full(1 << 18, -1.0, np.float32)})

        await asyncio.gather(*(worker(n) for n in names))
        got = await client.get_arrays(names)
        _same(got, {n: np.full(1 << 18, 10.0, np.float32) for n in names})
        stats = client.stats()["shared_memory"]
        assert stats["pushes"] == 40 and stats["kept"] == 0


# A peer of another user: Debian's own Python (not this one, which may sit where that user
# cannot read) run as nobody, sending a push made here and printing the reply's bytes.
_PEER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(bytes.fromhex(sys.stdin.read()))
head = b""
while len(head) < 4:
    head += s.recv(4 - len(head))
body = b""
while len(body) < int.from_bytes(head, "big"):
    body += s.recv(65536)
print(body.hex())
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
    reason="root starts a peer of another user (nobody) with Debian's Python",
)
async def test_a_peer_of_another_user_on_the_socket_shares_no_memory() -> None:
    import tempfile

    from aioparamsync.wire import Protocol
    from aioparamsync.wire.codec import decode_header, encode_message

    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o755)  # (nobody may reach the socket)
        path = os.path.join(directory, "node.sock")
        async with Node(port=0, unix_socket=path), ParameterClient(f"unix:{path}") as client:
            os.chmod(path, 0o777)
            await client.update_arrays({"w": np.zeros(4, np.float32)}, rules=sgd(1.0))
            segment = Segment(1 << 16)
            try:
                np.frombuffer(segment.map, np.float32)[:4] = 1.0
                push = thrift.GradientPush(
                    grads=[], packed=[_block(segment.wire, 0, 16)], request_id="other-user"
                )
                args = METHODS.push_gradients.args(push=push)
                parts, _ = encode_message("push_gradients", 1, 7, args)
                message = b"".join(bytes(p) for p in parts)

                def drop() -> None:  # (in the child: nobody)
                    os.setgid(65534)
                    os.setuid(65534)

                peer = await asyncio.create_subprocess_exec(
                    "/usr/bin/python3",
                    "-c",
                    _PEER,
                    path,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    preexec_fn=drop,
                )
                out, _ = await asyncio.wait_for(peer.communicate(message.hex().encode()), 30)
                assert peer.returncode == 0
                _, _, seqid, reader = decode_header(bytes.fromhex(out.decode()), Protocol.BINARY)
                result = reader.read_body(METHODS.push_gradients.result)
                assert seqid == 7 and result.success is None
                assert result.error.code == ErrorCode.BAD_REQUEST
                assert "only from a client on the node's Unix socket" in result.error.message
                _same(await client.get_arrays(["w"]), {"w": np.zeros(4, np.float32)})
            finally:
                segment.close()
