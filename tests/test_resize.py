"""Resizing: a replacement stores its value whole or as partitions, as its size asks.

A parameter of 40 bytes replaced by one of 16 MiB (more than the default
``--partition-bytes``, 4 MiB) is stored as partitions, and back: with our
client (``replace=True``) and with the founding client (thriftpy2 loading
``idl/ml_param_sync.thrift``: plain bytes over plain bytes replace, as the
seed's server does), on a node alone and in a cluster of three holding each
key twice, where the partitions live at other nodes than the name. Readers
see the old value or the new, versions grow, and the keys of the layout
replaced are left holding nothing. An update that is no replacement keeps
the layout (SHAPE_MISMATCH, nothing applied). First the table's rule that
makes the switch one step: a name is held whole or as partitions, never both.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import thriftpy2
import thriftpy2.rpc
from cluster_helpers import LocalCluster, eventually, table_state
from thriftpy2.thrift import TApplicationException

from aioparamsync import ErrorCode, Node, ParameterClient, RequestError, sgd, thrift
from aioparamsync.placement import Placement, manifest_key, parse_key, partition_key
from aioparamsync.routing.partitions import READ_AGAIN, Replaced, gather
from aioparamsync.store.table import ParameterTable
from aioparamsync.values.partitions import DEFAULT_PARTITION_BYTES, Layout
from aioparamsync.wire import SEED_IDL_PATH

pytestmark = pytest.mark.timeout(120)

SMALL = np.arange(10, dtype=np.float32)  # 40 bytes
LARGE = np.arange(4 * 1024 * 1024, dtype=np.float32) % 1013  # 16 MiB: 4 partitions
R = 2
seed = thriftpy2.load(str(SEED_IDL_PATH), module_name="seed_resize_thrift")


def P(name: str, data: bytes = b"\0" * 4, version: int = 0, origin: str = "") -> Any:
    return thrift.Parameter(name=name, data=data, version=version, origin=origin or None)


def manifest(name: str, elements: int = 8, per: int = 4) -> Any:
    return Layout(None, None, elements, per).to_bytes()


def keys_of(node: Node, name: str) -> dict[str, int]:
    """The keys of ``name`` a node holds (whole, manifest, partitions), with their bytes."""
    table = node.table
    found = {}
    for key in table.names():
        parsed = parse_key(key)
        if key == name or (parsed is not None and parsed[0] == name):
            found[key] = table.entry(key).nbytes
    return found


def assert_whole(nodes: list[Node], name: str, nbytes: int, holders: set[str]) -> None:
    """``name`` is whole at ``holders`` (nowhere else); no manifest, no partition holds a byte."""
    for node in nodes:
        held = keys_of(node, name)
        assert (held.get(name) == nbytes) == (node.node_id in holders), (node.node_id, held)
        assert manifest_key(name) not in held, (node.node_id, held)
        assert not any(n for k, n in held.items() if k != name), (node.node_id, held)


def assert_partitioned(nodes: list[Node], name: str, count: int, placement: Placement) -> None:
    """``name`` as ``count`` partitions, each at its replicas, the manifest at the name's."""
    for node in nodes:
        held = keys_of(node, name)
        assert name not in held, (node.node_id, held)
        assert (manifest_key(name) in held) == placement.holds(node.node_id, name)
        for i in range(count):
            key = partition_key(name, i)
            assert (held.get(key, 0) > 0) == placement.holds(node.node_id, key), (node, key)


# -- the table: a name whole or as partitions, never both ---------------------------------------


def test_a_manifest_replaces_the_whole_and_the_whole_the_manifest_in_one_step() -> None:
    table = ParameterTable("n1")
    table.apply([P("w", version=5)], 1)
    applied = table.apply([P(manifest_key("w"), manifest("w"))], 2)
    assert [(e.name, e.version) for e in applied.entries] == [(manifest_key("w"), 6)]
    assert table.names() == [manifest_key("w")]
    applied = table.apply([P("w")], 3)
    assert [(e.name, e.version) for e in applied.entries] == [("w", 7)]
    assert table.names() == ["w"] and table.nbytes == 4
    with pytest.raises(RequestError, match="both whole and as partitions") as info:
        table.apply([P("w"), P(manifest_key("w"), manifest("w"))], 4)
    assert info.value.code == ErrorCode.BAD_REQUEST and table.entry("w").version == 7


