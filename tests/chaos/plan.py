"""The generator: one seed, one plan of a randomized cluster run (pure: no I/O, no asyncio).

Theory of operation. :func:`make_plan` draws everything from ``random.Random(seed)``, in a
fixed order: the cluster (N nodes, R, ``--acks``, a coordinator or not, data directories,
the failure timeout), the keys (dense parameters folded by a gradient rule, parameters
written whole, one embedding table), the clients (each routed by the topology or pinned to
one node, ``route=False``, each with lanes of operations run one after another, lanes at
once), and the nemesis's schedule of faults. The same seed and duration make the same plan
on any machine; what real processes make of it (the interleavings, the timings) is the
machine's: a replay runs the same plan, not the same bytes at the same instants.

The values are chosen so that a checker can count: every gradient is ones, so a parameter
that starts at zeros holds a whole number of folds (``sum``: +1 each, ``sgd(lr=0.5)``: -0.5,
``adam(lr=1)``: about -1 whatever its state), and a row's version is its folds; every whole
write holds one stamp, unique in the run, in every element.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "EVENT_KINDS",
    "OP_KINDS",
    "Event",
    "Key",
    "OpSpec",
    "Plan",
    "TableSpec",
    "make_plan",
]

#: what the nemesis can do (see :mod:`.nemesis`)
EVENT_KINDS = ("kill", "join", "drain", "cut", "delay", "etcd")
#: what a client lane can do (see :mod:`.workload`)
OP_KINDS = ("update", "push", "burst", "row_push", "row_pull", "read", "barrier")

# Dense rules and their learning rates (see the module: each fold of ones moves a value by
# a whole step). Rows fold by sgd, adagrad or adam (no sum).
PARAM_RULES = ("sum", "sgd", "adam")
ROW_RULES = ("sgd", "adagrad", "adam")
LEARNING_RATE = {"sum": 1.0, "sgd": 0.5, "adam": 1.0, "adagrad": 1.0}

# How often each operation is drawn (a burst is many pushes at once: the writers that
# meet at different nodes; a barrier is not drawn, it comes every BARRIER_EVERY ops).
OP_WEIGHTS = {"update": 20, "push": 25, "burst": 8, "row_push": 20, "row_pull": 10, "read": 15}
BARRIER_EVERY = 20
# Operations drawn per lane and second of the run: more than a lane gets through.
OPS_PER_SECOND = 40
MAX_THINK = 0.04  # the longest pause before an operation (seconds)
MAX_BURST = 12  # the most pushes a burst sends at once
MAX_RETRIES = 2  # the most times a push of unknown outcome is sent again under its id
QUIET_START = (1.0, 2.0)  # no fault before this (seconds)
MAX_EVENTS = 3
MAX_NODES = 6  # the initial nodes and a joiner, at most
DATA_DIR_ODDS = 0.3  # without a kill, the odds of data directories anyway
COORDINATOR_ODDS = 0.3
BARRIER_ODDS = 0.5


@dataclass(frozen=True)
class Key:
    """A dense parameter: ``rule`` folds its gradients, or None: written whole (stamped)."""

    name: str
    rule: str | None
    size: int  # float32 elements


@dataclass(frozen=True)
class TableSpec:
    """The run's embedding table (rows of ``dim`` float32, zeros until folded)."""

    name: str
    rule: str
    dim: int
    buckets: int
    ids: int  # row ids drawn from range(ids)


@dataclass(frozen=True)
class OpSpec:
    """One operation of a lane (what it does; the history records what it did).

    ``request_ids``: one per push a ``burst`` sends (one for ``push``, ``row_push``), each
    unique in the run; ``retries``: times it is sent again, under the same id, after an
    answer that leaves its outcome unknown.
    """

    kind: str
    think: float
    keys: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    stamp: int = 0
    request_ids: tuple[str, ...] = ()
    retries: int = 0
    step: int = 0


@dataclass(frozen=True)
class ClientPlan:
    """A client: ``pinned`` to a node (its index, ``route=False``) or routed (None)."""

    name: str
    pinned: int | None
    lanes: tuple[tuple[OpSpec, ...], ...]


@dataclass(frozen=True)
class Event:
    """A fault: at ``at`` seconds into the workload, for ``hold`` seconds.

    ``node`` (and ``other``, for a cut) are node indexes: 0..N-1 the initial nodes, N the
    one a join starts. ``latency``: a delay's, per chunk forwarded (seconds).
    """

    kind: str
    at: float
    hold: float = 0.0
    node: int = -1
    other: int = -1
    latency: float = 0.0

    def describe(self) -> str:
        where = {
            "kill": f"n{self.node} down {self.hold:.1f}s",
            "join": f"n{self.node} joins",
            "drain": f"n{self.node} drained",
            "cut": f"link n{self.node}-n{self.other} cut {self.hold:.1f}s",
            "delay": f"links into n{self.node} +{self.latency * 1000:.0f}ms for {self.hold:.1f}s",
            "etcd": f"etcd down {self.hold:.1f}s",
        }[self.kind]
        return f"{where} at {self.at:.1f}s"


