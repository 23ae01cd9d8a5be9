"""Shared fixtures: every async test runs on asyncio's own loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import warnings

import pytest
import uvloop

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
