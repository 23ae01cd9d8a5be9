"""ParameterClient against a real node on 127.0.0.1: semantics, concurrency, failures."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from raw_helpers import slow_link

from aioparamsync import (
    CallTimeout,
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    ServerError,
    __version__,
    sgd,
    thrift,
    to_parameter,
)
from aioparamsync.client import connection as client_module
from aioparamsync.client.addresses import parse_address
from aioparamsync.wire import MessageType, Receiver, decode_header, encode_message, method


async def test_update_then_get_round_trips_arrays_and_versions(client: ParameterClient) -> None:
    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    versions = await client.update_arrays({"w": w, "b": np.zeros(4, np.float16)})
    assert versions == {"w": 1, "b": 1}
    assert await client.update_arrays({"w": w * 2}) == {"w": 2}
    arrays = await client.get_arrays(["w", "b", "missing"])
    assert set(arrays) == {"w", "b"}
    np.testing.assert_array_equal(arrays["w"], w * 2)
    assert arrays["b"].dtype == np.float16 and not arrays["w"].flags.writeable


async def test_get_parameters_honours_min_version_and_reports_the_timestamp(client) -> None:
    await client.update_parameters({"a": [1], "b": [2]}, timestamp=1000)
    await client.update_parameters({"b": [3]}, timestamp=500)
    response = await client.get_parameters(["a", "b"], min_version=2)
    assert [(p.name, p.version) for p in response.params] == [("b", 2)]
    assert response.timestamp == 1000


async def test_a_given_version_is_honoured_when_larger(client) -> None:
    param = to_parameter("w", np.ones(2), version=40)
    assert await client.update_parameters([param]) == {"w": 40}
    assert await client.update_parameters({"w": np.ones(2)}) == {"w": 41}


async def test_refused_updates_raise_typed_errors_and_change_nothing(client) -> None:
    await client.update_arrays({"a": np.ones(2)})
    bad = to_parameter("b", np.ones(2))
    bad.shape = [3]
    with pytest.raises(RequestError) as info:
        await client.update_parameters([to_parameter("a", np.zeros(2)), bad])
    assert info.value.code == ErrorCode.SHAPE_MISMATCH
    assert "'b'" in info.value.message
    arrays = await client.get_arrays(["a", "b"])
    assert list(arrays) == ["a"] and arrays["a"].tolist() == [1.0, 1.0]
    with pytest.raises(RequestError) as info:
        await client.update_arrays({"": np.ones(1)})
    assert info.value.code == ErrorCode.BAD_REQUEST


async def test_misuse_of_the_api_is_a_clear_local_error(client) -> None:
    with pytest.raises(TypeError, match="list of names"):
        await client.get_parameters("w")
    with pytest.raises(TypeError, match="mapping"):
        await client.update_arrays([np.ones(1)])
    with pytest.raises(TypeError):
        await client.update_parameters([1, 2])
    with pytest.raises(TypeError, match="cannot send"):
        await client.update_arrays({"s": np.array(["text"])})


async def test_500_coroutines_share_one_client(node: Node) -> None:
    async with ParameterClient(node.address, max_connections=4) as client:

        async def worker(i: int) -> None:
            value = np.full(16, i, np.int64)
            versions = await client.update_arrays({f"p{i}": value, "shared": value})
            assert versions[f"p{i}"] == 1
            got = await client.get_arrays([f"p{i}", "shared"])
            np.testing.assert_array_equal(got[f"p{i}"], value)
            shared = got["shared"]
            assert (shared == shared[0]).all()  # some worker's whole value, never a mix

        await asyncio.gather(*(worker(i) for i in range(500)))
        assert len(client._connections) <= 4
        response = await client.get_parameters(["shared"])
        assert response.params[0].version == 500
    assert len(node.table) == 501


async def test_one_connection_pipelines_many_calls(node: Node) -> None:
    # (shared_memory=0: on TCP, not moved to the node's Unix socket: one connection)
    async with ParameterClient(node.address, max_connections=1, shared_memory=0) as client:
        results = await asyncio.gather(*(client.update_arrays({f"k{i}": [i]}) for i in range(200)))
        assert all(r == {f"k{i}": 1} for i, r in enumerate(results))
        assert len(client._connections) == 1
        assert "Connections: 0 active, 1 idle" in repr(client)
    assert node.server.counters["connections_total"] == 1


async def test_no_reader_sees_half_an_update(node: Node) -> None:
    names = [f"layer{i}" for i in range(8)]
    stop = asyncio.Event()

    async def writer(client: ParameterClient) -> int:
        step = 0
        while not stop.is_set() and step < 300:
            step += 1
            await client.update_arrays({n: np.full(1024, step, np.int32) for n in names})
        return step

    async def reader(client: ParameterClient) -> int:
        checks = 0
        while not stop.is_set() and checks < 300:
            response = await client.get_parameters(names)
            steps = {int(np.frombuffer(p.data, np.int32)[0]) for p in response.params}
            versions = {p.version for p in response.params}
            assert len(steps) <= 1 and len(versions) <= 1, (steps, versions)
            if response.params:
                assert len(response.params) == len(names)
            checks += 1
        return checks

    async with ParameterClient(node.address) as w, ParameterClient(node.address) as r:
        tasks = [asyncio.create_task(writer(w))] + [
            asyncio.create_task(reader(r)) for _ in range(4)
        ]
        done = await tasks[0]
        stop.set()
        checks = await asyncio.gather(*tasks[1:])
    assert done > 0 and sum(checks) > 0


async def test_a_oneway_broadcast_is_read_by_the_next_call(node: Node) -> None:
    async with ParameterClient(node.address, max_connections=1) as client:
        for i in range(20):
            await client.broadcast_update({"w": np.full(3, i)})
            assert (await client.get_arrays(["w"]))["w"].tolist() == [i] * 3
        assert (await client.get_parameters(["w"])).params[0].version == 20


async def test_large_parameters_round_trip_with_bounded_queues(node: Node) -> None:
    rng = np.random.default_rng(1)
    arrays = {f"big{i}": rng.standard_normal(1 << 20) for i in range(8)}  # 8 x 8 MiB
    async with ParameterClient(node.address, max_connections=2) as client:
        await asyncio.gather(*(client.update_arrays({k: v}) for k, v in arrays.items()))
        got = await asyncio.gather(*(client.get_arrays([k]) for k in arrays))
    for (name, arr), result in zip(arrays.items(), got, strict=True):
        np.testing.assert_array_equal(result[name], arr)


async def test_ping_and_info(client: ParameterClient, node: Node) -> None:
    assert await client.ping() == node.node_id == "{}:{}".format(*node.address)
    await client.update_arrays({"w": np.zeros(10, np.float32)})
    info = await client.info()
    assert info.node_id == node.node_id
    assert info.parameter_count == 1 and info.parameter_bytes == 40
    assert info.counters["requests"] >= 3 and info.counters["updates_applied"] == 1


def _readme_on_info() -> tuple[set[str], set[str]]:
    """docs/quickstart.md's bullet on ``info()``: (the NodeInfo fields, the counters it names)."""
    readme = (Path(__file__).parent.parent / "docs" / "quickstart.md").read_text(encoding="utf-8")
    start = readme.index("- `ping()`, `info()`")
    bullet = readme[start : readme.index("\n- ", start + 1)]
    names = set(re.findall(r"`([a-z_]+)`", bullet))
    fields = {spec[1] for spec in thrift.NodeInfo.thrift_spec.values()}
    return names & fields, names - fields


