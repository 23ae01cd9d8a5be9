"""A node: the store, the service and the server, started and stopped together."""

from __future__ import annotations

import asyncio
import logging

from .server import DEFAULT_IDLE_TIMEOUT, Server, ServerConfig
from .service import ParameterService
from .store import Limits, ParameterStore, ParameterTable
from .wire import DEFAULT_MAX_FRAME_BYTES

__all__ = ["Node"]

log = logging.getLogger(__name__)


class Node:
    """One aioparamsync node, in this process.

    Use it as an async context manager, or call :meth:`start` and
    :meth:`stop`::

        async with Node(port=0) as node:
            async with ParameterClient(node.address) as client:
                ...

    Args:
        host: the address to listen on (loopback by default).
        port: the port; 0 picks a free one (see :attr:`address`).
        node_id: a stable id for this node; by default ``host:port``.
        max_frame_bytes: the largest frame (message) accepted.
        idle_timeout: close connections silent this long (seconds; None: never).
        limits: what one request may hold.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9090,
        *,
        node_id: str | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        limits: Limits | None = None,
    ) -> None:
        self.config = ServerConfig(
            host=host, port=port, max_frame_bytes=max_frame_bytes, idle_timeout=idle_timeout
        )
        self.table = ParameterTable(node_id or "", limits)
        self.store = ParameterStore(self.table)
        self.service = ParameterService(self.store)
        self.server = Server(self.service, self.config)
        self.service.counters = self.server.counters
        self._writer: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        state = f"listening on {self.host}:{self.port}" if self._writer else "stopped"
        return f"<Node {self.node_id!r} {state}, {len(self.table)} parameters>"

    @property
    def node_id(self) -> str:
        return self.table.node_id

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the node listens on."""
        return self.server.address

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]

    async def start(self) -> None:
        """Start the store's writer and listen."""
        self._writer = asyncio.create_task(self.store.run(), name="aioparamsync-store-writer")
        try:
            await self.server.start()
        except BaseException:
            self.store.close()
            await self._writer
            raise
        if not self.table.node_id:
            self.table.node_id = "{}:{}".format(*self.address)
        log.info("node %s listening on %s:%d", self.node_id, *self.address)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting, finish the calls in flight (up to ``grace`` s), stop the writer."""
        await self.server.close(grace)
        self.store.close()
        if self._writer is not None:
            await self._writer
            self._writer = None

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
