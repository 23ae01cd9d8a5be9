"""The blocking client: :class:`SyncParameterClient`, ParameterClient's methods, blocking.

Theory of operation. A :class:`SyncParameterClient` owns a
:class:`~aioparamsync.client.api.ParameterClient` and a private event loop
(uvloop where it is installed, as the node and ``aioparamsync-ctl`` run on),
run by a daemon thread of its own (:class:`_LoopThread`). Each method is the
async client's, generated from it (so the two cannot drift apart, and
``help()`` shows the same signature and docstring): it submits the coroutine
to that loop and waits for its result. Calls from several threads run
concurrently on the one loop, pipelined over the async client's connections,
which is safe among coroutines; what a call raises is raised as it is, the
same exceptions the async client raises.

A call from a thread that runs an event loop (async code, a notebook cell,
or a coroutine on the client's own loop) would stall that loop, or never be
answered: it raises :class:`~aioparamsync.errors.RunningLoopError` instead.
A ``KeyboardInterrupt`` (Ctrl-C) while a call waits cancels that call on the
loop and is raised; the loop and the client stay usable.

``close()`` (or the end of a ``with`` block) closes the async client on the
loop, cancels what is left, stops the loop and joins the thread, each step
bounded by ``CLOSE_TIMEOUT``; a client that is dropped, or still open when
the interpreter exits, is closed so (``weakref.finalize``). Calls made after
``close()`` raise :class:`~aioparamsync.errors.ClientClosedError`.

The async client's one async iterator, ``watch``, has a generator as its
twin here (each step waits on the loop as a call does); its one async
context manager is the client itself: ``with SyncParameterClient(...)`` is
its twin.

Async helpers that take a client (``aioparamsync.torch``'s, your own) run
on the loop with :meth:`SyncParameterClient.run`; :func:`also_blocking` and
:func:`on_client` let one such helper take either client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

from ..errors import ClientClosedError, RunningLoopError
from .api import ParameterClient
from .loop import new_event_loop
from .watch import WATCH_WAIT

__all__ = ["SyncParameterClient", "also_blocking", "on_client"]

# How long close() waits for each step of the shutdown: the async client's
# close, the calls left to cancel, the loop's thread to end (seconds).
CLOSE_TIMEOUT = 5.0
# ParameterClient's public methods written here rather than generated: they differ.
OWN = frozenset({"close", "from_env", "watch"})

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


def refuse_running_loop(what: str) -> None:
    """Raise RunningLoopError if this thread runs an event loop (``what`` would block it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RunningLoopError(
        f"SyncParameterClient.{what}() blocks until it is answered, and this thread runs an "
        "event loop, which it would stall (on the client's own loop: never answered). In "
        "async code (a notebook cell too) use ParameterClient and await its methods"
    )


async def _apply(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


class _LoopThread:
    """A private event loop, the daemon thread that runs it, and the calls submitted to it.

    It holds no reference to the client, so that a client nobody holds can be
    collected (and closed by its finalizer).
    """

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self.closed = False
        self._lock = threading.Lock()  # closed, and the submissions: none once closed
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self.thread = threading.Thread(
            target=self._run, name="aioparamsync-sync-client", daemon=True
        )
        self.thread.start()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<_LoopThread {state} [Calls: {len(self._pending)} in flight]>"

    def _run(self) -> None:
        loop = self.loop
        try:
            loop.run_forever()
        finally:
            # What a close that ran out of time left: cancelled, briefly waited for.
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=CLOSE_TIMEOUT))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def submit(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args, **kwargs)`` (awaited if it answers an awaitable) on the loop."""
        with self._lock:
            if self.closed:
                raise ClientClosedError("the client is closed")
            future = asyncio.run_coroutine_threadsafe(_apply(fn, args, kwargs), self.loop)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def stop(self, client: ParameterClient) -> None:
        """Close ``client`` on the loop, then the loop; wait for it unless that would block.

        From the loop's own thread (a finalizer run there) or from a thread
        running another loop, the shutdown is started and not waited for.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
        loop = self.loop
        done = asyncio.run_coroutine_threadsafe(self._finish(client), loop)
        # (run in the loop's thread as the shutdown ends: the loop is still open)
        done.add_done_callback(lambda _: loop.call_soon_threadsafe(loop.stop))
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            return
        try:
            done.result(CLOSE_TIMEOUT)
        except concurrent.futures.TimeoutError:
            loop.call_soon_threadsafe(loop.stop)
        except Exception:  # noqa: BLE001  # (the client's close failed: the loop stops anyway)
            pass
        self.thread.join(CLOSE_TIMEOUT)
        # Calls the loop could not end in time: their callers are not left waiting.
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.cancel()

    async def _finish(self, client: ParameterClient) -> None:
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await client.close()
        finally:
            me = asyncio.current_task()
            others = [task for task in asyncio.all_tasks() if task is not me]
            for task in others:
                task.cancel()
            if others:
                await asyncio.wait(others, timeout=CLOSE_TIMEOUT)


