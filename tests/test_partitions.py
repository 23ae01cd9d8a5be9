"""Large parameters stored as partitions: the layout, the cut, and the whole again.

Pure functions first (layout, keys, cutting every encoding, putting together),
then real nodes on loopback: a node alone, a cluster of three holding each key
twice (``LocalCluster``), our client routed and not, thriftpy2's and Apache
Thrift's generated clients knowing nothing of partitions.
"""

from __future__ import annotations

import asyncio
import shutil
import types
from typing import Any

import numpy as np
import pytest
from cluster_helpers import LocalCluster, eventually
from test_interop import _generate, apache_client

from aioparamsync import ErrorCode, Node, ParameterClient, RequestError, sgd, thrift
from aioparamsync.placement import (
    Placement,
    manifest_key,
    parse_key,
    partition_key,
    placed_by,
)
from aioparamsync.routing.partitions import collapse, cut, readable
from aioparamsync.values import compression
from aioparamsync.values.arrays import from_parameter, to_parameter
from aioparamsync.values.partitions import (
    Layout,
    assemble,
    layout_for,
    per_partition,
    split,
)
from aioparamsync.wire import METHODS, SEED_IDL_PATH, Protocol
from aioparamsync.wire.codec import encode_message
from aioparamsync.wire.writer import Chunks

PB = 64 * 1024  # partition_bytes in these tests: 16384 float32 elements a partition
PER = PB // 4
R = 2


# -- keys ---------------------------------------------------------------------------------------


def test_partition_and_manifest_keys_parse_back_and_nothing_else_does() -> None:
    for name in ["w", "layer.0.weight", "é", "x" * 300, "w#0", "#"]:
        for i in (0, 1, 9, 10, 4095):
            assert parse_key(partition_key(name, i)) == (name, i)
        assert parse_key(manifest_key(name)) == (name, None)
        assert parse_key(name) is None
    for key in ["w\x00#", "w\x00#01", "w\x00#-1", "w\x00#+1", "w\x00#1.0", "w\x00#mm",
                "\x00#0", "a\x00b\x00#0", "w\x00#٣", "\x00barrier\x00g"]:  # fmt: skip
        assert parse_key(key) is None, repr(key)


def test_a_manifest_is_placed_by_its_name_and_partitions_by_themselves() -> None:
    members = [f"127.0.0.1:{9000 + i}" for i in range(7)]
    placement = Placement(members, 2)
    spread = set()
    for name in [f"w{i}" for i in range(50)]:
        assert placed_by(manifest_key(name)) == name
        assert placement.replicas(manifest_key(name)) == placement.replicas(name)
        spread |= {placement.replicas(partition_key(name, i)) for i in range(8)}
    assert len(spread) > 10  # (partitions go everywhere, not with their name)


# -- the layout ---------------------------------------------------------------------------------


def test_a_parameter_is_cut_only_above_partition_bytes_of_float32() -> None:
    assert per_partition(PB) == PER and per_partition(PB, plain=True) == PB
    assert layout_for(to_parameter("w", np.zeros(PER, np.float32)), PB) is None
    layout = layout_for(to_parameter("w", np.zeros((3, PER + 1), np.float32)), PB)
    assert layout == Layout("<f4", (3, PER + 1), 3 * PER + 3, PER)
    assert layout.count == 4 and layout.bounds(3) == (3 * PER, 3 * PER + 3)
    # Elements, not bytes: a float64 gradient cuts where its float32 parameter does.
    assert layout_for(to_parameter("g", np.zeros((3, PER + 1))), PB).per == PER
    assert layout_for(to_parameter("w", np.zeros(10**6, np.float32)), 0) is None
    plain = thrift.Parameter(name="blob", data=bytes(PB + 1))
    assert layout_for(plain, PB) == Layout(None, None, PB + 1, PB)


