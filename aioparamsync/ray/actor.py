"""One node of a :class:`~aioparamsync.ray.RayCluster`: the Ray actor that runs it.

See :mod:`aioparamsync.ray` for how the nodes find each other and restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray  # type: ignore[import-not-found, unused-ignore]  # (aioparamsync.ray checked it is there)

from ..placement import UP

if TYPE_CHECKING:
    from ..node import Node

__all__ = ["NodeActor", "POLL_INTERVAL", "RemoteNode", "actor_name", "address_of"]

log = logging.getLogger(__name__)

# How long a node that stops finishes its calls and sends its outboxes (seconds).
STOP_GRACE = 5.0
# How long a starting node asks a sibling after it, which may be dead or
# restarting, whether it is up (seconds).
ASK_TIMEOUT = 5.0
POLL_INTERVAL = 0.05


def address_of(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def actor_name(name: str, index: int) -> str:
    return f"{name}-node-{index}"


class NodeActor:
    """One node of a :class:`RayCluster`, as a Ray async actor.

    Made by :func:`start_cluster` (not by hand): Ray runs the constructor in
    the actor's event loop, at its creation and at each restart, and the
    constructor starts the node there, in the background, so that a
    restarted actor rejoins without being told to. Its methods answer once
    the node is up.

    Args:
        index: the node's place among its siblings (0 to ``size - 1``).
        size: how many siblings there are.
        name: the cluster's name: the actors are ``{name}-node-{i}``.
        namespace: the Ray namespace of the actors.
        port: the port to listen on (0: one the OS picks).
        data_dir: the directory of the cluster on each Ray node (this node's
            is ``data_dir/node-{index}``); None: in memory.
        replication_factor: as :class:`aioparamsync.Node`'s.
        node_options: more arguments of :class:`aioparamsync.Node`.
        join_timeout: how long to wait for the siblings before this one.
    """

    def __init__(
        self,
        index: int,
        size: int,
        name: str,
        namespace: str,
        port: int,
        data_dir: str | None,
        replication_factor: int | None,
        node_options: Mapping[str, Any],
        join_timeout: float,
    ) -> None:
        self.index = index
        self.size = size
        self.name = name
        self.namespace = namespace
        self.port = port
        self.data_dir = os.path.join(data_dir, f"node-{index}") if data_dir else None
        self.replication_factor = replication_factor
        self.node_options = dict(node_options)
        self.join_timeout = join_timeout
        self.node: Node | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._stopping: asyncio.Future[None] | None = None
        # Ray runs an async actor's constructor in its event loop: the node starts
        # now, by itself (else at the first call).
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._starting: asyncio.Task[Node] | None = None
        else:
            self._starting = loop.create_task(self._start(), name="aioparamsync-ray-start")

    @property
    def node_id(self) -> str:
        return actor_name(self.name, self.index)

    async def _ready(self) -> Node:
        if self._starting is None:
            self._starting = asyncio.create_task(self._start(), name="aioparamsync-ray-start")
        node = await asyncio.shield(self._starting)
        if self._stopping is not None:
            raise RuntimeError(f"node {self.node_id} was stopped")
        return node

    async def _start(self) -> Node:
        from ..node import Node

        peers = await self._siblings()
        host = ray.util.get_node_ip_address()
        node = Node(
            host,
            self.port,
            node_id=self.node_id,
            peers=peers,
            data_dir=self.data_dir,
            replication_factor=self.replication_factor,
            **self.node_options,
        )
        try:
            await node.start()
        except Exception:
            log.exception("node %s could not start", self.node_id)
            raise
        self.node = node
        self._watcher = asyncio.create_task(self._watch(node), name="aioparamsync-ray-watch")
        log.info(
            "node %s up at %s, joining %s",
            self.node_id,
            address_of(*node.address),
            ", ".join(peers) or "no one",
        )
        return node

    async def _siblings(self) -> list[str]:
        """The addresses of the siblings to join: those before this one (waited
        for), and those after it that are up already."""
        others = [j for j in range(self.size) if j != self.index]
        found = await asyncio.gather(*(self._ask(j, wait=j < self.index) for j in others))
        return [address for address in found if address is not None]

    async def _ask(self, index: int, *, wait: bool) -> str | None:
        name = actor_name(self.name, index)
        try:
            sibling = await asyncio.to_thread(ray.get_actor, name, namespace=self.namespace)
        except ValueError:
            return None  # no such actor (any more)
        call: Any = sibling.address if wait else sibling.current_address
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(call.remote().future()),
                self.join_timeout if wait else ASK_TIMEOUT,
            )
        except (TimeoutError, ray.exceptions.RayError) as exc:
            # (one before this one should answer; one after may not be there yet)
            log.log(
                logging.WARNING if wait else logging.DEBUG,
                "node %s: no address from %s (%s); starting without it",
                self.node_id,
                name,
                type(exc).__name__,
            )
            return None

    async def _watch(self, node: Node) -> None:
        """Stop the node when it is told to drain or to shut down (by a client)."""
        waits = [
            asyncio.ensure_future(node.left.wait()),
            asyncio.ensure_future(node.shutting_down.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        log.info("node %s was told to stop: stopping", self.node_id)
        await asyncio.shield(self._stop())

    def _stop(self) -> asyncio.Future[None]:
        """Stop the node, once (callers share the one stop)."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop_node())
        return self._stopping

    async def _stop_node(self) -> None:
        watcher = self._watcher
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            await asyncio.wait({self._starting})
        if self.node is not None:
            await self.node.stop(STOP_GRACE, leave=False)

    # -- what the driver calls ------------------------------------------------------

    async def address(self) -> str:
        """``host:port`` of the node, once it is up.

        Raises:
            Exception: why it could not start (the node's error).
        """
        node = await self._ready()
        return address_of(*node.address)

    async def current_address(self) -> str | None:
        """``host:port`` of the node if it is up now, else None (no waiting)."""
        node = self.node
        if node is None or self._stopping is not None:
            return None
        return address_of(*node.address)

    async def describe(self) -> dict[str, Any]:
        """What the node is: its id, address, state, Ray node, process (``pid``: a restart
        makes a new one), directory, and how many parameters it holds."""
        node = await self._ready()
        return {
            "index": self.index,
            "node_id": node.node_id,
            "address": address_of(*node.address),
            "state": node.cluster.state,
            "ready": node.readiness()[0],
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "data_dir": self.data_dir,
            "parameters": len(node.table),
        }

    async def wait_meshed(self, node_ids: Sequence[str], timeout: float) -> None:
        """Wait until this node is ready (joined and caught up) and sees every one of
        ``node_ids`` up.

        Raises:
            TimeoutError: not so within ``timeout`` seconds (the message says what lacks).
        """
        node = await self._ready()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            ready, why = node.readiness()
            members = node.cluster.topology().members
            up = {m.node_id for m in members if m.state == UP}
            missing = [i for i in node_ids if i not in up]
            if ready and not missing:
                return
            if loop.time() >= deadline:
                seen = ", ".join(f"{m.node_id} {m.state}" for m in members)
                raise TimeoutError(
                    f"node {self.node_id} not meshed within {timeout} s: "
                    + (f"not ready ({why}); " if not ready else "")
                    + (f"does not see {', '.join(missing)} up; " if missing else "")
                    + f"it sees {seen}"
                )
            await asyncio.sleep(POLL_INTERVAL)

    async def stop(self, snapshot: bool = False) -> None:
        """Stop the node, handing nothing off (the whole cluster stops).

        With ``snapshot`` and a data directory, the node first takes no more
        writes and writes its final snapshot (else it writes it as it stops).
        """
        node = self.node
        if snapshot and node is not None and self._stopping is None:
            await node.shutdown(cluster=False, snapshot=True)
        await asyncio.shield(self._stop())


#: the actor class Ray runs (``RemoteNode.options(...).remote(...)``)
RemoteNode: Any = ray.remote(NodeActor)
