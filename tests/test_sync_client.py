"""SyncParameterClient: the async client's methods, blocking, against real nodes.

The nodes run in-process on a loop of their own thread (the tests themselves
are synchronous: a blocking call from a thread running a loop is refused), or
as a node process (``cluster_helpers.launch``). Everything listens on
127.0.0.1 and a port the kernel picks; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import inspect
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import uvloop
from cluster_helpers import eventually, free_port, launch
from test_not_a_node import python_http_server

from aioparamsync import (
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    Node,
    ParameterClient,
    RemoteProtocolError,
    RequestError,
    RunningLoopError,
    SyncParameterClient,
    thrift,
)
from aioparamsync import torch as ps_torch
from aioparamsync.client.blocking import OWN
from aioparamsync.values import rules
from aioparamsync.wire import METHODS

pytestmark = pytest.mark.timeout(90)

# The longest a test waits for one thing (seconds): a bound, never a measure.
BOUND = 30.0
LOOP_THREAD = "aioparamsync-sync-client"

OnLoop = Callable[..., Any]


@pytest.fixture
def on_loop() -> Iterator[OnLoop]:
    """``on_loop(coro)``: run it on a loop in a thread of its own (where the nodes run)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(BOUND)

    yield run
    loop.call_soon_threadsafe(loop.stop)
    thread.join(BOUND)
    loop.close()


@pytest.fixture
def node(on_loop: OnLoop) -> Iterator[Node]:
    """A node on 127.0.0.1 and a free port, in this process (on ``on_loop``'s loop)."""
    n = Node("127.0.0.1", 0)
    on_loop(n.__aenter__())
    yield n
    on_loop(n.__aexit__(None, None, None))


@pytest.fixture
def client(node: Node) -> Iterator[SyncParameterClient]:
    with SyncParameterClient(node.address, timeout=BOUND) as c:
        yield c


def until(on_loop: OnLoop, check: Callable[[], Any]) -> Any:
    """``cluster_helpers.eventually`` of a blocking ``check`` (run in a worker thread)."""
    return on_loop(eventually(lambda: asyncio.to_thread(check), timeout=BOUND))


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == LOOP_THREAD]


# -- the method set ---------------------------------------------------------------------------


def test_every_public_member_of_the_async_client_has_a_blocking_twin() -> None:
    members = {
        name: member
        for name, member in inspect.getmembers_static(ParameterClient)
        if not name.startswith("_")
    }
    assert {"get_arrays", "push_gradients", "pull_rows", "barrier", "topology"} <= set(members)
    for name, member in members.items():
        twin = inspect.getattr_static(SyncParameterClient, name, None)
        assert twin is not None, f"SyncParameterClient has no {name}"
        if isinstance(member, property):
            assert isinstance(twin, property), name
            continue
        function = getattr(ParameterClient, name)
        blocking = getattr(SyncParameterClient, name)
        theirs, ours = inspect.signature(function), inspect.signature(blocking)
        assert ours.parameters == theirs.parameters, name
        if name == "watch":  # (an async generator there, a generator here)
            assert (theirs.return_annotation, ours.return_annotation) == (
                "AsyncGenerator[dict[str, int], None]",
                "Iterator[dict[str, int]]",
            )
        elif name != "from_env":  # (it answers a SyncParameterClient)
            assert ours.return_annotation == theirs.return_annotation, name
        assert not inspect.iscoroutinefunction(blocking), name
        if name not in OWN:  # (close and from_env say what they do here)
            assert blocking.__doc__ == function.__doc__, name
    init = inspect.signature(ParameterClient).parameters
    assert inspect.signature(SyncParameterClient).parameters == init
    # help() shows the async method's arguments and docstring.
    shown = pydoc_text(SyncParameterClient.get_arrays)
    assert "min_version: 'int' = 0" in shown and "Fetch parameters as numpy arrays" in shown


def pydoc_text(thing: Any) -> str:
    import pydoc

    return pydoc.render_doc(thing, renderer=pydoc.plaintext)


# -- every family, over the wire --------------------------------------------------------------


