"""A live node: gradient pushes, idempotent retries, encodings, delta pulls, waits, barriers."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from cluster_helpers import (
    LocalCluster,
    ProcessCluster,
    assert_,
    eventually,
    node_client,
    primary_of,
)

from aioparamsync import (
    CallTimeout,
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    ServerError,
    adam,
    sgd,
    sum_rule,
    thrift,
)
from aioparamsync.placement import Placement
from aioparamsync.server import holds as waiting_module
from aioparamsync.values.arrays import to_parameter
from aioparamsync.values.compression import encode

pytestmark = pytest.mark.timeout(60)


def ones(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


async def push(client: ParameterClient, grads: list, request_id: str | None = None) -> dict:
    """push_gradients with hand-made Parameters (as any Thrift client would send them)."""
    result = await client.call(
        "push_gradients", push=thrift.GradientPush(grads=grads, request_id=request_id)
    )
    return dict(result.versions)


# -- pushing gradients ----------------------------------------------------------------------


async def test_gradients_are_folded_by_each_parameters_rule(client: ParameterClient) -> None:
    await client.update_arrays(
        {"s": np.zeros(3, np.float32), "m": ones(2, 2), "a": np.zeros(4)},
        rules={"s": sum_rule(), "m": sgd(0.1, momentum=0.5), "a": adam(0.01)},
    )
    grads = {"s": ones(3), "m": ones(2, 2), "a": np.full(4, 2.0)}
    assert await client.push_gradients(grads) == {"s": 2, "m": 2, "a": 2}
    assert await client.push_gradients(grads) == {"s": 3, "m": 3, "a": 3}
    got = await client.get_arrays(["s", "m", "a"])
    np.testing.assert_array_equal(got["s"], [2, 2, 2])
    np.testing.assert_allclose(got["m"], np.full((2, 2), 1 - 0.1 - 0.1 * 1.5))
    np.testing.assert_allclose(got["a"], np.full(4, -0.02))  # adam moves lr per step at first
    info = await client.get_parameters(["m"])
    assert info.params[0].rule == sgd(0.1, momentum=0.5)


async def test_a_parameter_of_no_dimensions_folds_its_gradient_by_every_rule(
    client: ParameterClient,
) -> None:
    # (numpy's arithmetic on 0-d arrays answers scalars: the fold still makes an array)
    rules = {"s": sum_rule(), "m": sgd(0.1, momentum=0.5), "a": adam(0.01), "h": sgd(0.5)}
    scalars = {n: np.array(1.0, np.float16 if n == "h" else np.float32) for n in rules}
    await client.update_arrays(scalars, rules=rules)
    grads = {n: np.array(2.0, a.dtype) for n, a in scalars.items()}
    for version in (2, 4):
        assert await client.push_gradients(grads) == dict.fromkeys(rules, version)
        sent = [to_parameter(n, g) for n, g in grads.items()]  # (one Parameter each)
        assert await push(client, sent) == dict.fromkeys(rules, version + 1)
        grads = {n: g * 0.5 for n, g in grads.items()}
    got = await client.get_arrays(list(rules))
    assert all(got[n].shape == () and got[n].dtype == a.dtype for n, a in scalars.items())
    assert got["s"] == 1 + 2 + 2 + 1 + 1
    assert got["h"] == 1 - 0.5 * (2 + 2 + 1 + 1)


async def test_a_retried_push_is_applied_once(client: ParameterClient) -> None:
    await client.update_arrays({"w": np.zeros(2)}, rules=sum_rule())
    first = await client.push_gradients({"w": np.ones(2)}, request_id="step-1")
    again = await client.push_gradients({"w": np.ones(2)}, request_id="step-1")
    assert first == again == {"w": 2}
    # Sent twice at once: still once.
    both = await asyncio.gather(
        client.push_gradients({"w": np.ones(2)}, request_id="step-2"),
        client.push_gradients({"w": np.ones(2)}, request_id="step-2"),
    )
    assert both == [{"w": 3}, {"w": 3}]
    await client.push_gradients({"w": np.ones(2)})  # a new id each time
    await client.push_gradients({"w": np.ones(2)})
    assert (await client.get_arrays(["w"]))["w"].tolist() == [4.0, 4.0]
    counters = (await client.info()).counters
    assert counters["gradient_pushes_repeated"] == 2


async def test_a_refused_push_may_be_retried_under_its_id(client: ParameterClient) -> None:
    await client.update_arrays({"w": np.zeros(2)}, rules=sum_rule())
    with pytest.raises(RequestError) as info:
        await client.push_gradients({"w": np.ones(3)}, request_id="r")
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    assert await client.push_gradients({"w": np.ones(2)}, request_id="r") == {"w": 2}


@pytest.mark.parametrize(
    ("grads", "code", "words"),
    [
        ({"nope": ones(2)}, ErrorCode.UNKNOWN_PARAMETER, "'nope'"),
        ({"plain": ones(2)}, ErrorCode.BAD_REQUEST, "no rule"),
        ({"w": ones(3)}, ErrorCode.SHAPE_MISMATCH, "shape"),
        ({"w": ones(2), "nope": ones(1)}, ErrorCode.UNKNOWN_PARAMETER, "'nope'"),
    ],
)
async def test_bad_gradients_are_refused_whole(
    client: ParameterClient, grads: dict, code: ErrorCode, words: str
) -> None:
    await client.update_arrays({"w": ones(2), "plain": ones(2)}, rules={"w": sum_rule()})
    with pytest.raises(RequestError) as info:
        await client.push_gradients(grads)
    assert info.value.code == code
    assert words in str(info.value)
    got = await client.get_parameters(["w"])
    assert got.params[0].version == 1
    assert np.frombuffer(got.params[0].data, np.float32).tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("push_", "code"),
    [
        (thrift.GradientPush(grads=[], request_id=""), ErrorCode.BAD_REQUEST),
        (thrift.GradientPush(grads=[], request_id="x" * 257), ErrorCode.BAD_REQUEST),
        (
            thrift.GradientPush(grads=[thrift.Parameter(name="w", data=b"ab")]),
            ErrorCode.SHAPE_MISMATCH,  # "gradient 'w' has no dtype"
        ),
    ],
)
async def test_malformed_pushes_get_typed_errors(client: ParameterClient, push_, code) -> None:
    await client.update_arrays({"w": ones(2)}, rules=sum_rule())
    with pytest.raises(RequestError) as info:
        await client.call("push_gradients", push=push_)
    assert info.value.code == code
    assert await client.ping()  # the connection is fine


async def test_bad_rules_in_updates_are_refused(client: ParameterClient) -> None:
    with pytest.raises(RequestError) as info:
        await client.update_arrays({"w": ones(2)}, rules=thrift.Rule(kind="sgd", lr=-1.0))
    assert info.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(RequestError):
        await client.update_arrays({"w": np.arange(3)}, rules=sgd(0.1))  # integers
    assert (await client.get_parameters(["w"])).params == []


# -- encodings --------------------------------------------------------------------------------


async def test_encoded_gradients_and_error_feedback(client: ParameterClient) -> None:
    rng = np.random.default_rng(1)
    await client.update_arrays({"w": np.zeros(1000, np.float32)}, rules=sum_rule())
    total = np.zeros(1000)
    for _ in range(20):
        g = rng.standard_normal(1000).astype(np.float32)
        total += g
        await client.push_gradients({"w": g}, encoding="topk", ratio=0.1)
    got = (await client.get_arrays(["w"]))["w"]
    residual = client._feedback.residual("w")
    # Nothing is lost: what reached the node plus what waits in the residual
    # is everything that was pushed.
    np.testing.assert_allclose(got + residual, total, atol=1e-3)
    for encoding in ("fp16", "bf16", "int8", "zlib"):
        before = (await client.get_arrays(["w"]))["w"].astype(np.float64)
        g = rng.standard_normal(1000).astype(np.float32)
        await client.push_gradients({"w": g}, encoding=encoding, error_feedback=False)
        after = (await client.get_arrays(["w"]))["w"].astype(np.float64)
        tolerance = {"fp16": 2e-3, "bf16": 2e-2, "int8": np.abs(g).max() / 127, "zlib": 1e-6}
        assert np.abs(after - before - g).max() <= tolerance[encoding] * 1.01 + 1e-4


async def test_a_push_not_applied_leaves_error_feedback_as_it_was(client) -> None:
    g = np.array([4.0, 3.0, 2.0, 1.0], np.float32)
    await client.update_arrays({"w": np.zeros(4, np.float32)}, rules=sum_rule())
    await client.push_gradients({"w": g}, encoding="topk", ratio=0.5)  # sends 4 and 3
    kept = client._feedback.residual("w")
    with pytest.raises(RequestError) as refused:  # nothing applied: "missing" is unknown
        await client.push_gradients({"w": g, "missing": g}, encoding="topk", ratio=0.5)
    assert refused.value.code == ErrorCode.UNKNOWN_PARAMETER
    with pytest.raises(ValueError, match="non-finite"):  # never sent
        await client.push_gradients({"w": g, "v": np.array([np.inf])}, encoding="int8")
    np.testing.assert_array_equal(client._feedback.residual("w"), kept)
    assert client._feedback.residual("missing") is None
    await client.push_gradients({"w": np.zeros(4, np.float32)}, encoding="topk", ratio=1.0)
    # What reached the node is the one push that was applied, whole.
    np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], g)


async def test_a_push_retried_under_its_id_counts_once_with_error_feedback(client) -> None:
    g = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    await client.update_arrays({"w": np.zeros(4, np.float32)}, rules=sum_rule())
    first = await client.push_gradients({"w": g}, encoding="topk", ratio=0.25, request_id="s1")
    kept = client._feedback.residual("w")
    again = await client.push_gradients({"w": g}, encoding="topk", ratio=0.25, request_id="s1")
    assert again == first  # applied once, by the node
    np.testing.assert_array_equal(client._feedback.residual("w"), kept)  # counted once here
    for _ in range(4):  # what error feedback held back goes out
        await client.push_gradients({"w": np.zeros(4, np.float32)}, encoding="topk", ratio=0.25)
    np.testing.assert_array_equal((await client.get_arrays(["w"]))["w"], g)


async def test_updates_and_pulls_in_any_encoding(client: ParameterClient) -> None:
    w = np.linspace(-3, 3, 600, dtype=np.float32).reshape(20, 30)
    ints = np.arange(10, dtype=np.int64)
    await client.update_arrays({"w": w, "i": ints}, encoding="zlib")
    got = await client.get_arrays(["w", "i"])
    np.testing.assert_array_equal(got["w"], w)
    np.testing.assert_array_equal(got["i"], ints)
    for encoding, tolerance in [("fp16", 2e-3), ("bf16", 2e-2), ("int8", 3 / 254), ("zlib", 0)]:
        response = await client.get_parameters(["w", "i"], encoding=encoding)
        by_name = {p.name: p for p in response.params}
        assert by_name["w"].encoding == encoding
        # integers cannot go as floats: they come raw
        assert by_name["i"].encoding == (encoding if encoding == "zlib" else None)
        got = await client.get_arrays(["w", "i"], encoding=encoding)
        assert got["w"].shape == (20, 30) and got["w"].dtype == np.float32
        np.testing.assert_allclose(got["w"], w, atol=tolerance * 3 + 1e-7, rtol=tolerance)
        np.testing.assert_array_equal(got["i"], ints)
    zlib_bytes = sum(
        len(p.data) for p in (await client.get_parameters(["i"], encoding="zlib")).params
    )
    assert zlib_bytes < ints.nbytes


async def test_a_pull_in_int8_of_values_it_cannot_code_sends_them_raw(client) -> None:
    diverged = np.array([1.0, np.inf, np.nan, -2.0], np.float32)
    await client.update_arrays({"w": diverged, "ok": np.ones(3, np.float32)})
    response = await client.get_parameters(["w", "ok"], encoding="int8")
    by_name = {p.name: p for p in response.params}
    assert by_name["w"].encoding is None and by_name["ok"].encoding == "int8"
    got = await client.get_arrays(["w", "ok"], encoding="int8")
    np.testing.assert_array_equal(got["w"], diverged)  # (NaN equals NaN here)
    np.testing.assert_allclose(got["ok"], 1.0, rtol=1e-2)


async def test_topk_is_refused_for_updates(client: ParameterClient) -> None:
    values = np.arange(100, dtype=np.float32)
    with pytest.raises(ValueError, match="topk is for gradients"):
        await client.update_arrays({"w": values}, encoding="topk")
    # A client that encodes it anyway (another language, say) is refused by the node.
    from aioparamsync.values import compression

    update = thrift.ParameterUpdate(
        params=[compression.encode("w", values, "topk", ratio=0.1)], timestamp=1
    )
    with pytest.raises(RequestError, match="topk is for gradients") as info:
        await client.call("push_parameters", update=update)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert await client.get_arrays(["w"]) == {}


async def test_a_barrier_worker_is_a_name(client: ParameterClient) -> None:
    with pytest.raises(TypeError, match=r"names \(str\)"):
        await client.barrier("train", 0, 1, 1)  # type: ignore[arg-type]
    assert (await client.barrier("train", "rank0", 1, 1)).workers == ["rank0"]


async def test_bad_encodings_are_refused(node: Node, client: ParameterClient) -> None:
    await client.update_arrays({"w": ones(4)}, rules=sum_rule())
    with pytest.raises(RequestError) as info:
        await client.get_parameters(["w"], encoding="topk")
    assert info.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(RequestError):
        await client.get_parameters(["w"], encoding="gzip")
    # A few bytes of topk that claim a huge array: refused before any allocation.
    bomb = thrift.Parameter(
        name="w",
        data=np.ones(1, np.float32).tobytes(),
        dtype="<f4",
        shape=[1 << 40],
        encoding="topk",
        indices=np.zeros(1, "<i8").tobytes(),
    )
    with pytest.raises(RequestError) as info:
        await push(client, [bomb])
    assert info.value.code in (ErrorCode.LIMIT_EXCEEDED, ErrorCode.SHAPE_MISMATCH)
    corrupt = encode("w", ones(4), "zlib")
    corrupt.data = b"not zlib at all"
    for call in (push(client, [corrupt]), client.update_parameters([corrupt])):
        with pytest.raises(RequestError) as info:
            await call
        assert info.value.code in (ErrorCode.BAD_REQUEST, ErrorCode.SHAPE_MISMATCH)
    got = await client.get_parameters(["w"])
    assert got.params[0].version == 1
    assert node.store.updates_applied == 1


# -- delta pulls --------------------------------------------------------------------------------


async def test_delta_pulls_answer_only_what_changed(client: ParameterClient) -> None:
    versions = await client.update_arrays({"a": ones(1), "b": ones(1), "c": ones(1)})
    assert await client.get_arrays(None, known_versions=versions) == {}
    await client.update_arrays({"b": ones(1) * 2})
    changed = await client.get_arrays(["a", "b", "c"], known_versions=versions)
    assert list(changed) == ["b"] and changed["b"].tolist() == [2.0]
    everything = await client.get_arrays(None)
    assert sorted(everything) == ["a", "b", "c"]
    unknown = await client.get_arrays(None, known_versions={"a": 1})
    assert sorted(unknown) == ["b", "c"]  # never held: changed


async def test_a_delta_pull_with_origins_sees_a_writer_that_won_at_the_same_version(
    client: ParameterClient,
) -> None:
    async def replicated(origin: str, data: bytes) -> None:  # as a peer sends it on
        p = thrift.Parameter(name="w", data=data, version=2, origin=origin)
        update = thrift.ParameterUpdate([p], timestamp=1, from_peer="node-x")
        await client.call("broadcast_update", update=update)

    await replicated("node-a", b"aaaa")
    [held] = (await client.get_parameters(["w"])).params
    assert (held.version, held.origin) == (2, "node-a")
    await replicated("node-b", b"bbbb")  # written at once elsewhere: it wins, same version
    assert await client.get_arrays(["w"], known_versions={"w": 2}) == {}  # a version says no more
    changed = await client.get_parameters(["w"], known_versions={"w": (2, "node-a")})
    assert [(p.origin, bytes(p.data)) for p in changed.params] == [("node-b", b"bbbb")]
    assert await client.get_arrays(None, known_versions={"w": (2, "node-b")}) == {}
    assert await client.get_arrays(None, known_versions={"w": (3, "node-a")}) == {}


# -- long polls -------------------------------------------------------------------------------


async def test_a_long_poll_wakes_when_the_version_arrives(client: ParameterClient) -> None:
    await client.update_arrays({"w": ones(2)})
    poll = asyncio.ensure_future(client.get_arrays(["w"], min_version=3, wait=20))
    await eventually(lambda: _waiting(client, 1))
    info = await client.info()
    (waiter,) = info.waiting
    assert (waiter.kind, waiter.waiting_for) == ("pull", ["w"])
    assert "version >= 3" in waiter.what
    # Other calls are not held up behind it.
    started = time.monotonic()
    await client.update_arrays({"w": ones(2) * 2})
    assert time.monotonic() - started < 5
    assert not poll.done()
    await client.update_arrays({"w": ones(2) * 3})
    got = await asyncio.wait_for(poll, 10)
    assert got["w"].tolist() == [3.0, 3.0]
    assert (await client.info()).waiting == []


async def test_a_long_poll_already_satisfied_answers_at_once(client: ParameterClient) -> None:
    await client.update_arrays({"w": ones(2)})
    got = await client.get_arrays(["w"], min_version=1, wait=0)
    assert list(got) == ["w"]


async def test_a_long_poll_ends_at_its_deadline_naming_what_is_missing(
    client: ParameterClient,
) -> None:
    await client.update_arrays({"w": ones(2)})
    started = time.monotonic()
    with pytest.raises(RequestError) as info:
        await client.get_parameters(["w", "never"], min_version=2, wait=0.3)
    assert 0.25 < time.monotonic() - started < 5
    assert info.value.code == ErrorCode.TIMEOUT
    assert "'never'" in str(info.value) and "'w'" in str(info.value)
    counters = (await client.info()).counters
    assert counters["wait_timeouts"] == 1 and counters["long_polls_waiting"] == 0


async def test_the_founding_method_long_polls_too(node: Node, client: ParameterClient) -> None:
    request = thrift.ParameterRequest(param_names=["w"], min_version=1, wait_ms=5000)
    poll = asyncio.ensure_future(client.call("get_parameters", request=request))
    await eventually(lambda: _waiting(client, 1))  # the node holds the poll
    await client.update_arrays({"w": ones(1)})
    assert [p.name for p in (await poll).params] == ["w"]
    request.min_version, request.wait_ms = 9, 100
    with pytest.raises(ServerError, match="TIMEOUT"):
        await client.call("get_parameters", request=request)


async def test_a_long_poll_whose_caller_left_is_dropped(node: Node) -> None:
    def held() -> None:
        assert node.service.waiting.statistics()["long_polls_waiting"] == 1

    async with ParameterClient(node.address, timeout=2.0) as impatient:
        poll = asyncio.ensure_future(
            impatient.get_parameters(["w"], min_version=1, wait=30, timeout=2.0)
        )
        await eventually(held)  # the node holds the poll before its caller gives up
        with pytest.raises(CallTimeout):
            await poll

    def dropped() -> None:
        assert node.service.waiting.statistics()["long_polls_waiting"] == 0

    await eventually(dropped)


async def test_bad_long_polls_are_refused(client: ParameterClient) -> None:
    for request in (
        thrift.ParameterRequest(param_names=[], all_names=True, wait_ms=10),
        thrift.ParameterRequest(param_names=["w"], wait_ms=-1),
    ):
        with pytest.raises(RequestError) as info:
            await client.call("pull_parameters", request=request)
        assert info.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(ValueError):
        await client.get_parameters(["w"], wait=-1)


async def _waiting(client: ParameterClient, n: int) -> None:
    waiting = (await client.info()).waiting or []
    assert len(waiting) == n, waiting


# -- barriers -----------------------------------------------------------------------------------


async def test_a_barrier_opens_when_every_worker_arrives(client: ParameterClient) -> None:
    first = [
        asyncio.ensure_future(client.barrier("train", f"w{i}", 1, 3, timeout=20)) for i in (0, 1)
    ]
    await eventually(lambda: _waiting(client, 2))
    waiters = (await client.info()).waiting
    assert {w.who for w in waiters} == {"w0", "w1"}
    assert all(w.kind == "barrier" and w.waiting_for == ["1 never seen"] for w in waiters)
    assert not any(f.done() for f in first)
    last = await client.barrier("train", "w2", 1, 3, timeout=20)
    results = [await asyncio.wait_for(f, 10) for f in first]
    for result in [*results, last]:
        assert (result.group, result.step, result.workers) == ("train", 1, ["w0", "w1", "w2"])
    # A worker ahead waits for the one behind, and says who.
    ahead = asyncio.ensure_future(client.barrier("train", "w0", 2, 3, timeout=20))
    await eventually(lambda: _waiting(client, 1))
    (waiter,) = (await client.info()).waiting
    assert sorted(waiter.waiting_for) == ["w1 (at step 1)", "w2 (at step 1)"]
    middle = asyncio.ensure_future(client.barrier("train", "w1", 2, 3, timeout=20))
    await eventually(lambda: _waiting(client, 2))
    assert not ahead.done()
    await client.barrier("train", "w2", 2, 3, timeout=20)
    assert (await asyncio.wait_for(ahead, 10)).step == 2
    assert (await asyncio.wait_for(middle, 10)).step == 2


async def test_a_barrier_times_out_naming_the_absent(client: ParameterClient) -> None:
    await asyncio.gather(
        client.barrier("g", "a", 1, 2, timeout=5), client.barrier("g", "b", 1, 2, timeout=5)
    )
    with pytest.raises(RequestError) as info:
        await client.barrier("g", "a", 2, 2, timeout=0.2)
    assert info.value.code == ErrorCode.TIMEOUT
    assert "b (at step 1)" in str(info.value)
    assert (await client.info()).waiting == []


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (thrift.BarrierRequest(group="", worker="a", step=1, world_size=2), "group"),
        (thrift.BarrierRequest(group="g", worker="", step=1, world_size=2), "worker"),
        (thrift.BarrierRequest(group="g", worker="a", step=1, world_size=0), "world_size"),
        (thrift.BarrierRequest(group="g", worker="a", step=1, world_size=10**9), "world_size"),
        (thrift.BarrierRequest(group="g", worker="a", step=1, world_size=2, wait_ms=-5), "wait"),
    ],
)
async def test_bad_barriers_are_refused(client: ParameterClient, request_, words: str) -> None:
    with pytest.raises(RequestError) as info:
        await client.call("barrier", request=request_)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert words in str(info.value)


async def test_a_barrier_group_keeps_its_size_and_its_workers(client: ParameterClient) -> None:
    one = asyncio.ensure_future(client.barrier("g", "a", 1, 2, timeout=10))
    await eventually(lambda: _waiting(client, 1))
    with pytest.raises(RequestError, match="world_size 2"):
        await client.barrier("g", "b", 1, 3, timeout=1)
    await client.barrier("g", "b", 1, 2, timeout=10)
    await one
    with pytest.raises(RequestError, match="one more"):
        await client.barrier("g", "c", 1, 2, timeout=1)


async def test_a_barrier_group_starts_afresh_for_a_new_run(client: ParameterClient) -> None:
    await asyncio.gather(*(client.barrier("run", f"w{i}", 100, 2, timeout=10) for i in range(2)))
    # The job starts again (or w0 goes back to a checkpoint): at step 0, w0 waits
    # for w1, not let through by the steps of the run before.
    early = asyncio.ensure_future(client.barrier("run", "w0", 0, 2, timeout=10))
    await eventually(lambda: _waiting(client, 1))
    assert not early.done()
    await client.barrier("run", "w1", 0, 2, timeout=10)
    assert (await early).workers == ["w0", "w1"]
    # Started again with another size while nobody waits: a new group, not a refusal.
    three = [client.barrier("run", f"w{i}", 1, 3, timeout=10) for i in range(3)]
    assert [r.workers for r in await asyncio.gather(*three)] == [["w0", "w1", "w2"]] * 3


# -- durability and the cluster --------------------------------------------------------------


async def test_rules_survive_a_restart(tmp_path) -> None:
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address) as client,
    ):
        await client.update_arrays({"w": ones(2), "v": ones(2)}, rules={"w": sgd(0.5)})
        await client.push_gradients({"w": ones(2)})
    # once from the log, once from a snapshot
    for _ in range(2):
        async with (
            Node("127.0.0.1", 0, data_dir=tmp_path) as node,
            ParameterClient(node.address) as client,
        ):
            got = await client.get_parameters(["w", "v"])
            rules_ = {p.name: p.rule for p in got.params}
            assert rules_ == {"w": sgd(0.5), "v": None}
            await client.push_gradients({"w": ones(2)})
            await client.update_arrays({"w": np.zeros(2, np.float32)})  # (keeps the rule)
            await client.push_gradients({"w": ones(2)})
            assert (await client.get_arrays(["w"]))["w"].tolist() == [-0.5, -0.5]


async def test_gradients_pushed_at_every_node_are_all_folded() -> None:
    """Each node passes a name's gradients to the one node that folds them: none is lost."""
    procs = ProcessCluster(repair_interval=0.5)
    try:
        a = await procs.spawn()
        b = await procs.spawn(peers=[a])
        c = await procs.spawn(peers=[a])
        nodes = [a, b, c]
        clients = [n.client() for n in nodes]
        try:

            async def meshed() -> None:
                infos = [await cl.info() for cl in clients]
                ups = [len([p for p in i.peers or [] if p.state == "up"]) for i in infos]
                assert ups == [2] * len(clients), f"peers up: {ups}; infos: {infos}"

            await eventually(meshed, timeout=20)
            names = [f"layer{i}" for i in range(8)]
            await clients[0].update_arrays(
                {n: np.zeros(16, np.float32) for n in names}, rules=sum_rule()
            )

            async def worker(cl: ParameterClient) -> None:
                # As a worker starts: the initial values, once its node has them.
                await cl.get_arrays(names, min_version=1, wait=10)
                for _ in range(40):
                    await cl.push_gradients({n: ones(16) for n in names})

            await asyncio.gather(*(worker(cl) for cl in clients))

            async def folded() -> None:
                for cl in clients:
                    got = await cl.get_arrays(names)
                    wrong = {n: g.tolist() for n, g in got.items() if g.tolist() != [120.0] * 16}
                    assert not wrong, wrong

            await eventually(folded, timeout=20)
            counters = [(await cl.info()).counters for cl in clients]
            assert sum(c["gradient_pushes_forwarded"] for c in counters) > 0
            assert sum(c["gradient_forward_failures"] for c in counters) == 0
        finally:
            for cl in clients:
                await cl.close()
    finally:
        await procs.close()


