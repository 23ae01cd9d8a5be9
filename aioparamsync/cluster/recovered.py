"""A node restarted with its data: its copies from before yield to what was written since.

A node with a data directory reads back at start what it held (its table
marks those entries: :meth:`~aioparamsync.store.table.ParameterTable.recovered_entry`).
The cluster went on without it meanwhile. Where no live replica of one of its
keys was left (R=1, or every replica down), the key's next primary held no
copy, and a write there made the key anew, from version 1. By last-writer-wins
alone, the restarted node's copy, of a higher version, would win over that
later write when the node came back: an acknowledged write lost. So a copy
as recovered (nothing written to it since) does not win over a live one:

- A node does not pull a peer's recovered copy over a live copy of its own
  (:func:`newer`, in repair), and a hand-off does not take a recovered copy at
  its target for its own live one (:func:`covers`, in rebalance).
- The restarted node gives up its recovered copy of a key where the key's
  primary, the member that took its writes meanwhile, holds a live copy of a
  lower version: it asks the primary to raise the key's version above its own
  first (the IDL's ``lift``: a write of the primary's, in order with the
  others), then the primary's copy replaces its own as a later write
  (:meth:`Recovery.pull`, in repair; its own is kept until then, should the
  primary go away meanwhile). So versions keep growing for readers. A copy it
  hands off (it holds the key no more) goes the same way: it drops it once the
  key's primary raised the key above it (:meth:`Recovery.lift_at_primaries`).
- As it takes over as the primary of its keys (once the former primaries
  stopped taking their writes), it asks each of those once more (a write may
  have made a key there after its join pulled; their copies replace its own
  as they are), then raises the versions of the keys whose copies yielded
  above the versions it held (asking their primary where that is another
  member now), and takes its copies of the keys it is primary of now for live
  ones (:meth:`Recovery.settle`): a key no one wrote meanwhile is back as it was.

Two recovered copies (a cluster whose nodes all restarted) compare by
last-writer-wins, as before: the later write wins. A node back from a lost
lease (with a coordinator) holds what it kept the same way: the others placed
its keys elsewhere meanwhile (see :meth:`.fencing.Fencing.forget_unconfirmed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..client.fetch import fetch
from ..errors import ParamSyncError
from ..placement import UP
from ..store.table import Entry, ParameterTable, lww_key
from ..wire import METHODS, thrift
from .batches import batches
from .links import LinkState

if TYPE_CHECKING:
    from ..client.api import ParameterClient
    from .links import PeerLink
    from .membership import Cluster

__all__ = ["Recovery", "covers", "newer", "pull"]

log = logging.getLogger(__name__)


def newer(table: ParameterTable, item: Any) -> bool:
    """Whether a peer's copy (a ``DigestEntry``) is to be pulled over this node's:
    this node has none, or a lower one, unless the peer's is recovered and this
    node's is live."""
    mine = table.entry(item.name)
    if mine is None:
        return True
    if lww_key(mine) >= lww_key(item):
        return False
    return not item.recovered or table.recovered_entry(item.name) is not None


def covers(table: ParameterTable, theirs: Any, mine: Entry) -> bool:
    """Whether a hand-off's target, holding ``theirs`` (a ``DigestEntry``), holds what
    this node does of it (``mine``): the same version; or a newer one, not recovered
    where this node's is live; or any live copy where this node's is recovered."""
    if lww_key(theirs) == lww_key(mine):
        return True  # (one write, whoever holds it as what)
    if table.recovered and table.recovered_entry(mine.name) is not None:
        return not theirs.recovered or lww_key(theirs) > lww_key(mine)
    return lww_key(theirs) > lww_key(mine) and not theirs.recovered


def _at_floors(digest: Sequence[Any], floors: Mapping[str, int]) -> list[Any]:
    """The entries of ``digest`` (live) at their floors or above."""
    return [
        item
        for item in digest
        if not item.recovered and item.name in floors and item.version >= floors[item.name]
    ]


