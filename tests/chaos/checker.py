"""The checker: what a run's history and the healed cluster's state must satisfy (pure).

Theory of operation. :func:`check` reads the plan, the history (:mod:`.history`) and the final
state (:class:`Final`: each key as its replicas agree on it after the heal, each row, and what
the agreement check found) and answers every violation, each naming the op or key:

- **Nothing hangs.** An op without an answer within its deadline is a violation by itself.
- **Nothing fails without a fault near.** An op that is not ok while no fault was active (from
  a fault's start to its heal plus ``grace``: links retry within 5 s, a member is declared
  failed after ``--failure-timeout``) is a violation; so is a node's failure (``ServerError``)
  at any time. (Excused: an op sent to a node after it was drained; a barrier that timed out
  while a worker had not come.)
- **Every acknowledged gradient folded exactly once.** Gradients are ones and values start at
  zero, so each gradient key holds a whole number of folds: per key, ``firm <= folds <= acked +
  unknown``, where ``firm`` counts acknowledged pushes that no documented gap excuses (below),
  ``unknown`` the pushes of unknown outcome (and those a gap may fold twice); a push known
  refused is never folded. The same per row of the table, by the row's version (its folds) and,
  for ``sgd`` and ``adam``, by its values too.
- **Every acknowledged whole write is the final value, or was overwritten by a later one.** Each
  write stamps its value; the final value must be a stamp of a write not refused, and no firm
  acknowledged write may have been invoked after the final one was acknowledged; the final
  version is no lower than any firm acknowledged one. (Not the order with ``--acks 1``: any
  replica applies a write, so one acknowledged by a replica that had not yet received an
  earlier write makes the same version, and last-writer-wins may keep the earlier one.)
- **Reads see what was written.** A read answers versions >= its ``min_version``, values that
  were written (no torn arrays, no stamp from a write invoked after the read ended), and a row
  pull no more folds than were pushed (and folded twice where a gap allows it, below).
- **Barriers.** A barrier released at a step only once every worker had arrived at it.
- **Replicas agree after the heal** (``Final.problems``, found by :mod:`.run`).

The documented gaps (README: "Joining, leaving, failing", "What a partition does, and the
coordinator") excuse an acknowledged write from surviving when it overlaps a window: a fault's
start (less ``LAG`` with ``--acks 1``, for what had not reached the replicas yet) to its heal
plus ``grace``. With ``--acks 1``: every fault but a delay (a primary's writes its replicas never
got). With ``--acks all`` and no coordinator: a kill and a cut (nodes that disagree on who is
primary take writes for a while; a partition is not fenced). With a coordinator: rows alone
under a kill, a cut or etcd's loss (rows merge by their count of folds). A push may be folded
twice when a kill, a drain or (without a coordinator) a cut overlaps it: the request ids a node
has seen are in its memory only (docs/training.md, "Retried safely").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .history import Fault, History, Op
from .plan import LEARNING_RATE, Plan

__all__ = ["LAG", "LINK_BACKOFF", "Final", "check", "folds_of", "uniform"]

LINK_BACKOFF = 5.0  # the longest a peer link waits before it connects again (links.BACKOFF_MAX)
LAG = 3.0  # with --acks 1: how far before a fault an acknowledged write may not have replicated
TOLERANCE = 1e-3  # a value's distance from a whole number of folds (adam's are not exact)
MAX_SHOWN = 12  # violations of one kind shown (the rest are counted)


@dataclass
class Final:
    """The cluster after the heal: ``params``: name -> (version, origin, bytes), as the
    replicas hold it; ``rows``: row id -> (version, values); ``problems``: where replicas
    disagreed or the cluster did not settle."""

    params: dict[str, tuple[int, str, bytes]] = field(default_factory=dict)
    rows: dict[int, tuple[int, tuple[float, ...]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def uniform(values: Iterable[float]) -> float | None:
    """The one number every element holds, or None when they differ (a torn value)."""
    values = list(values)
    if not values or any(v != values[0] for v in values):
        return None
    return float(values[0])


def folds_of(rule: str, value: float) -> tuple[int, bool]:
    """How many folds of ones from zero make ``value`` under ``rule``, and whether it is
    that whole number (within ``TOLERANCE``). Not for adagrad, whose steps shrink."""
    step = 1.0 if rule == "sum" else -LEARNING_RATE[rule]
    estimate = value / step
    if not math.isfinite(estimate):
        return 0, False
    count = round(estimate)
    return count, abs(estimate - count) <= TOLERANCE * max(1, abs(count))


def check(plan: Plan, history: History, final: Final) -> list[str]:
    """Every violation of the run (see the module), worst first; empty when it passed."""
    gaps = Gaps(plan, history.faults)
    found = [
        *_hangs(history.ops),
        *_errors(history.ops, gaps, len(plan.clients)),
        *_gradients(plan, history.ops, final, gaps),
        *_stamps(plan, history.ops, final, gaps),
        *_rows(plan, history.ops, final, gaps),
        *_reads(plan, history.ops, gaps),
        *_barriers(history.ops, len(plan.clients)),
        *final.problems,
    ]
    return found


class Gaps:
    """The windows of a run's faults (see the module): when an op is excused."""

    def __init__(self, plan: Plan, faults: Sequence[Fault]) -> None:
        self.grace = plan.failure_timeout + LINK_BACKOFF
        self.faults = list(faults)
        if plan.acks == "1":
            lost = {"kill", "cut", "join", "drain", "etcd"}
            self.lost_params, self.lost_rows, self.before = lost, lost, LAG
        elif plan.coordinator:
            self.lost_params, self.lost_rows, self.before = set(), {"kill", "cut", "etcd"}, 0.0
        else:
            self.lost_params, self.lost_rows, self.before = {"kill", "cut"}, {"kill", "cut"}, 0.0
        # (a drained node's memory of request ids goes with it, as a killed one's)
        self.twice_kinds = {"kill", "drain"} if plan.coordinator else {"kill", "cut", "drain"}
        self.ordered = plan.acks == "all"  # (see the module: whole writes' order)

    def _overlaps(self, op: Op, kinds: set[str], before: float = 0.0) -> bool:
        end = math.inf if op.complete is None else op.complete
        for f in self.faults:
            if f.kind in kinds:
                healed = math.inf if f.end is None else f.end + self.grace
                if op.invoke <= healed and end >= f.start - before:
                    return True
        return False

    def quiet(self, op: Op) -> bool:
        """No fault was active (or settling) while ``op`` ran."""
        return not self._overlaps(op, {f.kind for f in self.faults})

    def lost(self, op: Op, rows: bool = False) -> bool:
        """A documented gap may lose ``op``'s acknowledged effect."""
        return self._overlaps(op, self.lost_rows if rows else self.lost_params, self.before)

    def twice(self, op: Op) -> bool:
        """A documented gap may fold ``op`` twice."""
        return self._overlaps(op, self.twice_kinds)

    def left(self, op: Op) -> bool:
        """``op`` went to a node after that node was drained (it answers no more)."""
        return any(
            f.kind == "drain" and op.target in f.nodes and op.invoke >= f.start for f in self.faults
        )


