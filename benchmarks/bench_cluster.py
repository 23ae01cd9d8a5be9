#!/usr/bin/env python3
"""A cluster of aioparamsync nodes on loopback: the cost of fan-out, and replication lag.

One command, every cluster a set of fresh processes::

    python benchmarks/bench_cluster.py [--peers-list 0,1,2,4] [--sizes 4KiB,16MiB]
                                       [--count 2000] [--lag-count 200] [--seconds 10]
                                       [--json out.json]

For each size and each number of peers P: start P+1 node processes
(``python -m aioparamsync``; node 0 first, the others with ``--peers`` node 0),
wait until every node sees P peers "up" (a full mesh), then, on one
parameter ``w`` and through the public client (one
``ParameterClient(address, max_connections=1)`` per node):

0. warm-up: two untimed updates on node 0, each peer then holds the same bytes;
1. update latency: up to ``--count`` sequential updates on node 0 (stopping at
   ``--seconds``): p50/p99 and calls/s. The reply never waits for a peer
   (``aioparamsync/cluster/links.py``), so this is what the fan-out costs the client
   (CPU, memory bandwidth), not a replication round trip;
2. replication lag: up to ``--lag-count`` updates on node 0 (stopping at
   ``--seconds``), one at a time: after each ack, every peer is polled with
   ``get_parameters(["w"], min_version=v)`` (each with its own client,
   concurrently, back to back) until it answers the parameter; the next update
   only then. lag = time from the ack until the answer of the LAST peer. It is
   an upper bound: it includes the round trip of that last poll, which carries
   the parameter's bytes back to the driver (reported: ``poll rtt``). A lower
   bound is also kept: the latest send of a poll that was answered empty
   (the version arrived after that poll was served);
3. node 0's ``info()``: each peer link's updates_sent/updates_coalesced
   before and after each phase (coalescing under load in phase 1).

Every node process is stopped by its PID (SIGTERM, SIGKILL if it does not
exit) in a ``finally``; it also gets SIGTERM if this driver dies. Processes,
malloc tuning and helpers come from ``bench_node.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import (
    CALL_TIMEOUT,
    NODE_ARGS,
    REPO,
    WARMUP_UPDATES,
    PhaseResult,
    ServerProcess,
    _list_of,
    _percentile,
    _positive_int,
    _print_md,
    fmt_size,
    load_average,
    machine,
    parse_size,
    run_environment,
)

THIS = Path(__file__).resolve()
NAME = "w"  # the one parameter
FORM_TIMEOUT = 30.0  # the cluster forms (every node sees P peers up) within this
REPLICATION_TIMEOUT = 30.0  # every peer holds an update within this, or it counts as timed out
FORM_POLL = 0.02
SETTLE_TIMEOUT = 5.0  # node 0's link counters account for every update within this


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


# ---------------------------------------------------------------------------
# A cluster of node processes


class ClusterProcesses:
    """Node 0, then ``peers`` nodes that join it; every one stopped by its PID only."""

    def __init__(self, peers: int, env: dict[str, str], repair_interval: float) -> None:
        self.nodes: list[ServerProcess] = []
        try:
            self.nodes.append(ServerProcess("node 0", env, cmd=self._cmd(repair_interval)))
            seed = "{}:{}".format(*self.nodes[0].address)
            for i in range(1, peers + 1):
                self.nodes.append(
                    ServerProcess(f"node {i}", env, cmd=self._cmd(repair_interval, seed))
                )
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _cmd(repair_interval: float, seed: str | None = None) -> list[str]:
        cmd = [sys.executable, "-m", "aioparamsync", *NODE_ARGS]
        # Every node holds w: this measures the fan-out of full replication
        # (bench_sharding.py measures a sharded cluster).
        cmd += ["--repair-interval", repr(repair_interval), "--replication-factor", "all"]
        if seed is not None:
            cmd += ["--peers", seed]
        return cmd

    def cpu_seconds(self) -> list[float]:
        return [n.cpu_seconds() for n in self.nodes]

    def dead(self) -> str:
        return "; ".join(
            f"{n.variant} exited {n.proc.returncode}: {n.stderr_tail(500)}"
            for n in self.nodes
            if n.proc.poll() is not None
        )

    def stop(self) -> None:
        # SIGTERM to all first (by PID, only while the process runs), so that they
        # shut down together; then each is waited for (and SIGKILLed if need be).
        for n in self.nodes:
            if n.proc.poll() is None:
                with contextlib.suppress(OSError):
                    n.proc.send_signal(signal.SIGTERM)
        for n in self.nodes:
            n.stop()


async def wait_formed(clients: list[Any], peers: int) -> tuple[float, list[int]]:
    """Until every node sees ``peers`` peers up: (seconds waited, peers up per node)."""
    t0 = time.perf_counter()
    deadline = t0 + FORM_TIMEOUT
    while True:
        infos = await asyncio.gather(*(c.info() for c in clients))
        up = [sum(1 for p in (i.peers or []) if p.state == "up") for i in infos]
        if all(u >= peers for u in up):
            return time.perf_counter() - t0, up
        if time.perf_counter() > deadline:
            raise RuntimeError(
                f"the cluster of {peers + 1} nodes did not form within {FORM_TIMEOUT} s: "
                f"peers up per node {up}"
            )
        await asyncio.sleep(FORM_POLL)


# ---------------------------------------------------------------------------
# Measurements


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, all CPUs (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    ticks += [0] * (8 - len(ticks))
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz


async def background_cpu(seconds: float) -> float:
    """The machine's busy CPUs (1.0: one core) over ``seconds`` while this script idles."""
    busy0, _ = machine_cpu_seconds()
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    busy1, _ = machine_cpu_seconds()
    return (busy1 - busy0) / (time.perf_counter() - t0)


