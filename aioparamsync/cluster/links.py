"""Replica links: this node's link to one peer, its coalescing outbox, its sender, its repairs.

A node keeps one :class:`PeerLink` per other member of its cluster (a full
mesh; :mod:`.membership` keeps the set). Every update this node applies for
a client reaches each link's outbox as the store's writer finishes the batch;
each link's own task sends what its outbox holds to its peer as oneway
``broadcast_update`` calls over one persistent connection, so the client's
reply never waits for a peer and the links never wait for each other. An
update received from a peer carries its version and origin; the receiver
merges it (last writer wins on ``(version, origin)``, see
:meth:`ParameterTable.merge`) and does not send it on: the origin has sent
it to everyone.

Oneway messages can be lost, so links also repair (see :mod:`.repair`).

Theory of operation: a link's states (:class:`LinkState`), what moves a
link between them, and what each means for its outbox and for placement
(see :mod:`.membership`: a member whose link is not UP is down).

- CONNECTING: the link's task connects and announces this node; the answer
  names the peer (its id) and the members it knows (each new one gets a
  link). Entered when the link starts, and again when an UP link's client
  had to open a new connection (the peer may have restarted, empty and
  without seeds: it is told of this node again). The outbox fills; nothing
  is sent. Its member is down: primary of nothing (a gradient push
  forwarded to it just as its link reconnects waits ``FORWARD_CONNECT_WAIT``).
- UP: the peer answered, and no other link reaches it. The link repairs
  first, then sends its outbox as it fills, pings an idle peer every
  ``HEARTBEAT_SECONDS`` and repairs every ``repair_interval`` seconds.
  Only UP links drain (:meth:`Cluster.drain` waits for these alone). Its
  member is live: the primary of the keys it is the first replica of.
- BACKOFF: a call failed (connecting, announcing, repairing, sending, a
  ping), from CONNECTING or UP. The link waits a doubling delay
  (``BACKOFF_INITIAL`` up to ``BACKOFF_MAX``, jittered; cut short when the
  peer announces itself) and tries again, staying BACKOFF until a try
  succeeds (then UP, the delay starting over, or DROPPED). What a failed
  send had taken goes back into the outbox (unless newer entries came
  meanwhile) for the next connection; repair catches up what was lost. Its
  member is down: its keys' next replicas are their primaries (and past
  the failure timeout it leaves placement).
- REFUSED: the peer answered, but it and this node cannot be in one
  cluster (their replication factors differ: placement would differ, and
  reads through one would miss keys the other placed); whichever side
  noticed it first refused the other, and ``last_error`` names both values.
  Logged at ERROR. The link tries again every ``REFUSED_RETRY`` seconds (or
  when the peer announces itself: it may have been restarted with the
  cluster's), staying REFUSED until it is accepted. Its member is no member:
  placed nowhere, sent nothing, in no topology this node answers.
- DROPPED, final: the peer turned out to be this node itself, or a member
  another link reaches already. The cluster forgets the link; its task ends.

A link is never given up on: its task ends only DROPPED, or when the cluster
stops it (at shutdown, or when its member announces itself at another
address: the new link takes back the old one's outbox). In every state an
offer never blocks: the outbox coalesces by name whatever the link is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..client.api import ParameterClient
from ..errors import ClientClosedError, ConnectError, ParamSyncError
from ..store.table import Entry, lww_key
from ..wire import METHODS, Method, thrift
from .batches import batches, messages
from .repair import repair
from .rowbox import RowOutbox

if TYPE_CHECKING:
    import numpy as np

    from ..store.rows import RowTable
    from .membership import Cluster

__all__ = ["LinkState", "PeerLink", "member_name"]

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
# How long a link that its peer refused (see LinkState.REFUSED) waits before it
# tries again (seconds).
REFUSED_RETRY = 30.0
# How often an idle link checks that its peer is there (seconds).
HEARTBEAT_SECONDS = 1.0
# Most bytes, and most parameters, in one replication message or one pull;
# fewer where the node's limits say so (see Cluster).
BATCH_BYTES = 64 * 1024 * 1024
BATCH_PARAMS = 1024


class LinkState(enum.StrEnum):
    """The state of a peer link (see the theory of operation, in the module's docstring).

    A ``str``: it compares equal to, and prints as, its value, which is what
    ``info()`` answers in ``PeerInfo.state`` and metrics label ``peer_state`` with.
    """

    CONNECTING = "connecting"  # connecting and announcing; may own parameters
    UP = "up"  # connected and joined: sending its outbox, repairing
    BACKOFF = "backoff"  # a call failed: waiting to retry; owns nothing
    REFUSED = "refused"  # not of this node's cluster (last_error says why): no member
    DROPPED = "dropped"  # redundant (it reaches this node, or a node linked already): gone


# The states forward() compares with, once per push it forwards: bound here,
# as an enum's member looked up on its class is a slow attribute on Python 3.11.
_CONNECTING = LinkState.CONNECTING
_UP = LinkState.UP
# The states whose log line says why (the link's last error).
_SAYS_WHY = (LinkState.BACKOFF, LinkState.REFUSED)


def member_name(node_id: str, host: str, port: int) -> str:
    """How logs name a member: ``node-id (host:port)``, or its address alone.

    The address alone while the id is unknown (a seed not reached yet), or
    when the id is the address (the default id).
    """
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not node_id or node_id in (address, f"{host}:{port}"):
        return address
    return f"{node_id} ({address})"


class _Refused(Exception):
    """The peer and this node cannot be in one cluster (the message says why)."""


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
        self.state = LinkState.CONNECTING
        self.outbox: dict[str, Entry] = {}
        #: the rows of embedding tables waiting for the peer (see :mod:`.rowbox`)
        self.rows = RowOutbox()
        self._oldest: float | None = None  # when the oldest waiting entry was queued
        self._wakeup = asyncio.Event()
        self._poked = asyncio.Event()
        self.drained = asyncio.Event()  # set while nothing waits to be sent
        self.drained.set()
        self.task: asyncio.Task[None] | None = None  # the link's task, once started
        self.updates_sent = 0
        self.updates_coalesced = 0
        self.send_failures = 0
        self.repaired = 0
        self.last_error = ""
        self.client: ParameterClient | None = None  # while the link is up
        self._changed = asyncio.Event()  # set at each change of state or client
        #: what the member says of itself (Member.state); None: it has not said
        self.member_state: str | None = None
        #: the epoch of its last report of that (older reports are ignored)
        self.said_epoch: int | None = None
        #: since when (time.monotonic()) the link has not been up
        self.down_since = time.monotonic()
        #: a repair succeeded since the link started (a joining node waits for it)
        self.pulled = False
        self._repair_due = False
        self._announce_due = False
        # acks=all writes waiting for the peer: (offers counted when asked, future)
        self._offers = 0
        self._confirms: list[tuple[int, asyncio.Future[bool]]] = []
        self._proxy: ParameterClient | None = None  # for calls passed on to the peer

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
            "outbox_depth": len(self.outbox) + len(self.rows),
            "updates_sent": self.updates_sent,
            "updates_coalesced": self.updates_coalesced,
            "send_failures": self.send_failures,
            "lag_seconds": self.lag,
            "last_error": self.last_error,
            "repaired": self.repaired,
        }

    def offer(self, entries: Iterable[Entry], taken_back: bool = False) -> None:
        """Queue entries for the peer (never blocks).

        Of two entries of one name, the outbox keeps the newer by ``lww_key``
        (a repair may have queued a newer one than an update offered now).
        An update offered now wins a tie, counts as coalesced where an entry
        of its name waited, and wakes the sender.

        Args:
            taken_back: the entries were queued once already (a send that
                failed took them, or a member's old link held them): a tie
                keeps the entry waiting, nothing counts as coalesced, and the
                sender is not woken (it sends them when it is up again). The
                outbox is not drained either way.
        """
        # (Hot: the writer offers each update to each link; a keyword-only
        # flag would slow every call.)
        outbox = self.outbox
        self._offers += 1
        for entry in entries:
            old = outbox.get(entry.name)
            if old is not None:
                if not taken_back:
                    self.updates_coalesced += 1
                waiting, offered = lww_key(old), lww_key(entry)
                if waiting > offered or (taken_back and waiting == offered):
                    continue  # keep the newer (a repair may have queued it)
            outbox[entry.name] = entry
        if outbox:
            if self._oldest is None:
                self._oldest = time.monotonic()
            self.drained.clear()
            if not taken_back:
                self._wakeup.set()

    def offer_rows(self, table: RowTable, bucket: int, ids: np.ndarray) -> None:
        """Queue rows ``ids`` of ``bucket`` of ``table`` for the peer (never blocks; see
        :mod:`.rowbox`): sent as parameters are, confirmed by the same ping."""
        self._offers += 1
        self.rows.offer(table, bucket, ids)
        if self._oldest is None:
            self._oldest = time.monotonic()
        self.drained.clear()
        self._wakeup.set()

    def discard(self) -> dict[str, tuple[int, str]]:
        """Empty the outboxes, unsent; answer what the parameters' held (name -> ``lww_key``).

        A write waiting for its confirmation (``acks=all``) is told it failed.
        """
        self.rows.take()
        taken, self.outbox = self.outbox, {}
        self._oldest = None
        self.drained.set()
        self._settle_confirms(False)
        return {name: lww_key(entry) for name, entry in taken.items()}

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"aioparamsync-peer-{self.address}")

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task})
            self.task = None
        self._settle_confirms(False)
        if self._proxy is not None:
            await self._proxy.close()
            self._proxy = None

    def repair_soon(self) -> None:
        """Repair at the next step (the topology changed: this node may hold other keys)."""
        self._repair_due = True
        self._wakeup.set()

    def announce_soon(self) -> None:
        """Announce this node again at the next step (its state changed)."""
        self._announce_due = True
        self._wakeup.set()

    async def pull(self) -> bool:
        """Repair now: pull what the peer holds newer (False: the link is not up)."""
        client = self.client
        if self.state != LinkState.UP or client is None:
            return False
        await self._repair(client)
        return True

    def confirm(self) -> asyncio.Future[bool]:
        """A future: True once what was offered so far reached the peer and was applied.

        The link sends its outbox, then a ping: the peer answers a ping only
        after the writes before it on the connection (read-your-writes), so
        the answer confirms them. False when the link is not up, or goes down
        first (the member is then not live, and is not waited for).
        """
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if self.state != _UP:
            future.set_result(False)
        else:
            self._confirms.append((self._offers, future))
            self._wakeup.set()
        return future

    def _settle_confirms(self, ok: bool, upto: int | None = None) -> None:
        kept = []
        for seq, future in self._confirms:
            if upto is None or seq <= upto:
                if not future.done():
                    future.set_result(ok)
            else:
                kept.append((seq, future))
        self._confirms = kept

    def proxy(self) -> ParameterClient:
        """A client of the peer for calls passed on to it (not the link's own connection).

        Raises:
            ConnectError: the link is not up.
        """
        if self.state != _UP:
            raise ConnectError(f"peer {self.name} is {self.state}")
        if self._proxy is None:
            self._proxy = ParameterClient(
                (self.host, self.port),
                timeout=3 * PEER_CALL_TIMEOUT,  # (calls passed on say their own)
                connect_timeout=PEER_CALL_TIMEOUT,
                ssl=self.cluster.ssl,
                route=False,
                shared_memory=0,  # (peers link over TCP, never a local socket)
            )
        return self._proxy

    def refused(self, why: str) -> None:
        """Its peer announced itself and this node refused it (see ``LinkState.REFUSED``):
        the link, made for it (not started yet), says so from the start, and tries
        again as a refused link does."""
        self.last_error = why
        self._set_state(LinkState.REFUSED)

    def poke(self) -> None:
        """The peer is (back) up: cut short the wait before the next try."""
        self._poked.set()

    async def forward(self, push: Any, timeout: float | None = PEER_CALL_TIMEOUT) -> Any:
        """Send a gradient push on to this peer (its owner); answer its ``UpdateResult``.

        It goes on the forwarding lane (:meth:`proxy`), never on the link's own
        connection: a forwarded write waits there for its replication, and its
        reply holds up the replies behind it, so replication (and its
        confirming pings) sharing that connection could wait for it, and it
        for them, the other way round (a cycle between two nodes).

        Raises:
            NetworkError: the link is down, or broke.
            RequestError: the peer refused the push.
        """
        await self._connected()
        return await self.proxy().invoke(METHODS.push_gradients, timeout=timeout, push=push)

    async def replicate(self, m: Method, /, timeout: float = PEER_CALL_TIMEOUT, **args: Any) -> Any:
        """Call ``m`` on the replication lane: the link's own connection.

        Only for replication (what this node applied, for the peer to apply as
        it is): a call that waits for nothing but the peer's store, so it never
        waits behind a forwarded write (see :meth:`forward`).

        Raises:
            ConnectError: the link is not up.
        """
        client = self.client
        if client is None or self.state != _UP:
            raise ConnectError(f"peer {self.name} is {self.state}")
        return await client.invoke(m, timeout=timeout, **args)

    async def _connected(self) -> None:
        """Wait (a little) while the link is being made; raise unless it is up.

        A link being made (e.g. to a member just learned) is not down: a call
        waits for it up to ``FORWARD_CONNECT_WAIT``; a link in backoff is not
        waited for.

        Raises:
            ConnectError: the link is not up.
        """
        if self.client is None and self.state == _CONNECTING:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FORWARD_CONNECT_WAIT):
                    while self.client is None and self.state == _CONNECTING:
                        self._changed.clear()
                        await self._changed.wait()
        if self.client is None or self.state != _UP:
            raise ConnectError(f"peer {self.name} is {self.state}")

    # -- the link's task ----------------------------------------------------------

    async def _run(self) -> None:
        backoff = BACKOFF_INITIAL
        if self.state == LinkState.REFUSED:  # (made refused: see refused())
            await self._pause(REFUSED_RETRY)
        while True:
            delay = backoff
            client = ParameterClient(
                (self.host, self.port),
                timeout=PEER_CALL_TIMEOUT,
                connect_timeout=PEER_CALL_TIMEOUT,
                max_connections=1,
                ssl=self.cluster.ssl,
                route=False,
                shared_memory=0,  # (peers link over TCP, never a local socket)
            )
            try:
                if self.state not in (LinkState.BACKOFF, LinkState.REFUSED):
                    # (retries stay in backoff, or refused, until one succeeds)
                    self._set_state(LinkState.CONNECTING)
                await self._join(client)
                if self.cluster.redundant(self):
                    self._set_state(LinkState.DROPPED)
                    return
                self.client = client
                self._set_state(LinkState.UP)
                backoff = BACKOFF_INITIAL
                self._repair_due = False
                await self._repair(client)
                self.pulled = True
                await self._send(client)
                continue  # the connection was replaced: the peer may be new; join again
            except _Refused as exc:
                self.last_error = str(exc)
                self._set_state(LinkState.REFUSED)
                self.discard()  # (no member: nothing is sent to it)
                delay = REFUSED_RETRY
            except (ParamSyncError, OSError) as exc:
                if isinstance(exc, ClientClosedError):
                    return
                self.send_failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._set_state(LinkState.BACKOFF)
                log.debug("peer %s: %s; retrying in %.2f s", self.name, exc, backoff)
            finally:
                self.client = None
                self._changed.set()
                self._settle_confirms(False)
                await client.close()
            await self._pause(delay)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _pause(self, delay: float) -> None:
        """Wait about ``delay`` seconds (jittered) before the next try, or until the
        peer announces itself."""
        self._poked.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay * random.uniform(0.5, 1.0)):
                await self._poked.wait()

    def _set_state(self, state: LinkState) -> None:
        if state != self.state:
            if self.state == LinkState.UP:
                self.down_since = time.monotonic()
            # (unreachable: a WARNING, once, not at each retry; refused: an ERROR; up: INFO)
            level = {
                LinkState.BACKOFF: logging.WARNING,
                LinkState.REFUSED: logging.ERROR,
                LinkState.UP: logging.INFO,
            }.get(state, logging.DEBUG)
            suffix = f" ({self.last_error})" if state in _SAYS_WHY else ""
            log.log(level, "peer %s: %s%s", self.name, state, suffix)
            self.state = state
            self._changed.set()
            self.cluster.links_changed()

    async def _join(self, client: ParameterClient) -> None:
        self._announce_due = False
        # Its answer is newer than any report before the call (the member may
        # have restarted, its epoch starting over); one it makes meanwhile, on
        # its own link, is newer still (see Announces.said).
        self.said_epoch = None
        members = await client.invoke(
            METHODS.announce, member=self.cluster.announces.announcement()
        )
        if members:
            self.node_id = members[0].node_id  # a node answers itself first
            why = self.cluster.announces.refusal(members[0])
            if why is not None:
                raise _Refused(why)
        self.cluster.announces.learn(members, self)

    async def _repair(self, client: ParameterClient) -> None:
        """Pull what the peer holds newer than this node (see :mod:`.repair`)."""
        self.repaired += await repair(self.cluster, client, self.node_id)

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
            if not self.outbox and not self.rows and not self._confirms and not self._repair_due:
                self._wakeup.clear()
                wait = min(next_repair - loop.time(), HEARTBEAT_SECONDS)
                try:
                    async with asyncio.timeout(max(wait, 0)):
                        await self._wakeup.wait()
                except TimeoutError:
                    if loop.time() < next_repair:
                        await client.ping()
            if self._announce_due:
                await self._join(client)
            if loop.time() >= next_repair or self._repair_due:
                self._repair_due = False
                await self._repair(client)
                self.pulled = True
                next_repair = loop.time() + interval
            if self.outbox or self.rows:
                await self._send_outbox(client)
            if self._confirms:
                upto = self._offers  # (all of it was taken by the sends above)
                if not self.outbox and not self.rows:
                    await client.ping()
                    self._settle_confirms(True, upto)

    async def _send_outbox(self, client: ParameterClient) -> None:
        taken, self.outbox = self.outbox, {}
        self._oldest = None
        cluster = self.cluster
        timestamp = cluster.store.timestamp
        cut = list(batches(taken.values(), cluster.batch_params, cluster.batch_bytes))
        for i, batch in enumerate(cut):
            try:
                for params in messages(batch, cluster.inline_bytes, cluster.piece_bytes):
                    update = thrift.ParameterUpdate(
                        params=params, timestamp=timestamp, from_peer=cluster.me.node_id
                    )
                    await client.invoke(METHODS.broadcast_update, update=update)
            except BaseException:
                # Not sent (or maybe half): keep it for the next connection,
                # unless a newer version of a name came meanwhile.
                for rest in cut[i:]:
                    self.offer(rest, taken_back=True)
                raise
            self.updates_sent += len(batch)
        await self._send_rows(client)
        if not self.outbox and not self.rows:
            self.drained.set()

    async def _send_rows(self, client: ParameterClient) -> None:
        """Send the rows waiting, read from their tables now (see :mod:`.rowbox`)."""
        taken = self.rows.take()
        if not taken:
            return
        me = self.cluster.me.node_id
        try:
            for deltas in RowOutbox.messages(taken, me):
                await client.invoke(METHODS.replicate_rows, deltas=deltas)
        except BaseException:
            # Kept for the next connection (what was sent too: a row merges once, by
            # its version), with what came meanwhile.
            self.rows.put_back(taken)
            raise