async def pull(
    cluster: Cluster,
    client: ParameterClient,
    items: Sequence[Any],
    replacing: Mapping[str, tuple[int, str]] | None = None,
) -> list[str]:
    """Pull the parameters named by ``items`` (a peer's digest) from ``client``'s node
    and merge them here; answer the names that came. Those of ``replacing`` (name ->
    the ``lww_key`` of this node's copy) replace this node's copy, whatever their
    versions: it is dropped as the peer's arrives (not before: a peer that goes away
    meanwhile takes nothing with it), unless it changed meanwhile."""
    came: list[str] = []
    for batch in batches(list(items), cluster.batch_params, cluster.batch_bytes):
        request = thrift.ParameterRequest(
            param_names=[item.name for item in batch],
            max_inline_bytes=cluster.inline_bytes,
            as_stored=True,  # (what the peer stores: never passed on, see the IDL)
        )
        response = await client.invoke(METHODS.pull_parameters, request=request)
        # A large parameter comes without its data: read it in pieces.
        params = [
            p
            if p.total_bytes is None
            else await fetch(client, p, cluster.piece_bytes, as_stored=True)
            for p in response.params
        ]
        if params:
            if replacing and (
                gone := {p.name: replacing[p.name] for p in params if p.name in replacing}
            ):
                await cluster.store.drop(gone)
            await cluster.store.update(params, response.timestamp, replicated=True)
            came += [p.name for p in params]
    return came


