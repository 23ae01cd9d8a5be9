#!/usr/bin/env python3
"""aioparamsync node vs. a raw socket ceiling, stock thriftpy2, gRPC and Thrift's C++ server.

On loopback. One command measures them all, interleaved, each server in a fresh process per
(variant, size, connections, repetition)::

    python benchmarks/bench_node.py [--sizes 4KiB,1MiB,64MiB] [--conns 1,8]
                                    [--reps 3] [--seconds 2] [--json out.json]
                                    [--plot out.png]

Variants:

* ``ceiling``: ``serve_ceiling``/``CeilingConnection`` below, a raw length-prefixed protocol on
  ``asyncio.BufferedProtocol`` under uvloop, doing the node's job without
  Thrift: it keeps the payloads in a dict, receives a large message into one
  exact-size buffer, allocated and not zeroed, as the node does (a small one
  through a 256 KiB scratch buffer and one copy), stores the payload as a view
  of it and sends it back by reference.
  Request: ``[u32 n][u8 op][u8 key length][key][payload]`` (n counts what
  follows it); op ``U`` is answered by a 1-byte ack, op ``G`` by
  ``[u32 n][payload]``.
* ``thriftpy2``: thriftpy2's stock aio server (``thriftpy2.rpc.make_aio_server``,
  framed transport, binary protocol, ``client_timeout=None``) on a uvloop loop,
  serving ``idl/aioparamsync.thrift`` (``thriftpy2.load``) with a dict-backed
  handler (``StockHandler``); driven with ``make_aio_client`` (framed, binary),
  one client per connection, ``update_parameters``/``get_parameters``.
* ``grpc``: a ``grpc.aio`` server under uvloop with generic handlers and no
  (de)serializers (raw bytes): ``/bench.Params/Update`` takes
  ``[u8 key length][key][payload]``, keeps it and answers a 1-byte ack;
  ``/bench.Params/Get`` takes the key and answers what was kept (the client
  skips the header, zero-copy). Messages up to 256 MiB. Driven with one
  ``grpc.aio`` channel per connection (a local subchannel pool, so each is
  its own TCP connection).
* ``cpp``: Apache Thrift's C++ server, as a Thrift user would deploy it:
  ``TThreadPoolServer`` (one pool thread per connection), framed transport, binary
  protocol, serving the founding IDL ``idl/ml_param_sync.thrift`` from a hash map under
  a reader-writer lock (``benchmarks/cpp/param_server.cpp``, built by ``cppserver.py``
  from Debian's ``libthrift-dev``, cached in ``build/cpp-baseline/``). Driven with the
  node's client (``CppWorker``): ``ParameterClient(address, max_connections=1,
  route=False)``, calling the founding methods by name (``call("update_parameters")``,
  ``call("get_parameters")``: the client's ``update_parameters``/``get_parameters``
  send ``push_parameters``/``pull_parameters``, which that IDL has not). Where it
  cannot be built, it is skipped, and the header says why.
* ``node``: ``python -m aioparamsync --port 0``, driven with the public client:
  one ``ParameterClient(address, max_connections=1)`` per connection,
  ``update_parameters([to_parameter(name, array)])`` and
  ``get_parameters([name])`` (the data stays a zero-copy view).

Every variant is divided by each of the baselines ``ceiling``, ``thriftpy2`` and
``cpp`` (the ratio tables).

The client runs in this process under uvloop and drives every variant the
same way: ``conns`` connections, each with one call in flight, each on its own
parameter (``p0``, ``p1``, ...), all sending the same array (the thriftpy2 and
gRPC clients take ``bytes``: made once per run, untimed). A run is: start
the server, two untimed updates and a get per connection (connects, stores the
parameter and replaces it once, checks the bytes come back equal), an update
phase, a get phase (each ending at ``--max-calls`` calls or ``--seconds``,
whichever comes first; calls in flight at the deadline complete and count), then the
server's peak RSS (VmHWM) is read and the server stopped (SIGTERM to its
PID, SIGKILL if it does not exit). Every process this script starts is
stopped in a ``finally``. A row (variant, size, conns) gets ``--row-budget``
seconds over all its repetitions: a repetition that would pass it is not
started, and the row says it was cut by time (stock thriftpy2 takes ~1.5 s
per 64 MiB call, ~15-20 s per round of 8).

glibc malloc: a fresh large buffer comes from mmap and page-faults on first
touch, which makes results depend on the process's malloc history (see
shared/research/thriftpy2.md §1.9). With ``--malloc tuned`` (the default)
every server, and this driver (it re-executes itself once), run with
``MALLOC_MMAP_THRESHOLD_=1GiB MALLOC_TRIM_THRESHOLD_=8GiB``: large buffers come
from the heap and freed memory is kept for reuse. ``--malloc default`` leaves
the environment alone. MALLOC_ARENA_MAX is left alone: the gRPC processes'
threads get arenas of their own, but strace shows their payload-sized
buffers all come from the main heap (no payload-sized mmap) with the tuning.
The C++ server's payloads do come from its pool threads' arenas, which serve
64 MiB only by mmap: with the tuning it runs with ``MALLOC_ARENA_MAX=1``
(``CPP_MALLOC_TUNED``; without, its 64 MiB updates ran 14x slower here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import select
import shlex
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve()
HOST = "127.0.0.1"
VARIANTS = (
    "ceiling",
    "ceiling-unix",
    "thriftpy2",
    "grpc",
    "cpp",
    "node",
    "node-pure",
    "node-unix",
    "node-2proc",
)
#: the baselines every figure is divided by
BASELINES = ("ceiling", "thriftpy2", "cpp")
#: the servers this script runs itself (``--serve``); the node is ``python -m aioparamsync``,
#: cpp a C++ binary (``cppserver.build()``)
BASELINE_SERVERS = ("ceiling", "ceiling-unix", "thriftpy2", "grpc")
#: the variants served (and called) over a Unix socket in a temporary directory
UNIX_VARIANTS = ("ceiling-unix", "node-unix")

# The same tuning for every process of a run (servers and driver).
MALLOC_TUNED = {
    "MALLOC_MMAP_THRESHOLD_": str(1024**3),  # above any frame: large buffers come from the heap
    "MALLOC_TRIM_THRESHOLD_": str(8 * 1024**3),  # and stay there for reuse once freed
}
# And for the C++ server: its pool threads allocate from arenas of their own, and such an
# arena serves a block of 64 MiB or more only by mmap, whatever the threshold (a fresh,
# page-faulting buffer per 64 MiB call: 84 instead of 1164 MB/s of updates, x1, here). One
# arena, the main heap, as the Python servers' payloads come from.
CPP_MALLOC_TUNED = {"MALLOC_ARENA_MAX": "1"}
_REEXEC_MARK = "BENCH_NODE_REEXEC"

# Like the node's receiver (aioparamsync/wire/framing.py).
SCRATCH_BYTES = 256 * 1024
LARGE_FRAME_BYTES = 64 * 1024
MAX_FRAME_BYTES = 256 * 1024 * 1024

_U32 = struct.Struct("!I")
_REQ = struct.Struct("!IBB")  # n, op, key length
_OP_UPDATE = ord("U")
_OP_GET = ord("G")
_ACK = b"\x01"

SERVER_START_TIMEOUT = 30.0
SERVER_STOP_TIMEOUT = 10.0
CALL_TIMEOUT = 60.0
# thriftpy2's stock stack takes seconds per 64 MiB call, and 8 connections share one
# event loop that a decode blocks: its client and the guards of a run wait this long.
SLOW_CALL_TIMEOUT = 600.0
WARMUP_UPDATES = 2  # untimed update rounds before the update phase


# ---------------------------------------------------------------------------
# The ceiling: a raw length-prefixed protocol, server and client


class FrameReceiver:
    """``[u32 n][n bytes]`` frames: small ones via a scratch buffer, large ones in place.

    As the node's receiver (aioparamsync/wire/framing.py): a frame above 64 KiB
    goes straight into one buffer of its exact size, allocated but not zeroed.
    """

    def __init__(self) -> None:
        self.scratch = bytearray(SCRATCH_BYTES)
        self.start = 0
        self.end = 0
        self.large: memoryview | None = None
        self.filled = 0

    def get_buffer(self) -> memoryview:
        if self.large is not None:
            return self.large[self.filled :]
        if self.end == len(self.scratch):
            unread = self.end - self.start
            self.scratch[:unread] = self.scratch[self.start : self.end]
            self.start, self.end = 0, unread
        return memoryview(self.scratch)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.large is not None:
            self.filled += nbytes
        else:
            self.end += nbytes

    def take_byte(self) -> bool:
        """Consume one byte (an ack) if one has arrived."""
        if self.large is None and self.end > self.start:
            self.start += 1
            if self.start == self.end:
                self.start = self.end = 0
            return True
        return False

    def frames(self) -> list[memoryview]:
        out: list[memoryview] = []
        if self.large is not None:
            if self.filled == len(self.large):
                out.append(self.large.toreadonly())
                self.large = None
                self.filled = 0
            return out
        scratch = self.scratch
        while self.end - self.start >= 4:
            start = self.start
            size = _U32.unpack_from(scratch, start)[0]
            if size > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {size} bytes")
            available = self.end - start - 4
            if size > LARGE_FRAME_BYTES and available < size:
                # Allocated, not zeroed (the node's numpy.empty): the socket fills it.
                self.large = memoryview(np.empty(size, np.uint8))  # type: ignore[arg-type]
                self.large[:available] = memoryview(scratch)[start + 4 : self.end]
                self.filled = available
                self.start = self.end = 0
                return out
            if available < size:
                break
            out.append(memoryview(bytes(memoryview(scratch)[start + 4 : start + 4 + size])))
            self.start = start + 4 + size
        if self.start == self.end:
            self.start = self.end = 0
        return out


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class CeilingConnection(asyncio.BufferedProtocol):
    """One connection of the raw server (same buffering and flow control as the node's)."""

    def __init__(self, store: dict[bytes, memoryview]) -> None:
        self.store = store
        self.rx = FrameReceiver()
        self.transport: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        _nodelay(transport)
        transport.set_write_buffer_limits(high=8 * 1024 * 1024)  # type: ignore[attr-defined]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.rx.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.rx.buffer_updated(nbytes)
        try:
            frames = self.rx.frames()
        except ValueError:
            self.transport.close()
            return
        for frame in frames:
            op, klen = frame[0], frame[1]
            key = bytes(frame[2 : 2 + klen])
            if op == _OP_UPDATE:
                self.store[key] = frame[2 + klen :]
                self.transport.write(_ACK)
            elif op == _OP_GET:
                payload = self.store.get(key)
                if payload is None:
                    self.transport.write(_U32.pack(0))
                else:
                    self.transport.writelines([_U32.pack(len(payload)), payload])
            else:
                self.transport.close()
                return

    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False


async def serve_ceiling(host: str, port: int, unix_socket: str | None = None) -> None:
    loop = asyncio.get_running_loop()
    store: dict[bytes, memoryview] = {}
    server = await loop.create_server(
        lambda: CeilingConnection(store), host, port, reuse_address=True, backlog=1024
    )
    servers = [server]
    if unix_socket is not None:
        servers.append(await loop.create_unix_server(lambda: CeilingConnection(store), unix_socket))
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    h, p = server.sockets[0].getsockname()[:2]
    unix = f" and unix:{unix_socket}" if unix_socket is not None else ""
    print(f"bench-ceiling {os.getpid()} listening on {h}:{p}{unix}", flush=True)
    await stop.wait()
    for s in servers:
        s.close()
        await s.wait_closed()


class CeilingClient(asyncio.BufferedProtocol):
    """A client connection of the raw protocol, one call in flight."""

    def __init__(self) -> None:
        self.rx = FrameReceiver()
        self.transport: Any = None
        self.waiter: asyncio.Future | None = None
        self.want_ack = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        _nodelay(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.rx.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.rx.buffer_updated(nbytes)
        waiter = self.waiter
        if self.want_ack:
            if self.rx.take_byte() and waiter is not None and not waiter.done():
                self.waiter = None
                waiter.set_result(None)
            return
        frames = self.rx.frames()
        if frames and waiter is not None and not waiter.done():
            self.waiter = None
            waiter.set_result(frames[0])

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"ceiling server closed: {exc}"))

    async def update(self, key: bytes, payload: memoryview) -> None:
        self.want_ack = True
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines(
            [_REQ.pack(2 + len(key) + len(payload), _OP_UPDATE, len(key)), key, payload]
        )
        await self.waiter

    async def get(self, key: bytes) -> memoryview:
        self.want_ack = False
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(_REQ.pack(2 + len(key), _OP_GET, len(key)) + key)
        return await self.waiter


