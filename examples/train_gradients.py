#!/usr/bin/env python3
"""Asynchronous SGD with server-side aggregation: workers push gradients, the nodes apply them.

Start a cluster (or a single node), then train on it::

    aioparamsync-node --port 9001 &
    aioparamsync-node --port 9002 --peers 127.0.0.1:9001 &
    aioparamsync-node --port 9003 --peers 127.0.0.1:9001 &
    python examples/train_gradients.py --nodes 127.0.0.1:9001,127.0.0.1:9002,127.0.0.1:9003
    python examples/train_gradients.py --nodes 127.0.0.1:9001,127.0.0.1:9002,127.0.0.1:9003 \\
        --encoding topk --ratio 0.05 --json topk.json
    kill %1 %2 %3                      # stop the nodes (SIGTERM: they stop gracefully)

With one node (``aioparamsync-node`` alone listens on 127.0.0.1:9090, the
default of ``--nodes``), every worker uses that node.

What it does:

1. **The data.** ``--samples`` x ``--features`` standard normal inputs, and
   labels drawn from a "true" logistic model (so the classes overlap a little:
   linearly separable-ish). Everything comes from ``--seed``, so the
   coordinator and every worker make the same data without sending it.
2. **The parameters.** The coordinator stores the model, a logistic
   regression (``<prefix>.weight`` of shape ``(features,)`` and
   ``<prefix>.bias`` of shape ``(1,)``), at zero, with the rule
   ``rules.sgd(lr)``: from then on, a node folds each gradient pushed to it
   into the weights itself (``w -= lr * g``), and replicates the result.
3. **The workers.** ``--workers`` processes (this script, run with
   ``--worker-rank``), worker ``r`` on node ``r % len(nodes)``, each with
   shard ``r`` of the data. Once every worker is ready, all start together;
   each then loops ``--steps`` times: pull the weights (``get_arrays``),
   compute the gradient of the mean logistic loss on a mini-batch of its
   shard (numpy), ``push_gradients`` (``--encoding``, ``--ratio``; lossy
   encodings keep an error-feedback residual; ``--encoding auto`` chooses at
   each push, and the report says what it chose). No worker waits for another.
4. **The report.** The coordinator waits until the nodes agree on the model,
   pulls it, and prints (and with ``--json`` writes) the full-data loss it
   reached, beside the loss of **single-process SGD** on the same data: the
   same mini-batches, lr and number of gradient steps, applied one after the
   other in this process (the workers' steps interleaved round robin), which
   is what asynchronous SGD approximates. Also: the best loss there is (the
   optimum, by Newton's method), the bytes the workers sent and received, how
   far the weights' version advanced (each gradient a node folds adds one
   version, so on one node it equals the gradients pushed; across nodes,
   concurrent pushes to different nodes that are not aggregated in one place
   overwrite each other and the version advances less), and the wall time.

Every wait is bounded: the workers by ``--steps`` and ``--time-limit``, each
call by a timeout, the start and the agreement by fixed limits. A worker
stops as soon as its coordinator goes away (its stdin closes), and the
coordinator kills (by PID) any of its workers still running when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# One BLAS thread: the products here are small, and idle BLAS threads spin on
# the CPUs that the nodes and the other workers need. Set before numpy loads.
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np  # noqa: E402

from aioparamsync import ParameterClient  # noqa: E402
from aioparamsync.client.addresses import parse_addresses  # noqa: E402
from aioparamsync.values import rules  # noqa: E402
from aioparamsync.values.arrays import from_parameter  # noqa: E402

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
# The encodings a push may use ("none": raw float32; "auto": chosen at each push
# from the link and the compute time the worker measures).
ENCODINGS = ("none", "fp16", "bf16", "int8", "topk", "zlib", "auto")
# The "true" model's weights have this norm: its logits have about this standard
# deviation, so most labels are clear and some are not (the optimum is ~0.29).
TRUE_SCALE = 4.0
TRUE_BIAS = 0.5
# Bounds of the waits (seconds): the nodes agreeing at the end, one call (a worker's
# start and exit: see workers.py).
SETTLE_TIMEOUT = 30.0
CALL_TIMEOUT = 15.0
# Newton's method for the optimum: at most this many iterations (it takes ~7
# here), stopping once no coordinate moves more than the tolerance; and the
# tiny L2 term that keeps its Hessian invertible.
NEWTON_STEPS = 30
NEWTON_TOLERANCE = 1e-9
NEWTON_RIDGE = 1e-6


# -- The problem ------------------------------------------------------------------------------


@dataclass
class Data:
    x: np.ndarray  # (samples, features) float32
    y: np.ndarray  # (samples,) float32, 0 or 1


def make_data(samples: int, features: int, seed: int) -> Data:
    """Inputs and labels from a true logistic model; the same for the same arguments."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features), dtype=np.float32)
    true_weight = rng.standard_normal(features) * (TRUE_SCALE / math.sqrt(features))
    p = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ true_weight + TRUE_BIAS)))
    y = (rng.random(samples) < p).astype(np.float32)
    return Data(x, y)


