"""Membership: the :class:`Cluster`, this node's set of peer links, and who it is.

A link's first call announces this node to its peer, which adds it to its
own links and answers the members it knows; any member new to this node gets
a link too. So a node started with one live member joins the whole cluster.
A member that announces itself under another address moved: its link
follows it. A link that reaches this node itself, or a member another link
reaches already, is dropped. A peer that cannot be reached is retried with
capped exponential backoff, forever (see :mod:`.links`); it is never
forgotten (unless it said it left), and its state is in ``info``; while its
link is down it is primary of nothing (see :meth:`Cluster.owner`), and past
the failure timeout it holds nothing (see the class's topology).

While no link is up (say, none of the ``--peers`` a node started with
answers), the node says so at WARNING after ``unreachable_warning`` seconds,
then every ``UNREACHABLE_REPEAT`` seconds, not at every retry; when a peer
answers again, an INFO line says which. Every ``STATS_LOG_SECONDS`` the node
logs each link's state and counters.

The cluster sees the store only through its feed of applied updates: each
update applied for a client is offered to the links of the other replicas of
its parameters (those of the pending placement too, while members join or
leave); updates that came from a peer are not sent on (the node that applied
them first sends them to every replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, RequestError
from ..placement import (
    DEFAULT_REPLICATION_FACTOR,
    DOWN,
    FAILED,
    JOINING,
    LEAVING,
    LEFT,
    LIVE,
    PLACED,
    SELF_STATES,
    UP,
    Placement,
)
from ..store.table import Entry, Limits, lww_key
from ..values import pieces
from ..wire import DEFAULT_MAX_FRAME_BYTES, METHODS, thrift
from .links import (
    BATCH_BYTES,
    BATCH_PARAMS,
    DEFAULT_REPAIR_INTERVAL,
    PEER_CALL_TIMEOUT,
    LinkState,
    PeerLink,
)
from .rebalance import Rebalancer

if TYPE_CHECKING:
    from ..store.writer import ParameterStore
    from .coordinator import EtcdCoordinator

__all__ = ["Cluster"]

log = logging.getLogger(__name__)

# How often the node logs each peer link's state and counters (seconds).
STATS_LOG_SECONDS = 60.0
# How long no peer may fail to answer before the node warns (seconds; see
# Cluster), and how often it warns again while none answers.
UNREACHABLE_WARNING = 10.0
UNREACHABLE_REPEAT = 60.0
# Most peers one such warning names (the others are counted).
UNREACHABLE_NAMED = 5
# How long a member may not answer before it leaves placement and its keys
# are re-replicated by the others (seconds).
DEFAULT_FAILURE_TIMEOUT = 30.0
# The longest a node takes to join (pull what it will hold) before it serves
# anyway (seconds): links that stay unreachable are not waited for.
JOIN_TIMEOUT = 120.0
# How long an acks=all write waits for its replicas to confirm (seconds).
ACK_TIMEOUT = 2 * PEER_CALL_TIMEOUT
ACKS = ("1", "all")


class Cluster:
    """This node's view of its cluster: its links, and who it is.

    Args:
        store: the node's store (its feed of applied updates drives the fan-out).
        me: this node as its peers reach it (``thrift.Member``).
        repair_interval: seconds between anti-entropy rounds with each peer.
        ssl: the ``ssl.SSLContext`` links connect with (None: plain TCP).
        limits: this node's limits of one request (default: ``Limits()``).
        max_frame_bytes: the largest frame this node accepts.
        unreachable_warning: warn when no peer has answered for this long
            (seconds), then every ``UNREACHABLE_REPEAT`` seconds while none
            answers; None: never.

    The messages links send, and the pulls they make, are cut to this node's
    limits and frame size: the members of a cluster are assumed to run with
    the same ones, so what this node would take, its peers take too. (A peer
    with lower limits refuses them: a oneway update is then lost until a
    repair, and a pull fails and is retried.)

    Topology. Each member is in one of the states of ``TopologyMember.state``:
    what it says of itself when it announces (joining, up, leaving, left),
    and, for one that says it is up or leaving, what this node sees of its
    link: down (its link is not up), failed (down longer than
    ``failure_timeout``). The members up, leaving or down are placed
    (:class:`~aioparamsync.placement.Placement`); the primary of a key is the
    first of its replicas that is up or leaving. While members join or
    leave, :attr:`pending` is the placement once they have: writes
    replicate to the replicas of both, the members joining pull what they
    will hold, those leaving hand theirs off (see :mod:`.rebalance`), and
    only then does the member say so, and placement changes. Every change
    of that view bumps the
    ``epoch``; a member that says a larger epoch than this node's is
    adopted (so epochs only grow, cluster-wide, as Redis Cluster's
    configEpoch); :attr:`changed` wakes the rebalancer.

    Args (topology):
        replication_factor: how many members hold each key (None: every one).
        failure_timeout: seconds a member may be down before it leaves placement.
        acks: "1" or "all": when a write is answered, unless it says.
        coordinator: an :class:`~.coordinator.EtcdCoordinator` (None: the
            members decide among themselves, as above).

    With a coordinator, the members and their states are etcd's (see
    :mod:`.coordinator`): a member is live while its lease is, whatever this
    node's link to it does, and the epoch is etcd's revision of the members.
    Peers' announces no longer change the view (links still carry the
    replication, repairs and calls passed on). A write with ``acks=all`` is
    refused before it is applied when a live replica cannot be reached from
    here; a write that was applied but not confirmed is remembered
    (:attr:`unconfirmed`), and dropped if this node loses its lease, before
    it registers anew, with what its outboxes still hold (writes that never
    reached those replicas): so none can win, by last-writer-wins, over a
    write the others acknowledged meanwhile. Replication from, and repairs with, a
    member not live in etcd are ignored for the same reason.
    """

    def __init__(
        self,
        store: ParameterStore,
        me: Any,
        *,
        repair_interval: float = DEFAULT_REPAIR_INTERVAL,
        ssl: Any = None,
        limits: Limits | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        unreachable_warning: float | None = UNREACHABLE_WARNING,
        replication_factor: int | None = DEFAULT_REPLICATION_FACTOR,
        failure_timeout: float = DEFAULT_FAILURE_TIMEOUT,
        acks: str = "1",
        coordinator: EtcdCoordinator | None = None,
    ) -> None:
        if replication_factor is not None and replication_factor < 1:
            raise ValueError(f"replication_factor must be at least 1, not {replication_factor}")
        if acks not in ACKS:
            raise ValueError(f"acks must be one of {', '.join(ACKS)}, not {acks!r}")
        if not failure_timeout > 0:
            raise ValueError(f"failure_timeout must be above 0, not {failure_timeout}")
        self.store = store
        self.me = me
        self.replication_factor = replication_factor
        self.failure_timeout = failure_timeout
        self.acks = acks
        #: this node's own state (see the class's docstring)
        self.state = UP
        self.epoch = 0
        self.placement = Placement([], replication_factor)
        #: the placement once the members joining or leaving now have (None: none is)
        self.pending: Placement | None = None
        #: the ids of the members up (this node too, while it is up)
        self.live: frozenset[str] = frozenset()
        self.by_id: dict[str, PeerLink] = {}
        self._view: Any = None  # what the epoch was last bumped for
        #: while this node takes over as the primary of its keys (see join): done then
        self.settling: asyncio.Future[None] | None = None
        #: set at every new epoch (the rebalancer clears it)
        self.changed = asyncio.Event()
        self._departed: set[str] = set()  # ids of members that left (not learned again)
        self._ticker: asyncio.Task[None] | None = None
        self.rebalancer = Rebalancer(self)
        self.repair_interval = repair_interval
        self.ssl = ssl
        limits = limits or Limits()
        # A batch is one broadcast_update (parameters in one update) or one
        # pull (names in one request).
        self.batch_params = max(
            1, min(BATCH_PARAMS, limits.max_params_per_update, limits.max_names_per_request)
        )
        # Half a frame: the rest leaves room for the message's header and for
        # PARAM_OVERHEAD's estimate being short (long names need frames well
        # above the smallest, 1 KiB). A parameter over inline_bytes goes in
        # pieces of piece_bytes (both at most half a frame, too).
        frame = max(1, max_frame_bytes // 2)
        self.batch_bytes = min(BATCH_BYTES, frame)
        self.inline_bytes = min(pieces.INLINE_BYTES, frame)
        self.piece_bytes = min(pieces.PIECE_BYTES, frame)
        self.links: dict[str, PeerLink] = {}  # by address
        self._started = False
        self._reporter: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Future[None]] = set()  # links being stopped
        # Links known and none up: since when (time.monotonic()), and when the
        # node last warned of it (see _watch_alone).
        self.unreachable_warning = unreachable_warning
        self._alone_since: float | None = None
        self._alone_warned: float | None = None
        self._alone_changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        store.subscribe(self._applied)
        self.coordinator = coordinator
        #: writes applied here whose replicas did not confirm them (name -> lww key)
        self.unconfirmed: dict[str, tuple[int, str]] = {}
        self._published: asyncio.Future[None] | None = None  # the last state written to etcd
        self._rejoining: asyncio.Future[None] | None = None  # joining again, its lease lost
        if coordinator is not None:
            coordinator.on_change = self._coordinated
            coordinator.on_lost = self._lease_lost
            coordinator.before_register = self._forget_unconfirmed
            coordinator.on_registered = self._registered_anew

    def __repr__(self) -> str:
        up = sum(1 for link in self.links.values() if link.state == LinkState.UP)
        return f"<Cluster {self.me.node_id} [{up} of {len(self.links)} peers up]>"

    def start(self, seeds: Iterable[tuple[str, int]] = ()) -> None:
        self._started = True
        for host, port in seeds:
            self.add(host, port)
        coordinator = self.coordinator
        if coordinator is not None:
            self._coordinated()
            self.state = JOINING  # (as it registered)
            if not any(m != self.me.node_id for m in coordinator.members):
                self.set_state(UP)  # the first member: nothing to pull
        elif self.links:
            self.state = JOINING  # until it holds what it will (see join)
        for link in self.links.values():
            if link.task is None:
                link.start()
        self.refresh()
        self._reporter = asyncio.create_task(self._report(), name="aioparamsync-peer-stats")
        self._ticker = asyncio.create_task(self._tick(), name="aioparamsync-peer-failures")
        self.rebalancer.start()
        if self.unreachable_warning is not None:
            self._watcher = asyncio.create_task(self._watch_alone(), name="aioparamsync-peer-watch")

    async def drain(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until every link that is up has sent its outbox.

        Links that are down cannot drain: anti-entropy will repair those peers.
        Answers whether everything was sent.
        """
        waits = [
            asyncio.ensure_future(link.drained.wait())
            for link in self.links.values()
            if link.state == LinkState.UP and not link.drained.is_set()
        ]
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout)
        for wait in pending:
            wait.cancel()
        if pending:
            late = [
                link.name
                for link in self.links.values()
                if link.state == LinkState.UP and not link.drained.is_set()
            ]
            log.warning(
                "%d peer outboxes not drained within %.1f s: %s",
                len(pending),
                timeout,
                ", ".join(late) or "(their links went down meanwhile)",
            )
        return not pending

    async def stop(self) -> None:
        self._started = False
        await self.rebalancer.stop()
        for task in (self._reporter, self._watcher, self._ticker, self._rejoining):
            if task is not None:
                task.cancel()
                await asyncio.wait({task})
        await asyncio.gather(*(link.stop() for link in self.links.values()))

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(STATS_LOG_SECONDS)
            for link in self.links.values():
                s = link.statistics()
                log.info(
                    "peer %s: %s, outbox %d, sent %d, coalesced %d, failures %d, "
                    "lag %.3f s, repaired %d",
                    link.name,
                    s["state"],
                    s["outbox_depth"],
                    s["updates_sent"],
                    s["updates_coalesced"],
                    s["send_failures"],
                    s["lag_seconds"],
                    s["repaired"],
                )

    # -- is any peer answering? ---------------------------------------------------

    def links_changed(self) -> None:
        """A link changed state, or came or went: is there still a peer that answers?"""
        self.refresh()
        links = self.links.values()
        up = next((link for link in links if link.state == LinkState.UP), None)
        alone = bool(self.links) and up is None
        if alone and self._alone_since is None:
            self._alone_since = time.monotonic()
            self._alone_changed.set()
        elif not alone and self._alone_since is not None:
            if self._alone_warned is not None and up is not None:
                log.info(
                    "peer %s answers, after %.1f s with no peer answering",
                    up.name,
                    time.monotonic() - self._alone_since,
                )
            self._alone_since = self._alone_warned = None
            self._alone_changed.set()

    async def _watch_alone(self) -> None:
        """Warn while links are known and none is up.

        First ``unreachable_warning`` seconds after the last link went down
        (or since the start, for seeds that never answered), then every
        ``UNREACHABLE_REPEAT`` seconds: a line per minute, not per retry.
        """
        assert self.unreachable_warning is not None
        while True:
            self._alone_changed.clear()
            since = self._alone_since
            if since is None:
                await self._alone_changed.wait()
                continue
            if self._alone_warned is None:
                due = since + self.unreachable_warning
            else:
                due = self._alone_warned + UNREACHABLE_REPEAT
            delay = due - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._alone_changed.wait()
                continue
            self._alone_warned = time.monotonic()
            links = list(self.links.values())
            tried = [
                f"{link.name} ({link.last_error or 'no answer yet'})"
                for link in links[:UNREACHABLE_NAMED]
            ]
            if len(links) > UNREACHABLE_NAMED:
                tried.append(f"and {len(links) - UNREACHABLE_NAMED} more")
            log.warning(
                "no peer has answered for %.1f s; tried %s; retrying (this node serves "
                "alone meanwhile; check the addresses, and that the peers run and can be reached)",
                self._alone_warned - since,
                ", ".join(tried),
            )

    # -- members ------------------------------------------------------------------

    def add(
        self, host: str, port: int, node_id: str = "", *, itself: bool = False
    ) -> PeerLink | None:
        """Add a member (nothing if it is this node or already known).

        Args:
            itself: the member says so itself (it announced): where it is known
                under another address, it moved there, and its link follows it.
        """
        if node_id == self.me.node_id or (host, port) == (self.me.host, self.me.port):
            return None
        address = f"{host}:{port}"
        link = self.links.get(address)
        if link is None:
            moved = next((o for o in self.links.values() if node_id and o.node_id == node_id), None)
            if moved is not None:
                if not itself:
                    return None  # known under another address; only it can say it moved
                self._relink(moved, address)
            link = self.links[address] = PeerLink(self, host, port, node_id)
            if moved is None:
                log.info("member %s added", link.name)
            else:
                link.offer(moved.outbox.values(), taken_back=True)
            if self._started:
                link.start()
            self.links_changed()
        else:
            if node_id and not link.node_id:
                link.node_id = node_id
            if itself:
                link.poke()
        return link

    def _relink(self, old: PeerLink, address: str) -> None:
        """Drop the link to a member's old address (it announced ``address``)."""
        del self.links[old.address]
        log.info("member %s moved to %s", old.name, address)
        task = asyncio.ensure_future(old.stop())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def redundant(self, link: PeerLink) -> bool:
        """Drop a link that reached this node itself, or a node another link reaches."""
        if link.node_id == self.me.node_id:
            reaches = "this node itself"
        else:
            other = next(
                (o for o in self.links.values() if o is not link and o.node_id == link.node_id),
                None,
            )
            if other is None:
                return False
            reaches = f"{other.name}, linked already"
        self.links.pop(link.address, None)
        log.info("link to %s dropped: it reaches %s", link.address, reaches)
        self.links_changed()
        return True

    def learn(self, members: Sequence[Any], peer: PeerLink | None = None) -> None:
        """Members a peer answered (``peer``: the link it answered on; it is the first)."""
        if self.coordinator is not None:
            return  # (the members are etcd's)
        for i, member in enumerate(members):
            if i == 0 and peer is not None:
                self._said(peer, member)
            elif member.node_id not in self._departed:
                link = self.add(member.host, member.port, member.node_id)
                if link is not None and link.member_state is None and member.state:
                    # (what it said of itself to the peer: until it tells this node)
                    link.member_state = member.state if member.state in SELF_STATES else UP
        self.refresh()

    def _said(self, link: PeerLink, member: Any) -> None:
        """What a member said of itself (its state, its epoch), directly.

        A member bumps its epoch whenever its own state changes, before it
        says so: of two of its reports, the one with the smaller epoch is the
        older (an answer to an announce can arrive after the member's next
        announce, on another connection), and changes nothing.
        """
        if self.coordinator is not None:
            return  # (the members are etcd's)
        if member.epoch is not None:
            if link.said_epoch is not None and member.epoch < link.said_epoch:
                return
            link.said_epoch = member.epoch
        state = member.state if member.state in SELF_STATES else UP  # (a node of old: up)
        if link.member_state != state:
            link.member_state = state
            if state == LEFT:
                self._departed.add(member.node_id)
                log.info("member %s left the cluster", link.name)
        if state != LEFT:
            self._departed.discard(member.node_id)
        if member.epoch is not None and member.epoch > self.epoch:
            self.epoch = member.epoch

    def holds_here(self, key: str) -> bool:
        """Whether this node is a replica of ``key``, now or in the pending placement."""
        me = self.me.node_id
        pending = self.pending
        return self.placement.holds(me, key) or (pending is not None and pending.holds(me, key))

    def owner(self, key: str, excluding: frozenset[str] = frozenset()) -> PeerLink | None:
        """The primary of ``key`` (it folds its gradients, holds its barrier): a link,
        or None for this node (also when no replica is up). ``excluding``: members
        not to count as live (they could not be reached)."""
        live = self.live - excluding if excluding else self.live
        primary = self.placement.primary(key, live)
        if primary is None or primary == self.me.node_id:
            return None
        return self.by_id.get(primary)

    def announcement(self) -> Any:
        """This node as it announces itself: where it is, its state and epoch."""
        me = self.me
        return thrift.Member(
            node_id=me.node_id, host=me.host, port=me.port, state=self.state, epoch=self.epoch
        )

    def members(self) -> list[Any]:
        """Every member known, this node first."""
        known = [
            thrift.Member(
                node_id=link.node_id,
                host=link.host,
                port=link.port,
                state=link.member_state or UP,
            )
            for link in self.links.values()
            if link.node_id
        ]
        return [self.announcement(), *known]

    def announced(self, member: Any) -> list[Any]:
        """A peer announced itself: add it; answer the members this node knows."""
        if not member.node_id or not member.host or not 0 < member.port < 65536:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"a member needs an id, a host and a port: {member}"
            )
        if member.state is not None and member.state not in SELF_STATES:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"a member's state is one of {', '.join(sorted(SELF_STATES))}, not "
                f"{member.state!r}",
            )
        link = self.add(member.host, member.port, member.node_id, itself=True)
        if link is not None:
            self._said(link, member)
        self.refresh()
        return self.members()

    # -- the topology -------------------------------------------------------------

    def seen_state(self, link: PeerLink) -> str:
        """A member's state as this node sees it (see the class's docstring)."""
        if self.coordinator is not None:
            record = self.coordinator.members.get(link.node_id)
            return record.state if record is not None else FAILED
        said = link.member_state or UP
        if said not in (UP, LEAVING):
            return said
        if link.state == LinkState.UP:
            return said
        if time.monotonic() - link.down_since > self.failure_timeout:
            return FAILED
        return DOWN

    def refresh(self) -> None:
        """Recompute the view; a change bumps the epoch and sets :attr:`changed`."""
        me = self.me.node_id
        if not me:
            return  # (not started: who this node is is not known yet)
        coordinator = self.coordinator
        if coordinator is not None and not coordinator.revision:
            return  # (etcd not read yet)
        states = {me: self.state}
        if coordinator is not None:  # (this node too, as etcd has it: one view for all)
            record = coordinator.members.get(me)
            states[me] = record.state if record is not None else FAILED
        by_id = {}
        for link in self.links.values():
            if link.node_id and link.node_id != me:
                states[link.node_id] = self.seen_state(link)
                by_id[link.node_id] = link
        self.by_id = by_id
        view = (tuple(sorted(states.items())), self.replication_factor)
        if view == self._view:
            if coordinator is not None and coordinator.revision > self.epoch:
                self.epoch = coordinator.revision  # (a change, and its undoing: the same view)
            return
        before = dict(self._view[0]) if self._view else {}  # (for the log line's level)
        self._view = view
        placed = [m for m, s in states.items() if s in PLACED]
        placement = Placement(placed, self.replication_factor)
        if placement != self.placement:
            self.placement = placement
        # Members joining or leaving: the placement once they have (see rebalance).
        said = {m: link.member_state for m, link in by_id.items()}
        said[me] = states[me] if coordinator is not None else self.state
        joining = [m for m, s in states.items() if s == JOINING]
        leaving = {m for m in placed if said.get(m) == LEAVING}
        if joining or leaving:
            after = [m for m in placed if m not in leaving] + joining
            self.pending = Placement(after, self.replication_factor)
        else:
            self.pending = None
        self.live = frozenset(m for m, s in states.items() if s in LIVE)
        if coordinator is not None:
            self.epoch = max(self.epoch, coordinator.revision)  # (etcd's)
        else:
            self.epoch += 1
        # (a member live before and down now, or down before and failed now: a WARNING)
        lost = any(
            s in (DOWN, FAILED) and (before.get(m) in LIVE or (s, before.get(m)) == (FAILED, DOWN))
            for m, s in states.items()
        )
        log.log(
            logging.WARNING if lost else logging.INFO,
            "epoch %d: %s (R=%s)",
            self.epoch,
            ", ".join(f"{m} {s}" for m, s in sorted(states.items())),
            self.replication_factor or "all",
        )
        for link in self.links.values():
            link.repair_soon()
        self.changed.set()

    async def _tick(self) -> None:
        """Notice members down longer than the failure timeout (the view changes then)."""
        period = min(1.0, self.failure_timeout / 4)
        while True:
            await asyncio.sleep(period)
            self.refresh()

    def set_state(self, state: str) -> None:
        """This node's own state changed: the view, and every peer, is told."""
        if state == self.state:
            return
        log.info("node %s is %s", self.me.node_id, state)
        self.state = state
        if self.coordinator is not None:
            self._published = asyncio.ensure_future(self._publish(state, self._published))
        self.refresh()
        for link in self.links.values():
            link.announce_soon()

    # -- with a coordinator -------------------------------------------------------

    async def _publish(self, state: str, before: asyncio.Future[None] | None) -> None:
        """Write this node's state to etcd, after the one before it."""
        if before is not None:
            await asyncio.wait({before})
        assert self.coordinator is not None
        if not await self.coordinator.set_state(state):
            log.warning("could not write this node's state (%s) to the coordinator", state)

    async def published(self) -> None:
        """Wait until this node's last state change is written to the coordinator (if any)."""
        if self._published is not None:
            await asyncio.wait({self._published})

    def _coordinated(self) -> None:
        """The members in etcd changed: a link to each, their states; the view."""
        coordinator = self.coordinator
        assert coordinator is not None
        me = self.me.node_id
        for node_id, record in coordinator.members.items():
            if node_id == me or not me:
                continue
            link = self.add(record.host, record.port, node_id, itself=True)
            if link is not None:
                link.member_state = record.state
        self.refresh()

    def fenced(self) -> str | None:
        """Why this node may take no writes now (None: it may; see :mod:`.coordinator`)."""
        return self.coordinator.fenced() if self.coordinator is not None else None

    def trusted(self, node_id: str | None) -> bool:
        """Whether what ``node_id`` sends is taken (with a coordinator: while it is a
        member there, its lease alive or registered anew; without: always)."""
        coordinator = self.coordinator
        if coordinator is None or node_id is None:
            return True
        return node_id in coordinator.members

    def check_writable(self, names: Iterable[str], acks: str) -> None:
        """Refuse (UNAVAILABLE) a write this node may not take now, before it is applied.

        With a coordinator: while its lease is not renewed (it is fenced);
        with ``acks=all``, while a live replica of ``names`` cannot be reached
        from here (the write could not be confirmed).
        """
        if self.coordinator is None:
            return
        why = self.coordinator.fenced()
        if why is not None:
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"node {self.me.node_id} takes no writes: {why}; nothing was applied "
                "(reads go on; another node takes its keys if its lease expires)",
                epoch=self.epoch,
            )
        if acks == "all":
            cut = self._unreachable([n for n in names if self.holds_here(n)])
            if cut:
                raise RequestError(
                    ErrorCode.UNAVAILABLE,
                    f"replicas {', '.join(sorted(cut))} are members but cannot be reached from "
                    f"{self.me.node_id}: nothing was applied (acks=all); try again",
                    epoch=self.epoch,
                )

    def _unreachable(self, names: Iterable[str]) -> set[str]:
        """The live replicas of ``names`` (other than this node) whose links are not up."""
        placement, me, live = self.placement, self.me.node_id, self.live
        members: set[str] = set()
        if placement.everywhere:
            members.update(placement.members)
        else:
            for name in names:
                members.update(placement.replicas(name))
        return {
            m
            for m in members & live
            if m != me and ((link := self.by_id.get(m)) is None or link.state != LinkState.UP)
        }

    def _lease_lost(self) -> None:
        """This node's lease expired: it is no member now; it joins anew.

        What its outboxes still hold never reached those replicas (it was
        fenced for half a TTL: a link that was up has sent it all): writes
        applied here while cut off, acknowledged with ``acks=1`` at most.
        They join the unconfirmed ones, dropped before it registers again.
        """
        log.warning("node %s lost its lease: it joins again", self.me.node_id)
        self.state = JOINING
        self._take_outboxes()
        self.refresh()

    def _take_outboxes(self) -> None:
        """Empty every link's outbox, unsent, into :attr:`unconfirmed`."""
        unconfirmed = self.unconfirmed
        for link in self.links.values():
            for name, key in link.discard().items():
                if name not in unconfirmed or unconfirmed[name] < key:
                    unconfirmed[name] = key

    async def _forget_unconfirmed(self) -> None:
        """Before registering anew: drop the writes applied here that no replica confirmed."""
        self._take_outboxes()  # (offered since: a send that failed)
        held, self.unconfirmed = self.unconfirmed, {}
        if held:
            dropped = await self.store.drop(held)
            log.warning(
                "dropped %d writes applied here that its replicas did not confirm (the "
                "others' copies are pulled instead)",
                dropped,
            )

    def _registered_anew(self) -> None:
        """Registered again (joining): pull what it holds, then serve it."""
        for link in self.links.values():
            link.pulled = False
            link.repair_soon()
        if self._rejoining is not None:
            self._rejoining.cancel()
        self._rejoining = asyncio.ensure_future(self.join())

    async def leave(self, timeout: float) -> int:
        """A planned leave: say so, hand every key off (up to ``timeout`` s), say it left.

        Answers how many keys the others confirmed. The node keeps serving
        meanwhile (its keys are its own until the others place it no more).
        """
        if self.state not in (UP, JOINING):
            return 0
        if not any(link.state == LinkState.UP for link in self.links.values()):
            self.set_state(LEFT)  # (no one to hand anything to)
            return 0
        self.set_state(LEAVING)
        await self.published()
        await self._tell_all()  # (they must know before what it hands them)
        handed = await self.rebalancer.drain(timeout)
        self.set_state(LEFT)
        await self.published()
        await self._tell_all()
        return handed

    async def _tell_all(self) -> None:
        """Announce this node to every member up, now, and wait for their answers."""
        member = self.announcement()

        async def tell(link: PeerLink) -> None:
            members = await link.proxy().invoke(METHODS.announce, member=member)
            if members:
                self._said(link, members[0])

        links = [link for link in self.links.values() if link.state == LinkState.UP]
        results = await asyncio.gather(*(tell(link) for link in links), return_exceptions=True)
        for link, result in zip(links, results, strict=True):
            if isinstance(result, Exception):
                log.info(
                    "could not tell %s that this node is %s: %s", link.name, self.state, result
                )
        self.refresh()

    def topology(self) -> Any:
        """The cluster as this node sees it (the IDL's ``Topology``)."""
        me = self.me
        members = [
            thrift.TopologyMember(node_id=me.node_id, host=me.host, port=me.port, state=self.state)
        ]
        members += [
            thrift.TopologyMember(
                node_id=link.node_id, host=link.host, port=link.port, state=self.seen_state(link)
            )
            for link in self.links.values()
            if link.node_id
        ]
        return thrift.Topology(
            epoch=self.epoch,
            members=members,
            replication_factor=self.replication_factor or 0,
            partition_bytes=0,  # (the node's service answers its own: see server.handlers)
        )

    async def join(self, timeout: float = JOIN_TIMEOUT) -> None:
        """Joining: wait until every link that answers has pulled what this node will hold.

        Then this node is up (it serves its keys, and the others place it).
        A link that cannot connect is not waited for (it repairs once up);
        past ``timeout`` seconds the node serves anyway, with a warning.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.state == JOINING:
            # (a link in backoff cannot be reached: not waited for; with a
            # coordinator, the link of a member live there is: it will answer)
            waiting = [
                link
                for link in self.links.values()
                if not link.pulled
                and (
                    link.state in (LinkState.UP, LinkState.CONNECTING)
                    or (self.coordinator is not None and self.seen_state(link) in LIVE)
                )
            ]
            if not waiting:
                break
            if loop.time() >= deadline:
                log.warning(
                    "joined after %.0f s without pulling from %s",
                    timeout,
                    ", ".join(link.name for link in waiting),
                )
                break
            await asyncio.sleep(0.05)
        await self._take_over()

    async def _take_over(self) -> None:
        """Say this node is up, and become the primary of its keys once no one else is.

        Until every member up has answered that it knows (each answers once
        what it folded as their primary is applied: see the announce handler)
        and this node has pulled what they folded, it folds nothing
        (:attr:`settling`): two primaries of one key at once would each make
        its next version, and last-writer-wins would drop one of the two.
        """
        settling = self.settling = asyncio.get_running_loop().create_future()
        try:
            self.set_state(UP)
            await self.published()
            if any(link.state == LinkState.UP for link in self.links.values()):
                await self._tell_all()
                await self._pull_all()
                await self.rebalancer.other_rounds()
        finally:
            self.settling = None
            settling.set_result(None)

    async def _pull_all(self) -> None:
        """Pull from every member up what it holds newer than this node, now."""
        links = [link for link in self.links.values() if link.state == LinkState.UP]
        results = await asyncio.gather(*(link.pull() for link in links), return_exceptions=True)
        for link, result in zip(links, results, strict=True):
            if isinstance(result, Exception):
                log.warning("could not pull from %s as this node took over: %s", link.name, result)

    # -- the store's feed ---------------------------------------------------------

    def _applied(self, entries: Sequence[Entry], replicated: bool) -> None:
        if replicated:
            return  # its origin sends it to every replica
        placement = self.placement
        if placement.everywhere and self.pending is None:
            for link in self.links.values():
                if link.member_state in (None, UP, JOINING) and link.state != LinkState.DROPPED:
                    link.offer(entries)
            return
        by_id, me, pending = self.by_id, self.me.node_id, self.pending
        for entry in entries:
            targets = placement.replicas(entry.name)
            if pending is not None:  # (members joining get what they will hold)
                targets = (*targets, *pending.replicas(entry.name))
            for member in set(targets):
                if member != me and (peer := by_id.get(member)) is not None:
                    peer.offer((entry,))

    def replica_links(self, names: Iterable[str]) -> set[PeerLink]:
        """The links up, to members other than this node that hold any of ``names`` (or
        will: members joining)."""
        placement, me, pending = self.placement, self.me.node_id, self.pending
        names = list(names)
        members: set[str] = set()
        for view in (placement, pending):  # (members joining get what they will hold)
            if view is None:
                continue
            if view.everywhere:
                members.update(view.members)
            else:
                for name in names:
                    members.update(view.replicas(name))
        return {
            link
            for m in members
            if m != me and (link := self.by_id.get(m)) is not None and link.state == LinkState.UP
        }

    async def replicated(self, names: Iterable[str], timeout: float = ACK_TIMEOUT) -> None:
        """Wait until every live replica of ``names`` has what this node applied of them.

        For an ``acks=all`` write, once this node applied it (the entries are
        in the links' outboxes: the store's feed ran). A replica whose link
        goes down meanwhile is no longer waited for (it is not live).

        Raises:
            RequestError: (UNAVAILABLE) a live replica did not confirm in time.
        """
        names = list(names)
        try:
            await self._replicated(names, timeout)
        except RequestError:
            if self.coordinator is not None:
                table = self.store.table
                for name in names:
                    entry = table.entry(name)
                    if entry is not None:
                        self.unconfirmed[name] = lww_key(entry)
            raise
        for name in names:
            self.unconfirmed.pop(name, None)

    async def _replicated(self, names: list[str], timeout: float) -> None:
        if self.coordinator is not None:
            cut = self._unreachable(names)
            if cut:
                raise RequestError(
                    ErrorCode.UNAVAILABLE,
                    f"applied by {self.me.node_id}, but replicas {', '.join(sorted(cut))} cannot "
                    "be reached to confirm it (acks=all)",
                )
        links = self.replica_links(names)
        if not links:
            return
        waits = {link: link.confirm() for link in links}
        _, late = await asyncio.wait(waits.values(), timeout=timeout)
        if late:
            for wait in late:
                wait.cancel()
            names_late = [link.name for link, wait in waits.items() if wait in late]
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"applied by {self.me.node_id}, but replicas {', '.join(names_late)} did not "
                f"confirm within {timeout:.0f} s (acks=all)",
            )
        if self.coordinator is not None:
            # (a link that went down meanwhile: its member is live until etcd says not)
            lost = [link.name for link, wait in waits.items() if not wait.result()]
            if lost:
                raise RequestError(
                    ErrorCode.UNAVAILABLE,
                    f"applied by {self.me.node_id}, but the links to replicas "
                    f"{', '.join(lost)} broke before they confirmed it (acks=all)",
                )

    def statistics(self) -> list[dict[str, Any]]:
        return [link.statistics() for link in self.links.values()]
