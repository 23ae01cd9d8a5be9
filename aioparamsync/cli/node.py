"""``aioparamsync-node``: run a node until SIGINT or SIGTERM.

Its flags read sizes, seconds, ports and addresses with :mod:`.options`; the rules only a
node has (a frame size, a receive budget, a data directory, an address peers are told) are
here, and :func:`main` refuses the flags that do not go together before it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys
from collections.abc import Sequence

from .._version import __version__
from ..client.environment import ENV_PREFIX
from ..cluster.balance import DEFAULT_BALANCE_INTERVAL
from ..cluster.coordinator import (
    DEFAULT_PREFIX,
    CoordinatorError,
    check_prefix,
    parse_coordinator,
)
from ..cluster.discovery import DEFAULT_INTERVAL as DNS_INTERVAL
from ..cluster.links import DEFAULT_REPAIR_INTERVAL
from ..cluster.membership import ACKS, DEFAULT_FAILURE_TIMEOUT, UNREACHABLE_WARNING
from ..metrics import MetricsBindError
from ..node import Node, unspecified_host
from ..persistence.datadir import FSYNC_MODES, PersistenceError
from ..placement import DEFAULT_REPLICATION_FACTOR
from ..server.transport import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, ListenError
from ..store.table import Limits
from ..tls import client_context, server_context
from ..values import parallel
from ..values.partitions import DEFAULT_PARTITION_BYTES
from ..values.pieces import MAX_UPLOAD_BYTES
from ..wire import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_RECEIVING_BYTES
from ..wire.protocol import MAX_I32
from .environ import env_name, from_environment
from .memory import collect_less, keep_freed_memory
from .options import (
    TLS_ERRORS,
    address,
    addresses,
    byte_size,
    human_size,
    port_number,
    positive_int,
    positive_seconds,
    process_count,
    seconds,
)
from .processes import supervise
from .taskdump import install as install_task_dump

__all__ = ["main"]

log = logging.getLogger("aioparamsync")

DEFAULT_LIMITS = Limits()
# The flags of the node's Limits: each field's --flag, and what it bounds.
LIMIT_FLAGS = (
    ("max_names_per_request", "names one get may ask for"),
    ("max_params_per_update", "parameters one update may hold"),
    ("max_name_bytes", "longest parameter name, in UTF-8 bytes"),
)
# The smallest --max-frame-bytes worth running with.
MIN_FRAME_BYTES = 1024


def frame_size(text: str) -> int:
    value = byte_size(text)
    if not MIN_FRAME_BYTES <= value <= MAX_I32:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a frame size must lie in {MIN_FRAME_BYTES}..{MAX_I32} bytes"
        )
    return value


def receiving_size(text: str) -> int | None:
    """A receive budget: a size, or 0 for none."""
    value = byte_size(text)
    return value or None


def replication_factor(text: str) -> int | None:
    """How many nodes hold each key: a count from 1, or ``all``."""
    if text.strip().lower() == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a number of nodes from 1, or all"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 node holds each key (or all)")
    return value


def directory(text: str) -> str:
    if not text.strip():
        # (say, --data-dir "$UNSET": the node's files would go where it was started)
        raise argparse.ArgumentTypeError("an empty path: give the directory")
    return text


def advertised_address(text: str) -> tuple[str, int]:
    """An address peers are told: not ``0.0.0.0`` or ``::`` (every interface)."""
    host, port = address(text)
    if unspecified_host(host):
        raise argparse.ArgumentTypeError(
            f"{text!r} means every interface, not an address peers can reach: "
            "give this node's address on their network"
        )
    return host, port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aioparamsync-node",
        description="Run an aioparamsync parameter-server node: it holds its parameters in "
        "memory, and with --data-dir keeps them on disk too. It speaks Thrift (framed or "
        "buffered, binary or compact) on one port.",
        epilog=f"Every flag can also be set in the environment as {ENV_PREFIX}<FLAG> (e.g. "
        f"{ENV_PREFIX}PEERS for --peers, {ENV_PREFIX}DATA_DIR for --data-dir; a switch such as "
        "--ignore-corrupt-snapshot takes 1/true/yes/on or 0/false/no/off); a flag given on "
        "the command line wins over its variable.",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 or :: for every interface (with --peers, "
        "--advertise is then needed) (default: %(default)s)",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=9090,
        help="port to listen on; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--node-id", help="a stable id for this node (default: its advertised host:port)"
    )
    parser.add_argument(
        "--peers",
        type=addresses,
        default=[],
        metavar="HOST:PORT,...",
        help="members of the cluster to join; any one live member will do",
    )
    parser.add_argument(
        "--follow",
        type=addresses,
        default=[],
        metavar="HOST:PORT,...",
        help="mirror the cluster of these nodes (any one live node will do), read-only: "
        "this node takes every change of every parameter and table row there, within about "
        "a second, and serves reads, long polls and watches of them; writes are refused, "
        "naming the cluster followed. With --peers (or --peers-dns), a cluster of followers, "
        "each taking the keys it holds by its own placement. Not with --coordinator or "
        "--processes",
    )
    parser.add_argument(
        "--peers-dns",
        type=address,
        metavar="NAME:PORT",
        help="members of the cluster: every address of NAME (a Kubernetes headless "
        "Service), resolved as the node starts and again every --peers-dns-interval seconds, "
        "so members that come are joined without a list",
    )
    parser.add_argument(
        "--peers-dns-interval",
        type=positive_seconds,
        default=DNS_INTERVAL,
        metavar="SECONDS",
        help="how often --peers-dns is resolved again (default: %(default)s)",
    )
    parser.add_argument(
        "--advertise",
        type=advertised_address,
        metavar="HOST:PORT",
        help="where peers reach this node, an address they can reach (default: where it "
        "listens, which must then not be 0.0.0.0 or :: if --peers are given)",
    )
    parser.add_argument(
        "--unix-socket",
        metavar="PATH",
        help="also serve clients on this Unix socket (colocated workers connect to "
        "unix:PATH, faster than TCP on one host; no TLS there: who may connect is the "
        "file's permissions); a socket file left by a node that is gone is replaced",
    )
    parser.add_argument(
        "--no-local-socket",
        dest="local_socket",
        action="store_false",
        help="without --unix-socket or TLS a node also listens on an abstract Unix socket "
        "(Linux), which clients reaching its TCP port from this host move to, to share "
        "memory with it: this turns that off (clients on this host stay on TCP)",
    )
    parser.add_argument(
        "--processes",
        type=process_count,
        default=1,
        metavar="N",
        help="run N node processes on this host, one cluster, each holding its share of "
        "the keys (so all cores work; --replication-factor is then 1 unless given): ports "
        "PORT..PORT+N-1 (or free ones with --port 0), "
        "data in DIR/shard-I; clients may connect to any (see aioparamsync.cli.processes) "
        "(default: %(default)s)",
    )
    cluster = parser.add_argument_group("sharding and replication")
    cluster.add_argument(
        "--replication-factor",
        type=replication_factor,
        default=argparse.SUPPRESS,  # (not given: see replication_default)
        metavar="R",
        help="how many nodes hold each parameter (every node when the cluster has fewer); "
        f"'all': every node holds everything (default: {DEFAULT_REPLICATION_FACTOR}; with "
        "--processes N, 1: each process holds its 1/N share; give R to keep copies, the same "
        "R on every node of the cluster)",
    )
    cluster.add_argument(
        "--acks",
        choices=ACKS,
        default="1",
        help="when a write is answered, unless it says: '1' once its primary applied it "
        "(and logged it, with --data-dir), 'all' once every live replica did "
        "(default: %(default)s)",
    )
    cluster.add_argument(
        "--failure-timeout",
        type=positive_seconds,
        default=DEFAULT_FAILURE_TIMEOUT,
        metavar="SECONDS",
        help="how long a member may not answer before it leaves placement and the others "
        "re-replicate what it held (default: %(default)s)",
    )
    cluster.add_argument(
        "--partition-bytes",
        type=byte_size,
        default=DEFAULT_PARTITION_BYTES,
        metavar="SIZE",
        help="parameters larger than this (in elements: SIZE of float32) are stored as "
        "partitions of SIZE, each placed on its own, so a large tensor's traffic spreads over "
        "the cluster; the same on every node; 0: every parameter whole "
        f"(default: {human_size(DEFAULT_PARTITION_BYTES)})",
    )
    cluster.add_argument(
        "--drain-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="on SIGTERM or 'aioparamsync-ctl drain', the longest the node hands its keys "
        "to their next holders before it exits (default: %(default)s)",
    )
    parser.add_argument(
        "--repair-interval",
        type=positive_seconds,
        default=DEFAULT_REPAIR_INTERVAL,
        metavar="SECONDS",
        help="seconds between anti-entropy rounds with each peer (default: %(default)s)",
    )
    parser.add_argument(
        "--balance-interval",
        type=seconds,
        default=DEFAULT_BALANCE_INTERVAL,
        metavar="SECONDS",
        help="placement balanced by bytes: this often, a member that is primary of less than "
        "its share of the bytes takes keys over from the fullest (pulled first, as at a join); "
        f"0: never (keys placed by hashing alone) (default: {DEFAULT_BALANCE_INTERVAL:g})",
    )
    parser.add_argument(
        "--unreachable-warning",
        type=seconds,
        default=UNREACHABLE_WARNING,
        metavar="SECONDS",
        help="warn when no peer has answered for this long, then once a minute while none "
        f"answers; 0: never (default: {UNREACHABLE_WARNING:g})",
    )
    parser.add_argument(
        "--data-dir",
        type=directory,
        metavar="DIR",
        help="keep a write-ahead log and snapshots here, and recover from them on start "
        "(default: in memory only)",
    )
    parser.add_argument(
        "--fsync",
        choices=FSYNC_MODES,
        help="with --data-dir: 'always' syncs before each answer (survives a machine crash); "
        "'batch' syncs every 50 ms (an answered update survives kill -9; a machine crash may "
        "lose the last 50 ms); 'never' leaves it to the OS (default: batch)",
    )
    parser.add_argument(
        "--ignore-corrupt-snapshot",
        action="store_true",
        help="with --data-dir: start even if the newest snapshot is damaged, keeping what "
        "passes its checksums and replaying the log over it (losing what only its damaged "
        "parameters held); the damaged files are kept aside",
    )
    parser.add_argument(
        "--ignore-corrupt-log",
        action="store_true",
        help="with --data-dir: start even if the write-ahead log is damaged (not a torn "
        "write), from what comes before the damage (losing the updates after it); the "
        "damaged segments are kept aside",
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=frame_size,
        default=DEFAULT_MAX_FRAME_BYTES,
        metavar="SIZE",
        help="largest message accepted, e.g. 1GiB "
        f"(default: {human_size(DEFAULT_MAX_FRAME_BYTES)})",
    )
    parser.add_argument(
        "--max-upload-bytes",
        type=byte_size,
        default=MAX_UPLOAD_BYTES,
        metavar="SIZE",
        help="most bytes held at once for parameters larger than one message while their "
        f"pieces arrive, e.g. 64GiB (default: {human_size(MAX_UPLOAD_BYTES)})",
    )
    parser.add_argument(
        "--max-receiving-bytes",
        type=receiving_size,
        default=DEFAULT_MAX_RECEIVING_BYTES,
        metavar="SIZE",
        help="most bytes that large messages being received may hold at once, all "
        "connections together (the first 64 KiB of each are not counted: 128MiB takes two "
        "64 MiB parameters); a message that does not fit waits for those ahead of it, "
        "and one larger than this goes alone; 0: no limit "
        f"(default: {human_size(DEFAULT_MAX_RECEIVING_BYTES)})",
    )
    parser.add_argument(
        "--idle-timeout",
        type=seconds,
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="close connections silent this long; 0: never (default: %(default)s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="fail a call not answered within this time (default: no deadline)",
    )
    parser.add_argument(
        "--fold-threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="the most cores one fold of a large tensor (2 MiB or more) runs on, in parts, "
        "as torch runs an optimizer's step; 1: on the event loop's alone (default: this "
        "host's cores, at most 4, shared out among --processes)",
    )
    parser.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="client connections served at once; more are refused (default: %(default)s)",
    )
    for field, text in LIMIT_FLAGS:
        parser.add_argument(
            "--" + field.replace("_", "-"),
            type=positive_int,
            default=getattr(DEFAULT_LIMITS, field),
            metavar="N",
            help=text + " (default: %(default)s)",
        )
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        metavar="PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics, on --host; 0 picks a free "
        "port (logged); needs prometheus-client: pip install '.[metrics]' in the checkout "
        "(default: no metrics)",
    )
    coordinated = parser.add_argument_group("membership in etcd (see docs/cluster.md)")
    coordinated.add_argument(
        "--coordinator",
        type=coordinator_spec,
        metavar="etcd://HOST:PORT[,...]",
        help="keep the members, their states and the epoch in etcd, and take writes only "
        "while this node holds its lease there (TTL: --failure-timeout): one view of who is "
        "primary, even under partitions. With --tls-cert, etcd is reached over TLS with the "
        "node's certificate and --tls-ca. Needs aetcd: pip install '.[etcd]' in the checkout. "
        "(default: the members decide among themselves)",
    )
    coordinated.add_argument(
        "--coordinator-prefix",
        type=coordinator_prefix,
        default=DEFAULT_PREFIX,
        metavar="PATH",
        help="where in etcd this cluster's keys are: clusters with different prefixes share "
        "one etcd (default: %(default)s)",
    )
    tls = parser.add_argument_group("TLS (for client and peer links)")
    tls.add_argument("--tls-cert", metavar="PEM", help="the node's certificate chain: serve TLS")
    tls.add_argument("--tls-key", metavar="PEM", help="its private key (if not in --tls-cert)")
    tls.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="CA certificates: require clients to present a certificate they signed, and "
        "verify peers with them",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="(default: %(default)s)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def coordinator_spec(text: str) -> str:
    """``--coordinator``: checked here, parsed by the node."""
    try:
        parse_coordinator(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def coordinator_prefix(text: str) -> str:
    """``--coordinator-prefix``: a path like ``/aioparamsync/NAME``; a trailing ``/``
    (as etcd's users write a prefix: ``/job/``) is dropped."""
    trimmed = text.rstrip("/") if text.strip("/") else text  # ("/" alone: refused, below)
    try:
        return check_prefix(trimmed)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a prefix is a path like /aioparamsync/NAME (one / between its parts)"
        ) from None


