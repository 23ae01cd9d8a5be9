"""Routing on the node: what it serves itself, what it passes on, and to whom.

A node holds the keys placement gives it (see :mod:`aioparamsync.placement`).
A request may name others:

* A caller that routed by a topology says so (the request's ``epoch``): it
  is served what this node holds, and answered ``MOVED`` (with this node's
  epoch) for any name it does not hold, so it refreshes its topology. A
  write is served by any replica (views of the primary may differ for a
  moment; any replica applies it and replicates it, so no caller bounces
  between two nodes).
* A caller that knows no topology (the founding client, any Apache Thrift
  client, our client with ``route=False``) is served everything: what this
  node holds is served (and written) here; the rest of the request is cut
  by primary, each part passed on to its primary (with this node's epoch; a
  part answered ``MOVED`` goes to the key's next replica), and the answers
  merged. So the founding IDL is complete on every node.

Reads of names no replica of which is live are served here (what this node
has of them: usually nothing). Writes of such names are refused
(``UNAVAILABLE``): a copy made here would start the key anew, and could lose
to the old one by last-writer-wins when its replicas come back.

What is atomic: each part is applied atomically where it is applied; an
update spanning several replica sets is answered once every part is, and a
reader of two of them may see one applied before the other.

The cluster is read through its typed view (:class:`~.clusterview.ClusterView`):
this module imports nothing of :mod:`aioparamsync.cluster`.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..errors import RequestError
from ..placement import LIVE, barrier_key
from ..routing.merge import merge_responses, merge_results, read_part
from ..store.cuts import new_call
from ..store.table import lww_key
from ..wire import METHODS, Method, thrift
from . import forward
from .clusterview import ClusterView

__all__ = ["Router"]

# The deadline of a call passed on to another node (seconds), past the wait a
# held one (a long poll, a barrier) asks for: a node that froze is given up on.
PASS_ON_TIMEOUT = 30.0


def _deadline(m: Method, args: dict[str, Any]) -> float | None:
    wait_ms = getattr(args.get("request"), "wait_ms", None)
    if wait_ms is not None and wait_ms >= 0:
        return wait_ms / 1000 + PASS_ON_TIMEOUT
    if m.held == "always":
        return None  # (a barrier without a wait: as long as its caller waits)
    return PASS_ON_TIMEOUT


class Router:
    """Cuts requests by the nodes that hold their keys (see the module).

    Args:
        cluster: the node's cluster (its view of the topology), or None (a node alone).
    """

    def __init__(self, cluster: ClusterView | None) -> None:
        self.cluster = cluster
        self.passed_on = 0  # parts of requests passed on to other nodes

    # -- which node serves what ---------------------------------------------------

    def alone(self) -> bool:
        """Whether this node serves everything itself (no peers, or every key here)."""
        cluster = self.cluster
        return cluster is None or not cluster.links

    def serves_all(self) -> bool:
        """Whether this node holds every key of its cluster (alone, or every node holds all)."""
        cluster = self.cluster
        if cluster is None or not cluster.links:
            return True
        placement = cluster.placement
        return (
            cluster.state in LIVE
            and placement.everywhere
            and cluster.me.node_id in placement.members
        )

    def check_routed(self, names: Sequence[str]) -> None:
        """Refuse (MOVED) a routed request naming keys this node does not hold."""
        cluster = self.cluster
        if cluster is not None:
            forward.gate(cluster, names)

    def read_parts(self, names: Sequence[str]) -> dict[str | None, list[str]] | None:
        """``names`` by the node to read each from (None: here); None when all are here."""
        return self._parts(names, write=False)

    def write_parts(self, names: Sequence[str]) -> dict[str | None, list[str]] | None:
        """``names`` by the node to apply each at (None: here); None when all are here.

        Here, when this node is a replica of the name (as a founding client's
        write was applied where it was sent, before sharding: the primary is
        where routed callers write, and replicas resolve concurrent writes by
        last-writer-wins); else at its primary.

        Raises:
            RequestError: (UNAVAILABLE) a name none of whose replicas is up.
        """
        return self._parts(names, write=True)

    def _parts(self, names: Sequence[str], write: bool) -> dict[str | None, list[str]] | None:
        cluster = self.cluster
        if cluster is None or not cluster.links:
            return None
        me, placement = cluster.me.node_id, cluster.placement
        if cluster.state in LIVE and placement.everywhere and me in placement.members:
            return None
        parts = forward.cut(cluster, names, what="the update", held_here=True, refuse=write)
        return None if not parts or list(parts) == [None] else parts

    def owner(self, key: str) -> str | None:
        """The primary of ``key`` when it is another node (None: this one, or none live)."""
        cluster = self.cluster
        if cluster is None or not cluster.links:
            return None
        target = forward.holder(cluster, key)
        return None if target == cluster.me.node_id else target

    # -- passing on ---------------------------------------------------------------

    async def pass_on(
        self,
        target: str,
        names: list[str],
        m: Method,
        make: Callable[[list[str]], dict[str, Any]],
        here: Callable[[list[str]], Awaitable[Any]],
    ) -> list[Any]:
        """Call ``m`` (its arguments ``make(names)``) at ``target``; answer the results.

        By the one forward policy (:func:`.forward.pass_on`): names a node
        does not take go on to their holders as this node sees them
        (``here(names)``, those this node holds by then).
        """
        cluster = self.cluster
        assert cluster is not None

        async def send(link: Any, chosen: list[str], fallback: bool) -> Any:
            args = make(chosen)
            result = await link.proxy().invoke(m, timeout=_deadline(m, args), **args)
            self.passed_on += 1
            return result

        return await forward.pass_on(
            cluster, target, names, send, here, what=m.name, idempotent=not m.writes
        )

    # -- requests cut by node, answers merged --------------------------------------

    async def read(
        self,
        request: Any,
        parts: Mapping[str | None, list[str]],
        local: Callable[[Any], Any],
        m: Method,
    ) -> Any:
        """A read cut by node: each part read where it is held, the answers merged."""
        cluster = self.cluster
        assert cluster is not None

        async def here(names: list[str]) -> Any:
            outcome = local(read_part(request, names))
            return await outcome if isinstance(outcome, asyncio.Future) else outcome

        async def part(target: str | None, names: list[str]) -> Any:
            if target is None:
                return await here(names)
            sub = read_part(request, names)
            sub.epoch = cluster.epoch

            def make(chosen: list[str]) -> dict[str, Any]:
                return {"request": sub if chosen == names else read_part(sub, chosen)}

            return merge_responses(await self.pass_on(target, names, m, make, here))

        answers = await asyncio.gather(*(part(t, ns) for t, ns in parts.items()))
        return merge_responses(answers)

    async def read_everything(self, request: Any, local: Any, m: Method) -> Any:
        """A read of every name (``all_names``): from every member, merged by last writer."""
        cluster = self.cluster
        assert cluster is not None
        sub = copy.copy(request)
        sub.epoch = cluster.epoch
        sub.packed = sub.shared = None  # (merged by Parameter)
        calls = []
        for member in cluster.live:
            link = cluster.by_id.get(member)
            if link is not None:
                calls.append(link.proxy().invoke(m, request=sub))
        answers = [local, *await asyncio.gather(*calls)]
        newest: dict[str, Any] = {}
        for answer in answers:
            for p in answer.params:
                held = newest.get(p.name)
                if held is None or lww_key(held) < lww_key(p):
                    newest[p.name] = p
        stamp = max(a.timestamp for a in answers)
        return thrift.ParameterResponse(params=list(newest.values()), timestamp=stamp)

    async def write(
        self,
        update: Any,
        params: Sequence[Any],
        parts: Mapping[str | None, list[str]] | None,
        local: Callable[[Sequence[Any], str | None], asyncio.Future],
        acks: str,
    ) -> Any:
        """An update cut by primary: each part applied at its primary; the versions merged.

        ``local(params, call)`` applies this node's part (a future of its
        ``UpdateResult``); with ``acks="all"`` each primary answers once its
        live replicas have the part.
        """
        cluster = self.cluster
        by_name: dict[str, list[Any]] = {}
        for p in params:
            by_name.setdefault(p.name, []).append(p)  # (pieces: several of one name)
        if parts is None:
            parts = {None: list(by_name)}
        # (cut among nodes: every part stamped as one call, for a checkpoint's cut)
        call = update.call or (new_call(len(by_name)) if set(parts) != {None} else None)

        # (here and part: no reference cycle of closures, which would keep the
        # update's buffers alive until a collection)
        async def here(names: list[str]) -> Any:
            result = await local([p for n in names for p in by_name[n]], call)
            if acks == "all" and cluster is not None:
                await cluster.replicated(names)
            return result

        async def part(target: str | None, names: list[str]) -> Any:
            if target is None:
                return await here(names)
            assert cluster is not None
            epoch = cluster.epoch

            def make(chosen: list[str]) -> dict[str, Any]:
                params = [p for n in chosen for p in by_name[n]]
                sub = thrift.ParameterUpdate(
                    params=params, timestamp=update.timestamp, epoch=epoch, acks=acks, call=call
                )
                return {"update": sub}

            return merge_results(
                await self.pass_on(target, names, METHODS.push_parameters, make, here)
            )

        answers = await asyncio.gather(
            *(part(t, ns) for t, ns in parts.items()), return_exceptions=True
        )
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            done = sum(1 for a in answers if not isinstance(a, BaseException))
            first = errors[0]
            if done and isinstance(first, RequestError):
                raise RequestError.of(
                    first.code,
                    f"{first.message} (the update spans {len(answers)} replica sets: "
                    f"{done} of them applied their part)",
                    first.epoch,
                ) from first
            raise first
        return merge_results(answers)

    async def barrier(self, target: str, request: Any, here: Callable[[], Awaitable[Any]]) -> Any:
        """A barrier held by another node (the primary of its group's key); ``here()``
        holds it on this node, if this node becomes its holder."""
        cluster = self.cluster
        assert cluster is not None
        sub = copy.copy(request)
        sub.epoch = cluster.epoch
        key = barrier_key(request.group)

        async def held_here(_: list[str]) -> Any:
            return await here()

        [result] = await self.pass_on(
            target, [key], METHODS.barrier, lambda _: {"request": sub}, held_here
        )
        return result
