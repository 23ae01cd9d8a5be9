"""What the server reads of the cluster: :class:`ClusterView`, a typed Protocol.

The server may not import :mod:`aioparamsync.cluster` (they are siblings in
the layers contract: see ``[tool.importlinter]`` in pyproject.toml), nor the
client. The node hands its :class:`~aioparamsync.cluster.membership.Cluster`
to the server, which reads it through this Protocol alone: exactly what the
server reads of it, every member read-only (the server changes nothing of
the cluster but through its methods). ``forward.Holders``, what the forward
policy reads, is a subset of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Protocol

from ..placement import Placement
from ..wire import Method

if TYPE_CHECKING:
    import numpy as np

    from ..store.rows import RowTable

__all__ = ["ClusterView", "CoordinatorView", "PeerCalls", "PeerView", "RebalancerView"]


class PeerCalls(Protocol):
    """A client of a peer, for calls passed on to it."""

    async def invoke(
        self, m: Method, /, *, timeout: float | EllipsisType | None = ..., **args: Any
    ) -> Any: ...


class PeerView(Protocol):
    """This node's link to one member, as the server reads it."""

    @property
    def name(self) -> str:
        """The member as logs name it."""
        ...

    @property
    def state(self) -> str:
        """The link's state (``LinkState``: "up", "backoff", ...)."""
        ...

    def proxy(self) -> PeerCalls:
        """The forwarding lane: a client of the peer for calls passed on to it."""
        ...

    async def forward(self, push: Any, timeout: float | None = ...) -> Any:
        """A gradient push sent on to its owner, on the forwarding lane."""
        ...

    async def replicate(self, m: Method, /, timeout: float = ..., **args: Any) -> Any:
        """A call of replication, on the replication lane."""
        ...

    def offer_rows(self, table: RowTable, bucket: int, ids: np.ndarray) -> None:
        """Rows of ``table``'s ``bucket`` changed here, for the peer (never blocks)."""
        ...


class RebalancerView(Protocol):
    """What ``info`` says of the rebalancing."""

    @property
    def moving(self) -> int: ...

    @property
    def under_replicated(self) -> int: ...


class CoordinatorView(Protocol):
    """Where the members are kept (``info``)."""

    @property
    def address(self) -> str: ...

    @property
    def prefix(self) -> str: ...


class ClusterView(Protocol):
    """This node's cluster as the server reads it (see the module)."""

    @property
    def me(self) -> Any:
        """This node as its peers reach it (``thrift.Member``)."""
        ...

    @property
    def state(self) -> str:
        """This node's own state: joining, up, leaving, left."""
        ...

    @property
    def epoch(self) -> int: ...

    @property
    def acks(self) -> str:
        """When a write is answered unless it says: "1" or "all"."""
        ...

    @property
    def placement(self) -> Placement: ...

    @property
    def pending(self) -> Placement | None:
        """The placement once the members joining or leaving have (None: none is)."""
        ...

    @property
    def live(self) -> frozenset[str]:
        """The ids of the members that answer (up or leaving)."""
        ...

    @property
    def links(self) -> Mapping[str, PeerView]:
        """Every link, by address (none: this node is alone)."""
        ...

    @property
    def by_id(self) -> Mapping[str, PeerView]:
        """The links to the members of the view, by member id."""
        ...

    @property
    def settling(self) -> asyncio.Future[None] | None:
        """While this node takes over as the primary of its keys: done then."""
        ...

    @property
    def coordinator(self) -> CoordinatorView | None: ...

    @property
    def rebalancer(self) -> RebalancerView: ...

    def holds_here(self, key: str) -> bool:
        """Whether this node is a replica of ``key``, now or in the pending placement."""
        ...

    def fenced(self) -> str | None:
        """Why this node may take no writes now (None: it may)."""
        ...

    def trusted(self, node_id: str | None) -> bool:
        """Whether what ``node_id`` sends is taken."""
        ...

    def check_writable(self, names: Iterable[str], acks: str) -> None:
        """Refuse (``RequestError``) a write this node may not take now."""
        ...

    async def replicated(self, names: Iterable[str]) -> None:
        """Wait until every live replica of ``names`` has what this node applied."""
        ...

    def statistics(self) -> list[dict[str, Any]]:
        """Each link's state and counters (``PeerInfo``'s fields)."""
        ...

    def topology(self) -> Any:
        """The cluster as this node sees it (``thrift.Topology``)."""
        ...

    def announced(self, member: Any) -> list[Any]:
        """A peer announced itself; answer the members this node knows."""
        ...

    async def caught_up(self, epoch: int | None) -> bool:
        """Wait (bounded) until this node's view is at ``epoch`` or later, where a
        coordinator's watch brings it; whether it is."""
        ...