class SyncParameterClient:
    """A blocking client of a node: ParameterClient's methods, for synchronous code.

    The same constructor arguments, methods, arguments, results and
    exceptions as :class:`~aioparamsync.client.api.ParameterClient` (each
    method's ``help()`` is the async one's), but every call blocks until it
    is answered. Safe to share among threads: their calls run concurrently on
    the client's loop, in a daemon thread it owns. Use it as a context
    manager, or call :meth:`close`::

        with SyncParameterClient("127.0.0.1:9090") as client:
            versions = client.update_arrays({"w": weights})
            arrays = client.get_arrays(["w"])

    Its attributes (``timeout``, ``addresses``, ``traffic``...) are the async
    client's, to read; :attr:`aio` is the async client itself (its coroutines
    run on this client's loop only: see :meth:`run`).

    Raises:
        ValueError: an argument out of its range, as ParameterClient's
            (nothing is started then).
        RunningLoopError: (from any method) called from a thread that runs
            an event loop.
        ClientClosedError: (from any method) called after :meth:`close`.
    """

    aio: ParameterClient  #: the async client, whose coroutines run on this client's loop

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._start(ParameterClient(*args, **kwargs))

    def _start(self, aio: ParameterClient) -> None:
        self.aio = aio
        self._thread = _LoopThread()
        self._finalizer = weakref.finalize(self, self._thread.stop, aio)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **kwargs: Any
    ) -> SyncParameterClient:
        """A client of the nodes the environment names (see :meth:`ParameterClient.from_env`)."""
        client = cls.__new__(cls)
        client._start(ParameterClient.from_env(environ, **kwargs))
        return client

    def __repr__(self) -> str:
        return "<Sync" + repr(self.aio).removeprefix("<")

    def __getattr__(self, name: str) -> Any:
        # The async client's attributes, to read (its methods are generated below).
        if name.startswith("_") or name == "aio":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.aio, name)

    def __enter__(self) -> SyncParameterClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections, stop the client's loop and end its thread.

        Calls in flight fail as the async client's do when it is closed
        (``ConnectionLostError``), or with ``ClientClosedError``; later calls
        raise ``ClientClosedError``. Each step is bounded by
        ``CLOSE_TIMEOUT`` seconds. Called again, it does nothing. Called from
        a thread that runs an event loop, it starts the shutdown without
        waiting for it.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the client was finalized)."""
        return self._thread.closed

    def watch(
        self,
        names: Iterable[str] | None = None,
        *,
        prefix: str | None = None,
        wait: float = WATCH_WAIT,
    ) -> Iterator[dict[str, int]]:
        """:meth:`ParameterClient.watch`, blocking: ``for changed in client.watch([...]):``.

        Each step waits for the next change; ending the loop (``break``, the
        generator closed) ends the watch on the client's loop.
        """
        changes = self.aio.watch(names, prefix=prefix, wait=wait)
        try:
            while True:
                try:
                    yield self._wait("watch", changes.__anext__, (), {})
                except StopAsyncIteration:
                    return
        finally:
            if not self.closed:
                self._wait("watch", changes.aclose, (), {})

    def run(
        self,
        fn: Callable[Concatenate[ParameterClient, P], Coroutine[Any, Any, R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """Run ``await fn(client.aio, *args, **kwargs)`` on the client's loop; answer its result.

        For async helpers that take a ParameterClient: your own, or
        ``aioparamsync.torch``'s (which also take this client directly).

        Raises:
            What ``fn`` raises; and as every method (see the class).
        """
        return self._wait(getattr(fn, "__name__", "run"), fn, (self.aio, *args), kwargs)

    def _wait(
        self, what: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> Any:
        refuse_running_loop(what)
        future = self._thread.submit(fn, args, kwargs)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self._thread.closed:
                raise ClientClosedError(f"the client was closed during {what}") from None
            raise
        except BaseException:
            # Ctrl-C (or a signal handler's exception) in this thread: the call
            # is cancelled on the loop, which goes on serving the next ones.
            # (For the call's own exception, the future is done: no-op.)
            future.cancel()
            raise


def _blocking(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The blocking twin of ParameterClient's method ``name`` (its signature and docstring)."""

    @functools.wraps(fn)
    def method(self: SyncParameterClient, /, *args: Any, **kwargs: Any) -> Any:
        return self._wait(name, getattr(self.aio, name), args, kwargs)

    method.__qualname__ = f"{SyncParameterClient.__name__}.{name}"
    method.__module__ = __name__
    return method


