"""Replication: the store's feed to the links' outboxes, and what waits for the replicas.

The cluster sees the store only through its feed of applied updates: each
update applied for a client is offered to the links of the other replicas
of its parameters (those of the pending placement too, while members join
or leave: they get what they will hold); updates that came from a peer are
not sent on (the node that applied them first sends them to every replica).
Each link sends its outbox on its own (see :mod:`.links`).

A write with ``acks=all`` waits, once applied here, until every live replica
confirmed it (:meth:`Replication.replicated`): each of their links sends what
it holds, then a ping the peer answers behind it. A node that stops first
waits (a bounded time) until every link up has sent its outbox
(:meth:`Replication.drain`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import Indeterminate, RequestError
from ..placement import JOINING, UP
from ..store.table import Entry
from .links import PEER_CALL_TIMEOUT, LinkState, PeerLink

if TYPE_CHECKING:
    from .membership import Cluster

__all__ = ["ACK_TIMEOUT", "Replication"]

log = logging.getLogger(__name__)

# How long an acks=all write waits for its replicas to confirm (seconds).
ACK_TIMEOUT = 2 * PEER_CALL_TIMEOUT
# The states of a link whose peer is no member (it is sent nothing).
_NO_MEMBER = (LinkState.DROPPED, LinkState.REFUSED)


class Replication:
    """The fan-out of what this node applies to the links of its replicas (see the module).

    Args:
        cluster: the cluster whose links carry it; its store's feed is subscribed to.
    """

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        cluster.store.subscribe(self.applied)

    def applied(self, entries: Sequence[Entry], replicated: bool) -> None:
        """The store's feed: ``entries`` were applied (``replicated``: from a peer)."""
        if replicated:
            return  # its origin sends it to every replica
        cluster = self.cluster
        view = cluster.view
        if view.placement.everywhere and view.pending is None:
            for link in cluster.links.values():
                if link.member_state in (None, UP, JOINING) and link.state not in _NO_MEMBER:
                    link.offer(entries)
            return
        by_id, me, pending = cluster.by_id, cluster.me.node_id, view.pending
        for entry in entries:
            targets = view.placement.replicas(entry.name)
            if pending is not None:  # (members joining get what they will hold)
                targets = (*targets, *pending.replicas(entry.name))
            for member in set(targets):
                if member != me and (peer := by_id.get(member)) is not None:
                    peer.offer((entry,))

    def replica_links(self, names: Iterable[str]) -> set[PeerLink]:
        """The links up, to members other than this node that hold any of ``names`` (or
        will: members joining)."""
        cluster = self.cluster
        view, me = cluster.view, cluster.me.node_id
        names = list(names)
        members: set[str] = set()
        for placement in (view.placement, view.pending):
            if placement is None:
                continue
            if placement.everywhere:
                members.update(placement.members)
            else:
                for name in names:
                    members.update(placement.replicas(name))
        return {
            link
            for m in members
            if m != me and (link := cluster.by_id.get(m)) is not None and link.state == LinkState.UP
        }

    async def replicated(self, names: Iterable[str], timeout: float = ACK_TIMEOUT) -> None:
        """Wait until every live replica of ``names`` has what this node applied of them.

        For an ``acks=all`` write, once this node applied it (the entries are
        in the links' outboxes: the store's feed ran). A replica whose link
        goes down meanwhile is no longer waited for (it is not live).

        Raises:
            Indeterminate: a live replica did not confirm it (in time): it is applied
                here, and may be lost if this node fails before the replica has it.
        """
        names = list(names)
        fencing = self.cluster.fencing
        try:
            await self._replicated(names, timeout)
        except RequestError:
            fencing.not_confirmed(names)
            raise
        fencing.confirmed(names)

    async def _replicated(self, names: list[str], timeout: float) -> None:
        cluster = self.cluster
        me, coordinated = cluster.me.node_id, cluster.coordinator is not None
        if coordinated:
            cut = cluster.fencing.unreachable(names)
            if cut:
                raise Indeterminate(
                    f"applied by {me}, but replicas {', '.join(sorted(cut))} cannot "
                    "be reached to confirm it (acks=all)",
                )
        links = self.replica_links(names)
        if not links:
            return
        waits = {link: link.confirm() for link in links}
        _, late = await asyncio.wait(waits.values(), timeout=timeout)
        if late:
            for wait in late:
                wait.cancel()
            names_late = [link.name for link, wait in waits.items() if wait in late]
            raise Indeterminate(
                f"applied by {me}, but replicas {', '.join(names_late)} did not "
                f"confirm within {timeout:.0f} s (acks=all)",
            )
        if coordinated:
            # (a link that went down meanwhile: its member is live until etcd says not)
            lost = [link.name for link, wait in waits.items() if not wait.result()]
            if lost:
                raise Indeterminate(
                    f"applied by {me}, but the links to replicas "
                    f"{', '.join(lost)} broke before they confirmed it (acks=all)",
                )

    async def drain(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until every link that is up has sent its outbox.

        Links that are down cannot drain: anti-entropy will repair those peers.
        Answers whether everything was sent.
        """
        links = self.cluster.links
        waits = [
            asyncio.ensure_future(link.drained.wait())
            for link in links.values()
            if link.state == LinkState.UP and not link.drained.is_set()
        ]
        if not waits:
            return True
        _, pending = await asyncio.wait(waits, timeout=timeout)
        for wait in pending:
            wait.cancel()
        if pending:
            late = [
                link.name
                for link in links.values()
                if link.state == LinkState.UP and not link.drained.is_set()
            ]
            log.warning(
                "%d peer outboxes not drained within %.1f s: %s",
                len(pending),
                timeout,
                ", ".join(late) or "(their links went down meanwhile)",
            )
        return not pending
