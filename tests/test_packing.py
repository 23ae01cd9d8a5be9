"""Many parameters in blocks (the IDL's ``Packed``; ``aioparamsync.values.packing``): a read
answered so (``ParameterRequest.packed``) and a push of gradients sent so
(``GradientPush.packed``) do what one ``Parameter`` each does, where they apply, and a block
that does not add up is refused (a push's: nothing of it folded)."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from cluster_helpers import LocalCluster, assert_, eventually
from hypothesis import given, settings
from hypothesis import strategies as st

from aioparamsync import ErrorCode, Node, ParameterClient, RemoteProtocolError, RequestError, sgd
from aioparamsync.store.table import Entry, Limits
from aioparamsync.values import packing
from aioparamsync.values.arrays import parse_dtype, to_parameter
from aioparamsync.values.packing import gradients_of, pack_arrays, packed_response, unpack
from aioparamsync.values.rules import adam
from aioparamsync.wire import METHODS, thrift
from aioparamsync.wire.writer import ZERO_COPY_MIN_BYTES


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


async def test_a_parameter_of_16_kib_or_more_is_answered_as_a_parameter_of_its_own() -> None:
    """(Sent by reference, as it is: in a block its bytes would be copied once more.)"""
    want = {"small": np.ones(4095 // 4, np.float32), "large": np.arange(4096, dtype=np.int32)}
    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        await client.update_arrays(want)
        response = await client.get_parameters(list(want), rules=False, packed=True)
        assert [p.name for p in response.params] == ["large"]
        assert [b.names for b in response.packed] == [["small"]]
        _same(await client.get_arrays(list(want)), want)


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
    async with _three_nodes(replication_factor=1) as a:
        want = {f"p{i}": np.full(32, i, np.float32) for i in range(30)}
        async with ParameterClient(a.address) as writer:
            await writer.update_arrays(want)
        assert 0 < sum(n in a.table for n in want) < len(want)
        for route in (False, True):
            async with ParameterClient(a.address, route=route) as client:
                for _ in range(3):
                    _same(await client.get_arrays(list(want)), want)


@contextlib.asynccontextmanager
async def _three_nodes(replication_factor: int) -> AsyncIterator[Node]:
    """A cluster of three nodes in this process, formed; its first node."""
    cluster = LocalCluster(replication_factor=replication_factor)
    try:
        nodes = [await cluster.start()]
        nodes += [await cluster.start(peers=nodes[:1]) for _ in range(2)]

        def formed() -> None:
            for node in nodes:
                assert node.cluster.live == {n.node_id for n in nodes}

        await eventually(formed)
        yield nodes[0]
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
        ({"shapes": [1, 2, 2, 1]}, "shape of 'b' is [1]"),
        ({"shapes": [1, -2, 2, 1, 3]}, "shape of 'a' is [-2]"),
        ({"shapes": [99, 2, 2, 1, 3]}, "shapes end or go wrong at 'a'"),
        ({"shapes": [5, 2, 2, 1, 3]}, "shape of 'a' is [2, 2, 1, 3]"),
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


# -- gradients in blocks ----------------------------------------------------------------------


def _model() -> dict[str, np.ndarray]:
    """Parameters of three rules and dtypes, small and large (a large one's gradient is
    sent as a Parameter of its own), one of two dimensions."""
    rng = np.random.default_rng(3)
    out = {f"w/{i}": rng.standard_normal(100 + i, dtype=np.float32) for i in range(20)}
    out["m"] = rng.standard_normal((6, 7))
    out["big"] = rng.standard_normal(8192, dtype=np.float32)  # (32 KiB)
    out["h"] = rng.standard_normal(16).astype(np.float16)
    return out


def _grads(model: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    return {n: np.full(a.shape, 0.01 * (step + 1), a.dtype) for n, a in model.items()}


async def _made(address: object, model: dict[str, np.ndarray]) -> None:
    async with ParameterClient(address) as client:
        await client.update_arrays(
            {n: a for n, a in model.items() if n.startswith("w/")}, rules=sgd(0.1, momentum=0.9)
        )
        await client.update_arrays({"m": model["m"], "big": model["big"]}, rules=adam(0.01))
        await client.update_arrays({"h": model["h"]}, rules=sgd(0.5))


async def test_gradients_pushed_in_blocks_fold_as_one_parameter_each() -> None:
    model = _model()
    async with Node("127.0.0.1", 0) as packs, Node("127.0.0.1", 0) as plain:
        await _made(packs.address, model)
        await _made(plain.address, model)
        async with ParameterClient(packs.address) as a, ParameterClient(plain.address) as b:
            assert not a._packs  # (no read answered in blocks yet: none sent so)
            await a.get_arrays(list(model))
            assert a._packs
            blocks, rest, _ = a._packed(_grads(model, 0), None)
            assert sorted(b.dtype for b in blocks) == ["<f2", "<f4", "<f8"]
            assert list(rest) == ["big"]
            for step in range(4):
                va = await a.push_gradients(_grads(model, step))
                vb = await b.push_gradients(_grads(model, step), request_id=f"r{step}")
                assert va == vb == {n: step + 2 for n in model}
            _same(await a.get_arrays(list(model)), await b.get_arrays(list(model)))
            got = await a.get_arrays(list(model))
            assert not np.array_equal(got["w/3"], model["w/3"])
            # each gradient counted once as it came, in a block or beside (raw: "none")
            for node in (packs, plain):
                assert node.service.gradients.encodings == {"none": 4 * len(model)}


async def test_a_client_sends_blocks_only_where_the_node_reads_them() -> None:
    """Not before a read answered in blocks, not under an id given (sent again as it
    went), not measured (encoding="auto"), not routed (cut by Parameter): the arrays it
    would send as they are."""
    grads = {"a": np.ones(4, np.float32), "b": np.ones(3, np.float32)}

    def sent(client: ParameterClient, request_id: str | None = None) -> list[list[str]]:
        blocks, rest, _ = client._packed(grads, request_id)
        assert sorted([*rest, *(n for b in blocks for n in b.names)]) == ["a", "b"]
        return [b.names for b in blocks]

    async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
        assert sent(client) == []
        client._packs = True
        assert sent(client) == [["a", "b"]]
        assert sent(client, "retry-7") == []
        client._auto = object()
        assert sent(client) == []
    cluster = LocalCluster(replication_factor=1)
    try:
        a = await cluster.start()
        await cluster.start(peers=[a])
        async with ParameterClient(a.address) as client:
            client._packs = True
            await eventually(lambda: assert_(client.routes.wanted()))
            assert sent(client) == []
    finally:
        await cluster.close()


def test_only_small_contiguous_numeric_arrays_are_packed() -> None:
    small = np.arange(6, dtype=np.int32)
    arrays = {
        "small": small,
        "strided": np.arange(12, dtype=np.float32)[::2],
        "large": np.zeros(4096, np.float32),  # (16 KiB: sent by reference as it is)
        "empty": np.zeros(0, np.float32),
        "bools": np.ones(3, bool),
        "listed": [1.0, 2.0],
    }
    blocks, rest = pack_arrays(arrays)
    assert [(b.names, b.dtype, b.shapes) for b in blocks] == [(["small"], "<i4", [1, 6])]
    assert bytes(blocks[0].data) == small.tobytes()
    assert list(rest) == ["strided", "large", "empty", "bools", "listed"]


@pytest.mark.parametrize(
    ("how", "code", "says"),
    [
        ("counts", ErrorCode.BAD_REQUEST, "ends within"),
        ("dtype", ErrorCode.SHAPE_MISMATCH, "not a numpy dtype"),
        ("shape", ErrorCode.SHAPE_MISMATCH, "'w/3' has shape (3,)"),
        ("unknown", ErrorCode.UNKNOWN_PARAMETER, "no parameter 'nope'"),
        ("twice", ErrorCode.BAD_REQUEST, "w/1"),
        ("nan", ErrorCode.BAD_REQUEST, "not finite"),
        # (more names than the node's limit, counted before any is read: the block's
        # shapes, cut short, would say otherwise)
        ("many", ErrorCode.LIMIT_EXCEEDED, "26 gradients in one request; the limit is 25"),
    ],
)
async def test_a_push_with_a_bad_block_is_refused_and_folds_nothing(
    how: str, code: ErrorCode, says: str
) -> None:
    model = _model()
    limits = Limits(max_params_per_update=25) if how == "many" else None
    async with (
        Node("127.0.0.1", 0, limits=limits) as node,
        ParameterClient(node.address) as client,
    ):
        await _made(node.address, model)
        before = await client.get_arrays(list(model))
        grads = {n: a for n, a in _grads(model, 0).items() if n.startswith("w/")}
        if how == "shape":
            grads["w/3"] = np.ones(3, np.float32)
        blocks, _ = pack_arrays(grads)
        [block] = blocks
        extra = []
        if how == "counts":
            block.data = bytes(block.data)[:-4]
        elif how == "dtype":
            block.dtype = "<q9"
        elif how == "unknown":
            block.names[5] = "nope"
        elif how == "twice":
            extra = [to_parameter("w/1", grads["w/1"])]
        elif how == "many":  # (20 in the block, 6 beside it)
            block.shapes = block.shapes[:4]
            extra = [to_parameter(f"x/{i}", np.ones(3, np.float32)) for i in range(6)]
        elif how == "nan":
            data = bytearray(block.data)
            data[8:12] = np.float32("nan").tobytes()
            block.data = bytes(data)
        push = thrift.GradientPush(grads=extra, packed=blocks, request_id="bad-" + how)
        with pytest.raises(RequestError) as info:
            await client.invoke(METHODS.push_gradients, push=push)
        assert info.value.code == code and says in info.value.message, info.value
        _same(await client.get_arrays(list(model)), before)
        versions = await client.get_parameters(list(model), rules=False)
        assert {p.version for p in versions.params} == {1}


async def test_a_push_in_blocks_through_a_node_of_a_sharded_cluster_folds_everywhere() -> None:
    """A client not routed: the node folds its part and passes the rest on, each part as
    Parameters; acks all."""
    async with _three_nodes(replication_factor=2) as a:
        model = {f"p{i}": np.zeros(32, np.float32) for i in range(30)}
        async with ParameterClient(a.address, route=False) as client:
            await client.update_arrays(model, rules=sgd(1.0))
            assert 0 < sum(n in a.table for n in model) < len(model)
            client._packs = True  # (a's answers are merged from the others': not in blocks)
            for step in range(3):
                versions = await client.push_gradients(
                    {n: np.full(32, -1.0, np.float32) for n in model}, acks="all"
                )
                assert versions == {n: step + 2 for n in model}
            got = await client.get_arrays(list(model))
            _same(got, {n: np.full(32, 3.0, np.float32) for n in model})


async def test_gradients_a_node_leaves_out_of_blocks_go_again_one_parameter_each(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As a node older than GradientPush.packed does: its decoder skips the field, and it
    folds the rest. The client sends what was left out again, and no more in blocks."""
    from aioparamsync.server.gradients import GradientPushes

    folds = GradientPushes.push

    def older(self: GradientPushes, method: object, args: object) -> object:
        args.push.packed = None  # type: ignore[attr-defined]
        return folds(self, method, args)

    monkeypatch.setattr(GradientPushes, "push", older)
    model = _model()
    async with Node("127.0.0.1", 0) as node, Node("127.0.0.1", 0) as plain:
        await _made(node.address, model)
        await _made(plain.address, model)
        async with ParameterClient(node.address) as a, ParameterClient(plain.address) as b:
            await a.get_arrays(list(model))
            assert a._packs
            with caplog.at_level("WARNING", logger="aioparamsync.client.gradients"):
                versions = await a.push_gradients(_grads(model, 0))
            assert versions == {n: 2 for n in model}  # (each folded once)
            assert "folded none of 22 gradients sent in blocks" in caplog.text
            assert not a._packs
            await b.push_gradients(_grads(model, 0), request_id="r")
            _same(await a.get_arrays(list(model)), await b.get_arrays(list(model)))


