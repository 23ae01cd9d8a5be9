"""TLS on client and peer links, with certificates made by trustme."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trustme
from cluster_helpers import eventually

from aioparamsync import ConnectError, NetworkError, Node, ParameterClient
from aioparamsync.tls import client_context, server_context


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def pki(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEM files: the CA, a node's certificate for 127.0.0.1, a client's certificate."""
    root = tmp_path_factory.mktemp("pki")
    files = {"ca": root / "ca.pem", "node": root / "node.pem", "client": root / "client.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        str(files["node"])
    )
    ca.issue_cert("worker-1@example.test").private_key_and_cert_chain_pem.write_to_path(
        str(files["client"])
    )
    return files


async def test_a_tls_node_serves_a_tls_client(pki) -> None:
    async with (
        Node("127.0.0.1", 0, ssl=server_context(str(pki["node"]))) as node,
        ParameterClient(node.address, ssl=client_context(str(pki["ca"]))) as client,
    ):
        assert await client.update_arrays({"w": np.arange(3.0)}) == {"w": 1}
        assert (await client.get_arrays(["w"]))["w"].tolist() == [0.0, 1.0, 2.0]


async def test_a_tls_client_leaving_is_not_a_warning(pki, caplog) -> None:
    async with Node("127.0.0.1", 0, ssl=server_context(str(pki["node"]))) as node:
        for _ in range(3):
            async with ParameterClient(node.address, ssl=client_context(str(pki["ca"]))) as c:
                await c.ping()

        async def all_gone() -> None:
            assert not node.server.connections

        await eventually(all_gone)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert not [m for m in warned if "eof_received" in m], warned


async def test_client_certificates_are_required_when_a_ca_is_given(pki) -> None:
    context = server_context(str(pki["node"]), cafile=str(pki["ca"]))
    async with Node("127.0.0.1", 0, ssl=context) as node:
        with_cert = client_context(str(pki["ca"]), str(pki["client"]))
        async with ParameterClient(node.address, ssl=with_cert) as client:
            assert await client.ping() == node.node_id
        without = client_context(str(pki["ca"]))
        async with ParameterClient(node.address, ssl=without, timeout=10) as client:
            with pytest.raises(NetworkError):
                await client.ping()
        assert len(node.table) == 0


async def test_a_certificate_from_another_ca_is_refused(pki) -> None:
    stranger = trustme.CA()
    context = ssl.create_default_context()
    stranger.configure_trust(context)
    async with (
        Node("127.0.0.1", 0, ssl=server_context(str(pki["node"]))) as node,
        ParameterClient(node.address, ssl=context, timeout=10) as client,
    ):
        with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await client.ping()


async def test_a_plaintext_client_fails_fast_against_a_tls_node(pki) -> None:
    async with (
        Node("127.0.0.1", 0, ssl=server_context(str(pki["node"]))) as node,
        ParameterClient(node.address, timeout=10) as client,
        asyncio.timeout(5),  # a clear failure, not a hang
    ):
        with pytest.raises(NetworkError):
            await client.ping()


async def test_a_tls_client_fails_fast_against_a_plaintext_node(pki) -> None:
    async with Node("127.0.0.1", 0) as node:
        async with ParameterClient(
            node.address, ssl=client_context(str(pki["ca"])), timeout=10
        ) as client:
            async with asyncio.timeout(5):
                with pytest.raises(ConnectError):
                    await client.ping()
        assert node.server.counters["protocol_errors"] == 1


async def test_peer_links_replicate_over_mutual_tls(pki) -> None:
    served = server_context(str(pki["node"]), cafile=str(pki["ca"]))
    links = client_context(str(pki["ca"]), str(pki["node"]))
    a = Node("127.0.0.1", 0, ssl=served, peer_ssl=links, repair_interval=0.2)
    await a.start()
    b = Node(
        "127.0.0.1", 0, ssl=served, peer_ssl=links, peers=["{}:{}".format(*a.address)],
        repair_interval=0.2,
    )  # fmt: skip
    await b.start()
    try:
        worker = client_context(str(pki["ca"]), str(pki["client"]))
        replicated = asyncio.Event()
        b.store.subscribe(lambda entries, _: replicated.set())
        async with ParameterClient(a.address, ssl=worker) as client:
            await client.update_arrays({"w": np.ones(4)})
        async with asyncio.timeout(10):
            await replicated.wait()
        assert b.table.entry("w").origin == a.table.origin
    finally:
        await b.stop()
        await a.stop()


def test_the_cli_serves_tls_and_refuses_bad_tls_flags(pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.pem"
    result = subprocess.run(
        [sys.executable, "-m", "aioparamsync", "--port", "0", "--tls-cert", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "TLS" in result.stderr and "Traceback" not in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "aioparamsync", "--port", "0", "--tls-ca", str(pki["ca"])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "--tls-cert" in result.stderr


async def test_the_cli_node_speaks_tls(pki) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aioparamsync", "--port", "0", "--log-level", "warning",
        "--tls-cert", str(pki["node"]), "--tls-ca", str(pki["ca"]),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()
        host, port = line.rsplit(" ", 1)[1].strip().rsplit(":", 1)
        context = client_context(str(pki["ca"]), str(pki["client"]))
        async with ParameterClient((host, int(port)), ssl=context) as client:
            assert await client.update_arrays({"w": [1.0]}) == {"w": 1}
    finally:
        proc.terminate()
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
