"""A checkpoint's cut, as one node takes part in it (the IDL's ``cut``).

The checkpointer (:mod:`aioparamsync.client.checkpoint`) takes each step at
every member, one step at all of them before the next:

1. ``hold``: the node's writer keeps every client write it has not applied
   out of the table (see :mod:`aioparamsync.store.cuts`) and the node answers
   the split calls it applied lately, each with the keys it wrote here. A
   call some node applied a part of and whose other keys no node did is
   *torn* at the cut: its other parts were sent before the hold reached their
   nodes, or are still on their way.
2. ``admit``: the writers let those calls' parts in, held or still to come;
   the checkpointer asks again until every torn call is whole (or gives up on
   one whose writer died amid it: the checkpoint's manifest says so).
3. ``take``: the node keeps what its table holds now as the cut's (the
   table's entries are never changed in place, so this keeps references,
   not copies) and answers the cut's keys. It still holds: a member that
   let writes in before another took its part would replicate writes made
   after the cut to it.
4. ``release``: the node lets writes in (they go on while the cut is read).
5. ``read``: the checkpointer reads each key from a node holding its newest
   version in the cut.
6. ``end``: the node forgets the cut.

A hold ends by itself after ``hold_ms`` (a checkpointer that died must not
stop training); a cut taken and not read for ``IDLE_SECONDS`` is forgotten.
One cut at a time: another checkpoint's ``hold`` is refused while one is
being made.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..errors import ErrorCode, RequestError
from ..placement import is_reserved, parse_key
from ..store.cuts import MAX_HOLD_MS
from ..store.table import Entry
from ..store.writer import ParameterStore
from ..wire import Method, thrift

__all__ = ["DEFAULT_HOLD_MS", "IDLE_SECONDS", "Cuts"]

DEFAULT_HOLD_MS = 10_000
IDLE_SECONDS = 60.0
# The most bytes one read of a cut answers (the caller asks for fewer).
MAX_READ_BYTES = 1 << 30


def parameter_key(key: str) -> bool:
    """Whether ``key`` is a parameter's (its name, a partition's or a manifest's key)."""
    return not is_reserved(key) or parse_key(key) is not None


class _Cut:
    def __init__(self, cut_id: str) -> None:
        self.id = cut_id
        self.entries: dict[str, Entry] | None = None  # taken
        self.expired = False  # the hold ended by itself before the cut was taken
        self.timer: asyncio.TimerHandle | None = None
        self.used = time.monotonic()


