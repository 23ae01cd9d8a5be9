"""A cluster of nodes as Ray actors, spread over a Ray cluster; workers use the ordinary client.

Needs ``pip install '.[ray]'`` (in the checkout); ``import aioparamsync`` never
imports ray. ::

    import ray
    import aioparamsync.ray

    ray.init()
    with aioparamsync.ray.start_cluster() as cluster:  # one node per Ray node

        @ray.remote
        def train(addresses: list[str]) -> None:
            async def run() -> None:
                async with aioparamsync.ParameterClient(addresses) as client:
                    ...  # get_arrays, push_gradients, as anywhere

            asyncio.run(run())

        ray.get([train.remote(cluster.addresses) for _ in range(4)])

(or pass ``runtime_env={"env_vars": cluster.addresses_env()}`` to the tasks and
use ``ParameterClient.from_env()`` there).

Theory of operation. :func:`start_cluster` reserves a placement group of one
bundle per node with the ``SPREAD`` strategy (Ray puts the bundles on
different Ray nodes where it can), and starts in each bundle an async actor
(named ``{name}-node-{i}``, in the namespace ``name``) that runs an
:class:`aioparamsync.Node` in the actor's own event loop, listening on the
address Ray knows the Ray node it runs on by (its ``NodeManagerAddress``; in a
Ray instance pinned to ``127.0.0.1``, loopback) and a port the OS picks. The
node's id is its actor's name, stable across restarts. The nodes start one
after the other, each with the addresses of those already up as its peers,
and :func:`start_cluster` answers once every node sees the others up.

Restarts. The actors have ``max_restarts=-1``: Ray starts a dead one again
(on the same bundle). A restarted actor starts its node at its next call
(:meth:`RayCluster.refresh` makes one), and finds the cluster by itself: it
asks its live siblings for their addresses (a sibling answers where it is,
without starting anything, so two restarting at once do not wait on each
other), joins them under its old id at its new address (its peers' links
follow it), and pulls what it holds, as any node that joins does. With
``data_dir``, a node keeps its log and snapshots in ``data_dir/node-{i}`` on
its Ray node's disk and recovers from them when it comes back on the same
machine; elsewhere it starts empty and catches up from its replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from typing import Any

try:
    import ray  # type: ignore[import-not-found, unused-ignore]
    from ray.util.placement_group import (  # type: ignore[import-not-found, unused-ignore]
        placement_group,
        remove_placement_group,
    )
    from ray.util.scheduling_strategies import (  # type: ignore[import-not-found, unused-ignore]
        PlacementGroupSchedulingStrategy,
    )
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "aioparamsync.ray needs Ray: pip install '.[ray]' (in the checkout)", name="ray"
    ) from exc

from .client.api import ParameterClient
from .node import Node

__all__ = ["RayCluster", "start_cluster"]

# How long start_cluster waits for the placement group, the nodes and the mesh (seconds).
START_TIMEOUT = 120.0


def _ray_node_address() -> str:
    """The address Ray knows the Ray node this runs on by (its ``NodeManagerAddress``: with
    ``ray start --node-ip-address`` or ``ray.init(_node_ip_address=...)``, the one given)."""
    me = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == me:
            return str(node["NodeManagerAddress"])
    return str(ray.util.get_node_ip_address())


class _NodeActor:
    """One node in a Ray actor (see the module). Its node starts at its first call."""

    def __init__(self, name: str, index: int, count: int, options: Mapping[str, Any]) -> None:
        self.name, self.index, self.count = name, index, count
        self.options = dict(options)
        self.node: Node | None = None
        self._starting: asyncio.Future[Node] | None = None

    def _actor_name(self, index: int) -> str:
        return f"{self.name}-node-{index}"

    async def _node(self) -> Node:
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> Node:
        host = _ray_node_address()
        options = dict(self.options)
        data_dir = options.pop("data_dir", None)
        if data_dir is not None:
            data_dir = os.path.join(data_dir, f"node-{self.index}")
        node = Node(
            host,
            options.pop("port", 0),
            node_id=self._actor_name(self.index),
            peers=await self._siblings(),
            data_dir=data_dir,
            **options,
        )
        await node.start()
        self.node = node
        return node

    async def _siblings(self) -> list[tuple[str, int]]:
        """Where the other nodes are, as they answer now (none started: none)."""
        found: list[tuple[str, int]] = []
        for i in range(self.count):
            if i == self.index:
                continue
            try:
                sibling = ray.get_actor(self._actor_name(i), namespace=self.name)
                address: Any = await asyncio.wait_for(sibling.where.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - (not made yet, dead, restarting: not a peer now)
                continue
            if address is not None:
                found.append((str(address[0]), int(address[1])))
        return found

    async def where(self) -> tuple[str, int] | None:
        """This node's address if it runs, else None (it starts nothing)."""
        node = self.node
        return node.address if node is not None else None

    async def address(self) -> str:
        """This node's ``host:port``, starting it first if it does not run."""
        host, port = (await self._node()).address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def peers_up(self) -> int:
        """How many of its peers this node sees up."""
        node = await self._node()
        return sum(1 for link in node.cluster.links.values() if link.state == "up")

    async def stop(self, snapshot: bool) -> None:
        """Stop the node (every node of the cluster stops: nothing is handed off)."""
        node = self.node
        if node is None:
            return
        if snapshot:
            await node.shutdown(cluster=False, snapshot=True)
        await node.stop(leave=False)
        self.node = None


