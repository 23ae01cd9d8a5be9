#!/usr/bin/env python3
"""The training step users run, timed on aioparamsync and on what they would pick instead.

One command runs the same loop on five systems, side by side, on loopback::

    python benchmarks/bench_peers.py [--systems aioparamsync,redis,torch-rpc,ray,grpc]
                                     [--workloads A,B,C,D] [--workers 2] [--reps 3]
                                     [--seconds 3] [--transport tcp|unix|shm]
                                     [--client-loop uvloop|asyncio] [--json out.json]

One server and ``--workers`` worker processes (N, default 2), all on 127.0.0.1, every
system doing the same loop. A step is: pull every tensor of the workload, make a
gradient for each, push them; the fold (``w -= lr * g``, or ``w += g``) is done on the
server wherever the system can do it.

Systems:

* ``aioparamsync``: ``python -m aioparamsync --host 127.0.0.1 --port 0`` (plus
  ``--node-args``, e.g. ``--partition-bytes 0``), one subprocess. Each worker is a process
  with one public ``ParameterClient`` on uvloop (``--client-loop asyncio``: asyncio's own
  loop). Worker 0 creates the tensors once with ``update_arrays({...}, rules=sgd(lr))``
  (``sum_rule()`` for C); a step is ``await client.get_arrays(names)`` then
  ``await client.push_gradients({name: grad})``. The node folds each push (it makes a
  new array per fold: a read never sees half a fold). ``--transport tcp``: clients made
  with ``shared_memory=0``, pinned to TCP; ``unix``: the node's ``--unix-socket``, clients
  made with ``shared_memory=0``; ``shm``: clients as by default, given the node's TCP
  address: they move to the node's own Unix socket (``aioparamsync.client.local``) and
  tensors go through memory shared with the node (``aioparamsync.client.shared``).
* ``redis``: ``redis-server --save "" --appendonly no`` on a free loopback port, redis-py's
  ``redis.asyncio`` (one client per worker, on the same loop as above). A step is one MGET
  of every key (bytes -> ``numpy.frombuffer``), the SGD step done by the worker itself
  (``w - lr * g``, a new array) and one MSET of them all (each value passed as a
  memoryview). Redis has no server-side fold: that is how it is used, so concurrent
  workers overwrite each other's steps (C counts them).
* ``torch-rpc``: ``torch.distributed.rpc`` on TensorPipe, one process per rank: rank 0
  ("ps") holds a parameter-server object behind an ``RRef`` (``rpc.RRef(ps)``), ranks
  1..N are the workers, started by rank 0 with ``rpc_async(worker, command, (ps_rref,
  ...))`` as in PyTorch's parameter-server tutorials. A step is
  ``rpc.rpc_sync(ps_rref.owner(), get_weights, args=(ps_rref,))`` then
  ``rpc.rpc_sync(ps_rref.owner(), apply_gradients, args=(ps_rref, grads))``; the PS folds
  in place (``add_``) under a ``threading.Lock``. ``get_weights`` answers the PS's own
  tensors, as the tutorials do (no copy: TensorPipe sends them after the lock is released,
  so a read may overlap a fold; that favours torch-rpc). ``--transport tcp`` pins
  TensorPipe to TCP (``_transports=["uv"], _channels=["basic"]``); ``unix`` and ``shm``
  leave its defaults (shared memory on one host; it has no Unix-socket transport).
  ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``TP_SOCKET_IFNAME=lo``.
* ``ray``: a local Ray instance (``ray.init(address="local", num_cpus=2,
  include_dashboard=False, object_store_memory=--ray-object-store)``, every process on
  127.0.0.1) in a subprocess of its own, as in Ray's parameter-server example: one actor
  holds the weights (numpy, folded in place; an actor runs one call at a time), N worker
  actors; a step is ``ray.get(ps.get_weights.remote())`` then
  ``ray.get(ps.apply_gradients.remote(grads))``. ``--transport`` does not apply (Ray's own:
  gRPC for calls, its shared-memory object store for large values).
* ``grpc``: a ``grpc.aio`` server (this script, ``--serve-grpc``, on uvloop) with generic
  handlers and raw bytes (no protoc): ``Init`` stores a workload's tensors, ``Get``
  answers all of them in one message, ``Push`` takes every gradient in one message and
  folds it on the server (numpy, in place). One channel per worker (same loop as above);
  the worker joins its gradients into one ``bytes`` each step (gRPC's Python API takes
  bytes).

Workloads (``--workloads``):

* A: 8 tensors of 8 MiB float32 (64 MiB a pull, 64 MiB a push); steps/s.
* B: 200 tensors of 4 KiB float32; steps/s.
  A and B: every worker makes its gradients once (1e-3 everywhere, one array per tensor)
  and pushes them every step. After ``warm-up`` untimed steps per worker, all workers start
  together (a start time sent ahead) and step until ``--seconds`` or ``--max-steps``
  (steps in flight at the deadline complete and count). steps/s = all workers' steps over
  the span from the first start to the last end.
* C: one tensor of 16 float32 (zeros, rule ``sum``); each worker pushes ones
  ``--c-pushes`` times (a step is one push: Redis's is GET-add-SET through MGET/MSET).
  Lost updates = the pushes the workers completed - the final value (read once all
  ended; the tensor must be uniform).
* D: a torch MLP (16 -> 64 -> 64 -> 1, tanh) on a fixed synthetic regression set
  (``--d-samples`` x 16, seeded; the targets from a seeded random teacher net plus
  noise), trained by the N asynchronous workers, ``--d-steps`` each: pull the weights,
  load them into the worker's copy of the model, one minibatch of 64 (each worker its own
  seeded sampler), backward, push the ``.grad``s; the server folds SGD (lr 0.05; Redis:
  the worker, as above). Reported: the wall time (first start to last end) and the MSE
  on the whole set, evaluated once at the end with the final weights (and at the start,
  the same for every system). torch runs 1 thread per worker process.

Every system runs all workloads in one session (its server, its workers), the
workloads in order; each rep starts fresh processes, and the systems' order rotates
every rep. Medians over ``--reps``. Every loop stops after a count or at a deadline
(C and D: ``--guard`` seconds, a guard, not a measure), every wait has a timeout, and
every process this script starts is stopped by its PID in a ``finally`` (SIGTERM, then
SIGKILL): the nodes, redis-server, the gRPC server, the workers, the torch ranks and the
Ray subprocess (which shuts Ray down in its own ``finally``). glibc's malloc is left at
its defaults everywhere.

Printed (and in ``--json``, with every rep, the specs and the machine: CPUs, Python, every
package's version, the commit, and a note if the checkout changed during the run): the
medians, a column per system; the ratios aioparamsync / peer (A, B: steps/s; C: the lost
counts side by side; D: time and final loss); and the cores each side kept busy over the
measured phase (the server's process, Ray's server actor or torch's rank 0, from
/proc/PID/stat or process_time; the workers' process_time summed), read from the workers'
start to their last answer.

A system whose package or binary is missing is skipped, with the reason, in the table
and the JSON. ``--smoke``: tiny sizes, 1 rep, short deadlines (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_node import REPO, git_state, load_average

THIS = Path(__file__).resolve()
HOST = "127.0.0.1"
SYSTEMS = ("aioparamsync", "redis", "torch-rpc", "ray", "grpc")
WORKLOADS = ("A", "B", "C", "D")
TRANSPORTS = ("tcp", "unix", "shm")
#: the start of every line a child process answers the driver with (the rest is JSON)
MARK = "@bench-peers "

START_TIMEOUT = 90.0  # a server, a worker, Ray or a torch rank ready
STOP_TIMEOUT = 10.0  # SIGTERM to SIGKILL
EXIT_GRACE = 60.0  # a child that is ending by itself (Ray shutting down, torch ranks)
CALL_GUARD = 120.0  # added to every wait for an answer: a guard, not a measure
START_DELAY = 0.25  # the start time sent to the workers is this far ahead
MAX_COMMANDS = 10_000  # a worker's command loop

GRPC_SERVICE = "peers.Params"
GRPC_MAX_MESSAGE = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
]
ACK = b"\x01"

KiB = 1024
MiB = 1024 * 1024
DENSE_GRAD = 1e-3  # A and B's gradient, everywhere
LR_DENSE = 0.01
LR_MLP = 0.05

# The sizes of a full run and of --smoke (the command line overrides the counts).
FULL = {
    "a_tensors": 8,
    "a_bytes": 8 * MiB,
    "b_tensors": 200,
    "b_bytes": 4 * KiB,
    "c_elements": 16,
    "c_pushes": 200,
    "d_steps": 300,
    "d_samples": 4096,
    "warmup": 2,
    "seconds": 3.0,
    "reps": 3,
    "guard": 300.0,
}
SMOKE = {
    "a_tensors": 8,
    "a_bytes": 64 * KiB,
    "b_tensors": 20,
    "b_bytes": 4 * KiB,
    "c_elements": 16,
    "c_pushes": 20,
    "d_steps": 20,
    "d_samples": 512,
    "warmup": 1,
    "seconds": 0.3,
    "reps": 1,
    "guard": 60.0,
}
D_FEATURES = 16
D_HIDDEN = 64
D_TEACHER = 32
D_BATCH = 64


# ---------------------------------------------------------------------------
# What every worker does, whatever the system: the workload's tensors and gradients


def _flat(a: Any) -> memoryview:
    """The bytes of a C-contiguous array, without a copy."""
    return memoryview(np.ascontiguousarray(a)).cast("B")


def fold_numpy(w: np.ndarray, g: np.ndarray, rule: str, lr: float) -> None:
    """``w += g`` or ``w -= lr * g``, in place (the gRPC server and the Ray actor)."""
    if rule == "sum":
        w += g
    else:
        w -= np.float32(lr) * g


def _mlp(torch: Any, seed: int) -> Any:
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(D_FEATURES, D_HIDDEN),
        nn.Tanh(),
        nn.Linear(D_HIDDEN, D_HIDDEN),
        nn.Tanh(),
        nn.Linear(D_HIDDEN, 1),
    )


def _dataset(torch: Any, samples: int, seed: int) -> tuple[Any, Any]:
    """A fixed regression set: a random teacher net's outputs plus noise, seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, D_FEATURES, generator=g)
    w1 = torch.randn(D_FEATURES, D_TEACHER, generator=g) / math.sqrt(D_FEATURES)
    w2 = torch.randn(D_TEACHER, 1, generator=g) / math.sqrt(D_TEACHER)
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(samples, 1, generator=g)
    return x, y


