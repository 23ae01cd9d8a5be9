"""Passing part of a call on to the node that holds its keys: the one forward policy.

Theory of operation. A node serves what it holds and passes the rest of a
call on: an update's or a read's names, a gradient push's parts, an
embedding table's row buckets, a barrier's group. Each kind of key goes by
the same rules, written here once (:func:`pass_on`); the caller says only how
to send a part to a node (``send``) and how to serve it here (``here``).

* The holder of a key is its first live replica in this node's view that
  was not tried yet (:func:`holder`): the primary, unless it could not be
  reached. Keys are grouped by holder (:func:`by_holder`), one part a node.
* ``Moved`` (the node does not hold the keys, or is not their primary, at
  its epoch; nothing was done there): views differ for a moment while a
  member joins or leaves, so the part goes again, after a short wait
  (``FORWARD_RETRY_DELAYS``), to the holders as this node sees them by then;
  after the last wait it fails ``UNAVAILABLE`` (nothing applied).
* The node cannot be reached (``ConnectError``: nothing was sent): the part
  goes to each key's next live replica; this node serves it when it is that
  replica. Unless the caller says it may not (``fallback=False``: a gradient
  fold under a coordinator, whose primary is still a member and may be folding
  other pushes of the same keys: a second node folding them would make versions
  beside its, one of the two lost by last-writer-wins): it fails
  ``UNAVAILABLE``, nothing applied. A key none of whose replicas is left fails
  ``UNAVAILABLE`` (nothing applied): a part is never sent to, nor applied at, a
  node that does not hold its key, where it would start the key anew.
* The call broke in flight or timed out (``ConnectionLostError``,
  ``CallTimeout``): the outcome there is unknown, so a write is not sent
  elsewhere (it could apply twice); it fails ``INDETERMINATE`` (a push sent
  again with its request id folds once). A
  read (``idempotent``) goes on to the next replica, as if not reached.
* A push's part in doubt (:class:`InDoubt`): the node that passed it on
  notes, under the push's request id, where each key's part went when its
  call ended without an answer (or answered ``INDETERMINATE``). Sent again
  under that id while that node cannot be reached (not reached now, or not
  live in this node's view, and still a member), the part is sent nowhere
  else (it may have been folded there, and the ids a node has seen are its
  own: another replica would fold it again); it fails ``INDETERMINATE`` until
  that node can be reached, which folds it once. Where that node is no longer
  the keys' holder (they moved: a join, a claim), the part goes to it first
  all the same: it answers what it folded under the id from its memory,
  whatever it holds now, and ``Moved`` for the rest, which then goes on to
  the holders.
* Any other refusal is the caller's answer, as it is.

A part sent to a node that is not the keys' primary in this node's view
(their primary could not be reached) is sent as a fallback (``send``'s third
argument): the caller sends it without an epoch, to be applied where it
arrives, which holds it.

A node that waits before it folds a part (its own take-over settling: see
``Cluster.settling``) checks, once done waiting, that the keys did not move
meanwhile (:func:`unmoved`): a member that claimed them took them over while
it waited, and folds them from then on. Folded here, the part would make a
second primary's version of a key (one of the two lost by last-writer-wins),
or would land in a bucket this node handed off and dropped meanwhile, started
anew. A part that moved goes on to its holder as this node now sees it
(:func:`pass_on`, this node the target), as a part answered ``Moved`` does.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from ..errors import (
    CallTimeout,
    ConnectError,
    ConnectionLostError,
    ErrorCode,
    Indeterminate,
    Moved,
    RequestError,
)
from ..placement import LIVE, Placement

__all__ = [
    "FORWARD_RETRY_DELAYS",
    "MAX_IN_DOUBT",
    "Holders",
    "InDoubt",
    "by_holder",
    "cut",
    "gate",
    "holder",
    "moved",
    "pass_on",
    "unmoved",
]

# Waits before a part answered Moved goes again to its holders as this node
# sees them then (seconds): views differ for a moment while members change.
FORWARD_RETRY_DELAYS = (0.02, 0.1, 0.5, 1.0)
# Keys of parts in doubt a node remembers, over all request ids (the oldest ids' are
# forgotten first): ~100 bytes each.
MAX_IN_DOUBT = 100_000

T = TypeVar("T")


class Holders(Protocol):
    """What the forward policy reads of the cluster (a part of
    :class:`~.clusterview.ClusterView`)."""

    @property
    def me(self) -> Any: ...
    @property
    def epoch(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def placement(self) -> Placement: ...
    @property
    def live(self) -> frozenset[str]: ...
    @property
    def by_id(self) -> Mapping[str, Any]: ...
    @property
    def links(self) -> Mapping[str, Any]: ...


class InDoubt:
    """Where the parts of pushes went whose calls ended without an answer, by request id.

    For each request id, each key and the node its part was sent to: folded there or
    not, nobody here knows. At most ``size`` keys in all, the latest request ids'. See
    the module.
    """

    def __init__(self, size: int = MAX_IN_DOUBT) -> None:
        self.size = size
        self._sent: collections.OrderedDict[str, dict[str, str]] = collections.OrderedDict()
        self._keys = 0  # (in all of _sent)
        self.refused = 0  # parts sent again not passed on to a next replica

    def __len__(self) -> int:
        return self._keys

    def note(self, request_id: str | None, keys: Iterable[str], node: str) -> None:
        """The part of ``keys`` sent to ``node`` under ``request_id`` ended unanswered."""
        if request_id is None:
            return
        sent = self._sent.setdefault(request_id, {})
        self._keys -= len(sent)
        sent.update(dict.fromkeys(keys, node))
        self._keys += len(sent)
        self._sent.move_to_end(request_id)
        while self._keys > self.size and len(self._sent) > 1:
            self._keys -= len(self._sent.popitem(last=False)[1])

    def check(
        self,
        cluster: Holders,
        request_id: str | None,
        keys: Iterable[str],
        target: str | None,
        tried: frozenset[str],
        what: str,
    ) -> None:
        """Refuse to send ``keys`` to ``target`` (None: to any node) when an earlier try
        of ``request_id`` left a part of them in doubt at another node that cannot be
        reached now (tried and not reached, or not live in this view; still a member).

        Raises:
            Indeterminate: (see the module) naming the keys and where they went.
        """
        sent = self._sent.get(request_id) if request_id is not None else None
        if not sent:
            return
        away = tried | (frozenset(cluster.placement.members) - cluster.live)
        doubtful = {k: sent[k] for k in keys if sent.get(k) in away and sent[k] != target}
        if not doubtful:
            return
        self.refused += 1
        nodes = ", ".join(sorted(set(doubtful.values())))
        raise Indeterminate(
            f"{what} of {_shown(list(doubtful))} not sent on: an earlier try of this push "
            f"passed them on to {nodes}, which did not answer and cannot be reached now, "
            "and may have folded them; sent to another replica they could be folded twice. "
            "Try again under the same request id once it can be reached (they fold once)",
            cluster.epoch,
        )

    def elsewhere(
        self, cluster: Holders, request_id: str | None, keys: Iterable[str], target: str
    ) -> dict[str, list[str]]:
        """The keys of ``keys`` an earlier try of ``request_id`` left in doubt at a member
        other than ``target``, by that member (in doubt at a node that is no longer a
        member: forgotten, see the module)."""
        sent = self._sent.get(request_id) if request_id is not None else None
        back: dict[str, list[str]] = {}
        if not sent:
            return back
        gone = []
        members = cluster.placement.members
        for k in keys:
            if (node := sent.get(k)) is not None and node != target:
                if node in members:
                    back.setdefault(node, []).append(k)
                else:
                    gone.append(k)
        self.settled(request_id, gone)
        return back

    def settled(self, request_id: str | None, keys: Iterable[str]) -> None:
        """The node in doubt answered for ``keys`` (folded them, or did not): no more doubt."""
        if request_id is None or not (sent := self._sent.get(request_id)):
            return
        for k in keys:
            if sent.pop(k, None) is not None:
                self._keys -= 1
        if not sent:
            del self._sent[request_id]


def holder(cluster: Holders, key: str, tried: frozenset[str] = frozenset()) -> str | None:
    """The node ``key``'s part goes to: its first live replica not in ``tried`` (None: none)."""
    live = cluster.live - tried if tried else cluster.live
    return cluster.placement.primary(key, live)