def test_replicas_converge_on_the_newer_key_in_any_order() -> None:
    m = manifest_key("w")
    updates = [
        [P("w", version=3, origin="a")],
        [P(m, manifest("w"), version=4, origin="b")],
        [P("w", version=2, origin="c")],
        [P(m, manifest("w"), version=1, origin="a")],
    ]
    ends = set()
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2], [2, 3, 0, 1]):
        table = ParameterTable("r")
        for i in order:
            table.merge(updates[i], 0)
        ends.add(tuple((k, table.entry(k).version) for k in table.names()))
    assert ends == {((m, 4),)}
    # One message holding both keys (an outbox coalesces by key): the newer one is merged.
    table = ParameterTable("r")
    table.merge([P(m, manifest("w"), version=9, origin="a"), P("w", version=8, origin="a")], 0)
    assert table.names() == [m]
    table.merge([P("w", version=10, origin="a"), P(m, manifest("w"), version=9, origin="b")], 0)
    assert table.names() == ["w"]


async def test_a_read_that_meets_a_replacement_reads_again() -> None:
    # The manifest read says 2 partitions of 4 float32; its partitions, read after, were
    # emptied by a replacement: the read is made again, and answers the new value.
    layout = Layout("<f4", None, 8, 4)
    old = thrift.ParameterResponse(
        params=[thrift.Parameter(name=manifest_key("w"), data=layout.to_bytes(), version=1)],
        timestamp=1,
    )
    new = thrift.ParameterResponse(params=[P("w", SMALL.tobytes(), 9)], timestamp=2)
    emptied = thrift.ParameterResponse(
        params=[P(partition_key("w", i), b"", 8) for i in range(2)], timestamp=2
    )
    request = thrift.ParameterRequest(param_names=["w"])
    reads: list[Any] = []

    async def read(sub: Any) -> Any:
        reads.append(sub.param_names)
        return emptied

    async def again() -> Any:
        return new

    assert (await gather(request, old, read, again=again)).params == new.params
    assert reads == [[partition_key("w", 0), partition_key("w", 1)]]
    with pytest.raises(Replaced) as info:  # (without again: said, typed)
        await gather(request, old, read)
    assert info.value.code == ErrorCode.UNAVAILABLE and "read it again" in info.value.message

    async def still_old() -> Any:
        return old

    with pytest.raises(Replaced):  # (a bounded number of times)
        await gather(request, old, read, again=still_old)
    assert len(reads) == 2 + 1 + READ_AGAIN


# -- a node alone, our client -------------------------------------------------------------------


@pytest.fixture
async def lone() -> AsyncIterator[Node]:
    async with Node("127.0.0.1", 0) as node:  # (the default --partition-bytes)
        assert node.service.partitioned.partition_bytes == DEFAULT_PARTITION_BYTES
        yield node


async def read(client: ParameterClient, name: str) -> tuple[int, np.ndarray]:
    [p] = (await client.get_parameters([name])).params
    return p.version, np.frombuffer(bytes(p.data), np.float32)


async def test_our_client_resizes_40_bytes_to_16_mib_and_back(lone: Node) -> None:
    async with ParameterClient(lone.address, timeout=30) as client:
        await client.update_arrays({"w": SMALL}, rules=sgd(0.5))
        await client.update_arrays({"w": SMALL + 1})
        versions = [2]
        for value in (LARGE, SMALL * 3, LARGE + 2):
            made = await client.update_arrays({"w": value}, replace=True)
            version, got = await read(client, "w")
            assert made == {"w": version} and version > versions[-1], (made, versions)
            versions.append(version)
            assert np.array_equal(got, value)
            if value.size == SMALL.size:
                assert_whole([lone], "w", SMALL.nbytes, {lone.node_id})
            else:
                assert_partitioned([lone], "w", 4, Placement([lone.node_id], None))
        assert lone.table.nbytes < LARGE.nbytes * 1.01  # (the first large value is gone)
        # The rule went with the value: gradients fold as before.
        assert await client.push_gradients({"w": np.ones_like(LARGE)}) == {"w": versions[-1] + 1}
        version, got = await read(client, "w")
        assert np.array_equal(got, LARGE + 1.5)