def test_a_manifest_round_trips_and_a_bad_one_is_refused() -> None:
    layout = Layout("bfloat16", (7, 5), 35, 4)
    assert Layout.from_bytes(layout.to_bytes()) == layout
    assert Layout.from_bytes(Layout(None, None, 9, 2).to_bytes()).count == 5
    bad = [
        b"", b"\xff", b"[]", b'{"format": 2}', b"null",
        b'{"format":1,"dtype":"<f4","shape":[2,3],"elements":7,"per":2}',
        b'{"format":1,"dtype":"<f4","shape":null,"elements":7,"per":0}',
        b'{"format":1,"dtype":"<f4","shape":null,"elements":-7,"per":2}',
        b'{"format":1,"dtype":"<f4","shape":7,"elements":7,"per":2}',
        b'{"format":1,"dtype":4,"shape":null,"elements":7,"per":2}',
        b'{"format":1,"dtype":"<f4","shape":null,"elements":7.0,"per":2}',
        b'{"format":1,"dtype":"<f4","shape":[true],"elements":1,"per":2}',
    ]  # fmt: skip
    for data in bad:
        with pytest.raises(ValueError):
            Layout.from_bytes(data)


# -- cutting and putting together -----------------------------------------------------------


def _layout(n: int, per: int = 1000) -> Layout:
    return Layout("<f4", (n,), n, per)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, "bfloat16"])
def test_raw_partitions_put_together_are_the_parameter(dtype: Any) -> None:
    if dtype == "bfloat16":
        from ml_dtypes import bfloat16

        dtype = bfloat16
    array = (np.arange(2 * 3 * 1001) % 251).astype(dtype).reshape(2, 3, 1001)
    p = to_parameter("w", array, version=0)
    layout = Layout(p.dtype, tuple(array.shape), array.size, 1000)
    parts = split(p, layout)
    assert [q.name for q in parts] == [partition_key("w", i) for i in range(7)]
    assert [q.shape for q in parts] == [[1000]] * 6 + [[6]]
    for i, q in enumerate(parts):
        q.version, q.origin = 5 + (i == 3), f"n{i}"
    whole = assemble("w", layout, parts)
    assert whole.version == 5 and whole.origin == "n0"
    assert np.array_equal(from_parameter(whole), array)


def test_plain_bytes_are_cut_by_bytes() -> None:
    data = bytes(range(256)) * 40
    p = thrift.Parameter(name="blob", data=data)
    layout = layout_for(p, 4096)
    parts = split(p, layout)
    assert [len(q.data) for q in parts] == [4096, 4096, 2048]
    assert all(q.dtype is None and q.shape is None for q in parts)
    assert assemble("blob", layout, parts).data == data


@pytest.mark.parametrize("encoding", ["fp16", "bf16", "int8", "topk"])
def test_each_elementwise_encoding_is_cut_so_its_partitions_decode_to_the_whole(
    encoding: str,
) -> None:
    rng = np.random.default_rng(0)
    array = rng.standard_normal(5500).astype(np.float32)
    p = compression.encode("g", array, encoding, ratio=0.1)
    layout = _layout(array.size)
    parts = split(p, layout)
    assert len(parts) == 6 and all(q.encoding == encoding for q in parts)
    decoded = np.concatenate([compression.decode(q) for q in parts])
    assert np.array_equal(decoded, compression.decode(p))


def test_data_that_does_not_fit_the_layout_is_not_cut() -> None:
    p = to_parameter("w", np.zeros(5000, np.float32))
    with pytest.raises(ValueError, match="do not hold 5001"):
        split(p, _layout(5001))
    with pytest.raises(ValueError, match="decoded before"):
        split(compression.encode("w", np.zeros(5000, np.float32), "zlib"), _layout(5000))
    topk = compression.encode("g", np.arange(5000, dtype=np.float32), "topk", ratio=0.01)
    topk.indices = np.frombuffer(topk.indices, "<i8")[::-1].tobytes()
    with pytest.raises(ValueError, match="out of order"):
        split(topk, _layout(5000))
    topk = compression.encode("g", np.arange(5000, dtype=np.float32), "topk", ratio=0.01)
    with pytest.raises(ValueError, match="out of order or out of range"):
        split(topk, _layout(4000))
    parts = split(to_parameter("w", np.zeros(5500, np.float32)), _layout(5500))
    with pytest.raises(ValueError, match="5 of 6"):
        assemble("w", _layout(5500), parts[:5])
    with pytest.raises(ValueError, match="partition 5"):
        assemble("w", _layout(5500), [*parts[:5], parts[0]])