def by_holder(
    cluster: Holders, keys: Iterable[str], tried: frozenset[str] = frozenset()
) -> dict[str | None, list[str]]:
    """``keys`` grouped by :func:`holder` (None: keys none of whose replicas is left): the
    placement's own cut by primary, which the routed client cuts its calls by too."""
    live = cluster.live - tried if tried else cluster.live
    return cluster.placement.by_primary(list(keys), live)


def cut(
    cluster: Holders,
    keys: Iterable[str],
    *,
    what: str,
    held_here: bool = False,
    refuse: bool = True,
    shown: Callable[[str], str] = repr,
) -> dict[str | None, list[str]]:
    """``keys`` by the node each is served at (None: this node): the one cut.

    Each key goes to its :func:`holder`; with ``held_here``, a key this node
    holds (a replica, serving) is served here (a read, or a write that any
    replica applies).

    Args:
        what: the call, as the error names it ("the push", "the update").
        refuse: a key none of whose replicas is up is refused (else served
            here: a read answers what this node has of it).
        shown: how the error names a key.

    Raises:
        RequestError: (UNAVAILABLE) with ``refuse``, a key none of whose replicas
            is up (not failed yet): nothing is applied, for a copy made here
            would start the key anew, and could lose to the old one by
            last-writer-wins when its replicas come back.
    """
    me, placement = cluster.me.node_id, cluster.placement
    keys = list(keys)
    here: list[str] = []
    if held_here and cluster.state in LIVE:
        here = [k for k in keys if placement.holds(me, k)]
        keys = [k for k in keys if not placement.holds(me, k)]
    groups = by_holder(cluster, keys)
    lost = groups.pop(None, [])
    if lost and refuse:
        down = ", ".join(placement.replicas(lost[0]))
        raise RequestError(
            ErrorCode.UNAVAILABLE,
            f"no replica of {shown(lost[0])} is up ({down}); nothing of {what} was applied: "
            "try again when one is, or after the failure timeout",
            cluster.epoch,
        )
    here += groups.pop(me, []) + lost  # (lost, not refused: what this node has of them)
    if here:
        groups[None] = here
    return groups


