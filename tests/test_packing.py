"""A read of many parameters answered in blocks (``ParameterRequest.packed``, the IDL's
``Packed``; ``aioparamsync.values.packing``): the same arrays as one ``Parameter`` each,
where the node may pack them, and a block that does not add up refused."""

from __future__ import annotations

import numpy as np
import pytest
from cluster_helpers import LocalCluster, eventually

from aioparamsync import Node, ParameterClient, RemoteProtocolError, sgd
from aioparamsync.values.arrays import to_parameter
from aioparamsync.values.packing import unpack
from aioparamsync.wire import thrift


def _mixed() -> dict[str, np.ndarray]:
    """Many of one dtype, and others: several dtypes, 0 to 3 dimensions, empty."""
    rng = np.random.default_rng(7)
    out: dict[str, np.ndarray] = {
        f"t/{i}": rng.standard_normal(64 + i, dtype=np.float32) for i in range(50)
    }
    out["grid"] = np.arange(24, dtype=np.int64).reshape(2, 3, 4)
    out["scalar"] = np.asarray(3.5)
    out["empty"] = np.zeros((0, 5), np.float32)
    out["half"] = np.arange(6, dtype=np.float16).reshape(3, 2)
    out["u8"] = np.arange(7, dtype=np.uint8)
    return out


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name], a)


async def test_a_read_of_many_is_answered_in_blocks_with_the_same_arrays() -> None:
    want = _mixed()
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        floats = {n: a for n, a in want.items() if n.startswith("t/")}
        await client.update_arrays(floats, rules=sgd(0.1))
        await client.update_arrays({n: a for n, a in want.items() if n not in floats})
        # plain bytes (no dtype: a founding client's) stay a Parameter of their own
        await client.update_parameters([thrift.Parameter(name="raw", data=b"\x01\x02\x03")])
        names = [*want, "raw", "missing"]

        response = await client.get_parameters(names, rules=False, packed=True)
        assert [p.name for p in response.params] == ["raw"]
        blocks = {b.dtype: b for b in response.packed}
        assert sorted(blocks) == sorted({a.dtype.str for a in want.values()})
        assert blocks["<f4"].names == [*floats, "empty"]
        assert blocks["<f4"].versions == [1] * 51
        assert set(blocks["<f4"].origins) == {node.table.origin}
        unpacked = {name: a for name, a, _, _ in unpack(response.packed)}
        _same(unpacked, want)

        arrays = await client.get_arrays(names)
        _same({n: a for n, a in arrays.items() if n != "raw"}, want)
        assert bytes(arrays["raw"]) == b"\x01\x02\x03"
        assert all(not a.flags.writeable for a in arrays.values())
        # as one Parameter each: the same
        plain = await client.get_parameters(names, rules=False)
        assert not plain.packed and len(plain.params) == len(want) + 1


@pytest.mark.parametrize(
    "how",
    ["with rules", "not asked", "encoded", "long poll", "partitioned"],
)
async def test_a_read_is_answered_one_parameter_each_where_blocks_do_not_apply(how: str) -> None:
    names = [f"t/{i}" for i in range(5)]
    want = {n: np.full(300, i, np.float32) for i, n in enumerate(names)}
    cut = {"partition_bytes": 512} if how == "partitioned" else {}
    node = Node("127.0.0.1", 0, **cut)
    async with node, ParameterClient(node.address) as client:
        await client.update_arrays(want)
        ask = {"rules": False, "packed": True}
        if how == "with rules":
            ask["rules"] = True
        elif how == "not asked":
            ask["packed"] = False
        elif how == "encoded":
            ask["encoding"] = "fp16"
        elif how == "long poll":
            ask["wait"] = 1.0
        response = await client.get_parameters(names, **ask)
        assert not response.packed
        assert sorted(p.name for p in response.params) == sorted(names)
        if how == "partitioned":  # (each over partition_bytes: cut; answered whole)
            assert all(p.total_bytes is None for p in response.params)
        same = {k: v for k, v in ask.items() if k in ("wait", "encoding")}
        got = await client.get_arrays(names, **same)  # (fp16 holds these values exactly)
        _same({n: a.astype(np.float32) for n, a in got.items()}, want)


async def test_a_client_not_routed_reads_through_a_node_of_a_sharded_cluster() -> None:
    """The node asks the others for what it does not hold: that answer is not in blocks,
    and get_arrays reads it whole; a routed client reads each node's part as such."""
    cluster = LocalCluster(replication_factor=1)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        c = await cluster.start(peers=[a])
        nodes = [a, b, c]

        def formed() -> None:
            for node in nodes:
                assert node.cluster.live == {n.node_id for n in nodes}

        await eventually(formed)
        want = {f"p{i}": np.full(32, i, np.float32) for i in range(30)}
        async with ParameterClient(a.address) as writer:
            await writer.update_arrays(want)
        assert 0 < sum(n in a.table for n in want) < len(want)
        for route in (False, True):
            async with ParameterClient(a.address, route=route) as client:
                for _ in range(3):
                    _same(await client.get_arrays(list(want)), want)
    finally:
        await cluster.close()


def _block(**fields: object) -> thrift.Packed:
    base: dict[str, object] = {
        "names": ["a", "b"],
        "dtype": "<f4",
        "shapes": [1, 2, 2, 1, 3],
        "data": np.arange(5, dtype=np.float32).tobytes(),
        "versions": [1, 2],
        "origins": ["n", "n"],
    }
    base.update(fields)
    return thrift.Packed(**base)


def test_a_block_is_read_as_views_of_its_bytes() -> None:
    (a, x, va, oa), (b, y, vb, ob) = unpack([_block()])
    assert (a, va, oa, b, vb, ob) == ("a", 1, "n", "b", 2, "n")
    assert x.shape == (2,) and y.shape == (1, 3)
    np.testing.assert_array_equal(np.concatenate([x, y.ravel()]), np.arange(5, dtype=np.float32))
    assert not x.flags.writeable


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"versions": [1]}, "2 names has 1 versions"),
        ({"origins": ["n", "n", "n"]}, "3 origins"),
        ({"dtype": "O"}, "not a numeric dtype"),
        ({"dtype": "nonsense"}, "not a numpy dtype"),
        ({"shapes": [1, 2]}, "shapes end or go wrong at 'b'"),
        ({"shapes": [1, 2, 2, 1]}, "shape of 'b' is (1,)"),
        ({"shapes": [1, -2, 2, 1, 3]}, "shape of 'a' is (-2,)"),
        ({"shapes": [40, 2, 2, 1, 3]}, "shapes end or go wrong at 'a'"),
        ({"shapes": [1, 2, 2, 1, 3, 9]}, "1 shape values past"),
        ({"shapes": [1, 2, 2, 1, 1 << 40]}, "ends within 'b'"),
        ({"data": b"\0" * 16}, "ends within 'b'"),
        ({"data": b"\0" * 24}, "holds 4 bytes"),
    ],
)
def test_a_block_that_does_not_add_up_is_refused(fields: dict, says: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        unpack([_block(**fields)])
    assert says in str(info.value)


def test_a_parameter_and_a_block_are_not_confused() -> None:
    """A Parameter is not a block (unpack reads Packed alone)."""
    with pytest.raises(AttributeError):
        unpack([to_parameter("a", np.ones(2, np.float32))])
