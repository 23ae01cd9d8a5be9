"""aioparamsync.ray on one local Ray instance pinned to 127.0.0.1.

Nodes as actors, workers as Ray tasks, a node killed and restarted by Ray
(it rejoins and catches up), the end (nothing left), persistence across
clusters, refused arguments, and the imports. Loopback only: Ray turns
127.0.0.1 given as its node's address into the machine's interface address
unless its multi-machine clusters are off, which is read when ray is
imported (and inherited by every process it starts), so it is set first;
usage statistics (which Ray would send out) are off too. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # (127.0.0.1 stays 127.0.0.1)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
ray = pytest.importorskip("ray")
ps_ray = pytest.importorskip("aioparamsync.ray")

from aioparamsync import ParameterClient, sum_rule  # noqa: E402

LOOPBACK = "127.0.0.1"
CALL_TIMEOUT = 20.0
pytestmark = pytest.mark.timeout(180)


def closed_port() -> int:
    """A loopback port nothing listens on (it was free a moment ago)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(**variables: str):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance for the module: 2 CPUs, every process of it on 127.0.0.1."""
    # Ray's API server asks the clouds' metadata servers (169.254.169.254, a DNS
    # name) which cloud it runs on, usage statistics off or not: through a proxy
    # on a closed loopback port it learns "unknown" with nothing sent out. Ray's
    # processes started here keep these variables; loopback is never proxied.
    proxy = f"http://{LOOPBACK}:{closed_port()}"
    direct = f"{LOOPBACK},localhost,::1"
    with environment(
        http_proxy=proxy,
        https_proxy=proxy,
        HTTP_PROXY=proxy,
        HTTPS_PROXY=proxy,
        no_proxy=direct,
        NO_PROXY=direct,
    ):
        ray.init(
            address="local",  # a new instance, never one already running on the machine
            num_cpus=2,
            include_dashboard=False,
            dashboard_host=LOOPBACK,  # (its API server runs all the same)
            _node_ip_address=LOOPBACK,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
    try:
        # Had ray been imported before the variable above, it would be elsewhere.
        assert ray.util.get_node_ip_address() == LOOPBACK
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster(local_ray):
    """Two nodes on the one Ray node (SPREAD places both there), each holding everything."""
    c = ps_ray.start_cluster(
        2, num_cpus=0.5, name="test-ps", node_options={"repair_interval": 0.5}, timeout=90
    )
    try:
        yield c
    finally:
        c.shutdown()


def run(coro_fn, *args, **kwargs):
    return asyncio.run(coro_fn(*args, **kwargs))


async def read(addresses, names, **kwargs):
    async with ParameterClient(addresses, timeout=CALL_TIMEOUT, **kwargs) as client:
        return {n: a.tolist() for n, a in (await client.get_arrays(names)).items()}


async def eventually_read(addresses, name, expected, timeout=10.0):
    """``name``'s value once it is ``expected`` (or the last one read, after ``timeout`` s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with ParameterClient(addresses, timeout=CALL_TIMEOUT) as client:
        while True:
            value = (await client.get_arrays([name]))[name].tolist()
            if value == expected or loop.time() > deadline:
                return value
            await asyncio.sleep(0.05)


async def write(addresses, arrays, **kwargs):
    async with ParameterClient(addresses, timeout=CALL_TIMEOUT) as client:
        return await client.update_arrays(arrays, **kwargs)


@ray.remote(num_cpus=0.5)
def push_ones(name: str, pushes: int) -> int:
    """A worker: the nodes from its environment (runtime_env), the ordinary client."""
    addresses = os.environ[ps_ray.ADDRESSES_VARIABLE].split(",")

    async def main() -> int:
        async with ParameterClient(addresses, timeout=CALL_TIMEOUT) as client:
            for _ in range(pushes):
                await client.push_gradients({name: np.ones(4, np.float32)})
        return pushes

    return asyncio.run(main())


def test_the_nodes_are_up_on_loopback_and_meshed(cluster) -> None:
    assert len(cluster.addresses) == 2
    assert len(set(cluster.addresses)) == 2
    assert all(a.startswith(f"{LOOPBACK}:") for a in cluster.addresses), cluster.addresses
    assert cluster.addresses_env() == {"AIOPARAMSYNC_ADDRESSES": ",".join(cluster.addresses)}
    nodes = cluster.nodes()
    assert [n["node_id"] for n in nodes] == ["test-ps-node-0", "test-ps-node-1"]
    assert all(n["ready"] and n["state"] == "up" for n in nodes), nodes
    assert [n["address"] for n in nodes] == cluster.addresses

    async def topologies():
        seen = []
        for address in cluster.addresses:
            async with ParameterClient(address, route=False, timeout=CALL_TIMEOUT) as client:
                topology = await client.topology()
            seen.append(sorted((m.node_id, m.state) for m in topology.members))
        return seen

    both = [("test-ps-node-0", "up"), ("test-ps-node-1", "up")]
    assert run(topologies) == [both, both]