def moved(
    cluster: Holders,
    keys: Sequence[str],
    what: str = "does not hold",
    then: str = "ask a node for the topology",
    shown: Callable[[str], str] = repr,
) -> Moved:
    """The ``Moved`` error for ``keys`` (what this node does not do for them), with its epoch."""
    named = ", ".join(shown(k) for k in keys[:3]) + (" ..." if len(keys) > 3 else "")
    return Moved(
        f"node {cluster.me.node_id} {what} {named} at epoch {cluster.epoch}: {then}",
        epoch=cluster.epoch,
    )


def gate(
    cluster: Holders,
    keys: Iterable[str],
    *,
    primary: bool = False,
    what: str = "does not hold",
    then: str = "ask a node for the topology",
    shown: Callable[[str], str] = repr,
) -> None:
    """Refuse (:class:`Moved`) what this node may not serve of ``keys``: the one gate.

    A routed call (its caller's epoch set) is served only where its keys are
    held (this node a replica of each, and serving); a part passed on to be
    folded, only at their primary (``primary``). A node alone serves all.

    Raises:
        Moved: the keys it does not hold (is not the primary of), with its epoch.
    """
    if not cluster.links:
        return
    me, placement = cluster.me.node_id, cluster.placement
    if cluster.state not in LIVE:
        missing = list(keys)
    elif primary:
        missing = [k for k in keys if holder(cluster, k) != me]
    elif placement.everywhere and me in placement.members:
        return
    else:
        missing = [k for k in keys if not placement.holds(me, k)]
    if missing:
        raise moved(cluster, missing, what, then, shown)