def test_cut_follows_a_known_layout_and_the_rule_otherwise() -> None:
    big = to_parameter("w", np.zeros((4, PER), np.float32))
    small = to_parameter("b", np.zeros(3, np.float32))
    items, manifests, chosen = cut([big, small], PB)
    assert [q.name for q in items] == [partition_key("w", i) for i in range(4)] + ["b"]
    assert [m.name for m in manifests] == [manifest_key("w")]
    assert Layout.from_bytes(manifests[0].data) == chosen["w"]
    # A known layout (as stored) cuts, though this node's partition_bytes would not.
    items, _, chosen = cut([big], 8 * PB, {"w": chosen["w"]})
    assert len(items) == 4 and chosen["w"].per == PER
    # Another shape (or replace) is not that layout: the rule again (the node checks).
    other = to_parameter("w", np.zeros((2, 2 * PER), np.float32))
    _, _, chosen2 = cut([other], PB, {"w": chosen["w"]})
    assert chosen2["w"].shape == (2, 2 * PER)


def test_versions_of_partitions_collapse_to_their_oldest_and_keys_read_as_names() -> None:
    versions = {partition_key("w", 0): 7, partition_key("w", 1): 6, manifest_key("w"): 2, "b": 3}
    assert collapse(versions, {}) == {"w": 6, "b": 3}
    two = Layout("<f4", None, 2 * PER, PER)
    assert collapse(versions, {"w": two}) == {"w": 6, "b": 3}
    with pytest.raises(RequestError, match=r"partitions \[2\] were not answered"):
        collapse(versions, {"w": Layout("<f4", None, 3 * PER, PER)})
    message = f"no parameter {partition_key('w', 12)!r}, nor {manifest_key('w')!r}"
    assert readable(message) == "no parameter 'w[partition 12]', nor 'w[manifest]'"


@pytest.mark.parametrize("protocol", [Protocol.BINARY, Protocol.COMPACT])
def test_a_parameter_of_chunks_is_written_as_its_bytes_joined(protocol: Protocol) -> None:
    # (a node answers a partitioned parameter so: each partition's bytes as stored)
    big, small = bytes(range(256)) * 200, b"tail"  # one sent by reference, one copied
    chunks = Chunks([memoryview(big), small, memoryview(big)[:5]])
    assert chunks.nbytes == len(big) + 9

    def encoded(data: Any) -> bytes:
        response = thrift.ParameterResponse(
            params=[thrift.Parameter(name="w", data=data, version=3)], timestamp=1
        )
        parts, size = encode_message("pull_parameters", 2, 7, response, protocol)
        joined = b"".join(bytes(part) for part in parts)
        assert len(joined) == size
        return joined

    assert encoded(chunks) == encoded(b"".join(bytes(c) for c in chunks))


# -- a node alone ---------------------------------------------------------------------------


@pytest.fixture
async def lone() -> Any:
    async with Node("127.0.0.1", 0, partition_bytes=PB) as node:
        yield node


def weights(rows: int = 40, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 1000)).astype(np.float32)


