#!/usr/bin/env python3
"""Asynchronous SGD on a local aioparamsync cluster: the whole job in one command.

    python examples/train_async_sgd.py                    # 3 nodes, 6 workers: 10-30 s
    python examples/train_async_sgd.py --mode overwrite   # workers write weights instead
    python examples/train_async_sgd.py --help             # the knobs

What it does, step by step:

1. **A cluster.** Starts ``--nodes`` nodes on 127.0.0.1, each a
   ``python -m aioparamsync --port 0`` subprocess, and learns each one's port
   from the line it prints once it listens. The first node is the seed that
   the others join; together they form a full mesh that replicates every
   update to every node.
2. **A problem.** A fixed random "true" linear model ``y = x @ W + b`` (plus a
   little noise) generates the data: one shard per worker, and a held-out set
   to measure the loss on. The model to train is a linear layer of the same
   shape, stored on the cluster as two parameters, ``linear.weight`` and
   ``linear.bias``, starting at zero.
3. **Workers.** ``--workers`` coroutines in this process, each with its own
   :class:`~aioparamsync.ParameterClient` pointed at a different node (the
   other nodes are its failover addresses). Each step, a worker pulls the
   weights (``get_arrays``) and computes the gradient of the loss on a
   mini-batch of its shard. No worker waits for another: asynchronous SGD.
   What it sends depends on ``--mode``:

   - ``gradients`` (the default): the gradient itself (``push_gradients``).
     The parameters were stored with the rule ``sgd(lr)``, so the cluster
     applies the step: each parameter's gradients are folded in at one node,
     whichever node they were pushed to, and every gradient counts (the
     weight's version grows by one for each).
   - ``overwrite``: the updated weights, computed by the worker
     (``update_arrays``). The node only stores them, so a write replaces
     whatever other workers wrote since this worker's pull: concurrent steps
     overwrite each other, and SGD converges all the same, in more steps.

   A step may start from weights a replica has not caught up on yet; SGD
   tolerates that too.
4. **The result.** Prints the loss before and after training, with the
   weights the cluster agrees on: on the workers' training data and on the
   held-out set (the one that says how well the model learned), the
   throughput, and stops every node it started, by PID, always: also on an
   error, Ctrl-C or SIGTERM.

Try ``kill <pid>`` on one node while it trains (the PIDs are printed): the
workers using it move to another node and carry on.

Progress (the running training loss) shows as a tqdm bar when tqdm is
installed (``pip install '.[examples]'`` in the checkout) and the output is a
terminal, else as a plain line every second, on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One BLAS thread: the matrix products here are small, and idle BLAS threads spin
# on the CPU that the nodes need (10x slower on 2 cores). Set before numpy loads.
for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np  # noqa: E402

from aioparamsync import ConnectionLostError, NetworkError, ParameterClient, sgd  # noqa: E402

# The parameters of the model, as the cluster stores them.
WEIGHT, BIAS = "linear.weight", "linear.bias"
NAMES = [WEIGHT, BIAS]

# What a worker sends each step (--mode): its gradient, folded in by the
# cluster, or the new weights it computed, which overwrite the stored ones.
GRADIENTS, OVERWRITE = "gradients", "overwrite"
MODES = {
    GRADIENTS: "push the gradient (push_gradients); the nodes fold every one in by the "
    "parameters' sgd rule, so no step is lost",
    OVERWRITE: "compute the new weights and write them (update_arrays); concurrent "
    "steps overwrite each other (last writer wins)",
}

# Training samples each worker holds, and held-out samples the loss is measured on.
SHARD_SAMPLES = 4096
TEST_SAMPLES = 4096
# Standard deviation of the noise in the targets: the loss cannot go below
# 0.5 * outputs * NOISE**2 (the "noise floor").
NOISE = 0.1

# What a node prints once it listens: "aioparamsync-node <id> listening on <host>:<port>".
LISTENING = re.compile(r"^aioparamsync-node (\S+) listening on (\S+):(\d+)$", re.MULTILINE)
# Bounds of every wait (seconds): a node's start (Python imports numpy and
# thriftpy2 first), the cluster forming or agreeing, a node's exit, one call.
START_TIMEOUT = 30.0
SETTLE_TIMEOUT = 30.0
EXIT_TIMEOUT = 10.0
CALL_TIMEOUT = 30.0


# -- 1. A local cluster, as subprocesses ---------------------------------------------------


@dataclass
class NodeProcess:
    """One node: its process and where it listens."""

    process: subprocess.Popen[bytes]
    log: Path  # its stdout and stderr
    node_id: str = ""
    address: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid


class LocalCluster:
    """``nodes`` aioparamsync nodes on 127.0.0.1, stopped (by PID) when the block ends.

    A context manager, so the nodes are stopped however the block ends: normally,
    on an error, or on Ctrl-C. Each node runs in a session of its own, so a Ctrl-C
    in the terminal reaches this script alone, and the script stops them in order.
    """

    def __init__(self, nodes: int) -> None:
        self.size = nodes
        self.nodes: list[NodeProcess] = []
        self._logs = tempfile.TemporaryDirectory(prefix="aioparamsync-example-")

    @property
    def addresses(self) -> list[str]:
        return [node.address for node in self.nodes]

    @property
    def pids(self) -> list[int]:
        return [node.pid for node in self.nodes]

    def __enter__(self) -> LocalCluster:
        try:
            seed = self._start(0)  # the first node, which the others join
            self._wait_listening(seed)
            others = [self._start(i, "--peers", seed.address) for i in range(1, self.size)]
            for node in others:
                self._wait_listening(node)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _start(self, index: int, *flags: str) -> NodeProcess:
        log = Path(self._logs.name) / f"node-{index}.log"
        with log.open("wb") as out:  # the child keeps its own copy of the file
            process = subprocess.Popen(
                [sys.executable, "-m", "aioparamsync", "--port", "0", "--node-id", f"node-{index}",
                 "--log-level", "warning", *flags],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        node = NodeProcess(process, log)
        self.nodes.append(node)  # from now on, stop() will stop it
        return node

    @staticmethod
    def _wait_listening(node: NodeProcess) -> None:
        """Wait for the node's listening line and learn its address from it."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            output = node.log.read_text(errors="replace")
            if match := LISTENING.search(output):
                node.node_id, host, port = match.groups()
                node.address = f"{host}:{port}"
                return
            if node.process.poll() is not None:
                raise RuntimeError(
                    f"node {node.pid} exited with {node.process.returncode}:\n{output.strip()}"
                )
            time.sleep(0.02)
        raise RuntimeError(f"node {node.pid} did not listen within {START_TIMEOUT} s")

    def stop(self) -> None:
        """SIGTERM every node still running, wait (bounded), SIGKILL what is left."""
        running = [node.process for node in self.nodes if node.process.poll() is None]
        for process in running:
            process.terminate()  # a node stops gracefully on SIGTERM
        deadline = time.monotonic() + EXIT_TIMEOUT
        try:
            for process in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:  # even if a second Ctrl-C cuts the wait short
            for process in running:
                if process.poll() is None:
                    process.kill()
                    process.wait()
            self._logs.cleanup()


