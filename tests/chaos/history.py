"""The history of a run: every operation as it was invoked and as it ended, and every fault.

Theory of operation. Each operation of a client lane is one :class:`Op`: the seconds since
the workload began (the test's loop clock) at which it was invoked and at which it
completed, and its outcome, one of

- ``ok``: answered; its effect is applied (acknowledged);
- ``failed``: refused (:class:`~aioparamsync.RequestError`) by a call of one part (one key,
  one bucket): known not applied;
- ``indeterminate``: a timeout, a broken connection, a node's failure, an
  :class:`~aioparamsync.Indeterminate` (applied, but not confirmed), or a refusal of a call
  cut in parts (the other parts may have been folded: see ``push_gradients``): applied or not;
- ``hung``: no answer within its deadline (``OP_DEADLINE``): indeterminate for what it did,
  and a failure of the run by itself.

A push sent again under its request id (after an outcome it could not know) is one op with
several attempts: ok if one attempt was, failed if every one was known not applied, else
indeterminate. What the nemesis did is a list of :class:`Fault`: its kind, the node ids it
touched, when it began and when it was healed. Nothing here knows of the cluster: the
workload and the nemesis write it, the checker (:mod:`.checker`) reads it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aioparamsync import CallTimeout, Indeterminate, NetworkError, RequestError, ServerError

__all__ = ["OUTCOMES", "Fault", "History", "Op", "merge_outcomes", "outcome_of"]

OUTCOMES = ("ok", "failed", "indeterminate", "hung")


@dataclass
class Op:
    """One operation, as the history keeps it (see the module).

    ``target``: ``"routed"``, or the id of the node the client is pinned to. ``parts``:
    the keys (or the table's buckets) it touches. What an ok op answered: ``versions``
    (writes), ``seen`` (a read: name -> (version, value); a row pull: str(id) -> (0,
    value)), where a value is the one number every element holds, or None when they
    differ.
    """

    index: int
    client: str
    lane: int
    kind: str
    target: str
    invoke: float
    keys: tuple[str, ...] = ()
    ids: tuple[int, ...] = ()
    parts: int = 1
    stamp: int = 0
    request_id: str = ""
    step: int = 0
    min_version: int = 0
    complete: float | None = None
    outcome: str = "pending"
    error: str = ""
    attempts: int = 0
    versions: dict[str, int] = field(default_factory=dict)
    seen: dict[str, tuple[int, float | None]] = field(default_factory=dict)

    def describe(self) -> str:
        """The op in a few words: ``#12 push[g01,g02] by c1@n2 at 3.10s``."""
        what = ",".join(self.keys) if self.keys else ",".join(map(str, self.ids))
        if len(what) > 40:
            what = what[:37] + "..."
        rid = f" id {self.request_id}" if self.request_id else ""
        who = f"{self.client}@{self.target}"
        return f"#{self.index} {self.kind}[{what}]{rid} by {who} at {self.invoke:.2f}s"


@dataclass
class Fault:
    """A fault the nemesis made: ``nodes`` by id, from ``start`` until healed at ``end``."""

    kind: str
    nodes: tuple[str, ...]
    start: float
    end: float | None = None
    note: str = ""

    def describe(self) -> str:
        end = "never healed" if self.end is None else f"{self.end:.2f}s"
        return f"{self.kind} {','.join(self.nodes)} {self.start:.2f}s-{end} {self.note}".rstrip()


def outcome_of(exc: BaseException, parts: int) -> tuple[str, str]:
    """An exception's outcome (see the module) and its text, for a call of ``parts`` parts.

    Raises:
        BaseException: ``exc`` itself, when it is none of the client's errors (a bug of
            the harness must not pass for the cluster's).
    """
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, Indeterminate):
        return "indeterminate", text  # (applied, or not: the node cannot know)
    if isinstance(exc, RequestError):
        return ("failed" if parts == 1 else "indeterminate"), text
    if isinstance(exc, (CallTimeout, NetworkError, ServerError)):
        return "indeterminate", text
    raise exc


def merge_outcomes(outcomes: list[str]) -> str:
    """The outcome of an op sent several times under one request id (see the module)."""
    if "ok" in outcomes:
        return "ok"
    if "hung" in outcomes:
        return "hung"
    if all(o == "failed" for o in outcomes):
        return "failed"
    return "indeterminate"


@dataclass
class History:
    """Every op and fault of one run."""

    ops: list[Op] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """How many ops ended each way (``OUTCOMES``), and ``ops`` in all."""
        counts = dict.fromkeys(OUTCOMES, 0)
        for op in self.ops:
            counts[op.outcome] = counts.get(op.outcome, 0) + 1
        counts["ops"] = len(self.ops)
        return counts

    def report(self) -> str:
        """One line: ops, acknowledged, failed, indeterminate, hung, the faults."""
        c = self.counts()
        faults = "; ".join(f.describe() for f in self.faults) or "none"
        return (
            f"ops {c['ops']}: acked {c['ok']}, failed {c['failed']}, "
            f"indeterminate {c['indeterminate']}, hung {c['hung']} | faults: {faults}"
        )

    def dump(self, path: Path) -> None:
        """Write the history as JSON (for a look at a failed run)."""
        data = {"ops": [asdict(o) for o in self.ops], "faults": [asdict(f) for f in self.faults]}
        path.write_text(json.dumps(data, indent=1))