async def test_a_node_alone_stores_a_large_parameter_as_partitions_and_answers_it_whole(
    lone: Node,
) -> None:
    w = weights()  # 160,000 bytes: 3 partitions of 16384 elements
    async with ParameterClient(lone.address, timeout=10) as client:
        versions = await client.update_arrays({"w": w, "b": np.ones(3, np.float32)})
        assert versions == {"w": 1, "b": 1}
        keys = set(lone.table.names())
        assert keys == {"b", manifest_key("w"), *(partition_key("w", i) for i in range(3))}
        got = await client.get_arrays(["w", "b"])
        assert np.array_equal(got["w"], w) and got["w"].shape == (40, 1000)
        every = await client.get_parameters(None)
        assert sorted(p.name for p in every.params) == ["b", "w"]
        # The version is the oldest partition's; min_version and delta pulls go by it.
        assert {p.name: p.version for p in every.params} == {"w": 1, "b": 1}
        assert [p.name for p in (await client.get_parameters(["w"], 2)).params] == []
        assert (await client.get_parameters(["w"], known_versions={"w": 1})).params == []
        await client.update_arrays({"w": w + 1})
        changed = await client.get_parameters(["w"], known_versions={"w": 1})
        assert [(p.name, p.version) for p in changed.params] == [("w", 2)]
        encoded = await client.get_parameters(["w"], encoding="fp16")
        assert encoded.params[0].encoding == "fp16"
        assert np.allclose(compression.decode(encoded.params[0]), w + 1, atol=1e-2)


async def test_a_long_poll_of_a_partitioned_parameter_waits_for_every_partition(
    lone: Node,
) -> None:
    w = weights()
    async with ParameterClient(lone.address, timeout=10) as client:
        await client.update_arrays({"w": w})
        poll = asyncio.ensure_future(client.get_parameters(["w"], 2, wait=5.0))
        await asyncio.sleep(0.2)
        assert not poll.done()
        await client.update_arrays({"w": w * 2})
        answer = await asyncio.wait_for(poll, 5)
        assert answer.params[0].version == 2
        assert np.array_equal(from_parameter(answer.params[0]), w * 2)
        with pytest.raises(RequestError) as info:
            await client.get_parameters(["w"], 9, wait=0.2)
        assert info.value.code == ErrorCode.TIMEOUT
        assert "\\x00" not in info.value.message


async def test_a_long_poll_of_a_name_that_comes_as_partitions_is_answered_when_it_comes(
    lone: Node,
) -> None:
    w = weights()
    async with ParameterClient(lone.address, timeout=10) as client:
        poll = asyncio.ensure_future(client.get_parameters(["w"], 1, wait=5.0))
        await asyncio.sleep(0.2)
        assert not poll.done()
        await client.update_arrays({"w": w})  # (its manifest, written last, answers the poll)
        answer = await asyncio.wait_for(poll, 5)
        assert answer.params[0].version == 1
        assert np.array_equal(from_parameter(answer.params[0]), w)


async def test_gradients_fold_per_partition_by_the_parameters_rule(lone: Node) -> None:
    w = weights()
    g = np.random.default_rng(1).standard_normal(w.shape).astype(np.float32)
    async with ParameterClient(lone.address, timeout=10) as client:
        await client.update_arrays({"w": w}, rules=sgd(0.5))
        assert await client.push_gradients({"w": g}) == {"w": 2}
        assert np.allclose((await client.get_arrays(["w"]))["w"], w - 0.5 * g, atol=1e-6)
        # topk: the 10% largest, cut by their indices; error feedback keeps the rest
        # (max_residual=1: exactly the ratio, not more where the bound would need it).
        await client.push_gradients({"w": g}, encoding="topk", ratio=0.1, max_residual=1.0)
        sent = compression.decode(compression.encode("w", g, "topk", ratio=0.1))
        got = (await client.get_arrays(["w"]))["w"]
        assert np.allclose(got, w - 0.5 * g - 0.5 * sent, atol=1e-5)


