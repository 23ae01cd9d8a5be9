#!/usr/bin/env python3
"""The node's and the client's CPU per call, in one process, without sockets.

``bench_node.py`` measures whole calls over loopback, where the kernel's copies,
the scheduler and the other side all count. This script measures what is left
when they are taken away: the Python work per call of each side, each driven
by hand through transports that only count what is written.

* ``server``: a :class:`~aioparamsync.node.Node` (its store's writer running)
  and ``conns`` :class:`~aioparamsync.server.transport.ServerConnection` objects; each
  round feeds one encoded request per connection, in pieces as a socket would
  hand them over, and waits until every reply has been written.
* ``client``: ``conns`` :class:`~aioparamsync.ParameterClient` objects, each
  with one connection whose transport answers every call with a reply made
  beforehand (its seqid patched in), on the next pass of the event loop.

* ``server-wire`` and ``client-wire``: the wire work of one call alone, with no
  event loop, connection or store: on the node, cutting the request's frame,
  decoding it and encoding the reply; on the client, making the parameter,
  encoding the request, cutting the reply's frame and decoding it. The whole
  side's figure less this one is what a faster codec could not take away.

Each side's figure is CPU time (``time.process_time``) per call: the best and the
median of ``--reps`` repetitions of ``--rounds`` rounds, after 200 rounds of
warm-up. One core, no I/O: a figure here is the floor of what that side costs
per call on this machine. As ``bench_node.py`` does, the script runs with glibc
malloc tuned (it re-executes itself once with ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` set), so that large buffers are reused rather than
page-faulted in afresh. The client side reaches into the client's private
connection class (``aioparamsync.client.connection._Connection``) to give it the fake
transport.

    python benchmarks/bench_percall.py                      # 4 KiB, 8 connections
    python benchmarks/bench_percall.py --bytes 1MiB --conns 1 --ops update --sides server
    python benchmarks/bench_percall.py --sides server,server-wire,client,client-wire
    python benchmarks/bench_percall.py --paths pure     # the pure-Python path alone

``--paths compiled,pure`` (the default) runs each side on the compiled fast path
and on the pure-Python one (``AIOPARAMSYNC_NO_EXT=1``), one process each, one
after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aioparamsync import ParameterClient, has_extension, to_parameter
from aioparamsync.cli.options import byte_size
from aioparamsync.client import connection as client_module
from aioparamsync.node import Node
from aioparamsync.server.transport import ServerConnection
from aioparamsync.wire import MessageType, Receiver, decode_header, encode_message, method, thrift

# As bench_node.py's MALLOC_TUNED: large buffers from the heap, kept for reuse.
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(1024**3), "MALLOC_TRIM_THRESHOLD_": str(8 * 1024**3)}
WARMUP_ROUNDS = 200
# A socket hands the bytes over in pieces of at most this many bytes.
READ_BYTES = 256 * 1024


class CountingTransport:
    """Enough of an asyncio transport for a protocol: what is written goes to ``sink``."""

    def __init__(self, sink: Callable[[list[Any]], None]) -> None:
        self.sink = sink
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def writelines(self, parts: list[Any]) -> None:
        self.sink(parts)

    def write(self, data: Any) -> None:
        self.sink([data])

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def get_write_buffer_size(self) -> int:
        return 0


def feed(protocol: asyncio.BufferedProtocol, data: bytes | bytearray) -> None:
    """Hand ``data`` to ``protocol`` as a socket would, in pieces."""
    view = memoryview(data)
    while view:
        buffer = protocol.get_buffer(-1)
        n = min(len(buffer), len(view), READ_BYTES)
        buffer[:n] = view[:n]
        view = view[n:]
        protocol.buffer_updated(n)


def encoded(name: str, mtype: int, seqid: int, args: Any) -> bytes:
    parts, _ = encode_message(name, mtype, seqid, args)
    return b"".join(bytes(p) for p in parts)


async def measure(
    one_round: Callable[[], Awaitable[None]], rounds: int, reps: int, calls_per_round: int
) -> list[float]:
    """CPU microseconds per call, once per repetition."""
    for _ in range(WARMUP_ROUNDS):
        await one_round()
    results = []
    for _ in range(reps):
        started = time.process_time()
        for _ in range(rounds):
            await one_round()
        results.append((time.process_time() - started) / (rounds * calls_per_round) * 1e6)
    return results


def messages(op: str, array: np.ndarray) -> tuple[Any, Callable[[], Any], Any]:
    """The method of ``op``, a maker of its arguments (as a client makes them), and a reply body."""
    m = method("push_parameters" if op == "update" else "pull_parameters")
    if op == "update":

        def make_args() -> Any:
            update = thrift.ParameterUpdate(params=[to_parameter("p0", array)], timestamp=1)
            return m.args(update=update)

        body = m.result(success=thrift.UpdateResult(versions={"p0": 7}, timestamp=1))
    else:

        def make_args() -> Any:
            return m.args(request=thrift.ParameterRequest(param_names=["p0"]))

        param = thrift.Parameter(
            name="p0",
            data=memoryview(array).cast("B"),
            version=3,
            dtype="float32",
            shape=list(array.shape),
            origin="n",
        )
        body = m.result(success=thrift.ParameterResponse(params=[param], timestamp=1))
    return m, make_args, body


async def server_side(
    op: str, array: np.ndarray, conns: int, rounds: int, reps: int
) -> list[float]:
    node = Node("127.0.0.1", 0)
    await node.start()
    written = 0

    def sink(parts: list[Any]) -> None:
        nonlocal written
        written += 1

    try:
        connections = []
        for _ in range(conns):
            connection = ServerConnection(node.server)
            connection.connection_made(CountingTransport(sink))  # type: ignore[arg-type]
            connections.append(connection)
        m = method("push_parameters" if op == "update" else "pull_parameters")
        requests = []
        for i in range(conns):
            if op == "update":
                update = thrift.ParameterUpdate(params=[to_parameter(f"p{i}", array)], timestamp=1)
                args = m.args(update=update)
            else:
                await node.store.submit([to_parameter(f"p{i}", array)], 1)
                args = m.args(request=thrift.ParameterRequest(param_names=[f"p{i}"]))
            requests.append(encoded(m.name, 1, 5, args))

        async def one_round() -> None:
            target = written + conns
            for connection, request in zip(connections, requests, strict=True):
                feed(connection, request)
            # Passes of the loop until the writer has answered them all (an
            # Event would add its own cost to what is measured).
            while written < target:  # noqa: ASYNC110
                await asyncio.sleep(0)

        results = await measure(one_round, rounds, reps, conns)
        for connection in connections:
            connection.connection_lost(None)
        return results
    finally:
        await node.stop()


async def client_side(
    op: str, array: np.ndarray, conns: int, rounds: int, reps: int
) -> list[float]:
    loop = asyncio.get_running_loop()
    m, _, body = messages(op, array)
    reply = encoded(m.name, MessageType.REPLY, 1, body)  # its seqid is patched per call
    seqid_at = 4 + 8 + len(m.name)  # frame length, version and type, name length, name

    clients = []
    for _ in range(conns):
        # (not routed: its one connection replays one reply, to no topology call)
        client = ParameterClient(("127.0.0.1", 1), max_connections=1, route=False)
        connection = client_module._Connection(client.max_frame_bytes, client.traffic)

        mine = bytearray(reply)

        def answer(parts: list[Any], connection: Any = connection, data: bytearray = mine) -> None:
            # The call's seqid into this connection's copy of the reply, in
            # place: one call is in flight per connection, and feeding copies.
            data[seqid_at : seqid_at + 4] = memoryview(parts[0])[seqid_at : seqid_at + 4]
            loop.call_soon(feed, connection, data)

        connection.connection_made(CountingTransport(answer))
        client._connections.append(connection)
        clients.append(client)
    assert struct.unpack_from("!i", reply, seqid_at)[0] == 1

    async def one_call(client: ParameterClient) -> None:
        if op == "update":
            await client.update_parameters([to_parameter("p0", array)])
        else:
            await client.get_parameters(["p0"])

    async def one_round() -> None:
        await asyncio.gather(*(one_call(c) for c in clients))

    try:
        return await measure(one_round, rounds, reps, conns)
    finally:
        for client in clients:
            await client.close()


async def wire_side(
    side: str, op: str, array: np.ndarray, conns: int, rounds: int, reps: int
) -> list[float]:
    """The wire work of one call (see the module's docstring), ``conns`` calls a round."""
    m, make_args, body = messages(op, array)
    request = encoded(m.name, MessageType.CALL, 5, make_args())
    reply = encoded(m.name, MessageType.REPLY, 5, body)
    receiver = Receiver()

    def decode(data: bytes, cls: Any) -> tuple[str, int]:
        (frame,) = receiver.feed(data)
        name, _, seqid, reader = decode_header(frame.payload, frame.protocol)
        reader.read_body(cls)
        return name, seqid

    def node_call() -> None:
        name, seqid = decode(request, m.args)
        encode_message(name, MessageType.REPLY, seqid, body)

    def client_call() -> None:
        encode_message(m.name, MessageType.CALL, 5, make_args())
        decode(reply, m.result)

    one_call = node_call if side == "server-wire" else client_call

    async def one_round() -> None:
        for _ in range(conns):
            one_call()

    return await measure(one_round, rounds, reps, conns)


SIDES = ("server", "client", "server-wire", "client-wire")


async def run(args: argparse.Namespace) -> None:
    array = np.random.default_rng(0).random(max(1, args.bytes // 4), dtype=np.float32)
    path = "compiled" if has_extension() else "pure-Python"
    print(
        f"{args.bytes} bytes per parameter, {args.conns} connections, "
        f"{args.rounds} rounds x {args.reps} reps, the {path} path; "
        "CPU microseconds per call (best, median)"
    )
    for op in args.ops:
        for side in args.sides:
            if side == "server":
                results = await server_side(op, array, args.conns, args.rounds, args.reps)
            elif side == "client":
                results = await client_side(op, array, args.conns, args.rounds, args.reps)
            else:
                results = await wire_side(side, op, array, args.conns, args.rounds, args.reps)
            print(
                f"{op:6s} {side:11s} {min(results):8.1f} {statistics.median(results):8.1f}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=byte_size, default=4096, help="parameter size (default 4KiB)")
    p.add_argument("--conns", type=int, default=8, help="connections (default 8)")
    p.add_argument("--rounds", type=int, default=1000, help="rounds per repetition")
    p.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    p.add_argument("--ops", type=lambda s: s.split(","), default=["update", "get"])
    p.add_argument(
        "--sides",
        type=lambda s: s.split(","),
        default=["server", "client"],
        help=f"which of {','.join(SIDES)} (default: server,client)",
    )
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    p.add_argument(
        "--paths",
        type=lambda s: s.split(","),
        default=["compiled", "pure"],
        help="compiled, pure, or both (default: compiled,pure)",
    )
    args = p.parse_args(argv)
    if args.conns < 1 or args.rounds < 1 or args.reps < 1:
        p.error("--conns, --rounds and --reps must be at least 1")
    for op in args.ops:
        if op not in ("update", "get"):
            p.error(f"--ops: {op!r} is neither update nor get")
    for side in args.sides:
        if side not in SIDES:
            p.error(f"--sides: {side!r} is not one of {', '.join(SIDES)}")
    for path in args.paths:
        if path not in ("compiled", "pure"):
            p.error(f"--paths: {path!r} is neither compiled nor pure")
    again = list(sys.argv[1:] if argv is None else argv)
    if len(args.paths) > 1:  # each path in a process of its own, one after the other
        for path in args.paths:
            subprocess.run([sys.executable, __file__, *again, "--paths", path], check=True)
        return 0
    env = {
        **os.environ,
        **MALLOC_TUNED,
        "AIOPARAMSYNC_NO_EXT": "1" if args.paths == ["pure"] else "",
    }
    if any(os.environ.get(k, "") != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable, __file__, *again], env)
    if args.paths == ["compiled"] and not has_extension():
        p.error("the compiled path is not built (see hatch_build.py)")
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(run(args))
    else:
        asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