async def test_info_answers_what_the_readme_says(node: Node) -> None:
    fields, counters = _readme_on_info()
    assert fields == {
        "node_id", "version", "parameter_count", "parameter_bytes", "timestamp",
        "uptime_seconds", "counters", "peers", "waiting", "state", "topology", "keys_moving",
        "under_replicated",
    }  # fmt: skip
    assert {"requests", "errors", "bytes_in", "bytes_out", "updates_applied"} <= counters
    # (route=False: the requests counted are these alone, no topology asked for;
    # shared_memory=0: nor the node's Unix socket)
    async with ParameterClient(node.address, timeout=30, route=False, shared_memory=0) as client:
        first = await client.info()
        # Every counter is there from the start, at 0 until it counts.
        assert counters <= set(first.counters), counters - set(first.counters)
        assert first.counters["errors"] == first.counters["protocol_errors"] == 0
        assert first.counters["requests"] == 1  # this info call
        assert (first.parameter_count, first.parameter_bytes, first.timestamp) == (0, 0, 0)
        assert (first.peers, first.waiting) == ([], [])

        await client.update_arrays({"w": np.zeros((3, 4), np.float32)}, timestamp=5000)
        await client.update_arrays({"b": np.zeros(2)}, timestamp=4000)
        with pytest.raises(RequestError):  # refused: counted as an error, not applied
            await client.update_arrays({"w": np.zeros(2)}, timestamp=9000)
        poll = asyncio.ensure_future(client.get_parameters(["w", "b"], 5, wait=30))
        await _until(lambda: node.service.waiting.statistics()["long_polls_waiting"] == 1)
        received = client.traffic["bytes_received"]
        info = await client.info()

        assert info.node_id == node.node_id
        assert info.version == __version__  # the release the node runs
        assert (info.parameter_count, info.parameter_bytes) == (2, 48 + 16)
        assert info.timestamp == 5000  # the largest timestamp of the updates applied
        assert 0 <= first.uptime_seconds <= info.uptime_seconds
        c = info.counters
        assert c["requests"] == 6  # every message: 2 infos, 3 updates, the poll
        assert (c["errors"], c["updates_applied"], c["updates_refused"]) == (1, 2, 1)
        assert c["bytes_in"] == client.traffic["bytes_sent"]  # the info call's included
        assert c["bytes_out"] == received  # (the info's own reply comes after)
        assert c["connections_total"] == client.connects == 2  # the pool's, the poll's
        assert c["long_polls_waiting"] == 1
        (waiter,) = info.waiting
        assert (waiter.kind, sorted(waiter.waiting_for)) == ("pull", ["b", "w"])
        assert waiter.seconds >= 0
        poll.cancel()