class Task:
    """One workload as one worker sees it: names, shapes, first values, gradients."""

    def __init__(self, spec: dict[str, Any], index: int) -> None:
        self.spec = spec
        self.kind: str = spec["kind"]  # dense (A, B), count (C), mlp (D)
        self.rule: str = spec["rule"]
        self.lr: float = spec["lr"]
        self.group: str = spec["workload"]
        self.pulls = self.kind != "count"
        if self.kind == "mlp":
            import torch

            # Loading weights from a read-only buffer (a received message) is fine here:
            # they are copied into the model's own tensors.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            torch.set_num_threads(1)
            self.torch = torch
            self.model = _mlp(torch, spec["seed"])
            named = list(self.model.named_parameters())
            self.names = [f"{self.group}/{k}" for k, _ in named]
            self.params = [p for _, p in named]
            self.shapes = [tuple(p.shape) for p in self.params]
            self.x, self.y = _dataset(torch, spec["samples"], spec["seed"] + 100)
            self.sampler = torch.Generator().manual_seed(1000 + index)
            self.grads: dict[str, np.ndarray] = {}
        else:
            n = spec["elements"]
            self.names = [f"{self.group}/{i}" for i in range(spec["tensors"])]
            self.shapes = [(n,)] * len(self.names)
            value = 1.0 if self.kind == "count" else DENSE_GRAD
            self.grads = {name: np.full(n, value, np.float32) for name in self.names}
        self.head = bytes([len(self.group)]) + self.group.encode()  # gRPC's Push header

    def initial(self) -> dict[str, np.ndarray]:
        """The first values (the same wherever they are made: seeded)."""
        if self.kind == "mlp":
            return {
                n: p.detach().numpy().copy() for n, p in zip(self.names, self.params, strict=True)
            }
        if self.kind == "count":
            return {
                n: np.zeros(s, np.float32) for n, s in zip(self.names, self.shapes, strict=True)
            }
        rng = np.random.default_rng(self.spec["seed"])
        pairs = zip(self.names, self.shapes, strict=True)
        return {n: rng.standard_normal(s, dtype=np.float32) for n, s in pairs}

    def _load(self, weights: dict[str, Any]) -> None:
        torch = self.torch
        with torch.no_grad():
            for name, p in zip(self.names, self.params, strict=True):
                p.copy_(torch.from_numpy(np.asarray(weights[name])).view(p.shape))

    def gradients(self, weights: dict[str, Any] | None) -> dict[str, np.ndarray]:
        """This step's gradient of every tensor (D: a minibatch's, at ``weights``)."""
        if self.kind != "mlp":
            return self.grads
        assert weights is not None
        torch = self.torch
        self._load(weights)
        idx = torch.randint(len(self.x), (D_BATCH,), generator=self.sampler)
        self.model.zero_grad(set_to_none=True)  # new .grad tensors: safe to send as they are
        torch.nn.functional.mse_loss(self.model(self.x[idx]), self.y[idx]).backward()
        return {n: p.grad.numpy() for n, p in zip(self.names, self.params, strict=True)}

    def warm(self) -> None:
        """D: one forward and backward, not pushed (torch's first call is slow)."""
        if self.kind == "mlp":
            self.gradients(self.initial())
            self.model.zero_grad(set_to_none=True)

    def apply_local(
        self, weights: dict[str, np.ndarray], grads: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The new values, computed by the worker (Redis: no fold on the server)."""
        if self.rule == "sum":
            return {n: weights[n] + grads[n] for n in self.names}
        lr = np.float32(self.lr)
        return {n: weights[n] - lr * grads[n] for n in self.names}

    def split(self, data: Any) -> dict[str, np.ndarray]:
        """Every tensor's view into one buffer holding them all, in order (no copy)."""
        out = {}
        offset = 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            count = math.prod(shape)
            out[name] = np.frombuffer(data, np.float32, count, offset).reshape(shape)
            offset += 4 * count
        if offset != len(data):
            raise RuntimeError(f"{self.group}: {len(data)} bytes, expected {offset}")
        return out

    def from_values(self, values: Sequence[bytes | None]) -> dict[str, np.ndarray]:
        """Redis's MGET answer as arrays (views of its bytes)."""
        out = {}
        for name, shape, value in zip(self.names, self.shapes, values, strict=True):
            if value is None:
                raise RuntimeError(f"redis has no {name!r}")
            out[name] = np.frombuffer(value, np.float32).reshape(shape)
        return out

    def loss(self, weights: dict[str, Any]) -> float:
        """D: the MSE on the whole set at ``weights``."""
        torch = self.torch
        self._load(weights)
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(self.model(self.x), self.y))

    def final(self, weights: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "count":
            v = np.asarray(weights[self.names[0]])
            return {"value": float(v.flat[0]), "uniform": bool(np.all(v == v.flat[0]))}
        if self.kind == "mlp":
            return {"loss": self.loss(weights)}
        return {"finite": all(bool(np.isfinite(np.asarray(weights[n])).all()) for n in self.names)}


def _stats(
    steps: int, start: float, end: float, latencies: list[float], cpu: float
) -> dict[str, Any]:
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1e3 if latencies else None
    return {"steps": steps, "start": start, "end": end, "step_ms_p50": p50, "cpu": cpu}


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children (a node's --processes)."""
    pids = [pid]
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
        pids += [int(c) for c in f.read().split()]
    total = 0
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------
# Clients: the async ones run in worker processes (one each), the sync ones in Ray actors
# and torch ranks. Each: create (worker 0 only), bind, step, read, drop.


class NodeClient:
    """aioparamsync's public client."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client: Any = None
        self.shared = False  # (--transport shm: memory shared with the node; unix: not)

    async def open(self) -> None:
        from aioparamsync import ParameterClient

        if self.shared:
            self.client = ParameterClient(self.address)
        else:
            self.client = ParameterClient(self.address, shared_memory=0)
        await self.client.ping()

    async def create(self, task: Task, initial: dict[str, np.ndarray]) -> None:
        from aioparamsync import sgd, sum_rule

        rules = sum_rule() if task.rule == "sum" else sgd(task.lr)
        await self.client.update_arrays(initial, rules=rules)

    async def step(self, task: Task) -> None:
        weights = await self.client.get_arrays(task.names) if task.pulls else None
        await self.client.push_gradients(task.gradients(weights))

    async def read(self, task: Task) -> dict[str, Any]:
        return await self.client.get_arrays(task.names)

    async def drop(self, task: Task, owner: bool) -> None:
        pass  # (the node keeps them: a fresh node every rep)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


class RedisClient:
    """redis-py's asyncio client: MGET, the step in the worker, MSET."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.r: Any = None

    async def open(self) -> None:
        import redis.asyncio as aioredis

        if self.address.startswith("unix:"):
            self.r = aioredis.Redis(unix_socket_path=self.address[5:])
        else:
            host, port = self.address.rsplit(":", 1)
            self.r = aioredis.Redis(host=host, port=int(port))
        await self.r.ping()

    async def create(self, task: Task, initial: dict[str, np.ndarray]) -> None:
        await self.r.mset({n: _flat(a) for n, a in initial.items()})

    async def step(self, task: Task) -> None:
        weights = task.from_values(await self.r.mget(task.names))
        new = task.apply_local(weights, task.gradients(weights))
        await self.r.mset({n: _flat(a) for n, a in new.items()})

    async def read(self, task: Task) -> dict[str, Any]:
        return task.from_values(await self.r.mget(task.names))

    async def drop(self, task: Task, owner: bool) -> None:
        if owner:
            await self.r.delete(*task.names)

    async def close(self) -> None:
        if self.r is not None:
            await self.r.aclose()


class GrpcClient:
    """One ``grpc.aio`` channel, raw bytes: Get answers every tensor, Push takes them all."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: Any = None

    async def open(self) -> None:
        import grpc

        self.channel = grpc.aio.insecure_channel(self.address, options=GRPC_OPTIONS)
        await asyncio.wait_for(self.channel.channel_ready(), START_TIMEOUT)
        call = self.channel.unary_unary
        self._init = call(f"/{GRPC_SERVICE}/Init")
        self._get = call(f"/{GRPC_SERVICE}/Get")
        self._push = call(f"/{GRPC_SERVICE}/Push")
        self._drop = call(f"/{GRPC_SERVICE}/Drop")

    async def create(self, task: Task, initial: dict[str, np.ndarray]) -> None:
        head = json.dumps(
            {"group": task.group, "shapes": task.shapes, "rule": task.rule, "lr": task.lr}
        ).encode()
        parts = [len(head).to_bytes(4, "big"), head, *(_flat(initial[n]) for n in task.names)]
        await self._init(b"".join(parts), timeout=CALL_GUARD)

    async def read(self, task: Task) -> dict[str, Any]:
        return task.split(await self._get(task.group.encode(), timeout=CALL_GUARD))

    async def step(self, task: Task) -> None:
        weights = await self.read(task) if task.pulls else None
        grads = task.gradients(weights)
        request = b"".join([task.head, *(_flat(grads[n]) for n in task.names)])
        await self._push(request, timeout=CALL_GUARD)

    async def drop(self, task: Task, owner: bool) -> None:
        if owner:
            await self._drop(task.group.encode(), timeout=CALL_GUARD)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


ASYNC_CLIENTS: dict[str, Callable[[str], Any]] = {
    "aioparamsync": NodeClient,
    "redis": RedisClient,
    "grpc": GrpcClient,
}


class RayClient:
    """A Ray worker actor's calls to the parameter-server actor."""

    def __init__(self) -> None:
        import ray

        self.ray = ray
        self.ps: Any = None

    def bind(self, task: Task, ps: Any) -> None:
        self.ps = ps

    def read(self, task: Task) -> dict[str, Any]:
        return self.ray.get(self.ps.get_weights.remote())

    def step(self, task: Task) -> None:
        ray = self.ray
        weights = ray.get(self.ps.get_weights.remote()) if task.pulls else None
        ray.get(self.ps.apply_gradients.remote(task.gradients(weights)))

    def drop(self, task: Task, owner: bool) -> None:
        self.ps = None


class TorchClient:
    """A torch rank's RPCs to the parameter server's owner, through its RRef."""

    def __init__(self) -> None:
        import torch
        import torch.distributed.rpc as rpc

        self.torch = torch
        self.rpc = rpc
        self.rref: Any = None
        self.owner: Any = None

    def bind(self, task: Task, rref: Any) -> None:
        self.rref = rref
        self.owner = rref.owner()

    def read(self, task: Task) -> dict[str, Any]:
        weights = self.rpc.rpc_sync(
            self.owner, torch_get_weights, args=(self.rref,), timeout=CALL_GUARD
        )
        return {n: t.numpy() for n, t in weights.items()}

    def step(self, task: Task) -> None:
        weights = self.read(task) if task.pulls else None
        from_numpy = self.torch.from_numpy
        grads = {n: from_numpy(g) for n, g in task.gradients(weights).items()}
        self.rpc.rpc_sync(
            self.owner, torch_apply_gradients, args=(self.rref, grads), timeout=CALL_GUARD
        )

    def drop(self, task: Task, owner: bool) -> None:
        self.rref = self.owner = None


class NumpyPS:
    """The Ray parameter server: the weights in numpy, folded in place (one call at a time)."""

    def __init__(self, initial: dict[str, np.ndarray], rule: str, lr: float) -> None:
        self.w = {n: np.array(a, copy=True) for n, a in initial.items()}
        self.rule = rule
        self.lr = lr

    def ready(self) -> int:
        return os.getpid()

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.w

    def apply_gradients(self, grads: dict[str, np.ndarray]) -> bool:
        for name, g in grads.items():
            fold_numpy(self.w[name], g, self.rule, self.lr)
        return True


class TorchPS:
    """torch-rpc's parameter server (held by rank 0): folds in place under a lock."""

    def __init__(self, initial: dict[str, np.ndarray], rule: str, lr: float) -> None:
        import torch

        self.lock = threading.Lock()
        self.w = {n: torch.from_numpy(np.array(a, copy=True)) for n, a in initial.items()}
        self.rule = rule
        self.lr = lr

    def get_weights(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.w)

    def apply_gradients(self, grads: dict[str, Any]) -> bool:
        with self.lock:
            for name, g in grads.items():
                if self.rule == "sum":
                    self.w[name].add_(g)
                else:
                    self.w[name].add_(g, alpha=-self.lr)
        return True


def torch_get_weights(rref: Any) -> dict[str, Any]:
    return rref.local_value().get_weights()


def torch_apply_gradients(rref: Any, grads: dict[str, Any]) -> bool:
    return rref.local_value().apply_gradients(grads)


# ---------------------------------------------------------------------------
# A worker's commands: create (worker 0), prepare, run, final (worker 0), drop


class AsyncCore:
    def __init__(self, index: int, client: Any) -> None:
        self.index = index
        self.client = client
        self.task: Task | None = None

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        kind = cmd["cmd"]
        if kind == "create":
            task = Task(cmd["spec"], self.index)
            await self.client.create(task, task.initial())
            return {}
        if kind == "prepare":
            task = self.task = Task(cmd["spec"], self.index)
            weights = await self.client.read(task)  # untimed: connected, the tensors exist
            reply = {}
            if task.kind == "mlp":
                task.warm()
                if self.index == 0:
                    reply["initial_loss"] = task.loss(weights)
            for _ in range(cmd["spec"]["warmup"]):
                await self.client.step(task)
            return reply
        assert self.task is not None
        task = self.task
        if kind == "run":
            await asyncio.sleep(max(0.0, cmd["t0"] - time.monotonic()))
            clock = time.monotonic
            deadline, max_steps = cmd["deadline"], cmd["max_steps"]
            latencies: list[float] = []
            steps = 0
            cpu = time.process_time()
            start = clock()
            while steps < max_steps and clock() < deadline:
                t = clock()
                await self.client.step(task)
                latencies.append(clock() - t)
                steps += 1
            end = clock()
            return _stats(steps, start, end, latencies, time.process_time() - cpu)
        if kind == "final":
            return task.final(await self.client.read(task))
        if kind == "drop":
            await self.client.drop(task, self.index == 0)
            self.task = None
            return {}
        raise ValueError(f"unknown command {kind!r}")


class SyncCore:
    """The same for Ray actors and torch ranks (the fleet creates the server's state)."""

    def __init__(self, index: int, client: Any) -> None:
        self.index = index
        self.client = client
        self.task: Task | None = None

    def handle(self, cmd: dict[str, Any], ps: Any) -> dict[str, Any]:
        kind = cmd["cmd"]
        if kind == "prepare":
            task = self.task = Task(cmd["spec"], self.index)
            self.client.bind(task, ps)
            weights = self.client.read(task)
            reply = {}
            if task.kind == "mlp":
                task.warm()
                if self.index == 0:
                    reply["initial_loss"] = task.loss(weights)
            for _ in range(cmd["spec"]["warmup"]):
                self.client.step(task)
            return reply
        assert self.task is not None
        task = self.task
        if kind == "run":
            time.sleep(max(0.0, cmd["t0"] - time.monotonic()))
            clock = time.monotonic
            deadline, max_steps = cmd["deadline"], cmd["max_steps"]
            latencies: list[float] = []
            steps = 0
            cpu = time.process_time()
            start = clock()
            while steps < max_steps and clock() < deadline:
                t = clock()
                self.client.step(task)
                latencies.append(clock() - t)
                steps += 1
            end = clock()
            return _stats(steps, start, end, latencies, time.process_time() - cpu)
        if kind == "final":
            return task.final(self.client.read(task))
        if kind == "drop":
            self.client.drop(task, self.index == 0)
            self.task = None
            return {}
        raise ValueError(f"unknown command {kind!r}")


class RayWorker:
    """A Ray worker actor."""

    def __init__(self, index: int) -> None:
        self.core = SyncCore(index, RayClient())

    def ready(self) -> int:
        return os.getpid()

    def command(self, cmd: dict[str, Any], ps: Any) -> dict[str, Any]:
        return self.core.handle(cmd, ps)


_TORCH_CORE: SyncCore | None = None  # a torch worker rank's


def torch_command(rref: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    """Run on a worker rank, called by rank 0."""
    assert _TORCH_CORE is not None
    return _TORCH_CORE.handle(cmd, rref)


# ---------------------------------------------------------------------------
# A session: every workload in turn on one system's fleet of workers


def _reply_ok(reply: dict[str, Any], who: str) -> dict[str, Any]:
    if not reply.get("ok", True):
        raise RuntimeError(f"{who}: {reply.get('error')}")
    return reply


def summarize_workload(
    spec: dict[str, Any],
    prepared: list[dict],
    runs: list[dict],
    final: dict,
    server_cpu: float | None,  # (cores busy)
) -> dict[str, Any]:
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    p50s = [r["step_ms_p50"] for r in runs if r["step_ms_p50"] is not None]
    out: dict[str, Any] = {
        "steps": steps,
        "seconds": span,
        "per_worker_steps": [r["steps"] for r in runs],
        "step_ms_p50": statistics.median(p50s) if p50s else None,
        # CPU seconds over the span (1.0: one core busy): the server, all workers together
        "server_cpu": server_cpu,
        "workers_cpu": sum(r["cpu"] for r in runs) / span if span > 0 else None,
        # C and D run to a count: this says whether every worker got there
        "complete": all(r["steps"] == spec["max_steps"] for r in runs),
    }
    if spec["kind"] == "dense":
        out["steps_per_s"] = steps / span if span > 0 else None
        out["finite"] = final.get("finite")
    elif spec["kind"] == "count":
        out["expected"] = steps
        out["final_value"] = final["value"]
        out["lost"] = steps - final["value"]
        out["uniform"] = final["uniform"]
    else:
        out["loss"] = final["loss"]
        out["initial_loss"] = prepared[0].get("initial_loss")
    return out


def session(fleet: Any, specs: list[dict[str, Any]], log: Callable[[str], None]) -> dict:
    results = {}
    for spec in specs:
        fleet.create(spec)
        prepared = fleet.all({"cmd": "prepare", "spec": spec}, CALL_GUARD * 2)
        t0 = time.monotonic() + START_DELAY
        run = {"cmd": "run", "t0": t0, "deadline": t0 + spec["seconds"]}
        run["max_steps"] = spec["max_steps"]
        collect = fleet.start(run, spec["seconds"] + START_DELAY + CALL_GUARD)
        # The server's CPU from the workers' start to their last answer (over that time).
        time.sleep(max(0.0, t0 - time.monotonic()))
        cpu0, w0 = fleet.server_cpu(), time.monotonic()
        runs = collect()
        cpu1, w1 = fleet.server_cpu(), time.monotonic()
        final = fleet.one({"cmd": "final"}, CALL_GUARD)
        fleet.drop(spec)
        cpu = None
        if cpu0 is not None and cpu1 is not None and w1 > w0:
            cpu = (cpu1 - cpu0) / (w1 - w0)
        results[spec["workload"]] = r = summarize_workload(spec, prepared, runs, final, cpu)
        log(f"  {spec['workload']}: {_brief(spec['workload'], r)}")
    return results


def _brief(workload: str, r: dict[str, Any]) -> str:
    cpu = f"; CPU server {_num(r['server_cpu'])}, workers {_num(r['workers_cpu'])}"
    if workload in ("A", "B"):
        return f"{r['steps_per_s']:.1f} steps/s ({r['steps']} steps in {r['seconds']:.2f} s){cpu}"
    if workload == "C":
        return f"lost {r['lost']:g} of {r['expected']} (final {r['final_value']:g}){cpu}"
    return f"{r['seconds']:.2f} s, loss {r['loss']:.4f} (initial {r['initial_loss']:.4f}){cpu}"


class RayFleet:
    def __init__(self, ray: Any, ps_cls: Any, workers: list[Any]) -> None:
        self.ray = ray
        self.ps_cls = ps_cls
        self.workers = workers
        self.ps: Any = None
        self.ps_pid = 0

    def create(self, spec: dict[str, Any]) -> None:
        initial = Task(spec, 0).initial()
        self.ps = self.ps_cls.remote(initial, spec["rule"], spec["lr"])
        self.ps_pid = self.ray.get(self.ps.ready.remote(), timeout=START_TIMEOUT)

    def server_cpu(self) -> float | None:
        return cpu_seconds(self.ps_pid)

    def start(self, cmd: dict[str, Any], timeout: float) -> Callable[[], list[dict]]:
        refs = [w.command.remote(cmd, self.ps) for w in self.workers]
        deadline = time.monotonic() + timeout
        return lambda: self.ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))

    def all(self, cmd: dict[str, Any], timeout: float) -> list[dict]:
        return self.start(cmd, timeout)()

    def one(self, cmd: dict[str, Any], timeout: float) -> dict:
        return self.ray.get(self.workers[0].command.remote(cmd, self.ps), timeout=timeout)

    def drop(self, spec: dict[str, Any]) -> None:
        self.all({"cmd": "drop"}, CALL_GUARD)
        self.ray.kill(self.ps)
        self.ps = None


class TorchFleet:
    def __init__(self, n: int) -> None:
        import torch.distributed.rpc as rpc

        self.rpc = rpc
        self.names = [f"worker{i}" for i in range(1, n + 1)]
        self.rref: Any = None

    def create(self, spec: dict[str, Any]) -> None:
        initial = Task(spec, 0).initial()
        self.rref = self.rpc.RRef(TorchPS(initial, spec["rule"], spec["lr"]))

    def server_cpu(self) -> float | None:
        return time.process_time()  # (rank 0: the PS's RPC threads, and this driving loop)

    def start(self, cmd: dict[str, Any], timeout: float) -> Callable[[], list[dict]]:
        # (the RPCs' own timeout is the guard: they fail past it)
        futures = [
            self.rpc.rpc_async(name, torch_command, args=(self.rref, cmd), timeout=timeout)
            for name in self.names
        ]
        return lambda: [f.wait() for f in futures]

    def all(self, cmd: dict[str, Any], timeout: float) -> list[dict]:
        return self.start(cmd, timeout)()

    def one(self, cmd: dict[str, Any], timeout: float) -> dict:
        return self.rpc.rpc_sync(
            self.names[0], torch_command, args=(self.rref, cmd), timeout=timeout
        )

    def drop(self, spec: dict[str, Any]) -> None:
        self.all({"cmd": "drop"}, CALL_GUARD)
        self.rref = None


class ProcFleet:
    """Worker processes of this script (``--worker``), a JSON command a line on stdin."""

    def __init__(self, agents: list[Child], server_pid: int) -> None:
        self.agents = agents
        self.server_pid = server_pid

    def server_cpu(self) -> float | None:
        return cpu_seconds(self.server_pid)

    def create(self, spec: dict[str, Any]) -> None:
        self.one({"cmd": "create", "spec": spec}, CALL_GUARD)

    def start(self, cmd: dict[str, Any], timeout: float) -> Callable[[], list[dict]]:
        for a in self.agents:
            a.send(cmd)
        deadline = time.monotonic() + timeout
        return lambda: [
            _reply_ok(a.reply(deadline - time.monotonic()), a.name) for a in self.agents
        ]

    def all(self, cmd: dict[str, Any], timeout: float) -> list[dict]:
        return self.start(cmd, timeout)()

    def one(self, cmd: dict[str, Any], timeout: float) -> dict:
        self.agents[0].send(cmd)
        return _reply_ok(self.agents[0].reply(timeout), self.agents[0].name)

    def drop(self, spec: dict[str, Any]) -> None:
        self.all({"cmd": "drop"}, CALL_GUARD)


# ---------------------------------------------------------------------------
# Child processes: started with their stdout piped, stopped by PID


class ChildFailed(RuntimeError):
    """A child exited, timed out, or answered an error."""


def _load_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this driver dies (even by SIGKILL)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A process of ours: its stdout read line by line, its stderr kept in a file."""

    def __init__(
        self, name: str, cmd: Sequence[str], env: dict[str, str], *, stdin: bool = False
    ) -> None:
        self.name = name
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.buffer = b""
        self.other: list[str] = []  # lines that were not answers
        self.proc = subprocess.Popen(
            list(cmd),
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            preexec_fn=_die_with_parent,
        )

    def line(self, timeout: float) -> str:
        """The next line of its stdout (ChildFailed at EOF or past ``timeout``)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed(f"{self.name}: no answer within {timeout:.0f} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise ChildFailed(f"{self.name} exited: {self.stderr_tail()}")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace")

    def reply(self, timeout: float) -> dict[str, Any]:
        """Its next answer (a line starting with MARK); other lines are kept aside."""
        deadline = time.monotonic() + timeout
        for _ in range(100_000):
            text = self.line(deadline - time.monotonic())
            if text.startswith(MARK):
                return json.loads(text[len(MARK) :])
            self.other = [*self.other[-20:], text]
        raise ChildFailed(f"{self.name}: no answer among its lines")

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def stderr_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(ValueError, OSError):
            self.stderr.seek(0)
            return self.stderr.read().decode(errors="replace")[-n:]
        return ""

    def stop(self, grace: float = 0.0) -> None:
        """Wait ``grace`` s for it to end by itself, then SIGTERM, then SIGKILL: by its PID."""
        proc = self.proc
        try:
            if grace > 0:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(grace)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_TIMEOUT)
        finally:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            self.stderr.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def closed_port() -> int:
    return free_port()  # (bound, then closed: nothing listens there)


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------
# Sessions, one per system, run by the driver


