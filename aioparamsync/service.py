"""The service: each IDL method of ``ParameterSyncService``, served from the store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import __version__
from .errors import ErrorCode, RequestError
from .store import Applied, ParameterStore
from .wire import Method, thrift

__all__ = ["ParameterService"]


def _params(update: Any) -> tuple[Sequence[Any], int]:
    if update is None:
        raise RequestError(ErrorCode.BAD_REQUEST, "the update is missing")
    return update.params, update.timestamp


class ParameterService:
    """Answers every method of the IDL from a :class:`ParameterStore`.

    Args:
        store: where parameters live; ``ping`` answers its table's node id.
        cluster: the node's :class:`~aioparamsync.peers.Cluster` (membership calls).
        counters: the server's counters, reported by ``info``.
    """

    writes = frozenset({"update_parameters", "push_parameters", "broadcast_update"})

    def __init__(
        self, store: ParameterStore, cluster: Any = None, counters: Mapping[str, int] | None = None
    ) -> None:
        self.store = store
        self.cluster = cluster
        self.counters: Mapping[str, int] = counters if counters is not None else {}
        self.started = time.monotonic()
        self._handlers: dict[str, Callable[[Method, Any], Any]] = {}  # by method name

    @property
    def node_id(self) -> str:
        return self.store.table.node_id

    def handle(self, method: Method, args: Any) -> Any:
        handler = self._handlers.get(method.name)
        if handler is None:
            handler = self._handlers[method.name] = getattr(self, "_" + method.name)
        return handler(method, args)

    # -- the founding methods ----------------------------------------------------

    def _read(self, request: Any) -> Any:
        if request is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the request is missing")
        entries = self.store.read(request.param_names, request.min_version or 0)
        return thrift.ParameterResponse(
            params=[e.to_parameter() for e in entries], timestamp=self.store.timestamp
        )

    def _get_parameters(self, method: Method, args: Any) -> Any:
        return method.result(success=self._read(args.request))

    def _update_parameters(self, method: Method, args: Any) -> asyncio.Future:
        # The store's writer makes the reply as it answers the batch.
        return self.store.submit(*_params(args.update), then=lambda _: method.result())

    def _broadcast_update(self, method: Method, args: Any) -> asyncio.Future:
        # From a peer, every parameter carries its origin: merge it, send it on
        # to no one. From a client: an update like any other.
        params, timestamp = _params(args.update)
        replicated = bool(params) and all(p.origin for p in params)
        return self.store.submit(params, timestamp, replicated=replicated)

    # -- the typed methods --------------------------------------------------------

    def _pull_parameters(self, method: Method, args: Any) -> Any:
        return method.result(success=self._read(args.request))

    def _push_parameters(self, method: Method, args: Any) -> asyncio.Future:
        def result(applied: Applied) -> Any:
            versions = {e.name: e.version for e in applied.entries}
            return method.result(
                success=thrift.UpdateResult(versions=versions, timestamp=applied.timestamp)
            )

        return self.store.submit(*_params(args.update), then=result)

    def _ping(self, method: Method, args: Any) -> Any:
        return method.result(success=self.node_id)

    def _info(self, method: Method, args: Any) -> Any:
        table = self.store.table
        counters = {k: int(v) for k, v in self.counters.items()}
        counters.update(self.store.statistics())
        info = thrift.NodeInfo(
            node_id=self.node_id,
            version=__version__,
            parameter_count=len(table),
            parameter_bytes=table.nbytes,
            timestamp=table.timestamp,
            uptime_seconds=time.monotonic() - self.started,
            counters=counters,
            peers=[thrift.PeerInfo(**s) for s in self.cluster.statistics()] if self.cluster else [],
        )
        return method.result(success=info)

    def _announce(self, method: Method, args: Any) -> Any:
        if self.cluster is None or args.member is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "announce needs a member")
        return method.result(success=self.cluster.announced(args.member))

    def _digest(self, method: Method, args: Any) -> Any:
        table = self.store.table
        digest = []
        for name in table.names():
            e = table.entry(name)
            assert e is not None
            digest.append(
                thrift.DigestEntry(name=e.name, version=e.version, origin=e.origin, nbytes=e.nbytes)
            )
        return method.result(success=digest)
