"""Membership: the :class:`Cluster`, this node's set of peer links, and who it is.

The cluster owns this node's links (one per other member, a full mesh; see
:mod:`.links`) and its :class:`~.view.View` of the members, and the parts
that act on them, each in its module:

- :mod:`.view`: the members, their states and placement at one epoch (frozen,
  replaced whole at each change);
- :mod:`.announces`: what members say of themselves and of others;
- :mod:`.replication`: the store's feed to the links' outboxes, and what
  waits for the replicas;
- :mod:`.fencing`: with a coordinator, when this node may take writes;
- :mod:`.transitions`: this node's own changes of state (joining, leaving);
- :mod:`.rebalance`: handing off the keys it holds but is no replica of;
- :mod:`.reports`: the links' counters, and a warning while none answers.

A member that announces itself under another address moved: its link
follows it. A link that reaches this node itself, or a member another link
reaches already, is dropped. A peer that cannot be reached is retried with
capped exponential backoff, forever (see :mod:`.links`); it is never
forgotten (unless it said it left), and its state is in ``info``; while its
link is down it is primary of nothing (see :meth:`Cluster.owner`), and past
the failure timeout it holds nothing (see :mod:`.view`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..placement import (
    DEFAULT_REPLICATION_FACTOR,
    DOWN,
    FAILED,
    JOINING,
    LEAVING,
    LIVE,
    UP,
    Placement,
)
from ..store.table import Limits
from ..values import pieces
from ..wire import DEFAULT_MAX_FRAME_BYTES
from .announces import Announces
from .balance import DEFAULT_BALANCE_INTERVAL, Balancer
from .fencing import Fencing
from .links import BATCH_BYTES, BATCH_PARAMS, DEFAULT_REPAIR_INTERVAL, LinkState, PeerLink
from .rebalance import Rebalancer
from .recovered import Recovery
from .replication import ACK_TIMEOUT, Replication
from .reports import UNREACHABLE_WARNING, LinkReports
from .transitions import Transitions
from .view import View

if TYPE_CHECKING:
    from ..store.writer import ParameterStore
    from .coordinator import EtcdCoordinator

__all__ = ["ACKS", "DEFAULT_FAILURE_TIMEOUT", "UNREACHABLE_WARNING", "Cluster"]

log = logging.getLogger(__name__)

# How long a member may not answer before it leaves placement and its keys
# are re-replicated by the others (seconds).
DEFAULT_FAILURE_TIMEOUT = 30.0
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
            (seconds; see :mod:`.reports`); None: never.
        replication_factor: how many members hold each key (None: every one).
        failure_timeout: seconds a member may be down before it leaves placement.
        acks: "1" or "all": when a write is answered, unless it says.
        coordinator: an :class:`~.coordinator.EtcdCoordinator` (None: the
            members decide among themselves).
        balance_interval: seconds between rounds of balancing by bytes (see
            :mod:`.balance`); 0: never.

    The links' messages and pulls are cut to this node's limits and frame
    size: the members of a cluster are assumed to run with the same ones (a
    peer with lower ones refuses them: a oneway update is lost until a
    repair, a pull fails and is retried).

    Every change of the members or their states replaces :attr:`view` at a
    larger epoch and sets :attr:`changed` (it wakes the rebalancer). With a
    coordinator, the members and their states are etcd's (see
    :mod:`.coordinator`, :mod:`.fencing`), whatever the links do, and the
    epoch is etcd's revision of the members.
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
        balance_interval: float = DEFAULT_BALANCE_INTERVAL,
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
        self.coordinator = coordinator
        #: this node's own state (one of placement's SELF_STATES)
        self.state = UP
        #: the keys this node claims, and is claiming (key -> the epoch it claimed
        #: it at; see aioparamsync.placement and .balance)
        self.claims: dict[str, int] = {}
        self.claiming: dict[str, int] = {}
        self._view = View.empty(replication_factor)
        self._epoch_waiters: list[tuple[int, asyncio.Future[None]]] = []  # (see caught_up)
        #: the links to the members of the view, by member id
        self.by_id: dict[str, PeerLink] = {}
        #: set at every new epoch (the rebalancer clears it)
        self.changed = asyncio.Event()
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
        self._ticker: asyncio.Task[None] | None = None
        self._stopping: set[asyncio.Future[None]] = set()  # links being stopped
        self.announces = Announces(self)
        self.fencing = Fencing(self, coordinator)
        self.replication = Replication(self)
        self.transitions = Transitions(self)
        self.rebalancer = Rebalancer(self)
        self.recovery = Recovery(self)
        self.balancer = Balancer(self, balance_interval)
        self.reports = LinkReports(self.links, unreachable_warning)
        if coordinator is not None:
            coordinator.on_change = self._coordinated
            coordinator.on_lost = self.transitions.lease_lost
            coordinator.before_register = self.fencing.forget_unconfirmed
            coordinator.on_registered = self.transitions.registered_anew

    def __repr__(self) -> str:
        up = sum(1 for link in self.links.values() if link.state == LinkState.UP)
        return f"<Cluster {self.me.node_id} [{up} of {len(self.links)} peers up]>"

    # -- the view, as the server and the links read it ----------------------------

    @property
    def view(self) -> View:
        """The members, their states and placement at this epoch (see :mod:`.view`)."""
        return self._view

    @view.setter
    def view(self, view: View) -> None:
        self._view = view
        if self._epoch_waiters:
            waiting, self._epoch_waiters = self._epoch_waiters, []
            for epoch, waiter in waiting:
                if waiter.done():
                    continue  # (its wait ended)
                if epoch <= view.epoch:
                    waiter.set_result(None)
                else:
                    self._epoch_waiters.append((epoch, waiter))

    @property
    def epoch(self) -> int:
        return self.view.epoch

    async def caught_up(self, epoch: int | None, timeout: float | None = None) -> bool:
        """With a coordinator: wait until this node's view is at ``epoch`` or later (up to
        ``timeout`` s; default: the failure timeout). Answers whether it is.

        Every node follows etcd's members on its own watch, so a member that wrote its
        new state has seen it before another node may have: what that node does
        as the primary of a key until it has seen it (see :meth:`.Transitions.take_over`)
        is what this wait orders. Without a coordinator a member's announce is its
        news (see :mod:`.announces`): nothing to wait for.
        """
        if self.coordinator is None or epoch is None or self.view.epoch >= epoch:
            return True
        timeout = self.failure_timeout if timeout is None else timeout
        waiter = asyncio.get_running_loop().create_future()
        self._epoch_waiters.append((epoch, waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            log.warning(
                "this node's view is at epoch %d, not yet at %d, after %.1f s: the "
                "coordinator's watch is behind",
                self.view.epoch,
                epoch,
                timeout,
            )
            return False
        return True

    @property
    def placement(self) -> Placement:
        return self.view.placement

    @property
    def pending(self) -> Placement | None:
        """The placement once the members joining or leaving now have (None: none is)."""
        return self.view.pending

    @property
    def live(self) -> frozenset[str]:
        """The ids of the members up or leaving (this node too, while it is up)."""
        return self.view.live

    @property
    def settling(self) -> asyncio.Future[None] | None:
        """While this node takes over as the primary of its keys: done then."""
        return self.transitions.settling

    # -- start, stop -------------------------------------------------------------

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
        self._ticker = asyncio.create_task(self._tick(), name="aioparamsync-peer-failures")
        self.rebalancer.start()
        self.balancer.start()
        self.reports.start()

    async def stop(self) -> None:
        self._started = False
        await self.balancer.stop()
        await self.rebalancer.stop()
        await self.reports.stop()
        await self.transitions.stop()
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.wait({self._ticker})
        await asyncio.gather(*(link.stop() for link in self.links.values()))

    # -- the links ----------------------------------------------------------------

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

    def add_refused(self, host: str, port: int, node_id: str, why: str) -> None:
        """A member that announced itself and cannot be in this node's cluster (see
        :mod:`.announces`): no member here, but a link to it, refused from the start,
        says why (``info``, the log).

        A link there already is left as it is (not poked: two refused links poking
        each other would announce without end); its own task finds out.
        """
        address = f"{host}:{port}"
        if address in self.links or (host, port) == (self.me.host, self.me.port):
            return
        link = self.links[address] = PeerLink(self, host, port, node_id)
        link.refused(why)
        if self._started:
            link.start()

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

    def links_changed(self) -> None:
        """A link changed state, or came or went: the view, and the reports."""
        self.refresh()
        self.reports.links_changed()

    def statistics(self) -> list[dict[str, Any]]:
        return [link.statistics() for link in self.links.values()]

    # -- the view -----------------------------------------------------------------

    def seen_state(self, link: PeerLink) -> str:
        """A member's state as this node sees it (see :mod:`.view`)."""
        if self.coordinator is not None:
            return self.coordinator.state_of(link.node_id)
        said = link.member_state or UP
        if said not in (UP, LEAVING):
            return said
        if link.state == LinkState.UP:
            return said
        if time.monotonic() - link.down_since > self.failure_timeout:
            return FAILED
        return DOWN

    def refresh(self) -> None:
        """See the members again; where they differ from :attr:`view`'s, a new view at
        a larger epoch replaces it, and :attr:`changed` is set."""
        me = self.me.node_id
        if not me:
            return  # (not started: who this node is is not known yet)
        coordinator = self.coordinator
        if coordinator is not None and not coordinator.revision:
            return  # (etcd not read yet)
        states = {me: self.state}
        if coordinator is not None:  # (this node too, as etcd has it: one view for all)
            states[me] = coordinator.state_of(me)
        by_id = {}
        for link in self.links.values():
            if link.node_id and link.node_id != me and link.state != LinkState.REFUSED:
                states[link.node_id] = self.seen_state(link)
                by_id[link.node_id] = link
        self.by_id = by_id
        if coordinator is not None:  # (in each member's record, this node's too: one view)
            records = coordinator.members
            claims = {m: dict(r.claims) for m, r in records.items() if m in states}
            claiming = {m: dict(r.claiming) for m, r in records.items() if m in states}
        else:  # (as each member says it in its announces)
            claimed = self.announces.claims
            claims = {m: claimed.get(m, {}) for m in by_id}
            claims[me] = self.claims
            taking = self.announces.claiming
            claiming = {m: taking.get(m, {}) for m in by_id}
            claiming[me] = self.claiming
        view = self.view
        if view.same(states, claims, claiming):
            if coordinator is not None and coordinator.revision > view.epoch:
                self.view = view.at(coordinator.revision)  # (a change, and its undoing)
            return
        # Members joining or leaving: the placement once they have (see rebalance).
        said = {m: link.member_state for m, link in by_id.items()}
        said[me] = states[me] if coordinator is not None else self.state
        leaving = [m for m, s in said.items() if s == LEAVING]
        epoch = max(view.epoch, coordinator.revision) if coordinator else view.epoch + 1
        self.view = View.of(epoch, states, leaving, self.replication_factor, view, claims, claiming)
        # (a member live before and down now, or down before and failed now: a WARNING)
        before = view.states
        lost = any(
            s in (DOWN, FAILED) and (before.get(m) in LIVE or (s, before.get(m)) == (FAILED, DOWN))
            for m, s in states.items()
        )
        log.log(logging.WARNING if lost else logging.INFO, "%s", self.view)
        for link in self.links.values():
            link.repair_soon()
        self.changed.set()

    async def _tick(self) -> None:
        """Notice members down longer than the failure timeout (the view changes then)."""
        period = min(1.0, self.failure_timeout / 4)
        while True:
            await asyncio.sleep(period)
            self.refresh()

    def holds_here(self, key: str) -> bool:
        """Whether this node is a replica of ``key``, now or in the pending placement."""
        return self.view.holds(self.me.node_id, key)

    def owner(self, key: str, excluding: frozenset[str] = frozenset()) -> PeerLink | None:
        """The primary of ``key`` (it folds its gradients, holds its barrier): a link,
        or None for this node (also when no replica is up). ``excluding``: members
        not to count as live (they could not be reached)."""
        view = self.view
        live = view.live - excluding if excluding else view.live
        primary = view.placement.primary(key, live)
        if primary is None or primary == self.me.node_id:
            return None
        return self.by_id.get(primary)

    def topology(self) -> Any:
        """The cluster as this node sees it (the IDL's ``Topology``)."""
        return self.announces.topology()

    def set_state(self, state: str) -> None:
        """This node's own state changed: the view, and every peer, is told."""
        if state == self.state:
            return
        log.info("node %s is %s", self.me.node_id, state)
        self.state = state
        if self.coordinator is not None:
            self.transitions.publish(state)
        self.refresh()
        for link in self.links.values():
            link.announce_soon()

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

    # -- what the server calls (each part's own: see the module) ------------------

    def announced(self, member: Any) -> list[Any]:
        return self.announces.announced(member)

    def fenced(self) -> str | None:
        return self.fencing.fenced()

    def trusted(self, node_id: str | None) -> bool:
        return self.fencing.trusted(node_id)

    def check_writable(self, names: Iterable[str], acks: str) -> None:
        self.fencing.check_writable(names, acks)

    async def replicated(self, names: Iterable[str], timeout: float = ACK_TIMEOUT) -> None:
        await self.replication.replicated(names, timeout)
