#!/usr/bin/env python3
"""A torch model trained by workers that torchrun launches; the nodes share its parameters.

Start a node (or a cluster), then launch the workers with torchrun::

    aioparamsync-node --port 9090 &
    AIOPARAMSYNC_ADDRESSES=127.0.0.1:9090 torchrun --standalone --nproc-per-node 2 \\
        examples/torchrun_train.py
    kill %1

torchrun gives each worker ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``;
:class:`aioparamsync.torch.Launch` reads them, and ``AIOPARAMSYNC_ADDRESSES``
(in Kubernetes: the nodes' Service name), so the script has no flags of its
own. No process group is made: the nodes are how the workers share the model.

What it does: rank 0 stores a linear regression model (``torch.nn.Linear``)
on the nodes with the rule ``sgd(lr)``, unless it is there already (a
restarted job goes on from it); every worker waits at a barrier for that,
then, for ``STEPS`` steps, loads the model from the nodes (``load_into``),
computes the loss of a mini-batch of its own shard of the data (all of it made
from one seed, so nothing is sent), and pushes the gradients (``push_grads``),
which the nodes fold in. Once every worker is done (a barrier), rank 0 prints
the loss of the full data, and with ``AIOPARAMSYNC_EXAMPLE_SHUTDOWN=1`` stops
the cluster after a snapshot, so a Kubernetes Job of workers ends the nodes.
"""

from __future__ import annotations

import asyncio
import os

import torch

from aioparamsync import sgd
from aioparamsync import torch as ps_torch

FEATURES = 8
SAMPLES = 1024
STEPS = 60
BATCH = 64
LR = 0.1
PREFIX = "torchrun."


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The same data in every worker: y = X @ w + b plus a little noise."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 1, generator=generator)
    y = x @ w + 0.5 + 0.01 * torch.randn(SAMPLES, 1, generator=generator)
    return x, y


async def main() -> float:
    launch = ps_torch.Launch.from_env()
    x, y = data()
    shard = torch.arange(launch.rank, SAMPLES, launch.world_size)
    model = torch.nn.Linear(FEATURES, 1)
    loss_of = torch.nn.MSELoss()
    generator = torch.Generator().manual_seed(1 + launch.rank)
    async with launch.client(timeout=30) as client:
        if launch.is_first and not await client.get_arrays([f"{PREFIX}weight"]):
            with torch.no_grad():
                model.weight.zero_()
                model.bias.zero_()
            await ps_torch.push_state_dict(client, model, prefix=PREFIX, rule=sgd(LR))
        await launch.barrier(client, "torchrun-start", 0)
        for _ in range(STEPS):
            await ps_torch.load_into(client, model, prefix=PREFIX)
            batch = shard[torch.randint(len(shard), (BATCH,), generator=generator)]
            model.zero_grad()
            loss_of(model(x[batch]), y[batch]).backward()
            await ps_torch.push_grads(client, model, prefix=PREFIX)
        await launch.barrier(client, "torchrun-done", 1)
        await ps_torch.load_into(client, model, prefix=PREFIX)
        with torch.no_grad():
            loss = float(loss_of(model(x), y))
        if launch.is_first:
            print(f"rank 0 of {launch.world_size}: full-data loss {loss:.6f}", flush=True)
            if os.environ.get("AIOPARAMSYNC_EXAMPLE_SHUTDOWN", "") == "1":
                result = await client.shutdown_cluster(snapshot=True)
                print(f"rank 0: {result.stopping} nodes stopping", flush=True)
    return loss


if __name__ == "__main__":
    asyncio.run(main())