class Cuts:
    """This node's part in checkpoints' cuts (see the module)."""

    def __init__(self, store: ParameterStore) -> None:
        self.store = store
        self._cut: _Cut | None = None
        self.taken = 0

    def handle(self, method: Method, args: Any) -> Any:
        request = args.request
        if request is None or not isinstance(request.id, str) or not request.id:
            raise RequestError(ErrorCode.BAD_REQUEST, "a cut needs its id")
        phase = request.phase
        step = getattr(self, f"_{phase}", None) if phase in _PHASES else None
        if step is None:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"a cut's phase is one of {', '.join(_PHASES)}, not {phase!r}",
            )
        return method.result(success=step(request))

    def close(self) -> None:
        self._forget()

    # -- the phases ---------------------------------------------------------------

    def _hold(self, request: Any) -> Any:
        cut = self._cut
        if cut is not None and cut.id != request.id:
            if cut.entries is None and not cut.expired:
                raise RequestError(
                    ErrorCode.UNAVAILABLE,
                    f"another checkpoint ({cut.id}) is being cut here; try again when it ends",
                )
            self._forget()
            cut = None
        hold_ms = DEFAULT_HOLD_MS if request.hold_ms is None else request.hold_ms
        if not 0 < hold_ms <= MAX_HOLD_MS:
            raise RequestError(
                ErrorCode.BAD_REQUEST, f"hold_ms is from 1 to {MAX_HOLD_MS}, not {hold_ms}"
            )
        if cut is None:
            cut = self._cut = _Cut(request.id)
            self.store.start_hold()
            cut.timer = asyncio.get_running_loop().call_later(hold_ms / 1000, self._expire, cut)
        return self._calls(None)

    def _admit(self, request: Any) -> Any:
        self._holding(request)
        calls = [c for c in request.calls or () if isinstance(c, str)]
        self.store.admit(calls)
        return self._calls(calls)

    def _take(self, request: Any) -> Any:
        cut = self._holding(request)
        table = self.store.table
        cut.entries = {
            name: e
            for name in table.names()
            if parameter_key(name) and (e := table.entry(name)) is not None
        }
        self.taken += 1
        keys = [
            thrift.DigestEntry(name=e.name, version=e.version, origin=e.origin, nbytes=e.nbytes)
            for e in cut.entries.values()
        ]
        return thrift.CutResult(keys=keys)

    def _release(self, request: Any) -> Any:
        cut = self._cut
        if cut is not None and cut.id == request.id and cut.entries is not None:
            self.store.release()
            self._idle_later(cut)
        return thrift.CutResult()

    def _read(self, request: Any) -> Any:
        cut = self._cut
        if cut is None or cut.id != request.id or cut.entries is None:
            raise RequestError(
                ErrorCode.UNKNOWN_PARAMETER,
                f"no cut {request.id!r} is taken here (it ended, or was never taken)",
            )
        cut.used = time.monotonic()
        params: list[Any] = []
        total = 0
        for name in request.names or ():
            entry = cut.entries.get(name)
            if entry is None:
                raise RequestError(
                    ErrorCode.UNKNOWN_PARAMETER, f"cut {request.id!r} holds no {name!r}"
                )
            total += entry.nbytes
            if total > MAX_READ_BYTES and params:
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"a read of a cut answers at most {MAX_READ_BYTES} bytes; ask for fewer keys",
                )
            params.append(entry.to_parameter())
        return thrift.CutResult(params=params)

    def _end(self, request: Any) -> Any:
        cut = self._cut
        if cut is not None and cut.id == request.id:
            self._forget()
        return thrift.CutResult()

    # -- helpers -----------------------------------------------------------------

    def _holding(self, request: Any) -> _Cut:
        cut = self._cut
        if cut is None or cut.id != request.id:
            raise RequestError(
                ErrorCode.UNKNOWN_PARAMETER, f"cut {request.id!r} holds nothing here (hold first)"
            )
        if cut.expired:
            raise RequestError(
                ErrorCode.TIMEOUT,
                f"cut {request.id!r}: the hold ended by itself (hold_ms) before it was taken",
            )
        if cut.entries is not None:
            raise RequestError(ErrorCode.BAD_REQUEST, f"cut {request.id!r} is taken already")
        return cut

    def _calls(self, only: list[str] | None) -> Any:
        hold = self.store.hold
        return thrift.CutResult(
            calls=self.store.calls.report(only), held=len(hold.held) if hold else 0
        )

    def _expire(self, cut: _Cut) -> None:
        cut.timer = None
        if self._cut is not cut:
            return
        self.store.release()
        if cut.entries is None:
            cut.expired = True
        else:  # (taken, never released: its checkpointer stopped; it may still read)
            self._idle_later(cut)

    def _idle_later(self, cut: _Cut) -> None:
        def check() -> None:
            if self._cut is not cut:
                return
            idle = time.monotonic() - cut.used
            if idle >= IDLE_SECONDS:
                self._forget()
            else:
                cut.timer = loop.call_later(IDLE_SECONDS - idle, check)

        loop = asyncio.get_running_loop()
        if cut.timer is not None:
            cut.timer.cancel()
        cut.timer = loop.call_later(IDLE_SECONDS, check)

    def _forget(self) -> None:
        cut, self._cut = self._cut, None
        if cut is None:
            return
        if cut.timer is not None:
            cut.timer.cancel()
        self.store.release()  # (a hold of this cut's, if it still holds)
        cut.entries = None


_PHASES = ("hold", "admit", "take", "release", "read", "end")
