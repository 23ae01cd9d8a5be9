"""Interop: stock Thrift clients, not ours, against a real node over loopback sockets.

- Apache Thrift's compiler (Debian's ``thrift-compiler``) generates Python from
  the founding IDL and from ours; the generated synchronous clients, on the
  official ``thrift`` package's transports and protocols, run in a worker
  thread (``asyncio.to_thread``) while the node serves in the test's loop.
- The founding article's client, as written there.
- thriftpy2's stock clients, async (``make_aio_client``) and sync (``make_client``).
- Our :class:`~aioparamsync.ParameterClient` reading what a founding client wrote.

No test sleeps to synchronise: a call that waits for its reply is applied when
it returns, and a oneway call is applied before any later read on the same
connection (the node's read-your-writes).
"""

from __future__ import annotations

import asyncio
import importlib
import shutil
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import thriftpy2.rpc
from thrift.protocol import TBinaryProtocol, TCompactProtocol
from thrift.Thrift import TApplicationException, TMessageType
from thrift.transport import TSocket, TTransport
from thriftpy2.contrib.aio.protocol import TAsyncBinaryProtocolFactory, TAsyncCompactProtocolFactory
from thriftpy2.contrib.aio.transport import (
    TAsyncBufferedTransportFactory,
    TAsyncFramedTransportFactory,
)
from thriftpy2.protocol import TBinaryProtocolFactory, TCompactProtocolFactory
from thriftpy2.thrift import TApplicationException as PyTApplicationException
from thriftpy2.transport import TBufferedTransportFactory, TFramedTransportFactory

from aioparamsync import Node, ParameterClient, from_parameter
from aioparamsync.wire import IDL_PATH, SEED_IDL_PATH, thrift

# A stock client's socket gives up after this long instead of hanging the test
# (milliseconds): a node that never answers fails the test, it does not stall it.
SOCKET_TIMEOUT_MS = 5_000

SHAPE_MISMATCH = 3


# -- Apache Thrift's generated code -----------------------------------------------


def _thrift_compiler() -> str:
    path = shutil.which("thrift")
    if path is None:
        pytest.fail(
            "Apache Thrift's compiler (`thrift`) is not on PATH; the interop tests need it: "
            "`apt-get install thrift-compiler` (Debian/Ubuntu)",
            pytrace=False,
        )
    return path


def _is_generated(name: str) -> bool:
    return name == "ml" or name.startswith("ml.")