class CpuMeter:
    """CPU used during a phase, as a fraction of its wall time (1.0: one core busy).

    ``other`` is the machine's busy time that neither the nodes nor this driver
    account for: other work on the machine (and kernel time charged to no
    process), so a measure of the noise.
    """

    def __init__(self, cluster: ClusterProcesses) -> None:
        self.cluster = cluster
        self.nodes = cluster.cpu_seconds()
        self.driver = time.process_time()
        self.machine, self.steal = machine_cpu_seconds()
        self.start = time.perf_counter()

    def read(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        nodes = [b - a for a, b in zip(self.nodes, self.cluster.cpu_seconds(), strict=True)]
        driver = time.process_time() - self.driver
        machine, steal = machine_cpu_seconds()
        busy = machine - self.machine
        return {
            "node0": nodes[0] / elapsed,
            "peers": sum(nodes[1:]) / elapsed,
            "driver": driver / elapsed,
            "machine": busy / elapsed,
            "other": max(0.0, busy - sum(nodes) - driver) / elapsed,
            "steal": (steal - self.steal) / elapsed,
        }


@dataclass
class UpdatePhase(PhaseResult):
    """bench_node's PhaseResult; server_cpu is node 0's, peers_cpu the peers' sum.

    other_cpu: the machine's busy time that is none of this run's processes
    (other work), steal_cpu: time the hypervisor gave to other guests.
    """

    peers_cpu: float = 0.0
    other_cpu: float = 0.0
    steal_cpu: float = 0.0


@dataclass
class LagPhase:
    updates: int = 0  # updates whose replication was waited for
    timeouts: int = 0  # of them, not on every peer within REPLICATION_TIMEOUT (no lag counted)
    seconds: float = 0.0
    lag_p50_ms: float = 0.0  # upper bounds: ack -> the last peer's answer
    lag_p99_ms: float = 0.0
    lag_max_ms: float = 0.0
    lag_low_p50_ms: float = 0.0  # lower bounds: ack -> the latest poll answered empty
    poll_rtt_p50_ms: float = 0.0  # round trip of the last peer's answering poll
    polls_per_update: float = 0.0  # all peers together
    update_p50_ms: float = 0.0  # latency of these (spaced) updates
    cpu: dict[str, float] = field(default_factory=dict)  # as CpuMeter.read
    lags_ms: list[float] = field(default_factory=list)


@dataclass
class ClusterRun:
    peers: int
    size: int
    load1: float = 0.0  # the machine's 1-minute load average as the run started
    start_seconds: float = 0.0  # processes started and the mesh formed
    update: UpdatePhase = field(default_factory=UpdatePhase)
    lag: LagPhase | None = None  # None without peers
    drain_seconds: float = 0.0  # after phase 1: until every peer held its last version
    drain_timeouts: int = 0
    # Node 0's link counters were read once every update was sent or coalesced.
    counters_settled: bool = True
    links: list[dict[str, Any]] = field(default_factory=list)  # node 0's peer links


async def poll_until(client: Any, version: int, interval: float) -> tuple[float, float, float, int]:
    """Poll a peer until it holds ``version`` of NAME.

    Answers (when the answer came, that poll's round trip, when the latest
    empty-answered poll was sent or -inf, polls made).
    """
    clock = time.perf_counter
    polls = 0
    last_empty = float("-inf")
    while True:
        t_send = clock()
        response = await client.get_parameters([NAME], min_version=version)
        t_recv = clock()
        polls += 1
        if response.params:
            got = response.params[0].version
            if got < version:
                raise RuntimeError(f"asked for version >= {version}, answered {got}")
            return t_recv, t_recv - t_send, last_empty, polls
        last_empty = t_send
        if interval:
            await asyncio.sleep(interval)


async def replicated(peers: list[Any], version: int, interval: float) -> list[Any] | None:
    """Poll every peer until each holds ``version``; None past REPLICATION_TIMEOUT."""
    try:
        async with asyncio.timeout(REPLICATION_TIMEOUT):
            return await asyncio.gather(*(poll_until(c, version, interval) for c in peers))
    except TimeoutError:
        return None


async def update_phase(
    client: Any, array: Any, args: argparse.Namespace, cluster: ClusterProcesses
) -> tuple[UpdatePhase, int]:
    from aioparamsync import to_parameter

    clock = time.perf_counter
    latencies: list[float] = []
    version = 0
    meter = CpuMeter(cluster)
    start = clock()
    deadline = start + args.seconds
    while len(latencies) < args.count and clock() < deadline:
        t0 = clock()
        versions = await client.update_parameters([to_parameter(NAME, array)])
        latencies.append(clock() - t0)
        version = versions[NAME]
    elapsed = clock() - start
    cpu = meter.read()
    latencies.sort()
    n = len(latencies)
    result = UpdatePhase(
        calls=n,
        seconds=round(elapsed, 4),
        calls_per_s=n / elapsed,
        mb_per_s=n * array.nbytes / elapsed / 1e6,
        p50_ms=_percentile(latencies, 50) * 1e3,
        p99_ms=_percentile(latencies, 99) * 1e3,
        server_cpu=cpu["node0"],
        client_cpu=cpu["driver"],
        peers_cpu=cpu["peers"],
        other_cpu=cpu["other"],
        steal_cpu=cpu["steal"],
    )
    return result, version


async def lag_phase(
    client: Any, peers: list[Any], array: Any, args: argparse.Namespace, cluster: ClusterProcesses
) -> LagPhase:
    from aioparamsync import to_parameter

    clock = time.perf_counter
    upper: list[float] = []
    lower: list[float] = []
    rtts: list[float] = []
    spaced: list[float] = []
    polls = 0
    timeouts = 0
    meter = CpuMeter(cluster)
    start = clock()
    deadline = start + args.seconds
    while len(spaced) < args.lag_count and clock() < deadline:
        t0 = clock()
        versions = await client.update_parameters([to_parameter(NAME, array)])
        t_ack = clock()
        spaced.append(t_ack - t0)
        answers = await replicated(peers, versions[NAME], args.poll_interval)
        if answers is None:
            timeouts += 1
            print(
                f"warning: version {versions[NAME]} was not on every peer within "
                f"{REPLICATION_TIMEOUT} s",
                file=sys.stderr,
            )
            continue
        t_last, rtt, _, _ = max(answers, key=lambda a: a[0])
        upper.append(t_last - t_ack)
        lower.append(max(0.0, max(a[2] for a in answers) - t_ack))
        rtts.append(rtt)
        polls += sum(a[3] for a in answers)
    elapsed = clock() - start
    cpu = meter.read()
    done = len(upper)
    lags_ms = [x * 1e3 for x in upper]
    for values in (upper, lower, rtts, spaced):
        values.sort()
    return LagPhase(
        updates=len(spaced),
        timeouts=timeouts,
        seconds=round(elapsed, 4),
        lag_p50_ms=_percentile(upper, 50) * 1e3,
        lag_p99_ms=_percentile(upper, 99) * 1e3,
        lag_max_ms=(upper[-1] * 1e3) if upper else 0.0,
        lag_low_p50_ms=_percentile(lower, 50) * 1e3,
        poll_rtt_p50_ms=_percentile(rtts, 50) * 1e3,
        polls_per_update=polls / done if done else 0.0,
        update_p50_ms=_percentile(spaced, 50) * 1e3,
        cpu=cpu,
        lags_ms=[round(x, 4) for x in lags_ms],
    )


def _links(info: Any) -> dict[str, dict[str, Any]]:
    return {
        p.address: {
            "node_id": p.node_id,
            "state": p.state,
            "outbox_depth": p.outbox_depth,
            "updates_sent": p.updates_sent,
            "updates_coalesced": p.updates_coalesced,
            "send_failures": p.send_failures,
            "lag_seconds": p.lag_seconds,
            "repaired": p.repaired,
        }
        for p in (info.peers or [])
    }


async def settled_info(client: Any, offered: int, peers: int) -> tuple[Any, bool]:
    """Node 0's info() once each of its links has dealt with all ``offered`` updates.

    A link counts an update as sent only when the call returns, which can be
    after the peer already holds it (a oneway call is fenced by a ping since
    c43652f). So: until every link's updates_sent + updates_coalesced reaches
    ``offered`` (each update offered to a link is either sent or replaced by a
    newer one) and its outbox is empty; past SETTLE_TIMEOUT, the info as is.
    """
    deadline = time.perf_counter() + SETTLE_TIMEOUT
    while True:
        info = await client.info()
        links = info.peers or []
        if len(links) >= peers and all(
            p.updates_sent + p.updates_coalesced >= offered and p.outbox_depth == 0 for p in links
        ):
            return info, True
        if time.perf_counter() > deadline:
            return info, False
        await asyncio.sleep(FORM_POLL)


def link_report(
    addresses: list[str], before: Any, end1: Any, drained: Any, end: Any
) -> list[dict[str, Any]]:
    """Node 0's link to each peer: counters per phase, and its state as phase 1 ended."""
    snaps = [_links(i) for i in (before, end1, drained, end)]
    out = []
    for address in addresses:
        b, e1, d, e = (s.get(address, {}) for s in snaps)

        def delta(key: str, x: dict[str, Any], y: dict[str, Any]) -> int:
            return int(y.get(key, 0)) - int(x.get(key, 0))

        out.append(
            {
                "address": address,
                "node_id": e.get("node_id", ""),
                "state": e.get("state", "missing"),
                # Phase 1 (back-to-back updates), counted until the peer held the last one.
                "update_sent": delta("updates_sent", b, d),
                "update_coalesced": delta("updates_coalesced", b, d),
                # As phase 1's last update was acked: what was still waiting.
                "update_end_outbox_depth": e1.get("outbox_depth", 0),
                "update_end_lag_seconds": e1.get("lag_seconds", 0.0),
                # Phase 2 (spaced updates).
                "lag_sent": delta("updates_sent", d, e),
                "lag_coalesced": delta("updates_coalesced", d, e),
                # Totals at the end (warm-up included).
                "updates_sent": e.get("updates_sent", 0),
                "updates_coalesced": e.get("updates_coalesced", 0),
                "send_failures": e.get("send_failures", 0),
                "repaired": e.get("repaired", 0),
            }
        )
    return out


async def run_cluster(
    peers: int, size: int, array: Any, args: argparse.Namespace, env: dict[str, str]
) -> ClusterRun:
    from aioparamsync import ParameterClient, from_parameter, to_parameter

    run = ClusterRun(peers, size, load1=load_average())
    t0 = time.perf_counter()
    cluster = ClusterProcesses(peers, env, args.repair_interval)
    clients: list[Any] = []
    try:
        clients = [
            ParameterClient(n.address, max_connections=1, timeout=CALL_TIMEOUT, route=False)
            for n in cluster.nodes
        ]
        await wait_formed(clients, peers)
        run.start_seconds = round(time.perf_counter() - t0, 3)
        first, others = clients[0], clients[1:]
        addresses = ["{}:{}".format(*n.address) for n in cluster.nodes[1:]]

        # Warm-up (untimed): store w, replace it once, every replica then holds it.
        for _ in range(WARMUP_UPDATES):
            versions = await first.update_parameters([to_parameter(NAME, array)])
        if await replicated(others, versions[NAME], args.poll_interval) is None:
            raise RuntimeError(f"the warm-up update did not reach every peer: {await first.info()}")
        for c in clients:
            response = await c.get_parameters([NAME])
            if not np.array_equal(from_parameter(response.params[0]), array):
                raise RuntimeError(f"a replica at {c.host}:{c.port} holds other values")

        offered = WARMUP_UPDATES
        before, settled = await settled_info(first, offered, peers)
        run.update, last = await update_phase(first, array, args, cluster)
        end1 = await first.info()
        t_drain = time.perf_counter()
        if others and await replicated(others, last, args.poll_interval) is None:
            run.drain_timeouts = 1
        run.drain_seconds = round(time.perf_counter() - t_drain, 4)
        offered += run.update.calls
        drained, ok = await settled_info(first, offered, peers)
        settled = settled and ok
        if others:
            run.lag = await lag_phase(first, others, array, args, cluster)
            offered += run.lag.updates
        end, ok = await settled_info(first, offered, peers)
        run.counters_settled = settled and ok
        run.links = link_report(addresses, before, end1, drained, end)
        return run
    except BaseException:
        dead = cluster.dead()
        if dead:
            print(f"a node died: {dead}", file=sys.stderr)
        raise
    finally:
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()
        cluster.stop()


# ---------------------------------------------------------------------------
# Summary


def summarize(runs: list[ClusterRun], cpus: int) -> list[dict[str, Any]]:
    base = {r.size: r.update.p50_ms for r in runs if r.peers == 0}
    rows = []
    for r in sorted(runs, key=lambda r: (r.size, r.peers)):
        b = base.get(r.size)
        lag = r.lag
        n_links = len(r.links)
        row: dict[str, Any] = {
            "peers": r.peers,
            "size": r.size,
            "size_text": fmt_size(r.size),
            "processes": r.peers + 2,  # the nodes and this driver
            "cpus": cpus,
            "cpu_contended": r.peers + 2 > cpus,
            "load1": r.load1,
            "update_calls": r.update.calls,
            "update_p50_ms": r.update.p50_ms,
            "update_p99_ms": r.update.p99_ms,
            "update_calls_per_s": r.update.calls_per_s,
            "update_p50_vs_p0": r.update.p50_ms / b if b else None,
            "node0_cpu": r.update.server_cpu,
            "peers_cpu": r.update.peers_cpu,
            "driver_cpu": r.update.client_cpu,
            "other_cpu": r.update.other_cpu,
            "steal_cpu": r.update.steal_cpu,
            "lag_other_cpu": lag.cpu.get("other") if lag else None,
            "lag_updates": lag.updates - lag.timeouts if lag else None,
            "lag_timeouts": (lag.timeouts + r.drain_timeouts) if lag else None,
            "lag_p50_ms": lag.lag_p50_ms if lag else None,
            "lag_p99_ms": lag.lag_p99_ms if lag else None,
            "lag_max_ms": lag.lag_max_ms if lag else None,
            "lag_low_p50_ms": lag.lag_low_p50_ms if lag else None,
            "poll_rtt_p50_ms": lag.poll_rtt_p50_ms if lag else None,
            # Per peer link of node 0, mean over the links, during phase 1.
            "update_sent_per_peer": (
                sum(x["update_sent"] for x in r.links) / n_links if n_links else None
            ),
            "update_coalesced_per_peer": (
                sum(x["update_coalesced"] for x in r.links) / n_links if n_links else None
            ),
        }
        rows.append(row)
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    head = (
        "P",
        "size",
        "procs/CPUs",
        "upd n",
        "upd p50 ms",
        "upd p99 ms",
        "upd calls/s",
        "p50 / P=0",
        "lag n",
        "lag p50 ms",
        "lag p99 ms",
        "lag max ms",
        "lag p50 >= ms",
        "poll rtt p50 ms",
        "sent/coalesced per peer",
        "CPU n0/peers/drv/other",
    )
    lines = []
    for r in rows:
        contended = " *" if r["cpu_contended"] else ""
        sent = r["update_sent_per_peer"]
        lines.append(
            (
                str(r["peers"]),
                r["size_text"],
                f"{r['processes']}/{r['cpus']}{contended}",
                str(r["update_calls"]),
                _ms(r["update_p50_ms"]),
                _ms(r["update_p99_ms"]),
                f"{r['update_calls_per_s']:.1f}",
                "-" if r["update_p50_vs_p0"] is None else f"{r['update_p50_vs_p0']:.2f}",
                "-"
                if r["lag_updates"] is None
                else str(r["lag_updates"])
                + (f" ({r['lag_timeouts']} lost)" if r["lag_timeouts"] else ""),
                _ms(r["lag_p50_ms"]),
                _ms(r["lag_p99_ms"]),
                _ms(r["lag_max_ms"]),
                _ms(r["lag_low_p50_ms"]),
                _ms(r["poll_rtt_p50_ms"]),
                "-" if sent is None else f"{sent:.0f}/{r['update_coalesced_per_peer']:.0f}",
                f"{r['node0_cpu']:.2f}/{r['peers_cpu']:.2f}/{r['driver_cpu']:.2f}/"
                f"{r['other_cpu']:.2f}",
            )
        )
    _print_md(head, lines, out)


NOTES = """\
* upd: phase 1, sequential updates of one parameter on node 0 (the reply never waits
  for a peer: this is what the fan-out costs the client). p50 / P=0: its p50 over the
  P=0 p50 of the same size.
* lag: phase 2, one update at a time; lag = from the ack on node 0 until the LAST peer
  answered get_parameters(min_version=v) with it, polled back to back by the driver.
  An UPPER bound: it includes that last poll's round trip (poll rtt, which carries the
  parameter's bytes back to the driver). lag p50 >= is a lower bound: from the ack to
  the latest poll sent that was answered empty (0: the first poll already found it).
* sent/coalesced per peer: node 0's links during phase 1, mean over the peers: updates
  sent to the peer, and updates replaced by a newer one before they were sent.
* CPU: during phase 1, as a fraction of wall time (1.0 = one core busy): node 0, the
  peers together, this driver, and other: the machine's busy time that none of them
  accounts for (other work on the machine, and kernel time charged to no process)."""


def contention_note(cpus: int, peers_list: list[int]) -> str:
    """Which rows ran more processes than the machine has CPUs."""
    crowded = sorted(p for p in set(peers_list) if p + 2 > cpus)
    text = f"* procs/CPUs: each row runs P+1 node processes and this driver on {cpus} CPUs."
    if crowded:
        worst = crowded[-1]
        text += (
            f"\n  Rows marked * (P = {', '.join(map(str, crowded))}) run more processes than "
            f"CPUs: the peers\n  receive (and in phase 2 answer polls) while node 0 sends, so "
            f"their figures include\n  waiting for a CPU, not only the cost of fan-out. "
            f"P={worst} ({worst + 2} processes on {cpus} CPUs) is\n  CPU-contended."
        )
    return text


# ---------------------------------------------------------------------------
# Main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument(
        "--peers-list",
        type=_list_of(_non_negative_int),
        default=[0, 1, 2, 4],
        help="numbers of peers of node 0, comma separated (default: 0,1,2,4)",
    )
    p.add_argument(
        "--sizes",
        type=_list_of(parse_size),
        default=_list_of(parse_size)("4KiB,16MiB"),
        help="bytes of the parameter, comma separated (default: 4KiB,16MiB)",
    )
    p.add_argument(
        "--count",
        type=_positive_int,
        default=2000,
        help="most updates of phase 1 (default: %(default)s)",
    )
    p.add_argument(
        "--lag-count",
        type=_positive_int,
        default=200,
        help="most updates of phase 2, each waited for on every peer (default: %(default)s)",
    )
    p.add_argument(
        "--seconds",
        type=_positive_float,
        default=10.0,
        help="deadline of each phase (default: %(default)s)",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=0.0,
        help="seconds between two polls of a peer in phase 2; 0: back to back "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--repair-interval",
        type=_positive_float,
        default=600.0,
        help="the nodes' --repair-interval: longer than a run, so that periodic "
        "anti-entropy does not run while measuring (default: %(default)s)",
    )
    p.add_argument(
        "--malloc",
        choices=("tuned", "default"),
        default="tuned",
        help="glibc malloc settings of every process, as bench_node.py (default: %(default)s)",
    )
    p.add_argument(
        "--probe-seconds",
        type=_positive_float,
        default=2.0,
        help="before the first run and after the last, measure for this long how busy "
        "other work keeps the machine (default: %(default)s)",
    )
    p.add_argument("--json", metavar="PATH", help="write the table and every run to PATH")
    return p


