"""What the writer keeps for a checkpoint's cut: the split calls it applied, and a hold.

A call that writes keys held by several primaries (an ``update_arrays`` of a
routed client, an update a node passes on in parts) is applied in parts, one
per node, each part stamped ``"ID:K"`` (``ParameterUpdate.call``: the same
for every part, ``K`` the keys the call writes in all). A cut across the
nodes must take all of such a call's keys or none, so:

* :class:`CallLog` remembers, for the split calls applied lately, which of
  their keys this node applied (a part that holds every key of its call is
  whole: nothing to remember).
* :class:`Hold`, while a cut is being made, keeps the client writes the
  writer has not applied out of the table (replication goes on: it carries
  only what some primary applied), except those of the calls the cut
  *admits*: calls some node had applied a part of before the hold, whose
  other parts must come in for the cut to hold the whole call.

The node's side of the protocol is :mod:`aioparamsync.server.cuts`; the
checkpointer's, :mod:`aioparamsync.client.checkpoint`.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "CALLS_KEPT",
    "CALLS_KEPT_SECONDS",
    "MAX_HOLD_MS",
    "CallLog",
    "Hold",
    "call_keys",
    "new_call",
]

# The split calls remembered: those applied in the last CALLS_KEPT_SECONDS, at
# most CALLS_KEPT of them. A call whose parts arrive further apart than that is
# no call a cut can make whole (its writer is gone or stuck).
CALLS_KEPT_SECONDS = 30.0
CALLS_KEPT = 20_000
# The longest a node holds writes for a cut.
MAX_HOLD_MS = 60_000


_PROCESS = secrets.token_hex(8)  # (a call's id: this process's, and its count)
_COUNT = itertools.count()


def new_call(keys: int) -> str:
    """A new call's stamp (``"ID:K"``) for a call that writes ``keys`` keys in all."""
    return f"{_PROCESS}.{next(_COUNT)}:{keys}"


def call_keys(call: str) -> int:
    """The number of keys ``call`` (``"ID:K"``) writes in all; 0 for a malformed stamp."""
    _, _, keys = call.rpartition(":")
    try:
        return max(int(keys), 0)
    except ValueError:
        return 0


class CallLog:
    """The keys each split call applied lately wrote here (see the module)."""

    def __init__(
        self, *, keep_seconds: float = CALLS_KEPT_SECONDS, max_calls: int = CALLS_KEPT
    ) -> None:
        self.keep_seconds = keep_seconds
        self.max_calls = max_calls
        # call -> (when last applied, its keys applied here), oldest first
        self._calls: collections.OrderedDict[str, tuple[float, set[str]]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: str, params: Sequence[Any]) -> None:
        """``params`` of ``call`` were applied here."""
        names = {p.name for p in params}
        if len(names) >= call_keys(call):
            return  # the whole call, applied at once
        now = time.monotonic()
        calls = self._calls
        held = calls.pop(call, None)
        if held is not None:
            names |= held[1]
        calls[call] = (now, names)
        while calls:
            oldest = next(iter(calls.values()))[0]
            if len(calls) <= self.max_calls and now - oldest <= self.keep_seconds:
                break
            calls.popitem(last=False)

    def report(self, only: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Each call remembered (of ``only``, where given) and the keys it wrote here."""
        calls = self._calls
        if only is None:
            return {call: sorted(names) for call, (_, names) in calls.items()}
        return {call: sorted(calls[call][1]) for call in only if call in calls}


class Hold:
    """Client writes kept out of the table while a cut is made (see the module).

    Attributes:
        admitted: the calls whose writes go in all the same.
        held: the writer's queue items held, in their order.
    """

    def __init__(self) -> None:
        self.admitted: set[str] = set()
        self.held: list[Any] = []

    def admits(self, call: str | None) -> bool:
        return call is not None and call in self.admitted

    def admit(self, calls: Iterable[str]) -> list[Any]:
        """Admit ``calls``; answer the items held of them (in order), no longer held."""
        self.admitted.update(calls)
        freed = [item for item in self.held if self.admits(item[5])]
        if freed:
            self.held = [item for item in self.held if not self.admits(item[5])]
        return freed