@dataclass(frozen=True)
class Plan:
    """Everything one run does, drawn from ``seed`` (see the module)."""

    seed: int
    duration: float
    nodes: int
    replication: int
    acks: str
    coordinator: bool
    data_dir: bool
    failure_timeout: float
    keys: tuple[Key, ...]
    table: TableSpec
    clients: tuple[ClientPlan, ...]
    events: tuple[Event, ...]
    barriers: bool

    @property
    def proxies(self) -> bool:
        """Whether the nodes' peer links go through proxies (a cut or a delay needs them)."""
        return any(e.kind in ("cut", "delay") for e in self.events)

    @property
    def gradient_keys(self) -> tuple[Key, ...]:
        return tuple(k for k in self.keys if k.rule is not None)

    @property
    def stamped_keys(self) -> tuple[Key, ...]:
        return tuple(k for k in self.keys if k.rule is None)

    def features(self) -> set[str]:
        """What the plan exercises, as words (``acks=all``, ``fault=kill``, ``pinned``...):
        a fixed set of seeds is chosen to cover them."""
        found = {
            f"nodes={self.nodes}",
            f"R={self.replication}",
            f"acks={self.acks}",
            f"rows={self.table.rule}",
            "coordinator" if self.coordinator else "peers",
            *("routed" if c.pinned is None else "pinned" for c in self.clients),
            *(f"rule={k.rule}" for k in self.gradient_keys),
        }
        faults = {e.kind for e in self.events} or {"none"}
        found |= {f"fault={k}" for k in faults}
        found |= {f"acks={self.acks}+{k}" for k in faults}  # (each fault under each --acks)
        if self.coordinator:
            found |= {f"coordinator+{k}" for k in faults}
        if self.barriers:
            found.add("barriers")
        pinned = {c.pinned for c in self.clients if c.pinned is not None}
        if len(pinned) > 1 and self.acks == "all" and self.replication > 1:
            found.add("writers at several nodes, acks=all")
        return found

    def summary(self) -> str:
        """One line: the cluster, the clients, the faults."""
        clients = ",".join("routed" if c.pinned is None else f"n{c.pinned}" for c in self.clients)
        lanes = sum(len(c.lanes) for c in self.clients)
        rules = "/".join(sorted({k.rule for k in self.gradient_keys if k.rule}))
        events = "; ".join(e.describe() for e in self.events) or "none"
        return (
            f"N={self.nodes} R={self.replication} acks={self.acks}"
            f"{' coordinator' if self.coordinator else ''}"
            f"{' data-dir' if self.data_dir else ''} failure-timeout={self.failure_timeout:g}s"
            f" | {len(self.gradient_keys)} gradient keys ({rules}),"
            f" {len(self.stamped_keys)} stamped, table {self.table.rule}"
            f" x{self.table.buckets} buckets | clients {clients} ({lanes} lanes)"
            f"{' barriers' if self.barriers else ''} | nemesis: {events}"
        )


