"""``aioparamsync-ctl``: inspect a running node from a shell.

::

    aioparamsync-ctl stats 127.0.0.1:9090        # id, version, parameters, uptime, counters
    aioparamsync-ctl peers 127.0.0.1:9090        # the node's peer links, as a table
    aioparamsync-ctl waiting 127.0.0.1:9090      # long polls and barriers: who waits for whom
    aioparamsync-ctl get 127.0.0.1:9090 w b      # version, origin, dtype, shape, a preview
    aioparamsync-ctl list 127.0.0.1:9090 layer1. # names (from a prefix), dtype, shape, size
    aioparamsync-ctl ping 127.0.0.1:9090         # the node's id and a round trip
    aioparamsync-ctl --json stats 127.0.0.1:9090 # any of them, as JSON

Exit codes: 0 done; 1 the node could not be reached, did not answer in time,
refused, or is no node (one line on stderr); 2 bad arguments; 3 ``get`` found
some name not on the node (what it found is still shown).

It only reads: no command changes the node.

Here are its parser (the flags' values read by :mod:`.options`), its
commands (each asks the node, then prints with :mod:`.output`), and the
running of one, with what goes wrong said in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl as ssl_module
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .._version import __version__
from ..client.api import ParameterClient
from ..cluster.links import LinkState
from ..errors import ParamSyncError, ProtocolError, RequestError, ServerError
from ..tls import client_context
from ..values.arrays import from_parameter
from ..wire import METHODS, thrift
from ..wire.protocol import MAX_I32
from .options import TLS_ERRORS, address, positive_seconds
from .output import (
    dtype_name,
    format_duration,
    format_fields,
    format_preview,
    format_size,
    format_table,
    format_timestamp,
    print_json,
    print_parameter,
)

__all__ = ["build_parser", "main"]

PROG = "aioparamsync-ctl"
# Default deadline of connecting, and of each call (seconds).
DEFAULT_TIMEOUT = 5.0
# Exit codes.
OK, FAILED, NOT_FOUND = 0, 1, 3  # (2: bad arguments, as argparse exits)


# -- arguments ------------------------------------------------------------------------------


def _address(text: str) -> str:
    host, port = address(text)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _prefix(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave it out to list every name)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # (bytes the shell passed that are not UTF-8)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid UTF-8, so no parameter's name starts with it"
        ) from None
    return text


# The options every command takes, before or after its name, and their defaults.
DEFAULTS: dict[str, Any] = {
    "json": False,
    "timeout": DEFAULT_TIMEOUT,
    "tls": False,
    "tls_ca": None,
    "tls_cert": None,
    "tls_key": None,
}


def _add_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """Add the options every command takes; without ``defaults``, an option left
    out leaves the value alone (so ``--json`` may come before the command or after it)."""

    def default(name: str) -> Any:
        return DEFAULTS[name] if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--json", action="store_true", default=default("json"), help="print one JSON document"
    )
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=default("timeout"),
        metavar="SECONDS",
        help=f"deadline of connecting and of each call (default: {DEFAULT_TIMEOUT:g})",
    )
    tls = parser.add_argument_group("TLS (for a node started with --tls-cert)")
    tls.add_argument("--tls", action="store_true", default=default("tls"), help="connect with TLS")
    tls.add_argument(
        "--tls-ca",
        metavar="PEM",
        default=default("tls_ca"),
        help="CA certificates to verify the node with (implies --tls; default: the system's)",
    )
    tls.add_argument(
        "--tls-cert",
        metavar="PEM",
        default=default("tls_cert"),
        help="a client certificate, for a node that requires one (implies --tls)",
    )
    tls.add_argument(
        "--tls-key",
        metavar="PEM",
        default=default("tls_key"),
        help="its private key (if not in --tls-cert)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect a running aioparamsync node and its cluster. No command "
        "changes it, but drain, which makes it leave its cluster, and shutdown, which stops "
        "the cluster.",
        epilog="Exit codes: 0 done; 1 the node could not be reached, did not answer in time, "
        "refused, or is no node; 2 bad arguments; 3 (get) some name is not on the node.",
    )
    _add_options(parser, defaults=True)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=summary, description=summary, prog=f"{PROG} {name}")
        _add_options(sub, defaults=False)
        sub.add_argument("address", type=_address, metavar="ADDRESS", help="the node's host:port")
        return sub

    command("stats", "the node's id, version, parameters, timestamp, uptime and counters")
    command("peers", "the node's peer links: state, outbox, updates sent, failures, lag")
    command("waiting", "the long polls and barriers the node holds, and whom each waits for")
    get = command("get", "parameters: version, origin, dtype, shape and a preview of the value")
    get.add_argument("names", nargs="+", metavar="NAME", help="a parameter's name")
    listing = command("list", "the parameters' names, dtypes, shapes, versions and sizes")
    listing.add_argument(
        "prefix",
        nargs="?",
        type=_prefix,
        metavar="PREFIX",
        help="only the names that start with it (plain text, not a pattern)",
    )
    command("ping", "the node's id and the round trip of one call")
    command(
        "topology",
        "the cluster as the node sees it: epoch, replication factor, each member's state, "
        "and what each member up holds, is moving and has under-replicated",
    )
    drain = command(
        "drain",
        "make the node leave its cluster: it hands every key to its next holders, then exits",
    )
    drain.add_argument(
        "--wait",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="the longest the node hands keys off before it leaves anyway (default: its "
        "--drain-timeout); the command's --timeout should be longer",
    )
    shutdown = command(
        "shutdown",
        "stop every node of the node's cluster (none hands anything off), so a job ends",
    )
    shutdown.add_argument(
        "--snapshot",
        action="store_true",
        help="each node with a data directory takes no more writes and writes its final "
        "snapshot before it answers (else it writes it as it stops)",
    )
    shutdown.add_argument(
        "--only-this-node",
        action="store_true",
        help="stop this node alone (its peers see it down, as a node to come back)",
    )
    return parser


# -- the commands ---------------------------------------------------------------------------


def _peer(p: Any) -> dict[str, Any]:
    """What ``stats`` and ``peers`` show of a peer link in JSON."""
    return {
        "node_id": p.node_id,
        "address": p.address,
        "state": p.state,
        "outbox_depth": p.outbox_depth,
        "updates_sent": p.updates_sent,
        "updates_coalesced": p.updates_coalesced,
        "send_failures": p.send_failures,
        "lag_seconds": p.lag_seconds,
        "last_error": p.last_error or "",
        "repaired": p.repaired,
    }


async def stats(client: ParameterClient, args: argparse.Namespace) -> int:
    info = await client.info()
    peers = info.peers or []
    if args.json:
        print_json(
            {
                "node_id": info.node_id,
                "version": info.version,
                "fast_path": info.fast_path,
                "parameter_count": info.parameter_count,
                "parameter_bytes": info.parameter_bytes,
                "timestamp": info.timestamp,
                "uptime_seconds": info.uptime_seconds,
                "counters": dict(sorted(info.counters.items())),
                "peers": [_peer(p) for p in peers],
                **(
                    {"coordinator": info.coordinator, "fenced": info.fenced}
                    if info.coordinator
                    else {}
                ),
            }
        )
        return OK
    up = sum(p.state == LinkState.UP for p in peers)
    print(
        format_fields(
            [
                ("node", info.node_id),
                ("version", info.version),
                ("fast path", info.fast_path or "-"),
                ("parameters", f"{info.parameter_count} ({format_size(info.parameter_bytes)})"),
                ("timestamp", format_timestamp(info.timestamp, info.parameter_count)),
                ("uptime", format_duration(info.uptime_seconds)),
                ("peers", f"{len(peers)} ({up} up)"),
                *(
                    [("coordinator", info.coordinator), ("writes", info.fenced or "taken")]
                    if info.coordinator
                    else []
                ),
            ]
        )
    )
    if info.counters:
        print("counters")
        print(format_fields(sorted(info.counters.items()), indent="  "))
    return OK


async def peers(client: ParameterClient, args: argparse.Namespace) -> int:
    info = await client.info()
    links = sorted(info.peers or [], key=lambda p: (p.node_id, p.address))
    if args.json:
        print_json({"node_id": info.node_id, "peers": [_peer(p) for p in links]})
        return OK
    if not links:
        print(f"{info.node_id} has no peers")
        return OK
    header = ["NODE", "ADDRESS", "STATE", "OUTBOX", "SENT", "COALESCED", "FAILURES", "LAG"]
    rows = [
        [
            p.node_id or "?",
            p.address,
            p.state,
            p.outbox_depth,
            p.updates_sent,
            p.updates_coalesced,
            p.send_failures,
            f"{p.lag_seconds:.3f} s",
        ]
        for p in links
    ]
    print(format_table(header, rows, right={3, 4, 5, 6, 7}))
    for p in links:
        if p.last_error:
            print(f"{p.node_id or p.address}: last error: {p.last_error}")
    return OK


async def waiting(client: ParameterClient, args: argparse.Namespace) -> int:
    info = await client.info()
    held = sorted(info.waiting or [], key=lambda w: -w.seconds)
    if args.json:
        document = [
            {
                "kind": w.kind,
                "what": w.what,
                "who": w.who or "",
                "seconds": w.seconds,
                "waiting_for": list(w.waiting_for),
            }
            for w in held
        ]
        print_json({"node_id": info.node_id, "waiting": document})
        return OK
    if not held:
        print(f"{info.node_id} holds no long polls or barriers")
        return OK
    header = ["KIND", "WHO", "FOR", "WAITING", "WAITING FOR"]
    rows = [
        [w.kind, w.who or "-", w.what, format_duration(w.seconds), ", ".join(w.waiting_for)]
        for w in held
    ]
    print(format_table(header, rows, right={3}))
    return OK


async def get(client: ParameterClient, args: argparse.Namespace) -> int:
    names = list(dict.fromkeys(args.names))  # each once, in the order given
    response = await client.get_parameters(names)
    found = {p.name: p for p in response.params}
    missing = [name for name in names if name not in found]
    shown = []
    for name in names:
        if name not in found:
            continue
        p = found[name]
        array = from_parameter(p)  # a parameter sent without a dtype reads as bytes
        item = {
            "name": name,
            "version": p.version,
            "origin": p.origin,
            "dtype": p.dtype,
            "shape": list(p.shape) if p.shape is not None else None,
            "nbytes": array.nbytes,
        }
        shown.append((item, array))
    if args.json:
        documents = [{**item, "preview": format_preview(array, prefix="")} for item, array in shown]
        print_json({"parameters": documents, "missing": missing})
    else:
        for item, array in shown:
            print_parameter(item, array)
    for name in missing:
        print(f"{PROG}: no parameter {name!r} on {client.host}:{client.port}", file=sys.stderr)
    return NOT_FOUND if missing else OK


async def list_parameters(client: ParameterClient, args: argparse.Namespace) -> int:
    # max_inline_bytes=0: the node answers every parameter that holds any
    # bytes without them, as a header (dtype, shape, version, total_bytes), so
    # listing a node costs a few bytes a parameter, not its data.
    request = thrift.ParameterRequest(param_names=[], all_names=True, max_inline_bytes=0)
    response = await client.invoke(METHODS.pull_parameters, request=request)
    prefix = args.prefix or ""
    params = sorted((p for p in response.params if p.name.startswith(prefix)), key=lambda p: p.name)
    items = [_listed(p) for p in params]
    total = sum(item["nbytes"] for item in items)
    if args.json:
        print_json({"parameters": items, "count": len(items), "nbytes": total})
        return OK
    if not items:
        where = f"{client.host}:{client.port}"
        if not prefix:
            print(f"{where} holds no parameters")
            return OK
        # (a name may hold "*": the prefix is matched as it is)
        hint = " (PREFIX is plain text, not a pattern)" if any(c in prefix for c in "*?[") else ""
        print(f"{where} holds no parameter whose name starts with {prefix!r}{hint}")
        return OK
    header = ["NAME", "DTYPE", "SHAPE", "VERSION", "BYTES"]
    rows = [
        [
            item["name"],
            dtype_name(item["dtype"]),
            "-" if item["shape"] is None else str(tuple(item["shape"])),
            item["version"],
            format_size(item["nbytes"]),
        ]
        for item in items
    ]
    print(format_table(header, rows, right={3, 4}))
    print(f"{len(items)} parameter{'' if len(items) == 1 else 's'}, {format_size(total)}")
    return OK


def _listed(p: Any) -> dict[str, Any]:
    """What ``list`` shows of a parameter the node answered, with or without its data."""
    return {
        "name": p.name,
        "version": p.version,
        "origin": p.origin,
        "dtype": p.dtype,  # None: plain bytes
        "shape": list(p.shape) if p.shape is not None and p.dtype is not None else None,
        "nbytes": p.total_bytes if p.total_bytes is not None else memoryview(p.data).nbytes,
    }


async def ping(client: ParameterClient, args: argparse.Namespace) -> int:
    await client.ping()  # connects
    started = time.perf_counter()
    node_id = await client.ping()  # one round trip on the open connection
    rtt_ms = (time.perf_counter() - started) * 1000
    address = f"{client.host}:{client.port}"
    if args.json:
        print_json({"address": address, "node_id": node_id, "rtt_ms": round(rtt_ms, 3)})
    else:
        print(f"{address}: {node_id} answered in {rtt_ms:.2f} ms")
    return OK


async def topology(client: ParameterClient, args: argparse.Namespace) -> int:
    answer = await client.topology()
    members = sorted(answer.members, key=lambda m: m.node_id)

    async def held(m: Any) -> Any:
        if m.state not in ("up", "leaving"):
            return None
        other = ParameterClient(
            (m.host, m.port),
            timeout=args.timeout,
            connect_timeout=args.timeout,
            max_connections=1,
            ssl=client.ssl,
            route=False,
        )
        try:
            return await other.info()
        except ParamSyncError:
            return None
        finally:
            await other.close()

    infos = await asyncio.gather(*(held(m) for m in members))
    r = answer.replication_factor or "all"
    rows = []
    document = []
    for m, info in zip(members, infos, strict=True):
        item = {
            "node_id": m.node_id,
            "address": f"{m.host}:{m.port}",
            "state": m.state,
            "keys": info.parameter_count if info else None,
            "bytes": info.parameter_bytes if info else None,
            "keys_moving": info.keys_moving if info else None,
            "under_replicated": info.under_replicated if info else None,
            "epoch": info.topology.epoch if info and info.topology else None,
        }
        document.append(item)
        rows.append(
            [
                m.node_id,
                item["address"],
                m.state,
                "-" if info is None else info.parameter_count,
                "-" if info is None else format_size(info.parameter_bytes),
                "-" if info is None else info.keys_moving or 0,
                "-" if info is None else info.under_replicated or 0,
            ]
        )
    if args.json:
        print_json(
            {
                "epoch": answer.epoch,
                "replication_factor": answer.replication_factor,
                "partition_bytes": answer.partition_bytes,
                "members": document,
            }
        )
        return OK
    cut = answer.partition_bytes
    partitions = f"partitions of {format_size(cut)} of float32" if cut else "no partitions"
    print(f"epoch {answer.epoch}, replication factor {r}, {len(members)} members, {partitions}")
    header = ["NODE", "ADDRESS", "STATE", "KEYS", "BYTES", "MOVING", "UNDER-REPLICATED"]
    print(format_table(header, rows, right={3, 4, 5, 6}))
    return OK


async def drain(client: ParameterClient, args: argparse.Namespace) -> int:
    wait_ms = None if args.wait is None else min(int(args.wait * 1000), MAX_I32)
    handed = await client.call("drain", wait_ms=wait_ms, timeout=args.timeout)
    address = f"{client.host}:{client.port}"
    if args.json:
        print_json({"address": address, "handed_off": handed})
    else:
        print(f"{address}: handed off {handed} keys; the node is leaving")
    return OK


async def shutdown(client: ParameterClient, args: argparse.Namespace) -> int:
    request = thrift.ShutdownRequest(cluster=not args.only_this_node, snapshot=args.snapshot)
    result = await client.call("shutdown", request=request, timeout=args.timeout)
    address = f"{client.host}:{client.port}"
    unreached = list(result.unreached or [])
    if args.json:
        print_json(
            {
                "address": address,
                "stopping": result.stopping,
                "snapshots": result.snapshots,
                "unreached": unreached,
            }
        )
    else:
        print(
            f"{address}: {result.stopping} nodes stopping, {result.snapshots} wrote their final "
            "snapshot" + (f"; not reached: {', '.join(unreached)}" if unreached else "")
        )
    return FAILED if unreached else OK


Command = Callable[[ParameterClient, argparse.Namespace], Coroutine[Any, Any, int]]
COMMANDS: dict[str, Command] = {
    "stats": stats,
    "peers": peers,
    "waiting": waiting,
    "get": get,
    "list": list_parameters,
    "ping": ping,
    "topology": topology,
    "drain": drain,
    "shutdown": shutdown,
}


# -- running --------------------------------------------------------------------------------


async def run(args: argparse.Namespace, ssl: ssl_module.SSLContext | None = None) -> int:
    """Run the command ``args`` names against its node; answer the exit code."""
    client = ParameterClient(
        args.address,
        timeout=args.timeout,
        connect_timeout=args.timeout,
        max_connections=1,
        ssl=ssl,
        route=False,  # (its node answers, passing on what it does not hold)
    )
    try:
        return await COMMANDS[args.command](client, args)
    finally:
        await client.close()


def _run(coroutine: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _error(exc: BaseException) -> str:
    """One line for what went wrong."""
    if isinstance(exc, RequestError):
        text = f"the node refused the request: {exc}"
    elif isinstance(exc, ServerError):
        text = f"the node failed: {exc}"
    elif isinstance(exc, ProtocolError):
        # (it may quote bytes: their spaces stay as they came)
        return " ".join(str(exc).splitlines())
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # What the client logs (e.g. why it closed a connection), as our own lines.
    logging.basicConfig(level=logging.WARNING, format=f"{PROG}: %(message)s")
    ssl = None
    if args.tls_key and not args.tls_cert:
        parser.error("--tls-key needs --tls-cert")
    if args.tls or args.tls_ca or args.tls_cert:
        try:
            ssl = client_context(args.tls_ca, args.tls_cert, args.tls_key)
        except TLS_ERRORS as exc:
            parser.error(f"TLS: {exc}")
    try:
        return _run(run(args, ssl))
    except ParamSyncError as exc:
        print(f"{PROG}: {_error(exc)}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): say nothing more, and let
        # Python's exit not complain about flushing stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILED


if __name__ == "__main__":
    sys.exit(main())
