"""Stale-synchronous reads whose bound adapts: ``StaleSync(..., staleness="auto")``.

A worker of ``world_size`` reads its parameters at each step through
:meth:`StaleSync.pull`, which waits (a long poll) until each has a version of
at least ``world_size * (step - bound)``: every worker pushes one gradient a
step, and each fold advances a version by one, so that is "the others are
at most ``bound`` steps behind, on average" (the version counts pushes, not
which worker made them: a fast worker's pushes count for a slow one's).
With ``staleness="auto"`` the bound is
:class:`~aioparamsync.values.adaptive.StalenessController`'s: it grows while
reads wait for stragglers and is halved when the loss the worker reports
stops improving.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..values.adaptive import StalenessController

__all__ = ["StaleSync"]


class StaleSync:
    """Reads at each step, at most ``bound`` steps stale.

    Args:
        client: the worker's client.
        names: the parameters read at each step.
        world_size: the workers that push one gradient a step each.
        staleness: the bound, in steps (an int >= 0), or ``"auto"``.
        wait: how long a read may wait for the versions (seconds).
        **auto: for ``"auto"``: the :class:`StalenessController`'s arguments
            (``initial``, ``low``, ``high``, ``window``, ``wait_share``, ``min_progress``).

    Raises:
        ValueError: a bad ``world_size``, ``staleness`` or controller argument.
    """

    def __init__(
        self,
        client: Any,
        names: Sequence[str],
        world_size: int,
        *,
        staleness: int | str = "auto",
        wait: float = 60.0,
        **auto: Any,
    ) -> None:
        if isinstance(names, (str, bytes)):
            raise TypeError("names must be a list of names, not one string")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size is a number of workers >= 1, not {world_size!r}")
        self.controller: StalenessController | None = None
        if staleness == "auto":
            self.controller = StalenessController(**auto)
            bound = self.controller.bound
        elif isinstance(staleness, int) and not isinstance(staleness, bool) and staleness >= 0:
            if auto:
                raise ValueError(f"{', '.join(auto)}: only for staleness='auto'")
            bound = staleness
        else:
            raise ValueError(f'staleness is a number of steps >= 0 or "auto", not {staleness!r}')
        self.client, self.names, self.world_size = client, list(names), world_size
        self.bound, self.wait = bound, wait
        self._began: float | None = None
        self._waited = 0.0

    async def pull(self, step: int) -> dict[str, np.ndarray]:
        """The arrays for ``step`` (0, 1, ...), at most ``bound`` steps stale."""
        now = time.monotonic()
        if self._began is None:
            self._began = now
        least = max(0, self.world_size * (step - self.bound))
        arrays = await self.client.get_arrays(self.names, min_version=least, wait=self.wait)
        self._waited += time.monotonic() - now
        return arrays

    def done(self, loss: float | None = None) -> int:
        """This step is done (its ``loss`` if known); answer the bound for the next."""
        now = time.monotonic()
        if self.controller is not None and self._began is not None:
            self.bound = self.controller.observe_step(now - self._began, self._waited, loss)
        self._began, self._waited = now, 0.0
        return self.bound

    def stats(self) -> dict[str, Any]:
        """The bound now and, with "auto", each change and why."""
        if self.controller is None:
            return {"bound": self.bound, "changes": []}
        return self.controller.stats()