class Context:
    """What a session needs: the arguments, the specs, the environment, a log."""

    def __init__(self, args: argparse.Namespace, specs: list[dict], env: dict[str, str]) -> None:
        self.args = args
        self.specs = specs
        self.env = env

    def log(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def budget(self) -> float:
        """A guard on a whole session (Ray, torch-rpc): every phase's own guards together."""
        return START_TIMEOUT + sum(s["seconds"] + START_DELAY + 5 * CALL_GUARD for s in self.specs)


def transport_of(system: str, transport: str) -> tuple[str, str | None]:
    """(what the system uses under ``--transport``, a note saying so, or None)."""
    if system == "ray":
        return "ray", (
            "ray: --transport does not apply: Ray's own (gRPC over TCP for calls, its "
            "shared-memory object store for values above 100 KiB)"
        )
    if system == "torch-rpc":
        if transport == "tcp":
            return "tcp", (
                "torch-rpc: TensorPipe pinned to TCP (_transports=['uv'], _channels=['basic'])"
            )
        why = "it has no Unix-socket transport; " if transport == "unix" else ""
        return "tensorpipe-defaults", (
            f"torch-rpc: {why}TensorPipe's defaults (shared memory between processes of one host)"
        )
    if system == "aioparamsync" and transport == "shm":
        return transport, (
            "aioparamsync: the client as it is by default, given the node's TCP address: "
            "it moves to the node's Unix socket (found by asking) and shares memory there"
        )
    if system == "aioparamsync" and transport == "unix":
        return transport, "aioparamsync: the node's Unix socket, without shared memory"
    if system == "aioparamsync":
        return transport, "aioparamsync: pinned to TCP (shared_memory=0: no Unix socket)"

    if transport == "shm":
        return "tcp", f"{system}: no shared-memory transport; fell back to tcp"
    return transport, None


def agents_session(ctx: Context, system: str, address: str, server: Child) -> dict:
    """N worker processes of ``system`` against the server at ``address``."""
    args = ctx.args
    agents: list[Child] = []
    try:
        for i in range(args.workers):
            cmd = [sys.executable, str(THIS), "--worker", system, "--address", address]
            cmd += ["--index", str(i), "--client-loop", args.client_loop]
            cmd += ["--transport", args.transport]
            agents.append(Child(f"{system} worker {i}", cmd, ctx.env, stdin=True))
        loops = {_reply_ok(a.reply(START_TIMEOUT), a.name)["loop"] for a in agents}
        results = session(ProcFleet(agents, server.proc.pid), ctx.specs, ctx.log)
        return {"results": results, "client_loop": sorted(loops)}
    except ChildFailed:
        for a in agents:
            if a.proc.poll() is not None:
                ctx.log(f"{a.name} ended: {a.stderr_tail()}")
        raise
    finally:
        for a in agents:
            with contextlib.suppress(OSError, ValueError):
                a.send({"cmd": "exit"})
        for a in agents:
            a.stop(grace=5.0)


def _progress(ctx: Context, child: Child) -> None:
    """Show the per-workload lines a session child logged (Ray, torch rank 0)."""
    for line in child.stderr_tail(200_000).splitlines():
        if len(line) > 4 and line.startswith("  ") and line[2] in WORKLOADS and line[3] == ":":
            ctx.log(line)


def _listening(child: Child, timeout: float) -> str:
    """The address a server printed (``... listening on HOST:PORT[ and unix:PATH]``)."""
    line = child.line(timeout)
    if " listening on " not in line:
        raise ChildFailed(f"{child.name} printed {line!r}: {child.stderr_tail()}")
    where = line.split(" listening on ", 1)[1].strip()
    if " and " in where:  # the node's Unix socket: clients connect there
        return where.split(" and ", 1)[1]
    return where


def session_aioparamsync(ctx: Context) -> dict:
    args = ctx.args
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "aioparamsync", "--host", HOST, "--port", "0"]
        cmd += ["--log-level", "warning", *args.node_args]
        if args.transport == "unix":
            cmd += ["--unix-socket", str(Path(tmp) / "node.sock")]
        # (shm: the workers are given its TCP address, as by default, and move to its own
        # Unix socket, an abstract one, by themselves: see aioparamsync.client.local)
        node = Child("aioparamsync node", cmd, ctx.env)
        try:
            address = _listening(node, START_TIMEOUT)
            return agents_session(ctx, "aioparamsync", address, node)
        except ChildFailed:
            ctx.log(f"node: {node.stderr_tail()}")
            raise
        finally:
            node.stop()


