"""A slow link on loopback: a TCP proxy that limits bandwidth and adds latency.

Used by the tests and benchmarks of ``encoding="auto"`` to put a throttled
link between workers and a node, on 127.0.0.1 only::

    async with Throttle(node.address, mbit=100, rtt_ms=5) as link:
        client = ParameterClient(link.address)

Each direction is a link of its own: bytes are serialized at ``mbit`` (one
after another, as a link does) and delivered ``rtt_ms / 2`` after they left,
so a round trip takes ``rtt_ms`` more than on loopback and a transfer of ``n``
bytes ``n / rate`` more. ``set(mbit=..., rtt_ms=...)`` changes the link while
it runs (for a link that becomes fast). Or from a shell::

    python benchmarks/throttle.py 127.0.0.1:9090 --listen 9091 --mbit 100 --rtt-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from typing import Any

CHUNK = 64 * 1024
QUEUED = 256  # chunks in flight per direction (16 MiB)


class Throttle:
    """A proxy to ``target`` on 127.0.0.1 at ``mbit`` Mbit/s each way, ``rtt_ms`` added."""

    def __init__(
        self, target: tuple[str, int] | str, *, mbit: float, rtt_ms: float, port: int = 0
    ) -> None:
        if isinstance(target, str):
            host, _, p = target.rpartition(":")
            target = (host, int(p))
        self.target = target
        self.port = port
        self.set(mbit=mbit, rtt_ms=rtt_ms)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.address = ""
        self.bytes = 0  # moved, both ways

    def set(self, *, mbit: float, rtt_ms: float) -> None:
        """Change the link: ``mbit`` Mbit/s each way (0: unlimited), ``rtt_ms`` added."""
        if mbit < 0 or rtt_ms < 0:
            raise ValueError(f"mbit and rtt_ms are >= 0, not {mbit}, {rtt_ms}")
        self.rate = mbit * 1e6 / 8 if mbit else 0.0  # bytes per second
        self.delay = rtt_ms / 2000.0  # seconds, one way

    async def __aenter__(self) -> Throttle:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._direction(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _direction(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUED)
        free = 0.0  # when the link has sent what it holds

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await src.read(CHUNK):
                now = time.monotonic()
                sent = max(now, free) + (len(data) / self.rate if self.rate else 0.0)
                free = sent
                self.bytes += len(data)
                await queue.put((sent + self.delay, data))
            await queue.put(None)
            await sender
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
            dst.close()


async def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="HOST:PORT to forward to (loopback)")
    parser.add_argument("--listen", type=int, default=0, help="port on 127.0.0.1 (0: any)")
    parser.add_argument("--mbit", type=float, default=100.0)
    parser.add_argument("--rtt-ms", type=float, default=5.0)
    args = parser.parse_args()
    async with Throttle(args.target, mbit=args.mbit, rtt_ms=args.rtt_ms, port=args.listen) as t:
        print(f"{t.address} -> {args.target} at {args.mbit} Mbit/s, +{args.rtt_ms} ms", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main())
