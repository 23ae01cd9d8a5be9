"""The service: each IDL method of ``ParameterSyncService``, served from the store.

Reads (long polls too), updates (whole or in pieces), barriers and the node's
own methods (ping, info, announce, digest) are answered here; gradient pushes
by :mod:`aioparamsync.server.gradients`. What long polls and barriers wait for
is kept by :mod:`aioparamsync.server.holds`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._ext import fast_path
from .._version import __version__
from ..errors import ErrorCode, RequestError
from ..placement import barrier_key, manifest_key
from ..store.table import Entry, lww_key
from ..store.writer import NOT_NOW, ParameterStore
from ..values.packing import packed_response, shared_response
from ..values.partitions import DEFAULT_PARTITION_BYTES
from ..values.pieces import MAX_UPLOAD_BYTES, Uploads
from ..wire import DEFAULT_MAX_FRAME_BYTES, METHODS, Method, thrift
from .clusterview import ClusterView
from .cuts import Cuts
from .digests import bucket_digest, digest, digest_for, lift
from .gradients import GradientPushes, decode_parameter, update_result
from .holds import Waiting
from .partitioned import Partitioned, check_names, inline_limit, is_manifest, piece_of
from .routing import Router
from .rows import RowService
from .smallcalls import fast_calls
from .watches import Watches

__all__ = ["ParameterService"]

# What a node answers while it starts (see ParameterService.starting): health and info.
_WHILE_STARTING = frozenset({METHODS.ping.name, METHODS.info.name})
# What a follower refuses (see ParameterService.following): the writes of data.
# (not what its own cluster's members send it: a cluster of followers moves keys as any does)
_FOLLOWER_TAKES = {"drain", "shutdown", "replicate_rows"}
_FOLLOWER_REFUSES = frozenset(m.name for m in METHODS if m.writes) - _FOLLOWER_TAKES

log = logging.getLogger(__name__)


# The server's counters (see transport.py), in info's counters from the start:
# 0 until they count something, so a reader need not guess what is missing.
SERVER_COUNTERS = (
    "requests", "errors", "protocol_errors", "timeouts", "bytes_in", "bytes_out",
    "connections_total", "connections_refused", "idle_closed", "budget_waits",
    "budget_overruns",
)  # fmt: skip


def _newer(entry: Entry, version: int, origin: str | None) -> bool:
    """Whether ``entry`` is newer than the ``version`` (of ``origin``, if known) a caller holds.

    At equal versions the larger origin has won (last-writer-wins, as the
    store merges): newer, if the caller holds the other.
    """
    if origin is None:
        return entry.version > version
    return lww_key(entry) > (version, origin)


def _done(value: Any) -> asyncio.Future:
    """A future done already, with ``value``."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def _then(future: asyncio.Future, make: Callable[[Any], Any]) -> asyncio.Future:
    """A future of ``make(result)`` once ``future`` succeeds (its error otherwise).

    Cancelling the answer cancels ``future`` (a caller that went away).
    """
    answer = asyncio.get_running_loop().create_future()

    def settle(done: asyncio.Future) -> None:
        if answer.done():
            return
        if done.cancelled():
            answer.cancel()
        elif (exc := done.exception()) is not None:
            answer.set_exception(exc)
        else:
            try:
                answer.set_result(make(done.result()))
            except Exception as error:  # noqa: BLE001 - the reply says what failed
                answer.set_exception(error)

    future.add_done_callback(settle)
    answer.add_done_callback(lambda a: future.cancel() if a.cancelled() else None)
    return answer


def _params(update: Any) -> tuple[Sequence[Any], int]:
    if update is None:
        raise RequestError(ErrorCode.BAD_REQUEST, "the update is missing")
    return update.params, update.timestamp


