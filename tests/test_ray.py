"""aioparamsync.ray on a local Ray instance pinned to 127.0.0.1: nodes as actors, workers as
tasks, a node killed and restarted by Ray, and the end (bounded; loopback only)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest

# Ray turns 127.0.0.1 given as the node's address into the machine's interface address,
# unless its clusters are off (what it does on macOS and Windows): then every process of it
# (and each node it starts here) is on loopback. Read when ray is imported, and inherited by
# the processes it starts.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")
ps_ray = pytest.importorskip("aioparamsync.ray")

from aioparamsync import ParameterClient, sum_rule  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def local_ray():
    # Every process of Ray's own on 127.0.0.1 (it picks the machine's address otherwise).
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level="WARNING",
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def read(addresses, names, **kwargs):
    async def run():
        async with ParameterClient(addresses, timeout=20, **kwargs) as client:
            return {n: a.tolist() for n, a in (await client.get_arrays(names)).items()}

    return asyncio.run(run())


@ray.remote(num_cpus=0.25)
def push_ones(addresses: list[str], pushes: int) -> None:
    async def run() -> None:
        async with ParameterClient(addresses, timeout=20) as client:
            await client.get_arrays(["g"], min_version=1, wait=20)
            for _ in range(pushes):
                await client.push_gradients({"g": np.ones(4, np.float32)})

    asyncio.run(run())


def test_a_cluster_of_actors_serves_workers_comes_back_from_a_kill_and_ends(local_ray) -> None:
    cluster = ps_ray.start_cluster(2, name="t1", num_cpus=0.5, repair_interval=0.5)
    try:
        assert len(cluster.addresses) == 2
        assert all(a.startswith("127.0.0.1:") for a in cluster.addresses), cluster.addresses
        assert cluster.addresses_env() == {"AIOPARAMSYNC_ADDRESSES": ",".join(cluster.addresses)}

        async def seed() -> None:
            async with cluster.client(timeout=20) as client:
                await client.update_arrays({"g": np.zeros(4, np.float32)}, rules=sum_rule())
                await client.update_arrays({"w": np.arange(3, dtype=np.float32)}, acks="all")

        asyncio.run(seed())
        ray.get([push_ones.remote(cluster.addresses, 10) for _ in range(2)], timeout=120)
        assert read(cluster.addresses, ["g"]) == {"g": [20.0] * 4}

        # A node's actor killed: Ray restarts it, it rejoins under its id and catches up.
        victim = cluster.actors[1]
        ray.kill(victim, no_restart=False)

        def restarted() -> list[str]:
            for _ in range(100):
                try:
                    return cluster.refresh(timeout=10)
                except ray.exceptions.RayError:
                    time.sleep(0.2)
            raise AssertionError("the actor did not come back")

        addresses = restarted()
        cluster.wait_meshed(timeout=60)
        alone = addresses[1]
        for _ in range(100):
            held = read([alone], ["w", "g"], route=False)
            if held == {"w": [0.0, 1.0, 2.0], "g": [20.0] * 4}:
                break
            time.sleep(0.2)
        assert held == {"w": [0.0, 1.0, 2.0], "g": [20.0] * 4}, held
    finally:
        cluster.shutdown()
    assert cluster.actors == []
    for i in range(2):
        with pytest.raises(ValueError):
            ray.get_actor(f"t1-node-{i}", namespace="t1")
    groups = ray.util.placement_group_table()
    assert all(g["state"] == "REMOVED" for g in groups.values()), groups


def test_one_node_per_ray_node_by_default_and_as_a_context_manager(local_ray) -> None:
    with ps_ray.start_cluster(name="t2", num_cpus=0.25) as cluster:
        assert len(cluster.addresses) == 1  # (one Ray node here)
        assert read(cluster.addresses, ["nothing"]) == {}
    assert cluster.actors == []


@pytest.mark.parametrize("num_nodes", [0, -1, 1.5, True])
def test_bad_numbers_are_refused(local_ray, num_nodes) -> None:
    with pytest.raises(ValueError, match="num_nodes"):
        ps_ray.start_cluster(num_nodes, name="t3")


def test_a_negative_cpu_share_is_refused(local_ray) -> None:
    with pytest.raises(ValueError, match="num_cpus"):
        ps_ray.start_cluster(1, name="t4", num_cpus=-1)


def test_import_aioparamsync_does_not_import_ray() -> None:
    code = "import sys, aioparamsync; aioparamsync.ParameterClient; print('ray' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"
