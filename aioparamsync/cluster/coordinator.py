"""Membership from etcd: one view of who is in the cluster, and fencing by lease.

Without a coordinator, each node decides alone when another is down (see
:mod:`.membership`): in a partition both sides may take a key's primary for
gone and both take writes. With ``--coordinator etcd://HOST:PORT,...`` the
members and their states live in etcd, and a node takes writes only while
it holds its lease there:

* ``PREFIX/config`` holds the cluster's replication factor; the first node
  creates it (a transaction: only if absent); a node started with another
  one is refused.
* ``PREFIX/members/NODE_ID`` holds a member (its address and state: joining,
  up, leaving, left), attached to the member's lease. Its TTL is the failure
  timeout: a member that stops renewing it is removed by etcd itself, once,
  for every node at the same revision. A node registers only where no key of
  its id is (a previous run's key whose lease has not expired is waited
  out: two processes under one id never both hold it), and changes its own
  state only where its key is still the one it wrote (compare, then put).
* Every node watches ``PREFIX/members/``; the view it places keys by is the
  members there, and the cluster's **epoch is etcd's revision** of the last
  change to them. So every node has one view at one epoch.
* **Fencing.** The lease is renewed every TTL/3. A node that has not had a
  renewal answered for TTL/2 (etcd cannot be reached, or the node was cut off)
  refuses writes (``UNAVAILABLE``) until it has one again: etcd expires the
  lease no sooner than TTL after the last renewal it answered, so the node
  stops writing before any other can take its keys over. Reads go on from
  what it holds. A node whose lease expired registers anew, joining (it
  pulls what it holds from the others before it serves it again).

While etcd is down, no lease can be renewed: every node stops taking writes
after TTL/2 and serves reads; when etcd is back (with its data: leases
survive a restart, their TTL counted anew), renewals succeed and writes
resume. Workers need no etcd: they learn the topology from any node.

The etcd client is ``aetcd`` (the ``[etcd]`` extra), imported only when a
coordinator is asked for (see :mod:`.etcdclient`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from ..placement import FAILED, LEFT
from .etcdclient import client_class, credentials, refresh, watch_from
from .records import Record

__all__ = [
    "DEFAULT_PREFIX",
    "CoordinatorError",
    "EtcdCoordinator",
    "Record",
    "parse_coordinator",
]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/aioparamsync/default"
# The deadline of one call to etcd (seconds): past it, the next endpoint is tried.
CALL_TIMEOUT = 5.0
# The longest a node waits at start for etcd, and for a previous lease of its
# id to expire, before it gives up: this many TTLs, and at least START_TIMEOUT s.
START_TTLS = 3
START_TIMEOUT = 10.0
# The shortest lease etcd grants is about 2 s (1.5 election timeouts).
MIN_TTL = 2.0


class CoordinatorError(Exception):
    """The coordinator cannot be used: unreachable, or it disagrees with this node."""


def parse_coordinator(spec: str) -> list[tuple[str, int]]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` -> the endpoints.

    Raises:
        ValueError: not that form (the message says what is wrong).
    """
    if not spec.startswith("etcd://"):
        raise ValueError(f"a coordinator is etcd://HOST:PORT[,HOST:PORT...], not {spec!r}")
    endpoints = []
    for part in spec[len("etcd://") :].split(","):
        part = part.strip().rstrip("/")
        if not part:
            raise ValueError(f"an empty endpoint in {spec!r}")
        try:
            split = urlsplit(f"//{part}")
            host, port = split.hostname, split.port
        except ValueError as exc:
            raise ValueError(f"bad endpoint {part!r} in {spec!r}: {exc}") from None
        if not host or port is None or split.path or split.query:
            raise ValueError(f"an endpoint is HOST:PORT, not {part!r} (in {spec!r})")
        endpoints.append((host, port))
    return endpoints


def check_prefix(prefix: str) -> str:
    """``prefix``, where it is a path like ``/aioparamsync/NAME``.

    Raises:
        ValueError: it is not.
    """
    if not prefix.startswith("/") or prefix.endswith("/") or "//" in prefix:
        raise ValueError(
            f"a prefix is a path like /aioparamsync/NAME (no trailing /), not {prefix!r}"
        )
    return prefix


