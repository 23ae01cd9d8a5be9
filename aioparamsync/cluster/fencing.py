"""Fencing: with a coordinator, when this node may take writes, and what it forgets.

With a coordinator (see :mod:`.coordinator`) the members and their states
are etcd's: a member is live while its lease is, whatever this node's link
to it does. This node takes writes only while its lease is renewed
(:meth:`Fencing.fenced`); with ``acks=all``, a write is refused before it is
applied when a live replica of it cannot be reached from here
(:meth:`Fencing.check_writable`). A write that was applied but not confirmed
is remembered (:attr:`Fencing.unconfirmed`), and dropped if this node loses
its lease, before it registers anew, with what its outboxes still hold
(writes that never reached those replicas): so none can win, by
last-writer-wins, over a write the others acknowledged meanwhile; and
what it keeps is held as copies from before (see :mod:`.recovered`).
Replication from, and repairs with, a member not live in etcd are ignored
for the same reason (:meth:`Fencing.trusted`).

Without a coordinator, nothing is fenced: every check here passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import ErrorCode, RequestError
from ..store.table import lww_key
from .links import LinkState

if TYPE_CHECKING:
    from .coordinator import EtcdCoordinator
    from .membership import Cluster

__all__ = ["Fencing"]

log = logging.getLogger(__name__)


class Fencing:
    """What the coordinator's lease lets this node take (see the module).

    Args:
        cluster: the cluster it fences.
        coordinator: etcd's membership (None: nothing is fenced).
    """

    def __init__(self, cluster: Cluster, coordinator: EtcdCoordinator | None) -> None:
        self.cluster = cluster
        self.coordinator = coordinator
        #: writes applied here whose replicas did not confirm them (name -> lww key)
        self.unconfirmed: dict[str, tuple[int, str]] = {}

    def fenced(self) -> str | None:
        """Why this node may take no writes now (None: it may)."""
        return self.coordinator.fenced() if self.coordinator is not None else None

    def trusted(self, node_id: str | None) -> bool:
        """Whether what ``node_id`` sends is taken (with a coordinator: while it is a
        member there, its lease alive or registered anew; without: always)."""
        coordinator = self.coordinator
        if coordinator is None or node_id is None:
            return True
        return node_id in coordinator.members

    def check_writable(self, names: Iterable[str], acks: str) -> None:
        """Refuse (UNAVAILABLE) a write this node may not take now, before it is applied.

        With a coordinator: while its lease is not renewed (it is fenced);
        with ``acks=all``, while a live replica of ``names`` cannot be reached
        from here (the write could not be confirmed).
        """
        if self.coordinator is None:
            return
        cluster = self.cluster
        why = self.coordinator.fenced()
        if why is not None:
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"node {cluster.me.node_id} takes no writes: {why}; nothing was applied "
                "(reads go on; another node takes its keys if its lease expires)",
                epoch=cluster.epoch,
            )
        if acks == "all":
            cut = self.unreachable([n for n in names if cluster.holds_here(n)])
            if cut:
                raise RequestError(
                    ErrorCode.UNAVAILABLE,
                    f"replicas {', '.join(sorted(cut))} are members but cannot be reached from "
                    f"{cluster.me.node_id}: nothing was applied (acks=all); try again",
                    epoch=cluster.epoch,
                )

    def unreachable(self, names: Iterable[str]) -> set[str]:
        """The live replicas of ``names`` (other than this node) whose links are not up."""
        cluster = self.cluster
        view, me, by_id = cluster.view, cluster.me.node_id, cluster.by_id
        members: set[str] = set()
        if view.placement.everywhere:
            members.update(view.placement.members)
        else:
            for name in names:
                members.update(view.placement.replicas(name))
        return {
            m
            for m in members & view.live
            if m != me and ((link := by_id.get(m)) is None or link.state != LinkState.UP)
        }

    def not_confirmed(self, names: Iterable[str]) -> None:
        """What this node applied of ``names`` was not confirmed by their replicas."""
        if self.coordinator is None:
            return
        table = self.cluster.store.table
        for name in names:
            entry = table.entry(name)
            if entry is not None:
                self.unconfirmed[name] = lww_key(entry)

    def confirmed(self, names: Iterable[str]) -> None:
        """Every live replica of ``names`` has what this node applied of them."""
        for name in names:
            self.unconfirmed.pop(name, None)

    def take_outboxes(self) -> None:
        """Empty every link's outbox, unsent, into :attr:`unconfirmed`.

        Once its lease expired (it was fenced for half a TTL: a link that was
        up has sent it all), what they still hold never reached those
        replicas: writes applied here while cut off, acknowledged with
        ``acks=1`` at most.
        """
        unconfirmed = self.unconfirmed
        for link in self.cluster.links.values():
            for name, key in link.discard().items():
                if name not in unconfirmed or unconfirmed[name] < key:
                    unconfirmed[name] = key

    async def forget_unconfirmed(self) -> None:
        """Before registering anew: drop the writes applied here that no replica confirmed,
        and hold the rest as a restarted node holds what it read from its data directory:
        copies from before the others placed its keys elsewhere, which yield to what they
        wrote meanwhile (see :mod:`.recovered`)."""
        self.take_outboxes()  # (offered since: a send that failed)
        held, self.unconfirmed = self.unconfirmed, {}
        if held:
            dropped = await self.cluster.store.drop(held)
            log.warning(
                "dropped %d writes applied here that its replicas did not confirm (the "
                "others' copies are pulled instead)",
                dropped,
            )
        self.cluster.store.table.mark_recovered()
