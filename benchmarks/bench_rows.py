#!/usr/bin/env python3
"""Embedding rows by id: pull and push throughput beside the node's own dense get of the
same bytes, and the memory a row takes.

One command, one node process (``python -m aioparamsync``, in memory) on loopback::

    python benchmarks/bench_rows.py [--rows 1000,10000,100000] [--dims 16,64,256]
                                    [--count 10] [--json out.json]

For each (ROWS, DIM) and each id pattern (``unique``: ROWS distinct ids drawn from
[0, 2**40); ``zipf``: ROWS ids drawn Zipf(1.2) over the same space, so few are distinct
and a push sums many gradients into each row):

* ``push``: ``--count`` timed ``push_row_gradients`` of a ``(ROWS, DIM)`` float32
  block into a table with the rule ``--rule`` (``adagrad``, a table's default, unless
  told; after one untimed push that makes the rows);
* ``pull``: ``--count`` timed ``pull_rows`` of the same ids;
* ``dense get``: beside them, the node's own ``get_arrays`` of one float32 parameter
  of ROWS x DIM values (the same bytes as the pulled rows), ``--count`` timed;
* ``dense push``: ``push_gradients`` of the same bytes into that parameter (rule
  ``sgd``: the dense rules have no ``adagrad``; both are one pass of a compiled loop;
  ``--rule sgd`` compares like with like), ``--count`` timed.

The four calls are timed in turn, ``--count`` rounds of one of each, so that the
machine's drift falls on each alike.

Reported per case: rows/s and MB/s (the rows' values, ROWS x DIM x 4 bytes, over
the median call), ``pull / dense`` and ``push / dense`` (the ratios of the medians'
throughput; the target is >= 0.6 for both at 10^5 rows x 64). Then memory, for a table
of the ``sgd`` rule (no state) and one of ``adagrad`` (one state array as large as the values),
their rows made by pushes of ``--memory-rows`` ids of dim ``--memory-dim``: the
node's ``info()`` counters ``row_bytes`` / ``rows`` (everything a row holds:
values, the rule's state, version and time, the index, spare capacity
included), beside the values' ``dim * 4``.

The client runs on uvloop (``aioparamsync.run``). The client and the node share the
machine's cores: the figures are one machine's loopback, not a network's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import NODE_ARGS, ServerProcess

import aioparamsync
from aioparamsync import ParameterClient, adagrad, sgd

ID_SPACE = 2**40


def ids_of(pattern: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if pattern == "unique":
        return rng.choice(ID_SPACE, n, replace=False).astype(np.int64)
    return (rng.zipf(1.2, n) % ID_SPACE).astype(np.int64)


async def interleaved(count: int, *calls: Any) -> list[float]:
    """The median seconds of ``count`` calls of each of ``calls``, taken in turn (a round
    calls each once), so that the machine's drift falls on each alike."""
    seconds: list[list[float]] = [[] for _ in calls]
    for _ in range(count):
        for call, times in zip(calls, seconds, strict=True):
            start = time.perf_counter()
            await call()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in seconds]


async def case(
    client: ParameterClient, rows: int, dim: int, pattern: str, count: int, rule: str
) -> dict:
    table = f"t{rows}x{dim}{pattern}"
    await client.create_table(table, dim, rule=adagrad(0.01) if rule == "adagrad" else sgd(0.01))
    ids = ids_of(pattern, rows, seed=rows + dim)
    grads = np.random.default_rng(1).standard_normal((rows, dim)).astype(np.float32)
    await client.push_row_gradients(table, ids, grads)  # (makes the rows)
    name = f"dense{rows}x{dim}"
    await client.update_arrays({name: np.zeros((rows, dim), np.float32)}, rules=sgd(0.01))
    push, pull, dense, dense_push = await interleaved(
        count,
        lambda: client.push_row_gradients(table, ids, grads),
        lambda: client.pull_rows(table, ids),
        lambda: client.get_arrays([name]),
        lambda: client.push_gradients({name: grads}),
    )
    mb = rows * dim * 4 / 1e6
    return {
        "rows": rows,
        "dim": dim,
        "ids": pattern,
        "rule": rule,
        "distinct": len(np.unique(ids)),
        "push_rows_per_s": rows / push,
        "push_MBps": mb / push,
        "pull_rows_per_s": rows / pull,
        "pull_MBps": mb / pull,
        "dense_MBps": mb / dense,
        "pull_over_dense": dense / pull,
        "dense_push_MBps": mb / dense_push,
        "push_over_dense": dense_push / push,
    }


async def run(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "aioparamsync", *NODE_ARGS]
    node = ServerProcess("node", dict(os.environ), cmd=cmd)
    try:
        async with ParameterClient(node.address, timeout=120) as client:
            results = []
            for rows in args.rows:
                for dim in args.dims:
                    for pattern in ("unique", "zipf"):
                        r = await case(client, rows, dim, pattern, args.count, args.rule)
                        results.append(r)
                        print(describe(r), flush=True)
            memory = [await measure_memory(client, args, rule) for rule in ("sgd", "adagrad")]
            return {"cases": results, "memory": memory}
    finally:
        node.stop()


def describe(r: dict) -> str:
    return (
        f"{r['rows']:>7} x {r['dim']:<4} {r['ids']:<6} ({r['distinct']:>6} distinct), {r['rule']}: "
        f"push {r['push_rows_per_s']:>10,.0f} rows/s {r['push_MBps']:>7.1f} MB/s | "
        f"pull {r['pull_rows_per_s']:>10,.0f} rows/s {r['pull_MBps']:>7.1f} MB/s | "
        f"dense get {r['dense_MBps']:>7.1f} MB/s | pull / dense {r['pull_over_dense']:.2f} | "
        f"dense push {r['dense_push_MBps']:>7.1f} MB/s | push / dense {r['push_over_dense']:.2f}"
    )


async def measure_memory(client: ParameterClient, args: argparse.Namespace, rule: str) -> dict:
    """The node's bytes per row (info: row_bytes / rows) of a table its pushes made."""
    name, dim = f"memory-{rule}", args.memory_dim
    await client.create_table(name, dim, rule=sgd(0.01) if rule == "sgd" else adagrad(0.01))
    ids = ids_of("unique", args.memory_rows, seed=7)
    before = (await client.info()).counters
    for start in range(0, len(ids), 10_000):
        part = ids[start : start + 10_000]
        await client.push_row_gradients(name, part, np.zeros((len(part), dim), np.float32))
    after = (await client.info()).counters
    made = after["rows"] - before["rows"]
    per_row = (after["row_bytes"] - before["row_bytes"]) / made
    memory = {"rule": rule, "rows": made, "dim": dim, "bytes_per_row": per_row}
    memory["ratio"] = per_row / (dim * 4)
    print(
        f"memory ({rule}): {made} rows of dim {dim}: {per_row:.0f} bytes a row, "
        f"{memory['ratio']:.2f}x the values' {dim * 4} (with the rule's state, each row's "
        "version and time, and the index)"
    )
    return memory


def counts(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--rows", type=counts, default=[1000, 10_000, 100_000])
    p.add_argument("--dims", type=counts, default=[16, 64, 256])
    p.add_argument("--count", type=int, default=10, help="timed calls per figure")
    p.add_argument("--rule", choices=("adagrad", "sgd"), default="adagrad", help="the tables' rule")
    p.add_argument("--memory-rows", type=int, default=200_000)
    p.add_argument("--memory-dim", type=int, default=64)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    result = aioparamsync.run(run(args))  # (the client on uvloop, as users are told)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