def _redis_ping(address: str) -> bool:
    try:
        if address.startswith("unix:"):
            s = socket.socket(socket.AF_UNIX)
            target: Any = address[5:]
        else:
            s = socket.socket()
            host, port = address.rsplit(":", 1)
            target = (host, int(port))
        with s:
            s.settimeout(2.0)
            s.connect(target)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def session_redis(ctx: Context) -> dict:
    args = ctx.args
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [args.redis_server_path, "--bind", HOST, "--save", "", "--appendonly", "no"]
        cmd += ["--daemonize", "no", "--protected-mode", "yes", "--dir", tmp]
        cmd += ["--loglevel", "warning", "--logfile", ""]
        if args.transport == "unix":
            path = str(Path(tmp) / "redis.sock")
            cmd += ["--port", "0", "--unixsocket", path, "--unixsocketperm", "700"]
            address = f"unix:{path}"
        else:
            port = free_port()
            cmd += ["--port", str(port)]
            address = f"{HOST}:{port}"
        server = Child("redis-server", cmd, ctx.env)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not _redis_ping(address):
                if server.proc.poll() is not None or time.monotonic() > deadline:
                    raise ChildFailed(f"redis-server did not start: {server.stderr_tail()}")
                time.sleep(0.05)
            return agents_session(ctx, "redis", address, server)
        finally:
            server.stop()


