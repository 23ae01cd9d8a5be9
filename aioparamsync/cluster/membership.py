"""Membership: the :class:`Cluster`, this node's set of peer links, and who it is.

A link's first call announces this node to its peer, which adds it to its
own links and answers the members it knows; any member new to this node gets
a link too. So a node started with one live member joins the whole cluster.
A member that announces itself under another address moved: its link
follows it. A link that reaches this node itself, or a member another link
reaches already, is dropped. A peer that cannot be reached is retried with
capped exponential backoff, forever (see :mod:`.links`); it is never
forgotten, and its state is in ``info``; but while its link is down it owns
no parameters (see :meth:`Cluster.owner`).

While no link is up (say, none of the ``--peers`` a node started with
answers), the node says so at WARNING after ``unreachable_warning`` seconds,
then every ``UNREACHABLE_REPEAT`` seconds, not at every retry; when a peer
answers again, an INFO line says which. Every ``STATS_LOG_SECONDS`` the node
logs each link's state and counters.

The cluster sees the store only through its feed of applied updates: each
update applied for a client is offered to the links of its :func:`replicas`;
updates that came from a peer are not sent on (their origin sends them to
everyone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ErrorCode, RequestError
from ..store.table import Entry, Limits
from ..values import pieces
from ..wire import DEFAULT_MAX_FRAME_BYTES, thrift
from .links import (
    BATCH_BYTES,
    BATCH_PARAMS,
    DEFAULT_REPAIR_INTERVAL,
    OWNER_STATES,
    LinkState,
    PeerLink,
)
from .placement import owner as _owner
from .placement import replicas

if TYPE_CHECKING:
    from ..store.writer import ParameterStore

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
    ) -> None:
        self.store = store
        self.me = me
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

    def __repr__(self) -> str:
        up = sum(1 for link in self.links.values() if link.state == LinkState.UP)
        return f"<Cluster {self.me.node_id} [{up} of {len(self.links)} peers up]>"

    def start(self, seeds: Iterable[tuple[str, int]] = ()) -> None:
        self._started = True
        for host, port in seeds:
            self.add(host, port)
        for link in self.links.values():
            if link.task is None:
                link.start()
        self._reporter = asyncio.create_task(self._report(), name="aioparamsync-peer-stats")
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
        for task in (self._reporter, self._watcher):
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

    def learn(self, members: Iterable[Any]) -> None:
        for member in members:
            self.add(member.host, member.port, member.node_id)

    def owner(self, name: str) -> PeerLink | None:
        """The member that folds gradients of ``name``: a link, or None for this node.

        Rendezvous hashing over this node and the members it can reach (their
        links in ``OWNER_STATES``): see :func:`.placement.owner`.
        """
        return _owner(name, self.me.node_id, self.links.values(), OWNER_STATES)

    def members(self) -> list[Any]:
        """Every member known, this node first."""
        known = [
            thrift.Member(node_id=link.node_id, host=link.host, port=link.port)
            for link in self.links.values()
            if link.node_id
        ]
        return [self.me, *known]

    def announced(self, member: Any) -> list[Any]:
        """A peer announced itself: add it; answer the members this node knows."""
        if not member.node_id or not member.host or not 0 < member.port < 65536:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"a member needs an id, a host and a port: {member}"
            )
        self.add(member.host, member.port, member.node_id, itself=True)
        return self.members()

    # -- the store's feed ---------------------------------------------------------

    def _applied(self, entries: Sequence[Entry], replicated: bool) -> None:
        if replicated:
            return  # its origin sends it to every peer
        links = list(self.links.values())
        for entry in entries:
            for link in replicas(entry.name, links):
                link.offer((entry,))

    def statistics(self) -> list[dict[str, Any]]:
        return [link.statistics() for link in self.links.values()]
