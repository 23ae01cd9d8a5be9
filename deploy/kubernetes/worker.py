"""A training worker of worker-job.yaml: asynchronous SGD on one parameter.

Each pod of the Indexed Job runs it with RANK (its completion index) and WORLD_SIZE, and reaches
the nodes at AIOPARAMSYNC_ADDRESSES (with the AIOPARAMSYNC_TLS_* files, if set). Rank 0 creates
the parameter ``w``; every rank pushes gradients of 0.5 * |w - TARGET|^2, which the nodes fold
in by ``w``'s sgd rule; once every rank is done, rank 0 stops the cluster after a snapshot.
"""

from __future__ import annotations

import asyncio

import numpy as np

import aioparamsync
from aioparamsync import Launch, ParameterClient

STEPS = 20
TARGET = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
# The Job and the StatefulSet start together: how long to wait for a node to answer (seconds).
CONNECT_WITHIN = 300.0


async def connect() -> ParameterClient:
    """A client, once a node answers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_WITHIN
    while True:
        client = None
        try:
            client = ParameterClient.from_env()
            await client.ping()
            return client
        # (a name not resolving yet, a refused connection and a timeout are all OSErrors)
        except OSError:
            if client is not None:
                await client.close()
            if loop.time() > deadline:
                raise
        await asyncio.sleep(2.0)


async def main() -> None:
    launch = Launch.from_env()  # RANK (the completion index) and WORLD_SIZE
    rank = launch.rank
    client = await connect()
    async with client:
        # Created only if absent, so a rank 0 restarted (or a Job run again on the cluster's
        # volumes) goes on from what the nodes hold.
        if rank == 0 and not await client.get_arrays(["w"]):
            await client.update_arrays(
                {"w": np.zeros(4, np.float32)}, rules={"w": aioparamsync.sgd(0.1)}
            )
        # Raises TIMEOUT if rank 0 has not created it within a minute (the Job retries).
        await client.get_arrays(["w"], min_version=1, wait=60)
        for _ in range(STEPS):
            w = (await client.get_arrays(["w"]))["w"]
            await client.push_gradients({"w": w - TARGET})
        w = (await client.get_arrays(["w"]))["w"]
        print(f"rank {rank}: w = {w}, loss {0.5 * float(np.sum((w - TARGET) ** 2)):.6f}")
        await launch.barrier(client, "done", 1)
        if rank == 0:
            await client.shutdown_cluster(snapshot=True)
            print("rank 0: cluster shut down after a snapshot")


if __name__ == "__main__":
    asyncio.run(main())
