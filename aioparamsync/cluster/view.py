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
member say so, and placement changes. A member claiming keys (see
:mod:`.balance`) is as one joining, for those keys alone: the pending
placement has its claims, it pulls the keys, then says it claims them.

A :class:`View` is immutable. The cluster (:mod:`.membership`) computes one
from what it sees and, where its members or their states differ from its
own, replaces its own whole, at a larger epoch; every epoch has one view. So
whoever takes ``cluster.view`` once reads one epoch's members, placement and
pending placement together, whatever changes while it awaits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..placement import JOINING, LIVE, PLACED, Placement, claims_of

__all__ = ["View"]


def _none() -> Mapping[str, Mapping[str, int]]:
    return MappingProxyType({})


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
        claims: each member's claims (key -> the epoch it claimed it at), and
        claiming: those it is taking (see :mod:`aioparamsync.placement`).
    """

    epoch: int
    states: Mapping[str, str]
    replication_factor: int | None
    placement: Placement
    pending: Placement | None
    live: frozenset[str]
    claims: Mapping[str, Mapping[str, int]] = field(default_factory=_none)
    claiming: Mapping[str, Mapping[str, int]] = field(default_factory=_none)

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
        claims: Mapping[str, Mapping[str, int]] | None = None,
        claiming: Mapping[str, Mapping[str, int]] | None = None,
    ) -> View:
        """The view of the members in ``states`` at ``epoch``.

        Args:
            leaving: the members that say they leave (their links may be down).
            before: the view this one follows: its placement is kept where it is
                the same (with the rankings it has cached).
            claims: each member's claims; claiming: the claims it is taking.
        """
        claims = {m: dict(c) for m, c in (claims or {}).items() if c}
        claiming = {m: dict(c) for m, c in (claiming or {}).items() if c}
        placed = [m for m, s in states.items() if s in PLACED]
        placement = Placement(placed, replication_factor, claims_of(claims))
        if before is not None and placement == before.placement:
            placement = before.placement
        joining = [m for m, s in states.items() if s == JOINING]
        going = {m for m in placed if m in leaving}
        pending = None
        taking = {m: c for m, c in claiming.items() if states.get(m) in LIVE}
        if joining or going or taking:
            after = [m for m in placed if m not in going] + joining
            claimed = {m: {**claims.get(m, {}), **taking.get(m, {})} for m in after}
            pending = Placement(after, replication_factor, claims_of(claimed))
        live = frozenset(m for m, s in states.items() if s in LIVE)
        return cls(
            epoch,
            MappingProxyType(dict(states)),
            replication_factor,
            placement,
            pending,
            live,
            MappingProxyType(claims),
            MappingProxyType(claiming),
        )

    def at(self, epoch: int) -> View:
        """This view at another epoch (the members changed, and changed back)."""
        return dataclasses.replace(self, epoch=epoch)

    def same(
        self,
        states: Mapping[str, str],
        claims: Mapping[str, Mapping[str, int]] | None = None,
        claiming: Mapping[str, Mapping[str, int]] | None = None,
    ) -> bool:
        """Whether ``states`` are this view's members, in the same states (and claims)."""

        def given(c: Mapping[str, Mapping[str, int]] | None) -> dict[str, dict[str, int]]:
            return {m: dict(k) for m, k in (c or {}).items() if k}

        return (
            dict(self.states) == dict(states)
            and given(self.claims) == given(claims)
            and given(self.claiming) == given(claiming)
        )

    def holds(self, member: str, key: str) -> bool:
        """Whether ``member`` is a replica of ``key``, now or in the pending placement."""
        pending = self.pending
        return self.placement.holds(member, key) or (
            pending is not None and pending.holds(member, key)
        )

    def __str__(self) -> str:
        members = ", ".join(f"{m} {s}" for m, s in sorted(self.states.items()))
        return f"epoch {self.epoch}: {members} (R={self.replication_factor or 'all'})"
