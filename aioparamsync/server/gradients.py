"""Gradient pushes: each gradient folded once, at its parameter's primary.

Theory of operation. A ``push_gradients`` call carries gradients, each folded
into its parameter by the parameter's rule (see :mod:`aioparamsync.values.rules`).
In a cluster a parameter's gradients are folded by its primary (see
:mod:`aioparamsync.placement`), so a push is cut into parts by primary: this
node folds its own part, passes each other part on to its primary (marked
``forwarded``: a part is folded where it arrives, never passed on again), and
answers once every part has ended. How a part is passed on (a primary that
answers ``MOVED`` or cannot be reached, a call that ends without an answer)
is the one forward policy, :mod:`.forward`: a part goes only to a node that
holds its parameters, and fails ``UNAVAILABLE`` when none can take it.
After a part folded by another node, the reply waits a little
(``ARRIVAL_WAIT_MS``) for the versions made there to replicate here, so that
the pusher's next read here sees them.

One primary at a time. A part is passed on with this node's epoch; a node
that is not the primary of its names in its own view answers ``MOVED``
(nothing folded), and the part goes again to the names' primaries as this
node sees them by then (views differ for a moment while a member joins or
leaves). A part passed on to a next replica because its primary could not be
reached goes without an epoch, and is folded where it arrives. A node that
joins folds nothing until the others have stopped folding its keys (see
``Cluster.settling``). A fold taken here waits in the writer's queue; the
writer applies it only if this node is still the names' primary then (a
member may have claimed them meanwhile): else it is refused ``MOVED``, and
goes on to their primary (see ``GradientPushes._still_here``).

Idempotence: a push may carry a request id, so that a push sent again (after
a timeout or a lost connection, at this node or another) folds nothing twice:
see :mod:`.ledger`. :class:`GradientPushes` does the folding and the
forwarding. The decoding of encoded parameters and the result of an update are
here too: the update handlers use them as well.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConnectError, ErrorCode, Moved, RequestError
from ..placement import parse_key
from ..routing.merge import merge_results
from ..routing.partitions import collapse, cut, readable_error
from ..store.checks import check_count
from ..store.cuts import new_call
from ..values.packing import gradients_of
from ..values.partitions import elements_of, per_partition
from ..wire import Method, thrift
from . import forward
from .clusterview import ClusterView
from .ledger import PushLedger

if TYPE_CHECKING:
    from ..store.table import Applied
    from ..store.writer import ParameterStore
    from .holds import Waiting

__all__ = ["GradientPushes", "decode_parameter", "update_result"]

log = logging.getLogger(__name__)

# After a push folded by another node, how long its reply waits for the
# results to replicate here, so the pusher's next read here sees them (ms).
ARRIVAL_WAIT_MS = 2_000
# How long a push waits here for a parameter this node holds by placement but lacks, made
# at another of its replicas a moment ago, before it is refused UNKNOWN_PARAMETER (ms).
UNKNOWN_WAIT_MS = 1_000
# Waits before asking a primary again to fold gradients of a parameter it does
# not hold yet (just made elsewhere) (seconds): as long as after a MOVED.
UNKNOWN_RETRY_DELAYS = forward.FORWARD_RETRY_DELAYS


def update_result(applied: Applied) -> Any:
    """What an update or a push answers: each parameter's new version, and the timestamp."""
    versions = {e.name: e.version for e in applied.entries}
    return thrift.UpdateResult(versions=versions, timestamp=applied.timestamp)


def decoded_parameters(params: Sequence[Any], max_nbytes: int) -> Sequence[Any]:
    """``params`` with every encoded one decoded (see :mod:`aioparamsync.values.compression`).

    A decoded array may not be larger than ``max_nbytes`` (a few bytes of
    zlib or topk can claim any size).
    """
    if not any(p.encoding for p in params):
        return params
    return [decode_parameter(p, max_nbytes) if p.encoding else p for p in params]


def decode_parameter(p: Any, max_nbytes: int) -> Any:
    """The raw ``Parameter`` of an encoded one; its data a read-only view of the decoded array."""
    from ..values.arrays import to_parameter
    from ..values.compression import LOSSY, decode

    array = decode(p, max_nbytes=max_nbytes)
    array.flags.writeable = False  # ours alone: the store keeps it, uncopied
    decoded = to_parameter(p.name, array, p.version or 0)
    decoded.origin, decoded.rule, decoded.replace = p.origin, p.rule, p.replace
    if p.dtype is None:  # plain bytes stay plain bytes
        decoded.dtype = decoded.shape = None
    # The caller chose to lose precision: its gradient may fold into a
    # narrower float (see ParameterTable.check_gradients). Not on the wire.
    decoded.lossy = p.encoding in LOSSY
    return decoded