# ---------------------------------------------------------------------------
# thriftpy2's stock aio server, and gRPC's aio server, doing the same job


def stock_thrift() -> Any:
    """The IDL as thriftpy2 loads it (``thriftpy2.load``), for the stock server and client."""
    import thriftpy2

    global _STOCK_THRIFT
    if _STOCK_THRIFT is None:
        _STOCK_THRIFT = thriftpy2.load(
            str(REPO / "idl" / "aioparamsync.thrift"), module_name="bench_stock_thrift"
        )
    return _STOCK_THRIFT


_STOCK_THRIFT: Any = None


class StockHandler:
    """update_parameters/get_parameters over a dict, for thriftpy2's stock aio server."""

    def __init__(self) -> None:
        self.store: dict[str, Any] = {}
        self.timestamp = 0

    async def update_parameters(self, update: Any) -> None:
        for param in update.params:
            self.store[param.name] = param
        self.timestamp = max(self.timestamp, update.timestamp)

    async def get_parameters(self, request: Any) -> Any:
        params = [self.store[n] for n in request.param_names if n in self.store]
        return stock_thrift().ParameterResponse(params=params, timestamp=self.timestamp)


def serve_thriftpy2(host: str, port: int) -> None:
    """``thriftpy2.rpc.make_aio_server``: framed transport, binary protocol, no client timeout."""
    import uvloop
    from thriftpy2.contrib.aio.protocol import TAsyncBinaryProtocolFactory
    from thriftpy2.contrib.aio.transport import TAsyncFramedTransportFactory
    from thriftpy2.rpc import make_aio_server

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    server = make_aio_server(
        stock_thrift().ParameterSyncService,
        StockHandler(),
        host=host,
        port=port or 1,  # make_server refuses port 0; the socket is bound below
        proto_factory=TAsyncBinaryProtocolFactory(),
        trans_factory=TAsyncFramedTransportFactory(),
        client_timeout=None,  # the default (3000 ms) closes every connection after 3 s
        loop=loop,
    )
    server.trans.port = port  # 0: any free port
    server.init_server()  # listen, then asyncio.start_server on the bound socket
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, loop.stop)
    h, p = server.trans.raw_sock.getsockname()[:2]
    print(f"bench-thriftpy2 {os.getpid()} listening on {h}:{p}", flush=True)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(server.close())
        loop.close()


