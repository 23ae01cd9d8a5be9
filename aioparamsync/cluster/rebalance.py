"""Rebalancing: a node hands off the keys it holds but is no replica of any more.

After a change of topology (a member joined, left, failed, or came back), a
node may hold keys placement gives to others: its own keys, when it leaves;
keys a joining member now ranks above it for; keys it held for a member that
failed, once that member is back. Its :class:`Rebalancer` hands each such key
to the key's replicas and only then forgets it:

1. ask each live replica for the digest of those keys (``digest_for`` by
   names): what version it holds of each;
2. offer what it lacks to the link to it (a replication message, merged by
   last-writer-wins) and wait for the link to confirm it (its outbox sent,
   then a ping answered behind it);
3. ask again; the keys every replica now holds at this node's version or
   newer are dropped here (through the store's writer, in order with the
   updates: a version written here since is kept for the next round).

A round works for the epoch it started at: if a newer one came while it
waited for the replicas (a member joined, left or failed meanwhile), it drops
nothing, since what they confirmed was for the placement before; the next
round, which the new epoch starts, works from the new placement.

A replica that is down cannot confirm: the key stays here until it can, or
until placement moves it to members that can. So a key is never dropped
before its new holders have it: no acknowledged write is lost to a join, a
leave or a failure (Redis Cluster's MIGRATING/IMPORTING, and Cassandra's
streaming before the old replicas drop a range, do the same).

The other direction needs nothing here: a node that becomes a replica of a
key pulls it, by the restricted anti-entropy its links run at every new
epoch (see :mod:`.links`). Rounds run at every new epoch and every
``repair_interval`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..errors import ParamSyncError
from ..placement import JOINING, LEAVING, LEFT, UP
from ..store.table import Entry, lww_key
from ..wire import METHODS, thrift
from .links import LinkState, PeerLink
from .recovered import covers

if TYPE_CHECKING:
    from .membership import Cluster

__all__ = ["Rebalancer"]

log = logging.getLogger(__name__)

# The shortest time between two rounds (seconds): epochs may change in bursts.
MIN_ROUND_INTERVAL = 0.1
# The longest time between two rounds while keys are left to move (seconds).
AGAIN_WHILE_MOVING = 1.0


class Rebalancer:
    """Hands off what this node holds but placement gives to others (see the module).

    Attributes:
        moving: keys held here that are no replica's here any more (last round).
        under_replicated: keys this node is primary of, some of whose replicas
            are not live (last round).
        handed_off: keys dropped here once their replicas had them, so far.
        aborted: rounds that dropped nothing, a newer epoch having come meanwhile.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.moving = 0
        self.under_replicated = 0
        self.handed_off = 0
        self.stuck = 0  # keys to move none of whose holders to come is up (last round)
        self.aborted = 0
        #: rounds of other keys than parameters (embedding tables' buckets), run
        #: after each round here and at a take-over; each answers the keys it still
        #: has to move
        self.hooks: list[Callable[[], Awaitable[int]]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="aioparamsync-rebalance")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
            self._task = None

    async def _run(self) -> None:
        cluster = self.cluster
        while True:
            # (keys left to hand off to holders that are up: again soon, not a repair
            # interval later; a round that a newer epoch cut short may have left them)
            wait = cluster.repair_interval
            if self.moving > self.stuck:
                wait = min(wait, AGAIN_WHILE_MOVING)
            with_timeout = asyncio.timeout(wait)
            try:
                async with with_timeout:
                    await cluster.changed.wait()
            except TimeoutError:
                pass
            cluster.changed.clear()
            try:
                await self.round()
                await self.other_rounds()
            except (ParamSyncError, OSError) as exc:
                log.info("rebalancing stopped short (%s); trying again", exc)
            except Exception:  # a bug must not stop rebalancing for good
                log.exception("rebalancing failed")
            await asyncio.sleep(MIN_ROUND_INTERVAL)

    async def other_rounds(self) -> int:
        """One round of each hook; answer the keys they still have to move."""
        return sum([await hook() for hook in self.hooks])

    def surplus(self) -> list[Entry]:
        """The entries held here that this node will not hold: it is a replica of
        them neither now nor in the pending placement (every one, while leaving)."""
        cluster = self.cluster
        if cluster.state in (JOINING, LEFT):
            return []  # (it pulls what it will hold; or it has left, and stops)
        me = cluster.me.node_id
        placement, pending = cluster.placement, cluster.pending
        leaving = cluster.state == LEAVING
        after = pending or placement
        if not leaving and after.everywhere and placement.everywhere and me in after.members:
            return []
        table = cluster.store.table
        entries = []
        for name in table.names():
            if not leaving and (after.holds(me, name) or placement.holds(me, name)):
                continue
            entry = table.entry(name)
            if entry is not None:
                entries.append(entry)
        return entries

    def count_under_replicated(self) -> int:
        """Keys held here that this node is primary of, with a replica not live."""
        cluster = self.cluster
        placement, live, me = cluster.placement, cluster.live, cluster.me.node_id
        count = 0
        for name in cluster.store.table.names():
            if placement.primary(name, live) == me and not all(
                m in live for m in placement.replicas(name)
            ):
                count += 1
        return count

    async def round(self) -> int:
        """One round: hand off what can be handed off now; answer how many keys were dropped."""
        surplus = self.surplus()
        self.moving = len(surplus)
        self.under_replicated = self.count_under_replicated()
        if not surplus:
            return 0
        cluster = self.cluster
        me = cluster.me.node_id
        epoch = cluster.epoch
        after = cluster.pending or cluster.placement
        # Each key's holders to come, and the entries each is to confirm.
        targets: dict[str, list[str]] = {}
        by_member: dict[str, list[Entry]] = {}
        for entry in surplus:
            holders = [m for m in after.replicas(entry.name) if m != me]
            targets[entry.name] = holders
            for m in holders:
                by_member.setdefault(m, []).append(entry)
        confirmed: dict[str, set[str]] = {}
        # (the links up now: one that goes down meanwhile fails its own hand-off)
        up = {
            m: link
            for m in by_member
            if (link := cluster.by_id.get(m)) is not None and link.state == LinkState.UP
        }
        # (stuck: no holder to come is up, or joining: a draining node waits for one
        # that joins, whose link comes up, rather than leave with its keys)
        coming = {m for m, s in cluster.view.states.items() if s in (JOINING, UP)}
        self.stuck = sum(
            1 for e in surplus if not any(m in up or m in coming for m in targets[e.name])
        )
        results = await asyncio.gather(
            *(self._hand_to(link, by_member[m]) for m, link in up.items()),
            return_exceptions=True,
        )
        for m, result in zip(up, results, strict=True):
            if isinstance(result, BaseException):
                log.info("handing keys to %s failed: %s", m, result)
            else:
                confirmed[m] = result
        if cluster.epoch != epoch:
            self.aborted += 1
            log.info(
                "rebalancing round of epoch %d dropped nothing: epoch %d came meanwhile",
                epoch,
                cluster.epoch,
            )
            return 0
        handed = {
            e.name: lww_key(e)
            for e in surplus
            if targets[e.name] and all(e.name in confirmed.get(m, ()) for m in targets[e.name])
        }
        if cluster.state == LEAVING:
            # (kept until it exits: it answers as primary until the others place it no more)
            self.moving = len(surplus) - len(handed)
            return len(handed)
        dropped = await cluster.store.drop(handed)
        self.handed_off += dropped
        self.moving = len(surplus) - dropped
        if dropped:
            log.info(
                "handed off %d keys (%d still to move) at epoch %d",
                dropped,
                self.moving,
                cluster.epoch,
            )
        return dropped

    async def _hand_to(self, link: PeerLink, entries: list[Entry]) -> set[str]:
        """Make sure ``link``'s member holds ``entries`` (or newer): answer the names it does."""
        client = link.proxy()
        held, later = await self._held(client, entries)
        lacking = [e for e in entries if e.name not in held and e.name not in later]
        if lacking:
            link.offer(lacking)
            if not await link.confirm():
                return held
            held |= (await self._held(client, lacking))[0]
        return held

    async def _held(self, client: Any, entries: list[Entry]) -> tuple[set[str], set[str]]:
        """The names of ``entries`` the peer holds at their version here, or newer (see
        :func:`.recovered.covers`); and those not to offer it now: copies from before a
        restart that its later writes cover at lower versions, which the keys' primaries
        did not raise above them yet (see :meth:`.recovered.Recovery.lift_at_primaries`)."""
        held: set[str] = set()
        later: set[str] = set()
        step, table = self.cluster.batch_params, self.cluster.store.table
        for i in range(0, len(entries), step):
            batch = entries[i : i + step]
            request = thrift.DigestRequest(names=[e.name for e in batch], handing=True)
            digest = await client.invoke(METHODS.digest_for, request=request)
            theirs = {d.name: d for d in digest}
            covered = [e for e in batch if (d := theirs.get(e.name)) and covers(table, d, e)]
            if below := {
                e.name: e.version + 1 for e in covered if lww_key(theirs[e.name]) < lww_key(e)
            }:
                raised = await self.cluster.recovery.lift_at_primaries(below)
                later.update(name for name in below if name not in raised)
            held.update(e.name for e in covered if e.name not in later)
        return held, later

    async def drain(self, timeout: float) -> int:
        """Hand off every key (the node is leaving): rounds until none is left, or ``timeout``.

        Answers how many keys were handed off.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        handed = 0
        while True:
            handed = await self.round()
            others = await self.other_rounds()
            if (not self.moving and not others) or loop.time() >= deadline:
                break
            if self.stuck == self.moving and not others:
                break  # nowhere to hand the rest to
            await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
        if self.moving > self.stuck:
            log.warning(
                "%d keys not handed off within %.1f s: their holders to come did not confirm them",
                self.moving - self.stuck,
                timeout,
            )
        if self.stuck:
            log.info(
                "%d keys not handed off: no member that would hold them is up (the cluster "
                "is going away?); they stay with this node",
                self.stuck,
            )
        return handed
