"""Embedding tables through a real node: create, pull and push rows by id, over the wire.

The folds are checked against numpy and against torch (``nn.Embedding(sparse=True)``
with ``SGD``, ``Adagrad``, ``SparseAdam``); bad input gets a clear error and
changes nothing; the rows survive a restart from the data directory.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from cluster_helpers import LocalCluster, node_client

from aioparamsync import Node, ParameterClient, adagrad, adam, sgd
from aioparamsync.errors import ErrorCode, RequestError
from aioparamsync.values.rowwire import encode_ids, encode_rows
from aioparamsync.wire import METHODS, thrift

pytestmark = pytest.mark.timeout(60)

IDS = np.array([3, -7, 2**62, 3, 11], np.int64)


async def test_a_new_table_answers_initial_rows_in_the_order_of_the_ids(
    client: ParameterClient,
) -> None:
    made = await client.create_table("emb", 8, init="normal", scale=0.1, seed=7)
    assert (made.dim, made.dtype, made.init, made.buckets) == (8, "<f4", "normal", 64)
    assert made.rule.kind == "adagrad" and made.rule.lr == 0.01  # the default rule
    rows = await client.pull_rows("emb", IDS)
    assert rows.shape == (5, 8) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows[0], rows[3])  # the same id, the same row
    assert 0.02 < rows.std() < 0.3
    again = await client.pull_rows("emb", IDS[::-1].copy())
    np.testing.assert_array_equal(again, rows[::-1])  # a pure function of the id
    zeros = await client.create_table("zeros", 4)
    assert zeros.init == "zeros"
    np.testing.assert_array_equal(await client.pull_rows("zeros", IDS), np.zeros((5, 4)))
    assert [t.name for t in await client.tables()] == ["emb", "zeros"]


async def test_the_same_table_again_is_no_error_and_another_under_its_name_is(
    client: ParameterClient,
) -> None:
    first = await client.create_table("t", 4, rule=sgd(0.5))
    assert await client.create_table("t", 4, rule=sgd(0.5)) == first
    with pytest.raises(RequestError, match="exists, and differs") as err:
        await client.create_table("t", 5, rule=sgd(0.5))
    assert err.value.code == ErrorCode.BAD_REQUEST


async def test_sgd_sums_repeated_ids_and_folds_each_row_once(client: ParameterClient) -> None:
    await client.create_table("t", 3, rule=sgd(0.5))
    ids = np.array([5, 9, 5], np.int64)
    grads = np.array([[1, 2, 3], [4, 5, 6], [10, 20, 30]], np.float32)
    result = await client.push_row_gradients("t", ids, grads)
    assert (result.rows, result.created) == (2, 2)
    rows = await client.pull_rows("t", np.array([5, 9, 1], np.int64))
    np.testing.assert_allclose(rows[0], -0.5 * (grads[0] + grads[2]))
    np.testing.assert_allclose(rows[1], -0.5 * grads[1])
    np.testing.assert_array_equal(rows[2], 0)  # untouched
    result = await client.push_row_gradients("t", ids[:1], grads[:1])
    assert (result.rows, result.created) == (1, 0)
    none = np.empty(0, np.int64)  # no ids: no rows, nothing folded
    assert (await client.pull_rows("t", none)).shape == (0, 3)
    result = await client.push_row_gradients("t", none, np.empty((0, 3), np.float32))
    assert (result.rows, result.created) == (0, 0)


async def test_a_push_sent_again_under_its_request_id_folds_once(client: ParameterClient) -> None:
    await client.create_table("t", 2, rule=sgd(1.0))
    ids, grads = np.array([1, 2], np.int64), np.ones((2, 2), np.float32)
    await client.push_row_gradients("t", ids, grads, request_id="step-1")
    await client.push_row_gradients("t", ids, grads, request_id="step-1")
    np.testing.assert_array_equal(await client.pull_rows("t", ids), -np.ones((2, 2)))


async def test_a_push_sent_again_while_the_first_is_under_way_folds_once() -> None:
    """A routed client whose push failed in one part sends it all again at once, under
    its request id, while a part of the first try may still be on its way at another
    node: there the two meet, and the second folds only what the first did not."""
    cluster = LocalCluster(replication_factor=2)
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await cluster.formed([a, b])
        ids = np.arange(64, dtype=np.int64)  # (every bucket: parts for both nodes)
        grads = np.ones((len(ids), 2), np.float32)
        async with node_client(a.address) as client:
            await client.create_table("t", 2, rule=sgd(1.0), buckets=8)
            # Both tries are in flight together (pipelined, or on two connections).
            await asyncio.gather(
                *(client.push_row_gradients("t", ids, grads, request_id="step-1") for _ in "12")
            )
            np.testing.assert_array_equal(await client.pull_rows("t", ids), -grads)
    finally:
        await cluster.close()


def _torch_reference(kind: str, steps: list[tuple[np.ndarray, np.ndarray]], dim: int, n: int):
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(n, dim, sparse=True)
    with torch.no_grad():
        emb.weight.zero_()
    opt = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-10),
        "adam": lambda p: torch.optim.SparseAdam(p, lr=0.1),
    }[kind](emb.parameters())
    with torch.sparse.check_sparse_tensor_invariants():  # opting in silences torch's warning
        for ids, grads in steps:
            opt.zero_grad()
            out = emb(torch.from_numpy(ids))
            out.backward(torch.from_numpy(grads))
            opt.step()
    return emb.weight.detach().numpy()


@pytest.mark.parametrize(
    ("kind", "rule"),
    [("sgd", sgd(0.1)), ("adagrad", adagrad(0.1)), ("adam", adam(0.1))],
)
async def test_rows_fold_as_torch_sparse_optimizers_do(
    client: ParameterClient, kind: str, rule: object
) -> None:
    dim, n = 4, 6
    rng = np.random.default_rng(1)
    # adam: every step touches the same rows (SparseAdam counts steps per
    # parameter, the node per row: they agree when each step touches each row).
    steps = []
    for _ in range(5):
        ids = np.arange(n, dtype=np.int64) if kind == "adam" else rng.integers(0, n, 8)
        steps.append((ids.astype(np.int64), rng.standard_normal((len(ids), dim)).astype("f4")))
    await client.create_table(kind, dim, rule=rule)
    for ids, grads in steps:
        await client.push_row_gradients(kind, ids, grads)
    got = await client.pull_rows(kind, np.arange(n, dtype=np.int64))
    np.testing.assert_allclose(got, _torch_reference(kind, steps, dim, n), rtol=1e-5, atol=1e-6)


async def test_rows_travel_compressed_both_ways(client: ParameterClient) -> None:
    await client.create_table("t", 16, init="uniform", scale=1.0, rule=sgd(1.0))
    ids = np.arange(100, dtype=np.int64)
    raw = await client.pull_rows("t", ids)
    for encoding, bound in (("fp16", 1e-3), ("bf16", 1e-2), ("int8", 1 / 127)):
        got = await client.pull_rows("t", ids, encoding=encoding)
        assert got.dtype == np.float32
        assert np.abs(got - raw).max() <= bound, encoding
    grads = np.random.default_rng(0).standard_normal((100, 16)).astype(np.float32)
    await client.push_row_gradients("t", ids, grads, encoding="int8")
    after = await client.pull_rows("t", ids)
    scale = np.abs(grads).max(axis=1, keepdims=True) / 127
    assert (np.abs((raw - after) - grads) <= scale / 2 + 1e-6).all()


@pytest.mark.parametrize(
    ("ids", "grads", "error"),
    [
        (np.array([1.0, 2.0]), np.ones((2, 4), "f4"), "ids are int64, not float64"),
        (np.array([1, 2], np.int32), np.ones((2, 4), "f4"), r"astype\(np.int64\)"),
        (np.array([[1, 2]], np.int64), np.ones((2, 4), "f4"), "1-D"),
        (np.array([1, 2], np.int64), np.ones((2, 5), "f4"), r"\(2, 4\), not \(2, 5\)"),
        (np.array([1, 2], np.int64), np.ones((3, 4), "f4"), r"\(2, 4\), not \(3, 4\)"),
        (np.array([1, 2], np.int64), np.ones((2, 4), "i4"), "grads are floats"),
    ],
)
async def test_bad_input_is_refused_by_the_client_before_anything_is_sent(
    client: ParameterClient, ids: np.ndarray, grads: np.ndarray, error: str
) -> None:
    await client.create_table("t", 4, rule=sgd(1.0))
    with pytest.raises(ValueError, match=error):
        await client.push_row_gradients("t", ids, grads)
    with pytest.raises(ValueError):
        await client.pull_rows("t", np.array([1.5]))
    np.testing.assert_array_equal(await client.pull_rows("t", np.array([1, 2])), 0)


async def test_bad_input_on_the_wire_is_refused_and_folds_nothing(client: ParameterClient) -> None:
    await client.create_table("t", 4, rule=sgd(1.0))
    ids = np.array([1, 2], np.int64)

    async def push(**fields: object) -> RequestError:
        push = thrift.RowPush(
            table="t", ids=encode_ids(ids), grads=encode_rows(np.ones((2, 4), "f4"))
        )
        for k, v in fields.items():
            setattr(push, k, v)
        with pytest.raises(RequestError) as err:
            await client.invoke(METHODS.push_row_gradients, push=push)
        return err.value

    nan = np.ones((2, 4), "f4")
    nan[1, 2] = np.nan
    assert "not finite" in (await push(grads=encode_rows(nan))).message
    assert (await push(ids=b"\x01\x02\x03")).code == ErrorCode.BAD_REQUEST
    assert "3 rows for 2 ids" in (await push(grads=encode_rows(np.ones((3, 4), "f4")))).message
    bad = encode_rows(np.ones((2, 4), "f4"))
    bad.count = -2
    assert "not negative" in (await push(grads=bad)).message
    bad = encode_rows(np.ones((2, 4), "f4"))
    bad.count = 2**40
    assert (await push(grads=bad)).code == ErrorCode.SHAPE_MISMATCH
    bad = encode_rows(np.ones((2, 4), "f4"))
    bad.data = bytes(8)
    assert "bytes" in (await push(grads=bad)).message
    assert (await push(table="nope")).code == ErrorCode.UNKNOWN_PARAMETER
    bad = encode_rows(np.ones((2, 4), "f4"), "int8")
    bad.scales = None
    assert "scale per row" in (await push(grads=bad)).message
    # None of it was folded:
    np.testing.assert_array_equal(await client.pull_rows("t", ids), 0)
    with pytest.raises(RequestError, match="no table 'nope'") as err:
        await client.pull_rows("nope", ids)
    assert err.value.code == ErrorCode.UNKNOWN_PARAMETER


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"dim": 0}, ValueError),
        ({"dim": 2**20}, RequestError),
        ({"init": "ones"}, ValueError),
        ({"init": "normal", "scale": -1.0}, RequestError),
        ({"buckets": 0}, RequestError),
        ({"dtype": "int32"}, ValueError),
        ({"rule": sgd(0.1, momentum=0.9)}, RequestError),
        ({"rule": adagrad(-1.0)}, RequestError),
        ({"row_ttl": -5.0}, RequestError),
    ],
)
async def test_a_table_out_of_range_is_refused(
    client: ParameterClient, kwargs: dict, error: type
) -> None:
    args = {"dim": 4, **kwargs}
    with pytest.raises(error):
        await client.create_table("bad", **args)
    assert await client.tables() == []


async def test_adagrad_is_refused_for_a_dense_parameter(client: ParameterClient) -> None:
    with pytest.raises(RequestError, match="adagrad is for embedding tables"):
        await client.update_arrays({"w": np.zeros(3, np.float32)}, rules=adagrad(0.1))


async def test_rows_survive_a_restart_from_the_data_directory(tmp_path) -> None:
    ids = np.arange(-50, 50, dtype=np.int64)
    grads = np.random.default_rng(2).standard_normal((100, 8)).astype(np.float32)
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path, fsync="always") as node,
        ParameterClient(node.address) as client,
    ):
        await client.create_table("t", 8, init="normal", scale=0.01, rule=adam(0.01))
        for _ in range(3):
            await client.push_row_gradients("t", ids, grads)
        before = await client.pull_rows("t", ids)
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address) as client,
    ):
        np.testing.assert_array_equal(await client.pull_rows("t", ids), before)
        # adam's state came back too: the next step is the one it would have been
        await client.push_row_gradients("t", ids, grads)
        after = await client.pull_rows("t", ids)
    # the same four steps, never restarted
    async with Node("127.0.0.1", 0) as fresh, ParameterClient(fresh.address) as client:
        await client.create_table("t", 8, init="normal", scale=0.01, rule=adam(0.01))
        for _ in range(4):
            await client.push_row_gradients("t", ids, grads)
        np.testing.assert_array_equal(await client.pull_rows("t", ids), after)


async def test_the_tables_snapshot_is_readable_by_safetensors(tmp_path) -> None:
    st = pytest.importorskip("safetensors.numpy")
    ids = np.array([4, 8, 15, 16, 23, 42], np.int64)
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address) as client,
    ):
        await client.create_table("t", 2, rule=sgd(1.0), buckets=1)
        await client.push_row_gradients("t", ids, np.ones((6, 2), np.float32))
    (snapshot,) = (tmp_path / "rows").glob("rows-*.safetensors")
    tensors = st.load_file(str(snapshot))
    assert sorted(tensors["t/0/ids"]) == sorted(ids)
    np.testing.assert_array_equal(tensors["t/0/rows"], -np.ones((6, 2)))


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_node_killed_keeps_every_acknowledged_push_and_cuts_a_torn_tail(
    spawn, tmp_path
) -> None:
    ids = np.arange(200, dtype=np.int64)
    ones = np.ones((200, 4), np.float32)
    flags = ("--data-dir", str(tmp_path), "--fsync", "always")
    node = await spawn(*flags)
    async with node.client() as client:
        await client.create_table("t", 4, rule=sgd(1.0))
        for _ in range(5):
            await client.push_row_gradients("t", ids, ones)
    await node.kill()  # SIGKILL: no last snapshot, the log is all there is
    log_file = sorted((tmp_path / "rows").glob("rows-*.log"))[-1]
    torn = b"\x00\x00\x01\x00" + bytes(12)  # a record cut short, as a crash amid a write leaves
    await asyncio.to_thread(_append, log_file, torn)
    again = await spawn(*flags)
    async with again.client() as client:
        np.testing.assert_array_equal(await client.pull_rows("t", ids), -5 * ones)
        await client.push_row_gradients("t", ids, ones)
        np.testing.assert_array_equal(await client.pull_rows("t", ids), -6 * ones)
    assert "torn record" in again.stderr


def _append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def test_pulls_and_pushes_at_once_see_whole_rows(client: ParameterClient) -> None:
    await client.create_table("t", 64, rule=sgd(1.0))
    ids = np.arange(1000, dtype=np.int64)
    ones = np.ones((1000, 64), np.float32)

    async def pull_until_done() -> None:
        for _ in range(20):
            rows = await client.pull_rows("t", ids)
            # every row is at one step or another, never half of a fold
            assert (rows == rows[:, :1]).all()

    await asyncio.gather(
        pull_until_done(), *(client.push_row_gradients("t", ids, ones) for _ in range(10))
    )
    np.testing.assert_array_equal(await client.pull_rows("t", ids), -10 * ones)


async def test_parts_of_one_push_for_other_buckets_do_not_wait_for_each_other() -> None:
    """Under one request id, a push waits for one under way only where their buckets meet
    (one sent again must not fold twice). Parts of one call for other buckets go on: two
    nodes each passing the other a part of one call once waited for each other for good."""
    from aioparamsync.placement import bucket_of
    from aioparamsync.server.rows import RowService
    from aioparamsync.store.rows import table_spec

    service = RowService()  # (a node's row methods, alone)
    rule = thrift.Rule(kind="sgd", lr=1.0)
    table = service.tables.create(table_spec(thrift.Table(name="t", dim=2, buckets=8, rule=rule)))[
        0
    ]
    ids = np.arange(200, dtype=np.int64)
    buckets = bucket_of(ids, 8)
    a, b = ids[buckets == 0][:3], ids[buckets == 1][:3]
    release, folds = asyncio.Event(), []
    fold = service._push_once

    async def first_held(method, push, table, ids, grads):  # type: ignore[no-untyped-def]
        folds.append(ids.tolist())
        if len(folds) == 1:
            await release.wait()  # (the first part stays under way)
        return await fold(method, push, table, ids, grads)

    service._push_once = first_held  # type: ignore[method-assign]

    def push(part: np.ndarray) -> asyncio.Future:
        grads = encode_rows(np.ones((len(part), 2), np.float32))
        p = thrift.RowPush(table="t", ids=encode_ids(part), grads=grads, request_id="r1")
        return asyncio.ensure_future(service._push(METHODS.push_row_gradients, p, part))

    first = push(a)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(push(b), 5)  # other buckets: not behind the first
    again = push(a)  # the same buckets, sent again: behind the first
    await asyncio.sleep(0.05)
    assert not again.done() and len(folds) == 2
    release.set()
    await asyncio.wait_for(asyncio.gather(first, again), 5)
    # each row folded once (sgd at 1.0 from zeros): the resend found its buckets folded
    assert table.pull(np.concatenate([a, b])).tolist() == [[-1.0, -1.0]] * 6


@pytest.mark.parametrize("buckets", [1, 7, 64, 1000])
@pytest.mark.parametrize("dtype", ["<f4", "<f8", "<f2", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_pull_in_one_pass_reads_what_a_read_bucket_by_bucket_does(
    buckets: int,
    dtype: str,
    threads: int,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """A table's pull reads every bucket's rows in one compiled pass (rowcopy.gather),
    its ids in parts on several cores where it is large: each id's row from its
    bucket's block, or its initial row where it has none (no block, or no row in it,
    or one evicted: walked past); the same bytes as the read bucket by bucket (what
    the pure path does, and a read into chosen positions)."""
    from aioparamsync.store.rows import RowTable, table_spec
    from aioparamsync.values import parallel, rowcopy

    monkeypatch.setattr(parallel, "PART_BYTES", 4096)  # (this pull's 80 KiB: parts)
    kept = parallel.set_threads(threads)
    request.addfinalizer(lambda: parallel.set_threads(kept))

    spec = table_spec(
        thrift.Table(
            name="t",
            dim=5,
            dtype=dtype,
            buckets=buckets,
            rule=thrift.Rule(kind="sgd", lr=0.5),
            init="normal",
            scale=1.0,
            row_ttl_seconds=10.0,
        )
    )
    table = RowTable(spec)
    rng = np.random.default_rng(buckets)
    extremes = np.array([0, -1, 2**63 - 1, -(2**63)], np.int64)
    old = np.concatenate([extremes, rng.integers(-(2**63), 2**63 - 1, 3000)])
    table.fold(old, rng.standard_normal((len(old), 5)).astype(np.float32), 100.0)
    new = rng.integers(-(2**63), 2**63 - 1, 3000)
    table.fold(new, rng.standard_normal((len(new), 5)).astype(np.float32), 105.0)
    assert table.evict(111.0) > 0  # (the old rows gone: their index's buckets tombstones)
    absent = rng.integers(-(2**63), 2**63 - 1, 500)
    asked = rng.permutation(np.concatenate([old[:500], new, new[:100], absent, extremes]))
    got = table.pull(asked)
    expected = np.empty_like(got)
    table.read_into(asked, expected, np.arange(len(asked)))  # (bucket by bucket)
    assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
    missing = rowcopy.gather(
        [table.blocks[b].layout() if b in table.blocks else None for b in range(buckets)],
        asked,
        np.empty_like(got),
    )
    if rowcopy._crows is not None:  # (the pure path reads bucket by bucket)
        assert missing is not None
        have = {int(i) for i in new}
        assert missing.tolist() == [i for i, x in enumerate(asked.tolist()) if x not in have]


def test_the_compiled_gather_refuses_what_it_cannot_read() -> None:
    from aioparamsync.values import rowcopy

    c = rowcopy._crows
    if c is None:
        pytest.skip("the compiled path is not built")
    table, sids = np.full(8, -1, np.int64), np.zeros(4, np.int64)
    rows = np.zeros((4, 8), np.uint8)
    ids, out, missing = (
        np.arange(3, dtype=np.int64),
        np.zeros((3, 8), np.uint8),
        np.empty(3, np.int64),
    )
    with pytest.raises(ValueError, match="one length"):
        c.gather_rows([table], [sids], [rows], ids, out[:2], missing)
    with pytest.raises(ValueError, match="one per bucket"):
        c.gather_rows([table], [sids, sids], [rows], ids, out, missing)
    with pytest.raises(ValueError, match="one per bucket"):
        c.gather_rows([], [], [], ids, out, missing)
    with pytest.raises(ValueError, match="as wide"):
        c.gather_rows([table], [sids], [np.zeros((4, 4), np.uint8)], ids, out, missing)
    with pytest.raises(ValueError, match="power of two"):
        c.gather_rows([table[:6]], [sids], [rows], ids, out, missing)
    # A slot past the block's rows is no row (never read out of bounds), and a walk
    # ends after every bucket, though none is empty
    table[:4] = 7
    assert c.gather_rows([table], [sids], [rows], ids, out, missing) == 3
    table[:] = 7
    assert c.gather_rows([table], [sids], [rows], ids, out, missing) == 3
    # rows of another dtype than out's: not gathered (the caller reads bucket by bucket)
    f4 = np.zeros((4, 2), np.float32)
    assert rowcopy.gather([(table, sids, f4)], ids, np.zeros((3, 2), np.float64)) is None


@pytest.mark.parametrize("dtype", ["<f4", "<f8", "<f2"])
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("repeats", [False, True])
def test_a_tables_fold_where_the_gradients_lie_is_the_blocks_own(
    dtype: str, rule: str, repeats: bool
) -> None:
    """A table folds each bucket's part of a push where its gradients lie in the push
    (the compiled fold reads them by index, uncopied): the same rows, state and versions,
    bit for bit, as each block folding its own part gathered; with repeated ids, other
    dtypes or rules (which the compiled fold does not take) too."""
    from aioparamsync.store.rows import RowTable, counts_of, table_spec

    wire = thrift.Table(name="t", dim=7, dtype=dtype, buckets=16, rule=thrift.Rule(kind=rule))
    by_table, by_block = RowTable(table_spec(wire)), RowTable(table_spec(wire))
    rng = np.random.default_rng(len(dtype) + len(rule) + repeats)
    for step in range(3):
        ids = rng.integers(0, 3000 if repeats else 2**62, 5000)
        grads = rng.standard_normal((5000, 7)).astype(np.float32 if step else np.float64)
        if step == 2:  # (unaligned, as gradients read where they lie in a frame)
            raw = np.empty(grads.nbytes + 1, np.uint8)
            grads = np.frombuffer(raw.data, grads.dtype, grads.size, offset=1).reshape(5000, 7)
            grads[...] = rng.standard_normal((5000, 7))
            assert not grads.flags.aligned
        before = by_block.rows
        changed, created = by_table.fold(ids, grads, 10.0 + step)
        buckets = []
        for bucket, positions in by_block.by_bucket(ids):
            block = by_block.block(bucket)
            assert block.fold(ids[positions], grads[positions], 10.0 + step).tolist() == (
                changed[bucket].tolist()
            )
            buckets.append(bucket)
        assert list(changed) == buckets and len(changed) == len(buckets)
        # (counted without grouping them: see store.rows.Folded)
        assert counts_of(changed) == {b: len(changed[b]) for b in buckets}
        assert created == by_block.rows - before
    assert set(by_table.blocks) == set(by_block.blocks)
    for bucket, block in by_table.blocks.items():
        mine, theirs = block.export(), by_block.blocks[bucket].export()
        assert set(mine) == set(theirs)
        for name, values in mine.items():
            assert values.tobytes() == theirs[name].tobytes(), (bucket, name)


@pytest.mark.parametrize("rule", ["sgd", "adagrad"])
def test_a_large_push_found_and_folded_in_parts_is_the_blocks_own(rule: str) -> None:
    """A push of 2 MiB or more is found (each id's bucket and slot) and folded in parts
    on two cores at once: the same rows, state and versions as each block's fold."""
    from aioparamsync.store.rows import RowTable, table_spec
    from aioparamsync.values import parallel

    wire = thrift.Table(name="t", dim=16, buckets=16, rule=thrift.Rule(kind=rule, lr=0.1))
    by_table, by_block = RowTable(table_spec(wire)), RowTable(table_spec(wire))
    rng = np.random.default_rng(7)
    ids = rng.choice(2**40, 40_000, replace=False).astype(np.int64)  # (2.56 MB of rows)
    old = parallel.set_threads(2)
    try:
        for step in range(3):  # (made, then found: in the index, from either part)
            grads = rng.standard_normal((len(ids), 16)).astype(np.float32)
            by_table.fold(ids, grads, 1.0 + step)
            for bucket, positions in by_block.by_bucket(ids):
                by_block.block(bucket).fold(ids[positions], grads[positions], 1.0 + step)
            ids = rng.permutation(ids)
    finally:
        parallel.set_threads(old)
    assert set(by_table.blocks) == set(by_block.blocks)
    for bucket, block in by_table.blocks.items():
        mine, theirs = block.export(), by_block.blocks[bucket].export()
        for name, values in mine.items():
            assert values.tobytes() == theirs[name].tobytes(), (bucket, name)


class _Counted:
    """A compiled module whose ``fold_held`` calls are counted."""

    def __init__(self, module: object) -> None:
        self.module, self.calls = module, 0

    def fold_held(self, *args: object) -> object:
        self.calls += 1
        return self.module.fold_held(*args)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("case", "one_pass"),
    [
        ("sgd", True),
        ("adagrad, float64", True),
        ("repeats", True),
        ("rows made in new buckets", True),
        ("adam", False),
        ("float16", False),
        ("float64 gradients of float32 rows", False),
        ("repeats, a bucket's part longer than a sum's chunk", False),
    ],
)
def test_a_tables_push_folds_every_bucket_in_one_pass_where_it_can(
    case: str, one_pass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table's push folds the rows of every bucket in one compiled pass (its rule sgd
    or adagrad, the gradients of the rows' dtype; repeated ids summed first, rows made
    first where missing), else block by block; either way the same rows, state,
    versions and times, bit for bit, as each block folding its own part."""
    from aioparamsync.store import rows as store_rows
    from aioparamsync.store.rows import RowTable, table_spec

    if store_rows._crowfold is None:
        pytest.skip("the compiled path is not built")
    counted = _Counted(store_rows._crowfold)
    monkeypatch.setattr(store_rows, "_crowfold", counted)
    rule = "adam" if case == "adam" else "adagrad" if "adagrad" in case else "sgd"
    dtype = {"float16": "<f2", "adagrad, float64": "<f8"}.get(case, "<f4")
    long = "longer" in case  # (dim 2**16: a sum's chunk is 32 rows)
    dim, n = (1 << 16, 40) if long else (6, 4000)
    wire = thrift.Table(name="t", dim=dim, dtype=dtype, buckets=1 if long else 16)
    wire.rule = thrift.Rule(kind=rule, lr=0.1)
    by_table, by_block = RowTable(table_spec(wire)), RowTable(table_spec(wire))
    rng = np.random.default_rng(len(case))
    made = rng.integers(0, 2**62, n)
    first = rng.standard_normal((n, dim)).astype(np.float32)
    for table in (by_table, by_block):  # (rows in half the buckets, unless they are made)
        part = made[table.buckets_of(made) % 2 == 0] if "new buckets" in case else made
        table.fold(part, first[: len(part)], 5.0)
    counted.calls = 0
    ids = rng.choice(made, n) if "repeats" in case else rng.permutation(made)
    grads = rng.standard_normal((n, dim)).astype(np.float64 if "gradients" in case else dtype)
    before = by_block.rows
    changed, created = by_table.fold(ids, grads, 7.0)
    assert counted.calls == (1 if one_pass else 0)
    for bucket, positions in by_block.by_bucket(ids):
        folded = by_block.block(bucket).fold(ids[positions], grads[positions], 7.0)
        assert changed[bucket].tolist() == folded.tolist()
    assert set(changed) == set(by_block.buckets_in(ids))
    assert created == by_block.rows - before
    if "new buckets" in case:
        assert created > 0
    assert set(by_table.blocks) == set(by_block.blocks)
    for bucket, block in by_table.blocks.items():
        mine, theirs = block.export(), by_block.blocks[bucket].export()
        for name, values in mine.items():
            assert values.tobytes() == theirs[name].tobytes(), (bucket, name)
    # (a row made later without a time gets the latest time the block has seen)
    late = np.array([made.max() + 1], np.int64)
    assert by_table.pull(late).tobytes() == by_block.pull(late).tobytes()
    assert [b._clock for b in by_table.blocks.values()] == [
        by_block.blocks[b]._clock for b in by_table.blocks
    ]


def test_a_tables_push_at_a_time_not_finite_is_refused_and_changes_nothing() -> None:
    from aioparamsync.store.rows import RowTable, table_spec

    table = RowTable(table_spec(thrift.Table(name="t", dim=3, rule=thrift.Rule(kind="sgd"))))
    ids = np.arange(100, dtype=np.int64)
    table.fold(ids, np.ones((100, 3), np.float32), 1.0)
    before = {b: block.export() for b, block in table.blocks.items()}
    for bad in (float("nan"), float("inf")):
        with pytest.raises(RequestError, match="now"):
            table.fold(ids, np.ones((100, 3), np.float32), bad)
    for bucket, block in table.blocks.items():
        for name, values in block.export().items():
            assert values.tobytes() == before[bucket][name].tobytes(), name


def test_the_compiled_walk_and_fold_of_held_rows_refuse_bad_input_and_write_nothing() -> None:
    from aioparamsync.store import rows as store_rows

    c, f = store_rows._crows, store_rows._crowfold
    if c is None or f is None:
        pytest.skip("the compiled path is not built")
    index, sids = np.full(8, -1, np.int64), np.arange(4, dtype=np.int64)
    index[sids] = sids  # (id i in slot i, at its home or walked to)
    ids = np.array([0, 1, 9], np.int64)
    slots, owner = np.empty(3, np.int64), np.empty(3, np.int64)
    held = np.array([4], np.int64)
    with pytest.raises(ValueError, match="one length"):
        c.locate([index], [sids], held, ids, slots[:2], owner)
    with pytest.raises(ValueError, match="one per bucket"):
        c.locate([index], [sids], np.array([4, 4], np.int64), ids, slots, owner)
    with pytest.raises(ValueError, match="one per bucket"):
        c.locate([], [], held[:0], ids, slots, owner)
    with pytest.raises(ValueError, match="power of two"):
        c.locate([index[:6]], [sids], held, ids, slots, owner)
    with pytest.raises(ValueError, match="no more rows"):
        c.locate([index], [sids], np.array([5], np.int64), ids, slots, owner)
    assert c.locate([None], [None], held, ids, slots, owner) == 3
    assert slots.tolist() == [-1, -1, -1] and owner.tolist() == [0, 0, 0]

    rows = np.ones((4, 2), np.float32)
    sums, versions, touched = rows.copy(), np.zeros(4, np.int64), np.zeros(4)
    grads = np.ones((2, 2), np.float32)
    arrays = [[rows], [sums], [versions], [touched]]

    def fold(slots: list[int], owner: list[int], g: np.ndarray = grads, **kw: object) -> None:
        s, o = np.array(slots, np.int64), np.array(owner, np.int64)
        lists = kw.get("arrays", arrays)
        f.fold_held(*lists, s, o, g, 0.5, 0.0, True, 3.0)  # type: ignore[misc]

    for bad_slots, bad_owner, error in (
        ([0, 4], [0, 0], IndexError),
        ([0, -1], [0, 0], IndexError),
        ([0, 1], [0, 1], IndexError),
        ([0, 1], [0, -1], IndexError),
    ):
        with pytest.raises(error, match="not held"):
            fold(bad_slots, bad_owner)
    with pytest.raises(IndexError, match="not held"):  # (a bucket with no block)
        fold([0, 1], [0, 0], arrays=[[None], [None], [None], [None]])
    with pytest.raises(ValueError, match="one length"):
        fold([0], [0])
    with pytest.raises(ValueError, match="one per bucket"):
        fold([0, 1], [0, 0], arrays=[[rows], [sums, sums], [versions], [touched]])
    with pytest.raises(ValueError, match="as wide"):
        fold([0, 1], [0, 0], np.ones((2, 3), np.float32))
    assert np.all(rows == 1) and np.all(sums == 1) and not versions.any() and not touched.any()
    fold([2, 0], [0, 0])
    assert versions.tolist() == [1, 0, 1, 0] and touched.tolist() == [3.0, 0.0, 3.0, 0.0]
    assert np.all(rows[1] == 1) and np.all(rows[3] == 1) and np.all(rows[[0, 2]] < 1)
