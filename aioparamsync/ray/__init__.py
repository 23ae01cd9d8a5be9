"""Ray: a cluster of nodes run as Ray actors, one per Ray node, for Ray workers.

Import it yourself (``import aioparamsync.ray``); ``import aioparamsync``
never imports ray. Needs ``pip install 'aioparamsync[ray]'`` on the driver
and on every Ray node (the actors import aioparamsync there).

::

    import asyncio

    import numpy as np
    import ray

    import aioparamsync
    import aioparamsync.ray


    @ray.remote
    def train(addresses, rank):
        async def run():
            async with aioparamsync.ParameterClient(addresses) as client:
                for step in range(100):
                    arrays = await client.get_arrays(["w"])
                    grad = compute_gradient(arrays["w"], rank, step)  # your model's
                    await client.push_gradients({"w": grad})

        asyncio.run(run())


    ray.init()
    with aioparamsync.ray.start_cluster(replication_factor=2) as cluster:

        async def setup():
            async with cluster.client() as client:
                w = np.zeros(1000, np.float32)
                await client.update_arrays({"w": w}, rules={"w": aioparamsync.sgd(0.1)})

        asyncio.run(setup())
        ray.get([train.remote(cluster.addresses, rank) for rank in range(8)])
        # or: train.options(runtime_env={"env_vars": cluster.addresses_env()}), and in
        # the worker aioparamsync.ParameterClient.from_env()

Workers are ordinary Ray tasks or actors with the ordinary client: nothing
here runs in them. A worker is given the nodes' addresses (any one live node
will do: the client learns the others from it).

Theory of operation. :func:`start_cluster` reserves one bundle of
``num_cpus`` CPUs per node in a placement group of strategy SPREAD, which
puts the bundles on distinct Ray nodes as far as there are some (with more
nodes than Ray nodes, some Ray nodes hold several). Each node is an async
actor named ``{name}-node-{i}`` (in the namespace ``name`` unless told), whose
event loop runs one :class:`aioparamsync.Node`. It listens on the address of
the Ray node it runs on (``ray.util.get_node_ip_address()``), on a port the
OS picks unless ``port`` is given, and its node id is its actor's name, so
it keeps its identity, and the keys placement gives it, across restarts.

An actor finds its cluster by itself, from its constructor, which Ray runs
again when it restarts the actor (``max_restarts``): it asks its siblings,
by name, for their addresses and starts with those as its peers. It waits
for the siblings before it (``{name}-node-0`` to ``-{i-1}``), and takes those
after it only if they are up already. So at the first start node 0 starts
alone and node ``i`` joins nodes 0 to ``i-1``, and a restarted node joins
whoever is up. A node waits only for nodes before it, so no two wait for each
other, and when every node restarts at once they form one cluster again
(node 0 alone, the others joining it); a node that finds no one starts alone.
A node restarted on the same Ray node, with ``data_dir``, recovers from its
snapshot and log (``data_dir/node-{i}`` on that Ray node's disk); restarted
on another Ray node, or in memory, it starts empty. Either way it joins as
any joining node does: it pulls what it holds from its replicas
(anti-entropy) before it takes writes as a primary. Its address changes
with its port; :meth:`RayCluster.refresh` asks again. Ray restarts an actor
without end by default (``max_restarts=-1``): a parameter server is to
outlive the workers' faults; a bounded number leaves a node that died that
many times dead, and the cluster goes on without it (its keys re-replicated
past the failure timeout).

The cluster lives with the job that started it (the placement group and
the actors fate-share with their creator) unless shut down before, by
:meth:`RayCluster.shutdown` (every node stops, none handing off,
then the actors and the placement group are removed). A node that is told
to drain or to shut down (``aioparamsync-ctl drain``,
``client.shutdown_cluster()``) stops as ``aioparamsync-node`` would, and its
actor stays, holding no node, until the cluster is shut down.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..placement import DEFAULT_REPLICATION_FACTOR

MISSING = (
    "aioparamsync.ray needs Ray: pip install 'aioparamsync[ray]' "
    "(in the aioparamsync checkout: pip install '.[ray]')"
)

try:
    import ray  # type: ignore[import-not-found, unused-ignore]  # Ray (imports are absolute)
    from ray.util.scheduling_strategies import (  # type: ignore[import-not-found, unused-ignore]
        PlacementGroupSchedulingStrategy,
    )
except ImportError as exc:
    raise ImportError(MISSING, name="ray") from exc

# (after the check: the actor's module needs Ray too)
from .actor import POLL_INTERVAL, NodeActor, RemoteNode, actor_name  # noqa: E402

if TYPE_CHECKING:
    from ..client.api import ParameterClient

__all__ = [
    "ADDRESSES_VARIABLE",
    "MISSING",
    "NodeActor",
    "RayCluster",
    "RESERVED_OPTIONS",
    "start_cluster",
]

log = logging.getLogger(__name__)

#: the variable :meth:`ParameterClient.from_env` reads the nodes' addresses from
ADDRESSES_VARIABLE = "AIOPARAMSYNC_ADDRESSES"
#: the Node arguments :func:`start_cluster` sets itself (not in ``node_options``)
RESERVED_OPTIONS = frozenset(
    {"host", "port", "node_id", "peers", "advertise", "data_dir", "replication_factor"}
)
# Contexts do not pickle, so they cannot travel to the actors; peers_dns would
# compete with the actors' own discovery.
UNSUPPORTED_OPTIONS = frozenset({"ssl", "peer_ssl", "peers_dns", "resolve"})


class RayCluster:
    """Nodes running as Ray actors (see the module); made by :func:`start_cluster`.

    Use it as a context manager, or call :meth:`shutdown`.

    Attributes:
        name, namespace: the actors are ``{name}-node-{i}`` in that namespace.
        actors: the actors' handles, in order.
        placement_group: the placement group that holds their bundles.
        addresses: ``host:port`` of every node, as of the start or the last
            :meth:`refresh` (a restarted node listens on a new port).
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        actors: Sequence[Any],
        placement_group: Any,
    ) -> None:
        self.name = name
        self.namespace = namespace
        self.actors = list(actors)
        self.placement_group = placement_group
        self.addresses: list[str] = []
        self._closed = False

    def __repr__(self) -> str:
        state = "shut down" if self._closed else ", ".join(self.addresses)
        return f"<RayCluster {self.name!r}: {len(self.actors)} nodes, {state}>"

    @property
    def node_ids(self) -> list[str]:
        """Each node's id (its actor's name)."""
        return [actor_name(self.name, i) for i in range(len(self.actors))]

    def _call(
        self, method: str, *args: Any, timeout: float, what: str, retry: bool = True
    ) -> list[Any]:
        """Call ``method`` on every actor; every answer, in order.

        A call that fails because its actor died is made again (with
        ``retry``) while Ray still has that actor: it is restarting, and
        answers once it is back.

        Raises:
            TimeoutError: a node did not answer within ``timeout`` seconds (named).
            RayActorError: an actor is gone for good (or died, without ``retry``).
        """
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        calls = {i: getattr(a, method).remote(*args) for i, a in enumerate(self.actors)}
        while calls:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=max(left, 0))
            if not ready:
                late = ", ".join(self.node_ids[i] for i in calls)
                raise TimeoutError(f"{what}: no answer within {timeout} s from {late}")
            for i, ref in list(calls.items()):
                if ref not in ready:
                    continue
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    if not retry or not _exists(self.node_ids[i], self.namespace):
                        raise
                    time.sleep(POLL_INTERVAL)  # (restarting: ask again)
                    calls[i] = getattr(self.actors[i], method).remote(*args)
                else:
                    del calls[i]
        return [results[i] for i in range(len(self.actors))]

    def refresh(self, timeout: float = 60.0) -> list[str]:
        """Ask every node for its address again; a restarting one answers once it is up
        (on a new port, unless ``port`` was given).

        A node killed a moment ago may still answer as it was: Ray's kill
        takes effect shortly after it returns.

        Returns:
            The addresses, also in :attr:`addresses`.

        Raises:
            TimeoutError: a node did not answer within ``timeout`` seconds.
        """
        self.addresses = self._call("address", timeout=timeout, what="addresses")
        return list(self.addresses)

    def wait_meshed(self, timeout: float = 60.0) -> None:
        """Wait until every node is ready (joined, caught up) and sees every other one up.

        Raises:
            TimeoutError: not so within ``timeout`` seconds (the message says what lacks).
        """
        self._call("wait_meshed", self.node_ids, timeout, timeout=timeout + 10.0, what="meshing")

    def nodes(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """What each node is (see :meth:`NodeActor.describe`)."""
        return self._call("describe", timeout=timeout, what="describe")

    def client(self, **kwargs: Any) -> ParameterClient:
        """A :class:`aioparamsync.ParameterClient` of every node (``kwargs``: its own).

        Use it in an event loop (``async with cluster.client() as client``).
        """
        from ..client.api import ParameterClient

        return ParameterClient(self.addresses, **kwargs)

    def addresses_env(self) -> dict[str, str]:
        """The environment a worker's client reads the nodes from
        (:meth:`ParameterClient.from_env`): for ``runtime_env={"env_vars": ...}``."""
        return {ADDRESSES_VARIABLE: ",".join(self.addresses)}

    def shutdown(self, snapshot: bool = False, timeout: float = 60.0) -> None:
        """Stop every node, then remove the actors and the placement group.

        Each node stops gracefully, handing nothing off (they all stop): what
        it acknowledged is applied, and, with a data directory, in its final
        snapshot. With ``snapshot``, each node with a data directory first
        takes no more writes and writes that snapshot. A node that does not
        answer within ``timeout`` seconds is killed all the same. Answers
        once the actors are gone and the placement group is removed, so that
        the name can be used again. Shutting down twice does nothing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._call("stop", snapshot, timeout=timeout, what="stop", retry=False)
        except Exception as exc:  # noqa: BLE001 (what failed is logged; the rest goes on)
            log.warning("cluster %s: not every node stopped gracefully: %s", self.name, exc)
        _remove(self.actors, self.placement_group, self.name, self.namespace, timeout)

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _remove(
    actors: Iterable[Any], placement_group: Any, name: str, namespace: str, timeout: float
) -> None:
    """Kill the actors (no restart) and remove the placement group; wait until both are gone."""
    actors = list(actors)
    for actor in actors:
        with contextlib.suppress(Exception):  # (already dead)
            ray.kill(actor, no_restart=True)
    ray.util.remove_placement_group(placement_group)
    deadline = time.monotonic() + timeout
    names = [actor_name(name, i) for i in range(len(actors))]
    while True:
        alive = [n for n in names if _exists(n, namespace)]
        state = ray.util.placement_group_table(placement_group).get("state")
        if not alive and state in ("REMOVED", None):
            return
        if time.monotonic() >= deadline:
            log.warning(
                "cluster %s: after %s s, actors %s remain and the placement group is %s",
                name,
                timeout,
                ", ".join(alive) or "none",
                state,
            )
            return
        time.sleep(POLL_INTERVAL)


def _exists(actor_name: str, namespace: str) -> bool:
    try:
        ray.get_actor(actor_name, namespace=namespace)
    except ValueError:
        return False
    return True


def _check_count(value: Any, what: str, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be an integer of at least {least}, not {value!r}")
    return value


def _ray_nodes(num_cpus: float, resources: Mapping[str, float]) -> int:
    """How many alive Ray nodes could hold a node's bundle (by their total resources)."""
    wanted = {"CPU": num_cpus, **resources}
    return sum(
        1
        for n in ray.nodes()
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v for k, v in wanted.items())
    )


