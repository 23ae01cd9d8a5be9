"""``aioparamsync-ctl``: each command against a real node, and what goes wrong.

Most tests run ``main(argv)`` in a thread (it runs its own event loop, as from
a shell) against a node in this process, and read what it printed with capsys;
a few run the console script and ``python -m aioparamsync.ctl`` as processes.
Everything listens on 127.0.0.1 and a port the kernel picks; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import trustme
from cluster_helpers import ProcessCluster, assert_, eventually, run_process

from aioparamsync import (
    ErrorCode,
    Node,
    ParameterClient,
    RequestError,
    __version__,
    has_extension,
    thrift,
)
from aioparamsync.cli.ctl import main
from aioparamsync.store.table import Limits
from aioparamsync.tls import server_context

pytestmark = pytest.mark.timeout(60)

# Bound of a ctl run, and of a process's (it imports numpy and thriftpy2 first).
RUN_TIMEOUT = 30.0
# Bound of the wait for a cluster to form.
SETTLE_TIMEOUT = 15.0
COMMANDS = ["stats", "peers", "ping", "get", "list"]


def text(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def argv_of(command: str, address: str) -> list[str]:
    return [command, address, *(["w"] if command == "get" else [])]


async def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``aioparamsync-ctl *argv`` as a shell would; answer (exit code, stdout, stderr)."""
    capsys.readouterr()  # what the test printed before does not count
    async with asyncio.timeout(RUN_TIMEOUT):
        rc = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, out: str, err: str, *expected: str) -> None:
    assert rc == 1, (out, err)
    assert out == ""
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("aioparamsync-ctl: "), err
    for part in expected:
        assert part in err, err