def test_arrays_parameters_and_the_nodes_answers_round_trip(
    client: SyncParameterClient, node: Node
) -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert client.update_arrays({"w": w}) == {"w": 1}
    got = client.get_arrays(["w"])
    assert got["w"].dtype == w.dtype and np.array_equal(got["w"], w)
    assert client.update_parameters([thrift.Parameter(name="raw", data=b"abc", version=7)]) == {
        "raw": 7
    }
    response = client.get_parameters(["raw", "w"], min_version=2)
    assert [(p.name, bytes(p.data)) for p in response.params] == [("raw", b"abc")]
    client.broadcast_update({"b": np.ones(2, np.int64)})
    assert client.get_arrays(["b"])["b"].tolist() == [1, 1]
    assert client.ping() == node.node_id
    assert client.call("ping") == node.node_id
    assert client.invoke(METHODS.ping) == node.node_id
    info = client.info()
    assert info.node_id == node.node_id and info.parameter_count == 3
    assert client.topology().epoch >= 1
    stats = client.stats()  # (on the node's host: memory shared, once it moved there)
    assert stats["gradients"] == {} and set(stats) <= {"gradients", "shared_memory"}
    # The async client's attributes, to read.
    assert client.timeout == BOUND and client.addresses == [node.address]
    assert (client.host, client.port) == node.address