def _forwarded(name: str, prop: property) -> property:
    """ParameterClient's property ``name``, read from the async client."""
    return property(lambda self: getattr(self.aio, name), doc=prop.__doc__)


def _generate() -> None:
    """Give SyncParameterClient a twin of each public member of ParameterClient.

    A member of a kind without a twin here fails the import, so that a new
    one is never silently missing from the blocking client.
    """
    for name, member in inspect.getmembers_static(ParameterClient):
        if name.startswith("_") or name in OWN:
            continue
        if isinstance(member, property):
            setattr(SyncParameterClient, name, _forwarded(name, member))
        elif inspect.isfunction(member):  # a coroutine function, or a plain one (stats)
            setattr(SyncParameterClient, name, _blocking(name, member))
        else:
            raise TypeError(
                f"ParameterClient.{name} is a {type(member).__name__}: "
                "SyncParameterClient has no twin of it (see client/blocking.py)"
            )
    init: Any = SyncParameterClient.__init__  # (help() shows the arguments it passes on)
    init.__signature__ = inspect.signature(ParameterClient.__init__)


_generate()


# -- helpers that take either client --------------------------------------------------------


def on_client(
    client: Any,
    fn: Callable[Concatenate[ParameterClient, P], Coroutine[Any, Any, R]],
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> Any:
    """``fn(client, *args, **kwargs)`` (``fn`` async, of a ParameterClient) for either client.

    A :class:`SyncParameterClient` runs it on its loop and answers its
    result (:meth:`SyncParameterClient.run`); a ParameterClient gets the
    coroutine, to await.
    """
    if isinstance(client, SyncParameterClient):
        return client.run(fn, *args, **kwargs)
    return fn(client, *args, **kwargs)


class EitherClient(Protocol[P, R_co]):
    """An async function of a ParameterClient that also takes a SyncParameterClient."""

    @overload
    def __call__(
        self, client: SyncParameterClient, /, *args: P.args, **kwargs: P.kwargs
    ) -> R_co: ...
    @overload
    def __call__(
        self, client: ParameterClient, /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, R_co]: ...


def also_blocking(
    fn: Callable[Concatenate[ParameterClient, P], Coroutine[Any, Any, R]],
) -> EitherClient[P, R]:
    """Let an async ``fn(client, ...)`` take a SyncParameterClient as ``client`` too (see
    :func:`on_client`): then it blocks and answers the result. Signature and docstring stay."""

    # (The arguments are fn's: checked when it is called, not here.)
    either: Callable[..., Any] = on_client
    untyped: Callable[..., Any] = fn

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if args:
            client, args = args[0], args[1:]
        elif "client" in kwargs:
            client = kwargs.pop("client")
        else:
            return untyped(**kwargs)  # (fn's own TypeError: no client)
        return either(client, fn, *args, **kwargs)

    return call
