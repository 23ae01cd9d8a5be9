"""A node: the store, the service and the server, started and stopped together."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl as ssl_module
import time
from collections.abc import Iterable
from typing import Any

from .client.addresses import is_loopback, unspecified_host
from .client.api import Address, parse_address, parse_addresses
from .cluster.balance import DEFAULT_BALANCE_INTERVAL
from .cluster.coordinator import DEFAULT_PREFIX, EtcdCoordinator, Record, parse_coordinator
from .cluster.discovery import DEFAULT_INTERVAL as DNS_INTERVAL
from .cluster.discovery import DnsDiscovery, Resolver
from .cluster.links import DEFAULT_REPAIR_INTERVAL, member_name
from .cluster.membership import DEFAULT_FAILURE_TIMEOUT, UNREACHABLE_WARNING, Cluster
from .errors import ErrorCode, RequestError
from .follower import Follower
from .metrics import NodeMetrics
from .persistence.datadir import DataDir
from .persistence.rows import RowStore
from .placement import DEFAULT_REPLICATION_FACTOR, JOINING, LEFT, UP
from .server.digests import bucket_digest
from .server.handlers import ParameterService
from .server.transport import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, Server, ServerConfig
from .store.table import Limits, ParameterTable
from .store.writer import ParameterStore
from .values.partitions import DEFAULT_PARTITION_BYTES
from .values.pieces import MAX_UPLOAD_BYTES
from .wire import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_RECEIVING_BYTES, METHODS, thrift

__all__ = ["Node", "unspecified_host"]

log = logging.getLogger(__name__)


class Node:
    """One aioparamsync node, in this process.

    Use it as an async context manager, or call :meth:`start` and
    :meth:`stop`::

        async with Node(port=0) as node:
            async with ParameterClient(node.address) as client:
                ...

    Args:
        host: the address to listen on (loopback by default).
        port: the port; 0 picks a free one (see :attr:`address`).
        node_id: a stable id for this node; by default its advertised ``host:port``.
        peers: members of the cluster to join (any one live member will do).
        advertise: ``host:port`` where peers reach this node (default: where it
            listens). Needed with ``peers`` when ``host`` is ``0.0.0.0`` or ``::``
            (every interface), which is no address a peer can reach; without
            ``peers``, such a node starts with a warning.
        repair_interval: seconds between anti-entropy rounds with each peer.
        unreachable_warning: warn (log) when no peer has answered for this many
            seconds, then once a minute while none answers (None: never).
        data_dir: where to keep the write-ahead log and snapshots (None: in memory).
        fsync: ``always``, ``batch`` or ``never`` (see :mod:`aioparamsync.persistence`).
        ignore_corrupt_snapshot: start even if the newest snapshot is damaged,
            keeping what passes its checks.
        ignore_corrupt_log: start even if the log is damaged (not a torn write),
            from what comes before the damage.
        ssl: an ``ssl.SSLContext`` to serve TLS with (see :mod:`aioparamsync.tls`).
        peer_ssl: the ``ssl.SSLContext`` peer links connect with.
        max_connections: client connections open at once; more are refused.
        request_timeout: seconds after which a call not yet answered fails.
        max_frame_bytes: the largest frame (message) accepted.
        max_upload_bytes: the most bytes held for parameters larger than one
            message while their pieces arrive (see :mod:`aioparamsync.values.pieces`).
        max_receiving_bytes: the most bytes that large frames being received may
            hold at once, all connections together (None: no limit; see
            :class:`~aioparamsync.wire.ReceiveBudget`).
        idle_timeout: close connections silent this long (seconds; None: never).
        limits: what one request may hold.
        metrics_port: serve Prometheus metrics on this port of ``host`` (0: a free
            one, see :attr:`metrics_address`; None: no metrics). Needs the
            ``prometheus-client`` package (``pip install '.[metrics]'`` in the
            checkout); see :mod:`aioparamsync.metrics`.
        replication_factor: how many nodes hold each key (None: every node;
            fewer when the cluster has fewer). See :mod:`aioparamsync.placement`.
        failure_timeout: seconds a member may not answer before it leaves
            placement and the others re-replicate its keys.
        acks: "1" (answer a write once its primary applied it) or "all" (once
            every live replica did), for writes that do not say.
        drain_timeout: the longest :meth:`stop` hands keys off before it stops
            (a planned leave; see :meth:`leave`).
        partition_bytes: parameters of more elements than this many bytes of
            float32 are stored as partitions, each placed on its own (see
            :mod:`aioparamsync.values.partitions`); 0: every one whole. The
            same on every node of a cluster.
        peers_dns: ``name:port`` whose every address is a member (a Kubernetes
            headless Service), resolved as the node starts and again every
            ``peers_dns_interval`` seconds (see :mod:`aioparamsync.cluster.discovery`).
        resolve: how ``peers_dns`` is resolved (default: the system's resolver).
        unix_socket: also serve clients on this Unix socket path (colocated
            workers connect to ``unix:PATH``; no TLS there: who may connect is
            the file's permissions). Peers still link over TCP.
        local_socket: without ``unix_socket`` and TLS, also listen on an abstract
            Unix socket (Linux), where clients that reach the TCP port from this
            host move to share memory with the node (``info().local_socket``).
        coordinator: ``etcd://HOST:PORT[,HOST:PORT...]``: the members, their
            states and the epoch live in etcd, and the node takes writes only
            while it holds its lease there (its TTL: ``failure_timeout``); see
            :mod:`aioparamsync.cluster.coordinator`. Needs the ``[etcd]`` extra.
            None: the members decide among themselves (``peers``, DNS).
        coordinator_prefix: where in etcd this cluster's keys are (several
            clusters share one etcd under different prefixes).
        coordinator_tls: (ca, cert, key) files to reach etcd over TLS (cert and
            key may be None); None: plain.
        follow: nodes of another cluster (any one will do) to mirror, read-only:
            this node takes no writes (see :mod:`aioparamsync.follower`); with
            ``peers`` (or ``peers_dns``), a cluster of followers. Not with
            ``coordinator``.
        balance_interval: seconds between this member's rounds of balancing by
            bytes (see :mod:`aioparamsync.cluster.balance`); 0: never.

    Raises:
        ValueError: ``advertise`` is ``0.0.0.0`` or ``::``, or ``host`` is and
            ``peers`` are given without ``advertise``; ``follow`` with ``coordinator``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9090,
        *,
        node_id: str | None = None,
        peers: Iterable[Address] | str = (),
        advertise: Address | None = None,
        repair_interval: float = DEFAULT_REPAIR_INTERVAL,
        unreachable_warning: float | None = UNREACHABLE_WARNING,
        data_dir: str | os.PathLike[str] | None = None,
        fsync: str = "batch",
        ignore_corrupt_snapshot: bool = False,
        ignore_corrupt_log: bool = False,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_upload_bytes: int = MAX_UPLOAD_BYTES,
        max_receiving_bytes: int | None = DEFAULT_MAX_RECEIVING_BYTES,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        limits: Limits | None = None,
        ssl: ssl_module.SSLContext | None = None,
        peer_ssl: ssl_module.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        request_timeout: float | None = None,
        metrics_port: int | None = None,
        replication_factor: int | None = DEFAULT_REPLICATION_FACTOR,
        failure_timeout: float = DEFAULT_FAILURE_TIMEOUT,
        acks: str = "1",
        drain_timeout: float = 60.0,
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
        peers_dns: Address | None = None,
        peers_dns_interval: float = DNS_INTERVAL,
        resolve: Resolver | None = None,
        unix_socket: str | os.PathLike[str] | None = None,
        local_socket: bool = True,
        coordinator: str | None = None,
        coordinator_prefix: str = DEFAULT_PREFIX,
        coordinator_tls: tuple[str, str | None, str | None] | None = None,
        follow: Iterable[Address] | str = (),
        balance_interval: float = DEFAULT_BALANCE_INTERVAL,
    ) -> None:
        self.config = ServerConfig(
            host=host,
            port=port,
            max_frame_bytes=max_frame_bytes,
            max_receiving_bytes=max_receiving_bytes,
            idle_timeout=idle_timeout,
            max_connections=max_connections,
            request_timeout=request_timeout,
            ssl=ssl,
            unix_path=os.path.abspath(unix_socket) if unix_socket is not None else None,
            local_socket=local_socket,
        )
        self.seeds = parse_addresses(peers) if peers else []
        self._advertise = parse_address(advertise) if advertise is not None else None
        if self._advertise is not None and unspecified_host(self._advertise[0]):
            raise ValueError(
                f"advertise={self._advertise[0]!r} means every interface, not an address "
                "peers can reach: give this node's address on their network"
            )
        self._dns = parse_address(peers_dns) if peers_dns is not None else None
        if self._advertise is None and (self.seeds or self._dns) and unspecified_host(host):
            told = f"[{host}]" if ":" in host else host or "0.0.0.0"
            raise ValueError(
                f"host={host!r} (every interface) with peers needs advertise=(host, port): "
                f"an address the peers can reach (they would be told {told}:PORT, which "
                "reaches no one)"
            )
        self.table = ParameterTable(node_id or "", limits)
        self.data_dir = (
            DataDir(
                data_dir,
                fsync=fsync,
                ignore_corrupt_snapshot=ignore_corrupt_snapshot,
                ignore_corrupt_log=ignore_corrupt_log,
            )
            if data_dir is not None
            else None
        )
        self.store = ParameterStore(self.table, data_dir=self.data_dir)
        #: the files of the embedding tables, in the data directory's rows/ (None: in memory)
        self.row_store = (
            RowStore(self.data_dir.path, fsync=fsync, sync_interval=self.data_dir.sync_interval)
            if self.data_dir is not None
            else None
        )
        #: this node's membership in etcd (None: peer to peer)
        self.coordinator = (
            EtcdCoordinator(
                parse_coordinator(coordinator),
                prefix=coordinator_prefix,
                ttl=failure_timeout,
                tls=coordinator_tls,
            )
            if coordinator is not None
            else None
        )
        # Who this node is, to its peers: known once it listens (port 0).
        self.cluster = Cluster(
            self.store,
            thrift.Member(node_id="", host="", port=0),
            repair_interval=repair_interval,
            ssl=peer_ssl,
            limits=self.table.limits,  # (peers are assumed to run with the same)
            max_frame_bytes=max_frame_bytes,
            unreachable_warning=unreachable_warning,
            replication_factor=replication_factor,
            failure_timeout=failure_timeout,
            acks=acks,
            coordinator=self.coordinator,
            balance_interval=balance_interval,
        )
        self.drain_timeout = drain_timeout
        #: the members found by DNS (``peers_dns``), or None
        self.discovery = (
            DnsDiscovery(self.cluster, *self._dns, interval=peers_dns_interval, resolve=resolve)
            if self._dns is not None
            else None
        )
        self.service = ParameterService(
            self.store,
            self.cluster,
            max_decoded_bytes=max_frame_bytes,
            max_upload_bytes=max_upload_bytes,
            partition_bytes=partition_bytes,
        )
        self.server = Server(self.service, self.config)
        self.service.counters = self.server.counters
        self.service.on_drain = self._drain_requested
        self.service.on_shutdown = self._shutdown_requested
        self.cluster.rebalancer.hooks.append(self.service.rows.moves.round)
        self.service.statistics_hooks.append(self.cluster.balancer.statistics)
        self.cluster.balancer.buckets_here = lambda: bucket_digest(self.service.rows.tables)
        #: set once the node has left its cluster (a drain): it is to be stopped
        self.left = asyncio.Event()
        #: set once the node was told to shut down: it is to be stopped, not leave
        self.shutting_down = asyncio.Event()
        self._joining: asyncio.Task[None] | None = None
        self._leaving: asyncio.Task[int] | None = None
        self._writer: asyncio.Task[None] | None = None
        self.metrics_port = metrics_port
        self.metrics: NodeMetrics | None = None
        if follow and coordinator:
            raise ValueError("a follower has no coordinator (its cluster of followers has peers)")
        #: what mirrors the cluster this node follows (None: it follows none)
        self.follower = (
            Follower(self.service, self.store, parse_addresses(follow), ssl=peer_ssl)
            if follow
            else None
        )

    def __repr__(self) -> str:
        state = f"listening on {self.host}:{self.port}" if self._writer else "stopped"
        return f"<Node {self.node_id!r} {state}, {len(self.table)} parameters>"

    @property
    def node_id(self) -> str:
        return self.table.node_id

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the node listens on."""
        return self.server.address

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) the metrics endpoint listens on; None without metrics."""
        return self.metrics.address if self.metrics is not None else None

    @property
    def host(self) -> str:
        return self.address[0]

    @property
    def port(self) -> int:
        return self.address[1]

    def _close_files(self) -> None:
        """Close the tables' files (their last snapshot written), then the data directory."""
        assert self.data_dir is not None
        try:
            if self.row_store is not None:
                self.row_store.close()
        finally:
            self.data_dir.close()

    async def start(self) -> None:
        """Recover the data directory (if any), start the store's writer, and listen.

        Raises:
            PersistenceError: the data directory is damaged.
            OSError: the address cannot be listened on.
            MetricsBindError: (an OSError) the metrics port cannot be listened on.
            ImportError: metrics were asked for without ``prometheus-client``.
        """
        if self.data_dir is not None:
            found = await asyncio.to_thread(self.data_dir.recover, self.table)
            log.info(
                "recovered %d parameters from %s (snapshot %s, %d log records, %d torn bytes cut)",
                len(self.table),
                self.data_dir.path,
                found.snapshot,
                found.records,
                found.torn_bytes,
            )
            assert self.row_store is not None
            try:
                await asyncio.to_thread(self.row_store.recover, self.service.rows.tables)
            except BaseException:
                self.data_dir.close()
                raise
            self.service.rows.log = self.row_store.log
        if self.metrics_port is not None:
            metrics = NodeMetrics(self)
            try:
                metrics.start(self.config.host, self.metrics_port)
            except BaseException:
                if self.data_dir is not None:
                    self._close_files()  # (its lock too: the directory is free again)
                raise
            self.metrics = metrics
        self._writer = asyncio.create_task(self.store.run(), name="aioparamsync-store-writer")
        # (it listens first, for its address is its id: until it is in its cluster,
        # it serves nothing but ping and info, or alone it would take every key)
        self.service.starting = "starting"
        try:
            await self.server.start()
            self.service.local_socket = self.server.local_socket
        except BaseException:
            if self.metrics is not None:
                await self.metrics.close()
                self.metrics = None
            self.store.close()
            await self._writer
            if self.data_dir is not None:
                self._close_files()
            raise
        adv_host, adv_port = self._advertise or self.address
        if not self.table.node_id:
            self.table.node_id = f"{adv_host}:{adv_port}"
        # The origin of this run's writes: the id and when the run started, so
        # that a node restarted empty (under its old id) never makes a
        # (version, origin) its last run made with other bytes, and its newer
        # writes win ties.
        self.table.origin = f"{self.node_id}@{time.time_ns() // 1_000_000:013d}"
        self.cluster.me = thrift.Member(node_id=self.node_id, host=adv_host, port=adv_port)
        if self.coordinator is not None:
            self.service.starting = f"registering with the coordinator ({self.coordinator.address})"
            try:
                record = Record(self.node_id, adv_host, adv_port, JOINING)
                await self.coordinator.start(record, self.cluster.replication_factor)
            except BaseException:
                await self.coordinator.stop(leave=False)
                await self.server.close(0)
                self.store.close()
                await self._writer
                if self.data_dir is not None:
                    self._close_files()
                if self.metrics is not None:
                    await self.metrics.close()
                    self.metrics = None
                raise
        seeds = list(self.seeds)
        if self.discovery is not None:
            seeds += [a for a in await self.discovery.seeds() if a not in seeds]
        self.cluster.start(seeds)
        self.service.starting = None
        if self.follower is not None:
            self.follower.start()
        if self.discovery is not None:
            self.discovery.start()
        if self.cluster.state == JOINING:
            self._joining = asyncio.create_task(
                self.cluster.transitions.join(), name="aioparamsync-join"
            )
        kept = f"data in {self.data_dir.path}" if self.data_dir is not None else "in memory"
        log.info(
            "node %s listening on %s:%d, %s",
            member_name(self.node_id, adv_host, adv_port),
            *self.address,
            kept,
        )
        self._warn_of_address(adv_host, adv_port)

    def _warn_of_address(self, host: str, port: int) -> None:
        """Warn when the address peers are told is one they may not reach."""
        if unspecified_host(host):
            # (with seeds, __init__ refused it: here a node alone, so far)
            log.warning(
                "node %s listens on every interface, without --advertise: it would tell a "
                "node that joins it later that it is at %s:%d, where that node cannot reach "
                "it; pass --advertise HOST:PORT (Node(advertise=...)) with an address the "
                "other nodes can reach",
                self.node_id,
                host or "0.0.0.0",
                port,
            )
        elif is_loopback(host.strip("[]")):
            remote = [f"{h}:{p}" for h, p in self.seeds if not is_loopback(h.strip("[]"))]
            if remote:
                log.warning(
                    "node %s tells its peers it is at %s:%d, a loopback address, but %s may "
                    "be on other machines, where that address is their own machine, not this "
                    "node: pass --host with an address they can reach (or --host 0.0.0.0 and "
                    "--advertise HOST:PORT)",
                    self.node_id,
                    host,
                    port,
                    ", ".join(remote),
                )

    async def leave(self, timeout: float | None = None) -> int:
        """Leave the cluster: hand every key this node holds to its next holders.

        The node serves meanwhile; once the others confirmed what it held (or
        ``timeout`` seconds, default ``drain_timeout``, passed), it says it
        left and :attr:`left` is set. Answers how many keys were handed off.
        Leaving twice waits for the first.
        """
        if self._leaving is None:
            wait = self.drain_timeout if timeout is None else timeout
            self._leaving = asyncio.ensure_future(self._leave(wait))
        return await asyncio.shield(self._leaving)

    async def _leave(self, timeout: float) -> int:
        if self._joining is not None:
            self._joining.cancel()
            await asyncio.wait({self._joining})
        try:
            handed = await self.cluster.transitions.leave(timeout)
        except RequestError:
            # It could not leave (it stays, holding its keys): it may be asked again.
            self._leaving = None
            raise
        except BaseException:
            self.left.set()
            raise
        self.left.set()
        log.info("node %s left its cluster: %d keys handed off", self.node_id, handed)
        return handed

    def _drain_requested(self, timeout: float | None) -> asyncio.Future:
        return asyncio.ensure_future(self.leave(timeout))

    def readiness(self) -> tuple[bool, str]:
        """Whether to send this node traffic (``/readyz``), and why: it has joined its
        cluster and caught up, is not leaving or shutting down, and (with a coordinator)
        holds its lease, so it takes writes."""
        state = self.cluster.state
        if self._writer is None:
            return False, "not started"
        if self.shutting_down.is_set():
            return False, "shutting down"
        if state == JOINING:
            return False, "joining: pulling what it will hold"
        if state != UP:
            return False, state
        if self.cluster.settling is not None:
            return False, "taking over as the primary of its keys"
        unjoined = self.cluster.reports.unjoined()
        if unjoined is not None:
            return False, f"in no cluster: {unjoined}"
        fenced = self.cluster.fenced()
        if fenced is not None:
            return False, f"takes no writes: {fenced}"
        return True, f"up at epoch {self.cluster.epoch}"

    async def shutdown(self, *, cluster: bool = True, snapshot: bool = False) -> Any:
        """Ask this node (and, with ``cluster``, every member it knows) to stop.

        Each member is told concurrently and answers at once; none hands
        anything off (they all stop). With ``snapshot``, a node with a data
        directory takes no more writes and writes its final snapshot before it
        answers (else it writes it as it stops). Then :attr:`shutting_down` is
        set: whoever runs the node stops it (``aioparamsync-node`` does, and
        exits 0). Answers a ``ShutdownResult``.
        """
        told: list[Any] = []
        unreached: list[str] = []
        if cluster:
            links = [
                link
                for link in self.cluster.links.values()
                if link.node_id and link.member_state != LEFT
            ]
            request = thrift.ShutdownRequest(cluster=False, snapshot=snapshot)

            async def tell(link: Any) -> Any:
                return await link.proxy().invoke(METHODS.shutdown, request=request)

            results = await asyncio.gather(*(tell(link) for link in links), return_exceptions=True)
            for link, result in zip(links, results, strict=True):
                if isinstance(result, Exception):
                    log.warning("could not tell %s to shut down: %s", link.name, result)
                    unreached.append(link.address)
                else:
                    told.append(result)
        wrote = False
        if snapshot and self.data_dir is not None and self._writer is not None:
            self.store.close()  # (writes are refused from now: the snapshot is the last word)
            await self._writer
            wrote = True
        log.info("node %s shutting down (asked to)", self.node_id)
        self.shutting_down.set()
        return thrift.ShutdownResult(
            stopping=1 + sum(r.stopping for r in told),
            snapshots=int(wrote) + sum(r.snapshots for r in told),
            unreached=unreached or None,
        )

    def _shutdown_requested(self, request: Any) -> asyncio.Future:
        ssl = self.config.ssl
        if ssl is not None and ssl.verify_mode != ssl_module.CERT_REQUIRED:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                "a node serving TLS without verifying its clients (no --tls-ca) takes no "
                "shutdown: anyone could stop it",
            )
        cluster = request.cluster is None or request.cluster
        return asyncio.ensure_future(
            self.shutdown(cluster=cluster, snapshot=bool(request.snapshot))
        )

    async def stop(self, grace: float = 5.0, *, leave: bool = True) -> None:
        """Stop gracefully: what was acknowledged is sent on and kept.

        In a cluster, a node that has not left yet leaves first (see
        :meth:`leave`, up to ``drain_timeout`` s), unless not ``leave``: it
        then stops as one that is to come back (its peers see it down; past
        their failure timeout, they re-replicate what it held). Then it stops accepting,
        finishes the calls in flight and sends the peer outboxes (up to
        ``grace`` s each), then applies what is queued, writes a snapshot
        (with a data directory) and closes the log.
        """
        try:
            if leave and self._writer is not None and self.cluster.state in (UP, JOINING):
                try:
                    await self.leave()
                except RequestError as exc:
                    log.error("node %s stops without leaving its cluster: %s", self.node_id, exc)
            if self._joining is not None:
                self._joining.cancel()
                await asyncio.wait({self._joining})
            if self.discovery is not None:
                await self.discovery.stop()
            if self.follower is not None:
                await self.follower.stop()
            await self.server.close(grace)
            self.service.close()
            await self.cluster.replication.drain(
                grace
            )  # what clients wrote reaches the peers that are up
            await self.cluster.stop()
            if self.coordinator is not None:
                # (a node that left is gone at once; one to come back, past its TTL)
                await self.coordinator.stop(leave=self.cluster.state == LEFT)
            self.store.close()
            if self._writer is not None:
                await self._writer  # applies what was queued; writes the last snapshot
                self._writer = None
            if self.data_dir is not None:
                self._close_files()
        finally:
            if self.metrics is not None:  # last: it can be scraped while the node drains
                await self.metrics.close()
                self.metrics = None

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