# gRPC: raw bytes both ways (no (de)serializer), messages up to 256 MiB.
GRPC_SERVICE = "bench.Params"
GRPC_MAX_MESSAGE = MAX_FRAME_BYTES
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
]
# Each client channel its own subchannel (TCP connection): by default gRPC
# shares one among the channels of a process that have the same target and options.
GRPC_CLIENT_OPTIONS = [*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


async def serve_grpc(host: str, port: int) -> None:
    """A ``grpc.aio`` server: ``Update`` takes ``[u8 key length][key][payload]`` and keeps it,
    answering a 1-byte ack; ``Get`` takes the key and answers what ``Update`` kept, by reference."""
    import grpc

    store: dict[bytes, bytes] = {}

    async def update(request: bytes, context: Any) -> bytes:
        store[request[1 : 1 + request[0]]] = request
        return _ACK

    async def get(request: bytes, context: Any) -> bytes:
        return store.get(request, b"")

    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                GRPC_SERVICE,
                {
                    "Update": grpc.unary_unary_rpc_method_handler(update),
                    "Get": grpc.unary_unary_rpc_method_handler(get),
                },
            ),
        )
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"bench-grpc {os.getpid()} listening on {host}:{bound}", flush=True)
    await stop.wait()
    await server.stop(grace=1.0)


# ---------------------------------------------------------------------------
# Workers: one connection each, the same interface for every variant


class CeilingWorker:
    def __init__(self, address: tuple[str, int], index: int, array: Any) -> None:
        self.address = address
        self.key = f"p{index}".encode()
        self.array = array
        self.payload = memoryview(array.reshape(-1).view("u1"))
        self.nbytes = array.nbytes
        self.conn: CeilingClient | None = None

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        host, port = self.address
        if host.startswith("unix:"):
            _, self.conn = await loop.create_unix_connection(CeilingClient, host[len("unix:") :])
        else:
            _, self.conn = await loop.create_connection(CeilingClient, host, port)

    async def update(self) -> None:
        await self.conn.update(self.key, self.payload)  # type: ignore[union-attr]

    async def get(self) -> None:
        data = await self.conn.get(self.key)  # type: ignore[union-attr]
        if len(data) != self.nbytes:
            raise RuntimeError(f"ceiling get: {len(data)} bytes, expected {self.nbytes}")

    async def check(self) -> None:
        data = await self.conn.get(self.key)  # type: ignore[union-attr]
        if not np.array_equal(np.frombuffer(data, self.array.dtype), self.array):
            raise RuntimeError("ceiling get returned other bytes than were stored")

    async def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()
        await asyncio.sleep(0)


class NodeWorker:
    def __init__(self, address: tuple[str, int], index: int, array: Any) -> None:
        from aioparamsync import ParameterClient

        self.name = f"p{index}"
        self.array = array
        self.nbytes = array.nbytes
        self.client = ParameterClient(address, max_connections=1, timeout=CALL_TIMEOUT, route=False)

    async def open(self) -> None:
        await self.client.ping()

    async def update(self) -> None:
        from aioparamsync import to_parameter

        await self.client.update_parameters([to_parameter(self.name, self.array)])

    async def get(self) -> None:
        response = await self.client.get_parameters([self.name])
        params = response.params
        if len(params) != 1 or memoryview(params[0].data).nbytes != self.nbytes:
            raise RuntimeError(f"node get of {self.name!r}: unexpected response")

    async def check(self) -> None:
        from aioparamsync import from_parameter

        response = await self.client.get_parameters([self.name])
        if not np.array_equal(from_parameter(response.params[0]), self.array):
            raise RuntimeError("node get returned other values than were stored")

    async def close(self) -> None:
        await self.client.close()


class CppWorker(NodeWorker):
    """The node's client against Thrift's C++ server, by the founding IDL's method names.

    The client's ``update_parameters``/``get_parameters`` send ``push_parameters``/
    ``pull_parameters``, and ``NodeWorker.open`` a ``ping``: none of them is in the founding
    IDL. ``call`` sends the same update (``make_update``, as ``update_parameters`` makes it)
    under the founding name. The server keeps plain bytes: ``check`` compares bytes, and
    the version, which the server bumps on each update.
    """

    def __init__(self, address: tuple[str, int], index: int, array: Any) -> None:
        from aioparamsync.wire import thrift

        super().__init__(address, index, array)
        self.request = thrift.ParameterRequest(param_names=[self.name])
        self.updates = 0

    async def open(self) -> None:
        await self.client.call("get_parameters", request=self.request)  # (connects)

    async def update(self) -> None:
        from aioparamsync import to_parameter
        from aioparamsync.client.updates import make_update

        self.updates += 1
        update = make_update([to_parameter(self.name, self.array)], None)
        await self.client.call("update_parameters", update=update)

    async def _get(self) -> Any:
        response = await self.client.call("get_parameters", request=self.request)
        params = response.params
        if len(params) != 1 or memoryview(params[0].data).nbytes != self.nbytes:
            raise RuntimeError(f"cpp get of {self.name!r}: unexpected response")
        return params[0]

    async def get(self) -> None:
        await self._get()

    async def check(self) -> None:
        param = await self._get()
        if not np.array_equal(np.frombuffer(param.data, self.array.dtype), self.array):
            raise RuntimeError("cpp get returned other bytes than were stored")
        if param.version != self.updates:
            raise RuntimeError(f"cpp get: version {param.version} after {self.updates} updates")


