"""The single writer: one coroutine owns every mutation of the table.

Theory of operation. :class:`ParameterStore` puts one coroutine,
:meth:`ParameterStore.run`, in front of a :class:`~aioparamsync.store.table.ParameterTable`:
callers submit updates to a bounded queue and get a future; the writer takes
whatever is queued (a batch, so that a durable store commits a whole batch at
once), applies each update with no ``await`` inside a mutation, then resolves
the callers and hands the applied entries to its subscribers (the
replication feed). asyncio's queues and futures only: no sockets.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import ErrorCode, RequestError, drop_tracebacks
from .cuts import CallLog, Hold
from .table import Applied, Entry, ParameterTable

__all__ = ["NOT_NOW", "Answer", "ParameterStore"]

log = logging.getLogger(__name__)

# Updates that may wait for the writer before submit() refuses more.
MAX_PENDING = 10_000
# Most updates the writer applies in one batch.
MAX_BATCH = 256
# Batches larger than this are written to the log from a worker thread (bytes).
INLINE_LOG_BYTES = 1024 * 1024


#: what :meth:`ParameterStore.apply_now` answers where the update must wait its turn
NOT_NOW: Any = object()

# How a queued update is applied.
_APPLY, _MERGE, _FOLD, _DROP, _LIFT = 0, 1, 2, 3, 4


class Answer(asyncio.Future[Any]):
    """The future :meth:`ParameterStore.submit` answers with.

    Attributes:
        eager: None, or a quick callable that the writer calls with the future
            the moment it answers it: one pass of the event loop before the
            loop runs the future's done callbacks. (The server sets it to
            write the reply in the writer's own step.) An exception it raises
            is logged.
    """

    __slots__ = ("eager",)
    eager: Callable[[Answer], Any] | None


def _tell(future: Answer) -> None:
    """Call the eager observer of a future just answered (see :class:`Answer`)."""
    eager, future.eager = future.eager, None
    if eager is None:
        return
    try:
        eager(future)
    except Exception:  # the observer's bug must not stop the writer
        log.exception("the observer of an update's answer failed")


def _fail(future: Answer, exc: BaseException) -> None:
    # (the writer's frames, which hold the batch and the future, are of no use to the
    # caller: without them, no cycle keeps the batch's bytes; see drop_tracebacks)
    drop_tracebacks(exc)
    future.set_exception(exc)
    if future.eager is not None:
        _tell(future)


# An applied update awaiting its answer: (the caller's future, what was
# applied, the caller's ``then`` or None).
_Done = tuple[Answer, Applied, Callable[[Applied], Any] | None]


class ParameterStore:
    """The single writer in front of a :class:`ParameterTable`.

    Backpressure: at most ``max_pending`` updates wait for the writer;
    :meth:`submit` refuses more with ``RequestError(UNAVAILABLE)`` at once
    (the server's per-connection limits keep a well-behaved client far from
    it), while :meth:`update` waits for room.

    Args:
        table: the table to own (a new, empty one by default).
        max_pending: the queue's bound.
        max_batch: the most updates applied in one batch.
    """

    def __init__(
        self,
        table: ParameterTable | None = None,
        *,
        max_pending: int = MAX_PENDING,
        max_batch: int = MAX_BATCH,
        data_dir: Any = None,
    ) -> None:
        self.table = table if table is not None else ParameterTable()
        self.max_pending = max_pending
        self.max_batch = max_batch
        self.data_dir = data_dir  # a persistence.DataDir, or None: in memory only
        self._failure: Exception | None = None  # the log could not be written
        self._snapshots: set[asyncio.Future[Any]] = set()
        self._drops = 0  # drops since the last snapshot was asked for
        self._queue: collections.deque[
            tuple[
                Sequence[Any],
                int,
                int,
                Answer,
                Callable[[Applied], Any] | None,
                str | None,
                Callable[[], None] | None,
            ]
        ] = collections.deque()
        #: the split calls applied lately, and the hold of a cut being made (see .cuts)
        self.calls = CallLog()
        self.hold: Hold | None = None
        # The writer's loop, kept (on CPython 3.11 every asyncio.get_running_loop()
        # makes a getpid() system call), and the future the idle writer awaits:
        # the next submit (or close) resolves it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._room: asyncio.Event | None = None
        self._closed = False
        self._subscribers: list[Callable[[Sequence[Entry], bool], None]] = []
        self.batches = 0
        self.updates_applied = 0
        self.updates_refused = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<ParameterStore {state} [{len(self._queue)} pending | "
            f"{self.updates_applied} applied in {self.batches} batches] {self.table!r}>"
        )

    def statistics(self) -> dict[str, int]:
        return {
            "pending": len(self._queue),
            "batches": self.batches,
            "updates_applied": self.updates_applied,
            "updates_refused": self.updates_refused,
            "parameters": len(self.table),
            "parameter_bytes": self.table.nbytes,
        }

    # -- reading ----------------------------------------------------------------

    def read(self, names: Sequence[str], min_version: int = 0) -> list[Entry]:
        """A consistent snapshot of ``names`` (see :meth:`ParameterTable.read`)."""
        return self.table.read(names, min_version)

    @property
    def timestamp(self) -> int:
        return self.table.timestamp

    # -- writing ----------------------------------------------------------------

    def subscribe(self, callback: Callable[[Sequence[Entry], bool], None]) -> None:
        """Call ``callback(entries, replicated)`` after each batch, with the entries it applied.

        ``replicated`` tells entries merged from peers from those this node
        originated (called once for each kind the batch has).

        The callback runs in the writer, so it must not block: it queues work.
        """
        self._subscribers.append(callback)

    def submit(
        self,
        params: Sequence[Any],
        timestamp: int,
        *,
        replicated: bool = False,
        gradients: bool = False,
        then: Callable[[Applied], Any] | None = None,
        call: str | None = None,
        check: Callable[[], None] | None = None,
    ) -> asyncio.Future[Any]:
        """Queue an update; answer a future of its :class:`Applied`.

        Updates are applied in the order they are submitted: with
        :meth:`ParameterTable.apply`, :meth:`ParameterTable.merge` where
        ``replicated`` (an update a peer sends on), or
        :meth:`ParameterTable.fold` where ``gradients``.

        With ``then``, the future is of ``then(applied)``, made by the writer
        as it answers the batch: a caller that turns the outcome into a reply
        gets the reply itself, one hop of the event loop sooner than through a
        future chained to this one. ``then`` must be quick; its exception
        fails that one future.

        ``call``: the stamp of the split call the update is a part of (see
        :mod:`.cuts`), which the writer remembers, and which a cut's hold admits.

        ``check``: called by the writer just before it applies the update; a
        ``RequestError`` it raises fails the update, nothing of it applied. (A
        cluster's primary checks it still is one: a fold it took as primary may
        wait here while its view changes.)

        Raises:
            RequestError: (UNAVAILABLE) the queue is full or the store is closed.
        """
        if self._closed:
            raise RequestError(ErrorCode.UNAVAILABLE, "the node is shutting down")
        if self._failure is not None:
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"the node cannot write its log ({self._failure}); it takes no more "
                "updates until restarted",
            )
        if len(self._queue) >= self.max_pending:
            self.updates_refused += 1
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"the node has {len(self._queue)} updates waiting; try again",
            )
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future = Answer(loop=loop)
        future.eager = None
        mode = _MERGE if replicated else _FOLD if gradients else _APPLY
        self._queue.append((params, timestamp, mode, future, then, call, check))
        wakeup = self._wakeup  # (self._wake(), inlined)
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)
        return future

    def apply_now(
        self,
        params: Sequence[Any],
        timestamp: int,
        then: Callable[[Applied], Any],
        call: str | None = None,
    ) -> Any:
        """Apply an update at once, as the writer would next, and answer ``then(applied)``;
        or :data:`NOT_NOW` where it must wait its turn: the writer is busy or has updates
        queued, or keeps a log (a batch is logged before it is answered), or holds writes
        for a cut. (One update the writer would apply alone, without a future, a pass of
        the loop, nor a batch.)

        Raises:
            RequestError: the update may not be applied (nothing of it was).
        """
        if not self.idle():
            return NOT_NOW
        try:
            applied = self.table.apply(params, timestamp)
        except Exception:
            self.updates_refused += 1
            raise
        if call is not None:
            self.calls.add(call, params)
        return then(self._applied_now(applied))

    def idle(self) -> bool:
        """Whether an update would be applied next, alone (see :meth:`apply_now`): the
        writer waits for work with none queued, keeps no log, holds no writes for a cut,
        and takes updates."""
        wakeup = self._wakeup
        return (
            wakeup is not None  # (the writer waits for work)
            and not wakeup.done()
            and not self._queue
            and self.data_dir is None
            and self.hold is None
            and not self._closed
            and self._failure is None
        )

    def applied_now(self, made: list[Entry], timestamp: int) -> Applied:
        """Store ``made``, the entries of an update checked and made elsewhere as
        :meth:`ParameterTable.apply` makes them (a founding client's small update, in C:
        ``server/_csmall.pyx``), as :meth:`apply_now` does; only while :meth:`idle`."""
        return self._applied_now(self.table.put(made, timestamp))

    def _applied_now(self, applied: Applied) -> Applied:
        self.batches += 1
        self.updates_applied += 1
        if applied.entries:
            self._feed(applied.entries, False)
        return applied

    async def update(
        self, params: Sequence[Any], timestamp: int, *, replicated: bool = False
    ) -> Applied:
        """Apply an update (see :meth:`submit`), waiting for room in the queue if need be."""
        while len(self._queue) >= self.max_pending and not self._closed:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            await self._room.wait()
        return await self.submit(params, timestamp, replicated=replicated)

    async def drop(self, held: Mapping[str, tuple[int, str]]) -> int:
        """Forget parameters other nodes hold now (see :meth:`ParameterTable.drop`), in
        order with the updates queued; answers how many were dropped. With a
        data directory, a snapshot follows, so the files hold what the node holds."""
        if not held:
            return 0
        return await self._queued(dict(held), _DROP)

    async def _queued(self, what: dict[str, Any], mode: int) -> Any:
        """Queue a drop or a lift (waiting for room), and answer what it answers."""
        while len(self._queue) >= self.max_pending and not self._closed:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            await self._room.wait()
        if self._closed:
            raise RequestError(ErrorCode.UNAVAILABLE, "the node is shutting down")
        loop = self._loop = asyncio.get_running_loop()
        future = Answer(loop=loop)
        future.eager = None
        self._queue.append((what, 0, mode, future, None, None, None))  # type: ignore[arg-type]
        self._wake()
        return await future

    async def lift(self, floors: Mapping[str, int]) -> int:
        """Raise the named parameters' versions to their floors (see
        :meth:`ParameterTable.lift`), in order with the updates queued; answers how
        many were lifted."""
        if not floors:
            return 0
        return len((await self._queued(dict(floors), _LIFT)).entries)

    async def applied(self) -> None:
        """Wait until every update queued before this call is applied (a barrier).

        A node that stops being a key's primary waits so before it says it has:
        the folds it took as primary are in its table when the new one asks.
        """
        if self._closed or not self._queue:
            return
        future = Answer(loop=self._loop or asyncio.get_running_loop())
        future.eager = None
        # (an empty drop: in order with the others, and no more)
        self._queue.append(({}, 0, _DROP, future, None, None, None))  # type: ignore[arg-type]
        self._wake()
        await future

    async def run(self) -> None:
        """The writer. Runs until :meth:`close`, then applies what was queued and returns.

        With a data directory, a batch is written to the log (and synced, as its
        ``fsync`` mode says) before its callers are answered; at the end a
        snapshot is written.
        """
        loop = self._loop = asyncio.get_running_loop()
        syncer = None
        if self.data_dir is not None and self.data_dir.fsync == "batch":
            syncer = asyncio.ensure_future(self._sync_periodically())
        while True:
            if not self._queue:
                if self._closed:
                    break
                self._wakeup = loop.create_future()
                try:
                    await self._wakeup
                finally:
                    self._wakeup = None
                continue
            if self._failure is not None:
                self._refuse_queued()  # not applied: they could not be kept
                continue
            done, fed = self._apply_batch()
            if self.data_dir is not None and (fed[0] or fed[1]):
                await self._log(done, fed)
            self._finish_batch(done, fed)
            # (not kept while the writer waits for the next: a batch holds its updates'
            # buffers, a push's whole frame, which the next large frame would reuse)
            done = fed = None  # type: ignore[assignment]
            if self._queue:
                # Let readers and the network run between batches (with
                # nothing queued, waiting for the next update does that).
                await asyncio.sleep(0)
        if syncer is not None:
            syncer.cancel()
            await asyncio.wait({syncer})
        if self._snapshots:
            await asyncio.wait(self._snapshots)
        if self.data_dir is not None and self._failure is None:
            await self._snapshot()

    async def _sync_periodically(self) -> None:
        """With ``fsync=batch``: sync what was logged, also when no batch follows it."""
        data_dir = self.data_dir
        while True:
            await asyncio.sleep(data_dir.sync_interval)
            if data_dir.dirty and self._failure is None:
                try:
                    await asyncio.to_thread(data_dir.sync)
                except OSError as exc:
                    log.critical("cannot sync the log: %s; refusing further updates", exc)
                    self._failure = exc

    def _refuse_queued(self) -> None:
        error = RequestError(
            ErrorCode.UNAVAILABLE,
            f"the node cannot write its log ({self._failure}); it takes no more updates "
            "until restarted",
        )
        while self._queue:
            future = self._queue.popleft()[3]
            if not future.done():
                _fail(future, error)

    async def _log(self, done: list[_Done], fed: tuple[list[Entry], list[Entry]]) -> None:
        data_dir = self.data_dir
        entries = fed[0] + fed[1]
        try:
            if sum(e.nbytes for e in entries) > INLINE_LOG_BYTES:
                await asyncio.to_thread(data_dir.append, entries, self.table.timestamp)
            else:
                data_dir.append(entries, self.table.timestamp)
            if data_dir.sync_due():
                await asyncio.to_thread(data_dir.sync)
        except OSError as exc:
            # Applied in memory, not on disk: answer so, and take no more writes.
            log.critical("cannot write the log: %s; refusing further updates", exc)
            self._failure = exc
            error = RequestError(ErrorCode.UNAVAILABLE, f"the update could not be logged: {exc}")
            for future, _, _ in done:
                if not future.done():
                    _fail(future, error)
            done.clear()
            return
        if data_dir.snapshot_due():
            task = asyncio.ensure_future(self._snapshot())
            self._snapshots.add(task)
            task.add_done_callback(self._snapshots.discard)

    async def _snapshot(self) -> None:
        """Cut the log and write a snapshot of this moment (in a worker thread)."""
        data_dir = self.data_dir
        n = data_dir.start_snapshot()
        entries = [e for name in self.table.names() if (e := self.table.entry(name))]
        try:
            await asyncio.to_thread(data_dir.write_snapshot, n, entries, self.table.timestamp)
        except OSError as exc:
            log.error("snapshot %d failed: %s (the log still holds everything)", n, exc)

    def _apply_batch(self) -> tuple[list[_Done], tuple[list[Entry], list[Entry]]]:
        queue = self._queue
        batch = [queue.popleft() for _ in range(min(self.max_batch, len(queue)))]
        if self._room is not None:
            self._room.set()
        done: list[_Done] = []
        fed: tuple[list[Entry], list[Entry]] = ([], [])  # originated here, replicated
        table = self.table
        hold = self.hold
        for item in batch:
            params, timestamp, mode, future, then, call, check = item
            if future.cancelled():
                continue  # its caller gave up before it was applied
            if hold is not None and mode < _DROP and mode != _MERGE and not hold.admits(call):
                hold.held.append(item)  # (after the cut: see .cuts)
                continue
            try:
                if mode == _DROP:
                    dropped = table.drop(params)  # type: ignore[arg-type]
                    future.set_result(len(dropped))
                    if dropped:
                        self._drops += 1
                    continue
                if check is not None:
                    check()
                if mode == _LIFT:
                    applied = table.lift(params, timestamp)  # type: ignore[arg-type]
                elif mode == _APPLY:
                    applied = table.apply(params, timestamp)
                elif mode == _MERGE:
                    applied = table.merge(params, timestamp)
                else:
                    applied = table.fold(params, timestamp)
            except RequestError as exc:
                self.updates_refused += 1
                _fail(future, exc)
                continue
            except Exception as exc:  # a bug must fail one update, never stop the writer
                log.exception("applying an update failed")
                self.updates_refused += 1
                _fail(future, exc)
                continue
            done.append((future, applied, then))
            fed[mode == _MERGE].extend(applied.entries)
            if call is not None:
                self.calls.add(call, params)
        self.batches += 1
        self.updates_applied += len(done)
        if self._drops and self.data_dir is not None:
            self._drops = 0
            task = asyncio.ensure_future(self._snapshot())
            self._snapshots.add(task)
            task.add_done_callback(self._snapshots.discard)
        return done, fed

    def _finish_batch(self, done: list[_Done], fed: tuple[list[Entry], list[Entry]]) -> None:
        """Answer the batch's callers; hand its entries to the subscribers."""
        for future, applied, then in done:
            if future.done():
                continue
            if then is None:
                future.set_result(applied)
            else:
                try:
                    result = then(applied)
                except Exception as exc:  # the caller's bug fails its own update only
                    log.exception("answering an applied update failed")
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            if future.eager is not None:
                _tell(future)
        for kind, entries in zip((False, True), fed, strict=True):
            if entries:
                self._feed(entries, kind)

    def _feed(self, entries: Sequence[Entry], replicated: bool) -> None:
        """Hand entries just applied to the subscribers."""
        for callback in self._subscribers:
            try:
                callback(entries, replicated)
            except Exception:  # one subscriber's bug must not stop the writer
                log.exception("store subscriber %r failed", callback)

    def _wake(self) -> None:
        """Wake the writer if it waits for work."""
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    # -- a checkpoint's cut (see .cuts) ------------------------------------------

    def start_hold(self) -> None:
        """Keep the client writes not applied yet out of the table (see :class:`Hold`)."""
        if self.hold is None:
            self.hold = Hold()

    def admit(self, calls: Iterable[str]) -> None:
        """Let the held and coming writes of ``calls`` in, though held."""
        if self.hold is not None and (freed := self.hold.admit(calls)):
            self._queue.extendleft(reversed(freed))
            self._wake()

    def release(self) -> None:
        """End the hold: what it held is applied next, in its order."""
        hold, self.hold = self.hold, None
        if hold is not None and hold.held:
            self._queue.extendleft(reversed(hold.held))
            self._wake()

    def close(self) -> None:
        """Refuse new updates; :meth:`run` returns once the queued ones are applied."""
        self.release()
        self._closed = True
        self._wake()
        if self._room is not None:
            self._room.set()
