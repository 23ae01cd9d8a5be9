"""Workers launched by torchrun (the example, on CPU, loopback only), and ``Launch``'s reading
of the environment launchers set."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from cluster_helpers import ProcessCluster, free_port, run_process

from aioparamsync import Launch, ParameterClient

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchrun_train.py"


async def test_torchrun_workers_train_the_example_and_end_the_cluster() -> None:
    pytest.importorskip("torch")
    procs = ProcessCluster()
    try:
        a = await procs.spawn()
        b = await procs.spawn(peers=[a])
        env = {
            **os.environ,
            "AIOPARAMSYNC_ADDRESSES": f"{a.address_text},{b.address_text}",
            "AIOPARAMSYNC_EXAMPLE_SHUTDOWN": "1",
            "OMP_NUM_THREADS": "1",
        }
        # (rendezvous on loopback: a static one, its store on 127.0.0.1 and a free port)
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "static",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--node-rank", "0",
            str(EXAMPLE),
        ]  # fmt: skip
        rc, out, err = await run_process(*argv, timeout=150, env=env)
        assert rc == 0, err[-3000:]
        (line,) = [x for x in out.splitlines() if "full-data loss" in x]
        assert line.startswith("rank 0 of 2: ")
        assert float(line.rsplit(" ", 1)[1]) < 0.01, line  # (the labels' variance is ~8)
        assert "rank 0: 2 nodes stopping" in out
        assert [await p.wait_exit() for p in (a, b)] == [0, 0]
    finally:
        await procs.close()


def test_launch_reads_torchruns_environment() -> None:
    launch = Launch.from_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "AIOPARAMSYNC_ADDRESSES": "h:1"}
    )
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 4, 1)
    assert launch.worker == "rank3" and not launch.is_first
    assert isinstance(launch.client(), ParameterClient)


def test_launch_reads_an_indexed_jobs_environment() -> None:
    launch = Launch.from_env({"JOB_COMPLETION_INDEX": "0", "WORLD_SIZE": "2"})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.is_first) == (0, 2, 0, True)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "RANK and WORLD_SIZE not set"),
        ({"RANK": "0"}, "WORLD_SIZE not set"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not a whole number"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not in 0..1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 is negative"),
    ],
)
def test_a_bad_launch_environment_is_refused_naming_the_variable(environ, expected) -> None:
    with pytest.raises(ValueError) as info:
        Launch.from_env(environ)
    assert expected in str(info.value)


def test_launch_without_addresses_says_which_to_set() -> None:
    launch = Launch.from_env({"RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(ValueError, match="AIOPARAMSYNC_ADDRESSES"):
        launch.client()
