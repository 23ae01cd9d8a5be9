#!/usr/bin/env python3
"""A click-through-rate model on sparse embedding tables: worker processes pull and push rows.

Start a cluster (or a single node), then train on it::

    aioparamsync-node --port 9001 &
    aioparamsync-node --port 9002 --peers 127.0.0.1:9001 &
    python examples/train_ctr.py --nodes 127.0.0.1:9001,127.0.0.1:9002 --json ctr.json
    kill %1 %2                         # stop the nodes

With one node (``aioparamsync-node`` alone listens on 127.0.0.1:9090, the
default of ``--nodes``), everything lives on that node.

What it does:

1. **The data.** Each sample has ``--fields`` hashed categorical fields (6 by
   default, at most 8), each an id from a space of 10^6 to 10^9 ids, drawn
   Zipf-like (rank ``k`` with probability ~ ``k^-a``, ``a`` from 1.1 to 1.4 by
   field; the rank hashed to an id): a few ids are frequent, most are seen
   once or never, so a table only ever holds a tiny share of the id space.
   Every id has a hidden weight (a hash of the id, uniform, unit variance);
   the label is a click with probability ``sigmoid(bias + sum of the sample's
   hidden weights * 2 / sqrt(fields))``: a known signal, with Bernoulli noise.
   Nothing is stored: a worker draws fresh samples every step (an endless
   stream), and the held-out set is drawn from its own seed.
2. **The model.** One shared table ``<prefix>.ids`` of ``--dim`` wide rows
   (the ids of field ``f`` are ``f << 40 | id``, so the fields never collide),
   made with ``init="normal"``, the ``adagrad(--lr)`` rule and ``--buckets``
   buckets (8: plenty to spread over a few nodes, and a node's work for a
   push grows with the buckets it touches: measured in one process, a fold of
   ~1300 new rows takes ~3 ms in 8 buckets, ~12 ms in the default 64), read through
   :class:`aioparamsync.torch.Embedding`; the ``fields x dim`` embeddings are
   concatenated into a small MLP (``--hidden`` units). The dense MLP is shared
   through the nodes too: the coordinator stores it with
   ``push_state_dict(..., rule=adam(--dense-lr))``, so the node folds the
   workers' gradients into it by Adam (no local optimizer anywhere).
3. **The workers.** ``--workers`` processes (this script, with
   ``--worker-rank``), each with a client routed over all ``--nodes`` (a row
   goes to the node its bucket lives on, the MLP's tensors to theirs). Each
   step: pull the MLP (``load_into``) and the batch's rows (``emb.pull``, one
   call, each id once) together, a forward and ``backward()`` of the logistic
   loss, then push the MLP's gradients (``push_grads``) and the rows'
   (``emb.push``) together. No worker waits for another.
4. **The report.** The held-out AUC (computed with numpy) of the model the
   nodes hold, before training and after, beside the AUC of the hidden
   weights themselves (the best any model can do on that set); the rows the
   nodes hold; the wall time.

Measured (2 cores shared by 2 node processes, the 2 workers and the
coordinator; the defaults: 6 fields, dim 8, 2 workers x 400 steps of 256
samples): the held-out AUC goes from ~0.5 (0.49-0.54 over runs: the model
as created ranks at random) to 0.81 (0.806-0.816 over 6 runs and 5 seeds;
the hidden weights' own AUC is 0.86), in 7-16 s of training, 9-21 s in all
with the processes' start (the spread is the machine's other load). Each
node then holds ~170,000 rows, of an id space of ~2.2 * 10^9.
``tests/test_ctr_example.py`` checks that it reaches :data:`STATED_AUC` = 0.75.

Every wait is bounded: the workers by ``--steps`` and ``--time-limit``, each
call by a timeout, the start by a fixed limit. A worker stops as soon as its
coordinator goes away (its stdin closes), and the coordinator kills (by PID)
any of its workers still running when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# One thread per process for numpy and torch: the products are tiny, and idle
# threads spin on the CPUs the nodes and the other workers need.
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from aioparamsync import ParameterClient, adagrad, adam  # noqa: E402
from aioparamsync import torch as ps_torch  # noqa: E402
from aioparamsync.client.addresses import parse_addresses  # noqa: E402

# The coordinator's worker processes, shared with the other examples (this one's folder).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from workers import (  # noqa: E402
    positive_float,
    positive_int,
    run_workers,
    stoppable,
    watch_stdin,
)

# This script: a worker process runs it again, with --worker-rank.
SCRIPT = str(Path(__file__).resolve())
# The held-out AUC a run with the defaults reaches at least (see the docstring).
STATED_AUC = 0.75
# Each field's id space and Zipf exponent (the first --fields of them).
SPACES = (10**6, 10**7, 10**8, 10**9, 10**9, 10**6, 10**8, 10**7)
EXPONENTS = (1.3, 1.2, 1.15, 1.1, 1.25, 1.4, 1.2, 1.3)
# Field f's ids are f << FIELD_SHIFT | id (every space is below 2**FIELD_SHIFT).
FIELD_SHIFT = 40
# The label's logit: BIAS + SIGNAL / sqrt(fields) * the sum of the hidden weights.
BIAS = -1.0
SIGNAL = 2.0
# The initial rows: N(0, INIT_SCALE^2).
INIT_SCALE = 0.01
HELD_OUT = 20_000
# The bound of one call (seconds; a worker's start and exit: see workers.py).
CALL_TIMEOUT = 15.0


# -- The problem ------------------------------------------------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64s: a deterministic, well-spread hash."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class CTRData:
    """The synthetic click data: ``sample`` draws batches, the same for the same rng."""

    fields: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.fields <= len(SPACES):
            raise ValueError(f"fields is from 1 to {len(SPACES)}, not {self.fields}")

    def hidden_weight(self, ids: np.ndarray) -> np.ndarray:
        """The hidden weight of each (field-offset) id: uniform, unit variance."""
        h = _mix(ids.astype(np.uint64) ^ np.uint64(0x9E3779B97F4A7C15 * (self.seed + 1) % 2**64))
        unit = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53  # in [0, 1)
        return (unit * 2.0 - 1.0) * math.sqrt(3.0)

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``n`` samples: ids ``(n, fields)`` int64, labels ``(n,)`` float32, true logits."""
        ids = np.empty((n, self.fields), np.int64)
        for f in range(self.fields):
            rank = np.minimum(rng.zipf(EXPONENTS[f], n), SPACES[f]).astype(np.uint64)
            hashed = _mix(rank + np.uint64(f << 32) + np.uint64((self.seed << 48) % 2**64))
            ids[:, f] = (f << FIELD_SHIFT) | (hashed % np.uint64(SPACES[f])).astype(np.int64)
        logit = BIAS + SIGNAL / math.sqrt(self.fields) * self.hidden_weight(ids).sum(axis=1)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ids, labels, logit


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve (Mann-Whitney U; tied scores count a half)."""
    labels = np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="mergesort")
    ordered = np.asarray(scores)[order]
    _, first, counts = np.unique(ordered, return_index=True, return_counts=True)
    ranks = np.empty(len(ordered))
    ranks[order] = np.repeat(first + (counts + 1) / 2.0, counts)  # 1-based, ties averaged
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return math.nan
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / positives / negatives)


class CTRModel(torch.nn.Module):
    """The fields' rows (one shared table), concatenated, into an MLP: a click's logit."""

    def __init__(self, client: ParameterClient, table: str, fields: int, dim: int, hidden: int):
        super().__init__()
        self.emb = ps_torch.Embedding(client, table, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(fields * dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids).flatten(1)).squeeze(1)


def table_of(prefix: str) -> str:
    return f"{prefix}.ids"


def mlp_prefix(prefix: str) -> str:
    return f"{prefix}."


def batch_rng(seed: int, rank: int) -> np.random.Generator:
    return np.random.default_rng([seed, rank, 1])


def held_out(data: CTRData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return data.sample(np.random.default_rng([data.seed, 2**32 - 1]), HELD_OUT)


async def held_out_auc(
    model: CTRModel, prefix: str, ids: np.ndarray, labels: np.ndarray
) -> tuple[float, int]:
    """The AUC on (ids, labels) of the model the nodes hold; and the distinct ids pulled."""
    client = model.emb.client
    tensor = torch.from_numpy(ids)
    await asyncio.gather(
        ps_torch.load_into(client, model, prefix=mlp_prefix(prefix)), model.emb.pull(tensor)
    )
    with torch.no_grad():
        scores = model(tensor).numpy()
    pulled = model.emb.pulled_ids
    return auc(labels, scores), 0 if pulled is None else len(pulled)


# -- A worker (a process of its own) ------------------------------------------------------


@dataclass
class WorkerReport:
    """What one worker did; it prints this as its last stdout line (JSON)."""

    rank: int
    steps: int = 0
    samples: int = 0
    rows_pulled: int = 0  # distinct ids, summed over the steps
    last_loss: float = math.nan  # mean training loss of its last 50 steps
    seconds: float = 0.0
    stopped_by: str = "steps"  # or "time limit", "coordinator gone"


async def train_worker(args: argparse.Namespace, nodes: list[str]) -> WorkerReport:
    data = CTRData(args.fields, args.seed)
    rng = batch_rng(args.seed, args.worker_rank)
    report = WorkerReport(rank=args.worker_rank)
    prefix = mlp_prefix(args.prefix)
    gone = threading.Event()
    watch_stdin(gone)
    started = time.monotonic()
    deadline = started + args.time_limit
    losses: list[float] = []
    async with ParameterClient(nodes, timeout=CALL_TIMEOUT) as client:
        model = CTRModel(client, table_of(args.prefix), args.fields, args.dim, args.hidden)
        for _ in range(args.steps):
            if gone.is_set():
                report.stopped_by = "coordinator gone"
                break
            if time.monotonic() >= deadline:
                report.stopped_by = "time limit"
                break
            ids, labels, _ = data.sample(rng, args.batch)
            batch = torch.from_numpy(ids)
            _, rows = await asyncio.gather(
                ps_torch.load_into(client, model, prefix=prefix), model.emb.pull(batch)
            )
            model.zero_grad(set_to_none=True)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model(batch), torch.from_numpy(labels)
            )
            loss.backward()
            await asyncio.gather(
                ps_torch.push_grads(client, model, prefix=prefix), model.emb.push()
            )
            report.steps += 1
            report.samples += len(labels)
            report.rows_pulled += len(rows)
            losses.append(loss.item())
    report.seconds = time.monotonic() - started
    report.last_loss = float(np.mean(losses[-50:])) if losses else math.nan
    return report


def worker_main(args: argparse.Namespace) -> int:
    """Run as worker ``--worker-rank``: ready, wait for "go" on stdin, train, report."""
    # A Ctrl-C reaches the whole process group: the coordinator alone handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    nodes = [f"{h}:{p}" for h, p in parse_addresses(args.nodes)]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1  # the coordinator went away before the start
    try:
        report = asyncio.run(train_worker(args, nodes))
    except Exception as exc:  # noqa: BLE001 - one line, the coordinator names the worker
        print(f"worker {args.worker_rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(report)), flush=True)
    return 0


# -- The coordinator ----------------------------------------------------------------------------


@dataclass
class Result:
    """What a run reached; ``--json`` writes it."""

    nodes: list[str]
    prefix: str
    workers: int
    steps: int
    batch: int
    fields: int
    dim: int
    hidden: int
    lr: float
    dense_lr: float
    buckets: int
    seed: int
    initial_auc: float = math.nan  # held out, the model as created
    auc: float = math.nan  # held out, the model the nodes hold after training
    best_auc: float = math.nan  # held out, the hidden weights' own logits
    held_out_ids: int = 0  # distinct ids in the held-out set
    rows_held: dict[str, int] = field(default_factory=dict)  # node -> rows (all its tables)
    samples: int = 0  # trained on, all workers
    wall_seconds: float = 0.0  # from "go" to the last worker's report
    worker_reports: list[dict[str, Any]] = field(default_factory=list)


async def coordinate(args: argparse.Namespace, argv: Sequence[str]) -> Result:
    nodes = [f"{h}:{p}" for h, p in parse_addresses(args.nodes)]
    result = Result(
        nodes=nodes, prefix=args.prefix, workers=args.workers, steps=args.steps,
        batch=args.batch, fields=args.fields, dim=args.dim, hidden=args.hidden, lr=args.lr,
        dense_lr=args.dense_lr, buckets=args.buckets, seed=args.seed,
    )  # fmt: skip
    data = CTRData(args.fields, args.seed)
    ids, labels, logits = held_out(data)
    result.best_auc = auc(labels, logits)
    torch.manual_seed(args.seed)
    async with ParameterClient(nodes, timeout=CALL_TIMEOUT) as client:
        model = CTRModel(client, table_of(args.prefix), args.fields, args.dim, args.hidden)
        await client.create_table(
            table_of(args.prefix), args.dim, init="normal", scale=INIT_SCALE, seed=args.seed,
            rule=adagrad(args.lr), buckets=args.buckets,
        )  # fmt: skip
        await ps_torch.push_state_dict(
            client, model, prefix=mlp_prefix(args.prefix), rule=adam(args.dense_lr)
        )
        result.initial_auc, result.held_out_ids = await held_out_auc(
            model, args.prefix, ids, labels
        )
        print(f"held-out AUC at the start: {result.initial_auc:.4f}", flush=True)

        reports, result.wall_seconds = await run_workers(
            SCRIPT, argv, args.workers, args.time_limit, WorkerReport
        )
        result.worker_reports = [asdict(r) for r in reports]
        result.samples = sum(r.samples for r in reports)
        result.auc, _ = await held_out_auc(model, args.prefix, ids, labels)
    for node in nodes:
        async with ParameterClient(node, timeout=CALL_TIMEOUT, route=False) as one:
            result.rows_held[node] = int((await one.info()).counters.get("rows", 0))
    return result


def print_result(r: Result) -> None:
    print(
        f"{r.workers} workers x {r.steps} steps of {r.batch} samples on {len(r.nodes)} node(s); "
        f"{r.fields} fields, dim {r.dim}, table {table_of(r.prefix)!r}"
    )
    print(
        f"held-out AUC: {r.initial_auc:.4f} -> {r.auc:.4f} "
        f"(the hidden weights' own: {r.best_auc:.4f}; {HELD_OUT} samples, "
        f"{r.held_out_ids} distinct ids)"
    )
    held = ", ".join(f"{n} {rows:,}" for n, rows in r.rows_held.items())
    print(f"rows held by the nodes (all tables): {held}")
    rate = r.samples / r.wall_seconds if r.wall_seconds else 0.0
    print(f"time: {r.wall_seconds:.2f} s of training, {rate:,.0f} samples/s")


# -- The command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="A click-through-rate model on sparse embedding tables: worker processes "
        "pull and push a batch's rows (and share a small MLP) through a running aioparamsync "
        "cluster; prints the held-out AUC before and after.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    knob = parser.add_argument
    knob("--nodes", default="127.0.0.1:9090", help="the cluster's nodes, host:port,...")
    knob("--workers", type=positive_int, default=2, help="worker processes")
    knob("--steps", type=positive_int, default=400, help="steps each worker takes")
    knob("--batch", type=positive_int, default=256, help="samples in each step's batch")
    knob("--fields", type=positive_int, default=6, help=f"categorical fields (<= {len(SPACES)})")
    knob("--dim", type=positive_int, default=8, help="the embedding rows' width")
    knob("--hidden", type=positive_int, default=32, help="the MLP's hidden units")
    knob("--lr", type=positive_float, default=0.1, help="the table's adagrad learning rate")
    knob("--dense-lr", type=positive_float, default=0.003, help="the MLP's adam learning rate")
    knob("--buckets", type=positive_int, default=8, help="the table's buckets (see the docstring)")
    knob("--seed", type=int, default=0, help="seed of the data, the rows and the MLP")
    knob("--prefix", default=None, help="names of the table and the MLP (default: ctr-<random>)")
    knob("--time-limit", type=positive_float, default=120.0, help="seconds a worker trains at most")
    knob("--json", type=Path, metavar="OUT.json", help="also write the result as JSON here")
    knob("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)  # a worker process
    return parser


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The arguments a worker process gets (its rank is added per worker)."""
    return [
        "--nodes", args.nodes, "--workers", str(args.workers), "--steps", str(args.steps),
        "--batch", str(args.batch), "--fields", str(args.fields), "--dim", str(args.dim),
        "--hidden", str(args.hidden), "--seed", str(args.seed), "--prefix", args.prefix,
        "--time-limit", repr(args.time_limit),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_addresses(args.nodes)
        CTRData(args.fields, args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker_rank is not None:
        return worker_main(args)
    if args.prefix is None:  # a fresh table and MLP: a run again on the same nodes starts anew
        args.prefix = f"ctr-{uuid.uuid4().hex[:8]}"
    torch.set_num_threads(1)
    try:
        result = asyncio.run(stoppable(coordinate(args, worker_argv(args))))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: the workers were stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user, not a traceback
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print_result(result)
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