def session_grpc(ctx: Context) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(THIS), "--serve-grpc"]
        if ctx.args.transport == "unix":
            cmd += ["--unix-socket", str(Path(tmp) / "grpc.sock")]
        server = Child("grpc server", cmd, ctx.env)
        try:
            address = _listening(server, START_TIMEOUT)
            return agents_session(ctx, "grpc", address, server)
        except ChildFailed:
            ctx.log(f"grpc server: {server.stderr_tail()}")
            raise
        finally:
            server.stop()


def ray_environment(env: dict[str, str]) -> dict[str, str]:
    """Ray on loopback only: its API server asks the clouds' metadata servers which cloud
    it runs on; through a proxy on a closed loopback port it learns nothing, sends nothing
    (as tests/test_ray.py does)."""
    proxy = f"http://{HOST}:{closed_port()}"
    direct = f"{HOST},localhost,::1"
    return {
        **env,
        "http_proxy": proxy,
        "https_proxy": proxy,
        "HTTP_PROXY": proxy,
        "HTTPS_PROXY": proxy,
        "no_proxy": direct,
        "NO_PROXY": direct,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }


def session_ray(ctx: Context) -> dict:
    args = ctx.args
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "ray.json"
        config.write_text(
            json.dumps(
                {
                    "specs": ctx.specs,
                    "workers": args.workers,
                    "object_store": args.ray_object_store,
                    "cpus": args.ray_cpus,
                    "temp_dir": str(Path(tmp) / "ray"),  # (its logs and sockets: removed after)
                }
            )
        )
        runner = Child("ray", [sys.executable, str(THIS), "--ray-session", str(config)],
                       ray_environment(ctx.env))  # fmt: skip
        try:
            reply = _reply_ok(runner.reply(ctx.budget()), "ray")
            _progress(ctx, runner)
            return {"results": reply["results"]}
        except (ChildFailed, RuntimeError):
            ctx.log(f"ray: {runner.stderr_tail()}")
            raise
        finally:
            runner.stop(grace=EXIT_GRACE)  # it shuts Ray down in its finally, then exits


