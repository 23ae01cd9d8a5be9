"""Prometheus metrics for a node: ``Node(metrics_port=...)``, ``aioparamsync-node --metrics-port``.

Needs the ``prometheus-client`` package (``pip install '.[metrics]'`` in the checkout);
it is imported only when a node's metrics are enabled, so ``import aioparamsync``
never loads it.

Theory of operation. Each node has its own ``CollectorRegistry`` (never the
process-wide default one, so several nodes in one process do not clash), with
one custom collector that reads, at scrape time, what the node counts anyway:
the server's ``counters`` and open connections, the store's ``statistics()``
and each peer link's state and counters. The only thing measured for metrics
alone is each call's latency: while :attr:`Server.call_observer` is set, the
server stamps a call with ``time.perf_counter()`` as it dispatches it and, as
the call is settled, hands ``(method, seconds, error)`` to :class:`CallStats`,
which keeps per-method histograms and error counts in plain lists and
counters (a few hundred nanoseconds a call; nothing at all when metrics are
off but one attribute test).

The endpoint is ``prometheus_client``'s own HTTP server, whose thread (and one
thread per scrape) runs off the event loop, so a scrape never delays a call.
The collector therefore reads the node's state from another thread: every read
is a single attribute, ``len()``, ``dict.get`` or copy of a list or dict, each
atomic under the GIL, so a scrape never sees a half-changed structure, though
its values may come from slightly different moments.

Metrics (every name starts with ``aioparamsync_``):

- calls: ``requests_total{method}`` (calls answered, or failed),
  ``request_duration_seconds{method}`` (histogram, from dispatch to the reply
  being ready, including a read's wait for the writes before it),
  ``request_errors_total{method,code}`` (refused with an ``ErrorCode``; a
  call past ``request_timeout`` counts as ``UNAVAILABLE``),
  ``internal_errors_total{method}`` (failed otherwise, or cancelled at
  shutdown);
- the server: ``messages_received_total`` (every whole message read, valid
  or not; bytes that are not even one are a protocol error),
  ``errors_total`` (every error reply, unknown methods included),
  ``protocol_errors_total``, ``request_timeouts_total``,
  ``received_bytes_total``, ``sent_bytes_total``, ``open_connections``,
  ``connections_opened_total``, ``connections_refused_total``,
  ``connections_idle_closed_total``; the receive budget:
  ``receiving_bytes`` (held by large messages being received, as the
  budget counts them: beyond each one's first 64 KiB),
  ``messages_waiting_to_receive``, ``receive_waits_total`` (messages that
  waited for room), ``receive_budget_overruns_total`` (let in beyond it,
  past stalled ones);
- the store: ``parameters``, ``parameter_bytes``, ``pending_updates``,
  ``batches_total``, ``updates_applied_total``, ``updates_refused_total``;
- training: ``long_polls_waiting``, ``barrier_waiters``, ``barrier_groups``,
  ``wait_timeouts_total``, ``gradient_pushes_repeated_total``,
  ``gradient_pushes_forwarded_total``, ``gradient_forward_failures_total``,
  ``gradient_pushes_in_doubt_total``, ``row_pushes_in_doubt_total`` (parts of
  pushes sent again, held back: an earlier try is in doubt at a node out of reach);
- each peer (label ``peer``, its ``host:port``): ``peer_outbox_depth``,
  ``peer_updates_sent_total``, ``peer_updates_coalesced_total``,
  ``peer_send_failures_total``, ``peer_repaired_total``,
  ``peer_lag_seconds`` (how long the oldest update waiting for it has
  waited), ``peer_state{peer,state}`` (1 for its state, 0 for the others),
  ``peer_info{peer,node_id}``;
- ``node_info{node_id,version}``, and the ``process_*`` metrics.

The same port answers the probes of an orchestrator (Kubernetes' liveness and
readiness): ``/healthz`` is 200 while the node's event loop runs a callback
within ``HEALTH_WAIT`` seconds (503: it is stuck, restart it), ``/readyz`` 200
while the node has joined and caught up (503 while it joins, takes its keys
over, leaves or shuts down: send it no traffic); each says why in a line.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from ._ext import fast_path
from ._version import __version__
from .cluster.links import LinkState
from .errors import ErrorCode, RequestError
from .wire import method, thrift

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.registry import CollectorRegistry

    from .cluster.membership import Cluster
    from .server.handlers import ParameterService
    from .server.transport import Server
    from .store.writer import ParameterStore

__all__ = ["LATENCY_BUCKETS", "CallStats", "MetricsBindError", "NodeMetrics"]

# The states a member may be in (member_state's label; see aioparamsync.placement).
MEMBER_STATES = ("joining", "up", "down", "failed", "leaving", "left")

log = logging.getLogger(__name__)

# How long /healthz waits for the event loop to run a callback (seconds).
HEALTH_WAIT = 5.0


class Metered(Protocol):
    """The parts of a node its metrics read (a :class:`~aioparamsync.node.Node` has them)."""

    @property
    def node_id(self) -> str: ...

    server: Server
    store: ParameterStore
    service: ParameterService
    cluster: Cluster

    def readiness(self) -> tuple[bool, str]: ...


# Upper bounds of the latency histograms' buckets (seconds).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
# Every state a peer link can be in (see PeerLink).
PEER_STATES = (LinkState.CONNECTING, LinkState.UP, LinkState.BACKOFF, LinkState.REFUSED)
PREFIX = "aioparamsync_"
# Each peer link's counters: the link's attribute (its metric is peer_ATTRIBUTE), its help.
PEER_COUNTERS = (
    ("updates_sent", "Parameters sent to the peer."),
    (
        "updates_coalesced",
        "Parameter updates replaced in the outbox by a newer one before being sent.",
    ),
    ("send_failures", "Failed sends to the peer."),
    ("repaired", "Parameters pulled from the peer by repair."),
)

MISSING = (
    "metrics need the prometheus-client package: pip install '.[metrics]' in the "
    "aioparamsync checkout (or pip install prometheus-client)"
)


class MetricsBindError(OSError):
    """The metrics endpoint cannot listen on its address (e.g. the port is in use)."""


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _MethodStats:
    __slots__ = ("counts", "seconds")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets  # per bucket, not cumulative; the last is +Inf
        self.seconds = 0.0


class CallStats:
    """Per-method call latencies and errors, fed by the server's call observer.

    Written only from the event loop's thread (:meth:`observe`); read from any
    (:meth:`snapshot`).
    """

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(sorted(buckets))
        self.methods: dict[str, _MethodStats] = {}
        self.request_errors: collections.Counter[tuple[str, str]] = collections.Counter()
        self.internal_errors: collections.Counter[str] = collections.Counter()
        # Every method of the IDL, from 0: rates work from the first scrape.
        for name in thrift.ParameterSyncService.thrift_services:
            if method(name) is not None:
                self.methods[name] = _MethodStats(len(self.bounds) + 1)

    def observe(self, name: str, seconds: float, exc: BaseException | None) -> None:
        """One call of ``name`` took ``seconds`` and failed with ``exc`` (None: it succeeded)."""
        stats = self.methods.get(name)
        if stats is None:
            stats = self.methods[name] = _MethodStats(len(self.bounds) + 1)
        stats.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        stats.seconds += seconds
        if exc is not None:
            if isinstance(exc, RequestError):
                code = exc.code.name if isinstance(exc.code, ErrorCode) else str(exc.code)
                self.request_errors[name, code] += 1
            else:
                self.internal_errors[name] += 1

    def snapshot(
        self,
    ) -> tuple[list[tuple[str, list[int], float]], dict[tuple[str, str], int], dict[str, int]]:
        """(method, counts per bucket, seconds in all) of each method; the errors by kind."""
        methods = [(name, list(s.counts), s.seconds) for name, s in list(self.methods.items())]
        return methods, dict(self.request_errors), dict(self.internal_errors)


class _NodeCollector:
    """Reads a node's live counters at scrape time (see the module's docstring)."""

    def __init__(self, node: Metered, calls: CallStats) -> None:
        self.node = node
        self.calls = calls

    def describe(self) -> list[Any]:
        return []  # nothing to check for clashes: the registry is this node's alone

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        node = self.node

        def counter(name: str, doc: str, value: float) -> Any:
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> Any:
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        info = InfoMetricFamily(PREFIX + "node", "This node.")
        info.add_metric(
            [], {"node_id": node.node_id, "version": __version__, "fast_path": fast_path()}
        )
        yield info

        # -- calls ------------------------------------------------------------------
        methods, request_errors, internal_errors = self.calls.snapshot()
        requests = CounterMetricFamily(
            PREFIX + "requests", "Calls answered (or failed), by method.", labels=["method"]
        )
        latency = HistogramMetricFamily(
            PREFIX + "request_duration_seconds",
            "Seconds from a call's dispatch to its reply being ready, by method.",
            labels=["method"],
        )
        bounds = [*map(floatToGoString, self.calls.bounds), "+Inf"]
        for name, counts, seconds in methods:
            cumulative, buckets = 0, []
            for le, n in zip(bounds, counts, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            requests.add_metric([name], cumulative)
            latency.add_metric([name], buckets, sum_value=seconds)
        yield requests
        yield latency
        refused = CounterMetricFamily(
            PREFIX + "request_errors",
            "Calls refused with an error code (ParameterError), by method and code.",
            labels=["method", "code"],
        )
        for (name, code), n in sorted(request_errors.items()):
            refused.add_metric([name, code], n)
        yield refused
        failed = CounterMetricFamily(
            PREFIX + "internal_errors",
            "Calls that failed in the node (or were cancelled at shutdown), by method.",
            labels=["method"],
        )
        for name, n in sorted(internal_errors.items()):
            failed.add_metric([name], n)
        yield failed

        # -- the server -------------------------------------------------------------
        server = node.server
        c = server.counters
        yield counter(
            "messages_received", "Whole messages received, valid or not.", c.get("requests", 0)
        )
        yield counter(
            "errors", "Error replies (every kind, unknown methods included).", c.get("errors", 0)
        )
        yield counter(
            "protocol_errors",
            "Bytes that were not valid messages (each closes its connection).",
            c.get("protocol_errors", 0),
        )
        yield counter(
            "request_timeouts",
            "Calls not answered within the request timeout.",
            c.get("timeouts", 0),
        )
        yield counter("received_bytes", "Bytes received from clients.", c.get("bytes_in", 0))
        yield counter("sent_bytes", "Bytes of replies sent to clients.", c.get("bytes_out", 0))
        yield gauge("open_connections", "Client connections open.", len(server.connections))
        yield counter(
            "connections_opened", "Client connections accepted.", c.get("connections_total", 0)
        )
        yield counter(
            "connections_refused",
            "Client connections refused (max connections).",
            c.get("connections_refused", 0),
        )
        yield counter(
            "connections_idle_closed",
            "Client connections closed for idleness.",
            c.get("idle_closed", 0),
        )
        budget = server.budget
        yield gauge(
            "receiving_bytes",
            "Bytes held by large messages being received (the receive budget in use).",
            budget.in_use,
        )
        yield gauge(
            "messages_waiting_to_receive",
            "Large messages waiting for room in the receive budget.",
            budget.waiting,
        )
        yield counter(
            "receive_waits",
            "Large messages that waited for room in the receive budget.",
            c.get("budget_waits", 0),
        )
        yield counter(
            "receive_budget_overruns",
            "Large messages let in beyond the receive budget, past stalled ones.",
            c.get("budget_overruns", 0),
        )

        # -- the store --------------------------------------------------------------
        s = node.store.statistics()
        yield gauge("parameters", "Parameters held.", s["parameters"])
        yield gauge("parameter_bytes", "Bytes of parameter data held.", s["parameter_bytes"])
        yield gauge("pending_updates", "Updates waiting for the store's writer.", s["pending"])
        yield counter("batches", "Batches of updates the writer applied.", s["batches"])
        yield counter("updates_applied", "Updates applied.", s["updates_applied"])
        yield counter("updates_refused", "Updates refused.", s["updates_refused"])

        r = node.service.rows.tables.statistics()
        yield gauge("tables", "Embedding tables this node knows.", r["tables"])
        yield gauge("table_rows", "Rows of embedding tables held here.", r["rows"])
        yield gauge("table_bytes", "Bytes of tables' rows (and their state) held.", r["row_bytes"])

        # -- training: waits and gradients --------------------------------------------
        service = node.service
        w = service.waiting.statistics()
        yield gauge("long_polls_waiting", "Long polls held, waiting.", w["long_polls_waiting"])
        yield gauge("barrier_waiters", "Workers held at barriers.", w["barrier_waiters"])
        yield gauge("barrier_groups", "Barrier groups the node keeps.", w["barrier_groups"])
        yield counter(
            "wait_timeouts",
            "Long polls and barriers that reached their deadline.",
            w["wait_timeouts"],
        )
        yield counter(
            "gradient_pushes_repeated",
            "Gradient pushes answered from an earlier push with their request id.",
            service.gradients.ledger.repeated,
        )
        yield counter(
            "gradient_pushes_forwarded",
            "Parts of gradient pushes folded by their owner, another node.",
            service.gradients.forwarded,
        )
        received = CounterMetricFamily(
            PREFIX + "gradients_received",
            "Gradients received from clients, by the encoding they came in (none: raw).",
            labels=["encoding"],
        )
        for encoding, n in sorted(service.gradients.encodings.items()):
            received.add_metric([encoding], n)
        yield received
        yield counter(
            "gradient_forward_failures",
            "Parts of gradient pushes whose owner could not be reached (folded here).",
            service.forward_failures,
        )
        for kind, in_doubt in (
            ("gradient", service.gradients.in_doubt),
            ("row", service.rows.in_doubt),
        ):
            yield counter(
                f"{kind}_pushes_in_doubt",
                f"Parts of {kind} pushes sent again and held back (INDETERMINATE): an earlier "
                "try passed them on to a node that did not answer and cannot be reached now.",
                in_doubt.refused,
            )

        # -- following another cluster (see aioparamsync.follower) ---------------------
        if service.following is not None:
            f = {k: v for hook in service.statistics_hooks for k, v in hook().items()}
            yield gauge(
                "follow_lag_seconds",
                "How long the oldest change heard of from the cluster followed has waited.",
                f["follow_lag_ms"] / 1000,
            )
            yield gauge(
                "follow_versions_behind",
                "Versions heard of from the cluster followed and not held here yet.",
                f["follow_versions_behind"],
            )
            yield counter(
                "follow_keys_pulled",
                "Keys read from the cluster followed and merged here.",
                f["follow_keys_pulled"],
            )

        # -- the cluster: topology, placement, moves -----------------------------------
        cluster = node.cluster
        yield gauge(
            "cluster_epoch", "The epoch of the topology as this node sees it.", cluster.epoch
        )
        yield gauge(
            "replication_factor",
            "How many nodes hold each key (0: every node).",
            cluster.replication_factor or 0,
        )
        yield gauge(
            "keys_moving", "Keys held here that are being handed off.", cluster.rebalancer.moving
        )
        yield gauge(
            "under_replicated_keys",
            "Keys this node is primary of with a replica not live.",
            cluster.rebalancer.under_replicated,
        )
        yield counter(
            "keys_handed_off",
            "Keys dropped here once their new holders had them.",
            cluster.rebalancer.handed_off,
        )
        yield counter(
            "requests_passed_on",
            "Parts of requests passed on to the node holding them.",
            service.router.passed_on,
        )
        members = GaugeMetricFamily(
            PREFIX + "member_state",
            "Each member's state as this node sees it: 1 for the one it is in.",
            labels=["member", "state"],
        )
        for m in list(cluster.topology().members):
            for name in MEMBER_STATES:
                members.add_metric([m.node_id, name], 1.0 if name == m.state else 0.0)
        yield members

        # -- the peers --------------------------------------------------------------
        labels = ["peer"]
        depth = GaugeMetricFamily(
            PREFIX + "peer_outbox_depth",
            "Parameters waiting to be sent to the peer.",
            labels=labels,
        )
        peer_counts = [
            (CounterMetricFamily(PREFIX + "peer_" + attribute, doc, labels=labels), attribute)
            for attribute, doc in PEER_COUNTERS
        ]
        lag = GaugeMetricFamily(
            PREFIX + "peer_lag_seconds",
            "How long the oldest update waiting for the peer has waited (replication lag).",
            labels=labels,
        )
        state = GaugeMetricFamily(
            PREFIX + "peer_state",
            "The link's state: 1 for the one it is in.",
            labels=["peer", "state"],
        )
        peer_info = InfoMetricFamily(PREFIX + "peer", "Each peer's node id.", labels=labels)
        for link in list(node.cluster.links.values()):
            peer = [link.address]
            depth.add_metric(peer, len(link.outbox))
            for family, attribute in peer_counts:
                family.add_metric(peer, getattr(link, attribute))
            try:
                seconds_behind = link.lag
            except TypeError:  # its outbox drained between lag's two reads of its start
                seconds_behind = 0.0
            lag.add_metric(peer, seconds_behind)
            current = link.state
            for name in dict.fromkeys((*PEER_STATES, current)):
                state.add_metric([link.address, name], 1.0 if name == current else 0.0)
            peer_info.add_metric(peer, {"node_id": link.node_id})
        yield depth
        yield from (family for family, _ in peer_counts)
        yield from (lag, state, peer_info)


class NodeMetrics:
    """A node's metrics: its registry, the call statistics and the HTTP endpoint.

    Creating it hooks :class:`CallStats` into the node's server.

    Raises:
        ImportError: ``prometheus-client`` is not installed.
    """

    def __init__(self, node: Metered) -> None:
        try:
            from prometheus_client import CollectorRegistry, ProcessCollector
        except ImportError as exc:
            raise ImportError(MISSING, name="prometheus_client") from exc
        self.calls = CallStats()
        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.registry.register(_NodeCollector(node, self.calls))
        ProcessCollector(registry=self.registry)
        node.server.call_observer = self.calls.observe
        self._node = node
        self._loop: asyncio.AbstractEventLoop | None = None
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) the endpoint listens on; None when it does not."""
        if self._httpd is None:
            return None
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def start(self, host: str, port: int) -> None:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` from a thread.

        Raises:
            MetricsBindError: the address cannot be listened on.
        """
        self._loop = asyncio.get_running_loop()
        try:
            self._httpd, self._thread = _serve(host, port, self._app())
        except OSError as exc:
            error = MetricsBindError(
                f"cannot serve metrics on {_hostport(host, port)}: {exc.strerror or exc}"
            )
            error.errno = exc.errno
            raise error from exc
        assert self.address is not None
        log.info("metrics on http://%s/metrics", _hostport(*self.address))

    def _app(self) -> Any:
        """The WSGI app: the probes, and the metrics at every other path."""
        from prometheus_client import make_wsgi_app

        metrics = make_wsgi_app(self.registry)
        probes = {"/healthz": self.alive, "/readyz": self._node.readiness}

        def app(environ: dict[str, Any], start_response: Any) -> Any:
            probe = probes.get(environ.get("PATH_INFO", ""))
            if probe is None:
                return metrics(environ, start_response)
            ok, why = probe()
            status = "200 OK" if ok else "503 Service Unavailable"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [f"{why}\n".encode()]

        return app

    def alive(self) -> tuple[bool, str]:
        """Whether the event loop runs a callback within ``HEALTH_WAIT`` s (from a thread)."""
        loop, ran = self._loop, threading.Event()
        try:
            if loop is None:
                raise RuntimeError("not started")
            loop.call_soon_threadsafe(ran.set)
        except RuntimeError as exc:  # (a closed loop)
            return False, f"the event loop is gone: {exc}"
        if not ran.wait(HEALTH_WAIT):
            return False, f"the event loop did not answer in {HEALTH_WAIT:g} s"
        return True, "alive"

    async def close(self) -> None:
        """Stop the endpoint and release its port (the call statistics stay)."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is None:
            return

        def stop() -> None:
            httpd.shutdown()  # waits for serve_forever's next poll (<= 0.5 s)
            httpd.server_close()
            if thread is not None:
                thread.join()

        await asyncio.to_thread(stop)


def _serve(host: str, port: int, app: Any) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``app`` on ``host:port`` from a daemon thread, one thread per request."""
    import socket
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # (scrapes are not news)
            pass

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, app, Server, handler_class=Quiet)
    thread = threading.Thread(target=httpd.serve_forever, name="aioparamsync-metrics", daemon=True)
    thread.start()
    return httpd, thread