async def test_a_part_passed_on_to_a_node_that_is_not_its_primary_is_refused() -> None:
    """A node passes a part on with its epoch; the receiver folds it only as the
    name's primary, else answers MOVED and folds nothing. A part sent to a next
    replica (its owner out of reach) goes without an epoch and is folded there."""
    cluster = LocalCluster()
    try:
        a = await cluster.start()
        b = await cluster.start(peers=[a])
        await cluster.formed([a, b])
        async with node_client(a.address) as ca:
            await ca.update_arrays({"w": np.zeros(2, np.float32)}, rules=sum_rule())
        primary = primary_of([a, b], "w")
        other = b if primary is a else a
        await eventually(lambda: assert_("w" in other.table), timeout=10)
        grads = [to_parameter("w", ones(2))]
        async with node_client(other.address) as client:
            part = thrift.GradientPush(
                grads=grads, request_id="r1", forwarded=True, epoch=other.cluster.epoch
            )
            with pytest.raises(RequestError) as info:
                await client.call("push_gradients", push=part)
            assert info.value.code == ErrorCode.MOVED
            assert info.value.epoch == other.cluster.epoch and "not the primary" in str(info.value)
            assert other.table.entry("w").version == 1  # nothing folded
            # The same part without an epoch: a next replica's, folded where it arrives.
            part = thrift.GradientPush(grads=grads, request_id="r1", forwarded=True)
            versions = dict((await client.call("push_gradients", push=part)).versions)
            assert versions == {"w": 2}
        async with node_client(primary.address) as client:
            part = thrift.GradientPush(
                grads=grads, request_id="r2", forwarded=True, epoch=primary.cluster.epoch
            )
            assert dict((await client.call("push_gradients", push=part)).versions) == {"w": 3}
            assert (await client.get_arrays(["w"], min_version=3, wait=5))["w"].tolist() == [2, 2]
    finally:
        await cluster.close()