def session_torch(ctx: Context) -> dict:
    args = ctx.args
    world = args.workers + 1
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "torch.json"
        pinned = args.transport == "tcp"
        config.write_text(json.dumps({"specs": ctx.specs, "world": world, "tcp": pinned}))
        env = {**ctx.env, "MASTER_ADDR": HOST, "MASTER_PORT": str(free_port())}
        env["TP_SOCKET_IFNAME"] = "lo"  # TensorPipe's TCP transport on loopback
        ranks: list[Child] = []
        try:
            for rank in range(world):
                cmd = [sys.executable, str(THIS), "--torch-rank", str(rank)]
                cmd += ["--config", str(config)]
                ranks.append(Child(f"torch rank {rank}", cmd, env))
            reply = _reply_ok(ranks[0].reply(ctx.budget()), "torch rank 0")
            _progress(ctx, ranks[0])
            return {"results": reply["results"]}
        except (ChildFailed, RuntimeError):
            for r in ranks:
                ctx.log(f"{r.name}: {r.stderr_tail(1500)}")
            raise
        finally:
            for r in ranks:
                r.stop(grace=EXIT_GRACE if r is ranks[0] else 5.0)


SESSIONS: dict[str, Callable[[Context], dict]] = {
    "aioparamsync": session_aioparamsync,
    "redis": session_redis,
    "torch-rpc": session_torch,
    "ray": session_ray,
    "grpc": session_grpc,
}


# ---------------------------------------------------------------------------
# Entry points of the child processes


def worker_main(args: argparse.Namespace) -> int:
    """A worker process: one client, commands on stdin, answers on stdout."""

    async def main() -> None:
        client = ASYNC_CLIENTS[args.worker](args.address)
        if isinstance(client, NodeClient):
            client.shared = args.transport == "shm"
        try:
            await client.open()
            core = AsyncCore(args.index, client)
            loop = type(asyncio.get_running_loop())
            emit({"ok": True, "loop": f"{loop.__module__}.{loop.__qualname__}"})
            for _ in range(MAX_COMMANDS):
                line = await asyncio.to_thread(sys.stdin.readline)
                if not line:
                    return
                cmd = json.loads(line)
                if cmd["cmd"] == "exit":
                    return
                try:
                    reply = await core.handle(cmd)
                except Exception:  # noqa: BLE001 - the driver reports it and stops
                    reply = {"ok": False, "error": traceback.format_exc()}
                emit(reply)
        except Exception:  # noqa: BLE001 - (the first answer: open failed)
            emit({"ok": False, "error": traceback.format_exc()})
        finally:
            await client.close()

    if args.client_loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())
    return 0


async def serve_grpc(unix_socket: str | None) -> None:
    """Init stores a workload's tensors, Get answers them all, Push folds every gradient."""
    import grpc

    groups: dict[str, tuple[list[np.ndarray], str, float]] = {}

    async def init(request: bytes, context: Any) -> bytes:
        n = int.from_bytes(request[:4], "big")
        head = json.loads(request[4 : 4 + n])
        offset = 4 + n
        arrays = []
        for shape in head["shapes"]:
            count = math.prod(shape)
            a = np.frombuffer(request, np.float32, count, offset).reshape(shape).copy()
            arrays.append(a)
            offset += a.nbytes
        groups[head["group"]] = (arrays, head["rule"], head["lr"])
        return ACK

    async def get(request: bytes, context: Any) -> bytes:
        return b"".join(_flat(a) for a in groups[request.decode()][0])

    async def push(request: bytes, context: Any) -> bytes:
        n = request[0]
        arrays, rule, lr = groups[request[1 : 1 + n].decode()]
        offset = 1 + n
        for a in arrays:
            g = np.frombuffer(request, np.float32, a.size, offset).reshape(a.shape)
            fold_numpy(a, g, rule, lr)
            offset += a.nbytes
        return ACK

    async def drop(request: bytes, context: Any) -> bytes:
        groups.pop(request.decode(), None)
        return ACK

    server = grpc.aio.server(options=GRPC_OPTIONS)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(fn)
        for name, fn in (("Init", init), ("Get", get), ("Push", push), ("Drop", drop))
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GRPC_SERVICE, handlers),))
    if unix_socket:
        server.add_insecure_port(f"unix:{unix_socket}")
        where = f"unix:{unix_socket}"
    else:
        where = f"{HOST}:{server.add_insecure_port(f'{HOST}:0')}"
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"bench-peers-grpc {os.getpid()} listening on {where}", flush=True)
    await stop.wait()
    await server.stop(grace=1.0)


def _exit_on_sigterm() -> None:
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def ray_main(config_path: str) -> int:
    """The Ray session: a local instance, the actors, every workload, then Ray shut down."""
    cfg = json.loads(Path(config_path).read_text())
    _exit_on_sigterm()  # (so that the finally below shuts Ray down)
    import ray

    ray.init(
        address="local",  # a new instance, never one already running on the machine
        num_cpus=cfg["cpus"],
        include_dashboard=False,
        dashboard_host=HOST,
        _node_ip_address=HOST,
        object_store_memory=cfg["object_store"],
        _temp_dir=cfg["temp_dir"],
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        nodes = {n["NodeManagerAddress"] for n in ray.nodes()}
        if nodes != {HOST}:
            raise RuntimeError(f"Ray is not on loopback only: {nodes}")
        ps_cls = ray.remote(NumpyPS)
        worker_cls = ray.remote(RayWorker)
        workers = [worker_cls.options(max_concurrency=1).remote(i) for i in range(cfg["workers"])]
        ray.get([w.ready.remote() for w in workers], timeout=START_TIMEOUT)
        results = session(RayFleet(ray, ps_cls, workers), cfg["specs"], _stderr_log)
        emit({"ok": True, "results": results})
    except Exception:  # noqa: BLE001 - answered to the driver
        emit({"ok": False, "error": traceback.format_exc()})
    finally:
        ray.shutdown()
    return 0


def _stderr_log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def torch_main(rank: int, config_path: str) -> int:
    """A torch rank: 0 holds the parameter server and drives the session, the others work."""
    global _TORCH_CORE
    cfg = json.loads(Path(config_path).read_text())
    import torch.distributed.rpc as rpc

    extra: dict[str, Any] = {}
    if cfg["tcp"]:
        extra = {"_transports": ["uv"], "_channels": ["basic"]}
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=CALL_GUARD, **extra)
    world = cfg["world"]
    if rank > 0:
        _TORCH_CORE = SyncCore(rank - 1, TorchClient())
    name = "ps" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    try:
        if rank == 0:
            try:
                results = session(TorchFleet(world - 1), cfg["specs"], _stderr_log)
                emit({"ok": True, "results": results})
            except Exception:  # noqa: BLE001 - answered to the driver
                emit({"ok": False, "error": traceback.format_exc()})
    finally:
        rpc.shutdown()  # (waits for every rank: the workers wait here for rank 0)
    return 0


# ---------------------------------------------------------------------------
# The driver: availability, specs, the runs, medians, ratios, the tables


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def redis_server_version(path: str | None) -> str | None:
    if not path:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    for word in out.stdout.split():
        if word.startswith("v="):
            return word[2:]
    return out.stdout.strip() or None


