"""Prometheus metrics: ``Node(metrics_port=...)`` and ``aioparamsync-node --metrics-port``.

Every node listens on 127.0.0.1 with ports from port 0; each scrape is a real
HTTP GET (urllib, in a thread) parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from cluster_helpers import LOOPBACK, LocalCluster, ProcessCluster, eventually
from prometheus_client.parser import text_string_to_metric_families

from aioparamsync import (
    ErrorCode,
    Node,
    ParameterClient,
    ParameterRequest,
    RequestError,
    __version__,
    has_extension,
    sgd,
    sum_rule,
    to_parameter,
)
from aioparamsync import metrics as metrics_module
from aioparamsync.metrics import LATENCY_BUCKETS, CallStats, MetricsBindError
from aioparamsync.wire.framing import LARGE_FRAME_BYTES

pytestmark = pytest.mark.timeout(60)

METRICS_LINE = re.compile(r"metrics on http://(?P<host>[^\s/]+):(?P<port>\d+)/metrics")

# (sample name, sorted label items) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Which per-call path the node runs, as its info metric says.
FAST_PATH = "compiled" if has_extension() else "pure"


def _get(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


async def scrape(address: tuple[str, int]) -> Samples:
    """GET /metrics; answer every sample."""
    content_type, text = await asyncio.to_thread(_get, f"http://{address[0]}:{address[1]}/metrics")
    assert content_type.startswith("text/plain"), content_type
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (f"aioparamsync_{name}", tuple(sorted(labels.items())))
    assert key in samples, f"no {key} in {sorted(k for k in samples if name in k[0])}"
    return samples[key]


def free_listener() -> socket.socket:
    """A socket listening on 127.0.0.1 and a port of its own (the caller closes it)."""
    s = socket.socket()
    s.bind((LOOPBACK, 0))
    s.listen()
    return s


async def protocol_error(address: tuple[str, int]) -> None:
    """Send bytes that are no Thrift message; read until the node closes the connection."""
    reader, writer = await asyncio.open_connection(*address)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    async with asyncio.timeout(10):
        while await reader.read(65536):
            pass
    writer.close()
    await writer.wait_closed()


@pytest.fixture
async def cluster() -> AsyncIterator[LocalCluster]:
    c = LocalCluster()
    try:
        yield c
    finally:
        await c.close()


async def test_a_scrape_shows_calls_errors_bytes_and_the_store(cluster: LocalCluster) -> None:
    node = await cluster.start(metrics_port=0)
    assert node.metrics_address is not None
    host, port = node.metrics_address
    assert host == LOOPBACK and port not in (0, node.port)

    # (route=False: the messages counted are these alone, no topology asked for;
    # shared_memory=0: no info and ping asking for the node's Unix socket)
    async with ParameterClient(node.address, timeout=15, route=False, shared_memory=0) as client:
        await client.update_arrays({"w": np.zeros((3, 4), np.float32)})  # push_parameters
        await client.update_arrays({"b": np.ones(5, np.float64)})
        await client.get_arrays(["w", "b"])  # pull_parameters
        await client.call("get_parameters", request=ParameterRequest(param_names=["w"]))
        bad = to_parameter("w", np.zeros(3, np.float32))
        bad.shape = [4]
        with pytest.raises(RequestError) as refused:
            await client.update_parameters([bad])
        assert refused.value.code == ErrorCode.SHAPE_MISMATCH
        await protocol_error(node.address)

        async def garbage_connection_gone() -> Samples:
            samples = await scrape(node.metrics_address)  # type: ignore[arg-type]
            assert value(samples, "open_connections") == 1  # the client's
            return samples

        samples = await eventually(garbage_connection_gone)

        assert value(samples, "requests_total", method="push_parameters") == 3
        assert value(samples, "requests_total", method="pull_parameters") == 1
        assert value(samples, "requests_total", method="get_parameters") == 1
        assert value(samples, "requests_total", method="ping") == 0  # every method, from 0
        hist = "request_duration_seconds"
        assert value(samples, f"{hist}_count", method="push_parameters") == 3
        assert value(samples, f"{hist}_bucket", method="push_parameters", le="+Inf") == 3
        assert value(samples, f"{hist}_sum", method="push_parameters") > 0
        buckets = [
            value(samples, f"{hist}_bucket", method="push_parameters", le=str(b))
            for b in LATENCY_BUCKETS
        ]
        assert buckets == sorted(buckets)  # cumulative
        assert (
            value(samples, "request_errors_total", method="push_parameters", code="SHAPE_MISMATCH")
            == 1
        )
        assert value(samples, "errors_total") == 1
        assert value(samples, "protocol_errors_total") == 1
        assert value(samples, "request_timeouts_total") == 0
        # The 5 calls; the garbage was no message (not even a frame): a protocol error.
        assert value(samples, "messages_received_total") == 5
        assert value(samples, "connections_opened_total") == 2

        server = node.server.counters
        assert value(samples, "received_bytes_total") == server["bytes_in"] > 0
        # The scrape came after the last reply; the protocol error's reply is not counted.
        assert value(samples, "sent_bytes_total") == server["bytes_out"] > 0

        assert value(samples, "receiving_bytes") == 0
        assert value(samples, "messages_waiting_to_receive") == 0
        assert value(samples, "receive_waits_total") == 0
        assert value(samples, "receive_budget_overruns_total") == 0

        assert value(samples, "parameters") == 2
        assert value(samples, "parameter_bytes") == 3 * 4 * 4 + 5 * 8
        assert value(samples, "pending_updates") == 0
        assert value(samples, "updates_applied_total") == 2
        assert value(samples, "batches_total") >= 1
        assert (
            value(
                samples, "node_info", node_id=node.node_id, version=__version__, fast_path=FAST_PATH
            )
            == 1
        )
        assert any(name == "process_cpu_seconds_total" for name, _ in samples)
        assert not any(name.startswith("aioparamsync_peer") for name, _ in samples)


async def test_a_scrape_shows_waits_and_gradient_pushes(cluster: LocalCluster) -> None:
    node = await cluster.start(metrics_port=0)
    async with ParameterClient(node.address, timeout=15) as client:
        await client.update_arrays({"w": np.zeros(2)}, rules=sum_rule())
        await client.push_gradients({"w": np.ones(2)}, request_id="once")
        await client.push_gradients({"w": np.ones(2)}, request_id="once")
        await client.push_gradients({"w": np.ones(2)}, encoding="int8")
        with pytest.raises(RequestError):
            await client.get_parameters(["w"], min_version=9, wait=0.05)
        held = [
            asyncio.ensure_future(client.get_parameters(["w"], min_version=9, wait=30)),
            asyncio.ensure_future(client.barrier("g", "a", 1, 2, timeout=30)),
        ]
        try:

            async def holding() -> Samples:
                samples = await scrape(node.metrics_address)  # type: ignore[arg-type]
                assert value(samples, "long_polls_waiting") == 1
                assert value(samples, "barrier_waiters") == 1
                return samples

            samples = await eventually(holding)
            assert value(samples, "barrier_groups") == 1
            assert value(samples, "wait_timeouts_total") == 1
            assert value(samples, "gradient_pushes_repeated_total") == 1
            assert value(samples, "gradient_pushes_forwarded_total") == 0
            assert value(samples, "gradient_forward_failures_total") == 0
            assert value(samples, "gradient_pushes_in_doubt_total") == 0
            assert value(samples, "row_pushes_in_doubt_total") == 0
            assert value(samples, "requests_total", method="push_gradients") == 3
            # Each gradient as it came (the one sent again counts again).
            assert value(samples, "gradients_received_total", encoding="none") == 2
            assert value(samples, "gradients_received_total", encoding="int8") == 1
        finally:
            for call in held:
                call.cancel()
            await asyncio.gather(*held, return_exceptions=True)


async def test_a_scrape_shows_the_embedding_tables(cluster: LocalCluster) -> None:
    node = await cluster.start(metrics_port=0)
    async with ParameterClient(node.address, timeout=15) as client:
        await client.create_table("emb", 8, rule=sgd(0.1), buckets=1)
        samples = await scrape(node.metrics_address)  # type: ignore[arg-type]
        assert value(samples, "tables") == 1 and value(samples, "table_rows") == 0
        ids = np.arange(100, dtype=np.int64)
        await client.push_row_gradients("emb", ids, np.ones((100, 8), np.float32))
        samples = await scrape(node.metrics_address)  # type: ignore[arg-type]
        assert value(samples, "table_rows") == 100
        assert 100 * 8 * 4 <= value(samples, "table_bytes") < 100 * 8 * 4 * 10


async def test_a_follower_scrape_shows_its_lag(cluster: LocalCluster) -> None:
    leader = await cluster.start(metrics_port=0)
    follower = await cluster.start(follow=[leader.address], metrics_port=0)
    async with ParameterClient(leader.address, timeout=15) as client:
        samples = await scrape(follower.metrics_address)  # type: ignore[arg-type]
        assert value(samples, "follow_keys_pulled_total") == 0
        await client.update_arrays({"w": np.zeros(4, np.float32)})

        async def pulled() -> None:
            samples = await scrape(follower.metrics_address)  # type: ignore[arg-type]
            assert value(samples, "follow_keys_pulled_total") == 1
            assert value(samples, "follow_versions_behind") == 0
            assert value(samples, "follow_lag_seconds") == 0

        await eventually(pulled)
    samples = await scrape(leader.metrics_address)  # type: ignore[arg-type]
    assert not any("follow" in name for name, _ in samples)  # (a node that follows none)


async def test_a_scrape_shows_the_receive_budget(cluster: LocalCluster) -> None:
    mib = 1024 * 1024
    node = await cluster.start(metrics_port=0, max_receiving_bytes=mib)
    assert node.metrics_address is not None
    # The start of a 1 MiB message, then nothing: it holds the whole budget.
    held = socket.create_connection(node.address)
    try:
        held.sendall(struct.pack("!i", mib) + b"\x80" + bytes(300 * 1024))

        async def holding() -> None:
            samples = await scrape(node.metrics_address)  # type: ignore[arg-type]
            assert value(samples, "receiving_bytes") == mib - LARGE_FRAME_BYTES

        await eventually(holding)
        async with ParameterClient(node.address, timeout=15) as client:
            # It waits behind the stalled one, then is let in beyond the budget.
            await client.update_arrays({"w": np.zeros(mib, np.uint8)})
        samples = await scrape(node.metrics_address)
        assert value(samples, "receive_waits_total") == 1
        assert value(samples, "receive_budget_overruns_total") == 1
        assert value(samples, "messages_waiting_to_receive") == 0
    finally:
        held.close()


async def test_two_nodes_show_their_peer_links(cluster: LocalCluster) -> None:
    a = await cluster.start(metrics_port=0)
    b = await cluster.start(peers=[a], metrics_port=0)
    await cluster.formed([a, b])
    assert a.metrics_address != b.metrics_address  # one registry and endpoint each
    async with ParameterClient(a.address, timeout=15, route=False) as client:  # (at a)
        for i in range(3):
            await client.update_arrays({"w": np.full(4, i, np.float32)})
    await cluster.converged([a, b])
    b_address = f"{b.host}:{b.port}"

    async def sent_all() -> Samples:
        samples = await scrape(a.metrics_address)  # type: ignore[arg-type]
        sent = value(samples, "peer_updates_sent_total", peer=b_address)
        coalesced = value(samples, "peer_updates_coalesced_total", peer=b_address)
        assert sent + coalesced == 3, (sent, coalesced)
        return samples

    samples = await eventually(sent_all)
    assert value(samples, "peer_outbox_depth", peer=b_address) == 0
    assert value(samples, "peer_lag_seconds", peer=b_address) == 0
    assert value(samples, "peer_send_failures_total", peer=b_address) == 0
    assert value(samples, "peer_state", peer=b_address, state="up") == 1
    assert value(samples, "peer_state", peer=b_address, state="backoff") == 0
    assert value(samples, "peer_info", peer=b_address, node_id=b.node_id) == 1
    assert "peer_repaired_total" in {n.removeprefix("aioparamsync_") for n, _ in samples}

    # B replicated what A sent: its store shows it, and it counted A's broadcasts.
    samples_b = await scrape(b.metrics_address)  # type: ignore[arg-type]
    assert value(samples_b, "parameters") == 1
    assert value(samples_b, "requests_total", method="broadcast_update") >= 1
    a_address = f"{a.host}:{a.port}"
    assert value(samples_b, "peer_state", peer=a_address, state="up") == 1

    # The topology as each sees it: its epoch, R (0: every node), each member's state.
    assert value(samples_b, "cluster_epoch") == b.cluster.epoch
    assert value(samples_b, "replication_factor") == 0  # (LocalCluster: R=all)
    for member in (a, b):
        assert value(samples_b, "member_state", member=member.node_id, state="up") == 1
        assert value(samples_b, "member_state", member=member.node_id, state="joining") == 0
    assert value(samples_b, "keys_moving") == value(samples_b, "under_replicated_keys") == 0
    assert value(samples_b, "keys_handed_off_total") == 0


async def test_stop_releases_the_port_and_metrics_off_costs_no_hook(
    cluster: LocalCluster,
) -> None:
    plain = await cluster.start()
    assert plain.metrics_address is None and plain.metrics is None
    assert plain.server.call_observer is None

    node = await cluster.start(metrics_port=0)
    address = node.metrics_address
    assert address is not None
    await scrape(address)
    await cluster.stop(node)
    assert node.metrics_address is None
    with socket.socket() as s:  # free again at once (for a server, as it reuses addresses)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(address)
        s.listen()
    with pytest.raises(OSError):
        await scrape(address)


async def test_a_metrics_port_in_use_fails_the_start_cleanly(tmp_path) -> None:
    with free_listener() as busy:
        port = busy.getsockname()[1]
        node = Node(LOOPBACK, 0, metrics_port=port, data_dir=tmp_path)
        with pytest.raises(MetricsBindError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}"):
            await node.start()
        assert isinstance(MetricsBindError(), OSError)
        assert node.metrics is None and node._writer is None
        with pytest.raises(AssertionError):
            _ = node.address  # it never listened
    # It let go of its data directory: another node may have it.
    async with Node(LOOPBACK, 0, data_dir=tmp_path) as again:
        assert again.address


async def test_metrics_without_prometheus_client_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    node = Node(LOOPBACK, 0, metrics_port=0)
    with pytest.raises(ImportError, match=r"pip install '\.\[metrics\]'"):
        await node.start()


def test_call_stats_buckets_and_error_kinds() -> None:
    stats = CallStats(buckets=(0.001, 0.01))
    stats.observe("ping", 0.0005, None)
    stats.observe("ping", 0.001, None)  # on a bound: le="0.001"
    stats.observe("ping", 0.5, None)
    stats.observe("push_parameters", 0.002, RequestError(ErrorCode.LIMIT_EXCEEDED, "too big"))
    stats.observe("push_parameters", 0.002, RequestError(99, "a newer node's code"))
    stats.observe("info", 0.002, RuntimeError("boom"))
    stats.observe("info", 0.002, asyncio.CancelledError())
    methods, request_errors, internal_errors = stats.snapshot()
    by_name = {name: (counts, seconds) for name, counts, seconds in methods}
    assert by_name["ping"][0] == [2, 0, 1]
    assert by_name["ping"][1] == pytest.approx(0.5015)
    assert by_name["digest"] == ([0, 0, 0], 0.0)  # every method of the IDL
    assert request_errors == {
        ("push_parameters", "LIMIT_EXCEEDED"): 1,
        ("push_parameters", "99"): 1,
    }
    assert internal_errors == {"info": 2}


def test_importing_the_package_does_not_import_prometheus_client() -> None:
    check = "import aioparamsync, sys; assert 'prometheus_client' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)
    check = (
        "import aioparamsync.cli, aioparamsync.metrics, sys;"
        " assert 'prometheus_client' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


# -- the CLI, as a process -----------------------------------------------------------------


@pytest.fixture
async def processes() -> AsyncIterator[ProcessCluster]:
    c = ProcessCluster()
    try:
        yield c
    finally:
        await c.close()


async def test_the_cli_serves_metrics(processes: ProcessCluster) -> None:
    node = await processes.spawn(extra=["--metrics-port", "0"])
    # The listening line is unchanged (the spawn parsed it); the endpoint is logged.
    assert len(node.stdout_lines) == 1

    def logged() -> tuple[str, int]:
        match = METRICS_LINE.search(node.stderr)
        assert match, node.stderr
        return match["host"], int(match["port"])

    address: Any = await eventually(logged)
    assert address[0] == LOOPBACK and address[1] != node.port
    async with node.client() as client:
        await client.update_arrays({"w": np.ones(8, np.float32)})
        await client.ping()
    samples = await scrape(address)
    assert value(samples, "requests_total", method="push_parameters") == 1
    assert value(samples, "requests_total", method="ping") == 1
    assert value(samples, "parameters") == 1
    assert value(samples, "parameter_bytes") == 32
    assert (
        value(samples, "node_info", node_id=node.node_id, version=__version__, fast_path=FAST_PATH)
        == 1
    )
    node.signal(signal.SIGTERM)
    async with asyncio.timeout(15):
        assert await node.proc.wait() == 0


def test_the_cli_with_a_metrics_port_in_use_exits_1() -> None:
    with free_listener() as busy:
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "aioparamsync", "--port", "0", "--metrics-port", str(port)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1, result
    assert result.stdout == ""  # it never said it listens
    assert f"aioparamsync-node: cannot serve metrics on 127.0.0.1:{port}:" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_cli_without_prometheus_client_exits_1() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None;"
        "from aioparamsync.cli.node import main;"
        "sys.exit(main(['--port', '0', '--metrics-port', '0']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result
    assert result.stdout == ""
    assert "--metrics-port: metrics need the prometheus-client package" in result.stderr
    assert "Traceback" not in result.stderr


# -- the probes: /healthz and /readyz ---------------------------------------------------------


def _probe(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def probe(node: Node, path: str) -> tuple[int, str]:
    host, port = node.metrics_address or ("", 0)
    return await asyncio.to_thread(_probe, f"http://{host}:{port}{path}")


async def test_healthz_says_alive_while_the_loop_runs_and_not_when_it_is_stuck(
    monkeypatch,
) -> None:
    monkeypatch.setattr(metrics_module, "HEALTH_WAIT", 0.5)
    async with Node("127.0.0.1", 0, metrics_port=0) as node:
        assert await probe(node, "/healthz") == (200, "alive\n")
        assert node.metrics is not None
        # The loop stuck (a blocking call on it): the probe, from its thread, says so.
        loop = asyncio.get_running_loop()
        answer = loop.run_in_executor(None, _probe, probe_url(node, "/healthz"))
        time.sleep(1.5)  # noqa: ASYNC251 (blocks the loop on purpose)
        status, text = await answer
        assert status == 503 and "did not answer" in text, (status, text)
        assert await probe(node, "/healthz") == (200, "alive\n")


def probe_url(node: Node, path: str) -> str:
    host, port = node.metrics_address or ("", 0)
    return f"http://{host}:{port}{path}"


async def test_readyz_follows_joining_taking_over_leaving_and_shutting_down() -> None:
    async with Node("127.0.0.1", 0, node_id="a") as a:
        b = Node("127.0.0.1", 0, node_id="b", peers=[a.address], metrics_port=0)
        await b.start()
        try:
            # (b joins: not ready until it has pulled what it holds and taken it over)
            status, text = await probe(b, "/readyz")
            if status == 503:
                assert text.startswith(("joining", "taking over")), text

            async def ready() -> None:
                assert await probe(b, "/readyz") == (200, f"up at epoch {b.cluster.epoch}\n")

            await eventually(ready, timeout=15)
            await b.leave(timeout=5)
            assert await probe(b, "/readyz") == (503, "left\n")
            assert (await probe(b, "/healthz"))[0] == 200  # (alive all the same)
        finally:
            await b.stop()


async def test_readyz_is_503_once_a_node_is_told_to_shut_down() -> None:
    async with Node("127.0.0.1", 0, metrics_port=0) as node:
        assert (await probe(node, "/readyz"))[0] == 200
        await node.shutdown()
        assert await probe(node, "/readyz") == (503, "shutting down\n")
        # every other path is still the metrics
        content_type, _ = await asyncio.to_thread(_get, probe_url(node, "/metrics"))
        assert content_type.startswith("text/plain")