def tls_contexts(
    args: argparse.Namespace,
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(server context, peer-link context) from the TLS flags."""
    if not args.tls_cert:
        if args.tls_key or args.tls_ca:
            raise ValueError("--tls-key and --tls-ca need --tls-cert")
        return None, None
    server = server_context(args.tls_cert, args.tls_key, args.tls_ca)
    peers = client_context(args.tls_ca, args.tls_cert, args.tls_key)
    return server, peers


async def serve(args: argparse.Namespace) -> int:
    try:
        server_ssl, peer_ssl = tls_contexts(args)
    except TLS_ERRORS as exc:
        print(f"aioparamsync-node: TLS: {exc}", file=sys.stderr)
        return 1
    coordinator_tls = (args.tls_ca, args.tls_cert, args.tls_key) if args.tls_cert else None
    try:
        node = Node(
            args.host,
            args.port,
            node_id=args.node_id,
            peers=args.peers,
            advertise=args.advertise,
            repair_interval=args.repair_interval,
            unreachable_warning=args.unreachable_warning,
            data_dir=args.data_dir,
            fsync=args.fsync,
            ignore_corrupt_snapshot=args.ignore_corrupt_snapshot,
            ignore_corrupt_log=args.ignore_corrupt_log,
            max_frame_bytes=args.max_frame_bytes,
            max_upload_bytes=args.max_upload_bytes,
            max_receiving_bytes=args.max_receiving_bytes,
            idle_timeout=args.idle_timeout,
            request_timeout=args.request_timeout,
            max_connections=args.max_connections,
            limits=Limits(**{field: getattr(args, field) for field, _ in LIMIT_FLAGS}),
            ssl=server_ssl,
            peer_ssl=peer_ssl,
            metrics_port=args.metrics_port,
            replication_factor=args.replication_factor,
            failure_timeout=args.failure_timeout,
            acks=args.acks,
            drain_timeout=args.drain_timeout,
            unix_socket=args.unix_socket,
            local_socket=args.local_socket,
            partition_bytes=args.partition_bytes,
            peers_dns=args.peers_dns,
            peers_dns_interval=args.peers_dns_interval,
            coordinator=args.coordinator,
            coordinator_prefix=args.coordinator_prefix,
            coordinator_tls=coordinator_tls,
            follow=args.follow,
            balance_interval=args.balance_interval or 0.0,
        )
    except CoordinatorError as exc:
        print(f"aioparamsync-node: --coordinator: {exc}", file=sys.stderr)
        return 1
    try:
        await node.start()
    except (PersistenceError, MetricsBindError, ListenError) as exc:
        print(f"aioparamsync-node: {exc}", file=sys.stderr)
        return 1
    except CoordinatorError as exc:
        print(f"aioparamsync-node: --coordinator: {exc}", file=sys.stderr)
        return 1
    except ImportError as exc:
        if exc.name != "prometheus_client":
            raise
        print(f"aioparamsync-node: --metrics-port: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"aioparamsync-node: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    install_task_dump(loop)  # (kill -USR1: what every task waits for, on stderr)
    host, port = node.address
    where = f"{host}:{port}" + (f" and unix:{args.unix_socket}" if args.unix_socket else "")
    print(f"aioparamsync-node {node.node_id} listening on {where}", flush=True)
    waits = [
        asyncio.ensure_future(stop.wait()),
        asyncio.ensure_future(node.left.wait()),  # drained: 'aioparamsync-ctl drain'
        asyncio.ensure_future(node.shutting_down.wait()),  # 'aioparamsync-ctl shutdown'
    ]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    log.info("shutting down")
    # (told to shut down, the whole cluster stops: nothing to hand off, nor anyone to take it)
    await node.stop(leave=not node.shutting_down.is_set())
    log.info("stopped")
    return 0


def replication_default(args: argparse.Namespace) -> int:
    """The replication factor when ``--replication-factor`` is not given.

    N processes on one host are there for its cores: each holds its share of
    the keys (R = 1), not a copy of most of them, as R = 3 would have it.
    """
    return 1 if args.processes > 1 else DEFAULT_REPLICATION_FACTOR


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [*from_environment(parser, argv, os.environ), *argv]
    args = parser.parse_args(argv)
    if args.data_dir is None and (
        args.fsync or args.ignore_corrupt_snapshot or args.ignore_corrupt_log
    ):
        # (a node in memory that was meant to keep its data)
        parser.error("--fsync, --ignore-corrupt-snapshot and --ignore-corrupt-log need --data-dir")
    if (args.peers or args.peers_dns) and args.advertise is None and unspecified_host(args.host):
        # (peers would be told HOST:PORT, and reach themselves or nothing)
        given = "--peers" if args.peers else "--peers-dns"
        parser.error(
            f"--host {args.host} listens on every interface, which is no address to give "
            f"peers: with {given}, pass --advertise HOST:PORT with an address the peers can "
            "reach"
        )
    if args.follow and (args.coordinator or args.processes > 1):
        parser.error(
            "--follow makes a read-only mirror of another cluster: not with --coordinator or "
            "--processes (a cluster of followers is made with --peers among them)"
        )
    args.fsync = args.fsync or "batch"
    if "replication_factor" not in vars(args):
        args.replication_factor = replication_default(args)
        if args.processes > 1:  # (the processes are told it: their own default is 3)
            argv = [*argv, "--replication-factor", str(args.replication_factor)]
    if args.processes > 1:
        if args.advertise is None and unspecified_host(args.host):
            parser.error(
                f"--processes with --host {args.host}: pass --advertise HOST:PORT (process I "
                "is told HOST:PORT+I), an address the processes reach each other at"
            )
        if args.advertise is not None and args.port == 0:
            parser.error("--processes with --advertise needs a --port (not 0)")
        flags = [env_name(f) for a in parser._actions for f in a.option_strings]
        return asyncio.run(supervise(args.processes, argv, args, os.environ, flags))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvloop

    keep_freed_memory()  # (see cli/memory.py)
    collect_less()
    if args.fold_threads is not None:
        parallel.set_threads(args.fold_threads)
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