def _shown(kind: str, found: list[str]) -> list[str]:
    if len(found) <= MAX_SHOWN:
        return found
    return [*found[:MAX_SHOWN], f"... and {len(found) - MAX_SHOWN} more {kind}"]


def _hangs(ops: Sequence[Op]) -> list[str]:
    return _shown(
        "hangs", [f"{op.describe()} hung: {op.error}" for op in ops if op.outcome == "hung"]
    )


def _errors(ops: Sequence[Op], gaps: Gaps, world: int) -> list[str]:
    found = []
    arrived = _barrier_arrivals(ops)
    for op in ops:
        if op.outcome in ("ok", "hung"):
            continue
        if op.error.startswith("ServerError"):
            found.append(f"{op.describe()}: the node failed: {op.error}")
            continue
        if not gaps.quiet(op) or gaps.left(op):
            continue
        if op.kind == "barrier":
            came = arrived.get(op.step, [])
            if len([t for t in came if t <= (op.complete or math.inf)]) < world:
                continue  # (a worker had not come: a timeout is the answer)
        found.append(f"{op.describe()} {op.outcome} with no fault near: {op.error}")
    return _shown("errors", found)


def _pushes_of(ops: Sequence[Op], kind: str) -> list[Op]:
    return [op for op in ops if op.kind == kind]


