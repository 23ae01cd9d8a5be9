"""Shared fixtures: every async test runs on asyncio's own loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from cluster_helpers import NodeProcess, Spawn, launch

from aioparamsync import Node, ParameterClient

# Hypothesis reports a failure with a patch made by libcst, whose import warns
# (mypy_extensions.TypedDict) and so, under filterwarnings=error, turns any
# failing example into an INTERNALERROR that hides it: import it now, quietly.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with contextlib.suppress(ImportError):
        import hypothesis.extra._patching  # noqa: F401


def pytest_asyncio_loop_factories(config, item):
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture
async def node():
    """A node on 127.0.0.1 and a free port; any error the loop reports fails the test."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    async with Node("127.0.0.1", 0) as n:
        yield n
    await asyncio.sleep(0)
    assert not reported, f"the event loop reported errors: {reported}"


@pytest.fixture
async def client(node: Node):
    async with ParameterClient(node.address, timeout=30) as c:
        yield c


@pytest.fixture
async def spawn() -> AsyncIterator[Spawn]:
    """``await spawn(*flags)``: a node process on 127.0.0.1 and a free port, listening.

    ``listening=False`` returns at once (for a node expected to exit). Every
    process started here is killed (by PID) at teardown if it still runs.
    """
    started: list[NodeProcess] = []

    async def spawn_(*flags: str, listening: bool = True) -> NodeProcess:
        node = await launch("--port", "0", *flags)
        started.append(node)
        if listening:
            await node.wait_listening()
        return node

    try:
        yield spawn_
    finally:
        for node in started:
            await node.close()


# -- which tests start processes -------------------------------------------------------------
#
# The suite runs twice (.ci/run): on the compiled fast path, then (the tests of the wire and of
# calls) on the pure-Python one. The second pass need not run again what starts processes
# (node processes, the CLI, examples): those run the same code as the in-process tests, from
# another process, and take most of the time. So the first pass notes each test that started
# a process (every child is made by subprocess.Popen: asyncio's, multiprocessing's spawn and
# Ray's too), and the second leaves those out:
#   AIOPARAMSYNC_NOTE_SPAWNING=FILE  the ids of the tests that started a process go to FILE;
#   AIOPARAMSYNC_SKIP_SPAWNING=FILE  the tests FILE names are deselected.

_spawned = False
_popen_init = subprocess.Popen.__init__


def _noting_popen_init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
    global _spawned
    _spawned = True
    _popen_init(self, *args, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("AIOPARAMSYNC_NOTE_SPAWNING"):
        subprocess.Popen.__init__ = _noting_popen_init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _spawned
    _spawned = False
    try:
        return (yield)
    finally:
        note = os.environ.get("AIOPARAMSYNC_NOTE_SPAWNING")
        if note and _spawned:
            with open(note, "a", encoding="utf-8") as f:
                f.write(item.nodeid + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = os.environ.get("AIOPARAMSYNC_SKIP_SPAWNING")
    if not skip:
        return
    try:
        spawning = set(Path(skip).read_text(encoding="utf-8").split("\n"))
    except FileNotFoundError:
        raise pytest.UsageError(
            f"AIOPARAMSYNC_SKIP_SPAWNING={skip}: no such file (the first pass writes it, "
            "with AIOPARAMSYNC_NOTE_SPAWNING)"
        ) from None
    kept = [item for item in items if item.nodeid not in spawning]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in spawning])
        items[:] = kept


# -- randomized cluster runs (tests/test_randomized_cluster.py, tests/chaos/) ----------------


def pytest_addoption(parser: pytest.Parser) -> None:
    from chaos import options

    group = parser.getgroup("chaos", "randomized cluster runs (tests/test_randomized_cluster.py)")
    group.addoption(
        "--chaos-seed",
        metavar="S",
        help=f"run seed S (with --chaos-seeds: the first of them); env {options.ENV['seed']}",
    )
    group.addoption(
        "--chaos-seeds",
        metavar="N",
        help=f"run N seeds (from --chaos-seed, else from one drawn now); env "
        f"{options.ENV['seeds']}",
    )
    group.addoption(
        "--chaos-duration",
        metavar="SECONDS",
        help=f"seconds of workload per run (default {options.DEFAULT_DURATION:g}); env "
        f"{options.ENV['duration']}",
    )
    group.addoption(
        "--chaos-log-level",
        metavar="LEVEL",
        help=f"the nodes' log level, one of {', '.join(options.LOG_LEVELS)} (default "
        f"{options.LOG_LEVELS[0]}; a failed run keeps every node's log); env "
        f"{options.ENV['log_level']}",
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from chaos import options

    if options.REPORTS:
        terminalreporter.section("randomized cluster runs")
        for line in options.REPORTS:
            terminalreporter.write_line(line)
