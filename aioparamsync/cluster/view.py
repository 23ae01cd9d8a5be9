"""The cluster at one epoch: its members, their states, and where keys go.

Theory of operation. Each member is in one of the states of
``TopologyMember.state``: what it says of itself when it announces (joining,
up, leaving, left), and, for one that says it is up or leaving, what this
node sees of its link: down (its link is not up), failed (down longer than
the failure timeout). The members up, leaving or down are placed
(:class:`~aioparamsync.placement.Placement`); the primary of a key is the
first of its replicas that is up or leaving. While members join or leave,
:attr:`View.pending` is the placement once they have: writes replicate to
the replicas of both, the members joining pull what they will hold, those
leaving hand theirs off (see :mod:`.rebalance`), and only then does the
member say so, and placement changes.

A :class:`View` is immutable. The cluster (:mod:`.membership`) computes one
from what it sees and, where its members or their states differ from its
own, replaces its own whole, at a larger epoch; every epoch has one view. So
whoever takes ``cluster.view`` once reads one epoch's members, placement and
pending placement together, whatever changes while it awaits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ..placement import JOINING, LIVE, PLACED, Placement

__all__ = ["View"]


@dataclass(frozen=True, slots=True)
class View:
    """The cluster at one epoch, as this node sees it (see the module).

    Attributes:
        epoch: grows with every change of the members or their states (without a
            coordinator; with one, it is etcd's revision of the members).
        states: each member's state, by id (this node's too).
        replication_factor: how many members hold each key (None: every one).
        placement: where keys are, over the members placed (up, leaving or down).
        pending: the placement once the members joining or leaving now have
            (None: none is).
        live: the ids of the members up or leaving (they answer).
    """

    epoch: int
    states: Mapping[str, str]
    replication_factor: int | None
    placement: Placement
    pending: Placement | None
    live: frozenset[str]

    @classmethod
    def empty(cls, replication_factor: int | None) -> View:
        """No member yet, at epoch 0."""
        placement = Placement([], replication_factor)
        return cls(0, MappingProxyType({}), replication_factor, placement, None, frozenset())

    @classmethod
    def of(
        cls,
        epoch: int,
        states: Mapping[str, str],
        leaving: Collection[str],
        replication_factor: int | None,
        before: View | None = None,
    ) -> View:
        """The view of the members in ``states`` at ``epoch``.

        Args:
            leaving: the members that say they leave (their links may be down).
            before: the view this one follows: its placement is kept where it is
                the same (with the rankings it has cached).
        """
        placed = [m for m, s in states.items() if s in PLACED]
        placement = Placement(placed, replication_factor)
        if before is not None and placement == before.placement:
            placement = before.placement
        joining = [m for m, s in states.items() if s == JOINING]
        going = {m for m in placed if m in leaving}
        pending = None
        if joining or going:
            after = [m for m in placed if m not in going] + joining
            pending = Placement(after, replication_factor)
        live = frozenset(m for m, s in states.items() if s in LIVE)
        return cls(
            epoch, MappingProxyType(dict(states)), replication_factor, placement, pending, live
        )

    def at(self, epoch: int) -> View:
        """This view at another epoch (the members changed, and changed back)."""
        return dataclasses.replace(self, epoch=epoch)

    def same(self, states: Mapping[str, str]) -> bool:
        """Whether ``states`` are this view's members, in the same states."""
        return dict(self.states) == dict(states)

    def holds(self, member: str, key: str) -> bool:
        """Whether ``member`` is a replica of ``key``, now or in the pending placement."""
        pending = self.pending
        return self.placement.holds(member, key) or (
            pending is not None and pending.holds(member, key)
        )

    def __str__(self) -> str:
        members = ", ".join(f"{m} {s}" for m, s in sorted(self.states.items()))
        return f"epoch {self.epoch}: {members} (R={self.replication_factor or 'all'})"
