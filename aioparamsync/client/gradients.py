"""Gradients from the client: :meth:`GradientClient.push_gradients`, raw or compressed.

A part of :class:`~aioparamsync.client.api.ParameterClient` (it is one of its
bases, as :class:`~.rows.TableClient` is): gradients are encoded here (an
encoding, with error feedback for the lossy ones, or chosen by measurement
with ``encoding="auto"``: see :mod:`.auto`), pushed with a request id, and
folded on the node by each parameter's rule.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from types import EllipsisType
from typing import TYPE_CHECKING, Any

from ..errors import RequestError
from ..values.arrays import to_parameter
from ..values.packing import pack_arrays
from ..wire import METHODS, Method, thrift
from .shared import Lane

if TYPE_CHECKING:
    from .shared import Region

__all__ = ["GradientClient"]

log = logging.getLogger(__name__)


class GradientClient:
    """Pushing gradients (see the module); what the client provides is declared below."""

    if TYPE_CHECKING:
        _auto: Any
        _feedback: Any
        _last_push: tuple[str, list[Any]] | None
        _rules: dict[str, Any]
        _packs: bool
        _lane: Lane | None
        _local_lane: Lane | None
        _shared_limit: int
        find_local: bool
        routes: Any

        async def invoke(
            self, m: Method, /, *, timeout: float | EllipsisType | None = ..., **args: Any
        ) -> Any: ...

    def stats(self) -> dict[str, Any]:
        """What this client chose when it compressed, per parameter, and what it shared
        with its node (no call is made).

        ``"gradients"``: name -> what the last push with error feedback sent
        of it (``share`` of the values, ``encoding``: None when top-k went
        raw, ``bound``: top-k's residual bound then, ``pushes``).
        ``"shared_memory"`` (a client of a node on its host, see :mod:`.shared`):
        its ``segments`` and their ``bytes``, the bytes ``lent`` to calls (and to
        arrays alive) now, those ``kept`` from use (their calls failed), the
        ``reads`` and ``pushes`` that went so, and why it is ``broken`` (None: it
        is not).
        """
        feedback = self._feedback
        out: dict[str, Any] = {"gradients": {} if feedback is None else feedback.sent_all()}
        if self._auto is not None:
            out.update(self._auto.stats())
        if self._lane is not None:
            out["shared_memory"] = self._lane.stats()
        return out

    def _on_connection(self, local: bool) -> None:
        """(ConnectionPool's: a connection opened, on a node's Unix socket or not.) Found
        by asking (``find_local``): shared memory while there, none over TCP."""
        if self.find_local:
            if local and self._local_lane is None:
                self._local_lane = Lane(self._shared_limit)
            self._lane = self._local_lane if local else None

    async def _auto_of(self) -> Any:
        if self._auto is None:
            from .auto import Auto, local_link

            local = await local_link(self)
            if self._auto is None:  # (another call made it meanwhile)
                self._auto = Auto(local)
        return self._auto

    async def push_gradients(
        self,
        grads: Mapping[str, Any],
        *,
        encoding: str | None = None,
        ratio: float = 0.01,
        error_feedback: bool = True,
        max_residual: float | None = None,
        warmup: int = 0,
        target: float = 0.2,
        request_id: str | None = None,
        timestamp: int | None = None,
        acks: str | None = None,
        timeout: float | EllipsisType | None = ...,
    ) -> dict[str, int]:
        """Fold gradients into their parameters on the node, by each parameter's rule.

        The parameters must exist with a rule (see :meth:`update_parameters`).
        All gradients of one push are applied together, or none. The push
        carries a request id (a new one by default): sent again with the same
        id, it is applied once, and a broken connection is retried so. (In a
        cluster a push is folded in parts, one at each parameter's owner; if
        one part is refused after others were folded, sending the push again
        under its id folds the rest, each part once: see the README.)

        Args:
            grads: name -> gradient array (the parameter's shape).
            encoding: compress them: ``"fp16"``, ``"bf16"``, ``"int8"``,
                ``"topk"`` (the largest by magnitude) or ``"zlib"``.
            ratio: the least share of elements ``"topk"`` sends. With error
                feedback it sends more when that would hold back more than
                the rule's bound (see ``max_residual``), and raw when top-k
                would be larger than the array.
            error_feedback: with a lossy encoding, keep what compression left
                out of each gradient and add it to the next one (so nothing
                is lost over time; see :class:`~aioparamsync.values.feedback.ErrorFeedback`).
            max_residual: top-k with error feedback: the share of what there
                was to send (by norm) that a push may hold back. Default: by
                the parameter's rule, as this client last read or set it
                (0.5 for ``sum`` and ``sgd`` without momentum, ``0.5 * (1 -
                momentum)`` with it, ``0.5 * (1 - beta1)`` for ``adam``; that
                of momentum 0.9 for a rule not seen; ``get_arrays`` reads
                rules once the client pushes with feedback), lowered while what
                there is to send grows. 1.0: exactly ``ratio`` (unbounded: at a
                step size that converges uncompressed, training may diverge).
            warmup: top-k: for each parameter's first ``warmup`` pushes, the
                least share falls from 25% to ``ratio`` (sparsity warm-up).
            target: ``encoding="auto"``: the share of a step communication
                may take. Each push then picks, from what this client has
                measured (the link's round trip and throughput over its
                pushes and reads, the time it takes to encode, the worker's
                compute time between pushes), the least lossy of none, bf16,
                int8, top-k 10% and 1% that keeps under it, or the fastest
                when none does; ``stats()["auto"]`` shows the figures and the
                choice. Error feedback is always on with "auto".
            request_id: the push's id (default: a new UUID). With error
                feedback, the last push sent under your id is sent again as
                it was when you push under that id again (a retry after a
                timeout), so that its gradients count once.
            timestamp: the push's timestamp (default: now, in milliseconds).
            acks: as in :meth:`update_parameters`.
            timeout: this call's deadline (seconds; default: the client's).

        Returns:
            The version each parameter now has.

        Raises:
            RequestError: the node refused the push (nothing was applied):
                e.g. UNKNOWN_PARAMETER, or a parameter without a rule, or a
                gradient of another shape (SHAPE_MISMATCH).
        """
        if not isinstance(grads, Mapping):
            raise TypeError("grads must be a mapping of name -> array")
        if acks is not None and acks not in ("1", "all"):
            raise ValueError(f'acks is "1" or "all", not {acks!r}')
        feedback, kept = None, {}
        packed: list[Any] = []
        region = None  # (of shared memory, the gradients written there: see .shared)
        last = self._last_push
        auto = None
        if encoding == "auto":
            auto = await self._auto_of()
            encoding, ratio, max_residual = auto.push_choice(grads, target)
            error_feedback = True
        try:
            if request_id is not None and last is not None and last[0] == request_id:
                # Sent again (a retry): what went the first time. Error feedback
                # counted it once; encoding it anew would count it twice.
                params = last[1]
            elif encoding is None:
                packed, rest, region = self._packed(grads, request_id)
                try:
                    params = [to_parameter(name, g) for name, g in rest.items()]
                except BaseException:  # (never sent: its region back)
                    if region is not None and self._lane is not None:
                        self._lane.give(region)
                    raise
            else:
                from ..values import compression

                if encoding in compression.LOSSY and error_feedback:
                    if self._feedback is None:
                        from ..values.feedback import ErrorFeedback

                        self._feedback = ErrorFeedback()
                    feedback = self._feedback
                    kept = feedback.kept(grads)
                    rules = self._rules
                    params = []
                    for name, g in grads.items():
                        began = time.perf_counter()
                        params.append(
                            feedback.encode(
                                name,
                                g,
                                encoding,
                                ratio=ratio,
                                rule=rules.get(name),
                                max_residual=max_residual,
                                warmup=warmup,
                            )
                        )
                        if auto is not None:
                            auto.observe_encode(name, g, params[-1], time.perf_counter() - began)
                else:
                    params = [
                        compression.encode(name, g, encoding, ratio=ratio)
                        for name, g in grads.items()
                    ]
                if feedback is not None and request_id is not None:
                    self._last_push = (request_id, params)
            push = thrift.GradientPush(
                grads=params,
                packed=packed or None,
                request_id=request_id or uuid.uuid4().hex,
                timestamp=timestamp if timestamp is not None else time.time_ns() // 1_000_000,
                acks=acks,
            )
            began = time.monotonic()
            try:
                result = await self.invoke(METHODS.push_gradients, timeout=timeout, push=push)
            except BaseException:
                if region is not None and self._lane is not None:
                    self._lane.keep(region)  # (the node may read it yet)
                raise
            if region is not None and self._lane is not None:
                self._lane.give(region)
            if self._auto is not None and self._auto.push is not None:
                self._auto.observe_push(params, time.monotonic() - began)
            folded = dict(result.versions)
            if packed and (left := [n for b in packed for n in b.names if n not in folded]):
                # A node older than GradientPush.packed left the blocks out (and folded
                # the rest): what it left goes again, as Parameters, under an id of its own.
                log.warning(
                    "the node folded none of %d gradients sent in blocks (older than "
                    "GradientPush.packed): sent again one Parameter each",
                    len(left),
                )
                self._packs = False
                again = {n: grads[n] for n in left}
                return folded | await self.push_gradients(
                    again, timestamp=push.timestamp, acks=acks, timeout=timeout
                )
        except (RequestError, TypeError, ValueError):
            # Not applied (refused by the node, or never sent): error feedback
            # keeps the residuals it had, so what this push would have sent is
            # neither lost nor sent twice by the next. (After a timeout or a
            # broken connection the push may have been applied: then the
            # residuals stay as sent; a retry under the same request_id is
            # applied once.)
            if feedback is not None:
                feedback.restore(kept)
                self._last_push = None  # (to be encoded again, from the old residuals)
            raise
        return folded

    def _packed(
        self, grads: Mapping[str, Any], request_id: str | None
    ) -> tuple[list, Mapping, Region | None]:
        """The small raw gradients of ``grads`` in blocks (``GradientPush.packed``), the
        others, and the region of shared memory some blocks' bytes are in (None: all in
        their blocks). None in blocks unless the node has answered a read so (it knows
        them), the push is not routed (a routed push is cut by Parameter) and its id is
        new (a push sent again under an id is sent as it was). Once the node has
        answered a read in shared memory, the raw gradients of 16 KiB or more go there."""
        routes = self.routes
        if not self._packs or request_id is not None or self._auto is not None:
            return [], grads, None
        if routes is not None and routes.wanted():
            return [], grads, None
        lane = self._lane
        if lane is not None and lane.shared_reads:  # (the node maps this client's segments)
            shared, rest, region = lane.for_push(grads)
            if region is not None:
                packed, rest = pack_arrays(rest)
                return [*shared, *packed], rest, region
        return (*pack_arrays(grads), None)