def _collapsed(future: asyncio.Future, chosen: Mapping[str, Any]) -> asyncio.Future:
    """``future``'s reply with partitions' versions as their parameters' (routing.partitions)."""

    async def collapsed() -> Any:
        try:
            reply = await future
        except RequestError as exc:
            if readable_error(exc) is exc:  # (then not `raise exc from exc`: it would hold
                raise  # itself, and with it every frame it passed, until a collection)
            raise readable_error(exc) from exc
        reply.success.versions = collapse(reply.success.versions, chosen)
        return reply

    return asyncio.ensure_future(collapsed())


class GradientPushes:
    """Answers ``push_gradients``: folds here, or forwards to the owners (see the module).

    Args:
        store: where the gradients are folded.
        cluster: the node's :class:`~aioparamsync.cluster.membership.Cluster` (who owns
            what), or None.
        waiting: the long polls, through which a reply waits for what other
            nodes folded to arrive.
        max_decoded_bytes: the largest array an encoded gradient may decode to.
        partition_bytes: gradients of parameters stored as partitions are cut
            so (see :mod:`aioparamsync.values.partitions`); 0: none is.
    """

    def __init__(
        self,
        store: ParameterStore,
        cluster: ClusterView | None,
        waiting: Waiting,
        max_decoded_bytes: int,
        *,
        partition_bytes: int = 0,
    ) -> None:
        self.store = store
        self.partition_bytes = partition_bytes
        self.cluster = cluster
        self.waiting = waiting
        self.max_decoded_bytes = max_decoded_bytes
        self.ledger = PushLedger()
        # (parts passed on whose calls ended unanswered: see forward.InDoubt)
        self.in_doubt = forward.InDoubt()
        self.forwarded = 0  # gradient pushes folded by their owner, another node
        self.forward_failures = 0  # ... that could not reach it, and were folded here
        # Gradients received from clients, by the encoding they came in ("none": raw):
        # what the clients' encoding="auto" chose, seen from the node.
        self.encodings: collections.Counter[str] = collections.Counter()

    def push(self, method: Method, args: Any) -> asyncio.Future:
        """Answer a push: a future of its reply.

        1. Seen before: a push sent again under a request id (and, for a part
           forwarded here, the same names) answers the first push's reply, in
           flight or done, unless that failed.
        2. Folded before: the gradients of names already folded under the
           request id (by parts of an earlier try that succeeded) are left out;
           the versions they made go into the reply.
        3. The rest is folded (:meth:`_fold`). Nothing left: answered at once.
           In a cluster, a push not forwarded here is cut by owner: if any part
           is owned by another node, the whole is checked here first, then each
           part is folded at its owner, concurrently (an owner that cannot be
           reached: here). Otherwise it is all folded here, atomically.
        4. The reply is remembered under the request id, while it succeeds.

        The reply is an ``UpdateResult``: each parameter's version made by
        this push (or by its earlier tries), and the timestamp.
        """
        push = args.push
        if push is None:
            raise RequestError(ErrorCode.BAD_REQUEST, "the push is missing")
        given, packed = push.grads or [], 0  # (packed: gradients that came in blocks, raw)
        if push.packed:  # (gradients in blocks: from here on, as if each came in grads)
            # (counted before a Parameter is made of each: the limit the fold checks)
            packed = sum(len(b.names or ()) for b in push.packed)
            check_count(self.store.table.limits, len(given) + packed, what="gradients")
            unpacked = gradients_of(push.packed)
            push.grads = [*given, *unpacked] if given else unpacked
            push.packed = None
        if push.acks is not None and push.acks not in ("1", "all"):
            raise RequestError(ErrorCode.BAD_REQUEST, f'acks is "1" or "all", not {push.acks!r}')
        if push.epoch is None and not push.forwarded:
            for g in push.grads or ():
                if "\x00" in g.name and parse_key(g.name) is None:
                    raise RequestError(
                        ErrorCode.BAD_REQUEST,
                        f"{g.name!r}: a parameter's name may not hold NUL (nothing was folded)",
                    )
        if push.forwarded and push.epoch is not None:
            self._check_primary(push)
        if self.cluster is not None and self.cluster.coordinator is not None:  # (fenced: refused)
            names = [g.name for g in push.grads or ()]
            self.cluster.check_writable(names, push.acks or self.cluster.acks)
        if not push.forwarded and push.grads:
            self.encodings.update(g.encoding or "none" for g in given)
            if packed:
                self.encodings["none"] += packed
        chosen: dict[str, Any] = {}
        if self.partition_bytes and not push.forwarded and push.grads:
            push, chosen = self._cut(push)
        ledger = self.ledger
        key = ledger.key(push)
        if key is not None and (first := ledger.first_reply(key)) is not None:
            return first
        grads, before = ledger.unfolded(push)
        timestamp = push.timestamp if push.timestamp is not None else time.time_ns() // 1_000_000
        future = self._fold(method, push, grads, before, timestamp)
        if chosen:  # (what it cut; partitions sent as such are answered as such)
            future = _collapsed(future, chosen)
        if key is not None:
            ledger.remember_reply(key, future)
        return future

    def _check_primary(self, push: Any) -> None:
        """Refuse (MOVED) a part passed on here by a node that took this one for the
        primary of names it is not the primary of now (but for names folded here under
        its request id: answered from the ledger, whatever this node is now; see
        forward.InDoubt)."""
        cluster = self.cluster
        if cluster is not None:
            folded = self.ledger.folded.get(push.request_id) if push.request_id else None
            names = [g.name for g in push.grads or () if not folded or g.name not in folded]
            forward.gate(
                cluster,
                names,
                primary=True,
                what="is not the primary of",
                then="nothing was folded",
            )

    def _cut(self, push: Any) -> tuple[Any, dict[str, Any]]:
        """``push`` with the gradients of large parameters cut as their partitions are.

        A parameter this node holds whole (made when ``--partition-bytes`` was larger,
        or 0) takes its gradient whole: cut, it would name partitions it has not.
        """
        per = per_partition(self.partition_bytes)
        table = self.store.table
        large = [
            g
            for g in push.grads
            if table.entry(g.name) is None and ((n := elements_of(g)) is None or n > per)
        ]
        if not large:
            return push, {}
        whole = {id(g) for g in push.grads} - {id(g) for g in large}
        try:
            items, _, chosen = cut(
                [
                    decode_parameter(g, self.max_decoded_bytes) if g.encoding == "zlib" else g
                    for g in large
                ],
                self.partition_bytes,
                max_nbytes=self.max_decoded_bytes,
            )
        except ValueError as exc:
            raise RequestError(ErrorCode.SHAPE_MISMATCH, str(exc)) from None
        if not chosen:
            return push, {}
        cut_push = copy.copy(push)
        cut_push.grads = [g for g in push.grads if id(g) in whole] + items
        return cut_push, chosen

    def _fold(
        self, method: Method, push: Any, grads: list[Any], before: dict[str, int], timestamp: int
    ) -> asyncio.Future:
        """Fold ``grads`` of ``push``, here or at their owners: a future of the reply."""
        parts = self._parts(push, grads)
        if not grads:  # every part was folded already
            return asyncio.ensure_future(self._folded_before(method, push, before))
        if any(node is not None for node in parts):
            self._check(parts)
            return asyncio.ensure_future(self._forward(method, push, parts, timestamp, before))
        return self._fold_here(method, push, grads, before, timestamp)

    async def _folded_before(self, method: Method, push: Any, before: dict[str, int]) -> Any:
        """The answer to a push every part of which earlier tries folded: with acks=all,
        once the replicas of those this node folds (it is their primary) have them (the
        earlier try's wait for them may have ended Indeterminate; those folded elsewhere
        are here only once their primary answered, confirmed)."""
        cluster = self.cluster
        if cluster is not None and cluster.links and self._acks_all(push):
            me = cluster.me.node_id
            mine = [name for name in before if forward.holder(cluster, name) == me]
            if mine:
                await cluster.replicated(mine)
        versions = thrift.UpdateResult(versions=before, timestamp=self.store.timestamp)
        return method.result(success=versions)

    def _parts(self, push: Any, grads: list[Any]) -> dict[str | None, list[Any]]:
        """``grads`` by the node that folds them (None: this one); {} when none is elsewhere.

        Raises:
            RequestError: (UNAVAILABLE) no replica of a parameter is up: nothing
                is folded (a fold here, where it is not held, would start it anew).
        """
        cluster = self.cluster
        parts: dict[str | None, list[Any]] = {}
        if cluster is None or not cluster.links or push.forwarded:
            return parts
        cut = forward.cut(cluster, dict.fromkeys(g.name for g in grads), what="the push")
        node_of = {name: node for node, names in cut.items() for name in names}
        for g in grads:
            parts.setdefault(node_of[g.name], []).append(g)
        return parts

    def _check(self, parts: dict[str | None, list[Any]]) -> None:
        """Refuse a push that cannot be folded, before any of its parts is."""
        # Checked here first, of every parameter this node holds (a replica
        # of those other nodes fold too): a push that cannot be folded is
        # refused before any part of it is. This node's own part is decoded
        # once, for the check and its fold; an encoded part another node folds
        # is left to it to decode and check, as are the parameters this node
        # does not hold (their primaries decide: what the others folded is
        # remembered under the push's id, see PushLedger).
        if None in parts:
            parts[None] = list(decoded_parameters(parts[None], self.max_decoded_bytes))
        table = self.store.table
        table.check_gradients(
            [g for gs in parts.values() for g in gs if not g.encoding and g.name in table]
        )

    def _acks_all(self, push: Any) -> bool:
        cluster = self.cluster
        if cluster is None:
            return False
        return (push.acks or cluster.acks) == "all"

    def _fold_here(
        self, method: Method, push: Any, grads: list[Any], before: dict[str, int], timestamp: int
    ) -> asyncio.Future:
        """Fold every one of ``grads`` here, atomically: a future of the reply."""

        def result(applied: Applied) -> Any:
            made = update_result(applied)
            self.ledger.remember_folded(push.request_id, made.versions)
            made.versions = {**before, **made.versions}
            return method.result(success=made)

        decoded = decoded_parameters(grads, self.max_decoded_bytes)
        cluster = self.cluster
        if cluster is None or not cluster.links:  # (a node alone: it folds all)
            return self.store.submit(
                decoded, timestamp, gradients=True, then=result, call=push.call
            )
        names = [g.name for g in grads]
        acks_all = self._acks_all(push)
        settling = cluster.settling
        arriving = self._arriving(grads)
        if settling is None and not acks_all and not arriving and push.epoch is not None:
            # (refused Moved, the node that passed it on, or the routed client, sends it on)
            return self.store.submit(
                decoded,
                timestamp,
                gradients=True,
                then=result,
                call=push.call,
                check=self._still_here(push, names),
            )

        async def folded() -> Any:
            if settling is not None or arriving:
                # (the names may move meanwhile, claimed by a member: see forward.unmoved)
                unmoved = forward.unmoved(cluster, names)
                await self._arrived(arriving)
                if cluster.settling is not None:
                    await cluster.settling
                if push.forwarded:
                    unmoved()  # (Moved: the node that passed it on sends it on)
                else:
                    parts = self._parts(push, grads)
                    if any(node is not None for node in parts):
                        self._check(parts)  # (as _fold does: refused before any part folds)
                        return await self._forward(method, push, parts, timestamp, before)
            check = self._still_here(push, names)
            try:
                applied = await self.store.submit(
                    decoded, timestamp, gradients=True, call=push.call, check=check
                )
            except Moved:
                if push.forwarded:
                    raise
                # (they moved while the fold waited for the writer: on to their holders now)
                parts = self._parts(push, grads)
                return await self._forward(method, push, parts, timestamp, before)
            # (remembered as folded before the wait for its replicas: should that end
            # Indeterminate, the push sent again under its request id folds it no more)
            made = result(applied)
            if acks_all:
                await cluster.replicated([e.name for e in applied.entries])
            return made

        return asyncio.ensure_future(folded())

    def _still_here(self, push: Any, names: list[str]) -> Callable[[], None] | None:
        """The check a fold here makes as the writer applies it (see ``ParameterStore.submit``).

        Taken as the names' primary, a fold may wait in the writer's queue while
        this node's view changes (a member claims the names): applied then, it
        would make the next version beside the new primary's, and last-writer-wins
        would drop one of the two. So the writer applies it only if this node is
        still their primary (a part passed on here as a fallback, its primary out
        of reach: if their holders did not change); else it is refused ``Moved``,
        nothing folded, and goes on to their primary.
        """
        cluster = self.cluster
        if cluster is None or not cluster.links:
            return None
        if push.forwarded and push.epoch is None:
            return forward.unmoved(cluster, names)

        def check() -> None:
            forward.gate(
                cluster,
                names,
                primary=True,
                what="is no longer the primary of",
                then="nothing was folded",
            )

        return check

    def _arriving(self, grads: Sequence[Any]) -> list[str]:
        """The names of ``grads`` this node holds by placement but not in its table yet
        (none outside a cluster): a parameter made at another of its replicas a moment
        ago reaches this one by replication."""
        cluster = self.cluster
        if cluster is None or not cluster.links:
            return []
        table = self.store.table
        return [g.name for g in grads if g.name not in table and cluster.holds_here(g.name)]

    async def _arrived(self, names: list[str]) -> None:
        """Wait (up to ``UNKNOWN_WAIT_MS``) for ``names`` (see :meth:`_arriving`) to come;
        those that do not are refused by the fold, as unknown."""
        if names:
            polls = [self.waiting.poll([n], 1, UNKNOWN_WAIT_MS) for n in names]
            await asyncio.gather(*polls, return_exceptions=True)

    async def _forward(
        self,
        method: Method,
        push: Any,
        parts: dict[str | None, list[Any]],
        timestamp: int,
        before: Mapping[str, int],
    ) -> Any:
        """Fold each part of a push at its holder (None: here); answer the versions made.

        The parts are applied concurrently, each atomically where it is
        folded, passed on by the one forward policy (:func:`.forward.pass_on`).
        If a part fails, the push fails once every part has ended, and what
        the others folded is remembered under the push's id (see
        :class:`PushLedger`): sent again, the push folds only the rest.
        ``before``: the versions of the names folded by earlier tries.
        """
        cluster = self.cluster
        assert cluster is not None
        by_name = {g.name: g for gs in parts.values() for g in gs}
        acks = push.acks or cluster.acks
        # (a push cut among nodes: its parts stamped as one call, for a checkpoint's cut)
        call = push.call or (new_call(len(by_name)) if set(parts) != {None} else None)

        async def send(link: Any, names: list[str], fallback: bool) -> Any:
            passed = thrift.GradientPush(
                grads=[by_name[n] for n in names],
                request_id=push.request_id,
                timestamp=timestamp,
                forwarded=True,
                # (to a next replica, its primary out of reach: folded where it arrives)
                epoch=None if fallback else cluster.epoch,
                acks=acks,
                call=call,
            )
            try:
                result = await self._forward_to(link, passed)
            except ConnectError:
                self.forward_failures += 1
                raise
            self.forwarded += 1
            await self._arrival(result.versions)
            return result

        async def here(names: list[str]) -> Any:
            arriving = self._arriving([by_name[n] for n in names])
            if cluster.settling is not None or arriving:
                unmoved = forward.unmoved(cluster, names)  # (see forward.unmoved)
                await self._arrived(arriving)
                if cluster.settling is not None:
                    await cluster.settling
                unmoved()
            grads = decoded_parameters([by_name[n] for n in names], self.max_decoded_bytes)
            # (Moved, the names moved while the fold waited for the writer: pass_on
            # sends them on to their holders now)
            applied = await self.store.submit(
                grads, timestamp, gradients=True, call=call, check=self._still_here(push, names)
            )
            made = update_result(applied)
            # (remembered before the wait for its replicas, as in _fold_here)
            self.ledger.remember_folded(push.request_id, made.versions)
            if acks == "all":
                await cluster.replicated([e.name for e in applied.entries])
            return made

        async def fold(node: str | None, grads: list[Any]) -> Any:
            names = [g.name for g in grads]
            target = cluster.me.node_id if node is None else node  # (None: here, see pass_on)
            done = await forward.pass_on(
                cluster,
                target,
                names,
                send,
                here,
                what="gradients",
                in_doubt=self.in_doubt,
                request_id=push.request_id,
                # (under a coordinator, folded only at the primary: see forward)
                fallback=cluster.coordinator is None,
            )
            return merge_results(done)

        results = await asyncio.gather(
            *(fold(node, g) for node, g in parts.items()), return_exceptions=True
        )
        versions: dict[str, int] = dict(before)
        for r in results:
            if not isinstance(r, BaseException):
                versions.update(r.versions)
                self.ledger.remember_folded(push.request_id, r.versions)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        stamp = max(r.timestamp for r in results if not isinstance(r, BaseException))
        return method.result(success=thrift.UpdateResult(versions=versions, timestamp=stamp))

    async def _forward_to(self, owner: Any, push: Any) -> Any:
        """``owner.forward(push)``, again a few times while the owner lacks a parameter.

        A parameter just created here may not have reached its owner yet.
        """
        table = self.store.table
        for delay in UNKNOWN_RETRY_DELAYS:
            try:
                return await owner.forward(push)
            except RequestError as exc:
                if exc.code != ErrorCode.UNKNOWN_PARAMETER or not all(
                    g.name in table for g in push.grads
                ):
                    raise
            await asyncio.sleep(delay)
        return await owner.forward(push)

    async def _arrival(self, versions: Mapping[str, int]) -> None:
        """Wait (a little) until this node holds ``versions``, replicated from their owner.

        Only of the names this node holds (is a replica of): the others never come.
        """
        cluster = self.cluster
        polls = [
            self.waiting.poll([n], v, ARRIVAL_WAIT_MS)
            for n, v in versions.items()
            if cluster is None or cluster.holds_here(n)
        ]
        await asyncio.gather(*polls, return_exceptions=True)