def test_gradients_fold_and_refusals_raise_the_async_clients_errors(
    client: SyncParameterClient,
) -> None:
    client.update_arrays({"g": np.zeros(3, np.float32)}, rules=rules.sgd(lr=0.5))
    versions = client.push_gradients({"g": np.array([2, 4, 6], np.float32)})
    assert versions == {"g": 2}
    assert client.get_arrays(["g"])["g"].tolist() == [-1, -2, -3]
    client.push_gradients({"g": np.ones(3, np.float32)}, encoding="topk", ratio=0.5)
    assert set(client.stats()["gradients"]) == {"g"}
    with pytest.raises(RequestError) as refused:
        client.push_gradients({"nothing": np.ones(1, np.float32)})
    assert refused.value.code.name == "UNKNOWN_PARAMETER"
    with pytest.raises(TypeError, match="mapping"):
        client.push_gradients([("g", np.ones(3))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="acks"):
        client.update_arrays({"g": np.ones(3, np.float32)}, acks="2")


def test_tables_and_rows_round_trip(client: SyncParameterClient) -> None:
    table = client.create_table("emb", 4, rule=rules.sgd(lr=1.0))
    assert table.name == "emb" and table.dim == 4
    assert [t.name for t in client.tables()] == ["emb"]
    ids = np.array([3, 1, 3], np.int64)
    assert np.array_equal(client.pull_rows("emb", ids), np.zeros((3, 4), np.float32))
    grads = np.arange(12, dtype=np.float32).reshape(3, 4)
    result = client.push_row_gradients("emb", ids, grads)
    assert (result.rows, result.created) == (2, 2)
    rows = client.pull_rows("emb", np.array([1, 3], np.int64))
    assert np.array_equal(rows, -np.stack([grads[1], grads[0] + grads[2]]))
    with pytest.raises(RequestError, match="no table"):
        client.pull_rows("missing", ids)
    with pytest.raises(ValueError, match="int64"):
        client.pull_rows("emb", np.array([1], np.int32))


def test_a_barrier_and_a_long_poll_hold_their_callers_until_released(
    client: SyncParameterClient, on_loop: OnLoop
) -> None:
    answers: dict[str, Any] = {}

    def call(key: str, fn: Callable[[], Any]) -> threading.Thread:
        thread = threading.Thread(target=lambda: answers.__setitem__(key, fn()))
        thread.start()
        return thread

    waiting = [
        call("poll", lambda: client.get_arrays(["late"], min_version=1, wait=BOUND)),
        call("w0", lambda: client.barrier("step", "w0", 0, 2, timeout=BOUND)),
    ]
    until(on_loop, lambda: assert_counters(client, long_polls_waiting=1, barrier_waiters=1))
    assert answers == {}
    client.update_arrays({"late": np.ones(1, np.float32)})
    passed = client.barrier("step", "w1", 0, 2, timeout=BOUND)
    for thread in waiting:
        thread.join(BOUND)
    assert answers["poll"]["late"].tolist() == [1.0]
    assert sorted(passed.workers) == sorted(answers["w0"].workers) == ["w0", "w1"]


def assert_counters(client: SyncParameterClient, **expected: int) -> None:
    counters = client.info().counters
    assert {k: counters[k] for k in expected} == expected


def test_from_env_and_its_errors_are_the_async_clients(node: Node) -> None:
    host, port = node.address
    environ = {"AIOPARAMSYNC_ADDRESSES": f"{host}:{port}"}
    with SyncParameterClient.from_env(environ, timeout=5) as client:
        assert client.ping() == node.node_id and client.timeout == 5
    for bad in ({}, {"AIOPARAMSYNC_ADDRESSES": "nonsense"}):
        with pytest.raises(ValueError) as sync_error:
            SyncParameterClient.from_env(bad)
        with pytest.raises(ValueError) as async_error:
            ParameterClient.from_env(bad)
        assert str(sync_error.value) == str(async_error.value)


# -- threads --------------------------------------------------------------------------------------


def test_eight_threads_share_one_client(client: SyncParameterClient) -> None:
    threads, calls = 8, 25
    client.update_arrays({"count": np.zeros(1, np.int64)}, rules=rules.sum_rule())
    errors: list[BaseException] = []
    seen: dict[int, list[int]] = {}
    start = threading.Barrier(threads)

    def work(i: int) -> None:
        try:
            start.wait(BOUND)
            mine = []
            for n in range(calls):
                client.update_arrays({f"t{i}": np.full(4, i * 1000 + n, np.int64)})
                mine.append(int(client.get_arrays([f"t{i}"])[f"t{i}"][0]))
                client.push_gradients({"count": np.ones(1, np.int64)})
            seen[i] = mine
        except Exception as exc:  # noqa: BLE001  # (reported below)
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(BOUND * 2)
    assert not errors, errors
    assert seen == {i: [i * 1000 + n for n in range(calls)] for i in range(threads)}
    assert client.get_arrays(["count"])["count"].tolist() == [threads * calls]
    versions = client.get_parameters([f"t{i}" for i in range(threads)]).params
    assert {p.name: p.version for p in versions} == {f"t{i}": calls for i in range(threads)}


# -- misuse, closing, bad addresses -------------------------------------------------------------


async def test_a_call_from_a_running_loop_is_refused_naming_the_async_client(node: Node) -> None:
    before = set(loop_threads())
    client = SyncParameterClient(node.address, timeout=BOUND)
    (mine,) = set(loop_threads()) - before
    try:
        with pytest.raises(RunningLoopError, match="use ParameterClient and await") as info:
            client.ping()
        assert isinstance(info.value, RuntimeError)
        assert "SyncParameterClient.ping()" in str(info.value)
        with pytest.raises(RunningLoopError):
            client.get_arrays(["w"])

        # From a thread without a loop, the same client works...
        assert await asyncio.to_thread(client.ping) == node.node_id

        # ...and a coroutine on its own loop calling it is refused, not left hanging.
        async def calls_back(aio: ParameterClient) -> None:
            client.ping()

        with pytest.raises(RunningLoopError):
            await asyncio.to_thread(client.run, calls_back)
        assert await asyncio.to_thread(client.ping) == node.node_id
    finally:
        client.close()  # (from a loop: started, not waited for)
    assert client.closed
    await asyncio.to_thread(mine.join, BOUND)
    assert not mine.is_alive()
    with pytest.raises(ClientClosedError):
        await asyncio.to_thread(client.ping)


def test_a_closed_client_raises_the_closed_error_and_its_thread_ends(node: Node) -> None:
    before = set(loop_threads())
    with SyncParameterClient(node.address, timeout=BOUND) as client:
        assert client.ping() == node.node_id
        (mine,) = set(loop_threads()) - before
    assert client.closed and not mine.is_alive()
    for call in (client.ping, lambda: client.get_arrays(["w"]), client.stats):
        with pytest.raises(ClientClosedError, match="closed"):
            call()
    client.close()  # (again: nothing)
    assert "closed" in repr(client)


def test_close_ends_the_calls_in_flight(client: SyncParameterClient, on_loop: OnLoop) -> None:
    failed: list[BaseException] = []

    def poll() -> None:
        try:
            client.get_arrays(["never"], min_version=1, wait=BOUND)
        except Exception as exc:  # noqa: BLE001  # (its type is checked below)
            failed.append(exc)

    thread = threading.Thread(target=poll)
    thread.start()
    until(on_loop, lambda: assert_counters(client, long_polls_waiting=1))
    client.close()
    thread.join(BOUND)
    assert not thread.is_alive()
    (error,) = failed
    assert isinstance(error, (ConnectionLostError, ClientClosedError)), repr(error)


def test_a_dropped_client_is_closed_and_its_thread_ends(node: Node) -> None:
    before = set(loop_threads())
    client = SyncParameterClient(node.address, timeout=BOUND)
    assert client.ping() == node.node_id
    (mine,) = set(loop_threads()) - before
    del client
    gc.collect()
    mine.join(BOUND)
    assert not mine.is_alive()


def test_the_loop_is_uvloop(client: SyncParameterClient) -> None:
    async def loop_of(aio: ParameterClient) -> asyncio.AbstractEventLoop:
        assert isinstance(aio, ParameterClient)
        return asyncio.get_running_loop()

    assert isinstance(client.run(loop_of), uvloop.Loop)


def sync_and_async_errors(
    address: Any, call: Callable[[Any], Any], **options: Any
) -> BaseException:
    """The same error, of the same type, from both clients (the async one on uvloop, as the
    blocking one runs)."""
    with (
        pytest.raises(Exception) as sync_error,
        SyncParameterClient(address, **options) as client,
    ):
        call(client)

    async def the_async_one() -> None:
        async with ParameterClient(address, **options) as aclient:
            await call(aclient)

    with pytest.raises(Exception) as async_error:
        uvloop.run(the_async_one())
    assert type(sync_error.value) is type(async_error.value)
    assert str(sync_error.value) == str(async_error.value)
    return sync_error.value


@pytest.mark.parametrize(
    ("address", "options"),
    [
        ("nonsense", {}),
        ("127.0.0.1:0", {}),
        ([], {}),
        ("127.0.0.1:9", {"timeout": 0}),
        ("127.0.0.1:9", {"max_connections": 0}),
        ("127.0.0.1:9", {"read_from": "nearest"}),
    ],
)
def test_a_bad_address_or_option_is_the_async_clients_value_error(address, options) -> None:
    before = set(loop_threads())
    with pytest.raises(ValueError) as sync_error:
        SyncParameterClient(address, **options)
    with pytest.raises(ValueError) as async_error:
        ParameterClient(address, **options)
    assert type(sync_error.value) is type(async_error.value)
    assert str(sync_error.value) == str(async_error.value)
    assert set(loop_threads()) == before  # (nothing was started)


def test_no_node_there_is_the_async_clients_connect_error() -> None:
    address = f"127.0.0.1:{free_port()}"
    error = sync_and_async_errors(address, lambda c: c.ping(), timeout=BOUND)
    assert isinstance(error, ConnectError)
    error = sync_and_async_errors(
        [address, f"127.0.0.1:{free_port()}"], lambda c: c.info(), timeout=BOUND
    )
    assert isinstance(error, ConnectError) and "no node is reachable" in str(error)


def test_a_server_that_is_no_node_is_the_async_clients_protocol_error() -> None:
    with python_http_server() as address:
        error = sync_and_async_errors(address, lambda c: c.ping(), timeout=BOUND)
    assert isinstance(error, RemoteProtocolError)


# -- Ctrl-C and the interpreter's exit (processes of their own) --------------------------------


def python(script: str, node: Node) -> list[str]:
    """The command that runs ``script`` with the node's ``host:port`` as its argument."""
    host, port = node.address
    return [sys.executable, "-c", script, f"{host}:{port}"]


INTERRUPTED = """
import sys, numpy as np
from aioparamsync import SyncParameterClient
client = SyncParameterClient(sys.argv[1], timeout=60)
print("calling", flush=True)
try:
    client.barrier("never", "alone", 0, 2, timeout=60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.readline()
print(client.ping(), flush=True)
print(client.update_arrays({"after": np.ones(2)}), flush=True)
client.close()
print("closed", flush=True)
"""


def test_ctrl_c_cancels_the_waiting_call_and_the_next_call_works(
    client: SyncParameterClient, node: Node, on_loop: OnLoop
) -> None:
    child = subprocess.Popen(
        python(INTERRUPTED, node),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline() == "calling\n"
        until(on_loop, lambda: assert_counters(client, barrier_waiters=1))
        child.send_signal(signal.SIGINT)
        assert child.stdout.readline() == "interrupted\n"
        # The interrupted call was cancelled: it left the node (its connection closed).
        until(on_loop, lambda: assert_counters(client, barrier_waiters=0))
        out, err = child.communicate("go\n", timeout=BOUND)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(BOUND)
    assert child.returncode == 0, err
    assert out.splitlines() == [node.node_id, "{'after': 1}", "closed"]
    assert err == ""


LEFT_OPEN = """
import atexit

def report():
    print("closed at exit:", client.closed, flush=True)

atexit.register(report)  # (before anything: atexit runs it last, after the client's finalizer)

import contextlib, sys, threading, numpy as np
from aioparamsync import ClientClosedError, ConnectionLostError, SyncParameterClient
client = SyncParameterClient(sys.argv[1], timeout=600)
client.update_arrays({"w": np.ones(2)})

def poll():
    # (closed at exit: the call fails so)
    with contextlib.suppress(ConnectionLostError, ClientClosedError):
        client.get_arrays(["never"], min_version=1, wait=600)

# A daemon thread held in a long poll when the interpreter exits.
threading.Thread(target=poll, daemon=True).start()
while client.info().counters["long_polls_waiting"] == 0:
    pass
print("exiting", flush=True)
"""


def test_the_interpreter_exits_with_a_client_left_open_and_a_call_held(
    client: SyncParameterClient, node: Node, on_loop: OnLoop
) -> None:
    done = subprocess.run(
        python(LEFT_OPEN, node),
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "exiting\nclosed at exit: True\n", "")
    assert client.get_arrays(["w"])["w"].tolist() == [1.0, 1.0]
    until(on_loop, lambda: assert_counters(client, long_polls_waiting=0))


# -- a node process -----------------------------------------------------------------------------


def test_against_a_node_process_down_to_shutting_the_cluster(on_loop: OnLoop) -> None:
    process = on_loop(launch("--port", "0"))
    try:
        on_loop(process.wait_listening())
        with SyncParameterClient(process.address_text, timeout=BOUND) as client:
            assert client.ping() == process.node_id
            assert client.update_arrays({"w": np.ones(3, np.float32)}) == {"w": 1}
            assert client.get_arrays(["w"])["w"].tolist() == [1.0, 1.0, 1.0]
            result = client.shutdown_cluster()
            assert (result.stopping, result.snapshots, result.unreached or []) == (1, 0, [])
        assert on_loop(process.wait_exit()) == 0
    finally:
        on_loop(process.close())


# -- torch ----------------------------------------------------------------------------------------


def test_a_torch_training_loop_pushes_its_gradients_through_a_node_process(
    on_loop: OnLoop,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = [(torch.randn(16, 4), torch.randn(16, 2)) for _ in range(5)]
    process = on_loop(launch("--port", "0"))
    try:
        on_loop(process.wait_listening())
        with SyncParameterClient(process.address_text, timeout=BOUND) as client:
            versions = ps_torch.push_state_dict(client, model, rule=rules.sgd(lr=0.1))
            assert versions == dict.fromkeys(model.state_dict(), 1)
            for step, (x, y) in enumerate(batches):
                assert ps_torch.load_into(client, model) == dict.fromkeys(versions, step + 1)
                model.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                pushed = ps_torch.push_grads(client, model)
                assert pushed == dict.fromkeys(versions, step + 2)
                # The same step, locally.
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(reference(x), y).backward()
                optimizer.step()
            trained = ps_torch.pull_state_dict(client=client, names_or_module=model)
            # Errors are the async helpers' own.
            with pytest.raises(ValueError, match=r"call loss.backward\(\) first"):
                ps_torch.push_grads(client, torch.nn.Linear(4, 2))
            with pytest.raises(KeyError, match=r"the node has no other\.0\.weight"):
                ps_torch.load_into(client, model, prefix="other.")
    finally:
        on_loop(process.close())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=1e-5, atol=1e-6)


def test_an_embedding_pulls_and_pushes_its_rows_through_the_blocking_client(
    client: SyncParameterClient,
) -> None:
    emb = ps_torch.Embedding(client, "user", 3, create=True, rule=rules.sgd(lr=1.0))
    with pytest.raises(RuntimeError, match="nothing pulled to push"):
        emb.push()
    ids = torch.tensor([[5, 2], [5, 9]])
    rows = emb.pull(ids)
    assert isinstance(rows, torch.Tensor) and rows.shape == (3, 3) and rows.requires_grad
    emb(ids).sum().backward()
    result = emb.push()
    assert (result.rows, result.created) == (3, 3)
    stored = client.pull_rows("user", np.array([2, 5, 9], np.int64))
    assert stored.tolist() == [[-1.0] * 3, [-2.0] * 3, [-1.0] * 3]  # id 5 used twice
    bag = ps_torch.EmbeddingBag(client, "user", 3, mode="sum")
    bag.pull(ids)
    assert bag(ids).tolist() == [[-3.0] * 3, [-3.0] * 3]


def test_the_torch_helpers_keep_their_signatures_and_docstrings() -> None:
    shown = pydoc_text(ps_torch.push_grads)
    assert "push_grads(client: 'ParameterClient', module: 'torch.nn.Module'" in shown
    assert "Send the gradients of a module's parameters" in shown
    assert list(inspect.signature(ps_torch.load_into).parameters)[:2] == ["client", "module"]