def unused_port() -> int:
    """A port nothing listens on (it was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- ping ------------------------------------------------------------------------------------


async def test_ping_answers_the_node_id_and_a_round_trip(node: Node, capsys) -> None:
    rc, out, err = await ctl(capsys, "ping", text(node.address))
    assert (rc, err) == (0, "")
    assert re.fullmatch(
        rf"{re.escape(text(node.address))}: {re.escape(node.node_id)} answered in "
        r"\d+\.\d\d ms\n",
        out,
    ), out

    rc, out, err = await ctl(capsys, "--json", "ping", text(node.address))
    assert (rc, err) == (0, "")
    document = json.loads(out)
    assert document["address"] == text(node.address)
    assert document["node_id"] == node.node_id
    assert 0 <= document["rtt_ms"] < RUN_TIMEOUT * 1000


async def test_options_may_come_after_the_command(node: Node, capsys) -> None:
    rc, out, err = await ctl(capsys, "ping", text(node.address), "--json", "--timeout", "9")
    assert (rc, err) == (0, "")
    assert json.loads(out)["node_id"] == node.node_id


# -- stats -----------------------------------------------------------------------------------


async def test_stats_shows_the_node_and_its_counters(node: Node, client, capsys) -> None:
    await client.update_arrays({"w": np.zeros((4, 8), np.float32), "b": np.zeros(8)})
    rc, out, err = await ctl(capsys, "stats", text(node.address))
    assert (rc, err) == (0, "")
    head, counters_text = out.split("\ncounters\n")
    fields = dict(line.split(None, 1) for line in head.splitlines())
    assert fields["node"] == node.node_id
    assert fields["version"] == __version__
    assert fields["parameters"] == f"2 ({32 * 4 + 8 * 8} B)"
    assert re.fullmatch(
        r"\d{13} \(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC\)", fields["timestamp"]
    )
    assert re.fullmatch(r"\d+\.\d s", fields["uptime"]), fields["uptime"]
    assert fields["peers"] == "0 (0 up)"
    counters = dict(line.split() for line in counters_text.splitlines())
    assert int(counters["updates_applied"]) == 1
    assert int(counters["requests"]) >= 1


async def test_stats_as_json(node: Node, client, capsys) -> None:
    await client.update_arrays({"w": np.arange(10.0)}, timestamp=1234)
    rc, out, err = await ctl(capsys, "--json", "stats", text(node.address))
    assert (rc, err) == (0, "")
    info = json.loads(out)
    assert set(info) == {
        "node_id", "version", "parameter_count", "partition_count", "key_count",
        "parameter_bytes", "timestamp", "uptime_seconds", "counters", "peers", "fast_path",
    }  # fmt: skip
    assert (info["node_id"], info["version"]) == (node.node_id, __version__)
    assert info["fast_path"] == ("compiled" if has_extension() else "pure")
    assert (info["parameter_count"], info["parameter_bytes"]) == (1, 80)
    assert info["timestamp"] == 1234
    assert info["uptime_seconds"] >= 0
    assert info["counters"]["updates_applied"] == 1
    assert info["peers"] == []


async def test_stats_counts_parameters_as_list_does_and_partitions_apart(capsys) -> None:
    # (12 small parameters, 2 cut into 8 and 5 partitions of 256 elements: 1 KiB of float32)
    arrays = {f"small{i}": np.zeros(4, np.float32) for i in range(12)}
    arrays |= {"big": np.zeros(8 * 256, np.float32), "bytes": np.zeros(5 * 256, np.uint8)}
    async with Node("127.0.0.1", 0, partition_bytes=1024) as node:
        async with ParameterClient(node.address) as client:
            await client.update_arrays(arrays)
        rc, out, _ = await ctl(capsys, "list", text(node.address))
        assert rc == 0 and out.splitlines()[-1].startswith("14 parameters, ")
        rc, out, _ = await ctl(capsys, "stats", text(node.address))
        fields = dict(line.split(None, 1) for line in out.split("\ncounters\n")[0].splitlines())
        assert rc == 0 and fields["parameters"].startswith("14 ("), out
        assert fields["partitions"] == "13 (of the large ones)", out
        rc, out, _ = await ctl(capsys, "--json", "stats", text(node.address))
        info = json.loads(out)
        assert (info["parameter_count"], info["partition_count"]) == (14, 13)
        assert info["key_count"] == 12 + 13 + 2  # (and the 2 manifests)


async def test_stats_of_a_node_without_updates(node: Node, capsys) -> None:
    rc, out, _ = await ctl(capsys, "stats", text(node.address))
    assert rc == 0
    assert "timestamp   0 (no update yet)" in out
    assert "parameters  0 (0 B)" in out
    # Updates may say timestamp 0 themselves: then it is no sign of no update.
    async with ParameterClient(node.address) as client:
        await client.update_arrays({"p": np.zeros(2)}, timestamp=0)
    rc, out, _ = await ctl(capsys, "stats", text(node.address))
    assert "timestamp   0\n" in out and "no update yet" not in out


# -- get -------------------------------------------------------------------------------------


async def test_get_shows_version_origin_dtype_shape_and_a_preview(
    node: Node, client, capsys
) -> None:
    big = np.arange(600, dtype=np.float32).reshape(20, 30)
    await client.update_arrays({"w": big, "b": np.array([1.5, -2.0])})
    await client.update_arrays({"w": big * 2})
    rc, out, err = await ctl(capsys, "get", text(node.address), "w", "b")
    assert (rc, err) == (0, "")
    w, b = out.split("\nb\n")
    assert w.splitlines()[:6] == [
        "w",
        "  version  2",
        f"  origin   {node.table.origin}",
        "  dtype    float32 (<f4)",
        "  shape    (20, 30)",
        "  bytes    2.3 KiB",
    ]
    value = w.splitlines()[6:]
    assert value[0].startswith("  value    [[   0.    2.    4. ...")
    # A preview: the first and last rows and columns, the rest elided.
    assert len(value) == 7 and value[3].strip() == "..."
    assert all(line.startswith("            ") for line in value[1:])  # under the first
    assert value[-1].endswith("1198.]]")
    assert b.splitlines() == [
        "  version  1",
        f"  origin   {node.table.origin}",
        "  dtype    float64 (<f8)",
        "  shape    (2,)",
        "  bytes    16 B",
        "  value    [ 1.5 -2. ]",
    ]


async def test_get_as_json(node: Node, client, capsys) -> None:
    await client.update_arrays({"s": np.float16(2.5), "c": np.array([1 + 2j]), "n": [math.nan]})
    rc, out, err = await ctl(capsys, "get", "--json", text(node.address), "s", "c", "n")
    assert (rc, err) == (0, "")
    document = json.loads(out)
    assert document["missing"] == []
    s, c, n = document["parameters"]
    assert s == {
        "name": "s",
        "version": 1,
        "origin": node.table.origin,
        "dtype": "<f2",
        "shape": [],
        "nbytes": 2,
        "preview": "2.5",
    }
    assert (c["dtype"], c["shape"], c["preview"]) == ("<c16", [1], "[1.+2.j]")
    assert (n["dtype"], n["preview"]) == ("<f8", "[nan]")  # strict JSON: NaN only as text


async def test_get_a_founding_clients_plain_bytes(node: Node, client, capsys) -> None:
    await client.update_parameters([thrift.Parameter(name="raw", data=b"hi!")])
    rc, out, _ = await ctl(capsys, "get", text(node.address), "raw")
    assert rc == 0
    assert "  dtype    none (plain bytes)\n  shape    -\n  bytes    3 B\n" in out
    assert out.endswith("  value    [104 105  33]\n")


async def test_get_an_unknown_name_exits_3_and_shows_the_others(node: Node, client, capsys) -> None:
    await client.update_arrays({"w": np.ones(2)})
    rc, out, err = await ctl(capsys, "get", text(node.address), "nope", "w", "also-nope")
    assert rc == 3
    assert out.startswith("w\n") and "nope" not in out
    assert err.splitlines() == [
        f"aioparamsync-ctl: no parameter 'nope' on {text(node.address)}",
        f"aioparamsync-ctl: no parameter 'also-nope' on {text(node.address)}",
    ]
    rc, out, err = await ctl(capsys, "--json", "get", text(node.address), "nope", "w")
    assert rc == 3
    document = json.loads(out)
    assert [p["name"] for p in document["parameters"]] == ["w"]
    assert document["missing"] == ["nope"]


async def test_get_shows_a_name_given_twice_once(node: Node, client, capsys) -> None:
    await client.update_arrays({"w": np.ones(2)})
    rc, out, err = await ctl(capsys, "get", text(node.address), "w", "w")
    assert (rc, err) == (0, "")
    assert out.count("version") == 1


async def test_a_request_the_node_refuses_exits_1_with_its_reason(capsys) -> None:
    async with Node("127.0.0.1", 0, limits=Limits(max_names_per_request=2)) as node:
        rc, out, err = await ctl(capsys, "get", text(node.address), "a", "b", "c")
    assert_one_line_error(rc, out, err, "the node refused the request: LIMIT_EXCEEDED")


# -- list ------------------------------------------------------------------------------------


async def test_list_shows_each_parameter_sorted_by_name(node: Node, client, capsys) -> None:
    await client.update_arrays(
        {
            "layer1.weight": np.zeros((768, 512), np.float32),  # 1.5 MiB
            "layer1.bias": np.zeros(512, np.float32),
            "step": np.int64(7),
        }
    )
    await client.update_arrays({"layer1.bias": np.ones(512, np.float32)})
    await client.update_parameters([thrift.Parameter(name="raw", data=b"hi!")])
    rc, out, err = await ctl(capsys, "list", text(node.address))
    assert (rc, err) == (0, "")
    assert out.splitlines() == [
        "NAME           DTYPE    SHAPE       VERSION    BYTES",
        "layer1.bias    float32  (512,)            2  2.0 KiB",
        "layer1.weight  float32  (768, 512)        1  1.5 MiB",
        "raw            bytes    -                 1      3 B",
        "step           int64    ()                1      8 B",
        "4 parameters, 1.5 MiB",
    ]


async def test_list_shows_a_bfloat16_and_a_big_endian_dtype_as_they_are(
    node: Node, client, capsys
) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    await client.update_arrays(
        {"h": np.zeros(4, ml_dtypes.bfloat16), "be": np.zeros(2, ">i4"), "u": np.zeros(3, "u1")}
    )
    rc, out, _ = await ctl(capsys, "list", text(node.address))
    assert rc == 0
    dtypes = {line.split()[0]: line.split()[1] for line in out.splitlines()[1:-1]}
    assert dtypes == {"be": ">i4", "h": "bfloat16", "u": "uint8"}


async def test_list_with_a_prefix_shows_the_names_that_start_with_it(
    node: Node, client, capsys
) -> None:
    await client.update_arrays({n: np.zeros(2) for n in ["enc.w", "enc.b", "dec.w", "encore"]})
    rc, out, err = await ctl(capsys, "list", text(node.address), "enc.")
    assert (rc, err) == (0, "")
    assert [line.split()[0] for line in out.splitlines()] == ["NAME", "enc.b", "enc.w", "2"]
    rc, out, err = await ctl(capsys, "list", text(node.address), "encore")
    assert out.splitlines()[-1] == "1 parameter, 16 B"


async def test_list_as_json(node: Node, client, capsys) -> None:
    await client.update_arrays({"w": np.zeros((2, 3), np.float16), "v": np.zeros(0)})
    await client.update_parameters([thrift.Parameter(name="raw", data=b"abcd")])
    rc, out, err = await ctl(capsys, "list", "--json", text(node.address))
    assert (rc, err) == (0, "")
    origin = node.table.origin
    assert json.loads(out) == {
        "parameters": [
            {"name": "raw", "version": 1, "origin": origin, "dtype": None, "shape": None,
             "nbytes": 4},
            {"name": "v", "version": 1, "origin": origin, "dtype": "<f8", "shape": [0],
             "nbytes": 0},
            {"name": "w", "version": 1, "origin": origin, "dtype": "<f2", "shape": [2, 3],
             "nbytes": 12},
        ],
        "count": 3,
        "nbytes": 16,
    }  # fmt: skip


async def test_list_does_not_download_the_data(node: Node, client, capsys) -> None:
    big = 8 * 1024 * 1024
    await client.update_arrays({f"p{i}": np.zeros(big, np.uint8) for i in range(4)})
    sent = node.server.counters["bytes_out"]
    rc, out, _ = await ctl(capsys, "list", text(node.address))
    assert rc == 0 and out.splitlines()[-1] == "4 parameters, 32.0 MiB"
    assert node.server.counters["bytes_out"] - sent < 4096  # headers only, not 32 MiB


async def test_list_of_a_node_without_parameters_or_matches(node: Node, client, capsys) -> None:
    address = text(node.address)
    rc, out, err = await ctl(capsys, "list", address)
    assert (rc, out, err) == (0, f"{address} holds no parameters\n", "")
    await client.update_arrays({"w": np.zeros(2)})
    rc, out, err = await ctl(capsys, "list", address, "x")
    assert (rc, out, err) == (0, f"{address} holds no parameter whose name starts with 'x'\n", "")
    rc, out, _ = await ctl(capsys, "list", address, "w*")
    assert out == (
        f"{address} holds no parameter whose name starts with 'w*' "
        "(PREFIX is plain text, not a pattern)\n"
    )
    rc, out, _ = await ctl(capsys, "--json", "list", address, "x")
    assert json.loads(out) == {"parameters": [], "count": 0, "nbytes": 0}


async def test_list_matches_a_prefix_as_it_is(node: Node, client, capsys) -> None:
    await client.update_arrays({"a*b": np.zeros(1), "ab": np.zeros(1), "é.w": np.zeros(1)})
    for prefix, names in [("a*", ["a*b"]), ("é", ["é.w"]), ("A", [])]:
        rc, out, _ = await ctl(capsys, "--json", "list", text(node.address), prefix)
        assert rc == 0
        assert [p["name"] for p in json.loads(out)["parameters"]] == names, prefix


# -- a server that is no node ----------------------------------------------------------------


@pytest.fixture
async def http_server() -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1: a 400 once a request's head is in."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield text(server.sockets[0].getsockname())


@pytest.mark.parametrize("command", ["ping", "stats", "list"])
async def test_an_http_server_is_no_node_and_says_so(command, http_server, capsys) -> None:
    # (A deadline far beyond the test's: it fails at once, from what came back.)
    rc, out, err = await ctl(capsys, "--timeout", "600", command, http_server)
    assert_one_line_error(
        rc, out, err,
        f"aioparamsync-ctl: the server at {http_server} answered "
        "b'HTTP/1.1 400 Bad Request\\r\\nContent-Length: 0\\r\\n\\r\\n', which is not a "
        "framed Thrift message: it speaks HTTP (is this the node's metrics port?)\n",
    )  # fmt: skip


@pytest.mark.parametrize("command", ["ping", "stats"])
async def test_a_nodes_metrics_port_is_no_node_and_says_so(command, capsys) -> None:
    pytest.importorskip("prometheus_client")
    async with Node("127.0.0.1", 0, metrics_port=0) as node:
        assert node.metrics_address is not None
        metrics = text(node.metrics_address)
        rc, out, err = await ctl(capsys, "--timeout", "600", command, metrics)
    assert_one_line_error(
        rc, out, err, f"the server at {metrics} answered b'<!DOCTYPE HTML>", "metrics port?"
    )
    assert "\\n    <head>" in err  # (the quoted bytes as they came, spaces kept)


# -- peers -----------------------------------------------------------------------------------


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Node, Node]]:
    """Two nodes that have formed a cluster, and one update replicated from the first."""
    async with (
        Node("127.0.0.1", 0, node_id="a") as a,
        Node("127.0.0.1", 0, node_id="b", peers=[a.address]) as b,
    ):

        async def until(condition) -> None:
            async with asyncio.timeout(SETTLE_TIMEOUT):
                while True:
                    if condition():
                        return
                    await asyncio.sleep(0.02)

        def states() -> list[str]:
            return [s["state"] for n in (a, b) for s in n.cluster.statistics()]

        await until(lambda: states() == ["up", "up"])
        async with ParameterClient(a.address, timeout=10, route=False) as client:  # (at a)
            await client.update_arrays({"w": np.ones(4)})
        await until(lambda: b.table.entry("w") is not None)
        await until(lambda: a.cluster.statistics()[0]["updates_sent"] == 1)
        yield a, b


async def test_peers_shows_a_table_of_the_links(pair, capsys) -> None:
    a, b = pair
    rc, out, err = await ctl(capsys, "peers", text(a.address))
    assert (rc, err) == (0, "")
    header, row, *rest = out.splitlines()
    assert header.split() == [
        "NODE", "ADDRESS", "STATE", "OUTBOX", "SENT", "COALESCED", "FAILURES", "LAG",
    ]  # fmt: skip
    node_id, address, state, outbox, sent, coalesced, failures, lag, unit = row.split()
    assert (node_id, address, state) == ("b", text(b.address), "up")
    assert (outbox, sent, coalesced, failures) == ("0", "1", "0", "0")
    assert (float(lag), unit) == (0.0, "s")
    assert rest == []
    # Columns line up: text columns on the left, numbers on the right.
    heads = [m.span() for m in re.finditer(r"\S+", header)]
    cells = [m.span() for m in re.finditer(r"\S+", row)]
    assert [start for start, _ in heads[:3]] == [start for start, _ in cells[:3]]
    assert [end for _, end in heads[3:]] == [end for _, end in cells[3:7] + cells[8:]]


async def test_peers_as_json(pair, capsys) -> None:
    a, b = pair
    rc, out, err = await ctl(capsys, "--json", "peers", text(a.address))
    assert (rc, err) == (0, "")
    document = json.loads(out)
    assert document["node_id"] == "a"
    (peer,) = document["peers"]
    assert peer == {
        "node_id": "b",
        "address": text(b.address),
        "state": "up",
        "outbox_depth": 0,
        "updates_sent": 1,
        "updates_coalesced": 0,
        "send_failures": 0,
        "lag_seconds": 0.0,
        "last_error": "",
        "repaired": 0,
    }


async def test_peers_of_a_lone_node(node: Node, capsys) -> None:
    rc, out, err = await ctl(capsys, "peers", text(node.address))
    assert (rc, out, err) == (0, f"{node.node_id} has no peers\n", "")
    rc, out, _ = await ctl(capsys, "peers", "--json", text(node.address))
    assert json.loads(out) == {"node_id": node.node_id, "peers": []}


# -- waiting ---------------------------------------------------------------------------------


async def test_waiting_shows_who_waits_for_whom(node: Node, client, capsys) -> None:
    rc, out, err = await ctl(capsys, "waiting", text(node.address))
    assert (rc, out, err) == (0, f"{node.node_id} holds no long polls or barriers\n", "")
    held = [
        asyncio.ensure_future(client.get_parameters(["w"], min_version=1, wait=30)),
        asyncio.ensure_future(client.barrier("train", "worker-0", 7, 2, timeout=30)),
    ]
    try:

        async def both_held() -> None:
            waiting = (await client.info()).waiting or []
            assert len(waiting) == 2, waiting

        await eventually(both_held)
        rc, out, err = await ctl(capsys, "waiting", text(node.address))
        assert rc == 0 and err == ""
        lines = out.splitlines()
        assert lines[0].split() == ["KIND", "WHO", "FOR", "WAITING", "WAITING", "FOR"]
        assert any(
            line.startswith("barrier")
            and "worker-0" in line
            and "'train' step 7" in line
            and line.endswith("1 never seen")
            for line in lines
        ), out
        assert any(line.startswith("pull") and line.endswith("w") for line in lines), out
        rc, out, _ = await ctl(capsys, "--json", "waiting", text(node.address))
        document = json.loads(out)
        assert document["node_id"] == node.node_id
        kinds = {w["kind"]: w for w in document["waiting"]}
        assert kinds["barrier"]["who"] == "worker-0"
        assert kinds["barrier"]["waiting_for"] == ["1 never seen"]
        assert kinds["pull"]["waiting_for"] == ["w"] and kinds["pull"]["seconds"] >= 0
    finally:
        for call in held:
            call.cancel()
        await asyncio.gather(*held, return_exceptions=True)


# -- what goes wrong -------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
async def test_an_unreachable_node_exits_1_with_one_line(command, capsys) -> None:
    address = f"127.0.0.1:{unused_port()}"
    rc, out, err = await ctl(capsys, *argv_of(command, address))
    assert_one_line_error(rc, out, err, f"cannot connect to {address}")


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
async def test_a_node_that_does_not_answer_times_out(as_json, capsys) -> None:
    with socket.socket() as silent:  # accepts (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = text(silent.getsockname())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        flags = ["--json"] if as_json else []
        rc, out, err = await ctl(capsys, *flags, "--timeout", "0.3", "stats", address)
        took = loop.time() - t0
    assert_one_line_error(rc, out, err, "info did not complete within 0.3 s")
    assert took < 5


async def test_a_name_that_cannot_be_resolved_exits_1(capsys) -> None:
    # .invalid never resolves (RFC 2606): the resolver answers at once, no traffic.
    rc, out, err = await ctl(capsys, "ping", "no-such-host.invalid:9090")
    assert_one_line_error(rc, out, err, "cannot connect to no-such-host.invalid:9090")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["bogus", "127.0.0.1:9090"], "invalid choice: 'bogus'"),
        (["stats"], "the following arguments are required: ADDRESS"),
        (["stats", "nohost"], "argument ADDRESS: 'nohost' is not host:port"),
        (["stats", "127.0.0.1:abc"], "argument ADDRESS: '127.0.0.1:abc': port 'abc' is not"),
        (["stats", "127.0.0.1:70000"], "argument ADDRESS: port 70000 is out of range"),
        (["stats", ":9090"], "argument ADDRESS: ':9090' is not host:port"),
        (["stats", "http://127.0.0.1:9090"], "without a scheme: drop 'http://'"),
        (["export", "127.0.0.1:9090"], "the following arguments are required: FILE"),
        (["get", "127.0.0.1:9090"], "the following arguments are required: NAME"),
        (["list"], "the following arguments are required: ADDRESS"),
        (["list", "127.0.0.1:9090", ""], "argument PREFIX: must not be empty (leave it out"),
        (["list", "127.0.0.1:9090", "\udcff"], "argument PREFIX: '\\udcff' is not valid UTF-8"),
        (["list", "127.0.0.1:9090", "a", "b"], "unrecognized arguments: b"),
        (["--timeout", "inf", "list", "127.0.0.1:9090"], "argument --timeout: 'inf'"),
        (["list", "127.0.0.1:9090", "--timeout", "-1"], "argument --timeout: '-1'"),
        (["--timeout", "0", "ping", "127.0.0.1:9090"], "argument --timeout: '0'"),
        (["ping", "127.0.0.1:9090", "--timeout", "nan"], "argument --timeout: 'nan'"),
        (["ping", "127.0.0.1:9090", "--timeout", "soon"], "argument --timeout: 'soon'"),
        (["ping", "127.0.0.1:9090", "--bogus"], "unrecognized arguments: --bogus"),
        (["ping", "127.0.0.1:9090", "extra"], "unrecognized arguments: extra"),
        (["ping", "127.0.0.1:9090", "--tls-key", "k.pem"], "--tls-key needs --tls-cert"),
        (["ping", "127.0.0.1:9090", "--tls", "--tls-key", "k.pem"], "--tls-key needs --tls-cert"),
        (["ping", "127.0.0.1:9090", "--tls-ca", "ca.pem", "--tls-key", "k.pem"], "--tls-key needs"),
        (["ping", "127.0.0.1:9090", "--tls-ca", "/no/such/ca.pem"], "TLS: "),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_arguments_exit_2_with_usage(argv, expected, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    assert err.startswith("usage: aioparamsync-ctl")
    assert err.splitlines()[-1].startswith("aioparamsync-ctl")
    assert expected in err.splitlines()[-1], err


def test_help_lists_the_commands_and_exits_0(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for word in [*COMMANDS, "--json", "--timeout", "Exit codes"]:
        assert word in out


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"aioparamsync-ctl {__version__}\n"


# -- TLS -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ca = trustme.CA()
    root = tmp_path_factory.mktemp("pki")
    files = {"ca": root / "ca.pem", "node": root / "node.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(files["node"]))
    return files


async def test_a_tls_node(pki, capsys) -> None:
    async with Node("127.0.0.1", 0, ssl=server_context(str(pki["node"]))) as node:
        rc, out, err = await ctl(capsys, "ping", text(node.address), "--tls-ca", str(pki["ca"]))
        assert (rc, err) == (0, "")
        assert node.node_id in out
        # Without TLS, or with the system's CAs: a clear failure, not a hang.
        for flags in [[], ["--tls"]]:
            rc, out, err = await ctl(capsys, "ping", text(node.address), "--timeout", "5", *flags)
            assert rc == 1 and out == "" and "Traceback" not in err, (flags, err)


# -- as processes ----------------------------------------------------------------------------


async def run_ctl(*argv: str) -> tuple[int, str, str]:
    return await run_process(*argv, timeout=RUN_TIMEOUT)


async def test_the_console_script(node: Node, client) -> None:
    # pip puts the script beside the interpreter of the environment it installs into.
    script = str(Path(sys.executable).with_name("aioparamsync-ctl"))
    await client.update_arrays({"w": np.arange(3)})
    rc, out, err = await run_ctl(script, "--json", "get", text(node.address), "w")
    assert (rc, err) == (0, "")
    (w,) = json.loads(out)["parameters"]
    assert (w["name"], w["shape"], w["preview"]) == ("w", [3], "[0 1 2]")

    rc, out, err = await run_ctl(script, "ping", f"127.0.0.1:{unused_port()}")
    assert_one_line_error(rc, out, err, "cannot connect to")


async def test_python_m_aioparamsync_ctl(node: Node) -> None:
    rc, out, err = await run_ctl(
        sys.executable, "-m", "aioparamsync.ctl", "stats", text(node.address)
    )
    assert (rc, err) == (0, "")
    assert out.startswith(f"node        {node.node_id}\n")
    rc, out, err = await run_ctl(sys.executable, "-m", "aioparamsync.ctl", "stats", "nohost")
    assert rc == 2 and out == "" and "Traceback" not in err


# -- topology and drain ---------------------------------------------------------------------


async def test_topology_shows_the_epoch_r_and_each_member(pair, capsys) -> None:
    a, b = pair

    def both_up() -> None:  # (b may still be joining when the pair is made)
        assert {m.node_id: m.state for m in a.cluster.topology().members} == {
            "a": "up",
            "b": "up",
        }

    await eventually(both_up)
    rc, out, err = await ctl(capsys, "topology", text(a.address))
    assert (rc, err) == (0, "")
    first, header, *rows = out.splitlines()
    # (the epoch a answered: it may have moved on since, while the pair settles)
    epoch = int(first.split(",")[0].removeprefix("epoch "))
    assert 0 < epoch <= a.cluster.epoch
    assert first == (
        f"epoch {epoch}, replication factor 3, 2 members, partitions of 4.0 MiB of float32"
    )
    assert header.split() == [
        "NODE",
        "ADDRESS",
        "STATE",
        "CLAIMS",
        "KEYS",
        "BYTES",
        "MOVING",
        "UNDER-REPLICATED",
    ]
    got = {row.split()[0]: row.split() for row in rows}
    assert set(got) == {"a", "b"}
    assert got["b"][1:5] == [text(b.address), "up", "0", "1"]  # b holds w (R=3: every node)
    rc, out, err = await ctl(capsys, "--json", "topology", text(a.address))
    document = json.loads(out)
    assert document["replication_factor"] == 3
    assert document["partition_bytes"] == 4 * 1024 * 1024
    assert {m["node_id"]: m["state"] for m in document["members"]} == {"a": "up", "b": "up"}
    assert {m["node_id"]: m["keys"] for m in document["members"]} == {"a": 1, "b": 1}
    assert {m["node_id"]: m["claims"] for m in document["members"]} == {"a": 0, "b": 0}


async def test_drain_makes_a_node_leave_after_handing_its_keys_off(capsys) -> None:
    async with (
        Node("127.0.0.1", 0, node_id="a") as a,
        Node("127.0.0.1", 0, node_id="b", peers=[a.address]) as b,
    ):

        def formed() -> None:
            assert a.cluster.state == b.cluster.state == "up" and len(a.cluster.live) == 2

        await eventually(formed, timeout=SETTLE_TIMEOUT)
        async with ParameterClient(a.address, timeout=10, route=False) as client:
            await client.update_arrays({"w": np.ones(4), "v": np.zeros(2)}, acks="all")
        rc, out, err = await ctl(capsys, "drain", text(b.address))
        assert (rc, err) == (0, "")
        assert out == f"{text(b.address)}: handed off 2 keys; the node is leaving\n"
        assert b.left.is_set() and b.cluster.state == "left"

        def b_gone() -> None:
            assert a.cluster.placement.members == ("a",)

        await eventually(b_gone, timeout=SETTLE_TIMEOUT)


async def test_drain_of_a_lone_node_hands_off_nothing(node: Node, capsys) -> None:
    rc, out, err = await ctl(capsys, "--json", "drain", text(node.address))
    assert (rc, err) == (0, "")
    assert json.loads(out) == {"address": text(node.address), "handed_off": 0}
    assert node.left.is_set()


def test_drain_refuses_a_wait_that_is_no_number_of_seconds(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["drain", "--wait", "-3", "127.0.0.1:9"])
    assert exited.value.code == 2
    assert "--wait" in capsys.readouterr().err


# -- shutdown -------------------------------------------------------------------------------


def assert_up(*nodes: Node) -> None:
    for node in nodes:
        assert node.cluster.state == "up" and len(node.cluster.live) == len(nodes)


async def test_shutdown_stops_every_node_of_the_cluster(capsys) -> None:
    async with (
        Node("127.0.0.1", 0, node_id="a") as a,
        Node("127.0.0.1", 0, node_id="b", peers=[a.address]) as b,
    ):
        await eventually(lambda: assert_up(a, b), timeout=SETTLE_TIMEOUT)
        rc, out, err = await ctl(capsys, "shutdown", text(a.address))
        assert (rc, err) == (0, "")
        assert out == f"{text(a.address)}: 2 nodes stopping, 0 wrote their final snapshot\n"
        assert a.shutting_down.is_set() and b.shutting_down.is_set()
        assert not a.left.is_set()  # (no hand-off: every node stops)


async def test_shutdown_of_this_node_only_as_json(capsys) -> None:
    async with (
        Node("127.0.0.1", 0, node_id="a") as a,
        Node("127.0.0.1", 0, node_id="b", peers=[a.address]) as b,
    ):
        await eventually(lambda: assert_up(a, b), timeout=SETTLE_TIMEOUT)
        rc, out, err = await ctl(capsys, "--json", "shutdown", "--only-this-node", text(b.address))
        assert (rc, err) == (0, "")
        assert json.loads(out) == {
            "address": text(b.address),
            "stopping": 1,
            "snapshots": 0,
            "unreached": [],
        }
        assert b.shutting_down.is_set() and not a.shutting_down.is_set()


async def test_shutdown_with_snapshot_writes_it_before_answering_and_refuses_writes_after(
    tmp_path, capsys
) -> None:
    async with (
        Node("127.0.0.1", 0, data_dir=tmp_path) as node,
        ParameterClient(node.address) as client,
    ):
        await client.update_arrays({"w": np.arange(4, dtype=np.float32)})
        rc, out, err = await ctl(capsys, "shutdown", "--snapshot", text(node.address))
        assert (rc, err) == (0, "")
        assert out.endswith(": 1 nodes stopping, 1 wrote their final snapshot\n")
        snapshots = list(tmp_path.glob("*.safetensors"))
        assert snapshots, sorted(p.name for p in tmp_path.iterdir())
        with pytest.raises(RequestError) as refused:
            await client.update_arrays({"w": np.zeros(4, np.float32)})
        assert refused.value.code == ErrorCode.UNAVAILABLE
        assert (await client.get_arrays(["w"]))["w"].tolist() == [0, 1, 2, 3]  # reads go on
    async with Node("127.0.0.1", 0, data_dir=tmp_path) as again:
        assert again.table.entry("w").version == 1


async def test_shutdown_names_the_members_it_could_not_reach_and_exits_1(capsys) -> None:
    async with Node("127.0.0.1", 0, node_id="a") as a:
        b = Node("127.0.0.1", 0, node_id="b", peers=[a.address])
        await b.start()
        await eventually(lambda: assert_up(a, b), timeout=SETTLE_TIMEOUT)
        b_address = text(b.address)
        await b.stop(leave=False)  # (down, not left: a still counts it a member)
        await eventually(lambda: assert_(a.cluster.by_id["b"].state != "up"), timeout=10)
        rc, out, err = await ctl(capsys, "shutdown", text(a.address))
        assert rc == 1, (out, err)
        assert f"not reached: {b_address}" in out
        assert a.shutting_down.is_set()


async def test_a_tls_node_takes_shutdown_only_from_clients_it_verifies(tmp_path, capsys) -> None:
    ca = trustme.CA()
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "node", "client")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(files["node"]))
    ca.issue_cert("worker").private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    tls = ["--tls-ca", str(files["ca"])]
    async with Node("127.0.0.1", 0, ssl=server_context(str(files["node"]))) as node:
        rc, out, err = await ctl(capsys, "shutdown", text(node.address), *tls)
        assert_one_line_error(rc, out, err, "without verifying its clients", "--tls-ca")
        assert not node.shutting_down.is_set()
    verifying = server_context(str(files["node"]), cafile=str(files["ca"]))
    async with Node("127.0.0.1", 0, ssl=verifying) as node:
        rc, out, err = await ctl(
            capsys, "shutdown", text(node.address), *tls, "--tls-cert", str(files["client"])
        )
        assert (rc, err) == (0, ""), err
        assert node.shutting_down.is_set()


async def test_a_job_ends_the_cluster_its_node_processes_exit_0_after_their_snapshots(
    tmp_path,
) -> None:
    """What a Kubernetes Job's last worker does: the node processes exit, and come
    back from their snapshots."""
    procs = ProcessCluster()
    try:
        dirs = [tmp_path / name for name in ("a", "b")]
        a = await procs.spawn(extra=["--data-dir", str(dirs[0])])
        b = await procs.spawn(peers=[a], extra=["--data-dir", str(dirs[1])])
        async with ParameterClient(a.address, timeout=10) as client:

            async def meshed() -> None:
                info = await client.info()
                assert [p.state for p in info.peers or []] == ["up"]

            await eventually(meshed, timeout=SETTLE_TIMEOUT)
            await client.update_arrays({"w": np.ones(3, np.float32)}, acks="all")
            result = await client.shutdown_cluster(snapshot=True)
        assert (result.stopping, result.snapshots, result.unreached) == (2, 2, None)
        assert [await p.wait_exit() for p in (a, b)] == [0, 0]
        for data_dir in dirs:
            async with Node("127.0.0.1", 0, data_dir=data_dir) as again:
                assert again.table.entry("w").version == 1
    finally:
        await procs.close()
