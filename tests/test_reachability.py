"""A node for more than one machine: the address it gives peers, and peers that do not answer.

Node processes (``python -m aioparamsync``) on 127.0.0.1 and ports the kernel
picks; a peer that refuses is a socket bound and held by the test but not
listening (so no other process can take its port), and a peer that does not
answer is a node process held by SIGSTOP. The ``spawn`` fixture kills (by PID)
every node a test leaves running; every wait is bounded.
"""

from __future__ import annotations

import logging
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import CALL_TIMEOUT, LOOPBACK, NodeProcess, eventually

from aioparamsync import Node, ParameterClient
from aioparamsync.cluster.links import member_name
from aioparamsync.node import unspecified_host

pytestmark = pytest.mark.timeout(90)

# The node's unreachable-peers warning, as the tests shorten it (seconds).
WARN_AFTER = "0.3"
NO_ANSWER = "no peer has answered for"
RETRY = re.compile(r"DEBUG aioparamsync\.cluster\.links: peer \S+: .*; retrying in")
# The bound of a wait for a handful of the node's retries (its backoff starts
# at 50 ms and doubles: a few retries take a few seconds).
RETRIES_TIMEOUT = 20.0


@pytest.fixture
def refusing() -> Iterator[tuple[str, int]]:
    """An address on 127.0.0.1 where connecting is refused: bound, never listening."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        yield s.getsockname()


def text(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def lines_with(node: NodeProcess, fragment: str) -> list[str]:
    return [line for line in node.stderr_lines if fragment in line]


def assert_clean(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert " ERROR " not in stderr and " CRITICAL " not in stderr, stderr


async def stop(node: NodeProcess) -> int:
    node.signal(signal.SIGTERM)
    return await node.wait_exit()


# -- every interface, and --advertise ---------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_every_interface_is_no_address_to_give_peers(host) -> None:
    assert unspecified_host(host)
    assert unspecified_host(f"[{host}]") and unspecified_host("") and unspecified_host(" ")


@pytest.mark.parametrize("host", ["127.0.0.1", "10.0.0.1", "::1", "localhost", "node-a"])
def test_an_address_or_a_name_is_one_to_give_peers(host) -> None:
    assert not unspecified_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_node_on_every_interface_with_peers_needs_advertise(host, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with pytest.raises(ValueError, match=r"needs advertise=\(host, port\).*peers can reach"):
        Node(host, 0, peers=[(LOOPBACK, 9)], data_dir=data)
    assert not data.exists()  # refused before anything was made
    # With an address to give, it is fine (not started: nothing listens).
    Node(host, 0, peers=[(LOOPBACK, 9)], advertise=(LOOPBACK, 9090))


@pytest.mark.parametrize("advertise", [("0.0.0.0", 9090), "[::]:9090", ("", 9090)])
def test_node_refuses_to_advertise_every_interface(advertise) -> None:
    with pytest.raises(ValueError, match="every interface, not an address peers can reach"):
        Node(LOOPBACK, 0, advertise=advertise)


async def test_a_node_alone_on_every_interface_starts_with_a_warning(spawn) -> None:
    node = await spawn("--host", "0.0.0.0")
    assert node.node_id == f"0.0.0.0:{node.port}"
    async with ParameterClient((LOOPBACK, node.port), timeout=CALL_TIMEOUT) as client:
        assert await client.ping() == node.node_id  # it serves
    [warning] = lines_with(node, "listens on every interface")
    assert " WARNING aioparamsync.node: " in warning
    assert f"0.0.0.0:{node.port}" in warning
    assert "--advertise HOST:PORT" in warning
    assert await stop(node) == 0
    assert_clean(node.stderr)


async def test_a_node_on_every_interface_with_advertise_gives_that_address(spawn) -> None:
    node = await spawn("--host", "0.0.0.0", "--advertise", "127.0.0.1:9", "--node-id", "n1")
    async with ParameterClient((LOOPBACK, node.port), timeout=CALL_TIMEOUT) as client:
        info = await client.info()
        assert info.node_id == "n1"
    assert await stop(node) == 0
    assert " WARNING " not in node.stderr, node.stderr
    assert "n1 (127.0.0.1:9) listening on 0.0.0.0:" in node.stderr


def test_a_loopback_address_given_to_peers_elsewhere_is_a_warning(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="aioparamsync")
    # (not started: only what it would tell its peers is checked, without a connection)
    Node(LOOPBACK, 0, peers="127.0.0.2:9001,localhost:9002")._warn_of_address(LOOPBACK, 9090)
    assert caplog.records == []
    Node(LOOPBACK, 0, peers="127.0.0.1:9001,10.1.2.3:9001")._warn_of_address(LOOPBACK, 9090)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "127.0.0.1:9090, a loopback address" in message
    assert "10.1.2.3:9001 may be on other machines" in message
    assert "127.0.0.1:9001" not in message


# -- peers that do not answer ----------------------------------------------------------


async def test_no_peer_answering_is_a_warning_once_not_at_every_retry(spawn, refusing) -> None:
    node = await spawn(
        "--log-level", "debug", "--unreachable-warning", WARN_AFTER, "--peers", text(refusing)
    )
    await node.wait_stderr(NO_ANSWER)
    [warning] = lines_with(node, NO_ANSWER)
    assert " WARNING aioparamsync.cluster.membership: " in warning
    assert f"tried {text(refusing)} (ConnectError: " in warning
    assert "Connection refused" in warning
    # The node goes on retrying (and serving), and says nothing more of it for now.
    retries_before = len([line for line in node.stderr_lines if RETRY.search(line)])

    def three_more_retries() -> None:
        retries = len([line for line in node.stderr_lines if RETRY.search(line)])
        assert retries >= retries_before + 3, f"{retries} retries"

    await eventually(three_more_retries, timeout=RETRIES_TIMEOUT)
    assert len(lines_with(node, NO_ANSWER)) == 1, node.stderr
    async with node.client() as client:
        [peer] = (await client.info()).peers
        assert (peer.address, peer.state) == (text(refusing), "backoff")
    assert await stop(node) == 0
    assert_clean(node.stderr)


async def test_unreachable_warning_0_never_warns(spawn, refusing) -> None:
    node = await spawn(
        "--log-level", "debug", "--unreachable-warning", "0", "--peers", text(refusing)
    )

    def retried() -> None:
        assert len([line for line in node.stderr_lines if RETRY.search(line)]) >= 4

    await eventually(retried, timeout=RETRIES_TIMEOUT)
    assert not lines_with(node, NO_ANSWER), node.stderr
    assert await stop(node) == 0


async def test_the_warning_names_every_peer_tried_and_a_peer_answering_is_said(
    spawn, refusing
) -> None:
    frozen = await spawn("--node-id", "b")
    frozen.signal(signal.SIGSTOP)  # it accepts connections (the kernel does) but answers nothing
    node = await spawn(
        "--unreachable-warning",
        WARN_AFTER,
        "--peers",
        f"{text(refusing)},{frozen.address_text}",
    )
    await node.wait_stderr(NO_ANSWER)
    [warning] = lines_with(node, NO_ANSWER)
    # Its id is not known yet: the address names it.
    assert f"{frozen.address_text} (no answer yet)" in warning, warning
    assert f"{text(refusing)} (ConnectError: " in warning, warning
    frozen.signal(signal.SIGCONT)
    await node.wait_stderr("answers")
    [answered] = lines_with(node, "answers")
    assert " INFO aioparamsync.cluster.membership: " in answered
    assert f"peer b ({frozen.address_text}) answers, after " in answered
    assert len(lines_with(node, NO_ANSWER)) == 1
    assert await stop(node) == 0
    assert await stop(frozen) == 0
    assert_clean(node.stderr)


# -- members named in the logs ---------------------------------------------------------


@pytest.mark.parametrize(
    ("node_id", "host", "port", "name"),
    [
        ("", "10.0.0.1", 9001, "10.0.0.1:9001"),
        ("10.0.0.1:9001", "10.0.0.1", 9001, "10.0.0.1:9001"),
        ("trainer-3", "10.0.0.1", 9001, "trainer-3 (10.0.0.1:9001)"),
        ("", "::1", 9001, "[::1]:9001"),
        ("::1:9001", "::1", 9001, "[::1]:9001"),
        ("10.0.0.1:9001", "10.0.0.2", 9001, "10.0.0.1:9001 (10.0.0.2:9001)"),
    ],
)
def test_member_name(node_id, host, port, name) -> None:
    assert member_name(node_id, host, port) == name


async def test_logs_name_members_by_id_and_address(spawn) -> None:
    a = await spawn("--node-id", "a")
    b = await spawn("--node-id", "b", "--peers", a.address_text)
    await b.wait_stderr(f"peer a ({a.address_text}): up")
    await a.wait_stderr(f"member b ({b.address_text}) added")
    assert f"node b ({b.address_text}) listening on {b.address_text}, in memory" in b.stderr
    # The seed, before it answered: its address alone.
    assert f"member {a.address_text} added" in b.stderr
    for node in (a, b):
        assert "?" not in node.stderr, node.stderr
    assert await stop(b) == 0
    assert await stop(a) == 0
