"""Routing on the client: each part of a call sent straight to the node that holds it.

Theory of operation. A client learns the cluster's topology (the IDL's
``topology()``: epoch, members and their states, replication factor) from
its node at its first call, and computes placement from it with the very
function the nodes use (:mod:`aioparamsync.placement`). A call naming
parameters (a read, an update, a gradient push) is cut by the node each name
goes to, each part sent with the topology's epoch on its own pool of
connections to that node, concurrently, and the answers merged. A write goes
to each name's primary; a barrier to the primary of its group's key.

Where reads go (``read_from``). ``"primary"``: each name's primary, which has
every write acknowledged. ``"any"``: one live replica of each name, the same
for a name as long as the topology holds (so the pieces of a large parameter
come from one node), so reads spread over the replicas and R = 2 adds read
bandwidth. A replica may lag its primary by a replication message, but never
behind this client's own reads and writes: the client remembers the newest
version of each name it wrote or read, and a name a replica answers older
than that (or leaves out) is read again from its primary. So a client reads
its own writes, and never goes back in time. ``"auto"`` (the default) is
``"any"`` where the cluster answers writes once every live replica holds them
(``--acks all``, which the topology says): then a replica has every write
acknowledged, by anyone, as the primary does (a barrier's "everyone pushed"
holds there too); with ``--acks 1``, ``"primary"``.

When the topology is stale: a node answers ``MOVED`` for what it does not
hold (with its epoch); the client asks that node for the topology and sends
the part again, and after ``MAX_MOVES`` such answers sends it without an
epoch to its first node, which passes it on (every node answers every name).
A node that cannot be reached is taken as down (its keys go to their next
replica) and the topology is asked for again; a part that may have reached
it (its connection broke in flight) is sent again only if the method is
idempotent. The topology is also asked for again every ``REFRESH_SECONDS``,
or every ``CHANGING_REFRESH_SECONDS`` while a member is joining, leaving or
down: a node still answers, from what it holds or by passing on, a call routed
by the topology before such a change ends (no MOVED tells the client), so
without it the client would keep sending a joined node's keys the long way.

A cluster of one node, or one that answers no topology (not an aioparamsync
node, or an old one), is not routed: every call goes to the client's node.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import os
import time
from collections.abc import Sequence
from types import EllipsisType
from typing import TYPE_CHECKING, Any

from ..errors import (
    CallTimeout,
    ClientClosedError,
    ConnectError,
    ConnectionLostError,
    ErrorCode,
    Moved,
    ParamSyncError,
    RequestError,
    ServerError,
)
from ..placement import DOWN, JOINING, LEAVING, LIVE, PLACED, Placement, barrier_key
from ..routing.merge import merge_answers, merge_responses, read_part
from ..routing.partitions import (
    collapse,
    cut,
    gather,
    manifests_of,
    read_ahead,
    readable_error,
)
from ..store.cuts import new_call
from ..values.partitions import Layout, layout_for
from ..wire import METHODS, Method, thrift
from .fetch import gather_all
from .pool import ConnectionPool

if TYPE_CHECKING:
    from .api import ParameterClient

__all__ = ["READ_FROM", "Routes"]

log = logging.getLogger(__name__)

#: where reads go: a name's primary, any live replica of it (reading this
#: client's own writes), or (auto) any where writes wait for every replica
READ_FROM = ("auto", "primary", "any")
# The most names whose newest version a client remembers (see the module);
# past it, it reads from primaries (which every version it saw came from, or
# reached).
MAX_FLOORS = 1 << 20
# MOVED answers to one part before it goes to the client's node unrouted.
MAX_MOVES = 2
# How often a client asks for the topology again, at its next call (seconds).
REFRESH_SECONDS = 30.0
# Partitions a read asks for beside their manifests, at most, a live node (read_ahead).
AHEAD_BYTES = 64 * 1024 * 1024
# ... and while a member of the topology known is in a state that changes soon.
CHANGING_REFRESH_SECONDS = 1.0
CHANGING = frozenset({JOINING, LEAVING, DOWN})
# The methods routed by the names they carry, and the argument holding them.
ROUTED = {
    "get_parameters": "request",
    "pull_parameters": "request",
    "update_parameters": "update",
    "push_parameters": "update",
    "broadcast_update": "update",
    "push_gradients": "push",
    "barrier": "request",
}


class Topology:
    """One topology as the client uses it: placement, who is live, where each member is."""

    def __init__(self, answer: Any) -> None:
        self.epoch: int = answer.epoch
        members = answer.members or []
        self.addresses = {m.node_id: (m.host, m.port) for m in members}
        placed = [m.node_id for m in members if m.state in PLACED]
        self.placement = Placement(placed, answer.replication_factor or None, answer.claims)
        self.live = frozenset(m.node_id for m in members if m.state in LIVE)
        #: one member only: nothing to route
        self.single = len(placed) <= 1
        #: parameters larger than this are stored as partitions (0: none is)
        self.partition_bytes: int = answer.partition_bytes or 0
        #: where reads go by default (read_from="auto"): any replica where every
        #: one holds each write acknowledged
        self.auto_reads = "any" if answer.acks == "all" else "primary"
        #: seconds before asking for the topology again (soon while a member changes)
        self.refresh_after = (
            CHANGING_REFRESH_SECONDS
            if any(m.state in CHANGING for m in members)
            else REFRESH_SECONDS
        )

    def target(self, name: str, read_from: str, salt: bytes) -> str | None:
        """Where a call for ``name`` goes: its primary, or (reads from any) one live replica."""
        if read_from == "primary":
            return self.placement.primary(name, self.live)
        live = [m for m in self.placement.replicas(name) if m in self.live]
        if not live:
            return None
        if len(live) == 1:
            return live[0]
        # (the same replica for a name while the topology holds: rendezvous with a salt)
        return max(live, key=lambda m: hashlib.blake2b(salt + f"{m}\0{name}".encode()).digest())


class Routes:
    """A client's routing: its topology, and a pool of connections to each member.

    Args:
        client: the client (its own pool is the way to its first node).
        read_from: "auto", "primary" or "any" (see the module).
    """

    def __init__(self, client: ParameterClient, read_from: str) -> None:
        if read_from not in READ_FROM:
            raise ValueError(f"read_from is one of {', '.join(READ_FROM)}, not {read_from!r}")
        self.client = client
        self.read_from = read_from
        self.topology: Topology | None = None
        self.enabled = True  # False once the node answered no topology
        self._learning: asyncio.Future[None] | None = None
        self._learned_at = 0.0
        self._pools: dict[tuple[str, int], ConnectionPool] = {}
        self._salt = os.urandom(8)
        #: the layouts of partitioned parameters, as last read or written
        self.layouts: dict[str, Layout] = {}
        #: the newest version of each name this client wrote or read (see the module)
        self.floors: dict[str, int] = {}
        self.reread = 0  # names a replica answered older than their floor, read again
        self.refreshes = 0  # topologies asked for, so far
        self._background: asyncio.Future[None] | None = None

    async def close(self) -> None:
        for task in (self._background, self._learning):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task})
        pools, self._pools = self._pools, {}
        await asyncio.gather(*(p.close() for p in pools.values()))

    # -- the topology ---------------------------------------------------------------

    async def learn(self, source: ConnectionPool | None = None) -> None:
        """Ask for the topology (once at a time; from ``source``, else the client's node)."""
        if self._learning is None:
            self._learning = asyncio.ensure_future(self._learn(source))
        learning = self._learning
        try:
            await asyncio.shield(learning)
        finally:
            if self._learning is learning and learning.done():
                self._learning = None

    async def _learn(self, source: ConnectionPool | None) -> None:
        self.refreshes += 1
        self._learned_at = time.monotonic()
        client = self.client
        pools: list[ConnectionPool] = [source] if source is not None else []
        pools.append(client)
        if self.topology is not None:
            pools += [self._pool(a) for a in self.topology.addresses.values()]
        last: Exception | None = None
        for pool in pools:
            try:
                answer = await ConnectionPool.invoke(pool, METHODS.topology)
            except ServerError as exc:
                if pool is client and self.topology is None:
                    # (not an aioparamsync node of this kind: it answers no topology)
                    log.info(
                        "%s:%d answers no topology (%s): calls are not routed",
                        *pool.addresses[pool._current],
                        exc,
                    )
                    self.enabled = False
                    return
                last = exc
            except (ConnectError, ConnectionLostError, CallTimeout) as exc:
                last = exc
            else:
                if self.topology is None or answer.epoch >= self.topology.epoch or source is pool:
                    self.topology = Topology(answer)
                return
        if self.topology is None and last is not None:
            try:
                raise last
            finally:
                del last  # (the error's traceback holds this frame: not a cycle through it)

    def _pool(self, address: tuple[str, int]) -> ConnectionPool:
        client = self.client
        if address == client.addresses[client._current]:
            return client
        pool = self._pools.get(address)
        if pool is None:
            pool = self._pools[address] = ConnectionPool(
                address,
                timeout=client.timeout,
                connect_timeout=client.connect_timeout,
                max_connections=client.max_connections,
                max_frame_bytes=client.max_frame_bytes,
                ssl=client.ssl,
            )
            pool.traffic = client.traffic  # (the client counts every byte it moves)
        return pool

    def _down(self, member: str) -> None:
        """A member could not be reached: route around it until the topology says more."""
        topology = self.topology
        if topology is not None and member in topology.live:
            topology.live = topology.live - {member}

    # -- calls ----------------------------------------------------------------------

    def wanted(self) -> bool:
        """Whether to route a call now: the topology is known, and of several nodes.

        Until the topology is known, calls go to the client's node (which
        passes on what it does not hold) while it is asked for, in the
        background: the first call waits for no extra round trip. It is
        asked for again every ``REFRESH_SECONDS`` (``CHANGING_REFRESH_SECONDS``
        while a member changes).
        """
        if not self.enabled:
            return False
        topology = self.topology
        if self._learning is None and (
            topology is None or time.monotonic() - self._learned_at > topology.refresh_after
        ):
            self._learned_at = time.monotonic()
            self._background = asyncio.ensure_future(self._relearn())
        return topology is not None and not topology.single

    def reads(self) -> str:
        """Where reads go now: "primary" or "any" (``read_from``, "auto" as the topology says)."""
        mode = self.read_from
        if mode == "auto":
            topology = self.topology
            mode = "primary" if topology is None else topology.auto_reads
        if mode == "any" and len(self.floors) >= MAX_FLOORS:
            return "primary"  # (see MAX_FLOORS)
        return mode

    async def invoke(self, m: Method, timeout: float | EllipsisType | None, args: dict) -> Any:
        """Send ``m`` routed (see the module); answer its (merged) result."""
        arg = ROUTED[m.name]
        value = args.get(arg)
        if value is None:
            return await ConnectionPool.invoke(self.client, m, timeout=timeout, **args)
        reads = self.reads()
        if arg == "request" and m.name != "barrier":
            topology = self.topology
            sent, ahead = value, set[str]()
            if self.layouts and topology is not None and not topology.single:
                most = AHEAD_BYTES * len(topology.live)  # (about that much a node)
                sent, ahead = read_ahead(value, self.layouts, most)

            def send() -> Any:
                return self._send(m, arg, sent, timeout, {**args, arg: sent}, 0, reads)

            try:
                answer = await send()
            except Exception:
                for name in value.param_names if ahead else ():
                    self.layouts.pop(name, None)  # (next, read plainly: it may be whole now)
                raise
            for p in answer.params if self.layouts else ():
                if "\x00" not in p.name:
                    self.layouts.pop(p.name, None)  # (answered whole: not partitioned now)
            response = await self._gather(value, answer, timeout, send, reads)
            if ahead:  # (one asked ahead, its parameter now whole: not the caller's)
                response.params = [p for p in response.params if p.name not in ahead]
            if reads == "any":
                response = await self._fresh(m, value, response, timeout)
                self._saw({p.name: p.version for p in response.params})
            return response
        topology = self.topology
        if topology is not None and topology.partition_bytes and arg in ("update", "push"):
            result = await self._cut(m, arg, value, timeout, topology.partition_bytes)
        else:
            if arg in ("update", "push") and value.call is None:
                value = _stamped(value, value.grads if arg == "push" else value.params)
                args = {**args, arg: value}
            result = await self._send(m, arg, value, timeout, args, moves=0)
        if reads == "any" and isinstance(result, thrift.UpdateResult) and result.versions:
            self._saw(result.versions)
        return result

    def _saw(self, versions: dict[str, int]) -> None:
        """This client wrote or read these versions: its reads see them, or newer."""
        floors = self.floors
        for name, version in versions.items():
            if version > floors.get(name, -1):
                floors[name] = version

    async def _fresh(self, m: Method, request: Any, response: Any, timeout: Any) -> Any:
        """``response`` (from replicas) with each name it has older than this client
        saw it (or left out) read again from its primary (see the module)."""
        floors = self.floors
        if not floors or not request.param_names:
            return response
        answered = {p.name: p.version for p in response.params}
        known = request.known_versions or {}
        stale = []
        for name in dict.fromkeys(request.param_names):
            floor = floors.get(name)
            if floor is None:
                continue
            version = answered.get(name)
            # (left out of a delta pull: the caller holds that version or newer)
            if (version is None and known.get(name, -1) < floor) or (
                version is not None and version < floor
            ):
                stale.append(name)
        if not stale:
            return response
        self.reread += len(stale)
        sub = read_part(request, stale)

        def send() -> Any:
            return self._send(m, "request", sub, timeout, {"request": sub}, 0, "primary")

        again = await self._gather(sub, await send(), timeout, send, "primary")
        gone = set(stale)
        kept = thrift.ParameterResponse(
            params=[p for p in response.params if p.name not in gone],
            timestamp=response.timestamp,
        )
        return merge_responses([kept, again])

    def cuts(self, p: Any) -> bool:
        """Whether a write of ``p`` is cut into partitions here (routed, and large)."""
        topology = self.topology
        if topology is None or topology.single or not topology.partition_bytes:
            return False
        return "\x00" not in p.name and layout_for(p, topology.partition_bytes) is not None

    async def _gather(
        self, request: Any, response: Any, timeout: Any, again: Any, reads: str
    ) -> Any:
        """``response`` with the partitioned parameters in it read whole (routing.partitions),
        where ``reads`` says; ``again()`` reads it again, if one was replaced amid the read."""
        if not any("\x00" in p.name for p in response.params):
            return response
        found = manifests_of(response.params)
        self.layouts.update(found)
        asked = set(request.param_names or ())
        if all(p.name in asked for p in response.params if "\x00" in p.name):
            return response  # (keys asked for by their own names: as they are, as a node answers)

        def read(sub: Any) -> Any:
            return self._send(
                METHODS.pull_parameters, "request", sub, timeout, {"request": sub}, 0, reads
            )

        # (no limits: the partitions are put together here, whatever their size)
        return await gather(request, response, read, again=again, encoding=request.encoding)

    async def _cut(
        self, m: Method, arg: str, value: Any, timeout: Any, partition_bytes: int
    ) -> Any:
        """A write (an update, a push) with its large parameters cut into their partitions.

        An update's manifests are written first, at the nodes holding their
        names (which check the layout), unless the layout is the one last
        read or written; then everything, each part at its primary.
        """
        items = value.grads if arg == "push" else value.params
        try:
            cut_items, manifests, chosen = cut(items, partition_bytes, self.layouts)
        except ValueError as exc:
            raise RequestError(ErrorCode.SHAPE_MISMATCH, str(exc)) from None
        known = self.layouts
        if arg == "update" and known:
            for item in items:
                if item.name not in chosen:
                    known.pop(item.name, None)  # (written whole: it may no longer be cut)
        if not chosen:
            if value.call is None:
                value = _stamped(value, items)
            return await self._send(m, arg, value, timeout, {arg: value}, moves=0)
        if arg == "update" and any(p.replace or p.dtype is None for p in items if p.name in chosen):
            # A replacement may change a parameter between whole and partitions: the
            # node writes its partitions, then its manifest, past the stored version.
            for name in chosen:
                known.pop(name, None)
            return await ConnectionPool.invoke(self.client, m, timeout=timeout, **{arg: value})
        new: list[Any] = []
        if arg == "update":
            new = [
                made
                for made, (name, layout) in zip(manifests, chosen.items(), strict=True)
                if made.replace or known.get(name) != layout
            ]
        if value.call is None:  # (its parts: one call, for a checkpoint's cut)
            value = _stamped(value, [*new, *cut_items])
        try:
            if arg == "update" and new:
                first = copy.copy(value)
                first.params = new
                await self._send(
                    METHODS.push_parameters, arg, first, timeout, {arg: first}, moves=0
                )
            sub = copy.copy(value)
            if arg == "push":
                sub.grads = cut_items
            else:
                sub.params = cut_items
            result = await self._send(m, arg, sub, timeout, {arg: sub}, moves=0)
        except RequestError as exc:
            for name in chosen:
                known.pop(name, None)  # (read again before the next write)
            if readable_error(exc) is exc:  # (then not `raise exc from exc`: it would hold
                raise  # itself, and with it every frame it passed, until a collection)
            raise readable_error(exc) from exc
        if arg == "update":
            known.update(chosen)
        if isinstance(result, thrift.UpdateResult):
            result.versions = collapse(result.versions, chosen)
        return result

    def _parts(self, m: Method, value: Any, reads: str) -> dict[str | None, Any] | None:
        """The call's argument cut by target node (None: unrouted); None: send it as it is.
        (``reads``: where reads go, "primary" or "any".)"""
        topology = self.topology
        assert topology is not None
        name = m.name
        if name == "barrier":
            if not isinstance(value.group, str):
                return None
            return {topology.target(barrier_key(value.group), "primary", self._salt): value}
        if name in ("get_parameters", "pull_parameters"):
            if value.all_names or not value.param_names:
                return None
            groups: dict[str | None, list[str]] = {}
            for n in value.param_names:
                groups.setdefault(topology.target(n, reads, self._salt), []).append(n)
            return {t: read_part(value, names) for t, names in groups.items()}
        items = value.grads if name == "push_gradients" else value.params
        if not items:
            return None
        # (by primary: the placement's own cut, which the node cuts what it passes on by)
        by_name: dict[str, list[Any]] = {}
        for item in items:
            by_name.setdefault(item.name, []).append(item)  # (pieces: several of one name)
        by_target = {
            t: [item for n in names for item in by_name[n]]
            for t, names in topology.placement.by_primary(list(by_name), topology.live).items()
        }
        parts = {}
        for t, chosen in by_target.items():
            sub = copy.copy(value)
            if name == "push_gradients":
                sub.grads = chosen
            else:
                sub.params = chosen
            parts[t] = sub
        return parts

    async def _send(
        self,
        m: Method,
        arg: str,
        value: Any,
        timeout: Any,
        args: dict,
        moves: int,
        reads: str = "primary",
    ) -> Any:
        parts = self._parts(m, value, reads)
        if parts is None or (len(parts) == 1 and None in parts):
            return await ConnectionPool.invoke(self.client, m, timeout=timeout, **args)

        async def part(target: str | None, sub: Any) -> Any:
            if target is None or moves >= MAX_MOVES:
                # (no live replica known, or moved too often: the node passes it on)
                sub.epoch = None
                return await ConnectionPool.invoke(self.client, m, timeout=timeout, **{arg: sub})
            done, result = await self.call_at(target, m, timeout, arg, sub)
            if done:
                return result
            return await self._send(m, arg, sub, timeout, {**args, arg: sub}, moves + 1, reads)

        if len(parts) == 1:
            ((target, sub),) = parts.items()
            return await part(target, sub)
        answers = await gather_all(part(t, sub) for t, sub in parts.items())
        return merge_answers(m.oneway, answers)

    def pool_of(self, key: str) -> ConnectionPool | None:
        """The connections to ``key``'s primary by the topology known (None: not routed,
        or no replica of it live): for calls the routing does not cut (a bucket's rows)."""
        topology = self.topology
        if not self.wanted() or topology is None or topology.single:
            return None
        target = topology.target(key, "primary", self._salt)
        return None if target is None else self._pool(topology.addresses[target])

    def target(self, key: str, read_from: str) -> str | None:
        """Where a call for ``key`` goes by the topology known (see :meth:`Topology.target`)."""
        topology = self.topology
        assert topology is not None
        return topology.target(key, read_from, self._salt)

    async def call_at(
        self, target: str, m: Method, timeout: Any, arg: str, sub: Any
    ) -> tuple[bool, Any]:
        """Send ``m`` (its argument ``arg`` is ``sub``) to member ``target`` with the
        topology's epoch: ``(True, result)``, or ``(False, None)`` when it must be
        routed again (the node answered MOVED, or could not be reached: the
        topology was asked for again).

        Raises:
            RequestError: any other refusal.
            ConnectionLostError: the connection broke with a call in flight
                that is not idempotent (it may have been applied).
        """
        topology = self.topology
        assert topology is not None
        sub.epoch = topology.epoch
        pool = self._pool(topology.addresses[target])
        try:
            return True, await ConnectionPool.invoke(pool, m, timeout=timeout, **{arg: sub})
        except Moved:
            await self.learn(pool)
        except ConnectError:
            self._down(target)
            await self._relearn()
        except ConnectionLostError:
            self._down(target)
            await self._relearn()
            if not m.idempotent:
                raise
        except ClientClosedError:
            raise
        return False, None

    async def _relearn(self) -> None:
        try:
            await self.learn()
        except (ParamSyncError, OSError) as exc:
            log.info("could not learn the topology: %s", exc)


def _stamped(value: Any, items: Sequence[Any]) -> Any:
    """``value`` (an update, a push) stamped as one call writing ``items`` (see
    :mod:`aioparamsync.store.cuts`): its parts at several nodes are one call."""
    stamped = copy.copy(value)
    stamped.call = new_call(len({item.name for item in items}))
    return stamped