async def amain(args: argparse.Namespace, env: dict[str, str]) -> int:
    arrays = {}
    for size in args.sizes:
        if size % 4 == 0:
            arrays[size] = np.random.default_rng(size).random(size // 4, dtype=np.float32)
        else:
            arrays[size] = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    plan = [(peers, size) for size in args.sizes for peers in args.peers_list]
    # SIGTERM cancels the run, so the finally clauses stop the nodes.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    cpus = os.cpu_count() or 1
    load_before = load_average()
    busy_before = await background_cpu(args.probe_seconds)
    if load_before > 0.5:
        print(
            f"note: load average {load_before:.2f} before the first run: other processes compete "
            "for the CPUs, expect noise",
            file=sys.stderr,
        )
    runs: list[ClusterRun] = []
    t_start = time.monotonic()
    for i, (peers, size) in enumerate(plan, 1):
        r = await run_cluster(peers, size, arrays[size], args, env)
        runs.append(r)
        lag = (
            f"lag p50 {r.lag.lag_p50_ms:8.3f} ms p99 {r.lag.lag_p99_ms:8.3f} ms "
            f"({r.lag.updates} updates)"
            if r.lag
            else "no peers"
        )
        coalesced = sum(x["update_coalesced"] for x in r.links)
        print(
            f"[{i}/{len(plan)} {time.monotonic() - t_start:6.1f}s] P={peers} "
            f"{fmt_size(size):>6s}: update p50 {r.update.p50_ms:8.3f} ms "
            f"{r.update.calls_per_s:8.1f}/s ({r.update.calls} calls) | {lag} | "
            f"coalesced {coalesced} | load {r.load1:.2f}, other CPU {r.update.other_cpu:.2f}"
            + ("" if r.counters_settled else " | link counters not settled"),
            file=sys.stderr,
            flush=True,
        )
    rows = summarize(runs, cpus)
    meta = machine()
    meta.update(
        {
            "malloc": args.malloc,
            "malloc_env": {k: v for k, v in env.items() if k.startswith("MALLOC_")},
            "peers_list": args.peers_list,
            "sizes": args.sizes,
            "count": args.count,
            "lag_count": args.lag_count,
            "seconds": args.seconds,
            "poll_interval": args.poll_interval,
            "repair_interval": args.repair_interval,
            "load1_before": load_before,
            "load1_after": load_average(),
            # Busy CPUs of the machine while this script idled, before and after.
            "background_cpu_before": busy_before,
            "background_cpu_after": await background_cpu(args.probe_seconds),
            "lag": "upper bound: ack on node 0 -> the last peer's answering poll received",
        }
    )
    print(f"\naioparamsync at {meta['git']}")
    print(
        f"{meta['cpus']} CPUs ({meta['cpu_model']}), Python {meta['python']}, "
        f"uvloop {meta['uvloop']}; malloc {args.malloc}; load average {load_before:.2f} before, "
        f"{meta['load1_after']:.2f} after; other work kept {busy_before:.2f} CPUs busy before "
        f"the runs, {meta['background_cpu_after']:.2f} after ({args.probe_seconds} s idle each); "
        f"one run per row; phase deadline {args.seconds} s; 127.0.0.1; nodes and driver share "
        f"the CPUs\n"
    )
    print_table(rows)
    print()
    print(NOTES)
    print(contention_note(cpus, args.peers_list))
    if args.json:
        doc = {"meta": meta, "rows": rows, "runs": [asdict(r) for r in runs]}
        with open(args.json, "w") as f:  # noqa: ASYNC230 - after the last run
            f.write(json.dumps(doc, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.peers_list or not args.sizes:
        print("--peers-list and --sizes must not be empty", file=sys.stderr)
        return 2
    env = run_environment(args.malloc, THIS, reexec=argv is None)
    if env is None:
        return 2
    sys.path.insert(0, str(REPO))
    import uvloop

    try:
        return uvloop.run(amain(args, env))
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("interrupted; the nodes started were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