class ThriftpyWorker:
    """thriftpy2's stock aio client (``make_aio_client``, framed, binary), one connection."""

    def __init__(self, address: tuple[str, int], index: int, array: Any) -> None:
        self.address = address
        self.name = f"p{index}"
        self.array = array
        self.nbytes = array.nbytes
        self.data = array.tobytes()  # the client takes bytes; made once, untimed
        self.timestamp = 0
        self.client: Any = None

    async def open(self) -> None:
        from thriftpy2.contrib.aio.protocol import TAsyncBinaryProtocolFactory
        from thriftpy2.contrib.aio.transport import TAsyncFramedTransportFactory
        from thriftpy2.rpc import make_aio_client

        ms = int(SLOW_CALL_TIMEOUT * 1000)
        self.client = await make_aio_client(
            stock_thrift().ParameterSyncService,
            host=self.address[0],
            port=self.address[1],
            proto_factory=TAsyncBinaryProtocolFactory(),
            trans_factory=TAsyncFramedTransportFactory(),
            timeout=ms,  # per read and per drain, not per call
            connect_timeout=ms,
        )

    async def update(self) -> None:
        t = stock_thrift()
        self.timestamp += 1
        param = t.Parameter(name=self.name, data=self.data)
        await self.client.update_parameters(t.ParameterUpdate([param], self.timestamp))

    async def _get(self) -> bytes:
        t = stock_thrift()
        response = await self.client.get_parameters(t.ParameterRequest([self.name]))
        if len(response.params) != 1:
            raise RuntimeError(f"thriftpy2 get of {self.name!r}: unexpected response")
        return response.params[0].data

    async def get(self) -> None:
        if len(await self._get()) != self.nbytes:
            raise RuntimeError(f"thriftpy2 get of {self.name!r}: wrong size")

    async def check(self) -> None:
        data = await self._get()
        if not np.array_equal(np.frombuffer(data, self.array.dtype), self.array):
            raise RuntimeError("thriftpy2 get returned other bytes than were stored")

    async def close(self) -> None:
        if self.client is not None:
            self.client.close()
        await asyncio.sleep(0)


class GrpcWorker:
    """One ``grpc.aio`` channel (its own TCP connection), raw bytes, no (de)serializer."""

    def __init__(self, address: tuple[str, int], index: int, array: Any) -> None:
        import grpc

        key = f"p{index}".encode()
        self.key = key
        self.array = array
        self.nbytes = array.nbytes
        # [u8 key length][key][payload]; the channel takes bytes: made once, untimed.
        self.request = bytes([len(key)]) + key + array.tobytes()
        self.channel = grpc.aio.insecure_channel(
            f"{address[0]}:{address[1]}", options=GRPC_CLIENT_OPTIONS
        )
        self._update = self.channel.unary_unary(f"/{GRPC_SERVICE}/Update")
        self._get_call = self.channel.unary_unary(f"/{GRPC_SERVICE}/Get")

    async def open(self) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), CALL_TIMEOUT)

    async def update(self) -> None:
        await self._update(self.request, timeout=CALL_TIMEOUT)

    async def _get(self) -> memoryview:
        reply = await self._get_call(self.key, timeout=CALL_TIMEOUT)
        head = 1 + len(self.key)
        if len(reply) != head + self.nbytes:
            raise RuntimeError(f"grpc get: {len(reply)} bytes, expected {head + self.nbytes}")
        return memoryview(reply)[head:]

    async def get(self) -> None:
        await self._get()

    async def check(self) -> None:
        data = await self._get()
        if not np.array_equal(np.frombuffer(data, self.array.dtype), self.array):
            raise RuntimeError("grpc get returned other bytes than were stored")

    async def close(self) -> None:
        await self.channel.close()


WORKERS = {
    "ceiling": CeilingWorker,
    "ceiling-unix": CeilingWorker,
    "thriftpy2": ThriftpyWorker,
    "grpc": GrpcWorker,
    "cpp": CppWorker,
    "node": NodeWorker,
    "node-pure": NodeWorker,  # (the node without its extensions; the driver's client as always)
    "node-unix": NodeWorker,
    "node-2proc": NodeWorker,  # (two node processes, one cluster, R=1: see _server_cmd)
}


# ---------------------------------------------------------------------------
# Server processes


NODE_ARGS = ["--host", HOST, "--port", "0", "--log-level", "warning"]


def _server_cmd(
    variant: str, profile: Path | None, node_args: Sequence[str] = (), unix: str | None = None
) -> list[str]:
    node = variant.startswith("node")
    if node:
        node_args = [*node_args, *(["--unix-socket", unix] if unix else [])]
    if variant == "node-2proc":  # (each key on one of the two: the host's two cores)
        node_args = [*node_args, "--processes", "2", "--replication-factor", "1"]
    if profile is not None:
        # In-process, under cProfile timed by CPU time (wall time would count
        # the waits and the preemptions of a loaded machine).
        extra = list(node_args) if node else []
        return [sys.executable, str(THIS), "--serve-profiled", str(profile), variant, *extra]
    if node:
        return [sys.executable, "-m", "aioparamsync", *NODE_ARGS, *node_args]
    cmd = [sys.executable, str(THIS), "--serve", variant, "--host", HOST, "--port", "0"]
    return cmd + (["--unix-socket", unix] if unix else [])


def serve(variant: str, host: str, port: int, unix_socket: str | None = None) -> int:
    """Run one of the baseline servers in this process until SIGTERM."""
    import uvloop

    if variant in ("ceiling", "ceiling-unix"):
        uvloop.run(serve_ceiling(host, port, unix_socket))
    elif variant == "thriftpy2":
        serve_thriftpy2(host, port)
    elif variant == "grpc":
        uvloop.run(serve_grpc(host, port))
    else:
        raise ValueError(f"no server {variant!r}")
    return 0


def serve_profiled(out: str, variant: str, *node_args: str) -> int:
    import cProfile

    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        if variant.startswith("node"):
            from aioparamsync.cli.node import main as node_main

            return node_main([*NODE_ARGS, *node_args])
        return serve(variant, HOST, 0)
    finally:
        profiler.disable()
        profiler.dump_stats(out)


def _load_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform == "linux" else None  # looked up before any fork


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if this driver dies (even by SIGKILL)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def plan_cpus(pin: str) -> tuple[set[int], set[int]] | None:
    """(client CPUs, server CPUs): one core each, or None to leave scheduling alone."""
    if pin == "off" or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, {cpus[1]}


class ServerFailed(RuntimeError):
    """A server did not start (it exited, or said something else than where it listens)."""


