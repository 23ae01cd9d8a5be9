"""What the multi-process examples share: a coordinator's worker processes, and their flags.

``train_gradients.py`` and ``train_ctr.py`` each run as a coordinator that starts
``--workers`` copies of itself (with ``--worker-rank``): each worker prints
``ready``, waits for ``go`` on its stdin, trains, and prints its report as one
line of JSON; it stops as soon as its stdin closes (the coordinator went away).
Every wait here is bounded, and a worker that does not stop is killed by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

__all__ = [
    "positive_float",
    "positive_int",
    "run_workers",
    "stoppable",
    "watch_stdin",
]

Report = TypeVar("Report")
Result = TypeVar("Result")

# Bounds of the waits (seconds): a worker's start (it imports numpy, maybe torch, and
# makes its data), and its exit once told.
START_TIMEOUT = 60.0
EXIT_TIMEOUT = 10.0


def watch_stdin(gone: threading.Event) -> None:
    """Set ``gone`` once stdin closes: the coordinator went away (or told us to stop)."""

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            while sys.stdin.readline():
                pass
        gone.set()

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


async def _start(script: str, argv: Sequence[str], workers: int) -> list[Any]:
    """Start the worker processes and wait (bounded) until each says it is ready."""
    procs: list[asyncio.subprocess.Process] = []
    try:
        for rank in range(workers):
            procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    script,
                    *argv,
                    "--worker-rank",
                    str(rank),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
            )
        async with asyncio.timeout(START_TIMEOUT):
            for rank, proc in enumerate(procs):
                assert proc.stdout is not None
                line = await proc.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError(f"worker {rank} did not start (it said {line!r})")
    except BaseException:
        await _stop(procs)
        raise
    return procs


async def _stop(procs: Sequence[asyncio.subprocess.Process]) -> None:
    """Close their stdin (they stop at their next step), then kill (by PID) what is left."""
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
    for proc in procs:
        if proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), EXIT_TIMEOUT)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


async def run_workers(
    script: str,
    argv: Sequence[str],
    workers: int,
    time_limit: float,
    report: Callable[..., Report],
) -> tuple[list[Report], float]:
    """Start ``workers`` copies of ``script`` (with ``argv``), start them together, and
    collect their reports (``report(**json)`` of each one's last line); answer them and
    the seconds from "go" to the last report. A worker trains ``time_limit`` s at most."""
    procs = await _start(script, argv, workers)
    try:
        started = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            await proc.stdin.drain()

        async def report_of(rank: int, proc: asyncio.subprocess.Process) -> Report:
            stdout, _ = await proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"worker {rank} failed with exit code {proc.returncode}")
            return report(**json.loads(stdout.decode().strip().splitlines()[-1]))

        # The workers stop themselves at time_limit; this bounds a hung one.
        async with asyncio.timeout(time_limit + START_TIMEOUT):
            reports = await asyncio.gather(*(report_of(r, p) for r, p in enumerate(procs)))
        return list(reports), time.monotonic() - started
    finally:
        await _stop(procs)


async def stoppable(coroutine: Coroutine[Any, Any, Result]) -> Result:
    """Run ``coroutine``; SIGINT (Ctrl-C) or SIGTERM cancels it (the workers are stopped).

    SIGINT is handled here, not left to asyncio's default: a job started in the
    background by a script (``cmd &``) inherits SIGINT ignored, and Python keeps it so.
    """
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    return await coroutine


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number above 0")
    return value