async def test_an_update_that_is_no_replacement_keeps_the_layout(lone: Node) -> None:
    async with ParameterClient(lone.address, timeout=30) as client:
        await client.update_arrays({"s": SMALL, "l": LARGE})
        before = table_state(lone)
        for name, value in (("s", LARGE), ("l", SMALL)):
            with pytest.raises(RequestError) as info:
                await client.update_arrays({name: value})
            assert info.value.code == ErrorCode.SHAPE_MISMATCH
            assert repr(name) in info.value.message and "replace=True" in info.value.message
        assert table_state(lone) == before


async def test_an_update_of_a_name_whole_and_as_partitions_is_refused(lone: Node) -> None:
    async with ParameterClient(lone.address, timeout=30) as client:
        with pytest.raises(RequestError, match="both whole and as partitions") as info:
            await client.update_parameters(
                [P("w", SMALL.tobytes()), P(manifest_key("w"), manifest("w"))]
            )
        assert info.value.code == ErrorCode.BAD_REQUEST
    assert lone.table.names() == []


async def test_a_reader_sees_the_old_value_or_the_new(lone: Node) -> None:
    values = [SMALL, LARGE, SMALL * 2, LARGE * 2, SMALL * 3]
    known = {v.tobytes() for v in values}
    async with (
        ParameterClient(lone.address, timeout=30) as writer,
        ParameterClient(lone.address, timeout=30) as reader,
    ):
        await writer.update_arrays({"w": values[0]})
        seen: list[int] = []
        done = asyncio.Event()

        async def keep_reading() -> None:
            while not done.is_set():
                got = await reader.get_parameters(["w"])
                assert [p.name for p in got.params] == ["w"]  # never missing
                assert bytes(got.params[0].data) in known  # never a mix
                assert not seen or got.params[0].version >= seen[-1]
                seen.append(got.params[0].version)

        task = asyncio.ensure_future(keep_reading())
        for value in values[1:]:
            await writer.update_arrays({"w": value}, replace=True)
            await asyncio.sleep(0.01)
        done.set()
        await task
    assert len(set(seen)) > 1, seen


# -- the founding client: plain bytes over plain bytes replace ----------------------------------


@contextlib.asynccontextmanager
async def founding(address: tuple[str, int]) -> AsyncIterator[Any]:
    client = await thriftpy2.rpc.make_aio_client(
        seed.ParameterSyncService, address[0], address[1], timeout=60_000
    )
    try:
        yield client
    finally:
        client.close()


async def founding_round(address: tuple[str, int], name: str) -> list[int]:
    """Plain bytes of 4 KiB, 8 MiB, 4 KiB: each read back as written; answer the versions."""
    sizes = (4096, 8 * 1024 * 1024, 4096, 8 * 1024 * 1024 + 3)
    versions = []
    async with founding(address) as client:
        for i, size in enumerate(sizes):
            data = bytes([i + 1]) * size
            update = seed.ParameterUpdate(params=[seed.Parameter(name, data, 0)], timestamp=i)
            await client.update_parameters(update)
            got = await client.get_parameters(seed.ParameterRequest(param_names=[name]))
            assert [(p.name, p.data == data) for p in got.params] == [(name, True)], size
            versions.append(got.params[0].version)
    assert versions == sorted(set(versions)), versions
    return versions


async def test_the_founding_client_resizes_plain_bytes(lone: Node) -> None:
    await founding_round(lone.address, "blob")
    assert manifest_key("blob") in lone.table and "blob" not in lone.table
    # Plain bytes over a typed parameter keep its layout: another size is refused.
    async with ParameterClient(lone.address, timeout=30) as client:
        await client.update_arrays({"typed": SMALL})
    async with founding(lone.address) as client:
        with pytest.raises(TApplicationException, match="'typed' is stored as float32"):
            await client.update_parameters(
                seed.ParameterUpdate([seed.Parameter("typed", bytes(LARGE.nbytes))], 1)
            )
    assert (lone.table.entry("typed").version, lone.table.entry("typed").nbytes) == (1, 40)


async def test_a_replaced_layout_stays_replaced_after_a_restart(tmp_path: Path) -> None:
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address, timeout=30) as client,
    ):
        await client.update_arrays({"w": LARGE})
        await client.update_arrays({"w": SMALL}, replace=True)
        version, _ = await read(client, "w")
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address, timeout=30) as client,
    ):
        assert_whole([node], "w", SMALL.nbytes, {node.node_id})
        again, got = await read(client, "w")
        assert again == version and np.array_equal(got, SMALL)


