#!/usr/bin/env python3
"""The coordinator's cost: write latency with and without etcd, and the failover time.

One command, every cluster a set of fresh processes on loopback::

    python benchmarks/bench_coordinator.py [--nodes 3] [--count 2000] [--ttl 3] [--reps 3]
                                           [--etcd etcd://HOST:PORT] [--json out.json]

Two clusters of ``--nodes`` node processes (R=2), side by side: ``peer`` (the
members decide among themselves: ``--peers``) and ``etcd`` (``--coordinator``;
an etcd is started on loopback in a temporary directory unless ``--etcd`` names
one). Both run with ``--failure-timeout`` = ``--ttl``. For each, through the
public client (one connection to node 0, ``route=False``):

1. write latency: ``--count`` sequential 4 KiB updates of one name, with
   ``acks=1`` and then ``acks=all``: p50 / p99 (ms). The coordinator is off the
   write path (a node reads its fencing state in memory), so the ratio etcd /
   peer should be 1 within noise;
2. failover: the primary of a name is killed (SIGKILL, no leave); a surviving
   node is written that name (``acks=all``) every 20 ms until a write succeeds.
   failover = the time from the kill to that write's answer. Without a
   coordinator a node takes a replica whose link broke for down at once (so a
   partition would also make two primaries); with one, a member is live until
   its lease expires: TTL plus the hand-over.

Each is run ``--reps`` times, the two alternating; the table shows medians.
Every process is stopped by its PID (SIGTERM, then SIGKILL) in a ``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import NODE_ARGS, REPO, ServerProcess, machine

from aioparamsync import ParameterClient, RequestError
from aioparamsync.errors import NetworkError
from aioparamsync.placement import Placement

R = 2
NAME = "w"
FAILOVER_NAME = "f"
SIZE = 4096
FAILOVER_LIMIT = 120.0  # seconds: a failover slower than this is reported as failed
POLL = 0.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """An etcd on loopback, its data in a temporary directory (stopped by its PID)."""

    def __init__(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise SystemExit("no etcd on PATH (apt-get install etcd-server), and no --etcd given")
        self.tmp = tempfile.TemporaryDirectory()
        port, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
        self.endpoint = f"etcd://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                binary,
                "--name=bench",
                f"--data-dir={self.tmp.name}/data",
                f"--listen-client-urls={client_url}",
                f"--advertise-client-urls={client_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=bench={peer_url}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise SystemExit("etcd did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.tmp.cleanup()


def node_cmd(flags: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "aioparamsync", *NODE_ARGS, *flags]


def start_cluster(kind: str, n: int, ttl: float, endpoint: str | None) -> list[ServerProcess]:
    flags = [
        "--replication-factor",
        str(R),
        "--failure-timeout",
        str(ttl),
        "--repair-interval",
        "1",
    ]
    if kind == "etcd":
        assert endpoint is not None
        prefix = f"/bench/{os.getpid()}-{time.monotonic_ns()}"  # (a cluster of its own)
        flags += ["--coordinator", endpoint, "--coordinator-prefix", prefix]
    env = dict(os.environ)
    nodes: list[ServerProcess] = []
    try:
        for i in range(n):
            mine = [*flags, "--node-id", f"n{i}"]
            if kind == "peer" and nodes:
                host, port = nodes[0].address
                mine += ["--peers", f"{host}:{port}"]
            nodes.append(ServerProcess(f"{kind}-{i}", env, cmd=node_cmd(mine)))
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


async def formed(nodes: Sequence[ServerProcess], timeout: float = 60.0) -> Any:
    """Wait until node 0 sees every node up; answer its topology."""
    deadline = time.monotonic() + timeout
    async with ParameterClient(nodes[0].address, route=False, timeout=10) as client:
        while True:
            topology = await client.topology()
            if sum(1 for m in topology.members if m.state == "up") == len(nodes):
                return topology
            if time.monotonic() > deadline:
                raise SystemExit(f"the cluster did not form: {topology}")
            await asyncio.sleep(0.2)


async def latency(nodes: Sequence[ServerProcess], count: int, acks: str) -> dict[str, float]:
    value = np.zeros(SIZE // 4, np.float32)
    times = []
    async with ParameterClient(nodes[0].address, route=False, timeout=30) as client:
        for _ in range(20):  # warm-up
            await client.update_parameters({NAME: value}, acks=acks)
        for i in range(count):
            value[0] = i
            t0 = time.perf_counter()
            await client.update_parameters({NAME: value}, acks=acks)
            times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "p50_ms": 1000 * times[len(times) // 2],
        "p99_ms": 1000 * times[min(len(times) - 1, int(len(times) * 0.99))],
    }


async def failover(nodes: list[ServerProcess]) -> float | None:
    """Kill the primary of FAILOVER_NAME; seconds until a survivor takes a write of it
    (None: none did within FAILOVER_LIMIT)."""
    topology = await formed(nodes)
    ids = [m.node_id for m in topology.members]
    primary = Placement(ids, R).replicas(FAILOVER_NAME)[0]
    victim = next(i for i, node_id in enumerate(ids) if node_id == primary)
    by_id = {f"n{i}": node for i, node in enumerate(nodes)}
    survivor = next(node for node_id, node in by_id.items() if node_id != primary)
    async with ParameterClient(survivor.address, route=False, timeout=5) as client:
        await client.update_parameters({FAILOVER_NAME: np.ones(4, np.float32)}, acks="all")
        by_id[ids[victim]].proc.kill()
        killed = time.monotonic()
        while time.monotonic() - killed < FAILOVER_LIMIT:
            try:
                await client.update_parameters(
                    {FAILOVER_NAME: np.full(4, 2, np.float32)}, acks="all"
                )
                return time.monotonic() - killed
            except (RequestError, NetworkError):
                await asyncio.sleep(POLL)
    return None


async def run(kind: str, args: argparse.Namespace, endpoint: str | None) -> dict[str, Any]:
    nodes = start_cluster(kind, args.nodes, args.ttl, endpoint)
    try:
        await formed(nodes)
        result: dict[str, Any] = {"kind": kind}
        for acks in ("1", "all"):
            result[f"acks={acks}"] = await latency(nodes, args.count, acks)
        result["failover_s"] = await failover(nodes)
        return result
    finally:
        for node in nodes:
            node.stop()


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over ``runs`` (a failover that failed counts as the longest)."""
    out: dict[str, Any] = {"kind": runs[0]["kind"]}
    for acks in ("acks=1", "acks=all"):
        out[acks] = {q: statistics.median(r[acks][q] for r in runs) for q in runs[0][acks]}
    times = [r["failover_s"] for r in runs]
    out["failover_s"] = None if None in times else statistics.median(times)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="nodes per cluster (default: 3)")
    parser.add_argument("--count", type=int, default=2000, help="updates timed (default: 2000)")
    parser.add_argument(
        "--ttl", type=float, default=3.0, help="--failure-timeout, the lease's TTL (default: 3)"
    )
    parser.add_argument("--reps", type=int, default=3, help="runs of each (default: 3)")
    parser.add_argument("--etcd", help="an etcd to use (default: one started on loopback)")
    parser.add_argument("--json", help="also write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nodes < 2 or args.count < 1 or args.ttl < 2 or args.reps < 1:
        raise SystemExit("--nodes >= 2, --count >= 1, --ttl >= 2, --reps >= 1")
    etcd = None if args.etcd else LocalEtcd()
    endpoint = args.etcd or (etcd.endpoint if etcd is not None else None)
    results: list[dict[str, Any]] = []
    try:
        for _ in range(args.reps):  # (alternating: the machine's noise falls on both)
            results += [asyncio.run(run(kind, args, endpoint)) for kind in ("peer", "etcd")]
    finally:
        if etcd is not None:
            etcd.stop()
    peer, coord = (median_of([r for r in results if r["kind"] == k]) for k in ("peer", "etcd"))
    print(f"medians of {args.reps} runs each")
    print(f"{args.nodes} nodes, R={R}, {SIZE} B updates x {args.count}, TTL {args.ttl:g} s")
    print(f"{'':10} {'peer':>10} {'etcd':>10} {'etcd/peer':>10}")
    for acks in ("1", "all"):
        for q in ("p50_ms", "p99_ms"):
            a, b = peer[f"acks={acks}"][q], coord[f"acks={acks}"][q]
            print(f"{acks:>3} {q:>6} {a:10.3f} {b:10.3f} {b / a:10.2f}")

    def shown(v: float | None) -> str:
        return f"{v:10.2f}" if v is not None else f"{'failed':>10}"

    print(f"{'failover s':>10} {shown(peer['failover_s'])} {shown(coord['failover_s'])}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": machine(), "args": vars(args), "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