def shard(data: Data, rank: int, workers: int) -> Data:
    """Worker ``rank``'s contiguous share of the samples."""
    rows = np.array_split(np.arange(len(data.y)), workers)[rank]
    return Data(data.x[rows], data.y[rows])


def loss_of(weight: np.ndarray, bias: np.ndarray, data: Data) -> float:
    """The mean logistic loss (binary cross-entropy on the logits), in float64."""
    z = data.x.astype(np.float64) @ weight.astype(np.float64) + float(bias[0])
    return float(np.mean(np.logaddexp(0.0, z) - data.y * z))


def gradients(
    weight: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gradients of the mean logistic loss on (x, y), float32, as the workers push them."""
    z = x @ weight + bias[0]
    error = np.exp(-np.logaddexp(np.float32(0.0), -z)) - y  # sigmoid(z) - y, stably
    return (x.T @ error / np.float32(len(y))).astype(np.float32), np.array(
        [error.mean()], dtype=np.float32
    )


def batch_rng(seed: int, rank: int) -> np.random.Generator:
    """Worker ``rank``'s stream of mini-batches (the reference replays it)."""
    return np.random.default_rng([seed, rank, 1])


def reference_loss(
    data: Data, workers: int, steps_done: Sequence[int], batch: int, lr: float, seed: int
) -> float:
    """Single-process SGD on the same data: the workers' mini-batches, one step each in turn.

    Worker ``r`` took ``steps_done[r]`` steps; the same mini-batches are applied
    here sequentially, interleaved round robin, with the node's arithmetic
    (``rules.sgd``: ``w -= lr * g`` in float32).
    """
    shards = [shard(data, r, workers) for r in range(workers)]
    streams = [batch_rng(seed, r) for r in range(workers)]
    weight = np.zeros(data.x.shape[1], np.float32)
    bias = np.zeros(1, np.float32)
    for step in range(max(steps_done, default=0)):
        for r in range(workers):
            if step >= steps_done[r]:
                continue
            rows = streams[r].integers(0, len(shards[r].y), batch)
            g_weight, g_bias = gradients(weight, bias, shards[r].x[rows], shards[r].y[rows])
            weight -= np.float32(lr) * g_weight
            bias -= np.float32(lr) * g_bias
    return loss_of(weight, bias, data)


def optimum_loss(data: Data) -> float:
    """The smallest loss a logistic regression reaches on ``data`` (Newton's method)."""
    x = np.hstack([data.x.astype(np.float64), np.ones((len(data.y), 1))])
    theta = np.zeros(x.shape[1])
    for _ in range(NEWTON_STEPS):
        p = 1.0 / (1.0 + np.exp(-(x @ theta)))
        grad = x.T @ (p - data.y) / len(data.y) + NEWTON_RIDGE * theta
        hessian = (x.T * (p * (1 - p))) @ x / len(data.y) + NEWTON_RIDGE * np.eye(x.shape[1])
        step = np.linalg.solve(hessian, grad)
        theta -= step
        if float(np.max(np.abs(step))) < NEWTON_TOLERANCE:
            break
    return loss_of(theta[:-1], theta[-1:], data)


def names_of(prefix: str) -> tuple[str, str]:
    return f"{prefix}.weight", f"{prefix}.bias"


# -- A worker (a process of its own) ------------------------------------------------------


@dataclass
class WorkerReport:
    """What one worker did; it prints this as its last stdout line (JSON)."""

    rank: int
    node: str
    steps: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    stopped_by: str = "steps"  # or "time limit", "coordinator gone"
    chose: dict[str, int] = field(default_factory=dict)  # --encoding auto: choice -> pushes


async def train_worker(args: argparse.Namespace, mine: Data, node: str) -> WorkerReport:
    weight_name, bias_name = names_of(args.prefix)
    report = WorkerReport(rank=args.worker_rank, node=node)
    rng = batch_rng(args.seed, args.worker_rank)
    encoding = None if args.encoding == "none" else args.encoding
    gone = threading.Event()
    watch_stdin(gone)
    started = time.monotonic()
    deadline = started + args.time_limit
    async with ParameterClient(node, timeout=CALL_TIMEOUT) as client:
        for _ in range(args.steps):
            if gone.is_set():
                report.stopped_by = "coordinator gone"
                break
            if time.monotonic() >= deadline:
                report.stopped_by = "time limit"
                break
            weights = await client.get_arrays([weight_name, bias_name])
            rows = rng.integers(0, len(mine.y), args.batch)
            g_weight, g_bias = gradients(
                weights[weight_name], weights[bias_name], mine.x[rows], mine.y[rows]
            )
            await client.push_gradients(
                {weight_name: g_weight, bias_name: g_bias},
                encoding=encoding,
                ratio=args.ratio,
                error_feedback=True,
            )
            report.steps += 1
        report.seconds = time.monotonic() - started
        report.bytes_sent = client.traffic["bytes_sent"]
        report.bytes_received = client.traffic["bytes_received"]
        if encoding == "auto":
            report.chose = dict(client.stats()["auto"]["counts"])
    return report


def worker_main(args: argparse.Namespace) -> int:
    """Run as worker ``--worker-rank``: ready, wait for "go" on stdin, train, report."""
    # A Ctrl-C in the terminal reaches the whole process group: the coordinator
    # alone handles it, and stops its workers by closing their stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    nodes = [f"{h}:{p}" for h, p in parse_addresses(args.nodes)]
    node = nodes[args.worker_rank % len(nodes)]
    mine = shard(make_data(args.samples, args.features, args.seed), args.worker_rank, args.workers)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1  # the coordinator went away before the start
    try:
        report = asyncio.run(train_worker(args, mine, node))
    except Exception as exc:  # noqa: BLE001 - one line, the coordinator names the worker
        print(f"worker {args.worker_rank} ({node}): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(report)), flush=True)
    return 0


# -- The coordinator ----------------------------------------------------------------------------


@dataclass
class Result:
    """What a run reached; ``--json`` writes it."""

    nodes: list[str]
    workers: int
    encoding: str
    ratio: float
    steps: int
    batch: int
    lr: float
    samples: int
    features: int
    seed: int
    names: list[str]
    initial_loss: float = math.nan
    loss: float = math.nan  # reached: the weights the nodes agree on, on all the data
    reference_loss: float = math.nan  # single-process SGD, same batches, lr and steps
    optimum_loss: float = math.nan
    gradients_pushed: int = 0
    version_advance: int = 0  # of the weight: gradients a node folded (see the docstring)
    bytes_sent: int = 0  # by the workers, framing included
    bytes_received: int = 0
    wall_seconds: float = 0.0  # from "go" to the last worker's report
    nodes_agree: bool = False
    max_weight_difference: float = math.nan  # between the nodes' final weights
    worker_reports: list[dict[str, Any]] = field(default_factory=list)
    auto_chose: dict[str, int] = field(default_factory=dict)  # --encoding auto, all workers


async def wait_until_all_hold(nodes: Sequence[str], names: Sequence[str], version: int) -> None:
    """Wait until every node holds every name at ``version`` or newer (bounded)."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(ParameterClient(n, timeout=CALL_TIMEOUT)) for n in nodes
        ]
        async with asyncio.timeout(SETTLE_TIMEOUT):
            for client in clients:
                while True:
                    response = await client.get_parameters(names, min_version=version)
                    if len(response.params) == len(names):
                        break
                    await asyncio.sleep(0.02)


async def agreed_state(
    nodes: Sequence[str], names: Sequence[str]
) -> tuple[bool, dict[str, np.ndarray], int, float]:
    """Wait (bounded) until every node holds the same (version, origin) of each name.

    Answers whether they came to agree, the first node's arrays, the weight's
    version there, and the largest difference between the nodes' weights.
    """
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(ParameterClient(n, timeout=CALL_TIMEOUT)) for n in nodes
        ]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT
        while True:
            responses = [await c.get_parameters(names) for c in clients]
            held = [{p.name: (p.version, p.origin) for p in r.params} for r in responses]
            agree = all(h == held[0] for h in held) and len(held[0]) == len(names)
            if agree or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        arrays = [{p.name: from_parameter(p) for p in r.params} for r in responses]
        first = arrays[0]
        difference = max(
            float(np.max(np.abs(a[n] - first[n]))) if n in a and n in first else math.inf
            for a in arrays
            for n in names
        )
        version = held[0].get(names[0], (0, ""))[0]
        return agree, first, version, difference


async def coordinate(args: argparse.Namespace, argv: Sequence[str]) -> Result:
    nodes = [f"{h}:{p}" for h, p in parse_addresses(args.nodes)]
    names = list(names_of(args.prefix))
    weight_name, bias_name = names
    data = make_data(args.samples, args.features, args.seed)
    result = Result(
        nodes=nodes,
        workers=args.workers,
        encoding=args.encoding,
        ratio=args.ratio,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        samples=args.samples,
        features=args.features,
        seed=args.seed,
        names=names,
    )
    weight = np.zeros(args.features, np.float32)
    bias = np.zeros(1, np.float32)
    result.initial_loss = loss_of(weight, bias, data)
    async with ParameterClient(nodes, timeout=CALL_TIMEOUT) as client:
        versions = await client.update_arrays(
            {weight_name: weight, bias_name: bias}, rules=rules.sgd(args.lr)
        )
    created = versions[weight_name]
    # Workers on other nodes push there: each node must hold the model (and its rule) first.
    await wait_until_all_hold(nodes, names, min(versions.values()))

    reports, result.wall_seconds = await run_workers(
        SCRIPT, argv, args.workers, args.time_limit, WorkerReport
    )
    result.worker_reports = [asdict(r) for r in reports]
    result.gradients_pushed = sum(r.steps for r in reports)
    result.bytes_sent = sum(r.bytes_sent for r in reports)
    result.bytes_received = sum(r.bytes_received for r in reports)
    for r in reports:
        for choice, n in r.chose.items():
            result.auto_chose[choice] = result.auto_chose.get(choice, 0) + n

    agree, arrays, version, difference = await agreed_state(nodes, names)
    result.nodes_agree = agree
    result.max_weight_difference = difference
    result.version_advance = version - created
    result.loss = loss_of(arrays[weight_name], arrays[bias_name], data)
    steps_done = [r.steps for r in reports]
    result.reference_loss = reference_loss(
        data, args.workers, steps_done, args.batch, args.lr, args.seed
    )
    result.optimum_loss = optimum_loss(data)
    return result


def print_result(r: Result) -> None:
    ratio = f" (ratio {r.ratio})" if r.encoding == "topk" else ""
    print(
        f"{r.workers} workers x {r.steps} steps on {len(r.nodes)} node(s), "
        f"encoding {r.encoding}{ratio}, lr {r.lr}, batch {r.batch}"
    )
    print(
        f"loss: initial {r.initial_loss:.4f} -> reached {r.loss:.4f}; single-process SGD "
        f"{r.reference_loss:.4f} (reached / reference = {r.loss / r.reference_loss:.4f}); "
        f"optimum {r.optimum_loss:.4f}"
    )
    print(
        f"gradients: {r.gradients_pushed} pushed, the weight's version advanced {r.version_advance}"
    )
    per_push = r.bytes_sent / max(r.gradients_pushed, 1)
    print(
        f"traffic: workers sent {r.bytes_sent:,} bytes ({per_push:.0f} per step, pull "
        f"included), received {r.bytes_received:,}"
    )
    if r.auto_chose:
        chose = ", ".join(f"{c} x{n}" for c, n in sorted(r.auto_chose.items()))
        print(f"encoding auto chose: {chose}")
    steps_per_second = r.gradients_pushed / r.wall_seconds if r.wall_seconds else 0.0
    print(f"time: {r.wall_seconds:.2f} s of training, {steps_per_second:.0f} steps/s")
    agree = "agree" if r.nodes_agree else "do NOT agree"
    print(
        f"the {len(r.nodes)} node(s) {agree} on the model "
        f"(largest difference {r.max_weight_difference:.3g})"
    )


# -- The command ------------------------------------------------------------------------------


def unit_ratio(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be in (0, 1]")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Asynchronous SGD with server-side aggregation: worker processes push "
        "gradients to a running aioparamsync cluster, whose nodes apply them with the sgd "
        "rule; reports the loss reached beside single-process SGD.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    knob = parser.add_argument
    knob("--nodes", default="127.0.0.1:9090", help="the cluster's nodes, host:port,...")
    knob("--workers", type=positive_int, default=3, help="worker processes, round robin on nodes")
    knob("--steps", type=positive_int, default=300, help="gradient steps each worker takes")
    knob("--lr", type=positive_float, default=0.05, help="learning rate of the sgd rule")
    knob("--batch", type=positive_int, default=32, help="samples in each mini-batch")
    knob("--encoding", choices=ENCODINGS, default="none", help="how gradients are sent")
    knob("--ratio", type=unit_ratio, default=0.01, help="least share of elements topk sends")
    knob("--samples", type=positive_int, default=16384, help="samples in the data")
    knob("--features", type=positive_int, default=256, help="features of each sample")
    knob("--seed", type=int, default=0, help="seed of the data and the mini-batches")
    knob("--prefix", default="logreg", help="the parameters are PREFIX.weight and PREFIX.bias")
    knob("--time-limit", type=positive_float, default=120.0, help="seconds a worker trains at most")
    knob("--json", type=Path, metavar="OUT.json", help="also write the result as JSON here")
    knob("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)  # a worker process
    return parser


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The arguments a worker process gets (its rank is added per worker)."""
    return [
        "--nodes", args.nodes, "--workers", str(args.workers), "--steps", str(args.steps),
        "--lr", repr(args.lr), "--batch", str(args.batch), "--encoding", args.encoding,
        "--ratio", repr(args.ratio), "--samples", str(args.samples),
        "--features", str(args.features), "--seed", str(args.seed), "--prefix", args.prefix,
        "--time-limit", repr(args.time_limit),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_addresses(args.nodes)
    except ValueError as exc:
        parser.error(f"--nodes: {exc}")
    if args.worker_rank is not None:
        return worker_main(args)
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