class Recovery:
    """This node's recovered copies, as it meets the live cluster (see the module).

    Args:
        cluster: the cluster whose node this is.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        #: names whose recovered copies yielded -> the version to raise them to
        self.floors: dict[str, int] = {}

    async def pull(
        self, client: ParameterClient, peer: str, items: Sequence[Any], primaries: bool = True
    ) -> int:
        """Pull from ``peer`` (through ``client``) what its digest ``items`` holds newer
        than this node (see :func:`newer`), and the copies that supersede the recovered
        ones here: live there, lower, and (``primaries``) ``peer`` their primary now;
        those replace this node's. Answers how many parameters came."""
        cluster = self.cluster
        table = cluster.store.table
        given: dict[str, tuple[int, str]] = {}
        if table.recovered:
            placement, live = cluster.placement, cluster.live
            for item in items:
                if item.recovered or (mine := table.recovered_entry(item.name)) is None:
                    continue
                if lww_key(item) < lww_key(mine) and (
                    not primaries or placement.primary(item.name, live) == peer
                ):
                    given[item.name] = lww_key(mine)
        if given and primaries:
            # (``peer`` raises them above this node's copies first: they come as later
            # writes, which replace these by last-writer-wins; those it did not raise
            # replace these as they are, and are raised later: see lift_floors)
            floors = {name: key[0] + 1 for name, key in given.items()}
            try:
                raised = _at_floors(await self._lifted(client, floors), floors)
            except (ParamSyncError, OSError) as exc:
                log.info("%s raised no versions: %s", peer, exc)
                raised = []
            if raised:
                names = {item.name for item in raised}
                given = {n: key for n, key in given.items() if n not in names}
                items = [item for item in items if item.name not in names] + raised
        wanted = [item for item in items if item.name in given or newer(table, item)]
        came = await pull(cluster, client, wanted, given)
        yielded = [name for name in came if name in given]
        for name in yielded:
            self.floors[name] = max(self.floors.get(name, 0), given[name][0] + 1)
        if yielded:
            log.warning(
                "%d keys read from the data directory were written anew at %s while this "
                "node was away (e.g. %r): the newer writes replace its copies",
                len(yielded),
                peer,
                yielded[0],
            )
        if self.floors and cluster.state == UP and cluster.settling is None:
            await self.lift_floors()  # (once it settled: until then, its settle does)
        return len(came)

    def former_primaries(self) -> dict[str, str]:
        """Before this node says it is up: each key recovered here that it will be the
        primary of, and the member that is the key's primary now (if any)."""
        cluster = self.cluster
        table = cluster.store.table
        if not table.recovered:
            return {}
        me = cluster.me.node_id
        placement, live = cluster.placement, cluster.live
        after = cluster.pending or placement
        found = {}
        for name in list(table.recovered):
            if table.recovered_entry(name) is None or after.primary(name, live | {me}) != me:
                continue
            former = placement.primary(name, live)
            if former is not None and former != me:
                found[name] = former
        return found

    async def settle(self, former: Mapping[str, str], up: Mapping[str, PeerLink]) -> None:
        """As this node takes over (the former primaries answered that they know): yield
        to what they wrote meanwhile (each of ``former``'s members, asked through its
        link in ``up``), raise the versions of the keys whose copies yielded, and take
        its copies of the keys it is now primary of for live ones."""
        cluster = self.cluster
        by_peer: dict[str, list[str]] = {}
        for name, peer in former.items():
            by_peer.setdefault(peer, []).append(name)
        asked = await asyncio.gather(
            *(self._ask(up.get(peer), peer, names) for peer, names in by_peer.items())
        )
        table = cluster.store.table
        me, placement, live = cluster.me.node_id, cluster.placement, cluster.live
        await self.lift_floors()
        for names, answered in zip(by_peer.values(), asked, strict=True):
            for name in names if answered else ():
                if placement.primary(name, live) == me:
                    table.recovered.pop(name, None)  # (live now: the primary's copy)

    async def lift_floors(self) -> None:
        """Have the keys whose copies yielded here raised above the versions this node
        held (:attr:`floors`), by their primaries; those not raised now (their primary
        not up, or not their primary by its own view) are asked again at the next
        repair."""
        floors = dict(self.floors)
        raised = await self.lift_at_primaries(floors)
        for name in raised:
            if self.floors.get(name) == floors[name]:
                del self.floors[name]
        if raised:
            log.info("the versions of %d keys raised above those this node held", len(raised))

    async def lift_at_primaries(self, floors: Mapping[str, int]) -> set[str]:
        """Have each key of ``floors`` raised to its floor by its primary (by this node's
        view; this node's own, here); answer the names raised, or that their primary
        does not hold (nothing to raise). A primary not up, or that does not answer,
        raises nothing."""
        cluster = self.cluster
        table = cluster.store.table
        me, placement, live = cluster.me.node_id, cluster.placement, cluster.live
        by_primary: dict[str | None, dict[str, int]] = {}
        for name, floor in floors.items():
            by_primary.setdefault(placement.primary(name, live), {})[name] = floor
        raised: set[str] = set()
        for primary, part in by_primary.items():
            if primary == me:
                await cluster.store.lift(part)
                raised.update(
                    n for n in part if (e := table.entry(n)) is None or e.version >= part[n]
                )
                continue
            link = cluster.by_id.get(primary) if primary is not None else None
            if link is None or link.state != LinkState.UP:
                continue
            try:
                digest = await self._lifted(link.proxy(), part)
            except (ParamSyncError, OSError) as exc:
                log.info("%s raised no versions: %s", primary, exc)
                continue
            held = {item.name for item in digest}
            raised.update(item.name for item in _at_floors(digest, part))
            raised.update(name for name in part if name not in held)
        return raised

    async def _lifted(self, client: ParameterClient, floors: Mapping[str, int]) -> list[Any]:
        """Ask ``client``'s node to raise the keys of ``floors`` to their floors (the
        IDL's ``lift``: it does where it is their primary); answer its digest of them."""
        step = self.cluster.batch_params
        items = list(floors.items())
        digest = []
        for i in range(0, len(items), step):
            request = thrift.LiftRequest(floors=dict(items[i : i + step]))
            digest += await client.invoke(METHODS.lift, request=request)
        return digest

    async def _ask(self, link: PeerLink | None, peer: str, names: list[str]) -> bool:
        """Yield to ``peer``'s live copies of ``names`` and pull them, through ``link``
        (None: not up); answer whether ``peer`` answered."""
        cluster = self.cluster
        if link is None:
            return False
        client = link.proxy()
        try:
            for i in range(0, len(names), cluster.batch_params):
                request = thrift.DigestRequest(names=names[i : i + cluster.batch_params])
                digest = await client.invoke(METHODS.digest_for, request=request)
                await self.pull(client, peer, digest, primaries=False)
        except (ParamSyncError, OSError) as exc:
            log.info("could not ask %s what it wrote while this node was away: %s", peer, exc)
            return False
        return True
