#!/usr/bin/env python3
"""A push of gradients beside an update of the same bytes: what a fold costs the node.

One command, one node process (``python -m aioparamsync``, in memory) on loopback, the
client on uvloop (``aioparamsync.run``); or two nodes in turn with ``--paths compiled,pure``
(the second with ``AIOPARAMSYNC_NO_EXT=1``: the rules' arithmetic in numpy instead of
``values/_cfold.pyx``)::

    python benchmarks/bench_push.py [--sizes 4KiB,1MiB,64MiB] [--rules sgd,momentum,adam]
                                    [--count 10] [--paths compiled,pure] [--json out.json]
                                    [--node-args '--partition-bytes 0']

For each SIZE and RULE, one float32 parameter ``w`` of SIZE bytes with that rule:

* ``update``: ``--count`` timed ``update_arrays({"w": array})``;
* ``push``: ``--count`` timed ``push_gradients({"w": grad})``, the gradient's bytes as many;

after two untimed calls of each (the node touches the memory of both generations of ``w``).
Reported: each median in ms, and ``push / update`` (the target of the gradient path: a push
costs no more than an update, about 1.0). The client and the node share the machine's
cores (loopback): the client's own time is in both figures alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import NODE_ARGS, ServerProcess, _list_of, parse_size

import aioparamsync
from aioparamsync import ParameterClient, adam, sgd

RULES = {"sgd": sgd(0.01), "momentum": sgd(0.01, momentum=0.9), "adam": adam(0.001)}


async def timed(count: int, call: Any) -> float:
    """The median seconds of ``count`` calls, after two untimed ones."""
    for _ in range(2):
        await call()
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        await call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


async def case(client: ParameterClient, size: int, rule: str, count: int) -> dict:
    name = f"w-{size}-{rule}"
    n = max(1, size // 4)
    value = np.random.default_rng(size).standard_normal(n).astype(np.float32)
    grad = np.random.default_rng(size + 1).standard_normal(n).astype(np.float32) * 1e-3
    await client.update_arrays({name: value}, rules=RULES[rule])
    update = await timed(count, lambda: client.update_arrays({name: value}))
    push = await timed(count, lambda: client.push_gradients({name: grad}))
    return {"bytes": n * 4, "rule": rule, "update_s": update, "push_s": push}


async def run_path(path: str, args: argparse.Namespace) -> list[dict]:
    env = dict(os.environ)
    if path == "pure":
        env["AIOPARAMSYNC_NO_EXT"] = "1"
    node = ServerProcess(
        f"node-{path}",
        env,
        cmd=[sys.executable, "-m", "aioparamsync", *NODE_ARGS, *shlex.split(args.node_args)],
    )
    try:
        async with ParameterClient(node.address, timeout=120) as client:
            results = []
            for size in args.sizes:
                for rule in args.rules:
                    r = await case(client, size, rule, args.count)
                    r["path"] = path
                    results.append(r)
                    print(describe(r), flush=True)
            return results
    finally:
        node.stop()


def describe(r: dict) -> str:
    return (
        f"{r['path']:<8} {r['bytes']:>11,} B {r['rule']:<8} | update {r['update_s'] * 1e3:8.2f} ms"
        f" | push {r['push_s'] * 1e3:8.2f} ms | push / update {r['push_s'] / r['update_s']:.2f}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--sizes", type=_list_of(parse_size), default=[4096, 1 << 20, 64 << 20])
    p.add_argument("--rules", type=lambda t: t.split(","), default=list(RULES))
    p.add_argument("--count", type=int, default=10, help="timed calls per figure")
    p.add_argument(
        "--paths",
        type=lambda t: t.split(","),
        default=["compiled"],
        help="the node's: compiled (the default), pure (AIOPARAMSYNC_NO_EXT=1), or both",
    )
    p.add_argument(
        "--node-args", default="", help="more of the node's flags, e.g. '--partition-bytes 0'"
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    bad = [r for r in args.rules if r not in RULES] + [
        x for x in args.paths if x not in ("compiled", "pure")
    ]
    if bad:
        p.error(f"unknown: {', '.join(bad)}")
    results = []
    for path in args.paths:
        results += aioparamsync.run(run_path(path, args))  # (the client on uvloop)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
