"""The async client's API: :class:`ParameterClient`, numpy arrays in and out of a node.

Theory of operation. A :class:`ParameterClient` is a pool of pipelined
connections to its node (:mod:`.pool`, :mod:`.connection`), so hundreds of
coroutines can share one client; every call goes through
:meth:`~ParameterClient.invoke` by its entry in the method table, which
decides how it is retried. The methods here turn arrays into the IDL's
messages and back: an update larger than one message goes in pieces
(:mod:`.updates`), and a parameter the node answers without data is read in
pieces (:mod:`.fetch`). Arrays are sent by reference, without a copy: do
not change an array until the call sending it has returned.
"""

from __future__ import annotations

import asyncio
import os
import ssl as ssl_module
import time
from collections.abc import AsyncGenerator, Collection, Iterable, Mapping
from types import EllipsisType
from typing import Any

import numpy as np

from ..errors import CallTimeout
from ..values import pieces
from ..values.packing import arrays_of
from ..wire import DEFAULT_MAX_FRAME_BYTES, METHODS, thrift
from .addresses import Address, check_seconds, parse_address
from .addresses import parse_addresses as parse_addresses  # (importable from here too)
from .fetch import fetch_all
from .gradients import GradientClient
from .pool import ConnectionPool
from .routing import ROUTED, Routes
from .rows import TableClient
from .shared import DEFAULT_SHARED_MEMORY_BYTES, lane_for, may_share, read_lent
from .updates import make_update, push_in_pieces
from .watch import WATCH_WAIT, Watcher

__all__ = ["ParameterClient", "parse_address"]

# Default deadline of one call, connecting included (seconds).
DEFAULT_TIMEOUT = 60.0
# Default deadline of opening one connection (seconds).
DEFAULT_CONNECT_TIMEOUT = 10.0
# Default number of connections a client keeps to its node.
DEFAULT_MAX_CONNECTIONS = 4
# A held call's deadline is its wait plus this (seconds), so that the node's
# TIMEOUT, which says what never came, arrives before the client gives up.
HOLD_MARGIN = 5.0
# The most milliseconds a wait_ms field holds (an i32); nodes cap waits far lower.
MAX_WAIT_MS = 2**31 - 1


