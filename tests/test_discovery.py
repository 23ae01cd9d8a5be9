"""Members found by DNS (``--peers-dns``): a resolver seam for names that come and go, and
the system's resolver for ``localhost``; every address is on loopback."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys

import pytest
from cluster_helpers import ProcessCluster, assert_, eventually

from aioparamsync import Node, ParameterClient
from aioparamsync.cluster.discovery import DnsDiscovery, resolve_all

pytestmark = pytest.mark.timeout(60)

SETTLE = 15.0


class Names:
    """A resolver whose answers the test changes (what a headless Service does as pods
    come and go); a name it does not hold does not resolve."""

    def __init__(self) -> None:
        self.records: dict[str, list[tuple[str, int]]] = {}
        self.asked = 0

    async def __call__(self, name: str, port: int) -> list[tuple[str, int]]:
        self.asked += 1
        if name not in self.records:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.records[name])


def peer_ids(node: Node) -> set[str]:
    return {link.node_id for link in node.cluster.links.values() if link.state == "up"}


async def test_a_node_joins_the_members_the_name_resolves_to_and_those_that_come_later() -> None:
    names = Names()
    async with Node("127.0.0.1", 0, node_id="a") as a, Node("127.0.0.1", 0, node_id="b") as b:
        names.records["ps.test"] = [a.address]
        async with Node(
            "127.0.0.1",
            0,
            node_id="c",
            peers_dns=("ps.test", 1),
            peers_dns_interval=0.1,
            resolve=names,
        ) as c:
            await eventually(lambda: assert_equal(peer_ids(c), {"a"}), timeout=SETTLE)
            await eventually(lambda: assert_equal(c.cluster.state, "up"), timeout=SETTLE)
            # b appears under the name (a pod scheduled): c adds it; c's own address is
            # among the name's too, as in a Service, and is no member.
            names.records["ps.test"] = [a.address, b.address, c.address]
            await eventually(lambda: assert_equal(peer_ids(c), {"a", "b"}), timeout=SETTLE)
            assert c.discovery is not None and c.discovery.addresses == sorted(
                [a.address, b.address, c.address]
            )
            # a leaves the name (its pod is gone): nothing is dropped for that; the
            # failure timeout decides, as for any member that stops answering.
            names.records["ps.test"] = [b.address]
            asked = names.asked
            await eventually(lambda: assert_(names.asked > asked + 1), timeout=SETTLE)
            assert peer_ids(c) == {"a", "b"}


async def test_a_name_that_does_not_resolve_yet_is_tried_again(caplog) -> None:
    names = Names()
    caplog.set_level(logging.INFO, logger="aioparamsync.cluster.discovery")
    async with (
        Node("127.0.0.1", 0, node_id="a") as a,
        Node(
            "127.0.0.1",
            0,
            node_id="c",
            peers_dns=("ps.later", 1),
            peers_dns_interval=0.1,
            resolve=names,
        ) as c,
    ):
        # (the Service is not there yet: the node starts alone, and says why)
        assert c.cluster.state == "up" and not c.cluster.links
        assert "ps.later:1 does not resolve" in caplog.text
        names.records["ps.later"] = [a.address]
        await eventually(lambda: assert_equal(peer_ids(c), {"a"}), timeout=SETTLE)
        assert c.discovery is not None and c.discovery.failures >= 1
        assert f"ps.later:1 resolves to {a.host}:{a.port}" in caplog.text
        async with ParameterClient(c.address) as client:
            await client.update_arrays({"w": [1.0, 2.0]})
        await eventually(lambda: assert_("w" in a.table), timeout=SETTLE)


async def test_the_systems_resolver_answers_every_address_of_a_name() -> None:
    found = await resolve_all("localhost", 9090)
    assert ("127.0.0.1", 9090) in found
    assert all(port == 9090 for _, port in found)
    with pytest.raises(OSError):
        await resolve_all("no-such-name.invalid", 9090)


def test_discovery_refuses_an_interval_that_is_no_period() -> None:
    for interval in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="interval"):
            DnsDiscovery(None, "ps", 1, interval=interval)  # type: ignore[arg-type]


async def test_a_node_process_with_peers_dns_localhost_joins_the_node_there() -> None:
    procs = ProcessCluster()
    try:
        a = await procs.spawn()
        c = await procs.spawn(
            extra=["--peers-dns", f"localhost:{a.port}", "--peers-dns-interval", "0.5"]
        )
        async with ParameterClient(a.address, timeout=10, route=False) as client:

            async def joined() -> None:
                info = await client.info()
                assert [(p.node_id, p.state) for p in info.peers or []] == [(c.node_id, "up")]

            await eventually(joined, timeout=SETTLE)
    finally:
        await procs.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--peers-dns", "ps.default.svc"], "--peers-dns"),
        (["--peers-dns", "ps:0"], "--peers-dns"),
        (["--peers-dns", "ps:9090", "--peers-dns-interval", "0"], "--peers-dns-interval"),
        (["--host", "0.0.0.0", "--peers-dns", "ps:9090"], "with --peers-dns, pass --advertise"),
    ],
)
def test_bad_dns_flags_exit_2_naming_them(args, message) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aioparamsync", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_bad_dns_flag_from_the_environment_names_its_variable() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aioparamsync"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"AIOPARAMSYNC_PEERS_DNS": "ps", "PATH": ""},
    )
    assert result.returncode == 2 and "AIOPARAMSYNC_PEERS_DNS='ps'" in result.stderr


def assert_equal(got: object, expected: object) -> None:
    assert got == expected, got


async def test_stopping_a_node_stops_its_discovery() -> None:
    names = Names()
    names.records["ps"] = []
    node = Node("127.0.0.1", 0, peers_dns=("ps", 1), peers_dns_interval=0.05, resolve=names)
    await node.start()
    await node.stop()
    asked = names.asked
    await asyncio.sleep(0.2)
    assert names.asked == asked