_SHAPES = st.lists(st.integers(-2, 9), min_size=5, max_size=12)


@pytest.mark.skipif(packing._cpacking is None, reason="the compiled path is not built")
@settings(max_examples=400, deadline=None)
@given(
    names=st.lists(st.sampled_from(["a", "b", "w/1", "ü"]), max_size=5),
    shapes=_SHAPES,
    extra=st.sampled_from([0, 0, 0, -4, -1, 1, 4]),
    dtype=st.sampled_from(["<f4", "<f8", "|i1", "<q9", "bfloat16", "V4"]),
    vectors=st.booleans(),
)
def test_gradients_made_compiled_are_those_python_makes_or_left_to_it(
    names: list[str], shapes: list[int], extra: int, dtype: str, vectors: bool
) -> None:
    """The compiled loop (values/_cpacking.pyx) makes what gradients_of's Python makes, or
    nothing (None: the Python function then makes them, or says what is wrong)."""
    if vectors:  # (blocks that add up, mostly: each a vector, the common case)
        shapes = [d for n in shapes[: len(names)] for d in (1, abs(n))]
    try:
        size = parse_dtype(dtype).itemsize
    except RequestError:
        size = 4
    counts, at = [], 0
    for _ in names:  # (the bytes the shapes ask for, give or take `extra`)
        ndim = shapes[at] if at < len(shapes) and 0 <= shapes[at] <= 3 else 0
        counts.append(math.prod(max(d, 0) for d in shapes[at + 1 : at + 1 + ndim]))
        at += 1 + ndim
    data = bytes(range(256)) * (max(sum(counts) * size + extra, 0) // 256 + 1)
    block = thrift.Packed(
        names=names, dtype=dtype, shapes=shapes, data=data[: max(sum(counts) * size + extra, 0)]
    )
    made = packing._cpacking.gradients_of(
        [block], thrift.Parameter, packing._DEFAULTS, packing._itemsize, packing.MAX_DIMENSIONS
    )
    compiled = packing._cpacking
    try:
        packing._cpacking = None
        expected: Any = gradients_of([block])
    except (RequestError, ValueError) as exc:
        expected = exc
    finally:
        packing._cpacking = compiled
    if made is None:  # (left: only what is not of the common case)
        assert isinstance(expected, Exception) or not vectors, "a block of vectors was left"
        return
    assert not isinstance(expected, Exception), expected
    assert [vars(p) | {"data": bytes(p.data)} for p in made] == [
        vars(p) | {"data": bytes(p.data)} for p in expected
    ]
    assert all(p.data.obj is made[0].data.obj for p in made)


def test_gradients_of_a_block_in_shared_memory_or_of_odd_fields_are_left_to_python() -> None:
    blocks, _ = pack_arrays({"a": np.ones(3, np.float32)})
    odd = copy.copy(blocks[0])
    odd.shared = thrift.SharedRegion()
    with pytest.raises(RequestError, match="shared memory"):  # (both paths: the Python says)
        gradients_of([odd])
    c = packing._cpacking
    if c is None:
        pytest.skip("the compiled path is not built")
    args = (thrift.Parameter, packing._DEFAULTS, packing._itemsize, packing.MAX_DIMENSIONS)
    assert c.gradients_of(blocks, *args) is not None
    for field, value in [("shared", thrift.SharedRegion()), ("names", ("a",)), ("data", None)]:
        odd = copy.copy(blocks[0])
        setattr(odd, field, value)
        assert c.gradients_of([odd], *args) is None, field


def _as_compared(response: Any) -> tuple[list[dict], list[dict]]:
    def plain(s: Any) -> dict:
        return {k: bytes(v) if isinstance(v, memoryview | bytes) else v for k, v in vars(s).items()}

    return [plain(p) for p in response.params], [plain(b) for b in response.packed or ()]


@pytest.mark.skipif(packing._cpacking is None, reason="the compiled path is not built")
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["<f4", "<f8", "|u1", None]),
            st.sampled_from([(), (3,), (2, 2), None]),
            st.sampled_from([0, 4, 4096, ZERO_COPY_MIN_BYTES - 1, ZERO_COPY_MIN_BYTES]),
            st.sampled_from(["a", "b/ü", "w\x00#2"]),
        ),
        max_size=8,
    )
)
def test_a_read_answered_in_blocks_compiled_is_the_one_python_makes(
    specs: list[tuple[Any, Any, int, str]],
) -> None:
    entries = [
        Entry(f"{name}{i}", memoryview(bytes([i]) * n), i + 1, dtype, shape, f"o{i}")
        for i, (dtype, shape, n, name) in enumerate(specs)
    ]
    made = packed_response(entries, 7)
    compiled = packing._cpacking
    try:
        packing._cpacking = None
        expected = packed_response(entries, 7)
    finally:
        packing._cpacking = compiled
    assert _as_compared(made) == _as_compared(expected)
    assert made.timestamp == expected.timestamp == 7