def test_a_client_writes_and_reads(cluster) -> None:
    async def roundtrip():
        async with cluster.client(timeout=CALL_TIMEOUT) as client:
            await client.update_arrays({"rw": np.arange(6, dtype=np.float32).reshape(2, 3)})
            return (await client.get_arrays(["rw"]))["rw"]

    got = run(roundtrip)
    assert got.shape == (2, 3)
    assert got.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_gradients_pushed_from_two_tasks_are_all_folded(cluster) -> None:
    run(write, cluster.addresses, {"g": np.zeros(4, np.float32)}, rules={"g": sum_rule()})
    env = {"env_vars": cluster.addresses_env()}
    pushed = ray.get([push_ones.options(runtime_env=env).remote("g", 10) for _ in range(2)])
    assert pushed == [10, 10]
    # Each push was answered once folded at g's primary; a replica may lag it by a message.
    assert run(eventually_read, cluster.addresses, "g", [20.0] * 4) == [20.0] * 4


def test_a_killed_node_comes_back_rejoins_and_catches_up(cluster) -> None:
    run(write, cluster.addresses, {"kept": np.full(3, 7.0, np.float32)}, acks="all")
    before = cluster.nodes()[1]
    ray.kill(cluster.actors[1], no_restart=False)  # (in memory: it comes back empty)
    # (the kill takes a moment: until then the actor answers as it was)
    deadline = time.monotonic() + 60
    while cluster.nodes()[1]["pid"] == before["pid"]:
        assert time.monotonic() < deadline, "the actor was not restarted"
        time.sleep(0.05)

    addresses = cluster.refresh(timeout=60)  # (a restarting node answers once it is up)
    cluster.wait_meshed(timeout=60)
    assert all(a.startswith(f"{LOOPBACK}:") for a in addresses), addresses
    back = cluster.nodes()[1]
    assert back["node_id"] == "test-ps-node-1"  # (its old id, at its new address)

    async def held_there():
        # That node alone: what it holds itself, once it has pulled it.
        async with ParameterClient(addresses[1], route=False, timeout=CALL_TIMEOUT) as client:
            info = await client.info()
            return info.parameter_count, (await client.get_arrays(["kept"]))["kept"].tolist()

    count, kept = run(held_there)
    assert kept == [7.0, 7.0, 7.0]
    assert count >= 1
    assert cluster.nodes()[1]["parameters"] >= 1
    # It takes its part of writes again (acks="all": once every replica applied them).
    run(write, addresses, {"after": np.ones(2, np.float32)}, acks="all")
    assert run(read, addresses[1], ["after"], route=False) == {"after": [1.0, 1.0]}


def test_shutdown_leaves_nothing_and_a_data_dir_outlives_its_cluster(local_ray, tmp_path) -> None:
    # num_nodes=None: one node per Ray node (here one).
    first = ps_ray.start_cluster(name="test-end", num_cpus=0.25, data_dir=tmp_path, timeout=90)
    assert len(first.addresses) == 1
    run(write, first.addresses, {"saved": np.arange(3, dtype=np.float32)})
    group = first.placement_group
    first.shutdown(snapshot=True)
    first.shutdown()  # (twice: nothing more)

    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    named = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["namespace"] == "test-end"], named
    assert os.listdir(tmp_path / "node-0")  # its log and snapshot, on the Ray node's disk

    # The same name again, on the same disk: the node recovers what it had.
    with ps_ray.start_cluster(name="test-end", num_cpus=0.25, data_dir=tmp_path) as again:
        assert run(read, again.addresses, ["saved"]) == {"saved": [0.0, 1.0, 2.0]}
    named = ray.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["namespace"] == "test-end"], named


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, True])
def test_bad_node_counts_are_refused(num_nodes) -> None:
    with pytest.raises(ValueError, match=r"num_nodes must be an integer of at least 1"):
        ps_ray.start_cluster(num_nodes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_cpus": 0}, "num_cpus must be a number above 0"),
        ({"num_cpus": -1}, "num_cpus must be a number above 0"),
        ({"port": -1}, "port must be 0"),
        ({"max_restarts": -2}, "max_restarts must be an integer of at least -1"),
        ({"replication_factor": 0}, "replication_factor must be an integer of at least 1"),
        ({"data_dir": "relative/dir"}, "data_dir must be an absolute path"),
        ({"node_options": {"port": 9000}}, "node_options port: set by start_cluster"),
        ({"node_options": {"ssl": None}}, "node_options ssl: not supported"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ps_ray.start_cluster(1, **kwargs)


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_import_aioparamsync_does_not_import_ray() -> None:
    out = python(
        "import sys, aioparamsync; aioparamsync.ParameterClient; aioparamsync.Node; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_without_ray_the_import_error_says_what_to_install() -> None:
    out = python(
        "import sys; sys.modules['ray'] = None\n"  # (import ray then raises ImportError)
        "try:\n"
        "    import aioparamsync.ray\n"
        "except ImportError as exc:\n"
        "    print(exc.name, '|', exc)\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ray | ")
    assert "pip install 'aioparamsync[ray]'" in out.stdout
