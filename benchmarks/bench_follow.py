#!/usr/bin/env python3
"""Followers under a steady write load: how far behind the leader a follower, and a follower of
it, are.

One command, every node a fresh process on loopback::

    python benchmarks/bench_follow.py [--keys 1000] [--key-bytes 4KiB] [--rate 50] [--batch 20]
                                      [--seconds 10] [--json out.json]

A leader node (``python -m aioparamsync``) holds ``--keys`` float32 parameters of
``--key-bytes`` each; a follower follows it (``--follow``) and a second follower follows the
first. A writer updates ``--batch`` of the keys (the next ones round-robin, each call a new
step) ``--rate`` times a second for ``--seconds``, each call carrying the probe key ``probe``
too. After each acknowledged call (version ``v`` of ``probe``), one client per follower asks it
``get_parameters(["probe"], min_version=v, wait=5)``, a long poll answered as soon as the
follower holds ``v``: the lag of that write is the time from the leader's answer to the
follower's (an upper bound: it includes the poll's round trip; the next write waits for
nothing). Reported: p50, p99 and max lag per follower, writes that never arrived within 5 s,
and each follower's ``info()`` counters at the end (keys pulled, batches: how much coalescing
saved) beside the writes made.

The client and the three nodes share this machine's cores: the figures are loopback's, with
the CPU shared, not a network's.

``python benchmarks/bench_follow.py --fanout [bench_fanout.py's flags]`` measures the other
half, on hosts with links of their own (root: network namespaces): the time for K readers to
get a new 256 MiB model version from one node against from a tree of followers (see
``bench_fanout.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import (
    NODE_ARGS,
    ServerProcess,
    _percentile,
    _positive_int,
    fmt_size,
    git_state,
    load_average,
    parse_size,
)

from aioparamsync import ParameterClient, RequestError

PROBE = "probe"
LAG_WAIT = 5.0  # a write not at a follower within this counts as not arrived (seconds)
CONVERGE_TIMEOUT = 60.0  # the followers hold the initial keys within this (seconds)


def node_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "aioparamsync", *NODE_ARGS, *flags]


async def lag_of(client: ParameterClient, version: int, acked: float) -> float | None:
    """Seconds from ``acked`` until ``client``'s node answers ``probe`` at ``version``."""
    try:
        await client.get_parameters([PROBE], min_version=version, wait=LAG_WAIT)
    except RequestError:
        return None
    return time.monotonic() - acked


async def run(args: argparse.Namespace) -> dict[str, Any]:
    elements = args.key_bytes // 4
    names = [f"k{i:05d}" for i in range(args.keys)]
    procs: list[ServerProcess] = []
    try:
        leader = ServerProcess("leader", {}, cmd=node_cmd())
        procs.append(leader)
        host, port = leader.address
        first = ServerProcess("follower", {}, cmd=node_cmd("--follow", f"{host}:{port}"))
        procs.append(first)
        fhost, fport = first.address
        second = ServerProcess("follower2", {}, cmd=node_cmd("--follow", f"{fhost}:{fport}"))
        procs.append(second)
        async with (
            ParameterClient(leader.address, timeout=30) as writer,
            ParameterClient(first.address, timeout=30) as one,
            ParameterClient(second.address, timeout=30) as two,
        ):
            # Every key once, then wait until both followers hold them.
            base = np.zeros(elements, np.float32)
            for i in range(0, len(names), 256):
                await writer.update_arrays({n: base for n in names[i : i + 256]})
            (v0,) = (await writer.update_arrays({PROBE: base})).values()
            for client in (one, two):
                await client.get_parameters([PROBE], min_version=v0, wait=CONVERGE_TIMEOUT)
            lags: dict[str, list[float]] = {"follower": [], "follower of it": []}
            missed = dict.fromkeys(lags, 0)
            pending: set[asyncio.Task[None]] = set()

            async def measure(version: int, acked: float) -> None:
                found = await asyncio.gather(
                    lag_of(one, version, acked), lag_of(two, version, acked)
                )
                for who, lag in zip(lags, found, strict=True):
                    if lag is None:
                        missed[who] += 1
                    else:
                        lags[who].append(lag)

            interval = 1.0 / args.rate
            start = time.monotonic()
            writes, cursor, step = 0, 0, 0
            while time.monotonic() - start < args.seconds:
                step += 1
                chosen = [names[(cursor + j) % len(names)] for j in range(args.batch)]
                cursor += args.batch
                stamp = np.full(elements, step, np.float32)
                result = await writer.update_arrays({**dict.fromkeys(chosen, stamp), PROBE: stamp})
                acked = time.monotonic()
                writes += 1
                task = asyncio.ensure_future(measure(result[PROBE], acked))
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(max(0.0, start + writes * interval - time.monotonic()))
            elapsed = time.monotonic() - start
            if pending:
                await asyncio.wait(pending)
            counters = {
                who: dict((await c.info()).counters)
                for who, c in zip(lags, (one, two), strict=True)
            }
    finally:
        for proc in reversed(procs):
            proc.stop()
    rows = []
    for who, found in lags.items():
        found.sort()
        c = counters[who]
        rows.append(
            {
                "who": who,
                "writes": writes,
                "keys_written": writes * (args.batch + 1),
                "lag_p50_ms": 1000 * statistics.median(found) if found else None,
                "lag_p99_ms": 1000 * _percentile(found, 99) if found else None,
                "lag_max_ms": 1000 * found[-1] if found else None,
                "missed": missed[who],
                "keys_pulled": c.get("follow_keys_pulled", 0),
                "batches": c.get("follow_batches", 0),
            }
        )
    return {
        "rows": rows,
        "meta": {
            "commit": git_state(),
            "load_average": load_average(),
            "keys": args.keys,
            "key_bytes": args.key_bytes,
            "rate": args.rate,
            "batch": args.batch,
            "seconds": args.seconds,
            "writes_per_s": writes / elapsed,
        },
    }


def print_table(doc: dict[str, Any]) -> None:
    meta = doc["meta"]
    print(
        f"{meta['keys']} keys of {fmt_size(meta['key_bytes'])}; {meta['batch']} keys + the probe "
        f"per write, {meta['writes_per_s']:.1f} writes/s for {meta['seconds']:g} s "
        f"(commit {meta['commit']}, load {meta['load_average']:.2f})"
    )
    print()
    print("| follower | writes | lag p50 ms | lag p99 ms | lag max ms | not within 5 s | "
          "keys written | keys pulled | batches |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for r in doc["rows"]:
        print(
            f"| {r['who']} | {r['writes']} | {ms(r['lag_p50_ms'])} | {ms(r['lag_p99_ms'])} | "
            f"{ms(r['lag_max_ms'])} | {r['missed']} | {r['keys_written']} | {r['keys_pulled']} | "
            f"{r['batches']} |"
        )


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--fanout"]:  # (the fan-out half: bench_fanout.py, on the namespace test bed)
        import bench_fanout

        return bench_fanout.main(raw[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=_positive_int, default=1000)
    parser.add_argument("--key-bytes", type=parse_size, default=4096)
    parser.add_argument("--rate", type=float, default=50.0, help="writes per second")
    parser.add_argument("--batch", type=_positive_int, default=20, help="keys per write")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.key_bytes % 4 or args.key_bytes <= 0:
        parser.error("--key-bytes must be a positive multiple of 4")
    if not args.rate > 0 or not args.seconds > 0:
        parser.error("--rate and --seconds must be above 0")
    doc = asyncio.run(run(args))
    print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