async def test_no_gradient_is_lost_while_a_node_joins_and_takes_over_names() -> None:
    """Pushes go on at two nodes while a third joins and becomes the primary of some
    of their names: every gradient is folded once (two primaries of one name at
    once would each make its next version, and last-writer-wins drop one)."""
    procs = ProcessCluster(repair_interval=0.5)
    clients: list[ParameterClient] = []
    try:
        a = await procs.spawn()
        b = await procs.spawn(peers=[a])
        clients = [a.client(), b.client()]

        async def meshed(n: int) -> None:
            infos = [await cl.info() for cl in clients]
            ups = [len([p for p in i.peers or [] if p.state == "up"]) for i in infos]
            assert ups == [n - 1] * n, f"peers up: {ups}"

        await eventually(lambda: meshed(2), timeout=20)
        names = [f"layer{i}" for i in range(24)]
        await clients[0].update_arrays(
            {n: np.zeros(4, np.float32) for n in names}, rules=sum_rule()
        )
        pushes = {"a": 60, "b": 60, "c": 30}
        pushed = {"a": 0, "b": 0, "c": 0}

        async def worker(label: str, cl: ParameterClient) -> None:
            await cl.get_arrays(names, min_version=1, wait=20)
            for _ in range(pushes[label]):
                await cl.push_gradients({n: ones(4) for n in names})
                pushed[label] += 1
                await asyncio.sleep(0.005)

        workers = [
            asyncio.ensure_future(worker(x, cl)) for x, cl in zip("ab", clients, strict=True)
        ]
        await eventually(lambda: assert_(pushed["a"] >= 10), timeout=20)
        c = await procs.spawn(peers=[a])  # (joins while a and b push)
        clients.append(c.client())
        workers.append(asyncio.ensure_future(worker("c", clients[2])))
        await asyncio.gather(*workers)
        assert pushed["a"] + pushed["b"] < sum(pushes.values()), "c joined after the pushes"

        topology = await clients[0].topology()
        placement = Placement([m.node_id for m in topology.members], None)
        taken = [
            n for n in names if placement.primary(n, {c.node_id, a.node_id, b.node_id}) == c.node_id
        ]
        assert taken, "the node that joined is the primary of none of the names"
        total = float(sum(pushes.values()))

        async def folded() -> None:
            for cl in clients:
                got = await cl.get_arrays(names)
                wrong = {n: g[0] for n, g in got.items() if g.tolist() != [total] * 4}
                assert not wrong, f"{len(wrong)} of {len(names)} wrong: {wrong}"

        await eventually(folded, timeout=20)
    finally:
        for cl in clients:
            await cl.close()
        await procs.close()