def make_plan(seed: int, duration: float) -> Plan:
    """The plan of seed ``seed`` for a workload of ``duration`` seconds (see the module).

    Raises:
        ValueError: ``seed`` not an int >= 0, or ``duration`` not a number of seconds > 0.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"a seed is an int >= 0, not {seed!r}")
    if (
        isinstance(duration, bool)
        or not isinstance(duration, (int, float))
        or not 0 < duration < math.inf
    ):
        raise ValueError(f"a duration is a number of seconds above 0, not {duration!r}")
    rng = random.Random(seed)
    nodes = rng.randint(3, 5)
    replication = rng.choice([1, 2, 2, 3])
    acks = rng.choice(["1", "all"])
    coordinator = rng.random() < COORDINATOR_ODDS
    failure_timeout = 3.0 if coordinator else rng.choice([2.0, 3.0, 5.0])

    keys = [
        Key(f"g{i:02d}", rng.choice(PARAM_RULES), rng.choice([4, 16]))
        for i in range(rng.randint(6, 24))
    ]
    keys += [Key(f"u{i:02d}", None, rng.choice([4, 16])) for i in range(rng.randint(3, 10))]
    table = TableSpec(
        "emb",
        rng.choice(ROW_RULES),
        dim=4,
        buckets=rng.choice([4, 8, 16]),
        ids=rng.randint(32, 128),
    )
    events = _events(rng, duration, nodes, replication, coordinator)
    barriers = rng.random() < BARRIER_ODDS

    counter = iter(range(1, 1 << 30))  # stamps and request ids: unique in the run
    gradient = [k.name for k in keys if k.rule is not None]
    stamped = [k.name for k in keys if k.rule is None]
    count = rng.randint(2, 4)
    order = list(range(nodes))
    rng.shuffle(order)
    clients = []
    for c in range(count):
        pinned = order[c % nodes] if rng.random() < 0.6 else None
        lanes = tuple(
            tuple(
                _ops(rng, counter, seed, gradient, stamped, table, duration, lane == 0 and barriers)
            )
            for lane in range(rng.randint(1, 3))
        )
        clients.append(ClientPlan(f"c{c}", pinned, lanes))

    return Plan(
        seed=seed,
        duration=float(duration),
        nodes=nodes,
        replication=replication,
        acks=acks,
        coordinator=coordinator,
        data_dir=any(e.kind == "kill" for e in events) or rng.random() < DATA_DIR_ODDS,
        failure_timeout=failure_timeout,
        keys=tuple(keys),
        table=table,
        clients=tuple(clients),
        events=tuple(events),
        barriers=barriers,
    )


def _events(
    rng: random.Random, duration: float, nodes: int, replication: int, coordinator: bool
) -> list[Event]:
    """The nemesis's faults: one after another (never two at once), each bounded, all
    ending half a second before the workload does."""
    members = list(range(nodes))  # nodes that are (or will be again) members
    slots = nodes
    events: list[Event] = []
    at = rng.uniform(*QUIET_START)
    for _ in range(rng.choice(range(MAX_EVENTS + 1))):
        kinds = ["kill", "cut", "delay"]
        if slots < MAX_NODES and not any(e.kind == "join" for e in events):
            kinds.append("join")
        # (a drain leaves R copies and two nodes; node 0 stays: it is every restart's seed)
        if len(members) > max(replication, 2) and len(members) > 2:
            kinds.append("drain")
        if coordinator:
            kinds.append("etcd")
        kind = rng.choice(kinds)
        hold = 0.0 if kind in ("join", "drain") else rng.uniform(0.5, 4.0)
        if at + hold > duration - 0.5:
            break
        if kind == "join":
            event = Event(kind, at, node=slots)
            members.append(slots)
            slots += 1
        elif kind == "drain":
            node = rng.choice(members[1:])
            members.remove(node)
            event = Event(kind, at, node=node)
        elif kind == "cut":
            a, b = rng.sample(members, 2)
            event = Event(kind, at, hold, node=a, other=b)
        elif kind == "delay":
            event = Event(kind, at, hold, node=rng.choice(members), latency=rng.uniform(0.02, 0.2))
        elif kind == "kill":
            event = Event(kind, at, hold, node=rng.choice(members))
        else:
            event = Event(kind, at, hold)
        events.append(event)
        # (a join or a drain takes a while: the next fault waits for it too, see nemesis)
        at += hold + rng.uniform(0.5, 2.0)
    return events


def _ops(
    rng: random.Random,
    counter: Iterator[int],
    seed: int,
    gradient: Sequence[str],
    stamped: Sequence[str],
    table: TableSpec,
    duration: float,
    barriers: bool,
) -> list[OpSpec]:
    kinds, weights = zip(*OP_WEIGHTS.items(), strict=True)
    ops = []
    for i in range(int(duration * OPS_PER_SECOND)):
        think = rng.uniform(0, MAX_THINK)
        if barriers and i % BARRIER_EVERY == BARRIER_EVERY - 1:
            ops.append(OpSpec("barrier", think, step=i // BARRIER_EVERY + 1))
            continue
        kind = rng.choices(kinds, weights)[0]

        def rid() -> str:
            return f"{seed:x}-{next(counter)}"

        def some(names: Sequence[str], most: int) -> tuple[str, ...]:
            if rng.random() < 0.3:
                return tuple(names)
            return tuple(sorted(rng.sample(names, rng.randint(1, min(most, len(names))))))

        retries = rng.choice([0, 0, 1, MAX_RETRIES])
        if kind == "update":
            op = OpSpec(
                kind,
                think,
                keys=tuple(sorted(rng.sample(stamped, rng.randint(1, 3)))),
                stamp=next(counter),
            )
        elif kind == "push":
            op = OpSpec(kind, think, keys=some(gradient, 4), request_ids=(rid(),), retries=retries)
        elif kind == "burst":
            keys = some(gradient, len(gradient))
            op = OpSpec(
                kind,
                think,
                keys=keys,
                request_ids=tuple(rid() for _ in range(rng.randint(2, MAX_BURST))),
            )
        elif kind == "row_push":
            ids = tuple(sorted(rng.sample(range(table.ids), rng.randint(1, 8))))
            op = OpSpec(kind, think, ids=ids, request_ids=(rid(),), retries=retries)
        elif kind == "row_pull":
            op = OpSpec(kind, think, ids=tuple(rng.sample(range(table.ids), rng.randint(1, 8))))
        else:
            op = OpSpec(kind, think, keys=tuple(sorted(rng.sample(stamped, rng.randint(1, 3)))))
        ops.append(op)
    return ops