async def _until(condition) -> None:
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 (the node's state has no event to await)
            await asyncio.sleep(0.001)


# -- failures --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_no_node_is_a_connect_error() -> None:
    async with ParameterClient(("127.0.0.1", _free_port()), connect_timeout=2) as client:
        with pytest.raises(ConnectError, match="cannot connect"):
            await client.ping()


async def test_a_closed_client_refuses_calls(node: Node) -> None:
    client = ParameterClient(node.address)
    async with client:
        await client.ping()
    with pytest.raises(ClientClosedError):
        await client.ping()


async def test_a_broken_connection_is_replaced(node: Node) -> None:
    async with ParameterClient(node.address, max_connections=1) as client:
        await client.update_arrays({"w": [1.0]})
        for conn in list(node.server.connections):
            conn.abort()
        # The read finds its connection dead (at once, or when it sends) and retries.
        assert (await client.get_arrays(["w"]))["w"].tolist() == [1.0]
        assert await client.update_arrays({"w": [2.0]}) == {"w": 2}
    assert node.server.counters["connections_total"] == 2


@contextlib.asynccontextmanager
async def scripted_server(on_frame):
    """A bare TCP peer that calls ``on_frame(writer, name, seqid)`` for each framed call."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        receiver = Receiver(framed=True)
        try:
            while data := await reader.read(65536):
                for frame in receiver.feed(data):
                    name, _, seqid, _ = decode_header(frame.payload, frame.protocol)
                    await on_frame(writer, name, seqid)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        server.close()


def _ping_reply(seqid: int, text: str) -> list:
    result = method("ping").result(success=text)
    return encode_message("ping", MessageType.REPLY, seqid, result)[0]


async def test_a_late_reply_is_dropped_not_given_to_the_next_call() -> None:
    tasks: set[asyncio.Future] = set()
    release_first = asyncio.Event()
    first_sent = asyncio.Event()
    seqids: list[int] = []  # of the calls, in the order they came

    async def answer(writer, name, seqid):
        seqids.append(seqid)
        n = len(seqids)
        first = n == 1

        async def later():
            if first:
                await release_first.wait()
            writer.writelines(_ping_reply(seqid, f"reply-to-{n}"))
            if first:
                first_sent.set()

        tasks.add(asyncio.ensure_future(later()))

    async with (
        scripted_server(answer) as address,
        # (shared_memory=0: no info call asking for a Unix socket among the pings)
        ParameterClient(address, max_connections=1, shared_memory=0) as client,
    ):
        with pytest.raises(CallTimeout, match="ping"):
            await client.ping(timeout=0.1)
        assert await client.ping() == "reply-to-2"
        release_first.set()  # the late reply to call 1 arrives, and is dropped
        await first_sent.wait()
        assert await client.ping() == "reply-to-3"
    assert len(set(seqids)) == 3


async def test_a_connection_lost_mid_call_fails_it_clearly() -> None:
    async def hang_up(writer, name, seqid):
        writer.transport.abort()

    async with scripted_server(hang_up) as address, ParameterClient(address) as client:
        with pytest.raises(ConnectionLostError, match="broke"):
            await client.update_arrays({"w": [1]})  # a write is never retried
        with pytest.raises(ConnectionLostError):
            await client.ping()  # a read is retried once, then fails


async def test_an_application_exception_is_a_server_error() -> None:
    async def unknown(writer, name, seqid):
        from thriftpy2.thrift import TApplicationException

        error = TApplicationException(TApplicationException.UNKNOWN_METHOD, "no such method")
        writer.writelines(encode_message(name, MessageType.EXCEPTION, seqid, error)[0])

    async with scripted_server(unknown) as address, ParameterClient(address) as client:
        with pytest.raises(ServerError, match="no such method") as info:
            await client.ping()
        assert info.value.type == 1


@pytest.mark.parametrize("timeout", [None, 30.0])
async def test_a_reply_that_cannot_be_decoded_fails_its_own_call(timeout) -> None:
    async def bad_text(writer, name, seqid):
        head = encode_message("ping", MessageType.REPLY, seqid, method("ping").result())[0]
        body = b"\x0b\x00\x00" + (1).to_bytes(4, "big") + b"\xff" + b"\x00"  # b"\xff": no UTF-8
        message = b"".join(bytes(part) for part in head)[4:-1] + body
        writer.write(len(message).to_bytes(4, "big") + message)

    async with (
        scripted_server(bad_text) as address,
        ParameterClient(address, timeout=timeout) as client,
    ):
        # Not left waiting for its deadline, or forever without one.
        with pytest.raises(ConnectionLostError, match="UTF-8"):
            await asyncio.wait_for(client.ping(), 10)


async def test_calls_woken_by_flow_control_send_one_message_at_a_time(monkeypatch) -> None:
    mib = 1024 * 1024

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.5)  # reads nothing till then: the client's buffer fills
        with contextlib.suppress(ConnectionError):
            while await reader.read(mib):
                pass
        writer.close()

    unsent: list[int] = []  # bytes waiting in the transport after each call is sent
    send = client_module._Connection.send

    def counting_send(self, m, args, when):
        sent = send(self, m, args, when)
        unsent.append(self.transport.get_write_buffer_size())
        return sent

    monkeypatch.setattr(client_module._Connection, "send", counting_send)
    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    try:
        address = server.sockets[0].getsockname()[:2]
        async with ParameterClient(address, timeout=1.5, max_connections=1, route=False) as client:
            updates = [client.update_arrays({f"w{i}": np.zeros(mib, np.float32)}) for i in range(8)]
            await asyncio.gather(*updates, return_exceptions=True)  # (no replies: timeouts)
    finally:
        server.close()
    assert len(unsent) > 1
    # Each woken call looks again before it sends: one 4 MiB message past the
    # 1 MiB mark at a time, never all eight at once.
    assert max(unsent) <= 2 * 4 * mib + mib, [n // mib for n in unsent]


async def test_a_write_that_timed_out_unsent_is_never_finished_from_changed_memory(
    node: Node,
) -> None:
    w = np.ones(16 * 1024 * 1024, np.float32)  # 64 MiB: most of it waits in the client
    async with (
        slow_link(node.address, first_read_after=1.0) as address,  # reads nothing for 1 s
        ParameterClient(address, timeout=0.3) as client,
    ):
        with pytest.raises(CallTimeout):
            await client.update_arrays({"w": w})
        w[:] = 2  # the call has failed: the caller may change its array
        await asyncio.sleep(1.5)  # the link reads again
    # Not a mix of ones and twos: nothing, since the rest was never sent.
    stored = node.store.table.entry("w")
    assert stored is None or len(set(np.frombuffer(stored.data, np.float32)[:: 1 << 16])) == 1


async def test_a_small_call_timing_out_leaves_a_large_one_on_its_connection(
    node: Node,
) -> None:
    w = np.ones(16 * 1024 * 1024, np.float32)  # 64 MiB, waiting in the client's buffer
    async with (
        slow_link(node.address, first_read_after=1.0) as address,  # reads nothing for 1 s
        ParameterClient(address, timeout=30, max_connections=1) as client,
    ):
        ping = asyncio.ensure_future(client.ping(timeout=0.3))  # sent whole, unanswered
        await asyncio.sleep(0.1)
        update = asyncio.ensure_future(client.update_arrays({"w": w}))  # mostly unsent
        with pytest.raises(CallTimeout):
            await ping  # it lent no memory of its caller: the connection stays
        assert await update == {"w": 1}
    async with ParameterClient(node.address, timeout=30) as reader:
        assert (await reader.get_arrays(["w"]))["w"].tobytes() == w.tobytes()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:9090", ("127.0.0.1", 9090)), ("[::1]:80", ("::1", 80)), (("h", 1), ("h", 1))],
)
def test_addresses_parse(text, expected) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("bad", ["localhost", ":9090", "host:port", "host:0", "host:70000"])
def test_bad_addresses_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        parse_address(bad)


@pytest.mark.parametrize("scheme", ["http", "https", "tcp", "thrift"])
def test_an_address_with_a_scheme_is_refused_saying_to_drop_it(scheme: str) -> None:
    # (else "http://host:9090" reads as the host "http://host", and connecting fails later)
    with pytest.raises(ValueError, match=f"without a scheme: drop '{scheme}://' and give 'h:9090'"):
        ParameterClient(f"{scheme}://h:9090")
    with pytest.raises(ValueError, match="give 'h:9090'"):
        parse_address(f"{scheme}://h:9090/")


def test_max_connections_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ParameterClient("127.0.0.1:1", max_connections=0)


async def test_sending_back_what_a_get_answered_is_a_plain_update(client) -> None:
    await client.update_arrays({"w": np.zeros(2)})
    (param,) = (await client.get_parameters(["w"])).params
    assert param.origin  # the node says where the version was made...
    await client.broadcast_update([param])  # ...and a client's update is applied anew
    assert (await client.get_parameters(["w"])).params[0].version == 2
    assert await client.update_parameters([param]) == {"w": 3}


# -- aioparamsync.run --------------------------------------------------------------------------


def test_run_is_asyncio_run_on_uvloop() -> None:
    """``aioparamsync.run(main())`` runs ``main`` on a new uvloop loop and answers its
    result, as ``asyncio.run`` would; a client works there, and an error comes out as is."""
    import uvloop

    import aioparamsync

    async def main() -> tuple[type, list[float]]:
        async with Node("127.0.0.1", 0) as node, ParameterClient(node.address) as client:
            await client.update_arrays({"w": np.arange(3, dtype=np.float32)})
            got = (await client.get_arrays(["w"]))["w"]
        return type(asyncio.get_running_loop()), got.tolist()

    loop_type, got = aioparamsync.run(main())
    assert loop_type is uvloop.Loop and got == [0.0, 1.0, 2.0]

    async def fails() -> None:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        aioparamsync.run(fails())


async def test_run_refuses_a_thread_that_runs_a_loop() -> None:
    import aioparamsync

    async def nothing() -> None:
        return None

    coroutine = nothing()
    with pytest.raises(RuntimeError, match="running event loop"):
        aioparamsync.run(coroutine)
    coroutine.close()


async def test_a_connection_accepted_as_the_node_stops_is_closed_not_left_open() -> None:
    """A connection the node accepted just before it stopped listening, whose transport
    asyncio makes a turn or two later (after the stop closed those there were), is closed
    too: its client reads the end of it, and the node holds none."""
    for turns in range(6):  # (where the accept falls, in turns of the loop before the stop)
        node = Node(port=0)
        await node.start()
        sock = socket.create_connection(node.address)
        sock.settimeout(5)
        got: list[bytes] = []

        def read_to_the_end(sock: socket.socket, got: list[bytes]) -> None:
            got.append(sock.recv(1))  # (b"" once the node closed it)
            sock.close()  # (the node waits for this end's close too, up to its grace)

        reader = threading.Thread(target=read_to_the_end, args=(sock, got))
        reader.start()
        try:
            for _ in range(turns):
                await asyncio.sleep(0)
            await node.stop()  # (begins at once: no turn of the loop before it)
            assert not node.server.connections, turns
        finally:
            await asyncio.to_thread(reader.join)
        assert got == [b""], turns


async def test_rules_come_with_a_read_unless_it_leaves_them_out(client: ParameterClient) -> None:
    rule = sgd(0.5, momentum=0.9)
    await client.update_arrays({"w": np.arange(4, dtype=np.float32)}, rules=rule)
    (p,) = (await client.get_parameters(["w"])).params
    assert p.rule == rule
    (q,) = (await client.get_parameters(["w"], rules=False)).params
    assert q.rule is None
    assert (q.version, q.dtype, q.shape, bytes(q.data)) == (
        p.version,
        p.dtype,
        p.shape,
        bytes(p.data),
    )
    # Encoded, and past the answer's inline bytes (a header, read in pieces): without too.
    (q,) = (await client.get_parameters(["w"], encoding="fp16", rules=False)).params
    assert q.rule is None and q.encoding == "fp16"
    request = thrift.ParameterRequest(param_names=["w"], max_inline_bytes=0, without_rules=True)
    (q,) = (await client.invoke(method("pull_parameters"), request=request)).params
    assert q.rule is None and q.total_bytes == 16
    # A request that says nothing of rules (the founding IDL's, any other client's) gets them.
    raw = thrift.ParameterRequest(param_names=["w"])
    answer = await client.invoke(method("pull_parameters"), request=raw)
    assert answer.params[0].rule == rule


async def test_get_arrays_reads_rules_only_once_the_client_pushes_with_error_feedback(
    client: ParameterClient, node: Node
) -> None:
    rule = sgd(0.1, momentum=0.5)
    await client.update_arrays({"w": np.zeros(64, np.float32)}, rules=rule)
    async with ParameterClient(node.address, timeout=30) as worker:
        await worker.get_arrays(["w"])
        assert worker._rules == {}  # (nothing read that it has no use for)
        await worker.push_gradients({"w": np.ones(64, np.float32)}, encoding="topk", ratio=0.1)
        await worker.get_arrays(["w"])
        assert worker._rules == {"w": rule}  # (its pushes' bound is by the rule)
