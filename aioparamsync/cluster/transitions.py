"""This node's own changes of state: joining, taking over, leaving, a lease lost.

- Joining (:meth:`Transitions.join`): the node waits until every link that
  answers has pulled what it will hold, then says it is up and takes over as
  the primary of its keys (:meth:`Transitions.take_over`).
- Leaving (:meth:`Transitions.leave`, a drain or SIGTERM): it says so, hands
  every key off (see :mod:`.rebalance`), then says it left.
- With a coordinator, its lease lost (:meth:`Transitions.lease_lost`): it is
  no member; it registers anew, joining, after forgetting what no replica
  confirmed (see :mod:`.fencing`), and joins again.

Each state is told to every member up (an announce) and, with a coordinator,
written to etcd, one write after the other (:meth:`Transitions.published`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from ..errors import ErrorCode, ParamSyncError, RequestError
from ..placement import JOINING, LEAVING, LEFT, LIVE, UP
from ..wire import METHODS
from .links import LinkState, PeerLink

if TYPE_CHECKING:
    from .membership import Cluster

__all__ = ["JOIN_TIMEOUT", "Transitions"]

log = logging.getLogger(__name__)

# The longest a node takes to join (pull what it will hold) before it serves
# anyway (seconds): links that stay unreachable are not waited for.
JOIN_TIMEOUT = 120.0
# How often a node that leaves writes its state to the coordinator again while the
# coordinator cannot be reached (seconds).
PUBLISH_RETRY = 0.5


class Transitions:
    """This node's own changes of state (see the module).

    Args:
        cluster: the cluster whose node this is.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        #: while this node takes over as the primary of its keys (see join): done then
        self.settling: asyncio.Future[None] | None = None
        self._published: asyncio.Future[bool] | None = None  # the last state written to etcd
        self._given_up = False  # (the last state is not written again: see _said)
        self._rejoining: asyncio.Future[None] | None = None  # joining again, its lease lost

    async def stop(self) -> None:
        if self._rejoining is not None:
            self._rejoining.cancel()
            await asyncio.wait({self._rejoining})

    # -- to the coordinator -------------------------------------------------------

    def publish(self, state: str) -> None:
        """Write this node's new state to the coordinator, after the one before it.

        While etcd cannot be reached it is written again, as long as it is this
        node's state and not given up on (see :meth:`_said`).
        """
        self._given_up = False
        self._published = asyncio.ensure_future(self._publish(state, self._published))

    async def _publish(self, state: str, before: asyncio.Future[bool] | None) -> bool:
        if before is not None:
            await asyncio.wait({before})
        cluster = self.cluster
        coordinator = cluster.coordinator
        assert coordinator is not None
        warned = False
        # Written again while etcd cannot be reached and the state still holds: a node
        # whose "up" was never written stays "joining" for the others (placed nowhere).
        while not await coordinator.set_state(state, cluster.claims, cluster.claiming):
            if not warned:
                log.warning("could not write this node's state (%s) to the coordinator", state)
                warned = True
            if cluster.state != state or state == LEFT or self._given_up:
                return False  # (superseded, given up on, or gone: its lease ends it)
            await asyncio.sleep(PUBLISH_RETRY)
        return True

    async def published(self) -> bool:
        """Wait until this node's last state change is written to the coordinator (if any);
        whether it was (True without a coordinator)."""
        published = self._published
        if published is None:
            return True
        await asyncio.wait({published})
        return not published.cancelled() and published.exception() is None and published.result()

    async def _said(self, timeout: float) -> bool:
        """Whether this node's last state is written to the coordinator within
        ``timeout`` s (it is written again while it cannot be: see ``_publish``).

        Past the timeout, it is given up on: no write of it starts again, and the
        one under way, which may still land (etcd back within its call's
        timeout), is waited for: so the answer holds, and no late write says
        what the node no longer is.
        """
        published = self._published
        if published is None:
            return True
        await asyncio.wait({published}, timeout=timeout)
        if not published.done():
            self._given_up = True
        return await self.published()

    # -- the lease ------------------------------------------------------------------

    def lease_lost(self) -> None:
        """This node's lease expired: it is no member now; it joins anew.

        What its outboxes still hold joins the unconfirmed writes, dropped
        before it registers again (see :mod:`.fencing`).
        """
        cluster = self.cluster
        log.warning("node %s lost its lease: it joins again", cluster.me.node_id)
        cluster.state = JOINING
        cluster.claims.clear()  # (its record goes with its lease: it claims nothing now)
        cluster.claiming = {}
        cluster.fencing.take_outboxes()
        cluster.refresh()

    def registered_anew(self) -> None:
        """Registered again (joining): pull what it holds, then serve it."""
        for link in self.cluster.links.values():
            link.pulled = False
            link.repair_soon()
        if self._rejoining is not None:
            self._rejoining.cancel()
        self._rejoining = asyncio.ensure_future(self.join())

    # -- joining ----------------------------------------------------------------------

    async def join(self, timeout: float = JOIN_TIMEOUT) -> None:
        """Joining: wait until every link that answers has pulled what this node will hold.

        Then this node is up (it serves its keys, and the others place it).
        A link that cannot connect is not waited for (it repairs once up);
        past ``timeout`` seconds the node serves anyway, with a warning.
        """
        waiting = await self._pulling(timeout, JOINING)
        if waiting:
            log.warning("joined after %.0f s without pulling from %s", timeout, waiting)
        if self.cluster.state == JOINING:
            # (and the buckets of rows it will hold, whole, from their holders now: by
            # its own view, while it joins, they are named there; once it is up, no
            # longer where this node is their primary. What they fold meanwhile comes
            # too: see take_over)
            try:
                await self.cluster.rebalancer.other_rounds()
            except (ParamSyncError, OSError) as exc:  # (the settle's round tries again)
                log.warning("joining: buckets of rows not pulled (%s)", exc)
        await self.take_over()

    async def _pulling(self, timeout: float, state: str) -> str:
        """Wait (up to ``timeout`` s, while this node is in ``state``) until every link
        that answers has pulled since its ``pulled`` was cleared; answer the links
        still waited for then ("": none)."""
        cluster = self.cluster
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while cluster.state == state:
            # (a link in backoff cannot be reached: not waited for; with a
            # coordinator, the link of a member live there is: it will answer)
            waiting = [
                link
                for link in cluster.links.values()
                if not link.pulled
                and (
                    link.state in (LinkState.UP, LinkState.CONNECTING)
                    or (cluster.coordinator is not None and cluster.seen_state(link) in LIVE)
                )
            ]
            if not waiting:
                return ""
            if loop.time() >= deadline:
                return ", ".join(link.name for link in waiting)
            await asyncio.sleep(0.05)
        return ""

    async def take_over(self) -> None:
        """Say this node is up, and become the primary of its keys once no one else is.

        Until every member up has answered that it knows (each answers once
        it sees the epoch this node is up at, and what it folded as their
        primary before is applied: see the announce handler) and this node has
        pulled what they folded, it folds nothing (:attr:`settling`): two
        primaries of one key at once would each make its next version, and
        last-writer-wins would drop one of the two. With a coordinator the
        epoch is etcd's revision of this node's write: each member sees it on
        its own watch, this node first (it announces that epoch).
        """
        cluster = self.cluster
        settling = self.settling = asyncio.get_running_loop().create_future()
        former = cluster.recovery.former_primaries()  # (by the view before it is up)
        try:
            cluster.set_state(UP)
            if await self.published() and cluster.coordinator is not None:
                await cluster.caught_up(cluster.coordinator.written_revision)
            await self._settle(former)
        finally:
            self.settling = None
            settling.set_result(None)

    async def _settle(self, former: Mapping[str, str]) -> None:
        """Tell every member up what this node now is, and pull what they folded (and
        wrote of the keys it read from its data directory: ``former``, see
        :meth:`.recovered.Recovery.settle`)."""
        cluster = self.cluster
        up = {m: link for m, link in cluster.by_id.items() if link.state == LinkState.UP}
        if up:
            await self.tell_all()
        await cluster.recovery.settle(former, up)
        if up:
            await self._pull_all()
            await cluster.rebalancer.other_rounds()

    # -- claiming (placement balanced by bytes: see .balance) ---------------------------

    async def claim(self, keys: Collection[str], timeout: float = JOIN_TIMEOUT) -> bool:
        """Take ``keys`` over as their primary; answer whether this node did.

        As a member joining, for those keys alone: it says it is claiming them
        (they are replicated to it from then on: they are its in the pending
        placement), pulls from every member up what it will hold, then says it
        claims them and takes over as their primary as :meth:`take_over` does
        (folding nothing until every member up has answered, and it has pulled
        what they folded). A change of membership meanwhile, or a pull that
        fails or takes more than ``timeout`` s, gives the claim up (nothing
        changed: the keys stay where they were).
        """
        cluster = self.cluster
        if not keys or cluster.state != UP or self.settling is not None or cluster.claiming:
            return False
        epoch = cluster.epoch + 1
        members = dict(cluster.view.states)
        taking = cluster.claiming = dict.fromkeys(keys, epoch)
        if not await self._claims_said():
            cluster.claiming = {}
            await self._said_again()  # (it may have been written: its answer lost)
            return False
        cluster.refresh()  # (its pending placement: the keys are this node's)
        await self.tell_all()  # (they replicate to this node what they apply from now on)
        try:
            async with asyncio.timeout(timeout):
                pulled = await self._pull_all()  # (by the pending placement: the keys too)
                # (and the buckets of rows it claims, whole, from their holders now: the
                # bucket moves take them as at a join; what they fold meanwhile comes
                # to this node too, a replica in the pending placement)
                pulled = await cluster.rebalancer.other_rounds() == 0 and pulled
        except TimeoutError:
            pulled = False
        except Exception:  # (a bug: the claim is given up, not left half made)
            log.exception("claim of %d keys given up: its pulls failed", len(keys))
            pulled = False
        changed = dict(cluster.view.states) != members
        beaten = self._beaten(taking)
        if not pulled or changed or beaten or cluster.claiming is not taking or cluster.state != UP:
            if not pulled:
                log.warning("claim of %d keys given up: not pulled from every member", len(keys))
            elif beaten:
                log.info("claim of %d keys given up: %s", len(keys), beaten)
            if cluster.claiming is taking:
                cluster.claiming = {}
                await self._said_again()  # (the others replicate to it until they see it)
                cluster.refresh()
                await self.tell_all()
            return False
        settling = self.settling = asyncio.get_running_loop().create_future()
        try:
            cluster.claims.update(taking)
            cluster.claiming = {}
            if not await self._claims_said():
                # (etcd did not take it, or did and its answer was lost: taken back, so
                # the keys stay where they were, for every node)
                await self._take_back(taking)
                return False
            cluster.refresh()
            log.info(
                "node %s claims %d keys (%d in all), at epoch %d",
                cluster.me.node_id, len(taking), len(cluster.claims), epoch,
            )  # fmt: skip
            await self._settle({})
        finally:
            self.settling = None
            settling.set_result(None)
        return True

    def _beaten(self, taking: Mapping[str, int]) -> str:
        """Whose claim of one of ``taking``'s keys, made or being made, wins over this
        node's ("": none's).

        Two members may claim one key at once (each ran its round before it saw the
        other's). Of two claims the later wins, then the smaller member id (see
        :func:`~aioparamsync.placement.claims_of`): the one that would lose gives its
        claim up before it takes any key over, rather than be the keys' primary until
        it sees the other claim win.
        """
        cluster = self.cluster
        me = cluster.me.node_id
        view = cluster.view
        for said in (view.claims, view.claiming):
            for member, keys in said.items():
                if member == me:
                    continue
                for key, epoch in keys.items():
                    mine = taking.get(key)
                    if mine is not None and (epoch > mine or (epoch == mine and member < me)):
                        return f"{member} claims {key!r} too, at epoch {epoch}"
        return ""

    async def _take_back(self, taking: Collection[str]) -> None:
        """Take back a claim whose write failed: etcd may still have applied it (the
        answer was lost), and every node but this one would then place the keys here.
        Written again until etcd answers, while this node is up and settling (it folds
        nothing meanwhile); once etcd answers, the write lands, or finds the key changed
        under it and the node registers anew (its record rewritten, claiming nothing)."""
        cluster = self.cluster
        for key in taking:
            cluster.claims.pop(key, None)
        await self._said_again()
        cluster.refresh()

    async def _said_again(self) -> None:
        """:meth:`_claims_said`, again until it is, while this node is up (its lease
        lost, its record goes, claims and all)."""
        while not await self._claims_said():
            if self.cluster.state != UP:
                break
            await asyncio.sleep(PUBLISH_RETRY)

    async def _claims_said(self) -> bool:
        """With a coordinator: write what this node claims and is claiming into its record,
        and wait until its own view has it (every node sees it at that revision, its
        epoch); whether it did. Without one, announces carry claims: True."""
        cluster = self.cluster
        coordinator = cluster.coordinator
        if coordinator is None:
            return True
        if not await coordinator.set_state(cluster.state, cluster.claims, cluster.claiming):
            log.info("claims not written to the coordinator: the keys stay where they are")
            return False
        return await cluster.caught_up(coordinator.written_revision)

    async def _pull_all(self) -> bool:
        """Pull from every member up what it holds newer than this node, now; answer
        whether every pull succeeded."""
        links = [link for link in self.cluster.links.values() if link.state == LinkState.UP]
        results = await asyncio.gather(*(link.pull() for link in links), return_exceptions=True)
        for link, result in zip(links, results, strict=True):
            if isinstance(result, Exception):
                log.warning("could not pull from %s as this node took over: %s", link.name, result)
        return all(result is True for result in results)

    # -- leaving ----------------------------------------------------------------------

    async def leave(self, timeout: float) -> int:
        """A planned leave: say so, hand every key off (up to ``timeout`` s), say it left.

        Answers how many keys the others confirmed. The node keeps serving
        meanwhile (its keys are its own until the others place it no more).
        """
        cluster = self.cluster
        if cluster.state not in (UP, JOINING):
            return 0
        if not any(link.state == LinkState.UP for link in cluster.links.values()):
            cluster.set_state(LEFT)  # (no one to hand anything to)
            return 0
        cluster.set_state(LEAVING)
        if not await self._said(timeout):
            # The others never saw it leave (placement is etcd's): it hands nothing
            # off, so it keeps its keys, and stays.
            cluster.set_state(UP)  # (written to etcd once it answers: see _publish)
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"node {cluster.me.node_id} could not tell the coordinator it leaves within "
                f"{timeout:.0f} s: it stays, holding its keys (leaving now could lose the only "
                "copies of them); drain it again once the coordinator answers",
            )
        if cluster.coordinator is not None:  # (its own view says it leaves: what it hands off)
            await cluster.caught_up(cluster.coordinator.written_revision)
        await self.tell_all()  # (they must know before what it hands them)
        handed = await cluster.rebalancer.drain(timeout)
        cluster.set_state(LEFT)
        await self.published()
        await self.tell_all()
        return handed

    async def tell_all(self) -> None:
        """Announce this node to every member up, now, and wait for their answers."""
        cluster = self.cluster
        member = cluster.announces.announcement()

        async def tell(link: PeerLink) -> None:
            members = await link.proxy().invoke(METHODS.announce, member=member)
            if members and cluster.announces.refusal(members[0]) is None:  # (refused: its link)
                cluster.announces.said(link, members[0])

        links = [link for link in cluster.links.values() if link.state == LinkState.UP]
        results = await asyncio.gather(*(tell(link) for link in links), return_exceptions=True)
        for link, result in zip(links, results, strict=True):
            if isinstance(result, Exception):
                log.info(
                    "could not tell %s that this node is %s: %s", link.name, cluster.state, result
                )
        cluster.refresh()
