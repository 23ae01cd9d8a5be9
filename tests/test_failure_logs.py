"""What an operator's log says when a peer dies and comes back: real node processes.

A peer that cannot be reached, a member down, one that failed: a WARNING, so
that ``--log-level warning`` shows it; once for each change, not at each
retry. A peer up again: INFO.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from cluster_helpers import (
    NodeProcess,
    ProcessCluster,
    eventually,
    open_clients,
    wait_formed,
)

pytestmark = pytest.mark.timeout(120)

# --failure-timeout: long enough that a member killed stays "down" (not "failed") while
# the retries below happen, short enough for the test that waits for "failed".
FAILURE_TIMEOUT = 4.0
# How long the retries to reach a killed peer are watched (its link retries every
# 0.05 s, doubling to 5 s: several retries in this time).
RETRIES_SECONDS = 2.5


@pytest.fixture
async def procs() -> AsyncIterator[ProcessCluster]:
    async with ProcessCluster(repair_interval=0.5) as cluster:
        yield cluster


def lines(node: NodeProcess, level: str, naming: str) -> list[str]:
    """The lines of ``node``'s log at ``level`` that name ``naming``."""
    return [line for line in node.stderr_lines if f" {level} " in line and naming in line]


async def three(procs: ProcessCluster) -> tuple[NodeProcess, NodeProcess, NodeProcess]:
    """A node logging at WARNING, one at INFO, and a third (to be killed): formed."""
    failure = ["--failure-timeout", str(FAILURE_TIMEOUT)]
    quiet = await procs.spawn(extra=["--log-level", "warning", *failure])
    chatty = await procs.spawn(peers=[quiet], extra=["--log-level", "info", *failure])
    victim = await procs.spawn(peers=[quiet], extra=failure)
    async with contextlib.AsyncExitStack() as stack:
        await wait_formed(await open_clients(stack, [quiet, chatty, victim]))
    return quiet, chatty, victim


async def test_a_peer_killed_is_a_warning_once_and_its_return_an_info_line(
    procs: ProcessCluster,
) -> None:
    quiet, chatty, victim = await three(procs)
    name = victim.node_id
    assert quiet.stderr_lines == [], quiet.stderr  # (formed: nothing to warn of)
    up_before = len(lines(chatty, "INFO", f"peer {name}: up"))
    await victim.kill()

    def warned() -> None:
        got = lines(quiet, "WARNING", name)
        assert any(f"peer {name}: backoff" in line for line in got), quiet.stderr
        assert any(f"{name} down" in line for line in got), quiet.stderr

    await eventually(warned, timeout=30.0)
    seen = len(lines(quiet, "WARNING", name))
    await asyncio.sleep(RETRIES_SECONDS)  # (the link retries meanwhile: no line each time)
    assert len(lines(quiet, "WARNING", name)) == seen, quiet.stderr
    assert seen <= 2, quiet.stderr  # unreachable, then down: one line each
    assert not [line for line in quiet.stderr_lines if " INFO " in line]

    again = await procs.spawn(peers=[quiet], port=victim.port, extra=["--log-level", "warning"])
    assert again.node_id == name

    def back() -> None:
        assert len(lines(chatty, "INFO", f"peer {name}: up")) > up_before, chatty.stderr

    await eventually(back, timeout=30.0)
    assert not lines(chatty, "WARNING", f"peer {name}: up")


async def test_a_member_down_past_the_failure_timeout_is_a_warning_that_it_failed(
    procs: ProcessCluster,
) -> None:
    quiet, _, victim = await three(procs)
    await victim.kill()

    def failed() -> None:
        assert any(f"{victim.node_id} failed" in line for line in lines(quiet, "WARNING", "epoch"))

    await eventually(failed, timeout=FAILURE_TIMEOUT + 30.0, interval=0.2)
