"""The store's rules, without an event loop; then its single writer, with one."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioparamsync import ErrorCode, RequestError, to_parameter
from aioparamsync.store.table import MAX_VERSION, Limits, ParameterTable
from aioparamsync.store.writer import ParameterStore
from aioparamsync.wire import thrift


def P(name: str, data: bytes = b"\x00" * 4, version: int = 0, **kw) -> object:
    return thrift.Parameter(name=name, data=data, version=version, **kw)


# -- ParameterTable: no event loop -------------------------------------------------


def test_versions_are_max_of_stored_plus_one_and_given() -> None:
    table = ParameterTable("n1")
    assert table.apply([P("a")], 10).entries[0].version == 1
    assert table.apply([P("a")], 11).entries[0].version == 2
    assert table.apply([P("a", version=7)], 12).entries[0].version == 7
    assert table.apply([P("a", version=3)], 13).entries[0].version == 8
    assert table.entry("a").origin == "n1"


def test_timestamp_only_grows() -> None:
    table = ParameterTable()
    assert table.apply([P("a")], 100).timestamp == 100
    assert table.apply([P("a")], 50).timestamp == 100
    assert table.timestamp == 100


def test_read_filters_by_min_version_and_leaves_out_unknown_names() -> None:
    table = ParameterTable()
    table.apply([P("a"), P("b")], 1)
    table.apply([P("b")], 2)
    assert [e.name for e in table.read(["a", "b", "zz"])] == ["a", "b"]
    assert [e.name for e in table.read(["a", "b"], min_version=2)] == ["b"]
    assert [e.name for e in table.read(["b", "b", "a"])] == ["b", "a"]
    assert table.read([]) == []


def test_a_bad_parameter_refuses_the_whole_update() -> None:
    table = ParameterTable()
    table.apply([P("a", b"1234")], 1)
    before = table.entry("a")
    bad = P("c", b"12345", dtype="<f4", shape=[1])
    with pytest.raises(RequestError) as info:
        table.apply([P("a", b"9999"), P("b"), bad], 2)
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    assert table.entry("a") is before and "b" not in table and len(table) == 1
    assert table.timestamp == 1


@pytest.mark.parametrize(
    ("params", "code"),
    [
        ([P("")], ErrorCode.BAD_REQUEST),
        ([P("a"), P("a")], ErrorCode.BAD_REQUEST),
        ([P("__metadata__")], ErrorCode.BAD_REQUEST),  # (a snapshot's own key)
        ([P("x" * 2000)], ErrorCode.LIMIT_EXCEEDED),
        ([P("é" * 600)], ErrorCode.LIMIT_EXCEEDED),  # 1200 bytes in UTF-8
        ([P("a", b"123", dtype="<f4")], ErrorCode.SHAPE_MISMATCH),
        ([P("a", b"1234", dtype="<f4", shape=[2])], ErrorCode.SHAPE_MISMATCH),
        ([P("a", b"1234", dtype="<f4", shape=[-1, -1])], ErrorCode.SHAPE_MISMATCH),
        ([P("a", b"1234", dtype="O")], ErrorCode.SHAPE_MISMATCH),
        ([P("a", b"1234", dtype="<U1")], ErrorCode.SHAPE_MISMATCH),
        ([P("a", b"1234", dtype="not a dtype")], ErrorCode.SHAPE_MISMATCH),
        ([P("a", b"1234", shape=[5])], ErrorCode.SHAPE_MISMATCH),
        ([P("a", None)], ErrorCode.BAD_REQUEST),
    ],
)
def test_bad_updates_are_refused_with_their_code(params, code) -> None:
    table = ParameterTable()
    with pytest.raises(RequestError) as info:
        table.apply(params, 1)
    assert info.value.code == code
    assert len(table) == 0


def test_limits_are_enforced() -> None:
    table = ParameterTable(limits=Limits(max_params_per_update=2, max_names_per_request=3))
    with pytest.raises(RequestError) as info:
        table.apply([P("a"), P("b"), P("c")], 1)
    assert info.value.code == ErrorCode.LIMIT_EXCEEDED
    with pytest.raises(RequestError):
        table.read(["a", "b", "c", "d"])


def test_versions_stop_at_the_i32_limit() -> None:
    table = ParameterTable()
    table.apply([P("a", version=MAX_VERSION)], 1)
    with pytest.raises(RequestError) as info:
        table.apply([P("a")], 2)
    assert info.value.code == ErrorCode.LIMIT_EXCEEDED
    assert table.entry("a").version == MAX_VERSION


def test_entries_are_read_only_and_independent_of_the_callers_buffer() -> None:
    table = ParameterTable()
    buf = bytearray(b"abcd")
    table.apply([P("a", buf)], 1)
    buf[:] = b"zzzz"
    entry = table.entry("a")
    assert bytes(entry.data) == b"abcd"
    assert entry.data.readonly
    with pytest.raises(TypeError):
        entry.data[0] = 1


def test_read_only_buffers_are_kept_without_a_copy() -> None:
    table = ParameterTable()
    data = memoryview(bytes(1 << 20)).toreadonly()
    table.apply([P("a", data)], 1)
    assert table.entry("a").data.obj is data.obj


def test_byte_accounting() -> None:
    table = ParameterTable()
    table.apply([P("a", b"x" * 10), P("b", b"y" * 5)], 1)
    table.apply([P("a", b"x" * 3)], 2)
    assert table.nbytes == 8


def test_numpy_parameters_of_every_layout_are_accepted() -> None:
    table = ParameterTable()
    arrays = {
        "f16": np.arange(6, dtype=np.float16).reshape(2, 3),
        "scalar": np.float64(1.5),
        "empty": np.zeros((0, 4), np.int32),
        "strided": np.arange(20, dtype=np.int64).reshape(4, 5)[:, ::2],
        "bool": np.array([True, False]),
        "complex": np.array([1 + 2j], np.complex64),
        "big_endian": np.arange(3, dtype=">u4"),
    }
    table.apply([to_parameter(k, v) for k, v in arrays.items()], 1)
    assert len(table) == len(arrays)
    assert table.entry("strided").shape == (4, 3)


# -- ParameterStore: the single writer ------------------------------------------


async def test_writer_applies_in_order_in_batches_and_feeds_subscribers() -> None:
    store = ParameterStore(ParameterTable("n"), max_batch=64)
    fed: list[list[str]] = []
    store.subscribe(lambda entries, replicated: fed.append([e.name for e in entries]))
    futures = [store.submit([P(f"p{i % 3}")], i) for i in range(100)]
    writer = asyncio.create_task(store.run())
    results = await asyncio.gather(*futures)
    assert [r.entries[0].version for r in results[:6]] == [1, 1, 1, 2, 2, 2]
    assert results[-1].timestamp == 99
    assert store.batches == 2  # 64 + 36: queued updates are applied together
    assert sum(len(f) for f in fed) == 100
    store.close()
    await writer


async def test_a_refused_update_fails_only_its_caller() -> None:
    store = ParameterStore()
    writer = asyncio.create_task(store.run())
    good = store.submit([P("a")], 1)
    bad = store.submit([P("")], 2)
    after = store.submit([P("a")], 3)
    assert (await good).entries[0].version == 1
    with pytest.raises(RequestError):
        await bad
    assert (await after).entries[0].version == 2
    store.close()
    await writer


async def test_a_full_queue_refuses_at_once_and_update_waits_for_room() -> None:
    store = ParameterStore(max_pending=2)
    first = store.submit([P("a")], 1)
    store.submit([P("a")], 2)
    with pytest.raises(RequestError) as info:
        store.submit([P("a")], 3)
    assert info.value.code == ErrorCode.UNAVAILABLE
    waiting = asyncio.create_task(store.update([P("a")], 4))
    await asyncio.sleep(0)
    assert not waiting.done()
    writer = asyncio.create_task(store.run())
    assert (await waiting).entries[0].version == 3
    assert first.done()
    store.close()
    await writer


async def test_close_applies_what_was_queued_then_refuses() -> None:
    store = ParameterStore()
    writer = asyncio.create_task(store.run())
    queued = store.submit([P("a")], 1)
    store.close()
    await writer
    assert queued.result().entries[0].version == 1
    with pytest.raises(RequestError) as info:
        store.submit([P("a")], 2)
    assert info.value.code == ErrorCode.UNAVAILABLE


async def test_a_failing_subscriber_does_not_stop_the_writer(caplog) -> None:
    store = ParameterStore()

    def broken(entries, replicated):
        raise RuntimeError("subscriber bug")

    store.subscribe(broken)
    writer = asyncio.create_task(store.run())
    assert (await store.submit([P("a")], 1)).entries[0].version == 1
    assert (await store.submit([P("a")], 2)).entries[0].version == 2
    assert "subscriber" in caplog.text
    store.close()
    await writer


async def test_a_cancelled_update_is_not_applied() -> None:
    store = ParameterStore()
    cancelled = store.submit([P("a")], 1)
    cancelled.cancel()
    kept = store.submit([P("b")], 2)
    writer = asyncio.create_task(store.run())
    await kept
    assert "a" not in store.table and "b" in store.table
    store.close()
    await writer


async def test_applied_waits_for_what_was_queued_before_it_only() -> None:
    store = ParameterStore()
    await store.applied()  # (nothing queued: at once, even with no writer)
    before = [store.submit([P("a")], i) for i in range(3)]
    barrier = asyncio.ensure_future(store.applied())
    after = store.submit([P("b")], 9)
    await asyncio.sleep(0)
    assert not barrier.done()  # (no writer yet)
    writer = asyncio.create_task(store.run())
    await barrier
    assert all(f.done() for f in before) and store.table.entry("a").version == 3
    assert store.updates_applied >= 3  # (the barrier itself is not an update)
    await after
    assert store.updates_applied == 4
    store.close()
    await writer


# -- merge: last writer wins on (version, origin) -----------------------------------


def R(name: str, version: int, origin: str, data: bytes = b"\x00") -> object:
    return thrift.Parameter(name=name, data=data, version=version, origin=origin)


def test_merge_keeps_the_given_version_and_origin() -> None:
    table = ParameterTable("here")
    applied = table.merge([R("a", 7, "there", b"x")], 5)
    assert [(e.version, e.origin) for e in applied.entries] == [(7, "there")]
    assert table.entry("a").origin == "there" and table.timestamp == 5
    # A local update after it bumps the version and takes the origin.
    assert table.apply([P("a")], 6).entries[0].version == 8
    assert table.entry("a").origin == "here"


def test_merge_lets_the_larger_version_then_the_larger_origin_win() -> None:
    table = ParameterTable()
    table.merge([R("a", 2, "n1", b"old")], 1)
    assert table.merge([R("a", 1, "n9", b"older")], 2).entries == ()
    assert table.merge([R("a", 2, "n0", b"tie, smaller origin")], 3).entries == ()
    assert table.merge([R("a", 2, "n1", b"duplicate")], 4).entries == ()
    assert bytes(table.entry("a").data) == b"old"
    assert len(table.merge([R("a", 2, "n2", b"tie, larger origin")], 5).entries) == 1
    assert len(table.merge([R("a", 3, "n0", b"newer")], 6).entries) == 1
    assert bytes(table.entry("a").data) == b"newer"


@pytest.mark.parametrize("bad", [R("a", 1, ""), R("a", 0, "n"), R("a", -3, "n")])
def test_merge_refuses_updates_without_origin_or_version(bad) -> None:
    with pytest.raises(RequestError) as info:
        ParameterTable().merge([bad], 1)
    assert info.value.code == ErrorCode.BAD_REQUEST


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(1, 5),
            st.sampled_from(["n1", "n2", "n3"]),
            st.binary(max_size=4),
        ),
        min_size=1,
        max_size=20,
    ),
    st.randoms(use_true_random=False),
)
def test_merge_ends_equal_whatever_the_order_and_duplication(updates, rnd) -> None:
    # Each (name, version, origin) is written once at its origin, so its bytes are fixed.
    canonical = {(n, v, o): d for n, v, o, d in updates}
    messages = [[R(n, v, o, canonical[(n, v, o)])] for n, v, o, _ in updates]
    shuffled = messages + rnd.sample(messages, len(messages) // 2)  # and some twice
    rnd.shuffle(shuffled)
    first, second = ParameterTable(), ParameterTable()
    for message in messages:
        first.merge(message, 1)
    for message in shuffled:
        second.merge(message, 1)
    view = lambda t: {  # noqa: E731
        n: (t.entry(n).version, t.entry(n).origin, bytes(t.entry(n).data)) for n in t.names()
    }
    assert view(first) == view(second)
    for name in view(first):
        best = max((v, o) for n, v, o, _ in updates if n == name)
        assert view(first)[name][:2] == best


async def test_the_writer_tells_subscribers_what_was_replicated() -> None:
    store = ParameterStore(ParameterTable("here"))
    fed: list[tuple[list[str], bool]] = []
    store.subscribe(lambda entries, replicated: fed.append(([e.name for e in entries], replicated)))
    local = store.submit([P("a")], 1)
    merged = store.submit([R("b", 3, "there")], 2, replicated=True)
    writer = asyncio.create_task(store.run())
    await asyncio.gather(local, merged)
    assert sorted(fed) == [(["a"], False), (["b"], True)]
    store.close()
    await writer
