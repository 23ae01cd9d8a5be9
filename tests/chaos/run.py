"""One randomized run, start to verdict: :func:`run_seed`.

Theory of operation. A run (1) draws its plan from the seed and prints it; (2) starts the
cluster and makes the keys (gradient keys at zeros with their rules, stamped keys at zeros,
the table), acknowledged by every replica; (3) runs the workload and the nemesis together
for the plan's duration; (4) heals (the nemesis's last fault undone, every node that should
be up up) and gives the cluster ``SETTLE_TIMEOUT`` to settle: every member up and seeing the
same members, nothing moving or under-replicated, each key held by exactly its replicas, and
every replica of each key (and of each bucket of rows) holding the same version and bytes,
read at each node alone (``route=False``: its digest, then its own copy); (5) checks the
history against that state (:mod:`.checker`). Its :class:`Result` says what happened in one
line and lists the violations.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cluster_helpers import RETRY_WIRE, eventually, wait_formed, wire_state

from aioparamsync import CallTimeout, ParameterClient, RequestError, adagrad, adam, sgd, sum_rule
from aioparamsync.placement import Placement, bucket_key
from aioparamsync.wire import thrift

from .checker import Final, check
from .cluster import ChaosCluster, Slot
from .history import History
from .nemesis import EVENT_TIMEOUT, Nemesis
from .plan import LEARNING_RATE, Plan, make_plan
from .workload import CONNECT_TIMEOUT, OP_DEADLINE, Workload

__all__ = ["SETTLE_TIMEOUT", "Result", "run_seed"]

SETTLE_TIMEOUT = 45.0  # the heal's bound: the cluster settles and its replicas agree (seconds)
SETUP_TIMEOUT = 30.0  # the cluster forms and the keys are made (seconds)
POLL = 0.3  # (the nodes share 2 cores with the test: poll them gently)
RETRY = (*RETRY_WIRE, CallTimeout, RequestError)


@dataclass
class Result:
    """What one run did: its plan, history, final state and violations."""

    plan: Plan
    history: History
    final: Final
    violations: list[str]

    def report(self) -> str:
        """The run in one line (see :meth:`History.report`)."""
        verdict = f"{len(self.violations)} violations" if self.violations else "ok"
        return f"seed {self.plan.seed}: {self.history.report()} | {verdict}"


def _rule(kind: str) -> Any:
    lr = LEARNING_RATE[kind]
    return {"sum": sum_rule, "sgd": lambda: sgd(lr), "adam": lambda: adam(lr)}[kind]()


def _row_rule(kind: str) -> Any:
    lr = LEARNING_RATE[kind]
    return {"sgd": sgd, "adagrad": adagrad, "adam": adam}[kind](lr)


async def run_seed(seed: int, duration: float, tmp: Path, log_level: str = "warning") -> Result:
    """Run seed ``seed`` for ``duration`` seconds of workload, in directory ``tmp``, the
    nodes logging at ``log_level`` (a failed run keeps their logs there: ``node-*.log``)."""
    plan = make_plan(seed, duration)
    print(f"seed {seed}: {plan.summary()}")
    cluster = ChaosCluster(plan, tmp, log_level)
    history = History()
    failed = True
    try:
        async with asyncio.timeout(SETUP_TIMEOUT):
            await cluster.start()
            await _make_keys(plan, cluster)
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        def clock() -> float:
            return loop.time() - t0

        nemesis = Nemesis(cluster, plan.events, history, clock)
        schedule = asyncio.ensure_future(nemesis.run())
        try:
            async with asyncio.timeout(duration + OP_DEADLINE * 4 + EVENT_TIMEOUT):
                await Workload(plan, cluster, history, clock).run(until=duration)
        finally:
            await nemesis.heal(schedule)
        final = await _settled(plan, cluster)
        final.problems[:0] = nemesis.problems
        result = Result(plan, history, final, check(plan, history, final))
        failed = bool(result.violations)
        return result
    finally:
        if failed:
            cluster.show_logs()
            with contextlib.suppress(OSError):  # (not in place of the run's own error)
                cluster.save_logs(tmp)
        await cluster.close()


async def _make_keys(plan: Plan, cluster: ChaosCluster) -> None:
    """The keys and the table, each replica of them acknowledged, through a routed client."""
    async with contextlib.AsyncExitStack() as stack:
        clients = {
            s.node_id: await stack.enter_async_context(_node_client(s)) for s in cluster.slots
        }
        await wait_formed(clients, timeout=SETUP_TIMEOUT)
        routed = await stack.enter_async_context(
            ParameterClient([s.address for s in cluster.slots], timeout=10.0)
        )
        gradient = {k.name: np.zeros(k.size, np.float32) for k in plan.gradient_keys}
        rules = {k.name: _rule(k.rule) for k in plan.gradient_keys if k.rule is not None}
        stamped = {k.name: np.zeros(k.size, np.float32) for k in plan.stamped_keys}
        table = plan.table

        async def make() -> None:
            await routed.update_arrays(gradient, rules=rules, acks="all")
            await routed.update_arrays(stamped, acks="all")
            await routed.create_table(
                table.name, table.dim, rule=_row_rule(table.rule), buckets=table.buckets
            )

        await eventually(make, timeout=SETUP_TIMEOUT, interval=POLL, retry_on=RETRY)


def _node_client(slot: Slot) -> ParameterClient:
    """A client of that node alone (its own port, not its proxy)."""
    return ParameterClient(slot.address, route=False, timeout=10.0, connect_timeout=CONNECT_TIMEOUT)


async def _settled(plan: Plan, cluster: ChaosCluster) -> Final:
    """The healed cluster's state, once settled (see the module); past ``SETTLE_TIMEOUT``,
    what it holds then, with why it is not settled among its problems."""
    async with contextlib.AsyncExitStack() as stack:
        members = cluster.members()
        clients = {s.node_id: await stack.enter_async_context(_node_client(s)) for s in members}
        try:
            return await eventually(
                lambda: _agreed(plan, clients, strict=True),
                timeout=SETTLE_TIMEOUT,
                interval=POLL,
                retry_on=RETRY,
            )
        except AssertionError as exc:
            final = await eventually(
                lambda: _agreed(plan, clients, strict=False),
                timeout=SETTLE_TIMEOUT,
                interval=POLL,
                retry_on=RETRY,
            )
            final.problems.append(f"not settled {SETTLE_TIMEOUT:g} s after the heal: {exc}")
            return final


async def _agreed(plan: Plan, clients: Mapping[str, ParameterClient], strict: bool) -> Final:
    """Every member settled and every replica equal (``strict``: else the first differences
    are the final state's problems, and each key is as its primary holds it)."""
    live = sorted(clients)
    problems: list[str] = []
    claims: dict[str, dict[str, str]] = {}  # (each member's claims in its topology)
    for node_id, client in clients.items():
        info = await client.info()
        claims[node_id] = dict(info.topology.claims or {})
        states = {m.node_id: m.state for m in info.topology.members}
        up = sorted(m for m, s in states.items() if s == "up")
        if info.state != "up" or up != live:
            problems.append(f"{node_id} is {info.state} and sees {states}")
        elif info.keys_moving or info.under_replicated:
            problems.append(
                f"{node_id}: {info.keys_moving} keys moving, {info.under_replicated} "
                "under-replicated"
            )
    # (placement balanced by bytes: the keys members claimed, the same seen from every member)
    claimed = next(iter(claims.values()), {})
    if any(c != claimed for c in claims.values()):
        problems.append(f"members see other claims: {claims}")
    placement = Placement(live, plan.replication, claimed)
    states = {node_id: await wire_state(client) for node_id, client in clients.items()}
    final = Final()
    for name in sorted({n for s in states.values() for n in s}):
        replicas = placement.replicas(name)
        held = {m: s[name] for m, s in states.items() if name in s}
        if set(held) != set(replicas):
            problems.append(f"{name!r} held by {sorted(held)}, placed at {sorted(replicas)}")
        values = {m: held[m] for m in replicas if m in held}
        if len(set(values.values())) > 1:
            problems.append(
                f"{name!r}: replicas differ: "
                + ", ".join(f"{m} v{v[0]} from {v[1]}" for m, v in sorted(values.items()))
            )
        if values:
            final.params[name] = next(iter(values.values()))  # (the primary's: replicas first)
    final.rows, row_problems = await _rows(plan, clients, placement)
    problems += row_problems
    if strict:
        assert not problems, "; ".join(problems[:6])
    final.problems = problems
    return final


async def _rows(
    plan: Plan, clients: Mapping[str, ParameterClient], placement: Placement
) -> tuple[dict[int, tuple[int, tuple[float, ...]]], list[str]]:
    """Each row's (version, values), as the replicas of its bucket hold it (its primary's
    copy), and where they differ."""
    table, rows, problems = plan.table, {}, []
    for bucket in range(table.buckets):
        copies = {}
        for member in placement.replicas(bucket_key(table.name, bucket)):
            request = thrift.BucketRequest(table=table.name, bucket=bucket)
            delta = await clients[member].call("bucket_rows", request=request)
            ids = np.frombuffer(delta.ids, "<i8").tolist()
            versions = np.frombuffer(delta.versions, "<i8").tolist()
            values = np.frombuffer(delta.rows, "<f4").reshape(-1, table.dim).tolist()
            copies[member] = {
                i: (v, tuple(r)) for i, v, r in zip(ids, versions, values, strict=True)
            }
        first = next(iter(copies.values()))
        for member, copy in copies.items():
            if copy != first:
                differ = sorted(i for i in set(copy) | set(first) if copy.get(i) != first.get(i))
                problems.append(
                    f"bucket {bucket} of {table.name!r}: {member} differs from "
                    f"{next(iter(copies))} at {len(differ)} rows: "
                    + ", ".join(
                        f"row {i} {_row(copy.get(i))} vs {_row(first.get(i))}" for i in differ[:4]
                    )
                )
        rows.update(first)
    return rows, problems


def _row(copy: tuple[int, tuple[float, ...]] | None) -> str:
    """A row's copy in a few words: its version and first value (or that it is missing)."""
    return "missing" if copy is None else f"v{copy[0]} {copy[1][0]:g}"
