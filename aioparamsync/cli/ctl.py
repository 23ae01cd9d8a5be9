"""``aioparamsync-ctl``: inspect a running node from a shell.

::

    aioparamsync-ctl stats 127.0.0.1:9090        # id, version, parameters, uptime, counters
    aioparamsync-ctl peers 127.0.0.1:9090        # the node's peer links, as a table
    aioparamsync-ctl waiting 127.0.0.1:9090      # long polls and barriers: who waits for whom
    aioparamsync-ctl get 127.0.0.1:9090 w b      # version, origin, dtype, shape, a preview
    aioparamsync-ctl list 127.0.0.1:9090 layer1. # names (from a prefix), dtype, shape, size
    aioparamsync-ctl ping 127.0.0.1:9090         # the node's id and a round trip
    aioparamsync-ctl export 127.0.0.1:9090 model.safetensors  # the parameters, whole
    aioparamsync-ctl checkpoint 127.0.0.1:9090 ckpt/  # everything, at one cut
    aioparamsync-ctl restore 127.0.0.1:9090 ckpt/     # ... and back, into any cluster
    aioparamsync-ctl --json stats 127.0.0.1:9090 # any of them, as JSON

Exit codes: 0 done; 1 the node could not be reached, did not answer in time,
refused, or is no node, or ``export``, ``checkpoint``, ``restore`` could not
write or read their files (one line on stderr); 2 bad arguments; 3 ``get``
found some name not on the node (what it found is still shown), or a NAME of
``export`` is no parameter.

Only ``drain``, ``shutdown`` and ``restore`` change the node; the others read
(``checkpoint`` holds writes while its cut is made).

Here are its commands (each asks the node, then prints with :mod:`.output`;
``export`` is :mod:`.export`), and the running of one, with what goes wrong
said in one line; its parser is :mod:`.ctl_parser`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl as ssl_module
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from ..client import loop
from ..client.api import ParameterClient
from ..cluster.links import LinkState
from ..errors import ParamSyncError, ProtocolError, RequestError, ServerError
from ..placement import is_reserved, parse_key
from ..tls import client_context
from ..values.arrays import from_parameter
from ..wire import thrift
from ..wire.protocol import MAX_I32
from . import checkpoints, export
from .ctl_parser import PROG, build_parser
from .options import TLS_ERRORS
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

# Exit codes.
OK, FAILED, NOT_FOUND = 0, 1, 3  # (2: bad arguments, as argparse exits)


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


def _parameters_of(keys: Iterable[str]) -> tuple[int, int]:
    """``(parameters, partitions)`` of a node's keys: the partitions and manifest of a
    partitioned parameter count as that parameter (as ``list`` shows it), and apart."""
    names: set[str] = set()
    partitions = 0
    for key in keys:
        parsed = parse_key(key) if is_reserved(key) else None
        names.add(key if parsed is None else parsed[0])
        partitions += parsed is not None and parsed[1] is not None
    return len(names), partitions


async def stats(client: ParameterClient, args: argparse.Namespace) -> int:
    info = await client.info()
    count, partitions = _parameters_of(d.name for d in await client.call("digest"))
    peers = info.peers or []
    if args.json:
        print_json(
            {
                "node_id": info.node_id,
                "version": info.version,
                "fast_path": info.fast_path,
                "parameter_count": count,
                "partition_count": partitions,
                "key_count": info.parameter_count,  # (partitions and manifests included)
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
                ("parameters", f"{count} ({format_size(info.parameter_bytes)})"),
                *([("partitions", f"{partitions} (of the large ones)")] if partitions else []),
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
    # (headers: a few bytes a parameter, not its data)
    prefix = args.prefix or ""
    items = [_listed(p) for p in await export.headers(client) if p.name.startswith(prefix)]
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
        "nbytes": export.nbytes_of(p),
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
            shared_memory=0,
        )
        try:
            return await other.info()
        except ParamSyncError:
            return None
        finally:
            await other.close()

    infos = await asyncio.gather(*(held(m) for m in members))
    r = answer.replication_factor or "all"
    claimed: dict[str, int] = {}  # (placement balanced by bytes: keys each member claims)
    for member in (answer.claims or {}).values():
        claimed[member] = claimed.get(member, 0) + 1
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
        item["claims"] = claimed.get(m.node_id, 0)
        rows.append(
            [
                m.node_id,
                item["address"],
                m.state,
                item["claims"],
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
    header = ["NODE", "ADDRESS", "STATE", "CLAIMS", "KEYS", "BYTES", "MOVING", "UNDER-REPLICATED"]
    print(format_table(header, rows, right={3, 4, 5, 6, 7}))
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
    "export": export.run_export,
    "checkpoint": checkpoints.run_checkpoint,
    "restore": checkpoints.run_restore,
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
        # (its node answers, passing on what it does not hold; export routes its reads)
        route=args.route,
        shared_memory=0,  # (one command: its calls stay on the connection it opened)
    )
    try:
        return await COMMANDS[args.command](client, args)
    finally:
        await client.close()


def _run(coroutine: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop when it is installed, else on asyncio's own loop."""
    return loop.run(coroutine)


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