async def test_layout_changes_are_refused_with_nothing_applied_unless_replaced(
    lone: Node,
) -> None:
    w = weights()
    async with ParameterClient(lone.address, timeout=10) as client:
        await client.update_arrays({"w": w})
        before = {k: lone.table.entry(k).version for k in lone.table.names()}
        with pytest.raises(RequestError) as info:  # the same elements, another shape
            await client.update_arrays({"w": w.reshape(1000, 40)})
        assert info.value.code == ErrorCode.SHAPE_MISMATCH
        assert "40x1000" in info.value.message and "1000x40" in info.value.message
        with pytest.raises(RequestError) as info:  # whole, small
            await client.update_arrays({"w": np.zeros(3, np.float32)})
        assert info.value.code == ErrorCode.SHAPE_MISMATCH
        assert {k: lone.table.entry(k).version for k in lone.table.names()} == before
        assert np.array_equal((await client.get_arrays(["w"]))["w"], w)
        # replace: another shape, more partitions.
        bigger = weights(70, seed=3)
        await client.update_arrays({"w": bigger}, replace=True)
        assert np.array_equal((await client.get_arrays(["w"]))["w"], bigger)
        assert partition_key("w", 4) in lone.table


async def test_names_holding_nul_are_refused_and_a_garbage_manifest_too(lone: Node) -> None:
    async with ParameterClient(lone.address, timeout=10) as client:
        for name in ["w\x00", "\x00barrier\x00g", "a\x00#b"]:
            with pytest.raises(RequestError) as info:
                await client.update_arrays({name: np.zeros(3, np.float32)})
            assert info.value.code == ErrorCode.BAD_REQUEST and "NUL" in info.value.message
            with pytest.raises(RequestError):
                await client.get_parameters([name])
        with pytest.raises(RequestError) as info:
            await client.update_parameters(
                [thrift.Parameter(name=manifest_key("w"), data=b"not json")]
            )
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert lone.table.names() == []


async def test_partition_bytes_0_stores_every_parameter_whole() -> None:
    async with (
        Node("127.0.0.1", 0, partition_bytes=0) as node,
        ParameterClient(node.address, timeout=10) as client,
    ):
        await client.update_arrays({"w": weights()})
        assert node.table.names() == ["w"]
        assert (await client.topology()).partition_bytes == 0
    with pytest.raises(ValueError, match="partition_bytes"):
        Node("127.0.0.1", 0, partition_bytes=-1)


# -- a cluster --------------------------------------------------------------------------------


@pytest.fixture
async def sharded() -> Any:
    cluster = LocalCluster(replication_factor=R)
    try:
        a = await cluster.start(partition_bytes=PB)
        b = await cluster.start(peers=[a], partition_bytes=PB)
        c = await cluster.start(peers=[a], partition_bytes=PB)
        nodes = [a, b, c]

        def formed() -> None:
            for node in nodes:
                assert node.cluster.state == "up"
                assert node.cluster.live == {n.node_id for n in nodes}, node.cluster.live

        await eventually(formed)
        yield nodes
    finally:
        await cluster.close()