class ParameterClient(GradientClient, TableClient, ConnectionPool):
    """An async client of a node (or of the first reachable of several).

    Safe to share among many coroutines: calls are pipelined over a small pool
    of connections. Given several addresses (nodes of one cluster), it uses one
    node at a time and moves to the next when that one cannot be reached.
    Use it as an async context manager, or call :meth:`close`::

        async with ParameterClient("127.0.0.1:9090") as client:
            versions = await client.update_arrays({"w": weights})
            arrays = await client.get_arrays(["w"])

    Args:
        address: ``"host:port"``, ``(host, port)``, or several of them (a
            list, or ``"host:port,host:port"``).
        timeout: default deadline of each call in seconds (None: no deadline).
        connect_timeout: deadline of opening a connection (seconds; None: none).
        max_connections: connections to keep to the node.
        max_frame_bytes: the largest reply accepted.
        max_inline_bytes: parameters larger than this travel in pieces of
            ``piece_bytes``, both ways (see :mod:`aioparamsync.values.pieces`): so a
            parameter may be larger than a frame, or than 2 GiB.
        piece_bytes: the size of those pieces.
        ssl: an ``ssl.SSLContext`` to reach TLS nodes with (see :mod:`aioparamsync.tls`).
        route: send each part of a call straight to the node that holds it, by
            the cluster's topology (see :mod:`.routing`); False: every call
            to this client's node, which passes on what it does not hold.
        read_from: where reads go: ``"primary"`` (each name's primary: reads
            see every acknowledged write), ``"any"`` (any live replica:
            spreads reads; they see this client's own writes, but may lag
            another's by a replication message) or ``"auto"`` (``"any"``
            where the cluster acknowledges a write once every live replica
            holds it, ``--acks all``; else ``"primary"``). See
            :mod:`.routing`.
        shared_memory: with a node on this host, on its Unix socket (``unix:PATH``,
            or the one a node reached over TCP names: see :mod:`.local`), the most
            memory (bytes) this client shares with it, so that tensors cross by one
            copy, not through the socket (see :mod:`.shared`); 0: none, and on TCP.

    Every timeout, here and per call, is None or a finite number of seconds
    above 0; anything else (0, a negative number, NaN, infinity, a bool) is a
    ValueError where it is given.

    Raises:
        ValueError: an argument out of its range (see above for timeouts).
    """

    def __init__(
        self,
        address: Address | Iterable[Address],
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_inline_bytes: int = pieces.INLINE_BYTES,
        piece_bytes: int = pieces.PIECE_BYTES,
        ssl: ssl_module.SSLContext | None = None,
        route: bool = True,
        read_from: str = "auto",
        shared_memory: int = DEFAULT_SHARED_MEMORY_BYTES,
    ) -> None:
        super().__init__(
            address,
            timeout=timeout,
            connect_timeout=connect_timeout,
            max_connections=max_connections,
            max_frame_bytes=max_frame_bytes,
            ssl=ssl,
        )
        if not 0 < piece_bytes < max_frame_bytes or max_inline_bytes < 0:
            raise ValueError(
                "piece_bytes must be above 0 and below max_frame_bytes, and max_inline_bytes "
                "not negative"
            )
        self.max_inline_bytes = max_inline_bytes
        self.piece_bytes = piece_bytes
        #: the client's routing (None: not routed)
        self.routes = Routes(self, read_from) if route else None
        self._feedback: Any = None  # a values.feedback.ErrorFeedback, made when first needed
        # The last push with error feedback under a caller's request id, and what
        # it sent: sent again under that id, it goes as it went (see push_gradients).
        self._last_push: tuple[str, list[Any]] | None = None
        # name -> the rule the node answered or this client set (top-k's bound
        # follows the rule's momentum: see values.feedback)
        self._rules: dict[str, Any] = {}
        self._auto: Any = None  # an .auto.Auto (encoding="auto"), made when first asked for
        self._packs = False  # a node answered a read in blocks (see .gradients._packed)
        self._lane = lane_for(self.addresses, shared_memory)  # (None: no shared memory)
        # (a node on this host reached over TCP: its Unix socket instead, and a lane there)
        self.find_local = self._ask_local = self._lane is None and may_share(shared_memory)
        self._shared_limit, self._local_lane = shared_memory, self._lane
        self._tables = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> ParameterClient:
        """A client of the nodes the environment names (default: ``os.environ``).

        ``AIOPARAMSYNC_ADDRESSES`` (else ``AIOPARAMSYNC_PEERS_DNS``) and the TLS
        files ``AIOPARAMSYNC_TLS_CA``, ``_TLS_CERT``, ``_TLS_KEY``, as the nodes
        read them (see :mod:`.environment`); ``kwargs`` are the constructor's.

        Raises:
            ValueError: no addresses, or a variable that is not what it should be
                (the message names it).
        """
        from .environment import client_options

        return cls(**{**client_options(environ), **kwargs})

    async def close(self) -> None:
        if self.routes is not None:
            await self.routes.close()
        await super().close()
        if self._local_lane is not None:
            self._local_lane.close()

    async def invoke(
        self, m: Any, /, *, timeout: float | EllipsisType | None = ..., **args: Any
    ) -> Any:
        """As :meth:`ConnectionPool.invoke`; a call naming parameters is routed (see
        :mod:`.routing`)."""
        routes = self.routes
        if routes is None or m.name not in ROUTED or not routes.wanted():
            return await ConnectionPool.invoke(self, m, timeout=timeout, **args)
        return await routes.invoke(m, timeout, args)

    async def topology(self, *, timeout: float | EllipsisType | None = ...) -> Any:
        """The cluster as the node sees it (the IDL's ``Topology``: epoch, members, R)."""
        return await self.invoke(METHODS.topology, timeout=timeout)

    async def shutdown_cluster(
        self, *, snapshot: bool = False, timeout: float | EllipsisType | None = ...
    ) -> Any:
        """Stop every node of the cluster, so a job's cluster ends with its workers.

        The node tells every member it knows; none hands anything off. With
        ``snapshot``, each node with a data directory takes no more writes and
        writes its final snapshot before it answers (else as it stops). Answers
        the IDL's ``ShutdownResult``: ``stopping`` nodes, ``snapshots`` written,
        ``unreached`` members. A node serving TLS refuses it unless it verifies
        its clients' certificates (``--tls-ca``).
        """
        request = thrift.ShutdownRequest(cluster=True, snapshot=snapshot)
        return await self.invoke(METHODS.shutdown, timeout=timeout, request=request)

    async def get_parameters(
        self,
        names: Iterable[str] | None,
        min_version: int = 0,
        *,
        wait: float | None = None,
        known_versions: Mapping[str, int | tuple[int, str]] | None = None,
        encoding: str | None = None,
        rules: bool = True,
        packed: bool = False,
        timeout: float | EllipsisType | None = ...,
    ) -> Any:
        """Fetch parameters: those of ``names`` that exist with ``version >= min_version``.

        The response is one consistent snapshot: an update is in it wholly or
        not at all. Names that do not qualify are left out.

        Args:
            names: the parameters' names; None: every parameter the node holds.
            min_version: leave out parameters older than this.
            wait: a long poll (stale-synchronous training): wait up to this
                many seconds for every name to reach ``min_version``; the
                call's deadline is extended by as much. 0: answer at once,
                or ``TIMEOUT`` naming what is not there yet.
            known_versions: a delta pull: the version held of each name, or
                its ``(version, origin)`` as a response gave them; a parameter
                comes back only if the node has a newer one. With the origin,
                also the same version from another writer that won (two
                nodes wrote it at once: last-writer-wins).
            encoding: ask for the data encoded (``"fp16"``, ``"bf16"``,
                ``"int8"``, ``"zlib"``; see :mod:`aioparamsync.values.compression`).
            rules: False: each parameter without its rule (``rule`` None), less
                to send and read (a node older than this option sends them).
            packed: with ``rules=False``, let the node answer raw parameters in
                ``response.packed``, several of a dtype in a block
                (:func:`aioparamsync.values.packing.unpack` reads them).
            timeout: this call's deadline (seconds; default: the client's).

        Returns:
            A ``ParameterResponse``: ``params`` (each ``data`` a read-only view
            of the received bytes; ``encoding`` set where encoded) and the
            node's ``timestamp``.

        Raises:
            RequestError: the node refused the request (e.g. too many names),
                or ``TIMEOUT``: the wait ended first (the message names the
                parameters that did not come).
            CallTimeout, NetworkError, ServerError: see :mod:`aioparamsync.errors`.
        """
        if isinstance(names, (str, bytes)):
            raise TypeError("names must be a list of names, not one string")
        if encoding == "auto":
            if names is None:
                raise ValueError('encoding="auto" needs the names (their sizes are what it weighs)')
            encoding = (await self._auto_of()).pull_encoding(names)
        request = thrift.ParameterRequest(
            param_names=list(names) if names is not None else [],
            min_version=min_version,
            all_names=True if names is None else None,
            encoding=encoding,
            without_rules=None if rules else True,
            packed=True if packed and not rules else None,
        )
        if known_versions is not None:
            versions, origins = {}, {}
            for name, held in known_versions.items():
                if isinstance(held, tuple):
                    versions[name], origins[name] = held
                else:
                    versions[name] = held
            request.known_versions = versions
            request.known_origins = origins or None
        if wait is not None:
            check_seconds(wait, "wait", zero=True)
            request.wait_ms = min(round(wait * 1000), MAX_WAIT_MS)
            timeout = self._held_timeout(wait, timeout)
        request.max_inline_bytes = self.max_inline_bytes
        # (time.monotonic: no getpid() system call, as asyncio.get_running_loop() makes on 3.11)
        started = time.monotonic()
        response = await read_lent(
            self._lane,
            request,
            lambda: self.invoke(METHODS.pull_parameters, timeout=timeout, request=request),
        )
        if any(p.total_bytes is not None for p in response.params):
            # Larger than one message: answered without data; read in pieces,
            # within what is left of this call's deadline.
            deadline = self.timeout if isinstance(timeout, EllipsisType) else timeout
            left = None if deadline is None else deadline - (time.monotonic() - started)
            try:
                async with asyncio.timeout(left):
                    response.params = await fetch_all(
                        self, response.params, self.piece_bytes, timeout=timeout
                    )
            except TimeoutError:
                raise CallTimeout(f"pull_parameters did not complete within {deadline} s") from None
        known = self._rules
        for p in response.params:
            if p.rule is not None:
                known[p.name] = p.rule
        if self._auto is not None and self._auto.measuring:
            self._auto.observe_read(response.params, time.monotonic() - started)
        return response

    def _held_timeout(
        self, wait: float, timeout: float | EllipsisType | None
    ) -> float | EllipsisType | None:
        if isinstance(timeout, EllipsisType):
            return None if self.timeout is None else wait + HOLD_MARGIN + self.timeout
        return timeout

    async def update_parameters(
        self,
        params: Iterable[Any] | Mapping[str, Any],
        *,
        rules: Any = None,
        encoding: str | None = None,
        replace: bool | Collection[str] = False,
        timestamp: int | None = None,
        acks: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, int]:
        """Apply an update atomically: every parameter in it, or none.

        A stored parameter keeps its dtype and shape: an update that gives it
        another is refused (``SHAPE_MISMATCH``, naming both layouts) unless
        ``replace`` says to replace it.

        A parameter larger than ``max_inline_bytes`` (see the constructor)
        goes in pieces, and the node applies it once it is whole: atomically
        by itself, not together with the rest of the update.

        Args:
            params: ``Parameter`` objects, or a mapping of name -> array.
            rules: the rule :meth:`push_gradients` folds gradients in by
                (see :mod:`aioparamsync.values.rules`): one for every parameter, or
                a mapping of name -> rule. Parameters without one keep theirs.
            encoding: send arrays encoded (``"fp16"``, ``"bf16"``, ``"int8"``,
                ``"zlib"``); the node stores them decoded. An array larger than
                ``max_inline_bytes`` even encoded goes raw, in pieces.
            replace: replace stored parameters whose dtype or shape the update
                changes: True for every parameter of the update, or the names
                of those to replace. (Their rule stays if it fits the new
                dtype; their optimizer state starts again.)
            timestamp: the update's timestamp (default: now, in milliseconds).
            acks: when the node answers: ``"1"`` once each parameter's
                primary applied it (and logged it, with a data directory),
                ``"all"`` once every live replica did; None: the node's
                ``--acks``. In a cluster, an update whose parameters have
                different primaries is atomic at each of them; a reader of
                two may see one part before the other.
            timeout: this call's deadline (seconds; default: the client's).

        Returns:
            The version each parameter now has.

        Raises:
            RequestError: the node refused the update (nothing was applied).
            ConnectionLostError: the connection broke; the update may or may
                not have been applied.
        """
        update = make_update(params, timestamp, rules=rules, encoding=encoding, replace=replace)
        if acks is not None:
            if acks not in ("1", "all"):
                raise ValueError(f'acks is "1" or "all", not {acks!r}')
            update.acks = acks
        for p in update.params:
            if p.rule is not None:
                self._rules[p.name] = p.rule
        routes = self.routes
        large = [
            p
            for p in update.params
            if memoryview(p.data).nbytes > self.max_inline_bytes
            and not (routes is not None and routes.wanted() and routes.cuts(p))
        ]
        if not large:
            result = await self.invoke(METHODS.push_parameters, timeout=timeout, update=update)
            return dict(result.versions)
        # Larger than one message: each such parameter in pieces, applied once
        # whole; the others together, as one update.
        return await push_in_pieces(self, update, large, params, timeout=timeout)

    async def watch(
        self,
        names: Iterable[str] | None = None,
        *,
        prefix: str | None = None,
        wait: float = WATCH_WAIT,
    ) -> AsyncGenerator[dict[str, int], None]:
        """Yield ``{name: version}`` as the names watched change, without polling each.

        ``async for changed in client.watch(["w", "b"]):`` (or ``prefix="layer."``;
        ``""``: every name). The first yield has every name watched that exists,
        with its version; each next one the names whose version changed since
        the one before. Writes between two yields are coalesced: a consumer
        slower than the writes sees the newest version of each name, never a
        backlog. Read the values with :meth:`get_arrays` (``min_version`` the
        version yielded). Works on a node alone and in a cluster (each node
        watched where it holds the keys), partitioned parameters too (see
        :mod:`aioparamsync.client.watch`); it ends when the loop does.

        Args:
            names: the names to watch; or
            prefix: every name that starts with it.
            wait: how long each node holds a watch call before it is sent again
                (seconds; no change is missed meanwhile).

        Raises:
            ValueError: neither or both of ``names`` and ``prefix``; a bad ``wait``.
            TypeError: ``names`` is one string (give a list).
            RequestError: a node refused the watch (e.g. ``LIMIT_EXCEEDED``).
        """
        if isinstance(names, str):
            raise TypeError(f"names is a list of names, not one string ({names!r}): [{names!r}]")
        if (names is None) == (prefix is None):
            raise ValueError("watch names, or a prefix: one of the two")
        check_seconds(wait, "wait")
        async for changed in Watcher(self, None if names is None else list(names), prefix, wait):
            yield changed

    async def barrier(
        self,
        group: str,
        worker: str,
        step: int,
        world_size: int,
        *,
        timeout: float | None = 600.0,
    ) -> Any:
        """Wait until ``world_size`` workers of ``group`` have reached ``step``.

        Bulk-synchronous training: each worker calls it after each step. Every
        worker of a group must use the same node. While it waits, the node's
        ``info`` (and ``aioparamsync-ctl waiting``) shows who is missing.

        Args:
            group: the barrier's name.
            worker: this worker's name, unique in the group.
            step: the step this worker has finished.
            world_size: how many workers the group has.
            timeout: the longest to wait (seconds; None: the node's maximum).

        Returns:
            A ``BarrierResult``: the group, the step, the workers that passed.

        Raises:
            RequestError: ``TIMEOUT`` (naming the workers that did not come),
                or BAD_REQUEST (e.g. a world_size the group disagrees with).
        """
        if not isinstance(group, str) or not isinstance(worker, str):
            raise TypeError(
                f"a barrier's group and worker are names (str), e.g. worker=f'rank{{rank}}'; "
                f"got {type(group).__name__} and {type(worker).__name__}"
            )
        check_seconds(timeout, "timeout")
        request = thrift.BarrierRequest(
            group=group,
            worker=worker,
            step=step,
            world_size=world_size,
            # (at least 1 ms: 0 would be no wait at all)
            wait_ms=None if timeout is None else min(max(round(timeout * 1000), 1), MAX_WAIT_MS),
        )
        deadline = None if timeout is None else timeout + HOLD_MARGIN
        return await self.invoke(METHODS.barrier, timeout=deadline, request=request)

    async def broadcast_update(
        self,
        params: Iterable[Any] | Mapping[str, Any],
        *,
        timestamp: int | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> None:
        """Send an update oneway: no reply, and no error from the node if it refuses it.

        Returns once the node has read and applied it (a ``ping`` follows it on
        the connection, and the node answers reads in order), so the arrays may
        change again and a later read on any client sees it.
        """
        update = make_update(params, timestamp)
        await self.invoke(METHODS.broadcast_update, timeout=timeout, update=update)

    async def get_arrays(
        self,
        names: Iterable[str] | None,
        min_version: int = 0,
        *,
        wait: float | None = None,
        known_versions: Mapping[str, int | tuple[int, str]] | None = None,
        encoding: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, np.ndarray]:
        """Fetch parameters as numpy arrays, by name (see :meth:`get_parameters`).

        Raw data comes as read-only views of the received bytes (no copy);
        encoded data is decoded into new arrays. The parameters' rules are
        not sent, unless this client compresses gradients with error feedback
        (which bounds what it holds back by each parameter's rule, as last
        read or set).
        """
        rules = self._feedback is not None or self._auto is not None
        routes = self.routes
        response = await self.get_parameters(
            names,
            min_version,
            wait=wait,
            known_versions=known_versions,
            encoding=encoding,
            rules=rules,
            # (a routed read merges the nodes' answers by Parameter: one node's, in blocks)
            packed=not rules and (routes is None or not routes.wanted()),
            timeout=timeout,
        )
        if response.packed:
            self._packs = True  # (the node knows blocks: pushes may send them so too)
        return arrays_of(response)

    async def update_arrays(
        self,
        arrays: Mapping[str, Any],
        *,
        rules: Any = None,
        encoding: str | None = None,
        replace: bool | Collection[str] = False,
        timestamp: int | None = None,
        acks: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, int]:
        """Store numpy arrays (any numeric dtype and shape) atomically; answer their versions.

        A stored parameter keeps its dtype and shape unless ``replace`` names
        it. See :meth:`update_parameters` for ``rules``, ``encoding``,
        ``replace`` and ``acks``.
        """
        if not isinstance(arrays, Mapping):
            raise TypeError("arrays must be a mapping of name -> array")
        return await self.update_parameters(
            arrays,
            rules=rules,
            encoding=encoding,
            replace=replace,
            timestamp=timestamp,
            acks=acks,
            timeout=timeout,
        )

    async def checkpoint(
        self, directory: str | os.PathLike[str], *, hold_ms: int = 10_000
    ) -> dict[str, Any]:
        """Write the whole cluster's parameters and tables into ``directory`` (new or
        empty) at one cut: of every update call, all of its parameters or none;
        answer the manifest (see :mod:`aioparamsync.client.checkpoint`).

        Raises:
            CheckpointError: it could not be taken (nothing is left behind).
        """
        from .checkpoint import checkpoint

        return await checkpoint(self, directory, hold_ms=hold_ms)

    async def restore(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Write the checkpoint in ``directory`` into this cluster (of any size) through
        the normal write path; answer its manifest. Every file is checked first.

        Raises:
            CheckpointError: no checkpoint there, or a damaged one (nothing written).
        """
        from .restore import restore

        return await restore(self, directory)

    async def ping(self, *, timeout: float | EllipsisType | None = ...) -> str:
        """Answer the node's id."""
        return await self.invoke(METHODS.ping, timeout=timeout)

    async def info(self, *, timeout: float | EllipsisType | None = ...) -> Any:
        """The node's ``NodeInfo`` (what ``aioparamsync-ctl stats`` shows).

        Its fields: ``node_id``; ``version``, the aioparamsync release the
        node runs (not a parameter's version); ``parameter_count`` and
        ``parameter_bytes``, the parameters it holds and their bytes;
        ``timestamp``, the largest update timestamp it has applied (0 before
        any); ``uptime_seconds``, since the node was made; ``counters``, by
        name, each there from the start (0 until it counts): the server's
        ``requests`` (messages received), ``errors`` (calls answered with an
        error), ``protocol_errors``, ``timeouts``, ``bytes_in`` and
        ``bytes_out`` (of every connection to its port, framing included),
        ``connections_total``, ``connections_refused``, ``idle_closed``,
        ``budget_waits``, ``budget_overruns``; the store's
        (``updates_applied``, ``updates_refused``, ``batches``, ``pending``,
        ...), the waits' (``long_polls_waiting``, ``barrier_waiters``,
        ``wait_timeouts``, ...), the uploads' and the gradient pushes';
        ``peers``, a ``PeerInfo`` per peer link (state, outbox depth, updates
        sent and coalesced, send failures, replication lag, last error,
        parameters repaired); ``waiting``, a ``Waiter`` per long poll or
        barrier held (what it waits for, whom, and for how many seconds).
        """
        return await self.invoke(METHODS.info, timeout=timeout)