async def test_plain_bytes_pull_zlib_encoded(client: ParameterClient) -> None:
    await client.update_parameters([thrift.Parameter(name="blob", data=b"seed bytes " * 100)])
    response = await client.get_parameters(["blob"], encoding="zlib")
    (p,) = response.params
    assert p.encoding == "zlib" and p.dtype is None and len(p.data) < 1100
    got = await client.get_arrays(["blob"], encoding="zlib")
    assert got["blob"].tobytes() == b"seed bytes " * 100


async def test_client_side_mistakes_are_clear_errors(client: ParameterClient) -> None:
    with pytest.raises(TypeError, match="mapping"):
        await client.push_gradients([ones(2)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="encoding"):
        await client.push_gradients({"w": ones(2)}, encoding="gzip")
    with pytest.raises(TypeError):
        await client.push_gradients({"w": np.arange(3)}, encoding="fp16")  # integers
    with pytest.raises(TypeError, match="mapping"):
        await client.update_parameters([thrift.Parameter(name="w", data=b"x")], encoding="zlib")
    with pytest.raises(TypeError, match="one string"):
        await client.get_arrays("w")  # type: ignore[arg-type]
    assert (await client.info()).counters["requests"] == 1  # only info reached the node


async def test_a_decoded_update_is_stored_without_a_copy(
    node: Node, client: ParameterClient
) -> None:
    await client.update_arrays({"w": np.arange(1000, dtype=np.float32)}, encoding="zlib")
    entry = node.store.table.entry("w")
    assert entry is not None and entry.data.readonly
    # The entry holds the decoded array itself, not bytes copied out of it.
    assert isinstance(entry.data.obj, np.ndarray)


async def test_a_full_node_forgets_an_idle_barrier_group_for_a_new_one(
    node: Node, client: ParameterClient, monkeypatch
) -> None:
    monkeypatch.setattr(waiting_module, "MAX_GROUPS", 2)

    async def both(group: str, step: int) -> None:
        a, b = (client.barrier(group, w, step, 2, timeout=10) for w in ("a", "b"))
        assert [r.step for r in await asyncio.gather(a, b)] == [step, step]

    for group in ("old", "recent"):  # both workers came: nobody waits
        await both(group, 1)
    await both("new", 1)
    assert sorted(node.service.waiting._groups) == ["new", "recent"]  # the oldest went
    # With a worker waiting in each group, none can go: a new one is refused.
    held = asyncio.ensure_future(client.barrier("recent", "a", 2, 2, timeout=20))
    waits = asyncio.ensure_future(client.barrier("new", "a", 2, 2, timeout=20))
    await eventually(lambda: _waiting(client, 2))
    with pytest.raises(RequestError) as info:
        await client.barrier("third", "w", 1, 1, timeout=10)
    assert info.value.code == ErrorCode.LIMIT_EXCEEDED
    for group, pending in (("recent", held), ("new", waits)):
        await client.barrier(group, "b", 2, 2, timeout=10)
        assert (await asyncio.wait_for(pending, 10)).step == 2


async def test_a_barrier_waiter_whose_caller_left_is_dropped(node: Node) -> None:
    request = thrift.BarrierRequest(group="g", worker="a", step=1, world_size=2, wait_ms=30_000)

    def held() -> None:
        assert node.service.waiting.statistics()["barrier_waiters"] == 1

    async with ParameterClient(node.address) as impatient:
        call = asyncio.ensure_future(impatient.call("barrier", timeout=2.0, request=request))
        await eventually(held)  # the node holds the waiter before its caller gives up
        with pytest.raises(CallTimeout):
            await call

    def dropped() -> None:
        assert node.service.waiting.statistics()["barrier_waiters"] == 0
        assert node.service.waiting.report() == []

    await eventually(dropped)