# -- 2. The problem: data from a "true" linear model ---------------------------------------


@dataclass
class Problem:
    """Data that a true linear model generated: one shard per worker, and a test set."""

    shards: list[tuple[np.ndarray, np.ndarray]]  # (x, y) of each worker
    test: tuple[np.ndarray, np.ndarray]
    noise_floor: float  # the loss of the true model itself


def make_problem(dim: int, outputs: int, workers: int, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    # The true model: a random linear map that keeps each output's variance near 1.
    true_weight = rng.normal(0.0, 1.0 / np.sqrt(dim), (dim, outputs)).astype(np.float32)
    true_bias = rng.normal(0.0, 0.5, outputs).astype(np.float32)

    def samples(n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.standard_normal((n, dim), dtype=np.float32)
        noise = NOISE * rng.standard_normal((n, outputs), dtype=np.float32)
        return x, x @ true_weight + true_bias + noise

    return Problem(
        shards=[samples(SHARD_SAMPLES) for _ in range(workers)],
        test=samples(TEST_SAMPLES),
        noise_floor=0.5 * outputs * NOISE**2,
    )


def loss_and_gradients(
    weight: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """The loss, half the squared error summed over outputs and averaged over
    samples, and its gradients with respect to the weight and the bias."""
    error = x @ weight + bias - y
    loss = 0.5 * float(np.mean(np.sum(error * error, axis=1)))
    return loss, x.T @ error / len(x), error.mean(axis=0)


def loss_of(weights: dict[str, np.ndarray], data: tuple[np.ndarray, np.ndarray]) -> float:
    return loss_and_gradients(weights[WEIGHT], weights[BIAS], *data)[0]


# -- 3. Training: asynchronous workers ------------------------------------------------------


class Progress:
    """Steps done and the running training loss (of the mini-batches): tqdm's bar on
    a terminal if tqdm is installed, else a plain line every second (both on stderr)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.loss = float("nan")  # an exponential moving average of the mini-batch losses
        self.started = self._last_line = time.monotonic()
        self._bar: Any = None
        if sys.stderr.isatty():
            with contextlib.suppress(ImportError):
                from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

                self._bar = tqdm(total=total, unit="step", desc="training", leave=True)

    def step(self, loss: float | None) -> None:
        """One more step done, with its mini-batch's loss (None: a lost step)."""
        self.done += 1
        if loss is not None:
            self.loss = loss if math.isnan(self.loss) else 0.95 * self.loss + 0.05 * loss
        if self._bar is not None:
            self._bar.set_postfix_str(f"train loss {self.loss:.4f}", refresh=False)
            self._bar.update(1)
        elif time.monotonic() - self._last_line >= 1.0 or self.done == self.total:
            self._last_line = time.monotonic()
            rate = self.done / (self._last_line - self.started)
            print(
                f"  step {self.done:>6}/{self.total}  train loss {self.loss:9.4f}  "
                f"{rate:7.0f} steps/s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class Traffic:
    """What the workers did: steps, bytes pulled and pushed, and steps lost."""

    steps: int = 0
    bytes: int = 0
    lost_steps: int = 0


async def sgd_step(
    client: ParameterClient,
    x: np.ndarray,
    y: np.ndarray,
    rng: np.random.Generator,
    batch: int,
    lr: float,
    mode: str,
    rule_lr: float,
) -> tuple[float, int]:
    """Pull the weights, compute the gradient on a mini-batch, and push: the gradient
    (``mode`` GRADIENTS; the nodes step by the rule ``sgd(rule_lr)``) or the updated
    weights (OVERWRITE). Either way, a step of learning rate ``lr``.

    Answers the mini-batch's loss and the bytes pulled and pushed.
    """
    weights = await client.get_arrays(NAMES)  # read-only views of the bytes received
    rows = rng.integers(0, len(x), batch)
    loss, grad_weight, grad_bias = loss_and_gradients(
        weights[WEIGHT], weights[BIAS], x[rows], y[rows]
    )
    if mode == GRADIENTS:
        # The node steps by w -= rule_lr * g: a gradient scaled by lr / rule_lr
        # makes the step of this learning rate (which decays; the rule's is fixed).
        scale = np.float32(lr / rule_lr)
        pushed = {WEIGHT: scale * grad_weight, BIAS: scale * grad_bias}
        await client.push_gradients(pushed)  # both folded in, together
    else:
        pushed = {
            WEIGHT: weights[WEIGHT] - lr * grad_weight,
            BIAS: weights[BIAS] - lr * grad_bias,
        }
        await client.update_arrays(pushed)  # both parameters, atomically
    return loss, sum(array.nbytes for array in [*weights.values(), *pushed.values()])


async def worker(
    rank: int,
    addresses: Sequence[str],
    shard: tuple[np.ndarray, np.ndarray],
    args: argparse.Namespace,
    progress: Progress,
    traffic: Traffic,
) -> None:
    """Take ``--steps`` SGD steps on the cluster, with mini-batches of ``shard``."""
    # Worker `rank` uses node `rank % nodes`; the other nodes are its failover addresses.
    mine = rank % len(addresses)
    failover = [a for i, a in enumerate(addresses) if i != mine]
    rng = np.random.default_rng([args.seed, rank])  # its own stream of mini-batches
    x, y = shard
    async with ParameterClient([addresses[mine], *failover], timeout=CALL_TIMEOUT) as client:
        for step in range(args.steps):
            # The learning rate decays linearly to 0: big steps first, then small
            # ones that average out the noise of the mini-batches.
            lr = args.lr * (1 - step / args.steps)
            try:
                loss, nbytes = await sgd_step(
                    client, x, y, rng, args.batch, lr, args.mode, rule_lr=args.lr
                )
            except ConnectionLostError:
                # The node went away during the step (its push may or may not have
                # landed). To SGD that is one lost step; the next call moves to
                # another node.
                traffic.lost_steps += 1
                progress.step(None)
                continue
            traffic.steps += 1
            traffic.bytes += nbytes
            progress.step(loss)


async def wait_for_mesh(addresses: Sequence[str]) -> None:
    """Wait until every node has a link, up, to each of the others, and sees each
    member up (a node that joins holds and serves its share only once it is up)."""

    async def meshed(client: ParameterClient) -> bool:
        info = await client.info()
        if sum(peer.state == "up" for peer in info.peers or []) != len(addresses) - 1:
            return False
        topology = await client.topology()
        states = [member.state for member in topology.members or []]
        return states == ["up"] * len(addresses)

    await until_all(addresses, meshed, "form a full mesh")


async def wait_for_agreement(addresses: Sequence[str], min_version: int = 0) -> int:
    """Wait until every node holds the same version of each parameter (at least
    ``min_version``); answer the weight's version."""
    held: dict[str, dict[str, tuple[int, str]]] = {}  # address -> name -> (version, origin)

    async def holds(client: ParameterClient) -> bool:
        # A node leaves out of its reply the parameters older than min_version.
        response = await client.get_parameters(NAMES, min_version=min_version)
        held[f"{client.host}:{client.port}"] = {
            p.name: (p.version, p.origin) for p in response.params
        }
        return len(response.params) == len(NAMES)

    async def agree(client: ParameterClient) -> bool:
        return await holds(client) and len({tuple(sorted(h.items())) for h in held.values()}) == 1

    await until_all(addresses, holds, "hold the model")
    await until_all(addresses, agree, "agree on the model")
    return next(iter(held.values()))[WEIGHT][0]


async def until_all(
    addresses: Sequence[str],
    check: Callable[[ParameterClient], Coroutine[Any, Any, bool]],
    what: str,
) -> None:
    """Poll ``check`` on each node until it holds on all of them at once (bounded)."""
    clients = [ParameterClient(address, timeout=CALL_TIMEOUT) for address in addresses]
    try:
        async with asyncio.timeout(SETTLE_TIMEOUT):
            while True:
                if all([await check(client) for client in clients]):
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise RuntimeError(f"the nodes did not {what} within {SETTLE_TIMEOUT} s") from None
    finally:
        for client in clients:
            await client.close()


@dataclass
class Result:
    # The loss of the initial and of the final weights, on the workers' training
    # data (all the shards) and on the held-out set.
    initial_train_loss: float
    final_train_loss: float
    initial_loss: float
    final_loss: float
    nodes_agreeing: int  # the nodes still up at the end
    initial_version: int  # of the weight, once stored at zero
    version: int  # of the weight, which they agree on at the end
    seconds: float
    traffic: Traffic


async def train(addresses: Sequence[str], problem: Problem, args: argparse.Namespace) -> Result:
    await wait_for_mesh(addresses)

    # Initial weights, on the first node; the others receive them by replication.
    initial = {
        WEIGHT: np.zeros((args.dim, args.outputs), np.float32),
        BIAS: np.zeros(args.outputs, np.float32),
    }
    # In GRADIENTS mode, with the rule the nodes fold the gradients in by.
    rules = sgd(args.lr) if args.mode == GRADIENTS else None
    async with ParameterClient(addresses[0], timeout=CALL_TIMEOUT) as client:
        versions = await client.update_arrays(initial, rules=rules)
    await wait_for_agreement(addresses, min_version=versions[WEIGHT])
    print(f"the cluster is ready: {len(addresses)} nodes in a full mesh; training", flush=True)

    progress = Progress(args.workers * args.steps)
    traffic = Traffic()
    started = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as workers:
            for rank in range(args.workers):
                shard = problem.shards[rank]
                workers.create_task(worker(rank, addresses, shard, args, progress, traffic))
    finally:
        progress.close()
    seconds = time.perf_counter() - started

    # Replication is asynchronous: wait for the nodes (those still up) to agree,
    # then read the result from one of them.
    up = await nodes_up(addresses)
    version = await wait_for_agreement(up)
    async with ParameterClient(up[0], timeout=CALL_TIMEOUT) as client:
        final = await client.get_arrays(NAMES)

    def train_loss(weights: dict[str, np.ndarray]) -> float:
        # The shards have one size: the mean of their losses is the loss on them all.
        return float(np.mean([loss_of(weights, shard) for shard in problem.shards]))

    return Result(
        initial_train_loss=train_loss(initial),
        final_train_loss=train_loss(final),
        initial_loss=loss_of(initial, problem.test),
        final_loss=loss_of(final, problem.test),
        nodes_agreeing=len(up),
        initial_version=versions[WEIGHT],
        version=version,
        seconds=seconds,
        traffic=traffic,
    )


async def nodes_up(addresses: Sequence[str]) -> list[str]:
    """The addresses of the nodes that answer a ping (a node may have been killed)."""

    async def answers(address: str) -> bool:
        async with ParameterClient(address, timeout=CALL_TIMEOUT) as client:
            try:
                await client.ping()
            except NetworkError:
                return False
            return True

    answered = await asyncio.gather(*map(answers, addresses))
    up = [address for address, ok in zip(addresses, answered, strict=True) if ok]
    if not up:
        raise RuntimeError("no node is up any more")
    return up


# -- 4. The command --------------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a linear model with asynchronous SGD on a local aioparamsync "
        "cluster: start the nodes, run the workers, report, stop the nodes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    knob = parser.add_argument
    knob("--nodes", type=positive_int, default=3, help="nodes in the cluster (subprocesses)")
    knob("--workers", type=positive_int, default=6, help="async workers, spread over the nodes")
    knob("--steps", type=positive_int, default=1000, help="SGD steps each worker takes")
    knob("--dim", type=positive_int, default=1024, help="input features of the model")
    knob("--outputs", type=positive_int, default=16, help="outputs of the model")
    knob("--batch", type=positive_int, default=64, help="samples in each mini-batch")
    knob(
        "--lr",
        type=positive_float,
        default=0.05,
        help="learning rate at the start (it decays linearly to 0)",
    )
    knob("--seed", type=int, default=0, help="seed of the data and of the mini-batches")
    knob(
        "--mode",
        choices=list(MODES),
        default=GRADIENTS,
        help="what a worker sends each step: "
        + "; ".join(f"{mode}: {what}" for mode, what in MODES.items()),
    )
    return parser.parse_args(argv)


# Signals that stop the job: the nodes are stopped on the way out. SIGINT (Ctrl-C) is
# handled here too, not left to Python's default: a job started in the background by a
# script (``cmd &``) inherits SIGINT ignored, and Python keeps it so; the nodes handle it
# themselves as well.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(coroutine: Coroutine[Any, Any, Result]) -> Result:
    """Run on uvloop when it is installed, else on asyncio's own loop.

    While it runs, a stop signal (Ctrl-C included) cancels it, as asyncio does on
    Ctrl-C (an exception raised in the middle of the loop's own code could be lost).
    """

    async def cancellable() -> Result:
        task = asyncio.current_task()
        assert task is not None
        for sig in STOP_SIGNALS:
            asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
        return await coroutine

    try:
        import uvloop
    except ImportError:
        return asyncio.run(cancellable())
    else:
        return uvloop.run(cancellable())
    finally:
        for sig in STOP_SIGNALS:  # the loop is gone: back to raising KeyboardInterrupt
            signal.signal(sig, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # The client logs when it moves to another node: show it, attributed.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)

    size = args.dim * args.outputs + args.outputs
    print(
        f"model: linear {args.dim} -> {args.outputs} ({size:,} float32 parameters, "
        f"{4 * size / 1024:.0f} KiB); {args.workers} workers x {args.steps} steps, "
        f"batch {args.batch}, lr {args.lr}"
    )
    print(f"mode: {args.mode}: {MODES[args.mode]}")
    try:
        problem = make_problem(args.dim, args.outputs, args.workers, args.seed)
        print(f"starting {args.nodes} nodes ...", flush=True)
        with LocalCluster(args.nodes) as cluster:
            for node in cluster.nodes:
                print(f"  {node.node_id} on {node.address}, pid {node.pid}")
            print("node pids:", *cluster.pids, flush=True)
            result = run(train(cluster.addresses, problem, args))
            report(result, problem, args)
        print(f"stopped {args.nodes} nodes")
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: every node was stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback, for the user
        print(f"error: {describe(exc)}; every node was stopped", file=sys.stderr)
        return 1
    return 0


def report(result: Result, problem: Problem, args: argparse.Namespace) -> None:
    t = result.traffic
    down = args.nodes - result.nodes_agreeing
    which = f"{result.nodes_agreeing} nodes still up" if down else f"{args.nodes} nodes"
    went = f"; {down} went down" if down else ""
    print(f"the {which} agree on the model (version {result.version}){went}")
    advanced = result.version - result.initial_version
    cut = f", and {t.lost_steps} cut off by a lost connection" if t.lost_steps else ""
    if args.mode == GRADIENTS:
        # Each gradient folded in adds one to the version.
        print(f"gradients folded in: {advanced} of {t.steps} pushed{cut}")
    else:
        print(
            f"weights written: {t.steps}{cut}; the version advanced by {advanced} "
            "(concurrent writes overwrite each other)"
        )
    print(
        f"training loss: initial {result.initial_train_loss:.4f} -> "
        f"final {result.final_train_loss:.4f} (the workers' shards)"
    )
    print(
        f"held-out loss: initial {result.initial_loss:.4f} -> final {result.final_loss:.4f} "
        f"(noise floor {problem.noise_floor:.4f})"
    )
    lost = f" ({t.lost_steps} steps lost)" if t.lost_steps else ""
    print(
        f"throughput: {t.steps} steps in {result.seconds:.2f} s = "
        f"{t.steps / result.seconds:.0f} steps/s, "
        f"{t.bytes / result.seconds / 1e6:.1f} MB/s pulled and pushed{lost}",
        flush=True,
    )


def describe(exc: BaseException) -> str:
    """One line for an error, the first of a group (the workers run in a TaskGroup)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    sys.exit(main())
