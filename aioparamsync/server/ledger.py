"""The pushes a node has seen by request id, and what it folded of them.

Idempotence: a push may carry a request id, so that a push sent again (after
a timeout or a lost connection, at this node or another) folds nothing twice.
The :class:`PushLedger` keeps two records, each of the latest
``MAX_REQUEST_IDS`` request ids:

* the reply of each push by its request id and names (the parts of one push
  differ by their names), kept while it has not failed: a push sent again
  answers the first one's reply, in flight or done, and folds nothing;
* under each request id, the names this node has folded and the versions
  made: a push folded in parts may have some parts folded and others failed;
  sent again, it folds only the names no part has folded yet, and answers the
  versions the others made.

The ledger is pure bookkeeping (no event loop): the gradient pushes
(:mod:`.gradients`) fold and forward.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping
from typing import Any

from ..errors import ErrorCode, RequestError

__all__ = ["MAX_REQUEST_IDS", "MAX_REQUEST_ID_BYTES", "PushLedger"]

# Request ids of gradient pushes remembered (with their outcome) for retries.
MAX_REQUEST_IDS = 100_000
MAX_REQUEST_ID_BYTES = 256


class PushLedger:
    """The pushes seen by request id, and the parts of them folded here (see the module).

    It only keeps, looks up and forgets: the futures it holds are given a
    done callback, no more.
    """

    def __init__(self) -> None:
        # request id -> the future of that push's reply (kept while it succeeds)
        self.replies: collections.OrderedDict[str, asyncio.Future] = collections.OrderedDict()
        # request id -> the names this node has folded under it, and the versions
        # made: in a cluster a push is folded in parts, at each name's owner, and
        # a push sent again (after one part failed, or at another node) folds
        # only what no part has folded yet.
        self.folded: collections.OrderedDict[str, dict[str, int]] = collections.OrderedDict()
        self.repeated = 0  # pushes sent again, whole or in part

    @staticmethod
    def key(push: Any) -> str | None:
        """What the reply to ``push`` is remembered by; None for a push without a request id.

        Raises:
            RequestError: (BAD_REQUEST) the request id is empty or too long.
        """
        request_id = push.request_id
        if request_id is None:
            return None
        if not request_id or len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise RequestError(
                ErrorCode.BAD_REQUEST,
                f"a request id has 1 to {MAX_REQUEST_ID_BYTES} bytes",
            )
        # By its names too: the parts of one push (forwarded here by another
        # node, or sent here by a client that cut it by primary, several of
        # them to one node when their primaries are down) are told apart, and
        # a push sent again is sent with the same names.
        return request_id + "\0" + "\0".join(sorted(g.name for g in push.grads))

    def first_reply(self, key: str) -> asyncio.Future | None:
        """The reply to the push first sent under ``key``, if this is a retry of one."""
        first = self.replies.get(key)
        if first is not None:  # a retry: the first push's outcome
            self.repeated += 1
            self.replies.move_to_end(key)
        return first

    def unfolded(self, push: Any) -> tuple[list[Any], dict[str, int]]:
        """The gradients of ``push`` not folded yet, and the versions made by those that were."""
        request_id = push.request_id
        folded = self.folded.get(request_id) if request_id is not None else None
        grads = push.grads
        if not folded:
            return grads, {}
        # parts of it were folded before: not again
        self.repeated += 1
        before = {g.name: folded[g.name] for g in grads if g.name in folded}
        return [g for g in grads if g.name not in folded], before

    def remember_reply(self, key: str, future: asyncio.Future) -> None:
        """Answer ``future`` to a push sent again under ``key``, unless it fails."""
        pushes = self.replies
        pushes[key] = future
        if len(pushes) > MAX_REQUEST_IDS:
            pushes.popitem(last=False)

        def forget_failure(done: asyncio.Future) -> None:
            # A retry may try again (what was folded of it, it folds no more).
            if (done.cancelled() or done.exception()) and pushes.get(key) is done:
                del pushes[key]

        future.add_done_callback(forget_failure)

    def remember_folded(self, request_id: str | None, versions: Mapping[str, int]) -> None:
        """Note that the names of ``versions`` were folded under ``request_id``."""
        if request_id is None or not versions:
            return
        folded = self.folded
        folded.setdefault(request_id, {}).update(versions)
        folded.move_to_end(request_id)
        if len(folded) > MAX_REQUEST_IDS:
            folded.popitem(last=False)