def availability(args: argparse.Namespace) -> dict[str, str | None]:
    """system -> None (it runs) or why it is skipped."""
    out: dict[str, str | None] = {}
    for system in SYSTEMS:
        reason = None
        if system == "aioparamsync" and not _has("aioparamsync"):
            reason = "the aioparamsync package is not importable"
        elif system == "redis":
            if not _has("redis"):
                reason = "redis-py is not installed (pip install 'redis>=5')"
            elif not args.redis_server_path or not os.access(args.redis_server_path, os.X_OK):
                reason = (
                    f"no redis-server binary ({args.redis_server_path or 'none on PATH'}; "
                    "apt install redis-server, or --redis-server PATH)"
                )
        elif system == "torch-rpc" and not _has("torch"):
            reason = "torch is not installed"
        elif system == "ray" and not _has("ray"):
            reason = "ray is not installed (pip install 'ray>=2.40')"
        elif system == "grpc" and not _has("grpc"):
            reason = "grpcio is not installed (pip install grpcio)"
        out[system] = reason
    return out


def make_specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    p = args.sizes
    specs: list[dict[str, Any]] = []
    for w in args.workloads:
        if w in ("A", "B"):
            key = w.lower()
            specs.append(
                {
                    "workload": w,
                    "kind": "dense",
                    "tensors": p[f"{key}_tensors"],
                    "elements": p[f"{key}_bytes"] // 4,
                    "bytes": p[f"{key}_bytes"],
                    "rule": "sgd",
                    "lr": LR_DENSE,
                    "warmup": p["warmup"],
                    "seconds": args.seconds,
                    "max_steps": args.max_steps,
                    "seed": 1 if w == "A" else 2,
                }
            )
        elif w == "C":
            specs.append(
                {
                    "workload": "C",
                    "kind": "count",
                    "tensors": 1,
                    "elements": p["c_elements"],
                    "rule": "sum",
                    "lr": 0.0,
                    "warmup": 0,
                    "seconds": args.guard,
                    "max_steps": args.c_pushes,
                    "seed": 3,
                }
            )
        else:
            specs.append(
                {
                    "workload": "D",
                    "kind": "mlp",
                    "rule": "sgd",
                    "lr": LR_MLP,
                    "warmup": 0,
                    "seconds": args.guard,
                    "max_steps": args.d_steps,
                    "samples": args.d_samples,
                    "seed": 4,
                }
            )
    return specs


def describe(spec: dict[str, Any], workers: int) -> str:
    w = spec["workload"]
    if w in ("A", "B"):
        return f"{w}: {spec['tensors']} x {fmt_size(spec['bytes'])}, steps/s"
    if w == "C":
        return f"C: lost of {workers} x {spec['max_steps']} pushes"
    return f"D: seconds, {workers} x {spec['max_steps']} steps"


