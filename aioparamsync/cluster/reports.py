"""What a node says of its peer links: their counters, and a warning while none answers.

Every ``STATS_LOG_SECONDS`` the node logs each link's state and counters.
While no link is up (say, none of the ``--peers`` a node started with
answers), the node says so at WARNING after ``unreachable_warning`` seconds,
then every ``UNREACHABLE_REPEAT`` seconds, not at every retry; when a peer
answers again, an INFO line says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

from .links import LinkState, PeerLink

__all__ = ["UNREACHABLE_WARNING", "LinkReports"]

# (under the membership's name, as these lines always were: filters of logs name it)
log = logging.getLogger("aioparamsync.cluster.membership")

# How often the node logs each peer link's state and counters (seconds).
STATS_LOG_SECONDS = 60.0
# How long no peer may fail to answer before the node warns (seconds), and how
# often it warns again while none answers.
UNREACHABLE_WARNING = 10.0
UNREACHABLE_REPEAT = 60.0
# Most peers one such warning names (the others are counted).
UNREACHABLE_NAMED = 5


class LinkReports:
    """The log lines of a node's links (see the module).

    Args:
        links: the node's links, by address (read, never changed, here).
        unreachable_warning: warn when no peer has answered for this long
            (seconds), then every ``UNREACHABLE_REPEAT`` seconds while none
            answers; None: never.
    """

    def __init__(self, links: Mapping[str, PeerLink], unreachable_warning: float | None) -> None:
        self.links = links
        self.unreachable_warning = unreachable_warning
        # Links known and none up: since when (time.monotonic()), and when the
        # node last warned of it.
        self._alone_since: float | None = None
        self._alone_warned: float | None = None
        self._alone_changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._report(), name="aioparamsync-peer-stats")]
        if self.unreachable_warning is not None:
            watch = asyncio.create_task(self._watch_alone(), name="aioparamsync-peer-watch")
            self._tasks.append(watch)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []

    def unjoined(self) -> str | None:
        """Why this node is in no cluster (None: it is, or it has no peers): no link is
        up, and a peer cannot be in one with it (see ``LinkState.REFUSED``)."""
        links = self.links.values()
        if any(link.state == LinkState.UP for link in links):
            return None
        refused = next((link for link in links if link.state == LinkState.REFUSED), None)
        return None if refused is None else f"{refused.name}: {refused.last_error}"

    def links_changed(self) -> None:
        """A link changed state, or came or went: is there still a peer that answers?"""
        up = next((link for link in self.links.values() if link.state == LinkState.UP), None)
        alone = bool(self.links) and up is None
        if alone and self._alone_since is None:
            self._alone_since = time.monotonic()
            self._alone_changed.set()
        elif not alone and self._alone_since is not None:
            if self._alone_warned is not None and up is not None:
                log.info(
                    "peer %s answers, after %.1f s with no peer answering",
                    up.name,
                    time.monotonic() - self._alone_since,
                )
            self._alone_since = self._alone_warned = None
            self._alone_changed.set()

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(STATS_LOG_SECONDS)
            for link in self.links.values():
                s = link.statistics()
                log.info(
                    "peer %s: %s, outbox %d, sent %d, coalesced %d, failures %d, "
                    "lag %.3f s, repaired %d",
                    link.name,
                    s["state"],
                    s["outbox_depth"],
                    s["updates_sent"],
                    s["updates_coalesced"],
                    s["send_failures"],
                    s["lag_seconds"],
                    s["repaired"],
                )

    async def _watch_alone(self) -> None:
        """Warn while links are known and none is up.

        First ``unreachable_warning`` seconds after the last link went down
        (or since the start, for seeds that never answered), then every
        ``UNREACHABLE_REPEAT`` seconds: a line per minute, not per retry.
        """
        assert self.unreachable_warning is not None
        while True:
            self._alone_changed.clear()
            since = self._alone_since
            if since is None:
                await self._alone_changed.wait()
                continue
            if self._alone_warned is None:
                due = since + self.unreachable_warning
            else:
                due = self._alone_warned + UNREACHABLE_REPEAT
            delay = due - time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._alone_changed.wait()
                continue
            self._alone_warned = time.monotonic()
            links = list(self.links.values())
            tried = [
                f"{link.name} ({link.last_error or 'no answer yet'})"
                for link in links[:UNREACHABLE_NAMED]
            ]
            if len(links) > UNREACHABLE_NAMED:
                tried.append(f"and {len(links) - UNREACHABLE_NAMED} more")
            log.warning(
                "no peer has answered for %.1f s; tried %s; retrying (this node serves "
                "alone meanwhile; check the addresses, and that the peers run and can be reached)",
                self._alone_warned - since,
                ", ".join(tried),
            )