def _generate(idl: Path, out: Path) -> types.SimpleNamespace:
    """``thrift --gen py`` of ``idl`` into ``out``; import its package and leave no trace.

    Both IDLs generate the package ``ml.param_sync``, so each is imported with
    ``out`` on sys.path and then taken out of sys.path and sys.modules again
    (whatever was there before is put back): the module objects keep working,
    and no other test, nor the other IDL's import, sees them.
    """
    compiler = _thrift_compiler()
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [compiler, "--gen", "py", "-out", str(out), str(idl)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if done.returncode != 0:
        pytest.fail(f"`thrift --gen py` of {idl} failed ({done.returncode}):\n{done.stderr}")
    saved_path = list(sys.path)
    saved_modules = {k: v for k, v in sys.modules.items() if _is_generated(k)}
    for name in saved_modules:
        del sys.modules[name]
    sys.path.insert(0, str(out))
    importlib.invalidate_caches()
    try:
        service = importlib.import_module("ml.param_sync.ParameterSyncService")
        ttypes = importlib.import_module("ml.param_sync.ttypes")
    finally:
        sys.path[:] = saved_path
        for name in [k for k in sys.modules if _is_generated(k)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
        importlib.invalidate_caches()
    assert Path(service.__file__).is_relative_to(out), service.__file__
    return types.SimpleNamespace(service=service, ttypes=ttypes, idl=idl)


@pytest.fixture(scope="session")
def seed(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """Apache Thrift's Python of the founding IDL: ``.service``, ``.ttypes``."""
    return _generate(SEED_IDL_PATH, tmp_path_factory.mktemp("gen-seed"))


@pytest.fixture(scope="session")
def ours(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """Apache Thrift's Python of our IDL: ``.service``, ``.ttypes``."""
    return _generate(IDL_PATH, tmp_path_factory.mktemp("gen-ours"))


class InThread:
    """A synchronous client whose every method runs in a worker thread.

    ``await c.get_parameters(request)`` calls the generated client's blocking
    method in a thread, so the node, in this event loop, keeps serving.
    """

    def __init__(self, client: Any, sock: TSocket.TSocket | None = None) -> None:
        self.sync = client  # the client itself, for its blocking methods
        self.socket = sock  # its TSocket, when known

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.sync, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(fn, *args, **kwargs)

        return call


# (transport class, protocol class) of the official ``thrift`` package.
APACHE_STACKS = {
    "buffered-binary": (TTransport.TBufferedTransport, TBinaryProtocol.TBinaryProtocol),
    "framed-binary": (TTransport.TFramedTransport, TBinaryProtocol.TBinaryProtocol),
    "framed-compact": (TTransport.TFramedTransport, TCompactProtocol.TCompactProtocol),
    "buffered-compact": (TTransport.TBufferedTransport, TCompactProtocol.TCompactProtocol),
    # The C-accelerated codecs (thrift.protocol.fastbinary) of the same protocols.
    "buffered-binary-accel": (
        TTransport.TBufferedTransport,
        TBinaryProtocol.TBinaryProtocolAccelerated,
    ),
    "framed-compact-accel": (
        TTransport.TFramedTransport,
        TCompactProtocol.TCompactProtocolAccelerated,
    ),
}


class apache_client:  # lower case: used like a function, ``async with apache_client(...)``
    """A generated ``ParameterSyncService.Client`` connected to ``node`` over ``stack``.

    ``async with apache_client(gen, node, stack) as c:`` gives an :class:`InThread`.
    A class, not ``contextlib.asynccontextmanager``: that one sets
    ``__traceback__`` on an exception passing through, and the exceptions
    thrift 0.17 generates refuse any attribute change (TypeError), which would
    hide a test's real error.
    """

    def __init__(
        self,
        gen: types.SimpleNamespace,
        node: Node,
        stack: str = "framed-binary",
        *,
        timeout_ms: int = SOCKET_TIMEOUT_MS,
    ) -> None:
        transport_cls, protocol_cls = APACHE_STACKS[stack]
        self.sock = TSocket.TSocket(node.host, node.port)
        self.sock.setTimeout(timeout_ms)
        self.transport = transport_cls(self.sock)
        self.client = gen.service.Client(protocol_cls(self.transport))

    async def __aenter__(self) -> InThread:
        await asyncio.to_thread(self.transport.open)
        return InThread(self.client, self.sock)

    async def __aexit__(self, *exc_info: object) -> None:
        self.transport.close()


def f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


def by_name(params: list[Any]) -> dict[str, Any]:
    return {p.name: p for p in params}


# -- 1. clients generated from the founding IDL, on every transport and protocol ------


@pytest.fixture(params=list(APACHE_STACKS))
def stack(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_seed_update_then_get(node: Node, seed: types.SimpleNamespace, stack: str) -> None:
    T = seed.ttypes
    w1, w2, b = f32(1.0, -2.5, 3.25), f32(4.0, 5.0, 6.0), f32(0.5)
    async with apache_client(seed, node, stack) as c:
        assert (
            await c.update_parameters(
                T.ParameterUpdate(
                    params=[T.Parameter("w", w1, version=5), T.Parameter("b", b, version=0)],
                    timestamp=2_000,
                )
            )
            is None
        )
        # version 0 (and an older timestamp): the node gives stored + 1, keeps the newest timestamp
        await c.update_parameters(
            T.ParameterUpdate(params=[T.Parameter("w", w2, version=0)], timestamp=1_000)
        )

        response = await c.get_parameters(T.ParameterRequest(param_names=["w", "nope", "b"]))
        assert isinstance(response, T.ParameterResponse)
        assert [p.name for p in response.params] == ["w", "b"]  # asked order; unknown left out
        got = by_name(response.params)
        assert (got["w"].data, got["w"].version) == (w2, 6)
        assert (got["b"].data, got["b"].version) == (b, 1)
        assert np.array_equal(np.frombuffer(got["w"].data, np.float32), [4.0, 5.0, 6.0])
        assert response.timestamp == 2_000  # max of the updates' timestamps

        # min_version leaves out what is older
        fresh = await c.get_parameters(T.ParameterRequest(param_names=["w", "b"], min_version=2))
        assert [(p.name, p.version) for p in fresh.params] == [("w", 6)]
        assert fresh.timestamp == 2_000
        none = await c.get_parameters(T.ParameterRequest(param_names=["w", "b"], min_version=7))
        assert none.params == []

        # a version above stored + 1 is taken as given
        await c.update_parameters(
            T.ParameterUpdate(params=[T.Parameter("b", b, version=40)], timestamp=3_000)
        )
        again = await c.get_parameters(T.ParameterRequest(param_names=["b"]))
        assert [(p.name, p.version) for p in again.params] == [("b", 40)]
        assert again.timestamp == 3_000

        empty = await c.get_parameters(T.ParameterRequest(param_names=[]))
        assert empty.params == []


async def test_seed_broadcast_is_applied(
    node: Node, seed: types.SimpleNamespace, stack: str
) -> None:
    T = seed.ttypes
    data = f32(*range(10))
    async with apache_client(seed, node, stack) as c:
        # oneway: no reply; the next read on this connection sees it
        assert (
            await c.broadcast_update(
                T.ParameterUpdate(params=[T.Parameter("g", data, version=3)], timestamp=77)
            )
            is None
        )
        response = await c.get_parameters(T.ParameterRequest(param_names=["g"]))
        assert [(p.name, p.data, p.version) for p in response.params] == [("g", data, 3)]
        assert response.timestamp == 77

        await c.broadcast_update(
            T.ParameterUpdate(params=[T.Parameter("g", f32(1.0))], timestamp=78)
        )
        await c.broadcast_update(
            T.ParameterUpdate(params=[T.Parameter("h", f32(2.0))], timestamp=79)
        )
        response = await c.get_parameters(T.ParameterRequest(param_names=["g", "h"]))
        assert [(p.name, p.data, p.version) for p in response.params] == [
            ("g", f32(1.0), 4),
            ("h", f32(2.0), 1),
        ]
        assert response.timestamp == 79


async def test_seed_bad_update_raises_and_connection_survives(
    node: Node, seed: types.SimpleNamespace, stack: str
) -> None:
    T = seed.ttypes
    async with apache_client(seed, node, stack) as c:
        good = T.Parameter("ok", f32(1.0), version=9)
        bad = T.Parameter("", f32(2.0))  # an empty name
        with pytest.raises(TApplicationException) as raised:
            await c.update_parameters(T.ParameterUpdate(params=[good, bad], timestamp=5))
        assert "empty" in (raised.value.message or "")
        # the same, repeated in one update
        twice = [T.Parameter("x", b"1"), T.Parameter("x", b"2")]
        with pytest.raises(TApplicationException):
            await c.update_parameters(T.ParameterUpdate(params=twice, timestamp=6))
        # a bad oneway update: no reply, no error, nothing applied
        await c.broadcast_update(T.ParameterUpdate(params=[good, bad], timestamp=7))

        # nothing of the refused updates was applied, and the connection still works
        response = await c.get_parameters(T.ParameterRequest(param_names=["ok", "x", ""]))
        assert response.params == []
        assert response.timestamp == 0
        await c.update_parameters(T.ParameterUpdate(params=[good], timestamp=8))
        response = await c.get_parameters(T.ParameterRequest(param_names=["ok"]))
        assert [(p.name, p.version) for p in response.params] == [("ok", 9)]
        assert response.timestamp == 8
    assert len(node.table) == 1


async def test_seed_bytes_keep_a_stored_layout_and_other_sizes_are_refused(
    node: Node, seed: types.SimpleNamespace, stack: str
) -> None:
    T = seed.ttypes
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    async with ParameterClient(node.address, timeout=30) as ours:
        await ours.update_arrays({"w": w})
    async with apache_client(seed, node, stack) as c:
        # the stored size: taken, and the parameter keeps its dtype and shape
        await c.update_parameters(T.ParameterUpdate([T.Parameter("w", (w * 3).tobytes())], 1))
        # another size: refused, saying why; nothing applied
        for size in (20, 28, 0):
            with pytest.raises(TApplicationException) as raised:
                await c.update_parameters(T.ParameterUpdate([T.Parameter("w", b"\0" * size)], 2))
            message = raised.value.message or ""
            assert "'w' is stored as float32 (2, 3) (24 bytes)" in message, message
            assert f"{size} plain bytes" in message, message
        response = await c.get_parameters(T.ParameterRequest(param_names=["w"]))
        assert [(p.version, p.data) for p in response.params] == [(2, (w * 3).tobytes())]
    entry = node.table.entry("w")
    assert entry is not None and (entry.dtype, entry.shape) == ("<f4", (2, 3))
    async with ParameterClient(node.address, timeout=30) as ours:
        np.testing.assert_array_equal((await ours.get_arrays(["w"]))["w"], w * 3)


async def test_seed_large_unicode_and_empty(
    node: Node, seed: types.SimpleNamespace, stack: str
) -> None:
    """A 1 MiB parameter (a frame larger than the node's scratch buffer), a
    non-ASCII name and empty data, each way over every stack."""
    T = seed.ttypes
    big = np.random.default_rng(7).standard_normal(1 << 18).astype(np.float32)
    name = "encoder/层.权重-Ω"
    async with apache_client(seed, node, stack) as c:
        await c.update_parameters(
            T.ParameterUpdate(
                params=[T.Parameter(name, big.tobytes()), T.Parameter("empty", b"")], timestamp=1
            )
        )
        await c.broadcast_update(
            T.ParameterUpdate(params=[T.Parameter(name, (big * 2).tobytes())], timestamp=2)
        )
        response = await c.get_parameters(T.ParameterRequest(param_names=[name, "empty"]))
        got = by_name(response.params)
        assert list(got) == [name, "empty"]
        assert got[name].version == 2
        np.testing.assert_array_equal(np.frombuffer(got[name].data, np.float32), big * 2)
        assert (got["empty"].data, got["empty"].version) == (b"", 1)
    assert node.table.entry(name) is not None


async def test_seed_many_parameters_and_extreme_values(
    node: Node, seed: types.SimpleNamespace, stack: str
) -> None:
    """Lists longer than the compact protocol's short header (15), i64 and i32 extremes."""
    T = seed.ttypes
    names = [f"p{i:02d}" for i in range(40)]
    params = [T.Parameter(n, bytes([i]) * i, version=i * 1000) for i, n in enumerate(names)]
    latest = 2**63 - 1
    async with apache_client(seed, node, stack) as c:
        await c.update_parameters(T.ParameterUpdate(params=params, timestamp=latest))
        await c.update_parameters(T.ParameterUpdate(params=params[:1], timestamp=-(2**63)))
        response = await c.get_parameters(
            T.ParameterRequest(param_names=[*reversed(names), "p00", "zz"], min_version=-5)
        )
        assert [p.name for p in response.params] == list(reversed(names))
        got = by_name(response.params)
        assert got["p00"].version == 2  # 0 asked twice: 1, then 2
        for i, n in enumerate(names[1:], start=1):
            assert (got[n].data, got[n].version) == (bytes([i]) * i, i * 1000)
        assert response.timestamp == latest

        top = 2**31 - 1  # i32's largest version may be set; past it an update is refused
        await c.update_parameters(
            T.ParameterUpdate(params=[T.Parameter("v", b"1", version=top)], timestamp=1)
        )
        with pytest.raises(TApplicationException):
            await c.update_parameters(
                T.ParameterUpdate(params=[T.Parameter("v", b"2")], timestamp=2)
            )
        response = await c.get_parameters(T.ParameterRequest(param_names=["v"], min_version=top))
        assert [(p.data, p.version) for p in response.params] == [(b"1", top)]


def _send(proto: Any, name: str, mtype: int, seqid: int, args: Any) -> None:
    proto.writeMessageBegin(name, mtype, seqid)
    args.write(proto)
    proto.writeMessageEnd()
    if isinstance(proto.trans, TTransport.TFramedTransport):
        proto.trans.flush()  # one message per frame


def _receive(proto: Any, result_cls: type) -> tuple[str, int, int, Any]:
    name, mtype, seqid = proto.readMessageBegin()
    body = TApplicationException() if mtype == TMessageType.EXCEPTION else result_cls()
    body.read(proto)
    proto.readMessageEnd()
    return name, mtype, seqid, body


async def test_pipelined_calls_with_stock_protocol_objects(
    node: Node, seed: types.SimpleNamespace, stack: str
) -> None:
    """Many calls sent before any reply is read (as an async Thrift client does), with
    the stock transports and protocols: replies come in order with their seqids, a
    oneway update is applied before the reads after it, an unknown oneway call is
    dropped, an unknown call is answered UNKNOWN_METHOD, and the connection goes on."""
    S, T = seed.service, seed.ttypes
    transport_cls, protocol_cls = APACHE_STACKS[stack]
    sock = TSocket.TSocket(node.host, node.port)
    sock.setTimeout(SOCKET_TIMEOUT_MS)
    transport = transport_cls(sock)
    proto = protocol_cls(transport)
    CALL, ONEWAY = TMessageType.CALL, TMessageType.ONEWAY
    update = T.ParameterUpdate(params=[T.Parameter("a", b"abc", version=3)], timestamp=5)

    def exchange() -> list[tuple[str, int, int, Any]]:
        _send(proto, "update_parameters", CALL, -5, S.update_parameters_args(update))
        _send(
            proto,
            "broadcast_update",
            ONEWAY,
            7,
            S.broadcast_update_args(T.ParameterUpdate([T.Parameter("b", b"x")], timestamp=6)),
        )
        _send(proto, "no_such_oneway", ONEWAY, 8, S.broadcast_update_args(update))
        _send(
            proto,
            "get_parameters",
            CALL,
            2**31 - 1,
            S.get_parameters_args(T.ParameterRequest(["a", "b"])),
        )
        _send(proto, "no_such_method", CALL, 9, S.get_parameters_args(T.ParameterRequest(["a"])))
        _send(
            proto,
            "get_parameters",
            CALL,
            -(2**31),
            S.get_parameters_args(T.ParameterRequest(["a", "b"], min_version=2)),
        )
        if not isinstance(transport, TTransport.TFramedTransport):
            transport.flush()  # all six in one write
        return [
            _receive(proto, S.update_parameters_result),
            _receive(proto, S.get_parameters_result),
            _receive(proto, S.get_parameters_result),
            _receive(proto, S.get_parameters_result),
        ]

    await asyncio.to_thread(transport.open)
    try:
        replies = await asyncio.to_thread(exchange)
        assert [r[:3] for r in replies] == [
            ("update_parameters", TMessageType.REPLY, -5),
            ("get_parameters", TMessageType.REPLY, 2**31 - 1),
            ("no_such_method", TMessageType.EXCEPTION, 9),
            ("get_parameters", TMessageType.REPLY, -(2**31)),
        ]
        got = replies[1][3].success
        assert [(p.name, p.data, p.version) for p in got.params] == [
            ("a", b"abc", 3),
            ("b", b"x", 1),
        ]
        assert got.timestamp == 6
        error = replies[2][3]
        assert error.type == TApplicationException.UNKNOWN_METHOD
        assert "no_such_method" in (error.message or "")
        assert [p.name for p in replies[3][3].success.params] == ["a"]
        # and a plain generated client goes on on the same connection
        c = InThread(S.Client(proto))
        response = await c.get_parameters(T.ParameterRequest(param_names=["b"]))
        assert [(p.name, p.data) for p in response.params] == [("b", b"x")]
    finally:
        transport.close()


async def test_replies_owed_are_sent_after_the_client_half_closes(
    node: Node, seed: types.SimpleNamespace, stack: str
) -> None:
    """A client that sends its calls and then shuts its sending side still gets the replies."""
    T = seed.ttypes
    big = bytes(range(256)) * 1024  # a 256 KiB parameter: more than one read of the socket
    async with apache_client(seed, node, stack) as c:
        client, sock = c.sync, c.socket
        assert sock is not None and sock.handle is not None

        def send_shut_receive() -> Any:
            # each send_* writes (and flushes) one whole message
            client.send_update_parameters(T.ParameterUpdate([T.Parameter("a", big)], 1))
            client.send_get_parameters(T.ParameterRequest(["a"]))
            sock.handle.shutdown(socket.SHUT_WR)
            client.recv_update_parameters()
            return client.recv_get_parameters()

        response = await asyncio.to_thread(send_shut_receive)
    assert [(p.name, p.data, p.version) for p in response.params] == [("a", big, 1)]


async def test_seed_clients_see_each_other(node: Node, seed: types.SimpleNamespace) -> None:
    """Two founding clients on different stacks share one store."""
    T = seed.ttypes
    async with (
        apache_client(seed, node, "buffered-binary") as writer,
        apache_client(seed, node, "framed-compact") as reader,
    ):
        await writer.update_parameters(
            T.ParameterUpdate(params=[T.Parameter("shared", f32(7.0))], timestamp=1)
        )
        response = await reader.get_parameters(T.ParameterRequest(param_names=["shared"]))
        assert [(p.name, p.data, p.version) for p in response.params] == [("shared", f32(7.0), 1)]


# -- 2. the founding article's client ---------------------------------------------------


def founding_client_class(gen: types.SimpleNamespace) -> type:
    """The founding article's ``ParameterSyncClient``, over the generated ``gen``."""
    ParameterSyncService = gen.service
    Parameter = gen.ttypes.Parameter
    ParameterUpdate = gen.ttypes.ParameterUpdate
    ParameterRequest = gen.ttypes.ParameterRequest

    class ParameterSyncClient:
        def __init__(self, host: str = "localhost", port: int = 9090) -> None:
            self.transport = TSocket.TSocket(host, port)
            self.transport.setTimeout(SOCKET_TIMEOUT_MS)  # not in the article: no hanging test
            self.transport = TTransport.TBufferedTransport(self.transport)
            self.protocol = TBinaryProtocol.TBinaryProtocol(self.transport)
            self.client = ParameterSyncService.Client(self.protocol)
            self.transport.open()

        def numpy_to_parameter(self, name: str, array: np.ndarray) -> Any:
            return Parameter(name=name, data=array.tobytes(), version=int(time.time()))

        def parameter_to_numpy(self, param: Any) -> np.ndarray:
            return np.frombuffer(param.data, dtype=np.float32)

        def update_parameters(self, params_dict: dict[str, np.ndarray]) -> None:
            params = [self.numpy_to_parameter(name, arr) for name, arr in params_dict.items()]
            update = ParameterUpdate(params=params, timestamp=int(time.time()))
            self.client.update_parameters(update)

        def get_parameters(self, param_names: list[str]) -> dict[str, np.ndarray]:
            request = ParameterRequest(param_names=param_names)
            response = self.client.get_parameters(request)
            return {p.name: self.parameter_to_numpy(p) for p in response.params}

        def close(self) -> None:
            self.transport.close()

    return ParameterSyncClient


async def test_founding_article_example(node: Node, seed: types.SimpleNamespace) -> None:
    ParameterSyncClient = founding_client_class(seed)
    rng = np.random.default_rng(1234)
    weights = rng.standard_normal(100).astype(np.float32)

    def example() -> dict[str, np.ndarray]:
        client = ParameterSyncClient(node.host, node.port)
        try:
            client.update_parameters({"layer1.weight": weights})
            return client.get_parameters(["layer1.weight"])
        finally:
            client.close()

    before = int(time.time())
    retrieved = await asyncio.to_thread(example)
    assert list(retrieved) == ["layer1.weight"]
    assert retrieved["layer1.weight"].dtype == np.float32
    np.testing.assert_array_equal(retrieved["layer1.weight"], weights)
    entry = node.table.entry("layer1.weight")
    assert entry is not None
    assert entry.version >= before  # version=int(time.time()) was kept
    assert entry.dtype is None and entry.shape is None  # plain bytes


# -- 3. a client generated from our IDL ---------------------------------------------------


async def test_ours_typed_methods(node: Node, ours: types.SimpleNamespace) -> None:
    T = ours.ttypes
    matrix = np.arange(6, dtype=np.float32).reshape(2, 3)
    async with apache_client(ours, node, "framed-binary") as c:
        result = await c.push_parameters(
            T.ParameterUpdate(
                params=[
                    T.Parameter("m", matrix.tobytes(), dtype="<f4", shape=[2, 3]),
                    T.Parameter("raw", b"\x01\x02\x03", version=10),
                ],
                timestamp=123,
            )
        )
        assert isinstance(result, T.UpdateResult)
        assert result.versions == {"m": 1, "raw": 10}
        assert result.timestamp == 123
        result = await c.push_parameters(
            T.ParameterUpdate(params=[T.Parameter("m", matrix.tobytes(), dtype="<f4")], timestamp=9)
        )
        assert (result.versions, result.timestamp) == ({"m": 2}, 123)

        # data that does not fit its dtype and shape: the typed error, nothing applied
        with pytest.raises(T.ParameterError) as raised:
            await c.push_parameters(
                T.ParameterUpdate(
                    params=[
                        T.Parameter("ok", f32(1.0)),
                        T.Parameter("bad", b"\x00" * 5, dtype="<f4", shape=[3]),
                    ],
                    timestamp=200,
                )
            )
        assert raised.value.code == T.ErrorCode.SHAPE_MISMATCH == SHAPE_MISMATCH
        assert "bad" in raised.value.message
        with pytest.raises(T.ParameterError) as raised:
            await c.push_parameters(T.ParameterUpdate(params=[T.Parameter("", b"")], timestamp=200))
        assert raised.value.code == T.ErrorCode.BAD_REQUEST
        # the founding method refuses the same update with a TApplicationException
        with pytest.raises(TApplicationException):
            await c.update_parameters(
                T.ParameterUpdate(
                    params=[T.Parameter("bad", b"\x00" * 5, dtype="<f4", shape=[3])],
                    timestamp=200,
                )
            )

        response = await c.pull_parameters(
            T.ParameterRequest(param_names=["m", "raw", "ok", "bad"], min_version=0)
        )
        got = by_name(response.params)
        assert list(got) == ["m", "raw"]
        # The update without a shape kept the stored one (a parameter keeps its layout).
        assert (got["m"].version, got["m"].dtype, got["m"].shape) == (2, "<f4", [2, 3])
        np.testing.assert_array_equal(np.frombuffer(got["m"].data, np.float32), matrix.ravel())
        assert (got["raw"].data, got["raw"].version, got["raw"].dtype) == (
            b"\x01\x02\x03",
            10,
            None,
        )
        assert response.timestamp == 123
        newer = await c.pull_parameters(T.ParameterRequest(param_names=["m", "raw"], min_version=3))
        assert [p.name for p in newer.params] == ["raw"]

        assert await c.ping() == node.node_id
        info = await c.info()
        assert isinstance(info, T.NodeInfo)
        assert info.node_id == node.node_id
        assert info.parameter_count == 2
        assert info.parameter_bytes == matrix.nbytes + 3
        assert info.timestamp == 123
        assert info.uptime_seconds >= 0
        assert info.counters["requests"] >= 7


async def test_ours_training_methods(node: Node, ours: types.SimpleNamespace) -> None:
    """Gradients, encodings, delta pulls, long polls and barriers from a generated client."""
    T = ours.ttypes
    async with apache_client(ours, node, "framed-compact") as c:
        await c.push_parameters(
            T.ParameterUpdate(
                params=[
                    T.Parameter(
                        "w", f32(1.0, 2.0), dtype="<f4", shape=[2], rule=T.Rule(kind="sgd", lr=0.5)
                    )
                ],
                timestamp=1,
            )
        )
        grad = T.Parameter("w", f32(2.0, 2.0), dtype="<f4", shape=[2])
        push = T.GradientPush(grads=[grad], request_id="step-1")
        assert (await c.push_gradients(push)).versions == {"w": 2}
        assert (await c.push_gradients(push)).versions == {"w": 2}  # a retry: applied once
        with pytest.raises(T.ParameterError) as raised:
            await c.push_gradients(T.GradientPush(grads=[T.Parameter("nope", f32(1.0))]))
        assert raised.value.code == T.ErrorCode.UNKNOWN_PARAMETER

        # An encoded pull: fp16 bytes, with the dtype of the stored array.
        response = await c.pull_parameters(T.ParameterRequest(param_names=["w"], encoding="fp16"))
        (p,) = response.params
        assert (p.encoding, p.dtype, p.shape, p.version) == ("fp16", "<f4", [2], 2)
        assert np.frombuffer(p.data, "<f2").tolist() == [0.0, 1.0]
        assert p.rule == T.Rule(kind="sgd", lr=0.5)
        # A delta pull, and a long poll that times out with the typed error.
        same = await c.pull_parameters(
            T.ParameterRequest(param_names=[], all_names=True, known_versions={"w": 2})
        )
        assert same.params == []
        with pytest.raises(T.ParameterError) as raised:
            await c.pull_parameters(
                T.ParameterRequest(param_names=["w"], min_version=5, wait_ms=50)
            )
        assert raised.value.code == T.ErrorCode.TIMEOUT
        # A barrier of one.
        passed = await c.barrier(T.BarrierRequest(group="g", worker="a", step=3, world_size=1))
        assert (passed.group, passed.step, passed.workers) == ("g", 3, ["a"])
        info = await c.info()
        assert info.waiting == []


async def test_ours_dtype_and_shape_round_trip_and_seed_skips_them(
    node: Node, ours: types.SimpleNamespace, seed: types.SimpleNamespace, stack: str
) -> None:
    """Fields 4 and 5 come back to our IDL's clients; a founding client skips them."""
    T = ours.ttypes
    cube = np.arange(24, dtype=">i8").reshape(2, 3, 4)
    deep = np.arange(4, dtype="<i2").reshape([1] * 14 + [2, 2])  # a list of 16: long header
    async with apache_client(ours, node, stack) as c:
        result = await c.push_parameters(
            T.ParameterUpdate(
                params=[
                    T.Parameter("cube", cube.tobytes(), dtype=cube.dtype.str, shape=[2, 3, 4]),
                    T.Parameter("deep", deep.tobytes(), dtype="<i2", shape=list(deep.shape)),
                ],
                timestamp=1,
            )
        )
        assert result.versions == {"cube": 1, "deep": 1}
        response = await c.pull_parameters(T.ParameterRequest(param_names=["cube", "deep"]))
        p, q = response.params
        assert (p.name, p.dtype, p.shape) == ("cube", ">i8", [2, 3, 4])
        np.testing.assert_array_equal(np.frombuffer(p.data, ">i8").reshape(p.shape), cube)
        assert (q.name, q.dtype, q.shape) == ("deep", "<i2", list(deep.shape))
        np.testing.assert_array_equal(np.frombuffer(q.data, "<i2").reshape(q.shape), deep)
        # a double, a map<string, i64> and i64s on this stack
        info = await c.info()
        assert (info.node_id, info.parameter_count) == (node.node_id, 2)
        assert info.parameter_bytes == cube.nbytes + deep.nbytes
        assert 0 <= info.uptime_seconds < 3600
        assert info.counters["updates_applied"] == 1
        assert all(isinstance(v, int) for v in info.counters.values())
        assert await c.ping() == node.node_id
    async with apache_client(seed, node, stack) as old:
        response = await old.get_parameters(seed.ttypes.ParameterRequest(param_names=["cube"]))
        [p] = response.params
        assert (p.name, p.data, p.version) == ("cube", cube.tobytes(), 1)
        assert not hasattr(p, "dtype")


async def test_ours_unparsable_dtype_is_a_shape_mismatch(ours: types.SimpleNamespace) -> None:
    # Its own node, stopped with a short grace: a dead writer would hang it.
    T = ours.ttypes
    node = Node("127.0.0.1", 0)
    await node.start()
    try:
        async with apache_client(ours, node, timeout_ms=500) as c:
            for dtype in ("f4,,,", "(1e400,)f4"):
                with pytest.raises(T.ParameterError) as raised:
                    await c.push_parameters(
                        T.ParameterUpdate([T.Parameter("x", b"abcd", dtype=dtype)], 1)
                    )
                assert raised.value.code == SHAPE_MISMATCH
            result = await c.push_parameters(T.ParameterUpdate([T.Parameter("ok", b"")], 2))
            assert result.versions == {"ok": 1}
    finally:
        await node.stop(grace=0.1)


async def test_ours_negative_dimensions_without_dtype_are_refused(
    node: Node, ours: types.SimpleNamespace
) -> None:
    T = ours.ttypes
    async with apache_client(ours, node) as c:
        with pytest.raises(T.ParameterError) as raised:
            await c.push_parameters(
                T.ParameterUpdate([T.Parameter("x", b"abc", shape=[-1, -3])], 1)
            )
        assert raised.value.code == SHAPE_MISMATCH


# -- 4. thriftpy2's stock clients, with our loaded IDL ----------------------------------------

AIO_STACKS = {
    "buffered-binary": (TAsyncBufferedTransportFactory, TAsyncBinaryProtocolFactory),
    "framed-binary": (TAsyncFramedTransportFactory, TAsyncBinaryProtocolFactory),
    "framed-compact": (TAsyncFramedTransportFactory, TAsyncCompactProtocolFactory),
    "buffered-compact": (TAsyncBufferedTransportFactory, TAsyncCompactProtocolFactory),
}


@pytest.mark.parametrize("aio_stack", list(AIO_STACKS))
async def test_thriftpy2_aio_client(node: Node, aio_stack: str) -> None:
    trans_factory, proto_factory = AIO_STACKS[aio_stack]
    client = await thriftpy2.rpc.make_aio_client(
        thrift.ParameterSyncService,
        node.host,
        node.port,
        trans_factory=trans_factory(),
        proto_factory=proto_factory(),
        timeout=SOCKET_TIMEOUT_MS,
    )
    try:
        data = f32(1.5, 2.5)
        assert (
            await client.update_parameters(
                thrift.ParameterUpdate(
                    params=[thrift.Parameter(name="a", data=data, version=4)], timestamp=10
                )
            )
            is None
        )
        response = await client.get_parameters(thrift.ParameterRequest(param_names=["a", "zz"]))
        assert [(p.name, bytes(p.data), p.version) for p in response.params] == [("a", data, 4)]
        assert response.timestamp == 10

        # oneway, then read on the same connection
        assert (
            await client.broadcast_update(
                thrift.ParameterUpdate(
                    params=[thrift.Parameter(name="a", data=f32(9.0))], timestamp=11
                )
            )
            is None
        )
        response = await client.get_parameters(thrift.ParameterRequest(param_names=["a"]))
        assert [(p.name, bytes(p.data), p.version) for p in response.params] == [("a", f32(9.0), 5)]
        assert response.timestamp == 11

        # the typed methods and errors
        result = await client.push_parameters(
            thrift.ParameterUpdate(
                params=[thrift.Parameter(name="v", data=f32(1, 2), dtype="<f4", shape=[2])],
                timestamp=12,
            )
        )
        if "compact" in aio_stack:
            # thriftpy2's async compact protocol drops maps with string keys
            # (see test_thriftpy2_aio_compact_reads_string_keyed_maps): check with a read.
            assert result.versions == {}
            pulled = await client.pull_parameters(thrift.ParameterRequest(param_names=["v"]))
            assert [(p.name, p.version) for p in pulled.params] == [("v", 1)]
        else:
            assert result.versions == {"v": 1}
        assert result.timestamp == 12
        with pytest.raises(thrift.ParameterError) as raised:
            await client.push_parameters(
                thrift.ParameterUpdate(
                    params=[thrift.Parameter(name="v", data=b"12345", dtype="<f4", shape=[3])],
                    timestamp=13,
                )
            )
        assert raised.value.code == SHAPE_MISMATCH
        with pytest.raises(PyTApplicationException):
            await client.update_parameters(
                thrift.ParameterUpdate(params=[thrift.Parameter(name="", data=b"")], timestamp=14)
            )
        assert await client.ping() == node.node_id
        info = await client.info()
        assert info.parameter_count == 2
        assert info.timestamp == 12
    finally:
        client.close()


THRIFTPY2_SYNC_STACKS = {
    "framed-binary": (TFramedTransportFactory, TBinaryProtocolFactory),
    "buffered-compact": (TBufferedTransportFactory, TCompactProtocolFactory),
    "framed-compact": (TFramedTransportFactory, TCompactProtocolFactory),
    "buffered-binary": (TBufferedTransportFactory, TBinaryProtocolFactory),
}


@pytest.mark.parametrize("sync_stack", list(THRIFTPY2_SYNC_STACKS))
async def test_thriftpy2_sync_client(node: Node, sync_stack: str) -> None:
    trans_factory, proto_factory = THRIFTPY2_SYNC_STACKS[sync_stack]
    client = await asyncio.to_thread(
        thriftpy2.rpc.make_client,
        thrift.ParameterSyncService,
        node.host,
        node.port,
        trans_factory=trans_factory(),
        proto_factory=proto_factory(),
        timeout=SOCKET_TIMEOUT_MS,
    )
    c = InThread(client)
    try:
        data = np.linspace(0, 1, 33, dtype=np.float32)
        await c.update_parameters(
            thrift.ParameterUpdate(
                params=[thrift.Parameter(name="s", data=data.tobytes(), dtype="<f4")], timestamp=1
            )
        )
        await c.broadcast_update(
            thrift.ParameterUpdate(params=[thrift.Parameter(name="t", data=b"tt")], timestamp=2)
        )
        response = await c.get_parameters(thrift.ParameterRequest(param_names=["s", "t"]))
        got = by_name(response.params)
        assert list(got) == ["s", "t"]
        np.testing.assert_array_equal(from_parameter(got["s"]), data)
        assert (got["s"].version, got["s"].dtype, got["s"].shape) == (1, "<f4", None)
        assert (bytes(got["t"].data), got["t"].version, got["t"].dtype) == (b"tt", 1, None)
        assert response.timestamp == 2
        with pytest.raises(thrift.ParameterError) as raised:
            await c.push_parameters(
                thrift.ParameterUpdate(
                    params=[thrift.Parameter(name="s", data=b"12345", dtype="<f4", shape=[3])],
                    timestamp=3,
                )
            )
        assert raised.value.code == SHAPE_MISMATCH
        assert await c.ping() == node.node_id
    finally:
        client.close()


# -- 5. our client reads what a founding client wrote ---------------------------------------


async def test_our_client_reads_founding_bytes(
    node: Node, client: ParameterClient, seed: types.SimpleNamespace
) -> None:
    T = seed.ttypes
    values = np.array([0.25, -1.0, 3.5, 1e-3], dtype=np.float32)
    async with apache_client(seed, node, "buffered-binary") as old:
        await old.update_parameters(
            T.ParameterUpdate(
                params=[T.Parameter("legacy", values.tobytes(), version=3)], timestamp=4
            )
        )
    arrays = await client.get_arrays(["legacy"])
    assert list(arrays) == ["legacy"]
    raw = arrays["legacy"]
    assert raw.dtype == np.uint8 and raw.shape == (values.nbytes,)
    np.testing.assert_array_equal(raw, np.frombuffer(values.tobytes(), np.uint8))

    response = await client.get_parameters(["legacy"])
    [p] = response.params
    assert (p.name, p.version, p.dtype, p.shape) == ("legacy", 3, None, None)
    assert response.timestamp == 4
    as_f32 = from_parameter(p, dtype=np.float32)
    assert as_f32.dtype == np.float32
    np.testing.assert_array_equal(as_f32, values)

    # and the other way: a founding client reads what we wrote, as plain bytes
    versions = await client.update_arrays({"ours": values * 2})
    async with apache_client(seed, node, "framed-compact") as old:
        response = await old.get_parameters(T.ParameterRequest(param_names=["ours"]))
    [p] = response.params
    assert p.version == versions["ours"] == 1
    np.testing.assert_array_equal(np.frombuffer(p.data, np.float32), values * 2)


def test_generated_modules_left_no_trace(
    seed: types.SimpleNamespace, ours: types.SimpleNamespace
) -> None:
    """Importing the generated code changed neither sys.path nor sys.modules."""
    assert not [k for k in sys.modules if _is_generated(k)]
    assert not [p for p in sys.path if "gen-seed" in p or "gen-ours" in p]
    assert seed.service is not ours.service
    assert not hasattr(seed.ttypes, "ParameterError")
    assert hasattr(ours.ttypes, "ParameterError")