def fmt_size(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(
    runs: list[dict[str, Any]], specs: list[dict], systems: dict[str, dict], workers: int
) -> tuple[list[dict], list[dict]]:
    """One row per workload (a column per system: medians and each rep), and the ratios."""
    metrics = {"A": ["steps_per_s"], "B": ["steps_per_s"], "C": ["lost"], "D": ["seconds", "loss"]}
    rows = []
    for spec in specs:
        w = spec["workload"]
        columns: dict[str, Any] = {}
        for system, state in systems.items():
            if state["status"] == "skipped":
                columns[system] = {"skipped": state["reason"]}
                continue
            mine = [r["results"][w] for r in runs if r["system"] == system and r.get("results")]
            if not mine:
                columns[system] = {"failed": state.get("reason") or "no run completed"}
                continue
            col: dict[str, Any] = {"n": len(mine)}
            for m in metrics[w]:
                col[m] = _median([r[m] for r in mine])
                col[f"{m}_reps"] = [r[m] for r in mine]
            for key in ("step_ms_p50", "server_cpu", "workers_cpu"):
                col[key] = _median([r[key] for r in mine])
            if w in ("C", "D"):  # (run to a count: did every worker get there?)
                col["complete"] = all(r["complete"] for r in mine)
            if w == "C":
                col["expected"] = _median([r["expected"] for r in mine])
                col["uniform"] = all(r["uniform"] for r in mine)
            if w == "D":
                col["initial_loss"] = _median([r["initial_loss"] for r in mine])
            columns[system] = col
        rows.append({"workload": w, "what": describe(spec, workers), "columns": columns})
    ratios = []
    for row in rows:
        ours = row["columns"].get("aioparamsync", {})
        for peer in SYSTEMS[1:]:
            theirs = row["columns"].get(peer)
            if theirs is None or "n" not in theirs or "n" not in ours:
                continue
            r: dict[str, Any] = {"workload": row["workload"], "peer": peer}
            w = row["workload"]
            if w in ("A", "B"):
                r["throughput"] = _div(ours["steps_per_s"], theirs["steps_per_s"])
            elif w == "C":
                r["aioparamsync_lost"] = ours["lost"]
                r["peer_lost"] = theirs["lost"]
            else:
                r["time"] = _div(ours["seconds"], theirs["seconds"])
                r["loss"] = _div(ours["loss"], theirs["loss"])
            ratios.append(r)
    return rows, ratios


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def render_tables(rows: list[dict], ratios: list[dict], systems: dict[str, dict]) -> str:
    names = list(systems)
    lines: list[list[str]] = []
    for row in rows:
        w = row["workload"]
        cells = []
        for s in names:
            c = row["columns"][s]
            if "skipped" in c:
                cells.append("skipped")
            elif "failed" in c:
                cells.append("failed")
            elif w in ("A", "B"):
                cells.append(_num(c["steps_per_s"]))
            elif w == "C":
                mark = "" if c["complete"] and c["uniform"] else "*"
                cells.append(f"{c['lost']:g}{mark}")
            else:
                cells.append(_num(c["seconds"]) + ("" if c["complete"] else "*"))
        lines.append([row["what"], *cells])
        if w == "D":
            cells = []
            for s in names:
                c = row["columns"][s]
                cells.append(f"{c['loss']:.4f}" if "n" in c else "-")
            init = [c.get("initial_loss") for c in row["columns"].values() if "n" in c]
            first = f" (initial {init[0]:.4f})" if init and init[0] is not None else ""
            lines.append([f"D: final loss{first}", *cells])
    out = [_table(["workload (median)", *names], lines)]
    peers = [p for p in SYSTEMS[1:] if p in names]
    rlines = []
    by = {(r["workload"], r["peer"]): r for r in ratios}
    for row in rows:
        w = row["workload"]
        if w in ("A", "B"):
            label, key = f"{w}: steps/s, aioparamsync / peer", "throughput"
        elif w == "C":
            label, key = "C: lost, aioparamsync vs peer", None
        else:
            label, key = "D: time, aioparamsync / peer", "time"
        cells = []
        for p in peers:
            r = by.get((w, p))
            if r is None:
                cells.append("-")
            elif key is None:
                cells.append(f"{r['aioparamsync_lost']:g} vs {r['peer_lost']:g}")
            else:
                cells.append(f"{r[key]:.2f}x" if r[key] is not None else "-")
        rlines.append([label, *cells])
        if w == "D":
            cells = []
            for p in peers:
                r = by.get((w, p))
                cells.append(f"{r['loss']:.2f}x" if r and r["loss"] is not None else "-")
            rlines.append(["D: final loss, aioparamsync / peer", *cells])
    if peers:
        out.append(_table(["ratio", *(f"/ {p}" for p in peers)], rlines))
    clines = []
    for row in rows:
        cells = []
        for s in names:
            c = row["columns"][s]
            ok = "n" in c and c["server_cpu"] is not None
            cells.append(f"{c['server_cpu']:.2f} / {c['workers_cpu']:.2f}" if ok else "-")
        clines.append([f"{row['workload']}: CPU server / workers", *cells])
    out.append(_table(["cores busy (1.0 = one), median", *names], clines))
    return "\n\n".join(out)


def _table(head: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    fmt = [str.ljust] + [str.rjust] * (len(head) - 1)
    text = [" | ".join(f(str(c), w) for f, c, w in zip(fmt, head, widths, strict=True))]
    text.append("-+-".join("-" * w for w in widths))
    for line in lines:
        text.append(" | ".join(f(str(c), w) for f, c, w in zip(fmt, line, widths, strict=True)))
    return "\n".join(text)


def machine(args: argparse.Namespace) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {
        d: _version(d)
        for d in ("aioparamsync", "numpy", "uvloop", "redis", "hiredis", "torch", "ray", "grpcio")
    }
    versions["redis-server"] = redis_server_version(args.redis_server_path)
    return {
        "git": git_state(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
    }


def header(meta: dict[str, Any], args: argparse.Namespace, notes: list[str]) -> str:
    v = meta["versions"]

    def ver(name: str) -> str:
        return v.get(name) or "not installed"

    took = f" in {meta['total_seconds']:.0f} s" if "total_seconds" in meta else ""
    after = meta.get("load1_after")
    load = f"load average {meta['load1_before']:.2f} before" + (
        f", {after:.2f} after" if after is not None else ""
    )
    p = args.sizes
    lines = [
        f"aioparamsync {ver('aioparamsync')} at {meta['git']}{took}",
        f"{meta['cpus']} CPUs ({meta['cpu_model']}), Python {meta['python']}, numpy "
        f"{ver('numpy')}, uvloop {ver('uvloop')}, redis-py {ver('redis')} (hiredis "
        f"{ver('hiredis')}), redis-server {ver('redis-server')}, torch {ver('torch')}, "
        f"ray {ver('ray')}, grpcio {ver('grpcio')}; {load}",
        f"{args.workers} workers + 1 server on 127.0.0.1, transport {args.transport}, the "
        f"async workers' loop {args.client_loop}; medians of {args.reps} reps; A and B: "
        f"{args.seconds:g} s per measured phase (at most {args.max_steps} steps a worker) "
        f"after {p['warmup']} warm-up steps a worker; C: {args.c_pushes} pushes a worker; "
        f"D: {args.d_steps} steps a worker, {args.d_samples} samples, batch {D_BATCH}, "
        f"lr {LR_MLP}; C and D guard {args.guard:g} s",
    ]
    if args.node_args:
        lines.append(f"the node runs with: {shlex.join(args.node_args)}")
    lines += notes
    return "\n".join(lines)


def _list_of(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {','.join(choices)}")
        return items

    return parse


def _size(text: str) -> int:
    units = {"kib": KiB, "mib": MiB, "gib": 1024 * MiB, "": 1}
    t = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda x: -len(x[0])):
        if unit and t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--systems", type=_list_of(SYSTEMS), default=list(SYSTEMS),
                   help="comma separated (default: all five)")  # fmt: skip
    p.add_argument("--workloads", type=_list_of(WORKLOADS), default=list(WORKLOADS),
                   help="comma separated, of A,B,C,D (default: all)")  # fmt: skip
    p.add_argument("--workers", type=int, default=2, help="worker processes (default: 2)")
    p.add_argument("--reps", type=int, help="repetitions, medians reported (default: 3)")
    p.add_argument("--seconds", type=float,
                   help="deadline of A's and B's measured phase (default: 3)")  # fmt: skip
    p.add_argument("--max-steps", type=int, default=100_000,
                   help="most steps a worker of A or B makes (default: %(default)s)")  # fmt: skip
    p.add_argument("--c-pushes", type=int, help="C: pushes a worker (default: 200)")
    p.add_argument("--d-steps", type=int, help="D: steps a worker (default: 300)")
    p.add_argument("--d-samples", type=int, help="D: the set's size (default: 4096)")
    p.add_argument("--guard", type=float,
                   help="C and D's deadline, a guard (default: 300 s)")  # fmt: skip
    p.add_argument("--transport", choices=TRANSPORTS, default="tcp",
                   help="tcp (default; aioparamsync's clients pinned to it), unix (Unix "
                   "sockets where a system has them), shm (aioparamsync's clients as by "
                   "default: moved to the node's Unix socket, sharing memory; TensorPipe's "
                   "defaults; the others fall back to tcp)")  # fmt: skip
    p.add_argument("--client-loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the event loop of the async workers: aioparamsync, redis, grpc "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--node-args", type=shlex.split, default=[], metavar="ARGS",
                   help="more flags for the node, as one string, e.g. "
                   "--node-args='--partition-bytes 0'")  # fmt: skip
    p.add_argument("--redis-server", dest="redis_server_path",
                   default=shutil.which("redis-server") or
                   ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None),
                   help="the redis-server binary (default: on PATH)")  # fmt: skip
    p.add_argument("--ray-object-store", type=_size, default=1024 * MiB,
                   help="Ray's object store, bytes (default: 1GiB)")  # fmt: skip
    p.add_argument("--ray-cpus", type=int, default=2, help="Ray's num_cpus (default: 2)")
    p.add_argument("--json", metavar="PATH", help="write the medians, ratios and every run")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, 1 rep, short deadlines (a CI smoke test)")  # fmt: skip
    # The child processes of a run:
    p.add_argument("--worker", choices=tuple(ASYNC_CLIENTS), help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--serve-grpc", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--unix-socket", help=argparse.SUPPRESS)
    p.add_argument("--ray-session", metavar="CONFIG", help=argparse.SUPPRESS)
    p.add_argument("--torch-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p


def finish_args(args: argparse.Namespace) -> None:
    """The sizes of the profile (full or smoke), overridden by the counts given."""
    base = dict(SMOKE if args.smoke else FULL)
    args.sizes = base
    for name in ("reps", "seconds", "c_pushes", "d_steps", "d_samples", "guard"):
        if getattr(args, name) is None:
            setattr(args, name, base[name])
    if args.smoke and args.max_steps == 100_000:
        args.max_steps = 200


def driver(args: argparse.Namespace) -> int:
    finish_args(args)
    if args.workers < 1 or args.reps < 1 or args.seconds <= 0 or args.max_steps < 1:
        print("--workers, --reps, --max-steps must be >= 1, --seconds > 0", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).resolve().parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + old if old else "")
    specs = make_specs(args)
    available = availability(args)
    systems: dict[str, dict[str, Any]] = {}
    notes = []
    torch_missing = not _has("torch")
    for s in args.systems:
        reason = available[s]
        if reason is not None:
            systems[s] = {"status": "skipped", "reason": reason}
            notes.append(f"{s}: skipped: {reason}")
            continue
        used, note = transport_of(s, args.transport)
        systems[s] = {"status": "ran", "transport": used}
        if note:
            systems[s]["note"] = note
            notes.append(note)
    if torch_missing and any(s["workload"] == "D" for s in specs):
        specs = [s for s in specs if s["workload"] != "D"]
        notes.append("D: skipped: torch is not installed")
    meta = machine(args)
    meta["load1_before"] = load_average()
    print(header(meta, args, notes), file=sys.stderr, flush=True)
    ctx = Context(args, specs, env)
    runnable = [s for s in args.systems if systems[s]["status"] == "ran"]
    runs: list[dict[str, Any]] = []
    t_start = time.monotonic()
    for rep in range(args.reps):
        k = rep % len(runnable) if runnable else 0
        for system in runnable[k:] + runnable[:k]:
            t0 = time.monotonic()
            ctx.log(f"[{time.monotonic() - t_start:6.1f}s] {system} rep {rep}")
            record: dict[str, Any] = {"system": system, "rep": rep, "load1": load_average()}
            try:
                record.update(SESSIONS[system](ctx))
            except (ChildFailed, RuntimeError, OSError) as exc:
                record["error"] = str(exc)
                ctx.log(f"{system} rep {rep} failed: {exc}")
            record["wall_seconds"] = round(time.monotonic() - t0, 2)
            runs.append(record)
    for s in runnable:
        done = [r for r in runs if r["system"] == s and "results" in r]
        errors = [r["error"] for r in runs if r["system"] == s and "error" in r]
        if errors:
            systems[s]["errors"] = errors
        if not done:
            systems[s]["status"] = "failed"
            systems[s]["reason"] = errors[0] if errors else "no run"
        if s in ("aioparamsync", "redis", "grpc"):
            loops = sorted({x for r in done for x in r.get("client_loop", [])})
            systems[s]["client_loop"] = loops
    meta["load1_after"] = load_average()
    meta["total_seconds"] = round(time.monotonic() - t_start, 1)
    meta["git_after"] = git_state()
    if meta["git_after"] != meta["git"]:
        notes.append(
            f"note: the checkout changed during the run: {meta['git']} at the start, "
            f"{meta['git_after']} at the end (each session imports the package as it starts)"
        )
    rows, ratios = summarize(runs, specs, systems, args.workers)
    print()
    print(header(meta, args, notes))
    print()
    print(render_tables(rows, ratios, systems))
    marks = any(
        "n" in c and not (c.get("complete", True) and c.get("uniform", True))
        for row in rows
        for c in row["columns"].values()
    )
    if marks:
        print("\n* a worker did not finish its count within --guard, or C's tensor was not uniform")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("worker", "address", "index")}
        doc = {
            "meta": meta,
            "config": config,
            "specs": specs,
            "systems": systems,
            "rows": rows,
            "ratios": ratios,
            "runs": runs,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    failed = [s for s, v in systems.items() if v["status"] == "failed"]
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.serve_grpc:
        import uvloop

        uvloop.run(serve_grpc(args.unix_socket))
        return 0
    if args.ray_session:
        return ray_main(args.ray_session)
    if args.torch_rank is not None:
        return torch_main(args.torch_rank, args.config)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)  # (the finally clauses stop every child)
    try:
        return driver(args)
    except KeyboardInterrupt:
        print("interrupted; the processes started were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