def start_cluster(
    num_nodes: int | None = None,
    *,
    replication_factor: int | None = DEFAULT_REPLICATION_FACTOR,
    port: int = 0,
    data_dir: str | os.PathLike[str] | None = None,
    num_cpus: float = 1,
    resources: Mapping[str, float] | None = None,
    node_options: Mapping[str, Any] | None = None,
    name: str = "aioparamsync",
    namespace: str | None = None,
    max_restarts: int = -1,
    timeout: float = 120.0,
) -> RayCluster:
    """Start nodes as Ray actors, one per Ray node by default, and wait until they are meshed.

    Connects to Ray (``ray.init()``) if the process has not yet. Answers once
    every node is up, has joined and sees every other one up.

    Args:
        num_nodes: how many nodes (None: one per alive Ray node that has the
            resources of one). SPREAD puts them on distinct Ray nodes as far
            as there are some; more go where there is room.
        replication_factor: how many nodes hold each key (None: every node).
        port: the port every node listens on (0: one the OS picks for each).
            A fixed port takes one node per Ray node: two on one Ray node
            would collide (the second fails to start).
        data_dir: an absolute path on every Ray node's disk (each node keeps
            its log and snapshots in ``data_dir/node-{i}``); None: in memory.
        num_cpus: the CPUs reserved for each node (above 0; fractions too).
        resources: more resources reserved for each node (Ray's custom ones).
        node_options: more arguments of :class:`aioparamsync.Node`
            (``repair_interval``, ``fsync``, ``metrics_port``...), which must
            pickle; not those set here (:data:`RESERVED_OPTIONS`), nor TLS
            contexts.
        name: the cluster's name: the actors are ``{name}-node-{i}``, which is
            also each node's id. Unique in its namespace while it runs.
        namespace: the Ray namespace of the actors (None: ``name``), where
            ``ray.get_actor`` finds them from any job.
        max_restarts: how many times Ray restarts a node's actor that died
            (-1: always; 0: never). A restarted node rejoins by itself.
        timeout: seconds for the placement group, the nodes' start and the mesh.

    Returns:
        The cluster, its :attr:`~RayCluster.addresses` known.

    Raises:
        ValueError: an argument out of its range (the message says which).
        TimeoutError: the bundles could not be placed (not enough resources),
            or the nodes did not start or mesh, within ``timeout`` (what was
            started is removed).
    """
    if num_nodes is not None:
        _check_count(num_nodes, "num_nodes", least=1)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise ValueError(f"port must be 0 (any free port) or a port number, not {port!r}")
    if (
        isinstance(num_cpus, bool)
        or not isinstance(num_cpus, int | float)
        or not (num_cpus > 0 and math.isfinite(num_cpus))
    ):
        raise ValueError(f"num_cpus must be a number above 0, not {num_cpus!r}")
    if replication_factor is not None:
        _check_count(replication_factor, "replication_factor", least=1)
    _check_count(max_restarts, "max_restarts", least=-1)
    if not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds above 0, not {timeout!r}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, not {name!r}")
    options = dict(node_options or {})
    for bad, why in (
        (RESERVED_OPTIONS, "set by start_cluster"),
        (UNSUPPORTED_OPTIONS, "not supported"),
    ):
        clash = sorted(bad & set(options))
        if clash:
            raise ValueError(f"node_options {', '.join(clash)}: {why} (see its arguments)")
    extra = dict(resources or {})
    directory = os.fspath(data_dir) if data_dir is not None else None
    if directory is not None and not os.path.isabs(directory):
        # (the actors' working directory is not the driver's, nor on its machine)
        raise ValueError(f"data_dir must be an absolute path on the Ray nodes, not {directory!r}")

    if not ray.is_initialized():
        ray.init()
    if num_nodes is None:
        num_nodes = _ray_nodes(float(num_cpus), extra)
        if num_nodes == 0:
            raise ValueError(
                f"no alive Ray node has {num_cpus} CPUs{' and ' + str(extra) if extra else ''} "
                "for a node: lower num_cpus or give num_nodes"
            )
    namespace = namespace or name
    deadline = time.monotonic() + timeout

    bundle = {"CPU": float(num_cpus), **extra}
    group = ray.util.placement_group(
        [dict(bundle) for _ in range(num_nodes)], strategy="SPREAD", name=f"{name}-nodes"
    )
    actors: list[Any] = []
    try:
        if not group.wait(timeout_seconds=timeout):
            raise TimeoutError(
                f"could not place {num_nodes} bundles of {bundle} within {timeout} s: the Ray "
                f"cluster has {ray.available_resources()} available"
            )
        for i in range(num_nodes):
            actor = RemoteNode.options(
                name=actor_name(name, i),
                namespace=namespace,
                max_restarts=max_restarts,
                num_cpus=float(num_cpus),
                resources=extra or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i
                ),
            ).remote(
                i,
                num_nodes,
                name,
                namespace,
                port,
                directory,
                replication_factor,
                options,
                timeout,
            )
            actors.append(actor)
        cluster = RayCluster(name, namespace, actors, group)
        cluster.refresh(max(deadline - time.monotonic(), 1.0))
        cluster.wait_meshed(max(deadline - time.monotonic(), 1.0))
    except BaseException:
        _remove(actors, group, name, namespace, 30.0)
        raise
    log.info("cluster %s up: %s", name, ", ".join(cluster.addresses))
    return cluster
