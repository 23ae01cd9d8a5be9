"""A stored parameter keeps its layout, and no value is cast with loss.

Once a parameter has a dtype and shape, an update with another is refused
(SHAPE_MISMATCH, naming both) unless it asks to replace the parameter; plain
bytes of the stored size keep the stored layout. A gradient folds into its
parameter only if its dtype converts without loss (numpy's "safe" casting),
or, sent in a lossy encoding, keeping its kind. Nothing of a refused update
or push is applied, on the node, its peers or in its data directory.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from cluster_helpers import LocalCluster, eventually, watched_cluster

from aioparamsync import (
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    sgd,
    sum_rule,
    thrift,
)
from aioparamsync.store.table import ParameterTable
from aioparamsync.values.arrays import lossless_cast, same_kind_cast, to_parameter

pytestmark = pytest.mark.timeout(60)


def snapshot(node: Node, name: str) -> tuple[int, str | None, tuple | None, bytes, object]:
    entry = node.table.entry(name)
    assert entry is not None
    return entry.version, entry.dtype, entry.shape, bytes(entry.data), entry.rule


async def refused(call: object, *texts: str) -> RequestError:
    with pytest.raises(RequestError) as raised:
        await call  # type: ignore[misc]
    assert raised.value.code == ErrorCode.SHAPE_MISMATCH, raised.value
    for text in texts:
        assert text in str(raised.value), raised.value
    return raised.value


# -- the rules, without a node -------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "target", "lossless", "same_kind"),
    [
        ("<f4", "<f8", True, True),
        ("<f8", "<f4", False, True),
        ("<f4", "<i4", False, False),
        ("<i4", "<i8", True, True),
        ("<i8", "<i4", False, True),
        ("<i2", "<f4", True, True),
        ("<i4", "<f4", False, True),  # float32 has 24 bits of significand
        ("<c8", "<f8", False, False),
        ("<f4", "<c8", True, True),
        ("bfloat16", "<f4", True, True),
        ("<f4", "bfloat16", False, True),
        ("<f2", "bfloat16", False, True),
        ("|i1", "bfloat16", True, True),
        ("bfloat16", "<i4", False, False),
    ],
)
def test_casting_rules(source: str, target: str, lossless: bool, same_kind: bool) -> None:
    def dt(s: str) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16) if s == "bfloat16" else np.dtype(s)

    assert lossless_cast(dt(source), dt(target)) is lossless
    assert same_kind_cast(dt(source), dt(target)) is same_kind


def test_the_table_keeps_a_layout_unless_told_to_replace_it() -> None:
    table = ParameterTable("n")
    table.apply([to_parameter("w", np.zeros((4, 3), np.float32))], 1)
    before = table.entry("w")
    for other in (np.zeros((3, 4), np.float32), np.zeros((4, 3), np.float64), np.zeros(12)):
        with pytest.raises(RequestError) as raised:
            table.apply([to_parameter("w", other)], 2)
        assert raised.value.code == ErrorCode.SHAPE_MISMATCH
        assert "float32 (4, 3)" in str(raised.value)
        assert table.entry("w") is before
    p = to_parameter("w", np.zeros((3, 4), np.float64))
    p.replace = True
    table.apply([p], 3)
    entry = table.entry("w")
    assert (entry.dtype, entry.shape, entry.version) == ("<f8", (3, 4), 2)


# -- updates, through a node ---------------------------------------------------------------


async def test_an_update_with_another_layout_is_refused_naming_both(
    node: Node, client: ParameterClient
) -> None:
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    await client.update_arrays({"w": w}, rules=sgd(0.1))
    before = snapshot(node, "w")
    await refused(
        client.update_arrays({"w": np.zeros((3, 4), np.float64)}),
        "'w' is stored as float32 (4, 3)",
        "float64 (3, 4)",
        "replace=True",
    )
    await refused(client.update_arrays({"w": w.reshape(3, 4)}), "float32 (3, 4)")
    await refused(client.update_arrays({"w": w.astype(np.float16)}), "float16 (4, 3)")
    # Nothing applied: version, layout, value and rule as they were.
    assert snapshot(node, "w") == before
    # The same layout is taken, and keeps the rule.
    assert await client.update_arrays({"w": w + 1}) == {"w": 2}
    assert node.table.entry("w").rule == sgd(0.1)


async def test_a_refused_parameter_fails_the_whole_update(
    node: Node, client: ParameterClient
) -> None:
    await client.update_arrays({"a": np.zeros(3), "b": np.zeros(2, np.int32)})
    before = snapshot(node, "a"), snapshot(node, "b")
    await refused(client.update_arrays({"a": np.ones(3), "b": np.ones(2)}), "'b'")
    assert (snapshot(node, "a"), snapshot(node, "b")) == before
    assert "c" not in node.table
    await refused(client.update_arrays({"c": np.ones(1), "b": np.ones(2)}), "'b'")
    assert "c" not in node.table


async def test_a_float_into_an_integer_parameter_is_refused(
    node: Node, client: ParameterClient
) -> None:
    await client.update_arrays({"step": np.array(3, np.int64)})
    await refused(client.update_arrays({"step": np.array(3.7)}), "stored as int64 ()", "float64 ()")
    entry = node.table.entry("step")
    assert (entry.dtype, np.frombuffer(entry.data, np.int64).tolist()) == ("<i8", [3])


async def test_replace_changes_the_layout(node: Node, client: ParameterClient) -> None:
    await client.update_arrays({"w": np.ones((4, 3), np.float32)}, rules=sgd(0.1, momentum=0.9))
    await client.push_gradients({"w": np.ones((4, 3), np.float32)})
    assert node.table.state("w") is not None
    assert await client.update_arrays({"w": np.zeros((3, 4))}, replace=True) == {"w": 3}
    version, dtype, shape, _, rule = snapshot(node, "w")
    assert (version, dtype, shape, rule) == (3, "<f8", (3, 4), sgd(0.1, momentum=0.9))
    assert node.table.state("w") is None  # a new layout starts the optimizer over
    # replace names some: the others keep their layout as before
    await client.update_arrays({"x": np.zeros(2), "y": np.zeros(2)})
    assert await client.update_arrays({"x": np.zeros(5), "y": np.ones(2)}, replace=["x"]) == {
        "x": 2,
        "y": 2,
    }
    await refused(client.update_arrays({"x": np.zeros(1), "y": np.zeros(1)}, replace={"x"}), "'y'")
    # An integer replaced by floats loses its sum rule only if it cannot keep it.
    await client.update_arrays({"n": np.zeros(2, np.int32)}, rules=sum_rule())
    await client.update_arrays({"n": np.zeros(2, np.float32)}, replace=True)
    assert node.table.entry("n").rule == sum_rule()


@pytest.mark.parametrize(
    ("replace", "error"),
    [
        ("w", TypeError),
        (b"w", TypeError),
        (1, TypeError),
        ([1], TypeError),
        (["nope"], ValueError),
    ],
)
async def test_replace_takes_a_bool_or_names_of_the_update(
    node: Node, client: ParameterClient, replace: object, error: type
) -> None:
    await client.update_arrays({"w": np.zeros(2)})
    with pytest.raises(error):
        await client.update_arrays({"w": np.zeros(3)}, replace=replace)  # type: ignore[arg-type]
    assert snapshot(node, "w")[:3] == (1, "<f8", (2,))


async def test_plain_bytes_of_the_stored_size_keep_the_layout(
    node: Node, client: ParameterClient
) -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    await client.update_arrays({"w": w}, rules=sgd(0.5))
    plain = thrift.Parameter(name="w", data=(w * 2).tobytes())
    await client.call("push_parameters", update=thrift.ParameterUpdate(params=[plain], timestamp=1))
    version, dtype, shape, _, rule = snapshot(node, "w")
    assert (version, dtype, shape, rule) == (2, "<f4", (2, 3), sgd(0.5))
    np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], w * 2)
    # other sizes are refused, saying why
    short = thrift.Parameter(name="w", data=b"\0" * 20)
    error = await refused(
        client.call("push_parameters", update=thrift.ParameterUpdate(params=[short], timestamp=1)),
        "stored as float32 (2, 3) (24 bytes)",
        "20 plain bytes",
    )
    assert "Send 24 bytes" in str(error)
    assert snapshot(node, "w")[0] == 2
    # data of the stored dtype and size without a shape keeps the shape too
    flat = thrift.Parameter(name="w", data=w.tobytes(), dtype="<f4")
    await client.call("push_parameters", update=thrift.ParameterUpdate(params=[flat], timestamp=1))
    assert snapshot(node, "w")[:3] == (3, "<f4", (2, 3))


async def test_plain_bytes_parameters_take_any_size(node: Node, client: ParameterClient) -> None:
    for size in (3, 8, 1):
        raw = thrift.Parameter(name="raw", data=b"x" * size)
        await client.call(
            "push_parameters", update=thrift.ParameterUpdate(params=[raw], timestamp=1)
        )
    assert snapshot(node, "raw")[:4] == (3, None, None, b"x")
    # ... and a plain-bytes parameter may be given a layout
    await client.update_arrays({"raw": np.zeros(2, np.float32)})
    assert snapshot(node, "raw")[:3] == (4, "<f4", (2,))


async def test_an_encoded_update_keeps_the_layout_rule(node: Node, client: ParameterClient) -> None:
    await client.update_arrays({"w": np.zeros((8, 8), np.float32)})
    await client.update_arrays({"w": np.ones((8, 8), np.float32)}, encoding="fp16")
    await refused(client.update_arrays({"w": np.ones(64, np.float32)}, encoding="int8"), "(64,)")
    await refused(client.update_arrays({"w": np.ones((8, 8))}, encoding="zlib"), "float64 (8, 8)")
    assert snapshot(node, "w")[:3] == (2, "<f4", (8, 8))
    # A wider float sent in a lossy encoding: the precision given up was asked for, so its
    # values narrow to the stored dtype; a kind is never changed.
    await client.update_arrays({"w": np.full((8, 8), 0.5)}, encoding="fp16")
    version, dtype, shape, data, _ = snapshot(node, "w")
    assert (version, dtype, shape) == (3, "<f4", (8, 8))
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), 0.5)
    np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], np.full((8, 8), 0.5))
    await client.update_arrays({"n": np.zeros(4, np.int32)})
    await refused(client.update_arrays({"n": np.ones(4)}, encoding="fp16"), "int32 (4,)")
    assert snapshot(node, "n")[:3] == (1, "<i4", (4,))


async def test_a_parameter_in_pieces_keeps_the_layout_rule(node: Node) -> None:
    async with ParameterClient(
        node.address, timeout=30, max_inline_bytes=1024, piece_bytes=1024
    ) as client:
        await client.update_arrays({"big": np.zeros((64, 16), np.float32)})
        await refused(client.update_arrays({"big": np.ones((16, 64), np.float32)}), "(16, 64)")
        assert snapshot(node, "big")[:3] == (1, "<f4", (64, 16))
        assert await client.update_arrays({"big": np.ones((16, 64))}, replace=True) == {"big": 2}
        assert snapshot(node, "big")[:3] == (2, "<f8", (16, 64))
        np.testing.assert_array_equal((await client.get_arrays(["big"]))["big"], 1.0)


# -- gradients -----------------------------------------------------------------------------


async def test_float_gradients_are_not_truncated_into_integers(
    node: Node, client: ParameterClient
) -> None:
    await client.update_arrays({"count": np.array([10], np.int32)}, rules=sum_rule())
    for _ in range(3):
        await refused(
            client.push_gradients({"count": np.array([0.7])}),
            "gradient 'count' of float64 cannot fold into a parameter of int32",
        )
    assert snapshot(node, "count")[:4] == (1, "<i4", (1,), np.int32(10).tobytes())
    # integers of a type that fits fold
    await client.push_gradients({"count": np.array([2], np.int16)})
    assert np.frombuffer(snapshot(node, "count")[3], np.int32).tolist() == [12]
    await refused(client.push_gradients({"count": np.array([2], np.int64)}), "int64")


async def test_a_wider_gradient_needs_a_lossy_encoding(node: Node, client: ParameterClient) -> None:
    await client.update_arrays({"w": np.zeros(4, np.float32), "b": np.zeros(1)}, rules=sgd(1.0))
    before = snapshot(node, "w"), snapshot(node, "b")
    error = await refused(
        client.push_gradients({"b": np.ones(1), "w": np.ones(4)}),
        "gradient 'w' of float64 cannot fold into a parameter of float32 without losing precision",
    )
    assert "fp16" in str(error)
    assert (snapshot(node, "w"), snapshot(node, "b")) == before  # the whole push refused
    # the same in a lossy encoding: asked for, so taken
    await client.push_gradients({"w": np.ones(4)}, encoding="fp16")
    np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], -1.0)
    # lossless encodings do not count, and no encoding changes a kind
    await refused(client.push_gradients({"w": np.ones(4)}, encoding="zlib"), "float64")
    await refused(
        client.push_gradients({"w": np.ones(4, np.complex64)}),
        "gradient 'w' of complex64 is not a real number type",
    )
    await client.push_gradients({"w": np.ones(4, np.float16)})  # narrower: fine
    assert snapshot(node, "w")[0] == 3


# -- replicas and the data directory -------------------------------------------------------


@pytest.fixture
async def cluster() -> object:
    async with watched_cluster(repair_interval=0.2) as nodes:
        yield nodes


async def test_replicas_follow_the_layout_rule(cluster: LocalCluster) -> None:
    a = await cluster.start()
    b = await cluster.start(peers=[a])
    await cluster.formed([a, b])
    async with ParameterClient(a.address, timeout=30) as ca:
        await ca.update_arrays({"w": np.zeros((2, 2), np.float32)})
        await refused(ca.update_arrays({"w": np.zeros(4)}))
        plain = thrift.Parameter(name="w", data=np.ones(4, np.float32).tobytes())
        await ca.call("push_parameters", update=thrift.ParameterUpdate(params=[plain], timestamp=1))
        state = await cluster.converged([a, b])
        assert state["w"][0] == 2
        assert snapshot(b, "w")[:3] == (2, "<f4", (2, 2))  # the stored layout travelled
        await ca.update_arrays({"w": np.zeros(3, np.int64)}, replace=True)
        await cluster.converged([a, b])
        assert snapshot(b, "w")[:3] == (3, "<i8", (3,))

    async def b_refuses_too() -> None:
        async with ParameterClient(b.address, timeout=30) as cb:
            await refused(cb.update_arrays({"w": np.zeros(3)}), "int64 (3,)")

    await eventually(b_refuses_too)


async def test_a_restarted_node_keeps_the_layout(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    async with (
        Node("127.0.0.1", 0, data_dir=data_dir) as node,
        ParameterClient(node.address, timeout=30) as client,
    ):
        await client.update_arrays({"w": w})
        plain = thrift.Parameter(name="w", data=(w + 1).tobytes())
        await client.call(
            "push_parameters", update=thrift.ParameterUpdate(params=[plain], timestamp=1)
        )
        await refused(client.update_arrays({"w": np.zeros(6)}))
    async with Node("127.0.0.1", 0, data_dir=data_dir) as node:
        version, dtype, shape, data, _ = snapshot(node, "w")
        assert (version, dtype, shape) == (2, "<f4", (3, 2))
        np.testing.assert_array_equal(np.frombuffer(data, np.float32).reshape(3, 2), w + 1)
