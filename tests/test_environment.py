"""A client configured by environment (``ParameterClient.from_env``), against real nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from aioparamsync import Node, ParameterClient
from aioparamsync.client.environment import client_options
from aioparamsync.tls import server_context

pytestmark = pytest.mark.timeout(60)


def text(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ca = trustme.CA()
    root = tmp_path_factory.mktemp("pki")
    files = {name: root / f"{name}.pem" for name in ("ca", "node", "worker")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(files["node"]))
    ca.issue_cert("worker").private_key_and_cert_chain_pem.write_to_path(str(files["worker"]))
    return files


async def test_from_env_reaches_the_nodes_named_in_aioparamsync_addresses() -> None:
    async with Node("127.0.0.1", 0) as node:
        # (the first is down: any one live node will do)
        environ = {"AIOPARAMSYNC_ADDRESSES": f"127.0.0.1:9, {text(node.address)}"}
        async with ParameterClient.from_env(environ, timeout=5) as client:
            assert await client.ping() == node.node_id
            assert client.timeout == 5  # (the constructor's arguments go on)


async def test_from_env_falls_back_to_the_nodes_dns_name() -> None:
    async with Node("127.0.0.1", 0) as node:
        environ = {"AIOPARAMSYNC_PEERS_DNS": f"localhost:{node.port}"}
        async with ParameterClient.from_env(environ) as client:
            assert await client.ping() == node.node_id


async def test_from_env_reads_os_environ_by_default(monkeypatch) -> None:
    async with Node("127.0.0.1", 0) as node:
        monkeypatch.setenv("AIOPARAMSYNC_ADDRESSES", text(node.address))
        async with ParameterClient.from_env() as client:
            assert await client.ping() == node.node_id


async def test_from_env_with_tls_files_reaches_a_node_that_verifies_its_clients(pki) -> None:
    verifying = server_context(str(pki["node"]), cafile=str(pki["ca"]))
    async with Node("127.0.0.1", 0, ssl=verifying) as node:
        environ = {
            "AIOPARAMSYNC_ADDRESSES": text(node.address),
            "AIOPARAMSYNC_TLS_CA": str(pki["ca"]),
            "AIOPARAMSYNC_TLS_CERT": str(pki["worker"]),
        }
        async with ParameterClient.from_env(environ) as client:
            assert await client.ping() == node.node_id


def test_tls_is_on_when_a_file_or_the_switch_says_so(pki) -> None:
    base = {"AIOPARAMSYNC_ADDRESSES": "127.0.0.1:9090"}
    assert client_options(base)["ssl"] is None
    assert client_options({**base, "AIOPARAMSYNC_TLS": "0"})["ssl"] is None
    assert client_options({**base, "AIOPARAMSYNC_TLS": "yes"})["ssl"] is not None
    with_ca = client_options({**base, "AIOPARAMSYNC_TLS_CA": str(pki["ca"])})
    assert with_ca["ssl"] is not None and with_ca["address"] == [("127.0.0.1", 9090)]


def test_shared_memory_is_a_size_as_the_nodes_flags_take_them(tmp_path) -> None:
    base = {"AIOPARAMSYNC_ADDRESSES": f"unix:{tmp_path / 'n.sock'}"}
    assert "shared_memory" not in client_options(base)  # (the client's default)
    for size, expected in (("0", 0), ("256m", 256 << 20), ("1GiB", 1 << 30), ("4096", 4096)):
        assert client_options({**base, "AIOPARAMSYNC_SHARED_MEMORY": size})["shared_memory"] == (
            expected
        )
    assert ParameterClient.from_env({**base, "AIOPARAMSYNC_SHARED_MEMORY": "0"})._lane is None
    lane = ParameterClient.from_env({**base, "AIOPARAMSYNC_SHARED_MEMORY": "64m"})._lane
    assert lane is not None and lane.limit == 64 << 20


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "set AIOPARAMSYNC_ADDRESSES"),
        ({"AIOPARAMSYNC_ADDRESSES": " , "}, "AIOPARAMSYNC_ADDRESSES=',': no address given"),
        ({"AIOPARAMSYNC_ADDRESSES": "nohost"}, "AIOPARAMSYNC_ADDRESSES='nohost': "),
        ({"AIOPARAMSYNC_ADDRESSES": "h:99999"}, "out of range"),
        ({"AIOPARAMSYNC_PEERS_DNS": "ps.default.svc"}, "AIOPARAMSYNC_PEERS_DNS="),
        (
            {"AIOPARAMSYNC_ADDRESSES": "h:1", "AIOPARAMSYNC_TLS": "maybe"},
            "AIOPARAMSYNC_TLS='maybe': a switch is one of",
        ),
        (
            {"AIOPARAMSYNC_ADDRESSES": "h:1", "AIOPARAMSYNC_TLS_CA": "/nonexistent/ca.pem"},
            "AIOPARAMSYNC_TLS_CA='/nonexistent/ca.pem': no such file",
        ),
        (
            {"AIOPARAMSYNC_ADDRESSES": "h:1", "AIOPARAMSYNC_TLS_KEY": "/k.pem"},
            "AIOPARAMSYNC_TLS_KEY needs AIOPARAMSYNC_TLS_CERT",
        ),
        *(
            (
                {"AIOPARAMSYNC_ADDRESSES": "unix:/n.sock", "AIOPARAMSYNC_SHARED_MEMORY": size},
                f"AIOPARAMSYNC_SHARED_MEMORY={size!r} is not a size",
            )
            for size in ("", "-1", "1.5G", "lots", "1T")
        ),
    ],
)
def test_a_bad_environment_is_refused_naming_its_variable(environ, expected) -> None:
    with pytest.raises(ValueError) as info:
        ParameterClient.from_env(environ)
    assert expected in str(info.value)


def test_a_tls_file_that_is_no_certificate_is_refused_naming_it(tmp_path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    environ = {"AIOPARAMSYNC_ADDRESSES": "h:1", "AIOPARAMSYNC_TLS_CA": str(junk)}
    with pytest.raises(ValueError) as info:
        ParameterClient.from_env(environ)
    assert str(info.value).startswith(f"TLS from the environment (AIOPARAMSYNC_TLS_CA='{junk}')")