@dataclass
class _Tally:
    """Pushes that touched one key (or row): see the module."""

    acked: int = 0
    firm: int = 0
    unknown: int = 0
    twice: int = 0

    def add(self, op: Op, gaps: Gaps, rows: bool) -> None:
        if op.outcome == "ok":
            self.acked += 1
            if not gaps.lost(op, rows):
                self.firm += 1
        elif op.outcome in ("indeterminate", "hung"):
            self.unknown += 1
        if op.outcome != "failed" and gaps.twice(op):
            self.twice += 1

    def bounds(self) -> tuple[int, int]:
        return self.firm, self.acked + self.unknown + self.twice

    def explain(self) -> str:
        return (
            f"{self.acked} pushes acknowledged ({self.firm} outside the documented gaps), "
            f"{self.unknown} of unknown outcome, {self.twice} the gaps may fold twice"
        )


def _held(
    final: Final, name: str, label: str, torn: str, found: list[str]
) -> tuple[str, int, float] | None:
    """(``label`` with its version and origin, its version, its one value) of key ``name``
    after the heal; None, told in ``found``, when it is missing or its elements differ."""
    if name not in final.params:
        found.append(f"{label} is missing after the heal")
        return None
    version, origin, data = final.params[name]
    where = f"{label} v{version} from {origin}"
    value = uniform(np.frombuffer(data, np.float32).tolist())
    if value is None:
        found.append(f"{where}: its elements differ ({torn})")
        return None
    return where, version, value


def _gradients(plan: Plan, ops: Sequence[Op], final: Final, gaps: Gaps) -> list[str]:
    found = []
    tallies = {k.name: _Tally() for k in plan.gradient_keys}
    for op in _pushes_of(ops, "push"):
        for name in op.keys:
            tallies[name].add(op, gaps, rows=False)
    for key in plan.gradient_keys:
        tally = tallies[key.name]
        held = _held(final, key.name, f"{key.name!r} ({key.rule})", "a fold applied in part", found)
        if held is None:
            continue
        where, _, value = held
        assert key.rule is not None
        folds, whole = folds_of(key.rule, value)
        if not whole:
            found.append(f"{where} holds {value}, not a whole number of folds")
            continue
        low, high = tally.bounds()
        if folds < low:
            found.append(
                f"{where} holds {folds} folds: {low - folds} acknowledged lost; {tally.explain()}"
            )
        elif folds > high:
            found.append(
                f"{where} holds {folds} folds: {folds - high} more than pushed; {tally.explain()}"
            )
    return _shown("gradient keys", found)


def _stamps(plan: Plan, ops: Sequence[Op], final: Final, gaps: Gaps) -> list[str]:
    found = []
    writes: dict[str, list[Op]] = {k.name: [] for k in plan.stamped_keys}
    by_stamp: dict[int, Op] = {}
    for op in _pushes_of(ops, "update"):
        by_stamp[op.stamp] = op
        for name in op.keys:
            writes[name].append(op)
    for key in plan.stamped_keys:
        held = _held(final, key.name, repr(key.name), "a torn write", found)
        if held is None:
            continue
        where, version, value = held
        stamp = int(value)
        last = by_stamp.get(stamp)
        if stamp != value or (stamp != 0 and (last is None or key.name not in last.keys)):
            found.append(f"{where} holds {value}, which no write of it had")
            continue
        if last is not None and last.outcome == "failed":
            found.append(f"{where} holds the write of {last.describe()}, which was refused")
            continue
        # (the initial write was acknowledged before the workload: at -inf)
        done = -math.inf if last is None else last.complete
        acked = last is None or last.outcome == "ok"
        for w in writes[key.name]:
            if w.outcome != "ok" or gaps.lost(w):
                continue
            if gaps.ordered and acked and done is not None and done < w.invoke:
                what = "the initial write" if last is None else last.describe()
                found.append(
                    f"{where}: acknowledged {w.describe()} lost: the key holds {what}, "
                    f"acknowledged before it was invoked"
                )
                break
            if w.versions.get(key.name, 0) > version:
                found.append(
                    f"{where}: acknowledged {w.describe()} made v{w.versions[key.name]}, "
                    "higher than the final version"
                )
                break
    return _shown("stamped keys", found)


