"""The cluster: membership, per-peer coalescing outboxes, concurrent fan-out, anti-entropy.

Theory of operation. A node keeps one :class:`PeerLink` per other member of
its cluster (a full mesh). Every update this node applies for a client reaches
each link's outbox as the store's writer finishes the batch; each link's own
task sends what its outbox holds to its peer as oneway ``broadcast_update``
calls over one persistent connection, so the client's reply never waits for
a peer and the links never wait for each other. An update received from a
peer carries its version and origin; the receiver merges it (last writer
wins on ``(version, origin)``, see :meth:`ParameterTable.merge`) and does not
send it on: the origin has sent it to everyone.

Oneway messages can be lost (a connection that breaks mid-send, a node that
restarts empty), so links also repair: on every (re)connection, and every
``repair_interval`` seconds, a link asks its peer for a digest (name ->
version, origin) and pulls whatever the peer has newer than this node.
Every node does the same towards each of its peers, so every replica ends
equal.

Membership: a link's first call announces this node to its peer, which adds
it to its own links and answers the members it knows; any member new to this
node gets a link too. So a node started with one live member joins the whole
cluster. A peer that cannot be reached is retried with capped exponential
backoff, forever; it is never forgotten, and its state is in ``info``; but
while its link is down it owns no parameters (see :meth:`Cluster.owner`).
While no link is up (say, none of the ``--peers`` a node started with
answers), the node says so at WARNING after ``unreachable_warning`` seconds,
then every ``UNREACHABLE_REPEAT`` seconds, not at every retry; when a peer
answers again, an INFO line says which.

Which nodes hold a name is :func:`replicas` (today: every node); it is the
one place that sharding would change. Which node folds a name's gradients is
:meth:`Cluster.owner` (rendezvous hashing over the members that are up):
gradients of one parameter pushed at different nodes meet at that one node,
in one order, so none is lost to last-writer-wins; its results replicate like
any update.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ..client.api import ParameterClient
from ..client.fetch import fetch
from ..errors import ClientClosedError, ConnectError, ErrorCode, ParamSyncError, RequestError
from ..store.table import Entry, Limits, lww_key
from ..store.writer import ParameterStore
from ..values import pieces
from ..wire import DEFAULT_MAX_FRAME_BYTES, METHODS, thrift

__all__ = ["Cluster", "PeerLink", "member_name", "replicas"]

log = logging.getLogger(__name__)

# First and largest wait before reconnecting to an unreachable peer (seconds).
BACKOFF_INITIAL = 0.05
BACKOFF_MAX = 5.0
# Default period of anti-entropy repair with each peer (seconds).
DEFAULT_REPAIR_INTERVAL = 10.0
# Deadline of one call to a peer; a peer that cannot take a message this long
# (frozen, or its network) is dropped and reconnected (seconds).
PEER_CALL_TIMEOUT = 10.0
# How long a gradient push waits for the link to its owner while the link is
# being made (seconds); a link down (in backoff) is not waited for.
FORWARD_CONNECT_WAIT = 2.0
# How often an idle link checks that its peer is there (seconds).
HEARTBEAT_SECONDS = 1.0
# How often the node logs each peer link's state and counters (seconds).
STATS_LOG_SECONDS = 60.0
# How long no peer may fail to answer before the node warns (seconds; see
# Cluster), and how often it warns again while none answers.
UNREACHABLE_WARNING = 10.0
UNREACHABLE_REPEAT = 60.0
# Most peers one such warning names (the others are counted).
UNREACHABLE_NAMED = 5
# Most bytes, and most parameters, in one replication message or one pull;
# fewer where the node's limits say so (see Cluster).
BATCH_BYTES = 64 * 1024 * 1024
BATCH_PARAMS = 1024
# What a parameter takes in a message besides its data, name and origin (its
# dtype, shape, version, rule and upload id, and Thrift's field headers): an
# estimate on the safe side, counted when cutting batches.
PARAM_OVERHEAD = 512
# The states of a link whose member may own parameters (fold their gradients):
# up, or being made (a member just learned or just announced, alive as far as
# anyone knows: forward waits FORWARD_CONNECT_WAIT for it). A link in backoff
# is down: its member owns nothing until the link is up again.
OWNER_STATES = frozenset({"up", "connecting"})


def member_name(node_id: str, host: str, port: int) -> str:
    """How logs name a member: ``node-id (host:port)``, or its address alone.

    The address alone while the id is unknown (a seed not reached yet), or
    when the id is the address (the default id).
    """
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not node_id or node_id in (address, f"{host}:{port}"):
        return address
    return f"{node_id} ({address})"


def replicas(name: str, members: Sequence[PeerLink]) -> Sequence[PeerLink]:
    """The peers that hold ``name``: today every one (full replication)."""
    return members


def _messages(entries: list[Entry], inline_bytes: int, piece_bytes: int) -> Iterable[list[Any]]:
    """The replication messages of a batch: one, or the pieces of a large parameter.

    A parameter over ``inline_bytes`` is alone in its batch (see
    :func:`_batches`) and goes in pieces of ``piece_bytes``.
    """
    if len(entries) == 1 and entries[0].nbytes > inline_bytes:
        e = entries[0]
        # The same id for every resend of this version, so a receiver that has
        # some of its pieces already keeps them; hashed, as an upload id is
        # short (pieces.MAX_UPLOAD_ID_BYTES) and a name need not be.
        key = hashlib.blake2b(f"{e.origin}\0{e.version}\0{e.name}".encode(), digest_size=16)
        for piece in pieces.split(e.to_parameter(), f"peer:{key.hexdigest()}", piece_bytes):
            yield [piece]
    else:
        yield [e.to_parameter() for e in entries]


def _wire_bytes(item: Any) -> int:
    """About what an entry (or a digest item) takes in a message, data and fields."""
    return item.nbytes + len(item.name.encode()) + len(item.origin.encode()) + PARAM_OVERHEAD


def _batches(items: Iterable[Any], max_items: int, max_bytes: int) -> Iterable[list[Any]]:
    """Cut ``items`` into lists of at most ``max_items`` items and ``max_bytes`` bytes.

    An item larger than ``max_bytes`` (by :func:`_wire_bytes`) is alone in its list.
    """
    batch: list[Any] = []
    size = 0
    for item in items:
        n = _wire_bytes(item)
        if batch and (len(batch) >= max_items or size + n > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def _score(node_id: str, name: str) -> bytes:
    return hashlib.blake2b(f"{node_id}\0{name}".encode(), digest_size=8).digest()


class PeerLink:
    """This node's link to one peer: its outbox and the task that drains it.

    Backpressure: the outbox holds at most one entry per parameter name, the
    newest; an update of a name already waiting replaces it (counted as
    coalesced). Entries are the store's own immutable entries, so a slow or
    dead peer costs at most one reference per parameter, never a copy, and
    never delays the client or the other peers.

    Args:
        cluster: the cluster it belongs to.
        host, port: where the peer listens.
        node_id: the peer's id, when known (learned from it otherwise).
    """

    def __init__(self, cluster: Cluster, host: str, port: int, node_id: str = "") -> None:
        self.cluster = cluster
        self.host = host
        self.port = port
        self.node_id = node_id
        self.state = "connecting"
        self.outbox: dict[str, Entry] = {}
        self._oldest: float | None = None  # when the oldest waiting entry was queued
        self._wakeup = asyncio.Event()
        self._poked = asyncio.Event()
        self._drained = asyncio.Event()  # set while nothing waits to be sent
        self._drained.set()
        self._task: asyncio.Task[None] | None = None
        self.updates_sent = 0
        self.updates_coalesced = 0
        self.send_failures = 0
        self.repaired = 0
        self.last_error = ""
        self.client: ParameterClient | None = None  # while the link is up
        self._changed = asyncio.Event()  # set at each change of state or client

    def __repr__(self) -> str:
        return (
            f"<PeerLink {self.node_id or '?'} at {self.address} {self.state} "
            f"[outbox {len(self.outbox)} | sent {self.updates_sent}, coalesced "
            f"{self.updates_coalesced}, failures {self.send_failures}]>"
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """The peer as logs name it (see :func:`member_name`)."""
        return member_name(self.node_id, self.host, self.port)

    @property
    def lag(self) -> float:
        """Seconds the oldest update waiting for this peer has waited."""
        oldest = self._oldest  # read once: a metrics scrape may call this from a thread
        return 0.0 if oldest is None else time.monotonic() - oldest

    def statistics(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "state": self.state,
            "outbox_depth": len(self.outbox),
            "updates_sent": self.updates_sent,
            "updates_coalesced": self.updates_coalesced,
            "send_failures": self.send_failures,
            "lag_seconds": self.lag,
            "last_error": self.last_error,
            "repaired": self.repaired,
        }

    def offer(self, entries: Iterable[Entry]) -> None:
        """Queue entries for the peer (never blocks)."""
        outbox = self.outbox
        for entry in entries:
            old = outbox.get(entry.name)
            if old is not None:
                self.updates_coalesced += 1
                if lww_key(old) > lww_key(entry):
                    continue  # keep the newer (a repair may have queued it)
            outbox[entry.name] = entry
        if outbox:
            if self._oldest is None:
                self._oldest = time.monotonic()
            self._drained.clear()
            self._wakeup.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"aioparamsync-peer-{self.address}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
            self._task = None

    # -- the link's task ----------------------------------------------------------

    async def _run(self) -> None:
        backoff = BACKOFF_INITIAL
        while True:
            client = ParameterClient(
                (self.host, self.port),
                timeout=PEER_CALL_TIMEOUT,
                connect_timeout=PEER_CALL_TIMEOUT,
                max_connections=1,
                ssl=self.cluster.ssl,
            )
            try:
                if self.state != "backoff":  # retries stay "backoff" until one succeeds
                    self._set_state("connecting")
                await self._join(client)
                if self.cluster.redundant(self):
                    self._set_state("dropped")
                    return
                self.client = client
                self._set_state("up")
                backoff = BACKOFF_INITIAL
                await self._repair(client)
                await self._send(client)
                continue  # the connection was replaced: the peer may be new; join again
            except (ParamSyncError, OSError) as exc:
                if isinstance(exc, ClientClosedError):
                    return
                self.send_failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._set_state("backoff")
                log.debug("peer %s: %s; retrying in %.2f s", self.name, exc, backoff)
            finally:
                self.client = None
                self._changed.set()
                await client.close()
            self._poked.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff * random.uniform(0.5, 1.0)):
                    await self._poked.wait()  # or sooner, when the peer announces itself
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def forward(self, push: Any) -> Any:
        """Send a gradient push on to this peer (its owner); answer its ``UpdateResult``.

        Raises:
            NetworkError: the link is down, or broke.
            RequestError: the peer refused the push.
        """
        if self.client is None and self.state == "connecting":
            # (a link being made, e.g. to a member just learned: not down)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FORWARD_CONNECT_WAIT):
                    while self.client is None and self.state == "connecting":
                        self._changed.clear()
                        await self._changed.wait()
        client = self.client
        if client is None or self.state != "up":
            raise ConnectError(f"peer {self.node_id or self.address} is {self.state}")
        return await client.invoke(METHODS.push_gradients, push=push)

    def poke(self) -> None:
        """The peer is (back) up: cut short the wait before the next try."""
        self._poked.set()

    def _set_state(self, state: str) -> None:
        if state != self.state:
            level = logging.INFO if state in ("up", "backoff") else logging.DEBUG
            suffix = f" ({self.last_error})" if state == "backoff" else ""
            log.log(level, "peer %s: %s%s", self.name, state, suffix)
            self.state = state
            self._changed.set()
            self.cluster._links_changed()

    async def _join(self, client: ParameterClient) -> None:
        members = await client.invoke(METHODS.announce, member=self.cluster.me)
        if members:
            self.node_id = members[0].node_id  # a node answers itself first
        self.cluster.learn(members)

    async def _repair(self, client: ParameterClient) -> None:
        """Pull what the peer holds newer than this node (anti-entropy)."""
        digest = await client.invoke(METHODS.digest)
        table = self.cluster.store.table
        wanted = []
        for item in digest:
            mine = table.entry(item.name)
            if mine is None or lww_key(mine) < lww_key(item):
                wanted.append(item)
        cluster = self.cluster
        for batch in _batches(wanted, cluster.batch_params, cluster.batch_bytes):
            request = thrift.ParameterRequest(
                param_names=[item.name for item in batch], max_inline_bytes=cluster.inline_bytes
            )
            response = await client.invoke(METHODS.pull_parameters, request=request)
            # A large parameter comes without its data: read it in pieces.
            params = [
                p if p.total_bytes is None else await fetch(client, p, cluster.piece_bytes)
                for p in response.params
            ]
            if params:
                await self.cluster.store.update(params, response.timestamp, replicated=True)
                self.repaired += len(params)

    async def _send(self, client: ParameterClient) -> None:
        """Send the outbox as it fills; repair every ``repair_interval`` seconds.

        An idle link pings its peer every ``HEARTBEAT_SECONDS``, so a peer that
        went away shows as such within that time, not at the next update.
        Returns when the client had to open a new connection: the peer may have
        restarted (empty, without seeds), so the link joins it again.
        """
        loop = asyncio.get_running_loop()
        interval = self.cluster.repair_interval
        next_repair = loop.time() + interval
        session = client.connects
        while client.connects == session:
            if not self.outbox:
                self._wakeup.clear()
                wait = min(next_repair - loop.time(), HEARTBEAT_SECONDS)
                try:
                    async with asyncio.timeout(max(wait, 0)):
                        await self._wakeup.wait()
                except TimeoutError:
                    if loop.time() < next_repair:
                        await client.ping()
            if loop.time() >= next_repair:
                await self._repair(client)
                next_repair = loop.time() + interval
            if self.outbox:
                await self._send_outbox(client)

    async def _send_outbox(self, client: ParameterClient) -> None:
        taken, self.outbox = self.outbox, {}
        self._oldest = None
        cluster = self.cluster
        timestamp = cluster.store.timestamp
        batches = list(_batches(taken.values(), cluster.batch_params, cluster.batch_bytes))
        for i, batch in enumerate(batches):
            try:
                for params in _messages(batch, cluster.inline_bytes, cluster.piece_bytes):
                    update = thrift.ParameterUpdate(
                        params=params, timestamp=timestamp, from_peer=cluster.me.node_id
                    )
                    await client.invoke(METHODS.broadcast_update, update=update)
            except BaseException:
                # Not sent (or maybe half): keep it for the next connection,
                # unless a newer version of a name came meanwhile.
                for rest in batches[i:]:
                    self.offer_back(rest)
                raise
            self.updates_sent += len(batch)
        if not self.outbox:
            self._drained.set()

    def offer_back(self, entries: Iterable[Entry]) -> None:
        outbox = self.outbox
        for entry in entries:
            old = outbox.get(entry.name)
            if old is None or lww_key(old) < lww_key(entry):
                outbox[entry.name] = entry
        if outbox and self._oldest is None:
            self._oldest = time.monotonic()


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
        up = sum(1 for link in self.links.values() if link.state == "up")
        return f"<Cluster {self.me.node_id} [{up} of {len(self.links)} peers up]>"

    def start(self, seeds: Iterable[tuple[str, int]] = ()) -> None:
        self._started = True
        for host, port in seeds:
            self.add(host, port)
        for link in self.links.values():
            if link._task is None:
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
            asyncio.ensure_future(link._drained.wait())
            for link in self.links.values()
            if link.state == "up" and not link._drained.is_set()
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
                if link.state == "up" and not link._drained.is_set()
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

    def _links_changed(self) -> None:
        """A link changed state, or came or went: is there still a peer that answers?"""
        links = self.links.values()
        up = next((link for link in links if link.state == "up"), None)
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
                link.offer_back(moved.outbox.values())
            if self._started:
                link.start()
            self._links_changed()
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
        self._links_changed()
        return True

    def learn(self, members: Iterable[Any]) -> None:
        for member in members:
            self.add(member.host, member.port, member.node_id)

    def owner(self, name: str) -> PeerLink | None:
        """The member that folds gradients of ``name``: a link, or None for this node.

        Rendezvous hashing over this node and the members it can reach (see
        ``OWNER_STATES``) whose ids are known: nodes that see the same members
        live compute the same owner, and a member joining or leaving moves
        only the names it wins or held. A member that is down is left out, so
        its names move to a live member the survivors agree on. (Ranking it
        anyway made each survivor fold those names itself, once forwarding
        failed: concurrent pushes at two nodes then overwrote each other by
        last-writer-wins, for as long as the member stayed away.)

        What remains: while nodes disagree on whether a member is up, they
        may choose different owners for its names, and gradients of one name
        pushed concurrently at two of them may then be lost to
        last-writer-wins, as above. That lasts until each notices the change:
        a member that went away shows when its link's next call fails (within
        ``HEARTBEAT_SECONDS`` on an idle link whose connection broke; up to
        ``PEER_CALL_TIMEOUT`` if the member froze), and one that came back
        when each link's backoff (up to ``BACKOFF_MAX``) ends or it announces
        itself; a link that flaps, or a partition between some members only,
        keeps the window open as long as it lasts. Each push is still applied
        atomically, once, and replicates; only concurrent ones at nodes that
        disagree can overwrite each other.
        """
        best: PeerLink | None = None
        best_score = _score(self.me.node_id, name)
        for link in self.links.values():
            if link.node_id and link.state in OWNER_STATES:
                score = _score(link.node_id, name)
                if score > best_score:
                    best, best_score = link, score
        return best

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

    def _applied(self, entries: Sequence[Entry], replicated: bool) -> None:
        if replicated:
            return  # its origin sends it to every peer
        links = list(self.links.values())
        for entry in entries:
            for link in replicas(entry.name, links):
                link.offer((entry,))

    def statistics(self) -> list[dict[str, Any]]:
        return [link.statistics() for link in self.links.values()]