# -- a cluster of three, each key twice -------------------------------------------------------


@pytest.fixture
async def three() -> AsyncIterator[list[Node]]:
    cluster = LocalCluster(replication_factor=R)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        c = await cluster.start(peers=[a])
        await cluster.formed([a, b, c])
        yield [a, b, c]
    finally:
        await cluster.close()


def holder_and_not(nodes: list[Node], name: str) -> tuple[Node, Node]:
    placement = Placement([n.node_id for n in nodes], R)
    holders = [n for n in nodes if placement.holds(n.node_id, name)]
    return holders[0], next(n for n in nodes if n not in holders)


async def test_a_cluster_resizes_with_our_client_and_the_replicas_converge(
    three: list[Node],
) -> None:
    nodes = three
    placement = Placement([n.node_id for n in nodes], R)
    holders = {n.node_id for n in nodes if placement.holds(n.node_id, "w")}
    client = ParameterClient(nodes[0].address, timeout=30)
    async with client:
        await client.routes.learn()
        await client.update_arrays({"w": SMALL}, acks="all")
        last = 1
        for value in (LARGE, SMALL * 2, LARGE + 1, SMALL * 3):
            made = await client.update_arrays({"w": value}, replace=True)
            assert made["w"] > last, made
            last = made["w"]
            got = await client.get_arrays(["w"])
            assert np.array_equal(got["w"], value)
            for node in nodes:  # (every node answers it, whoever holds what)
                async with ParameterClient(node.address, route=False, timeout=30) as plain:
                    version, got_here = await read(plain, "w")
                    assert version == last and np.array_equal(got_here, value)
            if value.size == SMALL.size:
                await eventually(lambda: assert_whole(nodes, "w", SMALL.nbytes, holders))
            else:
                await eventually(lambda: assert_partitioned(nodes, "w", 4, placement))


async def test_a_cluster_resizes_with_the_founding_client_at_any_node(three: list[Node]) -> None:
    nodes = three
    placement = Placement([n.node_id for n in nodes], R)
    holder, other = holder_and_not(nodes, "blob")
    await founding_round(other.address, "blob")  # (the name held elsewhere: passed on)
    await eventually(lambda: assert_partitioned(nodes, "blob", 3, placement))
    await founding_round(holder.address, "blob")
    async with founding(holder.address) as client:
        update = seed.ParameterUpdate(params=[seed.Parameter("blob", b"small", 0)], timestamp=9)
        await client.update_parameters(update)
    holders = {n.node_id for n in nodes if placement.holds(n.node_id, "blob")}
    await eventually(lambda: assert_whole(nodes, "blob", 5, holders))


async def test_a_parameter_stored_whole_takes_gradients_after_a_smaller_partition_size(
    tmp_path: Path,
) -> None:
    """A parameter made whole (``--partition-bytes`` was 0 or larger) stays whole after a
    restart with a smaller one (see the module), and its gradients fold into it whole: cut
    by the new size, they named partitions it has not (UNKNOWN_PARAMETER)."""
    big = np.zeros(2 << 20, np.float32)  # 8 MiB: two partitions of 4 MiB
    async with (
        Node("127.0.0.1", 0, partition_bytes=0, data_dir=tmp_path) as node,
        ParameterClient(node.address) as client,
    ):
        await client.update_arrays({"w": big, "b": np.zeros(4, np.float32)}, rules=sgd(1.0))
    async with (
        Node("127.0.0.1", 0, partition_bytes=DEFAULT_PARTITION_BYTES, data_dir=tmp_path) as node,
        ParameterClient(node.address) as client,
    ):
        assert sorted(node.table.names()) == ["b", "w"]  # (whole, as made)
        grads = {"w": np.ones(2 << 20, np.float32), "b": np.ones(4, np.float32)}
        assert await client.push_gradients(grads) == {"w": 2, "b": 2}
        got = await client.get_arrays(["w", "b"])
        assert got["w"].min() == got["w"].max() == -1 and got["b"].tolist() == [-1] * 4
        assert sorted(node.table.names()) == ["b", "w"]
