#!/usr/bin/env python3
"""Large parameters stored as partitions: what the cut costs, what it spreads, on loopback.

One command, every cluster a set of fresh node processes::

    python benchmarks/bench_partitions.py [--nodes 4] [--replication-factor 2]
                                          [--partition-bytes 0,1MiB,4MiB,16MiB]
                                          [--size 256MiB] [--count 10]
                                          [--lone-size 64MiB] [--lone-partition-bytes 4MiB]
                                          [--json out.json]

1. Cluster. For each SIZE of ``--partition-bytes`` (0: every parameter whole),
   start ``--nodes`` N processes (``python -m aioparamsync --partition-bytes SIZE
   --replication-factor R``; node 0 first, the others with ``--peers`` node 0),
   wait until every node's topology shows N members up, then drive one float32
   parameter ``w`` of ``--size`` bytes (of more than SIZE/4 elements: stored as
   partitions of SIZE/4 elements, each on replicas of its own) with two
   clients of node 0, one after the other, on the same ``w``:

   * ``routed``: ``ParameterClient(node 0)``, after ``await client.routes.learn()``
     (its topology must say SIZE): it cuts the array itself and sends each
     partition straight to its primary, concurrently, and reads them back so
     and puts them together (one copy);
   * ``node0``: ``ParameterClient(node 0, route=False)``: the whole tensor goes to
     node 0 (larger than 128 MiB: in pieces), which cuts it and passes the
     partitions on, and gathers them on a read (one copy).

   Each client: two untimed updates and a read (it connects, stores the
   layout, and the nodes touch the memory of both generations of ``w``, old
   and new, before the clock starts: see bench_node.py), ``--count``
   sequential ``update_arrays({"w": array})`` (acks "1", the default; element 0
   changes each time), each timed, then ``--count`` sequential
   ``get_arrays(["w"])``, each timed (the size is checked), then one untimed
   read compared with ``np.array_equal`` to what was written last. Then the
   driver waits until no node is moving keys and the nodes hold, together,
   min(R, N) copies of every key (the partitions and the manifest, or ``w``
   whole), and reads every node's ``info()``: ``parameter_bytes`` (as a share
   of ``--size``) and ``parameter_count`` (keys) per node, and the max/mean of
   the bytes.

   A ``route=False`` read larger than the client's ``max_inline_bytes`` (128
   MiB by default) is answered as a header and read in pieces, each piece put
   together by node 0 from the partitions it spans.

   Reported per (SIZE, client): update and read p50 and p99 (seconds) and MB/s
   (``--count`` x ``--size`` over the phase's wall time), the bytes held per
   node; and every figure as a ratio to the same figure of the same client
   with ``--partition-bytes 0`` (whole; the first SIZE when 0 is not given):
   above 1 for seconds is slower, for MB/s faster.

2. Lone node. One node (``--lone-size``, ``--partition-bytes`` 0, then
   ``--lone-partition-bytes``), the ``node0`` client the same way: update and
   read p50 and their ratio to the whole one. Nothing is spread: this is the
   cost partitioning adds on one node (the cut, the manifest written before
   the partitions, and the copy that puts a read together).

On a 2-core machine every node process and the driver share two cores: the
concurrent sends of partitions to N primaries cannot go faster than two
cores move bytes (between hosts, each would have a NIC and cores of its own),
and with R >= 2 the primaries' replication of the previous update competes
with the next one; what partitioning spreads shows here in the bytes held per
node (max/mean), what it costs in the seconds. The nodes hold min(R, N) x
``--size`` together (the default run: 0.5 GiB), plus the copies in flight.
Every call has a deadline (``CALL_TIMEOUT``), every wait a bound; a call
that fails, or a read that does not give back what was written, is
recorded in its row (and the table and exit status say so), not measured.
Every process is stopped by its PID (SIGTERM, then SIGKILL) in a ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import (
    _UNITS,
    NODE_ARGS,
    REPO,
    WARMUP_UPDATES,
    ServerProcess,
    _list_of,
    _percentile,
    parse_size,
    run_environment,
)
from bench_sharding import until

sys.path.insert(0, str(REPO))

from aioparamsync import ParameterClient, ParamSyncError

THIS = Path(__file__).resolve()

FORM_TIMEOUT = 60.0
SETTLE_TIMEOUT = 60.0
CALL_TIMEOUT = 60.0
LEARN_TIMEOUT = 30.0
#: the bytes a manifest may take, at most (it is a short JSON document)
MANIFEST_BYTES = 4096
NAME = "w"
KINDS = ("routed", "node0")


def size(text: str) -> int:
    """As ``parse_size``, without its bound of one frame (a parameter may be larger)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        return parse_size(text)  # (its error)
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def positive_size(text: str) -> int:
    value = size(text)
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: a float32 parameter's bytes, 4 or more")
    return value