class RayCluster:
    """The nodes :func:`start_cluster` started: their addresses, a client, and the end."""

    def __init__(self, name: str, actors: list[Any], group: Any) -> None:
        self.name = name
        self.actors = actors
        self.placement_group = group
        #: each node's ``host:port``, as last asked (see :meth:`refresh`)
        self.addresses: list[str] = []

    def __repr__(self) -> str:
        return f"<RayCluster {self.name!r} {len(self.actors)} nodes: {', '.join(self.addresses)}>"

    def refresh(self, timeout: float = START_TIMEOUT) -> list[str]:
        """Ask every node where it is (a node restarted by Ray starts then): the addresses."""
        self.addresses = ray.get([a.address.remote() for a in self.actors], timeout=timeout)
        return self.addresses

    def addresses_env(self) -> dict[str, str]:
        """``{"AIOPARAMSYNC_ADDRESSES": ...}``, for workers' ``runtime_env`` env_vars."""
        return {"AIOPARAMSYNC_ADDRESSES": ",".join(self.addresses)}

    def client(self, **kwargs: Any) -> ParameterClient:
        """A client of the nodes (any one live node will do: it learns the others)."""
        return ParameterClient(self.addresses, **kwargs)

    def wait_meshed(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until every node sees every other up.

        Raises:
            TimeoutError: not so within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        want = len(self.actors) - 1
        while True:
            ups = ray.get([a.peers_up.remote() for a in self.actors], timeout=timeout)
            if all(n >= want for n in ups):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the nodes see {ups} peers up, not {want} each")
            time.sleep(0.1)

    def shutdown(self, snapshot: bool = False) -> None:
        """Stop every node (after a final snapshot, with ``snapshot``), then remove the
        actors and the placement group."""
        try:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get([a.stop.remote(snapshot) for a in self.actors], timeout=START_TIMEOUT)
        finally:
            for actor in self.actors:
                with contextlib.suppress(ray.exceptions.RayError, ValueError):
                    ray.kill(actor, no_restart=True)
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                remove_placement_group(self.placement_group)
            self.actors = []

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def start_cluster(
    num_nodes: int | None = None,
    *,
    name: str = "aioparamsync",
    num_cpus: float = 1,
    data_dir: str | None = None,
    port: int = 0,
    timeout: float = START_TIMEOUT,
    **node_options: Any,
) -> RayCluster:
    """Start ``num_nodes`` nodes as Ray actors spread over the Ray cluster (see the module).

    Args:
        num_nodes: how many (default: one per alive Ray node).
        name: the actors' prefix and namespace (two clusters need two names).
        num_cpus: the CPUs each node's bundle reserves (fractions are fine).
        data_dir: where each node keeps its data on its Ray node (``data_dir/node-{i}``);
            None: in memory.
        port: each node's port (0: one the OS picks; a fixed one needs one node per
            Ray node).
        timeout: the longest to wait for the placement group, the nodes and the mesh.
        node_options: more arguments of :class:`aioparamsync.Node`
            (``replication_factor``, ``acks``, ``failure_timeout``...).

    Raises:
        ValueError: a number out of range; TimeoutError: the cluster did not form in time.
    """
    if num_nodes is None:
        num_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a whole number of at least 1, not {num_nodes!r}")
    if not num_cpus >= 0:
        raise ValueError(f"num_cpus must not be negative, not {num_cpus!r}")
    group = placement_group([{"CPU": num_cpus}] * num_nodes, strategy="SPREAD")
    actors: list[Any] = []
    cluster = RayCluster(name, actors, group)
    try:
        ray.get(group.ready(), timeout=timeout)
        remote: Any = ray.remote(_NodeActor)
        options = {**node_options, "data_dir": data_dir, "port": port}
        for i in range(num_nodes):
            actor: Any = remote.options(
                name=f"{name}-node-{i}",
                namespace=name,
                num_cpus=num_cpus,
                max_restarts=-1,
                max_concurrency=1000,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i
                ),
            ).remote(name, i, num_nodes, options)
            actors.append(actor)
            ray.get(actor.address.remote(), timeout=timeout)  # (each joins those before it)
        cluster.refresh(timeout)
        cluster.wait_meshed(timeout)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
