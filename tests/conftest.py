"""Shared fixtures: every async test runs on asyncio's own loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator

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


# -- randomized cluster runs (tests/test_randomized_cluster.py, tests/chaos/) ----------------


def pytest_addoption(parser):
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


def pytest_terminal_summary(terminalreporter):
    from chaos import options

    if options.REPORTS:
        terminalreporter.section("randomized cluster runs")
        for line in options.REPORTS:
            terminalreporter.write_line(line)