class ServerProcess:
    """A server in a process of its own; stopped by its PID only.

    ``variant`` names it in errors; ``cmd``, when given, is the command to run
    instead of the variant's (it must print ``... listening on HOST:PORT`` first).
    """

    #: CPUs the servers are pinned to (None: not pinned)
    cpus: set[int] | None = None

    def __init__(
        self,
        variant: str,
        env: dict[str, str],
        profile: Path | None = None,
        *,
        cmd: Sequence[str] | None = None,
        node_args: Sequence[str] = (),
    ) -> None:
        self.variant = variant
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.tmp = tempfile.TemporaryDirectory()  # (its Unix socket, if any)
        unix = str(Path(self.tmp.name) / "server.sock") if variant in UNIX_VARIANTS else None
        if variant == "node-pure":
            env = {**env, "AIOPARAMSYNC_NO_EXT": "1"}
        self.proc = subprocess.Popen(
            _server_cmd(variant, profile, node_args, unix) if cmd is None else list(cmd),
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            preexec_fn=_die_with_parent,
        )
        try:
            if self.cpus is not None:
                os.sched_setaffinity(self.proc.pid, self.cpus)
            self.address = self._wait_listening()
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self) -> tuple[str, int]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        text = b""
        while b"\n" not in text:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerFailed(
                    f"{self.variant} server did not start within {SERVER_START_TIMEOUT} s"
                )
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise ServerFailed(f"{self.variant} server exited: {self.stderr_tail()}")
                text += chunk
        line = text.split(b"\n", 1)[0].decode()
        match = re.search(r"listening on (\S+):(\d+)(?: and (unix:\S+))?$", line)
        if not match:
            raise ServerFailed(f"{self.variant} server printed {line!r}")
        if match.group(3):  # (its Unix socket: a client of this variant connects there)
            return match.group(3), 0
        return match.group(1), int(match.group(2))

    def stderr_tail(self, n: int = 2000) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-n:]

    def _pids(self) -> list[int]:
        """The server's process and its children (``--processes``: the node processes)."""
        pid = self.proc.pid
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                return [pid, *(int(c) for c in f.read().split())]
        except OSError:
            return [pid]

    def status(self, key: str) -> int:
        """A ``VmHWM``-like line of /proc/PID/status, in KiB (summed over its processes)."""
        total = 0
        for pid in self._pids():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        total += int(line.split()[1])
        return total

    def cpu_seconds(self) -> float:
        total = 0
        for pid in self._pids():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        proc = self.proc
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(SERVER_STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(SERVER_STOP_TIMEOUT)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
            self.stderr.close()
            self.tmp.cleanup()


# ---------------------------------------------------------------------------
# One run


@dataclass
class PhaseResult:
    calls: int = 0
    seconds: float = 0.0
    calls_per_s: float = 0.0
    mb_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    server_cpu: float = 0.0  # server CPU seconds / wall seconds
    client_cpu: float = 0.0  # driver CPU seconds / wall seconds


@dataclass
class RunResult:
    variant: str
    size: int
    conns: int
    rep: int
    update: PhaseResult = field(default_factory=PhaseResult)
    get: PhaseResult = field(default_factory=PhaseResult)
    server_peak_rss_mib: float = 0.0
    load1: float = 0.0  # the machine's 1-minute load average as the run started
    wall_seconds: float = 0.0  # the whole run: server start, warm-up, phases, stop


def load_average() -> float:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


async def _phase(
    workers: list[Any],
    op: Callable[[Any], Awaitable[None]],
    size: int,
    seconds: float,
    max_calls: int,
    server: ServerProcess,
) -> PhaseResult:
    latencies: list[float] = []
    issued = 0
    clock = time.perf_counter
    cpu0, pcpu0 = server.cpu_seconds(), time.process_time()
    start = clock()
    deadline = start + seconds

    async def drive(worker: Any) -> None:
        nonlocal issued
        while issued < max_calls and clock() < deadline:
            issued += 1
            t0 = clock()
            await op(worker)
            latencies.append(clock() - t0)

    # A guard, not a measure: calls in flight at the deadline complete and count.
    async with asyncio.timeout(seconds + SLOW_CALL_TIMEOUT):
        await asyncio.gather(*(drive(w) for w in workers))
    elapsed = clock() - start
    cpu1, pcpu1 = server.cpu_seconds(), time.process_time()
    latencies.sort()
    n = len(latencies)
    return PhaseResult(
        calls=n,
        seconds=round(elapsed, 4),
        calls_per_s=n / elapsed,
        mb_per_s=n * size / elapsed / 1e6,
        p50_ms=_percentile(latencies, 50) * 1e3,
        p99_ms=_percentile(latencies, 99) * 1e3,
        server_cpu=(cpu1 - cpu0) / elapsed,
        client_cpu=(pcpu1 - pcpu0) / elapsed,
    )


async def run_once(
    variant: str,
    size: int,
    conns: int,
    rep: int,
    array: Any,
    args: argparse.Namespace,
    env: dict[str, str],
) -> RunResult:
    profile = None
    if args.profile:
        profile = Path(args.profile) / f"{variant}-{fmt_size(size)}-c{conns}-r{rep}.prof"
    load1 = load_average()
    t0 = time.monotonic()
    cmd = None
    if variant == "cpp":  # (a C++ binary: no cProfile)
        cmd = [str(args.cpp_server), "--host", HOST, "--port", "0", "--threads", str(conns)]
        profile = None
        env = cpp_environment(env, args.malloc)
    server = ServerProcess(variant, env, profile, cmd=cmd, node_args=args.node_args)
    workers: list[Any] = []
    try:
        workers = [WORKERS[variant](server.address, i, array) for i in range(conns)]
        # A guard: stock thriftpy2 takes ~15-20 s per round of 8 x 64 MiB calls here.
        async with asyncio.timeout(SLOW_CALL_TIMEOUT):
            await asyncio.gather(*(w.open() for w in workers))
            # Untimed: store p0..pN, then replace them once, so that the server
            # has touched the memory of both generations (old and new buffer)
            # before the clock starts: the first touch of fresh memory is slow
            # (page faults, and more so in a VM) and is not the steady state.
            for _ in range(WARMUP_UPDATES):
                await asyncio.gather(*(w.update() for w in workers))
            await asyncio.gather(*(w.check() for w in workers))
        result = RunResult(variant, size, conns, rep, load1=load1)
        if "update" in args.ops:
            result.update = await _phase(
                workers, lambda w: w.update(), size, args.seconds, args.max_calls, server
            )
        if "get" in args.ops:
            result.get = await _phase(
                workers, lambda w: w.get(), size, args.seconds, args.max_calls, server
            )
        result.server_peak_rss_mib = server.status("VmHWM") / 1024
    except BaseException:
        if server.proc.poll() is not None:
            print(f"{variant} server died: {server.stderr_tail()}", file=sys.stderr)
        raise
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                await w.close()
        server.stop()
    result.wall_seconds = round(time.monotonic() - t0, 3)
    return result


# ---------------------------------------------------------------------------
# Summary


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4KiB, 1MiB, 4096)")
    value = int(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 1 <= value <= MAX_FRAME_BYTES - 1024:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be in 1..{MAX_FRAME_BYTES - 1024}")
    return value


def _list_of(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse_list(text: str) -> list[Any]:
        return [parse(t) for t in text.split(",") if t.strip()]

    return parse_list


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


PHASE_KEYS = ("calls_per_s", "mb_per_s", "p50_ms", "p99_ms", "server_cpu", "client_cpu")
# (ratio name, row key): a throughput ratio above 1 is faster than the baseline, a
# latency or RSS ratio above 1 is slower or bigger. MB/s is calls/s times the size.
RATIO_KEYS = (
    ("update_throughput", "update_calls_per_s"),
    ("get_throughput", "get_calls_per_s"),
    ("update_p50_latency", "update_p50_ms"),
    ("update_p99_latency", "update_p99_ms"),
    ("get_p50_latency", "get_p50_ms"),
    ("get_p99_latency", "get_p99_ms"),
    ("server_peak_rss", "server_peak_rss_mib"),
)


def summarize(
    runs: list[RunResult],
    planned: dict[tuple[str, int, int], int] | None = None,
) -> tuple[list[dict], list[dict]]:
    """Medians per (variant, size, conns), and each row as a ratio to every baseline.

    ``planned``: the repetitions planned per row; a row with fewer runs was cut by time.
    """
    groups: dict[tuple[str, int, int], list[RunResult]] = {}
    for r in runs:
        groups.setdefault((r.variant, r.size, r.conns), []).append(r)
    rows = []
    for (variant, size, conns), rs in groups.items():
        reps_planned = (planned or {}).get((variant, size, conns), len(rs))
        row: dict[str, Any] = {
            "variant": variant,
            "size": size,
            "size_text": fmt_size(size),
            "conns": conns,
            "n": len(rs),
            "reps_planned": reps_planned,
            "cut_by_time": len(rs) < reps_planned,
        }
        for phase in ("update", "get"):
            for key in PHASE_KEYS:
                row[f"{phase}_{key}"] = statistics.median(
                    getattr(getattr(r, phase), key) for r in rs
                )
        row["server_peak_rss_mib"] = statistics.median(r.server_peak_rss_mib for r in rs)
        row["wall_seconds"] = round(sum(r.wall_seconds for r in rs), 3)
        rows.append(row)
    index = {(r["variant"], r["size"], r["conns"]): r for r in rows}
    ratios = []
    for baseline in BASELINES:
        for (variant, size, conns), row in index.items():
            base = index.get((baseline, size, conns))
            if variant == baseline or base is None:
                continue
            ratio: dict[str, Any] = {
                "variant": variant,
                "baseline": baseline,
                "size": size,
                "size_text": fmt_size(size),
                "conns": conns,
            }
            for name, key in RATIO_KEYS:
                # None (JSON null) when a phase did not run (--ops) or measured nothing.
                ratio[name] = row[key] / base[key] if row[key] and base[key] else None
            ratios.append(ratio)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (r["size"], r["conns"], order.get(r["variant"], 9)))
    ratios.sort(
        key=lambda r: (
            BASELINES.index(r["baseline"]),
            r["size"],
            r["conns"],
            order.get(r["variant"], 9),
        )
    )
    return rows, ratios


def _num(value: float | None, fmt: str) -> str:
    return "-" if not value else format(value, fmt)


def print_table(rows: list[dict], ratios: list[dict], out: Any = sys.stdout) -> None:
    head = (
        "size",
        "conns",
        "variant",
        "n",
        "upd calls/s",
        "upd MB/s",
        "upd p50 ms",
        "upd p99 ms",
        "get calls/s",
        "get MB/s",
        "get p50 ms",
        "get p99 ms",
        "srv CPU u/g",
        "cli CPU u/g",
        "srv peak RSS MiB",
    )
    lines = []
    for r in rows:
        lines.append(
            (
                r["size_text"],
                str(r["conns"]),
                r["variant"],
                f"{r['n']} of {r['reps_planned']}*" if r["cut_by_time"] else str(r["n"]),
                _num(r["update_calls_per_s"], ".1f"),
                _num(r["update_mb_per_s"], ".1f"),
                _num(r["update_p50_ms"], ".3f"),
                _num(r["update_p99_ms"], ".3f"),
                _num(r["get_calls_per_s"], ".1f"),
                _num(r["get_mb_per_s"], ".1f"),
                _num(r["get_p50_ms"], ".3f"),
                _num(r["get_p99_ms"], ".3f"),
                f"{r['update_server_cpu']:.2f}/{r['get_server_cpu']:.2f}",
                f"{r['update_client_cpu']:.2f}/{r['get_client_cpu']:.2f}",
                f"{r['server_peak_rss_mib']:.0f}",
            )
        )
    _print_md(head, lines, out)
    cut = [r for r in rows if r["cut_by_time"]]
    if cut:
        print(
            "\n* cut by time: "
            + "; ".join(
                f"{r['variant']} {r['size_text']} x{r['conns']} ran {r['n']} of "
                f"{r['reps_planned']} reps ({r['wall_seconds']:.0f} s)"
                for r in cut
            )
            + ". Another rep would have passed the row's time budget (--row-budget).",
            file=out,
        )
    for baseline in BASELINES:
        mine = [r for r in ratios if r["baseline"] == baseline]
        if not mine:
            continue
        print(
            f"\n/ {baseline} (medians; throughput > 1: faster than {baseline}; "
            "latency, RSS > 1: slower, bigger)",
            file=out,
        )
        head2 = (
            "size",
            "conns",
            "variant",
            "upd thr",
            "get thr",
            "upd p50",
            "upd p99",
            "get p50",
            "get p99",
            "peak RSS",
        )
        lines2 = [
            (
                r["size_text"],
                str(r["conns"]),
                r["variant"],
                *(_num(r[name], ".2f") for name, _ in RATIO_KEYS),
            )
            for r in mine
        ]
        _print_md(head2, lines2, out)


PLOT_COLORS = {
    "ceiling": "0.55",
    "ceiling-unix": "0.8",
    "thriftpy2": "#d62728",
    "grpc": "#2ca02c",
    "cpp": "#8c564b",
    "node": "#1f77b4",
    "node-pure": "#9467bd",
    "node-unix": "#17becf",
    "node-2proc": "#ff7f0e",
}


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """MB/s per variant, one panel per (op, size), bars grouped by connections (log scale).

    Each bar is labelled with its ratio to the ceiling; a hatched bar is a row
    cut by time. matplotlib is imported here only (the ``bench`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    sizes = sorted({r["size"] for r in rows})
    conns = sorted({r["conns"] for r in rows})
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    index = {(r["variant"], r["size"], r["conns"]): r for r in rows}
    ops = ("update", "get")
    fig, axes = plt.subplots(
        len(ops),
        len(sizes),
        figsize=(4.2 * len(sizes), 3.6 * len(ops)),
        squeeze=False,
        constrained_layout=True,
    )
    width = 0.8 / len(variants)
    for i, op in enumerate(ops):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            for k, variant in enumerate(variants):
                xs, ys, labels, hatches = [], [], [], []
                for c, n in enumerate(conns):
                    row = index.get((variant, size, n))
                    if row is None or not row[f"{op}_mb_per_s"]:
                        continue
                    base = index.get(("ceiling", size, n))
                    value = row[f"{op}_mb_per_s"]
                    xs.append(c + (k - (len(variants) - 1) / 2) * width)
                    ys.append(value)
                    b = base[f"{op}_mb_per_s"] if base else 0
                    labels.append(f"{value / b:.2f}" if b else "")
                    hatches.append("//" if row["cut_by_time"] else "")
                bars = ax.bar(
                    xs,
                    ys,
                    width,
                    color=PLOT_COLORS.get(variant),
                    label=variant if i == j == 0 else None,
                )
                for bar, hatch in zip(bars, hatches, strict=True):
                    bar.set_hatch(hatch)
                ax.bar_label(bars, labels=labels, fontsize=7, rotation=90, padding=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(range(len(conns)), [f"{n} conn" + ("s" if n > 1 else "") for n in conns])
            ax.set_title(f"{op}, {fmt_size(size)}", fontsize=10)
            if j == 0:
                ax.set_ylabel("MB/s (log)")
            ax.margins(y=0.25)
    fig.legend(loc="outside upper center", ncols=len(variants), fontsize=9)
    if title:
        fig.supxlabel(title, fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print_md(head: Sequence[str], lines: Sequence[Sequence[str]], out: Any) -> None:
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
        for i, h in enumerate(head)
    ]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |", file=out)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|", file=out)
    for line in lines:
        print(
            "| " + " | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) + " |",
            file=out,
        )


def git_state() -> str:
    """The commit measured, and the package's files changed since it (if any)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "aioparamsync"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [line[3:] for line in dirty if line.strip()]
    return commit + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


def grpc_version() -> str:
    try:
        import grpc
    except ImportError:
        return "not installed"
    return str(grpc.__version__)


def machine() -> dict[str, Any]:
    """The commit, the CPUs and the versions measured."""
    import numpy
    import thriftpy2
    import uvloop

    import aioparamsync

    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "git": git_state(),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "libc": " ".join(platform.libc_ver()),
        "uvloop": uvloop.__version__,
        "numpy": numpy.__version__,
        "thriftpy2": thriftpy2.__version__,
        "grpcio": grpc_version(),
        "aioparamsync": aioparamsync.__version__,
    }


