"""Placement: which nodes hold a name, and which one folds its gradients.

Which nodes hold a name is :func:`replicas` (today: every node); it is the
one place that sharding would change. Which node folds a name's gradients is
:func:`owner` (rendezvous hashing over the members that are up):
gradients of one parameter pushed at different nodes meet at that one node,
in one order, so none is lost to last-writer-wins; its results replicate like
any update.

Pure functions of the members given (no I/O, no asyncio): a member is
anything with a ``node_id`` and a link ``state`` (a :class:`.links.PeerLink`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Iterable, Sequence
from typing import Protocol, TypeVar

__all__ = ["owner", "replicas"]


class Peer(Protocol):
    """What placement reads of a member: its id ("" while unknown) and its link's state."""

    @property
    def node_id(self) -> str: ...

    @property
    def state(self) -> str: ...


P = TypeVar("P", bound=Peer)


def replicas(name: str, members: Sequence[P]) -> Sequence[P]:
    """The peers that hold ``name``: today every one (full replication)."""
    return members


def _score(node_id: str, name: str) -> bytes:
    return hashlib.blake2b(f"{node_id}\0{name}".encode(), digest_size=8).digest()


def owner(name: str, me: str, members: Iterable[P], live: Container[str]) -> P | None:
    """The member that folds gradients of ``name``: one of ``members``, or None for ``me``.

    Rendezvous hashing over this node (``me``, its id) and the members it can
    reach (whose state is in ``live``: ``OWNER_STATES``) whose ids are known:
    nodes that see the same members live compute the same owner, and a member
    joining or leaving moves only the names it wins or held. A member that is
    down is left out, so its names move to a live member the survivors agree
    on. (Ranking it anyway made each survivor fold those names itself, once
    forwarding failed: concurrent pushes at two nodes then overwrote each
    other by last-writer-wins, for as long as the member stayed away.)

    What remains: while nodes disagree on whether a member is up, they
    may choose different owners for its names, and gradients of one name
    pushed concurrently at two of them may then be lost to
    last-writer-wins, as above. That lasts until each notices the change:
    a member that went away shows when its link's next call fails (within
    ``HEARTBEAT_SECONDS`` on an idle link whose connection broke; up to
    ``PEER_CALL_TIMEOUT`` if the member froze), and one that came back
    when each link's backoff (up to ``BACKOFF_MAX``) ends or it announces
    itself; a link that flaps, or a partition between some members only,
    keeps the window open as long as it lasts. Each push is still applied
    atomically, once, and replicates; only concurrent ones at nodes that
    disagree can overwrite each other.
    """
    best: P | None = None
    best_score = _score(me, name)
    for member in members:
        if member.node_id and member.state in live:
            score = _score(member.node_id, name)
            if score > best_score:
                best, best_score = member, score
    return best