def unmoved(
    cluster: Holders, keys: Iterable[str], shown: Callable[[str], str] = repr
) -> Callable[[], None]:
    """Note ``keys``' holders now (see :func:`holder`); answer a check, to call after a
    wait and just before applying them here, that raises :class:`Moved` for those whose
    holder changed meanwhile (see the module)."""
    keys = list(keys)
    before = [holder(cluster, k) for k in keys]

    def check() -> None:
        gone = [k for k, was in zip(keys, before, strict=True) if holder(cluster, k) != was]
        if gone:
            raise moved(cluster, gone, "no longer holds", "they moved while it waited", shown)

    return check


def _shown(keys: Sequence[str]) -> str:
    return ", ".join(repr(k) for k in keys[:3]) + (" ..." if len(keys) > 3 else "")


async def pass_on(
    cluster: Holders,
    target: str,
    keys: list[str],
    send: Callable[[Any, list[str], bool], Awaitable[T]],
    here: Callable[[list[str]], Awaitable[T]],
    *,
    what: str,
    idempotent: bool = False,
    tried: frozenset[str] = frozenset(),
    moves: int = 0,
    in_doubt: InDoubt | None = None,
    request_id: str | None = None,
    fallback: bool = True,
) -> list[T]:
    """Send ``keys``' part to ``target`` by the policy (see the module); answer every result.

    ``target`` may be this node: the part is served here, and should its keys have
    moved while it waited to (``here`` raised :class:`Moved`: see :func:`unmoved`),
    it goes on to their holders as this node sees them now.

    Args:
        send: ``send(link, keys, fallback)`` calls the node of ``link`` for
            ``keys`` (``fallback``: it is not their primary in this view).
        here: serves ``keys`` on this node (it holds them: it is their holder).
        what: the call, as errors name it ("gradients", "an update", ...).
        idempotent: the call may be sent again elsewhere when its outcome is
            unknown (a read).
        in_doubt: where this node notes the parts of a push (``request_id``) that
            ended unanswered, and finds those of its earlier tries (see the module).
        fallback: a part whose node cannot be reached may go to a next replica.

    Raises:
        RequestError: UNAVAILABLE when a key's part could be applied nowhere,
            ``Indeterminate`` when it may have been (see the module); a node's
            refusal as it is.
    """
    # (how every part of this call goes on, as far as it goes: see _onwards)
    policy: dict[str, Any] = {
        "what": what,
        "idempotent": idempotent,
        "in_doubt": in_doubt,
        "request_id": request_id,
        "fallback": fallback,
    }
    if in_doubt is not None:
        in_doubt.check(cluster, request_id, keys, target, tried, what)
        if back := in_doubt.elsewhere(cluster, request_id, keys, target):
            # (parts an earlier try left in doubt at a node that can be reached, no
            # longer their holder: it folded them or not, only it knows: asked first)
            asked = {k for ks in back.values() for k in ks}
            if rest := [k for k in keys if k not in asked]:
                back[target] = rest
            return await _each(cluster, back, send, here, tried, moves, policy)
    if target == cluster.me.node_id:
        try:
            return [await here(keys)]
        except Moved as exc:
            moves = await _again(cluster, exc, keys, moves, what)
            return await _onwards(cluster, keys, send, here, tried, moves, exc, policy)
    link = cluster.by_id.get(target)
    try:
        if link is None:
            raise ConnectError(f"node {target} is not linked")
        answer = await send(link, keys, bool(tried))
        if in_doubt is not None:
            in_doubt.settled(request_id, keys)
        return [answer]
    except Moved as exc:
        if in_doubt is not None:  # (not folded there: it answers those it folded)
            in_doubt.settled(request_id, keys)
        moves = await _again(cluster, exc, keys, moves, what)
        last: Exception = exc
    except ConnectError as exc:
        tried = tried | {target}
        last = exc
        if not fallback:
            if in_doubt is not None:  # (an earlier try's part there: not known, not refused)
                in_doubt.check(cluster, request_id, keys, None, tried, what)
            raise RequestError(
                ErrorCode.UNAVAILABLE,
                f"{what} of {_shown(keys)} not applied: their primary {target} cannot be "
                f"reached from {cluster.me.node_id} ({exc}), and only it applies them while "
                "it is a member; try again",
                cluster.epoch,
            ) from None
    except Indeterminate:  # (applied there, its replicas' confirmation missing)
        if in_doubt is not None:
            in_doubt.note(request_id, keys, target)
        raise
    except (ConnectionLostError, CallTimeout) as exc:
        if not idempotent:
            if in_doubt is not None:
                in_doubt.note(request_id, keys, target)
            raise Indeterminate(
                f"{what} passed on to {link.name if link else target} ended without an answer "
                f"({exc}): it may or may not have been applied there; try again",
                cluster.epoch,
            ) from exc
        tried = tried | {target}
        last = exc
    return await _onwards(cluster, keys, send, here, tried, moves, last, policy)