def _rows(plan: Plan, ops: Sequence[Op], final: Final, gaps: Gaps) -> list[str]:
    found = []
    table = plan.table
    tallies: dict[int, _Tally] = {}
    for op in _pushes_of(ops, "row_push"):
        for i in op.ids:
            tallies.setdefault(i, _Tally()).add(op, gaps, rows=True)
    for i in sorted(set(tallies) | set(final.rows)):
        tally = tallies.get(i, _Tally())
        version, values = final.rows.get(i, (0, (0.0,) * table.dim))
        where = f"row {i} of {table.name!r} ({table.rule}) v{version}"
        value = uniform(values)
        if value is None:
            found.append(f"{where}: its elements differ (a fold applied in part)")
            continue
        if table.rule != "adagrad":
            folds, whole = folds_of(table.rule, value)
            if not whole or folds != version:
                found.append(f"{where} holds {value}: not its {version} folds")
                continue
        low, high = tally.bounds()
        if version < low:
            found.append(f"{where}: {low - version} acknowledged folds lost; {tally.explain()}")
        elif version > high:
            found.append(f"{where}: {version - high} folds more than pushed; {tally.explain()}")
    return _shown("rows", found)


def _reads(plan: Plan, ops: Sequence[Op], gaps: Gaps) -> list[str]:
    found = []
    by_stamp = {op.stamp: op for op in _pushes_of(ops, "update")}
    pushes = _pushes_of(ops, "row_push")
    for op in ops:
        if op.outcome != "ok":
            continue
        if op.kind == "read":
            for name, (version, value) in op.seen.items():
                where = f"{op.describe()} read {name!r} v{version}"
                if version < op.min_version:
                    found.append(f"{where}, below its min_version {op.min_version}")
                elif value is None:
                    found.append(f"{where}: its elements differ (a torn read)")
                elif value != 0:
                    w = by_stamp.get(int(value))
                    if w is None or name not in w.keys or w.outcome == "failed":
                        found.append(f"{where}: {value}, which no write of it had (not refused)")
                    elif w.invoke > (op.complete or math.inf):
                        found.append(f"{where}: the write of {w.describe()}, invoked after")
        elif op.kind == "row_pull" and plan.table.rule != "adagrad":
            for rid, (_, value) in op.seen.items():
                where = f"{op.describe()} read row {rid}"
                if value is None:
                    found.append(f"{where}: its elements differ (a torn read)")
                    continue
                folds, whole = folds_of(plan.table.rule, value)
                before = [p for p in pushes if int(rid) in p.ids and p.invoke <= (op.complete or 0)]
                # (and those a documented gap may fold twice, as the final rows allow)
                twice = sum(1 for p in before if p.outcome != "failed" and gaps.twice(p))
                if not whole or folds > len(before) + twice:
                    found.append(
                        f"{where} = {value}: {folds} folds, {len(before)} pushed by then"
                        + (f" ({twice} a gap may fold twice)" if twice else "")
                    )
    return _shown("reads", found)


def _barrier_arrivals(ops: Sequence[Op]) -> dict[int, list[float]]:
    arrived: dict[int, list[float]] = {}
    for op in ops:
        if op.kind == "barrier":
            arrived.setdefault(op.step, []).append(op.invoke)
    return arrived


def _barriers(ops: Sequence[Op], world: int) -> list[str]:
    found = []
    arrived = _barrier_arrivals(ops)
    for op in ops:
        if op.kind == "barrier" and op.outcome == "ok":
            came = [t for t in arrived.get(op.step, []) if t <= (op.complete or math.inf)]
            if len(came) < world:
                found.append(
                    f"{op.describe()} passed step {op.step} when {len(came)} of {world} "
                    "workers had come"
                )
    return _shown("barriers", found)
