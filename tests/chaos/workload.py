"""The workload: the plan's clients run their lanes of operations, and each op is recorded.

Theory of operation. Each :class:`~.plan.ClientPlan` is one :class:`~aioparamsync.ParameterClient`:
routed (every initial node's address; it learns the topology in its first calls) or pinned
to one node (``route=False``: that node passes on what it does not hold). Its lanes run at
once, each one op after another, until the workload's end; a ``burst`` is several pushes
sent at once. Every op runs under its own deadline (``OP_DEADLINE``, plus what a held call
waits), shorter than the client's, so that a hang is seen as one; the history
(:mod:`.history`) gets the op's times and outcome. A push whose outcome is unknown is sent
again under its request id, as often as the plan says. The client's own deadline stays
longer than the op's: what ends an op that does not answer is the op's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from aioparamsync import CallTimeout, ParameterClient, ParamSyncError
from aioparamsync.placement import bucket_of

from .checker import uniform
from .cluster import ChaosCluster
from .history import History, Op, merge_outcomes, outcome_of
from .plan import ClientPlan, OpSpec, Plan

__all__ = ["OP_DEADLINE", "Workload"]

OP_DEADLINE = 8.0  # an op not answered within this is a hang (seconds)
READ_WAIT = 2.0  # a read's long poll for its min_version (seconds)
BARRIER_WAIT = 3.0  # a barrier's wait for the other workers (seconds)
CONNECT_TIMEOUT = 2.0
CLIENT_SLACK = 5.0  # the client's deadline is the op's plus this
ERROR_PAUSE = 0.1  # a lane's pause after an op that was not ok (as a worker backs off)


class Workload:
    """Runs ``plan``'s clients against ``cluster`` (see the module)."""

    def __init__(
        self, plan: Plan, cluster: ChaosCluster, history: History, clock: Callable[[], float]
    ) -> None:
        self.plan = plan
        self.cluster = cluster
        self.history = history
        self.clock = clock
        self.sizes = {k.name: k.size for k in plan.keys}
        self.dumped = False  # the nodes were asked for their tasks (at the first hang)

    async def run(self, until: float) -> None:
        """Every client's lanes, until ``until`` (on ``clock``); ops in flight then end."""
        async with contextlib.AsyncExitStack() as stack:
            runs = []
            for c in self.plan.clients:
                client = await stack.enter_async_context(self._client(c))
                target = "routed" if c.pinned is None else self.cluster.slots[c.pinned].node_id
                known: dict[str, int] = {}  # name -> the highest version this client saw
                for lane, ops in enumerate(c.lanes):
                    runs.append(self._lane(client, c, target, lane, ops, until, known))
            await asyncio.gather(*runs)

    def _client(self, c: ClientPlan) -> ParameterClient:
        slots = self.cluster.slots
        kwargs: dict[str, Any] = {
            "timeout": OP_DEADLINE + READ_WAIT + CLIENT_SLACK,
            "connect_timeout": CONNECT_TIMEOUT,
        }
        if c.pinned is None:
            return ParameterClient([s.address for s in slots[: self.plan.nodes]], **kwargs)
        return ParameterClient(slots[c.pinned].address, route=False, **kwargs)

    async def _lane(
        self,
        client: ParameterClient,
        c: ClientPlan,
        target: str,
        lane: int,
        ops: tuple[OpSpec, ...],
        until: float,
        known: dict[str, int],
    ) -> None:
        for spec in ops:
            await asyncio.sleep(spec.think)
            if self.clock() >= until:
                return
            if spec.kind == "burst":
                await asyncio.gather(
                    *(
                        self._op(client, c, target, lane, spec, known, rid)
                        for rid in spec.request_ids
                    )
                )
            elif not await self._op(client, c, target, lane, spec, known):
                await asyncio.sleep(ERROR_PAUSE)

    def _new_op(self, c: ClientPlan, target: str, lane: int, spec: OpSpec, rid: str) -> Op:
        kind = "push" if spec.kind == "burst" else spec.kind
        parts = len(spec.keys)
        if spec.ids:
            parts = len(set(bucket_of(np.array(spec.ids, np.int64), self.plan.table.buckets)))
        op = Op(
            index=len(self.history.ops),
            client=c.name,
            lane=lane,
            kind=kind,
            target=target,
            invoke=self.clock(),
            keys=spec.keys,
            ids=spec.ids,
            parts=max(parts, 1),
            stamp=spec.stamp,
            request_id=rid,
            step=spec.step,
        )
        self.history.ops.append(op)
        return op

    async def _op(
        self,
        client: ParameterClient,
        c: ClientPlan,
        target: str,
        lane: int,
        spec: OpSpec,
        known: dict[str, int],
        rid: str = "",
    ) -> bool:
        """Run one op (see the module); answer whether it was ok."""
        op = self._new_op(c, target, lane, spec, rid or (spec.request_ids or ("",))[0])
        call = self._call(client, op, known)
        held = READ_WAIT if op.kind == "read" else BARRIER_WAIT if op.kind == "barrier" else 0.0
        outcomes = []
        for _ in range(1 + spec.retries):
            op.attempts += 1
            try:
                async with asyncio.timeout(OP_DEADLINE + held):
                    await call()
            except CallTimeout as exc:  # (the client's deadline: before the op's, its outcome)
                outcomes.append("indeterminate")
                op.error = f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                outcomes.append("hung")
                op.error = f"no answer within {OP_DEADLINE + held:g} s (attempt {op.attempts})"
                if not self.dumped:  # (the first hang: what every node waits for, in its log)
                    self.dumped = True
                    self.cluster.dump_tasks()
                break
            except ParamSyncError as exc:
                outcome, op.error = outcome_of(exc, op.parts)
                outcomes.append(outcome)
                if outcome == "failed":
                    break
            else:
                outcomes.append("ok")
                break
        op.outcome = merge_outcomes(outcomes)
        op.complete = self.clock()
        if op.outcome == "ok":
            for name, version in op.versions.items():
                known[name] = max(known.get(name, 0), version)
        return op.outcome == "ok"

    def _call(
        self, client: ParameterClient, op: Op, known: dict[str, int]
    ) -> Callable[[], Awaitable[None]]:
        """The op's call (each attempt calls it again), keeping what it answers in ``op``."""
        plan, sizes = self.plan, self.sizes
        table = plan.table
        ids = np.array(op.ids, np.int64)

        async def update() -> None:
            arrays = {n: np.full(sizes[n], op.stamp, np.float32) for n in op.keys}
            op.versions = await client.update_arrays(arrays)

        async def push() -> None:
            grads = {n: np.ones(sizes[n], np.float32) for n in op.keys}
            op.versions = await client.push_gradients(grads, request_id=op.request_id)

        async def row_push() -> None:
            grads = np.ones((len(ids), table.dim), np.float32)
            await client.push_row_gradients(table.name, ids, grads, request_id=op.request_id)

        async def row_pull() -> None:
            rows = await client.pull_rows(table.name, ids)
            op.seen = {str(i): (0, uniform(r.tolist())) for i, r in zip(op.ids, rows, strict=True)}

        async def read() -> None:
            op.min_version = min(known.get(n, 0) for n in op.keys)
            response = await client.get_parameters(list(op.keys), op.min_version, wait=READ_WAIT)
            op.seen = {
                p.name: (p.version, uniform(np.frombuffer(p.data, np.float32).tolist()))
                for p in response.params
            }
            op.versions = {p.name: p.version for p in response.params}

        async def barrier() -> None:
            world = len(plan.clients)
            await client.barrier("chaos", op.client, op.step, world, timeout=BARRIER_WAIT)

        calls = {
            "update": update,
            "push": push,
            "row_push": row_push,
            "row_pull": row_pull,
            "read": read,
            "barrier": barrier,
        }
        return calls[op.kind]
