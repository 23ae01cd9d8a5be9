#!/usr/bin/env python3
"""A sharded cluster on loopback: what each node holds, what replication costs, throughput.

One command, every cluster a set of fresh node processes::

    python benchmarks/bench_sharding.py [--nodes 1,2,4] [--factors 1,2,all] [--keys 64]
                                        [--key-size 1MiB] [--size 16MiB] [--count 50]
                                        [--clients 4] [--seconds 5] [--json out.json]

For each number of nodes N and each replication factor R (``--replication-factor``;
``all`` is full replication, what the cluster did before sharding), start N
processes (``python -m aioparamsync``; node 0 first, the others with
``--peers`` node 0), wait until node 0's topology shows N members up, then,
through the public client (routed: each name straight to its primary):

1. holdings: write ``--keys`` float32 parameters of ``--key-size`` each (acks=all),
   wait until no node is moving keys and the copies add up to keys * min(R, N),
   and read every node's ``info()``: the bytes each holds, as a share of the
   keys' bytes (R/N expected) and max/mean;
2. update latency: ``--count`` sequential updates of one ``--size`` parameter
   (acks=1, the default, and acks=all): p50 and p99. With R=1 nothing is
   replicated; with R>=2 the primary sends each update to R-1 replicas;
3. aggregate throughput: ``--clients`` clients, each its own share of the keys,
   update them back to back for ``--seconds`` (MB/s pushed), then read them
   back the same way (MB/s pulled).

Ratios are to the same figure with one node. On a 2-core machine every node
process and the driver share two cores: aggregate throughput cannot grow with
N here (the load moves between processes, it is not added), and more nodes
cost context switches; per-node bytes are what shows the capacity. Every
process is stopped by its PID (SIGTERM, then SIGKILL) in a ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import (
    NODE_ARGS,
    REPO,
    ServerProcess,
    _list_of,
    _percentile,
    parse_size,
    run_environment,
)

sys.path.insert(0, str(REPO))

from aioparamsync import ParameterClient

THIS = Path(__file__).resolve()

FORM_TIMEOUT = 60.0
SETTLE_TIMEOUT = 60.0
CALL_TIMEOUT = 60.0


def start(n: int, factor: str, env: dict[str, str]) -> list[ServerProcess]:
    nodes: list[ServerProcess] = []
    try:
        for i in range(n):
            cmd = [sys.executable, "-m", "aioparamsync", *NODE_ARGS]
            cmd += ["--replication-factor", factor, "--repair-interval", "1"]
            if nodes:
                cmd += ["--peers", "{}:{}".format(*nodes[0].address)]
            nodes.append(ServerProcess(f"node {i}", env, cmd=cmd))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


async def until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout} s")
        await asyncio.sleep(0.05)


async def run(n: int, factor: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    nodes = start(n, factor, env)
    direct = [ParameterClient(p.address, timeout=CALL_TIMEOUT, route=False) for p in nodes]
    client = ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT)
    try:

        async def formed() -> bool:
            infos = await asyncio.gather(*(c.info() for c in direct))
            return all(
                i.state in (None, "up") and sum(m.state == "up" for m in i.topology.members) == n
                for i in infos
            )

        await until(formed, FORM_TIMEOUT, "every node up")
        await client.ping()
        key_elems = args.key_size // 4
        keys = {f"k{i}": np.full(key_elems, i, np.float32) for i in range(args.keys)}
        for i in range(0, args.keys, 8):
            await client.update_arrays(dict(list(keys.items())[i : i + 8]), acks="all")
        copies = args.keys * (n if factor == "all" else min(int(factor), n))

        async def settled() -> list[Any] | None:
            infos = await asyncio.gather(*(c.info() for c in direct))
            held = sum(i.parameter_count for i in infos)
            moving = sum(i.keys_moving or 0 for i in infos)
            return infos if held == copies and not moving else None

        infos = await until(settled, SETTLE_TIMEOUT, f"{copies} copies held")
        total = args.keys * args.key_size
        shares = [i.parameter_bytes / total for i in infos]
        mean = sum(i.parameter_bytes for i in infos) / n

        big = np.ones(args.size // 4, np.float32)
        await client.update_arrays({"w": big})
        latency: dict[str, list[float]] = {}
        for acks in ("1", "all"):
            times = []
            for step in range(args.count):
                big[0] = step
                started = time.perf_counter()
                await client.update_arrays({"w": big}, acks=acks)
                times.append(time.perf_counter() - started)
            latency[acks] = sorted(times)

        names = list(keys)
        per_client = [names[i :: args.clients] for i in range(args.clients)]
        clients = [ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT) for _ in per_client]
        try:
            for c in clients:  # (each learns the topology before the clock starts)
                await c.update_arrays({names[0]: keys[names[0]]})
                await until(lambda c=c: _routed(c), 10.0, "the topology")

            async def push(c: ParameterClient, mine: list[str]) -> int:
                sent, deadline = 0, time.perf_counter() + args.seconds
                while time.perf_counter() < deadline:
                    for name in mine:
                        await c.update_arrays({name: keys[name]})
                        sent += args.key_size
                return sent

            async def pull(c: ParameterClient, mine: list[str]) -> int:
                got, deadline = 0, time.perf_counter() + args.seconds
                while time.perf_counter() < deadline:
                    for name in mine:
                        await c.get_arrays([name])
                        got += args.key_size
                return got

            started = time.perf_counter()
            pushes = (push(c, m) for c, m in zip(clients, per_client, strict=True))
            pushed = sum(await asyncio.gather(*pushes))
            push_s = time.perf_counter() - started
            started = time.perf_counter()
            pulls = (pull(c, m) for c, m in zip(clients, per_client, strict=True))
            pulled = sum(await asyncio.gather(*pulls))
            pull_s = time.perf_counter() - started
        finally:
            await asyncio.gather(*(c.close() for c in clients))
        return {
            "nodes": n,
            "replication_factor": factor,
            "held_share": shares,
            "held_max_over_mean": max(i.parameter_bytes for i in infos) / mean,
            "update_p50_ms": {a: _percentile(t, 50) * 1000 for a, t in latency.items()},
            "update_p99_ms": {a: _percentile(t, 99) * 1000 for a, t in latency.items()},
            "push_MBps": pushed / push_s / 1e6,
            "pull_MBps": pulled / pull_s / 1e6,
        }
    finally:
        await client.close()
        await asyncio.gather(*(c.close() for c in direct))
        for node in nodes:
            node.stop()


async def _routed(c: ParameterClient) -> bool:
    return c.routes is not None and (c.routes.topology is not None or not c.routes.enabled)


def print_table(rows: list[dict]) -> None:
    base: dict[str, dict] = {}
    for r in rows:
        if r["nodes"] == 1:
            base[r["replication_factor"]] = r
    head = (
        f"{'N':>3} {'R':>4} | {'held/node (share of keys bytes)':<34} {'max/mean':>8} | "
        f"{'upd p50 acks=1':>14} {'acks=all':>9} {'p99 =1':>8} | {'push MB/s':>9} {'x1':>5} "
        f"{'pull MB/s':>9} {'x1':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        b = base.get(r["replication_factor"]) or base.get("1") or r
        shares = " ".join(f"{s:.2f}" for s in r["held_share"])
        print(
            f"{r['nodes']:>3} {r['replication_factor']:>4} | {shares:<34} "
            f"{r['held_max_over_mean']:>8.2f} | {r['update_p50_ms']['1']:>11.2f} ms "
            f"{r['update_p50_ms']['all']:>6.2f} ms {r['update_p99_ms']['1']:>5.1f} ms | "
            f"{r['push_MBps']:>9.0f} {r['push_MBps'] / b['push_MBps']:>5.2f} "
            f"{r['pull_MBps']:>9.0f} {r['pull_MBps'] / b['pull_MBps']:>5.2f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--nodes", type=_list_of(int), default=[1, 2, 4], help="cluster sizes")
    p.add_argument("--factors", type=_list_of(str), default=["1", "2", "all"])
    p.add_argument("--keys", type=int, default=64, help="parameters written (holdings)")
    p.add_argument("--key-size", type=parse_size, default=parse_size("1MiB"))
    p.add_argument("--size", type=parse_size, default=parse_size("16MiB"), help="latency's")
    p.add_argument("--count", type=int, default=50, help="updates timed per acks mode")
    p.add_argument("--clients", type=int, default=4, help="clients of the throughput phase")
    p.add_argument("--seconds", type=float, default=5.0, help="each throughput phase")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--malloc", choices=("tuned", "default"), default="tuned")
    args = p.parse_args()
    env = run_environment(args.malloc, THIS, reexec=True)
    if env is None:
        return 2
    print("python benchmarks/bench_sharding.py", " ".join(sys.argv[1:]), flush=True)
    rows = []
    for n in args.nodes:
        for factor in args.factors:
            if n == 1 and factor not in ("1",) and "1" in args.factors:
                continue  # (one node: every factor is the same)
            rows.append(asyncio.run(run(n, factor, args, env)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
