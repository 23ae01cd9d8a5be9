"""The event loop a client runs best on: uvloop where it is installed.

A client moves large tensors without copying their bytes on uvloop; asyncio's
own loop (Python 3.11) joins the buffers of a write into one ``bytes`` and
copies them again into its transport's buffer: about 10x the client's CPU per
64 MiB push (see docs/performance.md). ``aioparamsync.run(main())`` is
``asyncio.run(main())`` on uvloop, as the node and ``aioparamsync-ctl`` run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run"]

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop where uvloop is installed, else one of asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to its end on a new event loop, as :func:`asyncio.run` does, on
    uvloop where it is installed (else on asyncio's own loop); answer its result.

    Raises:
        RuntimeError: called from a thread that runs an event loop (as ``asyncio.run``).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main, debug=debug)
    return uvloop.run(main, debug=debug)