def machine_info(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    return {
        **machine(),
        "malloc": args.malloc,
        "client_cpus": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "server_cpus": sorted(ServerProcess.cpus) if ServerProcess.cpus is not None else None,
        "malloc_env": {k: v for k, v in env.items() if k.startswith("MALLOC_")},
        "seconds": args.seconds,
        "max_calls": args.max_calls,
        "reps": args.reps,
        "sizes": args.sizes,
        "conns": args.conns,
        "variants": args.variants,
        "ops": args.ops,
        "row_budget": args.row_budget,
        "node_args": args.node_args,
        "cpp_server": str(args.cpp_server) if args.cpp_server else None,
        "skipped": args.skipped,
        "mb": "10^6 bytes",
    }


# ---------------------------------------------------------------------------
# Main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument(
        "--sizes",
        type=_list_of(parse_size),
        default=_list_of(parse_size)("4KiB,1MiB,64MiB"),
        help="payload bytes per parameter, comma separated (default: 4KiB,1MiB,64MiB)",
    )
    p.add_argument(
        "--conns",
        type=_list_of(_positive_int),
        default=[1, 8],
        help="concurrent connections, one call in flight each (default: 1,8)",
    )
    p.add_argument(
        "--reps", type=_positive_int, default=3, help="repetitions (default: %(default)s)"
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="deadline of each phase, update and get (default: %(default)s)",
    )
    p.add_argument(
        "--max-calls",
        type=_positive_int,
        default=200_000,
        help="most calls of one phase, all connections together (default: %(default)s)",
    )
    p.add_argument(
        "--variants",
        type=_list_of(str),
        default=list(VARIANTS),
        help=f"which of {','.join(VARIANTS)} to run (default: all)",
    )
    p.add_argument(
        "--ops",
        type=_list_of(str),
        default=["update", "get"],
        help="which phases to time, update,get (default: both; the warm-up always updates)",
    )
    p.add_argument(
        "--row-budget",
        type=float,
        default=60.0,
        help="seconds of wall time per (variant, size, conns) row, all its reps together: "
        "a rep that would pass it is not started, and the row says it was cut by time "
        "(the first rep always runs; default: %(default)s)",
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG of MB/s and ratios (matplotlib)")
    p.add_argument(
        "--malloc",
        choices=("tuned", "default"),
        default="tuned",
        help="glibc malloc settings of every process (default: %(default)s; see the docstring)",
    )
    p.add_argument(
        "--pin",
        choices=("auto", "off"),
        default="off",
        help="auto: pin this driver (the client) to one CPU and each server to another, "
        "so that each side has one core, as between two hosts; on a machine that other "
        "work keeps busy, pinning makes results worse (default: %(default)s)",
    )
    p.add_argument("--json", metavar="PATH", help="write every run and the medians to PATH")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="run the servers under cProfile (CPU time), one .prof per run in DIR",
    )
    p.add_argument("--serve", choices=BASELINE_SERVERS, help=argparse.SUPPRESS)
    p.add_argument(
        "--node-args",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help="more flags for the node, as one string, e.g. --node-args='--max-receiving-bytes 0'",
    )
    p.add_argument("--serve-profiled", nargs="+", metavar="OUT VARIANT", help=argparse.SUPPRESS)
    p.add_argument("--host", default=HOST, help=argparse.SUPPRESS)
    p.add_argument("--unix-socket", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p


async def amain(args: argparse.Namespace, env: dict[str, str]) -> int:
    arrays = {}
    for size in args.sizes:
        if size % 4 == 0:
            arrays[size] = np.random.default_rng(size).random(size // 4, dtype=np.float32)
        else:
            arrays[size] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    plan = []
    for rep in range(args.reps):
        for size in args.sizes:
            for conns in args.conns:
                k = rep % len(args.variants)
                for variant in args.variants[k:] + args.variants[:k]:  # rotate the order each rep
                    plan.append((variant, size, conns, rep))
    planned = {(v, size, conns): args.reps for v, size, conns, _ in plan}
    # SIGTERM cancels the run, so the finally clauses stop the servers.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    info = machine_info(args, env)
    load_before = load_average()
    info["load1_before"] = load_before
    print(run_header(info, args), file=sys.stderr, flush=True)
    if load_before > 0.5:
        print(
            f"note: load average {load_before:.2f} before the first run: other processes compete "
            "for the CPUs, expect noise",
            file=sys.stderr,
        )
    runs: list[RunResult] = []
    spent: dict[tuple[str, int, int], list[float]] = {}
    t_start = time.monotonic()
    for i, (variant, size, conns, rep) in enumerate(plan, 1):
        took = spent.setdefault((variant, size, conns), [])
        if took and sum(took) + statistics.mean(took) > args.row_budget:
            print(
                f"[{i}/{len(plan)} {time.monotonic() - t_start:6.1f}s] {variant:9s} "
                f"{fmt_size(size):>6s} x{conns} rep{rep}: cut by time (the row's reps took "
                f"{sum(took):.0f} s, --row-budget {args.row_budget:g} s)",
                file=sys.stderr,
                flush=True,
            )
            continue
        r = await run_once(variant, size, conns, rep, arrays[size], args, env)
        took.append(r.wall_seconds)
        runs.append(r)
        print(
            f"[{i}/{len(plan)} {time.monotonic() - t_start:6.1f}s] {variant:9s} "
            f"{fmt_size(size):>6s} x{conns} rep{rep}: "
            f"update {r.update.calls_per_s:9.1f}/s {r.update.mb_per_s:8.1f} MB/s "
            f"| get {r.get.calls_per_s:9.1f}/s {r.get.mb_per_s:8.1f} MB/s | peak RSS "
            f"{r.server_peak_rss_mib:.0f} MiB | {r.wall_seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    rows, ratios = summarize(runs, planned)
    info["load1_after"] = load_average()
    info["total_seconds"] = round(time.monotonic() - t_start, 1)
    print()
    print(run_header(info, args))
    print()
    print_table(rows, ratios)
    if args.json:
        doc = {"meta": info, "rows": rows, "ratios": ratios, "runs": [asdict(r) for r in runs]}
        with open(args.json, "w") as f:  # noqa: ASYNC230 - after the last run
            f.write(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        plot(
            rows,
            args.plot,
            f"aioparamsync {info['git'].split()[0]}, {info['cpus']} CPUs, loopback, medians of "
            f"up to {args.reps} reps; bar labels: ratio to the ceiling; hatched: cut by time",
        )
    return 0


def run_header(info: dict[str, Any], args: argparse.Namespace) -> str:
    """What was measured, where, and with which malloc settings."""
    after = info.get("load1_after")
    load = f"load average {info['load1_before']:.2f} before" + (
        f", {after:.2f} after" if after is not None else ""
    )
    took = f" in {info['total_seconds']:.0f} s" if "total_seconds" in info else ""
    return (
        f"aioparamsync at {info['git']}{took}\n"
        f"{info['cpus']} CPUs ({info['cpu_model']}), Python {info['python']}, "
        f"uvloop {info['uvloop']}, thriftpy2 {info['thriftpy2']}, grpcio {info['grpcio']}; "
        f"client on CPUs {info['client_cpus']}, servers on {info['server_cpus'] or 'any'}; "
        f"{load}\n"
        f"malloc {info['malloc']}: {info['malloc_env'] or 'glibc defaults'} in every server and "
        "in this driver (see --help and benchmarks/README.md)\n"
        f"medians of {args.reps} reps, {args.seconds} s per phase (calls in flight at the "
        f"deadline complete and count), at most {args.max_calls} calls per phase, "
        f"--row-budget {args.row_budget:g} s; MB = 10^6 bytes; client and servers share the CPUs"
        + (f"\nthe node runs with: {shlex.join(args.node_args)}" if args.node_args else "")
        + (
            f"\ncpp: Apache Thrift's C++ TThreadPoolServer, a pool thread per connection "
            f"({info['cpp_server']})"
            + (f", with {CPP_MALLOC_TUNED}" if info["malloc"] == "tuned" else "")
            if info["cpp_server"]
            else ""
        )
        + "".join(f"\n{v} skipped: {why}" for v, why in info["skipped"].items())
    )


def run_environment(malloc: str, script: Path, *, reexec: bool) -> dict[str, str] | None:
    """The environment of every process of a run (servers, and the driver ``script``).

    With ``malloc == "tuned"`` and ``reexec``, a driver started without the
    tuning re-executes itself once with it (this call then does not return).
    None: the environment cannot be set (re-exec loop; printed).
    """
    env = dict(os.environ)
    if malloc == "tuned":
        env.update(MALLOC_TUNED)
        if reexec and any(os.environ.get(k) != v for k, v in MALLOC_TUNED.items()):
            if os.environ.get(_REEXEC_MARK):
                print("cannot set the malloc environment (re-exec loop)", file=sys.stderr)
                return None
            # glibc reads MALLOC_* at start-up: run the driver (the client) with them too.
            env[_REEXEC_MARK] = "1"
            sys.stdout.flush()
            os.execve(sys.executable, [sys.executable, str(script), *sys.argv[1:]], env)
    env.pop(_REEXEC_MARK, None)
    pythonpath = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + pythonpath if pythonpath else "")
    return env


def cpp_environment(env: dict[str, str], malloc: str) -> dict[str, str]:
    """The C++ server's environment: the run's, and one malloc arena under the tuning."""
    return {**env, **CPP_MALLOC_TUNED} if malloc == "tuned" else env


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.serve_profiled:
        sys.path.insert(0, str(REPO))
        return serve_profiled(*args.serve_profiled)
    if args.serve:
        return serve(args.serve, args.host, args.port, args.unix_socket)
    bad_ops = [o for o in args.ops if o not in ("update", "get")]
    if bad_ops or not args.ops:
        print(f"unknown ops {bad_ops}; choose from update,get", file=sys.stderr)
        return 2
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        print(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.seconds <= 0:
        print("--seconds must be positive", file=sys.stderr)
        return 2
    env = run_environment(args.malloc, THIS, reexec=argv is None)
    if env is None:
        return 2
    args.cpp_server, args.skipped = None, {}
    if "cpp" in args.variants:
        from cppserver import CppBaselineUnavailable, build

        try:
            args.cpp_server = build()
        except CppBaselineUnavailable as exc:
            args.skipped["cpp"] = exc.reason
            args.variants = [v for v in args.variants if v != "cpp"]
            print(f"cpp skipped: {exc.reason}", file=sys.stderr)
            if not args.variants:
                return 1
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    for out in (args.json, args.plot):  # before the runs: a bad path fails at once
        if out:
            Path(out).resolve().parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    pinned = plan_cpus(args.pin)
    if pinned is not None:
        os.sched_setaffinity(0, pinned[0])
        ServerProcess.cpus = pinned[1]
    import uvloop

    try:
        return uvloop.run(amain(args, env))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("interrupted; the servers started were stopped", file=sys.stderr)
        return 130
    except ServerFailed as exc:
        print(f"bench_node: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
