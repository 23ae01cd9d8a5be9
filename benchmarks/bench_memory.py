#!/usr/bin/env python3
"""A node's resident memory against the bytes it holds, when it keeps only part of what it receives.

One command, fresh node processes::

    python benchmarks/bench_memory.py [--values 5] [--value-size 8MiB] [--batches 6]

Two cases, each a node (or three) started as ``python -m aioparamsync``:

1. replaced: ``--batches`` updates of ``--values`` values each (one frame each),
   then every value but the first of each batch replaced by its own update:
   the node holds one value per batch from the batched frames, the rest from
   single-value frames;
2. passed on: three nodes, ``--replication-factor 1``; a client that knows no
   topology (``route=False``) sends the same batches to node 0, which keeps
   the names it holds and passes the others on.

For each, the node's RSS (``/proc/PID/status`` VmRSS) before the first update
and after the last, against the bytes it holds (``info().parameter_bytes``):
``(rss_after - rss_before) / held`` is 1.0 when the node holds exactly its
bytes; a node that kept whole frames alive for one value of each would show
about ``--values`` in case 1. Measured after a short settle, with glibc's
default malloc settings (``--malloc tuned``, bench_node.py's, keeps freed
large buffers in the heap for reuse: RSS then counts those too).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
from bench_node import NODE_ARGS, REPO, ServerProcess, parse_size, run_environment

sys.path.insert(0, str(REPO))

from aioparamsync import ParameterClient

CALL_TIMEOUT = 60.0
SETTLE_SECONDS = 2.0


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def batches(args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    n = args.value_size
    return [
        {f"b{b}v{v}": np.full(n, (b * args.values + v) % 251, np.uint8) for v in range(args.values)}
        for b in range(args.batches)
    ]


async def replaced(args: argparse.Namespace, env: dict[str, str]) -> tuple[int, int, int]:
    node = ServerProcess("node", env, cmd=[sys.executable, "-m", "aioparamsync", *NODE_ARGS])
    try:
        async with ParameterClient(node.address, timeout=CALL_TIMEOUT, route=False) as client:
            await client.ping()
            before = rss(node.proc.pid)
            for batch in batches(args):
                await client.update_arrays(batch)
            for batch in batches(args):
                for name, value in list(batch.items())[1:]:
                    await client.update_arrays({name: value})
            await asyncio.sleep(SETTLE_SECONDS)
            held = (await client.info()).parameter_bytes
            return before, rss(node.proc.pid), held
    finally:
        node.stop()


async def passed_on(args: argparse.Namespace, env: dict[str, str]) -> tuple[int, int, int]:
    base = [sys.executable, "-m", "aioparamsync", *NODE_ARGS, "--replication-factor", "1"]
    nodes = [ServerProcess("node 0", env, cmd=base)]
    try:
        seed = "{}:{}".format(*nodes[0].address)
        nodes += [ServerProcess(f"node {i}", env, cmd=[*base, "--peers", seed]) for i in (1, 2)]
        async with ParameterClient(nodes[0].address, timeout=CALL_TIMEOUT, route=False) as client:
            deadline = time.monotonic() + 30
            while True:
                topology = await client.topology()
                if sum(m.state == "up" for m in topology.members) == 3:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError("the cluster did not form")
                await asyncio.sleep(0.1)
            before = rss(nodes[0].proc.pid)
            for batch in batches(args):
                await client.update_arrays(batch)
            await asyncio.sleep(SETTLE_SECONDS)
            held = (await client.info()).parameter_bytes
            return before, rss(nodes[0].proc.pid), held
    finally:
        for node in nodes:
            node.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--values", type=int, default=5, help="values in one batched update")
    p.add_argument("--value-size", type=parse_size, default=parse_size("8MiB"))
    p.add_argument("--batches", type=int, default=6)
    # (default: glibc's own settings, as a node runs unless told; "tuned" keeps
    # freed large buffers in the heap for reuse, so RSS also counts those)
    p.add_argument("--malloc", choices=("tuned", "default"), default="default")
    args = p.parse_args()
    env = run_environment(args.malloc, __import__("pathlib").Path(__file__).resolve(), reexec=True)
    if env is None:
        return 2
    print("python benchmarks/bench_memory.py", " ".join(sys.argv[1:]))
    mib = 1024 * 1024
    print(f"{'case':<12} {'held MiB':>9} {'RSS grew MiB':>13} {'grew/held':>10}")
    for name, case in (("replaced", replaced), ("passed on", passed_on)):
        before, after, held = asyncio.run(case(args, env))
        grew = after - before
        print(f"{name:<12} {held / mib:>9.1f} {grew / mib:>13.1f} {grew / max(held, 1):>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
