#!/usr/bin/env python3
"""Does a cluster scale out? Aggregate throughput of N nodes, each a host with a shaped link.

On loopback every node shares one network stack and no link is a bottleneck, so adding
nodes cannot show whether the cluster scales. Here (``netlab.py``) every node and every
worker is a host of its own, a Linux network namespace on one bridge, with a link
shaped to ``--mbit`` each way; the aggregate should grow with N as long as the links,
not the CPUs, are what limits it. Needs root (namespaces, veths, tc; CI runs as root)::

    sudo python benchmarks/bench_scaleout.py [--nodes 1,2,4] [--rs 1,2] [--workers 4]
                                             [--mbit 300] [--keysets uniform,model]
                                             [--seconds 12] [--warmup 2] [--scale 1]
                                             [--baseline cpp|none] [--json out.json]
    sudo python benchmarks/bench_scaleout.py --quick   # a smoke: 2 nodes, R=1, 1% sizes

One lab for the whole run: hosts ``n0``.. (nodes), ``w0``.. (workers), every link
``--mbit`` each way, and ``ctl``, unshaped, for the untimed steps. For each key set, first
the baseline (``--baseline cpp``, the default): Apache Thrift's C++ server
(``benchmarks/cpp/param_server.cpp``: ``TThreadPoolServer``, framed, binary, the founding
IDL; built by ``cppserver.py``) alone on ``n0``, same link, driven by the same workers as
in step 3 with the same bytes: each stores its key set once (the server starts empty),
then the same two loops, sent under the founding IDL's names (``update_parameters``,
``get_parameters``: ``update_arrays`` and ``get_arrays`` send ``push_parameters`` and
``pull_parameters``, which that server has not), unrouted. Every row is also divided by
it (``vs C++``). Where it cannot be built, or a key set is more than one message holds
(256 MiB), it is skipped, and the output says why. Then, for each N of ``--nodes`` and
each R of ``--rs`` (R > N skipped), a fresh cluster:

1. nodes: ``python -m aioparamsync --host <ip> --port 7000 --replication-factor R``
   on ``n0``..``n{N-1}`` (node 0 first, the others with ``--peers`` node 0;
   ``--repair-interval 600``: no anti-entropy round while measuring;
   ``--partition-bytes``: 4 MiB times ``--scale``, one "4 MiB" tensor per partition);
2. on ``ctl``: wait until every node's ``topology()`` shows N members up, then a
   writer loads every parameter once (``update_arrays``, acks=all), waits until no
   node is moving keys, and computes where the bytes are with the project's own
   placement: ``Placement`` over the members, each parameter cut as the nodes cut it
   (``layout_for`` with the topology's ``partition_bytes``: its partitions are keys of
   their own, ``partition_key(name, i)``), the bytes of each key counted at its
   primary (manifests, a few hundred bytes, are not counted);
3. ``--workers`` worker processes, one per worker host, under ``aioparamsync.run``
   (uvloop), each with routed ``ParameterClient`` objects for node 0's address (default
   routing: the client learns the topology itself). Once all are ready they start
   together: two loops overlap, ``get_arrays(all names)`` back to back and
   ``update_arrays(all arrays)`` back to back; ``--warmup`` seconds first (not
   counted), then a window of ``--seconds``. Calls start only inside the warm-up or
   the window; those in flight at its end complete. A call's bytes count
   **pro-rated**: its payload times the share of its duration inside the window (a
   call longer than the window, as with one node and the full key sets, still counts
   what it moved in it). A worker's figure is bytes/s of the window, gets plus
   updates; the aggregate is their sum. Each worker also reads its ``eth0`` counters
   over the window: ``wire MB/s`` (both ways; within ~1% of the payload, see NOTES)
   checks the pro-rating, which assumes a call moves its bytes evenly (``calls/wire``).

   Each loop has a client of its own (``--one-client``: one for both). One client
   would pipeline the first update behind the first get on the same connection
   (its pool sends on a busy connection while it opens another), and a node stops
   reading a connection while a large reply is being written to it: the update
   would wait for the whole get (~15 s with one node and the full key sets);
4. on ``ctl``: every node's ``info()`` (bytes in and out), then ``shutdown_cluster``;
   the processes are waited for (and stopped by PID if they linger).

Key sets (``--scale`` multiplies every size, in whole rows):

* ``uniform``: 32 float32 parameters of 4 MiB (1024 x 1024);
* ``model``: a model-like mix: an embedding (N x 512 float32) of ~40% of the bytes,
  24 layers each with a 4 MiB (1024 x 1024) and a 1 MiB (256 x 1024) float32 tensor, and
  100 norms of 4 KiB (1024 float32).

Reading it: a 300 Mbit/s link carries ~36 MB/s of payload each way (TCP/IP headers:
95.7% of the rate), so with perfect balance N nodes move at most ~72*N MB/s (gets out,
updates in), and W workers ~72*W; replication (R=2) spends node uplinks on copies.
``max/mean`` of the primary bytes per node is the placement's imbalance: the busiest
node's link bounds the aggregate.

Caveat: on a 2-core machine every host shares the same two CPUs. Keep the link rates
low enough (300 Mbit/s) that the links, not the CPUs, are the bottleneck, and check
it: ``node CPU`` is the CPU seconds of all node processes over the window's seconds,
``busy`` the whole machine's busy CPUs (2.0: saturated) in the window; a row near
saturation measures the CPUs, not scaling.

Everything started runs inside the lab: on an error, Ctrl-C or SIGTERM the lab stops
every process (by its process group, then whatever is left in its namespaces) and
deletes its namespaces (see ``netlab.py``). Helpers come from ``bench_node.py``,
``bench_cluster.py`` and ``cppserver.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_cluster import _positive_float, machine_cpu_seconds
from bench_node import (
    REPO,
    SERVER_STOP_TIMEOUT,
    ServerProcess,
    _die_with_parent,
    _list_of,
    _positive_int,
    _print_md,
    cpp_environment,
    fmt_size,
    load_average,
    machine,
    run_environment,
)
from bench_sharding import until
from netlab import Host, NetLab, NetLabUnavailable, read_line

THIS = Path(__file__).resolve()
PORT = 7000
KEYSETS = ("uniform", "model")
CALL_TIMEOUT = 300.0  # one call; with one node and 200 MiB per call, calls take ~25 s
FORM_TIMEOUT = 60.0
SETTLE_TIMEOUT = 600.0
READY_TIMEOUT = 120.0  # workers made their arrays and learnt the topology
CONTROL_TIMEOUT = 600.0  # loading the key set (at 300 Mbit/s: seconds)
START_MARGIN = 0.3  # the workers start this long after the go is sent
# The nodes stop by shutdown_cluster (nothing handed off); stopped by SIGTERM (an error, an
# interruption) they hand their keys off for this long at most.
DRAIN_TIMEOUT = 2.0
QUICK = {
    "nodes": [2],
    "rs": [1],
    "seconds": 3.0,
    "warmup": 0.5,
    "scale": 0.01,
    "workers": 2,
}
# The calls' pro-rated bytes over the workers' wire bytes: ~1 (see NOTES); outside this
# range the calls progressed unevenly in the window.
AGREE = (0.9, 1.1)
UNIT = 1024  # a "4 MiB" tensor is UNIT x UNIT float32 at --scale 1
EMBEDDING_WIDTH = 512
EMBEDDING_SHARE = 0.4
# The C++ baseline moves a whole key set in one message each way: its frame limit and the
# client's are 256 MiB (less a little for the names and framing).
CPP_MAX_BYTES = 256 * 1024 * 1024 - (1 << 20)


# ---------------------------------------------------------------------------
# Key sets


def _rows(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def keyset_shapes(name: str, scale: float) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape (float32) of key set ``name`` at ``scale``."""
    if name == "uniform":
        return {f"u{i:02d}": (_rows(UNIT, scale), UNIT) for i in range(32)}
    if name != "model":
        raise ValueError(f"no key set {name!r}: {', '.join(KEYSETS)}")
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(24):
        shapes[f"layer{i:02d}.w"] = (_rows(UNIT, scale), UNIT)  # 4 MiB
        shapes[f"layer{i:02d}.proj"] = (_rows(UNIT // 4, scale), UNIT)  # 1 MiB
    for i in range(100):
        shapes[f"norm{i:03d}"] = (_rows(UNIT, scale),)  # 4 KiB
    rest = sum(4 * int(np.prod(s)) for s in shapes.values())
    embedding = rest * EMBEDDING_SHARE / (1 - EMBEDDING_SHARE)  # bytes: a share of the whole
    rows = max(1, round(embedding / (4 * EMBEDDING_WIDTH)))
    return {"embedding": (rows, EMBEDDING_WIDTH), **shapes}


def keyset_bytes(name: str, scale: float) -> int:
    return sum(4 * int(np.prod(shape)) for shape in keyset_shapes(name, scale).values())


def keyset_arrays(name: str, scale: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        n: rng.standard_normal(shape, dtype=np.float32)
        for n, shape in keyset_shapes(name, scale).items()
    }


def partition_bytes(scale: float) -> int:
    """The nodes' ``--partition-bytes``: one "4 MiB" tensor, as scaled (whole at any scale)."""
    return 4 * UNIT * _rows(UNIT, scale)


# ---------------------------------------------------------------------------
# Inside the lab: the writer and placement (``--control``), the workers (``--worker``)


def placement_report(topology: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Where the bytes are: keys and bytes per member at their primary, and at every replica.

    Each parameter is cut as the nodes cut it (``layout_for`` with the topology's
    ``partition_bytes``); a partition is a key of its own. Manifests are not counted.
    """
    from aioparamsync import to_parameter
    from aioparamsync.placement import LIVE, PLACED, Placement
    from aioparamsync.values.partitions import layout_for

    placed = [m.node_id for m in topology.members if m.state in PLACED]
    live = {m.node_id for m in topology.members if m.state in LIVE}
    placement = Placement(placed, topology.replication_factor or None, topology.claims)
    cut = topology.partition_bytes or 0
    keys: dict[str, int] = {}
    for name, shape in shapes.items():
        p = to_parameter(name, np.empty(shape, np.float32))
        layout = layout_for(p, cut)
        if layout is None:
            keys[name] = 4 * int(np.prod(shape))
        else:
            for i, key in enumerate(layout.keys(name)):
                lo, hi = layout.bounds(i)
                keys[key] = 4 * (hi - lo)
    primary_keys = dict.fromkeys(placed, 0)
    primary_bytes = dict.fromkeys(placed, 0)
    replica_bytes = dict.fromkeys(placed, 0)
    for key, nbytes in keys.items():
        first = placement.primary(key, live)
        if first is None:
            raise RuntimeError(f"no live replica of {key!r}")
        primary_keys[first] += 1
        primary_bytes[first] += nbytes
        for member in placement.replicas(key):
            replica_bytes[member] += nbytes
    return {
        "keys": len(keys),
        "partitioned": sum(1 for k in keys if "\x00" in k),
        "primary_keys": primary_keys,
        "primary_bytes": primary_bytes,
        "replica_bytes": replica_bytes,
        "partition_bytes": cut,
    }


async def control(spec: dict[str, Any]) -> dict[str, Any]:
    """``setup``: wait for the cluster, load the key set, place it; ``teardown``: counters, stop."""
    from aioparamsync import ParameterClient

    addresses: list[str] = spec["addresses"]
    direct = [ParameterClient(a, timeout=CALL_TIMEOUT, route=False) for a in addresses]
    try:
        if spec["action"] == "teardown":
            infos = await asyncio.gather(*(c.info() for c in direct))
            result = await direct[0].shutdown_cluster()
            return {
                "counters": [dict(i.counters) for i in infos],
                "stopping": result.stopping,
            }
        n = len(addresses)

        async def formed() -> list[Any] | None:
            tops = await asyncio.gather(*(c.topology() for c in direct))
            ok = all(sum(m.state == "up" for m in t.members) == n for t in tops)
            return tops if ok else None

        t0 = time.monotonic()
        tops = await until(formed, FORM_TIMEOUT, f"every node sees {n} members up")
        formed_s = time.monotonic() - t0
        arrays = keyset_arrays(spec["keyset"], spec["scale"], seed=0)
        t0 = time.monotonic()
        async with ParameterClient(addresses[0], timeout=CALL_TIMEOUT) as writer:
            await writer.update_arrays(arrays, acks="all")
        load_s = time.monotonic() - t0

        # Settled: no node moving keys, and (balanced by bytes) the claims the same
        # for a few balance rounds (``--balance-interval`` seconds each).
        # Every node has run two rounds since the load, none is claiming keys, and the
        # claims held still for 3 rounds (with --balance-interval 0: none run).
        quiet = max(3.0, 3 * spec["balance_interval"])
        seen: dict[str, Any] = {"claims": None, "since": time.monotonic()}
        rounds0 = [
            i.counters.get("balance_rounds", 0)
            for i in await asyncio.gather(*(c.info() for c in direct))
        ]

        async def settled() -> list[Any] | None:
            infos = await asyncio.gather(*(c.info() for c in direct))
            claims = [sorted((t.claims or {}).items()) for t in (i.topology for i in infos)]
            now = time.monotonic()
            busy = any(i.keys_moving or i.counters.get("keys_claiming", 0) for i in infos)
            rounds = [i.counters.get("balance_rounds", 0) for i in infos]
            if spec["balance_interval"] and any(
                r < r0 + 2 for r, r0 in zip(rounds, rounds0, strict=True)
            ):
                busy = True
            if claims != seen["claims"] or busy:
                seen.update(claims=claims, since=now)
                return None
            return infos if now - seen["since"] >= quiet else None

        t0 = time.monotonic()
        infos = await until(settled, SETTLE_TIMEOUT, "no node moving keys, claims unchanged")
        balance_s = time.monotonic() - t0
        tops = await asyncio.gather(*(c.topology() for c in direct))
        report = placement_report(tops[0], {k: a.shape for k, a in arrays.items()})
        ids = [i.node_id for i in infos]
        return {
            "node_ids": ids,
            "epoch": tops[0].epoch,
            "replication_factor": tops[0].replication_factor,
            "total_bytes": sum(a.nbytes for a in arrays.values()),
            "parameters": len(arrays),
            "keys": report["keys"],
            "partitioned_keys": report["partitioned"],
            "partition_bytes": report["partition_bytes"],
            "primary_keys": [report["primary_keys"][i] for i in ids],
            "primary_bytes": [report["primary_bytes"][i] for i in ids],
            "replica_bytes": [report["replica_bytes"][i] for i in ids],
            "held_bytes": [i.parameter_bytes for i in infos],  # info(): what each holds
            "held_count": [i.parameter_count for i in infos],
            "counters": [dict(i.counters) for i in infos],
            "formed_seconds": formed_s,
            "load_seconds": load_s,
            "settle_seconds": balance_s,
            "claims": len(tops[0].claims or {}),
        }
    finally:
        await asyncio.gather(*(c.close() for c in direct), return_exceptions=True)


def _wire() -> tuple[int, int]:
    """This host's ``eth0`` bytes (received, sent), from the namespace's /sys."""
    base = "/sys/class/net/eth0/statistics/"
    with open(base + "rx_bytes") as rx, open(base + "tx_bytes") as tx:
        return int(rx.read()), int(tx.read())


def prorated(calls: list[tuple[float, float, int]], t0: float, t1: float) -> float:
    """The bytes of ``calls`` (start, end, bytes) that fall in ``[t0, t1]``, each call's
    bytes spread evenly over its duration."""
    total = 0.0
    for start, end, nbytes in calls:
        inside = min(end, t1) - max(start, t0)
        if inside > 0:
            total += nbytes * inside / (end - start)
    return total


async def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One worker: a get loop and an update loop over the whole key set (see the module).

    ``founding``: against Thrift's C++ server, which has the founding IDL's methods only: the
    same updates and reads, sent under those names (``update_arrays`` and ``get_arrays``
    send ``push_parameters`` and ``pull_parameters``), and no routing (no ``topology``).
    """
    from aioparamsync import ParameterClient
    from aioparamsync.client.updates import make_update
    from aioparamsync.wire import thrift

    arrays = keyset_arrays(spec["keyset"], spec["scale"], seed=1 + spec["index"])
    names = list(arrays)
    total = sum(a.nbytes for a in arrays.values())
    loop = asyncio.get_running_loop()
    clock = time.monotonic
    founding = spec["founding"]
    reader = ParameterClient(spec["address"], timeout=CALL_TIMEOUT, route=not founding)
    writer = (
        reader
        if spec["one_client"]
        else ParameterClient(spec["address"], timeout=CALL_TIMEOUT, route=not founding)
    )

    async def get() -> int:
        if founding:
            request = thrift.ParameterRequest(param_names=names)
            params = (await reader.call("get_parameters", request=request)).params
            got = {p.name: memoryview(p.data).nbytes for p in params}
        else:
            got = {n: a.nbytes for n, a in (await reader.get_arrays(names)).items()}
        nbytes = sum(got.values())
        if len(got) != len(names) or nbytes != total:
            raise RuntimeError(f"read {len(got)} of {len(names)} parameters, {nbytes} bytes")
        return nbytes

    async def update() -> int:
        if founding:  # (the update update_arrays makes)
            await writer.call("update_parameters", update=make_update(arrays, None))
        else:
            await writer.update_arrays(arrays)
        return total

    try:
        if founding:  # The server starts empty: each stores its set, then reads it.
            await update()
            await get()
        else:  # Each connects and learns the topology before the clock starts.
            await asyncio.gather(reader.get_arrays(names[:1]), writer.get_arrays(names[-1:]))
        print(json.dumps({"ready": True}), flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        start = float(line)
        late = clock() - start
        t0 = start + spec["warmup"]
        t1 = t0 + spec["seconds"]
        await asyncio.sleep(max(0.0, start - clock()))

        async def repeat(op: Any) -> list[tuple[float, float, int]]:
            calls = []
            while clock() < t1:
                s = clock()
                nbytes = await op()
                calls.append((s, clock(), nbytes))
            return calls

        async def sample() -> tuple[tuple[int, int], tuple[int, int], float]:
            await asyncio.sleep(max(0.0, t0 - clock()))
            w0, cpu0 = _wire(), time.process_time()
            await asyncio.sleep(max(0.0, t1 - clock()))
            w1, cpu1 = _wire(), time.process_time()
            return (w0, w1, cpu1 - cpu0)

        gets, updates, (w0, w1, cpu) = await asyncio.gather(repeat(get), repeat(update), sample())
    finally:
        await reader.close()
        if writer is not reader:
            await writer.close()
    window = t1 - t0

    def done_in(calls: list[tuple[float, float, int]]) -> int:
        return sum(1 for s, e, _ in calls if t0 <= s and e <= t1)

    return {
        "index": spec["index"],
        "window_seconds": window,
        "late_seconds": late,
        "get_bytes": prorated(gets, t0, t1),
        "update_bytes": prorated(updates, t0, t1),
        "get_calls": len(gets),
        "update_calls": len(updates),
        "get_calls_inside": done_in(gets),
        "update_calls_inside": done_in(updates),
        "get_seconds_max": max((e - s for s, e, _ in gets), default=0.0),
        "update_seconds_max": max((e - s for s, e, _ in updates), default=0.0),
        "tail_seconds": max(e for _, e, _ in gets + updates) - t1,
        "wire_rx_bytes": w1[0] - w0[0],
        "wire_tx_bytes": w1[1] - w0[1],
        "cpu_seconds": cpu,
    }


def run_inside(role: str, text: str) -> int:
    """``--control``/``--worker``: run it, print its JSON result as the last line."""
    from aioparamsync import run

    spec = json.loads(text)
    result = run(control(spec) if role == "control" else worker(spec))
    print(json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------
# The driver (outside the lab)


class LabNode(ServerProcess):
    """A server process on a lab host (a node, or the C++ baseline): bench_node's
    ServerProcess (waits for its ``listening on`` line, reads its CPU, stops it by PID),
    started by ``host.popen``."""

    def __init__(self, host: Host, name: str, cmd: Sequence[str], env: dict[str, str]) -> None:
        self.variant = f"{name} ({host.ip})"
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.tmp = tempfile.TemporaryDirectory()  # (ServerProcess.stop removes it)
        self.proc = host.popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            preexec_fn=_die_with_parent,
        )
        try:
            self.address = self._wait_listening()
        except BaseException:
            self.stop()
            raise


def start_nodes(
    hosts: list[Host], r: int, args: argparse.Namespace, env: dict[str, str]
) -> list[LabNode]:
    nodes: list[LabNode] = []
    try:
        for i, host in enumerate(hosts):
            cmd = [sys.executable, "-m", "aioparamsync", "--host", host.ip, "--port", str(PORT)]
            cmd += ["--replication-factor", str(r), "--log-level", "warning"]
            cmd += ["--repair-interval", "600", "--partition-bytes", str(args.partition_bytes)]
            cmd += ["--drain-timeout", str(DRAIN_TIMEOUT)]
            cmd += ["--balance-interval", repr(args.balance_interval)]
            if i:
                cmd += ["--peers", f"{hosts[0].ip}:{PORT}"]
            nodes.append(LabNode(host, f"node {i}", [*cmd, *args.node_args], env))
    except BaseException:
        stop_nodes(nodes)
        raise
    return nodes


def stop_nodes(nodes: list[LabNode], wait: float = 0.0) -> None:
    """Wait up to ``wait`` s for the nodes to exit (after a shutdown); SIGTERM to those left,
    all at once (each hands off keys for ``--drain-timeout`` at most); then each stopped by
    its PID (SIGKILL if it lingers)."""
    deadline = time.monotonic() + wait
    for n in nodes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            n.proc.wait(max(0.0, deadline - time.monotonic()))
    for n in nodes:
        if n.proc.poll() is None:
            with contextlib.suppress(OSError):
                n.proc.send_signal(signal.SIGTERM)
    for n in nodes:
        n.stop()


def inside(host: Host, role: str, spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Run ``--control`` in ``host`` to its end; its JSON result."""
    done = host.run(
        [sys.executable, THIS, f"--{role}", json.dumps(spec)],
        timeout=CONTROL_TIMEOUT,
        check=False,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(f"--{role} {spec.get('action')} exited {done.returncode}: {done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cpu(nodes: list[LabNode]) -> tuple[float, float]:
    return sum(n.cpu_seconds() for n in nodes), machine_cpu_seconds()[0]


def run_workers(
    hosts: list[Host],
    nodes: list[LabNode],
    keyset: str,
    args: argparse.Namespace,
    env: dict[str, str],
    founding: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Start the workers, let them go together; their results and the window's CPU.

    ``founding``: the server is Thrift's C++ one (see ``worker``)."""
    address = "{}:{}".format(*nodes[0].address)
    procs: list[subprocess.Popen[bytes]] = []
    errors: list[Any] = []
    try:
        for i, host in enumerate(hosts):
            spec = {"address": address, "keyset": keyset, "scale": args.scale, "index": i}
            spec |= {"seconds": args.seconds, "warmup": args.warmup, "one_client": args.one_client}
            spec["founding"] = founding
            err = tempfile.TemporaryFile()  # noqa: SIM115 - closed below
            errors.append(err)
            procs.append(
                host.popen(
                    [sys.executable, THIS, "--worker", json.dumps(spec)],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    preexec_fn=_die_with_parent,
                )
            )

        def line(i: int, deadline: float) -> dict[str, Any]:
            try:
                return json.loads(read_line(procs[i], deadline))
            except (RuntimeError, TimeoutError) as exc:
                errors[i].seek(0)
                tail = errors[i].read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"worker {i}: {exc}\n{tail}") from None

        deadline = time.monotonic() + READY_TIMEOUT
        for i in range(len(procs)):
            line(i, deadline)
        start = time.monotonic() + START_MARGIN
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start!r}\n".encode())
            p.stdin.flush()
        t0, t1 = start + args.warmup, start + args.warmup + args.seconds
        time.sleep(max(0.0, t0 - time.monotonic()))
        nodes0, busy0 = _cpu(nodes)
        time.sleep(max(0.0, t1 - time.monotonic()))
        nodes1, busy1 = _cpu(nodes)
        deadline = time.monotonic() + CALL_TIMEOUT + 30
        results = [line(i, deadline) for i in range(len(procs))]
        for p in procs:
            p.wait(SERVER_STOP_TIMEOUT)
        cpu = {"nodes": (nodes1 - nodes0) / args.seconds, "busy": (busy1 - busy0) / args.seconds}
        return results, cpu
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        for err in errors:
            err.close()


def run_one(
    lab_hosts: dict[str, list[Host]],
    n: int,
    r: int,
    keyset: str,
    args: argparse.Namespace,
    env: dict[str, str],
) -> dict[str, Any]:
    """One cluster of ``n`` nodes, replication ``r``: load ``keyset``, run the workers."""
    load1 = load_average()
    nodes = start_nodes(lab_hosts["nodes"][:n], r, args, env)
    ctl = lab_hosts["ctl"][0]
    shut_down = False
    try:
        addresses = ["{}:{}".format(*node.address) for node in nodes]
        setup = inside(
            ctl,
            "control",
            {
                "action": "setup",
                "addresses": addresses,
                "keyset": keyset,
                "scale": args.scale,
                "balance_interval": args.balance_interval,
            },
            env,
        )
        results, cpu = run_workers(lab_hosts["workers"], nodes, keyset, args, env)
        after = inside(ctl, "control", {"action": "teardown", "addresses": addresses}, env)
        shut_down = True
    except BaseException:
        dead = "; ".join(
            f"{x.variant} exited {x.proc.returncode}: {x.stderr_tail(800)}"
            for x in nodes
            if x.proc.poll() is not None
        )
        if dead:
            print(f"a node died: {dead}", file=sys.stderr)
        raise
    finally:
        # After shutdown_cluster the nodes exit by themselves; else SIGTERM, all at once.
        stop_nodes(nodes, wait=SERVER_STOP_TIMEOUT if shut_down else 0.0)
    traffic = [
        {key: (b.get(key, 0) - a.get(key, 0)) for key in ("bytes_in", "bytes_out", "requests")}
        for a, b in zip(setup["counters"], after["counters"], strict=True)
    ]
    primary = setup["primary_bytes"]
    mean = sum(primary) / len(primary)
    return {
        "server": "aioparamsync",
        "keyset": keyset,
        "nodes": n,
        "replication_factor": r,
        "load1": load1,
        "total_bytes": setup["total_bytes"],
        "parameters": setup["parameters"],
        "keys": setup["keys"],
        "partitioned_keys": setup["partitioned_keys"],
        "partition_bytes": setup["partition_bytes"],
        "node_ids": setup["node_ids"],
        "primary_keys": setup["primary_keys"],
        "primary_bytes": primary,
        "primary_max_over_mean": max(primary) / mean if mean else None,
        "replica_bytes": setup["replica_bytes"],
        "held_bytes": setup["held_bytes"],
        "held_count": setup["held_count"],
        "load_seconds": setup["load_seconds"],
        "settle_seconds": setup["settle_seconds"],
        "claims": setup["claims"],
        "node_traffic": traffic,  # per node, from the load's end to the workers' end
        **figures(results, cpu, args),
    }


def run_baseline(
    lab_hosts: dict[str, list[Host]], keyset: str, args: argparse.Namespace, env: dict[str, str]
) -> dict[str, Any]:
    """Thrift's C++ server alone on the first node's host (its link), holding all of
    ``keyset``; the workers as for a cluster, under the founding IDL's method names."""
    load1 = load_average()
    host = lab_hosts["nodes"][0]
    cmd = [str(args.cpp_server), "--host", host.ip, "--port", str(PORT)]
    cmd += ["--threads", str(8 * args.workers)]  # (2 clients a worker, up to 4 connections each)
    server = LabNode(host, "cpp", cmd, cpp_environment(env, args.malloc))
    try:
        results, cpu = run_workers(lab_hosts["workers"], [server], keyset, args, env, founding=True)
    except BaseException:
        if server.proc.poll() is not None:
            print(f"the C++ server died: {server.stderr_tail(800)}", file=sys.stderr)
        raise
    finally:
        server.stop()
    shapes = keyset_shapes(keyset, args.scale)
    total = keyset_bytes(keyset, args.scale)
    return {
        "server": "cpp",
        "keyset": keyset,
        "nodes": 1,
        "replication_factor": 1,
        "load1": load1,
        "total_bytes": total,
        "parameters": len(shapes),
        "keys": len(shapes),
        "partitioned_keys": 0,
        "partition_bytes": 0,
        "primary_keys": [len(shapes)],
        "primary_bytes": [total],
        "primary_max_over_mean": 1.0,
        **figures(results, cpu, args),
    }


def figures(
    results: list[dict[str, Any]], cpu: dict[str, float], args: argparse.Namespace
) -> dict[str, Any]:
    """A row's measures: the workers' bytes per second of the window, the CPU."""
    window = args.seconds
    return {
        "workers": len(results),
        "mbit": args.mbit,
        "seconds": window,
        "warmup": args.warmup,
        "scale": args.scale,
        "aggregate_bytes_per_s": sum(w["get_bytes"] + w["update_bytes"] for w in results) / window,
        "get_bytes_per_s": sum(w["get_bytes"] for w in results) / window,
        "update_bytes_per_s": sum(w["update_bytes"] for w in results) / window,
        "wire_bytes_per_s": sum(w["wire_rx_bytes"] + w["wire_tx_bytes"] for w in results) / window,
        "worker_bytes_per_s": [(w["get_bytes"] + w["update_bytes"]) / window for w in results],
        "node_cpu": cpu["nodes"],  # CPU seconds of all server processes / window seconds
        "workers_cpu": sum(w["cpu_seconds"] for w in results) / window,
        "machine_busy": cpu["busy"],  # the machine's busy CPUs in the window
        "workers_detail": results,
    }


# ---------------------------------------------------------------------------
# Summary


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_1``: over N=1 R=1 of the same key set; ``vs_2_r2`` (R=2 only): over N=2 R=2;
    ``vs_cpp``: over Thrift's C++ server with the same key set.

    Of the aggregate (the calls' bytes); ``*_wire``: the same of the wire's.
    """
    by = {
        (r["keyset"], r["nodes"], r["replication_factor"]): r for r in rows if r["server"] != "cpp"
    }
    cpp = {r["keyset"]: r for r in rows if r["server"] == "cpp"}
    for r in rows:
        one = by.get((r["keyset"], 1, 1))
        r2 = r["server"] != "cpp" and r["replication_factor"] == 2
        two = by.get((r["keyset"], 2, 2)) if r2 else None
        base = cpp.get(r["keyset"])
        for suffix, key in (("", "aggregate_bytes_per_s"), ("_wire", "wire_bytes_per_s")):
            r["vs_1" + suffix] = r[key] / one[key] if one and one[key] else None
            r["vs_2_r2" + suffix] = r[key] / two[key] if two and two[key] else None
            r["vs_cpp" + suffix] = r[key] / base[key] if base and base[key] else None


def _ratios(row: dict[str, Any], key: str) -> str:
    calls, wire = row[key], row[key + "_wire"]
    return "-" if calls is None else f"{calls:.2f}x / {wire:.2f}x"


def _agreement(row: dict[str, Any]) -> str:
    """The calls' pro-rated bytes over the wire's; ``!`` where they disagree (see NOTES)."""
    wire = row["wire_bytes_per_s"]
    if not wire:
        return "-"
    ratio = row["aggregate_bytes_per_s"] / wire
    return f"{ratio:.2f}" + ("" if AGREE[0] <= ratio <= AGREE[1] else " !")


def print_tables(rows: list[dict[str, Any]], out: Any = sys.stdout) -> None:
    head = (
        "N",
        "R",
        "primaries per node (keys)",
        "primary MB per node",
        "max/mean",
        "aggregate MB/s",
        "get / update MB/s",
        "wire MB/s",
        "calls/wire",
        "vs 1 node (calls / wire)",
        "vs 2 nodes R=2 (calls / wire)",
        "vs C++ (calls / wire)",
        "CPU nodes / workers / machine",
    )
    for keyset in dict.fromkeys(r["keyset"] for r in rows):
        mine = [r for r in rows if r["keyset"] == keyset]
        first = next((r for r in mine if r["server"] != "cpp"), mine[0])  # (how nodes cut it)
        print(
            f"\n{keyset}: {first['parameters']} parameters, {first['total_bytes'] / 1e6:.1f} MB "
            f"in {first['keys']} keys ({first['partitioned_keys']} of them partitions of "
            f"{fmt_size(first['partition_bytes'])})\n",
            file=out,
        )
        lines = [
            (
                "C++" if r["server"] == "cpp" else str(r["nodes"]),
                "-" if r["server"] == "cpp" else str(r["replication_factor"]),
                "/".join(map(str, r["primary_keys"])),
                "/".join(f"{b / 1e6:.1f}" for b in r["primary_bytes"]),
                f"{r['primary_max_over_mean']:.2f}",
                f"{r['aggregate_bytes_per_s'] / 1e6:.1f}",
                f"{r['get_bytes_per_s'] / 1e6:.1f} / {r['update_bytes_per_s'] / 1e6:.1f}",
                f"{r['wire_bytes_per_s'] / 1e6:.1f}",
                _agreement(r),
                _ratios(r, "vs_1"),
                _ratios(r, "vs_2_r2"),
                _ratios(r, "vs_cpp"),
                f"{r['node_cpu']:.2f} / {r['workers_cpu']:.2f} / {r['machine_busy']:.2f}",
            )
            for r in mine
        ]
        _print_md(head, lines, out)


NOTES = """\
* primaries per node, primary MB per node: each key's bytes at its primary (the project's
  placement over the members; a partitioned parameter's partitions are keys of their own);
  max/mean: of the primary bytes per node.
* aggregate: the sum over the workers of the bytes of their get_arrays and update_arrays
  calls in the window, each call pro-rated by its share of the window, per second.
  wire: the workers' eth0 byte counters, both ways, in the window: what crossed their links,
  payload and Thrift framing (a GSO packet's TCP/IP headers count once per 64 KiB, so this
  is within ~1% of the payload; the shaping counts every segment's headers: a fully used
  300 Mbit/s link carries 35.9 MB/s of payload).
  calls/wire: aggregate over wire, ~1 when the pro-rating holds. Marked ! outside 0.9..1.1:
  calls progressed unevenly inside the window (calls longer than the window, such as
  updates that waited for the node's receive budget before they moved their bytes), and
  the wire figure is the one to read; a longer --seconds evens it out.
* vs 1 node: over N=1 R=1 of the same key set, of the aggregate and of the wire;
  vs 2 nodes R=2 (R=2 rows): over N=2 R=2, the same; vs C++: over the C++ row, the same.
* C++: Apache Thrift's C++ server (TThreadPoolServer, framed, binary: benchmarks/cpp/) alone
  on n0, the first node's host and link, holding the whole key set; the same workers make
  the same calls, under the founding IDL's method names (update_parameters and
  get_parameters, unrouted), as that server has no others. Its primaries: the whole set.
* CPU: in the window, as CPUs busy (1.0 = one core): all node processes (or the C++ server),
  all workers, and the whole machine (every host shares its CPUs; the machine's figure also
  holds the kernel's work on the links, and any other work on the machine)."""


# ---------------------------------------------------------------------------
# Main


def build_parser(quick: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n", 1)[0])
    p.add_argument("--nodes", type=_list_of(_positive_int), default=[1, 2, 4])
    p.add_argument("--rs", type=_list_of(_positive_int), default=[1, 2], help="replication")
    p.add_argument("--workers", type=_positive_int, default=4)
    p.add_argument("--mbit", type=_positive_float, default=300.0, help="every link, each way")
    p.add_argument(
        "--keysets",
        type=_list_of(str),
        default=list(KEYSETS),
        help=f"comma separated, of {', '.join(KEYSETS)}",
    )
    p.add_argument("--scale", type=_positive_float, default=1.0, help="times every size")
    p.add_argument("--seconds", type=_positive_float, default=12.0, help="the timed window")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds before it, not counted")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke: --nodes 2 --rs 1 --seconds 3 --warmup 0.5 --scale 0.01 --workers 2 "
        "(flags given win)",
    )
    p.add_argument(
        "--balance-interval",
        type=float,
        default=1.0,
        help="every node's --balance-interval (placement balanced by bytes; 0: hashing "
        "alone); the run waits until the claims hold still for 3 such rounds "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--one-client",
        action="store_true",
        help="each worker's two loops share one client (default: a client each; see the "
        "module's docstring)",
    )
    p.add_argument(
        "--node-args",
        type=shlex.split,
        default=[],
        help="more flags for every node, one string (e.g. '--max-receiving-bytes 0')",
    )
    p.add_argument(
        "--malloc",
        choices=("tuned", "default"),
        default="tuned",
        help="glibc malloc settings of every process, as bench_node.py (default: %(default)s)",
    )
    p.add_argument(
        "--baseline",
        choices=("cpp", "none"),
        default="cpp",
        help="cpp: first, for each key set, Apache Thrift's C++ server on one host, same link, "
        "the row every other is divided by (vs C++); skipped, saying why, where it cannot "
        "be built (benchmarks/cppserver.py) (default: %(default)s)",
    )
    p.add_argument("--json", metavar="PATH", help="write the rows (and the machine) to PATH")
    p.add_argument("--control", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    if quick:
        p.set_defaults(**QUICK)
    return p


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = build_parser(quick="--quick" in raw).parse_args(raw)
    if args.control or args.worker:
        return run_inside("control" if args.control else "worker", args.control or args.worker)
    unknown = [k for k in args.keysets if k not in KEYSETS]
    if unknown or not args.keysets or not args.nodes or not args.rs or args.warmup < 0:
        print(f"bad --keysets {unknown}, --nodes, --rs or --warmup", file=sys.stderr)
        return 2
    plan = [(k, n, r) for k in args.keysets for n in args.nodes for r in args.rs if r <= n]
    if not plan:
        print("every R is more than every N: nothing to run", file=sys.stderr)
        return 2
    args.partition_bytes = partition_bytes(args.scale)
    if args.json:  # before the runs: a bad path fails at once
        Path(args.json).resolve().parent.mkdir(parents=True, exist_ok=True)
    env = run_environment(args.malloc, THIS, reexec=argv is None)
    if env is None:
        return 2
    args.cpp_server, args.cpp_skipped = None, {}  # keyset -> why it has no C++ row
    if args.baseline == "cpp":
        from cppserver import CppBaselineUnavailable, build

        try:
            args.cpp_server = build()
        except CppBaselineUnavailable as exc:
            args.cpp_skipped = dict.fromkeys(args.keysets, exc.reason)
        for keyset in args.keysets:
            nbytes = keyset_bytes(keyset, args.scale)
            if args.cpp_server and nbytes > CPP_MAX_BYTES:
                args.cpp_skipped[keyset] = (
                    f"{nbytes / 1e6:.0f} MB, more than one message holds "
                    f"({CPP_MAX_BYTES / 1e6:.0f} MB)"
                )
        for keyset, why in args.cpp_skipped.items():
            print(f"{keyset}: the C++ baseline is skipped: {why}", file=sys.stderr)
    try:
        return drive(plan, args, env)
    except NetLabUnavailable as exc:
        print(f"bench_scaleout: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; the lab was torn down", file=sys.stderr)
        return 130


def drive(plan: list[tuple[str, int, int]], args: argparse.Namespace, env: dict[str, str]) -> int:
    rows = []
    t_start = time.monotonic()
    with NetLab() as lab:
        hosts = {
            "nodes": [lab.host(f"n{i}", mbit=args.mbit) for i in range(max(n for _, n, _ in plan))],
            "workers": [lab.host(f"w{i}", mbit=args.mbit) for i in range(args.workers)],
            "ctl": [lab.host("ctl")],  # unshaped: loading and reading counters only
        }
        for i, (keyset, n, r) in enumerate(plan, 1):
            first = not any(x["keyset"] == keyset for x in rows)
            if first and args.cpp_server and keyset not in args.cpp_skipped:
                row = run_baseline(hosts, keyset, args, env)
                rows.append(row)
                print(
                    f"[{time.monotonic() - t_start:6.1f}s] {keyset} C++: "
                    f"{row['aggregate_bytes_per_s'] / 1e6:8.1f} MB/s (wire "
                    f"{row['wire_bytes_per_s'] / 1e6:.1f}), server CPU {row['node_cpu']:.2f}, "
                    f"busy {row['machine_busy']:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
            row = run_one(hosts, n, r, keyset, args, env)
            rows.append(row)
            print(
                f"[{i}/{len(plan)} {time.monotonic() - t_start:6.1f}s] {keyset} N={n} R={r}: "
                f"{row['aggregate_bytes_per_s'] / 1e6:8.1f} MB/s (wire "
                f"{row['wire_bytes_per_s'] / 1e6:.1f}), primary max/mean "
                f"{row['primary_max_over_mean']:.2f}, node CPU {row['node_cpu']:.2f}, busy "
                f"{row['machine_busy']:.2f}, loaded in {row['load_seconds']:.1f} s, balanced "
                f"({row['claims']} keys claimed) in {row['settle_seconds']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        tag = lab.tag
    add_ratios(rows)
    meta = machine()
    meta.update(
        {
            "lab": tag,
            "mbit": args.mbit,
            "workers": args.workers,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "scale": args.scale,
            "partition_bytes": args.partition_bytes,
            "malloc": args.malloc,
            "node_args": args.node_args,
            "cpp_server": str(args.cpp_server) if args.cpp_server else None,
            "cpp_skipped": args.cpp_skipped,
            "load1_after": load_average(),
        }
    )
    print(f"\naioparamsync at {meta['git']}")
    print(
        f"{meta['cpus']} CPUs ({meta['cpu_model']}), Python {meta['python']}, uvloop "
        f"{meta['uvloop']}, malloc {args.malloc}; every host a network namespace, links "
        f"{args.mbit:g} Mbit/s each way (htb), {args.workers} workers; window {args.seconds:g} s "
        f"after {args.warmup:g} s warm-up; scale {args.scale:g}; one run per row; all hosts "
        f"share the CPUs"
    )
    if args.cpp_server:
        tuned = cpp_environment({}, args.malloc)  # (one malloc arena under the tuning)
        print(
            f"C++: Apache Thrift's TThreadPoolServer ({args.cpp_server})"
            + (f", with {tuned}" if tuned else "")
        )
    for keyset, why in args.cpp_skipped.items():
        print(f"{keyset}: the C++ baseline is skipped: {why}")
    print_tables(rows)
    print()
    print(NOTES)
    if args.json:
        doc = {"meta": meta, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