def fmt_size(n: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def start(n: int, factor: str, partition_bytes: int, env: dict[str, str]) -> list[ServerProcess]:
    nodes: list[ServerProcess] = []
    try:
        for i in range(n):
            cmd = [sys.executable, "-m", "aioparamsync", *NODE_ARGS]
            cmd += ["--replication-factor", factor, "--repair-interval", "1"]
            cmd += ["--partition-bytes", str(partition_bytes)]
            if nodes:
                cmd += ["--peers", "{}:{}".format(*nodes[0].address)]
            nodes.append(ServerProcess(f"node {i}", env, cmd=cmd))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def keys_of(nbytes: int, partition_bytes: int) -> int:
    """The keys one copy of a float32 parameter of ``nbytes`` is stored as."""
    elements, per = nbytes // 4, partition_bytes // 4
    if not partition_bytes or elements <= max(1, per):
        return 1
    return math.ceil(elements / max(1, per)) + 1  # (its partitions, and its manifest)


async def drive(
    client: ParameterClient, nbytes: int, count: int, errors: list[str], what: str
) -> dict:
    """The update and read phases of one client on ``w`` (see the module)."""
    out: dict[str, Any] = {}
    big = np.ones(nbytes // 4, np.float32)
    stored = 1
    try:  # (untimed: see the module)
        for step in range(WARMUP_UPDATES):
            big[0] = stored = -step
            await client.update_arrays({NAME: big})
    except ParamSyncError as exc:
        errors.append(f"{what}: warm-up: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    with contextlib.suppress(ParamSyncError):  # (the read phase says what fails)
        await client.get_arrays([NAME])
    for op in ("update", "read"):
        times: list[float] = []
        try:
            for step in range(count):
                if op == "update":
                    big[0] = step + 1
                    started = time.perf_counter()
                    await client.update_arrays({NAME: big})
                    times.append(time.perf_counter() - started)
                    stored = step + 1
                else:
                    started = time.perf_counter()
                    got = await client.get_arrays([NAME])
                    times.append(time.perf_counter() - started)
                    if NAME not in got or got[NAME].size != big.size:
                        raise RuntimeError(f"a read gave {got.get(NAME)!r:.80}")
                    del got
        except (ParamSyncError, RuntimeError) as exc:
            errors.append(f"{what}: {op} {len(times) + 1}: {type(exc).__name__}: {exc}")
            out[op] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        wall = sum(times)
        times.sort()
        out[op] = {
            "p50_s": _percentile(times, 50),
            "p99_s": _percentile(times, 99),
            "MBps": count * nbytes / wall / 1e6,
        }
    if "error" in out["read"]:
        out["read_back_equal"] = None  # (not checked: the reads failed)
        return out
    big[0] = stored  # (what the last update that succeeded wrote)
    try:
        got = await client.get_arrays([NAME])
        same = NAME in got and got[NAME].dtype == big.dtype and np.array_equal(got[NAME], big)
    except ParamSyncError as exc:
        same = False
        errors.append(f"{what}: checked read: {type(exc).__name__}: {exc}")
    else:
        if not same:
            errors.append(f"{what}: a read gave back other values than were written")
    out["read_back_equal"] = same
    return out


async def holdings(
    direct: list[ParameterClient], nbytes: int, partition_bytes: int, factor: str
) -> dict:
    """Once settled (see the module): what each node holds."""
    n = len(direct)
    copies = n if factor == "all" else min(int(factor), n)
    keys = keys_of(nbytes, partition_bytes) * copies
    low, high = nbytes * copies, (nbytes + MANIFEST_BYTES) * copies
    last: list[Any] = []

    async def settled() -> list[Any] | None:
        infos = await asyncio.gather(*(c.info() for c in direct))
        last[:] = infos
        held = sum(i.parameter_bytes for i in infos)
        moving = sum(i.keys_moving or 0 for i in infos)
        count = sum(i.parameter_count for i in infos)
        return infos if count == keys and low <= held <= high and not moving else None

    out: dict[str, Any] = {"keys_expected": keys}
    try:
        infos = await until(settled, SETTLE_TIMEOUT, f"{keys} keys held, {low} bytes")
    except TimeoutError as exc:
        infos = last
        out["error"] = str(exc)
    held = [i.parameter_bytes for i in infos]
    mean = sum(held) / n
    out.update(
        share=[b / nbytes for b in held],
        keys=[i.parameter_count for i in infos],
        max_share=max(held) / nbytes,
        mean_share=mean / nbytes,
        max_over_mean=max(held) / mean if mean else 0.0,
    )
    return out


async def run(
    n: int,
    factor: str,
    partition_bytes: int,
    nbytes: int,
    kinds: tuple[str, ...],
    args: argparse.Namespace,
    env: dict[str, str],
    errors: list[str],
) -> dict:
    nodes = start(n, factor, partition_bytes, env)
    direct = [ParameterClient(p.address, timeout=CALL_TIMEOUT, route=False) for p in nodes]
    row: dict[str, Any] = {
        "nodes": n,
        "replication_factor": factor,
        "partition_bytes": partition_bytes,
        "size": nbytes,
    }
    try:

        async def formed() -> bool:
            infos = await asyncio.gather(*(c.info() for c in direct))
            return all(
                i.state in (None, "up") and sum(m.state == "up" for m in i.topology.members) == n
                for i in infos
            )

        await until(formed, FORM_TIMEOUT, "every node up")
        for kind in kinds:
            nodes_s = f"{n} node{'s' if n > 1 else ''}"
            what = f"{nodes_s}, --partition-bytes {fmt_size(partition_bytes)}, {kind}"
            client = ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT, route=kind == "routed")
            try:
                if client.routes is not None:
                    try:
                        await asyncio.wait_for(client.routes.learn(), LEARN_TIMEOUT)
                    except (TimeoutError, ParamSyncError) as exc:
                        what_failed = f"the topology: {type(exc).__name__}: {exc}"
                    else:
                        topology = client.routes.topology
                        if topology is None or topology.partition_bytes != partition_bytes:
                            what_failed = "the client learnt no topology of this run"
                        elif n > 1 and topology.single:
                            what_failed = "the client's topology has one member"
                        else:
                            what_failed = ""
                    if what_failed:
                        errors.append(f"{what}: {what_failed}")
                        row[kind] = {"error": what_failed}
                        continue
                result = await drive(client, nbytes, args.count, errors, what)
            finally:
                await client.close()
            result["held"] = await holdings(direct, nbytes, partition_bytes, factor)
            if "error" in result["held"]:
                errors.append(f"{what}: holdings: {result['held']['error']}")
            row[kind] = result
        return row
    finally:
        await asyncio.gather(*(c.close() for c in direct))
        for node in nodes:
            node.stop()


FIGURES = (
    ("update", "p50_s"),
    ("update", "p99_s"),
    ("update", "MBps"),
    ("read", "p50_s"),
    ("read", "p99_s"),
    ("read", "MBps"),
)


def add_ratios(rows: list[dict], kinds: tuple[str, ...]) -> None:
    """Each row's figures over the whole (``partition_bytes`` 0, else the first) row's."""
    base = next((r for r in rows if r["partition_bytes"] == 0), rows[0])
    for r in rows:
        for kind in kinds:
            mine, theirs = r.get(kind, {}), base.get(kind, {})
            ratios: dict[str, float | None] = {}
            for op, figure in FIGURES:
                a, b = mine.get(op, {}).get(figure), theirs.get(op, {}).get(figure)
                ratios[f"{op}_{figure}"] = a / b if a is not None and b else None
            a = mine.get("held", {}).get("max_share")
            b = theirs.get("held", {}).get("max_share")
            ratios["held_max_share"] = a / b if a is not None and b else None
            a = mine.get("held", {}).get("max_over_mean")
            b = theirs.get("held", {}).get("max_over_mean")
            ratios["held_max_over_mean"] = a / b if a is not None and b else None
            if kind in r:
                r[kind]["ratio_to_whole"] = ratios
        r["whole"] = base["partition_bytes"]


def _cell(value: float | None, width: int, spec: str) -> str:
    return f"{'-' if value is None else format(value, spec):>{width}}"


def print_table(rows: list[dict], kinds: tuple[str, ...], args: argparse.Namespace) -> None:
    print(
        f"\ncluster: {args.nodes} nodes, R={args.replication_factor}, one float32 parameter of "
        f"{fmt_size(args.size)}, {args.count} sequential updates then {args.count} reads per "
        "client; MB = 10^6 bytes; held: the node's bytes as a share of the parameter's; "
        "keys/node: what each node holds (! not the copies expected: see FAILED); equal: the "
        "checked read gave back what was written; -: failed (see FAILED)"
    )
    head = (
        f"{'part.':>6} {'client':<6} | {'upd p50 s':>9} {'p99 s':>7} {'MB/s':>6} | "
        f"{'read p50 s':>10} {'p99 s':>7} {'MB/s':>6} | {'held max':>8} {'mean':>5} "
        f"{'max/mean':>8} | {'keys/node':<14} equal"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        for kind in kinds:
            k = r.get(kind, {})
            u, g, h = k.get("update", {}), k.get("read", {}), k.get("held", {})
            keys = " ".join(str(c) for c in h.get("keys", []))
            ok = {True: "yes", False: "NO"}.get(k.get("read_back_equal"), "-")
            keys += "" if "error" not in h and h else " !"
            print(
                f"{fmt_size(r['partition_bytes']):>6} {kind:<6} | "
                f"{_cell(u.get('p50_s'), 9, '.3f')} {_cell(u.get('p99_s'), 7, '.3f')} "
                f"{_cell(u.get('MBps'), 6, '.0f')} | "
                f"{_cell(g.get('p50_s'), 10, '.3f')} {_cell(g.get('p99_s'), 7, '.3f')} "
                f"{_cell(g.get('MBps'), 6, '.0f')} | "
                f"{_cell(h.get('max_share'), 8, '.2f')} {_cell(h.get('mean_share'), 5, '.2f')} "
                f"{_cell(h.get('max_over_mean'), 8, '.2f')} | {keys:<14} {ok}"
            )
    whole = fmt_size(rows[0]["whole"]) if rows else "0"
    print(
        f"\nratios to --partition-bytes {whole} (whole) of the same client "
        "(seconds: above 1 is slower; MB/s: above 1 is faster; held: above 1 is less even)"
    )
    head = (
        f"{'part.':>6} {'client':<6} | {'upd p50':>7} {'p99':>5} {'MB/s':>5} | "
        f"{'read p50':>8} {'p99':>5} {'MB/s':>5} | {'held max':>8} {'max/mean':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        for kind in kinds:
            x = r.get(kind, {}).get("ratio_to_whole", {})
            print(
                f"{fmt_size(r['partition_bytes']):>6} {kind:<6} | "
                f"{_cell(x.get('update_p50_s'), 7, '.2f')} "
                f"{_cell(x.get('update_p99_s'), 5, '.2f')} "
                f"{_cell(x.get('update_MBps'), 5, '.2f')} | "
                f"{_cell(x.get('read_p50_s'), 8, '.2f')} {_cell(x.get('read_p99_s'), 5, '.2f')} "
                f"{_cell(x.get('read_MBps'), 5, '.2f')} | "
                f"{_cell(x.get('held_max_share'), 8, '.2f')} "
                f"{_cell(x.get('held_max_over_mean'), 8, '.2f')}"
            )


def print_lone(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nlone node: 1 node, one float32 parameter of {fmt_size(args.lone_size)}, a route=False "
        f"client, {args.count} updates then {args.count} reads; x: ratio to the whole one"
    )
    head = f"{'part.':>6} | {'upd p50 s':>9} {'x':>5} | {'read p50 s':>10} {'x':>5} | keys equal"
    print(head)
    print("-" * len(head))
    for r in rows:
        k = r.get("node0", {})
        x = k.get("ratio_to_whole", {})
        h = k.get("held", {})
        ok = {True: "yes", False: "NO"}.get(k.get("read_back_equal"), "-")
        keys = " ".join(str(c) for c in h.get("keys", []))
        keys += "" if "error" not in h and h else " !"
        print(
            f"{fmt_size(r['partition_bytes']):>6} | "
            f"{_cell(k.get('update', {}).get('p50_s'), 9, '.3f')} "
            f"{_cell(x.get('update_p50_s'), 5, '.2f')} | "
            f"{_cell(k.get('read', {}).get('p50_s'), 10, '.3f')} "
            f"{_cell(x.get('read_p50_s'), 5, '.2f')} | {keys:>4} {ok:>5}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--nodes", type=int, default=4, help="node processes of the cluster")
    p.add_argument("--replication-factor", default="2", help="each node's (a number, or all)")
    p.add_argument(
        "--partition-bytes",
        type=_list_of(size),
        default=_list_of(size)("0,1MiB,4MiB,16MiB"),
        help="each node's, one cluster per value; 0: whole (default: 0,1MiB,4MiB,16MiB)",
    )
    p.add_argument("--size", type=positive_size, default=size("256MiB"), help="w's bytes")
    p.add_argument("--count", type=int, default=10, help="updates, then reads, timed per client")
    p.add_argument("--lone-size", type=positive_size, default=size("64MiB"), help="lone node's")
    p.add_argument("--lone-partition-bytes", type=size, default=size("4MiB"))
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--malloc", choices=("tuned", "default"), default="tuned")
    args = p.parse_args()
    if args.nodes < 1 or args.count < 1 or not args.partition_bytes:
        p.error("--nodes and --count must be at least 1, --partition-bytes name a size")
    if args.replication_factor != "all" and not args.replication_factor.isdigit():
        p.error("--replication-factor is a number or all")
    env = run_environment(args.malloc, THIS, reexec=True)
    if env is None:
        return 2
    print("python benchmarks/bench_partitions.py", " ".join(sys.argv[1:]), flush=True)
    errors: list[str] = []
    rows = []
    for partition_bytes in args.partition_bytes:
        rows.append(
            asyncio.run(
                run(
                    args.nodes,
                    args.replication_factor,
                    partition_bytes,
                    args.size,
                    KINDS,
                    args,
                    env,
                    errors,
                )
            )
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    add_ratios(rows, KINDS)
    lone = []
    for partition_bytes in dict.fromkeys((0, args.lone_partition_bytes)):
        lone.append(
            asyncio.run(run(1, "1", partition_bytes, args.lone_size, ("node0",), args, env, errors))
        )
        print(json.dumps(lone[-1]), file=sys.stderr, flush=True)
    add_ratios(lone, ("node0",))
    print_table(rows, KINDS, args)
    print_lone(lone, args)
    if errors:
        print("\nFAILED (not measured):", file=sys.stderr)
        for e in errors:
            print(f"  {e}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cluster": rows, "lone": lone, "errors": errors}, f, indent=2)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