async def _again(cluster: Holders, exc: Moved, keys: list[str], moves: int, what: str) -> int:
    """After ``exc``: wait before the keys go again (the count of tries so far: ``moves``);
    answer the count; past the last wait, fail UNAVAILABLE (nothing applied)."""
    if moves >= len(FORWARD_RETRY_DELAYS):
        raise RequestError(
            ErrorCode.UNAVAILABLE,
            f"{what} of {_shown(keys)} not applied: the nodes disagree on where they are "
            f"held ({exc.message}); try again",
            cluster.epoch,
        ) from None
    await asyncio.sleep(FORWARD_RETRY_DELAYS[moves])
    return moves + 1


async def _onwards(
    cluster: Holders,
    keys: list[str],
    send: Callable[[Any, list[str], bool], Awaitable[T]],
    here: Callable[[list[str]], Awaitable[T]],
    tried: frozenset[str],
    moves: int,
    last: Exception,
    policy: dict[str, Any],
) -> list[T]:
    """``keys`` to their holders as this node sees them now, ``tried`` left out (not
    those an earlier try left in doubt at a node tried: see the module); ``policy``:
    :func:`pass_on`'s keyword arguments."""
    what, in_doubt = policy["what"], policy["in_doubt"]
    if in_doubt is not None:
        in_doubt.check(cluster, policy["request_id"], keys, None, tried, what)
    groups = by_holder(cluster, keys, tried)
    lost = groups.pop(None, None)
    if lost:
        raise RequestError(
            ErrorCode.UNAVAILABLE,
            f"{what} of {_shown(lost)} not applied: no replica of them could take it "
            f"({last}); try again",
            cluster.epoch,
        ) from last
    return await _each(cluster, groups, send, here, tried, moves, policy)  # type: ignore[arg-type]


async def _each(
    cluster: Holders,
    parts: Mapping[str, list[str]],
    send: Callable[[Any, list[str], bool], Awaitable[T]],
    here: Callable[[list[str]], Awaitable[T]],
    tried: frozenset[str],
    moves: int,
    policy: dict[str, Any],
) -> list[T]:
    """Each node's part (node -> its keys) by :func:`pass_on`, concurrently; every result."""
    answers = await asyncio.gather(
        *(
            pass_on(cluster, node, ks, send, here, tried=tried, moves=moves, **policy)
            for node, ks in parts.items()
        )
    )
    return [a for answer in answers for a in answer]