class EtcdCoordinator:
    """This node's membership in etcd (see the module).

    Args:
        endpoints: etcd's client endpoints; the next is tried when one fails.
        prefix: where this cluster's keys are (several clusters share one etcd).
        ttl: the lease's time to live (seconds): the failure timeout.
        tls: (ca, cert, key) file paths to reach etcd over TLS (cert and key
            may be None), or None: plain.

    :attr:`on_change` is called (no arguments) whenever :attr:`members` or
    :attr:`revision` changed; :attr:`on_lost` when this node's lease expired;
    then :attr:`before_register` is awaited, the node registers anew
    (joining), and :attr:`on_registered` is called.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl: float = 10.0,
        tls: tuple[str, str | None, str | None] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a coordinator needs at least one endpoint")
        if not ttl >= MIN_TTL:
            raise ValueError(f"the coordinator's lease TTL must be at least {MIN_TTL} s, not {ttl}")
        check_prefix(prefix)
        try:
            self._client_class = client_class()  # (at once without aetcd)
        except ImportError as exc:  # (the [etcd] extra)
            raise CoordinatorError(
                "--coordinator needs the aetcd package: pip install '.[etcd]' in the checkout"
            ) from exc
        self.endpoints = list(endpoints)
        self.prefix = prefix
        self.ttl = ttl
        self.tls = tls
        #: how long :meth:`start` waits for etcd, and for a previous lease of this id (s)
        self.start_timeout = max(START_TIMEOUT, START_TTLS * ttl)
        self._members_prefix = f"{prefix}/members/".encode()
        self._config_key = f"{prefix}/config".encode()
        #: the members in etcd, by id
        self.members: dict[str, Record] = {}
        #: ids whose record went with its state "left" (a planned leave, not a lease
        #: lost): the view says they left, not that they failed, until they come back
        self.left: set[str] = set()
        self._writing = asyncio.Lock()
        #: etcd's revision of the last change to the members seen
        self.revision = 0
        self.on_change: Callable[[], None] = lambda: None
        self.on_lost: Callable[[], None] = lambda: None
        self.before_register: Callable[[], Awaitable[None]] = _nothing
        self.on_registered: Callable[[], None] = lambda: None
        self.me: Record | None = None
        self._client: Any = None
        self._endpoint = 0
        self._lease: int | None = None
        self._key_revision = 0  # the mod revision of this node's key, as it wrote it
        self._renewed = -math.inf  # time.monotonic() when the last answered renewal was sent
        self._lost = False
        self._tasks: list[asyncio.Task[None]] = []
        self._watching: tuple[Any, Any] | None = None  # the watch running: (client, Watch)
        self._registering: asyncio.Task[None] | None = None
        self._complained = 0.0

    def __repr__(self) -> str:
        ends = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        return f"<EtcdCoordinator etcd://{ends} {self.prefix} rev {self.revision}>"

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def state_of(self, node_id: str) -> str:
        """A member's state as etcd has it: its record's; with none, "left" if its
        record went after it said it left, else "failed" (its lease expired)."""
        record = self.members.get(node_id)
        if record is not None:
            return record.state
        return LEFT if node_id in self.left else FAILED

    # -- fencing ------------------------------------------------------------------

    def fenced(self) -> str | None:
        """Why this node may not take writes now (None: it may)."""
        if self._lost:
            return "its lease on the coordinator expired; it is registering anew"
        since = time.monotonic() - self._renewed
        if since > self.ttl / 2:
            return (
                f"it has not renewed its lease on the coordinator ({self.address}) for "
                f"{since:.1f} s (TTL {self.ttl:g} s)"
            )
        return None

    # -- etcd calls ---------------------------------------------------------------

    async def _call(self, make: Callable[[Any], Any], timeout: float = CALL_TIMEOUT) -> Any:
        """``make(client)`` against the current endpoint; on failure, the next one is next.

        The calls of this node (renewals, the watch, registering, state changes)
        share one client; a call that fails drops it (see :meth:`_drop_client`),
        and gRPC cancels the calls still in flight on it: those raise
        ``CancelledError`` though their callers were not cancelled. That is a
        failure of the call, as any other (a ``CoordinatorError``): taken for a
        cancellation, it ended the task that made it (the watch, and the node's
        view stopped at the epoch it had, for good).
        """
        client = None
        try:
            async with asyncio.timeout(timeout):
                if self._client is None:
                    self._client = self._connect(self.endpoints[self._endpoint])
                client = self._client
                await client.connect()  # (at once when connected; else with the one connecting)
                return await make(client)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # (this call's caller was cancelled)
            await self._drop_client(client)
            raise CoordinatorError(
                f"{self.address}: the connection was closed under the call (another failed)"
            ) from None
        except (Exception, TimeoutError) as exc:
            await self._drop_client(client)
            raise CoordinatorError(f"{self.address}: {type(exc).__name__}: {exc}") from exc

    def _connect(self, endpoint: tuple[str, int]) -> Any:
        return self._client_class(*endpoint, credentials(self.tls))

    async def _drop_client(self, client: Any = None) -> None:
        """Close ``client`` (None: the current one); where it is the current one, the
        next call connects anew, to the next endpoint, and the watch on it ends (see
        :meth:`_watch`). A client that a call failed on after another call dropped it
        is closed, and nothing else is: a newer client, and its watch, go on."""
        current = client is None or client is self._client
        if client is None:
            client = self._client
        if current:
            self._client = None
            self._endpoint = (self._endpoint + 1) % len(self.endpoints)
        watching = self._watching
        if watching is not None and (client is None or watching[0] is client):
            self._watching = None  # (cancelled: it ends the watch's loop)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await watching[1].cancel()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    # -- start, stop ----------------------------------------------------------------

    async def start(self, me: Record, replication_factor: int | None) -> None:
        """Check the cluster's config, register this node (its state in ``me``), watch.

        Raises:
            CoordinatorError: etcd could not be reached within :attr:`start_timeout`,
                or its config disagrees with this node's.
        """
        deadline = time.monotonic() + self.start_timeout
        await self._until(deadline, lambda: self._check_config(replication_factor))
        await self._until(deadline, lambda: self._register(me, deadline))
        await self._until(deadline, self._snapshot)
        self._tasks = [
            asyncio.create_task(self._keep_alive(), name="aioparamsync-etcd-lease"),
            asyncio.create_task(self._watch(), name="aioparamsync-etcd-watch"),
        ]

    async def _until(self, deadline: float, step: Callable[[], Any]) -> None:
        """``step()`` again (every second) while etcd cannot be reached, up to ``deadline``."""
        while True:
            try:
                await step()
                return
            except CoordinatorError as exc:
                if isinstance(exc.__cause__, _Refused):
                    raise CoordinatorError(str(exc.__cause__)) from None
                if time.monotonic() >= deadline:
                    raise CoordinatorError(
                        f"could not reach the coordinator within {self.start_timeout:.0f} s: {exc}"
                    ) from exc
                self._complain(exc)
                await asyncio.sleep(1.0)

    async def _check_config(self, replication_factor: int | None) -> None:
        import aetcd.transactions as tx

        wanted = json.dumps({"replication_factor": replication_factor or 0}).encode()
        key = self._config_key

        async def create(client: Any) -> Any:
            return await client.transaction(
                compare=[tx.Create(key) == 0],
                success=[tx.Put(key, wanted)],
                failure=[tx.Get(key)],
            )

        created, responses = await self._call(create)
        if created:
            log.info("coordinator: cluster %s created (R=%s)", self.prefix, replication_factor)
            return
        [[(raw, _kv)]] = responses
        try:
            held = json.loads(raw)["replication_factor"] or None
        except (ValueError, TypeError, KeyError):
            held = f"unreadable ({raw[:100]!r})"
        if held != (replication_factor or None):
            raise CoordinatorError(
                f"{self.address}: cluster {self.prefix} has replication factor "
                f"{held or 'all'}, this node {replication_factor or 'all'}"
            ) from _Refused(
                f"the cluster {self.prefix} in etcd has replication factor {held or 'all'}; "
                f"this node was started with {replication_factor or 'all'}: start it with the "
                "cluster's, or give it another --coordinator-prefix"
            )

    async def _register(self, me: Record, deadline: float) -> None:
        """A lease, and this node's key with it, where no key of its id is."""
        import aetcd.transactions as tx

        key = self._members_prefix + me.node_id.encode()
        ttl = math.ceil(self.ttl)
        lease = await self._call(lambda c: c.lease(ttl))
        self._renewed = time.monotonic()  # (granted: it runs from now)
        waited = False
        while True:

            async def put(client: Any) -> Any:
                return await client.transaction(
                    compare=[tx.Create(key) == 0],
                    success=[tx.Put(key, me.encode(), lease.id)],
                    failure=[tx.Get(key)],
                )

            done, responses = await self._call(put)
            if done:
                self._key_revision = responses[0].response_put.header.revision
                break
            if time.monotonic() >= deadline:
                raise CoordinatorError(f"{self.address}: node id {me.node_id} is taken") from (
                    _Refused(
                        f"node id {me.node_id} is registered in {self.prefix} by a process whose "
                        f"lease did not expire within {self.start_timeout:.0f} s: is another node "
                        "running under this id?"
                    )
                )
            if not waited:
                log.warning(
                    "coordinator: node id %s is registered already (a previous run, or another "
                    "process under this id): waiting for its lease to expire",
                    me.node_id,
                )
                waited = True
            await asyncio.sleep(min(1.0, self.ttl / 4))
            await self._call(lambda c: c.refresh_lease(lease.id))
            self._renewed = time.monotonic()
        self._lease = lease.id
        self.me = me
        self._lost = False
        log.info(
            "coordinator: %s registered as %s in %s (lease TTL %d s)",
            me.node_id,
            me.state,
            self.address,
            ttl,
        )

    async def _snapshot(self) -> None:
        """The members now, and the revision to watch from."""
        found = await self._call(lambda c: c.get_prefix(self._members_prefix))
        members = {}
        for kv in found:
            node_id = kv.key[len(self._members_prefix) :].decode(errors="replace")
            record = Record.decode(node_id, kv.value)
            if record is not None:
                members[node_id] = record
        self.members = members
        self.left -= members.keys()
        # The last change seen: the newest put here (a delete since is not seen, but
        # the watch, from here, replays it: every node ends at the same revision).
        newest = max((kv.mod_revision for kv in found), default=found.header.revision)
        self.revision = max(self.revision, newest)
        self.on_change()

    async def stop(self, *, leave: bool = True) -> None:
        """Stop renewing and watching; ``leave``: remove this node's key (revoke its lease)."""
        tasks = [t for t in (*self._tasks, self._registering) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._tasks = []
        if leave and self._lease is not None:
            lease, self._lease = self._lease, None
            try:
                await self._call(lambda c: c.revoke_lease(lease), timeout=2.0)
            except CoordinatorError as exc:
                log.info("coordinator: could not revoke this node's lease (%s): it expires", exc)
        await self._drop_client()

    @property
    def written_revision(self) -> int:
        """etcd's revision of this node's last write of its own key (0: none yet)."""
        return self._key_revision

    # -- this node's state ----------------------------------------------------------

    async def set_state(
        self,
        state: str,
        claims: Mapping[str, int] | None = None,
        claiming: Mapping[str, int] | None = None,
    ) -> bool:
        """Write this node's state (and what it claims: None, as it is), where its key is
        still the one it wrote.

        Answers whether it was written (False: the lease is gone, or etcd
        could not be reached; the node registers anew when the lease is gone).
        """
        async with self._writing:  # (one write of its key at a time: each compares with the last)
            return await self._set_state(state, claims, claiming)

    async def _set_state(
        self, state: str, claims: Mapping[str, int] | None, claiming: Mapping[str, int] | None
    ) -> bool:
        import aetcd.transactions as tx

        me = self.me
        if me is None or self._lease is None or self._lost:
            return False
        record = me.with_state(state, claims, claiming)
        key = self._members_prefix + me.node_id.encode()
        lease, at = self._lease, self._key_revision

        async def put(client: Any) -> Any:
            return await client.transaction(
                compare=[tx.Mod(key) == at],
                success=[tx.Put(key, record.encode(), lease)],
                failure=[],
            )

        try:
            done, responses = await self._call(put)
        except CoordinatorError as exc:
            self._complain(exc)
            return False
        if not done:
            log.warning("coordinator: this node's key changed under it: registering anew")
            self._lease_lost()
            return False
        self.me = record
        self._key_revision = responses[0].response_put.header.revision
        return True

    # -- the lease ------------------------------------------------------------------

    async def _keep_alive(self) -> None:
        period = self.ttl / 3
        while True:
            await asyncio.sleep(period)
            lease = self._lease
            if lease is None or self._lost:
                continue
            sent = time.monotonic()
            try:
                reply = await self._call(partial(refresh, lease=lease), period)
            except CoordinatorError as exc:
                self._complain(exc)
                continue
            if reply is None or reply.TTL <= 0:
                self._lease_lost()
                continue
            if self.fenced() is not None:
                log.info("coordinator: lease renewed: this node takes writes again")
            self._renewed = sent

    def _lease_lost(self) -> None:
        if self._lost:
            return
        log.warning(
            "coordinator: this node's lease expired: it takes no writes, and registers anew"
        )
        self._lost = True
        self._lease = None
        self.on_lost()
        self._registering = asyncio.create_task(self._register_anew(), name="aioparamsync-etcd-re")

    async def _register_anew(self) -> None:
        me = self.me
        assert me is not None
        record = Record(me.node_id, me.host, me.port, "joining")
        await self.before_register()
        while True:
            try:
                await self._register(record, deadline=time.monotonic() + self.start_timeout)
                self.on_registered()
                return
            except CoordinatorError as exc:
                self._complain(exc)
                await asyncio.sleep(1.0)

    def _complain(self, exc: Exception) -> None:
        """Log a failure to reach etcd at WARNING at most every 10 s (the rest: DEBUG)."""
        now = time.monotonic()
        level = logging.WARNING if now - self._complained > 10.0 else logging.DEBUG
        if level == logging.WARNING:
            self._complained = now
        log.log(level, "coordinator: %s (retrying)", exc)

    # -- the watch ------------------------------------------------------------------

    async def _watch(self) -> None:
        """Follow the members, from the last revision seen on; after a failure, anew.

        The watch outlives any failure of etcd's: only a cancellation of this
        task (the node stops) ends it.
        """
        import aetcd

        prefix = self._members_prefix
        resync = False  # read the members anew first (the revision may have been compacted)
        while True:
            try:
                if resync:
                    await self._snapshot()
                    resync = False
                client, watch = await self._call(lambda c: watch_from(c, prefix, self.revision + 1))
                self._watching = (client, watch)
                if client is not self._client:
                    # (dropped while the watch was made on it, which connected it anew,
                    # aside: no failure of a call would end that watch)
                    await self._drop_client(client)
                    continue
                try:
                    async for event in watch:
                        self._event(event, aetcd.EventKind)
                finally:
                    if self._watching is not None and self._watching[1] is watch:
                        self._watching = None
                # (ended: a call failed and dropped the client, since a stream can
                # hang rather than fail: watched anew, replaying what it missed)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (the watch outlives any failure of etcd's)
                self._complain(CoordinatorError(f"watch: {type(exc).__name__}: {exc}"))
                resync = True
                await asyncio.sleep(1.0)

    def _event(self, event: Any, kinds: Any) -> None:
        kv = event.kv
        node_id = kv.key[len(self._members_prefix) :].decode(errors="replace")
        if event.kind == kinds.DELETE:
            went = self.members.pop(node_id, None)
            if went is not None and went.state == LEFT:
                self.left.add(node_id)
        else:
            record = Record.decode(node_id, kv.value)
            if record is None:
                self.members.pop(node_id, None)
            else:
                self.members[node_id] = record
                self.left.discard(node_id)
        self.revision = max(self.revision, kv.mod_revision)
        me = self.me
        mine = me is not None and node_id == me.node_id
        # (a delete after this node registered last: not the key of a lease lost before)
        gone = mine and event.kind == kinds.DELETE and kv.mod_revision > self._key_revision
        if gone and not self._lost and self._lease is not None:
            self._lease_lost()
        self.on_change()


async def _nothing() -> None:
    return None


class _Refused(Exception):
    """A refusal that retrying does not cure (the cause of a CoordinatorError)."""
