"""``kill -USR1 PID``: a running process prints every asyncio task's stack to stderr.

What a node (or a worker) waits for when it seems stuck: each task's name, then the whole
chain of coroutines it is suspended in (``asyncio``'s own ``print_stack`` shows only the
outermost frame of a suspended task), then the future at its end, between two marker
lines, so a log can be cut at them. Like Go's SIGQUIT or the JVM's ``jstack``, it changes
nothing and the process goes on.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["BEGIN", "END", "dump_tasks", "install"]

BEGIN = "--- asyncio tasks (SIGUSR1) ---"
END = "--- end of asyncio tasks ---"
DEPTH = 40  # the most frames shown a task


def _chain(coro: Any) -> Iterator[str]:
    """``file:line in function`` of each coroutine (or generator) down the chain of
    awaits."""
    for _ in range(DEPTH):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        frame = frame or getattr(coro, "ag_frame", None)
        if frame is None:
            return
        yield f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        awaited = (
            getattr(coro, "cr_await", None)
            or getattr(coro, "gi_yieldfrom", None)
            or getattr(coro, "ag_await", None)
        )
        if awaited is None:
            return
        coro = awaited


def dump_tasks(out: TextIO | None = None) -> int:
    """Write every task of the running loop with its chain of awaits to ``out`` (stderr);
    answer how many tasks there were."""
    out = out or sys.stderr
    tasks = sorted(asyncio.all_tasks(), key=lambda t: t.get_name())
    print(f"{BEGIN} {len(tasks)} tasks", file=out)
    for task in tasks:
        print(f"task {task.get_name()}:", file=out)
        try:
            for line in _chain(task.get_coro()):
                print(line, file=out)
            # (the future the task is parked on, with the callbacks that will wake it)
            waiter = getattr(task, "_fut_waiter", None)
            if waiter is not None:
                print(f"  waits on {waiter!r}"[:400], file=out)
        except Exception as exc:  # noqa: BLE001 (a frame not to be read: say so, go on)
            print(f"  (not shown: {type(exc).__name__}: {exc})", file=out)
    print(END, file=out, flush=True)
    return len(tasks)


def install(loop: asyncio.AbstractEventLoop) -> bool:
    """Dump the tasks on SIGUSR1 (see the module); answer whether the platform has it."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return False
    loop.add_signal_handler(usr1, dump_tasks)
    return True