class ParameterService:
    """Answers every method of the IDL from a :class:`ParameterStore`.

    Args:
        store: where parameters live; ``ping`` answers its table's node id.
        cluster: the node's cluster as the server reads it (:mod:`.clusterview`), or None.
        counters: the server's counters, reported by ``info``.
        max_decoded_bytes: the largest array an encoded parameter may decode to,
            and the largest piece of a parameter answered.
        max_upload_bytes: the most bytes unfinished uploads of large
            parameters may hold (see :mod:`aioparamsync.values.pieces`).
        partition_bytes: parameters of more than this many bytes of float32
            are stored as partitions (see :mod:`aioparamsync.values.partitions`);
            0: every one whole.
    """

    # The methods the server orders reads behind (see aioparamsync.wire.idl).
    writes = frozenset(m.name for m in METHODS if m.writes)

    def __init__(
        self,
        store: ParameterStore,
        cluster: ClusterView | None = None,
        counters: Mapping[str, int] | None = None,
        *,
        max_decoded_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_upload_bytes: int = MAX_UPLOAD_BYTES,
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
    ) -> None:
        self.store = store
        self.partitioned = Partitioned(self, partition_bytes)
        self.max_decoded_bytes = max_decoded_bytes
        self.uploads = Uploads(max_upload_bytes)
        self.cluster = cluster
        self.counters: Mapping[str, int] = counters if counters is not None else {}
        self.started = time.monotonic()
        self.waiting = Waiting(store)
        self.gradients = GradientPushes(
            store, cluster, self.waiting, max_decoded_bytes, partition_bytes=partition_bytes
        )
        self.router = Router(cluster)
        self.watches = Watches(store, self.router)
        self.cuts = Cuts(store)
        #: the embedding tables (see .rows)
        self.rows = RowService(cluster)
        #: called by drain(wait_ms): a future of the keys handed off (set by the node)
        self.on_drain: Callable[[float | None], asyncio.Future] | None = None
        #: what answers a shutdown (the node's: see Node.shutdown)
        self.on_shutdown: Callable[[Any], asyncio.Future] | None = None
        #: why this node serves no call yet but ping and info (None: it serves): a node
        #: listens before it is in its cluster (its id is its address), and alone it
        #: would serve every key as its own (the node's: see Node.start)
        self.starting: str | None = None
        #: why this node takes no writes (None: it does): it follows another cluster
        self.following: str | None = None
        #: more of info's counters: each answers some (a follower's lag)
        self.statistics_hooks: list[Callable[[], Mapping[str, int]]] = []
        self.local_socket: str | None = None  # (info's: where clients on this host connect)
        #: small calls answered in C, or None (see .smallcalls): the connections' to call
        self.fast_calls = fast_calls(self)
        # Each method of the IDL's table and its handler, by the method's name.
        handlers: dict[Method, Callable[[Method, Any], Any]] = {
            METHODS.get_parameters: self._get_parameters,
            METHODS.update_parameters: self._update_parameters,
            METHODS.broadcast_update: self._broadcast_update,
            METHODS.pull_parameters: self._pull_parameters,
            METHODS.push_parameters: self._push_parameters,
            METHODS.push_gradients: self.gradients.push,
            METHODS.barrier: self._barrier,
            METHODS.watch: self.watches.handle,
            METHODS.cut: self.cuts.handle,
            METHODS.ping: self._ping,
            METHODS.info: self._info,
            METHODS.announce: self._announce,
            METHODS.digest: self._digest,
            METHODS.topology: self._topology,
            METHODS.digest_for: self._digest_for,
            METHODS.lift: self._lift,
            METHODS.drain: self._drain,
            METHODS.shutdown: self._shutdown,
            **self.rows.handlers(),
        }
        if missing := [m.name for m in METHODS if m not in handlers]:
            raise RuntimeError(f"IDL methods without a handler: {missing}")
        self._handlers = {m.name: handler for m, handler in handlers.items()}
        # While uploads are open: the timer that drops those abandoned (see _sweep).
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def node_id(self) -> str:
        return self.store.table.node_id

    @property
    def forward_failures(self) -> int:
        """Gradient pushes (parts of them) that could not reach their owner, folded here."""
        return self.gradients.forward_failures

    def handle(self, method: Method, args: Any) -> Any:
        if self.starting is not None and method.name not in _WHILE_STARTING:
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"node {self.node_id or '(starting)'} is {self.starting}: nothing was "
                "done; try again, or another node",
            )
        if (
            self.following is not None
            and method.name in _FOLLOWER_REFUSES
            and not (method.name == "broadcast_update" and args.update and args.update.from_peer)
        ):
            raise RequestError(ErrorCode.BAD_REQUEST, f"node {self.node_id} {self.following}")
        return self._handlers[method.name](method, args)

    # -- the founding methods ----------------------------------------------------

    def _read(self, request: Any, packed: bool = False) -> Any:
        """The response to a read, now (``packed``: in blocks, see :mod:`..values.packing`);
        a name stored as partitions by its manifest (the partitions' versions are its)."""
        table = self.store.table
        min_version = request.min_version or 0
        manifests: list[Entry] = []
        if request.all_names:
            entries = []
            for name in table.names():
                if (e := table.entry(name)) is None:
                    continue
                if is_manifest(name):
                    manifests.append(e)
                elif e.version >= min_version:
                    entries.append(e)
        else:
            names = request.param_names
            entries = self.store.read(names, min_version)
            if len(entries) < len(names):
                manifests = self.partitioned.manifests(names, entries)
        known = request.known_versions
        if known:
            origins = request.known_origins or {}
            entries = [e for e in entries if _newer(e, known.get(e.name, 0), origins.get(e.name))]
        ts = self.store.timestamp
        if packed and not manifests and (shared := shared_response(request, entries, ts)):
            return shared  # (into the client's memory: see .shared)
        limit = inline_limit(request)
        if request.piece_offset is not None:
            params = piece_of(request, entries, self.max_decoded_bytes)
        elif sum(e.data.nbytes for e in entries) > limit and (
            request.max_inline_bytes is not None or any(e.nbytes > limit for e in entries)
        ):  # (one over the limit makes the sum so: a read of small ones sums them once)
            budget = [limit]  # (what the answer may still carry: the rest as headers)
            params = [self._inline_or_header(request, e, budget) for e in entries]
        elif request.encoding:
            params = [self.encoded(e, request.encoding, not request.without_rules) for e in entries]
        elif packed and not manifests:
            return packed_response(entries, ts)
        else:
            params = [e.to_parameter(not request.without_rules) for e in entries]
        if manifests:
            params += [e.to_parameter() for e in manifests]
        return thrift.ParameterResponse(params=params, timestamp=ts)

    def _inline_or_header(self, request: Any, entry: Entry, budget: list[int]) -> Any:
        """A parameter in the answer, or its header (no data, total_bytes) where it is over
        ``budget[0]``: what the answer may still carry, for a caller that reads pieces."""
        rule = not request.without_rules
        if entry.nbytes > budget[0]:
            if request.max_inline_bytes is None:  # a client that cannot take pieces
                raise RequestError(
                    ErrorCode.LIMIT_EXCEEDED,
                    f"{entry.name!r} has {entry.nbytes} bytes, more than one message holds: "
                    "read it in pieces (ParameterRequest.max_inline_bytes)",
                )
            header = entry.to_parameter(rule)
            header.data, header.total_bytes = b"", entry.nbytes
            return header
        if request.max_inline_bytes is not None:
            budget[0] -= entry.nbytes
        if request.encoding:
            return self.encoded(entry, request.encoding, rule)
        return entry.to_parameter(rule)

    def incoming(self, params: Sequence[Any]) -> Sequence[Any]:
        """An update's parameters as the store takes them: whole and decoded.

        The pieces of a large parameter are put aside until it is whole (see
        :class:`~aioparamsync.values.pieces.Uploads`); the piece that completes it
        brings the whole in its place. Encoded ones are decoded.
        """
        if not any(p.encoding or p.total_bytes is not None for p in params):
            return params
        max_nbytes = self.max_decoded_bytes
        ready = []
        for p in params:
            if p.encoding == "topk":
                from ..values.compression import TOPK_IS_FOR_GRADIENTS

                raise RequestError(ErrorCode.BAD_REQUEST, f"{p.name!r}: {TOPK_IS_FOR_GRADIENTS}")
            if p.total_bytes is not None:
                if (whole := self.uploads.add(p)) is not None:
                    ready.append(whole)
                elif self._sweeper is None:
                    self._sweep_later()
            else:
                ready.append(decode_parameter(p, max_nbytes) if p.encoding else p)
        return ready

    def _sweep_later(self) -> None:
        # A quarter of the timeout: an abandoned upload's buffer goes within
        # 1.25 timeouts of its last piece, even if no other piece ever comes.
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(self.uploads.timeout / 4, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        self.uploads.sweep()
        if len(self.uploads):
            self._sweep_later()

    def close(self) -> None:
        """Stop the timers of this service (the node is stopping)."""
        self.cuts.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    @staticmethod
    def encoded(entry: Entry, encoding: str, rule: bool = True) -> Any:
        """``entry`` as a ``Parameter`` in ``encoding`` (raw where it cannot be encoded);
        ``rule=False``: without its rule."""
        from ..values import compression
        from ..values.arrays import from_parameter

        if not compression.encodable(entry.dtype, encoding):
            return entry.to_parameter(rule)  # e.g. fp16 of integers: sent raw
        try:
            param = compression.encode(entry.name, from_parameter(entry), encoding)
        except ValueError:
            # int8 has no code for NaN or inf (say, after a model diverged):
            # sent raw, as are values no encoding fits.
            return entry.to_parameter(rule)
        param.version, param.origin = entry.version, entry.origin
        param.rule = entry.rule if rule else None
        if entry.dtype is None:  # plain bytes: a shape says how many
            param.dtype, param.shape = None, [entry.nbytes]
        return param

    def _pull(self, method: Method, request: Any) -> Any:
        if request is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the request is missing")
        router = self.router
        if request.epoch is None:
            check_names(request.param_names)
            if request.known_versions:
                check_names(request.known_versions)
        outcome: Any = None
        # (a peer's repair reads what is stored here: passed on, it could wait for the
        # very node repairing, behind writes that wait for that repair: a cycle)
        if not router.alone() and not request.as_stored:
            if request.epoch is not None:  # routed by a topology: what this node holds
                if not request.all_names:
                    router.check_routed(request.param_names)
            elif request.all_names:
                if request.wait_ms is None:
                    outcome = asyncio.ensure_future(
                        router.read_everything(
                            request, self.pull_here(request), METHODS.pull_parameters
                        )
                    )
            elif (parts := router.read_parts(request.param_names)) is not None:
                self.store.read(request.param_names)  # (checks the request's size)
                outcome = asyncio.ensure_future(
                    router.read(request, parts, self.pull_here, METHODS.pull_parameters)
                )
        if outcome is None:  # (served here alone: in blocks, if asked, and not a long poll)
            outcome = self.pull_here(request, request.packed and request.without_rules)
        # (a routed caller puts partitioned ones together itself)
        if (
            request.epoch is None
            and not request.as_stored
            and (
                isinstance(outcome, asyncio.Future) or any("\x00" in p.name for p in outcome.params)
            )
        ):
            outcome = asyncio.ensure_future(self.partitioned.whole(request, outcome))
        if isinstance(outcome, asyncio.Future):
            return _then(outcome, lambda r: method.result(success=r))
        return method.result(success=outcome)

    def pull_here(self, request: Any, packed: bool = False) -> Any:
        """A read served here: its ``ParameterResponse``, or a future of it (a long poll);
        ``packed``: answered in blocks, unless it is a long poll."""
        if request.encoding:
            from ..values.compression import PULL_ENCODINGS

            if request.encoding not in PULL_ENCODINGS:
                raise RequestError(
                    ErrorCode.BAD_REQUEST,
                    f"a pull cannot be encoded {request.encoding!r}; one of "
                    f"{', '.join(PULL_ENCODINGS)}",
                )
        if request.wait_ms is None:
            return self._read(request, packed)
        if request.all_names:
            raise RequestError(ErrorCode.BAD_REQUEST, "a long poll names its parameters")
        names = request.param_names
        self.store.read(names)  # (checks the request's size)
        table = self.store.table
        # (a partitioned one is answered by its manifest; its partitions are waited for)
        waited = [n for n in names if n in table or manifest_key(n) not in table]
        ready = self.waiting.poll(waited, request.min_version or 0, request.wait_ms)
        return _then(ready, lambda _: self._read(request))

    def _get_parameters(self, method: Method, args: Any) -> Any:
        return self._pull(method, args.request)

    def _update_parameters(self, method: Method, args: Any) -> asyncio.Future:
        # The store's writer makes the reply as it answers the batch.
        return self._write(args.update, lambda _: method.result())

    def _broadcast_update(self, method: Method, args: Any) -> asyncio.Future:
        # From a peer (it says so: from_peer), replication: merged, sent on to
        # no one. From a client: an update like any other.
        if args.update is not None and args.update.from_peer is not None:
            if self.cluster is not None and not self.cluster.trusted(args.update.from_peer):
                # (a member whose lease expired: what it sends may be writes its
                # replicas never confirmed, and could win over acknowledged ones)
                log.debug("replication from %s ignored: not a member", args.update.from_peer)
                return _done(None)
            params, timestamp = _params(args.update)
            return self.store.submit(self.incoming(params), timestamp, replicated=True)
        return self._write(args.update, lambda _: None)

    def _write(self, update: Any, answer: Callable[[Any], Any]) -> asyncio.Future:
        """Apply a client's update (here, or cut by primary: see :mod:`.routing`).

        ``answer(result)`` makes the reply of its ``UpdateResult``. An update
        with a parameter to store as partitions goes by :meth:`_write_cut`.
        """
        params, timestamp = _params(update)
        cluster = self.cluster
        acks = update.acks
        if acks is None:
            acks = cluster.acks if cluster is not None else "1"
        elif acks not in ("1", "all"):
            raise RequestError(ErrorCode.BAD_REQUEST, f'acks is "1" or "all", not {acks!r}')
        if update.epoch is None:
            check_names([p.name for p in params])
        if cluster is not None and cluster.coordinator is not None:  # (fenced: refused)
            cluster.check_writable([p.name for p in params], acks)
        partitioned = self.partitioned
        if partitioned.partition_bytes and any(partitioned.large(p) for p in params):
            return _then(asyncio.ensure_future(partitioned.write(update, params, acks)), answer)
        router = self.router
        alone = router.alone()
        parts = None
        if not alone:
            names = list(dict.fromkeys(p.name for p in params))
            if update.epoch is not None:
                router.check_routed(names)
            else:
                parts = router.write_parts(names)
        if shrinking := partitioned.shrinking(params):  # (stored as partitions here, now whole)
            shrunk = partitioned.shrink(update, params, parts, acks, shrinking)
            return _then(asyncio.ensure_future(shrunk), answer)
        if parts is None and (acks == "1" or alone):
            checked = self.partitioned.checked(self.incoming(params))
            store = self.store

            def reply(applied: Any) -> Any:
                return answer(update_result(applied))

            if alone:  # (a cluster's primary sends what it applies on, by batches)
                done = store.apply_now(checked, timestamp, reply, update.call)
                if done is not NOT_NOW:
                    return done
            return store.submit(checked, timestamp, then=reply, call=update.call)
        return _then(asyncio.ensure_future(self.write_parts(update, params, parts, acks)), answer)

    async def write_parts(self, update: Any, params: Sequence[Any], parts: Any, acks: str) -> Any:
        """``params`` of ``update`` applied where they are held (``parts``: see Router.write)."""
        router = self.router
        if parts is not None:
            whole = [p for p in params if p.total_bytes is None and not p.encoding]
            self.store.table.check(whole)  # (refused before any part is applied elsewhere)

        def here(mine: Sequence[Any], call: str | None) -> asyncio.Future:
            checked = self.partitioned.checked(self.incoming(mine))
            return self.store.submit(checked, update.timestamp, then=update_result, call=call)

        return await router.write(update, params, parts, here, acks)

    # -- the typed methods --------------------------------------------------------

    def _pull_parameters(self, method: Method, args: Any) -> Any:
        return self._pull(method, args.request)

    def _push_parameters(self, method: Method, args: Any) -> asyncio.Future:
        return self._write(args.update, lambda result: method.result(success=result))

    def _barrier(self, method: Method, args: Any) -> asyncio.Future:
        request = args.request
        if request is not None and isinstance(request.group, str):
            target = self.router.owner(barrier_key(request.group))
            # (one routed here by a caller, or passed on by a node, that sees
            # another owner is held here, where it was sent)
            if target is not None and request.epoch is None:
                passed = asyncio.ensure_future(
                    self.router.barrier(target, request, lambda: self.waiting.barrier(request))
                )
                return _then(passed, lambda r: method.result(success=r))
        return _then(self.waiting.barrier(request), lambda r: method.result(success=r))

    def _ping(self, method: Method, args: Any) -> Any:
        return method.result(success=self.node_id)

    def _info(self, method: Method, args: Any) -> Any:
        table = self.store.table
        counters = dict.fromkeys(SERVER_COUNTERS, 0)
        counters.update((k, int(v)) for k, v in self.counters.items())
        counters.update(self.store.statistics())
        counters.update(self.waiting.statistics())
        counters.update(self.uploads.statistics())
        counters.update(self.rows.tables.statistics())
        counters["gradient_pushes_repeated"] = self.gradients.ledger.repeated
        counters["gradient_pushes_forwarded"] = self.gradients.forwarded
        counters["gradient_forward_failures"] = self.forward_failures
        # (parts sent again and held back: an earlier try is in doubt at a node out of reach)
        counters["gradient_pushes_in_doubt"] = self.gradients.in_doubt.refused
        counters["row_pushes_in_doubt"] = self.rows.in_doubt.refused
        for hook in self.statistics_hooks:
            counters.update(hook())
        info = thrift.NodeInfo(
            node_id=self.node_id,
            version=__version__,
            parameter_count=len(table),
            parameter_bytes=table.nbytes,
            timestamp=table.timestamp,
            uptime_seconds=time.monotonic() - self.started,
            counters=counters,
            peers=[thrift.PeerInfo(**s) for s in self.cluster.statistics()] if self.cluster else [],
            waiting=self.waiting.report(),
            topology=self._topology_now(),
            fast_path=fast_path(),
            local_socket=self.local_socket,
        )
        cluster = self.cluster
        if cluster is not None:
            info.state = cluster.state
            info.keys_moving = cluster.rebalancer.moving
            info.under_replicated = cluster.rebalancer.under_replicated
            counters["requests_passed_on"] = self.router.passed_on
            if (coordinator := cluster.coordinator) is not None:
                info.coordinator = f"{coordinator.address} {coordinator.prefix}"
                info.fenced = cluster.fenced()
        return method.result(success=info)

    def _topology_now(self) -> Any:
        if self.cluster is not None and self.cluster.me.node_id:
            topology = self.cluster.topology()
            topology.partition_bytes = self.partitioned.partition_bytes
            return topology
        return thrift.Topology(
            epoch=0,
            members=[thrift.TopologyMember(node_id=self.node_id, host="", port=0, state="up")],
            replication_factor=0,
            partition_bytes=self.partitioned.partition_bytes,
        )

    def _topology(self, method: Method, args: Any) -> Any:
        return method.result(success=self._topology_now())

    def _digest_for(self, method: Method, args: Any) -> Any:
        return method.result(success=digest_for(self.store, args.request, self.cluster))

    def _lift(self, method: Method, args: Any) -> asyncio.Future:
        lifted = lift(self.store, self.cluster, args.request)
        return _then(asyncio.ensure_future(lifted), lambda d: method.result(success=d))

    def _drain(self, method: Method, args: Any) -> asyncio.Future:
        if self.on_drain is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "this node cannot be drained")
        wait = args.wait_ms / 1000 if args.wait_ms is not None and args.wait_ms > 0 else None
        return _then(self.on_drain(wait), lambda n: method.result(success=n))

    def _shutdown(self, method: Method, args: Any) -> asyncio.Future:
        if self.on_shutdown is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "this node cannot be shut down")
        request = args.request or thrift.ShutdownRequest()
        return _then(self.on_shutdown(request), lambda r: method.result(success=r))

    def _announce(self, method: Method, args: Any) -> Any:
        if self.cluster is None or args.member is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "announce needs a member")
        cluster = self.cluster
        members = cluster.announced(args.member)
        epoch = args.member.epoch

        # Answered once this node sees the epoch of the announcement (with a
        # coordinator, from its own watch) and what it folded as the primary of
        # keys that the announcement may have moved is applied: a member that
        # says it is up takes them over after every answer (see take_over).
        async def settled() -> None:
            await cluster.caught_up(epoch)
            await self.store.applied()

        return _then(asyncio.ensure_future(settled()), lambda _: method.result(success=members))

    def _digest(self, method: Method, args: Any) -> Any:
        entries = digest(self.store.table)
        if args.buckets:
            entries += bucket_digest(self.rows.tables)
        return method.result(success=entries)