@pytest.fixture(scope="module")
def founding(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace | None:
    if shutil.which("thrift") is None:
        return None
    return _generate(SEED_IDL_PATH, tmp_path_factory.mktemp("gen-seed-partitions"))


async def routed_client(node: Node) -> ParameterClient:
    client = ParameterClient(node.address, timeout=10)
    await client.routes.learn()
    assert client.routes.wanted() and client.routes.topology.partition_bytes == PB
    return client


async def test_partitions_spread_over_the_cluster_and_every_client_reads_the_whole(
    sharded: list[Node], founding: types.SimpleNamespace | None
) -> None:
    nodes = sharded
    w = weights(160)  # 640,000 bytes: 10 partitions, each on 2 of 3 nodes
    client = await routed_client(nodes[0])
    async with client:
        assert await client.update_arrays({"w": w}, acks="all") == {"w": 1}
        placement = Placement([n.node_id for n in nodes], R)
        for i in range(10):
            key = partition_key("w", i)
            assert {n.node_id for n in nodes if key in n.table} == set(placement.replicas(key))
        assert {n.node_id for n in nodes if manifest_key("w") in n.table} == set(
            placement.replicas("w")
        )
        held = [sum(e.nbytes for k in n.table.names() if (e := n.table.entry(k))) for n in nodes]
        assert sum(held) >= 2 * w.nbytes and max(held) < 0.9 * 2 * w.nbytes, held
        assert np.array_equal((await client.get_arrays(["w"]))["w"], w)
    for node in nodes:
        async with ParameterClient(node.address, route=False, timeout=10) as plain:
            assert np.array_equal((await plain.get_arrays(["w"]))["w"], w)
            names = [p.name for p in (await plain.get_parameters(None)).params]
            assert names == ["w"]
    if founding is None:
        pytest.skip("Apache Thrift's compiler (`thrift`) is not on PATH: the rest passed")
    T = founding.ttypes
    for node in nodes:
        async with apache_client(founding, node) as thrift_client:
            response = await thrift_client.get_parameters(T.ParameterRequest(["w"]))
        assert [(p.name, p.version, p.data) for p in response.params] == [("w", 1, w.tobytes())]
    async with apache_client(founding, nodes[1]) as thrift_client:
        await thrift_client.update_parameters(
            T.ParameterUpdate([T.Parameter("w", (w * 3).tobytes(), 0)], 5)
        )
    client = await routed_client(nodes[2])
    async with client:
        got = (await client.get_arrays(["w"]))["w"]
        assert np.array_equal(got, w * 3) and got.shape == w.shape  # (shape: as stored)


async def test_a_routed_client_reads_the_partitions_it_knows_with_their_manifest_at_once(
    sharded: list[Node],
) -> None:
    # Once it has seen a parameter's layout, a routed read asks for its partitions beside
    # its manifest: one round to the nodes, not a second for the partitions. The caller
    # sees the same whole, whatever the parameter has become since.
    w, small = weights(160), np.arange(5, dtype=np.float32)
    client = await routed_client(sharded[0])
    async with client:
        await client.update_arrays({"w": w, "s": small}, acks="all")
        sent: list[list[str]] = []
        send = client.routes._send
        failing: list[Exception] = []

        async def counted(m: Any, arg: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if arg == "request":
                sent.append(list(value.param_names))
                if failing:
                    raise failing.pop()
            return await send(m, arg, value, *args, **kwargs)

        client.routes._send = counted  # type: ignore[method-assign]

        async def read() -> dict[str, np.ndarray]:
            sent.clear()
            return await client.get_arrays(["w", "s"])

        got = await read()
        assert np.array_equal(got["w"], w) and np.array_equal(got["s"], small)
        assert len(sent) in (1, 2)  # (the layout learnt by the update, or by this read)
        got = await read()
        assert np.array_equal(got["w"], w) and sorted(got) == ["s", "w"]
        keys = [partition_key("w", i) for i in range(10)]
        assert sent == [["w", "s", *keys]]
        # replaced by a larger one (more partitions): the new whole, read in two rounds
        bigger = weights(240, seed=5)
        await client.update_arrays({"w": bigger}, replace=True, acks="all")
        client.routes.layouts["w"] = layout_for(to_parameter("w", w), PB)  # (as learnt before)
        got = await read()
        assert np.array_equal(got["w"], bigger) and got["w"].shape == bigger.shape
        assert sent[0] == ["w", "s", *keys] and len(sent) == 2, sent
        assert np.array_equal((await read())["w"], bigger) and len(sent) == 1
        # replaced by a small one, stored whole: no partition is answered to the caller
        await client.update_arrays({"w": small}, replace=True, acks="all")
        client.routes.layouts["w"] = layout_for(to_parameter("w", bigger), PB)  # (stale)
        got = await read()
        assert partition_key("w", 0) in sent[0]
        assert sorted(got) == ["s", "w"] and np.array_equal(got["w"], small), list(got)
        assert "w" not in client.routes.layouts  # (answered whole: read plainly next)
        await read()
        assert sent == [["w", "s"]]
        # ... and a partition left over (as a read may meet one amid a replace) is not either
        stray = to_parameter(partition_key("w", 0), np.ones(PER, np.float32))
        for node in sharded:
            node.table.apply([stray], 1)
        client.routes.layouts["w"] = layout_for(to_parameter("w", bigger), PB)
        got = await read()
        assert sorted(got) == ["s", "w"] and np.array_equal(got["w"], small), list(got)
        assert partition_key("w", 0) in sent[0]
        # a read asking ahead that fails forgets the layouts it used: the next is plain
        client.routes.layouts["w"] = layout_for(to_parameter("w", bigger), PB)
        failing.append(RequestError(ErrorCode.UNAVAILABLE, "a node is down"))
        with pytest.raises(RequestError, match="a node is down"):
            await read()
        assert partition_key("w", 0) in sent[0] and "w" not in client.routes.layouts
        assert np.array_equal((await read())["w"], small) and sent == [["w", "s"]]
        # reads that wait, or ask what is newer than versions held, are sent as they are
        client.routes.layouts["w"] = layout_for(to_parameter("w", bigger), PB)
        sent.clear()
        await client.get_parameters(["w"], 1, wait=0.05)
        await client.get_parameters(["w"], known_versions={"w": 1})
        assert sent == [["w"], ["w"]]


async def test_concurrent_gradient_pushes_at_every_node_fold_each_once_per_partition(
    sharded: list[Node],
) -> None:
    nodes = sharded
    w = weights(100)
    steps, lr = 8, 0.25
    grads = [np.random.default_rng(10 + i).standard_normal(w.shape).astype(np.float32)
             for i in range(len(nodes))]  # fmt: skip
    async with ParameterClient(nodes[0].address, timeout=10) as setup:
        await setup.update_arrays({"w": w}, rules=sgd(lr), acks="all")

    async def worker(node: Node, g: np.ndarray, route: bool) -> None:
        async with ParameterClient(node.address, route=route, timeout=10) as client:
            if route:
                await client.routes.learn()
            for _ in range(steps):
                await client.push_gradients({"w": g})

    await asyncio.gather(
        *(worker(n, g, i % 2 == 0) for i, (n, g) in enumerate(zip(nodes, grads, strict=True)))
    )
    expected = w - lr * steps * sum(grads)
    for node in nodes:
        async with ParameterClient(node.address, route=False, timeout=10) as client:

            async def folded(client: ParameterClient = client) -> None:
                got = await client.get_parameters(["w"])
                assert got.params[0].version == 1 + steps * len(nodes)
                assert np.allclose(from_parameter(got.params[0]), expected, atol=1e-4)

            await eventually(folded, retry_on=(AssertionError,))


async def test_a_client_that_reads_in_pieces_reads_a_partitioned_parameter_so(lone: Node) -> None:
    w = weights(100)  # 400,000 bytes; pieces of 50,000 cross partition boundaries
    async with ParameterClient(
        lone.address, route=False, timeout=10, max_inline_bytes=64 * 1024, piece_bytes=50_000
    ) as client:
        await client.update_arrays({"w": w})
        listed = await client.get_parameters(None)  # (what ctl list asks: headers)
        assert [(p.name, p.version) for p in listed.params] == [("w", 1)]
        assert np.array_equal((await client.get_arrays(["w"]))["w"], w)


async def test_a_node_joining_copies_partitions_and_manifests_as_they_are(
    sharded: list[Node],
) -> None:
    nodes = sharded
    w = weights(160)
    async with ParameterClient(nodes[0].address, timeout=10) as client:
        await client.update_arrays({"w": w}, acks="all")
    cluster = LocalCluster(replication_factor=R)
    try:
        d = await cluster.start(peers=[nodes[0]], partition_bytes=PB)
        everyone = [*nodes, d]

        def placed() -> None:
            # (with the keys claimed as d sees them: balance by bytes may claim some)
            claims = d.cluster.placement.claims
            placement = Placement([n.node_id for n in everyone], R, claims)
            for node in everyone:
                assert node.cluster.state == "up"
                assert "w" not in node.table  # (never a whole copy)
                for key in node.table.names():
                    assert node.node_id in placement.replicas(key), (node.node_id, key)
            assert any(k in d.table for k in (partition_key("w", i) for i in range(10)))

        await eventually(placed, timeout=30)
        async with ParameterClient(d.address, timeout=10) as client:
            await client.routes.learn()
            assert np.array_equal((await client.get_arrays(["w"]))["w"], w)
            await client.update_arrays({"w": w + 1})
            assert np.array_equal((await client.get_arrays(["w"]))["w"], w + 1)
    finally:
        await cluster.close()


@pytest.mark.parametrize("epoch", [1, None])  # (a routed part, or one sent on unrouted)
async def test_two_parts_of_one_push_at_one_node_are_both_folded(
    lone: Node, epoch: int | None
) -> None:
    # A routed client sends each part of a push to its primary; when primaries are down,
    # two parts under one request id may come to the same node: neither is taken for a
    # retry of the other. The same part sent again is folded once.
    async with ParameterClient(lone.address, route=False, timeout=10) as client:
        await client.update_arrays({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)},
                                   rules=sgd(1.0))  # fmt: skip

        async def part(name: str) -> dict[str, int]:
            push = thrift.GradientPush(
                grads=[to_parameter(name, np.ones(4, np.float32))],
                request_id="one-push",
                timestamp=1,
                epoch=epoch,
            )
            result = await client.invoke(METHODS.push_gradients, push=push)
            return dict(result.versions)

        assert await part("a") == {"a": 2}
        assert await part("b") == {"b": 2}
        assert await part("b") == {"b": 2}  # (a retry: not folded again)
        got = await client.get_arrays(["a", "b"])
        assert np.array_equal(got["a"], -np.ones(4)) and np.array_equal(got["b"], -np.ones(4))


async def test_a_node_alone_keeps_the_partitions_of_a_frame_without_copying_them(
    lone: Node,
) -> None:
    # (each partition is a third of its frame: alone it would be copied, so the frame would
    # not outlive it; the partitions of one parameter are replaced together, so they keep it)
    w = weights()
    async with ParameterClient(lone.address, timeout=10) as client:
        await client.update_arrays({"w": w, "v": np.ones(PER // 2, np.float32)})
    frames = set()
    for i in range(3):
        data = lone.table.entry(partition_key("w", i)).data
        assert data.obj is not None and memoryview(data.obj).nbytes >= w.nbytes, i
        frames.add(id(data.obj))
    assert len(frames) == 1
    # A parameter beside them in the frame is still kept alone.
    v = lone.table.entry("v").data
    assert v.obj is None or memoryview(v.obj).nbytes <= v.nbytes * 4 // 3


async def test_partitions_survive_a_restart_with_a_data_dir(tmp_path: Any) -> None:
    w = weights(60)
    async with (
        Node("127.0.0.1", 0, partition_bytes=PB, data_dir=tmp_path) as node,
        ParameterClient(node.address, timeout=10) as client,
    ):
        await client.update_arrays({"w": w}, rules=sgd(1.0))
        await client.push_gradients({"w": np.ones_like(w)})
    async with Node("127.0.0.1", 0, partition_bytes=PB, data_dir=tmp_path) as node:
        assert manifest_key("w") in node.table and "w" not in node.table
        async with ParameterClient(node.address, timeout=10) as client:
            got = await client.get_parameters(["w"])
            assert got.params[0].version == 2
            assert np.array_equal(from_parameter(got.params[0]), w - 1)
